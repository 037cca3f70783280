//! A Llama inference engine on an NVIDIA GPU, written from metainfer's contracts for target `cuda`
//! (`platform.cuda-sm90`): bf16 weights on the device (the embedding table also kept in f32 for
//! the gather), f32 activations, KV cache and accumulation; greedy decoding kept on the device.
//!
//! Modules in the order the phases build them: `device` (component.cuda_device: the driver loaded
//! at run time, one stream, the CUDA C of `kernels.cu` compiled once with NVRTC), `kernels` (one
//! launcher per kernel contract, the contracts' `[cuda]` signatures), `config` and `weights`
//! (loading), `model` (the decoder, its KV cache and `decode_greedy`), `tokenizer` and `generate`.
//! It builds without a CUDA toolkit or GPU (cudarc's dynamic loading); without a driver every entry
//! point returns "no CUDA device: ..." instead of panicking.
//!
//! Its `tokenizer` module and `stop_tokens` are the plain engine's, held identical by metainfer's
//! tidy test; its `config` (transformers v5 `rope_parameters` included) and `weights` are derived
//! from the plain engine's, narrowed to plain Llama and one `model.safetensors` file.
#![deny(unsafe_op_in_unsafe_fn)]
// The kernel contracts fix the launchers' signatures, some with more than seven arguments.
#![allow(clippy::too_many_arguments)]

mod config;
pub mod device;
pub mod generate;
pub mod kernels;
pub mod model;
pub mod tokenizer;
mod weights;
