//! The one comparator: an engine's output against expected values at a contract tolerance, for
//! kernel tests, generation logits and diagnosis alike.
//!
//! An element is within tolerance when `|got - want| <= atol + rtol |want|` (numpy's `isclose`
//! rule). An engine value that is non-finite where a finite value is expected counts as the largest
//! error, [`UNWRITTEN`]: output buffers start as NaN, so an unwritten element fails. A non-finite
//! value that matches a non-finite expectation (both NaN, or the same infinity) counts as no error:
//! mutants such as `softmax_no_max` predict NaN; the true oracle never does.

use serde::{Deserialize, Serialize};

use super::kernels::Expect;
use crate::ckb::Tolerance;

/// The error reported for an output element that is NaN, infinite or missing where a finite value
/// was expected (JSON has no infinity, so the largest finite f64 stands for it).
pub const UNWRITTEN: f64 = f64::MAX;

/// The outcome of one comparison.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// Largest |got - want| ([`UNWRITTEN`] for a wrong length or an unexpected non-finite value).
    pub max_abs_err: f64,
    /// Largest |got - want| / max(|want|, 1e-30), same convention.
    pub max_rel_err: f64,
    /// Flat index of the element furthest outside its tolerance (for an index output, the index
    /// the engine returned; for a wrong length, the first missing or extra element).
    pub worst_index: usize,
    /// Whether the lengths agree and every element is within tolerance.
    pub ok: bool,
}

/// Compare values: `got` [n] against `want` [n] at `tol`.
pub fn compare(got: &[f32], want: &[f64], tol: &Tolerance) -> Verdict {
    let (mut max_abs, mut max_rel, mut worst, mut worst_excess) = (0.0f64, 0.0f64, 0usize, f64::NEG_INFINITY);
    let mut ok = true;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (*g as f64, *w);
        let err = if g.is_finite() && w.is_finite() {
            (g - w).abs().min(UNWRITTEN)
        } else if (g.is_nan() && w.is_nan()) || g == w {
            0.0
        } else {
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
        };
    }
    Verdict { max_abs_err: max_abs, max_rel_err: max_rel, worst_index: worst, ok }
}

/// Compare a kernel's output tensor `out`, read back as raw little-endian words (f32 bits, or the
/// u32 index of an argmax), with what the oracle or a mutant expects. An index is right or wrong:
/// error 0 or 1.
pub fn judge(out: &[u32], want: &Expect, tol: &Tolerance) -> Verdict {
    match want {
        Expect::Values(w) => {
            let got: Vec<f32> = out.iter().map(|&b| f32::from_bits(b)).collect();
            compare(&got, w, tol)
        }
        Expect::Index(w) => {
            let g = out.first().map(|&v| v as usize).unwrap_or(usize::MAX);
            let e = if g == *w && out.len() == 1 { 0.0 } else { 1.0 };
            Verdict { max_abs_err: e, max_rel_err: e, worst_index: g, ok: e == 0.0 }
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
        // A predicted NaN matched by a NaN is no error (mutants).
        assert!(compare(&[f32::NAN, 1.0], &[f64::NAN, 1.0], &tol(0.0, 0.0)).ok);
        assert!(compare(&[f32::INFINITY], &[f64::INFINITY], &tol(0.0, 0.0)).ok);
        assert!(!compare(&[f32::NEG_INFINITY], &[f64::INFINITY], &tol(0.0, 0.0)).ok);
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
    }
}
