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

use std::io::{BufRead, BufReader};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::gate::{Gate, Stop, Tool};
use super::{Ctx, Report};
use crate::error::{Error, Result};
use crate::harness::{Budget, Grants};
use crate::ledger::figures::{Figures, ServeFigures};
use crate::model;
use crate::oracle::llama::Reference;

/// What to serve and how hard to load it.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
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
    #[serde(default, deserialize_with = "crate::util::de_seed")]
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
    pub rules: Vec<crate::guard::Finding>,
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

/// The HTTP side: one agent, the base URL.
struct Client {
    agent: ureq::Agent,
    base: String,
    /// The gate's deadline: every request's time limit is what is left of the call's budget.
    deadline: Instant,
}

/// Largest plain (non-streaming) answer read, bytes: a completion of max_context tokens as JSON
/// is far below it; an engine that sends more is answering wrongly, and is not read further.
pub const MAX_ANSWER_BYTES: u64 = 4 << 20;

/// Largest event stream read, bytes (one event per token, each well under a kilobyte).
pub const MAX_STREAM_BYTES: u64 = 16 << 20;

/// Bytes read after `data: [DONE]` to reach the end of a streamed body (a chunked terminator is 5).
const STREAM_TAIL_BYTES: u64 = 4096;

/// Largest excess of the median time to first token on reused keep-alive connections over the one
/// on fresh connections, milliseconds: half of Linux's minimum delayed-ACK time (TCP_DELACK_MIN =
/// 40 ms, include/net/tcp.h), the wait Nagle's algorithm (RFC 896) adds to a response's second small
/// write on a reused connection of a server without TCP_NODELAY.
pub const KEEP_ALIVE_EXCESS_MS: f64 = 20.0;

/// Streaming requests timed on each kind of connection by the keep-alive check.
pub const KEEP_ALIVE_ROUNDS: usize = 7;

/// Longest line of an event stream read, bytes: an SSE `data:` line holds one chunk's JSON.
pub const MAX_EVENT_LINE: usize = 64 << 10;

/// Read one line of at most [`MAX_EVENT_LINE`] bytes (its newline included) into `buf`; Ok(false)
/// at the end of the stream.
///
/// # Errors
/// A line longer than the bound (named), or a transport error.
fn read_event_line(reader: &mut impl std::io::BufRead, buf: &mut Vec<u8>) -> std::result::Result<bool, String> {
    use std::io::Read;
    buf.clear();
    let n = reader
        .by_ref()
        .take(MAX_EVENT_LINE as u64 + 1)
        .read_until(b'\n', buf)
        .map_err(|e| format!("reading the event stream: {e}"))?;
    if buf.len() > MAX_EVENT_LINE && !buf.ends_with(b"\n") {
        return Err(format!(
            "an event-stream line longer than {MAX_EVENT_LINE} bytes (component.openai_server: one `data:` line per chunk); not read further"
        ));
    }
    Ok(n > 0)
}

/// A plain response: status and body text.
struct Answer {
    status: u16,
    body: String,
}

impl Client {
    /// A client that pools keep-alive connections (up to 64 idle), as the official openai package does.
    fn new(port: u16, deadline: Instant) -> Client {
        let agent =
            ureq::Agent::config_builder().http_status_as_error(false).max_idle_connections_per_host(64).build().into();
        Client { agent, base: format!("http://127.0.0.1:{port}"), deadline }
    }

    /// A client that keeps no connection: every request opens a new one.
    fn fresh(port: u16, deadline: Instant) -> Client {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_idle_connections(0)
            .max_idle_connections_per_host(0)
            .build()
            .into();
        Client { agent, base: format!("http://127.0.0.1:{port}"), deadline }
    }

    /// What is left of the call's budget: the time limit of the next request.
    fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
    }

    /// A POST of JSON to `path` under the remaining budget.
    fn post_request(&self, path: &str) -> ureq::RequestBuilder<ureq::typestate::WithBody> {
        self.agent
            .post(format!("{}{path}", self.base))
            .config()
            .timeout_global(Some(self.remaining()))
            .build()
            .header("content-type", "application/json")
    }

    fn get(&self, path: &str) -> std::result::Result<Answer, String> {
        let mut r = self
            .agent
            .get(format!("{}{path}", self.base))
            .config()
            .timeout_global(Some(self.remaining()))
            .build()
            .call()
            .map_err(|e| format!("GET {path}: {e}"))?;
        let status = r.status().as_u16();
        let body = r
            .body_mut()
            .with_config()
            .limit(MAX_ANSWER_BYTES)
            .read_to_string()
            .map_err(|e| format!("GET {path}: reading the body (at most {MAX_ANSWER_BYTES} bytes): {e}"))?;
        Ok(Answer { status, body })
    }

    fn post(&self, path: &str, body: &str) -> std::result::Result<Answer, String> {
        let mut r = self.post_request(path).send(body).map_err(|e| format!("POST {path}: {e}"))?;
        let status = r.status().as_u16();
        let body = r
            .body_mut()
            .with_config()
            .limit(MAX_ANSWER_BYTES)
            .read_to_string()
            .map_err(|e| format!("POST {path}: reading the body (at most {MAX_ANSWER_BYTES} bytes): {e}"))?;
        Ok(Answer { status, body })
    }

    /// A streaming completion: the texts of its chunks with their arrival times, the finish reason,
    /// the usage's completion_tokens, whether `[DONE]` ended it.
    fn stream(&self, body: &Value) -> std::result::Result<Streamed, String> {
        let start = Instant::now();
        let mut r = self
            .post_request("/v1/completions")
            .send(body.to_string())
            .map_err(|e| format!("POST /v1/completions (stream): {e}"))?;
        if r.status().as_u16() != 200 {
            let text = r.body_mut().with_config().limit(MAX_ANSWER_BYTES).read_to_string().unwrap_or_default();
            return Err(format!(
                "streaming request answered {}: {}",
                r.status().as_u16(),
                crate::harness::tail(&text, 300)
            ));
        }
        let mut out = Streamed::default();
        let mut reader = BufReader::new(r.body_mut().with_config().limit(MAX_STREAM_BYTES).reader());
        let mut buf = Vec::new();
        while read_event_line(&mut reader, &mut buf)? {
            let line = String::from_utf8_lossy(&buf);
            let Some(data) = line.trim_end_matches(['\r', '\n']).strip_prefix("data:") else { continue };
            let data = data.trim();
            if data == "[DONE]" {
                out.done = true;
                // Read the body's end (the chunked terminator), so the connection goes back to the
                // pool and the next request reuses it; a server that sends more is not read further.
                let _ = std::io::copy(&mut std::io::Read::take(&mut reader, STREAM_TAIL_BYTES), &mut std::io::sink());
                break;
            }
            let v: Value = serde_json::from_str(data).map_err(|e| format!("an event is not JSON ({e}): {data}"))?;
            let choice = &v["choices"][0];
            if let Some(t) = choice["text"].as_str().filter(|t| !t.is_empty()) {
                out.pieces.push((start.elapsed(), t.to_string()));
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                out.finish = f.to_string();
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                out.completion_tokens = n as usize;
            }
        }
        Ok(out)
    }
}

#[derive(Debug, Default)]
struct Streamed {
    pieces: Vec<(Duration, String)>,
    finish: String,
    completion_tokens: usize,
    done: bool,
}

impl Streamed {
    fn text(&self) -> String {
        self.pieces.iter().map(|(_, t)| t.as_str()).collect()
    }
}

/// Nearest-rank percentile `p` (0..=100) of `xs`, 0 when empty.
fn percentile(xs: &mut [f64], p: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * xs.len() as f64).ceil().max(1.0) as usize;
    xs[rank.min(xs.len()) - 1]
}

/// The check `help`: `exe --help` and `exe serve --help` exit 0 and print the commands and serve's
/// flags (`--model`, `--port`), as component.openai_server asks. Run sandboxed, with no model and
/// no network, within 30 s each.
///
/// # Errors
/// When the process cannot be started or the sandbox refuses.
fn help_check(ctx: &Ctx, exe: &std::path::Path, scratch: &std::path::Path, budget: &Budget) -> Result<Check> {
    let grants = Grants::harness(exe, scratch);
    for (args, wants) in [(&["--help"][..], &["serve"][..]), (&["serve", "--help"][..], &["--model", "--port"][..])] {
        let limit =
            Budget { deadline: budget.deadline.min(Instant::now() + Duration::from_secs(30)), ..budget.clone() };
        let run = ctx.workshop.run_program_sandboxed(exe, args, &grants, &limit)?;
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
                    crate::harness::tail(&run.stdout, 400)
                ),
            ));
        }
    }
    Ok(check("help", true, "`--help` and `serve --help` exit 0 and list the commands and serve's flags"))
}

fn check(name: &str, passed: bool, detail: impl Into<String>) -> Check {
    Check { name: name.into(), passed, detail: detail.into() }
}

/// Whether `body` is an OpenAI error object: {"error": {"message": string, "type": string}}.
fn openai_error(body: &str) -> bool {
    serde_json::from_str::<Value>(body)
        .map(|v| v["error"]["message"].is_string() && v["error"]["type"].is_string())
        .unwrap_or(false)
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
    let (held, cfg) = (&ck.held, &ck.cfg);
    let model_dir = ck.path().to_path_buf();
    gate.same_family(&model_dir, &cfg.family)?;
    let seed = req.seed.unwrap_or_else(crate::util::fresh_seed);
    gate.seed = Some(seed);
    gate.contracts(&[cfg.family.as_str(), "component.openai_server", "component.scheduler", "kernel.sample"]);
    let dtype = gate.target.dtype.clone();
    let mut report = ServeReport {
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
    let stop = |gate: &Gate, report: &mut ServeReport, stop: Stop| {
        report.error = stop.text.clone();
        report.rules = gate.findings.clone();
        gate.stopped(&stop, report.clone())
    };
    if let Err(s) = gate.rules()? {
        return Ok(stop(&gate, &mut report, s));
    }
    report.rules = gate.findings.clone();

    // Build the binary: with the engine's `server` feature when it declares one.
    let mut features = gate.target.spec.features.clone();
    let manifest_text = std::fs::read_to_string(gate.engine.build_dir.join("Cargo.toml")).unwrap_or_default();
    if manifest_text.parse::<toml::Table>().ok().and_then(|t| t.get("features")?.get("server").cloned()).is_some() {
        features.push("server".into());
    }
    let scratch = ctx.workshop.scratch()?;
    let exe = match gate.build_binary(&features, scratch.path())? {
        Ok(exe) => exe,
        Err(s) => return Ok(stop(&gate, &mut report, s)),
    };

    // component.openai_server: the binary explains itself before it is asked to serve.
    let help = help_check(ctx, &exe, scratch.path(), budget)?;
    let help_ok = help.passed;
    report.checks.push(help);
    if !help_ok {
        report.error = format!("the engine's binary does not explain itself: {}", report.checks[0].detail);
        return Ok(finish(&gate, report));
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
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ crate::util::fnv1a("serve_engine"));
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
    let port = crate::harness::free_loopback_port()?;
    let grant = held.grant();
    let mut grants = Grants::harness(&exe, scratch.path());
    for p in grant.paths() {
        grants = grants.read(p);
    }
    grants.listen = Some(port);
    let args: Vec<std::ffi::OsString> = vec![
        "serve".into(),
        "--model".into(),
        model_dir.as_os_str().to_owned(),
        "--host".into(),
        "127.0.0.1".into(),
        "--port".into(),
        port.to_string().into(),
    ];
    let server = std::sync::Arc::new(ctx.workshop.start_server(&exe, &args, &grants, scratch.path())?);
    report.sandboxed = server.sandboxed;
    // The server ends when the call's budget runs out or the call is cancelled, so no request of
    // this gate waits past them (each request's own limit is also what is left of the budget).
    let watch = crate::harness::Watch::start(server.clone(), budget);
    let client = Client::new(port, budget.deadline);
    let died = |server: &crate::harness::ServerProcess| {
        server.exited().map(|e| {
            let why = match e {
                crate::harness::Exit::Code(Some(c)) => format!("exited with status {c}"),
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
        return Ok(finish(&gate, report));
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
        (Ok(a), None) => check(
            "models",
            false,
            format!("GET /v1/models answered {}: {}", a.status, crate::harness::tail(&a.body, 300)),
        ),
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
            return Err(format!("answered {}: {}", a.status, crate::harness::tail(&a.body, 300)));
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
        &json!({"messages": [{"role": "user", "content": e0.prompt}], "max_tokens": 8, "temperature": 0}).to_string(),
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
                    format!("not a chat.completion: {}", crate::harness::tail(&a.body, 300))
                },
            )
        }
        Ok(a) => check("chat", false, format!("answered {}: {}", a.status, crate::harness::tail(&a.body, 300))),
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
            Ok(a) => wrong.push(format!("{what}: answered {} {}", a.status, crate::harness::tail(&a.body, 200))),
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
        let body = json!({"prompt": e0.prompt, "max_tokens": e0.max_tokens.min(4), "temperature": 0, "stream": true});
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
    Ok(finish(&gate, report))
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
/// cannot be told apart from scheduling noise, and the check says so and passes.
fn disconnect(client: &Client, prompt: &str, full: usize, slots: usize) -> Check {
    let timed = |max_tokens: usize| -> std::result::Result<(Duration, usize), String> {
        let start = Instant::now();
        let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).to_string();
        let a = client.post("/v1/completions", &body)?;
        if a.status != 200 {
            return Err(format!("answered {}: {}", a.status, crate::harness::tail(&a.body, 300)));
        }
        let v: Value = serde_json::from_str(&a.body).map_err(|e| format!("the body is not JSON: {e}"))?;
        Ok((start.elapsed(), v["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize))
    };
    let (t_full, k) = match timed(full) {
        Ok(x) => x,
        Err(why) => return check("disconnect", false, format!("the full-length request alone: {why}")),
    };
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    if t_full < Duration::from_millis(20) {
        return check(
            "disconnect",
            true,
            format!(
                "not observable here: one request of {k} tokens takes {:.1} ms, too short to tell a cancelled request from a finished one",
                ms(t_full)
            ),
        );
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
        Err(why) => return check("disconnect", false, format!("the request after the dropped clients: {why}")),
    };
    let detail = format!(
        "{opened} of {abandoned} streaming requests of {k} tokens (max_seqs) dropped after their first event; a one-token request then took {:.1} ms, one {k}-token request alone {:.1} ms",
        ms(t_probe),
        ms(t_full)
    );
    if opened * 2 < abandoned {
        return check("disconnect", false, format!("{detail}: too few requests were accepted to tell"));
    }
    if t_probe < t_full {
        check("disconnect", true, format!("{detail}: the dropped requests were cancelled"))
    } else {
        check(
            "disconnect",
            false,
            format!(
                "{detail}: it waited behind the dropped requests (component.openai_server: a client disconnect cancels its request and frees its slot)"
            ),
        )
    }
}

/// The keep-alive check (component.openai_server: TCP_NODELAY on every accepted connection). One
/// streaming request `body` opens a pooled connection; then [`KEEP_ALIVE_ROUNDS`] times, alternating,
/// one request on a new connection (`fresh`) and one on the pooled one (`pooled`), each timed from
/// sending to its first text event. Passes when the reused connections' median TTFT exceeds the
/// fresh ones' by at most [`KEEP_ALIVE_EXCESS_MS`]; a request that fails fails the check.
fn keep_alive(pooled: &Client, fresh: &Client, body: &Value) -> Check {
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

/// Requests the burst check sends at once: component.openai_server's "1,000 requests at once".
pub const BURST: usize = 1000;

/// What a burst of requests got back.
#[derive(Debug, Default)]
struct Burst {
    /// Answered 200 with a completion.
    completed: usize,
    /// Answered 4xx with an OpenAI error object (e.g. 429 when the queue is full).
    refused: usize,
    /// Anything else (no answer, 5xx, another shape): how many, and the first few.
    wrong_count: usize,
    wrong: Vec<String>,
    /// Connections the burst lost before any HTTP answer (reset, refused: a full listen backlog)
    /// that were answered when sent again once, after the burst.
    retried: usize,
}

/// Send `n` one-token greedy completions of `prompt` at once (one thread each, released
/// together) and sort the answers; a request lost at the connection before any HTTP answer (a
/// full listen backlog resets it) is sent again once after the burst, and its second answer
/// counts; a thread the client cannot start ends the burst there, counted as a wrong answer.
fn burst(client: &Client, prompt: &str, n: usize) -> Burst {
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
            .filter(|v| v["choices"][0]["text"].is_string())
            .map(|_| ())
            .ok_or_else(|| format!("200 without a completion: {}", crate::harness::tail(&a.body, 200))),
        Ok(a) if (400..500).contains(&a.status) && openai_error(&a.body) => Err(String::new()),
        Ok(a) => Err(format!("answered {}: {}", a.status, crate::harness::tail(&a.body, 200))),
        Err(e) => Err(e),
    };
    let sort = |r: std::result::Result<(), String>, retry: bool| {
        let mut b = out.lock().unwrap_or_else(|p| p.into_inner());
        match r {
            Ok(()) => b.completed += 1,
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

/// Decide, record and return the report.
fn finish(gate: &Gate, mut report: ServeReport) -> ServeReport {
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
    gate.record(&report, Figures::Serve(figures));
    report
}

/// The 1-minute load average from /proc/loadavg; -1 when unreadable.
fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|x| x.parse().ok()))
        .unwrap_or(-1.0)
}

/// One load-test request as its client saw it: completion tokens, whether the text equals the
/// reference's, its TTFT (one entry) and its inter-token gaps, milliseconds.
type Sent = (usize, bool, Vec<f64>, Vec<f64>);

/// One concurrency level: `c` clients send `n` streaming greedy requests drawn from `pool`.
fn load_level(client: &Client, pool: &[Expected], c: usize, n: usize, rng: &mut ChaCha8Rng) -> LoadLevel {
    let picks: Vec<usize> = (0..n).map(|_| rng.random_range(0..pool.len())).collect();
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<std::result::Result<Sent, String>>> = Mutex::new(Vec::new());
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..c {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= n {
                        break;
                    }
                    let e = &pool[picks[i]];
                    let body =
                        json!({"prompt": e.prompt, "max_tokens": e.max_tokens, "temperature": 0, "stream": true});
                    let r = client.stream(&body).and_then(|st| {
                        if !st.done {
                            return Err("the event stream ended without [DONE]".to_string());
                        }
                        let times: Vec<f64> = st.pieces.iter().map(|(t, _)| t.as_secs_f64() * 1e3).collect();
                        let ttft = times.first().copied().into_iter().collect();
                        let itl = times.windows(2).map(|w| w[1] - w[0]).collect();
                        Ok((st.completion_tokens, st.text() == e.text, ttft, itl))
                    });
                    results.lock().unwrap_or_else(|p| p.into_inner()).push(r);
                }
            });
        }
    });
    let seconds = start.elapsed().as_secs_f64();
    let results = results.into_inner().unwrap_or_else(|p| p.into_inner());
    let mut level = LoadLevel { concurrency: c, requests: n, seconds, ..Default::default() };
    let (mut ttft, mut itl) = (Vec::new(), Vec::new());
    for r in results {
        match r {
            Ok((tokens, same, t, i)) => {
                level.completed += 1;
                level.output_tokens += tokens;
                level.greedy_mismatches += usize::from(!same);
                ttft.extend(t);
                itl.extend(i);
            }
            Err(e) if level.errors.len() < 4 => level.errors.push(e),
            Err(_) => {}
        }
    }
    level.output_tokens_per_s = level.output_tokens as f64 / seconds.max(1e-9);
    level.requests_per_s = level.completed as f64 / seconds.max(1e-9);
    level.ttft_ms_p50 = percentile(&mut ttft, 50.0);
    level.ttft_ms_p99 = percentile(&mut ttft, 99.0);
    level.itl_ms_p50 = percentile(&mut itl, 50.0);
    level.itl_ms_p99 = percentile(&mut itl, 99.0);
    level
}

#[cfg(test)]
mod tests {
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

    /// A minimal HTTP/1.1 server on a loopback port that answers every request of a connection with a
    /// streamed completion, writing the header block and each event as its own small write (as an
    /// HTTP stack does); `nodelay` sets TCP_NODELAY on each accepted connection. Returns the port and
    /// the count of accepted connections.
    fn sse_server(nodelay: bool) -> (u16, std::sync::Arc<AtomicUsize>) {
        use std::io::{Read, Write};
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
                    loop {
                        let mut length = 0usize;
                        let mut line = String::new();
                        loop {
                            line.clear();
                            if input.read_line(&mut line).unwrap_or(0) == 0 {
                                return;
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
                        input.read_exact(&mut body).unwrap();
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

    #[test]
    fn openai_error_shape() {
        assert!(openai_error(r#"{"error": {"message": "x", "type": "invalid_request_error", "param": null}}"#));
        assert!(!openai_error(r#"{"detail": "x"}"#));
        assert!(!openai_error("Bad Request"));
    }
}
