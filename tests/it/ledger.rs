//! The ledger: exact export/import round trip, idempotent merge, parallel writers, refusal of a newer
//! schema, migration of an older one, and consistency after the writer is killed mid-import.

use metainfer::ledger::{Ledger, Outcome};

fn outcome(i: usize, tool: &str) -> Outcome {
    Outcome {
        id: format!("{i:032x}-{tool}"),
        time: "2026-11-30T20:00:00Z".into(),
        tool: tool.into(),
        engine: "/w/engine".into(),
        engine_hash: format!("{:064x}", i % 7),
        contracts: vec!["kernel.rope@1".into(), "model.llama@1".into()],
        passed: !i.is_multiple_of(3),
        summary: format!("outcome {i} with \"quotes\" and unicode é"),
        figures: serde_json::json!({"i": i, "max_abs_err": 1.5e-7, "list": [1, 2, 3]}),
        reference_level: ["zero", "docs", "code"][i % 3].into(),
        duration_ms: i as u64 * 11,
        client: "test/1".into(),
        constraints: serde_json::json!({"family": "model.llama", "dtype": "f32"}),
        status: String::new(),
        imported: false,
        authenticated: false,
    }
}

#[test]
fn export_import_round_trips_exactly_and_merges_idempotently() {
    let t = tempfile::tempdir().unwrap();
    let a = Ledger::open(&t.path().join("a.sqlite")).unwrap();
    for i in 0..50 {
        a.record(&outcome(i, "run_kernel_test")).unwrap();
    }
    let text = a.export_jsonl().unwrap();
    assert_eq!(text.lines().count(), 50);
    let mut b = Ledger::open(&t.path().join("b.sqlite")).unwrap();
    assert_eq!(b.import_jsonl(&text).unwrap(), (50, 0));
    assert_eq!(
        b.export_jsonl().unwrap(),
        text.replace("\"imported\":false", "\"imported\":true"),
        "round trip must be exact but for the imported mark"
    );
    assert!(a.list(0, 50).unwrap().iter().all(|o| o.authenticated && !o.imported));
    assert!(b.list(0, 50).unwrap().iter().all(|o| !o.authenticated && o.imported));
    assert_eq!(b.import_jsonl(&text).unwrap(), (0, 50), "a second import changes nothing");
    assert_eq!(b.count().unwrap(), 50);
    // A merge of two machines' ledgers keeps both sets once.
    let c = Ledger::open(&t.path().join("c.sqlite")).unwrap();
    for i in 40..70 {
        c.record(&outcome(i, "run_kernel_test")).unwrap();
    }
    assert_eq!(b.import_jsonl(&c.export_jsonl().unwrap()).unwrap(), (20, 10));
    assert_eq!(b.count().unwrap(), 70);
    // A malformed line rejects the whole file and names the line.
    let e =
        b.import_jsonl(&format!("{}\n{{not json\n", serde_json::to_string(&outcome(99, "x")).unwrap())).unwrap_err();
    assert!(e.message.contains("line 2"), "{}", e.message);
    assert_eq!(b.count().unwrap(), 70);
}

#[test]
fn parallel_writers_lose_nothing() {
    let t = tempfile::tempdir().unwrap();
    let path = t.path().join("l.sqlite");
    Ledger::open(&path).unwrap();
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let path = path.clone();
            std::thread::spawn(move || {
                let l = Ledger::open(&path).unwrap();
                for i in 0..100 {
                    l.record(&outcome(w * 1000 + i, "verify_generation")).unwrap();
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    assert_eq!(Ledger::open(&path).unwrap().count().unwrap(), 400);
}

/// Opening a fresh ledger from several processes at once: each sees it migrated once, none fails
/// (before, two could read version 0 together and the second's migration failed with "duplicate
/// column name"). Eight connections of their own (as processes have), ten fresh ledgers.
#[test]
fn a_fresh_ledger_opened_by_many_at_once_migrates_once() {
    let t = tempfile::tempdir().unwrap();
    for round in 0..10 {
        let path = t.path().join(format!("l{round}.sqlite"));
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(8));
        let openers: Vec<_> = (0..8)
            .map(|_| {
                let (path, barrier) = (path.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    Ledger::open(&path).map(|l| l.count().unwrap()).map_err(|e| e.message)
                })
            })
            .collect();
        for o in openers {
            assert_eq!(o.join().unwrap(), Ok(0), "round {round}");
        }
        let l = Ledger::open(&path).unwrap();
        l.record(&outcome(1, "verify_generation")).unwrap();
        assert_eq!(l.list(0, 1).unwrap()[0].status, "passed");
    }
}

#[test]
fn newer_schema_is_refused_and_older_one_migrates() {
    let t = tempfile::tempdir().unwrap();
    let newer = t.path().join("newer.sqlite");
    {
        let conn = rusqlite::Connection::open(&newer).unwrap();
        conn.pragma_update(None, "user_version", 99).unwrap();
    }
    let e = Ledger::open(&newer).err().expect("a newer schema must be refused");
    assert!(e.message.contains("newer") && e.message.contains("99"), "{}", e.message);

    let old = t.path().join("old.sqlite");
    {
        let conn = rusqlite::Connection::open(&old).unwrap();
        conn.execute_batch(
            "CREATE TABLE outcomes (id TEXT PRIMARY KEY, time TEXT NOT NULL, tool TEXT NOT NULL, engine TEXT NOT NULL,
             engine_hash TEXT NOT NULL, contracts TEXT NOT NULL, passed INTEGER NOT NULL, summary TEXT NOT NULL,
             figures TEXT NOT NULL, reference_level TEXT NOT NULL, duration_ms INTEGER NOT NULL);
             INSERT INTO outcomes VALUES ('old1', '2026-01-01T00:00:00Z', 'compile_engine', '/e', 'h', '[]', 1, 's', '{}', 'zero', 5);
             PRAGMA user_version = 1;",
        )
        .unwrap();
    }
    let l = Ledger::open(&old).unwrap();
    let rows = l.list(0, 10).unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].id.as_str(), rows[0].client.as_str()), ("old1", ""));
    l.record(&outcome(1, "compile_engine")).unwrap();
    assert_eq!(l.count().unwrap(), 2);
}

#[test]
fn a_writer_killed_mid_import_leaves_a_consistent_database() {
    let t = tempfile::tempdir().unwrap();
    let path = t.path().join("l.sqlite");
    let big: String =
        (0..30_000).map(|i| serde_json::to_string(&outcome(i, "profile_engine")).unwrap() + "\n").collect();
    let file = t.path().join("big.jsonl");
    std::fs::write(&file, big).unwrap();
    let mut child = std::process::Command::new(crate::bin())
        .args(["--ledger"])
        .arg(&path)
        .args(["ledger", "import"])
        .arg(&file)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Kill it while it writes (the file parses in well under this, the inserts take longer).
    let start = std::time::Instant::now();
    while !path.exists() && start.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    std::thread::sleep(std::time::Duration::from_millis(150));
    let _ = child.kill();
    let status = child.wait().unwrap();
    let conn = rusqlite::Connection::open(&path).unwrap();
    let check: String = conn.query_row("PRAGMA integrity_check", [], |r| r.get(0)).unwrap();
    assert_eq!(check, "ok");
    let l = Ledger::open(&path).unwrap();
    let n = l.count().unwrap();
    assert!(n == 0 || n == 30_000, "an import is one transaction: all or nothing, got {n} (status {status:?})");
}

/// The report's figures from a ledger whose answer is known: engine A needs three attempts and two
/// minutes for kernel.rope (two diagnosed as adjacent-pair RoPE), engine B passes at once.
#[test]
fn report_computes_pass_rates_attempts_and_failure_modes() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let kt = |engine: &str, time: &str, passed: bool, level: &str| Outcome {
        id: format!("{engine}{time}"),
        time: time.into(),
        tool: "run_kernel_test".into(),
        engine: engine.into(),
        engine_hash: "h".into(),
        contracts: vec!["kernel.rope@1".into()],
        passed,
        summary: String::new(),
        figures: serde_json::json!({
            "kernels": [{"id": "kernel.rope", "passed": passed, "diagnosis": if passed { vec![] } else { vec!["failure.rope-adjacent-pairs"] }}],
        }),
        reference_level: level.into(),
        duration_ms: 1,
        client: String::new(),
        constraints: serde_json::json!({}),
        status: String::new(),
        imported: false,
        authenticated: false,
    };
    let outcomes = vec![
        kt("/a", "2026-11-30T10:00:00Z", false, "zero"),
        kt("/b", "2026-11-30T10:00:30Z", true, "code"),
        kt("/a", "2026-11-30T10:01:00Z", false, "zero"),
        kt("/a", "2026-11-30T10:02:00Z", true, "zero"),
    ];
    let r = metainfer::ops::report::build(&ctx, &outcomes, &Default::default());
    let rope = r.contracts.iter().find(|c| c.id == "kernel.rope").unwrap();
    assert_eq!(rope.stats.attempts, 4);
    assert_eq!(rope.stats.engines, 2);
    assert_eq!(rope.stats.first_try_pass_rate, 0.5);
    assert_eq!(rope.stats.median_attempts_to_green, 2.0); // median of 3 and 1
    assert_eq!(rope.stats.median_seconds_to_green, 60.0); // median of 120 and 0
    assert_eq!(rope.failure_modes, ["failure.rope-adjacent-pairs (2)"]);
    let zero = r.levels.iter().find(|l| l.level == "zero").unwrap();
    assert_eq!(
        (zero.stats.attempts, zero.stats.first_try_pass_rate, zero.stats.median_attempts_to_green),
        (3, 0.0, 3.0)
    );
    let code = r.levels.iter().find(|l| l.level == "code").unwrap();
    assert_eq!((code.stats.attempts, code.stats.first_try_pass_rate), (1, 1.0));
    // Every family x platform x dtype the CKB covers is listed; none has a passing verify here.
    let cells: Vec<(&str, &str)> = r.coverage.iter().map(|c| (c.family.as_str(), c.status.as_str())).collect();
    assert!(cells.contains(&("model.llama", "covered")), "{cells:?}");
    let dtypes: usize =
        ctx.ckb.of_kind(metainfer::ckb::Kind::Platform).map(|p| p.platform.as_ref().unwrap().dtypes.len()).sum();
    assert_eq!(cells.len(), ctx.ckb.of_kind(metainfer::ckb::Kind::Model).count() * dtypes);
    assert!(cells.iter().all(|c| c.1 == "covered"), "{cells:?}");
}

/// A failed verify_generation is charged to the contracts at fault, not to every contract of the
/// engine: without a diagnosis to the model family (the kernels passed their own tests and stay
/// green), with one to the contracts its failure mode applies to. (Before, one failed verify made
/// every kernel of the engine "never green".)
#[test]
fn a_failed_verify_is_charged_to_the_contracts_at_fault() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let at = |i: usize, tool: &str, passed: bool, figures: serde_json::Value| Outcome {
        time: format!("2026-11-30T20:0{i}:00Z"),
        engine: "/e".into(),
        contracts: vec!["model.llama@1".into(), "kernel.rope@1".into(), "kernel.rms_norm@1".into()],
        passed,
        figures,
        ..outcome(i, tool)
    };
    let kernels = serde_json::json!({"kernels": [
        {"id": "kernel.rope", "passed": true, "diagnosis": []},
        {"id": "kernel.rms_norm", "passed": true, "diagnosis": []}]});
    let outcomes = vec![
        at(1, "run_kernel_test", true, kernels),
        at(2, "verify_generation", false, serde_json::json!({"diagnosis": []})),
        at(3, "verify_generation", false, serde_json::json!({"diagnosis": ["failure.rope-adjacent-pairs"]})),
    ];
    let r = metainfer::ops::report::build(&ctx, &outcomes, &Default::default());
    let row = |id: &str| r.contracts.iter().find(|c| c.id == id).unwrap_or_else(|| panic!("no {id}"));
    // kernel.rms_norm: its own test only, green.
    assert_eq!((row("kernel.rms_norm").stats.attempts, row("kernel.rms_norm").stats.never_green), (1, 0));
    // kernel.rope: its test, then the verify whose diagnosis applies to it.
    assert_eq!((row("kernel.rope").stats.attempts, row("kernel.rope").stats.never_green), (2, 0));
    assert_eq!(row("kernel.rope").failure_modes, ["failure.rope-adjacent-pairs (1)"]);
    // model.llama: both failed verifies (the undiagnosed one and the diagnosed one, which applies to it too).
    assert_eq!((row("model.llama").stats.attempts, row("model.llama").stats.never_green), (2, 1));
}

/// The machine probe measures every figure on 1..N threads and is cached per machine fingerprint.
#[test]
fn machine_probe_is_complete_and_cached() {
    let p = metainfer::probe::run(1, 0.002);
    let cores = metainfer::probe::cores();
    assert_eq!(p.figures.len(), cores * (metainfer::probe::working_sets().len() + 1));
    for f in &p.figures {
        assert!(f.spread.median.is_finite() && f.spread.median > 0.0, "{f:?}");
        assert!(f.spread.min <= f.spread.median && f.spread.median <= f.spread.max, "{f:?}");
    }
    assert!(p.median("read DRAM", 1).is_some() && p.median("peak f32", cores).is_some());
    let t = tempfile::tempdir().unwrap();
    let l = Ledger::open(&t.path().join("l.sqlite")).unwrap();
    assert!(l.probe(&p.fingerprint).unwrap().is_none());
    l.put_probe(&p.fingerprint, &serde_json::to_value(&p).unwrap()).unwrap();
    let back: metainfer::probe::MachineProbe =
        serde_json::from_value(l.probe(&p.fingerprint).unwrap().unwrap()).unwrap();
    assert_eq!(back, p);
}

/// A ledger of 2,000 engines: ckb_report and list_outcomes stay under the output bound in their
/// structured content and their text, and paging through the engines visits each exactly once.
#[test]
fn report_over_two_thousand_engines_is_bounded_and_pages_through_every_engine() {
    use metainfer::ops::Report;
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let bound = ctx.max_output;
    let mut lines = String::new();
    for e in 0..2000 {
        for (k, tool) in ["compile_engine", "run_kernel_test", "verify_generation"].iter().enumerate() {
            let mut o = outcome(e * 3 + k, tool);
            o.engine = format!("/work/engines/engine-{e:04}");
            o.time = format!("2026-11-30T{:02}:{:02}:{:02}Z", e / 100 % 24, e % 60, k);
            lines += &(serde_json::to_string(&o).unwrap() + "\n");
        }
    }
    let mut l = Ledger::open(&ctx.ledger).unwrap();
    assert_eq!(l.import_jsonl(&lines).unwrap().0, 6000);
    let size = |v: &serde_json::Value| serde_json::to_string(v).unwrap().chars().count();

    let r = metainfer::ops::report::report(&ctx, &Default::default()).unwrap();
    let v = serde_json::to_value(&r).unwrap();
    assert!(size(&v) <= bound, "structured report of {} characters", size(&v));
    assert!(r.text().chars().count() <= bound, "text of {} characters", r.text().chars().count());
    assert_eq!(r.totals.engines, 2000);
    crate::assert_conforms(&r);

    let mut seen = std::collections::BTreeSet::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        let req = metainfer::ops::report::ReportRequest {
            section: Some("engines".into()),
            cursor: cursor.clone(),
            ..Default::default()
        };
        let r = metainfer::ops::report::report(&ctx, &req).unwrap();
        assert!(size(&serde_json::to_value(&r).unwrap()) <= bound);
        for e in &r.engines {
            assert!(seen.insert(e.engine.clone()), "{} twice", e.engine);
        }
        pages += 1;
        match r.engines_next {
            Some(c) => cursor = Some(c),
            None => break,
        }
        assert!(pages < 1000, "paging does not end");
    }
    assert_eq!(seen.len(), 2000);

    let page = metainfer::ops::outcomes::list(
        &ctx,
        &metainfer::ops::outcomes::OutcomesRequest {
            limit: Some(100),
            engine: Some("engine-0042".into()),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(page.total, 3);
    assert!(page.outcomes.iter().all(|o| o.engine.ends_with("engine-0042")));
    let all = metainfer::ops::outcomes::list(
        &ctx,
        &metainfer::ops::outcomes::OutcomesRequest { limit: Some(100), ..Default::default() },
    )
    .unwrap();
    assert!(size(&serde_json::to_value(&all).unwrap()) <= bound);
    assert!(all.next_cursor.is_some());
}

/// A cancelled call is neither a pass nor a failure: it counts in no pass rate.
#[test]
fn cancelled_outcomes_are_left_out_of_pass_rates() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let mut cancelled = outcome(1, "compile_engine");
    cancelled.passed = false;
    cancelled.status = "cancelled".into();
    let mut passed = outcome(2, "compile_engine");
    passed.passed = true;
    let r = metainfer::ops::report::build(&ctx, &[cancelled.clone(), passed], &Default::default());
    let rope = r.contracts.iter().find(|c| c.id == "kernel.rope").unwrap();
    assert_eq!((rope.stats.attempts, rope.stats.first_try_pass_rate), (1, 1.0));
    // The status survives the ledger, and older exports without one derive it from `passed`.
    let l = Ledger::open(&t.path().join("s.sqlite")).unwrap();
    l.record(&cancelled).unwrap();
    assert_eq!(l.list(0, 1).unwrap()[0].status, "cancelled");
    let old: Outcome =
        serde_json::from_str(&serde_json::to_string(&outcome(4, "x")).unwrap().replace(",\"status\":\"\"", ""))
            .unwrap();
    assert_eq!(old.status(), "passed");
}

/// An attempt is code run against a contract: a gate that ran nothing for want of a device, and a
/// kernel still the scaffold's `todo!()`, count in no rate. Engine /a: kernel tests with no device,
/// then rope and softmax with softmax unwritten (its panic text as the harness returns it), then
/// both passing: rope 2 attempts, first try failed; softmax 1 attempt, first try passed.
#[test]
fn no_device_runs_and_unwritten_kernels_are_no_attempts() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let kt = |i: usize, figures: serde_json::Value| {
        let mut o = outcome(i, "run_kernel_test");
        o.time = format!("2026-11-30T10:0{i}:00Z");
        o.passed = false;
        o.figures = figures;
        o
    };
    let outcomes = vec![
        kt(
            1,
            serde_json::json!({"no_device": true, "kernels": [
                {"id": "kernel.rope", "passed": false, "diagnosis": []},
                {"id": "kernel.softmax", "passed": false, "diagnosis": []}]}),
        ),
        kt(
            2,
            serde_json::json!({"kernels": [
                {"id": "kernel.rope", "passed": false, "diagnosis": []},
                {"id": "kernel.softmax", "passed": false, "diagnosis": [], "unwritten": true,
                 "error": "engine panicked: not yet implemented"}]}),
        ),
        kt(
            3,
            serde_json::json!({"kernels": [
                {"id": "kernel.rope", "passed": true, "diagnosis": []},
                {"id": "kernel.softmax", "passed": true, "diagnosis": []}]}),
        ),
    ];
    let r = metainfer::ops::report::build(&ctx, &outcomes, &Default::default());
    let stats = |id: &str| r.contracts.iter().find(|c| c.id == id).unwrap().stats.clone();
    let (rope, softmax) = (stats("kernel.rope"), stats("kernel.softmax"));
    assert_eq!((rope.attempts, rope.first_try_pass_rate, rope.median_attempts_to_green), (2, 0.0, 2.0));
    assert_eq!((softmax.attempts, softmax.first_try_pass_rate, softmax.never_green), (1, 1.0, 0));
    // The scaffold's panic message is what marks a kernel unwritten (std's todo!/unimplemented!).
    assert!(metainfer::ledger::figures::KernelFigure::is_unwritten(
        "panicked at src/kernels.rs:3:5:\nnot yet implemented"
    ));
    assert!(!metainfer::ledger::figures::KernelFigure::is_unwritten("index out of bounds: the len is 3"));
}

/// The report's text: a contract no engine brought to green has no median to green ("-", not
/// 0.0); coverage rows name their platform (sm80 and sm90 share the target `cuda`); a page of one
/// section prints no empty table for the others.
#[test]
fn report_text_has_no_figure_for_never_green_and_names_platforms() {
    use metainfer::ops::Report;
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let mut o = outcome(1, "run_kernel_test");
    o.passed = false;
    o.figures = serde_json::json!({"kernels": [{"id": "kernel.softmax", "passed": false, "diagnosis": []}]});
    let r = metainfer::ops::report::build(&ctx, &[o.clone()], &Default::default());
    let text = r.text();
    assert!(text.contains("| kernel.softmax | 1 | 1 | 0% | - | - | 1 |"), "{text}");
    assert!(text.contains("| model.llama | platform.cuda-sm80 | cuda | bf16 | covered |"), "{text}");
    assert!(text.contains("| model.llama | platform.cuda-sm90 | cuda | bf16 | covered |"), "{text}");
    let l = Ledger::open(&ctx.ledger).unwrap();
    l.record(&o).unwrap();
    let req = metainfer::ops::report::ReportRequest { section: Some("coverage".into()), ..Default::default() };
    let text = metainfer::ops::report::report(&ctx, &req).unwrap().text();
    assert!(!text.contains("## Per contract") && !text.contains("## Engines"), "{text}");
    assert!(text.contains("## Coverage"), "{text}");
}

/// The columns of the outcomes table at schema version 4 (before HMACs), for rows forged with SQL.
const V4_INSERT: &str = "INSERT INTO outcomes (id, time, tool, engine, engine_hash, contracts, passed, summary, figures, reference_level, duration_ms, client, constraints)
     VALUES (?1, '2026-12-01T00:00:00Z', ?2, '/e', ?3, '[]', 1, 'forged', '{}', 'zero', 1, '', '{\"dtype\":\"f32\"}')";

#[test]
fn only_outcomes_this_server_recorded_are_evidence() {
    let t = tempfile::tempdir().unwrap();
    let path = t.path().join("ledger.sqlite");
    let mut l = Ledger::open(&path).unwrap();
    // The key: 64 hex digits, beside the ledger, readable by its owner only.
    let key = metainfer::ledger::key_path(&path);
    assert_eq!(key, t.path().join("ledger.sqlite.key"));
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&key).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(std::fs::read_to_string(&key).unwrap().trim().len(), 64);

    // A row inserted by anything but this server (a build script that found the ledger's path) is
    // listed, but not evidence.
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute(V4_INSERT, rusqlite::params!["forged", "run_kernel_test", "H1"]).unwrap();
    assert!(!l.passed_on("run_kernel_test", "H1", "f32").unwrap());
    let row = &l.list(0, 1).unwrap()[0];
    assert!(row.id == "forged" && row.passed && !row.authenticated && !row.imported);

    // A genuine failing outcome altered to pass is no longer authenticated.
    let mut o = outcome(1, "run_kernel_test");
    o.passed = false;
    o.engine_hash = "H2".into();
    l.record(&o).unwrap();
    assert!(l.list(0, 1).unwrap()[0].authenticated);
    conn.execute("UPDATE outcomes SET passed = 1 WHERE engine_hash = 'H2'", []).unwrap();
    assert!(!l.list(0, 1).unwrap()[0].authenticated);
    assert!(!l.passed_on("run_kernel_test", "H2", "f32").unwrap());
    // Its MAC copied onto another row does not authenticate that row either.
    conn.execute(
        "UPDATE outcomes SET mac = (SELECT mac FROM outcomes WHERE engine_hash = 'H2') WHERE id = 'forged'",
        [],
    )
    .unwrap();
    assert!(!l.passed_on("run_kernel_test", "H1", "f32").unwrap());

    // An imported passing outcome is shown as imported, and is not evidence.
    let mut imported = outcome(2, "run_kernel_test");
    imported.passed = true;
    imported.engine_hash = "H3".into();
    l.import_jsonl(&serde_json::to_string(&imported).unwrap()).unwrap();
    let row = l.list(0, 1).unwrap().remove(0);
    assert!(row.imported && !row.authenticated && row.passed);
    assert!(!l.passed_on("run_kernel_test", "H3", "f32").unwrap());

    // This server's own passing outcome is.
    let mut own = outcome(4, "run_kernel_test");
    own.passed = true;
    own.engine_hash = "H3".into();
    l.record(&own).unwrap();
    assert!(l.passed_on("run_kernel_test", "H3", "f32").unwrap());

    // A ledger whose key file became readable by others is refused with what to do.
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let e = Ledger::open(&path).err().expect("a readable key is refused");
    assert!(e.message.contains("chmod 600"), "{}", e.message);
}

#[test]
fn a_version_4_ledger_migrates_and_its_rows_are_not_evidence() {
    let t = tempfile::tempdir().unwrap();
    let path = t.path().join("v4.sqlite");
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        // The schema metainfer wrote at version 4.
        conn.execute_batch(
            "CREATE TABLE outcomes (id TEXT PRIMARY KEY, time TEXT NOT NULL, tool TEXT NOT NULL, engine TEXT NOT NULL,
             engine_hash TEXT NOT NULL, contracts TEXT NOT NULL, passed INTEGER NOT NULL, summary TEXT NOT NULL,
             figures TEXT NOT NULL, reference_level TEXT NOT NULL, duration_ms INTEGER NOT NULL,
             client TEXT NOT NULL DEFAULT '', constraints TEXT NOT NULL DEFAULT '{}');
             CREATE INDEX outcomes_engine ON outcomes(engine_hash, tool);
             CREATE TABLE reference_files (id INTEGER PRIMARY KEY, name TEXT NOT NULL, file TEXT NOT NULL, UNIQUE(name, file));
             CREATE TABLE reference_prints (file_id INTEGER NOT NULL REFERENCES reference_files(id) ON DELETE CASCADE,
             hash INTEGER NOT NULL, line INTEGER NOT NULL);
             CREATE TABLE machine_probes (fingerprint TEXT PRIMARY KEY, time TEXT NOT NULL, probe TEXT NOT NULL);
             PRAGMA user_version = 4;",
        )
        .unwrap();
        conn.execute(V4_INSERT, rusqlite::params!["old", "run_kernel_test", "H"]).unwrap();
    }
    let l = Ledger::open(&path).unwrap();
    let version: i64 =
        rusqlite::Connection::open(&path).unwrap().pragma_query_value(None, "user_version", |r| r.get(0)).unwrap();
    assert_eq!(version, metainfer::ledger::SCHEMA_VERSION);
    assert_eq!(version, 8);
    // Step 8 added the table of written bundles.
    assert!(l.written_bundle("none").unwrap().is_none());
    l.record_bundle("n", "run_kernel_test", "abc").unwrap();
    assert_eq!(l.written_bundle("n").unwrap(), Some(("run_kernel_test".to_string(), "abc".to_string())));
    let rows = l.list(0, 10).unwrap();
    assert_eq!(rows.len(), 1);
    assert!(rows[0].passed && !rows[0].authenticated && !rows[0].imported, "{:?}", rows[0]);
    assert!(!l.passed_on("run_kernel_test", "H", "f32").unwrap(), "a row from before HMACs is not evidence");
    let mut o = outcome(3, "run_kernel_test");
    o.passed = true;
    o.engine_hash = "H".into();
    l.record(&o).unwrap();
    assert!(l.passed_on("run_kernel_test", "H", "f32").unwrap());
}

#[test]
fn imported_outcomes_are_marked_in_list_outcomes_and_ckb_report() {
    use metainfer::ops::Report;
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let mut l = Ledger::open(&ctx.ledger).unwrap();
    l.record(&outcome(1, "run_kernel_test")).unwrap();
    l.import_jsonl(&serde_json::to_string(&outcome(2, "run_kernel_test")).unwrap()).unwrap();
    let page = metainfer::ops::outcomes::list(&ctx, &Default::default()).unwrap();
    let marks: Vec<(bool, bool)> = page.outcomes.iter().map(|o| (o.imported, o.authenticated)).collect();
    assert_eq!(marks, [(true, false), (false, true)], "newest first: the imported one, then this server's");
    assert_eq!(page.text().matches("[imported]").count(), 1, "{}", page.text());
    let r = metainfer::ops::report::report(&ctx, &metainfer::ops::report::ReportRequest::default()).unwrap();
    assert_eq!((r.outcomes, r.imported), (2, 1));
    assert_eq!(r.engines.iter().map(|e| e.imported).sum::<usize>(), 1);
    assert!(r.text().contains("2 outcomes, 1 imported"), "{}", r.text());
}
