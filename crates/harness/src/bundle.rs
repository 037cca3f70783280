//! Bundles: a gate's harness call packed to run on another machine (the one with the device), and
//! run there. A gate splits into build-and-draw (here: build the harness, draw the inputs, write the
//! bundle), run (`metainfer bundle run DIR` where the device is: [`run`]) and compare (here again:
//! read the replies back, judge against the oracle and record). Expected values never enter a bundle:
//! it holds the harness binary, the protocol requests, the drawn inputs and (when small) the model.
//!
//! Layout of a bundle directory:
//!
//! ```text
//! bundle.json          BundleManifest: tool, seed, engine source hash, requests, input and model hashes
//! harness              the harness executable, built for the engine (and its device api)
//! request.<i>.json     protocol::Request i, every path relative to the bundle directory
//! case<n>.in.safetensors ... inputs drawn from the seed (kernel tests)
//! model/               the model directory (copied when small; else a link `bundle run --model` makes)
//! vocab.<i>/tokenizer.json  the real vocabularies verify_generation tokenizes (copies; judged against
//!                      the server's own files, so an altered copy can only fail)
//! after a run:
//! reply.<i>.json       protocol::Reply i, as the harness wrote it
//! run.<i>.json         RunRecord i: how the process ended, its wall time and stderr tail
//! *.out.safetensors, generate.safetensors ... outputs named in the requests
//! ```
//!
//! A bundle of serve_engine, which runs the engine's own server rather than the harness, holds the
//! engine's binary as `harness` and one request, [`PLAN`] (`plan.json`: every prompt and load level
//! the client sends, no expected answer). `metainfer bundle run` starts the server on the bundle's
//! model, sends the plan and writes what came back as [`OBSERVED`] under the nonce
//! (`observed.<nonce>.json`); [`run`] here refuses such a bundle.
//!
//! Writing (`write_bundle` on a gate call): the gate runs up to the harness call (rules, harness
//! build, inputs drawn from the seed), then writes the harness executable, the commands as
//! `request.<i>.json` and the inputs into a directory staged beside the destination and renames it
//! into place, all through the handle of the directory the destination was resolved beneath
//! (`ops::gate::Staging`, every file in it a new file), so a failure leaves no half-written bundle. A
//! model of at most [`MAX_COPIED_MODEL`] bytes is copied in; a larger one is named by hash for
//! `bundle run --model DIR`. A gate sends all its commands in one exchange, so a bundle holds every
//! request. Nothing is judged or recorded.
//!
//! Running ([`run`], `metainfer bundle run DIR` on the device machine): the harness and inputs are
//! checked against the manifest, the requests run in order (stopping at a failed one), and each
//! leaves `reply.<i>.json` and `run.<i>.json` beside the outputs. Running one is not sandboxed by the
//! server: it runs wherever the user starts it (see README, Security).
//!
//! Reading back (`from_bundle` on the same gate call): the gate runs again here on the same sources
//! (the source hash must match), draws the same inputs from the manifest's seed and refuses a bundle
//! that does not hold exactly them and the same requests and model, or that holds a symbolic link;
//! a bundle is read through its directory's handle, each file bounded and regular. The replies
//! ([`called`]) and outputs are then judged like a direct run's, the outcome is recorded with the
//! bundle's path, and a pass promotes.
//!
//! What a bundle verdict proves: every output file's name carries the bundle's nonce (drawn when it
//! was written; `ops::gate::Harness::output`), so outputs copied from another bundle are not found;
//! and a verdict is evidence (phase order, promotion) only when a runner the ledger trusts signed the
//! run and every file read back is the one signed ([`super::attest`]). Otherwise it is recorded with
//! `attestation: "unattested: <why>"`, shown in the report and counted, and `Ledger::passed_on` and
//! promotion skip it (`ledger::unattested`): whoever can write a bundle directory can write its
//! replies.
//!
//! Where the rest lives: [`super::attest`] (runner key pairs, signatures, trusted runners),
//! `ops::bundle` (the `bundle run` report), `ops::gate` (`Mode`, `Gate::split`, `Gate::exchange`,
//! `Gate::input`) and its `transport` module (the scratch directory, writing a bundle, checking one
//! read back).

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::protocol;
use super::{Budget, Exit, Run};
use base::beneath::{Dir, Entry, Files};
use base::error::{Context, Error, Result};

/// Version of the bundle layout (2: a nonce, mixed into every output file's name and signed by
/// the runner's attestation).
pub const FORMAT: u32 = 2;

/// File name of the manifest in a bundle directory.
pub const MANIFEST: &str = "bundle.json";

/// The harness executable's name in a bundle.
pub const HARNESS: &str = "harness";

/// The model directory's name in a bundle.
pub const MODEL: &str = "model";

/// A bundle of a gate that runs the engine's own binary (serve_engine): its one request, the plan
/// of what the client sends, in place of protocol requests; `harness` is then the engine's binary.
pub const PLAN: &str = "plan.json";

/// What the client saw when it sent a [`PLAN`], written by the run (its name carries the nonce:
/// [`output_name`]).
pub const OBSERVED: &str = "observed.json";

/// Largest model directory copied into a bundle, bytes; a larger one is referenced by its hash and
/// given to `bundle run --model DIR` on the device machine.
pub const MAX_COPIED_MODEL: u64 = 64 << 20;

/// What a bundle holds and what it was made from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BundleManifest {
    /// [`FORMAT`].
    pub format: u32,
    /// The gate (MCP tool name) that wrote it.
    pub tool: String,
    /// The engine directory it was written for.
    pub engine: String,
    /// sha256 of the engine's files when it was written: compare refuses other sources.
    pub engine_hash: String,
    /// Weight dtype the harness was built for.
    pub dtype: String,
    /// Target platform name, e.g. `cuda`.
    pub target: String,
    /// Platform contract id, when the target has one.
    #[serde(default)]
    pub platform: Option<String>,
    /// Seed of the drawn inputs (kernel tests, random prompts).
    #[serde(default)]
    pub seed: Option<u64>,
    /// 128 random bits (hex) drawn when the bundle was written: every output file's name carries it
    /// ([`output_name`]), so outputs copied from another bundle are not this bundle's; a runner's
    /// attestation signs it ([`super::attest`]).
    pub nonce: String,
    /// Harness protocol version ([`protocol::VERSION`]).
    pub protocol: u32,
    /// sha256 of the harness executable.
    pub harness_sha256: String,
    /// The requests, run in order: file names of `protocol::Request`s in the bundle, each with the
    /// environment its process gets.
    pub requests: Vec<BundleRequest>,
    /// sha256 of every input file, by file name.
    #[serde(default)]
    pub inputs: BTreeMap<String, String>,
    /// The model the requests read, when they read one.
    #[serde(default)]
    pub model: Option<BundleModel>,
    /// When it was written (RFC 3339).
    pub written: String,
}

/// One request of a bundle.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BundleRequest {
    /// File name of the request, e.g. `request.0.json`.
    pub request: String,
    /// Environment added to the harness process, e.g. `RAYON_NUM_THREADS`.
    #[serde(default)]
    pub env: Vec<(String, String)>,
}

/// The model of a bundle.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BundleModel {
    /// Whether its files are in the bundle's `model/` (else `bundle run --model DIR` links it).
    pub copied: bool,
    /// [`model_hash`] of the directory.
    pub sha256: String,
    /// Where it was on the machine that wrote the bundle.
    pub source: String,
}

/// How one request's process ended, as `bundle run` records it (`run.<i>.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunRecord {
    /// `exited`, `timed_out`, `cancelled` or `output_limit`.
    pub outcome: String,
    /// Exit status when it exited (None: killed by a signal).
    pub code: Option<i32>,
    /// Wall time, seconds.
    pub seconds: f64,
    /// The tail of its stderr.
    pub stderr: String,
}

impl RunRecord {
    /// The record of a finished process.
    pub fn of(run: &Run) -> RunRecord {
        let (outcome, code) = match run.exit {
            Exit::Code(c) => ("exited", c),
            Exit::TimedOut => ("timed_out", None),
            Exit::Cancelled => ("cancelled", None),
            Exit::OutputLimit => ("output_limit", None),
        };
        RunRecord { outcome: outcome.into(), code, seconds: run.seconds, stderr: super::tail(&run.stderr, 16 << 10) }
    }

    /// The process as a [`Run`] (stdout is not kept).
    pub fn to_run(&self) -> Run {
        let exit = match self.outcome.as_str() {
            "timed_out" => Exit::TimedOut,
            "cancelled" => Exit::Cancelled,
            "output_limit" => Exit::OutputLimit,
            _ => Exit::Code(self.code),
        };
        Run { exit, stdout: String::new(), stderr: self.stderr.clone(), seconds: self.seconds, sandboxed: false }
    }
}

/// The name a bundle gives the output file `name` of its requests: the bundle's nonce before the
/// extension (`generate.safetensors` -> `generate.<nonce>.safetensors`).
pub fn output_name(name: &str, nonce: &str) -> String {
    match name.split_once('.') {
        Some((stem, ext)) => format!("{stem}.{nonce}.{ext}"),
        None => format!("{name}.{nonce}"),
    }
}

/// A fresh nonce: 128 random bits, hex.
pub fn fresh_nonce() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// File name of request `i`.
pub fn request_file(i: usize) -> String {
    format!("request.{i}.json")
}

/// File name of reply `i`.
pub fn reply_file(i: usize) -> String {
    format!("reply.{i}.json")
}

/// File name of run record `i`.
pub fn run_file(i: usize) -> String {
    format!("run.{i}.json")
}

/// sha256 of a file.
///
/// # Errors
/// When it cannot be read.
pub fn file_hash(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).ctx(|| path.display().to_string())?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).ctx(|| path.display().to_string())?;
    Ok(format!("{:x}", h.finalize()))
}

/// The files of a model directory (top level: config, tokenizer, weights; a symlink that leads
/// to a regular file, as in a Hugging Face cache's snapshot, counts as the file), in name order.
fn model_files(dir: &dyn Files) -> Vec<String> {
    dir.listing()
        .into_iter()
        .filter(|(name, e)| *e == Entry::File || (*e == Entry::Link && dir.has_file(name)))
        .map(|(name, _)| name)
        .collect()
}

/// sha256 over a model directory's top-level files (names and contents, in name order): what
/// `bundle run --model` and compare check, so a bundle runs and is judged on the same weights.
/// Read through `dir` (a held directory reads through its handle).
///
/// # Errors
/// When a file cannot be read.
pub fn model_hash(dir: &dyn Files) -> Result<String> {
    let mut h = Sha256::new();
    for name in model_files(dir) {
        let mut f = dir.open(&name, &base::util::MODEL_FILE)?;
        let mut fh = Sha256::new();
        std::io::copy(&mut f, &mut fh).ctx(|| dir.show(&name).display().to_string())?;
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update(format!("{:x}", fh.finalize()).as_bytes());
    }
    Ok(format!("{:x}", h.finalize()))
}

/// Total bytes of a model directory's top-level files.
///
/// # Errors
/// When a file cannot be opened.
pub fn model_bytes(dir: &dyn Files) -> Result<u64> {
    let mut total = 0;
    for name in model_files(dir) {
        let f = dir.open(&name, &base::util::MODEL_FILE)?;
        total += f.metadata().map(|m| m.len()).unwrap_or(0);
    }
    Ok(total)
}

/// Copy a model directory's top-level files (read through `from`) into the new directory `to`
/// beneath `into`, each a new file (nothing already there is written through).
///
/// # Errors
/// When a file cannot be read, or `to` or a file in it exists or cannot be written.
pub fn copy_model(from: &dyn Files, into: &Dir, to: &str) -> Result<()> {
    into.create_dir(Path::new(to))?;
    for name in model_files(from) {
        let mut f = from.open(&name, &base::util::MODEL_FILE)?;
        let dest = Path::new(to).join(&name);
        let mut out = into.create_new_file(&dest)?;
        std::io::copy(&mut f, &mut out).internal_ctx(|| format!("copying {}", from.show(&name).display()))?;
    }
    Ok(())
}

/// A command as a bundle holds it: every path relative to the bundle directory `root` (inputs
/// and outputs in it), the model directory as the bundle's [`MODEL`].
pub fn relative(command: protocol::Command, root: &Path) -> protocol::Command {
    use protocol::Command;
    let rel = |p: &Path| p.strip_prefix(root).map(Path::to_path_buf).unwrap_or_else(|_| p.to_path_buf());
    match command {
        Command::Kernel { cases } => Command::Kernel {
            cases: cases
                .into_iter()
                .map(|k| protocol::KernelCase { input: rel(&k.input), output: rel(&k.output), ..k })
                .collect(),
        },
        Command::Generate { prompts, tensors, stop_tokens, logits_every, .. } => {
            Command::Generate { model: MODEL.into(), prompts, tensors: rel(&tensors), stop_tokens, logits_every }
        }
        Command::Tokenize { sets } => Command::Tokenize {
            sets: sets.into_iter().map(|s| protocol::TokenizeSet { dir: rel(&s.dir), ..s }).collect(),
        },
        Command::Profile { prompt_len, new_tokens, runs, seed, .. } => {
            Command::Profile { model: MODEL.into(), prompt_len, new_tokens, runs, seed }
        }
        Command::Trace { tokens, tensors, .. } => {
            Command::Trace { model: MODEL.into(), tokens, tensors: rel(&tensors) }
        }
        t @ Command::Time { .. } => t,
        t @ Command::BlockManager { .. } => t,
        t @ Command::Scheduler { .. } => t,
        Command::Batch { num_blocks, block_size, seqs, steps, tensors, .. } => {
            Command::Batch { model: MODEL.into(), num_blocks, block_size, seqs, steps, tensors: rel(&tensors) }
        }
    }
}

/// Read request `i` of a bundle.
///
/// # Errors
/// [`base::error::ErrorKind::Usage`] when it is missing or does not parse.
pub fn read_request(dir: &dyn Files, i: usize) -> Result<protocol::Request> {
    let path = dir.show(&request_file(i));
    let bytes = dir
        .read(&request_file(i), &base::util::HARNESS_REPLY)
        .map_err(|e| Error::usage(format!("{}; the bundle is incomplete, write it again", e.message)))?;
    serde_json::from_slice(&bytes).usage_ctx(|| format!("{}: not a harness request", path.display()))
}

/// Refuse a bundle directory holding a symbolic link (other than the `model` link `bundle run
/// --model` makes): what is read back must be the bundle's own files.
///
/// # Errors
/// [`base::error::ErrorKind::Usage`] naming the link; Input when the directory cannot be read.
pub fn check_no_links(dir: &dyn Files) -> Result<()> {
    for (name, e) in dir.listing() {
        if e == Entry::Link && name != MODEL {
            return Err(Error::usage(format!(
                "{} is a symbolic link; a bundle holds only its own files: write and run it again",
                dir.show(&name).display()
            )));
        }
    }
    Ok(())
}

/// Whether two safetensors files hold the same tensors (name, dtype, shape, bytes) and the same
/// metadata, whatever the order of their headers (the metadata is a hash map, serialised in no fixed
/// order). Unreadable bytes are equal to nothing.
pub fn same_tensors(a: &[u8], b: &[u8]) -> bool {
    use safetensors::SafeTensors;
    type Contents = (BTreeMap<String, String>, BTreeMap<String, (String, Vec<usize>, Vec<u8>)>);
    let read = |bytes| -> Option<Contents> {
        let (_, header) = SafeTensors::read_metadata(bytes).ok()?;
        let meta = header.metadata().clone().unwrap_or_default().into_iter().collect();
        let st = SafeTensors::deserialize(bytes).ok()?;
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, (format!("{:?}", v.dtype()), v.shape().to_vec(), v.data().to_vec())))
            .collect();
        Some((meta, tensors))
    };
    matches!((read(a), read(b)), (Some(x), Some(y)) if x == y)
}

/// Read a bundle's manifest.
///
/// # Errors
/// [`base::error::ErrorKind::Usage`] when `dir` holds no readable manifest or one of another format.
pub fn read_manifest(dir: &dyn Files) -> Result<BundleManifest> {
    let path = dir.show(MANIFEST);
    let bytes = dir.read(MANIFEST, &base::util::HARNESS_REPLY).map_err(|e| {
        Error::usage(format!(
            "{} is not a bundle ({}); write one with a gate's write_bundle",
            dir.path().display(),
            e.message
        ))
    })?;
    let m: BundleManifest =
        serde_json::from_slice(&bytes).usage_ctx(|| format!("{}: not a bundle manifest", path.display()))?;
    if m.format != FORMAT || m.protocol != protocol::VERSION {
        return Err(Error::usage(format!(
            "{}: bundle format {} / protocol {}, this metainfer reads format {FORMAT} / protocol {}; write the bundle again",
            path.display(),
            m.format,
            m.protocol,
            protocol::VERSION
        )));
    }
    Ok(m)
}

/// What `bundle run` did.
#[derive(Debug, Clone)]
pub struct Ran {
    /// The manifest.
    pub manifest: BundleManifest,
    /// One record per request run, in order; a failed request ends the run.
    pub runs: Vec<RunRecord>,
    /// The runner's attestation, when run with a key.
    pub attestation: Option<super::attest::Attestation>,
}

/// Run a bundle where the device is: check it (manifest, harness hash, model hash; with `model`,
/// link that directory as the bundle's model after checking its hash), then run each request's
/// harness process in the bundle directory within `budget`, writing its reply and `run.<i>.json`.
/// Earlier replies, records and attestation are removed first. Stops at the first request that
/// fails. With `key` (a runner's secret key), sign the run ([`super::attest::sign`]).
///
/// # Errors
/// [`base::error::ErrorKind::Usage`] for a malformed bundle, a swapped harness, a missing or
/// different model; Internal when a process cannot be started.
pub fn run(dir: &Path, model: Option<&Path>, key: Option<&ed25519_dalek::SigningKey>, budget: &Budget) -> Result<Ran> {
    let (dir, manifest) = open(dir, model)?;
    run_opened(&dir, manifest, key, budget)
}

/// Check a bundle before it runs, as [`run`] does: no symbolic link but the model's, a manifest
/// of this format, at least one request, the harness executable and every input as written, and
/// the model (with `model`: that directory, checked by hash and linked as the bundle's model).
/// Returns the bundle's canonical path and its manifest.
///
/// # Errors
/// As [`run`].
pub fn open(dir: &Path, model: Option<&Path>) -> Result<(std::path::PathBuf, BundleManifest)> {
    let dir = dir.canonicalize().usage_ctx(|| format!("bundle {}", dir.display()))?;
    check_no_links(&dir)?;
    let manifest = read_manifest(&dir)?;
    if manifest.requests.is_empty() {
        return Err(Error::usage(format!(
            "{}: the bundle's manifest lists no request, so there is nothing to run; write the bundle again with a gate's write_bundle",
            dir.join(MANIFEST).display()
        )));
    }
    let exe = dir.join(HARNESS);
    if file_hash(&exe)? != manifest.harness_sha256 {
        return Err(Error::usage(format!(
            "{}: the harness executable differs from the one the bundle was written with",
            exe.display()
        )));
    }
    if let Some(m) = &manifest.model {
        let link = dir.join(MODEL);
        match (m.copied, model) {
            (true, _) => {
                // The bundle's own copy: a directory of the bundle (not a link out of it) holding
                // the files it was written with.
                let real = std::fs::symlink_metadata(&link).map(|md| md.is_dir()).unwrap_or(false);
                if !real || model_hash(&link)? != m.sha256 {
                    return Err(Error::usage(format!(
                        "{}: the bundle's model is not the copy it was written with (a link, missing, or other files); copy the bundle again",
                        link.display()
                    )));
                }
            }
            (false, Some(given)) => {
                let given = given.canonicalize().usage_ctx(|| format!("model {}", given.display()))?;
                let h = model_hash(&given)?;
                if h != m.sha256 {
                    return Err(Error::usage(format!(
                        "model {} differs from the bundle's (sha256 {h}, the bundle was written for {} with {})",
                        given.display(),
                        m.source,
                        m.sha256
                    )));
                }
                let _ = std::fs::remove_file(&link);
                std::os::unix::fs::symlink(&given, &link).internal_ctx(|| format!("linking {}", link.display()))?;
            }
            (false, None) if link.exists() && model_hash(&link)? == m.sha256 => {}
            (false, None) => {
                return Err(Error::usage(format!(
                    "this bundle needs the model it was written for ({}, sha256 {}): pass --model DIR",
                    m.source, m.sha256
                )));
            }
        }
    }
    for (name, sha) in &manifest.inputs {
        if name.contains('/') || name.contains("..") {
            return Err(Error::usage(format!("bundle input name {name:?} must be a file name")));
        }
        if file_hash(&dir.join(name))? != *sha {
            return Err(Error::usage(format!(
                "bundle input {name} differs from the one the bundle was written with: copy the bundle again"
            )));
        }
    }
    Ok((dir, manifest))
}

/// Run the requests of a bundle checked by [`open`], then sign the run with `key`
/// ([`seal`]).
///
/// # Errors
/// As [`run`].
pub fn run_opened(
    dir: &Path,
    manifest: BundleManifest,
    key: Option<&ed25519_dalek::SigningKey>,
    budget: &Budget,
) -> Result<Ran> {
    if manifest.requests.iter().any(|r| r.request == PLAN) {
        return Err(Error::usage(format!(
            "{}: a bundle of {} holds a plan for the engine's server, not harness requests; run it with `metainfer bundle run`",
            dir.display(),
            manifest.tool
        )));
    }
    for i in 0..manifest.requests.len() {
        let _ = std::fs::remove_file(dir.join(reply_file(i)));
        let _ = std::fs::remove_file(dir.join(run_file(i)));
    }
    let mut runs = Vec::new();
    for (i, r) in manifest.requests.iter().enumerate() {
        if r.request.contains('/') || r.request.contains("..") {
            return Err(Error::usage(format!("bundle request name {:?} must be a file name", r.request)));
        }
        let mut cmd = duct::cmd(dir.join(HARNESS), [r.request.as_str()]).dir(dir);
        for (k, v) in &r.env {
            cmd = cmd.env(k, v);
        }
        let ran = super::run(cmd, budget)?;
        let record = RunRecord::of(&ran);
        let text = serde_json::to_vec_pretty(&record).internal_ctx(|| "run record".to_owned())?;
        base::util::write_atomic(&dir.join(run_file(i)), &text)?;
        runs.push(record);
        if !ran.ok() {
            break;
        }
    }
    let attestation = seal(dir, &manifest.nonce, key)?;
    Ok(Ran { manifest, runs, attestation })
}

/// After a run: remove an earlier run's attestation (it no longer describes the directory) and,
/// with `key`, sign this one ([`super::attest::sign`]).
///
/// # Errors
/// When the bundle's files cannot be read or the attestation cannot be written.
pub fn seal(
    dir: &Path,
    nonce: &str,
    key: Option<&ed25519_dalek::SigningKey>,
) -> Result<Option<super::attest::Attestation>> {
    let _ = std::fs::remove_file(dir.join(super::attest::ATTESTATION));
    key.map(|k| super::attest::sign(dir, nonce, k)).transpose()
}

/// Read back request `i` of a run bundle: its process record and reply, as a harness call would
/// have returned them.
///
/// # Errors
/// [`base::error::ErrorKind::Usage`] when the request has not been run (no `run.<i>.json`).
pub fn called(dir: &dyn Files, i: usize, attested: Option<&super::attest::Attested>) -> Result<super::Called> {
    if !dir.has(&run_file(i)) {
        return Err(Error::usage(format!(
            "bundle {} has not been run (no {}): run `metainfer bundle run {}` on the machine with the device, then compare again",
            dir.path().display(),
            run_file(i),
            dir.path().display()
        )));
    }
    let record = dir.read(&run_file(i), &base::util::HARNESS_REPLY)?;
    if let Some(a) = attested {
        a.check(&run_file(i), &record)?;
    }
    let record: RunRecord = serde_json::from_slice(&record)
        .usage_ctx(|| format!("{}: unreadable run record", dir.show(&run_file(i)).display()))?;
    let reply = match dir.read(&reply_file(i), &base::util::HARNESS_REPLY) {
        Ok(bytes) if attested.is_some_and(|a| a.check(&reply_file(i), &bytes).is_err()) => {
            Err(format!("{} changed after the runner signed the run", reply_file(i)))
        }
        Ok(bytes) => {
            serde_json::from_slice::<protocol::Reply>(&bytes).map_err(|e| format!("reply does not parse: {e}"))
        }
        Err(_) => Err("it wrote no reply".to_string()),
    };
    Ok(super::Called { run: record.to_run(), reply })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bundle whose model was copied in is opened only with its own copy: not a link out of the
    /// bundle (which `bundle run` would grant the engine's processes), not other files.
    #[test]
    fn a_copied_model_must_be_the_bundles_own_directory() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("b");
        let model = dir.join(MODEL);
        std::fs::create_dir_all(&model).unwrap();
        std::fs::write(model.join("config.json"), "{}").unwrap();
        std::fs::write(dir.join(HARNESS), "exe").unwrap();
        let manifest = BundleManifest {
            format: FORMAT,
            tool: "verify_generation".into(),
            engine: "e".into(),
            engine_hash: "h".into(),
            dtype: "f32".into(),
            target: "cpu".into(),
            platform: None,
            seed: Some(1),
            nonce: "n".into(),
            protocol: protocol::VERSION,
            harness_sha256: file_hash(&dir.join(HARNESS)).unwrap(),
            requests: vec![BundleRequest { request: request_file(0), env: vec![] }],
            inputs: BTreeMap::new(),
            model: Some(BundleModel { copied: true, sha256: model_hash(&model).unwrap(), source: "m".into() }),
            written: "now".into(),
        };
        std::fs::write(dir.join(MANIFEST), serde_json::to_vec(&manifest).unwrap()).unwrap();
        assert!(open(&dir, None).is_ok());
        // The same files, but through a link to a directory outside the bundle.
        let outside = t.path().join("home");
        std::fs::rename(&model, &outside).unwrap();
        std::os::unix::fs::symlink(&outside, &model).unwrap();
        let e = open(&dir, None).unwrap_err();
        assert!(e.message.contains("the bundle's model is not the copy it was written with"), "{}", e.message);
        // Back in place, but with a file changed.
        std::fs::remove_file(&model).unwrap();
        std::fs::rename(&outside, &model).unwrap();
        std::fs::write(model.join("config.json"), "{\"x\": 1}").unwrap();
        assert!(open(&dir, None).unwrap_err().message.contains("not the copy it was written with"));
    }

    #[test]
    fn run_records_round_trip_every_ending() {
        for exit in [
            Exit::Code(Some(0)),
            Exit::Code(Some(101)),
            Exit::Code(None),
            Exit::TimedOut,
            Exit::Cancelled,
            Exit::OutputLimit,
        ] {
            let run =
                Run { exit: exit.clone(), stdout: "x".into(), stderr: "boom".into(), seconds: 1.5, sandboxed: false };
            let back = RunRecord::of(&run).to_run();
            assert_eq!((back.exit, back.stderr.as_str(), back.seconds), (exit, "boom", 1.5));
        }
    }
}
