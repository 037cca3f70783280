//! The subcommands of the command groups (`contract`, `ledger`, `reference`, `bundle`, `ckb`): argument
//! types only (clap derive), each group one enum.

use std::path::PathBuf;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum ContractCmd {
    /// Show contracts whole (TOML); several ids are each shown once.
    #[command(after_help = "Example:\n  metainfer contract show kernel.rope kernel.rms_norm")]
    Show {
        /// Contract ids, e.g. kernel.rope.
        #[arg(required = true, value_name = "ID")]
        ids: Vec<String>,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show a build phase's contracts with their failure modes and requirements, each once.
    #[command(after_help = "Example:\n  metainfer contract phase decoder_layer --family model.qwen3 --dtype bf16")]
    Phase {
        /// kernels, weight_loading, decoder_layer, full_forward, generation or performance.
        #[arg(value_name = "PHASE")]
        phase: String,
        /// Model-family contract.
        #[arg(long, default_value = "model.llama", value_name = "ID")]
        family: String,
        /// Weight dtype: f32, bf16, f16 or int8.
        #[arg(long, default_value = "f32", value_name = "DTYPE")]
        dtype: String,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Search contracts by words (ids rank first).
    #[command(after_help = "Example:\n  metainfer contract search \"rotary half\"")]
    Search {
        /// Words, e.g. rotary half.
        #[arg(value_name = "TEXT")]
        text: String,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum LedgerCmd {
    /// Write every outcome, oldest first, as JSONL (to stdout, or --out FILE).
    #[command(after_help = "Example:\n  metainfer ledger export --out outcomes.jsonl")]
    Export {
        /// File to write (atomically).
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// Merge outcomes from a JSONL export; outcomes already present (same id) are skipped.
    #[command(after_help = "Example:\n  metainfer ledger import outcomes.jsonl")]
    Import {
        /// A file written by `ledger export`.
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
}

#[derive(Subcommand)]
pub enum ReferenceCmd {
    /// Fingerprint a source tree (Rust, C/C++, CUDA, Python, Go) and register it under a name.
    #[command(after_help = "Example:\n  metainfer reference add ~/src/llama2.c --name llama2c")]
    Add {
        /// The source tree.
        #[arg(value_name = "DIR")]
        dir: PathBuf,
        /// Name to register it under (default: the directory name).
        #[arg(long, value_name = "NAME")]
        name: Option<String>,
    },
    /// List registered references.
    #[command(after_help = "Example:\n  metainfer reference list")]
    List,
}

#[derive(Subcommand)]
pub enum BundleCmd {
    /// Run every request of the bundle in DIR here; the replies stay in DIR.
    #[command(
        after_help = "Examples:\n  metainfer bundle run kt-bundle --key ~/runner/runner.key\n  metainfer bundle run verify-1b --model /data/llama-1b"
    )]
    Run {
        /// The bundle directory.
        #[arg(value_name = "DIR")]
        dir: PathBuf,
        /// The model directory here, when the bundle does not include its model.
        #[arg(long, value_name = "DIR")]
        model: Option<PathBuf>,
        /// A runner's secret key (`bundle keygen`): sign the run, so that a server trusting the key
        /// counts its verdicts as evidence.
        #[arg(long, value_name = "FILE")]
        key: Option<PathBuf>,
        /// Print exactly the structured result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Make a runner key pair in DIR: runner.key (secret, mode 0600: keep it where the device is,
    /// out of the agent's reach) and runner.pub (give it to `bundle trust`).
    #[command(after_help = "Example:\n  metainfer bundle keygen --out ~/runner")]
    Keygen {
        /// The directory to write the two files into (created if needed).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
    /// Trust a runner's public key: bundle runs it signs (`bundle run --key`) count as evidence
    /// in this ledger; unsigned ones are recorded as unattested.
    #[command(after_help = "Example:\n  metainfer bundle trust runner.pub --name gpu-box")]
    Trust {
        /// The public key: runner.pub, or its 64 hex digits.
        #[arg(value_name = "KEY")]
        key: String,
        /// The name outcomes record for the runner.
        #[arg(long)]
        name: String,
    },
    /// List the trusted runners of this ledger.
    #[command(after_help = "Example:\n  metainfer bundle runners")]
    Runners,
}

#[derive(Subcommand)]
pub enum CkbCmd {
    /// Validate every contract file against the schema and the lint; list findings.
    #[command(after_help = "Example:\n  metainfer --ckb ./contracts ckb check")]
    Check {
        /// Print exactly the structured result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print the JSON Schema of a contract file.
    #[command(after_help = "Example:\n  metainfer ckb schema > contract.schema.json")]
    Schema,
    /// Check family contracts against an independent implementation's numbers: each DIR holds a
    /// checkpoint, config.json and vectors.json (logits at every prompt position, greedy ids). Each
    /// covered check is recorded in the ledger; a staged family that passes is promoted.
    #[command(
        after_help = "Example (every folder, the trailing slash matching folders only):\n  metainfer ckb conformance ../shared/conformance/*/"
    )]
    Conformance {
        /// Conformance directories (config.json, model.safetensors, vectors.json).
        #[arg(value_name = "DIR", required = true)]
        dirs: Vec<PathBuf>,
        /// Print exactly the structured result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Weaker evidence for a family from trained weights you hold: the family's reference scores a
    /// text (default: a built-in passage) on the checkpoint, and must predict it far better than
    /// uniform and no worse than any of its own mutants. Recorded in the ledger; a staged family
    /// that passes is promoted only with --consent.
    #[command(after_help = "Example:\n  metainfer ckb perplexity ../shared/models/babyllama-105")]
    Perplexity {
        /// Checkpoint directory with trained weights and tokenizer.json.
        #[arg(value_name = "DIR")]
        model: PathBuf,
        /// A UTF-8 text file to score instead of the built-in passage.
        #[arg(long, value_name = "FILE")]
        text: Option<PathBuf>,
        /// Tokens scored at most (default and largest 512).
        #[arg(long, value_name = "N")]
        max_tokens: Option<usize>,
        /// The user consents to promoting a staged family on this weaker evidence.
        #[arg(long)]
        consent: bool,
        /// Print exactly the structured result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Validate a new or amended contract file and stage it as a candidate (tool propose_contract).
    #[command(after_help = "Example:\n  metainfer --ckb ./contracts ckb propose gemma3.toml")]
    Propose {
        /// The contract file (TOML).
        #[arg(value_name = "FILE")]
        file: PathBuf,
        /// Print exactly the tool's structured output as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Move a staged candidate into the CKB working copy (--ckb DIR): needs evidence in the ledger, or --force.
    #[command(after_help = "Example:\n  metainfer --ckb ./contracts ckb promote model.gemma3")]
    Promote {
        /// Contract id of the staged candidate.
        #[arg(value_name = "ID")]
        id: String,
        /// Promote without evidence (a person's decision).
        #[arg(long)]
        force: bool,
    },
}
