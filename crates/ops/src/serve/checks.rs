//! The checks of serve_engine's battery that talk to the server on their own: `--help`, a client
//! disconnect, keep-alive latency and a burst of requests at once; and the shape of a check.

use std::io::BufReader;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
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

/// The disconnect check (component.openai_server: "client disconnect cancels the request"). First
/// one greedy request of `full` new tokens alone: its time `t_full` and its token count k. Then
/// `slots` streaming requests of the same prompt and length (the engine's max_seqs: every running
/// slot taken), each dropped once its first event arrived (so it is running); then a one-token
/// request: its time `t_probe`. A server that cancels the dropped requests frees their slots within
/// a step or two and answers it about as fast as when idle; one that goes on generating for them
/// makes it wait for a free slot, at least until one k-token sequence ends, which takes at least
/// `t_full` (a step of every slot's sequence is no faster than a step of one). Passes when
/// `t_probe < t_full`; when `t_full` is under 20 ms (a short model context, or an early EOS) the two
/// cannot be told apart from scheduling noise, and the check says so and passes where the server
/// ran, returning the full-length answer: the judge then passes it only when that answer is the
/// reference's (a server could answer it at once with anything to take this way out).
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
    if t_full < Duration::from_millis(20) {
        let c = check(
            "disconnect",
            true,
            format!(
                "{NOT_OBSERVABLE}: one request of {k} tokens takes {:.1} ms, too short to tell a cancelled request from a finished one",
                ms(t_full)
            ),
        );
        return (c, Some(answer));
    }
    let body = json!({"prompt": prompt, "max_tokens": full, "temperature": 0, "stream": true}).to_string();
    let barrier = std::sync::Barrier::new(slots);
    let running = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..slots {
            s.spawn(|| {
                let r = client.post_request("/v1/completions").send(body.as_str());
                if let Some(mut r) = r.ok().filter(|r| r.status().as_u16() == 200) {
                    let mut first = Vec::new();
                    let mut reader = BufReader::new(r.body_mut().with_config().limit(MAX_STREAM_BYTES).reader());
                    while read_event_line(&mut reader, &mut first).unwrap_or(false) && !first.starts_with(b"data:") {}
                    if first.starts_with(b"data:") {
                        running.fetch_add(1, Ordering::SeqCst);
                    }
                    // Every response is held until all have their first event, then dropped: the
                    // clients go away while their requests run.
                    barrier.wait();
                    return;
                }
                barrier.wait();
            });
        }
    });
    let opened = running.into_inner();
    let abandoned = slots;
    let (t_probe, _) = match timed(1) {
        Ok(x) => x,
        Err(why) => return (check("disconnect", false, format!("the request after the dropped clients: {why}")), None),
    };
    let detail = format!(
        "{opened} of {abandoned} streaming requests of {k} tokens (max_seqs) dropped after their first event; a one-token request then took {:.1} ms, one {k}-token request alone {:.1} ms",
        ms(t_probe),
        ms(t_full)
    );
    if opened * 2 < abandoned {
        return (check("disconnect", false, format!("{detail}: too few requests were accepted to tell")), None);
    }
    let c = if t_probe < t_full {
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
