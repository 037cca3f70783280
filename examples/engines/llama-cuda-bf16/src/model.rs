//! Phases 3 and 4, the decoder (contract `model.llama`) on the device, with its KV cache
//! (`component.kv_cache`) and greedy decoding kept on the device (`component.device_decode`).
//!
//! Weights: every 2-D tensor in bf16 on the device, rounded to nearest even at load
//! (kernel.linear_bf16), q/k/v and gate/up each concatenated into one matrix so one product reads
//! them; the embedding table also in f32 (the bf16-rounded values, widened) for the gather. Norm
//! gains, activations, the KV cache and every accumulation are f32.
//!
//! Decode (`step_fused`): 2 + 5 * n_layers launches per token (34 + 48 at the Llama 3.2 1B shape:
//! 82, down from about 164), the norms, RoPE, the cache write, SiLU-and-mul, the residual adds and
//! the argmax fused into the matrix-vector products, the position and token kept in device memory
//! (`ctl`) and advanced by the step's last kernel, so one step is captured as a CUDA graph and
//! replayed per token (LLAMA_CUDA_GRAPH=0, or a failed capture: the same kernels launched one by
//! one). Prefill (`prefill_batched`): per layer, each projection one tensor-core product over the
//! prompt (exact three-plane bf16 split of the f32 activations), batched RoPE and cache writes,
//! causal attention over key tiles. Shapes the fused kernels do not take (k not a multiple of 8, a
//! GQA group above 8, head_dim above 128) run the per-contract kernels one token at a time (`step`).
//! `forward_traced` runs the same step, reading the graph's required points (embed, each layer's
//! attn_residual and mlp_residual, logits) back as it goes: verify localises a mismatch with them,
//! and profile times the real forward point by point.

use std::path::Path;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice};

use crate::config::Config;
use crate::device::Device;
use crate::fused;
use crate::kernels;
use crate::moe::{self, MoeLayer, MoeScratch};
use crate::weights;

/// One decoder layer's device weights and KV cache.
pub(crate) struct Layer {
    pub(crate) attn_norm: CudaSlice<f32>,
    /// q, k and v projections, one [(n_heads + 2 n_kv_heads) head_dim, hidden] bf16 matrix.
    pub(crate) wqkv: CudaSlice<u16>,
    pub(crate) wo: CudaSlice<u16>,
    pub(crate) ffn_norm: CudaSlice<f32>,
    /// The MLP: dense, or a mixture of experts.
    pub(crate) mlp: Mlp,
    /// Qwen3-MoE: the per-head RMSNorm gains of q and k ([head_dim] each), applied before RoPE.
    pub(crate) qk_norm: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// Keys after RoPE and values, [max_seq, n_kv_heads, head_dim] each, of the single-sequence
    /// API; one element until its first call (`Model::ensure_cache`): a server holds its KV cache
    /// in the paged pool only.
    pub(crate) k_cache: CudaSlice<f32>,
    pub(crate) v_cache: CudaSlice<f32>,
}

/// A layer's MLP.
pub(crate) enum Mlp {
    /// gate and up projections as one [2 intermediate, hidden] bf16 matrix, and down.
    Dense { w_gate_up: CudaSlice<u16>, w_down: CudaSlice<u16> },
    /// A router over experts (model.qwen3_moe, model.mixtral).
    Moe(MoeLayer),
}

impl Mlp {
    /// The dense MLP's matrices (gate/up, down); Err for a mixture of experts, which only the
    /// per-contract path runs.
    pub(crate) fn dense(&self) -> Result<(&CudaSlice<u16>, &CudaSlice<u16>), String> {
        match self {
            Mlp::Dense { w_gate_up, w_down } => Ok((w_gate_up, w_down)),
            Mlp::Moe(_) => Err("a mixture-of-experts layer runs on the per-contract path only".into()),
        }
    }
}

/// Device activations of the token being run, allocated once at load.
struct Scratch {
    x: CudaSlice<f32>,
    normed: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    gate_up: CudaSlice<f32>,
    act: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    /// The current token (argmax writes it, the embedding reads it).
    token: CudaSlice<u32>,
    /// Tokens of one decode_greedy call, [max_seq].
    trail: CudaSlice<u32>,
    /// Positions 0..max_seq, so a step's position is a view and never a host copy.
    positions: CudaSlice<u32>,
    /// The fused step's state on the device: [position, step, token, unused]. The fused kernels
    /// read the position and token here, and the last kernel of a decode step advances them, so
    /// one captured step replays for every token.
    ctl: CudaSlice<u32>,
    /// The rotated query of the fused step, [n_heads * head_dim].
    q: CudaSlice<f32>,
    /// lm_head's per-block argmax partials and its ticket.
    part_v: CudaSlice<f32>,
    part_i: CudaSlice<u32>,
    head_ticket: CudaSlice<u32>,
    /// Decode attention's per-split partials (max and sum, weighted V) and per-KV-head tickets.
    attn_ml: CudaSlice<f32>,
    attn_acc: CudaSlice<f32>,
    attn_ticket: CudaSlice<u32>,
    attn_splits: usize,
    /// q and k after their per-head RMSNorm (qk_norm), [(n_heads + n_kv_heads) head_dim].
    qk: CudaSlice<f32>,
    /// The mixture of experts' activations, for MoE checkpoints.
    moe: Option<MoeScratch>,
}

/// Device activations of a prompt chunk (up to `PREFILL_CHUNK` tokens), allocated once at load.
struct PrefillScratch {
    x: CudaSlice<f32>,
    normed: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    gate_up: CudaSlice<f32>,
    act: CudaSlice<f32>,
    /// The three bf16 planes of the activations a product reads (split3).
    planes: CudaSlice<u16>,
}

/// Most tokens of a prompt run through the layers at once; longer prompts go in chunks.
const PREFILL_CHUNK: usize = 512;

/// Where a step's token id comes from.
#[derive(Clone, Copy)]
enum Token {
    /// The device token (the previous argmax, or written by `forward`).
    Current,
    /// Element `i` of the uploaded prompt.
    Prompt(usize),
}

/// A loaded Llama-family model with its KV cache.
pub struct Model {
    pub(crate) dev: Device,
    pub(crate) cfg: Config,
    pub(crate) layers: Vec<Layer>,
    /// [vocab, hidden] f32 (bf16-rounded values) for the gather.
    pub(crate) embed: CudaSlice<f32>,
    /// [vocab, hidden] bf16: lm_head, or the embedding matrix when tied.
    pub(crate) lm_head: CudaSlice<u16>,
    pub(crate) final_norm: CudaSlice<f32>,
    /// RoPE frequencies [head_dim / 2], scaled as config.json says.
    pub(crate) freqs: CudaSlice<f64>,
    s: Scratch,
    /// Prompt activations, when the batched prefill takes this shape.
    pf: Option<PrefillScratch>,
    prompt: CudaSlice<u32>,
    host_logits: Vec<f32>,
    /// Whether the fused decode step takes this shape (every matrix's k a multiple of 8 within the
    /// staged-vector limit, a GQA group of at most 8, head_dim <= 128); else the per-contract path.
    fused: bool,
    /// The fused decode step captured as a CUDA graph (first decode_greedy call), replayed per token.
    graph: Option<CudaGraph>,
    /// Capture was tried and failed (or LLAMA_CUDA_GRAPH=0): decode launches the step's kernels.
    graph_off: bool,
}

/// f32 to bf16 bits, round to nearest, ties to even (contract kernel.linear_bf16); NaN stays NaN.
fn bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return ((bits >> 16) | 0x0040) as u16;
    }
    ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) as u16
}

fn widen(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// The callback of `forward_traced`: (layer, point name, the point's values).
type TraceFn<'a> = dyn FnMut(Option<usize>, &str, &[f32]) + 'a;

/// Hand the device buffer `buf` to `trace` as point `name` of `layer`: the copy to the host waits
/// for every kernel enqueued before it, so the time between two points is the device time of the
/// kernels between them plus one copy. Nothing happens without a `trace`.
fn point(
    dev: &Device,
    buf: &CudaSlice<f32>,
    trace: &mut Option<&mut TraceFn>,
    layer: Option<usize>,
    name: &str,
) -> Result<(), String> {
    if let Some(t) = trace.as_mut() {
        let v = dev.stream().clone_dtoh(buf).map_err(|e| format!("reading point {name}: {e}"))?;
        t(layer, name, &v);
    }
    Ok(())
}

/// Why this engine does not run a checkpoint of this configuration, or None when it does: plain
/// Llama, plus Qwen3-MoE's per-head q/k RMSNorm and the experts of Qwen3-MoE and Mixtral.
fn unsupported(c: &Config) -> Option<String> {
    let f = c.features;
    let others = [
        ("qkv_bias", f.qkv_bias),
        ("sliding_window", (0..c.n_layers).any(|l| c.window(l) > 0 || c.sliding(l))),
        ("gelu_tanh_mlp", f.gelu_tanh_mlp),
        ("rmsnorm_one_plus_w", f.rmsnorm_one_plus_w),
        ("embed_scale_sqrt_hidden", f.embed_scale_sqrt_hidden),
        ("fused", f.fused),
        ("qk_norm_whole", f.qk_norm_whole),
        ("post_norms", f.post_norms),
        ("no_pre_norms", f.no_pre_norms),
        ("multipliers", f.multipliers),
        ("softcapping", f.softcapping),
        ("alternating_window", f.alternating_window),
        ("rope_by_layer_type", f.rope_by_layer_type),
        ("layer_norm", f.layer_norm),
        ("norm_bias", f.norm_bias),
        ("norm_no_gain", f.norm_no_gain),
        ("parallel_block", f.parallel_block),
        ("interleaved_rope", f.interleaved_rope),
        ("fc_mlp", f.fc_mlp),
        ("o_bias", f.o_bias),
        ("attention_sinks", f.attention_sinks),
        ("partial rotary", c.rotary_dim != c.head_dim),
        ("attention scale", c.attention_scale.is_some() || c.attn_softcap.is_some() || c.final_softcap.is_some()),
        (
            "multipliers",
            c.embedding_multiplier.is_some()
                || c.residual_multiplier.is_some()
                || c.logits_scaling.is_some()
                || c.logit_scale.is_some(),
        ),
        ("clip_qkv", c.clip_qkv.is_some()),
        ("a RoPE base per layer type", c.sliding_rope_theta.is_some()),
        ("YaRN's attention factor", c.rope_attention_factor() != 1.0),
    ];
    if let Some((name, _)) = others.iter().find(|(_, on)| *on) {
        return Some(format!("the checkpoint's family needs `{name}`"));
    }
    if f.qk_norm && c.moe.is_none() {
        return Some("per-head q/k RMSNorm is run for mixture-of-experts checkpoints only (model.qwen3_moe)".into());
    }
    c.moe.as_ref().and_then(moe::unsupported)
}

fn dev_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// Qwen3-MoE's per-head RMSNorm of q and k (`norms`: their [head_dim] gains) on the row of a
/// fused q/k/v product that starts at `at` in `qkv` (q heads, then k heads, contiguous: `dims` =
/// (n_heads * head_dim, n_kv_heads * head_dim)), through `scratch` ([q_dim + kv_dim]) and copied
/// back in place. The single-token step and the batched step (row by row) both run it.
pub(crate) fn qk_norm_row(
    dev: &Device,
    norms: &(CudaSlice<f32>, CudaSlice<f32>),
    eps: f32,
    qkv: &mut CudaSlice<f32>,
    at: usize,
    dims: (usize, usize),
    scratch: &mut CudaSlice<f32>,
) -> Result<(), String> {
    let ((q_norm, k_norm), (q_dim, kv_dim)) = (norms, dims);
    let (q, k) = (at, at + q_dim);
    kernels::rms_norm(dev, &qkv.slice(q..k), &q_norm.as_view(), eps, &mut scratch.slice_mut(0..q_dim))?;
    let normed_k = &mut scratch.slice_mut(q_dim..q_dim + kv_dim);
    kernels::rms_norm(dev, &qkv.slice(k..k + kv_dim), &k_norm.as_view(), eps, normed_k)?;
    dev.stream().memcpy_dtod(&*scratch, &mut qkv.slice_mut(q..k + kv_dim)).map_err(|e| format!("qk norm: {e}"))
}

impl Model {
    /// Load `config.json` and the weights (`model.safetensors`, or the shards
    /// `model.safetensors.index.json` names) from an HF model directory onto the device, one tensor
    /// at a time. Errors name the missing file/tensor.
    pub fn load(dir: &Path) -> Result<Model, String> {
        let cfg = Config::load(dir)?;
        if let Some(why) = unsupported(&cfg) {
            return Err(format!("this engine runs model.llama, model.qwen3_moe and model.mixtral only: {why}"));
        }
        let dev = Device::open(0)?;
        let st = dev.stream().clone();
        let mut w = weights::read(dir)?;
        let (h, v, hd) = (cfg.hidden, cfg.vocab, cfg.head_dim);
        let (q_dim, kv_dim, inter) = (cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.intermediate);
        let up32 = |x: &[f32], what: &str| st.clone_htod(x).map_err(dev_err(what));
        let up16 = |x: &[f32], what: &str| {
            let b: Vec<u16> = x.iter().map(|&v| bf16(v)).collect();
            st.clone_htod(&b).map_err(dev_err(what))
        };
        let zeros = |n: usize, what: &str| st.alloc_zeros::<f32>(n).map_err(dev_err(what));
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let name = |n: &str| format!("model.layers.{i}.{n}");
            let mut qkv = w.take(&name("self_attn.q_proj.weight"), &[q_dim, h])?;
            qkv.extend(w.take(&name("self_attn.k_proj.weight"), &[kv_dim, h])?);
            qkv.extend(w.take(&name("self_attn.v_proj.weight"), &[kv_dim, h])?);
            let mlp = match &cfg.moe {
                Some(m) => Mlp::Moe(moe::load_layer(&mut w, i, m, h, &up16)?),
                None => {
                    let mut gate_up = w.take(&name("mlp.gate_proj.weight"), &[inter, h])?;
                    gate_up.extend(w.take(&name("mlp.up_proj.weight"), &[inter, h])?);
                    let w_down = up16(&w.take(&name("mlp.down_proj.weight"), &[h, inter])?, "w_down")?;
                    Mlp::Dense { w_gate_up: up16(&gate_up, "w_gate_up")?, w_down }
                }
            };
            let qk_norm = if cfg.features.qk_norm {
                Some((
                    up32(&w.take(&name("self_attn.q_norm.weight"), &[hd])?, "q_norm")?,
                    up32(&w.take(&name("self_attn.k_norm.weight"), &[hd])?, "k_norm")?,
                ))
            } else {
                None
            };
            layers.push(Layer {
                attn_norm: up32(&w.take(&name("input_layernorm.weight"), &[h])?, "attn_norm")?,
                wqkv: up16(&qkv, "wqkv")?,
                wo: up16(&w.take(&name("self_attn.o_proj.weight"), &[h, q_dim])?, "wo")?,
                ffn_norm: up32(&w.take(&name("post_attention_layernorm.weight"), &[h])?, "ffn_norm")?,
                mlp,
                qk_norm,
                k_cache: zeros(1, "k_cache")?,
                v_cache: zeros(1, "v_cache")?,
            });
        }
        let embed = w.take("model.embed_tokens.weight", &[v, h])?;
        let lm_head = if !cfg.tied && w.has("lm_head.weight") {
            up16(&w.take("lm_head.weight", &[v, h])?, "lm_head")?
        } else {
            up16(&embed, "lm_head")?
        };
        let rounded: Vec<f32> = embed.iter().map(|&x| widen(bf16(x))).collect();
        let positions: Vec<u32> = (0..cfg.max_seq as u32).collect();
        let group = cfg.n_heads / cfg.n_kv_heads.max(1);
        let splits = fused::attn_splits(cfg.max_seq);
        let s = Scratch {
            x: zeros(h, "x")?,
            normed: zeros(h, "normed")?,
            qkv: zeros(q_dim + 2 * kv_dim, "qkv")?,
            attn: zeros(q_dim, "attn")?,
            gate_up: zeros(2 * inter, "gate_up")?,
            act: zeros(inter, "act")?,
            logits: zeros(v, "logits")?,
            token: st.alloc_zeros::<u32>(1).map_err(dev_err("token"))?,
            trail: st.alloc_zeros::<u32>(cfg.max_seq.max(1)).map_err(dev_err("trail"))?,
            positions: st.clone_htod(&positions).map_err(dev_err("positions"))?,
            ctl: st.alloc_zeros::<u32>(4).map_err(dev_err("ctl"))?,
            q: zeros(q_dim, "q")?,
            part_v: zeros(fused::MV_MAX_BLOCKS, "part_v")?,
            part_i: st.alloc_zeros::<u32>(fused::MV_MAX_BLOCKS).map_err(dev_err("part_i"))?,
            head_ticket: st.alloc_zeros::<u32>(1).map_err(dev_err("head_ticket"))?,
            attn_ml: zeros(cfg.n_kv_heads * splits * group * 2, "attn_ml")?,
            attn_acc: zeros(cfg.n_kv_heads * splits * group * hd, "attn_acc")?,
            attn_ticket: st.alloc_zeros::<u32>(cfg.n_kv_heads.max(1)).map_err(dev_err("attn_ticket"))?,
            attn_splits: splits,
            qk: zeros(q_dim + kv_dim, "qk")?,
            moe: cfg.moe.as_ref().map(|m| MoeScratch::new(&st, m)).transpose()?,
        };
        let lm_head_ok = fused::mv_fits(&dev, &lm_head.as_view(), h);
        let fused = lm_head_ok
            && layers.iter().all(|l| {
                fused::mv_fits(&dev, &l.wqkv.as_view(), h)
                    && fused::mv_fits(&dev, &l.wo.as_view(), q_dim)
                    && l.qk_norm.is_none()
                    && l.mlp.dense().is_ok_and(|(gu, d)| {
                        fused::mv_fits(&dev, &gu.as_view(), h) && fused::mv_fits(&dev, &d.as_view(), inter)
                    })
            })
            && fused::decode_attention_fits(cfg.n_heads, cfg.n_kv_heads, hd)
            && hd.is_multiple_of(2);
        let pf = if fused && fused::prefill_attention_fits(cfg.n_heads, cfg.n_kv_heads, hd) {
            let c = PREFILL_CHUNK.min(cfg.max_seq).max(1);
            let widest = h.max(q_dim).max(inter);
            Some(PrefillScratch {
                x: zeros(c * h, "prefill x")?,
                normed: zeros(c * h, "prefill normed")?,
                qkv: zeros(c * (q_dim + 2 * kv_dim), "prefill qkv")?,
                attn: zeros(c * q_dim, "prefill attn")?,
                gate_up: zeros(c * 2 * inter, "prefill gate_up")?,
                act: zeros(c * inter, "prefill act")?,
                planes: st.alloc_zeros::<u16>(3 * c * widest).map_err(dev_err("prefill planes"))?,
            })
        } else {
            None
        };
        let graph_off = std::env::var("LLAMA_CUDA_GRAPH").is_ok_and(|v| v == "0");
        Ok(Model {
            embed: up32(&rounded, "embed")?,
            lm_head,
            final_norm: up32(&w.take("model.norm.weight", &[h])?, "final_norm")?,
            freqs: st.clone_htod(&cfg.rope_freqs()).map_err(dev_err("rope frequencies"))?,
            prompt: st.alloc_zeros::<u32>(1).map_err(dev_err("prompt"))?,
            host_logits: vec![0.0; v],
            layers,
            s,
            pf,
            fused,
            graph: None,
            graph_off,
            cfg,
            dev,
        })
    }

    /// Panics naming the first of `ids` outside the vocabulary: the embedding kernel writes no row
    /// for such an id, so the step would silently go on from the previous token's hidden state.
    fn check_ids(&self, what: &str, ids: &[u32]) {
        if let Some(t) = ids.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            panic!("{what}: token id {t} is outside the vocabulary ({})", self.cfg.vocab);
        }
    }

    /// Allocate every layer's contiguous KV cache ([max_seq, n_kv_heads, head_dim] f32 for K and
    /// for V) on the first single-sequence call; `what` names the call in the panic on a device
    /// error. The decode step's graph is captured after this, on these buffers.
    fn ensure_cache(&mut self, what: &str) {
        let len = self.cfg.max_seq * self.cfg.n_kv_heads * self.cfg.head_dim;
        if self.layers.first().is_none_or(|l| l.k_cache.len() == len) {
            return;
        }
        let st = self.dev.stream().clone();
        for l in &mut self.layers {
            l.k_cache = st.alloc_zeros::<f32>(len).unwrap_or_else(|e| panic!("{what}: allocating the KV cache: {e}"));
            l.v_cache = st.alloc_zeros::<f32>(len).unwrap_or_else(|e| panic!("{what}: allocating the KV cache: {e}"));
        }
    }

    /// Vocabulary size (length of the logits vector).
    pub fn vocab_size(&self) -> usize {
        self.cfg.vocab
    }

    /// Maximum sequence length the KV cache holds (config max_position_embeddings).
    pub fn max_seq_len(&self) -> usize {
        self.cfg.max_seq
    }

    /// Forget all cached positions.
    pub fn reset(&mut self) {
        // Positions at or beyond the next `pos` are overwritten before attention reads them; the
        // cache needs no clearing.
    }

    /// Run tokens at positions start_pos..start_pos+tokens.len(), writing their K/V into the cache;
    /// return the logits [vocab] of the last token.
    pub fn prefill(&mut self, tokens: &[u32], start_pos: usize) -> &[f32] {
        assert!(!tokens.is_empty(), "prefill: no tokens");
        assert!(
            start_pos + tokens.len() <= self.cfg.max_seq,
            "prefill: positions up to {} beyond max_position_embeddings {}",
            start_pos + tokens.len(),
            self.cfg.max_seq
        );
        self.check_ids("prefill", tokens);
        self.ensure_cache("prefill");
        if tokens.len() > 1 && self.pf.is_some() {
            self.prefill_batched(tokens, start_pos).unwrap_or_else(|e| panic!("prefill: {e}"));
            return self.read_logits();
        }
        if tokens.len() == 1 && self.fused {
            return self.forward(tokens[0], start_pos);
        }
        self.prompt =
            self.dev.stream().clone_htod(tokens).unwrap_or_else(|e| panic!("prefill: uploading the prompt: {e}"));
        for i in 0..tokens.len() {
            self.step(Token::Prompt(i), start_pos + i).unwrap_or_else(|e| panic!("prefill: {e}"));
        }
        self.read_logits()
    }

    /// Run one token at position `pos` (cache holds 0..pos), write its K/V at `pos`; return logits [vocab].
    pub fn forward(&mut self, token: u32, pos: usize) -> &[f32] {
        self.check_ids("forward", &[token]);
        self.ensure_cache("forward");
        if self.fused {
            assert!(
                pos < self.cfg.max_seq,
                "forward: position {pos} beyond max_position_embeddings {}",
                self.cfg.max_seq
            );
            self.dev
                .stream()
                .memcpy_htod(&[pos as u32, 0, token, 0], &mut self.s.ctl)
                .unwrap_or_else(|e| panic!("forward: {e}"));
            self.step_fused(false, None).unwrap_or_else(|e| panic!("forward: {e}"));
            return self.read_logits();
        }
        self.dev.stream().memcpy_htod(&[token], &mut self.s.token).unwrap_or_else(|e| panic!("forward: {e}"));
        self.step(Token::Current, pos).unwrap_or_else(|e| panic!("forward: {e}"));
        self.read_logits()
    }

    /// As `forward`, also calling `trace(layer, point, values)` for each activation point it
    /// computes, in order: `point` a node name of model.llama's [model.graph] (`layer` None in the
    /// prologue and epilogue, Some(i) in decoder layer i), `values` that node's output for this
    /// token, f32. The fused step computes the graph's `trace_required` points (embed, then per
    /// layer attn_residual and mlp_residual, then logits); the rest are fused away. Each point
    /// waits for the device and copies its values (hidden or vocab floats) to the host, so the
    /// time between two points is the device time of the kernels between them plus that copy.
    /// Shapes the fused step does not take report the same points from the per-contract path.
    #[allow(clippy::type_complexity)]
    pub fn forward_traced(
        &mut self,
        token: u32,
        pos: usize,
        trace: &mut dyn FnMut(Option<usize>, &str, &[f32]),
    ) -> &[f32] {
        assert!(
            pos < self.cfg.max_seq,
            "forward_traced: position {pos} beyond max_position_embeddings {}",
            self.cfg.max_seq
        );
        self.check_ids("forward_traced", &[token]);
        self.ensure_cache("forward_traced");
        if self.fused {
            self.dev
                .stream()
                .memcpy_htod(&[pos as u32, 0, token, 0], &mut self.s.ctl)
                .unwrap_or_else(|e| panic!("forward_traced: {e}"));
            self.step_fused(false, Some(trace)).unwrap_or_else(|e| panic!("forward_traced: {e}"));
        } else {
            self.dev
                .stream()
                .memcpy_htod(&[token], &mut self.s.token)
                .unwrap_or_else(|e| panic!("forward_traced: {e}"));
            self.step_traced(Token::Current, pos, Some(trace)).unwrap_or_else(|e| panic!("forward_traced: {e}"));
        }
        self.read_logits()
    }

    /// Greedy decoding on the device: feed `token` at `pos`, then each argmax (taken on the device) at the next position, `n` times; the host waits once. Returns the `n` tokens.
    pub fn decode_greedy(&mut self, token: u32, pos: usize, n: usize) -> Vec<u32> {
        assert!(
            pos + n <= self.cfg.max_seq,
            "decode_greedy: positions up to {} beyond max_position_embeddings {}",
            pos + n,
            self.cfg.max_seq
        );
        self.check_ids("decode_greedy", &[token]);
        self.ensure_cache("decode_greedy");
        if n == 0 {
            return Vec::new();
        }
        let st = self.dev.stream().clone();
        if self.fused {
            // The step reads position and token from ctl and its last kernel advances them.
            st.memcpy_htod(&[pos as u32, 0, token, 0], &mut self.s.ctl)
                .unwrap_or_else(|e| panic!("decode_greedy: {e}"));
            if self.graph.is_none() && !self.graph_off {
                self.capture();
            }
            for _ in 0..n {
                match &self.graph {
                    Some(g) => g.launch().map_err(|e| format!("replaying the decode step: {e}")),
                    None => self.step_fused(true, None),
                }
                .unwrap_or_else(|e| panic!("decode_greedy: {e}"));
            }
        } else {
            st.memcpy_htod(&[token], &mut self.s.token).unwrap_or_else(|e| panic!("decode_greedy: {e}"));
            for step in 0..n {
                self.step(Token::Current, pos + step).unwrap_or_else(|e| panic!("decode_greedy: {e}"));
                let Scratch { logits, token, trail, .. } = &mut self.s;
                kernels::argmax_into(
                    &self.dev,
                    &logits.as_view(),
                    &mut token.as_view_mut(),
                    Some(&mut trail.as_view_mut()),
                    step,
                )
                .unwrap_or_else(|e| panic!("decode_greedy: {e}"));
            }
        }
        st.clone_dtoh(&self.s.trail.slice(0..n)).unwrap_or_else(|e| panic!("decode_greedy: reading the tokens: {e}"))
    }

    /// Capture one fused decode step (with argmax and the advance of ctl) as a CUDA graph. Nothing
    /// runs during capture. On any failure the graph stays None and decoding launches the same
    /// kernels one by one, with the same results.
    fn capture(&mut self) {
        let st = self.dev.stream().clone();
        let captured = (|| -> Result<CudaGraph, String> {
            st.synchronize().map_err(|e| format!("synchronize: {e}"))?;
            st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| format!("begin_capture: {e}"))?;
            let stepped = self.step_fused(true, None);
            let graph = st.end_capture(CUgraphInstantiate_flags(0)).map_err(|e| format!("end_capture: {e}"));
            stepped?;
            let graph = graph?.ok_or("end_capture: an empty graph")?;
            graph.upload().map_err(|e| format!("graph upload: {e}"))?;
            Ok(graph)
        })();
        match captured {
            Ok(g) => self.graph = Some(g),
            Err(e) => {
                eprintln!(
                    "llama-cuda-bf16: decode step not captured as a CUDA graph ({e}); launching its kernels instead"
                );
                self.graph_off = true;
                // A failed capture can leave an error on the stream; this reports it if so.
                let _ = st.synchronize();
            }
        }
    }

    /// One token through the model with the fused kernels, position and token read from ctl on the
    /// device: embedding, then per layer 5 launches (qkv with norm, RoPE and cache write; decode
    /// attention; o projection with the residual; gate/up with norm; down with SiLU-and-mul and
    /// the residual), then lm_head with the final norm (and with `argmax`, the argmax and ctl
    /// advanced). 2 + 5 * n_layers launches; the host passes no per-token argument.
    fn step_fused(&mut self, argmax: bool, mut trace: Option<&mut TraceFn>) -> Result<(), String> {
        let Model { dev, cfg: c, layers, embed, lm_head, final_norm, freqs, s, .. } = self;
        let (h, hd, eps, inter) = (c.hidden, c.head_dim, c.rms_norm_eps, c.intermediate);
        let q_dim = c.n_heads * hd;
        let ids = s.ctl.slice(2..3);
        kernels::embedding(dev, &embed.as_view(), h, &ids, &mut s.x.as_view_mut())?;
        point(dev, &s.x, &mut trace, None, "embed")?;
        let ctl = s.ctl.as_view();
        for (i, l) in layers.iter_mut().enumerate() {
            let (w_gate_up, w_down) = l.mlp.dense()?;
            fused::mv_bf16_qkv(
                dev,
                &s.x.as_view(),
                &l.attn_norm.as_view(),
                eps,
                &l.wqkv.as_view(),
                &ctl,
                &freqs.as_view(),
                c.n_heads,
                c.n_kv_heads,
                hd,
                &mut s.q.as_view_mut(),
                &mut l.k_cache.as_view_mut(),
                &mut l.v_cache.as_view_mut(),
            )?;
            fused::attn_decode(
                dev,
                &s.q.as_view(),
                &l.k_cache.as_view(),
                &l.v_cache.as_view(),
                &ctl,
                c.n_heads,
                c.n_kv_heads,
                hd,
                s.attn_splits,
                &mut s.attn_ml.as_view_mut(),
                &mut s.attn_acc.as_view_mut(),
                &mut s.attn_ticket.as_view_mut(),
                &mut s.attn.as_view_mut(),
            )?;
            fused::mv_bf16(dev, &s.attn.as_view(), &l.wo.as_view(), q_dim, h, &mut s.x.as_view_mut(), true)?;
            point(dev, &s.x, &mut trace, Some(i), "attn_residual")?;
            fused::mv_bf16_norm(
                dev,
                &s.x.as_view(),
                &l.ffn_norm.as_view(),
                eps,
                &w_gate_up.as_view(),
                h,
                2 * inter,
                &mut s.gate_up.as_view_mut(),
            )?;
            fused::mv_bf16_silu(dev, &s.gate_up.as_view(), &w_down.as_view(), inter, h, &mut s.x.as_view_mut())?;
            point(dev, &s.x, &mut trace, Some(i), "mlp_residual")?;
        }
        let Scratch { x, logits, part_v, part_i, head_ticket, ctl, trail, .. } = s;
        fused::mv_bf16_head(
            dev,
            &x.as_view(),
            &final_norm.as_view(),
            eps,
            &lm_head.as_view(),
            c.vocab,
            &mut logits.as_view_mut(),
            argmax,
            &mut part_v.as_view_mut(),
            &mut part_i.as_view_mut(),
            &mut head_ticket.as_view_mut(),
            &mut ctl.as_view_mut(),
            &mut trail.as_view_mut(),
        )?;
        point(dev, logits, &mut trace, None, "logits")
    }

    /// A prompt through the model as matrix products: per chunk of up to PREFILL_CHUNK tokens,
    /// every projection one tensor-core product over all its tokens (activations split exactly
    /// into three bf16 planes, f32 accumulation), RoPE and the cache writes for all of them, causal
    /// attention over the cache; then the final norm and lm_head for the last token only.
    fn prefill_batched(&mut self, tokens: &[u32], start_pos: usize) -> Result<(), String> {
        let Model { dev, cfg: c, layers, embed, lm_head, final_norm, freqs, s, pf, .. } = self;
        let p = pf.as_mut().ok_or("prefill: no prompt scratch")?;
        let (h, hd, eps, inter) = (c.hidden, c.head_dim, c.rms_norm_eps, c.intermediate);
        let (q_dim, kv_dim) = (c.n_heads * hd, c.n_kv_heads * hd);
        let width = q_dim + 2 * kv_dim;
        let chunk = PREFILL_CHUNK.min(c.max_seq).max(1);
        let mut start = start_pos;
        let mut last_row = 0;
        for ids in tokens.chunks(chunk) {
            let m = ids.len();
            let dev_ids = dev.stream().clone_htod(ids).map_err(|e| format!("uploading the prompt: {e}"))?;
            kernels::embedding(dev, &embed.as_view(), h, &dev_ids.as_view(), &mut p.x.slice_mut(0..m * h))?;
            for l in layers.iter_mut() {
                let (w_gate_up, w_down) = l.mlp.dense()?;
                // q, k, v for every token; RoPE and the cache rows start..start + m.
                kernels::rms_norm(
                    dev,
                    &p.x.slice(0..m * h),
                    &l.attn_norm.as_view(),
                    eps,
                    &mut p.normed.slice_mut(0..m * h),
                )?;
                fused::split3(dev, &p.normed.slice(0..m * h), &mut p.planes.slice_mut(0..3 * m * h))?;
                fused::gemm_bf16x3(
                    dev,
                    &p.planes.slice(0..3 * m * h),
                    &l.wqkv.as_view(),
                    m,
                    h,
                    width,
                    &mut p.qkv.slice_mut(0..m * width),
                    false,
                )?;
                fused::rope_store_rows(
                    dev,
                    &mut p.qkv.slice_mut(0..m * width),
                    m,
                    start,
                    &freqs.as_view(),
                    c.n_heads,
                    c.n_kv_heads,
                    hd,
                    &mut l.k_cache.as_view_mut(),
                    &mut l.v_cache.as_view_mut(),
                )?;
                fused::attn_prefill(
                    dev,
                    &p.qkv.slice(0..m * width),
                    width,
                    &l.k_cache.as_view(),
                    &l.v_cache.as_view(),
                    m,
                    start,
                    c.n_heads,
                    c.n_kv_heads,
                    hd,
                    &mut p.attn.slice_mut(0..m * q_dim),
                )?;
                // x += attn Wo^T
                fused::split3(dev, &p.attn.slice(0..m * q_dim), &mut p.planes.slice_mut(0..3 * m * q_dim))?;
                fused::gemm_bf16x3(
                    dev,
                    &p.planes.slice(0..3 * m * q_dim),
                    &l.wo.as_view(),
                    m,
                    q_dim,
                    h,
                    &mut p.x.slice_mut(0..m * h),
                    true,
                )?;
                // x += (silu(norm(x) Wgate^T) * norm(x) Wup^T) Wdown^T
                kernels::rms_norm(
                    dev,
                    &p.x.slice(0..m * h),
                    &l.ffn_norm.as_view(),
                    eps,
                    &mut p.normed.slice_mut(0..m * h),
                )?;
                fused::split3(dev, &p.normed.slice(0..m * h), &mut p.planes.slice_mut(0..3 * m * h))?;
                fused::gemm_bf16x3(
                    dev,
                    &p.planes.slice(0..3 * m * h),
                    &w_gate_up.as_view(),
                    m,
                    h,
                    2 * inter,
                    &mut p.gate_up.slice_mut(0..m * 2 * inter),
                    false,
                )?;
                fused::silu_mul_rows(
                    dev,
                    &p.gate_up.slice(0..m * 2 * inter),
                    m,
                    inter,
                    &mut p.act.slice_mut(0..m * inter),
                )?;
                fused::split3(dev, &p.act.slice(0..m * inter), &mut p.planes.slice_mut(0..3 * m * inter))?;
                fused::gemm_bf16x3(
                    dev,
                    &p.planes.slice(0..3 * m * inter),
                    &w_down.as_view(),
                    m,
                    inter,
                    h,
                    &mut p.x.slice_mut(0..m * h),
                    true,
                )?;
            }
            start += m;
            last_row = m - 1;
        }
        let Scratch { logits, part_v, part_i, head_ticket, ctl, trail, .. } = s;
        fused::mv_bf16_head(
            dev,
            &p.x.slice(last_row * h..(last_row + 1) * h),
            &final_norm.as_view(),
            eps,
            &lm_head.as_view(),
            c.vocab,
            &mut logits.as_view_mut(),
            false,
            &mut part_v.as_view_mut(),
            &mut part_i.as_view_mut(),
            &mut head_ticket.as_view_mut(),
            &mut ctl.as_view_mut(),
            &mut trail.as_view_mut(),
        )
    }

    /// Copy the logits to the host (the one wait of a host-driven step).
    fn read_logits(&mut self) -> &[f32] {
        self.dev
            .stream()
            .memcpy_dtoh(&self.s.logits, &mut self.host_logits)
            .unwrap_or_else(|e| panic!("reading the logits: {e}"));
        &self.host_logits
    }

    /// One token through every layer at `pos`, on the device: the contracts' forward pass.
    fn step(&mut self, token: Token, pos: usize) -> Result<(), String> {
        self.step_traced(token, pos, None)
    }

    /// `step`, handing the graph's required points to `trace` (see `forward_traced`).
    fn step_traced(&mut self, token: Token, pos: usize, mut trace: Option<&mut TraceFn>) -> Result<(), String> {
        let Model { dev, cfg: c, layers, embed, lm_head, final_norm, freqs, s, prompt, .. } = self;
        if pos >= c.max_seq {
            return Err(format!("position {pos} is beyond max_position_embeddings {}", c.max_seq));
        }
        let (h, hd, eps, inter) = (c.hidden, c.head_dim, c.rms_norm_eps, c.intermediate);
        let (q_dim, kv_dim) = (c.n_heads * hd, c.n_kv_heads * hd);
        let ids = match token {
            Token::Current => s.token.slice(0..1),
            Token::Prompt(i) => prompt.slice(i..i + 1),
        };
        kernels::embedding(dev, &embed.as_view(), h, &ids, &mut s.x.as_view_mut())?;
        point(dev, &s.x, &mut trace, None, "embed")?;
        let position = s.positions.slice(pos..pos + 1);
        let kv_len = pos + 1;
        // Past the positions whose scores the per-token attention kernel keeps in shared memory
        // (head_dim 128 or a group that does not divide its query tile: no tiled kernel), the
        // attention is split over the sequence (flash-decoding), its position read from ctl[0].
        let split_attention = kv_len > kernels::MAX_KV_LEN
            && !fused::prefill_attention_fits(c.n_heads, c.n_kv_heads, hd)
            && fused::decode_attention_fits(c.n_heads, c.n_kv_heads, hd);
        if split_attention {
            dev.stream()
                .memcpy_htod(&[pos as u32], &mut s.ctl.slice_mut(0..1))
                .map_err(|e| format!("writing the position: {e}"))?;
        }
        for (i, l) in layers.iter_mut().enumerate() {
            // Attention block: x += o_proj(attention(rope(q), cache(rope(k), v))).
            kernels::rms_norm(dev, &s.x.as_view(), &l.attn_norm.as_view(), eps, &mut s.normed.as_view_mut())?;
            kernels::linear_bf16(
                dev,
                &s.normed.as_view(),
                &l.wqkv.as_view(),
                1,
                h,
                q_dim + 2 * kv_dim,
                &mut s.qkv.as_view_mut(),
            )?;
            // Qwen3-MoE: every q and k head RMSNormed with its gain (over head_dim) before RoPE.
            if let Some(norms) = &l.qk_norm {
                qk_norm_row(dev, norms, eps, &mut s.qkv, 0, (q_dim, kv_dim), &mut s.qk)?;
            }
            // q and k heads are contiguous in qkv and share the position: one rotation for both.
            let mut qk = s.qkv.slice_mut(0..q_dim + kv_dim);
            kernels::rope_with_freqs(dev, &mut qk, &position, c.n_heads + c.n_kv_heads, hd, &freqs.as_view())?;
            let qkv = s.qkv.as_view();
            kernels::store_kv(
                dev,
                &qkv,
                q_dim,
                q_dim + kv_dim,
                kv_dim,
                &mut l.k_cache.as_view_mut(),
                &mut l.v_cache.as_view_mut(),
                pos,
            )?;
            if split_attention {
                fused::attn_decode(
                    dev,
                    &qkv.slice(0..q_dim),
                    &l.k_cache.as_view(),
                    &l.v_cache.as_view(),
                    &s.ctl.as_view(),
                    c.n_heads,
                    c.n_kv_heads,
                    hd,
                    s.attn_splits,
                    &mut s.attn_ml.as_view_mut(),
                    &mut s.attn_acc.as_view_mut(),
                    &mut s.attn_ticket.as_view_mut(),
                    &mut s.attn.as_view_mut(),
                )?;
            } else {
                let (keys, values) = (l.k_cache.slice(0..kv_len * kv_dim), l.v_cache.slice(0..kv_len * kv_dim));
                kernels::attention(
                    dev,
                    &qkv.slice(0..q_dim),
                    &keys,
                    &values,
                    1,
                    kv_len,
                    c.n_heads,
                    c.n_kv_heads,
                    hd,
                    &mut s.attn.as_view_mut(),
                )?;
            }
            kernels::linear_bf16_into(
                dev,
                &s.attn.as_view(),
                &l.wo.as_view(),
                1,
                q_dim,
                h,
                &mut s.x.as_view_mut(),
                true,
            )?;
            point(dev, &s.x, &mut trace, Some(i), "attn_residual")?;
            // MLP block: x += down_proj(silu(gate_proj(x)) * up_proj(x)), or the mixture of experts.
            kernels::rms_norm(dev, &s.x.as_view(), &l.ffn_norm.as_view(), eps, &mut s.normed.as_view_mut())?;
            let (w_gate_up, w_down) = match &l.mlp {
                Mlp::Dense { w_gate_up, w_down } => (w_gate_up, w_down),
                Mlp::Moe(experts) => {
                    let (m, scratch) =
                        (c.moe.as_ref().ok_or("no moe config")?, s.moe.as_mut().ok_or("no moe scratch")?);
                    moe::mlp(dev, m, experts, &s.normed.as_view(), scratch, &mut s.x.as_view_mut())?;
                    point(dev, &s.x, &mut trace, Some(i), "mlp_residual")?;
                    continue;
                }
            };
            kernels::linear_bf16(
                dev,
                &s.normed.as_view(),
                &w_gate_up.as_view(),
                1,
                h,
                2 * inter,
                &mut s.gate_up.as_view_mut(),
            )?;
            kernels::silu_and_mul(
                dev,
                &s.gate_up.slice(0..inter),
                &s.gate_up.slice(inter..2 * inter),
                &mut s.act.as_view_mut(),
            )?;
            kernels::linear_bf16_into(
                dev,
                &s.act.as_view(),
                &w_down.as_view(),
                1,
                inter,
                h,
                &mut s.x.as_view_mut(),
                true,
            )?;
            point(dev, &s.x, &mut trace, Some(i), "mlp_residual")?;
        }
        kernels::rms_norm(dev, &s.x.as_view(), &final_norm.as_view(), eps, &mut s.normed.as_view_mut())?;
        kernels::linear_bf16(dev, &s.normed.as_view(), &lm_head.as_view(), 1, h, c.vocab, &mut s.logits.as_view_mut())?;
        point(dev, &s.logits, &mut trace, None, "logits")
    }
}

#[cfg(test)]
mod tests {
    /// Which of transformers' own checkpoints (../shared/conformance) this engine takes: plain
    /// Llama and the Split-expert families; Gemma 2 refused for the sliding window its config.json
    /// sets (sliding_window 4), GPT-OSS for its attention biases (attention_bias true), the first
    /// features the engine lacks, and Qwen3 for its q/k norm without experts.
    #[test]
    fn unsupported_names_what_the_engine_does_not_run() {
        // CONFORMANCE_DIR where metainfer's tests set it, else ../shared beside the repository.
        let root = std::env::var_os("CONFORMANCE_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../../shared/conformance"));
        let why = |name: &str| {
            let cfg = crate::config::Config::load(&root.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
            super::unsupported(&cfg)
        };
        for ok in ["llama", "qwen3_moe", "mixtral"] {
            assert_eq!(why(ok), None, "{ok}");
        }
        assert!(why("gemma2").is_some_and(|w| w.contains("`sliding_window`")), "{:?}", why("gemma2"));
        assert!(why("qwen3").is_some_and(|w| w.contains("mixture-of-experts")), "{:?}", why("qwen3"));
        assert!(why("gpt_oss").is_some_and(|w| w.contains("`qkv_bias`")), "{:?}", why("gpt_oss"));
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(super::bf16(1.0), 0x3F80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(super::bf16(1.0 + 1.0 / 256.0), 0x3F80);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
        assert_eq!(super::bf16(1.0 + 3.0 / 256.0), 0x3F82);
        assert!(super::widen(super::bf16(f32::NAN)).is_nan());
    }
}
