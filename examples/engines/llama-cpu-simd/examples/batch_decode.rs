//! Decode throughput of the batched step at several batch sizes: `cargo run --release --example
//! batch_decode -- MODEL_DIR [PROMPT_LEN] [NEW_TOKENS] [BATCH...]`. Each batch size runs that many
//! sequences (different prompts) through one prefill step, then NEW_TOKENS decode steps of one
//! token per sequence; it prints the median of 3 runs of output tokens/s. One read of each weight
//! serves every sequence of a step, so tokens/s should grow with the batch until compute binds.
use std::path::PathBuf;
use std::time::Instant;

use llama_cpu_simd::batch::{self, SeqChunk};
use llama_cpu_simd::model::Model;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = PathBuf::from(args.first().expect("usage: batch_decode MODEL_DIR [PROMPT_LEN] [NEW_TOKENS] [BATCH...]"));
    let prompt_len: usize = args.get(1).map_or(16, |s| s.parse().expect("PROMPT_LEN"));
    let new_tokens: usize = args.get(2).map_or(64, |s| s.parse().expect("NEW_TOKENS"));
    let batches: Vec<usize> =
        if args.len() > 3 { args[3..].iter().map(|s| s.parse().expect("BATCH")).collect() } else { vec![1, 4, 16] };
    let mut model = Model::load(&dir).unwrap_or_else(|e| panic!("{e}"));
    let vocab = model.vocab_size() as u32;
    let block = 16;
    let per_seq = (prompt_len + new_tokens).div_ceil(block);
    for &n in &batches {
        let mut rates = Vec::new();
        for run in 0..3 {
            let mut cache = batch::new_cache(&model, n * per_seq, block);
            let tables: Vec<Vec<u32>> = (0..n).map(|s| (0..per_seq).map(|b| (b * n + s) as u32).collect()).collect();
            let prompts: Vec<Vec<u32>> = (0..n)
                .map(|s| (0..prompt_len).map(|i| ((i * 7 + s * 13 + run * 5 + 3) as u32) % vocab).collect())
                .collect();
            let chunks: Vec<SeqChunk> =
                (0..n).map(|s| SeqChunk { tokens: &prompts[s], start: 0, block_table: &tables[s] }).collect();
            let logits = batch::step(&mut model, &mut cache, &chunks);
            let mut last: Vec<u32> =
                (0..n).map(|s| argmax(&logits[s * vocab as usize..(s + 1) * vocab as usize])).collect();
            let t = Instant::now();
            for i in 0..new_tokens {
                let toks: Vec<[u32; 1]> = last.iter().map(|&x| [x]).collect();
                let chunks: Vec<SeqChunk> = (0..n)
                    .map(|s| SeqChunk { tokens: &toks[s], start: prompt_len + i, block_table: &tables[s] })
                    .collect();
                let logits = batch::step(&mut model, &mut cache, &chunks);
                last = (0..n).map(|s| argmax(&logits[s * vocab as usize..(s + 1) * vocab as usize])).collect();
            }
            rates.push((n * new_tokens) as f64 / t.elapsed().as_secs_f64());
        }
        rates.sort_by(f64::total_cmp);
        println!(
            "batch {n:>3}: {:>9.1} output tokens/s (median of 3; min {:.1}, max {:.1})",
            rates[1], rates[0], rates[2]
        );
    }
}

fn argmax(x: &[f32]) -> u32 {
    llama_cpu_simd::kernels::argmax(x) as u32
}
