//! The engine manifest: an engine crate's `metainfer.toml` (written by scaffold), parsed once, typed,
//! by the code that resolves an engine (`harness::Workshop::engine`). It states the constraints the
//! engine was built for: model family, target platform, weight dtype, reference level, and the Cargo
//! features that build it for other weight dtypes. An optional `[serving]` table ([`Serving`]:
//! max_seqs, max_context, block_size, kv_blocks, max_batch_tokens, sampling) adds the serving
//! kernels and components to the engine's target (`ops::Ctx::target`) and the batching and serving
//! phases to its plan.
//!
//! A malformed or ill-typed manifest is an error naming the file, the key and what to write instead;
//! nothing is silently replaced by a default. An absent manifest means every default (a crate made by
//! hand can still be checked). Whether the family and platform exist is checked against the CKB by
//! the caller (`ops::Ctx::target`). Depends on `error`, `util` (bounded reads) and `ckb` (the weight dtype names) only.

use std::collections::BTreeMap;
use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use base::error::{Error, Result};

/// File name of the manifest in an engine crate.
pub const FILE: &str = "metainfer.toml";

/// The reference level an engine is built under: what the agent was allowed to read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReferenceLevel {
    /// Knowledge from the CKB only.
    #[default]
    Zero,
    /// Public documentation too.
    Docs,
    /// Other implementations' code too.
    Code,
}

impl ReferenceLevel {
    /// Every level, from the strictest.
    pub const ALL: [ReferenceLevel; 3] = [ReferenceLevel::Zero, ReferenceLevel::Docs, ReferenceLevel::Code];

    /// Parse a level by name.
    ///
    /// # Errors
    /// A message naming the valid levels.
    pub fn parse(s: &str) -> Result<ReferenceLevel, String> {
        ReferenceLevel::ALL
            .into_iter()
            .find(|l| l.name() == s)
            .ok_or_else(|| format!("unknown reference level `{s}`; levels: zero, docs, code"))
    }

    /// Name as recorded in the ledger.
    pub fn name(self) -> &'static str {
        match self {
            ReferenceLevel::Zero => "zero",
            ReferenceLevel::Docs => "docs",
            ReferenceLevel::Code => "code",
        }
    }
}

/// Serving constraints of an engine: how many sequences at once, how long each, the KV cache's
/// block size and size, the token budget of one batched step, and whether requests may sample.
/// Written by scaffold as the `[serving]` table of `metainfer.toml`; plan_engine takes the same.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Serving {
    /// Most sequences in one batched step (and running at once).
    pub max_seqs: usize,
    /// Most tokens of one sequence, prompt and output together (at most the model's
    /// max_position_embeddings).
    pub max_context: usize,
    /// Positions per KV-cache block (vLLM's default is 16).
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    /// KV-cache blocks of the whole pool; absent: enough for max_seqs sequences of max_context
    /// tokens (max_seqs * ceil(max_context / block_size)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_blocks: Option<usize>,
    /// Most tokens one batched step runs (prefill chunks and decode tokens together); absent: 256.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_batch_tokens: Option<usize>,
    /// Whether requests may sample (temperature, top-k, top-p, min-p, penalties: kernel.sample);
    /// false serves greedy decoding only.
    #[serde(default)]
    pub sampling: bool,
}

fn default_block_size() -> usize {
    16
}

/// Largest value of a serving constraint (sequences, context, blocks, tokens): far beyond what a
/// machine holds, low enough that products of two of them cannot overflow.
pub const SERVING_MAX: usize = 1 << 24;

impl Serving {
    /// KV-cache blocks of the pool (`kv_blocks`, or enough for max_seqs full contexts).
    pub fn blocks(&self) -> usize {
        self.kv_blocks.unwrap_or(self.max_seqs * self.max_context.div_ceil(self.block_size.max(1)))
    }

    /// Token budget of one batched step (`max_batch_tokens`, default 256).
    pub fn batch_tokens(&self) -> usize {
        self.max_batch_tokens.unwrap_or(256)
    }

    /// Check the constraints on their own (the model's limits are the plan's to check).
    ///
    /// # Errors
    /// A message naming the key and the value to write instead.
    pub fn check(&self) -> std::result::Result<(), String> {
        for (key, v) in [
            ("max_seqs", Some(self.max_seqs)),
            ("max_context", Some(self.max_context)),
            ("block_size", Some(self.block_size)),
            ("kv_blocks", self.kv_blocks),
            ("max_batch_tokens", self.max_batch_tokens),
        ] {
            if let Some(v) = v
                && (v == 0 || v > SERVING_MAX)
            {
                return Err(format!("key `serving.{key}` = {v} must be between 1 and {SERVING_MAX}"));
            }
        }
        if self.block_size > 1024 {
            return Err(format!("key `serving.block_size` = {} is larger than 1024; use 16 or 32", self.block_size));
        }
        if self.batch_tokens() < self.max_seqs {
            return Err(format!(
                "key `serving.max_batch_tokens` = {} is below max_seqs = {}: a decode step of every running sequence must fit one step",
                self.batch_tokens(),
                self.max_seqs
            ));
        }
        let one = self.max_context.div_ceil(self.block_size);
        if self.blocks() < one {
            return Err(format!(
                "key `serving.kv_blocks` = {} cannot hold one sequence of max_context = {} tokens ({one} blocks of {})",
                self.blocks(),
                self.max_context,
                self.block_size
            ));
        }
        Ok(())
    }
}

/// An engine's `metainfer.toml`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EngineManifest {
    /// Model-family contract id, e.g. `model.llama`.
    pub family: String,
    /// Target platform name, e.g. `cpu` (a platform contract's `target`).
    pub target: String,
    /// Weight dtype the engine stores its weights in by default (one of `ckb::WEIGHT_DTYPES`).
    pub dtype: String,
    /// What the agent building the engine could read.
    pub reference_level: ReferenceLevel,
    /// Cargo features that build the engine for another weight dtype, e.g. `bf16 = ["bf16"]`.
    pub dtype_features: BTreeMap<String, Vec<String>>,
    /// The model directory the engine was scaffolded for, if recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The platform contract id, where several share the target (e.g. `platform.cuda-sm90` for
    /// target `cuda`); absent: the target's only platform.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
    /// Serving constraints (`[serving]`): present when the engine serves several sequences at once
    /// (paged KV cache, scheduler, batched step, OpenAI-compatible server); absent for a batch-1
    /// greedy library.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serving: Option<Serving>,
    /// Every other key as written (e.g. the model's shape), recorded with each outcome.
    #[serde(flatten)]
    pub other: toml::Table,
}

impl Default for EngineManifest {
    fn default() -> Self {
        EngineManifest {
            family: "model.llama".into(),
            target: "cpu".into(),
            dtype: "f32".into(),
            reference_level: ReferenceLevel::Zero,
            dtype_features: BTreeMap::new(),
            model: None,
            platform: None,
            serving: None,
            other: toml::Table::new(),
        }
    }
}

impl EngineManifest {
    /// Read the manifest of the engine crate in `dir`; every default when the file is absent.
    ///
    /// # Errors
    /// [`base::error::ErrorKind::Input`] when it is not a regular file or too large
    /// (`util::METAINFER_TOML`); Usage naming the file and the key when it is not TOML, ill-typed, or
    /// names an unknown dtype, a malformed family or target.
    pub fn read(dir: &Path) -> Result<EngineManifest> {
        let path = dir.join(FILE);
        if let Err(e) = std::fs::symlink_metadata(&path) {
            if e.kind() == std::io::ErrorKind::NotFound {
                return Ok(EngineManifest::default());
            }
            return Err(Error::usage(format!("{}: {e}", path.display())));
        }
        // A regular file of bounded size (a FIFO, a device or a huge file is refused by name).
        let text = base::util::read_regular_text(&path, &base::util::METAINFER_TOML)?;
        EngineManifest::parse(&text).map_err(|e| Error::usage(format!("{}: {}", path.display(), e.message)))
    }

    /// Parse and check a manifest's text.
    ///
    /// # Errors
    /// As [`EngineManifest::read`], without the file name.
    pub fn parse(text: &str) -> Result<EngineManifest> {
        let m: EngineManifest = toml::from_str(text).map_err(|e| {
            let at = e.to_string().lines().find(|l| l.contains('|') && l.trim_start().chars().next().is_some_and(|c| c.is_ascii_digit())).map(|l| format!(" at `{}`", l.split('|').nth(1).unwrap_or("").trim())).unwrap_or_default();
            Error::usage(format!(
                "{}{at}; the keys are family, target, platform, dtype, reference_level, model, [dtype_features] (a table of dtype = [features]) and [serving] (max_seqs, max_context, block_size, kv_blocks, max_batch_tokens, sampling)",
                e.message().trim()
            ))
        })?;
        let name_ok = |s: &str| {
            !s.is_empty() && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
        };
        if !m.family.strip_prefix("model.").is_some_and(name_ok) {
            return Err(Error::usage(format!(
                "key `family` = {:?} is not a model-family contract id; write e.g. family = \"model.llama\"",
                m.family
            )));
        }
        if let Some(p) = &m.platform
            && !p.strip_prefix("platform.").is_some_and(name_ok)
        {
            return Err(Error::usage(format!(
                "key `platform` = {p:?} is not a platform contract id; write e.g. platform = \"platform.cuda-sm90\""
            )));
        }
        if !name_ok(&m.target) {
            return Err(Error::usage(format!(
                "key `target` = {:?} is not a platform name; write e.g. target = \"cpu\"",
                m.target
            )));
        }
        let known = ckb::WEIGHT_DTYPES;
        for d in std::iter::once(&m.dtype).chain(m.dtype_features.keys()) {
            if !known.contains(&d.as_str()) {
                let key = if *d == m.dtype { "dtype".to_string() } else { format!("dtype_features.{d}") };
                return Err(Error::usage(format!(
                    "key `{key}`: weight dtype {d:?} is unknown; use one of {}",
                    known.join(", ")
                )));
            }
        }
        if let Some(sv) = &m.serving {
            sv.check().map_err(Error::usage)?;
        }
        Ok(m)
    }

    /// The Cargo features that build the engine for weight dtype `dtype`: none for its own dtype.
    /// None when the engine does not declare the dtype.
    pub fn features_for(&self, dtype: &str) -> Option<Vec<String>> {
        match self.dtype_features.get(dtype) {
            Some(f) => Some(f.clone()),
            None if dtype == self.dtype => Some(vec![]),
            None => None,
        }
    }

    /// Every dtype the engine can be built for: its own, then those of `[dtype_features]`.
    pub fn dtypes(&self) -> Vec<String> {
        let mut v = vec![self.dtype.clone()];
        v.extend(self.dtype_features.keys().filter(|d| **d != self.dtype).cloned());
        v
    }

    /// The manifest as JSON (the constraints recorded with an outcome).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or_else(|_| serde_json::json!({}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaffolded_manifest_parses_with_its_extra_keys() {
        let m = EngineManifest::parse(
            "family = \"model.qwen3\"\ntarget = \"cpu\"\ndtype = \"bf16\"\nreference_level = \"docs\"\nhidden = 128\n\n[dtype_features]\nint8 = [\"int8\"]\n",
        )
        .unwrap();
        assert_eq!(
            (m.family.as_str(), m.dtype.as_str(), m.reference_level),
            ("model.qwen3", "bf16", ReferenceLevel::Docs)
        );
        assert_eq!(m.other.get("hidden").and_then(|v| v.as_integer()), Some(128));
        assert_eq!(m.features_for("int8"), Some(vec!["int8".to_string()]));
        assert_eq!(m.features_for("bf16"), Some(vec![]));
        assert_eq!(m.features_for("f16"), None);
        assert_eq!(m.dtypes(), vec!["bf16", "int8"]);
        assert_eq!(EngineManifest::parse("").unwrap(), EngineManifest::default());
        assert_eq!(m.serving, None);
    }

    #[test]
    fn serving_table_parses_with_defaults() {
        let m = EngineManifest::parse("[serving]\nmax_seqs = 16\nmax_context = 256\nsampling = true\n").unwrap();
        let s = m.serving.unwrap();
        // 16 sequences of ceil(256 / 16) = 16 blocks each.
        assert_eq!((s.block_size, s.blocks(), s.batch_tokens(), s.sampling), (16, 256, 256, true));
    }

    #[test]
    fn bad_manifests_name_the_key() {
        for (text, key) in [
            ("family = 3", "family"),
            ("family = \"llama\"", "family"),
            ("dtype = \"fp8\"", "dtype"),
            ("dtype = [\"f32\"]", "dtype"),
            ("reference_level = \"all\"", "reference_level"),
            ("target = \"../x\"", "target"),
            ("[dtype_features]\nbf16 = \"bf16\"", "dtype_features"),
            ("[dtype_features]\nfp4 = [\"fp4\"]", "dtype_features.fp4"),
            ("family = ", ""),
            ("[serving]\nmax_seqs = 0\nmax_context = 64", "serving.max_seqs"),
            ("[serving]\nmax_seqs = 4\nmax_context = 64\nkv_blocks = 2", "serving.kv_blocks"),
            ("[serving]\nmax_seqs = 4\nmax_context = 64\nmax_batch_tokens = 2", "serving.max_batch_tokens"),
            ("[serving]\nmax_seqs = 4", "max_context"),
            ("[serving]\nmax_seqs = 4\nmax_context = 64\nbeam = 2", "beam"),
        ] {
            let e = EngineManifest::parse(text).unwrap_err();
            assert!(e.message.contains(key), "{text:?}: {}", e.message);
        }
    }
}
