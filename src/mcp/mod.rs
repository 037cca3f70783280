//! The MCP server (rmcp, stdio). The only module that knows rmcp: it turns requests into ops calls
//! and reports into tool results (text content + structuredContent matching outputSchema).
//!
//! A failed gate is a normal result (`isError` false, `passed` false in the structured content); a
//! bad request is a tool error (`isError` true) whose text says what to fix.

pub mod schema;

use std::sync::Arc;
use std::time::Duration;

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolResult, ContentBlock, GetPromptRequestParams, GetPromptResponse, GetPromptResult, Implementation,
    ListPromptsResult, ListResourceTemplatesResult, ListResourcesResult, PaginatedRequestParams,
    ProgressNotificationParam, Prompt, PromptArgument, PromptMessage, ReadResourceRequestParams, ReadResourceResponse,
    ReadResourceResult, Resource, ResourceContents, ResourceTemplate, Role, ServerCapabilities, ServerConfig,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt, tool, tool_handler, tool_router};
use serde::Serialize;

use crate::harness::Budget;
use crate::ops::compile::{CompileReport, CompileRequest};
use crate::ops::evolve::{EvolveReport, EvolveRequest, ProposeReport, ProposeRequest};
use crate::ops::kernel_test::{KernelTestReport, KernelTestRequest};
use crate::ops::lookup::{LookupReport, LookupRequest};
use crate::ops::outcomes::{OutcomesReport, OutcomesRequest};
use crate::ops::plan::{PlanReport, PlanRequest};
use crate::ops::profile::{ProfileReport, ProfileRequest};
use crate::ops::report::{CkbReport, ReportRequest};
use crate::ops::rules::{RulesReport, RulesRequest};
use crate::ops::scaffold::{ScaffoldReport, ScaffoldRequest};
use crate::ops::verify::{VerifyReport, VerifyRequest};
use crate::ops::{Ctx, Report};
use schema::{input, output};

/// What the server tells an agent at initialisation: the order of work.
pub const INSTRUCTIONS: &str = "metainfer helps you build a compact LLM inference engine for exact constraints, proven \
against server-owned oracles. Order of work: 1) plan_engine with the model directory, target and dtype: it routes \
config.json to a model-family contract and lists the phases (kernels, weight_loading, decoder_layer, full_forward, \
generation, performance) with their contracts and gates. 2) lookup_contract for each contract id before writing its \
code: math, shapes, tolerance, pseudocode and failure modes. Build only from these contracts; do not read or copy \
other inference frameworks. 3) scaffold_engine into an empty directory: it writes the crate with the fixed public \
signatures the gates call; keep them. 4) Implement kernels, then compile_engine and run_kernel_test until every \
kernel passes (inputs are drawn fresh each run; the seed replays one). 5) Implement weight loading, the decoder \
layer, the full forward with KV cache, the tokenizer and the greedy sampler, then verify_generation on the real \
checkpoint (tokenizer, logits and greedy tokens are compared with the reference; some prompts are random). \
6) profile_engine for tokens/s. Every call is recorded in the outcome ledger.";

/// The metainfer MCP server.
#[derive(Clone)]
pub struct Server {
    ctx: Arc<Ctx>,
    /// Cancellation flags of the calls in flight, so that closing the session kills their children.
    running: Arc<std::sync::Mutex<Vec<Arc<std::sync::atomic::AtomicBool>>>>,
    /// Engine directories a call is working on: a second call on the same engine is refused.
    busy: Arc<std::sync::Mutex<std::collections::HashMap<String, &'static str>>>,
    #[allow(dead_code, reason = "read by the tool_handler macro")]
    tool_router: ToolRouter<Self>,
}

fn ok_result<R: Report + Serialize>(report: &R, max_text: usize) -> CallToolResult {
    let mut r = CallToolResult::success(vec![ContentBlock::text(crate::ops::bound_text(&report.text(), max_text))]);
    r.structured_content = Some(serde_json::to_value(report).expect("reports serialise"));
    r
}

fn err_result(e: crate::error::Error) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(e.message)])
}

impl Server {
    /// Remember the client's name and version (from its initialize request) for the ledger.
    fn note_client(&self, rc: &RequestContext<RoleServer>) {
        if let Some(info) = rc.peer.peer_info() {
            let who = format!("{}/{}", info.client_info.name, info.client_info.version);
            if let Ok(mut c) = self.ctx.client.write()
                && *c != who
            {
                *c = who;
            }
        }
    }

    fn to_result<R: Report + Serialize>(&self, r: crate::error::Result<R>) -> Result<CallToolResult, ErrorData> {
        Ok(match r {
            Ok(report) => ok_result(&report, self.ctx.max_output),
            Err(e) => err_result(e),
        })
    }

    /// A server over a context.
    pub fn new(ctx: Ctx) -> Server {
        Server {
            ctx: Arc::new(ctx),
            running: Default::default(),
            busy: Default::default(),
            tool_router: Self::tool_router(),
        }
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
        // One call at a time per engine directory: builds and snapshots of one engine must not interleave.
        let key = std::path::Path::new(engine)
            .canonicalize()
            .map(|p| p.display().to_string())
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
        let budget = Budget::secs(self.ctx.time_limit_s);
        let cancel = budget.cancel.clone();
        {
            let mut running = self.running.lock().expect("not poisoned");
            running.retain(|c| Arc::strong_count(c) > 1);
            running.push(cancel.clone());
        }
        let ctx = self.ctx.clone();
        let b = budget.clone();
        let mut job = tokio::task::spawn_blocking(move || f(&ctx, &b));
        let token = rc.meta.get_progress_token();
        let started = std::time::Instant::now();
        let mut tick = tokio::time::interval(Duration::from_secs(3));
        tick.tick().await;
        let mut n = 0.0;
        let result = loop {
            tokio::select! {
                r = &mut job => break r,
                _ = rc.ct.cancelled() => {
                    cancel.store(true, std::sync::atomic::Ordering::Relaxed);
                    // The job sees the flag, kills its child and returns shortly.
                    let _ = (&mut job).await;
                    return Ok(err_result(crate::error::Error::usage(format!("{what} cancelled by the client"))));
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
        match result {
            Ok(r) => self.to_result(r),
            Err(e) => Err(ErrorData::internal_error(format!("{what} failed inside the server: {e}"), None)),
        }
    }
}

#[tool_router]
impl Server {
    /// Plan an engine from constraints: routes the model's config.json to a model-family contract (or names the
    /// uncovered fields) and returns the build phases with their contracts and gates.
    #[tool(
        name = "plan_engine",
        input_schema = input::<PlanRequest>(),
        output_schema = output::<PlanReport>(),
        annotations(read_only_hint = true, destructive_hint = false, idempotent_hint = true, open_world_hint = false)
    )]
    async fn plan_engine(
        &self,
        Parameters(req): Parameters<PlanRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.note_client(&rc);
        self.to_result(crate::ops::plan::plan(&self.ctx, &req))
    }

    /// Look up a contract by id (math, shapes, dtypes, tolerance, pseudocode, failure modes, Rust signature) or
    /// search the knowledge base by words.
    #[tool(
        name = "lookup_contract",
        input_schema = input::<LookupRequest>(),
        output_schema = output::<LookupReport>(),
        annotations(read_only_hint = true, destructive_hint = false, idempotent_hint = true, open_world_hint = false)
    )]
    async fn lookup_contract(
        &self,
        Parameters(req): Parameters<LookupRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.note_client(&rc);
        self.to_result(crate::ops::lookup::lookup(&self.ctx, &req))
    }

    /// List the outcome ledger, newest first: every tool call's result with its engine hash, contracts and
    /// figures. Paginated: pass `next_cursor` back as `cursor`.
    #[tool(
        name = "list_outcomes",
        input_schema = input::<OutcomesRequest>(),
        output_schema = output::<OutcomesReport>(),
        annotations(read_only_hint = true, destructive_hint = false, idempotent_hint = true, open_world_hint = false)
    )]
    async fn list_outcomes(
        &self,
        Parameters(req): Parameters<OutcomesRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.note_client(&rc);
        self.to_result(crate::ops::outcomes::list(&self.ctx, &req))
    }

    /// Report what the ledger says about the knowledge base: per contract attempts, first-try pass rate, attempts
    /// and time to green, frequent failure modes; the same per reference level; each engine's phase timeline; and
    /// the coverage matrix (family x platform x dtype).
    #[tool(
        name = "ckb_report",
        input_schema = input::<ReportRequest>(),
        output_schema = output::<CkbReport>(),
        annotations(read_only_hint = true, destructive_hint = false, idempotent_hint = true, open_world_hint = false)
    )]
    async fn ckb_report(
        &self,
        Parameters(req): Parameters<ReportRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.note_client(&rc);
        self.to_result(crate::ops::report::report(&self.ctx, &req))
    }

    /// Cluster recurring failures in the ledger that no known failure mode explains, and stage one candidate
    /// failure-mode contract per cluster (with the outcome ids as evidence). Candidates never enter the knowledge
    /// base without promotion.
    #[tool(
        name = "evolve_knowledge",
        input_schema = input::<EvolveRequest>(),
        output_schema = output::<EvolveReport>(),
        annotations(read_only_hint = false, destructive_hint = false, idempotent_hint = true, open_world_hint = false)
    )]
    async fn evolve_knowledge(
        &self,
        Parameters(req): Parameters<EvolveRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.note_client(&rc);
        self.to_result(crate::ops::evolve::evolve(&self.ctx, &req))
    }

    /// Propose a new or amended contract (a model family, kernel, component, platform or failure mode) as TOML.
    /// It is validated (schema and lint, against the knowledge base) and staged; an amendment must bump the
    /// version. A new model family or platform routes provisionally at once: plan, scaffold and the gates use it,
    /// and a passing verify_generation (or verified profile_engine) under it promotes it into the CKB working copy
    /// (--ckb DIR). Other proposals are promoted once the ledger holds evidence, or by a person.
    #[tool(
        name = "propose_contract",
        input_schema = input::<ProposeRequest>(),
        output_schema = output::<ProposeReport>(),
        annotations(read_only_hint = false, destructive_hint = false, idempotent_hint = true, open_world_hint = false)
    )]
    async fn propose_contract(
        &self,
        Parameters(req): Parameters<ProposeRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.note_client(&rc);
        self.to_result(crate::ops::evolve::propose(&self.ctx, &req))
    }

    /// Write a compilable engine crate for the constraints into an empty directory: Cargo.toml, one module per
    /// phase, the fixed public signatures the gates call with their contract docs, and todo!() bodies.
    #[tool(
        name = "scaffold_engine",
        input_schema = input::<ScaffoldRequest>(),
        output_schema = output::<ScaffoldReport>(),
        annotations(read_only_hint = false, destructive_hint = false, idempotent_hint = false, open_world_hint = false)
    )]
    async fn scaffold_engine(
        &self,
        Parameters(req): Parameters<ScaffoldRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.note_client(&rc);
        self.to_result(crate::ops::scaffold::scaffold(&self.ctx, &req))
    }

    /// Build the engine crate (release) and return compiler errors with file, line, code and a contract hint.
    #[tool(
        name = "compile_engine",
        input_schema = input::<CompileRequest>(),
        output_schema = output::<CompileReport>(),
        annotations(read_only_hint = true, destructive_hint = false, idempotent_hint = true, open_world_hint = false)
    )]
    async fn compile_engine(
        &self,
        Parameters(req): Parameters<CompileRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let engine = req.engine.clone();
        self.long(rc, "compile_engine", &engine, move |ctx, b| crate::ops::compile::compile(ctx, &req, b)).await
    }

    /// Test the engine's kernels against the f64 oracle at each contract's tolerance, on inputs drawn from a
    /// fresh seed (reported; pass it back to replay). Per kernel: pass/fail, max abs/rel error, worst case.
    #[tool(
        name = "run_kernel_test",
        input_schema = input::<KernelTestRequest>(),
        output_schema = output::<KernelTestReport>(),
        annotations(read_only_hint = true, destructive_hint = false, idempotent_hint = false, open_world_hint = false)
    )]
    async fn run_kernel_test(
        &self,
        Parameters(req): Parameters<KernelTestRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let engine = req.engine.clone();
        self.long(rc, "run_kernel_test", &engine, move |ctx, b| crate::ops::kernel_test::kernel_test(ctx, &req, b))
            .await
    }

    /// Verify end-to-end generation on a real checkpoint: the engine's tokenizer against HF tokenizers, greedy
    /// tokens exactly and per-step logits within tolerance against the reference forward pass. Some prompts are
    /// drawn at random on every run. A pass under a staged model-family or platform proposal promotes it into the
    /// CKB working copy.
    #[tool(
        name = "verify_generation",
        input_schema = input::<VerifyRequest>(),
        output_schema = output::<VerifyReport>(),
        annotations(read_only_hint = false, destructive_hint = false, idempotent_hint = false, open_world_hint = false)
    )]
    async fn verify_generation(
        &self,
        Parameters(req): Parameters<VerifyRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let engine = req.engine.clone();
        self.long(rc, "verify_generation", &engine, move |ctx, b| crate::ops::verify::verify(ctx, &req, b)).await
    }

    /// Check the zero-reference and anti-fake rules on an engine: denied dependencies (full resolved graph),
    /// paths, includes and symlinks outside the crate, build scripts, changed gate signatures, hard-coded outputs,
    /// and fingerprint matches with registered reference code. Also run before every gate.
    #[tool(
        name = "check_rules",
        input_schema = input::<RulesRequest>(),
        output_schema = output::<RulesReport>(),
        annotations(read_only_hint = true, destructive_hint = false, idempotent_hint = true, open_world_hint = false)
    )]
    async fn check_rules(
        &self,
        Parameters(req): Parameters<RulesRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let engine = req.engine.clone();
        self.long(rc, "check_rules", &engine, move |ctx, b| crate::ops::rules::check_rules(ctx, &req, b)).await
    }

    /// Measure prefill and decode tokens/s (median, min, max over several runs), time to first token and load
    /// time, against the platform's bandwidth roofline. A verified pass under a staged model-family or platform
    /// proposal promotes it into the CKB working copy.
    #[tool(
        name = "profile_engine",
        input_schema = input::<ProfileRequest>(),
        output_schema = output::<ProfileReport>(),
        annotations(read_only_hint = false, destructive_hint = false, idempotent_hint = false, open_world_hint = false)
    )]
    async fn profile_engine(
        &self,
        Parameters(req): Parameters<ProfileRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let engine = req.engine.clone();
        self.long(rc, "profile_engine", &engine, move |ctx, b| crate::ops::profile::profile(ctx, &req, b)).await
    }
}

/// Resource URI of the coverage report.
pub const COVERAGE_URI: &str = "ckb://coverage";

impl Server {
    /// Read one resource by URI: `ckb://contract/{id}` (TOML), `ckb://coverage` (Markdown),
    /// `skill://{name}` (SKILL.md text).
    fn resource(&self, uri: &str) -> Result<(String, &'static str), ErrorData> {
        if uri == COVERAGE_URI {
            return Ok((self.ctx.ckb.coverage_report(), "text/markdown"));
        }
        if let Some(id) = uri.strip_prefix("ckb://contract/") {
            let c = self.ctx.ckb.get(id).map_err(|e| ErrorData::resource_not_found(e.message, None))?;
            let text = toml::to_string_pretty(c).map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
            return Ok((text, "application/toml"));
        }
        if let Some(name) = uri.strip_prefix("skill://") {
            let skills = crate::guide::skills().map_err(|e| ErrorData::internal_error(e.message, None))?;
            return skills.into_iter().find(|s| s.name == name).map(|s| (s.text, "text/markdown")).ok_or_else(|| {
                ErrorData::resource_not_found(format!("no skill `{name}`; resources/list names them"), None)
            });
        }
        Err(ErrorData::resource_not_found(
            format!("unknown resource `{uri}`; use ckb://contract/{{id}}, {COVERAGE_URI} or skill://{{name}}"),
            None,
        ))
    }
}

#[tool_handler]
impl ServerHandler for Server {
    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        let mut out = vec![
            Resource::new(COVERAGE_URI, "ckb-coverage")
                .with_description("What the contract knowledge base covers: families, platforms, dtypes")
                .with_mime_type("text/markdown"),
        ];
        for c in self.ctx.ckb.all() {
            out.push(
                Resource::new(format!("ckb://contract/{}", c.id), c.id.clone())
                    .with_description(c.summary.clone())
                    .with_mime_type("application/toml"),
            );
        }
        for s in crate::guide::skills().map_err(|e| ErrorData::internal_error(e.message, None))? {
            out.push(
                Resource::new(format!("skill://{}", s.name), s.name.clone())
                    .with_description(s.description)
                    .with_mime_type("text/markdown"),
            );
        }
        Ok(ListResourcesResult::with_all_items(out))
    }

    async fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, ErrorData> {
        Ok(ListResourceTemplatesResult::with_all_items(vec![
            ResourceTemplate::new("ckb://contract/{id}", "contract")
                .with_description("A contract of the knowledge base as TOML, e.g. ckb://contract/kernel.rope")
                .with_mime_type("application/toml"),
            ResourceTemplate::new("skill://{name}", "skill")
                .with_description("An agent skill (SKILL.md), e.g. skill://generate-engine")
                .with_mime_type("text/markdown"),
        ]))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        let (text, mime) = self.resource(&request.uri)?;
        Ok(ReadResourceResult::new(vec![ResourceContents::text(text, request.uri.clone()).with_mime_type(mime)]).into())
    }

    async fn list_prompts(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, ErrorData> {
        let prompts = crate::guide::prompts().map_err(|e| ErrorData::internal_error(e.message, None))?;
        Ok(ListPromptsResult::with_all_items(
            prompts
                .into_iter()
                .map(|p| {
                    let args = p
                        .arguments
                        .iter()
                        .map(|a| {
                            PromptArgument::new(&a.name).with_description(&a.description).with_required(a.required)
                        })
                        .collect();
                    Prompt::new(p.name, Some(p.description), Some(args))
                })
                .collect(),
        ))
    }

    async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, ErrorData> {
        let prompts = crate::guide::prompts().map_err(|e| ErrorData::internal_error(e.message, None))?;
        let p = prompts.iter().find(|p| p.name == request.name).ok_or_else(|| {
            ErrorData::invalid_params(
                format!(
                    "no prompt `{}`; prompts: {}",
                    request.name,
                    prompts.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", ")
                ),
                None,
            )
        })?;
        let args: std::collections::BTreeMap<String, String> = request
            .arguments
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.as_str().map(str::to_owned).unwrap_or_else(|| v.to_string())))
            .collect();
        let text = p.render(&args).map_err(|e| ErrorData::invalid_params(e.message, None))?;
        Ok(GetPromptResult::new(vec![PromptMessage::new_text(Role::User, text)])
            .with_description(p.description.clone())
            .into())
    }

    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().enable_resources().enable_prompts().build())
            .with_server_info(
                Implementation::new("metainfer", env!("CARGO_PKG_VERSION"))
                    .with_title("metainfer: contracts, oracles and gates for custom LLM inference engines"),
            )
            .with_instructions(INSTRUCTIONS)
    }
}

/// Serve MCP over stdin/stdout until the client closes stdin.
///
/// # Errors
/// When the transport fails to start.
pub async fn serve_stdio(ctx: Ctx) -> crate::error::Result<()> {
    let server = Server::new(ctx);
    let running = server.running.clone();
    let service = server
        .serve(rmcp::transport::stdio())
        .await
        .map_err(|e| crate::error::Error::internal(format!("MCP stdio transport: {e}")))?;
    let result = service.waiting().await;
    // The client is gone: stop every call still in flight (their children are killed and reaped).
    for c in running.lock().expect("not poisoned").iter() {
        c.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    result.map_err(|e| crate::error::Error::internal(format!("MCP session ended with an error: {e}")))?;
    Ok(())
}
