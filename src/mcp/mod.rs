//! The MCP server (rmcp, stdio). The only module that knows rmcp's server side (`demo` and `doctor`
//! use its client): it turns requests into ops calls and reports into tool results (text content +
//! structuredContent matching outputSchema).
//!
//! One tool per skill (`tools`: titles, truthful annotations; `--read-only` and `--toolsets` narrow
//! the router); resources (`ckb://`, `skill://`, and `example://`, the plain example engine's sources
//! that the ckb crate's build.rs embeds as `PLAIN_ENGINE`; `resources/list_changed` after a promotion), prompts,
//! completion and logging (`handler`); portable schemas (`schema`); the stdio framing in front of
//! rmcp (`framing`). Here: progress notifications, cancellation (the call's processes killed, its
//! outcome recorded as `cancelled`), one call at a time per engine, the client's identity (from
//! initialize or a request's `_meta`), and the client's MCP roots as the workspace when
//! `--workspace` is not given.
//!
//! A failed gate is a normal result (`isError` false, `passed` false in the structured content); a
//! bad request is a tool error (`isError` true) whose text says what to fix.

#![allow(
    deprecated,
    reason = "MCP logging and roots are deprecated by SEP-2577 (protocol 2026-07-28), but the clients in use \
              (Claude Code, Gemini CLI, VS Code, Cursor) still rely on them"
)]

pub mod framing;
mod handler;
pub mod schema;
mod tools;

use std::sync::Arc;
use std::time::Duration;

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::model::{
    CallToolResult, ContentBlock, LoggingLevel, LoggingMessageNotificationParam, ProgressNotificationParam,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServiceExt};
use serde::Serialize;

use crate::harness::Budget;
use crate::ops::{Ctx, Report};
use crate::options::{ServerOptions, Toolset};

pub use handler::{COVERAGE_URI, PLAIN_ENGINE_URI};
pub use tools::{AllowedDirectories, NoArguments};

/// What the server tells an agent at initialisation: the order of work.
pub const INSTRUCTIONS: &str = "metainfer helps you build a compact LLM inference engine for exact constraints, proven \
against server-owned oracles. Order of work: 1) plan_engine with the model directory, target and dtype: it routes \
config.json to a model-family contract and lists the phases (kernels, weight_loading, decoder_layer, full_forward, \
generation, performance) with their contracts and gates. 2) lookup_contract {phase, family} before writing a phase: its \
contracts (math, shapes, tolerance, pseudocode), their failure modes and what they require, each once. Build only from these contracts; do not read or copy \
other inference frameworks. 3) scaffold_engine into an empty directory: it writes the crate with the fixed public \
signatures the gates call; keep them. 4) Implement kernels, then compile_engine and run_kernel_test until every \
kernel passes (inputs are drawn fresh each run; the seed replays one). 5) Implement weight loading, the decoder \
layer, the full forward with KV cache, the tokenizer and the greedy sampler, then verify_generation on the real \
checkpoint (tokenizer, logits and greedy tokens are compared with the reference; some prompts are random). \
6) profile_engine for tokens/s. Every call is recorded in the outcome ledger. Paths must lie in the directories \
list_allowed_directories names.";

/// Which tools the server offers (`serve --read-only`, `--toolsets`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Exposure {
    /// Only tools whose annotations say read-only.
    pub read_only: bool,
    /// Only these groups; empty: all.
    pub toolsets: Vec<Toolset>,
    /// Whether `--workspace` was given (else the client's MCP roots become the workspace).
    pub workspace_given: bool,
    /// `--model-dir` directories, kept beside the client's roots.
    pub model_dirs: Vec<std::path::PathBuf>,
}

impl Exposure {
    /// The exposure of a server started with these options.
    pub fn of(o: &ServerOptions) -> Exposure {
        Exposure {
            read_only: o.read_only,
            toolsets: o.toolsets.clone(),
            workspace_given: o.workspace.is_some(),
            model_dirs: o.model_dirs.clone(),
        }
    }
}

/// The toolset a tool belongs to.
pub fn toolset_of(tool: &str) -> Toolset {
    match tool {
        "scaffold_engine" | "compile_engine" | "check_rules" => Toolset::Build,
        "run_kernel_test" | "verify_generation" | "profile_engine" | "verify_batching" | "serve_engine" => {
            Toolset::Gates
        }
        _ => Toolset::Knowledge,
    }
}

/// The metainfer MCP server.
#[derive(Clone)]
pub struct Server {
    /// The context calls run in; replaced when the client's roots change (no `--workspace`).
    ctx: Arc<std::sync::RwLock<Arc<Ctx>>>,
    exposure: Arc<Exposure>,
    /// Least severity of the log messages sent to the client (logging/setLevel).
    log_level: Arc<std::sync::Mutex<LoggingLevel>>,
    /// Fingerprint of the knowledge base the client last listed, to notify resources/list_changed.
    ckb_seen: Arc<std::sync::Mutex<String>>,
    /// Cancellation flags of the calls in flight, so that closing the session kills their children.
    running: Arc<std::sync::Mutex<Vec<Arc<std::sync::atomic::AtomicBool>>>>,
    /// Engine directories a call is working on: a second call on the same engine is refused.
    busy: Arc<std::sync::Mutex<std::collections::HashMap<String, &'static str>>>,
    /// The tools offered (narrowed by `--read-only` and `--toolsets`).
    tool_router: ToolRouter<Self>,
}

fn ok_result<R: Report + Serialize>(report: &R, max_text: usize) -> CallToolResult {
    let value = serde_json::to_value(report).expect("reports serialise");
    let size = crate::ops::page::json_len(&value);
    if size > max_text {
        tracing::warn!("structured result of {size} characters exceeds --max-output {max_text}");
    }
    let mut r = CallToolResult::success(vec![ContentBlock::text(crate::ops::bound_text(&report.text(), max_text))]);
    r.structured_content = Some(value);
    r
}

fn level_rank(l: LoggingLevel) -> u8 {
    match l {
        LoggingLevel::Debug => 0,
        LoggingLevel::Info => 1,
        LoggingLevel::Notice => 2,
        LoggingLevel::Warning => 3,
        LoggingLevel::Error => 4,
        LoggingLevel::Critical => 5,
        LoggingLevel::Alert => 6,
        LoggingLevel::Emergency => 7,
    }
}

/// The most characters of an error's text a tool result carries: an error can echo its input (a
/// path of megabytes), and its fix usually follows the echo, so the middle is cut.
const ERROR_CHARS: usize = 4000;

fn err_result(e: crate::error::Error) -> CallToolResult {
    let n = e.message.chars().count();
    let text = if n <= ERROR_CHARS {
        e.message
    } else {
        let (head, tail) = (ERROR_CHARS * 3 / 4, ERROR_CHARS / 4);
        let start: String = e.message.chars().take(head).collect();
        let end: String = e.message.chars().skip(n - tail).collect();
        format!("{start}[... {} characters cut ...]{end}", n - head - tail)
    };
    CallToolResult::error(vec![ContentBlock::text(text)])
}

impl Server {
    /// The context calls run in now.
    fn ctx(&self) -> Arc<Ctx> {
        self.ctx.read().expect("not poisoned").clone()
    }

    /// Remember the client's name and version for the ledger: from its initialize request, or,
    /// for a client that skips initialization (the 2026 protocol's per-request metadata), from the
    /// request's `_meta` (`io.modelcontextprotocol/clientInfo`).
    fn note_client(&self, rc: &RequestContext<RoleServer>) {
        let info = rc.meta.client_info().or_else(|| rc.peer.peer_info().map(|i| i.client_info.clone()));
        if let Some(info) = info {
            let who = format!("{}/{}", info.name, info.version);
            let ctx = self.ctx();
            if let Ok(mut c) = ctx.client.write()
                && *c != who
            {
                *c = who;
            }
        }
    }

    fn to_result<R: Report + Serialize>(&self, r: crate::error::Result<R>) -> Result<CallToolResult, ErrorData> {
        Ok(match r {
            Ok(report) => ok_result(&report, self.ctx().max_output),
            Err(e) => err_result(e),
        })
    }

    /// Run a short operation off the async runtime (it reads files, which may be slow or large),
    /// under the call's time limit.
    async fn quick<R, F>(
        &self,
        rc: &RequestContext<RoleServer>,
        what: &'static str,
        f: F,
    ) -> Result<CallToolResult, ErrorData>
    where
        R: Report + Serialize + Send + 'static,
        F: FnOnce(&Ctx) -> crate::error::Result<R> + Send + 'static,
    {
        self.note_client(rc);
        let ctx = self.ctx();
        let limit = ctx.time_limit_s;
        let job = tokio::task::spawn_blocking(move || f(&ctx));
        match tokio::time::timeout(Duration::from_secs(limit), job).await {
            Ok(Ok(r)) => self.to_result(r),
            Ok(Err(e)) => Err(ErrorData::internal_error(format!("{what} failed inside the server: {e}"), None)),
            Err(_) => Ok(err_result(crate::error::Error::usage(format!(
                "{what} ran past the time limit of {limit} s and was abandoned"
            )))),
        }
    }

    /// A server over a context, offering the tools `exposure` allows.
    pub fn new(ctx: Ctx, exposure: Exposure) -> Server {
        let mut tool_router = Self::tool_router();
        for t in tool_router.list_all() {
            let read_only = t.annotations.as_ref().and_then(|a| a.read_only_hint).unwrap_or(false);
            let in_set = exposure.toolsets.is_empty() || exposure.toolsets.contains(&toolset_of(&t.name));
            if (exposure.read_only && !read_only) || !in_set {
                tool_router.remove_route(&t.name);
            }
        }
        let seen = ctx.ckb.fingerprint().to_string();
        Server {
            ctx: Arc::new(std::sync::RwLock::new(Arc::new(ctx))),
            exposure: Arc::new(exposure),
            log_level: Arc::new(std::sync::Mutex::new(LoggingLevel::Info)),
            ckb_seen: Arc::new(std::sync::Mutex::new(seen)),
            running: Default::default(),
            busy: Default::default(),
            tool_router,
        }
    }

    /// Send a log message to the client (notifications/message) when its level is enabled.
    async fn log(&self, peer: &rmcp::Peer<RoleServer>, level: LoggingLevel, data: String) {
        if level_rank(level) < level_rank(*self.log_level.lock().expect("not poisoned")) {
            return;
        }
        let _ = peer
            .notify_logging_message(
                LoggingMessageNotificationParam::new(level, serde_json::Value::String(data)).with_logger("metainfer"),
            )
            .await;
    }

    /// After a call that may have promoted a contract: when the knowledge base changed, tell the
    /// client that the resource list changed.
    async fn notify_if_ckb_changed(&self, peer: &rmcp::Peer<RoleServer>) {
        let now = self.ctx().live().ckb.fingerprint().to_string();
        let changed = {
            let mut seen = self.ckb_seen.lock().expect("not poisoned");
            let changed = *seen != now;
            *seen = now;
            changed
        };
        if changed {
            let _ = peer.notify_resource_list_changed().await;
            self.log(
                peer,
                LoggingLevel::Notice,
                "the knowledge base changed (a contract was promoted); resources/list is new".into(),
            )
            .await;
        }
    }

    /// Ask a client that offers roots for them, without holding up the session.
    fn spawn_adopt_roots(&self, peer: rmcp::Peer<RoleServer>) {
        let offers_roots = peer.peer_info().is_some_and(|i| i.capabilities.roots.is_some());
        if self.exposure.workspace_given || !offers_roots {
            return;
        }
        let server = self.clone();
        tokio::spawn(async move { server.adopt_roots(&peer).await });
    }

    /// Without `--workspace`: the client's roots (file URIs) become the workspace (the first) and
    /// further allowed directories (the rest, with the `--model-dir` directories).
    async fn adopt_roots(&self, peer: &rmcp::Peer<RoleServer>) {
        if self.exposure.workspace_given {
            return;
        }
        let roots = match peer.list_roots().await {
            Ok(r) => r.roots,
            Err(e) => {
                tracing::debug!("client offers no roots: {e}");
                return;
            }
        };
        let dirs: Vec<std::path::PathBuf> = roots
            .iter()
            .filter_map(|r| r.uri.strip_prefix("file://"))
            .map(|p| std::path::PathBuf::from(percent_decode(p)))
            .filter(|p| p.is_dir())
            .collect();
        let Some((first, rest)) = dirs.split_first() else { return };
        let ctx = self.ctx();
        let mut models: Vec<std::path::PathBuf> = rest.to_vec();
        models.extend(self.exposure.model_dirs.iter().cloned());
        let new = Ctx { workspace: first.canonicalize().ok(), models, ..(*ctx).clone() };
        tracing::info!("workspace from the client's roots: {}", first.display());
        *self.ctx.write().expect("not poisoned") = Arc::new(new);
    }

    /// Run a long, blocking operation off the async runtime with a time budget. Cancellation of the
    /// request kills its child processes; progress notifications are sent every few seconds when the
    /// client gave a progress token.
    async fn long<R, F>(
        &self,
        rc: RequestContext<RoleServer>,
        what: &'static str,
        engine: &str,
        f: F,
    ) -> Result<CallToolResult, ErrorData>
    where
        R: Report + Serialize + Send + 'static,
        F: FnOnce(&Ctx, &Budget) -> crate::error::Result<R> + Send + 'static,
    {
        // One call at a time per engine directory: builds and snapshots of one engine must not
        // interleave. Keyed by the path the call resolves to (relative to the workspace, links
        // resolved), so `eng` and `<workspace>/eng` are one engine.
        let key = self
            .ctx()
            .confine(std::path::Path::new(engine))
            .map(|d| d.path().display().to_string())
            .unwrap_or_else(|_| engine.to_string());
        {
            let mut busy = self.busy.lock().expect("not poisoned");
            if let Some(other) = busy.get(&key) {
                return Ok(err_result(crate::error::Error::usage(format!(
                    "{key} is busy with {other}; wait for that call to finish (or cancel it), then call {what} again"
                ))));
            }
            busy.insert(key.clone(), what);
        }
        struct Release(Arc<std::sync::Mutex<std::collections::HashMap<String, &'static str>>>, String);
        impl Drop for Release {
            fn drop(&mut self) {
                self.0.lock().expect("not poisoned").remove(&self.1);
            }
        }
        let _release = Release(self.busy.clone(), key);
        self.note_client(&rc);
        let time_limit_s = self.ctx().time_limit_s;
        let budget = Budget::secs(time_limit_s);
        let cancel = budget.cancel.clone();
        {
            let mut running = self.running.lock().expect("not poisoned");
            running.retain(|c| Arc::strong_count(c) > 1);
            running.push(cancel.clone());
        }
        let ctx = self.ctx();
        let b = budget.clone();
        self.log(&rc.peer, LoggingLevel::Info, format!("{what} started on {engine}")).await;
        let mut job = tokio::task::spawn_blocking(move || b.scope(|| f(&ctx, &b)));
        // The budget kills the call's children at its deadline; work in the server itself (the
        // reference forward pass, file reads) is abandoned a little later, its result dropped.
        let abandon = tokio::time::sleep(Duration::from_secs(time_limit_s.saturating_add(30)));
        tokio::pin!(abandon);
        let token = rc.meta.get_progress_token();
        let started = std::time::Instant::now();
        let mut tick = tokio::time::interval(Duration::from_secs(3));
        tick.tick().await;
        let mut n = 0.0;
        let result = loop {
            tokio::select! {
                r = &mut job => break r,
                _ = &mut abandon => {
                    cancel.store(true, std::sync::atomic::Ordering::Relaxed);
                    return Ok(err_result(crate::error::Error::usage(format!(
                        "{what} ran past the time limit of {time_limit_s} s and was abandoned; raise --time-limit or make the call smaller"
                    ))));
                }
                _ = rc.ct.cancelled() => {
                    cancel.store(true, std::sync::atomic::Ordering::Relaxed);
                    // The job sees the flag, kills its child and returns shortly.
                    let _ = (&mut job).await;
                    self.log(&rc.peer, LoggingLevel::Notice, format!("{what} cancelled; recorded as cancelled")).await;
                    return Ok(err_result(crate::error::Error::usage(format!("{what} cancelled by the client; recorded in the ledger as cancelled"))));
                }
                _ = tick.tick() => {
                    if let Some(t) = &token {
                        n += 1.0;
                        let msg = format!("{what}: {:.0} s", started.elapsed().as_secs_f64());
                        let _ = rc.peer.notify_progress(ProgressNotificationParam::new(t.clone(), n).with_message(msg)).await;
                    }
                }
            }
        };
        self.log(
            &rc.peer,
            LoggingLevel::Info,
            format!("{what} finished after {:.1} s", started.elapsed().as_secs_f64()),
        )
        .await;
        self.notify_if_ckb_changed(&rc.peer).await;
        match result {
            Ok(r) => self.to_result(r),
            Err(e) => Err(ErrorData::internal_error(format!("{what} failed inside the server: {e}"), None)),
        }
    }
}

/// Decode `%XX` escapes of a file URI's path.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Some(v) = std::str::from_utf8(&b[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Serve MCP over stdin/stdout until the client closes stdin.
///
/// # Errors
/// When the transport fails to start.
pub async fn serve_stdio(ctx: Ctx, exposure: Exposure) -> crate::error::Result<()> {
    let server = Server::new(ctx, exposure);
    let running = server.running.clone();
    // rmcp reads and writes in-process pipes; `framing` sits between them and stdio, answering
    // lines that are not JSON with JSON-RPC's parse error.
    let (rmcp_in, to_rmcp) = tokio::io::duplex(1 << 20);
    let (from_rmcp, rmcp_out) = tokio::io::duplex(1 << 20);
    let framing = tokio::spawn(framing::run(tokio::io::stdin(), tokio::io::stdout(), from_rmcp, to_rmcp));
    let service = server
        .serve((rmcp_in, rmcp_out))
        .await
        .map_err(|e| crate::error::Error::internal(format!("MCP stdio transport: {e}")))?;
    let result = service.waiting().await;
    // rmcp's output is closed: the framing copies what is left and ends.
    let _ = tokio::time::timeout(Duration::from_secs(2), framing).await;
    // The client is gone: stop every call still in flight (their children are killed and reaped).
    for c in running.lock().expect("not poisoned").iter() {
        c.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    result.map_err(|e| crate::error::Error::internal(format!("MCP session ended with an error: {e}")))?;
    Ok(())
}
