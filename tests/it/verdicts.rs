//! Verdicts that cannot pass a wrong engine and do pass a right one, on a checkpoint whose
//! activations are extreme: BabyLlama stored as BF16 with one q_proj weight of 7e4 (layer 1, row 0,
//! column 9; 70144 once rounded to bf16). Attention scores near 1e4 there, where one f32 ulp is
//! 1e-3, so a correct f32 engine can differ from the f64 reference by more than the bf16 atol of
//! 1e-4: the plain engine, whose scalar sums run in one fixed order on every machine, by 3.4e-4
//! (how far an engine lands depends on its summation order: the SIMD engine's AVX-512 kernels
//! beyond 1e-4, its AVX2 kernels 3.5e-5). The weight is beyond the f16 range, so an f16 engine
//! computes infinities.

use std::path::{Path, PathBuf};

use metainfer::harness::Budget;
use metainfer::ops::kernel_test::{KernelTestRequest, kernel_test};
use metainfer::ops::verify::{VerifyReport, VerifyRequest, verify};
use serde_json::json;

use crate::checkpoints::{babyllama_tensors, babyllama_without_weights, edit_json, store};
use crate::s;

/// The weight set to 7e4 and its flat index.
const WEIGHT: (&str, usize) = ("model.layers.1.self_attn.q_proj.weight", 9);

/// The checkpoint described above, in `dir`.
fn large_activations(dir: &Path) -> PathBuf {
    babyllama_without_weights(dir);
    let mut t = babyllama_tensors();
    t.get_mut(WEIGHT.0).unwrap().1[WEIGHT.1] = 7.0e4;
    store(dir, &t, safetensors::Dtype::BF16, 1);
    edit_json(&dir.join("config.json"), |c| c["torch_dtype"] = json!("bfloat16"));
    dir.to_path_buf()
}

/// plan_engine on `model` for the CPU at `dtype`.
fn plan_at(ctx: &metainfer::ops::Ctx, model: &Path, dtype: &str) -> metainfer::ops::plan::PlanReport {
    metainfer::ops::plan::plan_only(
        ctx,
        &metainfer::ops::plan::PlanRequest {
            model: s(model),
            target: "cpu".into(),
            dtype: dtype.into(),
            ..Default::default()
        },
    )
    .unwrap()
}

fn verify_req(engine: &Path, model: &Path, dtype: Option<&str>) -> VerifyRequest {
    VerifyRequest {
        engine: s(engine),
        model: s(model),
        prompts: vec!["Once upon a time".into()],
        max_new_tokens: Some(8),
        seed: Some(17),
        dtype: dtype.map(str::to_string),
        ..Default::default()
    }
}

/// Regression: verify --dtype f16 on this checkpoint passed with "max abs 0.0": both sides computed
/// NaN and the comparison skipped them. Now plan names the weight as a dtype gap and verify refuses
/// before running, naming the weight, its value and the f16 range.
#[test]
fn a_weight_beyond_the_f16_range_is_named_at_plan_and_verify() {
    let t = tempfile::tempdir().unwrap();
    let model = large_activations(&t.path().join("model"));
    let ctx = crate::ctx(t.path());
    let plan = plan_at(&ctx, &model, "f16");
    let gap = plan.gaps.iter().find(|g| g.field == "dtype").expect("a dtype gap");
    assert!(gap.reason.contains(WEIGHT.0) && gap.reason.contains("65504"), "{}", gap.reason);
    // bf16 keeps f32's range: no gap.
    let plan = plan_at(&ctx, &model, "bf16");
    assert!(plan.gaps.iter().all(|g| g.field != "dtype"), "{:?}", plan.gaps);
    let engine = crate::Engine::Simd.shared_copy();
    let e = verify(&ctx, &verify_req(&engine, &model, Some("f16")), &Budget::secs(60)).unwrap_err();
    assert!(
        e.message.contains(WEIGHT.0)
            && e.message.contains("7.0144e4")
            && e.message.contains("choose dtype bf16 or f32"),
        "{}",
        e.message
    );
}

fn passes(ctx: &metainfer::ops::Ctx, engine: &Path, model: &Path, dtype: Option<&str>) -> VerifyReport {
    let budget = Budget::secs(900);
    let k = kernel_test(
        ctx,
        &KernelTestRequest {
            engine: s(engine),
            kernels: vec![],
            seed: Some(3),
            dtype: dtype.map(str::to_string),
            ..Default::default()
        },
        &budget,
    )
    .unwrap();
    assert!(k.passed, "{}", metainfer::ops::Report::text(&k));
    verify(ctx, &verify_req(engine, model, dtype), &budget).unwrap()
}

/// A correct engine passes on this checkpoint at f32 (the plain engine) and at bf16 (the SIMD
/// engine), because each step's atol grows with the checkpoint's own f32 rounding error
/// (model.llama's rounding margin). Without the margin, and with f32's tolerance as tight as bf16's
/// (1e-4), the plain engine fails: its error (3.4e-4, the same on every machine) is beyond 1e-4
/// though its arithmetic is right.
#[test]
fn a_correct_engine_passes_where_large_activations_make_f32_inexact() {
    let t = tempfile::tempdir().unwrap();
    let model = large_activations(&t.path().join("model"));
    let ctx = crate::ctx(t.path());
    let plain = crate::Engine::Plain.shared_copy();
    let v = passes(&ctx, &plain, &model, None);
    assert!(v.passed, "{}", metainfer::ops::Report::text(&v));
    let p = &v.prompts[0];
    assert!(p.max_abs_err > 1e-4 && p.widened_atol > p.max_abs_err, "{}", metainfer::ops::Report::text(&v));
    // A prompt that types the BOS token's text encodes with BOS twice: checked as given, with a note.
    let mut req = verify_req(&plain, &model, None);
    req.prompts = vec!["<s>Once upon a time".into()];
    let v = verify(&ctx, &req, &Budget::secs(900)).unwrap();
    assert!(v.warnings.iter().any(|w| w.contains("encodes with BOS twice")), "{}", metainfer::ops::Report::text(&v));
    let simd = crate::Engine::Simd.shared_copy();
    let v = passes(&ctx, &simd, &model, Some("bf16"));
    assert!(v.passed, "{}", metainfer::ops::Report::text(&v));
    let p = &v.prompts[0];
    assert!(p.widened_atol > 1e-4 && p.widened_atol > p.max_abs_err, "{}", metainfer::ops::Report::text(&v));

    // The same family without its rounding margin and with f32's tolerance at 1e-4: the correct
    // plain engine fails.
    let ckb = t.path().join("ckb");
    for (p, text) in metainfer::ckb::embedded_files() {
        let path = ckb.join(&p);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let text = if p == "models/llama.toml" {
            let start = text.find("[model.rounding_margin]").unwrap();
            let end = start + text[start..].find("[model.dtype_policy]").unwrap();
            let f32_tolerance = "[model.logits_tolerance.f32]\natol = 1e-3\nrtol = 1e-3\n";
            assert!(text.contains(f32_tolerance), "models/llama.toml: f32 tolerance moved");
            format!("{}{}", &text[..start], &text[end..])
                .replace(f32_tolerance, "[model.logits_tolerance.f32]\natol = 1e-4\nrtol = 1e-4\n")
        } else {
            text
        };
        std::fs::write(path, text).unwrap();
    }
    let mut strict = crate::ctx(&t.path().join("strict"));
    std::fs::create_dir_all(t.path().join("strict")).unwrap();
    strict.ckb = metainfer::ckb::Ckb::from_dir(&ckb).unwrap();
    let v = passes(&strict, &plain, &model, None);
    assert!(!v.passed && v.prompts[0].widened_atol == 0.0, "{}", metainfer::ops::Report::text(&v));
}

/// Regression: an engine whose decode steps write a K/V row at the wrong position (prefill right)
/// failed verify with an empty diagnosis: the fixed-row mutant assumes an empty cache, so no mutant
/// reproduced its logits. Now the failure contracts whose mutants first depart from the reference
/// where the engine does are named as suspects, the KV-cache one among them.
#[test]
fn a_kv_row_written_at_the_wrong_position_in_decode_is_named_as_a_suspect() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let engine = t.path().join("engine");
    crate::Engine::Simd.copy_to(&engine);
    // After RoPE, a one-token step also copies its K/V row over the previous position's: the
    // previous token's key and value are lost (prefill, several rows at once, stays right).
    let src = engine.join("src/model.rs");
    let text = std::fs::read_to_string(&src).unwrap();
    let anchor = "            trace(at, \"q_rope\", q);";
    assert!(text.contains(anchor));
    let bug = "            if rows == 1 && start > 0 {
                layer.k_cache.copy_within(start * kvd..kv_len * kvd, (start - 1) * kvd);
                layer.v_cache.copy_within(start * kvd..kv_len * kvd, (start - 1) * kvd);
            }
";
    std::fs::write(&src, text.replacen(anchor, &format!("{bug}{anchor}"), 1)).unwrap();
    let mut req = verify_req(&engine, &crate::babyllama(), None);
    req.prompts = vec!["Once upon a time there was".into()];
    let v = verify(&ctx, &req, &Budget::secs(900)).unwrap();
    let text = metainfer::ops::Report::text(&v);
    assert!(!v.passed && v.prompts[0].first_divergence >= 1, "{text}");
    assert!(!v.diagnosis.is_empty(), "{text}");
    assert!(v.diagnosis.iter().any(|d| d.failure == "failure.kv-cache-wrong-position"), "{text}");
}

/// Regression: a Gemma 2 config whose `layer_types` disagreed with the family's even/odd window
/// rule planned as covered, and the reference, computing the rule, failed a correct engine with no
/// diagnosis. The list transformers wrote agrees with the graph; a changed one is a gap at plan and
/// refused by the gates, naming the layer.
#[test]
fn layer_types_that_contradict_the_graph_are_a_gap() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let plan = |dir: &Path| plan_at(&ctx, dir, "f32");
    let written = crate::shared().join("conformance/gemma2");
    let p = plan(&written);
    assert_eq!(p.family, "model.gemma2");
    assert!(p.gaps.iter().all(|g| g.field != "layer_types"), "{:?}", p.gaps);
    // Layer 0 made full attention where the graph windows it.
    let dir = t.path().join("gemma2");
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(&written).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dir.join(f.file_name())).unwrap();
    }
    edit_json(&dir.join("config.json"), |c| c["layer_types"][0] = json!("full_attention"));
    let p = plan(&dir);
    let gap = p.gaps.iter().find(|g| g.field == "layer_types").expect("a layer_types gap");
    assert!(
        gap.reason.starts_with("layer 0 is \"full_attention\", but model.gemma2's graph gives it a sliding window"),
        "{}",
        gap.reason
    );
    // A list of the wrong length, and a type no graph names.
    edit_json(&dir.join("config.json"), |c| {
        c["layer_types"][0] = json!("sliding_attention");
        c["layer_types"].as_array_mut().unwrap().pop();
    });
    assert!(
        plan(&dir).gaps.iter().any(|g| g.field == "layer_types" && g.reason.contains("entries, but num_hidden_layers"))
    );
    edit_json(&dir.join("config.json"), |c| c["layer_types"].as_array_mut().unwrap().push(json!("chunked_attention")));
    assert!(plan(&dir).gaps.iter().any(|g| g.field == "layer_types" && g.reason.contains("\"chunked_attention\"")));
}

/// Regression: F16-stored weights under `torch_dtype: bfloat16` passed without a note, while BF16
/// under float32 is refused. They widen exactly and are checked as stored, with a note saying they
/// were converted on export.
#[test]
fn half_weights_stored_in_the_other_half_format_get_a_note() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("model");
    babyllama_without_weights(&dir);
    store(&dir, &babyllama_tensors(), safetensors::Dtype::F16, 1);
    edit_json(&dir.join("config.json"), |c| c["torch_dtype"] = json!("bfloat16"));
    let config = metainfer::model::read_config(&dir).unwrap();
    let layout = metainfer::model::weight_layout(&dir).unwrap();
    let notes = metainfer::model::dtype_notes(&config, &layout);
    assert_eq!(notes.len(), 1);
    assert!(
        notes[0].starts_with("config.json declares bfloat16 but 47 of 47 tensors are stored as F16"),
        "{}",
        notes[0]
    );
    // Declared as stored: nothing to say.
    edit_json(&dir.join("config.json"), |c| c["torch_dtype"] = json!("float16"));
    assert!(metainfer::model::dtype_notes(&metainfer::model::read_config(&dir).unwrap(), &layout).is_empty());
}

/// Busy threads on every core (twice the core count, spinning) until dropped.
struct Load {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start() -> Load {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let n = 2 * std::thread::available_parallelism().map_or(2, |n| n.get());
        let threads = (0..n)
            .map(|i| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut x = i as u64 + 1;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        for _ in 0..10_000 {
                            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        }
                        std::hint::black_box(x);
                    }
                })
            })
            .collect();
        Load { stop, threads }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The timing-based verdicts do not flip on a loaded machine: profile_engine timed on a quiet machine
/// and then, after a change that does not touch the computation (a comment), timed again with busy
/// threads on every core calls no regression (both builds are timed alternately in the loaded call,
/// so the load slows both) and never calls the engine faster than the compute bound.
#[test]
fn timing_verdicts_do_not_flip_under_load() {
    use metainfer::ops::profile::{ProfileRequest, profile};
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let engine = t.path().join("engine");
    crate::Engine::Simd.copy_to(&engine);
    let req = ProfileRequest {
        engine: s(&engine),
        model: s(&crate::babyllama()),
        prompt_len: Some(8),
        new_tokens: Some(32),
        runs: Some(5),
        ..Default::default()
    };
    // Phase order: profile counts on sources whose kernels and generation passed.
    assert!(passes(&ctx, &engine, &crate::babyllama(), None).passed);
    let quiet = profile(&ctx, &req, &Budget::secs(900)).unwrap();
    assert!(quiet.passed, "{}", metainfer::ops::Report::text(&quiet));
    let lib = engine.join("src/lib.rs");
    let text = std::fs::read_to_string(&lib).unwrap();
    std::fs::write(&lib, format!("{text}\n// A comment: the same computation.\n")).unwrap();
    assert!(passes(&ctx, &engine, &crate::babyllama(), None).passed);
    let loaded = {
        let _load = Load::start();
        profile(&ctx, &req, &Budget::secs(1800)).unwrap()
    };
    let text = metainfer::ops::Report::text(&loaded);
    assert!(loaded.passed, "{text}");
    let prev = loaded.previous.as_ref().expect("the quiet profile is the previous one");
    assert!(!prev.same_sources && !prev.regression, "{text}");
    assert!(loaded.decode_tok_s.max <= loaded.compute_bound_tok_s, "{text}");
}

/// verify with logits rows left out (`logits_every`: what a large vocabulary gets by default, so a
/// device's reply stays small) still judges every step: a right engine passes with every step of
/// every prompt judged; an engine whose logits go wrong only where a row does not come back
/// (position 26, step 9 of the golden prompt's 18 ids: rows 0 to 7 and every 4th come back whole)
/// fails there, through the 16 largest logits that do come back: its largest logit raised by 1 (the
/// token unchanged), named with its error; a -inf far below the largest, named as non-finite.
#[test]
fn logits_rows_left_out_still_judge_every_step() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let model = crate::babyllama();
    let req = |engine: &Path| VerifyRequest {
        engine: s(engine),
        model: s(&model),
        prompts: vec!["Once upon a time".into()],
        max_new_tokens: Some(16),
        seed: Some(17),
        logits_every: Some(4),
        ..Default::default()
    };
    let right = crate::Engine::Plain.shared_copy();
    let budget = Budget::secs(900);
    let k = kernel_test(&ctx, &KernelTestRequest { engine: s(&right), seed: Some(3), ..Default::default() }, &budget);
    assert!(k.unwrap().passed);
    let v = verify(&ctx, &req(&right), &budget).unwrap();
    let text = metainfer::ops::Report::text(&v);
    assert!(v.passed, "{text}");
    // Every prompt judged to its end: 16 steps, or the reference's EOS before them.
    assert!(v.prompts.iter().all(|p| p.steps >= 16 || p.stopped_at_eos), "{text}");
    assert_eq!(v.prompts[0].steps, 16, "{text}");

    let wrong = t.path().join("engine");
    crate::Engine::Plain.copy_to(&wrong);
    let fault = |at_26: &str| {
        crate::replace_body(
            &wrong,
            "src/model.rs",
            "pub fn forward(",
            &format!(
                "self.forward_traced(token, pos, &mut |_, _, _| {{}});
        if pos == 26 {{
            {at_26}
        }}
        &self.s.logits"
            ),
        );
        let v = verify(&ctx, &req(&wrong), &budget).unwrap();
        let text = metainfer::ops::Report::text(&v);
        assert!(!v.passed && !v.prompts[0].logits_ok && v.prompts[0].first_divergence == 9, "{text}");
        v
    };
    let v = fault(
        "let top = (0..self.s.logits.len()).max_by(|&a, &b| self.s.logits[a].total_cmp(&self.s.logits[b])).unwrap();
            self.s.logits[top] += 1.0;",
    );
    let p = &v.prompts[0];
    let d = p.divergence.as_ref().unwrap();
    assert!(p.tokens_ok && (d.engine - d.reference - 1.0).abs() < 1e-3, "{}", metainfer::ops::Report::text(&v));
    let v = fault("self.s.logits[40] = f32::NEG_INFINITY;");
    let p = &v.prompts[0];
    assert!(p.error.contains("-inf in the engine's output at token 40 of step 9"), "{}", p.error);
}

/// The plain engine copied into `dir/engine`, its model.rs given a `PROMPTS` counter for a faking
/// body to count its prompts with.
fn counting_engine(dir: &Path) -> PathBuf {
    let engine = dir.join("engine");
    crate::Engine::Plain.copy_to(&engine);
    let file = engine.join("src/model.rs");
    let mut text = std::fs::read_to_string(&file).unwrap();
    text += "\nstatic PROMPTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);\n";
    std::fs::write(&file, text).unwrap();
    engine
}

/// A profile of `engine` on BabyLlama: 8 prompt tokens, 16 new, `runs` runs.
fn babyllama_profile(engine: &Path, runs: usize) -> metainfer::ops::profile::ProfileRequest {
    metainfer::ops::profile::ProfileRequest {
        engine: s(engine),
        model: s(&crate::babyllama()),
        prompt_len: Some(8),
        new_tokens: Some(16),
        runs: Some(runs),
        ..Default::default()
    }
}

/// A profile's figures are medians over its timed runs, so every timed run is checked against the
/// reference (before, only the first two were: an engine that decoded honestly twice and then
/// returned its last logits without computing reported decode several times faster and passed).
/// This engine counts its prompts (prefill from position 0) and from the fifth on decodes without
/// computing (its logits pick a token by position): its kernels and verify (four prompts) pass,
/// its profile of five runs fails, naming the timed runs' tokens.
#[test]
fn a_profile_checks_every_timed_run() {
    use metainfer::ops::profile::profile;
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let model = crate::babyllama();
    let wrong = counting_engine(t.path());
    crate::replace_body(
        &wrong,
        "src/model.rs",
        "pub fn prefill(",
        "for (i, &token) in tokens.iter().enumerate() {
            self.forward_traced(token, start_pos + i, &mut |_, _, _| {});
        }
        if start_pos == 0 {
            PROMPTS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        &self.s.logits",
    );
    crate::replace_body(
        &wrong,
        "src/model.rs",
        "pub fn forward(",
        "if PROMPTS.load(std::sync::atomic::Ordering::SeqCst) > 4 {
            let n = self.s.logits.len();
            self.s.logits.iter_mut().enumerate().for_each(|(i, l)| *l = if i == (pos * 31 + 7) % n { 1.0 } else { 0.0 });
            return &self.s.logits;
        }
        self.forward_traced(token, pos, &mut |_, _, _| {})",
    );
    let budget = Budget::secs(900);
    let k = kernel_test(&ctx, &KernelTestRequest { engine: s(&wrong), seed: Some(3), ..Default::default() }, &budget);
    assert!(k.unwrap().passed);
    let v = verify(&ctx, &verify_req(&wrong, &model, None), &budget).unwrap();
    assert!(v.passed, "{}", metainfer::ops::Report::text(&v));
    let req = babyllama_profile(&wrong, 5);
    let p = profile(&ctx, &req, &budget).unwrap();
    let text = metainfer::ops::Report::text(&p);
    assert!(!p.passed && !p.outputs_ok && p.runs_checked == 5, "{text}");
    assert!(p.error.contains("the timed runs did not generate the reference's greedy tokens"), "{text}");
}

/// The prefill-by-length and traced runs are timed too, so a majority of each (drawn when the reply
/// is judged) is checked against the reference. This engine prefills its first five prompts (the
/// timed decode runs) honestly and then answers every prefill without computing (a token picked
/// by the prompt's length): its decode runs pass the check, its prefill runs at 2, 4 and 8 tokens
/// and its traced runs (whose first token comes from a prefill) fail it, each named.
#[test]
fn a_profile_checks_its_prefill_by_length_and_traced_runs() {
    use metainfer::ops::profile::profile;
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let wrong = counting_engine(t.path());
    crate::replace_body(
        &wrong,
        "src/model.rs",
        "pub fn prefill(",
        "if start_pos == 0 && PROMPTS.fetch_add(1, std::sync::atomic::Ordering::SeqCst) >= 5 {
            let n = self.s.logits.len();
            self.s.logits.iter_mut().enumerate().for_each(|(i, l)| *l = if i == (tokens.len() * 31 + 7) % n { 1.0 } else { 0.0 });
            return &self.s.logits;
        }
        for (i, &token) in tokens.iter().enumerate() {
            self.forward_traced(token, start_pos + i, &mut |_, _, _| {});
        }
        &self.s.logits",
    );
    let req = babyllama_profile(&wrong, 5);
    let p = profile(&ctx, &req, &Budget::secs(900)).unwrap();
    let text = metainfer::ops::Report::text(&p);
    // Decode runs: all five checked and right; prefill: 3 of 5 at each of 3 lengths; traced: 3 of 5.
    assert!(!p.passed && !p.outputs_ok, "{text}");
    assert_eq!((p.runs_checked, p.prefill_runs_checked, p.traced_runs_checked), (5, 9, 3), "{text}");
    assert!(!p.error.contains("the timed runs did not generate"), "{text}");
    assert!(
        p.error.contains("the prefill-by-length or traced runs did not generate the reference's greedy tokens"),
        "{text}"
    );
    for len in [2, 4, 8] {
        assert!(p.error.contains(&format!("of {len} tokens chose token {}", (len * 31 + 7) % 105)), "{text}");
    }
    assert!(p.error.contains("traced run"), "{text}");
}

/// A profile's figures are of the decode asked for, so every timed run must generate all its
/// tokens (a CUDA engine's `decode_greedy` returning fewer than the harness timed it for would
/// report a speed too high). This engine says its context ends 4 positions after the prompt: its
/// runs decode 4 tokens, not 16 (those it generates are the reference's), and the profile fails
/// naming the counts, where it passed before with figures of a shorter decode.
#[test]
fn a_profile_fails_runs_that_generate_fewer_tokens_than_asked() {
    use metainfer::ops::profile::profile;
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let short = t.path().join("engine");
    crate::Engine::Plain.copy_to(&short);
    crate::replace_body(&short, "src/model.rs", "pub fn max_seq_len(", "12");
    let req = babyllama_profile(&short, 3);
    let p = profile(&ctx, &req, &Budget::secs(900)).unwrap();
    let text = metainfer::ops::Report::text(&p);
    assert!(!p.passed && !p.outputs_ok, "{text}");
    assert!(
        p.error.contains("timed runs generated other token counts than the 17 asked for")
            && p.error.contains("decode run 0: 5 tokens"),
        "{text}"
    );
    assert!(p.error.contains("traced runs of [5, 5, 5] tokens, not 17 each"), "{text}");
}
