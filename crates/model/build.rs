//! Embeds the demo's model (the workspace root's examples/models/babyllama-105) and the shipped
//! tokenizer test vectors (examples/tokenizers) into the crate. Writes `$OUT_DIR/embedded_data.rs`:
//! (relative path, bytes) pairs per folder.
use std::{env, fs, path::Path};

fn main() {
    let manifest = env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    // crates/model -> the workspace root.
    let root = Path::new(&manifest).join("../..");
    let data = Path::new(&env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("embedded_data.rs");
    let mut code = String::new();
    for (konst, folder) in
        [("BABYLLAMA", "examples/models/babyllama-105"), ("TOKENIZER_VECTORS", "examples/tokenizers")]
    {
        let dir = root.join(folder);
        println!("cargo:rerun-if-changed={}", dir.display());
        let mut files: Vec<_> = walkdir::WalkDir::new(&dir)
            .into_iter()
            .filter_map(Result::ok)
            .filter(|e| e.file_type().is_file())
            .map(|e| e.into_path())
            .collect();
        files.sort();
        code.push_str(&format!("/// Embedded `{folder}/` files: (path relative to `{folder}/`, bytes).\n"));
        code.push_str(&format!("pub static {konst}: &[(&str, &[u8])] = &[\n"));
        for f in files {
            let rel = f.strip_prefix(&dir).unwrap().to_string_lossy().replace('\\', "/");
            code.push_str(&format!("    ({rel:?}, include_bytes!({:?})),\n", f.display().to_string()));
        }
        code.push_str("];\n");
    }
    fs::write(data, code).expect("OUT_DIR is writable");
}
