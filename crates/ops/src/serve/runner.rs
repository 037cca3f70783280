//! `metainfer bundle run DIR` for a serve_engine bundle, where the device is: start the bundle's
//! server binary on its model, send the bundle's plan, write what came back into the bundle
//! (`observed.<nonce>.json`) and sign the run when given a runner key. The checks that need no
//! reference (help, health, models, chat, bad requests, burst, disconnect, keep-alive) are decided
//! here, where the server runs; the answers that must equal the reference are only recorded: the
//! bundle holds no expected answer, and the judge reads them back where the reference is.

use std::path::Path;

use super::battery::observe;
use super::wire::Plan;
use base::error::{Context, Result};
use harness::{Budget, Workshop, bundle};

/// What a bundle run of serve_engine did.
#[derive(Debug, Clone)]
pub struct ServeRun {
    /// What stopped the server or the client ("" when the plan was sent to the end).
    pub error: String,
    /// Wall time of the run, seconds.
    pub seconds: f64,
    /// The public key (hex) of the runner that signed the run, "" when unsigned.
    pub signed_by: String,
}

/// Run the serve_engine bundle `dir` (checked by `harness::bundle::open`, which gave `manifest`)
/// with the server's processes in `workshop`'s scratch directory.
///
/// # Errors
/// [`base::error::ErrorKind::Usage`] when the plan is missing or does not parse; Internal when the
/// server cannot be started or the observations cannot be written. A server that fails is recorded,
/// not an error.
pub fn run_bundle(
    workshop: &Workshop,
    dir: &Path,
    manifest: bundle::BundleManifest,
    key: Option<&harness::attest::RunnerKey>,
    budget: &Budget,
) -> Result<ServeRun> {
    let plan_path = dir.join(bundle::PLAN);
    let bytes = base::util::read_regular(&plan_path, &base::util::HARNESS_REPLY)?;
    let plan: Plan = serde_json::from_slice(&bytes)
        .usage_ctx(|| format!("{}: not a serve_engine plan; write the bundle again", plan_path.display()))?;
    plan.check().map_err(|e| base::error::Error::usage(format!("{}: {}", plan_path.display(), e.message)))?;
    let out = dir.join(bundle::output_name(bundle::OBSERVED, &manifest.nonce));
    let _ = std::fs::remove_file(&out);
    let model = dir.join(bundle::MODEL);
    let reads: Vec<std::path::PathBuf> = match model.canonicalize() {
        Ok(real) if real != model => vec![model.clone(), real],
        _ => vec![model.clone()],
    };
    let scratch = workshop.scratch()?;
    let started = std::time::Instant::now();
    let seen = observe(workshop, &dir.join(bundle::HARNESS), &model, &reads, &plan, scratch.path(), budget)?;
    let text = serde_json::to_vec_pretty(&seen).internal_ctx(|| "serve_engine's observations".to_owned())?;
    base::util::write_atomic(&out, &text)?;
    let attestation = bundle::seal(dir, &manifest.nonce, key)?;
    Ok(ServeRun {
        error: seen.error,
        seconds: started.elapsed().as_secs_f64(),
        signed_by: attestation.map(|a| a.runner).unwrap_or_default(),
    })
}
