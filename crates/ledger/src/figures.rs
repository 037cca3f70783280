//! What each tool records beside its verdict: the ledger's `figures` column, typed per tool.
//!
//! Writers build one of these structs; readers parse the stored JSON back with [`Figures::read`],
//! which tolerates rows written by older versions (every field has a default) and never guesses a
//! figure that was not recorded. The JSON shape is the struct's fields, without a tag: the tool
//! name of the outcome says which struct it is.

use serde::{Deserialize, Serialize};

use base::stats::Spread;

fn is_false(b: &bool) -> bool {
    !*b
}

/// What every gate records: whether it was stopped before the engine ran, and at which dtype and
/// seed it ran.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GateFigures {
    /// Stopped by a blocking rule finding before anything was built.
    #[serde(skip_serializing_if = "is_false")]
    pub blocked: bool,
    /// Stopped because the engine did not build with the harness.
    #[serde(skip_serializing_if = "is_false")]
    pub build_failed: bool,
    /// Weight dtype the engine was built for.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub dtype: String,
    /// Seed of the drawn inputs, when the gate draws any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Nothing ran: the engine needs a device (CUDA) this machine does not have.
    #[serde(skip_serializing_if = "is_false")]
    pub no_device: bool,
    /// The gate ran on part of what the engine's plan covers (a kernel test limited to some
    /// kernels): evidence for those, never for phase order ([`crate::Ledger::passed_on`]).
    #[serde(skip_serializing_if = "is_false")]
    pub partial: bool,
    /// The bundle whose run on another machine this outcome judges ("" for a direct run).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub bundle: String,
    /// For a bundle: `runner <name>` when a trusted runner signed the run
    /// (`harness::attest`), else `unattested: <why>` (shown and counted, never evidence).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub attestation: String,
}

/// How [`GateFigures::attestation`] begins for a run a trusted runner signed.
pub const ATTESTED_PREFIX: &str = "runner ";

/// `compile_engine`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CompileFigures {
    /// Stopped by rules.
    #[serde(flatten)]
    pub gate: GateFigures,
    /// Compiler errors.
    pub errors: usize,
    /// Compiler warnings.
    pub warnings: usize,
    /// Build time, seconds.
    pub seconds: f64,
    /// Error codes on the returned page (e.g. `E0308`).
    pub codes: Vec<String>,
    /// Contracts the diagnostics were tied to.
    pub hinted: Vec<String>,
}

/// One kernel's verdict in `run_kernel_test`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct KernelFigure {
    /// Kernel contract id.
    pub id: String,
    /// Whether every case was within tolerance.
    pub passed: bool,
    /// Largest absolute error.
    pub max_abs_err: f64,
    /// Failure contracts whose mutant explains it.
    pub diagnosis: Vec<String>,
    /// The kernel is not written yet: it panicked with the scaffold's `todo!()` (Rust's message
    /// "not yet implemented") or an `unimplemented!()` ("not implemented"). No attempt at its
    /// contract: it counts in no rate and clusters into no candidate.
    #[serde(skip_serializing_if = "is_false")]
    pub unwritten: bool,
    /// Why it failed other than by its numbers (a panic, a missing or misshapen output), cut to
    /// [`KERNEL_ERROR_CHARS`] characters; "" when its numbers were judged.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub error: String,
}

/// The most characters of a kernel's error kept in [`KernelFigure::error`].
pub const KERNEL_ERROR_CHARS: usize = 200;

impl KernelFigure {
    /// Whether a kernel's error says its body was never written: the panic messages of `todo!()`
    /// ("not yet implemented") and `unimplemented!()` ("not implemented"), from the Rust standard
    /// library's documentation of the two macros.
    pub fn is_unwritten(error: &str) -> bool {
        error.contains("not yet implemented") || error.contains("not implemented")
    }
}

/// `run_kernel_test`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct KernelTestFigures {
    /// Common gate figures.
    #[serde(flatten)]
    pub gate: GateFigures,
    /// Per kernel.
    pub kernels: Vec<KernelFigure>,
}

/// `verify_generation`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct VerifyFigures {
    /// Common gate figures.
    #[serde(flatten)]
    pub gate: GateFigures,
    /// Largest logit error over the prompts.
    pub max_abs_err: f64,
    /// Prompts checked.
    pub prompts: usize,
    /// Failure contracts whose mutated reference explains the logits.
    pub diagnosis: Vec<String>,
    /// Where the first failing prompt went wrong: `tokenizer` (ids differ from HF's), `prefill` or
    /// `decode` (the first step whose logits are beyond tolerance), `tokens` (a token differs with
    /// the logits within tolerance), `stop` (stop tokens or EOS), `crash` (no output); empty when
    /// every prompt passed or in rows written before this field.
    pub divergence: String,
    /// The graph node where the traced rerun of the failing step first left the reference
    /// (`q_norm`, `attn`, `logits`; the layer left out, so one bug in every layer is one point);
    /// empty when not localised.
    pub point: String,
}

/// `profile_engine`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ProfileFigures {
    /// Common gate figures.
    #[serde(flatten)]
    pub gate: GateFigures,
    /// Model directory profiled.
    pub model: String,
    /// Threads the engine ran with.
    pub threads: usize,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Tokens decoded per run.
    pub new_tokens: usize,
    /// Weight bytes streamed per decoded token.
    pub bytes_per_token: f64,
    /// Decode tokens/s over the runs.
    pub decode: Spread,
    /// Decode tokens/s, median.
    pub decode_tok_s: f64,
    /// Prefill tokens/s, median.
    pub prefill_tok_s: f64,
    /// Bandwidth bound on decode, tokens/s.
    pub roofline_decode_tok_s: f64,
    /// Compute bound on decode, tokens/s.
    pub compute_bound_tok_s: f64,
    /// The kernel bounding decode.
    pub bounding_kernel: String,
    /// Slower than the previous profile beyond the noise.
    pub regression: bool,
    /// The timed runs generated the reference's tokens.
    pub outputs_ok: bool,
    /// verify_generation had passed on the same sources.
    pub verified: bool,
}

/// `verify_batching`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BatchingFigures {
    /// Common gate figures.
    #[serde(flatten)]
    pub gate: GateFigures,
    /// The block manager's answers all matched.
    pub block_manager_ok: bool,
    /// Block-manager violations reported (at most 8).
    pub violations: usize,
    /// The scheduler's plans and events all kept the invariants (false in rows before the test).
    pub scheduler_ok: bool,
    /// Preemptions the scheduler made in its trace.
    pub preemptions: usize,
    /// Sequences in the batched run.
    pub sequences: usize,
    /// Sequences equal to their single-sequence reference.
    pub sequences_ok: usize,
    /// Steps of the batched run.
    pub steps: usize,
    /// Largest logit error over the sequences.
    pub max_abs_err: f64,
}

/// `serve_engine`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ServeFigures {
    /// Common gate figures.
    #[serde(flatten)]
    pub gate: GateFigures,
    /// Conformance checks run.
    pub checks: usize,
    /// Conformance checks passed.
    pub checks_ok: usize,
    /// Concurrency of each load level.
    pub concurrency: Vec<usize>,
    /// Output tokens per second at each level (this machine, its load at the time).
    pub output_tokens_per_s: Vec<f64>,
    /// Time to first token, p99, milliseconds, at each level.
    pub ttft_ms_p99: Vec<f64>,
    /// Load-test completions that differ from the reference's greedy text.
    pub greedy_mismatches: usize,
}

/// `check_rules`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RulesFigures {
    /// Rule ids of the findings.
    pub findings: Vec<String>,
    /// Files not examined.
    pub skipped: usize,
}

/// `plan_engine`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PlanFigures {
    /// Model-family contract routed to ("" when none).
    pub family: String,
    /// Config fields not covered.
    pub gaps: Vec<String>,
}

/// `ckb_conformance`: one family's reference against an independent implementation's vectors.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ConformanceFigures {
    /// The directory checked (checkpoint and vectors.json).
    pub dir: String,
    /// The implementation that wrote the vectors, e.g. `transformers 5.17.0 (Gemma3ForCausalLM)`.
    pub source: String,
    /// sha256 of vectors.json, hex: which numbers the family was held to.
    pub vectors_sha256: String,
    /// sha256 of the contract checked (its TOML as the CKB renders it), hex: the text this outcome is
    /// evidence for.
    pub contract_sha256: String,
    /// Logit rows compared (one per prompt position).
    pub positions: usize,
    /// Largest |reference - vectors| over every logit.
    pub max_abs_diff: f64,
    /// The bound each logit was held to: atol and rtol.
    pub bound: (f64, f64),
    /// (prompt, position) of the first logit beyond the bound; null when none.
    pub first_beyond: Option<(usize, usize)>,
    /// Whether the reference's greedy ids equal the vectors'.
    pub greedy_equal: bool,
}

/// `ckb_perplexity`: a family's reference on trained weights, against its own mutants.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PerplexityFigures {
    /// The checkpoint directory (trained weights).
    pub model: String,
    /// sha256 of the text's bytes, hex.
    pub text_sha256: String,
    /// Tokens scored (predictions: tokens - 1).
    pub tokens: usize,
    /// The reference's perplexity on the text.
    pub perplexity: f64,
    /// Uniform prediction's perplexity (the vocabulary size).
    pub uniform: f64,
    /// (mutant name, its perplexity) for every mutant tried.
    pub mutants: Vec<(String, f64)>,
    /// Whether the user consented to promotion on this weaker evidence.
    pub consent: bool,
    /// sha256 of the contract checked, hex (as [`ConformanceFigures::contract_sha256`]).
    pub contract_sha256: String,
}

/// The figures of one outcome, by tool.
#[derive(Debug, Clone, PartialEq)]
pub enum Figures {
    /// `compile_engine`.
    Compile(CompileFigures),
    /// `run_kernel_test`.
    KernelTest(KernelTestFigures),
    /// `verify_generation`.
    Verify(VerifyFigures),
    /// `profile_engine`.
    Profile(ProfileFigures),
    /// `verify_batching`.
    Batching(BatchingFigures),
    /// `serve_engine`.
    Serve(ServeFigures),
    /// `check_rules`.
    Rules(RulesFigures),
    /// `plan_engine`.
    Plan(PlanFigures),
    /// `ckb_conformance`.
    Conformance(ConformanceFigures),
    /// `ckb_perplexity`.
    Perplexity(PerplexityFigures),
    /// Any other tool: whatever it stored.
    Other(serde_json::Value),
}

impl Figures {
    /// The JSON stored in the ledger.
    pub fn to_json(&self) -> serde_json::Value {
        let v = match self {
            Figures::Compile(f) => serde_json::to_value(f),
            Figures::KernelTest(f) => serde_json::to_value(f),
            Figures::Verify(f) => serde_json::to_value(f),
            Figures::Profile(f) => serde_json::to_value(f),
            Figures::Batching(f) => serde_json::to_value(f),
            Figures::Serve(f) => serde_json::to_value(f),
            Figures::Rules(f) => serde_json::to_value(f),
            Figures::Plan(f) => serde_json::to_value(f),
            Figures::Conformance(f) => serde_json::to_value(f),
            Figures::Perplexity(f) => serde_json::to_value(f),
            Figures::Other(v) => Ok(v.clone()),
        };
        v.unwrap_or_else(|_| serde_json::json!({}))
    }

    /// Parse the stored JSON of an outcome of `tool`. A row that does not parse as its tool's
    /// struct (written by something else) becomes [`Figures::Other`].
    pub fn read(tool: &str, v: &serde_json::Value) -> Figures {
        fn parse<T: serde::de::DeserializeOwned>(v: &serde_json::Value, f: fn(T) -> Figures) -> Figures {
            serde_json::from_value(v.clone()).map(f).unwrap_or_else(|_| Figures::Other(v.clone()))
        }
        match tool {
            "compile_engine" => parse(v, Figures::Compile),
            "run_kernel_test" => parse(v, Figures::KernelTest),
            "verify_generation" => parse(v, Figures::Verify),
            "profile_engine" => parse(v, Figures::Profile),
            "verify_batching" => parse(v, Figures::Batching),
            "serve_engine" => parse(v, Figures::Serve),
            "check_rules" => parse(v, Figures::Rules),
            "plan_engine" => parse(v, Figures::Plan),
            "ckb_conformance" => parse(v, Figures::Conformance),
            "ckb_perplexity" => parse(v, Figures::Perplexity),
            _ => Figures::Other(v.clone()),
        }
    }

    /// The common gate figures, for gates.
    pub fn gate(&self) -> Option<&GateFigures> {
        match self {
            Figures::Compile(f) => Some(&f.gate),
            Figures::KernelTest(f) => Some(&f.gate),
            Figures::Verify(f) => Some(&f.gate),
            Figures::Profile(f) => Some(&f.gate),
            Figures::Batching(f) => Some(&f.gate),
            Figures::Serve(f) => Some(&f.gate),
            _ => None,
        }
    }

    /// Whether a blocking rule finding stopped the gate.
    pub fn blocked(&self) -> bool {
        self.gate().is_some_and(|g| g.blocked)
    }

    /// Whether nothing ran because the engine needs a device this machine lacks: no attempt.
    pub fn no_device(&self) -> bool {
        self.gate().is_some_and(|g| g.no_device)
    }

    /// The weight dtype the gate ran at, when it says.
    pub fn dtype(&self) -> Option<&str> {
        self.gate().map(|g| g.dtype.as_str()).filter(|d| !d.is_empty())
    }

    /// Every failure contract named by a diagnosis in these figures.
    pub fn diagnoses(&self) -> Vec<&str> {
        match self {
            Figures::KernelTest(f) => f.kernels.iter().flat_map(|k| k.diagnosis.iter().map(String::as_str)).collect(),
            Figures::Verify(f) => f.diagnosis.iter().map(String::as_str).collect(),
            _ => vec![],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_the_stored_shape() {
        let f = Figures::KernelTest(KernelTestFigures {
            gate: GateFigures { dtype: "bf16".into(), seed: Some(7), ..Default::default() },
            kernels: vec![KernelFigure {
                id: "kernel.rope".into(),
                passed: false,
                max_abs_err: 0.5,
                diagnosis: vec!["failure.rope-adjacent-pairs".into()],
                ..Default::default()
            }],
        });
        let v = f.to_json();
        assert_eq!(
            v,
            serde_json::json!({"dtype": "bf16", "seed": 7, "kernels": [{"id": "kernel.rope", "passed": false, "max_abs_err": 0.5, "diagnosis": ["failure.rope-adjacent-pairs"]}]})
        );
        assert_eq!(Figures::read("run_kernel_test", &v), f);
        assert_eq!(f.diagnoses(), vec!["failure.rope-adjacent-pairs"]);
        assert_eq!(f.dtype(), Some("bf16"));
        assert!(!f.blocked());
    }

    #[test]
    fn old_and_foreign_rows_read_safely() {
        // A blocked row as older versions wrote it.
        let old = serde_json::json!({"blocked": true, "dtype": "f32"});
        let f = Figures::read("verify_generation", &old);
        assert!(f.blocked());
        // A row whose fields have other types is kept as it is.
        let odd = serde_json::json!({"kernels": "many"});
        assert_eq!(Figures::read("run_kernel_test", &odd), Figures::Other(odd.clone()));
        assert!(Figures::read("nothing_known", &odd).gate().is_none());
    }
}
