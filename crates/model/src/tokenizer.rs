//! tokenizer.json against the tokenizer contracts: the file described as a list of components
//! (`model BPE`, `normalizer NFC`, `pre_tokenizer Split(llama3)`, ...), routed to the contract that
//! covers every one ([`route_tokenizer`]), or the uncovered ones named as gaps, before any engine code is
//! written. Also the id check against the model's vocabulary, and the real-vocabulary test vectors
//! (`tests.json` beside a tokenizer.json: texts with the ids the original tokenizer gives them without
//! special tokens).

use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::Files;
use super::Gap;
use base::error::{Error, Result};
use ckb::{Ckb, Contract, TokenizerFamily};

/// One component of a tokenizer.json, as routing names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TokenizerPart {
    /// `model`, `normalizer`, `pre_tokenizer`, `decoder` or `post_processor`.
    pub slot: String,
    /// Type name, with the option that matters in parentheses: `BPE`, `ignore_merges`, `NFC`,
    /// `Split(llama3)` (a covered pattern by name), `Split("<regex>", Isolated)` (any other).
    pub name: String,
}

impl std::fmt::Display for TokenizerPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.slot, self.name)
    }
}

/// How a model's tokenizer.json was routed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TokenizerRoute {
    /// Tokenizer contract id covering every component, e.g. `component.tokenizer_bytelevel`.
    pub contract: String,
    /// The components, in file order (Sequences flattened).
    pub parts: Vec<String>,
    /// Entries of model.vocab plus added tokens.
    pub vocab_entries: usize,
    /// Added tokens marked special (their content, e.g. `<|endoftext|>`).
    pub special_tokens: Vec<String>,
}

/// Read and parse `dir/tokenizer.json` as JSON.
///
/// # Errors
/// [`base::error::ErrorKind::Input`] naming the file when it is missing or not a JSON object.
pub fn read_tokenizer_json(dir: &(impl Files + ?Sized)) -> Result<Value> {
    let text = dir.read_text("tokenizer.json", &base::util::TOKENIZER_JSON)?;
    parse_tokenizer_json(&dir.show("tokenizer.json"), text.as_bytes())
}

/// tokenizer.json's `bytes` (read from `path`, named in errors) as a JSON object.
///
/// # Errors
/// [`base::error::ErrorKind::Input`] naming `path`: not JSON, or not an object.
pub fn parse_tokenizer_json(path: &std::path::Path, bytes: &[u8]) -> Result<Value> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(Error::input(format!("{}: must be a JSON object", path.display()))),
        Err(e) => Err(Error::input(format!("{}: not valid JSON: {e}", path.display()))),
    }
}

/// The parts of `dir/tokenizer.json` routing reads (model type and options, normalizer,
/// pre-tokenizer, decoder, post-processor), skipping the vocabulary and merges without building them
/// (a Llama 3 tokenizer.json is 10 MB, nearly all of it vocabulary and merges).
///
/// # Errors
/// As [`read_tokenizer_json`].
pub fn read_tokenizer_head(dir: &(impl Files + ?Sized)) -> Result<Value> {
    #[derive(Deserialize)]
    struct ModelHead {
        #[serde(rename = "type", default)]
        ty: Value,
        #[serde(default)]
        byte_fallback: Value,
        #[serde(default)]
        fuse_unk: Value,
        #[serde(default)]
        ignore_merges: Value,
        #[serde(default)]
        continuing_subword_prefix: Value,
        #[serde(default)]
        end_of_word_suffix: Value,
        #[serde(default)]
        dropout: Value,
    }
    #[derive(Deserialize)]
    struct Head {
        model: ModelHead,
        #[serde(default)]
        normalizer: Value,
        #[serde(default)]
        pre_tokenizer: Value,
        #[serde(default)]
        decoder: Value,
        #[serde(default)]
        post_processor: Value,
    }
    let path = dir.show("tokenizer.json");
    let text = dir.read_text("tokenizer.json", &base::util::TOKENIZER_JSON)?;
    let h: Head = serde_json::from_str(&text)
        .map_err(|e| Error::input(format!("{}: not a tokenizer.json ({e})", path.display())))?;
    let m = h.model;
    Ok(serde_json::json!({
        "model": {"type": m.ty, "byte_fallback": m.byte_fallback, "fuse_unk": m.fuse_unk, "ignore_merges": m.ignore_merges,
                  "continuing_subword_prefix": m.continuing_subword_prefix, "end_of_word_suffix": m.end_of_word_suffix, "dropout": m.dropout},
        "normalizer": h.normalizer,
        "pre_tokenizer": h.pre_tokenizer,
        "decoder": h.decoder,
        "post_processor": h.post_processor,
    }))
}

fn type_of(v: &Value) -> &str {
    v.get("type").and_then(Value::as_str).unwrap_or("?")
}

/// The components of a tokenizer.json. Split patterns are named by the first pattern of `known`
/// that equals them character for character.
pub fn describe(json: &Value, known: &[&ckb::SplitPattern]) -> Vec<TokenizerPart> {
    let mut out = Vec::new();
    let mut push = |slot: &str, name: String| out.push(TokenizerPart { slot: slot.into(), name });
    let model = &json["model"];
    push("model", type_of(model).to_string());
    for flag in ["byte_fallback", "fuse_unk", "ignore_merges"] {
        if model.get(flag).and_then(Value::as_bool) == Some(true) {
            push("model", flag.into());
        }
    }
    for opt in ["continuing_subword_prefix", "end_of_word_suffix"] {
        if let Some(v) = model.get(opt).filter(|v| !v.is_null() && v.as_str() != Some("")) {
            push("model", format!("{opt}({v})"));
        }
    }
    if let Some(d) = model.get("dropout").and_then(Value::as_f64).filter(|d| *d > 0.0) {
        push("model", format!("dropout({d})"));
    }
    let flat = |v: &Value, list_key: &str| -> Vec<Value> {
        let mut todo = vec![v.clone()];
        let mut leaves = Vec::new();
        while let Some(x) = todo.pop() {
            if x.is_null() {
                continue;
            }
            if type_of(&x) == "Sequence" {
                let items = x.get(list_key).and_then(Value::as_array).cloned().unwrap_or_default();
                todo.extend(items.into_iter().rev());
            } else {
                leaves.push(x);
            }
        }
        leaves
    };
    let pattern_name = |p: &Value| -> String {
        match (p.get("Regex").and_then(Value::as_str), p.get("String").and_then(Value::as_str)) {
            (Some(r), _) => match known.iter().find(|k| k.regex == r) {
                Some(k) => k.name.clone(),
                None => format!("{r:?}"),
            },
            (None, Some(s)) => format!("String {s:?}"),
            _ => format!("{p}"),
        }
    };
    for n in flat(&json["normalizer"], "normalizers") {
        let name = match type_of(&n) {
            "Replace" if n["pattern"].get("String").is_none() => "Replace(Regex)".to_string(),
            t => t.to_string(),
        };
        push("normalizer", name);
    }
    let gpt2 = known.iter().find(|k| k.name == "gpt2").map(|k| k.name.clone()).unwrap_or_else(|| "gpt2".into());
    for p in flat(&json["pre_tokenizer"], "pretokenizers") {
        match type_of(&p) {
            "Split" => {
                let behavior = p.get("behavior").and_then(Value::as_str).unwrap_or("?");
                let invert = p.get("invert").and_then(Value::as_bool).unwrap_or(false);
                let name = pattern_name(&p["pattern"]);
                let plain = behavior == "Isolated" && !invert && known.iter().any(|k| k.name == name);
                push(
                    "pre_tokenizer",
                    if plain {
                        format!("Split({name})")
                    } else {
                        format!("Split({name}, {behavior}{})", if invert { ", inverted" } else { "" })
                    },
                );
            }
            "ByteLevel" => {
                if p.get("use_regex").and_then(Value::as_bool) != Some(false) {
                    push("pre_tokenizer", format!("Split({gpt2})"));
                }
                if p.get("add_prefix_space").and_then(Value::as_bool) == Some(true) {
                    push("pre_tokenizer", "ByteLevel(add_prefix_space)".into());
                } else {
                    push("pre_tokenizer", "ByteLevel".into());
                }
            }
            t => push("pre_tokenizer", t.to_string()),
        }
    }
    for d in flat(&json["decoder"], "decoders") {
        let name = match type_of(&d) {
            "Replace" if d["pattern"].get("String").is_none() => "Replace(Regex)".to_string(),
            t => t.to_string(),
        };
        push("decoder", name);
    }
    for p in flat(&json["post_processor"], "processors") {
        push("post_processor", type_of(&p).to_string());
    }
    out
}

/// The components of `parts` a contract's `[tokenizer]` section does not cover.
pub fn uncovered(tok: &TokenizerFamily, parts: &[TokenizerPart]) -> Vec<TokenizerPart> {
    parts
        .iter()
        .filter(|p| {
            let list = match p.slot.as_str() {
                "model" => &tok.model,
                "normalizer" => &tok.normalizers,
                "pre_tokenizer" => &tok.pre_tokenizers,
                "decoder" => &tok.decoders,
                _ => &tok.post_processors,
            };
            let split = p.name.strip_prefix("Split(").and_then(|r| r.strip_suffix(')'));
            let covered = match split {
                Some(name) => tok.split_patterns.iter().any(|k| k.name == name),
                None => list.contains(&p.name),
            };
            !covered
        })
        .cloned()
        .collect()
}

/// Route a parsed tokenizer.json to the tokenizer contract covering all its components.
///
/// # Errors
/// The gaps (field `tokenizer`), each naming an uncovered component and the closest contract, e.g.
/// `pre_tokenizer Split("\\s+", Removed) not covered by component.tokenizer_bytelevel`.
pub fn route_tokenizer<'a>(
    ckb: &'a Ckb,
    json: &Value,
) -> std::result::Result<(&'a Contract, Vec<TokenizerPart>), Vec<Gap>> {
    let contracts: Vec<&Contract> = ckb.all().filter(|c| c.tokenizer.is_some()).collect();
    let known: Vec<&ckb::SplitPattern> =
        contracts.iter().flat_map(|c| c.tokenizer.as_ref().unwrap().split_patterns.iter()).collect();
    let parts = describe(json, &known);
    let mut best: Option<(&Contract, Vec<TokenizerPart>)> = None;
    for c in contracts {
        let missing = uncovered(c.tokenizer.as_ref().unwrap(), &parts);
        if missing.is_empty() {
            return Ok((c, parts));
        }
        if best.as_ref().is_none_or(|(_, m)| missing.len() < m.len()) {
            best = Some((c, missing));
        }
    }
    let Some((closest, missing)) = best else {
        return Err(vec![Gap {
            field: "tokenizer".into(),
            reason: "the knowledge base has no tokenizer contract (a component contract with a [tokenizer] section)"
                .into(),
        }]);
    };
    Err(missing
        .iter()
        .map(|p| Gap {
            field: "tokenizer".into(),
            reason: format!(
                "{p} not covered by {} (closest tokenizer contract; it covers {}); a tokenizer contract covering it is needed",
                closest.id,
                covered_text(closest.tokenizer.as_ref().unwrap(), &p.slot)
            ),
        })
        .collect())
}

fn covered_text(tok: &TokenizerFamily, slot: &str) -> String {
    let list: Vec<String> = match slot {
        "model" => tok.model.clone(),
        "normalizer" => tok.normalizers.clone(),
        "pre_tokenizer" => {
            let mut l = tok.pre_tokenizers.clone();
            l.extend(tok.split_patterns.iter().map(|p| format!("Split({})", p.name)));
            l
        }
        "decoder" => tok.decoders.clone(),
        _ => tok.post_processors.clone(),
    };
    if list.is_empty() { format!("no {slot}") } else { format!("{slot}s {}", list.join(", ")) }
}

/// Check every id of a tokenizer.json (model.vocab and added_tokens) against the model's vocabulary
/// size; return the number of entries and the special tokens' contents.
///
/// # Errors
/// [`base::error::ErrorKind::Input`] naming the file, the token and its id when an id is not below
/// `vocab` (the model has no logit and no embedding row for it), or when model.vocab is not an
/// object of token -> id.
pub fn check_ids(path: &Path, json: &Value, vocab: usize) -> Result<(usize, Vec<String>)> {
    let bad = |token: &str, id: u64| {
        Error::input(format!(
            "{}: token {token:?} has id {id}, not below config.json vocab_size {vocab}: the model has no embedding row or logit for it; use the tokenizer.json that belongs to this checkpoint",
            path.display()
        ))
    };
    let Some(v) = json["model"].get("vocab").and_then(Value::as_object) else {
        return Err(Error::input(format!("{}: model.vocab must be an object of token -> id", path.display())));
    };
    let mut entries = 0;
    for (token, id) in v {
        let Some(id) = id.as_u64() else {
            return Err(Error::input(format!(
                "{}: model.vocab[{token:?}] must be a non-negative integer id",
                path.display()
            )));
        };
        if id as usize >= vocab {
            return Err(bad(token, id));
        }
        entries += 1;
    }
    let mut special = Vec::new();
    for a in json["added_tokens"].as_array().map(Vec::as_slice).unwrap_or_default() {
        let content = a["content"].as_str().unwrap_or_default();
        let Some(id) = a["id"].as_u64() else {
            return Err(Error::input(format!("{}: added token {content:?} has no integer id", path.display())));
        };
        if id as usize >= vocab {
            return Err(bad(content, id));
        }
        if !v.contains_key(content) {
            entries += 1;
        }
        if a["special"].as_bool() == Some(true) {
            special.push(content.to_string());
        }
    }
    Ok((entries, special))
}

/// Route `dir/tokenizer.json` to its tokenizer contract and check its ids against `vocab`: the
/// contract id and the route.
///
/// # Errors
/// [`base::error::ErrorKind::Input`] for a missing or malformed file or an id not below `vocab`;
/// [`base::error::ErrorKind::Usage`] listing the uncovered components when no contract covers it.
pub fn check_model_tokenizer(ckb: &Ckb, dir: &(impl Files + ?Sized), vocab: usize) -> Result<(String, TokenizerRoute)> {
    check_tokenizer_json(ckb, dir, &read_tokenizer_json(dir)?, vocab)
}

/// As [`check_model_tokenizer`], on `json`: `dir`'s tokenizer.json, already read and parsed.
///
/// # Errors
/// As [`check_model_tokenizer`].
pub fn check_tokenizer_json(
    ckb: &Ckb,
    dir: &(impl Files + ?Sized),
    json: &Value,
    vocab: usize,
) -> Result<(String, TokenizerRoute)> {
    let (entries, special_tokens) = check_ids(&dir.show("tokenizer.json"), json, vocab)?;
    let (contract, parts) = route_tokenizer(ckb, json).map_err(|gaps| {
        Error::usage(format!(
            "{}/tokenizer.json is not covered by the knowledge base:\n{}",
            dir.path().display(),
            gaps.iter().map(|g| format!("  {}: {}", g.field, g.reason)).collect::<Vec<_>>().join("\n")
        ))
    })?;
    let route = TokenizerRoute {
        contract: contract.id.clone(),
        parts: parts.iter().map(ToString::to_string).collect(),
        vocab_entries: entries,
        special_tokens,
    };
    Ok((contract.id.clone(), route))
}

/// One real vocabulary's test vectors: `dir/tokenizer.json` and `dir/tests.json`
/// (`[{"text", "ids"}]`, ids made by the original tokenizer with add_special_tokens = false).
#[derive(Debug, Clone)]
pub struct VectorSet {
    /// Folder name, e.g. `llama-bpe`.
    pub name: String,
    /// The folder (holds tokenizer.json).
    pub dir: PathBuf,
    /// Tokenizer contract the vocabulary routes to.
    pub contract: String,
    /// (text, ids) pairs in file order.
    pub cases: Vec<(String, Vec<u32>)>,
}

/// Where the real-vocabulary test vectors are: `$METAINFER_TOKENIZERS`, or `../shared/tokenizers`
/// beside the repository.
pub fn vectors_dir() -> PathBuf {
    if let Ok(p) = std::env::var("METAINFER_TOKENIZERS") {
        return PathBuf::from(p);
    }
    // crates/model -> the repository -> the folder beside it.
    let repository = Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2).unwrap_or(Path::new("."));
    repository.parent().unwrap_or(repository).join("shared/tokenizers")
}

/// Read one folder of test vectors.
///
/// # Errors
/// [`base::error::ErrorKind::Input`] naming the file when tests.json is missing or malformed, or
/// when the tokenizer.json does not route to a tokenizer contract.
pub fn read_vector_set(ckb: &Ckb, dir: &Path) -> Result<VectorSet> {
    let path = dir.join("tests.json");
    let text = base::util::read_regular_text(&path, &base::util::TOKENIZER_VECTORS)?;
    #[derive(Deserialize)]
    struct Case {
        text: String,
        ids: Vec<u32>,
    }
    let cases: Vec<Case> = serde_json::from_str(&text)
        .map_err(|e| Error::input(format!("{}: must be a list of {{\"text\", \"ids\"}} ({e})", path.display())))?;
    let json = read_tokenizer_head(dir)?;
    let (contract, _) = route_tokenizer(ckb, &json).map_err(|g| {
        Error::input(format!(
            "{}/tokenizer.json routes to no tokenizer contract: {}",
            dir.display(),
            g.iter().map(|g| g.reason.as_str()).collect::<Vec<_>>().join("; ")
        ))
    })?;
    Ok(VectorSet {
        name: dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        dir: dir.to_path_buf(),
        contract: contract.id.clone(),
        cases: cases.into_iter().map(|c| (c.text, c.ids)).collect(),
    })
}

/// Every folder of [`vectors_dir`] (or `root`) holding tokenizer.json and tests.json, in name order,
/// with the tokenizer contract it routes to. A folder that does not route is skipped.
pub fn vector_sets(ckb: &Ckb, root: &Path) -> Vec<VectorSet> {
    let Ok(entries) = std::fs::read_dir(root) else { return vec![] };
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("tokenizer.json").is_file() && p.join("tests.json").is_file())
        .collect();
    dirs.sort();
    dirs.iter().filter_map(|d| read_vector_set(ckb, d).ok()).collect()
}
