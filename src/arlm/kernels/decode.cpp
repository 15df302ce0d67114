// The decode step of a Llama-family model (RMSNorm, RoPE, grouped-query attention, SwiGLU, no
// biases) as one native call over all layers: [B, d] embeddings in, [B, d] hidden state out.
//
// It does the same math as `Transformer.forward` with a KV cache, op for op: the Python module
// path is the reference (tests/test_fused_decode.py). What it removes is the overhead around the
// math. A decode step of SmolLM2-135M multiplies ~84 MB of 4-bit weights, a few milliseconds of
// memory traffic, but the module path spends as long again in ~2,000 small tensor ops
// (views, RoPE's cat/mul/add, the cache scatter, the attention mask, SDPA for one query row),
// each a dispatch and an allocation. Here each layer is: norm, one fused q/k/v matmul, RoPE and
// the cache write in place, attention of one query row per head over its row's cached slots,
// output matmul, norm, fused gate/up matmul, SiLU * up, down matmul; the matmuls are the same
// kernels the quantized layers call (a8_linear.cpp, int8_linear.cpp, q4_linear.cpp), or for
// float32 weights a row-streaming kernel below.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "common.h"
#include "paged_attention.h"

#include <cmath>
#include <vector>

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& mins);
at::Tensor int8_linear_a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);
at::Tensor q4_linear_a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& mins);
at::Tensor int8_linear_a8p(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale);
at::Tensor q4_linear_a8p(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale, const at::Tensor& mins);

namespace {

constexpr int64_t kRows = 4;
// Row-wise work (norms, RoPE) goes to the thread pool in tasks of this many rows: a batch of 32
// splits across the cores, a single row stays on the calling thread (no hand-off).
constexpr int64_t kRowsPerTask = 8;

#if defined(__AVX2__) && defined(__FMA__)
using arlm_kernels::hsum;
#endif

// float32 y[m, n] = x[m, :] . w[n, :] for a few rows of x: each weight row is streamed once and
// reused for every row of x (decode is a matrix-vector product; MKL's is slow at these shapes).
// Rows of x are not batch-invariant here: above 4 rows the GEMM sums in its own order (float32
// models only; the quantized kernels are invariant).
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.scalar_type() == at::kFloat &&
              w.scalar_type() == at::kFloat && x.is_contiguous() && w.is_contiguous(),
              "f32_linear: x [M, K], w [N, K], contiguous float32");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (M > 4 || K % 8 != 0) return at::matmul(x, w.t());  // enough rows: a GEMM is the right tool
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + kRows - 1) / kRows, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t n = t0 * kRows; n < std::min(N, t1 * kRows); n += kRows) {
      const int64_t rows = std::min(kRows, N - n);
      for (int64_t m = 0; m < M; ++m) {
#if defined(__AVX512F__)
        if (K % 64 == 0) {  // each row read front to back: one sequential stream per thread
          for (int64_t r = 0; r < rows; ++r) {
            const float* wr = wp + (n + r) * K;
            const float* ahead = wp + std::min(n + r + 32, N - 1) * K;  // prefetch 32 rows on, within w
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
                   a3 = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 64) {
              _mm_prefetch(reinterpret_cast<const char*>(ahead + k), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(ahead + k + 16), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(ahead + k + 32), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(ahead + k + 48), _MM_HINT_T0);
              a0 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k), _mm512_loadu_ps(xp + m * K + k), a0);
              a1 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k + 16), _mm512_loadu_ps(xp + m * K + k + 16), a1);
              a2 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k + 32), _mm512_loadu_ps(xp + m * K + k + 32), a2);
              a3 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k + 48), _mm512_loadu_ps(xp + m * K + k + 48), a3);
            }
            yp[m * N + n + r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
          }
          continue;
        }
#endif
#if defined(__AVX2__) && defined(__FMA__)
        if (rows == kRows) {
          __m256 acc[kRows][2];
          for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
          int64_t k = 0;
          for (; k + 16 <= K; k += 16) {
            const __m256 x0 = _mm256_loadu_ps(xp + m * K + k), x1 = _mm256_loadu_ps(xp + m * K + k + 8);
            for (int r = 0; r < kRows; ++r) {
              acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(wp + (n + r) * K + k), x0, acc[r][0]);
              acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(wp + (n + r) * K + k + 8), x1, acc[r][1]);
            }
          }
          for (; k < K; k += 8) {
            const __m256 x0 = _mm256_loadu_ps(xp + m * K + k);
            for (int r = 0; r < kRows; ++r)
              acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(wp + (n + r) * K + k), x0, acc[r][0]);
          }
          for (int r = 0; r < kRows; ++r) yp[m * N + n + r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
          continue;
        }
#endif
        for (int64_t r = 0; r < rows; ++r) {
          float acc = 0.f;
          for (int64_t k = 0; k < K; ++k) acc += xp[m * K + k] * wp[(n + r) * K + k];
          yp[m * N + n + r] = acc;
        }
      }
    }
  });
  return y;
}

// One linear layer given as (w, scale, mins): 4-bit (w uint8), int8 (w int8, mins undefined),
// float32 (w float, scale and mins undefined), or either quantized kind in the packed layout
// (w 3-D, a8_linear.cpp; a8 only): int8 with scale [N] float32, 4-bit with scale [N/16, G, 16].
at::Tensor linear(const at::Tensor& x, const at::Tensor* p, bool a8) {
  const at::Tensor &w = p[0], &scale = p[1], &mins = p[2];
  if (w.dim() == 3) {
    TORCH_CHECK(a8, "decode: packed weights need 8-bit activations");
    return scale.dim() == 1 ? int8_linear_a8p(x, w, scale) : q4_linear_a8p(x, w, scale, mins);
  }
  if (w.scalar_type() == at::kByte) return a8 ? q4_linear_a8(x, w, scale, mins) : q4_linear(x, w, scale, mins);
  if (w.scalar_type() == at::kChar)
    return a8 && x.size(1) % 32 == 0 ? int8_linear_a8(x, w, scale) : int8_linear(x, w, scale);
  return f32_linear(x, w);
}

// out = x / sqrt(mean(x^2) + eps) * weight, row by row (as F.rms_norm, then the weight).
void rms_norm(const float* x, const float* weight, int64_t B, int64_t d, double eps, float* out) {
  at::parallel_for(0, B, kRowsPerTask, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* xr = x + b * d;
      float ss = 0.f;
      for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + static_cast<float>(eps));
      for (int64_t i = 0; i < d; ++i) out[b * d + i] = weight[i] * (xr[i] * inv);
    }
  });
}

// Half-split RoPE of one head in place: (x_i, x_{i + hd/2}) rotated by the angle of position pos.
inline void rope(float* v, const float* cos, const float* sin, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] - b * sin[i];
    v[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// out[i, j] = SiLU(gu[i, j]) * gu[i, dff + j] for N rows of the fused gate/up output [N, 2 dff].
// Every element takes the same instructions whatever N (masked tail per row): batch-invariant.
void silu_mul(const float* gu, int64_t N, int64_t dff, float* out) {
  at::parallel_for(0, N, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* g = gu + i * 2 * dff;
      const float* u = g + dff;
      float* o = out + i * dff;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (int64_t j = 0; j < dff; j += 16) {
        const __mmask16 m = arlm_kernels::tail_mask(dff - j);
        const __m512 gv = _mm512_maskz_loadu_ps(m, g + j);
        const __m512 e = arlm_kernels::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(o + j, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + j)));
      }
#else
      for (int64_t j = 0; j < dff; ++j) o[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
#endif
    }
  });
}

}  // namespace

namespace {

// The layer stack, with attention left to `attend(layer, qkv)`: qkv [N, (H + 2 H_kv) * hd] holds
// the layer's queries, keys and values for the N tokens, RoPE already applied; it returns the
// attention output [N, H * hd]. x [N, d] is updated in place.
template <typename Attend>
void run_layers(at::Tensor& x, at::TensorList weights, int64_t L, const int64_t* pos, const float* cos,
                const float* sin, int64_t hd, int64_t H, int64_t Hkv, double eps, bool a8, Attend attend) {
  const int64_t N = x.size(0), d = x.size(1), qkv_dim = (H + 2 * Hkv) * hd;
  at::Tensor h = at::empty({N, d}, x.options());
  float* xp = x.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* W = weights.data() + 14 * l;
    // attention: norm, q/k/v, RoPE, attention (with the cache), output projection
    rms_norm(xp, W[0].data_ptr<float>(), N, d, eps, hp);
    at::Tensor qkv = linear(h, W + 1, a8);  // [N, (H + 2 Hkv) * hd]
    TORCH_CHECK(qkv.size(1) == qkv_dim, "decode_llama: wqkv has the wrong number of outputs");
    float* qp = qkv.data_ptr<float>();
    at::parallel_for(0, N, kRowsPerTask, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t j = 0; j < H + Hkv; ++j) rope(qp + i * qkv_dim + j * hd, cos + pos[i] * hd, sin + pos[i] * hd, hd);
    });
    x.add_(linear(attend(l, qkv), W + 4, a8));

    // MLP: norm, fused gate/up, SiLU(gate) * up, down
    rms_norm(xp, W[7].data_ptr<float>(), N, d, eps, hp);
    at::Tensor gu = linear(h, W + 8, a8);  // [N, 2 * d_ff]
    const int64_t dff = gu.size(1) / 2;
    at::Tensor act = at::empty({N, dff}, x.options());
    silu_mul(gu.data_ptr<float>(), N, dff, act.data_ptr<float>());
    x.add_(linear(act, W + 11, a8));
  }
}

void check_common(const at::Tensor& x, at::TensorList weights, int64_t L, const at::Tensor& pos,
                  const at::Tensor& cos, const at::Tensor& sin, int64_t hd, int64_t max_pos) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "decode_llama: x [N, d] float32");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 14 * L, "decode_llama: 14 weight tensors per layer");
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == x.size(0) && pos.scalar_type() == at::kLong && pos.is_contiguous(),
              "decode_llama: pos [N] int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.size(1) == hd && sin.sizes() == cos.sizes(),
              "decode_llama: cos/sin [max_T, hd] float32");
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < x.size(0); ++i)
    TORCH_CHECK(0 <= pp[i] && pp[i] < max_pos && pp[i] < cos.size(0), "decode_llama: position out of range");
  for (int64_t l = 0; l < L; ++l)
    for (int64_t j : {0, 7}) {  // the two norm weights of each layer (the linears check their own shapes)
      const at::Tensor& w = weights[14 * l + j];
      TORCH_CHECK(w.numel() == x.size(1) && w.scalar_type() == at::kFloat && w.is_contiguous(),
                  "decode_llama: norm weights must be contiguous float32 [d]");
    }
}

}  // namespace

// One decode step over a contiguous cache. x [B, d]: the step's token embeddings. weights: 14
// tensors per layer, in order: attn_norm, wqkv (w, scale, mins), wo (w, scale, mins), mlp_norm,
// gate_up (w, scale, mins), down (w, scale, mins); unused scale/mins are empty tensors. k_cache,
// v_cache [L, B, H_kv, T, hd] float32; pos [B] int64, each row's position (its K/V go to slot pos);
// attention reads slots 0..min(pos, kv_len - 1) of the row. cos, sin [max_T, hd]. Returns the
// hidden state after the last layer [B, d] (before the final norm).
at::Tensor decode_llama(const at::Tensor& x_in, at::TensorList weights, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& pos, const at::Tensor& cos,
                        const at::Tensor& sin, int64_t kv_len, int64_t n_head, int64_t n_kv_heads,
                        double eps, bool a8) {
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() && v_cache.scalar_type() == at::kFloat,
              "decode_llama: contiguous float32 caches [L, B, H_kv, T, hd]");
  const int64_t L = k_cache.size(0), B = x_in.size(0), T = k_cache.size(3), hd = k_cache.size(4);
  TORCH_CHECK(k_cache.size(1) == B && k_cache.size(2) == n_kv_heads && n_head % n_kv_heads == 0 && hd % 2 == 0,
              "decode_llama: cache shape does not match the batch or the heads");
  TORCH_CHECK(0 < kv_len && kv_len <= T, "decode_llama: kv_len out of range");
  check_common(x_in, weights, L, pos, cos, sin, hd, T);  // a finished row may sit past kv_len: written, never read
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t H = n_head, Hkv = n_kv_heads, group = H / Hkv, qkv_dim = (H + 2 * Hkv) * hd;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  at::Tensor x = x_in.contiguous().clone();
  at::Tensor attn = at::empty({B, H * hd}, x.options());
  at::Tensor scores = at::empty({B * H, kv_len}, x.options());
  float* ap = attn.data_ptr<float>();
  float* sp = scores.data_ptr<float>();

  auto attend = [&](int64_t l, at::Tensor& qkv) -> at::Tensor {
    float* qp = qkv.data_ptr<float>();
    float* kl = k_cache.data_ptr<float>() + l * B * Hkv * T * hd;
    float* vl = v_cache.data_ptr<float>() + l * B * Hkv * T * hd;
    for (int64_t b = 0; b < B; ++b)  // the new K/V into slot pos of the row
      for (int64_t j = 0; j < Hkv; ++j) {
        const float* k = qp + b * qkv_dim + (H + j) * hd;
        const float* v = qp + b * qkv_dim + (H + Hkv + j) * hd;
        std::copy(k, k + hd, kl + ((b * Hkv + j) * T + pp[b]) * hd);
        std::copy(v, v + hd, vl + ((b * Hkv + j) * T + pp[b]) * hd);
      }
    at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / H, head = i % H, kvh = head / group, n = std::min(pp[b] + 1, kv_len);
        const float* q = qp + b * qkv_dim + head * hd;
        const float* K = kl + (b * Hkv + kvh) * T * hd;
        const float* V = vl + (b * Hkv + kvh) * T * hd;
        arlm_kernels::attend_head(q, hd, n, scale, [&](auto f) { f(K, V, n); }, sp + i * kv_len,
                                  ap + b * H * hd + head * hd);
      }
    });
    return attn;
  };
  run_layers(x, weights, L, pp, cos.data_ptr<float>(), sin.data_ptr<float>(), hd, H, Hkv, eps, a8, attend);
  return x;
}

// The same layer stack over the serving engine's paged pool (arlm.serve.paged_cache): x [N, d]
// holds a flattened batch of tokens from any mix of sequences, token i of sequence seq_index[i]
// at position pos[i]. Attention (paged_attention.h) writes the new K/V into the blocks and
// attends through the block table.
at::Tensor forward_llama_paged(const at::Tensor& x_in, at::TensorList weights, const at::Tensor& k_pool,
                               const at::Tensor& v_pool, const at::Tensor& block_table,
                               const at::Tensor& seq_index, const at::Tensor& pos, const at::Tensor& cos,
                               const at::Tensor& sin, int64_t n_head, int64_t n_kv_heads, double eps, bool a8) {
  TORCH_CHECK(k_pool.dim() == 5 && k_pool.scalar_type() == at::kFloat && v_pool.sizes() == k_pool.sizes(),
              "forward_llama_paged: float32 pools [L, n_blocks, H_kv, block_size, hd]");
  const int64_t L = k_pool.size(0), N = x_in.size(0), hd = k_pool.size(4);
  const int64_t H = n_head, Hkv = n_kv_heads;
  TORCH_CHECK(k_pool.size(2) == Hkv && H % Hkv == 0 && hd % 2 == 0, "forward_llama_paged: heads do not match");
  check_common(x_in, weights, L, pos, cos, sin, hd, block_table.size(1) * k_pool.size(3));
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() && block_table.dim() == 2 &&
              seq_index.scalar_type() == at::kLong && seq_index.is_contiguous() && seq_index.size(0) == N &&
              k_pool.is_contiguous() && v_pool.is_contiguous() && v_pool.scalar_type() == at::kFloat,
              "forward_llama_paged: contiguous int64 block_table [S, M] and seq_index [N], contiguous pools");
  const int64_t BS = k_pool.size(3), M = block_table.size(1), layer = k_pool[0].numel();
  const int64_t *table = block_table.data_ptr<int64_t>(), *seq = seq_index.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  arlm_kernels::check_block_table("forward_llama_paged", table, block_table.size(0), M, seq, pp, N, BS,
                                  k_pool.size(1));
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));  // as paged_cache.py's
  const int64_t qkv_dim = (H + 2 * Hkv) * hd;
  at::Tensor x = x_in.contiguous().clone();
  at::Tensor attn = at::empty({N, H * hd}, x.options());
  auto attend = [&](int64_t l, at::Tensor& qkv) -> at::Tensor {  // straight from the q/k/v rows, no copies
    const float* qp = qkv.data_ptr<float>();
    arlm_kernels::paged_attention(qp, qkv_dim, qp + H * hd, qp + (H + Hkv) * hd, qkv_dim,
                                  k_pool.data_ptr<float>() + l * layer, v_pool.data_ptr<float>() + l * layer,
                                  table, M, seq, pp, N, H, Hkv, hd, BS, scale, attn.data_ptr<float>());
    return attn;
  };
  run_layers(x, weights, L, pos.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), hd, H, Hkv,
             eps, a8, attend);
  return x;
}

// Greedy decoding's argmax over each row of logits [B, V] float32, as torch.argmax: the first
// index of the largest value, or of the first NaN. torch's index reductions run ~30x slower than
// its plain max on CPU (1.3 ms for [32, 49152]); a row here is a max pass and a compare pass.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "argmax_rows: x [B, V] contiguous float32");
  const int64_t B = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({B}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* r = xp + b * V;
      int64_t best = -1;
#if defined(__AVX512F__)
      __m512 mv = _mm512_set1_ps(-INFINITY);
      __mmask16 nan = 0;
      for (int64_t j = 0; j < V; j += 16) {
        const __mmask16 m = arlm_kernels::tail_mask(V - j);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, r + j);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mv = _mm512_max_ps(mv, v);
      }
      if (!nan) {
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
        for (int64_t j = 0; j < V && best < 0; j += 16) {
          const __mmask16 hit = _mm512_mask_cmp_ps_mask(arlm_kernels::tail_mask(V - j),
                                                        _mm512_loadu_ps(r + j), top, _CMP_EQ_OQ);
          if (hit) best = j + __builtin_ctz(hit);
        }
      }
#endif
      if (best < 0) {  // scalar: NaN rows (the first NaN wins) and CPUs without AVX-512
        best = 0;
        for (int64_t j = 0; j < V; ++j) {
          if (std::isnan(r[j])) { best = j; break; }
          if (r[j] > r[best]) best = j;
        }
      }
      op[b] = best;
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(arlm, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("decode_llama(Tensor x, Tensor[] weights, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor pos, "
        "Tensor cos, Tensor sin, int kv_len, int n_head, int n_kv_heads, float eps, bool a8) -> Tensor");
  m.def("forward_llama_paged(Tensor x, Tensor[] weights, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor block_table, "
        "Tensor seq_index, Tensor pos, Tensor cos, Tensor sin, int n_head, int n_kv_heads, float eps, bool a8) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(arlm, CPU, m) {
  m.impl("decode_llama", &decode_llama);
  m.impl("forward_llama_paged", &forward_llama_paged);
  m.impl("f32_linear", &f32_linear);
  m.impl("argmax_rows", &argmax_rows);
}
