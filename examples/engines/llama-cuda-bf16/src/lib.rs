//! A Llama inference engine on an NVIDIA GPU, written from metainfer's contracts for target `cuda`
//! (`platform.cuda-sm90`): bf16 weights on the device (the embedding table also kept in f32 for
//! the gather), f32 activations, KV cache and accumulation; greedy decoding kept on the device.
//! Besides plain Llama it runs the mixture-of-experts families Qwen3-MoE and Mixtral (`moe`: the
//! router, the top-k selection and the selected experts on the device, per token; their per-head
//! q/k RMSNorm), one token at a time through the per-contract kernels.
//!
//! Modules in the order the phases build them: `device` (component.cuda_device: the driver loaded
//! at run time, one stream, the CUDA C of `kernels.cu` compiled once with NVRTC), `kernels` (one
//! launcher per kernel contract, the contracts' `[cuda]` signatures; `fused` the model's fused
//! decode and prefill kernels), `config` and `weights` (loading), `model` (the decoder, its KV
//! cache and `decode_greedy`; `moe` its experts), `tokenizer` and `generate`.
//! It builds without a CUDA toolkit or GPU (cudarc's dynamic loading); without a driver every entry
//! point returns "no CUDA device: ..." instead of panicking.
//!
//! It is also a serving engine (`[serving]` in its metainfer.toml): `batch` (the batched step over
//! a paged KV cache on the device: every projection one tensor-core product over the rows of all
//! sequences of the step, kernel.paged_attention reading each sequence's keys through its block
//! table), `paged::BlockManager` and `scheduler::Scheduler` (the SIMD engine's, held identical),
//! `generate::sample` (kernel.sample on the host, over the logits rows the step copies back), and
//! a binary (`src/main.rs`, Cargo feature `server`: `generate` and `serve`, the OpenAI-compatible
//! server). The batched step takes expert models too (Qwen3-MoE, Mixtral), their q/k norms and
//! experts row by row: each row reads its own experts' rows (grouping the rows by expert, so each
//! selected expert is read once per step, is the plain engine's and not yet this one's).
//!
//! Its `tokenizer`, `config` (every family of the CKB, transformers v5 `rope_parameters` included;
//! `model::Model::load` refuses what this engine does not run, by name), `weights` (one
//! `model.safetensors` or the shards of an index, each tensor read when the model takes it, so the
//! host never holds the checkpoint widened to f32) and `stop_tokens` are the plain engine's, held
//! identical by metainfer's tidy test.
#![deny(unsafe_op_in_unsafe_fn)]
// The kernel contracts fix the launchers' signatures, some with more than seven arguments.
#![allow(clippy::too_many_arguments)]

pub mod batch;
// The plain engine's config, whole: some of what it reads only the families this engine refuses use.
#[allow(dead_code)]
mod config;
pub mod device;
mod fused;
pub mod generate;
pub mod kernels;
pub mod model;
mod moe;
pub mod paged;
pub mod scheduler;
pub mod tokenizer;
mod weights;
