//! The server over stdio, driven by the rmcp client: tools/list (names, annotations, portable schemas,
//! golden snapshot), calls, bad requests, and the demo's full loop on BabyLlama.

use std::path::Path;

use metainfer::mcp::schema::portability_problems;
use rmcp::ServiceExt;
use rmcp::model::CallToolRequestParams;
use rmcp::service::RunningService;
use rmcp::transport::{ConfigureCommandExt, TokioChildProcess};
use serde_json::{Value, json};

type Client = RunningService<rmcp::RoleClient, ()>;

async fn connect(ledger_dir: &Path, workspace: Option<&Path>) -> Client {
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

async fn call(c: &Client, tool: &str, args: Value) -> rmcp::model::CallToolResult {
    c.call_tool(CallToolRequestParams::new(tool.to_string()).with_arguments(args.as_object().unwrap().clone()))
        .await
        .unwrap()
}

const TOOLS: [&str; 12] = [
    "check_rules",
    "ckb_report",
    "compile_engine",
    "evolve_knowledge",
    "list_outcomes",
    "lookup_contract",
    "plan_engine",
    "profile_engine",
    "propose_contract",
    "run_kernel_test",
    "scaffold_engine",
    "verify_generation",
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
        // verify_generation and profile_engine may promote a staged proposal into the CKB working copy.
        let read_only = !matches!(
            t.name.as_ref(),
            "scaffold_engine" | "evolve_knowledge" | "propose_contract" | "verify_generation" | "profile_engine"
        );
        assert_eq!(a.read_only_hint, Some(read_only), "{}", t.name);
        assert_eq!(a.destructive_hint, Some(false), "{}", t.name);
    }

    // Golden snapshot of tools/list; refresh with METAINFER_UPDATE_SNAPSHOTS=1.
    let snapshot = serde_json::to_string_pretty(&tools).unwrap() + "\n";
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots/tools_list.json");
    if std::env::var_os("METAINFER_UPDATE_SNAPSHOTS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &snapshot).unwrap();
    }
    let want = std::fs::read_to_string(&path).expect("snapshot exists; create it with METAINFER_UPDATE_SNAPSHOTS=1");
    assert!(want == snapshot, "tools/list changed; if intended, refresh with METAINFER_UPDATE_SNAPSHOTS=1");
    c.cancel().await.unwrap();
}

#[tokio::test]
async fn calls_return_text_and_structured_content_and_bad_requests_are_tool_errors() {
    let t = tempfile::tempdir().unwrap();
    let c = connect(t.path(), None).await;

    let r = call(&c, "lookup_contract", json!({"id": "kernel.rope"})).await;
    assert_eq!(r.is_error, Some(false));
    let v = r.structured_content.unwrap();
    assert_eq!(v["matches"][0]["id"], "kernel.rope");
    assert!(
        v["contract_toml"].as_str().unwrap().contains("rotate-half")
            || v["contract_toml"].as_str().unwrap().contains("rotate_half")
    );
    assert!(r.content[0].as_text().unwrap().text.contains("kernel.rope"));

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

    // Missing required field and unknown tool: protocol errors, server stays up.
    let e = c.call_tool(CallToolRequestParams::new("plan_engine").with_arguments(serde_json::Map::new())).await;
    assert!(e.is_err() || e.unwrap().is_error == Some(true));
    assert!(c.call_tool(CallToolRequestParams::new("no_such_tool")).await.is_err());
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
    let r = call(&c, "scaffold_engine", json!({"model": crate::babyllama(), "out": ws.join("engine")})).await;
    assert_eq!(r.is_error, Some(false), "{:?}", r.content);
    c.cancel().await.unwrap();
}

/// README's demo: the full loop over MCP on the real checkpoint, with the golden text.
#[test]
fn demo_passes_every_gate_and_prints_the_golden_text() {
    let t = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(crate::bin())
        .arg("demo")
        .env("METAINFER_LEDGER", t.path().join("ledger.sqlite"))
        .env("METAINFER_CACHE", crate::cache())
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for tool in TOOLS.iter().filter(|t| {
        !matches!(**t, "check_rules" | "list_outcomes" | "ckb_report" | "evolve_knowledge" | "propose_contract")
    }) {
        assert!(stdout.contains(&format!("| {tool} | pass |")), "{tool} did not pass:\n{stdout}");
    }
    let golden = crate::golden();
    assert!(stdout.contains(golden["text"].as_str().unwrap()), "{stdout}");
    let ledger = metainfer::ledger::Ledger::open(&t.path().join("ledger.sqlite")).unwrap();
    assert_eq!(ledger.count().unwrap(), 7);
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
    ckb_copy_with(&ckb, broken, &shipped.replacen("version = 1", "version = \"one\"", 1));

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
