//! The server over stdio, driven by the rmcp client: tools/list (names, annotations, portable schemas,
//! golden snapshot), calls, bad requests; the demo runs in first_hour.

use std::path::Path;

use metainfer::mcp::schema::portability_problems;
use rmcp::ServiceExt;
use rmcp::model::CallToolRequestParams;
use rmcp::service::RunningService;
use rmcp::transport::{ConfigureCommandExt, TokioChildProcess};
use serde_json::{Value, json};

pub(crate) type Client = RunningService<rmcp::RoleClient, ()>;

pub(crate) async fn connect(ledger_dir: &Path, workspace: Option<&Path>) -> Client {
    let (ledger, ws) = (ledger_dir.join("ledger.sqlite"), workspace.map(Path::to_path_buf));
    let transport = TokioChildProcess::new(tokio::process::Command::new(crate::bin()).configure(|cmd| {
        cmd.arg("serve").env("METAINFER_LEDGER", &ledger).env("METAINFER_CACHE", crate::cache());
        if let Some(ws) = &ws {
            cmd.arg("--workspace").arg(ws).arg("--model-dir").arg(crate::babyllama());
        }
    }))
    .unwrap();
    ().serve(transport).await.unwrap()
}

pub(crate) async fn call(c: &Client, tool: &str, args: Value) -> rmcp::model::CallToolResult {
    c.call_tool(CallToolRequestParams::new(tool.to_string()).with_arguments(args.as_object().unwrap().clone()))
        .await
        .unwrap()
}

const TOOLS: [&str; 16] = [
    "check_rules",
    "ckb_report",
    "compile_engine",
    "evolve_knowledge",
    "list_allowed_directories",
    "list_outcomes",
    "lookup_contract",
    "plan_engine",
    "probe_machine",
    "profile_engine",
    "propose_contract",
    "run_kernel_test",
    "scaffold_engine",
    "serve_engine",
    "verify_batching",
    "verify_generation",
];

/// What each tool does to its surroundings, as README's table states it: (tool, read-only,
/// destructive, idempotent, open world). Building and running code is not read-only; cargo may
/// fetch the engine's dependencies from crates.io (open world); `force` lets scaffold overwrite code.
const ANNOTATIONS: [(&str, bool, bool, bool, bool); 16] = [
    ("check_rules", true, false, true, true),
    ("ckb_report", true, false, true, false),
    ("compile_engine", false, false, true, true),
    ("evolve_knowledge", false, false, true, false),
    ("list_allowed_directories", true, false, true, false),
    ("list_outcomes", true, false, true, false),
    ("lookup_contract", true, false, true, false),
    ("plan_engine", true, false, true, false),
    ("probe_machine", true, false, true, false),
    ("profile_engine", false, false, false, true),
    ("propose_contract", false, false, true, false),
    ("run_kernel_test", false, false, false, true),
    ("scaffold_engine", false, true, false, false),
    ("serve_engine", false, false, false, true),
    ("verify_batching", false, false, false, true),
    ("verify_generation", false, false, false, true),
];

#[tokio::test]
async fn tools_list_is_portable_annotated_and_matches_snapshot() {
    let t = tempfile::tempdir().unwrap();
    let c = connect(t.path(), None).await;
    let info = c.peer_info().unwrap();
    let server = info.server_info.clone().unwrap();
    assert_eq!(server.name, "metainfer");
    assert_eq!(server.version, env!("CARGO_PKG_VERSION"));
    assert!(info.instructions.as_deref().unwrap_or("").contains("plan_engine"));

    let mut tools = c.list_all_tools().await.unwrap();
    tools.sort_by(|a, b| a.name.cmp(&b.name));
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert_eq!(names, TOOLS);
    for t in &tools {
        let input = Value::Object((*t.input_schema).clone());
        assert_eq!(portability_problems(&input), Vec::<String>::new(), "{} input", t.name);
        let output = Value::Object((*t.output_schema.clone().expect("every tool has an output schema")).clone());
        assert_eq!(portability_problems(&output), Vec::<String>::new(), "{} output", t.name);
        let a = t.annotations.clone().expect("annotated");
        let (_, ro, de, idem, open) = ANNOTATIONS.iter().find(|x| x.0 == t.name).expect("in the table");
        assert_eq!(
            (a.read_only_hint, a.destructive_hint, a.idempotent_hint, a.open_world_hint),
            (Some(*ro), Some(*de), Some(*idem), Some(*open)),
            "{}",
            t.name
        );
        assert!(t.title.as_deref().is_some_and(|x| !x.is_empty()), "{} has no title", t.name);
    }

    // Golden snapshot of tools/list; refresh with METAINFER_UPDATE_SNAPSHOTS=1.
    let snapshot = serde_json::to_string_pretty(&tools).unwrap() + "\n";
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots/tools_list.json");
    if std::env::var_os("METAINFER_UPDATE_SNAPSHOTS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &snapshot).unwrap();
    }
    let want = std::fs::read_to_string(&path).expect("snapshot exists; create it with METAINFER_UPDATE_SNAPSHOTS=1");
    if want != snapshot {
        let (line, (w, g)) = want
            .lines()
            .zip(snapshot.lines())
            .enumerate()
            .find(|(_, (w, g))| w != g)
            .unwrap_or((want.lines().count().min(snapshot.lines().count()), ("<end>", "<end>")));
        panic!(
            "tools/list changed at line {}; if intended, refresh with METAINFER_UPDATE_SNAPSHOTS=1\n  snapshot: {w}\n  now:      {g}",
            line + 1
        );
    }
    c.cancel().await.unwrap();
}

#[tokio::test]
async fn calls_return_text_and_structured_content_and_bad_requests_are_tool_errors() {
    let t = tempfile::tempdir().unwrap();
    let c = connect(t.path(), None).await;

    let r = call(&c, "lookup_contract", json!({"id": "kernel.rope"})).await;
    assert_eq!(r.is_error, Some(false));
    let v = r.structured_content.unwrap();
    assert_eq!(v["contracts"][0]["id"], "kernel.rope");
    let toml = v["contracts"][0]["toml"].as_str().unwrap();
    assert!(toml.contains("rotate-half") || toml.contains("rotate_half"));
    // The text is a short index; the contract is in the structure once.
    let text = &r.content[0].as_text().unwrap().text;
    assert!(text.contains("kernel.rope") && !text.contains(toml), "{text}");

    let r = call(&c, "plan_engine", json!({"model": crate::babyllama()})).await;
    let v = r.structured_content.unwrap();
    assert_eq!(v["covered"], true);
    assert_eq!(v["family"], "model.llama");
    let phases: Vec<&str> = v["phases"].as_array().unwrap().iter().map(|p| p["phase"].as_str().unwrap()).collect();
    assert_eq!(phases, ["kernels", "weight_loading", "decoder_layer", "full_forward", "generation", "performance"]);

    // Unknown id: a tool error that says what to do; the server stays up.
    let r = call(&c, "lookup_contract", json!({"id": "kernel.ropee"})).await;
    assert_eq!(r.is_error, Some(true));
    let text = &r.content[0].as_text().unwrap().text;
    assert!(text.contains("unknown contract id") && text.contains("kernel.rope"), "{text}");

    // Missing model directory.
    let r = call(&c, "plan_engine", json!({"model": t.path().join("nowhere")})).await;
    assert_eq!(r.is_error, Some(true));
    // An error echoing a huge argument stays bounded, its head and its end (the fix) kept.
    let r = call(&c, "plan_engine", json!({"model": "x".repeat(1_000_000)})).await;
    let text = &r.content[0].as_text().unwrap().text;
    assert!(
        r.is_error == Some(true) && text.chars().count() < 4100 && text.contains("characters cut"),
        "{}",
        text.len()
    );

    // Missing required field and unknown tool: protocol errors, server stays up.
    let e = c.call_tool(CallToolRequestParams::new("plan_engine").with_arguments(serde_json::Map::new())).await;
    assert!(e.is_err() || e.unwrap().is_error == Some(true));
    assert!(c.call_tool(CallToolRequestParams::new("no_such_tool")).await.is_err());
    // An argument the tool does not take (the CLI's `--prompt` and `--max-tokens` for
    // verify_generation's `prompts` and `max_new_tokens`) is refused by name, never dropped.
    let args = json!({"engine": "e", "model": "m", "prompt": "Hello", "max_tokens": 5});
    let e = c
        .call_tool(CallToolRequestParams::new("verify_generation").with_arguments(args.as_object().unwrap().clone()))
        .await;
    let why = match e {
        Err(e) => e.to_string(),
        Ok(r) => r.content[0].as_text().unwrap().text.clone(),
    };
    assert!(
        why.contains("unknown field `") && why.contains("expected one of") && why.contains("`max_new_tokens`"),
        "{why}"
    );
    let r = call(&c, "lookup_contract", json!({"query": "rotary"})).await;
    assert_eq!(r.is_error, Some(false));
    c.cancel().await.unwrap();
}

#[tokio::test]
async fn paths_outside_the_workspace_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let ws = t.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    let c = connect(t.path(), Some(&ws)).await;
    let r = call(&c, "scaffold_engine", json!({"model": crate::babyllama(), "out": t.path().join("outside")})).await;
    assert_eq!(r.is_error, Some(true));
    assert!(r.content[0].as_text().unwrap().text.contains("outside the workspace"));
    assert!(!t.path().join("outside").exists(), "nothing may be written outside the workspace");
    let r = call(&c, "scaffold_engine", json!({"model": crate::babyllama(), "out": ws.join("../ws/../escape")})).await;
    assert_eq!(r.is_error, Some(true));
    // The workspace itself is no new directory: named as such, not as a path outside it.
    for out in [json!("."), json!(ws)] {
        let r = call(&c, "scaffold_engine", json!({"model": crate::babyllama(), "out": out})).await;
        let text = &r.content[0].as_text().unwrap().text;
        assert!(r.is_error == Some(true) && text.contains("is the workspace itself"), "{text}");
    }
    let r = call(&c, "scaffold_engine", json!({"model": crate::babyllama(), "out": ws.join("engine")})).await;
    assert_eq!(r.is_error, Some(false), "{:?}", r.content);
    c.cancel().await.unwrap();
}

/// A working copy of the shipped CKB in `dir` with `file` replaced by `text`.
fn ckb_copy_with(dir: &Path, file: &str, text: &str) {
    for (p, s) in metainfer::ckb::embedded_files() {
        let path = dir.join(&p);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, if p == file { text.to_string() } else { s }).unwrap();
    }
}

#[tokio::test]
async fn serve_skips_an_invalid_contract_file_only_with_skip_invalid_and_every_plan_says_so() {
    use tokio::io::AsyncReadExt;
    let t = tempfile::tempdir().unwrap();
    let ckb = t.path().join("ckb");
    let broken = "policies/zero-reference.toml";
    let shipped = metainfer::ckb::embedded_files().into_iter().find(|(p, _)| p == broken).unwrap().1;
    // Whatever its version number, the file's `version = N` line becomes a string.
    let version_line = shipped.lines().find(|l| l.starts_with("version = ")).unwrap();
    ckb_copy_with(&ckb, broken, &shipped.replacen(version_line, "version = \"one\"", 1));

    // Without the flag: refused, naming the file and the field; nothing on stdout.
    let out = std::process::Command::new(crate::bin())
        .args(["serve", "--ckb"])
        .arg(&ckb)
        .env("METAINFER_LEDGER", t.path().join("ledger.sqlite"))
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(broken) && stderr.contains("/version"), "{stderr}");
    assert!(out.stdout.is_empty());

    // With it: the server starts, logs the skipped file, and plan_engine lists it.
    let mut cmd = tokio::process::Command::new(crate::bin());
    cmd.arg("serve")
        .arg("--ckb")
        .arg(&ckb)
        .arg("--skip-invalid")
        .env("METAINFER_LEDGER", t.path().join("ledger.sqlite"))
        .env("METAINFER_CACHE", crate::cache());
    let (transport, stderr) = TokioChildProcess::builder(cmd).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let c: Client = ().serve(transport).await.unwrap();
    let r = call(&c, "plan_engine", json!({"model": crate::babyllama()})).await;
    assert_eq!(r.is_error, Some(false), "{:?}", r.content);
    let v = r.structured_content.unwrap();
    assert_eq!(v["covered"], true, "{v}");
    let skipped = v["skipped_contracts"].as_array().unwrap();
    assert_eq!(skipped.len(), 1, "{v}");
    assert_eq!(skipped[0]["file"], broken);
    let reason = skipped[0]["reason"].as_str().unwrap();
    assert!(reason.starts_with("field `/version`:") && reason.contains("\"one\""), "{reason}");
    let text = &r.content[0].as_text().unwrap().text;
    assert!(text.contains(&format!("skipped invalid contract file {broken}: field `/version`")), "{text}");
    c.cancel().await.unwrap();
    let mut log = String::new();
    tokio::time::timeout(std::time::Duration::from_secs(20), stderr.unwrap().read_to_string(&mut log))
        .await
        .expect("the server exits when the client is gone")
        .unwrap();
    assert!(log.contains(&format!("left out contract file {broken}: field `/version`")), "{log}");
}

async fn connect_with(ledger_dir: &Path, args: &[&str]) -> Client {
    let (ledger, args) = (ledger_dir.join("ledger.sqlite"), args.iter().map(|a| a.to_string()).collect::<Vec<_>>());
    let transport = TokioChildProcess::new(tokio::process::Command::new(crate::bin()).configure(|cmd| {
        cmd.arg("serve").args(&args).env("METAINFER_LEDGER", &ledger).env("METAINFER_CACHE", crate::cache());
    }))
    .unwrap();
    ().serve(transport).await.unwrap()
}

/// A client passes arguments and its config's `args` without a shell: a leading `~` in a path
/// argument, `--workspace` or `--model-dir` is `$HOME` as a shell would expand it. A `--model-dir`
/// that does not exist is named as admitting nothing, in list_allowed_directories and in the
/// refusal, so its advice to add a --model-dir is not taken for the one already given.
#[tokio::test]
async fn a_tilde_is_home_and_a_missing_model_dir_is_named() {
    let t = tempfile::tempdir().unwrap();
    let home = t.path().join("home");
    let model = home.join("models/llama");
    std::fs::create_dir_all(home.join("proj")).unwrap();
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(crate::shared().join("conformance/llama/config.json"), model.join("config.json")).unwrap();
    let (ledger, home_) = (t.path().join("ledger.sqlite"), home.clone());
    let transport = TokioChildProcess::new(tokio::process::Command::new(crate::bin()).configure(|cmd| {
        cmd.args(["serve", "--workspace", "~/proj", "--model-dir", "~/models", "--model-dir", "~/nowhere"])
            .env("HOME", &home_)
            .env("METAINFER_LEDGER", &ledger)
            .env("METAINFER_CACHE", crate::cache());
    }))
    .unwrap();
    let c = ().serve(transport).await.unwrap();
    let r = call(&c, "plan_engine", json!({"model": "~/models/llama"})).await;
    let text = &r.content[0].as_text().unwrap().text;
    assert_eq!(r.is_error, Some(false), "{text}");
    assert!(text.contains("model.llama"), "{text}");
    let v = call(&c, "list_allowed_directories", json!({})).await.structured_content.unwrap();
    let home = home.canonicalize().unwrap();
    assert_eq!(v["workspace"], home.join("proj").display().to_string(), "{v}");
    assert_eq!(v["others"][0], home.join("models").display().to_string(), "{v}");
    let missing = v["others"][1].as_str().unwrap();
    assert!(missing.contains("nowhere") && missing.contains("admits nothing"), "{v}");
    let r = call(&c, "plan_engine", json!({"model": t.path().join("elsewhere")})).await;
    let text = &r.content[0].as_text().unwrap().text;
    assert_eq!(r.is_error, Some(true));
    assert!(text.contains("outside the workspace") && text.contains("nowhere (cannot be opened"), "{text}");
    c.cancel().await.unwrap();
}

#[tokio::test]
async fn read_only_and_toolsets_narrow_the_tools() {
    let t = tempfile::tempdir().unwrap();
    let c = connect_with(t.path(), &["--read-only"]).await;
    let mut names: Vec<String> = c.list_all_tools().await.unwrap().iter().map(|t| t.name.to_string()).collect();
    names.sort();
    let want: Vec<&str> = ANNOTATIONS.iter().filter(|a| a.1).map(|a| a.0).collect();
    assert_eq!(names, want);
    c.cancel().await.unwrap();
    let c = connect_with(t.path(), &["--toolsets", "gates"]).await;
    let mut names: Vec<String> = c.list_all_tools().await.unwrap().iter().map(|t| t.name.to_string()).collect();
    names.sort();
    assert_eq!(names, ["profile_engine", "run_kernel_test", "serve_engine", "verify_batching", "verify_generation"]);
    // A tool outside the toolsets cannot be called.
    assert!(c.call_tool(CallToolRequestParams::new("scaffold_engine")).await.is_err());
    c.cancel().await.unwrap();
}

#[tokio::test]
async fn completion_allowed_directories_and_one_call_per_phase() {
    let t = tempfile::tempdir().unwrap();
    let ws = t.path().join("ws");
    std::fs::create_dir_all(ws.join("myengine")).unwrap();
    std::fs::write(ws.join("myengine/metainfer.toml"), "family = \"model.llama\"\n").unwrap();
    let c = connect(t.path(), Some(&ws)).await;

    let r = c.complete_resource_simple("ckb://contract/{id}", "id", "kernel.ro").await.unwrap();
    assert!(r.contains(&"kernel.rope".to_string()), "{r:?}");
    let r = c.complete_prompt_simple("review_phase", "engine", "my").await.unwrap();
    assert_eq!(r, ["myengine"]);

    let r = call(&c, "list_allowed_directories", json!({})).await;
    let v = r.structured_content.unwrap();
    assert_eq!(v["confined"], true);
    assert_eq!(v["workspace"], ws.canonicalize().unwrap().display().to_string());
    assert_eq!(v["others"][0], crate::babyllama().canonicalize().unwrap().display().to_string());

    // One call for the kernels phase (continued by cursor when it does not fit the bound): every
    // kernel of the phase, its failure modes and requirements, each once.
    let mut ids: Vec<String> = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut a = json!({"phase": "kernels", "family": "model.llama"});
        if let Some(c) = &cursor {
            a["cursor"] = c.clone().into();
        }
        let r = call(&c, "lookup_contract", a).await;
        assert_eq!(r.is_error, Some(false), "{:?}", r.content);
        let v = r.structured_content.unwrap();
        assert!(
            serde_json::to_string(&v).unwrap().len() <= metainfer::ops::MAX_TEXT
                || v["contracts"].as_array().unwrap().len() == 1
        );
        assert_eq!(metainfer::util::js_unsafe_numbers(&v), Vec::<String>::new());
        let text = &r.content[0].as_text().unwrap().text;
        assert!(text.len() < 4000, "the text is an index, not the contracts: {} chars", text.len());
        ids.extend(v["contracts"].as_array().unwrap().iter().map(|c| c["id"].as_str().unwrap().to_string()));
        match v["next_cursor"].as_str() {
            Some(n) => cursor = Some(n.to_string()),
            None => break,
        }
        assert!(ids.len() < 200, "paging does not end");
    }
    let mut unique = ids.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), ids.len(), "a contract twice: {ids:?}");
    for want in ["kernel.rms_norm", "kernel.rope", "kernel.embedding", "failure.rope-adjacent-pairs"] {
        assert!(ids.iter().any(|i| i == want), "{want} missing: {ids:?}");
    }
    c.cancel().await.unwrap();
}

/// A client that skips `initialize` (the 2026 protocol's `server/discover` and per-request
/// metadata) is still recorded under its own name, not as `cli`.
#[tokio::test]
async fn client_identity_comes_from_request_metadata_without_initialize() {
    use rmcp::{ClientLifecycleMode, ClientServiceExt};
    let t = tempfile::tempdir().unwrap();
    let ledger = t.path().join("ledger.sqlite");
    let transport = TokioChildProcess::new(tokio::process::Command::new(crate::bin()).configure(|cmd| {
        cmd.arg("serve").env("METAINFER_LEDGER", &ledger).env("METAINFER_CACHE", crate::cache());
    }))
    .unwrap();
    let mode = ClientLifecycleMode::Discover { preferred_versions: vec![rmcp::model::ProtocolVersion::V_2026_07_28] };
    let c = ().serve_with_lifecycle(transport, mode).await.unwrap();
    let r = call(&c, "lookup_contract", json!({"id": "kernel.rope"})).await;
    assert_eq!(r.is_error, Some(false));
    c.cancel().await.unwrap();
    let l = metainfer::ledger::Ledger::open(&ledger).unwrap();
    let o = l.list(0, 1).unwrap();
    assert!(!o[0].client.is_empty() && o[0].client != "cli", "recorded as {:?}", o[0].client);
}

/// A client that offers MCP roots.
#[derive(Clone)]
struct Rooted(std::path::PathBuf);

#[allow(deprecated, reason = "roots are deprecated by SEP-2577 but clients still send them")]
impl rmcp::ClientHandler for Rooted {
    fn get_info(&self) -> rmcp::model::ClientConfig {
        rmcp::model::ClientConfig::new(
            rmcp::model::ClientCapabilities::builder().enable_roots().build(),
            rmcp::model::Implementation::new("rooted", "1"),
        )
    }
    async fn list_roots(
        &self,
        _context: rmcp::service::RequestContext<rmcp::RoleClient>,
    ) -> Result<rmcp::model::ListRootsResult, rmcp::ErrorData> {
        Ok(rmcp::model::ListRootsResult::new(vec![rmcp::model::Root::new(format!("file://{}", self.0.display()))]))
    }
}

/// Without --workspace, the client's roots are the workspace.
#[tokio::test]
async fn the_clients_roots_become_the_workspace() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("project");
    std::fs::create_dir_all(&root).unwrap();
    let ledger = t.path().join("ledger.sqlite");
    let transport = TokioChildProcess::new(tokio::process::Command::new(crate::bin()).configure(|cmd| {
        cmd.arg("serve").env("METAINFER_LEDGER", &ledger).env("METAINFER_CACHE", crate::cache());
    }))
    .unwrap();
    let c = Rooted(root.clone()).serve(transport).await.unwrap();
    let args = |v: Value| v.as_object().unwrap().clone();
    let mut v = Value::Null;
    for _ in 0..50 {
        v = c
            .call_tool(CallToolRequestParams::new("list_allowed_directories").with_arguments(args(json!({}))))
            .await
            .unwrap()
            .structured_content
            .unwrap();
        if v["confined"] == true {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(v["workspace"], root.canonicalize().unwrap().display().to_string(), "{v}");
    let r = c
        .call_tool(
            CallToolRequestParams::new("scaffold_engine")
                .with_arguments(args(json!({"model": crate::babyllama(), "out": t.path().join("outside")}))),
        )
        .await
        .unwrap();
    assert_eq!(r.is_error, Some(true));
    let text = &r.content[0].as_text().unwrap().text;
    assert!(text.contains("outside the workspace") && text.contains("--model-dir"), "{text}");
    c.cancel().await.unwrap();
}

/// Regression: a line that is not JSON (invalid UTF-8, a lone surrogate escape, plain text) got no
/// reply. JSON-RPC 2.0 (5.1) answers each with a Parse error, -32700, `id` null; the session goes on
/// and the next request is answered as usual. A `tools/call` whose `arguments` are not an object
/// got "-32601 tools/call"; it gets Invalid params, -32602, with its id and the field to fix.
#[test]
fn lines_that_are_not_json_are_answered_with_a_parse_error() {
    use std::io::{BufRead, Write};
    let t = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(crate::bin())
        .arg("--ledger")
        .arg(t.path().join("l.sqlite"))
        .arg("serve")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    stdin.write_all(b"\xff\xfe not utf-8\n").unwrap();
    stdin.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\",\"params\":{\"s\":\"\\ud800\"}}\n").unwrap();
    stdin.write_all(b"hello\n").unwrap();
    stdin.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":9,\"method\":\"tools/call\",\"params\":{\"name\":\"lookup_contract\",\"arguments\":[1]}}\n").unwrap();
    let init = r#"{"jsonrpc":"2.0","id":7,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}"#;
    writeln!(stdin, "{init}").unwrap();
    stdin.flush().unwrap();
    let mut replies = Vec::new();
    for _ in 0..5 {
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        replies.push(serde_json::from_str::<Value>(&line).unwrap_or_else(|e| panic!("{e}: {line:?}")));
    }
    let parse_errors: Vec<&Value> = replies.iter().filter(|r| r["error"]["code"] == -32700).collect();
    assert_eq!(parse_errors.len(), 3, "{replies:?}");
    assert!(parse_errors.iter().all(|r| r.as_object().unwrap().contains_key("id") && r["id"].is_null()));
    assert!(parse_errors[0]["error"]["message"].as_str().unwrap().contains("UTF-8"));
    let invalid = replies.iter().find(|r| r["id"] == 9).expect("the tools/call reply");
    assert_eq!(invalid["error"]["code"], -32602, "{invalid}");
    assert!(invalid["error"]["message"].as_str().unwrap().contains("params.arguments must be an object"), "{invalid}");
    let init = replies.iter().find(|r| r["id"] == 7).expect("the initialize reply");
    assert!(init["result"]["serverInfo"]["name"].is_string(), "{init}");
    drop(stdin);
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(start.elapsed() < std::time::Duration::from_secs(10), "serve did not exit at the end of its input");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Regression: `lookup_contract {id: model.gemma2}` returned 21,501 characters of structured
/// content at `--max-output 2000`. Each contract's TOML and graph are now cut to share the bound,
/// saying how much was cut and where the whole contract is.
#[test]
fn lookup_keeps_its_structured_content_within_the_output_bound() {
    let t = tempfile::tempdir().unwrap();
    let mut ctx = crate::ctx(t.path());
    ctx.max_output = 2000;
    let req = metainfer::ops::lookup::LookupRequest { id: Some("model.gemma2".into()), ..Default::default() };
    let r = metainfer::ops::lookup::lookup(&ctx, &req).unwrap();
    let size = serde_json::to_string(&r).unwrap().chars().count();
    assert!(size <= 2000, "{size} characters");
    let c = &r.contracts[0];
    assert!(c.cut > 10_000, "{}", c.cut);
    assert!(c.toml.ends_with("the whole contract: resource ckb://contract/model.gemma2]"), "{}", c.toml);
    // Unbounded, nothing is cut.
    ctx.max_output = usize::MAX;
    let whole = metainfer::ops::lookup::lookup(&ctx, &req).unwrap();
    assert_eq!(whole.contracts[0].cut, 0);
    assert!(serde_json::to_string(&whole).unwrap().chars().count() > 15_000);
}
