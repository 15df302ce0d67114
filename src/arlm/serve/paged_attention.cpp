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

#include "../kernels/common.h"  // attend_head


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
  at::Tensor out = at::empty({N, H, D}, q.options());
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
      auto blocks = [&](auto f) {  // slots 0..L-1 of the sequence, a block at a time
        for (int64_t j0 = 0; j0 < L; j0 += BS) {
          const int64_t off = (row[j0 / BS] * Hkv + g) * BS * D;
          f(kp + off, vp + off, std::min(BS, L - j0));
        }
      };
      arlm_kernels::attend_head(qv, D, L, fscale, blocks, scores.data(), od + (i * H + h) * D);
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
