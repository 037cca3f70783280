//! `metainfer bundle run DIR`: run a bundle written by a gate (`write_bundle`) on the machine that
//! has the device, outside any server: check it, run its harness requests in order (or, for
//! serve_engine, start its server and send its plan: `serve::run_bundle`), and leave the replies
//! in the bundle for the gate to judge (`from_bundle`). Nothing is recorded here, and nothing is
//! judged against a reference: expected values never reach this machine (serve_engine's checks
//! of the server's own behaviour, which need none, are decided where the server runs).

use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Report;
use base::error::Result;
use harness::protocol::Reply;
use harness::{Budget, bundle};

/// What to run.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BundleRunRequest {
    /// The bundle directory.
    pub dir: String,
    /// The model directory on this machine, when the bundle does not include its model (checked
    /// against the bundle's hash of it).
    #[serde(default)]
    pub model: Option<String>,
    /// A runner's secret key file (`metainfer bundle keygen`): the run is then signed
    /// (`attestation.json`), and a server that trusts the key counts its verdict as evidence.
    #[serde(default)]
    pub key: Option<String>,
}

/// One request's run.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct RequestRun {
    /// Request file name.
    pub request: String,
    /// How the process ended: `exited` (with `code`), `timed_out`, `cancelled`, `output_limit`; for
    /// a serve_engine plan, `exited` or `server_failed` (then `no_device` says why).
    pub outcome: String,
    /// Exit status (-1 when killed by a signal or not exited).
    pub code: i64,
    /// Wall time, seconds.
    pub seconds: f64,
    /// The harness's reply kind (`kernel`, `generate`, `tokenize`, `profile`, `time`, `block_manager`,
    /// `batch`, `no_device`; `serve` for a serve_engine plan), "" when none or unreadable.
    pub reply: String,
    /// Why it did not run on a device, when the harness replied `no_device`; for a serve_engine
    /// plan, what stopped the server.
    pub no_device: String,
}

/// What `bundle run` did.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct BundleRunReport {
    /// Whether every request ran to a reply on its device (a `no_device` reply does not count).
    pub passed: bool,
    /// The bundle directory.
    pub dir: String,
    /// The gate that wrote it, to read it back with.
    pub tool: String,
    /// Per request, in order.
    pub runs: Vec<RequestRun>,
    /// The public key (hex) of the runner that signed the run, "" when it was not signed.
    pub signed_by: String,
}

impl Report for BundleRunReport {
    fn passed(&self) -> bool {
        self.passed
    }
    fn text(&self) -> String {
        let mut s = format!(
            "bundle {} {}: {} request(s) of {}; read it back with {} from_bundle = {}\n",
            self.dir,
            if self.passed { "RAN" } else { "FAILED" },
            self.runs.len(),
            self.tool,
            self.tool,
            self.dir
        );
        s += &if self.signed_by.is_empty() {
            "  not signed: a verdict judged from it is unattested evidence (run it with --key, a runner key the server trusts, for evidence)\n".to_string()
        } else {
            format!("  signed by runner key {}\n", self.signed_by)
        };
        for r in &self.runs {
            s += &format!(
                "  {} {} (code {}) in {:.2} s, reply {}{}\n",
                r.request,
                r.outcome,
                r.code,
                r.seconds,
                if r.reply.is_empty() { "none" } else { &r.reply },
                match (r.no_device.is_empty(), r.reply == "serve") {
                    (true, _) => String::new(),
                    (false, true) => format!(": {}", r.no_device),
                    (false, false) => format!(": no CUDA device: {}", r.no_device),
                }
            );
        }
        s
    }
}

/// Run a bundle here.
///
/// # Errors
/// A malformed bundle, a swapped harness, a missing or different model, or a process that cannot
/// be started. A request that fails is a report (`passed: false`).
pub fn run(req: &BundleRunRequest, budget: &Budget) -> Result<BundleRunReport> {
    let dir = Path::new(&req.dir);
    let key = req.key.as_deref().map(|k| harness::attest::read_secret(Path::new(k))).transpose()?;
    let (opened, manifest) = bundle::open(dir, req.model.as_deref().map(Path::new))?;
    if manifest.tool == super::gate::Tool::Serve.name() {
        // The engine's own server and the plan of what its client sends, not harness requests.
        let workshop = harness::Workshop::default_location();
        let tool = manifest.tool.clone();
        let ran = super::serve::run_bundle(&workshop, &opened, manifest, key.as_ref(), budget)?;
        let failed = !ran.error.is_empty();
        let run = RequestRun {
            request: bundle::PLAN.into(),
            outcome: if failed { "server_failed".into() } else { "exited".into() },
            code: if failed { -1 } else { 0 },
            seconds: ran.seconds,
            reply: "serve".into(),
            no_device: ran.error,
        };
        return Ok(BundleRunReport {
            passed: !failed,
            dir: dir.display().to_string(),
            tool,
            runs: vec![run],
            signed_by: ran.signed_by,
        });
    }
    let ran = bundle::run_opened(&opened, manifest, key.as_ref(), budget)?;
    let mut runs = Vec::new();
    for (i, r) in ran.runs.iter().enumerate() {
        let (reply, no_device) = match bundle::called(&dir, i, None).map(|c| c.reply) {
            Ok(Ok(Reply::Kernel { .. })) => ("kernel", String::new()),
            Ok(Ok(Reply::Generate { .. })) => ("generate", String::new()),
            Ok(Ok(Reply::Profile(_))) => ("profile", String::new()),
            Ok(Ok(Reply::Time { .. })) => ("time", String::new()),
            Ok(Ok(Reply::Trace { .. })) => ("trace", String::new()),
            Ok(Ok(Reply::Tokenize { .. })) => ("tokenize", String::new()),
            Ok(Ok(Reply::BlockManager { .. })) => ("block_manager", String::new()),
            Ok(Ok(Reply::Batch { .. })) => ("batch", String::new()),
            Ok(Ok(Reply::Scheduler { .. })) => ("scheduler", String::new()),
            Ok(Ok(Reply::NoDevice { reason })) => ("no_device", reason),
            // No reply, or one that does not parse.
            Ok(Err(_)) | Err(_) => ("", String::new()),
        };
        runs.push(RequestRun {
            request: ran.manifest.requests[i].request.clone(),
            outcome: r.outcome.clone(),
            code: r.code.map(i64::from).unwrap_or(-1),
            seconds: r.seconds,
            reply: reply.into(),
            no_device,
        });
    }
    let passed = runs.len() == ran.manifest.requests.len()
        && runs.iter().all(|r| r.outcome == "exited" && r.code == 0 && !r.reply.is_empty() && r.no_device.is_empty());
    let signed_by = ran.attestation.map(|a| a.runner).unwrap_or_default();
    Ok(BundleRunReport { passed, dir: dir.display().to_string(), tool: ran.manifest.tool, runs, signed_by })
}
