//! serve_engine's judge: the reference's greedy answers to the [`Plan`], computed here (they never
//! reach the server or a bundle), and the checks that compare what the server answered
//! ([`Observed`]) with them.

use super::checks::{NOT_OBSERVABLE, check};
use super::load::percentile;
use super::wire::{Answered, Observed, Plan, Step};
use super::{Check, LoadLevel};
use base::error::Result;

/// The reference's greedy completion of one ask, as the server must answer it.
#[derive(Debug, Clone)]
pub(super) struct Want {
    /// The text (the prompt's decoding stripped from the decoding of prompt and answer).
    pub(super) text: String,
    /// New tokens, the EOS token included when it ended the answer.
    pub(super) completion_tokens: usize,
    /// "stop" (EOS) or "length".
    pub(super) finish: &'static str,
    /// The answers a correct engine may give instead: at each step where another token's logit is
    /// within [`oracle::GREEDY_TIE`] of the greedy token's, that token followed greedily to the end
    /// (one per near-tie of this answer, at most [`MAX_NEAR_TIES`]; not their own near-ties).
    pub(super) near: Vec<Want>,
}

/// Most near-tie alternatives computed per answer: each costs the reference a run of the prompt
/// and the answer; an answer with more near-ties than this is judged on its first ones.
pub const MAX_NEAR_TIES: usize = 8;

impl Want {
    /// This answer, or else the first near-tie alternative, that `matches` (an answer's text, and
    /// where the server reports them its finish reason and token count, compared together).
    pub(super) fn accepts(&self, matches: impl Fn(&Want) -> bool) -> Option<&Want> {
        std::iter::once(self).chain(&self.near).find(|w| matches(w))
    }
}

/// The reference's answers to a plan: one per greedy ask and one per pool prompt.
#[derive(Debug, Clone)]
pub(super) struct Expected {
    pub(super) greedy: Vec<Want>,
    pub(super) pool: Vec<Want>,
    /// The burst's one-token greedy answer to the first greedy prompt.
    pub(super) burst: Want,
    /// The disconnect check's full-length answer to the first greedy prompt
    /// (`Plan::disconnect_tokens`), computed only when a run needs it ([`needs_full_answer`]).
    pub(super) disconnect: Option<Want>,
}

/// Whether `seen` holds a disconnect check that could not tell, whose full-length answer the judge
/// compares with the reference's.
pub(super) fn needs_full_answer(seen: &Observed) -> bool {
    seen.steps.iter().any(|s| matches!(s, Step::Disconnect { .. }))
}

/// The checks decided where the server runs: they compare the server's behaviour with the
/// contract (status codes, shapes, timing), not its answers with the reference. (A burst that
/// failed there is taken too; one that passed is judged here, [`Step::Burst`].)
pub(super) const DECIDED_THERE: [&str; 7] =
    ["help", "health", "models", "chat", "bad_requests", "disconnect", "keep_alive"];

/// Every check of the battery, in the order a server that answers everything goes through them.
pub(super) const BATTERY: [&str; 12] = [
    "help",
    "health",
    "models",
    "greedy",
    "streaming",
    "stop",
    "chat",
    "bad_requests",
    "burst",
    "alive",
    "disconnect",
    "keep_alive",
];

/// The checks and load levels of `seen`, judged against `want` (the reference's answers to
/// `plan`). A battery check absent from a run that reports no error fails as not recorded; a load
/// level counts as completed only the requests whose text it holds.
pub(super) fn judge(plan: &Plan, want: &Expected, seen: &Observed) -> (Vec<Check>, Vec<LoadLevel>) {
    let mut checks = Vec::new();
    let mut greedy_answers: &[std::result::Result<Answered, String>] = &[];
    let Some(w0) = want.greedy.first() else {
        return (vec![check("greedy", false, "the plan holds no greedy request")], vec![]);
    };
    for step in &seen.steps {
        checks.push(match step {
            // Decided where the server ran: only the checks that need no reference (and alive
            // when the server had died); any other is judged here, never taken from the run.
            Step::Checked { check: c }
                if (DECIDED_THERE.contains(&c.name.as_str())
                    && !(c.name == "disconnect" && c.passed && c.detail.starts_with(NOT_OBSERVABLE)))
                    || (matches!(c.name.as_str(), "alive" | "burst") && !c.passed) =>
            {
                c.clone()
            }
            Step::Disconnect { check: c, full } => disconnect(c, full, want.disconnect.as_ref()),
            Step::Burst { check: c, texts } => burst(c, texts, &want.burst),
            Step::Checked { check: c } => {
                check(&c.name, false, "recorded as decided where the server ran; only the judge here decides it")
            }
            Step::Greedy { answers } => {
                greedy_answers = answers;
                greedy(plan, want, answers)
            }
            Step::Streaming { answer } => match answer {
                Ok(s) if s.done && w0.accepts(|m| m.text == s.text && m.finish == s.finish).is_some() => check(
                    "streaming",
                    true,
                    format!("{} events, text equal to the non-streaming one, then [DONE]", s.events),
                ),
                Ok(s) => check(
                    "streaming",
                    false,
                    format!(
                        "streamed text {:?} (finish {:?}, [DONE] {}), expected {:?} ({})",
                        s.text, s.finish, s.done, w0.text, w0.finish
                    ),
                ),
                Err(why) => check("streaming", false, why.clone()),
            },
            Step::Stop { sent: None } => {
                check("stop", false, "no greedy completion is long enough to draw a stop string from")
            }
            Step::Stop { sent: Some((i, s, answer)) } => {
                // The server's own greedy answer the stop string was cut from, up to the string.
                let own = greedy_answers.get(*i).and_then(|a| a.as_ref().ok()).map(|a| a.text.as_str());
                match (own.and_then(|t| t.find(s.as_str()).map(|at| &t[..at])), answer) {
                    (None, _) => check("stop", false, format!("stop {s:?} is not in greedy answer {i}")),
                    (Some(cut), Ok(a)) if a.text == cut && a.finish == "stop" => {
                        check("stop", true, format!("stop {s:?}: text cut before it, finish_reason stop"))
                    }
                    (Some(cut), Ok(a)) => check(
                        "stop",
                        false,
                        format!("stop {s:?}: got {:?} ({}), expected {cut:?} (stop)", a.text, a.finish),
                    ),
                    (Some(_), Err(why)) => check("stop", false, format!("stop {s:?}: {why}")),
                }
            }
            Step::Alive { answer } => match answer {
                Ok(a) if w0.accepts(|m| m.text == a.text).is_some() => {
                    check("alive", true, "the server still answers greedy requests with the reference's text")
                }
                Ok(a) => {
                    check("alive", false, format!("after the bad requests: got {:?}, expected {:?}", a.text, w0.text))
                }
                Err(why) => check("alive", false, format!("after the bad requests: {why}")),
            },
        });
    }
    if seen.error.is_empty() {
        for name in BATTERY {
            if !checks.iter().any(|c| c.name == name) {
                checks.push(check(name, false, "not recorded by the run"));
            }
        }
        let planned: Vec<usize> = plan.levels.iter().map(|(c, _)| *c).collect();
        let ran: Vec<usize> = seen.levels.iter().map(|l| l.level.concurrency).collect();
        if planned != ran {
            checks.push(check(
                "load",
                false,
                format!("the plan's load levels are concurrency {planned:?}, the run recorded {ran:?}"),
            ));
        }
    }
    let levels = seen
        .levels
        .iter()
        .enumerate()
        .map(|(i, run)| {
            let picks = plan.levels.get(i).map_or(&[][..], |(_, p)| p.as_slice());
            level_figures(run, picks.len(), &want.pool)
        })
        .collect();
    (checks, levels)
}

/// One load level's figures from what the run recorded and the reference's answers: the requests
/// planned, those completed, those whose text differs from the reference's (`greedy_mismatches`),
/// and from the answers equal to the reference's alone, output tokens (the reference's token
/// counts, not the server's `usage`) and their rate over the level's wall time, TTFT (the first
/// non-empty text) and ITL (per request, the time from its first to its last text over its tokens
/// that carry text less one, so that how the server splits its text into events changes nothing;
/// none for an answer whose text came in one event), nearest-rank p50 and p99 in milliseconds.
pub(super) fn level_figures(run: &super::wire::LevelRun, planned: usize, pool: &[Want]) -> super::LoadLevel {
    let mut level = run.level.clone();
    level.requests = planned;
    level.completed = run.answers.len().min(planned);
    let (mut tokens, mut ttft, mut itl, mut mismatches) = (0, Vec::new(), Vec::new(), 0);
    for (k, (pick, text)) in run.answers.iter().enumerate() {
        let Some(w) = pool.get(*pick).and_then(|w| w.accepts(|m| m.text == *text)) else {
            mismatches += 1;
            continue;
        };
        tokens += w.completion_tokens;
        if let Some(&(first, last)) = run.spans_ms.get(k) {
            ttft.push(first);
            // The tokens that carry text (an EOS that ended the answer has none); an answer whose
            // text came in one event has no gap to measure.
            let texts = w.completion_tokens - usize::from(w.finish == "stop");
            if texts > 1 && last > first {
                itl.push((last - first) / (texts - 1) as f64);
            }
        }
    }
    if run.spans_ms.len() != run.answers.len() && level.errors.len() < 4 {
        level.errors.push(format!(
            "the run recorded {} answers and {} arrival times: TTFT and ITL are of those it has",
            run.answers.len(),
            run.spans_ms.len()
        ));
    }
    level.greedy_mismatches = mismatches;
    level.output_tokens = tokens;
    level.output_tokens_per_s = tokens as f64 / level.seconds.max(1e-9);
    level.ttft_ms_p50 = percentile(&mut ttft, 50.0);
    level.ttft_ms_p99 = percentile(&mut ttft, 99.0);
    level.itl_ms_p50 = percentile(&mut itl, 50.0);
    level.itl_ms_p99 = percentile(&mut itl, 99.0);
    level
}

/// The disconnect check that could not tell: what the run decided, taken only when the full-length
/// request's answer `full` is the reference's `want` (text, token count and finish reason).
fn disconnect(c: &Check, full: &Answered, want: Option<&Want>) -> Check {
    match want {
        Some(w)
            if c.name == "disconnect"
                && c.passed
                && w.accepts(|m| {
                    m.text == full.text && m.finish == full.finish && m.completion_tokens == full.completion_tokens
                })
                .is_some() =>
        {
            c.clone()
        }
        Some(w) => check(
            "disconnect",
            false,
            format!(
                "{}; but the full-length request was answered {:?} ({} tokens, {}), the reference {:?} ({} tokens, {})",
                c.detail, full.text, full.completion_tokens, full.finish, w.text, w.completion_tokens, w.finish
            ),
        ),
        None => check("disconnect", false, "the reference's full-length answer was not computed"),
    }
}

/// The burst check: what the run decided (each request answered or refused with a 4xx, none
/// lost), and every completed answer's text the reference's one-token greedy answer `want`.
fn burst(c: &Check, texts: &[(String, usize)], want: &Want) -> Check {
    if !c.passed || c.name != "burst" {
        return check("burst", false, c.detail.clone());
    }
    let accepted = |t: &str| {
        std::iter::once(want).chain(&want.near).any(|w| {
            // A first token that is part of a character decodes alone to U+FFFD: a server may send
            // that, or hold the bytes back and send less (a prefix of it, "" included).
            t == w.text || (w.text.contains('\u{FFFD}') && w.text.starts_with(t))
        })
    };
    let wrong: Vec<String> =
        texts.iter().filter(|(t, _)| !accepted(t)).map(|(t, n)| format!("{n} answered {t:?}")).collect();
    if wrong.is_empty() && !texts.is_empty() {
        check("burst", true, format!("{}; every completion is the reference's {:?}", c.detail, want.text))
    } else if texts.is_empty() {
        check("burst", false, format!("{}; no completion's text was recorded", c.detail))
    } else {
        check(
            "burst",
            false,
            format!(
                "{}; completions differ from the reference's one-token answer {:?}: {}",
                c.detail,
                want.text,
                wrong.iter().take(4).cloned().collect::<Vec<_>>().join(", ")
            ),
        )
    }
}

/// The greedy check: every answer equals the reference's text, token count and finish reason.
fn greedy(plan: &Plan, want: &Expected, answers: &[std::result::Result<Answered, String>]) -> Check {
    let (mut bad, mut other_side) = (Vec::new(), 0);
    for (i, (ask, w)) in plan.greedy.iter().zip(&want.greedy).enumerate() {
        let same = |a: &Answered| {
            w.accepts(|m| m.text == a.text && m.finish == a.finish && m.completion_tokens == a.completion_tokens)
                .map(|m| !std::ptr::eq(m, w))
        };
        match answers.get(i) {
            Some(Ok(a)) if same(a).is_some() => other_side += usize::from(same(a) == Some(true)),
            Some(Ok(a)) => bad.push(format!(
                "prompt {:?}, max_tokens {}: got {:?} ({} tokens, {}), the reference {:?} ({} tokens, {})",
                ask.prompt,
                ask.max_tokens,
                a.text,
                a.completion_tokens,
                a.finish,
                w.text,
                w.completion_tokens,
                w.finish
            )),
            Some(Err(why)) => bad.push(format!("prompt {:?}: {why}", ask.prompt)),
            None => bad.push(format!("prompt {:?}: no answer recorded", ask.prompt)),
        }
    }
    let eos_seen = want.greedy.iter().filter(|w| w.finish == "stop").count();
    if bad.is_empty() {
        let ties = if other_side > 0 {
            format!(
                "; {other_side} took the other side of a near-tie (within {} of the greedy logit)",
                oracle::GREEDY_TIE
            )
        } else {
            String::new()
        };
        check(
            "greedy",
            true,
            format!(
                "{} greedy completions equal the reference's text, token count and finish reason ({eos_seen} ended on EOS){ties}",
                want.greedy.len()
            ),
        )
    } else {
        check("greedy", false, format!("greedy completion differs from the reference: {}", bad.join("; ")))
    }
}

/// The reference's answers to `plan` (with `full_answer`, the disconnect check's too), each with
/// its near-tie alternatives ([`Want::near`]): `greedy(ids, n)` gives the reference's logits rows
/// and its greedy tokens after the ids, `n` at most, ending after the first of `eos` if one comes
/// (as `Reference::greedy_until`); `encode` and `decode` are the model's tokenizer.
///
/// # Errors
/// When the reference or the tokenizer fails.
pub(super) fn expected(
    plan: &Plan,
    eos: &[u32],
    encode: impl Fn(&str) -> Result<Vec<u32>>,
    decode: impl Fn(&[u32]) -> Result<String>,
    mut greedy: impl FnMut(&[u32], usize) -> Result<(Vec<Vec<f64>>, Vec<u32>)>,
    full_answer: bool,
) -> Result<Expected> {
    // The answer `toks` (cut after its first EOS) to the prompt `ids` of `n` new tokens at most.
    let answer = |ids: &[u32], toks: &[u32], n: usize| -> Result<Want> {
        let cut = toks.iter().position(|t| eos.contains(t)).map_or(toks.len(), |i| i + 1);
        let toks = &toks[..cut];
        let finish = if cut < n || toks.last().is_some_and(|t| eos.contains(t)) { "stop" } else { "length" };
        let prompt_text = decode(ids)?;
        let all: Vec<u32> = ids.iter().chain(toks).copied().collect();
        let full = decode(&all)?;
        let text = match full.strip_prefix(prompt_text.as_str()) {
            Some(t) => t.to_string(),
            None => decode(toks)?,
        };
        Ok(Want { text, completion_tokens: toks.len(), finish, near: vec![] })
    };
    let mut want = |prompt: &str, n: usize| -> Result<Want> {
        let ids = encode(prompt)?;
        let (rows, toks) = greedy(&ids, n)?;
        let mut w = answer(&ids, &toks, n)?;
        // Every near-tie up to the answer's end, followed greedily from the other token.
        let mut near = Vec::new();
        for (i, row) in rows.iter().enumerate().take(w.completion_tokens) {
            let best = toks[i] as usize;
            for (j, v) in row.iter().enumerate() {
                if j != best && near.len() < MAX_NEAR_TIES && row[best] - v <= oracle::GREEDY_TIE {
                    let mut branch: Vec<u32> = toks[..i].to_vec();
                    branch.push(j as u32);
                    let stops = eos.contains(&(j as u32));
                    if !stops && i + 1 < n {
                        let prefix: Vec<u32> = ids.iter().chain(&branch).copied().collect();
                        branch.extend(greedy(&prefix, n - i - 1)?.1);
                    }
                    near.push(answer(&ids, &branch, n)?);
                }
            }
        }
        w.near = near;
        Ok(w)
    };
    let greedy = plan.greedy.iter().map(|a| want(&a.prompt, a.max_tokens)).collect::<Result<_>>()?;
    let pool = plan.pool.iter().map(|a| want(&a.prompt, a.max_tokens)).collect::<Result<_>>()?;
    let burst = match plan.greedy.first() {
        Some(a) => want(&a.prompt, 1)?,
        None => Want { text: String::new(), completion_tokens: 0, finish: "length", near: vec![] },
    };
    let disconnect = match plan.greedy.first() {
        Some(a) if full_answer => Some(want(&a.prompt, plan.disconnect_tokens)?),
        _ => None,
    };
    Ok(Expected { greedy, pool, burst, disconnect })
}
