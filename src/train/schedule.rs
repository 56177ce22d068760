//! Learning-rate schedules with linear warm-up.

use serde::{Deserialize, Serialize};

/// How the learning rate evolves with the step number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Schedule {
    /// Linear warm-up to `lr`, then lr·√(warmup/step) (fairseq's inverse_sqrt).
    InverseSqrt,
    /// "Attention Is All You Need": lr·d_model^-0.5·min(step^-0.5, step·warmup^-1.5);
    /// `lr` is the paper's scale factor (1 or 2).
    Noam,
    /// Linear warm-up, then constant.
    Constant,
}

impl Schedule {
    /// The learning rate at 1-based `step`.
    pub fn lr(self, step: usize, lr: f64, warmup: usize, d_model: usize) -> f64 {
        let s = step.max(1) as f64;
        let w = warmup.max(1) as f64;
        match self {
            Schedule::InverseSqrt => lr * (s / w).min((w / s).sqrt()),
            Schedule::Noam => lr * (d_model as f64).powf(-0.5) * s.powf(-0.5).min(s * w.powf(-1.5)),
            Schedule::Constant => lr * (s / w).min(1.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Schedule::*;

    #[test]
    fn warm_up_then_decay() {
        assert!((InverseSqrt.lr(500, 1e-3, 1000, 256) - 5e-4).abs() < 1e-12);
        assert!((InverseSqrt.lr(1000, 1e-3, 1000, 256) - 1e-3).abs() < 1e-12);
        assert!((InverseSqrt.lr(4000, 1e-3, 1000, 256) - 5e-4).abs() < 1e-12);
        let peak = Noam.lr(4000, 2.0, 4000, 512);
        assert!(Noam.lr(3999, 2.0, 4000, 512) < peak && Noam.lr(4001, 2.0, 4000, 512) < peak);
        assert_eq!(Constant.lr(5000, 3e-4, 100, 256), 3e-4);
    }
}
