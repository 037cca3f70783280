//! Phase 5, the tokenizer: tokenizer.json of a BPE model read and applied as Hugging Face
//! `tokenizers` does, for SentencePiece-style vocabularies (contract `component.tokenizer`) and
//! byte-level ones (GPT-2, Llama 3, Qwen2: contract `component.tokenizer_bytelevel`). Every
//! pipeline stage is an enum of the component types covered (normalizer, pre-tokenizer, model,
//! post-processor, decoder); a type outside them is refused at load with its name, never skipped.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use fancy_regex::Regex;
use serde_json::Value;
use unicode_normalization::UnicodeNormalization;

/// The split pattern of a `ByteLevel` pre-tokenizer with `use_regex` (GPT-2's; the byte-level
/// contract's `split_patterns` "gpt2").
const GPT2_SPLIT: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The byte-level contract's table B from bytes to characters: the printable bytes 0x21..=0x7E,
/// 0xA1..=0xAC and 0xAE..=0xFF stand for themselves; the other 68, in increasing order, become
/// U+0100, U+0101, ... (so the space 0x20 is U+0120 "Ġ").
fn byte_to_char() -> Vec<char> {
    let mut shifted = 0x100u32;
    (0u32..256)
        .map(|b| {
            if (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b) {
                char::from_u32(b).unwrap_or('?')
            } else {
                shifted += 1;
                char::from_u32(shifted - 1).unwrap_or('?')
            }
        })
        .collect()
}

/// A pre-tokenizer step, applied to the words of a normalised piece (at first, the piece itself).
enum PreTokenizer {
    /// Split each word at the regex's matches; matches and the text between them are all words
    /// (behavior Isolated).
    Split(Regex),
    /// Replace each byte of a word's UTF-8 by its character of the byte table.
    ByteLevel,
}

/// A normalizer step, applied to each text piece between added tokens.
enum Normalizer {
    /// Put this string in front of a non-empty piece.
    Prepend(String),
    /// Replace every occurrence of the first string by the second.
    Replace(String, String),
    /// Unicode canonical composition (NFC, UAX #15).
    Nfc,
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
    /// Every token's characters back to their bytes (a token with a character outside the byte
    /// table keeps its own UTF-8), all tokens' bytes read as one UTF-8 text, U+FFFD where invalid.
    ByteLevel,
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
    pre_tokenizer: Vec<PreTokenizer>,
    /// BPE's `ignore_merges`: a word that is a vocabulary entry is that one token.
    ignore_merges: bool,
    /// The byte table (byte-level vocabularies).
    byte_to_char: Vec<char>,
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
        let unk = match model["unk_token"].as_str() {
            Some(t) => Some(*vocab.get(t).ok_or_else(|| format!("unk_token {t:?} is not in the vocabulary"))?),
            None => None,
        };
        let mut pre_tokenizer = Vec::new();
        for step in steps(&j["pre_tokenizer"], "pretokenizers", |v| Ok(v.clone()))? {
            pre_tokenizer.extend(pre_tokenizer_step(&step)?);
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
            pre_tokenizer,
            ignore_merges: model["ignore_merges"] == true,
            byte_to_char: byte_to_char(),
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

    /// Normalise one piece of text between added tokens, pre-tokenise it into words and append
    /// their BPE ids.
    fn encode_piece(&self, piece: &str, ids: &mut Vec<u32>) {
        let mut word = piece.to_string();
        for n in &self.normalizer {
            match n {
                Normalizer::Prepend(p) if !word.is_empty() => word.insert_str(0, p),
                Normalizer::Prepend(_) => {}
                Normalizer::Replace(from, to) => word = word.replace(from.as_str(), to),
                Normalizer::Nfc => word = word.nfc().collect(),
            }
        }
        let mut words = vec![word];
        for step in &self.pre_tokenizer {
            words = match step {
                PreTokenizer::Split(regex) => words.iter().flat_map(|w| split(regex, w)).collect(),
                PreTokenizer::ByteLevel => {
                    words.iter().map(|w| w.bytes().map(|b| self.byte_to_char[b as usize]).collect()).collect()
                }
            };
        }
        for word in words {
            match self.vocab.get(&word).filter(|_| self.ignore_merges) {
                Some(&id) => ids.push(id),
                None => ids.extend(self.bpe(&word)),
            }
        }
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
                Decoder::ByteLevel => {
                    let mut bytes = Vec::new();
                    for t in &tokens {
                        let of_table: Option<Vec<u8>> = t
                            .chars()
                            .map(|c| self.byte_to_char.iter().position(|&b| b == c).map(|b| b as u8))
                            .collect();
                        bytes.extend(of_table.unwrap_or_else(|| t.as_bytes().to_vec()));
                    }
                    vec![String::from_utf8_lossy(&bytes).into_owned()]
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
        Some("NFC") => Ok(Normalizer::Nfc),
        _ => Err(format!("normalizer {} is not covered (Prepend, Replace, NFC)", v["type"])),
    }
}

/// One pre-tokenizer of tokenizer.json as the steps it takes: `Split` (a Regex or String pattern,
/// behavior Isolated, not inverted); `ByteLevel` (add_prefix_space false), preceded by a Split with
/// GPT-2's pattern when `use_regex` is true or absent.
fn pre_tokenizer_step(v: &Value) -> Result<Vec<PreTokenizer>, String> {
    match v["type"].as_str() {
        Some("Split") => {
            if v["behavior"] != "Isolated" || v["invert"] == true {
                return Err(format!(
                    "Split behavior {} with invert {} is not covered (Isolated, not inverted)",
                    v["behavior"], v["invert"]
                ));
            }
            let pattern = match (v["pattern"]["Regex"].as_str(), v["pattern"]["String"].as_str()) {
                (Some(r), _) => r.to_string(),
                (None, Some(s)) => fancy_regex::escape(s).into_owned(),
                _ => return Err(format!("Split pattern {} is neither Regex nor String", v["pattern"])),
            };
            let regex = Regex::new(&pattern).map_err(|e| format!("Split pattern {pattern:?}: {e}"))?;
            Ok(vec![PreTokenizer::Split(regex)])
        }
        Some("ByteLevel") => {
            if v["add_prefix_space"] == true {
                return Err("ByteLevel pre_tokenizer with add_prefix_space = true is not covered".into());
            }
            let mut out = Vec::new();
            if v["use_regex"] != false {
                out.push(PreTokenizer::Split(Regex::new(GPT2_SPLIT).map_err(|e| e.to_string())?));
            }
            out.push(PreTokenizer::ByteLevel);
            Ok(out)
        }
        _ => Err(format!("pre_tokenizer {} is not covered (Split, ByteLevel)", v["type"])),
    }
}

/// The words of `text` under a Split with behavior Isolated: each match of the regex (leftmost,
/// non-overlapping) and each stretch of text between matches. A regex that gives up (its
/// backtracking limit) leaves the rest of the text as one word.
fn split(regex: &Regex, text: &str) -> Vec<String> {
    let (mut words, mut at) = (Vec::new(), 0);
    for m in regex.find_iter(text) {
        let Ok(m) = m else { break };
        if m.start() > at {
            words.push(text[at..m.start()].to_string());
        }
        if !m.as_str().is_empty() {
            words.push(m.as_str().to_string());
        }
        at = m.end();
    }
    if at < text.len() {
        words.push(text[at..].to_string());
    }
    words
}

fn decoder(v: &Value) -> Result<Decoder, String> {
    match v["type"].as_str() {
        Some("Replace") => replace(v).map(|(from, to)| Decoder::Replace(from, to)),
        Some("ByteFallback") => Ok(Decoder::ByteFallback),
        Some("Fuse") => Ok(Decoder::Fuse),
        Some("ByteLevel") => Ok(Decoder::ByteLevel),
        Some("Strip") => Ok(Decoder::Strip {
            content: v["content"].as_str().and_then(|c| c.chars().next()).unwrap_or(' '),
            start: v["start"].as_u64().unwrap_or(0) as usize,
            stop: v["stop"].as_u64().unwrap_or(0) as usize,
        }),
        _ => Err(format!("decoder {} is not covered (Replace, ByteFallback, Fuse, Strip, ByteLevel)", v["type"])),
    }
}

/// TemplateProcessing's `single` template as (ids before, ids after) the sequence `$A`; null or
/// ByteLevel (which changes offsets, never ids): none; a Sequence: its one TemplateProcessing.
fn template(v: &Value) -> Result<(Vec<u32>, Vec<u32>), String> {
    match v["type"].as_str() {
        _ if v.is_null() => return Ok((Vec::new(), Vec::new())),
        Some("ByteLevel") => return Ok((Vec::new(), Vec::new())),
        Some("Sequence") => {
            let mut found = (Vec::new(), Vec::new());
            for p in v["processors"].as_array().ok_or("post_processor Sequence without processors")? {
                let (before, after) = template(p)?;
                if !before.is_empty() || !after.is_empty() {
                    found = (before, after);
                }
            }
            return Ok(found);
        }
        Some("TemplateProcessing") => {}
        _ => return Err(format!("post_processor {} is not covered (TemplateProcessing, ByteLevel)", v["type"])),
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
