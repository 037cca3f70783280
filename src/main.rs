//! The metainfer CLI: every MCP tool is also a subcommand; `--json` prints exactly the tool's
//! structured output. Exit status: 0 the check passed, 1 it ran and failed, 2 bad usage or input.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use metainfer::ckb::{self, Ckb};
use metainfer::error::{Error, ErrorKind, Result};
use metainfer::harness::{Budget, Workshop};
use metainfer::ops::{self, Ctx, Report};

#[derive(Parser)]
#[command(
    name = "metainfer",
    version,
    about = "Contracts, oracles and gates with which coding agents build custom LLM inference engines"
)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

#[derive(Args)]
struct Global {
    /// Contract knowledge base directory (default: the CKB built into this binary).
    #[arg(long, global = true, value_name = "DIR")]
    ckb: Option<PathBuf>,
    /// Ledger database (default: $METAINFER_LEDGER or the per-user data directory).
    #[arg(long, global = true, value_name = "FILE")]
    ledger: Option<PathBuf>,
    /// Build cache with the shared cargo target directory (default: $METAINFER_CACHE or the per-user cache).
    #[arg(long, global = true, value_name = "DIR")]
    cache: Option<PathBuf>,
    /// Time limit of one compile/test/verify/profile call, in seconds.
    #[arg(long, global = true, default_value_t = 900, value_name = "SECS")]
    time_limit: u64,
    /// Leave invalid contract files out of the knowledge base (each logged with its file and reason, and
    /// listed in every plan), with the files whose contracts reference theirs, instead of refusing to
    /// start. `ckb check` lists every finding either way.
    #[arg(long, global = true)]
    skip_invalid: bool,
    /// Largest text content of one MCP tool result, in characters (longer text is cut and marked).
    #[arg(long, global = true, default_value_t = metainfer::ops::MAX_TEXT, value_name = "CHARS")]
    max_output: usize,
}

#[derive(Subcommand)]
enum Command {
    /// Serve MCP over stdio (stdout carries JSON-RPC only; logs go to stderr).
    Serve {
        /// Confine every path argument to this directory (and the --model-dir directories).
        #[arg(long, value_name = "DIR")]
        workspace: Option<PathBuf>,
        /// A model directory path arguments may also point into.
        #[arg(long = "model-dir", value_name = "DIR")]
        model_dirs: Vec<PathBuf>,
    },
    /// Plan an engine from constraints (tool plan_engine).
    Plan {
        /// Hugging Face model directory (config.json, model.safetensors, tokenizer.json).
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// Target platform (a platform contract's target).
        #[arg(long, default_value = "cpu")]
        target: String,
        /// Weight and activation dtype.
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write a random-weight HF checkpoint of a covered family (config.json, generation_config.json,
    /// weights in one file or shards, tokenizer.json).
    Synth {
        /// Family: llama, mistral, qwen2, qwen3, gemma (llama with --preset), or any other model family
        /// of the CKB, written from its contract (a staged candidate counts).
        #[arg(long)]
        family: Option<String>,
        /// A real model's shape: stories15m, stories42m or stories110m (the llama2.c TinyStories models),
        /// llama3.2-1b or qwen3-0.6b (bf16, byte-level tokenizer); the options below override its values.
        #[arg(long, value_name = "NAME")]
        preset: Option<String>,
        /// Directory to create (must not exist, or be empty).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Seed of the random weights.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// hidden_size.
        #[arg(long)]
        hidden: Option<usize>,
        /// num_hidden_layers.
        #[arg(long)]
        layers: Option<usize>,
        /// num_attention_heads.
        #[arg(long)]
        heads: Option<usize>,
        /// num_key_value_heads.
        #[arg(long = "kv-heads")]
        kv_heads: Option<usize>,
        /// head_dim (default hidden / heads).
        #[arg(long = "head-dim")]
        head_dim: Option<usize>,
        /// vocab_size.
        #[arg(long)]
        vocab: Option<usize>,
        /// intermediate_size.
        #[arg(long)]
        intermediate: Option<usize>,
        /// max_position_embeddings.
        #[arg(long = "max-seq")]
        max_seq: Option<usize>,
        /// sliding_window (mistral).
        #[arg(long = "sliding-window")]
        sliding_window: Option<usize>,
        /// Stored weight dtype: f32, bf16 or f16 (default the preset's, else f32).
        #[arg(long)]
        dtype: Option<String>,
        /// Weight files: N > 1 writes N shards and model.safetensors.index.json.
        #[arg(long)]
        shards: Option<usize>,
        /// Tokenizer: spm (SentencePiece-style) or bytelevel (a trained byte-level BPE with special tokens).
        #[arg(long)]
        tokenizer: Option<String>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show or search contracts (tool lookup_contract).
    Contract {
        #[command(subcommand)]
        action: ContractCmd,
    },
    /// The knowledge base itself.
    Ckb {
        #[command(subcommand)]
        action: CkbCmd,
    },
    /// Write an engine crate for the constraints (tool scaffold_engine).
    Scaffold {
        /// Hugging Face model directory (config.json, model.safetensors, tokenizer.json).
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// Directory to create the engine crate in (empty or new).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Target platform (a platform contract's target).
        #[arg(long, default_value = "cpu")]
        target: String,
        /// Weight and activation dtype.
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// Crate name.
        #[arg(long)]
        name: Option<String>,
        /// Overwrite the scaffold's files in a non-empty directory.
        #[arg(long)]
        force: bool,
        /// Reference level: zero (CKB only), docs, or code.
        #[arg(long, default_value = "zero", value_parser = ["zero", "docs", "code"])]
        reference_level: String,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Build the engine with structured diagnostics (tool compile_engine).
    Compile {
        /// Engine crate directory.
        #[arg(long, value_name = "DIR")]
        engine: PathBuf,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Test kernels against the oracle (tool run_kernel_test).
    TestKernel {
        /// Engine crate directory.
        #[arg(long, value_name = "DIR")]
        engine: PathBuf,
        /// Kernel contract id; repeat for several; none: all.
        #[arg(long = "kernel", value_name = "ID")]
        kernels: Vec<String>,
        /// Replay a run's seed.
        #[arg(long)]
        seed: Option<u64>,
        /// Weight dtype to build the engine for (f32, bf16, f16, int8); default: the engine's own (metainfer.toml).
        #[arg(long)]
        dtype: Option<String>,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Verify generation on a real checkpoint (tool verify_generation).
    Verify {
        /// Engine crate directory.
        #[arg(long, value_name = "DIR")]
        engine: PathBuf,
        /// Hugging Face model directory (config.json, model.safetensors, tokenizer.json).
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// Prompt; repeat for several (two random prompts are always added).
        #[arg(long = "prompt", value_name = "TEXT")]
        prompts: Vec<String>,
        #[arg(long)]
        max_new_tokens: Option<usize>,
        #[arg(long)]
        seed: Option<u64>,
        /// Weight dtype to build the engine for (f32, bf16, f16, int8); default: the engine's own (metainfer.toml).
        #[arg(long)]
        dtype: Option<String>,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Check the zero-reference and anti-fake rules (tool check_rules).
    CheckRules {
        /// Engine crate directory.
        #[arg(long, value_name = "DIR")]
        engine: PathBuf,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Registered reference code (other frameworks): only fingerprints are stored.
    Reference {
        #[command(subcommand)]
        action: ReferenceCmd,
    },
    /// Measure tokens/s (tool profile_engine).
    Profile {
        /// Engine crate directory.
        #[arg(long, value_name = "DIR")]
        engine: PathBuf,
        /// Hugging Face model directory (config.json, model.safetensors, tokenizer.json).
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        #[arg(long)]
        runs: Option<usize>,
        /// Prompt length in tokens for the prefill measurement (default 32).
        #[arg(long)]
        prompt_len: Option<usize>,
        /// Tokens decoded per run (default 64).
        #[arg(long)]
        new_tokens: Option<usize>,
        /// Threads the engine may use (RAYON_NUM_THREADS in the harness; default 1).
        #[arg(long)]
        threads: Option<usize>,
        /// Weight dtype to build the engine for (f32, bf16, f16, int8); default: the engine's own (metainfer.toml).
        #[arg(long)]
        dtype: Option<String>,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// List recorded outcomes, newest first.
    Ledger {
        #[command(subcommand)]
        action: Option<LedgerCmd>,
        /// Outcomes to list.
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// Newer outcomes to skip.
        #[arg(long, default_value_t = 0)]
        offset: usize,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Stage candidate failure modes from recurring unexplained failures (tool evolve_knowledge).
    Evolve {
        /// Fewest failures in a cluster.
        #[arg(long)]
        min_cluster: Option<usize>,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Probe this machine: read bandwidth at L1/L2/L3/DRAM working sets and peak f32 FLOP/s on
    /// 1..N threads (min/median/max); cached in the ledger per CPU model and core count.
    Machine {
        /// Measure again even when a cached probe exists.
        #[arg(long)]
        refresh: bool,
        /// Runs per figure.
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// Print the probe as JSON.
        #[arg(long)]
        json: bool,
    },
    /// What the ledger says about the knowledge base (tool ckb_report).
    Report {
        /// Only contracts whose id starts with this, e.g. `kernel.`.
        #[arg(long)]
        prefix: Option<String>,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write the skills as <DIR>/<name>/SKILL.md (Claude Code's layout).
    InstallSkills {
        /// Target directory.
        #[arg(long, default_value = ".claude/skills", value_name = "DIR")]
        dir: PathBuf,
    },
    /// Register the server in an agent client's config (merged; other servers are kept).
    Register {
        #[arg(long, value_enum)]
        client: metainfer::clients::Client,
        /// Print the merged config instead of writing it.
        #[arg(long)]
        print: bool,
        /// Project directory (the workspace the server is confined to).
        #[arg(long, default_value = ".", value_name = "DIR")]
        dir: PathBuf,
    },
    /// Run the whole loop over MCP on a real model and print the steps and the generated text.
    Demo {
        /// Model directory (default ../shared/models/babyllama-105).
        #[arg(long, value_name = "DIR")]
        model: Option<PathBuf>,
        /// Keep the workspace (scaffolded engine) in this directory.
        #[arg(long, value_name = "DIR")]
        keep: Option<PathBuf>,
        /// Tokens to generate (103 reproduces the golden continuation of "Once upon a time").
        #[arg(long, default_value_t = 103)]
        max_new_tokens: usize,
    },
    /// Benchmark: the example engine (each weight dtype) against candle (feature candle-oracle) on
    /// BabyLlama and the stories15M shape at 1 and 2 threads, alternating; roofline fractions; the
    /// agent loop's speed and the server's overhead over raw cargo.
    Bench {
        /// Alternating repetitions per configuration (medians are over these).
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// Thread counts; repeat for several.
        #[arg(long = "threads", default_values_t = vec![1usize, 2])]
        threads: Vec<usize>,
        /// Prompt tokens before the timed decode.
        #[arg(long, default_value_t = 32)]
        prompt_len: usize,
        /// Decoded tokens per run.
        #[arg(long, default_value_t = 128)]
        new_tokens: usize,
        /// Skip the agent-loop timings.
        #[arg(long)]
        no_agent_loop: bool,
        /// Print the measurements as JSON.
        #[arg(long)]
        json: bool,
    },
    /// One candle decode run for `bench` (prints seconds per token); needs feature candle-oracle.
    #[command(hide = true)]
    BenchPeer { model: PathBuf, prompt_len: usize, new_tokens: usize },
    /// Benchmark the f64 reference forward pass that verify_generation runs: peak memory and seconds
    /// per token on a checkpoint (e.g. `synth --preset llama3.2-1b`), in this process alone.
    BenchReference {
        /// Hugging Face model directory (single or sharded weights).
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// Weight dtype the reference rounds to, as verify at that dtype.
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// Tokens to step.
        #[arg(long, default_value_t = 4)]
        tokens: usize,
        /// Print the measurements as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum ContractCmd {
    /// Show one contract.
    Show {
        id: String,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Search contracts by words.
    Search {
        text: String,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum LedgerCmd {
    /// Write every outcome, oldest first, as JSONL (to stdout, or --out FILE).
    Export {
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// Merge outcomes from a JSONL export; outcomes already present (same id) are skipped.
    Import {
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
}

#[derive(Subcommand)]
enum ReferenceCmd {
    /// Fingerprint a source tree (Rust, C/C++, CUDA, Python, Go) and register it under a name.
    Add {
        #[arg(value_name = "DIR")]
        dir: PathBuf,
        /// Name to register it under (default: the directory name).
        #[arg(long)]
        name: Option<String>,
    },
    /// List registered references.
    List,
}

#[derive(Subcommand)]
enum CkbCmd {
    /// Validate every contract file against the schema and the lint; list findings.
    Check {
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print the JSON Schema of a contract file.
    Schema,
    /// Validate a new or amended contract file and stage it as a candidate (tool propose_contract).
    Propose {
        #[arg(value_name = "FILE")]
        file: PathBuf,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Move a staged candidate into the CKB working copy (--ckb DIR): needs evidence in the ledger, or --force.
    Promote {
        id: String,
        /// Promote without evidence (a person's decision).
        #[arg(long)]
        force: bool,
    },
}

fn emit<R: Report>(r: &R, json: bool) -> ExitCode {
    if json {
        println!("{}", serde_json::to_string_pretty(r).expect("reports serialise"));
    } else {
        print!("{}", r.text());
        if !r.text().ends_with('\n') {
            println!();
        }
    }
    if r.passed() { ExitCode::SUCCESS } else { ExitCode::from(1) }
}

fn load_ckb(dir: Option<&PathBuf>, skip_invalid: bool) -> Result<Ckb> {
    if !skip_invalid {
        return match dir {
            Some(d) => Ckb::from_dir(d),
            None => Ckb::embedded(),
        };
    }
    let ckb = match dir {
        Some(d) => Ckb::from_sources_skip_invalid(ckb::read_dir_files(d)?, s(d))?,
        None => Ckb::from_sources_skip_invalid(ckb::embedded_files(), "embedded".into())?,
    };
    for f in ckb.skipped() {
        tracing::warn!("--skip-invalid: left out contract file {}: {}", f.file, f.reason);
    }
    if !ckb.skipped().is_empty() {
        tracing::warn!(
            "--skip-invalid: {} contract file(s) of {} left out; {} contracts loaded",
            ckb.skipped().len(),
            ckb.origin,
            ckb.all().count()
        );
    }
    Ok(ckb)
}

fn ctx(g: &Global, workspace: Option<PathBuf>, models: Vec<PathBuf>) -> Result<Ctx> {
    Ok(Ctx {
        ckb: load_ckb(g.ckb.as_ref(), g.skip_invalid)?,
        // Absolute: the harness manifest refers to the engine snapshot inside the cache by path.
        workshop: g
            .cache
            .clone()
            .map(|root| Workshop { root: std::path::absolute(&root).unwrap_or(root) })
            .unwrap_or_else(Workshop::default_location),
        ledger: g.ledger.clone().unwrap_or_else(metainfer::ledger::default_path),
        workspace,
        models,
        time_limit_s: g.time_limit,
        max_output: g.max_output,
        client: std::sync::Arc::new(std::sync::RwLock::new("cli".into())),
        ckb_dir: g.ckb.clone(),
    })
}

fn s(p: &std::path::Path) -> String {
    p.display().to_string()
}

fn ckb_check(g: &Global, json: bool) -> Result<ExitCode> {
    let (files, origin) = match &g.ckb {
        Some(dir) => (ckb::read_dir_files(dir)?, s(dir)),
        None => (ckb::embedded_files(), "embedded".to_string()),
    };
    let (loaded, mut findings) = Ckb::check_sources(files, origin.clone());
    if let Some(ckb) = &loaded {
        for c in ckb.of_kind(ckb::Kind::Kernel) {
            if !metainfer::oracle::kernel_oracle_exists(&c.id) {
                findings.push(ckb::Finding {
                    file: ckb.file_of(&c.id).unwrap_or_default().into(),
                    field: "/id".into(),
                    message: format!("no oracle implements `{}`; a kernel contract needs one in src/oracle", c.id),
                });
            }
        }
    }
    if let Some(ckb) = &loaded {
        for c in ckb.of_kind(ckb::Kind::Failure) {
            if let Some(m) = c.failure.as_ref().and_then(|f| f.mutant.as_deref())
                && !metainfer::oracle::mutants::mutant_exists(m)
            {
                findings.push(ckb::Finding {
                    file: ckb.file_of(&c.id).unwrap_or_default().into(),
                    field: "/failure/mutant".into(),
                    message: format!(
                        "no oracle mutant named `{m}`; add it in src/oracle/mutants.rs or remove the field"
                    ),
                });
            }
        }
    }
    let n = loaded.as_ref().map(|c| c.all().count()).unwrap_or(0);
    if json {
        println!(
            "{}",
            serde_json::json!({"origin": origin, "contracts": n, "passed": findings.is_empty(), "findings": findings})
        );
    } else if findings.is_empty() {
        println!("ckb check passed: {n} contracts in {origin}, schema-valid and lint-clean");
    } else {
        println!("ckb check FAILED: {} finding(s) in {origin}", findings.len());
        for f in &findings {
            println!("  {f}");
        }
    }
    Ok(if findings.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

fn run(cli: Cli) -> Result<ExitCode> {
    let g = &cli.global;
    let budget = || Budget::secs(g.time_limit);
    match cli.command {
        Command::Serve { workspace, model_dirs } => {
            let workspace = workspace
                .map(|w| w.canonicalize().map_err(|e| Error::usage(format!("--workspace {}: {e}", w.display()))))
                .transpose()?;
            let ctx = ctx(g, workspace, model_dirs)?;
            let rt = tokio::runtime::Runtime::new().map_err(|e| Error::internal(format!("tokio runtime: {e}")))?;
            let served = rt.block_on(metainfer::mcp::serve_stdio(ctx));
            // Calls in flight were cancelled; give their blocking threads a moment to reap children.
            rt.shutdown_timeout(std::time::Duration::from_secs(2));
            served.map_err(|e| Error::internal(format!("MCP server: {e}")))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Plan { model, target, dtype, json } => {
            let r =
                ops::plan::plan(&ctx(g, None, vec![])?, &ops::plan::PlanRequest { model: s(&model), target, dtype })?;
            Ok(emit(&r, json))
        }
        Command::Synth {
            family,
            preset,
            out,
            seed,
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim,
            vocab,
            intermediate,
            max_seq,
            sliding_window,
            dtype,
            shards,
            tokenizer,
            json,
        } => {
            let req = ops::synth::SynthRequest {
                family: family.unwrap_or_default(),
                preset,
                out,
                seed,
                hidden,
                layers,
                heads,
                kv_heads,
                head_dim,
                vocab,
                intermediate,
                max_seq,
                sliding_window,
                dtype,
                shards,
                tokenizer,
            };
            let c = ctx(g, None, vec![])?;
            Ok(emit(&ops::synth::synth_in(&c.live().ckb, &req)?, json))
        }
        Command::Contract { action } => {
            let c = ctx(g, None, vec![])?;
            let (req, json) = match action {
                ContractCmd::Show { id, json } => {
                    (ops::lookup::LookupRequest { id: Some(id), query: None, cursor: None }, json)
                }
                ContractCmd::Search { text, json } => {
                    (ops::lookup::LookupRequest { id: None, query: Some(text), cursor: None }, json)
                }
            };
            Ok(emit(&ops::lookup::lookup(&c, &req)?, json))
        }
        Command::Ckb { action: CkbCmd::Check { json } } => ckb_check(g, json),
        Command::Ckb { action: CkbCmd::Schema } => {
            println!("{}", serde_json::to_string_pretty(&ckb::contract_schema()).expect("schema serialises"));
            Ok(ExitCode::SUCCESS)
        }
        Command::Scaffold { model, out, target, dtype, name, force, reference_level, json } => {
            let req = ops::scaffold::ScaffoldRequest {
                model: s(&model),
                out: s(&out),
                target,
                dtype,
                name,
                force,
                reference_level: serde_json::from_value(serde_json::Value::String(reference_level))
                    .expect("clap checked the value"),
            };
            Ok(emit(&ops::scaffold::scaffold(&ctx(g, None, vec![])?, &req)?, json))
        }
        Command::Compile { engine, json } => {
            let r = ops::compile::compile(
                &ctx(g, None, vec![])?,
                &ops::compile::CompileRequest { engine: s(&engine), cursor: None },
                &budget(),
            )?;
            Ok(emit(&r, json))
        }
        Command::TestKernel { engine, kernels, seed, dtype, json } => {
            let req = ops::kernel_test::KernelTestRequest { engine: s(&engine), kernels, seed, dtype };
            Ok(emit(&ops::kernel_test::kernel_test(&ctx(g, None, vec![])?, &req, &budget())?, json))
        }
        Command::Verify { engine, model, prompts, max_new_tokens, seed, dtype, json } => {
            let req = ops::verify::VerifyRequest {
                engine: s(&engine),
                model: s(&model),
                prompts,
                max_new_tokens,
                seed,
                dtype,
            };
            Ok(emit(&ops::verify::verify(&ctx(g, None, vec![])?, &req, &budget())?, json))
        }
        Command::Profile { engine, model, runs, prompt_len, new_tokens, dtype, threads, json } => {
            let req = ops::profile::ProfileRequest {
                engine: s(&engine),
                model: s(&model),
                prompt_len,
                new_tokens,
                runs,
                dtype,
                threads,
            };
            Ok(emit(&ops::profile::profile(&ctx(g, None, vec![])?, &req, &budget())?, json))
        }
        Command::Ledger { action: Some(action), .. } => {
            let c = ctx(g, None, vec![])?;
            let mut l = metainfer::ledger::Ledger::open(&c.ledger)?;
            match action {
                LedgerCmd::Export { out: None } => print!("{}", l.export_jsonl()?),
                LedgerCmd::Export { out: Some(path) } => {
                    let text = l.export_jsonl()?;
                    metainfer::util::write_atomic(&path, text.as_bytes())?;
                    eprintln!("exported {} outcomes to {}", text.lines().count(), path.display());
                }
                LedgerCmd::Import { file } => {
                    let text =
                        std::fs::read_to_string(&file).map_err(|e| Error::usage(format!("{}: {e}", file.display())))?;
                    let (new, known) = l
                        .import_jsonl(&text)
                        .map_err(|e| Error::input(format!("{}: {}", file.display(), e.message)))?;
                    println!("imported {new} new outcomes; {known} were already present");
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Ledger { action: None, limit, offset, json } => {
            let c = ctx(g, None, vec![])?;
            let l = metainfer::ledger::Ledger::open(&c.ledger)?;
            let rows = l.list(offset, limit)?;
            if json {
                println!("{}", serde_json::json!({"ledger": s(&l.path), "total": l.count()?, "outcomes": rows}));
            } else {
                println!("ledger {}: {} outcomes", l.path.display(), l.count()?);
                for o in rows {
                    println!(
                        "{} {:<18} {:<4} {:>7} ms  {}  {}",
                        o.time,
                        o.tool,
                        if o.passed { "pass" } else { "FAIL" },
                        o.duration_ms,
                        &o.engine_hash.get(..12).unwrap_or("-"),
                        o.summary
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::CheckRules { engine, json } => {
            let req = ops::rules::RulesRequest { engine: s(&engine) };
            Ok(emit(&ops::rules::check_rules(&ctx(g, None, vec![])?, &req, &budget())?, json))
        }
        Command::Reference { action } => {
            let c = ctx(g, None, vec![])?;
            let mut l = metainfer::ledger::Ledger::open(&c.ledger)?;
            match action {
                ReferenceCmd::Add { dir, name } => {
                    let dir = dir.canonicalize().map_err(|e| Error::usage(format!("{}: {e}", dir.display())))?;
                    let name = name.unwrap_or_else(|| {
                        dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
                    });
                    let refs = metainfer::guard::provenance::fingerprint_tree(&name, &dir);
                    if refs.is_empty() {
                        return Err(Error::usage(format!("{} holds no source files to fingerprint", dir.display())));
                    }
                    let files: Vec<(String, Vec<(u64, u32)>)> = refs
                        .iter()
                        .map(|r| (r.file.clone(), r.prints.iter().map(|p| (p.hash, p.line)).collect()))
                        .collect();
                    let prints: usize = files.iter().map(|f| f.1.len()).sum();
                    l.add_reference(&name, &files)?;
                    println!(
                        "registered reference `{name}`: {} files, {prints} fingerprints (no code stored)",
                        files.len()
                    );
                }
                ReferenceCmd::List => {
                    let mut by_name: std::collections::BTreeMap<String, (usize, usize)> = Default::default();
                    for (n, _, p) in l.references()? {
                        let e = by_name.entry(n).or_default();
                        e.0 += 1;
                        e.1 += p.len();
                    }
                    for (n, (files, prints)) in by_name {
                        println!("{n}: {files} files, {prints} fingerprints");
                    }
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Ckb { action: CkbCmd::Propose { file, json } } => {
            let toml = std::fs::read_to_string(&file).map_err(|e| Error::usage(format!("{}: {e}", file.display())))?;
            Ok(emit(&ops::evolve::propose(&ctx(g, None, vec![])?, &ops::evolve::ProposeRequest { toml })?, json))
        }
        Command::Ckb { action: CkbCmd::Promote { id, force } } => {
            println!("{}", ops::evolve::promote(&ctx(g, None, vec![])?, &id, force)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Evolve { min_cluster, json } => {
            let r = ops::evolve::evolve(&ctx(g, None, vec![])?, &ops::evolve::EvolveRequest { min_cluster })?;
            Ok(emit(&r, json))
        }
        Command::Machine { refresh, runs, json } => {
            let c = ctx(g, None, vec![])?;
            let l = metainfer::ledger::Ledger::open(&c.ledger)?;
            let fp = metainfer::probe::fingerprint();
            let cached = if refresh { None } else { l.probe(&fp)?.and_then(|v| serde_json::from_value(v).ok()) };
            let probe = match cached {
                Some(p) => p,
                None => {
                    eprintln!("probing {fp} ({runs} runs per figure) ...");
                    let p = metainfer::probe::run(runs, 0.05);
                    l.put_probe(&fp, &serde_json::to_value(&p).expect("probes serialise"))?;
                    p
                }
            };
            Ok(emit(&probe, json))
        }
        Command::Report { prefix, json } => {
            let r = ops::report::report(&ctx(g, None, vec![])?, &ops::report::ReportRequest { prefix })?;
            Ok(emit(&r, json))
        }
        Command::InstallSkills { dir } => {
            for p in metainfer::guide::install_skills(&dir)? {
                println!("wrote {}", p.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Register { client, print, dir } => {
            let project = dir.canonicalize().map_err(|e| Error::usage(format!("--dir {}: {e}", dir.display())))?;
            let exe = std::env::current_exe().map_err(|e| Error::internal(format!("own executable: {e}")))?;
            let entry = metainfer::clients::Entry {
                command: exe.display().to_string(),
                args: vec!["serve".into(), "--workspace".into(), project.display().to_string()],
            };
            if print {
                let path = client.config_path(&project);
                let existing = std::fs::read_to_string(&path).unwrap_or_default();
                println!("# {}", path.display());
                print!("{}", client.merge(&existing, "metainfer", &entry)?);
            } else {
                let path = metainfer::clients::register(client, &project, "metainfer", &entry)?;
                println!("registered metainfer in {}", path.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench { reps, threads, prompt_len, new_tokens, no_agent_loop, json } => {
            if reps == 0 || threads.contains(&0) || new_tokens == 0 {
                return Err(Error::usage("--reps, --threads and --new-tokens must be positive"));
            }
            let c = ctx(g, None, vec![])?;
            let work = c.workshop.scratch()?;
            let o =
                metainfer::bench::BenchOptions { reps, threads, prompt_len, new_tokens, agent_loop: !no_agent_loop };
            let r = metainfer::bench::run(&c, &o, work.path())?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r).expect("report serialises"));
            } else {
                print!("{}", r.text());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::BenchReference { model, dtype, tokens, json } => {
            let c = ctx(g, None, vec![])?;
            let r = metainfer::bench::reference(&c.ckb, &model, &dtype, tokens)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r).expect("report serialises"));
            } else {
                print!("{}", r.text());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::BenchPeer { model, prompt_len, new_tokens } => {
            #[cfg(feature = "candle-oracle")]
            {
                let s = metainfer::bench::candle_decode(&model, prompt_len, new_tokens)?;
                println!("{s}");
                Ok(ExitCode::SUCCESS)
            }
            #[cfg(not(feature = "candle-oracle"))]
            {
                let _ = (model, prompt_len, new_tokens);
                Err(Error::usage("this binary was built without the candle-oracle feature"))
            }
        }
        Command::Demo { model, keep, max_new_tokens } => {
            let model = model.unwrap_or_else(metainfer::model::default_model_dir);
            let rt = tokio::runtime::Runtime::new().map_err(|e| Error::internal(format!("tokio runtime: {e}")))?;
            let ok = rt.block_on(metainfer::demo::run(metainfer::demo::DemoOptions { model, keep, max_new_tokens }))?;
            Ok(if ok { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("METAINFER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            match e.kind {
                ErrorKind::Usage | ErrorKind::Input | ErrorKind::Internal => ExitCode::from(2),
            }
        }
    }
}
