//! The stdio framing in front of rmcp: one JSON-RPC message per line, as the MCP stdio transport
//! says. rmcp's line transport drops a line that is not JSON without a word; JSON-RPC 2.0
//! (section 5.1) answers it with a Parse error, code -32700, `id` null. This layer reads the
//! client's lines itself: a line that is valid JSON goes on to rmcp unchanged; a line that is not
//! (invalid UTF-8, a lone surrogate escape, not JSON at all, longer than [`MAX_LINE`]) is answered
//! here with that error, written between rmcp's own lines so no message is split.
//!
//! A request whose `params` rmcp cannot read as its method's (`tools/call` with `arguments` that
//! are not an object, a `name` that is not a string, no `params`) got rmcp's "-32601 tools/call",
//! which names nothing to fix. This layer answers such requests itself with JSON-RPC's Invalid
//! params, -32602, and the request's `id`, naming the field and the shape it takes
//! ([`invalid_params`]).
//!
//! A peer that echoed every error back as more invalid data could make an endless exchange
//! (rmcp's reason to stay silent, modelcontextprotocol/rust-sdk#938); this layer answers at most
//! [`MAX_PARSE_ERRORS`] such lines per session and then logs them only.

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;

/// Longest line read, bytes (rmcp's own default line cap, 16 MiB): a longer one is discarded up to
/// its newline and answered with a parse error.
pub const MAX_LINE: usize = 16 << 20;

/// Parse errors answered per session before the rest are only logged.
pub const MAX_PARSE_ERRORS: usize = 1000;

/// JSON-RPC's Parse error response to a line that is not a JSON value, naming why.
pub fn parse_error(why: &str) -> String {
    serde_json::json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": {"code": -32700, "message": format!("Parse error: {why}")}
    })
    .to_string()
}

/// Why `line` (without its newline) is not one JSON value, None when it is (or is blank).
pub fn check_line(line: &[u8]) -> Option<String> {
    let line = line.strip_prefix(b"\xef\xbb\xbf").unwrap_or(line);
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.iter().all(u8::is_ascii_whitespace) {
        return None;
    }
    if let Err(e) = std::str::from_utf8(line) {
        return Some(format!("the line is not valid UTF-8 ({e})"));
    }
    match serde_json::from_slice::<serde_json::Value>(line) {
        Ok(_) => None,
        Err(e) => Some(format!("the line is not JSON ({e})")),
    }
}

/// The JSON-RPC Invalid params response (-32602) to a request of `line` (one JSON value) whose
/// `params` do not have the shape its MCP method takes (MCP 2025-06-18, schema.ts:
/// `CallToolRequest`, `GetPromptRequest`, `ReadResourceRequest`; every request's `params` an
/// object), naming what to fix; None for anything else (notifications, responses, well-formed
/// requests, methods not checked here), which go on to rmcp.
pub fn invalid_params(line: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(line.strip_prefix(b"\xef\xbb\xbf").unwrap_or(line)).ok()?;
    let (method, id) = (v.get("method")?.as_str()?, v.get("id")?);
    if !(id.is_string() || id.is_number()) {
        return None;
    }
    let kind = |x: &serde_json::Value| match x {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    };
    let shape = match method {
        "tools/call" => r#"{"name": "<tool>", "arguments": {...}}"#,
        "prompts/get" => r#"{"name": "<prompt>", "arguments": {"<name>": "<value>"}}"#,
        "resources/read" => r#"{"uri": "<uri>"}"#,
        _ => "an object",
    };
    let why = match v.get("params") {
        None | Some(serde_json::Value::Null) if shape != "an object" => {
            format!("{method} takes params {shape}; none were given")
        }
        None | Some(serde_json::Value::Null) => return None,
        Some(p) if !p.is_object() && shape == "an object" => format!("params must be an object, not {}", kind(p)),
        Some(p) if !p.is_object() => format!("params must be an object ({shape}), not {}", kind(p)),
        Some(p) => {
            let key = if method == "resources/read" { "uri" } else { "name" };
            match (method, p.get(key), p.get("arguments")) {
                ("tools/call" | "prompts/get" | "resources/read", k, _) if !k.is_some_and(|k| k.is_string()) => {
                    format!(
                        "params.{key} must be a string ({method} takes params {shape}), not {}",
                        k.map_or("missing", kind)
                    )
                }
                ("tools/call" | "prompts/get", _, Some(a)) if !a.is_object() && !a.is_null() => format!(
                    "params.arguments must be an object of the {} arguments by name ({shape}), not {}",
                    if method == "tools/call" { "tool's" } else { "prompt's" },
                    kind(a)
                ),
                _ => return None,
            }
        }
    };
    Some(
        serde_json::json!({
            "jsonrpc": "2.0",
            "id": id,
            "error": {"code": -32602, "message": format!("Invalid params: {why}")}
        })
        .to_string(),
    )
}

/// Run the framing: read lines from `input`, pass the JSON ones to `to_rmcp`, copy rmcp's output
/// from `from_rmcp` to `output` line by line, and write a parse error for every other line. Ends
/// when `input` ends (closing `to_rmcp`, so rmcp sees the end too) and rmcp's output ends.
pub async fn run<I, O, R, W>(input: I, mut output: O, from_rmcp: R, mut to_rmcp: W)
where
    I: AsyncRead + Unpin + Send + 'static,
    O: AsyncWrite + Unpin + Send + 'static,
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (errors, mut errors_rx) = mpsc::unbounded_channel::<String>();
    let reader = tokio::spawn(async move {
        let mut input = BufReader::new(input);
        let mut answered = 0usize;
        let mut buf = Vec::new();
        loop {
            buf.clear();
            let mut too_long = false;
            // A bounded line: read up to the newline, keeping at most MAX_LINE bytes.
            loop {
                let available = match input.fill_buf().await {
                    Ok(b) => b,
                    Err(_) => return,
                };
                if available.is_empty() {
                    if buf.is_empty() && !too_long {
                        return;
                    }
                    break;
                }
                let (take, done) = match available.iter().position(|&b| b == b'\n') {
                    Some(i) => (i + 1, true),
                    None => (available.len(), false),
                };
                if !too_long {
                    if buf.len() + take > MAX_LINE + 1 {
                        too_long = true;
                        buf.clear();
                    } else {
                        buf.extend_from_slice(&available[..take]);
                    }
                }
                input.consume(take);
                if done {
                    break;
                }
            }
            let line = buf.strip_suffix(b"\n").unwrap_or(&buf);
            let why =
                if too_long { Some(format!("the line is longer than {MAX_LINE} bytes")) } else { check_line(line) };
            // A request whose params its method cannot read is answered here too (see the module's
            // documentation), within the same cap as the parse errors; past the cap it goes on to
            // rmcp, whose own error answers it.
            let invalid = if why.is_none() && answered < MAX_PARSE_ERRORS { invalid_params(line) } else { None };
            if let Some(reply) = invalid {
                tracing::warn!("client sent a request with invalid params: {reply}");
                answered += 1;
                let _ = errors.send(reply);
                continue;
            }
            match why {
                None => {
                    if to_rmcp.write_all(&buf).await.is_err() {
                        return;
                    }
                    if !buf.ends_with(b"\n") && to_rmcp.write_all(b"\n").await.is_err() {
                        return;
                    }
                    let _ = to_rmcp.flush().await;
                }
                Some(why) => {
                    tracing::warn!("client sent a line that is not JSON-RPC: {why}");
                    if answered < MAX_PARSE_ERRORS {
                        answered += 1;
                        let _ = errors.send(parse_error(&why));
                    }
                }
            }
        }
        // Dropping `to_rmcp` here ends rmcp's input.
    });
    let mut from_rmcp = BufReader::new(from_rmcp);
    // A line of rmcp's, kept across iterations: a read cut short by the other branch leaves its
    // bytes here and the next read goes on with the same line.
    let mut line = Vec::new();
    let (mut rmcp_open, mut errors_open) = (true, true);
    loop {
        tokio::select! {
            n = from_rmcp.read_until(b'\n', &mut line), if rmcp_open => {
                match n {
                    Ok(0) | Err(_) => rmcp_open = false,
                    Ok(_) => {
                        if output.write_all(&line).await.is_err() { break; }
                        let _ = output.flush().await;
                        line.clear();
                    }
                }
            }
            e = errors_rx.recv(), if errors_open => {
                match e {
                    Some(text) => {
                        if output.write_all(format!("{text}\n").as_bytes()).await.is_err() { break; }
                        let _ = output.flush().await;
                    }
                    None => errors_open = false,
                }
            }
            else => break,
        }
    }
    reader.abort();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_that_are_not_json_are_named() {
        // JSON-RPC 2.0, 5.1: -32700 with id null.
        let e: serde_json::Value = serde_json::from_str(&parse_error("x")).unwrap();
        assert_eq!(e["error"]["code"], -32700);
        assert!(e["id"].is_null() && e.as_object().unwrap().contains_key("id"));
        assert!(check_line(br#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#).is_none());
        assert!(check_line(b"  \r").is_none());
        assert!(check_line(b"\xef\xbb\xbf{}\r").is_none());
        assert!(check_line(b"\xff\xfe{}").unwrap().contains("not valid UTF-8"));
        assert!(check_line(br#"{"a":"\ud800"}"#).unwrap().contains("not JSON"));
        assert!(check_line(b"hello").unwrap().contains("not JSON"));
    }

    /// Requests whose params their method cannot read get -32602 with their id and what to fix;
    /// well-formed ones, notifications and unchecked methods go on to rmcp.
    #[test]
    fn requests_with_params_of_the_wrong_shape_are_named() {
        let answer = |line: &str| -> Option<serde_json::Value> {
            invalid_params(line.as_bytes()).map(|r| serde_json::from_str(&r).unwrap())
        };
        let r = answer(
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"lookup_contract","arguments":[1]}}"#,
        )
        .unwrap();
        assert_eq!((r["id"].as_i64(), r["error"]["code"].as_i64()), (Some(2), Some(-32602)));
        let m = r["error"]["message"].as_str().unwrap();
        assert!(m.contains("params.arguments must be an object") && m.ends_with("not an array"), "{m}");
        for (line, says) in [
            (r#"{"jsonrpc":"2.0","id":"a","method":"tools/call","params":{"name":5}}"#, "params.name must be a string"),
            (r#"{"jsonrpc":"2.0","id":3,"method":"tools/call"}"#, "tools/call takes params"),
            (r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":[1]}"#, "params must be an object"),
            (r#"{"jsonrpc":"2.0","id":3,"method":"ping","params":[1]}"#, "params must be an object, not an array"),
            (r#"{"jsonrpc":"2.0","id":3,"method":"resources/read","params":{}}"#, "params.uri must be a string"),
            (
                r#"{"jsonrpc":"2.0","id":3,"method":"prompts/get","params":{"name":"p","arguments":[1]}}"#,
                "params.arguments must be an object",
            ),
        ] {
            let r = answer(line).unwrap_or_else(|| panic!("{line} not answered"));
            assert!(r["error"]["message"].as_str().unwrap().contains(says), "{r}");
            assert_eq!(r["id"], serde_json::from_str::<serde_json::Value>(line).unwrap()["id"]);
        }
        for fine in [
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"lookup_contract","arguments":{"id":"kernel.rope"}}}"#,
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"lookup_contract"}}"#,
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/list"}"#,
            r#"{"jsonrpc":"2.0","method":"notifications/initialized","params":[1]}"#,
            r#"{"jsonrpc":"2.0","id":2,"result":{}}"#,
            r#"{"jsonrpc":"2.0","id":2,"method":"prompts/get","params":{"name":"p","arguments":{"a":"b"}}}"#,
            // The prompt handler takes arguments that are not strings as their JSON text.
            r#"{"jsonrpc":"2.0","id":2,"method":"prompts/get","params":{"name":"p","arguments":{"a":1}}}"#,
        ] {
            assert!(answer(fine).is_none(), "{fine}");
        }
    }
}
