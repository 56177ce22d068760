//! CPU building blocks of the ops: AVX-512/AVX2 dispatch (`wide`), lane-parallel reductions and
//! the exponential, a shared output pointer for parallel writers, and zeroed buffers cleared by
//! every thread (`zeros`). Matrix products are in `matmul`.

pub mod matmul;
pub(crate) mod panels;

use rayon::prelude::*;

/// The instruction sets nmt's kernels choose between, narrowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// The x86-64 baseline (or another architecture): portable loops.
    Baseline,
    Avx2,
    /// AVX2 with AVX-VNNI, its 256-bit int8 dot products (Intel cores since Alder Lake
    /// without AVX-512, Sierra Forest Xeons): what the int8 kernel uses there.
    AvxVnni,
    /// AVX-512, with VNNI and BF16 where the CPU has them.
    Avx512,
}

impl Isa {
    /// The cap that `NMT_CPU_ISA` (`baseline`, `avx2`, `avx_vnni` or `avx512`) puts on the
    /// instruction sets the kernels use, as CTranslate2's `CT2_FORCE_CPU_ISA` does: to run or
    /// measure the narrower kernels on a wider CPU. `None` when unset or empty; the kernels
    /// never use more than the CPU has (`avx_vnni` on an AVX-512 VNNI CPU without AVX-VNNI
    /// runs the same 256-bit kernel with the instruction's AVX-512 encoding).
    pub fn cap_from_env() -> Result<Option<Isa>, String> {
        let Some(v) = std::env::var_os("NMT_CPU_ISA").filter(|v| !v.is_empty()) else {
            return Ok(None);
        };
        match v.to_string_lossy().to_ascii_lowercase().as_str() {
            "baseline" => Ok(Some(Isa::Baseline)),
            "avx2" => Ok(Some(Isa::Avx2)),
            "avx_vnni" | "avxvnni" => Ok(Some(Isa::AvxVnni)),
            "avx512" => Ok(Some(Isa::Avx512)),
            other => Err(format!(
                "NMT_CPU_ISA={other}: expected baseline, avx2, avx_vnni or avx512"
            )),
        }
    }
}

/// What the kernels may use: this CPU's features under the `NMT_CPU_ISA` cap, detected once
/// (an invalid cap counts as none here; the binary refuses it before any kernel runs).
#[derive(Clone, Copy)]
struct Features {
    avx2: bool,
    /// 256-bit int8 dot products (`vpdpbusd` on ymm), in either encoding.
    avx_vnni: bool,
    avx512: bool,
}

fn features() -> Features {
    static FEATURES: std::sync::OnceLock<Features> = std::sync::OnceLock::new();
    *FEATURES.get_or_init(|| {
        let cap = Isa::cap_from_env().ok().flatten().unwrap_or(Isa::Avx512);
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma");
            let avx512 =
                has!("avx512f") && has!("avx512dq") && has!("avx512bw") && has!("avx512vl");
            let vnni256 = has!("avxvnni") || (has!("avx512vnni") && has!("avx512vl"));
            Features {
                avx2: avx2 && cap >= Isa::Avx2,
                avx_vnni: avx2 && vnni256 && cap >= Isa::AvxVnni,
                avx512: avx512 && cap >= Isa::Avx512,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = cap;
            Features {
                avx2: false,
                avx_vnni: false,
                avx512: false,
            }
        }
    })
}

/// Whether the kernels may use AVX-512 F, DQ, BW and VL (every AVX-512 CPU since
/// Skylake-SP and Zen 4), unless `NMT_CPU_ISA` caps them lower.
pub(crate) fn has_avx512() -> bool {
    features().avx512
}

/// Whether the kernels may use AVX2 and FMA (every x86-64 CPU since Haswell and Zen 1),
/// unless `NMT_CPU_ISA=baseline`.
pub(crate) fn has_avx2() -> bool {
    features().avx2
}

/// Whether the int8 kernel may use 256-bit VNNI: AVX-VNNI, or AVX-512 VNNI's encoding of the
/// same instruction, unless `NMT_CPU_ISA` caps the kernels at `avx2` or lower.
pub(crate) fn has_avx_vnni() -> bool {
    features().avx_vnni
}

/// Runs `f` inside a function compiled for AVX-512 where the CPU has it, else for AVX2, so
/// that the loops inlined into it vectorise 16 (or 8) lanes wide rather than the baseline
/// x86-64 target's 4. Results are the same either way: element-wise arithmetic is unchanged
/// (no fused multiply-add is formed unless written as one, `mul_add`, which rounds alike
/// everywhere) and the reductions keep their `LANES` partial sums.
#[inline(always)]
pub fn wide<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl")]
        unsafe fn run<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn run_avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if has_avx512() {
            // SAFETY: the CPU supports the enabled feature.
            return unsafe { run(f) };
        }
        if has_avx2() {
            // SAFETY: the CPU supports the enabled features.
            return unsafe { run_avx2(f) };
        }
    }
    f()
}

/// An output shared by parallel tasks, each writing its own disjoint elements.
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: every user hands each task disjoint elements of the output.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The element at `i`.
    ///
    /// # Safety
    /// `i` lies inside the output, and no other task touches that element meanwhile.
    pub(crate) unsafe fn at(&self, i: usize) -> *mut f32 {
        unsafe { self.0.add(i) }
    }
}

/// `n` zeros, written by all threads in blocks: `vec![0f32; n]` has the allocator clear a reused
/// buffer on the calling thread alone while the other cores wait.
pub(crate) fn zeros(n: usize) -> Vec<f32> {
    let mut v: Vec<f32> = Vec::with_capacity(n);
    v.spare_capacity_mut()[..n]
        .par_chunks_mut(1 << 16)
        .for_each(|c| c.fill(std::mem::MaybeUninit::new(0.0)));
    // SAFETY: the blocks above wrote all `n` elements of the capacity.
    unsafe { v.set_len(n) };
    v
}

/// Lanes of the vectorisable reductions below: independent partial sums the compiler can keep
/// in SIMD registers (a plain left-to-right float sum cannot be reordered, so it runs serially).
pub(crate) const LANES: usize = 16;

#[inline(always)]
pub(crate) fn lanes_fold(x: &[f32], init: f32, f: impl Fn(f32, f32) -> f32) -> [f32; LANES] {
    let mut acc = [init; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            acc[i] = f(acc[i], c[i]);
        }
    }
    for (i, &v) in chunks.remainder().iter().enumerate() {
        acc[i] = f(acc[i], v);
    }
    acc
}

/// Maximum of a row (−∞ for an empty one).
#[inline(always)]
pub fn row_max(x: &[f32]) -> f32 {
    lanes_fold(x, f32::NEG_INFINITY, f32::max)
        .into_iter()
        .fold(f32::NEG_INFINITY, f32::max)
}

/// Whether every value is finite: 0 · x is 0 for a finite x and NaN for a NaN or an infinity,
/// and so is their sum, which vectorises where a test per value with an early exit does not.
pub fn all_finite(x: &[f32]) -> bool {
    wide(
        #[inline(always)]
        || {
            lanes_fold(x, 0.0, |a, v| a + v * 0.0)
                .into_iter()
                .sum::<f32>()
                == 0.0
        },
    )
}

/// Sum of a row, in `LANES` partial sums.
#[inline(always)]
pub(crate) fn row_sum(x: &[f32]) -> f32 {
    lanes_fold(x, 0.0, |a, b| a + b).into_iter().sum()
}

/// e^x in f32 without a libm call, so loops over it vectorise: Cephes' `expf` (range reduction
/// by n·ln 2 split in two parts, degree-6 polynomial), within 2 ulp of the exact value for
/// −87 ≤ x ≤ 88; smaller x give 0, larger saturate at e^88 (e^−87 ≈ 1.6e−38, the end of the normal range).
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    exp_with(x, |a, b, c| a * b + c)
}

/// [`fast_exp`] in fused multiply-adds: a quarter fewer instructions, for beam search's
/// log-normalisers, which run it over every logit of every hypothesis (2.5 % of an int8 beam
/// search). The same bits on every path of [`wide`], a fused multiply-add being rounded once
/// wherever it runs. Training keeps [`fast_exp`]: the recorded PyTorch fine-tuning of
/// `tests/finetune.rs` matches it within 1 %, and the other rounding moves weights that only
/// rounding noise trains (cross-attention key biases) by 2 %.
#[inline(always)]
pub fn fast_exp_fused(x: f32) -> f32 {
    exp_with(x, f32::mul_add)
}

/// [`fast_exp`] with `madd(a, b, c)` = a·b + c rounded as it rounds.
#[inline(always)]
fn exp_with(x: f32, madd: impl Fn(f32, f32, f32) -> f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer
    let underflow = x < -87.0;
    let x = x.clamp(-87.0, 88.0);
    let t = madd(x, LOG2E, ROUND);
    let n = t - ROUND;
    let r = madd(n, 2.121_944_4e-4, madd(n, -0.693_359_4, x));
    let z = r * r;
    let mut p = 1.987_569_2e-4;
    for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        p = madd(p, r, c);
    }
    let p = madd(p, z, r) + 1.0;
    // 2^n from the bits of t = 1.5 · 2^23 + n, whose unit is one ulp: integer arithmetic,
    // which vectorises, where `n as i32` (a saturating conversion) took scalar code per lane.
    let scale = f32::from_bits(t.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127) << 23);
    let y = p * scale;
    if underflow {
        0.0
    } else {
        y
    }
}

/// Σ e^(x − shift) over `row`, in `LANES` partial sums, with [`fast_exp_fused`].
#[inline(always)]
pub fn exp_sum(row: &[f32], shift: f32) -> f32 {
    lanes_fold(row, 0.0, |a, x| a + fast_exp_fused(x - shift))
        .into_iter()
        .sum()
}

/// Replaces each x of `row` by e^(x − shift) and returns their sum.
#[inline(always)]
pub(crate) fn exp_shifted_sum(row: &mut [f32], shift: f32) -> f32 {
    row.iter_mut().for_each(|x| *x = fast_exp(*x - shift));
    row_sum(row)
}
