//! Consistency rules of a contract knowledge base that its JSON schema cannot express, one rule
//! per function ([`RULES`]), each run on every contract; a finding names the file and the field
//! (a JSON pointer into the contract) and says what to fix.

use std::collections::BTreeSet;

use super::family::{CONFIG_TYPES, GRAPH_OPS, WEIGHT_REWRITES};
use super::types::{self, Contract, Kind, Phase};
use super::{Ckb, Finding, graph, parse_id, same_value};

/// Where a rule reports: `bad(field, message)`.
type Bad<'a> = &'a mut dyn FnMut(&str, String);

/// The rules, in the order their findings are listed for each contract.
const RULES: &[fn(&Ckb, &Contract, Bad)] = &[
    id_and_sources,
    model_lists,
    family_graph,
    rewrite,
    references,
    sections,
    kernel,
    variant,
    cuda,
    platform,
    policy,
    tolerances,
    parameters,
    model_config,
    test_cases,
    logits_tolerances,
    conformance_and_margin,
    dtype_policy,
    tokenizer_section,
    optional_items,
];

impl Ckb {
    /// Consistency rules the schema cannot express ([`RULES`] on every contract). Each finding
    /// names file and field.
    pub fn lint(&self) -> Vec<Finding> {
        let mut out = Vec::new();
        for c in self.contracts.values() {
            let file = self.files.get(&c.id).cloned().unwrap_or_default();
            let mut bad =
                |field: &str, message: String| out.push(Finding { file: file.clone(), field: field.into(), message });
            for rule in RULES {
                rule(self, c, &mut bad);
            }
        }
        out
    }
}

/// A family states a logits tolerance for each weight dtype, with finite non-negative bounds and
/// its reasoning.
fn logits_tolerances(_ckb: &Ckb, c: &Contract, bad: Bad) {
    let Some(m) = &c.model else { return };
    for d in types::WEIGHT_DTYPES {
        if !m.logits_tolerance.contains_key(*d) {
            bad(
                "/model/logits_tolerance",
                format!(
                    "no logits tolerance for weight dtype `{d}`; every family states one per weight dtype ({}) with its reasoning",
                    types::WEIGHT_DTYPES.join(", ")
                ),
            );
        }
    }
    for (d, t) in &m.logits_tolerance {
        if !types::WEIGHT_DTYPES.contains(&d.as_str()) {
            bad(&format!("/model/logits_tolerance/{d}"), format!("`{d}` is not a weight dtype"));
        }
        if !(t.atol >= 0.0 && t.rtol >= 0.0 && t.atol.is_finite() && t.rtol.is_finite()) {
            bad(&format!("/model/logits_tolerance/{d}"), "atol and rtol must be finite and >= 0".into());
        }
        if t.reasoning.trim().is_empty() {
            bad(&format!("/model/logits_tolerance/{d}/reasoning"), "say why these numbers".into());
        }
    }
}

/// A family's conformance tolerance and rounding margin, where stated, are finite, in range and
/// reasoned.
fn conformance_and_margin(_ckb: &Ckb, c: &Contract, bad: Bad) {
    let Some(m) = &c.model else { return };
    if let Some(t) = &m.conformance {
        if !(t.atol >= 0.0 && t.rtol >= 0.0 && t.atol.is_finite() && t.rtol.is_finite()) {
            bad("/model/conformance", "atol and rtol must be finite and >= 0".into());
        }
        if t.reasoning.trim().is_empty() {
            bad("/model/conformance/reasoning", "say why these numbers".into());
        }
    }
    if let Some(r) = &m.rounding_margin {
        if !(r.factor.is_finite() && (1.0..=1000.0).contains(&r.factor)) {
            bad(
                "/model/rounding_margin/factor",
                format!("{} is no multiple of a rounding error: give a finite factor in 1..=1000", r.factor),
            );
        }
        if r.reasoning.trim().is_empty() {
            bad("/model/rounding_margin/reasoning", "say why this factor".into());
        }
    }
}

/// A family has a dtype policy covering each weight role once, the matrices (2 or more
/// dimensions) at the weight dtype as the reference rounds them, with its reasoning.
fn dtype_policy(_ckb: &Ckb, c: &Contract, bad: Bad) {
    let Some(m) = &c.model else { return };
    match &m.dtype_policy {
        None => bad(
            "/model/dtype_policy",
            "a family needs a dtype policy: which weight roles an engine stores at its weight dtype and which stay f32"
                .into(),
        ),
        Some(p) => {
            let roles: BTreeSet<&str> = m.weights.iter().map(|w| w.role.as_str()).collect();
            let matrices: BTreeSet<&str> =
                m.weights.iter().filter(|w| w.shape.len() >= 2).map(|w| w.role.as_str()).collect();
            for (list, field) in [(&p.at_weight_dtype, "at_weight_dtype"), (&p.keep_f32, "keep_f32")] {
                for r in list {
                    if !roles.contains(r.as_str()) {
                        bad(
                            &format!("/model/dtype_policy/{field}"),
                            format!("`{r}` is not a weight role of this family"),
                        );
                    }
                }
            }
            for r in &roles {
                let (a, k) = (p.at_weight_dtype.iter().any(|x| x == r), p.keep_f32.iter().any(|x| x == r));
                if a == k {
                    bad(
                        "/model/dtype_policy",
                        format!("weight role `{r}` must be in exactly one of at_weight_dtype and keep_f32"),
                    );
                } else if a && !matrices.contains(r) {
                    bad(
                        "/model/dtype_policy/at_weight_dtype",
                        format!(
                            "weight role `{r}`: only matrices (tensors of 2 or more dimensions) are stored at the weight dtype; a vector stays f32 (keep_f32)"
                        ),
                    );
                }
            }
            if p.reasoning.trim().is_empty() {
                bad("/model/dtype_policy/reasoning", "say why these tensors stay f32".into());
            }
        }
    }
}

/// A `tokenizer` section belongs to a component fixing the `tokenizer` module; its split
/// patterns have unique names and non-empty regexes.
fn tokenizer_section(_ckb: &Ckb, c: &Contract, bad: Bad) {
    if let Some(t) = &c.tokenizer {
        if c.kind != Kind::Component {
            bad("/tokenizer", "a `tokenizer` section belongs only to kind component".into());
        }
        if c.rust.as_ref().is_none_or(|r| r.module != "tokenizer") {
            bad("/rust/module", "a tokenizer contract fixes the engine's `tokenizer` module".into());
        }
        let mut names = BTreeSet::new();
        for (i, p) in t.split_patterns.iter().enumerate() {
            if !names.insert(p.name.as_str()) {
                bad(&format!("/tokenizer/split_patterns/{i}/name"), format!("pattern name `{}` used twice", p.name));
            }
            if p.regex.is_empty() {
                bad(&format!("/tokenizer/split_patterns/{i}/regex"), "empty pattern".into());
            }
        }
    }
}

/// Every optional skeleton item names a function of the skeleton.
fn optional_items(_ckb: &Ckb, c: &Contract, bad: Bad) {
    if let Some(r) = &c.rust {
        let fns: Vec<&str> = r
            .skeleton
            .split("pub fn ")
            .skip(1)
            .filter_map(|rest| rest.split(['(', '<']).next().map(str::trim))
            .collect();
        for (i, o) in r.optional.iter().enumerate() {
            if !fns.contains(&o.as_str()) {
                bad(&format!("/rust/optional/{i}"), format!("`{o}` is not a function of the skeleton"));
            }
        }
    }
}

/// The id is `<kind>.<name>` of the contract's kind, and at least one source says where the
/// knowledge comes from.
fn id_and_sources(_ckb: &Ckb, c: &Contract, bad: Bad) {
    let prefix = c.kind.prefix();
    match parse_id(&c.id) {
        Err(e) => bad("/id", e),
        Ok((kind, _)) if kind != c.kind => {
            bad("/id", format!("id `{}` must be `{prefix}.<name>` for kind {prefix}", c.id))
        }
        Ok(_) => {}
    }
    if c.sources.is_empty() {
        bad("/sources", "at least one source is required: say where the knowledge comes from".into());
    }
}

/// A family's kernel and component lists hold ids of those kinds, and its features are ones the
/// reference forward pass implements.
fn model_lists(_ckb: &Ckb, c: &Contract, bad: Bad) {
    if let Some(m) = &c.model {
        for k in &m.kernels {
            if !k.starts_with("kernel.") {
                bad("/model/kernels", format!("`{k}` is not a kernel id"));
            }
        }
        for k in &m.components {
            if !k.starts_with("component.") {
                bad("/model/components", format!("`{k}` is not a component id"));
            }
        }
        for (i, f) in m.features.iter().enumerate() {
            if !types::FAMILY_FEATURES.iter().any(|(known, _)| known == f) {
                bad(
                    &format!("/model/features/{i}"),
                    format!(
                        "unknown feature `{f}`: the reference forward pass implements only {}; describe a new difference in the forward pass with these, or add the feature to the server (oracle::llama and model::resolve) first",
                        types::FAMILY_FEATURES.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ")
                    ),
                );
            }
        }
    }
}

/// A family's `[model.graph]` passes [`graph::lint_graph`].
fn family_graph(_ckb: &Ckb, c: &Contract, bad: Bad) {
    if let Some(g) = c.model.as_ref().and_then(|m| m.graph.as_ref().map(|g| (g, m))) {
        for (field, message) in graph::lint_graph(g.0, g.1) {
            bad(&field, message);
        }
    }
}

/// A failure contract's rewrite changes something, names node.param, weight rewrites that exist and
/// op weight slots that exist, and only nodes of the graphs of the families it applies to.
fn rewrite(ckb: &Ckb, c: &Contract, bad: Bad) {
    if let Some(f) = &c.failure {
        // A rewrite names nodes of the graphs of the families it applies to.
        if let Some(rw) = &f.rewrite {
            if rw.is_empty() {
                bad(
                    "/failure/rewrite",
                    "the rewrite changes nothing: give skip, set, swap, weights or op_weights".into(),
                );
            }
            for key in rw.set.keys().filter(|k| !k.contains('.')) {
                bad("/failure/rewrite/set", format!("`{key}`: write node.param"));
            }
            for (field, map) in [("weights", &rw.weights), ("op_weights", &rw.op_weights)] {
                for (key, how) in map {
                    if !WEIGHT_REWRITES.contains(&how.as_str()) {
                        bad(
                            &format!("/failure/rewrite/{field}"),
                            format!("`{key}` = `{how}`: use one of {}", WEIGHT_REWRITES.join(", ")),
                        );
                    }
                    let Some((head, slot)) = key.split_once('.') else {
                        bad(&format!("/failure/rewrite/{field}"), format!("`{key}`: write <node or op>.<slot>"));
                        continue;
                    };
                    if field == "op_weights" {
                        let slots = GRAPH_OPS.iter().find(|o| o.name == head).map(|o| o.weights);
                        if !slots.is_some_and(|w| w.iter().any(|s| s.trim_end_matches('?') == slot)) {
                            bad(
                                "/failure/rewrite/op_weights",
                                format!("`{key}`: `{head}` is no graph op with a weight slot `{slot}`"),
                            );
                        }
                    }
                }
            }
            for fam in &f.applies_to {
                let Some(g) = ckb.contracts.get(fam).and_then(|m| m.model.as_ref()).and_then(|m| m.graph.as_ref())
                else {
                    continue;
                };
                let all = || g.prologue.iter().chain(&g.layer).chain(&g.epilogue);
                for node in rw.nodes() {
                    if !all().any(|n| n.name == node) {
                        bad(
                            "/failure/rewrite",
                            format!("node `{node}` is not in {fam}'s [model.graph]: the rewrite cannot apply"),
                        );
                    }
                }
            }
        }
    }
}

/// Every reference (failure modes, requires, a family's kernels and components, a failure's
/// `applies_to`, a platform's kernel guidance) resolves to a contract, and failure modes are
/// failure ids.
fn references(ckb: &Ckb, c: &Contract, bad: Bad) {
    let mut refs: Vec<(&str, &String)> = Vec::new();
    refs.extend(c.failure_modes.iter().map(|r| ("/failure_modes", r)));
    refs.extend(c.requires.iter().map(|r| ("/requires", r)));
    if let Some(m) = &c.model {
        refs.extend(m.kernels.iter().map(|r| ("/model/kernels", r)));
        refs.extend(m.components.iter().map(|r| ("/model/components", r)));
    }
    if let Some(f) = &c.failure {
        refs.extend(f.applies_to.iter().map(|r| ("/failure/applies_to", r)));
    }
    if let Some(p) = &c.platform {
        refs.extend(p.kernel_guidance.keys().map(|r| ("/platform/kernel_guidance", r)));
    }
    for (field, r) in refs {
        if !ckb.contracts.contains_key(r.as_str()) {
            bad(field, format!("reference `{r}` does not resolve to any contract"));
        }
    }
    for f in &c.failure_modes {
        if !f.starts_with("failure.") {
            bad("/failure_modes", format!("`{f}` is not a failure-mode id"));
        }
    }
}

/// Each kind has its own section (`[model]`, `[platform]`, `[failure]`, `[policy]`) and no other
/// kind has it.
fn sections(_ckb: &Ckb, c: &Contract, bad: Bad) {
    let section = |present: bool, name: &str, bad: &mut dyn FnMut(&str, String)| {
        let wanted = match name {
            "model" => c.kind == Kind::Model,
            "platform" => c.kind == Kind::Platform,
            "policy" => c.kind == Kind::Policy,
            _ => c.kind == Kind::Failure,
        };
        if present && !wanted {
            bad(&format!("/{name}"), format!("a `{name}` section belongs only to kind {name}"));
        }
        if !present && wanted {
            bad(&format!("/{name}"), format!("kind {name} needs a `[{name}]` section"));
        }
    };
    section(c.model.is_some(), "model", &mut *bad);
    section(c.platform.is_some(), "platform", &mut *bad);
    section(c.failure.is_some(), "failure", &mut *bad);
    section(c.policy.is_some(), "policy", &mut *bad);
}

/// A kernel states its math, pseudocode, f32 tolerance, test cases, failure modes, Rust signature
/// and phase.
fn kernel(_ckb: &Ckb, c: &Contract, bad: Bad) {
    if c.kind == Kind::Kernel {
        if c.math.is_empty() {
            bad("/math", "a kernel needs its exact semantics in `math`".into());
        }
        if c.pseudocode.is_empty() {
            bad("/pseudocode", "a kernel needs pseudocode".into());
        }
        if !c.tolerance.contains_key("f32") {
            bad("/tolerance", "a kernel needs a tolerance for f32 with its reasoning".into());
        }
        if c.test_cases.is_empty() {
            bad("/test_cases", "a kernel needs at least one test case".into());
        }
        if c.failure_modes.is_empty() {
            bad("/failure_modes", "a kernel needs at least one failure mode".into());
        }
        if c.rust.is_none() {
            bad("/rust", "a kernel needs the Rust signature the engine exposes".into());
        }
        if c.phase != Some(Phase::Kernels) {
            bad("/phase", "a kernel belongs to phase `kernels`".into());
        }
    }
}

/// A `[variant]` is a kernel's, of a plain kernel, for a weight dtype other than f32, and the only
/// one for that kernel and dtype.
fn variant(ckb: &Ckb, c: &Contract, bad: Bad) {
    if let Some(v) = &c.variant {
        if c.kind != Kind::Kernel {
            bad("/variant", "a `variant` section belongs only to kind kernel".into());
        }
        match ckb.contracts.get(&v.of) {
            Some(of) if of.kind == Kind::Kernel && of.variant.is_none() => {}
            Some(_) => bad("/variant/of", format!("`{}` is not a plain kernel contract", v.of)),
            None => bad("/variant/of", format!("reference `{}` does not resolve to any contract", v.of)),
        }
        if v.weight_dtype == "f32" || !types::WEIGHT_DTYPES.contains(&v.weight_dtype.as_str()) {
            bad(
                "/variant/weight_dtype",
                format!(
                    "`{}` is not a weight dtype with a variant; use one of {}",
                    v.weight_dtype,
                    types::WEIGHT_DTYPES[1..].join(", ")
                ),
            );
        }
        if ckb.contracts.values().any(|o| {
            o.id < c.id && o.variant.as_ref().is_some_and(|w| w.of == v.of && w.weight_dtype == v.weight_dtype)
        }) {
            bad("/variant", format!("another kernel is already the {} variant of {}", v.weight_dtype, v.of));
        }
    }
}

/// A `[cuda]` section is a kernel's, with a `pub fn` skeleton, a launch mapping and finite,
/// reasoned tolerances (f32 among them).
fn cuda(_ckb: &Ckb, c: &Contract, bad: Bad) {
    if let Some(cu) = &c.cuda {
        if c.kind != Kind::Kernel {
            bad("/cuda", "a `cuda` section belongs only to kind kernel".into());
        }
        if !cu.skeleton.contains("pub fn ") {
            bad("/cuda/skeleton", "the CUDA skeleton needs the `pub fn` the gates call".into());
        }
        if !cu.tolerance.contains_key("f32") {
            bad("/cuda/tolerance", "the CUDA variant needs a tolerance for f32 with its reasoning".into());
        }
        if cu.launch.trim().is_empty() {
            bad("/cuda/launch", "say how the work maps onto threads, warps and blocks".into());
        }
        for (dtype, t) in &cu.tolerance {
            if !(t.atol >= 0.0 && t.rtol >= 0.0 && t.atol.is_finite() && t.rtol.is_finite()) {
                bad(&format!("/cuda/tolerance/{dtype}"), "atol and rtol must be finite and >= 0".into());
            }
            if t.reasoning.trim().is_empty() {
                bad(&format!("/cuda/tolerance/{dtype}/reasoning"), "say why these numbers".into());
            }
        }
    }
}

/// A platform names a known api, a `[platform.gpu]` exactly when the api is cuda (with positive
/// figures that name their source), and components that are components.
fn platform(ckb: &Ckb, c: &Contract, bad: Bad) {
    if let Some(p) = &c.platform {
        if p.api != types::API_HOST && p.api != types::API_CUDA {
            bad(
                "/platform/api",
                format!("unknown api `{}`; use `{}` or `{}`", p.api, types::API_HOST, types::API_CUDA),
            );
        }
        if (p.api == types::API_CUDA) != p.gpu.is_some() {
            bad("/platform/gpu", "a `[platform.gpu]` section goes with api = \"cuda\", and only with it".into());
        }
        for (i, comp) in p.components.iter().enumerate() {
            match ckb.contracts.get(comp) {
                Some(o) if o.kind == Kind::Component => {}
                Some(_) => bad(&format!("/platform/components/{i}"), format!("`{comp}` is not a component")),
                None => bad(
                    &format!("/platform/components/{i}"),
                    format!("reference `{comp}` does not resolve to any contract"),
                ),
            }
        }
        if let Some(g) = &p.gpu {
            if g.devices.is_empty() {
                bad("/platform/gpu/devices", "name at least one device model with its bandwidth".into());
            }
            let figures = [&g.sm_count, &g.l2_mib, &g.smem_per_sm_kib]
                .into_iter()
                .chain(g.peak_tflops.values())
                .chain(g.devices.iter().flat_map(|d| [&d.memory_gb, &d.hbm_gbs]))
                .chain(g.devices.iter().filter_map(|d| d.measured_gbs.as_ref()));
            for f in figures {
                if !(f.value > 0.0 && f.value.is_finite()) || f.source.trim().is_empty() {
                    bad("/platform/gpu", format!("figure {} must be positive and name its source", f.value));
                }
            }
        }
    }
}

/// No pattern a policy permits is also denied.
fn policy(_ckb: &Ckb, c: &Contract, bad: Bad) {
    if let Some(p) = &c.policy {
        for (target, entries) in &p.permit {
            for (i, e) in entries.iter().enumerate() {
                let probe = e.pattern.trim_end_matches('*');
                if let Some(d) = p.deny.iter().find(|d| d.matches(probe)) {
                    bad(
                        &format!("/policy/permit/{target}/{i}"),
                        format!("permitted `{}` is also denied by pattern `{}`", e.pattern, d.pattern),
                    );
                }
            }
        }
    }
}

/// Tolerances are finite, non-negative and reasoned.
fn tolerances(_ckb: &Ckb, c: &Contract, bad: Bad) {
    for (dtype, t) in &c.tolerance {
        if !(t.atol >= 0.0 && t.rtol >= 0.0 && t.atol.is_finite() && t.rtol.is_finite()) {
            bad(&format!("/tolerance/{dtype}"), "atol and rtol must be finite and >= 0".into());
        }
        if t.reasoning.trim().is_empty() {
            bad(&format!("/tolerance/{dtype}/reasoning"), "say why these numbers".into());
        }
    }
}

/// No parameter is stated twice with different defaults or dtypes.
fn parameters(_ckb: &Ckb, c: &Contract, bad: Bad) {
    for (j, p) in c.parameters.iter().enumerate() {
        for (i, q) in c.parameters[..j].iter().enumerate() {
            if p.name != q.name {
                continue;
            }
            if let (Some(a), Some(b)) = (&q.default, &p.default)
                && !same_value(a, b)
            {
                bad(
                    &format!("/parameters/{j}/default"),
                    format!(
                        "parameter `{}` is stated twice with different defaults: {a:?} (/parameters/{i}) and {b:?} (/parameters/{j}); keep one entry with the right value",
                        p.name
                    ),
                );
            }
            if q.dtype != p.dtype {
                bad(
                    &format!("/parameters/{j}/dtype"),
                    format!(
                        "parameter `{}` is stated twice with different dtypes: {:?} (/parameters/{i}) and {:?} (/parameters/{j}); keep one entry with the right dtype",
                        p.name, q.dtype, p.dtype
                    ),
                );
            }
        }
    }
}

/// A family's config keys: no key stated twice with different defaults, known value types, per-
/// layer keys are lists, defaults among the supported values.
fn model_config(_ckb: &Ckb, c: &Contract, bad: Bad) {
    if let Some(m) = &c.model {
        for (j, f) in m.config.iter().enumerate() {
            for (i, g) in m.config[..j].iter().enumerate() {
                if let (true, Some(a), Some(b)) = (g.key == f.key, &g.default, &f.default)
                    && !same_value(a, b)
                {
                    bad(
                        &format!("/model/config/{j}/default"),
                        format!(
                            "config key `{}` is stated twice with different defaults: {a:?} (/model/config/{i}) and {b:?} (/model/config/{j}); keep one entry with the default of the HF configuration class",
                            f.key
                        ),
                    );
                }
            }
            if let Some(t) = f.value_type.as_deref()
                && !CONFIG_TYPES.contains(&t)
            {
                bad(
                    &format!("/model/config/{j}/type"),
                    format!("config key `{}` has type {t:?}; use one of {}", f.key, CONFIG_TYPES.join(", ")),
                );
            }
            if f.per_layer && f.value_type.as_deref() != Some("list") {
                bad(
                    &format!("/model/config/{j}/per_layer"),
                    format!("config key `{}` is per_layer but not of type \"list\"", f.key),
                );
            }
            if let Some(d) = &f.default
                && !f.supported.is_empty()
                && !f.supported.iter().any(|v| same_value(v, d))
            {
                bad(
                    &format!("/model/config/{j}/default"),
                    format!(
                        "config key `{}` has default {d:?}, which is not among its supported values {:?}; add it to `supported` or correct the default",
                        f.key, f.supported
                    ),
                );
            }
        }
    }
}

/// Test-case dimension ranges satisfy 1 <= lo <= hi.
fn test_cases(_ckb: &Ckb, c: &Contract, bad: Bad) {
    for (i, case) in c.test_cases.iter().enumerate() {
        for (dim, [lo, hi]) in &case.dims {
            if lo > hi || *lo == 0 {
                bad(&format!("/test_cases/{i}/dims/{dim}"), format!("range [{lo}, {hi}] must satisfy 1 <= lo <= hi"));
            }
        }
    }
}
