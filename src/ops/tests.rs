//! Each op against its Candle composite (the oracle), values and gradients.

use super::cpu::*;
use super::cross_entropy::*;
use super::dropout::*;
use super::embedding::*;
use super::layer_norm::*;
use super::linear::*;
use super::residual_norm::*;
use super::softmax::*;
use super::with_grad::*;
use super::*;
use crate::rng::Rng;
use candle_core::{Device, Var, D};

/// A CPU f32 tensor of `shape` with standard normal values drawn from `seed`.
pub(crate) fn randn(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = crate::rng::Rng::new(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| crate::model::weights::normal(&mut rng) as f32)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// The largest absolute difference between two tensors of one shape.
pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Values and gradients of a fused op equal those of the composite fallback (run on the
/// same inputs converted to f64, which takes the composite path).
fn check(f: impl Fn(&[Tensor]) -> Tensor, inputs: &[Tensor], weights: &Tensor) {
    let run = |dtype: DType| {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|t| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap())
            .collect();
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts);
        let loss = (y.to_dtype(DType::F32).unwrap() * weights)
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        let g: Vec<Tensor> = vars
            .iter()
            .map(|v| {
                grads
                    .get(v.as_tensor())
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
            })
            .collect();
        (y.to_dtype(DType::F32).unwrap(), g)
    };
    let (y1, g1) = run(DType::F32);
    let (y2, g2) = run(DType::F64);
    assert!(
        max_diff(&y1, &y2) < 1e-4,
        "values differ by {}",
        max_diff(&y1, &y2)
    );
    for (a, b) in g1.iter().zip(&g2) {
        assert!(
            max_diff(a, b) < 1e-4,
            "gradients differ by {}",
            max_diff(a, b)
        );
    }
}

/// Values and gradients of `f` and `g` on the same f32 inputs agree.
fn same_grads(f: impl Fn(&Tensor) -> Tensor, g: impl Fn(&Tensor) -> Tensor, x: &Tensor) {
    let wts = randn(x.dims(), 99);
    let run = |h: &dyn Fn(&Tensor) -> Tensor| {
        let v = Var::from_tensor(x).unwrap();
        let y = h(v.as_tensor());
        let grads = (&y * &wts).unwrap().sum_all().unwrap().backward().unwrap();
        (y, grads.get(v.as_tensor()).unwrap().clone())
    };
    let ((y1, g1), (y2, g2)) = (run(&f), run(&g));
    assert!(
        max_diff(&y1, &y2) < 1e-5,
        "values differ by {}",
        max_diff(&y1, &y2)
    );
    assert!(
        max_diff(&g1, &g2) < 1e-5,
        "gradients differ by {}",
        max_diff(&g1, &g2)
    );
}

#[test]
fn gpu_paths_have_the_composites_gradients() {
    // The kernels the GPU path uses also run on the CPU, so their backward is checked here.
    let x = randn(&[3, 5, 8], 7);
    let (w, b) = (randn(&[8], 8), randn(&[8], 9));
    let composite = |x: &Tensor| {
        let mean = x.mean_keepdim(D::Minus1)?;
        let centred = x.broadcast_sub(&mean)?;
        let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centred.broadcast_div(&(var + 1e-5)?.sqrt()?)?;
        normed.broadcast_mul(&w)?.broadcast_add(&b)
    };
    same_grads(
        |x| layer_norm_kernels(x, &w, &b, 1e-5).unwrap(),
        |x| composite(x).unwrap(),
        &x,
    );
    same_grads(
        |x| softmax_kernels(x).unwrap(),
        |x| candle_nn::ops::softmax(x, D::Minus1).unwrap(),
        &x,
    );
}

#[test]
fn layer_norm_matches_the_composite() {
    let (x, w, b) = (randn(&[3, 5, 8], 1), randn(&[8], 2), randn(&[8], 3));
    check(
        |t| layer_norm(&t[0], &t[1], &t[2], 1e-5).unwrap(),
        &[x, w, b],
        &randn(&[3, 5, 8], 4),
    );
}

/// A dropout mask with p = 0.3 and its values for `n` elements.
fn test_mask(n: usize) -> (DropoutMask, Tensor) {
    let mask = DropoutMask {
        rng: Rng::new(5),
        threshold: (0.3 * (1u64 << 32) as f64) as u64,
        keep: 1.0 / 0.7,
    };
    let values = Tensor::from_vec(mask.values(n), n, &Device::Cpu).unwrap();
    (mask, values)
}

#[test]
fn dropout_masks_follow_the_sequential_stream() {
    // Element 2j uses the low half of draw j + 1, element 2j + 1 its high half; an odd
    // length and more than one parallel block.
    let n = 2 * DropoutMask::CHUNK + 7;
    let (mask, values) = test_mask(n);
    let values = values.to_vec1::<f32>().unwrap();
    let mut rng = mask.rng;
    for j in 0..n.div_ceil(2) {
        let r = rng.next_u64();
        for (k, half) in [r & 0xffff_ffff, r >> 32].into_iter().enumerate() {
            if let Some(&v) = values.get(2 * j + k) {
                assert_eq!(
                    v,
                    if half < mask.threshold {
                        0.0
                    } else {
                        mask.keep
                    }
                );
            }
        }
    }
    let kept = values.iter().filter(|&&v| v > 0.0).count() as f64 / n as f64;
    assert!((kept - 0.7).abs() < 0.01, "kept {kept}");
}

#[test]
fn embedding_with_positions_and_dropout_matches_the_composite() {
    // Repeated ids (their gradients add up) and an id that never occurs (zero gradient).
    let (b, t, d, v) = (3, 4, 8, 7);
    let ids: Vec<u32> = vec![1, 2, 2, 0, 5, 1, 1, 3, 6, 0, 2, 5];
    let ids = Tensor::from_vec(ids, (b, t), &Device::Cpu).unwrap();
    let pos = randn(&[t, d], 26);
    let (mask, values) = test_mask(b * t * d);
    let values = values.reshape((b, t, d)).unwrap();
    for m in [None, Some(mask)] {
        check(
            |x| match x[0].dtype() {
                DType::F32 => embed(&x[0], &ids, &pos, 2.5, m).unwrap(),
                dt => {
                    let e = x[0]
                        .embedding(&ids.flatten_all().unwrap())
                        .unwrap()
                        .reshape((b, t, d))
                        .unwrap();
                    let y = (e * 2.5)
                        .unwrap()
                        .broadcast_add(&pos.to_dtype(dt).unwrap())
                        .unwrap();
                    match m {
                        Some(_) => (y * values.to_dtype(dt).unwrap()).unwrap(),
                        None => y,
                    }
                }
            },
            &[randn(&[v, d], 27)],
            &randn(&[b, t, d], 28),
        );
    }
    let bad = Tensor::from_vec(vec![0u32, 7], (1, 2), &Device::Cpu).unwrap();
    let err = embed(&randn(&[v, d], 27), &bad, &randn(&[2, d], 29), 1.0, None).unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
}

#[test]
fn residual_dropout_and_norm_match_the_composite() {
    let shape = [3, 5, 8];
    let (mask, values) = test_mask(120);
    let values = values.reshape(&shape[..]).unwrap();
    let masked = |f: &Tensor| (f * values.to_dtype(f.dtype()).unwrap()).unwrap();
    let (x, f, w, b) = (
        randn(&shape, 21),
        randn(&shape, 22),
        randn(&[8], 23),
        randn(&[8], 24),
    );
    let weights = randn(&shape, 25);
    check(
        |t| match t[0].dtype() {
            DType::F32 => add_dropout(&t[0], &t[1], Some(mask)).unwrap(),
            _ => (&t[0] + masked(&t[1])).unwrap(),
        },
        &[x.clone(), f.clone()],
        &weights,
    );
    for m in [None, Some(mask)] {
        check(
            |t| match t[0].dtype() {
                DType::F32 => residual_norm(&t[0], &t[1], &t[2], &t[3], 1e-5, m).unwrap(),
                _ => {
                    let f = if m.is_some() {
                        masked(&t[1])
                    } else {
                        t[1].clone()
                    };
                    layer_norm(&(&t[0] + f).unwrap(), &t[2], &t[3], 1e-5).unwrap()
                }
            },
            &[x.clone(), f.clone(), w.clone(), b.clone()],
            &weights,
        );
    }
}

#[test]
fn masked_softmax_matches_the_composite() {
    let mut bias = vec![0f32; 2 * 6];
    bias[5] = -1e9;
    bias[10] = -1e9;
    let bias = Tensor::from_vec(bias, (2, 1, 1, 6), &Device::Cpu).unwrap();
    let x = randn(&[2, 3, 4, 6], 5);
    let wts = randn(&[2, 3, 4, 6], 6);
    check(
        |t| masked_softmax(&t[0], Some(&bias.to_dtype(t[0].dtype()).unwrap())).unwrap(),
        std::slice::from_ref(&x),
        &wts,
    );
    let causal = Tensor::from_vec(
        (0..24)
            .map(|i| if i % 6 > i / 6 { -1e9f32 } else { 0.0 })
            .collect::<Vec<_>>(),
        (1, 1, 4, 6),
        &Device::Cpu,
    )
    .unwrap();
    check(
        |t| masked_softmax(&t[0], Some(&causal.to_dtype(t[0].dtype()).unwrap())).unwrap(),
        std::slice::from_ref(&x),
        &wts,
    );
    check(|t| masked_softmax(&t[0], None).unwrap(), &[x], &wts);
}

#[test]
fn linear_matches_the_composite() {
    // 3 rows take the few-rows kernel, 9 the gemm; 40 inputs span several dot lanes.
    for rows in [3, 9] {
        let (x, w, b) = (randn(&[rows, 40], 11), randn(&[5, 40], 12), randn(&[5], 13));
        for relu in [false, true] {
            check(
                |t| linear(&t[0], &t[1], &t[2], relu).unwrap(),
                &[x.clone(), w.clone(), b.clone()],
                &randn(&[rows, 5], 14),
            );
        }
    }
}

#[test]
fn projected_cross_entropy_matches_the_composite() {
    // More rows than one block of logits, so the blocked weight gradient is exercised.
    let n = LOGIT_ROWS + 37;
    let (h, w, b) = (randn(&[n, 6], 21), randn(&[11, 6], 22), randn(&[1, 11], 23));
    let ids: Vec<u32> = (0..n as u32).map(|i| (i * 7) % 11).collect();
    let labels = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
    let wts = Tensor::new(&[0.5f32, 0.0], &Device::Cpu).unwrap();
    let bias = b.clone();
    check(
        |t| {
            let b = bias.to_dtype(t[0].dtype()).unwrap();
            // Per row, so that the f32 sum's rounding stays under the tolerance.
            (projected_cross_entropy(&t[0], &t[1], &b, &labels, 0.1, true).unwrap() / n as f64)
                .unwrap()
        },
        &[h.clone(), w.clone()],
        &wts,
    );
    // Without gradients it reports the same sums.
    let a = projected_cross_entropy(&h, &w, &b, &labels, 0.1, true).unwrap();
    let z = projected_cross_entropy(&h, &w, &b, &labels, 0.1, false).unwrap();
    assert!(max_diff(&a, &z) == 0.0);
    let bad = Tensor::new(&[11u32], &Device::Cpu).unwrap();
    let err = projected_cross_entropy(&h.narrow(0, 0, 1).unwrap(), &w, &b, &bad, 0.1, true);
    assert!(err
        .unwrap_err()
        .to_string()
        .contains("outside the vocabulary"));
}

#[test]
fn fast_exp_is_within_two_ulp_of_exp() {
    for exp in [fast_exp, super::cpu::fast_exp_fused] {
        let mut worst = 0f64;
        for i in -870_000..=880_000 {
            let x = i as f32 * 1e-4;
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 2.5e-7, "relative error {worst}");
        assert_eq!(exp(-1e9), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }
}

/// Loading rejects a weights file by this test: one NaN or infinity anywhere (in the
/// vectorised part or the tail) must show, and no finite value may.
#[test]
fn all_finite_finds_one_non_finite_value_anywhere() {
    let finite = [
        f32::MAX,
        -f32::MAX,
        f32::MIN_POSITIVE,
        1e-45,
        -0.0,
        0.0,
        1.0,
    ];
    for n in [0, 1, 15, 16, 17, 40] {
        let x: Vec<f32> = (0..n).map(|i| finite[i % finite.len()]).collect();
        assert!(all_finite(&x), "{n} finite values");
        for at in 0..n {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut y = x.clone();
                y[at] = bad;
                assert!(!all_finite(&y), "{bad} at {at} of {n}");
            }
        }
    }
}

/// Sentences read where they are, from several groups (`rows`), give what copying them per
/// query row gives.
#[test]
fn attend_one_with_shared_rows_equals_copied_rows() {
    let (h, s, d) = (2, 5, 4);
    let q = randn(&[3, h, 1, d], 31);
    let (k, v) = (randn(&[2, h, s, d], 32), randn(&[2, h, s, d], 33));
    let bias = Tensor::new(
        &[0f32, 0., 0., -1e9, -1e9, 0., 0., 0., 0., -1e9],
        &Device::Cpu,
    )
    .unwrap()
    .reshape((2, 1, 1, s))
    .unwrap();
    let group = |k, v, bias| SourceKeys { k, v, bias };
    let rows = [(0u32, 1u32), (0, 0), (0, 1)];
    let idx = Tensor::new(&[1u32, 0, 1], &Device::Cpu).unwrap();
    let shared = attend_one(&q, &[group(&k, &v, Some(&bias))], Some(&rows)).unwrap();
    let pick = |t: &Tensor| t.index_select(&idx, 0).unwrap();
    let (pk, pv, pb) = (pick(&k), pick(&v), pick(&bias));
    let copied = attend_one(&q, &[group(&pk, &pv, Some(&pb))], None).unwrap();
    assert_eq!(max_diff(&shared, &copied), 0.0);
    // A second group of another source length (one sentence of 3 keys), unpadded: row 1
    // reads it and gets what it gets alone.
    let (k2, v2) = (randn(&[1, h, 3, d], 34), randn(&[1, h, 3, d], 35));
    let groups = [group(&k, &v, Some(&bias)), group(&k2, &v2, None)];
    let mixed = attend_one(&q, &groups, Some(&[(0, 1), (1, 0), (0, 1)])).unwrap();
    let alone = attend_one(&q.narrow(0, 1, 1).unwrap(), &groups[1..], None).unwrap();
    assert_eq!(max_diff(&mixed.narrow(0, 1, 1).unwrap(), &alone), 0.0);
    assert_eq!(
        max_diff(
            &mixed.narrow(0, 0, 1).unwrap(),
            &shared.narrow(0, 0, 1).unwrap()
        ),
        0.0
    );
    // Padding masked by the bias changes nothing: the 3 keys padded to 5 give the same bits.
    let pad = |t: &Tensor| {
        Tensor::cat(
            &[
                t,
                &Tensor::zeros((1, h, 2, d), DType::F32, &Device::Cpu).unwrap(),
            ],
            2,
        )
        .unwrap()
    };
    let pad_bias = Tensor::new(&[0f32, 0., 0., -1e9, -1e9], &Device::Cpu)
        .unwrap()
        .reshape((1, 1, 1, s))
        .unwrap();
    let (k2p, v2p) = (pad(&k2), pad(&v2));
    let padded = attend_one(
        &q.narrow(0, 1, 1).unwrap(),
        &[group(&k2p, &v2p, Some(&pad_bias))],
        None,
    )
    .unwrap();
    assert_eq!(max_diff(&padded, &alone), 0.0);
    // Elsewhere (here f64) the rows are gathered for Candle's primitives: the same values.
    let f64s = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
    let (q64, k64, v64, b64) = (f64s(&q), f64s(&k), f64s(&v), f64s(&bias));
    let general = attend_one(&q64, &[group(&k64, &v64, Some(&b64))], Some(&rows));
    assert!(max_diff(&general.unwrap().to_dtype(DType::F32).unwrap(), &shared) < 1e-6);
    // Rows out of range are an error, not a read past the keys.
    let bad = attend_one(&q, &groups, Some(&[(0, 0), (1, 1), (0, 1)]));
    assert!(bad.is_err());
    assert!(attend_one(&q, &groups, Some(&[(0, 0), (2, 0), (0, 1)])).is_err());
}

/// Keys kept per step and read through a reordering history give exactly what the
/// concatenated, reordered cache gives.
#[test]
fn attend_steps_equals_attention_over_the_gathered_cache() {
    let (h, d) = (2, 4);
    // Three steps; rows 3, 3, 2 (a hypothesis dropped before the last step).
    let steps: Vec<(Tensor, Tensor)> = [3usize, 3, 2]
        .iter()
        .enumerate()
        .map(|(j, &rows)| {
            let seed = 40 + 2 * j as u64;
            (
                randn(&[rows, h, 1, d], seed),
                randn(&[rows, h, 1, d], seed + 1),
            )
        })
        .collect();
    let history = vec![vec![2u32, 0, 0], vec![2, 2, 1]];
    let q = randn(&[2, h, 1, d], 50);
    let got = attend_steps(&q, &steps, &history).unwrap();
    // The same keys gathered into (B, H, t, d) for the general kernel.
    let gather = |which: usize| {
        let per_step: Vec<Tensor> = (0..3)
            .map(|j| {
                let idx: Vec<u32> = history.iter().map(|past| past[j]).collect();
                let t = if which == 0 { &steps[j].0 } else { &steps[j].1 };
                t.index_select(&Tensor::new(idx.as_slice(), &Device::Cpu).unwrap(), 0)
                    .unwrap()
            })
            .collect();
        Tensor::cat(&per_step, 2).unwrap()
    };
    let (gk, gv) = (gather(0), gather(1));
    let keys = SourceKeys {
        k: &gk,
        v: &gv,
        bias: None,
    };
    let want = attend_one(&q, &[keys], None).unwrap();
    assert_eq!(max_diff(&got, &want), 0.0);
    // A row whose sentence started at the last step reads that step only: what one key and
    // value give.
    let late = vec![vec![2u32, 0, 0], vec![1]];
    let got = attend_steps(&q, &steps, &late).unwrap();
    let (k1, v1) = (
        steps[2].0.narrow(0, 1, 1).unwrap(),
        steps[2].1.narrow(0, 1, 1).unwrap(),
    );
    let one = SourceKeys {
        k: &k1,
        v: &v1,
        bias: None,
    };
    let want = attend_one(&q.narrow(0, 1, 1).unwrap(), &[one], None).unwrap();
    assert_eq!(max_diff(&got.narrow(0, 1, 1).unwrap(), &want), 0.0);
    // A history naming a row a step does not have is an error.
    let bad = vec![vec![0u32, 0, 2], vec![0, 0, 0]];
    assert!(attend_steps(&q, &steps, &bad).is_err());
}
