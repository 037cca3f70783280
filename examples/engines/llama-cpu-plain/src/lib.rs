//! A plain Llama-family inference engine on the CPU, written from metainfer's contracts: the shape a
//! generated engine should have. Hugging Face checkpoint layout (`config.json`, `model.safetensors`
//! or its shards with `model.safetensors.index.json`, `tokenizer.json` (SentencePiece-style or byte-level BPE), the stop tokens of
//! `generation_config.json`); f32 weights, activations and KV cache; greedy decoding. No unsafe code, no SIMD
//! intrinsics, no threads: every function is the pseudocode of the contract its doc names.
//!
//! Modules in the order the phases build them: `kernels` (one function per kernel contract),
//! `config` and `weights` (loading), `model` (the decoder and its KV cache), `tokenizer` and
//! `generate`. The gates call the public signatures of `kernels`, `model`, `tokenizer` and `generate`,
//! which the contracts' skeletons fix.
//!
//! No memory mapping either; its dependencies are `safetensors`, `serde` and `serde_json`, plus
//! `fancy-regex` (the byte-level split patterns' lookahead) and `unicode-normalization` (NFC) in the
//! tokenizer. `config` is config.json as the family contracts map it (a table of families with their
//! HF defaults, refused keys and features), `weights::read` the one function that knows the
//! checkpoint layout (yielding named f32 tensors), `model` the one-token forward, the KV cache and
//! prefill as a loop over forward. It covers every model family of the CKB.
//!
//! The serving components (`[serving]` in its metainfer.toml; greedy only, no server binary):
//! `paged::BlockManager` (KV blocks handed out to sequences), `batch::step` (several sequences per
//! pass over a paged KV cache, each chunk at its own positions through its block table: the layer
//! computations of `forward` on all rows of the step, one product per weight matrix over all rows,
//! and a mixture of experts grouped by expert so that each selected expert's weights are read once
//! per step for every row routed to it), `scheduler::Scheduler` (continuous batching, chunked
//! prefill, preemption by recomputation) and `kernels::paged_attention`.
#![forbid(unsafe_code)]

pub mod batch;
mod config;
pub mod generate;
pub mod kernels;
pub mod model;
pub mod paged;
pub mod scheduler;
#[cfg(test)]
mod tests;
pub mod tokenizer;
mod weights;
