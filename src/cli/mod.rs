//! The CLI layer: maps parsed arguments to library calls and prints their reports (text, or the
//! tool's structured output with `--json`), with progress on a terminal for long steps. No logic of
//! its own beyond that mapping.

pub mod args;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use metainfer::clients::{Client, Merged};
use metainfer::error::{Context, Error, Result};
use metainfer::harness::Budget;
use metainfer::ops::{self, Ctx, Report};
use metainfer::options::{ServerOptions, Toolset};

use args::{
    BundleCmd, CkbCmd, ClientArg, Command, ContractCmd, Global, LedgerCmd, LevelArg, ReferenceCmd, ServeArgs,
    ToolsetArg,
};

fn client(c: ClientArg) -> Client {
    match c {
        ClientArg::Claude => Client::Claude,
        ClientArg::Codex => Client::Codex,
        ClientArg::Gemini => Client::Gemini,
        ClientArg::Cursor => Client::Cursor,
        ClientArg::Vscode => Client::Vscode,
    }
}

fn level(l: LevelArg) -> ops::ReferenceLevel {
    match l {
        LevelArg::Zero => ops::ReferenceLevel::Zero,
        LevelArg::Docs => ops::ReferenceLevel::Docs,
        LevelArg::Code => ops::ReferenceLevel::Code,
    }
}

fn toolset(t: ToolsetArg) -> Toolset {
    match t {
        ToolsetArg::Knowledge => Toolset::Knowledge,
        ToolsetArg::Build => Toolset::Build,
        ToolsetArg::Gates => Toolset::Gates,
    }
}

/// The server options of the global flags (plus a subcommand's serve options).
fn options(g: &Global, workspace: Option<PathBuf>, serve: Option<&ServeArgs>) -> ServerOptions {
    ServerOptions {
        ckb: g.ckb.clone(),
        ledger: g.ledger.clone(),
        cache: g.cache.clone(),
        time_limit_s: g.time_limit,
        skip_invalid: g.skip_invalid,
        max_output: g.max_output,
        require_sandbox: g.require_sandbox,
        workspace,
        model_dirs: serve.map(|s| s.model_dirs.clone()).unwrap_or_default(),
        read_only: serve.is_some_and(|s| s.read_only),
        toolsets: serve.map(|s| s.toolsets.iter().copied().map(toolset).collect()).unwrap_or_default(),
    }
}

fn ctx(g: &Global) -> Result<Ctx> {
    options(g, None, None).ctx("cli")
}

/// This binary's absolute, canonical path (what `register` writes and `doctor` compares with).
fn own_exe() -> Result<PathBuf> {
    let exe = std::env::current_exe().internal_ctx(|| "own executable".to_owned())?;
    Ok(exe.canonicalize().unwrap_or(exe))
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// MCP tools and the CLI commands that do the same.
const COMMANDS: [(&str, &str); 13] = [
    ("plan_engine", "`metainfer plan`"),
    ("lookup_contract", "`metainfer contract`"),
    ("scaffold_engine", "`metainfer scaffold`"),
    ("compile_engine", "`metainfer compile`"),
    ("run_kernel_test", "`metainfer test-kernel`"),
    ("verify_generation", "`metainfer verify`"),
    ("profile_engine", "`metainfer profile`"),
    ("check_rules", "`metainfer check-rules`"),
    ("list_outcomes", "`metainfer ledger`"),
    ("ckb_report", "`metainfer report`"),
    ("evolve_knowledge", "`metainfer evolve`"),
    ("propose_contract", "`metainfer ckb propose`"),
    ("probe_machine", "`metainfer machine`"),
];

/// A report's text for the terminal: its hints (`next:` and paging lines) name CLI commands and
/// options instead of MCP tools and arguments.
fn for_terminal(text: &str) -> String {
    text.lines()
        .map(|l| {
            let t = l.trim_start();
            if t.starts_with("next:") {
                COMMANDS.iter().fold(l.to_string(), |acc, (tool, cmd)| acc.replace(tool, cmd))
            } else if t.starts_with("more: pass cursor ") {
                l.replace("more: pass cursor ", "more: pass --cursor ")
            } else if t.starts_with("More ") && t.contains(": pass section \"") {
                l.replace(": pass section \"", ": pass --section \"").replace("\" and cursor \"", "\" --cursor \"")
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
        + if text.ends_with('\n') { "\n" } else { "" }
}

/// Print a report: its text, or its structured output as JSON; exit 0 when it passed or wrote a
/// bundle, else 1.
fn emit<R: Report>(r: &R, json: bool) -> ExitCode {
    if json {
        println!("{}", serde_json::to_string_pretty(r).expect("reports serialise"));
    } else {
        let text = for_terminal(&r.text());
        print!("{text}");
        if !text.ends_with('\n') {
            println!();
        }
    }
    // A bundle written is what was asked for: no verdict, no failure.
    if r.passed() || r.bundle_written() { ExitCode::SUCCESS } else { ExitCode::from(1) }
}

/// Run `f` while a line on stderr says what is happening and for how long, when stderr is a
/// terminal and `quiet` is false (updated every second, from the second second on).
fn progress<T>(what: &str, note: &str, quiet: bool, f: impl FnOnce() -> T) -> T {
    if quiet || !std::io::stderr().is_terminal() {
        return f();
    }
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = done.clone();
    let (what, note) = (what.to_string(), note.to_string());
    let ticker = std::thread::spawn(move || {
        let start = Instant::now();
        let mut shown = false;
        while !flag.load(std::sync::atomic::Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(200));
            let t = start.elapsed().as_secs();
            if t >= 2 {
                eprint!("\r\x1b[2K{what}: {t} s{note}");
                shown = true;
            }
        }
        if shown {
            eprint!("\r\x1b[2K");
        }
    });
    let r = f();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = ticker.join();
    r
}

/// What the first build of a cache adds to a progress line (the correctness gates build into the
/// incremental target directory, profile into the optimised one; either may be the first).
fn first_build_note(c: &Ctx) -> &'static str {
    if c.workshop.target_dir().exists() && c.workshop.incremental_target_dir().exists() {
        ""
    } else {
        " (the first build of each kind also compiles the engine's dependencies)"
    }
}

/// `rope` names `kernel.rope`: kernel ids may be given without their kind.
fn kernel_id(id: String) -> String {
    if id.contains('.') { id } else { format!("kernel.{id}") }
}

/// Run one parsed command line.
///
/// # Errors
/// Bad usage or input, or a fault of the server; the message says what to fix.
pub fn run(cli: args::Cli) -> Result<ExitCode> {
    let g = &cli.global;
    let budget = || Budget::secs(g.time_limit);
    match cli.command {
        Command::Serve { workspace, serve } => {
            let o = options(g, workspace, Some(&serve));
            let ctx = o.ctx("cli")?;
            let sandbox = metainfer::harness::sandbox::status();
            if sandbox.enforced {
                tracing::info!("{}", sandbox.summary);
            } else if o.require_sandbox {
                return Err(Error::usage(format!("--require-sandbox: {}", sandbox.summary)));
            } else {
                tracing::warn!("{}", sandbox.summary);
            }
            let rt = tokio::runtime::Runtime::new().internal_ctx(|| "tokio runtime".to_owned())?;
            let served = rt.block_on(metainfer::mcp::serve_stdio(ctx, metainfer::mcp::Exposure::of(&o)));
            // Calls in flight were cancelled; give their blocking threads a moment to reap children.
            rt.shutdown_timeout(Duration::from_secs(2));
            served.internal_ctx(|| "MCP server".to_owned())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Plan { model, target, dtype, platform, serving, json } => {
            let serving = serving_of(&serving);
            let r = ops::plan::plan(
                &ctx(g)?,
                &ops::plan::PlanRequest { model: s(&model), target, dtype, platform, serving },
            )?;
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
            experts,
            experts_per_token,
            expert_intermediate,
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
                experts,
                experts_per_token,
                expert_intermediate,
                dtype,
                shards,
                tokenizer,
            };
            let c = ctx(g)?;
            Ok(emit(&progress("synth", "", json, || ops::synth::synth_in(&c.live().ckb, &req))?, json))
        }
        Command::Contract { action } => {
            let c = ctx(g)?;
            let (req, json) = match action {
                ContractCmd::Show { ids, json } => (ops::lookup::LookupRequest { ids, ..Default::default() }, json),
                ContractCmd::Phase { phase, family, dtype, json } => (
                    ops::lookup::LookupRequest {
                        phase: Some(phase),
                        family: Some(family),
                        dtype: Some(dtype),
                        ..Default::default()
                    },
                    json,
                ),
                ContractCmd::Search { text, json } => {
                    (ops::lookup::LookupRequest { query: Some(text), ..Default::default() }, json)
                }
            };
            // The CLI has no output bound: every contract is shown, whole.
            let c = Ctx { max_output: usize::MAX / 2, ..c };
            let r = ops::lookup::lookup(&c, &req)?;
            if json || r.contracts.is_empty() {
                return Ok(emit(&r, json));
            }
            for (i, k) in r.contracts.iter().enumerate() {
                if i > 0 {
                    println!();
                }
                println!("# {} (v{}, {})", k.id, k.version, k.kind);
                print!("{}", k.toml);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Ckb { action: CkbCmd::Check { json } } => Ok(emit(&ops::ckb_check::check(g.ckb.as_deref())?, json)),
        Command::Ckb { action: CkbCmd::Conformance { dirs, json } } => {
            let dirs: Vec<String> = dirs.iter().map(|d| s(d)).collect();
            Ok(emit(&ops::conformance::conformance(&ctx(g)?, &dirs)?, json))
        }
        Command::Ckb { action: CkbCmd::Perplexity { model, text, max_tokens, consent, json } } => {
            let req = ops::perplexity::PerplexityRequest {
                model: s(&model),
                text: text.as_deref().map(s),
                consent,
                max_tokens,
            };
            Ok(emit(&ops::perplexity::check(&ctx(g)?, &req)?, json))
        }
        Command::Ckb { action: CkbCmd::Schema } => {
            println!(
                "{}",
                serde_json::to_string_pretty(&metainfer::ckb::contract_schema()).expect("schema serialises")
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Scaffold { model, out, target, dtype, platform, name, force, reference_level, serving, json } => {
            let req = ops::scaffold::ScaffoldRequest {
                serving: serving_of(&serving),
                model: s(&model),
                out: s(&out),
                target,
                dtype,
                platform,
                name,
                force,
                reference_level: level(reference_level),
            };
            Ok(emit(&ops::scaffold::scaffold(&ctx(g)?, &req)?, json))
        }
        Command::Compile { engine, json } => {
            let c = ctx(g)?;
            let req = ops::compile::CompileRequest { engine: s(&engine), cursor: None };
            let r = progress("compile", first_build_note(&c), json, || ops::compile::compile(&c, &req, &budget()))?;
            Ok(emit(&r, json))
        }
        Command::TestKernel { engine, kernels, seed, dtype, write_bundle, from_bundle, json } => {
            let c = ctx(g)?;
            let kernels = kernels.into_iter().map(kernel_id).collect();
            let req = ops::kernel_test::KernelTestRequest {
                engine: s(&engine),
                kernels,
                seed,
                dtype,
                write_bundle: write_bundle.as_deref().map(s),
                from_bundle: from_bundle.as_deref().map(s),
            };
            let r = progress("kernel tests (build + run)", first_build_note(&c), json, || {
                ops::kernel_test::kernel_test(&c, &req, &budget())
            })?;
            Ok(emit(&r, json))
        }
        Command::Verify {
            engine,
            model,
            prompts,
            max_new_tokens,
            seed,
            dtype,
            logits_every,
            write_bundle,
            from_bundle,
            json,
        } => {
            let c = ctx(g)?;
            let req = ops::verify::VerifyRequest {
                engine: s(&engine),
                model: s(&model),
                prompts,
                max_new_tokens,
                seed,
                dtype,
                logits_every,
                write_bundle: write_bundle.as_deref().map(s),
                from_bundle: from_bundle.as_deref().map(s),
            };
            let r = progress("verify (build + generate + reference)", first_build_note(&c), json, || {
                ops::verify::verify(&c, &req, &budget())
            })?;
            Ok(emit(&r, json))
        }
        Command::VerifyBatching { engine, model, sequences, seed, dtype, write_bundle, from_bundle, json } => {
            let c = ctx(g)?;
            let req = ops::batching::BatchingRequest {
                engine: s(&engine),
                model: s(&model),
                sequences,
                seed,
                dtype,
                write_bundle: write_bundle.as_deref().map(s),
                from_bundle: from_bundle.as_deref().map(s),
            };
            let r = progress(
                "verify batching (build + block manager + batched run + reference)",
                first_build_note(&c),
                json,
                || ops::batching::verify_batching(&c, &req, &budget()),
            )?;
            Ok(emit(&r, json))
        }
        Command::LoadTest {
            engine,
            model,
            concurrency,
            requests,
            max_tokens,
            seed,
            dtype,
            write_bundle,
            from_bundle,
            json,
        } => {
            let c = ctx(g)?;
            let req = ops::serve::ServeRequest {
                engine: s(&engine),
                model: s(&model),
                concurrency,
                requests,
                max_tokens,
                seed,
                dtype,
                write_bundle: write_bundle.as_deref().map(s),
                from_bundle: from_bundle.as_deref().map(s),
            };
            let r = progress(
                "serve engine (build binary + reference + server + conformance + load)",
                first_build_note(&c),
                json,
                || ops::serve::serve_engine(&c, &req, &budget()),
            )?;
            Ok(emit(&r, json))
        }
        Command::Profile {
            engine,
            model,
            runs,
            prompt_len,
            new_tokens,
            dtype,
            threads,
            write_bundle,
            from_bundle,
            json,
        } => {
            let c = ctx(g)?;
            let req = ops::profile::ProfileRequest {
                engine: s(&engine),
                model: s(&model),
                prompt_len,
                new_tokens,
                runs,
                dtype,
                threads,
                write_bundle: write_bundle.as_deref().map(s),
                from_bundle: from_bundle.as_deref().map(s),
            };
            let r = progress("profile", first_build_note(&c), json, || ops::profile::profile(&c, &req, &budget()))?;
            Ok(emit(&r, json))
        }
        Command::Ledger { action: Some(action), .. } => {
            let c = ctx(g)?;
            let mut l = metainfer::ledger::Ledger::open(&c.ledger)?;
            match action {
                LedgerCmd::Export { out: None } => print!("{}", l.export_jsonl()?),
                LedgerCmd::Export { out: Some(path) } => {
                    let n = l.export_file(&path)?;
                    eprintln!("exported {n} outcomes to {}", path.display());
                }
                LedgerCmd::Import { file } => {
                    let (new, known) = l.import_file(&file)?;
                    println!("imported {new} new outcomes; {known} were already present");
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Ledger { action: None, limit, cursor, tool, engine, contract, since, json } => {
            let c = ctx(g)?;
            let req = ops::outcomes::OutcomesRequest { cursor, limit: Some(limit), tool, engine, contract, since };
            // The CLI has no output bound; the page is what --limit says.
            let c = Ctx { max_output: usize::MAX / 2, ..c };
            let r = ops::outcomes::list(&c, &req)?;
            if !json {
                eprintln!("ledger {}", c.ledger.display());
            }
            emit(&r, json);
            Ok(ExitCode::SUCCESS)
        }
        Command::CheckRules { engine, json } => {
            let c = ctx(g)?;
            let req = ops::rules::RulesRequest { engine: s(&engine) };
            Ok(emit(&progress("check-rules", "", json, || ops::rules::check_rules(&c, &req, &budget()))?, json))
        }
        Command::Bundle { action: BundleCmd::Keygen { out } } => {
            let (secret, public, key) = metainfer::harness::attest::keygen(&out)?;
            println!(
                "runner key pair written:\n  {} (secret: keep it on the device machine, out of the agent's reach)\n  {} (public: {key})\ntrust it where gates judge bundles: metainfer bundle trust {} --name NAME",
                secret.display(),
                public.display(),
                public.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Bundle { action: BundleCmd::Trust { key, name } } => {
            let c = ctx(g)?;
            let key = metainfer::harness::attest::read_public(&key)?;
            metainfer::ledger::Ledger::open(&c.ledger)?.trust_runner(&name, &key)?;
            println!("runner {name:?} trusted in {}: bundle runs its key signs count as evidence", c.ledger.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Bundle { action: BundleCmd::Runners } => {
            let c = ctx(g)?;
            let runners = metainfer::ledger::Ledger::open(&c.ledger)?.runners()?;
            if runners.is_empty() {
                println!("no trusted runner in {}: every bundle verdict is unattested", c.ledger.display());
            }
            for (name, key) in runners {
                println!("{name}\t{key}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bundle { action: BundleCmd::Run { dir, model, key, json } } => {
            let req = ops::bundle::BundleRunRequest {
                dir: s(&dir),
                model: model.as_deref().map(s),
                key: key.as_deref().map(s),
            };
            let r = progress("bundle run", "", json, || ops::bundle::run(&req, &budget()))?;
            Ok(emit(&r, json))
        }
        Command::Reference { action: ReferenceCmd::Add { dir, name } } => {
            let r = ops::reference::add(&ctx(g)?, &dir, name.as_deref())?;
            println!(
                "registered reference `{}`: {} files, {} fingerprints (no code stored)",
                r.name, r.files, r.prints
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Reference { action: ReferenceCmd::List } => {
            let refs = ops::reference::list(&ctx(g)?)?;
            if refs.is_empty() {
                println!("no references registered; add one with `metainfer reference add DIR`");
            }
            for r in refs {
                println!("{}: {} files, {} fingerprints", r.name, r.files, r.prints);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Ckb { action: CkbCmd::Propose { file, json } } => {
            // A regular file of bounded size (a FIFO or a device is refused by name, never read).
            let toml = metainfer::util::read_regular_text(&file, &metainfer::util::CONTRACT_FILE).map_err(|e| {
                if file.is_dir() {
                    Error::usage(format!("{} is a directory; pass one contract file (TOML)", file.display()))
                } else {
                    e
                }
            })?;
            Ok(emit(&ops::evolve::propose(&ctx(g)?, &ops::evolve::ProposeRequest { toml })?, json))
        }
        Command::Ckb { action: CkbCmd::Promote { id, force } } => {
            println!("{}", ops::evolve::promote(&ctx(g)?, &id, force)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Evolve { min_cluster, json } => {
            let r = ops::evolve::evolve(&ctx(g)?, &ops::evolve::EvolveRequest { min_cluster })?;
            Ok(emit(&r, json))
        }
        Command::Machine { refresh, runs, json } => {
            let c = ctx(g)?;
            let req = ops::machine::MachineRequest { refresh, runs: Some(runs) };
            let p = progress("machine probe", "", json, || ops::machine::probe(&c, &req, |m| eprintln!("{m} ...")))?;
            Ok(emit(&p, json))
        }
        Command::Report { prefix, section, cursor, limit, engine, since, json } => {
            let c = ctx(g)?;
            let req = ops::report::ReportRequest { prefix, section, cursor, limit, engine, contract: None, since };
            Ok(emit(&ops::report::report(&c, &req)?, json))
        }
        Command::InstallSkills { client: cl, dir, force } => {
            let dir = match dir {
                Some(d) => d,
                None => PathBuf::from(metainfer::guide::skills_dir(client(cl))?),
            };
            for (p, state) in metainfer::guide::install_skills(&dir, force)? {
                let what = match state {
                    metainfer::guide::Installed::Written => "wrote",
                    metainfer::guide::Installed::Replaced => "replaced",
                    metainfer::guide::Installed::Unchanged => "up to date:",
                };
                println!("{what} {}", p.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Doctor { client: cl, dir, name, json } => {
            let project = dir.canonicalize().usage_ctx(|| format!("--dir {}", dir.display()))?;
            let r = metainfer::doctor::check(client(cl), &project, name)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r).expect("report serialises"));
            } else {
                print!("{}", r.text());
            }
            Ok(if r.passed() { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
        Command::Register { client: cl, print, dir, name, replace, serve } => {
            let cl = client(cl);
            let project = dir.canonicalize().usage_ctx(|| format!("--dir {}", dir.display()))?;
            let exe = own_exe()?;
            let mut serve = serve;
            serve.model_dirs = serve.model_dirs.iter().map(|m| std::path::absolute(m).unwrap_or(m.clone())).collect();
            for m in &serve.model_dirs {
                if !m.is_dir() {
                    return Err(Error::usage(format!("--model-dir {}: no such directory", m.display())));
                }
            }
            let mut o = options(g, Some(project.clone()), Some(&serve));
            o.ckb = o.ckb.map(|p| std::path::absolute(&p).unwrap_or(p));
            o.ledger = o.ledger.map(|p| std::path::absolute(&p).unwrap_or(p));
            o.cache = o.cache.map(|p| std::path::absolute(&p).unwrap_or(p));
            let entry = cl.entry(&project, &exe, &o);
            let name = name.unwrap_or_else(|| cl.default_name(&project));
            if print {
                let path = cl.config_path(&project);
                let existing = std::fs::read_to_string(&path).unwrap_or_default();
                println!("# {}", path.display());
                print!("{}", cl.merge(&existing, &name, &entry, replace)?.0);
                return Ok(ExitCode::SUCCESS);
            }
            let (path, merged) = metainfer::clients::register(cl, &project, &name, &entry, replace)?;
            let what = match merged {
                Merged::Added => "registered",
                Merged::Replaced => "replaced",
                Merged::Unchanged => "already registered, unchanged:",
            };
            println!("{what} `{name}` in {}: {} {}", path.display(), entry.command, entry.args.join(" "));
            println!(
                "the client starts {} (this binary's absolute path, so it is found without ~/.cargo/bin on the \
                 client's PATH; register again after moving it); check the setup with `metainfer doctor --client {}`",
                entry.command,
                cl.name()
            );
            if cl == Client::Codex {
                println!(
                    "note: Codex reads this one user-wide file for every project, so the entry is named `{name}` \
                     (per project); its tool timeout is {} s, above the server's {} s limit",
                    entry.tool_timeout_s.unwrap_or_default(),
                    o.time_limit_s
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench { reps, threads, prompt_len, new_tokens, no_agent_loop, serving, llama_bench, gguf, json } => {
            if reps == 0 || threads.contains(&0) || new_tokens == 0 {
                return Err(Error::usage("--reps, --threads and --new-tokens must be positive"));
            }
            let llama = match llama_bench {
                Some(exe) => Some(metainfer::bench::LlamaPeer { exe, gguf: gguf_args(&gguf)? }),
                None => None,
            };
            let c = ctx(g)?;
            let work = c.workshop.scratch()?;
            let o = metainfer::bench::BenchOptions {
                reps,
                threads,
                prompt_len,
                new_tokens,
                agent_loop: !no_agent_loop,
                serving,
                llama,
            };
            let r = metainfer::bench::run(&c, &o, work.path())?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r).expect("report serialises"));
            } else {
                print!("{}", r.text());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::BenchReference { model, dtype, tokens, json } => {
            let c = ctx(g)?;
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
            let rt = tokio::runtime::Runtime::new().internal_ctx(|| "tokio runtime".to_owned())?;
            let opts = metainfer::demo::DemoOptions {
                model,
                keep,
                max_new_tokens,
                server: options(g, None, None),
                progress: std::io::stderr().is_terminal(),
            };
            let ok = rt.block_on(metainfer::demo::run(opts))?;
            Ok(if ok { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
    }
}

/// The serving constraints of the CLI flags (None without --max-seqs).
fn serving_of(a: &args::ServingArgs) -> Option<metainfer::manifest::Serving> {
    Some(metainfer::manifest::Serving {
        max_seqs: a.max_seqs?,
        max_context: a.max_context?,
        block_size: a.block_size,
        kv_blocks: a.kv_blocks,
        max_batch_tokens: a.max_batch_tokens,
        sampling: a.sampling,
    })
}

/// `--gguf DTYPE=FILE` values: each dtype `f32` or `int8` at most once, each file present.
fn gguf_args(values: &[String]) -> Result<Vec<(String, PathBuf)>> {
    let mut out: Vec<(String, PathBuf)> = Vec::new();
    for v in values {
        let (d, f) = v
            .split_once('=')
            .ok_or_else(|| Error::usage(format!("--gguf {v:?}: write DTYPE=FILE, e.g. f32=stories15m-f32.gguf")))?;
        if !matches!(d, "f32" | "int8") {
            return Err(Error::usage(format!(
                "--gguf {v:?}: the dtype is the engine's it stands beside, f32 (an F32 GGUF) or int8 (a Q8_0 GGUF)"
            )));
        }
        if out.iter().any(|(o, _)| o == d) {
            return Err(Error::usage(format!("--gguf: {d} given twice")));
        }
        let file = PathBuf::from(f);
        if !file.is_file() {
            return Err(Error::usage(format!("--gguf {v:?}: {} is not a file", file.display())));
        }
        out.push((d.to_string(), file));
    }
    Ok(out)
}
