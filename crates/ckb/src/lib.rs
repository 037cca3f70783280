//! The contract knowledge base: typed contracts, loading, schema validation, lint and search.
//!
//! The modules: `types` (the contract types; the JSON Schema every file is validated against is
//! generated from them with schemars and checked with jsonschema), `family` (the model-family and
//! forward-pass graph types, re-exported here), [`graph`] (the graph's lint, op conditions and
//! rendering), [`expr`] (the graph's expression language), `lint` (the consistency rules the schema
//! cannot express, one function per rule), and [`embedded`] (the shipped files).
//!
//! The shipped knowledge lives outside `src/`: `contracts/` (one TOML file per contract, grouped by
//! kind: kernels, components, models, platforms, failures, policies), with `skills/`, `prompts/` and
//! the two CPU example engines' sources embedded by build.rs, so `metainfer serve` works from any
//! directory. `--ckb DIR` loads a working copy instead; proposals and evolution candidates are
//! staged in its `candidates/` (or beside the ledger for the built-in CKB) and enter the CKB only by
//! promotion (new model families and platforms route provisionally before that: `ops::evolve`).
//!
//! Knows nothing of MCP, processes, models, the oracle or the ledger (tidy).

pub mod expr;
mod family;
pub mod graph;
mod lint;
mod types;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

pub use family::*;
pub use types::*;

use base::error::{Context, Error, Result};

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
    /// [`base::error::ErrorKind::Input`] listing every finding, one per line.
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
                        "no oracle implements `{}`: a kernel contract needs a kernel registry module (crates/oracle/src/kernels/)",
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
                        "no oracle mutant named `{m}`: add it to its kernel's registry module (crates/oracle/src/kernels/) or remove the field"
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
    /// [`base::error::ErrorKind::Input`] when no valid contract remains, or a finding names no file
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

    /// The contract with this id.
    ///
    /// # Errors
    /// [`base::error::ErrorKind::Usage`] naming the closest known ids.
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
        let mut hits = self.of_kind(Kind::Model).filter(|c| claims(c, architectures, model_type));
        let first = hits.next()?;
        if self.is_provisional(&first.id) {
            hits.find(|c| !self.is_provisional(&c.id)).or(Some(first))
        } else {
            Some(first)
        }
    }

    /// Staged candidates that claim config.json's `architectures` or `model_type` but do not route
    /// it, because an established family does ([`Ckb::family_for`] prefers it): they route only
    /// once promoted. Empty when the routed family is itself the candidate or none claims it.
    pub fn shadowed(&self, architectures: &[String], model_type: Option<&str>) -> Vec<&Contract> {
        let Some(routed) = self.family_for(architectures, model_type) else { return vec![] };
        self.of_kind(Kind::Model)
            .filter(|c| c.id != routed.id && self.is_provisional(&c.id) && claims(c, architectures, model_type))
            .collect()
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

/// Whether model family `c` claims a config.json with these `architectures` or this `model_type`.
fn claims(c: &Contract, architectures: &[String], model_type: Option<&str>) -> bool {
    let m = c.model.as_ref().expect("lint: model kind has a model section");
    architectures.iter().any(|a| m.architectures.contains(a))
        || model_type.is_some_and(|t| m.model_types.iter().any(|x| x == t))
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
        let entry = entry.ctx(|| format!("walking {}", dir.display()))?;
        let path = entry.path();
        let rel = path.strip_prefix(dir).unwrap_or(path);
        if !entry.file_type().is_file()
            || path.extension().and_then(|e| e.to_str()) != Some("toml")
            || rel.starts_with("candidates")
        {
            continue;
        }
        let text = base::util::read_regular_text(path, &base::util::CONTRACT_FILE)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A staged family claiming an established family's architecture does not route it, and is
    /// named as shadowed; one claiming a new architecture routes, and shadows nothing.
    #[test]
    fn a_candidate_claiming_an_established_architecture_is_shadowed_not_routed() {
        let llama = embedded_files().into_iter().find(|(p, _)| p == "models/llama.toml").unwrap().1;
        let twin = llama.replacen("id = \"model.llama\"", "id = \"model.llama_twin\"", 1);
        let novel = twin
            .replacen("id = \"model.llama_twin\"", "id = \"model.novel\"", 1)
            .replace("\"LlamaForCausalLM\"", "\"NovelForCausalLM\"")
            .replace("model_types = [\"llama\"]", "model_types = [\"novel\"]");
        let candidates = vec![("models/llama_twin.toml".to_string(), twin), ("models/novel.toml".to_string(), novel)];
        let (ckb, left_out) = Ckb::with_candidates(embedded_files(), candidates, "test".into(), None).unwrap();
        assert!(left_out.is_empty(), "{left_out:?}");
        let llama_arch = ["LlamaForCausalLM".to_string()];
        assert_eq!(ckb.family_for(&llama_arch, Some("llama")).unwrap().id, "model.llama");
        let shadowed: Vec<&str> = ckb.shadowed(&llama_arch, Some("llama")).iter().map(|c| c.id.as_str()).collect();
        assert_eq!(shadowed, ["model.llama_twin"]);
        let novel_arch = ["NovelForCausalLM".to_string()];
        assert_eq!(ckb.family_for(&novel_arch, None).unwrap().id, "model.novel");
        assert!(ckb.shadowed(&novel_arch, None).is_empty());
    }
}
