//! serve_engine (CLI `metainfer load-test`): builds the engine's binary, starts its
//! OpenAI-compatible server on a loopback port (sandboxed, its process group killed when the gate
//! ends: `harness::ServerProcess`), runs a conformance battery, then a load test.
//!
//! The battery (component.openai_server): `/health` and `/v1/models`; greedy completions of drawn
//! prompts equal the f64 reference's greedy text, token count and finish reason (EOS honoured);
//! streaming equals non-streaming and ends with `[DONE]`; a stop string cuts the text before it with
//! finish_reason "stop"; chat completions answer in OpenAI's shape; bad requests (malformed JSON,
//! negative or absurd max_tokens, temperature, top_p, an unknown model, a prompt longer than the
//! context) are answered 4xx with an `{"error": {"message", "type"}}` body; the server is alive
//! afterwards and still answers greedy requests correctly; streaming requests on reused keep-alive
//! connections are answered as fast as on fresh ones (TCP_NODELAY, [`KEEP_ALIVE_EXCESS_MS`]).
//!
//! The load test: at each concurrency level, that many clients send streaming greedy completions of
//! drawn prompts back to back over pooled keep-alive connections, as real clients send them; it reports output tokens/s, requests/s, time to first token (TTFT) and
//! inter-token latency (ITL: time between successive text chunks) at p50 and p99 (nearest rank), and
//! checks every output under load against the reference. Figures are measurements of this machine
//! under its current load; no test asserts them.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::gate::{Gate, Runs, Spec, Tool, Verdict as GateVerdict};
use super::{Ctx, Report};
use base::error::{Error, Result};
use harness::{Budget, Grants};
use ledger::figures::{Figures, ServeFigures};
use oracle::llama::Reference;

mod checks;
mod client;
mod load;
#[cfg(test)]
mod tests;

pub use checks::{BURST, KEEP_ALIVE_EXCESS_MS, KEEP_ALIVE_ROUNDS};
pub use client::{MAX_ANSWER_BYTES, MAX_EVENT_LINE, MAX_STREAM_BYTES};

use checks::{burst, check, disconnect, help_check, keep_alive, openai_error};
use client::Client;
use load::{load_average, load_level};

/// What to serve and how hard to load it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
pub struct ServeRequest {
    /// Engine crate directory (its metainfer.toml must have a `[serving]` table; its binary takes
    /// `serve --model DIR --host H --port P`).
    pub engine: String,
    /// Hugging Face model directory with real weights.
    pub model: String,
    /// Concurrency levels of the load test, each 1..=64 (default 1, 4, 16).
    #[serde(default)]
    pub concurrency: Option<Vec<usize>>,
    /// Requests per level (default twice the level's concurrency).
    #[serde(default)]
    pub requests: Option<usize>,
    /// New tokens per load-test request, 1..=256 (default 16).
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// Seed of the drawn prompts (below 2^53; a decimal string is accepted too); absent: fresh, reported.
    #[serde(default, deserialize_with = "base::util::de_seed")]
    pub seed: Option<u64>,
    /// Weight dtype to build the engine for; absent: the engine's own.
    #[serde(default)]
    pub dtype: Option<String>,
}

/// One check of the conformance battery.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct Check {
    /// Short name (help, health, models, greedy, streaming, stop, chat, bad_requests, burst, alive,
    /// disconnect, keep_alive).
    pub name: String,
    /// Whether it passed.
    pub passed: bool,
    /// What was sent and seen; on failure, what differs.
    pub detail: String,
}

/// One concurrency level of the load test.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
pub struct LoadLevel {
    /// Clients sending at once.
    pub concurrency: usize,
    /// Requests sent.
    pub requests: usize,
    /// Requests answered completely (streamed to `[DONE]`).
    pub completed: usize,
    /// Completions whose text differs from the reference's greedy text.
    pub greedy_mismatches: usize,
    /// Completion tokens (from `usage`) over all requests.
    pub output_tokens: usize,
    /// Wall time of the level, seconds.
    pub seconds: f64,
    /// Output tokens per second of wall time.
    pub output_tokens_per_s: f64,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Time to first token, median, milliseconds.
    pub ttft_ms_p50: f64,
    /// Time to first token, 99th percentile (nearest rank), milliseconds.
    pub ttft_ms_p99: f64,
    /// Inter-token latency, median, milliseconds.
    pub itl_ms_p50: f64,
    /// Inter-token latency, 99th percentile, milliseconds.
    pub itl_ms_p99: f64,
    /// The first failures in words (at most 4).
    pub errors: Vec<String>,
}

/// serve_engine's result.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ServeReport {
    /// Whether every check passed and every load-test request completed with the reference's text.
    pub passed: bool,
    /// Seed of this run.
    pub seed: u64,
    /// Weight dtype the engine was built for and the reference ran at.
    pub dtype: String,
    /// Whether the server ran in the enforced sandbox.
    pub sandboxed: bool,
    /// The conformance battery, in order.
    pub checks: Vec<Check>,
    /// The load test, one entry per concurrency level.
    pub levels: Vec<LoadLevel>,
    /// Load average (1 minute) of the machine when the load test started; -1 when unknown.
    pub load_average: f64,
    /// What stopped the gate (build, no binary, server exit), "" when nothing did.
    pub error: String,
    /// Rule findings (check_rules); a blocking one stops the gate.
    pub rules: Vec<guard::Finding>,
}

impl Report for ServeReport {
    fn passed(&self) -> bool {
        self.passed
    }
    fn text(&self) -> String {
        let ok = self.checks.iter().filter(|c| c.passed).count();
        let mut s = format!(
            "serve_engine {}: {ok}/{} conformance checks (seed {}, {} weights, sandboxed {})\n",
            if self.passed { "PASSED" } else { "FAILED" },
            self.checks.len(),
            self.seed,
            self.dtype,
            self.sandboxed
        );
        if !self.error.is_empty() {
            s += &format!("{}\n", self.error);
        }
        for c in &self.checks {
            s += &format!("{} {}: {}\n", if c.passed { "ok  " } else { "FAIL" }, c.name, c.detail);
        }
        if !self.levels.is_empty() {
            s += &format!(
                "load (machine load average {:.1}; medians and p99 over requests of this run):\n",
                self.load_average
            );
        }
        for l in &self.levels {
            s += &format!(
                "  concurrency {:>2}: {:>8.1} output tokens/s, {:>6.2} requests/s, TTFT p50 {:.1} ms p99 {:.1} ms, ITL p50 {:.1} ms p99 {:.1} ms; {}/{} completed, {} differ from the reference\n",
                l.concurrency,
                l.output_tokens_per_s,
                l.requests_per_s,
                l.ttft_ms_p50,
                l.ttft_ms_p99,
                l.itl_ms_p50,
                l.itl_ms_p99,
                l.completed,
                l.requests,
                l.greedy_mismatches
            );
            for e in &l.errors {
                s += &format!("    {e}\n");
            }
        }
        if let (Some(first), Some(last)) = (self.levels.first(), self.levels.last())
            && self.levels.len() > 1
            && first.output_tokens_per_s > 0.0
        {
            s += &format!(
                "throughput ratio concurrency {} / {}: {:.2}x\n",
                last.concurrency,
                first.concurrency,
                last.output_tokens_per_s / first.output_tokens_per_s
            );
        }
        s
    }
}

/// Words the drawn prompts are made of (plain English, in every tokenizer's vocabulary).
const WORDS: &[&str] = &[
    "Once", "upon", "a", "time", "there", "was", "little", "girl", "boy", "dog", "cat", "sun", "happy", "played",
    "the", "park", "with", "her", "his", "friend", "and", "they", "went", "to", "see", "big", "tree",
];

/// A prompt of 2..=7 words drawn from [`WORDS`].
fn draw_prompt(rng: &mut ChaCha8Rng) -> String {
    let n = rng.random_range(2..=7);
    (0..n).map(|_| WORDS[rng.random_range(0..WORDS.len())]).collect::<Vec<_>>().join(" ")
}

/// The reference's greedy completion of one prompt, as the server must answer it.
#[derive(Debug, Clone)]
struct Expected {
    prompt: String,
    max_tokens: usize,
    text: String,
    completion_tokens: usize,
    finish: &'static str,
}

/// Run serve_engine.
///
/// # Errors
/// Not a crate, no `[serving]` table, bad levels, an unreadable model, a path outside the
/// workspace, or a process that cannot be started. An engine without a binary, one that does not
/// build, a server that dies or answers wrongly is a report.
pub fn serve_engine(ctx: &Ctx, req: &ServeRequest, budget: &Budget) -> Result<ServeReport> {
    let live = ctx.live();
    let ctx = &*live;
    let mut gate = Gate::open(ctx, Tool::Serve, &req.engine, req.dtype.as_deref(), budget)?;
    if gate.target.serving.is_none() {
        return Err(Error::usage(format!(
            "{}: metainfer.toml has no [serving] table; serve_engine checks engines built with serving constraints (scaffold with --max-seqs and --max-context)",
            gate.engine.dir.display()
        )));
    }
    let levels = req.concurrency.clone().unwrap_or_else(|| vec![1, 4, 16]);
    if levels.is_empty() || levels.iter().any(|&c| c == 0 || c > 64) {
        return Err(Error::usage(format!("concurrency levels must be 1..=64, got {levels:?}")));
    }
    let max_tokens = req.max_tokens.unwrap_or(16);
    if max_tokens == 0 || max_tokens > 256 {
        return Err(Error::usage(format!("max_tokens must be 1..=256, got {max_tokens}")));
    }
    if req.requests == Some(0) || req.requests.is_some_and(|r| r > 1024) {
        return Err(Error::usage("requests must be 1..=1024".to_string()));
    }
    let ck = super::checkpoint::Checkpoint::open(ctx, &req.model)?;
    let cfg = &ck.cfg;
    let model_dir = ck.path().to_path_buf();
    gate.same_family(&model_dir, &cfg.family)?;
    let seed = req.seed.unwrap_or_else(base::util::fresh_seed);
    gate.seed = Some(seed);
    gate.contracts(&[cfg.family.as_str(), "component.openai_server", "component.scheduler", "kernel.sample"]);
    let dtype = gate.target.dtype.clone();
    let report = ServeReport {
        passed: false,
        seed,
        dtype: dtype.clone(),
        sandboxed: false,
        checks: vec![],
        levels: vec![],
        load_average: -1.0,
        error: String::new(),
        rules: vec![],
    };
    // The binary: with the engine's `server` feature when it declares one.
    let mut features = gate.target.spec.features.clone();
    let manifest_text = std::fs::read_to_string(gate.engine.build_dir.join("Cargo.toml")).unwrap_or_default();
    if manifest_text.parse::<toml::Table>().ok().and_then(|t| t.get("features")?.get("server").cloned()).is_some() {
        features.push("server".into());
    }
    let mut spec = ServeSpec { ck: &ck, req, report, features, levels, max_tokens, seed };
    gate.run(&mut spec)
}

/// serve_engine as a [`Spec`] that runs the engine's own binary here: the checkpoint, the
/// request's load plan and the report as far as it is known before the binary runs.
struct ServeSpec<'c> {
    ck: &'c super::checkpoint::Checkpoint,
    req: &'c ServeRequest,
    report: ServeReport,
    features: Vec<String>,
    levels: Vec<usize>,
    max_tokens: usize,
    seed: u64,
}

impl Spec for ServeSpec<'_> {
    type Report = ServeReport;

    fn runs(&self) -> Runs {
        Runs::Binary(self.features.clone())
    }

    fn unjudged(&self, gate: &Gate, why: String) -> ServeReport {
        ServeReport { error: why, rules: gate.findings.clone(), ..self.report.clone() }
    }

    fn judge_here(
        &mut self,
        gate: &Gate,
        exe: Option<&std::path::Path>,
        scratch: &std::path::Path,
    ) -> Result<GateVerdict<ServeReport>> {
        let exe = exe.ok_or_else(|| Error::internal("serve_engine judged without the engine's binary"))?;
        let (ctx, budget, req) = (gate.ctx, gate.budget, self.req);
        let (ck, levels, max_tokens, seed) = (self.ck, self.levels.clone(), self.max_tokens, self.seed);
        let (held, cfg) = (&ck.held, &ck.cfg);
        let dtype = self.report.dtype.clone();
        let mut report = ServeReport { rules: gate.findings.clone(), ..self.report.clone() };
        // component.openai_server: the binary explains itself before it is asked to serve.
        let help = help_check(ctx, exe, scratch, budget)?;
        let help_ok = help.passed;
        report.checks.push(help);
        if !help_ok {
            report.error = format!("the engine's binary does not explain itself: {}", report.checks[0].detail);
            return Ok(finish(gate, report));
        }

        // The reference's answers, computed before the server starts (it never sees them).
        let tensors = ck.tensors(&ctx.ckb, &dtype)?;
        // The reference is the family's graph, as every gate builds it.
        let (_, fam) = ck.family(&ctx.ckb)?;
        let mut reference = Reference::of_family(fam, cfg, tensors, &dtype)?;
        let tok = ck.tokenizer()?;
        // The stop tokens every gate uses (Checkpoint::generation).
        let eos = ck.generation.eos_token_ids.clone();
        let max_context = cfg.max_seq;
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ base::util::fnv1a("serve_engine"));
        let mut expect = |prompt: String, n: usize| -> Result<Expected> {
            let ids = model::hf_encode(tok, &prompt)?;
            let n = n.min(max_context.saturating_sub(ids.len())).max(1);
            let (_, toks) = reference.greedy(&ids, n)?;
            let cut = toks.iter().position(|t| eos.contains(t)).map_or(toks.len(), |i| i + 1);
            let toks = &toks[..cut];
            let finish = if cut < n || toks.last().is_some_and(|t| eos.contains(t)) { "stop" } else { "length" };
            let prompt_text = model::hf_decode(tok, &ids)?;
            let all: Vec<u32> = ids.iter().chain(toks).copied().collect();
            let full = model::hf_decode(tok, &all)?;
            let text = match full.strip_prefix(prompt_text.as_str()) {
                Some(t) => t.to_string(),
                None => model::hf_decode(tok, toks)?,
            };
            Ok(Expected { prompt, max_tokens: n, text, completion_tokens: toks.len(), finish })
        };
        let mut greedy = Vec::new();
        for _ in 0..3 {
            let p = draw_prompt(&mut rng);
            let n = rng.random_range(8..=48);
            greedy.push(expect(p, n)?);
        }
        let mut pool = Vec::new();
        for _ in 0..6 {
            let p = draw_prompt(&mut rng);
            pool.push(expect(p, max_tokens)?);
        }

        // Start the server.
        let port = harness::free_loopback_port()?;
        let grant = held.grant();
        let mut grants = Grants::harness(exe, scratch);
        for p in grant.paths() {
            grants = grants.read(p);
        }
        grants.listen = Some(port);
        let args: Vec<std::ffi::OsString> = vec![
            "serve".into(),
            "--model".into(),
            ck.path().as_os_str().to_owned(),
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port.to_string().into(),
        ];
        let server = std::sync::Arc::new(ctx.workshop.start_server(exe, &args, &grants, scratch)?);
        report.sandboxed = server.sandboxed;
        // The server ends when the call's budget runs out or the call is cancelled, so no request of
        // this gate waits past them (each request's own limit is also what is left of the budget).
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
                report.error = format!("the server exited before answering /health: {why}");
                break;
            }
            if client.get("/health").is_ok_and(|a| a.status == 200) {
                up = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if !up {
            if report.error.is_empty() {
                report.error = format!(
                    "the server did not answer GET /health with 200 on 127.0.0.1:{port} within 60 s; stderr (tail):\n{}",
                    server.stderr_tail(4000)
                );
            }
            report.checks.push(check("health", false, report.error.clone()));
            return Ok(finish(gate, report));
        }
        report.checks.push(check("health", true, format!("GET /health: 200 on 127.0.0.1:{port}")));

        // 2. models.
        let models = client.get("/v1/models");
        let model_id = models
            .as_ref()
            .ok()
            .filter(|a| a.status == 200)
            .and_then(|a| serde_json::from_str::<Value>(&a.body).ok())
            .and_then(|v| v["data"][0]["id"].as_str().map(str::to_string));
        report.checks.push(match (&models, &model_id) {
            (_, Some(id)) => check("models", true, format!("GET /v1/models lists {id:?}")),
            (Ok(a), None) => {
                check("models", false, format!("GET /v1/models answered {}: {}", a.status, harness::tail(&a.body, 300)))
            }
            (Err(e), None) => check("models", false, e.clone()),
        });

        // 3. greedy completions equal the reference.
        let completion = |e: &Expected, extra: Value| -> std::result::Result<(String, String, usize), String> {
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
            Ok((text, finish, n))
        };
        let mut bad = Vec::new();
        for e in &greedy {
            match completion(e, json!({})) {
                Ok((text, finish, n)) => {
                    if text != e.text || finish != e.finish || n != e.completion_tokens {
                        bad.push(format!(
                            "prompt {:?}, max_tokens {}: got {text:?} ({n} tokens, {finish}), the reference {:?} ({} tokens, {})",
                            e.prompt, e.max_tokens, e.text, e.completion_tokens, e.finish
                        ));
                    }
                }
                Err(why) => bad.push(format!("prompt {:?}: {why}", e.prompt)),
            }
        }
        let eos_seen = greedy.iter().filter(|e| e.finish == "stop").count();
        report.checks.push(if bad.is_empty() {
            check(
                "greedy",
                true,
                format!(
                    "{} greedy completions equal the reference's text, token count and finish reason ({eos_seen} ended on EOS)",
                    greedy.len()
                ),
            )
        } else {
            check("greedy", false, format!("greedy completion differs from the reference: {}", bad.join("; ")))
        });

        // 4. streaming equals non-streaming.
        let e0 = &greedy[0];
        let streamed =
            client.stream(&json!({"prompt": e0.prompt, "max_tokens": e0.max_tokens, "temperature": 0, "stream": true}));
        report.checks.push(match streamed {
            Ok(s) if s.done && s.text() == e0.text && s.finish == e0.finish => check(
                "streaming",
                true,
                format!("{} events, text equal to the non-streaming one, then [DONE]", s.pieces.len()),
            ),
            Ok(s) => check(
                "streaming",
                false,
                format!(
                    "streamed text {:?} (finish {:?}, [DONE] {}), expected {:?} ({})",
                    s.text(),
                    s.finish,
                    s.done,
                    e0.text,
                    e0.finish
                ),
            ),
            Err(why) => check("streaming", false, why),
        });

        // 5. a stop string cuts the text before it.
        let stop_case = greedy.iter().find_map(|e| {
            let chars: Vec<(usize, char)> = e.text.char_indices().collect();
            (chars.len() >= 4).then(|| {
                let from = chars[chars.len() / 2].0;
                let to = chars.get(chars.len() / 2 + 2).map_or(e.text.len(), |c| c.0);
                let s = e.text[from..to].to_string();
                let at = e.text.find(&s).unwrap_or(from);
                (e, s, e.text[..at].to_string())
            })
        });
        report.checks.push(match stop_case {
            None => check("stop", false, "no greedy completion is long enough to draw a stop string from"),
            Some((e, s, want)) => match completion(e, json!({"stop": [s]})) {
                Ok((text, finish, _)) if text == want && finish == "stop" => {
                    check("stop", true, format!("stop {s:?}: text cut before it, finish_reason stop"))
                }
                Ok((text, finish, _)) => {
                    check("stop", false, format!("stop {s:?}: got {text:?} ({finish}), expected {want:?} (stop)"))
                }
                Err(why) => check("stop", false, format!("stop {s:?}: {why}")),
            },
        });

        // 6. chat.
        let chat = client.post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": e0.prompt}], "max_tokens": 8, "temperature": 0})
                .to_string(),
        );
        report.checks.push(match chat {
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
        });

        // 7. bad requests: 4xx in OpenAI's shape.
        let long_prompt = "the ".repeat(max_context * 2);
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
        report.checks.push(if wrong.is_empty() {
            check("bad_requests", true, format!("{} bad requests answered 4xx with an OpenAI error object", bads.len()))
        } else {
            check(
                "bad_requests",
                false,
                format!("not answered 4xx with {{\"error\": {{\"message\", \"type\"}}}}: {}", wrong.join("; ")),
            )
        });

        // 8. a burst: BURST requests at once, each answered or refused with a 4xx, none lost.
        report.checks.push(if died(&server).is_some() {
            check("burst", false, "not sent: the server had exited")
        } else {
            let b = burst(&client, &e0.prompt, BURST);
            let passed = b.wrong.is_empty() && b.completed > 0;
            let mut detail = format!(
                "{BURST} requests at once: {} completed, {} refused with a 4xx in OpenAI's shape",
                b.completed, b.refused
            );
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
            check("burst", passed, detail)
        });

        // 9. alive afterwards, and still right.
        let alive = match died(&server) {
            Some(why) => check("alive", false, why),
            None => match completion(e0, json!({})) {
                Ok((text, _, _)) if text == e0.text => {
                    check("alive", true, "the server still answers greedy requests with the reference's text")
                }
                Ok((text, _, _)) => {
                    check("alive", false, format!("after the bad requests: got {text:?}, expected {:?}", e0.text))
                }
                Err(why) => check("alive", false, format!("after the bad requests: {why}")),
            },
        };
        let alive_ok = alive.passed;
        report.checks.push(alive);

        // 10. a client that goes away cancels its request.
        if alive_ok {
            let max_seqs = gate.target.serving.as_ref().map_or(16, |s| s.max_seqs);
            let prompt_len = model::hf_encode(tok, &e0.prompt)?.len();
            let full = max_context.saturating_sub(prompt_len).max(1);
            report.checks.push(disconnect(&client, &e0.prompt, full, max_seqs.clamp(1, 64)));
            if let Some(why) = died(&server) {
                report.checks.push(check("alive", false, format!("after the dropped clients: {why}")));
            }
        }

        // 11. reused connections answer as fast as fresh ones.
        if alive_ok && died(&server).is_none() {
            let fresh = Client::fresh(port, budget.deadline);
            let body =
                json!({"prompt": e0.prompt, "max_tokens": e0.max_tokens.min(4), "temperature": 0, "stream": true});
            report.checks.push(keep_alive(&client, &fresh, &body));
        }

        // 12. load.
        if alive_ok {
            report.load_average = load_average();
            for &c in &levels {
                if budget.cancel.load(Ordering::Relaxed) || Instant::now() >= budget.deadline {
                    break;
                }
                report.levels.push(load_level(&client, &pool, c, req.requests.unwrap_or(2 * c), &mut rng));
                if died(&server).is_some() {
                    break;
                }
            }
            if let Some(why) = died(&server) {
                report.error = format!("the server died under load: {why}");
            }
        }
        if let Some(why) = watch.fired() {
            report.error =
                format!("{why}: the engine's server was stopped; checks after that point failed for that reason");
        }
        drop(watch);
        drop(server);
        Ok(finish(gate, report))
    }
}

/// Decide, record and return the report.
fn finish(gate: &Gate, mut report: ServeReport) -> GateVerdict<ServeReport> {
    let levels_ok = !report.levels.is_empty()
        && report.levels.iter().all(|l| l.completed == l.requests && l.greedy_mismatches == 0 && l.errors.is_empty());
    report.passed = report.error.is_empty() && report.checks.iter().all(|c| c.passed) && levels_ok;
    let figures = ServeFigures {
        gate: gate.common(),
        checks: report.checks.len(),
        checks_ok: report.checks.iter().filter(|c| c.passed).count(),
        concurrency: report.levels.iter().map(|l| l.concurrency).collect(),
        output_tokens_per_s: report.levels.iter().map(|l| l.output_tokens_per_s).collect(),
        ttft_ms_p99: report.levels.iter().map(|l| l.ttft_ms_p99).collect(),
        greedy_mismatches: report.levels.iter().map(|l| l.greedy_mismatches).sum(),
    };
    GateVerdict { report, figures: Figures::Serve(figures) }
}
