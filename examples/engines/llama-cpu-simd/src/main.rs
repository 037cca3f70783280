//! Phase 7 (serving): the engine's binary (component.openai_server).
//!
//! `llama-cpu-simd --help` and `llama-cpu-simd <command> --help` list the commands and their flags;
//! an unknown command or flag is refused by name with exit status 2 (a failure while running: 1).
//! `llama-cpu-simd generate --model DIR --prompt TEXT [--max-tokens N] [--temperature T] [--top-p P]
//! [--top-k K] [--min-p P] [--seed S]` streams the new text to stdout;
//! `llama-cpu-simd serve --model DIR [--host 127.0.0.1] [--port 8000] [--max-seqs 16] [--block-size 16]
//! [--kv-blocks N] [--max-batch-tokens N]` serves the OpenAI-compatible API (`/health`, `/v1/models`,
//! `/v1/completions`, `/v1/chat/completions`, streaming as server-sent events ending with `[DONE]`),
//! and says on stderr which model it serves on which address once it listens.
//!
//! One engine thread owns the model, the paged KV cache and the scheduler; HTTP handlers (axum on
//! tokio) validate and tokenise a request and send it to that thread with a channel for its text.
//! A closed channel (the client went away) aborts the request and frees its blocks.
// Validation errors are the HTTP responses themselves, built at most once per request.
#![allow(clippy::result_large_err)]

use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use llama_cpu_simd::batch::{self, SeqChunk};
use llama_cpu_simd::kernels::{self, SamplingParams};
use llama_cpu_simd::model::Model;
use llama_cpu_simd::paged;
use llama_cpu_simd::scheduler::{Event, Finish, Request, Scheduler};
use llama_cpu_simd::tokenizer::Tokenizer;
use serde_json::{Value, json};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

/// Requests queued or running at once before the server answers 429.
const MAX_IN_FLIGHT: usize = 256;

/// Used when the model directory has no tokenizer_config.json with a chat_template.
const DEFAULT_CHAT_TEMPLATE: &str = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}";

/// What the engine thread sends a request's handler.
enum Out {
    Text(String),
    Done { finish: &'static str, prompt_tokens: usize, completion_tokens: usize },
}

/// A request on its way to the engine thread, with its sampling parameters and seed (kernel.sample
/// draws with one uniform number u per token from the request's own generator).
struct Job {
    req: Request,
    params: SamplingParams,
    seed: u64,
    stop: Vec<String>,
    out: UnboundedSender<Out>,
}

struct Sizes {
    max_seqs: usize,
    block_size: usize,
    kv_blocks: Option<usize>,
    max_batch_tokens: Option<usize>,
}

struct Loaded {
    vocab: usize,
    max_context: usize,
    /// The KV-cache pool: blocks, positions per block, bytes.
    kv: (usize, usize, usize),
}

/// One flag of a subcommand: name, value placeholder, what it does (with its default).
struct Flag {
    name: &'static str,
    value: &'static str,
    help: &'static str,
}

const GENERATE_FLAGS: &[Flag] = &[
    Flag {
        name: "--model",
        value: "DIR",
        help: "Hugging Face model directory (config.json, model.safetensors, tokenizer.json); required",
    },
    Flag { name: "--prompt", value: "TEXT", help: "the prompt; required" },
    Flag { name: "--max-tokens", value: "N", help: "tokens to generate, at most the context left (default 64)" },
    Flag { name: "--temperature", value: "T", help: "sampling temperature; 0 is greedy (default 0)" },
    Flag { name: "--top-p", value: "P", help: "nucleus sampling mass in (0, 1] (default 1)" },
    Flag { name: "--top-k", value: "K", help: "keep the K most likely tokens; 0 keeps all (default 0)" },
    Flag { name: "--min-p", value: "P", help: "drop tokens below P times the top token's probability (default 0)" },
    Flag { name: "--seed", value: "S", help: "seed of the sampler's random numbers (default 0)" },
];

const SERVE_FLAGS: &[Flag] = &[
    Flag {
        name: "--model",
        value: "DIR",
        help: "Hugging Face model directory; its name is the served model id; required",
    },
    Flag { name: "--host", value: "ADDR", help: "address to listen on (default 127.0.0.1)" },
    Flag { name: "--port", value: "PORT", help: "port to listen on (default 8000)" },
    Flag { name: "--max-seqs", value: "N", help: "sequences running at once (default 16)" },
    Flag { name: "--block-size", value: "N", help: "tokens per KV-cache block (default 16)" },
    Flag {
        name: "--kv-blocks",
        value: "N",
        help: "KV-cache blocks (default: max-seqs full contexts, as far as memory holds them)",
    },
    Flag { name: "--max-batch-tokens", value: "N", help: "tokens per batched step (default 256)" },
];

/// Subcommands: name, what it does, its flags.
const COMMANDS: &[(&str, &str, &[Flag])] = &[
    ("generate", "generate text for one prompt and stream it to stdout", GENERATE_FLAGS),
    (
        "serve",
        "serve the OpenAI-compatible API (/health, /v1/models, /v1/completions, /v1/chat/completions)",
        SERVE_FLAGS,
    ),
];

/// Why the binary stops: bad usage (exit status 2) or a failure while running (exit status 1).
enum Fail {
    Usage(String),
    Run(String),
}

impl From<String> for Fail {
    fn from(s: String) -> Fail {
        Fail::Run(s)
    }
}

impl From<&str> for Fail {
    fn from(s: &str) -> Fail {
        Fail::Run(s.to_string())
    }
}

fn usage() -> String {
    let mut s = String::from("usage: llama-cpu-simd <command> [flags]\n\ncommands:\n");
    for (name, what, _) in COMMANDS {
        s += &format!("  {name:<10} {what}\n");
    }
    s += "\n`llama-cpu-simd <command> --help` lists the command's flags.\n";
    s
}

fn command_help(name: &str, what: &str, flags: &[Flag]) -> String {
    let mut s = format!("usage: llama-cpu-simd {name} [flags]\n\n{what}\n\nflags:\n");
    for f in flags {
        s += &format!("  {:<24} {}\n", format!("{} {}", f.name, f.value), f.help);
    }
    s += &format!("  {:<24} print this help\n", "-h, --help");
    s
}

/// Check `args` against the command's flags: every flag known and followed by a value. Ok(false)
/// when help was asked for (and printed).
fn check_flags(name: &str, what: &str, flags: &[Flag], args: &[String]) -> Result<bool, Fail> {
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        if a == "--help" || a == "-h" {
            print!("{}", command_help(name, what, flags));
            return Ok(false);
        }
        if !flags.iter().any(|f| f.name == a) {
            let known: Vec<&str> = flags.iter().map(|f| f.name).collect();
            return Err(Fail::Usage(format!(
                "unknown flag `{a}` for `{name}`; its flags: {}, --help",
                known.join(", ")
            )));
        }
        if args.get(i + 1).is_none() {
            return Err(Fail::Usage(format!("`{a}` needs a value")));
        }
        i += 2;
    }
    Ok(true)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("--help" | "-h" | "help") => {
            print!("{}", usage());
            Ok(())
        }
        Some(cmd) => match COMMANDS.iter().find(|(name, _, _)| *name == cmd) {
            Some((name, what, flags)) => match check_flags(name, what, flags, &args[1..]) {
                Ok(true) if *name == "generate" => generate(&args[1..]),
                Ok(true) => serve(&args[1..]),
                Ok(false) => Ok(()),
                Err(e) => Err(e),
            },
            None => Err(Fail::Usage(format!("unknown command `{cmd}`\n{}", usage()))),
        },
        None => Err(Fail::Usage(format!("no command given\n{}", usage()))),
    };
    match result {
        Ok(()) => {}
        Err(Fail::Usage(e)) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
        Err(Fail::Run(e)) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}

fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(String::as_str)
}

fn required<'a>(args: &'a [String], name: &str, cmd: &str, value: &str) -> Result<&'a str, Fail> {
    flag(args, name)
        .ok_or_else(|| Fail::Usage(format!("{cmd} needs {name} {value} (see `llama-cpu-simd {cmd} --help`)")))
}

fn parsed<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> Result<T, Fail> {
    match flag(args, name) {
        None => Ok(default),
        Some(v) => v.parse().map_err(|_| Fail::Usage(format!("{name}: cannot parse {v:?}"))),
    }
}

/// Exit status of a server whose engine thread failed (EX_SOFTWARE, sysexits.h).
const ENGINE_FAILED: i32 = 70;

/// Wakes the HTTP server's graceful shutdown when the engine thread has failed.
static ENGINE_DOWN: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// How long the failed engine thread lets the HTTP server answer the requests in flight (each with
/// a 500: their channels closed) before it ends the process itself.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Held by the engine thread: when that thread ends in a panic (a device error, an out-of-memory,
/// a bug), the server stops taking connections, answers the requests in flight and exits with
/// [`ENGINE_FAILED`] (within [`SHUTDOWN_GRACE`]), so that nothing goes on answering `/health` while
/// every request fails. The panic's message is already on stderr.
struct Lifeline;

impl Drop for Lifeline {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("error: the engine thread failed (the panic above); the server stops");
            ENGINE_DOWN.notify_one();
            std::thread::sleep(SHUTDOWN_GRACE);
            std::process::exit(ENGINE_FAILED);
        }
    }
}

/// Start the engine thread: it loads the model, then serves jobs until every sender is gone.
fn start_engine(
    dir: PathBuf,
    tok: Arc<Tokenizer>,
    sizes: Sizes,
) -> Result<(std::sync::mpsc::Sender<Job>, Loaded), String> {
    let (tx, rx) = std::sync::mpsc::channel::<Job>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<Loaded, String>>();
    std::thread::spawn(move || {
        let _lifeline = Lifeline;
        let mut model = match Model::load(&dir) {
            Ok(m) => m,
            Err(e) => {
                let _ = ready_tx.send(Err(e));
                return;
            }
        };
        let vocab = model.vocab_size();
        let max_context = model.max_seq_len();
        // Unless told, max_seqs full contexts, as far as the memory holds them (a model's context can
        // be 131,072 positions).
        let block_bytes = batch::block_bytes(&model, sizes.block_size);
        let kv_blocks = sizes.kv_blocks.unwrap_or_else(|| {
            let wanted = sizes.max_seqs * max_context.div_ceil(sizes.block_size);
            paged::default_num_blocks(wanted, block_bytes, batch::kv_budget_bytes(&model))
        });
        let budget = sizes.max_batch_tokens.unwrap_or(256).max(sizes.max_seqs);
        let mut cache = batch::new_cache(&model, kv_blocks, sizes.block_size);
        let mut sched = Scheduler::new(kv_blocks, sizes.block_size, sizes.max_seqs, budget, max_context);
        let kv = (kv_blocks, sizes.block_size, kv_blocks.saturating_mul(block_bytes));
        let _ = ready_tx.send(Ok(Loaded { vocab, max_context, kv }));
        engine_loop(&mut model, &mut cache, &mut sched, &tok, &rx, vocab);
    });
    let loaded = ready_rx.recv().map_err(|_| "the engine thread died while loading".to_string())??;
    Ok((tx, loaded))
}

/// Per-request state of the engine thread: sampling, the text sent so far and the stop strings.
struct Live {
    params: SamplingParams,
    /// State of the request's splitmix64 generator of u.
    rng: u64,
    out: UnboundedSender<Out>,
    prompt: Vec<u32>,
    generated: Vec<u32>,
    prompt_text: String,
    stop: Vec<String>,
    sent: usize,
}

impl Live {
    /// The next u in [0, 1): splitmix64 (Steele, Lea & Flood 2014), top 24 bits.
    fn next_u(&mut self) -> f32 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32
    }

    /// The completion text so far (incremental detokenisation: decode(prompt + new) less decode(prompt)).
    fn text(&self, tok: &Tokenizer) -> String {
        let mut all = self.prompt.clone();
        all.extend(&self.generated);
        let full = tok.decode(&all);
        full.strip_prefix(self.prompt_text.as_str()).map(str::to_string).unwrap_or_else(|| tok.decode(&self.generated))
    }
}

fn engine_loop(
    model: &mut Model,
    cache: &mut batch::PagedKvCache,
    sched: &mut Scheduler,
    tok: &Tokenizer,
    rx: &std::sync::mpsc::Receiver<Job>,
    vocab: usize,
) {
    let mut live: HashMap<u64, Live> = HashMap::new();
    let accept = |job: Job, sched: &mut Scheduler, live: &mut HashMap<u64, Live>| {
        let id = job.req.id;
        let prompt = job.req.prompt.clone();
        if let Err(e) = sched.add(job.req) {
            // Validated by the handler; a refusal here still answers.
            let _ = job.out.send(Out::Text(String::new()));
            eprintln!("request {id} refused: {e}");
            let _ = job.out.send(Out::Done { finish: "length", prompt_tokens: prompt.len(), completion_tokens: 0 });
            return;
        }
        let prompt_text = tok.decode(&prompt);
        live.insert(
            id,
            Live {
                params: job.params,
                rng: job.seed,
                out: job.out,
                prompt,
                generated: Vec::new(),
                prompt_text,
                stop: job.stop,
                sent: 0,
            },
        );
    };
    loop {
        if sched.is_idle() {
            match rx.recv() {
                Ok(job) => accept(job, sched, &mut live),
                Err(_) => return,
            }
        }
        while let Ok(job) = rx.try_recv() {
            accept(job, sched, &mut live);
        }
        // Requests whose client went away.
        let gone: Vec<u64> = live.iter().filter(|(_, l)| l.out.is_closed()).map(|(id, _)| *id).collect();
        for id in gone {
            sched.abort(id);
            live.remove(&id);
        }
        let plan = sched.schedule();
        if plan.is_empty() {
            continue;
        }
        let chunks: Vec<SeqChunk> =
            plan.iter().map(|p| SeqChunk { tokens: &p.tokens, start: p.start, block_table: &p.block_table }).collect();
        let logits = batch::step(model, cache, &chunks);
        // A token for each chunk that ends its sequence, drawn with the request's parameters.
        let mut sampled = Vec::new();
        for (k, p) in plan.iter().enumerate().filter(|(_, p)| p.samples) {
            let row = &logits[k * vocab..(k + 1) * vocab];
            let prev = sched.tokens(p.id).unwrap_or_default();
            sampled.push(match live.get_mut(&p.id) {
                Some(l) => {
                    let u = l.next_u();
                    kernels::sample(row, &prev, &l.params, u)
                }
                None => kernels::argmax(row) as u32,
            });
        }
        for ev in sched.update(&plan, &sampled) {
            match ev {
                Event::Token { id, token } => {
                    let Some(l) = live.get_mut(&id) else { continue };
                    l.generated.push(token);
                    let text = l.text(tok);
                    let hit = l.stop.iter().filter_map(|s| text.find(s.as_str())).min();
                    if let Some(at) = hit {
                        if at > l.sent {
                            let _ = l.out.send(Out::Text(text[l.sent..at].to_string()));
                        }
                        let _ = l.out.send(Out::Done {
                            finish: "stop",
                            prompt_tokens: l.prompt.len(),
                            completion_tokens: l.generated.len(),
                        });
                        sched.abort(id);
                        live.remove(&id);
                        continue;
                    }
                    // Hold back what could still become a stop string, or an incomplete character.
                    let hold = l.stop.iter().map(|s| s.len().saturating_sub(1)).max().unwrap_or(0);
                    let mut end = text.len().saturating_sub(hold);
                    while end > 0 && !text.is_char_boundary(end) {
                        end -= 1;
                    }
                    if text.ends_with('\u{FFFD}') {
                        end = end.min(text.len() - '\u{FFFD}'.len_utf8());
                    }
                    if end > l.sent && text.is_char_boundary(l.sent) {
                        let _ = l.out.send(Out::Text(text[l.sent..end].to_string()));
                        l.sent = end;
                    }
                }
                Event::Finished { id, finish } => {
                    let Some(l) = live.remove(&id) else { continue };
                    let text = l.text(tok);
                    if text.len() > l.sent && text.is_char_boundary(l.sent) {
                        let _ = l.out.send(Out::Text(text[l.sent..].to_string()));
                    }
                    let finish = if finish == Finish::Stop { "stop" } else { "length" };
                    let _ = l.out.send(Out::Done {
                        finish,
                        prompt_tokens: l.prompt.len(),
                        completion_tokens: l.generated.len(),
                    });
                }
            }
        }
    }
}

fn sizes(args: &[String]) -> Result<Sizes, Fail> {
    let optional = |name: &str| -> Result<Option<usize>, Fail> {
        flag(args, name).map(|v| v.parse().map_err(|_| Fail::Usage(format!("{name}: cannot parse {v:?}")))).transpose()
    };
    let s = Sizes {
        max_seqs: parsed(args, "--max-seqs", 16)?,
        block_size: parsed(args, "--block-size", 16)?,
        kv_blocks: optional("--kv-blocks")?,
        max_batch_tokens: optional("--max-batch-tokens")?,
    };
    if s.max_seqs == 0 || s.block_size == 0 {
        return Err(Fail::Usage("--max-seqs and --block-size must be positive".into()));
    }
    Ok(s)
}

fn generate(args: &[String]) -> Result<(), Fail> {
    let dir = PathBuf::from(required(args, "--model", "generate", "DIR")?);
    let prompt = required(args, "--prompt", "generate", "TEXT")?;
    let tok = Arc::new(Tokenizer::load(&dir)?);
    let (tx, loaded) = start_engine(
        dir.clone(),
        tok.clone(),
        Sizes { max_seqs: 1, block_size: 16, kv_blocks: None, max_batch_tokens: None },
    )?;
    let params = SamplingParams {
        temperature: parsed(args, "--temperature", 0.0)?,
        top_k: parsed(args, "--top-k", 0)?,
        top_p: parsed(args, "--top-p", 1.0)?,
        min_p: parsed(args, "--min-p", 0.0)?,
        ..SamplingParams::default()
    };
    let ids = tok.encode(prompt);
    let max_tokens = parsed(args, "--max-tokens", 64usize)?.min(loaded.max_context.saturating_sub(ids.len()));
    let (out, mut rx) = unbounded_channel();
    let req = Request { id: 0, prompt: ids, max_tokens, eos: llama_cpu_simd::generate::stop_tokens(&dir)? };
    let seed = parsed(args, "--seed", 0)?;
    tx.send(Job { req, params, seed, stop: vec![], out }).map_err(|_| "the engine thread is gone")?;
    let mut stdout = std::io::stdout();
    while let Some(o) = rx.blocking_recv() {
        match o {
            Out::Text(t) => {
                let _ = stdout.write_all(t.as_bytes());
                let _ = stdout.flush();
            }
            Out::Done { .. } => break,
        }
    }
    println!();
    Ok(())
}

struct App {
    model_id: String,
    tok: Arc<Tokenizer>,
    template: String,
    eos: Vec<u32>,
    max_context: usize,
    engine: std::sync::Mutex<std::sync::mpsc::Sender<Job>>,
    next_id: AtomicU64,
    in_flight: AtomicUsize,
    _vocab: usize,
}

fn serve(args: &[String]) -> Result<(), Fail> {
    let dir = PathBuf::from(required(args, "--model", "serve", "DIR")?);
    let host = flag(args, "--host").unwrap_or("127.0.0.1");
    let port: u16 = parsed(args, "--port", 8000)?;
    let addr: SocketAddr =
        format!("{host}:{port}").parse().map_err(|_| Fail::Usage(format!("bad --host/--port: {host}:{port}")))?;
    let sizes = sizes(args)?;
    let tok = Arc::new(Tokenizer::load(&dir)?);
    let template = std::fs::read_to_string(dir.join("tokenizer_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v["chat_template"].as_str().map(str::to_string))
        .unwrap_or_else(|| DEFAULT_CHAT_TEMPLATE.to_string());
    let model_id = std::fs::canonicalize(&dir)
        .unwrap_or(dir.clone())
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    // The stop tokens every gate uses: generation_config.json's eos_token_id, else config.json's.
    let eos = llama_cpu_simd::generate::stop_tokens(&dir)?;
    let shown = format!("{} from {}", model_id, dir.display());
    let (tx, loaded) = start_engine(dir, tok.clone(), sizes)?;
    let (loaded_kv, max_context) = (loaded.kv, loaded.max_context);
    let app = Arc::new(App {
        model_id,
        tok,
        template,
        eos,
        max_context: loaded.max_context,
        engine: std::sync::Mutex::new(tx),
        next_id: AtomicU64::new(1),
        in_flight: AtomicUsize::new(0),
        _vocab: loaded.vocab,
    });
    let router = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such path", "invalid_request_error", None) })
        .with_state(app);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let listener =
            tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let bound = listener.local_addr().map_err(|e| e.to_string())?;
        eprintln!("serving model {shown} on http://{bound}");
        let (blocks, size, bytes) = loaded_kv;
        eprintln!(
            "KV cache: {blocks} blocks of {size} positions ({:.2} GiB), {} full contexts of {} positions",
            bytes as f64 / (1u64 << 30) as f64,
            blocks * size / max_context.max(1),
            max_context
        );
        // component.openai_server: TCP_NODELAY on every accepted connection. With Nagle's algorithm a
        // response's second small write (the first event after the headers) waits for the client's
        // delayed ACK (40 ms minimum on Linux) on every reused keep-alive connection.
        let listener = listener.tap_io(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                eprintln!("cannot set TCP_NODELAY on an accepted connection: {e}");
            }
        });
        axum::serve(listener, router)
            .with_graceful_shutdown(ENGINE_DOWN.notified())
            .await
            .map_err(|e| e.to_string())
    })
    .map_err(Fail::Run)?;
    // Only the engine thread's failure ends the server (its Lifeline).
    eprintln!("the server answered the requests in flight and stopped");
    std::process::exit(ENGINE_FAILED)
}

/// An OpenAI-shaped error: {"error": {"message", "type", "param", "code"}}.
fn error(status: StatusCode, message: &str, kind: &str, param: Option<&str>) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "param": param, "code": null}});
    (status, axum::Json(body)).into_response()
}

fn bad(message: impl AsRef<str>, param: &str) -> Response {
    error(StatusCode::BAD_REQUEST, message.as_ref(), "invalid_request_error", Some(param))
}

async fn models(State(app): State<Arc<App>>) -> Response {
    axum::Json(json!({"object": "list", "data": [{"id": app.model_id, "object": "model", "created": 0, "owned_by": "llama-cpu-simd"}]})).into_response()
}

fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The validated sampling fields of a request body.
struct Parsed {
    max_tokens: usize,
    params: SamplingParams,
    stop: Vec<String>,
    seed: u64,
    stream: bool,
}

fn number(body: &Value, key: &str, default: f64, ok: impl Fn(f64) -> bool, range: &str) -> Result<f64, Response> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() && ok(x) => Ok(x),
            _ => Err(bad(format!("{key} must be a number in {range}, got {v}"), key)),
        },
    }
}

fn parse_common(app: &App, body: &Value, prompt_len: usize) -> Result<Parsed, Response> {
    if let Some(m) = body.get("model").and_then(Value::as_str)
        && m != app.model_id
    {
        return Err(error(
            StatusCode::NOT_FOUND,
            &format!("the model {m:?} does not exist; this server serves {:?}", app.model_id),
            "invalid_request_error",
            Some("model"),
        ));
    }
    let room = app.max_context.saturating_sub(prompt_len);
    if room == 0 {
        return Err(bad(
            format!("the prompt has {prompt_len} tokens; this model's context is {} tokens", app.max_context),
            "prompt",
        ));
    }
    let max_tokens = match body.get("max_tokens").or_else(|| body.get("max_completion_tokens")) {
        None | Some(Value::Null) => 16.min(room),
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 && (n as usize) <= room => n as usize,
            Some(n) if n >= 1 => {
                return Err(bad(
                    format!(
                        "max_tokens {n} + the prompt's {prompt_len} tokens exceed this model's context of {} tokens",
                        app.max_context
                    ),
                    "max_tokens",
                ));
            }
            _ => return Err(bad(format!("max_tokens must be an integer >= 1, got {v}"), "max_tokens")),
        },
    };
    let temperature = number(body, "temperature", 1.0, |x| (0.0..=2.0).contains(&x), "[0, 2]")?;
    let top_p = number(body, "top_p", 1.0, |x| x > 0.0 && x <= 1.0, "(0, 1]")?;
    let top_k = number(body, "top_k", 0.0, |x| x >= 0.0 && x.fract() == 0.0, "integers >= 0 (0: off)")?;
    let min_p = number(body, "min_p", 0.0, |x| (0.0..=1.0).contains(&x), "[0, 1]")?;
    let frequency_penalty = number(body, "frequency_penalty", 0.0, |x| (-2.0..=2.0).contains(&x), "[-2, 2]")?;
    let presence_penalty = number(body, "presence_penalty", 0.0, |x| (-2.0..=2.0).contains(&x), "[-2, 2]")?;
    let repetition_penalty = number(body, "repetition_penalty", 1.0, |x| x > 0.0 && x <= 10.0, "(0, 10]")?;
    if let Some(n) = body.get("n")
        && n.as_u64() != Some(1)
    {
        return Err(bad(format!("only n = 1 is supported, got {n}"), "n"));
    }
    let stop = match body.get("stop") {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= 4 && a.iter().all(Value::is_string) => {
            a.iter().filter_map(Value::as_str).map(str::to_string).collect()
        }
        Some(v) => return Err(bad(format!("stop must be a string or a list of up to 4 strings, got {v}"), "stop")),
    };
    if stop.iter().any(String::is_empty) {
        return Err(bad("stop strings must not be empty", "stop"));
    }
    let seed = match body.get("seed") {
        None | Some(Value::Null) => now(),
        Some(v) => {
            v.as_i64().map(|s| s as u64).ok_or_else(|| bad(format!("seed must be an integer, got {v}"), "seed"))?
        }
    };
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(bad(format!("stream must be true or false, got {v}"), "stream")),
    };
    let params = SamplingParams {
        temperature: temperature as f32,
        top_k: top_k as usize,
        top_p: top_p as f32,
        min_p: min_p as f32,
        repetition_penalty: repetition_penalty as f32,
        frequency_penalty: frequency_penalty as f32,
        presence_penalty: presence_penalty as f32,
    };
    Ok(Parsed { max_tokens, params, stop, seed, stream })
}

fn json_body(bytes: &Bytes) -> Result<Value, Response> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(bad("the request body must be a JSON object", "body")),
        Err(e) => Err(bad(format!("the request body is not valid JSON: {e}"), "body")),
    }
}

/// Decrements the in-flight count when the request's response is gone.
struct Slot(Arc<App>);
impl Drop for Slot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn completions(State(app): State<Arc<App>>, bytes: Bytes) -> Response {
    let body = match json_body(&bytes) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let prompt = match body.get("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => a[0].as_str().unwrap_or_default().to_string(),
        _ => return bad("prompt must be a string", "prompt"),
    };
    run(app, body, prompt, false).await
}

async fn chat(State(app): State<Arc<App>>, bytes: Bytes) -> Response {
    let body = match json_body(&bytes) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let Some(messages) = body.get("messages").and_then(Value::as_array).filter(|m| !m.is_empty()) else {
        return bad("messages must be a non-empty list of {role, content}", "messages");
    };
    if !messages.iter().all(|m| m["role"].is_string() && m["content"].is_string()) {
        return bad("every message needs a string role and a string content", "messages");
    }
    let env = minijinja::Environment::new();
    let ctx =
        minijinja::context! { messages => messages, add_generation_prompt => true, bos_token => "", eos_token => "" };
    let prompt = match env.render_str(&app.template, ctx) {
        Ok(p) => p,
        Err(e) => return bad(format!("the chat template failed on these messages: {e}"), "messages"),
    };
    run(app, body, prompt, true).await
}

async fn run(app: Arc<App>, body: Value, prompt: String, chat: bool) -> Response {
    let ids = app.tok.encode(&prompt);
    let p = match parse_common(&app, &body, ids.len()) {
        Ok(p) => p,
        Err(r) => return r,
    };
    if app.in_flight.fetch_add(1, Ordering::SeqCst) >= MAX_IN_FLIGHT {
        app.in_flight.fetch_sub(1, Ordering::SeqCst);
        return error(
            StatusCode::TOO_MANY_REQUESTS,
            &format!("{MAX_IN_FLIGHT} requests are in flight; retry later"),
            "rate_limit_error",
            None,
        );
    }
    let slot = Slot(app.clone());
    let id = app.next_id.fetch_add(1, Ordering::SeqCst);
    let (out, mut rx) = unbounded_channel();
    let req = Request { id, prompt: ids, max_tokens: p.max_tokens, eos: app.eos.clone() };
    let job = Job { req, params: p.params, seed: p.seed, stop: p.stop, out };
    let sent = app.engine.lock().map(|e| e.send(job).is_ok()).unwrap_or(false);
    if !sent {
        return error(StatusCode::SERVICE_UNAVAILABLE, "the engine thread is gone", "server_error", None);
    }
    let rid = if chat { format!("chatcmpl-{id}") } else { format!("cmpl-{id}") };
    let created = now();
    let model = app.model_id.clone();
    if p.stream {
        let stream = sse(rx, slot, rid, created, model, chat);
        return Sse::new(stream).into_response();
    }
    let mut text = String::new();
    while let Some(o) = rx.recv().await {
        match o {
            Out::Text(t) => text.push_str(&t),
            Out::Done { finish, prompt_tokens, completion_tokens } => {
                drop(slot);
                let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens});
                let choice = if chat {
                    json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish})
                } else {
                    json!({"index": 0, "text": text, "finish_reason": finish, "logprobs": null})
                };
                let object = if chat { "chat.completion" } else { "text_completion" };
                return axum::Json(json!({"id": rid, "object": object, "created": created, "model": model, "choices": [choice], "usage": usage})).into_response();
            }
        }
    }
    error(StatusCode::INTERNAL_SERVER_ERROR, "the engine dropped the request", "server_error", None)
}

type SseItem = Result<SseEvent, std::convert::Infallible>;

/// Where a streaming response is: text still coming, the `[DONE]` event next, or ended.
enum Phase {
    Text { rx: UnboundedReceiver<Out>, slot: Slot, first: bool },
    Done(Slot),
    End,
}

/// The server-sent events of a streaming request: one chunk per piece of text, the last with its
/// finish_reason and usage, then `[DONE]`.
fn sse(
    rx: UnboundedReceiver<Out>,
    slot: Slot,
    rid: String,
    created: u64,
    model: String,
    chat: bool,
) -> impl futures_util::Stream<Item = SseItem> {
    let object = if chat { "chat.completion.chunk" } else { "text_completion" };
    let chunk = move |text: &str, finish: Option<&str>, first: bool| {
        let choice = if chat {
            let delta = if first { json!({"role": "assistant", "content": text}) } else { json!({"content": text}) };
            json!({"index": 0, "delta": delta, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": text, "finish_reason": finish, "logprobs": null})
        };
        json!({"id": rid, "object": object, "created": created, "model": model, "choices": [choice]})
    };
    futures_util::stream::unfold(Phase::Text { rx, slot, first: true }, move |phase| {
        let chunk = chunk.clone();
        async move {
            match phase {
                Phase::End => None,
                Phase::Done(slot) => {
                    drop(slot);
                    Some((Ok(SseEvent::default().data("[DONE]")), Phase::End))
                }
                Phase::Text { mut rx, slot, first } => match rx.recv().await {
                    Some(Out::Text(t)) => Some((
                        Ok(SseEvent::default().data(chunk(&t, None, first).to_string())),
                        Phase::Text { rx, slot, first: false },
                    )),
                    Some(Out::Done { finish, prompt_tokens, completion_tokens }) => {
                        let mut last = chunk("", Some(finish), first);
                        last["usage"] = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens});
                        Some((Ok(SseEvent::default().data(last.to_string())), Phase::Done(slot)))
                    }
                    None => None,
                },
            }
        }
    })
}
