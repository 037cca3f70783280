//! Phase 5, the tokenizer (contract `component.tokenizer`): tokenizer.json of a BPE model read and
//! applied as Hugging Face `tokenizers` does for SentencePiece-style vocabularies. Every pipeline
//! stage is an enum of the component types covered (normalizer, model, post-processor, decoder);
//! a type outside them is refused at load with its name, never skipped. Another tokenizer family
//! (e.g. byte-level BPE) adds its stages as variants here.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde_json::Value;

/// A normalizer step, applied to each text piece between added tokens.
enum Normalizer {
    /// Put this string in front of a non-empty piece.
    Prepend(String),
    /// Replace every occurrence of the first string by the second.
    Replace(String, String),
}

/// A decoder step, applied to the list of token strings.
enum Decoder {
    /// Replace the first string by the second in every token.
    Replace(String, String),
    /// Turn each run of `<0xHH>` tokens into its bytes, read as UTF-8 (U+FFFD per byte if invalid).
    ByteFallback,
    /// Concatenate all tokens into one.
    Fuse,
    /// Remove up to `start` leading and `stop` trailing `content` characters from every token.
    Strip { content: char, start: usize, stop: usize },
}

pub struct Tokenizer {
    vocab: HashMap<String, u32>,
    tokens: HashMap<u32, String>,
    /// (left id, right id) -> (rank, merged id).
    merges: HashMap<(u32, u32), (usize, u32)>,
    unk: Option<u32>,
    fuse_unk: bool,
    byte_fallback: bool,
    /// Added tokens (content, id), longest first; matched in the raw text before anything else.
    added: Vec<(String, u32)>,
    /// Ids of added tokens marked special (dropped by decode).
    special: HashSet<u32>,
    normalizer: Vec<Normalizer>,
    /// The post-processor's ids before and after the encoded sequence (e.g. BOS before).
    template: (Vec<u32>, Vec<u32>),
    decoder: Vec<Decoder>,
}

impl Tokenizer {
    /// Load `tokenizer.json` from the model directory.
    pub fn load(dir: &Path) -> Result<Tokenizer, String> {
        let path = dir.join("tokenizer.json");
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: cannot read ({e})", path.display()))?;
        let json: Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: not valid JSON ({e})", path.display()))?;
        Tokenizer::from_json(&json).map_err(|e| format!("tokenizer.json: {e}"))
    }

    fn from_json(j: &Value) -> Result<Tokenizer, String> {
        let model = &j["model"];
        if model["type"] != "BPE" {
            return Err(format!("model type {} is not covered (BPE)", model["type"]));
        }
        for key in ["continuing_subword_prefix", "end_of_word_suffix", "dropout"] {
            if !model[key].is_null() {
                return Err(format!("model.{key} = {} is not covered", model[key]));
            }
        }
        let mut vocab = HashMap::new();
        for (token, id) in model["vocab"].as_object().ok_or("model.vocab must be an object")? {
            vocab.insert(
                token.clone(),
                id.as_u64().ok_or_else(|| format!("vocab id of {token:?} must be an integer"))? as u32,
            );
        }
        let mut added = Vec::new();
        let mut special = HashSet::new();
        for t in j["added_tokens"].as_array().into_iter().flatten() {
            let (content, id) =
                (t["content"].as_str().unwrap_or(""), t["id"].as_u64().ok_or("added token without id")? as u32);
            if t["special"] == true {
                special.insert(id);
            }
            if !content.is_empty() {
                vocab.insert(content.to_string(), id);
                added.push((content.to_string(), id));
            }
        }
        added.sort_by_key(|(content, _)| std::cmp::Reverse(content.len()));
        let mut merges = HashMap::new();
        for (rank, m) in model["merges"].as_array().ok_or("model.merges must be a list")?.iter().enumerate() {
            // "left right" (split at the single space) or ["left", "right"].
            let (left, right) = match m {
                Value::String(s) => s.split_once(' ').ok_or_else(|| format!("merge {s:?} has no space"))?,
                Value::Array(a) if a.len() == 2 => (a[0].as_str().unwrap_or(""), a[1].as_str().unwrap_or("")),
                other => return Err(format!("merge {other} is neither \"a b\" nor [\"a\", \"b\"]")),
            };
            let id = |t: &str| {
                vocab.get(t).copied().ok_or_else(|| format!("merge {left:?} {right:?}: {t:?} is not in the vocabulary"))
            };
            merges.insert((id(left)?, id(right)?), (rank, id(&format!("{left}{right}"))?));
        }
        if model["ignore_merges"] == true {
            return Err("model.ignore_merges = true is not covered".into());
        }
        let unk = match model["unk_token"].as_str() {
            Some(t) => Some(*vocab.get(t).ok_or_else(|| format!("unk_token {t:?} is not in the vocabulary"))?),
            None => None,
        };
        if !j["pre_tokenizer"].is_null() {
            return Err(format!("pre_tokenizer {} is not covered (null)", j["pre_tokenizer"]["type"]));
        }
        Ok(Tokenizer {
            tokens: vocab.iter().map(|(t, &id)| (id, t.clone())).collect(),
            vocab,
            merges,
            unk,
            fuse_unk: model["fuse_unk"] == true,
            byte_fallback: model["byte_fallback"] == true,
            added,
            special,
            normalizer: steps(&j["normalizer"], "normalizers", normalizer)?,
            template: template(&j["post_processor"])?,
            decoder: steps(&j["decoder"], "decoders", decoder)?,
        })
    }

    /// Encode text as the HF tokenizer does with add_special_tokens = true (normalizer, BPE, post-processor BOS).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        let mut piece_start = 0;
        let mut i = 0;
        while i < text.len() {
            match self.added.iter().find(|(content, _)| text[i..].starts_with(content.as_str())) {
                Some((content, id)) => {
                    self.encode_piece(&text[piece_start..i], &mut ids);
                    ids.push(*id);
                    i += content.len();
                    piece_start = i;
                }
                None => i += text[i..].chars().next().map_or(1, char::len_utf8),
            }
        }
        self.encode_piece(&text[piece_start..], &mut ids);
        self.post_process(ids)
    }

    /// Normalise one piece of text between added tokens and append its BPE ids.
    fn encode_piece(&self, piece: &str, ids: &mut Vec<u32>) {
        let mut word = piece.to_string();
        for n in &self.normalizer {
            match n {
                Normalizer::Prepend(p) if !word.is_empty() => word.insert_str(0, p),
                Normalizer::Prepend(_) => {}
                Normalizer::Replace(from, to) => word = word.replace(from.as_str(), to),
            }
        }
        ids.extend(self.bpe(&word));
    }

    /// BPE of one word: one symbol per character (byte fallback or unk for characters outside the
    /// vocabulary), then the adjacent pair of lowest merge rank is merged, leftmost first, until none is left.
    fn bpe(&self, word: &str) -> Vec<u32> {
        let mut symbols: Vec<u32> = Vec::new();
        let mut after_unk = false;
        for ch in word.chars() {
            let mut buf = [0u8; 4];
            let ch = &*ch.encode_utf8(&mut buf);
            if let Some(&id) = self.vocab.get(ch) {
                symbols.push(id);
                after_unk = false;
                continue;
            }
            let bytes: Option<Vec<u32>> =
                ch.bytes().map(|b| self.vocab.get(&format!("<0x{b:02X}>")).copied()).collect();
            match (self.byte_fallback, bytes) {
                (true, Some(bytes)) => {
                    symbols.extend(bytes);
                    after_unk = false;
                }
                _ => {
                    if let Some(unk) = self.unk.filter(|_| !(self.fuse_unk && after_unk)) {
                        symbols.push(unk);
                    }
                    after_unk = true;
                }
            }
        }
        loop {
            let best = (1..symbols.len())
                .filter_map(|i| self.merges.get(&(symbols[i - 1], symbols[i])).map(|&(rank, id)| (rank, i, id)))
                .min();
            let Some((_, i, id)) = best else { return symbols };
            symbols[i - 1] = id;
            symbols.remove(i);
        }
    }

    /// The post-processor (TemplateProcessing, single sequence): its special ids around the sequence.
    fn post_process(&self, ids: Vec<u32>) -> Vec<u32> {
        let (before, after) = &self.template;
        [before.as_slice(), &ids, after].concat()
    }

    /// Decode ids as the HF tokenizer does with skip_special_tokens = true.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut tokens: Vec<String> =
            ids.iter().filter(|id| !self.special.contains(id)).filter_map(|id| self.tokens.get(id).cloned()).collect();
        for step in &self.decoder {
            tokens = match step {
                Decoder::Replace(from, to) => tokens.iter().map(|t| t.replace(from.as_str(), to)).collect(),
                Decoder::ByteFallback => byte_fallback(tokens),
                Decoder::Fuse => vec![tokens.concat()],
                Decoder::Strip { content, start, stop } => {
                    tokens.iter().map(|t| strip(t, *content, *start, *stop)).collect()
                }
            };
        }
        tokens.concat()
    }
}

/// A pipeline stage: null (no steps), a `Sequence` of steps under `list`, or one step.
fn steps<T>(v: &Value, list: &str, one: fn(&Value) -> Result<T, String>) -> Result<Vec<T>, String> {
    match v["type"].as_str() {
        _ if v.is_null() => Ok(Vec::new()),
        Some("Sequence") => {
            v[list].as_array().ok_or_else(|| format!("Sequence without {list}"))?.iter().map(one).collect()
        }
        _ => Ok(vec![one(v)?]),
    }
}

/// The string a Replace step looks for (`pattern.String`; regex patterns are not covered) and its replacement.
fn replace(v: &Value) -> Result<(String, String), String> {
    let from = v["pattern"]["String"]
        .as_str()
        .ok_or_else(|| format!("Replace pattern {} is not covered (String)", v["pattern"]))?;
    Ok((from.to_string(), v["content"].as_str().unwrap_or("").to_string()))
}

fn normalizer(v: &Value) -> Result<Normalizer, String> {
    match v["type"].as_str() {
        Some("Prepend") => Ok(Normalizer::Prepend(v["prepend"].as_str().unwrap_or("").to_string())),
        Some("Replace") => replace(v).map(|(from, to)| Normalizer::Replace(from, to)),
        _ => Err(format!("normalizer {} is not covered (Prepend, Replace)", v["type"])),
    }
}

fn decoder(v: &Value) -> Result<Decoder, String> {
    match v["type"].as_str() {
        Some("Replace") => replace(v).map(|(from, to)| Decoder::Replace(from, to)),
        Some("ByteFallback") => Ok(Decoder::ByteFallback),
        Some("Fuse") => Ok(Decoder::Fuse),
        Some("Strip") => Ok(Decoder::Strip {
            content: v["content"].as_str().and_then(|c| c.chars().next()).unwrap_or(' '),
            start: v["start"].as_u64().unwrap_or(0) as usize,
            stop: v["stop"].as_u64().unwrap_or(0) as usize,
        }),
        _ => Err(format!("decoder {} is not covered (Replace, ByteFallback, Fuse, Strip)", v["type"])),
    }
}

/// TemplateProcessing's `single` template as (ids before, ids after) the sequence `$A`; null: none.
fn template(v: &Value) -> Result<(Vec<u32>, Vec<u32>), String> {
    if v.is_null() {
        return Ok((Vec::new(), Vec::new()));
    }
    if v["type"] != "TemplateProcessing" {
        return Err(format!("post_processor {} is not covered (TemplateProcessing)", v["type"]));
    }
    let (mut before, mut after, mut seen) = (Vec::new(), Vec::new(), false);
    for piece in v["single"].as_array().ok_or("post_processor.single must be a list")? {
        if piece.get("Sequence").is_some() {
            seen = true;
            continue;
        }
        let name =
            piece["SpecialToken"]["id"].as_str().ok_or_else(|| format!("template piece {piece} is not covered"))?;
        let ids =
            v["special_tokens"][name]["ids"].as_array().ok_or_else(|| format!("template token {name:?} has no ids"))?;
        let ids = ids.iter().map(|i| i.as_u64().map(|i| i as u32).ok_or("template ids must be integers"));
        let out = if seen { &mut after } else { &mut before };
        for id in ids {
            out.push(id?);
        }
    }
    Ok((before, after))
}

/// ByteFallback decoding: runs of `<0xHH>` tokens become their bytes, read as UTF-8, or one U+FFFD
/// per byte when the run is not valid UTF-8.
fn byte_fallback(tokens: Vec<String>) -> Vec<String> {
    let mut out = Vec::new();
    let mut bytes = Vec::new();
    let flush = |bytes: &mut Vec<u8>, out: &mut Vec<String>| {
        if !bytes.is_empty() {
            out.push(String::from_utf8(bytes.clone()).unwrap_or_else(|_| "\u{FFFD}".repeat(bytes.len())));
            bytes.clear();
        }
    };
    for t in tokens {
        let byte = t.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')).filter(|h| h.len() == 2);
        match byte.and_then(|h| u8::from_str_radix(h, 16).ok()) {
            Some(b) => bytes.push(b),
            None => {
                flush(&mut bytes, &mut out);
                out.push(t);
            }
        }
    }
    flush(&mut bytes, &mut out);
    out
}

/// Remove up to `start` leading and up to `stop` trailing `content` characters.
fn strip(t: &str, content: char, start: usize, stop: usize) -> String {
    let lead = t.chars().take(start).take_while(|&c| c == content).count();
    let rest: Vec<char> = t.chars().skip(lead).collect();
    let trail = rest.iter().rev().take(stop).take_while(|&&c| c == content).count();
    rest[..rest.len() - trail].iter().collect()
}
