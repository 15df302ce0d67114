// The paged-attention op: the module path's attention over the KV cache through a block table
// (arlm.kv_cache.KVCache.attend); the native layer stack calls the same code directly (paged_attention.h).
#include "aten.h"

#include <optional>

#include "paged_attention.h"

// q [N, H, D]; k, v [N, Hkv, D] float32; k_pool, v_pool [n_blocks, Hkv, BS, row] (written in
// place) in the cache's format (kv_format, attention.h: float32 or float16 rows of D, or quantized
// uint8 rows); block_table [S, M], seq, pos [N]: int64. Returns [N, H, D].
#ifndef ARLM_BARE  // (ops that return new tensors: torch's build only)
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_pool,
                           at::Tensor v_pool, const at::Tensor& block_table, const at::Tensor& seq,
                           const at::Tensor& pos, double scale, int64_t kv_format, int64_t window, int64_t sinks,
                           const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k_pool.dim() == 4 && v_pool.dim() == 4,
              "paged_attention: q [N,H,D], k/v [N,Hkv,D], pools [n_blocks,Hkv,BS,row]");
  for (const at::Tensor& t : {q, k, v}) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "paged_attention: contiguous float32 q, k, v");
  }
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq.scalar_type() == at::kLong && pos.scalar_type() == at::kLong
              && block_table.is_contiguous() && seq.is_contiguous() && pos.is_contiguous(),
              "paged_attention: block_table, seq, pos contiguous int64");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
  const int64_t BS = k_pool.size(2), M = block_table.size(1), n_blocks = k_pool.size(0);
  TORCH_CHECK(H % Hkv == 0 && k.size(0) == N && k.size(2) == D && v.sizes() == k.sizes() && k_pool.size(1) == Hkv &&
              v_pool.size(1) == Hkv && v_pool.size(0) == n_blocks && v_pool.size(2) == BS,
              "paged_attention: shape mismatch");
  const int64_t* bt = block_table.data_ptr<int64_t>();
  const int64_t* sp = seq.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  arlm_kernels::check_block_table("paged_attention", bt, block_table.size(0), M, sp, pp, N, BS, n_blocks);
  arlm_kernels::Window win;
  if (window > 0) {  // sliding window + sinks: the RoPE tables rotate the sink queries (paged_attention.h)
    TORCH_CHECK(sinks >= 0 && cos && sin && cos->dim() == 2 && cos->size(1) == D && sin->sizes() == cos->sizes() &&
                cos->scalar_type() == at::kFloat && sin->scalar_type() == at::kFloat && cos->is_contiguous() &&
                sin->is_contiguous(), "paged_attention: a window needs sinks >= 0 and cos/sin [max_T, D] float32");
    for (int64_t i = 0; i < N; ++i)
      TORCH_CHECK(pp[i] < cos->size(0), "paged_attention: position past the RoPE table");
    win = {window, sinks, cos->data_ptr<float>(), sin->data_ptr<float>()};
  }
  at::Tensor out = at::empty({N, H, D}, q.options());
  arlm_kernels::with_kv("paged_attention", k_pool, v_pool, kv_format, D, [&](auto* kp, auto* vp) {
    arlm_kernels::paged_attention(q.data_ptr<float>(), H * D, k.data_ptr<float>(), v.data_ptr<float>(), Hkv * D, kp,
                                  vp, bt, M, sp, pp, N, H, Hkv, D, BS, static_cast<float>(scale),
                                  out.data_ptr<float>(), win);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(arlm, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor block_table, "
        "Tensor seq, Tensor pos, float scale, int kv_format=0, int window=0, int sinks=0, Tensor? cos=None, "
        "Tensor? sin=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(arlm, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
#endif  // ARLM_BARE
