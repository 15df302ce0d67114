// Paged attention for CPU serving: write each new token's K/V into its block, then attend every
// query to the keys of its own sequence, read in place through the block table.
//
// The batch is flattened: N tokens from any number of sequences (one decode token each, or a
// chunk of a prompt), token i belonging to sequence seq[i] at position pos[i]. Each query reads
// keys 0..pos[i] of its sequence, one block at a time, and nothing else: no gather copy, no
// padding, no mask. Every query's result is computed in the same order whatever else is in the
// batch, so a sequence's logits are bit-identical alone, in a batch, or prefilled in chunks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "../kernels/common.h"  // softmax_numerators

namespace {

inline float dot(const float* a, const float* b, int64_t D) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 16 == 0) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
    }
    __m256 s = _mm256_add_ps(s0, s1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
  }
#endif
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

inline void axpy(float w, const float* x, float* y, int64_t D) {  // y += w * x
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    const __m256 wv = _mm256_set1_ps(w);
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(y + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) y[d] += w * x[d];
}

}  // namespace

// q [N, H, D]; k, v [N, Hkv, D]; k_pool, v_pool [n_blocks, Hkv, BS, D] (written in place);
// block_table [S, M], seq, pos [N]: int64. Returns [N, H, D].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_pool,
                           at::Tensor v_pool, const at::Tensor& block_table, const at::Tensor& seq,
                           const at::Tensor& pos, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k_pool.dim() == 4 && v_pool.dim() == 4,
              "paged_attention: q [N,H,D], k/v [N,Hkv,D], pools [n_blocks,Hkv,BS,D]");
  for (const at::Tensor& t : {q, k, v, k_pool, v_pool}) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "paged_attention: contiguous float32");
  }
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq.scalar_type() == at::kLong && pos.scalar_type() == at::kLong
              && block_table.is_contiguous() && seq.is_contiguous() && pos.is_contiguous(),
              "paged_attention: block_table, seq, pos contiguous int64");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
  const int64_t BS = k_pool.size(2), M = block_table.size(1), n_blocks = k_pool.size(0);
  TORCH_CHECK(H % Hkv == 0 && k_pool.size(1) == Hkv && k_pool.size(3) == D && v_pool.sizes() == k_pool.sizes(),
              "paged_attention: shape mismatch");
  const int64_t group = H / Hkv;
  const int64_t* bt = block_table.data_ptr<int64_t>();
  const int64_t* sp = seq.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) {  // cheap bounds check: a bad table must not write out of the pool
    TORCH_CHECK(sp[i] >= 0 && sp[i] < block_table.size(0) && pp[i] >= 0 && pp[i] / BS < M,
                "paged_attention: token ", i, " has no block-table entry");
    const int64_t blk = bt[sp[i] * M + pp[i] / BS];
    TORCH_CHECK(blk >= 0 && blk < n_blocks, "paged_attention: block id out of range");
  }
  float* kp = k_pool.data_ptr<float>();
  float* vp = v_pool.data_ptr<float>();
  const float* qd = q.data_ptr<float>();
  const float* kd = k.data_ptr<float>();
  const float* vd = v.data_ptr<float>();

  // 1. Write: token i's K/V go to slot pos % BS of block block_table[seq, pos / BS].
  at::parallel_for(0, N, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t blk = bt[sp[i] * M + pp[i] / BS], slot = pp[i] % BS;
      for (int64_t g = 0; g < Hkv; ++g) {
        const int64_t dst = ((blk * Hkv + g) * BS + slot) * D;
        std::copy(kd + (i * Hkv + g) * D, kd + (i * Hkv + g + 1) * D, kp + dst);
        std::copy(vd + (i * Hkv + g) * D, vd + (i * Hkv + g + 1) * D, vp + dst);
      }
    }
  });

  // 2. Attend: one (token, query head) per work item; softmax(q.K / sqrt(D)) V over 0..pos.
  at::Tensor out = at::zeros({N, H, D}, q.options());
  float* od = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, N * H, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t i = w / H, h = w % H, g = h / group;
      const int64_t L = pp[i] + 1;
      const int64_t* row = bt + sp[i] * M;
      const float* qv = qd + (i * H + h) * D;
      scores.resize(L);
      for (int64_t j0 = 0; j0 < L; j0 += BS) {
        const float* kb = kp + (row[j0 / BS] * Hkv + g) * BS * D;
        const int64_t n = std::min(BS, L - j0);
        for (int64_t s = 0; s < n; ++s) scores[j0 + s] = dot(qv, kb + s * D, D) * fscale;
      }
      const float total = arlm_kernels::softmax_numerators(scores.data(), L);
      float* o = od + (i * H + h) * D;
      for (int64_t j0 = 0; j0 < L; j0 += BS) {
        const float* vb = vp + (row[j0 / BS] * Hkv + g) * BS * D;
        const int64_t n = std::min(BS, L - j0);
        for (int64_t s = 0; s < n; ++s) axpy(scores[j0 + s], vb + s * D, o, D);
      }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
  return out;
}

TORCH_LIBRARY(arlm_serve, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor block_table, "
        "Tensor seq, Tensor pos, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(arlm_serve, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
