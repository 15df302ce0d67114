// What arlm's CPU kernels share (included by the .cpp files next to it and by
// serve/paged_attention.cpp): the weight layouts' argument checks and SIMD helpers.
#pragma once
#include <ATen/ATen.h>
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
              scale.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf,
              op, ": x float32, w uint8, scale and mins float16");
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

inline void check_int8(const char* op, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                       bool groups_of_32) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && (scale.dim() == 1 || scale.dim() == 2),
              op, ": x [M,K], w [N,K], scale [N] or [N,K/32]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar &&
              scale.scalar_type() == (group_scales(scale) ? at::kHalf : at::kFloat),
              op, ": x float32, w int8, scale float32 [N] or float16 [N,K/32]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && scale.is_contiguous(), op, ": contiguous inputs");
  const bool grouped = groups_of_32 || group_scales(scale);
  TORCH_CHECK(w.size(1) == x.size(1) && scale.size(0) == w.size(0) && (!grouped || x.size(1) % 32 == 0) &&
              (!group_scales(scale) || scale.size(1) == x.size(1) / 32),
              op, grouped ? ": shape mismatch (K must be a multiple of 32)" : ": shape mismatch");
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

// The same product with 8-bit activations taken twice: x ~ q1 d1 + q2 d2, q2 d2 the 8-bit
// rounding of x's own rounding error (x - q1 d1). ~15 bits of activation, close to float32's
// products, for ~2x the integer dot products but one pass over the weights (each row of x and
// its residual run as a pair of rows). x [M, K] float32 (row stride K); y as linear_a8p.
// r[0..n) = x - (x quantized to 8 bits per group of 32 and back): what one 8-bit pass loses (n a
// multiple of 32). Serial.
void activation_residual(const float* x, int64_t n, float* r);

void linear_a8p_residual(const float* x, int64_t M, int64_t K, const at::Tensor& wp, const at::Tensor& scale,
                         const at::Tensor& mins, float* y, int64_t ldy, bool accumulate);

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
#else
  float mx = -INFINITY, total = 0.f;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
  if (max_out) *max_out = mx;
  for (int64_t j = 0; j < n; ++j) total += (s[j] = std::exp(s[j] - mx));
  return total;
#endif
}

}  // namespace arlm_kernels

namespace arlm_kernels {

// K/V cache elements are float32 or float16 (half the bytes a decode step streams); the math
// is float32 either way. load8 / load16: 8 or 16 of them widened to float32.
inline float to_float(float v) { return v; }
inline float to_float(at::Half v) { return static_cast<float>(v); }
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// dst[0..n) = src as T (float16: rounded to nearest even, as torch's .to(torch.float16)).
inline void store_row(const float* src, int64_t n, float* dst) { std::copy(src, src + n, dst); }
inline void store_row(const float* src, int64_t n, at::Half* dst) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = static_cast<at::Half>(src[i]);
}

// sum_i a[i] * b[i], in an order that depends on n alone.
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
#if defined(__AVX512F__)
  if (n % 32 == 0) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 32) {
      s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), s0);
      s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), load16(b + i + 16), s1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
    return hsum(acc);
  }
#endif
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * to_float(b[i]);
  return s;
}

#if defined(__AVX512F__)
// out[h] = inv[h] * sum_t s[h * n + t] V[t] for HB heads at once, V rows of C * 16 floats: each V
// row is loaded once for all HB heads; every head's sum is in registers, in slot order.
template <int C, int HB, typename T, typename Spans>
inline void weighted_heads(const float* s, int64_t n, Spans spans, const float* inv, int64_t hd, float* out) {
  __m512 acc[HB][C];
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = _mm512_setzero_ps();
  int64_t t = 0;
  spans([&](const T*, const T* v, int64_t len) {
    for (int64_t j = 0; j < len; ++j, ++t)
      for (int c = 0; c < C; ++c) {
        const __m512 vc = load16(v + j * C * 16 + c * 16);
        for (int h = 0; h < HB; ++h) acc[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[h * n + t]), vc, acc[h][c]);
      }
  });
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(out + h * hd + c * 16, _mm512_mul_ps(acc[h][c], _mm512_set1_ps(inv[h])));
}

// weighted_heads over G heads, 16 / C at a time (16 accumulators).
template <int C, typename T, typename Spans>
inline void weighted_group(const float* s, int64_t n, int64_t G, Spans spans, const float* inv, int64_t hd,
                           float* out) {
  constexpr int HB = 16 / C;
  for (int64_t h = 0; h < G; h += HB) {
    const float *sh = s + h * n, *ih = inv + h;
    float* oh = out + h * hd;
    switch (std::min<int64_t>(HB, G - h)) {
      case 1: weighted_heads<C, 1, T>(sh, n, spans, ih, hd, oh); break;
      case 2: weighted_heads<C, 2 <= HB ? 2 : 1, T>(sh, n, spans, ih, hd, oh); break;
      case 3: weighted_heads<C, 3 <= HB ? 3 : 1, T>(sh, n, spans, ih, hd, oh); break;
      default: weighted_heads<C, HB, T>(sh, n, spans, ih, hd, oh); break;
    }
  }
}
#endif

// The G query heads that share one KV head (G * hd floats at q, head after head) attend over its n
// cached slots: out[h] = softmax(q_h . K_t * scale) V. The slots come as spans of consecutive
// rows, spans(f) calling f(k, v, len) for each in order: one span for a contiguous cache, one per
// block for the paged pool. Each K and V row is read once for all G heads. Every head runs the
// same operations in the same order whatever G, the layout, the batch or the thread, so its
// output does not depend on them. K/V rows of T (float or at::Half). s: G * (n + 1) floats of
// scratch; out: G * hd floats.
// With stats, the slots are one chunk of a longer row (split-K, combine_chunks below): out gets
// the unnormalized sums sum_t exp(s_t - max) V_t, and stats[2h], stats[2h + 1] head h's max score
// and sum of exp.
template <typename T, typename Spans>
inline void attend_group(const float* q, int64_t G, int64_t hd, int64_t n, float scale, Spans spans, float* s,
                         float* out, float* stats = nullptr) {
  int64_t t = 0;
  spans([&](const T* k, const T*, int64_t len) {
    for (int64_t j = 0; j < len; ++j, ++t)
      for (int64_t h = 0; h < G; ++h) s[h * n + t] = dot(q + h * hd, k + j * hd, hd) * scale;
  });
  float* inv = s + G * n;
  for (int64_t h = 0; h < G; ++h) {
    if (!stats) {
      inv[h] = 1.f / softmax_numerators(s + h * n, n);
      continue;
    }
    stats[2 * h + 1] = softmax_numerators(s + h * n, n, stats + 2 * h);
    inv[h] = 1.f;  // x * 1 is exact: the chunk's sums as they are
  }
#if defined(__AVX512F__)
  if (hd == 64) return weighted_group<4, T>(s, n, G, spans, inv, hd, out);
  if (hd == 128) return weighted_group<8, T>(s, n, G, spans, inv, hd, out);
#endif
  std::fill(out, out + G * hd, 0.f);
  t = 0;
  spans([&](const T*, const T* v, int64_t len) {
    for (int64_t j = 0; j < len; ++j, ++t)
      for (int64_t h = 0; h < G; ++h)
        for (int64_t e = 0; e < hd; ++e) out[h * hd + e] += s[h * n + t] * to_float(v[j * hd + e]);
  });
  for (int64_t h = 0; h < G; ++h)
    for (int64_t e = 0; e < hd; ++e) out[h * hd + e] *= inv[h];
}

// The attention output of G heads from C chunks' partial results (attend_group with stats; chunk
// c's sums at part + c * G * hd, its stats at stats + c * 2 G): out = sum_c f_c o_c with
// f_c = exp(m_c - M) / L, M the largest max, L = sum_c exp(m_c - M) l_c, in chunk order.
inline void combine_chunks(const float* part, const float* stats, int64_t C, int64_t G, int64_t hd, float* out) {
  for (int64_t h = 0; h < G; ++h) {
    float top = -INFINITY, total = 0.f;
    for (int64_t c = 0; c < C; ++c) top = std::max(top, stats[c * 2 * G + 2 * h]);
    for (int64_t c = 0; c < C; ++c) total += std::exp(stats[c * 2 * G + 2 * h] - top) * stats[c * 2 * G + 2 * h + 1];
    const float inv = 1.f / total;
    float* o = out + h * hd;
    for (int64_t c = 0; c < C; ++c) {
      const float f = std::exp(stats[c * 2 * G + 2 * h] - top) * inv;
      const float* p = part + (c * G + h) * hd;
      for (int64_t e = 0; e < hd; ++e) o[e] = c == 0 ? p[e] * f : o[e] + p[e] * f;
    }
  }
}

}  // namespace arlm_kernels
