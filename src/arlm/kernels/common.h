// What arlm's CPU linear kernels share (included by the .cpp files next to it): the weight
// layouts' argument checks and a SIMD helper.
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

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

// int8 weights: x [M, K] float32, w [N, K] int8, scale [N] float32, all contiguous (K a multiple
// of 32 where the kernel works in groups).
inline void check_int8(const char* op, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                       bool groups_of_32) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scale.dim() == 1, op, ": x [M,K], w [N,K], scale [N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat,
              op, ": x float32, w int8, scale float32");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && scale.is_contiguous(), op, ": contiguous inputs");
  TORCH_CHECK(w.size(1) == x.size(1) && scale.size(0) == w.size(0) && (!groups_of_32 || x.size(1) % 32 == 0),
              op, groups_of_32 ? ": shape mismatch (K must be a multiple of 32)" : ": shape mismatch");
}

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
