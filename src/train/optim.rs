//! Adam with decoupled weight decay, gradient-norm clipping, and a state that is saved and
//! restored exactly (candle's VarMap saves weights only).

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, Var};
use std::collections::HashMap;
use std::path::Path;

/// Adam's hyper-parameters.
#[derive(Debug, Clone, Copy)]
pub struct AdamConfig {
    /// β₁
    pub beta1: f64,
    /// β₂
    pub beta2: f64,
    /// ε
    pub eps: f64,
    /// Decoupled weight decay (AdamW), applied to weight matrices only.
    pub weight_decay: f64,
}

/// One trainable tensor with its moments.
struct Slot {
    name: String,
    var: Var,
    m: Tensor,
    v: Tensor,
    decay: bool,
}

/// Adam over named variables.
pub struct Adam {
    cfg: AdamConfig,
    slots: Vec<Slot>,
    /// Updates applied so far.
    pub step: usize,
}

impl Adam {
    /// Adam over `vars` with zero moments.
    pub fn new(vars: Vec<(String, Var)>, cfg: AdamConfig) -> Result<Self> {
        let slots = vars
            .into_iter()
            .map(|(name, var)| {
                let z = var.as_tensor().zeros_like()?.to_dtype(DType::F32)?;
                Ok(Slot {
                    decay: var.as_tensor().rank() >= 2,
                    name,
                    m: z.clone(),
                    v: z,
                    var,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            cfg,
            slots,
            step: 0,
        })
    }

    /// The variables, in order.
    pub fn vars(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.slots.iter().map(|s| (s.name.as_str(), &s.var))
    }

    /// One update with learning rate `lr` from `grads` (same order as the variables).
    pub fn update(&mut self, grads: &[Tensor], lr: f64) -> Result<()> {
        self.step += 1;
        let AdamConfig {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.cfg;
        let bc1 = 1.0 - beta1.powi(self.step as i32);
        let bc2 = 1.0 - beta2.powi(self.step as i32);
        for (slot, g) in self.slots.iter_mut().zip(grads) {
            let g = g.to_dtype(DType::F32)?;
            slot.m = ((&slot.m * beta1)? + (&g * (1.0 - beta1))?)?;
            slot.v = ((&slot.v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
            let denom = ((&slot.v / bc2)?.sqrt()? + eps)?;
            let step = ((&slot.m / bc1)? / denom)?;
            let theta = slot.var.as_tensor().to_dtype(DType::F32)?;
            let mut new = (&theta - (step * lr)?)?;
            if slot.decay && weight_decay > 0.0 {
                new = (new - (theta * (lr * weight_decay))?)?;
            }
            slot.var.set(&new.to_dtype(slot.var.dtype())?)?;
        }
        Ok(())
    }

    /// The moments as named tensors (`NAME.exp_avg`, `NAME.exp_avg_sq`), for saving.
    pub fn state(&self) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for s in &self.slots {
            out.insert(format!("{}.exp_avg", s.name), s.m.clone());
            out.insert(format!("{}.exp_avg_sq", s.name), s.v.clone());
        }
        out
    }

    /// Restores moments saved by [`Adam::state`] and the step count.
    pub fn load_state(&mut self, path: &Path, step: usize) -> Result<()> {
        let device = self.slots.first().map(|s| s.var.device().clone());
        let Some(device) = device else { return Ok(()) };
        let saved = candle_core::safetensors::load(path, &device)
            .with_context(|| format!("{}: cannot read optimizer state", path.display()))?;
        for s in &mut self.slots {
            let get = |k: String| {
                saved
                    .get(&k)
                    .cloned()
                    .with_context(|| format!("{}: {k} is missing", path.display()))
            };
            let (m, v) = (
                get(format!("{}.exp_avg", s.name))?,
                get(format!("{}.exp_avg_sq", s.name))?,
            );
            if m.dims() != s.m.dims() || v.dims() != s.v.dims() {
                bail!(
                    "{}: optimizer state for {} has the wrong shape",
                    path.display(),
                    s.name
                );
            }
            s.m = m;
            s.v = v;
        }
        self.step = step;
        Ok(())
    }
}

/// The global L2 norm of `grads`.
pub fn global_norm(grads: &[Tensor]) -> Result<f64> {
    let mut total = 0f64;
    for g in grads {
        total += g
            .to_dtype(DType::F32)?
            .sqr()?
            .sum_all()?
            .to_scalar::<f32>()? as f64;
    }
    Ok(total.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn adam_minimises_a_quadratic_and_its_state_round_trips() {
        let x = Var::new(&[3.0f32, -2.0], &Device::Cpu).unwrap();
        let cfg = AdamConfig {
            beta1: 0.9,
            beta2: 0.98,
            eps: 1e-9,
            weight_decay: 0.0,
        };
        let mut opt = Adam::new(vec![("x".into(), x.clone())], cfg).unwrap();
        for _ in 0..500 {
            let loss = x.as_tensor().sqr().unwrap().sum_all().unwrap();
            let grads = loss.backward().unwrap();
            opt.update(&[grads.get(x.as_tensor()).unwrap().clone()], 0.05)
                .unwrap();
        }
        let v: Vec<f32> = x.as_tensor().to_vec1().unwrap();
        assert!(v.iter().all(|a| a.abs() < 0.05), "{v:?}");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("opt.safetensors");
        candle_core::safetensors::save(&opt.state(), &p).unwrap();
        let mut again = Adam::new(vec![("x".into(), x.clone())], cfg).unwrap();
        again.load_state(&p, opt.step).unwrap();
        assert_eq!(
            again.state()["x.exp_avg"].to_vec1::<f32>().unwrap(),
            opt.state()["x.exp_avg"].to_vec1::<f32>().unwrap()
        );
        assert_eq!(again.step, 500);
    }
}
