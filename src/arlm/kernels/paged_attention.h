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
#include "aten.h"

#include "attention.h"

#include <atomic>
#include <memory>
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

// Prompt tokens attend in runs of up to kRun consecutive tokens of one sequence (paged_attend):
// the run's keys are transposed 16 at a time and scored against all its queries (block_scores).
// 32 rather than 16: each key and value read (and widened from the cache's format) for twice the
// queries; a 1B model's 512-token prompt spent 86-87 ms in attention at 16, 81 at 32, 79-80 at
// 64 (Zen 5, 2 threads, benchmarks/phases.py --prefill 512); 72-73 at 32 once a pool block's keys
// were transposed in registers and block_scores kept its tree in 16 registers (it spilled). A
// token's result is the same in any run.
constexpr int64_t kRun = 32;

// Scratch floats per thread for paged_attend: one query's scores, G * (its slots + 1), or for a
// run of 4 or more prompt tokens scored together (the runs paged_attend forms) the run's scores
// and a block of transposed keys. A batch of decode tokens needs no more than before.
inline int64_t paged_scratch(const int64_t* seq, const int64_t* pos, int64_t N, int64_t H, int64_t Hkv,
                             int64_t D) {
  const int64_t G = H / Hkv;
  int64_t need = 0;
  for (int64_t i = 0; i < N;) {
    int64_t len = 1;
    while (len < kRun && i + len < N && seq[i + len] == seq[i] && pos[i + len] == pos[i] + len) ++len;
    const int64_t last = pos[i] + len;  // the run's slots
    need = std::max(need, len >= 4 ? len * G * (last + 1) + 16 * D + 16 : G * (last + 1));
    i += len;
  }
  return need;
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
  const int64_t G = H / Hkv, per_thread = paged_scratch(seq, pos, N, H, Hkv, D);
  const int64_t sk = KV<TK>::stride(D), sv = KV<TV>::stride(D);
  // Runs: tokens i .. i + len - 1 of one sequence at consecutive positions (a prompt's chunk),
  // at most kRun; a decode token is a run of one.
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t i = 0; i < N;) {
    int64_t len = 1;
    while (len < kRun && i + len < N && seq[i + len] == seq[i] && pos[i + len] == pos[i] + len) ++len;
    runs.emplace_back(i, len);
    i += len;
  }
  // Each thread takes the next task (a run and a KV head) until none is left, the batch's last
  // runs first: in a prompt's chunk the later tokens read more slots (token p reads p + 1), so a
  // fixed split of the tasks would give one thread ~3/4 of a 512-token prefill's attention. Which
  // thread runs a task, and whether its queries are scored together or one by one (below),
  // does not change a token's result.
  const int64_t tasks = static_cast<int64_t>(runs.size()) * Hkv;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    float* s = scratch + at::get_thread_num() * per_thread;
    thread_local std::vector<float> q_sink;
    for (int64_t taken; (taken = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t w = tasks - 1 - taken, g = w % Hkv;
      const auto [first_token, run] = runs[w / Hkv];
      const int64_t* row = table + seq[first_token] * M;
      auto range = [&](auto f, int64_t a, int64_t b) {  // slots a..b-1, a block at a time
        for (int64_t j = a; j < b;) {
          const int64_t len = std::min(BS - j % BS, b - j);
          const int64_t first = (row[j / BS] * Hkv + g) * BS + j % BS;
          f(kp + first * sk, vp + first * sv, len);
          j += len;
        }
      };
#if defined(__AVX512F__)
      if constexpr (!KV<TK>::quantized) {
        if (run >= 4 && D % 32 == 0 && D <= 512 && !win.splits(pos[first_token + run - 1])) {
          // Every query of the run scored 16 keys at a time (block_scores), then its softmax and
          // values as one query alone (attend_scored). Query r reads slots 0..pos + r.
          const int64_t p0 = pos[first_token], last = p0 + run;  // slots 0..last-1 in all
          const int64_t ld = G * (last + 1);                     // floats of one query's scores
          float* kt = s + run * ld;
          kt += (64 - reinterpret_cast<uintptr_t>(kt) % 64) % 64 / sizeof(float);  // aligned
          alignas(64) float block[4 * 16];
          for (int64_t t0 = 0; t0 < last; t0 += 16) {
            const int64_t count = std::min<int64_t>(16, last - t0);
            int64_t filled = 0;  // the block's keys transposed (from one or more pool blocks)
            if (count < 16) std::fill(kt, kt + 16 * D, 0.f);
            range([&](const TK* k, const TV*, int64_t len) {
              transpose_keys(k, sk, len, D, kt, filled);
              filled += len;
            }, t0, t0 + count);
            for (int64_t r = std::max<int64_t>(0, t0 - p0); r < run; ++r) {  // queries that read slot t0
              const int64_t n = p0 + r + 1, live = std::min<int64_t>(16, n - t0);
              const float* qr = q + (first_token + r) * ldq + g * G * D;
              for (int64_t h = 0; h < G; h += 4) {
                const int64_t nq = std::min<int64_t>(4, G - h);
                switch (nq) {
                  case 4: block_scores<4>(qr + h * D, D, kt, scale, block); break;
                  case 3: block_scores<3>(qr + h * D, D, kt, scale, block); break;
                  case 2: block_scores<2>(qr + h * D, D, kt, scale, block); break;
                  default: block_scores<1>(qr + h * D, D, kt, scale, block);
                }
                for (int64_t x = 0; x < nq; ++x)
                  std::copy(block + x * 16, block + x * 16 + live, s + r * ld + (h + x) * n + t0);
              }
            }
          }
          for (int64_t r = 0; r < run; ++r) {
            const int64_t i = first_token + r, n = pos[i] + 1;
            float* o = out + (i * H + g * G) * D;
            attend_scored<TK, TV>(G, D, n, [&](auto f) { range(f, 0, n); }, s + r * ld, o);
            done(o, (i * H + g * G) * D);
          }
          continue;
        }
      }
#endif
      for (int64_t i = first_token; i < first_token + run; ++i) {
      const int64_t L = pos[i] + 1;
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
  // (written before it is read: no zero-fill)
  std::unique_ptr<float[]> scratch(new float[at::get_num_threads() * paged_scratch(seq, pos, N, H, Hkv, D)]);
  paged_attend(q, ldq, kp, vp, table, M, seq, pos, N, H, Hkv, D, BS, scale, out, scratch.get(),
               [](const float*, int64_t) {}, win);
}

}  // namespace arlm_kernels
