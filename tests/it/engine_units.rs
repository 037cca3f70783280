//! The example engines' own unit tests (`cargo test` in the engine's crate: kernels against values
//! worked out by hand, the tokenizer and greedy decoding against BabyLlama's golden output), run on
//! a copy of each engine in the shared build cache, and shown to fail when a kernel is broken.

use std::path::Path;
use std::process::Command;

use crate::Engine;

/// `cargo test --release` of the engine crate at `dir`, into the gates' shared target directory (the
/// flags of the gates' builds, so compiled dependencies are shared); BabyLlama from the repository,
/// the conformance checkpoints from ../shared.
/// Returns (success, stdout + stderr).
fn cargo_test(dir: &Path) -> (bool, String) {
    let out = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        .args(["test", "--release", "--config", "profile.release.incremental=false", "--manifest-path"])
        .arg(dir.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(crate::cache().join("target"))
        .env("BABYLLAMA_DIR", Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/models/babyllama-105"))
        .env("CONFORMANCE_DIR", crate::shared().join("conformance"))
        .env_remove("RUSTFLAGS")
        .output()
        .expect("cargo runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// The number of passed tests cargo reports, summed over the test binaries.
fn passed(text: &str) -> usize {
    text.lines()
        .filter_map(|l| l.strip_prefix("test result: ")?.split("; ").next()?.split(' ').nth(1)?.parse::<usize>().ok())
        .sum()
}

#[test]
fn plain_engine_unit_tests_pass_and_catch_a_broken_kernel() {
    let t = tempfile::tempdir().unwrap();
    let engine = t.path().join("llama-cpu-plain");
    Engine::Plain.copy_to(&engine);
    let (ok, text) = cargo_test(&engine);
    assert!(ok, "{text}");
    // 16 kernel tests, 11 whole-engine tests and the KV pool's default size (src/kernels.rs,
    // src/tests.rs, src/paged.rs).
    assert_eq!(passed(&text), 28, "{text}");
    assert!(text.contains("every_family_equals_transformers_on_its_conformance_checkpoint ... ok"), "{text}");
    // RMSNorm without its gain: the hand-worked case names the kernel.
    crate::inject(
        &engine,
        "src/kernels.rs",
        "out[r * dim + i] = row[i] * inv * weight[i];",
        "out[r * dim + i] = row[i] * inv;",
    );
    let (ok, text) = cargo_test(&engine);
    assert!(!ok, "a RMSNorm without its weight passed the engine's own tests:\n{text}");
    assert!(text.contains("rms_norm_divides_by_the_root_mean_square_and_scales") && text.contains("FAILED"), "{text}");
}

#[test]
fn simd_engine_unit_tests_pass() {
    let t = tempfile::tempdir().unwrap();
    let engine = t.path().join("llama-cpu-simd");
    Engine::Simd.copy_to(&engine);
    let (ok, text) = cargo_test(&engine);
    assert!(ok, "{text}");
    // src/matmul.rs, kernels.rs, quant.rs, model.rs, pool.rs, paged.rs and batch.rs (4: the KV
    // budget's cgroup reading); the binary's server, feature `server`, is tested by serving.rs.
    assert_eq!(passed(&text), 28, "{text}");
}

/// The CUDA engine's own tests, here without a GPU: the batched step's host plan (rows, positions,
/// cache slots worked out by hand, bad chunks refused by name), which conformance checkpoints its
/// loader takes, bf16 rounding, stop tokens, and a missing driver reported as an error; its CUDA C
/// is compiled by NVRTC only where libnvrtc is present. A plan that ignores the position within a
/// block fails them.
#[test]
fn cuda_engine_unit_tests_pass_and_catch_a_broken_slot_plan() {
    let t = tempfile::tempdir().unwrap();
    let engine = t.path().join("llama-cuda-bf16");
    Engine::Cuda.copy_to(&engine);
    let (ok, text) = cargo_test(&engine);
    assert!(ok, "{text}");
    // src/batch.rs 2, device.rs 2, generate.rs 1, model.rs 2, paged.rs 1.
    assert_eq!(passed(&text), 8, "{text}");
    crate::inject(
        &engine,
        "src/batch.rs",
        "p.slot.push((c.block_table[at / bs] as usize * bs + at % bs) as u32);",
        "p.slot.push((c.block_table[at / bs] as usize * bs) as u32);",
    );
    let (ok, text) = cargo_test(&engine);
    assert!(!ok, "a plan writing every position of a block to its first slot passed:\n{text}");
    assert!(text.contains("plan_places_every_row_through_its_block_table") && text.contains("FAILED"), "{text}");
}
