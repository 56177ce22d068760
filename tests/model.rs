//! The model definition against transformers' MarianMTModel: logits on fixture inputs equal
//! to 1e-4 relative (fixtures from scripts/gen-model-fixtures.py).

use candle_core::{DType, Device, Tensor};
use nmt::model::weights::Weights;
use nmt::model::{ModelConfig, Seq2Seq};

mod common;
use common::{fixture, max_rel_diff};

fn ids(v: &serde_json::Value) -> Tensor {
    let rows = common::id_rows(v);
    let (b, t) = (rows.len(), rows[0].len());
    Tensor::from_vec(rows.concat(), (b, t), &Device::Cpu).unwrap()
}

/// A fixture's model in `dtype`, its inputs (source, target) and transformers' f32 logits.
fn with_transformers_logits(name: &str, dtype: DType) -> (Seq2Seq, Tensor, Tensor, Tensor) {
    let dir = fixture(name);
    let cfg = ModelConfig::load(&dir.join("config.json")).unwrap();
    let w = Weights::load(&dir.join("model.safetensors"), &Device::Cpu, dtype).unwrap();
    let model = Seq2Seq::new(&cfg, &w).unwrap();
    let f: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("logits.json")).unwrap()).unwrap();
    let want: Vec<Vec<Vec<f32>>> = serde_json::from_value(f["logits"].clone()).unwrap();
    let want = Tensor::new(want, &Device::Cpu).unwrap();
    (model, ids(&f["src"]), ids(&f["tgt_in"]), want)
}

#[test]
fn logits_equal_transformers_marian() {
    for name in ["marian-tiny", "marian-tiny-gelu"] {
        let (model, src, tgt, want) = with_transformers_logits(name, DType::F32);
        let got = model.forward(&src, &tgt).unwrap();
        // Padded target positions are not compared (their outputs are never used).
        for (b, len) in [(0usize, 5usize), (1, 3)] {
            let g = got.get(b).unwrap().narrow(0, 0, len).unwrap();
            let w = want.get(b).unwrap().narrow(0, 0, len).unwrap();
            let rel = max_rel_diff(&g, &w);
            assert!(rel < 1e-4, "{name} row {b}: relative difference {rel}");
        }
    }
}

#[test]
fn incremental_decoding_equals_the_full_forward_pass() {
    let dir = fixture("marian-tiny");
    let cfg = ModelConfig::load(&dir.join("config.json")).unwrap();
    let w = Weights::load(&dir.join("model.safetensors"), &Device::Cpu, DType::F32).unwrap();
    let model = Seq2Seq::new(&cfg, &w).unwrap();
    let src = Tensor::new(
        &[[5u32, 17, 33, 8, 42, 0], [9, 21, 0, 60, 60, 60]],
        &Device::Cpu,
    )
    .unwrap();
    let tgt = Tensor::new(&[[60u32, 7, 13, 29], [60, 44, 3, 12]], &Device::Cpu).unwrap();
    let full = model.forward(&src, &tgt).unwrap();
    let drop = nmt::model::Dropout::off();
    let bias = model.padding_bias(&src).unwrap();
    let memory = model.encode(&src, &bias, &drop).unwrap();
    let mut cache = model.start_decoding(&memory, &bias, 1).unwrap();
    for t in 0..4 {
        let step = model
            .decode_step(&tgt.narrow(1, t, 1).unwrap(), &mut cache)
            .unwrap();
        let want = full.narrow(1, t, 1).unwrap().squeeze(1).unwrap();
        let rel = max_rel_diff(&step, &want);
        assert!(rel < 1e-5, "step {t}: {rel}");
    }
}

/// The model in half precision (what `--dtype bf16|f16` runs on a GPU; the same model code
/// runs here on the CPU) stays finite and near transformers' f32 logits: the padding masks in
/// particular must not turn into NaN where f16 cannot hold their large negative value.
#[test]
fn half_precision_logits_stay_finite_and_near_f32() {
    for (dtype, tol) in [(DType::F16, 5e-3), (DType::BF16, 2e-2)] {
        let (model, src, tgt, want) = with_transformers_logits("marian-tiny", dtype);
        let got = model
            .forward(&src, &tgt)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        for (b, len) in [(0usize, 5usize), (1, 3)] {
            let g = got.get(b).unwrap().narrow(0, 0, len).unwrap();
            let w = want.get(b).unwrap().narrow(0, 0, len).unwrap();
            let rel = max_rel_diff(&g, &w);
            eprintln!("{dtype:?} row {b}: relative difference {rel:.2e}");
            assert!(
                rel <= tol,
                "{dtype:?} row {b}: relative difference {rel} > {tol}"
            );
        }
    }
}
