// 4-bit grouped linear layer for CPU decode, the Q4_1 layout of llama.cpp:
//   w[n, k] = scale[n, g] * q[n, k] + min[n, g],  q in 0..15,  g = k / 32
// q is packed two per byte: in group g of row n, byte j (of 16) holds element 32g + j in its low
// nibble and element 32g + 16 + j in its high nibble. scale and min are float16 [N, K / 32], or
// float32 (a Q4_K matrix's d sc and -dmin m per group: its values exactly, in the row layout).
// That is 0.625 bytes a weight against int8's 1 (and float32's 4); decode streams every weight
// once a step, so fewer bytes is faster steps. Each 4-bit value is widened and dequantized in
// registers (one FMA), then multiplied into the activations with float32 accumulation.
#include "aten.h"
#include <immintrin.h>

#include "common.h"

#include <vector>

namespace {

constexpr int64_t kRows = 4;   // weight rows per tile
constexpr int64_t kGroup = 32;  // weights per scale/min pair

#if defined(__AVX2__) && defined(__FMA__)
using arlm_kernels::hsum;

inline __m256 u8_to_ps(__m128i v) {  // low 8 bytes -> 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}

// MB rows of x against kRows weight rows, all groups. Each (x row, weight row) pair sums in the
// same order whatever MB is, so a row's result does not depend on how many rows share the call:
// batched decode and continuous batching give bitwise the results of running alone.
template <int MB>
void block(const float* x, int64_t K, const uint8_t* w, const float* d, const float* mn, float* out) {
  constexpr int kSplit = 2;  // two accumulators per pair: more independent FMA chains
  const int64_t G = K / kGroup, ldw = K / 2;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256 acc[kSplit][MB][kRows];
  for (int s = 0; s < kSplit; ++s)
    for (int i = 0; i < MB; ++i)
      for (int r = 0; r < kRows; ++r) acc[s][i][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const float* xg = x + g * kGroup;
    for (int r = 0; r < kRows; ++r) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * ldw + g * 16));
      const __m128i lo = _mm_and_si128(bytes, low4);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
      const __m256 dv = _mm256_set1_ps(d[r * G + g]), mv = _mm256_set1_ps(mn[r * G + g]);
      const __m256 w0 = _mm256_fmadd_ps(u8_to_ps(lo), dv, mv);
      const __m256 w1 = _mm256_fmadd_ps(u8_to_ps(_mm_srli_si128(lo, 8)), dv, mv);
      const __m256 w2 = _mm256_fmadd_ps(u8_to_ps(hi), dv, mv);
      const __m256 w3 = _mm256_fmadd_ps(u8_to_ps(_mm_srli_si128(hi, 8)), dv, mv);
      for (int i = 0; i < MB; ++i) {
        const float* xi = xg + i * K;
        __m256& a = acc[0][i][r];
        __m256& b = acc[kSplit - 1][i][r];
        a = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xi), a);
        b = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xi + 8), b);
        a = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xi + 16), a);
        b = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xi + 24), b);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kRows; ++r)
      out[i * kRows + r] = hsum(_mm256_add_ps(acc[0][i][r], acc[1][i][r]));
}
#endif

inline float weight(const uint8_t* w_row, const float* d_row, const float* mn_row, int64_t k) {
  const int64_t g = k / kGroup, j = k % kGroup;
  const uint8_t byte = w_row[g * 16 + (j % 16)];
  const int q = j < 16 ? (byte & 0x0F) : (byte >> 4);
  return d_row[g] * static_cast<float>(q) + mn_row[g];
}

// All M rows of x against one tile of `rows` weight rows (scales already float32 in d, mn).
void tile(const float* x, int64_t M, int64_t K, const uint8_t* w, const float* d, const float* mn,
          int64_t rows, float* y, int64_t N) {
  const int64_t G = K / kGroup;
#if defined(__AVX2__) && defined(__FMA__)
  if (rows == kRows) {
    float out[2 * kRows];
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) {
      block<2>(x + m * K, K, w, d, mn, out);
      for (int i = 0; i < 2; ++i)
        for (int r = 0; r < kRows; ++r) y[(m + i) * N + r] = out[i * kRows + r];
    }
    for (; m < M; ++m) {
      block<1>(x + m * K, K, w, d, mn, out);
      for (int r = 0; r < kRows; ++r) y[m * N + r] = out[r];
    }
    return;
  }
#endif
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < rows; ++r) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * weight(w + r * (K / 2), d + r * G, mn + r * G, k);
      y[m * N + r] = acc;
    }
}

}  // namespace

#ifndef ARLM_BARE  // (ops that return new tensors: torch's build only)
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& mins) {
  arlm_kernels::check_q4("q4_linear", x, w, scale, mins);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), G = K / kGroup;
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kRows - 1) / kRows;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> d(kRows * G), mn(kRows * G);  // one tile's scales, widened once
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * kRows, rows = std::min(kRows, N - n);
      arlm_kernels::scales_f32(scale, n * G, rows * G, d.data());
      arlm_kernels::scales_f32(mins, n * G, rows * G, mn.data());
      tile(xp, M, K, wp + n * (K / 2), d.data(), mn.data(), rows, yp + n, N);
    }
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(arlm, m) {
  m.def("q4_linear(Tensor x, Tensor w, Tensor scale, Tensor mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(arlm, CPU, m) {
  m.impl("q4_linear", &q4_linear);
}
#endif  // ARLM_BARE
