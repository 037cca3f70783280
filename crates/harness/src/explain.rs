//! Texts that turn what a child process or a check left behind into what the user can act on:
//! paths in the server's engine snapshot mapped back to the user's engine directory, an
//! unimplemented `todo!()` named by its function (`todo!() in Tokenizer::load`), a kernel with no
//! output reported as panicked or unwritten instead of a sentinel number, a generation run that
//! crashed before its first prompt said so, and a path outside the workspace answered with the
//! option that admits it.

use std::path::{Path, PathBuf};

use super::Engine;

/// `text` (a child's stderr or a report built from it) with every path into the engine's
/// snapshot replaced by the same path in the user's engine directory, and each panic at a
/// `todo!()` (Rust's "not yet implemented") followed by the function it is in, e.g.
/// `todo!() in Tokenizer::load (myengine/src/tokenizer.rs:9): implement it`.
pub fn explain(text: &str, engine: &Engine) -> String {
    explain_in(text, &engine.build_dir, &engine.dir)
}

/// [`explain`] over explicit directories: `snapshot` is what was built, `dir` the user's engine.
pub fn explain_in(text: &str, snapshot: &Path, dir: &Path) -> String {
    // Whole path components only: the snapshot directory followed by a separator.
    let mut out = text.replace(&format!("{}/", snapshot.display()), &format!("{}/", dir.display()));
    let mut notes = Vec::new();
    for line in out.lines() {
        let Some(loc) = panic_location(line) else { continue };
        if !out.contains("not yet implemented") {
            continue;
        }
        let (file, lineno) = loc;
        let path = if Path::new(&file).is_absolute() { PathBuf::from(&file) } else { dir.join(&file) };
        if !path.starts_with(dir) {
            continue;
        }
        if let Some(func) = std::fs::read_to_string(&path).ok().and_then(|src| enclosing_fn(&src, lineno)) {
            let note = format!("todo!() in {func} ({file}:{lineno}): implement it");
            if !notes.contains(&note) {
                notes.push(note);
            }
        }
    }
    if !notes.is_empty() {
        out = format!("{}\n{out}", notes.join("\n"));
    }
    out
}

/// `(file, line)` of a Rust panic message line: `thread 'main' panicked at src/x.rs:9:5:`.
fn panic_location(line: &str) -> Option<(String, usize)> {
    let rest = line.split("panicked at ").nth(1)?;
    let rest = rest.trim_end_matches(':').trim();
    let mut parts = rest.rsplitn(3, ':');
    let _col = parts.next()?;
    let line: usize = parts.next()?.parse().ok()?;
    let file = parts.next()?.trim_start_matches('\'').to_string();
    Some((file, line))
}

/// The function around 1-based `line` of Rust source `src`, as `Type::name` inside an `impl`
/// block, else `name`.
pub fn enclosing_fn(src: &str, line: usize) -> Option<String> {
    let lines: Vec<&str> = src.lines().collect();
    let upto = line.min(lines.len());
    let mut func = None;
    let mut at = 0;
    for i in (0..upto).rev() {
        if let Some(name) = item_name(lines[i], "fn ") {
            func = Some(name);
            at = i;
            break;
        }
    }
    let func = func?;
    // The nearest `impl` above at the outer indentation names the type.
    let fn_indent = lines[at].len() - lines[at].trim_start().len();
    if fn_indent > 0 {
        for l in lines[..at].iter().rev() {
            let indent = l.len() - l.trim_start().len();
            if indent < fn_indent
                && let Some(t) = impl_type(l.trim_start())
            {
                return Some(format!("{t}::{func}"));
            }
            if indent < fn_indent && !l.trim().is_empty() && !l.trim_start().starts_with("//") {
                break;
            }
        }
    }
    Some(func)
}

/// The identifier after `keyword` in a declaration line (`pub fn load(` -> `load`).
fn item_name(line: &str, keyword: &str) -> Option<String> {
    let t = line.trim_start();
    if t.starts_with("//") {
        return None;
    }
    let pos = t.find(keyword)?;
    let before = &t[..pos];
    if !before.split_whitespace().all(|w| matches!(w, "pub" | "pub(crate)" | "const" | "unsafe" | "async" | "extern")) {
        return None;
    }
    let name: String = t[pos + keyword.len()..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
    (!name.is_empty()).then_some(name)
}

/// The implementing type of an `impl` line: `impl Tokenizer {` -> `Tokenizer`,
/// `impl Trait for Model {` -> `Model`.
fn impl_type(line: &str) -> Option<String> {
    let rest = line.strip_prefix("impl")?;
    if !rest.starts_with([' ', '<']) {
        return None;
    }
    let mut rest = rest.split('{').next()?.trim();
    if rest.starts_with('<') {
        // Skip the impl's generic parameters, `<T: X<Y>>`.
        let mut depth = 0;
        let end = rest.char_indices().find(|&(_, c)| {
            depth += match c {
                '<' => 1,
                '>' => -1,
                _ => 0,
            };
            depth == 0
        })?;
        rest = rest[end.0 + 1..].trim();
    }
    let ty = rest.rsplit(" for ").next()?.trim();
    let name: String = ty.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
    (!name.is_empty()).then_some(name)
}

/// An error figure for a report: the number, or what stands behind the sentinel `f64::MAX` (an
/// output that was never written, or a kernel that panicked, per its `error` text).
pub fn figure(x: f64, error: &str) -> String {
    if x >= f64::MAX {
        if error.contains("panicked") { "panicked".into() } else { "no output".into() }
    } else {
        format!("{x:.2e}")
    }
}

/// "3/4 prompts passed", or "crashed before the first prompt" when the engine produced none.
pub fn prompts_passed(ok: usize, total: usize) -> String {
    if total == 0 { "crashed before the first prompt".into() } else { format!("{ok}/{total} prompts passed") }
}

/// The refusal of a path outside the allowed roots, naming the two ways to admit it: the server
/// option, and the register command that writes it.
pub fn outside_workspace(path: &Path, roots: &[PathBuf]) -> String {
    let dir = if path.is_dir() { path } else { path.parent().unwrap_or(path) };
    format!(
        "{} is outside the workspace; allowed roots: {}. To allow it, start the server with `--model-dir {}` \
         (e.g. `metainfer register --client claude --model-dir {} --replace`), or move it into the workspace",
        path.display(),
        roots.iter().map(|r| r.display().to_string()).collect::<Vec<_>>().join(", "),
        dir.display(),
        dir.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKENIZER: &str = "//! Tokenizer.\n\npub struct Tokenizer {\n    vocab: Vec<String>,\n}\n\nimpl Tokenizer {\n    /// Load.\n    pub fn load(dir: &Path) -> Result<Tokenizer> {\n        todo!()\n    }\n}\n";

    #[test]
    fn snapshot_paths_map_back_to_the_engine_and_todo_names_its_function() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("myengine");
        std::fs::create_dir_all(dir.join("src")).unwrap();
        std::fs::write(dir.join("src/tokenizer.rs"), TOKENIZER).unwrap();
        let snap = Path::new("/home/u/.cache/metainfer/snapshots/0123456789abcdef");
        let stderr = format!(
            "thread 'main' panicked at {}/src/tokenizer.rs:10:9:\nnot yet implemented\nnote: run with `RUST_BACKTRACE=1`",
            snap.display()
        );
        let text = explain_in(&stderr, snap, &dir);
        assert!(!text.contains("snapshots"), "{text}");
        assert!(text.contains(&format!("panicked at {}/src/tokenizer.rs:10:9", dir.display())), "{text}");
        assert!(text.starts_with("todo!() in Tokenizer::load ("), "{text}");
    }

    #[test]
    fn a_panic_that_is_not_a_todo_gets_no_note() {
        let dir = Path::new("/e");
        let text = explain_in("thread 'main' panicked at /s/src/k.rs:3:1:\nindex out of bounds", Path::new("/s"), dir);
        assert_eq!(text, "thread 'main' panicked at /e/src/k.rs:3:1:\nindex out of bounds");
    }

    #[test]
    fn enclosing_functions_are_named_with_their_type() {
        assert_eq!(enclosing_fn(TOKENIZER, 10).as_deref(), Some("Tokenizer::load"));
        let free = "pub fn rms_norm(x: &[f32]) {\n    todo!()\n}\n";
        assert_eq!(enclosing_fn(free, 2).as_deref(), Some("rms_norm"));
        let tr = "impl Default for Model {\n    fn default() -> Self {\n        todo!()\n    }\n}\n";
        assert_eq!(enclosing_fn(tr, 3).as_deref(), Some("Model::default"));
    }

    #[test]
    fn sentinels_and_empty_runs_read_as_words() {
        assert_eq!(figure(f64::MAX, "panicked on case 0: boom"), "panicked");
        assert_eq!(figure(f64::MAX, ""), "no output");
        assert_eq!(figure(1.5e-7, ""), "1.50e-7");
        assert_eq!(prompts_passed(0, 0), "crashed before the first prompt");
        assert_eq!(prompts_passed(3, 4), "3/4 prompts passed");
    }

    #[test]
    fn outside_workspace_names_the_option_and_the_register_command() {
        let m = outside_workspace(Path::new("/data/models/llama"), &[PathBuf::from("/p")]);
        assert!(m.contains("--model-dir /data/models") && m.contains("metainfer register"), "{m}");
    }
}
