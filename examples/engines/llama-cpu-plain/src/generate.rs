//! Phase 5, sampling (contract `component.sampler`): greedy decoding takes the argmax of the logits.

use crate::kernels;

/// Greedy sampler: the id of the largest logit (first on ties).
pub fn sample_greedy(logits: &[f32]) -> u32 {
    kernels::argmax(logits) as u32
}
