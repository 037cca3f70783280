//! Tokenizer writing: synth's SentencePiece-style BPE, and its byte-level BPE trained with HF
//! `tokenizers`' trainer, with the special tokens and their bos and eos ids.

use rand::{Rng, SeedableRng};
use serde_json::json;

use base::error::{Context, Error, Result};

/// A BPE tokenizer.json in the layout of the BabyLlama checkpoint with exactly `vocab` entries, so
/// that every token id a model of that vocabulary can produce decodes: `<unk>`, `<s>`, `</s>`, `▁`
/// (space), then printable ASCII characters, as many as `vocab` leaves room for (character-level up to
/// 79 entries); beyond that, merged tokens fill the vocabulary, shortest first: a token of the previous
/// length (`▁` or a character to start with) followed by a character, each with its merge `"left right"`
/// in that order of rank. A 32000 vocabulary holds the 79 specials and characters, 5700 two-character
/// tokens and 26221 three-character ones (31921 merges).
pub fn synth_tokenizer(vocab: usize) -> serde_json::Value {
    const CHARS: &str = "etaoinshrdlucmfwypvbgkjqxzETAOINSHRDLUCMFWYPVBGKJQXZ.,!?'\"-:;0123456789()";
    let mut entries: Vec<String> = ["<unk>", "<s>", "</s>", "\u{2581}"].iter().map(|s| s.to_string()).collect();
    entries.extend(CHARS.chars().map(|c| c.to_string()).take(vocab.saturating_sub(4)));
    let mut merges: Vec<String> = Vec::new();
    let mut known: std::collections::HashSet<String> = entries.iter().cloned().collect();
    let mut frontier: Vec<String> = entries[3.min(entries.len())..].to_vec();
    'fill: while entries.len() < vocab && !frontier.is_empty() {
        let mut next = Vec::new();
        for left in &frontier {
            for right in CHARS.chars() {
                if entries.len() >= vocab {
                    break 'fill;
                }
                let token = format!("{left}{right}");
                if known.insert(token.clone()) {
                    merges.push(format!("{left} {right}"));
                    entries.push(token.clone());
                    next.push(token);
                }
            }
        }
        frontier = next;
    }
    let vocab_map: serde_json::Map<String, serde_json::Value> =
        entries.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
    let special = |id: usize, content: &str| json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}
        ]},
        "pre_tokenizer": null,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        ]},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab_map, "merges": merges
        }
    })
}

/// The bos and eos ids of a synthetic tokenizer.
pub(super) struct SpecialIds {
    pub(super) bos: usize,
    pub(super) eos: usize,
}

/// Special tokens of synth's byte-level tokenizers, placed at the end of the vocabulary as in the
/// real ones. llama3 style (Llama 3's names and order; 256 of them from a 4096 vocabulary on, as in
/// Llama 3's 128000..128256, else the first 10): `<|begin_of_text|>` (BOS), `<|end_of_text|>` (EOS),
/// reserved tokens, `<|start_header_id|>`, `<|end_header_id|>`, `<|eot_id|>`. qwen2 style (Qwen2's):
/// `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`.
fn bytelevel_specials(style: &str, vocab: usize) -> Vec<String> {
    if style == "qwen2" {
        return ["<|endoftext|>", "<|im_start|>", "<|im_end|>"].iter().map(|s| s.to_string()).collect();
    }
    let n = if vocab >= 4096 { 256 } else { 10 };
    let mut reserved = 0;
    (0..n)
        .map(|i| match i {
            0 => "<|begin_of_text|>".to_string(),
            1 => "<|end_of_text|>".to_string(),
            6 => "<|start_header_id|>".to_string(),
            7 => "<|end_header_id|>".to_string(),
            9 => "<|eot_id|>".to_string(),
            _ => {
                reserved += 1;
                format!("<|reserved_special_token_{}|>", reserved - 1)
            }
        })
        .collect()
}

/// The byte-level style synth writes for a model_type: qwen2 (Qwen2's split pattern, NFC, no BOS)
/// for the qwen families, llama3 (Llama 3's pattern, ignore_merges, BOS template) otherwise.
pub(super) fn bytelevel_style(model_type: &str) -> &'static str {
    if model_type.starts_with("qwen") { "qwen2" } else { "llama3" }
}

/// The bos and eos ids a tokenizer kind gives for this family and vocabulary.
pub(super) fn special_ids(tokenizer: &str, family: &str, vocab: usize) -> Result<SpecialIds> {
    if tokenizer != "bytelevel" {
        return Ok(SpecialIds { bos: 1, eos: 2 });
    }
    let style = bytelevel_style(family);
    let specials = bytelevel_specials(style, vocab);
    let min = 256 + specials.len() + 1;
    if vocab < min {
        return Err(Error::usage(format!(
            "--vocab {vocab} is too small for --tokenizer bytelevel: 256 byte tokens, {} special tokens and at least one merge need {min}",
            specials.len()
        )));
    }
    let first = vocab - specials.len();
    Ok(match style {
        // <|endoftext|> is Qwen's bos_token_id in config.json; generation ends at <|im_end|>.
        "qwen2" => SpecialIds { bos: first, eos: first + 2 },
        _ => SpecialIds { bos: first, eos: first + 1 },
    })
}

/// GPT-2's byte-to-character table (contract component.tokenizer_bytelevel): printable bytes map to
/// themselves, the other 68 to U+0100.. in byte order.
fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 0u32;
    for b in 0..256u32 {
        let printable = (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).expect("a Latin-1 code point")
        } else {
            next += 1;
            char::from_u32(0x100 + next - 1).expect("a code point below U+0144")
        };
    }
    table
}

/// Words of a generated training text for synth's byte-level BPE: pseudo-words from syllables (some
/// capitalised), numbers, punctuation runs and non-ASCII words (accents, Cyrillic, CJK, emoji), most
/// with a leading space, as the split patterns cut them. `distinct` words, the k-th used about
/// 1 + 400 / (k + 1) times (a Zipf-like frequency), so common merges are learned first.
fn training_words(seed: u64, distinct: usize) -> Vec<(String, u64)> {
    const ONSETS: &[&str] = &[
        "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr", "ch",
        "sh", "th", "pl", "gr",
    ];
    const VOWELS: &[&str] = &["a", "e", "i", "o", "u", "ea", "ou", "ai", "y"];
    const CODAS: &[&str] = &["", "", "n", "r", "s", "t", "l", "m", "ng", "ck", "st", "nd"];
    const OTHER: &[&str] = &["é", "ü", "ñ", "ß", "ç", "при", "вет", "日本", "中文", "語", "😀", "—", "’", "“", "”"];
    const PUNCT: &[&str] = &[".", ",", "!", "?", ";", ":", "...", "(", ")", "\"", "'", "-", "\n", "\n\n", "  "];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x70_6b_65_6e);
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(distinct);
    let mut tries = 0;
    while out.len() < distinct && tries < distinct * 20 {
        tries += 1;
        let kind = rng.random_range(0..20);
        let mut w = String::new();
        if kind < 15 {
            for _ in 0..rng.random_range(1..=4) {
                w += ONSETS[rng.random_range(0..ONSETS.len())];
                w += VOWELS[rng.random_range(0..VOWELS.len())];
                w += CODAS[rng.random_range(0..CODAS.len())];
            }
            if rng.random_bool(0.15) {
                let mut c = w.chars();
                w = c.next().map(|f| f.to_uppercase().collect::<String>() + c.as_str()).unwrap_or_default();
            }
        } else if kind < 17 {
            w = rng.random_range(0..100_000u32).to_string();
        } else if kind < 18 {
            w = PUNCT[rng.random_range(0..PUNCT.len())].to_string();
        } else {
            for _ in 0..rng.random_range(1..=3) {
                w += OTHER[rng.random_range(0..OTHER.len())];
            }
        }
        if rng.random_bool(0.8) {
            w.insert(0, ' ');
        }
        if seen.insert(w.clone()) {
            let k = out.len() as u64;
            out.push((w, 1 + 400 / (k + 1)));
        }
    }
    out
}

/// A byte-level BPE tokenizer.json with exactly `vocab` entries, trained with HF `tokenizers`' BPE
/// trainer on generated text ([`training_words`]), in the layout of the real ones (contract
/// component.tokenizer_bytelevel): the 256 byte characters, learned merges (completed, if the text
/// offers fewer, by merges of a learned token with a byte character), then the special tokens;
/// `style` llama3 (Llama 3's split pattern from the contract, ignore_merges, a
/// `<|begin_of_text|>` template) or qwen2 (Qwen2's pattern, NFC, no template). Deterministic in
/// `seed`.
///
/// # Errors
/// [`base::error::ErrorKind::Usage`] for a vocabulary too small; Internal when training or the
/// check that HF loads the result fails.
pub fn synth_bytelevel_tokenizer(vocab: usize, style: &str, seed: u64) -> Result<serde_json::Value> {
    use tokenizers::Trainer;
    let specials = bytelevel_specials(style, vocab);
    let _ = special_ids("bytelevel", if style == "qwen2" { "qwen2" } else { "llama" }, vocab)?;
    let target = vocab - specials.len();
    let table = byte_chars();
    let map = |w: &str| -> String { w.bytes().map(|b| table[b as usize]).collect() };
    let words = training_words(seed, (target / 3).max(64));
    let mut trainer = tokenizers::models::bpe::BpeTrainerBuilder::new()
        .vocab_size(target)
        .min_frequency(0)
        .show_progress(false)
        .initial_alphabet(table.iter().copied().collect())
        .limit_alphabet(256)
        .build();
    let corpus: Vec<String> = words.iter().map(|(w, _)| map(w)).collect();
    let counts: std::collections::HashMap<&str, u64> =
        corpus.iter().map(String::as_str).zip(words.iter().map(|w| w.1)).collect();
    trainer
        .feed(corpus.iter(), |w| Ok(std::iter::repeat_n(w.to_string(), counts[w] as usize).collect()))
        .internal_ctx(|| "byte-level BPE training".to_owned())?;
    let mut model = tokenizers::models::bpe::BPE::default();
    trainer.train(&mut model).internal_ctx(|| "byte-level BPE training".to_owned())?;
    let trained = serde_json::to_value(&model).internal_ctx(|| "trained model".to_owned())?;
    // Vocabulary in id order, and merges as pairs.
    let mut entries: Vec<(String, u64)> = trained["vocab"]
        .as_object()
        .map(|o| o.iter().map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0))).collect())
        .unwrap_or_default();
    entries.sort_by_key(|e| e.1);
    let mut tokens: Vec<String> = entries.into_iter().map(|e| e.0).collect();
    let mut merges: Vec<(String, String)> = trained["merges"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|m| match m {
                    serde_json::Value::Array(p) => Some((p[0].as_str()?.to_string(), p[1].as_str()?.to_string())),
                    serde_json::Value::String(s) => s.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    // Complete the vocabulary where the text offered fewer merges: learned token + byte character.
    let mut known: std::collections::HashSet<String> = tokens.iter().cloned().collect();
    let mut left = 256.min(tokens.len());
    'fill: while tokens.len() < target {
        let base = tokens[left % tokens.len()].clone();
        left += 1;
        for c in table.iter() {
            if tokens.len() >= target {
                break 'fill;
            }
            let t = format!("{base}{c}");
            if known.insert(t.clone()) {
                merges.push((base.clone(), c.to_string()));
                tokens.push(t);
            }
        }
    }
    tokens.truncate(target);
    let vocab_map: serde_json::Map<String, serde_json::Value> =
        tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
    let merges_json: Vec<serde_json::Value> = merges
        .iter()
        .filter(|(a, b)| known.contains(&format!("{a}{b}")) && vocab_map.contains_key(&format!("{a}{b}")))
        .map(|(a, b)| json!([a, b]))
        .collect();
    let added: Vec<serde_json::Value> = specials
        .iter()
        .enumerate()
        .map(|(i, c)| json!({"id": target + i, "content": c, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let ckb = ckb::Ckb::embedded().internal_ctx(|| "built-in CKB".to_owned())?;
    let regex = ckb
        .all()
        .filter_map(|c| c.tokenizer.as_ref())
        .flat_map(|t| t.split_patterns.iter())
        .find(|p| p.name == style)
        .map(|p| p.regex.clone())
        .ok_or_else(|| Error::internal(format!("no tokenizer contract has the split pattern `{style}`")))?;
    let byte_level = |prefix: bool, regex: bool| json!({"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": !regex || prefix, "use_regex": regex});
    let post = if style == "qwen2" {
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true})
    } else {
        let bos = &specials[0];
        json!({"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {bos.as_str(): {"id": bos, "ids": [target], "tokens": [bos]}}}
        ]})
    };
    let json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": if style == "qwen2" { json!({"type": "NFC"}) } else { serde_json::Value::Null },
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            byte_level(false, false)
        ]},
        "post_processor": post,
        "decoder": byte_level(true, true),
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": style != "qwen2",
            "vocab": vocab_map, "merges": merges_json
        }
    });
    // HF must load it, and it must round-trip text through its own vocabulary.
    let check: tokenizers::Tokenizer = serde_json::from_value(json.clone()).map_err(|e| {
        Error::internal(format!("the synthetic byte-level tokenizer does not load in HF tokenizers: {e}"))
    })?;
    let probe = "Once upon a time, 42 birds said “привет” 😀.\n";
    let ids = check.encode(probe, false).internal_ctx(|| "synthetic tokenizer".to_owned())?;
    let back = check.decode(ids.get_ids(), true).internal_ctx(|| "synthetic tokenizer".to_owned())?;
    if back != probe {
        return Err(Error::internal(format!("the synthetic byte-level tokenizer decodes {probe:?} as {back:?}")));
    }
    Ok(json)
}
