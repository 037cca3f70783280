//! Unit tests of profile_engine: the roofline's memory level, the regression rule.

use base::stats::Spread;
use probe::{Figure, MachineProbe};

fn probe() -> MachineProbe {
    let fig = |what: String, threads: usize, max: f64| Figure {
        what,
        threads,
        unit: "GB/s".into(),
        spread: Spread { min: max / 2.0, median: max * 0.9, max },
    };
    let mut figures = Vec::new();
    for (i, (label, _)) in probe::working_sets().into_iter().enumerate() {
        figures.push(fig(format!("read {label}"), 1, 100.0 / (i + 1) as f64));
        figures.push(fig(format!("read {label}"), 2, 200.0 / (i + 1) as f64));
    }
    MachineProbe { fingerprint: "test".into(), simd: "scalar".into(), figures }
}

/// The roofline's level holds the working set: 0.4 MB (the synthetic checkpoints) is L3's
/// (4 MiB), 60 MB (stories15M in f32) and 5 GB are DRAM's; at the run's thread count; the best
/// run (max), since a roofline bounds.
#[test]
fn the_roofline_level_holds_the_decode_working_set_at_the_run_s_threads() {
    let p = probe();
    let (bw, label) = super::roofline_level(&p, 0.4e6, 1).unwrap();
    assert_eq!((bw, label.as_str()), (100.0 / 3.0, "L3 (4 MiB)"));
    let (bw, label) = super::roofline_level(&p, 60e6, 2).unwrap();
    assert!(label.starts_with("DRAM") && bw == 50.0, "{label} {bw}");
    assert!(super::roofline_level(&p, 5e9, 2).unwrap().1.starts_with("DRAM"));
    assert_eq!(super::roofline_level(&p, 10e3, 1).unwrap().1, "L1 (16 KiB)");
    assert!(super::roofline_level(&p, 10e3, 3).is_none(), "no figure at 3 threads");
}

use super::*;

fn spread(median: f64, min: f64, max: f64) -> Spread {
    Spread { median, min, max }
}

#[test]
fn regression_needs_disjoint_ranges_and_a_drop_beyond_the_noise() {
    // 10% slower, ranges apart, spreads of 2%: a regression.
    assert!(is_regression(&spread(1000.0, 990.0, 1010.0), &spread(900.0, 890.0, 910.0)));
    // Same drop but the earlier run spread over 30%: within its noise.
    assert!(!is_regression(&spread(1000.0, 800.0, 1100.0), &spread(900.0, 890.0, 910.0)));
    // Ranges overlap: not a regression.
    assert!(!is_regression(&spread(1000.0, 900.0, 1010.0), &spread(950.0, 940.0, 960.0)));
    // 2% slower with tight ranges: below the 3% floor.
    assert!(!is_regression(&spread(1000.0, 999.0, 1001.0), &spread(980.0, 979.0, 981.0)));
    // Ten times slower while one earlier run was an outlier at 4x its median (seen on a
    // loaded 2-core machine): the outlier widens no gap, so the slowdown is still called.
    assert!(is_regression(&spread(2545.0, 2432.0, 11347.0), &spread(281.0, 256.0, 283.0)));
    // Ranges apart, but the earlier runs fell 7% below their median (noise 14%): a 10% drop
    // is within it.
    assert!(!is_regression(&spread(1000.0, 930.0, 1010.0), &spread(900.0, 890.0, 910.0)));
    // Thirty times slower on a loaded 2-core machine where the earlier build's runs fell to
    // a third of their median (CI, 2026-12-05: before 9268 tok/s, min 2848; now 304, max
    // 306): a spread of 3.3x hides a 3x drop, not a 30x one.
    assert!(is_regression(&spread(9268.0, 2848.0, 16695.0), &spread(304.0, 299.0, 306.0)));
    assert!(!is_regression(&spread(9268.0, 2848.0, 16695.0), &spread(2800.0, 2700.0, 2840.0)));
    // Faster is never a regression.
    assert!(!is_regression(&spread(1000.0, 990.0, 1010.0), &spread(1200.0, 1190.0, 1210.0)));
}

/// The device figures a CUDA engine's reply carries are judged against platform.cuda-sm90's
/// datasheet figures (H200: 4,800 GB/s HBM; L2 50 MiB): 2 GB of weights per token put the
/// roofline at 4800e9 / 2e9 = 2,400 tok/s, so 2,600 tok/s decode (beyond 5 %) fails as invalid
/// and 2,500 does not; a copy faster than the HBM figure (beyond 5 %) says the contract is wrong;
/// a device model the contract lacks is named, with its copy bandwidth as the roofline.
#[test]
fn device_figures_fail_a_decode_above_the_hbm_roofline() {
    let ckb = ckb::Ckb::embedded().unwrap();
    let gpu = ckb.get("platform.cuda-sm90").unwrap().platform.as_ref().unwrap().gpu.clone().unwrap();
    let info = |name: &str, copy_gbs: f64| harness::protocol::DeviceInfo {
        name: name.into(),
        compute_capability: "9.0".into(),
        memory_bytes: 141 << 30,
        copy_gbs,
    };
    let judge = |name: &str, copy_gbs: f64, decode_max: f64| {
        let mut report = ProfileReport {
            decode_tok_s: spread(decode_max * 0.9, decode_max * 0.8, decode_max),
            ..Default::default()
        };
        let problems =
            spec::judge_device(&mut report, &info(name, copy_gbs), &gpu, "platform.cuda-sm90", 2e9, 1_000_000_000);
        (report, problems)
    };
    let (r, problems) = judge("NVIDIA H200", 4250.0, 2600.0);
    assert_eq!(r.roofline_decode_tok_s, 2400.0);
    assert!(problems.len() == 1 && problems[0].contains("above the HBM roofline of 2400 tok/s"), "{problems:?}");
    let d = r.device.unwrap();
    assert_eq!((d.hbm_gbs, d.decode_fraction), (4800.0, 2600.0 * 0.9 / 2400.0));
    // bf16 tensor cores, 989 TFLOP/s dense: 989e12 / (2 x 1e9) tok/s.
    assert_eq!(r.compute_bound_tok_s, 989e12 / 2e9);
    let (_, problems) = judge("NVIDIA H200", 4250.0, 2500.0);
    assert!(problems.is_empty(), "{problems:?}");
    let (_, problems) = judge("NVIDIA H200", 5100.0, 1000.0);
    assert!(problems.len() == 1 && problems[0].contains("exceeds the platform contract's 4800 GB/s"), "{problems:?}");
    let (r, problems) = judge("NVIDIA B200", 7000.0, 1000.0);
    assert!(problems.is_empty() && r.roofline_decode_tok_s == 3500.0, "{problems:?}");
    assert!(r.figures_from.contains("not among the contract's device models (H200, H100)"), "{}", r.figures_from);
}

/// A majority of the runs, distinct, ascending, each a run: n / 2 + 1 of n.
#[test]
fn a_majority_of_runs_is_checked() {
    assert!(spec::majority(0).is_empty());
    for (n, k) in [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (100, 51)] {
        let m = spec::majority(n);
        assert_eq!(m.len(), k, "{n}");
        assert!(m.windows(2).all(|w| w[0] < w[1]) && m.iter().all(|&i| i < n), "{m:?}");
    }
    // Drawn afresh: over 50 draws of 3 of 5, more than one set comes up.
    let sets: std::collections::BTreeSet<Vec<usize>> = (0..50).map(|_| spec::majority(5)).collect();
    assert!(sets.len() > 1);
}

/// A reply's timings are taken only when each list holds one per run and every value is a finite
/// number of seconds above 0: a NaN decode time would pass every bound it is compared with.
#[test]
fn timings_must_be_one_per_run_finite_and_positive() {
    use harness::protocol::{PrefillTimes, ProfileTimings, TimedRun};
    let run = TimedRun { prompt: vec![1, 2], tokens: vec![3, 4] };
    let good = ProfileTimings {
        load_s: 0.1,
        prefill_s: vec![0.01, 0.02],
        decode_s_per_token: vec![0.001, 0.002],
        first_token_s: vec![0.01, 0.02],
        prefill_by_len: vec![PrefillTimes { len: 2, seconds: vec![0.01, 0.01], tokens: vec![5, 5] }],
        peak_rss_kb: 0,
        runs: vec![run.clone(), run],
        device: None,
        points: vec![],
        traced_s_per_token: vec![],
        points_error: None,
        traced_runs: vec![],
    };
    assert_eq!(spec::timings_problem(&good, 2), None);
    assert!(spec::timings_problem(&good, 3).unwrap().contains("for the 3 runs asked for"));
    let mut nan = good.clone();
    nan.decode_s_per_token[1] = f64::NAN;
    assert_eq!(
        spec::timings_problem(&nan, 2).unwrap(),
        "the reply's decode timing 1 is NaN seconds: a timing is a finite number above 0"
    );
    let mut zero = good.clone();
    zero.prefill_by_len[0].seconds[0] = 0.0;
    assert!(
        spec::timings_problem(&zero, 2).unwrap().starts_with("the reply's prefill-by-length timing 0 is 0 seconds")
    );
    let mut inf = good;
    inf.first_token_s[0] = f64::INFINITY;
    assert!(spec::timings_problem(&inf, 2).unwrap().contains("first-token timing 0 is inf"));
}
