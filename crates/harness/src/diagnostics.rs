//! Parsing cargo's JSON messages (`--message-format=json`) into compiler diagnostics. Tolerates
//! noise: lines that are not JSON, unknown message kinds and unknown fields are skipped.

use std::path::PathBuf;

use cargo_metadata::Message;
use cargo_metadata::diagnostic::DiagnosticLevel;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// One compiler error or warning, located at its primary span.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Diagnostic {
    /// `error` or `warning`.
    pub level: String,
    /// File as cargo reports it (relative to the crate root for the engine's own files).
    pub file: String,
    /// 1-based line of the primary span (0 when the message has no span).
    pub line: u32,
    /// 1-based column.
    pub column: u32,
    /// Error code such as `E0308`, or "".
    pub code: String,
    /// The compiler's message.
    pub message: String,
    /// The label on the primary span, or "".
    pub label: String,
    /// Contract whose fixed signature is involved, when the server can tell.
    pub contract: String,
}

/// Parse cargo's stdout: diagnostics of level error or warning (in order, de-duplicated) and the
/// executable of the last binary artifact, if any.
pub fn parse_messages(stdout: &str) -> (Vec<Diagnostic>, Option<PathBuf>) {
    let mut diags: Vec<Diagnostic> = Vec::new();
    let mut exe = None;
    for msg in Message::parse_stream(stdout.as_bytes()).flatten() {
        match msg {
            Message::CompilerMessage(m) => {
                let d = &m.message;
                let level = match d.level {
                    DiagnosticLevel::Error | DiagnosticLevel::Ice => "error",
                    DiagnosticLevel::Warning => "warning",
                    _ => continue,
                };
                // Summary lines such as "aborting due to 2 previous errors" carry no span.
                if d.spans.is_empty() && d.message.starts_with("aborting due to") {
                    continue;
                }
                let span = d.spans.iter().find(|s| s.is_primary).or(d.spans.first());
                let diag = Diagnostic {
                    level: level.into(),
                    file: span.map(|s| s.file_name.clone()).unwrap_or_default(),
                    line: span.map(|s| s.line_start as u32).unwrap_or(0),
                    column: span.map(|s| s.column_start as u32).unwrap_or(0),
                    code: d.code.as_ref().map(|c| c.code.clone()).unwrap_or_default(),
                    message: d.message.clone(),
                    label: span.and_then(|s| s.label.clone()).unwrap_or_default(),
                    contract: String::new(),
                };
                if !diags.contains(&diag) {
                    diags.push(diag);
                }
            }
            Message::CompilerArtifact(a) => {
                if let Some(e) = a.executable {
                    exe = Some(e.into_std_path_buf());
                }
            }
            _ => {}
        }
    }
    (diags, exe)
}

#[cfg(test)]
mod tests {
    use super::*;

    // A real cargo error message (E0308), abbreviated, surrounded by noise lines.
    const STREAM: &str = r#"warning: not json
{"reason":"compiler-message","package_id":"path+file:///e#engine@0.1.0","manifest_path":"/e/Cargo.toml","target":{"kind":["lib"],"crate_types":["lib"],"name":"engine","src_path":"/e/src/lib.rs","edition":"2024","doc":true,"doctest":true,"test":true},"message":{"rendered":"error[E0308]: mismatched types","$message_type":"diagnostic","children":[],"code":{"code":"E0308","explanation":null},"level":"error","message":"mismatched types","spans":[{"byte_end":10,"byte_start":5,"column_end":12,"column_start":7,"expansion":null,"file_name":"src/kernels.rs","is_primary":true,"label":"expected `usize`, found `f32`","line_end":42,"line_start":42,"suggested_replacement":null,"suggestion_applicability":null,"text":[]}]}}
{"reason":"compiler-message","package_id":"path+file:///e#engine@0.1.0","manifest_path":"/e/Cargo.toml","target":{"kind":["lib"],"crate_types":["lib"],"name":"engine","src_path":"/e/src/lib.rs","edition":"2024","doc":true,"doctest":true,"test":true},"message":{"rendered":"error: aborting due to 1 previous error","$message_type":"diagnostic","children":[],"code":null,"level":"error","message":"aborting due to 1 previous error","spans":[]}}
{"reason":"some-future-kind","x":1}
{"reason":"build-finished","success":false}
"#;

    #[test]
    fn parses_error_location_and_code_and_skips_noise() {
        let (d, exe) = parse_messages(STREAM);
        assert_eq!(exe, None);
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!(d[0].file, "src/kernels.rs");
        assert_eq!((d[0].line, d[0].column), (42, 7));
        assert_eq!(d[0].code, "E0308");
        assert_eq!(d[0].label, "expected `usize`, found `f32`");
        assert_eq!(d[0].level, "error");
    }
}
