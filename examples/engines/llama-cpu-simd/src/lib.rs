//! A Llama-family inference engine on the CPU: Hugging Face checkpoint layout (`config.json`,
//! `model.safetensors` or its shards with `model.safetensors.index.json`, `tokenizer.json`: SentencePiece-style or byte-level BPE), greedy
//! decoding with a KV cache to the stop tokens of `generation_config.json`.
//!
//! Weight matrices are stored as f32 by default, or as bf16, f16 or int8 (symmetric, one scale per
//! output row) with the cargo feature of that name; activations, accumulation and the KV cache are
//! f32 in every variant. Matrix products use AVX-512F or AVX2+FMA kernels chosen at run time and
//! split their rows across a persistent team of threads (`pool`: RAYON_NUM_THREADS threads, the
//! variable profile_engine sets, else one per CPU). Weights are memory-mapped,
//! prefill is batched, and the weight-dtype features are declared in metainfer.toml
//! (`[dtype_features]`).
//!
//! It is also a serving engine (`[serving]` in its metainfer.toml): `kernels::sample`,
//! `kernels::paged_attention`, `paged::BlockManager`, `scheduler::Scheduler` (continuous batching,
//! chunked prefill, preemption by recomputation; it takes the tokens the caller sampled, so the
//! sampler and its per-request generator live in the server loop), `batch::step` (a pass whose
//! projections and MLP run on the rows of every sequence of the step at once: one read of each
//! weight serves them all, which is where batched throughput comes from), and a binary (`src/main.rs`,
//! Cargo feature `server`, so the harness never compiles axum, tokio or minijinja: `generate` and
//! `serve`, the OpenAI-compatible server).

#[cfg(any(
    all(feature = "bf16", feature = "f16"),
    all(feature = "bf16", feature = "int8"),
    all(feature = "f16", feature = "int8"),
))]
compile_error!("enable at most one of the features bf16, f16 and int8");

pub mod batch;
pub mod generate;
pub mod kernels;
mod matmul;
pub mod model;
pub mod paged;
mod pool;
pub mod quant;
pub mod scheduler;
pub mod tokenizer;
mod weights;
