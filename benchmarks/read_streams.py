"""How fast this host reads memory as one stream a thread, and as the packed kernels' two-block tiles.

    .venv/bin/python benchmarks/read_streams.py [--threads 2] [--mb 800] [--block-kb 16] [--repeat 15]

A C++ loop (built here with the system's g++, -O2 -march=native -fopenmp: the compiler the
kernels build with; 64-byte loads where the CPU has AVX-512, as the kernels read, else two of 32)
sums --mb MB of bytes on --threads OpenMP threads, each its contiguous share,
in three patterns:
- one stream: each thread reads its share front to back;
- two streams: each thread reads tiles of two blocks of --block-kb KB side by side (line i of the
  first block, then line i of the second), the pattern of the packed kernels' two-block tiles (the
  16 channels of a block of a K = 2048 Q4_K layer are 16 KB);
- two streams + prefetch: the same, each line's twin in the next tile prefetched (the kernels'
  prefetch of the next tile);
- one stream on 2 MB pages: the first pattern over memory on transparent huge pages
  (MADV_HUGEPAGE, as arlm holds a model's weights: `arlm.files.load_weights`), the others' on
  4 KB pages (what a map of a file, or memory that does not ask, gets). "(4 KB pages)" after it:
  the kernel gave none.
Printed: GB/s, best and median of --repeat passes. The decode kernels read a step's weights as
one stream a thread since docs/benchmarks.md's Zen 5 section ("one stream a thread").
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_args import positive_int  # noqa: E402

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

// One 64-byte line into acc: one load where the CPU has 512-bit vectors (as the kernels read), else two.
#ifdef __AVX512F__
using Acc = __m512i;
inline Acc zero() { return _mm512_setzero_si512(); }
inline Acc add_line(Acc acc, const uint8_t* p) { return _mm512_add_epi32(acc, _mm512_load_si512(p)); }
inline long long lane_sum(Acc a) { return _mm512_reduce_add_epi32(a); }
#else
using Acc = __m256i;
inline Acc zero() { return _mm256_setzero_si256(); }
inline Acc add_line(Acc acc, const uint8_t* p) {
  acc = _mm256_add_epi32(acc, _mm256_load_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm256_add_epi32(acc, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 32)));
}
inline long long lane_sum(Acc a) {
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a);
  long long s = 0;
  for (int32_t v : lanes) s += v;
  return s;
}
#endif

// The process's anonymous memory on huge pages, kB (/proc/self/smaps_rollup).
long huge_kb() {
  FILE* f = std::fopen("/proc/self/smaps_rollup", "r");
  char line[256];
  long kb = 0;
  while (f && std::fgets(line, sizeof line, f))
    if (!std::strncmp(line, "AnonHugePages:", 14)) kb = std::atol(line + 14);
  if (f) std::fclose(f);
  return kb;
}

// mode 0: one stream; 1: two streams; 2: two streams, the next tile prefetched; 3: one stream on 2 MB pages
int main(int argc, char** argv) {
  const size_t total = std::strtoull(argv[1], nullptr, 10) << 20, blk = std::strtoull(argv[2], nullptr, 10) << 10;
  const int mode = std::atoi(argv[3]), repeat = std::atoi(argv[4]);
  const size_t align = mode == 3 ? 2 << 20 : 4096;
  uint8_t* buf = static_cast<uint8_t*>(std::aligned_alloc(align, (total + align - 1) / align * align));
  if (mode == 3) madvise(buf, total, MADV_HUGEPAGE);  // (before the pages are touched)
  std::memset(buf, 1, total);
  const size_t tiles = total / (2 * blk);
  std::vector<double> seconds;
  long long check = 0;
  for (int r = 0; r < repeat; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    long long sum = 0;
#pragma omp parallel reduction(+ : sum)
    {
      const size_t n = omp_get_num_threads(), chunk = (tiles + n - 1) / n, a = omp_get_thread_num() * chunk;
      const size_t b = std::min(tiles, a + chunk);
      Acc acc0 = zero(), acc1 = zero();
      for (size_t t = a; t < b; ++t) {
        const uint8_t* w = buf + t * 2 * blk;
        if (mode == 0 || mode == 3) {
          for (size_t o = 0; o < 2 * blk; o += 128) {
            acc0 = add_line(acc0, w + o);
            acc1 = add_line(acc1, w + o + 64);
          }
        } else {
          const uint8_t* next = mode == 2 && t + 1 < b ? w + 2 * blk : nullptr;
          for (size_t o = 0; o < blk; o += 64) {
            if (next) {
              _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(next + blk + o), _MM_HINT_T0);
            }
            acc0 = add_line(acc0, w + o);
            acc1 = add_line(acc1, w + blk + o);
          }
        }
      }
      sum += lane_sum(acc0) + lane_sum(acc1);
    }
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    check += sum;
  }
  std::sort(seconds.begin(), seconds.end());
  const double bytes = static_cast<double>(tiles * 2 * blk);
  std::printf("%.2f %.2f %lld %ld\n", bytes / seconds.front() / 1e9, bytes / seconds[seconds.size() / 2] / 1e9,
              check % 7, huge_kb());
  return 0;
}
"""

MODES = {"one stream a thread": 0, "two streams a thread": 1, "two streams + next-tile prefetch": 2,
         "one stream a thread, 2 MB pages": 3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--mb", type=positive_int, default=800, help="MB read per pass (default 800)")
    ap.add_argument("--block-kb", type=positive_int, default=16, help="KB of one block of a tile (default 16)")
    ap.add_argument("--repeat", type=positive_int, default=15)
    ap.add_argument("--rounds", type=positive_int, default=2, help="the patterns alternated this many times")
    args = ap.parse_args()
    compiler = shutil.which("g++")
    if compiler is None:
        print("read_streams.py: g++ not found (the kernels' build needs it too)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "read.cpp", Path(tmp) / "read"
        src.write_text(SOURCE)
        subprocess.run([compiler, "-O2", "-march=native", "-fopenmp", str(src), "-o", str(exe)], check=True)
        env = {"OMP_NUM_THREADS": str(args.threads), "OMP_PROC_BIND": "false", "PATH": "/usr/bin:/bin"}
        print(f"{args.mb} MB a pass, {args.threads} threads, blocks of {args.block_kb} KB; GB/s best / median "
              f"of {args.repeat}")
        for r in range(args.rounds):
            for label, mode in MODES.items():
                out = subprocess.run([str(exe), str(args.mb), str(args.block_kb), str(mode), str(args.repeat)],
                                     env=env, capture_output=True, text=True, check=True).stdout.split()
                none = " (4 KB pages)" if mode == 3 and int(out[3]) == 0 else ""
                print(f"  round {r}  {label:34} {float(out[0]):7.1f} / {float(out[1]):7.1f}{none}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
