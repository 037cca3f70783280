//! Registration of the server in agent clients: each client's config file and format, merged
//! without touching the other servers in an existing file.
//!
//! Formats (as the clients document them): Claude Code `.mcp.json` and Cursor `.cursor/mcp.json` and
//! Gemini CLI `.gemini/settings.json` use `{"mcpServers": {NAME: {command, args}}}`; VS Code
//! `.vscode/mcp.json` uses `{"servers": {NAME: {type: "stdio", command, args}}}`; Codex uses
//! `[mcp_servers.NAME]` with `command` and `args` in `~/.codex/config.toml` (or `$CODEX_HOME`).

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::error::{Error, Result};

/// A supported client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Client {
    /// Claude Code (`.mcp.json`).
    Claude,
    /// Cursor (`.cursor/mcp.json`).
    Cursor,
    /// VS Code (`.vscode/mcp.json`).
    Vscode,
    /// Codex (`config.toml`, `[mcp_servers.metainfer]`).
    Codex,
    /// Gemini CLI (`.gemini/settings.json`).
    Gemini,
}

/// The server entry: the command and its arguments.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Executable.
    pub command: String,
    /// Arguments.
    pub args: Vec<String>,
}

impl Client {
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

    /// Merge the entry into the existing text of the config file (empty when absent); other
    /// servers and settings are kept.
    ///
    /// # Errors
    /// When the existing file is not valid JSON/TOML or has an unexpected shape.
    pub fn merge(self, existing: &str, name: &str, e: &Entry) -> Result<String> {
        if self == Client::Codex {
            let mut doc: toml_edit::DocumentMut = existing
                .parse()
                .map_err(|err| Error::input(format!("existing config.toml is not valid TOML: {err}")))?;
            let servers = doc.entry("mcp_servers").or_insert(toml_edit::table());
            let servers = servers
                .as_table_mut()
                .ok_or_else(|| Error::input("`mcp_servers` in config.toml is not a table; fix it by hand"))?;
            servers.set_implicit(true);
            let mut t = toml_edit::Table::new();
            t["command"] = toml_edit::value(e.command.clone());
            let mut args = toml_edit::Array::new();
            e.args.iter().for_each(|a| args.push(a.as_str()));
            t["args"] = toml_edit::value(args);
            servers.insert(name, toml_edit::Item::Table(t));
            return Ok(doc.to_string());
        }
        let mut v: Value = if existing.trim().is_empty() {
            json!({})
        } else {
            serde_json::from_str(existing)
                .map_err(|err| Error::input(format!("existing config is not valid JSON: {err}")))?
        };
        let obj =
            v.as_object_mut().ok_or_else(|| Error::input("existing config is not a JSON object; fix it by hand"))?;
        let key = if self == Client::Vscode { "servers" } else { "mcpServers" };
        let servers = obj.entry(key).or_insert_with(|| json!({}));
        let servers =
            servers.as_object_mut().ok_or_else(|| Error::input(format!("`{key}` is not an object; fix it by hand")))?;
        let mut entry = json!({"command": e.command, "args": e.args});
        if self == Client::Vscode {
            entry["type"] = json!("stdio");
        }
        servers.insert(name.to_string(), entry);
        Ok(serde_json::to_string_pretty(&v).expect("JSON serialises") + "\n")
    }
}

/// Merge the entry into the client's config file and write it atomically; returns the path.
///
/// # Errors
/// An unreadable or malformed existing file (left untouched), or an unwritable directory.
pub fn register(client: Client, project: &Path, name: &str, e: &Entry) -> Result<PathBuf> {
    let path = client.config_path(project);
    let existing = match std::fs::read_to_string(&path) {
        Ok(s) => s,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(err) => return Err(Error::input(format!("{}: {err}", path.display()))),
    };
    let text =
        client.merge(&existing, name, e).map_err(|err| Error::input(format!("{}: {}", path.display(), err.message)))?;
    let dir = path.parent().expect("config paths have a parent");
    std::fs::create_dir_all(dir).map_err(|err| Error::usage(format!("{}: {err}", dir.display())))?;
    crate::util::write_atomic(&path, text.as_bytes())?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> Entry {
        Entry { command: "/usr/bin/metainfer".into(), args: vec!["serve".into(), "--workspace".into(), "/p".into()] }
    }

    #[test]
    fn json_merge_keeps_other_servers_and_settings() {
        let existing = r#"{"theme": "dark", "mcpServers": {"other": {"command": "x"}}}"#;
        let out: Value = serde_json::from_str(&Client::Cursor.merge(existing, "metainfer", &entry()).unwrap()).unwrap();
        assert_eq!(out["theme"], "dark");
        assert_eq!(out["mcpServers"]["other"]["command"], "x");
        assert_eq!(out["mcpServers"]["metainfer"]["args"][0], "serve");
        let vs: Value = serde_json::from_str(&Client::Vscode.merge("", "metainfer", &entry()).unwrap()).unwrap();
        assert_eq!(vs["servers"]["metainfer"]["type"], "stdio");
    }

    #[test]
    fn toml_merge_keeps_comments_and_other_servers() {
        let existing = "# mine\nmodel = \"o3\"\n\n[mcp_servers.other]\ncommand = \"x\"\n";
        let out = Client::Codex.merge(existing, "metainfer", &entry()).unwrap();
        assert!(out.contains("# mine") && out.contains("[mcp_servers.other]"), "{out}");
        let v: toml::Table = toml::from_str(&out).unwrap();
        assert_eq!(v["mcp_servers"]["metainfer"]["command"].as_str(), Some("/usr/bin/metainfer"));
        assert_eq!(v["model"].as_str(), Some("o3"));
    }

    #[test]
    fn malformed_existing_file_is_refused() {
        assert!(Client::Claude.merge("{not json", "metainfer", &entry()).is_err());
        assert!(Client::Claude.merge("[1, 2]", "metainfer", &entry()).is_err());
        assert!(Client::Codex.merge("mcp_servers = 3", "metainfer", &entry()).is_err());
    }
}
