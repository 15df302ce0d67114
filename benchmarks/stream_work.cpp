// How fast a decode step's weight stream can go with the batch-1 Q4_K kernel's work beside it: a
// synthetic tile loop over 800 MB (2 MB pages, one stream a thread, each line prefetched 4 KB
// ahead, as the packed kernels read), per 64-byte line 4 vpdpbusd (the 16-bit activations' two
// bytes times the low and high nibbles), per 256 bytes (a group of 32 K-values) the float work of
// applying its scales. Variants, GB/s of the lines read (best of 5 passes, 3 rounds):
//   x in registers    the activations' broadcasts taken from registers (no loads of x);
//   x of K            each line's 4 broadcasts loaded from an x of K values (2 K bytes: hi, lo),
//                     as the kernel does: K 2048 (a 1B model's q/k/v, gate/up), 4096 (8B's),
//                     8192 (1B's down), 14336 (8B's down);
//   two blocks        tiles of two 16 KB blocks read side by side (two streams a thread), each
//                     broadcast shared by both (x of 2048);
//   in chunks         K = 14336 walked in chunks of 2048: the memory laid out [chunk][tile], each
//                     thread's tiles of a chunk one stream, 4 KB of x live at a time;
//   tiles reading an x of 2048: tiles of K = 14336 whose broadcasts wrap around 2048 values;
//   K-quant scales apart / inline: x of 2048 with the scales read from memory as a Q4_K layer
//                     holds them (pass_sc): in two arrays of their own beside the weights (three
//                     streams a thread, as arlm's layout), or after each super-block's weights
//                     (one stream); GB/s of every byte read, scales included; and apart with the
//                     scales left to the hardware prefetchers;
//   two blocks interleaved: tiles of two blocks whose 64-byte lines alternate (one stream a
//                     thread), each broadcast of x serving both.
//
//     g++ -O2 -march=native -fopenmp benchmarks/stream_work.cpp -o /tmp/stream_work
//     OMP_NUM_THREADS=2 /tmp/stream_work
//
// (An AVX-512 VNNI CPU.) docs/benchmarks.md, 2026-12-07 19:14: on a Zen 5 the stream with x in
// registers runs at the full read rate; tiles of 8,192 or more values cost it 4-7%, chunks of K
// do not win it back, two blocks a tile cost ~37%.
//
// 2026-12-07 21:13 (docs/benchmarks.md): this loop leads, the kernel decides. The scales read from
// memory cost the stream 2-7% (apart 88.0-92.9 GB/s, inline 88.7-90.8, x of 2048 94.0-95.2 in
// the same runs), inline 8 KB ahead ran 93.0-94.4 and two blocks interleaved 92.4-93.9 at x of
// 8,192 and 14,336 (one block 90.0-91.8). None of it carried over to the real kernel: over a
// throwaway inline copy the 1B gate/up ran 87.6-90.0 GB/s 8 KB ahead (80-83 4 KB ahead) against
// 91.1-91.8 as laid out; over an interleaved copy the 8B's Q4_K layers ran 3-10% slower (their
// scales then two places a stream); and without the scales' prefetch the kernel is 5-7% slower
// where this loop is as fast or faster (91.3-94.7). Here the scales feed only the last FMAs; in
// the kernel their 6-bit unpacking sits on the path of every group.
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

alignas(64) static int8_t X[2 * 14336];

// KX = 0: x in registers (tiles as at K = 2048). A block of 16 channels is 8 K bytes (K 4-bit values
// a channel); NB blocks a tile (NB 2: two streams a thread).
template <int KX, int NB = 1, int KC = 0, int XM = 0, bool IL2 = false>
double pass(const uint8_t* buf, size_t total) {
  constexpr size_t K = KX ? KX : 2048, block = 8 * K, tile = NB * block;
  const auto t0 = std::chrono::steady_clock::now();
  double sum = 0;
#pragma omp parallel reduction(+ : sum)
  {
    const size_t n = omp_get_num_threads(), tiles = total / tile, chunk = (tiles + n - 1) / n;
    const size_t a = omp_get_thread_num() * chunk, b = std::min(tiles, a + chunk);
    const __m512i low4 = _mm512_set1_epi8(15);
    const __m512i reg[4] = {_mm512_set1_epi32(0x01020304), _mm512_set1_epi32(0x02030405),
                            _mm512_set1_epi32(0x03040506), _mm512_set1_epi32(0x04050607)};
    __m512 acc[NB];
    for (auto& v : acc) v = _mm512_setzero_ps();
    constexpr size_t C = KC ? K / KC : 1, GC = KC ? KC / 32 : K / 32;  // chunks, groups a chunk
    const size_t tiles_all = total / tile;
    for (size_t c = 0; c < C; ++c)
    for (size_t t = a; t < b; ++t)
      for (size_t gc = 0; gc < GC; ++gc) {
        const size_t g = c * GC + gc;
        __m512i dh[NB], dl[NB];
        for (int i = 0; i < NB; ++i) dh[i] = dl[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int l = 0; l < 4; ++l) {
          const size_t k = XM ? (32 * g + 8 * l) % XM : 32 * g + 8 * l;  // the K-value x is at
          auto x4 = [&](size_t at, int r) {
            return KX ? _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(X + at)) : reg[r];
          };
          const __m512i h0 = x4(k, 0), h1 = x4(k + 4, 1), l0 = x4(K + k, 2), l1 = x4(K + k + 4, 3);
          for (int i = 0; i < NB; ++i) {
            const uint8_t* p = KC ? buf + (c * tiles_all + t) * (8 * KC) + gc * 256 + 64 * l
                               : IL2 ? buf + t * tile + (g * 4 + l) * 64 * NB + 64 * i
                                     : buf + t * tile + i * block + g * 256 + 64 * l;
            _mm_prefetch(reinterpret_cast<const char*>(p) + 4096, _MM_HINT_T0);
            const __m512i v = _mm512_loadu_si512(p);
            const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            dh[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dh[i], lo, h0), hi, h1);
            dl[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dl[i], lo, l0), hi, l1);
          }
        }
        const __m512 e = _mm512_set1_ps(1.5f + (g & 1));
        for (int i = 0; i < NB; ++i) {  // the group's scales: d sc, -dmin m, their product with e, two sums
          const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(dh[i], 8), dl[i]);
          const uint8_t* s = reinterpret_cast<const uint8_t*>(X) + 16 * (g % 8);
          auto widen = [](const uint8_t* q) {
            return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
          };
          const __m512 ds = _mm512_mul_ps(_mm512_set1_ps(0.5f), widen(s));
          const __m512 ms = _mm512_mul_ps(_mm512_set1_ps(-0.25f), widen(s + 128));
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ds, e), acc[i]);
          acc[i] = _mm512_fmadd_ps(ms, _mm512_set1_ps(0.75f), acc[i]);
        }
      }
    for (auto& v : acc) sum += _mm512_reduce_add_ps(v);
  }
  volatile double sink = sum;
  (void)sink;
  return total / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9;
}

// The K-quant tile loop with its scales read from memory, as a Q4_K layer lays them out (x of
// 2048, one block a tile): SC 1, apart: per block of 16 channels and super-block of 256 K-values,
// 192 bytes of 6-bit sc/m and 64 of float16 d/dmin in two arrays of their own (three streams a
// thread), each prefetched 4 super-blocks ahead (as prefetch_kscales); SC 2, inline: the same
// 256 bytes after each super-block's 2,048 bytes of weights, one stream. Every line prefetched PD
// bytes ahead. GB/s of every byte read.
template <int SC, int PD = 4096, bool SA = true>
double pass_sc(uint8_t* buf, size_t total) {
  constexpr size_t K = 2048, S = K / 256, wsb = 2048, ssb = 256, sb = wsb + ssb, block = S * sb;
  const size_t tiles = total / block;
  uint8_t* scales = buf + tiles * S * wsb;  // SC 1: [tile][S][192] sc/m, then [tile][S][64] d/dmin
  uint8_t* dmins = scales + tiles * S * 192;
  const auto t0 = std::chrono::steady_clock::now();
  double sum = 0;
#pragma omp parallel reduction(+ : sum)
  {
    const size_t n = omp_get_num_threads(), chunk = (tiles + n - 1) / n;
    const size_t a = omp_get_thread_num() * chunk, b = std::min(tiles, a + chunk);
    const __m512i low4 = _mm512_set1_epi8(15);
    __m512 acc = _mm512_setzero_ps();
    for (size_t t = a; t < b; ++t)
      for (size_t s = 0; s < S; ++s) {
        const uint8_t* w = SC == 2 ? buf + t * block + s * sb : buf + (t * S + s) * wsb;
        const uint8_t* sc = SC == 2 ? w + wsb : scales + (t * S + s) * 192;
        const uint8_t* dm = SC == 2 ? w + wsb + 192 : dmins + (t * S + s) * 64;
        if (SC == 1 && SA) {
          _mm_prefetch(reinterpret_cast<const char*>(sc + 4 * 192), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(sc + 4 * 192 + 64), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(sc + 4 * 192 + 128), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(dm + 4 * 64), _MM_HINT_T0);
        } else if (SC == 2) {
          for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(sc + PD + 64 * l), _MM_HINT_T0);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm)));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + 32)));
        for (size_t gs = 0; gs < 8; ++gs) {
          const size_t k = 256 * s + 32 * gs;
          __m512i dh = _mm512_setzero_si512(), dl = dh;
#pragma GCC unroll 4
          for (int l = 0; l < 4; ++l) {
            auto x4 = [&](size_t at) { return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(X + at)); };
            const size_t at = k + 8 * l;
            const __m512i h0 = x4(at), h1 = x4(at + 4), l0 = x4(K + at), l1 = x4(K + at + 4);
            const uint8_t* p = w + gs * 256 + 64 * l;
            _mm_prefetch(reinterpret_cast<const char*>(p) + PD, _MM_HINT_T0);
            const __m512i v = _mm512_loadu_si512(p);
            const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            dh = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dh, lo, h0), hi, h1);
            dl = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dl, lo, l0), hi, l1);
          }
          const __m512 e = _mm512_set1_ps(1.5f + (gs & 1));
          const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(dh, 8), dl);
          auto widen = [](const uint8_t* q) {
            return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
          };
          const __m512 ds = _mm512_mul_ps(d, widen(sc + 16 * (gs % 8)));
          const __m512 ms = _mm512_mul_ps(dmin, widen(sc + 64 + 16 * (gs % 8)));
          acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ds, e), acc);
          acc = _mm512_fmadd_ps(ms, _mm512_set1_ps(0.75f), acc);
        }
      }
    sum += _mm512_reduce_add_ps(acc);
  }
  volatile double sink = sum;
  (void)sink;
  const size_t bytes = tiles * block;
  return bytes / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9;
}

int main() {
  const size_t total = 800ull << 20;
  uint8_t* buf = static_cast<uint8_t*>(std::aligned_alloc(2 << 20, total));
  madvise(buf, total, MADV_HUGEPAGE);  // (before the pages are touched)
  std::memset(buf, 1, total);
  std::memset(X, 3, sizeof X);
  for (int r = 0; r < 3; ++r) {
    double b[15] = {0};
    for (int i = 0; i < 5; ++i) {
      b[0] = std::max(b[0], pass<0>(buf, total));
      b[6] = std::max(b[6], pass<2048, 2>(buf, total));
      b[7] = std::max(b[7], pass<14336, 1, 0, 2048>(buf, total));
      b[1] = std::max(b[1], pass<2048>(buf, total));
      b[2] = std::max(b[2], pass<4096>(buf, total));
      b[3] = std::max(b[3], pass<8192>(buf, total));
      b[4] = std::max(b[4], pass<14336>(buf, total));
      b[5] = std::max(b[5], pass<14336, 1, 2048>(buf, total));
      b[8] = std::max(b[8], pass_sc<1>(buf, total));
      b[9] = std::max(b[9], pass_sc<2>(buf, total));
      b[10] = std::max(b[10], pass_sc<2, 8192>(buf, total));
      b[11] = std::max(b[11], pass_sc<1, 4096, false>(buf, total));
      b[12] = std::max(b[12], pass<8192, 2, 0, 0, true>(buf, total));
      b[13] = std::max(b[13], pass<14336, 2, 0, 0, true>(buf, total));
    }
    std::printf("GB/s: x in registers %.1f  x of 2048 %.1f  4096 %.1f  8192 %.1f  14336 %.1f  two blocks %.1f\n"
                "      14336 in chunks of 2048 %.1f  tiles of 14336 reading an x of 2048 %.1f\n"
                "      K-quant scales apart (three streams) %.1f  inline (one stream) %.1f  inline, 8 KB ahead %.1f\n"
                "      apart, the scales not prefetched %.1f  two blocks interleaved (one stream): 8192 %.1f  "
                "14336 %.1f\n",
                b[0], b[1], b[2], b[3], b[4], b[6], b[5], b[7], b[8], b[9], b[10], b[11], b[12], b[13]);
  }
  return 0;
}
