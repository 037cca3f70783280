//! Bundle transport: the scratch directory a harness call works in, and a gate's harness
//! commands written into a bundle (staged beside its destination, moved into place when complete)
//! or a bundle read back and checked to hold exactly what this call would send.

use std::path::{Path, PathBuf};

use super::Gate;
use base::beneath::{Dir, Files};
use base::error::{Context, Error, Result};
use harness::protocol::{Command, Request, VERSION};
use harness::{self, bundle};

/// The directory a harness call's requests, inputs and outputs live in.
pub enum Scratch {
    /// A temporary directory, removed when dropped (direct calls).
    Temp(tempfile::TempDir),
    /// A bundle being staged beside its destination, removed when dropped unless moved into place.
    Staged(Staging),
    /// A bundle directory being read back (kept), by its handle.
    Bundle(Dir),
}

/// A bundle's staging directory: created through the handle of the destination's parent, written
/// through its own handle's path in this process (`/proc/self/fd/N`), and renamed into place
/// through the parent's handle, so a parent swapped for a symlink meanwhile redirects nothing.
pub struct Staging {
    parent: Dir,
    name: String,
    dir: Dir,
    done: std::cell::Cell<bool>,
    /// The destination's missing ancestors this call created (beneath `base`, outermost first),
    /// removed again when the bundle is not completed.
    created: Vec<PathBuf>,
    base: Dir,
}

impl Staging {
    /// Create the missing folders of `parent` (relative to `base`), then
    /// `.bundle-staging-<random>` in it.
    pub(super) fn new(base: &Dir, parent: &Path) -> Result<Staging> {
        let mut created = Vec::new();
        let mut at = PathBuf::new();
        for c in parent.components() {
            at.push(c);
            if !base.exists(&at) {
                created.push(at.clone());
            }
        }
        let made = (|| {
            base.create_dir_all(parent)?;
            let parent = base.open_dir(parent)?;
            let name = format!(".bundle-staging-{:016x}", rand::random::<u64>());
            parent.create_dir(Path::new(&name))?;
            let dir = parent.open_dir_nofollow(Path::new(&name))?;
            Ok((parent, name, dir))
        })();
        match made {
            Ok((parent, name, dir)) => {
                Ok(Staging { parent, name, dir, done: std::cell::Cell::new(false), created, base: base.clone() })
            }
            Err(e) => {
                remove_created(base, &created);
                Err(e)
            }
        }
    }

    /// Move the staged bundle into place as `dest` (a plain name in the parent; an empty
    /// directory there is replaced).
    fn commit(&self, dest: &std::ffi::OsStr) -> Result<()> {
        self.parent.replace_empty_dir(Path::new(&self.name), Path::new(dest))?;
        self.done.set(true);
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.done.get() {
            self.parent.remove_dir_all(Path::new(&self.name));
            remove_created(&self.base, &self.created);
        }
    }
}

/// Remove the folders a failed bundle created, innermost first, each only while empty.
fn remove_created(base: &Dir, created: &[PathBuf]) {
    for p in created.iter().rev() {
        base.remove_empty_dir(p);
    }
}

/// `e` with the `/proc/self/fd/N` path of `dir` named by the directory's own path (whole path
/// components only: `/proc/self/fd/5` is not a prefix of `/proc/self/fd/57`).
fn unpin(dir: &Dir, e: Error) -> Error {
    let (pinned, real) = (dir.fd_path().display().to_string(), dir.path().display().to_string());
    let mut out = String::with_capacity(e.message.len());
    let mut rest = e.message.as_str();
    while let Some(at) = rest.find(&pinned) {
        let after = &rest[at + pinned.len()..];
        out.push_str(&rest[..at]);
        out.push_str(if after.starts_with(|c: char| c.is_ascii_digit()) { &pinned } else { &real });
        rest = after;
    }
    out.push_str(rest);
    Error { message: out, ..e }
}

/// A built harness and the scratch directory of this call.
pub struct Harness {
    /// The harness executable.
    pub exe: PathBuf,
    /// Scratch directory for requests, inputs and outputs.
    pub scratch: Scratch,
    /// The bundle's nonce when writing or reading one (output names carry it).
    pub nonce: Option<String>,
    /// What a trusted runner signed, when reading back an attested bundle: every file read is
    /// checked against it.
    pub attested: Option<harness::attest::Attested>,
}

impl Harness {
    /// The scratch directory.
    pub fn dir(&self) -> &Path {
        match &self.scratch {
            Scratch::Temp(t) => t.path(),
            Scratch::Staged(s) => s.dir.pinned(),
            Scratch::Bundle(d) => d.pinned(),
        }
    }

    /// `e` with the scratch directory named by its own path where [`Harness::dir`] is a handle's
    /// `/proc/self/fd/N` (a bundle being staged or read back).
    pub fn unpin(&self, e: Error) -> Error {
        match &self.scratch {
            Scratch::Temp(_) => e,
            Scratch::Staged(s) => unpin(&s.dir, e),
            Scratch::Bundle(d) => unpin(d, e),
        }
    }

    /// Read the file `name` of the scratch directory, at most
    /// [`base::util::HARNESS_OUTPUT`] bytes: beneath the bundle directory's handle when reading
    /// one back (a link out of it refused), by path otherwise.
    ///
    /// # Errors
    /// Input naming the file: missing, not a regular file, too large, or leading outside.
    pub fn read(&self, name: &str) -> Result<Vec<u8>> {
        match &self.scratch {
            Scratch::Bundle(d) => {
                let bytes = d.read(Path::new(name), &base::util::HARNESS_OUTPUT)?;
                if let Some(a) = &self.attested {
                    a.check(name, &bytes)?;
                }
                Ok(bytes)
            }
            _ => base::util::read_regular(&self.path(name), &base::util::HARNESS_OUTPUT).map_err(|e| self.unpin(e)),
        }
    }

    /// The tensors of the harness output file `path` (in the scratch directory, as
    /// [`Harness::path`] gives it), read as [`Harness::read`] reads.
    ///
    /// # Errors
    /// As [`Harness::read`]; Internal when it is not a safetensors file.
    pub fn output_words(
        &self,
        path: &Path,
    ) -> Result<(harness::Metadata, std::collections::HashMap<String, Vec<u32>>)> {
        let name = path.strip_prefix(self.dir()).unwrap_or(path).to_string_lossy().into_owned();
        let shown = match &self.scratch {
            Scratch::Bundle(d) => d.path().join(&name),
            _ => path.to_path_buf(),
        };
        harness::tensor_words(&self.read(&name)?, &shown)
    }

    /// Write the new file `name` into the scratch directory and return its path: created with
    /// `O_EXCL`, so a name already there (a symlink planted in a bundle's staging directory
    /// included) is an error, never written through.
    ///
    /// # Errors
    /// Usage or Internal naming the file; Internal for a bundle being read back.
    pub fn write_new(&self, name: &str, bytes: &[u8]) -> Result<PathBuf> {
        match &self.scratch {
            Scratch::Temp(_) => {
                use std::io::Write;
                let path = self.path(name);
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&path)
                    .and_then(|mut f| f.write_all(bytes))
                    .internal_ctx(|| path.display().to_string())?;
            }
            Scratch::Staged(s) => s.dir.write_new(Path::new(name), bytes).map_err(|e| unpin(&s.dir, e))?,
            Scratch::Bundle(_) => return Err(Error::internal("nothing is written into a bundle being read back")),
        }
        Ok(self.path(name))
    }

    /// Create the new directory `name` in the scratch directory (a name already there, a
    /// symlink included, is an error).
    ///
    /// # Errors
    /// Usage or Internal naming the directory.
    pub fn create_dir(&self, name: &str) -> Result<PathBuf> {
        match &self.scratch {
            Scratch::Temp(_) => {
                std::fs::create_dir(self.path(name)).internal_ctx(|| self.path(name).display().to_string())?
            }
            Scratch::Staged(s) => s.dir.create_dir(Path::new(name)).map_err(|e| unpin(&s.dir, e))?,
            Scratch::Bundle(_) => return Err(Error::internal("nothing is written into a bundle being read back")),
        }
        Ok(self.path(name))
    }

    /// A path in the scratch directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir().join(name)
    }

    /// The path of the output file `name` the harness is to write: in a bundle, its name carries
    /// the bundle's nonce ([`bundle::output_name`]), so outputs copied from another bundle are not
    /// found.
    pub fn output(&self, name: &str) -> PathBuf {
        match &self.nonce {
            Some(n) => self.path(&bundle::output_name(name, n)),
            None => self.path(name),
        }
    }
}

/// What a bundle carries to run: harness commands, or the plan of a gate that runs the engine's
/// own binary (`bundle::PLAN`).
pub enum Payload<'c> {
    /// Harness protocol commands, each with its environment.
    Commands(Vec<(Command, Vec<(&'c str, String)>)>),
    /// The plan's bytes (JSON).
    Plan(Vec<u8>),
}

/// A bundle written by a gate: not a verdict.
#[derive(Debug, Clone)]
pub struct BundleWritten {
    /// The bundle directory.
    pub dir: PathBuf,
    /// Requests in it.
    pub requests: usize,
    /// Bytes written.
    pub bytes: u64,
    /// Whether the model was copied in (else `bundle run --model DIR` must name it).
    pub model_copied: bool,
    /// Whether the gate reads a model at all (a kernel test does not).
    pub has_model: bool,
}

/// How the text of a gate that wrote a bundle begins ([`BundleWritten::text`]): such a report is
/// no verdict, and the CLI exits 0 for it.
pub const BUNDLE_WRITTEN: &str = "not run: bundle written to ";

/// Whether a gate report's reason text says it wrote a bundle (no verdict).
pub fn wrote_bundle(why: &str) -> bool {
    why.starts_with(BUNDLE_WRITTEN)
}

impl BundleWritten {
    /// What a gate reports for it: not run, and how to run and compare it.
    pub fn text(&self, tool: &str) -> String {
        format!(
            "{BUNDLE_WRITTEN}{} ({} request(s), {} bytes{}); run `metainfer bundle run {}{}` on the machine with the device, then call {tool} again with from_bundle = {}",
            self.dir.display(),
            self.requests,
            self.bytes,
            if self.model_copied { ", model included" } else { "" },
            self.dir.display(),
            if self.model_copied || !self.has_model { "" } else { " --model DIR" },
            self.dir.display()
        )
    }
}

impl<'a> Gate<'a> {
    /// A bundle read back must hold exactly what this call would send: the same requests (with
    /// the same environment) and the same model, by hash.
    pub(super) fn check_bundle(
        &self,
        dir: &Dir,
        commands: &[(Command, Vec<(&str, String)>)],
        model: Option<&dyn Files>,
    ) -> Result<()> {
        let m = self.bundle.as_ref().ok_or_else(|| Error::internal("reading a bundle without its manifest"))?;
        if m.requests.len() != commands.len() {
            return Err(Error::usage(format!(
                "{} holds {} request(s), this call sends {}: the bundle was altered or written by another metainfer",
                dir.path().display(),
                m.requests.len(),
                commands.len()
            )));
        }
        for (i, ((c, env), r)) in commands.iter().zip(&m.requests).enumerate() {
            let held = bundle::read_request(dir, i)?;
            let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
            let sends = bundle::relative(c.clone(), dir.pinned());
            let differs = if held.command != sends {
                let as_json = |c: &Command| serde_json::to_value(c).unwrap_or_default();
                Some(first_difference(&as_json(&held.command), &as_json(&sends), "command"))
            } else if r.env != env {
                Some(format!("environment (bundle {:?}, this call {env:?})", r.env))
            } else {
                None
            };
            if let Some(what) = differs {
                return Err(Error::usage(format!(
                    "{} is not what this call sends ({what}): call {} with the arguments the bundle was written with (prompts, max_new_tokens, prompt_len, new_tokens, runs, threads, kernels), or write a new bundle",
                    dir.show(Path::new(&bundle::request_file(i))).display(),
                    self.tool.name()
                )));
            }
        }
        self.check_bundle_model(dir, model)
    }

    /// A bundle read back must hold the model this call reads, by hash (or none when it reads
    /// none).
    fn check_bundle_model(&self, dir: &Dir, model: Option<&dyn Files>) -> Result<()> {
        let m = self.bundle.as_ref().ok_or_else(|| Error::internal("reading a bundle without its manifest"))?;
        match (&m.model, model) {
            (Some(held), Some(here)) => {
                let h = bundle::model_hash(here)?;
                if h != held.sha256 {
                    return Err(Error::usage(format!(
                        "model {} differs from the one the bundle was written with ({}): judge it against that model",
                        here.path().display(),
                        held.source
                    )));
                }
            }
            (None, None) => {}
            _ => {
                return Err(Error::usage(format!(
                    "{}: the bundle's model entry does not fit this call",
                    dir.path().display()
                )));
            }
        }
        Ok(())
    }

    /// The observations a bundle of a gate that runs the engine's binary recorded when it ran
    /// (`bundle::OBSERVED` under the bundle's nonce), after checking that the bundle's plan is the
    /// one this call sends and its model the one this call reads. Read through the bundle's
    /// handle, bounded, and checked against the runner's signature when there is one.
    ///
    /// # Errors
    /// Usage: not a plan bundle, another plan or model, or not run yet.
    pub(super) fn read_observed(&self, dir: &Dir, plan: &[u8], model: Option<&dyn Files>) -> Result<Vec<u8>> {
        let m = self.bundle.as_ref().ok_or_else(|| Error::internal("reading a bundle without its manifest"))?;
        if m.requests.len() != 1 || m.requests[0].request != bundle::PLAN {
            return Err(Error::usage(format!(
                "{} holds no plan of {}: the bundle was altered or written by another metainfer",
                dir.path().display(),
                self.tool.name()
            )));
        }
        let read = |name: &str, limit: &base::util::Limit| -> Result<Vec<u8>> {
            let bytes = dir.read(Path::new(name), limit)?;
            if let Some(a) = self.attested() {
                a.check(name, &bytes)?;
            }
            Ok(bytes)
        };
        let held: serde_json::Value = serde_json::from_slice(&read(bundle::PLAN, &base::util::HARNESS_REPLY)?)
            .usage_ctx(|| format!("{}: the plan does not parse", dir.show(Path::new(bundle::PLAN)).display()))?;
        let sends: serde_json::Value =
            serde_json::from_slice(plan).internal_ctx(|| format!("{}'s plan", self.tool.name()))?;
        if held != sends {
            return Err(Error::usage(format!(
                "{} is not what this call sends ({}): call {} with the arguments the bundle was written with (concurrency, requests, max_tokens), or write a new bundle",
                dir.show(Path::new(bundle::PLAN)).display(),
                first_difference(&held, &sends, "plan"),
                self.tool.name()
            )));
        }
        self.check_bundle_model(dir, model)?;
        let name = bundle::output_name(bundle::OBSERVED, &m.nonce);
        if !dir.has(&name) {
            return Err(Error::usage(format!(
                "bundle {} has not been run (no {name}): run `metainfer bundle run {}` on the machine with the device, then call {} again",
                dir.path().display(),
                dir.path().display(),
                self.tool.name()
            )));
        }
        read(&name, &base::util::SERVE_OBSERVED)
    }

    pub(super) fn write_bundle(
        &self,
        h: &Harness,
        payload: Payload,
        model: Option<&dyn Files>,
        dest: &crate::NewDir,
    ) -> Result<BundleWritten> {
        let Scratch::Staged(staging) = &h.scratch else {
            return Err(Error::internal("a bundle is written from its staging directory"));
        };
        let (root, dir) = (h.dir().to_path_buf(), &staging.dir);
        let unpinned = |e: Error| unpin(dir, e);
        let hash = |name: &str, limit: &base::util::Limit| -> Result<String> {
            use sha2::Digest;
            let mut f = dir.open(name, limit)?;
            let mut h = sha2::Sha256::new();
            std::io::copy(&mut f, &mut h).internal_ctx(|| dir.show(Path::new(name)).display().to_string())?;
            Ok(format!("{:x}", h.finalize()))
        };
        // Inputs first (everything the gate drew into the scratch directory), by file name.
        let mut inputs = std::collections::BTreeMap::new();
        for (name, e) in dir.listing() {
            if e == base::beneath::Entry::File {
                let sha = hash(&name, &base::util::HARNESS_OUTPUT)?;
                inputs.insert(name, sha);
            }
        }
        // The harness executable: a new file (nothing planted in its place is written through),
        // executable.
        {
            use std::os::unix::fs::PermissionsExt;
            let mut from = std::fs::File::open(&h.exe).internal_ctx(|| h.exe.display().to_string())?;
            let mut to = dir.create_new_file(Path::new(bundle::HARNESS)).map_err(unpinned)?;
            std::io::copy(&mut from, &mut to)
                .and_then(|_| to.set_permissions(std::fs::Permissions::from_mode(0o755)))
                .internal_ctx(|| dir.show(Path::new(bundle::HARNESS)).display().to_string())?;
        }
        let model_entry = match model {
            Some(m) => {
                let copied = bundle::model_bytes(m)? <= bundle::MAX_COPIED_MODEL;
                if copied {
                    bundle::copy_model(m, dir, bundle::MODEL).map_err(unpinned)?;
                }
                Some(bundle::BundleModel {
                    copied,
                    sha256: bundle::model_hash(m)?,
                    source: m.path().display().to_string(),
                })
            }
            None => None,
        };
        let mut requests = Vec::new();
        let commands = match payload {
            Payload::Commands(c) => c,
            Payload::Plan(plan) => {
                dir.write_new(Path::new(bundle::PLAN), &plan).map_err(unpinned)?;
                requests.push(bundle::BundleRequest { request: bundle::PLAN.into(), env: vec![] });
                vec![]
            }
        };
        for (i, (c, env)) in commands.into_iter().enumerate() {
            let command = bundle::relative(c, &root);
            let req = Request { version: VERSION, reply: bundle::reply_file(i).into(), command };
            let text = serde_json::to_vec_pretty(&req).internal_ctx(|| "bundle request".to_owned())?;
            dir.write_new(Path::new(&bundle::request_file(i)), &text).map_err(unpinned)?;
            requests.push(bundle::BundleRequest {
                request: bundle::request_file(i),
                env: env.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
            });
        }
        let manifest = bundle::BundleManifest {
            format: bundle::FORMAT,
            tool: self.tool.name().into(),
            engine: self.engine.dir.display().to_string(),
            engine_hash: self.engine.hash.clone(),
            dtype: self.target.dtype.clone(),
            target: self.target.target.clone(),
            platform: self.target.platform.clone(),
            seed: self.seed,
            protocol: VERSION,
            nonce: self.nonce.clone().ok_or_else(|| Error::internal("a bundle written without its nonce"))?,
            harness_sha256: hash(bundle::HARNESS, &base::util::MODEL_FILE)?,
            requests,
            inputs,
            model: model_entry.clone(),
            written: ledger::now_rfc3339(),
        };
        let text = serde_json::to_vec_pretty(&manifest).internal_ctx(|| "bundle manifest".to_owned())?;
        dir.write_new(Path::new(bundle::MANIFEST), &text).map_err(unpinned)?;
        // The ledger remembers what was written: a bundle read back must carry this manifest.
        let sha = format!("{:x}", <sha2::Sha256 as sha2::Digest>::digest(&text));
        ledger::Ledger::open(&self.ctx.ledger)?.record_bundle(&manifest.nonce, &manifest.tool, &sha)?;
        let bytes: u64 = walkdir::WalkDir::new(&root)
            .into_iter()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type().is_file())
            .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
            .sum();
        // Complete: move the staged directory into place (an empty destination is replaced).
        let name = dest.rest.file_name().ok_or_else(|| Error::internal("a bundle destination without a name"))?;
        staging.commit(name)?;
        Ok(BundleWritten {
            dir: dest.path(),
            requests: manifest.requests.len(),
            bytes,
            has_model: model_entry.is_some(),
            model_copied: model_entry.is_some_and(|m| m.copied),
        })
    }
}

/// Where two JSON values first differ, as `path: held X, sent Y` (values cut to 120 characters),
/// for a bundle request that does not match the call reading it back.
fn first_difference(held: &serde_json::Value, sent: &serde_json::Value, path: &str) -> String {
    use serde_json::Value;
    match (held, sent) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for k in keys {
                let (x, y) = (a.get(k).unwrap_or(&Value::Null), b.get(k).unwrap_or(&Value::Null));
                if x != y {
                    return first_difference(x, y, &format!("{path}.{k}"));
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                if x != y {
                    return first_difference(x, y, &format!("{path}[{i}]"));
                }
            }
        }
        _ => {}
    }
    let cut = |v: &Value| v.to_string().chars().take(120).collect::<String>();
    format!("{path}: bundle {}, this call {}", cut(held), cut(sent))
}

#[cfg(test)]
mod tests {
    use super::first_difference;
    use serde_json::json;

    #[test]
    fn first_difference_names_the_innermost_differing_field() {
        let held = json!({"command": "generate", "prompts": [{"text": "a", "max_new_tokens": 8}], "model": "model"});
        let sent = json!({"command": "generate", "prompts": [{"text": "a", "max_new_tokens": 9}], "model": "model"});
        assert_eq!(
            first_difference(&held, &sent, "command"),
            "command.prompts[0].max_new_tokens: bundle 8, this call 9"
        );
        // Lists of different lengths are shown whole; a key only one side has is compared with null.
        assert_eq!(first_difference(&json!([1]), &json!([1, 2]), "c"), "c: bundle [1], this call [1,2]");
        assert_eq!(first_difference(&json!({"a": 1}), &json!({}), "c"), "c.a: bundle 1, this call null");
    }

    #[test]
    fn an_unfinished_bundle_leaves_no_folder_it_created() {
        use super::{Dir, Path, Staging};
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir(t.path().join("kept")).unwrap();
        let base = Dir::open(t.path()).unwrap();
        // Dropped before its commit: the staging directory and the folders made for it go; a folder
        // that was there stays.
        let s = Staging::new(&base, Path::new("kept/new/deeper")).unwrap();
        assert!(t.path().join("kept/new/deeper").join(&s.name).is_dir());
        drop(s);
        assert!(t.path().join("kept").is_dir() && !t.path().join("kept/new").exists());
        // Committed: everything stays, under the destination's name.
        let s = Staging::new(&base, Path::new("a/b")).unwrap();
        s.dir.write_new(Path::new("f"), b"F").unwrap();
        s.commit(std::ffi::OsStr::new("bundle")).unwrap();
        drop(s);
        assert_eq!(std::fs::read(t.path().join("a/b/bundle/f")).unwrap(), b"F");
    }
}
