// What arlm's CPU kernels share (included by the .cpp files next to it and by
// serve/paged_attention.cpp): the weight layouts' argument checks and SIMD helpers.
#pragma once
#include "aten.h"
#include <immintrin.h>

#include <algorithm>
#include <cmath>

namespace arlm_kernels {

// 4-bit weights (q4_linear.cpp for the layout): x [M, K] float32, w [N, K/2] uint8, scale and
// mins [N, K/32] float16, all contiguous, K a multiple of 32.
inline void check_q4(const char* op, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                     const at::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scale.dim() == 2 && mins.dim() == 2,
              op, ": x [M,K], w [N,K/2], scale and mins [N,K/32]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte &&
              (scale.scalar_type() == at::kHalf || scale.scalar_type() == at::kFloat) &&
              mins.scalar_type() == scale.scalar_type(),
              op, ": x float32, w uint8, scale and mins float16 (Q4_1) or float32 (Q4_K's d sc and -dmin m)");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && scale.is_contiguous() && mins.is_contiguous(),
              op, ": contiguous inputs");
  const int64_t K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0 && w.size(1) == K / 2 && scale.size(0) == N && scale.size(1) == K / 32 &&
              mins.sizes() == scale.sizes(), op, ": shape mismatch (K must be a multiple of 32)");
}

// int8 weights: x [M, K] float32, w [N, K] int8, all contiguous, and either one scale per output
// row, scale [N] float32, or one per group of 32 (Q8_0's layout, the file's own), scale [N, K/32]
// float16 (K a multiple of 32 where the kernel works in groups, and for group scales).
inline bool group_scales(const at::Tensor& scale) { return scale.dim() == 2; }

// Weights per group scale: 32 (Q8_0's float16, or float32), or 16 (float32: Q6_K's d sc).
inline int64_t scale_group(const at::Tensor& scale, int64_t K) {
  return group_scales(scale) && scale.size(1) > 0 ? K / scale.size(1) : K;
}

inline void check_int8(const char* op, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                       bool groups_of_32) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && (scale.dim() == 1 || scale.dim() == 2),
              op, ": x [M,K], w [N,K], scale [N] or [N,K/32] or [N,K/16]");
  const bool grouped = group_scales(scale);
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar &&
              (scale.scalar_type() == at::kFloat || (grouped && scale.scalar_type() == at::kHalf)),
              op, ": x float32, w int8, scale float32 [N], float16 [N,K/32] or float32 [N,K/32] or [N,K/16]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && scale.is_contiguous(), op, ": contiguous inputs");
  const int64_t K = x.size(1);
  TORCH_CHECK(w.size(1) == K && scale.size(0) == w.size(0) && (!(groups_of_32 || grouped) || K % 32 == 0) &&
              (!grouped || scale.size(1) * 32 == K || (scale.size(1) * 16 == K && scale.scalar_type() == at::kFloat)),
              op, groups_of_32 || grouped ? ": shape mismatch (K must be a multiple of 32)" : ": shape mismatch");
}

// A tile's group scales as float32: float16 widened (below), float32 copied.
inline void widen(const at::Half* src, int64_t n, float* dst);
inline void scales_f32(const at::Tensor& scale, int64_t first, int64_t n, float* dst) {
  if (scale.scalar_type() == at::kHalf) return widen(scale.data_ptr<at::Half>() + first, n, dst);
  std::copy(scale.data_ptr<float>() + first, scale.data_ptr<float>() + first + n, dst);
}

// float16 -> float32, n values, 8 at a time where the CPU has F16C (scalar conversion costs more
// than the matmul it feeds).
inline void widen(const at::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// 8-bit activations (a8_linear.cpp) in the caller's storage, as one flat run of values cut into
// groups of 32: value e is q[e], its group e / 32 has scale d, s = d * sum of its q, and that sum.
// Rows of K values (K a multiple of 32) lie one after another: row m starts at value m * K.
struct Act8 {
  int8_t* q;
  float* d;
  float* s;
  int32_t* sum;
};

// Quantizes x[0..n) (n a multiple of 32) into values at..at+n of a (at a multiple of 32). Serial:
// callers quantize what they just wrote, inside their own parallel loop.
void quantize_span(const float* x, int64_t n, const Act8& a, int64_t at);

// Packed int8 / 4-bit weights (a8_linear.cpp; wp 3-D; int8 with scale [N] float32 or, Q8_0,
// [N/16, K/32, 16] float16; 4-bit with scale and mins [N/16, K/32, 16]): checks the layout against
// K and returns N.
int64_t packed_out_features(const char* op, int64_t K, const at::Tensor& wp, const at::Tensor& scale,
                            const at::Tensor& mins);

// y[m, n] (row stride ldy) = sum_k x[m, k] w[n, k] for M rows of quantized x, or y += that when
// accumulate (a residual add). Over the thread pool; AVX-512 VNNI builds only.
void linear_a8p(const Act8& x, int64_t M, int64_t K, const at::Tensor& wp, const at::Tensor& scale,
                const at::Tensor& mins, float* y, int64_t ldy, bool accumulate);

// The same product with x taken as 16 bits per group of 32 (step max|x| / 32512), split exactly
// into two bytes, hi and lo: 256 dot(w, hi) + dot(w, lo) per group in int32, then one scale
// (a8_linear.cpp, x16p_block). ~16 bits of activation, close to float32's products, for 2x the
// integer dot products of one 8-bit pass but one pass over the weights ("int8x2": 8-bit
// activations taken twice). x [M, K] float32 (row stride K); y as linear_a8p.
void linear_a8p_residual(const float* x, int64_t M, int64_t K, const at::Tensor& wp, const at::Tensor& scale,
                         const at::Tensor& mins, float* y, int64_t ldy, bool accumulate);

// linear_a8p_residual of several packed layers that read the same x (a projection's parts: Q4_K_M's
// Q4_K q and k beside its Q6_K v), their outputs side by side in y's columns (n parts, each
// (wp, scale, mins)): x quantized once, and a decode step's rows in one pass of the pool over
// all the parts, each thread's share cut by bytes. Each output as the part's own call gives it.
void linear_a8p_residual_parts(const float* x, int64_t M, int64_t K, const at::Tensor* const* parts, int64_t n,
                               float* y, int64_t ldy);

// r[0..n) = x - (x quantized to 8 bits per group of 32 and back): what one 8-bit pass loses (n a
// multiple of 32); the row layouts' (AVX2) second pass. Serial.
void activation_residual(const float* x, int64_t n, float* r);

// bf16_linear.cpp: y[m, n] (row stride ldy) = x[m, :] . w[n, :] (or y += that) with x rounded to
// bf16, float32 sums; wp in the packed bf16 layout [N/16, K/2, 32] (bf16_packed). AVX512-BF16 builds.
bool bf16_packed(const at::Tensor& w);
void bf16_linear_into(const float* x, int64_t M, int64_t K, const at::Tensor& wp, float* y, int64_t ldy,
                      bool accumulate);

}  // namespace arlm_kernels

#if defined(__AVX2__) && defined(__FMA__)
namespace arlm_kernels {

// The sum of the 8 lanes.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace arlm_kernels
#endif

namespace arlm_kernels {

#if defined(__AVX512F__)
// e^x for 16 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' expf polynomial (about
// 1 ulp), times 2^n by scalef. x is clamped to [-104, 89] first (e^x is 0 / inf beyond in
// float32; max/min with x second keep NaN), so scalef gives 0 and inf there.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(89.f), _mm512_max_ps(_mm512_set1_ps(-104.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
}
#elif defined(__AVX2__) && defined(__FMA__)
// exp16's e^x for 8 floats on AVX2: the same clamp, reduction and polynomial; 2^n (n in [-150, 128]
// after the clamp) as the product of two powers of two with normal exponents, so one rounding
// where the result is subnormal, as scalef's.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(89.f), _mm256_max_ps(_mm256_set1_ps(-104.f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i k = _mm256_cvtps_epi32(n), k1 = _mm256_srai_epi32(k, 1), k2 = _mm256_sub_epi32(k, k1);
  auto pow2 = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  };
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(k1)), pow2(k2));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// s[j .. j + 8) as a vector, the lanes past n `fill`.
inline __m256 load8_tail(const float* s, int64_t j, int64_t n, float fill) {
  if (j + 8 <= n) return _mm256_loadu_ps(s + j);
  alignas(32) float t[8];
  for (int64_t i = 0; i < 8; ++i) t[i] = j + i < n ? s[j + i] : fill;
  return _mm256_load_ps(t);
}
#endif

// s[j] = exp(s[j] - max(s)) in place for j < n; returns their sum (and the max in *max_out when
// given). The same operations for each element whatever n (16 at a time, the tail masked), so
// results do not depend on the batch.
inline float softmax_numerators(float* s, int64_t n, float* max_out = nullptr) {
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += 16)
    mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(n - j), s + j));
  const float top = _mm512_reduce_max_ps(mv);
  if (max_out) *max_out = top;
  const __m512 mx = _mm512_set1_ps(top);
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = tail_mask(n - j);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), mx));
    _mm512_mask_storeu_ps(s + j, m, e);
    total = _mm512_mask_add_ps(total, m, total, e);
  }
  return _mm512_reduce_add_ps(total);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += 8) mv = _mm256_max_ps(mv, load8_tail(s, j, n, -INFINITY));
  const float top = hmax(mv);
  if (max_out) *max_out = top;
  const __m256 mx = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(load8_tail(s, j, n, 0.f), mx));
    if (j + 8 <= n) {
      _mm256_storeu_ps(s + j, e);
      total = _mm256_add_ps(total, e);
    } else {  // the tail: its lanes alone
      alignas(32) float t[8];
      _mm256_store_ps(t, e);
      for (int64_t i = 0; i < n - j; ++i) s[j + i] = t[i];
      const __m256 in = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                                      _mm256_set1_ps(static_cast<float>(n - j)), _CMP_LT_OQ);
      total = _mm256_add_ps(total, _mm256_blendv_ps(_mm256_setzero_ps(), e, in));
    }
  }
  return hsum(total);
#else
  float mx = -INFINITY, total = 0.f;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
  if (max_out) *max_out = mx;
  for (int64_t j = 0; j < n; ++j) total += (s[j] = std::exp(s[j] - mx));
  return total;
#endif
}

}  // namespace arlm_kernels
