//! The one comparator: an engine's output against expected values at a contract tolerance, for
//! kernel tests, generation logits and diagnosis alike.
//!
//! An element is within tolerance when `|got - want| <= atol + rtol |want|` (numpy's `isclose`
//! rule). A gate's comparison ([`compare`], [`judge`]) fails on any non-finite value on either
//! side and says where the first one is ([`Verdict::non_finite`]): output buffers start as NaN, so
//! an unwritten element fails, and a reference that computes NaN or an infinity (weights that
//! overflow the engine's dtype, say) proves nothing about the engine, so two NaNs never agree.
//! Diagnosis compares an engine with a known-wrong variant's *prediction* instead
//! ([`compare_prediction`], [`judge_prediction`]): mutants such as `softmax_no_max` predict NaN, and
//! an engine that computes that NaN matches them.

use serde::{Deserialize, Serialize};

use super::kernels::Expect;
use ckb::Tolerance;

/// The error reported for an output element that is NaN, infinite or missing where a finite value
/// was expected (JSON has no infinity, so the largest finite f64 stands for it).
pub const UNWRITTEN: f64 = f64::MAX;

/// Which side of a comparison held a non-finite value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Side {
    /// The engine's output.
    Engine,
    /// The expected value (the oracle's or the reference's).
    Expected,
}

/// The first non-finite value a comparison met.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct NonFinite {
    /// Flat index of the element.
    pub index: usize,
    /// Which side held it (the engine's side is named when both did).
    pub side: Side,
    /// `NaN`, `inf` or `-inf`.
    pub value: &'static str,
}

impl NonFinite {
    /// `NaN in the engine's output at index 17`, for messages.
    pub fn describe(&self) -> String {
        let side = match self.side {
            Side::Engine => "the engine's output",
            Side::Expected => "the expected values (the oracle's or reference's own computation)",
        };
        format!("{} in {side} at index {}", self.value, self.index)
    }
}

fn kind(v: f64) -> &'static str {
    if v.is_nan() {
        "NaN"
    } else if v > 0.0 {
        "inf"
    } else {
        "-inf"
    }
}

/// The outcome of one comparison.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// Largest |got - want| ([`UNWRITTEN`] for a wrong length or a non-finite value).
    pub max_abs_err: f64,
    /// Largest |got - want| / max(|want|, 1e-30), same convention.
    pub max_rel_err: f64,
    /// Flat index of the element furthest outside its tolerance (for an index output, the index
    /// the engine returned; for a wrong length, the first missing or extra element).
    pub worst_index: usize,
    /// Whether the lengths agree and every element is finite and within tolerance.
    pub ok: bool,
    /// The first non-finite value on either side, if any (a gate's comparison then fails).
    #[serde(default, skip_serializing_if = "Option::is_none", skip_deserializing)]
    pub non_finite: Option<NonFinite>,
}

/// Compare values for a gate: `got` [n] against `want` [n] at `tol`; any non-finite value on
/// either side fails and is named in [`Verdict::non_finite`].
pub fn compare(got: &[f32], want: &[f64], tol: &Tolerance) -> Verdict {
    compare_with(got, want, tol, false)
}

/// Compare an engine's values with a known-wrong variant's prediction (diagnosis): as [`compare`],
/// except that a non-finite prediction matched by the same non-finite value (both NaN, or the same
/// infinity) counts as no error.
pub fn compare_prediction(got: &[f32], want: &[f64], tol: &Tolerance) -> Verdict {
    compare_with(got, want, tol, true)
}

fn compare_with(got: &[f32], want: &[f64], tol: &Tolerance, prediction: bool) -> Verdict {
    let (mut max_abs, mut max_rel, mut worst, mut worst_excess) = (0.0f64, 0.0f64, 0usize, f64::NEG_INFINITY);
    let mut ok = true;
    let mut non_finite = None;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (*g as f64, *w);
        let err = if g.is_finite() && w.is_finite() {
            (g - w).abs().min(UNWRITTEN)
        } else if prediction && ((g.is_nan() && w.is_nan()) || g == w) {
            0.0
        } else {
            if non_finite.is_none() {
                non_finite = Some(if !g.is_finite() {
                    NonFinite { index: i, side: Side::Engine, value: kind(g) }
                } else {
                    NonFinite { index: i, side: Side::Expected, value: kind(w) }
                });
            }
            UNWRITTEN
        };
        let rel = if err == UNWRITTEN { UNWRITTEN } else { (err / w.abs().max(1e-30)).min(UNWRITTEN) };
        let excess = if err == UNWRITTEN { UNWRITTEN } else { err - (tol.atol + tol.rtol * w.abs()) };
        if excess > 0.0 {
            ok = false;
        }
        if excess > worst_excess {
            worst_excess = excess;
            worst = i;
        }
        max_abs = max_abs.max(err);
        max_rel = max_rel.max(if rel.is_nan() { 0.0 } else { rel });
    }
    if got.len() != want.len() {
        return Verdict {
            max_abs_err: UNWRITTEN,
            max_rel_err: UNWRITTEN,
            worst_index: got.len().min(want.len()),
            ok: false,
            non_finite,
        };
    }
    Verdict { max_abs_err: max_abs, max_rel_err: max_rel, worst_index: worst, ok, non_finite }
}

/// Compare a kernel's output tensor `out`, read back as raw little-endian words (f32 bits, or the
/// u32 index of an argmax), with what the oracle expects, for a gate ([`compare`]'s rule: any
/// non-finite value fails). An index is right or wrong: error 0 or 1.
pub fn judge(out: &[u32], want: &Expect, tol: &Tolerance) -> Verdict {
    judge_with(out, want, tol, false)
}

/// [`judge`] against a known-wrong variant's prediction ([`compare_prediction`]'s rule).
pub fn judge_prediction(out: &[u32], want: &Expect, tol: &Tolerance) -> Verdict {
    judge_with(out, want, tol, true)
}

fn judge_with(out: &[u32], want: &Expect, tol: &Tolerance, prediction: bool) -> Verdict {
    match want {
        Expect::Values(w) => {
            let got: Vec<f32> = out.iter().map(|&b| f32::from_bits(b)).collect();
            compare_with(&got, w, tol, prediction)
        }
        Expect::Index(w) => {
            let g = out.first().map(|&v| v as usize).unwrap_or(usize::MAX);
            let e = if g == *w && out.len() == 1 { 0.0 } else { 1.0 };
            Verdict { max_abs_err: e, max_rel_err: e, worst_index: g, ok: e == 0.0, non_finite: None }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tol(atol: f64, rtol: f64) -> Tolerance {
        Tolerance { atol, rtol, reasoning: String::new() }
    }

    #[test]
    fn isclose_rule_worst_element_and_sentinels() {
        // |1.1 - 1| = 0.1 <= 0.05 + 0.1 * 1; |2.5 - 2| = 0.5 > 0.05 + 0.2.
        let v = compare(&[1.1, 2.5], &[1.0, 2.0], &tol(0.05, 0.1));
        assert!(!v.ok);
        assert_eq!(v.worst_index, 1);
        assert!((v.max_abs_err - 0.5).abs() < 1e-6 && (v.max_rel_err - 0.25).abs() < 1e-6);
        assert!(compare(&[1.1, 2.2], &[1.0, 2.0], &tol(0.05, 0.1)).ok);
        // An unwritten (NaN sentinel) element is the largest error.
        let v = compare(&[1.0, f32::NAN], &[1.0, 2.0], &tol(1.0, 1.0));
        assert!(!v.ok && v.max_abs_err == UNWRITTEN && v.worst_index == 1);
        assert_eq!(v.non_finite, Some(NonFinite { index: 1, side: Side::Engine, value: "NaN" }));
        // For a gate, two NaNs (or two equal infinities) never agree: a reference that computes NaN
        // proves nothing, and the expected side is named when only it is non-finite.
        let v = compare(&[f32::NAN, 1.0], &[f64::NAN, 1.0], &tol(0.0, 0.0));
        assert!(!v.ok && v.max_abs_err == UNWRITTEN);
        assert!(!compare(&[f32::INFINITY], &[f64::INFINITY], &tol(0.0, 0.0)).ok);
        let v = compare(&[1.0, 2.0], &[1.0, f64::NEG_INFINITY], &tol(1.0, 1.0));
        assert_eq!(v.non_finite, Some(NonFinite { index: 1, side: Side::Expected, value: "-inf" }));
        assert!(v.non_finite.unwrap().describe().starts_with("-inf in the expected values"));
        // A predicted NaN matched by a NaN is no error (mutants, in diagnosis).
        assert!(compare_prediction(&[f32::NAN, 1.0], &[f64::NAN, 1.0], &tol(0.0, 0.0)).ok);
        assert!(compare_prediction(&[f32::INFINITY], &[f64::INFINITY], &tol(0.0, 0.0)).ok);
        assert!(!compare_prediction(&[f32::NEG_INFINITY], &[f64::INFINITY], &tol(0.0, 0.0)).ok);
        // A finite value where the prediction is NaN is still an error.
        assert!(!compare_prediction(&[1.0], &[f64::NAN], &tol(1.0, 1.0)).ok);
        // A wrong length fails whatever the values.
        let v = compare(&[1.0], &[1.0, 2.0], &tol(1.0, 1.0));
        assert!(!v.ok && v.max_abs_err == UNWRITTEN && v.worst_index == 1);
    }

    #[test]
    fn judge_reads_values_and_indices() {
        let t = tol(0.0, 0.0);
        assert!(judge(&[2.0f32.to_bits()], &Expect::Values(vec![2.0]), &t).ok);
        assert!(judge(&[3], &Expect::Index(3), &t).ok);
        let v = judge(&[4], &Expect::Index(3), &t);
        assert!(!v.ok && v.worst_index == 4 && v.max_abs_err == 1.0);
        assert!(!judge(&[], &Expect::Index(0), &t).ok);
        let nan = [f32::NAN.to_bits()];
        assert!(!judge(&nan, &Expect::Values(vec![f64::NAN]), &t).ok);
        assert!(judge_prediction(&nan, &Expect::Values(vec![f64::NAN]), &t).ok);
    }
}
