//! The HTTP side of serve_engine: a client under the gate's deadline, plain answers read to a
//! bound, and streamed completions read from the event stream line by line.

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The HTTP side: one agent, the base URL.
pub(super) struct Client {
    agent: ureq::Agent,
    base: String,
    /// The gate's deadline: every request's time limit is what is left of the call's budget.
    deadline: Instant,
}

/// Largest plain (non-streaming) answer read, bytes: a completion of max_context tokens as JSON
/// is far below it; an engine that sends more is answering wrongly, and is not read further.
pub const MAX_ANSWER_BYTES: u64 = 4 << 20;

/// Largest event stream read, bytes (one event per token, each well under a kilobyte).
pub const MAX_STREAM_BYTES: u64 = 16 << 20;

/// Bytes read after `data: [DONE]` to reach the end of a streamed body (a chunked terminator is 5).
const STREAM_TAIL_BYTES: u64 = 4096;

/// Longest line of an event stream read, bytes: an SSE `data:` line holds one chunk's JSON.
pub const MAX_EVENT_LINE: usize = 64 << 10;

/// Read one line of at most [`MAX_EVENT_LINE`] bytes (its newline included) into `buf`; Ok(false)
/// at the end of the stream.
///
/// # Errors
/// A line longer than the bound (named), or a transport error.
pub(super) fn read_event_line(
    reader: &mut impl std::io::BufRead,
    buf: &mut Vec<u8>,
) -> std::result::Result<bool, String> {
    use std::io::Read;
    buf.clear();
    let n = reader
        .by_ref()
        .take(MAX_EVENT_LINE as u64 + 1)
        .read_until(b'\n', buf)
        .map_err(|e| format!("reading the event stream: {e}"))?;
    if buf.len() > MAX_EVENT_LINE && !buf.ends_with(b"\n") {
        return Err(format!(
            "an event-stream line longer than {MAX_EVENT_LINE} bytes (component.openai_server: one `data:` line per chunk); not read further"
        ));
    }
    Ok(n > 0)
}

/// A plain response: status and body text.
pub(super) struct Answer {
    pub(super) status: u16,
    pub(super) body: String,
}

impl Client {
    /// A client that pools keep-alive connections (up to 64 idle), as the official openai package does.
    pub(super) fn new(port: u16, deadline: Instant) -> Client {
        let agent =
            ureq::Agent::config_builder().http_status_as_error(false).max_idle_connections_per_host(64).build().into();
        Client { agent, base: format!("http://127.0.0.1:{port}"), deadline }
    }

    /// A client that keeps no connection: every request opens a new one.
    pub(super) fn fresh(port: u16, deadline: Instant) -> Client {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_idle_connections(0)
            .max_idle_connections_per_host(0)
            .build()
            .into();
        Client { agent, base: format!("http://127.0.0.1:{port}"), deadline }
    }

    /// What is left of the call's budget: the time limit of the next request.
    fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
    }

    /// A POST of JSON to `path` under the remaining budget.
    pub(super) fn post_request(&self, path: &str) -> ureq::RequestBuilder<ureq::typestate::WithBody> {
        self.agent
            .post(format!("{}{path}", self.base))
            .config()
            .timeout_global(Some(self.remaining()))
            .build()
            .header("content-type", "application/json")
    }

    pub(super) fn get(&self, path: &str) -> std::result::Result<Answer, String> {
        let mut r = self
            .agent
            .get(format!("{}{path}", self.base))
            .config()
            .timeout_global(Some(self.remaining()))
            .build()
            .call()
            .map_err(|e| format!("GET {path}: {e}"))?;
        let status = r.status().as_u16();
        let body = r
            .body_mut()
            .with_config()
            .limit(MAX_ANSWER_BYTES)
            .read_to_string()
            .map_err(|e| format!("GET {path}: reading the body (at most {MAX_ANSWER_BYTES} bytes): {e}"))?;
        Ok(Answer { status, body })
    }

    pub(super) fn post(&self, path: &str, body: &str) -> std::result::Result<Answer, String> {
        let mut r = self.post_request(path).send(body).map_err(|e| format!("POST {path}: {e}"))?;
        let status = r.status().as_u16();
        let body = r
            .body_mut()
            .with_config()
            .limit(MAX_ANSWER_BYTES)
            .read_to_string()
            .map_err(|e| format!("POST {path}: reading the body (at most {MAX_ANSWER_BYTES} bytes): {e}"))?;
        Ok(Answer { status, body })
    }

    /// A streaming completion: the texts of its chunks with their arrival times, the finish reason,
    /// the usage's completion_tokens, whether `[DONE]` ended it.
    pub(super) fn stream(&self, body: &Value) -> std::result::Result<Streamed, String> {
        let start = Instant::now();
        let mut r = self
            .post_request("/v1/completions")
            .send(body.to_string())
            .map_err(|e| format!("POST /v1/completions (stream): {e}"))?;
        if r.status().as_u16() != 200 {
            let text = r.body_mut().with_config().limit(MAX_ANSWER_BYTES).read_to_string().unwrap_or_default();
            return Err(format!("streaming request answered {}: {}", r.status().as_u16(), harness::tail(&text, 300)));
        }
        let mut out = Streamed::default();
        let mut reader = BufReader::new(r.body_mut().with_config().limit(MAX_STREAM_BYTES).reader());
        let mut buf = Vec::new();
        while read_event_line(&mut reader, &mut buf)? {
            let line = String::from_utf8_lossy(&buf);
            let Some(data) = line.trim_end_matches(['\r', '\n']).strip_prefix("data:") else { continue };
            let data = data.trim();
            if data == "[DONE]" {
                out.done = true;
                // Read the body's end (the chunked terminator), so the connection goes back to the
                // pool and the next request reuses it; a server that sends more is not read further.
                let _ = std::io::copy(&mut std::io::Read::take(&mut reader, STREAM_TAIL_BYTES), &mut std::io::sink());
                break;
            }
            let v: Value = serde_json::from_str(data).map_err(|e| format!("an event is not JSON ({e}): {data}"))?;
            let choice = &v["choices"][0];
            if let Some(t) = choice["text"].as_str().filter(|t| !t.is_empty()) {
                out.pieces.push((start.elapsed(), t.to_string()));
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                out.finish = f.to_string();
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                out.completion_tokens = n as usize;
            }
        }
        Ok(out)
    }
}

#[derive(Debug, Default)]
pub(super) struct Streamed {
    pub(super) pieces: Vec<(Duration, String)>,
    pub(super) finish: String,
    pub(super) completion_tokens: usize,
    pub(super) done: bool,
}

impl Streamed {
    pub(super) fn text(&self) -> String {
        self.pieces.iter().map(|(_, t)| t.as_str()).collect()
    }
}
