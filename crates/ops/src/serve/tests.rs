//! Unit tests of serve_engine: percentiles, the keep-alive check against a Nagle-bound server,
//! the disconnect check against cancelling and deaf servers, the OpenAI error shape, the judge of
//! a recorded run.

use std::io::{BufRead, BufReader};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;

use super::checks::{keep_alive, openai_error};
use super::client::Client;
use super::load::percentile;
use super::*;

#[test]
fn nearest_rank_percentiles_by_hand() {
    // Nearest rank (NIST/Hyndman-Fan definition 1): p99 of 1..=100 is 99, p50 is 50.
    let mut xs: Vec<f64> = (1..=100).rev().map(f64::from).collect();
    assert_eq!(percentile(&mut xs, 50.0), 50.0);
    assert_eq!(percentile(&mut xs, 99.0), 99.0);
    assert_eq!(percentile(&mut [7.0], 99.0), 7.0);
    assert_eq!(percentile(&mut [], 50.0), 0.0);
}

/// One HTTP/1.1 request from a test server's connection: its body (by content-length), or None at
/// the connection's end.
fn read_request(input: &mut impl BufRead) -> Option<Vec<u8>> {
    let (mut line, mut length) = (String::new(), 0usize);
    loop {
        line.clear();
        if input.read_line(&mut line).unwrap_or(0) == 0 {
            return None;
        }
        if line == "\r\n" {
            break;
        }
        if let Some((k, v)) = line.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            length = v.trim().parse().unwrap();
        }
    }
    let mut body = vec![0u8; length];
    std::io::Read::read_exact(input, &mut body).unwrap();
    Some(body)
}

/// A minimal HTTP/1.1 server on a loopback port that answers every request of a connection with a
/// streamed completion, writing the header block and each event as its own small write (as an
/// HTTP stack does); `nodelay` sets TCP_NODELAY on each accepted connection. Returns the port and
/// the count of accepted connections.
fn sse_server(nodelay: bool) -> (u16, std::sync::Arc<AtomicUsize>) {
    use std::io::Write;
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = std::sync::Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut out) = conn else { continue };
            count.fetch_add(1, Ordering::SeqCst);
            out.set_nodelay(nodelay).unwrap();
            std::thread::spawn(move || {
                let mut input = BufReader::new(out.try_clone().unwrap());
                while read_request(&mut input).is_some() {
                    let head =
                        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
                    let events = [
                        r#"data: {"choices":[{"index":0,"text":" once","finish_reason":null}]}"#,
                        r#"data: {"choices":[{"index":0,"text":"","finish_reason":"length"}],"usage":{"completion_tokens":1}}"#,
                        "data: [DONE]",
                    ];
                    let mut writes = vec![head.to_string()];
                    writes.extend(events.iter().map(|e| format!("{:x}\r\n{e}\n\n\r\n", e.len() + 2)));
                    writes.push("0\r\n\r\n".to_string());
                    for w in writes {
                        if out.write_all(w.as_bytes()).is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (port, accepted)
}

#[test]
fn keep_alive_fails_a_nagle_bound_server_and_passes_one_with_nodelay() {
    let body = json!({"prompt": "Once", "max_tokens": 1, "temperature": 0, "stream": true});
    let deadline = Instant::now() + Duration::from_secs(60);
    for nodelay in [true, false] {
        let (port, accepted) = sse_server(nodelay);
        let c = keep_alive(&Client::new(port, deadline), &Client::fresh(port, deadline), &body);
        // One connection per fresh request, one kept by the pooled client for all of its requests.
        assert_eq!(accepted.load(Ordering::SeqCst), KEEP_ALIVE_ROUNDS + 1, "nodelay {nodelay}: {}", c.detail);
        assert_eq!(c.passed, nodelay, "nodelay {nodelay}: {}", c.detail);
        assert_eq!(c.detail.contains("set TCP_NODELAY"), !nodelay, "{}", c.detail);
    }
}

/// Time a [`slot_server`] takes per generated token.
const STEP: Duration = Duration::from_millis(3);

/// A loopback completion server with `cap` running slots: each request waits for a free slot, then
/// generates its max_tokens tokens, one per [`STEP`] (streamed as events, or answered at the end),
/// and frees the slot. A streaming client that went away is noticed at the next failed write; the
/// server then stops generating for it, unless `deaf`, which goes on to the end holding the slot.
/// With `refuse_one`, the first streaming request of more than one token is refused with a 429.
/// One request per connection. Returns the port.
fn slot_server(cap: usize, deaf: bool, refuse_one: bool) -> u16 {
    use std::io::Write;
    use std::sync::{Arc, Condvar, Mutex};
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    let slots = Arc::new((Mutex::new(cap), Condvar::new()));
    let refused = Arc::new(std::sync::atomic::AtomicBool::new(!refuse_one));
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut out) = conn else { continue };
            let (slots, refused) = (slots.clone(), refused.clone());
            std::thread::spawn(move || {
                let mut input = BufReader::new(out.try_clone().unwrap());
                let Some(body) = read_request(&mut input) else { return };
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
                let n = v["max_tokens"].as_u64().unwrap() as usize;
                let stream = v["stream"].as_bool().unwrap_or(false);
                if stream && n > 1 && !refused.swap(true, Ordering::SeqCst) {
                    let e = r#"{"error":{"message":"busy","type":"rate_limit_error"}}"#;
                    let _ = write!(
                        out,
                        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{e}",
                        e.len()
                    );
                    return;
                }
                {
                    let (free, cv) = &*slots;
                    let mut free = free.lock().unwrap();
                    while *free == 0 {
                        free = cv.wait(free).unwrap();
                    }
                    *free -= 1;
                }
                let chunk = |e: &str| format!("{:x}\r\n{e}\n\n\r\n", e.len() + 2);
                let mut gone = stream
                    && out
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n")
                        .is_err();
                for i in 0..n {
                    std::thread::sleep(STEP);
                    if stream && !gone {
                        let e = format!(r#"data: {{"choices":[{{"index":0,"text":" t{i}","finish_reason":null}}]}}"#);
                        gone = out.write_all(chunk(&e).as_bytes()).is_err();
                    }
                    if gone && !deaf {
                        break;
                    }
                }
                {
                    let (free, cv) = &*slots;
                    *free.lock().unwrap() += 1;
                    cv.notify_one();
                }
                let text: String = (0..n).map(|i| format!(" t{i}")).collect();
                if stream {
                    let last = format!(
                        r#"data: {{"choices":[{{"index":0,"text":"","finish_reason":"length"}}],"usage":{{"completion_tokens":{n}}}}}"#
                    );
                    let _ = out.write_all(format!("{}{}0\r\n\r\n", chunk(&last), chunk("data: [DONE]")).as_bytes());
                } else {
                    let b = json!({"choices": [{"index": 0, "text": text, "finish_reason": "length"}], "usage": {"completion_tokens": n}}).to_string();
                    let _ = write!(
                        out,
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{b}",
                        b.len()
                    );
                }
            });
        }
    });
    port
}

/// The disconnect check on a [`slot_server`] of `cap` running slots, claimed to have `slots`, with
/// requests of 64 tokens (32 at least are needed to tell; 64 x 3 ms is well over 20 ms).
fn disconnect_on(cap: usize, slots: usize, deaf: bool, refuse_one: bool) -> Check {
    let port = slot_server(cap, deaf, refuse_one);
    let client = Client::new(port, Instant::now() + Duration::from_secs(60));
    let (c, full) = super::checks::disconnect(&client, "Once upon", 64, slots);
    assert!(full.is_none(), "decided by the witness: {}", c.detail);
    c
}

/// A server that frees the slots of clients that went away passes the disconnect check; one that
/// goes on generating for them fails it, the check's witness (one of four twins kept open) having
/// nearly all its events sent when the probe is answered.
#[test]
fn disconnect_passes_a_cancelling_server_and_fails_a_deaf_one() {
    let c = disconnect_on(4, 4, false, false);
    assert!(c.passed && c.detail.ends_with("the dropped requests were cancelled"), "{}", c.detail);
    let c = disconnect_on(4, 4, true, false);
    assert!(!c.passed && c.detail.contains("it waited behind the dropped requests"), "{}", c.detail);
}

/// The slots must all run at once. A server that refuses one of the four streams (429) once is
/// checked again with four; one that runs two or three sequences at once though four are claimed,
/// again with as many as ran at once. A cancelling one then passes, and a deaf one fails (the free
/// slots of refused or finished requests no longer pass for cancelled ones).
#[test]
fn disconnect_checks_again_with_the_streams_that_ran_at_once() {
    let c = disconnect_on(4, 4, false, true);
    assert!(c.passed && c.detail.starts_with("1 of 4 streaming requests were refused"), "{}", c.detail);
    assert!(c.detail.ends_with("the dropped requests were cancelled"), "{}", c.detail);
    let c = disconnect_on(2, 4, false, false);
    assert!(c.passed && c.detail.starts_with("2 of 4 streaming requests ran at once"), "{}", c.detail);
    for (cap, refuse) in [(4, true), (2, false), (3, false)] {
        let c = disconnect_on(cap, 4, true, refuse);
        assert!(
            !c.passed && c.detail.contains("it waited behind the dropped requests"),
            "{cap} {refuse}: {}",
            c.detail
        );
    }
}

#[test]
fn openai_error_shape() {
    assert!(openai_error(r#"{"error": {"message": "x", "type": "invalid_request_error", "param": null}}"#));
    assert!(!openai_error(r#"{"detail": "x"}"#));
    assert!(!openai_error("Bad Request"));
}

/// A plan of one greedy ask and one pool prompt, its reference answers (written by hand), and a
/// run that answered every check as the reference does.
fn judged_case() -> (Plan, judge::Expected, Observed) {
    let ask = |p: &str, n| Ask { prompt: p.into(), max_tokens: n };
    let plan = Plan {
        seed: 1,
        greedy: vec![ask("Once upon", 8)],
        pool: vec![ask("the dog", 4)],
        levels: vec![(2, vec![0, 0])],
        max_context: 256,
        max_seqs: 4,
        disconnect_tokens: 250,
    };
    let want = |t: &str, n, f| judge::Want { text: t.into(), completion_tokens: n, finish: f, near: vec![] };
    let expected = judge::Expected {
        greedy: vec![want(" a time there was a girl", 8, "length")],
        pool: vec![want(" ran to the", 4, "length")],
        burst: want(" a", 1, "length"),
        disconnect: Some(want(" a time there was a girl who", 9, "stop")),
        unsearched: 0,
    };
    let answered = Answered { text: " a time there was a girl".into(), finish: "length".into(), completion_tokens: 8 };
    let ok = |name: &str| Step::Checked { check: checks::check(name, true, "ok") };
    let steps = vec![
        ok("help"),
        ok("health"),
        ok("models"),
        Step::Greedy { answers: vec![Ok(answered.clone())] },
        Step::Streaming {
            answer: Ok(StreamAnswered { text: answered.text.clone(), finish: "length".into(), events: 8, done: true }),
        },
        Step::Stop {
            sent: Some((
                0,
                "there".into(),
                Ok(Answered { text: " a time ".into(), finish: "stop".into(), completion_tokens: 3 }),
            )),
        },
        ok("chat"),
        ok("bad_requests"),
        Step::Burst {
            check: checks::check("burst", true, "1000 requests at once: 1000 completed"),
            texts: vec![(" a".into(), 1000)],
        },
        Step::Alive { answer: Ok(answered) },
        ok("disconnect"),
        ok("keep_alive"),
    ];
    let level = LoadLevel { concurrency: 2, requests: 2, completed: 2, seconds: 0.5, ..Default::default() };
    let answers = vec![(0, " ran to the".into()), (0, " ran to the".into())];
    let levels = vec![LevelRun { level, answers, spans_ms: vec![(10.0, 40.0), (20.0, 110.0)] }];
    (plan, expected, Observed { sandboxed: true, steps, levels, load_average: 0.5, error: String::new() })
}

#[test]
fn the_judge_passes_answers_equal_to_the_reference() {
    let (plan, want, seen) = judged_case();
    let (checks, levels) = judge::judge(&plan, &want, &seen);
    let names: Vec<&str> = checks.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, judge::BATTERY);
    assert!(checks.iter().all(|c| c.passed), "{checks:?}");
    assert_eq!((levels[0].requests, levels[0].completed, levels[0].greedy_mismatches), (2, 2, 0));
    // The reference's 4 tokens each over 0.5 s; TTFT 10 and 20 ms; ITL (40 - 10) / 3 and
    // (110 - 20) / 3 ms.
    let l = &levels[0];
    assert_eq!((l.output_tokens, l.output_tokens_per_s), (8, 16.0));
    assert_eq!((l.ttft_ms_p50, l.ttft_ms_p99, l.itl_ms_p50, l.itl_ms_p99), (10.0, 20.0, 10.0, 30.0));
}

/// A level's figures come from the reference: the server's `usage` (here 100,000 tokens a
/// request) and its level figures are not used, an answer that differs from the reference's adds
/// no tokens and no latency, and ITL is per token however the text was split into events.
#[test]
fn load_figures_count_the_reference_s_tokens_of_answers_equal_to_it() {
    let (plan, want, mut seen) = judged_case();
    let run = &mut seen.levels[0];
    run.level.output_tokens = 200_000;
    run.level.output_tokens_per_s = 400_000.0;
    run.level.itl_ms_p50 = 0.001;
    run.answers[1].1 = " ran to".into();
    let (_, levels) = judge::judge(&plan, &want, &seen);
    let l = &levels[0];
    assert_eq!((l.greedy_mismatches, l.output_tokens, l.output_tokens_per_s), (1, 4, 8.0));
    assert_eq!((l.ttft_ms_p50, l.itl_ms_p50, l.itl_ms_p99), (10.0, 10.0, 10.0));
}

#[test]
fn the_judge_fails_each_answer_that_differs_and_each_check_not_recorded() {
    let (plan, want, mut seen) = judged_case();
    // A stop string ignored: the whole answer came back, finish "length".
    seen.steps[5] = Step::Stop {
        sent: Some((
            0,
            "there".into(),
            Ok(Answered { text: " a time there was a girl".into(), finish: "length".into(), completion_tokens: 8 }),
        )),
    };
    // Streaming that stops early, without [DONE].
    seen.steps[4] = Step::Streaming {
        answer: Ok(StreamAnswered { text: " a time".into(), finish: String::new(), events: 2, done: false }),
    };
    // The greedy step missing altogether, in a run that reports no error.
    seen.steps.remove(3);
    // Under load: one answer differs, one names a prompt the plan does not have.
    seen.levels[0].answers = vec![(0, " ran to a".into()), (5, " ran to the".into())];
    let (checks, levels) = judge::judge(&plan, &want, &seen);
    let failed: Vec<(&str, &str)> =
        checks.iter().filter(|c| !c.passed).map(|c| (c.name.as_str(), c.detail.as_str())).collect();
    assert_eq!(failed.len(), 3, "{failed:?}");
    assert!(failed[0].0 == "streaming" && failed[0].1.contains("[DONE] false"), "{failed:?}");
    // The stop string is cut from the server's own greedy answer; without that answer it cannot
    // be judged.
    assert_eq!(failed[1], ("stop", "stop \"there\" is not in greedy answer 0"));
    assert_eq!(failed[2], ("greedy", "not recorded by the run"));
    assert_eq!(levels[0].greedy_mismatches, 2);

    // With the greedy answer back, the ignored stop string fails on its own.
    let (_, _, mut seen) = judged_case();
    seen.steps[5] = Step::Stop {
        sent: Some((
            0,
            "there".into(),
            Ok(Answered { text: " a time there was a girl".into(), finish: "length".into(), completion_tokens: 8 }),
        )),
    };
    let (checks, _) = judge::judge(&plan, &want, &seen);
    let stop = checks.iter().find(|c| c.name == "stop").unwrap();
    assert!(!stop.passed && stop.detail.ends_with("expected \" a time \" (stop)"), "{stop:?}");
}

/// The burst's completions are judged here against the reference's one-token answer: a server
/// that answers some of its thousand requests with another text (cross-talk under load) fails,
/// and a burst recorded as passed where the server ran is not taken.
#[test]
fn the_burst_s_completions_are_the_reference_s() {
    let (plan, want, mut seen) = judged_case();
    let burst = |seen: &Observed| {
        let (checks, _) = judge::judge(&plan, &want, seen);
        checks.into_iter().find(|c| c.name == "burst").unwrap()
    };
    let c = burst(&seen);
    assert!(c.passed && c.detail.ends_with("every completion is the reference's \" a\""), "{c:?}");
    let passed_there = checks::check("burst", true, "1000 requests at once: 1000 completed");
    seen.steps[8] = Step::Burst { check: passed_there.clone(), texts: vec![(" a".into(), 990), (" ran".into(), 10)] };
    let c = burst(&seen);
    assert!(!c.passed && c.detail.ends_with("one-token answer \" a\": 10 answered \" ran\""), "{c:?}");
    seen.steps[8] = Step::Checked { check: passed_there };
    let c = burst(&seen);
    assert!(!c.passed && c.detail.contains("only the judge here decides it"), "{c:?}");
    // A burst that failed there (or was not sent) fails as it was recorded.
    seen.steps[8] = Step::Checked { check: checks::check("burst", false, "not sent: the server had exited") };
    assert_eq!(burst(&seen).detail, "not sent: the server had exited");
}

/// A disconnect check that could not tell (the full-length request took under 20 ms) passes only
/// when that request's answer is the reference's: a server answering it at once with anything
/// fails, and such a check recorded as passed where the server ran is not taken.
#[test]
fn a_disconnect_check_that_could_not_tell_needs_the_reference_s_full_answer() {
    let (plan, want, mut seen) = judged_case();
    let at =
        seen.steps.iter().position(|s| matches!(s, Step::Checked { check } if check.name == "disconnect")).unwrap();
    let disconnect = |seen: &Observed| {
        let (checks, _) = judge::judge(&plan, &want, seen);
        checks.into_iter().find(|c| c.name == "disconnect").unwrap()
    };
    let c =
        checks::check("disconnect", true, format!("{}: one request of 9 tokens takes 3.0 ms", checks::NOT_OBSERVABLE));
    let answered = |text: &str, n| Answered { text: text.into(), finish: "stop".into(), completion_tokens: n };
    seen.steps[at] = Step::Disconnect { check: c.clone(), full: answered(" a time there was a girl who", 9) };
    assert!(judge::needs_full_answer(&seen));
    assert!(disconnect(&seen).passed);
    seen.steps[at] = Step::Disconnect { check: c.clone(), full: answered("", 9) };
    let d = disconnect(&seen);
    assert!(
        !d.passed && d.detail.ends_with("the reference \" a time there was a girl who\" (9 tokens, stop)"),
        "{d:?}"
    );
    seen.steps[at] = Step::Checked { check: c };
    let d = disconnect(&seen);
    assert!(!d.passed && d.detail.contains("only the judge here decides it"), "{d:?}");
}

#[test]
fn the_judge_takes_from_the_run_only_the_checks_that_need_no_reference() {
    let (plan, want, mut seen) = judged_case();
    // A record claiming the greedy check passed where the server ran, and a load test of other
    // levels than the plan's.
    seen.steps[3] = Step::Checked { check: checks::check("greedy", true, "trust me") };
    seen.levels[0].level.concurrency = 3;
    let (checks, _) = judge::judge(&plan, &want, &seen);
    let failed: Vec<(&str, &str)> =
        checks.iter().filter(|c| !c.passed).map(|c| (c.name.as_str(), c.detail.as_str())).collect();
    assert_eq!(
        failed,
        [
            ("greedy", "recorded as decided where the server ran; only the judge here decides it"),
            // The stop string was cut from a greedy answer the record no longer holds.
            ("stop", "stop \"there\" is not in greedy answer 0"),
            ("load", "the plan's load levels are concurrency [2], the run recorded [3]"),
        ]
    );
}

#[test]
fn a_plan_out_of_bounds_is_refused_naming_the_field_and_long_answers_are_cut() {
    let (plan, _, _) = judged_case();
    assert!(plan.check().is_ok());
    let refused = |p: Plan| p.check().unwrap_err().message;
    assert!(refused(Plan { greedy: vec![], ..plan.clone() }).contains("greedy asks must be 1..=8"));
    assert!(refused(Plan { levels: vec![(0, vec![0])], ..plan.clone() }).contains("level of concurrency 0"));
    assert!(refused(Plan { levels: vec![(1, vec![1])], ..plan.clone() }).contains("each picking one of the 1 pool"));
    assert!(refused(Plan { levels: vec![(1, vec![0]); 9], ..plan.clone() }).contains("9 levels, at most 8"));
    assert!(refused(Plan { max_context: 1 << 40, ..plan.clone() }).contains("max_context"));
    // A recorded text is cut at a character boundary below the bound, and marked.
    let long = "é".repeat(wire::MAX_RECORDED_TEXT);
    let cut = wire::recorded(long);
    assert!(cut.ends_with(" [cut: longer than the recorded bound]"));
    assert_eq!(cut.len(), wire::MAX_RECORDED_TEXT + " [cut: longer than the recorded bound]".len());
    assert_eq!(wire::recorded("short".into()), "short");
}

/// A hand-made model of three letters (a, b, c) and an EOS: each token is followed by the next
/// letter (a, b, c, a, ...) with logit 1, all others 0, except the letter `near` (or, with
/// `every`, the letter after the next) 5e-4 behind (within `oracle::GREEDY_TIE`) after two
/// tokens (or, with `every`, after every token). Its tokenizer is the letters themselves; it
/// counts the reference runs in `runs`.
struct Letters {
    near: u32,
    every: bool,
    runs: std::cell::Cell<usize>,
}

impl Letters {
    const EOS: u32 = 3;

    fn new(near: u32, every: bool) -> Self {
        Self { near, every, runs: std::cell::Cell::new(0) }
    }

    fn encode(p: &str) -> Result<Vec<u32>> {
        Ok(p.bytes().map(|b| u32::from(b - b'a')).collect())
    }

    fn decode(ids: &[u32]) -> Result<String> {
        Ok(ids.iter().filter(|&&t| t != Self::EOS).map(|&t| char::from(b'a' + t as u8)).collect())
    }

    fn greedy(&self, ids: &[u32], n: usize) -> Result<(Vec<Vec<f64>>, Vec<u32>)> {
        self.runs.set(self.runs.get() + 1);
        let (mut ids, mut rows, mut toks) = (ids.to_vec(), Vec::new(), Vec::new());
        for _ in 0..n {
            let next = (ids.last().unwrap() + 1) % 3;
            let mut row = vec![0.0; 4];
            row[next as usize] = 1.0;
            if self.every {
                row[((next + 1) % 3) as usize] = 1.0 - 5e-4;
            } else if ids.len() == 2 {
                row[self.near as usize] = 1.0 - 5e-4;
            }
            rows.push(row);
            toks.push(next);
            ids.push(next);
        }
        Ok((rows, toks))
    }

    /// The reference's answers to `plan` with the near-tie paths to the answers in `seen`.
    fn expected(&self, plan: &Plan, seen: &Observed) -> judge::Expected {
        judge::expected(plan, &[Self::EOS], Self::encode, Self::decode, |i, n| self.greedy(i, n), seen).unwrap()
    }
}

/// A plan of one greedy ask, `prompt` of `n` tokens, and a run that answered it with `texts`
/// (finish "length", `n` tokens, as the letters' model never ends).
fn letters_case(prompt: &str, n: usize, texts: &[&str]) -> (Plan, Observed) {
    let plan = Plan {
        seed: 1,
        greedy: vec![Ask { prompt: prompt.into(), max_tokens: n }],
        pool: vec![Ask { prompt: prompt.into(), max_tokens: n }],
        levels: vec![],
        max_seqs: 1,
        max_context: 512,
        disconnect_tokens: n,
    };
    let answered = |t: &str| Ok(Answered { text: t.into(), finish: "length".into(), completion_tokens: n });
    let steps = vec![Step::Greedy { answers: vec![answered(texts[0])] }];
    let level = LoadLevel { concurrency: 1, requests: texts.len(), completed: texts.len(), ..Default::default() };
    let levels = vec![LevelRun { level, answers: texts.iter().map(|t| (0, (*t).into())).collect(), spans_ms: vec![] }];
    (plan, Observed { sandboxed: true, steps, levels, load_average: 0.0, error: String::new() })
}

/// The reference's near-ties become accepted answers, only those the server gave: on the letters'
/// model with a near-tie after two tokens, the answer to "a" of 3 tokens is "bca"; the server's
/// "bab" takes the near-tie and is accepted, "bcb" is not (no near-tie where it leaves "bca");
/// an EOS taken at a near-tie ends the answer there.
#[test]
fn near_ties_of_the_reference_are_accepted_answers() {
    let m = Letters::new(0, false);
    let (plan, seen) = letters_case("a", 3, &["bab", "bcb", "bca"]);
    let e = m.expected(&plan, &seen);
    let w = &e.greedy[0];
    assert_eq!((w.text.as_str(), w.finish), ("bca", "length"));
    let near: Vec<&str> = w.near.iter().map(|n| n.text.as_str()).collect();
    assert_eq!(near, ["bab"]);
    let accepted = |t: &str| w.accepts(|m| m.text == t).map(|m| m.text.clone());
    assert_eq!(accepted("bab").as_deref(), Some("bab"));
    assert_eq!(accepted("bca").as_deref(), Some("bca"));
    assert_eq!(accepted("bcb"), None);
    assert_eq!(e.pool[0].near.len(), 1);
    // The level's three answers: "bcb" is the one mismatch.
    let (_, levels) = judge::judge(&plan, &e, &seen);
    assert_eq!(levels[0].greedy_mismatches, 1);
    // One greedy run per ask (greedy, pool, burst) and one branch per ask that found "bab": the
    // wrong "bcb" left the greedy path at a step with no near-tie and cost no run.
    assert_eq!((m.runs.get(), e.unsearched), (3 + 2, 0));
    // The burst's one-token answer has no near-tie at its only step.
    assert!(e.burst.near.is_empty());
    // A near-tie with the EOS token: the answer stops there, after 2 tokens.
    let m = Letters::new(Letters::EOS, false);
    let mut seen = letters_case("a", 3, &["b"]).1;
    seen.steps = vec![Step::Greedy {
        answers: vec![Ok(Answered { text: "b".into(), finish: "stop".into(), completion_tokens: 2 })],
    }];
    let e = m.expected(&plan, &seen);
    let n = &e.greedy[0].near[0];
    assert_eq!((n.text.as_str(), n.completion_tokens, n.finish), ("b", 2, "stop"));
    // The same text with a token count the path does not have is not accepted.
    seen.steps = vec![Step::Greedy {
        answers: vec![Ok(Answered { text: "b".into(), finish: "stop".into(), completion_tokens: 3 })],
    }];
    assert!(m.expected(&plan, &seen).greedy[0].near.is_empty());
}

/// An answer may take any number of near-ties: on the letters' model with the letter after the
/// next 5e-4 behind at every step, the answer to "a" of 3 tokens is "bca"; "cac" takes near-ties at
/// its first and last steps and is accepted, "caa" is not (no letter follows itself). Of 400
/// tokens, an answer that takes a near-tie at every step ("cbacba...") needs 399 branches of 401
/// reference positions (the one-letter prompt and 400 tokens), beyond what the search may spend
/// (`judge::MAX_SEARCH_POSITIONS`): it is judged unequal and the level says why; one that takes
/// 10 (every 40th step, the last at the last step, where a branch costs no run) is accepted.
#[test]
fn an_answer_may_take_several_near_ties_within_the_search_budget() {
    let m = Letters::new(0, true);
    let (plan, seen) = letters_case("a", 3, &["cac", "caa"]);
    let e = m.expected(&plan, &seen);
    let near: Vec<&str> = e.greedy[0].near.iter().map(|n| n.text.as_str()).collect();
    assert_eq!(near, ["cac"]);
    let (checks, levels) = judge::judge(&plan, &e, &seen);
    assert!(checks.iter().any(|c| c.name == "greedy" && c.passed), "{checks:?}");
    assert_eq!(levels[0].greedy_mismatches, 1);
    assert_eq!(e.unsearched, 0);

    let n = 400;
    let all_ties: String = "cba".chars().cycle().take(n).collect();
    let mut ten = String::new();
    let mut last = 0u8;
    for i in 1..=n {
        last = (last + if i % 40 == 0 { 2 } else { 1 }) % 3;
        ten.push(char::from(b'a' + last));
    }
    let m = Letters::new(0, true);
    let (plan, seen) = letters_case("a", n, &[&ten, &all_ties]);
    let e = m.expected(&plan, &seen);
    let near: Vec<&str> = e.greedy[0].near.iter().map(|n| n.text.as_str()).collect();
    assert_eq!(near, [ten.as_str()]);
    assert!(e.pool[0].accepts(|w| w.text == ten).is_some());
    assert!(e.pool[0].accepts(|w| w.text == all_ties).is_none());
    assert_eq!(e.unsearched, 1);
    // Runs: one greedy run per ask (greedy, pool, burst); 9 branches for "ten" in each of the
    // greedy and the pool ask; then "all_ties" branches while the budget lasts.
    let branch = 1 + n;
    let spent = 2 * 9 * branch;
    assert_eq!(m.runs.get(), 3 + 18 + (judge::MAX_SEARCH_POSITIONS - spent) / branch);
    let (_, levels) = judge::judge(&plan, &e, &seen);
    assert_eq!(levels[0].greedy_mismatches, 1);
    assert!(
        levels[0].errors.iter().any(|e| e.contains("without a finished near-tie search")),
        "{:?}",
        levels[0].errors
    );
}

/// A server may hold back the bytes of a character its answer's last token left incomplete: the
/// reference's text then ends in U+FFFD, the server's without it.
#[test]
fn an_answer_that_holds_back_an_incomplete_last_character_is_the_reference_s() {
    assert!(judge::same_text("ab", "ab"));
    assert!(judge::same_text("ab", "ab\u{FFFD}"));
    assert!(judge::same_text("ab\u{FFFD}", "ab\u{FFFD}"));
    assert!(!judge::same_text("a", "ab\u{FFFD}"));
    assert!(!judge::same_text("ab", "a\u{FFFD}b"));
    assert!(!judge::same_text("ab\u{FFFD}", "ab"));
}
