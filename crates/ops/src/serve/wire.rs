//! What serve_engine sends the server, and what it saw: the [`Plan`] is drawn here from the seed
//! and the tokenizer and holds no expected answer, so it can travel in a bundle to the machine
//! where the server runs; the [`Observed`] record is what the battery and the load test saw there,
//! judged here against the reference ([`super::judge`]).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::{Check, LoadLevel};
use base::error::Result;

/// Words the drawn prompts are made of (plain English, in every tokenizer's vocabulary).
const WORDS: &[&str] = &[
    "Once", "upon", "a", "time", "there", "was", "little", "girl", "boy", "dog", "cat", "sun", "happy", "played",
    "the", "park", "with", "her", "his", "friend", "and", "they", "went", "to", "see", "big", "tree",
];

/// A prompt of 2..=7 words drawn from [`WORDS`].
fn draw_prompt(rng: &mut ChaCha8Rng) -> String {
    let n = rng.random_range(2..=7);
    (0..n).map(|_| WORDS[rng.random_range(0..WORDS.len())]).collect::<Vec<_>>().join(" ")
}

/// One greedy completion request: a drawn prompt and its new-token budget (already cut to what
/// the model's context leaves after the prompt's tokens).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ask {
    /// Prompt text.
    pub prompt: String,
    /// `max_tokens` of the request, >= 1.
    pub max_tokens: usize,
}

/// Every request serve_engine sends, drawn from one seed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// The seed it was drawn from.
    pub seed: u64,
    /// Three greedy completions (8..=48 new tokens); the first is also streamed, cut by a stop
    /// string, asked as chat and used by the burst, disconnect and keep-alive checks.
    pub greedy: Vec<Ask>,
    /// Six load-test prompts of the request's `max_tokens`.
    pub pool: Vec<Ask>,
    /// The load test: per concurrency level, the pool index of each request, in sending order.
    pub levels: Vec<(usize, Vec<usize>)>,
    /// The model's context length, tokens (the too-long prompt is twice as many words).
    pub max_context: usize,
    /// The engine's `max_seqs` (the disconnect check fills every slot).
    pub max_seqs: usize,
    /// New tokens of the disconnect check's requests: what the context leaves after the first
    /// greedy prompt.
    pub disconnect_tokens: usize,
}

/// Most concurrency levels of one load test.
pub const MAX_LEVELS: usize = 8;

/// Longest text of one answer a run records, bytes: far above any answer of the plan's token
/// budgets (256 tokens); a longer one is cut (and can then only differ from the reference), so a
/// run's record stays bounded ([`MAX_LEVELS`] levels of 1,024 requests at most).
pub const MAX_RECORDED_TEXT: usize = 16 << 10;

/// `text` cut to [`MAX_RECORDED_TEXT`] bytes at a character boundary, marked when cut.
pub(super) fn recorded(mut text: String) -> String {
    if text.len() > MAX_RECORDED_TEXT {
        let mut at = MAX_RECORDED_TEXT;
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        text.truncate(at);
        text.push_str(" [cut: longer than the recorded bound]");
    }
    text
}

impl Plan {
    /// Refuse a plan no serve_engine call draws (a bundle's plan is read on the machine that runs
    /// it): 1..=8 greedy asks and 1..=64 pool prompts of at most 4 KiB and 1..=4096 new tokens each;
    /// at most [`MAX_LEVELS`] levels of concurrency 1..=64 and at most 1,024 requests, each
    /// picking a pool prompt; a context of 1..=2^20 tokens.
    ///
    /// # Errors
    /// [`base::error::ErrorKind::Usage`] naming the first field out of bounds.
    pub fn check(&self) -> Result<()> {
        let bad = |what: String| Err(base::error::Error::usage(format!("the plan's {what}; write the bundle again")));
        let asks_ok = |asks: &[Ask], max: usize| {
            !asks.is_empty()
                && asks.len() <= max
                && asks.iter().all(|a| a.prompt.len() <= 4096 && (1..=4096).contains(&a.max_tokens))
        };
        if !asks_ok(&self.greedy, 8) {
            return bad("greedy asks must be 1..=8, each a prompt of at most 4 KiB and 1..=4096 tokens".into());
        }
        if !asks_ok(&self.pool, 64) {
            return bad("pool must hold 1..=64 asks, each a prompt of at most 4 KiB and 1..=4096 tokens".into());
        }
        if self.levels.len() > MAX_LEVELS {
            return bad(format!("load test has {} levels, at most {MAX_LEVELS}", self.levels.len()));
        }
        for (c, picks) in &self.levels {
            if !(1..=64).contains(c) || picks.len() > 1024 || picks.iter().any(|&p| p >= self.pool.len()) {
                return bad(format!(
                    "level of concurrency {c} must be 1..=64 with at most 1024 requests, each picking one of the {} pool prompts",
                    self.pool.len()
                ));
            }
        }
        let context = 1..=(1usize << 20);
        if !context.contains(&self.max_context) || !context.contains(&self.disconnect_tokens) {
            return bad("max_context and disconnect_tokens must be 1..=2^20".into());
        }
        Ok(())
    }
}

/// How serve_engine draws its plan: levels, requests per level and new tokens of the load test.
pub(super) struct Draw<'a> {
    pub(super) seed: u64,
    pub(super) levels: &'a [usize],
    pub(super) requests: Option<usize>,
    pub(super) max_tokens: usize,
    pub(super) max_context: usize,
    pub(super) max_seqs: usize,
}

impl Draw<'_> {
    /// The plan, with each prompt's token count from `count` (the model's tokenizer).
    ///
    /// # Errors
    /// When a prompt cannot be tokenized.
    pub(super) fn plan(&self, count: impl Fn(&str) -> Result<usize>) -> Result<Plan> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ base::util::fnv1a("serve_engine"));
        let ask = |prompt: String, n: usize| -> Result<Ask> {
            let n = n.min(self.max_context.saturating_sub(count(&prompt)?)).max(1);
            Ok(Ask { prompt, max_tokens: n })
        };
        let mut greedy = Vec::new();
        for _ in 0..3 {
            let p = draw_prompt(&mut rng);
            let n = rng.random_range(8..=48);
            greedy.push(ask(p, n)?);
        }
        let mut pool = Vec::new();
        for _ in 0..6 {
            let p = draw_prompt(&mut rng);
            pool.push(ask(p, self.max_tokens)?);
        }
        let levels = self
            .levels
            .iter()
            .map(|&c| {
                let n = self.requests.unwrap_or(2 * c);
                (c, (0..n).map(|_| rng.random_range(0..pool.len())).collect())
            })
            .collect();
        let disconnect_tokens = self.max_context.saturating_sub(count(&greedy[0].prompt)?).max(1);
        Ok(Plan {
            seed: self.seed,
            greedy,
            pool,
            levels,
            max_context: self.max_context,
            max_seqs: self.max_seqs,
            disconnect_tokens,
        })
    }
}

/// A plain completion as the client read it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Answered {
    /// `choices[0].text`.
    pub text: String,
    /// `choices[0].finish_reason` ("" when absent).
    pub finish: String,
    /// `usage.completion_tokens`.
    pub completion_tokens: usize,
}

/// A streamed completion as the client read it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamAnswered {
    /// The text events' pieces, joined.
    pub text: String,
    /// The last finish_reason seen.
    pub finish: String,
    /// Text events received.
    pub events: usize,
    /// Whether the stream ended with `data: [DONE]`.
    pub done: bool,
}

/// One step of the battery as the client saw it, in the order the checks are reported.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "step", rename_all = "snake_case", deny_unknown_fields)]
pub enum Step {
    /// A check decided where the server ran: it needs no reference (help, health, models, chat,
    /// bad requests, disconnect, keep-alive; alive when the server had died, burst when it was not
    /// sent).
    Checked {
        /// The check.
        check: Check,
    },
    /// The plan's greedy completions, in order (Err: what went wrong, in words).
    Greedy {
        /// One per [`Plan::greedy`].
        answers: Vec<std::result::Result<Answered, String>>,
    },
    /// The first greedy request, streamed.
    Streaming {
        /// What the stream held.
        answer: std::result::Result<StreamAnswered, String>,
    },
    /// A stop string cut from the middle of the server's own greedy answer `greedy` (the first of
    /// at least four characters), sent with that request; None when no answer was long enough.
    Stop {
        /// The greedy request it was sent with, its stop string and the answer.
        sent: Option<(usize, String, std::result::Result<Answered, String>)>,
    },
    /// The burst as decided where the server ran (each request answered or refused with a 4xx),
    /// with the texts of its completed answers and how many gave each; judged here against the
    /// reference's one-token answer.
    Burst {
        /// The check as decided there.
        check: Check,
        /// Each distinct completion text and its count.
        texts: Vec<(String, usize)>,
    },
    /// The disconnect check that could not tell (`checks::NOT_OBSERVABLE`: its full-length request
    /// alone took under 20 ms), with that request's answer; judged here against the reference's.
    Disconnect {
        /// The check as decided there.
        check: Check,
        /// The full-length request's answer.
        full: Answered,
    },
    /// The first greedy request again, after the bad requests and the burst.
    Alive {
        /// The answer.
        answer: std::result::Result<Answered, String>,
    },
}

/// One concurrency level of the load test as the client saw it: its timing figures (the greedy
/// mismatches are left to the judge) and each completed request's text.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LevelRun {
    /// The level, `greedy_mismatches` 0.
    pub level: LoadLevel,
    /// Per completed request: its pool index and streamed text.
    pub answers: Vec<(usize, String)>,
    /// Per completed request, as `answers`: when its first and its last non-empty text arrived,
    /// milliseconds from the request (the judge derives the level's token counts and inter-token
    /// latency from these and the reference's tokens, not from the server's usage or chunking).
    #[serde(default)]
    pub spans_ms: Vec<(f64, f64)>,
}

/// Everything the battery and the load test saw, where the server ran.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Observed {
    /// Whether the server ran in the enforced sandbox.
    pub sandboxed: bool,
    /// The battery, in order.
    pub steps: Vec<Step>,
    /// The load test, one entry per level run.
    pub levels: Vec<LevelRun>,
    /// Load average (1 minute) when the load test started; -1 when unknown.
    pub load_average: f64,
    /// What stopped the run (the server exited, the budget ran out), "" when nothing did.
    pub error: String,
}
