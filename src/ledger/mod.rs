//! The outcome ledger: every tool call's result, in SQLite (WAL, one transaction per outcome).
//!
//! Knows nothing of MCP or processes. Schema versions are tracked with `PRAGMA user_version`; a
//! database written by a newer metainfer is refused rather than guessed at.

pub mod figures;

use std::path::{Path, PathBuf};

use rusqlite::{Connection, OptionalExtension, params};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Schema version this build writes.
pub const SCHEMA_VERSION: i64 = 4;

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
}

/// An open ledger.
pub struct Ledger {
    conn: Connection,
    /// Database file.
    pub path: PathBuf,
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
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::input(format!("cannot create ledger directory {}: {e}", dir.display())))?;
        }
        let fail = |e: rusqlite::Error| Error::input(format!("ledger {}: {e}", path.display()));
        let conn = Connection::open(path).map_err(fail)?;
        conn.busy_timeout(std::time::Duration::from_secs(10)).map_err(fail)?;
        conn.pragma_update(None, "journal_mode", "WAL").map_err(fail)?;
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0)).map_err(fail)?;
        if version > SCHEMA_VERSION {
            return Err(Error::input(format!(
                "ledger {} has schema version {version}, newer than this metainfer's {SCHEMA_VERSION}; upgrade metainfer or pass another --ledger",
                path.display()
            )));
        }
        if version < 1 {
            conn.execute_batch(
                "BEGIN;
                 CREATE TABLE IF NOT EXISTS outcomes (
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
                 PRAGMA user_version = 1;
                 COMMIT;",
            )
            .map_err(fail)?;
        }
        if version < 2 {
            conn.execute_batch(
                "BEGIN;
                 CREATE TABLE IF NOT EXISTS reference_files (
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
                 PRAGMA user_version = 2;
                 COMMIT;",
            )
            .map_err(fail)?;
        }
        if version < 3 {
            conn.execute_batch(
                "BEGIN;
                 ALTER TABLE outcomes ADD COLUMN client TEXT NOT NULL DEFAULT '';
                 ALTER TABLE outcomes ADD COLUMN constraints TEXT NOT NULL DEFAULT '{}';
                 PRAGMA user_version = 3;
                 COMMIT;",
            )
            .map_err(fail)?;
        }
        if version < 4 {
            conn.execute_batch(
                "BEGIN;
                 CREATE TABLE IF NOT EXISTS machine_probes (
                    fingerprint TEXT PRIMARY KEY,
                    time TEXT NOT NULL,
                    probe TEXT NOT NULL
                 );
                 PRAGMA user_version = 4;
                 COMMIT;",
            )
            .map_err(fail)?;
        }
        Ok(Ledger { conn, path: path.to_path_buf() })
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
            .map_err(|e| Error::internal(format!("ledger {}: {e}", self.path.display())))
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
            .map_err(|e| Error::internal(format!("ledger {}: {e}", self.path.display())))
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
        insert(&self.conn, o, false)
            .map(|_| ())
            .map_err(|e| Error::internal(format!("ledger {}: cannot record outcome: {e}", self.path.display())))
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
                "SELECT id, time, tool, engine, engine_hash, contracts, passed, summary, figures, reference_level, duration_ms, client, constraints
                 FROM outcomes WHERE (?3 IS NULL OR tool = ?3) ORDER BY rowid DESC LIMIT ?1 OFFSET ?2",
            )
            .map_err(fail)?;
        let rows = stmt
            .query_map(params![limit as i64, offset as i64, tool], |r| {
                Ok(Outcome {
                    id: r.get(0)?,
                    time: r.get(1)?,
                    tool: r.get(2)?,
                    engine: r.get(3)?,
                    engine_hash: r.get(4)?,
                    contracts: serde_json::from_str(&r.get::<_, String>(5)?).unwrap_or_default(),
                    passed: r.get(6)?,
                    summary: r.get(7)?,
                    figures: serde_json::from_str(&r.get::<_, String>(8)?).unwrap_or_default(),
                    reference_level: r.get(9)?,
                    duration_ms: r.get::<_, i64>(10)? as u64,
                    client: r.get(11)?,
                    constraints: serde_json::from_str(&r.get::<_, String>(12)?).unwrap_or_default(),
                })
            })
            .map_err(fail)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(fail)
    }

    /// Number of outcomes recorded.
    ///
    /// # Errors
    /// When SQLite fails.
    pub fn count(&self) -> Result<usize> {
        self.conn
            .query_row("SELECT COUNT(*) FROM outcomes", [], |r| r.get::<_, i64>(0))
            .map(|n| n as usize)
            .map_err(|e| Error::internal(format!("ledger {}: {e}", self.path.display())))
    }

    /// Whether `tool` last passed on exactly this engine source hash built for weight dtype `dtype`
    /// (outcomes whose constraints record no dtype count as f32).
    ///
    /// # Errors
    /// When SQLite fails.
    pub fn passed_on(&self, tool: &str, engine_hash: &str, dtype: &str) -> Result<bool> {
        self.conn
            .query_row(
                "SELECT passed FROM outcomes WHERE tool = ?1 AND engine_hash = ?2 \
                 AND COALESCE(json_extract(constraints, '$.dtype'), 'f32') = ?3 ORDER BY rowid DESC LIMIT 1",
                params![tool, engine_hash, dtype],
                |r| r.get::<_, bool>(0),
            )
            .optional()
            .map(|p| p.unwrap_or(false))
            .map_err(|e| Error::internal(format!("ledger {}: {e}", self.path.display())))
    }
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
            inserted += insert(&tx, o, true).map_err(fail)?;
        }
        tx.commit().map_err(fail)?;
        Ok((inserted, outcomes.len() - inserted))
    }
}

/// Insert one outcome; with `or_ignore`, an outcome whose id exists is skipped. Returns rows inserted.
fn insert(conn: &Connection, o: &Outcome, or_ignore: bool) -> rusqlite::Result<usize> {
    let sql = format!(
        "INSERT {}INTO outcomes (id, time, tool, engine, engine_hash, contracts, passed, summary, figures, reference_level, duration_ms, client, constraints)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
        if or_ignore { "OR IGNORE " } else { "" }
    );
    conn.execute(
        &sql,
        params![
            o.id,
            o.time,
            o.tool,
            o.engine,
            o.engine_hash,
            serde_json::to_string(&o.contracts).expect("strings serialise"),
            o.passed,
            o.summary,
            o.figures.to_string(),
            o.reference_level,
            o.duration_ms as i64,
            o.client,
            o.constraints.to_string()
        ],
    )
}
