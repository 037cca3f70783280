//! The serving part of `metainfer bench --serving`: serve_engine's load test of the example engine
//! on the stories15M shape at [`SERVING_LEVELS`], and its table and goal (output tokens/s at
//! concurrency 16 >= 4x concurrency 1, with every answer equal to the reference's).

use std::path::Path;

use serde::Serialize;

use super::BenchReport;
use crate::error::{Error, Result};
use crate::harness::Budget;
use crate::ops::{self, Ctx};

/// Concurrency levels of the serving benchmark, requests per level and new tokens per request.
pub const SERVING_LEVELS: [usize; 3] = [1, 4, 16];
const SERVING_REQUESTS: usize = 32;
const SERVING_TOKENS: usize = 64;

/// The serving benchmark: serve_engine's report on the stories15M shape.
#[derive(Debug, Clone, Serialize)]
pub struct Serving {
    /// Whether serve_engine passed (every check, every answer equal to the reference's).
    pub passed: bool,
    /// Seed of the run (replays its prompts).
    pub seed: u64,
    /// Machine load average when the load test ran.
    pub load_average: f64,
    /// One row per concurrency level.
    pub levels: Vec<ops::serve::LoadLevel>,
}

/// serve_engine on the example engine and the stories15M checkpoint at [`SERVING_LEVELS`].
pub(super) fn run(ctx: &Ctx, engine_dir: &Path, model: &Path, budget: &Budget) -> Result<Serving> {
    eprintln!("bench: serve_engine's load test at concurrency {SERVING_LEVELS:?}");
    let req = ops::serve::ServeRequest {
        engine: engine_dir.display().to_string(),
        model: model.display().to_string(),
        concurrency: Some(SERVING_LEVELS.to_vec()),
        requests: Some(SERVING_REQUESTS),
        max_tokens: Some(SERVING_TOKENS),
        seed: None,
        dtype: None,
        write_bundle: None,
        from_bundle: None,
    };
    let r = ops::serve::serve_engine(ctx, &req, budget)?;
    if !r.error.is_empty() {
        return Err(Error::internal(format!("serve_engine on the example engine: {}", r.error)));
    }
    Ok(Serving { passed: r.passed, seed: r.seed, load_average: r.load_average, levels: r.levels })
}

impl BenchReport {
    /// The serving table and its goal: output tokens/s at concurrency 16 >= 4x concurrency 1, with
    /// every answer equal to the reference's.
    pub(super) fn serving_text(&self, sv: &Serving) -> String {
        let mut s = format!(
            "\nserving (serve_engine, example engine f32, stories15M shape, {SERVING_TOKENS} new tokens per request, seed {}, load average {:.1}):\n",
            sv.seed, sv.load_average
        );
        s += &format!(
            "  {:>4} {:>12} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7}\n",
            "conc", "output tok/s", "req/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "differ"
        );
        for l in &sv.levels {
            s += &format!(
                "  {:>4} {:>12.1} {:>9.2} {:>7.1}ms {:>7.1}ms {:>7.2}ms {:>7.2}ms {:>3}/{:<3}\n",
                l.concurrency,
                l.output_tokens_per_s,
                l.requests_per_s,
                l.ttft_ms_p50,
                l.ttft_ms_p99,
                l.itl_ms_p50,
                l.itl_ms_p99,
                l.greedy_mismatches + (l.requests - l.completed),
                l.requests
            );
        }
        let at = |c: usize| sv.levels.iter().find(|l| l.concurrency == c).map(|l| l.output_tokens_per_s);
        if let (Some(one), Some(sixteen)) = (at(1), at(16)) {
            let ratio = sixteen / one.max(1e-9);
            let ok = ratio >= 4.0 && sv.passed;
            s += &format!(
                "  serving output tok/s at concurrency 16 >= 4x concurrency 1, answers equal to the reference: {ratio:.2}x, serve_engine {} ({})\n",
                if sv.passed { "passed" } else { "FAILED" },
                if ok { "met" } else { "NOT met" }
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn level(concurrency: usize, tok_s: f64, mismatches: usize) -> ops::serve::LoadLevel {
        ops::serve::LoadLevel {
            concurrency,
            requests: 32,
            completed: 32,
            greedy_mismatches: mismatches,
            output_tokens: 2048,
            seconds: 2048.0 / tok_s,
            output_tokens_per_s: tok_s,
            requests_per_s: tok_s / 64.0,
            ttft_ms_p50: 5.1,
            ttft_ms_p99: 10.2,
            itl_ms_p50: 2.0,
            itl_ms_p99: 5.1,
            errors: vec![],
        }
    }

    #[test]
    fn the_serving_goal_is_the_ratio_of_concurrency_16_to_1_with_every_answer_equal() {
        // Figures of one serve_engine run on a 2-core EPYC (2026-12-06): 483.5, 1507.2 and
        // 2134.9 output tokens/s at concurrency 1, 4 and 16; 2134.9 / 483.5 = 4.415.
        let report = |passed: bool, mismatches: usize| BenchReport {
            machine: "test".into(),
            threads: vec![1, 2],
            rows: vec![],
            agent_loop: None,
            serving: Some(Serving {
                passed,
                seed: 7,
                load_average: 1.4,
                levels: vec![level(1, 483.5, 0), level(4, 1507.2, 0), level(16, 2134.9, mismatches)],
            }),
            candle: false,
        };
        let text = report(true, 0).text();
        assert!(text.contains("    16       2134.9"), "{text}");
        assert!(
            text.contains("4x concurrency 1, answers equal to the reference: 4.42x, serve_engine passed (met)"),
            "{text}"
        );
        // The same speed with one answer that differs: not met.
        let text = report(false, 1).text();
        assert!(text.contains("4.42x, serve_engine FAILED (NOT met)"), "{text}");
        assert!(text.contains("  1/32"), "{text}");
    }
}
