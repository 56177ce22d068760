//! Where the model's tensors come from: a checkpoint (HF tensor names) or, for a new model,
//! deterministic initialisation into trainable variables. The VarBuilder-style path of each
//! tensor *is* its name in `model.safetensors`.

use crate::ops::packed::ComputeType;
use crate::rng::Rng;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// How a new parameter is initialised.
#[derive(Debug, Clone, Copy)]
pub enum Init {
    /// All zeros (biases).
    Zeros,
    /// All ones (LayerNorm gains).
    Ones,
    /// Normal(0, std) with the row `zero_row` (the pad embedding) set to zero.
    Normal { std: f64, zero_row: Option<usize> },
    /// Xavier/Glorot uniform for a (fan_out, fan_in) matrix.
    XavierUniform,
}

enum Source {
    Loaded {
        tensors: Tensors,
        path: PathBuf,
    },
    Init {
        rng: RefCell<Rng>,
        vars: RefCell<Vec<(String, Var)>>,
        buffers: RefCell<Vec<(String, Tensor)>>,
        /// Pretrained tensors the variables start from (fine-tuning), and their file.
        from: Option<(Tensors, PathBuf)>,
    },
}

/// The tensors a model is built from.
pub struct Weights {
    source: Source,
    device: Device,
    dtype: DType,
    /// How loaded linear layers compute.
    compute: ComputeType,
}

/// Other names under which transformers may have saved the tied embedding.
const SHARED_ALIASES: &[&str] = &[
    "model.shared.weight",
    "model.encoder.embed_tokens.weight",
    "model.decoder.embed_tokens.weight",
    "lm_head.weight",
];

/// The tensors of a weights file by name: `model.safetensors`, or a PyTorch
/// `pytorch_model.bin` (read without executing its pickle). Weights are read here or, a
/// tensor at a time as the model asks, by [`Weights::load`]: both through [`Tensors::open`].
pub fn read_tensors(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    match Tensors::open(path, device)? {
        Tensors::Memory(tensors) => Ok(tensors),
        Tensors::Mapped(m) => m
            .index
            .iter()
            .map(|(name, entry)| {
                let t = m
                    .copy_out(entry, device)
                    .with_context(|| format!("{}: tensor {name}", path.display()))?;
                Ok((name.clone(), t))
            })
            .collect(),
    }
}

impl Weights {
    /// Tensors from a `model.safetensors` file (or a PyTorch `pytorch_model.bin`, as older
    /// OPUS-MT repos publish, read without executing its pickle), converted to `dtype` on
    /// `device`.
    pub fn load(path: &Path, device: &Device, dtype: DType) -> Result<Self> {
        let tensors = Tensors::open(path, device)?;
        Ok(Self {
            source: Source::Loaded {
                tensors,
                path: path.to_path_buf(),
            },
            device: device.clone(),
            dtype,
            compute: ComputeType::Float32,
        })
    }

    /// Tensors already in memory (averaged checkpoints, tests).
    pub fn from_tensors(tensors: HashMap<String, Tensor>, device: &Device, dtype: DType) -> Self {
        Self {
            source: Source::Loaded {
                tensors: Tensors::Memory(tensors),
                path: PathBuf::from("<memory>"),
            },
            device: device.clone(),
            dtype,
            compute: ComputeType::Float32,
        }
    }

    /// Fresh trainable variables, initialised from `seed`.
    pub fn init(seed: u64, device: &Device, dtype: DType) -> Self {
        Self {
            source: Source::Init {
                rng: RefCell::new(Rng::new(seed)),
                vars: RefCell::new(Vec::new()),
                buffers: RefCell::new(Vec::new()),
                from: None,
            },
            device: device.clone(),
            dtype,
            compute: ComputeType::Float32,
        }
    }

    /// Trainable variables starting from the tensors of the weights file `path` (fine-tuning):
    /// every tensor the model asks for must be there, with its shape.
    pub fn start_from(path: &Path, device: &Device, dtype: DType) -> Result<Self> {
        let tensors = read_tensors(path, device)?;
        Ok(Self {
            source: Source::Init {
                rng: RefCell::new(Rng::new(0)),
                vars: RefCell::new(Vec::new()),
                buffers: RefCell::new(Vec::new()),
                from: Some((Tensors::Memory(tensors), path.to_path_buf())),
            },
            device: device.clone(),
            dtype,
            compute: ComputeType::Float32,
        })
    }

    /// The same weights, their linear layers computing as `compute`.
    pub fn computing(self, compute: ComputeType) -> Self {
        Self { compute, ..self }
    }

    /// How loaded linear layers compute (`--compute-type`).
    pub fn compute(&self) -> ComputeType {
        self.compute
    }

    /// How a linear layer made from these weights computes: `None` for trainable variables,
    /// which change at every step and keep the general product.
    pub fn packing(&self) -> Option<ComputeType> {
        self.is_loaded().then_some(self.compute)
    }

    /// Whether the tensors come from a file (fixed for the model's lifetime) rather than
    /// trainable variables.
    pub fn is_loaded(&self) -> bool {
        matches!(self.source, Source::Loaded { .. })
    }

    /// The device tensors live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The trainable variables created so far, in creation order, with their names.
    pub fn vars(&self) -> Vec<(String, Var)> {
        match &self.source {
            Source::Init { vars, .. } => vars.borrow().clone(),
            Source::Loaded { .. } => Vec::new(),
        }
    }

    /// Every tensor of the model by checkpoint name: trainable variables and buffers.
    pub fn named_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        match &self.source {
            Source::Init { vars, buffers, .. } => Ok(vars
                .borrow()
                .iter()
                .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
                .chain(buffers.borrow().iter().cloned())
                .collect()),
            Source::Loaded { tensors, path } => {
                let mut names = tensors.names();
                names.sort();
                names
                    .into_iter()
                    .map(|n| {
                        let t = tensors
                            .get(&n, &self.device)
                            .with_context(|| format!("{}: tensor {n}", path.display()))?;
                        Ok((n, t.expect("a tensor of its own names")))
                    })
                    .collect()
            }
        }
    }

    /// A zero-initialised buffer that is saved but not trained (`final_logits_bias`); a
    /// checkpoint without it gets zeros, as in transformers.
    pub fn buffer(&self, name: &str, dims: &[usize]) -> Result<Tensor> {
        match &self.source {
            Source::Loaded { tensors, .. } if !tensors.contains(name) => {
                Ok(Tensor::zeros(dims, self.dtype, &self.device)?)
            }
            Source::Loaded { .. } => self.get(name, dims, Init::Zeros),
            Source::Init { buffers, from, .. } => {
                let t = match from {
                    Some((tensors, path)) if tensors.contains(name) => {
                        self.pretrained(tensors, path, name, dims)?
                    }
                    _ => Tensor::zeros(dims, self.dtype, &self.device)?,
                };
                buffers.borrow_mut().push((name.to_string(), t.clone()));
                Ok(t)
            }
        }
    }

    /// The tensor `name` of shape `dims`; created with `init` for a new model.
    pub fn get(&self, name: &str, dims: &[usize], init: Init) -> Result<Tensor> {
        match &self.source {
            Source::Loaded { tensors, path } => self.pretrained(tensors, path, name, dims),
            Source::Init {
                vars,
                from: Some((tensors, path)),
                ..
            } => {
                let t = self.pretrained(tensors, path, name, dims)?;
                let var = Var::from_tensor(&t).with_context(|| format!("creating {name}"))?;
                vars.borrow_mut().push((name.to_string(), var.clone()));
                Ok(var.as_tensor().clone())
            }
            Source::Init { rng, vars, .. } => {
                let n: usize = dims.iter().product();
                let mut rng = rng.borrow_mut();
                let data: Vec<f32> = match init {
                    Init::Zeros => vec![0.0; n],
                    Init::Ones => vec![1.0; n],
                    Init::Normal { std, zero_row } => {
                        let mut d: Vec<f32> =
                            (0..n).map(|_| (normal(&mut rng) * std) as f32).collect();
                        if let Some(r) = zero_row {
                            let w = dims[1];
                            d[r * w..(r + 1) * w].iter_mut().for_each(|x| *x = 0.0);
                        }
                        d
                    }
                    Init::XavierUniform => {
                        let bound = (6.0 / (dims[0] + dims[1]) as f64).sqrt();
                        (0..n)
                            .map(|_| ((uniform(&mut rng) * 2.0 - 1.0) * bound) as f32)
                            .collect()
                    }
                };
                let t = Tensor::from_vec(data, dims, &self.device)?.to_dtype(self.dtype)?;
                let var = Var::from_tensor(&t).with_context(|| format!("creating {name}"))?;
                vars.borrow_mut().push((name.to_string(), var.clone()));
                Ok(var.as_tensor().clone())
            }
        }
    }
}

impl Weights {
    /// Tensor `name` of a weights file (the tied embedding under any of its names), checked
    /// against the shape the config implies, in the model's dtype.
    fn pretrained(
        &self,
        tensors: &Tensors,
        path: &Path,
        name: &str,
        dims: &[usize],
    ) -> Result<Tensor> {
        let stored = if SHARED_ALIASES.contains(&name) {
            SHARED_ALIASES.iter().copied().find(|n| tensors.contains(n))
        } else {
            Some(name)
        };
        let t = match stored {
            Some(n) => tensors
                .get(n, &self.device)
                .with_context(|| format!("{}: tensor {n}", path.display()))?,
            None => None,
        };
        let t = t.ok_or_else(|| anyhow!("{}: tensor {name} is missing", path.display()))?;
        if t.dims() != dims {
            bail!(
                "{}: tensor {name} has shape {:?}, the config implies {:?}",
                path.display(),
                t.dims(),
                dims
            );
        }
        Ok(t.to_dtype(self.dtype)?)
    }
}

/// The tensors of a weights file, by name.
enum Tensors {
    /// All in memory: a PyTorch file, averaged checkpoints, tests, fine-tuning's start.
    Memory(HashMap<String, Tensor>),
    /// A safetensors file mapped into memory, each tensor copied out when the model asks for
    /// it: loading holds one copy of each weight (packed layers release theirs), not the whole
    /// file and every tensor at once.
    Mapped(Mapped),
}

/// A mapped safetensors file and where each tensor lies in it.
struct Mapped {
    map: memmap2::Mmap,
    /// Per tensor: its dtype, shape and bytes in `map`.
    index: HashMap<String, (safetensors::Dtype, Vec<usize>, std::ops::Range<usize>)>,
}

impl Mapped {
    fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path)
            .with_context(|| format!("{}: cannot open", path.display()))?;
        // SAFETY: weights files are written under a temporary name and renamed into place;
        // nmt never modifies one afterwards, and a tensor is copied out before it is used.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("{}: cannot map", path.display()))?;
        let (header, metadata) = safetensors::SafeTensors::read_metadata(&map)
            .map_err(|e| anyhow!("{}: not a valid safetensors file: {e}", path.display()))?;
        let start = 8 + header;
        let index = metadata
            .tensors()
            .into_iter()
            .map(|(name, info)| {
                let (a, b) = info.data_offsets;
                (name, (info.dtype, info.shape.clone(), start + a..start + b))
            })
            .collect();
        Ok(Self { map, index })
    }

    /// A copy of the tensor at `entry` (of `index`) on `device`, its pages then dropped from
    /// the mapping.
    fn copy_out(
        &self,
        (dtype, shape, bytes): &(safetensors::Dtype, Vec<usize>, std::ops::Range<usize>),
        device: &Device,
    ) -> Result<Tensor> {
        let view =
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), &self.map[bytes.clone()])?;
        let t = candle_core::safetensors::Load::load(&view, device)?;
        check_finite(&t)?;
        // The copy is made: the file's pages can leave this process (they stay in the page
        // cache). Only a hint; on failure they stay until the unmapping.
        // SAFETY: no reference into these bytes outlives `view`, and the mapping is read-only,
        // so dropping its pages only makes a later read fetch them again.
        let _ = unsafe {
            self.map.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                bytes.start,
                bytes.len(),
            )
        };
        Ok(t)
    }
}

impl Tensors {
    /// The tensors of `path`: a safetensors file mapped, a PyTorch file read whole.
    fn open(path: &Path, device: &Device) -> Result<Self> {
        if !path.is_file() {
            bail!("{}: no such weights file", path.display());
        }
        if path.extension().is_some_and(|e| e == "bin") {
            candle_core::pickle::read_all(path)
                .map_err(|e| anyhow!("{}: not a valid PyTorch weights file: {e}", path.display()))?
                .into_iter()
                .map(|(k, t)| {
                    check_finite(&t).with_context(|| format!("{}: tensor {k}", path.display()))?;
                    Ok((k, t.to_device(device)?))
                })
                .collect::<Result<_>>()
                .map(Tensors::Memory)
        } else {
            Mapped::open(path).map(Tensors::Mapped)
        }
    }

    fn contains(&self, name: &str) -> bool {
        match self {
            Tensors::Memory(t) => t.contains_key(name),
            Tensors::Mapped(m) => m.index.contains_key(name),
        }
    }

    fn names(&self) -> Vec<String> {
        match self {
            Tensors::Memory(t) => t.keys().cloned().collect(),
            Tensors::Mapped(m) => m.index.keys().cloned().collect(),
        }
    }

    /// Tensor `name` on `device`; `None` if the file has none.
    fn get(&self, name: &str, device: &Device) -> Result<Option<Tensor>> {
        match self {
            Tensors::Memory(t) => Ok(t.get(name).cloned()),
            Tensors::Mapped(m) => m.index.get(name).map(|e| m.copy_out(e, device)).transpose(),
        }
    }
}

/// Fails if `t` holds a NaN or an infinity: a damaged checkpoint, or one saved after training
/// diverged, would otherwise load and translate, silently wrong (a NaN weight in a ReLU layer
/// reads as zero).
fn check_finite(t: &Tensor) -> Result<()> {
    if !t.dtype().is_float() {
        return Ok(());
    }
    let finite = if t.device().is_cpu() && t.dtype() == DType::F32 {
        // Read in place: a zeroed copy of every tensor, only to test it, doubled the fresh
        // memory a load touched.
        crate::ops::with_host_f32(t, crate::ops::cpu::all_finite)?
    } else {
        // 0 · x is 0 for every finite x and NaN for a NaN or an infinity, and so is the sum:
        // one scalar comes back from the device.
        let sum = t.affine(0.0, 0.0)?.sum_all()?.to_dtype(DType::F32)?;
        !sum.to_scalar::<f32>()?.is_nan()
    };
    if !finite {
        bail!("holds NaN or infinite values: the checkpoint is damaged (was it saved after training diverged?)");
    }
    Ok(())
}

fn uniform(rng: &mut Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// A standard normal sample (Box–Muller).
pub fn normal(rng: &mut Rng) -> f64 {
    let u1 = uniform(rng).max(f64::MIN_POSITIVE);
    let u2 = uniform(rng);
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}
