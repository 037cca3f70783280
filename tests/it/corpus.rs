//! The adversarial corpus, made at test time (no hostile file is committed):
//! - hostile path arguments (traversal, absolute, symlink chains and loops, a directory swapped for
//!   a symlink during the calls, NUL, unicode, over-long names, FIFOs, devices) sent to every
//!   path-taking tool of a real server over MCP (`serve --workspace`), with a canary tree outside
//!   the workspace watched by inotify: no open, read, write, create or delete in it, its contents
//!   unchanged, and its secret text and hidden file name in no reply; and bundle directories
//!   (`write_bundle`, `from_bundle`) written and read back by a gate the same way;
//! - malformed inputs (config.json, safetensors headers, tokenizer.json, metainfer.toml, Cargo.toml,
//!   contract files, ledger imports) given to the CLI (exit 2, a message naming the file, no panic,
//!   each under a short time limit) or, for the files only a gate run reads (safetensors,
//!   tokenizer.json), to the library functions the gates call (an error naming the file);
//! - engines that try each escape: each stopped by check_rules with its rule id (the sandbox's
//!   denials of the same escapes at build and run time are `sandbox::`'s tests).
//!
//! Each part prints its counts.

use std::collections::BTreeSet;
use std::io::Write;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;

/// Text that exists only in the canary's files.
const SECRET: &str = "CANARY-SECRET-5d1e0b7c";
/// A file name that exists only in the canary and no path argument names.
const HIDDEN: &str = "hidden-9c2b41.txt";

/// inotify on every directory of a tree: counts every open, read, write, create, delete, move or
/// attribute change below it (by any process).
struct Watch {
    fd: i32,
    dirs: std::collections::HashMap<i32, PathBuf>,
}

impl Watch {
    fn new(root: &Path) -> Watch {
        // SAFETY: plain syscalls on a descriptor this struct owns; paths are NUL-terminated copies.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        assert!(fd >= 0, "inotify_init1");
        let mask = libc::IN_OPEN
            | libc::IN_ACCESS
            | libc::IN_MODIFY
            | libc::IN_CREATE
            | libc::IN_DELETE
            | libc::IN_MOVED_FROM
            | libc::IN_MOVED_TO
            | libc::IN_ATTRIB
            | libc::IN_CLOSE_WRITE;
        let mut dirs = std::collections::HashMap::new();
        for e in walkdir::WalkDir::new(root).into_iter().filter_map(|e| e.ok()).filter(|e| e.file_type().is_dir()) {
            let c = std::ffi::CString::new(e.path().as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: as above.
            let wd = unsafe { libc::inotify_add_watch(fd, c.as_ptr(), mask) };
            assert!(wd >= 0, "inotify_add_watch");
            dirs.insert(wd, e.path().to_path_buf());
        }
        let w = Watch { fd, dirs };
        // The walk above opened the directories it watched: not an access by the server.
        w.events();
        w
    }

    /// Events since the last call: (path, mask).
    fn events(&self) -> Vec<(PathBuf, u32)> {
        let mut buf = vec![0u8; 1 << 16];
        let mut n = Vec::new();
        loop {
            // SAFETY: reading into a buffer of the stated length.
            let got = unsafe { libc::read(self.fd, buf.as_mut_ptr().cast(), buf.len()) };
            if got <= 0 {
                return n;
            }
            let mut off = 0;
            while off < got as usize {
                // SAFETY: the kernel writes whole inotify_event records.
                let ev = unsafe { &*(buf.as_ptr().add(off) as *const libc::inotify_event) };
                let name_at = off + std::mem::size_of::<libc::inotify_event>();
                let name = &buf[name_at..name_at + ev.len as usize];
                let name = String::from_utf8_lossy(name).trim_end_matches('\0').to_string();
                n.push((self.dirs.get(&ev.wd).cloned().unwrap_or_default().join(name), ev.mask));
                off += std::mem::size_of::<libc::inotify_event>() + ev.len as usize;
            }
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        // SAFETY: closing the descriptor this struct owns.
        unsafe { libc::close(self.fd) };
    }
}

/// Every file of a tree with its contents.
fn snapshot(root: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    walkdir::WalkDir::new(root)
        .sort_by_file_name()
        .into_iter()
        .filter_map(|e| e.ok())
        .map(|e| {
            (e.path().to_path_buf(), if e.file_type().is_file() { std::fs::read(e.path()).unwrap() } else { vec![] })
        })
        .collect()
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", p.display());
}

/// The canary: a model directory and an engine crate outside the workspace, holding [`SECRET`].
fn canary(dir: &Path) {
    std::fs::create_dir_all(dir.join("model")).unwrap();
    std::fs::create_dir_all(dir.join("eng/src")).unwrap();
    std::fs::write(dir.join(HIDDEN), SECRET).unwrap();
    std::fs::write(dir.join("model/config.json"), format!("{{\"model_type\": \"{SECRET}\"}}")).unwrap();
    std::fs::write(
        dir.join("eng/Cargo.toml"),
        format!("# {SECRET}\n[package]\nname = \"canary\"\nversion = \"0.1.0\"\nedition = \"2024\"\n\n[workspace]\n"),
    )
    .unwrap();
    std::fs::write(dir.join("eng/src/lib.rs"), format!("//! {SECRET}\n")).unwrap();
    std::fs::write(dir.join("eng/metainfer.toml"), format!("family = \"{SECRET}\"\n")).unwrap();
}

/// The workspace's furniture: plain folders, links out of it by every route, chains, loops, a
/// FIFO, a device link, and the folder the swapper replaces by a link now and then.
fn furnish(ws: &Path, outside: &Path) {
    std::fs::create_dir_all(ws.join("a/b/c")).unwrap();
    std::fs::create_dir_all(ws.join("swap")).unwrap();
    std::fs::create_dir_all(ws.join("eng/src")).unwrap();
    std::fs::write(ws.join("eng/Cargo.toml"), "[package]\nname = \"x\"\nversion = \"0.1.0\"\n").unwrap();
    symlink(outside, ws.join("abs")).unwrap();
    symlink("../outside", ws.join("rel")).unwrap();
    symlink("../../../outside", ws.join("a/b/up")).unwrap();
    symlink("chain2", ws.join("chain1")).unwrap();
    symlink("chain3", ws.join("chain2")).unwrap();
    symlink(outside, ws.join("chain3")).unwrap();
    symlink("loop2", ws.join("loop1")).unwrap();
    symlink("loop1", ws.join("loop2")).unwrap();
    symlink("self", ws.join("self")).unwrap();
    symlink("nowhere", ws.join("dangling")).unwrap();
    symlink("/dev/zero", ws.join("zero")).unwrap();
    symlink("/proc/self/root", ws.join("procroot")).unwrap();
    symlink(outside.join("eng/src"), ws.join("eng/src/linked")).unwrap();
    symlink(outside.join("model/config.json"), ws.join("a/config.json")).unwrap();
    // A model inside the folder the swapper swaps: resolved while it is a folder, then read (the
    // link leads to the canary's model, whose config.json holds the secret).
    std::fs::create_dir_all(ws.join("swap/model")).unwrap();
    std::fs::copy(crate::babyllama().join("config.json"), ws.join("swap/model/config.json")).unwrap();
    std::fs::copy(crate::babyllama().join("tokenizer.json"), ws.join("swap/model/tokenizer.json")).unwrap();
    mkfifo(&ws.join("fifo"));
    mkfifo(&ws.join("a/b/fifo"));
}

/// The generated path arguments.
fn paths(ws: &Path, outside: &Path) -> Vec<String> {
    let o = outside.display().to_string();
    let w = ws.display().to_string();
    let heads: Vec<String> = vec![
        o.clone(),
        format!("{o}/eng"),
        format!("{o}/model"),
        format!("{w}/../outside"),
        format!("{w}/a/../../outside"),
        format!("{w}/./abs"),
        format!("/proc/self/root{o}"),
        format!("/proc/self/cwd/../outside"),
        "/".into(),
        "/etc".into(),
        "/dev/zero".into(),
        "/dev/null".into(),
        "/proc/self/fd/0".into(),
        "/proc/1/root".into(),
        "~".into(),
        "$HOME".into(),
        "abs".into(),
        "rel".into(),
        "a/b/up".into(),
        "chain1".into(),
        "loop1".into(),
        "self".into(),
        "dangling".into(),
        "zero".into(),
        "procroot".into(),
        "fifo".into(),
        "a/b/fifo".into(),
        "a/config.json".into(),
        "eng/src/linked".into(),
        "swap".into(),
        "swap/../swap".into(),
        "swap/model".into(),
        "swap/model/.".into(),
        "swap/../swap/model".into(),
        "".into(),
        ".".into(),
        "..".into(),
        "a/./b/../../..".into(),
        "a//b///c/../../../../outside".into(),
        "nul\0byte".into(),
        "a/\0/../../outside".into(),
        "é/../../outside".into(),
        "\u{202e}edistuo/..".into(),
        "\u{ff0e}\u{ff0e}/outside".into(),
        "a\\..\\..\\outside".into(),
        "x".repeat(300),
        format!("a/{}", "y".repeat(5000)),
        "a/".repeat(2100),
        format!("{}outside", "../".repeat(40)),
        "file:///etc/passwd".into(),
        " ../outside".into(),
        "../outside ".into(),
        "-rf".into(),
    ];
    let mut out = Vec::new();
    for h in &heads {
        for tail in [
            "",
            "/",
            "/eng",
            "/model",
            "/config.json",
            "/eng/src/lib.rs",
            "/x/y",
            "/..",
            "/../..",
            "/.",
            "/loop1",
            "/fifo",
            "/abs",
            "/rel/eng",
            "/chain1/model",
            "/../../outside",
            "/a/../../..",
            "/\0",
            "/\u{e9}",
            "/zero",
            "/procroot/tmp",
        ] {
            out.push(format!("{h}{tail}"));
        }
    }
    for d in 1..=12 {
        out.push(format!("{}outside/eng", "../".repeat(d)));
        out.push(format!("a/{}outside/model", "../".repeat(d)));
        out.push(format!("a/b/c/{}outside", "../".repeat(d)));
        out.push(format!("swap/{}outside", "../".repeat(d)));
    }
    out.sort();
    out.dedup();
    out
}

/// Swaps `ws/swap` for a link to `outside` at random moments until `stop`.
fn swapper(ws: PathBuf, outside: PathBuf, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let (sub, aside) = (ws.join("swap"), ws.join("swap.aside"));
        let (mut swaps, mut rng) = (0, 0x2545_f491_4f6c_dd1d_u64);
        while !stop.load(Ordering::Relaxed) {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            std::thread::sleep(Duration::from_micros((rng >> 33) % 2000));
            if std::fs::rename(&sub, &aside).is_ok() {
                // A call may have created `sub` meanwhile (resolving a missing parent by name).
                let linked = symlink(&outside, &sub).is_ok();
                std::thread::sleep(Duration::from_micros((rng >> 40) % 1000));
                if linked {
                    std::fs::remove_file(&sub).unwrap();
                }
                // A call may have created `sub` meanwhile, and may still be writing into it:
                // remove it until the original can go back.
                let mut tries = 0;
                while std::fs::rename(&aside, &sub).is_err() {
                    let _ = std::fs::remove_dir_all(&sub);
                    tries += 1;
                    assert!(tries < 10_000, "cannot put {} back", sub.display());
                }
                swaps += 1;
            }
        }
        swaps
    })
}

/// Bundle directories (`write_bundle`, `from_bundle`) are path arguments too: written and read
/// while the swapper replaces the folder they lie in by a link to the canary, and given by every
/// route out of the workspace. A bundle is staged and moved into place through the handle of the
/// directory it was resolved beneath, and read back through the handle of the bundle directory,
/// so nothing outside is opened, created or written.
#[test]
fn bundle_paths_reach_nothing_outside_the_workspace() {
    use metainfer::ops::kernel_test::{KernelTestRequest, kernel_test};
    let t = tempfile::tempdir().unwrap();
    let (ws, outside) = (t.path().join("ws"), t.path().join("outside"));
    canary(&outside);
    furnish(&ws, &outside);
    crate::Engine::Plain.copy_to(&ws.join("engine"));
    let mut ctx = crate::ctx(t.path());
    ctx.workspace = Some(ws.clone());
    let req = |write: Option<&str>, read: Option<&str>| KernelTestRequest {
        engine: "engine".into(),
        kernels: vec!["kernel.rms_norm".into()],
        seed: Some(5),
        write_bundle: write.map(String::from),
        from_bundle: read.map(String::from),
        ..Default::default()
    };
    let budget = crate::budget();
    // The harness built once before the watch starts.
    kernel_test(&ctx, &req(Some("warm"), None), &budget).unwrap();
    let before = snapshot(&outside);
    let watch = Watch::new(&outside);
    let stop = Arc::new(AtomicBool::new(false));
    let swaps = swapper(ws.clone(), outside.clone(), stop.clone());
    let o = outside.display().to_string();
    let mut hostile: Vec<String> = ["abs", "rel", "chain1", "a/b/up", "procroot", "dangling", "loop1", "self"]
        .iter()
        .map(|h| format!("{h}/bundle"))
        .collect();
    hostile.extend([format!("{o}/bundle"), format!("{}/../outside/bundle", ws.display()), "../outside/bundle".into()]);
    hostile.extend([format!("/proc/self/root{o}/bundle"), "a/config.json/bundle".into(), "fifo".into(), "zero".into()]);
    let (mut written, mut refused, mut accesses) = (0, 0, Vec::<String>::new());
    let mut calls: Vec<(Option<String>, Option<String>)> = Vec::new();
    for i in 0..16 {
        calls.push((Some(format!("swap/b{i}")), None));
        calls.push((None, Some(format!("swap/b{i}"))));
    }
    for h in &hostile {
        calls.push((Some(h.clone()), None));
        calls.push((None, Some(h.trim_end_matches("/bundle").to_string())));
    }
    calls.push((None, Some("warm".into())));
    for (w, r) in &calls {
        match kernel_test(&ctx, &req(w.as_deref(), r.as_deref()), &budget) {
            Ok(_) => written += 1,
            Err(e) => {
                refused += 1;
                assert!(
                    !e.message.contains(SECRET) && !e.message.contains("/proc/self/fd"),
                    "{w:?} {r:?}: {}",
                    e.message
                );
            }
        }
        for (path, mask) in watch.events() {
            accesses.push(format!("write {w:?} read {r:?}: {} mask {mask:#x}", path.display()));
        }
    }
    stop.store(true, Ordering::Relaxed);
    let swaps = swaps.join().unwrap();
    accesses.extend(watch.events().into_iter().map(|(p, m)| format!("after the calls: {} mask {m:#x}", p.display())));
    let changed = snapshot(&outside) != before;
    println!(
        "bundle paths: {} calls ({written} answered, {refused} refused), {swaps} swaps; outside: {} accesses, changed: {changed}",
        calls.len(),
        accesses.len()
    );
    assert!(accesses.is_empty(), "something opened, read or wrote the canary: {accesses:#?}");
    assert!(!changed, "the canary changed");
    assert!(swaps > 0 && written > 0, "{swaps} swaps, {written} bundles written");
    // The bundles written while the swapper ran are in the workspace, under the folder's own name.
    let held = (0..16).filter(|i| ws.join(format!("swap/b{i}/bundle.json")).is_file()).count();
    assert!(held > 0, "no bundle under ws/swap");
}

/// The text of a tool result, structured content included.
fn result_text(r: &rmcp::model::CallToolResult) -> String {
    serde_json::to_string(r).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn hostile_path_arguments_reach_nothing_outside_the_workspace() {
    let t = tempfile::tempdir().unwrap();
    let (ws, outside) = (t.path().join("ws"), t.path().join("outside"));
    canary(&outside);
    furnish(&ws, &outside);
    let paths = paths(&ws, &outside);
    let before = snapshot(&outside);
    let c = crate::mcp::connect(t.path(), Some(&ws)).await;
    let watch = Watch::new(&outside);
    let stop = Arc::new(AtomicBool::new(false));
    let swaps = swapper(ws.clone(), outside.clone(), stop.clone());
    let model = crate::babyllama().display().to_string();
    let (mut calls, mut leaks, mut refused, mut accesses) = (0usize, Vec::new(), 0usize, Vec::<String>::new());
    let started = Instant::now();
    // Engine and model arguments first; scaffold's `out` last, so that nothing it creates inside
    // the workspace is built by a gate.
    let mut plan: Vec<(&str, serde_json::Value)> = Vec::new();
    for p in &paths {
        plan.push(("plan_engine", json!({"model": p})));
        plan.push(("check_rules", json!({"engine": p})));
        plan.push(("compile_engine", json!({"engine": p})));
        plan.push(("run_kernel_test", json!({"engine": p})));
        plan.push(("verify_generation", json!({"engine": p, "model": p})));
        plan.push(("profile_engine", json!({"engine": p, "model": model})));
        plan.push(("scaffold_engine", json!({"model": p, "out": "new"})));
    }
    for p in &paths {
        plan.push(("scaffold_engine", json!({"model": model, "out": p})));
        plan.push(("scaffold_engine", json!({"model": model, "out": p, "force": true})));
    }
    for (tool, args) in plan {
        calls += 1;
        let r = tokio::time::timeout(Duration::from_secs(120), crate::mcp::call(&c, tool, args.clone()))
            .await
            .unwrap_or_else(|_| panic!("{tool} {args} did not answer within 120 s"));
        let text = result_text(&r);
        if r.is_error == Some(true) {
            refused += 1;
        }
        if text.contains(SECRET) || text.contains(HIDDEN) {
            leaks.push(format!("{tool} {args}: {}", &text[..text.len().min(300)]));
        }
        // Attributed to the call in flight (the swapper alone never opens what its link names).
        for (path, mask) in watch.events() {
            accesses.push(format!("{tool} {args}: {} mask {mask:#x}", path.display()));
        }
    }
    stop.store(true, Ordering::Relaxed);
    let swaps = swaps.join().unwrap();
    accesses.extend(
        watch.events().into_iter().map(|(path, mask)| format!("after the calls: {} mask {mask:#x}", path.display())),
    );
    let accesses_n = accesses.len();
    let changed = snapshot(&outside) != before;
    c.cancel().await.unwrap();
    println!(
        "path corpus: {} paths, {calls} calls over MCP ({refused} refused), {swaps} swaps, in {:.1} s; \
         outside the workspace: {accesses_n} accesses, {} leaks, changed: {changed}",
        paths.len(),
        started.elapsed().as_secs_f64(),
        leaks.len()
    );
    assert!(paths.len() >= 1000, "{} paths", paths.len());
    assert!(swaps > 0);
    assert!(leaks.is_empty(), "{leaks:#?}");
    assert!(accesses.is_empty(), "something opened, read or wrote the canary: {accesses:#?}");
    assert!(!changed, "the canary changed");
}

/// Run the CLI with `args` under a time limit: (exit code, stdout and stderr).
fn cli(t: &Path, args: &[&std::ffi::OsStr]) -> (Option<i32>, String) {
    let mut child = std::process::Command::new(crate::bin())
        .args(args)
        .env("METAINFER_LEDGER", t.join("l.sqlite"))
        .env("METAINFER_CACHE", crate::cache())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Drained while it runs, so that a large report cannot fill the pipe and stall the child.
    let mut out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut out, &mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
            return (status.code(), reader.join().unwrap() + &err);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("metainfer {args:?} did not finish within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Malformed files of one kind: (case name, how to make it at `path`).
type Maker = Box<dyn Fn(&Path)>;

fn bytes(b: Vec<u8>) -> Maker {
    Box::new(move |p| std::fs::write(p, &b).unwrap())
}

/// The malformed variants every kind of file gets: not a regular file, too large, not text, empty.
fn common() -> Vec<(String, Maker)> {
    vec![
        ("fifo".into(), Box::new(|p: &Path| mkfifo(p)) as Maker),
        ("dev-zero".into(), Box::new(|p: &Path| symlink("/dev/zero", p).unwrap())),
        ("dev-null".into(), Box::new(|p: &Path| symlink("/dev/null", p).unwrap())),
        ("directory".into(), Box::new(|p: &Path| std::fs::create_dir(p).unwrap())),
        ("dangling".into(), Box::new(|p: &Path| symlink("nowhere", p).unwrap())),
        ("loop".into(), Box::new(|p: &Path| symlink(p.file_name().unwrap(), p).unwrap())),
        ("empty".into(), bytes(vec![])),
        ("nul".into(), bytes(vec![0; 64])),
        ("not-utf8".into(), bytes(vec![0xff, 0xfe, 0x80, 0x81])),
        ("huge".into(), bytes(vec![b' '; 24 << 20])),
        ("bom".into(), bytes(b"\xef\xbb\xbf".to_vec())),
    ]
}

fn texts(list: &[&str]) -> Vec<(String, Maker)> {
    list.iter().enumerate().map(|(i, s)| (format!("text{i}"), bytes(s.as_bytes().to_vec()))).collect()
}

#[test]
fn malformed_inputs_are_refused_by_name_without_panic_or_hang() {
    let t = tempfile::tempdir().unwrap();
    let mut tried = 0usize;
    let mut failures = Vec::new();
    let deep = format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000));
    // CLI: config.json (plan), metainfer.toml and Cargo.toml (check-rules), contract files (ckb
    // propose), ledger imports.
    let kinds: Vec<(&str, Vec<&str>)> = vec![
        (
            "config.json",
            vec![
                "{",
                "[]",
                "null",
                "{\"model_type\": 5}",
                "{\"model_type\": \"llama\", \"hidden_size\": \"x\"}",
                "{\"model_type\": \"llama\", \"hidden_size\": -1, \"num_attention_heads\": 0}",
                "{\"model_type\": \"llama\", \"hidden_size\": 1e400}",
                "{\"model_type\": \"llama\", \"hidden_size\": 18446744073709551616}",
                "{\"model_type\": \"no-such-family\"}",
                "{\"model_type\": \"llama\", \"vocab_size\": 0, \"hidden_size\": 0, \"num_hidden_layers\": 0}",
                &deep,
            ],
        ),
        (
            "metainfer.toml",
            vec!["family = ", "family = 5", "[[[", "reference_level = \"sideways\"", "dtype = \"f99\"", "x = 1\nx = 2"],
        ),
        (
            "Cargo.toml",
            vec![
                "[package",
                "[package]\nname = 5",
                "[workspace]\nmembers = [\"*\"]\n",
                "[package]\nname = \"a\"\nversion = \"x\"\n",
            ],
        ),
        (
            "contract.toml",
            vec![
                "id = ",
                "id = \"kernel.../../../x\"\nkind = \"kernel\"\nversion = 1\nsummary = \"s\"\n",
                "id = \"kernel./../../kernels/argmax\"\nkind = \"kernel\"\nversion = 1\nsummary = \"s\"\n",
                "id = \"kernel.Ok\"\nkind = \"kernel\"\nversion = 1\nsummary = \"s\"\n",
                "id = \"kernel.a\"\nkind = \"nope\"\n",
                "[[[",
            ],
        ),
        (
            "outcomes.jsonl",
            vec!["{", "[1,2]", "{\"id\": 5}", "not json at all", "{\"id\":\"x\",\"tool\":\"run_kernel_test\"}"],
        ),
    ];
    for (file, cases) in &kinds {
        let mut all = common();
        all.extend(texts(cases));
        for (case, make) in all {
            let dir = t.path().join(format!("{file}-{case}"));
            std::fs::create_dir_all(dir.join("src")).unwrap();
            let target = dir.join(file);
            let args: Vec<std::ffi::OsString> = match *file {
                "config.json" => vec!["plan".into(), "--model".into(), dir.clone().into()],
                "metainfer.toml" | "Cargo.toml" => {
                    if *file == "metainfer.toml" {
                        std::fs::write(
                            dir.join("Cargo.toml"),
                            "[package]\nname = \"m\"\nversion = \"0.1.0\"\nedition = \"2024\"\n\n[workspace]\n",
                        )
                        .unwrap();
                    }
                    std::fs::write(dir.join("src/lib.rs"), "").unwrap();
                    vec!["check-rules".into(), "--engine".into(), dir.clone().into()]
                }
                "contract.toml" => vec!["ckb".into(), "propose".into(), target.clone().into()],
                _ => vec!["ledger".into(), "import".into(), target.clone().into()],
            };
            make(&target);
            tried += 1;
            let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
            let (code, err) = cli(t.path(), &args);
            // Refused (exit 2) naming the file; or judged (exit 1: a plan with gaps, rule findings,
            // a proposal's findings) naming what is wrong; or, for an import, nothing to import.
            let named = err.contains(file) || err.contains(&dir.display().to_string());
            let ok = match code {
                Some(2) => named,
                Some(1) => !err.trim().is_empty(),
                Some(0) => *file == "outcomes.jsonl" && err.contains("imported 0 new"),
                _ => false,
            };
            if !ok || err.contains("panicked") {
                failures.push(format!(
                    "{file} {case}: exit {code:?}: {}",
                    err.lines().take(3).collect::<Vec<_>>().join(" | ")
                ));
            }
        }
    }
    // The files only a gate run reads, through the functions the gates call.
    let mut lib_tried = 0usize;
    let st_headers: Vec<(String, Maker)> = {
        let mut v = common();
        let hdr = |len: u64, body: &[u8]| {
            let mut b = len.to_le_bytes().to_vec();
            b.extend_from_slice(body);
            b
        };
        for (i, b) in [
            vec![1, 2, 3],
            hdr(u64::MAX, b"{}"),
            hdr(1 << 40, b"{}"),
            hdr(100, b"{}"),
            hdr(2, b"[]"),
            hdr(10, b"not json!!"),
            hdr(54, b"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}"),
            hdr(56, b"{\"a\":{\"dtype\":\"F99\",\"shape\":[1],\"data_offsets\":[0,4]}}  "),
            hdr(64, b"{\"a\":{\"dtype\":\"F32\",\"shape\":[99999999999],\"data_offsets\":[0,4]}}  "),
        ]
        .into_iter()
        .enumerate()
        {
            v.push((format!("header{i}"), bytes(b)));
        }
        v
    };
    for (case, make) in st_headers {
        let dir = t.path().join(format!("st-{case}"));
        std::fs::create_dir_all(&dir).unwrap();
        make(&dir.join("model.safetensors"));
        lib_tried += 1;
        let started = Instant::now();
        let r = std::panic::catch_unwind(|| metainfer::model::read_safetensors(&dir));
        match r {
            Ok(Err(e)) if e.message.contains("model.safetensors") && started.elapsed() < Duration::from_secs(30) => {}
            Ok(Err(e)) => failures.push(format!("safetensors {case}: {}", e.message)),
            Ok(Ok(_)) => failures.push(format!("safetensors {case}: accepted")),
            Err(_) => failures.push(format!("safetensors {case}: panicked")),
        }
    }
    let mut toks = common();
    toks.extend(texts(&["{", "[]", "{\"model\": 5}", "{\"model\": {\"type\": \"BPE\", \"vocab\": 3}}", &deep]));
    for (case, make) in toks {
        let dir = t.path().join(format!("tok-{case}"));
        std::fs::create_dir_all(&dir).unwrap();
        make(&dir.join("tokenizer.json"));
        lib_tried += 1;
        match std::panic::catch_unwind(|| metainfer::model::hf_tokenizer(&dir)) {
            Ok(Err(e)) if e.message.contains("tokenizer.json") => {}
            Ok(Err(e)) => failures.push(format!("tokenizer {case}: {}", e.message)),
            Ok(Ok(_)) => failures.push(format!("tokenizer {case}: accepted")),
            Err(_) => failures.push(format!("tokenizer {case}: panicked")),
        }
    }
    println!(
        "input corpus: {} inputs ({tried} through the CLI, {lib_tried} through the gates' readers), {} not refused by name",
        tried + lib_tried,
        failures.len()
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

/// An engine that tries one escape, and the rule that must stop it.
struct Escape {
    name: &'static str,
    rule: &'static str,
    files: Vec<(&'static str, String)>,
    link_src_to: Option<PathBuf>,
}

#[test]
fn escaping_engines_are_stopped_by_their_rule() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let secret = t.path().join("secret.txt");
    std::fs::write(&secret, SECRET).unwrap();
    let pad = "// padding\n".repeat(200_000);
    let escapes = [
        Escape {
            name: "include_bytes of an outside file",
            rule: "path-outside",
            files: vec![("src/lib.rs", format!("pub static S: &[u8] = include_bytes!({:?});\n", secret.display()))],
            link_src_to: None,
        },
        Escape {
            name: "padded include_bytes",
            rule: "file-too-large",
            files: vec![("src/lib.rs", format!("{pad}pub static S: &[u8] = include_bytes!(\"../../secret.txt\");\n"))],
            link_src_to: None,
        },
        Escape {
            name: "padded build script",
            rule: "file-too-large",
            files: vec![("build.rs", format!("{pad}fn main() {{}}\n"))],
            link_src_to: None,
        },
        Escape {
            name: "ledger path from the parent's environ",
            rule: "build-script",
            files: vec![(
                "build.rs",
                "fn main() { let pid = std::os::unix::process::parent_id(); let _ = std::fs::read(format!(\"/proc/{pid}/environ\")); }\n".into(),
            )],
            link_src_to: None,
        },
        Escape {
            name: "write outside OUT_DIR",
            rule: "build-script",
            files: vec![("build.rs", "fn main() { std::fs::write(\"/tmp/escaped\", \"x\").unwrap(); }\n".into())],
            link_src_to: None,
        },
        Escape {
            name: "TCP connection",
            rule: "build-script",
            files: vec![("build.rs", "fn main() { let _ = std::net::TcpStream::connect(\"127.0.0.1:9\"); }\n".into())],
            link_src_to: None,
        },
        Escape { name: "symlinked src/", rule: "symlink-outside", files: vec![], link_src_to: Some(t.path().join("elsewhere")) },
    ];
    std::fs::create_dir_all(t.path().join("elsewhere")).unwrap();
    std::fs::write(t.path().join("elsewhere/lib.rs"), "").unwrap();
    let mut stopped = 0;
    for (i, e) in escapes.iter().enumerate() {
        let d = t.path().join(format!("e{i}"));
        crate::Engine::Plain.copy_to(&d);
        for (rel, text) in &e.files {
            if *rel == "src/lib.rs" {
                let mut f = std::fs::OpenOptions::new().append(true).open(d.join(rel)).unwrap();
                f.write_all(text.as_bytes()).unwrap();
            } else {
                std::fs::write(d.join(rel), text).unwrap();
            }
        }
        if let Some(to) = &e.link_src_to {
            std::fs::remove_dir_all(d.join("src")).unwrap();
            symlink(to, d.join("src")).unwrap();
        }
        let r = metainfer::ops::rules::check_rules(
            &ctx,
            &metainfer::ops::rules::RulesRequest { engine: d.display().to_string() },
            &metainfer::harness::Budget::secs(300),
        );
        let text = match &r {
            Ok(r) => metainfer::ops::Report::text(r),
            Err(e) => e.message.clone(),
        };
        assert!(!text.contains(SECRET), "{}: the report quotes the outside file", e.name);
        match r {
            Ok(r) if !r.passed && r.findings.iter().any(|f| f.rule == e.rule) => stopped += 1,
            // A crate whose sources are all behind a link out is not a crate the server can read:
            // refused, naming the rule.
            Err(err) if err.message.contains(e.rule) => stopped += 1,
            other => panic!("{}: not stopped by {}: {other:?}", e.name, e.rule),
        }
    }
    let seen: BTreeSet<&str> = escapes.iter().map(|e| e.rule).collect();
    println!(
        "escape corpus: {} escaping engines, {stopped} stopped by their rule ({seen:?}), 0 escapes",
        escapes.len()
    );
}

/// A model directory inside the workspace whose config.json or model.safetensors is a link to a
/// file outside it is refused by name, and nothing of the outside file reaches the answer.
#[test]
fn a_model_file_linked_outside_the_workspace_is_refused_by_name() {
    use metainfer::ops::plan::{PlanRequest, plan};
    let t = tempfile::tempdir().unwrap();
    let (ws, outside) = (t.path().join("ws"), t.path().join("outside"));
    std::fs::create_dir_all(&outside).unwrap();
    let mut ctx = crate::ctx(t.path());
    ctx.workspace = Some(ws.clone());
    for linked in ["config.json", "model.safetensors"] {
        let m = ws.join(format!("model-{linked}"));
        std::fs::create_dir_all(&m).unwrap();
        for f in ["config.json", "model.safetensors", "tokenizer.json"] {
            let src = crate::babyllama().join(f);
            if f == linked {
                // The outside copy carries a marker that must never appear in an answer.
                let out = outside.join(f);
                let mut bytes = std::fs::read(&src).unwrap();
                if f == "config.json" {
                    bytes =
                        String::from_utf8(bytes).unwrap().replacen('{', "{\"secret_marker_7731\": 1,", 1).into_bytes();
                }
                std::fs::write(&out, bytes).unwrap();
                std::os::unix::fs::symlink(&out, m.join(f)).unwrap();
            } else {
                std::fs::copy(&src, m.join(f)).unwrap();
            }
        }
        let req = PlanRequest {
            model: format!("model-{linked}"),
            target: "cpu".into(),
            dtype: "f32".into(),
            ..Default::default()
        };
        let e = plan(&ctx, &req).unwrap_err();
        assert!(e.message.contains(linked) && e.message.contains("leads outside"), "{linked}: {}", e.message);
        assert!(!e.message.contains("secret_marker_7731"), "{}", e.message);
    }
}
