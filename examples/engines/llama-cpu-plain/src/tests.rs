//! The whole engine on BabyLlama (examples/models/babyllama-105 in the metainfer repository, or the
//! directory in `$BABYLLAMA_DIR`): the tokenizer, the stop tokens and greedy decoding against the
//! golden output that four independent implementations agreed on (numpy, llama2.c, candle,
//! llama.cpp; metainfer's ../shared/golden/babyllama-105-once-upon-a-time.json).

use std::path::PathBuf;

use crate::{generate, model::Model, tokenizer::Tokenizer};

/// "Once upon a time" as BabyLlama's tokenizer encodes it (BOS 1 first): the golden prompt_ids.
const PROMPT_IDS: [u32; 18] = [1, 3, 34, 9, 22, 4, 3, 18, 20, 7, 9, 3, 5, 3, 6, 10, 16, 4];
/// The first 16 greedy tokens after the prompt: the golden greedy_ids[18..34].
const GREEDY_16: [u32; 16] = [25, 3, 6, 8, 4, 13, 4, 3, 17, 5, 12, 3, 5, 3, 14, 10];

fn babyllama() -> PathBuf {
    let dir = std::env::var_os("BABYLLAMA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/babyllama-105")));
    assert!(
        dir.join("model.safetensors").is_file(),
        "{}: no BabyLlama here; set BABYLLAMA_DIR to metainfer's examples/models/babyllama-105",
        dir.display()
    );
    dir
}

#[test]
fn tokenizer_encodes_and_decodes_the_golden_prompt() {
    let tok = Tokenizer::load(&babyllama()).unwrap();
    assert_eq!(tok.encode("Once upon a time"), PROMPT_IDS);
    assert_eq!(tok.decode(&PROMPT_IDS), "Once upon a time");
}

#[test]
fn greedy_decoding_gives_the_golden_tokens_and_reset_starts_over() {
    let dir = babyllama();
    let mut model = Model::load(&dir).unwrap();
    assert_eq!((model.vocab_size(), model.max_seq_len()), (105, 256), "BabyLlama's config.json");
    let run = |model: &mut Model| {
        let mut next = generate::sample_greedy(model.prefill(&PROMPT_IDS, 0));
        let mut out = vec![next];
        while out.len() < GREEDY_16.len() {
            next = generate::sample_greedy(model.forward(next, PROMPT_IDS.len() + out.len() - 1));
            out.push(next);
        }
        out
    };
    assert_eq!(run(&mut model), GREEDY_16);
    model.reset();
    assert_eq!(run(&mut model), GREEDY_16, "after reset the cache must start empty");
    let tok = Tokenizer::load(&dir).unwrap();
    let all: Vec<u32> = PROMPT_IDS.iter().chain(&GREEDY_16).copied().collect();
    assert_eq!(tok.decode(&all), "Once upon a time, there was a li");
}

#[test]
fn stop_tokens_read_generation_config_first_then_config() {
    let t = std::env::temp_dir().join(format!("llama-cpu-plain-stop-{}", std::process::id()));
    let write = |files: &[(&str, &str)]| {
        let _ = std::fs::remove_dir_all(&t);
        std::fs::create_dir_all(&t).unwrap();
        for (name, text) in files {
            std::fs::write(t.join(name), text).unwrap();
        }
    };
    assert_eq!(generate::stop_tokens(&babyllama()).unwrap(), [2], "BabyLlama's config.json eos_token_id");
    write(&[("config.json", r#"{"eos_token_id": 2}"#), ("generation_config.json", r#"{"eos_token_id": [7, 9]}"#)]);
    assert_eq!(generate::stop_tokens(&t).unwrap(), [7, 9]);
    write(&[("config.json", r#"{"eos_token_id": null}"#)]);
    assert_eq!(generate::stop_tokens(&t).unwrap(), [] as [u32; 0]);
    write(&[("config.json", r#"{"eos_token_id": -1}"#)]);
    let e = generate::stop_tokens(&t).unwrap_err();
    assert!(e.contains("config.json") && e.contains("eos_token_id"), "{e}");
    let _ = std::fs::remove_dir_all(&t);
}
