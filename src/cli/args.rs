//! The command line: argument types only (clap derive). Kept in the binary so that no library type
//! depends on clap; values such as clients, reference levels and toolsets are parsed here into the
//! library's own types. Global options stand under their own help heading, and nearly every
//! command's help ends with examples (a command with subcommands shows theirs).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

mod groups;

pub use groups::*;

const GLOBAL: &str = "Global options";

#[derive(Parser)]
#[command(
    name = "metainfer",
    version,
    about = "Contracts, oracles and gates with which coding agents build custom LLM inference engines",
    long_about = "Contracts, oracles and gates with which coding agents build custom LLM inference engines.\n\n\
        Every MCP tool is also a subcommand; `--json` prints exactly the tool's structured output.\n\
        Exit status: 0 the check passed, 1 it ran and failed, 2 bad usage or input.",
    after_help = "Quick start:\n  metainfer demo                                   the whole loop on BabyLlama\n  \
        metainfer register --client claude --model-dir ../shared/models\n  \
        metainfer install-skills --client claude\n  \
        metainfer doctor --client claude                 does the client see the server and its tools?\n\n\
        Environment: METAINFER_LEDGER (ledger file), METAINFER_CACHE (build cache), METAINFER_MODEL \
        (the demo's model; default: the BabyLlama-105 built into this binary), METAINFER_TOKENIZERS (tokenizer \
        test vectors beyond the shipped ones; default ../shared/tokenizers), METAINFER_LOG (log filter, e.g. debug)."
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// Options every subcommand takes (and `serve` passes to the server).
#[derive(Args, Clone)]
pub struct Global {
    /// Contract knowledge base working copy (default: the CKB built into this binary).
    #[arg(long, global = true, value_name = "DIR", help_heading = GLOBAL)]
    pub ckb: Option<PathBuf>,
    /// Ledger database (default: $METAINFER_LEDGER, else ~/.local/share/metainfer/ledger.sqlite;
    /// `demo` uses its own unless this or $METAINFER_LEDGER is given).
    #[arg(long, global = true, value_name = "FILE", help_heading = GLOBAL)]
    pub ledger: Option<PathBuf>,
    /// Build cache: the shared cargo target directory and harness crates (default: $METAINFER_CACHE,
    /// else ~/.cache/metainfer).
    #[arg(long, global = true, value_name = "DIR", help_heading = GLOBAL)]
    pub cache: Option<PathBuf>,
    /// Time limit of one compile/test/verify/profile call, in seconds.
    #[arg(long, global = true, default_value_t = metainfer::options::DEFAULT_TIME_LIMIT_S, value_name = "SECS", help_heading = GLOBAL)]
    pub time_limit: u64,
    /// Leave invalid contract files out (each logged with its file and reason, and listed in every
    /// plan), with the files whose contracts reference theirs, instead of refusing to start.
    #[arg(long, global = true, help_heading = GLOBAL)]
    pub skip_invalid: bool,
    /// Largest text and structured content of one MCP tool result, in characters (lists page,
    /// long text is cut and marked).
    #[arg(long, global = true, default_value_t = metainfer::ops::MAX_TEXT, value_name = "CHARS", help_heading = GLOBAL)]
    pub max_output: usize,
    /// Refuse to build or run an engine when this kernel cannot sandbox it (Linux Landlock ABI >= 6
    /// and seccomp); without it such gates run unconfined and report `sandboxed: false`.
    #[arg(long, global = true, help_heading = GLOBAL)]
    pub require_sandbox: bool,
}

/// A client to register in or install skills for.
#[derive(Clone, Copy, ValueEnum)]
pub enum ClientArg {
    /// Claude Code (.mcp.json; skills in .claude/skills).
    Claude,
    /// Codex (~/.codex/config.toml; skills in .agents/skills).
    Codex,
    /// Gemini CLI (.gemini/settings.json; skills in .gemini/skills).
    Gemini,
    /// Cursor (.cursor/mcp.json; skills in .cursor/skills).
    Cursor,
    /// VS Code (.vscode/mcp.json; no skills folder).
    Vscode,
}

/// Reference level of a new engine.
#[derive(Clone, Copy, ValueEnum)]
pub enum LevelArg {
    /// Knowledge from the CKB only.
    Zero,
    /// Public documentation too.
    Docs,
    /// Other implementations' code too (provenance matches become warnings).
    Code,
}

/// A group of MCP tools.
#[derive(Clone, Copy, ValueEnum)]
pub enum ToolsetArg {
    /// plan_engine, lookup_contract, list_outcomes, ckb_report, evolve_knowledge, propose_contract,
    /// probe_machine, list_allowed_directories.
    Knowledge,
    /// scaffold_engine, compile_engine, check_rules.
    Build,
    /// run_kernel_test, verify_generation, profile_engine.
    Gates,
}

/// Options of the server that `serve` and `register` share.
#[derive(Args, Clone)]
pub struct ServeArgs {
    /// A model directory path arguments may also point into; repeat for several.
    #[arg(long = "model-dir", value_name = "DIR")]
    pub model_dirs: Vec<PathBuf>,
    /// Offer only the tools that change nothing (plan, lookup, ledger, report, check_rules, ...).
    #[arg(long)]
    pub read_only: bool,
    /// Offer only these tool groups (comma-separated); default: all.
    #[arg(long, value_enum, value_delimiter = ',', value_name = "SET,...")]
    pub toolsets: Vec<ToolsetArg>,
}

#[derive(Subcommand)]
pub enum Command {
    /// Serve MCP over stdio (stdout carries JSON-RPC only; logs go to stderr).
    #[command(
        after_help = "Example:\n  metainfer serve --workspace . --model-dir ~/models --toolsets knowledge,build,gates"
    )]
    Serve {
        /// Confine every path argument to this directory (and the --model-dir directories); without
        /// it, the client's MCP roots are the workspace when it offers them.
        #[arg(long, value_name = "DIR")]
        workspace: Option<PathBuf>,
        #[command(flatten)]
        serve: ServeArgs,
    },
    /// Plan an engine from constraints (tool plan_engine).
    #[command(after_help = "Example:\n  metainfer plan --model ../shared/models/babyllama-105 --dtype bf16")]
    Plan {
        /// Hugging Face model directory (config.json, model.safetensors, tokenizer.json).
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// Target platform: a platform contract's target (cpu, cuda; cpu-aarch64 once proposed).
        #[arg(long, default_value = "cpu", value_name = "TARGET")]
        target: String,
        /// Weight dtype: f32, bf16, f16 or int8 (cuda: bf16).
        #[arg(long, default_value = "f32", value_name = "DTYPE")]
        dtype: String,
        /// Platform contract id where the target has several (cuda: platform.cuda-sm90 or platform.cuda-sm80).
        #[arg(long, value_name = "ID")]
        platform: Option<String>,
        #[command(flatten)]
        serving: ServingArgs,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write a random-weight HF checkpoint of a covered family (config.json, generation_config.json,
    /// weights in one file or shards, tokenizer.json).
    #[command(
        after_help = "Examples:\n  metainfer synth --family qwen2 --out /tmp/tiny-qwen2\n  metainfer synth --preset stories15m --out /tmp/s15m\n  metainfer synth --family llama --tokenizer bytelevel --vocab 1000 --dtype bf16 --shards 2 --out /tmp/bl\n  metainfer synth --preset llama3.2-1b --shards 2 --out /tmp/llama-1b"
    )]
    Synth {
        /// Family: llama, mistral, qwen2, qwen3, gemma (llama with --preset), or any other model family
        /// of the CKB, written from its contract (a staged candidate counts).
        #[arg(long, value_name = "FAMILY")]
        family: Option<String>,
        /// A real model's shape: stories15m, stories42m or stories110m (the llama2.c TinyStories models),
        /// llama3.2-1b or qwen3-0.6b (bf16, byte-level tokenizer), qwen3-moe-mini, qwen3-moe-1b-active
        /// or gpt-oss-mini (mixtures of experts, bf16); the options below override its values.
        #[arg(long, value_name = "NAME")]
        preset: Option<String>,
        /// Directory to create (must not exist, or be empty).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Seed of the random weights.
        #[arg(long, default_value_t = 0, value_name = "N")]
        seed: u64,
        /// hidden_size.
        #[arg(long, value_name = "N")]
        hidden: Option<usize>,
        /// num_hidden_layers.
        #[arg(long, value_name = "N")]
        layers: Option<usize>,
        /// num_attention_heads.
        #[arg(long, value_name = "N")]
        heads: Option<usize>,
        /// num_key_value_heads.
        #[arg(long = "kv-heads", value_name = "N")]
        kv_heads: Option<usize>,
        /// head_dim (default hidden / heads).
        #[arg(long = "head-dim", value_name = "N")]
        head_dim: Option<usize>,
        /// vocab_size.
        #[arg(long, value_name = "N")]
        vocab: Option<usize>,
        /// intermediate_size.
        #[arg(long, value_name = "N")]
        intermediate: Option<usize>,
        /// max_position_embeddings.
        #[arg(long = "max-seq", value_name = "N")]
        max_seq: Option<usize>,
        /// sliding_window (mistral).
        #[arg(long = "sliding-window", value_name = "N")]
        sliding_window: Option<usize>,
        /// Mixture of experts: the expert count (num_local_experts).
        #[arg(long, value_name = "N")]
        experts: Option<usize>,
        /// Mixture of experts: experts per token (num_experts_per_tok).
        #[arg(long = "experts-per-token", value_name = "N")]
        experts_per_token: Option<usize>,
        /// Mixture of experts: one expert's width where the family gives it apart (qwen3_moe's
        /// moe_intermediate_size).
        #[arg(long = "expert-intermediate", value_name = "N")]
        expert_intermediate: Option<usize>,
        /// Stored weight dtype: f32, bf16 or f16 (default the preset's, else f32).
        #[arg(long, value_name = "DTYPE")]
        dtype: Option<String>,
        /// Weight files: N > 1 writes N shards and model.safetensors.index.json.
        #[arg(long, value_name = "N")]
        shards: Option<usize>,
        /// Tokenizer: spm (SentencePiece-style) or bytelevel (a trained byte-level BPE with special tokens).
        #[arg(long, value_name = "KIND")]
        tokenizer: Option<String>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show or search contracts (tool lookup_contract).
    #[command(
        after_help = "Examples:\n  metainfer contract show kernel.rope\n  metainfer contract phase kernels\n  metainfer contract search rotary"
    )]
    Contract {
        #[command(subcommand)]
        action: ContractCmd,
    },
    /// The knowledge base itself: check, schema, propose, promote.
    #[command(after_help = "Example:\n  metainfer --ckb ./contracts ckb check")]
    Ckb {
        #[command(subcommand)]
        action: CkbCmd,
    },
    /// Write an engine crate for the constraints (tool scaffold_engine).
    #[command(after_help = "Example:\n  metainfer scaffold --model ../shared/models/babyllama-105 --out myengine")]
    Scaffold {
        /// Hugging Face model directory (config.json, model.safetensors, tokenizer.json).
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// Directory to create the engine crate in (empty or new).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Target platform: a platform contract's target.
        #[arg(long, default_value = "cpu", value_name = "TARGET")]
        target: String,
        /// Weight dtype: f32, bf16, f16 or int8.
        #[arg(long, default_value = "f32", value_name = "DTYPE")]
        dtype: String,
        /// Platform contract id where the target has several (cuda: platform.cuda-sm90 or platform.cuda-sm80).
        #[arg(long, value_name = "ID")]
        platform: Option<String>,
        /// Crate name (default: the directory's name).
        #[arg(long, value_name = "NAME")]
        name: Option<String>,
        /// Overwrite the scaffold's files in a non-empty directory (replaces code you wrote there).
        #[arg(long)]
        force: bool,
        /// Reference level: what the agent may read besides the CKB.
        #[arg(long, value_enum, default_value = "zero")]
        reference_level: LevelArg,
        #[command(flatten)]
        serving: ServingArgs,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Build the engine with structured diagnostics (tool compile_engine).
    #[command(after_help = "Example:\n  metainfer compile --engine myengine")]
    Compile {
        /// Engine crate directory.
        #[arg(long, value_name = "DIR")]
        engine: PathBuf,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Test kernels against the oracle (tool run_kernel_test).
    #[command(
        after_help = "Examples:\n  metainfer test-kernel --engine myengine\n  metainfer test-kernel --engine myengine --kernel rope --seed 42"
    )]
    TestKernel {
        /// Engine crate directory.
        #[arg(long, value_name = "DIR")]
        engine: PathBuf,
        /// Kernel contract id (`kernel.rope`, or `rope`); repeat for several; none: every kernel of the plan.
        #[arg(long = "kernel", value_name = "ID")]
        kernels: Vec<String>,
        /// Replay a run: the seed a report gave (below 2^53).
        #[arg(long, value_name = "N")]
        seed: Option<u64>,
        /// Weight dtype to build the engine for: f32, bf16, f16 or int8 (default: the engine's own, metainfer.toml).
        #[arg(long, value_name = "DTYPE")]
        dtype: Option<String>,
        /// Do not run here: build the harness, draw the inputs and write them as a bundle to DIR, to run
        /// with `metainfer bundle run DIR` on the machine with the device.
        #[arg(long, value_name = "DIR", conflicts_with = "from_bundle")]
        write_bundle: Option<PathBuf>,
        /// Judge and record a bundle this command wrote and `metainfer bundle run` ran elsewhere.
        #[arg(long, value_name = "DIR")]
        from_bundle: Option<PathBuf>,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Verify generation on a real checkpoint (tool verify_generation).
    #[command(
        after_help = "Example:\n  metainfer verify --engine myengine --model ../shared/models/babyllama-105 --prompt \"Once upon a time\""
    )]
    Verify {
        /// Engine crate directory.
        #[arg(long, value_name = "DIR")]
        engine: PathBuf,
        /// Hugging Face model directory (config.json, model.safetensors, tokenizer.json).
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// Prompt; repeat for several (three random prompts are always added, the last generated to
        /// the end of the context).
        #[arg(long = "prompt", value_name = "TEXT")]
        prompts: Vec<String>,
        /// Tokens to generate per prompt, 1..=4096 (default 32).
        #[arg(long, value_name = "N")]
        max_new_tokens: Option<usize>,
        /// Replay the random prompts of a run: the seed a report gave (below 2^53).
        #[arg(long, value_name = "N")]
        seed: Option<u64>,
        /// Weight dtype to build the engine for: f32, bf16, f16 or int8 (default: the engine's own, metainfer.toml).
        #[arg(long, value_name = "DTYPE")]
        dtype: Option<String>,
        /// Whole logits rows at the first 8 steps, every Nth and the last; the 16 largest elsewhere
        /// (default: every row, unless they would exceed 24 MiB).
        #[arg(long, value_name = "N")]
        logits_every: Option<usize>,
        /// Do not run here: build the harness, draw the inputs and write them as a bundle to DIR, to run
        /// with `metainfer bundle run DIR` on the machine with the device.
        #[arg(long, value_name = "DIR", conflicts_with = "from_bundle")]
        write_bundle: Option<PathBuf>,
        /// Judge and record a bundle this command wrote and `metainfer bundle run` ran elsewhere.
        #[arg(long, value_name = "DIR")]
        from_bundle: Option<PathBuf>,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Verify the block manager and the batched step of a serving engine (tool verify_batching).
    #[command(
        after_help = "Example:\n  metainfer verify-batching --engine myengine --model ../shared/models/babyllama-105"
    )]
    VerifyBatching {
        /// Engine crate directory (its metainfer.toml has a [serving] table).
        #[arg(long, value_name = "DIR")]
        engine: PathBuf,
        /// Hugging Face model directory (config.json, model.safetensors).
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// Sequences in the batched run, 1..=32 (default 6).
        #[arg(long, value_name = "N")]
        sequences: Option<usize>,
        /// Replay a run: the seed a report gave (below 2^53).
        #[arg(long, value_name = "N")]
        seed: Option<u64>,
        /// Weight dtype to build the engine for (default: the engine's own).
        #[arg(long, value_name = "DTYPE")]
        dtype: Option<String>,
        /// Do not run here: build the harness, draw the operations, trace and schedule and write them
        /// as a bundle to DIR, to run with `metainfer bundle run DIR` on the machine with the device.
        #[arg(long, value_name = "DIR", conflicts_with = "from_bundle")]
        write_bundle: Option<PathBuf>,
        /// Judge and record a bundle this command wrote and `metainfer bundle run` ran elsewhere.
        #[arg(long, value_name = "DIR")]
        from_bundle: Option<PathBuf>,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Serve a serving engine's binary and test it: conformance battery and load (tool serve_engine).
    #[command(
        after_help = "Example:\n  metainfer load-test --engine myengine --model ../shared/models/babyllama-105 --concurrency 1,4,16"
    )]
    LoadTest {
        /// Engine crate directory (its metainfer.toml has a [serving] table; it has a binary with `serve`).
        #[arg(long, value_name = "DIR")]
        engine: PathBuf,
        /// Hugging Face model directory (config.json, model.safetensors).
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// Concurrency levels of the load test, each 1..=64 (default 1,4,16).
        #[arg(long, value_name = "N,N,...", value_delimiter = ',')]
        concurrency: Option<Vec<usize>>,
        /// Requests per level (default twice its concurrency).
        #[arg(long, value_name = "N")]
        requests: Option<usize>,
        /// New tokens per load-test request, 1..=256 (default 16).
        #[arg(long, value_name = "N")]
        max_tokens: Option<usize>,
        /// Replay a run: the seed a report gave (below 2^53).
        #[arg(long, value_name = "N")]
        seed: Option<u64>,
        /// Weight dtype to build the engine for (default: the engine's own).
        #[arg(long, value_name = "DTYPE")]
        dtype: Option<String>,
        /// Do not serve here: build the engine's binary, draw every request and write them as a bundle
        /// to DIR, to run with `metainfer bundle run DIR` on the machine with the device.
        #[arg(long, value_name = "DIR", conflicts_with = "from_bundle")]
        write_bundle: Option<PathBuf>,
        /// Judge and record a bundle this command wrote and `metainfer bundle run` ran elsewhere.
        #[arg(long, value_name = "DIR")]
        from_bundle: Option<PathBuf>,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Check the zero-reference and anti-fake rules (tool check_rules).
    #[command(after_help = "Example:\n  metainfer check-rules --engine myengine")]
    CheckRules {
        /// Engine crate directory.
        #[arg(long, value_name = "DIR")]
        engine: PathBuf,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Run a bundle written by a gate's --write-bundle, on the machine that has the device.
    #[command(
        after_help = "Example (on the device machine):\n  metainfer bundle run kt-bundle --key ~/runner/runner.key\n  metainfer bundle run verify-1b --model /data/llama-1b\nand here, once: metainfer bundle trust runner.pub --name gpu-box"
    )]
    Bundle {
        #[command(subcommand)]
        action: BundleCmd,
    },
    /// Registered reference code (other frameworks): only fingerprints are stored.
    #[command(after_help = "Example:\n  metainfer reference add ~/src/llama2.c --name llama2c")]
    Reference {
        #[command(subcommand)]
        action: ReferenceCmd,
    },
    /// Measure tokens/s (tool profile_engine).
    #[command(
        after_help = "Example:\n  metainfer profile --engine myengine --model ../shared/models/babyllama-105 --threads 2"
    )]
    Profile {
        /// Engine crate directory.
        #[arg(long, value_name = "DIR")]
        engine: PathBuf,
        /// Hugging Face model directory (config.json, model.safetensors, tokenizer.json).
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// Timed runs; medians, minima and maxima are over these (default 5).
        #[arg(long, value_name = "N")]
        runs: Option<usize>,
        /// Prompt length in tokens for the prefill measurement (default 32).
        #[arg(long, value_name = "N")]
        prompt_len: Option<usize>,
        /// Tokens decoded per run (default 64).
        #[arg(long, value_name = "N")]
        new_tokens: Option<usize>,
        /// Threads the engine may use (RAYON_NUM_THREADS in the harness; default 1).
        #[arg(long, value_name = "N")]
        threads: Option<usize>,
        /// Weight dtype to build the engine for: f32, bf16, f16 or int8 (default: the engine's own, metainfer.toml).
        #[arg(long, value_name = "DTYPE")]
        dtype: Option<String>,
        /// Do not run here: build the harness, draw the inputs and write them as a bundle to DIR, to run
        /// with `metainfer bundle run DIR` on the machine with the device.
        #[arg(long, value_name = "DIR", conflicts_with = "from_bundle")]
        write_bundle: Option<PathBuf>,
        /// Judge and record a bundle this command wrote and `metainfer bundle run` ran elsewhere.
        #[arg(long, value_name = "DIR")]
        from_bundle: Option<PathBuf>,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// List recorded outcomes, newest first (tool list_outcomes); export or import them.
    #[command(
        after_help = "Examples:\n  metainfer ledger --tool run_kernel_test --limit 5\n  metainfer ledger export --out outcomes.jsonl"
    )]
    Ledger {
        #[command(subcommand)]
        action: Option<LedgerCmd>,
        /// Outcomes per page, 1..=100.
        #[arg(long, default_value_t = 20, value_name = "N")]
        limit: usize,
        /// The `next_cursor` of the previous page.
        #[arg(long, value_name = "CURSOR")]
        cursor: Option<String>,
        /// Only outcomes of this tool, e.g. run_kernel_test.
        #[arg(long, value_name = "TOOL")]
        tool: Option<String>,
        /// Only outcomes of engines whose directory contains this text.
        #[arg(long, value_name = "TEXT")]
        engine: Option<String>,
        /// Only outcomes under this contract id or prefix, e.g. kernel.rope or kernel.
        #[arg(long, value_name = "ID")]
        contract: Option<String>,
        /// Only outcomes at or after this UTC time, e.g. 2026-12-01T00:00:00Z.
        #[arg(long, value_name = "TIME")]
        since: Option<String>,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Stage candidate failure modes from recurring unexplained failures (tool evolve_knowledge).
    #[command(after_help = "Example:\n  metainfer evolve --min-cluster 3")]
    Evolve {
        /// Fewest failures in a cluster (default 3).
        #[arg(long, value_name = "N")]
        min_cluster: Option<usize>,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Probe this machine (tool probe_machine): read bandwidth at L1/L2/L3/DRAM working sets and peak
    /// f32 FLOP/s on 1..N threads (min/median/max); cached in the ledger per CPU model and core count.
    #[command(after_help = "Example:\n  metainfer machine --refresh --runs 3")]
    Machine {
        /// Measure again even when a cached probe exists.
        #[arg(long)]
        refresh: bool,
        /// Runs per figure, 1..=50.
        #[arg(long, default_value_t = 5, value_name = "N")]
        runs: usize,
        /// Print the probe as JSON.
        #[arg(long)]
        json: bool,
    },
    /// What the ledger says about the knowledge base (tool ckb_report).
    #[command(
        after_help = "Examples:\n  metainfer report --prefix kernel.\n  metainfer report --section engines --cursor <next cursor>"
    )]
    Report {
        /// Only contracts whose id starts with this, e.g. `kernel.`.
        #[arg(long, value_name = "PREFIX")]
        prefix: Option<String>,
        /// Page through one section: contracts, engines or coverage.
        #[arg(long, value_name = "SECTION")]
        section: Option<String>,
        /// The section's previous next cursor (with --section).
        #[arg(long, value_name = "CURSOR")]
        cursor: Option<String>,
        /// Rows per section page, 1..=500.
        #[arg(long, value_name = "N")]
        limit: Option<usize>,
        /// Only outcomes of engines whose directory contains this text.
        #[arg(long, value_name = "TEXT")]
        engine: Option<String>,
        /// Only outcomes at or after this UTC time, e.g. 2026-12-01T00:00:00Z.
        #[arg(long, value_name = "TIME")]
        since: Option<String>,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write the skills as <folder>/<name>/SKILL.md for a client (Agent Skills layout).
    #[command(
        after_help = "Examples:\n  metainfer install-skills --client codex\n  metainfer install-skills --dir ~/.claude/skills"
    )]
    InstallSkills {
        /// Client whose project skills folder to write: claude (.claude/skills), codex (.agents/skills),
        /// gemini (.gemini/skills), cursor (.cursor/skills).
        #[arg(long, value_enum, default_value = "claude")]
        client: ClientArg,
        /// Write into this folder instead of the client's.
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
        /// Overwrite skill files that differ from the shipped ones (edited by you, or older).
        #[arg(long)]
        force: bool,
    },
    /// Check the setup an agent client sees: its config entry, the binary it starts, the workspace
    /// and model directories, cargo in the environment the client passes, and the server answering
    /// MCP with its tools, started as the client starts it; each failure with its fix.
    #[command(
        after_help = "Examples:\n  metainfer doctor --client claude\n  metainfer doctor --client codex --dir ~/myproject"
    )]
    Doctor {
        /// Client whose config to check: claude, codex, gemini, cursor, vscode.
        #[arg(long, value_enum, default_value = "claude")]
        client: ClientArg,
        /// Project directory (default: the current directory).
        #[arg(long, value_name = "DIR", default_value = ".")]
        dir: PathBuf,
        /// Entry name (default: the one `register` writes: `metainfer`, or `metainfer-<project>` for Codex).
        #[arg(long, value_name = "NAME")]
        name: Option<String>,
        /// Print the findings as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Register the server in an agent client's config, with every server option given (merged:
    /// other servers, settings, comments and key order are kept).
    #[command(after_help = "Examples:\n  metainfer register --client claude --model-dir ../shared/models\n  \
        metainfer register --client codex --model-dir ~/models --time-limit 1800\n  \
        metainfer register --client gemini --print")]
    Register {
        /// The client.
        #[arg(long, value_enum)]
        client: ClientArg,
        /// Print the merged config instead of writing it.
        #[arg(long)]
        print: bool,
        /// Project directory (the workspace the server is confined to).
        #[arg(long, default_value = ".", value_name = "DIR")]
        dir: PathBuf,
        /// Entry name (default: metainfer; for Codex, whose config is user-wide, metainfer-<project>).
        #[arg(long, value_name = "NAME")]
        name: Option<String>,
        /// Replace the command, arguments and environment of an existing entry of that name (its other
        /// keys are kept).
        #[arg(long)]
        replace: bool,
        #[command(flatten)]
        serve: ServeArgs,
    },
    /// Run the whole loop over MCP on a real model and print the steps and the generated text.
    #[command(
        after_help = "Examples:\n  metainfer demo\n  metainfer demo --model ~/models/babyllama-105 --keep /tmp/demo"
    )]
    Demo {
        /// Model directory (default: $METAINFER_MODEL, else the BabyLlama-105 checkpoint built into
        /// this binary, written into the demo's workspace).
        #[arg(long, value_name = "DIR")]
        model: Option<PathBuf>,
        /// Keep the workspace (scaffolded engine, the embedded model's copy, and the demo's own ledger
        /// unless --ledger or $METAINFER_LEDGER names another) in this directory.
        #[arg(long, value_name = "DIR")]
        keep: Option<PathBuf>,
        /// Tokens to generate (103 reproduces the golden continuation of "Once upon a time").
        #[arg(long, default_value_t = 103, value_name = "N")]
        max_new_tokens: usize,
    },
    /// Benchmark: the example engine (each weight dtype) against candle (feature candle-oracle) on
    /// BabyLlama and the stories15M shape at 1 and 2 threads, alternating; roofline fractions; the
    /// agent loop's speed and the server's overhead over raw cargo; with --serving, the load test.
    #[command(
        after_help = "Example:\n  metainfer bench --reps 3 --threads 1\n  metainfer bench --no-agent-loop --serving"
    )]
    Bench {
        /// Alternating repetitions per configuration (medians are over these).
        #[arg(long, default_value_t = 5, value_name = "N")]
        reps: usize,
        /// Thread counts; repeat for several.
        #[arg(long = "threads", default_values_t = vec![1usize, 2], value_name = "N")]
        threads: Vec<usize>,
        /// Prompt tokens before the timed decode.
        #[arg(long, default_value_t = 32, value_name = "N")]
        prompt_len: usize,
        /// Decoded tokens per run.
        #[arg(long, default_value_t = 128, value_name = "N")]
        new_tokens: usize,
        /// Skip the agent-loop timings.
        #[arg(long)]
        no_agent_loop: bool,
        /// Also run serve_engine's load test of the example engine on the stories15M shape at
        /// concurrency 1, 4 and 16 (64 new tokens per request; every answer checked).
        #[arg(long)]
        serving: bool,
        /// llama.cpp's `llama-bench` executable: run it as a peer on the stories15M shape,
        /// alternating with the engine, on the GGUFs given by --gguf.
        #[arg(long, value_name = "PATH", requires = "gguf")]
        llama_bench: Option<PathBuf>,
        /// A GGUF of the stories15M shape for --llama-bench, beside the engine dtype it compares
        /// with: `f32=FILE` (an F32 GGUF) or `int8=FILE` (a Q8_0 GGUF); repeat for both.
        #[arg(long, value_name = "DTYPE=FILE", requires = "llama_bench")]
        gguf: Vec<String>,
        /// Print the measurements as JSON.
        #[arg(long)]
        json: bool,
    },
    /// One candle decode run for `bench` (prints seconds per token); needs feature candle-oracle.
    #[command(hide = true)]
    BenchPeer { model: PathBuf, prompt_len: usize, new_tokens: usize },
    /// Benchmark the f64 reference forward pass that verify_generation runs: peak memory and seconds
    /// per token on a checkpoint (e.g. `synth --preset llama3.2-1b`), in this process alone.
    #[command(after_help = "Example:\n  metainfer bench-reference --model /tmp/llama-1b --dtype bf16 --tokens 4")]
    BenchReference {
        /// Hugging Face model directory (single or sharded weights).
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// Weight dtype the reference rounds to, as verify at that dtype.
        #[arg(long, default_value = "f32", value_name = "DTYPE")]
        dtype: String,
        /// Tokens to step.
        #[arg(long, default_value_t = 4, value_name = "N")]
        tokens: usize,
        /// Print the measurements as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Serving constraints of plan and scaffold: given `--max-seqs`, the engine serves several
/// sequences at once (paged KV cache, scheduler, OpenAI-compatible server).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Serving constraints")]
pub struct ServingArgs {
    /// Most sequences running at once (turns serving on; needs --max-context).
    #[arg(long, value_name = "N", requires = "max_context")]
    pub max_seqs: Option<usize>,
    /// Most tokens of one sequence, prompt and output together.
    #[arg(long, value_name = "N", requires = "max_seqs")]
    pub max_context: Option<usize>,
    /// Positions per KV-cache block.
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub block_size: usize,
    /// KV-cache blocks in the pool (default: enough for max-seqs full contexts).
    #[arg(long, value_name = "N")]
    pub kv_blocks: Option<usize>,
    /// Most tokens per batched step (default 256).
    #[arg(long, value_name = "N")]
    pub max_batch_tokens: Option<usize>,
    /// Requests may sample (temperature, top-k, top-p, min-p, penalties); without it, greedy only.
    #[arg(long)]
    pub sampling: bool,
}
