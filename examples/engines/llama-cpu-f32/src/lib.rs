//! A small Llama-family inference engine: f32 on the CPU, Hugging Face checkpoint layout
//! (`config.json`, `model.safetensors`, `tokenizer.json`), greedy decoding with a KV cache.
pub mod generate;
pub mod kernels;
pub mod model;
pub mod tokenizer;
