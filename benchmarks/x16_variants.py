"""The prompt rows' Q4_K kernel (a8_linear.cpp's x16p_block, 4 rows x 2 blocks of 16 channels) on
one core with everything in L1, against variants of it: what its per-group work costs.

    .venv/bin/python benchmarks/x16_variants.py [--k 2048] [--iters 20000] [--rounds 3]

Builds a small extension that includes a8_linear.cpp (AVX-512 VNNI CPUs only) and times, in G
16-bit multiply-adds a second: base (KScales' scales, as a chunk of fewer than 32 rows takes
them); pre (the scales read as precomputed floats: FloatScales, what a prompt's chunk takes);
noadd (the low-byte chain started from the high one shifted, no add); exp (the 4-bit weights
pre-expanded to bytes); and the two combinations. "same" says whether each gives base's bits.
The core's VNNI peak: `gcc -O2 -march=icelake-server benchmarks/vnni_pipes.c` (8 chains of
vpdpbusd, 64 byte products each: 32 16-bit multiply-adds).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

SOURCE = r"""
#include <torch/extension.h>
#include "A8_LINEAR"
#include <chrono>
#include <random>
namespace {
template <int MB, int NB, bool PRE, bool NOADD, bool EXP>
void variant(const int8_t* hi, const int8_t* lo, const float* e, const float* sx, int64_t K, const uint8_t* w,
             const KScales& sc, const float* pre, float* out) {
  const int64_t G = K / kGroup, block = EXP ? K / 8 * kExpanded : K / 8 * 64;
  __m512 acc[MB][NB];
  zero(acc);
  for (int64_t g = 0; g < G; ++g) {
    __m512i dh[MB][NB], dl[MB][NB];
    zero(dh);
    if (!NOADD) zero(dl);
    auto pass = [&](bool high, bool low) {
#pragma GCC unroll 4
      for (int64_t p = 0; p < kGroup / 8; ++p) {
        const int64_t k = g * kGroup + 8 * p;
        __m512i w0[NB], w1[NB];
        if constexpr (EXP) load_x<NB>(w, block, k, w0, w1);
        else load_q4<NB, false>(w, block, k, nullptr, w0, w1);
        for (int i = 0; i < MB; ++i) {
          auto x4 = [&](const int8_t* x, int64_t at) {
            return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + i * K + at));
          };
          for (int b = 0; b < NB; ++b) {
            if (high) dh[i][b] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dh[i][b], w0[b], x4(hi, k)), w1[b], x4(hi, k + 4));
            if (low) dl[i][b] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dl[i][b], w0[b], x4(lo, k)), w1[b], x4(lo, k + 4));
          }
        }
      }
    };
    if constexpr (NOADD) {
      pass(true, false);
      for (int i = 0; i < MB; ++i)
        for (int b = 0; b < NB; ++b) dl[i][b] = _mm512_slli_epi32(dh[i][b], 8);
      pass(false, true);
    } else {
      pass(true, true);
    }
    __m512 ds[NB], ms[NB];
    for (int b = 0; b < NB; ++b) {
      if constexpr (PRE) FloatScales{pre, G}.at(b, g, ds[b], ms[b]);
      else sc.at(b, g, ds[b], ms[b]);
    }
    for (int i = 0; i < MB; ++i) {
      const __m512 ei = _mm512_set1_ps(e[i * G + g]);
      for (int b = 0; b < NB; ++b) {
        const __m512i dot = NOADD ? dl[i][b] : _mm512_add_epi32(_mm512_slli_epi32(dh[i][b], 8), dl[i][b]);
        acc[i][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ds[b], ei), acc[i][b]);
        acc[i][b] = _mm512_fmadd_ps(ms[b], _mm512_set1_ps(sx[i * G + g]), acc[i][b]);
      }
    }
  }
  store(acc, out);
}

struct Data {
  int64_t K, G;
  std::vector<int8_t> hi, lo;
  std::vector<float> e, sx;
  std::vector<uint8_t> w, sm;
  std::vector<at::Half> dd;
  std::vector<__m512> pre;
  std::vector<__m512i> wx;
  explicit Data(int64_t K) : K(K), G(K / kGroup) {
    std::mt19937 rng(1);
    hi.resize(4 * K), lo.resize(4 * K), e.resize(4 * G), sx.resize(4 * G);
    for (auto& v : hi) v = static_cast<int8_t>(rng() % 255 - 127);
    for (auto& v : lo) v = static_cast<int8_t>(rng() % 256 - 128);
    for (auto& v : e) v = 1e-3f * (1 + rng() % 100);
    for (auto& v : sx) v = 1e-2f * (static_cast<int>(rng() % 200) - 100);
    w.resize(2 * K / 8 * 64), sm.resize(2 * (G / 8) * kKScaleBytes), dd.resize(2 * (G / 8) * 2 * kLanes);
    for (auto& v : w) v = rng();
    for (auto& v : sm) v = rng();
    for (auto& v : dd) v = at::Half(1e-3f * (1 + rng() % 50));
    pre.resize(2 * G * 2);
    expand_kscales(KScales(sm.data(), dd.data(), G), 2, reinterpret_cast<float*>(pre.data()));
    wx.resize(2 * K / 8 * 2);
    for (int b = 0; b < 2; ++b)
      for (int64_t k = 0; k < K; k += 8) {
        __m512i l[1], h[1];
        load_q4<1, false>(w.data() + b * K / 8 * 64, 0, k, nullptr, l, h);
        wx[(b * K / 8 + k / 8) * 2] = l[0], wx[(b * K / 8 + k / 8) * 2 + 1] = h[0];
      }
  }
};

template <bool PRE, bool NOADD, bool EXP>
std::pair<double, std::vector<float>> timed(const Data& d, int64_t iters) {
  const uint8_t* w = EXP ? reinterpret_cast<const uint8_t*>(d.wx.data()) : d.w.data();
  const float* pre = reinterpret_cast<const float*>(d.pre.data());
  float out[4 * 2 * 16];
  auto call = [&] {
    variant<4, 2, PRE, NOADD, EXP>(d.hi.data(), d.lo.data(), d.e.data(), d.sx.data(), d.K, w,
                                   KScales(d.sm.data(), d.dd.data(), d.G), pre, out);
  };
  for (int i = 0; i < 10; ++i) call();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    call();
    asm volatile("" ::: "memory");
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / iters;
  return {4.0 * 2 * 16 * d.K / ns, std::vector<float>(out, out + 4 * 2 * 16)};
}
}  // namespace

std::vector<std::pair<double, bool>> bench(int64_t K, int64_t iters) {
  const Data d(K);
  const auto base = timed<false, false, false>(d, iters);
  std::vector<std::pair<double, bool>> r{{base.first, true}};
  for (const auto& v : {timed<true, false, false>(d, iters), timed<false, true, false>(d, iters),
                        timed<false, false, true>(d, iters), timed<true, true, false>(d, iters),
                        timed<true, true, true>(d, iters)})
    r.emplace_back(v.first, v.second == base.second);
  return r;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("bench", &bench); }
"""

NAMES = ("base", "pre", "noadd", "exp", "pre+noadd", "all")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=positive_int, default=2048, help="K-values a row (a multiple of 256)")
    ap.add_argument("--iters", type=positive_int, default=20000)
    ap.add_argument("--rounds", type=positive_int, default=3)
    args = ap.parse_args()
    if args.k % 256:
        ap.error("--k must be a multiple of 256")
    import tempfile

    import torch
    from torch.utils.cpp_extension import load

    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        sys.exit("x16_variants.py: the packed AVX-512 kernels need an AVX-512 CPU")
    build = Path(tempfile.gettempdir()) / "arlm-x16-variants"
    build.mkdir(exist_ok=True)
    src = build / "x16_variants.cpp"
    src.write_text(SOURCE.replace("A8_LINEAR", str(ROOT / "src/arlm/kernels/a8_linear.cpp")))
    m = load(name="x16_variants", sources=[str(src)], build_directory=str(build),
             extra_cflags=["-O3", "-march=native", "-fopenmp"], verbose=False)
    torch.set_num_threads(1)
    print(f"K {args.k}, 4 rows x 2 blocks of 16 channels, one core; G 16-bit multiply-adds a second")
    for _ in range(args.rounds):
        r = m.bench(args.k, args.iters)
        print("  ".join(f"{n} {g:.1f}{'' if same else ' (other bits)'}" for n, (g, same) in zip(NAMES, r)))


if __name__ == "__main__":
    main()
