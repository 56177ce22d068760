//! Label-smoothed cross-entropy over the real (non-pad) target positions only.

use anyhow::Result;
use candle_core::{DType, Tensor};

/// Sum over the N rows of (1-ε)·(−log p[y]) + ε·mean_v(−log p[v]), as PyTorch's
/// `cross_entropy(label_smoothing=ε)` defines it; returns (loss sum, plain NLL sum) as
/// scalars. Logits (N, V), labels (N,).
pub fn label_smoothed_nll(
    logits: &Tensor,
    labels: &Tensor,
    epsilon: f64,
) -> Result<(Tensor, Tensor)> {
    let per_row =
        crate::model::ops::smoothed_cross_entropy(&logits.to_dtype(DType::F32)?, labels, epsilon)?;
    let sums = per_row.sum(0)?; // (2,)
    Ok((sums.get(0)?, sums.get(1)?.detach()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn matches_the_definition() {
        let logits = Tensor::new(&[[1.0f32, 2.0, 3.0], [0.5, 0.5, -1.0]], &Device::Cpu).unwrap();
        let labels = Tensor::new(&[2u32, 0], &Device::Cpu).unwrap();
        let (loss, nll) = label_smoothed_nll(&logits, &labels, 0.1).unwrap();
        let lsm = |row: [f64; 3]| {
            let m = row.iter().cloned().fold(f64::MIN, f64::max);
            let z = row.iter().map(|x| (x - m).exp()).sum::<f64>().ln() + m;
            row.map(|x| x - z)
        };
        let (a, b) = (lsm([1.0, 2.0, 3.0]), lsm([0.5, 0.5, -1.0]));
        let want_nll = -(a[2] + b[0]);
        let want = 0.9 * want_nll + 0.1 * -(a.iter().sum::<f64>() + b.iter().sum::<f64>()) / 3.0;
        assert!((nll.to_scalar::<f32>().unwrap() as f64 - want_nll).abs() < 1e-5);
        assert!((loss.to_scalar::<f32>().unwrap() as f64 - want).abs() < 1e-5);
    }
}
