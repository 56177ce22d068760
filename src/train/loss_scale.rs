//! Dynamic loss scaling for f16 training (Micikevicius et al. 2018, with PyTorch GradScaler's
//! defaults): the loss is multiplied by `scale` before the backward pass so that small
//! gradients do not flush to zero in f16, and the update divides the gradients by it again. A
//! step whose gradients overflow (inf or NaN) is skipped and the scale halved; after
//! `growth_interval` good steps in a row the scale doubles. The state is saved with every
//! checkpoint, so a resumed run scales exactly as an uninterrupted one.

use serde::{Deserialize, Serialize};

/// The smallest scale: below it an overflow is not the scale's doing.
const MIN_SCALE: f64 = 1.0 / 65536.0;

/// The scaler's state.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// The current loss scale.
    pub scale: f64,
    /// Good steps since the scale last changed.
    pub good_steps: usize,
    /// Good steps in a row after which the scale doubles.
    pub growth_interval: usize,
}

impl LossScaler {
    /// A scaler starting at `scale`.
    pub fn new(scale: f64, growth_interval: usize) -> Self {
        Self {
            scale,
            good_steps: 0,
            growth_interval: growth_interval.max(1),
        }
    }

    /// Takes the outcome of a backward pass: `finite` says whether every gradient was finite.
    /// Returns whether to apply the update (false: skip it; the scale was halved).
    pub fn update(&mut self, finite: bool) -> bool {
        if !finite {
            self.scale = (self.scale / 2.0).max(MIN_SCALE);
            self.good_steps = 0;
            return false;
        }
        self.good_steps += 1;
        if self.good_steps >= self.growth_interval {
            self.scale *= 2.0;
            self.good_steps = 0;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_halves_and_skips_good_steps_double() {
        let mut s = LossScaler::new(1024.0, 3);
        assert!(!s.update(false));
        assert_eq!(s.scale, 512.0);
        assert!(s.update(true) && s.update(true));
        assert_eq!(s.scale, 512.0);
        assert!(s.update(true));
        assert_eq!((s.scale, s.good_steps), (1024.0, 0));
        // An overflow in the middle of a run of good steps starts the count again.
        assert!(s.update(true));
        assert!(!s.update(false));
        assert_eq!((s.scale, s.good_steps), (512.0, 0));
        let mut tiny = LossScaler::new(MIN_SCALE, 10);
        tiny.update(false);
        assert_eq!(tiny.scale, MIN_SCALE);
    }
}
