//! Phase 5: sampling.
use crate::kernels;

/// Greedy sampler: the id of the largest logit (first on ties).
pub fn sample_greedy(logits: &[f32]) -> u32 {
    kernels::argmax(logits) as u32
}
