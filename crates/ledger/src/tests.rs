//! Unit tests of the ledger: schema migrations from earlier versions.

use super::*;

/// Regression: a ledger at version 5 whose outcomes table already had `mac` and `imported` (a
/// build that numbered its schema steps differently) failed to open with "duplicate column
/// name: mac". It now opens, gains `status` (its row marked passed from `passed`) and ends at the
/// current version.
#[test]
fn a_ledger_holding_a_later_steps_columns_opens() {
    let t = tempfile::tempdir().unwrap();
    let path = t.path().join("ledger.sqlite");
    let conn = Connection::open(&path).unwrap();
    conn.execute_batch(
        "CREATE TABLE outcomes (id TEXT PRIMARY KEY, time TEXT NOT NULL, tool TEXT NOT NULL, engine TEXT NOT NULL,
            engine_hash TEXT NOT NULL, contracts TEXT NOT NULL, passed INTEGER NOT NULL, summary TEXT NOT NULL,
            figures TEXT NOT NULL, reference_level TEXT NOT NULL, duration_ms INTEGER NOT NULL,
            client TEXT NOT NULL DEFAULT '', constraints TEXT NOT NULL DEFAULT '{}',
            mac TEXT NOT NULL DEFAULT '', imported INTEGER NOT NULL DEFAULT 0);
         INSERT INTO outcomes (id, time, tool, engine, engine_hash, contracts, passed, summary, figures,
            reference_level, duration_ms) VALUES ('a', 't', 'verify_generation', 'e', 'h', '[]', 1, 's', '{}', 'zero', 1);
         CREATE TABLE reference_files (id INTEGER PRIMARY KEY, name TEXT NOT NULL, file TEXT NOT NULL, UNIQUE(name, file));
         CREATE TABLE reference_prints (file_id INTEGER NOT NULL, hash INTEGER NOT NULL, line INTEGER NOT NULL);
         CREATE TABLE machine_probes (fingerprint TEXT PRIMARY KEY, time TEXT NOT NULL, probe TEXT NOT NULL);
         PRAGMA user_version = 5;",
    )
    .unwrap();
    drop(conn);
    let ledger = Ledger::open(&path).unwrap();
    let version: i64 = ledger.conn.pragma_query_value(None, "user_version", |r| r.get(0)).unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    let status: String = ledger.conn.query_row("SELECT status FROM outcomes WHERE id = 'a'", [], |r| r.get(0)).unwrap();
    assert_eq!(status, "passed");
}
