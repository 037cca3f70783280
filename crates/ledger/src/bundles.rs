//! Bundles this server wrote: per bundle nonce, the gate and the sha256 of the manifest as written
//! (which names the executable's, the inputs' and the model's hashes), authenticated with the
//! ledger's key. A bundle read back is checked against its row: a manifest changed since (a swapped
//! executable with its hash rewritten, say) is refused, and a bundle this ledger has no row for was
//! not written here, so its verdict is no evidence.

use rusqlite::{OptionalExtension, params};

use super::Ledger;
use base::error::{Context, Result};

/// Schema step 8: the table of written bundles.
pub(super) const MIGRATION: &str = "CREATE TABLE IF NOT EXISTS bundles_written (
    nonce TEXT PRIMARY KEY,
    tool TEXT NOT NULL,
    manifest_sha256 TEXT NOT NULL,
    written TEXT NOT NULL,
    mac TEXT NOT NULL
 );
 PRAGMA user_version = 8;";

impl Ledger {
    fn bundle_mac(&self, nonce: &str, tool: &str, manifest_sha256: &str, written: &str) -> String {
        use hmac::Mac;
        let mut m =
            <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(&self.key).expect("HMAC takes keys of any length");
        for part in ["bundle", nonce, tool, manifest_sha256, written] {
            m.update(&(part.len() as u64).to_le_bytes());
            m.update(part.as_bytes());
        }
        m.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Record that this server wrote the bundle `nonce` for `tool`, its manifest hashing to
    /// `manifest_sha256` (hex).
    ///
    /// # Errors
    /// When SQLite fails (a nonce recorded twice included: nonces are 128 random bits).
    pub fn record_bundle(&self, nonce: &str, tool: &str, manifest_sha256: &str) -> Result<()> {
        let written = super::now_rfc3339();
        let mac = self.bundle_mac(nonce, tool, manifest_sha256, &written);
        self.conn
            .execute(
                "INSERT INTO bundles_written (nonce, tool, manifest_sha256, written, mac) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![nonce, tool, manifest_sha256, written, mac],
            )
            .internal_ctx(|| format!("ledger {}", self.path.display()))?;
        Ok(())
    }

    /// The (tool, manifest sha256) recorded for bundle `nonce`, None when this ledger wrote no such
    /// bundle (a row without this ledger's HMAC counts as none).
    ///
    /// # Errors
    /// When SQLite fails.
    pub fn written_bundle(&self, nonce: &str) -> Result<Option<(String, String)>> {
        let row: Option<(String, String, String, String)> = self
            .conn
            .query_row(
                "SELECT tool, manifest_sha256, written, mac FROM bundles_written WHERE nonce = ?1",
                params![nonce],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .optional()
            .internal_ctx(|| format!("ledger {}", self.path.display()))?;
        Ok(row.and_then(|(tool, sha, written, mac)| {
            (self.bundle_mac(nonce, &tool, &sha, &written) == mac).then_some((tool, sha))
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_bundle_is_found_by_nonce_and_a_forged_row_is_not() {
        let t = tempfile::tempdir().unwrap();
        let l = Ledger::open(&t.path().join("l.sqlite")).unwrap();
        l.record_bundle("n1", "serve_engine", "abc").unwrap();
        assert_eq!(l.written_bundle("n1").unwrap(), Some(("serve_engine".into(), "abc".into())));
        assert_eq!(l.written_bundle("n2").unwrap(), None);
        // A row inserted without the ledger's key, or one whose hash was changed, is no record.
        l.conn
            .execute(
                "INSERT INTO bundles_written VALUES ('n2', 'serve_engine', 'def', '2026-01-01T00:00:00Z', 'beef')",
                [],
            )
            .unwrap();
        l.conn.execute("UPDATE bundles_written SET manifest_sha256 = 'abd' WHERE nonce = 'n1'", []).unwrap();
        assert_eq!(l.written_bundle("n2").unwrap(), None);
        assert_eq!(l.written_bundle("n1").unwrap(), None);
    }
}
