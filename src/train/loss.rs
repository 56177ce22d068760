//! Label-smoothed cross-entropy over the real (non-pad) target positions only.

use anyhow::Result;
use candle_core::Tensor;

/// Sum over the N rows of (1-ε)·(−log p[y]) + ε·mean_v(−log p[v]), as PyTorch's
/// `cross_entropy(label_smoothing=ε)` defines it, where p = softmax(hidden Wᵀ + bias): the
/// model's tied output projection applied to decoder states (N, d). Returns (loss sum, plain
/// NLL sum) as scalars; only the loss sum has a gradient, and only when `with_grad`.
pub fn label_smoothed_nll(
    weight: &Tensor,
    bias: &Tensor,
    hidden: &Tensor,
    labels: &Tensor,
    epsilon: f64,
    with_grad: bool,
) -> Result<(Tensor, Tensor)> {
    let sums =
        crate::ops::projected_cross_entropy(hidden, weight, bias, labels, epsilon, with_grad)?;
    Ok((sums.get(0)?, sums.get(1)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn matches_the_definition() {
        let logits = Tensor::new(&[[1.0f32, 2.0, 3.0], [0.5, 0.5, -1.0]], &Device::Cpu).unwrap();
        let labels = Tensor::new(&[2u32, 0], &Device::Cpu).unwrap();
        // An identity projection: the hidden rows are the logits.
        let eye = Tensor::eye(3, DType::F32, &Device::Cpu).unwrap();
        let zero = Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap();
        let (loss, nll) = label_smoothed_nll(&eye, &zero, &logits, &labels, 0.1, true).unwrap();
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
