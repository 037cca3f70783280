//! Registration of the server in agent clients: each client's config file and format, edited in
//! place. Other servers, other settings, comments and key order of an existing file are kept; an
//! existing entry of the same name is replaced only when asked to (`replace`), and then only its
//! command, arguments and environment change (other keys such as `disabled` or `trust` stay).
//!
//! Formats (as the clients document them): Claude Code `.mcp.json` and Cursor `.cursor/mcp.json` and
//! Gemini CLI `.gemini/settings.json` use `{"mcpServers": {NAME: {command, args, env}}}`; VS Code
//! `.vscode/mcp.json` uses `{"servers": {NAME: {type: "stdio", command, args}}}`. Gemini CLI and
//! VS Code read JSON with comments, so every JSON file is edited through a concrete syntax tree
//! (`jsonc-parser`'s CST) that keeps comments and formatting. Codex uses `[mcp_servers.NAME]` in
//! `~/.codex/config.toml` (or `$CODEX_HOME`), edited with `toml_edit` (comments kept); Codex starts
//! servers without the shell's environment and cuts tool calls at its `tool_timeout_sec`, so its
//! entry names the variables cargo needs (`env_vars`, and `env` with this machine's RUSTUP_HOME and
//! CARGO_HOME) and a tool timeout above the server's own time limit.
//!
//! The entry's command is the registering binary's canonical absolute path, its arguments every
//! server option given (`ServerOptions`). Entries are read back for `doctor`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use jsonc_parser::ParseOptions;
use jsonc_parser::cst::{CstInputValue, CstObject, CstRootNode};
use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::options::ServerOptions;

/// A supported client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Client {
    /// Claude Code (`.mcp.json`).
    Claude,
    /// Cursor (`.cursor/mcp.json`).
    Cursor,
    /// VS Code (`.vscode/mcp.json`).
    Vscode,
    /// Codex (`config.toml`, `[mcp_servers.NAME]`).
    Codex,
    /// Gemini CLI (`.gemini/settings.json`).
    Gemini,
}

/// Environment variables the Codex entry forwards from the environment Codex runs in (`env_vars`):
/// what cargo and rustup need to find a toolchain, and where the server keeps its files.
pub const CODEX_ENV_VARS: [&str; 8] =
    ["PATH", "HOME", "RUSTUP_HOME", "CARGO_HOME", "RUSTUP_TOOLCHAIN", "METAINFER_LEDGER", "METAINFER_CACHE", "TMPDIR"];

/// Seconds the Codex entry's tool timeout exceeds the server's own time limit, so that the server
/// reports a timed-out gate before the client gives up on the call.
pub const CODEX_TIMEOUT_MARGIN_S: u64 = 60;

/// The server entry a client starts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Entry {
    /// Executable: the absolute, canonical path of the binary that registered it (a client started
    /// from a desktop menu may not have `~/.cargo/bin` on its PATH).
    pub command: String,
    /// Arguments, starting with `serve`.
    pub args: Vec<String>,
    /// Environment set for the server (`env`).
    pub env: BTreeMap<String, String>,
    /// Variables forwarded from the client's environment (Codex `env_vars`).
    pub env_vars: Vec<String>,
    /// Tool-call timeout, seconds (Codex `tool_timeout_sec`).
    pub tool_timeout_s: Option<u64>,
}

/// What a merge did to an existing file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merged {
    /// The entry was new.
    Added,
    /// An entry of that name was replaced (`replace`).
    Replaced,
    /// An identical entry was there already; the file is unchanged.
    Unchanged,
}

impl Client {
    /// Every client, in README's order.
    pub const ALL: [Client; 5] = [Client::Claude, Client::Codex, Client::Gemini, Client::Cursor, Client::Vscode];

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Client::Claude => "claude",
            Client::Cursor => "cursor",
            Client::Vscode => "vscode",
            Client::Codex => "codex",
            Client::Gemini => "gemini",
        }
    }

    /// Parse a command-line name.
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Usage`] naming the valid names.
    pub fn parse(s: &str) -> Result<Client> {
        Client::ALL.into_iter().find(|c| c.name() == s).ok_or_else(|| {
            Error::usage(format!("unknown client `{s}`; clients: claude, codex, gemini, cursor, vscode"))
        })
    }

    /// The config file the client reads, for a project directory.
    pub fn config_path(self, project: &Path) -> PathBuf {
        match self {
            Client::Claude => project.join(".mcp.json"),
            Client::Cursor => project.join(".cursor/mcp.json"),
            Client::Vscode => project.join(".vscode/mcp.json"),
            Client::Gemini => project.join(".gemini/settings.json"),
            Client::Codex => std::env::var_os("CODEX_HOME")
                .map(PathBuf::from)
                .or_else(|| dirs::home_dir().map(|h| h.join(".codex")))
                .unwrap_or_else(|| project.join(".codex"))
                .join("config.toml"),
        }
    }

    /// Whether the config file belongs to the project (so paths in it may be workspace-relative)
    /// rather than to the user (Codex: one file for every project).
    pub fn project_file(self) -> bool {
        self != Client::Codex
    }

    /// The entry name to register under: `metainfer`, except for Codex, whose one user-wide file
    /// holds every project's entry: `metainfer-<project directory name>` there, so that registering
    /// a second project does not replace the first.
    pub fn default_name(self, project: &Path) -> String {
        if self != Client::Codex {
            return "metainfer".into();
        }
        let dir: String = project
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c.to_ascii_lowercase() } else { '-' })
            .collect();
        if dir.is_empty() { "metainfer".into() } else { format!("metainfer-{dir}") }
    }

    /// How the client names the project directory inside its own config file, when it expands a
    /// variable or starts the server in the project: VS Code and Cursor expand `${workspaceFolder}`;
    /// Claude Code starts project servers in the project directory (`.`). None: write absolute paths.
    fn workspace_token(self) -> Option<&'static str> {
        match self {
            Client::Vscode | Client::Cursor => Some("${workspaceFolder}"),
            Client::Claude => Some("."),
            Client::Gemini | Client::Codex => None,
        }
    }

    /// The entry for a project: `exe serve --workspace <project> ...` (`exe` as given: the caller
    /// passes the running binary's canonical path) with every option of `opts`
    /// that differs from its default. Paths inside the project are written relative to the
    /// workspace where the client supports it (portable project files); others absolute.
    pub fn entry(self, project: &Path, exe: &Path, opts: &ServerOptions) -> Entry {
        let token = self.workspace_token();
        let rel = |p: &Path| -> PathBuf {
            let abs = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
            match (token, abs.strip_prefix(project)) {
                (Some(t), Ok(r)) if r.as_os_str().is_empty() => PathBuf::from(t),
                (Some(t), Ok(r)) => Path::new(t).join(r),
                _ => abs,
            }
        };
        let mut o = opts.clone();
        o.workspace = Some(rel(project));
        o.model_dirs = opts.model_dirs.iter().map(|m| rel(m)).collect();
        o.ckb = opts.ckb.as_deref().map(rel);
        o.ledger = opts.ledger.as_deref().map(rel);
        o.cache = opts.cache.as_deref().map(rel);
        let command = exe.display().to_string();
        let mut e = Entry { command, args: o.serve_args(), ..Entry::default() };
        if self == Client::Codex {
            e.env_vars = CODEX_ENV_VARS.iter().map(|s| s.to_string()).collect();
            let home = dirs::home_dir().unwrap_or_default();
            let var = |k: &str, default: PathBuf| std::env::var(k).unwrap_or_else(|_| default.display().to_string());
            e.env.insert("RUSTUP_HOME".into(), var("RUSTUP_HOME", home.join(".rustup")));
            e.env.insert("CARGO_HOME".into(), var("CARGO_HOME", home.join(".cargo")));
            e.tool_timeout_s = Some(opts.time_limit_s + CODEX_TIMEOUT_MARGIN_S);
        }
        e
    }

    /// The JSON object of the entry in this client's format.
    fn json_entry(self, e: &Entry) -> Value {
        let mut v = serde_json::Map::new();
        if self == Client::Vscode {
            v.insert("type".into(), json!("stdio"));
        }
        v.insert("command".into(), json!(e.command));
        v.insert("args".into(), json!(e.args));
        if !e.env.is_empty() {
            v.insert("env".into(), json!(e.env));
        }
        Value::Object(v)
    }

    /// Merge the entry into the existing text of the config file (empty when absent). Other servers
    /// and settings, comments and key order are kept. An entry of the same name with other
    /// arguments is replaced only with `replace`.
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Input`] when the existing file is not valid JSON (with comments)
    /// or TOML or has an unexpected shape; [`crate::error::ErrorKind::Usage`] when an entry of the
    /// same name differs and `replace` is false (the message shows its arguments).
    pub fn merge(self, existing: &str, name: &str, e: &Entry, replace: bool) -> Result<(String, Merged)> {
        if self == Client::Codex {
            merge_toml(existing, name, e, replace)
        } else {
            self.merge_json(existing, name, e, replace)
        }
    }

    fn merge_json(self, existing: &str, name: &str, e: &Entry, replace: bool) -> Result<(String, Merged)> {
        let text = if existing.trim().is_empty() { "{}\n" } else { existing };
        let root = CstRootNode::parse(text, &ParseOptions::default())
            .map_err(|err| Error::input(format!("existing config is not valid JSON (comments allowed): {err}")))?;
        let obj = match root.value() {
            None => root.object_value_or_set(),
            Some(v) => {
                v.as_object().ok_or_else(|| Error::input("existing config is not a JSON object; fix it by hand"))?
            }
        };
        let key = if self == Client::Vscode { "servers" } else { "mcpServers" };
        let servers: CstObject = match obj.get(key) {
            None => obj.append(key, CstInputValue::Object(vec![])).object_value().expect("just appended an object"),
            Some(p) => {
                p.object_value().ok_or_else(|| Error::input(format!("`{key}` is not an object; fix it by hand")))?
            }
        };
        let want = self.json_entry(e);
        let merged = match servers.get(name) {
            None => {
                // Keys in the order the clients document them: (type,) command, args, env.
                let order = ["type", "command", "args", "env"];
                let fields = want.as_object().expect("entries are objects");
                let ordered = order.iter().filter_map(|k| fields.get(*k).map(|v| (k.to_string(), cst(v)))).collect();
                servers.append(name, CstInputValue::Object(ordered));
                Merged::Added
            }
            Some(prop) => {
                let current = prop.value().and_then(|v| v.to_serde_value()).unwrap_or(Value::Null);
                let cur = current.as_object().cloned().unwrap_or_default();
                let same = want.as_object().expect("entries are objects").iter().all(|(k, v)| match k.as_str() {
                    // Variables the user added to the entry's environment do not make it differ.
                    "env" => v
                        .as_object()
                        .expect("env is an object")
                        .iter()
                        .all(|(ek, ev)| cur.get("env").and_then(|c| c.get(ek)) == Some(ev)),
                    _ => cur.get(k) == Some(v),
                });
                if same {
                    return Ok((existing.to_string(), Merged::Unchanged));
                }
                if !replace {
                    return Err(Error::usage(format!(
                        "an entry `{name}` is already registered with {}; pass --replace to replace its command and arguments (its other keys and extra environment are kept), or --name to add another entry",
                        describe(&current)
                    )));
                }
                let o = prop
                    .object_value()
                    .ok_or_else(|| Error::input(format!("entry `{name}` is not an object; fix it by hand")))?;
                for (k, v) in want.as_object().expect("entries are objects") {
                    match (k.as_str(), o.get(k)) {
                        ("env", Some(p)) if p.object_value().is_some() => {
                            let env = p.object_value().expect("checked");
                            for (ek, ev) in v.as_object().expect("env is an object") {
                                match env.get(ek) {
                                    Some(q) => q.set_value(cst(ev)),
                                    None => {
                                        env.append(ek, cst(ev));
                                    }
                                }
                            }
                        }
                        (_, Some(p)) => p.set_value(cst(v)),
                        (_, None) => {
                            o.append(k, cst(v));
                        }
                    }
                }
                Merged::Replaced
            }
        };
        let mut out = root.to_string();
        if !out.ends_with('\n') {
            out.push('\n');
        }
        Ok((out, merged))
    }
}

impl Client {
    /// The client's name as its users know it.
    pub fn title(self) -> &'static str {
        match self {
            Client::Claude => "Claude Code",
            Client::Cursor => "Cursor",
            Client::Vscode => "VS Code",
            Client::Codex => "Codex",
            Client::Gemini => "Gemini CLI",
        }
    }

    /// Whether the client starts servers with its own (the user's) environment plus the entry's
    /// `env`; false for Codex, which passes only the variables the entry lists in `env_vars`.
    pub fn inherits_environment(self) -> bool {
        self != Client::Codex
    }

    /// The entry `name` in the text of this client's config file; None when there is none.
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Input`] when the file is not valid JSON (with comments) or TOML,
    /// or the entry has no string `command`.
    pub fn read_entry(self, text: &str, name: &str) -> Result<Option<Entry>> {
        let v: Value = if self == Client::Codex {
            let t: toml::Table = toml::from_str(text)
                .map_err(|e| Error::input(format!("not valid TOML: {e}; fix it by hand or register again")))?;
            let v = serde_json::to_value(t).map_err(|e| Error::input(e.to_string()))?;
            v.get("mcp_servers").and_then(|s| s.get(name)).cloned().unwrap_or(Value::Null)
        } else {
            let root = CstRootNode::parse(if text.trim().is_empty() { "{}" } else { text }, &ParseOptions::default())
                .map_err(|e| Error::input(format!("not valid JSON (comments allowed): {e}; fix it by hand")))?;
            let v = root.to_serde_value().unwrap_or(Value::Null);
            let key = if self == Client::Vscode { "servers" } else { "mcpServers" };
            v.get(key).and_then(|s| s.get(name)).cloned().unwrap_or(Value::Null)
        };
        if v.is_null() {
            return Ok(None);
        }
        let strings = |x: &Value| -> Vec<String> {
            x.as_array().map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect()).unwrap_or_default()
        };
        let command = v["command"].as_str().ok_or_else(|| {
            Error::input(format!("entry `{name}` has no string `command`; register again with --replace"))
        })?;
        Ok(Some(Entry {
            command: command.to_string(),
            args: strings(&v["args"]),
            env: v["env"]
                .as_object()
                .map(|o| o.iter().filter_map(|(k, x)| x.as_str().map(|s| (k.clone(), s.to_string()))).collect())
                .unwrap_or_default(),
            env_vars: strings(&v["env_vars"]),
            tool_timeout_s: v["tool_timeout_sec"].as_u64(),
        }))
    }

    /// A path argument of an entry as the client resolves it for `project`: the workspace tokens
    /// (`${workspaceFolder}`, Claude Code's `.`) and relative paths from the project directory.
    pub fn resolve_arg(self, project: &Path, arg: &str) -> PathBuf {
        let arg = arg.replace("${workspaceFolder}", &project.display().to_string());
        let p = PathBuf::from(arg);
        let p = if p.is_absolute() { p } else { project.join(p) };
        // `.` components dropped: `.` is the project itself.
        p.components().collect()
    }
}

/// A short account of an existing entry for messages: its command and arguments.
fn describe(entry: &Value) -> String {
    let args: Vec<String> = entry["args"]
        .as_array()
        .map(|a| a.iter().map(|x| x.as_str().unwrap_or("?").to_string()).collect())
        .unwrap_or_default();
    format!("command `{}` and arguments [{}]", entry["command"].as_str().unwrap_or("?"), args.join(" "))
}

/// A serde_json value as a CST input value (numbers keep their JSON text).
fn cst(v: &Value) -> CstInputValue {
    match v {
        Value::Null => CstInputValue::Null,
        Value::Bool(b) => CstInputValue::Bool(*b),
        Value::Number(n) => CstInputValue::Number(n.to_string()),
        Value::String(s) => CstInputValue::String(s.clone()),
        Value::Array(a) => CstInputValue::Array(a.iter().map(cst).collect()),
        Value::Object(o) => CstInputValue::Object(o.iter().map(|(k, v)| (k.clone(), cst(v))).collect()),
    }
}

fn merge_toml(existing: &str, name: &str, e: &Entry, replace: bool) -> Result<(String, Merged)> {
    let mut doc: toml_edit::DocumentMut =
        existing.parse().map_err(|err| Error::input(format!("existing config.toml is not valid TOML: {err}")))?;
    let servers = doc.entry("mcp_servers").or_insert(toml_edit::table());
    let servers = servers
        .as_table_mut()
        .ok_or_else(|| Error::input("`mcp_servers` in config.toml is not a table; fix it by hand"))?;
    servers.set_implicit(true);
    let mut args = toml_edit::Array::new();
    e.args.iter().for_each(|a| args.push(a.as_str()));
    let mut env_vars = toml_edit::Array::new();
    e.env_vars.iter().for_each(|a| env_vars.push(a.as_str()));
    let mut want: Vec<(&str, toml_edit::Item)> =
        vec![("command", toml_edit::value(e.command.clone())), ("args", toml_edit::value(args))];
    if !e.env_vars.is_empty() {
        want.push(("env_vars", toml_edit::value(env_vars)));
    }
    if let Some(t) = e.tool_timeout_s {
        want.push(("tool_timeout_sec", toml_edit::value(t as i64)));
    }
    let merged = match servers.get_mut(name) {
        None => {
            let mut t = toml_edit::Table::new();
            for (k, v) in want {
                t[k] = v;
            }
            if !e.env.is_empty() {
                let mut env = toml_edit::InlineTable::new();
                for (k, v) in &e.env {
                    env.insert(k, v.as_str().into());
                }
                t["env"] = toml_edit::value(env);
            }
            servers.insert(name, toml_edit::Item::Table(t));
            Merged::Added
        }
        Some(item) => {
            let t = item
                .as_table_like_mut()
                .ok_or_else(|| Error::input(format!("[mcp_servers.{name}] is not a table; fix it by hand")))?;
            let same_value = |a: Option<&toml_edit::Item>, b: &toml_edit::Item| {
                a.and_then(|x| x.as_value()).map(|x| x.to_string().trim().to_string())
                    == b.as_value().map(|x| x.to_string().trim().to_string())
            };
            let env_same = e.env.iter().all(|(k, v)| {
                t.get("env").and_then(|x| x.as_table_like()).and_then(|x| x.get(k)).and_then(|x| x.as_str()) == Some(v)
            });
            if want.iter().all(|(k, v)| same_value(t.get(k), v)) && env_same {
                return Ok((existing.to_string(), Merged::Unchanged));
            }
            if !replace {
                let cmd = t.get("command").and_then(|c| c.as_str()).unwrap_or("?").to_string();
                let args = t.get("args").and_then(|a| a.as_value()).map(|a| a.to_string()).unwrap_or_default();
                return Err(Error::usage(format!(
                    "an entry `{name}` is already registered with command `{cmd}` and arguments {}; pass --replace to replace its command and arguments (its other keys and extra environment are kept), or --name to add another entry",
                    args.trim()
                )));
            }
            for (k, v) in want {
                t.insert(k, v);
            }
            if !e.env.is_empty() {
                if t.get("env").and_then(|x| x.as_table_like()).is_none() {
                    t.insert("env", toml_edit::value(toml_edit::InlineTable::new()));
                }
                let env = t.get_mut("env").and_then(|x| x.as_table_like_mut()).expect("just ensured");
                for (k, v) in &e.env {
                    env.insert(k, toml_edit::value(v.as_str()));
                }
            }
            Merged::Replaced
        }
    };
    Ok((doc.to_string(), merged))
}

/// Merge the entry into the client's config file and write it atomically (nothing is written when
/// the entry is there already). Returns the path and what changed.
///
/// # Errors
/// An unreadable or malformed existing file (left untouched), an entry of the same name without
/// `replace`, or an unwritable directory.
pub fn register(client: Client, project: &Path, name: &str, e: &Entry, replace: bool) -> Result<(PathBuf, Merged)> {
    let path = client.config_path(project);
    let existing = match std::fs::read_to_string(&path) {
        Ok(s) => s,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(err) => return Err(Error::input(format!("{}: {err}", path.display()))),
    };
    let (text, merged) = client.merge(&existing, name, e, replace).map_err(|err| crate::error::Error {
        kind: err.kind,
        message: format!("{}: {}", path.display(), err.message),
    })?;
    if merged != Merged::Unchanged {
        let dir = path.parent().expect("config paths have a parent");
        std::fs::create_dir_all(dir).map_err(|err| Error::usage(format!("{}: {err}", dir.display())))?;
        crate::util::write_atomic(&path, text.as_bytes())?;
    }
    Ok((path, merged))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> Entry {
        Entry {
            command: "/usr/bin/metainfer".into(),
            args: vec!["serve".into(), "--workspace".into(), "/p".into()],
            ..Entry::default()
        }
    }

    #[test]
    fn json_merge_keeps_other_servers_and_settings() {
        let existing = r#"{"theme": "dark", "mcpServers": {"other": {"command": "x"}}}"#;
        let (out, m) = Client::Cursor.merge(existing, "metainfer", &entry(), false).unwrap();
        assert_eq!(m, Merged::Added);
        let out: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(out["theme"], "dark");
        assert_eq!(out["mcpServers"]["other"]["command"], "x");
        assert_eq!(out["mcpServers"]["metainfer"]["args"][0], "serve");
        let (vs, _) = Client::Vscode.merge("", "metainfer", &entry(), false).unwrap();
        let vs: Value = serde_json::from_str(&vs).unwrap();
        assert_eq!(vs["servers"]["metainfer"]["type"], "stdio");
    }

    /// A Gemini CLI settings file with comments and keys in no sorted order: only the new entry is
    /// added; every original line stays, in order.
    #[test]
    fn commented_gemini_settings_round_trip_unchanged_apart_from_the_entry() {
        let existing = "{\n  // my theme\n  \"theme\": \"GitHub\",\n  /* servers */\n  \"mcpServers\": {\n    \"zeta\": { \"command\": \"z\" }, // last on purpose\n    \"alpha\": { \"command\": \"a\" }\n  },\n  \"checkpointing\": { \"enabled\": true }\n}\n";
        let (out, m) = Client::Gemini.merge(existing, "metainfer", &entry(), false).unwrap();
        assert_eq!(m, Merged::Added);
        let mut lines = out.lines();
        for want in existing.lines() {
            let want = want.trim_end_matches(',');
            assert!(lines.any(|l| l.trim_end_matches(',') == want), "line {want:?} lost or moved:\n{out}");
        }
        let added: Vec<&str> = out.lines().filter(|l| !existing.contains(l.trim_end_matches(','))).collect();
        assert!(
            added.iter().all(|l| l.contains("metainfer")
                || l.contains("serve")
                || l.contains("/p")
                || l.contains("--workspace")
                || l.trim() == "]"
                || l.trim() == "}"
                || l.trim() == "},"
                || l.contains("\"args\"")),
            "{added:?}"
        );
        let v = CstRootNode::parse(&out, &ParseOptions::default()).unwrap().to_serde_value().unwrap();
        assert_eq!(v["mcpServers"]["metainfer"]["command"], "/usr/bin/metainfer");
        assert_eq!(v["mcpServers"]["zeta"]["command"], "z");
        // Registering again is a no-op that leaves the text byte for byte.
        let (again, m) = Client::Gemini.merge(&out, "metainfer", &entry(), false).unwrap();
        assert_eq!((again.as_str(), m), (out.as_str(), Merged::Unchanged));
    }

    #[test]
    fn a_different_existing_entry_is_replaced_only_with_replace_and_keeps_its_other_keys() {
        let existing = r#"{"mcpServers": {"metainfer": {"command": "old", "args": ["serve", "--model-dir", "/m"], "env": {"MINE": "1"}, "disabled": false}}}"#;
        let e = Client::Claude.merge(existing, "metainfer", &entry(), false).unwrap_err();
        assert!(e.message.contains("--replace") && e.message.contains("--model-dir /m"), "{e}");
        let mut with_env = entry();
        with_env.env.insert("RUSTUP_HOME".into(), "/r".into());
        let (out, m) = Client::Claude.merge(existing, "metainfer", &with_env, true).unwrap();
        assert_eq!(m, Merged::Replaced);
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["mcpServers"]["metainfer"]["command"], "/usr/bin/metainfer");
        assert_eq!(v["mcpServers"]["metainfer"]["disabled"], false);
        assert_eq!(v["mcpServers"]["metainfer"]["env"], json!({"MINE": "1", "RUSTUP_HOME": "/r"}));
    }

    #[test]
    fn toml_merge_keeps_comments_and_other_servers_and_asks_before_replacing() {
        let existing = "# mine\nmodel = \"o3\"\n\n[mcp_servers.other]\ncommand = \"x\"\n";
        let mut e = entry();
        e.env_vars = vec!["PATH".into(), "RUSTUP_HOME".into()];
        e.env.insert("RUSTUP_HOME".into(), "/r".into());
        e.tool_timeout_s = Some(960);
        let (out, m) = Client::Codex.merge(existing, "metainfer-p", &e, false).unwrap();
        assert_eq!(m, Merged::Added);
        assert!(out.starts_with(existing.trim_end()), "{out}");
        let v: toml::Table = toml::from_str(&out).unwrap();
        let s = &v["mcp_servers"]["metainfer-p"];
        assert_eq!(s["command"].as_str(), Some("/usr/bin/metainfer"));
        assert_eq!(s["tool_timeout_sec"].as_integer(), Some(960));
        assert_eq!(s["env"]["RUSTUP_HOME"].as_str(), Some("/r"));
        assert_eq!(s["env_vars"].as_array().unwrap().len(), 2);
        assert_eq!(v["model"].as_str(), Some("o3"));
        assert_eq!(Client::Codex.merge(&out, "metainfer-p", &e, false).unwrap().1, Merged::Unchanged);
        let mut other = e.clone();
        other.args.push("--read-only".into());
        assert!(Client::Codex.merge(&out, "metainfer-p", &other, false).unwrap_err().message.contains("--replace"));
        let (out2, m) = Client::Codex.merge(&out, "metainfer-p", &other, true).unwrap();
        assert_eq!(m, Merged::Replaced);
        assert!(out2.contains("--read-only") && out2.contains("# mine"), "{out2}");
    }

    #[test]
    fn malformed_existing_file_is_refused() {
        assert!(Client::Claude.merge("{not json", "metainfer", &entry(), false).is_err());
        assert!(Client::Claude.merge("[1, 2]", "metainfer", &entry(), false).is_err());
        assert!(Client::Claude.merge(r#"{"mcpServers": 3}"#, "metainfer", &entry(), false).is_err());
        assert!(Client::Codex.merge("mcp_servers = 3", "metainfer", &entry(), false).is_err());
    }

    #[test]
    fn entries_carry_every_option_with_workspace_relative_paths_where_the_client_expands_them() {
        let project = Path::new("/home/u/proj");
        let opts = ServerOptions {
            model_dirs: vec!["/home/u/proj/models".into(), "/data/m".into()],
            time_limit_s: 1200,
            ledger: Some("/l.sqlite".into()),
            ..ServerOptions::default()
        };
        let e = Client::Vscode.entry(project, Path::new("/bin/metainfer"), &opts);
        assert_eq!(e.command, "/bin/metainfer");
        assert_eq!(
            e.args,
            [
                "serve",
                "--workspace",
                "${workspaceFolder}",
                "--model-dir",
                "${workspaceFolder}/models",
                "--model-dir",
                "/data/m",
                "--ledger",
                "/l.sqlite",
                "--time-limit",
                "1200"
            ]
        );
        let c = Client::Codex.entry(project, Path::new("/opt/x/metainfer"), &opts);
        assert_eq!(c.command, "/opt/x/metainfer");
        assert_eq!(c.args[1..3], ["--workspace".to_string(), "/home/u/proj".to_string()]);
        assert_eq!(c.tool_timeout_s, Some(1200 + CODEX_TIMEOUT_MARGIN_S));
        assert!(c.env.contains_key("RUSTUP_HOME") && c.env_vars.contains(&"PATH".to_string()));
        assert_eq!(Client::Codex.default_name(project), "metainfer-proj");
        assert_eq!(Client::Claude.default_name(project), "metainfer");
    }
}
