//! README's figures against the code and the binary: the demo plan's kernel count, the number of
//! tools (README, CI's check and the tools/list snapshot), synth's size limit (one figure), and no
//! exact test or crate counts (which drift with every change and no test could hold).

use std::path::Path;

use metainfer::ops::plan::{PlanRequest, plan};

fn readme() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap()
}

/// The number just before `suffix` at each place README says `suffix` (e.g. "16 tools" for " tools").
fn numbers_before(text: &str, suffix: &str) -> Vec<u64> {
    let mut out = Vec::new();
    for (at, _) in text.match_indices(suffix) {
        let digits: String =
            text[..at].chars().rev().take_while(|c| c.is_ascii_digit() || *c == ',').collect::<String>();
        let digits: String = digits.chars().rev().filter(char::is_ascii_digit).collect();
        if let Ok(n) = digits.parse() {
            out.push(n);
        }
    }
    out
}

/// The kernel contracts of the plan the demo makes (BabyLlama, cpu, f32), each once.
fn demo_plan_kernels() -> usize {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let req = PlanRequest {
        model: crate::babyllama().display().to_string(),
        target: "cpu".into(),
        dtype: "f32".into(),
        ..Default::default()
    };
    let r = plan(&ctx, &req).unwrap();
    let mut kernels: Vec<&String> =
        r.phases.iter().flat_map(|p| &p.contracts).filter(|c| c.starts_with("kernel.")).collect();
    kernels.sort();
    kernels.dedup();
    kernels.len()
}

/// The kernels run_kernel_test tests on the demo's engine (the SIMD example engine, whose
/// metainfer.toml adds serving constraints and with them the serving kernels).
pub fn demo_engine_kernels() -> usize {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let engine = ctx.workshop.engine_at(&metainfer::beneath::Dir::open(&crate::example_engine()).unwrap()).unwrap();
    ctx.target(&engine, None).unwrap().spec.kernels.len()
}

#[test]
fn readme_figures_match_the_code_and_the_binary() {
    let text = readme();
    // The demo: "the plan names N kernels" and "all M kernels pass" (M: the plan's and the serving
    // kernels the example engine's constraints add).
    let planned = demo_plan_kernels() as u64;
    let tested = demo_engine_kernels() as u64;
    assert_eq!(numbers_before(&text, " kernels of the plan"), [planned], "README against the demo plan's {planned}");
    assert_eq!(numbers_before(&text, " kernels pass"), [tested], "README against the {tested} kernels the demo tests");

    // Tools: README, CI's Inspector check and the reviewed tools/list snapshot (which the `mcp::tools_list`
    // test holds equal to the server's answer) agree.
    let snapshot: serde_json::Value = serde_json::from_slice(
        &std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots/tools_list.json")).unwrap(),
    )
    .unwrap();
    let tools = snapshot.as_array().unwrap().len() as u64;
    let stated = numbers_before(&text, " tools)");
    assert!(
        !stated.is_empty() && stated.iter().all(|n| *n == tools),
        "README says {stated:?} tools, the server has {tools}"
    );
    let ci = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/run")).unwrap();
    assert!(ci.contains(&format!("assert len(tools) == {tools},")), ".ci/run checks another tool count");

    // synth's size limit: one figure wherever README states it, equal to the code's.
    let limit = metainfer::ops::synth::MAX_BYTES as u64 / 1_000_000_000;
    let stated = numbers_before(&text, " GB of stored weights");
    assert!(
        stated.len() >= 2 && stated.iter().all(|n| *n == limit),
        "README's synth limits {stated:?}, code {limit} GB"
    );

    // No exact test or crate counts: they change with every commit.
    for suffix in [" unit and", " integration tests", " crates,", " tests;"] {
        assert!(numbers_before(&text, suffix).is_empty(), "README states a count before {suffix:?}");
    }
}

/// The tools table renders: every row of the MCP tools table has exactly three cells.
#[test]
fn readme_tools_table_rows_have_three_cells() {
    let text = readme();
    let start = text.find("| MCP tool | CLI | what it does |").unwrap();
    for line in text[start..].lines().skip(2).take_while(|l| l.starts_with('|')) {
        // Escaped pipes (`\|`) are inside cells.
        let cells = line.replace("\\|", "").matches('|').count() - 1;
        assert_eq!(cells, 3, "{line}");
    }
}
