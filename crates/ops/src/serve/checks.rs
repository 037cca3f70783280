//! The checks of serve_engine's battery that talk to the server on their own: `--help`, a client
//! disconnect, keep-alive latency and a burst of requests at once; and the shape of a check.

use std::io::BufReader;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::Check;
use super::client::{Answer, Client, MAX_STREAM_BYTES, read_event_line};
use super::load::percentile;
use super::wire::Answered;
use base::error::Result;
use harness::{Budget, Grants};

/// Largest excess of the median time to first token on reused keep-alive connections over the one
/// on fresh connections, milliseconds: half of Linux's minimum delayed-ACK time (TCP_DELACK_MIN =
/// 40 ms, include/net/tcp.h), the wait Nagle's algorithm (RFC 896) adds to a response's second small
/// write on a reused connection of a server without TCP_NODELAY.
pub const KEEP_ALIVE_EXCESS_MS: f64 = 20.0;

/// Streaming requests timed on each kind of connection by the keep-alive check.
pub const KEEP_ALIVE_ROUNDS: usize = 7;

/// The check `help`: `exe --help` and `exe serve --help` exit 0 and print the commands and serve's
/// flags (`--model`, `--port`), as component.openai_server asks. Run sandboxed, with no model and
/// no network, within 30 s each.
///
/// # Errors
/// When the process cannot be started or the sandbox refuses.
pub(super) fn help_check(
    workshop: &harness::Workshop,
    exe: &std::path::Path,
    scratch: &std::path::Path,
    budget: &Budget,
) -> Result<Check> {
    let grants = Grants::harness(exe, scratch);
    for (args, wants) in [(&["--help"][..], &["serve"][..]), (&["serve", "--help"][..], &["--model", "--port"][..])] {
        let limit =
            Budget { deadline: budget.deadline.min(Instant::now() + Duration::from_secs(30)), ..budget.clone() };
        let run = workshop.run_program_sandboxed(exe, args, &grants, &limit)?;
        let shown = format!("`{} {}`", exe.file_name().unwrap_or_default().to_string_lossy(), args.join(" "));
        if !run.ok() {
            return Ok(check(
                "help",
                false,
                format!(
                    "{shown} {}; it must print the commands and flags to stdout and exit 0 (component.openai_server)",
                    run.failure_text(600)
                ),
            ));
        }
        if let Some(w) = wants.iter().find(|w| !run.stdout.contains(**w)) {
            return Ok(check(
                "help",
                false,
                format!(
                    "{shown} exited 0 but does not mention `{w}`; stdout (tail): {}",
                    harness::tail(&run.stdout, 400)
                ),
            ));
        }
    }
    Ok(check("help", true, "`--help` and `serve --help` exit 0 and list the commands and serve's flags"))
}

pub(super) fn check(name: &str, passed: bool, detail: impl Into<String>) -> Check {
    Check { name: name.into(), passed, detail: detail.into() }
}

/// Whether `body` is an OpenAI error object: {"error": {"message": string, "type": string}}.
pub(super) fn openai_error(body: &str) -> bool {
    serde_json::from_str::<Value>(body)
        .map(|v| v["error"]["message"].is_string() && v["error"]["type"].is_string())
        .unwrap_or(false)
}

/// Fewest tokens the disconnect check's full-length request, and the streaming request it keeps
/// open, must generate for the check to be decided by that witness, and per running slot: the
/// witness must outlast the scheduler's admission of every slot (one prompt per step at worst) by
/// a wide margin.
pub const DISCONNECT_MIN_TOKENS: usize = 32;
/// See [`DISCONNECT_MIN_TOKENS`].
pub const DISCONNECT_TOKENS_PER_SLOT: usize = 4;

/// The disconnect check (component.openai_server: "client disconnect cancels the request").
///
/// First one greedy request of `full` new tokens alone: its token count k and time `t_full`. Then
/// `slots` streaming requests of the same prompt and length (the engine's max_seqs: every running
/// slot taken). Once each has its first event (so each is running), all are dropped but one, the
/// witness: the request whose first event came last, the last the server admitted, read to its
/// `[DONE]`. Then a one-token request, the probe. A server that cancels the dropped requests frees
/// their slots within a step or two and answers the probe while the witness still has most of its
/// text to send. One that goes on generating for them makes the probe wait for a free slot: every
/// dropped request is the witness's twin and started no later, so the first slot frees only near
/// the witness's end (within the admission of the slots, a step per slot at worst). Passes when the
/// probe is answered with at least half of the witness's text events still to come. Events are
/// counted, not timed, so a server that holds back its last chunk or its `[DONE]` gains nothing.
///
/// The slots must all run at once, or a free slot could not be told from a cancelled request. When
/// some streaming requests are refused, the check runs again with as many; when some are queued
/// (their first event more than `t_full / 2` after the earliest), again with as many as ran at once,
/// the server's running slots. If they again do not all run at once, it fails. Limits: a server that
/// knew which stream is the witness (after the drops it is the only one open) could hold back its
/// events; one that always kept a slot free for new requests would look like one slot fewer and
/// answer the probe in it; one slot has no twin, so there the probe's time is compared with
/// `t_full`, which a server could lengthen by sleeping on a lone full-length request.
///
/// When `t_full` is under 20 ms, or (with two or more slots) k is under [`DISCONNECT_MIN_TOKENS`] and
/// [`DISCONNECT_TOKENS_PER_SLOT`] per slot, or the witness's answer ended early (an EOS its batch
/// reached sooner), the outcomes cannot be told apart: the check says so and passes where the server
/// ran, returning the full-length answer, and the judge then passes it only when that answer is the
/// reference's (a server could answer it at once with anything to take this way out). A witness that
/// sends its whole answer in fewer events than that fails: each piece is to be sent as it comes.
pub(super) fn disconnect(client: &Client, prompt: &str, full: usize, slots: usize) -> (Check, Option<Answered>) {
    let timed = |max_tokens: usize| -> std::result::Result<(Duration, Answered), String> {
        let start = Instant::now();
        let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).to_string();
        let a = client.post("/v1/completions", &body)?;
        if a.status != 200 {
            return Err(format!("answered {}: {}", a.status, harness::tail(&a.body, 300)));
        }
        let v: Value = serde_json::from_str(&a.body).map_err(|e| format!("the body is not JSON: {e}"))?;
        let c = &v["choices"][0];
        let answered = Answered {
            text: super::wire::recorded(c["text"].as_str().unwrap_or("").to_string()),
            finish: c["finish_reason"].as_str().unwrap_or("").to_string(),
            completion_tokens: v["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize,
        };
        Ok((start.elapsed(), answered))
    };
    let (t_full, answer) = match timed(full) {
        Ok(x) => x,
        Err(why) => return (check("disconnect", false, format!("the full-length request alone: {why}")), None),
    };
    let k = answer.completion_tokens;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let least = |n: usize| if n >= 2 { DISCONNECT_MIN_TOKENS.max(DISCONNECT_TOKENS_PER_SLOT * n) } else { 1 };
    let not_observable = |why: String| {
        let c = check("disconnect", true, format!("{NOT_OBSERVABLE}: {why}"));
        (c, Some(answer.clone()))
    };
    if t_full < Duration::from_millis(20) || k < least(slots) {
        return not_observable(format!(
            "one request of {k} tokens takes {:.1} ms, too short to tell a cancelled request from a finished one (at least 20 ms and {} tokens for {slots} slots)",
            ms(t_full),
            least(slots)
        ));
    }
    let mut n = slots;
    let mut rerun = String::new();
    loop {
        let run = drop_streams(client, prompt, full, n, || timed(1).map(|(t, _)| (t, Instant::now())));
        let (t_probe, answered_at) = match run.probe {
            Ok(x) => x,
            Err(why) => {
                return (
                    check("disconnect", false, format!("{rerun}the request after the dropped clients: {why}")),
                    None,
                );
            }
        };
        let started: Vec<Instant> = run.firsts.iter().flatten().copied().collect();
        let opened = started.len();
        // The streams that ran at once: first events within t_full / 2 of the earliest.
        let at_once = started.iter().min().map_or(0, |&e| started.iter().filter(|&&t| t - e < t_full / 2).count());
        let detail = format!(
            "{rerun}{opened} of {n} streaming requests of {k} tokens had their first event, {} then dropped; a one-token request then took {:.1} ms",
            opened.saturating_sub(usize::from(n >= 2)),
            ms(t_probe)
        );
        if opened < n || at_once < n {
            // Refused streams: the same count again (their slots were free, so a gap among them is
            // no evidence); queued ones: as many as ran at once, the server's running slots.
            let refused = opened < n;
            if !rerun.is_empty() || at_once == 0 {
                let why = if refused {
                    format!(
                        "{} of {n} were refused, so a free slot cannot be told from a cancelled request (component.openai_server: requests beyond the running slots wait in the queue)",
                        n - opened
                    )
                } else {
                    format!(
                        "only {at_once} ran at once, so a free slot cannot be told from a cancelled request (component.openai_server: the server runs max_seqs sequences at once; lower max_seqs in metainfer.toml [serving] to what it holds)"
                    )
                };
                return (check("disconnect", false, format!("{detail}: {why}")), None);
            }
            let again = if refused { n } else { at_once };
            rerun = if refused {
                format!("{} of {n} streaming requests were refused, so the check ran again: ", n - opened)
            } else {
                format!(
                    "{at_once} of {n} streaming requests ran at once (the others queued), so the check ran again with {at_once}: "
                )
            };
            n = again;
            continue;
        }
        let (passed, detail) = match run.kept {
            None if n < 2 => {
                (t_probe < t_full, format!("{detail}; one {k}-token request alone took {:.1} ms", ms(t_full)))
            }
            None => return (check("disconnect", false, format!("{detail}; no request was kept open")), None),
            Some(Err(why)) => {
                return (check("disconnect", false, format!("{detail}; the streaming request kept open: {why}")), None);
            }
            Some(Ok(w)) if w.events.len() < least(n) => {
                // Compared as recorded (the lone answer's text is cut at the recorded bound).
                if super::wire::recorded(w.text.clone()).chars().count() < answer.text.chars().count() {
                    return not_observable(format!(
                        "{detail}; the request kept open ended after {} text events, {:?}, sooner than the request alone (an EOS reached in the batch): too few to tell (at least {})",
                        w.events.len(),
                        w.text,
                        least(n)
                    ));
                }
                return (
                    check(
                        "disconnect",
                        false,
                        format!(
                            "{detail}; the request kept open sent its whole answer in {} text events (component.openai_server: a streaming request sends each decoded piece as it arrives)",
                            w.events.len()
                        ),
                    ),
                    None,
                );
            }
            Some(Ok(w)) => {
                let total = w.events.len();
                let to_come = w.events.iter().filter(|t| **t > answered_at).count();
                let detail = format!(
                    "{detail}, answered with {to_come} of the {total} text events of the request kept open (the last admitted) still to come (at least half must be)"
                );
                (to_come * 2 >= total, detail)
            }
        };
        let c = if passed {
            check("disconnect", true, format!("{detail}: the dropped requests were cancelled"))
        } else {
            check(
                "disconnect",
                false,
                format!(
                    "{detail}: it waited behind the dropped requests (component.openai_server: a client disconnect cancels its request and frees its slot)"
                ),
            )
        };
        return (c, None);
    }
}

/// What the disconnect check's streaming requests saw.
struct Dropped {
    /// When each request had its first event (None: refused, or no event).
    firsts: Vec<Option<Instant>>,
    /// The witness's events (with two or more requests), or the first failure of a request that
    /// had its first event.
    kept: Option<std::result::Result<Witness, String>>,
    /// The probe's time and when its answer came, or why it failed.
    probe: std::result::Result<(Duration, Instant), String>,
}

/// The request kept open: when each of its events with text arrived, and the text.
struct Witness {
    events: Vec<Instant>,
    text: String,
}

/// `n` streaming requests of `full` tokens of `prompt`; once every one has its first event (or
/// failed), all but the witness (the latest first event, the lowest index on a tie; none when `n`
/// is 1) are dropped and `probe` runs while the witness is read to its `[DONE]`.
fn drop_streams(
    client: &Client,
    prompt: &str,
    full: usize,
    n: usize,
    probe: impl FnOnce() -> std::result::Result<(Duration, Instant), String>,
) -> Dropped {
    let witnessed = n >= 2;
    let body = json!({"prompt": prompt, "max_tokens": full, "temperature": 0, "stream": true}).to_string();
    // Every streaming request's thread and, with a witness, the probe's sender wait here once, until
    // every request has its first event (or failed).
    let barrier = std::sync::Barrier::new(n + usize::from(witnessed));
    let firsts = Mutex::new(vec![None::<Instant>; n]);
    // One streaming request: its first event; then, as the witness, its text events up to `[DONE]`;
    // else dropped (Ok(None)).
    let stream = |i: usize| -> std::result::Result<Option<Witness>, String> {
        let sent = client.post_request("/v1/completions").send(body.as_str()).map_err(|e| e.to_string());
        let (mut response, refused) = match sent {
            Ok(r) if r.status().as_u16() == 200 => (Some(r), None),
            Ok(r) => (None, Some(format!("answered {}", r.status().as_u16()))),
            Err(e) => (None, Some(e)),
        };
        let mut reader =
            response.as_mut().map(|r| BufReader::new(r.body_mut().with_config().limit(MAX_STREAM_BYTES).reader()));
        let mut line = Vec::new();
        let first = match (reader.as_mut(), refused) {
            (Some(rd), _) => loop {
                match read_event_line(rd, &mut line) {
                    Err(e) => break Err(e),
                    Ok(false) => break Err("the event stream ended before its first event".to_string()),
                    Ok(true) if line.starts_with(b"data:") => break Ok(Instant::now()),
                    Ok(true) => {}
                }
            },
            (None, why) => Err(why.unwrap_or_default()),
        };
        if let (Ok(at), Ok(mut f)) = (&first, firsts.lock()) {
            f[i] = Some(*at);
        }
        barrier.wait();
        let first = first?;
        let last = firsts.lock().ok().and_then(|f| {
            f.iter().enumerate().filter_map(|(j, t)| t.map(|t| (t, j))).max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)))
        });
        let Some(rd) = reader.as_mut().filter(|_| witnessed && last.map(|(_, j)| j) == Some(i)) else {
            // Dropped: the client goes away while its request runs.
            return Ok(None);
        };
        let mut w = Witness { events: vec![], text: String::new() };
        let take = |line: &[u8], at: Instant, w: &mut Witness| -> bool {
            let text = String::from_utf8_lossy(line);
            let Some(data) = text.trim_end().strip_prefix("data:").map(str::trim) else { return false };
            if data == "[DONE]" {
                return true;
            }
            let piece = serde_json::from_str::<Value>(data)
                .ok()
                .and_then(|v| v["choices"][0]["text"].as_str().map(str::to_string))
                .unwrap_or_default();
            if !piece.is_empty() {
                w.events.push(at);
                w.text += &piece;
            }
            false
        };
        let first_line = line.clone();
        take(&first_line, first, &mut w);
        while read_event_line(rd, &mut line)? {
            if take(&line, Instant::now(), &mut w) {
                return Ok(Some(w));
            }
        }
        Err("the event stream ended without [DONE]".into())
    };
    let mut probe = Some(probe);
    let (kept, early) = std::thread::scope(|s| {
        let threads: Vec<_> = (0..n).map(|i| s.spawn(move || stream(i))).collect();
        let early = match probe.take() {
            Some(p) if witnessed => {
                barrier.wait();
                Some(p())
            }
            other => {
                probe = other;
                None
            }
        };
        let joined = threads.into_iter().map(|t| t.join().unwrap_or_else(|_| Err("its thread panicked".into())));
        // The witness's answer, else the first failure of a request that had its first event.
        let mut kept = None;
        for (j, r) in joined.enumerate() {
            match r {
                Ok(Some(w)) => kept = Some(Ok(w)),
                Err(why) if kept.is_none() && firsts.lock().is_ok_and(|f| f[j].is_some()) => kept = Some(Err(why)),
                _ => {}
            }
        }
        (kept, early)
    });
    let firsts = firsts.into_inner().unwrap_or_default();
    // Without a witness, the probe follows the dropped requests.
    let probe = match (early, probe) {
        (Some(p), _) => p,
        (None, Some(p)) => p(),
        (None, None) => Err("the probe was not sent".into()),
    };
    Dropped { firsts, kept, probe }
}

/// The keep-alive check (component.openai_server: TCP_NODELAY on every accepted connection). One
/// streaming request `body` opens a pooled connection; then [`KEEP_ALIVE_ROUNDS`] times, alternating,
/// one request on a new connection (`fresh`) and one on the pooled one (`pooled`), each timed from
/// sending to its first text event. Passes when the reused connections' median TTFT exceeds the
/// fresh ones' by at most [`KEEP_ALIVE_EXCESS_MS`]; a request that fails fails the check.
pub(super) fn keep_alive(pooled: &Client, fresh: &Client, body: &Value) -> Check {
    let ttft = |client: &Client| -> std::result::Result<f64, String> {
        let s = client.stream(body)?;
        if !s.done {
            return Err("the event stream ended without [DONE]".into());
        }
        s.pieces.first().map(|(t, _)| t.as_secs_f64() * 1e3).ok_or_else(|| "no text event".to_string())
    };
    let run = || -> std::result::Result<(Vec<f64>, Vec<f64>), String> {
        ttft(pooled).map_err(|e| format!("opening a keep-alive connection: {e}"))?;
        let (mut f, mut r) = (Vec::new(), Vec::new());
        for _ in 0..KEEP_ALIVE_ROUNDS {
            f.push(ttft(fresh).map_err(|e| format!("on a fresh connection: {e}"))?);
            r.push(ttft(pooled).map_err(|e| format!("on a reused connection: {e}"))?);
        }
        Ok((f, r))
    };
    match run() {
        Err(why) => check("keep_alive", false, why),
        Ok((mut f, mut r)) => {
            let (fm, rm) = (percentile(&mut f, 50.0), percentile(&mut r, 50.0));
            let passed = rm - fm <= KEEP_ALIVE_EXCESS_MS;
            let mut detail = format!(
                "median TTFT over {KEEP_ALIVE_ROUNDS} streaming requests each: {rm:.1} ms on a reused keep-alive connection, {fm:.1} ms on fresh connections (bound: at most {KEEP_ALIVE_EXCESS_MS} ms more)"
            );
            if !passed {
                detail += "; the server waits on reused connections, the signature of Nagle's algorithm against delayed ACKs: set TCP_NODELAY on every accepted connection (component.openai_server)";
            }
            check("keep_alive", passed, detail)
        }
    }
}

/// How a disconnect check that could not tell begins its detail; the judge passes it only on a
/// full-length answer equal to the reference's.
pub(super) const NOT_OBSERVABLE: &str = "not observable here";

/// Requests the burst check sends at once: component.openai_server's "1,000 requests at once".
pub const BURST: usize = 1000;

/// What a burst of requests got back.
#[derive(Debug, Default)]
pub(super) struct Burst {
    /// Answered 200 with a completion.
    pub(super) completed: usize,
    /// The completions' texts (as recorded, `wire::recorded`), distinct, with how many gave each.
    pub(super) texts: std::collections::BTreeMap<String, usize>,
    /// Answered 4xx with an OpenAI error object (e.g. 429 when the queue is full).
    pub(super) refused: usize,
    /// Anything else (no answer, 5xx, another shape): how many, and the first few.
    pub(super) wrong_count: usize,
    pub(super) wrong: Vec<String>,
    /// Connections the burst lost before any HTTP answer (reset, refused: a full listen backlog)
    /// that were answered when sent again once, after the burst.
    pub(super) retried: usize,
}

/// Send `n` one-token greedy completions of `prompt` at once (one thread each, released
/// together) and sort the answers; a request lost at the connection before any HTTP answer (a
/// full listen backlog resets it) is sent again once after the burst, and its second answer
/// counts; a thread the client cannot start ends the burst there, counted as a wrong answer.
pub(super) fn burst(client: &Client, prompt: &str, n: usize) -> Burst {
    let body = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0}).to_string();
    // Every thread waits for the write lock to go before it sends: all are released at once.
    let go = std::sync::RwLock::new(());
    let out: Mutex<Burst> = Mutex::new(Burst::default());
    // A request lost at the connection (no HTTP answer) is sent again once after the burst, as a
    // client does; only what it then gets counts.
    let lost: Mutex<usize> = Mutex::new(0);
    let answer = |r: std::result::Result<Answer, String>| match r {
        Ok(a) if a.status == 200 => serde_json::from_str::<Value>(&a.body)
            .ok()
            .and_then(|v| v["choices"][0]["text"].as_str().map(|t| super::wire::recorded(t.to_string())))
            .ok_or_else(|| format!("200 without a completion: {}", harness::tail(&a.body, 200))),
        Ok(a) if (400..500).contains(&a.status) && openai_error(&a.body) => Err(String::new()),
        Ok(a) => Err(format!("answered {}: {}", a.status, harness::tail(&a.body, 200))),
        Err(e) => Err(e),
    };
    let sort = |r: std::result::Result<String, String>, retry: bool| {
        let mut b = out.lock().unwrap_or_else(|p| p.into_inner());
        match r {
            Ok(text) => {
                b.completed += 1;
                // At most a few hundred distinct texts are kept: a server answering each request
                // differently fails the judge's comparison with the first of them anyway.
                if b.texts.len() < 256 || b.texts.contains_key(&text) {
                    *b.texts.entry(text).or_default() += 1;
                }
            }
            Err(e) if e.is_empty() => b.refused += 1,
            Err(_) if retry => *lost.lock().unwrap_or_else(|p| p.into_inner()) += 1,
            Err(e) => {
                b.wrong_count += 1;
                if b.wrong.len() < 3 {
                    b.wrong.push(e);
                }
            }
        }
    };
    // Transport failures (no status) may be retried; an HTTP answer never is.
    let send = |retry: bool| {
        let r = client.post("/v1/completions", &body);
        let transport = r.is_err();
        sort(answer(r), retry && transport);
    };
    let hold = go.write().unwrap_or_else(|p| p.into_inner());
    std::thread::scope(|s| {
        for _ in 0..n {
            let spawned = std::thread::Builder::new().stack_size(256 << 10).spawn_scoped(s, || {
                drop(go.read().unwrap_or_else(|p| p.into_inner()));
                send(true);
            });
            if let Err(e) = spawned {
                sort(Err(format!("the client could not start a thread: {e}")), false);
                break;
            }
        }
        drop(hold);
    });
    let lost = *lost.lock().unwrap_or_else(|p| p.into_inner());
    for _ in 0..lost {
        send(false);
    }
    let mut b = out.into_inner().unwrap_or_else(|p| p.into_inner());
    b.retried = lost;
    b
}
