// Weight-only int8 linear layer for CPU decode: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k], or
// with a scale per group of 32 (Q8_0): y[m, n] = sum_g scale[n, g] * sum_{k in g} x[m, k] * w[n, k].
//
// Decode is memory-bound: each step streams every weight once. Stock PyTorch has no fast path
// for int8 weights with float activations on AVX2 (its int8 kernels run at ~1 GB/s here), so this
// kernel widens int8 -> float in registers and accumulates with FMA, reading each weight byte
// once. Rows of w are split across torch's intra-op threads (at::parallel_for).
#include "aten.h"
#include <immintrin.h>

#include "common.h"

#include <vector>

namespace {

constexpr int64_t kRows = 4;  // weight rows per tile: 4 independent accumulators hide FMA latency

#if defined(__AVX2__) && defined(__FMA__)
using arlm_kernels::hsum;

inline __m256 widen8(const int8_t* p) {  // 8 int8 -> 8 float
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// MB x rows against kRows weight rows: 4 * MB accumulators stay in registers, each widened weight
// vector is reused for MB rows of x (the batch), so batched decode does MB times the math per byte.
template <int MB>
inline void block_rows(const float* x, int64_t ldx, const int8_t* w, int64_t K, float* acc_out) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[MB][kRows];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kRows; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[kRows];
    for (int r = 0; r < kRows; ++r) wv[r] = widen8(w + r * K + k);
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
      for (int r = 0; r < kRows; ++r) acc[i][r] = _mm256_fmadd_ps(wv[r], xv, acc[i][r]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kRows; ++r) acc_out[i * kRows + r] = hsum(acc[i][r]);
#endif
}

// All M rows of x against one tile of `rows` weight rows; writes y[m, n + r] (scaled).
inline void tile(const float* x, int64_t M, const int8_t* w, int64_t K, int64_t rows,
                 float* y, int64_t N, const float* scale) {
  float out[3 * kRows];
#if defined(__AVX2__) && defined(__FMA__)
  if (rows == kRows && K % 8 == 0) {
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) {
      block_rows<3>(x + m * K, K, w, K, out);
      for (int i = 0; i < 3; ++i)
        for (int r = 0; r < kRows; ++r) y[(m + i) * N + r] = out[i * kRows + r] * scale[r];
    }
    for (; m + 2 <= M; m += 2) {
      block_rows<2>(x + m * K, K, w, K, out);
      for (int i = 0; i < 2; ++i)
        for (int r = 0; r < kRows; ++r) y[(m + i) * N + r] = out[i * kRows + r] * scale[r];
    }
    for (; m < M; ++m) {
      block_rows<1>(x + m * K, K, w, K, out);
      for (int r = 0; r < kRows; ++r) y[m * N + r] = out[r] * scale[r];
    }
    return;
  }
#endif
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < rows; ++r) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * static_cast<float>(w[r * K + k]);
      y[m * N + r] = acc * scale[r];
    }
}

// Group scales (Q8_0; Q6_K's per 16): MB x rows against kRows weight rows, each group of GS summed
// on its own and scaled by d[r * G + g] (the tile's scales as float32).
template <int MB, int GS = 32>
inline void block_rows_grouped(const float* x, int64_t ldx, const int8_t* w, int64_t K, const float* d,
                               float* acc_out) {
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t G = K / GS;
  __m256 acc[MB][kRows];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kRows; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 part[MB][kRows];
    for (int i = 0; i < MB; ++i)
      for (int r = 0; r < kRows; ++r) part[i][r] = _mm256_setzero_ps();
    for (int64_t k = g * GS; k < g * GS + GS; k += 8) {
      __m256 wv[kRows];
      for (int r = 0; r < kRows; ++r) wv[r] = widen8(w + r * K + k);
      for (int i = 0; i < MB; ++i) {
        const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
        for (int r = 0; r < kRows; ++r) part[i][r] = _mm256_fmadd_ps(wv[r], xv, part[i][r]);
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int r = 0; r < kRows; ++r) acc[i][r] = _mm256_fmadd_ps(part[i][r], _mm256_set1_ps(d[r * G + g]), acc[i][r]);
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kRows; ++r) acc_out[i * kRows + r] = hsum(acc[i][r]);
#endif
}

#if defined(__AVX512F__)
// The same with 16 weights to a vector: a group of 32 is two widened loads and two FMAs per row
// (a group of 16, GS = 16: one, its second half's weights and FMA skipped).
template <int MB, int GS = 32>
inline void block_rows_grouped16(const float* x, int64_t ldx, const int8_t* w, int64_t K, const float* d,
                                 float* acc_out) {
  const int64_t G = K / GS;
  __m512 acc[MB][kRows];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kRows; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 w0[kRows], w1[kRows];
    for (int r = 0; r < kRows; ++r) {
      const int8_t* p = w + r * K + g * GS;
      w0[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      if constexpr (GS == 32)
        w1[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
    }
    for (int i = 0; i < MB; ++i) {
      const __m512 x0 = _mm512_loadu_ps(x + i * ldx + g * GS);
      for (int r = 0; r < kRows; ++r) {
        __m512 part = _mm512_mul_ps(w0[r], x0);
        if constexpr (GS == 32) part = _mm512_fmadd_ps(w1[r], _mm512_loadu_ps(x + i * ldx + g * GS + 16), part);
        acc[i][r] = _mm512_fmadd_ps(part, _mm512_set1_ps(d[r * G + g]), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kRows; ++r) acc_out[i * kRows + r] = _mm512_reduce_add_ps(acc[i][r]);
}
#endif

// All M rows of x against one tile of `rows` weight rows with group scales d [rows, K/GS].
template <int GS>
inline void tile_grouped(const float* x, int64_t M, const int8_t* w, int64_t K, int64_t rows, float* y, int64_t N,
                         const float* d) {
  const int64_t G = K / GS;
#if defined(__AVX512F__)
  if (rows == kRows) {  // x rows 4, 2, 1 at a time: each widened weight vector serves them all
    float out[4 * kRows];
    int64_t m = 0;
    auto put = [&](int mb) {
      for (int i = 0; i < mb; ++i)
        for (int r = 0; r < kRows; ++r) y[(m + i) * N + r] = out[i * kRows + r];
    };
    for (; m + 4 <= M; m += 4) { block_rows_grouped16<4, GS>(x + m * K, K, w, K, d, out); put(4); }
    for (; m + 2 <= M; m += 2) { block_rows_grouped16<2, GS>(x + m * K, K, w, K, d, out); put(2); }
    for (; m < M; ++m) { block_rows_grouped16<1, GS>(x + m * K, K, w, K, d, out); put(1); }
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (rows == kRows) {
    float out[kRows];
    for (int64_t m = 0; m < M; ++m) {
      block_rows_grouped<1, GS>(x + m * K, K, w, K, d, out);
      for (int r = 0; r < kRows; ++r) y[m * N + r] = out[r];
    }
    return;
  }
#endif
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < rows; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        float part = 0.f;
        for (int64_t k = g * GS; k < g * GS + GS; ++k) part += x[m * K + k] * static_cast<float>(w[r * K + k]);
        acc += part * d[r * G + g];
      }
      y[m * N + r] = acc;
    }
}

}  // namespace

#ifndef ARLM_BARE  // (ops that return new tensors: torch's build only)
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  arlm_kernels::check_int8("int8_linear", x, w, scale, false);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kRows - 1) / kRows;
  if (arlm_kernels::group_scales(scale)) {
    const int64_t G = scale.size(1);
    const bool half16 = arlm_kernels::scale_group(scale, K) == 16;
    at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
      std::vector<float> d(kRows * G);  // one tile's scales, widened once
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n = t * kRows, rows = std::min(kRows, N - n);
        arlm_kernels::scales_f32(scale, n * G, rows * G, d.data());
        if (half16) tile_grouped<16>(xp, M, wp + n * K, K, rows, yp + n, N, d.data());
        else tile_grouped<32>(xp, M, wp + n * K, K, rows, yp + n, N, d.data());
      }
    });
    return y;
  }
  const float* sp = scale.data_ptr<float>();
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * kRows;
      tile(xp, M, wp + n * K, K, std::min(kRows, N - n), yp + n, N, sp + n);
    }
  });
  return y;
}

TORCH_LIBRARY(arlm, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(arlm, CPU, m) {
  m.impl("int8_linear", &int8_linear);
}
#endif  // ARLM_BARE
