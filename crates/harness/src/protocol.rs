//! The harness protocol: the one request the server hands a harness process and the one reply it
//! reads back. This file is compiled into the server (`metainfer::harness::protocol`) and, verbatim,
//! into every generated harness crate (`src/protocol.rs` there), so the two sides cannot drift: a
//! change to a message is a compile error in the harness or a reported "unreadable reply", never
//! silently zeros. It depends on `serde` and `std` only.
//!
//! The harness is run as `harness <request.json>`; it reads a [`Request`], runs the engine, writes
//! bulk tensors as safetensors files named in the request, and writes its [`Reply`] as JSON to
//! `Request::reply` (never stdout, which the engine may print to). A request carries one
//! [`Command`]: `kernel`, `generate`, `tokenize`, `profile`, `trace`, `time`, and for serving engines
//! `block_manager`, `scheduler` and `batch` (compiled into the harness only for them, see
//! `harness::templating`). A reply that does not parse, or of another variant than the command's,
//! is reported in the gate's report.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Protocol version, checked by the harness against the request's.
pub const VERSION: u32 = 3;

/// What the server asks a harness process to do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// [`VERSION`] of the server that wrote it.
    pub version: u32,
    /// Where the harness writes its [`Reply`] as JSON.
    pub reply: PathBuf,
    /// The command.
    pub command: Command,
}

/// One harness command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case", deny_unknown_fields)]
pub enum Command {
    /// Run each case through the engine's kernel: inputs and outputs are safetensors files; every
    /// output buffer starts as NaN.
    Kernel {
        /// The cases, in order.
        cases: Vec<KernelCase>,
    },
    /// Greedy generation through the engine's tokenizer, model and sampler, one prompt after the
    /// other, writing per prompt `prompt_ids.<p>`, `tokens.<p>` and `logits.<p>` (the logits rows
    /// that chose each generated token, f32, [rows, vocab]: every step's, or with `logits_every` > 1
    /// only the steps [`whole_row`] names, in step order, and then every step's [`TOP_LOGITS`] largest
    /// as `top_ids.<p>` (u32) and `top_logits.<p>` (f32), [tokens, min(TOP_LOGITS, vocab)], largest
    /// first) into `tensors`.
    Generate {
        /// Hugging Face model directory.
        model: PathBuf,
        /// The prompts.
        prompts: Vec<Prompt>,
        /// Output safetensors file.
        tensors: PathBuf,
        /// The server's stop tokens (generation_config.json eos_token_id): generation ends after one
        /// of them unless the engine has its own `generate::stop_tokens`, which then decides.
        #[serde(default)]
        stop_tokens: Vec<u32>,
        /// 0 or 1: every logits row whole; N > 1: only the rows [`whole_row`] names (a row of a
        /// 128,256-token vocabulary is 0.5 MB, and a verify generates hundreds of tokens). Left out
        /// of the request when 0, so a request is what it was before the field existed.
        #[serde(default, skip_serializing_if = "is_zero")]
        logits_every: usize,
    },
    /// The engine's tokenizer on real vocabularies: per set, `Tokenizer::load(dir)`, then encode each
    /// text and decode each id list.
    Tokenize {
        /// The vocabularies.
        sets: Vec<TokenizeSet>,
    },
    /// Timed prefill and decode runs on prompts drawn from `seed` ([`profile_prompt`]: different
    /// on every run and every call, so an engine cannot tell a timed prompt by its tokens).
    Profile {
        /// Hugging Face model directory.
        model: PathBuf,
        /// Prompt tokens per run.
        prompt_len: usize,
        /// Tokens decoded per run.
        new_tokens: usize,
        /// Runs.
        runs: usize,
        /// The gate's seed, which the prompts are drawn from.
        #[serde(default)]
        seed: u64,
    },
    /// Run `tokens` through the engine's `Model::forward_traced` one at a time from position 0,
    /// keeping the activation points the engine reports while running the last one; write them,
    /// in the engine's order, as `point.<k>` (f32, flattened) into `tensors`. An engine without
    /// `forward_traced` replies [`Reply::Trace`] with `missing` set.
    Trace {
        /// Hugging Face model directory.
        model: PathBuf,
        /// Token ids at positions 0, 1, ...; the last one is traced.
        tokens: Vec<u32>,
        /// Output safetensors file.
        tensors: PathBuf,
    },
    /// Time kernels on given shapes, cycling through `copies` weight buffers.
    Time {
        /// Timed repetitions per item.
        reps: usize,
        /// The kernel calls.
        items: Vec<TimeItem>,
    },
    /// Apply operations in order to one new engine `paged::BlockManager` (serving engines only),
    /// reporting after each what the engine says; the server checks the invariants.
    BlockManager {
        /// Blocks in the pool.
        num_blocks: usize,
        /// Positions per block.
        block_size: usize,
        /// The operations, in order.
        ops: Vec<BlockOp>,
    },
    /// Greedy generation of several sequences through the engine's batched step over one paged
    /// KV cache (serving engines only), on the server's schedule: step by step, the listed chunks
    /// run together; a chunk that completes its prompt, and every decode entry, takes the greedy
    /// token of its logits, which the sequence's next decode entry feeds back. Writes per sequence
    /// `tokens.<s>` and `logits.<s>` ([tokens, vocab] f32: the rows that chose each token) into
    /// `tensors`.
    Batch {
        /// Hugging Face model directory.
        model: PathBuf,
        /// Blocks of the paged KV cache.
        num_blocks: usize,
        /// Positions per block.
        block_size: usize,
        /// The sequences.
        seqs: Vec<BatchSeq>,
        /// Per step, its chunks (at most one per sequence).
        steps: Vec<Vec<StepEntry>>,
        /// Output safetensors file.
        tensors: PathBuf,
    },
    /// Drive one new engine `scheduler::Scheduler` through a request trace (serving engines only).
    /// Step by step: add the requests arriving at that step (recording `add`'s answer), abort the
    /// ids listed for it (recording `abort`'s answer), then `schedule()`, then `update()` with each
    /// sampling chunk's request's next scripted token as the sampled one, and record the plan, the
    /// events and `free_blocks()`. Stops when every request is resolved and no
    /// arrival is left, or after `max_steps`.
    Scheduler {
        /// Blocks in the pool.
        num_blocks: usize,
        /// Positions per block.
        block_size: usize,
        /// Most running sequences.
        max_seqs: usize,
        /// Token budget per step.
        max_batch_tokens: usize,
        /// Most positions of a sequence.
        max_context: usize,
        /// The requests, each with its arrival step and scripted tokens.
        requests: Vec<TraceRequest>,
        /// (step, id): abort `id` at that step, before scheduling.
        aborts: Vec<(usize, u64)>,
        /// Most steps to run.
        max_steps: usize,
    },
}

/// One request of [`Command::Scheduler`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRequest {
    /// Request id.
    pub id: u64,
    /// Step at which it is added.
    pub arrival: usize,
    /// Prompt ids.
    pub prompt: Vec<u32>,
    /// Most new tokens.
    pub max_tokens: usize,
    /// EOS ids.
    pub eos: Vec<u32>,
    /// The token its k-th sampling step draws, k = 0, 1, ...
    pub script: Vec<u32>,
}

/// What one step of [`Command::Scheduler`] did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerStep {
    /// (id, Err text or None) of each `add` at this step, in trace order.
    pub added: Vec<(u64, Option<String>)>,
    /// (id, answer) of each `abort` at this step.
    pub aborted: Vec<(u64, bool)>,
    /// The plan `schedule()` returned.
    pub plan: Vec<PlannedChunk>,
    /// The events `update()` returned, in order.
    pub events: Vec<SchedulerEvent>,
    /// `free_blocks()` after `update()`.
    pub free_blocks: usize,
}

/// One entry of a plan of [`SchedulerStep`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlannedChunk {
    /// Request id.
    pub id: u64,
    /// Token ids of the chunk.
    pub tokens: Vec<u32>,
    /// Position of its first token.
    pub start: usize,
    /// Physical blocks.
    pub block_table: Vec<u32>,
    /// Whether its logits give the next token.
    pub samples: bool,
}

/// One event of [`SchedulerStep`]: a token, or a finish with its reason (`stop` or `length`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerEvent {
    /// Request id.
    pub id: u64,
    /// The token, for a token event.
    pub token: Option<u32>,
    /// `stop` or `length`, for a finish event.
    pub finish: Option<String>,
}

/// One operation of [`Command::BlockManager`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum BlockOp {
    /// `can_allocate(n_tokens)`.
    CanAllocate {
        /// Positions.
        n_tokens: usize,
    },
    /// `allocate(seq, n_tokens)`.
    Allocate {
        /// Sequence id.
        seq: u64,
        /// Positions.
        n_tokens: usize,
    },
    /// `append_slot(seq)`.
    Append {
        /// Sequence id.
        seq: u64,
    },
    /// `free(seq)`.
    Free {
        /// Sequence id.
        seq: u64,
    },
}

/// One sequence of [`Command::Batch`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchSeq {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Greedy tokens to generate.
    pub new_tokens: usize,
    /// Its physical blocks, covering prompt and generated tokens.
    pub block_table: Vec<u32>,
}

/// One chunk of a step of [`Command::Batch`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepEntry {
    /// Index into `seqs`.
    pub seq: usize,
    /// Prompt tokens of this prefill chunk, or 1 for a decode entry (the last generated token).
    pub tokens: usize,
}

/// One kernel case of [`Command::Kernel`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelCase {
    /// Kernel contract id, e.g. `kernel.rope`.
    pub kernel: String,
    /// Inputs (tensors by name; scalar parameters as text in the safetensors metadata).
    pub input: PathBuf,
    /// Where the harness writes the output tensor `out`.
    pub output: PathBuf,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// Which prompts of a profile [`profile_prompt`] draws: the timed decode runs, the prefill-by-length
/// runs and the traced runs are separate streams.
pub const PROMPT_DECODE: u64 = 0;
/// See [`PROMPT_DECODE`].
pub const PROMPT_PREFILL: u64 = 1;
/// See [`PROMPT_DECODE`].
pub const PROMPT_TRACED: u64 = 2;

/// The `len` prompt token ids of the profile prompt that `draw` names (its stream,
/// [`PROMPT_DECODE`], ..., then its run, and for a prefill-by-length run its length), drawn from
/// `seed`, each below `vocab`: splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom
/// number generators", OOPSLA 2014) chained over seed, the parts of `draw` and the index. The
/// harness draws them and the server draws them again to check the prompts a reply says it timed.
pub fn profile_prompt(seed: u64, draw: &[u64], len: usize, vocab: u32) -> Vec<u32> {
    let base = draw.iter().fold(splitmix64(seed), |h, &part| splitmix64(h ^ part));
    (0..len).map(|i| (splitmix64(base ^ i as u64) % u64::from(vocab.max(1))) as u32).collect()
}

/// One output of splitmix64 from state `z` (the state advanced by the golden-ratio increment, then
/// mixed), as in Vigna's reference splitmix64.c.
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod prompt_tests {
    use super::{PROMPT_DECODE, PROMPT_PREFILL, profile_prompt, splitmix64};

    /// splitmix64's first outputs from state 0 are 0xE220A8397B1DCDAF and 0x6E789E6AA1B965F4
    /// (Vigna's splitmix64.c; the state advances by the increment before each output).
    #[test]
    fn splitmix64_gives_the_reference_outputs() {
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(0x9E37_79B9_7F4A_7C15), 0x6E78_9E6A_A1B9_65F4);
    }

    /// Prompts are below the vocabulary, the same for the same draw, and differ by seed, run and
    /// stream.
    #[test]
    fn prompts_are_in_range_repeatable_and_distinct() {
        let p = profile_prompt(7, &[PROMPT_DECODE, 0], 64, 105);
        assert!(p.len() == 64 && p.iter().all(|&t| t < 105));
        assert_eq!(p, profile_prompt(7, &[PROMPT_DECODE, 0], 64, 105));
        for other in [
            profile_prompt(8, &[PROMPT_DECODE, 0], 64, 105),
            profile_prompt(7, &[PROMPT_DECODE, 1], 64, 105),
            profile_prompt(7, &[PROMPT_PREFILL, 0, 64], 64, 105),
        ] {
            assert_ne!(p, other);
        }
    }
}

/// Steps of a generation whose logits rows come back whole under `logits_every` > 1: the first
/// `HEAD_ROWS` (what a diagnosis reruns: `oracle::diagnose::GENERATION_ROWS`).
pub const HEAD_ROWS: usize = 8;

/// How many of the largest logits of each step come back when its row does not.
pub const TOP_LOGITS: usize = 16;

/// Whether step `step` of a generation of `steps` tokens returns its whole logits row under
/// `every` ([`Command::Generate`]'s `logits_every`): always for `every` <= 1; otherwise the first
/// [`HEAD_ROWS`] steps, every `every`-th step and the last one.
pub fn whole_row(step: usize, steps: usize, every: usize) -> bool {
    every <= 1 || step < HEAD_ROWS || step.is_multiple_of(every) || step + 1 == steps
}

/// The `k` largest values of `row` as (index, value), largest first (equal values by lower index);
/// a non-finite value (NaN, inf, -inf) counts as larger than every number, so a non-finite logit is
/// always among them, and the judge fails it.
pub fn top_logits(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let order = |a: &(u32, f32), b: &(u32, f32)| {
        let finite = |v: f32| if v.is_finite() { v } else { f32::INFINITY };
        b.1.is_finite().cmp(&a.1.is_finite()).reverse().then(finite(b.1).total_cmp(&finite(a.1))).then(a.0.cmp(&b.0))
    };
    let mut all: Vec<(u32, f32)> = row.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
    let k = k.min(all.len());
    if k < all.len() && k > 0 {
        all.select_nth_unstable_by(k - 1, order);
    }
    all.truncate(k);
    all.sort_by(order);
    all
}

/// One prompt of [`Command::Generate`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prompt {
    /// Text, encoded by the engine's tokenizer.
    pub text: String,
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
}

/// One vocabulary of [`Command::Tokenize`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeSet {
    /// Directory holding its tokenizer.json.
    pub dir: PathBuf,
    /// Texts to encode.
    pub texts: Vec<String>,
    /// Id lists to decode.
    pub decode: Vec<Vec<u32>>,
}

/// One timed kernel call of [`Command::Time`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeItem {
    /// Kernel contract id.
    pub kernel: String,
    /// Dimensions by name, as the kernel's timed arm reads them.
    pub dims: BTreeMap<String, usize>,
    /// Distinct weight buffers cycled through, so the working set is the model's.
    pub copies: usize,
    /// Calls per timed repetition.
    pub iters: usize,
}

/// What the harness answers, one variant per command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    /// Per kernel case, in request order.
    Kernel {
        /// The results.
        results: Vec<CaseResult>,
    },
    /// The generation's texts (the tensors are in the request's file).
    Generate {
        /// The engine's `vocab_size()`.
        vocab: usize,
        /// Per prompt, in request order.
        prompts: Vec<Generated>,
        /// The engine's `generate::stop_tokens(dir)`, when it defines that function.
        #[serde(default)]
        stop_tokens: Option<Vec<u32>>,
    },
    /// Per vocabulary of [`Command::Tokenize`], in request order.
    Tokenize {
        /// The results.
        sets: Vec<TokenizedSet>,
    },
    /// Timings of [`Command::Profile`].
    Profile(Box<ProfileTimings>),
    /// Timings of [`Command::Time`], per item in request order.
    Time {
        /// The items.
        items: Vec<TimedItem>,
    },
    /// The points of [`Command::Trace`] (their values are in the request's file), in the order the
    /// engine reported them.
    Trace {
        /// The points: `point.<k>` in the file is `points[k]`.
        points: Vec<TracePoint>,
        /// Why nothing was traced: the engine has no `forward_traced`, or it panicked (the text).
        missing: Option<String>,
    },
    /// The harness of an engine for a device (e.g. CUDA) found no usable device: nothing ran.
    NoDevice {
        /// Why, in words (no driver library, no device, the driver's error).
        reason: String,
    },
    /// What the block manager answered, per operation in request order, and every sequence's
    /// block table at the end.
    BlockManager {
        /// Per operation.
        results: Vec<BlockOpResult>,
        /// (sequence id, block table) of every id the operations named, after the last one.
        tables: Vec<(u64, Vec<u32>)>,
        /// The panic message when the engine panicked (results then stop there).
        panic: Option<String>,
    },
    /// What the scheduler did, step by step.
    Scheduler {
        /// Per step run.
        steps: Vec<SchedulerStep>,
        /// The panic message when the engine panicked (steps then stop there).
        panic: Option<String>,
    },
    /// The batched generation ran (the tensors are in the request's file).
    Batch {
        /// The engine's `vocab_size()`.
        vocab: usize,
        /// Steps run.
        steps: usize,
        /// The panic message when the engine panicked (the tensors then hold what was done).
        panic: Option<String>,
    },
}

/// The device a harness ran on (CUDA engines), as its driver reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceInfo {
    /// Device name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Compute capability, e.g. `9.0`.
    pub compute_capability: String,
    /// Device memory, bytes.
    pub memory_bytes: u64,
    /// Bandwidth of a device-to-device copy of 1 GiB (bytes read plus bytes written, per second),
    /// GB/s, timed with CUDA events, best of 5; 0 when not probed.
    pub copy_gbs: f64,
}

/// The engine's tokenizer on one vocabulary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizedSet {
    /// Why `Tokenizer::load` failed (or its panic); the lists are then empty.
    pub error: Option<String>,
    /// Per text, in request order.
    pub encoded: Vec<Encoded>,
    /// Per id list, in request order.
    pub decoded: Vec<Decoded>,
}

/// One text's encoding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Encoded {
    /// The ids.
    pub ids: Vec<u32>,
    /// The panic message when encode panicked.
    pub panic: Option<String>,
}

/// One id list's decoding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Decoded {
    /// The text.
    pub text: String,
    /// The panic message when decode panicked.
    pub panic: Option<String>,
}

/// The engine's answer to one [`BlockOp`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockOpResult {
    /// `can_allocate`'s answer, or whether `allocate` / `append_slot` returned Ok (free: true).
    pub ok: bool,
    /// `num_free_blocks()` after the operation.
    pub free: usize,
    /// `block_table(seq)` after the operation (empty for can_allocate).
    pub table: Vec<u32>,
}

/// One kernel case's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaseResult {
    /// Seconds the kernel call took.
    pub seconds: f64,
    /// The panic message when the engine's kernel panicked (no output was written).
    pub panic: Option<String>,
}

/// One prompt's generation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Generated {
    /// The engine's own decode of prompt ids and generated tokens.
    pub text: String,
    /// Tokens generated.
    pub tokens: usize,
}

/// Timings of one profile command; seconds throughout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileTimings {
    /// `Model::load`.
    pub load_s: f64,
    /// Prefill of the prompt, per run.
    pub prefill_s: Vec<f64>,
    /// Decode time per token, per run.
    pub decode_s_per_token: Vec<f64>,
    /// Prefill plus the first greedy choice, per run.
    pub first_token_s: Vec<f64>,
    /// Prefill at a quarter, half and all of the prompt length.
    pub prefill_by_len: Vec<PrefillTimes>,
    /// Peak resident set size of the process (Linux VmHWM), kB; 0 where unknown.
    pub peak_rss_kb: u64,
    /// Each timed run's prompt ids and greedy tokens, for the server to check.
    pub runs: Vec<TimedRun>,
    /// The device the engine ran on (CUDA engines), with a bandwidth probe; None on the host.
    #[serde(default)]
    pub device: Option<DeviceInfo>,
    /// Time per activation point of the real forward pass (`Model::forward_traced`, decode steps
    /// after a `prompt_len` prefill): empty when the engine has no traced forward.
    #[serde(default)]
    pub points: Vec<PointTime>,
    /// Decode seconds per token of the traced runs, call to return, per run (the whole of which
    /// the points share); empty without a traced forward.
    #[serde(default)]
    pub traced_s_per_token: Vec<f64>,
    /// Why the points are missing when the engine has a traced forward (it panicked).
    #[serde(default)]
    pub points_error: Option<String>,
    /// The greedy tokens of each traced run (its prompt is [`profile_prompt`]'s
    /// `[PROMPT_TRACED, run]`), the first chosen after the prefill, for the server to check;
    /// empty without a traced forward.
    #[serde(default)]
    pub traced_runs: Vec<Vec<u32>>,
}

/// One activation point an engine's traced forward reported: its layer (None in the prologue and
/// epilogue) and name (a node of the family's `[model.graph]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracePoint {
    /// Decoder layer, or None for `embed`, `final_norm`, `logits`, ...
    pub layer: Option<usize>,
    /// Node name.
    pub name: String,
}

/// The time the traced forward spent reaching one activation point from the one before it (or
/// from the call's start), summed over its layers, per decoded token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PointTime {
    /// Node name (e.g. `q`, `attn`, `logits`).
    pub name: String,
    /// Layers it was reported in per token (0 for prologue and epilogue points).
    pub layers: usize,
    /// Seconds per decoded token, per run.
    pub seconds: Vec<f64>,
}

/// Prefill timings at one prompt length.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillTimes {
    /// Prompt tokens.
    pub len: usize,
    /// Seconds per run.
    pub seconds: Vec<f64>,
    /// The greedy token chosen after each run's prefill (its prompt is [`profile_prompt`]'s
    /// `[PROMPT_PREFILL, run, len]`), for the server to check.
    #[serde(default)]
    pub tokens: Vec<u32>,
}

/// One timed run's tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimedRun {
    /// Prompt ids.
    pub prompt: Vec<u32>,
    /// Greedy tokens generated.
    pub tokens: Vec<u32>,
}

/// One timed kernel's figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimedItem {
    /// Kernel contract id.
    pub kernel: String,
    /// Seconds per call, one figure per repetition.
    pub seconds_per_call: Vec<f64>,
}

#[cfg(test)]
mod logits_tests {
    use super::{top_logits, whole_row};

    /// Largest first, equal values by lower token, NaN and infinities above every number; k beyond
    /// the row.
    #[test]
    fn top_logits_order_and_nan() {
        let row = [1.0, 3.0, 3.0, f32::NAN, f32::NEG_INFINITY, 2.0];
        let top = top_logits(&row, 4);
        // Non-finite first (by index), then the numbers.
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), [3, 4, 1, 2]);
        assert!(top[0].1.is_nan() && top[1].1 == f32::NEG_INFINITY && top[2].1 == 3.0);
        let all: Vec<u32> = top_logits(&row, 10).iter().map(|t| t.0).collect();
        assert_eq!(all, [3, 4, 1, 2, 5, 0]);
    }

    /// Under every = 4 in 16 steps: 0 to 7, then 8 and 12, and the last (15).
    #[test]
    fn whole_rows_are_the_head_every_nth_and_the_last() {
        let whole: Vec<usize> = (0..16).filter(|&s| whole_row(s, 16, 4)).collect();
        assert_eq!(whole, [0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 15]);
        assert!((0..16).all(|s| whole_row(s, 16, 1)));
    }
}
