//! Small helpers with no home of their own: a string hash for deriving seeds, and atomic file writes
//! (a temporary file in the destination's directory, moved into place, so a reader never sees half a
//! file). Depends on nothing else in the crate but `error`.

use std::path::Path;

use crate::error::{Error, Result};

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
    let tmp = tempfile::NamedTempFile::new_in(dir).map_err(|e| Error::usage(format!("{}: {e}", dir.display())))?;
    std::fs::write(tmp.path(), bytes).map_err(|e| Error::usage(format!("{}: {e}", path.display())))?;
    tmp.persist(path).map_err(|e| Error::usage(format!("{}: {e}", path.display())))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
