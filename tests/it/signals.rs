//! Nothing left behind: SIGTERM, SIGINT and SIGHUP to a CLI command or to `serve` in the middle of a
//! build kill every child process group before the process exits; a failed scaffold leaves no
//! temporary crate; the one-call-per-engine lock is keyed by the resolved path; a FIFO or a device
//! where a model file should be is refused by name without blocking the server.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rmcp::ServiceExt;
use rmcp::model::CallToolRequestParams;
use rmcp::transport::{ConfigureCommandExt, TokioChildProcess};

/// Command lines of the processes that mention `marker` (this test's own excepted).
fn processes_mentioning(marker: &str) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(marker) && !cmd.contains("cargo test") && !cmd.contains("/it-") {
                out.push(cmd);
            }
        }
    }
    out
}

/// A build script that starts a daemon in a session of its own (`setsid`; its command line names
/// `marker`), out of the build's process group, then sleeps `sleep_s` seconds. It is written past
/// the static build-script rule (which refuses `std::process` in build.rs), as a hostile engine
/// would write it, so that what is tested is the sandbox's own defence: the daemon runs, and must
/// not outlive the gate.
pub(crate) fn daemon_build_script(marker: &str, sleep_s: u64) -> String {
    format!(
        "use std::os::unix::{{process as u}};
use std::{{process as q}};
use u::CommandExt;
fn main() {{
    let _ = <q::Command>::new(\"setsid\")
        .args([\"sh\", \"-c\", \"sleep 987; : {marker}-daemon\"])
        .process_group(0)
        .stdin(q::Stdio::null())
        .stdout(q::Stdio::null())
        .stderr(q::Stdio::null())
        .spawn();
    std::thread::sleep(std::time::Duration::from_secs({sleep_s}));
}}
"
    )
}

/// Wait until a process whose command line holds `text` runs.
pub(crate) fn wait_for_process(text: &str) {
    let start = Instant::now();
    while processes_mentioning(text).is_empty() {
        assert!(start.elapsed() < Duration::from_secs(240), "{text} never started");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Wait up to `within` for no process to mention `marker`.
pub(crate) fn none_left(marker: &str, within: Duration, what: &str) {
    let start = Instant::now();
    loop {
        let left = processes_mentioning(marker);
        if left.is_empty() {
            return;
        }
        assert!(start.elapsed() < within, "{what}: left running: {left:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `metainfer serve` with a compile_engine call on `engine` in flight (raw JSON-RPC); its stdin stays
/// open until the returned handle is dropped.
fn serve_compiling(ledger: &Path, cache: &Path, engine: &Path) -> (std::process::Child, std::process::ChildStdin) {
    let mut child = Command::new(crate::bin())
        .arg("--ledger")
        .arg(ledger)
        .arg("--cache")
        .arg(cache)
        .arg("serve")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let call = serde_json::json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "compile_engine", "arguments": {"engine": engine}}});
    let init = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"signals-test","version":"1"}}}"#;
    let initialized = r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;
    writeln!(stdin, "{init}\n{initialized}\n{call}").unwrap();
    stdin.flush().unwrap();
    (child, stdin)
}

/// A scaffolded engine named `marker` in `dir` whose build script starts a daemon in its own
/// session ([`daemon_build_script`]) and sleeps for two minutes.
fn sleepy_engine(dir: &Path, marker: &str) -> PathBuf {
    let engine = dir.join(marker);
    let out = Command::new(crate::bin())
        .args(["scaffold", "--name", marker, "--model"])
        .arg(crate::babyllama())
        .arg("--out")
        .arg(&engine)
        .env("METAINFER_LEDGER", dir.join("l.sqlite"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::write(engine.join("build.rs"), daemon_build_script(marker, 120)).unwrap();
    engine
}

/// Wait until the build script of `marker` runs and its daemon has started.
fn wait_for_build_script(marker: &str) {
    let start = Instant::now();
    while !processes_mentioning(&format!("{marker}-")).iter().any(|p| p.contains("build-script-build")) {
        assert!(start.elapsed() < Duration::from_secs(240), "the build script never started");
        std::thread::sleep(Duration::from_millis(100));
    }
    wait_for_process(&format!("{marker}-daemon"));
}

/// Send `sig` to `child`, wait for it to exit (with 128 + sig), and find no process of `marker`.
fn signal_and_check(mut child: std::process::Child, sig: i32, marker: &str, what: &str) {
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "{what} did not exit on signal {sig}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(128 + sig), "{what}: exit status after signal {sig}");
    // The groups were killed and their leaders reaped before the exit; what remains of their
    // processes (already-dead grandchildren being reaped by init) is gone within moments.
    let start = Instant::now();
    loop {
        let left = processes_mentioning(marker);
        if left.is_empty() {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(2), "{what}: left running after signal {sig}: {left:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn each_signal_mid_build_kills_every_child_of_a_cli_command_and_of_serve() {
    let t = tempfile::tempdir().unwrap();
    let marker = format!("sigs{}", std::process::id());
    let engine = sleepy_engine(t.path(), &marker);
    // Its own build cache, so that other tests' builds cannot hold the target directory's lock.
    let cache = t.path().join("cache");
    let ledger = t.path().join("l.sqlite");
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // A CLI command.
        let child = Command::new(crate::bin())
            .arg("--ledger")
            .arg(&ledger)
            .arg("--cache")
            .arg(&cache)
            .args(["compile", "--engine"])
            .arg(&engine)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_for_build_script(&marker);
        signal_and_check(child, sig, &marker, "compile");

        // serve, with a compile_engine call in flight (raw JSON-RPC; stdin stays open).
        let (child, stdin) = serve_compiling(&ledger, &cache, &engine);
        wait_for_build_script(&marker);
        signal_and_check(child, sig, &marker, "serve");
        drop(stdin);
    }
}

/// Regression: a process that left its group (a daemon in a session of its own, started by a build
/// script) outlived its gate, and after the server's input closed the engine's processes lived on
/// under init. Now no process of a gate survives its end: the build's normal end, its time limit,
/// and the end of the server's input with a call in flight (signals and cancellation: the tests
/// above and `client::long_call`, whose engines start the same daemon).
#[test]
fn no_process_of_a_gate_survives_its_end() {
    let t = tempfile::tempdir().unwrap();
    let marker = format!("reap{}", std::process::id());
    let engine = sleepy_engine(t.path(), &marker);
    let cache = t.path().join("cache");
    let ledger = t.path().join("l.sqlite");
    let compile = |time_limit: u64| {
        Command::new(crate::bin())
            .arg("--ledger")
            .arg(&ledger)
            .arg("--cache")
            .arg(&cache)
            .args(["--time-limit", &time_limit.to_string(), "compile", "--engine"])
            .arg(&engine)
            .output()
            .unwrap()
    };
    // The time limit: the build script still sleeps when it runs out.
    let start = Instant::now();
    let out = compile(20);
    assert!(start.elapsed() < Duration::from_secs(60), "the time limit did not hold");
    assert!(!out.status.success() || String::from_utf8_lossy(&out.stdout).contains("time limit"));
    none_left(&marker, Duration::from_secs(2), "after the time limit");

    // A normal end: the build script returns at once, its daemon still running, and the build goes on.
    std::fs::write(engine.join("build.rs"), daemon_build_script(&marker, 0)).unwrap();
    let out = compile(600);
    assert!(out.status.code().is_some(), "{}", String::from_utf8_lossy(&out.stderr));
    none_left(&marker, Duration::from_secs(2), "after a normal end");

    // The server's input ends with a call in flight.
    std::fs::write(engine.join("build.rs"), daemon_build_script(&marker, 120)).unwrap();
    let (mut child, stdin) = serve_compiling(&ledger, &cache, &engine);
    wait_for_build_script(&marker);
    drop(stdin);
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(start.elapsed() < Duration::from_secs(10), "serve did not exit at the end of its input");
        std::thread::sleep(Duration::from_millis(20));
    }
    none_left(&marker, Duration::from_secs(2), "after the server's input ended");
}

#[test]
fn a_failed_scaffold_leaves_nothing_in_the_workspace() {
    let t = tempfile::tempdir().unwrap();
    let ws = t.path().join("ws");
    std::fs::create_dir(&ws).unwrap();
    std::os::unix::fs::symlink(ws.join("loop"), ws.join("loop")).unwrap();
    let mut ctx = crate::ctx(t.path());
    ctx.workspace = Some(ws.canonicalize().unwrap());
    ctx.models = vec![crate::babyllama()];
    let listing = |d: &Path| -> Vec<String> {
        walkdir::WalkDir::new(d).into_iter().filter_map(|e| e.ok()).map(|e| e.path().display().to_string()).collect()
    };
    let before = listing(&ws);
    for out in ["x".repeat(300), "loop".into(), format!("new/deeper/{}", "y".repeat(300)), "a\0b".into()] {
        let req = metainfer::ops::scaffold::ScaffoldRequest {
            model: crate::babyllama().display().to_string(),
            out: out.clone(),
            target: "cpu".into(),
            dtype: "f32".into(),
            force: false,
            reference_level: Default::default(),
            ..Default::default()
        };
        let e = metainfer::ops::scaffold::scaffold(&ctx, &req).unwrap_err();
        assert!(!e.message.is_empty());
        assert_eq!(listing(&ws), before, "scaffold to {out:?} left something behind ({})", e.message);
    }
}

type Client = rmcp::service::RunningService<rmcp::RoleClient, ()>;

async fn serve_in(ws: &Path, ledger: &Path, cache: &Path) -> Client {
    let (ws, ledger, cache) = (ws.to_path_buf(), ledger.to_path_buf(), cache.to_path_buf());
    let transport = TokioChildProcess::new(tokio::process::Command::new(crate::bin()).configure(|cmd| {
        cmd.arg("--ledger").arg(&ledger).arg("--cache").arg(&cache).arg("serve").arg("--workspace").arg(&ws);
    }))
    .unwrap();
    ().serve(transport).await.unwrap()
}

async fn call(c: &Client, tool: &str, args: serde_json::Value) -> rmcp::model::CallToolResult {
    c.call_tool(CallToolRequestParams::new(tool.to_string()).with_arguments(args.as_object().unwrap().clone()))
        .await
        .unwrap()
}

#[tokio::test]
async fn the_engine_lock_is_keyed_by_the_resolved_path() {
    let t = tempfile::tempdir().unwrap();
    let marker = format!("lock{}", std::process::id());
    let ws = t.path().canonicalize().unwrap();
    let engine = sleepy_engine(&ws, &marker);
    let c = std::sync::Arc::new(serve_in(&ws, &ws.join("l.sqlite"), &ws.join("cache")).await);
    // The engine by its workspace-relative name...
    let c2 = c.clone();
    let m = marker.clone();
    let first = tokio::spawn(async move { call(&c2, "compile_engine", serde_json::json!({"engine": m})).await });
    tokio::task::spawn_blocking({
        let m = marker.clone();
        move || wait_for_build_script(&m)
    })
    .await
    .unwrap();
    // ...and by its absolute path, and through a link, are one engine: the second call is refused.
    // (A relative link: an absolute one is refused as leading outside, since paths resolve beneath
    // the workspace's handle.)
    std::os::unix::fs::symlink(&marker, ws.join("alias")).unwrap();
    for name in [engine.display().to_string(), "alias".to_string(), format!("./{marker}/")] {
        let r = call(&c, "run_kernel_test", serde_json::json!({"engine": name})).await;
        assert_eq!(r.is_error, Some(true), "{name}");
        let text = &r.content[0].as_text().unwrap().text;
        assert!(text.contains("busy with compile_engine"), "{name}: {text}");
    }
    first.abort();
    let _ = first.await;
    // Closing the session cancels the build in flight, which kills its processes.
    let Ok(c) = std::sync::Arc::try_unwrap(c) else { panic!("the only client handle") };
    c.cancel().await.unwrap();
}

#[tokio::test]
async fn a_fifo_or_a_device_as_a_model_file_is_refused_by_name_without_blocking() {
    let t = tempfile::tempdir().unwrap();
    let ws = t.path().canonicalize().unwrap();
    let model = ws.join("model");
    std::fs::create_dir(&model).unwrap();
    let fifo = std::ffi::CString::new(model.join("config.json").as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let c = serve_in(&ws, &ws.join("l.sqlite"), &ws.join("cache")).await;
    for _ in 0..3 {
        let r = tokio::time::timeout(
            Duration::from_secs(20),
            call(&c, "plan_engine", serde_json::json!({"model": "model", "target": "cpu", "dtype": "f32"})),
        )
        .await
        .expect("a FIFO must not block the call");
        assert_eq!(r.is_error, Some(true));
        let text = &r.content[0].as_text().unwrap().text;
        assert!(text.contains("config.json") && text.contains("FIFO"), "{text}");
    }
    let r = call(&c, "lookup_contract", serde_json::json!({"id": "kernel.rope"})).await;
    assert_eq!(r.is_error, Some(false), "the server still answers");
    c.cancel().await.unwrap();

    // /dev/zero as tokenizer.json is refused by name, not read until memory runs out.
    let dir = ws.join("tok");
    std::fs::create_dir(&dir).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.join("tokenizer.json")).unwrap();
    let e = metainfer::model::hf_tokenizer(&dir).unwrap_err();
    assert!(e.message.contains("tokenizer.json") && e.message.contains("character device"), "{}", e.message);
}
