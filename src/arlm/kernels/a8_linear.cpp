// Integer-dot linear layers for CPU decode: int8 or 4-bit weights times 8-bit activations.
//
// The float kernels (int8_linear.cpp, q4_linear.cpp) widen every weight to float32 before the
// multiply; for 4-bit weights that widening, not memory, bounds the step. Here the activations
// are quantized instead, the way llama.cpp's Q8_0 does: each row of x is cut into groups of 32,
// each group stored as int8 with one float scale (dx = max|x| / 127). A group of 32 weights times
// a group of 32 activations is then one integer dot product (VNNI's vpdpbusd where the CPU has
// it, else AVX2's maddubs + madd), scaled once per group in float32. On AVX-512 VNNI CPUs the
// packed kernels further down do the same products 16 output channels at a time:
//
//   int8 weights  (w = s[n] * q):              y = s[n] * sum_g dx_g * sum_j q_j qx_j
//   Q8_0 weights  (w = d[n,g] * q):            y = sum_g d dx_g * sum_j q_j qx_j
//   4-bit weights (w = d[n,g] * q + m[n,g]):   y = sum_g d dx_g * sum_j q_j qx_j + m * dx_g * sum_j qx_j
//
// The result is exactly the float product of the dequantized weights and the quantized
// activations (up to float32 summation), which the tests check against float64.
// x is quantized per row and every (row, weight row) pair is summed in the same order whatever
// the number of rows M, so a sequence's result does not depend on what it is batched with.
#include "aten.h"
#include <immintrin.h>

#include "common.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;  // activations (and 4-bit weights) per scale
constexpr int64_t kKScaleBytes = 192;  // Q4_K's / Q5_K's sc and m, a block of 16 channels and super-block
// Weight rows per tile of the row-layout kernels (AVX2): kRows x MB accumulators in registers.
// This file's register tiling, like decode.cpp's kTileRows for its float32 kernel: a separate
// choice, and a count of w's rows, not x's (the layer stack's kExactRows).
constexpr int64_t kRows = 4;
// Rows of x per block at most (row_blocks): one load of a weight vector serves them all.
constexpr int kBlockRows = 4;
constexpr int64_t kLanes = 16;  // output channels per block of the packed layouts (below)

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512F__) && defined(__AVX512BW__))
#define ARLM_QUANTIZE_AVX2 1  // the groups' quantization on AVX2 (below)

// A group's 32 floats as 4 vectors; returns their largest magnitude, finite false where one is
// NaN or infinite (max would hide a NaN: the unordered compare finds it).
inline float group_amax8(const float* src, __m256 (&v)[4], bool& finite) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_loadu_ps(src + 8 * k);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[k]));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v[k], v[k], _CMP_UNORD_Q));
  }
  const float amax = arlm_kernels::hmax(m);
  finite = std::isfinite(amax) && !_mm256_movemask_ps(unordered);
  return amax;
}

// 32 int32 in 4 vectors, each within int8, -> 32 bytes in order.
inline void store_bytes(const __m256i (&x)[4], int8_t* dst) {
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(x[0], x[1]), _mm256_packs_epi32(x[2], x[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

inline int32_t sum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
#endif

// One group of 32 floats -> 32 int8 q, its scale d = max|x| / 127, s = d * sum(q) and sum(q).
// The vector and scalar paths do the same float32 operations (round half to even is the CPU's
// default rounding), so every build quantizes bitwise alike, as kernels.quantize_activations does.
inline void quantize_group(const float* src, int8_t* q, float* d_out, float* s_out, int32_t* sum_out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
  const float vmax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  if (std::isfinite(vmax) && !_mm512_cmp_ps_mask(lo, hi, _CMP_UNORD_Q)) {  // no inf, no NaN (else below)
    const float d = vmax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    const __m512 idv = _mm512_set1_ps(id);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(lo, idv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(hi, idv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
    *sum_out = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    *d_out = d;
    *s_out = d * static_cast<float>(*sum_out);
    return;
  }
#elif defined(ARLM_QUANTIZE_AVX2)
  __m256 v[4];
  bool finite;
  const float vmax = group_amax8(src, v, finite);
  if (finite) {
    const float d = vmax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    __m256i qv[4];
    for (int k = 0; k < 4; ++k) qv[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(id)));
    store_bytes(qv, q);
    *sum_out = sum_epi32(_mm256_add_epi32(_mm256_add_epi32(qv[0], qv[1]), _mm256_add_epi32(qv[2], qv[3])));
    *d_out = d;
    *s_out = d * static_cast<float>(*sum_out);
    return;
  }
#endif
  float amax = 0.f;
  for (int j = 0; j < kGroup; ++j) amax = std::isnan(src[j]) ? NAN : std::max(amax, std::fabs(src[j]));
  if (!std::isfinite(amax)) {  // NaN or inf in the group: the result is NaN, as in float math
    for (int j = 0; j < kGroup; ++j) q[j] = 0;
    *d_out = *s_out = NAN;
    *sum_out = 0;
    return;
  }
  const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
  int sum = 0;
  for (int j = 0; j < kGroup; ++j) {
    const int v = static_cast<int>(std::nearbyint(src[j] * id));  // round half to even
    q[j] = static_cast<int8_t>(v);
    sum += v;
  }
  *sum_out = sum;
  *d_out = d;
  *s_out = d * static_cast<float>(sum);
}

// x [M, K] float -> qx [M, K] int8, dx [M, K/32] (scale), sx [M, K/32] (dx * sum of the group's qx),
// qs [M, K/32] (that sum of qx itself), over the thread pool.
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* qx, float* dx, float* sx, int32_t* qs) {
  at::parallel_for(0, M * (K / kGroup), 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) quantize_group(x + b * kGroup, qx + b * kGroup, dx + b, sx + b, qs + b);
  });
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512DQ__) && \
    defined(__AVX2__) && defined(__FMA__)
#define ARLM_AVX512 1  // the packed kernels below
#endif
#if defined(ARLM_AVX512) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define ARLM_PACKED 1  // the packed layouts' kernels: AVX-512 VNNI's, else AVX2's
#endif
#if defined(ARLM_AVX512) && defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define ARLM_AMX 1  // the tile kernel for prompt rows (amx_tile)
#include <sys/syscall.h>
#include <unistd.h>
#endif

// sum_g a[g] * b[g], in an order that depends on n alone.
inline float dot_f32(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
  for (int64_t g = 0; g < n; ++g) acc = std::fma(a[g], b[g], acc);
  return acc;
}

#if defined(__AVX2__) && defined(__FMA__)
using arlm_kernels::hsum;

// Eight int32 partial sums of a[j] * b[j] over 32 bytes: a unsigned (0..255), b signed.
inline __m256i dot_u8s8(__m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#else
  // maddubs: pairs of u8 * s8 into int16 (|15 * 127 * 2| and |127 * 127 * 2| fit); madd: into int32.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

// 16 packed bytes (element j in the low nibble of byte j, element 16 + j in the high) -> 32 bytes 0..15.
inline __m256i unpack_nibbles(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }


// MB rows of quantized x against kRows 4-bit weight rows (scales widened to float in d, mn).
// y = sum_g (d * dx) * dot(q, qx)  +  sum_g m * (dx * sum qx): the second sum is one short dot
// product per (row, weight row) after the main loop.
template <int MB>
void q4_block(const int8_t* qx, const float* dx, const float* sx, int64_t K, const uint8_t* w,
              const float* d, const float* mn, float* out) {
  const int64_t G = K / kGroup, ldw = K / 2;
  __m256 acc[MB][kRows];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kRows; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i wq[kRows];
    for (int r = 0; r < kRows; ++r) wq[r] = unpack_nibbles(w + r * ldw + g * 16);
    for (int i = 0; i < MB; ++i) {
      const __m256i xq = load32(qx + i * K + g * kGroup);
      const float dxi = dx[i * G + g];
      for (int r = 0; r < kRows; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wq[r], xq));
        acc[i][r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d[r * G + g] * dxi), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kRows; ++r) out[i * kRows + r] = hsum(acc[i][r]) + dot_f32(mn + r * G, sx + i * G, G);
}

// MB rows of quantized x against kRows int8 weight rows: a per-row scale is applied by the caller;
// group scales (Q8_0: dw [kRows, K/32], widened) multiply each group's dot product here; kHalf16:
// a scale per 16 (dw [kRows, K/16]: Q6_K's d sc), the dot's lanes 0-3 holding the first 16
// products of a group and lanes 4-7 the others.
template <int MB, bool kGrouped = false, bool kHalf16 = false>
void i8_block(const int8_t* qx, const float* dx, int64_t K, const int8_t* w, float* out,
              const float* dw = nullptr) {
  const int64_t G = K / kGroup;
  __m256 acc[MB][kRows];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kRows; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i wa[kRows], ws[kRows];
    for (int r = 0; r < kRows; ++r) {
      ws[r] = load32(w + r * K + g * kGroup);
      wa[r] = _mm256_sign_epi8(ws[r], ws[r]);  // |w| as unsigned; the sign moves onto x below
    }
    for (int i = 0; i < MB; ++i) {
      const __m256i xq = load32(qx + i * K + g * kGroup);
      const __m256 dxv = _mm256_set1_ps(dx[i * G + g]);
      for (int r = 0; r < kRows; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wa[r], _mm256_sign_epi8(xq, ws[r])));
        const __m256 sv = kHalf16 ? _mm256_set_m128(_mm_set1_ps(dx[i * G + g] * dw[r * 2 * G + 2 * g + 1]),
                                                    _mm_set1_ps(dx[i * G + g] * dw[r * 2 * G + 2 * g]))
                          : kGrouped ? _mm256_set1_ps(dx[i * G + g] * dw[r * G + g]) : dxv;
        acc[i][r] = _mm256_fmadd_ps(dot, sv, acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kRows; ++r) out[i * kRows + r] = hsum(acc[i][r]);
}
#endif

// Scalar reference for tiles narrower than kRows and CPUs without AVX2. Same per-group math.
float q4_scalar(const int8_t* qx, const float* dx, const float* sx, int64_t K, const uint8_t* w,
                const float* d, const float* mn) {
  const int64_t G = K / kGroup;
  float acc = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    int dot = 0;
    for (int j = 0; j < 16; ++j) {
      const uint8_t b = w[g * 16 + j];
      dot += (b & 0x0F) * qx[g * kGroup + j] + (b >> 4) * qx[g * kGroup + 16 + j];
    }
    acc += static_cast<float>(dot) * (d[g] * dx[g]);
  }
  return acc + dot_f32(mn, sx, G);
}

float i8_scalar(const int8_t* qx, const float* dx, int64_t K, const int8_t* w, const float* dw = nullptr,
                bool half16 = false) {
  const int64_t G = K / kGroup;
  float acc = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    if (half16) {  // a weight scale per 16: the two halves' dots scaled on their own
      for (int h = 0; h < 2; ++h) {
        int dot = 0;
        for (int j = 16 * h; j < 16 * h + 16; ++j) dot += w[g * kGroup + j] * qx[g * kGroup + j];
        acc += static_cast<float>(dot) * (dx[g] * dw[2 * g + h]);
      }
      continue;
    }
    int dot = 0;
    for (int j = 0; j < kGroup; ++j) dot += w[g * kGroup + j] * qx[g * kGroup + j];
    acc += static_cast<float>(dot) * (dw ? dx[g] * dw[g] : dx[g]);
  }
  return acc;
}

using arlm_kernels::widen;

// Calls block(MB, m) over the rows of x in blocks of MB = kMax (kBlockRows: 4) rows, then the rest
// as one block of 3, or of 2, and of 1 (MB as a type, so that it can be a template argument). Three
// rows in one block, not 2 + 1: a speculative pass verifying two draft tokens (3 rows) was as dear
// as one of 4 rows (1.79x / 1.81x one token's at 1B, benchmarks/speculative.py --step-cost): the
// weights unpacked for 2 rows, then again for 1.
template <int kMax = kBlockRows, typename Block>
inline void row_blocks(int64_t M, Block block) {
  int64_t m = 0;
  for (; m + kMax <= M; m += kMax) block(std::integral_constant<int, kMax>{}, m);
  if constexpr (kMax > 3)
    if (M - m == 3) return block(std::integral_constant<int, 3>{}, m);
  if constexpr (kMax > 2)
    for (; m + 2 <= M; m += 2) block(std::integral_constant<int, 2>{}, m);
  for (; m < M; ++m) block(std::integral_constant<int, 1>{}, m);
}

struct QuantizedX {
  std::unique_ptr<int8_t[]> q;  // written in full by quantize_rows: no zero-fill first
  std::unique_ptr<float[]> d, s;
  std::unique_ptr<int32_t[]> sum;
  QuantizedX(const at::Tensor& x)
      : q(new int8_t[x.numel()]), d(new float[x.numel() / kGroup]), s(new float[x.numel() / kGroup]),
        sum(new int32_t[x.numel() / kGroup]) {
    quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), q.get(), d.get(), s.get(), sum.get());
  }
  arlm_kernels::Act8 view() const { return {q.get(), d.get(), s.get(), sum.get()}; }
};


// ---- 16-bit activations as two bytes (linear_a8p_residual) ----------------------------------
//
// x is quantized to 16 bits per group of 32, X = round(x / e) with e = max|x| / 32512 (= the 8-bit
// scale / 256), and X split exactly into bytes: hi = (X + 128) >> 8 in [-127, 127] and
// lo = X - 256 hi in [-128, 127]. A group's integer dot product is then
// 256 * dot(w, hi) + dot(w, lo), exact in int32 (|256 * 32 * 255 * 127| < 2^31): two vpdpbusd
// chains per row, shifted and added once per group, then one convert and one scale, as one
// 8-bit pass has. The rounding error is at most e / 2 = max|x| / 65024 per value.

// One group of 32 floats -> hi, lo (32 bytes each), e, sx = e * sum(X) and sum(X). NaN or inf in
// the group: codes 0 and NaN scales, so the result is NaN as in float math.
inline void quantize_group16(const float* src, int8_t* hi, int8_t* lo, float* e_out, float* sx_out,
                             int32_t* sum_out) {
  float amax = 0.f;
  bool finite = true;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
  amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  finite = std::isfinite(amax) && !_mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);  // (max hides a NaN)
#elif defined(ARLM_QUANTIZE_AVX2)
  __m256 v[4];
  amax = group_amax8(src, v, finite);
#else
  for (int j = 0; j < kGroup; ++j) {
    finite &= std::isfinite(src[j]);
    amax = std::max(amax, std::fabs(src[j]));
  }
#endif
  if (!finite) {
    std::fill(hi, hi + kGroup, 0);
    std::fill(lo, lo + kGroup, 0);
    *e_out = *sx_out = NAN;
    *sum_out = 0;
    return;
  }
  // (a group below ~1e-34 in magnitude, whose 1 / e would overflow, is taken as zeros)
  const float e = amax / 32512.f, ie = e >= std::numeric_limits<float>::min() ? 1.f / e : 0.f;
  int32_t sum = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (int half = 0; half < 2; ++half) {
    const __m512i X = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(src + 16 * half), _mm512_set1_ps(ie)));
    const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(X, _mm512_set1_epi32(128)), 8);
    const __m512i l = _mm512_sub_epi32(X, _mm512_slli_epi32(h, 8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + 16 * half), _mm512_cvtepi32_epi8(h));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 16 * half), _mm512_cvtepi32_epi8(l));
    sum += _mm512_reduce_add_epi32(X);
  }
#elif defined(ARLM_QUANTIZE_AVX2)
  __m256i h[4], l[4], total = _mm256_setzero_si256();
  for (int k = 0; k < 4; ++k) {
    const __m256i X = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(ie)));
    h[k] = _mm256_srai_epi32(_mm256_add_epi32(X, _mm256_set1_epi32(128)), 8);
    l[k] = _mm256_sub_epi32(X, _mm256_slli_epi32(h[k], 8));
    total = _mm256_add_epi32(total, X);
  }
  store_bytes(h, hi);
  store_bytes(l, lo);
  sum = sum_epi32(total);
#else
  for (int j = 0; j < kGroup; ++j) {
    const int32_t X = static_cast<int32_t>(std::nearbyint(src[j] * ie)), h = (X + 128) >> 8;
    hi[j] = static_cast<int8_t>(h);
    lo[j] = static_cast<int8_t>(X - 256 * h);
    sum += X;
  }
#endif
  *e_out = e;
  *sx_out = e * static_cast<float>(sum);
  *sum_out = sum;
}

// (The packed kernels of either instruction set, below.)
// Accumulator tiles: MB rows of x by NB blocks of 16 channels.
template <typename V, int MB, int NB>
inline void zero(V (&a)[MB][NB]) {
  for (int i = 0; i < MB; ++i)
    for (int b = 0; b < NB; ++b) a[i][b] = V{};
}

// Bytes of 8 K-values of one block of 16 channels: 4-bit (64), or 5-bit (k5: the 64 bytes of low
// 4 bits, then two 64-bit masks of the 5th: bit i of the first is byte i of the low-nibble vector,
// of the second the high-nibble one's).
template <bool k5>
constexpr int64_t chunk_bytes() { return k5 ? 80 : 64; }

// The K-quants' scales lie in arrays of their own beside the weights (kscale, supers): two more
// streams, read once a super-block. Left to the hardware prefetchers they arrived late: prefetched
// kScalesAhead super-blocks ahead (where each super-block's are first read: KScales::unpack,
// q6p_block) the 8B Q4_K_M batch-1 step went 2-4% faster (55.0-57.1 -> 53.2-55.9 ms over four
// alternations), its Q4_K passes 84 -> 86-89 GB/s, the 1B step 9.9-10.3 -> 9.35-9.85 ms (Zen 5,
// benchmarks/phases.py; Q4_K's 16 ahead measured as 4). The same bits: prefetches only.
constexpr int64_t kScalesAhead = 4;
inline void prefetch_scales(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(static_cast<const char*>(p) + o, _MM_HINT_T0);
}
// Q4_K / Q5_K: a block's sc and m (p) and d, dmin (ds) of the super-block kScalesAhead on (KScales::unpack).
inline void prefetch_kscales(const uint8_t* p, const at::Half* ds) {
  prefetch_scales(p + kScalesAhead * kKScaleBytes, kKScaleBytes);
  prefetch_scales(ds + kScalesAhead * 2 * kLanes, 2 * kLanes * sizeof(at::Half));
}
// Q6_K: NB blocks' scales (sc [blocks][H][16] int8) and d (dd [blocks][S][16]) of the super-block
// kScalesAhead on from group g's (q6p_block, a decode tile's first row block; g a super-block's first).
template <int NB>
inline void prefetch_q6_scales(const int8_t* sc, const at::Half* dd, int64_t H, int64_t S, int64_t g) {
  for (int b = 0; b < NB; ++b) {
    prefetch_scales(sc + (b * H + 2 * g + 16 * kScalesAhead) * kLanes, 16 * kLanes);
    prefetch_scales(dd + (b * S + g / 8 + kScalesAhead) * kLanes, kLanes * sizeof(at::Half));
  }
}

#ifdef ARLM_AVX512
// ---- Packed layouts: 16 output channels per 512-bit vector ----------------------------------
//
// The kernels above (AVX2) put one weight row's 32 K-values in a vector and reduce across lanes
// at the end; every group then costs a dot, a convert, a multiply and an FMA. With many rows of x
// (batched decode, serving) that bookkeeping, not memory, bounds the step. The packed layouts
// put 16 output channels in the vector instead, 4 consecutive K-values per channel (the operand
// shape of vpdpbusd): each instruction takes 4 bytes of x broadcast to every lane, and a group
// of 32 K-values is 8 instructions into one int32 accumulator per channel, then one convert and
// one FMA with the group's scale. A weight vector is loaded once and used for up to 4 rows of x.
//
//   int8: wp [N/16, K/4, 16, 4] bytes, w XOR 0x80 = w + 128: vpdpbusd multiplies unsigned by
//         signed bytes, so no sign work; the 128 * sum(qx) this adds to a group's integer dot
//         product is taken off in integers (exact) before the convert. scale [N] float32.
//   4-bit: wp [N/16, K/8, 16, 4] bytes, low nibble of byte (c, t) = q[c, 8p + t], high nibble
//          = q[c, 8p + 4 + t]; scale and mins [N/16, K/32, 16] float16.
// and GGUF's K-quants, their super-blocks of 256 K-values read as stored (K a multiple of 256):
//   Q4_K:  the 4-bit wp (w = d sc q - dmin m, q 0..15); scale [N/16, K/256, 192] uint8, the 6-bit
//          sc and m of each super-block's 8 groups in the file's 12 bytes a channel (KScales);
//          mins [N/16, K/256, 32] float16 (the file's), each super-block's d for the 16 channels,
//          then its dmin.
//   5-bit: wp [N/16, K/8, 80] bytes, per 8 K-values the 4-bit layout's 64 bytes of low bits, then
//          two 64-bit masks of the 5th bits (load_q4); with a float16 scale and no mins (Q5_0:
//          m = -16 d, as Q4_0's -8 d: the file's 5.5 bits a weight) or Q4_K's scales (Q5_K).
//   Q6_K:  wp [N/16, K/8, 96] bytes, per 8 K-values the 4-bit layout's 64 bytes of u = q + 32's low
//          4 bits, then 32 of its top 2 (load_q6); scale [N/16, K/16, 16] int8, a scale per 16
//          K-values; mins [N/16, K/256, 16] float16, d (q6p_block). 6.5625 bits a weight: the file's.
// N a multiple of 16. arlm.kernels.pack_int8 / pack_q4 / pack_q4_k / pack_q6_k build them from
// the row layouts.



template <int MB, int NB>
inline void store(const __m512 (&acc)[MB][NB], float* out) {
  for (int i = 0; i < MB; ++i)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + (i * NB + b) * kLanes, acc[i][b]);
}

// MB rows of quantized x against NB blocks of 16 channels of packed int8 weights.
// out[i * NB * 16 + c]: sum_g dx_g * dot_g(w, qx) for row i, channel c of the blocks; qs: the
// rows' sums of qx per group (dot_g(w + 128, qx) - 128 * qs_g = dot_g(w, qx)).
// pf: where to prefetch the next tile from (the same offsets as w), or null.
// With group scales (Q8_0), dw [NB blocks][G][16] float16 multiplies each group's dot products.
template <int MB, int NB>
void i8p_block(const int8_t* qx, const float* dx, const int32_t* qs, int64_t K, const uint8_t* w, const uint8_t* pf,
               float* out, const at::Half* dw = nullptr) {
  const int64_t G = K / kGroup, block = K * kLanes, sblock = G * kLanes;
  __m512 acc[MB][NB];
  zero(acc);
  for (int64_t g = 0; g < G; ++g) {
    __m512i dot[MB][NB];
    zero(dot);
#pragma GCC unroll 8
    for (int64_t j = 0; j < kGroup / 4; ++j) {
      const int64_t k = g * kGroup + 4 * j;
      __m512i wv[NB];
      for (int b = 0; b < NB; ++b) {
        wv[b] = _mm512_loadu_si512(w + b * block + k * kLanes);
        if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + b * block + k * kLanes), _MM_HINT_T0);
      }
      for (int i = 0; i < MB; ++i) {
        const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(qx + i * K + k));
        for (int b = 0; b < NB; ++b) dot[i][b] = _mm512_dpbusd_epi32(dot[i][b], wv[b], xb);
      }
    }
    __m512 ds[NB];
    if (dw)
      for (int b = 0; b < NB; ++b)
        ds[b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dw + b * sblock + g * kLanes)));
    for (int i = 0; i < MB; ++i) {
      const __m512 s = _mm512_set1_ps(dx[i * G + g]);
      const __m512i offset = _mm512_set1_epi32(128 * qs[i * G + g]);
      for (int b = 0; b < NB; ++b)
        acc[i][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[i][b], offset)),
                                    dw ? _mm512_mul_ps(ds[b], s) : s, acc[i][b]);
    }
  }
  store(acc, out);
}


// NB blocks' packed 4-bit (or, k5, 5-bit) weights for K-values k .. k + 7 (block: bytes per
// block), split into their low nibbles (k .. k + 3 per channel) and high nibbles (k + 4 .. k + 7),
// each byte 16 more where its 5th bit is set; pf: prefetched alike.
template <int NB, bool k5 = false>
inline void load_q4(const uint8_t* w, int64_t block, int64_t k, const uint8_t* pf, __m512i (&lo)[NB],
                    __m512i (&hi)[NB]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int64_t at = k / 8 * chunk_bytes<k5>();
  for (int b = 0; b < NB; ++b) {
    const uint8_t* p = w + b * block + at;
    const __m512i v = _mm512_loadu_si512(p);
    if (pf) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + b * block + at), _MM_HINT_T0);
      if (k5) _mm_prefetch(reinterpret_cast<const char*>(pf + b * block + at + 64), _MM_HINT_T0);
    }
    lo[b] = _mm512_and_si512(v, low4);
    hi[b] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    if constexpr (k5) {
      uint64_t m0, m1;
      std::memcpy(&m0, p + 64, 8);
      std::memcpy(&m1, p + 72, 8);
      const __m512i sixteen = _mm512_set1_epi8(16);
      lo[b] = _mm512_mask_add_epi8(lo[b], _cvtu64_mask64(m0), lo[b], sixteen);
      hi[b] = _mm512_mask_add_epi8(hi[b], _cvtu64_mask64(m1), hi[b], sixteen);
    }
  }
}

// A Q6_K tile's weights unpacked once for a prompt's rows (expand_q6): per block and 8 K-values
// the two vectors load_q6 makes of them, kExpanded bytes; q6p_block reads them with kX.
constexpr int64_t kExpanded = 128;

template <int NB>
inline void load_x(const uint8_t* w, int64_t block, int64_t k, __m512i (&lo)[NB], __m512i (&hi)[NB]) {
  const int64_t at = k / 8 * kExpanded;
  for (int b = 0; b < NB; ++b) {
    lo[b] = _mm512_load_si512(w + b * block + at);
    hi[b] = _mm512_load_si512(w + b * block + at + 64);
  }
}

// A packed layer's per-group scales for 16 channels as vectors: ds[b] multiplies group g's integer
// dot product, ms[b] (4-bit layouts) the activations' sum. Pointers start at the tile's first block.
// F16Scales: Q4_1's (and Q8_0's: m null) float16 d and m per group, [blocks][G][16]; d null: none
// (int8 with a scale per row, applied by the caller).
// m_per_d: Q4_0's m = -8 d (m null), no mins stored.
struct F16Scales {
  const at::Half *d, *m;
  int64_t G;
  float m_per_d = 0.f;
  bool scaled() const { return d != nullptr; }
  // The scales 1 KB past group g's (32 groups ahead), with the weights' prefetch: the step's second
  // stream, which the hardware prefetchers did not keep ahead. The 1B Q8_0 step 20.1-21.8 ->
  // 19.0-20.8 ms (5 alternations, Zen 5; 256 B and 2-4 KB ahead no better), SmolLM2's the same.
  // Q4_K's and Q6_K's scales prefetched alike gave nothing (within the host's noise).
  void prefetch(int b, int64_t g) const {
    constexpr int64_t kAhead = 1024;
    if (d) _mm_prefetch(reinterpret_cast<const char*>(d + (b * G + g) * kLanes) + kAhead, _MM_HINT_T0);
    if (m) _mm_prefetch(reinterpret_cast<const char*>(m + (b * G + g) * kLanes) + kAhead, _MM_HINT_T0);
  }
  void at(int b, int64_t g, __m512& ds, __m512& ms) const {
    if (d) ds = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + (b * G + g) * kLanes)));
    if (m) ms = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + (b * G + g) * kLanes)));
    else if (m_per_d != 0.f) ms = _mm512_mul_ps(ds, _mm512_set1_ps(m_per_d));
  }
};

// Q4_K's: ds = d * sc and ms = -(dmin * m), sc and m the group's 6-bit integers, d and dmin its
// super-block's floats ([blocks][G / 8][32]). The products are exact in float32 (an 11-bit d times
// a 6-bit integer), as gguf dequantizes them. sc and m lie as the file holds them, 12 bytes a
// channel and super-block (kernels.pack_kscales): per block and super-block, 8 groups' 16 bytes
// of low 4 bits (sc | m << 4, byte 16 j + c), then 64 bytes of the top 2 bits of both, byte
// 16 k + c holding group k's in its low nibble (sc | m << 2) and group k + 4's in its high one.
// At each super-block's first group the 8 groups' sc and m are unpacked as bytes (14 operations
// for the 16 channels) and d and -dmin widened, which at() then multiplies as it did when sc and
// m were stored as bytes: unpacked for each group (7 more operations a group and block), a batch
// of 8 at 1B took 11% longer, an 8B step 5-8%.
// at() must be called for groups 0, 1, ... in order for each block (the kernels' loops do).
struct KScales {
  const uint8_t* sm;
  const at::Half* dd;
  int64_t G;
  mutable uint8_t bytes[2][256] __attribute__((aligned(64)));  // block b's groups' sc (16 j + c), then m
  mutable __m512 d[2], neg_dmin[2];                             // its super-block's d and -dmin
  KScales(const uint8_t* sm, const at::Half* dd, int64_t G) : sm(sm), dd(dd), G(G) {}  // (bytes left unset)
  static KScales of(const void* kscale, const at::Half* supers, int64_t b0, int64_t G) {
    return {static_cast<const uint8_t*>(kscale) + b0 * (G / 8) * kKScaleBytes, supers + b0 * (G / 8) * 2 * kLanes, G};
  }
  bool scaled() const { return true; }
  void prefetch(int, int64_t) const {}  // (prefetched as F16Scales' are: no change, F16Scales::prefetch)
  void unpack(int b, int64_t super) const {
    const at::Half* ds = dd + (b * (G / 8) + super) * 2 * kLanes;
    d[b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ds)));
    neg_dmin[b] = _mm512_sub_ps(_mm512_setzero_ps(),
                                _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ds + kLanes))));
    const uint8_t* p = sm + (b * (G / 8) + super) * kKScaleBytes;
    prefetch_kscales(p, ds);
    const __m512i low0 = _mm512_loadu_si512(p), low1 = _mm512_loadu_si512(p + 64), top = _mm512_loadu_si512(p + 128);
    const __m512i x0f = _mm512_set1_epi8(0x0F), x30 = _mm512_set1_epi8(0x30);
    const __m512i x03 = _mm512_set1_epi8(0x03), x0c = _mm512_set1_epi8(0x0C);
    auto put = [&](int at, __m512i v) { _mm512_store_si512(bytes[b] + at, v); };
    put(0, _mm512_or_si512(_mm512_and_si512(low0, x0f), _mm512_slli_epi16(_mm512_and_si512(top, x03), 4)));
    put(64, _mm512_or_si512(_mm512_and_si512(low1, x0f), _mm512_and_si512(top, x30)));
    put(128, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low0, 4), x0f),
                             _mm512_slli_epi16(_mm512_and_si512(top, x0c), 2)));
    put(192, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low1, 4), x0f),
                             _mm512_and_si512(_mm512_srli_epi16(top, 2), x30)));
  }
  void at(int b, int64_t g, __m512& ds, __m512& ms) const {  // (-dmin) m: -(dmin m) exactly
    if (g % 8 == 0) unpack(b, g / 8);
    const uint8_t* s = bytes[b] + 16 * (g % 8);
    auto widen = [](const uint8_t* p) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(p))));
    };
    ds = _mm512_mul_ps(d[b], widen(s));
    ms = _mm512_mul_ps(neg_dmin[b], widen(s + 128));
  }
};

// KScales' two vectors of every group of nb blocks, computed once for a prompt's chunk of rows
// (expand_kscales) and then loaded by each of its blocks of rows: the same floats, so the same
// results, without the ~9 operations a group and block that KScales::at spends for every 4 rows.
struct FloatScales {
  const float* v;  // [blocks][G][2][16]: ds, then ms
  int64_t G;
  bool scaled() const { return true; }
  void prefetch(int, int64_t) const {}
  void at(int b, int64_t g, __m512& ds, __m512& ms) const {
    ds = _mm512_load_ps(v + (b * G + g) * 2 * kLanes);
    ms = _mm512_load_ps(v + ((b * G + g) * 2 + 1) * kLanes);
  }
};

inline void expand_kscales(const KScales& ks, int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t g = 0; g < ks.G; ++g) {
      __m512 ds, ms;
      ks.at(static_cast<int>(b), g, ds, ms);
      _mm512_store_ps(out + (b * ks.G + g) * 2 * kLanes, ds);
      _mm512_store_ps(out + ((b * ks.G + g) * 2 + 1) * kLanes, ms);
    }
}

// MB rows of quantized x against NB blocks of 16 channels of packed 4-bit weights:
// out = sum_g (d * dx_g) * dot_g(q, qx) + m * sx_g, d and m as `sc` gives them.
template <int MB, int NB, typename Scales, bool k5 = false>
void q4p_block(const int8_t* qx, const float* dx, const float* sx, int64_t K, const uint8_t* w,
               const Scales& sc, const uint8_t* pf, float* out) {
  const int64_t G = K / kGroup, block = K / 8 * chunk_bytes<k5>();
  __m512 acc[MB][NB];
  zero(acc);
  for (int64_t g = 0; g < G; ++g) {
    __m512i dot[MB][NB];
    zero(dot);
#pragma GCC unroll 4
    for (int64_t p = 0; p < kGroup / 8; ++p) {
      const int64_t k = g * kGroup + 8 * p;
      __m512i lo[NB], hi[NB];
      load_q4<NB, k5>(w, block, k, pf, lo, hi);
      for (int i = 0; i < MB; ++i) {
        const __m512i x0 = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(qx + i * K + k));
        const __m512i x1 = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(qx + i * K + k + 4));
        for (int b = 0; b < NB; ++b) {
          dot[i][b] = _mm512_dpbusd_epi32(dot[i][b], lo[b], x0);
          dot[i][b] = _mm512_dpbusd_epi32(dot[i][b], hi[b], x1);
        }
      }
    }
    __m512 ds[NB], ms[NB];
    if (pf)
      for (int b = 0; b < NB; ++b) sc.prefetch(b, g);
    for (int b = 0; b < NB; ++b) sc.at(b, g, ds[b], ms[b]);
    for (int i = 0; i < MB; ++i) {
      const __m512 dxi = _mm512_set1_ps(dx[i * G + g]), sxi = _mm512_set1_ps(sx[i * G + g]);
      for (int b = 0; b < NB; ++b) {
        acc[i][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][b]), _mm512_mul_ps(ds[b], dxi), acc[i][b]);
        acc[i][b] = _mm512_fmadd_ps(ms[b], sxi, acc[i][b]);
      }
    }
  }
  store(acc, out);
}

// MB rows of 16-bit x (hi, lo bytes; e, sx or sums per group) against NB blocks of 16 channels
// of packed weights. Q4: out = sum_g d e_g (256 dot_g(q, hi) + dot_g(q, lo)) + m sx_g. Int8 and
// Q8_0 (w + 128 stored, as i8p_block): out = sum_g e_g [dw] (dot_g(w + 128, X) - 128 sum(X)).
// d and m as `sc` gives them (F16Scales, KScales).
template <bool kQ4, int MB, int NB, typename Scales, bool k5 = false>
void x16p_block(const int8_t* hi, const int8_t* lo, const float* e, const float* sx, const int32_t* sums,
                int64_t K, const uint8_t* w, const Scales& sc, const uint8_t* pf, float* out,
                const int16_t* = nullptr) {  // (x as 16 bits: the AVX2 kernel's int8 layouts only)
  const int64_t G = K / kGroup, block = kQ4 ? K / 8 * chunk_bytes<k5>() : K * kLanes;
  __m512 acc[MB][NB];
  zero(acc);
  for (int64_t g = 0; g < G; ++g) {
    __m512i dh[MB][NB], dl[MB][NB];
    zero(dh);
    zero(dl);
    if constexpr (kQ4) {
#pragma GCC unroll 4
      for (int64_t p = 0; p < kGroup / 8; ++p) {
        const int64_t k = g * kGroup + 8 * p;
        __m512i w0[NB], w1[NB];
        load_q4<NB, k5>(w, block, k, pf, w0, w1);
        for (int i = 0; i < MB; ++i) {
          const __m512i h0 = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(hi + i * K + k));
          const __m512i h1 = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(hi + i * K + k + 4));
          const __m512i l0 = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(lo + i * K + k));
          const __m512i l1 = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(lo + i * K + k + 4));
          for (int b = 0; b < NB; ++b) {
            dh[i][b] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dh[i][b], w0[b], h0), w1[b], h1);
            dl[i][b] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dl[i][b], w0[b], l0), w1[b], l1);
          }
        }
      }
    } else {
#pragma GCC unroll 8
      for (int64_t j = 0; j < kGroup / 4; ++j) {
        const int64_t k = g * kGroup + 4 * j;
        __m512i wv[NB];
        for (int b = 0; b < NB; ++b) {
          wv[b] = _mm512_loadu_si512(w + b * block + k * kLanes);
          if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + b * block + k * kLanes), _MM_HINT_T0);
        }
        for (int i = 0; i < MB; ++i) {
          const __m512i h = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(hi + i * K + k));
          const __m512i l = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(lo + i * K + k));
          for (int b = 0; b < NB; ++b) {
            dh[i][b] = _mm512_dpbusd_epi32(dh[i][b], wv[b], h);
            dl[i][b] = _mm512_dpbusd_epi32(dl[i][b], wv[b], l);
          }
        }
      }
    }
    __m512 ds[NB], ms[NB];
    if (pf)
      for (int b = 0; b < NB; ++b) sc.prefetch(b, g);
    for (int b = 0; b < NB; ++b) sc.at(b, g, ds[b], ms[b]);
    for (int i = 0; i < MB; ++i) {
      const __m512 ei = _mm512_set1_ps(e[i * G + g]);
      const __m512i offset = _mm512_set1_epi32(kQ4 ? 0 : 128 * sums[i * G + g]);
      for (int b = 0; b < NB; ++b) {
        __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(dh[i][b], 8), dl[i][b]);
        if (!kQ4) dot = _mm512_sub_epi32(dot, offset);
        acc[i][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc.scaled() ? _mm512_mul_ps(ds[b], ei) : ei, acc[i][b]);
        if (kQ4) acc[i][b] = _mm512_fmadd_ps(ms[b], _mm512_set1_ps(sx[i * G + g]), acc[i][b]);
      }
    }
  }
  store(acc, out);
}

// Q6_K's 6-bit u = q + 32 (0..63) in the 4-bit layout's 64 bytes of low nibbles per 8 K-values
// of 16 channels (load_q4), then 32 bytes of their top two bits: 16 for the low-nibble vector's
// 64 bytes, 16 for the high-nibble one's. Each 16 are broadcast to the vector's four 128-bit lanes
// and every 32-bit element of lane L rotated right by 2L, which brings byte i's two bits to bits
// 4-5 (kernels.pack_q6_k writes them where the rotation finds them): two instructions a vector.
template <int NB>
inline void load_q6(const uint8_t* w, int64_t block, int64_t k, const uint8_t* pf, __m512i (&lo)[NB],
                    __m512i (&hi)[NB]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
  const __m512i turn = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
  const int64_t at = k / 8 * 96;
  for (int b = 0; b < NB; ++b) {
    const uint8_t* p = w + b * block + at;
    if (pf) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + b * block + at), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pf + b * block + at + 64), _MM_HINT_T0);
    }
    const __m512i v = _mm512_loadu_si512(p);
    const __m512i h0 = _mm512_rorv_epi32(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 64))), turn);
    const __m512i h1 = _mm512_rorv_epi32(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 80))), turn);
    lo[b] = _mm512_or_si512(_mm512_and_si512(v, low4), _mm512_and_si512(h0, top2));
    hi[b] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), _mm512_and_si512(h1, top2));
  }
}

// nb blocks of a Q6_K tile (block bytes each, from w; pf: the next tile's, prefetched alike)
// unpacked into out [nb][K / 8][kExpanded] (64-byte aligned): a prompt's rows then read each
// block's values as two loads, where every 4 rows unpacked them again (load_q6: 6 operations a
// vector). The same values, so the same products. A 1B prompt's Q6_K down pass 443-451 -> 422-426
// ms (512 tokens, Zen 5); the same for the 4-bit layouts (3 operations a vector) made Q4_K's
// gate/up slower, 711-715 -> 731-737: not done there.
void expand_q6(const uint8_t* w, int64_t block, int64_t nb, int64_t K, const uint8_t* pf, uint8_t* out) {
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t k = 0; k < K; k += 8) {
      __m512i lo[1], hi[1];
      load_q6<1>(w + b * block, block, k, pf ? pf + b * block : nullptr, lo, hi);
      uint8_t* o = out + (b * (K / 8) + k / 8) * kExpanded;
      _mm512_store_si512(o, lo[0]);
      _mm512_store_si512(o + 64, hi[0]);
    }
}

// The d sc products of nb blocks of a Q6_K tile (sc: its [nb][K / 16][16] int8, dd: its
// [nb][K / 256][16] float16) as floats, out [nb][K / 16][16], for q6p_block's kX path.
inline void expand_q6_scales(const int8_t* sc, const at::Half* dd, int64_t nb, int64_t K, float* out) {
  const int64_t H = K / 16, S = K / 256;
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t s16 = 0; s16 < H; ++s16) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dd + (b * S + s16 / 16) * kLanes)));
      const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + (b * H + s16) * kLanes))));
      _mm512_store_ps(out + (b * H + s16) * kLanes, _mm512_mul_ps(d, c));
    }
}

// Q6_K's layout (load_q6; a signed scale per 16 K-values, a float16 d per 256) against MB rows of
// 8-bit x (kX16 false: codes a, scale e per group of 32) or of 16-bit x in two bytes (a = hi,
// b = lo). Each half group has its own scale:
// out = sum_g sum_h d sc_h e_g (dot_h(u, X) - 32 sum_h X), hs holding the rows' sums of X per 16
// K-values (16-bit: 256 sum(hi) + sum(lo)); the -32 is taken off in integers, exactly.
// kX (a prompt's chunk: the tile's values unpacked by expand_q6): its scales too, d sc per 16
// K-values as floats in sv16 [NB][K / 16][16] (expand_q6_scales), the same products.
// The -32 sum starts the last integer chain instead of being subtracted from it (exact either way).
template <bool kX16, int MB, int NB, bool kX = false>
void q6p_block(const int8_t* a, const int8_t* bl, const float* e, const int32_t* hs, int64_t K, const uint8_t* w,
               const int8_t* sc, const at::Half* dd, const uint8_t* pf, float* out, const float* sv16 = nullptr) {
  const int64_t G = K / kGroup, H = K / 16, S = K / 256, block = K / 8 * (kX ? kExpanded : 96);
  __m512 acc[MB][NB];
  zero(acc);
  for (int64_t g = 0; g < G; ++g) {
    __m512 dv[NB];
    if (!kX && pf && g % 8 == 0) prefetch_q6_scales<NB>(sc, dd, H, S, g);  // (a decode step's tile)
    if constexpr (!kX)
      for (int b = 0; b < NB; ++b)
        dv[b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dd + (b * S + g / 8) * kLanes)));
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t s16 = 2 * g + h;
      __m512i dh[MB][NB], dl[MB][NB];
      for (int i = 0; i < MB; ++i) {
        const __m512i start = _mm512_set1_epi32(-32 * hs[i * H + s16]);
        for (int b = 0; b < NB; ++b) {
          dh[i][b] = kX16 ? _mm512_setzero_si512() : start;
          dl[i][b] = kX16 ? start : _mm512_setzero_si512();
        }
      }
#pragma GCC unroll 2
      for (int64_t p = 0; p < 2; ++p) {
        const int64_t k = g * kGroup + 16 * h + 8 * p;
        __m512i w0[NB], w1[NB];
        if constexpr (kX) load_x<NB>(w, block, k, w0, w1);
        else load_q6<NB>(w, block, k, pf, w0, w1);
        for (int i = 0; i < MB; ++i) {
          const __m512i a0 = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + i * K + k));
          const __m512i a1 = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + i * K + k + 4));
          for (int b = 0; b < NB; ++b) dh[i][b] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dh[i][b], w0[b], a0), w1[b], a1);
          if constexpr (kX16) {
            const __m512i b0 = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(bl + i * K + k));
            const __m512i b1 = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(bl + i * K + k + 4));
            for (int b = 0; b < NB; ++b) dl[i][b] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dl[i][b], w0[b], b0), w1[b], b1);
          }
        }
      }
      __m512 sv[NB];
      for (int b = 0; b < NB; ++b)
        sv[b] = kX ? _mm512_load_ps(sv16 + (b * H + s16) * kLanes)
                   : _mm512_mul_ps(dv[b], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + (b * H + s16) * kLanes)))));
      for (int i = 0; i < MB; ++i) {
        const __m512 ei = _mm512_set1_ps(e[i * G + g]);
        for (int b = 0; b < NB; ++b) {
          const __m512i dot = kX16 ? _mm512_add_epi32(_mm512_slli_epi32(dh[i][b], 8), dl[i][b]) : dh[i][b];
          acc[i][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sv[b], ei), acc[i][b]);
        }
      }
    }
  }
  store(acc, out);
}

// 16 channels of a block's result v into yr (or added to it), times int8's scale per channel (rs, or null).
inline void put16(const float* v, const float* rs, float* yr, bool accumulate) {
  __m512 x = _mm512_loadu_ps(v);
  if (rs) x = _mm512_mul_ps(x, _mm512_loadu_ps(rs));
  _mm512_storeu_ps(yr, accumulate ? _mm512_add_ps(_mm512_loadu_ps(yr), x) : x);
}

#elif defined(ARLM_PACKED)
// ---- The packed layouts on AVX2 (no AVX-512 VNNI) -------------------------------------------
//
// The same layouts as above, read by 256-bit vectors: a block's 16 channels are two vectors of 8
// (the first and second 32 bytes of each 64-byte step). AVX2 has no vpdpbusd; maddubs multiplies
// unsigned by signed bytes into int16 sums of pairs and madd(., 1) widens those to int32 sums of
// four: vpdpbusd's integer, exactly, where no int16 sum can saturate. Codes of at most 6 bits
// (4-bit, 5-bit, Q6_K's u) times bytes of x (|x| <= 128) give int16 sums of at most 2 * 63 * 128,
// so several maddubs add up in int16 before one madd (the bounds at each kernel). Int8 weights
// (w + 128, up to 255) would saturate: 8-bit x (|x| <= 127) takes w's sign onto x instead, 16-bit
// x's bytes split w + 128 into its low 7 bits and its top bit. Every integer dot product is the
// AVX-512 kernels' and the float work after it is theirs lane for lane, so each output is bit
// for bit what the AVX-512 build gives.

struct F16v {  // 16 float lanes: channels 0-7, 8-15 of a block
  __m256 h[2];
};
struct I16v {  // 16 int32 lanes
  __m256i h[2];
};

template <int MB, int NB>
inline void store(const F16v (&acc)[MB][NB], float* out) {
  for (int i = 0; i < MB; ++i)
    for (int b = 0; b < NB; ++b)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + (i * NB + b) * kLanes + 8 * h, acc[i][b].h[h]);
}

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i bcast4(const int8_t* p) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(p)); }
inline __m256i madd1(__m256i s16) { return _mm256_madd_epi16(s16, _mm256_set1_epi16(1)); }
inline __m256 half8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 byte8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// int8 layouts (w + 128 stored) times 8-bit x (|x| <= 127): dot(w, x) = maddubs(|w|, x * sign(w)),
// pairs at most 2 * 128 * 127; dot(w + 128, x) - 128 sum(x) in the AVX-512 kernel is that integer.
template <int MB, int NB>
void i8p_block(const int8_t* qx, const float* dx, const int32_t* qs, int64_t K, const uint8_t* w, const uint8_t* pf,
               float* out, const at::Half* dw = nullptr) {
  (void)qs;
  const int64_t G = K / kGroup, block = K * kLanes, sblock = G * kLanes;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  F16v acc[MB][NB];
  zero(acc);
  for (int64_t g = 0; g < G; ++g) {
    I16v dot[MB][NB];
    zero(dot);
#pragma GCC unroll 8
    for (int64_t j = 0; j < kGroup / 4; ++j) {
      const int64_t k = g * kGroup + 4 * j;
      __m256i ws[NB][2], wa[NB][2];
      for (int b = 0; b < NB; ++b) {
        if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + b * block + k * kLanes), _MM_HINT_T0);
        for (int h = 0; h < 2; ++h) {
          ws[b][h] = _mm256_xor_si256(load256(w + b * block + k * kLanes + 32 * h), flip);
          wa[b][h] = _mm256_abs_epi8(ws[b][h]);
        }
      }
      for (int i = 0; i < MB; ++i) {
        const __m256i xb = bcast4(qx + i * K + k);
        for (int b = 0; b < NB; ++b)
          for (int h = 0; h < 2; ++h)
            dot[i][b].h[h] = _mm256_add_epi32(
                dot[i][b].h[h], madd1(_mm256_maddubs_epi16(wa[b][h], _mm256_sign_epi8(xb, ws[b][h]))));
      }
    }
    F16v ds[NB];
    if (dw)
      for (int b = 0; b < NB; ++b)
        for (int h = 0; h < 2; ++h) ds[b].h[h] = half8(dw + b * sblock + g * kLanes + 8 * h);
    for (int i = 0; i < MB; ++i) {
      const __m256 s = _mm256_set1_ps(dx[i * G + g]);
      for (int b = 0; b < NB; ++b)
        for (int h = 0; h < 2; ++h)
          acc[i][b].h[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][b].h[h]), dw ? _mm256_mul_ps(ds[b].h[h], s) : s,
                                           acc[i][b].h[h]);
    }
  }
  store(acc, out);
}

// 32 bits -> 32 bytes, byte i 16 where bit i is set, else 0.
inline __m256i sixteens(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// load_q4 of the AVX-512 section, as two halves of 32 bytes (channels 0-7, 8-15).
template <int NB, bool k5 = false>
inline void load_q4(const uint8_t* w, int64_t block, int64_t k, const uint8_t* pf, __m256i (&lo)[NB][2],
                    __m256i (&hi)[NB][2]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const int64_t at = k / 8 * chunk_bytes<k5>();
  for (int b = 0; b < NB; ++b) {
    const uint8_t* p = w + b * block + at;
    if (pf) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + b * block + at), _MM_HINT_T0);
      if (k5) _mm_prefetch(reinterpret_cast<const char*>(pf + b * block + at + 64), _MM_HINT_T0);
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i v = load256(p + 32 * h);
      lo[b][h] = _mm256_and_si256(v, low4);
      hi[b][h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      if constexpr (k5) {
        uint32_t m0, m1;
        std::memcpy(&m0, p + 64 + 4 * h, 4);
        std::memcpy(&m1, p + 72 + 4 * h, 4);
        lo[b][h] = _mm256_add_epi8(lo[b][h], sixteens(m0));
        hi[b][h] = _mm256_add_epi8(hi[b][h], sixteens(m1));
      }
    }
  }
}

struct F16Scales {
  const at::Half *d, *m;
  int64_t G;
  float m_per_d = 0.f;
  bool scaled() const { return d != nullptr; }
  void at(int b, int64_t g, F16v& ds, F16v& ms) const {
    for (int h = 0; h < 2; ++h) {
      if (d) ds.h[h] = half8(d + (b * G + g) * kLanes + 8 * h);
      if (m) ms.h[h] = half8(m + (b * G + g) * kLanes + 8 * h);
      else if (m_per_d != 0.f) ms.h[h] = _mm256_mul_ps(ds.h[h], _mm256_set1_ps(m_per_d));
    }
  }
};

struct KScales {  // (the AVX-512 build's, 32 bytes at a time: see it for the layout and the order of calls)
  const uint8_t* sm;
  const at::Half* dd;
  int64_t G;
  mutable uint8_t bytes[2][256] __attribute__((aligned(32)));
  mutable F16v d[2], neg_dmin[2];
  KScales(const uint8_t* sm, const at::Half* dd, int64_t G) : sm(sm), dd(dd), G(G) {}
  static KScales of(const void* kscale, const at::Half* supers, int64_t b0, int64_t G) {
    return {static_cast<const uint8_t*>(kscale) + b0 * (G / 8) * kKScaleBytes, supers + b0 * (G / 8) * 2 * kLanes, G};
  }
  bool scaled() const { return true; }
  void unpack(int b, int64_t super) const {
    const at::Half* ds = dd + (b * (G / 8) + super) * 2 * kLanes;
    for (int h = 0; h < 2; ++h) {
      d[b].h[h] = half8(ds + 8 * h);
      neg_dmin[b].h[h] = _mm256_sub_ps(_mm256_setzero_ps(), half8(ds + kLanes + 8 * h));
    }
    const uint8_t* p = sm + (b * (G / 8) + super) * kKScaleBytes;
    prefetch_kscales(p, ds);
    const __m256i x0f = _mm256_set1_epi8(0x0F), x30 = _mm256_set1_epi8(0x30);
    const __m256i x03 = _mm256_set1_epi8(0x03), x0c = _mm256_set1_epi8(0x0C);
    for (int h = 0; h < 2; ++h) {
      auto load = [&](int at) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + at + 32 * h)); };
      auto put = [&](int at, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(bytes[b] + at + 32 * h), v); };
      const __m256i low0 = load(0), low1 = load(64), top = load(128);
      put(0, _mm256_or_si256(_mm256_and_si256(low0, x0f), _mm256_slli_epi16(_mm256_and_si256(top, x03), 4)));
      put(64, _mm256_or_si256(_mm256_and_si256(low1, x0f), _mm256_and_si256(top, x30)));
      put(128, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low0, 4), x0f),
                               _mm256_slli_epi16(_mm256_and_si256(top, x0c), 2)));
      put(192, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low1, 4), x0f),
                               _mm256_and_si256(_mm256_srli_epi16(top, 2), x30)));
    }
  }
  void at(int b, int64_t g, F16v& ds, F16v& ms) const {
    if (g % 8 == 0) unpack(b, g / 8);
    const uint8_t* s = bytes[b] + 16 * (g % 8);
    for (int h = 0; h < 2; ++h) {
      ds.h[h] = _mm256_mul_ps(d[b].h[h], byte8(s + 8 * h));
      ms.h[h] = _mm256_mul_ps(neg_dmin[b].h[h], byte8(s + 128 + 8 * h));
    }
  }
};

// Steps of 8 K-values whose maddubs sums stay in int16 before one madd: 4-bit codes (<= 15) times
// bytes (|x| <= 128) are at most 2 * 15 * 128 per step and two maddubs a step: 4 steps (30,720);
// 5-bit (<= 31): 2 steps (31,744).
template <bool k5>
constexpr int64_t steps_in_int16() { return k5 ? 2 : 4; }

template <int MB, int NB, typename Scales, bool k5 = false>
void q4p_block(const int8_t* qx, const float* dx, const float* sx, int64_t K, const uint8_t* w,
               const Scales& sc, const uint8_t* pf, float* out) {
  const int64_t G = K / kGroup, block = K / 8 * chunk_bytes<k5>();
  F16v acc[MB][NB];
  zero(acc);
  for (int64_t g = 0; g < G; ++g) {
    I16v dot[MB][NB], s16[MB][NB];
    zero(dot);
    zero(s16);
#pragma GCC unroll 4
    for (int64_t p = 0; p < kGroup / 8; ++p) {
      const int64_t k = g * kGroup + 8 * p;
      __m256i lo[NB][2], hi[NB][2];
      load_q4<NB, k5>(w, block, k, pf, lo, hi);
      for (int i = 0; i < MB; ++i) {
        const __m256i x0 = bcast4(qx + i * K + k), x1 = bcast4(qx + i * K + k + 4);
        for (int b = 0; b < NB; ++b)
          for (int h = 0; h < 2; ++h)
            s16[i][b].h[h] = _mm256_add_epi16(s16[i][b].h[h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[b][h], x0),
                                                                               _mm256_maddubs_epi16(hi[b][h], x1)));
      }
      if ((p + 1) % steps_in_int16<k5>() == 0)
        for (int i = 0; i < MB; ++i)
          for (int b = 0; b < NB; ++b)
            for (int h = 0; h < 2; ++h) {
              dot[i][b].h[h] = _mm256_add_epi32(dot[i][b].h[h], madd1(s16[i][b].h[h]));
              s16[i][b].h[h] = _mm256_setzero_si256();
            }
    }
    F16v ds[NB], ms[NB];
    for (int b = 0; b < NB; ++b) sc.at(b, g, ds[b], ms[b]);
    for (int i = 0; i < MB; ++i) {
      const __m256 dxi = _mm256_set1_ps(dx[i * G + g]), sxi = _mm256_set1_ps(sx[i * G + g]);
      for (int b = 0; b < NB; ++b)
        for (int h = 0; h < 2; ++h) {
          acc[i][b].h[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][b].h[h]), _mm256_mul_ps(ds[b].h[h], dxi),
                                           acc[i][b].h[h]);
          acc[i][b].h[h] = _mm256_fmadd_ps(ms[b].h[h], sxi, acc[i][b].h[h]);
        }
    }
  }
  store(acc, out);
}

// x16p_block of the AVX-512 section. 4-bit and 5-bit codes: as q4p_block, for x's two bytes.
// Int8 layouts: x as the 16-bit X itself (x16: X = 256 hi + lo, [M, K] int16) times w widened to
// int16, by madd: per 4 K-values of 4 channels, two int32 sums of two products (|127 * 32512| each),
// added over the group and then pairwise (hadd): dot(w, X) = 256 dh + dl - 128 sum(X), the
// AVX-512 kernel's integer, in 4 operations per 32 products instead of maddubs' 10.
template <bool kQ4, int MB, int NB, typename Scales, bool k5 = false>
void x16p_block(const int8_t* hi, const int8_t* lo, const float* e, const float* sx, const int32_t* sums,
                int64_t K, const uint8_t* w, const Scales& sc, const uint8_t* pf, float* out,
                const int16_t* x16 = nullptr) {
  const int64_t G = K / kGroup, block = kQ4 ? K / 8 * chunk_bytes<k5>() : K * kLanes;
  F16v acc[MB][NB];
  zero(acc);
  for (int64_t g = 0; g < G; ++g) {
    I16v dh[MB][NB], dl[MB][NB], sh[MB][NB], sl[MB][NB];
    zero(dh);
    zero(dl);
    zero(sh);
    zero(sl);
    if constexpr (kQ4) {
#pragma GCC unroll 4
      for (int64_t p = 0; p < kGroup / 8; ++p) {
        const int64_t k = g * kGroup + 8 * p;
        __m256i w0[NB][2], w1[NB][2];
        load_q4<NB, k5>(w, block, k, pf, w0, w1);
        for (int i = 0; i < MB; ++i) {
          const __m256i h0 = bcast4(hi + i * K + k), h1 = bcast4(hi + i * K + k + 4);
          const __m256i l0 = bcast4(lo + i * K + k), l1 = bcast4(lo + i * K + k + 4);
          for (int b = 0; b < NB; ++b)
            for (int h = 0; h < 2; ++h) {
              sh[i][b].h[h] = _mm256_add_epi16(sh[i][b].h[h], _mm256_add_epi16(_mm256_maddubs_epi16(w0[b][h], h0),
                                                                               _mm256_maddubs_epi16(w1[b][h], h1)));
              sl[i][b].h[h] = _mm256_add_epi16(sl[i][b].h[h], _mm256_add_epi16(_mm256_maddubs_epi16(w0[b][h], l0),
                                                                               _mm256_maddubs_epi16(w1[b][h], l1)));
            }
        }
        if ((p + 1) % steps_in_int16<k5>() == 0)
          for (int i = 0; i < MB; ++i)
            for (int b = 0; b < NB; ++b)
              for (int h = 0; h < 2; ++h) {
                dh[i][b].h[h] = _mm256_add_epi32(dh[i][b].h[h], madd1(sh[i][b].h[h]));
                dl[i][b].h[h] = _mm256_add_epi32(dl[i][b].h[h], madd1(sl[i][b].h[h]));
                sh[i][b].h[h] = sl[i][b].h[h] = _mm256_setzero_si256();
              }
      }
    } else {  // sh, sl here hold int32 pair sums (channels 0-3, 4-7 of a half); dh gets dot(w, X)
              // itself after the hadd, dl stays unused, and no 128 sum(X) offset comes off below
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 8
      for (int64_t j = 0; j < kGroup / 4; ++j) {
        const int64_t k = g * kGroup + 4 * j;
        __m256i w16[NB][4];  // channels 0-3, 4-7, 8-11, 12-15: 4 K-values each as int16
        for (int b = 0; b < NB; ++b) {
          if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + b * block + k * kLanes), _MM_HINT_T0);
          for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_xor_si256(load256(w + b * block + k * kLanes + 32 * h), flip);
            w16[b][2 * h] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
            w16[b][2 * h + 1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
          }
        }
        for (int i = 0; i < MB; ++i) {
          int64_t quad;
          std::memcpy(&quad, x16 + i * K + k, 8);
          const __m256i xb = _mm256_set1_epi64x(quad);
          for (int b = 0; b < NB; ++b)
            for (int h = 0; h < 2; ++h) {
              sh[i][b].h[h] = _mm256_add_epi32(sh[i][b].h[h], _mm256_madd_epi16(w16[b][2 * h], xb));
              sl[i][b].h[h] = _mm256_add_epi32(sl[i][b].h[h], _mm256_madd_epi16(w16[b][2 * h + 1], xb));
            }
        }
      }
      // [c0 c0 c1 c1 c2 c2 c3 c3] and [c4 c4 ... c7 c7] -> hadd [c0 c1 c4 c5 | c2 c3 c6 c7] -> in order
      for (int i = 0; i < MB; ++i)
        for (int b = 0; b < NB; ++b)
          for (int h = 0; h < 2; ++h)
            dh[i][b].h[h] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(sh[i][b].h[h], sl[i][b].h[h]), 0xD8);
    }
    F16v ds[NB], ms[NB];
    for (int b = 0; b < NB; ++b) sc.at(b, g, ds[b], ms[b]);
    for (int i = 0; i < MB; ++i) {
      const __m256 ei = _mm256_set1_ps(e[i * G + g]);
      for (int b = 0; b < NB; ++b)
        for (int h = 0; h < 2; ++h) {
          const __m256i dot = kQ4 ? _mm256_add_epi32(_mm256_slli_epi32(dh[i][b].h[h], 8), dl[i][b].h[h]) : dh[i][b].h[h];
          acc[i][b].h[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sc.scaled() ? _mm256_mul_ps(ds[b].h[h], ei) : ei,
                                           acc[i][b].h[h]);
          if (kQ4) acc[i][b].h[h] = _mm256_fmadd_ps(ms[b].h[h], _mm256_set1_ps(sx[i * G + g]), acc[i][b].h[h]);
        }
    }
  }
  store(acc, out);
}

// load_q6 of the AVX-512 section as two halves: half h holds the 512-bit vector's 128-bit lanes
// 2h and 2h + 1, whose 32-bit elements that rotates right by 4h and 4h + 2 before the mask 0x30
// keeps bits 4-5 of each byte. Without AVX-512's rorv, the same bits in fewer operations: half 0
// (0 and 2) by a right shift alone (no byte's bits 4-5 come from past its element's top), half 1
// (4 and 6: bits 0-1 or 2-3 of the next byte of the element, the top byte's from the bottom one)
// by the bytes rotated one place in each element, then shifted left by 4 or 2 bits.
template <int NB>
inline void load_q6(const uint8_t* w, int64_t block, int64_t k, const uint8_t* pf, __m256i (&lo)[NB][2],
                    __m256i (&hi)[NB][2]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
  const __m256i right = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2), left = _mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2);
  const __m256i next_byte = _mm256_setr_epi8(1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12,
                                             1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12);
  auto turned = [&](__m256i t, int h) {
    return h == 0 ? _mm256_srlv_epi32(t, right) : _mm256_sllv_epi32(_mm256_shuffle_epi8(t, next_byte), left);
  };
  const int64_t at = k / 8 * 96;
  for (int b = 0; b < NB; ++b) {
    const uint8_t* p = w + b * block + at;
    if (pf) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + b * block + at), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pf + b * block + at + 64), _MM_HINT_T0);
    }
    const __m256i t0 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 64)));
    const __m256i t1 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 80)));
    for (int h = 0; h < 2; ++h) {
      const __m256i v = load256(p + 32 * h);
      lo[b][h] = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(turned(t0, h), top2));
      hi[b][h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), _mm256_and_si256(turned(t1, h), top2));
    }
  }
}

// q6p_block of the AVX-512 section: u <= 63, so one step's two maddubs sum in int16 (at most
// 2 * 2 * 63 * 128 = 32,256), then madd.
template <bool kX16, int MB, int NB, bool kX = false>
void q6p_block(const int8_t* a, const int8_t* bl, const float* e, const int32_t* hs, int64_t K, const uint8_t* w,
               const int8_t* sc, const at::Half* dd, const uint8_t* pf, float* out, const float* = nullptr) {
  static_assert(!kX, "unpacked Q6_K tiles (expand_q6): AVX-512 builds only");
  const int64_t G = K / kGroup, H = K / 16, S = K / 256, block = K / 8 * 96;
  F16v acc[MB][NB];
  zero(acc);
  for (int64_t g = 0; g < G; ++g) {
    F16v dv[NB];
    if (pf && g % 8 == 0) prefetch_q6_scales<NB>(sc, dd, H, S, g);  // (a decode step's tile)
    for (int b = 0; b < NB; ++b)
      for (int h = 0; h < 2; ++h) dv[b].h[h] = half8(dd + (b * S + g / 8) * kLanes + 8 * h);
    for (int64_t hh = 0; hh < 2; ++hh) {
      I16v dh[MB][NB], dl[MB][NB];
      zero(dh);
      zero(dl);
#pragma GCC unroll 2
      for (int64_t p = 0; p < 2; ++p) {
        const int64_t k = g * kGroup + 16 * hh + 8 * p;
        __m256i w0[NB][2], w1[NB][2];
        load_q6<NB>(w, block, k, pf, w0, w1);
        for (int i = 0; i < MB; ++i) {
          const __m256i a0 = bcast4(a + i * K + k), a1 = bcast4(a + i * K + k + 4);
          for (int b = 0; b < NB; ++b)
            for (int h = 0; h < 2; ++h)
              dh[i][b].h[h] = _mm256_add_epi32(dh[i][b].h[h], madd1(_mm256_add_epi16(_mm256_maddubs_epi16(w0[b][h], a0),
                                                                                     _mm256_maddubs_epi16(w1[b][h], a1))));
          if constexpr (kX16) {
            const __m256i b0 = bcast4(bl + i * K + k), b1 = bcast4(bl + i * K + k + 4);
            for (int b = 0; b < NB; ++b)
              for (int h = 0; h < 2; ++h)
                dl[i][b].h[h] = _mm256_add_epi32(dl[i][b].h[h], madd1(_mm256_add_epi16(_mm256_maddubs_epi16(w0[b][h], b0),
                                                                                       _mm256_maddubs_epi16(w1[b][h], b1))));
          }
        }
      }
      const int64_t s16 = 2 * g + hh;
      F16v sv[NB];
      for (int b = 0; b < NB; ++b)
        for (int h = 0; h < 2; ++h)
          sv[b].h[h] = _mm256_mul_ps(dv[b].h[h], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                                     reinterpret_cast<const __m128i*>(sc + (b * H + s16) * kLanes + 8 * h)))));
      for (int i = 0; i < MB; ++i) {
        const __m256 ei = _mm256_set1_ps(e[i * G + g]);
        const __m256i corr = _mm256_set1_epi32(32 * hs[i * H + s16]);
        for (int b = 0; b < NB; ++b)
          for (int h = 0; h < 2; ++h) {
            __m256i dot = kX16 ? _mm256_add_epi32(_mm256_slli_epi32(dh[i][b].h[h], 8), dl[i][b].h[h]) : dh[i][b].h[h];
            dot = _mm256_sub_epi32(dot, corr);
            acc[i][b].h[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sv[b].h[h], ei), acc[i][b].h[h]);
          }
      }
    }
  }
  store(acc, out);
}

// 16 channels of a block's result v into yr (or added to it), times int8's scale per channel (rs, or null).
inline void put16(const float* v, const float* rs, float* yr, bool accumulate) {
  for (int h = 0; h < 2; ++h) {
    __m256 x = _mm256_loadu_ps(v + 8 * h);
    if (rs) x = _mm256_mul_ps(x, _mm256_loadu_ps(rs + 8 * h));
    _mm256_storeu_ps(yr + 8 * h, accumulate ? _mm256_add_ps(_mm256_loadu_ps(yr + 8 * h), x) : x);
  }
}

#endif

#ifdef ARLM_AVX512
constexpr int kPackedRows = kBlockRows;  // rows of x per call of a packed kernel, at most
constexpr int64_t kTileBlocks = 2;       // blocks of 16 channels per tile (a thread's unit of work), at most
#else
// AVX2 has 16 vector registers, not 32: a tile of one block and two rows keeps x16p_block's int16
// and int32 sums, the weights and x's bytes in registers (two blocks and four rows spilled).
constexpr int kPackedRows = 2;
constexpr int64_t kTileBlocks = 1;
#endif
// A decode step (rows of x no more than one call takes) goes through its weights one block a
// tile: each thread's blocks are then one sequential stream. Two blocks a tile are two streams a
// block apart, which the hardware prefetchers follow less well: on a Zen 5, 2 threads, a plain
// read of 800 MB ran at 95-97 GB/s as one stream a thread and at 87-92 GB/s as two with the
// next-tile prefetch, 75-84 without (benchmarks/read_streams.py); the 1B Q4_K_M decode step went from 12.6 to
// 11.3 ms. More rows share each loaded weight vector over both blocks of a wider tile (prompts).
inline int64_t tile_blocks(int64_t M) { return M <= kPackedRows ? 1 : kTileBlocks; }
// The first rows of a tile prefetch the weights ahead of those they read. A decode step's tiles
// of one block (AVX-512): 4 KB ahead took the 1B Q4_K_M step to 10.0-10.5 ms where the next tile
// (16-64 KB ahead) gave 11.3, 8 KB 10.8, 2 KB 11.1 and none 15.5 (Zen 5, benchmarks/phases.py);
// Q6_K's layers (the head) and Q8_0's gave the same from 2 to 8 KB within the host's noise
// (+-5%). Wider tiles (more rows) prefetch the whole next tile: 4 KB ahead there slowed a batch of
// 8 by 5% (SmolLM2) and 19% (Gemma 3 270M). AVX2 keeps the next tile, as tuned on a Zen 3 (its
// build on the Zen 5 is bound by its arithmetic: 14.0 ms a 1B step either way).
inline const uint8_t* prefetch_from(const uint8_t* tile, int64_t blocks, int64_t block_bytes, bool last) {
#ifdef ARLM_AVX512
  if (blocks == 1) return tile + 4096;
#endif
  return last ? nullptr : tile + blocks * block_bytes;
}

// A thread's first 4 KB of a one-block-a-tile stream, which no tile before it prefetched: the 1B
// step 10.1 -> 9.75 ms at Q4_K_M, 19.2 -> 17.4 at Q8_0 (medians of 3 alternated, Zen 5; 8 KB
// gave no more, nor the scales' first lines).
inline void prefetch_start(const uint8_t* stream, int64_t blocks) {
#ifdef ARLM_AVX512
  if (blocks == 1)
    for (int64_t o = 0; o < 4096; o += 64) _mm_prefetch(reinterpret_cast<const char*>(stream + o), _MM_HINT_T0);
#else
  (void)stream;
  (void)blocks;
#endif
}

// The packed layouts (above), told apart by their tensors' shapes and types.
// kQ4_0: the 4-bit layout with Q4_1's float16 scale and no mins stored (m = -8 d: a Q4_0 file's).
enum class Packed { kInt8, kQ8_0, kQ4_1, kQ4_0, kQ4_K, kQ6_K, kQ5, kQ5_K };

Packed packed_kind(int64_t K, const at::Tensor& wp, const at::Tensor& scale, const at::Tensor& mins) {
  if (wp.size(2) == 6 * kLanes) return Packed::kQ6_K;
  if (wp.size(2) == 5 * kLanes) return scale.scalar_type() == at::kByte ? Packed::kQ5_K : Packed::kQ5;
  if (scale.dim() == 1) return Packed::kInt8;
  if (wp.size(1) == K / 8)
    return scale.scalar_type() == at::kByte ? Packed::kQ4_K : mins.numel() ? Packed::kQ4_1 : Packed::kQ4_0;
  return Packed::kQ8_0;
}

// Each row's sums of x per 16 values (Q6_K's half groups): x as 8-bit codes q, or 16 bits as
// 256 hi + lo (lo given).
void half_sums(const int8_t* q, const int8_t* lo, int64_t M, int64_t K, int32_t* out) {
  at::parallel_for(0, M * (K / 16), 1024, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      int32_t hi_sum = 0, lo_sum = 0;
      for (int64_t j = 0; j < 16; ++j) {
        hi_sum += q[s * 16 + j];
        if (lo) lo_sum += lo[s * 16 + j];
      }
      out[s] = lo ? 256 * hi_sum + lo_sum : hi_sum;
    }
  });
}

// ---- AMX tiles: the prompt's rows 16 at a time (linear_a8p_residual) --------------------------
//
// On CPUs with AMX-INT8 one tile instruction (tdpbsud: signed bytes of x by unsigned weight bytes)
// takes the integer dot products of 16 rows of x by 16 channels over a group, 16 x 8 vpdpbusd's
// work. The packed layouts' weight vectors are already its B operand (16 channels x 4
// consecutive K-values a 64-byte row): a group's B tile is the vectors load_q4 / load_q6 return,
// stored (int8 and Q8_0: the packed bytes as they lie). Each group's int32 dot products are the
// VNNI kernels', and the float work after them (convert, scale, accumulate in group order) is
// x16p_block's and q6p_block's op for op: a row's result is bit for bit the same whichever kernel
// ran it, so the number of rows (and so batching) still changes nothing. Rows past the last full
// 16 go through those kernels.
#ifdef ARLM_AMX

// Linux grants the tile registers' state only to a process that asks (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); asked once. Off unless ARLM_AMX=1: measured beside
// the VNNI kernels the tiles gave a whole prefill 0.88-1.02x (3B Q4_K_M, 2 threads) and a Q6_K
// layer at K = 8,192 ~0.65-0.9x: the per-group float work, the same in both, is the time
// (docs/benchmarks.md, "The sizes users run").
bool amx_ready() {
  static const bool ready = [] {
    const char* env = std::getenv("ARLM_AMX");
    if (!env || std::strcmp(env, "1") != 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ready;
}

// Tiles 0, 1: 16 rows of x's high and low bytes, kk K-values; 2, 3: B of two blocks of 16
// channels (kk / 4 rows of 64 bytes); 4-7: their int32 products (hi b0, lo b0, hi b1, lo b1).
void configure_tiles(int kk) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t : {0, 1}) cfg.rows[t] = 16, cfg.colsb[t] = static_cast<uint16_t>(kk);
  for (int t : {2, 3}) cfg.rows[t] = static_cast<uint8_t>(kk / 4), cfg.colsb[t] = 64;
  for (int t = 4; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  // (GCC may drop the stores above otherwise: it does not model ldtilecfg's read of cfg; a build
  // of an out-of-line copy of this function loaded a zero configuration and faulted at the first tile)
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// One packed layer as linear_a8p_residual reads it, and x as 16 bits in two bytes.
struct X16Layer {
  Packed kind;
  int64_t K, G, H, S, block;
  const uint8_t* w;
  const float* rs;  // int8: the scale per row
  F16Scales fs;     // at the tile's first block (set per tile)
  const uint8_t* ksc;
  const at::Half* supers;
  const int8_t *hi, *lo;
  const float *e, *sx;
  const int32_t *sums, *hs;
};

// Rows m0 .. m0 + R (R a multiple of 16) of the tile of nb blocks from block b0, into acc [R][nb*16].
void amx_tile(const X16Layer& L, int64_t m0, int64_t R, int64_t b0, int64_t nb, float* acc) {
  const int64_t K = L.K, G = L.G, ld = nb * kLanes;
  const uint8_t* wt = L.w + b0 * L.block;
  const bool q6 = L.kind == Packed::kQ6_K, k5 = L.kind == Packed::kQ5 || L.kind == Packed::kQ5_K;
  const bool kq4 = L.kind == Packed::kQ4_K || L.kind == Packed::kQ5_K;
  const bool q4 = kq4 || L.kind == Packed::kQ4_1 || L.kind == Packed::kQ4_0 || L.kind == Packed::kQ5;
  alignas(64) uint8_t bt[2][8][64];   // a group's (Q6_K: a half group's) B tiles
  alignas(64) int32_t c[4][16][16];   // their products with 16 rows
  std::fill(acc, acc + R * ld, 0.f);
  auto products = [&](int64_t k, const uint8_t* b0p, const uint8_t* b1p, int64_t stride, int64_t r) {
    _tile_loadd(2, b0p, stride);
    if (nb == 2) _tile_loadd(3, b1p, stride);
    _tile_loadd(0, L.hi + (m0 + r) * K + k, K);
    _tile_loadd(1, L.lo + (m0 + r) * K + k, K);
    _tile_zero(4);
    _tile_zero(5);
    _tile_dpbsud(4, 0, 2);
    _tile_dpbsud(5, 1, 2);
    _tile_stored(4, c[0], 64);
    _tile_stored(5, c[1], 64);
    if (nb == 2) {
      _tile_zero(6);
      _tile_zero(7);
      _tile_dpbsud(6, 0, 3);
      _tile_dpbsud(7, 1, 3);
      _tile_stored(6, c[2], 64);
      _tile_stored(7, c[3], 64);
    }
  };
  auto dot = [&](int b, int i) {
    return _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c[2 * b][i]), 8), _mm512_load_si512(c[2 * b + 1][i]));
  };
  if (q6) {
    configure_tiles(16);
    const int8_t* sc = reinterpret_cast<const int8_t*>(L.ksc) + b0 * L.H * kLanes;
    const at::Half* dd = L.supers + b0 * L.S * kLanes;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t k = g * kGroup + 16 * h, s16 = 2 * g + h;
        __m512 sv[2];
        for (int64_t b = 0; b < nb; ++b) {
          for (int64_t p = 0; p < 2; ++p) {
            __m512i w0[1], w1[1];
            load_q6<1>(wt + b * L.block, L.block, k + 8 * p, nullptr, w0, w1);
            _mm512_store_si512(bt[b][2 * p], w0[0]);
            _mm512_store_si512(bt[b][2 * p + 1], w1[0]);
          }
          const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dd + (b * L.S + g / 8) * kLanes)));
          sv[b] = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + (b * L.H + s16) * kLanes)))));
        }
        for (int64_t r = 0; r < R; r += 16) {
          products(k, bt[0][0], bt[1][0], 64, r);
          for (int i = 0; i < 16; ++i) {
            const int64_t m = m0 + r + i;
            const __m512 ei = _mm512_set1_ps(L.e[m * G + g]);
            const __m512i corr = _mm512_set1_epi32(32 * L.hs[m * L.H + s16]);
            for (int64_t b = 0; b < nb; ++b) {
              float* a = acc + (r + i) * ld + b * kLanes;
              const __m512i d = _mm512_sub_epi32(dot(b, i), corr);
              _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sv[b], ei), _mm512_loadu_ps(a)));
            }
          }
        }
      }
    return;
  }
  configure_tiles(kGroup);
  const KScales ks = KScales::of(L.ksc, L.supers, b0, G);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k = g * kGroup;
    __m512 ds[2], ms[2];
    const uint8_t *b0p = bt[0][0], *b1p = bt[1][0];
    for (int64_t b = 0; b < nb; ++b) {
      if (kq4) ks.at(b, g, ds[b], ms[b]);
      else L.fs.at(b, g, ds[b], ms[b]);
      if (!q4) continue;
      for (int64_t p = 0; p < kGroup / 8; ++p) {
        __m512i w0[1], w1[1];
        if (k5) load_q4<1, true>(wt + b * L.block, L.block, k + 8 * p, nullptr, w0, w1);
        else load_q4<1>(wt + b * L.block, L.block, k + 8 * p, nullptr, w0, w1);
        _mm512_store_si512(bt[b][2 * p], w0[0]);
        _mm512_store_si512(bt[b][2 * p + 1], w1[0]);
      }
    }
    if (!q4) b0p = wt + k * kLanes, b1p = b0p + L.block;  // int8 / Q8_0: the packed bytes are the tile
    const bool scaled = kq4 || L.fs.scaled();
    for (int64_t r = 0; r < R; r += 16) {
      products(k, b0p, b1p, 64, r);
      for (int i = 0; i < 16; ++i) {
        const int64_t m = m0 + r + i;
        const __m512 ei = _mm512_set1_ps(L.e[m * G + g]);
        const __m512i offset = _mm512_set1_epi32(q4 ? 0 : 128 * L.sums[m * G + g]);
        for (int64_t b = 0; b < nb; ++b) {
          float* a = acc + (r + i) * ld + b * kLanes;
          __m512i d = dot(b, i);
          if (!q4) d = _mm512_sub_epi32(d, offset);
          __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scaled ? _mm512_mul_ps(ds[b], ei) : ei, _mm512_loadu_ps(a));
          if (q4) v = _mm512_fmadd_ps(ms[b], _mm512_set1_ps(L.sx[m * G + g]), v);
          _mm512_storeu_ps(a, v);
        }
      }
    }
  }
}
#endif  // ARLM_AMX
}  // namespace

#ifndef ARLM_BARE  // (ops that return new tensors: torch's build only)
at::Tensor q4_linear_a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& mins) {
  arlm_kernels::check_q4("q4_linear_a8", x, w, scale, mins);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), G = K / kGroup;
  const QuantizedX xq(x);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kRows - 1) / kRows;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> d(kRows * G), mn(kRows * G);  // one tile's scales, widened once
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * kRows, rows = std::min(kRows, N - n);
      arlm_kernels::scales_f32(scale, n * G, rows * G, d.data());
      arlm_kernels::scales_f32(mins, n * G, rows * G, mn.data());
      const uint8_t* wt = wp + n * (K / 2);
      const int8_t* q = xq.q.get();
      const float *dx = xq.d.get(), *sx = xq.s.get();
#if defined(__AVX2__) && defined(__FMA__)
      if (rows == kRows) {
        float out[kBlockRows * kRows];
        auto store = [&](int64_t m, int mb) {
          for (int i = 0; i < mb; ++i)
            for (int r = 0; r < kRows; ++r) yp[(m + i) * N + n + r] = out[i * kRows + r];
        };
        row_blocks(M, [&](auto mb, int64_t m) {
          q4_block<decltype(mb)::value>(q + m * K, dx + m * G, sx + m * G, K, wt, d.data(), mn.data(), out);
          store(m, decltype(mb)::value);
        });
        continue;
      }
#endif
      for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < rows; ++r)
          yp[m * N + n + r] = q4_scalar(q + m * K, dx + m * G, sx + m * G, K, wt + r * (K / 2),
                                        d.data() + r * G, mn.data() + r * G);
    }
  });
  return y;
}

at::Tensor int8_linear_a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  arlm_kernels::check_int8("int8_linear_a8", x, w, scale, true);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), G = K / kGroup;
  const QuantizedX xq(x);
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  // Q8_0: scale [N, G] float16; float32 [N, G] or [N, 2G] (Q6_K's d sc per 16: half16)
  const bool grouped = arlm_kernels::group_scales(scale);
  const bool half16 = grouped && arlm_kernels::scale_group(scale, K) == 16;
  const int64_t GS = half16 ? 2 * G : G;  // group scales per row
  const float* sp = grouped ? nullptr : scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kRows - 1) / kRows;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> dw(grouped ? kRows * GS : 0);  // one tile's group scales, widened once
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * kRows, rows = std::min(kRows, N - n);
      const int8_t* wt = wp + n * K;
      const int8_t* q = xq.q.get();
      const float* dx = xq.d.get();
      if (grouped) arlm_kernels::scales_f32(scale, n * GS, rows * GS, dw.data());
      auto row_scale = [&](int64_t r) { return grouped ? 1.f : sp[n + r]; };
#if defined(__AVX2__) && defined(__FMA__)
      if (rows == kRows) {
        float out[kBlockRows * kRows];
        auto store = [&](int64_t m, int mb) {
          for (int i = 0; i < mb; ++i)
            for (int r = 0; r < kRows; ++r)
              yp[(m + i) * N + n + r] = grouped ? out[i * kRows + r] : out[i * kRows + r] * sp[n + r];
        };
        row_blocks(M, [&](auto mb, int64_t m) {
          if (half16) i8_block<decltype(mb)::value, true, true>(q + m * K, dx + m * G, K, wt, out, dw.data());
          else if (grouped) i8_block<decltype(mb)::value, true>(q + m * K, dx + m * G, K, wt, out, dw.data());
          else i8_block<decltype(mb)::value>(q + m * K, dx + m * G, K, wt, out);
          store(m, decltype(mb)::value);
        });
        continue;
      }
#endif
      for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < rows; ++r)
          yp[m * N + n + r] = grouped ? i8_scalar(q + m * K, dx + m * G, K, wt + r * K, dw.data() + r * GS, half16)
                                      : i8_scalar(q + m * K, dx + m * G, K, wt + r * K) * row_scale(r);
    }
  });
  return y;
}


#endif  // ARLM_BARE

void arlm_kernels::quantize_span(const float* x, int64_t n, const Act8& a, int64_t at) {
  for (int64_t e = 0; e < n; e += kGroup)
    quantize_group(x + e, a.q + at + e, a.d + (at + e) / kGroup, a.s + (at + e) / kGroup, a.sum + (at + e) / kGroup);
}

int64_t arlm_kernels::packed_out_features(const char* op, int64_t K, const at::Tensor& wp, const at::Tensor& scale,
                                          const at::Tensor& mins) {
  TORCH_CHECK(K % kGroup == 0 && wp.dim() == 3 && wp.scalar_type() == at::kByte && wp.is_contiguous() &&
              (wp.size(2) == 4 * kLanes || wp.size(2) == 5 * kLanes || wp.size(2) == 6 * kLanes),
              op, ": packed weights [N/16, ., 64 (80: 5-bit, 96: Q6_K)] uint8 and K a multiple of 32");
  const int64_t NB = wp.size(0), G = K / kGroup;
  const Packed kind = packed_kind(K, wp, scale, mins);
  if (kind == Packed::kQ4_K || kind == Packed::kQ5_K || kind == Packed::kQ6_K) {
    const bool q4 = kind == Packed::kQ4_K || kind == Packed::kQ5_K;
    TORCH_CHECK(K % 256 == 0 && wp.size(1) == K / 8 && scale.dim() == 3 && scale.is_contiguous() &&
                scale.size(0) == NB && scale.size(1) == (q4 ? K / 256 : K / 16) &&
                scale.size(2) == (q4 ? kKScaleBytes : kLanes) &&
                mins.dim() == 3 && mins.scalar_type() == at::kHalf && mins.is_contiguous() && mins.size(0) == NB &&
                mins.size(1) == K / 256 && mins.size(2) == (q4 ? 2 : 1) * kLanes,
                op, q4 ? ": Q4_K / Q5_K wp [N/16, K/8, 64 or 80] uint8, scale [N/16, K/256, 192] uint8, mins "
                         "[N/16, K/256, 32] float16"
                       : ": Q6_K wp [N/16, K/8, 96] uint8, scale [N/16, K/16, 16] int8, mins [N/16, K/256, 16] float16");
    return NB * kLanes;
  }
  if (scale.dim() == 1) {
    TORCH_CHECK(wp.size(1) == K / 4 && scale.size(0) == NB * kLanes && scale.scalar_type() == at::kFloat &&
                scale.is_contiguous(), op, ": int8 wp [N/16, K/4, 64] uint8, scale [N] float32");
  } else if (wp.size(1) == K / 4) {  // Q8_0: int8 with a scale per group of 32
    TORCH_CHECK(scale.dim() == 3 && scale.scalar_type() == at::kHalf && scale.is_contiguous() &&
                scale.size(0) == NB && scale.size(1) == G && scale.size(2) == kLanes,
                op, ": Q8_0 wp [N/16, K/4, 64] uint8, scale [N/16, K/32, 16] float16");
  } else {
    TORCH_CHECK(wp.size(1) == K / 8 && scale.dim() == 3 && scale.scalar_type() == at::kHalf &&
                scale.is_contiguous() && scale.size(0) == NB && scale.size(1) == G && scale.size(2) == kLanes &&
                (mins.numel() == 0 || (mins.sizes() == scale.sizes() && mins.scalar_type() == at::kHalf &&
                                       mins.is_contiguous())),
                op, ": 4-bit (5-bit: 80) wp [N/16, K/8, 64] uint8, scale and mins [N/16, K/32, 16] float16 (mins empty: "
                "-8 scale; 5-bit: -16)");
  }
  return NB * kLanes;
}

#ifdef ARLM_PACKED
namespace {

// One packed layer's tensors as the tile loops read them (linear_a8p, x16_tiles).
struct PackedLayer {
  Packed kind;
  int64_t NB, block;  // blocks of 16 channels; bytes of one
  bool k5, f16, q4;
  const uint8_t* w;
  const float* rs;  // int8: the scale per row
  const at::Half *dp, *mp;
  float m_per_d;
  const void* kscale;
  const at::Half* supers;
};

PackedLayer packed_layer(int64_t K, const at::Tensor& wp, const at::Tensor& scale, const at::Tensor& mins) {
  PackedLayer L;
  L.kind = packed_kind(K, wp, scale, mins);
  L.NB = wp.size(0);
  L.k5 = L.kind == Packed::kQ5 || L.kind == Packed::kQ5_K;
  L.f16 = L.kind == Packed::kQ4_1 || L.kind == Packed::kQ4_0 || L.kind == Packed::kQ5;
  L.q4 = L.f16 || L.kind == Packed::kQ4_K || L.kind == Packed::kQ5_K;
  const bool q8 = L.kind == Packed::kQ8_0;
  L.block = L.kind == Packed::kQ6_K ? K / 8 * 96 : L.k5 ? K / 8 * 80 : L.q4 ? K / 2 * kLanes : K * kLanes;
  L.w = wp.data_ptr<uint8_t>();
  L.rs = L.kind == Packed::kInt8 ? scale.data_ptr<float>() : nullptr;
  L.dp = L.f16 || q8 ? scale.data_ptr<at::Half>() : nullptr;
  L.mp = L.f16 && L.kind != Packed::kQ4_0 && mins.numel() ? mins.data_ptr<at::Half>() : nullptr;
  L.m_per_d = L.kind == Packed::kQ4_0 ? -8.f : L.kind == Packed::kQ5 && !mins.numel() ? -16.f : 0.f;  // (Q5_0: -16 d)
  const bool kq = L.kind == Packed::kQ4_K || L.kind == Packed::kQ5_K || L.kind == Packed::kQ6_K;
  L.kscale = kq ? scale.data_ptr() : nullptr;
  L.supers = kq ? mins.data_ptr<at::Half>() : nullptr;
  return L;
}

}  // namespace
#endif

void arlm_kernels::linear_a8p(const Act8& a, int64_t M, int64_t K, const at::Tensor& wp, const at::Tensor& scale,
                              const at::Tensor& mins, float* y, int64_t ldy, bool accumulate) {
#ifdef ARLM_PACKED
  const PackedLayer W = packed_layer(K, wp, scale, mins);
  const int64_t G = K / kGroup, NB = W.NB, H = K / 16, S = K / 256, block = W.block;
  const Packed kind = W.kind;
  const bool k5 = W.k5, f16 = W.f16, q8 = kind == Packed::kQ8_0;
  const uint8_t* wpp = W.w;
  const float* sp = W.rs;
  const at::Half *dp = W.dp, *mp = W.mp, *supers = W.supers;
  const float m_per_d = W.m_per_d;
  const void* kscale = W.kscale;
  thread_local std::vector<int32_t> halves;  // Q6_K: the rows' sums per 16 codes
  if (kind == Packed::kQ6_K) {
    halves.resize(std::max<size_t>(halves.size(), M * H));
    half_sums(a.q, nullptr, M, K, halves.data());
  }
  const int32_t* hs = halves.data();
  const int64_t tb = tile_blocks(M);
  at::parallel_for(0, (NB + tb - 1) / tb, 4, [&](int64_t t0, int64_t t1) {
    float out[kPackedRows * kTileBlocks * kLanes];
    prefetch_start(wpp + t0 * tb * block, tb);
    for (int64_t t = t0; t < t1; ++t) {  // a tile: tb blocks of 16 channels (fewer at the end)
      const int64_t b0 = tb * t, nb = std::min<int64_t>(tb, NB - b0);
      const uint8_t* wt = wpp + b0 * block;
      const uint8_t* next = prefetch_from(wt, tb, block, t + 1 == t1);  // prefetched by the first rows
      row_blocks<kPackedRows>(M, [&](auto mb, int64_t m) {
        constexpr int MB = decltype(mb)::value;
        const int8_t* q = a.q + m * K;
        const float* dx = a.d + m * G;
        const uint8_t* pf = m == 0 ? next : nullptr;
        if (f16) {
          const F16Scales sc{dp + b0 * G * kLanes, mp ? mp + b0 * G * kLanes : nullptr, G, m_per_d};
          if (k5) {
            if (nb == 2) q4p_block<MB, 2, F16Scales, true>(q, dx, a.s + m * G, K, wt, sc, pf, out);
            else q4p_block<MB, 1, F16Scales, true>(q, dx, a.s + m * G, K, wt, sc, pf, out);
          } else {
            if (nb == 2) q4p_block<MB, 2>(q, dx, a.s + m * G, K, wt, sc, pf, out);
            else q4p_block<MB, 1>(q, dx, a.s + m * G, K, wt, sc, pf, out);
          }
        } else if (kind == Packed::kQ4_K || kind == Packed::kQ5_K) {
          const KScales sc = KScales::of(kscale, supers, b0, G);
          if (k5) {
            if (nb == 2) q4p_block<MB, 2, KScales, true>(q, dx, a.s + m * G, K, wt, sc, pf, out);
            else q4p_block<MB, 1, KScales, true>(q, dx, a.s + m * G, K, wt, sc, pf, out);
          } else {
            if (nb == 2) q4p_block<MB, 2>(q, dx, a.s + m * G, K, wt, sc, pf, out);
            else q4p_block<MB, 1>(q, dx, a.s + m * G, K, wt, sc, pf, out);
          }
        } else if (kind == Packed::kQ6_K) {
          const int8_t* sc = static_cast<const int8_t*>(kscale) + b0 * H * kLanes;
          const at::Half* dd = supers + b0 * S * kLanes;
          if (nb == 2) q6p_block<false, MB, 2>(q, nullptr, dx, hs + m * H, K, wt, sc, dd, pf, out);
          else q6p_block<false, MB, 1>(q, nullptr, dx, hs + m * H, K, wt, sc, dd, pf, out);
        } else {
          const at::Half* dw = q8 ? dp + b0 * G * kLanes : nullptr;
          if (nb == 2) i8p_block<MB, 2>(q, dx, a.sum + m * G, K, wt, pf, out, dw);
          else i8p_block<MB, 1>(q, dx, a.sum + m * G, K, wt, pf, out, dw);
        }
        for (int i = 0; i < MB; ++i)
          for (int64_t b = 0; b < nb; ++b)  // into y, or added to it, times the int8 scale
            put16(out + (i * nb + b) * kLanes, sp ? sp + (b0 + b) * kLanes : nullptr,
                  y + (m + i) * ldy + (b0 + b) * kLanes, accumulate);
      });
    }
  });
#else
  TORCH_CHECK(false, "linear_a8p: built without the packed kernels (AVX-512 VNNI or AVX2)");
#endif
}

void arlm_kernels::activation_residual(const float* x, int64_t n, float* r) {
  int8_t q[kGroup];
  float d, s;
  int32_t sum;
  for (int64_t e = 0; e < n; e += kGroup) {
    quantize_group(x + e, q, &d, &s, &sum);
    for (int j = 0; j < kGroup; ++j) r[e + j] = x[e + j] - static_cast<float>(q[j]) * d;
  }
}

#ifdef ARLM_PACKED
namespace {

// AVX2's int8 layouts read x as int16 (256 hi + lo), not as its two bytes.
inline bool reads_wide(const PackedLayer& L) {
#ifdef ARLM_AVX512
  (void)L;
  return false;
#else
  return !L.q4 && L.kind != Packed::kQ6_K;
#endif
}

// x as 16 bits in two bytes (x16p_block), for the layers that read it.
struct X16Rows {
  const int8_t *hi, *lo;
  const float *e, *sx;
  const int32_t *sums, *halves;  // halves: the rows' sums of X per 16 (Q6_K; where asked for)
  const int16_t* wide;           // 256 hi + lo (reads_wide; where asked for)
};

// x [M, K] quantized for X16Rows. Scratch kept per calling thread and grown as needed (a decode
// step allocates nothing here); valid until the thread's next call.
X16Rows quantize_x16(const float* x, int64_t M, int64_t K, bool halves_too, bool wide_too) {
  const int64_t G = K / kGroup;
  thread_local std::vector<int8_t> codes;
  thread_local std::vector<float> scales;
  thread_local std::vector<int32_t> sums;
  codes.resize(std::max<size_t>(codes.size(), 2 * M * K));
  scales.resize(std::max<size_t>(scales.size(), 2 * M * G));
  sums.resize(std::max<size_t>(sums.size(), M * G));
  // Pointers for the pool's threads: a thread_local's name would mean each thread's own copy.
  int8_t *hi = codes.data(), *lo = hi + M * K;
  float *e = scales.data(), *sx = e + M * G;
  int32_t* sp = sums.data();
  at::parallel_for(0, M * G, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      quantize_group16(x + b * kGroup, hi + b * kGroup, lo + b * kGroup, e + b, sx + b, sp + b);
  });
  X16Rows a{hi, lo, e, sx, sp, nullptr, nullptr};
  thread_local std::vector<int32_t> halves;
  if (halves_too) {
    halves.resize(std::max<size_t>(halves.size(), M * (K / 16)));
    half_sums(hi, lo, M, K, halves.data());
    a.halves = halves.data();
  }
  // (A second pass over the codes quantize_group16 just split; ~1% of a prompt's time, nothing
  // at batch 1: left.)
  thread_local std::vector<int16_t> wide;
  if (wide_too) {
    wide.resize(std::max<size_t>(wide.size(), M * K));
    int16_t* xw = wide.data();
    at::parallel_for(0, M * K, 4096, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) xw[i] = static_cast<int16_t>(256 * hi[i] + lo[i]);
    });
    a.wide = xw;
  }
  return a;
}

// Each thread's tiles are taken a chunk of rows at a time: the chunk's codes (64 rows: 74 KB at
// K = 576, 197 KB at 1,536) stay in L2 across the tiles, where all M rows would be read again
// from L3 for every tile. A row's products do not depend on the chunking.
constexpr int64_t kChunkRows = 64;
constexpr int64_t kExpandRows = 32;  // (expand_q6, below)

// Tiles t0 .. t1 of layer W (tile_blocks(M) blocks of 16 channels each) times x's M rows: those
// blocks' columns of y (row stride ldy), or added to them. One thread's share of a call. Inlined
// into each caller's loop over the pool, its layer's fields copied into locals: SmolLM2's gate/up
// pass (benchmarks/phases.py, batch 1, Zen 5) 0.41 ms, where the same code as a call took 0.54 and
// the lambda it was before (every field read through its captures) 0.47.
__attribute__((always_inline)) inline void x16_tiles(const PackedLayer& W, const X16Rows& a, int64_t M, int64_t K,
                                                     int64_t t0, int64_t t1, float* y, int64_t ldy, bool accumulate) {
  const int64_t G = K / kGroup, H = K / 16, S = K / 256, NB = W.NB, block = W.block;
  const Packed kind = W.kind;
  const bool k5 = W.k5, q4 = W.q4;
  const uint8_t* wpp = W.w;
  const float* rs = W.rs;
  const at::Half *dp = W.dp, *mp = W.mp, *supers = W.supers;
  const void* kscale = W.kscale;
  const int8_t *hi = a.hi, *lo = a.lo;
  const float *e = a.e, *sx = a.sx;
  const int32_t *sp = a.sums, *hs = a.halves;
  const int16_t* x16 = a.wide;
  const int64_t tb = tile_blocks(M);
  float out[kPackedRows * kTileBlocks * kLanes];
#ifdef ARLM_AMX
  const bool amx = M >= 16 && amx_ready();
  alignas(64) float tiled[kChunkRows * 2 * kLanes];  // amx_tile's rows of the chunk
  X16Layer L{kind, K, G, H, S, block, wpp, rs, {}, static_cast<const uint8_t*>(kscale), supers, hi, lo, e,
             sx, sp, hs};
#endif
  // A prompt's rows of a Q6_K layer: each tile's values unpacked once a chunk (expand_q6), then
  // read by every row block of the chunk, where it has kExpandRows rows or more: a batch of 8
  // decode rows unpacking its tiles was 8% slower a step (1B Q4_K_M: its Q6_K head and down).
  // (AVX-512 builds; one scratch a thread.)
  bool expand = false;
  uint8_t* xw = nullptr;
  float* kx = nullptr;  // a K-quant tile's scales as floats (FloatScales, expand_q6_scales) for a prompt's chunk
#ifdef ARLM_AVX512
  expand = M > kPackedRows && kind == Packed::kQ6_K;
  thread_local std::vector<__m512i> scratch;  // (64-byte aligned: the type's alignment)
  if (expand) {
    scratch.resize(std::max<size_t>(scratch.size(), tb * K / 8 * (kExpanded / 64)));
    xw = reinterpret_cast<uint8_t*>(scratch.data());
  }
  thread_local std::vector<__m512> kscratch;
  if (M >= kExpandRows && (kind == Packed::kQ4_K || kind == Packed::kQ5_K || kind == Packed::kQ6_K)) {
    kscratch.resize(std::max<size_t>(kscratch.size(), tb * std::max(G * 2, H)));
    kx = reinterpret_cast<float*>(kscratch.data());
  }
#else
  (void)expand;
#endif
  prefetch_start(wpp + t0 * tb * block, tb);
  for (int64_t c0 = 0; c0 < M; c0 += kChunkRows)
    for (int64_t t = t0; t < t1; ++t) {  // a tile: tb blocks of 16 channels (fewer at the end)
      const int64_t b0 = tb * t, nb = std::min<int64_t>(tb, NB - b0);
      const uint8_t* wt = wpp + b0 * block;
      const uint8_t* next = prefetch_from(wt, tb, block, t + 1 == t1);  // prefetched by the first rows
      const F16Scales fs{dp ? dp + b0 * G * kLanes : nullptr, mp ? mp + b0 * G * kLanes : nullptr, G, W.m_per_d};
      int64_t done = 0;  // the chunk's rows the tiles took
#ifdef ARLM_AMX
      if (amx) {
        done = std::min(kChunkRows, M - c0) / 16 * 16;
        L.fs = fs;
        if (done) amx_tile(L, c0, done, b0, nb, tiled);
        for (int64_t i = 0; i < done; ++i)
          for (int64_t b = 0; b < nb; ++b) {
            __m512 v = _mm512_load_ps(tiled + (i * nb + b) * kLanes);
            if (rs) v = _mm512_mul_ps(v, _mm512_loadu_ps(rs + (b0 + b) * kLanes));
            float* yr = y + (c0 + i) * ldy + (b0 + b) * kLanes;
            _mm512_storeu_ps(yr, accumulate ? _mm512_add_ps(_mm512_loadu_ps(yr), v) : v);
          }
      }
#endif
      // the chunk's rows by blocks of rows; kX: a Q6_K tile's from its unpacked values (xw), whose
      // unpacking prefetched the next tile
      const bool kscaled = kx && kind != Packed::kQ6_K && std::min(kChunkRows, M - c0) - done >= kExpandRows;
#ifdef ARLM_AVX512
      if (kscaled)
        expand_kscales(KScales::of(kscale, supers, b0, G), nb, kx);
#endif
      auto rows = [&](auto xc) {
        constexpr bool kX = decltype(xc)::value;
        const uint8_t* ws = kX ? xw : wt;
        row_blocks<kPackedRows>(std::min(kChunkRows, M - c0) - done, [&](auto mb, int64_t r) {
          constexpr int MB = decltype(mb)::value;
          const int64_t m = c0 + done + r;
          const uint8_t* pf = !kX && r == 0 ? next : nullptr;
          const int8_t *h = hi + m * K, *l = lo + m * K;
          const float *em = e + m * G, *sm = sx + m * G;
          const int32_t* um = sp + m * G;
          auto kquant = [&](const auto& ks) {  // Q4_K / Q5_K with KScales or FloatScales
            using Scales = std::decay_t<decltype(ks)>;
            if (k5) {
              if (nb == 2) x16p_block<true, MB, 2, Scales, true>(h, l, em, sm, um, K, wt, ks, pf, out);
              else x16p_block<true, MB, 1, Scales, true>(h, l, em, sm, um, K, wt, ks, pf, out);
            } else {
              if (nb == 2) x16p_block<true, MB, 2, Scales>(h, l, em, sm, um, K, wt, ks, pf, out);
              else x16p_block<true, MB, 1, Scales>(h, l, em, sm, um, K, wt, ks, pf, out);
            }
          };
          if (kind == Packed::kQ4_K || kind == Packed::kQ5_K) {
#ifdef ARLM_AVX512
            if (kscaled) kquant(FloatScales{kx, G});
            else
#endif
            kquant(KScales::of(kscale, supers, b0, G));
          } else if (kind == Packed::kQ5) {
            if (nb == 2) x16p_block<true, MB, 2, F16Scales, true>(h, l, em, sm, um, K, wt, fs, pf, out);
            else x16p_block<true, MB, 1, F16Scales, true>(h, l, em, sm, um, K, wt, fs, pf, out);
          } else if (kind == Packed::kQ6_K) {
            const int8_t* sc = static_cast<const int8_t*>(kscale) + b0 * H * kLanes;
            const at::Half* dd = supers + b0 * S * kLanes;
            if (nb == 2) q6p_block<true, MB, 2, kX>(h, l, em, hs + m * H, K, ws, sc, dd, pf, out, kx);
            else q6p_block<true, MB, 1, kX>(h, l, em, hs + m * H, K, ws, sc, dd, pf, out, kx);
          } else if (q4) {
            if (nb == 2) x16p_block<true, MB, 2>(h, l, em, sm, um, K, wt, fs, pf, out);
            else x16p_block<true, MB, 1>(h, l, em, sm, um, K, wt, fs, pf, out);
          } else {
            const int16_t* xm = x16 ? x16 + m * K : nullptr;
            if (nb == 2) x16p_block<false, MB, 2>(h, l, em, sm, um, K, wt, fs, pf, out, xm);
            else x16p_block<false, MB, 1>(h, l, em, sm, um, K, wt, fs, pf, out, xm);
          }
          for (int i = 0; i < MB; ++i)
            for (int64_t b = 0; b < nb; ++b)  // into y, or added to it, times the int8 scale
              put16(out + (i * nb + b) * kLanes, rs ? rs + (b0 + b) * kLanes : nullptr,
                    y + (m + i) * ldy + (b0 + b) * kLanes, accumulate);
        });
      };
#ifdef ARLM_AVX512
      if (expand && std::min(kChunkRows, M - c0) - done >= kExpandRows) {
        expand_q6(wt, block, nb, K, next, xw);
        expand_q6_scales(static_cast<const int8_t*>(kscale) + b0 * H * kLanes, supers + b0 * S * kLanes, nb, K, kx);
        rows(std::true_type{});
        continue;
      }
#endif
      rows(std::false_type{});
    }
}

}  // namespace
#endif

void arlm_kernels::linear_a8p_residual(const float* x, int64_t M, int64_t K, const at::Tensor& wp,
                                       const at::Tensor& scale, const at::Tensor& mins, float* y, int64_t ldy,
                                       bool accumulate) {
#ifdef ARLM_PACKED
  const PackedLayer W = packed_layer(K, wp, scale, mins);
  const X16Rows a = quantize_x16(x, M, K, W.kind == Packed::kQ6_K, reads_wide(W));
  const int64_t tb = tile_blocks(M);
  at::parallel_for(0, (W.NB + tb - 1) / tb, 4,
                   [&](int64_t t0, int64_t t1) { x16_tiles(W, a, M, K, t0, t1, y, ldy, accumulate); });
#else
  TORCH_CHECK(false, "linear_a8p_residual: built without the packed kernels (AVX-512 VNNI or AVX2)");
#endif
}

void arlm_kernels::linear_a8p_residual_parts(const float* x, int64_t M, int64_t K, const at::Tensor* const* parts,
                                             int64_t n, float* y, int64_t ldy) {
#ifdef ARLM_PACKED
  constexpr int64_t kMaxParts = 4;  // (q, k, v: three; on the stack, a decode step allocates nothing)
  TORCH_CHECK(n >= 1 && n <= kMaxParts, "linear_a8p_residual_parts: 1 to 4 parts");
  PackedLayer W[kMaxParts];
  bool q6 = false, wide = false;
  for (int64_t p = 0; p < n; ++p) {
    W[p] = packed_layer(K, parts[p][0], parts[p][1], parts[p][2]);
    q6 = q6 || W[p].kind == Packed::kQ6_K;
    wide = wide || reads_wide(W[p]);
  }
  const X16Rows a = quantize_x16(x, M, K, q6, wide);
  const int64_t tb = tile_blocks(M);
  // each part's first column of y, its tiles, its first byte in the parts' bytes end to end
  int64_t col[kMaxParts + 1] = {0}, tiles[kMaxParts], first[kMaxParts + 1] = {0};
  for (int64_t p = 0; p < n; ++p) {
    col[p + 1] = col[p] + W[p].NB * kLanes;
    tiles[p] = (W[p].NB + tb - 1) / tb;
    first[p + 1] = first[p] + tiles[p] * tb * W[p].block;
  }
  if (M > kPackedRows) {  // prompt rows: each part over the pool in turn, x quantized once
    for (int64_t p = 0; p < n; ++p)
      at::parallel_for(0, tiles[p], 4,
                       [&](int64_t t0, int64_t t1) { x16_tiles(W[p], a, M, K, t0, t1, y + col[p], ldy, false); });
    return;
  }
  // A decode step: all parts in one pass of the pool, the threads' shares cut by bytes (a thread
  // takes the tiles that start in its share), each share's tiles one stream.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), first[n] / (64 * 1024)));
  at::parallel_for(0, threads, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t lo = first[n] * i / threads, hi = first[n] * (i + 1) / threads;
      for (int64_t p = 0; p < n; ++p) {
        const int64_t bytes = tb * W[p].block;  // a tile's (the last may hold fewer blocks)
        auto tile_at = [&](int64_t byte) {  // the first tile that starts at or after byte
          return std::clamp<int64_t>((byte - first[p] + bytes - 1) / bytes, 0, tiles[p]);
        };
        const int64_t t0 = tile_at(lo), t1 = tile_at(hi);
        if (t0 < t1) x16_tiles(W[p], a, M, K, t0, t1, y + col[p], ldy, false);
      }
    }
  });
#else
  TORCH_CHECK(false, "linear_a8p_residual_parts: built without the packed kernels (AVX-512 VNNI or AVX2)");
#endif
}

#ifndef ARLM_BARE
// The packed twins of int8_linear_a8 / q4_linear_a8 (layouts above; AVX-512 VNNI only).
at::Tensor int8_linear_a8p(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int8_linear_a8p: x [M, K] contiguous float32");
  TORCH_CHECK(scale.dim() == 1 || scale.dim() == 3, "int8_linear_a8p: scale [N] float32 or [N/16, K/32, 16] float16");
  const int64_t N = arlm_kernels::packed_out_features("int8_linear_a8p", x.size(1), wp, scale, scale);
  const QuantizedX xq(x);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  arlm_kernels::linear_a8p(xq.view(), x.size(0), x.size(1), wp, scale, scale, y.data_ptr<float>(), N, false);
  return y;
}

at::Tensor q4_linear_a8p(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale, const at::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "q4_linear_a8p: x [M, K] contiguous float32");
  TORCH_CHECK(scale.dim() == 3, "q4_linear_a8p: scale and mins [N/16, K/32, 16] float16");
  const int64_t N = arlm_kernels::packed_out_features("q4_linear_a8p", x.size(1), wp, scale, mins);
  const QuantizedX xq(x);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  arlm_kernels::linear_a8p(xq.view(), x.size(0), x.size(1), wp, scale, mins, y.data_ptr<float>(), N, false);
  return y;
}

// The K-quants' packed layouts (Q4_K, Q5_K, Q6_K: above) times 8-bit x, one pass.
at::Tensor kquant_linear_a8p(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale,
                             const at::Tensor& supers) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "kquant_linear_a8p: x [M, K] contiguous float32");
  TORCH_CHECK(scale.dim() == 3 && (scale.scalar_type() == at::kByte || scale.scalar_type() == at::kChar),
              "kquant_linear_a8p: a Q4_K, Q5_K or Q6_K layout");
  const int64_t N = arlm_kernels::packed_out_features("kquant_linear_a8p", x.size(1), wp, scale, supers);
  const QuantizedX xq(x);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  arlm_kernels::linear_a8p(xq.view(), x.size(0), x.size(1), wp, scale, supers, y.data_ptr<float>(), N, false);
  return y;
}

// Whether prompt rows go through the AMX tiles here (amx_tile): built with AMX-INT8 and granted by Linux.
#endif  // ARLM_BARE

bool amx_active() {
#ifdef ARLM_AMX
  return amx_ready();
#else
  return false;
#endif
}

bool packed_a8_available() {
#ifdef ARLM_PACKED
  return true;
#else
  return false;
#endif
}

// The instructions the packed kernels multiply with: "AVX512-VNNI", "AVX2", or "" (not built).
std::string packed_a8_isa() {
#if defined(ARLM_AVX512)
  return "AVX512-VNNI";
#elif defined(ARLM_PACKED)
  return "AVX2";
#else
  return "";
#endif
}

#ifndef ARLM_BARE
// linear_a8p_residual as an op: packed weights (wp, scale, mins as the a8p ops take them; mins
// empty for int8 layouts).
at::Tensor linear_a8p_residual(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale,
                               const at::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "linear_a8p_residual: x [M, K] contiguous float32");
  const int64_t N = arlm_kernels::packed_out_features("linear_a8p_residual", x.size(1), wp, scale, mins);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
#ifdef ARLM_PACKED
  arlm_kernels::linear_a8p_residual(x.data_ptr<float>(), x.size(0), x.size(1), wp, scale, mins, y.data_ptr<float>(),
                                    N, false);
#else
  TORCH_CHECK(false, "linear_a8p_residual: built without the packed kernels (AVX-512 VNNI or AVX2)");
#endif
  return y;
}

// Rows `index` of a packed Q8_0, Q6_K or Q4_K layer (K inputs) as float32 [T, K]: an embedding
// table's lookup (a tied head's matrix; 8B Q4_K_M's own Q4_K table), once a decode step. The
// layers' dequantize_rows (quant.py) in the same float32 operations (Q8_0: d q; Q6_K: (d sc) q,
// q = u - 32; Q4_K: (d sc) q - dmin m, not fused), one pass over each row's bytes, where ~10 tensor
// ops took 1-2% of a 1B, 270M or 135M model's step (benchmarks/phases.py's "other": 0.38 -> 0.19
// ms at 1B Q4_K_M).
__attribute__((optimize("fp-contract=off")))
at::Tensor packed_rows(const at::Tensor& wp, const at::Tensor& scale, const at::Tensor& mins, const at::Tensor& index,
                       int64_t K) {
  TORCH_CHECK(wp.dim() == 3 && wp.scalar_type() == at::kByte && wp.is_contiguous() && K > 0 && K % 32 == 0,
              "packed_rows: a packed layer");
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong, "packed_rows: index [T] int64");
  const Packed kind = packed_kind(K, wp, scale, mins);
  TORCH_CHECK(kind == Packed::kQ8_0 || ((kind == Packed::kQ6_K || kind == Packed::kQ4_K) && K % 256 == 0),
              "packed_rows: Q8_0, Q6_K and Q4_K only");
  TORCH_CHECK(scale.is_contiguous() && mins.is_contiguous(), "packed_rows: contiguous scales");
  const int64_t T = index.size(0), NB = wp.size(0), C = wp.size(1), R = wp.size(2);
  at::Tensor out = at::empty({T, K}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* ip = index.data_ptr<int64_t>();
  const uint8_t* w = wp.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = ip[t];
    TORCH_CHECK(n >= 0 && n < NB * kLanes, "packed_rows: index out of range");
    const int64_t b = n / kLanes, lane = n % kLanes;
    const uint8_t* wb = w + b * C * R;
    float* row = op + t * K;
    if (kind == Packed::kQ8_0) {  // [NB, K/4, 64]: lane's 4 bytes (w + 128) per 4 K-values; d [NB, K/32, 16]
      const at::Half* d = scale.data_ptr<at::Half>() + b * (K / 32) * kLanes + lane;
      for (int64_t k = 0; k < K; ++k) {
        const int8_t q = static_cast<int8_t>(wb[(k / 4) * R + 4 * lane + k % 4] ^ 0x80);
        row[k] = static_cast<float>(q) * static_cast<float>(d[(k / 32) * kLanes]);
      }
    } else if (kind == Packed::kQ4_K) {  // [NB, K/8, 64]: byte 4 lane + t, q[8c + t] low, q[8c + 4 + t] high
      const uint8_t* sm = static_cast<const uint8_t*>(scale.data_ptr()) + b * (K / 256) * kKScaleBytes;
      const at::Half* dd = mins.data_ptr<at::Half>() + b * (K / 256) * 2 * kLanes;
      for (int64_t su = 0; su < K / 256; ++su) {
        const uint8_t* p = sm + su * kKScaleBytes;  // KScales' layout
        const float d = static_cast<float>(dd[su * 2 * kLanes + lane]);
        const float dmin = static_cast<float>(dd[su * 2 * kLanes + kLanes + lane]);
        for (int64_t j = 0; j < 8; ++j) {
          const int low = p[16 * j + lane], top = p[128 + 16 * (j % 4) + lane] >> (4 * (j / 4));
          const float dsc = d * static_cast<float>((low & 15) | ((top & 3) << 4));
          const float dm = dmin * static_cast<float>((low >> 4) | (((top >> 2) & 3) << 4));
          for (int64_t i = 0; i < 32; ++i) {
            const int64_t k = 256 * su + 32 * j + i;
            const uint8_t byte = wb[(k / 8) * R + 4 * lane + k % 4];
            row[k] = dsc * static_cast<float>(k % 8 < 4 ? byte & 0x0F : byte >> 4) - dm;
          }
        }
      }
    } else {  // Q6_K [NB, K/8, 96] (pack_q6_k): 64 bytes of low nibbles, 32 of top bits (load_q6)
      const int8_t* sc = scale.data_ptr<int8_t>() + b * (K / 16) * kLanes + lane;
      const at::Half* dd = mins.data_ptr<at::Half>() + b * (K / 256) * kLanes + lane;
      // channel lane's 4 bytes are vector bytes 4 lane .. 4 lane + 3: 128-bit lane L, word lane % 4,
      // whose top bits sit at bits 2 slot of the stored byte (c + offset) % 4 (kernels.pack_q6_k)
      static constexpr int kSlotOf[4] = {2, 3, 0, 1}, kOffsetOf[4] = {1, 1, 0, 0};  // by L; by slot
      const int64_t L = lane / 4, word = lane % 4, slot = kSlotOf[L], offset = kOffsetOf[slot];
      for (int64_t c = 0; c < K / 8; ++c) {
        const uint8_t* g = wb + c * R;
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t j = 0; j < 4; ++j) {
            const int64_t k = 8 * c + 4 * h + j;
            const int low = h ? g[4 * lane + j] >> 4 : g[4 * lane + j] & 0x0F;
            const int top = (g[64 + 16 * h + 4 * word + (j + offset) % 4] >> (2 * slot)) & 0x03;
            const float dsc = static_cast<float>(dd[(k / 256) * kLanes]) * static_cast<float>(sc[(k / 16) * kLanes]);
            row[k] = dsc * static_cast<float>((low | top << 4) - 32);
          }
      }
    }
  }
  return out;
}

// linear_a8p_residual_parts as an op: layers (wp, scale, mins) after one another in `layers`.
at::Tensor linear_a8p_residual_parts(const at::Tensor& x, at::TensorList layers) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "linear_a8p_residual_parts: x [M, K] contiguous float32");
  TORCH_CHECK(!layers.empty() && layers.size() % 3 == 0, "linear_a8p_residual_parts: (wp, scale, mins) per part");
  const int64_t n = static_cast<int64_t>(layers.size()) / 3;
  std::vector<const at::Tensor*> parts;
  int64_t N = 0;
  for (int64_t p = 0; p < n; ++p) {
    const at::Tensor* t = layers.data() + 3 * p;
    N += arlm_kernels::packed_out_features("linear_a8p_residual_parts", x.size(1), t[0], t[1], t[2]);
    parts.push_back(t);
  }
  at::Tensor y = at::empty({x.size(0), N}, x.options());
#ifdef ARLM_PACKED
  arlm_kernels::linear_a8p_residual_parts(x.data_ptr<float>(), x.size(0), x.size(1), parts.data(), n,
                                          y.data_ptr<float>(), N);
#else
  TORCH_CHECK(false, "linear_a8p_residual_parts: built without the packed kernels (AVX-512 VNNI or AVX2)");
#endif
  return y;
}

TORCH_LIBRARY_FRAGMENT(arlm, m) {
  m.def("linear_a8p_residual(Tensor x, Tensor wp, Tensor scale, Tensor mins) -> Tensor");
  m.def("linear_a8p_residual_parts(Tensor x, Tensor[] layers) -> Tensor");
  m.def("packed_rows(Tensor wp, Tensor scale, Tensor mins, Tensor index, int K) -> Tensor");
  m.def("q4_linear_a8(Tensor x, Tensor w, Tensor scale, Tensor mins) -> Tensor");
  m.def("int8_linear_a8(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("int8_linear_a8p(Tensor x, Tensor wp, Tensor scale) -> Tensor");
  m.def("q4_linear_a8p(Tensor x, Tensor wp, Tensor scale, Tensor mins) -> Tensor");
  m.def("kquant_linear_a8p(Tensor x, Tensor wp, Tensor scale, Tensor supers) -> Tensor");
  m.def("packed_a8_available() -> bool", &packed_a8_available);
  m.def("packed_a8_isa() -> str", &packed_a8_isa);
  m.def("amx_active() -> bool", &amx_active);
}

TORCH_LIBRARY_IMPL(arlm, CPU, m) {
  m.impl("q4_linear_a8", &q4_linear_a8);
  m.impl("int8_linear_a8", &int8_linear_a8);
  m.impl("int8_linear_a8p", &int8_linear_a8p);
  m.impl("q4_linear_a8p", &q4_linear_a8p);
  m.impl("linear_a8p_residual", &linear_a8p_residual);
  m.impl("linear_a8p_residual_parts", &linear_a8p_residual_parts);
  m.impl("packed_rows", &packed_rows);
  m.impl("kquant_linear_a8p", &kquant_linear_a8p);
}
#endif  // ARLM_BARE
