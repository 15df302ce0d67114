// The decode step of a Llama-family model (RMSNorm, RoPE, grouped-query attention, SwiGLU) as one
// native call over all layers: [B, d] embeddings in, [B, d] hidden state out. The later families'
// switches ride along (Arch): q/k/v biases (Qwen 2), per-head q/k norms (Qwen 3, Gemma 3), GeGLU,
// norms on each branch's output, sliding-window layers with their own RoPE base (Gemma 3).
//
// It does the same math as `Transformer.forward` with a KV cache, op for op: the Python module
// path is the reference (tests/test_fused_decode.py). What it removes is the overhead around the
// math. A decode step of SmolLM2-135M multiplies ~84 MB of 4-bit weights, a few milliseconds of
// memory traffic, but the module path spends as long again in ~2,000 small tensor ops
// (views, RoPE's cat/mul/add, the cache scatter, the attention mask, SDPA for one query row),
// each a dispatch and an allocation. Here each layer is: norm, one fused q/k/v matmul, RoPE and
// the cache write in place, attention of one query row per head over its row's cached slots,
// output matmul, norm, fused gate/up matmul, SiLU * up, down matmul; the matmuls are the same
// kernels the quantized layers call (a8_linear.cpp, int8_linear.cpp, q4_linear.cpp), or for
// float32 weights a row-streaming kernel below.
#include "aten.h"
#include <immintrin.h>

#include "arlm_layout.h"  // generated from arlm/kernels/layout.py by the build
#include "common.h"
#include "paged_attention.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <type_traits>
#include <vector>

#ifndef ARLM_BARE  // (the row layouts' ops: torch's build only; the bare build runs packed layers)
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& mins);
at::Tensor int8_linear_a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);
at::Tensor q4_linear_a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& mins);
at::Tensor int8_linear_a8p(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale);
at::Tensor q4_linear_a8p(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale, const at::Tensor& mins);
#endif

namespace {

using namespace arlm_layout;  // LayerWeight, kExactRows

// Weight rows per tile of f32_linear_into's AVX2 path (kTileRows x 2 accumulators in registers):
// this kernel's own register tiling, as each linear kernel has its kRows. It counts rows of w,
// not of x (that bound is kExactRows), and does not change a row's result.
constexpr int64_t kTileRows = 4;
// Row-wise work (norms, RoPE) goes to the thread pool in tasks of this many rows: a batch of 32
// splits across the cores, a single row stays on the calling thread (no hand-off).
constexpr int64_t kRowsPerTask = 8;
// Cached slots per attention task on long rows (decode_llama's split-K): below ~1k slots the two
// extra passes cost more than the balance gains (docs/benchmarks.md, split-K).
constexpr int64_t kChunk = 1024;
constexpr int64_t kMaxWorkers = 256;  // (threads sharing a step's attention tasks, at most)

#if defined(__AVX2__) && defined(__FMA__)
using arlm_kernels::hsum;
#endif

// float32 y[m, n] = x[m, :] . w[n, :] for a few rows of x (row stride of y: ldy; y += that when
// accumulate): each weight row is streamed once and reused for every row of x (decode is a
// matrix-vector product; MKL's is slow at these shapes). Rows of x are batch-invariant up to
// kExactRows of them; with more a GEMM sums in its own order (float32 models only; the quantized
// kernels are batch-invariant at any count).
void f32_linear_into(const float* xp, int64_t M, int64_t K, const at::Tensor& w, float* yp, int64_t ldy,
                     bool accumulate) {
  TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "f32_linear: w [N, K] contiguous float32");
  const int64_t N = w.size(0);
  if (M > kExactRows || K % 8 != 0) {  // enough rows: a GEMM is the right tool, straight into y
#ifdef ARLM_BARE
    TORCH_CHECK(false, "f32_linear: more than ", kExactRows, " rows need torch's GEMM (not in the bare build)");
#else
    const at::Tensor xt = at::from_blob(const_cast<float*>(xp), {M, K}, at::TensorOptions().dtype(at::kFloat));
    at::Tensor yt = at::from_blob(yp, {M, N}, {ldy, 1}, at::TensorOptions().dtype(at::kFloat));
    if (accumulate) yt.addmm_(xt, w.t());
    else at::mm_out(yt, xt, w.t());
    return;
#endif
  }
  const float* wp = w.data_ptr<float>();
  auto put = [&](int64_t m, int64_t n, float v) { yp[m * ldy + n] = accumulate ? yp[m * ldy + n] + v : v; };
  at::parallel_for(0, (N + kTileRows - 1) / kTileRows, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t n = t0 * kTileRows; n < std::min(N, t1 * kTileRows); n += kTileRows) {
      const int64_t rows = std::min(kTileRows, N - n);
      for (int64_t m = 0; m < M; ++m) {
#if defined(__AVX512F__)
        if (K % 64 == 0) {  // each row read front to back: one sequential stream per thread
          for (int64_t r = 0; r < rows; ++r) {
            const float* wr = wp + (n + r) * K;
            const float* ahead = wp + std::min(n + r + 32, N - 1) * K;  // prefetch 32 rows on, within w
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
                   a3 = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 64) {
              _mm_prefetch(reinterpret_cast<const char*>(ahead + k), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(ahead + k + 16), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(ahead + k + 32), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(ahead + k + 48), _MM_HINT_T0);
              a0 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k), _mm512_loadu_ps(xp + m * K + k), a0);
              a1 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k + 16), _mm512_loadu_ps(xp + m * K + k + 16), a1);
              a2 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k + 32), _mm512_loadu_ps(xp + m * K + k + 32), a2);
              a3 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k + 48), _mm512_loadu_ps(xp + m * K + k + 48), a3);
            }
            put(m, n + r, _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))));
          }
          continue;
        }
#endif
#if defined(__AVX2__) && defined(__FMA__)
        if (rows == kTileRows) {
          __m256 acc[kTileRows][2];
          for (int r = 0; r < kTileRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
          int64_t k = 0;
          for (; k + 16 <= K; k += 16) {
            const __m256 x0 = _mm256_loadu_ps(xp + m * K + k), x1 = _mm256_loadu_ps(xp + m * K + k + 8);
            for (int r = 0; r < kTileRows; ++r) {
              acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(wp + (n + r) * K + k), x0, acc[r][0]);
              acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(wp + (n + r) * K + k + 8), x1, acc[r][1]);
            }
          }
          for (; k < K; k += 8) {
            const __m256 x0 = _mm256_loadu_ps(xp + m * K + k);
            for (int r = 0; r < kTileRows; ++r)
              acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(wp + (n + r) * K + k), x0, acc[r][0]);
          }
          for (int r = 0; r < kTileRows; ++r) put(m, n + r, hsum(_mm256_add_ps(acc[r][0], acc[r][1])));
          continue;
        }
#endif
        for (int64_t r = 0; r < rows; ++r) {
          float acc = 0.f;
          for (int64_t k = 0; k < K; ++k) acc += xp[m * K + k] * wp[(n + r) * K + k];
          put(m, n + r, acc);
        }
      }
    }
  });
}

// One linear layer given as (w, scale, mins): 4-bit (w uint8), int8 (w int8, mins undefined),
// float32 (w float, scale and mins undefined), or either quantized kind in the packed layout
// (w 3-D, a8_linear.cpp; a8 only): int8 with scale [N] float32, 4-bit with scale [N/16, G, 16].
inline bool packed(const at::Tensor* p) { return p[0].dim() == 3 && !arlm_kernels::bf16_packed(p[0]); }

// The layer's output width for inputs of width K (and its layout checked against K).
int64_t out_features(const char* op, const at::Tensor* p, int64_t K) {
  const at::Tensor& w = p[0];
  if (packed(p)) return arlm_kernels::packed_out_features(op, K, w, p[1], p[2]);
  if (arlm_kernels::bf16_packed(w)) {
    TORCH_CHECK(w.size(1) == K / 2 && w.size(2) == 32, op, ": a bf16 weight does not match its input width");
    return w.size(0) * 16;
  }
  TORCH_CHECK(w.dim() == 2 && w.size(1) == (w.scalar_type() == at::kByte ? K / 2 : K),
              op, ": a weight does not match its input width");
  return w.size(0);
}

// y[M, N] (row stride ldy) = x W^T, or y += x W^T when accumulate (the residual adds). x [M, K]
// float32; xq: x quantized (arlm_kernels::Act8), which packed layers read instead. Packed layers
// write straight into y; the other layouts (AVX2 / float32 builds) go through their tensor ops.
// residual (with a8): the 8-bit activations taken twice: for the packed layouts x as 16 bits in
// two bytes, in one pass over the weights (arlm_kernels::linear_a8p_residual); for the row layouts
// each row of x and its 8-bit rounding error run as two rows.
void linear_into(const float* x, const arlm_kernels::Act8* xq, int64_t M, int64_t K, const at::Tensor* p, bool a8,
                 float* y, int64_t ldy, bool accumulate, bool residual = false) {
  if (residual && a8 && K % 32 == 0) {
    if (packed(p)) return arlm_kernels::linear_a8p_residual(x, M, K, p[0], p[1], p[2], y, ldy, accumulate);
    const int64_t N = out_features("decode", p, K);
    thread_local std::vector<float> pairs_x, pairs_y;  // kept and grown: no allocation per step
    pairs_x.resize(std::max<size_t>(pairs_x.size(), 2 * M * K));
    pairs_y.resize(std::max<size_t>(pairs_y.size(), 2 * M * N));
    for (int64_t m = 0; m < M; ++m) {
      std::copy(x + m * K, x + (m + 1) * K, pairs_x.data() + 2 * m * K);
      arlm_kernels::activation_residual(x + m * K, K, pairs_x.data() + (2 * m + 1) * K);
    }
    linear_into(pairs_x.data(), nullptr, 2 * M, K, p, a8, pairs_y.data(), N, false);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        const float v = pairs_y[2 * m * N + n] + pairs_y[(2 * m + 1) * N + n];
        y[m * ldy + n] = accumulate ? y[m * ldy + n] + v : v;
      }
    return;
  }
  if (packed(p)) {
    TORCH_CHECK(a8 && xq, "decode: packed weights need 8-bit activations");
    return arlm_kernels::linear_a8p(*xq, M, K, p[0], p[1], p[2], y, ldy, accumulate);
  }
  const at::Tensor &w = p[0], &scale = p[1], &mins = p[2];
  if (w.scalar_type() == at::kFloat) return f32_linear_into(x, M, K, w, y, ldy, accumulate);
  if (arlm_kernels::bf16_packed(w)) return arlm_kernels::bf16_linear_into(x, M, K, w, y, ldy, accumulate);
#ifdef ARLM_BARE
  TORCH_CHECK(false, "decode: the row layouts and dense copies run through torch's ops (not in the bare build)");
#else
  if (w.scalar_type() == at::kBFloat16) {  // a dense bf16 copy [N, K] (prompt tokens, AMX CPUs): torch's
    // GEMM, oneDNN on the AMX tiles; its result (rounded to bf16) widened into y
    const at::Tensor xt = at::from_blob(const_cast<float*>(x), {M, K}, at::TensorOptions().dtype(at::kFloat));
    at::Tensor yt = at::from_blob(y, {M, w.size(0)}, {ldy, 1}, at::TensorOptions().dtype(at::kFloat));
    const at::Tensor r = at::mm(xt.to(at::kBFloat16), w.t());
    if (accumulate) yt.add_(r);
    else yt.copy_(r);
    return;
  }
  const at::Tensor xt = at::from_blob(const_cast<float*>(x), {M, K}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor r;
  if (w.scalar_type() == at::kByte) r = a8 ? q4_linear_a8(xt, w, scale, mins) : q4_linear(xt, w, scale, mins);
  else if (w.scalar_type() == at::kChar)
    r = a8 && K % 32 == 0 ? int8_linear_a8(xt, w, scale) : int8_linear(xt, w, scale);
  else TORCH_CHECK(false, "decode: unsupported weight dtype ", w.scalar_type());
  if (w.scalar_type() == at::kChar && mins.numel()) {
    // int8 codes with mins (Q5_K in the row layout, quant.Q8MinsLinear): + sum_g mins[n, g] times
    // the group-g sum of the activations the codes were multiplied by (8-bit ones: dequantized)
    at::Tensor xa = xt;
    if (a8 && K % 32 == 0) {
      at::Tensor resid = at::empty_like(xt);
      for (int64_t m = 0; m < M; ++m) arlm_kernels::activation_residual(x + m * K, K, resid.data_ptr<float>() + m * K);
      xa = xt - resid;
    }
    // (each row in its own fixed order, whatever M: a row's result does not depend on its batch)
    const at::Tensor xs = xa.view({M, mins.size(1), K / mins.size(1)}).sum(-1).contiguous();
    const int64_t G = mins.size(1), Nm = mins.size(0);
    const float *sp = xs.data_ptr<float>(), *mp = mins.data_ptr<float>();
    float* rw = r.data_ptr<float>();
    at::parallel_for(0, Nm, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n) {
          float acc = 0.f;
          for (int64_t g = 0; g < G; ++g) acc += mp[n * G + g] * sp[m * G + g];
          rw[m * Nm + n] += acc;
        }
    });
  }
  const float* rp = r.data_ptr<float>();
  const int64_t N = r.size(1);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) y[m * ldy + n] = accumulate ? y[m * ldy + n] + rp[m * N + n] : rp[m * N + n];
#endif
}

// out = x / sqrt(mean(x^2) + eps) * weight, row by row (as F.rms_norm, then the weight); with
// xq, each row is also quantized (for a packed layer next) while it is in cache.
void rms_norm(const float* x, const float* weight, int64_t B, int64_t d, double eps, float* out,
              const arlm_kernels::Act8* xq) {
  at::parallel_for(0, B, kRowsPerTask, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* xr = x + b * d;
      float* o = out + b * d;
      float ss = 0.f;
      int64_t i = 0;
#if defined(__AVX512F__)
      __m512 acc = _mm512_setzero_ps();
      for (; i + 16 <= d; i += 16) {
        const __m512 v = _mm512_loadu_ps(xr + i);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      ss = _mm512_reduce_add_ps(acc);
#endif
      for (; i < d; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + static_cast<float>(eps));
      for (i = 0; i < d; ++i) o[i] = weight[i] * (xr[i] * inv);
      if (xq) arlm_kernels::quantize_span(o, d, *xq, b * d);
    }
  });
}

// Half-split RoPE of one head in place: (x_i, x_{i + hd/2}) rotated by the angle of position pos.
inline void rope(float* v, const float* cos, const float* sin, int64_t hd) {
  const int64_t half = hd / 2;
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= half; i += 16) {  // the same float operations as below, 16 at a time
    const __m512 a = _mm512_loadu_ps(v + i), b = _mm512_loadu_ps(v + i + half);
    _mm512_storeu_ps(v + i, _mm512_sub_ps(_mm512_mul_ps(a, _mm512_loadu_ps(cos + i)),
                                          _mm512_mul_ps(b, _mm512_loadu_ps(sin + i))));
    _mm512_storeu_ps(v + i + half, _mm512_add_ps(_mm512_mul_ps(b, _mm512_loadu_ps(cos + i + half)),
                                                 _mm512_mul_ps(a, _mm512_loadu_ps(sin + i + half))));
  }
#endif
  for (; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] - b * sin[i];
    v[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// One head's RMSNorm in place (v [hd] / sqrt(mean(v^2) + eps) * w): Qwen 3's and Gemma 3's q/k
// norms, before RoPE. The same operations as rms_norm on one row.
inline void head_norm(float* v, const float* w, int64_t hd, float eps) {
  float ss = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= hd; i += 16) {
    const __m512 x = _mm512_loadu_ps(v + i);
    acc = _mm512_fmadd_ps(x, x, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#endif
  for (; i < hd; ++i) ss += v[i] * v[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(hd) + eps);
  for (i = 0; i < hd; ++i) v[i] = w[i] * (v[i] * inv);
}

// What a layer of a later family adds to Llama's (see the file's head). Per layer: windows[l]
// slots (a sliding layer reads its last windows[l] positions, itself included; 0: all) and, for
// a sliding layer where local_cos is set, RoPE from the local tables [max_T, hd].
struct Arch {
  bool geglu = false;  // the MLP's gate through tanh-GELU instead of SiLU
  float q_scale = 1.f;  // queries times this after RoPE (a score scale other than 1/sqrt(hd))
  const int64_t* windows = nullptr;
  const float *local_cos = nullptr, *local_sin = nullptr;
  int64_t window(int64_t l) const { return windows ? windows[l] : 0; }
  const float* cos(int64_t l, const float* global) const { return window(l) && local_cos ? local_cos : global; }
  const float* sin(int64_t l, const float* global) const { return window(l) && local_sin ? local_sin : global; }
};

// A token's q and k heads before attention: per-head norms (where qn / kn are given), RoPE from the row
// of (c, sn), then the queries scaled. qk [(H + Hkv) * hd]: H query heads, then Hkv key heads.
inline void prepare_heads(float* qk, int64_t H, int64_t Hkv, int64_t hd, const float* qn, const float* kn,
                          float eps, const float* c, const float* sn, float q_scale) {
  for (int64_t j = 0; j < H + Hkv; ++j) {
    float* v = qk + j * hd;
    if (const float* w = j < H ? qn : kn) head_norm(v, w, hd, eps);
    rope(v, c, sn, hd);
    if (j < H && q_scale != 1.f)
      for (int64_t i = 0; i < hd; ++i) v[i] *= q_scale;
  }
}

// tanh-GELU (torch's approximate="tanh"): x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(u)
// as 1 - 2 / (1 + e^{2u}).
#if defined(__AVX512F__)
inline __m512 gelu_tanh16(__m512 x) {
  const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                 _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), x), _mm512_mul_ps(x, x), x));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = arlm_kernels::exp16(_mm512_add_ps(u, u));
  const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(one, e)));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(one, t));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 gelu_tanh8(__m256 x) {  // gelu_tanh16's operations, 8 lanes
  const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                 _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x), _mm256_mul_ps(x, x), x));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 e = arlm_kernels::exp8(_mm256_add_ps(u, u));
  const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(one, e)));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, t));
}
#endif
inline float gelu_tanh(float x) {
  return 0.5f * x * (1.f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// out[i, j] = SiLU(gu[i, j]) * gu[i, dff + j] for N rows of the fused gate/up output [N, 2 dff],
// or GELU(...) * ... with geglu (quantized into xq too, when given). Every element takes the same
// instructions whatever N (masked tail per row): batch-invariant.
void gated_mul(const float* gu, int64_t N, int64_t dff, float* out, const arlm_kernels::Act8* xq, bool geglu) {
  at::parallel_for(0, N, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* g = gu + i * 2 * dff;
      const float* u = g + dff;
      float* o = out + i * dff;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (int64_t j = 0; j < dff; j += 16) {
        const __mmask16 m = arlm_kernels::tail_mask(dff - j);
        const __m512 gv = _mm512_maskz_loadu_ps(m, g + j);
        __m512 s;
        if (geglu) {
          s = gelu_tanh16(gv);
        } else {
          const __m512 e = arlm_kernels::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
          s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
        }
        _mm512_mask_storeu_ps(o + j, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + j)));
      }
#else
      int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 one = _mm256_set1_ps(1.f);
      for (; j + 8 <= dff; j += 8) {  // (dff is the model's: an element takes the same path at every step)
        const __m256 gv = _mm256_loadu_ps(g + j);
        const __m256 s = geglu ? gelu_tanh8(gv)
                               : _mm256_div_ps(gv, _mm256_add_ps(one, arlm_kernels::exp8(
                                                       _mm256_sub_ps(_mm256_setzero_ps(), gv))));
        _mm256_storeu_ps(o + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
      }
#endif
      for (; j < dff; ++j) o[j] = (geglu ? gelu_tanh(g[j]) : g[j] / (1.f + std::exp(-g[j]))) * u[j];
#endif
      if (xq) arlm_kernels::quantize_span(o, dff, *xq, i * dff);
    }
  });
}

// One call's buffers, carved from a per-thread arena that grows to the largest call seen and is
// then reused: a steady decode step allocates nothing.
class Arena {
 public:
  explicit Arena(size_t bytes) {
    thread_local std::unique_ptr<char, decltype(&std::free)> buf(nullptr, &std::free);
    thread_local size_t size = 0;
    if (bytes > size) {
      size = 0;  // a failed allocation leaves an empty arena, not a stale size
      buf.reset(static_cast<char*>(std::aligned_alloc(64, bytes)));
      TORCH_CHECK(buf, "decode: out of memory for ", bytes, " bytes of scratch");
      size = bytes;
    }
    next_ = buf.get();
  }
  template <typename T>
  T* take(int64_t n) {
    T* p = reinterpret_cast<T*>(next_);
    next_ += round(n * sizeof(T));
    return p;
  }
  static size_t round(size_t bytes) { return (bytes + 63) / 64 * 64; }

 private:
  char* next_;
};

// The per-layer weight list the layer stack takes: kLayerWeights tensors a layer, where
// LayerWeight (arlm_layout.h) says. A norm (kAttnNorm, kMlpNorm) is one float32 tensor [d]; a
// linear (kWqkv, kWo, kGateUp, kDown) is three, (w, scale, mins), in any layout `linear_into`
// takes, unused ones empty.

// A projection's output width: one linear, or its parts side by side (kWk, kWv after kWqkv; kUp
// after kGateUp), each part empty where the projection is one matrix.
int64_t parts_out(const char* op, const at::Tensor* W, std::initializer_list<int64_t> slots, int64_t K) {
  int64_t n = 0;
  for (int64_t s : slots)
    if (s == *slots.begin() || W[s].numel()) n += out_features(op, W + s, K);
  return n;
}

// The layer stack's shapes, read off the weights and checked.
struct Shapes {
  int64_t N, d, H, Hkv, hd, qkv_dim, dff, kmax;
  Shapes(const char* op, int64_t N, int64_t d, at::TensorList weights, int64_t L, int64_t H, int64_t Hkv,
         int64_t hd)
      : N(N), d(d), H(H), Hkv(Hkv), hd(hd), qkv_dim((H + 2 * Hkv) * hd) {
    TORCH_CHECK(L > 0, op, ": no layers");
    dff = parts_out(op, weights.data(), {kGateUp, kUp}, d) / 2;
    for (int64_t l = 0; l < L; ++l) {
      const at::Tensor* W = weights.data() + kLayerWeights * l;
      TORCH_CHECK(parts_out(op, W, {kWqkv, kWk, kWv}, d) == qkv_dim, op, ": wqkv has the wrong number of outputs");
      for (auto [slot, n] : {std::pair<int64_t, int64_t>{kQNorm, hd}, {kKNorm, hd}, {kAttnPostNorm, d},
                             {kMlpPostNorm, d}, {kQkvBias, qkv_dim}})  // each absent (empty) or [n] float32
        TORCH_CHECK(W[slot].numel() == 0 || (W[slot].numel() == n && W[slot].scalar_type() == at::kFloat &&
                                             W[slot].is_contiguous()), op, ": layer ", l, "'s extra weight ",
                    slot, " is not a contiguous float32 [", n, "]");
      TORCH_CHECK((W[kQNorm].numel() == 0) == (W[kKNorm].numel() == 0) &&
                  (W[kAttnPostNorm].numel() == 0) == (W[kMlpPostNorm].numel() == 0),
                  op, ": q/k norms and post norms come in pairs");
      TORCH_CHECK(out_features(op, W + kWo, H * hd) == d && parts_out(op, W, {kGateUp, kUp}, d) == 2 * dff &&
                  out_features(op, W + kDown, dff) == d, op, ": layer ", l, " does not match the model's widths");
    }
    kmax = std::max({d, H * hd, dff});
  }
};

// Every float and 8-bit buffer of one pass: h (the normed x), qkv, attention output, gate/up,
// SiLU * up, the 8-bit copy of the next linear's input, and attention scratch for `scratch`
// floats per thread.
struct Buffers {
  float *h, *qkv, *attn, *gu, *act, *scores, *partial;
  arlm_kernels::Act8 xq;
  Buffers(const Shapes& s, int64_t scratch, int64_t partial_floats = 0) {
    const int64_t N = s.N, G = N * s.kmax / 32, T = at::get_num_threads();
    const size_t floats = Arena::round(4 * N * s.d) + Arena::round(4 * N * s.qkv_dim) +
                          Arena::round(4 * N * s.H * s.hd) + Arena::round(4 * N * 2 * s.dff) +
                          Arena::round(4 * N * s.dff) +
                          Arena::round(4 * T * scratch) + Arena::round(N * s.kmax) + 3 * Arena::round(4 * G) +
                          Arena::round(4 * partial_floats);
    Arena arena(floats);
    h = arena.take<float>(N * s.d);
    qkv = arena.take<float>(N * s.qkv_dim);
    attn = arena.take<float>(N * s.H * s.hd);
    gu = arena.take<float>(N * 2 * s.dff);
    act = arena.take<float>(N * s.dff);
    scores = arena.take<float>(T * scratch);
    xq = {arena.take<int8_t>(N * s.kmax), arena.take<float>(G), arena.take<float>(G), arena.take<int32_t>(G)};
    partial = arena.take<float>(partial_floats);
  }
};

// The layer stack over x [N, d] in place, with attention left to attend(layer, qkv, xq): qkv
// [N, (H + 2 H_kv) * hd] holds the layer's queries, keys and values for the N tokens (before
// RoPE); it writes the attention output [N, H * hd] to buf.attn, and quantized into xq when xq is
// given. Per layer: norm (+ quantize), q/k/v, attention, output projection + residual, norm
// (+ quantize), gate/up, SiLU * up (+ quantize), down + residual: eight passes over the threads.
// timed(pass, f) runs f; while the per-pass timer is switched on (torch.ops.arlm.decode_profile;
// benchmarks/phases.py) it also sums each pass's wall time over layers and calls: where a step's
// time goes. Off, it costs one relaxed load a pass. The sums are process-wide: two threads decoding
// at once while it is on add their passes into the same sums (a tool for one decoding thread).
enum Phase { kNorm1, kQkv, kAttention, kWoPass, kNorm2, kGateUpPass, kSilu, kDownPass, kHead, kPhases };
std::atomic<bool> g_profile{false};
std::atomic<int64_t> g_phase_ns[kPhases] = {};

template <typename F>
inline void timed(Phase phase, F f) {
  if (!g_profile.load(std::memory_order_relaxed)) return f();
  const auto t0 = std::chrono::steady_clock::now();
  f();
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0);
  g_phase_ns[phase].fetch_add(ns.count(), std::memory_order_relaxed);
}

// x[i] += rms_norm(h[i]) * w for N rows of d (Gemma's norm on a branch's output before its
// residual add); h is overwritten.
void add_normed(float* x, float* h, const float* w, int64_t N, int64_t d, double eps) {
  rms_norm(h, w, N, d, eps, h, nullptr);
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0 * d; i < i1 * d; ++i) x[i] += h[i];
  });
}

// residual: bit (1 << slot) set for each linear (kWqkv, kWo, kGateUp, kDown) whose 8-bit
// activations are taken twice (linear_into); those read the float input, not buf.xq. A branch
// with a post norm (kAttnPostNorm, kMlpPostNorm) writes its output to buf.h, then adds it normed.
template <typename Attend>
void run_layers(float* x, const Shapes& s, at::TensorList weights, int64_t L, double eps, bool a8, int64_t residual,
                const Arch& arch, Buffers& buf, Attend attend) {
  const int64_t N = s.N, d = s.d;
  auto twice = [&](LayerWeight slot) { return a8 && (residual >> slot & 1); };
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* W = weights.data() + kLayerWeights * l;
    const bool post = W[kAttnPostNorm].numel() > 0;
    // the 8-bit copy of a linear's input, where it (or one of its parts) is packed
    auto quantized_for = [&](LayerWeight slot) {
      const bool any = packed(W + slot) || (slot == kWqkv && ((W[kWk].numel() && packed(W + kWk)) ||
                                                              (W[kWv].numel() && packed(W + kWv)))) ||
                       (slot == kGateUp && W[kUp].numel() && packed(W + kUp));
      return any && !twice(slot) ? &buf.xq : nullptr;
    };
    // a projection's parts (first, then the others where given) side by side in y's columns
    auto project = [&](std::initializer_list<int64_t> slots, const float* in, int64_t K, float* y, int64_t ldy) {
      const at::Tensor* parts[3];
      int64_t n = 0;
      bool all_packed = twice(static_cast<LayerWeight>(*slots.begin())) && K % 32 == 0;
      for (int64_t slot : slots)
        if (slot == *slots.begin() || W[slot].numel()) {
          parts[n++] = W + slot;
          all_packed = all_packed && packed(W + slot);
        }
      if (n > 1 && all_packed) return arlm_kernels::linear_a8p_residual_parts(in, N, K, parts, n, y, ldy);
      int64_t col = 0;
      for (int64_t slot : slots) {
        if (slot != *slots.begin() && !W[slot].numel()) continue;
        linear_into(in, &buf.xq, N, K, W + slot, a8, y + col, ldy, false, twice(static_cast<LayerWeight>(*slots.begin())));
        col += out_features("decode", W + slot, K);
      }
    };
    timed(kNorm1, [&] { rms_norm(x, W[kAttnNorm].data_ptr<float>(), N, d, eps, buf.h, quantized_for(kWqkv)); });
    timed(kQkv, [&] {
      project({kWqkv, kWk, kWv}, buf.h, d, buf.qkv, s.qkv_dim);
      if (W[kQkvBias].numel()) {
        const float* bias = W[kQkvBias].data_ptr<float>();
        for (int64_t i = 0; i < N; ++i)
          for (int64_t j = 0; j < s.qkv_dim; ++j) buf.qkv[i * s.qkv_dim + j] += bias[j];
      }
    });
    timed(kAttention, [&] { attend(l, buf.qkv, quantized_for(kWo)); });
    timed(kWoPass, [&] {
      linear_into(buf.attn, &buf.xq, N, s.H * s.hd, W + kWo, a8, post ? buf.h : x, d, !post, twice(kWo));
      if (post) add_normed(x, buf.h, W[kAttnPostNorm].data_ptr<float>(), N, d, eps);
    });
    timed(kNorm2, [&] { rms_norm(x, W[kMlpNorm].data_ptr<float>(), N, d, eps, buf.h, quantized_for(kGateUp)); });
    timed(kGateUpPass, [&] { project({kGateUp, kUp}, buf.h, d, buf.gu, 2 * s.dff); });
    timed(kSilu, [&] { gated_mul(buf.gu, N, s.dff, buf.act, quantized_for(kDown), arch.geglu); });
    timed(kDownPass, [&] {
      linear_into(buf.act, &buf.xq, N, s.dff, W + kDown, a8, post ? buf.h : x, d, !post, twice(kDown));
      if (post) add_normed(x, buf.h, W[kMlpPostNorm].data_ptr<float>(), N, d, eps);
    });
  }
}

// The Arch of an op's arguments, checked: windows one per layer (or none), the local RoPE tables
// (or empty ones) shaped as the global.
Arch make_arch(const char* op, int64_t L, bool geglu, double q_scale, at::IntArrayRef windows,
               const at::Tensor& local_cos, const at::Tensor& local_sin, const at::Tensor& cos) {
  Arch a;
  a.geglu = geglu;
  a.q_scale = static_cast<float>(q_scale);
  TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == L, op, ": one window per layer");
  for (int64_t w : windows) TORCH_CHECK(w >= 0, op, ": windows must be >= 0");
  if (!windows.empty()) a.windows = windows.data();
  if (local_cos.numel()) {
    TORCH_CHECK(local_cos.sizes() == cos.sizes() && local_sin.sizes() == cos.sizes() &&
                local_cos.scalar_type() == at::kFloat && local_sin.scalar_type() == at::kFloat &&
                local_cos.is_contiguous() && local_sin.is_contiguous(), op, ": local cos/sin shaped as cos/sin");
    a.local_cos = local_cos.data_ptr<float>();
    a.local_sin = local_sin.data_ptr<float>();
  }
  return a;
}

void check_common(const char* op, const at::Tensor& x, at::TensorList weights, int64_t L, const at::Tensor& pos,
                  const at::Tensor& cos, const at::Tensor& sin, int64_t hd, int64_t max_pos) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op, ": x [N, d] contiguous float32");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kLayerWeights * L, op, ": kLayerWeights (",
              static_cast<int64_t>(kLayerWeights), ") weight tensors per layer");
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == x.size(0) && pos.scalar_type() == at::kLong && pos.is_contiguous(),
              op, ": pos [N] int64");
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
              cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == hd && sin.sizes() == cos.sizes(),
              op, ": cos/sin [max_T, hd] float32");
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < x.size(0); ++i)
    TORCH_CHECK(0 <= pp[i] && pp[i] < max_pos && pp[i] < cos.size(0), op, ": position out of range");
  for (int64_t l = 0; l < L; ++l)
    for (int64_t j : {kAttnNorm, kMlpNorm}) {  // the linears check their own shapes
      const at::Tensor& w = weights[kLayerWeights * l + j];
      TORCH_CHECK(w.numel() == x.size(1) && w.scalar_type() == at::kFloat && w.is_contiguous(),
                  op, ": norm weights must be contiguous float32 [d]");
    }
}

}  // namespace

// One decode step over a contiguous cache, in place on x [B, d]: the step's token embeddings in,
// the hidden state after the last layer out (before the final norm). weights: kLayerWeights
// tensors per layer, laid out as LayerWeight says. k_cache, v_cache [L, B, H_kv, T, row] in the
// cache's format (kv_format, attention.h: float32 or float16 rows of hd, or quantized uint8 rows);
// pos [B] int64, each row's position (its K/V go to slot pos); attention reads slots
// 0..min(pos, kv_len - 1) of the row. cos, sin [max_T, hd].
void decode_llama(const at::Tensor& x, at::TensorList weights, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& pos, const at::Tensor& cos, const at::Tensor& sin, int64_t kv_len,
                  int64_t n_head, int64_t n_kv_heads, double eps, bool a8, int64_t residual, int64_t kv_format,
                  bool geglu, double q_scale, at::IntArrayRef windows, const at::Tensor& local_cos,
                  const at::Tensor& local_sin) {
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.dim() == 5 && cos.dim() == 2 && k_cache.sizes().slice(0, 4) ==
              v_cache.sizes().slice(0, 4), "decode_llama: caches [L, B, H_kv, T, row], cos [max_T, hd]");
  const int64_t L = k_cache.size(0), B = x.size(0), T = k_cache.size(3), hd = cos.size(1);
  TORCH_CHECK(k_cache.size(1) == B && k_cache.size(2) == n_kv_heads && n_kv_heads > 0 && n_head % n_kv_heads == 0 &&
              hd % 2 == 0, "decode_llama: cache shape does not match the batch or the heads");
  TORCH_CHECK(0 < kv_len && kv_len <= T, "decode_llama: kv_len out of range");
  // (a finished row may sit past kv_len: written, never read)
  check_common("decode_llama", x, weights, L, pos, cos, sin, hd, T);
  const Shapes s("decode_llama", B, x.size(1), weights, L, n_head, n_kv_heads, hd);
  const Arch arch = make_arch("decode_llama", L, geglu, q_scale, windows, local_cos, local_sin, cos);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t H = n_head, Hkv = n_kv_heads, group = H / Hkv, qkv_dim = s.qkv_dim;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  // Rows longer than kChunk slots are attended in chunks of kChunk (split-K, "flash decoding"):
  // a batch of one has only H_kv tasks otherwise, too few to keep the threads busy on a long
  // context. The chunks depend on the row's own length only, and a row of one chunk gets exactly
  // the unsplit result, so rows stay independent of their batch.
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, std::min(pp[b] + 1, kv_len));
  const int64_t chunks = longest > kChunk ? (longest + kChunk - 1) / kChunk : 1;
  Buffers buf(s, group * (std::min(longest, kChunk) + 1), chunks > 1 ? B * Hkv * chunks * group * (hd + 2) : 0);

  // One (row, KV head) per task: RoPE on its key and its query heads, the new K/V into slot pos,
  // attention of the query heads over the row's slots, and the output quantized for wo. The
  // cache's rows are EK (keys) and EV (values); everything else is float32.
  auto attend_in = [&](auto* kc, auto* vc, int64_t l, float* qkv, const arlm_kernels::Act8* xq) {
    using EK = std::remove_pointer_t<decltype(kc)>;
    using EV = std::remove_pointer_t<decltype(vc)>;
    const int64_t sk = arlm_kernels::KV<EK>::stride(hd), sv = arlm_kernels::KV<EV>::stride(hd);
    EK* kl = kc + l * B * Hkv * T * sk;
    EV* vl = vc + l * B * Hkv * T * sv;
    const bool fused = xq && group * hd % 32 == 0;  // the task's output is whole groups of 32
    const at::Tensor* W = weights.data() + kLayerWeights * l;
    const float* qn = W[kQNorm].numel() ? W[kQNorm].data_ptr<float>() : nullptr;
    const float* kn = qn ? W[kKNorm].data_ptr<float>() : nullptr;
    const float *lc = arch.cos(l, cp), *ls = arch.sin(l, sp);
    const int64_t window = arch.window(l);
    // the row's slots this layer reads: [first(b), first(b) + n(b)) (a sliding layer's last `window`)
    auto end = [&](int64_t b) { return std::min(pp[b] + 1, kv_len); };
    auto first = [&](int64_t b) { return window ? std::max<int64_t>(0, end(b) - window) : 0; };
    auto rope_and_store = [&](int64_t b, int64_t j) {
      float* row = qkv + b * qkv_dim;
      float *k = row + (H + j) * hd, *v = row + (H + Hkv + j) * hd;
      const float *c = lc + pp[b] * hd, *sn = ls + pp[b] * hd;
      prepare_heads(k, 0, 1, hd, nullptr, kn, eps, c, sn, 1.f);
      prepare_heads(row + j * group * hd, group, 0, hd, qn, nullptr, eps, c, sn, arch.q_scale);
      arlm_kernels::KV<EK>::store(k, hd, kl + ((b * Hkv + j) * T + pp[b]) * sk);
      arlm_kernels::KV<EV>::store(v, hd, vl + ((b * Hkv + j) * T + pp[b]) * sv);
    };
    auto finish = [&](int64_t b, int64_t j) {
      const int64_t off = (b * H + j * group) * hd;  // the task's outputs in buf.attn
      if (fused) arlm_kernels::quantize_span(buf.attn + off, group * hd, *xq, off);
    };
    if (chunks == 1) {  // every row in one pass: RoPE, the cache write, attention, quantize
      at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
        float* scratch = buf.scores + at::get_thread_num() * group * (longest + 1);
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t b = i / Hkv, j = i % Hkv, n = end(b) - first(b);
          rope_and_store(b, j);
          const EK* K = kl + ((b * Hkv + j) * T + first(b)) * sk;
          const EV* V = vl + ((b * Hkv + j) * T + first(b)) * sv;
          arlm_kernels::attend_group<EK, EV>(qkv + b * qkv_dim + j * group * hd, group, hd, n, scale,
                                             [&](auto f) { f(K, V, n); }, scratch,
                                             buf.attn + (b * H + j * group) * hd);
          finish(b, j);
        }
      });
    } else {  // RoPE and the cache writes; then one task per (row, KV head, chunk); then the combine
      at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) rope_and_store(i / Hkv, i % Hkv);
      });
      const int64_t part = group * hd, stat = 2 * group;  // floats of one chunk's sums and stats
      float* stats = buf.partial + B * Hkv * chunks * part;
      // Each thread takes the tasks of its own share in order (a KV head's chunks one after the
      // other: its keys and values read as two long streams), then helps with the others' shares
      // until none is left, not a fixed share alone: a row's last chunk is short (2,049 slots:
      // 1,024 + 1,024 + 1), so equal task counts can be 2:1 in rows, and on a shared machine one
      // core may run slower for a while. Which thread runs a task does not change its result.
      // (Tasks handed out one at a time in order had each thread read every other chunk: the 1B's
      // attention at 4-8k slots 10-13% slower; benchmarks/phases.py, docs/benchmarks.md.)
      const int64_t tasks = B * Hkv * chunks;
      const int64_t workers = std::min<int64_t>({tasks, at::get_num_threads(), kMaxWorkers});
      std::atomic<int64_t> next[kMaxWorkers];
      for (int64_t w = 0; w < workers; ++w) next[w].store(tasks * w / workers, std::memory_order_relaxed);
      at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t) {
        float* scratch = buf.scores + at::get_thread_num() * group * (kChunk + 1);
        auto take = [&]() -> int64_t {  // the next task of this thread's share, else of another's
          for (int64_t k = 0; k < workers; ++k) {
            const int64_t w = (w0 + k) % workers;
            const int64_t i = next[w].fetch_add(1, std::memory_order_relaxed);
            if (i < tasks * (w + 1) / workers) return i;
          }
          return tasks;
        };
        for (int64_t i; (i = take()) < tasks;) {
          const int64_t bj = i / chunks, c = i % chunks, b = bj / Hkv, j = bj % Hkv;
          const int64_t n = end(b) - first(b), t0 = c * kChunk, len = std::min(kChunk, n - t0);
          if (len <= 0) continue;  // this row has fewer chunks
          const EK* K = kl + (bj * T + first(b) + t0) * sk;
          const EV* V = vl + (bj * T + first(b) + t0) * sv;
          arlm_kernels::attend_group<EK, EV>(qkv + b * qkv_dim + j * group * hd, group, hd, len, scale,
                                             [&](auto f) { f(K, V, len); }, scratch, buf.partial + i * part,
                                             stats + i * stat);
        }
      });
      at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t b = i / Hkv, j = i % Hkv, n = end(b) - first(b);
          float* out = buf.attn + (b * H + j * group) * hd;
          arlm_kernels::combine_chunks(buf.partial + i * chunks * part, stats + i * chunks * stat,
                                       (n + kChunk - 1) / kChunk, group, hd, out);
          arlm_kernels::unrotate<EV>(out, group, hd);
          finish(b, j);
        }
      });
    }
    if (xq && !fused)
      at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) arlm_kernels::quantize_span(buf.attn + b * H * hd, H * hd, *xq, b * H * hd);
      });
  };
  arlm_kernels::with_kv("decode_llama", k_cache, v_cache, kv_format, hd, [&](auto* kc, auto* vc) {
    auto attend = [&](int64_t l, float* qkv, const arlm_kernels::Act8* xq) { attend_in(kc, vc, l, qkv, xq); };
    run_layers(x.data_ptr<float>(), s, weights, L, eps, a8, residual, arch, buf, attend);
  });
}

// The same layer stack over the serving engine's paged pool (arlm.kv_cache.KVCache), in place on
// x [N, d]: a flattened batch of tokens from any mix of sequences, token i of sequence
// seq_index[i] at position pos[i]. Attention (paged_attention.h) writes the new K/V into the
// blocks and attends through the block table.
void forward_llama_paged(const at::Tensor& x, at::TensorList weights, const at::Tensor& k_pool,
                         const at::Tensor& v_pool, const at::Tensor& block_table, const at::Tensor& seq_index,
                         const at::Tensor& pos, const at::Tensor& cos, const at::Tensor& sin, int64_t n_head,
                         int64_t n_kv_heads, double eps, bool a8, int64_t residual, int64_t kv_format,
                         int64_t window, int64_t sinks, bool geglu, double q_scale, at::IntArrayRef windows,
                         const at::Tensor& local_cos, const at::Tensor& local_sin, const at::Tensor& local_k,
                         const at::Tensor& local_v, const at::Tensor& local_table) {
  TORCH_CHECK(k_pool.dim() == 5 && v_pool.dim() == 5 && cos.dim() == 2 &&
              k_pool.sizes().slice(0, 4) == v_pool.sizes().slice(0, 4),
              "forward_llama_paged: pools [L, n_blocks, H_kv, block_size, row], cos [max_T, hd]");
  const int64_t L = static_cast<int64_t>(weights.size()) / kLayerWeights, N = x.size(0), hd = cos.size(1);
  const int64_t H = n_head, Hkv = n_kv_heads;
  TORCH_CHECK(k_pool.size(2) == Hkv && Hkv > 0 && H % Hkv == 0 && hd % 2 == 0,
              "forward_llama_paged: heads do not match");
  check_common("forward_llama_paged", x, weights, L, pos, cos, sin, hd, block_table.size(1) * k_pool.size(3));
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() && block_table.dim() == 2 &&
              seq_index.scalar_type() == at::kLong && seq_index.is_contiguous() && seq_index.size(0) == N,
              "forward_llama_paged: contiguous int64 block_table [S, M] and seq_index [N]");
  const int64_t BS = k_pool.size(3), M = block_table.size(1);
  const int64_t k_layer = k_pool.numel() / k_pool.size(0), v_layer = v_pool.numel() / v_pool.size(0);  // elements of one layer's pool
  const int64_t *table = block_table.data_ptr<int64_t>(), *seq = seq_index.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  arlm_kernels::check_block_table("forward_llama_paged", table, block_table.size(0), M, seq, pp, N, BS,
                                  k_pool.size(1));
  const Shapes s("forward_llama_paged", N, x.size(1), weights, L, H, Hkv, hd);
  const Arch arch = make_arch("forward_llama_paged", L, geglu, q_scale, windows, local_cos, local_sin, cos);
  TORCH_CHECK(!(arch.windows && window), "forward_llama_paged: a model with sliding-window layers runs without the "
              "cache's own window");
  // A split pool (kv_cache.py): the sliding layers' K/V in pools of their own, read through a
  // table of their own; layer l is layer `index[l]` of its pool.
  const bool split = local_k.numel() > 0;
  std::vector<int64_t> index(L);
  int64_t n_local = 0, n_full = 0;
  for (int64_t l = 0; l < L; ++l) index[l] = split && arch.window(l) ? n_local++ : n_full++;
  const int64_t* ltable = split ? local_table.data_ptr<int64_t>() : nullptr;
  TORCH_CHECK(k_pool.size(0) == n_full, "forward_llama_paged: the pools do not hold every layer");
  if (split) {
    TORCH_CHECK(local_k.dim() == 5 && local_v.dim() == 5 && local_k.size(0) == n_local &&
                local_k.sizes().slice(0, 4) == local_v.sizes().slice(0, 4) && local_k.size(2) == Hkv &&
                local_k.size(3) == BS && local_k.size(4) == k_pool.size(4) && local_v.size(4) == v_pool.size(4) &&
                local_k.scalar_type() == k_pool.scalar_type() && local_v.scalar_type() == v_pool.scalar_type() &&
                local_k.is_contiguous() && local_v.is_contiguous(),
                "forward_llama_paged: the sliding layers' pools [L_sliding, n_blocks, H_kv, block_size, row] as the "
                "others");
    TORCH_CHECK(local_table.scalar_type() == at::kLong && local_table.is_contiguous() &&
                local_table.sizes() == block_table.sizes(),
                "forward_llama_paged: the sliding layers' block table [S, M] int64, as the other");
    arlm_kernels::check_block_table("forward_llama_paged", ltable, block_table.size(0), M, seq, pp, N, BS,
                                    local_k.size(1));
  }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));  // as paged_cache.py's
  const int64_t qkv_dim = s.qkv_dim, group = H / Hkv;
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  Buffers buf(s, arlm_kernels::paged_scratch(seq, pp, N, H, Hkv, hd));
  TORCH_CHECK(window >= 0 && sinks >= 0, "forward_llama_paged: window and sinks must be >= 0");
  const arlm_kernels::Window win{window, sinks, cp, sp};  // (window 0: every slot; paged_attention.h)
  // straight from the q/k/v rows; the pools hold the cache's format (attention.h)
  const int64_t lk_layer = split ? local_k.numel() / local_k.size(0) : 0,
                lv_layer = split ? local_v.numel() / local_v.size(0) : 0;
  auto attend_in = [&](auto* k_base, auto* v_base, int64_t l, float* qkv, const arlm_kernels::Act8* xq) {
    const bool local = split && arch.window(l);
    auto *kp = k_base + index[l] * k_layer, *vp = v_base + index[l] * v_layer;
    const int64_t* table = ltable;
    if (local) {
      kp = reinterpret_cast<decltype(kp)>(local_k.data_ptr()) + index[l] * lk_layer;
      vp = reinterpret_cast<decltype(vp)>(local_v.data_ptr()) + index[l] * lv_layer;
    } else {
      table = block_table.data_ptr<int64_t>();
    }
    const at::Tensor* W = weights.data() + kLayerWeights * l;
    const float* qn = W[kQNorm].numel() ? W[kQNorm].data_ptr<float>() : nullptr;
    const float* kn = qn ? W[kKNorm].data_ptr<float>() : nullptr;
    const float *lc = arch.cos(l, cp), *ls = arch.sin(l, sp);
    // a sliding layer: its window without sinks (nothing is rotated back into place)
    const arlm_kernels::Window layer_win = arch.window(l) ? arlm_kernels::Window{arch.window(l), 0, cp, sp} : win;
    at::parallel_for(0, N, 8, [&](int64_t i0, int64_t i1) {  // norms, RoPE, then every token's K/V into the pool
      for (int64_t i = i0; i < i1; ++i) {
        prepare_heads(qkv + i * qkv_dim, H, Hkv, hd, qn, kn, eps, lc + pp[i] * hd, ls + pp[i] * hd, arch.q_scale);
        arlm_kernels::paged_write(qkv + H * hd, qkv + (H + Hkv) * hd, qkv_dim, kp, vp, table, M, seq, pp, i, Hkv,
                                  hd, BS);
      }
    });
    const bool fused = xq && group * hd % 32 == 0;
    arlm_kernels::paged_attend(qkv, qkv_dim, kp, vp, table, M, seq, pp, N, H, Hkv, hd, BS, scale, buf.attn,
                               buf.scores, [&](const float* o, int64_t at) {
                                 if (fused) arlm_kernels::quantize_span(o, group * hd, *xq, at);
                               }, layer_win);
    if (xq && !fused)
      at::parallel_for(0, N, 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) arlm_kernels::quantize_span(buf.attn + i * H * hd, H * hd, *xq, i * H * hd);
      });
  };
  arlm_kernels::with_kv("forward_llama_paged", k_pool, v_pool, kv_format, hd, [&](auto* kp, auto* vp) {
    auto attend = [&](int64_t l, float* qkv, const arlm_kernels::Act8* xq) { attend_in(kp, vp, l, qkv, xq); };
    run_layers(x.data_ptr<float>(), s, weights, L, eps, a8, residual, arch, buf, attend);
  });
}

// The final norm and the LM head: logits out [N, V] = head(rms_norm(x) * norm). head: (w, scale,
// mins) in any layout `decode_llama` takes; residual: a packed head takes its 8-bit activations
// twice (linear_a8p_residual). Writes into out (a buffer reused step after step).
void llama_head(const at::Tensor& x, const at::Tensor& norm, at::TensorList head, double eps, bool a8,
                bool residual, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && head.size() == 3 &&
              norm.numel() == x.size(1) && norm.scalar_type() == at::kFloat && norm.is_contiguous(),
              "llama_head: x [N, d] contiguous float32, norm [d] float32, head (w, scale, mins)");
  const int64_t N = x.size(0), d = x.size(1), V = out_features("llama_head", head.data(), d);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == N && out.size(1) == V && out.scalar_type() == at::kFloat &&
              out.is_contiguous(), "llama_head: out [N, vocab] contiguous float32");
  const size_t bytes = Arena::round(4 * N * d) + Arena::round(N * d) + 3 * Arena::round(4 * N * d / 32);
  Arena arena(bytes);
  float* h = arena.take<float>(N * d);
  const int64_t G = N * d / 32;
  const arlm_kernels::Act8 xq{arena.take<int8_t>(N * d), arena.take<float>(G), arena.take<float>(G),
                              arena.take<int32_t>(G)};
  TORCH_CHECK(!packed(head.data()) || d % 32 == 0, "llama_head: packed head needs d a multiple of 32");
  const bool two_pass = residual && a8 && d % 32 == 0;  // 8-bit activations taken twice (linear_into)
  timed(kHead, [&] {
    rms_norm(x.data_ptr<float>(), norm.data_ptr<float>(), N, d, eps, h,
             packed(head.data()) && !two_pass ? &xq : nullptr);
    linear_into(h, &xq, N, d, head.data(), a8, out.data_ptr<float>(), V, false, two_pass);
  });
}

#ifndef ARLM_BARE
// Switches the per-pass timing on or off and returns the seconds summed since the last call
// [norm 1, q/k/v, attention, wo, norm 2, gate/up, SiLU, down, final norm + head], then zeroes them.
at::Tensor decode_profile(bool on) {
  at::Tensor t = at::empty({kPhases}, at::TensorOptions().dtype(at::kDouble));
  for (int i = 0; i < kPhases; ++i) t.data_ptr<double>()[i] = 1e-9 * static_cast<double>(g_phase_ns[i].exchange(0));
  g_profile.store(on);
  return t;
}
#endif

// Greedy decoding's argmax over a row of V logits, as torch.argmax: the first index of the
// largest value, or of the first NaN. torch's index reductions run ~30x slower than its plain
// max on CPU (1.3 ms for [32, 49152]); a row here is a max pass and a compare pass.
int64_t argmax_row(const float* r, int64_t V) {
  int64_t best = -1;
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 m = arlm_kernels::tail_mask(V - j);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, r + j);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mv = _mm512_max_ps(mv, v);
  }
  if (!nan) {
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    for (int64_t j = 0; j < V && best < 0; j += 16) {
      const __mmask16 hit = _mm512_mask_cmp_ps_mask(arlm_kernels::tail_mask(V - j),
                                                    _mm512_loadu_ps(r + j), top, _CMP_EQ_OQ);
      if (hit) best = j + __builtin_ctz(hit);
    }
  }
#endif
  if (best < 0) {  // scalar: NaN rows (the first NaN wins) and CPUs without AVX-512
    best = 0;
    for (int64_t j = 0; j < V; ++j) {
      if (std::isnan(r[j])) { best = j; break; }
      if (r[j] > r[best]) best = j;
    }
  }
  return best;
}

#ifndef ARLM_BARE
// argmax_row over each row of logits [B, V] float32.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "argmax_rows: x [B, V] contiguous float32");
  const int64_t B = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({B}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) op[b] = argmax_row(xp + b * V, V);
  });
  return out;
}
#endif

// Structured outputs: logits[rows[i], t] = -inf for every token t whose bit is 0 in bits[i]
// (llguidance's mask: bit t % 32 of 32-bit word t / 32). Words with every bit set (all allowed)
// are skipped; tokens past the mask's words are masked too.
void mask_rows(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "mask_rows: logits [B, V] contiguous float32");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && bits.dim() == 2 &&
              bits.scalar_type() == at::kInt && bits.is_contiguous() && bits.size(0) == rows.size(0),
              "mask_rows: rows [n] int64, bits [n, words] contiguous int32");
  const int64_t V = logits.size(1), n = rows.size(0), W = bits.size(1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < logits.size(0), "mask_rows: row out of range");
  float* lp = logits.data_ptr<float>();
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  at::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float* r = lp + rp[i] * V;
      const uint32_t* w = bp + i * W;
      int64_t k = 0;
#if defined(__AVX512F__)
      const __m512 ninf = _mm512_set1_ps(-INFINITY);
      for (; k < W && 32 * k + 32 <= V; ++k) {  // two masked stores a word
        const uint32_t off = ~w[k];
        if (!off) continue;
        _mm512_mask_storeu_ps(r + 32 * k, static_cast<__mmask16>(off & 0xFFFF), ninf);
        _mm512_mask_storeu_ps(r + 32 * k + 16, static_cast<__mmask16>(off >> 16), ninf);
      }
#endif
      for (; k < W && 32 * k < V; ++k) {
        uint32_t off = ~w[k];
        while (off) {
          const int64_t t = 32 * k + __builtin_ctz(off);
          if (t < V) r[t] = -INFINITY;
          off &= off - 1;
        }
      }
      for (int64_t t = 32 * W; t < V; ++t) r[t] = -INFINITY;
    }
  });
}

#ifndef ARLM_BARE
TORCH_LIBRARY_FRAGMENT(arlm, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("mask_rows(Tensor(a!) logits, Tensor rows, Tensor bits) -> ()");
  m.def("decode_llama(Tensor(c!) x, Tensor[] weights, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor pos, "
        "Tensor cos, Tensor sin, int kv_len, int n_head, int n_kv_heads, float eps, bool a8, int residual, "
        "int kv_format, bool geglu, float q_scale, int[] windows, Tensor local_cos, Tensor local_sin) -> ()");
  m.def("forward_llama_paged(Tensor(c!) x, Tensor[] weights, Tensor(a!) k_pool, Tensor(b!) v_pool, "
        "Tensor block_table, Tensor seq_index, Tensor pos, Tensor cos, Tensor sin, int n_head, int n_kv_heads, "
        "float eps, bool a8, int residual, int kv_format, int window, int sinks, bool geglu, float q_scale, "
        "int[] windows, Tensor local_cos, Tensor local_sin, Tensor(d!) local_k, Tensor(e!) local_v, "
        "Tensor local_table) -> ()");
  m.def("llama_head(Tensor x, Tensor norm, Tensor[] head, float eps, bool a8, bool residual, Tensor(a!) out) -> ()");
  m.def("decode_profile(bool on) -> Tensor", &decode_profile);
}

TORCH_LIBRARY_IMPL(arlm, CPU, m) {
  m.impl("decode_llama", &decode_llama);
  m.impl("forward_llama_paged", &forward_llama_paged);
  m.impl("llama_head", &llama_head);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("mask_rows", &mask_rows);
}
#endif  // ARLM_BARE
