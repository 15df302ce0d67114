// How the KV cache stores one row: the hd values of one token's key (or value) for one KV head.
// Every attention kernel reads and writes rows only through KV<T> (paged_attention.h, decode.cpp),
// so a format is defined once, here, and arlm/kv_cache.py's quantizers mirror it bit for bit.
//
//   float, at::Half   hd elements (float16: rounded to nearest even when written)
//   Q8                --kv-dtype int8, llama.cpp's q8_0: hd int8 codes, then hd / 32 float16
//                     scales; value e = code[e] * scale[e / 32], scale = max |x| / 127 over the
//                     group (rounded to float16 first, so the codes use the stored scale)
//   QR<B, G>          --kv-dtype int4: the row rotated by the normalized Walsh-Hadamard transform
//                     (QuaRot: spreads a key's outlier channels over all of them), then B-bit
//                     codes in groups of G: hd / 2 bytes of their low 4 bits (value 2i in the low
//                     nibble of byte i, 2i + 1 in the high), for B = 5 hd / 8 bytes of their 5th
//                     bits (value e's in bit e % 8 of byte e / 8), then per group a float16 scale
//                     and minimum; value = code * scale + min, scale = (max - min) / (2^B - 1).
//                     Values take 4 bits, keys (the more sensitive) 5; both groups of 32.
//
// H is symmetric and its own inverse, so q . k = Hq . Hk and sum_t p_t v_t = H sum_t p_t (H v_t):
// a rotated cache rotates the query heads once before the scores and the output once after.
//
// Every dequantized value is code * scale (+ min): the product of a 4- to 8-bit integer and a
// float16 is exact in float32, so one rounding (the add) whether or not the compiler fuses it,
// and the torch mirror gets the same bits.
#pragma once
#include "aten.h"

#include <cmath>
#include <cstring>

#include "arlm_layout.h"  // generated from arlm/kernels/layout.py by the build
#include "common.h"

#ifndef ARLM_PREFETCH  // (kPrefetch, below)
#if defined(__AVX512F__)
#define ARLM_PREFETCH 4096
#else
#define ARLM_PREFETCH 2048
#endif
#endif

#include <type_traits>
#include <vector>

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

#if defined(__AVX512F__)
// The sum of v's 16 lanes by a fixed tree (GCC's _mm512_reduce_add_ps, written out so that every
// compiler gives the same bits): a_j = v_j + v_{j+8}, b_j = a_j + a_{j+4}, (b_0 + b_2) + (b_1 + b_3).
// block_scores (below) computes the same tree with 16 keys in the lanes.
inline float tree_sum16(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_shuffle_ps(b, b, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(c) + _mm_cvtss_f32(_mm_shuffle_ps(c, c, _MM_SHUFFLE(1, 1, 1, 1)));
}
#endif

// sum_i a[i] * b[i], in an order that depends on n alone.
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
#if defined(__AVX512F__)
  if (n % 32 == 0) {  // two chains (lanes j of elements j mod 32 < 16, and the rest), then the tree
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 32) {
      s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), s0);
      s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), load16(b + i + 16), s1);
    }
    return tree_sum16(_mm512_add_ps(s0, s1));
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


struct Q8 {
  uint8_t byte;
};
template <int B, int G>
struct QR {  // B bits (4 or 5), groups of G, rotated
  uint8_t byte;
};
using Q4K = QR<5, 32>;  // keys: the more sensitive, a bit more
using Q4V = QR<4, 32>;

// x <- H x for n (a power of two) floats: the Walsh-Hadamard butterflies, then / sqrt(n).
inline void hadamard(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float f = 1.f / std::sqrt(static_cast<float>(n));
  for (int64_t i = 0; i < n; ++i) x[i] *= f;
}

// A float16 stored as 2 bytes (scales, minimums), with F16C's conversions where the CPU has them
// (both round to nearest even, as at::Half and torch's .half()).
inline float half_bits_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  at::Half h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
#endif
}
inline void float_to_half_bits(float v, uint8_t* p) {
#if defined(__F16C__)
  const uint16_t bits = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
  std::memcpy(p, &bits, 2);
#else
  const at::Half h(v);
  std::memcpy(p, &h, 2);
#endif
}

template <typename T>
struct KV {  // float and at::Half: the row as it is
  static constexpr bool quantized = false, rotated = false;
  static int64_t stride(int64_t hd) { return hd; }
  static void store(const float* src, int64_t hd, T* dst) { store_row(src, hd, dst); }
  // The row as something load8 / load16 / to_float read: itself (buf unused).
  static const T* view(const T* row, int64_t, float*) { return row; }
#if defined(__AVX512F__)
  // Values 16c .. 16c + 15 of the row as float32, in registers (the same values view gives).
  static __m512 chunk16(const T* row, int64_t, int64_t c) { return load16(row + 16 * c); }
#endif
};

template <>
struct KV<Q8> {
  static constexpr bool quantized = true, rotated = false;
  static int64_t stride(int64_t hd) { return hd + 2 * (hd / 32); }
  static void store(const float* src, int64_t hd, Q8* dst) {
    auto* codes = reinterpret_cast<int8_t*>(dst);
    uint8_t* scales = reinterpret_cast<uint8_t*>(dst) + hd;
    for (int64_t g = 0; g < hd / 32; ++g) {
      const float* x = src + 32 * g;
      float amax = 0.f;
      for (int e = 0; e < 32; ++e) amax = std::max(amax, std::fabs(x[e]));
      float_to_half_bits(amax / 127.f, scales + 2 * g);
      const float d = half_bits_to_float(scales + 2 * g), inv = d > 0.f ? 1.f / d : 0.f;
      for (int e = 0; e < 32; ++e)
        codes[32 * g + e] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[e] * inv))));
    }
  }
#if defined(__AVX512F__)
  static __m512 chunk16(const Q8* row, int64_t hd, int64_t c) {
    const auto* codes = reinterpret_cast<const int8_t*>(row) + 16 * c;
    const float d = half_bits_to_float(reinterpret_cast<const uint8_t*>(row) + hd + 2 * (16 * c / 32));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)))),
                         _mm512_set1_ps(d));
  }
#endif
  static const float* view(const Q8* row, int64_t hd, float* buf) {
    const auto* codes = reinterpret_cast<const int8_t*>(row);
    const uint8_t* scales = reinterpret_cast<const uint8_t*>(row) + hd;
    for (int64_t g = 0; g < hd / 32; ++g) {
      const float d = half_bits_to_float(scales + 2 * g);
      int e = 0;
#if defined(__AVX512F__)
      for (; e < 32; e += 16)
        _mm512_storeu_ps(buf + 32 * g + e, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 32 * g + e)))), _mm512_set1_ps(d)));
#endif
      for (; e < 32; ++e) buf[32 * g + e] = static_cast<float>(codes[32 * g + e]) * d;
    }
    return buf;
  }
};

// 8 bytes of 4-bit codes as 16 bytes, in order (value 2i the low nibble of byte i, 2i + 1 the high).
inline __m128i nibbles16(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), low4 = _mm_set1_epi8(0x0F);
  return _mm_unpacklo_epi8(_mm_and_si128(b, low4), _mm_and_si128(_mm_srli_epi16(b, 4), low4));
}

template <int B, int G>
struct KV<QR<B, G>> {
  static constexpr bool quantized = true, rotated = true;
  static constexpr int top = (1 << B) - 1;
  static int64_t stride(int64_t hd) { return hd / 2 + (B == 5 ? hd / 8 : 0) + 4 * (hd / G); }
  static void store(const float* src, int64_t hd, QR<B, G>* dst) {
    float x[512];  // hd <= 512 (checked by the ops)
    std::copy(src, src + hd, x);
    hadamard(x, hd);
    uint8_t* low = reinterpret_cast<uint8_t*>(dst);
    uint8_t* high = low + hd / 2;  // 5 bits: bit 4 of value e is bit e % 8 of high[e / 8]
    uint8_t* params = high + (B == 5 ? hd / 8 : 0);
    if (B == 5) std::fill(high, high + hd / 8, 0);
    for (int64_t g = 0; g < hd / G; ++g) {
      const float* xg = x + G * g;
      float lo = xg[0], hi = xg[0];
      for (int e = 1; e < G; ++e) lo = std::min(lo, xg[e]), hi = std::max(hi, xg[e]);
      float_to_half_bits((hi - lo) / static_cast<float>(top), params + 4 * g);
      float_to_half_bits(lo, params + 4 * g + 2);
      const float d = half_bits_to_float(params + 4 * g), m = half_bits_to_float(params + 4 * g + 2);
      const float inv = d > 0.f ? 1.f / d : 0.f;
      for (int e = 0; e < G; ++e) {
        const int64_t i = G * g + e;
        const auto q = static_cast<uint8_t>(std::min(static_cast<float>(top),
                                                     std::max(0.f, std::nearbyint((xg[e] - m) * inv))));
        if (e % 2 == 0) low[i / 2] = q & 0x0F;
        else low[i / 2] |= static_cast<uint8_t>((q & 0x0F) << 4);
        if (B == 5 && (q & 0x10)) high[i / 8] |= static_cast<uint8_t>(1u << (i % 8));
      }
    }
  }
#if defined(__AVX512F__)
  __attribute__((always_inline)) static __m512 chunk16(const QR<B, G>* row, int64_t hd, int64_t c) {
#if !(defined(__AVX512BW__) && defined(__AVX512VL__))
    alignas(64) float buf[512];
    return _mm512_loadu_ps(view(row, hd, buf) + 16 * c);
#else
    const uint8_t* low = reinterpret_cast<const uint8_t*>(row);
    const uint8_t* params = low + hd / 2 + (B == 5 ? hd / 8 : 0) + 4 * (16 * c / G);
    __m128i q = nibbles16(low + 8 * c);
    if (B == 5) {
      uint16_t bits;
      std::memcpy(&bits, low + hd / 2 + 2 * c, 2);
      q = _mm_or_si128(q, _mm_maskz_set1_epi8(bits, 0x10));
    }
    return _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)),
                                       _mm512_set1_ps(half_bits_to_float(params))),
                         _mm512_set1_ps(half_bits_to_float(params + 2)));
#endif
  }
#endif
  static const float* view(const QR<B, G>* row, int64_t hd, float* buf) {
    const uint8_t* low = reinterpret_cast<const uint8_t*>(row);
    const uint8_t* high = low + hd / 2;
    const uint8_t* params = high + (B == 5 ? hd / 8 : 0);
    for (int64_t g = 0; g < hd / G; ++g) {
      const float d = half_bits_to_float(params + 4 * g), m = half_bits_to_float(params + 4 * g + 2);
      int e = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      for (; e < G; e += 16) {  // 8 bytes -> 16 codes, in order: low nibble, high nibble, ...
        const int64_t i = G * g + e;
        __m128i q = nibbles16(low + i / 2);
        if (B == 5) {
          uint16_t bits;
          std::memcpy(&bits, high + i / 8, 2);
          q = _mm_or_si128(q, _mm_maskz_set1_epi8(bits, 0x10));
        }
        const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
        _mm512_storeu_ps(buf + i, _mm512_add_ps(_mm512_mul_ps(v, _mm512_set1_ps(d)), _mm512_set1_ps(m)));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      for (; e < G; e += 16) {  // the same 16 codes; the fifth bits spread to bytes by a shuffle
        const int64_t i = G * g + e;
        __m128i q = nibbles16(low + i / 2);
        if (B == 5) {
          uint16_t bits;
          std::memcpy(&bits, high + i / 8, 2);
          const __m128i spread = _mm_shuffle_epi8(_mm_set1_epi16(static_cast<int16_t>(bits)),
                                                  _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
          const __m128i bit = _mm_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
          q = _mm_or_si128(q, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit), _mm_set1_epi8(0x10)));
        }
        for (int half = 0; half < 2; ++half) {
          const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(half ? _mm_srli_si128(q, 8) : q));
          _mm256_storeu_ps(buf + i + 8 * half, _mm256_add_ps(_mm256_mul_ps(v, _mm256_set1_ps(d)), _mm256_set1_ps(m)));
        }
      }
#endif
      for (; e < G; ++e) {
        const int64_t i = G * g + e;
        int q = i % 2 ? low[i / 2] >> 4 : low[i / 2] & 0x0F;
        if (B == 5) q |= (high[i / 8] >> (i % 8) & 1) << 4;
        buf[i] = static_cast<float>(q) * d + m;
      }
    }
    return buf;
  }
};

// Whether hd suits format T: whole groups, and a power of two for the rotation.
template <typename T>
inline bool kv_fits(int64_t hd) {
  if constexpr (std::is_same_v<T, Q8>) return hd % 32 == 0;
  if constexpr (KV<T>::rotated) return hd % 32 == 0 && hd <= 512 && (hd & (hd - 1)) == 0;
  return true;
}

// The cache's format as the ops take it (kv_format: arlm_layout::KVFormat, float32 or float16 told
// apart by dtype). Calls f(k_pool, v_pool) with typed pointers.
template <typename F>
inline void with_kv(const char* op, const at::Tensor& k, const at::Tensor& v, int64_t format, int64_t hd, F f) {
  auto check = [&](auto* kp, auto* vp, at::ScalarType st) {
    using TK = std::remove_pointer_t<decltype(kp)>;
    using TV = std::remove_pointer_t<decltype(vp)>;
    TORCH_CHECK(k.scalar_type() == st && v.scalar_type() == st && k.is_contiguous() && v.is_contiguous() &&
                k.size(-1) == KV<TK>::stride(hd) && v.size(-1) == KV<TV>::stride(hd) && kv_fits<TK>(hd) &&
                kv_fits<TV>(hd), op, ": the KV pools do not match the cache format or head size");
    f(kp, vp);
  };
  switch (format) {
    case arlm_layout::kFloat:
      if (k.scalar_type() == at::kHalf) return check(k.data_ptr<at::Half>(), v.data_ptr<at::Half>(), at::kHalf);
      return check(k.data_ptr<float>(), v.data_ptr<float>(), at::kFloat);
    case arlm_layout::kInt8:
      return check(reinterpret_cast<Q8*>(k.data_ptr<uint8_t>()), reinterpret_cast<Q8*>(v.data_ptr<uint8_t>()),
                   at::kByte);
    case arlm_layout::kInt4:
      return check(reinterpret_cast<Q4K*>(k.data_ptr<uint8_t>()), reinterpret_cast<Q4V*>(v.data_ptr<uint8_t>()),
                   at::kByte);
    default:
      TORCH_CHECK(false, op, ": unknown KV format ", format);
  }
}

// How far ahead (bytes) the streaming loops below ask for the cache rows they will read: a long
// row's keys and values come from DRAM, and the loops do too little work per row for the
// hardware's own prefetcher to keep up. (A prefetch never faults, past the end included.) 4 KB
// on AVX-512, where the rows go fastest: a 1B model's attention at 4-8k slots 5-8% faster than
// with 2 KB (float16 cache; int8 the same or faster; Zen 5, benchmarks/phases.py); 2 KB on AVX2,
// whose loops are slower per row (there 4 KB was 0-5% slower).
constexpr int64_t kPrefetch = ARLM_PREFETCH;

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// ---- AVX2 (no AVX-512): float32 or float16 rows, 8 values a vector ------------------------------
//
// Scores: each key row loaded once for NH of the G heads, each head's sum in its own chain over
// the row in order, then hsum: the operations dot() does for one head, so the same bits.
// (Quantized rows take the generic loops, on rows KV<T>::view dequantizes: int4's 16 codes a
// vector (KV<QR>::view), int8's in a loop GCC vectorizes itself (a hand-written one: no faster).)
template <typename T>
constexpr bool kPlainRows = std::is_same_v<T, float> || std::is_same_v<T, at::Half>;

template <int NH, typename TK>
inline void row_scores8(const float* q, const TK* row, int64_t hd, int64_t n, int64_t t, float scale, float* s) {
  __m256 acc[NH];
  for (int h = 0; h < NH; ++h) acc[h] = _mm256_setzero_ps();
  for (int64_t c = 0; c < hd; c += 8) {
    const __m256 kc = load8(row + c);
    for (int h = 0; h < NH; ++h) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * hd + c), kc, acc[h]);
  }
  for (int h = 0; h < NH; ++h) s[h * n + t] = hsum(acc[h]) * scale;
}

template <typename TK, typename TV, typename Spans>
inline void scores8(const float* q, int64_t G, int64_t hd, int64_t n, float scale, Spans spans, float* s,
                    const float* q_sink, int64_t n_sink) {
  if constexpr (kPlainRows<TK>) {
    const int64_t stride = KV<TK>::stride(hd);
    int64_t t = 0;
    spans([&](const TK* k, const TV*, int64_t len) {
      for (int64_t j = 0; j < len; ++j, ++t) {
        const TK* row = k + j * stride;
        _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetch, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetch + 64, _MM_HINT_T0);
        const float* qt = t < n_sink ? q_sink : q;
        int64_t h = 0;
        for (; h + 4 <= G; h += 4) row_scores8<4>(qt + h * hd, row, hd, n, t, scale, s + h * n);
        for (; h < G; ++h) row_scores8<1>(qt + h * hd, row, hd, n, t, scale, s + h * n);
      }
    });
  }
}

// out[h, c0 .. c0 + 8C) = inv[h] * sum_t s[h * n + t] V[t, c0 ..] for one head h, in slot order
// (one fused multiply-add per value and slot, as the scalar loop does).
template <int C, typename TK, typename TV, typename Spans>
inline void weighted_columns8(const float* s, Spans spans, float inv, int64_t hd, int64_t c0, float* out) {
  if constexpr (kPlainRows<TV>) {
    __m256 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
    const int64_t stride = KV<TV>::stride(hd);
    int64_t t = 0;
    spans([&](const TK*, const TV* v, int64_t len) {
      for (int64_t j = 0; j < len; ++j, ++t) {
        const TV* row = v + j * stride + c0;
        _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetch, _MM_HINT_T0);
        const __m256 p = _mm256_set1_ps(s[t]);
        for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(p, load8(row + 8 * c), acc[c]);
      }
    });
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + c0 + 8 * c, _mm256_mul_ps(acc[c], _mm256_set1_ps(inv)));
  }
}
#endif

#if defined(__AVX512F__)
// out[h] = inv[h] * sum_t s[h * n + t] V[t] for HB heads at once, V rows of C * 16 values: each V
// row is loaded (a quantized row dequantized in registers: KV<T>::chunk16) once for all HB heads; every head's
// sum is in registers, in slot order.
template <int C, int HB, typename TK, typename TV, typename Spans>
inline void weighted_heads(const float* s, int64_t n, Spans spans, const float* inv, int64_t hd, float* out) {
  __m512 acc[HB][C];
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = _mm512_setzero_ps();
  const int64_t stride = KV<TV>::stride(hd);
  int64_t t = 0;
  spans([&](const TK*, const TV* v, int64_t len) {
    for (int64_t j = 0; j < len; ++j, ++t) {
      const TV* row = v + j * stride;
      _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetch, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetch + 64, _MM_HINT_T0);
      for (int c = 0; c < C; ++c) {
        const __m512 vc = KV<TV>::chunk16(row, hd, c);
        for (int h = 0; h < HB; ++h) acc[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[h * n + t]), vc, acc[h][c]);
      }
    }
  });
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(out + h * hd + c * 16, _mm512_mul_ps(acc[h][c], _mm512_set1_ps(inv[h])));
}

// weighted_heads over G heads, 16 / C at a time (16 accumulators).
template <int C, typename TK, typename TV, typename Spans>
inline void weighted_group(const float* s, int64_t n, int64_t G, Spans spans, const float* inv, int64_t hd,
                           float* out) {
  constexpr int HB = 16 / C;
  for (int64_t h = 0; h < G; h += HB) {
    const float *sh = s + h * n, *ih = inv + h;
    float* oh = out + h * hd;
    switch (std::min<int64_t>(HB, G - h)) {
      case 1: weighted_heads<C, 1, TK, TV>(sh, n, spans, ih, hd, oh); break;
      case 2: weighted_heads<C, 2 <= HB ? 2 : 1, TK, TV>(sh, n, spans, ih, hd, oh); break;
      case 3: weighted_heads<C, 3 <= HB ? 3 : 1, TK, TV>(sh, n, spans, ih, hd, oh); break;
      default: weighted_heads<C, HB, TK, TV>(sh, n, spans, ih, hd, oh); break;
    }
  }
}

// The sums of the 16 lanes of a, b, c and d, each by a fixed tree of its own lanes (whatever the
// other three hold): lane pairs, then pairs of pairs within each 128-bit lane, then the lanes.
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(x),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// A quantized key cache's scores, s[h * n + t] = (q_h . K_t) * scale: keys dequantized in
// registers four rows at a time (KV<T>::chunk16), each row's sum over its chunks in order and then
// reduce4's tree, so a row's score depends on its own key alone. hd a multiple of 16, at most 512.
// Slots t < n_sink are scored with q_sink's heads instead of q's (attention sinks: attend_group).
template <typename TK, typename TV, typename Spans>
inline void quantized_scores(const float* q, int64_t G, int64_t hd, int64_t n, float scale, Spans spans, float* s,
                             const float* q_sink = nullptr, int64_t n_sink = 0) {
  alignas(64) float kb[4 * 512];
  const int64_t stride = KV<TK>::stride(hd), C = hd / 16;
  int64_t t = 0, held = 0;
  auto flush = [&] {
    for (int64_t r = held; r < 4; ++r) std::fill(kb + r * hd, kb + (r + 1) * hd, 0.f);
    const int64_t t0 = t - held;  // the first row's slot
    for (int64_t h = 0; h < G; ++h) {
      __m512 acc[4];
      if (t0 >= n_sink) {  // (every row with q: the usual case)
        const float* qh = q + h * hd;
        const __m512 q0 = _mm512_loadu_ps(qh);
        for (int r = 0; r < 4; ++r) acc[r] = _mm512_mul_ps(q0, _mm512_load_ps(kb + r * hd));
        for (int64_t c = 1; c < C; ++c) {
          const __m512 qc = _mm512_loadu_ps(qh + 16 * c);
          for (int r = 0; r < 4; ++r) acc[r] = _mm512_fmadd_ps(qc, _mm512_load_ps(kb + r * hd + 16 * c), acc[r]);
        }
      } else {  // rows before n_sink with q_sink: the same operations, row by row's own query
        for (int r = 0; r < 4; ++r) {
          const float* qh = (t0 + r < n_sink ? q_sink : q) + h * hd;
          acc[r] = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_load_ps(kb + r * hd));
          for (int64_t c = 1; c < C; ++c)
            acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), _mm512_load_ps(kb + r * hd + 16 * c), acc[r]);
        }
      }
      alignas(16) float out[4];
      _mm_store_ps(out, _mm_mul_ps(reduce4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(scale)));
      for (int64_t r = 0; r < held; ++r) s[h * n + t - held + r] = out[r];
    }
    held = 0;
  };
  spans([&](const TK* k, const TV*, int64_t len) {
    for (int64_t j = 0; j < len; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(k + j * stride) + kPrefetch, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(k + j * stride) + kPrefetch + 64, _MM_HINT_T0);
      for (int64_t c = 0; c < C; ++c) _mm512_store_ps(kb + held * hd + 16 * c, KV<TK>::chunk16(k + j * stride, hd, c));
      ++t;
      if (++held == 4) flush();
    }
  });
  if (held) flush();
}
#endif

// --kv-dtype int8's queries, as llama.cpp's dot products read its q8_0 cache: each head's values
// quantized to int8 per group of 32 (code = round(x * 127 / amax), clamped to +-127; scale
// amax / 127), so q . k is per group an exact sum of integer products times the two scales.
// kv_cache.py's quantize_query mirrors it. q8: G * hd codes, d: G * hd / 32 scales, sum: each
// group's codes summed.
inline void quantize_query(const float* q, int64_t G, int64_t hd, int8_t* q8, float* d, int32_t* sum) {
  for (int64_t g = 0; g < G * hd / 32; ++g) {
    const float* x = q + 32 * g;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    {  // the same operations on 16 lanes (max is exact in any order; round to nearest even)
      const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      d[g] = amax / 127.f;
      const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f), vi = _mm512_set1_ps(inv);
      auto codes = [&](__m512 v) {
        const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v, vi), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        return _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, r)));
      };
      const __m512i c0 = codes(x0), c1 = codes(x1);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + 32 * g), _mm512_cvtepi32_epi8(c0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + 32 * g + 16), _mm512_cvtepi32_epi8(c1));
      sum[g] = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
      continue;
    }
#endif
    float amax = 0.f;
    for (int e = 0; e < 32; ++e) amax = std::max(amax, std::fabs(x[e]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    d[g] = amax / 127.f;
    int32_t total = 0;
    for (int e = 0; e < 32; ++e) {
      const int c = static_cast<int>(std::min(127.f, std::max(-127.f, std::nearbyint(x[e] * inv))));
      q8[32 * g + e] = static_cast<int8_t>(c);
      total += c;
    }
    sum[g] = total;
  }
}

// How the integer scores below read a quantized key format (IntKeys<T>::integer: they can).
template <typename T>
struct IntKeys {
  static constexpr bool integer = false;
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__BMI2__)
#define ARLM_INT_SCORES 1
// Sixteen keys' codes as integer_scores multiplies them: 16-byte chunks, so that one vpdpbusd
// takes the same chunk of four keys against the query's chunk broadcast to the four 128-bit
// lanes. Chunk j (0..3) of piece c (64 codes) of key 4m + k goes to 128-bit lane m of vector
// (c, j, k): then lane m of a vector's sums is key 4m + k's, and reduce_quartets puts the keys in
// order. (Sixteen keys side by side in the 32-bit lanes would take a 16 x 16 transpose: 64
// shuffles; one key per vector takes 30 per head to reduce.)
inline void stage_chunk(uint8_t* kb, int64_t c, int j, int64_t slot, __m128i chunk) {
  _mm_store_si128(reinterpret_cast<__m128i*>(kb + 1024 * c + 256 * j + 64 * (slot % 4) + 16 * (slot / 4)), chunk);
}

// int8 keys: codes + 128 (vpdpbusd takes unsigned bytes), in element order (a group of 32 is
// chunks 0, 1 or 2, 3 of its piece); a float16 scale per group of 32.
template <>
struct IntKeys<Q8> {
  static constexpr bool integer = true, interleaved = false, has_min = false;
  static constexpr int32_t bias = 128;
  // Key `slot`'s row of C pieces of 64 codes into kb, its scales into d.
  __attribute__((always_inline)) static void stage(const uint8_t* row, int64_t C, uint8_t* kb, uint16_t* d,
                                                   uint16_t*, int64_t slot) {
    const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
    for (int64_t c = 0; c < C; ++c)
      for (int j = 0; j < 4; ++j) {
        const auto* chunk = reinterpret_cast<const __m128i*>(row + 64 * c + 16 * j);
        stage_chunk(kb, c, j, slot, _mm_xor_si128(_mm_loadu_si128(chunk), flip));
      }
    for (int64_t g = 0; g < 2 * C; ++g) std::memcpy(d + 16 * g + slot, row + 64 * C + 2 * g, 2);
  }
};
// int4's 5-bit keys (rotated: the query is too): each piece of 64 codes as stored, the low
// nibbles (even elements) first and then the high ones (odd elements), so a group of 32 is chunks
// 0, 2 or 1, 3 of its piece; the fifth bits put in by a mask (pext splits the row's bits into
// evens and odds); a float16 scale and minimum per group.
template <>
struct IntKeys<Q4K> {
  static constexpr bool integer = true, interleaved = true, has_min = true;
  static constexpr int32_t bias = 0;
  __attribute__((always_inline)) static void stage(const uint8_t* row, int64_t C, uint8_t* kb, uint16_t* d,
                                                   uint16_t* m, int64_t slot) {
    const int64_t hd = 64 * C;
    const uint8_t *high = row + hd / 2, *params = high + hd / 8;
    const __m256i nib = _mm256_set1_epi8(0x0F);
    for (int64_t c = 0; c < C; ++c) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c));
      __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, nib)),
                                     _mm256_and_si256(_mm256_srli_epi16(b, 4), nib), 1);
      uint64_t bits;
      std::memcpy(&bits, high + 8 * c, 8);
      const uint64_t fifth = _pext_u64(bits, 0x5555555555555555ull) | _pext_u64(bits, 0xAAAAAAAAAAAAAAAAull) << 32;
      v = _mm512_or_si512(v, _mm512_maskz_set1_epi8(fifth, 0x10));
      stage_chunk(kb, c, 0, slot, _mm512_castsi512_si128(v));
      stage_chunk(kb, c, 1, slot, _mm512_extracti32x4_epi32(v, 1));
      stage_chunk(kb, c, 2, slot, _mm512_extracti32x4_epi32(v, 2));
      stage_chunk(kb, c, 3, slot, _mm512_extracti32x4_epi32(v, 3));
    }
    for (int64_t g = 0; g < hd / 32; ++g) {
      std::memcpy(d + 16 * g + slot, params + 4 * g, 2);
      std::memcpy(m + 16 * g + slot, params + 4 * g + 2, 2);
    }
  }
};

// Sixteen keys' int32 sums from the four vectors of one group (a[k]: lane m's four partial sums
// are key 4m + k's, stage_chunk), in key order: pairs of partials, then pairs of pairs. Integer
// adds: exact in any order.
inline __m512i reduce_quartets(const __m512i* a) {
  const __m512i b01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
  const __m512i b23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]), _mm512_unpackhi_epi32(a[2], a[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(b01, b23), _mm512_unpackhi_epi64(b01, b23));
}

// A quantized key cache's scores by integer dot products (VNNI), s[h * n + t] = (q_h . K_t) *
// scale, q_h quantized (quantize_query: codes q8 in the key's piece order, scales qd, code sums
// qsum): sixteen keys at a time (IntKeys<TK>::stage, stage_chunk), each chunk of four keys times
// the query's chunk by vpdpbusd, the sums per group of 32 (reduce_quartets), then per group in
// order
//   int8:  acc += (S_g - 128 qsum_g) * (qd_g * kd_g)      (the +128 of the codes taken back)
//   int4:  acc += qd_g * (S_g * kd_g + km_g * qsum_g)     (value = code * kd + km)
// A key's score depends on its own row alone. hd a multiple of 64, at most 512. Slots t < n_sink
// are scored with the sink query's codes (q8s, qds, qsums) instead (attend_group).
// CC: hd / 64 known when compiled (1, 2: the usual head sizes, loops unrolled), or 0 (read from hd).
template <typename TK, int CC, typename Spans>
inline void integer_scores_c(const int8_t* q8, const float* qd, const int32_t* qsum, int64_t G, int64_t hd,
                             int64_t n, float scale, Spans spans, float* s, const int8_t* q8s, const float* qds,
                             const int32_t* qsums, int64_t n_sink) {
  using K = IntKeys<TK>;
  // 16 keys' codes (stage_chunk; slots past a last, partial batch hold anything: their lanes are
  // never stored), and their float16 scales and minimums [group][key]
  alignas(64) uint8_t kb[16 * 512];
  alignas(64) uint16_t kd[16 * 16] = {}, km[16 * 16] = {};
  const int64_t C = CC ? CC : hd / 64, NG = 2 * C, stride = KV<TK>::stride(64 * C);
  int64_t t = 0, held = 0;
  auto flush = [&] {
    const int64_t t0 = t - held;
    auto score = [&](const int8_t* qh, const float* dh, const int32_t* sh) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < C; ++c) {
        __m512i qv[4];
        for (int j = 0; j < 4; ++j)
          qv[j] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + 64 * c + 16 * j)));
        const uint8_t* kc = kb + 1024 * c;
        __m512i sums[2];
        for (int half = 0; half < 2; ++half) {  // group 2c + half: chunks j0, j1 of the piece
          const int j0 = K::interleaved ? half : 2 * half, j1 = j0 + (K::interleaved ? 2 : 1);
          __m512i a[4];
          for (int k = 0; k < 4; ++k) {
            a[k] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_load_si512(kc + 256 * j0 + 64 * k), qv[j0]);
            a[k] = _mm512_dpbusd_epi32(a[k], _mm512_load_si512(kc + 256 * j1 + 64 * k), qv[j1]);
          }
          sums[half] = reduce_quartets(a);
        }
        for (int half = 0; half < 2; ++half) {
          const int64_t g = 2 * c + half;
          const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(kd + 16 * g)));
          if constexpr (K::has_min) {
            const __m512 m = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(km + 16 * g)));
            const __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[half]), d,
                                               _mm512_mul_ps(m, _mm512_set1_ps(static_cast<float>(sh[g]))));
            acc = _mm512_fmadd_ps(dot, _mm512_set1_ps(dh[g]), acc);
          } else {
            const __m512i S = _mm512_sub_epi32(sums[half], _mm512_set1_epi32(K::bias * sh[g]));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), _mm512_mul_ps(_mm512_set1_ps(dh[g]), d), acc);
          }
        }
      }
      return _mm512_mul_ps(acc, _mm512_set1_ps(scale));
    };
    for (int64_t h = 0; h < G; ++h) {
      __m512 v = score(q8 + h * hd, qd + h * NG, qsum + h * NG);
      if (t0 < n_sink)  // keys before n_sink: the sink query's scores
        v = _mm512_mask_blend_ps(tail_mask(n_sink - t0), v, score(q8s + h * hd, qds + h * NG, qsums + h * NG));
      _mm512_mask_storeu_ps(s + h * n + t0, tail_mask(held), v);
    }
    held = 0;
  };
  spans([&](const TK* k, const auto*, int64_t len) {
    for (int64_t j = 0; j < len; ++j) {
      const auto* row = reinterpret_cast<const uint8_t*>(k + j * stride);
      _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetch, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetch + 64, _MM_HINT_T0);
      K::stage(row, C, kb, kd, km, held);
      ++t;
      if (++held == 16) flush();
    }
  });
  if (held) flush();
}

template <typename TK, typename Spans>
inline void integer_scores(const int8_t* q8, const float* qd, const int32_t* qsum, int64_t G, int64_t hd,
                           int64_t n, float scale, Spans spans, float* s, const int8_t* q8s = nullptr,
                           const float* qds = nullptr, const int32_t* qsums = nullptr, int64_t n_sink = 0) {
  if (hd == 64) return integer_scores_c<TK, 1>(q8, qd, qsum, G, hd, n, scale, spans, s, q8s, qds, qsums, n_sink);
  if (hd == 128) return integer_scores_c<TK, 2>(q8, qd, qsum, G, hd, n, scale, spans, s, q8s, qds, qsums, n_sink);
  integer_scores_c<TK, 0>(q8, qd, qsum, G, hd, n, scale, spans, s, q8s, qds, qsums, n_sink);
}
#endif

// The query codes in the order IntKeys<TK> stages a key's (interleaved: each piece of 64, its
// even elements first, then its odd ones), in place.
template <typename TK>
inline void order_query_codes(int8_t* q8, int64_t n) {
#if defined(ARLM_INT_SCORES)
  if constexpr (IntKeys<TK>::integer && IntKeys<TK>::interleaved) {
    int8_t piece[64];
    for (int64_t c = 0; c < n; c += 64) {
      for (int p = 0; p < 32; ++p) piece[p] = q8[c + 2 * p], piece[32 + p] = q8[c + 2 * p + 1];
      std::memcpy(q8 + c, piece, 64);
    }
  }
#endif
}

// Back from a rotated V cache's space (see the top): out <- H out for each of the G heads. Call
// it on the final output (after combine_chunks where a row was split).
template <typename TV>
inline void unrotate(float* out, int64_t G, int64_t hd) {
  if constexpr (KV<TV>::rotated)
    for (int64_t h = 0; h < G; ++h) hadamard(out + h * hd, hd);
}

#if defined(__AVX512F__)
// Scores of many queries against the same keys (a prompt's tokens: each reads the slots before
// it), 16 keys at a time with the keys in the vector lanes: each query value is broadcast once
// per 16 keys instead of each key being reduced across lanes per query. Lane k's arithmetic is
// dot()'s for key k exactly (the same fused products in the same two chains, the same tree), so
// a query's scores, and with them its output, are the bits the one-query path gives it.

// r[i] (16 floats of row i) -> r[e] = element e of the 16 rows (lane i: row i's).
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // lane L: rows i, i + 1 of elements 4L, 4L + 1 (lo), 4L + 2, 4L + 3 (hi)
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + x], lane L: rows i .. i + 3 of element 4L + x
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int x = 0; x < 4; ++x) {  // element 4L + x: lane L of r[x], r[4 + x], r[8 + x], r[12 + x]
    const __m512 ab0 = _mm512_shuffle_f32x4(r[x], r[4 + x], 0x44), ab1 = _mm512_shuffle_f32x4(r[x], r[4 + x], 0xEE);
    const __m512 cd0 = _mm512_shuffle_f32x4(r[8 + x], r[12 + x], 0x44);
    const __m512 cd1 = _mm512_shuffle_f32x4(r[8 + x], r[12 + x], 0xEE);
    t[x] = _mm512_shuffle_f32x4(ab0, cd0, 0x88);
    t[4 + x] = _mm512_shuffle_f32x4(ab0, cd0, 0xDD);
    t[8 + x] = _mm512_shuffle_f32x4(ab1, cd1, 0x88);
    t[12 + x] = _mm512_shuffle_f32x4(ab1, cd1, 0xDD);
  }
  for (int e = 0; e < 16; ++e) r[e] = t[e];
}

// count rows of keys (at k, row stride `stride` elements) widened to float32 into lanes
// lane0 .. lane0 + count - 1 (<= 16) of the transposed block kt: kt[e * 16 + lane] = element e.
// A whole block (16 rows from lane 0: a pool block of 16 slots, the default) is transposed in
// registers; 16 rows through memory a float at a time took 14% of a 1B model's prompt attention.
template <typename TK>
inline void transpose_keys(const TK* k, int64_t stride, int64_t count, int64_t hd, float* kt, int64_t lane0) {
  if (count == 16 && lane0 == 0 && hd % 16 == 0) {
    for (int64_t c = 0; c < hd; c += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = load16(k + i * stride + c);
      transpose16(r);
      for (int e = 0; e < 16; ++e) _mm512_store_ps(kt + (c + e) * 16, r[e]);
    }
    return;
  }
  alignas(64) float rows[16][16];
  for (int64_t c = 0; c < hd; c += 16) {
    for (int64_t r = 0; r < count; ++r) _mm512_store_ps(rows[r], load16(k + r * stride + c));
    for (int64_t e = 0; e < 16; ++e)
      for (int64_t r = 0; r < count; ++r) kt[(c + e) * 16 + lane0 + r] = rows[r][e];
  }
}

// out[h * 16 + lane] = dot(q_h, key lane) * scale for the NQ queries at q (hd floats each, hd a
// multiple of 32) against the 16 keys transposed in kt (transpose_keys).
template <int NQ>
inline void block_scores(const float* q, int64_t hd, const float* kt, float scale, float* out) {
  // Lane sums v_j (dot()'s two chains added) for key-vector j of the tree, per query.
  auto lanes = [&](int64_t j, __m512 (&v)[NQ]) {
    __m512 s0[NQ], s1[NQ];
    for (int h = 0; h < NQ; ++h) s0[h] = s1[h] = _mm512_setzero_ps();
    for (int64_t i = 0; i < hd; i += 32) {
      const __m512 k0 = _mm512_load_ps(kt + (i + j) * 16), k1 = _mm512_load_ps(kt + (i + 16 + j) * 16);
      for (int h = 0; h < NQ; ++h) {
        s0[h] = _mm512_fmadd_ps(_mm512_set1_ps(q[h * hd + i + j]), k0, s0[h]);
        s1[h] = _mm512_fmadd_ps(_mm512_set1_ps(q[h * hd + i + 16 + j]), k1, s1[h]);
      }
    }
    for (int h = 0; h < NQ; ++h) v[h] = _mm512_add_ps(s0[h], s1[h]);
  };
  // The tree: a_j = v_j + v_{j+8}, b_j = a_j + a_{j+4}, (b_0 + b_2) + (b_1 + b_3), built as the
  // lanes come so that 4 vectors a query stay live (NQ = 4 in 32 registers, none spilled).
  __m512 a[NQ][4];
  for (int64_t j = 0; j < 8; ++j) {
    __m512 v[NQ], w[NQ];
    lanes(j, v);
    lanes(j + 8, w);
    for (int h = 0; h < NQ; ++h) {
      const __m512 aj = _mm512_add_ps(v[h], w[h]);
      a[h][j % 4] = j < 4 ? aj : _mm512_add_ps(a[h][j % 4], aj);
    }
  }
  for (int h = 0; h < NQ; ++h) {
    const __m512 c0 = _mm512_add_ps(a[h][0], a[h][2]), c1 = _mm512_add_ps(a[h][1], a[h][3]);
    _mm512_store_ps(out + h * 16, _mm512_mul_ps(_mm512_add_ps(c0, c1), _mm512_set1_ps(scale)));
  }
}
#endif

// attend_group's second half, on scores already in s[h * n + t] (scale applied): the softmax, then
// out[h] = sum_t p_t V_t (see attend_group for stats). block_scores's callers use it directly.
template <typename TK, typename TV, typename Spans>
inline void attend_scored(int64_t G, int64_t hd, int64_t n, Spans spans, float* s, float* out,
                          float* stats = nullptr) {
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
  if (hd == 64 || hd == 128 || hd == 256) {  // (256: Gemma's heads)
    if (hd == 64) weighted_group<4, TK, TV>(s, n, G, spans, inv, hd, out);
    else if (hd == 128) weighted_group<8, TK, TV>(s, n, G, spans, inv, hd, out);
    else weighted_group<16, TK, TV>(s, n, G, spans, inv, hd, out);
    if (!stats) unrotate<TV>(out, G, hd);
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (!KV<TV>::quantized && hd % 32 == 0) {  // (a float16 or float32 cache: the default)
    for (int64_t h = 0; h < G; ++h) {
      int64_t c0 = 0;
      for (; c0 + 64 <= hd; c0 += 64) weighted_columns8<8, TK, TV>(s + h * n, spans, inv[h], hd, c0, out + h * hd);
      for (; c0 < hd; c0 += 32) weighted_columns8<4, TK, TV>(s + h * n, spans, inv[h], hd, c0, out + h * hd);
    }
    return;
  }
#endif
  std::fill(out, out + G * hd, 0.f);
  const int64_t vstride = KV<TV>::stride(hd);
  thread_local std::vector<float> local;  // a dequantized row
  if (local.size() < static_cast<size_t>(hd)) local.resize(hd);
  float* buf = local.data();
  int64_t t = 0;
  spans([&](const TK*, const TV* v, int64_t len) {
    for (int64_t j = 0; j < len; ++j, ++t) {
      const auto* row = KV<TV>::view(v + j * vstride, hd, buf);
      for (int64_t h = 0; h < G; ++h)
        for (int64_t e = 0; e < hd; ++e) out[h * hd + e] += s[h * n + t] * to_float(row[e]);
    }
  });
  for (int64_t h = 0; h < G; ++h)
    for (int64_t e = 0; e < hd; ++e) out[h * hd + e] *= inv[h];
  if (!stats) unrotate<TV>(out, G, hd);
}

#if defined(__AVX512F__)
// tree_sum16 of each of v[0..3] at once: the same adds on the same pairs of lanes (a_j = v_j +
// v_{j+8}, b_j = a_j + a_{j+4}, (b_0 + b_2) + (b_1 + b_3)), four vectors' lanes side by side;
// vector x's sum in lane 4x of the result.
inline __m512 tree_sum16x4(const __m512 (&v)[4]) {
  auto halves = [](__m512 x, __m512 y) {  // [x_0..7, y_0..7] + [x_8..15, y_8..15]
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  };
  const __m512 a01 = halves(v[0], v[1]), a23 = halves(v[2], v[3]);
  const __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(a01, a23, 0x88), _mm512_shuffle_f32x4(a01, a23, 0xDD));
  const __m512 c = _mm512_add_ps(b, _mm512_shuffle_ps(b, b, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_add_ps(c, _mm512_shuffle_ps(c, c, _MM_SHUFFLE(2, 3, 0, 1)));
}

// A float32 or float16 key cache's scores for one query's G heads, s[h * n + t] = (q_h . K_t) *
// scale, for heads of C * 16 values (C even): each key row widened once for all G heads, each
// head's dot() chains on it, and four heads' trees at once (tree_sum16x4): dot()'s arithmetic
// for every score, so the same bits as a row-by-row dot() per head. Slots t < n_sink are scored
// with q_sink's heads. Per head, dot() widened the row again and summed its lanes alone: a 1B
// model's attention read its float16 cache at ~33 GB/s at 1-8k slots, ~46 with this and the
// split-K tasks' order (decode.cpp; benchmarks/phases.py, docs/benchmarks.md 2026-12-07 21:13).
template <int C, typename TK, typename TV, typename Spans>
inline void float_key_scores(const float* q, int64_t G, int64_t n, float scale, Spans spans, float* s,
                             const float* q_sink, int64_t n_sink) {
  constexpr int64_t hd = 16 * C;
  const int64_t stride = KV<TK>::stride(hd);
  const __m512 sv = _mm512_set1_ps(scale);
  const __m512i lanes = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  // R rows' scores for every head: v[r] holds head h's dot() lanes for row r; the tree's sums of
  // the R rows go to s[h * n + t ..] in one store
  auto rows = [&](auto rn, const TK* row, int64_t t) {
    constexpr int R = decltype(rn)::value;
    __m512 kc[R][C];
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(row + r * stride) + kPrefetch, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(row + r * stride) + kPrefetch + 64, _MM_HINT_T0);
      for (int c = 0; c < C; ++c) kc[r][c] = load16(row + r * stride + 16 * c);
    }
    const float* qt = t < n_sink ? q_sink : q;
    for (int64_t h = 0; h < G; ++h) {
      const float* qh = qt + h * hd;
      __m512 s0[4], s1[4], v[4];
      for (int r = 0; r < 4; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
      for (int c = 0; c < C; c += 2) {
        const __m512 q0 = _mm512_loadu_ps(qh + 16 * c), q1 = _mm512_loadu_ps(qh + 16 * c + 16);
        for (int r = 0; r < R; ++r) {
          s0[r] = _mm512_fmadd_ps(q0, kc[r][c], s0[r]);
          s1[r] = _mm512_fmadd_ps(q1, kc[r][c + 1], s1[r]);
        }
      }
      for (int r = 0; r < 4; ++r) v[r] = _mm512_add_ps(s0[r], s1[r]);  // (rows past R: lanes of their own)
      const __m512 sums = _mm512_permutexvar_ps(lanes, _mm512_mul_ps(tree_sum16x4(v), sv));
      _mm512_mask_storeu_ps(s + h * n + t, static_cast<__mmask16>((1u << R) - 1), sums);
    }
  };
  constexpr int kR = C <= 4 ? 4 : 2;  // rows at a time: their widened keys in registers
  int64_t t = 0;
  spans([&](const TK* k, const TV*, int64_t len) {
    int64_t j = 0;
    for (; j + kR <= len; j += kR, t += kR) {
      if (t < n_sink && t + kR > n_sink) {  // (rows on both sides of n_sink: one at a time)
        for (int r = 0; r < kR; ++r) rows(std::integral_constant<int, 1>{}, k + (j + r) * stride, t + r);
        continue;
      }
      rows(std::integral_constant<int, kR>{}, k + j * stride, t);
    }
    for (; j < len; ++j, ++t) rows(std::integral_constant<int, 1>{}, k + j * stride, t);
  });
}
#endif

// The G query heads that share one KV head (G * hd floats at q, head after head) attend over its n
// cached slots: out[h] = softmax(q_h . K_t * scale) V. The slots come as spans of consecutive
// rows, spans(f) calling f(k, v, len) for each in order: one span for a contiguous cache, one per
// block for the paged pool. Each K and V row is read once for all G heads. Every head runs the
// same operations in the same order whatever G, the layout, the batch or the thread, so its
// output does not depend on them. K rows of TK, V rows of TV (KV<T> above). s: G * (n + 1) floats
// of scratch; out: G * hd floats.
// With stats, the slots are one chunk of a longer row (split-K, combine_chunks below): out gets
// the unnormalized sums sum_t exp(s_t - max) V_t (in a rotated V cache's space: unrotate the
// combined result), and stats[2h], stats[2h + 1] head h's max score and sum of exp.
// q_sink, n_sink (attention sinks, paged_attention.h): the first n_sink slots are scored with the G
// heads at q_sink instead (the query rotated to its position inside a windowed cache).
template <typename TK, typename TV, typename Spans>
inline void attend_group(const float* q, int64_t G, int64_t hd, int64_t n, float scale, Spans spans, float* s,
                         float* out, float* stats = nullptr, const float* q_sink = nullptr, int64_t n_sink = 0) {
  thread_local std::vector<float> local;  // a dequantized row, and the rotated queries
  if constexpr (KV<TK>::quantized || KV<TV>::quantized) {
    if (local.size() < static_cast<size_t>((2 * G + 1) * hd)) local.resize((2 * G + 1) * hd);
  }
  float* buf = local.data();
  if constexpr (KV<TK>::rotated) {
    std::copy(q, q + G * hd, buf + hd);
    for (int64_t h = 0; h < G; ++h) hadamard(buf + hd + h * hd, hd);
    q = buf + hd;
    if (n_sink) {
      std::copy(q_sink, q_sink + G * hd, buf + (G + 1) * hd);
      for (int64_t h = 0; h < G; ++h) hadamard(buf + (G + 1 + h) * hd, hd);
      q_sink = buf + (G + 1) * hd;
    }
  }
  const int64_t stride = KV<TK>::stride(hd);
  int64_t t = 0;
  bool scored = false;
  if constexpr (KV<TK>::quantized) {  // quantized keys: the queries quantized too (quantize_query)
    thread_local std::vector<int8_t> codes;
    thread_local std::vector<float> qd;
    thread_local std::vector<int32_t> qsum;
    const int64_t NG = G * hd / 32;
    if (codes.size() < static_cast<size_t>(2 * G * hd)) codes.resize(2 * G * hd), qd.resize(2 * NG), qsum.resize(2 * NG);
    quantize_query(q, G, hd, codes.data(), qd.data(), qsum.data());
    if (n_sink) quantize_query(q_sink, G, hd, codes.data() + G * hd, qd.data() + NG, qsum.data() + NG);
#if defined(ARLM_INT_SCORES)
    if (IntKeys<TK>::integer && hd % 64 == 0 && hd <= 512) {
      order_query_codes<TK>(codes.data(), (n_sink ? 2 : 1) * G * hd);
      integer_scores<TK>(codes.data(), qd.data(), qsum.data(), G, hd, n, scale, spans, s, codes.data() + G * hd,
                         qd.data() + NG, qsum.data() + NG, n_sink);
      scored = true;
    }
#endif
    if (!scored) {  // the float path below, on the quantized queries' values
      for (int64_t i = 0; i < (n_sink ? 2 : 1) * G * hd; ++i)
        buf[hd + i] = static_cast<float>(codes[i]) * qd[i / 32];
      q = buf + hd;
      if (n_sink) q_sink = buf + (G + 1) * hd;
    }
  }
#if defined(__AVX512F__)
  if constexpr (!KV<TK>::quantized) {  // (heads of other sizes: dot() row by row, below)
    scored = hd == 64 || hd == 128 || hd == 256;
    if (hd == 64) float_key_scores<4, TK, TV>(q, G, n, scale, spans, s, q_sink, n_sink);
    if (hd == 128) float_key_scores<8, TK, TV>(q, G, n, scale, spans, s, q_sink, n_sink);
    if (hd == 256) float_key_scores<16, TK, TV>(q, G, n, scale, spans, s, q_sink, n_sink);
  }
#endif
  if (!scored) {
#if defined(__AVX512F__)
    if (KV<TK>::quantized && hd % 16 == 0 && hd <= 512) {
      quantized_scores<TK, TV>(q, G, hd, n, scale, spans, s, q_sink, n_sink);
    } else
#elif defined(__AVX2__) && defined(__FMA__)
    if (!KV<TK>::quantized && hd % 8 == 0) {
      scores8<TK, TV>(q, G, hd, n, scale, spans, s, q_sink, n_sink);
    } else
#endif
    spans([&](const TK* k, const TV*, int64_t len) {
      for (int64_t j = 0; j < len; ++j, ++t) {
#if defined(__AVX512F__)
        _mm_prefetch(reinterpret_cast<const char*>(k + j * stride) + kPrefetch, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(k + j * stride) + kPrefetch + 64, _MM_HINT_T0);
#endif
        const auto* row = KV<TK>::view(k + j * stride, hd, buf);
        const float* qt = t < n_sink ? q_sink : q;
        for (int64_t h = 0; h < G; ++h) s[h * n + t] = dot(qt + h * hd, row, hd) * scale;
      }
    });
  }
  attend_scored<TK, TV>(G, hd, n, spans, s, out, stats);
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
