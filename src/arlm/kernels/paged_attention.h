// Paged attention over the serving engine's KV pool (arlm.serve.paged_cache), shared by the
// attention op (serve/paged_attention.cpp) and the native layer stack (decode.cpp).
//
// The batch is flattened: N tokens from any number of sequences (one decode token each, or a
// chunk of a prompt), token i belonging to sequence seq[i] at position pos[i]. Each token's K/V
// are written into slot pos % BS of block table[seq, pos / BS]; then each query reads keys
// 0..pos[i] of its own sequence, a block at a time, in place: no gather copy, no padding, no mask.
// Every query's result is computed in the same order whatever else is in the batch, so a
// sequence's logits are bit-identical alone, in a batch, or prefilled in chunks.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "attention.h"

#include <vector>

namespace arlm_kernels {

// A bad table must not write out of the pool: every token needs a block-table entry in range.
inline void check_block_table(const char* op, const int64_t* table, int64_t S, int64_t M, const int64_t* seq,
                              const int64_t* pos, int64_t N, int64_t BS, int64_t n_blocks) {
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(seq[i] >= 0 && seq[i] < S && pos[i] >= 0 && pos[i] / BS < M, op, ": token ", i,
                " has no block-table entry");
    const int64_t blk = table[seq[i] * M + pos[i] / BS];
    TORCH_CHECK(blk >= 0 && blk < n_blocks, op, ": block id out of range");
  }
}

// Writes token i's new K/V (its Hkv heads of D floats at k + i * ldkv, v + i * ldkv) into slot
// pos % BS of block table[seq, pos / BS] of one layer's pools kp [n_blocks, Hkv, BS, row] of TK and
// vp of TV (attention.h: float, at::Half rounded to nearest even, or a quantized row).
template <typename TK, typename TV>
inline void paged_write(const float* k, const float* v, int64_t ldkv, TK* kp, TV* vp, const int64_t* table,
                        int64_t M, const int64_t* seq, const int64_t* pos, int64_t i, int64_t Hkv, int64_t D,
                        int64_t BS) {
  const int64_t blk = table[seq[i] * M + pos[i] / BS], slot = pos[i] % BS;
  const int64_t sk = KV<TK>::stride(D), sv = KV<TV>::stride(D);
  for (int64_t g = 0; g < Hkv; ++g) {
    const int64_t row = (blk * Hkv + g) * BS + slot;
    KV<TK>::store(k + i * ldkv + g * D, D, kp + row * sk);
    KV<TV>::store(v + i * ldkv + g * D, D, vp + row * sv);
  }
}

// Scratch floats per thread for paged_attend: G * (longest sequence + 1).
inline int64_t paged_scratch(const int64_t* pos, int64_t N, int64_t H, int64_t Hkv) {
  int64_t longest = 0;
  for (int64_t i = 0; i < N; ++i) longest = std::max(longest, pos[i] + 1);
  return H / Hkv * (longest + 1);
}

// A sliding window with attention sinks (StreamingLLM): a query at position p reads the first
// `sinks` slots and the last `window` (p - window + 1 .. p), nothing between. Keys stay rotated at
// their own positions, so the window's keys are at their true distances from the query; the sink
// keys are scored with the query rotated back by d = p - (sinks + window - 1), as if it sat at the
// end of a cache of sinks + window slots (positions inside the cache: RoPE stays in the range
// the model was trained on, however long the stream). window = 0: every slot 0..p.
struct Window {
  int64_t window = 0, sinks = 0;
  const float *cos = nullptr, *sin = nullptr;  // RoPE tables [max_T, D] (the sink rotation), when window
  bool splits(int64_t p) const { return window > 0 && p >= sinks + window; }
};

// x (D floats, half-split layout) rotated by minus the angle of table row d: (a cos + b sin,
// b cos - a sin) for each pair (a, b) = (x_i, x_{i + D/2}).
inline void rope_back(float* x, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] + b * sin[i];
    x[i + half] = b * cos[i + half] - a * sin[i + half];
  }
}

// After the writes: out [N, H * D] = softmax(q . K * scale) V per query head, token i's H heads
// of D floats at q + i * ldq, reading keys 0..pos[i] of its sequence (or its window, win), one
// (token, KV head) per task. scratch: at::get_num_threads() * paged_scratch(...) floats. Each task
// then calls done(o, at): its G * D outputs, at offset `at` of out (the layer stack quantizes
// them there).
template <typename TK, typename TV, typename Done>
inline void paged_attend(const float* q, int64_t ldq, const TK* kp, const TV* vp, const int64_t* table,
                         int64_t M, const int64_t* seq, const int64_t* pos, int64_t N, int64_t H, int64_t Hkv,
                         int64_t D, int64_t BS, float scale, float* out, float* scratch, Done done,
                         const Window& win = Window()) {
  const int64_t G = H / Hkv, per_thread = paged_scratch(pos, N, H, Hkv);
  const int64_t sk = KV<TK>::stride(D), sv = KV<TV>::stride(D);
  at::parallel_for(0, N * Hkv, 1, [&](int64_t w0, int64_t w1) {
    float* s = scratch + at::get_thread_num() * per_thread;
    thread_local std::vector<float> q_sink;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t i = w / Hkv, g = w % Hkv, L = pos[i] + 1;
      const int64_t* row = table + seq[i] * M;
      auto range = [&](auto f, int64_t a, int64_t b) {  // slots a..b-1, a block at a time
        for (int64_t j = a; j < b;) {
          const int64_t len = std::min(BS - j % BS, b - j);
          const int64_t first = (row[j / BS] * Hkv + g) * BS + j % BS;
          f(kp + first * sk, vp + first * sv, len);
          j += len;
        }
      };
      const float* qi = q + i * ldq + g * G * D;
      float* o = out + (i * H + g * G) * D;
      if (!win.splits(pos[i])) {
        attend_group<TK, TV>(qi, G, D, L, scale, [&](auto f) { range(f, 0, L); }, s, o);
      } else {
        const int64_t d = pos[i] - (win.sinks + win.window - 1);
        if (q_sink.size() < static_cast<size_t>(G * D)) q_sink.resize(G * D);
        std::copy(qi, qi + G * D, q_sink.data());
        for (int64_t h = 0; h < G; ++h) rope_back(q_sink.data() + h * D, win.cos + d * D, win.sin + d * D, D);
        attend_group<TK, TV>(qi, G, D, win.sinks + win.window, scale, [&](auto f) {
          range(f, 0, win.sinks);
          range(f, L - win.window, L);
        }, s, o, nullptr, q_sink.data(), win.sinks);
      }
      done(o, (i * H + g * G) * D);
    }
  });
}

// The attention op's whole job: write the N tokens' K/V, then attend (scale given).
template <typename TK, typename TV>
inline void paged_attention(const float* q, int64_t ldq, const float* k, const float* v, int64_t ldkv, TK* kp,
                            TV* vp, const int64_t* table, int64_t M, const int64_t* seq, const int64_t* pos,
                            int64_t N, int64_t H, int64_t Hkv, int64_t D, int64_t BS, float scale, float* out,
                            const Window& win = Window()) {
  at::parallel_for(0, N, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) paged_write(k, v, ldkv, kp, vp, table, M, seq, pos, i, Hkv, D, BS);
  });
  std::vector<float> scratch(at::get_num_threads() * paged_scratch(pos, N, H, Hkv));
  paged_attend(q, ldq, kp, vp, table, M, seq, pos, N, H, Hkv, D, BS, scale, out, scratch.data(),
               [](const float*, int64_t) {}, win);
}

}  // namespace arlm_kernels
