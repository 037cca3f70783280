//! The comparison with the previous passing profile of an engine directory: found in the ledger,
//! its harness kept, and both builds timed alternately in this call.
//!
//! A passing profile keeps its harness executable, one per engine directory
//! (`<cache>/profiled/<engine dir key>/<source hash>`). The next profile of that directory at the same
//! settings calls a regression only from figures measured in its own call: identical sources never;
//! different sources by timing both builds alternately ([`INTERLEAVED_PAIRS`] pairs of one decode run
//! each) and judging the two spreads with [`is_regression`]; without a kept build, not at all (the
//! ledger's figure is shown).

use std::path::Path;

use super::{INTERLEAVED_PAIRS, Interleaved, PreviousProfile, ProfileReport, Spread, is_regression};
use crate::Ctx;
use crate::gate::Gate;
use harness::protocol::{Command, Reply};
use ledger::figures::Figures;

/// The newest passing profile of the same engine directory with the same model, dtype, threads and
/// lengths, compared with `now`.
pub(super) fn previous_profile(
    ctx: &Ctx,
    engine: &harness::Engine,
    model_dir: &Path,
    now: &ProfileReport,
) -> Option<(PreviousProfile, String)> {
    let ledger = ledger::Ledger::open(&ctx.ledger).ok()?;
    let dir = engine.dir.display().to_string();
    let model = model_dir.display().to_string();
    let old = ledger.list_filtered(0, 500, Some("profile_engine")).ok()?.into_iter().find_map(|o| {
        let Figures::Profile(f) = Figures::read(&o.tool, &o.figures) else { return None };
        (o.passed
            && o.engine == dir
            && f.model == model
            && f.gate.dtype == now.dtype
            && f.threads == now.threads
            && f.prompt_len == now.prompt_len
            && f.new_tokens == now.new_tokens)
            .then_some((o, f.decode))
    })?;
    let (old, before) = old;
    let change_pct = if before.median > 0.0 { 100.0 * (now.decode_tok_s.median / before.median - 1.0) } else { 0.0 };
    let hash = old.engine_hash.clone();
    Some((
        PreviousProfile {
            outcome: old.id,
            time: old.time,
            regression: false,
            decode_tok_s: before,
            change_pct,
            same_sources: hash == engine.hash,
            interleaved: None,
            note: String::new(),
        },
        hash,
    ))
}

/// Where the harness of an engine directory's last passing profile is kept, by source hash:
/// `<cache>/profiled/<engine key>/<source hash>`.
fn kept_dir(ctx: &Ctx, engine: &harness::Engine) -> std::path::PathBuf {
    let key = base::util::fnv1a(&engine.dir.display().to_string());
    ctx.workshop.root.join("profiled").join(format!("{key:016x}"))
}

/// Keep the harness of a passing profile for the next call's interleaved comparison: one build per
/// engine directory (the newest), copied, so later builds of the directory do not replace it.
/// Best effort: a copy that fails only costs the next comparison.
pub(super) fn keep_harness(ctx: &Ctx, engine: &harness::Engine, exe: &Path) {
    let dir = kept_dir(ctx, engine);
    let staged = dir.with_extension(format!("new-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staged);
    let ok = std::fs::create_dir_all(&staged).is_ok() && std::fs::copy(exe, staged.join(&engine.hash)).is_ok();
    if ok {
        let _ = std::fs::remove_dir_all(&dir);
        if std::fs::rename(&staged, &dir).is_ok() {
            return;
        }
    }
    let _ = std::fs::remove_dir_all(&staged);
}

/// What an interleaved decode run needs: the profile's model, lengths, reads and environment.
pub(super) struct Rerun<'a> {
    pub(super) model_dir: &'a Path,
    pub(super) prompt_len: usize,
    pub(super) new_tokens: usize,
    pub(super) reads: &'a [&'a Path],
    pub(super) env: &'a [(&'a str, String)],
    pub(super) seed: u64,
    /// The tokens of the profile's timed decode run 0, checked equal to the reference's: every
    /// interleaved run (the same prompt, drawn from the same seed) must generate them. None when
    /// they were not (the profile fails then, and nothing is compared).
    pub(super) checked: Option<&'a [u32]>,
}

/// Compare with the previous passing profile in this call: identical sources are never a
/// regression; otherwise, when the previous build's harness was kept, both builds decode
/// alternately ([`INTERLEAVED_PAIRS`] pairs, one run each) and [`is_regression`] judges the two
/// spreads measured here. Without a kept build no regression is called. Every interleaved run's
/// tokens are the checked run's ([`Rerun::checked`]) or, where they differ (a near-tie gone the
/// other way), greedy choices of the reference (`agrees`, run 0's prompt): returns the problem
/// when this build's are neither (it computes something else when rerun, and the profile fails);
/// the previous build's leave the comparison out.
pub(super) fn compare_with_previous(
    gate: &Gate<'_>,
    h: &crate::gate::Harness,
    hash: &str,
    rerun: &Rerun<'_>,
    prev: &mut PreviousProfile,
    agrees: &mut dyn FnMut(&[u32]) -> bool,
) -> Option<String> {
    if prev.same_sources {
        prev.note =
            "same sources as the previous profile: the change is the machine's noise between calls, not a regression"
                .into();
        return None;
    }
    let Some(checked) = rerun.checked else {
        prev.note = "no comparison: the timed runs' tokens were not all the reference's".into();
        return None;
    };
    let old = kept_dir(gate.ctx, &gate.engine).join(hash);
    if !old.is_file() || !matches!(gate.mode, crate::gate::Mode::Direct) {
        prev.note = "the previous build is not kept here, so both cannot be timed in this call; figures from different calls differ by the machine's noise, so no regression is called".into();
        return None;
    }
    let mut now = Vec::new();
    let mut before = Vec::new();
    for _ in 0..INTERLEAVED_PAIRS {
        for (this, exe, out) in [(true, h.exe.as_path(), &mut now), (false, old.as_path(), &mut before)] {
            let command = Command::Profile {
                model: rerun.model_dir.to_path_buf(),
                prompt_len: rerun.prompt_len,
                new_tokens: rerun.new_tokens,
                runs: 1,
                seed: rerun.seed,
            };
            match gate.call_exe(h, exe, command, rerun.env, rerun.reads).map(|c| c.ok("interleaved profile", 500)) {
                Ok(Ok(Reply::Profile(t)))
                    if t.runs.first().is_some_and(|r| r.tokens == checked || agrees(&r.tokens)) =>
                {
                    out.extend(t.decode_s_per_token.iter().map(|s| 1.0 / s));
                }
                Ok(Ok(Reply::Profile(_))) => {
                    let which = if this { "this build" } else { "the previous build" };
                    prev.note = format!(
                        "no comparison: {which}'s interleaved run did not generate the tokens of the checked timed run 0"
                    );
                    return this.then(|| {
                        "this build's interleaved decode run (the regression comparison's) did not generate the tokens of its checked timed run 0 on the same prompt: the engine computes something else when rerun".to_string()
                    });
                }
                Ok(Ok(other)) => {
                    prev.note = format!("no comparison: a build answered the interleaved profile with {other:?}");
                    return None;
                }
                Ok(Err(why)) | Err(base::error::Error { message: why, .. }) => {
                    prev.note = format!("no comparison: {why}");
                    return None;
                }
            }
        }
    }
    let (now, before) = (Spread::of(&now), Spread::of(&before));
    prev.regression = is_regression(&before, &now);
    prev.change_pct = if before.median > 0.0 { 100.0 * (now.median / before.median - 1.0) } else { 0.0 };
    prev.note = format!(
        "both builds timed here, alternately ({INTERLEAVED_PAIRS} pairs): this one {:.0} tok/s (min {:.0}, max {:.0}), the previous {:.0} tok/s (min {:.0}, max {:.0})",
        now.median, now.min, now.max, before.median, before.min, before.max
    );
    prev.interleaved = Some(Interleaved { pairs: INTERLEAVED_PAIRS, now_tok_s: now, before_tok_s: before });
    None
}
