//! Small helpers with no home of their own: a string hash for deriving seeds, atomic file writes
//! (a temporary file in the destination's directory, moved into place, so a reader never sees half a
//! file), and seeds and numbers that survive JavaScript clients (below 2^53). Depends on nothing else in the crate but `error`.

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

#[cfg(test)]
mod tests {
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
}
