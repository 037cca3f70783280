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
/// slot taken). Once each has its first event (so each is running, or has run), all are dropped but
/// one, the witness: the request whose first event came last, the last the server admitted, read to
/// its `[DONE]`. Then a one-token request, the probe. A server that cancels the dropped requests
/// frees their slots within a step or two and answers the probe while the witness still has most
/// of its tokens to send. One that goes on generating for them makes the probe wait for a free
/// slot: every dropped request is the witness's twin and started no later, so the first slot frees
/// only near the witness's end (within the admission of the slots, a step per slot at worst).
/// Passes when the probe is answered with at least half of the witness's events still to come.
/// Events are counted, not timed, so a server that holds back its `[DONE]` gains nothing; one that
/// generated everything at once and paced its events would pass, and wastes the same work.
///
/// With one slot there is no twin to keep: the probe's time is compared with `t_full`, which a
/// server could lengthen by sleeping on a lone full-length request. When `t_full` is under 20 ms,
/// or (with two or more slots) k or the witness's event count is under [`DISCONNECT_MIN_TOKENS`]
/// and [`DISCONNECT_TOKENS_PER_SLOT`] per slot, the outcomes cannot be told apart (a short model
/// context, or an early EOS): the check says so and passes where the server ran, returning the
/// full-length answer, and the judge then passes it only when that answer is the reference's (a
/// server could answer it at once with anything to take this way out).
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
    let witnessed = slots >= 2;
    let least = if witnessed { DISCONNECT_MIN_TOKENS.max(DISCONNECT_TOKENS_PER_SLOT * slots) } else { 1 };
    if t_full < Duration::from_millis(20) || k < least {
        let c = check(
            "disconnect",
            true,
            format!(
                "{NOT_OBSERVABLE}: one request of {k} tokens takes {:.1} ms, too short to tell a cancelled request from a finished one (at least 20 ms and {least} tokens for {slots} slots)",
                ms(t_full)
            ),
        );
        return (c, Some(answer));
    }
    let body = json!({"prompt": prompt, "max_tokens": full, "temperature": 0, "stream": true}).to_string();
    // Every streaming request's thread and, with a witness, the probe's sender wait here once, until
    // every request has its first event (or failed).
    let barrier = std::sync::Barrier::new(slots + usize::from(witnessed));
    // When each request had its first event (None: refused, or no event).
    let firsts = Mutex::new(vec![None::<Instant>; slots]);
    // One streaming request: its first event; then, as the witness, the arrival of each of its
    // events up to `[DONE]`, or else dropped (Ok(None)).
    let stream = |i: usize| -> std::result::Result<Option<Vec<Instant>>, String> {
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
        // The witness is the request whose first event came last (the lowest such index): the
        // last one the server admitted, so every dropped request started no later than it.
        let last = firsts.lock().ok().and_then(|f| {
            f.iter().enumerate().filter_map(|(j, t)| t.map(|t| (t, j))).max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)))
        });
        let Some(rd) = reader.as_mut().filter(|_| witnessed && last.map(|(_, j)| j) == Some(i)) else {
            // Dropped: the client goes away while its request runs.
            return Ok(None);
        };
        let mut events = vec![first];
        while read_event_line(rd, &mut line)? {
            let text = String::from_utf8_lossy(&line);
            let Some(data) = text.trim_end().strip_prefix("data:").map(str::trim) else { continue };
            if data == "[DONE]" {
                return Ok(Some(events));
            }
            events.push(Instant::now());
        }
        Err("the event stream ended without [DONE]".into())
    };
    let (kept, probe) = std::thread::scope(|s| {
        let threads: Vec<_> = (0..slots).map(|i| s.spawn(move || stream(i))).collect();
        let probe = witnessed.then(|| {
            barrier.wait();
            timed(1).map(|(t, _)| (t, Instant::now()))
        });
        let joined = threads.into_iter().map(|t| t.join().unwrap_or_else(|_| Err("its thread panicked".into())));
        // The witness's answer, else the first failure of a request that had its first event.
        let mut kept = None;
        for (j, r) in joined.enumerate() {
            match r {
                Ok(Some(events)) => kept = Some(Ok(events)),
                Err(why) if kept.is_none() && firsts.lock().is_ok_and(|f| f[j].is_some()) => kept = Some(Err(why)),
                _ => {}
            }
        }
        (kept, probe)
    });
    let opened = firsts.into_inner().map(|f| f.iter().flatten().count()).unwrap_or(0);
    let probe = match probe {
        Some(p) => p,
        None => timed(1).map(|(t, _)| (t, Instant::now())),
    };
    let (t_probe, answered_at) = match probe {
        Ok(x) => x,
        Err(why) => return (check("disconnect", false, format!("the request after the dropped clients: {why}")), None),
    };
    let dropped = opened.saturating_sub(usize::from(witnessed));
    let detail = format!(
        "{opened} of {slots} streaming requests of {k} tokens (max_seqs) had their first event, {dropped} then dropped; a one-token request then took {:.1} ms",
        ms(t_probe)
    );
    if opened * 2 < slots {
        return (check("disconnect", false, format!("{detail}: too few requests were accepted to tell")), None);
    }
    let (passed, detail) = match kept {
        None if !witnessed => {
            (t_probe < t_full, format!("{detail}; one {k}-token request alone took {:.1} ms", ms(t_full)))
        }
        None => return (check("disconnect", false, format!("{detail}; no request was kept open")), None),
        Some(Err(why)) => {
            return (check("disconnect", false, format!("{detail}; the streaming request kept open: {why}")), None);
        }
        Some(Ok(events)) if events.len() < least => {
            // The kept request ended early (an EOS its batch reached sooner): too short to tell.
            let c = check(
                "disconnect",
                true,
                format!(
                    "{NOT_OBSERVABLE}: {detail}; the request kept open ended after {} events, too few to tell a cancelled request from a finished one (at least {least})",
                    events.len()
                ),
            );
            return (c, Some(answer));
        }
        Some(Ok(events)) => {
            let total = events.len();
            let to_come = events.iter().filter(|t| **t > answered_at).count();
            let detail = format!(
                "{detail}, answered with {to_come} of the {total} events of the request kept open (the last admitted) still to come (at least half must be)"
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
    (c, None)
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
