//! What a bundle verdict proves: runner attestations.
//!
//! A bundle (see [`super::bundle`]) is run away from the server, in a directory anyone with write
//! access to it can change. The read-back checks that it holds this call's requests and inputs, and
//! that its outputs carry the nonce drawn when it was written (a copy of another bundle's outputs is
//! refused), but it cannot know that the replies and outputs were produced by running the bundle's
//! harness: whoever can write the directory can write them. So a verdict judged from a bundle is
//! `unattested` evidence (shown, recorded, counted, never enough for phase order or promotion)
//! unless a runner the server trusts vouches for the run:
//!
//! - `metainfer bundle keygen --out DIR` makes a runner key pair (Ed25519, RFC 8032):
//!   `runner.key` (the secret seed, mode 0600) and `runner.pub`;
//! - `metainfer bundle trust runner.pub --name NAME` records the public key in the ledger;
//! - `metainfer bundle run DIR --key runner.key` runs the bundle and then signs
//!   [`ATTESTATION`]: the sha256 of every top-level file of the bundle (manifest, harness, requests,
//!   inputs, replies, run records, outputs) and its nonce;
//! - the read-back verifies the signature against the trusted keys and, as it reads each file,
//!   that the file is the one signed.
//!
//! The server holds only public keys, so nothing it or the agent can read lets them forge an
//! attestation; what the attestation proves is that a holder of the secret key ran the bundle
//! (or signed its directory as it was then). Keep `runner.key` where the agent cannot read it (the
//! device machine).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};

/// A runner's secret key (Ed25519), as [`read_secret`] reads it.
pub type RunnerKey = SigningKey;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use base::beneath::{Entry, Files};
use base::error::{Context, Error, Result};

/// File name of the attestation in a run bundle.
pub const ATTESTATION: &str = "attestation.json";

/// Version of the attestation format.
pub const FORMAT: u32 = 1;

/// File names of a key pair written by [`keygen`].
pub const SECRET_FILE: &str = "runner.key";
/// See [`SECRET_FILE`].
pub const PUBLIC_FILE: &str = "runner.pub";

/// What a runner signs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Signed {
    /// [`FORMAT`].
    pub format: u32,
    /// The bundle's nonce (its manifest's), so the attestation names this bundle.
    pub nonce: String,
    /// sha256 (hex) of every top-level regular file of the bundle after the run, by name, the
    /// attestation itself excepted.
    pub files: BTreeMap<String, String>,
    /// When it was signed (RFC 3339).
    pub signed: String,
}

/// An attestation file: the signed content, the runner's public key and the signature over the
/// JSON serialisation of `content` (serde_json, keys in struct order, maps sorted).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Attestation {
    /// The signed content.
    pub content: Signed,
    /// The runner's Ed25519 public key, 64 hex digits.
    pub runner: String,
    /// The Ed25519 signature of the content's JSON, 128 hex digits.
    pub signature: String,
}

/// A run vouched for by a trusted runner: its name and the files it signed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attested {
    /// The runner's name in the ledger.
    pub runner: String,
    /// sha256 of each file it signed, by name.
    pub files: BTreeMap<String, String>,
}

impl Attested {
    /// Check bytes read from the bundle file `name` against what the runner signed.
    ///
    /// # Errors
    /// [`base::error::ErrorKind::Usage`] when the runner did not sign that file or signed other
    /// contents.
    pub fn check(&self, name: &str, bytes: &[u8]) -> Result<()> {
        self.matches(name, &hex(&Sha256::digest(bytes)))
    }
}

impl Attested {
    /// Check the bundle file `name`, read through `dir` (streamed), against what the runner signed.
    ///
    /// # Errors
    /// As [`Attested::check`]; Input when the file cannot be read.
    pub fn check_file(&self, dir: &dyn Files, name: &str) -> Result<()> {
        let mut f = dir.open(name, &base::util::MODEL_FILE)?;
        let mut h = Sha256::new();
        std::io::copy(&mut f, &mut h).ctx(|| dir.show(name).display().to_string())?;
        self.matches(name, &hex(&h.finalize()))
    }

    fn matches(&self, name: &str, sha256: &str) -> Result<()> {
        match self.files.get(name) {
            Some(h) if h == sha256 => Ok(()),
            Some(_) => Err(Error::usage(format!(
                "bundle file {name} changed after runner {} signed the run: run the bundle again",
                self.runner
            ))),
            None => Err(Error::usage(format!(
                "bundle file {name} was not signed by runner {}: it was added after the run",
                self.runner
            ))),
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex<const N: usize>(text: &str, what: &str) -> Result<[u8; N]> {
    let text = text.trim();
    if text.len() != 2 * N || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(Error::usage(format!("{what}: expected {} hex digits", 2 * N)));
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).usage_ctx(|| what.to_string())?;
    }
    Ok(out)
}

/// Make a runner key pair in the directory `dir` (created if needed): [`SECRET_FILE`] (the 32-byte
/// secret seed in hex, mode 0600, a new file) and [`PUBLIC_FILE`] (the public key in hex). Returns
/// both paths and the public key.
///
/// # Errors
/// [`base::error::ErrorKind::Usage`] when either file exists; Internal when one cannot be written.
pub fn keygen(dir: &Path) -> Result<(PathBuf, PathBuf, String)> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::create_dir_all(dir).internal_ctx(|| dir.display().to_string())?;
    let (secret, public) = (dir.join(SECRET_FILE), dir.join(PUBLIC_FILE));
    for p in [&secret, &public] {
        if p.symlink_metadata().is_ok() {
            return Err(Error::usage(format!("{} exists; choose another directory", p.display())));
        }
    }
    let seed: [u8; 32] = rand::random();
    let key = SigningKey::from_bytes(&seed);
    let public_hex = hex(key.verifying_key().as_bytes());
    let write = |path: &Path, text: &str, mode: u32| -> Result<()> {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(path)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .internal_ctx(|| path.display().to_string())
    };
    write(&secret, &format!("{}\n", hex(&seed)), 0o600)?;
    write(&public, &format!("{public_hex}\n"), 0o644)?;
    Ok((secret, public, public_hex))
}

/// Read a runner's secret key file ([`SECRET_FILE`]).
///
/// # Errors
/// [`base::error::ErrorKind::Usage`] when it is missing, readable by others than its owner, or not
/// 64 hex digits.
pub fn read_secret(path: &Path) -> Result<SigningKey> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).usage_ctx(|| format!("runner key {}", path.display()))?;
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(Error::usage(format!(
            "runner key {} is readable by others (mode {:o}); chmod 600 it",
            path.display(),
            meta.permissions().mode() & 0o777
        )));
    }
    let text = base::util::read_regular(path, &base::util::METAINFER_TOML)?;
    let seed = unhex::<32>(&String::from_utf8_lossy(&text), &format!("runner key {}", path.display()))?;
    Ok(SigningKey::from_bytes(&seed))
}

/// Read a public key: 64 hex digits, or a file holding them ([`PUBLIC_FILE`]).
///
/// # Errors
/// [`base::error::ErrorKind::Usage`] when it is neither.
pub fn read_public(text_or_file: &str) -> Result<String> {
    let text = if Path::new(text_or_file).is_file() {
        String::from_utf8_lossy(&base::util::read_regular(Path::new(text_or_file), &base::util::METAINFER_TOML)?)
            .into_owned()
    } else {
        text_or_file.to_string()
    };
    let bytes = unhex::<32>(&text, "runner public key")?;
    VerifyingKey::from_bytes(&bytes).usage_ctx(|| "runner public key".to_owned())?;
    Ok(hex(&bytes))
}

/// The top-level regular files of a bundle directory that an attestation covers, by name.
fn bundle_files(dir: &dyn Files) -> Vec<String> {
    dir.listing().into_iter().filter(|(n, e)| *e == Entry::File && n != ATTESTATION).map(|(n, _)| n).collect()
}

/// Sign the run bundle `dir` (after `bundle run`) with `key`: hash every top-level file and write
/// [`ATTESTATION`] (replaced when present).
///
/// # Errors
/// When a file cannot be read or the attestation cannot be written.
pub fn sign(dir: &Path, nonce: &str, key: &SigningKey) -> Result<Attestation> {
    let mut files = BTreeMap::new();
    for name in bundle_files(&dir.to_path_buf()) {
        files.insert(name.clone(), super::bundle::file_hash(&dir.join(&name))?);
    }
    let content = Signed { format: FORMAT, nonce: nonce.to_string(), files, signed: ledger::now_rfc3339() };
    let bytes = serde_json::to_vec(&content).internal_ctx(|| "attestation".to_owned())?;
    let attestation = Attestation {
        content,
        runner: hex(key.verifying_key().as_bytes()),
        signature: hex(&key.sign(&bytes).to_bytes()),
    };
    let text = serde_json::to_vec_pretty(&attestation).internal_ctx(|| "attestation".to_owned())?;
    base::util::write_atomic(&dir.join(ATTESTATION), &text)?;
    Ok(attestation)
}

/// Whether the run bundle `dir` (nonce `nonce`) is vouched for by one of the `trusted` runners
/// (name, public key hex): Ok(runner and signed files), or Err(why not) in words, for the
/// outcome's `unattested` figure. Every top-level file must be one the runner signed, with the
/// signed contents; the nonce must be this bundle's.
pub fn verify(dir: &dyn Files, nonce: &str, trusted: &[(String, String)]) -> std::result::Result<Attested, String> {
    if !dir.has(ATTESTATION) {
        return Err(format!(
            "no {ATTESTATION}: the bundle was run without a trusted runner's key (`bundle run --key`)"
        ));
    }
    let bytes = dir.read(ATTESTATION, &base::util::HARNESS_REPLY).map_err(|e| e.message)?;
    let a: Attestation = serde_json::from_slice(&bytes).map_err(|e| format!("{ATTESTATION} does not parse: {e}"))?;
    let Some((name, _)) = trusted.iter().find(|(_, k)| *k == a.runner) else {
        return Err(format!(
            "runner key {}... is not trusted here (`metainfer bundle trust`)",
            &a.runner[..16.min(a.runner.len())]
        ));
    };
    let key = unhex::<32>(&a.runner, "runner key")
        .ok()
        .and_then(|b| VerifyingKey::from_bytes(&b).ok())
        .ok_or("the attestation's runner key is malformed")?;
    let signature = unhex::<64>(&a.signature, "signature").map_err(|e| e.message)?;
    let signed = serde_json::to_vec(&a.content).map_err(|e| e.to_string())?;
    key.verify(&signed, &Signature::from_bytes(&signature))
        .map_err(|_| format!("the signature of runner {name} does not match the attestation's content"))?;
    if a.content.format != FORMAT {
        return Err(format!("attestation format {}, this metainfer reads {FORMAT}", a.content.format));
    }
    if a.content.nonce != nonce {
        return Err(format!("runner {name} signed another bundle's run (its nonce differs)"));
    }
    for file in bundle_files(dir) {
        if !a.content.files.contains_key(&file) {
            return Err(format!("{file} was added after runner {name} signed the run"));
        }
    }
    Ok(Attested { runner: name.clone(), files: a.content.files })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc8032_test_vector_1() {
        // RFC 8032, section 7.1, TEST 1: the empty message.
        let seed = unhex::<32>("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60", "seed").unwrap();
        let key = SigningKey::from_bytes(&seed);
        assert_eq!(
            hex(key.verifying_key().as_bytes()),
            "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"
        );
        assert_eq!(
            hex(&key.sign(b"").to_bytes()),
            "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"
        );
    }

    #[test]
    fn a_signed_run_verifies_and_every_change_is_named() {
        let t = tempfile::tempdir().unwrap();
        let keys = t.path().join("keys");
        let (secret, public, hexkey) = keygen(&keys).unwrap();
        assert!(keygen(&keys).is_err(), "a second keygen into the same directory must refuse");
        assert_eq!(read_public(public.to_str().unwrap()).unwrap(), hexkey);
        let key = read_secret(&secret).unwrap();
        let b = t.path().join("bundle");
        std::fs::create_dir(&b).unwrap();
        std::fs::write(b.join("reply.0.json"), b"{\"kernel\":1}").unwrap();
        std::fs::write(b.join("case0.out.safetensors"), b"out").unwrap();
        sign(&b, "n1", &key).unwrap();
        let trusted = vec![("device".to_string(), hexkey.clone())];
        let dir = b.clone();
        let ok = verify(&dir, "n1", &trusted).unwrap();
        assert_eq!(ok.runner, "device");
        assert!(ok.check("reply.0.json", b"{\"kernel\":1}").is_ok());
        assert!(ok.check("reply.0.json", b"{\"kernel\":2}").is_err());
        // Another bundle's nonce, an untrusted key, an added file, a changed signature.
        assert!(verify(&dir, "n2", &trusted).unwrap_err().contains("another bundle"));
        assert!(verify(&dir, "n1", &[]).unwrap_err().contains("not trusted"));
        std::fs::write(b.join("extra.out.safetensors"), b"x").unwrap();
        assert!(verify(&dir, "n1", &trusted).unwrap_err().contains("added after"));
        std::fs::remove_file(b.join("extra.out.safetensors")).unwrap();
        let mut a: Attestation = serde_json::from_slice(&std::fs::read(b.join(ATTESTATION)).unwrap()).unwrap();
        a.content.files.insert("reply.0.json".into(), "0".repeat(64));
        std::fs::write(b.join(ATTESTATION), serde_json::to_vec(&a).unwrap()).unwrap();
        assert!(verify(&dir, "n1", &trusted).unwrap_err().contains("does not match"));
        // A secret key others can read is refused.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(read_secret(&secret).unwrap_err().message.contains("chmod 600"));
    }
}
