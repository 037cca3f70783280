//! Phase 5, sampling (contract `component.sampler`): greedy decoding takes the argmax of the logits.
//! The device loop (`model::Model::decode_greedy`) takes it on the device, fused into lm_head;
//! this host function serves logits already copied to the host (verification, the first token).
//! `stop_tokens` reads the ids that end generation from the model directory (component.sampler v2).

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
