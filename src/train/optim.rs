//! Adam with decoupled weight decay, gradient-norm clipping, and a state that is saved and
//! restored exactly (candle's VarMap saves weights only).

use crate::ops::{slice, wide};
use anyhow::{bail, Context, Result};
use candle_core::{CpuStorage, DType, InplaceOp1, InplaceOp2, Layout, Tensor, Var};
use rayon::prelude::*;
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

/// Adam over all parameters at once: moments and master weights are one flat f32 vector, so
/// that an update costs the same few passes whatever the number of parameters: on the CPU one
/// fused pass over memory, on a CUDA GPU three kernel launches that read each gradient and
/// write each weight where it lies (per-parameter updates made the optimizer the slowest part
/// of a step there), elsewhere a few dozen tensor operations on the gathered gradients. The
/// arithmetic is elementwise and in the same order as a per-parameter update.
pub struct Adam {
    cfg: AdamConfig,
    slots: Vec<Slot>,
    /// Parameters in all.
    n: usize,
    /// First moments, second moments and f32 master weights, flat, one after the other (3n).
    /// The master weights are read from the parameters at the first update (and after
    /// [`Adam::load_state`]), then kept here, so that bf16 weights get f32 updates and the
    /// parameters need not be gathered at every step.
    state: Tensor,
    /// Whether the master weights in `state` are current.
    master_valid: bool,
    /// 1 where weight decay applies (matrices), 0 elsewhere (biases, LayerNorm). One byte per
    /// parameter: as f32 tensors the two masks cost 8 bytes per parameter (62 MB of the
    /// yardstick model's training peak); the device path makes tensors of them when it runs.
    decay: Vec<u8>,
    /// 0 on gradient entries that must stay zero (see [`Adam::freeze_row`]), else 1.
    grad_mask: Option<Vec<u8>>,
    /// `decay` and `grad_mask` as f32 tensors on the device (not the CPU).
    device_masks: Option<(Tensor, Option<Tensor>)>,
    /// The parameters' layout and masks for the CUDA kernels, made at their first update.
    #[cfg(feature = "cuda")]
    cuda_tables: Option<super::optim_cuda::AdamTables>,
    /// The global gradient norm of the last update (before clipping), where it was computed:
    /// on a GPU, reading it would wait for the device.
    last_norm: Option<Tensor>,
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
            let d = u8::from(var.as_tensor().rank() >= 2);
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
        Ok(Self {
            cfg,
            slots,
            n: offset,
            state: Tensor::zeros(3 * offset, DType::F32, &device)?,
            master_valid: false,
            decay,
            grad_mask: None,
            device_masks: None,
            #[cfg(feature = "cuda")]
            cuda_tables: None,
            last_norm: None,
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
        let start = slot.offset + row * cols;
        let n = self.n;
        self.grad_mask.get_or_insert_with(|| vec![1; n])[start..start + cols].fill(0);
        self.device_masks = None;
        #[cfg(feature = "cuda")]
        {
            self.cuda_tables = None;
        }
        Ok(())
    }

    /// One update from the summed gradients `grads` (one per parameter, in [`Adam::vars`]
    /// order): they are multiplied by `scale`, frozen entries zeroed, and clipped to a global
    /// norm of `clip_norm` (0: no clipping); [`Adam::grad_norm`] then gives that norm.
    pub fn update(&mut self, grads: &[Tensor], scale: f64, clip_norm: f64, lr: f64) -> Result<()> {
        if grads.len() != self.slots.len() {
            bail!(
                "{} gradients for {} parameters",
                grads.len(),
                self.slots.len()
            );
        }
        #[cfg(feature = "cuda")]
        if self.n > 0 && crate::ops::cuda::serves(self.slots[0].var.as_tensor()) {
            let norm = self.update_cuda(grads, scale, clip_norm, lr)?;
            self.last_norm = Some(norm);
            return Ok(());
        }
        let g = flat(grads.iter())?;
        let norm = if g.device().is_cpu() && self.n > 0 {
            self.update_cpu(g, scale, clip_norm, lr)?
        } else {
            self.update_tensors(g, scale, clip_norm, lr)?
        };
        self.last_norm = Some(Tensor::new(norm, &candle_core::Device::Cpu)?);
        Ok(())
    }

    /// The global gradient norm (before clipping) of the last update, if any.
    pub fn grad_norm(&self) -> Result<Option<f64>> {
        Ok(match &self.last_norm {
            Some(t) => Some(t.to_dtype(DType::F64)?.to_scalar::<f64>()?),
            None => None,
        })
    }

    /// [`Adam::update`] by nmt's CUDA kernels: three launches, the gradients and parameters
    /// read and written where they lie. Returns the norm as a device scalar.
    #[cfg(feature = "cuda")]
    fn update_cuda(
        &mut self,
        grads: &[Tensor],
        scale: f64,
        clip_norm: f64,
        lr: f64,
    ) -> Result<Tensor> {
        use super::optim_cuda::{adam_update, AdamArgs, AdamTables};
        let candle_core::Device::Cuda(dev) = self.state.device() else {
            bail!("the optimizer state is not on the GPU");
        };
        if self.cuda_tables.is_none() {
            let lens: Vec<usize> = self.slots.iter().map(|s| s.len).collect();
            let tables = AdamTables::new(dev, &lens, &self.decay, self.grad_mask.as_deref())?;
            self.cuda_tables = Some(tables);
        }
        if !self.master_valid {
            let theta = flat(self.slots.iter().map(|s| s.var.as_tensor()))?;
            self.state.slice_set(&theta, 0, 2 * self.n)?;
            self.master_valid = true;
        }
        self.step += 1;
        let c = self.cfg;
        let args = AdamArgs {
            scale,
            clip_norm,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            bc1: 1.0 - c.beta1.powi(self.step as i32),
            bc2: 1.0 - c.beta2.powi(self.step as i32),
            lr,
            weight_decay: c.weight_decay,
        };
        let params: Vec<&Tensor> = self.slots.iter().map(|s| s.var.as_tensor()).collect();
        let tables = self.cuda_tables.as_ref().unwrap();
        let out = adam_update(tables, grads, &params, &self.state, &args)?;
        Ok(out.get(1)?)
    }

    /// [`Adam::update`] in tensor operations, for any device.
    fn update_tensors(&mut self, g: Tensor, scale: f64, clip_norm: f64, lr: f64) -> Result<f64> {
        if self.device_masks.is_none() {
            let device = g.device();
            let f32s = |m: &[u8]| -> Result<Tensor> {
                let v: Vec<f32> = m.iter().map(|&b| f32::from(b)).collect();
                Ok(Tensor::from_vec(v, m.len(), device)?)
            };
            let grad_mask = self.grad_mask.as_deref().map(f32s).transpose()?;
            self.device_masks = Some((f32s(&self.decay)?, grad_mask));
        }
        let (decay, grad_mask) = self.device_masks.as_ref().unwrap();
        let mut g = (g * scale)?;
        if let Some(mask) = grad_mask {
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
        let n = self.n;
        let m = ((self.state.narrow(0, 0, n)? * beta1)? + (&g * (1.0 - beta1))?)?;
        let v = ((self.state.narrow(0, n, n)? * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
        let denom = ((&v / bc2)?.sqrt()? + eps)?;
        let step = ((&m / bc1)? / denom)?;
        let theta = if self.master_valid {
            self.state.narrow(0, 2 * n, n)?
        } else {
            flat(self.slots.iter().map(|s| s.var.as_tensor()))?.detach()
        };
        let mut new = (&theta - (step * lr)?)?;
        if weight_decay > 0.0 {
            new = (new - ((theta * decay)? * (lr * weight_decay))?)?;
        }
        self.state = Tensor::cat(&[&m, &v, &new], 0)?.detach();
        self.master_valid = true;
        self.write_weights()?;
        Ok(norm)
    }

    /// [`Adam::update`] on the CPU: the gradient scaled and masked in place while its norm is
    /// summed, then moments, master weights and decay in one parallel pass over `state`.
    fn update_cpu(&mut self, g: Tensor, scale: f64, clip_norm: f64, lr: f64) -> Result<f64> {
        let n = self.n;
        // `flat` of a single tensor is that tensor: copy it before writing in place.
        let g = if self.slots.len() == 1 { g.copy()? } else { g };
        let scaled = ScaleAndNorm {
            scale: scale as f32,
            mask: self.grad_mask.as_deref(),
            sum_sq: std::sync::Mutex::new(0.0),
        };
        g.inplace_op1(&scaled)?;
        let norm = scaled.sum_sq.into_inner().unwrap().sqrt();
        let clip = if clip_norm > 0.0 && norm > clip_norm {
            clip_norm / (norm + 1e-6)
        } else {
            1.0
        };
        if !self.master_valid {
            let theta = flat(self.slots.iter().map(|s| s.var.as_tensor()))?;
            self.state.slice_set(&theta, 0, 2 * n)?;
            self.master_valid = true;
        }
        self.step += 1;
        let c = self.cfg;
        self.state.inplace_op2(
            &g,
            &AdamStep {
                n,
                wd: &self.decay,
                clip: clip as f32,
                beta1: c.beta1 as f32,
                beta2: c.beta2 as f32,
                eps: c.eps as f32,
                bc1: (1.0 - c.beta1.powi(self.step as i32)) as f32,
                bc2: (1.0 - c.beta2.powi(self.step as i32)) as f32,
                lr: lr as f32,
                decay: (lr * c.weight_decay) as f32,
            },
        )?;
        self.write_weights()?;
        Ok(norm)
    }

    /// Copies the master weights into the parameters.
    fn write_weights(&self) -> Result<()> {
        let master = self.state.narrow(0, 2 * self.n, self.n)?;
        for s in &self.slots {
            let t = master.narrow(0, s.offset, s.len)?.reshape(s.var.shape())?;
            s.var.set(&t.to_dtype(s.var.dtype())?)?;
        }
        Ok(())
    }

    /// The moments per parameter, named `{name}.exp_avg` and `{name}.exp_avg_sq`, for saving.
    pub fn state(&self) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::new();
        for s in &self.slots {
            // Copies of just this part (the state is updated in place on the CPU; `copy` would
            // clone the whole state for every part).
            let part = |at: usize| {
                self.state
                    .narrow(0, at + s.offset, s.len)?
                    .reshape(s.var.shape())?
                    .force_contiguous()
            };
            out.insert(format!("{}.exp_avg", s.name), part(0)?);
            out.insert(format!("{}.exp_avg_sq", s.name), part(self.n)?);
        }
        Ok(out)
    }

    /// Restores moments saved by [`Adam::state`] and the step count.
    pub fn load_state(&mut self, path: &Path, step: usize) -> Result<()> {
        if self.slots.is_empty() {
            return Ok(());
        }
        let device = self.state.device().clone();
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
        let zeros = Tensor::zeros(self.n, DType::F32, &device)?;
        self.state = Tensor::cat(&[Tensor::cat(&ms, 0)?, Tensor::cat(&vs, 0)?, zeros], 0)?;
        self.master_valid = false; // the weights were restored too: read them again
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

/// The contiguous f32 data of a CPU tensor's storage, writable.
fn data_mut<'a>(s: &'a mut CpuStorage, l: &Layout) -> candle_core::Result<&'a mut [f32]> {
    match (l.contiguous_offsets(), s) {
        (Some((a, b)), CpuStorage::F32(v)) => Ok(&mut v[a..b]),
        _ => candle_core::bail!("optimizer: state is not contiguous f32"),
    }
}

/// Elements per parallel task of the optimizer's passes.
const CHUNK: usize = 1 << 16;

/// g ← g · scale · mask, in place, summing the squares of the result (in f64).
struct ScaleAndNorm<'a> {
    scale: f32,
    /// 0/1 per entry; none: all 1.
    mask: Option<&'a [u8]>,
    sum_sq: std::sync::Mutex<f64>,
}

impl InplaceOp1 for ScaleAndNorm<'_> {
    fn name(&self) -> &'static str {
        "nmt-adam-scale-norm"
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout) -> candle_core::Result<()> {
        let g = data_mut(s1, l1)?;
        let scale = self.scale;
        if self.mask.is_some_and(|m| m.len() != g.len()) {
            candle_core::bail!("optimizer: gradient and mask sizes disagree");
        }
        let sum: f64 = g
            .par_chunks_mut(CHUNK)
            .enumerate()
            .map(|(c, g)| {
                let m = self.mask.map(|m| &m[c * CHUNK..c * CHUNK + g.len()]);
                let mut acc = 0f64;
                for (i, x) in g.iter_mut().enumerate() {
                    let k = m.map_or(1.0, |m| f32::from(m[i]));
                    *x *= scale * k;
                    acc += (*x as f64) * (*x as f64);
                }
                acc
            })
            // Summed in chunk order (a parallel sum's order depends on the scheduler), so the
            // norm, and with it the clipping, is the same on every run.
            .collect::<Vec<f64>>()
            .into_iter()
            .sum();
        *self.sum_sq.lock().unwrap() = sum;
        Ok(())
    }
}

/// One Adam step over the packed state [m | v | master] (3n), from the scaled gradient g and
/// the weight-decay mask: the same formulas as the tensor path in [`Adam::update`].
struct AdamStep<'a> {
    n: usize,
    /// 1 where weight decay applies, per parameter.
    wd: &'a [u8],
    clip: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    bc1: f32,
    bc2: f32,
    lr: f32,
    /// lr · weight decay
    decay: f32,
}

impl InplaceOp2 for AdamStep<'_> {
    fn name(&self) -> &'static str {
        "nmt-adam-step"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let (state, g, wd) = (data_mut(s1, l1)?, slice(s2, l2)?, self.wd);
        let n = self.n;
        if state.len() != 3 * n || g.len() != n || wd.len() != n {
            candle_core::bail!("optimizer: state, gradient and decay sizes disagree");
        }
        let (m, rest) = state.split_at_mut(n);
        let (v, w) = rest.split_at_mut(n);
        let s = self;
        m.par_chunks_mut(CHUNK)
            .zip(v.par_chunks_mut(CHUNK))
            .zip(w.par_chunks_mut(CHUNK))
            .zip(g.par_chunks(CHUNK).zip(wd.par_chunks(CHUNK)))
            .for_each(|(((m, v), w), (g, wd))| {
                wide(
                    #[inline(always)]
                    || {
                        // Equal lengths made visible, so that the loop has no bounds checks.
                        let k = m.len();
                        let (v, w, g, wd) = (&mut v[..k], &mut w[..k], &g[..k], &wd[..k]);
                        for i in 0..k {
                            let gi = g[i] * s.clip;
                            m[i] = m[i] * s.beta1 + gi * (1.0 - s.beta1);
                            v[i] = v[i] * s.beta2 + gi * gi * (1.0 - s.beta2);
                            let step = (m[i] / s.bc1) / ((v[i] / s.bc2).sqrt() + s.eps);
                            let theta = w[i];
                            w[i] = theta - step * s.lr - theta * f32::from(wd[i]) * s.decay;
                        }
                    },
                )
            });
        Ok(())
    }
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

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap().flatten_all().unwrap();
        d.max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn the_fused_cpu_step_equals_the_tensor_step() {
        let cfg = AdamConfig {
            beta1: 0.9,
            beta2: 0.98,
            eps: 1e-9,
            weight_decay: 0.01,
        };
        let init = |seed: f32| {
            let w = Tensor::arange(0f32, 12.0, &Device::Cpu).unwrap();
            let w = ((w * 0.1).unwrap() + seed as f64).unwrap();
            vec![
                (
                    "w".to_string(),
                    Var::from_tensor(&w.reshape((3, 4)).unwrap()).unwrap(),
                ),
                (
                    "b".to_string(),
                    Var::new(&[0.5f32, -0.5], &Device::Cpu).unwrap(),
                ),
            ]
        };
        let (va, vb) = (init(0.3), init(0.3));
        let mut a = Adam::new(va.clone(), cfg).unwrap();
        let mut b = Adam::new(vb.clone(), cfg).unwrap();
        a.freeze_row("w", 1).unwrap();
        b.freeze_row("w", 1).unwrap();
        for step in 0..4 {
            let grads = |vars: &[(String, Var)]| -> Vec<Tensor> {
                vars.iter()
                    .map(|(_, v)| (v.as_tensor().sin().unwrap() * (step as f64 + 1.0)).unwrap())
                    .collect()
            };
            // Clipping applies from the second step on (the norm grows with `step`).
            let clip = 4.0;
            a.update(&grads(&va), 0.5, clip, 0.01).unwrap();
            let na = a.grad_norm().unwrap().unwrap();
            let g = flat(grads(&vb).iter()).unwrap();
            let nb = b.update_tensors(g, 0.5, clip, 0.01).unwrap();
            assert!((na - nb).abs() < 1e-5 * nb, "norms {na} {nb}");
        }
        for ((_, x), (_, y)) in va.iter().zip(&vb) {
            let d = max_abs_diff(x.as_tensor(), y.as_tensor());
            assert!(d < 1e-6, "weights differ by {d}");
        }
        let row1: Vec<f32> = va[0].1.as_tensor().get(1).unwrap().to_vec1().unwrap();
        let want: Vec<f32> = (4..8).map(|i| 0.3 + i as f32 * 0.1).collect();
        // The frozen row moves only by weight decay.
        for (x, w) in row1.iter().zip(&want) {
            assert!((x - w).abs() < 1e-3 && x != w, "{row1:?}");
        }
        let (sa, sb) = (a.state().unwrap(), b.state().unwrap());
        // Each part owns its data: a view into the whole state would start at an offset.
        assert!(sa.values().all(|t| t.layout().start_offset() == 0));
        for k in ["w.exp_avg", "w.exp_avg_sq", "b.exp_avg", "b.exp_avg_sq"] {
            let d = max_abs_diff(&sa[k], &sb[k]);
            assert!(d < 1e-6, "{k} differs by {d}");
        }
    }
}
