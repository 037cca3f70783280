//! The prompts verify_generation draws at random: plain words, and words mixed with the pieces of a
//! richer alphabet that the model's tokenizer represents exactly.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Most tokens generated for the long random prompt.
pub const LONG_RUN: usize = 512;

/// Words for random prompts: common in children's stories, so tiny story models stay in distribution.
const WORDS: &[&str] = &[
    "the", "a", "little", "dog", "cat", "girl", "boy", "sun", "tree", "ball", "happy", "big", "red", "park", "mom",
    "friend", "bird", "toy", "played", "saw", "went", "day", "one", "was", "and", "with", "car", "box", "blue", "fish",
];

/// Pieces a richer random prompt draws from: digits, punctuation, apostrophes, non-ASCII text (Latin
/// accents, typographic quotes, Cyrillic, CJK, an emoji, a combining accent) and whitespace runs.
/// [`rich_alphabet`] keeps those a model's tokenizer represents exactly.
const RICH: &[&str] = &[
    "0",
    "7",
    "42",
    "2024",
    "3.14",
    "1,000",
    ".",
    ",",
    "!",
    "?",
    ";",
    ":",
    "-",
    "(",
    ")",
    "\"",
    "'",
    "'s",
    "n't",
    "’",
    "“",
    "”",
    "…",
    "—",
    "é",
    "ñ",
    "ü",
    "ß",
    "ç",
    "Ω",
    "привет",
    "日本",
    "中文",
    "😀",
    "e\u{301}",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    " \n",
];

/// The pieces of [`RICH`] that `tok` encodes and decodes back unchanged (an unknown token does not
/// decode to what it replaced), and the special tokens' contents (between two letters, so that no leading-space rule hides a
/// loss): the alphabet an engine is expected to handle for this tokenizer. BabyLlama's 105
/// characters keep digits, ASCII punctuation, the typographic quotes and double spaces, but no
/// newline, CJK or emoji.
pub fn rich_alphabet(tok: &tokenizers::Tokenizer) -> Vec<String> {
    // In id order: the decoder is a hash map, whose order differs from one call to the next, and
    // the same seed must draw the same prompts.
    let mut specials: Vec<(u32, String)> =
        tok.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, t)| (id, t.content)).collect();
    specials.sort_unstable();
    let specials: Vec<String> = specials.into_iter().map(|(_, s)| s).collect();
    let mut out = Vec::new();
    for piece in RICH.iter().map(|s| s.to_string()) {
        let probe = format!("a{piece}b");
        let Ok(enc) = tok.encode(probe.as_str(), false) else { continue };
        // An unknown token decodes to its own text (e.g. "<unk>"), so the round trip fails too.
        if tok.decode(enc.get_ids(), false).ok().as_deref() == Some(probe.as_str()) {
            out.push(piece);
        }
    }
    // Special-token text: matched as one added token; it must not decode away when it is not special.
    out.extend(specials.into_iter().filter(|s| !s.is_empty()));
    out
}

/// Draw `n` prompts of 2-6 words with 1-3 pieces of `alphabet` mixed in (joined to a word or
/// standing alone), for tokenizer bugs no plain prompt shows.
pub fn rich_prompts(seed: u64, n: usize, alphabet: &[String]) -> Vec<String> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x0005_eed0_fa1f_abe7);
    let mut prompts = random_prompts(seed, n);
    if alphabet.is_empty() {
        return prompts;
    }
    for p in &mut prompts {
        let mut words: Vec<String> = p.split(' ').map(str::to_string).collect();
        for _ in 0..rng.random_range(1..=3) {
            let piece = &alphabet[rng.random_range(0..alphabet.len())];
            let at = rng.random_range(0..=words.len());
            if at > 0 && rng.random_bool(0.5) {
                words[at - 1].push_str(piece);
            } else {
                words.insert(at, piece.clone());
            }
        }
        *p = words.join(" ");
    }
    prompts
}

/// Draw `n` prompts of 2-6 words.
pub fn random_prompts(seed: u64, n: usize) -> Vec<String> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let len = rng.random_range(2..=6);
            let words: Vec<&str> = (0..len).map(|_| WORDS[rng.random_range(0..WORDS.len())]).collect();
            let mut s = words.join(" ");
            if let Some(first) = s.get(..1) {
                s = first.to_uppercase() + &s[1..];
            }
            s
        })
        .collect()
}
