//! Phase 5: sampling.
use std::path::Path;

use crate::kernels;

/// Greedy sampler: the id of the largest logit (first on ties).
pub fn sample_greedy(logits: &[f32]) -> u32 {
    kernels::argmax(logits) as u32
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
