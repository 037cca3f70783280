//! The kernel registry: one module per kernel contract, holding everything the server knows about
//! that kernel in one place (a [`Kernel`] in [`REGISTRY`]):
//! - the contract id it implements;
//! - how one test case is drawn from a contract `test_cases` entry (sizes and values from a seeded
//!   RNG, written for the engine as named tensors and text parameters: a [`Case`]);
//! - its f64 oracle, as one parameterised core with a `Faults` struct: no fault is the true kernel
//!   (a property test, `core_without_faults_is_the_plain_oracle`, holds it equal bit for bit to the
//!   kernel's plain function in `oracle`, written to be read; the reference forward passes call the
//!   cores), each known-wrong variant ("mutant", named by a failure contract's `mutant` field) is the
//!   core with one fault switched on;
//! - its bytes and FLOPs per call on given dimensions (`cost`), for the roofline;
//! - its harness arms: the Rust blocks the server-owned harness runs to call the engine's kernel on a
//!   case (`test_arm`) and on the model's shapes for timing (`timed_arm`), inserted at the harness
//!   template's `// @arms test` and `// @arms timed` lines for the kernels of an engine's plan only
//!   (`harness::templating`). `cuda_test_arm` and `cuda_timed_arm` are the same for the contract's
//!   CUDA signature (`[cuda]`: cudarc device views and the engine's `Device`, with its own tolerance
//!   per dtype), taken instead when the engine's platform contract has `api = "cuda"` (`ops::arm`);
//!   a kernel has CUDA arms exactly when its contract has a `[cuda]` section (a unit test below, and
//!   tidy).
//!
//! The kernel ids with an oracle ([`ids`], which `oracle::implemented` hands the CKB), drawing
//! ([`draw`]), the mutant names and diagnosis ([`mutants`], [`mutant`]) and the roofline's per-call
//! costs are all derived from [`REGISTRY`]. Adding a kernel is one module here plus its contract file.

pub mod argmax;
pub mod attention;
pub mod attention_sinks;
pub mod embedding;
pub mod gelu_tanh;
pub mod gelu_tanh_and_mul;
pub mod layer_norm;
pub mod linear;
pub mod linear_bf16;
pub mod linear_f16;
pub mod linear_int8;
pub mod moe_experts;
pub mod moe_experts_clamped;
pub mod moe_route;
pub mod paged_attention;
pub mod rms_norm;
pub mod rope;
pub mod rotary;
pub mod sample;
pub mod silu_and_mul;
pub mod softmax;

use std::collections::BTreeMap;

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use base::error::{Error, Result};
use ckb::TestCase;

/// One input tensor of a drawn case, as the engine receives it (flat, row-major).
#[derive(Debug, Clone, PartialEq)]
pub enum Tensor {
    /// f32 values.
    F32(Vec<f32>),
    /// u32 values (token ids, positions).
    U32(Vec<u32>),
    /// bfloat16 bit patterns.
    Bf16(Vec<u16>),
    /// IEEE binary16 bit patterns.
    F16(Vec<u16>),
    /// int8 values.
    I8(Vec<i8>),
}

/// One drawn case of a kernel test: the named inputs and text parameters the harness passes to the
/// engine. The oracle and every mutant read the same values (f32 inputs widened exactly to f64,
/// parameters parsed as the harness parses them).
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    /// Kernel contract id.
    pub kernel: &'static str,
    /// Test case name and concrete dims, e.g. `gqa: n_q=3 kv_len=17 n_heads=8 ...`.
    pub label: String,
    /// Input tensors by name.
    pub inputs: Vec<(String, Tensor)>,
    /// Scalar parameters as text (integers, or f32 values printed exactly), by name.
    pub params: BTreeMap<String, String>,
}

impl Case {
    /// An empty case of `kernel`.
    pub fn new(kernel: &'static str) -> Case {
        Case { kernel, label: String::new(), inputs: vec![], params: BTreeMap::new() }
    }

    /// Add an input tensor.
    pub fn input(&mut self, name: &str, t: Tensor) {
        self.inputs.push((name.to_string(), t));
    }

    /// Add a scalar parameter (its `Display` text is what the engine parses).
    pub fn param(&mut self, name: &str, v: impl std::fmt::Display) {
        self.params.insert(name.to_string(), v.to_string());
    }

    fn tensor(&self, name: &str) -> Option<&Tensor> {
        self.inputs.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    /// f32 input `name` widened to f64 (exact).
    pub fn f(&self, name: &str) -> Option<Vec<f64>> {
        match self.tensor(name)? {
            Tensor::F32(v) => Some(super::widen(v)),
            _ => None,
        }
    }

    /// u32 input `name`.
    pub fn u(&self, name: &str) -> Option<&[u32]> {
        match self.tensor(name)? {
            Tensor::U32(v) => Some(v),
            _ => None,
        }
    }

    /// 16-bit float input `name`: (bit patterns, whether bfloat16 (else IEEE binary16)).
    pub fn half(&self, name: &str) -> Option<(&[u16], bool)> {
        match self.tensor(name)? {
            Tensor::Bf16(v) => Some((v, true)),
            Tensor::F16(v) => Some((v, false)),
            _ => None,
        }
    }

    /// int8 input `name`.
    pub fn i8(&self, name: &str) -> Option<&[i8]> {
        match self.tensor(name)? {
            Tensor::I8(v) => Some(v),
            _ => None,
        }
    }

    /// Integer parameter `name`.
    pub fn n(&self, name: &str) -> Option<usize> {
        self.params.get(name)?.parse().ok()
    }

    /// Real parameter `name` as the engine receives it: parsed as f32, widened to f64.
    pub fn x(&self, name: &str) -> Option<f64> {
        self.params.get(name)?.parse::<f32>().ok().map(f64::from)
    }
}

/// What the oracle, or a mutant, expects a kernel to return on a case.
#[derive(Debug, Clone, PartialEq)]
pub enum Expect {
    /// Element values of the output tensor `out`.
    Values(Vec<f64>),
    /// An index (argmax), returned as the single u32 of `out`.
    Index(usize),
}

/// A known-wrong variant of a kernel: the core with one fault switched on.
pub struct Mutant {
    /// Its name, as failure contracts spell it in their `mutant` field.
    pub name: &'static str,
    /// What it expects on a case; None when the case lacks an input it needs.
    pub expect: fn(&Case) -> Option<Expect>,
}

/// Bytes moved and floating-point operations of one kernel call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cost {
    /// Bytes read and written.
    pub bytes: f64,
    /// Floating-point operations (a multiply-add counts two).
    pub flops: f64,
}

/// Dimensions of one timed call, by name (as the timed harness arm reads them).
pub type Dims = BTreeMap<String, usize>;

/// Everything the server knows about one kernel contract.
pub struct Kernel {
    /// Kernel contract id, e.g. `kernel.rms_norm`.
    pub id: &'static str,
    /// Draw one case of a contract test case.
    pub draw: fn(&TestCase, &mut ChaCha8Rng) -> Result<Case>,
    /// The f64 oracle (the core with no fault); None when the case lacks an input it needs.
    pub oracle: fn(&Case) -> Option<Expect>,
    /// The plain oracle of `oracle` (the function the reference forward pass calls), on the same
    /// case; the property test `core_without_faults_is_the_plain_oracle` holds the two equal, bit
    /// for bit.
    pub plain: fn(&Case) -> Option<Expect>,
    /// The known-wrong variants.
    pub mutants: &'static [Mutant],
    /// Bytes and FLOPs of one call on `dims` (the timed arm's dimensions).
    pub cost: fn(&Dims) -> Cost,
    /// Harness code run for one case: a block that reads inputs from `i: &Inputs` and evaluates to the
    /// outputs `Vec<(String, Out)>`; output buffers start as NaN (`nan(len)`).
    pub test_arm: &'static str,
    /// Harness code that prepares one timed call: a block that reads `n(dim)` and `copies` and
    /// evaluates to a `Timed` (a closure called with the iteration index).
    pub timed_arm: &'static str,
    /// As `test_arm`, for the kernel contract's CUDA signature (platforms with `api = "cuda"`):
    /// inputs uploaded with `device::up`, outputs from `device::nan(len)` (NaN on the device), the
    /// engine's kernel called with `device::dev()`, outputs read back with `device::down`.
    pub cuda_test_arm: &'static str,
    /// As `timed_arm`, for the CUDA signature: device buffers prepared once, the closure launches
    /// on the engine's stream and the harness times it with CUDA events.
    pub cuda_timed_arm: &'static str,
}

/// Every kernel with an oracle, in contract order of a decode step.
pub static REGISTRY: &[&Kernel] = &[
    &embedding::KERNEL,
    &rms_norm::KERNEL,
    &layer_norm::KERNEL,
    &rope::KERNEL,
    &rotary::KERNEL,
    &linear::KERNEL,
    &linear_bf16::KERNEL,
    &linear_f16::KERNEL,
    &linear_int8::KERNEL,
    &silu_and_mul::KERNEL,
    &gelu_tanh_and_mul::KERNEL,
    &gelu_tanh::KERNEL,
    &moe_route::KERNEL,
    &moe_experts::KERNEL,
    &moe_experts_clamped::KERNEL,
    &softmax::KERNEL,
    &attention::KERNEL,
    &attention_sinks::KERNEL,
    &paged_attention::KERNEL,
    &argmax::KERNEL,
    &sample::KERNEL,
];

/// The registry entry of a kernel contract id.
pub fn get(id: &str) -> Option<&'static Kernel> {
    REGISTRY.iter().copied().find(|k| k.id == id)
}

/// Kernel contract ids with an oracle.
pub fn ids() -> impl Iterator<Item = &'static str> {
    REGISTRY.iter().map(|k| k.id)
}

/// Every kernel mutant with its kernel.
pub fn mutants() -> impl Iterator<Item = (&'static Kernel, &'static Mutant)> {
    REGISTRY.iter().flat_map(|k| k.mutants.iter().map(move |m| (*k, m)))
}

/// The mutant of this name of kernel `kernel`, if it has one.
pub fn mutant(kernel: &str, name: &str) -> Option<&'static Mutant> {
    get(kernel)?.mutants.iter().find(|m| m.name == name)
}

/// Draw one case of `kernel` for test case `case`, labelled `<case name>: <dims>`.
///
/// # Errors
/// [`base::error::ErrorKind::Usage`] for a kernel without an oracle; Input when the test case lacks
/// a dimension the kernel needs.
pub fn draw(kernel: &str, case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let k = get(kernel).ok_or_else(|| {
        Error::usage(format!(
            "no oracle for `{kernel}`; kernels with an oracle: {}",
            ids().collect::<Vec<_>>().join(", ")
        ))
    })?;
    let mut c = match &case.exposes {
        None => (k.draw)(case, rng)?,
        Some(name) => {
            let m = mutant(kernel, name).ok_or_else(|| {
                Error::input(format!("test case `{}` exposes `{name}`, which is no mutant of {kernel}", case.name))
            })?;
            let mut found = None;
            for _ in 0..EXPOSE_DRAWS {
                let c = (k.draw)(case, rng)?;
                if differs((k.oracle)(&c), (m.expect)(&c)) {
                    found = Some(c);
                    break;
                }
            }
            found.ok_or_else(|| {
                Error::input(format!(
                    "test case `{}`: no case in {EXPOSE_DRAWS} draws on which mutant `{name}` differs from the oracle; widen its ranges",
                    case.name
                ))
            })?
        }
    };
    c.label = format!("{}: {}", case.name, c.label);
    Ok(c)
}

/// Draws tried for a test case with `exposes` before giving up.
pub const EXPOSE_DRAWS: usize = 500;

/// Whether a mutant's prediction differs from the oracle's beyond any kernel tolerance: another
/// index, another length, or a value off by more than 1e-3 of max(1, |oracle|).
#[allow(clippy::neg_cmp_op_on_partial_ord, reason = "a NaN on either side must count as a difference")]
fn differs(oracle: Option<Expect>, mutant: Option<Expect>) -> bool {
    match (oracle, mutant) {
        (Some(Expect::Index(a)), Some(Expect::Index(b))) => a != b,
        (Some(Expect::Values(a)), Some(Expect::Values(b))) => {
            a.len() != b.len() || a.iter().zip(&b).any(|(x, y)| !((x - y).abs() <= 1e-3 * x.abs().max(1.0)))
        }
        _ => false,
    }
}

/// Uniform f32 values in [-scale, scale).
pub fn uniform(rng: &mut ChaCha8Rng, n: usize, scale: f64) -> Vec<f32> {
    (0..n).map(|_| (rng.random_range(-1.0..1.0) * scale) as f32).collect()
}

/// A size drawn uniformly within the test case's inclusive range for `name`.
///
/// # Errors
/// [`base::error::ErrorKind::Input`] when the test case has no range for `name`.
pub fn dim(rng: &mut ChaCha8Rng, case: &TestCase, name: &str) -> Result<usize> {
    let [lo, hi] = *case
        .dims
        .get(name)
        .ok_or_else(|| Error::input(format!("test case `{}` has no range for dim `{name}`", case.name)))?;
    Ok(rng.random_range(lo..=hi) as usize)
}

/// The dimension `name` of a timed call (0 when absent).
pub fn d(dims: &Dims, name: &str) -> f64 {
    dims.get(name).copied().unwrap_or(0) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn ids_and_mutants_are_unique() {
        let mut ids: Vec<&str> = ids().collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), REGISTRY.len());
        let mut pairs: Vec<(&str, &str)> = mutants().map(|(k, m)| (k.id, m.name)).collect();
        let n = pairs.len();
        pairs.sort();
        pairs.dedup();
        assert_eq!(pairs.len(), n, "a kernel lists one mutant twice");
    }

    #[test]
    fn every_kernel_draws_from_its_shipped_contract_and_its_oracle_answers() {
        let ckb = ckb::Ckb::embedded().unwrap();
        for k in REGISTRY {
            let c = ckb.get(k.id).unwrap();
            assert!(!c.test_cases.is_empty(), "{}", k.id);
            for case in &c.test_cases {
                let mut rng = ChaCha8Rng::seed_from_u64(7);
                let drawn = draw(k.id, case, &mut rng).unwrap();
                assert!((k.oracle)(&drawn).is_some(), "{} {}", k.id, drawn.label);
                for m in k.mutants {
                    assert!((m.expect)(&drawn).is_some(), "{} {}", m.name, drawn.label);
                }
            }
            assert!(!k.test_arm.trim().is_empty() && !k.timed_arm.trim().is_empty(), "{}", k.id);
            // A kernel contract with a CUDA signature has CUDA arms, and only then.
            assert_eq!(c.cuda.is_some(), !k.cuda_test_arm.trim().is_empty(), "{}", k.id);
            assert_eq!(c.cuda.is_some(), !k.cuda_timed_arm.trim().is_empty(), "{}", k.id);
        }
    }

    /// The property the registry promises: every kernel's core with no fault computes exactly what
    /// the plain oracle computes, bit for bit, on cases drawn from every shipped test case with many
    /// seeds (adversarial scales and shapes included).
    #[test]
    fn core_without_faults_is_the_plain_oracle() {
        let ckb = ckb::Ckb::embedded().unwrap();
        let bits = |e: Option<Expect>| match e {
            Some(Expect::Values(v)) => v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            Some(Expect::Index(i)) => vec![i as u64],
            None => panic!("no expectation"),
        };
        for k in REGISTRY {
            for case in &ckb.get(k.id).unwrap().test_cases {
                for seed in 0..24 {
                    let drawn = draw(k.id, case, &mut ChaCha8Rng::seed_from_u64(seed)).unwrap();
                    assert_eq!(bits((k.oracle)(&drawn)), bits((k.plain)(&drawn)), "{} {}", k.id, drawn.label);
                }
            }
        }
    }
}
