//! A directory swapped for a symlink while a call runs: the workspace's `sub/` is renamed aside and
//! replaced by a link to a canary directory outside the workspace, then put back, in a tight loop
//! on another thread, while scaffold writes under `sub/` and check_rules reads the engine `sub/eng`.
//! A path checked once and used again by name follows the swap out of the workspace; a directory
//! handle ([`metainfer::beneath::Dir`]) keeps naming the directory it checked, so every try either
//! works on the real directory or is refused.
//!
//! Counted as an escape: any file written into the canary (scaffold), or a rules report on the
//! canary's engine (its source hash, or "PASSED": the workspace's engine has a blocking finding and
//! the canary's has none).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::s;
use metainfer::harness::Budget;

/// Swaps `ws/sub` with a symlink to `outside` until `stop`; the real directory is `ws/sub.aside`
/// while the link is in place, and is back at `ws/sub` when this returns.
fn swapper(ws: PathBuf, outside: PathBuf, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let (sub, aside) = (ws.join("sub"), ws.join("sub.aside"));
        let mut swaps = 0;
        let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
        let mut pause = |max_us: u64| {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            std::thread::sleep(std::time::Duration::from_micros((rng >> 33) % max_us));
        };
        while !stop.load(Ordering::Relaxed) {
            // The real directory most of the time, the link now and then, at random moments.
            pause(3000);
            if std::fs::rename(&sub, &aside).is_ok() {
                // A call may have created `sub` meanwhile (resolving a missing parent by name).
                let linked = std::os::unix::fs::symlink(&outside, &sub).is_ok();
                pause(1000);
                if linked {
                    std::fs::remove_file(&sub).unwrap();
                }
                if std::fs::rename(&aside, &sub).is_err() {
                    std::fs::remove_dir_all(&sub).unwrap();
                    std::fs::rename(&aside, &sub).unwrap();
                }
                swaps += 1;
            }
        }
        swaps
    })
}

/// Every file below `dir`, as paths relative to it.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    walkdir::WalkDir::new(dir)
        .into_iter()
        .filter_map(|e| e.ok())
        .filter(|e| !e.file_type().is_dir())
        .map(|e| e.path().strip_prefix(dir).unwrap().to_path_buf())
        .collect()
}

#[test]
fn a_directory_swapped_for_a_symlink_mid_call_redirects_no_write_and_no_read() {
    let t = tempfile::tempdir().unwrap();
    let (ws, outside) = (t.path().join("ws"), t.path().join("outside"));
    std::fs::create_dir_all(ws.join("sub")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    let mut ctx = crate::ctx(t.path());
    ctx.workspace = Some(ws.clone());
    ctx.models = vec![crate::babyllama().parent().unwrap().to_path_buf()];
    let budget = Budget::secs(600);

    // The canary's engine passes the rules; the workspace's has a blocking finding (a build script
    // that starts a process).
    crate::Engine::Plain.copy_to(&outside.join("eng"));
    crate::Engine::Plain.copy_to(&ws.join("sub/eng"));
    std::fs::write(ws.join("sub/eng/build.rs"), "fn main() { let _ = std::process::Command::new(\"sh\").status(); }\n")
        .unwrap();
    let canary_hash = metainfer::harness::source_hash(&outside.join("eng")).unwrap();
    let canary_files = files_under(&outside);

    let stop = Arc::new(AtomicBool::new(false));
    let swaps = swapper(ws.clone(), outside.clone(), stop.clone());
    let (mut why, mut rules_why) = (std::collections::BTreeSet::new(), std::collections::BTreeSet::new());
    // check_rules first: the old scaffold's clean-up could delete the real `sub/` (it removed the
    // parent it had created by name, which by then was the real one again).
    let (mut rules_tries, mut rules_escapes, mut rules_refused) = (0, 0, 0);
    for _ in 0..40 {
        rules_tries += 1;
        let req = metainfer::ops::rules::RulesRequest { engine: "sub/eng".into() };
        match metainfer::ops::rules::check_rules(&ctx, &req, &budget) {
            Ok(r) if r.passed || r.engine_hash == canary_hash => rules_escapes += 1,
            Ok(r) => assert!(r.findings.iter().any(|f| f.rule == "build-script"), "{:?}", r.findings),
            Err(e) => {
                rules_refused += 1;
                rules_why.insert(e.message.lines().next().unwrap_or_default().to_string());
            }
        }
    }
    let (mut scaffold_tries, mut scaffold_escapes, mut scaffold_refused) = (0, 0, 0);
    for i in 0..150 {
        let req = metainfer::ops::scaffold::ScaffoldRequest {
            model: s(&crate::babyllama()),
            out: format!("sub/e{i}"),
            target: "cpu".into(),
            dtype: "f32".into(),
            force: false,
            reference_level: Default::default(),
            ..Default::default()
        };
        scaffold_tries += 1;
        if let Err(e) = metainfer::ops::scaffold::scaffold(&ctx, &req) {
            scaffold_refused += 1;
            why.insert(e.message);
        }
        if files_under(&outside) != canary_files {
            scaffold_escapes += 1;
            // Put the canary back so that each escape is counted once.
            for f in files_under(&outside) {
                if !canary_files.contains(&f) {
                    let _ = std::fs::remove_file(outside.join(&f));
                }
            }
            for e in std::fs::read_dir(&outside).unwrap().flatten() {
                if e.file_name() != "eng" {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let swaps = swaps.join().unwrap();
    println!(
        "swap race: {swaps} swaps; scaffold {scaffold_tries} tries, {scaffold_refused} refused, {scaffold_escapes} wrote outside; \
         check_rules {rules_tries} tries, {rules_refused} refused, {rules_escapes} read outside"
    );
    for w in rules_why.iter().chain(why.iter().take(4)) {
        println!("  refused: {}", w.lines().next().unwrap_or_default());
    }
    assert!(swaps > 0, "the swapper never swapped");
    assert_eq!(scaffold_escapes, 0, "scaffold wrote outside the workspace");
    assert_eq!(rules_escapes, 0, "check_rules read an engine outside the workspace");
    // Refusal is for the swap, not for the path: with the swapper stopped, the same calls work on
    // the real directory. (How many tries the race refuses depends on the machine's load: a loaded
    // machine stretches each call across several swaps, so no count of refusals is asserted.)
    let req = metainfer::ops::rules::RulesRequest { engine: "sub/eng".into() };
    let r = metainfer::ops::rules::check_rules(&ctx, &req, &budget).expect("check_rules after the race");
    assert!(!r.passed && r.engine_hash != canary_hash, "{:?}", r.findings);
    assert!(r.findings.iter().any(|f| f.rule == "build-script"), "{:?}", r.findings);
    let req = metainfer::ops::scaffold::ScaffoldRequest {
        model: s(&crate::babyllama()),
        out: "sub/after".into(),
        target: "cpu".into(),
        dtype: "f32".into(),
        ..Default::default()
    };
    metainfer::ops::scaffold::scaffold(&ctx, &req).expect("scaffold after the race");
    assert!(ws.join("sub/after/Cargo.toml").is_file());
    assert_eq!(files_under(&outside), canary_files);
}
