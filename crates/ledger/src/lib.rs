//! The outcome ledger: every tool call's result, in SQLite (WAL, one transaction per outcome).
//!
//! Knows nothing of MCP or processes. Schema versions are tracked with `PRAGMA user_version`; a
//! database written by a newer metainfer is refused rather than guessed at.
//!
//! Evidence only from the server itself: every outcome this server records carries an HMAC-SHA256
//! (RFC 2104) over a canonical encoding of its row ([`canonical`]), keyed by a 256-bit key in a
//! file beside the ledger ([`key_path`], mode 0600, created on first open, never readable by the
//! sandboxed processes that run engine code). Phase order ([`Ledger::passed_on`]) and promotion
//! count only authenticated rows: a row inserted by anything else, altered after the fact, or
//! imported (`ledger import`) is listed and reported, but is not evidence.
//!
//! Besides the outcomes (status passed, failed or cancelled; typed figures per tool, [`figures`];
//! JSONL export and import, imported rows marked; filtered keyset pages), it holds the reference
//! fingerprints of the provenance rule, the machine probes by machine, and the trusted bundle
//! runners.

mod bundles;
pub mod figures;

use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use rusqlite::{Connection, OptionalExtension, params};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use base::error::{Context, Error, Result};

/// Schema version this build writes.
pub const SCHEMA_VERSION: i64 = 8;

/// One recorded result of a tool call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Outcome {
    /// Unique id (random, hex).
    pub id: String,
    /// UTC time, RFC 3339 (seconds since the epoch when the clock is unusual).
    pub time: String,
    /// Tool name, e.g. `run_kernel_test`.
    pub tool: String,
    /// Engine directory, when the tool acts on one.
    pub engine: String,
    /// sha256 of the engine's sources (Cargo.toml + src/), "" when none.
    pub engine_hash: String,
    /// Contract ids with versions, e.g. `kernel.rope@1`.
    pub contracts: Vec<String>,
    /// Whether the check passed.
    pub passed: bool,
    /// One-line summary.
    pub summary: String,
    /// Figures as JSON (errors, tok/s, counts).
    pub figures: serde_json::Value,
    /// Reference level the engine was built under (`zero`, `docs`, `code`).
    pub reference_level: String,
    /// Wall time of the call in milliseconds.
    pub duration_ms: u64,
    /// The MCP client that made the call (`name/version`), or `cli`.
    #[serde(default)]
    pub client: String,
    /// The engine's constraints (its metainfer.toml as JSON), `{}` when none.
    #[serde(default)]
    pub constraints: serde_json::Value,
    /// `passed`, `failed`, or `cancelled` (the client cancelled the call; neither a pass nor a
    /// failure, and left out of pass rates). Empty in exports of older ledgers: then it follows
    /// `passed`.
    #[serde(default)]
    pub status: String,
    /// Whether it came from `ledger import` (another ledger's export): listed and reported, never
    /// evidence. Ignored on input: the ledger sets it.
    #[serde(default)]
    pub imported: bool,
    /// Set when read: the row carries this server's HMAC, so this server recorded it from its own
    /// run and it is unchanged since. Only such outcomes are evidence for phase order and
    /// promotion. Not exported, ignored on input: the ledger sets it.
    #[serde(default, skip_serializing)]
    pub authenticated: bool,
}

/// Outcome status of a call the client cancelled.
pub const CANCELLED: &str = "cancelled";

impl Outcome {
    /// The status, derived from `passed` when none was recorded.
    pub fn status(&self) -> &str {
        match self.status.as_str() {
            "" if self.passed => "passed",
            "" => "failed",
            s => s,
        }
    }

    /// Whether the client cancelled the call.
    pub fn cancelled(&self) -> bool {
        self.status == CANCELLED
    }
}

/// Which outcomes to list: every given condition must hold.
#[derive(Debug, Clone, Default)]
pub struct OutcomeFilter {
    /// Tool name, exactly.
    pub tool: Option<String>,
    /// Text the engine directory contains (e.g. its folder name).
    pub engine: Option<String>,
    /// Contract id or id prefix (e.g. `kernel.rope`, `kernel.`).
    pub contract: Option<String>,
    /// Only outcomes at or after this RFC 3339 UTC time (e.g. `2026-12-01T00:00:00Z`).
    pub since: Option<String>,
    /// Keyset cursor: only outcomes recorded before the one with this row id.
    pub before: Option<i64>,
}

/// An open ledger.
pub struct Ledger {
    conn: Connection,
    /// Database file.
    pub path: PathBuf,
    /// HMAC key (from [`key_path`]).
    key: [u8; 32],
}

/// The HMAC key file of a ledger: beside it, named after it with `.key` appended
/// (`ledger.sqlite.key`).
pub fn key_path(ledger: &Path) -> PathBuf {
    let mut name = ledger.file_name().map(|n| n.to_os_string()).unwrap_or_else(|| "ledger".into());
    name.push(".key");
    ledger.with_file_name(name)
}

/// Read the ledger's key, creating it (32 random bytes as 64 hex digits, mode 0600, published with
/// a no-clobber link so that two processes opening a new ledger at once agree on one key).
fn load_or_create_key(ledger: &Path) -> Result<[u8; 32]> {
    use std::os::unix::fs::PermissionsExt;
    let path = key_path(ledger);
    if std::fs::symlink_metadata(&path).is_err() {
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        // NamedTempFile creates the file with mode 0600.
        let tmp = tempfile::NamedTempFile::new_in(dir)
            .ctx(|| format!("cannot create the ledger key in {}", dir.display()))?;
        let mut key = [0u8; 32];
        rand::RngCore::fill_bytes(&mut rand::rng(), &mut key);
        std::fs::write(tmp.path(), hex(&key) + "\n")
            .ctx(|| format!("cannot write the ledger key {}", tmp.path().display()))?;
        match tmp.persist_noclobber(&path) {
            Ok(_) => {}
            Err(e) if e.error.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                return Err(Error::input(format!("cannot create the ledger key {}: {}", path.display(), e.error)));
            }
        }
    }
    let bytes = base::util::read_regular(&path, &base::util::LEDGER_KEY)?;
    let meta = std::fs::symlink_metadata(&path).ctx(|| path.display().to_string())?;
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(Error::input(format!(
            "ledger key {} is readable or writable by other users (mode {:o}); run `chmod 600 {}`",
            path.display(),
            meta.permissions().mode() & 0o777,
            path.display()
        )));
    }
    let text = String::from_utf8_lossy(&bytes);
    let text = text.trim();
    let mut key = [0u8; 32];
    let ok = text.len() == 64
        && (0..32).all(|i| match u8::from_str_radix(&text[2 * i..2 * i + 2], 16) {
            Ok(b) => {
                key[i] = b;
                true
            }
            Err(_) => false,
        });
    if !ok {
        return Err(Error::input(format!(
            "ledger key {} is not 64 hex digits; restore it, or move it and the ledger away to start a new ledger (outcomes recorded under another key are not evidence)",
            path.display()
        )));
    }
    Ok(key)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The canonical encoding of an outcome row that its HMAC covers: a version tag, then every
/// column as stored (in table order: id, time, tool, engine, engine_hash, contracts, passed,
/// summary, figures, reference_level, duration_ms, client, constraints, status, imported), each as
/// its byte length (u64, little-endian) followed by its UTF-8 bytes; integers and booleans in
/// decimal.
pub fn canonical(columns: &[&str; COLUMNS]) -> Vec<u8> {
    let mut out = b"metainfer-outcome-v1\0".to_vec();
    for c in columns {
        out.extend((c.len() as u64).to_le_bytes());
        out.extend(c.as_bytes());
    }
    out
}

/// Columns an outcome's HMAC covers (see [`canonical`]).
pub const COLUMNS: usize = 15;

/// An outcome's columns as stored (see [`canonical`]).
struct Row {
    cols: [String; COLUMNS],
}

impl Row {
    fn of(o: &Outcome, imported: bool) -> Row {
        Row {
            cols: [
                o.id.clone(),
                o.time.clone(),
                o.tool.clone(),
                o.engine.clone(),
                o.engine_hash.clone(),
                serde_json::to_string(&o.contracts).expect("strings serialise"),
                (o.passed as u8).to_string(),
                o.summary.clone(),
                o.figures.to_string(),
                o.reference_level.clone(),
                o.duration_ms.to_string(),
                o.client.clone(),
                o.constraints.to_string(),
                o.status().to_string(),
                (imported as u8).to_string(),
            ],
        }
    }

    fn refs(&self) -> [&str; COLUMNS] {
        std::array::from_fn(|i| self.cols[i].as_str())
    }
}

fn mac_of(key: &[u8; 32], row: &Row) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes keys of any length");
    m.update(&canonical(&row.refs()));
    m
}

/// The ledger file used when none is given: `$METAINFER_LEDGER`, else the per-user data directory
/// (`~/.local/share/metainfer/ledger.sqlite` on Linux).
pub fn default_path() -> PathBuf {
    if let Ok(p) = std::env::var("METAINFER_LEDGER") {
        return PathBuf::from(p);
    }
    dirs::data_dir().unwrap_or_else(std::env::temp_dir).join("metainfer").join("ledger.sqlite")
}

impl Ledger {
    /// Open (creating if needed) and migrate the ledger at `path`.
    ///
    /// # Errors
    /// When the file cannot be opened, is not a SQLite database, or has a newer schema version.
    pub fn open(path: &Path) -> Result<Ledger> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).ctx(|| format!("cannot create ledger directory {}", dir.display()))?;
        }
        let fail = |e: rusqlite::Error| Error::input(format!("ledger {}: {e}", path.display()));
        let conn = Connection::open(path).map_err(fail)?;
        let busy = std::time::Duration::from_secs(10);
        conn.busy_timeout(busy).map_err(fail)?;
        // Switching a file to WAL takes an exclusive lock, and SQLite answers "database is locked"
        // at once, not through the busy timeout, while another connection holds the file (a fresh
        // ledger opened by several processes together): retried for as long as the busy timeout.
        let start = std::time::Instant::now();
        loop {
            match conn.pragma_update(None, "journal_mode", "WAL") {
                Ok(()) => break,
                Err(rusqlite::Error::SqliteFailure(f, _))
                    if f.code == rusqlite::ErrorCode::DatabaseBusy && start.elapsed() < busy =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(e) => return Err(fail(e)),
            }
        }
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0)).map_err(fail)?;
        if version > SCHEMA_VERSION {
            return Err(Error::input(format!(
                "ledger {} has schema version {version}, newer than this metainfer's {SCHEMA_VERSION}; upgrade metainfer or pass another --ledger",
                path.display()
            )));
        }
        if version < SCHEMA_VERSION {
            // One process migrates at a time: the version is read again and every step run in one
            // IMMEDIATE transaction (the write lock taken first), so processes opening a fresh
            // ledger together wait for the first (busy_timeout) and then find it migrated.
            conn.execute_batch("BEGIN IMMEDIATE;").map_err(fail)?;
            let migrated = conn
                .pragma_query_value(None, "user_version", |r| r.get::<_, i64>(0))
                .and_then(|now| migrate(&conn, now))
                .and_then(|()| conn.execute_batch("COMMIT;"));
            if let Err(e) = migrated {
                let _ = conn.execute_batch("ROLLBACK;");
                return Err(fail(e));
            }
        }
        let key = load_or_create_key(path)?;
        Ok(Ledger { conn, path: path.to_path_buf(), key })
    }

    fn runner_mac(&self, name: &str, public_key: &str, added: &str) -> String {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.key).expect("HMAC takes keys of any length");
        for part in ["runner", name, public_key, added] {
            m.update(&(part.len() as u64).to_le_bytes());
            m.update(part.as_bytes());
        }
        m.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Trust the runner key `public_key` (hex, `harness::attest::read_public`) under
    /// `name`: bundle runs it signs count as evidence. Replaces a runner of the same name.
    ///
    /// # Errors
    /// [`base::error::ErrorKind::Usage`] when another name holds the key; Internal when SQLite
    /// fails.
    pub fn trust_runner(&self, name: &str, public_key: &str) -> Result<()> {
        if let Some((other, _)) = self.runners()?.into_iter().find(|(n, k)| k == public_key && n != name) {
            return Err(Error::usage(format!("runner key already trusted as {other:?}")));
        }
        let added = now_rfc3339();
        let mac = self.runner_mac(name, public_key, &added);
        self.conn
            .execute(
                "INSERT OR REPLACE INTO runners (name, public_key, added, mac) VALUES (?1, ?2, ?3, ?4)",
                params![name, public_key, added, mac],
            )
            .internal_ctx(|| format!("ledger {}", self.path.display()))?;
        Ok(())
    }

    /// The trusted runners (name, public key hex) whose rows carry this ledger's HMAC (a row
    /// inserted without the key is ignored).
    ///
    /// # Errors
    /// When SQLite fails.
    pub fn runners(&self) -> Result<Vec<(String, String)>> {
        let fail = |e: rusqlite::Error| Error::internal(format!("ledger {}: {e}", self.path.display()));
        let mut stmt =
            self.conn.prepare("SELECT name, public_key, added, mac FROM runners ORDER BY name").map_err(fail)?;
        let rows = stmt
            .query_map([], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, String>(2)?, r.get::<_, String>(3)?))
            })
            .map_err(fail)?;
        let mut out = Vec::new();
        for row in rows {
            let (name, key, added, mac) = row.map_err(fail)?;
            if self.runner_mac(&name, &key, &added) == mac {
                out.push((name, key));
            }
        }
        Ok(out)
    }

    /// Store (replace) the machine probe of a fingerprint, as JSON.
    ///
    /// # Errors
    /// When SQLite fails.
    pub fn put_probe(&self, fingerprint: &str, probe: &serde_json::Value) -> Result<()> {
        self.conn
            .execute(
                "INSERT OR REPLACE INTO machine_probes (fingerprint, time, probe) VALUES (?1, ?2, ?3)",
                params![fingerprint, now_rfc3339(), probe.to_string()],
            )
            .map(|_| ())
            .internal_ctx(|| format!("ledger {}", self.path.display()))
    }

    /// The cached machine probe of a fingerprint, if any.
    ///
    /// # Errors
    /// When SQLite fails.
    pub fn probe(&self, fingerprint: &str) -> Result<Option<serde_json::Value>> {
        self.conn
            .query_row("SELECT probe FROM machine_probes WHERE fingerprint = ?1", [fingerprint], |r| {
                r.get::<_, String>(0)
            })
            .optional()
            .map(|o| o.and_then(|s| serde_json::from_str(&s).ok()))
            .internal_ctx(|| format!("ledger {}", self.path.display()))
    }

    /// Store the fingerprints of a reference tree under `name` (replacing an earlier registration of
    /// the same name), in one transaction. Files: (relative path, [(hash, line)]). No code is stored.
    ///
    /// # Errors
    /// When SQLite fails.
    pub fn add_reference(&mut self, name: &str, files: &[(String, Vec<(u64, u32)>)]) -> Result<()> {
        let fail = |e: rusqlite::Error| Error::internal(format!("ledger {}: {e}", self.path.display()));
        let tx = self.conn.transaction().map_err(fail)?;
        tx.execute(
            "DELETE FROM reference_prints WHERE file_id IN (SELECT id FROM reference_files WHERE name = ?1)",
            [name],
        )
        .map_err(fail)?;
        tx.execute("DELETE FROM reference_files WHERE name = ?1", [name]).map_err(fail)?;
        for (file, prints) in files {
            tx.execute("INSERT INTO reference_files (name, file) VALUES (?1, ?2)", params![name, file])
                .map_err(fail)?;
            let id = tx.last_insert_rowid();
            let mut stmt = tx
                .prepare_cached("INSERT INTO reference_prints (file_id, hash, line) VALUES (?1, ?2, ?3)")
                .map_err(fail)?;
            for (hash, line) in prints {
                stmt.execute(params![id, *hash as i64, line]).map_err(fail)?;
            }
        }
        tx.commit().map_err(fail)
    }

    /// Every registered reference file: (name, file, [(hash, line)]).
    ///
    /// # Errors
    /// When SQLite fails.
    #[allow(clippy::type_complexity)]
    pub fn references(&self) -> Result<Vec<(String, String, Vec<(u64, u32)>)>> {
        let fail = |e: rusqlite::Error| Error::internal(format!("ledger {}: {e}", self.path.display()));
        let mut files: Vec<(i64, String, String, Vec<(u64, u32)>)> = {
            let mut stmt = self.conn.prepare("SELECT id, name, file FROM reference_files ORDER BY id").map_err(fail)?;
            let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, Vec::new()))).map_err(fail)?;
            rows.collect::<rusqlite::Result<_>>().map_err(fail)?
        };
        let pos: std::collections::HashMap<i64, usize> = files.iter().enumerate().map(|(i, f)| (f.0, i)).collect();
        let mut stmt = self.conn.prepare("SELECT file_id, hash, line FROM reference_prints").map_err(fail)?;
        let rows = stmt
            .query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?, r.get::<_, u32>(2)?)))
            .map_err(fail)?;
        for row in rows {
            let (id, hash, line) = row.map_err(fail)?;
            if let Some(&i) = pos.get(&id) {
                files[i].3.push((hash as u64, line));
            }
        }
        Ok(files.into_iter().map(|(_, n, f, p)| (n, f, p)).collect())
    }

    /// Record one outcome in its own transaction.
    ///
    /// # Errors
    /// When SQLite fails (disk full, locked beyond the busy timeout).
    pub fn record(&self, o: &Outcome) -> Result<()> {
        insert(&self.conn, o, Some(&self.key))
            .map(|_| ())
            .internal_ctx(|| format!("ledger {}: cannot record outcome", self.path.display()))
    }

    /// The newest `limit` outcomes after skipping `offset`, newest first.
    ///
    /// # Errors
    /// When SQLite fails.
    pub fn list(&self, offset: usize, limit: usize) -> Result<Vec<Outcome>> {
        self.list_filtered(offset, limit, None)
    }

    /// Like [`Ledger::list`], only outcomes of `tool` when given.
    ///
    /// # Errors
    /// When SQLite fails.
    pub fn list_filtered(&self, offset: usize, limit: usize, tool: Option<&str>) -> Result<Vec<Outcome>> {
        let fail = |e: rusqlite::Error| Error::internal(format!("ledger {}: {e}", self.path.display()));
        let mut stmt = self
            .conn
            .prepare(
                &format!("SELECT {ROW_COLUMNS} FROM outcomes WHERE (?3 IS NULL OR tool = ?3) ORDER BY rowid DESC LIMIT ?1 OFFSET ?2"),
            )
            .map_err(fail)?;
        let rows = stmt.query_map(params![limit as i64, offset as i64, tool], |r| self.outcome_of(r)).map_err(fail)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(fail)
    }

    /// One page of outcomes matching `f`, newest first, each with its row id (the keyset cursor:
    /// pass the last one as `f.before` for the next page, which stays stable while new outcomes
    /// are recorded).
    ///
    /// # Errors
    /// When SQLite fails.
    pub fn page(&self, f: &OutcomeFilter, limit: usize) -> Result<Vec<(i64, Outcome)>> {
        let fail = |e: rusqlite::Error| Error::internal(format!("ledger {}: {e}", self.path.display()));
        let mut stmt = self
            .conn
            .prepare(&format!(
                "SELECT {ROW_COLUMNS}, rowid FROM outcomes WHERE {FILTER} AND (?5 IS NULL OR rowid < ?5) ORDER BY rowid DESC LIMIT ?6"
            ))
            .map_err(fail)?;
        let rows = stmt
            .query_map(params![f.tool, f.engine, f.contract, f.since, f.before, limit as i64], |r| {
                Ok((r.get::<_, i64>(COLUMNS + 1)?, self.outcome_of(r)?))
            })
            .map_err(fail)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(fail)
    }

    /// Number of outcomes matching `f` (its `before` ignored).
    ///
    /// # Errors
    /// When SQLite fails.
    pub fn count_matching(&self, f: &OutcomeFilter) -> Result<usize> {
        self.conn
            .query_row(
                &format!("SELECT COUNT(*) FROM outcomes WHERE {FILTER}"),
                params![f.tool, f.engine, f.contract, f.since],
                |r| r.get::<_, i64>(0),
            )
            .map(|n| n as usize)
            .internal_ctx(|| format!("ledger {}", self.path.display()))
    }

    /// An outcome from a row selected as [`ROW_COLUMNS`], with `authenticated` checked.
    fn outcome_of(&self, r: &rusqlite::Row) -> rusqlite::Result<Outcome> {
        // Every column as text, exactly as stored, so the MAC is checked on the stored bytes.
        let text = |i: usize| -> rusqlite::Result<String> {
            Ok(match r.get_ref(i)? {
                rusqlite::types::ValueRef::Text(t) | rusqlite::types::ValueRef::Blob(t) => {
                    String::from_utf8_lossy(t).into_owned()
                }
                rusqlite::types::ValueRef::Integer(n) => n.to_string(),
                rusqlite::types::ValueRef::Real(x) => x.to_string(),
                rusqlite::types::ValueRef::Null => String::new(),
            })
        };
        let row = Row { cols: std::array::from_fn(|i| text(i).unwrap_or_default()) };
        let mac: String = text(COLUMNS)?;
        let authenticated = decode_hex(&mac).is_some_and(|m| mac_of(&self.key, &row).verify_slice(&m).is_ok());
        let c = &row.cols;
        Ok(Outcome {
            id: c[0].clone(),
            time: c[1].clone(),
            tool: c[2].clone(),
            engine: c[3].clone(),
            engine_hash: c[4].clone(),
            contracts: serde_json::from_str(&c[5]).unwrap_or_default(),
            passed: c[6] != "0",
            summary: c[7].clone(),
            figures: serde_json::from_str(&c[8]).unwrap_or_default(),
            reference_level: c[9].clone(),
            duration_ms: c[10].parse().unwrap_or(0),
            client: c[11].clone(),
            constraints: serde_json::from_str(&c[12]).unwrap_or_default(),
            status: c[13].clone(),
            imported: c[14] != "0",
            authenticated,
        })
    }

    /// Number of outcomes recorded.
    ///
    /// # Errors
    /// When SQLite fails.
    pub fn count(&self) -> Result<usize> {
        self.conn
            .query_row("SELECT COUNT(*) FROM outcomes", [], |r| r.get::<_, i64>(0))
            .map(|n| n as usize)
            .internal_ctx(|| format!("ledger {}", self.path.display()))
    }

    /// Whether `tool` last passed on exactly this engine source hash built for weight dtype `dtype`
    /// (outcomes whose constraints record no dtype count as f32), counting only outcomes this server
    /// recorded itself (authenticated, not imported) from a run it made or a trusted runner signed
    /// (not [`unattested`]), over all it covers (not [`figures::GateFigures::partial`]): the newest
    /// such outcome decides.
    ///
    /// # Errors
    /// When SQLite fails.
    pub fn passed_on(&self, tool: &str, engine_hash: &str, dtype: &str) -> Result<bool> {
        let fail = |e: rusqlite::Error| Error::internal(format!("ledger {}: {e}", self.path.display()));
        let mut stmt = self
            .conn
            .prepare(&format!(
                "SELECT {ROW_COLUMNS} FROM outcomes WHERE tool = ?1 AND engine_hash = ?2 \
                 AND COALESCE(json_extract(constraints, '$.dtype'), 'f32') = ?3 ORDER BY rowid DESC"
            ))
            .map_err(fail)?;
        let rows = stmt.query_map(params![tool, engine_hash, dtype], |r| self.outcome_of(r)).map_err(fail)?;
        for o in rows {
            let o = o.map_err(fail)?;
            if o.authenticated && !o.imported && !unattested(&o) && o.figures["partial"] != true {
                return Ok(o.passed);
            }
        }
        Ok(false)
    }
}

/// Whether an outcome judged a bundle run that no trusted runner signed (its figures' `bundle` is
/// set and its `attestation` does not name a runner): shown and counted, never evidence for phase
/// order or promotion (see `harness::attest`).
pub fn unattested(o: &Outcome) -> bool {
    let f = &o.figures;
    f["bundle"].as_str().is_some_and(|b| !b.is_empty())
        && !f["attestation"].as_str().is_some_and(|a| a.starts_with(figures::ATTESTED_PREFIX))
}

/// A fresh random outcome id (128 bits, hex).
pub fn new_id() -> String {
    use rand::Rng;
    let v: u128 = rand::rng().random();
    format!("{v:032x}")
}

/// Now as RFC 3339 UTC with seconds, e.g. `2026-11-30T20:08:52Z`.
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

impl Ledger {
    /// Every outcome, oldest first, one JSON object per line (JSONL).
    ///
    /// # Errors
    /// When SQLite fails.
    pub fn export_jsonl(&self) -> Result<String> {
        let total = self.count()?;
        let mut rows = self.list(0, total)?;
        rows.reverse();
        Ok(rows.iter().map(|o| serde_json::to_string(o).expect("outcomes serialise") + "\n").collect())
    }

    /// Write every outcome as JSONL to `path` atomically; returns how many.
    ///
    /// # Errors
    /// When SQLite fails or `path` cannot be written.
    pub fn export_file(&self, path: &Path) -> Result<usize> {
        let text = self.export_jsonl()?;
        base::util::write_atomic(path, text.as_bytes())?;
        Ok(text.lines().count())
    }

    /// Merge outcomes from the JSONL file `path` (see [`Ledger::import_jsonl`]), read as a bounded
    /// regular file.
    ///
    /// # Errors
    /// An unreadable file, a malformed line (naming the file and line).
    pub fn import_file(&mut self, path: &Path) -> Result<(usize, usize)> {
        let text = base::util::read_regular_text(path, &base::util::LEDGER_EXPORT)?;
        self.import_jsonl(&text).map_err(|e| Error::input(format!("{}: {}", path.display(), e.message)))
    }

    /// Merge outcomes from JSONL: each is inserted unless an outcome with its id exists (so importing
    /// the same file twice changes nothing). One transaction; a malformed line rejects the whole file.
    /// Returns (inserted, already present).
    ///
    /// # Errors
    /// A line that is not an outcome (its number is named), or SQLite failing.
    pub fn import_jsonl(&mut self, text: &str) -> Result<(usize, usize)> {
        let mut outcomes = Vec::new();
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let o: Outcome = serde_json::from_str(line)
                .map_err(|e| Error::input(format!("line {}: not an outcome: {e}; nothing was imported", i + 1)))?;
            outcomes.push(o);
        }
        let fail = |e: rusqlite::Error| Error::internal(format!("ledger {}: {e}", self.path.display()));
        let tx = self.conn.transaction().map_err(fail)?;
        let mut inserted = 0;
        for o in &outcomes {
            inserted += insert(&tx, o, None).map_err(fail)?;
        }
        tx.commit().map_err(fail)?;
        Ok((inserted, outcomes.len() - inserted))
    }
}

/// The columns an outcome is read from: the [`COLUMNS`] of [`canonical`], then its MAC.
const ROW_COLUMNS: &str = "id, time, tool, engine, engine_hash, contracts, passed, summary, figures, reference_level, duration_ms, client, constraints, status, imported, mac";

/// The filter of [`Ledger::page`] as SQL over parameters ?1 tool, ?2 engine text, ?3 contract id
/// prefix (matched at the start of a quoted id in the contracts JSON), ?4 since.
const FILTER: &str = "(?1 IS NULL OR tool = ?1) AND (?2 IS NULL OR instr(engine, ?2) > 0) \
     AND (?3 IS NULL OR instr(contracts, '\"' || ?3) > 0) AND (?4 IS NULL OR time >= ?4)";

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || s.is_empty() {
        return None;
    }
    (0..s.len() / 2).map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()).collect()
}

/// Insert one outcome. With a key it is this server's own: authenticated with its HMAC, and an
/// existing id is an error. Without one it is imported: no MAC, `imported` set, and an outcome
/// whose id exists is skipped. Returns rows inserted.
fn insert(conn: &Connection, o: &Outcome, key: Option<&[u8; 32]>) -> rusqlite::Result<usize> {
    let row = Row::of(o, key.is_none());
    let mac = key.map(|k| hex(&mac_of(k, &row).finalize().into_bytes())).unwrap_or_default();
    let sql = format!(
        "INSERT {}INTO outcomes (id, time, tool, engine, engine_hash, contracts, passed, summary, figures, reference_level, duration_ms, client, constraints, status, imported, mac)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)",
        if key.is_none() { "OR IGNORE " } else { "" }
    );
    let c = &row.cols;
    conn.execute(
        &sql,
        params![
            c[0],
            c[1],
            c[2],
            c[3],
            c[4],
            c[5],
            o.passed,
            c[7],
            c[8],
            c[9],
            o.duration_ms as i64,
            c[11],
            c[12],
            c[13],
            key.is_none() as i64,
            mac
        ],
    )
}

/// One schema step on `outcomes`: add each column it lacks (a ledger written by a build that
/// numbered its steps differently may have some already), run `then`, set `user_version`, all in
/// one transaction (an error leaves the ledger as it was).
/// Bring a ledger at schema `version` to [`SCHEMA_VERSION`], step by step, inside the caller's
/// transaction (each step sets `user_version` to its number).
fn migrate(conn: &Connection, version: i64) -> rusqlite::Result<()> {
    if version < 1 {
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS outcomes (
                id TEXT PRIMARY KEY,
                time TEXT NOT NULL,
                tool TEXT NOT NULL,
                engine TEXT NOT NULL,
                engine_hash TEXT NOT NULL,
                contracts TEXT NOT NULL,
                passed INTEGER NOT NULL,
                summary TEXT NOT NULL,
                figures TEXT NOT NULL,
                reference_level TEXT NOT NULL,
                duration_ms INTEGER NOT NULL
             );
             CREATE INDEX IF NOT EXISTS outcomes_engine ON outcomes(engine_hash, tool);
             PRAGMA user_version = 1;",
        )?;
    }
    if version < 2 {
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS reference_files (
                id INTEGER PRIMARY KEY,
                name TEXT NOT NULL,
                file TEXT NOT NULL,
                UNIQUE(name, file)
             );
             CREATE TABLE IF NOT EXISTS reference_prints (
                file_id INTEGER NOT NULL REFERENCES reference_files(id) ON DELETE CASCADE,
                hash INTEGER NOT NULL,
                line INTEGER NOT NULL
             );
             CREATE INDEX IF NOT EXISTS reference_prints_file ON reference_prints(file_id);
             PRAGMA user_version = 2;",
        )?;
    }
    if version < 3 {
        add_columns(
            conn,
            &[("client", "TEXT NOT NULL DEFAULT ''"), ("constraints", "TEXT NOT NULL DEFAULT '{}'")],
            "",
            3,
        )?;
    }
    if version < 4 {
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS machine_probes (
                fingerprint TEXT PRIMARY KEY,
                time TEXT NOT NULL,
                probe TEXT NOT NULL
             );
             PRAGMA user_version = 4;",
        )?;
    }
    if version < 5 {
        // Outcome status, so that a cancelled call is neither a pass nor a failure.
        add_columns(
            conn,
            &[("status", "TEXT NOT NULL DEFAULT ''")],
            "UPDATE outcomes SET status = CASE passed WHEN 1 THEN 'passed' ELSE 'failed' END WHERE status = '';",
            5,
        )?;
    }
    if version < 6 {
        // Rows recorded before this version carry no HMAC: they stay listed but are not evidence
        // (authenticating them now would authenticate whatever had been inserted into them).
        add_columns(
            conn,
            // `status` again: a ledger a build numbered differently may hold this step's columns
            // at version 5 without step 5's.
            &[
                ("status", "TEXT NOT NULL DEFAULT ''"),
                ("mac", "TEXT NOT NULL DEFAULT ''"),
                ("imported", "INTEGER NOT NULL DEFAULT 0"),
            ],
            "UPDATE outcomes SET status = CASE passed WHEN 1 THEN 'passed' ELSE 'failed' END WHERE status = '';",
            6,
        )?;
    }
    if version < 7 {
        // Runners whose signed bundle runs count as evidence (harness::attest).
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS runners (
                name TEXT PRIMARY KEY,
                public_key TEXT NOT NULL UNIQUE,
                added TEXT NOT NULL,
                mac TEXT NOT NULL
             );
             PRAGMA user_version = 7;",
        )?;
    }
    if version < 8 {
        // Bundles this server wrote (bundles::record_bundle).
        conn.execute_batch(bundles::MIGRATION)?;
    }
    Ok(())
}

fn add_columns(conn: &Connection, columns: &[(&str, &str)], then: &str, version: i64) -> rusqlite::Result<()> {
    let have: Vec<String> = conn
        .prepare("SELECT name FROM pragma_table_info('outcomes')")?
        .query_map([], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    let mut sql = String::new();
    for (name, decl) in columns {
        if !have.iter().any(|h| h == name) {
            sql += &format!("ALTER TABLE outcomes ADD COLUMN {name} {decl};\n");
        }
    }
    sql += &format!("{then}\nPRAGMA user_version = {version};");
    conn.execute_batch(&sql)
}

#[cfg(test)]
mod tests;
