//! The sandbox around agent-written code: a build script and a harness process each try to read the
//! ledger and its key, write outside their scratch, open a TCP connection to a listener this test
//! holds on loopback, and read the server's environment from /proc; each attempt must be denied
//! by the kernel (asserted by the error the attempt got, not by a failed build).

use std::io::Read;
use std::net::TcpListener;
use std::path::Path;

use crate::budget;
use metainfer::harness::sandbox;
use metainfer::ledger::Ledger;
use metainfer::ops::kernel_test::{KernelTestRequest, kernel_test};

/// Rust code (a block) that tries every escape and collects what happened in `report: String`.
fn attempts(ledger: &Path, outside: &Path, addr: &str) -> String {
    let key = metainfer::ledger::key_path(ledger);
    format!(
        r#"{{
    let mut report = String::new();
    let mut note = |what: &str, r: Result<String, std::io::Error>| match r {{
        Ok(s) => report += &format!("{{what}}: ESCAPED {{s}}; "),
        Err(e) => report += &format!("{{what}}: DENIED {{e}}; "),
    }};
    note("ledger", std::fs::read({ledger:?}).map(|b| format!("read {{}} bytes", b.len())));
    note("key", std::fs::read_to_string({key:?}));
    note("write", std::fs::write({outside:?}, b"escaped").map(|_| "wrote".to_string()));
    note("tcp", std::net::TcpStream::connect({addr:?}).map(|_| "connected".to_string()));
    let parent = std::os::unix::process::parent_id();
    note("environ", std::fs::read(format!("/proc/{{parent}}/environ")).map(|b| format!("read {{}} bytes", b.len())));
    let tmp = std::env::temp_dir().join("own-scratch");
    note("tmp", std::fs::write(&tmp, b"ok").map(|_| "wrote".to_string()));
    report
}}"#,
        ledger = ledger.display().to_string(),
        key = key.display().to_string(),
        outside = outside.display().to_string(),
    )
}

/// The denials every attempt must get: EACCES from Landlock (files, /proc) or the seccomp filter
/// (sockets); the scratch directory stays writable.
fn assert_denied(report: &str, outside: &Path, listener: &TcpListener) {
    for what in ["ledger", "key", "write", "tcp", "environ"] {
        assert!(
            report.contains(&format!("{what}: DENIED Permission denied (os error 13)")),
            "{what} was not denied by the sandbox: {report}"
        );
    }
    assert!(report.contains("tmp: ESCAPED wrote"), "the process's own scratch must stay writable: {report}");
    assert!(!outside.exists(), "a file was written outside the sandbox");
    listener.set_nonblocking(true).unwrap();
    assert!(listener.accept().is_err(), "the loopback listener received a connection");
}

/// A ledger with a recorded outcome (so the ledger and its key exist) in `dir`, and a loopback
/// listener.
fn setup(dir: &Path) -> (metainfer::ops::Ctx, TcpListener) {
    let ctx = crate::ctx(dir);
    let l = Ledger::open(&ctx.ledger).unwrap();
    assert!(l.count().unwrap() == 0);
    assert!(metainfer::ledger::key_path(&ctx.ledger).is_file());
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    (ctx, listener)
}

#[test]
fn a_build_script_cannot_read_the_ledger_write_outside_or_connect() {
    let t = tempfile::tempdir().unwrap();
    let (ctx, listener) = setup(t.path());
    let outside = t.path().join("outside.txt");
    let eng = t.path().join("eng");
    std::fs::create_dir_all(eng.join("src")).unwrap();
    std::fs::write(
        eng.join("Cargo.toml"),
        "[package]\nname = \"sandboxed-build\"\nversion = \"0.1.0\"\nedition = \"2021\"\nbuild = \"build.rs\"\n\n[workspace]\n",
    )
    .unwrap();
    std::fs::write(eng.join("src/lib.rs"), "").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::fs::write(
        eng.join("build.rs"),
        format!(
            "fn main() {{\n    let report = {};\n    panic!(\"REPORT {{report}} END\");\n}}\n",
            attempts(&ctx.ledger, &outside, &addr)
        ),
    )
    .unwrap();
    let engine = ctx.workshop.engine(&eng).unwrap();
    let build = ctx.workshop.cargo_build(&engine.build_dir.join("Cargo.toml"), &budget()).unwrap();
    assert!(!build.ok, "the build script panics with its report");
    if !sandbox::status().enforced {
        assert!(!build.run.sandboxed && !ctx.workshop.sandboxed());
        eprintln!("no sandbox on this kernel: {}", sandbox::status().summary);
        return;
    }
    assert!(build.run.sandboxed);
    let report = build
        .run
        .stderr
        .split("REPORT ")
        .nth(1)
        .and_then(|r| r.split(" END").next())
        .unwrap_or_else(|| panic!("no report from the build script in cargo's output: {}", build.run.stderr));
    assert_denied(report, &outside, &listener);
    // The build script ran with the reduced environment: no pointer to the server's state.
    assert!(!build.run.stderr.contains("METAINFER_LEDGER"));
}

#[test]
fn a_harness_process_cannot_read_the_ledger_write_outside_or_connect() {
    let t = tempfile::tempdir().unwrap();
    let (ctx, listener) = setup(t.path());
    let outside = t.path().join("outside.txt");
    let eng = t.path().join("eng");
    crate::copy_example(&eng);
    let addr = listener.local_addr().unwrap().to_string();
    crate::inject(
        &eng,
        "src/kernels.rs",
        "    assert!(!x.is_empty(), \"argmax: empty input\");",
        &format!(
            "    assert!(!x.is_empty(), \"argmax: empty input\");\n    let report = {};\n    panic!(\"REPORT {{report}} END\");",
            attempts(&ctx.ledger, &outside, &addr)
        ),
    );
    let req = KernelTestRequest {
        engine: eng.display().to_string(),
        kernels: vec!["kernel.argmax".into()],
        seed: Some(7),
        ..Default::default()
    };
    let k = kernel_test(&ctx, &req, &budget()).unwrap();
    let argmax = k.kernels.iter().find(|r| r.kernel == "kernel.argmax").expect("argmax was tested");
    assert!(!argmax.passed);
    if !sandbox::status().enforced {
        eprintln!("no sandbox on this kernel: {}", sandbox::status().summary);
        return;
    }
    let report = argmax
        .error
        .split("REPORT ")
        .nth(1)
        .and_then(|r| r.split(" END").next())
        .unwrap_or_else(|| panic!("no report from the harness process: {}", argmax.error));
    assert_denied(report, &outside, &listener);
}

#[test]
fn the_start_log_says_whether_the_sandbox_is_enforced() {
    // `metainfer serve` logs the sandbox status at start; with --require-sandbox on a kernel
    // without it, it refuses to start.
    let t = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(crate::bin())
        .args(["--ledger"])
        .arg(t.path().join("l.sqlite"))
        .args(["--cache"])
        .arg(t.path().join("cache"))
        .args(["--require-sandbox", "serve"])
        .env("METAINFER_LOG", "info")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let status = child.wait().unwrap();
    let st = sandbox::status();
    if st.enforced {
        assert!(err.contains("sandbox: enforced (Landlock ABI"), "{err}");
        assert!(!err.contains("--require-sandbox:"), "{err}");
        let _ = status;
    } else {
        assert!(err.contains("--require-sandbox") && err.contains("NOT enforced"), "{err}");
        assert_eq!(status.code(), Some(2));
    }
}

/// cargo reads the `.cargo/config.toml` files above its working directory (the cache root), as it
/// does outside the sandbox: a cache placed below one still resolves an engine's dependency graph
/// (before the sandbox granted them, every such call failed with "Permission denied").
#[test]
fn a_cache_below_a_cargo_config_file_still_resolves_dependencies() {
    use metainfer::ops::rules::{RulesRequest, check_rules};
    let t = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(t.path().join(".cargo")).unwrap();
    std::fs::write(t.path().join(".cargo/config.toml"), "[term]\nquiet = false\n").unwrap();
    let mut ctx = crate::ctx(t.path());
    ctx.workshop = metainfer::harness::Workshop::new(t.path().join("cache"));
    ctx.workshop.protected = ctx.protected_paths();
    let engine = t.path().join("engine");
    crate::copy_example(&engine);
    let r = check_rules(&ctx, &RulesRequest { engine: engine.display().to_string() }, &budget()).unwrap();
    assert!(r.passed && r.packages > 0, "{}", metainfer::ops::Report::text(&r));
}

/// A model in a Hugging Face cache layout inside the workspace (`snapshots/<rev>/<file>` are
/// links to `../../blobs/<file>`): verify_generation reads it, and so does the engine's harness
/// process inside the sandbox, which is granted the linked files themselves.
#[test]
fn a_hugging_face_cache_snapshot_in_the_workspace_verifies_inside_the_sandbox() {
    use metainfer::ops::verify::{VerifyRequest, verify};
    let t = tempfile::tempdir().unwrap();
    let ws = t.path().join("ws");
    let repo = ws.join("hub/models--babyllama");
    let (blobs, snap) = (repo.join("blobs"), repo.join("snapshots/0123abc"));
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::create_dir_all(&snap).unwrap();
    for e in std::fs::read_dir(crate::babyllama()).unwrap() {
        let e = e.unwrap();
        let name = e.file_name();
        let blob = format!("{:016x}", metainfer::util::fnv1a(&name.to_string_lossy()));
        std::fs::copy(e.path(), blobs.join(&blob)).unwrap();
        std::os::unix::fs::symlink(Path::new("../../blobs").join(&blob), snap.join(&name)).unwrap();
    }
    crate::Engine::Plain.copy_to(&ws.join("engine"));
    let mut ctx = crate::ctx(t.path());
    ctx.workspace = Some(ws.clone());
    // Phase order: kernel tests first, on the same sources.
    let kt = KernelTestRequest { engine: "engine".into(), kernels: vec![], ..Default::default() };
    assert!(kernel_test(&ctx, &kt, &budget()).unwrap().passed);
    let req = VerifyRequest {
        engine: "engine".into(),
        model: "hub/models--babyllama/snapshots/0123abc".into(),
        prompts: vec!["Once upon a time".into()],
        max_new_tokens: Some(4),
        ..Default::default()
    };
    let r = verify(&ctx, &req, &budget()).unwrap();
    assert!(r.passed, "{}", metainfer::ops::Report::text(&r));
    assert_eq!(r.sandboxed, ctx.workshop.sandboxed());
}
