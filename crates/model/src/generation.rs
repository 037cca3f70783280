//! generation_config.json: the token ids that end generation (`eos_token_id`, an int or a list), the
//! BOS id and the length limit, read as HF transformers reads them. Without the file, HF builds the
//! generation config from config.json (`GenerationConfig.from_model_config`), so the ids fall back to
//! config.json's `eos_token_id` / `bos_token_id`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::Files;
use base::error::{Error, Result};

/// What generation_config.json (or config.json, without it) says about ending generation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GenerationConfig {
    /// Token ids that end generation: the generated token is kept and generation stops (HF's
    /// `eos_token_id`, an int or a list, in that order). Empty: generation runs to its length limit.
    pub eos_token_ids: Vec<u32>,
    /// Id of the beginning-of-sequence token, when stated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
    /// `max_length` (prompt plus generated tokens), when stated; a request's own token count wins,
    /// as `max_new_tokens` does in HF.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_length: Option<usize>,
    /// The file the ids come from: `generation_config.json`, `config.json`, or empty when neither states any.
    pub source: String,
}

/// Read `dir/generation_config.json`, or the ids of `dir/config.json` without it, checking each id
/// against the vocabulary (`vocab`, the length of the logits).
///
/// # Errors
/// [`base::error::ErrorKind::Input`] naming the file and key when a value has the wrong type
/// (`"eos_token_id": "2"`), an id is negative or not below `vocab`, or the file is not a JSON object.
pub fn read_generation_config(dir: &(impl Files + ?Sized), vocab: usize) -> Result<GenerationConfig> {
    generation_config_in(dir, None, vocab)
}

/// As [`read_generation_config`], with `config` (config.json, already read) used instead of
/// reading config.json again when there is no generation_config.json.
///
/// # Errors
/// As [`read_generation_config`].
pub fn generation_config_in(
    dir: &(impl Files + ?Sized),
    config: Option<&serde_json::Map<String, Value>>,
    vocab: usize,
) -> Result<GenerationConfig> {
    let (file, from_config) =
        if dir.has_file("generation_config.json") { ("generation_config.json", false) } else { ("config.json", true) };
    let path = dir.show(file);
    let map = match (from_config, config) {
        (true, Some(held)) => held.clone(),
        _ => {
            if from_config && !dir.has(file) {
                return Ok(GenerationConfig::default());
            }
            let text = dir.read_text(file, &base::util::CONFIG_JSON)?;
            match serde_json::from_str::<Value>(&text) {
                Ok(Value::Object(m)) => m,
                Ok(_) => return Err(Error::input(format!("{}: must be a JSON object", path.display()))),
                Err(e) => return Err(Error::input(format!("{}: not valid JSON: {e}", path.display()))),
            }
        }
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let id = |key: &str, v: &Value| -> Result<u32> {
        match v.as_u64() {
            Some(n) if (n as usize) < vocab => Ok(n as u32),
            Some(n) => Err(Error::input(format!(
                "{}: {key} {n} is not below the vocabulary size {vocab} (config.json vocab_size); fix the id",
                path.display()
            ))),
            None => Err(Error::input(format!(
                "{}: {key} must be a non-negative integer token id (or a list of them), got {}",
                path.display(),
                super::json_type(v)
            ))),
        }
    };
    let eos_token_ids = match map.get("eos_token_id") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(items)) => items.iter().map(|v| id("eos_token_id", v)).collect::<Result<_>>()?,
        Some(v) => vec![id("eos_token_id", v)?],
    };
    let bos_token_id = match map.get("bos_token_id") {
        None | Some(Value::Null) => None,
        // Some configs give a list here too; the first is the one prepended.
        Some(Value::Array(items)) => items.first().map(|v| id("bos_token_id", v)).transpose()?,
        Some(v) => Some(id("bos_token_id", v)?),
    };
    let max_length = match map.get("max_length").filter(|_| !from_config) {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => Some(n as usize),
            _ => {
                return Err(Error::input(format!(
                    "{}: max_length must be a positive integer, got {}",
                    path.display(),
                    super::json_type(v)
                )));
            }
        },
    };
    let source =
        if eos_token_ids.is_empty() && bos_token_id.is_none() && max_length.is_none() { String::new() } else { name };
    Ok(GenerationConfig { eos_token_ids, bos_token_id, max_length, source })
}
