//! The contract knowledge base: typed contracts, loading, schema validation, lint and search.
//!
//! Knows nothing of MCP, processes or the ledger.

pub mod expr;
pub mod graph;
mod types;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

pub use types::*;

use crate::error::{Error, Result};

/// The shipped files, embedded at build time by build.rs.
pub mod embedded {
    include!(concat!(env!("OUT_DIR"), "/embedded.rs"));
}

/// What the server implements that contracts name: kernel contract ids with an f64 oracle, and
/// mutant names. Supplied by the caller (the kernel registry, `oracle::implemented`), since ckb knows
/// nothing of the oracle; with it, a kernel contract without an oracle or a failure contract naming an
/// unknown mutant is a finding like any other, at load, at propose and at `ckb check` alike.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Implemented {
    /// Kernel contract ids with an oracle.
    pub kernels: BTreeSet<String>,
    /// Mutant names (kernel and model-level).
    pub mutants: BTreeSet<String>,
}

/// One problem in one contract file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct Finding {
    /// File path relative to the CKB root.
    pub file: String,
    /// Field path inside the file (JSON pointer style, e.g. `/tolerance/f32/atol`), or "" for the file.
    pub field: String,
    /// What is wrong and what to change.
    pub message: String,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}: {}", self.file, self.message)
        } else {
            write!(f, "{}: field `{}`: {}", self.file, self.field, self.message)
        }
    }
}

/// A contract file left out of a knowledge base loaded with `--skip-invalid` (`Ckb::from_sources_skip_invalid`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct SkippedFile {
    /// File path relative to the CKB root.
    pub file: String,
    /// Why it was left out: its findings (field and reason, `; `-separated), or the skipped file whose
    /// contract it references.
    pub reason: String,
}

impl std::fmt::Display for SkippedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.file, self.reason)
    }
}

/// A loaded, validated knowledge base.
#[derive(Debug, Clone)]
pub struct Ckb {
    contracts: BTreeMap<String, Contract>,
    files: BTreeMap<String, String>,
    /// Where it was loaded from: `embedded` or a directory.
    pub origin: String,
    skipped: Vec<SkippedFile>,
    /// Ids of staged candidates loaded beside the CKB for routing (see [`Ckb::with_candidates`]).
    provisional: BTreeSet<String>,
    /// FNV-1a hash of the source files (paths and texts, in path order): tells whether the files
    /// on disk still are the ones loaded.
    fingerprint: u64,
}

/// Longest name part of a contract id (the name is the file name a contract is staged and
/// promoted under).
pub const MAX_ID_NAME: usize = 64;

/// The grammar of contract ids, as messages state it.
pub const ID_GRAMMAR: &str = "contract ids are `<kind>.<name>`: kind one of kernel, component, model, platform, failure, policy; name of 1 to 64 lowercase letters, digits, `_` and `-`, starting with a letter or digit (e.g. `kernel.rms_norm`, `platform.cpu-x86_64`)";

/// Split a contract id into its kind and name, checking the grammar ([`ID_GRAMMAR`]). Ids are names,
/// never paths: a valid name contains no `/`, `.` or other separator, so the file name derived from
/// it (`<kind dir>/<name>.toml`) stays inside its directory.
///
/// # Errors
/// The grammar and what is wrong with `id`.
pub fn parse_id(id: &str) -> std::result::Result<(Kind, &str), String> {
    let bad = |why: &str| format!("`{}` is not a contract id ({why}); {ID_GRAMMAR}", id.escape_debug());
    let (kind, name) = id.split_once('.').ok_or_else(|| bad("no `.` after the kind"))?;
    let kind = [Kind::Kernel, Kind::Component, Kind::Model, Kind::Platform, Kind::Failure, Kind::Policy]
        .into_iter()
        .find(|k| k.prefix() == kind)
        .ok_or_else(|| bad("unknown kind"))?;
    if name.is_empty() || name.len() > MAX_ID_NAME {
        return Err(bad("the name must have 1 to 64 characters"));
    }
    if !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-') {
        return Err(bad("the name may hold only lowercase letters, digits, `_` and `-`"));
    }
    if !name.as_bytes()[0].is_ascii_alphanumeric() {
        return Err(bad("the name must start with a letter or digit"));
    }
    Ok((kind, name))
}

/// The folder of a kind's contract files, e.g. `kernels`.
pub fn kind_dir(kind: Kind) -> &'static str {
    match kind {
        Kind::Kernel => "kernels",
        Kind::Component => "components",
        Kind::Model => "models",
        Kind::Platform => "platforms",
        Kind::Failure => "failures",
        Kind::Policy => "policies",
    }
}

/// The file (relative to a CKB or candidates root) of a new contract, derived only from its validated
/// id: `<kind dir>/<name>.toml`.
///
/// # Errors
/// An id outside the grammar.
pub fn file_for_id(id: &str) -> std::result::Result<String, String> {
    let (kind, name) = parse_id(id)?;
    Ok(format!("{}/{name}.toml", kind_dir(kind)))
}

/// FNV-1a 64-bit hash of a set of (path, text) files, in path order.
pub fn fingerprint(files: &[(String, String)]) -> u64 {
    let mut sorted: Vec<&(String, String)> = files.iter().collect();
    sorted.sort();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (p, t) in sorted {
        for b in p.bytes().chain([0u8]).chain(t.bytes()).chain([0u8]) {
            h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

impl Ckb {
    /// The knowledge base shipped inside the binary.
    ///
    /// # Errors
    /// When a shipped file is invalid (only possible in a broken build; the tests check it).
    pub fn embedded() -> Result<Ckb> {
        Ckb::from_sources(embedded_files(), "embedded".into())
    }

    /// Load every `*.toml` under `dir` (except `candidates/`).
    ///
    /// # Errors
    /// An unreadable directory, or one [`Finding`] per invalid file, all listed in the message.
    pub fn from_dir(dir: &Path) -> Result<Ckb> {
        Ckb::from_sources(read_dir_files(dir)?, dir.display().to_string())
    }

    /// Parse, validate against the schema and lint a set of (relative path, TOML text) files.
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Input`] listing every finding, one per line.
    pub fn from_sources(files: Vec<(String, String)>, origin: String) -> Result<Ckb> {
        Ckb::from_sources_checked(files, origin, None)
    }

    /// As [`Ckb::from_sources`], and with `known` a kernel contract without an oracle or an unknown
    /// mutant name is a finding too (the server's own load: see [`Implemented`]).
    ///
    /// # Errors
    /// As [`Ckb::from_sources`].
    pub fn from_sources_checked(
        files: Vec<(String, String)>,
        origin: String,
        known: Option<&Implemented>,
    ) -> Result<Ckb> {
        let (ckb, findings) = Ckb::check_sources(files, origin, known);
        match ckb {
            Some(ckb) if findings.is_empty() => Ok(ckb),
            _ => Err(Error::input(format!(
                "the contract knowledge base is invalid ({} finding(s)):\n{}",
                findings.len(),
                findings.iter().map(|f| format!("  {f}")).collect::<Vec<_>>().join("\n")
            ))),
        }
    }

    /// Contracts the server cannot check: kernel contracts without an oracle, failure contracts
    /// naming a mutant that does not exist.
    pub fn unimplemented(&self, known: &Implemented) -> Vec<Finding> {
        let mut out = Vec::new();
        for c in self.contracts.values() {
            let file = self.files.get(&c.id).cloned().unwrap_or_default();
            if c.kind == Kind::Kernel && !known.kernels.contains(&c.id) {
                out.push(Finding {
                    file: file.clone(),
                    field: "/id".into(),
                    message: format!(
                        "no oracle implements `{}`: a kernel contract needs a kernel registry module (src/oracle/kernels/)",
                        c.id
                    ),
                });
            }
            if let Some(m) = c.failure.as_ref().and_then(|f| f.mutant.as_deref())
                && !known.mutants.contains(m)
            {
                out.push(Finding {
                    file,
                    field: "/failure/mutant".into(),
                    message: format!(
                        "no oracle mutant named `{m}`: add it to its kernel's registry module (src/oracle/kernels/) or remove the field"
                    ),
                });
            }
        }
        out
    }

    /// Like [`Ckb::from_sources`], but an invalid file (not TOML, schema error, lint finding in that
    /// file, dangling reference) is left out instead of failing the load, and so, in further rounds,
    /// is every file whose contract then references a contract that was left out. The files left out
    /// are listed, in the order they were found, by [`Ckb::skipped`].
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Input`] when no valid contract remains, or a finding names no file
    /// of the set (it cannot be attributed, so nothing can be skipped for it).
    /// With `known`, a contract the server cannot check (see [`Implemented`]) is invalid too.
    pub fn from_sources_skip_invalid(
        files: Vec<(String, String)>,
        origin: String,
        known: Option<&Implemented>,
    ) -> Result<Ckb> {
        let mut remaining = files;
        let mut skipped: Vec<SkippedFile> = Vec::new();
        // Contract id -> file, for the files left out (read leniently: a schema-invalid file may still
        // name its id).
        let mut skipped_ids: BTreeMap<String, String> = BTreeMap::new();
        loop {
            let (ckb, findings) = Ckb::check_sources(remaining.clone(), origin.clone(), known);
            let ckb = ckb.expect("check_sources always returns a knowledge base");
            if findings.is_empty() {
                if ckb.contracts.is_empty() {
                    return Err(Error::input(format!(
                        "no valid contract in {origin}: every file was skipped:\n{}",
                        skipped.iter().map(|s| format!("  {s}")).collect::<Vec<_>>().join("\n")
                    )));
                }
                return Ok(Ckb { skipped, ..ckb });
            }
            let mut by_file: BTreeMap<String, Vec<Finding>> = BTreeMap::new();
            for f in findings {
                if !remaining.iter().any(|(p, _)| *p == f.file) {
                    return Err(Error::input(format!("the contract knowledge base is invalid: {f}")));
                }
                by_file.entry(f.file.clone()).or_default().push(f);
            }
            for (file, text) in remaining.iter().filter(|(p, _)| by_file.contains_key(p)) {
                let id = toml::from_str::<toml::Value>(text)
                    .ok()
                    .and_then(|v| v.get("id").and_then(|i| i.as_str()).map(str::to_string));
                if let Some(id) = id.filter(|id| ckb.file_of(id).is_none_or(|f| f == file)) {
                    skipped_ids.insert(id, file.clone());
                }
            }
            // This round's files, those invalid in themselves first, then those only left out for
            // referencing them.
            let mut round: Vec<(bool, SkippedFile)> = Vec::new();
            for (file, fs) in &by_file {
                let mut only_dependent = true;
                let reasons: Vec<String> = fs
                    .iter()
                    .map(|f| {
                        let dep = skipped_ids
                            .iter()
                            .find(|(id, _)| f.message.contains(&format!("reference `{id}` does not resolve")));
                        only_dependent &= dep.is_some();
                        match dep {
                            Some((id, from)) => {
                                format!("field `{}` references `{id}`, which was skipped with {from}", f.field)
                            }
                            None if f.field.is_empty() => f.message.clone(),
                            None => format!("field `{}`: {}", f.field, f.message),
                        }
                    })
                    .collect();
                round.push((only_dependent, SkippedFile { file: file.clone(), reason: reasons.join("; ") }));
            }
            round.sort_by_key(|(dependent, _)| *dependent);
            skipped.extend(round.into_iter().map(|(_, s)| s));
            remaining.retain(|(p, _)| !by_file.contains_key(p));
        }
    }

    /// The files left out when loading with [`Ckb::from_sources_skip_invalid`]; empty otherwise.
    pub fn skipped(&self) -> &[SkippedFile] {
        &self.skipped
    }

    /// Like [`Ckb::from_sources`] but returns all findings instead of failing: `ckb check` uses it.
    /// With `known`, also every kernel contract without an oracle and every unknown mutant name.
    pub fn check_sources(
        files: Vec<(String, String)>,
        origin: String,
        known: Option<&Implemented>,
    ) -> (Option<Ckb>, Vec<Finding>) {
        let fingerprint = fingerprint(&files);
        let schema = contract_schema();
        let validator = jsonschema::validator_for(&schema).expect("the generated contract schema is valid");
        let mut findings = Vec::new();
        let mut contracts = BTreeMap::new();
        let mut file_of = BTreeMap::new();
        for (file, text) in &files {
            let value: toml::Value = match toml::from_str(text) {
                Ok(v) => v,
                Err(e) => {
                    findings.push(Finding {
                        file: file.clone(),
                        field: String::new(),
                        message: format!("not valid TOML: {e}"),
                    });
                    continue;
                }
            };
            let json = serde_json::to_value(&value).expect("TOML values convert to JSON");
            let errors: Vec<_> = validator.iter_errors(&json).collect();
            if !errors.is_empty() {
                for e in errors {
                    // A missing property is named by its own path, not its parent's.
                    let mut field = e.instance_path().to_string();
                    if let jsonschema::error::ValidationErrorKind::Required { property } = e.kind() {
                        field = format!("{field}/{}", property.as_str().unwrap_or_default());
                    }
                    findings.push(Finding { file: file.clone(), field, message: e.to_string() });
                }
                continue;
            }
            match serde_json::from_value::<Contract>(json) {
                Ok(c) => {
                    if let Some(prev) = file_of.get(&c.id) {
                        findings.push(Finding {
                            file: file.clone(),
                            field: "/id".into(),
                            message: format!("duplicate id `{}`, also defined in {prev}", c.id),
                        });
                        continue;
                    }
                    file_of.insert(c.id.clone(), file.clone());
                    contracts.insert(c.id.clone(), c);
                }
                Err(e) => findings.push(Finding { file: file.clone(), field: String::new(), message: e.to_string() }),
            }
        }
        let ckb =
            Ckb { contracts, files: file_of, origin, skipped: Vec::new(), provisional: BTreeSet::new(), fingerprint };
        findings.extend(ckb.lint());
        if let Some(k) = known {
            findings.extend(ckb.unimplemented(k));
        }
        (Some(ckb), findings)
    }

    /// Consistency rules the schema cannot express. Each finding names file and field.
    pub fn lint(&self) -> Vec<Finding> {
        let mut out = Vec::new();
        let ids: BTreeSet<&str> = self.contracts.keys().map(String::as_str).collect();
        for c in self.contracts.values() {
            let file = self.files.get(&c.id).cloned().unwrap_or_default();
            let mut bad =
                |field: &str, message: String| out.push(Finding { file: file.clone(), field: field.into(), message });
            let prefix = c.kind.prefix();
            match parse_id(&c.id) {
                Err(e) => bad("/id", e),
                Ok((kind, _)) if kind != c.kind => {
                    bad("/id", format!("id `{}` must be `{prefix}.<name>` for kind {prefix}", c.id))
                }
                Ok(_) => {}
            }
            if c.sources.is_empty() {
                bad("/sources", "at least one source is required: say where the knowledge comes from".into());
            }
            let mut refs: Vec<(&str, &String)> = Vec::new();
            refs.extend(c.failure_modes.iter().map(|r| ("/failure_modes", r)));
            refs.extend(c.requires.iter().map(|r| ("/requires", r)));
            if let Some(m) = &c.model {
                refs.extend(m.kernels.iter().map(|r| ("/model/kernels", r)));
                refs.extend(m.components.iter().map(|r| ("/model/components", r)));
                for k in &m.kernels {
                    if !k.starts_with("kernel.") {
                        bad("/model/kernels", format!("`{k}` is not a kernel id"));
                    }
                }
                for k in &m.components {
                    if !k.starts_with("component.") {
                        bad("/model/components", format!("`{k}` is not a component id"));
                    }
                }
                for (i, f) in m.features.iter().enumerate() {
                    if !types::FAMILY_FEATURES.iter().any(|(known, _)| known == f) {
                        bad(
                            &format!("/model/features/{i}"),
                            format!(
                                "unknown feature `{f}`: the reference forward pass implements only {}; describe a new difference in the forward pass with these, or add the feature to the server (oracle::llama and model::resolve) first",
                                types::FAMILY_FEATURES.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ")
                            ),
                        );
                    }
                }
            }
            if let Some(g) = c.model.as_ref().and_then(|m| m.graph.as_ref().map(|g| (g, m))) {
                for (field, message) in graph::lint_graph(g.0, g.1) {
                    bad(&field, message);
                }
            }
            if let Some(f) = &c.failure {
                refs.extend(f.applies_to.iter().map(|r| ("/failure/applies_to", r)));
                // A rewrite names nodes of the graphs of the families it applies to.
                if let Some(rw) = &f.rewrite {
                    if rw.is_empty() {
                        bad(
                            "/failure/rewrite",
                            "the rewrite changes nothing: give skip, set, swap, weights or op_weights".into(),
                        );
                    }
                    for key in rw.set.keys().filter(|k| !k.contains('.')) {
                        bad("/failure/rewrite/set", format!("`{key}`: write node.param"));
                    }
                    for (field, map) in [("weights", &rw.weights), ("op_weights", &rw.op_weights)] {
                        for (key, how) in map {
                            if !WEIGHT_REWRITES.contains(&how.as_str()) {
                                bad(
                                    &format!("/failure/rewrite/{field}"),
                                    format!("`{key}` = `{how}`: use one of {}", WEIGHT_REWRITES.join(", ")),
                                );
                            }
                            let Some((head, slot)) = key.split_once('.') else {
                                bad(
                                    &format!("/failure/rewrite/{field}"),
                                    format!("`{key}`: write <node or op>.<slot>"),
                                );
                                continue;
                            };
                            if field == "op_weights" {
                                let slots = GRAPH_OPS.iter().find(|o| o.name == head).map(|o| o.weights);
                                if !slots.is_some_and(|w| w.iter().any(|s| s.trim_end_matches('?') == slot)) {
                                    bad(
                                        "/failure/rewrite/op_weights",
                                        format!("`{key}`: `{head}` is no graph op with a weight slot `{slot}`"),
                                    );
                                }
                            }
                        }
                    }
                    for fam in &f.applies_to {
                        let Some(g) =
                            self.contracts.get(fam).and_then(|m| m.model.as_ref()).and_then(|m| m.graph.as_ref())
                        else {
                            continue;
                        };
                        let all = || g.prologue.iter().chain(&g.layer).chain(&g.epilogue);
                        for node in rw.nodes() {
                            if !all().any(|n| n.name == node) {
                                bad(
                                    "/failure/rewrite",
                                    format!("node `{node}` is not in {fam}'s [model.graph]: the rewrite cannot apply"),
                                );
                            }
                        }
                    }
                }
            }
            if let Some(p) = &c.platform {
                refs.extend(p.kernel_guidance.keys().map(|r| ("/platform/kernel_guidance", r)));
            }
            for (field, r) in refs {
                if !ids.contains(r.as_str()) {
                    bad(field, format!("reference `{r}` does not resolve to any contract"));
                }
            }
            for f in &c.failure_modes {
                if !f.starts_with("failure.") {
                    bad("/failure_modes", format!("`{f}` is not a failure-mode id"));
                }
            }
            let section = |present: bool, name: &str, bad: &mut dyn FnMut(&str, String)| {
                let wanted = match name {
                    "model" => c.kind == Kind::Model,
                    "platform" => c.kind == Kind::Platform,
                    "policy" => c.kind == Kind::Policy,
                    _ => c.kind == Kind::Failure,
                };
                if present && !wanted {
                    bad(&format!("/{name}"), format!("a `{name}` section belongs only to kind {name}"));
                }
                if !present && wanted {
                    bad(&format!("/{name}"), format!("kind {name} needs a `[{name}]` section"));
                }
            };
            section(c.model.is_some(), "model", &mut bad);
            section(c.platform.is_some(), "platform", &mut bad);
            section(c.failure.is_some(), "failure", &mut bad);
            section(c.policy.is_some(), "policy", &mut bad);
            if c.kind == Kind::Kernel {
                if c.math.is_empty() {
                    bad("/math", "a kernel needs its exact semantics in `math`".into());
                }
                if c.pseudocode.is_empty() {
                    bad("/pseudocode", "a kernel needs pseudocode".into());
                }
                if !c.tolerance.contains_key("f32") {
                    bad("/tolerance", "a kernel needs a tolerance for f32 with its reasoning".into());
                }
                if c.test_cases.is_empty() {
                    bad("/test_cases", "a kernel needs at least one test case".into());
                }
                if c.failure_modes.is_empty() {
                    bad("/failure_modes", "a kernel needs at least one failure mode".into());
                }
                if c.rust.is_none() {
                    bad("/rust", "a kernel needs the Rust signature the engine exposes".into());
                }
                if c.phase != Some(Phase::Kernels) {
                    bad("/phase", "a kernel belongs to phase `kernels`".into());
                }
            }
            if let Some(v) = &c.variant {
                if c.kind != Kind::Kernel {
                    bad("/variant", "a `variant` section belongs only to kind kernel".into());
                }
                match self.contracts.get(&v.of) {
                    Some(of) if of.kind == Kind::Kernel && of.variant.is_none() => {}
                    Some(_) => bad("/variant/of", format!("`{}` is not a plain kernel contract", v.of)),
                    None => bad("/variant/of", format!("reference `{}` does not resolve to any contract", v.of)),
                }
                if v.weight_dtype == "f32" || !types::WEIGHT_DTYPES.contains(&v.weight_dtype.as_str()) {
                    bad(
                        "/variant/weight_dtype",
                        format!(
                            "`{}` is not a weight dtype with a variant; use one of {}",
                            v.weight_dtype,
                            types::WEIGHT_DTYPES[1..].join(", ")
                        ),
                    );
                }
                if self.contracts.values().any(|o| {
                    o.id < c.id && o.variant.as_ref().is_some_and(|w| w.of == v.of && w.weight_dtype == v.weight_dtype)
                }) {
                    bad("/variant", format!("another kernel is already the {} variant of {}", v.weight_dtype, v.of));
                }
            }
            if let Some(cu) = &c.cuda {
                if c.kind != Kind::Kernel {
                    bad("/cuda", "a `cuda` section belongs only to kind kernel".into());
                }
                if !cu.skeleton.contains("pub fn ") {
                    bad("/cuda/skeleton", "the CUDA skeleton needs the `pub fn` the gates call".into());
                }
                if !cu.tolerance.contains_key("f32") {
                    bad("/cuda/tolerance", "the CUDA variant needs a tolerance for f32 with its reasoning".into());
                }
                if cu.launch.trim().is_empty() {
                    bad("/cuda/launch", "say how the work maps onto threads, warps and blocks".into());
                }
                for (dtype, t) in &cu.tolerance {
                    if !(t.atol >= 0.0 && t.rtol >= 0.0 && t.atol.is_finite() && t.rtol.is_finite()) {
                        bad(&format!("/cuda/tolerance/{dtype}"), "atol and rtol must be finite and >= 0".into());
                    }
                    if t.reasoning.trim().is_empty() {
                        bad(&format!("/cuda/tolerance/{dtype}/reasoning"), "say why these numbers".into());
                    }
                }
            }
            if let Some(p) = &c.platform {
                if p.api != types::API_HOST && p.api != types::API_CUDA {
                    bad(
                        "/platform/api",
                        format!("unknown api `{}`; use `{}` or `{}`", p.api, types::API_HOST, types::API_CUDA),
                    );
                }
                if (p.api == types::API_CUDA) != p.gpu.is_some() {
                    bad(
                        "/platform/gpu",
                        "a `[platform.gpu]` section goes with api = \"cuda\", and only with it".into(),
                    );
                }
                for (i, comp) in p.components.iter().enumerate() {
                    match self.contracts.get(comp) {
                        Some(o) if o.kind == Kind::Component => {}
                        Some(_) => bad(&format!("/platform/components/{i}"), format!("`{comp}` is not a component")),
                        None => bad(
                            &format!("/platform/components/{i}"),
                            format!("reference `{comp}` does not resolve to any contract"),
                        ),
                    }
                }
                if let Some(g) = &p.gpu {
                    if g.devices.is_empty() {
                        bad("/platform/gpu/devices", "name at least one device model with its bandwidth".into());
                    }
                    let figures = [&g.sm_count, &g.l2_mib, &g.smem_per_sm_kib]
                        .into_iter()
                        .chain(g.peak_tflops.values())
                        .chain(g.devices.iter().flat_map(|d| [&d.memory_gb, &d.hbm_gbs]))
                        .chain(g.devices.iter().filter_map(|d| d.measured_gbs.as_ref()));
                    for f in figures {
                        if !(f.value > 0.0 && f.value.is_finite()) || f.source.trim().is_empty() {
                            bad("/platform/gpu", format!("figure {} must be positive and name its source", f.value));
                        }
                    }
                }
            }
            if let Some(p) = &c.policy {
                for (target, entries) in &p.permit {
                    for (i, e) in entries.iter().enumerate() {
                        let probe = e.pattern.trim_end_matches('*');
                        if let Some(d) = p.deny.iter().find(|d| d.matches(probe)) {
                            bad(
                                &format!("/policy/permit/{target}/{i}"),
                                format!("permitted `{}` is also denied by pattern `{}`", e.pattern, d.pattern),
                            );
                        }
                    }
                }
            }
            for (dtype, t) in &c.tolerance {
                if !(t.atol >= 0.0 && t.rtol >= 0.0 && t.atol.is_finite() && t.rtol.is_finite()) {
                    bad(&format!("/tolerance/{dtype}"), "atol and rtol must be finite and >= 0".into());
                }
                if t.reasoning.trim().is_empty() {
                    bad(&format!("/tolerance/{dtype}/reasoning"), "say why these numbers".into());
                }
            }
            for (j, p) in c.parameters.iter().enumerate() {
                for (i, q) in c.parameters[..j].iter().enumerate() {
                    if p.name != q.name {
                        continue;
                    }
                    if let (Some(a), Some(b)) = (&q.default, &p.default)
                        && !same_value(a, b)
                    {
                        bad(
                            &format!("/parameters/{j}/default"),
                            format!(
                                "parameter `{}` is stated twice with different defaults: {a:?} (/parameters/{i}) and {b:?} (/parameters/{j}); keep one entry with the right value",
                                p.name
                            ),
                        );
                    }
                    if q.dtype != p.dtype {
                        bad(
                            &format!("/parameters/{j}/dtype"),
                            format!(
                                "parameter `{}` is stated twice with different dtypes: {:?} (/parameters/{i}) and {:?} (/parameters/{j}); keep one entry with the right dtype",
                                p.name, q.dtype, p.dtype
                            ),
                        );
                    }
                }
            }
            if let Some(m) = &c.model {
                for (j, f) in m.config.iter().enumerate() {
                    for (i, g) in m.config[..j].iter().enumerate() {
                        if let (true, Some(a), Some(b)) = (g.key == f.key, &g.default, &f.default)
                            && !same_value(a, b)
                        {
                            bad(
                                &format!("/model/config/{j}/default"),
                                format!(
                                    "config key `{}` is stated twice with different defaults: {a:?} (/model/config/{i}) and {b:?} (/model/config/{j}); keep one entry with the default of the HF configuration class",
                                    f.key
                                ),
                            );
                        }
                    }
                    if let Some(t) = f.value_type.as_deref()
                        && !CONFIG_TYPES.contains(&t)
                    {
                        bad(
                            &format!("/model/config/{j}/type"),
                            format!("config key `{}` has type {t:?}; use one of {}", f.key, CONFIG_TYPES.join(", ")),
                        );
                    }
                    if f.per_layer && f.value_type.as_deref() != Some("list") {
                        bad(
                            &format!("/model/config/{j}/per_layer"),
                            format!("config key `{}` is per_layer but not of type \"list\"", f.key),
                        );
                    }
                    if let Some(d) = &f.default
                        && !f.supported.is_empty()
                        && !f.supported.iter().any(|v| same_value(v, d))
                    {
                        bad(
                            &format!("/model/config/{j}/default"),
                            format!(
                                "config key `{}` has default {d:?}, which is not among its supported values {:?}; add it to `supported` or correct the default",
                                f.key, f.supported
                            ),
                        );
                    }
                }
            }
            for (i, case) in c.test_cases.iter().enumerate() {
                for (dim, [lo, hi]) in &case.dims {
                    if lo > hi || *lo == 0 {
                        bad(
                            &format!("/test_cases/{i}/dims/{dim}"),
                            format!("range [{lo}, {hi}] must satisfy 1 <= lo <= hi"),
                        );
                    }
                }
            }
        }
        out.extend(self.lint_checkpoints());
        out
    }

    /// Lint of what checkpoints need from contracts: every family states a logits tolerance for each
    /// weight dtype and a dtype policy covering each of its weight roles once (the 2-D ones at the
    /// weight dtype, as the reference rounds them); tokenizer sections only on components; optional
    /// skeleton items name functions of the skeleton.
    fn lint_checkpoints(&self) -> Vec<Finding> {
        let mut out = Vec::new();
        for c in self.contracts.values() {
            let file = self.files.get(&c.id).cloned().unwrap_or_default();
            let mut bad =
                |field: &str, message: String| out.push(Finding { file: file.clone(), field: field.into(), message });
            if let Some(m) = &c.model {
                for d in types::WEIGHT_DTYPES {
                    if !m.logits_tolerance.contains_key(*d) {
                        bad(
                            "/model/logits_tolerance",
                            format!(
                                "no logits tolerance for weight dtype `{d}`; every family states one per weight dtype ({}) with its reasoning",
                                types::WEIGHT_DTYPES.join(", ")
                            ),
                        );
                    }
                }
                for (d, t) in &m.logits_tolerance {
                    if !types::WEIGHT_DTYPES.contains(&d.as_str()) {
                        bad(&format!("/model/logits_tolerance/{d}"), format!("`{d}` is not a weight dtype"));
                    }
                    if !(t.atol >= 0.0 && t.rtol >= 0.0 && t.atol.is_finite() && t.rtol.is_finite()) {
                        bad(&format!("/model/logits_tolerance/{d}"), "atol and rtol must be finite and >= 0".into());
                    }
                    if t.reasoning.trim().is_empty() {
                        bad(&format!("/model/logits_tolerance/{d}/reasoning"), "say why these numbers".into());
                    }
                }
                if let Some(r) = &m.rounding_margin {
                    if !(r.factor.is_finite() && (1.0..=1000.0).contains(&r.factor)) {
                        bad(
                            "/model/rounding_margin/factor",
                            format!(
                                "{} is no multiple of a rounding error: give a finite factor in 1..=1000",
                                r.factor
                            ),
                        );
                    }
                    if r.reasoning.trim().is_empty() {
                        bad("/model/rounding_margin/reasoning", "say why this factor".into());
                    }
                }
                match &m.dtype_policy {
                    None => bad(
                        "/model/dtype_policy",
                        "a family needs a dtype policy: which weight roles an engine stores at its weight dtype and which stay f32".into(),
                    ),
                    Some(p) => {
                        let roles: BTreeSet<&str> = m.weights.iter().map(|w| w.role.as_str()).collect();
                        let matrices: BTreeSet<&str> =
                            m.weights.iter().filter(|w| w.shape.len() == 2).map(|w| w.role.as_str()).collect();
                        for (list, field) in [(&p.at_weight_dtype, "at_weight_dtype"), (&p.keep_f32, "keep_f32")] {
                            for r in list {
                                if !roles.contains(r.as_str()) {
                                    bad(&format!("/model/dtype_policy/{field}"), format!("`{r}` is not a weight role of this family"));
                                }
                            }
                        }
                        for r in &roles {
                            let (a, k) = (p.at_weight_dtype.iter().any(|x| x == r), p.keep_f32.iter().any(|x| x == r));
                            if a == k {
                                bad(
                                    "/model/dtype_policy",
                                    format!("weight role `{r}` must be in exactly one of at_weight_dtype and keep_f32"),
                                );
                            } else if a != matrices.contains(r) {
                                bad(
                                    "/model/dtype_policy/at_weight_dtype",
                                    format!(
                                        "weight role `{r}`: the reference rounds exactly the 2-D weights to the weight dtype, so at_weight_dtype must list exactly those"
                                    ),
                                );
                            }
                        }
                        if p.reasoning.trim().is_empty() {
                            bad("/model/dtype_policy/reasoning", "say why these tensors stay f32".into());
                        }
                    }
                }
            }
            if let Some(t) = &c.tokenizer {
                if c.kind != Kind::Component {
                    bad("/tokenizer", "a `tokenizer` section belongs only to kind component".into());
                }
                if c.rust.as_ref().is_none_or(|r| r.module != "tokenizer") {
                    bad("/rust/module", "a tokenizer contract fixes the engine's `tokenizer` module".into());
                }
                let mut names = BTreeSet::new();
                for (i, p) in t.split_patterns.iter().enumerate() {
                    if !names.insert(p.name.as_str()) {
                        bad(
                            &format!("/tokenizer/split_patterns/{i}/name"),
                            format!("pattern name `{}` used twice", p.name),
                        );
                    }
                    if p.regex.is_empty() {
                        bad(&format!("/tokenizer/split_patterns/{i}/regex"), "empty pattern".into());
                    }
                }
            }
            if let Some(r) = &c.rust {
                let fns: Vec<&str> = r
                    .skeleton
                    .split("pub fn ")
                    .skip(1)
                    .filter_map(|rest| rest.split(['(', '<']).next().map(str::trim))
                    .collect();
                for (i, o) in r.optional.iter().enumerate() {
                    if !fns.contains(&o.as_str()) {
                        bad(&format!("/rust/optional/{i}"), format!("`{o}` is not a function of the skeleton"));
                    }
                }
            }
        }
        out
    }

    /// The contract with this id.
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Usage`] naming the closest known ids.
    pub fn get(&self, id: &str) -> Result<&Contract> {
        self.contracts.get(id).ok_or_else(|| {
            let near: Vec<&str> = self
                .contracts
                .keys()
                .filter(|k| {
                    let tail = id.rsplit('.').next().unwrap_or(id);
                    k.contains(tail) || id.contains(k.rsplit('.').next().unwrap_or(k))
                })
                .map(String::as_str)
                .take(5)
                .collect();
            Error::usage(format!(
                "unknown contract id `{id}`{}; `metainfer contract search TEXT` lists ids",
                if near.is_empty() { String::new() } else { format!(" (did you mean: {})", near.join(", ")) }
            ))
        })
    }

    /// All contracts, ordered by id.
    pub fn all(&self) -> impl Iterator<Item = &Contract> {
        self.contracts.values()
    }

    /// Contracts of one kind, ordered by id.
    pub fn of_kind(&self, kind: Kind) -> impl Iterator<Item = &Contract> {
        self.contracts.values().filter(move |c| c.kind == kind)
    }

    /// File (relative to the CKB root) a contract was loaded from.
    pub fn file_of(&self, id: &str) -> Option<&str> {
        self.files.get(id).map(String::as_str)
    }

    /// Case-insensitive search over id, summary, math and pseudocode. Every word of `text` must
    /// occur; results are ranked by where the words occur (id > summary > body).
    pub fn search(&self, text: &str) -> Vec<&Contract> {
        let words: Vec<String> = text.split_whitespace().map(str::to_lowercase).collect();
        let mut hits: Vec<(u32, &Contract)> = self
            .contracts
            .values()
            .filter_map(|c| {
                let id = c.id.to_lowercase();
                let summary = c.summary.to_lowercase();
                let body = format!(
                    "{} {} {}",
                    c.math,
                    c.pseudocode,
                    c.failure.as_ref().map(|f| f.symptom.as_str()).unwrap_or("")
                )
                .to_lowercase();
                let mut score = 0;
                for w in &words {
                    // A word that is the id's last part (`rope` for kernel.rope) ranks above one inside it.
                    let s = if id == *w || id.rsplit('.').next() == Some(w.as_str()) {
                        8
                    } else if id.contains(w.as_str()) {
                        4
                    } else if summary.contains(w.as_str()) {
                        2
                    } else if body.contains(w.as_str()) {
                        1
                    } else {
                        return None;
                    };
                    score += s;
                }
                Some((score, c))
            })
            .collect();
        hits.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.id.cmp(&b.1.id)));
        hits.into_iter().map(|(_, c)| c).collect()
    }

    /// The model-family contract routed from config.json's `architectures` or `model_type`. An
    /// established contract is preferred to a provisional one that claims the same architecture.
    pub fn family_for(&self, architectures: &[String], model_type: Option<&str>) -> Option<&Contract> {
        let routes = |c: &&Contract| {
            let m = c.model.as_ref().expect("lint: model kind has a model section");
            architectures.iter().any(|a| m.architectures.contains(a))
                || model_type.is_some_and(|t| m.model_types.iter().any(|x| x == t))
        };
        let mut hits = self.of_kind(Kind::Model).filter(routes);
        let first = hits.next()?;
        if self.is_provisional(&first.id) {
            hits.find(|c| !self.is_provisional(&c.id)).or(Some(first))
        } else {
            Some(first)
        }
    }

    /// The platform contract for a `--target` name (an established one before a provisional one).
    pub fn platform_for(&self, target: &str) -> Option<&Contract> {
        let mut hits = self.of_kind(Kind::Platform).filter(|c| c.platform.as_ref().is_some_and(|p| p.target == target));
        let first = hits.next()?;
        if self.is_provisional(&first.id) {
            hits.find(|c| !self.is_provisional(&c.id)).or(Some(first))
        } else {
            Some(first)
        }
    }

    /// The platform contract of `target`: the one named `id` (which must be a platform contract of
    /// that target), else the only established one for `target` ([`Ckb::platform_for`]). None when
    /// the target has no platform contract.
    ///
    /// # Errors
    /// The reason, in words: `id` is unknown, not a platform, or of another target; or several
    /// platforms share `target` (e.g. `cuda`: sm_80 and sm_90) and none was named.
    pub fn platform_of(&self, target: &str, id: Option<&str>) -> std::result::Result<Option<&Contract>, String> {
        let of_target = |c: &&Contract| c.platform.as_ref().is_some_and(|p| p.target == target);
        if let Some(id) = id {
            let c = self.get(id).map_err(|e| e.message)?;
            return match &c.platform {
                Some(p) if p.target == target => Ok(Some(c)),
                Some(p) => Err(format!("{id} is a platform of target `{}`, not `{target}`", p.target)),
                None => Err(format!("{id} is not a platform contract")),
            };
        }
        let established: Vec<&Contract> =
            self.of_kind(Kind::Platform).filter(of_target).filter(|c| !self.is_provisional(&c.id)).collect();
        if established.len() > 1 {
            return Err(format!(
                "target `{target}` has {} platform contracts ({}); name one as the platform",
                established.len(),
                established.iter().map(|c| c.id.as_str()).collect::<Vec<_>>().join(", ")
            ));
        }
        Ok(self.platform_for(target))
    }

    /// The kernel contracts an engine of `family` with weights stored in `dtype` implements: the
    /// family's kernels, each replaced by its weight-dtype variant (`[variant]` of a kernel contract,
    /// e.g. `kernel.linear_int8` for `kernel.linear` at `int8`) where one exists.
    ///
    /// # Errors
    /// The reason, in words, when `dtype` is not a weight dtype or no kernel of the family has a
    /// variant for it (nothing would read weights in that dtype).
    pub fn kernels_for(&self, family: &Contract, dtype: &str) -> std::result::Result<Vec<String>, String> {
        if !WEIGHT_DTYPES.contains(&dtype) {
            return Err(format!("`{dtype}` is not a weight dtype; use one of {}", WEIGHT_DTYPES.join(", ")));
        }
        let m = family.model.as_ref().ok_or_else(|| format!("{} is not a model-family contract", family.id))?;
        let mut replaced = false;
        let kernels = m
            .kernels
            .iter()
            .map(|k| {
                let variant = self
                    .of_kind(Kind::Kernel)
                    .find(|c| c.variant.as_ref().is_some_and(|v| &v.of == k && v.weight_dtype == dtype));
                match variant {
                    Some(v) => {
                        replaced = true;
                        v.id.clone()
                    }
                    None => k.clone(),
                }
            })
            .collect();
        if dtype != "f32" && !replaced {
            return Err(format!(
                "no kernel contract of {} has a variant for {dtype} weights (a kernel contract with [variant] of = one of its kernels, weight_dtype = \"{dtype}\")",
                family.id
            ));
        }
        Ok(kernels)
    }

    /// Whether `id` is a staged candidate loaded for routing only (not yet promoted into the CKB).
    pub fn is_provisional(&self, id: &str) -> bool {
        self.provisional.contains(id)
    }

    /// Ids of the provisional contracts, ordered.
    pub fn provisional(&self) -> impl Iterator<Item = &str> {
        self.provisional.iter().map(String::as_str)
    }

    /// FNV-1a hash of the files this CKB was loaded from (see [`fingerprint`]).
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The CKB of `files` plus those staged `candidates` that may route engines before promotion:
    /// new ids (not amendments) of kind model or platform, each valid (schema and lint) together
    /// with `files`. They are marked provisional: established contracts route first, outcomes
    /// record them as `id@version` like any contract, and promotion (on a passing gate's evidence)
    /// makes them part of the CKB. Candidates of other kinds or amendments wait for promotion.
    ///
    /// Returns the CKB and, per candidate left out for being invalid, its findings (file paths
    /// prefixed `candidates/`).
    ///
    /// # Errors
    /// When `files` themselves are not a valid CKB.
    pub fn with_candidates(
        files: Vec<(String, String)>,
        candidates: Vec<(String, String)>,
        origin: String,
        known: Option<&Implemented>,
    ) -> Result<(Ckb, Vec<Finding>)> {
        let base = Ckb::from_sources_checked(files.clone(), origin.clone(), known)?;
        let fingerprint = base.fingerprint;
        let mut accepted: Vec<(String, String)> = Vec::new();
        let mut ids = BTreeSet::new();
        let mut left_out = Vec::new();
        for (rel, text) in candidates {
            let Ok(c) = toml::from_str::<Contract>(&text) else { continue };
            if !matches!(c.kind, Kind::Model | Kind::Platform)
                || base.contracts.contains_key(&c.id)
                || ids.contains(&c.id)
            {
                continue;
            }
            let path = format!("candidates/{rel}");
            let mut trial = files.clone();
            trial.push((path.clone(), text.clone()));
            let (_, findings) = Ckb::check_sources(trial, origin.clone(), known);
            if findings.is_empty() {
                ids.insert(c.id);
                accepted.push((path, text));
            } else {
                left_out.extend(findings);
            }
        }
        if accepted.is_empty() {
            return Ok((base, left_out));
        }
        let mut all = files;
        all.extend(accepted);
        let (ckb, findings) = Ckb::check_sources(all, origin, known);
        let mut ckb = ckb.expect("check_sources always returns a CKB");
        if !findings.is_empty() {
            // Candidates valid one by one but not together (e.g. two with one id): none routes.
            left_out.extend(findings);
            return Ok((base, left_out));
        }
        ckb.provisional = ids;
        ckb.fingerprint = fingerprint;
        Ok((ckb, left_out))
    }
}

/// Whether two values stated as text are the same value: equal as numbers when both parse as
/// numbers (`"10000"` and `"1e4"`), else equal as trimmed text.
fn same_value(a: &str, b: &str) -> bool {
    let (a, b) = (a.trim(), b.trim());
    match (a.parse::<f64>(), b.parse::<f64>()) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

/// The contract files under `dir` as (path relative to `dir`, text), in path order; `candidates/` is
/// skipped (staged knowledge is not part of the CKB).
///
/// # Errors
/// When `dir` is not a directory or a file cannot be read.
pub fn read_dir_files(dir: &Path) -> Result<Vec<(String, String)>> {
    if !dir.is_dir() {
        return Err(Error::usage(format!("CKB directory {} does not exist or is not a directory", dir.display())));
    }
    let mut files = Vec::new();
    for entry in walkdir::WalkDir::new(dir).follow_links(false).sort_by_file_name() {
        let entry = entry.map_err(|e| Error::input(format!("walking {}: {e}", dir.display())))?;
        let path = entry.path();
        let rel = path.strip_prefix(dir).unwrap_or(path);
        if !entry.file_type().is_file()
            || path.extension().and_then(|e| e.to_str()) != Some("toml")
            || rel.starts_with("candidates")
        {
            continue;
        }
        let text = crate::util::read_regular_text(path, &crate::util::CONTRACT_FILE)?;
        files.push((rel.to_string_lossy().replace('\\', "/"), text));
    }
    Ok(files)
}

/// The shipped contract files as (path, text).
pub fn embedded_files() -> Vec<(String, String)> {
    embedded::CONTRACTS.iter().map(|(p, s)| (p.to_string(), s.to_string())).collect()
}

impl Ckb {
    /// A coverage report in Markdown: model families (architectures, kernels, components), platforms
    /// (target, dtypes) and the family x platform x dtype matrix the CKB covers.
    pub fn coverage_report(&self) -> String {
        let mut s = format!("# CKB coverage ({} contracts, {})\n\n", self.contracts.len(), self.origin);
        for kind in [Kind::Kernel, Kind::Component, Kind::Model, Kind::Platform, Kind::Failure, Kind::Policy] {
            let ids: Vec<String> = self.of_kind(kind).map(|c| format!("{}@{}", c.id, c.version)).collect();
            s += &format!("- {} ({}): {}\n", kind.prefix(), ids.len(), ids.join(", "));
        }
        for f in &self.skipped {
            s += &format!("- skipped (invalid): {f}\n");
        }
        s += "\n| family | architectures | platform | target | dtypes |\n|---|---|---|---|---|\n";
        for m in self.of_kind(Kind::Model) {
            let fam = m.model.as_ref().expect("lint: model section");
            for p in self.of_kind(Kind::Platform) {
                let plat = p.platform.as_ref().expect("lint: platform section");
                s += &format!(
                    "| {} | {} | {} | {} | {} |\n",
                    m.id,
                    fam.architectures.join(", "),
                    p.id,
                    plat.target,
                    plat.dtypes.join(", ")
                );
            }
        }
        s
    }
}
