//! Timing statistics: median, min and max of repeated measurements. Medians, not means: the machines
//! are noisy and one descheduled run must not move the figure.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Median, min and max of one figure over the runs.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
pub struct Spread {
    /// Median.
    pub median: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
}

impl Spread {
    /// Spread of a sample; all zeros for an empty one (nothing was measured). The median of an even
    /// count is the mean of the two middle values.
    pub fn of(v: &[f64]) -> Spread {
        let mut s = v.to_vec();
        s.sort_by(|a, b| a.total_cmp(b));
        if s.is_empty() {
            return Spread { median: 0.0, min: 0.0, max: 0.0 };
        }
        let median = if s.len() % 2 == 1 { s[s.len() / 2] } else { (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0 };
        Spread { median, min: s[0], max: s[s.len() - 1] }
    }
}

/// Median of a sample (see [`Spread::of`]); 0 for an empty one.
pub fn median(v: &[f64]) -> f64 {
    Spread::of(v).median
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_by_hand() {
        assert_eq!(Spread::of(&[3.0, 1.0, 2.0]), Spread { median: 2.0, min: 1.0, max: 3.0 });
        assert_eq!(Spread::of(&[4.0, 1.0, 2.0, 3.0]), Spread { median: 2.5, min: 1.0, max: 4.0 });
        assert_eq!(Spread::of(&[]), Spread { median: 0.0, min: 0.0, max: 0.0 });
        assert_eq!(median(&[5.0, 9.0, 1.0]), 5.0);
    }
}
