//! `metainfer demo`: start `metainfer serve` as a child process and drive it through a real MCP client
//! (rmcp over stdio), playing the agent: plan, lookup, scaffold, write the code (the example engine),
//! compile, kernel tests, verify, profile, then read the ledger.
//!
//! The server is started as `harness::server_command` starts it (no `METAINFER_*` variable reaches
//! it) with every global option, the build cache also taken from `$METAINFER_CACHE` ([`cache_of`]);
//! its ledger is the demo's own, in the demo's workspace, unless `--ledger` or `$METAINFER_LEDGER`
//! names one. The model is `--model`, `$METAINFER_MODEL` or the embedded BabyLlama-105 written into
//! the workspace ([`choose_model`], `model::embedded`), never a path found relative to the current
//! directory.

use std::path::{Path, PathBuf};
use std::time::Instant;

use rmcp::ServiceExt;
use rmcp::model::CallToolRequestParams;
use rmcp::transport::{ConfigureCommandExt, TokioChildProcess};
use serde_json::{Value, json};

use crate::ckb::embedded;
use crate::error::{Context, Error, Result};

/// Options of the demo.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Model directory; None: `$METAINFER_MODEL`, else the embedded BabyLlama-105 ([`choose_model`]).
    pub model: Option<PathBuf>,
    /// Keep the workspace here instead of a temporary directory.
    pub keep: Option<PathBuf>,
    /// Tokens to generate in verification.
    pub max_new_tokens: usize,
    /// Options of the server the demo starts (every global option of the CLI). Its ledger, when
    /// None and `$METAINFER_LEDGER` is unset, is the demo's own, in the workspace.
    pub server: crate::options::ServerOptions,
    /// Show the elapsed time of each step on stderr while it runs (a terminal).
    pub progress: bool,
}

/// The model the demo runs on: `--model DIR`, else `$METAINFER_MODEL`, else the BabyLlama-105
/// checkpoint built into the binary (see [`crate::model::embedded`]), which the demo writes into its
/// workspace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DemoModel {
    /// A directory given by `--model` or `$METAINFER_MODEL`.
    Given(PathBuf),
    /// The embedded BabyLlama-105.
    Embedded,
}

/// Which model the demo runs on when `--model` is `given` (see [`DemoModel`]).
pub fn choose_model(given: Option<&Path>) -> DemoModel {
    match given.map(Path::to_path_buf).or_else(|| std::env::var_os("METAINFER_MODEL").map(PathBuf::from)) {
        Some(m) => DemoModel::Given(m),
        None => DemoModel::Embedded,
    }
}

/// The build cache the demo's server uses: `--cache`, else `$METAINFER_CACHE`, else None (the
/// server's per-user default). Passed to the server as `--cache`, since the server's environment
/// carries no `METAINFER_*` settings.
pub fn cache_of(opts: &crate::options::ServerOptions) -> Option<PathBuf> {
    opts.cache.clone().or_else(|| std::env::var_os("METAINFER_CACHE").filter(|c| !c.is_empty()).map(PathBuf::from))
}

/// One row of the demo's table.
#[derive(Debug, Clone)]
pub struct Step {
    /// Tool called.
    pub tool: String,
    /// Passed or not.
    pub passed: bool,
    /// Seconds.
    pub seconds: f64,
    /// Short detail.
    pub detail: String,
}

/// Write the example engine (embedded in the binary) over a scaffolded crate, as an agent writes its code.
///
/// # Errors
/// When a file cannot be written.
pub fn write_example_engine(dir: &Path) -> Result<()> {
    for (rel, text) in embedded::EXAMPLE_ENGINE {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().expect("relative file has a parent"))
            .internal_ctx(|| p.display().to_string())?;
        std::fs::write(&p, text).internal_ctx(|| p.display().to_string())?;
    }
    Ok(())
}

fn summary_line(tool: &str, v: &Value) -> String {
    match tool {
        "plan_engine" => format!(
            "{} on {}, {} phases",
            v["family"].as_str().unwrap_or("?"),
            v["platform"].as_str().unwrap_or("?"),
            v["phases"].as_array().map_or(0, Vec::len)
        ),
        "lookup_contract" => {
            format!("{} v{}", v["contracts"][0]["id"].as_str().unwrap_or("?"), v["contracts"][0]["version"])
        }
        "scaffold_engine" => format!("{} files", v["files"].as_array().map_or(0, Vec::len)),
        "compile_engine" => format!("{} errors, {} warnings", v["errors"], v["warnings"]),
        "run_kernel_test" => {
            let ks = v["kernels"].as_array().cloned().unwrap_or_default();
            let ok = ks.iter().filter(|k| k["passed"] == true).count();
            let worst = ks.iter().filter_map(|k| k["max_abs_err"].as_f64()).fold(0.0, f64::max);
            format!("{ok}/{} kernels, max abs err {worst:.1e}, seed {}", ks.len(), v["seed"])
        }
        "verify_generation" => {
            let ps = v["prompts"].as_array().cloned().unwrap_or_default();
            let ok = ps.iter().filter(|p| p["error"] == "").count();
            let worst = ps.iter().filter_map(|p| p["max_abs_err"].as_f64()).fold(0.0, f64::max);
            let vocabularies: Vec<&str> = v["tokenizer_vectors"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|x| x["vocabulary"].as_str())
                .collect();
            let skipped = v["skipped"].as_array().map_or(0, Vec::len);
            format!(
                "{ok}/{} prompts exact, max logit err {worst:.1e}, tokenizer vectors {}{}",
                ps.len(),
                if vocabularies.is_empty() { "none".to_string() } else { vocabularies.join(", ") },
                if skipped > 0 { format!(" ({skipped} skipped)") } else { String::new() }
            )
        }
        "profile_engine" => format!(
            "decode {:.0} tok/s, prefill {:.0} tok/s (median of {})",
            v["decode_tok_s"]["median"].as_f64().unwrap_or(0.0),
            v["prefill_tok_s"]["median"].as_f64().unwrap_or(0.0),
            v["runs"]
        ),
        _ => String::new(),
    }
}

/// Run the demo; prints the steps table and the generated text to stdout. Returns whether every
/// gate passed.
///
/// # Errors
/// Missing model directory, or the server cannot be started.
pub async fn run(opts: DemoOptions) -> Result<bool> {
    let chosen = choose_model(opts.model.as_deref());
    if let DemoModel::Given(model) = &chosen
        && !model.join("config.json").is_file()
    {
        return Err(Error::usage(format!(
            "model directory {} has no config.json. Pass --model DIR with a Hugging Face Llama-family directory \
             (config.json, model.safetensors, tokenizer.json), or leave --model and $METAINFER_MODEL unset to \
             run on the BabyLlama-105 checkpoint built into this binary",
            model.display()
        )));
    }
    let temp;
    let workspace = match &opts.keep {
        Some(k) => {
            std::fs::create_dir_all(k).usage_ctx(|| k.display().to_string())?;
            k.canonicalize().usage_ctx(|| k.display().to_string())?
        }
        None => {
            temp = tempfile::tempdir().internal_ctx(|| "temporary workspace".to_owned())?;
            temp.path().to_path_buf()
        }
    };
    let engine = workspace.join("engine");
    // What the demo writes into its workspace must not be there yet, in any form: a symlink left
    // in a --keep directory would redirect the writes to wherever it points.
    let own = ["engine", crate::model::embedded::BABYLLAMA_NAME, "ledger.sqlite"];
    if let Some(there) = own.iter().map(|n| workspace.join(n)).find(|p| std::fs::symlink_metadata(p).is_ok()) {
        return Err(Error::usage(format!(
            "{} already exists; pass an empty --keep directory (the demo writes engine/, {}/ and ledger.sqlite there)",
            there.display(),
            crate::model::embedded::BABYLLAMA_NAME
        )));
    }
    let (model, origin) = match chosen {
        DemoModel::Given(m) => {
            let m = m.canonicalize().usage_ctx(|| m.display().to_string())?;
            let origin = format!("model {}", m.display());
            (m, origin)
        }
        DemoModel::Embedded => {
            // Private to this run: inside the workspace (a fresh temporary directory unless --keep).
            let m = crate::model::embedded::write_babyllama(&workspace)?;
            let sha = crate::model::embedded::babyllama_files()
                .iter()
                .find(|(n, _)| *n == "model.safetensors")
                .map(|(_, b)| crate::model::embedded::sha256_hex(b))
                .unwrap_or_default();
            let origin = format!(
                "model BabyLlama-105 built into this binary (MIT; model.safetensors sha256 {sha}), written to {}",
                m.display()
            );
            (m, origin)
        }
    };
    let exe = std::env::current_exe().internal_ctx(|| "cannot find own executable".to_owned())?;
    // The demo's own ledger unless one was named, so its engines never enter the user's record.
    let ledger = opts
        .server
        .ledger
        .clone()
        .or_else(|| std::env::var_os("METAINFER_LEDGER").map(PathBuf::from))
        .unwrap_or_else(|| workspace.join("ledger.sqlite"));
    let ledger = std::path::absolute(&ledger).unwrap_or(ledger);
    let server = crate::options::ServerOptions {
        workspace: Some(workspace.clone()),
        model_dirs: vec![model.clone()],
        ledger: Some(ledger.clone()),
        cache: cache_of(&opts.server).map(|c| std::path::absolute(&c).unwrap_or(c)),
        ckb: opts.server.ckb.as_ref().map(|c| std::path::absolute(c).unwrap_or(c.clone())),
        ..opts.server.clone()
    };
    let args = server.serve_args();
    println!("metainfer demo: serving {} over MCP stdio, workspace {}", exe.display(), workspace.display());
    println!("  {origin}");
    println!("  server: metainfer {}", args.join(" "));
    let transport = TokioChildProcess::new(crate::harness::server_command(&exe).configure(|cmd| {
        cmd.args(&args);
    }))
    .internal_ctx(|| "cannot start `metainfer serve`".to_owned())?;
    let client = ().serve(transport).await.internal_ctx(|| "MCP initialisation failed".to_owned())?;
    let info = client
        .peer_info()
        .and_then(|i| i.server_info.clone())
        .map(|s| format!("{} {}", s.name, s.version))
        .unwrap_or_default();
    let tools = client.list_all_tools().await.internal_ctx(|| "tools/list failed".to_owned())?;
    println!(
        "connected to {info}; {} tools: {}",
        tools.len(),
        tools.iter().map(|t| t.name.to_string()).collect::<Vec<_>>().join(", ")
    );

    let m = model.display().to_string();
    let e = engine.display().to_string();
    let mut steps: Vec<Step> = Vec::new();
    let mut text = String::new();
    let mut skipped: Vec<String> = Vec::new();
    let calls: Vec<(&str, Value)> = vec![
        ("plan_engine", json!({"model": m, "target": "cpu", "dtype": "f32"})),
        ("lookup_contract", json!({"id": "kernel.rope"})),
        ("scaffold_engine", json!({"model": m, "out": e})),
        ("compile_engine", json!({"engine": e})),
        ("run_kernel_test", json!({"engine": e})),
        (
            "verify_generation",
            json!({"engine": e, "model": m, "prompts": ["Once upon a time"], "max_new_tokens": opts.max_new_tokens}),
        ),
        ("profile_engine", json!({"engine": e, "model": m})),
    ];
    for (tool, args) in calls {
        if tool == "compile_engine" {
            write_example_engine(&engine)?;
            println!("  (agent) wrote the engine code: examples/engines/llama-cpu-simd over the scaffold");
        }
        let t = Instant::now();
        let params = CallToolRequestParams::new(tool).with_arguments(args.as_object().cloned().unwrap_or_default());
        let call = client.call_tool(params);
        tokio::pin!(call);
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        let mut shown = false;
        let r = loop {
            tokio::select! {
                r = &mut call => break r,
                _ = tick.tick() => {
                    let s = t.elapsed().as_secs();
                    if opts.progress && s >= 2 {
                        let note = if tool == "compile_engine" { " (a first build also compiles the engine's dependencies)" } else { "" };
                        eprint!("\r\x1b[2K  {tool}: {s} s{note}");
                        shown = true;
                    }
                }
            }
        };
        if shown {
            eprint!("\r\x1b[2K");
        }
        let r = r.internal_ctx(|| format!("{tool} call failed"))?;
        let seconds = t.elapsed().as_secs_f64();
        let v = r.structured_content.clone().unwrap_or(Value::Null);
        let is_error = r.is_error == Some(true);
        let passed = !is_error
            && v.get("passed")
                .and_then(Value::as_bool)
                .unwrap_or(v.get("covered").and_then(Value::as_bool).unwrap_or(true));
        let detail = if is_error {
            r.content
                .first()
                .and_then(|c| c.as_text())
                .map(|t| t.text.lines().next().unwrap_or("").to_string())
                .unwrap_or_default()
        } else {
            summary_line(tool, &v)
        };
        if tool == "verify_generation" {
            text = v["prompts"][0]["text"].as_str().unwrap_or_default().to_string();
            skipped =
                v["skipped"].as_array().into_iter().flatten().filter_map(Value::as_str).map(str::to_string).collect();
        }
        println!("  {tool:<18} {}  {seconds:>6.1} s  {detail}", if passed { "PASS" } else { "FAIL" });
        steps.push(Step { tool: tool.into(), passed, seconds, detail });
        if !passed && tool != "profile_engine" {
            if let Some(t) = r.content.first().and_then(|c| c.as_text()) {
                println!("{}", crate::harness::tail(&t.text, 3000));
            }
            break;
        }
    }
    client.cancel().await.internal_ctx(|| "closing the MCP session".to_owned())?;

    println!("\n| step | tool | result | seconds | detail |\n|---|---|---|---|---|");
    for (i, s) in steps.iter().enumerate() {
        println!(
            "| {} | {} | {} | {:.1} | {} |",
            i + 1,
            s.tool,
            if s.passed { "pass" } else { "FAIL" },
            s.seconds,
            s.detail
        );
    }
    for k in &skipped {
        println!("verify_generation skipped: {k}");
    }
    if !text.is_empty() {
        println!("\nGenerated (greedy, verified token by token against the reference):\n{text}\n");
    }
    let ledger = crate::ledger::Ledger::open(&ledger)?;
    println!("ledger {}: {} outcomes recorded; newest:", ledger.path.display(), ledger.count()?);
    for o in ledger.list(0, steps.len())? {
        println!("  {} {:<18} {} {}", o.time, o.tool, if o.passed { "pass" } else { "FAIL" }, o.summary);
    }
    Ok(steps.len() == 7 && steps.iter().all(|s| s.passed))
}
