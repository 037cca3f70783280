//! Diagnosis of a failed gate: which known failure mode explains the engine's output.
//!
//! Every failure-mode contract with a `mutant` names a known-wrong variant of the oracle
//! (`oracle::mutants`). When a kernel fails its test, the server recomputes the expected output of
//! each mutant of that kernel's failure modes on the same drawn inputs; when generation fails, it
//! reruns the reference forward pass with each model-level mutation on the engine's own tokens. A
//! mutant that reproduces the engine's output while the true oracle does not is reported as a
//! [`Diagnosis`]: the failure id and the evidence. No mutant explaining it: no diagnosis.

use std::collections::HashMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::kernel_test::UNWRITTEN;
use crate::ckb::{Ckb, Contract, Kind, Tolerance};
use crate::oracle::llama::Reference;
use crate::oracle::mutants::{self, Mutation, Mutations};
use crate::oracle::{AttnShape, widen};

/// A failure mode that explains a failed gate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Diagnosis {
    /// Failure-mode contract id, e.g. `failure.rope-adjacent-pairs` (see lookup_contract).
    pub failure: String,
    /// The oracle mutant that reproduces the engine's output, e.g. `rope_adjacent`.
    pub mutant: String,
    /// Largest |engine - true oracle| over the compared cases or logit rows ([`UNWRITTEN`] for
    /// NaN/inf/missing output).
    pub error_vs_oracle: f64,
    /// Largest |engine - mutant| over the same cases or rows (0 where both are the same NaN/inf).
    pub error_vs_mutant: f64,
    /// The failure in one line: what is wrong and how to fix it.
    pub summary: String,
}

impl Diagnosis {
    /// One line for text reports.
    pub fn line(&self) -> String {
        format!(
            "diagnosis: {} (output matches mutant {}: max abs error {} vs it, {} vs the oracle). {}",
            self.failure,
            self.mutant,
            super::sci(self.error_vs_mutant),
            super::sci(self.error_vs_oracle),
            self.summary
        )
    }
}

fn diagnosis(c: &Contract, mutant: &str, error_vs_oracle: f64, error_vs_mutant: f64) -> Diagnosis {
    let fix = c.failure.as_ref().map(|f| f.fix.as_str()).unwrap_or_default();
    let summary = format!("{} Fix: {fix}", c.summary).split_whitespace().collect::<Vec<_>>().join(" ");
    let finite = |x: f64| if x.is_finite() { x.min(UNWRITTEN) } else { UNWRITTEN };
    Diagnosis {
        failure: c.id.clone(),
        mutant: mutant.to_string(),
        error_vs_oracle: finite(error_vs_oracle),
        error_vs_mutant: finite(error_vs_mutant),
        summary,
    }
}

/// The failure contract whose `mutant` is `name`, if the CKB has one.
pub fn failure_of_mutant<'a>(ckb: &'a Ckb, name: &str) -> Option<&'a Contract> {
    ckb.of_kind(Kind::Failure).find(|c| c.failure.as_ref().and_then(|f| f.mutant.as_deref()) == Some(name))
}

/// Compare engine output with a mutant's expected values at a tolerance, as
/// [`super::kernel_test::compare`] does, except that an engine value that is non-finite in the same
/// way as the mutant's (both NaN, or the same infinity) counts as a match: mutants such as
/// `softmax_no_max` predict NaN. Returns (max abs error, all within).
pub fn compare_mutant(got: &[f32], want: &[f64], tol: &Tolerance) -> (f64, bool) {
    let mut ok = got.len() == want.len();
    let mut max = if ok { 0.0f64 } else { UNWRITTEN };
    for (g, w) in got.iter().zip(want) {
        let g = *g as f64;
        let err = if g.is_finite() && w.is_finite() {
            (g - w).abs().min(UNWRITTEN)
        } else if (g.is_nan() && w.is_nan()) || g == *w {
            0.0
        } else {
            UNWRITTEN
        };
        if err == UNWRITTEN || err > tol.atol + tol.rtol * w.abs() {
            ok = false;
        }
        max = max.max(err);
    }
    (max, ok)
}

/// One case of a kernel test as the diagnosis needs it: the drawn inputs, the engine's output and
/// how it fared against the true oracle.
pub struct KernelCase<'a> {
    /// f32 inputs by name, as written for the engine.
    pub f32s: &'a [(String, Vec<f32>)],
    /// u32 inputs by name.
    pub u32s: &'a [(String, Vec<u32>)],
    /// 16-bit float inputs as bit patterns: (name, bits, whether bf16 (else IEEE binary16)).
    pub halves: &'a [(String, Vec<u16>, bool)],
    /// int8 inputs.
    pub i8s: &'a [(String, Vec<i8>)],
    /// Scalar parameters as text, as written for the engine.
    pub params: &'a HashMap<String, String>,
    /// The engine's output tensor `out` as raw words (f32 bits, or the index for argmax).
    pub out: &'a [u32],
    /// Whether the output was within tolerance of the true oracle.
    pub oracle_ok: bool,
    /// Its largest absolute error against the true oracle.
    pub oracle_err: f64,
}

/// What a mutant expects on one case.
pub enum MutantOut {
    /// Element values.
    Values(Vec<f64>),
    /// An index (argmax).
    Index(usize),
}

impl KernelCase<'_> {
    fn f(&self, name: &str) -> Option<Vec<f64>> {
        self.f32s.iter().find(|(n, _)| n == name).map(|(_, v)| widen(v))
    }
    fn u(&self, name: &str) -> Option<&[u32]> {
        self.u32s.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice())
    }
    fn p<T: std::str::FromStr>(&self, name: &str) -> Option<T> {
        self.params.get(name)?.parse().ok()
    }
    fn attn_shape(&self) -> Option<AttnShape> {
        Some(AttnShape {
            n_q: self.p("n_q")?,
            kv_len: self.p("kv_len")?,
            n_heads: self.p("n_heads")?,
            n_kv_heads: self.p("n_kv_heads")?,
            head_dim: self.p("head_dim")?,
        })
    }
}

/// What `mutant` expects on a case of `kernel`; `None` when the mutant is not a variant of that
/// kernel or the case lacks an input it needs. Parameters are parsed the way the engine receives them
/// (f32 text), so the mutant sees the same values as the true oracle did.
pub fn kernel_mutant(kernel: &str, mutant: &str, c: &KernelCase) -> Option<MutantOut> {
    let v = MutantOut::Values;
    Some(match (kernel, mutant) {
        ("kernel.rope", "rope_adjacent" | "rope_theta_default") => {
            let mut x = c.f("x")?;
            let pos: Vec<usize> = c.u("positions")?.iter().map(|&p| p as usize).collect();
            let (nh, hd, theta) = (c.p("n_heads")?, c.p("head_dim")?, c.p::<f32>("theta")? as f64);
            if mutant == "rope_adjacent" {
                mutants::rope_adjacent(&mut x, &pos, nh, hd, theta);
            } else {
                mutants::rope_theta_default(&mut x, &pos, nh, hd, theta);
            }
            v(x)
        }
        ("kernel.rms_norm", "rmsnorm_eps_outside") => {
            v(mutants::rms_norm_eps_outside(&c.f("x")?, &c.f("weight")?, c.p::<f32>("eps")? as f64))
        }
        ("kernel.rms_norm", "rmsnorm_no_weight") => {
            v(mutants::rms_norm_no_weight(&c.f("x")?, &c.f("weight")?, c.p::<f32>("eps")? as f64))
        }
        ("kernel.linear", "linear_xw") => {
            v(mutants::linear_xw(&c.f("x")?, &c.f("w")?, c.p("m")?, c.p("k")?, c.p("n")?))
        }
        ("kernel.linear_bf16" | "kernel.linear_f16", "half_format_swapped") => {
            let (_, bits, bf16) = c.halves.iter().find(|(n, _, _)| n == "w")?;
            v(mutants::half_format_swapped(&c.f("x")?, bits, c.p("m")?, c.p("k")?, c.p("n")?, *bf16))
        }
        ("kernel.linear_bf16", "bf16_accumulation") => {
            let (_, bits, _) = c.halves.iter().find(|(n, _, _)| n == "w")?;
            v(mutants::bf16_accumulation(&c.f("x")?, bits, c.p("m")?, c.p("k")?, c.p("n")?))
        }
        ("kernel.linear_int8", "int8_scale_missing") => {
            let (_, q) = c.i8s.iter().find(|(n, _)| n == "w")?;
            v(mutants::int8_scale_missing(&c.f("x")?, q, c.p("m")?, c.p("k")?, c.p("n")?))
        }
        ("kernel.gelu_tanh_and_mul", "gelu_erf") => v(mutants::gelu_erf(&c.f("gate")?, &c.f("up")?)),
        ("kernel.silu_and_mul", "silu_swapped") => v(mutants::silu_swapped(&c.f("gate")?, &c.f("up")?)),
        ("kernel.softmax", "softmax_no_max") => v(mutants::softmax_no_max(&c.f("x")?, c.p("n")?)),
        ("kernel.attention", "gqa_modulo") => {
            v(mutants::gqa_modulo(&c.f("q")?, &c.f("k_cache")?, &c.f("v_cache")?, c.attn_shape()?))
        }
        ("kernel.attention", "attention_no_mask") => {
            v(mutants::attention_no_mask(&c.f("q")?, &c.f("k_cache")?, &c.f("v_cache")?, c.attn_shape()?))
        }
        ("kernel.attention", "attention_no_scale") => {
            v(mutants::attention_no_scale(&c.f("q")?, &c.f("k_cache")?, &c.f("v_cache")?, c.attn_shape()?))
        }
        ("kernel.argmax", "argmax_last") => {
            let x = c.f("x")?;
            if x.is_empty() {
                return None;
            }
            MutantOut::Index(mutants::argmax_last(&x))
        }
        ("kernel.embedding", "embedding_off_by_one") => {
            let dim: usize = c.p("dim")?;
            if dim == 0 {
                return None;
            }
            v(mutants::embedding_off_by_one(&c.f("table")?, dim, c.u("ids")?))
        }
        _ => return None,
    })
}

/// Diagnose a failed kernel. `cases` are the cases where the engine produced an output (cases that
/// panicked or wrote nothing are left out: they say nothing about which formula the engine computes).
///
/// Rule: a failure mode of the kernel contract (its `failure_modes`) explains the failure when its
/// mutant exists for this kernel, the engine's output is within the contract's tolerance of the
/// mutant on every case, and on at least one of them it is outside the tolerance of the true
/// oracle. Several can be reported (best match first); none when nothing explains the output.
pub fn kernel(ckb: &Ckb, contract: &Contract, cases: &[KernelCase], tol: &Tolerance) -> Vec<Diagnosis> {
    if cases.is_empty() || cases.iter().all(|c| c.oracle_ok) {
        return vec![];
    }
    let mut found = Vec::new();
    for fid in &contract.failure_modes {
        let Ok(fc) = ckb.get(fid) else { continue };
        let Some(mutant) = fc.failure.as_ref().and_then(|f| f.mutant.as_deref()) else { continue };
        if !mutants::mutant_exists(mutant) {
            continue;
        }
        let (mut err_m, mut err_o, mut all_ok) = (0.0f64, 0.0f64, true);
        for c in cases {
            let (err, ok) = match kernel_mutant(&contract.id, mutant, c) {
                None => {
                    all_ok = false;
                    break;
                }
                Some(MutantOut::Values(want)) => {
                    let got: Vec<f32> = c.out.iter().map(|&b| f32::from_bits(b)).collect();
                    compare_mutant(&got, &want, tol)
                }
                Some(MutantOut::Index(want)) => {
                    let ok = c.out.first().map(|&g| g as usize) == Some(want);
                    (if ok { 0.0 } else { 1.0 }, ok)
                }
            };
            all_ok &= ok;
            err_m = err_m.max(err);
            err_o = err_o.max(c.oracle_err);
        }
        if all_ok {
            found.push(diagnosis(fc, mutant, err_o, err_m));
        }
    }
    found.sort_by(|a, b| a.error_vs_mutant.total_cmp(&b.error_vs_mutant));
    found
}

/// Logit rows compared when diagnosing generation: enough to see any of the model-level mutants
/// (they all change the logits within the first few positions), few enough that a large model's f64
/// reference forward, rerun once per mutation, stays affordable.
pub const GENERATION_ROWS: usize = 8;

/// Whether a model-level mutation can change this model's logits at all (a mutation that computes
/// exactly the true forward pass for this config cannot be told apart and is not tried).
fn distinguishable(m: Mutation, r: &Reference) -> bool {
    let c = r.config();
    match m {
        Mutation::RopeThetaDefault => c.rope_theta != mutants::DEFAULT_THETA,
        Mutation::GqaModulo => c.n_kv_heads > 1 && c.n_kv_heads < c.n_heads,
        _ => true,
    }
}

/// Run the reference (with mutations `m`) teacher-forced over `ids` then `tokens`, comparing each
/// logit row with the engine's as it goes: (largest error, every row within tolerance, largest
/// |logit| of the reference). Stops early, with what it has, once a row is outside tolerance and
/// the error exceeds `give_up`: such a mutant can no longer explain the engine. `None` when the
/// reference refuses a token or position.
fn run_forced(
    reference: &mut Reference,
    m: Mutations,
    ids: &[u32],
    tokens: &[u32],
    logits: &[f32],
    tol: &Tolerance,
    give_up: f64,
) -> Option<(f64, bool, f64)> {
    let vocab = reference.config().vocab;
    reference.set_mutations(m);
    let mut row = Vec::new();
    for &t in ids {
        row = reference.step(t).ok()?;
    }
    let (mut max, mut ok, mut scale) = (0.0f64, true, 0.0f64);
    for (i, &t) in tokens.iter().enumerate() {
        let got = logits.get(i * vocab..(i + 1) * vocab)?;
        let (e, o) = compare_mutant(got, &row, tol);
        max = max.max(e);
        ok &= o;
        scale = row.iter().fold(scale, |a, v| a.max(v.abs()));
        if (!ok && max > give_up) || i + 1 == tokens.len() {
            break;
        }
        row = reference.step(t).ok()?;
    }
    Some((max, ok, scale))
}

/// Diagnose failing logits of one prompt. `ids` are the engine's prompt ids, `tokens` its generated
/// tokens and `logits` its rows (`vocab` values per generated token). The reference is run
/// teacher-forced on the engine's own tokens (so a divergence in choices does not matter), first as
/// it is and then with each model-level mutation, over the first [`GENERATION_ROWS`] rows.
///
/// Rule: with e_ref the largest |engine - reference| logit error and e_m the one against mutation m,
/// m explains the failure when e_ref is outside the family tolerance and either every compared
/// logit is within the tolerance of the mutant, or e_m <= e_ref / 10 and e_m is within ten times
/// the tolerance (e_m <= 10 (atol + rtol max|mutant logit|)), which allows for an engine whose
/// mistake is the mutant's in substance but accumulates differently. Only mutations with a failure
/// contract in the CKB, and that can change this model's logits, are tried. Best match first; empty
/// when the reference itself matches the engine on its own tokens (e.g. a tokenizer mistake) or no
/// mutation explains the logits. The reference is left as it was given (mutations and all).
pub fn generation(
    ckb: &Ckb,
    reference: &mut Reference,
    ids: &[u32],
    tokens: &[u32],
    logits: &[f32],
    tol: &Tolerance,
) -> Vec<Diagnosis> {
    let vocab = reference.config().vocab;
    let n = tokens.len().min(logits.len() / vocab.max(1)).min(GENERATION_ROWS);
    if n == 0 || ids.is_empty() || ids.iter().chain(&tokens[..n]).any(|&t| t as usize >= vocab) {
        return vec![];
    }
    let (ids, tokens, logits) = (ids, &tokens[..n], &logits[..n * vocab]);
    let before = reference.mutations();
    let mut found = Vec::new();
    if let Some((e_ref, false, _)) = run_forced(reference, Mutations::NONE, ids, tokens, logits, tol, f64::INFINITY) {
        for m in Mutation::ALL {
            let Some(fc) = failure_of_mutant(ckb, m.name()) else { continue };
            if !distinguishable(m, reference) {
                continue;
            }
            let mutant = Mutations::of(&[m]);
            let Some((e_m, ok, scale)) = run_forced(reference, mutant, ids, tokens, logits, tol, e_ref / 10.0) else {
                continue;
            };
            let near = e_m * 10.0 <= e_ref && e_m <= 10.0 * (tol.atol + tol.rtol * scale);
            if ok || near {
                found.push(diagnosis(fc, m.name(), e_ref, e_m));
            }
        }
    }
    reference.set_mutations(before);
    found.sort_by(|a, b| a.error_vs_mutant.total_cmp(&b.error_vs_mutant));
    found
}
