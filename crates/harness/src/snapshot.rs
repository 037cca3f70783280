//! Engine snapshots: the engine's files read through its directory handle, their hash, and the
//! server's copy of them that every build reads, with the package name cargo gives it.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::builds::cargo;
use super::{Budget, Grants, Workshop};
use base::beneath::Dir;
use base::error::{Context, Error, Result};

/// What the server knows about an engine crate.
#[derive(Debug, Clone)]
pub struct Engine {
    /// Canonical engine directory (the agent's), as it was when it was opened: for messages,
    /// outcomes and locks; nothing is read by this path.
    pub dir: PathBuf,
    /// The engine directory's handle: the rules read the engine through it.
    pub root: Dir,
    /// The server's snapshot of it, which is what gets built: content-compared on every call, so
    /// that a file whose modification time was set back still triggers a rebuild, and the sources
    /// cannot change between hashing and building.
    pub build_dir: PathBuf,
    /// Cargo package name.
    pub package: String,
    /// sha256 over every file of the engine (paths and contents, in path order; `target/` and
    /// `.git/` excluded).
    pub hash: String,
    /// Its `metainfer.toml`, parsed and checked.
    pub manifest: manifest::EngineManifest,
}

/// Most bytes of one engine file the snapshot copies.
pub const MAX_ENGINE_FILE_BYTES: u64 = 16 << 20;

/// The engine's files: (relative path, contents), in path order, read through its directory
/// handle: a symlink to a file inside is read through, one leading out of the directory (or
/// dangling) is left out (the containment rule reports it), and a FIFO, device or socket is refused
/// by name. `target/` and `.git/` at the top are skipped.
/// Also returns the links left out because they lead outside (or nowhere).
#[allow(clippy::type_complexity)]
fn engine_files(root: &Dir) -> Result<(Vec<(String, Vec<u8>)>, Vec<String>)> {
    const LIMIT: base::util::Limit = base::util::Limit {
        what: "engine file",
        max: MAX_ENGINE_FILE_BYTES,
        hint: "keep weights in the model directory",
    };
    type Files = Vec<(String, Vec<u8>)>;
    fn walk(root: &Dir, rel: &Path, depth: usize, files: &mut Files, left_out: &mut Vec<String>) -> Result<()> {
        for (name, t) in root.entries(rel)? {
            let child = rel.join(&name);
            let shown = child.to_string_lossy().replace('\\', "/");
            if t.is_dir() {
                if (depth == 0 && (name == "target" || name == ".git")) || depth + 1 >= 16 {
                    continue;
                }
                walk(root, &child, depth + 1, files, left_out)?;
                continue;
            }
            if t.is_symlink() {
                let inside = root.link_target(&child).leads == base::beneath::Leads::Inside;
                if !inside {
                    left_out.push(shown);
                    continue;
                }
                if !root.cap().metadata(&child).is_ok_and(|m| m.is_file()) {
                    continue;
                }
            }
            if files.len() >= 5_000 {
                return Err(Error::usage(format!(
                    "{} holds more than 5000 files; is it the engine crate?",
                    root.path().display()
                )));
            }
            files.push((shown, root.read(&child, &LIMIT)?));
        }
        Ok(())
    }
    let (mut files, mut left_out) = (Vec::new(), Vec::new());
    walk(root, Path::new(""), 0, &mut files, &mut left_out)?;
    Ok((files, left_out))
}

/// sha256 over (path, contents) pairs in order.
fn hash_files(files: &[(String, Vec<u8>)]) -> String {
    let mut h = Sha256::new();
    for (rel, bytes) in files {
        h.update((rel.len() as u64).to_le_bytes());
        h.update(rel.as_bytes());
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    format!("{:x}", h.finalize())
}

/// sha256 of an engine directory's files, as [`Engine::hash`].
///
/// # Errors
/// When a file cannot be read or is too large.
pub fn source_hash(dir: &Path) -> Result<String> {
    Ok(hash_files(&engine_files(&Dir::open(dir)?)?.0))
}

impl Workshop {
    /// Inspect an engine directory and refresh the server's snapshot of it ([`Workshop::engine_at`]
    /// on the directory opened as it is).
    ///
    /// # Errors
    /// As [`Workshop::engine_at`]; Usage when the directory cannot be opened.
    pub fn engine(&self, dir: &Path) -> Result<Engine> {
        let root = Dir::open(dir)
            .map_err(|e| Error::usage(format!("engine directory {}; pass the crate made by `scaffold`", e.message)))?;
        self.engine_at(&root)
    }

    /// Inspect the engine directory `root` (a handle: every file is read through it, never by its
    /// path) and refresh the server's snapshot of it, from which everything else is built: the
    /// package name comes from `cargo metadata` run on the snapshot, in the sandbox.
    ///
    /// # Errors
    /// [`base::error::ErrorKind::Usage`] when the directory holds no Cargo package with a library
    /// target, or a file that is not a regular file or is too large; Internal when the snapshot
    /// cannot be written.
    pub fn engine_at(&self, root: &Dir) -> Result<Engine> {
        let dir = root.path().to_path_buf();
        let (files, left_out) = engine_files(root)?;
        if !files.iter().any(|(rel, _)| rel == "Cargo.toml") {
            return Err(Error::usage(format!(
                "{} is not a Rust crate (no Cargo.toml); create one with `metainfer scaffold --out DIR`",
                dir.display()
            )));
        }
        let manifest = match files.iter().find(|(rel, _)| rel == manifest::FILE) {
            None => manifest::EngineManifest::default(),
            Some((rel, bytes)) => {
                let path = dir.join(rel);
                let limit = base::util::METAINFER_TOML;
                if bytes.len() as u64 > limit.max {
                    return Err(Error::input(format!(
                        "{} is {} bytes; a {} may be at most {} bytes: {}",
                        path.display(),
                        bytes.len(),
                        limit.what,
                        limit.max,
                        limit.hint
                    )));
                }
                let text = std::str::from_utf8(bytes)
                    .map_err(|_| Error::input(format!("{} is not UTF-8 text", path.display())))?;
                manifest::EngineManifest::parse(text)
                    .map_err(|e| Error::usage(format!("{}: {}", path.display(), e.message)))?
            }
        };
        let hash = hash_files(&files);
        let mut h = Sha256::new();
        h.update(dir.to_string_lossy().as_bytes());
        let build_dir = self.root.join("snapshots").join(&format!("{:x}", h.finalize())[..16]);
        let fail = |p: &Path, e: std::io::Error| Error::internal(format!("snapshot {}: {e}", p.display()));
        let mut keep = std::collections::HashSet::new();
        for (rel, bytes) in &files {
            let to = build_dir.join(rel);
            keep.insert(to.clone());
            if std::fs::read(&to).ok().as_deref() == Some(bytes.as_slice()) {
                continue;
            }
            std::fs::create_dir_all(to.parent().expect("a file has a parent")).map_err(|e| fail(&to, e))?;
            std::fs::write(&to, bytes).map_err(|e| fail(&to, e))?;
        }
        // Drop files the engine no longer has (cargo's own Cargo.lock stays when the engine has none).
        for e in walkdir::WalkDir::new(&build_dir).into_iter().filter_map(|e| e.ok()) {
            let p = e.path();
            if e.file_type().is_file() && !keep.contains(p) && p != build_dir.join("Cargo.lock") {
                let _ = std::fs::remove_file(p);
            }
        }
        let package = self.package_of(&dir, &build_dir).map_err(|e| {
            if left_out.is_empty() {
                return e;
            }
            Error::usage(format!(
                "{} (not read: {}, symlinks that lead outside the engine directory or nowhere; rule symlink-outside: copy what they point to into the crate, or remove them)",
                e.message,
                left_out.join(", ")
            ))
        })?;
        Ok(Engine { dir, root: root.clone(), build_dir, package, hash, manifest })
    }

    /// The package name of the snapshot `build_dir` of the engine `dir`: `cargo metadata --no-deps`
    /// on the snapshot, in the sandbox (a manifest is agent-written input to cargo).
    fn package_of(&self, dir: &Path, build_dir: &Path) -> Result<String> {
        let manifest = build_dir.join("Cargo.toml");
        let shown = dir.join("Cargo.toml");
        // cargo's messages name the snapshot; the agent knows the engine directory.
        let own = |s: &str| s.replace(&build_dir.display().to_string(), &dir.display().to_string());
        let scratch = self.scratch()?;
        let grants = self.with_cargo_config(
            Grants { tmp: Some(scratch.path().into()), ..Grants::default() }.read(build_dir).write(scratch.path()),
        );
        let args = vec![
            "metadata".into(),
            "--no-deps".into(),
            "--offline".into(),
            "--format-version".into(),
            "1".into(),
            "--manifest-path".into(),
            manifest.clone().into_os_string(),
        ];
        let r = self.run_sandboxed(cargo(&self.cargo_cwd()?, args), &grants, &Budget::secs(120))?;
        if !r.ok() {
            // cargo also loads path dependencies' manifests, which the snapshot does not hold (a
            // path dependency outside the engine is the rules' `path-outside`): a manifest that
            // names a package with a library is still this engine, so that the rules can report it.
            let text = std::fs::read_to_string(&manifest).unwrap_or_default();
            let table = toml::from_str::<toml::Table>(&text).ok();
            let name = table.as_ref().and_then(|t| t.get("package")?.get("name")?.as_str().map(str::to_string));
            let lib = table.as_ref().is_some_and(|t| t.contains_key("lib")) || build_dir.join("src/lib.rs").is_file();
            if let Some(name) = name.filter(|_| lib && text.contains("path")) {
                return Ok(name);
            }
            return Err(Error::usage(format!(
                "{}: cargo cannot read this crate: {}",
                shown.display(),
                own(&r.failure_text(2000))
            )));
        }
        let meta: cargo_metadata::Metadata =
            serde_json::from_str(&r.stdout).internal_ctx(|| "cargo metadata output".to_owned())?;
        let pkg = meta.packages.iter().find(|p| p.manifest_path.as_std_path() == manifest).ok_or_else(|| {
            Error::usage(format!("{}: no package found (is it a virtual workspace?)", shown.display()))
        })?;
        if !pkg.targets.iter().any(|t| t.is_lib()) {
            return Err(Error::usage(format!("{}: the engine must be a library crate (src/lib.rs)", shown.display())));
        }
        Ok(pkg.name.to_string())
    }
}
