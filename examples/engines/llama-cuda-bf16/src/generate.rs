//! Phase 5, sampling (contract `component.sampler`): greedy decoding takes the argmax of the logits.
//! The device loop (`model::Model::decode_greedy`) takes it on the device with `kernels::argmax`;
//! this host function serves logits already copied to the host (verification, the first token).

/// Greedy sampler: the id of the largest logit (first on ties).
pub fn sample_greedy(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}
