//! Known-wrong variants of the reference ("mutants"), by name, as failure contracts spell them in
//! their `mutant` field. Kernel mutants live with their kernel in the registry ([`super::kernels`]:
//! one core per kernel with a faults struct); this module adds the model-level mutations of the
//! reference forward pass ([`Mutation`], used by [`super::llama::Reference::set_mutations`]): each
//! applies one kernel fault wherever the forward pass calls that kernel, except
//! [`Mutation::KvPositionOffByOne`], which only exists at this level. Mistakes that are not one
//! kernel's fault (a node skipped or moved, a weight bound wrong) are graph rewrites carried by
//! their failure contracts ([`ckb::GraphRewrite`]).
//!
//! A mutation is a kernel's fault applied wherever the forward pass calls that kernel (plus the KV
//! row written one off). A graph rewrite changes the family's graph as data, in the graph reference
//! (`oracle::graph`, `set_rewrite`): `skip` (a node's output is its input), `set` (a node parameter,
//! e.g. `attn.window`, `q_rope.scaling`, `attn.kv_row`), `swap` (two chained one-input nodes in the
//! other order: q/k norm after RoPE), `weights` and `op_weights` (a binding as a mistaken loader
//! makes it: `drop` a bias, round a tensor to `bf16`/`f16`, take a `one_plus_w` gain `raw`, bind the
//! `tied` embedding as the output projection). Weight rewrites derive new tensors after the graph's
//! own in the interpreter's store; restoring the graph truncates them. A rewrite that names a node
//! the graph lacks, or that changes no weight at this config (a `tied` rewrite of a tied
//! checkpoint), does not apply and is not tried.
//!
//! Every failure mode a family lists has a mutant and is named from that mutant's own logits in a
//! test (`contract_families::every_failure_mode_a_family_lists_is_named_from_its_own_logits`), except
//! where its detection is another gate's (weight loading) or the logits tolerance cannot see it
//! (GeGLU's exact erf: the kernel test names that one).

/// Whether a mutant of this name exists: a kernel mutant of the registry or a model-level mutation.
pub fn mutant_exists(name: &str) -> bool {
    super::kernels::mutants().any(|(_, m)| m.name == name) || Mutation::from_name(name).is_some()
}

/// Names of every mutant (kernel and model-level), each once, in registry order.
pub fn names() -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    for name in super::kernels::mutants().map(|(_, m)| m.name).chain(Mutation::ALL.iter().map(|m| m.name())) {
        if !out.contains(&name) {
            out.push(name);
        }
    }
    out
}

/// A model-level mutation of the reference forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// `rope_adjacent` for q and k.
    RopeAdjacent,
    /// `rope_theta_default` for q and k (no effect on a checkpoint with rope_theta = 10000).
    RopeThetaDefault,
    /// `rmsnorm_eps_outside` in every norm.
    RmsNormEpsOutside,
    /// `rmsnorm_no_weight` in every norm.
    RmsNormNoWeight,
    /// `linear_xw` in every projection, lm_head included.
    LinearXw,
    /// `silu_swapped` in the MLP (equivalently, gate_proj and up_proj outputs swapped).
    SiluSwapped,
    /// `gqa_modulo` in attention (no effect when n_kv_heads = n_heads or 1).
    GqaModulo,
    /// `attention_no_scale` in attention.
    AttentionNoScale,
    /// `embedding_off_by_one` for the token embedding (not the tied output projection).
    EmbeddingOffByOne,
    /// `kv_position_off_by_one`: the K and V of the token at position p are written to cache row
    /// p - 1 (row 0 for p = 0, K still rotated at p), so attention at p reads the next token's K/V in
    /// row p - 1 and an unwritten (zero) row p.
    KvPositionOffByOne,
    /// `gelu_erf` in the GeGLU MLP and the non-gated GELU (no effect in a family without
    /// `gelu_tanh_and_mul` or `gelu_tanh`).
    GeluErf,
    /// `layernorm_no_mean` in every LayerNorm (no effect in a family without `layer_norm`).
    LayerNormNoMean,
    /// `rotary_freq_over_head_dim` in every partial rotary node (no effect where rotary_dim is
    /// head_dim, or in a family without `rotary`).
    RotaryFreqOverHeadDim,
    /// `moe_no_renorm` in every router (no effect in a family that does not renormalise).
    MoeNoRenorm,
    /// `moe_softmax_over_topk` in every router (no effect in a family that renormalises).
    MoeSoftmaxOverTopk,
    /// `moe_expert_off_by_one` in every router.
    MoeExpertOffByOne,
    /// `moe_unweighted` in every experts node.
    MoeUnweighted,
    /// `sinks_dropped` in every attention node with sinks (no effect in a family without them).
    SinksDropped,
    /// `gate_up_halves` in every fused clamped-experts node (no effect without one, or where the
    /// expert width is 1).
    MoeGateUpHalves,
    /// `swiglu_unclamped` in every fused clamped-experts node (no effect while no gate or up value
    /// passes the limit).
    SwigluUnclamped,
}

impl Mutation {
    /// Every model-level mutation.
    pub const ALL: [Mutation; 20] = [
        Mutation::RopeAdjacent,
        Mutation::RopeThetaDefault,
        Mutation::RmsNormEpsOutside,
        Mutation::RmsNormNoWeight,
        Mutation::LinearXw,
        Mutation::SiluSwapped,
        Mutation::GqaModulo,
        Mutation::AttentionNoScale,
        Mutation::EmbeddingOffByOne,
        Mutation::KvPositionOffByOne,
        Mutation::GeluErf,
        Mutation::LayerNormNoMean,
        Mutation::RotaryFreqOverHeadDim,
        Mutation::MoeNoRenorm,
        Mutation::MoeSoftmaxOverTopk,
        Mutation::MoeExpertOffByOne,
        Mutation::MoeUnweighted,
        Mutation::SinksDropped,
        Mutation::MoeGateUpHalves,
        Mutation::SwigluUnclamped,
    ];

    /// The mutant's name, as the failure contracts spell it.
    pub fn name(self) -> &'static str {
        match self {
            Mutation::RopeAdjacent => "rope_adjacent",
            Mutation::RopeThetaDefault => "rope_theta_default",
            Mutation::RmsNormEpsOutside => "rmsnorm_eps_outside",
            Mutation::RmsNormNoWeight => "rmsnorm_no_weight",
            Mutation::LinearXw => "linear_xw",
            Mutation::SiluSwapped => "silu_swapped",
            Mutation::GqaModulo => "gqa_modulo",
            Mutation::AttentionNoScale => "attention_no_scale",
            Mutation::EmbeddingOffByOne => "embedding_off_by_one",
            Mutation::KvPositionOffByOne => "kv_position_off_by_one",
            Mutation::GeluErf => "gelu_erf",
            Mutation::LayerNormNoMean => "layernorm_no_mean",
            Mutation::RotaryFreqOverHeadDim => "rotary_freq_over_head_dim",
            Mutation::MoeNoRenorm => "moe_no_renorm",
            Mutation::MoeSoftmaxOverTopk => "moe_softmax_over_topk",
            Mutation::MoeExpertOffByOne => "moe_expert_off_by_one",
            Mutation::MoeUnweighted => "moe_unweighted",
            Mutation::SinksDropped => "sinks_dropped",
            Mutation::MoeGateUpHalves => "gate_up_halves",
            Mutation::SwigluUnclamped => "swiglu_unclamped",
        }
    }

    /// The model-level mutation of this name, if there is one.
    pub fn from_name(name: &str) -> Option<Mutation> {
        Mutation::ALL.into_iter().find(|m| m.name() == name)
    }

    fn bit(self) -> u32 {
        1 << Mutation::ALL.iter().position(|m| *m == self).expect("listed in ALL")
    }
}

/// A set of [`Mutation`]s; empty for the true forward pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Mutations(u32);

impl Mutations {
    /// No mutation: the true forward pass.
    pub const NONE: Mutations = Mutations(0);

    /// The set of the given mutations.
    pub fn of(ms: &[Mutation]) -> Mutations {
        Mutations(ms.iter().fold(0, |b, m| b | m.bit()))
    }

    /// Whether `m` is in the set.
    pub fn has(self, m: Mutation) -> bool {
        self.0 & m.bit() != 0
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_model_mutation_but_the_kv_one_is_a_kernel_mutant() {
        for m in Mutation::ALL {
            assert_eq!(Mutation::from_name(m.name()), Some(m));
            let kernel_level = super::super::kernels::mutants().any(|(_, k)| k.name == m.name());
            assert_eq!(kernel_level, m != Mutation::KvPositionOffByOne, "{}", m.name());
        }
        let set = Mutations::of(&[Mutation::SiluSwapped, Mutation::GqaModulo]);
        assert!(set.has(Mutation::SiluSwapped) && set.has(Mutation::GqaModulo) && !set.has(Mutation::LinearXw));
        assert!(Mutations::NONE.is_empty() && !set.is_empty());
        assert_eq!(
            names().len(),
            38,
            "30 before the five mixture-of-experts mutants, then gpt-oss's sinks, gate/up halves and clamp"
        );
    }
}
