//! Phase 5: tokenizer (HF tokenizer.json, BPE model).
//!
//! Supported `tokenizer.json` features (anything else is rejected at load with an error naming it):
//! - `added_tokens`, matched literally in the raw input (leftmost, longest first), honouring
//!   `lstrip`, `rstrip` and `single_word`;
//! - normalizers `Sequence`, `Prepend`, `Replace` (string patterns), `Lowercase`, `NFC`, or none;
//! - pre-tokenizers none (the whole normalised segment is one word), `Metaspace`, `Split` (a regex
//!   pattern, behavior `Isolated`, not inverted), `ByteLevel` (`add_prefix_space` false; with
//!   `use_regex` it splits with GPT-2's pattern first), or a `Sequence` of those;
//! - the `BPE` model (merges as `"a b"` or `["a", "b"]`, `byte_fallback`, `unk_token`,
//!   `fuse_unk`, `ignore_merges`);
//! - post-processors `TemplateProcessing` (the `single` template), `ByteLevel` (ids unchanged), a
//!   `Sequence` of those, or none;
//! - decoders `Sequence`, `Replace` (string patterns), `ByteFallback`, `Fuse`, `Strip`,
//!   `Metaspace`, `ByteLevel`, or none.
//!
//! Byte-level BPE (component.tokenizer_bytelevel): every byte of a word is mapped to a printable
//! character by the table `byte_chars` (the contract's B), merged by rank, and decoded back to bytes.
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::path::Path;

use fancy_regex::Regex;
use serde_json::Value;
use unicode_normalization::UnicodeNormalization;

/// GPT-2's split pattern: what a `ByteLevel` pre-tokenizer with `use_regex` splits by
/// (component.tokenizer_bytelevel, `split_patterns` "gpt2").
const GPT2_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The contract's byte-to-character table B: the 188 printable bytes (0x21..=0x7E, 0xA1..=0xAC,
/// 0xAE..=0xFF) map to the character of the same code point, the other 68 bytes, in increasing
/// order, to U+0100, U+0101, ...
fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        table[b as usize] = char::from_u32(code).expect("code points below U+0144 are characters");
    }
    table
}

/// A literal token matched in the raw input before normalisation.
struct AddedToken {
    id: u32,
    content: String,
    special: bool,
    lstrip: bool,
    rstrip: bool,
    single_word: bool,
}

enum Normalizer {
    Prepend(String),
    Replace {
        from: String,
        to: String,
    },
    Lowercase,
    /// Unicode canonical composition (UAX #15).
    Nfc,
}

#[derive(Clone, Copy, PartialEq)]
enum PrependScheme {
    Always,
    First,
    Never,
}

enum PreTokenizer {
    Metaspace {
        replacement: char,
        scheme: PrependScheme,
        split: bool,
    },
    /// Every match of the pattern is a word, and so is the text between two matches.
    Split(Regex),
    /// Each word's UTF-8 bytes become characters through `byte_chars`.
    ByteLevel,
}

enum Decoder {
    Replace {
        from: String,
        to: String,
    },
    ByteFallback,
    Fuse,
    Strip {
        content: char,
        start: usize,
        stop: usize,
    },
    Metaspace {
        replacement: char,
        scheme: PrependScheme,
    },
    /// Token characters back to bytes (characters outside the table keep their UTF-8 bytes); the
    /// bytes of all tokens read as UTF-8, lossily.
    ByteLevel,
}

/// One piece of the `single` post-processing template.
enum TemplatePiece {
    Special(Vec<u32>),
    Sequence,
}

pub struct Tokenizer {
    added: Vec<AddedToken>,
    normalizers: Vec<Normalizer>,
    pre_tokenizers: Vec<PreTokenizer>,
    vocab: HashMap<String, u32>,
    /// Token text by id (model vocabulary and added tokens).
    id_to_token: Vec<Option<String>>,
    /// Whether an id is a special added token (skipped when decoding).
    is_special: Vec<bool>,
    /// (left id, right id) -> (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32)>,
    unk_id: Option<u32>,
    fuse_unk: bool,
    byte_fallback: bool,
    ignore_merges: bool,
    template: Vec<TemplatePiece>,
    decoders: Vec<Decoder>,
    /// `byte_chars` and its inverse.
    byte_chars: [char; 256],
    char_bytes: HashMap<char, u8>,
}

// ---------------------------------------------------------------------------------------------
// Loading

fn field<'a>(v: &'a Value, key: &str, ctx: &str) -> Result<&'a Value, String> {
    v.get(key).ok_or_else(|| format!("tokenizer.json: {ctx} lacks field {key:?}"))
}

fn str_field<'a>(v: &'a Value, key: &str, ctx: &str) -> Result<&'a str, String> {
    field(v, key, ctx)?.as_str().ok_or_else(|| format!("tokenizer.json: {ctx} field {key:?} is not a string"))
}

fn bool_or(v: &Value, key: &str, default: bool) -> bool {
    v.get(key).and_then(Value::as_bool).unwrap_or(default)
}

fn type_of<'a>(v: &'a Value, ctx: &str) -> Result<&'a str, String> {
    str_field(v, "type", ctx)
}

fn single_char(s: &str, ctx: &str) -> Result<char, String> {
    let mut it = s.chars();
    match (it.next(), it.next()) {
        (Some(c), None) => Ok(c),
        _ => Err(format!("tokenizer.json: {ctx} expects a single character, got {s:?}")),
    }
}

/// A `Replace` pattern; only literal string patterns are supported.
fn string_pattern(v: &Value, ctx: &str) -> Result<(String, String), String> {
    let pattern = field(v, "pattern", ctx)?;
    let from = match pattern.get("String").and_then(Value::as_str) {
        Some(s) => s.to_string(),
        None => {
            return Err(format!("tokenizer.json: unsupported {ctx} pattern {pattern} (only String patterns)"));
        }
    };
    if from.is_empty() {
        return Err(format!("tokenizer.json: {ctx} has an empty pattern"));
    }
    let to = str_field(v, "content", ctx)?.to_string();
    Ok((from, to))
}

fn prepend_scheme(v: &Value, ctx: &str) -> Result<PrependScheme, String> {
    if let Some(s) = v.get("prepend_scheme").and_then(Value::as_str) {
        return match s {
            "always" => Ok(PrependScheme::Always),
            "first" => Ok(PrependScheme::First),
            "never" => Ok(PrependScheme::Never),
            other => Err(format!("tokenizer.json: {ctx} has unknown prepend_scheme {other:?}")),
        };
    }
    // Older files use a boolean instead.
    Ok(if bool_or(v, "add_prefix_space", true) { PrependScheme::Always } else { PrependScheme::Never })
}

fn parse_normalizer(v: &Value, out: &mut Vec<Normalizer>) -> Result<(), String> {
    if v.is_null() {
        return Ok(());
    }
    match type_of(v, "normalizer")? {
        "Sequence" => {
            let list = field(v, "normalizers", "Sequence normalizer")?
                .as_array()
                .ok_or("tokenizer.json: Sequence normalizer field \"normalizers\" is not a list")?;
            for n in list {
                parse_normalizer(n, out)?;
            }
        }
        "Prepend" => out.push(Normalizer::Prepend(str_field(v, "prepend", "Prepend normalizer")?.to_string())),
        "Replace" => {
            let (from, to) = string_pattern(v, "Replace normalizer")?;
            out.push(Normalizer::Replace { from, to });
        }
        "Lowercase" => out.push(Normalizer::Lowercase),
        "NFC" => out.push(Normalizer::Nfc),
        other => {
            return Err(format!("tokenizer.json: unsupported normalizer type {other:?}"));
        }
    }
    Ok(())
}

fn parse_pre_tokenizer(v: &Value, out: &mut Vec<PreTokenizer>) -> Result<(), String> {
    if v.is_null() {
        return Ok(());
    }
    match type_of(v, "pre_tokenizer")? {
        "Sequence" => {
            let list = field(v, "pretokenizers", "Sequence pre_tokenizer")?
                .as_array()
                .ok_or("tokenizer.json: Sequence pre_tokenizer field \"pretokenizers\" is not a list")?;
            for p in list {
                parse_pre_tokenizer(p, out)?;
            }
        }
        "Metaspace" => {
            let ctx = "Metaspace pre_tokenizer";
            out.push(PreTokenizer::Metaspace {
                replacement: single_char(str_field(v, "replacement", ctx)?, ctx)?,
                scheme: prepend_scheme(v, ctx)?,
                split: bool_or(v, "split", true),
            });
        }
        "Split" => {
            let ctx = "Split pre_tokenizer";
            let pattern = field(v, "pattern", ctx)?;
            let regex =
                match (pattern.get("Regex").and_then(Value::as_str), pattern.get("String").and_then(Value::as_str)) {
                    (Some(r), _) => r.to_string(),
                    (None, Some(s)) => fancy_regex::escape(s).into_owned(),
                    _ => return Err(format!("tokenizer.json: {ctx} pattern {pattern} is neither Regex nor String")),
                };
            let behavior = str_field(v, "behavior", ctx)?;
            if behavior != "Isolated" || bool_or(v, "invert", false) {
                return Err(format!(
                    "tokenizer.json: unsupported {ctx} behavior {behavior:?} (invert {}); only Isolated, not inverted",
                    bool_or(v, "invert", false)
                ));
            }
            let regex = Regex::new(&regex).map_err(|e| format!("tokenizer.json: {ctx} pattern {regex:?}: {e}"))?;
            out.push(PreTokenizer::Split(regex));
        }
        "ByteLevel" => {
            if bool_or(v, "add_prefix_space", false) {
                return Err("tokenizer.json: unsupported ByteLevel pre_tokenizer add_prefix_space = true".into());
            }
            if bool_or(v, "use_regex", true) {
                out.push(PreTokenizer::Split(Regex::new(GPT2_PATTERN).expect("GPT-2's pattern compiles")));
            }
            out.push(PreTokenizer::ByteLevel);
        }
        other => {
            return Err(format!("tokenizer.json: unsupported pre_tokenizer type {other:?}"));
        }
    }
    Ok(())
}

fn parse_decoder(v: &Value, out: &mut Vec<Decoder>) -> Result<(), String> {
    if v.is_null() {
        return Ok(());
    }
    match type_of(v, "decoder")? {
        "Sequence" => {
            let list = field(v, "decoders", "Sequence decoder")?
                .as_array()
                .ok_or("tokenizer.json: Sequence decoder field \"decoders\" is not a list")?;
            for d in list {
                parse_decoder(d, out)?;
            }
        }
        "Replace" => {
            let (from, to) = string_pattern(v, "Replace decoder")?;
            out.push(Decoder::Replace { from, to });
        }
        "ByteFallback" => out.push(Decoder::ByteFallback),
        "Fuse" => out.push(Decoder::Fuse),
        "Strip" => {
            let ctx = "Strip decoder";
            let count = |key: &str| -> Result<usize, String> {
                field(v, key, ctx)?
                    .as_u64()
                    .map(|n| n as usize)
                    .ok_or_else(|| format!("tokenizer.json: {ctx} field {key:?} is not a count"))
            };
            out.push(Decoder::Strip {
                content: single_char(str_field(v, "content", ctx)?, ctx)?,
                start: count("start")?,
                stop: count("stop")?,
            });
        }
        "Metaspace" => {
            let ctx = "Metaspace decoder";
            out.push(Decoder::Metaspace {
                replacement: single_char(str_field(v, "replacement", ctx)?, ctx)?,
                scheme: prepend_scheme(v, ctx)?,
            });
        }
        "ByteLevel" => out.push(Decoder::ByteLevel),
        other => {
            return Err(format!("tokenizer.json: unsupported decoder type {other:?}"));
        }
    }
    Ok(())
}

/// The post-processor's `single` template: `TemplateProcessing` (possibly inside a `Sequence`);
/// `ByteLevel` changes offsets only, never ids, so it adds nothing.
fn parse_template(v: &Value) -> Result<Vec<TemplatePiece>, String> {
    if v.is_null() {
        return Ok(Vec::new());
    }
    let kind = type_of(v, "post_processor")?;
    match kind {
        "ByteLevel" => return Ok(Vec::new()),
        "Sequence" => {
            let list = field(v, "processors", "Sequence post_processor")?
                .as_array()
                .ok_or("tokenizer.json: Sequence post_processor field \"processors\" is not a list")?;
            let mut pieces = Vec::new();
            for p in list {
                let more = parse_template(p)?;
                if !more.is_empty() && !pieces.is_empty() {
                    return Err("tokenizer.json: two TemplateProcessing post_processors in one Sequence".into());
                }
                pieces.extend(more);
            }
            return Ok(pieces);
        }
        "TemplateProcessing" => {}
        other => return Err(format!("tokenizer.json: unsupported post_processor type {other:?}")),
    }
    let ctx = "TemplateProcessing post_processor";
    let single = field(v, "single", ctx)?
        .as_array()
        .ok_or("tokenizer.json: TemplateProcessing field \"single\" is not a list")?;
    let specials = v.get("special_tokens");
    let mut pieces = Vec::new();
    for item in single {
        if let Some(seq) = item.get("Sequence") {
            let id = str_field(seq, "id", ctx)?;
            if id != "A" {
                return Err(format!("tokenizer.json: TemplateProcessing single template refers to sequence {id:?}"));
            }
            pieces.push(TemplatePiece::Sequence);
        } else if let Some(sp) = item.get("SpecialToken") {
            let name = str_field(sp, "id", ctx)?;
            let entry = specials
                .and_then(|s| s.get(name))
                .ok_or_else(|| format!("tokenizer.json: TemplateProcessing special token {name:?} is not defined"))?;
            let ids = field(entry, "ids", ctx)?
                .as_array()
                .ok_or("tokenizer.json: TemplateProcessing special token ids is not a list")?
                .iter()
                .map(|i| {
                    i.as_u64().map(|n| n as u32).ok_or_else(|| {
                        format!("tokenizer.json: TemplateProcessing special token {name:?} has a bad id")
                    })
                })
                .collect::<Result<Vec<u32>, String>>()?;
            pieces.push(TemplatePiece::Special(ids));
        } else {
            return Err(format!("tokenizer.json: unsupported TemplateProcessing piece {item}"));
        }
    }
    Ok(pieces)
}

fn as_id(v: &Value, ctx: &str) -> Result<u32, String> {
    v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| format!("tokenizer.json: {ctx} has a bad id {v}"))
}

impl Tokenizer {
    /// Load `tokenizer.json` from the model directory.
    pub fn load(dir: &Path) -> Result<Tokenizer, String> {
        let path = dir.join("tokenizer.json");
        let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let root: Value = serde_json::from_str(&text).map_err(|e| format!("cannot parse {}: {e}", path.display()))?;
        Self::from_json(&root)
    }

    fn from_json(root: &Value) -> Result<Tokenizer, String> {
        for key in ["truncation", "padding"] {
            if root.get(key).is_some_and(|v| !v.is_null()) {
                return Err(format!("tokenizer.json: unsupported {key} settings"));
            }
        }

        // Model.
        let model = field(root, "model", "tokenizer.json")?;
        let kind = model.get("type").and_then(Value::as_str).unwrap_or("BPE");
        if kind != "BPE" {
            return Err(format!("tokenizer.json: unsupported model type {kind:?} (only BPE)"));
        }
        for key in ["continuing_subword_prefix", "end_of_word_suffix"] {
            if model.get(key).is_some_and(|v| !v.is_null() && v.as_str() != Some("")) {
                return Err(format!("tokenizer.json: unsupported BPE option {key}"));
            }
        }
        if model.get("dropout").and_then(Value::as_f64).is_some_and(|p| p > 0.0) {
            return Err("tokenizer.json: unsupported BPE option dropout".into());
        }
        let vocab_json =
            field(model, "vocab", "BPE model")?.as_object().ok_or("tokenizer.json: BPE vocab is not an object")?;
        let mut vocab = HashMap::with_capacity(vocab_json.len());
        for (tok, id) in vocab_json {
            vocab.insert(tok.clone(), as_id(id, "BPE vocab")?);
        }

        // Added tokens (they may extend the vocabulary).
        let mut added = Vec::new();
        if let Some(list) = root.get("added_tokens").and_then(Value::as_array) {
            for t in list {
                let ctx = "added token";
                let content = str_field(t, "content", ctx)?.to_string();
                if content.is_empty() {
                    return Err("tokenizer.json: added token with empty content".into());
                }
                added.push(AddedToken {
                    id: as_id(field(t, "id", ctx)?, ctx)?,
                    content,
                    special: bool_or(t, "special", false),
                    lstrip: bool_or(t, "lstrip", false),
                    rstrip: bool_or(t, "rstrip", false),
                    single_word: bool_or(t, "single_word", false),
                });
            }
        }

        let max_id = vocab.values().chain(added.iter().map(|a| &a.id)).copied().max().map_or(0, |m| m as usize + 1);
        let mut id_to_token = vec![None; max_id];
        for (tok, &id) in &vocab {
            id_to_token[id as usize] = Some(tok.clone());
        }
        let mut is_special = vec![false; max_id];
        for a in &added {
            id_to_token[a.id as usize] = Some(a.content.clone());
            is_special[a.id as usize] = a.special;
        }

        let merges_json = model.get("merges").and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]);
        let mut merges = HashMap::with_capacity(merges_json.len());
        for (rank, m) in merges_json.iter().enumerate() {
            let (a, b) = match m {
                Value::String(s) => {
                    let mut parts = s.split(' ');
                    match (parts.next(), parts.next(), parts.next()) {
                        (Some(a), Some(b), None) => (a.to_string(), b.to_string()),
                        _ => return Err(format!("tokenizer.json: malformed merge {s:?}")),
                    }
                }
                Value::Array(pair) if pair.len() == 2 => match (pair[0].as_str(), pair[1].as_str()) {
                    (Some(a), Some(b)) => (a.to_string(), b.to_string()),
                    _ => return Err(format!("tokenizer.json: malformed merge {m}")),
                },
                _ => return Err(format!("tokenizer.json: malformed merge {m}")),
            };
            let lookup = |t: &str| {
                vocab
                    .get(t)
                    .copied()
                    .ok_or_else(|| format!("tokenizer.json: merge {a:?} {b:?} uses unknown token {t:?}"))
            };
            let left = lookup(&a)?;
            let right = lookup(&b)?;
            let merged = lookup(&format!("{a}{b}"))?;
            // The first occurrence of a pair wins, as its rank is the lowest.
            merges.entry((left, right)).or_insert((rank as u32, merged));
        }

        let unk_id = match model.get("unk_token").and_then(Value::as_str) {
            Some(u) => {
                Some(*vocab.get(u).ok_or_else(|| format!("tokenizer.json: unk_token {u:?} is not in the vocabulary"))?)
            }
            None => None,
        };

        let mut normalizers = Vec::new();
        parse_normalizer(root.get("normalizer").unwrap_or(&Value::Null), &mut normalizers)?;
        let mut pre_tokenizers = Vec::new();
        parse_pre_tokenizer(root.get("pre_tokenizer").unwrap_or(&Value::Null), &mut pre_tokenizers)?;
        let template = parse_template(root.get("post_processor").unwrap_or(&Value::Null))?;
        let mut decoders = Vec::new();
        parse_decoder(root.get("decoder").unwrap_or(&Value::Null), &mut decoders)?;

        Ok(Tokenizer {
            added,
            normalizers,
            pre_tokenizers,
            vocab,
            id_to_token,
            is_special,
            merges,
            unk_id,
            fuse_unk: bool_or(model, "fuse_unk", false),
            byte_fallback: bool_or(model, "byte_fallback", false),
            ignore_merges: bool_or(model, "ignore_merges", false),
            template,
            decoders,
            byte_chars: byte_chars(),
            char_bytes: byte_chars().iter().enumerate().map(|(b, &c)| (c, b as u8)).collect(),
        })
    }

    // -----------------------------------------------------------------------------------------
    // Encoding

    /// Encode text as the HF tokenizer does with add_special_tokens = true (normalizer, BPE, post-processor BOS).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut body = Vec::new();
        let mut cursor = 0;
        while cursor < text.len() {
            match self.find_added(text, cursor) {
                Some((seg_end, tok_end, id)) => {
                    self.encode_segment(&text[cursor..seg_end], cursor == 0, &mut body);
                    body.push(id);
                    cursor = tok_end;
                }
                None => {
                    self.encode_segment(&text[cursor..], cursor == 0, &mut body);
                    cursor = text.len();
                }
            }
        }

        if self.template.is_empty() {
            return body;
        }
        let mut out = Vec::with_capacity(body.len() + 2);
        for piece in &self.template {
            match piece {
                TemplatePiece::Special(ids) => out.extend_from_slice(ids),
                TemplatePiece::Sequence => out.extend_from_slice(&body),
            }
        }
        out
    }

    /// Find the leftmost (then longest) added token at or after byte `from`. Returns the end of the
    /// plain text before it (after `lstrip`), the end of the match (after `rstrip`) and its id.
    fn find_added(&self, text: &str, from: usize) -> Option<(usize, usize, u32)> {
        if self.added.is_empty() {
            return None;
        }
        for (start, _) in text[from..].char_indices() {
            let start = from + start;
            let rest = &text[start..];
            let best = self
                .added
                .iter()
                .filter(|a| rest.starts_with(a.content.as_str()))
                .filter(|a| !a.single_word || is_whole_word(text, start, start + a.content.len()))
                .max_by_key(|a| a.content.len());
            if let Some(a) = best {
                let mut seg_end = start;
                if a.lstrip {
                    seg_end = from + text[from..start].trim_end().len();
                }
                let mut tok_end = start + a.content.len();
                if a.rstrip {
                    tok_end = text.len() - text[tok_end..].trim_start().len();
                }
                return Some((seg_end, tok_end, a.id));
            }
        }
        None
    }

    /// Normalise, pre-tokenise and BPE-encode one stretch of text containing no added tokens.
    fn encode_segment(&self, seg: &str, at_start: bool, out: &mut Vec<u32>) {
        if seg.is_empty() {
            return;
        }
        let mut s = seg.to_string();
        for n in &self.normalizers {
            s = match n {
                Normalizer::Prepend(p) => {
                    if s.is_empty() {
                        s
                    } else {
                        format!("{p}{s}")
                    }
                }
                Normalizer::Replace { from, to } => s.replace(from.as_str(), to),
                Normalizer::Lowercase => s.to_lowercase(),
                Normalizer::Nfc => s.nfc().collect(),
            };
        }

        let mut words = vec![s];
        for p in &self.pre_tokenizers {
            let (replacement, scheme, split) = match p {
                PreTokenizer::Metaspace { replacement, scheme, split } => (replacement, scheme, split),
                PreTokenizer::Split(regex) => {
                    words = words.iter().flat_map(|w| split_isolated(regex, w)).collect();
                    continue;
                }
                PreTokenizer::ByteLevel => {
                    for w in &mut words {
                        *w = w.bytes().map(|b| self.byte_chars[b as usize]).collect();
                    }
                    continue;
                }
            };
            let mut next = Vec::new();
            for (wi, w) in words.into_iter().enumerate() {
                let mut w = w.replace(' ', &replacement.to_string());
                let prepend = match scheme {
                    PrependScheme::Always => true,
                    PrependScheme::First => at_start && wi == 0,
                    PrependScheme::Never => false,
                };
                if prepend && !w.starts_with(*replacement) {
                    w.insert(0, *replacement);
                }
                if *split {
                    // Split before every replacement character, keeping it with what follows.
                    let mut piece_start = 0;
                    for (i, c) in w.char_indices() {
                        if c == *replacement && i > piece_start {
                            next.push(w[piece_start..i].to_string());
                            piece_start = i;
                        }
                    }
                    if piece_start < w.len() {
                        next.push(w[piece_start..].to_string());
                    }
                } else if !w.is_empty() {
                    next.push(w);
                }
            }
            words = next;
        }

        for w in &words {
            self.bpe_word(w, out);
        }
    }

    /// Apply the BPE model to one word.
    fn bpe_word(&self, word: &str, out: &mut Vec<u32>) {
        if word.is_empty() {
            return;
        }
        if self.ignore_merges
            && let Some(&id) = self.vocab.get(word)
        {
            out.push(id);
            return;
        }

        // Initial symbols: one per character, with byte fallback or (fused) unknowns.
        let mut ids: Vec<u32> = Vec::with_capacity(word.len());
        let mut pending_unk = false;
        let mut buf = [0u8; 4];
        for c in word.chars() {
            let cs: &str = c.encode_utf8(&mut buf);
            if let Some(&id) = self.vocab.get(cs) {
                pending_unk = false;
                ids.push(id);
                continue;
            }
            if self.byte_fallback {
                let bytes: Option<Vec<u32>> =
                    cs.bytes().map(|b| self.vocab.get(&format!("<0x{b:02X}>")).copied()).collect();
                if let Some(bytes) = bytes {
                    pending_unk = false;
                    ids.extend(bytes);
                    continue;
                }
            }
            if let Some(unk) = self.unk_id {
                if !(self.fuse_unk && pending_unk) {
                    ids.push(unk);
                }
                pending_unk = true;
            }
            // Without an unk token an unknown character is dropped.
        }

        // Merge the lowest-ranked adjacent pair (leftmost on ties) until none applies, using a
        // doubly linked list of symbols and a heap of candidate merges.
        let n = ids.len();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut next: Vec<usize> = (1..=n).collect();
        let mut alive = vec![true; n];
        let mut heap = BinaryHeap::new();
        let push = |heap: &mut BinaryHeap<_>, ids: &[u32], l: usize, r: usize| {
            if let Some(&(rank, merged)) = self.merges.get(&(ids[l], ids[r])) {
                heap.push(Reverse((rank, l, r, ids[l], ids[r], merged)));
            }
        };
        for i in 1..n {
            push(&mut heap, &ids, i - 1, i);
        }
        while let Some(Reverse((_, l, r, lid, rid, merged))) = heap.pop() {
            // Skip candidates invalidated by earlier merges.
            if !alive[l] || !alive[r] || next[l] != r || ids[l] != lid || ids[r] != rid {
                continue;
            }
            ids[l] = merged;
            alive[r] = false;
            next[l] = next[r];
            if next[r] < n {
                prev[next[r]] = l;
            }
            if prev[l] < n {
                push(&mut heap, &ids, prev[l], l);
            }
            if next[l] < n {
                push(&mut heap, &ids, l, next[l]);
            }
        }
        out.extend((0..n).filter(|&i| alive[i]).map(|i| ids[i]));
    }

    // -----------------------------------------------------------------------------------------
    // Decoding

    /// Decode ids as the HF tokenizer does with skip_special_tokens = true.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut tokens: Vec<String> = ids
            .iter()
            .filter_map(|&id| {
                let i = id as usize;
                if i >= self.id_to_token.len() || self.is_special[i] {
                    return None;
                }
                self.id_to_token[i].clone()
            })
            .collect();

        for d in &self.decoders {
            tokens = match d {
                Decoder::Replace { from, to } => tokens.into_iter().map(|t| t.replace(from.as_str(), to)).collect(),
                Decoder::ByteFallback => byte_fallback(tokens),
                Decoder::Fuse => vec![tokens.concat()],
                Decoder::Strip { content, start, stop } => {
                    tokens.into_iter().map(|t| strip(&t, *content, *start, *stop)).collect()
                }
                Decoder::ByteLevel => {
                    let mut bytes = Vec::new();
                    for t in &tokens {
                        let mapped: Option<Vec<u8>> = t.chars().map(|c| self.char_bytes.get(&c).copied()).collect();
                        match mapped {
                            Some(b) => bytes.extend(b),
                            None => bytes.extend_from_slice(t.as_bytes()),
                        }
                    }
                    vec![String::from_utf8_lossy(&bytes).into_owned()]
                }
                Decoder::Metaspace { replacement, scheme } => tokens
                    .into_iter()
                    .enumerate()
                    .map(|(i, t)| {
                        let drop = i == 0 && *scheme != PrependScheme::Never;
                        t.chars()
                            .filter_map(|c| match (c == *replacement, drop) {
                                (true, true) => None,
                                (true, false) => Some(' '),
                                (false, _) => Some(c),
                            })
                            .collect()
                    })
                    .collect(),
            };
        }
        tokens.concat()
    }
}

/// Split `text` at the pattern's matches (leftmost, non-overlapping), keeping each match and each
/// stretch between matches as a word (behavior Isolated). A pattern that fails to run (fancy-regex's
/// backtracking limit) leaves the rest of the text as one word.
fn split_isolated(regex: &Regex, text: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut last = 0;
    for m in regex.find_iter(text) {
        let Ok(m) = m else { break };
        if m.start() > last {
            words.push(text[last..m.start()].to_string());
        }
        if m.end() > m.start() {
            words.push(m.as_str().to_string());
        }
        last = m.end();
    }
    if last < text.len() {
        words.push(text[last..].to_string());
    }
    words
}

/// True when the span [start, end) of `text` is not glued to word characters on either side.
fn is_whole_word(text: &str, start: usize, end: usize) -> bool {
    let before = text[..start].chars().next_back();
    let after = text[end..].chars().next();
    let is_word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    !is_word(before) && !is_word(after)
}

/// Parse a `<0xXX>` byte token.
fn byte_token(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Turn runs of `<0xXX>` tokens into text. A run that is not valid UTF-8 becomes one U+FFFD per
/// byte token, as the HF `ByteFallback` decoder does.
fn byte_fallback(tokens: Vec<String>) -> Vec<String> {
    let mut out = Vec::with_capacity(tokens.len());
    let mut bytes = Vec::new();
    let flush = |bytes: &mut Vec<u8>, out: &mut Vec<String>| {
        if bytes.is_empty() {
            return;
        }
        match String::from_utf8(std::mem::take(bytes)) {
            Ok(s) => out.push(s),
            Err(e) => {
                let n = e.as_bytes().len();
                out.extend(std::iter::repeat_n("\u{FFFD}".to_string(), n));
            }
        }
    };
    for t in tokens {
        match byte_token(&t) {
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

/// Remove up to `start` leading and `stop` trailing occurrences of `content` from `t`.
fn strip(t: &str, content: char, start: usize, stop: usize) -> String {
    let chars: Vec<char> = t.chars().collect();
    let lead = chars.iter().take(start).take_while(|&&c| c == content).count();
    let trail = chars[lead..].iter().rev().take(stop).take_while(|&&c| c == content).count();
    chars[lead..chars.len() - trail].iter().collect()
}
