//! Phase 5, sampling (contract `component.sampler`): greedy decoding takes the argmax of the logits.
//! The device loop (`model::Model::decode_greedy`) takes it on the device, fused into lm_head;
//! this host function serves logits already copied to the host (verification, the first token).
//! `stop_tokens` reads the ids that end generation from the model directory (component.sampler v2).
//! The server samples on the host (kernel.sample): a batched step returns each sequence's logits
//! row ([n, vocab] f32: 0.5 MB per sequence at a 128,256-token vocabulary) and the server draws
//! each request's next token with `sample` and the request's own generator. `sample` and
//! `SamplingParams` are the SIMD engine's, `argmax` the plain engine's, held identical by
//! metainfer's tidy test.

use std::path::Path;

/// Greedy sampler: the id of the largest logit (first on ties).
pub fn sample_greedy(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Token ids that end generation, from the model directory as HF reads them: generation_config.json
/// `eos_token_id` (an int or a list), else config.json's; empty when neither names one. Errors name
/// the file and key (a value that is not a token id, a file that does not parse).
pub fn stop_tokens(dir: &Path) -> Result<Vec<u32>, String> {
    let generation = dir.join("generation_config.json");
    let path = if generation.exists() { generation } else { dir.join("config.json") };
    let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("cannot parse {}: {e}", path.display()))?;
    let id = |x: &serde_json::Value| {
        x.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| format!("{}: eos_token_id holds {x}, not a token id", path.display()))
    };
    match &v["eos_token_id"] {
        serde_json::Value::Null => Ok(vec![]),
        serde_json::Value::Array(a) => a.iter().map(id).collect(),
        x => Ok(vec![id(x)?]),
    }
}

/// Contract `kernel.argmax`. Index of the largest element; the first one on ties. `x`: [n], n >= 1.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for i in 1..x.len() {
        if x[i] > x[best] {
            best = i;
        }
    }
    best
}

/// Sampling parameters of one request (kernel.sample). Neutral values switch a step off:
/// temperature 1, top_k 0, top_p 1, min_p 0, repetition_penalty 1, frequency and presence penalties 0;
/// temperature 0 is greedy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
        }
    }
}

/// One token drawn from `logits` ([n]) after penalties for `prev`, temperature, top-k, top-p and min-p,
/// by the inverse CDF in rank order at the uniform number `u` in [0, 1) (see kernel.sample for the order).
pub fn sample(logits: &[f32], prev: &[u32], params: &SamplingParams, u: f32) -> u32 {
    let n = logits.len();
    assert!(n > 0, "sample: empty logits");
    let p = params;
    let mut z = logits.to_vec();
    // Occurrences of each previous token, counted once per distinct id.
    let mut seen: Vec<u32> = prev.iter().copied().filter(|&t| (t as usize) < n).collect();
    seen.sort_unstable();
    let mut i = 0;
    while i < seen.len() {
        let t = seen[i];
        let mut c = 0usize;
        while i < seen.len() && seen[i] == t {
            c += 1;
            i += 1;
        }
        let v = &mut z[t as usize];
        *v = if *v > 0.0 { *v / p.repetition_penalty } else { *v * p.repetition_penalty };
        *v -= c as f32 * p.frequency_penalty + p.presence_penalty;
    }
    if p.temperature == 0.0 {
        return argmax(&z) as u32;
    }
    for v in &mut z {
        *v /= p.temperature;
    }
    let rank = |a: &u32, b: &u32| z[*b as usize].total_cmp(&z[*a as usize]).then(a.cmp(b));
    let mut order: Vec<u32> = (0..n as u32).collect();
    if p.top_k > 0 && p.top_k < n {
        order.select_nth_unstable_by(p.top_k - 1, rank);
        order.truncate(p.top_k);
    }
    order.sort_unstable_by(rank);
    let top = z[order[0] as usize];
    let mut probs: Vec<f32> = order.iter().map(|&t| (z[t as usize] - top).exp()).collect();
    let total: f32 = probs.iter().sum();
    for q in &mut probs {
        *q /= total;
    }
    let mut keep = probs.len();
    if p.top_p < 1.0 {
        let mut mass = 0.0f32;
        for (j, q) in probs.iter().enumerate() {
            mass += q;
            if mass >= p.top_p {
                keep = j + 1;
                break;
            }
        }
    }
    let floor = p.min_p * probs[0];
    let kept: Vec<(u32, f32)> = order
        .iter()
        .zip(&probs)
        .take(keep)
        .filter(|(_, q)| p.min_p <= 0.0 || **q >= floor)
        .map(|(&t, &q)| (t, q))
        .collect();
    let mass: f32 = kept.iter().map(|(_, q)| q).sum();
    let mut cdf = 0.0f32;
    for &(t, q) in &kept {
        cdf += q / mass;
        if u < cdf {
            return t;
        }
    }
    kept.last().map_or(order[0], |k| k.0)
}

#[cfg(test)]
mod tests {
    fn dir_with(files: &[(&str, &str)]) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("llama-cuda-stop-{}-{}", std::process::id(), files.len()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        for (name, text) in files {
            std::fs::write(d.join(name), text).unwrap();
        }
        d
    }

    #[test]
    fn stop_tokens_read_generation_config_first_then_config() {
        let d = dir_with(&[("config.json", r#"{"eos_token_id": 2}"#)]);
        assert_eq!(super::stop_tokens(&d).unwrap(), vec![2]);
        let d = dir_with(&[
            ("config.json", r#"{"eos_token_id": 2}"#),
            ("generation_config.json", r#"{"eos_token_id": [128001, 128009]}"#),
        ]);
        assert_eq!(super::stop_tokens(&d).unwrap(), vec![128001, 128009]);
        let d = dir_with(&[("config.json", r#"{"eos_token_id": -1}"#), ("x", ""), ("y", "")]);
        assert!(super::stop_tokens(&d).is_err());
    }
}
