// nmt's own CUDA kernels, compiled to PTX by build.rs when the `cuda` feature is on and loaded
// by src/ops/cuda/mod.rs. Each replaces a chain of Candle's generic kernels (one launch, one
// allocation and often a host-to-device copy of strides each) with one launch: on a model this
// size the number of launches, not arithmetic, sets the pace of a training step.
//
// Arithmetic is in f32 whatever the storage type (f32, bf16, f16), and follows the CPU ops of
// the CPU ops in src/ops/ step for step, so that the two agree to rounding.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
    return __float2bfloat16(x);
}
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ------------------------------------------------------------------------------- dropout
// The mask of src/ops/dropout.rs (DropoutMask): element i keeps its value, scaled by `keep`,
// unless its 32-bit half of SplitMix64 draw i/2 + 1 after `state` is below `threshold`. So a
// GPU run draws exactly the masks a CPU run draws. threshold 0 and keep 1: no dropout.

__device__ __forceinline__ uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ float mask_at(uint64_t state, uint64_t threshold, float keep,
                                         uint64_t i) {
    const uint64_t r = mix(state + (i / 2 + 1) * 0x9E3779B97F4A7C15ull);
    const uint64_t half = (i & 1) ? (r >> 32) : (r & 0xffffffffull);
    return half < threshold ? 0.0f : keep;
}

// y = [base +] x · mask
template <typename T>
__device__ void dropout(const T* x, const T* base, T* y, uint64_t n, uint64_t state,
                        uint64_t threshold, float keep) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)blockDim.x * gridDim.x) {
        float v = to_f(x[i]) * mask_at(state, threshold, keep, i);
        if (base) v = to_f(base[i]) + v;
        y[i] = from_f<T>(v);
    }
}

// ------------------------------------------------------------------------------- LayerNorm
// s = x + f · mask (f may be null: s = x), y = LayerNorm(s) · w + b over rows of width d.
// `wb` holds w then b. One warp per row; the row is read again rather than kept, so any
// width works.

template <typename T>
__device__ __forceinline__ float sum_at(const T* x, const T* f, uint64_t i, uint64_t state,
                                        uint64_t threshold, float keep) {
    float s = to_f(x[i]);
    if (f) s = s + to_f(f[i]) * mask_at(state, threshold, keep, i);
    return s;
}

template <typename T>
__device__ __forceinline__ void row_stats(const T* x, const T* f, uint64_t o, int d,
                                          uint64_t state, uint64_t threshold, float keep,
                                          float eps, float* mean, float* rstd) {
    const int lane = threadIdx.x % 32;
    float s = 0.0f;
    for (int c = lane; c < d; c += 32) s += sum_at(x, f, o + c, state, threshold, keep);
    const float m = warp_sum(s) / d;
    float v = 0.0f;
    for (int c = lane; c < d; c += 32) {
        const float t = sum_at(x, f, o + c, state, threshold, keep) - m;
        v += t * t;
    }
    *mean = m;
    *rstd = rsqrtf(warp_sum(v) / d + eps);
}

template <typename T>
__device__ void residual_norm(const T* x, const T* f, const T* wb, T* y, int rows, int d,
                              float eps, uint64_t state, uint64_t threshold, float keep) {
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const uint64_t o = (uint64_t)row * d;
    float mean, rstd;
    row_stats(x, f, o, d, state, threshold, keep, eps, &mean, &rstd);
    for (int c = lane; c < d; c += 32) {
        const float s = sum_at(x, f, o + c, state, threshold, keep);
        y[o + c] = from_f<T>((s - mean) * rstd * to_f(wb[c]) + to_f(wb[d + c]));
    }
}

// The backward of residual_norm for output gradient dy: ds = ∂L/∂s into `ds`, ∂L/∂f =
// ds · mask into `df` (when f is given), and per block the partial sums of dy · ŝ (for w) and
// dy (for b) into part[blockIdx.x][2d], summed by `sum_parts`. Each warp takes rows in turn
// and keeps its column sums in shared memory ([warps][2d] floats); blocks' partials are summed
// in a fixed order, so the gradients do not depend on scheduling.
template <typename T>
__device__ void residual_norm_bwd(const T* x, const T* f, const T* wb, const T* dy, T* ds,
                                  T* df, float* part, int rows, int d, float eps, uint64_t state,
                                  uint64_t threshold, float keep) {
    extern __shared__ float shared[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    float* acc = shared + warp * 2 * d;
    for (int c = lane; c < 2 * d; c += 32) acc[c] = 0.0f;
    for (int row = blockIdx.x * warps + warp; row < rows; row += gridDim.x * warps) {
        const uint64_t o = (uint64_t)row * d;
        float mean, rstd;
        row_stats(x, f, o, d, state, threshold, keep, eps, &mean, &rstd);
        float s1 = 0.0f, s2 = 0.0f;
        for (int c = lane; c < d; c += 32) {
            const float xh = (sum_at(x, f, o + c, state, threshold, keep) - mean) * rstd;
            const float g = to_f(dy[o + c]);
            const float gw = g * to_f(wb[c]);
            s1 += gw;
            s2 += gw * xh;
            acc[c] += g * xh;
            acc[d + c] += g;
        }
        const float m1 = warp_sum(s1) / d, m2 = warp_sum(s2) / d;
        for (int c = lane; c < d; c += 32) {
            const float xh = (sum_at(x, f, o + c, state, threshold, keep) - mean) * rstd;
            const float v = rstd * (to_f(dy[o + c]) * to_f(wb[c]) - m1 - xh * m2);
            ds[o + c] = from_f<T>(v);
            if (df) df[o + c] = from_f<T>(v * mask_at(state, threshold, keep, o + c));
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < 2 * d; c += blockDim.x) {
        float t = 0.0f;
        for (int w = 0; w < warps; ++w) t += shared[w * 2 * d + c];
        part[(uint64_t)blockIdx.x * 2 * d + c] = t;
    }
}

// out[c] = Σ_b part[b][c], b in order.
template <typename T>
__device__ void sum_parts(const float* part, T* out, int blocks, int width) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;
    float t = 0.0f;
    for (int b = 0; b < blocks; ++b) t += part[(uint64_t)b * width + c];
    out[c] = from_f<T>(t);
}

// ------------------------------------------------------------------------------- embedding
// The gradient of a row gather (an embedding lookup), ∂L/∂W[v] = Σ_{j: ids[j] = v} g[j],
// summed in the order of j (deterministic, unlike atomics; Candle's index_add runs one thread
// per column over all ids, which took milliseconds). First, per position j: next[j] = the next
// position with the same id (or -1), first[j] = whether no earlier position has it.
__device__ void embedding_links(const uint32_t* ids, int n, int* next, int* first) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    const uint32_t id = ids[j];
    int nx = -1;
    for (int k = j + 1; k < n; ++k) {
        if (ids[k] == id) {
            nx = k;
            break;
        }
    }
    int is_first = 1;
    for (int k = 0; k < j; ++k) {
        if (ids[k] == id) {
            is_first = 0;
            break;
        }
    }
    next[j] = nx;
    first[j] = is_first;
}

// Then one thread per (first position, column) walks its chain. `out` (vocab × d) is zeroed
// beforehand; ids ≥ vocab are skipped.
template <typename T>
__device__ void embedding_grad(const uint32_t* ids, const T* g, const int* next, const int* first,
                               T* out, int n, int d, uint32_t vocab) {
    const uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
    if (i >= (uint64_t)n * d) return;
    const int j = i / d, c = i % d;
    if (!first[j] || ids[j] >= vocab) return;
    float t = 0.0f;
    for (int k = j; k >= 0; k = next[k]) t += to_f(g[(uint64_t)k * d + c]);
    out[(uint64_t)ids[j] * d + c] = from_f<T>(t);
}

// ------------------------------------------------------------------------------- cross-entropy
// Label-smoothed cross-entropy per row of logits (rows × v), as ops::SmoothedCrossEntropy:
// out[row] = ((1 − ε)·nll + ε·(lse − mean(x)), nll) with nll = lse − x[label]. One block per
// row; a label outside the vocabulary gives NaN (the trainer stops on a NaN loss).

__device__ __forceinline__ float block_reduce(float v, bool take_max) {
    __shared__ float partial[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    for (int o = 16; o > 0; o >>= 1) {
        const float u = __shfl_xor_sync(0xffffffffu, v, o);
        v = take_max ? fmaxf(v, u) : v + u;
    }
    __syncthreads();  // an earlier call may still be reading `partial`
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = partial[0];
    for (int w = 1; w < warps; ++w) v = take_max ? fmaxf(v, partial[w]) : v + partial[w];
    return v;
}

template <typename T>
__device__ __forceinline__ void row_lse(const T* x, int v, float* max_out, float* lse_out,
                                        float* total_out) {
    float m = -INFINITY, t = 0.0f;
    for (int c = threadIdx.x; c < v; c += blockDim.x) {
        const float a = to_f(x[c]);
        m = fmaxf(m, a);
        t += a;
    }
    m = block_reduce(m, true);
    float s = 0.0f;
    for (int c = threadIdx.x; c < v; c += blockDim.x) s += __expf(to_f(x[c]) - m);
    s = block_reduce(s, false);
    *max_out = m;
    *lse_out = m + logf(s);
    *total_out = block_reduce(t, false);
}

template <typename T>
__device__ void smoothed_ce(const T* logits, const uint32_t* labels, float* out, int v,
                            float eps) {
    const uint64_t row = blockIdx.x;
    const T* x = logits + row * v;
    float m, lse, total;
    row_lse(x, v, &m, &lse, &total);
    if (threadIdx.x == 0) {
        const uint32_t y = labels[row];
        const float nll = y < (uint32_t)v ? lse - to_f(x[y]) : NAN;
        out[2 * row] = (1.0f - eps) * nll + eps * (lse - total / v);
        out[2 * row + 1] = nll;
    }
}

// ∂L/∂x = dy[row][0] · (softmax(x) − (1 − ε)·[c = label] − ε / v)
template <typename T>
__device__ void smoothed_ce_bwd(const T* logits, const uint32_t* labels, const float* dy, T* dx,
                                int v, float eps) {
    const uint64_t row = blockIdx.x;
    const T* x = logits + row * v;
    float m, lse, total;
    row_lse(x, v, &m, &lse, &total);
    const float g = dy[2 * row];
    const uint32_t y = labels[row];
    for (int c = threadIdx.x; c < v; c += blockDim.x) {
        const float p = __expf(to_f(x[c]) - lse);
        const float target = (c == (int)y ? 1.0f - eps : 0.0f) + eps / v;
        dx[row * v + c] = from_f<T>(g * (p - target));
    }
}

// ------------------------------------------------------------------------------- Adam
// Adam (train/optim.rs) over all parameters at once, reading each gradient and writing each
// parameter through tables of device pointers (`ptrs`: P gradients, then P parameters), so
// that nothing is gathered into or scattered from a flat copy. Work comes in chunks of at most
// ADAM_CHUNK elements: chunk k is elements chunk_start[k].. of parameter chunk_param[k], whose
// elements sit at offsets[p].. of the flat state [m | v | master] (n each) and of the masks.

#define ADAM_CHUNK 4096

struct AdamChunk {
    uint32_t param, start, len;
    uint64_t flat;  // offsets[param] + start
};

__device__ __forceinline__ AdamChunk adam_chunk(const uint32_t* chunk_param,
                                                const uint32_t* chunk_start,
                                                const uint64_t* offsets, const uint64_t* lens) {
    AdamChunk c;
    c.param = chunk_param[blockIdx.x];
    c.start = chunk_start[blockIdx.x];
    c.len = (uint32_t)min((uint64_t)ADAM_CHUNK, lens[c.param] - c.start);
    c.flat = offsets[c.param] + c.start;
    return c;
}

// partial[k] = Σ (g · scale · mask)² over chunk k.
template <typename T>
__device__ void adam_norm(const uint64_t* ptrs, const uint32_t* chunk_param,
                          const uint32_t* chunk_start, const uint64_t* offsets,
                          const uint64_t* lens, const uint8_t* grad_mask, float scale,
                          float* partial) {
    const AdamChunk c = adam_chunk(chunk_param, chunk_start, offsets, lens);
    const T* g = (const T*)ptrs[c.param] + c.start;
    float acc = 0.0f;
    for (uint32_t j = threadIdx.x; j < c.len; j += blockDim.x) {
        float x = to_f(g[j]) * scale;
        if (grad_mask && !grad_mask[c.flat + j]) x = 0.0f;
        acc += x * x;
    }
    acc = block_reduce(acc, false);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// One block of 256 threads: norm = √Σ partial (in f64, in a fixed order); out = [clip factor,
// norm], the factor 1 unless clip_norm > 0 and the norm exceeds it.
extern "C" __global__ void adam_clip(const float* partial, int chunks, float clip_norm,
                                     float* out) {
    __shared__ double sums[256];
    double s = 0.0;
    for (int i = threadIdx.x; i < chunks; i += 256) s += partial[i];
    sums[threadIdx.x] = s;
    __syncthreads();
    for (int w = 128; w > 0; w >>= 1) {
        if (threadIdx.x < w) sums[threadIdx.x] += sums[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const double norm = sqrt(sums[0]);
        out[0] = (clip_norm > 0.0f && norm > clip_norm) ? (float)(clip_norm / (norm + 1e-6)) : 1.0f;
        out[1] = (float)norm;
    }
}

// The update, as Adam::update_tensors computes it, element by element.
template <typename T>
__device__ void adam_step(const uint64_t* ptrs, int n_params, const uint32_t* chunk_param,
                          const uint32_t* chunk_start, const uint64_t* offsets,
                          const uint64_t* lens, const uint8_t* grad_mask, const uint8_t* decay,
                          float* state, uint64_t n, const float* clip, float scale, float beta1,
                          float one_minus_beta1, float beta2, float one_minus_beta2, float eps,
                          float bc1, float bc2, float lr, float lr_wd) {
    const AdamChunk c = adam_chunk(chunk_param, chunk_start, offsets, lens);
    const T* g = (const T*)ptrs[c.param] + c.start;
    T* w = (T*)ptrs[n_params + c.param] + c.start;
    const float factor = clip[0];
    for (uint32_t j = threadIdx.x; j < c.len; j += blockDim.x) {
        const uint64_t i = c.flat + j;
        float x = to_f(g[j]) * scale;
        if (grad_mask && !grad_mask[i]) x = 0.0f;
        x = x * factor;
        const float m = state[i] * beta1 + x * one_minus_beta1;
        const float v = state[n + i] * beta2 + x * x * one_minus_beta2;
        const float theta = state[2 * n + i];
        const float step = (m / bc1) / (sqrtf(v / bc2) + eps);
        float updated = theta - step * lr;
        if (lr_wd != 0.0f && decay[i]) updated = updated - theta * lr_wd;
        state[i] = m;
        state[n + i] = v;
        state[2 * n + i] = updated;
        w[j] = from_f<T>(updated);
    }
}

// ------------------------------------------------------------------------------- entry points

#define INSTANTIATE(T, S)                                                                      \
    extern "C" __global__ void dropout_##S(const T* x, const T* base, T* y, uint64_t n,        \
                                           uint64_t state, uint64_t threshold, float keep) {   \
        dropout<T>(x, base, y, n, state, threshold, keep);                                     \
    }                                                                                          \
    extern "C" __global__ void residual_norm_##S(const T* x, const T* f, const T* wb, T* y,    \
                                                 int rows, int d, float eps, uint64_t state,   \
                                                 uint64_t threshold, float keep) {             \
        residual_norm<T>(x, f, wb, y, rows, d, eps, state, threshold, keep);                   \
    }                                                                                          \
    extern "C" __global__ void residual_norm_bwd_##S(                                          \
        const T* x, const T* f, const T* wb, const T* dy, T* ds, T* df, float* part, int rows, \
        int d, float eps, uint64_t state, uint64_t threshold, float keep) {                    \
        residual_norm_bwd<T>(x, f, wb, dy, ds, df, part, rows, d, eps, state, threshold,       \
                             keep);                                                            \
    }                                                                                          \
    extern "C" __global__ void sum_parts_##S(const float* part, T* out, int blocks,            \
                                             int width) {                                      \
        sum_parts<T>(part, out, blocks, width);                                                \
    }                                                                                          \
    extern "C" __global__ void embedding_grad_##S(const uint32_t* ids, const T* g,             \
                                                  const int* next, const int* first, T* out,   \
                                                  int n, int d, uint32_t vocab) {              \
        embedding_grad<T>(ids, g, next, first, out, n, d, vocab);                              \
    }                                                                                          \
    extern "C" __global__ void smoothed_ce_##S(const T* logits, const uint32_t* labels,        \
                                               float* out, int v, float eps) {                 \
        smoothed_ce<T>(logits, labels, out, v, eps);                                           \
    }                                                                                          \
    extern "C" __global__ void smoothed_ce_bwd_##S(const T* logits, const uint32_t* labels,    \
                                                   const float* dy, T* dx, int v, float eps) { \
        smoothed_ce_bwd<T>(logits, labels, dy, dx, v, eps);                                    \
    }                                                                                          \
    extern "C" __global__ void adam_norm_##S(                                                  \
        const uint64_t* ptrs, const uint32_t* chunk_param, const uint32_t* chunk_start,        \
        const uint64_t* offsets, const uint64_t* lens, const uint8_t* grad_mask, float scale,  \
        float* partial) {                                                                      \
        adam_norm<T>(ptrs, chunk_param, chunk_start, offsets, lens, grad_mask, scale,          \
                     partial);                                                                 \
    }                                                                                          \
    extern "C" __global__ void adam_step_##S(                                                  \
        const uint64_t* ptrs, int n_params, const uint32_t* chunk_param,                       \
        const uint32_t* chunk_start, const uint64_t* offsets, const uint64_t* lens,            \
        const uint8_t* grad_mask, const uint8_t* decay, float* state, uint64_t n,              \
        const float* clip, float scale, float beta1, float one_minus_beta1, float beta2,       \
        float one_minus_beta2, float eps, float bc1, float bc2, float lr, float lr_wd) {       \
        adam_step<T>(ptrs, n_params, chunk_param, chunk_start, offsets, lens, grad_mask,       \
                     decay, state, n, clip, scale, beta1, one_minus_beta1, beta2,              \
                     one_minus_beta2, eps, bc1, bc2, lr, lr_wd);                               \
    }

INSTANTIATE(float, f32)
INSTANTIATE(__nv_bfloat16, bf16)
INSTANTIATE(__half, f16)

extern "C" __global__ void embedding_links_u32(const uint32_t* ids, int n, int* next,
                                               int* first) {
    embedding_links(ids, n, next, first);
}
