//! Agent guides shipped with the server: skills (`skills/*.md` with `name`/`description` front
//! matter, installable as Claude Code skills) and MCP prompt templates (`prompts/*.toml`).
//!
//! Knows nothing of MCP; the server lists and renders these through its own handlers.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::ckb::embedded;
use crate::error::{Context, Error, Result};

/// A skill: agent instructions with front matter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Skill {
    /// Lowercase letters, digits and hyphens; equals the file stem and the install folder name.
    pub name: String,
    /// What it does and when to use it (at most 1024 characters).
    pub description: String,
    /// The whole file, front matter included (what SKILL.md holds).
    pub text: String,
}

/// Parse a skill file. `stem` is the file name without `.md`.
///
/// # Errors
/// Missing or malformed front matter, a name that differs from the stem or is not lowercase-hyphen,
/// a description that is empty or longer than 1024 characters.
pub fn parse_skill(stem: &str, text: &str) -> Result<Skill> {
    let bad = |why: String| Error::input(format!("skills/{stem}.md: {why}"));
    let rest = text.strip_prefix("---\n").ok_or_else(|| bad("must start with `---` front matter".into()))?;
    let end = rest.find("\n---").ok_or_else(|| bad("front matter is not closed by `---`".into()))?;
    let mut fields = BTreeMap::new();
    for line in rest[..end].lines().filter(|l| !l.trim().is_empty()) {
        let (k, v) =
            line.split_once(':').ok_or_else(|| bad(format!("front matter line {line:?} is not `key: value`")))?;
        fields.insert(k.trim().to_string(), v.trim().trim_matches('"').to_string());
    }
    let name = fields.remove("name").ok_or_else(|| bad("front matter needs `name`".into()))?;
    let description = fields.remove("description").ok_or_else(|| bad("front matter needs `description`".into()))?;
    if name != stem {
        return Err(bad(format!("name `{name}` must equal the file name `{stem}`")));
    }
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-') {
        return Err(bad(format!("name `{name}` must use lowercase letters, digits and hyphens only")));
    }
    if description.is_empty() || description.chars().count() > 1024 {
        return Err(bad("description must say what the skill does and when to use it, in 1..=1024 characters".into()));
    }
    if let Some(k) = fields.keys().next() {
        return Err(bad(format!("unknown front matter key `{k}`; only name and description")));
    }
    Ok(Skill { name, description, text: text.to_string() })
}

/// The shipped skills, by name.
///
/// # Errors
/// When a shipped skill is malformed (a broken build; the tests check it).
pub fn skills() -> Result<Vec<Skill>> {
    embedded::SKILLS.iter().map(|(path, text)| parse_skill(path.trim_end_matches(".md"), text)).collect()
}

/// The project folder each client reads skills from (`<folder>/<name>/SKILL.md`, the Agent Skills
/// layout): Claude Code `.claude/skills`, Codex `.agents/skills`, Gemini CLI `.gemini/skills`,
/// Cursor `.cursor/skills` (each client's skills documentation, checked 2026-12-01). VS Code has
/// no skills folder of its own; it reads prompts over MCP.
///
/// # Errors
/// [`crate::error::ErrorKind::Usage`] for a client without a skills folder.
pub fn skills_dir(client: crate::clients::Client) -> Result<&'static str> {
    use crate::clients::Client;
    match client {
        Client::Claude => Ok(".claude/skills"),
        Client::Codex => Ok(".agents/skills"),
        Client::Gemini => Ok(".gemini/skills"),
        Client::Cursor => Ok(".cursor/skills"),
        Client::Vscode => Err(Error::usage(
            "VS Code has no skills folder; use the MCP prompts (`/mcp.metainfer.generate_engine`) or pass --dir DIR",
        )),
    }
}

/// What happened to one skill file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Installed {
    /// Written (new).
    Written,
    /// Already identical to the shipped skill.
    Unchanged,
    /// Replaced a different (edited or older) copy, with `force`.
    Replaced,
}

/// Write every skill as `<dir>/<name>/SKILL.md`; other skills in `dir` are left alone. A skill
/// file that exists with other content (edited by the user, or from another version) is replaced
/// only with `force`; without it nothing at all is written and the error lists those files.
///
/// # Errors
/// Edited skills without `force`, or `dir` not writable.
pub fn install_skills(dir: &Path, force: bool) -> Result<Vec<(PathBuf, Installed)>> {
    let skills = skills()?;
    let mut plan = Vec::new();
    let mut edited = Vec::new();
    for s in &skills {
        let path = dir.join(&s.name).join("SKILL.md");
        let state = match std::fs::read(&path) {
            Ok(b) if b == s.text.as_bytes() => Installed::Unchanged,
            Ok(_) => {
                edited.push(path.display().to_string());
                Installed::Replaced
            }
            Err(_) => Installed::Written,
        };
        plan.push((s, path, state));
    }
    if !edited.is_empty() && !force {
        return Err(Error::usage(format!(
            "these skill files differ from the shipped ones (edited, or from another metainfer version): {}; nothing was written. Pass --force to overwrite them",
            edited.join(", ")
        )));
    }
    let mut out = Vec::new();
    for (s, path, state) in plan {
        if state != Installed::Unchanged {
            let folder = path.parent().expect("a skill file has a folder");
            std::fs::create_dir_all(folder).usage_ctx(|| format!("cannot create {}", folder.display()))?;
            crate::util::write_atomic(&path, s.text.as_bytes())?;
        }
        out.push((path, state));
    }
    Ok(out)
}

/// One argument of a prompt template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptArg {
    /// Name, used as `{{name}}` in the template.
    pub name: String,
    /// What to pass.
    pub description: String,
    /// Whether the prompt cannot be rendered without it.
    #[serde(default)]
    pub required: bool,
}

/// An MCP prompt template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptTemplate {
    /// snake_case name; equals the file stem.
    pub name: String,
    /// One line.
    pub description: String,
    /// The user message, with `{{arg}}` placeholders.
    pub template: String,
    /// Arguments.
    #[serde(default)]
    pub arguments: Vec<PromptArg>,
}

impl PromptTemplate {
    /// Fill the template. Missing optional arguments become empty strings.
    ///
    /// # Errors
    /// A missing required argument or an unknown one.
    pub fn render(&self, args: &BTreeMap<String, String>) -> Result<String> {
        for k in args.keys() {
            if !self.arguments.iter().any(|a| &a.name == k) {
                return Err(Error::usage(format!(
                    "prompt `{}` has no argument `{k}`; it takes: {}",
                    self.name,
                    self.arguments.iter().map(|a| a.name.as_str()).collect::<Vec<_>>().join(", ")
                )));
            }
        }
        let mut out = self.template.clone();
        for a in &self.arguments {
            let v = args.get(&a.name).map(String::as_str).unwrap_or("");
            if a.required && v.trim().is_empty() {
                return Err(Error::usage(format!(
                    "prompt `{}` needs argument `{}`: {}",
                    self.name, a.name, a.description
                )));
            }
            out = out.replace(&format!("{{{{{}}}}}", a.name), v);
        }
        Ok(out)
    }
}

/// The shipped prompt templates.
///
/// # Errors
/// When a shipped prompt is malformed (the tests check it), or a placeholder has no argument.
pub fn prompts() -> Result<Vec<PromptTemplate>> {
    embedded::PROMPTS
        .iter()
        .map(|(path, text)| {
            let stem = path.trim_end_matches(".toml");
            let p: PromptTemplate = toml::from_str(text).ctx(|| format!("prompts/{path}"))?;
            if p.name != stem {
                return Err(Error::input(format!("prompts/{path}: name `{}` must equal the file name", p.name)));
            }
            for a in &p.arguments {
                if !p.template.contains(&format!("{{{{{}}}}}", a.name)) {
                    return Err(Error::input(format!(
                        "prompts/{path}: argument `{}` is not used in the template",
                        a.name
                    )));
                }
            }
            Ok(p)
        })
        .collect()
}
