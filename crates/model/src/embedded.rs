//! What the binary carries besides the knowledge base: the demo's model (BabyLlama-105, MIT,
//! `examples/models/babyllama-105`) and the real-vocabulary tokenizer test vectors whose licences
//! allow shipping them (`examples/tokenizers`), both embedded by build.rs. Writes them out on
//! demand (the engine's process and HF `tokenizers` read directories); knows nothing of MCP.
//!
//! BabyLlama-105 is the only checkpoint in the repository; the demo writes it into its workspace.
//! The shipped vectors (gpt-2 and phi-3, tokenizer.json gzipped) are written under
//! `<cache>/tokenizers/<hash>/`. [`VOCABULARIES`] lists every real vocabulary with its contract and
//! licence, shipped or not, so verify names each one it skipped. build.rs writes them all into
//! `embedded_data.rs`.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use base::error::{Context, Result};

mod data {
    include!(concat!(env!("OUT_DIR"), "/embedded_data.rs"));
}

/// Directory name of the embedded model (also the model id its servers report).
pub const BABYLLAMA_NAME: &str = "babyllama-105";

/// The embedded model's files: (name, bytes): LICENSE, PROVENANCE.md, config.json,
/// model.safetensors, tokenizer.json.
pub fn babyllama_files() -> &'static [(&'static str, &'static [u8])] {
    data::BABYLLAMA
}

/// The embedded tokenizer-vector files: (path relative to `examples/tokenizers`, bytes).
pub fn vector_files() -> &'static [(&'static str, &'static [u8])] {
    data::TOKENIZER_VECTORS
}

/// Lower-case hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

/// Write the embedded model into `parent/babyllama-105` (created; files already there with the
/// same contents are kept) and return that directory.
///
/// # Errors
/// Internal when a directory or file cannot be written, naming it.
pub fn write_babyllama(parent: &Path) -> Result<PathBuf> {
    let dir = parent.join(BABYLLAMA_NAME);
    write_files(&dir, babyllama_files().iter().map(|(n, b)| (n.to_string(), b.to_vec())))?;
    Ok(dir)
}

fn write_files(dir: &Path, files: impl Iterator<Item = (String, Vec<u8>)>) -> Result<()> {
    for (rel, bytes) in files {
        let p = dir.join(&rel);
        if std::fs::read(&p).is_ok_and(|have| have == bytes) {
            continue;
        }
        let parent = p.parent().expect("a joined file has a parent");
        std::fs::create_dir_all(parent).internal_ctx(|| parent.display().to_string())?;
        base::util::write_atomic(&p, &bytes)?;
    }
    Ok(())
}

/// A real vocabulary whose test vectors verify_generation knows of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Vocabulary {
    /// Folder name, e.g. `llama-bpe`.
    pub name: &'static str,
    /// Tokenizer contract its tokenizer.json routes to.
    pub contract: &'static str,
    /// Licence of the vocabulary.
    pub licence: &'static str,
    /// Whether its vectors are compiled into the binary.
    pub shipped: bool,
}

/// Every real vocabulary the project tests tokenizers with (the folders of `../shared/tokenizers`).
/// Only those whose licences allow shipping them without further agreements are embedded; the
/// others are checked where `$METAINFER_TOKENIZERS` (or `../shared/tokenizers`) holds them, and a
/// verify report names each one it skipped.
pub const VOCABULARIES: [Vocabulary; 5] = [
    Vocabulary {
        name: "gpt-2",
        contract: "component.tokenizer_bytelevel",
        licence: "Modified MIT (OpenAI GPT-2)",
        shipped: true,
    },
    Vocabulary {
        name: "llama-bpe",
        contract: "component.tokenizer_bytelevel",
        licence: "Llama 3 Community License",
        shipped: false,
    },
    Vocabulary {
        name: "llama-spm",
        contract: "component.tokenizer",
        licence: "Llama 2 Community License",
        shipped: false,
    },
    Vocabulary { name: "phi-3", contract: "component.tokenizer", licence: "MIT (Microsoft Phi-3)", shipped: true },
    Vocabulary {
        name: "qwen2",
        contract: "component.tokenizer_bytelevel",
        licence: "Apache-2.0 / Tongyi Qianwen (attribution unconfirmed)",
        shipped: false,
    },
];

/// Write the shipped vectors under `root/tokenizers/<hash>/<name>/` (tokenizer.json decompressed,
/// tests.json, the licence and provenance beside them; `<hash>` names the embedded contents, so a
/// different binary never reuses another's copy) and return each vocabulary's folder, in name order.
///
/// # Errors
/// Internal when a file cannot be decompressed or written.
pub fn write_shipped_vectors(root: &Path) -> Result<Vec<PathBuf>> {
    let mut h = Sha256::new();
    for (rel, bytes) in vector_files() {
        h.update(rel.as_bytes());
        h.update(bytes);
    }
    let base = root.join("tokenizers").join(&format!("{:x}", h.finalize())[..16]);
    let mut dirs = Vec::new();
    for v in VOCABULARIES.iter().filter(|v| v.shipped) {
        let dir = base.join(v.name);
        let prefix = format!("{}/", v.name);
        let mut files = Vec::new();
        for (rel, bytes) in vector_files().iter().filter(|(r, _)| r.starts_with(&prefix)) {
            let name = &rel[prefix.len()..];
            match name.strip_suffix(".gz") {
                Some(plain) => {
                    use std::io::Read;
                    let mut out = Vec::new();
                    flate2::read::GzDecoder::new(*bytes)
                        .read_to_end(&mut out)
                        .internal_ctx(|| format!("embedded {rel}"))?;
                    files.push((plain.to_string(), out));
                }
                None => files.push((name.to_string(), bytes.to_vec())),
            }
        }
        write_files(&dir, files.into_iter())?;
        dirs.push(dir);
    }
    Ok(dirs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every vocabulary marked shipped has its files embedded, and no other vocabulary does.
    #[test]
    fn the_shipped_vocabularies_are_the_embedded_ones() {
        let mut embedded: Vec<&str> =
            vector_files().iter().filter_map(|(r, _)| r.split_once('/').map(|(d, _)| d)).collect();
        embedded.dedup();
        let shipped: Vec<&str> = VOCABULARIES.iter().filter(|v| v.shipped).map(|v| v.name).collect();
        assert_eq!(embedded, shipped);
        for name in shipped {
            for f in ["tokenizer.json.gz", "tests.json", "LICENSE", "PROVENANCE.md"] {
                assert!(vector_files().iter().any(|(r, _)| *r == format!("{name}/{f}")), "{name}/{f}");
            }
        }
    }
}
