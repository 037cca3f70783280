//! `metainfer bench`: decode speed of the example engine (every weight dtype it declares) against
//! candle 0.11 as a peer, alternating in one run, on BabyLlama and on the stories15M shape, at 1 and
//! 2 threads; the fraction of the machine's measured bandwidth roofline; and the speed of the agent's
//! loop (one-line edit, compile, kernel tests, verify) with the server's overhead over raw cargo;
//! with `--serving`, serve_engine's load test of the example engine on the stories15M shape at
//! concurrency 1, 4 and 16 (output tokens/s, TTFT and ITL, every answer checked).
//!
//! Candle runs only when the binary was built with the `candle-oracle` feature, in a child process
//! of this binary (`metainfer bench-peer`), so each thread count gets its own process and pool.
//! Every figure is a median over the repetitions, with min and max; ratios are between medians
//! measured in the same run. It calls ops and harness like any client.
//!
//! `metainfer bench-reference` ([`reference()`]): the f64 reference's peak memory and seconds per
//! token on one checkpoint (e.g. `synth --preset llama3.2-1b`), in a process of its own.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use crate::error::{Context, Error, Result};
use crate::harness::protocol::{Command, Reply};
use crate::harness::{self, Budget};
use crate::ops::{self, Ctx, Report};
use crate::stats::Spread;

mod serving;
pub use serving::{SERVING_LEVELS, Serving};

/// The stories15M shape (Karpathy, llama2.c README model table: dim 288, 6 layers, 6 heads,
/// vocab 32000, hidden_dim 768, max_seq_len 256) as a Hugging Face Llama config.
pub fn stories15m_config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 288,
        "intermediate_size": 768,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "num_key_value_heads": 6,
        "vocab_size": 32000,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": true,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32"
    })
}

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Alternating repetitions per configuration.
    pub reps: usize,
    /// Thread counts.
    pub threads: Vec<usize>,
    /// Prompt tokens before the timed decode.
    pub prompt_len: usize,
    /// Decoded tokens per run.
    pub new_tokens: usize,
    /// Also time the agent's loop (edits, compile, kernel tests, verify).
    pub agent_loop: bool,
    /// Also run serve_engine's load test on the stories15M shape ([`SERVING_LEVELS`]).
    pub serving: bool,
    /// llama.cpp as a peer on the stories15M shape: its `llama-bench` executable and a GGUF of
    /// that shape per engine dtype it stands beside (`f32`: an F32 GGUF; `int8`: a Q8_0 GGUF).
    pub llama: Option<LlamaPeer>,
}

/// llama.cpp's `llama-bench` as a peer (see [`BenchOptions::llama`]).
#[derive(Debug, Clone)]
pub struct LlamaPeer {
    /// The `llama-bench` executable.
    pub exe: PathBuf,
    /// (engine dtype, GGUF file): `f32` beside an F32 GGUF, `int8` beside a Q8_0 GGUF.
    pub gguf: Vec<(String, PathBuf)>,
}

/// The runner label of llama.cpp beside the engine's `dtype` (`int8` stands beside Q8_0).
fn llama_runner(dtype: &str) -> String {
    if dtype == "int8" { "llama.cpp q8_0".into() } else { format!("llama.cpp {dtype}") }
}

/// Bytes per weight of llama.cpp's format beside `dtype`: Q8_0 stores 32 int8 weights with one
/// f16 scale, 34 bytes per 32 weights (ggml's block_q8_0).
fn llama_weight_bytes(dtype: &str) -> f64 {
    if dtype == "int8" { 34.0 / 32.0 } else { 4.0 }
}

/// Decode tokens/s of one `llama-bench` run: `-m GGUF -p 0 -n N -r 1 -t T -o json` prints a JSON
/// array of tests, each with `n_prompt`, `n_gen` and `avg_ts` (tokens/s); the text-generation test
/// is the one with `n_prompt` 0 and `n_gen` > 0.
fn llama_run(exe: &Path, gguf: &Path, new_tokens: usize, threads: usize, budget: &Budget) -> Result<f64> {
    let args: Vec<std::ffi::OsString> = vec![
        "-m".into(),
        gguf.as_os_str().to_owned(),
        "-p".into(),
        "0".into(),
        "-n".into(),
        new_tokens.to_string().into(),
        "-r".into(),
        "1".into(),
        "-t".into(),
        threads.to_string().into(),
        "-o".into(),
        "json".into(),
    ];
    let run = harness::run_program(exe, &args, &[], budget)?;
    if !run.ok() {
        return Err(Error::usage(format!("llama-bench {} failed: {}", exe.display(), run.failure_text(1500))));
    }
    llama_tok_s(&run.stdout).ok_or_else(|| {
        Error::usage(format!(
            "llama-bench {} printed no text-generation result (a JSON array with n_prompt 0, n_gen > 0 and avg_ts): {}",
            exe.display(),
            run.stdout.chars().take(400).collect::<String>()
        ))
    })
}

/// The text-generation tokens/s in `llama-bench -o json` output (see [`llama_run`]).
fn llama_tok_s(stdout: &str) -> Option<f64> {
    let start = stdout.find('[')?;
    let tests: Vec<serde_json::Value> = serde_json::from_str(stdout[start..].trim_end()).ok()?;
    tests.iter().find_map(|t| {
        let gen_only = t["n_prompt"].as_u64() == Some(0) && t["n_gen"].as_u64().is_some_and(|n| n > 0);
        t["avg_ts"].as_f64().filter(|v| gen_only && v.is_finite() && *v > 0.0)
    })
}

/// One row of the decode table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Model label.
    pub model: String,
    /// Threads.
    pub threads: usize,
    /// Runner: `engine f32`, `engine bf16`, `engine int8`, `candle f32`.
    pub runner: String,
    /// Decode tokens/s over the repetitions.
    pub decode_tok_s: Spread,
    /// Bytes of weights read per token.
    pub bytes_per_token: f64,
    /// Read bandwidth measured at this model's bytes per token as working set, these threads, GB/s.
    pub bandwidth_gbs: Spread,
    /// `bandwidth_gbs` median / bytes per token, tokens/s.
    pub roofline_tok_s: f64,
}

/// Agent-loop timings, seconds.
#[derive(Debug, Clone, Serialize)]
pub struct AgentLoop {
    /// compile_engine + run_kernel_test after a one-line edit of the engine.
    pub edit_compile_kernels_s: Spread,
    /// verify_generation on BabyLlama (sources unchanged since the kernel tests).
    pub verify_s: Spread,
    /// compile_engine after a one-line edit.
    pub compile_s: Spread,
    /// The same `cargo build` run directly after a one-line edit.
    pub raw_cargo_s: Spread,
}

/// Everything measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Machine fingerprint.
    pub machine: String,
    /// Thread counts measured.
    pub threads: Vec<usize>,
    /// Decode rows.
    pub rows: Vec<Row>,
    /// Agent loop, when timed.
    pub agent_loop: Option<AgentLoop>,
    /// Serving load test, when run.
    pub serving: Option<Serving>,
    /// Whether candle ran.
    pub candle: bool,
}

fn spread_of(v: &[f64]) -> Spread {
    Spread::of(v)
}

/// The harness's decode seconds per token for one run (RAYON_NUM_THREADS = `threads`), median over
/// the run's tokens.
fn engine_run(ctx: &Ctx, exe: &Path, model: &Path, o: &BenchOptions, threads: usize, budget: &Budget) -> Result<f64> {
    let scratch = ctx.workshop.scratch()?;
    let command = Command::Profile {
        model: model.to_path_buf(),
        prompt_len: o.prompt_len,
        new_tokens: o.new_tokens,
        runs: 1,
        seed: base::util::fresh_seed(),
    };
    let env = [("RAYON_NUM_THREADS", threads.to_string())];
    let grants = harness::Grants::harness(exe, scratch.path()).read(model);
    match ctx.workshop.call(exe, scratch.path(), command, &env, &grants, budget)?.ok("engine run", 1500) {
        Ok(Reply::Profile(t)) if !t.decode_s_per_token.is_empty() => Ok(crate::stats::median(&t.decode_s_per_token)),
        Ok(other) => Err(Error::internal(format!("engine run replied {other:?}"))),
        Err(why) => Err(Error::internal(why)),
    }
}

/// Candle's decode seconds per token for one run, in a child process of this binary.
fn candle_run(model: &Path, o: &BenchOptions, threads: usize, budget: &Budget) -> Result<f64> {
    let exe = std::env::current_exe().internal_ctx(|| "own executable".to_owned())?;
    let args: [std::ffi::OsString; 4] = [
        "bench-peer".into(),
        model.as_os_str().to_owned(),
        o.prompt_len.to_string().into(),
        o.new_tokens.to_string().into(),
    ];
    let run = harness::run_program(&exe, &args, &[("RAYON_NUM_THREADS", threads.to_string())], budget)?;
    if !run.ok() {
        return Err(Error::internal(format!("candle run {}", run.failure_text(1500))));
    }
    run.stdout
        .lines()
        .last()
        .and_then(|l| l.trim().parse::<f64>().ok())
        .ok_or_else(|| Error::internal("candle run printed no decode time"))
}

/// Decode `new_tokens` greedily with candle-transformers' Llama after a `prompt_len` prefill, and
/// return seconds per decoded token (threads from RAYON_NUM_THREADS, as candle reads it).
///
/// # Errors
/// When the checkpoint cannot be loaded by candle.
#[cfg(feature = "candle-oracle")]
pub fn candle_decode(model: &Path, prompt_len: usize, new_tokens: usize) -> Result<f64> {
    use candle_core::{DType, Device, Tensor};
    use candle_transformers::models::llama;
    let fail = |e: candle_core::Error| Error::internal(format!("candle: {e}"));
    let cfg: llama::LlamaConfig =
        serde_json::from_slice(&std::fs::read(model.join("config.json")).ctx(|| "config.json".to_owned())?)
            .ctx(|| "config.json".to_owned())?;
    let cfg = cfg.into_config(false);
    // SAFETY: the checkpoint is not modified while mapped (a file of ../shared or written by bench).
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(&[model.join("model.safetensors")], DType::F32, &Device::Cpu)
    }
    .map_err(fail)?;
    let m = llama::Llama::load(vb, &cfg).map_err(fail)?;
    let mut cache = llama::Cache::new(true, DType::F32, &cfg, &Device::Cpu).map_err(fail)?;
    let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| (i * 7 + 3) % cfg.vocab_size as u32).collect();
    let input = Tensor::new(prompt.as_slice(), &Device::Cpu).and_then(|t| t.unsqueeze(0)).map_err(fail)?;
    let logits = m.forward(&input, 0, &mut cache).map_err(fail)?;
    let mut next = logits.argmax(candle_core::D::Minus1).and_then(|t| t.flatten_all()).map_err(fail)?;
    let start = Instant::now();
    for pos in prompt_len..prompt_len + new_tokens {
        let input = next.unsqueeze(0).map_err(fail)?;
        let logits = m.forward(&input, pos, &mut cache).map_err(fail)?;
        next = logits.argmax(candle_core::D::Minus1).and_then(|t| t.flatten_all()).map_err(fail)?;
    }
    let _ = next.to_vec1::<u32>().map_err(fail)?;
    Ok(start.elapsed().as_secs_f64() / new_tokens.max(1) as f64)
}

fn weights_streamed(cfg: &crate::model::ResolvedConfig) -> f64 {
    let per_layer =
        cfg.hidden * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * cfg.hidden * cfg.intermediate;
    (cfg.n_layers * per_layer + cfg.vocab * cfg.hidden) as f64
}

/// Run the benchmark. `work` holds the engine copy and the synthetic checkpoint.
///
/// # Errors
/// When the engine does not build, a run fails, or a model cannot be read.
pub fn run(ctx: &Ctx, o: &BenchOptions, work: &Path) -> Result<BenchReport> {
    let budget = Budget::secs(ctx.time_limit_s);
    let engine_dir = work.join("engine");
    if !engine_dir.exists() {
        crate::demo::write_example_engine(&engine_dir)?;
    }
    let s15 = work.join("stories15m");
    if !s15.exists() {
        crate::ops::synth::write_checkpoint(&s15, &stories15m_config(), 0)?;
    }
    // BabyLlama: $METAINFER_MODEL, else the copy built into the binary (as the demo runs it).
    let baby = match std::env::var_os("METAINFER_MODEL") {
        Some(m) => PathBuf::from(m),
        None => crate::model::embedded::write_babyllama(work)?,
    };
    let models: Vec<(String, PathBuf)> =
        vec![("babyllama-105".into(), baby.clone()), ("stories15M shape".into(), s15.clone())];
    let engine = ctx.workshop.engine(&engine_dir)?;
    let table: toml::Table = std::fs::read_to_string(engine_dir.join("metainfer.toml"))
        .ok()
        .and_then(|t| toml::from_str(&t).ok())
        .unwrap_or_default();
    let mut dtypes = vec!["f32".to_string()];
    if let Some(f) = table.get("dtype_features").and_then(|v| v.as_table()) {
        dtypes.extend(["bf16", "int8"].iter().filter(|d| f.contains_key(**d)).map(|d| d.to_string()));
    }
    let mut exes = Vec::new();
    for d in &dtypes {
        let target = ctx.target(&engine, Some(d))?;
        eprintln!("bench: building the harness for the {d} engine");
        let build = ctx.workshop.build_harness(&engine, &target.spec, &budget)?;
        let exe = build.executable.clone().filter(|_| build.ok).ok_or_else(|| {
            Error::internal(format!("the {d} engine does not build:\n{}", build.run.failure_text(3000)))
        })?;
        exes.push((d.clone(), exe));
    }
    let candle = cfg!(feature = "candle-oracle");
    let mut rows = Vec::new();
    for (label, dir) in &models {
        let cfg = crate::model::load_config(&ctx.ckb, dir)?;
        let weights = weights_streamed(&cfg);
        for &t in &o.threads {
            // llama.cpp runs on the stories15M shape only (the GGUFs hold that shape).
            let peers: &[(String, PathBuf)] = match &o.llama {
                Some(l) if dir == &s15 => &l.gguf,
                _ => &[],
            };
            let mut samples: Vec<Vec<f64>> = vec![Vec::new(); exes.len() + 1 + peers.len()];
            for rep in 0..o.reps {
                eprintln!("bench: {label}, {t} thread(s), repetition {}/{}", rep + 1, o.reps);
                for (i, (_, exe)) in exes.iter().enumerate() {
                    samples[i].push(1.0 / engine_run(ctx, exe, dir, o, t, &budget)?);
                }
                if candle {
                    samples[exes.len()].push(1.0 / candle_run(dir, o, t, &budget)?);
                }
                for (j, (_, gguf)) in peers.iter().enumerate() {
                    let exe = &o.llama.as_ref().expect("peers come from o.llama").exe;
                    samples[exes.len() + 1 + j].push(llama_run(exe, gguf, o.new_tokens, t, &budget)?);
                }
            }
            let mut runners: Vec<(String, f64)> =
                exes.iter().map(|(d, _)| (format!("engine {d}"), ops::profile::roofline::weight_bytes(d))).collect();
            runners.push(("candle f32".into(), 4.0));
            runners.extend(peers.iter().map(|(d, _)| (llama_runner(d), llama_weight_bytes(d))));
            for (i, (runner, wb)) in runners.into_iter().enumerate() {
                if samples[i].is_empty() {
                    continue;
                }
                // int8 also reads one f32 scale per output row.
                let scales = if wb == 1.0 {
                    4.0 * (cfg.n_layers
                        * (cfg.head_dim * (cfg.n_heads + 2 * cfg.n_kv_heads) + 2 * cfg.intermediate + cfg.hidden)
                        + cfg.vocab) as f64
                } else {
                    0.0
                };
                let bytes = weights * wb + scales;
                // The roofline: this machine's read bandwidth with exactly this working set.
                let bw: Vec<f64> = (0..5).map(|_| crate::probe::read_bandwidth(bytes as usize, t, 0.05)).collect();
                let bandwidth = spread_of(&bw);
                rows.push(Row {
                    model: label.clone(),
                    threads: t,
                    runner,
                    decode_tok_s: spread_of(&samples[i]),
                    bytes_per_token: bytes,
                    roofline_tok_s: bandwidth.median * 1e9 / bytes,
                    bandwidth_gbs: bandwidth,
                });
            }
        }
    }
    let serving =
        if o.serving { Some(serving::run(ctx, &engine_dir, &work.join("stories15m"), &budget)?) } else { None };
    let agent_loop =
        if o.agent_loop { Some(agent_loop(ctx, &engine_dir, &baby, o.reps.max(3), &budget)?) } else { None };
    Ok(BenchReport {
        machine: crate::probe::fingerprint(),
        threads: o.threads.clone(),
        rows,
        agent_loop,
        serving,
        candle,
    })
}

/// Append a comment line to the engine's kernels.rs: a one-line edit that forces a rebuild.
fn edit(engine_dir: &Path, n: usize) -> Result<()> {
    let p = engine_dir.join("src/kernels.rs");
    let mut s = std::fs::read_to_string(&p).internal_ctx(|| p.display().to_string())?;
    s.push_str(&format!("// edit {n}\n"));
    std::fs::write(&p, s).internal_ctx(|| p.display().to_string())
}

fn agent_loop(ctx: &Ctx, engine_dir: &Path, model: &Path, reps: usize, budget: &Budget) -> Result<AgentLoop> {
    let e = engine_dir.display().to_string();
    let model = model.display().to_string();
    let compile_req = ops::compile::CompileRequest { engine: e.clone(), cursor: None };
    let kernels_req = ops::kernel_test::KernelTestRequest {
        engine: e.clone(),
        kernels: vec![],
        seed: None,
        dtype: None,
        write_bundle: None,
        from_bundle: None,
    };
    let verify_req = ops::verify::VerifyRequest {
        engine: e.clone(),
        model,
        prompts: vec![],
        max_new_tokens: None,
        seed: None,
        dtype: None,
        logits_every: None,
        write_bundle: None,
        from_bundle: None,
    };
    // Warm: dependencies, the harness and the engine built once.
    ops::compile::compile(ctx, &compile_req, budget)?;
    ops::kernel_test::kernel_test(ctx, &kernels_req, budget)?;
    let (mut loop_s, mut verify_s, mut compile_s, mut raw_s) = (vec![], vec![], vec![], vec![]);
    for i in 0..reps {
        eprintln!("bench: agent loop {}/{reps}", i + 1);
        edit(engine_dir, 3 * i)?;
        let t = Instant::now();
        let c = ops::compile::compile(ctx, &compile_req, budget)?;
        let k = ops::kernel_test::kernel_test(ctx, &kernels_req, budget)?;
        loop_s.push(t.elapsed().as_secs_f64());
        if !c.passed() || !k.passed() {
            return Err(Error::internal(format!("the example engine failed a gate:\n{}\n{}", c.text(), k.text())));
        }
        let t = Instant::now();
        let v = ops::verify::verify(ctx, &verify_req, budget)?;
        verify_s.push(t.elapsed().as_secs_f64());
        if !v.passed() {
            return Err(Error::internal(format!("the example engine failed verify:\n{}", v.text())));
        }
        edit(engine_dir, 3 * i + 1)?;
        let t = Instant::now();
        ops::compile::compile(ctx, &compile_req, budget)?;
        compile_s.push(t.elapsed().as_secs_f64());
        // The same cargo command on the same snapshot, after the same kind of edit.
        edit(engine_dir, 3 * i + 2)?;
        let engine = ctx.workshop.engine(engine_dir)?;
        let t = Instant::now();
        ctx.workshop.cargo_build_incremental(&engine.build_dir.join("Cargo.toml"), budget)?;
        raw_s.push(t.elapsed().as_secs_f64());
    }
    Ok(AgentLoop {
        edit_compile_kernels_s: spread_of(&loop_s),
        verify_s: spread_of(&verify_s),
        compile_s: spread_of(&compile_s),
        raw_cargo_s: spread_of(&raw_s),
    })
}

impl BenchReport {
    /// The table and the goals, as text.
    pub fn text(&self) -> String {
        let mut s = format!(
            "machine: {}\nroofline: read bandwidth measured in this run with the model's bytes per token as the working set\n",
            self.machine
        );
        if !self.candle {
            s += "candle: not built in (build with --features candle-oracle to compare)\n";
        }
        s += &format!(
            "\n{:<18} {:>3}  {:<14} {:>10} {:>10} {:>10} {:>8} {:>9} {:>9} {:>9}\n",
            "model", "thr", "runner", "tok/s med", "min", "max", "GB/s", "roofline", "vs candle", "vs f32"
        );
        let find = |m: &str, t: usize, r: &str| {
            self.rows.iter().find(|x| x.model == m && x.threads == t && x.runner == r).map(|x| x.decode_tok_s.median)
        };
        for r in &self.rows {
            let candle = find(&r.model, r.threads, "candle f32");
            let f32e = find(&r.model, r.threads, "engine f32");
            let ratio = |other: Option<f64>| match other {
                Some(o) if o > 0.0 && r.runner != "candle f32" => format!("{:.2}x", r.decode_tok_s.median / o),
                _ => "-".into(),
            };
            s += &format!(
                "{:<18} {:>3}  {:<14} {:>10.0} {:>10.0} {:>10.0} {:>8.1} {:>8.0}% {:>9} {:>9}\n",
                r.model,
                r.threads,
                r.runner,
                r.decode_tok_s.median,
                r.decode_tok_s.min,
                r.decode_tok_s.max,
                r.bandwidth_gbs.median,
                100.0 * r.decode_tok_s.median / r.roofline_tok_s.max(1e-9),
                ratio(candle),
                if r.runner.starts_with("engine") && r.runner != "engine f32" { ratio(f32e) } else { "-".into() },
            );
        }
        s += "\ngoals (stories15M shape unless named; medians of this run):\n";
        let goal = |ok: bool| if ok { "met" } else { "NOT met" };
        let s15 = "stories15M shape";
        if let Some(r) = self.rows.iter().find(|r| r.model == s15 && r.threads == 1 && r.runner == "engine f32") {
            let frac = r.decode_tok_s.median / r.roofline_tok_s.max(1e-9);
            s += &format!(
                "  f32 decode >= 0.9 of the bandwidth roofline (1 thread): {:.2} ({})\n",
                frac,
                goal(frac >= 0.9)
            );
        }
        for &t in &self.threads {
            if let (Some(e), Some(c)) = (find(s15, t, "engine f32"), find(s15, t, "candle f32")) {
                s += &format!("  f32 >= 3x candle ({t} thread(s)): {:.2}x ({})\n", e / c, goal(e / c >= 3.0));
            }
            if let (Some(b), Some(f)) = (find(s15, t, "engine bf16"), find(s15, t, "engine f32")) {
                s += &format!("  bf16 >= 1.7x f32 ({t} thread(s)): {:.2}x ({})\n", b / f, goal(b / f >= 1.7));
            }
            if let (Some(q), Some(f)) = (find(s15, t, "engine int8"), find(s15, t, "engine f32")) {
                s += &format!("  int8 >= 3x f32 ({t} thread(s)): {:.2}x ({})\n", q / f, goal(q / f >= 3.0));
            }
        }
        // Beside llama.cpp on the same shape: >= 1.5x at 1 thread, >= 1.2x at 2 (f32 beside its F32
        // GGUF, int8 beside Q8_0).
        for &t in &self.threads {
            for d in ["f32", "int8"] {
                if let (Some(e), Some(l)) = (find(s15, t, &format!("engine {d}")), find(s15, t, &llama_runner(d))) {
                    let want = if t == 1 { 1.5 } else { 1.2 };
                    s += &format!(
                        "  {d} >= {want}x {} ({t} thread(s)): {:.2}x ({})\n",
                        llama_runner(d),
                        e / l,
                        goal(e / l >= want)
                    );
                }
            }
        }
        // Issue goal: 2 threads >= 1.7x 1 thread. A decode that streams its weights from DRAM is
        // bounded by how the read bandwidth scales from 1 to 2 threads at that working set (the
        // ratio of the two rows' rooflines), printed beside the figure.
        let row = |t: usize, r: &str| self.rows.iter().find(|x| x.model == s15 && x.threads == t && x.runner == r);
        for runner in ["engine f32", "engine bf16", "engine int8"] {
            if let (Some(one), Some(two)) = (row(1, runner), row(2, runner)) {
                let up = two.decode_tok_s.median / one.decode_tok_s.median.max(1e-9);
                let bw = two.bandwidth_gbs.median / one.bandwidth_gbs.median.max(1e-9);
                s += &format!(
                    "  {} 2 threads >= 1.7x 1 thread: {up:.2}x ({}; read bandwidth at its working set scales {bw:.2}x here)\n",
                    &runner["engine ".len()..],
                    goal(up >= 1.7)
                );
            }
        }
        if let Some(b) = find("babyllama-105", 1, "engine f32") {
            s += &format!("  BabyLlama >= 5,000 tok/s on one thread: {b:.0} ({})\n", goal(b >= 5000.0));
        }
        if let Some(sv) = &self.serving {
            s += &self.serving_text(sv);
        }
        if let Some(a) = &self.agent_loop {
            let over = a.compile_s.median / a.raw_cargo_s.median.max(1e-9) - 1.0;
            s += &format!(
                "\nagent loop (medians, min-max):\n  one-line edit + compile_engine + run_kernel_test: {:.2} s ({:.2}-{:.2}) ({})\n  verify_generation on BabyLlama: {:.2} s ({:.2}-{:.2}) ({})\n  compile_engine {:.2} s vs raw cargo build {:.2} s: server adds {:+.1}% ({})\n",
                a.edit_compile_kernels_s.median,
                a.edit_compile_kernels_s.min,
                a.edit_compile_kernels_s.max,
                goal(a.edit_compile_kernels_s.median <= 5.0),
                a.verify_s.median,
                a.verify_s.min,
                a.verify_s.max,
                goal(a.verify_s.median <= 3.0),
                a.compile_s.median,
                a.raw_cargo_s.median,
                100.0 * over,
                goal(over <= 0.05)
            );
        }
        s
    }
}

/// The f64 reference forward pass (what verify_generation computes its expected logits with) on one
/// checkpoint: memory and speed. The reference holds every weight as f64 (8 bytes per parameter);
/// it is built from the f32 tensors read from the files, each freed once widened, so the peak is
/// about 8 bytes per parameter plus the f32 copy not yet widened; decode reads all of them once per
/// token.
#[derive(Debug, Clone, Serialize)]
pub struct ReferenceBench {
    /// Model directory.
    pub model: String,
    /// Parameters of the checkpoint.
    pub parameters: usize,
    /// Weight files (1 unless sharded).
    pub files: usize,
    /// Tensors per stored dtype.
    pub stored: std::collections::BTreeMap<String, usize>,
    /// Weight dtype the reference rounds to (as verify at that dtype).
    pub weight_dtype: String,
    /// Seconds to read and widen the weights to f32.
    pub read_s: f64,
    /// Seconds to build the f64 reference from them.
    pub build_s: f64,
    /// Resident memory after reading, MB (10^6 bytes).
    pub rss_after_read_mb: f64,
    /// Peak resident memory of the process (VmHWM), MB.
    pub peak_rss_mb: f64,
    /// Resident memory once the reference is built (what stays during generation), MB.
    pub rss_reference_mb: f64,
    /// Tokens stepped (prompt and generated, one at a time as verify does).
    pub tokens: usize,
    /// Seconds per token: median, min, max over the steps.
    pub s_per_token: Spread,
}

impl ReferenceBench {
    /// The figures in words.
    pub fn text(&self) -> String {
        format!(
            "reference (f64) on {}: {} parameters in {} file(s), stored {:?}, at weight dtype {}\n  read {:.1} s, build {:.1} s; RSS after read {:.0} MB, peak {:.0} MB, while generating {:.0} MB\n  {:.2} s/token (median of {}; min {:.2}, max {:.2})\n",
            self.model,
            self.parameters,
            self.files,
            self.stored,
            self.weight_dtype,
            self.read_s,
            self.build_s,
            self.rss_after_read_mb,
            self.peak_rss_mb,
            self.rss_reference_mb,
            self.s_per_token.median,
            self.tokens,
            self.s_per_token.min,
            self.s_per_token.max
        )
    }
}

/// A line of /proc/self/status in MB (Linux), 0 elsewhere.
fn status_mb(key: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb * 1024.0 / 1e6)
}

/// Measure the reference on `model` as verify_generation builds it: read the weights (single or
/// sharded), build the f64 reference at `weight_dtype` from them (consuming them), step `tokens`
/// tokens.
/// Run it in a process of its own (`metainfer bench-reference`): the peak is the process's.
///
/// # Errors
/// As verify's loading (config, layout, dtype policy), or `tokens` of 0.
pub fn reference(ckb: &crate::ckb::Ckb, model: &Path, weight_dtype: &str, tokens: usize) -> Result<ReferenceBench> {
    if tokens == 0 {
        return Err(Error::usage("--tokens must be positive"));
    }
    let cfg = crate::model::load_config(ckb, model)?;
    let family = ckb.get(&cfg.family)?;
    let layout = crate::model::weight_layout(model)?;
    crate::model::check_dtype_policy(family, &cfg, &crate::model::read_config(model)?, &layout)?;
    let t = Instant::now();
    let tensors = crate::model::weights::read_layout(model, &layout)?;
    let read_s = t.elapsed().as_secs_f64();
    let rss_after_read_mb = status_mb("VmRSS:");
    let parameters = tensors.values().map(|(_, v)| v.len()).sum();
    let t = Instant::now();
    let fam = family.model.as_ref().ok_or_else(|| Error::usage(format!("`{}` is not a model family", family.id)))?;
    let mut r = crate::oracle::llama::Reference::of_family(fam, &cfg, tensors, weight_dtype)?;
    let build_s = t.elapsed().as_secs_f64();
    let rss_reference_mb = status_mb("VmRSS:");
    let mut steps = Vec::new();
    let mut token = 1u32.min(cfg.vocab as u32 - 1);
    for _ in 0..tokens.min(cfg.max_seq) {
        let t = Instant::now();
        let logits = r.step(token)?;
        steps.push(t.elapsed().as_secs_f64());
        token = crate::oracle::argmax(&logits) as u32;
    }
    Ok(ReferenceBench {
        model: model.display().to_string(),
        parameters,
        files: layout.files.len(),
        stored: layout.dtype_counts(),
        weight_dtype: weight_dtype.to_string(),
        read_s,
        build_s,
        rss_after_read_mb,
        peak_rss_mb: status_mb("VmHWM:"),
        rss_reference_mb,
        tokens: steps.len(),
        s_per_token: Spread::of(&steps),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(threads: usize, runner: &str, tok_s: f64, gbs: f64) -> Row {
        let spread = |m: f64| Spread { median: m, min: m, max: m };
        Row {
            model: "stories15M shape".into(),
            threads,
            runner: runner.into(),
            decode_tok_s: spread(tok_s),
            bytes_per_token: 60e6,
            bandwidth_gbs: spread(gbs),
            roofline_tok_s: gbs * 1e9 / 60e6,
        }
    }

    /// A decode-only report (no serving, no agent loop, no candle) of `rows` at `threads`.
    fn report_of(threads: Vec<usize>, rows: Vec<Row>) -> BenchReport {
        BenchReport { machine: "test".into(), threads, rows, agent_loop: None, serving: None, candle: false }
    }

    #[test]
    fn goals_give_the_two_thread_speed_up_beside_the_bandwidth_scaling() {
        // Figures of one run on a 2-core EPYC (2026-12-05): f32 395 -> 445 tok/s while the read
        // bandwidth at 60 MB went 21.1 -> 40.5 GB/s; int8 1402 -> 2579 at 46.3 -> 84.3 GB/s.
        let report = report_of(
            vec![1, 2],
            vec![
                row(1, "engine f32", 395.0, 21.1),
                row(2, "engine f32", 445.0, 40.5),
                row(1, "engine int8", 1402.0, 46.3),
                row(2, "engine int8", 2579.0, 84.3),
            ],
        );
        let text = report.text();
        // 445 / 395 = 1.127; 40.5 / 21.1 = 1.919; 2579 / 1402 = 1.840; 84.3 / 46.3 = 1.821.
        assert!(
            text.contains(
                "  f32 2 threads >= 1.7x 1 thread: 1.13x (NOT met; read bandwidth at its working set scales 1.92x here)"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "  int8 2 threads >= 1.7x 1 thread: 1.84x (met; read bandwidth at its working set scales 1.82x here)"
            ),
            "{text}"
        );
        // No bf16 rows, no bf16 line.
        assert!(!text.contains("bf16 2 threads"), "{text}");
    }

    #[test]
    fn llama_bench_json_gives_the_text_generation_rate_and_goals_compare_with_it() {
        // The shape of `llama-bench -o json` (an array of tests with n_prompt, n_gen, avg_ts), after
        // a line of log text; the prompt-processing test is not the decode rate.
        let out = "load time 12 ms\n[\n  {\"n_prompt\": 512, \"n_gen\": 0, \"n_threads\": 2, \"avg_ts\": 1900.5},\n  {\"n_prompt\": 0, \"n_gen\": 128, \"n_threads\": 2, \"avg_ts\": 438.0, \"stddev_ts\": 3.1}\n]\n";
        assert_eq!(llama_tok_s(out), Some(438.0));
        assert_eq!(llama_tok_s("[{\"n_prompt\": 512, \"n_gen\": 0, \"avg_ts\": 1900.5}]"), None);
        assert_eq!(llama_tok_s("no json here"), None);
        assert_eq!(llama_tok_s("[{\"n_prompt\": 0, \"n_gen\": 128, \"avg_ts\": \"fast\"}]"), None);
        // llama.cpp f32 at 2 threads as measured beside an earlier engine on this shape (438 tok/s)
        // and a Q8_0 figure for the arithmetic: 503 / 438 = 1.148 (not met), 2188 / 1157 = 1.891.
        let report = report_of(
            vec![2],
            vec![
                row(2, "engine f32", 503.0, 30.0),
                row(2, "llama.cpp f32", 438.0, 30.0),
                row(2, "engine int8", 2188.0, 80.0),
                row(2, "llama.cpp q8_0", 1157.0, 80.0),
            ],
        );
        let text = report.text();
        assert!(text.contains("  f32 >= 1.2x llama.cpp f32 (2 thread(s)): 1.15x (NOT met)"), "{text}");
        assert!(text.contains("  int8 >= 1.2x llama.cpp q8_0 (2 thread(s)): 1.89x (met)"), "{text}");
    }
}
