//! Embeds the shipped knowledge (the workspace root's contracts/, skills/, prompts/, and the two
//! example engines: the SIMD one the demo builds, the plain one the skills name as the template) into
//! the crate, so that `metainfer serve` works from any directory. Writes `$OUT_DIR/embedded.rs`: a list
//! of (relative path, contents) pairs per folder.
use std::{env, fs, path::Path};

fn main() {
    let manifest = env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    // crates/ckb -> the workspace root.
    let root = Path::new(&manifest).join("../..");
    let out = Path::new(&env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("embedded.rs");
    let mut code = String::new();
    for (konst, folder, exts) in [
        ("CONTRACTS", "contracts", &["toml"][..]),
        ("SKILLS", "skills", &["md"][..]),
        ("PROMPTS", "prompts", &["toml"][..]),
        ("EXAMPLE_ENGINE", "examples/engines/llama-cpu-simd", &["toml", "rs"][..]),
        ("PLAIN_ENGINE", "examples/engines/llama-cpu-plain", &["toml", "rs"][..]),
    ] {
        let dir = root.join(folder);
        println!("cargo:rerun-if-changed={}", dir.display());
        let mut files: Vec<_> = walkdir::WalkDir::new(&dir)
            .into_iter()
            .filter_map(Result::ok)
            .filter(|e| e.file_type().is_file())
            .map(|e| e.into_path())
            .filter(|p| {
                p.extension().and_then(|e| e.to_str()).is_some_and(|e| exts.contains(&e))
                    // Candidates are staged knowledge, never shipped.
                    && !p.strip_prefix(&dir).unwrap().starts_with("candidates")
                    && !p.strip_prefix(&dir).unwrap().starts_with("target")
                    && p.file_name().is_some_and(|n| n != "Cargo.lock")
            })
            .collect();
        files.sort();
        code.push_str(&format!("/// Embedded `{folder}/` files: (path relative to `{folder}/`, contents).\n"));
        code.push_str(&format!("pub static {konst}: &[(&str, &str)] = &[\n"));
        for f in files {
            let rel = f.strip_prefix(&dir).unwrap().to_string_lossy().replace('\\', "/");
            code.push_str(&format!("    ({rel:?}, include_str!({:?})),\n", f.display().to_string()));
        }
        code.push_str("];\n");
    }
    fs::write(out, code).expect("OUT_DIR is writable");
}
