//! The server handler: resources (ckb:// contracts, coverage and schema, skill://, example://), prompts, completions, logging
//! level, roots notifications and the server's capabilities and instructions.

use rmcp::model::{
    CompleteRequestParams, CompleteResult, CompletionInfo, GetPromptRequestParams, GetPromptResponse, GetPromptResult,
    Implementation, ListPromptsResult, ListResourceTemplatesResult, ListResourcesResult, PaginatedRequestParams,
    Prompt, PromptArgument, PromptMessage, ReadResourceRequestParams, ReadResourceResponse, ReadResourceResult,
    Reference, Resource, ResourceContents, ResourceTemplate, Role, ServerCapabilities, ServerConfig,
    SetLevelRequestParams,
};
use rmcp::service::{NotificationContext, RequestContext};
use rmcp::{ErrorData, RoleServer, ServerHandler, tool_handler};

use super::{INSTRUCTIONS, Server};

/// Resource URI of the coverage report.
pub const COVERAGE_URI: &str = "ckb://coverage";

/// Resource URI of the contract schema (JSON Schema, as `metainfer ckb schema` prints it): every
/// field, the graph ops with their inputs, weights and parameters, and the expression grammar.
pub const SCHEMA_URI: &str = "ckb://schema";

/// Resource URI prefix of the plain example engine's files (`examples/engines/llama-cpu-plain`):
/// the template an engine of any covered family imitates, one plain function per kernel contract.
pub const PLAIN_ENGINE_URI: &str = "example://llama-cpu-plain/";

impl Server {
    /// Read one resource by URI: `ckb://contract/{id}` (TOML), `ckb://coverage` (Markdown),
    /// `skill://{name}` (SKILL.md text), `example://llama-cpu-plain/{path}` (the plain example
    /// engine's sources).
    fn resource(&self, uri: &str) -> Result<(String, &'static str), ErrorData> {
        if uri == COVERAGE_URI {
            return Ok((self.ctx().live().ckb.coverage_report(), "text/markdown"));
        }
        if uri == SCHEMA_URI {
            let text = serde_json::to_string_pretty(&crate::ckb::contract_schema())
                .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
            return Ok((text, "application/schema+json"));
        }
        if let Some(id) = uri.strip_prefix("ckb://contract/") {
            let ctx = self.ctx();
            let live = ctx.live();
            let c = live.ckb.get(id).map_err(|e| ErrorData::resource_not_found(e.message, None))?;
            let text = toml::to_string_pretty(c).map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
            return Ok((text, "application/toml"));
        }
        if let Some(name) = uri.strip_prefix("skill://") {
            let skills = crate::guide::skills().map_err(|e| ErrorData::internal_error(e.message, None))?;
            return skills.into_iter().find(|s| s.name == name).map(|s| (s.text, "text/markdown")).ok_or_else(|| {
                ErrorData::resource_not_found(format!("no skill `{name}`; resources/list names them"), None)
            });
        }
        if let Some(path) = uri.strip_prefix(PLAIN_ENGINE_URI) {
            return crate::ckb::embedded::PLAIN_ENGINE
                .iter()
                .find(|(p, _)| *p == path)
                .map(|(p, text)| {
                    (text.to_string(), if p.ends_with(".toml") { "application/toml" } else { "text/x-rust" })
                })
                .ok_or_else(|| {
                    ErrorData::resource_not_found(
                        format!("the plain example engine has no file `{path}`; resources/list names them"),
                        None,
                    )
                });
        }
        Err(ErrorData::resource_not_found(
            format!(
                "unknown resource `{uri}`; use ckb://contract/{{id}}, {COVERAGE_URI}, {SCHEMA_URI}, skill://{{name}} or {PLAIN_ENGINE_URI}{{path}}"
            ),
            None,
        ))
    }
}

#[tool_handler(router = self.tool_router)]
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
            Resource::new(SCHEMA_URI, "ckb-schema")
                .with_description(
                    "JSON Schema of a contract file: every field, the graph ops (inputs, weights, parameters) and the expression grammar, with examples",
                )
                .with_mime_type("application/schema+json"),
        ];
        let ctx = self.ctx();
        let live = ctx.live();
        *self.ckb_seen.lock().expect("not poisoned") = live.ckb.fingerprint().to_string();
        for c in live.ckb.all() {
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
        for (path, _) in crate::ckb::embedded::PLAIN_ENGINE {
            out.push(
                Resource::new(format!("{PLAIN_ENGINE_URI}{path}"), format!("llama-cpu-plain/{path}"))
                    .with_description(
                        "The plain example engine (every covered family, f32, one function per kernel contract): the template to imitate",
                    )
                    .with_mime_type(if path.ends_with(".toml") { "application/toml" } else { "text/x-rust" }),
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
            ResourceTemplate::new(format!("{PLAIN_ENGINE_URI}{{path}}"), "plain-engine")
                .with_description(
                    "A source file of the plain example engine, the template engine, e.g. example://llama-cpu-plain/src/model.rs",
                ),
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

    async fn complete(
        &self,
        request: CompleteRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CompleteResult, ErrorData> {
        let arg = request.argument.name.as_str();
        let prefix = request.argument.value.as_str();
        let values = match (&request.r#ref, arg) {
            (Reference::Resource(_), "id") | (Reference::Prompt(_), "kernel") => {
                self.contract_ids(prefix, arg == "kernel")
            }
            (Reference::Prompt(_), "engine" | "workspace") => self.paths(prefix, "metainfer.toml"),
            (Reference::Prompt(_), "model") => self.paths(prefix, "config.json"),
            (Reference::Prompt(_), "phase") => {
                crate::ckb::Phase::ALL.iter().map(|p| p.name().to_string()).filter(|p| p.starts_with(prefix)).collect()
            }
            (Reference::Prompt(_), "dtype") => {
                ["f32", "bf16", "f16", "int8"].iter().map(|d| d.to_string()).filter(|d| d.starts_with(prefix)).collect()
            }
            (Reference::Prompt(_), "target") => self
                .ctx()
                .ckb
                .of_kind(crate::ckb::Kind::Platform)
                .filter_map(|p| p.platform.as_ref().map(|x| x.target.clone()))
                .filter(|t| t.starts_with(prefix))
                .collect(),
            _ => vec![],
        };
        let total = values.len();
        let mut values = values;
        values.truncate(CompletionInfo::MAX_VALUES);
        let mut info = CompletionInfo::new(values).map_err(|e| ErrorData::internal_error(e, None))?;
        info.total = Some(total as u32);
        info.has_more = Some(total > CompletionInfo::MAX_VALUES);
        Ok(CompleteResult::new(info))
    }

    async fn set_level(
        &self,
        request: SetLevelRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        *self.log_level.lock().expect("not poisoned") = request.level;
        Ok(())
    }

    async fn on_initialized(&self, context: NotificationContext<RoleServer>) {
        self.spawn_adopt_roots(context.peer);
    }

    async fn on_roots_list_changed(&self, context: NotificationContext<RoleServer>) {
        self.spawn_adopt_roots(context.peer);
    }

    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_resources()
                .enable_resources_list_changed()
                .enable_prompts()
                .enable_logging()
                .enable_completions()
                .build(),
        )
        .with_server_info(
            Implementation::new("metainfer", env!("CARGO_PKG_VERSION"))
                .with_title("metainfer: contracts, oracles and gates for custom LLM inference engines"),
        )
        .with_instructions(INSTRUCTIONS)
    }
}

impl Server {
    /// Contract ids starting with `prefix` (kernels only with `kernels`), for completion.
    fn contract_ids(&self, prefix: &str, kernels: bool) -> Vec<String> {
        let ctx = self.ctx();
        let mut ids: Vec<String> = ctx
            .ckb
            .all()
            .filter(|c| !kernels || c.kind == crate::ckb::Kind::Kernel)
            .map(|c| c.id.clone())
            .filter(|id| id.starts_with(prefix) || (kernels && id.trim_start_matches("kernel.").starts_with(prefix)))
            .collect();
        ids.sort();
        ids
    }

    /// Directories under the workspace (and the allowed model directories) that hold `marker`
    /// (metainfer.toml for engines, config.json for models) and start with `prefix`, for
    /// completion; relative to the workspace where they lie in it. At most three levels deep.
    fn paths(&self, prefix: &str, marker: &str) -> Vec<String> {
        let ctx = self.ctx();
        let base = ctx.workspace.clone().unwrap_or_else(|| std::env::current_dir().unwrap_or_default());
        let mut out = Vec::new();
        for root in std::iter::once(&base).chain(&ctx.models) {
            for e in walkdir::WalkDir::new(root)
                .max_depth(3)
                .into_iter()
                .filter_entry(|e| {
                    let n = e.file_name().to_string_lossy();
                    e.depth() == 0 || !(n.starts_with('.') || n == "target" || n == "node_modules")
                })
                .filter_map(|e| e.ok())
            {
                if e.file_type().is_dir() && e.path().join(marker).is_file() {
                    let shown = match e.path().strip_prefix(&base) {
                        Ok(r) if !r.as_os_str().is_empty() => r.display().to_string(),
                        _ => e.path().display().to_string(),
                    };
                    if shown.starts_with(prefix) && !out.contains(&shown) {
                        out.push(shown);
                    }
                }
            }
        }
        out.sort();
        out
    }
}
