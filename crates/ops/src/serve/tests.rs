//! Unit tests of serve_engine: percentiles, the keep-alive check against a Nagle-bound server,
//! the OpenAI error shape.

use std::io::{BufRead, BufReader};
use std::sync::atomic::AtomicUsize;

use super::load::percentile;
use super::*;

#[test]
fn nearest_rank_percentiles_by_hand() {
    // Nearest rank (NIST/Hyndman-Fan definition 1): p99 of 1..=100 is 99, p50 is 50.
    let mut xs: Vec<f64> = (1..=100).rev().map(f64::from).collect();
    assert_eq!(percentile(&mut xs, 50.0), 50.0);
    assert_eq!(percentile(&mut xs, 99.0), 99.0);
    assert_eq!(percentile(&mut [7.0], 99.0), 7.0);
    assert_eq!(percentile(&mut [], 50.0), 0.0);
}

/// A minimal HTTP/1.1 server on a loopback port that answers every request of a connection with a
/// streamed completion, writing the header block and each event as its own small write (as an
/// HTTP stack does); `nodelay` sets TCP_NODELAY on each accepted connection. Returns the port and
/// the count of accepted connections.
fn sse_server(nodelay: bool) -> (u16, std::sync::Arc<AtomicUsize>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = std::sync::Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut out) = conn else { continue };
            count.fetch_add(1, Ordering::SeqCst);
            out.set_nodelay(nodelay).unwrap();
            std::thread::spawn(move || {
                let mut input = BufReader::new(out.try_clone().unwrap());
                loop {
                    let mut length = 0usize;
                    let mut line = String::new();
                    loop {
                        line.clear();
                        if input.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        if line == "\r\n" {
                            break;
                        }
                        if let Some((k, v)) = line.split_once(':')
                            && k.eq_ignore_ascii_case("content-length")
                        {
                            length = v.trim().parse().unwrap();
                        }
                    }
                    let mut body = vec![0u8; length];
                    input.read_exact(&mut body).unwrap();
                    let head =
                        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
                    let events = [
                        r#"data: {"choices":[{"index":0,"text":" once","finish_reason":null}]}"#,
                        r#"data: {"choices":[{"index":0,"text":"","finish_reason":"length"}],"usage":{"completion_tokens":1}}"#,
                        "data: [DONE]",
                    ];
                    let mut writes = vec![head.to_string()];
                    writes.extend(events.iter().map(|e| format!("{:x}\r\n{e}\n\n\r\n", e.len() + 2)));
                    writes.push("0\r\n\r\n".to_string());
                    for w in writes {
                        if out.write_all(w.as_bytes()).is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (port, accepted)
}

#[test]
fn keep_alive_fails_a_nagle_bound_server_and_passes_one_with_nodelay() {
    let body = json!({"prompt": "Once", "max_tokens": 1, "temperature": 0, "stream": true});
    let deadline = Instant::now() + Duration::from_secs(60);
    for nodelay in [true, false] {
        let (port, accepted) = sse_server(nodelay);
        let c = keep_alive(&Client::new(port, deadline), &Client::fresh(port, deadline), &body);
        // One connection per fresh request, one kept by the pooled client for all of its requests.
        assert_eq!(accepted.load(Ordering::SeqCst), KEEP_ALIVE_ROUNDS + 1, "nodelay {nodelay}: {}", c.detail);
        assert_eq!(c.passed, nodelay, "nodelay {nodelay}: {}", c.detail);
        assert_eq!(c.detail.contains("set TCP_NODELAY"), !nodelay, "{}", c.detail);
    }
}

#[test]
fn openai_error_shape() {
    assert!(openai_error(r#"{"error": {"message": "x", "type": "invalid_request_error", "param": null}}"#));
    assert!(!openai_error(r#"{"detail": "x"}"#));
    assert!(!openai_error("Bad Request"));
}
