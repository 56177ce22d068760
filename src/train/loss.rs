//! Label-smoothed cross-entropy over the real (non-pad) target positions only.

use anyhow::Result;
use candle_core::{DType, Tensor, D};

/// Sum over the N rows of (1-ε)·(−log p[y]) + ε·mean_v(−log p[v]), as PyTorch's
/// `cross_entropy(label_smoothing=ε)` defines it; returns (loss sum, plain NLL sum) as
/// scalars. Logits (N, V), labels (N,).
pub fn label_smoothed_nll(
    logits: &Tensor,
    labels: &Tensor,
    epsilon: f64,
) -> Result<(Tensor, Tensor)> {
    let logits = logits.to_dtype(DType::F32)?;
    let (_, v) = logits.dims2()?;
    let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    let nll = logp.gather(&labels.unsqueeze(1)?, 1)?.sum_all()?.neg()?;
    if epsilon == 0.0 {
        return Ok((nll.clone(), nll));
    }
    let smooth = logp.sum_all()?.neg()?;
    let loss = ((&nll * (1.0 - epsilon))? + (smooth * (epsilon / v as f64))?)?;
    Ok((loss, nll))
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
