"""The batch-1 Q4_K decode kernel of two versions of a8_linear.cpp, side by side in one process.

    .venv/bin/python benchmarks/kernel_ab.py A.cpp B.cpp [--rounds 15] [--iters 2000]

(A.cpp: e.g. `git show HEAD:src/arlm/kernels/a8_linear.cpp > /tmp/a8_head.cpp`, B.cpp the working
tree's.) Builds one small extension holding each file's packed AVX-512 section (from "The packed
kernels of either instruction set" up to Q6_K's loads) in a namespace of its own, and times each
one's `x16p_block<true, 1, 1, KScales>` (one row of 16-bit x against one block of 16 channels: the
decode step's Q4_K tile, the next tile's prefetch on as a decode step has it) on random weights and
scales in L1/L2, the two alternated --rounds times, the best of each. Printed: GB/s-equivalent (the
layout's bytes, weights and scales, per second on one core) and whether the two give the same bits.
Needs an AVX-512 VNNI CPU. A faster kernel here is not a faster step: the step streams from memory
(docs/benchmarks.md, 2026-12-07 19:14).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int  # noqa: E402

PRELUDE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <chrono>
#include <cstring>
#include <random>
#define ARLM_AVX512 1
constexpr int64_t kGroup = 32, kKScaleBytes = 192, kLanes = 16;
"""

HARNESS = r"""
namespace {
struct Data {
  int64_t K, G, blocks;
  std::vector<int8_t> hi, lo;
  std::vector<float> e, sx;
  std::vector<uint8_t> w, sm;
  std::vector<at::Half> dd;
  Data(int64_t K, int64_t blocks) : K(K), G(K / kGroup), blocks(blocks) {
    std::mt19937 rng(1);
    hi.resize(K), lo.resize(K), e.resize(G), sx.resize(G);
    for (auto& v : hi) v = static_cast<int8_t>(rng() % 255 - 127);
    for (auto& v : lo) v = static_cast<int8_t>(rng() % 256 - 128);
    for (auto& v : e) v = 1e-3f * (1 + rng() % 100);
    for (auto& v : sx) v = 1e-2f * (static_cast<int>(rng() % 200) - 100);
    w.resize(blocks * K / 8 * 64 + 8192), sm.resize(blocks * (G / 8) * kKScaleBytes);
    dd.resize(blocks * (G / 8) * 2 * kLanes);
    for (auto& v : w) v = rng();
    for (auto& v : sm) v = rng();
    for (auto& v : dd) v = at::Half(1e-3f * (1 + rng() % 50));
  }
};

template <typename Scales, typename Kernel>
double timed(const Data& d, int64_t iters, Kernel kernel, float* out) {
  const int64_t block = d.K / 8 * 64;
  auto call = [&] {
    for (int64_t b = 0; b < d.blocks; ++b)
      kernel(d.hi.data(), d.lo.data(), d.e.data(), d.sx.data(), nullptr, d.K, d.w.data() + b * block,
             Scales(d.sm.data() + b * (d.G / 8) * kKScaleBytes, d.dd.data() + b * (d.G / 8) * 2 * kLanes, d.G),
             d.w.data() + b * block + 4096, out + 16 * b, nullptr);
  };
  call();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    call();
    asm volatile("" ::: "memory");
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / iters;
  return d.blocks * (block + (d.G / 8) * (kKScaleBytes + 2 * kLanes * 2)) / ns;
}
}  // namespace

std::vector<double> bench(int64_t K, int64_t blocks, int64_t iters, int64_t rounds) {
  const Data d(K, blocks);
  std::vector<float> oa(16 * blocks), ob(16 * blocks);
  double a = 0, b = 0;
  for (int64_t r = 0; r < rounds; ++r) {
    a = std::max(a, timed<va::KScales>(d, iters, [](auto... v) { va::x16p_block<true, 1, 1, va::KScales>(v...); },
                                       oa.data()));
    b = std::max(b, timed<vb::KScales>(d, iters, [](auto... v) { vb::x16p_block<true, 1, 1, vb::KScales>(v...); },
                                       ob.data()));
  }
  return {a, b, oa == ob ? 1.0 : 0.0};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("bench", &bench); }
"""


def packed_section(source: str, path: str) -> str:
    try:
        start = source.index("// (The packed kernels of either instruction set, below.)")
        end = source.index("// Q6_K's 6-bit u = q + 32")
    except ValueError:
        sys.exit(f"kernel_ab.py: {path} is not an a8_linear.cpp of this layout (its packed section's markers)")
    return source[start:end] + "\n#endif\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="one a8_linear.cpp")
    ap.add_argument("b", type=Path, help="the other")
    ap.add_argument("--rounds", type=positive_int, default=15)
    ap.add_argument("--iters", type=positive_int, default=2000)
    args = ap.parse_args()
    sources = []
    for p in (args.a, args.b):
        try:
            sources.append(packed_section(p.read_text(), str(p)))
        except OSError as e:
            sys.exit(f"kernel_ab.py: {p}: {e.strerror}")
    import torch
    from torch.utils.cpp_extension import load

    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        sys.exit("kernel_ab.py: the packed AVX-512 kernels need an AVX-512 CPU")
    build = Path(tempfile.gettempdir()) / "arlm-kernel-ab"
    build.mkdir(exist_ok=True)
    src = build / "kernel_ab.cpp"
    src.write_text(PRELUDE + "namespace va {\n" + sources[0] + "}\nnamespace vb {\n" + sources[1] + "}\n" + HARNESS)
    m = load(name="kernel_ab", sources=[str(src)], build_directory=str(build),
             extra_cflags=["-O3", "-march=native"], verbose=False)
    torch.set_num_threads(1)
    print(f"A {args.a}, B {args.b}: one core, best of {args.rounds} alternated rounds")
    for K, blocks in ((2048, 1), (2048, 8), (8192, 4)):
        a, b, same = m.bench(K, blocks, args.iters, args.rounds)
        print(f"K {K:>5}, {blocks} block(s) of 16 channels: A {a:6.1f}  B {b:6.1f} GB/s-eq  "
              f"B/A {b / a:.3f}  {'same bits' if same else 'OTHER BITS'}", flush=True)


if __name__ == "__main__":
    main()
