//! The stdio framing in front of rmcp: one JSON-RPC message per line, as the MCP stdio transport
//! says. rmcp's line transport drops a line that is not JSON without a word; JSON-RPC 2.0
//! (section 5.1) answers it with a Parse error, code -32700, `id` null. This layer reads the
//! client's lines itself: a line that is valid JSON goes on to rmcp unchanged; a line that is not
//! (invalid UTF-8, a lone surrogate escape, not JSON at all, longer than [`MAX_LINE`]) is answered
//! here with that error, written between rmcp's own lines so no message is split.
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
}
