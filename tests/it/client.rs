//! What agent clients rely on: resources, prompts, skills, stdout hygiene, exit on EOF, progress
//! notifications and cancellation that leaves no process behind.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rmcp::model::{
    CallToolRequestParams, ClientRequest, GetPromptRequestParams, ReadResourceRequestParams, Request, ResourceContents,
};
use rmcp::service::PeerRequestOptions;
use rmcp::transport::{ConfigureCommandExt, TokioChildProcess};
use rmcp::{ClientHandler, ServiceExt};

fn serve_cmd(ledger: &std::path::Path) -> tokio::process::Command {
    serve_cmd_with_cache(ledger, &crate::cache())
}

fn serve_cmd_with_cache(ledger: &std::path::Path, cache: &std::path::Path) -> tokio::process::Command {
    let (ledger, cache) = (ledger.to_path_buf(), cache.to_path_buf());
    tokio::process::Command::new(crate::bin()).configure(|cmd| {
        cmd.arg("serve").env("METAINFER_LEDGER", &ledger).env("METAINFER_CACHE", &cache);
    })
}

#[tokio::test]
async fn resources_prompts_and_skills_are_served() {
    let t = tempfile::tempdir().unwrap();
    let c = ().serve(TokioChildProcess::new(serve_cmd(&t.path().join("l.sqlite"))).unwrap()).await.unwrap();

    let resources = c.list_all_resources().await.unwrap();
    let uris: Vec<&str> = resources.iter().map(|r| r.uri.as_str()).collect();
    assert!(uris.contains(&"ckb://coverage") && uris.contains(&"ckb://contract/kernel.rope"), "{uris:?}");
    assert!(uris.contains(&"skill://generate-engine"), "{uris:?}");
    let templates = c.list_all_resource_templates().await.unwrap();
    assert!(templates.iter().any(|t| t.uri_template == "ckb://contract/{id}"));

    let text = |r: rmcp::model::ReadResourceResult| match &r.contents[0] {
        ResourceContents::TextResourceContents { text, .. } => text.clone(),
        other => panic!("{other:?}"),
    };
    // The contract schema documents the graph ops and the expression grammar.
    assert!(uris.contains(&"ckb://schema"), "{uris:?}");
    let schema = text(c.read_resource(ReadResourceRequestParams::new("ckb://schema")).await.unwrap());
    assert!(schema.contains("attention_sinks") && schema.contains("if(cond, a, b)"), "{}", &schema[..200]);
    let rope = text(c.read_resource(ReadResourceRequestParams::new("ckb://contract/kernel.rope")).await.unwrap());
    assert!(rope.contains("id = \"kernel.rope\""), "{rope}");
    let cov = text(c.read_resource(ReadResourceRequestParams::new("ckb://coverage")).await.unwrap());
    assert!(
        cov.contains("| model.llama | LlamaForCausalLM | platform.cpu-x86_64 | cpu | f32, bf16, f16, int8 |"),
        "{cov}"
    );
    // The plain example engine, the template the skills name, is served file by file as on disk.
    assert!(uris.contains(&"example://llama-cpu-plain/src/model.rs"), "{uris:?}");
    let on_disk = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/engines/llama-cpu-plain/src/kernels.rs"),
    )
    .unwrap();
    let kernels = text(
        c.read_resource(ReadResourceRequestParams::new("example://llama-cpu-plain/src/kernels.rs")).await.unwrap(),
    );
    assert_eq!(kernels, on_disk);
    assert!(c.read_resource(ReadResourceRequestParams::new("example://llama-cpu-plain/src/nope.rs")).await.is_err());
    let skill = text(c.read_resource(ReadResourceRequestParams::new("skill://engine-verifier")).await.unwrap());
    assert!(skill.starts_with("---\nname: engine-verifier\n"));
    assert!(c.read_resource(ReadResourceRequestParams::new("ckb://contract/kernel.nope")).await.is_err());

    let prompts = c.list_all_prompts().await.unwrap();
    let mut names: Vec<&str> = prompts.iter().map(|p| p.name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["fix_failing_kernel", "generate_engine", "review_phase"]);
    let args = serde_json::json!({"model": "/models/tiny", "target": "cpu"}).as_object().unwrap().clone();
    let p = c.get_prompt(GetPromptRequestParams::new("generate_engine").with_arguments(args)).await.unwrap();
    let msg = serde_json::to_string(&p.messages).unwrap();
    assert!(msg.contains("/models/tiny") && !msg.contains("{{model}}"), "{msg}");
    // A required argument missing is an error that names it.
    let e = c.get_prompt(GetPromptRequestParams::new("fix_failing_kernel")).await.unwrap_err();
    assert!(e.to_string().contains("engine"), "{e}");
    c.cancel().await.unwrap();
}

#[test]
fn shipped_skills_are_valid_and_install_as_claude_skills() {
    let skills = metainfer::guide::skills().unwrap();
    let mut names: Vec<&str> = skills.iter().map(|s| s.name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["engine-implementer", "engine-reviewer", "engine-verifier", "generate-engine"]);
    assert!(metainfer::guide::parse_skill("Bad_Name", "---\nname: Bad_Name\ndescription: x\n---\n").is_err());
    assert!(metainfer::guide::parse_skill("a", "---\nname: b\ndescription: x\n---\n").is_err());
    assert!(metainfer::guide::prompts().unwrap().len() == 3);

    let t = tempfile::tempdir().unwrap();
    let out = Command::new(crate::bin()).args(["install-skills", "--dir"]).arg(t.path()).output().unwrap();
    assert!(out.status.success());
    for n in names {
        let text = std::fs::read_to_string(t.path().join(n).join("SKILL.md")).unwrap();
        assert!(text.starts_with(&format!("---\nname: {n}\n")));
    }
}

#[test]
fn register_merges_into_an_existing_claude_config() {
    let t = tempfile::tempdir().unwrap();
    std::fs::write(t.path().join(".mcp.json"), r#"{"mcpServers": {"other": {"command": "x", "args": []}}}"#).unwrap();
    let out =
        Command::new(crate::bin()).args(["register", "--client", "claude", "--dir"]).arg(t.path()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(t.path().join(".mcp.json")).unwrap()).unwrap();
    assert_eq!(v["mcpServers"]["other"]["command"], "x");
    assert_eq!(v["mcpServers"]["metainfer"]["args"][0], "serve");
}

/// Raw stdio session: every line on stdout is a JSON-RPC message, and the server exits promptly on EOF.
#[test]
fn stdout_carries_only_json_rpc_and_server_exits_on_eof() {
    let t = tempfile::tempdir().unwrap();
    let mut child = Command::new(crate::bin())
        .arg("serve")
        .env("METAINFER_LEDGER", t.path().join("l.sqlite"))
        .env("METAINFER_LOG", "debug")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    // Drain stderr while the server runs: debug logs of a large response fill a pipe buffer (64 KiB),
    // and a server blocked on stderr would never answer.
    let mut stderr = child.stderr.take().unwrap();
    let logs = std::thread::spawn(move || {
        let mut err = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut err).unwrap();
        err
    });
    let msgs = [
        r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"raw","version":"0"}}}"#,
        r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
        r#"{"jsonrpc":"2.0","id":2,"method":"tools/list"}"#,
        r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"lookup_contract","arguments":{"id":"kernel.none"}}}"#,
        r#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"plan_engine","arguments":{"model":"/nonexistent"}}}"#,
        r#"{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"lookup_contract","arguments":{"id":42}}}"#,
        r#"{"jsonrpc":"2.0","id":6,"method":"resources/read","params":{"uri":"ckb://coverage"}}"#,
        r#"{"jsonrpc":"2.0","id":7,"method":"prompts/list"}"#,
    ];
    for m in msgs {
        writeln!(stdin, "{m}").unwrap();
    }
    stdin.flush().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut ids = Vec::new();
    while ids.len() < 7 {
        let line = lines.next().expect("server closed stdout early").unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("non-JSON on stdout: {line:?}: {e}"));
        assert_eq!(v["jsonrpc"], "2.0", "{line}");
        if let Some(id) = v["id"].as_i64() {
            ids.push(id);
        }
    }
    ids.sort();
    assert_eq!(ids, [1, 2, 3, 4, 5, 6, 7]);
    let eof = Instant::now();
    drop(stdin);
    for line in lines {
        let line = line.unwrap();
        serde_json::from_str::<serde_json::Value>(&line)
            .unwrap_or_else(|e| panic!("non-JSON on stdout: {line:?}: {e}"));
    }
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "{status:?}");
            break;
        }
        assert!(eof.elapsed() < Duration::from_secs(1), "server did not exit within 1 s of stdin EOF");
        std::thread::sleep(Duration::from_millis(10));
    }
    let err = logs.join().unwrap();
    assert!(!err.is_empty(), "debug logs go to stderr");
}

#[derive(Clone, Default)]
struct Counter(Arc<AtomicUsize>);

impl ClientHandler for Counter {
    async fn on_progress(
        &self,
        _params: rmcp::model::ProgressNotificationParam,
        _context: rmcp::service::NotificationContext<rmcp::RoleClient>,
    ) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn processes_mentioning(marker: &str) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(marker) && !cmd.contains("cargo test") {
                out.push(cmd);
            }
        }
    }
    out
}

/// A build that would take a minute: progress arrives every few seconds, and a cancel kills cargo
/// and the build script it runs, with nothing left behind.
#[tokio::test]
async fn long_call_sends_progress_and_cancel_leaves_no_process() {
    let t = tempfile::tempdir().unwrap();
    let marker = format!("sleepy{}", std::process::id());
    let engine = t.path().join(&marker);
    // A scaffold (so the rules pass: every gate signature is there) with a build script that starts
    // a daemon in its own session and sleeps: cancelling must end both.
    let out = Command::new(crate::bin())
        .args(["scaffold", "--name", &marker, "--model"])
        .arg(crate::babyllama())
        .arg("--out")
        .arg(&engine)
        .env("METAINFER_LEDGER", t.path().join("l.sqlite"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::write(engine.join("build.rs"), crate::signals::daemon_build_script(&marker, 120)).unwrap();

    let counter = Counter::default();
    // Its own build cache, so that other tests' builds holding the shared target-dir lock cannot delay it.
    let cmd = serve_cmd_with_cache(&t.path().join("l.sqlite"), &t.path().join("cache"));
    let c = counter.clone().serve(TokioChildProcess::new(cmd).unwrap()).await.unwrap();
    let params = CallToolRequestParams::new("compile_engine")
        .with_arguments(serde_json::json!({"engine": engine}).as_object().unwrap().clone());
    let handle = c
        .send_cancellable_request(
            ClientRequest::CallToolRequest(Request::new(params)),
            PeerRequestOptions::no_options(),
        )
        .await
        .unwrap();
    // Wait until the build script runs (cargo compiles it first), then for two progress ticks.
    let start = Instant::now();
    while !processes_mentioning(&format!("{marker}-")).iter().any(|p| p.contains("build-script-build")) {
        assert!(start.elapsed() < Duration::from_secs(120), "the build script never started");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    crate::signals::wait_for_process(&format!("{marker}-daemon"));
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert!(counter.0.load(Ordering::SeqCst) >= 1, "no progress notification in 7 s");
    // A second call on the engine being compiled is refused with a message that says what to do.
    let again = c
        .call_tool(
            CallToolRequestParams::new("run_kernel_test")
                .with_arguments(serde_json::json!({"engine": engine}).as_object().unwrap().clone()),
        )
        .await
        .unwrap();
    assert_eq!(again.is_error, Some(true));
    let text = &again.content[0].as_text().unwrap().text;
    assert!(text.contains("busy with compile_engine"), "{text}");
    handle.cancel(Some("test".into())).await.unwrap();
    let start = Instant::now();
    loop {
        let left = processes_mentioning(&marker);
        if left.is_empty() {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "left running after cancel: {left:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The server is still serving.
    let r = c
        .call_tool(
            CallToolRequestParams::new("lookup_contract")
                .with_arguments(serde_json::json!({"id": "kernel.rope"}).as_object().unwrap().clone()),
        )
        .await
        .unwrap();
    assert_eq!(r.is_error, Some(false));
    c.cancel().await.unwrap();
    // The cancelled compile is recorded as cancelled: neither a pass nor a failure.
    let l = metainfer::ledger::Ledger::open(&t.path().join("l.sqlite")).unwrap();
    let compile = l.list_filtered(0, 10, Some("compile_engine")).unwrap();
    assert_eq!(compile.len(), 1, "{compile:?}");
    assert_eq!(compile[0].status, "cancelled", "{:?}", compile[0]);
    assert!(!compile[0].passed);
}

/// Tool results are bounded (configurable) and the ledger is listed page by page.
#[tokio::test]
async fn output_is_bounded_and_outcomes_are_paginated() {
    let t = tempfile::tempdir().unwrap();
    let mut cmd = serve_cmd(&t.path().join("l.sqlite"));
    cmd.args(["--max-output", "300"]);
    let c = ().serve(TokioChildProcess::new(cmd).unwrap()).await.unwrap();
    let args = |v: serde_json::Value| v.as_object().unwrap().clone();
    let r = c
        .call_tool(
            CallToolRequestParams::new("lookup_contract")
                .with_arguments(args(serde_json::json!({"id": "kernel.attention"}))),
        )
        .await
        .unwrap();
    let text = &r.content[0].as_text().unwrap().text;
    assert!(text.chars().count() < 500 && text.contains("kernel.attention"), "{text}");
    // One contract larger than the bound: its TOML is cut to the bound, saying so and naming the
    // resource that holds it whole (a page always holds one item).
    let v = r.structured_content.unwrap();
    assert!(v["contracts"][0]["cut"].as_u64().unwrap() > 0, "{v}");
    assert!(v["contracts"][0]["toml"].as_str().unwrap().ends_with("resource ckb://contract/kernel.attention]"));
    assert!(v.get("next_cursor").is_none());
    for _ in 0..3 {
        c.call_tool(
            CallToolRequestParams::new("lookup_contract").with_arguments(args(serde_json::json!({"query": "rope"}))),
        )
        .await
        .unwrap();
    }
    let page = |cursor: Option<String>| {
        let mut a = serde_json::json!({"limit": 3});
        if let Some(cur) = cursor {
            a["cursor"] = cur.into();
        }
        CallToolRequestParams::new("list_outcomes").with_arguments(args(a))
    };
    // With a 300-character bound a page holds one outcome; walking the cursors visits the four
    // outcomes once each, oldest last, even though a fifth is recorded after the first page
    // (keyset, not offset).
    let p1 = c.call_tool(page(None)).await.unwrap().structured_content.unwrap();
    assert_eq!(p1["total"], 4);
    assert!(serde_json::to_string(&p1["outcomes"]).unwrap().len() < 1000, "{p1}");
    let mut ids: Vec<String> =
        p1["outcomes"].as_array().unwrap().iter().map(|o| o["id"].as_str().unwrap().into()).collect();
    let mut cursor = p1["next_cursor"].as_str().map(str::to_owned);
    c.call_tool(
        CallToolRequestParams::new("lookup_contract").with_arguments(args(serde_json::json!({"query": "rms"}))),
    )
    .await
    .unwrap();
    let mut last = serde_json::Value::Null;
    while let Some(cur) = cursor {
        let p = c.call_tool(page(Some(cur))).await.unwrap().structured_content.unwrap();
        ids.extend(p["outcomes"].as_array().unwrap().iter().map(|o| o["id"].as_str().unwrap().to_string()));
        cursor = p["next_cursor"].as_str().map(str::to_owned);
        last = p;
        assert!(ids.len() <= 4, "pages repeat or include the newer outcome: {ids:?}");
    }
    let mut unique = ids.clone();
    unique.sort();
    unique.dedup();
    assert_eq!((ids.len(), unique.len()), (4, 4), "{ids:?}");
    let outcomes = last["outcomes"].as_array().unwrap();
    assert!(outcomes.last().unwrap()["summary"].as_str().unwrap().contains("kernel.attention"), "{last}");
    c.cancel().await.unwrap();
}
