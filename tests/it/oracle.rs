//! The reference forward pass reproduces the golden output agreed by four independent
//! implementations, and each oracle kernel matches a hand-computed value.

use metainfer::model;
use metainfer::oracle::{self, AttnShape, llama::Reference};

/// The reference forward pass on BabyLlama (../shared/models/babyllama-105).
fn babyllama_reference() -> Reference {
    let ckb = metainfer::ckb::Ckb::embedded().unwrap();
    let dir = crate::babyllama();
    let cfg = model::load_config(&ckb, &dir).unwrap();
    let tensors = model::read_safetensors(&dir).unwrap();
    Reference::new(&cfg, &tensors).unwrap()
}

#[test]
fn reference_forward_reproduces_golden_greedy_ids_and_logits() {
    let g = crate::golden();
    let mut r = babyllama_reference();
    let prompt: Vec<u32> = g["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let greedy: Vec<u32> = g["greedy_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();

    // Teacher-forced logits at positions 0..2 (golden rounds to 5 decimals).
    r.reset();
    for (pos, want) in g["logits_positions_0_to_2"].as_array().unwrap().iter().enumerate() {
        let got = r.step(prompt[pos]).unwrap();
        let want: Vec<f64> = want.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        assert_eq!(got.len(), want.len());
        let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(err < 1e-4, "position {pos}: max abs error {err}");
    }

    let (_, tokens) = r.greedy(&prompt, greedy.len() - prompt.len()).unwrap();
    assert_eq!(&greedy[prompt.len()..], &tokens[..]);
}

/// `Reference::greedy_agrees` takes the golden greedy continuation (agreed by four independent
/// implementations) and refuses it with its last token changed to the golden run's runner-up at
/// that step, unless the tie allowed covers the gap between the two logits; an empty run, or one
/// past the context, is refused.
#[test]
fn greedy_agrees_takes_the_golden_continuation_and_refuses_a_changed_token() {
    let g = crate::golden();
    let mut r = babyllama_reference();
    let ids = |k: &str| -> Vec<u32> { g[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect() };
    let (prompt, greedy) = (ids("prompt_ids"), ids("greedy_ids"));
    let golden = &greedy[prompt.len()..];
    assert!(r.greedy_agrees(&prompt, golden, 1e-3).unwrap());
    // The runner-up of the last step, and its gap to the golden token.
    let (rows, _) = r.greedy(&prompt, golden.len()).unwrap();
    let last = rows.last().unwrap();
    let best = *golden.last().unwrap() as usize;
    let second = (0..last.len()).filter(|&i| i != best).max_by(|&a, &b| last[a].total_cmp(&last[b])).unwrap();
    let gap = last[best] - last[second];
    assert!(gap > 1e-3, "the golden run has a near-tie at its last step ({gap})");
    let mut changed = golden.to_vec();
    *changed.last_mut().unwrap() = second as u32;
    assert!(!r.greedy_agrees(&prompt, &changed, 1e-3).unwrap());
    assert!(r.greedy_agrees(&prompt, &changed, gap * 1.001).unwrap());
    assert!(!r.greedy_agrees(&prompt, &[], 1e-3).unwrap());
    let past = vec![golden[0]; r.config().max_seq];
    assert!(!r.greedy_agrees(&prompt, &past, f64::INFINITY).unwrap());
}

#[test]
fn hf_tokenizer_matches_golden_prompt_and_text() {
    let g = crate::golden();
    let tok = model::hf_tokenizer(&crate::babyllama()).unwrap();
    let ids = model::hf_encode(&tok, g["prompt"].as_str().unwrap()).unwrap();
    let want: Vec<u32> = g["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(ids, want);
    let greedy: Vec<u32> = g["greedy_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(model::hf_decode(&tok, &greedy).unwrap(), g["text"].as_str().unwrap());
}

#[test]
fn oracle_kernels_match_hand_computed_values() {
    // RMSNorm of [3, 4] with eps 0: rms = sqrt(12.5); weight [1, 2].
    let y = oracle::rms_norm(&[3.0, 4.0], &[1.0, 2.0], 0.0);
    let rms = 12.5f64.sqrt();
    assert!((y[0] - 3.0 / rms).abs() < 1e-15 && (y[1] - 8.0 / rms).abs() < 1e-15);

    // RoPE rotate-half, head_dim 4, position 1, theta 10000: pair (0, 2) turns by 1 rad, pair (1, 3) by 0.01.
    let mut x = vec![1.0, 1.0, 0.0, 0.0];
    oracle::rope(&mut x, &[1], 1, 4, 10_000.0);
    assert!((x[0] - 1f64.cos()).abs() < 1e-15 && (x[2] - 1f64.sin()).abs() < 1e-15);
    assert!((x[1] - 0.01f64.cos()).abs() < 1e-15 && (x[3] - 0.01f64.sin()).abs() < 1e-15);

    // y = x W^T with W [[1, 2], [3, 4], [5, 6]] and x [1, 1]: [3, 7, 11].
    assert_eq!(oracle::linear(&[1.0, 1.0], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 1, 2, 3), vec![3.0, 7.0, 11.0]);

    // silu(0) * 5 = 0; silu(large) ~ large.
    assert_eq!(oracle::silu_and_mul(&[0.0], &[5.0]), vec![0.0]);

    // softmax([0, ln 3]) = [1/4, 3/4], stable at 1000 offsets.
    let p = oracle::softmax(&[1000.0, 1000.0 + 3f64.ln()], 2);
    assert!((p[0] - 0.25).abs() < 1e-12 && (p[1] - 0.75).abs() < 1e-12);

    // argmax: first on ties.
    assert_eq!(oracle::argmax(&[1.0, 5.0, 5.0]), 1);

    // Attention, one query at position 1 over two keys, GQA 2 query heads on 1 KV head.
    // Scores q.k / sqrt(2): key0 -> 0, key1 -> 2/sqrt(2) for head 0; head 1 has q = 0 -> uniform.
    let q = [1.0, 1.0, 0.0, 0.0];
    let k = [0.0, 0.0, 1.0, 1.0];
    let v = [1.0, 0.0, 0.0, 1.0];
    let s = AttnShape { n_q: 1, kv_len: 2, n_heads: 2, n_kv_heads: 1, head_dim: 2 };
    let o = oracle::attention(&q, &k, &v, s);
    let w1 = 1.0 / (1.0 + (-(2f64.sqrt())).exp());
    assert!((o[0] - (1.0 - w1)).abs() < 1e-12 && (o[1] - w1).abs() < 1e-12);
    assert!((o[2] - 0.5).abs() < 1e-12 && (o[3] - 0.5).abs() < 1e-12);
    // Causal: with two queries, the first (position 0) sees only key 0.
    let s2 = AttnShape { n_q: 2, kv_len: 2, n_heads: 1, n_kv_heads: 1, head_dim: 2 };
    let o2 = oracle::attention(&[1.0, 1.0, 1.0, 1.0], &k, &v, s2);
    assert_eq!(&o2[..2], &[1.0, 0.0]);
}

/// The same seed draws the same random prompts, call after call: verify's report gives its seed to
/// replay, and a bundle read back is checked against a fresh draw. BabyLlama's special tokens, in
/// the id order of its tokenizer.json's added_tokens (0 `<unk>`, 1 `<s>`, 2 `</s>`), end the alphabet.
#[test]
fn the_same_seed_draws_the_same_rich_prompts() {
    use metainfer::ops::verify::{rich_alphabet, rich_prompts};
    let tok = model::hf_tokenizer(&crate::babyllama()).unwrap();
    let first = rich_alphabet(&tok);
    assert_eq!(first[first.len() - 3..], ["<unk>", "<s>", "</s>"]);
    let prompts = rich_prompts(7, 2, &first);
    for _ in 0..8 {
        let again = rich_alphabet(&tok);
        assert_eq!(again, first);
        assert_eq!(rich_prompts(7, 2, &again), prompts);
    }
}

/// Every failure mode a kernel contract lists is caught by the cases its test cases draw: over 100
/// seeds, the mutant that reproduces the mode predicts, on at least one drawn case, an output
/// outside the contract's f32 tolerance of the oracle's (or another index), on at least 99 seeds.
/// An engine that makes the mistake therefore fails run_kernel_test on nearly every run, not only
/// on lucky ones (regression: the repetition-penalty sign passed 6 of 7 seeds).
#[test]
fn each_failure_mode_is_caught_on_99_of_100_seeds() {
    use metainfer::oracle::kernels::{self, Expect};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;
    let ckb = metainfer::ckb::Ckb::embedded().unwrap();
    let mut weak = Vec::new();
    let mut checked = 0;
    for c in ckb.of_kind(metainfer::ckb::Kind::Kernel) {
        let Some(k) = kernels::get(&c.id) else { continue };
        let tol = c.tolerance.get("f32").cloned().unwrap();
        for fid in &c.failure_modes {
            let Some(name) = ckb.get(fid).ok().and_then(|f| f.failure.as_ref()?.mutant.clone()) else { continue };
            let Some(m) = kernels::mutant(&c.id, &name) else { continue };
            checked += 1;
            let mut caught = 0;
            for seed in 0..100u64 {
                let hit = c.test_cases.iter().enumerate().any(|(ci, tc)| {
                    // As run_kernel_test draws them.
                    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ metainfer::util::fnv1a(&c.id) ^ (ci as u64) << 48);
                    let case = kernels::draw(&c.id, tc, &mut rng).unwrap();
                    match ((k.oracle)(&case), (m.expect)(&case)) {
                        (Some(Expect::Values(want)), Some(Expect::Values(got))) => {
                            let got: Vec<f32> = got.iter().map(|&v| v as f32).collect();
                            !metainfer::oracle::compare(&got, &want, &tol).ok
                        }
                        (Some(Expect::Index(a)), Some(Expect::Index(b))) => a != b,
                        _ => false,
                    }
                });
                caught += usize::from(hit);
            }
            if caught < 99 {
                weak.push(format!("{} {fid} ({name}): caught on {caught}/100 seeds", c.id));
            }
        }
    }
    assert!(checked >= 20, "only {checked} failure modes with mutants");
    assert!(weak.is_empty(), "failure modes the drawn cases miss:\n{}", weak.join("\n"));
}
