//! Directory handles: a directory resolved once, and every later open of a file or folder inside it
//! made relative to that handle without following a symlink or `..` out of it. On Linux the
//! `cap-std` crate resolves each path with `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` (and by
//! its own component-by-component walk where openat2 is missing), so a directory swapped for a
//! symlink after it was checked cannot redirect a read or a write: the handle still names the
//! directory that was checked, and a link leading out of it is an error, not a way out.
//!
//! Reads through a handle are the bounded, regular-file reads of [`crate::util`]: a FIFO, a device
//! or a socket is refused by name, a file over its kind's size limit is refused with the limit, and
//! the open never blocks. Errors name the file by its path under the handle's directory and never
//! quote the contents of anything outside it. Depends on `util` and `error` only.
//!
//! [`Files`] is what the model readers and a bundle's model copy read through: a plain path
//! (nothing confined), a [`HeldDir`] (a model directory held by its handle; a file that is a symlink
//! is opened beneath the root the directory was resolved in, so a Hugging Face cache's links into
//! `blobs/` work and nothing outside the root is read; its [`Grant`] gives a sandbox the held
//! directory and the files its links lead to, as `/proc/self/fd/N` of handles it keeps open), or a
//! [`Dir`] (a bundle read back). New files and directories made through a `Dir` are `O_EXCL` (a
//! symlink planted in their place is an error, never written through), directories 0700.
//!
//! cap-std rather than openat2 through rustix or libc: it is the maintained capability-style API
//! (Bytecode Alliance, used by wasmtime), brings no crate not already built but its own small ones
//! (cap-primitives, io-lifetimes, ...; rustix was already a dependency), and falls back to a checked
//! component-by-component walk where openat2 is missing, which our own code would have to write.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cap_std::fs::FileTypeExt;

use crate::error::{Error, Result};
use crate::util::Limit;

/// An open directory and the path it had when it was opened (for messages, outcomes and the child
/// processes that are given it by path). Cloning shares the handle.
#[derive(Clone)]
pub struct Dir {
    path: PathBuf,
    pinned: PathBuf,
    cap: Arc<cap_std::fs::Dir>,
}

impl std::fmt::Debug for Dir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dir").field("path", &self.path).finish()
    }
}

/// Whether an io error is cap-std's refusal of a path that leads outside the handle's directory
/// (an absolute symlink, a symlink or `..` climbing above it).
pub fn is_escape(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::PermissionDenied && e.to_string().contains("outside of the filesystem")
}

impl From<cap_std::fs::FileType> for crate::util::EntryType {
    fn from(t: cap_std::fs::FileType) -> crate::util::EntryType {
        crate::util::EntryType {
            dir: t.is_dir(),
            fifo: t.is_fifo(),
            char_device: t.is_char_device(),
            block_device: t.is_block_device(),
            socket: t.is_socket(),
            symlink: t.is_symlink(),
            file: t.is_file(),
        }
    }
}

impl Dir {
    /// Open `path` as a directory with the server's own rights (symlinks in `path` itself are
    /// followed): for a root the server trusts (the workspace, a model directory, a path given
    /// without `--workspace`). Its recorded path is the one the kernel resolved.
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Usage`] naming the path when it is missing or not a directory.
    pub fn open(path: &Path) -> Result<Dir> {
        let cap = cap_std::fs::Dir::open_ambient_dir(path, cap_std::ambient_authority())
            .map_err(|e| Error::usage(format!("{}: {}", path.display(), words(&e))))?;
        Ok(Dir::from_cap(cap, path))
    }

    fn from_cap(cap: cap_std::fs::Dir, fallback: &Path) -> Dir {
        use std::os::fd::AsRawFd;
        let path = std::fs::read_link(format!("/proc/self/fd/{}", cap.as_raw_fd()))
            .ok()
            .filter(|p| p.is_absolute())
            .unwrap_or_else(|| std::path::absolute(fallback).unwrap_or_else(|_| fallback.to_path_buf()));
        let pinned = PathBuf::from(format!("/proc/self/fd/{}", cap.as_raw_fd()));
        Dir { path, pinned, cap: Arc::new(cap) }
    }

    /// The directory's absolute path when it was opened (it may have been moved since; every
    /// access goes through the handle, never through this path).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The cap-std handle, for operations this type does not wrap.
    pub fn cap(&self) -> &cap_std::fs::Dir {
        &self.cap
    }

    /// A path that names this very directory in this process (`/proc/self/fd/N`), whatever has
    /// been renamed or swapped on the way to [`Dir::path`] since it was opened: for sandbox grants,
    /// which the server builds in its own process.
    pub fn fd_path(&self) -> PathBuf {
        self.pinned.clone()
    }

    /// [`Dir::fd_path`], borrowed: a path through which this process reads and writes inside the
    /// held directory by path (files written by other code, e.g. a gate's scratch files).
    pub fn pinned(&self) -> &Path {
        &self.pinned
    }

    /// Create the directory `rel` (its parent must exist beneath this one), readable and
    /// writable by the owner only (mode 0700).
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Usage`] naming the path: anything exists there (a symlink
    /// included), or its parent leads outside.
    pub fn create_dir(&self, rel: &Path) -> Result<()> {
        use cap_std::fs::DirBuilderExt;
        let mut b = cap_std::fs::DirBuilder::new();
        b.mode(0o700);
        self.cap.create_dir_with(rel, &b).map_err(|e| self.error(rel, &e))
    }

    /// Create the new file `rel` for writing (`O_CREAT | O_EXCL`: anything already there, a
    /// symlink planted in its place included, is an error, never written through).
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Usage`] naming the path.
    pub fn create_new_file(&self, rel: &Path) -> Result<std::fs::File> {
        let mut o = cap_std::fs::OpenOptions::new();
        o.write(true).create_new(true);
        Ok(self.cap.open_with(rel, &o).map_err(|e| self.error(rel, &e))?.into_std())
    }

    /// [`Dir::create_new_file`] holding `bytes`.
    ///
    /// # Errors
    /// As [`Dir::create_new_file`], or a failed write.
    pub fn write_new(&self, rel: &Path, bytes: &[u8]) -> Result<()> {
        use std::io::Write;
        let mut f = self.create_new_file(rel)?;
        f.write_all(bytes).map_err(|e| self.error(rel, &e))
    }

    /// Create the directory `rel` and its missing parents beneath this one.
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Usage`] naming the path: a component is not a directory or
    /// leads outside.
    pub fn create_dir_all(&self, rel: &Path) -> Result<()> {
        if rel.as_os_str().is_empty() {
            return Ok(());
        }
        self.cap.create_dir_all(rel).map_err(|e| self.error(rel, &e))
    }

    /// Rename the entry `from` to `to` (plain names in this directory); an empty directory at
    /// `to` is replaced, anything else there is an error.
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Usage`] naming `to`.
    pub fn replace_empty_dir(&self, from: &Path, to: &Path) -> Result<()> {
        if self.kind(to).is_some_and(|t| t.is_dir()) {
            self.cap.remove_dir(to).map_err(|e| self.error(to, &e))?;
        }
        self.cap.rename(from, &self.cap, to).map_err(|e| self.error(to, &e))
    }

    /// Remove the directory `rel` and everything in it, beneath this one (best effort: what
    /// cannot be removed stays).
    pub fn remove_dir_all(&self, rel: &Path) {
        let _ = self.cap.remove_dir_all(rel);
    }

    /// Remove the directory `rel` beneath this one if it is empty (best effort).
    pub fn remove_empty_dir(&self, rel: &Path) {
        let _ = self.cap.remove_dir(rel);
    }

    /// The path of `rel` under this directory, for messages.
    pub fn show(&self, rel: &Path) -> PathBuf {
        if rel.as_os_str().is_empty() { self.path.clone() } else { self.path.join(rel) }
    }

    /// The error for `rel` (under this directory) failing with `e`: an escape is named as one.
    pub fn error(&self, rel: &Path, e: &io::Error) -> Error {
        if is_escape(e) {
            Error::usage(format!(
                "{} leads outside {} (through a symlink or `..`); copy what it points to into the directory, or remove the link",
                self.show(rel).display(),
                self.path.display()
            ))
        } else {
            Error::usage(format!("{}: {}", self.show(rel).display(), words(e)))
        }
    }

    /// Open the directory `rel` beneath this one (symlinks inside it followed, none out of it).
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Usage`] naming the path: missing, not a directory, or leading
    /// outside.
    pub fn open_dir(&self, rel: &Path) -> Result<Dir> {
        if rel.as_os_str().is_empty() {
            return Ok(self.clone());
        }
        let cap = self.cap.open_dir(rel).map_err(|e| self.error(rel, &e))?;
        Ok(Dir::from_cap(cap, &self.show(rel)))
    }

    /// Open the directory `name` (one plain name) directly in this one, refusing a symlink.
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Usage`] naming the path: missing, a symlink, not a directory.
    pub fn open_dir_nofollow(&self, name: &Path) -> Result<Dir> {
        use std::os::unix::fs::MetadataExt;
        let d = self.open_dir(name)?;
        // What was opened must be what `name` is without following a link: a link swapped in
        // before the open, or after it, fails the comparison.
        let opened = std::fs::metadata(d.fd_path()).map_err(|e| self.error(name, &e))?;
        let here = std::fs::symlink_metadata(self.fd_path().join(name)).map_err(|e| self.error(name, &e))?;
        if here.file_type().is_symlink() || (here.dev(), here.ino()) != (opened.dev(), opened.ino()) {
            return Err(Error::usage(format!(
                "{} is a symlink, not a directory; remove it and let the server create the directory",
                self.show(name).display()
            )));
        }
        Ok(d)
    }

    /// What `rel` is without following a final symlink (None when it does not exist or leads
    /// outside).
    pub fn kind(&self, rel: &Path) -> Option<cap_std::fs::FileType> {
        self.cap.symlink_metadata(rel).ok().map(|m| m.file_type())
    }

    /// Whether `rel` exists beneath this directory (a final symlink is not followed).
    pub fn exists(&self, rel: &Path) -> bool {
        self.kind(rel).is_some()
    }

    /// Open the regular file `rel` for reading: its type is checked before the open (symlinks
    /// inside followed, none out), the open does not block (`O_NONBLOCK`, so a FIFO swapped in
    /// meanwhile cannot stall it), and the opened file's type is checked again.
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Input`] naming the file and what it is (a FIFO, a device, a
    /// socket, a directory); Usage when it leads outside or does not exist.
    pub fn open_file(&self, rel: &Path, limit: &Limit) -> Result<std::fs::File> {
        use cap_std::fs::OpenOptionsExt;
        let refuse = |what: &str| {
            Error::input(format!(
                "{} is {what}, not a regular file; the {} must be a regular file",
                self.show(rel).display(),
                limit.what
            ))
        };
        let meta = self.cap.metadata(rel).map_err(|e| self.error(rel, &e))?;
        if !meta.is_file() {
            return Err(refuse(crate::util::kind_of(meta.file_type())));
        }
        let mut o = cap_std::fs::OpenOptions::new();
        o.read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY);
        let f = self.cap.open_with(rel, &o).map_err(|e| self.error(rel, &e))?.into_std();
        let t = f.metadata().map_err(|e| self.error(rel, &e))?.file_type();
        if !t.is_file() {
            return Err(refuse(crate::util::kind_of(t)));
        }
        Ok(f)
    }

    /// Read the regular file `rel` whole, at most `limit.max` bytes ([`Dir::open_file`], then
    /// [`crate::util::read_open_bounded`]).
    ///
    /// # Errors
    /// As those two.
    pub fn read(&self, rel: &Path, limit: &Limit) -> Result<Vec<u8>> {
        crate::util::read_open_bounded(self.open_file(rel, limit)?, &self.show(rel), limit)
    }

    /// [`Dir::read`] as UTF-8 text.
    ///
    /// # Errors
    /// As [`Dir::read`], or a file that is not UTF-8.
    pub fn read_text(&self, rel: &Path, limit: &Limit) -> Result<String> {
        String::from_utf8(self.read(rel, limit)?).map_err(|_| {
            Error::input(format!("{} is not UTF-8 text; the {} must be UTF-8", self.show(rel).display(), limit.what))
        })
    }

    /// The entries of the directory `rel` beneath this one (`""`: this one), as (name, type
    /// without following symlinks), sorted by name.
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Usage`] naming the directory.
    pub fn entries(&self, rel: &Path) -> Result<Vec<(std::ffi::OsString, cap_std::fs::FileType)>> {
        let it = if rel.as_os_str().is_empty() { self.cap.entries() } else { self.cap.read_dir(rel) };
        let mut out = Vec::new();
        for e in it.map_err(|e| self.error(rel, &e))? {
            let e = e.map_err(|e| self.error(rel, &e))?;
            let t = e.file_type().map_err(|e| self.error(rel, &e))?;
            out.push((e.file_name(), t));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Where the symlink `rel` leads: inside this directory (it resolves beneath it), outside
    /// (it climbs out or is absolute), or nowhere (dangling or a loop).
    pub fn link_target(&self, rel: &Path) -> Link {
        let target = self.cap.read_link_contents(rel).unwrap_or_default();
        let leads = match self.cap.metadata(rel) {
            Ok(_) => Leads::Inside,
            Err(e) if is_escape(&e) => Leads::Outside,
            Err(_) => Leads::Nowhere,
        };
        Link { rel: rel.to_string_lossy().replace('\\', "/"), target, leads }
    }

    /// Write `bytes` to `rel` atomically: into a temporary file in the same directory beneath this
    /// one, then renamed over `rel` (a symlink at `rel` is replaced, never written through). The
    /// parent directory must exist beneath this one.
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Usage`] naming the path.
    pub fn write_atomic(&self, rel: &Path, bytes: &[u8]) -> Result<()> {
        use std::io::Write;
        let parent = rel.parent().unwrap_or(Path::new(""));
        let name =
            rel.file_name().ok_or_else(|| Error::usage(format!("{}: not a file name", self.show(rel).display())))?;
        let dir = self.open_dir(parent)?;
        let tmp = PathBuf::from(format!(".{}.{:016x}.tmp", name.to_string_lossy(), rand::random::<u64>()));
        let written = (|| -> io::Result<()> {
            let mut o = cap_std::fs::OpenOptions::new();
            o.write(true).create_new(true);
            let mut f = dir.cap.open_with(&tmp, &o)?;
            f.write_all(bytes)?;
            f.sync_all()?;
            dir.cap.rename(&tmp, &dir.cap, name)
        })();
        if let Err(e) = written {
            let _ = dir.cap.remove_file(&tmp);
            return Err(self.error(rel, &e));
        }
        Ok(())
    }
}

/// The files of one directory, read by name: what the model readers and a bundle's model copy
/// read through. A plain path ([`Path`], [`PathBuf`]) reads as it is, following symlinks (no
/// workspace: nothing is confined); a [`HeldDir`] reads through handles opened once.
pub trait Files {
    /// The directory's path: for messages, and for what is given the directory by path (an
    /// engine's process, inside its sandbox).
    fn path(&self) -> &Path;

    /// Open the regular file `name` (a plain name inside the directory) for reading, as
    /// [`crate::util::open_regular`] opens one (type checked before and after, a non-blocking open).
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Input`] or Usage naming the file: missing, not a regular file,
    /// or leading outside the directory's root.
    fn open(&self, name: &str, limit: &Limit) -> Result<std::fs::File>;

    /// Whether `name` is a regular file (symlinks followed, none out of the root).
    fn has_file(&self, name: &str) -> bool;

    /// Whether `name` exists (symlinks followed, none out of the root).
    fn has(&self, name: &str) -> bool;

    /// The directory's entries: name and what it is without following a symlink, sorted by
    /// name. Empty when it cannot be listed.
    fn listing(&self) -> Vec<(String, Entry)>;

    /// Ok when the directory is there; else the error to give (a file given for its directory, a
    /// missing directory), worded for a model directory.
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Input`] saying what was given and what to pass.
    fn check_dir(&self) -> Result<()> {
        Ok(())
    }

    /// The path of `name` in the directory, for messages.
    fn show(&self, name: &str) -> PathBuf {
        self.path().join(name)
    }

    /// Read `name` whole, at most `limit.max` bytes.
    ///
    /// # Errors
    /// As [`Files::open`] and [`crate::util::read_open_bounded`].
    fn read(&self, name: &str, limit: &Limit) -> Result<Vec<u8>> {
        crate::util::read_open_bounded(self.open(name, limit)?, &self.show(name), limit)
    }

    /// [`Files::read`] as UTF-8 text.
    ///
    /// # Errors
    /// As [`Files::read`], or a file that is not UTF-8.
    fn read_text(&self, name: &str, limit: &Limit) -> Result<String> {
        String::from_utf8(self.read(name, limit)?).map_err(|_| {
            Error::input(format!("{} is not UTF-8 text; the {} must be UTF-8", self.show(name).display(), limit.what))
        })
    }
}

impl Files for Path {
    fn path(&self) -> &Path {
        self
    }
    fn open(&self, name: &str, limit: &Limit) -> Result<std::fs::File> {
        crate::util::open_regular(&self.join(name), limit)
    }
    fn has_file(&self, name: &str) -> bool {
        self.join(name).is_file()
    }
    fn has(&self, name: &str) -> bool {
        self.join(name).exists()
    }
    fn listing(&self) -> Vec<(String, Entry)> {
        let Ok(it) = std::fs::read_dir(self) else { return vec![] };
        let mut out: Vec<(String, Entry)> = it
            .flatten()
            .filter_map(|e| Some((e.file_name().to_string_lossy().into_owned(), Entry::of(e.file_type().ok()?.into()))))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
    fn check_dir(&self) -> Result<()> {
        if self.is_file() {
            return Err(Error::input(format!(
                "{} is a file; pass the Hugging Face model directory that holds config.json, model.safetensors and tokenizer.json",
                self.display()
            )));
        }
        if !self.is_dir() {
            return Err(Error::input(format!(
                "model directory {} does not exist; pass a Hugging Face model directory (config.json, model.safetensors, tokenizer.json)",
                self.display()
            )));
        }
        Ok(())
    }
}

impl Files for PathBuf {
    fn path(&self) -> &Path {
        self
    }
    fn open(&self, name: &str, limit: &Limit) -> Result<std::fs::File> {
        self.as_path().open(name, limit)
    }
    fn has_file(&self, name: &str) -> bool {
        self.as_path().has_file(name)
    }
    fn has(&self, name: &str) -> bool {
        self.as_path().has(name)
    }
    fn listing(&self) -> Vec<(String, Entry)> {
        self.as_path().listing()
    }
    fn check_dir(&self) -> Result<()> {
        self.as_path().check_dir()
    }
}

impl<T: Files + ?Sized> Files for &T {
    fn path(&self) -> &Path {
        (**self).path()
    }
    fn open(&self, name: &str, limit: &Limit) -> Result<std::fs::File> {
        (**self).open(name, limit)
    }
    fn has_file(&self, name: &str) -> bool {
        (**self).has_file(name)
    }
    fn has(&self, name: &str) -> bool {
        (**self).has(name)
    }
    fn listing(&self) -> Vec<(String, Entry)> {
        (**self).listing()
    }
    fn check_dir(&self) -> Result<()> {
        (**self).check_dir()
    }
}

/// A directory held by its handle ([`Dir`]), and where a symlink in it may lead: what
/// `ops::Ctx::confine_model` returns. A file is opened through the held handle, so a directory
/// swapped for a symlink after the check is not followed, and a file in it swapped for a link
/// cannot lead out of it. A file that is a symlink when it is opened (a Hugging Face cache's
/// snapshot links into its `blobs/`) is opened beneath the root the directory was resolved in
/// (links inside the root followed, none out of it), or, for a directory given with nothing
/// confined, by its path.
#[derive(Debug, Clone)]
pub struct HeldDir {
    dir: Dir,
    links: Option<(Dir, PathBuf)>,
}

impl HeldDir {
    /// `dir`, resolved beneath `root` at `rel`: nothing is ever read outside `root`.
    pub fn beneath(dir: Dir, root: Dir, rel: PathBuf) -> HeldDir {
        HeldDir { dir, links: Some((root, rel)) }
    }

    /// `dir`, with nothing confined: a symlink in it is followed wherever it leads.
    pub fn unconfined(dir: Dir) -> HeldDir {
        HeldDir { dir, links: None }
    }

    /// The handle of the directory itself.
    pub fn dir(&self) -> &Dir {
        &self.dir
    }

    /// What a sandbox grants a process that reads this directory: the held directory itself
    /// ([`Dir::fd_path`], so a directory swapped for a link after the check is not what is
    /// granted) and every regular file a top-level symlink in it leads to, opened now as
    /// [`Files::open`] opens it (beneath the root: a Hugging Face cache's `blobs/`), by its
    /// `/proc/self/fd/N`. The paths name those handles only while the returned value lives.
    pub fn grant(&self) -> Grant {
        let mut grant = Grant { paths: vec![self.dir.fd_path()], _files: Vec::new() };
        for (name, entry) in self.listing() {
            if let Some(f) = (entry == Entry::Link).then(|| self.open(&name, &crate::util::MODEL_FILE).ok()).flatten() {
                use std::os::fd::AsRawFd;
                grant.paths.push(PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd())));
                grant._files.push(f);
            }
        }
        grant
    }

    /// The directory's path when it was resolved (for messages and for what is given it by path;
    /// reads go through [`Files`]).
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Where `name` is opened: in the held directory, unless it is a symlink now; then beneath
    /// the root (Ok), or by its path with nothing confined (Err: the path).
    fn place(&self, name: &str) -> std::result::Result<(&Dir, PathBuf), PathBuf> {
        if !self.dir.kind(Path::new(name)).is_some_and(|t| t.is_symlink()) {
            return Ok((&self.dir, PathBuf::from(name)));
        }
        match &self.links {
            // Only while `rel` still names the held directory: after a swap inside the root the
            // link is resolved in the held one (where a link out of it is refused).
            Some((root, rel)) if root.open_dir(rel).is_ok_and(|d| same_dir(&d, &self.dir)) => {
                Ok((root, rel.join(name)))
            }
            Some(_) => Ok((&self.dir, PathBuf::from(name))),
            None => Err(self.dir.show(Path::new(name))),
        }
    }
}

impl Files for HeldDir {
    fn path(&self) -> &Path {
        self.dir.path()
    }
    fn open(&self, name: &str, limit: &Limit) -> Result<std::fs::File> {
        match self.place(name) {
            Ok((d, rel)) => d.open_file(&rel, limit).map_err(|e| Error { kind: crate::error::ErrorKind::Input, ..e }),
            Err(path) => crate::util::open_regular(&path, limit),
        }
    }
    fn has_file(&self, name: &str) -> bool {
        match self.place(name) {
            Ok((d, rel)) => d.cap.metadata(rel).is_ok_and(|m| m.is_file()),
            Err(path) => path.is_file(),
        }
    }
    fn has(&self, name: &str) -> bool {
        match self.place(name) {
            Ok((d, rel)) => d.cap.metadata(rel).is_ok(),
            Err(path) => path.exists(),
        }
    }
    fn listing(&self) -> Vec<(String, Entry)> {
        self.dir.listing()
    }
}

/// Whether two handles name the same directory (device and inode).
fn same_dir(a: &Dir, b: &Dir) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a.pinned()), std::fs::metadata(b.pinned())) {
        (Ok(x), Ok(y)) => (x.dev(), x.ino()) == (y.dev(), y.ino()),
        _ => false,
    }
}

/// A directory handle read as [`Files`]: every open beneath it (symlinks inside followed, none
/// out of it), bounded and regular-file only.
impl Files for Dir {
    fn path(&self) -> &Path {
        Dir::path(self)
    }
    fn open(&self, name: &str, limit: &Limit) -> Result<std::fs::File> {
        self.open_file(Path::new(name), limit).map_err(|e| Error { kind: crate::error::ErrorKind::Input, ..e })
    }
    fn has_file(&self, name: &str) -> bool {
        self.cap.metadata(name).is_ok_and(|m| m.is_file())
    }
    fn has(&self, name: &str) -> bool {
        self.cap.metadata(name).is_ok()
    }
    fn listing(&self) -> Vec<(String, Entry)> {
        self.entries(Path::new(""))
            .unwrap_or_default()
            .into_iter()
            .map(|(n, t)| (n.to_string_lossy().into_owned(), Entry::of(t.into())))
            .collect()
    }
}

/// What a directory entry is, without following a symlink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link.
    Link,
    /// A FIFO, socket or device.
    Other,
}

impl Entry {
    fn of(t: crate::util::EntryType) -> Entry {
        if t.symlink {
            Entry::Link
        } else if t.dir {
            Entry::Dir
        } else if t.file {
            Entry::File
        } else {
            Entry::Other
        }
    }
}

/// What [`HeldDir::grant`] gives a sandbox: paths (`/proc/self/fd/N`) of handles this value
/// keeps open.
#[derive(Debug)]
pub struct Grant {
    paths: Vec<PathBuf>,
    _files: Vec<std::fs::File>,
}

impl Grant {
    /// The granted paths: the directory first, then the linked files.
    pub fn paths(&self) -> Vec<&Path> {
        self.paths.iter().map(PathBuf::as_path).collect()
    }
}

/// Where a symlink leads (see [`Dir::link_target`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leads {
    /// It resolves to something beneath the directory.
    Inside,
    /// It leads out of the directory (absolute, or climbing above it).
    Outside,
    /// It does not resolve (dangling, or a loop).
    Nowhere,
}

/// A symlink found inside a directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// Its path relative to the directory, `/`-separated.
    pub rel: String,
    /// Its target as stored in the link.
    pub target: PathBuf,
    /// Where it leads.
    pub leads: Leads,
}

/// An io error in words, without the `(os error N)` suffix's noise for the common kinds.
fn words(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::NotFound => "does not exist".into(),
        io::ErrorKind::NotADirectory => "is not a directory".into(),
        _ if e.raw_os_error() == Some(libc::ELOOP) => "is a symlink loop (or too many levels of links)".into(),
        _ => e.to_string(),
    }
}

#[cfg(test)]
mod tests;
