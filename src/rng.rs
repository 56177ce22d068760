//! A small, seedable, serialisable random number generator (SplitMix64). One `u64` of state,
//! so training can save and restore it exactly; the same on every platform.

use serde::{Deserialize, Serialize};

/// SplitMix64's state increment.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64: fast, statistically sound for shuffling, bootstrap and dropout seeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rng {
    /// The whole state.
    pub state: u64,
}

impl Rng {
    /// A generator started from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GAMMA);
        Self::mix(self.state)
    }

    /// The `k`-th draw (from 1) after the current state, without advancing: draws can be
    /// made in any order, or in parallel, and equal the sequential ones.
    pub fn draw_at(&self, k: u64) -> u64 {
        Self::mix(self.state.wrapping_add(k.wrapping_mul(GAMMA)))
    }

    /// Advances the state past `n` draws.
    pub fn skip(&mut self, n: u64) {
        self.state = self.state.wrapping_add(n.wrapping_mul(GAMMA));
    }

    /// SplitMix64's output function.
    fn mix(mut z: u64) -> u64 {
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform integer in `0..n` (`n > 0`), without modulo bias.
    pub fn below(&mut self, n: usize) -> usize {
        let n = n as u64;
        let zone = u64::MAX - u64::MAX % n;
        loop {
            let x = self.next_u64();
            if x < zone {
                return (x % n) as usize;
            }
        }
    }

    /// Fisher–Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_uniform_enough() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        assert_eq!(a.next_u64(), b.next_u64());
        // Draws at an offset equal the sequential ones, and skipping lands where drawing does.
        let ahead: Vec<u64> = (1..=3).map(|k| b.draw_at(k)).collect();
        let mut c = b;
        c.skip(3);
        assert_eq!(ahead, (0..3).map(|_| b.next_u64()).collect::<Vec<_>>());
        assert_eq!(b, c);
        let mut counts = [0usize; 4];
        for _ in 0..40_000 {
            counts[a.below(4)] += 1;
        }
        assert!(
            counts.iter().all(|&c| (9_500..10_500).contains(&c)),
            "{counts:?}"
        );
    }
}
