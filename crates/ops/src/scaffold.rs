//! scaffold_engine: write a compilable engine crate for the constraints, with the public signatures
//! the gates call (from the contracts' `rust` sections), their docs, and `todo!()` bodies. A serving
//! engine (its plan has component.openai_server) also gets its binary, from `template/engine_main.rs`:
//! the flag parsing done (`--help`, unknown flags refused by name, the served model and address
//! printed), `generate` and `serve` left to the agent; serve_engine's `help` check holds engines to
//! the same. The family's graph is written, rendered, as a comment beside its `model` skeleton.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::plan::{PlanRequest, api_of, constraints_toml, plan_only};
use super::{Ctx, Report};
use base::beneath::Dir;
use base::error::{Error, Result};

/// Where and for what to scaffold.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ScaffoldRequest {
    /// Hugging Face model directory the engine is for.
    pub model: String,
    /// Directory to create the crate in; must be empty or absent unless `force`.
    pub out: String,
    /// Target platform, e.g. `cpu`.
    #[serde(default = "cpu")]
    pub target: String,
    /// dtype, e.g. `f32` (`bf16` for target `cuda`).
    #[serde(default = "f32")]
    pub dtype: String,
    /// Platform contract id, where several share the target (`cuda`: `platform.cuda-sm90` or
    /// `platform.cuda-sm80`); absent: the target's only platform.
    #[serde(default)]
    pub platform: Option<String>,
    /// Crate name; default `engine`.
    #[serde(default)]
    pub name: Option<String>,
    /// Overwrite the scaffold's files in a non-empty directory (other files are kept).
    #[serde(default)]
    pub force: bool,
    /// What the agent building the engine may read: `zero` (the CKB only, default), `docs` (public
    /// documentation too) or `code` (other implementations' code too). Recorded with every outcome.
    #[serde(default)]
    pub reference_level: super::ReferenceLevel,
    /// Serving constraints (see plan_engine): the scaffold then writes the serving skeletons
    /// (src/paged.rs, src/batch.rs, the sampler) and a `[serving]` table in metainfer.toml.
    #[serde(default)]
    pub serving: Option<manifest::Serving>,
}

fn cpu() -> String {
    "cpu".into()
}
fn f32() -> String {
    "f32".into()
}

/// What was written.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ScaffoldReport {
    /// Engine crate directory (absolute).
    pub dir: String,
    /// Files written, relative to `dir`.
    pub files: Vec<String>,
    /// Contract ids whose signatures were written.
    pub contracts: Vec<String>,
    /// What to do next.
    pub next: String,
}

impl Report for ScaffoldReport {
    fn passed(&self) -> bool {
        true
    }
    fn text(&self) -> String {
        format!(
            "scaffolded {} ({} files: {})\ncontracts: {}\nnext: {}",
            self.dir,
            self.files.len(),
            self.files.join(", "),
            self.contracts.join(", "),
            self.next
        )
    }
}

/// The template of a serving engine's binary (`src/main.rs`): `generate` and `serve` with their
/// flags, `--help` on every command, unknown flags refused by name (component.openai_server).
pub const ENGINE_MAIN: &str = include_str!("template/engine_main.rs");

/// Files as (path relative to the crate, contents).
pub type Files = Vec<(String, String)>;

/// The files of a scaffold, as (relative path, contents), for the constraints.
///
/// # Errors
/// When the constraints are not covered.
pub fn render(ctx: &Ctx, req: &ScaffoldRequest) -> Result<(Files, Vec<String>)> {
    let preq = PlanRequest {
        model: req.model.clone(),
        target: req.target.clone(),
        dtype: req.dtype.clone(),
        platform: req.platform.clone(),
        serving: req.serving.clone(),
    };
    let report = plan_only(ctx, &preq)?;
    // Staged candidates (report.provisional) may be scaffolded under: that is how they earn evidence.
    if !report.gaps.is_empty() {
        return Err(Error::usage(format!(
            "cannot scaffold: the constraints are not covered:\n{}",
            report.gaps.iter().map(|g| format!("  {}: {}", g.field, g.reason)).collect::<Vec<_>>().join("\n")
        )));
    }
    let name = req.name.clone().unwrap_or_else(|| "engine".into());
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
        return Err(Error::usage(format!("crate name {name:?} must be ASCII letters, digits, '-' or '_'")));
    }
    // A CUDA platform takes the kernels' CUDA signatures (device buffers, a stream).
    let api = api_of(ctx, &report);
    let mut modules: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut contracts = Vec::new();
    let mut order: Vec<String> = Vec::new();
    for phase in &report.phases {
        for id in &phase.contracts {
            let c = ctx.ckb.get(id)?;
            if let Some(rust) = &c.api_for(&api)
                && !contracts.contains(&c.id)
            {
                contracts.push(c.id.clone());
                if !order.contains(&rust.module) {
                    order.push(rust.module.clone());
                }
                modules.entry(rust.module.clone()).or_default().push(format!(
                    "// Contract {} v{} ({}): {}\n{}\n",
                    c.id,
                    c.version,
                    c.phase.map(|p| p.name()).unwrap_or("model"),
                    c.summary,
                    rust.skeleton.trim_end()
                ));
                // A family's forward pass, node by node, beside the skeleton that computes it: the
                // node names are what the reference computes and traces, in order.
                if let Some(g) = c.model.as_ref().and_then(|m| m.graph.as_ref()) {
                    let lines: Vec<String> = ckb::graph::render_graph(g).lines().map(|l| format!("//   {l}")).collect();
                    modules.entry(rust.module.clone()).or_default().push(format!(
                        "// The forward pass of {} ([model.graph]; `metainfer contract show {}`): compute these\n\
                         // nodes in this order, each the operation named (a kernel contract or an elementwise\n\
                         // primitive) on its inputs and weights.\n{}\n",
                        c.id,
                        c.id,
                        lines.join("\n")
                    ));
                }
            }
        }
    }
    let mut files = Vec::new();
    files.push((
        "Cargo.toml".into(),
        format!(
            "[package]\nname = {name:?}\nversion = \"0.1.0\"\nedition = \"2024\"\npublish = false\n\n\
             # General-purpose crates only: no inference framework or its bindings (zero-reference rule).\n\
             [dependencies]\nsafetensors = \"0.8\"\nserde = {{ version = \"1\", features = [\"derive\"] }}\nserde_json = \"1\"\n{}\n\
             # A standalone crate, even inside another workspace.\n[workspace]\n",
            if api == ckb::API_CUDA {
                "# CUDA through cudarc, as policy.zero-reference permits for target cuda: the driver, NVRTC and\n\
                 # cuBLAS bindings, CUDA 13, libraries loaded at run time (builds without a CUDA toolkit).\n\
                 cudarc = { version = \"0.19\", default-features = false, features = [\"std\", \"cuda-13000\", \"driver\", \"nvrtc\", \"cublas\", \"dynamic-loading\"] }\n"
            } else {
                ""
            }
        ),
    ));
    let mut lib = String::from(
        "//! Inference engine scaffolded by metainfer. Fill in every `todo!()` from the contracts\n\
         //! (`metainfer contract show ID`); the public signatures are what the gates call: keep them.\n\
         #![allow(unused_variables)]\n\n",
    );
    for m in &order {
        lib += &format!("pub mod {m};\n");
    }
    files.push(("src/lib.rs".into(), lib));
    // A serving engine's binary: the flag parsing done (help, unknown flags refused by name, the
    // served model and address printed), `generate` and `serve` left to the agent.
    if report.phases.iter().any(|p| p.contracts.iter().any(|c| c == "component.openai_server")) {
        files.push(("src/main.rs".into(), ENGINE_MAIN.to_string()));
    }
    for m in &order {
        let body = modules[m].join("\n");
        // Skeletons that refer to paths bring their own `use` lines; hoist them to the top.
        let (uses, rest): (Vec<&str>, Vec<&str>) = body.lines().partition(|l| l.starts_with("use "));
        let mut uses: Vec<&str> = uses;
        uses.sort();
        uses.dedup();
        let mut text =
            format!("//! Module `{m}`: contracts {}.\n\n", contracts_in(ctx, m, &contracts, &api).join(", "));
        if !uses.is_empty() {
            text += &(uses.join("\n") + "\n\n");
        }
        text += &rest.join("\n");
        text += "\n";
        files.push((format!("src/{m}.rs"), text));
    }
    // The model as an absolute path: a path relative to the caller's directory means nothing later.
    let model = ctx.confine_model(std::path::Path::new(&req.model))?.path().display().to_string();
    let constraints = constraints_toml(
        &PlanRequest {
            model,
            target: req.target.clone(),
            dtype: req.dtype.clone(),
            platform: req.platform.clone(),
            serving: req.serving.clone(),
        },
        &report,
        req.reference_level,
    )?;
    files.push(("metainfer.toml".into(), constraints));
    files.push(("PLAN.md".into(), format!("# Build plan\n\n```\n{}```\n", report.text())));
    Ok((files, contracts))
}

fn contracts_in(ctx: &Ctx, module: &str, ids: &[String], api: &str) -> Vec<String> {
    ids.iter()
        .filter(|id| ctx.ckb.get(id).ok().and_then(|c| c.api_for(api)).is_some_and(|r| r.module == module))
        .cloned()
        .collect()
}

/// Scaffold an engine crate.
///
/// # Errors
/// Uncovered constraints; a non-empty `out` without `force`; a path outside the workspace.
pub fn scaffold(ctx: &Ctx, req: &ScaffoldRequest) -> Result<ScaffoldReport> {
    let started = std::time::Instant::now();
    let live = ctx.live();
    let ctx = &*live;
    let report = scaffold_only(ctx, req)?;
    let ids: Vec<&str> = report.contracts.iter().map(String::as_str).collect();
    let engine = ctx.confine(Path::new(&report.dir)).and_then(|d| ctx.workshop.engine_at(&d)).ok();
    ctx.record(
        "scaffold_engine",
        engine.as_ref(),
        ctx.versioned(&ids),
        &report,
        ledger::figures::Figures::Other(serde_json::json!({"files": report.files.len()})),
        started,
    );
    Ok(report)
}

fn scaffold_only(ctx: &Ctx, req: &ScaffoldRequest) -> Result<ScaffoldReport> {
    // Resolved once: every later step goes through `out.base`, a handle of the nearest existing
    // ancestor, so a directory swapped for a symlink meanwhile cannot redirect a write.
    let out = ctx.confine_new(Path::new(&req.out))?;
    let (files, contracts) = render(ctx, req)?;
    let shown = out.path();
    let (base, rest) = (&out.base, out.rest.as_path());
    let non_empty = match base.kind(rest) {
        None => false,
        Some(t) if t.is_dir() => !base.entries(rest)?.is_empty(),
        Some(t) => {
            return Err(Error::usage(format!(
                "{} exists and is {}, not a directory",
                shown.display(),
                base::util::kind_of(t)
            )));
        }
    };
    if non_empty && !req.force {
        return Err(Error::usage(format!(
            "{} is not empty; choose an empty or new directory, or pass force (CLI: --force) to overwrite the scaffold's files",
            shown.display()
        )));
    }
    // Write into a sibling temporary directory first (beside the target, so inside the workspace
    // only when the target is), then move each file into place, so that a failure part-way leaves
    // no half-written crate. On failure the staging directory and every directory created for it
    // are removed: nothing is left behind.
    // Missing parents are created one by one, and only the ones this call created are removed on
    // failure, each only while empty: a directory put in place by someone else meanwhile is kept.
    let parent_rel = rest.parent().unwrap_or(Path::new(""));
    let mut created = Vec::new();
    let mut result = Ok(());
    let mut at = PathBuf::new();
    for c in parent_rel.components() {
        at.push(c);
        match base.cap().create_dir(&at) {
            Ok(()) => created.push(at.clone()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                result = Err(base.error(&at, &e));
                break;
            }
        }
    }
    if result.is_ok() {
        result = write_staged(base, rest, &files, non_empty);
    }
    if result.is_err() {
        for d in created.iter().rev() {
            let _ = base.cap().remove_dir(d);
        }
    }
    result?;
    Ok(ScaffoldReport {
        dir: shown.display().to_string(),
        files: files.into_iter().map(|(r, _)| r).collect(),
        contracts,
        next: next_steps(&req.target, req.serving.is_some()),
    })
}

/// The gates after a scaffold, in phase order: the serving ones for an engine with serving
/// constraints; for a CUDA engine, how its gates run where the device is (bundles).
fn next_steps(target: &str, serving: bool) -> String {
    let mut s = String::from(
        "implement src/kernels.rs, then call compile_engine and run_kernel_test; then the model, tokenizer and \
         generate modules, then verify_generation",
    );
    if serving {
        s += "; then the block manager, batched step and scheduler (verify_batching), and the server (serve_engine)";
    }
    if target == "cuda" {
        s += ". Without a GPU here, each gate takes write_bundle: run the bundle with `metainfer bundle run DIR` where \
              the device is, then call the gate again with from_bundle";
    }
    s
}

/// Write `files` into a staging directory beside `out` (relative to `base`; its parent exists) and
/// move them to `out`
/// (the whole directory when `out` is absent or empty, else file by file), every step through
/// `base`'s handle: nothing is followed out of it. The staging directory is removed on every
/// path, success or failure.
fn write_staged(base: &Dir, out: &Path, files: &Files, non_empty: bool) -> Result<()> {
    let parent_rel = out.parent().unwrap_or(Path::new(""));
    let name = out.file_name().expect("a confined new directory has a name");
    let parent = base.open_dir(parent_rel)?;
    let staging = PathBuf::from(format!(".scaffold-{:016x}", rand::random::<u64>()));
    parent.cap().create_dir(&staging).map_err(|e| parent.error(&staging, &e))?;
    let result = (|| -> Result<()> {
        for (rel, text) in files {
            let p = staging.join(rel);
            if let Some(d) = p.parent() {
                parent.cap().create_dir_all(d).map_err(|e| parent.error(d, &e))?;
            }
            parent.cap().write(&p, text).map_err(|e| parent.error(&p, &e))?;
        }
        let exists = parent.exists(Path::new(name));
        if !exists || !non_empty {
            if exists {
                parent.cap().remove_dir(name).map_err(|e| parent.error(Path::new(name), &e))?;
            }
            parent.cap().rename(&staging, parent.cap(), name).map_err(|e| {
                Error::usage(format!(
                    "cannot create the engine crate at {}: {}",
                    parent.show(Path::new(name)).display(),
                    e
                ))
            })?;
        } else {
            let out = Path::new(name);
            for (rel, _) in files {
                let to = out.join(rel);
                if let Some(d) = to.parent() {
                    parent.cap().create_dir_all(d).map_err(|e| parent.error(d, &e))?;
                }
                parent.cap().rename(staging.join(rel), parent.cap(), &to).map_err(|e| parent.error(&to, &e))?;
            }
        }
        Ok(())
    })();
    if parent.exists(&staging) {
        let _ = parent.cap().remove_dir_all(&staging);
    }
    result
}
