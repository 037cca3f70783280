//! The knowledge base: the shipped CKB is valid; each kind of broken contract is refused with the
//! file, the field and the reason.

use metainfer::ckb::{self, Ckb, Finding};

fn shipped() -> Vec<(String, String)> {
    ckb::embedded_files()
}

fn findings_after(file: &str, edit: impl Fn(&str) -> String) -> Vec<Finding> {
    let mut files = shipped();
    let f = files.iter_mut().find(|(p, _)| p == file).unwrap_or_else(|| panic!("{file} not shipped"));
    let new = edit(&f.1);
    assert_ne!(new, f.1, "the edit must change {file}");
    f.1 = new;
    Ckb::check_sources(files, "test".into()).1
}

#[test]
fn shipped_ckb_is_schema_valid_and_lint_clean() {
    let (c, findings) = Ckb::check_sources(shipped(), "embedded".into());
    assert_eq!(findings, vec![]);
    let c = c.unwrap();
    for id in [
        "kernel.embedding",
        "kernel.rms_norm",
        "kernel.rope",
        "kernel.linear",
        "kernel.silu_and_mul",
        "kernel.softmax",
        "kernel.attention",
        "kernel.argmax",
        "component.kv_cache",
        "component.sampler",
        "component.tokenizer",
        "component.weight_loading",
        "model.llama",
        "platform.cpu-x86_64",
    ] {
        c.get(id).unwrap_or_else(|e| panic!("{e}"));
    }
    for k in c.of_kind(ckb::Kind::Kernel) {
        assert!(metainfer::oracle::kernel_oracle_exists(&k.id), "{} has no oracle", k.id);
    }
}

#[test]
fn wrong_type_names_file_and_field() {
    let f = findings_after("kernels/rope.toml", |s| s.replacen("version = 1", "version = \"one\"", 1));
    assert!(f.iter().any(|f| f.file == "kernels/rope.toml" && f.field == "/version"), "{f:?}");
}

#[test]
fn unknown_field_is_refused() {
    let f = findings_after("kernels/argmax.toml", |s| format!("colour = \"blue\"\n{s}"));
    assert!(f.iter().any(|f| f.file == "kernels/argmax.toml" && f.message.contains("colour")), "{f:?}");
}

#[test]
fn dangling_reference_names_field() {
    let f = findings_after("kernels/softmax.toml", |s| {
        s.replacen("\"failure.softmax-no-max-subtraction\"", "\"failure.does-not-exist\"", 1)
    });
    assert!(
        f.iter().any(|f| f.file == "kernels/softmax.toml"
            && f.field == "/failure_modes"
            && f.message.contains("failure.does-not-exist")),
        "{f:?}"
    );
}

#[test]
fn id_must_match_kind_and_be_unique() {
    let f =
        findings_after("kernels/linear.toml", |s| s.replacen("id = \"kernel.linear\"", "id = \"component.linear\"", 1));
    assert!(f.iter().any(|f| f.file == "kernels/linear.toml" && f.field == "/id"), "{f:?}");
    let f =
        findings_after("kernels/linear.toml", |s| s.replacen("id = \"kernel.linear\"", "id = \"kernel.argmax\"", 1));
    assert!(f.iter().any(|f| f.message.contains("duplicate id")), "{f:?}");
}

#[test]
fn negative_tolerance_is_refused() {
    let f = findings_after("kernels/rms_norm.toml", |s| {
        let i = s.find("atol = ").unwrap();
        let end = s[i..].find('\n').unwrap() + i;
        format!("{}atol = -1.0{}", &s[..i], &s[end..])
    });
    assert!(f.iter().any(|f| f.field.starts_with("/tolerance/f32")), "{f:?}");
}

#[test]
fn cli_ckb_check_fails_on_a_broken_directory_and_server_refuses_to_start() {
    let t = tempfile::tempdir().unwrap();
    for (p, s) in shipped() {
        let path = t.path().join(&p);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, s).unwrap();
    }
    let ok = std::process::Command::new(crate::bin()).args(["ckb", "check", "--ckb"]).arg(t.path()).output().unwrap();
    assert_eq!(ok.status.code(), Some(0), "{}", String::from_utf8_lossy(&ok.stdout));

    std::fs::write(t.path().join("kernels/rope.toml"), "id = \"kernel.rope\"\nkind = \"kernel\"\n").unwrap();
    let out = std::process::Command::new(crate::bin()).args(["ckb", "check", "--ckb"]).arg(t.path()).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("kernels/rope.toml") && text.contains("version"), "{text}");

    let out = std::process::Command::new(crate::bin())
        .args(["serve", "--ckb"])
        .arg(t.path())
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("kernels/rope.toml"));
    assert!(out.stdout.is_empty(), "nothing but JSON-RPC may reach stdout");
}

#[test]
fn unknown_family_feature_is_refused_and_every_shipped_one_is_known() {
    // The reference forward pass would silently ignore a feature it does not implement.
    let f = findings_after("models/qwen3.toml", |s| {
        s.replacen("features = [\"qk_norm\"]", "features = [\"qk_norm\", \"qk_layernorm\"]", 1)
    });
    assert!(
        f.iter().any(|f| f.file == "models/qwen3.toml"
            && f.field == "/model/features/1"
            && f.message.contains("unknown feature `qk_layernorm`")
            && f.message.contains("fused_qkv")),
        "{f:?}"
    );
    let c = Ckb::embedded().unwrap();
    for m in c.of_kind(ckb::Kind::Model) {
        for feature in &m.model.as_ref().unwrap().features {
            assert!(ckb::FAMILY_FEATURES.iter().any(|(k, _)| k == feature), "{}: {feature}", m.id);
        }
    }
}
