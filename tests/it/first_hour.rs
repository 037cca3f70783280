//! The first hour of a new user: the demo from a bare clone (no ../shared anywhere above it) on the
//! model built into the binary, and `doctor` on a registered project, passing on a correct setup
//! and naming the fix on each broken one.

use std::path::{Path, PathBuf};
use std::process::Command;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A directory with no `shared/` in it or in any directory above it.
fn bare_dir() -> tempfile::TempDir {
    let t = tempfile::tempdir().unwrap();
    for a in t.path().ancestors() {
        assert!(!a.join("shared").exists(), "{} has a shared/ beside it", a.display());
    }
    t
}

/// The number of tools `tools/list` returns, from the reviewed snapshot (tests/snapshots).
fn tool_count() -> usize {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots/tools_list.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
    v.as_array().or_else(|| v["tools"].as_array()).expect("a list of tools").len()
}

/// README's two set-up commands on a bare clone: the repository cloned at HEAD into a directory with
/// no ../shared above it, then `metainfer demo` run there. The binary is the one cargo built for
/// these tests (a second build of the clone would take minutes; the clone's own sources equal
/// HEAD's, from which it was built when the tree is clean): it must find its model without
/// ../shared, print the golden story (../shared/golden, read by this test only) and pass every
/// gate. The demo's server gets the build cache from $METAINFER_CACHE alone (no --cache), so it
/// also shows that the spawned server honours it. With METAINFER_BARE_CLONE_INSTALL=1 it first runs
/// README's install command on the clone, `cargo install --locked --path .`, with CARGO_TARGET_DIR
/// set to this build's target directory (so dependencies are not rebuilt), and runs that binary.
#[test]
fn demo_from_a_bare_clone_prints_the_golden_story() {
    let t = bare_dir();
    let clone = t.path().join("metainfer");
    let repo = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("git").args(["clone", "--quiet", repo]).arg(&clone).output().unwrap();
    assert!(out.status.success(), "git clone: {}", text(&out.stderr));
    // The model is committed (not ignored, not a pointer file) with the sha256 its provenance states.
    let model = clone.join("examples/models/babyllama-105/model.safetensors");
    let provenance = std::fs::read_to_string(clone.join("examples/models/babyllama-105/PROVENANCE.md")).unwrap();
    let sha = metainfer::model::embedded::sha256_hex(&std::fs::read(&model).unwrap());
    assert!(provenance.contains(&format!("{sha}  model.safetensors")), "{sha} not in PROVENANCE.md");
    let bin = if std::env::var_os("METAINFER_BARE_CLONE_INSTALL").is_some_and(|v| v == "1") {
        let root = t.path().join("install");
        let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
        let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or(target);
        let out = Command::new(env!("CARGO"))
            .args(["install", "--locked", "--path", "."])
            .arg("--root")
            .arg(&root)
            .env("CARGO_TARGET_DIR", &target)
            .current_dir(&clone)
            .output()
            .unwrap();
        assert!(out.status.success(), "cargo install: {}", text(&out.stderr));
        root.join("bin/metainfer")
    } else {
        crate::bin()
    };
    let ledger = t.path().join("ledger.sqlite");
    // A user's machine has none of ../shared/tokenizers: verify checks the shipped vocabulary of
    // BabyLlama's tokenizer contract and names the one it skipped.
    let no_vectors = t.path().join("no-tokenizers");
    std::fs::create_dir_all(&no_vectors).unwrap();
    let out = Command::new(&bin)
        .args(["demo", "--ledger"])
        .arg(&ledger)
        .args(["--time-limit", "1200"])
        .env("METAINFER_CACHE", crate::cache())
        .env_remove("METAINFER_MODEL")
        .env_remove("METAINFER_LEDGER")
        .env("METAINFER_TOKENIZERS", &no_vectors)
        .current_dir(&clone)
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("model BabyLlama-105 built into this binary"), "{stdout}");
    assert!(stdout.contains(&format!("sha256 {sha}")), "{stdout}");
    let server_line = stdout.lines().find(|l| l.trim_start().starts_with("server: metainfer serve")).unwrap();
    let cache = format!("--cache {}", crate::cache().display());
    for want in ["--ledger", cache.as_str(), "--time-limit 1200", "--model-dir"] {
        assert!(server_line.contains(want), "{want} not passed: {server_line}");
    }
    for tool in [
        "plan_engine",
        "lookup_contract",
        "scaffold_engine",
        "compile_engine",
        "run_kernel_test",
        "verify_generation",
        "profile_engine",
    ] {
        assert!(stdout.contains(&format!("| {tool} | pass |")), "{tool} did not pass:\n{stdout}");
    }
    assert!(stdout.contains("tokenizer vectors phi-3 (1 skipped)"), "{stdout}");
    assert!(
        stdout.contains(&format!(
            "verify_generation skipped: tokenizer vectors llama-spm (component.tokenizer): not found in {} ($METAINFER_TOKENIZERS) and not shipped with the binary (Llama 2 Community License)",
            no_vectors.display()
        )),
        "{stdout}"
    );
    let kernels = crate::readme::demo_engine_kernels();
    assert!(stdout.contains(&format!("{kernels}/{kernels} kernels")), "{stdout}");
    let golden = crate::golden();
    assert!(stdout.contains(golden["text"].as_str().unwrap()), "{stdout}");
    let l = metainfer::ledger::Ledger::open(&ledger).unwrap();
    assert_eq!(l.count().unwrap(), 7);
}

/// The files of examples/models/babyllama-105 are the checkpoint its PROVENANCE.md names (sha256
/// of every file, equal to ../shared's copy's README), and the binary embeds exactly these files.
#[test]
fn the_embedded_model_is_the_provenance_checkpoint() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/models/babyllama-105");
    let provenance = std::fs::read_to_string(dir.join("PROVENANCE.md")).unwrap();
    let shared_readme = std::fs::read_to_string(crate::shared().join("models/README.md")).unwrap();
    let mut named = 0;
    for line in provenance.lines().map(str::trim) {
        let Some((sha, file)) = line.split_once("  ") else { continue };
        if sha.len() != 64 || !sha.chars().all(|c| c.is_ascii_hexdigit()) {
            continue;
        }
        named += 1;
        assert_eq!(metainfer::model::embedded::sha256_hex(&std::fs::read(dir.join(file)).unwrap()), sha, "{file}");
        assert!(
            shared_readme.contains(&format!("{sha}  models/babyllama-105/{file}")),
            "{file}: not the shared checkpoint"
        );
        let embedded = metainfer::model::embedded::babyllama_files().iter().find(|(n, _)| *n == file).unwrap();
        assert_eq!(metainfer::model::embedded::sha256_hex(embedded.1), sha, "embedded {file}");
    }
    assert_eq!(named, 4, "LICENSE, config.json, model.safetensors, tokenizer.json");
    let mut files: Vec<&str> = metainfer::model::embedded::babyllama_files().iter().map(|(n, _)| *n).collect();
    files.sort();
    assert_eq!(files, ["LICENSE", "PROVENANCE.md", "config.json", "model.safetensors", "tokenizer.json"]);
    // The only checkpoint in the repository (its committed files; a checkout's ignored files, such
    // as build outputs, are not the repository's).
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let listed = std::process::Command::new("git").arg("-C").arg(root).args(["ls-files", "-z"]).output();
    let files: Vec<PathBuf> = match listed {
        Ok(o) if o.status.success() => o
            .stdout
            .split(|&b| b == 0)
            .filter(|f| !f.is_empty())
            .map(|f| root.join(String::from_utf8_lossy(f).as_ref()))
            .collect(),
        _ => walkdir::WalkDir::new(root)
            .into_iter()
            .filter_entry(|e| e.file_name() != "target" && e.file_name() != ".git")
            .filter_map(Result::ok)
            .map(|e| e.into_path())
            .collect(),
    };
    let weights: Vec<PathBuf> = files
        .into_iter()
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors" || x == "bin" || x == "gguf"))
        .collect();
    assert_eq!(weights, [dir.join("model.safetensors")]);
}

/// The shipped tokenizer vectors are ../shared/tokenizers' files, compressed.
#[test]
fn the_shipped_tokenizer_vectors_are_the_shared_ones() {
    let t = tempfile::tempdir().unwrap();
    let dirs = metainfer::model::embedded::write_shipped_vectors(t.path()).unwrap();
    let names: Vec<String> = dirs.iter().map(|d| d.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["gpt-2", "phi-3"]);
    for d in &dirs {
        let shared = crate::shared().join("tokenizers").join(d.file_name().unwrap());
        for f in ["tokenizer.json", "tests.json", "PROVENANCE.md"] {
            assert!(std::fs::read(d.join(f)).unwrap() == std::fs::read(shared.join(f)).unwrap(), "{}/{f}", d.display());
        }
        assert!(d.join("LICENSE").is_file());
    }
}

/// verify's real vocabularies: with no vectors directory, the shipped ones of the tokenizer contract
/// (GPT-2 byte-level, Phi-3 SentencePiece-style) and every other known one named as skipped with
/// its licence; with ../shared/tokenizers, all five and nothing skipped.
#[test]
fn verify_checks_the_shipped_vocabularies_and_names_every_one_it_skipped() {
    use metainfer::ops::verify::vocabulary_sets_in;
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let empty = t.path().join("none");
    std::fs::create_dir_all(&empty).unwrap();
    let names =
        |sets: &[metainfer::model::tokenizer::VectorSet]| sets.iter().map(|s| s.name.clone()).collect::<Vec<_>>();
    let (sets, skipped) = vocabulary_sets_in(&ctx, "component.tokenizer_bytelevel", &empty);
    assert_eq!(names(&sets), ["gpt-2"]);
    assert_eq!(sets[0].cases.len(), 46);
    assert_eq!(skipped.len(), 2, "{skipped:?}");
    assert!(
        skipped[0].starts_with("tokenizer vectors llama-bpe (component.tokenizer_bytelevel): not found in"),
        "{skipped:?}"
    );
    assert!(skipped[0].ends_with("not shipped with the binary (Llama 3 Community License)"), "{skipped:?}");
    assert!(skipped[1].starts_with("tokenizer vectors qwen2 "), "{skipped:?}");
    let (sets, skipped) = vocabulary_sets_in(&ctx, "component.tokenizer", &empty);
    assert_eq!(names(&sets), ["phi-3"]);
    assert_eq!(skipped.len(), 1);
    assert!(
        skipped[0].contains(&format!("llama-spm (component.tokenizer): not found in {}", empty.display())),
        "{skipped:?}"
    );

    let shared = crate::shared().join("tokenizers");
    let (sets, skipped) = vocabulary_sets_in(&ctx, "component.tokenizer_bytelevel", &shared);
    assert_eq!((names(&sets), skipped.len()), (vec!["gpt-2".to_string(), "llama-bpe".into(), "qwen2".into()], 0));
    assert!(sets[0].dir.starts_with(&shared), "found in the directory first: {}", sets[0].dir.display());
    let (sets, skipped) = vocabulary_sets_in(&ctx, "component.tokenizer", &shared);
    assert_eq!((names(&sets), skipped.len()), (vec!["llama-spm".to_string(), "phi-3".into()], 0));
}

/// Stand-ins for the clients' programs (`claude`, `codex`) in `home/clients`: doctor checks that
/// the client is installed, on the PATH.
fn client_programs(home: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let dir = home.join("clients");
    std::fs::create_dir_all(&dir).unwrap();
    for p in ["claude", "codex"] {
        std::fs::write(dir.join(p), "#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(dir.join(p), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
}

/// An approval of the project's `.mcp.json` server `metainfer`, as Claude Code records it when the
/// user approves it in an interactive session.
fn approve(home: &Path, project: &Path) {
    std::fs::create_dir_all(home).unwrap();
    let v = serde_json::json!({"projects": {project.display().to_string(): {"enabledMcpjsonServers": ["metainfer"]}}});
    std::fs::write(home.join(".claude.json"), v.to_string()).unwrap();
}

/// `doctor` as a user whose HOME is `home` runs it; `path` replaces PATH, else the clients'
/// programs (stand-ins in `home/clients`, see [`client_programs`]) come first on this PATH.
fn doctor(project: &Path, home: &Path, client: &str, path: Option<&str>) -> (i32, String) {
    let mut c = Command::new(crate::bin());
    c.args(["doctor", "--client", client, "--dir"])
        .arg(project)
        .env("HOME", home)
        .env("CODEX_HOME", home.join("codex"));
    match path {
        Some(p) => c.env("PATH", p),
        None => {
            let inherited = std::env::var_os("PATH").unwrap();
            let paths = std::iter::once(home.join("clients")).chain(std::env::split_paths(&inherited));
            c.env("PATH", std::env::join_paths(paths).unwrap())
        }
    };
    let out = c.output().unwrap();
    (out.status.code().unwrap_or(-1), format!("{}{}", text(&out.stdout), text(&out.stderr)))
}

/// `doctor` on a project registered for Claude Code (and Codex) passes every check, showing the
/// entry, the binary's version, the directories, cargo and the server's tools; each broken setup
/// fails the check it breaks and says what to do: not yet approved, cargo missing from the PATH the
/// client passes, a binary path that no longer exists, a model directory that is gone (or, for a
/// user other than root, unreadable).
#[test]
fn doctor_passes_on_a_registered_project_and_names_the_fix_on_each_broken_setup() {
    let t = tempfile::tempdir().unwrap();
    let project = t.path().join("proj");
    let models = t.path().join("models");
    let home = t.path().join("home");
    std::fs::create_dir_all(&project).unwrap();
    std::fs::create_dir_all(&models).unwrap();
    let project = project.canonicalize().unwrap();
    let register = |client: &str| {
        let out = Command::new(crate::bin())
            .args(["register", "--client", client, "--dir"])
            .arg(&project)
            .arg("--model-dir")
            .arg(&models)
            .env("HOME", &home)
            .env("CODEX_HOME", home.join("codex"))
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
    };
    register("claude");
    register("codex");
    let exe = crate::bin().canonicalize().unwrap();

    // Claude Code not installed: the client check says how to install it; never having run, it
    // has approved nothing (and no `claude mcp list` output is made up).
    std::fs::remove_file(home.join(".claude.json")).ok();
    let (code, out) = doctor(&project, &home, "claude", None);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("FAIL client     `claude` is not on this shell's PATH")
            && out.contains("npm install -g @anthropic-ai/claude-code"),
        "{out}"
    );
    assert!(out.contains("FAIL approval") && out.contains("has approved nothing") && !out.contains("Pending"), "{out}");
    client_programs(&home);

    // Registered but not approved yet: the one failing check says how to approve.
    std::fs::write(home.join(".claude.json"), "{\"projects\": {}}").unwrap();
    let (code, out) = doctor(&project, &home, "claude", None);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("ok   client     `claude` at"), "{out}");
    assert!(out.contains("FAIL approval") && out.contains("Pending approval"), "{out}");
    assert!(out.contains("fix: start `claude` in"), "{out}");

    approve(&home, &project);
    let (code, out) = doctor(&project, &home, "claude", None);
    assert_eq!(code, 0, "{out}");
    let tools = format!("with {} tools (", tool_count());
    for want in [
        format!("ok   config     entry `metainfer`: {} serve --workspace .", exe.display()),
        "ok   approval".to_string(),
        format!("ok   binary     {} runs: metainfer {}", exe.display(), env!("CARGO_PKG_VERSION")),
        format!("ok   workspace  . = {}: a readable directory", project.display()),
        format!("ok   model-dir  {}", models.canonicalize().unwrap().display()),
        "ok   cargo      cargo ".to_string(),
        "ok   server     started as the client starts it".to_string(),
        tools.clone(),
        "every check passed".to_string(),
    ] {
        assert!(out.contains(&want), "{want:?} not in:\n{out}");
    }
    let (code, out) = doctor(&project, &home, "codex", None);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("the environment Codex passes (the entry's env_vars and env only)") && out.contains(&tools),
        "{out}"
    );

    // cargo missing from the PATH the client passes.
    let empty = t.path().join("empty-bin");
    std::fs::create_dir_all(&empty).unwrap();
    let (code, out) = doctor(&project, &home, "claude", Some(empty.to_str().unwrap()));
    assert_eq!(code, 1, "{out}");
    assert!(out.contains(&format!("FAIL cargo      cargo is not on the PATH of the environment Claude Code passes (this shell's, plus the entry's env): PATH={}", empty.display())), "{out}");
    assert!(
        out.contains("fix: install Rust (rustup) or put cargo's directory (usually ~/.cargo/bin) on the PATH"),
        "{out}"
    );

    // The entry's binary moved away.
    let mcp = project.join(".mcp.json");
    let original = std::fs::read_to_string(&mcp).unwrap();
    let gone = t.path().join("moved/metainfer");
    std::fs::write(&mcp, original.replace(&exe.display().to_string(), &gone.display().to_string())).unwrap();
    let (code, out) = doctor(&project, &home, "claude", None);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains(&format!("FAIL binary     the entry's command `{}` does not exist", gone.display())), "{out}");
    assert!(out.contains("fix: run `metainfer register --client claude --dir") && out.contains("--replace"), "{out}");
    std::fs::write(&mcp, &original).unwrap();

    // The model directory is unreadable (a user other than root), then gone.
    if unsafe { libc::geteuid() } != 0 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&models, std::fs::Permissions::from_mode(0o000)).unwrap();
        let (code, out) = doctor(&project, &home, "claude", None);
        std::fs::set_permissions(&models, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(code, 1, "{out}");
        assert!(out.contains("FAIL model-dir") && out.contains("fix: make it readable"), "{out}");
    }
    std::fs::remove_dir(&models).unwrap();
    let (code, out) = doctor(&project, &home, "claude", None);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "FAIL model-dir  model-dir `{}` = {} does not exist",
            models.display(),
            models.display()
        )),
        "{out}"
    );
    assert!(out.contains("fix: create it, or register the directory that exists"), "{out}");
    assert!(!out.contains("ok   server") && !out.contains("FAIL server"), "no server started on a broken setup: {out}");
}
