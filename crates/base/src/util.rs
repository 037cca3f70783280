//! Small helpers with no home of their own: a string hash for deriving seeds, atomic file writes
//! (a temporary file in the destination's directory, moved into place, so a reader never sees half a
//! file), seeds and numbers that survive JavaScript clients (below 2^53), and bounded reads of regular
//! files (every input file the server parses: a FIFO, a device or a socket is refused by name before it
//! is opened, and a file over its kind's size limit is refused with the limit and what to do). Depends
//! on nothing else in the crate but `error`.
//!
//! A seed is read as a string or a number ([`de_seed`]). Each kind of input has its [`Limit`]
//! (config.json, tokenizer.json, safetensors files, metainfer.toml, contract files, harness replies,
//! ledger exports, ...).

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::{Context, Error, Result};

/// `path` with a leading `~` (alone or before a `/`) replaced by `$HOME`, as a shell expands it:
/// paths that reach the server through a client's JSON arguments or a config file's `args` never
/// passed a shell. Any other path, and any path when `$HOME` is unset or empty, is returned as is
/// (`~user` forms are not expanded).
pub fn expand_home(path: &Path) -> PathBuf {
    home_expanded(path, std::env::var_os("HOME"))
}

fn home_expanded(path: &Path, home: Option<std::ffi::OsString>) -> PathBuf {
    let Some(home) = home.filter(|h| !h.is_empty()) else { return path.to_path_buf() };
    match path.strip_prefix("~") {
        Ok(rest) => {
            let home = PathBuf::from(home);
            if rest.as_os_str().is_empty() { home } else { home.join(rest) }
        }
        _ => path.to_path_buf(),
    }
}

/// FNV-1a 64-bit hash of a string (Fowler, Noll, Vo; offset basis 0xcbf29ce484222325, prime
/// 0x100000001b3), used to derive per-item seeds and stable tags. Not a cryptographic hash.
pub fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

/// Write `bytes` to `path` atomically: into a temporary file beside it, then renamed over it. The
/// parent directory must exist. On error nothing is left at `path` that was not there before (the
/// temporary file is removed).
///
/// # Errors
/// [`crate::error::ErrorKind::Usage`] naming the path when the directory is not writable or the
/// rename fails.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let tmp = tempfile::NamedTempFile::new_in(dir).usage_ctx(|| dir.display().to_string())?;
    std::fs::write(tmp.path(), bytes).usage_ctx(|| path.display().to_string())?;
    tmp.persist(path).usage_ctx(|| path.display().to_string())?;
    Ok(())
}

/// The largest integer a JavaScript number (an IEEE-754 double) holds exactly: 2^53 - 1
/// (ECMA-262, `Number.MAX_SAFE_INTEGER`). JSON clients written in JavaScript round larger ones.
pub const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

/// A fresh random seed that survives a JavaScript client: uniform in 0..=2^53-1.
pub fn fresh_seed() -> u64 {
    use rand::Rng;
    rand::rng().random_range(0..=MAX_SAFE_INTEGER)
}

/// Deserialize an optional seed given as a JSON number or as a decimal string (what a JavaScript
/// client can send without rounding). Seeds above 2^53 - 1 are refused: a client that shows them
/// as numbers would replay a different run.
///
/// # Errors
/// A string that is not a decimal integer, or a seed above [`MAX_SAFE_INTEGER`].
pub fn de_seed<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<u64>, D::Error> {
    use serde::Deserialize;
    use serde::de::Error as _;
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Seed {
        Number(u64),
        Text(String),
    }
    let seed = match Option::<Seed>::deserialize(d)? {
        None => return Ok(None),
        Some(Seed::Number(n)) => n,
        Some(Seed::Text(t)) => {
            t.trim().parse::<u64>().map_err(|_| D::Error::custom(format!("seed {t:?} is not a decimal integer")))?
        }
    };
    if seed > MAX_SAFE_INTEGER {
        return Err(D::Error::custom(format!(
            "seed {seed} is above 2^53-1, which JSON clients round; seeds are drawn below it, so pass the seed a report gave"
        )));
    }
    Ok(Some(seed))
}

/// Every number in `v` that a JavaScript client would not read back exactly (an integer above
/// 2^53 - 1 in magnitude), as `pointer: value`. Empty when the value survives a round trip through
/// JavaScript numbers.
pub fn js_unsafe_numbers(v: &serde_json::Value) -> Vec<String> {
    fn walk(v: &serde_json::Value, at: String, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Number(n) => {
                let exact = match (n.as_u64(), n.as_i64()) {
                    (Some(u), _) => u <= MAX_SAFE_INTEGER,
                    (None, Some(i)) => i.unsigned_abs() <= MAX_SAFE_INTEGER,
                    _ => true,
                };
                if !exact {
                    out.push(format!("{at}: {n}"));
                }
            }
            serde_json::Value::Array(a) => a.iter().enumerate().for_each(|(i, x)| walk(x, format!("{at}/{i}"), out)),
            serde_json::Value::Object(o) => o.iter().for_each(|(k, x)| walk(x, format!("{at}/{k}"), out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(v, String::new(), &mut out);
    out
}

/// A kind of input file and its size limit: what the file is, its largest accepted size in bytes,
/// and what to do about a larger one.
#[derive(Debug, Clone, Copy)]
pub struct Limit {
    /// What the file is, e.g. `config.json`.
    pub what: &'static str,
    /// Largest size accepted, bytes.
    pub max: u64,
    /// What to do when it is larger.
    pub hint: &'static str,
}

/// A model's config.json or generation_config.json (real ones are a few KiB).
pub const CONFIG_JSON: Limit =
    Limit { what: "config.json", max: 4 << 20, hint: "pass the model's Hugging Face config.json (a few KiB)" };
/// A tokenizer.json (Llama 3's is 9 MB, Gemma 3's 33 MB).
pub const TOKENIZER_JSON: Limit =
    Limit { what: "tokenizer.json", max: 64 << 20, hint: "pass the model's Hugging Face tokenizer.json" };
/// A tokenizer test-vector file (`tests.json`: texts and the ids the original tokenizer gives).
pub const TOKENIZER_VECTORS: Limit =
    Limit { what: "tokenizer test-vector file", max: 64 << 20, hint: "split the vectors over several directories" };
/// A sharded checkpoint's `model.safetensors.index.json` (a 70B model's is about 60 KiB).
pub const SHARD_INDEX: Limit =
    Limit { what: "safetensors index", max: 16 << 20, hint: "pass the model's model.safetensors.index.json" };
/// A checkpoint's safetensors file, which the reference forward pass reads whole into memory.
pub const SAFETENSORS_FILE: Limit = Limit {
    what: "safetensors file",
    max: 16 << 30,
    hint: "the reference forward pass holds the whole checkpoint in memory; use a smaller model, or `metainfer synth` for its shape",
};
/// Any file of a model directory, hashed or copied whole as it streams (a bundle's model).
pub const MODEL_FILE: Limit =
    Limit { what: "model file", max: 64 << 30, hint: "a bundle holds models whose files are under 64 GiB" };
/// A safetensors file the engine's harness process wrote (kernel outputs, generated logits).
pub const HARNESS_OUTPUT: Limit =
    Limit { what: "harness output", max: 4 << 30, hint: "the engine's process wrote far more than it was asked for" };
/// A JSON file a harness or a bundle run wrote or a bundle holds (a reply, a run record, a request,
/// a bundle manifest): bulk tensors travel as safetensors files, so a reply is kilobytes; a larger
/// one is refused unread (a sparse 4 GB reply.json costs no memory).
pub const HARNESS_REPLY: Limit = Limit {
    what: "harness reply",
    max: 16 << 20,
    hint: "replies carry no tensors; the engine's process wrote far more than a reply",
};
/// What a serve_engine bundle run recorded (`observed.<nonce>.json`): every answer's text, each cut
/// to 16 KiB, for at most 8 load levels of 1,024 requests.
pub const SERVE_OBSERVED: Limit = Limit {
    what: "serve_engine observations",
    max: 192 << 20,
    hint: "a run records at most 8 levels of 1,024 answers of 16 KiB; write and run the bundle again",
};
/// An engine's metainfer.toml (written by scaffold; under 1 KiB).
pub const METAINFER_TOML: Limit =
    Limit { what: "metainfer.toml", max: 1 << 20, hint: "keep metainfer.toml to the scaffold's keys" };
/// One contract or proposal file (the largest shipped contract is about 20 KiB).
pub const CONTRACT_FILE: Limit =
    Limit { what: "contract file", max: 1 << 20, hint: "split the contract, or move long text to its sources" };
/// A ledger export to import (JSONL).
pub const LEDGER_EXPORT: Limit =
    Limit { what: "ledger export", max: 1 << 30, hint: "split the export into several files" };
/// The ledger's HMAC key file (64 hex digits).
pub const LEDGER_KEY: Limit =
    Limit { what: "ledger key", max: 1 << 10, hint: "the key file holds 64 hex digits; restore it" };

/// A file system entry's type as the flags [`kind_of`] reads; built from std's `FileType` here and
/// from cap-std's in `beneath`, so that both name a type in the same words.
#[derive(Debug, Clone, Copy, Default)]
pub struct EntryType {
    pub dir: bool,
    pub fifo: bool,
    pub char_device: bool,
    pub block_device: bool,
    pub socket: bool,
    pub symlink: bool,
    pub file: bool,
}

impl From<std::fs::FileType> for EntryType {
    fn from(t: std::fs::FileType) -> EntryType {
        use std::os::unix::fs::FileTypeExt;
        EntryType {
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

/// What a file system entry is, in words for messages (`a FIFO (named pipe)`, `a directory`, ...).
pub fn kind_of(t: impl Into<EntryType>) -> &'static str {
    let t = t.into();
    if t.dir {
        "a directory"
    } else if t.fifo {
        "a FIFO (named pipe)"
    } else if t.char_device {
        "a character device"
    } else if t.block_device {
        "a block device"
    } else if t.socket {
        "a socket"
    } else if t.symlink {
        "a symlink"
    } else if t.file {
        "a regular file"
    } else {
        "not a regular file"
    }
}

/// Open `path` for reading only if it is a regular file (symlinks followed): its type is checked
/// before the open, the open does not block (`O_NONBLOCK`, so a FIFO swapped in meanwhile cannot
/// stall it), and the opened file's type is checked again. The file handle is what
/// [`read_open_bounded`] reads, so a directory-handle open can replace this function later.
///
/// # Errors
/// [`crate::error::ErrorKind::Input`] naming the file and what it is (a FIFO, a device, a socket,
/// a directory), or why it cannot be opened.
pub fn open_regular(path: &Path, limit: &Limit) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let refuse = |t: std::fs::FileType| {
        Error::input(format!(
            "{} is {}, not a regular file; the {} must be a regular file",
            path.display(),
            kind_of(t),
            limit.what
        ))
    };
    let meta = std::fs::metadata(path).ctx(|| path.display().to_string())?;
    if !meta.file_type().is_file() {
        return Err(refuse(meta.file_type()));
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .ctx(|| path.display().to_string())?;
    let meta = f.metadata().ctx(|| path.display().to_string())?;
    if !meta.file_type().is_file() {
        return Err(refuse(meta.file_type()));
    }
    Ok(f)
}

/// Read an opened regular file whole, refusing more than `limit.max` bytes (`path` only names it in
/// messages).
///
/// # Errors
/// [`crate::error::ErrorKind::Input`] naming the file, its size, the limit and what to do.
pub fn read_open_bounded(mut f: std::fs::File, path: &Path, limit: &Limit) -> Result<Vec<u8>> {
    let too_big = |len: u64| {
        Error::input(format!(
            "{} is {len} bytes; a {} may be at most {} bytes: {}",
            path.display(),
            limit.what,
            limit.max,
            limit.hint
        ))
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    if len > limit.max {
        return Err(too_big(len));
    }
    let mut buf = Vec::with_capacity(len as usize);
    (&mut f).take(limit.max + 1).read_to_end(&mut buf).ctx(|| path.display().to_string())?;
    if buf.len() as u64 > limit.max {
        return Err(too_big(buf.len() as u64));
    }
    Ok(buf)
}

/// Read a regular file of at most `limit.max` bytes ([`open_regular`], then [`read_open_bounded`]).
///
/// # Errors
/// As those two.
pub fn read_regular(path: &Path, limit: &Limit) -> Result<Vec<u8>> {
    read_open_bounded(open_regular(path, limit)?, path, limit)
}

/// [`read_regular`] as UTF-8 text.
///
/// # Errors
/// As [`read_regular`], or a file that is not UTF-8.
pub fn read_regular_text(path: &Path, limit: &Limit) -> Result<String> {
    String::from_utf8(read_regular(path, limit)?)
        .map_err(|_| Error::input(format!("{} is not UTF-8 text; the {} must be UTF-8", path.display(), limit.what)))
}

#[cfg(test)]
mod tests {
    use super::home_expanded;

    #[test]
    fn a_leading_tilde_is_home_as_a_shell_expands_it() {
        let home = || Some(std::ffi::OsString::from("/home/u"));
        let e = |p: &str| home_expanded(std::path::Path::new(p), home()).display().to_string();
        assert_eq!(e("~/models/babyllama-105"), "/home/u/models/babyllama-105");
        assert_eq!(e("~"), "/home/u");
        assert_eq!(e("~user/x"), "~user/x");
        assert_eq!(e("models/~/x"), "models/~/x");
        assert_eq!(e("/abs/~"), "/abs/~");
        let p = std::path::Path::new("~/m");
        assert_eq!(home_expanded(p, None), p);
        assert_eq!(home_expanded(p, Some("".into())), p);
    }

    use super::*;

    #[test]
    fn fresh_seeds_survive_a_javascript_number_round_trip() {
        for _ in 0..10_000 {
            let s = fresh_seed();
            assert_eq!(s as f64 as u64, s, "{s} does not survive f64");
        }
        // The value Claude Code rounded: 7280743005045982972 read as a double is ...983000.
        assert_ne!(7_280_743_005_045_982_972u64 as f64 as u64, 7_280_743_005_045_982_972);
        assert_eq!(
            js_unsafe_numbers(&serde_json::json!({"seed": 7_280_743_005_045_982_972u64})),
            ["/seed: 7280743005045982972"]
        );
        assert!(js_unsafe_numbers(&serde_json::json!({"seed": MAX_SAFE_INTEGER, "x": [1.5e300]})).is_empty());
    }

    #[test]
    fn seeds_are_accepted_as_numbers_or_strings_and_unsafe_ones_are_refused() {
        #[derive(serde::Deserialize)]
        struct R {
            #[serde(default, deserialize_with = "de_seed")]
            seed: Option<u64>,
        }
        let r = |j: &str| serde_json::from_str::<R>(j).map(|r| r.seed);
        assert_eq!(r(r#"{"seed": 42}"#).unwrap(), Some(42));
        assert_eq!(r(r#"{"seed": "9007199254740991"}"#).unwrap(), Some(MAX_SAFE_INTEGER));
        assert_eq!(r(r#"{}"#).unwrap(), None);
        assert_eq!(r(r#"{"seed": null}"#).unwrap(), None);
        assert!(r(r#"{"seed": "7280743005045982972"}"#).unwrap_err().to_string().contains("2^53"));
        assert!(r(r#"{"seed": "abc"}"#).is_err());
    }

    #[test]
    fn fnv1a_matches_published_vectors() {
        // Test vectors from the FNV reference page (Noll): FNV-1a 64 of "" and "a".
        assert_eq!(fnv1a(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a("foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn write_atomic_replaces_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.txt");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        let missing = dir.path().join("no/such/dir/f.txt");
        assert!(write_atomic(&missing, b"x").is_err());
        assert!(!missing.exists());
    }

    #[test]
    fn bounded_reads_refuse_fifos_devices_and_oversized_files_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("config.json");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read_regular(&fifo, &CONFIG_JSON).unwrap_err();
        assert!(e.message.contains("config.json") && e.message.contains("FIFO"), "{}", e.message);
        let tok = dir.path().join("tokenizer.json");
        std::os::unix::fs::symlink("/dev/zero", &tok).unwrap();
        let e = read_regular(&tok, &TOKENIZER_JSON).unwrap_err();
        assert!(e.message.contains("tokenizer.json") && e.message.contains("character device"), "{}", e.message);
        let big = dir.path().join("metainfer.toml");
        std::fs::write(&big, vec![b'#'; (METAINFER_TOML.max + 1) as usize]).unwrap();
        let e = read_regular(&big, &METAINFER_TOML).unwrap_err();
        assert!(e.message.contains(&format!("at most {} bytes", METAINFER_TOML.max)), "{}", e.message);
        std::fs::write(&big, b"family = \"model.llama\"\n").unwrap();
        assert_eq!(read_regular_text(&big, &METAINFER_TOML).unwrap(), "family = \"model.llama\"\n");
    }
}
