//! profile_engine as a gate spec: the profile and per-kernel timing commands, and their judgement
//! (spreads, the device's roofline, the timed runs against the reference, kernels and points).

use super::previous::{Rerun, compare_with_previous, keep_harness, previous_profile};
use super::{DeviceFigures, MachineLoad, PrefillAt, ProfileReport, Spread, load_average, roofline};
use crate::checkpoint::Checkpoint;
use crate::gate::{Commands, Gate, Harness, Promotion, Spec, Verdict as GateVerdict};
use base::error::Result;
use harness::Called;
use harness::protocol::{Command, Reply, TimeItem};
use ledger::figures::{Figures, ProfileFigures};

/// profile_engine as a [`Spec`]: the checkpoint, the figures the roofline comes from, the kernel
/// calls of one decode step, and the report as far as it is known before the engine runs.
pub(super) struct ProfileSpec<'c> {
    pub(super) ck: &'c Checkpoint,
    pub(super) fam: &'c ckb::ModelFamily,
    pub(super) report: ProfileReport,
    pub(super) threads_env: Vec<(&'static str, String)>,
    pub(super) calls: Vec<roofline::Call>,
    /// Parameters one decoded token reads (the idle experts left out).
    pub(super) active: usize,
    pub(super) kv_len: usize,
    pub(super) bytes_per_token: f64,
    pub(super) probe: Option<probe::MachineProbe>,
    pub(super) platform: Option<&'c ckb::Platform>,
    pub(super) gpu: Option<&'c ckb::Gpu>,
    pub(super) bandwidth: f64,
    pub(super) peak: f64,
    pub(super) verified: bool,
    /// The load average just before the exchange.
    pub(super) load_before: Option<f64>,
    /// The seed the timed prompts are drawn from ([`harness::protocol::profile_prompt`]).
    pub(super) seed: u64,
}

impl Spec for ProfileSpec<'_> {
    type Report = ProfileReport;

    fn unjudged(&self, gate: &Gate, why: String) -> ProfileReport {
        ProfileReport { error: why, rules: gate.findings.clone(), ..self.report.clone() }
    }

    fn commands(&mut self, _gate: &Gate, _h: &Harness) -> Result<Commands> {
        let r = &self.report;
        let command = Command::Profile {
            model: self.ck.path().to_path_buf(),
            prompt_len: r.prompt_len,
            new_tokens: r.new_tokens,
            runs: r.runs,
            seed: self.seed,
        };
        let items: Vec<TimeItem> = self
            .calls
            .iter()
            .map(|c| TimeItem {
                kernel: c.kernel.clone(),
                dims: c.dims.clone(),
                copies: c.copies,
                iters: roofline::iters_for(c),
            })
            .collect();
        self.load_before = load_average();
        Ok(vec![
            (command, self.threads_env.clone()),
            (Command::Time { reps: r.runs.max(3), items }, self.threads_env.clone()),
        ])
    }

    fn model(&self) -> Option<&base::beneath::HeldDir> {
        Some(&self.ck.held)
    }

    fn promotions(report: &mut ProfileReport) -> Option<&mut Vec<Promotion>> {
        Some(&mut report.promotions)
    }

    fn judge(&mut self, gate: &Gate, h: &Harness, called: Vec<Called>) -> Result<GateVerdict<ProfileReport>> {
        let ctx = gate.ctx;
        let (ck, fam, target) = (self.ck, self.fam, &gate.target);
        let cfg = &ck.cfg;
        let model_dir = ck.path().to_path_buf();
        let (calls, kv_len, bytes_per_token) = (&self.calls, self.kv_len, self.bytes_per_token);
        let (probe, platform, gpu) = (&self.probe, self.platform, self.gpu);
        let (bandwidth, peak, verified) = (self.bandwidth, self.peak, self.verified);
        let threads_env = &self.threads_env;
        let mut report =
            ProfileReport { rules: gate.findings.clone(), attestation: gate.attestation_note(), ..self.report.clone() };
        let (threads, prompt_len, new_tokens) = (report.threads, report.prompt_len, report.new_tokens);
        report.machine_load = self.load_before.zip(load_average()).map(|(before, after)| MachineLoad {
            before,
            after,
            cores: probe::cores(),
        });
        let grant = ck.held.grant();
        let mut called = called.into_iter();
        let profile_called = called.next().expect("the first command always has a result");
        let t = match profile_called.ok("engine's profile", 2000) {
            Ok(Reply::Profile(t)) => t,
            other => {
                report.error = match other {
                    Err(why) => why,
                    Ok(r) => format!("the harness answered the profile with an unexpected reply: {r:?}"),
                };
                let figures = Figures::Profile(ProfileFigures { gate: gate.common(), ..Default::default() });
                return Ok(GateVerdict { report, figures });
            }
        };
        let prefill: Vec<f64> = t.prefill_s.iter().map(|s| prompt_len as f64 / s).collect();
        let decode: Vec<f64> = t.decode_s_per_token.iter().map(|s| 1.0 / s).collect();
        let first: Vec<f64> = t.first_token_s.iter().map(|s| s * 1e3).collect();
        report.prefill_tok_s = Spread::of(&prefill);
        report.decode_tok_s = Spread::of(&decode);
        report.first_token_ms = Spread::of(&first);
        report.load_ms = t.load_s * 1e3;
        let mut problems = Vec::new();
        // A CUDA engine: the roofline is the device model's HBM bandwidth from the platform contract,
        // checked against the bandwidth probe the harness ran on the device.
        if let (Some(info), Some(gpu)) = (&t.device, gpu) {
            let platform = target.platform.clone().unwrap_or_default();
            problems.extend(judge_device(&mut report, info, gpu, &platform, bytes_per_token, self.active));
        }
        report.peak_rss_mb = t.peak_rss_kb as f64 / 1024.0;
        report.prefill_by_len = t
            .prefill_by_len
            .iter()
            .map(|p| PrefillAt {
                prompt_len: p.len,
                tok_s: Spread::of(&p.seconds.iter().map(|s| p.len as f64 / s).collect::<Vec<_>>()),
            })
            .collect();
        // The timed runs' outputs, replayed through the reference forward pass.
        // Consumed while building: 8 bytes per parameter at the peak, not 12 (the 1B shapes).
        let tensors = ck.tensors(&ctx.ckb, &target.dtype)?;
        let mut reference = oracle::llama::Reference::of_family(fam, cfg, tensors, &target.dtype)?;
        report.outputs_ok = true;
        // Every timed decode run: a figure is a median over runs, so one run left unchecked is one
        // an engine could fake; and each on the prompt drawn from this call's seed.
        let mut prompts_drawn = true;
        let mut short: Vec<String> = Vec::new();
        for (i, r) in t.runs.iter().enumerate() {
            let draw = [harness::protocol::PROMPT_DECODE, i as u64];
            let drawn = harness::protocol::profile_prompt(self.seed, &draw, prompt_len, cfg.vocab as u32);
            report.runs_checked += 1;
            if r.prompt != drawn {
                report.outputs_ok = false;
                prompts_drawn = false;
                continue;
            }
            // A run is timed on the decode asked for: the first token chosen after the prefill,
            // then new_tokens (within config.json's context). Fewer means a shorter context than the
            // model's, or a decode that returned fewer tokens than the harness timed it for.
            if r.tokens.len() != new_tokens + 1 {
                short.push(format!("decode run {i}: {} tokens", r.tokens.len()));
                report.outputs_ok = false;
            } else if !greedy_agrees(&mut reference, &r.prompt, &r.tokens)? {
                report.outputs_ok = false;
            }
        }
        if let Some(why) = timings_problem(&t, report.runs) {
            problems.push(why);
            report.outputs_ok = false;
        }
        if !short.is_empty() {
            problems.push(format!(
                "timed runs generated other token counts than the {} asked for (the first after the prefill, then {new_tokens}): {}; \
                 the figures are of that decode only: an engine whose context (Model::max_seq_len) is shorter than config.json's \
                 max_position_embeddings, or whose decode returns fewer tokens than asked, is not timed on it",
                new_tokens + 1,
                short.join(", ")
            ));
        } else if !prompts_drawn {
            problems.push(format!(
                "the timed runs' prompts are not the ones drawn from seed {} (the harness draws them; an engine \
                 that reports another vocab_size than config.json's {} draws others)",
                self.seed, cfg.vocab
            ));
        } else if report.runs_checked < report.runs || !report.outputs_ok {
            problems.push("the timed runs did not generate the reference's greedy tokens: the engine computes something else when timed".to_string());
        }
        // The prefill-by-length and traced runs: a majority of each group, drawn now. These replay
        // up to 2.75 times the decode runs' positions, so not all of them; a majority keeps every
        // median honest (see `majority`).
        let mut wrong: Vec<String> = Vec::new();
        let lens = [prompt_len / 4, prompt_len / 2, prompt_len];
        let lens: Vec<usize> =
            lens.iter().enumerate().filter(|&(i, &l)| l > 0 && !lens[..i].contains(&l)).map(|(_, &l)| l).collect();
        let timed_lens: Vec<usize> = t.prefill_by_len.iter().map(|p| p.len).collect();
        if timed_lens != lens {
            wrong.push(format!("prefill by length timed at {timed_lens:?}, not {lens:?}"));
        }
        for p in &t.prefill_by_len {
            if p.tokens.len() != p.seconds.len() || p.seconds.len() != report.runs {
                wrong.push(format!(
                    "{} prefill runs of {} tokens with {} tokens, not {}",
                    p.seconds.len(),
                    p.len,
                    p.tokens.len(),
                    report.runs
                ));
                continue;
            }
            for run in majority(p.tokens.len()) {
                let draw = [harness::protocol::PROMPT_PREFILL, run as u64, p.len as u64];
                let prompt = harness::protocol::profile_prompt(self.seed, &draw, p.len, cfg.vocab as u32);
                report.prefill_runs_checked += 1;
                if !greedy_agrees(&mut reference, &prompt, &p.tokens[run..=run])? {
                    wrong.push(format!("prefill run {run} of {} tokens chose token {}", p.len, p.tokens[run]));
                }
            }
        }
        // An engine with a traced forward that ran (points reported) returns each traced run's tokens.
        if !t.points.is_empty() && t.points_error.is_none() {
            if t.traced_runs.len() != report.runs || t.traced_s_per_token.len() != report.runs {
                wrong.push(format!(
                    "{} traced runs' tokens and {} timings, not {}",
                    t.traced_runs.len(),
                    t.traced_s_per_token.len(),
                    report.runs
                ));
            } else {
                let lens: Vec<usize> = t.traced_runs.iter().map(Vec::len).collect();
                if lens.iter().any(|&l| l != new_tokens + 1) {
                    wrong.push(format!("traced runs of {lens:?} tokens, not {} each", new_tokens + 1));
                }
                for run in majority(t.traced_runs.len()) {
                    let draw = [harness::protocol::PROMPT_TRACED, run as u64];
                    let prompt = harness::protocol::profile_prompt(self.seed, &draw, prompt_len, cfg.vocab as u32);
                    report.traced_runs_checked += 1;
                    if !greedy_agrees(&mut reference, &prompt, &t.traced_runs[run])? {
                        wrong.push(format!("traced run {run} generated other tokens than the reference's"));
                    }
                }
            }
        }
        if !wrong.is_empty() {
            report.outputs_ok = false;
            problems.push(format!(
                "the prefill-by-length or traced runs did not generate the reference's greedy tokens ({}): their timings are not of the real forward",
                wrong.join("; ")
            ));
        }
        let compute_bound = report.compute_bound_tok_s;
        if report.decode_tok_s.max > compute_bound || report.prefill_tok_s.max > compute_bound * 16.0 {
            problems.push(format!(
                "measured {:.0} tok/s decode is above the compute bound of {compute_bound:.0} tok/s: invalid, not fast",
                report.decode_tok_s.max
            ));
        }
        if !verified {
            problems.push(
                "phase order: verify_generation has not passed on these exact sources; figures are unverified".into(),
            );
        }
        let peak_t = probe
            .as_ref()
            .and_then(|p| p.median("peak", threads))
            .or_else(|| platform.and_then(|p| p.peak_gflops_f32.get(&threads.to_string()).copied()))
            .unwrap_or(peak);
        // Kernels and points read from the level the whole model's weights fit in (the probe's
        // working sets: 256 KiB, 4 MiB, else DRAM); without a probe, the DRAM figure.
        let level = if bytes_per_token <= (256 << 10) as f64 {
            "read L2"
        } else if bytes_per_token <= (4 << 20) as f64 {
            "read L3"
        } else {
            "read DRAM"
        };
        let bw_kernels = probe.as_ref().and_then(|p| p.median(level, threads)).unwrap_or(bandwidth);
        // On a CUDA device: its HBM bandwidth (or the probe's) and the f32 peak in GFLOP/s.
        let (bw_kernels, peak_t) = match (&report.device, gpu) {
            (Some(d), Some(gpu)) => (
                if d.hbm_gbs > 0.0 { d.hbm_gbs } else { d.copy_gbs },
                gpu.peak_tflops.get("f32").map(|f| f.value * 1e3).unwrap_or(peak_t),
            ),
            _ => (bw_kernels, peak_t),
        };
        // The platform's guidance for a kernel (or for the kernel it is a variant of).
        let guidance_for = |k: &str| -> Vec<String> {
            let of = ctx.ckb.get(k).ok().and_then(|c| c.variant.as_ref()).map(|v| v.of.clone());
            platform
                .map(|p| &p.kernel_guidance)
                .and_then(|g| g.get(k).or_else(|| of.as_ref().and_then(|o| g.get(o))))
                .cloned()
                .unwrap_or_default()
        };
        let timed = match called.next() {
            Some(c) => c.ok("per-kernel timing", 1000),
            None => Err("the per-kernel timing did not run".to_string()),
        };
        match timed {
            Ok(Reply::Time { items }) => {
                let seconds: Vec<Vec<f64>> = items.into_iter().map(|i| i.seconds_per_call).collect();
                if seconds.len() == calls.len() {
                    report.kernels = roofline::analyse(calls, &seconds, bw_kernels, peak_t);
                    let per_token: f64 =
                        calls.iter().zip(&seconds).map(|(c, s)| Spread::of(s).median * c.per_token as f64).sum();
                    if report.decode_tok_s.median > 0.0 {
                        report.kernel_time_fraction = per_token * report.decode_tok_s.median;
                    }
                    if let Some((k, share)) = roofline::bounding_kernel(&report.kernels) {
                        report.guidance = guidance_for(&k);
                        report.bounding_kernel = k;
                        report.bounding_share = share;
                    }
                }
            }
            Ok(other) => problems.push(format!("the per-kernel timing answered with an unexpected reply: {other:?}")),
            Err(why) => problems.push(why),
        }
        // The real forward, point by point: its shares are of the traced decode time, so they add up
        // to at most all of it, and the bounding kernel is the one the forward spends most in.
        match (&fam.graph, t.points.is_empty(), &t.points_error) {
            (_, _, Some(why)) => report.points_note = format!("no per-point timing: {why}"),
            (_, true, None) => {
                report.points_note = "no per-point timing: the engine has no Model::forward_traced (its family contract's rust skeleton); the kernels below are timed alone, outside the forward, so their shares need not add up to the decode time".into()
            }
            (None, false, None) => report.points_note = "no per-point costs: the family contract has no [model.graph]".into(),
            (Some(graph), false, None) => {
                let costs = roofline::point_costs(graph, fam, cfg, &target.dtype, kv_len);
                report.points = roofline::analyse_points(&t.points, &t.traced_s_per_token, &costs, bw_kernels, peak_t);
                let traced = Spread::of(&t.traced_s_per_token).median;
                if traced > 0.0 {
                    report.traced_decode_tok_s = 1.0 / traced;
                }
                if let Some((k, share)) = roofline::bounding_kernel_of_points(&report.points) {
                    if k != report.bounding_kernel {
                        report.guidance = guidance_for(&k);
                    }
                    report.bounding_kernel = k;
                    report.bounding_share = share;
                }
            }
        }
        let checked = t.runs.first().map(|r| r.tokens.as_slice()).filter(|_| report.outputs_ok);
        report.previous = previous_profile(ctx, &gate.engine, &model_dir, &report).map(|(mut prev, hash)| {
            let reads = grant.paths();
            let rerun = Rerun {
                model_dir: &model_dir,
                prompt_len,
                new_tokens,
                reads: &reads,
                env: threads_env,
                seed: self.seed,
                checked,
            };
            let prompt0 = harness::protocol::profile_prompt(
                self.seed,
                &[harness::protocol::PROMPT_DECODE, 0],
                prompt_len,
                cfg.vocab as u32,
            );
            let mut agrees = |tokens: &[u32]| {
                tokens.len() == new_tokens + 1 && greedy_agrees(&mut reference, &prompt0, tokens).unwrap_or(false)
            };
            problems.extend(compare_with_previous(gate, h, &hash, &rerun, &mut prev, &mut agrees));
            prev
        });
        if !decode.is_empty() && problems.is_empty() && matches!(gate.mode, crate::gate::Mode::Direct) {
            keep_harness(ctx, &gate.engine, &h.exe);
        }
        report.error = problems.join("; ");
        report.passed = !decode.is_empty() && problems.is_empty();
        let figures = ProfileFigures {
            gate: gate.common(),
            model: model_dir.display().to_string(),
            threads,
            prompt_len,
            new_tokens,
            bytes_per_token,
            decode: report.decode_tok_s,
            decode_tok_s: report.decode_tok_s.median,
            prefill_tok_s: report.prefill_tok_s.median,
            roofline_decode_tok_s: report.roofline_decode_tok_s,
            compute_bound_tok_s: report.compute_bound_tok_s,
            bounding_kernel: report.bounding_kernel.clone(),
            regression: report.previous.as_ref().is_some_and(|p| p.regression),
            outputs_ok: report.outputs_ok,
            verified,
        };
        Ok(GateVerdict { report, figures: Figures::Profile(figures) })
    }
}

/// Whether `got`, an engine's greedy tokens after `prompt`, are greedy choices of the reference,
/// a near-tie within [`oracle::GREEDY_TIE`] going either way
/// (`oracle::llama::Reference::greedy_agrees`).
///
/// # Errors
/// As `Reference::greedy_agrees`.
pub(super) fn greedy_agrees(reference: &mut oracle::llama::Reference, prompt: &[u32], got: &[u32]) -> Result<bool> {
    reference.greedy_agrees(prompt, got, oracle::GREEDY_TIE)
}

/// Which of `n` timed runs the server replays: a majority, n / 2 + 1 of them, drawn afresh from
/// the operating system's randomness when the reply is judged (the engine cannot know which),
/// ascending. A median over the runs is then an honest run's figure, or a faked run is among those
/// checked: moving the median past every honest run takes at least n / 2 faked runs (n odd: more
/// than half), which leaves fewer honest runs than the n / 2 + 1 checked.
pub(super) fn majority(n: usize) -> Vec<usize> {
    if n == 0 {
        return vec![];
    }
    let mut picked = rand::seq::index::sample(&mut rand::rng(), n, n / 2 + 1).into_vec();
    picked.sort_unstable();
    picked
}

/// A CUDA engine's device figures from its reply: the roofline at the device model's HBM bandwidth
/// (`platform.gpu.devices` of the engine's platform contract, else the measured copy bandwidth),
/// the compute bound at the device's largest peak, and [`super::DeviceFigures`], written into
/// `report` (a device model the contract lacks is named in `figures_from`); returns the problems,
/// each a reason the profile fails: a measured copy bandwidth above the contract's HBM figure (more
/// than 5 %), or a decode speed above the roofline (more than 5 %) while the weights read per
/// token exceed the L2 cache (`platform.gpu.l2_mib`).
pub(super) fn judge_device(
    report: &mut ProfileReport,
    info: &harness::protocol::DeviceInfo,
    gpu: &ckb::Gpu,
    platform: &str,
    bytes_per_token: f64,
    active: usize,
) -> Vec<String> {
    let mut problems = Vec::new();
    let hbm = gpu.device(&info.name).map(|d| d.hbm_gbs.value).unwrap_or(0.0);
    let bw = if hbm > 0.0 { hbm } else { info.copy_gbs };
    if bw > 0.0 {
        report.roofline_decode_tok_s = bw * 1e9 / bytes_per_token;
    }
    // The compute bound must never understate: the largest peak the device has (tensor cores).
    if let Some(peak) = gpu.peak_tflops.values().map(|f| f.value).reduce(f64::max) {
        report.compute_bound_tok_s = peak * 1e12 / (2.0 * active as f64);
    }
    if hbm == 0.0 {
        // Still a bound (a copy reaches at most the HBM bandwidth), so the figures stand.
        report.figures_from = format!(
            "{platform} (device {}, compute capability {}): the device is not among the contract's device models ({}), so the roofline is its measured copy bandwidth {:.0} GB/s; add the model to platform.gpu.devices",
            info.name,
            info.compute_capability,
            gpu.devices.iter().map(|d| d.name.as_str()).collect::<Vec<_>>().join(", "),
            info.copy_gbs
        );
    } else {
        report.figures_from = format!(
            "{platform} (device {}, compute capability {}): HBM {hbm:.0} GB/s from the contract, {:.0} GB/s measured by a device-to-device copy",
            info.name, info.compute_capability, info.copy_gbs
        );
        if info.copy_gbs > 1.05 * hbm {
            problems.push(format!(
                "the device's measured copy bandwidth {:.0} GB/s exceeds the platform contract's {hbm:.0} GB/s: the contract's figure is wrong for {}",
                info.copy_gbs, info.name
            ));
        }
    }
    report.device = Some(DeviceFigures {
        name: info.name.clone(),
        compute_capability: info.compute_capability.clone(),
        hbm_gbs: hbm,
        copy_gbs: info.copy_gbs,
        probe_fraction: if hbm > 0.0 { info.copy_gbs / hbm } else { 0.0 },
        decode_fraction: if report.roofline_decode_tok_s > 0.0 {
            report.decode_tok_s.median / report.roofline_decode_tok_s
        } else {
            0.0
        },
    });
    // Weights beyond the L2 stream from HBM: a decode speed above the roofline is invalid.
    if bw > 0.0
        && bytes_per_token > gpu.l2_mib.value * (1 << 20) as f64
        && report.decode_tok_s.max > 1.05 * report.roofline_decode_tok_s
    {
        problems.push(format!(
            "measured {:.0} tok/s decode is above the HBM roofline of {:.0} tok/s for {:.0} MB of weights per token: invalid, not fast",
            report.decode_tok_s.max,
            report.roofline_decode_tok_s,
            bytes_per_token / 1e6
        ));
    }
    problems
}

/// Why the timings of a profile reply `t` for `runs` runs cannot be taken, if they cannot: every
/// timing a median is taken over must be one of the runs checked (as many decode, prefill and
/// first-token timings as timed runs' tokens, as runs asked for), and every timing a finite number
/// of seconds above 0 (a NaN compares false with every bound, so it would pass them all).
pub(super) fn timings_problem(t: &harness::protocol::ProfileTimings, runs: usize) -> Option<String> {
    let counts = [t.runs.len(), t.decode_s_per_token.len(), t.prefill_s.len(), t.first_token_s.len()];
    if counts.iter().any(|&c| c != runs) {
        return Some(format!(
            "the reply holds {} timed runs' tokens, {} decode, {} prefill and {} first-token timings for the {runs} runs asked for",
            counts[0], counts[1], counts[2], counts[3]
        ));
    }
    let named = [
        ("decode", &t.decode_s_per_token),
        ("prefill", &t.prefill_s),
        ("first-token", &t.first_token_s),
        ("traced", &t.traced_s_per_token),
    ];
    let by_len = t.prefill_by_len.iter().map(|p| ("prefill-by-length", &p.seconds));
    named.into_iter().chain(by_len).find_map(|(what, xs)| {
        xs.iter()
            .position(|s| !(s.is_finite() && *s > 0.0))
            .map(|i| format!("the reply's {what} timing {i} is {} seconds: a timing is a finite number above 0", xs[i]))
    })
}
