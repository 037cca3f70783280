//! The battery and the load test as the client runs them, where the server is (here, or on the
//! device machine from a bundle): start the engine's server, send the [`Plan`], record what came
//! back. Checks that need no reference are decided here; answers that must equal the reference are
//! recorded for the judge ([`super::judge`]), which alone knows the expected text.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::checks::{BURST, burst, check, disconnect, help_check, keep_alive, openai_error};
use super::client::Client;
use super::load::{load_average, load_level};
use super::wire::Step;
use super::wire::{Answered, Ask, Observed, Plan, StreamAnswered, recorded};
use base::error::Result;
use harness::{Budget, Grants, Workshop};

/// Run the battery and the load test against the engine's binary `exe`, started by `workshop`
/// (sandboxed: it may read `exe`, `reads` and write `scratch`; it listens on a free loopback port)
/// as `exe serve --model MODEL --host 127.0.0.1 --port P`. The server is stopped when this
/// returns, when `budget` runs out or when the call is cancelled.
///
/// # Errors
/// When the help check's or the server's process cannot be started, or the sandbox refuses.
pub(super) fn observe(
    workshop: &Workshop,
    exe: &Path,
    model: &Path,
    reads: &[PathBuf],
    plan: &Plan,
    scratch: &Path,
    budget: &Budget,
) -> Result<Observed> {
    let mut seen =
        Observed { sandboxed: false, steps: vec![], levels: vec![], load_average: -1.0, error: String::new() };
    let checked = |c| Step::Checked { check: c };
    // component.openai_server: the binary explains itself before it is asked to serve.
    let help = help_check(workshop, exe, scratch, budget)?;
    if !help.passed {
        seen.error = format!("the engine's binary does not explain itself: {}", help.detail);
        seen.steps.push(checked(help));
        return Ok(seen);
    }
    seen.steps.push(checked(help));

    let port = harness::free_loopback_port()?;
    let mut grants = Grants::harness(exe, scratch);
    for p in reads {
        grants = grants.read(p);
    }
    grants.listen = Some(port);
    let args: Vec<std::ffi::OsString> = vec![
        "serve".into(),
        "--model".into(),
        model.as_os_str().to_owned(),
        "--host".into(),
        "127.0.0.1".into(),
        "--port".into(),
        port.to_string().into(),
    ];
    let server = std::sync::Arc::new(workshop.start_server(exe, &args, &grants, scratch)?);
    seen.sandboxed = server.sandboxed;
    // The server ends when the call's budget runs out or the call is cancelled, so no request
    // waits past them (each request's own limit is also what is left of the budget).
    let watch = harness::Watch::start(server.clone(), budget);
    let client = Client::new(port, budget.deadline);
    let died = |server: &harness::ServerProcess| {
        server.exited().map(|e| {
            let why = match e {
                harness::Exit::Code(Some(c)) => format!("exited with status {c}"),
                _ => "was killed by a signal".to_string(),
            };
            format!("the server {why}; stderr (tail):\n{}", server.stderr_tail(4000))
        })
    };
    // 1. health: up within 60 s (or the budget).
    let until = Instant::now() + Duration::from_secs(60);
    let mut up = false;
    while Instant::now() < until.min(budget.deadline) && !budget.cancel.load(Ordering::Relaxed) {
        if let Some(why) = died(&server) {
            seen.error = format!("the server exited before answering /health: {why}");
            break;
        }
        if client.get("/health").is_ok_and(|a| a.status == 200) {
            up = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    if !up {
        if seen.error.is_empty() {
            seen.error = format!(
                "the server did not answer GET /health with 200 on 127.0.0.1:{port} within 60 s; stderr (tail):\n{}",
                server.stderr_tail(4000)
            );
        }
        seen.steps.push(checked(check("health", false, seen.error.clone())));
        return Ok(seen);
    }
    seen.steps.push(checked(check("health", true, format!("GET /health: 200 on 127.0.0.1:{port}"))));

    // 2. models.
    let models = client.get("/v1/models");
    let model_id = models
        .as_ref()
        .ok()
        .filter(|a| a.status == 200)
        .and_then(|a| serde_json::from_str::<Value>(&a.body).ok())
        .and_then(|v| v["data"][0]["id"].as_str().map(str::to_string));
    seen.steps.push(checked(match (&models, &model_id) {
        (_, Some(id)) => check("models", true, format!("GET /v1/models lists {id:?}")),
        (Ok(a), None) => {
            check("models", false, format!("GET /v1/models answered {}: {}", a.status, harness::tail(&a.body, 300)))
        }
        (Err(e), None) => check("models", false, e.clone()),
    }));

    // 3. greedy completions (judged against the reference).
    let completion = |e: &Ask, extra: Value| -> std::result::Result<Answered, String> {
        let mut body = json!({"prompt": e.prompt, "max_tokens": e.max_tokens, "temperature": 0});
        if let (Some(b), Some(x)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(x.clone());
        }
        let a = client.post("/v1/completions", &body.to_string())?;
        if a.status != 200 {
            return Err(format!("answered {}: {}", a.status, harness::tail(&a.body, 300)));
        }
        let v: Value = serde_json::from_str(&a.body).map_err(|e| format!("the body is not JSON: {e}"))?;
        let c = &v["choices"][0];
        let text = c["text"].as_str().ok_or("choices[0].text is missing")?.to_string();
        let finish = c["finish_reason"].as_str().unwrap_or("").to_string();
        let n = v["usage"]["completion_tokens"].as_u64().ok_or("usage.completion_tokens is missing")? as usize;
        Ok(Answered { text: recorded(text), finish, completion_tokens: n })
    };
    let answers: Vec<_> = plan.greedy.iter().map(|e| completion(e, json!({}))).collect();

    // 4. streaming (judged against the reference).
    let e0 = &plan.greedy[0];
    let streamed = client
        .stream(&json!({"prompt": e0.prompt, "max_tokens": e0.max_tokens, "temperature": 0, "stream": true}))
        .map(|s| StreamAnswered {
            text: recorded(s.text()),
            finish: s.finish.clone(),
            events: s.pieces.len(),
            done: s.done,
        });

    // 5. a stop string cut from the middle of the server's own greedy answer.
    let stop = answers.iter().enumerate().find_map(|(i, a)| {
        let text = &a.as_ref().ok()?.text;
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        (chars.len() >= 4).then(|| {
            let from = chars[chars.len() / 2].0;
            let to = chars.get(chars.len() / 2 + 2).map_or(text.len(), |c| c.0);
            (i, text[from..to].to_string())
        })
    });
    let stop = stop.map(|(i, s)| {
        let answer = completion(&plan.greedy[i], json!({"stop": [s]}));
        (i, s, answer)
    });
    seen.steps.push(Step::Greedy { answers });
    seen.steps.push(Step::Streaming { answer: streamed });
    seen.steps.push(Step::Stop { sent: stop });

    // 6. chat.
    let chat = client.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": e0.prompt}], "max_tokens": 8, "temperature": 0}).to_string(),
    );
    seen.steps.push(checked(match chat {
        Ok(a) if a.status == 200 => {
            let v: Value = serde_json::from_str(&a.body).unwrap_or(Value::Null);
            let ok = v["object"] == "chat.completion"
                && v["choices"][0]["message"]["role"] == "assistant"
                && v["choices"][0]["message"]["content"].is_string()
                && v["usage"]["completion_tokens"].is_u64();
            check(
                "chat",
                ok,
                if ok {
                    "chat.completion with an assistant message and usage".into()
                } else {
                    format!("not a chat.completion: {}", harness::tail(&a.body, 300))
                },
            )
        }
        Ok(a) => check("chat", false, format!("answered {}: {}", a.status, harness::tail(&a.body, 300))),
        Err(why) => check("chat", false, why),
    }));

    // 7. bad requests: 4xx in OpenAI's shape.
    let long_prompt = "the ".repeat(plan.max_context * 2);
    let bads: Vec<(&str, String)> = vec![
        ("malformed JSON", "{\"prompt\": ".to_string()),
        ("negative max_tokens", json!({"prompt": e0.prompt, "max_tokens": -5}).to_string()),
        ("absurd max_tokens", json!({"prompt": e0.prompt, "max_tokens": 1_000_000_000u64}).to_string()),
        ("temperature 5", json!({"prompt": e0.prompt, "temperature": 5}).to_string()),
        ("top_p 0", json!({"prompt": e0.prompt, "top_p": 0}).to_string()),
        ("unknown model", json!({"prompt": e0.prompt, "model": "no-such-model"}).to_string()),
        ("prompt longer than the context", json!({"prompt": long_prompt, "max_tokens": 4}).to_string()),
    ];
    let mut wrong = Vec::new();
    for (what, body) in &bads {
        match client.post("/v1/completions", body) {
            Ok(a) if (400..500).contains(&a.status) && openai_error(&a.body) => {}
            Ok(a) => wrong.push(format!("{what}: answered {} {}", a.status, harness::tail(&a.body, 200))),
            Err(why) => wrong.push(format!("{what}: {why}")),
        }
    }
    seen.steps.push(checked(if wrong.is_empty() {
        check("bad_requests", true, format!("{} bad requests answered 4xx with an OpenAI error object", bads.len()))
    } else {
        check(
            "bad_requests",
            false,
            format!("not answered 4xx with {{\"error\": {{\"message\", \"type\"}}}}: {}", wrong.join("; ")),
        )
    }));

    // 8. a burst: BURST requests at once, each answered or refused with a 4xx, none lost; the
    // completions' texts are judged against the reference.
    seen.steps.push(if died(&server).is_some() {
        checked(check("burst", false, "not sent: the server had exited"))
    } else {
        let b = burst(&client, &e0.prompt, BURST);
        let passed = b.wrong.is_empty() && b.completed > 0;
        let mut detail =
            format!("{BURST} requests at once: {} completed, {} refused with a 4xx in OpenAI's shape", b.completed, b.refused);
        if b.retried > 0 {
            detail += &format!(" ({} lost at the connection and sent again once)", b.retried);
        }
        if !b.wrong.is_empty() {
            detail += &format!(
                "; {} neither (component.openai_server: each is answered or refused with a 4xx, and the server keeps serving), e.g. {}",
                b.wrong_count,
                b.wrong.join("; ")
            );
        } else if b.completed == 0 {
            detail += "; none completed";
        }
        Step::Burst { check: check("burst", passed, detail), texts: b.texts.into_iter().collect() }
    });

    // 9. alive afterwards (its answer judged against the reference).
    let alive = match died(&server) {
        Some(why) => {
            seen.steps.push(checked(check("alive", false, why)));
            false
        }
        None => {
            let answer = completion(e0, json!({}));
            let ok = answer.is_ok();
            seen.steps.push(Step::Alive { answer });
            ok
        }
    };

    // 10. a client that goes away cancels its request.
    if alive {
        seen.steps.push(match disconnect(&client, &e0.prompt, plan.disconnect_tokens, plan.max_seqs.clamp(1, 64)) {
            (c, Some(full)) => Step::Disconnect { check: c, full },
            (c, None) => checked(c),
        });
        if let Some(why) = died(&server) {
            seen.steps.push(checked(check("alive", false, format!("after the dropped clients: {why}"))));
        }
    }

    // 11. reused connections answer as fast as fresh ones.
    if alive && died(&server).is_none() {
        let fresh = Client::fresh(port, budget.deadline);
        let body = json!({"prompt": e0.prompt, "max_tokens": e0.max_tokens.min(4), "temperature": 0, "stream": true});
        seen.steps.push(checked(keep_alive(&client, &fresh, &body)));
    }

    // 12. load.
    if alive {
        seen.load_average = load_average();
        for (c, picks) in &plan.levels {
            if budget.cancel.load(Ordering::Relaxed) || Instant::now() >= budget.deadline {
                seen.error = format!("the call's time ran out or it was cancelled before load level {c}");
                break;
            }
            seen.levels.push(load_level(&client, &plan.pool, *c, picks));
            if died(&server).is_some() {
                break;
            }
        }
        if let Some(why) = died(&server) {
            seen.error = format!("the server died under load: {why}");
        }
    }
    if let Some(why) = watch.fired() {
        seen.error = format!("{why}: the engine's server was stopped; checks after that point failed for that reason");
    }
    drop(watch);
    drop(server);
    Ok(seen)
}
