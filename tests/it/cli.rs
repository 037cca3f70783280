//! The command line as a user meets it: help, closed pipes, registration with every server option,
//! skills for each client, and messages that name the fix.

use std::io::Read;
use std::process::{Command, Stdio};

fn run(args: &[&str], dir: &std::path::Path) -> std::process::Output {
    Command::new(crate::bin())
        .args(args)
        .env("METAINFER_LEDGER", dir.join("l.sqlite"))
        .env("CODEX_HOME", dir.join("codex"))
        .current_dir(dir)
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `metainfer ckb schema | head -c 10`: the reader goes away; the CLI ends quietly (no panic, no
/// backtrace, not exit status 101).
#[test]
fn a_closed_pipe_ends_the_cli_quietly() {
    let t = tempfile::tempdir().unwrap();
    for args in [&["ckb", "schema"][..], &["contract", "show", "model.llama", "model.gemma", "kernel.attention"][..]] {
        let mut child = Command::new(crate::bin())
            .args(args)
            .env("METAINFER_LEDGER", t.path().join("l.sqlite"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut first = [0u8; 10];
        child.stdout.as_mut().unwrap().read_exact(&mut first).unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = text(&out.stderr);
        assert!(!err.contains("panicked") && !err.contains("Broken pipe"), "{args:?}: {err}");
        assert_ne!(out.status.code(), Some(101), "{args:?}: {err}");
    }
}

#[test]
fn help_groups_global_options_documents_every_option_and_gives_examples() {
    let t = tempfile::tempdir().unwrap();
    let top = text(&run(&["--help"], t.path()).stdout);
    assert!(top.contains("Global options:") && top.contains("METAINFER_MODEL"), "{top}");
    // Every subcommand, nested ones included, read from the help's own "Commands:" sections.
    let commands = |args: &[&str]| -> Vec<String> {
        let mut a = args.to_vec();
        a.push("--help");
        let h = text(&run(&a, t.path()).stdout);
        h.lines()
            .skip_while(|l| !l.starts_with("Commands:"))
            .skip(1)
            .take_while(|l| l.starts_with("  "))
            .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
            .filter(|c| c != "help")
            .collect()
    };
    let mut all: Vec<Vec<String>> = Vec::new();
    for sub in commands(&[]) {
        let nested = commands(&[sub.as_str()]);
        all.push(vec![sub.clone()]);
        all.extend(nested.into_iter().map(|n| vec![sub.clone(), n]));
    }
    assert!(all.len() > 30 && all.iter().any(|c| c == &["bundle", "trust"]), "{all:?}");
    for path in &all {
        let sub = path.join(" ");
        let mut a: Vec<&str> = path.iter().map(String::as_str).collect();
        a.push("-h");
        let h = text(&run(&a, t.path()).stdout);
        assert!(h.contains("Example"), "`{sub} -h` has no example:\n{h}");
        // Every option line has a description after its name (clap prints a bare name otherwise).
        let lines: Vec<&str> = h.lines().map(str::trim_start).collect();
        for (i, line) in lines.iter().enumerate().filter(|(_, l)| l.starts_with('-')) {
            // The description follows on the same line, or (when long) on the next, indented.
            let next = lines.get(i + 1).copied().unwrap_or("");
            assert!(
                line.contains("  ") || (!next.is_empty() && !next.starts_with('-')),
                "`{sub}`: undocumented option {line:?}"
            );
        }
    }
    let verify = text(&run(&["verify", "--help"], t.path()).stdout);
    assert!(verify.contains("Tokens to generate per prompt") && verify.contains("three random prompts"), "{verify}");
    let plan = text(&run(&["plan", "--help"], t.path()).stdout);
    assert!(plan.contains("f32, bf16, f16 or int8"), "{plan}");
}

#[test]
fn register_writes_the_absolute_binary_and_every_server_option_and_asks_before_replacing() {
    let t = tempfile::tempdir().unwrap();
    let project = t.path().join("proj");
    let models = t.path().join("models");
    std::fs::create_dir_all(&project).unwrap();
    std::fs::create_dir_all(&models).unwrap();
    let m = models.display().to_string();
    let out =
        run(&["register", "--client", "codex", "--dir", "proj", "--model-dir", &m, "--time-limit", "1200"], t.path());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let cfg: toml::Table =
        toml::from_str(&std::fs::read_to_string(t.path().join("codex/config.toml")).unwrap()).unwrap();
    let e = &cfg["mcp_servers"]["metainfer-proj"];
    let args: Vec<&str> = e["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    let models_abs = models.canonicalize().unwrap().display().to_string();
    assert!(args.windows(2).any(|w| w == ["--model-dir", models_abs.as_str()] || w[0] == "--model-dir"), "{args:?}");
    assert!(args.windows(2).any(|w| w == ["--time-limit", "1200"]), "{args:?}");
    assert_eq!(e["tool_timeout_sec"].as_integer(), Some(1260));
    assert!(e["env_vars"].as_array().unwrap().iter().any(|v| v.as_str() == Some("RUSTUP_HOME")));
    assert!(e["env"]["CARGO_HOME"].as_str().is_some());
    assert!(text(&out.stdout).contains("metainfer-proj"), "{}", text(&out.stdout));

    // Claude Code: the project file is portable (relative workspace); a different re-registration
    // needs --replace and then keeps the entry's other keys.
    let out = run(&["register", "--client", "claude", "--dir", "proj", "--model-dir", &m], t.path());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(project.join(".mcp.json")).unwrap()).unwrap();
    let args = v["mcpServers"]["metainfer"]["args"].as_array().unwrap().clone();
    assert_eq!(args[..3], [serde_json::json!("serve"), "--workspace".into(), ".".into()], "{v}");
    assert!(args.iter().any(|a| a == "--model-dir"), "{v}");
    // The command is this binary's absolute, canonical path (a client started from a desktop menu
    // may not have ~/.cargo/bin on its PATH), and register shows it.
    let exe = crate::bin().canonicalize().unwrap().display().to_string();
    assert_eq!(v["mcpServers"]["metainfer"]["command"], exe.as_str(), "{v}");
    assert_eq!(e["command"].as_str(), Some(exe.as_str()));
    assert!(text(&out.stdout).contains(&format!("the client starts {exe}")), "{}", text(&out.stdout));
    let out = run(&["register", "--client", "claude", "--dir", "proj", "--read-only"], t.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--replace"), "{}", text(&out.stderr));
    let out = run(&["register", "--client", "claude", "--dir", "proj", "--read-only", "--replace"], t.path());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(project.join(".mcp.json")).unwrap()).unwrap();
    assert!(v["mcpServers"]["metainfer"]["args"].as_array().unwrap().iter().any(|a| a == "--read-only"), "{v}");
}

#[test]
fn skills_install_into_each_clients_folder_and_edited_ones_are_kept_without_force() {
    let t = tempfile::tempdir().unwrap();
    for (client, dir) in [
        ("claude", ".claude/skills"),
        ("codex", ".agents/skills"),
        ("gemini", ".gemini/skills"),
        ("cursor", ".cursor/skills"),
    ] {
        let out = run(&["install-skills", "--client", client], t.path());
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert!(t.path().join(dir).join("generate-engine/SKILL.md").is_file(), "{client}");
    }
    let skill = t.path().join(".claude/skills/engine-reviewer/SKILL.md");
    std::fs::write(&skill, "---\nname: engine-reviewer\ndescription: mine\n---\nmy notes\n").unwrap();
    let out = run(&["install-skills", "--client", "claude"], t.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("--force") && text(&out.stderr).contains("engine-reviewer"),
        "{}",
        text(&out.stderr)
    );
    assert!(std::fs::read_to_string(&skill).unwrap().contains("my notes"), "an edited skill was overwritten");
    let out = run(&["install-skills", "--client", "claude", "--force"], t.path());
    assert!(out.status.success());
    assert!(!std::fs::read_to_string(&skill).unwrap().contains("my notes"));
}

/// A `--model` (or `$METAINFER_MODEL`) that is not a model directory is refused before anything
/// starts, saying what a model directory holds and that without one the built-in model runs.
#[test]
fn demo_with_a_wrong_model_names_the_fix() {
    let t = tempfile::tempdir().unwrap();
    let missing = t.path().join("no-model");
    for (flag, env) in [(true, None), (false, Some(&missing))] {
        let mut c = Command::new(crate::bin());
        c.arg("demo").env_remove("METAINFER_MODEL").current_dir(t.path());
        if flag {
            c.arg("--model").arg(&missing);
        }
        if let Some(m) = env {
            c.env("METAINFER_MODEL", m);
        }
        let out = c.output().unwrap();
        assert_eq!(out.status.code(), Some(2));
        let err = text(&out.stderr);
        assert!(
            err.contains(&format!("model directory {} has no config.json", missing.display()))
                && err.contains("BabyLlama-105 checkpoint built into this binary"),
            "{err}"
        );
        assert!(text(&out.stdout).is_empty(), "nothing started");
    }
}

/// `demo --keep DIR` writes engine/, babyllama-105/ and ledger.sqlite into DIR: one already there,
/// in any form, is refused before anything is written, so a link planted there cannot redirect
/// the demo's writes onto its target (before, the model's files overwrote the link's target).
#[test]
fn demo_keep_refuses_a_directory_holding_what_it_writes() {
    let t = tempfile::tempdir().unwrap();
    let (keep, victim) = (t.path().join("keep"), t.path().join("victim"));
    std::fs::create_dir_all(&keep).unwrap();
    std::fs::create_dir_all(&victim).unwrap();
    std::fs::write(victim.join("config.json"), "{\"victim\": true}").unwrap();
    std::os::unix::fs::symlink(&victim, keep.join("babyllama-105")).unwrap();
    let out = run(&["demo", "--keep", "keep"], t.path());
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("babyllama-105 already exists") && err.contains("--keep"), "{err}");
    assert_eq!(std::fs::read_to_string(victim.join("config.json")).unwrap(), "{\"victim\": true}");
    assert_eq!(std::fs::read_dir(&victim).unwrap().count(), 1, "nothing written into the link's target");
    assert!(!keep.join("engine").exists() && !keep.join("ledger.sqlite").exists());
}

#[test]
fn small_messages_name_the_fix() {
    let t = tempfile::tempdir().unwrap();
    // An empty ledger says so instead of printing a blank line.
    let out = run(&["ledger"], t.path());
    assert!(text(&out.stdout).contains("no outcomes recorded"), "{}", text(&out.stdout));
    // `contract search rope` ranks kernel.rope first.
    let out = run(&["contract", "search", "rope", "--json"], t.path());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["matches"][0]["id"], "kernel.rope", "{v}");
    // Proposing a directory says to pass a file.
    let out = run(&["ckb", "propose", "."], t.path());
    assert!(text(&out.stderr).contains("is a directory"), "{}", text(&out.stderr));
}

/// `bench --llama-bench` with a GGUF it cannot use is refused before anything is built, naming
/// the fix: a dtype other than f32 or int8, a missing `=`, a file that is not there, a dtype twice,
/// and --gguf without --llama-bench.
#[test]
fn bench_refuses_llama_peer_arguments_it_cannot_use() {
    let t = tempfile::tempdir().unwrap();
    let gguf = t.path().join("s15.gguf");
    std::fs::write(&gguf, b"GGUF").unwrap();
    let g = gguf.display().to_string();
    let cases: [(Vec<String>, &str); 5] = [
        (vec![format!("q4={g}")], "f32 (an F32 GGUF) or int8 (a Q8_0 GGUF)"),
        (vec![g.clone()], "write DTYPE=FILE"),
        (vec!["f32=/nonexistent/x.gguf".into()], "is not a file"),
        (vec![format!("f32={g}"), format!("f32={g}")], "f32 given twice"),
        (vec![], ""),
    ];
    for (ggufs, want) in cases {
        let mut args: Vec<String> = vec!["bench".into(), "--no-agent-loop".into()];
        if !want.is_empty() {
            args.extend(["--llama-bench".into(), "/bin/true".into()]);
        }
        for v in &ggufs {
            args.extend(["--gguf".into(), v.clone()]);
        }
        if want.is_empty() {
            args.extend(["--gguf".into(), format!("f32={g}")]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = run(&args, t.path());
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        let want = if want.is_empty() { "--llama-bench" } else { want };
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// server.json (the MCP Registry entry) names this package at this version, started as `serve`.
#[test]
fn registry_entry_matches_the_package() {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("server.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
    assert!(v["$schema"].as_str().unwrap().ends_with("/server.schema.json"));
    assert_eq!(v["name"].as_str().unwrap().split('/').count(), 2);
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    let pkg = &v["packages"][0];
    assert_eq!(
        (pkg["registryType"].as_str(), pkg["identifier"].as_str()),
        (Some("cargo"), Some(env!("CARGO_PKG_NAME")))
    );
    assert_eq!(pkg["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(pkg["transport"]["type"], "stdio");
    assert_eq!(pkg["packageArguments"][0]["value"], "serve");
}

#[test]
fn model_paths_that_are_files_or_llama2c_directories_get_their_own_message() {
    let t = tempfile::tempdir().unwrap();
    std::fs::write(t.path().join("config.json"), "{}").unwrap();
    let out = run(&["plan", "--model", "config.json"], t.path());
    assert!(text(&out.stderr).contains("is a file"), "{}", text(&out.stderr));
    std::fs::create_dir_all(t.path().join("l2c")).unwrap();
    std::fs::write(t.path().join("l2c/stories15M.bin"), [0u8; 16]).unwrap();
    let out = run(&["plan", "--model", "l2c"], t.path());
    assert!(text(&out.stderr).contains("llama2.c layout is not supported"), "{}", text(&out.stderr));
}

#[test]
fn scaffold_records_the_model_as_an_absolute_path() {
    let t = tempfile::tempdir().unwrap();
    let out = Command::new(crate::bin())
        .args(["scaffold", "--model", "models/babyllama-105", "--out"])
        .arg(t.path().join("e"))
        .env("METAINFER_LEDGER", t.path().join("l.sqlite"))
        .current_dir(crate::shared())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    // The hint names CLI commands, not MCP tools.
    let next = text(&out.stdout).lines().find(|l| l.starts_with("next:")).unwrap_or_default().to_string();
    assert!(next.contains("`metainfer compile`") && !next.contains("compile_engine"), "{next}");
    let toml: toml::Table =
        toml::from_str(&std::fs::read_to_string(t.path().join("e/metainfer.toml")).unwrap()).unwrap();
    let model = std::path::PathBuf::from(toml["model"].as_str().unwrap());
    assert!(model.is_absolute() && model.join("config.json").is_file(), "{model:?}");
}
