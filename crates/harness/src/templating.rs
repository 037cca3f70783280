//! Templating of the harness crate: the embedded template and protocol, the kernel arms and
//! optional items spliced into it, and the crate written and built per engine and feature set.
//!
//! The template (`template/main.rs`) is the harness's `main`: it reads one request, runs its command
//! and writes the reply ([`super::protocol`]); the protocol file is copied in verbatim. Spliced in per
//! engine: the kernel registry's arms for the kernels of the engine's plan (plus kernels asked for by
//! name) at the `// @arms test` and `// @arms timed` lines ([`TEST_ARMS`], [`TIMED_ARMS`]; the template
//! has no kernel arm of its own); the blocks `// @item <name>` ... `// @end` of the optional engine
//! items the engine defines ([`HarnessSpec::items`]); and, only when the engine's manifest has a
//! `[serving]` table ([`HarnessSpec::serving`]), the serving commands of `template/serving.rs` (block
//! manager, scheduler, batched step) at `// @serving mod` and `// @serving commands`, so a batch-1
//! library never has to export a block manager or a batched step. The crate's `device` module is
//! `template/device_cuda.rs` for a platform with `api = "cuda"` (device probe, NaN-filled device
//! outputs, CUDA-event timers, on-device decoding; without a CUDA device the harness replies `NoDevice`
//! and runs nothing) and `template/device_host.rs` otherwise (wall clocks, the host decode loop).

use std::path::PathBuf;

use sha2::{Digest, Sha256};

use super::{Budget, Build, Engine, Workshop};
use base::error::{Context, Result};

/// The harness source, rewritten before every build so that it cannot drift from the server's copy.
pub const HARNESS_MAIN: &str = include_str!("template/main.rs");

/// The protocol module, compiled into the harness crate verbatim (see [`protocol`]).
pub const HARNESS_PROTOCOL: &str = include_str!("protocol.rs");

/// The harness's `device` module for engines on the host (platform api `host`).
pub const HARNESS_DEVICE_HOST: &str = include_str!("template/device_host.rs");

/// The harness's `device` module for CUDA engines (platform api `cuda`): device probe, device
/// buffers, CUDA-event timers, on-device decoding.
pub const HARNESS_DEVICE_CUDA: &str = include_str!("template/device_cuda.rs");

/// What the harness of one engine calls and how it builds the engine.
#[derive(Debug, Clone, Default)]
pub struct HarnessSpec {
    /// Kernel contract ids whose harness arms are compiled in (the engine must export each one).
    pub kernels: Vec<String>,
    /// Their arms, in the same order.
    pub arms: Vec<Arm>,
    /// Cargo features of the engine crate to enable (its weight-dtype variant).
    pub features: Vec<String>,
    /// Optional engine items the harness calls (a contract's `rust.optional` names the engine
    /// defines, e.g. `stop_tokens`); the others' harness blocks are left out.
    pub items: Vec<String>,
    /// The engine's platform api (`ckb::API_HOST` or `ckb::API_CUDA`): which `device` module the
    /// harness gets, and whether it depends on cudarc. Empty: host.
    pub api: String,
    /// Whether the engine has serving constraints: the harness then compiles its serving commands
    /// (template/serving.rs), which call the engine's block manager and batched step.
    pub serving: bool,
    /// Build incrementally ([`Workshop::incremental_target_dir`]): for the correctness gates, where
    /// a one-line edit should cost a second, not a full optimised rebuild. Timing gates build
    /// without it.
    pub incremental: bool,
}

impl HarnessSpec {
    /// Whether the engine runs on a CUDA device.
    pub fn cuda(&self) -> bool {
        self.api == ckb::API_CUDA
    }
}

/// One kernel's harness code (from the kernel registry, `oracle::kernels`): the block run for a test
/// case and the block that prepares a timed call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arm {
    /// Kernel contract id, the arm's match pattern.
    pub kernel: String,
    /// Block evaluating to the case's outputs (see the template's `run_kernel`).
    pub test: String,
    /// Block evaluating to a `Timed` (see the template's `timed_kernel`).
    pub timed: String,
}

/// The serving commands of the harness (a module compiled in only for serving engines).
pub const HARNESS_SERVING: &str = include_str!("template/serving.rs");

/// Marker line of the template where the serving module is declared.
pub const SERVING_MOD: &str = "// @serving mod";
/// Marker line of the template where the serving commands are dispatched.
pub const SERVING_COMMANDS: &str = "// @serving commands";

/// Marker lines of the template where the arms go.
pub const TEST_ARMS: &str = "// @arms test";
/// See [`TEST_ARMS`].
pub const TIMED_ARMS: &str = "// @arms timed";

/// The harness source with exactly the given kernel arms, so an engine need not export kernels its
/// plan does not use: each arm is inserted at the template's [`TEST_ARMS`] / [`TIMED_ARMS`] line.
pub fn harness_source(arms: &[Arm]) -> String {
    harness_source_with(arms, &[], false)
}

/// As [`harness_source`], also keeping the template's blocks `// @item <name>` ... `// @end` of the
/// optional engine items in `items` (a contract's `rust.optional` the engine defines) and leaving
/// out the others.
///
/// With `serving`, the template's [`SERVING_MOD`] line declares the serving module
/// ([`HARNESS_SERVING`], written beside it) and its [`SERVING_COMMANDS`] line dispatches the
/// serving commands to it; without, both lines are dropped and a serving command is refused.
pub fn harness_source_with(arms: &[Arm], items: &[String], serving: bool) -> String {
    let mut out = String::with_capacity(HARNESS_MAIN.len() + arms.len() * 1024);
    let mut keep = true;
    for line in HARNESS_MAIN.lines() {
        let t = line.trim();
        let indent = &line[..line.len() - line.trim_start().len()];
        if t == SERVING_MOD || t == SERVING_COMMANDS {
            if serving && t == SERVING_MOD {
                out.push_str(&format!("{indent}mod serving;\n"));
            } else if serving {
                out.push_str(&format!(
                    "{indent}Command::BlockManager {{ num_blocks, block_size, ops }} => serving::block_manager(*num_blocks, *block_size, ops),\n\
                     {indent}Command::Batch {{ model, num_blocks, block_size, seqs, steps, tensors }} => serving::batch(model, *num_blocks, *block_size, seqs, steps, tensors),\n\
                     {indent}Command::Scheduler {{ num_blocks, block_size, max_seqs, max_batch_tokens, max_context, requests, aborts, max_steps }} => serving::scheduler(*num_blocks, *block_size, *max_seqs, *max_batch_tokens, *max_context, requests, aborts, *max_steps),\n"
                ));
            }
            continue;
        }
        if t == TEST_ARMS || t == TIMED_ARMS {
            for a in arms {
                let body = if t == TEST_ARMS { &a.test } else { &a.timed };
                out.push_str(&format!("{indent}{:?} => {},\n", a.kernel, body.trim()));
            }
            continue;
        }
        if let Some(name) = t.strip_prefix("// @item ") {
            keep = items.iter().any(|k| k == name.trim());
            continue;
        }
        if t == "// @end" {
            keep = true;
            continue;
        }
        if keep {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

impl Workshop {
    /// Write the harness crate for an engine (outside the engine's sources) and return its manifest.
    /// The harness calls only the kernels in `spec` and builds the engine with `spec`'s features.
    /// The crate's directory and package name are keyed by the engine's directory, the features and
    /// the harness's own sources: each feature set and each set of kernels gets its own package, so
    /// variants of one engine never clash, two gates on one engine with different kernels never
    /// rewrite each other's sources mid-build, and alternating between them rebuilds nothing.
    ///
    /// # Errors
    /// When the cache directory is not writable.
    pub fn write_harness(&self, engine: &Engine, spec: &HarnessSpec) -> Result<PathBuf> {
        let main = harness_source_with(&spec.arms, &spec.items, spec.serving);
        let mut h = Sha256::new();
        h.update(engine.dir.to_string_lossy().as_bytes());
        for f in &spec.features {
            h.update(b"\0");
            h.update(f.as_bytes());
        }
        h.update(b"\0");
        h.update(spec.api.as_bytes());
        h.update(b"\0");
        h.update(main.as_bytes());
        let key = format!("{:x}", h.finalize());
        let dir = self.root.join("harness").join(&key[..16]);
        std::fs::create_dir_all(dir.join("src")).internal_ctx(|| format!("cannot create {}", dir.display()))?;
        // A CUDA harness names cudarc's types and probes the driver itself; Cargo unifies this
        // requirement with the engine's cudarc (its version feature and dynamic loading).
        let cudarc = if spec.cuda() {
            "cudarc = { version = \"0.19\", default-features = false, features = [\"std\", \"driver\"] }\n"
        } else {
            ""
        };
        let manifest = format!(
            // A name per engine and feature set: builds share one target directory, and the
            // uplifted binary `target/release/<name>` of one engine must never be run for another.
            "[package]\nname = \"metainfer-harness-{}\"\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\n\
             [dependencies]\nengine = {{ path = {:?}, package = {:?}, features = {:?} }}\nsafetensors = \"0.8\"\nserde = {{ version = \"1\", features = [\"derive\"] }}\nserde_json = \"1\"\n{cudarc}\n[workspace]\n",
            &key[..16],
            engine.build_dir.to_string_lossy(),
            engine.package,
            spec.features,
        );
        // Written only when the text differs: cargo decides by modification time, so rewriting the
        // same sources would recompile the harness crate after every engine edit.
        let write = |p: PathBuf, s: &str| {
            if std::fs::read(&p).is_ok_and(|old| old == s.as_bytes()) {
                return Ok(());
            }
            std::fs::write(&p, s).internal_ctx(|| format!("cannot write {}", p.display()))
        };
        write(dir.join("Cargo.toml"), &manifest)?;
        write(dir.join("src/main.rs"), &main)?;
        write(dir.join("src/protocol.rs"), HARNESS_PROTOCOL)?;
        write(dir.join("src/device.rs"), if spec.cuda() { HARNESS_DEVICE_CUDA } else { HARNESS_DEVICE_HOST })?;
        let serving = dir.join("src/serving.rs");
        if spec.serving {
            write(serving, HARNESS_SERVING)?;
        } else {
            let _ = std::fs::remove_file(serving);
        }
        Ok(dir.join("Cargo.toml"))
    }

    /// Build the harness for an engine; returns the build, whose `executable` is the harness binary.
    ///
    /// # Errors
    /// When cargo cannot be started or the cache is not writable.
    pub fn build_harness(&self, engine: &Engine, spec: &HarnessSpec, budget: &Budget) -> Result<Build> {
        let manifest = self.write_harness(engine, spec)?;
        self.cargo_build_reading(&manifest, &[&engine.build_dir], &[], spec.incremental, budget)
    }
}
