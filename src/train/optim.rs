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
    /// Where the parameter lies in the flat buffers, and its length.
    offset: usize,
    len: usize,
}

/// Adam over all parameters at once: gradients, moments and weights are handled as one flat
/// f32 vector, so that an update is a few dozen tensor operations whatever the number of
/// parameters (on a GPU each operation is a kernel launch; per-parameter updates made the
/// optimizer the slowest part of a step there). The arithmetic is elementwise and in the same
/// order as a per-parameter update, so the results are the same.
pub struct Adam {
    cfg: AdamConfig,
    slots: Vec<Slot>,
    /// First and second moments, flat.
    m: Tensor,
    v: Tensor,
    /// 1 where weight decay applies (matrices), 0 elsewhere (biases, LayerNorm).
    decay: Tensor,
    /// 0 on gradient entries that must stay zero (see [`Adam::freeze_row`]), else 1.
    grad_mask: Option<Tensor>,
    /// The weights in f32, flat: read from the parameters at the first update (and after
    /// [`Adam::load_state`]), then kept here, so that bf16 weights get f32 updates and the
    /// parameters need not be gathered at every step.
    master: Option<Tensor>,
    /// Updates applied so far.
    pub step: usize,
}

impl Adam {
    /// Adam over `vars` with zero moments.
    pub fn new(vars: Vec<(String, Var)>, cfg: AdamConfig) -> Result<Self> {
        let mut offset = 0;
        let mut decay = Vec::new();
        let mut slots = Vec::new();
        for (name, var) in vars {
            let len = var.elem_count();
            let d = if var.as_tensor().rank() >= 2 {
                1f32
            } else {
                0f32
            };
            decay.extend(std::iter::repeat_n(d, len));
            slots.push(Slot {
                name,
                var,
                offset,
                len,
            });
            offset += len;
        }
        let device = slots
            .first()
            .map(|s| s.var.device().clone())
            .unwrap_or(candle_core::Device::Cpu);
        let zeros = Tensor::zeros(offset, DType::F32, &device)?;
        Ok(Self {
            cfg,
            slots,
            m: zeros.clone(),
            v: zeros,
            decay: Tensor::from_vec(decay, offset, &device)?,
            grad_mask: None,
            master: None,
            step: 0,
        })
    }

    /// The variables, in order.
    pub fn vars(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.slots.iter().map(|s| (s.name.as_str(), &s.var))
    }

    /// Keeps row `row` of matrix parameter `name` fixed: its gradient is zeroed before the
    /// norm and the update (the shared embedding's pad row, which Marian keeps at zero).
    pub fn freeze_row(&mut self, name: &str, row: usize) -> Result<()> {
        let slot = self
            .slots
            .iter()
            .find(|s| s.name == name)
            .with_context(|| format!("no parameter {name}"))?;
        let dims = slot.var.dims();
        let cols: usize = dims[1..].iter().product();
        if dims.len() < 2 || row >= dims[0] {
            bail!("{name} {dims:?} has no row {row}");
        }
        let mut mask = match &self.grad_mask {
            Some(m) => m.to_vec1::<f32>()?,
            None => vec![1f32; self.m.elem_count()],
        };
        let start = slot.offset + row * cols;
        mask[start..start + cols].fill(0.0);
        let n = mask.len();
        self.grad_mask = Some(Tensor::from_vec(mask, n, self.m.device())?);
        Ok(())
    }

    /// One update from the summed gradients `grads` (one per parameter, in [`Adam::vars`]
    /// order): they are multiplied by `scale`, frozen entries zeroed, and clipped to a global
    /// norm of `clip_norm` (0: no clipping). Returns the global norm before clipping.
    pub fn update(&mut self, grads: &[Tensor], scale: f64, clip_norm: f64, lr: f64) -> Result<f64> {
        if grads.len() != self.slots.len() {
            bail!(
                "{} gradients for {} parameters",
                grads.len(),
                self.slots.len()
            );
        }
        let mut g = (flat(grads.iter())? * scale)?;
        if let Some(mask) = &self.grad_mask {
            g = (g * mask)?;
        }
        let norm = (g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64).sqrt();
        if clip_norm > 0.0 && norm > clip_norm {
            g = (g * (clip_norm / (norm + 1e-6)))?;
        }
        self.step += 1;
        let AdamConfig {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.cfg;
        let bc1 = 1.0 - beta1.powi(self.step as i32);
        let bc2 = 1.0 - beta2.powi(self.step as i32);
        // Detached: the optimizer's tensors must not chain a computation graph across steps
        // (the first step reads the weights, which are variables), which would keep every
        // step's tensors alive.
        let g = g.detach();
        self.m = ((&self.m * beta1)? + (&g * (1.0 - beta1))?)?.detach();
        self.v = ((&self.v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?.detach();
        let denom = ((&self.v / bc2)?.sqrt()? + eps)?;
        let step = ((&self.m / bc1)? / denom)?;
        let theta = match self.master.take() {
            Some(t) => t.detach(),
            None => flat(self.slots.iter().map(|s| s.var.as_tensor()))?,
        };
        let mut new = (&theta - (step * lr)?)?;
        if weight_decay > 0.0 {
            new = (new - ((theta * &self.decay)? * (lr * weight_decay))?)?;
        }
        for s in &self.slots {
            let t = new.narrow(0, s.offset, s.len)?.reshape(s.var.shape())?;
            s.var.set(&t.to_dtype(s.var.dtype())?)?;
        }
        self.master = Some(new.detach());
        Ok(norm)
    }

    /// The moments per parameter, named `{name}.exp_avg` and `{name}.exp_avg_sq`, for saving.
    pub fn state(&self) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::new();
        for s in &self.slots {
            let part = |t: &Tensor| t.narrow(0, s.offset, s.len)?.reshape(s.var.shape());
            out.insert(format!("{}.exp_avg", s.name), part(&self.m)?);
            out.insert(format!("{}.exp_avg_sq", s.name), part(&self.v)?);
        }
        Ok(out)
    }

    /// Restores moments saved by [`Adam::state`] and the step count.
    pub fn load_state(&mut self, path: &Path, step: usize) -> Result<()> {
        if self.slots.is_empty() {
            return Ok(());
        }
        let device = self.m.device().clone();
        let saved = candle_core::safetensors::load(path, &device)
            .with_context(|| format!("{}: cannot read optimizer state", path.display()))?;
        let (mut ms, mut vs) = (Vec::new(), Vec::new());
        for s in &self.slots {
            let get = |k: String| {
                let t = saved
                    .get(&k)
                    .with_context(|| format!("{}: {k} is missing", path.display()))?;
                if t.dims() != s.var.dims() {
                    bail!(
                        "{}: optimizer state for {} has the wrong shape",
                        path.display(),
                        s.name
                    );
                }
                Ok(t.to_dtype(DType::F32)?.flatten_all()?)
            };
            ms.push(get(format!("{}.exp_avg", s.name))?);
            vs.push(get(format!("{}.exp_avg_sq", s.name))?);
        }
        self.m = Tensor::cat(&ms, 0)?;
        self.v = Tensor::cat(&vs, 0)?;
        self.master = None; // the weights were restored too: read them again
        self.step = step;
        Ok(())
    }
}

/// The tensors as one flat f32 vector, in order.
fn flat<'a>(ts: impl Iterator<Item = &'a Tensor>) -> Result<Tensor> {
    let ts = ts
        .map(|t| t.to_dtype(DType::F32)?.flatten_all())
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&ts, 0)?)
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
            opt.update(&[grads.get(x.as_tensor()).unwrap().clone()], 1.0, 0.0, 0.05)
                .unwrap();
        }
        let v: Vec<f32> = x.as_tensor().to_vec1().unwrap();
        assert!(v.iter().all(|a| a.abs() < 0.05), "{v:?}");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("opt.safetensors");
        candle_core::safetensors::save(&opt.state().unwrap(), &p).unwrap();
        let mut again = Adam::new(vec![("x".into(), x.clone())], cfg).unwrap();
        again.load_state(&p, opt.step).unwrap();
        assert_eq!(
            again.state().unwrap()["x.exp_avg"]
                .to_vec1::<f32>()
                .unwrap(),
            opt.state().unwrap()["x.exp_avg"].to_vec1::<f32>().unwrap()
        );
        assert_eq!(again.step, 500);
    }
}
