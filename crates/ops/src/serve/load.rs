//! The load test of serve_engine: one concurrency level of streaming clients, each request's text
//! and when its first and last text arrived, and the machine's load average; the judge derives the
//! level's throughput and nearest-rank TTFT and ITL percentiles (`judge::level_figures`).

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use serde_json::json;

use super::LoadLevel;
use super::client::Client;
use super::wire::{Ask, LevelRun};

/// Nearest-rank percentile `p` (0..=100) of `xs`, 0 when empty.
pub(super) fn percentile(xs: &mut [f64], p: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * xs.len() as f64).ceil().max(1.0) as usize;
    xs[rank.min(xs.len()) - 1]
}

/// The 1-minute load average from /proc/loadavg; -1 when unreadable.
pub(super) fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|x| x.parse().ok()))
        .unwrap_or(-1.0)
}

/// One load-test request as its client saw it: its pool index, completion tokens, text, and when
/// its first and last non-empty text arrived (milliseconds from the request).
type Sent = (usize, usize, String, (f64, f64));

/// One concurrency level: `c` clients send the streaming greedy requests `picks` (indices into
/// `pool`) back to back, in order; the figures of the level and each completed request's text.
pub(super) fn load_level(client: &Client, pool: &[Ask], c: usize, picks: &[usize]) -> LevelRun {
    let n = picks.len();
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<std::result::Result<Sent, String>>> = Mutex::new(Vec::new());
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..c {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= n {
                        break;
                    }
                    let Some(e) = pool.get(picks[i]) else {
                        results.lock().unwrap_or_else(|p| p.into_inner()).push(Err(format!(
                            "the plan picks prompt {} of {}",
                            picks[i],
                            pool.len()
                        )));
                        continue;
                    };
                    let body =
                        json!({"prompt": e.prompt, "max_tokens": e.max_tokens, "temperature": 0, "stream": true});
                    let r = client.stream(&body).and_then(|st| {
                        if !st.done {
                            return Err("the event stream ended without [DONE]".to_string());
                        }
                        let times: Vec<f64> = st.pieces.iter().map(|(t, _)| t.as_secs_f64() * 1e3).collect();
                        let span = (times.first().copied().unwrap_or(0.0), times.last().copied().unwrap_or(0.0));
                        Ok((picks[i], st.completion_tokens, st.text(), span))
                    });
                    results.lock().unwrap_or_else(|p| p.into_inner()).push(r);
                }
            });
        }
    });
    let seconds = start.elapsed().as_secs_f64();
    let results = results.into_inner().unwrap_or_else(|p| p.into_inner());
    let mut level = LoadLevel { concurrency: c, requests: n, seconds, ..Default::default() };
    let (mut answers, mut spans_ms) = (Vec::new(), Vec::new());
    for r in results {
        match r {
            Ok((pick, tokens, text, span)) => {
                level.completed += 1;
                level.output_tokens += tokens;
                answers.push((pick, super::wire::recorded(text)));
                spans_ms.push(span);
            }
            Err(e) if level.errors.len() < 4 => level.errors.push(e),
            Err(_) => {}
        }
    }
    level.requests_per_s = level.completed as f64 / seconds.max(1e-9);
    LevelRun { level, answers, spans_ms }
}
