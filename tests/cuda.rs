//! The model on a CUDA GPU against the same model on the CPU: logits on the fixtures agree to
//! 1e-4 relative in f32, 2e-2 in bf16 and 1e-2 in f16, incremental decoding on the GPU equals
//! its full forward pass, and training gradients equal the CPU's. Built only with `--features cuda`
//! (`scripts/build-cuda.sh --tests`); without a usable GPU the tests say so and pass, unless
//! `NMT_REQUIRE_CUDA=1` asks for one.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use nmt::cli::{DeviceArg, DtypeArg};
use nmt::commands::select_device;
use nmt::model::weights::Weights;
use nmt::model::{Dropout, ModelConfig, Seq2Seq};

mod common;
use common::{fixture, max_abs, max_rel_diff};

fn gpu() -> Option<Device> {
    match select_device(DeviceArg::Cuda, DtypeArg::F32) {
        Ok((d, _)) => Some(d),
        Err(e) if std::env::var("NMT_REQUIRE_CUDA").as_deref() != Ok("1") => {
            eprintln!("no usable CUDA GPU ({e:#}); CPU/GPU agreement not checked");
            None
        }
        Err(e) => panic!("NMT_REQUIRE_CUDA=1 but no usable CUDA GPU: {e:#}"),
    }
}

fn model(name: &str, device: &Device, dtype: DType) -> (ModelConfig, Seq2Seq) {
    let dir = fixture(name);
    let cfg = ModelConfig::load(&dir.join("config.json")).unwrap();
    let w = Weights::load(&dir.join("model.safetensors"), device, dtype).unwrap();
    let m = Seq2Seq::new(&cfg, &w).unwrap();
    (cfg, m)
}

/// A padded batch of source and target ids inside the fixture's vocabulary: rows of unequal
/// length, so that the padding masks are exercised too.
fn batch(cfg: &ModelConfig) -> (Vec<u32>, Vec<u32>) {
    let v = cfg.vocab_size as u32 - 1; // the last id is <pad>
    let pad = cfg.pad_token_id;
    let word = |i: u32| 2 + (i * 37 + 11) % (v - 2);
    let mut src = Vec::new();
    let mut tgt = Vec::new();
    for (row, (ls, lt)) in [(9u32, 7u32), (4, 3), (6, 7)].into_iter().enumerate() {
        let r = row as u32 * 13;
        src.extend((0..9).map(|i| if i < ls { word(i + r) } else { pad }));
        tgt.extend((0..7).map(|i| match i {
            0 => cfg.decoder_start_token_id,
            _ if i < lt => word(i * 3 + r),
            _ => pad,
        }));
    }
    (src, tgt)
}

fn logits(m: &Seq2Seq, src: &[u32], tgt: &[u32], device: &Device) -> Tensor {
    let s = Tensor::from_slice(src, (3, src.len() / 3), device).unwrap();
    let t = Tensor::from_slice(tgt, (3, tgt.len() / 3), device).unwrap();
    m.forward(&s, &t)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap()
}

#[test]
fn gpu_logits_equal_cpu_logits_in_f32_bf16_and_f16() {
    let Some(gpu) = gpu() else { return };
    for name in ["marian-tiny", "marian-tiny-gelu", "nmt-toy"] {
        let (cfg, cpu_model) = model(name, &Device::Cpu, DType::F32);
        let (src, tgt) = batch(&cfg);
        let want = logits(&cpu_model, &src, &tgt, &Device::Cpu);
        for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 2e-2), (DType::F16, 1e-2)] {
            let (_, gpu_model) = model(name, &gpu, dtype);
            let got = logits(&gpu_model, &src, &tgt, &gpu);
            // Only positions that hold a real target token are compared.
            for (b, len) in [(0usize, 7usize), (1, 3), (2, 7)] {
                let g = got.get(b).unwrap().narrow(0, 0, len).unwrap();
                let w = want.get(b).unwrap().narrow(0, 0, len).unwrap();
                let rel = max_rel_diff(&g, &w);
                eprintln!("{name} {dtype:?} row {b}: relative difference {rel:.2e}");
                assert!(rel <= tol, "{name} {dtype:?} row {b}: {rel} > {tol}");
            }
        }
    }
}

#[test]
fn incremental_decoding_on_the_gpu_equals_its_full_forward_pass() {
    let Some(gpu) = gpu() else { return };
    let (cfg, m) = model("nmt-toy", &gpu, DType::F32);
    let (src, tgt) = batch(&cfg);
    let s = Tensor::from_slice(&src, (3, 9), &gpu).unwrap();
    let t = Tensor::from_slice(&tgt, (3, 7), &gpu).unwrap();
    let full = m.forward(&s, &t).unwrap();
    let drop = nmt::model::Dropout::off();
    let bias = m.padding_bias(&s).unwrap();
    let memory = m.encode(&s, &bias, &drop).unwrap();
    let mut cache = m.start_decoding(&memory, &bias, 1).unwrap();
    for i in 0..7 {
        let step = m
            .decode_step(&t.narrow(1, i, 1).unwrap(), &mut cache)
            .unwrap();
        let want = full.narrow(1, i, 1).unwrap().squeeze(1).unwrap();
        // Rows whose target has ended (padding) are not compared.
        for (b, len) in [(0usize, 7usize), (1, 3), (2, 7)] {
            if i < len {
                let rel = max_rel_diff(&step.get(b).unwrap(), &want.get(b).unwrap());
                assert!(rel < 1e-5, "step {i} row {b}: {rel}");
            }
        }
    }
}

/// One training loss (label-smoothed cross-entropy) and its gradient for every parameter, on
/// `device`, from weights initialised with a fixed seed; with `dropout`, at rate 0.1 on every
/// site (residual, attention probabilities, FFN activations) from a fixed mask seed.
fn loss_and_grads(
    cfg: &ModelConfig,
    device: &Device,
    dropout: bool,
) -> (f32, Vec<(String, Tensor)>) {
    let mut cfg = cfg.clone();
    let drop = if dropout {
        (cfg.dropout, cfg.attention_dropout, cfg.activation_dropout) = (0.1, 0.1, 0.1);
        Dropout::on(11)
    } else {
        Dropout::off()
    };
    let w = Weights::init(7, device, DType::F32);
    let m = Seq2Seq::new(&cfg, &w).unwrap();
    let (src, tgt_in) = batch(&cfg);
    let s = Tensor::from_slice(&src, (3, 9), device).unwrap();
    let t = Tensor::from_slice(&tgt_in, (3, 7), device).unwrap();
    // Labels: the next input token; the last position of each row predicts </s> (id 0).
    let labels: Vec<u32> = tgt_in
        .chunks(7)
        .flat_map(|row| row[1..].iter().copied().chain([0]).collect::<Vec<_>>())
        .collect();
    let labels = Tensor::from_vec(labels, 21, device).unwrap();
    let src_bias = m.padding_bias(&s).unwrap();
    let memory = m.encode(&s, &src_bias, &drop).unwrap();
    let tgt_bias = m
        .causal_bias(7)
        .unwrap()
        .broadcast_add(&m.length_bias(&[7, 3, 7], 7).unwrap())
        .unwrap();
    let h = m.decode(&t, &tgt_bias, &memory, &src_bias, &drop).unwrap();
    let logits = m.logits(&h.flatten(0, 1).unwrap()).unwrap();
    let per_row = nmt::ops::smoothed_cross_entropy(&logits, &labels, 0.1).unwrap();
    let loss = per_row.narrow(1, 0, 1).unwrap().sum_all().unwrap();
    let store = loss.backward().unwrap();
    let grads = w
        .vars()
        .into_iter()
        .map(|(name, v)| {
            let g = store
                .get(v.as_tensor())
                .expect("every parameter has a gradient");
            (name, g.to_device(&Device::Cpu).unwrap())
        })
        .collect();
    (loss.to_scalar::<f32>().unwrap(), grads)
}

/// Loss and gradients on the GPU against the CPU's.
fn gradients_agree(dropout: bool) {
    let Some(gpu) = gpu() else { return };
    let cfg = ModelConfig::load(&fixture("nmt-toy").join("config.json")).unwrap();
    let (cpu_loss, cpu_grads) = loss_and_grads(&cfg, &Device::Cpu, dropout);
    let (gpu_loss, gpu_grads) = loss_and_grads(&cfg, &gpu, dropout);
    eprintln!("dropout {dropout}: loss: CPU {cpu_loss}, GPU {gpu_loss}");
    assert!(((cpu_loss - gpu_loss) / cpu_loss).abs() < 1e-5);
    assert_eq!(cpu_grads.len(), gpu_grads.len());
    // Differences relative to the largest gradient entry of the model: some gradients are zero
    // in exact arithmetic (the key projections' biases: softmax ignores a constant shift) and
    // hold only rounding noise, which a per-tensor ratio would magnify.
    let scale = cpu_grads
        .iter()
        .map(|(_, c)| max_abs(c))
        .fold(0f32, f32::max);
    let mut worst = (0f32, String::new());
    for ((name, c), (_, g)) in cpu_grads.iter().zip(&gpu_grads) {
        let rel = max_abs(&(g - c).unwrap()) / scale;
        if rel > worst.0 {
            worst = (rel, name.clone());
        }
    }
    eprintln!(
        "dropout {dropout}: largest relative gradient difference: {:.2e} ({})",
        worst.0, worst.1
    );
    assert!(worst.0 < 1e-4, "{} differs by {}", worst.1, worst.0);
}

#[test]
fn gpu_training_gradients_equal_cpu_gradients() {
    gradients_agree(false);
}

/// The GPU draws the CPU's dropout masks: with dropout on everywhere, loss and gradients still
/// agree.
#[test]
fn gpu_dropout_draws_the_cpu_masks() {
    gradients_agree(true);
}

/// Adam by the CUDA kernels (gradients and weights read and written in place, parameters
/// longer than one 4,096-element chunk, a frozen row, weight decay, clipping from the second
/// step on) against Adam on the CPU.
#[test]
fn gpu_adam_equals_cpu_adam() {
    use nmt::train::optim::{Adam, AdamConfig};
    let Some(gpu) = gpu() else { return };
    let cfg = AdamConfig {
        beta1: 0.9,
        beta2: 0.98,
        eps: 1e-9,
        weight_decay: 0.01,
    };
    let run = |dev: &Device| {
        let w = Tensor::arange(0f32, 7000.0, dev).unwrap();
        let w = (w * 1e-3)
            .unwrap()
            .sin()
            .unwrap()
            .reshape((70, 100))
            .unwrap();
        let w = candle_core::Var::from_tensor(&w).unwrap();
        let b = candle_core::Var::new(&[0.5f32, -0.5, 0.25], dev).unwrap();
        let mut opt =
            Adam::new(vec![("w".into(), w.clone()), ("b".into(), b.clone())], cfg).unwrap();
        opt.freeze_row("w", 3).unwrap();
        let mut norms = Vec::new();
        for step in 1..=4 {
            let grads = [
                (w.as_tensor().cos().unwrap() * step as f64).unwrap(),
                (b.as_tensor().sin().unwrap() * step as f64).unwrap(),
            ];
            opt.update(&grads, 0.5, 40.0, 0.01).unwrap();
            norms.push(opt.grad_norm().unwrap().unwrap());
        }
        let host = |t: &Tensor| t.flatten_all().unwrap().to_device(&Device::Cpu).unwrap();
        let mut state: Vec<_> = opt.state().unwrap().into_iter().collect();
        state.sort_by(|a, b| a.0.cmp(&b.0));
        let state: Vec<Tensor> = state.iter().map(|(_, t)| host(t)).collect();
        (vec![host(w.as_tensor()), host(b.as_tensor())], norms, state)
    };
    let (cpu_w, cpu_norms, cpu_state) = run(&Device::Cpu);
    let (gpu_w, gpu_norms, gpu_state) = run(&gpu);
    eprintln!("gradient norms: CPU {cpu_norms:?}, GPU {gpu_norms:?}");
    assert!(cpu_norms[1] > 40.0, "clipping must be exercised");
    for (c, g) in cpu_norms.iter().zip(&gpu_norms) {
        assert!((c - g).abs() < 1e-5 * c, "norms {c} {g}");
    }
    for (c, g) in cpu_w
        .iter()
        .zip(&gpu_w)
        .chain(cpu_state.iter().zip(&gpu_state))
    {
        let d = max_abs(&(c - g).unwrap());
        eprintln!("largest difference: {d:.2e}");
        assert!(d < 1e-6, "differs by {d}");
    }
}
