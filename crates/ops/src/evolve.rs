//! Knowledge-base evolution from the ledger, and contract proposals.
//!
//! - evolve_knowledge: clusters recurring failures that no failure mode explains (same gate, same
//!   contract, same error shape; compile errors by error code and the contract hinted; a diverging
//!   verify by the graph node it first diverges at) and stages a schema-valid candidate failure-mode
//!   contract per cluster, with the outcome ids as evidence.
//! - propose_contract ([`propose`]): validates a new or amended contract (schema + lint, against the
//!   CKB) and, for a model family with a graph, dry-runs its reference on a small checkpoint written
//!   from the proposal (six steps, every logit finite; a failure is a finding at `/model/graph`);
//!   then stages it. Refused: findings, nothing staged.
//! - promote: moves a staged contract into the CKB working copy when the ledger holds evidence (for
//!   a model family, a passing `ckb conformance` of exactly its text; for the others, a passing gate
//!   outcome that ran under it) or when a person forces it.
//!
//! Nothing enters the CKB without promotion: candidates live in `Ctx::candidates_dir`
//! (`<ckb>/candidates` for a working copy, else beside the ledger).
//!
//! Provisional routing: `Ctx::live` (what every plan, scaffold, gate and synth uses) re-reads the
//! working copy when its files changed (by fingerprint) and adds the staged candidates that are new
//! model or platform contracts and valid with it, marked provisional (`Ckb::with_candidates`).
//! Routing prefers established contracts; plan lists the provisional ones and is not `covered` by
//! them; a gate run under one records it as `id@version`, like any contract. Amendments and other
//! kinds never route before promotion.
//!
//! Promotion on evidence ([`promote_on_evidence`], after every passing gate, then [`promote`]: the
//! contract written into the working copy, its candidate removed; with the built-in CKB nothing can
//! be written, and the report's `promotions` say so). The evidence ([`evidence_gates`]): for a
//! platform, a passing verify_generation or a verified profile_engine; for a model family only a
//! passing `ckb_conformance` outcome (`ops::conformance`) of exactly the staged text (its sha256
//! recorded; another proposal at the same version does not inherit it), held at most as loosely as
//! the shipped families (`conformance::STAGED_BOUND`, whatever bound the proposal states), because an
//! engine written to the same contract agrees with its reference by construction (test
//! `evolution::an_engine_agreeing_with_a_wrong_family_is_no_evidence_the_vectors_decide`); a passing
//! verify or profile under a staged family says it is not evidence. `ckb promote ID` without
//! `--force` accepts exactly the evidence a gate would. Under a staged family, verify's diagnoses
//! name where engine and contract part and give no fix (the contract may be what is wrong; same
//! test).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Ctx, Report};
use base::beneath::Dir;
use base::error::{Context, Error, Result};
use ckb::{Ckb, Contract, Kind};
use ledger::figures::Figures;
use ledger::{Ledger, Outcome};

/// Fewest outcomes in a cluster before it becomes a candidate.
pub const MIN_CLUSTER: usize = 2;

/// Options of an evolution run.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EvolveRequest {
    /// Fewest failures in a cluster (default 2).
    #[serde(default)]
    pub min_cluster: Option<usize>,
}

/// One cluster of unexplained failures.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct Cluster {
    /// Candidate contract id written for it.
    pub candidate: String,
    /// Gate tool.
    pub tool: String,
    /// Contract involved.
    pub contract: String,
    /// Normalised error shape (numbers replaced by N) or compiler error code.
    pub shape: String,
    /// Outcome ids, the evidence.
    pub outcomes: Vec<String>,
    /// Candidate file written, relative to the candidates directory.
    pub file: String,
}

/// Result of an evolution run.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct EvolveReport {
    /// Failed outcomes examined.
    pub failures: usize,
    /// Of those, explained by a known failure mode (a diagnosis).
    pub explained: usize,
    /// Clusters of unexplained failures that became candidates.
    pub clusters: Vec<Cluster>,
    /// Where candidates are staged.
    pub candidates_dir: String,
}

impl Report for EvolveReport {
    fn passed(&self) -> bool {
        true
    }
    fn text(&self) -> String {
        let mut s = format!(
            "{} failures examined, {} explained by known failure modes; {} candidate(s) staged in {}\n",
            self.failures,
            self.explained,
            self.clusters.len(),
            self.candidates_dir
        );
        for c in &self.clusters {
            s += &format!(
                "{} <- {} x{} on {} ({}): {}\n",
                c.candidate,
                c.tool,
                c.outcomes.len(),
                c.contract,
                c.shape,
                c.file
            );
        }
        s
    }
}

/// Replace digit runs by `N` and cut to 120 characters: failures that differ only in numbers
/// (seeds, errors, indices) have one shape.
fn shape_of(text: &str) -> String {
    let mut out = String::new();
    let mut in_num = false;
    for c in text.chars() {
        if c.is_ascii_digit() || (in_num && (c == '.' || c == 'e' || c == '-')) {
            if !in_num {
                out.push('N');
                in_num = true;
            }
        } else {
            in_num = false;
            out.push(c);
        }
    }
    out.chars().take(120).collect()
}

/// The (contract, shape) keys of one failed outcome that no diagnosis explains: a kernel is keyed
/// by its error's shape where it failed without numbers, and none for a kernel not written yet.
fn keys(o: &Outcome) -> Vec<(String, String)> {
    match Figures::read(&o.tool, &o.figures) {
        Figures::Compile(f) => {
            let contract = f.hinted.first().cloned().unwrap_or_default();
            f.codes
                .iter()
                .filter(|c| !c.is_empty())
                .map(|c| (contract.clone(), format!("compiler error {c}")))
                .collect()
        }
        Figures::KernelTest(f) => f
            .kernels
            .iter()
            .filter(|k| !k.passed && k.diagnosis.is_empty() && !k.unwritten)
            .map(|k| match k.error.as_str() {
                "" => (k.id.clone(), "kernel outside tolerance".to_string()),
                e => (k.id.clone(), format!("kernel failed: {}", shape_of(e))),
            })
            .collect(),
        figures => {
            let contract = o.contracts.iter().find(|c| c.starts_with("model.")).or(o.contracts.first());
            let contract = contract.map(|c| c.split('@').next().unwrap_or(c).to_string()).unwrap_or_default();
            // By what the checker saw (where the logits first diverged), not by the message's wording;
            // rows written before verify recorded it fall back to the message's shape.
            match figures {
                Figures::Verify(f) if !f.point.is_empty() => vec![(
                    contract,
                    format!("verify_generation diverges first in {} at graph node {}", f.divergence, f.point),
                )],
                Figures::Verify(f) if !f.divergence.is_empty() => {
                    vec![(contract, format!("verify_generation diverges first in {}", f.divergence))]
                }
                _ => vec![(contract, shape_of(&o.summary))],
            }
        }
    }
}

/// Cluster the ledger's unexplained failures and stage one candidate failure-mode contract per cluster.
///
/// # Errors
/// An unreadable ledger or an unwritable candidates directory.
pub fn evolve(ctx: &Ctx, req: &EvolveRequest) -> Result<EvolveReport> {
    let min = req.min_cluster.unwrap_or(MIN_CLUSTER).max(1);
    let ledger = Ledger::open(&ctx.ledger)?;
    let mut all = ledger.list(0, ledger.count()?)?;
    all.reverse();
    let failures: Vec<&Outcome> = all
        .iter()
        .filter(|o| {
            !o.passed
                && !o.cancelled()
                && matches!(o.tool.as_str(), "compile_engine" | "run_kernel_test" | "verify_generation")
        })
        .filter(|o| {
            let f = Figures::read(&o.tool, &o.figures);
            !f.blocked() && !f.no_device()
        })
        .collect();
    let mut explained = 0;
    let mut clusters: BTreeMap<(String, String, String), Vec<String>> = BTreeMap::new();
    for o in &failures {
        if o.tool != "run_kernel_test" && !Figures::read(&o.tool, &o.figures).diagnoses().is_empty() {
            explained += 1;
            continue;
        }
        let ks = keys(o);
        if ks.is_empty() {
            explained += 1;
        }
        for (contract, shape) in ks {
            clusters.entry((o.tool.clone(), contract, shape)).or_default().push(o.id.clone());
        }
    }
    let dir = ctx.candidates_dir();
    let mut out = Vec::new();
    for ((tool, contract, shape), ids) in clusters {
        if ids.len() < min {
            continue;
        }
        let tag = format!("{:016x}", base::util::fnv1a(&format!("{tool}|{contract}|{shape}")));
        let id = format!("failure.candidate-{}", &tag[..10]);
        let applies: Vec<String> =
            if contract.is_empty() || ctx.ckb.get(&contract).is_err() { vec![] } else { vec![contract.clone()] };
        let c = candidate_contract(&id, &tool, &contract, &shape, &ids, applies);
        let file = format!("failures/{}.toml", id.trim_start_matches("failure."));
        write_candidate(&dir, &file, &c)?;
        out.push(Cluster { candidate: id, tool, contract, shape, outcomes: ids, file });
    }
    Ok(EvolveReport { failures: failures.len(), explained, clusters: out, candidates_dir: dir.display().to_string() })
}

fn candidate_contract(
    id: &str,
    tool: &str,
    contract: &str,
    shape: &str,
    ids: &[String],
    applies: Vec<String>,
) -> Contract {
    let evidence = ids.iter().take(20).cloned().collect::<Vec<_>>().join(", ");
    let text = format!(
        "[failure]\nsymptom = {symptom:?}\nroot_cause = \"unknown: a recurring failure that no known failure mode explains; to be written by whoever diagnoses it\"\n\
         detection = {detection:?}\nfix = \"unknown yet\"\napplies_to = {applies:?}\n",
        symptom =
            format!("{tool} fails on {} with: {shape}", if contract.is_empty() { "the engine" } else { contract }),
        detection = format!("same gate ({tool}), same contract, same error shape in {} outcomes", ids.len()),
    );
    let head = format!(
        "id = {id:?}\nkind = \"failure\"\nversion = 1\nsummary = {summary:?}\nsources = [{{ title = \"metainfer ledger: recurring unexplained failures\", locator = {evidence:?} }}]\n",
        summary = format!(
            "Candidate: recurring {tool} failure on {}",
            if contract.is_empty() { "engines" } else { contract }
        ),
    );
    toml::from_str(&(head + &text)).expect("candidate contracts are built from valid TOML")
}

/// Create `root/sub` (one folder below `root`) as real directories and open `root/sub`: a symlink
/// at `root` or at `root/sub` is refused (also when it is swapped in after the check: both are
/// opened without following a link), so nothing is written through a link into the CKB or
/// elsewhere.
fn real_dir(root: &Path, sub: &str) -> Result<Dir> {
    let dir = root.join(sub);
    for d in [root, dir.as_path()] {
        if let Ok(m) = std::fs::symlink_metadata(d)
            && !m.is_dir()
        {
            return Err(Error::usage(format!(
                "{} is {}, not a directory; remove it so that contracts can be staged and promoted there",
                d.display(),
                if m.file_type().is_symlink() { "a symlink" } else { "a file" }
            )));
        }
        std::fs::create_dir_all(d).usage_ctx(|| format!("cannot create {}", d.display()))?;
    }
    let parent = Dir::open(root.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")))?;
    let name = root
        .file_name()
        .map(Path::new)
        .ok_or_else(|| Error::usage(format!("{}: not a directory name", root.display())))?;
    parent.open_dir_nofollow(name)?.open_dir_nofollow(Path::new(sub))
}

/// Stage `c` as `dir/<rel>`, `rel` being `<kind dir>/<name>.toml` (derived from a validated id).
fn write_candidate(dir: &Path, rel: &str, c: &Contract) -> Result<PathBuf> {
    let (sub, file) = rel.split_once('/').expect("candidate files are <kind dir>/<name>.toml");
    let d = real_dir(dir, sub)?;
    let text = toml::to_string_pretty(c).internal_ctx(|| format!("cannot render {}", c.id))?;
    d.write_atomic(Path::new(file), text.as_bytes())?;
    Ok(d.show(Path::new(file)))
}

/// A contract proposal.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ProposeRequest {
    /// The contract as TOML (one file of the CKB), at most 1 MiB.
    pub toml: String,
}

/// Result of a proposal.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ProposeReport {
    /// Whether it was valid and is now staged.
    pub staged: bool,
    /// Contract id.
    pub id: String,
    /// Version proposed.
    pub version: u32,
    /// Whether it amends an existing contract (its version must be higher).
    pub amendment: bool,
    /// Staged file, "" when refused.
    pub file: String,
    /// Why it was refused: file, field and reason per finding.
    pub findings: Vec<ckb::Finding>,
}

impl Report for ProposeReport {
    fn passed(&self) -> bool {
        self.staged
    }
    fn text(&self) -> String {
        if self.staged {
            format!(
                "staged {} v{} ({}) in {}; promote it with evidence (a model family: a passing `ckb conformance` on its own implementation's vectors; otherwise a passing gate that used it) or `metainfer ckb promote {}`",
                self.id,
                self.version,
                if self.amendment { "amendment" } else { "new" },
                self.file,
                self.id
            )
        } else {
            let mut s = format!("refused {}: {} finding(s); nothing was staged\n", self.id, self.findings.len());
            for f in &self.findings {
                s += &format!("  {f}\n");
            }
            s
        }
    }
}

/// The CKB's files (working copy or built-in) with `extra` added or replacing the file of the same id.
fn files_with(ctx: &Ctx, extra: (String, String), replace_id: Option<&str>) -> Result<Vec<(String, String)>> {
    let mut files = match &ctx.ckb_dir {
        Some(d) => ckb::read_dir_files(d)?,
        None => ckb::embedded_files(),
    };
    if let Some(id) = replace_id
        && let Some(f) = ctx.ckb.file_of(id).filter(|_| !ctx.ckb.is_provisional(id))
    {
        files.retain(|(p, _)| p != f);
    }
    files.push(extra);
    Ok(files)
}

/// Validate and stage a proposal.
///
/// # Errors
/// Only for an unwritable candidates directory; an invalid proposal is a report with findings.
pub fn propose(ctx: &Ctx, req: &ProposeRequest) -> Result<ProposeReport> {
    let refused = |id: String, version: u32, findings: Vec<ckb::Finding>| ProposeReport {
        staged: false,
        id,
        version,
        amendment: false,
        file: String::new(),
        findings,
    };
    if req.toml.len() as u64 > base::util::CONTRACT_FILE.max {
        return Err(Error::usage(format!(
            "the proposal is {} bytes; a contract file may be at most {} bytes: {}",
            req.toml.len(),
            base::util::CONTRACT_FILE.max,
            base::util::CONTRACT_FILE.hint
        )));
    }
    let value: toml::Value = match toml::from_str(&req.toml) {
        Ok(v) => v,
        Err(e) => {
            let f =
                ckb::Finding { file: "proposal".into(), field: String::new(), message: format!("not valid TOML: {e}") };
            return Ok(refused(String::new(), 0, vec![f]));
        }
    };
    let id = value.get("id").and_then(|v| v.as_str()).unwrap_or("").to_string();
    let version = value.get("version").and_then(|v| v.as_integer()).unwrap_or(0) as u32;
    // The id names the staged file: it must be a name, never a path.
    let (kind, _) = match ckb::parse_id(&id) {
        Ok(k) => k,
        Err(message) => {
            let f = ckb::Finding { file: "proposal".into(), field: "/id".into(), message };
            return Ok(refused(id, version, vec![f]));
        }
    };
    let existing = ctx.ckb.get(&id).ok();
    let rel = format!("{}/proposal.toml", ckb::kind_dir(kind));
    let files = files_with(ctx, (rel.clone(), req.toml.clone()), existing.map(|c| c.id.as_str()))?;
    let (_, mut findings) = Ckb::check_sources(files, "proposal".into(), Some(&oracle::implemented()));
    findings.retain(|f| f.file == rel || f.message.contains(&id));
    for f in &mut findings {
        if f.file == rel {
            f.file = "proposal".into();
        }
    }
    if let Some(c) = existing
        && version <= c.version
    {
        findings.push(ckb::Finding {
            file: "proposal".into(),
            field: "/version".into(),
            message: format!("{id} is at version {}; an amendment must bump the version", c.version),
        });
    }
    if !findings.is_empty() {
        return Ok(refused(id, version, findings));
    }
    let contract: Contract = toml::from_str(&req.toml).internal_ctx(|| "validated proposal".to_owned())?;
    if let Some(message) = dry_run(&contract) {
        let f = ckb::Finding { file: "proposal".into(), field: "/model/graph".into(), message };
        return Ok(refused(id, version, vec![f]));
    }
    let file = ckb::file_for_id(&contract.id).map_err(Error::usage)?;
    write_candidate(&ctx.candidates_dir(), &file, &contract)?;
    Ok(ProposeReport { staged: true, id, version, amendment: existing.is_some(), file, findings: vec![] })
}

/// Tokens the dry run of a proposed family's graph steps through.
const DRY_RUN_STEPS: u32 = 6;

/// Run a proposed model family's graph before it is staged: write a small synthetic checkpoint from
/// the proposal itself (its config keys and its graph's weight bindings, `synth::synth_contract`),
/// resolve its config.json against the proposal, build the reference from the graph and step
/// [`DRY_RUN_STEPS`] tokens. None when it runs and every logit is finite (or the proposal is not a
/// model family with a graph); otherwise what failed, naming the step or the node.
fn dry_run(contract: &Contract) -> Option<String> {
    let family = contract.model.as_ref()?;
    family.graph.as_ref()?;
    let run = || -> Result<Option<String>> {
        let dir = tempfile::tempdir().internal_ctx(|| "dry run: temporary directory".to_owned())?;
        let out = dir.path().join("checkpoint");
        let req = crate::synth::SynthRequest {
            family: contract.id.clone(),
            out: out.clone(),
            seed: 1,
            layers: Some(2),
            ..Default::default()
        };
        crate::synth::synth_contract(contract, &req)?;
        let config = model::read_config(out.as_path())?;
        let cfg = model::resolve(contract, &config).map_err(|gaps| {
            Error::input(gaps.iter().map(|g| format!("{}: {}", g.field, g.reason)).collect::<Vec<_>>().join("; "))
        })?;
        let tensors = model::read_safetensors(out.as_path())?;
        let mut reference = oracle::graph::GraphReference::new(family, &cfg, &tensors, "f32")?;
        for step in 0..DRY_RUN_STEPS {
            let logits = reference.step((step * 7 + 1) % cfg.vocab as u32)?;
            if let Some(bad) = logits.iter().position(|v| !v.is_finite()) {
                return Ok(Some(format!(
                    "step {step}: logit {bad} is {}; a parameter expression or a node's input yields no finite value at the synthetic config (vocab {}, hidden {})",
                    logits[bad], cfg.vocab, cfg.hidden
                )));
            }
        }
        Ok(None)
    };
    match run() {
        Ok(found) => {
            found.map(|m| format!("dry run of the graph on a synthetic checkpoint written from the proposal: {m}"))
        }
        Err(e) => Some(format!(
            "dry run of the graph on a synthetic checkpoint written from the proposal failed: {}",
            e.message
        )),
    }
}

/// The gates whose passing outcome is evidence for a contract of `kind`. A model family: only
/// `ckb conformance`, its reference equal to numbers an independent implementation wrote (an engine
/// written to the same contract agrees with its reference by construction, so verify_generation is
/// no evidence about the model). A platform: verify_generation (real weights through the whole
/// forward pass) and a verified profile_engine; kernels and the rest: any gate that ran the engine.
pub fn evidence_gates(kind: Kind) -> &'static [&'static str] {
    match kind {
        Kind::Model => &[CONFORMANCE, PERPLEXITY],
        Kind::Platform => &["verify_generation", "profile_engine"],
        _ => &["compile_engine", "run_kernel_test", "verify_generation", "profile_engine"],
    }
}

/// The ledger's name for a `ckb conformance` check (an outcome's `tool`): a model family's evidence.
pub const CONFORMANCE: &str = "ckb_conformance";

/// The ledger's name for a `ckb perplexity` check: weaker evidence for a model family (it catches a
/// wrong family, not one slightly off), which counts only when the user consented to it.
pub const PERPLEXITY: &str = "ckb_perplexity";

/// What a staged model family still needs to be promoted: said by the gates that pass under it
/// (which are not its evidence), by plan and by `ckb promote`.
pub fn family_evidence_needed(id: &str) -> String {
    format!(
        "{id} stays provisional until its reference equals numbers an independent implementation wrote: \
         run `metainfer ckb conformance DIR` on a directory with a tiny checkpoint of the family and its \
         vectors.json (the logits the model's own implementation, e.g. transformers, gives at every \
         position of a few prompts, and its greedy ids); a passing check promotes it. An engine's passing verify is not evidence: it was written to the \
         same contract"
    )
}

/// Whether outcome `o` is evidence for the contract `c` (its `id@version`, and for a model family
/// exactly its text: a conformance pass of another proposal at the same version does not count).
fn is_evidence(o: &Outcome, c: &Contract) -> bool {
    let tag = format!("{}@{}", c.id, c.version);
    o.authenticated
        && !o.imported
        && !ledger::unattested(o)
        && o.passed
        && o.contracts.contains(&tag)
        && evidence_gates(c.kind).contains(&o.tool.as_str())
        && match Figures::read(&o.tool, &o.figures) {
            Figures::Profile(f) => f.verified,
            Figures::Conformance(f) => f.contract_sha256 == contract_sha256(c),
            Figures::Perplexity(f) => f.consent && f.contract_sha256 == contract_sha256(c),
            _ => c.kind != Kind::Model,
        }
}

/// sha256 (hex) of a contract's TOML as the CKB renders it: what a `ckb conformance` outcome records
/// and is evidence for.
pub fn contract_sha256(c: &Contract) -> String {
    model::embedded::sha256_hex(toml::to_string(c).unwrap_or_default().as_bytes())
}

/// Promote a staged contract into the CKB working copy.
///
/// Evidence: a passing outcome this server recorded itself (authenticated, not imported) in the ledger of a gate in [`evidence_gates`] for the contract's kind
/// that ran under exactly `id@version` (a model family: a passing `ckb conformance` on a directory it
/// routed, of exactly this contract's text, [`contract_sha256`]). Without evidence only `force` (a
/// person's decision) promotes. The contract is written into
/// the working copy (beside the contract it amends, or under its kind's folder) and its candidate
/// file is removed.
///
/// # Errors
/// No working copy (`--ckb DIR`), no such candidate, no evidence without force, or the promoted CKB
/// would be invalid.
pub fn promote(ctx: &Ctx, id: &str, force: bool) -> Result<String> {
    let new_file = ckb::file_for_id(id).map_err(Error::usage)?;
    let staged = ckb::read_dir_files(&ctx.candidates_dir()).unwrap_or_default();
    let (rel, text) = staged
        .into_iter()
        .find(|(_, t)| toml::from_str::<Contract>(t).is_ok_and(|c| c.id == id))
        .ok_or_else(|| Error::usage(format!("no staged candidate `{id}` in {}", ctx.candidates_dir().display())))?;
    let contract: Contract = toml::from_str(&text).ctx(|| format!("candidate {rel}"))?;
    let tag = format!("{}@{}", contract.id, contract.version);
    let ledger = Ledger::open(&ctx.ledger)?;
    let evidence = ledger.list(0, ledger.count()?)?.into_iter().find(|o| is_evidence(o, &contract));
    let Some(ckb_dir) = ctx.ckb_dir.as_ref() else {
        let has = match &evidence {
            Some(o) => format!("the ledger holds evidence for {tag} (outcome {} of {}), but ", o.id, o.tool),
            None => String::new(),
        };
        return Err(Error::usage(format!(
            "{has}the built-in CKB cannot be written: promotion writes into a CKB working copy. Pass --ckb DIR (a checkout of contracts/), stage the proposal there (`metainfer --ckb DIR ckb propose {}`) and run `metainfer --ckb DIR ckb promote {id}`",
            ctx.candidates_dir().join(&rel).display()
        )));
    };
    if evidence.is_none() && !force {
        let how = match contract.kind {
            Kind::Model => family_evidence_needed(&tag),
            _ => "build an engine that passes the gates using it".to_string(),
        };
        return Err(Error::usage(format!(
            "no evidence for {tag}: no passing {} outcome ran under it; {how}; or promote by hand with --force",
            evidence_gates(contract.kind).join(" or ")
        )));
    }
    let files = files_with(ctx, (rel.clone(), text.clone()), Some(id))?;
    let (_, findings) = Ckb::check_sources(files, "promotion".into(), Some(&oracle::implemented()));
    if !findings.is_empty() {
        return Err(Error::input(format!(
            "promoting {id} would make the CKB invalid:\n{}",
            findings.iter().map(|f| format!("  {f}")).collect::<Vec<_>>().join("\n")
        )));
    }
    // An amendment replaces the file it was loaded from (found by walking the working copy, links
    // not followed); a new contract goes to the file its id names. Either is written by rename,
    // which replaces a link instead of writing through it.
    let target = match ctx.ckb.file_of(id).filter(|_| !ctx.ckb.is_provisional(id)) {
        Some(f) => {
            let d = Dir::open(ckb_dir)?;
            d.write_atomic(Path::new(&f), text.as_bytes())?;
            d.show(Path::new(&f))
        }
        None => {
            let (sub, file) = new_file.split_once('/').expect("<kind dir>/<name>.toml");
            let d = real_dir(ckb_dir, sub)?;
            d.write_atomic(Path::new(file), text.as_bytes())?;
            d.show(Path::new(file))
        }
    };
    let _ = std::fs::remove_file(ctx.candidates_dir().join(&rel));
    Ok(format!(
        "promoted {tag} into {} ({})",
        target.display(),
        match evidence {
            Some(o) => format!("evidence: outcome {} of {}", o.id, o.tool),
            None => "forced by hand".into(),
        }
    ))
}

/// What a gate did about a provisional contract it ran under.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct Promotion {
    /// The staged candidate, `id@version`.
    pub contract: String,
    /// Whether it was promoted into the CKB working copy.
    pub promoted: bool,
    /// What happened, or why it was not promoted and what to do (e.g. the built-in CKB cannot be
    /// written: pass --ckb DIR).
    pub message: String,
}

/// After a gate passed and recorded its outcome under `contracts` (`id@version`), promote each of
/// them that is a provisional candidate whose kind this gate is evidence for ([`evidence_gates`]).
/// Never fails: a promotion that cannot happen is reported in its [`Promotion::message`].
pub fn promote_on_evidence(ctx: &Ctx, gate: &str, contracts: &[String]) -> Vec<Promotion> {
    let mut out = Vec::new();
    for tag in contracts {
        let id = tag.split('@').next().unwrap_or(tag);
        let Ok(c) = ctx.ckb.get(id) else { continue };
        if !ctx.ckb.is_provisional(id) {
            continue;
        }
        if !evidence_gates(c.kind).contains(&gate) {
            if c.kind == Kind::Model && evidence_gates(Kind::Platform).contains(&gate) {
                out.push(Promotion {
                    contract: tag.clone(),
                    promoted: false,
                    message: format!("not promoted by {gate}: {}", family_evidence_needed(tag)),
                });
            }
            continue;
        }
        let (promoted, message) = match promote(ctx, id, false) {
            Ok(m) => (true, m),
            Err(e) => (false, e.message),
        };
        out.push(Promotion { contract: tag.clone(), promoted, message });
    }
    out
}
