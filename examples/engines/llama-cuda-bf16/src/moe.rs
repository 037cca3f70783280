//! Phase 3 for the mixture-of-experts families (`model.qwen3_moe`, `model.mixtral`): each layer's
//! MLP is a router over experts (config.json's num_experts / num_local_experts,
//! num_experts_per_tok, norm_topk_prob, moe_intermediate_size), run on the device for one token:
//! the router's logits (kernel.linear_bf16), the top-k weights (kernel.moe_route), then only the
//! selected experts' rows are read (kernel.moe_experts: gate and up, then down with the residual
//! add). The selection never leaves the device and no expert is computed densely.
//!
//! Weights: the router [n_experts, hidden] and every expert's gate, up [n_experts, inter, hidden]
//! and down [n_experts, hidden, inter] in bf16, rounded at load as every other matrix.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};

use crate::config::{ExpertLayout, Moe};
use crate::device::Device;
use crate::kernels;
use crate::weights::Tensors;

/// One layer's experts on the device.
pub(crate) struct MoeLayer {
    /// [n_experts, hidden] bf16.
    router: CudaSlice<u16>,
    /// [n_experts, inter, hidden] bf16 each.
    gate: CudaSlice<u16>,
    up: CudaSlice<u16>,
    /// [n_experts, hidden, inter] bf16.
    down: CudaSlice<u16>,
}

/// The MLP's activations for one token: router logits and weights [n_experts], the selected
/// experts' intermediate rows [n_experts, inter].
pub(crate) struct MoeScratch {
    scores: CudaSlice<f32>,
    route: CudaSlice<f32>,
    act: CudaSlice<f32>,
}

impl MoeScratch {
    pub(crate) fn new(st: &Arc<CudaStream>, m: &Moe) -> Result<MoeScratch, String> {
        let z = |n: usize, what: &str| st.alloc_zeros::<f32>(n).map_err(|e| format!("moe {what}: {e}"));
        Ok(MoeScratch {
            scores: z(m.n_experts, "scores")?,
            route: z(m.n_experts, "route")?,
            act: z(m.n_experts * m.inter, "act")?,
        })
    }
}

/// Why this engine does not run the checkpoint's experts, or None when it does (SwiGLU experts in
/// one tensor per expert and projection, no router bias: Qwen3-MoE and Mixtral).
pub(crate) fn unsupported(m: &Moe) -> Option<String> {
    match m.layout {
        ExpertLayout::Split { .. } => None,
        _ => Some(format!("the experts of `{}` are not stored one tensor per expert and projection", m.module)),
    }
}

/// Rounds f32 values to bf16 and uploads them (the model's loader), naming what for errors.
pub(crate) type Upload16<'a> = dyn Fn(&[f32], &str) -> Result<CudaSlice<u16>, String> + 'a;

/// Read layer `i`'s router and experts from `w` (shapes checked, names as the family stores them)
/// and upload them as bf16 with `up16`.
pub(crate) fn load_layer(
    w: &mut Tensors,
    i: usize,
    m: &Moe,
    hidden: usize,
    up16: &Upload16,
) -> Result<MoeLayer, String> {
    let ExpertLayout::Split { names } = m.layout else {
        return Err(unsupported(m).unwrap_or_default());
    };
    let (n, inter) = (m.n_experts, m.inter);
    let base = format!("model.layers.{i}.{}", m.module);
    let router = w.take(&format!("{base}.gate.weight"), &[n, hidden])?;
    let (mut gate, mut up, mut down) = (Vec::new(), Vec::new(), Vec::new());
    for e in 0..n {
        let name = |p: &str| format!("{base}.experts.{e}.{p}.weight");
        gate.extend(w.take(&name(names[0]), &[inter, hidden])?);
        up.extend(w.take(&name(names[1]), &[inter, hidden])?);
        down.extend(w.take(&name(names[2]), &[hidden, inter])?);
    }
    Ok(MoeLayer {
        router: up16(&router, "router")?,
        gate: up16(&gate, "expert gate")?,
        up: up16(&up, "expert up")?,
        down: up16(&down, "expert down")?,
    })
}

/// x += the mixture of experts of `normed` (the post-attention RMSNorm of x) for one token:
/// router logits, kernel.moe_route, kernel.moe_experts over the selected experts only.
pub(crate) fn mlp(
    dev: &Device,
    m: &Moe,
    layer: &MoeLayer,
    normed: &CudaView<'_, f32>,
    s: &mut MoeScratch,
    x: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    let h = normed.len();
    kernels::linear_bf16(dev, normed, &layer.router.as_view(), 1, h, m.n_experts, &mut s.scores.as_view_mut())?;
    kernels::moe_route(dev, &s.scores.as_view(), m.top_k, m.renormalize, &mut s.route.as_view_mut())?;
    kernels::moe_experts_into(
        dev,
        normed,
        &s.route.as_view(),
        &layer.gate.as_view(),
        &layer.up.as_view(),
        &layer.down.as_view(),
        m.inter,
        &mut s.act.as_view_mut(),
        x,
        true,
    )
}
