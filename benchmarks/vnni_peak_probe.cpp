// Issue-rate probe for the int8 dot product the quantized kernels are built on: 12
// independent chains of zmm vpdpbusd (64 u8 x s8 multiply-adds each) per thread, one
// thread per core (OpenMP). Prints the machine's int8 peak in GOPS (2 ops per
// multiply-add), the bar benchmarks/model_sizes.py reports prefill against.
// Build and run: g++ -O2 -march=native -fopenmp benchmarks/vnni_peak_probe.cpp -o /tmp/vnni && /tmp/vnni 2
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
static double chains(long iters) {
  // named accumulators (an array stayed in memory: one load and store per product)
#define DECL(i) __m512i a##i = _mm512_set1_epi32(i);
  CHAINS(DECL)
  __m512i x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(-2);
  asm volatile("" : "+v"(x), "+v"(y));
  for (long it = 0; it < iters; ++it) {
#define STEP(i) a##i = _mm512_dpbusd_epi32(a##i, x, y);
    CHAINS(STEP)
  }
  __m512i s = _mm512_setzero_si512();
#define SUM(i) s = _mm512_add_epi32(s, a##i);
  CHAINS(SUM)
  return static_cast<double>(_mm512_reduce_add_epi32(s));
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : omp_get_max_threads();
  const long iters = 40000000;
  double best = 0, sink = 0;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += chains(iters);
    auto t1 = std::chrono::steady_clock::now();
    const double s = std::chrono::duration<double>(t1 - t0).count();
    const double gops = 2.0 * 64 * 12 * static_cast<double>(iters) * threads / s / 1e9;
    if (gops > best) best = gops;
  }
  std::printf("int8 vpdpbusd peak: %.0f GOPS on %d threads (best of 5)%s\n", best, threads,
              sink == 1.0 ? " " : "");
  return 0;
}
