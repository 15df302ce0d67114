// Causal attention's backward pass for training, on bf16 q/k/v (FlashAttention-2's scheme).
//
// attention_backward(q [B, H, T, d], k, v [B, H_kv, T, d], out [B, H, T, d], dout [B, H, T, d],
//                    lse [B, H, T] float32, scale) -> (dq [B, H, T, d], dk, dv [B, H_kv, T, d])
//   The gradients of out = softmax(scale q k^T, causal) v with respect to q, k and v, given the
//   forward pass's output and the log-sum-exp of each query's scaled scores (torch's CPU flash
//   forward returns both: arlm.fused.causal_attention). bf16 tensors whose last dim is contiguous
//   (any other strides); H a multiple of H_kv (grouped-query attention: each k/v head serves
//   H / H_kv query heads); d a multiple of 32 up to 128. The outputs are bf16, laid out [B, T, H, d]
//   in memory (the projection's layout) and returned as [B, H, T, d] views.
//   start: optional [B, T] int32, the first key each query may read (a packed row's documents:
//   query t reads keys start[t] .. t; absent: 0, plain causal attention). Key blocks before every
//   query's start in a block are skipped.
// attention_backward_supported() -> bool: the kernel is built for this CPU (AVX512-BF16).
//
// Why: torch's CPU flash backward takes 5-9x its forward here (SmolLM2's heads, 4 x 256 positions:
// 15.5 ms against 1.8 ms a layer; 4 x 1,024: 90 against 17), ~20% of a fine-tuning step at context
// 256 and ~35% at 1,024 (benchmarks/train_speed.py --parts). The arithmetic is FlashAttention-2's
// backward: for each 64-key block j and each 64-query block i >= j, recompute the scores, then
//   P = exp(scale S - lse),  dP = dO V^T,  dS = P (dP - D)  with D = rowsum(dO * out),
//   dV_j += P^T dO_i,  dK_j += scale dS^T Q_i,  dQ_i += scale dS K_j,
// float32 accumulation throughout; P and dS are rounded to bf16 for the three products that take
// them, as flash kernels do (tests/test_train_attention.py compares with float64 and with torch's).
// Work is split by (batch, k/v head): the group's query heads accumulate into its dK and dV without
// sharing. Every product is one micro-kernel (`gemm`): C (+)= A B with A bf16 rows and B packed in
// pairs along the reduction (`vdpbf16ps` takes two bf16 products a lane). Everything is computed
// key-major (S^T, dP^T): the products that need P^T and dS^T take them as written, and dQ is
// accumulated transposed (dQ^T = K_j^T dS^T), written back once per query block.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ARLM_BF16_ATTENTION 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define ARLM_AMX_ATTENTION 1
#endif
#endif

namespace {

#ifdef ARLM_BF16_ATTENTION
using bf16 = at::BFloat16;
constexpr int64_t kBlock = 64;  // queries and keys a block

inline uint32_t pair_at(const bf16* p) {  // two adjacent bf16 values as one 32-bit word
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// C [M, 16 NV] (=, or += where accumulate) A [M, K] x B [K, 16 NV]: A bf16 rows (row stride lda),
// B packed in pairs along K (bp[(p * N + n) * 2 + e] = B[2p + e, n]), C float32 (row stride ldc).
// M a multiple of the rows a pass takes (4, or 2 for wide C), K even.
template <int NV>
void gemm(const bf16* a, int64_t lda, const bf16* bp, int64_t M, int64_t K, float* c, int64_t ldc, bool accumulate) {
  constexpr int R = NV <= 4 ? 4 : 2;  // rows a pass: R * NV accumulators in registers
  constexpr int64_t N = 16 * NV;
  for (int64_t r0 = 0; r0 < M; r0 += R) {
    __m512 acc[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v)
        acc[r][v] = accumulate ? _mm512_loadu_ps(c + (r0 + r) * ldc + 16 * v) : _mm512_setzero_ps();
    for (int64_t p = 0; p < K / 2; ++p) {
      __m512bh b[NV];
      for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(bp + (p * N + 16 * v) * 2);
      for (int r = 0; r < R; ++r) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(a + (r0 + r) * lda + 2 * p)));
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x, b[v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + (r0 + r) * ldc + 16 * v, acc[r][v]);
  }
}

#ifdef ARLM_AMX_ATTENTION
// The same product on the AMX tiles (M, N and K multiples of 32): tdpbf16ps multiplies 16 rows of
// 32 bf16 by 32 x 16 (packed in pairs: the layout above) into 16 x 16 float32, ~30x vdpbf16ps's
// products an instruction. Tiles 0-3: a 32 x 32 block of C; 4, 5: A's two 16-row halves; 6, 7: B's
// two 16-column halves.
bool amx_ready() {  // Linux grants the tiles' state to a process that asks (once)
  static const bool ready = [] {
    const char* off = std::getenv("ARLM_ATTENTION_AMX");
    if (off && std::strcmp(off, "0") == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ready;
}

void configure_tiles() {  // every tile 16 rows of 64 bytes
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

void amx_gemm(int64_t N, const bf16* a, int64_t lda, const bf16* bp, int64_t M, int64_t K, float* c, int64_t ldc,
              bool accumulate) {
  const int64_t sa = lda * 2, sb = N * 4, sc = ldc * 4;  // row strides in bytes
  for (int64_t m0 = 0; m0 < M; m0 += 32)
    for (int64_t n0 = 0; n0 < N; n0 += 32) {
      float* c0 = c + m0 * ldc + n0;
      if (accumulate) {
        _tile_loadd(0, c0, sc);
        _tile_loadd(1, c0 + 16, sc);
        _tile_loadd(2, c0 + 16 * ldc, sc);
        _tile_loadd(3, c0 + 16 * ldc + 16, sc);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t k0 = 0; k0 < K; k0 += 32) {
        _tile_loadd(4, a + m0 * lda + k0, sa);
        _tile_loadd(5, a + (m0 + 16) * lda + k0, sa);
        _tile_loadd(6, bp + ((k0 / 2) * N + n0) * 2, sb);
        _tile_loadd(7, bp + ((k0 / 2) * N + n0 + 16) * 2, sb);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c0, sc);
      _tile_stored(1, c0 + 16, sc);
      _tile_stored(2, c0 + 16 * ldc, sc);
      _tile_stored(3, c0 + 16 * ldc + 16, sc);
    }
}
#endif

// gemm for an N known at run time (64 or d): d in {32, 64, 96, 128}; on the tiles where granted.
void gemm_n(int64_t N, const bf16* a, int64_t lda, const bf16* bp, int64_t M, int64_t K, float* c, int64_t ldc,
            bool accumulate) {
#ifdef ARLM_AMX_ATTENTION
  if (amx_ready()) return amx_gemm(N, a, lda, bp, M, K, c, ldc, accumulate);
#endif
  switch (N) {
    case 32: return gemm<2>(a, lda, bp, M, K, c, ldc, accumulate);
    case 64: return gemm<4>(a, lda, bp, M, K, c, ldc, accumulate);
    case 96: return gemm<6>(a, lda, bp, M, K, c, ldc, accumulate);
    default: return gemm<8>(a, lda, bp, M, K, c, ldc, accumulate);
  }
}

// Two rows of 16 bf16 (a, b) as 16 pairs (a0 b0 a1 b1 ...).
inline __m512i interleave(__m256i a, __m256i b) {
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_load_si512(order), _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
}

inline __m256i load16(const bf16* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// B operands. rows [n, w] bf16 (row stride ld, even; n <= 64 valid rows, zero beyond):
// pairs along a row (B = rows^T: [w, 64], packed [w/2][64][2]), or along the rows (B = rows: [64, w],
// packed [32][w][2]).
void pack_row_pairs(const bf16* rows, int64_t ld, int64_t n, int64_t w, bf16* out) {
  auto* o = reinterpret_cast<uint32_t*>(out);
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t r0 = 0; r0 < kBlock; r0 += 16) {
    const __mmask16 valid = n - r0 >= 16 ? 0xFFFF : n > r0 ? static_cast<__mmask16>((1u << (n - r0)) - 1) : 0;
    const __m512i index = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(static_cast<int>(ld / 2)));  // in words
    const auto* base = reinterpret_cast<const int*>(rows + r0 * ld);
    for (int64_t p = 0; p < w / 2; ++p)
      _mm512_storeu_si512(o + p * kBlock + r0,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, index, base + p, 4));
  }
}
void pack_column_pairs(const bf16* rows, int64_t ld, int64_t n, int64_t w, bf16* out) {
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t p = 0; p < kBlock / 2; ++p) {
    const bf16* a = rows + 2 * p * ld;
    const bf16* b = a + ld;
    for (int64_t col = 0; col < w; col += 16)
      _mm512_storeu_si512(out + (p * w + col) * 2, interleave(2 * p < n ? load16(a + col) : zero,
                                                               2 * p + 1 < n ? load16(b + col) : zero));
  }
}

// rows [n, w] into a zero-padded [64, w] block.
void copy_block(const bf16* rows, int64_t ld, int64_t n, int64_t w, bf16* out) {
  for (int64_t r = 0; r < kBlock; ++r) {
    if (r < n) std::memcpy(out + r * w, rows + r * ld, w * sizeof(bf16));
    else std::memset(static_cast<void*>(out + r * w), 0, w * sizeof(bf16));
  }
}

struct Strides {  // element strides of a [B, H, T, d] tensor (d contiguous)
  int64_t b, h, t;
  explicit Strides(const at::Tensor& x) : b(x.stride(0)), h(x.stride(1)), t(x.stride(2)) {}
  int64_t at(int64_t bi, int64_t hi, int64_t ti) const { return bi * b + hi * h + ti * t; }
};

// One (batch, k/v head): its query heads' contributions to dK and dV, and their dQ.
struct Task {
  const bf16 *q, *k, *v, *out, *dout;
  const float* lse;
  const int32_t* start;  // [B, T] or null
  bf16 *dq, *dk, *dv;
  Strides sq, sk, sv, so, sdo, sdq, sdk;
  int64_t lse_b, lse_h, lse_t;
  int64_t T, d, group;
  float scale;

  void run(int64_t b, int64_t g) const {
#ifdef ARLM_AMX_ATTENTION
    if (amx_ready()) configure_tiles();  // (per thread; torch's own GEMMs configure theirs)
#endif
    const int64_t nb = (T + kBlock - 1) / kBlock, W = kBlock * d;
    // per key block: K and V rows (zero-padded), K^T as rows [d, 64]
    std::vector<bf16> kpad(nb * W), vpad(nb * W), kt(nb * W);
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t n = std::min(kBlock, T - j * kBlock);
      copy_block(k + sk.at(b, g, j * kBlock), sk.t, n, d, kpad.data() + j * W);
      copy_block(v + sv.at(b, g, j * kBlock), sv.t, n, d, vpad.data() + j * W);
      for (int64_t r = 0; r < kBlock; ++r)
        for (int64_t c = 0; c < d; ++c) kt[j * W + c * kBlock + r] = kpad[j * W + r * d + c];
    }
    std::vector<float> dk_acc(nb * W, 0.f), dv_acc(nb * W, 0.f);
    std::vector<bf16> q_d(W), do_d(W), q_t(W), do_t(W);  // B operands of the query block
    std::vector<float> st(kBlock * kBlock), dpt(kBlock * kBlock), dqt(W), lse_i(kBlock), d_i(kBlock);
    std::vector<int32_t> start_i(kBlock, 0);
    std::vector<bf16> pt(kBlock * kBlock), dst(kBlock * kBlock), dst_pairs(kBlock * kBlock);
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      for (int64_t i = 0; i < nb; ++i) {
        const int64_t n = std::min(kBlock, T - i * kBlock);
        const bf16* qi = q + sq.at(b, h, i * kBlock);
        const bf16* doi = dout + sdo.at(b, h, i * kBlock);
        pack_row_pairs(qi, sq.t, n, d, q_d.data());      // Q_i^T: S^T = K_j Q_i^T
        pack_row_pairs(doi, sdo.t, n, d, do_d.data());   // dO_i^T: dP^T = V_j dO_i^T
        pack_column_pairs(qi, sq.t, n, d, q_t.data());   // Q_i: dK_j += dS^T Q_i
        pack_column_pairs(doi, sdo.t, n, d, do_t.data()); // dO_i: dV_j += P^T dO_i
        for (int64_t r = 0; r < kBlock; ++r) {
          if (r >= n) {  // padding queries: P = 0 (lse = inf), dS = 0
            lse_i[r] = std::numeric_limits<float>::infinity();
            d_i[r] = 0.f;
            continue;
          }
          lse_i[r] = lse[b * lse_b + h * lse_h + (i * kBlock + r) * lse_t];
          const bf16* o_row = out + so.at(b, h, i * kBlock + r);
          const bf16* g_row = doi + r * sdo.t;
          float s = 0.f;
          for (int64_t c = 0; c < d; ++c) s += static_cast<float>(o_row[c]) * static_cast<float>(g_row[c]);
          d_i[r] = s;
        }
        int64_t first = 0;  // the first key block a query of this block reads
        if (start) {
          int32_t lowest = static_cast<int32_t>(i * kBlock);
          for (int64_t r = 0; r < kBlock; ++r) {
            start_i[r] = r < n ? start[b * T + i * kBlock + r] : 0;
            if (r < n) lowest = std::min(lowest, start_i[r]);
          }
          first = lowest / kBlock;
        }
        for (int64_t j = first; j <= i; ++j) {
          gemm_n(kBlock, kpad.data() + j * W, d, q_d.data(), kBlock, d, st.data(), kBlock, false);   // S^T [key, q]
          gemm_n(kBlock, vpad.data() + j * W, d, do_d.data(), kBlock, d, dpt.data(), kBlock, false); // dP^T
          scores_to_gradients(st.data(), dpt.data(), lse_i.data(), d_i.data(), j == i,
                              start ? start_i.data() : nullptr, j * kBlock, pt.data(), dst.data(), dst_pairs.data());
          gemm_n(d, pt.data(), kBlock, do_t.data(), kBlock, kBlock, dv_acc.data() + j * W, d, true);
          gemm_n(d, dst.data(), kBlock, q_t.data(), kBlock, kBlock, dk_acc.data() + j * W, d, true);
          // dQ_i^T += K_j^T dS^T
          gemm_n(kBlock, kt.data() + j * W, kBlock, dst_pairs.data(), d, kBlock, dqt.data(), kBlock, j > first);
        }
        bf16* dqi = dq + sdq.at(b, h, i * kBlock);
        for (int64_t r = 0; r < n; ++r)
          for (int64_t c = 0; c < d; ++c) dqi[r * sdq.t + c] = bf16(dqt[c * kBlock + r] * scale);
      }
    }
    for (int64_t t = 0; t < T; ++t) {
      bf16* dk_row = dk + sdk.at(b, g, t);
      bf16* dv_row = dv + sdk.at(b, g, t);
      for (int64_t c = 0; c < d; ++c) {
        dk_row[c] = bf16(dk_acc[t * d + c] * scale);
        dv_row[c] = bf16(dv_acc[t * d + c]);
      }
    }
#ifdef ARLM_AMX_ATTENTION
    if (amx_ready()) _tile_release();
#endif
  }

  // One [64 keys, 64 queries] tile: S^T and dP^T in, P^T and dS^T out (bf16; dS^T also packed in
  // pairs of keys for dQ^T's product). diagonal: the block where key > query is masked; start_i:
  // each query's first key (null: 0), key0 the block's first key.
  void scores_to_gradients(const float* st, const float* dpt, const float* lse_i, const float* d_i, bool diagonal,
                           const int32_t* start_i, int64_t key0, bf16* pt, bf16* dst, bf16* dst_pairs) const {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t key = 0; key < kBlock; key += 2) {
      for (int64_t q0 = 0; q0 < kBlock; q0 += 16) {
        __m256i ds16[2];
        for (int64_t e = 0; e < 2; ++e) {
          const int64_t at = (key + e) * kBlock + q0;
          __m512 p = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(st + at), vscale, _mm512_loadu_ps(lse_i + q0)));
          if (diagonal) {  // queries q0 + lane < key get nothing from this key
            const int64_t first = key + e - q0;  // first lane allowed
            if (first >= 16) p = _mm512_setzero_ps();
            else if (first > 0) p = _mm512_maskz_mov_ps(static_cast<__mmask16>(0xFFFFu << first), p);
          }
          if (start_i) {  // queries whose document starts after this key
            const __m512i from = _mm512_loadu_si512(start_i + q0);
            const __mmask16 reads = _mm512_cmple_epi32_mask(from, _mm512_set1_epi32(static_cast<int>(key0 + key + e)));
            p = _mm512_maskz_mov_ps(reads, p);
          }
          const __m512 ds = _mm512_mul_ps(p, _mm512_sub_ps(_mm512_loadu_ps(dpt + at), _mm512_loadu_ps(d_i + q0)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pt + at), (__m256i)_mm512_cvtneps_pbh(p));
          ds16[e] = (__m256i)_mm512_cvtneps_pbh(ds);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + at), ds16[e]);
        }
        // pairs of keys: element (key, q) at ((key / 2) * 64 + q) * 2 + key % 2
        _mm512_storeu_si512(dst_pairs + ((key / 2) * kBlock + q0) * 2, interleave(ds16[0], ds16[1]));
      }
    }
  }

  // e^x for 16 lanes: 2^n e^y with n = round(x log2 e), |y| <= ln 2 / 2, e^y by its Taylor series to
  // y^6 (relative error below 2e-7); x below -87.2 (and -inf: padding queries) gives 0.
  static __m512 exp16(__m512 x) {
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));  // below: 0 after the bf16 rounding anyway
    const __m512 t = _mm512_mul_ps(x, log2e);
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);  // [-0.5, 0.5]: 2^f by its Taylor series in f ln 2
    const __m512 y = _mm512_mul_ps(f, _mm512_set1_ps(0.693147180559945309f));
    __m512 r = _mm512_set1_ps(1.f / 720.f);
    r = _mm512_fmadd_ps(r, y, _mm512_set1_ps(1.f / 120.f));
    r = _mm512_fmadd_ps(r, y, _mm512_set1_ps(1.f / 24.f));
    r = _mm512_fmadd_ps(r, y, _mm512_set1_ps(1.f / 6.f));
    r = _mm512_fmadd_ps(r, y, _mm512_set1_ps(0.5f));
    r = _mm512_fmadd_ps(r, y, _mm512_set1_ps(1.f));
    r = _mm512_fmadd_ps(r, y, _mm512_set1_ps(1.f));
    const __m512 e = _mm512_scalef_ps(r, n);
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.2f), _CMP_GT_OQ), e);
  }
};
#endif

void check(const at::Tensor& x, const char* name, int64_t dims) {
  TORCH_CHECK(x.dim() == dims && (x.stride(-1) == 1 || x.numel() == 0) && x.device().is_cpu(),
              "attention_backward: ", name, " must be a CPU tensor of ", dims, " dims with its last dim contiguous");
}

}  // namespace

bool attention_backward_supported() {
#ifdef ARLM_BF16_ATTENTION
  return true;
#else
  return false;
#endif
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& dout,
    const at::Tensor& lse, const std::optional<at::Tensor>& start, double scale) {
#ifdef ARLM_BF16_ATTENTION
  check(q, "q", 4), check(k, "k", 4), check(v, "v", 4), check(out, "out", 4), check(dout, "dout", 4);
  TORCH_CHECK(lse.dim() == 3 && lse.scalar_type() == at::kFloat, "attention_backward: lse [B, H, T] float32");
  for (const auto* x : {&q, &k, &v, &out, &dout})
    TORCH_CHECK(x->scalar_type() == at::kBFloat16, "attention_backward: bf16 q, k, v, out and dout");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), d = q.size(3), Hkv = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(2) == T && k.size(3) == d && Hkv > 0 &&
              H % Hkv == 0 && out.sizes() == q.sizes() && dout.sizes() == q.sizes() &&
              lse.size(0) == B && lse.size(1) == H && lse.size(2) == T,
              "attention_backward: shapes q [B, H, T, d], k and v [B, H_kv, T, d], H a multiple of H_kv");
  TORCH_CHECK(d % 32 == 0 && d <= 128, "attention_backward: head size a multiple of 32 up to 128");
  TORCH_CHECK(!start || (start->scalar_type() == at::kInt && start->is_contiguous() && start->dim() == 2 &&
                         start->size(0) == B && start->size(1) == T),
              "attention_backward: start [B, T] int32, contiguous");
  TORCH_CHECK(q.stride(2) % 2 == 0 && dout.stride(2) % 2 == 0,
              "attention_backward: q and dout with an even step between positions (their rows are read in pairs)");
  if (start) {
    const int32_t* first = start->data_ptr<int32_t>();
    for (int64_t i = 0; i < B * T; ++i)
      TORCH_CHECK(first[i] >= 0 && first[i] <= i % T, "attention_backward: start[t] must lie in 0 .. t");
  }
  // [B, T, H, d] in memory, returned as [B, H, T, d]
  auto dq = at::empty({B, T, H, d}, q.options()).transpose(1, 2);
  auto dk = at::empty({B, T, Hkv, d}, k.options()).transpose(1, 2);
  auto dv = at::empty({B, T, Hkv, d}, k.options()).transpose(1, 2);
  Task task{q.data_ptr<bf16>(), k.data_ptr<bf16>(), v.data_ptr<bf16>(), out.data_ptr<bf16>(),
            dout.data_ptr<bf16>(), lse.data_ptr<float>(), start ? start->data_ptr<int32_t>() : nullptr,
            dq.data_ptr<bf16>(), dk.data_ptr<bf16>(),
            dv.data_ptr<bf16>(), Strides(q), Strides(k), Strides(v), Strides(out), Strides(dout), Strides(dq),
            Strides(dk), lse.stride(0), lse.stride(1), lse.stride(2), T, d, H / Hkv, static_cast<float>(scale)};
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) task.run(w / Hkv, w % Hkv);
  });
  return {dq, dk, dv};
#else
  TORCH_CHECK(false, "attention_backward: built without AVX512-BF16 (use torch's attention backward)");
#endif
}

TORCH_LIBRARY_FRAGMENT(arlm_train, m) {
  m.def("attention_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor dout, Tensor lse, Tensor? start, "
        "float scale) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("attention_backward_supported() -> bool", &attention_backward_supported);
}

TORCH_LIBRARY_IMPL(arlm_train, CPU, m) { m.impl("attention_backward", &attention_backward); }
