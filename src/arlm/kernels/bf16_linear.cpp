// bf16 weights times bf16 activations, float32 sums and a float32 result: the prompt's GEMMs of
// `--matmul-path bf16` on CPUs with AVX512-BF16 (and no AMX: there torch's own bf16 GEMM takes the
// tiles, decode.cpp's linear_into).
//
// torch's bf16 matmul on CPU rounds its result to bf16 (no float32 output on CPU in torch 2.13):
// in a prefill that rounding, 2^-9 of every output, costs 4x the KL divergence from float32 of
// the inputs' own rounding (docs/benchmarks.md, prefill against the matrix peak). Here x is
// rounded to bf16 once (round to nearest even), each product is exact in float32 and the sums
// stay float32 (vdpbf16ps: a pair of K-values per lane), so the only roundings are the inputs'.
//
// Layout (arlm.kernels.pack_bf16): wp [N/16, K/2, 32] bf16: for each block of 16 output channels
// and each pair of K-values, the 16 channels' pairs side by side (vdpbf16ps's operand shape). A
// row of x against a block is one chain of K/2 instructions into one accumulator per channel, in
// K order: a row's result does not depend on the other rows, the tiling or the thread count.
#include "aten.h"
#include <immintrin.h>

#include "common.h"

#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // output channels per block

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define ARLM_BF16 1

// Rows of x (float32 [M, K]) rounded to bf16, as 32-bit pairs: xb[m * K/2 + p] = (x[2p], x[2p+1]).
void round_rows(const float* x, int64_t M, int64_t K, uint32_t* xb) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* r = x + m * K;
      uint32_t* o = xb + m * (K / 2);
      int64_t k = 0;
      for (; k + 32 <= K; k += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(r + k + 16), _mm512_loadu_ps(r + k));
        _mm512_storeu_si512(o + k / 2, reinterpret_cast<const __m512i&>(v));
      }
      for (; k < K; k += 2) {  // (K a multiple of 2; the tail one pair at a time, rounded alike)
        const __m128bh v = _mm_cvtneps_pbh(_mm_setr_ps(r[k], r[k + 1], 0.f, 0.f));
        std::memcpy(o + k / 2, &v, 4);
      }
    }
  });
}

// MB rows of x against NB blocks of 16 channels: y (+)= x W^T for them.
template <int MB, int NB>
void tile(const uint32_t* xb, int64_t K, const uint16_t* w, float* y, int64_t ldy, bool accumulate) {
  const int64_t P = K / 2, block = P * 2 * kLanes;  // bf16 values per block of 16 channels
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int64_t p = 0; p < P; ++p) {
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) {
      const __m512i v = _mm512_loadu_si512(w + b * block + p * 2 * kLanes);
      wv[b] = reinterpret_cast<const __m512bh&>(v);
    }
    for (int i = 0; i < MB; ++i) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(xb[i * P + p]));
      const __m512bh xh = reinterpret_cast<const __m512bh&>(xv);
      for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_dpbf16_ps(acc[i][b], wv[b], xh);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int b = 0; b < NB; ++b) {
      float* yr = y + i * ldy + b * kLanes;
      _mm512_storeu_ps(yr, accumulate ? _mm512_add_ps(_mm512_loadu_ps(yr), acc[i][b]) : acc[i][b]);
    }
}

template <int NB>
void rows(const uint32_t* xb, int64_t M, int64_t K, const uint16_t* w, float* y, int64_t ldy, bool accumulate) {
  int64_t m = 0;
  const int64_t P = K / 2;
  for (; m + 4 <= M; m += 4) tile<4, NB>(xb + m * P, K, w, y + m * ldy, ldy, accumulate);
  for (; m + 2 <= M; m += 2) tile<2, NB>(xb + m * P, K, w, y + m * ldy, ldy, accumulate);
  for (; m < M; ++m) tile<1, NB>(xb + m * P, K, w, y + m * ldy, ldy, accumulate);
}
#endif

}  // namespace

bool arlm_kernels::bf16_packed(const at::Tensor& w) { return w.dim() == 3 && w.scalar_type() == at::kBFloat16; }

void arlm_kernels::bf16_linear_into(const float* x, int64_t M, int64_t K, const at::Tensor& wp, float* y,
                                    int64_t ldy, bool accumulate) {
  TORCH_CHECK(bf16_packed(wp) && wp.is_contiguous() && wp.size(1) == K / 2 && wp.size(2) == 2 * kLanes &&
              K % 2 == 0, "bf16_linear: wp [N/16, K/2, 32] contiguous bfloat16 (K even)");
#ifdef ARLM_BF16
  const int64_t NB = wp.size(0), P = K / 2, block = P * 2 * kLanes;
  thread_local std::vector<uint32_t> scratch;  // x as bf16 pairs, kept and grown
  scratch.resize(std::max<size_t>(scratch.size(), M * P));
  uint32_t* xb = scratch.data();
  round_rows(x, M, K, xb);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>());
  // Tasks: 64 rows by 4 blocks (64 channels); a block's weights stay in L2 across its rows.
  constexpr int64_t kTaskRows = 64;
  const int64_t row_tasks = (M + kTaskRows - 1) / kTaskRows, col_tasks = (NB + 3) / 4;
  at::parallel_for(0, row_tasks * col_tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = (t % row_tasks) * kTaskRows, rows_here = std::min(kTaskRows, M - m0);
      const int64_t b0 = (t / row_tasks) * 4, nb = std::min<int64_t>(4, NB - b0);
      const uint32_t* xt = xb + m0 * P;
      const uint16_t* wt = w + b0 * block;
      float* yt = y + m0 * ldy + b0 * kLanes;
      switch (nb) {
        case 4: rows<4>(xt, rows_here, K, wt, yt, ldy, accumulate); break;
        case 3: rows<3>(xt, rows_here, K, wt, yt, ldy, accumulate); break;
        case 2: rows<2>(xt, rows_here, K, wt, yt, ldy, accumulate); break;
        default: rows<1>(xt, rows_here, K, wt, yt, ldy, accumulate);
      }
    }
  });
#else
  TORCH_CHECK(false, "bf16_linear: built without AVX512-BF16");
#endif
}

#ifndef ARLM_BARE  // (ops that return new tensors: torch's build only)
namespace {

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& wp) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "bf16_linear: x [M, K] float32");
  at::Tensor y = at::empty({x.size(0), wp.size(0) * kLanes}, x.options());
  arlm_kernels::bf16_linear_into(x.data_ptr<float>(), x.size(0), x.size(1), wp, y.data_ptr<float>(), y.size(1),
                                 false);
  return y;
}

bool bf16_kernel_available() {
#ifdef ARLM_BF16
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(arlm, m) {
  m.def("bf16_linear(Tensor x, Tensor wp) -> Tensor");
  m.def("bf16_kernel_available() -> bool", &bf16_kernel_available);
}

TORCH_LIBRARY_IMPL(arlm, CPU, m) { m.impl("bf16_linear", &bf16_linear); }
#endif  // ARLM_BARE
