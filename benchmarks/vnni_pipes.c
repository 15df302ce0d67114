// Whether float FMAs take the 8-bit dot products' (vpdpbusd) execution pipes on this CPU: 8
// independent vpdpbusd chains a loop iteration, alone and with 2, 4 and 8 independent vfmadd
// chains beside them; ns per iteration. If the FMAs ran elsewhere, the time would not grow.
//
//     gcc -O2 -march=icelake-server benchmarks/vnni_pipes.c -o /tmp/vnni_pipes && /tmp/vnni_pipes
//
// (Any -march with AVX-512 VNNI; the CPU must have it.) docs/benchmarks.md uses it to explain the
// packed 16-bit-activation kernels' share of the VNNI peak.
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

volatile int sink;

// (always inlined with a constant count: the chains stay in registers, the loops unrolled)
static inline __attribute__((always_inline)) double run(const int fmas, long n) {
  __m512i a[8];
  __m512 f[8];
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
  __m512 fw = _mm512_set1_ps(1.0f), fx = _mm512_set1_ps(0.0f);
  for (int i = 0; i < 8; i++) {
    a[i] = _mm512_setzero_si512();
    f[i] = _mm512_setzero_ps();
  }
  double t0 = now();
  for (long i = 0; i < n; i++) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) a[j] = _mm512_dpbusd_epi32(a[j], w, x);
#pragma GCC unroll 8
    for (int j = 0; j < fmas; j++) f[j] = _mm512_fmadd_ps(f[j], fw, fx);
    __asm__ volatile("" : "+v"(w), "+v"(fw), "+v"(x));  // (the loop is not folded away)
  }
  double t = now() - t0;
  __m512i s = a[0];
  __m512 fs = f[0];
  for (int i = 1; i < 8; i++) {
    s = _mm512_add_epi32(s, a[i]);
    fs = _mm512_add_ps(fs, f[i]);
  }
  sink = _mm512_reduce_add_epi32(s) + (int)_mm512_reduce_add_ps(fs);
  return t / n * 1e9;
}

int main(void) {
  const long n = 100000000;
  for (int r = 0; r < 2; r++) {
    printf("8 vpdpbusd + 0 vfmadd: %.3f ns an iteration\n", run(0, n));
    printf("8 vpdpbusd + 2 vfmadd: %.3f ns an iteration\n", run(2, n));
    printf("8 vpdpbusd + 4 vfmadd: %.3f ns an iteration\n", run(4, n));
    printf("8 vpdpbusd + 8 vfmadd: %.3f ns an iteration\n", run(8, n));
  }
  return 0;
}
