//! metainfer: the toolbox with which coding agents build compact, custom LLM inference engines.
//!
//! An MCP server (and a CLI over the same operations) that holds the contract knowledge base (CKB),
//! scaffolds engine crates, and proves them with server-owned gates: kernel tests against f64
//! oracles, end-to-end generation against a reference forward pass on real checkpoints, and
//! profiling. Every outcome is recorded in a SQLite ledger. See ARCHITECTURE.md for the module map.

pub mod bench;
pub mod clients;
pub mod demo;
pub mod doctor;
pub mod guide;
pub mod mcp;
pub mod options;

// The layers below, each its own crate (crates/), re-exported under the names the modules above use.
pub use base::{beneath, error, stats, util};
pub use ckb;
pub use guard;
pub use harness;
pub use ledger;
pub use manifest;
pub use model;
pub use ops;
pub use oracle;
pub use probe;
