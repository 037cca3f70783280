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
    /// The server's other answers to this ask that a correct engine may give: each a path of the
    /// reference that takes, at one or more steps, a token whose logit is within
    /// [`oracle::GREEDY_TIE`] of the greedy token's and is otherwise greedy ([`expected`]'s
    /// search); only those the server gave.
    pub(super) near: Vec<Want>,
}

/// Most reference positions the near-tie search spends on one judgement, all answers together:
/// each branch taken at a near-tie is a run of the prompt, the answer up to the branch and the
/// rest of it (64 branches of 512 positions). Judging a correct engine takes one branch per
/// near-tie its answers went the other way at, except at an answer's last step.
pub const MAX_SEARCH_POSITIONS: usize = 32_768;

/// Whether a server's answer text is the reference's `reference`: equal, or equal but for the
/// bytes of a character the answer's last tokens left incomplete (decoded as U+FFFD at the end of
/// the reference's text), which a server may hold back.
pub(super) fn same_text(server: &str, reference: &str) -> bool {
    server == reference || (reference.ends_with('\u{FFFD}') && server == reference.trim_end_matches('\u{FFFD}'))
}

/// Most distinct answers to one ask the near-tie search looks at: an engine that gives more is
/// judged unequal on the others.
pub const MAX_TEXTS_SEARCHED: usize = 8;

impl Want {
    /// This answer, or else the first near-tie path ([`Want::near`]), that `matches` (an answer's text, and
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
    /// The server's answers the near-tie search did not finish ([`MAX_SEARCH_POSITIONS`],
    /// [`MAX_TEXTS_SEARCHED`]): each is judged unequal, and a failing check says so.
    pub(super) unsearched: usize,
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
                Ok(s)
                    if s.done
                        && w0
                            .accepts(|m| Target { text: &s.text, finish: Some(&s.finish), tokens: None }.is(m))
                            .is_some() =>
                {
                    check(
                        "streaming",
                        true,
                        format!("{} events, text equal to the non-streaming one, then [DONE]", s.events),
                    )
                }
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
                Ok(a) if w0.accepts(|m| same_text(&a.text, &m.text)).is_some() => {
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
    let mut levels: Vec<LoadLevel> = seen
        .levels
        .iter()
        .enumerate()
        .map(|(i, run)| {
            let picks = plan.levels.get(i).map_or(&[][..], |(_, p)| p.as_slice());
            level_figures(run, picks.len(), &want.pool)
        })
        .collect();
    if want.unsearched > 0 {
        let note = format!(
            "{} of the server's answers were judged unequal without a finished near-tie search (at most {MAX_SEARCH_POSITIONS} reference positions a judgement, {MAX_TEXTS_SEARCHED} distinct answers an ask)",
            want.unsearched
        );
        // Only the checks that compare answers with the reference's.
        let compared = ["greedy", "streaming", "alive", "disconnect"];
        for c in checks.iter_mut().filter(|c| !c.passed && compared.contains(&c.name.as_str())) {
            c.detail = format!("{}; {note}", c.detail);
        }
        for l in levels.iter_mut().filter(|l| l.greedy_mismatches > 0) {
            l.errors.push(note.clone());
        }
    }
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
        let Some(w) = pool.get(*pick).and_then(|w| w.accepts(|m| same_text(text, &m.text))) else {
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
        Some(w) if c.name == "disconnect" && c.passed && w.accepts(|m| Target::answered(full).is(m)).is_some() => {
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
        let same = |a: &Answered| w.accepts(|m| Target::answered(a).is(m)).map(|m| !std::ptr::eq(m, w));
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

/// What the server answered to one ask, as far as its step recorded it: the text, and where the
/// step has them the finish reason and token count. The near-tie search looks for a path of the
/// reference that gives all of them.
struct Target<'s> {
    text: &'s str,
    finish: Option<&'s str>,
    tokens: Option<usize>,
}

impl<'s> Target<'s> {
    /// A non-streamed answer: its text, finish reason and token count.
    fn answered(a: &'s Answered) -> Self {
        Target { text: &a.text, finish: Some(&a.finish), tokens: Some(a.completion_tokens) }
    }

    /// Whether the reference's answer `w` is this one.
    fn is(&self, w: &Want) -> bool {
        same_text(self.text, &w.text)
            && self.finish.is_none_or(|f| f == w.finish)
            && self.tokens.is_none_or(|n| n == w.completion_tokens)
    }
}

/// The server's answers in `seen` to each ask of `plan`: per greedy ask (the greedy step's answer;
/// for the first also the streamed and the alive one), per pool prompt (every load level's
/// answers to it), and the disconnect check's full-length answer.
fn targets<'s>(plan: &Plan, seen: &'s Observed) -> (Vec<Vec<Target<'s>>>, Vec<Vec<Target<'s>>>, Vec<Target<'s>>) {
    let mut greedy: Vec<Vec<Target>> = plan.greedy.iter().map(|_| Vec::new()).collect();
    let mut pool: Vec<Vec<Target>> = plan.pool.iter().map(|_| Vec::new()).collect();
    let mut disconnect = Vec::new();
    for step in &seen.steps {
        match step {
            Step::Greedy { answers } => {
                for (i, a) in answers.iter().enumerate() {
                    if let (Some(t), Ok(a)) = (greedy.get_mut(i), a) {
                        t.push(Target::answered(a));
                    }
                }
            }
            Step::Streaming { answer: Ok(s) } => {
                if let Some(t) = greedy.first_mut() {
                    t.push(Target { text: &s.text, finish: Some(&s.finish), tokens: None });
                }
            }
            Step::Alive { answer: Ok(a) } => {
                if let Some(t) = greedy.first_mut() {
                    t.push(Target { text: &a.text, finish: None, tokens: None });
                }
            }
            Step::Disconnect { full: a, .. } => disconnect.push(Target::answered(a)),
            _ => {}
        }
    }
    for run in &seen.levels {
        for (pick, text) in &run.answers {
            if let Some(t) = pool.get_mut(*pick) {
                t.push(Target { text, finish: None, tokens: None });
            }
        }
    }
    (greedy, pool, disconnect)
}

/// The reference's answers to `plan`, each with the near-tie paths to the server's other answers
/// in `seen` ([`Want::near`]); the disconnect check's full-length answer where `seen` holds a
/// check that could not tell ([`needs_full_answer`]). `greedy(ids, n)` gives the reference's
/// logits rows and its greedy tokens after the ids, `n` at most, ending after the first of `eos` if
/// one comes (as `Reference::greedy_until`); `encode` and `decode` are the model's tokenizer.
///
/// The search for a server's answer starts from the reference's greedy path and finds the first
/// step where its text leaves the server's; at that step or an earlier one, a token within
/// [`oracle::GREEDY_TIE`] of the greedy logit whose text still agrees is followed greedily (up to
/// the answer's token count where the server reported it), and the search goes on from there, so
/// an answer may take any number of near-ties. Each branch costs the reference a run of the
/// prompt and the answer so far and to come; a judgement spends at most [`MAX_SEARCH_POSITIONS`]
/// positions, and an answer not found within them is judged unequal. An answer whose text leaves
/// the server's at a step with no near-tie that agrees costs nothing.
///
/// # Errors
/// When the reference or the tokenizer fails.
pub(super) fn expected(
    plan: &Plan,
    eos: &[u32],
    encode: impl Fn(&str) -> Result<Vec<u32>>,
    decode: impl Fn(&[u32]) -> Result<String>,
    mut greedy: impl FnMut(&[u32], usize) -> Result<(Vec<Vec<f64>>, Vec<u32>)>,
    seen: &Observed,
) -> Result<Expected> {
    let (greedy_seen, pool_seen, disconnect_seen) = targets(plan, seen);
    let mut search = Search {
        eos,
        decode: &decode,
        greedy: &mut greedy,
        positions_left: MAX_SEARCH_POSITIONS,
        cut: 0,
        starved: false,
    };
    let mut asks = Vec::new();
    for (a, targets) in plan.greedy.iter().zip(&greedy_seen) {
        asks.push(search.want(&encode(&a.prompt)?, a.max_tokens, targets)?);
    }
    let mut pool = Vec::new();
    for (a, targets) in plan.pool.iter().zip(&pool_seen) {
        pool.push(search.want(&encode(&a.prompt)?, a.max_tokens, targets)?);
    }
    let (burst, disconnect) = match plan.greedy.first() {
        Some(a) => {
            let ids = encode(&a.prompt)?;
            let full = match needs_full_answer(seen) {
                true => Some(search.want(&ids, plan.disconnect_tokens, &disconnect_seen)?),
                false => None,
            };
            (search.burst(&ids)?, full)
        }
        None => (Want { text: String::new(), completion_tokens: 0, finish: "length", near: vec![] }, None),
    };
    Ok(Expected { greedy: asks, pool, burst, disconnect, unsearched: search.cut })
}

/// The reference's greedy run: logits rows and tokens after `ids`, `n` at most ([`expected`]).
type GreedyRun<'f> = dyn FnMut(&[u32], usize) -> Result<(Vec<Vec<f64>>, Vec<u32>)> + 'f;

/// The near-tie search of [`expected`], with what is left of its budget.
struct Search<'f> {
    eos: &'f [u32],
    decode: &'f dyn Fn(&[u32]) -> Result<String>,
    greedy: &'f mut GreedyRun<'f>,
    /// Reference positions (prompt and tokens of each branch run) the search may still spend.
    positions_left: usize,
    /// Distinct server answers whose search the budget cut short or that were not searched.
    cut: usize,
    /// Whether the current search skipped a branch for want of budget.
    starved: bool,
}

/// One ask as the search sees it: the prompt's ids and decoding, and the most new tokens.
struct Asked<'a> {
    ids: &'a [u32],
    prompt: String,
    n: usize,
}

/// Per step of a greedy run, the tokens other than the greedy one whose logit is within
/// [`oracle::GREEDY_TIE`] of it, the largest first (the rows themselves are not kept: a row of a
/// real vocabulary is 1 MB).
fn near_ties(rows: &[Vec<f64>], toks: &[u32]) -> Vec<Vec<u32>> {
    rows.iter()
        .zip(toks)
        .map(|(row, &best)| {
            let top = row.get(best as usize).copied().unwrap_or(f64::NAN);
            let mut ties: Vec<u32> = (0..row.len())
                .filter(|&j| j != best as usize && top - row[j] <= oracle::GREEDY_TIE)
                .map(|j| j as u32)
                .collect();
            ties.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
            ties
        })
        .collect()
}

impl Search<'_> {
    /// The answer `toks` (cut after its first EOS) to the ask `a`.
    fn answer(&self, a: &Asked, toks: &[u32]) -> Result<Want> {
        let cut = toks.iter().position(|t| self.eos.contains(t)).map_or(toks.len(), |i| i + 1);
        let toks = &toks[..cut];
        let finish = if cut < a.n || toks.last().is_some_and(|t| self.eos.contains(t)) { "stop" } else { "length" };
        let all: Vec<u32> = a.ids.iter().chain(toks).copied().collect();
        let full = (self.decode)(&all)?;
        let text = match full.strip_prefix(a.prompt.as_str()) {
            Some(t) => t.to_string(),
            None => (self.decode)(toks)?,
        };
        Ok(Want { text, completion_tokens: toks.len(), finish, near: vec![] })
    }

    /// Whether `toks` is a whole answer to `a`: it ends with an EOS or has `a.n` tokens.
    fn whole(&self, a: &Asked, toks: &[u32]) -> bool {
        toks.len() >= a.n || toks.iter().any(|t| self.eos.contains(t))
    }

    /// Whether the answer `toks` so far agrees with `text`: its text, less a character still
    /// incomplete at its end (decoded as U+FFFD), begins `text`.
    fn agrees(&self, a: &Asked, toks: &[u32], text: &str) -> Result<bool> {
        let w = self.answer(a, toks)?;
        Ok(text.starts_with(w.text.trim_end_matches('\u{FFFD}')))
    }

    /// The reference's greedy answer to `ids` of `n` new tokens at most, with a near-tie path to
    /// each of the server's answers `seen` that differs from it and that the search finds (at most
    /// [`MAX_TEXTS_SEARCHED`] distinct ones).
    fn want(&mut self, ids: &[u32], n: usize, seen: &[Target]) -> Result<Want> {
        let a = Asked { ids, prompt: (self.decode)(ids)?, n };
        let (rows, toks) = (self.greedy)(ids, n)?;
        let ties = near_ties(&rows, &toks);
        drop(rows);
        let mut w = self.answer(&a, &toks)?;
        let mut tried: Vec<&Target> = Vec::new();
        let mut cut: Vec<&Target> = Vec::new();
        let same = |u: &Target, t: &Target| (u.text, u.finish, u.tokens) == (t.text, t.finish, t.tokens);
        for t in seen {
            if t.is(&w) || w.near.iter().any(|m| t.is(m)) || tried.iter().chain(&cut).any(|u| same(u, t)) {
                continue;
            }
            if tried.len() == MAX_TEXTS_SEARCHED {
                cut.push(t);
                continue;
            }
            tried.push(t);
            self.starved = false;
            match self.find(&a, &[], &ties, &toks, t)? {
                Some(found) => w.near.push(found),
                None if self.starved => cut.push(t),
                None => {}
            }
        }
        self.cut += cut.len();
        Ok(w)
    }

    /// A path to the server's answer `t` that begins with `prefix` and whose greedy continuation
    /// is `toks` (with `ties`, each step's near-ties), taking near-ties where its text leaves
    /// `t`'s; None when there is none within the budget (`starved` says whether it ran short).
    fn find(&mut self, a: &Asked, prefix: &[u32], ties: &[Vec<u32>], toks: &[u32], t: &Target) -> Result<Option<Want>> {
        let path: Vec<u32> = prefix.iter().chain(toks).copied().collect();
        if self.whole(a, &path) {
            let here = self.answer(a, &path)?;
            if t.is(&here) {
                return Ok(Some(here));
            }
        }
        // The first step whose text leaves the server's (toks.len() when none does: the greedy
        // path ended first, and a near-tie at any step may lengthen it). Agreement only shrinks
        // as the path grows, so it is found by bisection.
        let (mut lo, mut hi) = (0, toks.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            if self.agrees(a, &path[..prefix.len() + mid + 1], t.text)? {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let leaves = lo;
        for k in (0..toks.len().min(leaves + 1)).rev() {
            for &j in ties.get(k).map_or(&[][..], Vec::as_slice) {
                let mut branch: Vec<u32> = path[..prefix.len() + k].to_vec();
                branch.push(j);
                if t.tokens.is_some_and(|c| branch.len() > c) || !self.agrees(a, &branch, t.text)? {
                    continue;
                }
                if self.whole(a, &branch) {
                    let end = self.answer(a, &branch)?;
                    if t.is(&end) {
                        return Ok(Some(end));
                    }
                    continue;
                }
                // The rest of the answer: up to its token count where the server reported it.
                let rest = t.tokens.map_or(a.n, |c| c.min(a.n)) - branch.len();
                if rest == 0 {
                    continue;
                }
                let cost = a.ids.len() + branch.len() + rest;
                if cost > self.positions_left {
                    self.starved = true;
                    continue;
                }
                self.positions_left -= cost;
                let whole: Vec<u32> = a.ids.iter().chain(&branch).copied().collect();
                let (rows2, toks2) = (self.greedy)(&whole, rest)?;
                let ties2 = near_ties(&rows2, &toks2);
                drop(rows2);
                if let Some(found) = self.find(a, &branch, &ties2, &toks2, t)? {
                    return Ok(Some(found));
                }
            }
        }
        Ok(None)
    }

    /// The reference's one-token answer to `ids`, with every near-tie of its only step as an
    /// alternative (they cost no run).
    fn burst(&mut self, ids: &[u32]) -> Result<Want> {
        let a = Asked { ids, prompt: (self.decode)(ids)?, n: 1 };
        let (rows, toks) = (self.greedy)(ids, 1)?;
        let mut w = self.answer(&a, &toks)?;
        for &j in near_ties(&rows, &toks).first().map_or(&[][..], Vec::as_slice) {
            w.near.push(self.answer(&a, &[j])?);
        }
        Ok(w)
    }
}
