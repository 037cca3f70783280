//! The knowledge base: the shipped CKB is valid; each kind of broken contract is refused with the
//! file, the field and the reason.

use metainfer::ckb::{self, Ckb, Finding};

fn shipped() -> Vec<(String, String)> {
    ckb::embedded_files()
}

pub(crate) fn findings_after(file: &str, edit: impl Fn(&str) -> String) -> Vec<Finding> {
    let mut files = shipped();
    let f = files.iter_mut().find(|(p, _)| p == file).unwrap_or_else(|| panic!("{file} not shipped"));
    let new = edit(&f.1);
    assert_ne!(new, f.1, "the edit must change {file}");
    f.1 = new;
    Ckb::check_sources(files, "test".into(), None).1
}

#[test]
fn shipped_ckb_is_schema_valid_and_lint_clean() {
    let (c, findings) = Ckb::check_sources(shipped(), "embedded".into(), Some(&metainfer::oracle::implemented()));
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
    let f = findings_after("kernels/rope.toml", |s| s.replacen("version = 2", "version = \"one\"", 1));
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

/// The finding for `file` at `field`, asserting it is the only one there.
fn finding_at(findings: &[Finding], file: &str, field: &str) -> String {
    let at: Vec<&Finding> = findings.iter().filter(|f| f.file == file && f.field == field).collect();
    assert_eq!(at.len(), 1, "one finding at {file} {field}: {findings:?}");
    at[0].message.clone()
}

const SECOND_EPS: &str = "\n[[parameters]]\nname = \"eps\"\ndtype = \"f32\"\ndefault = \"1e-5\"\ndoc = \"Again.\"\n";

#[test]
fn parameter_stated_twice_with_different_defaults_is_refused() {
    let f = findings_after("kernels/rms_norm.toml", |s| format!("{s}{SECOND_EPS}"));
    assert_eq!(
        finding_at(&f, "kernels/rms_norm.toml", "/parameters/1/default"),
        "parameter `eps` is stated twice with different defaults: \"1e-6\" (/parameters/0) and \"1e-5\" (/parameters/1); keep one entry with the right value"
    );
    assert_eq!(f.len(), 1, "{f:?}");
    // The same number written differently is the same value; a different dtype is not.
    let f = findings_after("kernels/rms_norm.toml", |s| format!("{s}{}", SECOND_EPS.replace("1e-5", "0.000001")));
    assert_eq!(f, vec![]);
    let f = findings_after("kernels/rms_norm.toml", |s| {
        format!("{s}{}", SECOND_EPS.replace("1e-5", "1e-6").replace("f32", "f64"))
    });
    assert_eq!(
        finding_at(&f, "kernels/rms_norm.toml", "/parameters/1/dtype"),
        "parameter `eps` is stated twice with different dtypes: \"f32\" (/parameters/0) and \"f64\" (/parameters/1); keep one entry with the right dtype"
    );
}

#[test]
fn model_config_key_stated_twice_with_different_defaults_is_refused() {
    let f = findings_after("models/llama.toml", |s| {
        format!("{s}\n[[model.config]]\nkey = \"max_position_embeddings\"\nrole = \"max_seq\"\ndefault = \"4096\"\n")
    });
    assert_eq!(
        finding_at(&f, "models/llama.toml", "/model/config/13/default"),
        "config key `max_position_embeddings` is stated twice with different defaults: \"2048\" (/model/config/6) and \"4096\" (/model/config/13); keep one entry with the default of the HF configuration class"
    );
    assert_eq!(f.len(), 1, "{f:?}");
}

#[test]
fn model_config_default_outside_its_supported_values_is_refused() {
    let f = findings_after("models/llama.toml", |s| {
        s.replacen("default = \"silu\"\nsupported = [\"silu\"]", "default = \"gelu\"\nsupported = [\"silu\"]", 1)
    });
    assert_eq!(
        finding_at(&f, "models/llama.toml", "/model/config/12/default"),
        "config key `hidden_act` has default \"gelu\", which is not among its supported values [\"silu\"]; add it to `supported` or correct the default"
    );
    assert_eq!(f.len(), 1, "{f:?}");
}

#[test]
fn skip_invalid_leaves_out_a_broken_file_and_the_files_that_reference_it() {
    let mut files = shipped();
    let rope = files.iter_mut().find(|(p, _)| p == "kernels/rope.toml").unwrap();
    rope.1 = rope.1.replacen("version = 2", "version = \"two\"", 1);
    // Strict loading refuses, naming the file and the field.
    let e = Ckb::from_sources(files.clone(), "test".into()).unwrap_err();
    assert!(e.message.contains("kernels/rope.toml: field `/version`"), "{}", e.message);

    let c = Ckb::from_sources_skip_invalid(files, "test".into(), None).unwrap();
    let skipped: Vec<&str> = c.skipped().iter().map(|s| s.file.as_str()).collect();
    assert_eq!(skipped[0], "kernels/rope.toml", "the broken file comes first: {skipped:?}");
    assert!(c.skipped()[0].reason.starts_with("field `/version`: "), "{:?}", c.skipped()[0]);
    // Every family names kernel.rope; so do the KV cache and the two RoPE failure modes. Files that
    // reference those are left out in the next rounds.
    assert!(skipped.contains(&"failures/kv-cache-wrong-position.toml"), "{skipped:?}");
    for f in [
        "components/kv_cache.toml",
        "models/llama.toml",
        "models/gemma.toml",
        "models/mistral.toml",
        "models/qwen2.toml",
        "models/qwen3.toml",
        "failures/rope-adjacent-pairs.toml",
        "failures/rope-wrong-theta.toml",
    ] {
        let s = c.skipped().iter().find(|s| s.file == f).unwrap_or_else(|| panic!("{f} not skipped: {skipped:?}"));
        assert!(s.reason.contains("references `kernel.rope`, which was skipped with kernels/rope.toml"), "{s:?}");
    }
    assert!(c.get("kernel.rope").is_err() && c.get("model.llama").is_err());
    // Everything else loads, and what loaded is lint-clean.
    c.get("kernel.rms_norm").unwrap();
    c.get("platform.cpu-x86_64").unwrap();
    assert_eq!(c.all().count() + c.skipped().len(), shipped().len());
    assert_eq!(c.lint(), vec![]);
    assert!(c.coverage_report().contains("- skipped (invalid): kernels/rope.toml: field `/version`"));

    // A shipped CKB skips nothing.
    assert_eq!(
        Ckb::from_sources_skip_invalid(shipped(), "test".into(), Some(&metainfer::oracle::implemented()))
            .unwrap()
            .skipped(),
        &[]
    );
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

/// A kernel contract no oracle implements is refused alike at the server's load, at `ckb check`
/// and at propose_contract, naming the contract and the registry; so is a failure contract naming a
/// mutant that does not exist.
#[test]
fn a_kernel_without_an_oracle_is_refused_at_load_check_and_propose() {
    let t = tempfile::tempdir().unwrap();
    let wc = t.path().join("ckb");
    crate::evolve::working_copy(&wc);
    let argmax = std::fs::read_to_string(wc.join("kernels/argmax.toml")).unwrap();
    let orphan = argmax.replacen("id = \"kernel.argmax\"", "id = \"kernel.argmin\"", 1);
    assert_ne!(orphan, argmax);

    // propose_contract, against the built-in CKB.
    let ctx = crate::ctx(t.path());
    let r = metainfer::ops::evolve::propose(&ctx, &metainfer::ops::evolve::ProposeRequest { toml: orphan.clone() })
        .unwrap();
    assert!(
        !r.staged && r.findings.iter().any(|f| f.message.contains("no oracle implements `kernel.argmin`")),
        "{r:?}"
    );

    // ckb check and the server's own load (any subcommand), on a working copy holding it.
    std::fs::write(wc.join("kernels/argmin.toml"), &orphan).unwrap();
    let check = std::process::Command::new(crate::bin()).arg("--ckb").arg(&wc).args(["ckb", "check"]).output().unwrap();
    assert_eq!(check.status.code(), Some(1));
    let text = String::from_utf8_lossy(&check.stdout);
    assert!(text.contains("kernels/argmin.toml") && text.contains("no oracle implements"), "{text}");
    let plan = std::process::Command::new(crate::bin())
        .arg("--ckb")
        .arg(&wc)
        .args(["plan", "--model"])
        .arg(crate::babyllama())
        .output()
        .unwrap();
    assert_eq!(plan.status.code(), Some(2));
    let err = String::from_utf8_lossy(&plan.stderr);
    assert!(err.contains("kernels/argmin.toml") && err.contains("no oracle implements"), "{err}");

    // A failure contract naming a mutant nobody implements.
    std::fs::remove_file(wc.join("kernels/argmin.toml")).unwrap();
    let f = std::fs::read_to_string(wc.join("failures/argmax-last-on-ties.toml")).unwrap();
    std::fs::write(
        wc.join("failures/argmax-last-on-ties.toml"),
        f.replace("mutant = \"argmax_last\"", "mutant = \"argmax_random\""),
    )
    .unwrap();
    let check = std::process::Command::new(crate::bin()).arg("--ckb").arg(&wc).args(["ckb", "check"]).output().unwrap();
    let text = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.code() == Some(1) && text.contains("no oracle mutant named `argmax_random`"), "{text}");
}
