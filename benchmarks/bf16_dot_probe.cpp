// Issue-rate probe behind the bf16 product choice in csrc/paged_attention.cpp and
// csrc/prefill_vec.cpp: zmm fp32 FMA vs vdpbf16ps, 10 independent chains each.
// Build and run: g++ -O2 -march=native benchmarks/bf16_dot_probe.cpp -o /tmp/probe && /tmp/probe
// AMD EPYC Zen 5 (this project's CPU): 0.273 ns per instruction for both (dp/fma 1.00),
// i.e. vdpbf16ps at twice the FLOP rate of fp32 FMAs.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#define BODY(OP) \
  a0 = OP(a0); a1 = OP(a1); a2 = OP(a2); a3 = OP(a3); a4 = OP(a4); \
  a5 = OP(a5); a6 = OP(a6); a7 = OP(a7); a8 = OP(a8); a9 = OP(a9);
template <int KIND> double run(long iters) {
  __m512 a0 = _mm512_set1_ps(0.f), a1 = _mm512_set1_ps(1.f), a2 = _mm512_set1_ps(2.f), a3 = _mm512_set1_ps(3.f), a4 = _mm512_set1_ps(4.f), a5 = _mm512_set1_ps(5.f), a6 = _mm512_set1_ps(6.f), a7 = _mm512_set1_ps(7.f), a8 = _mm512_set1_ps(8.f), a9 = _mm512_set1_ps(9.f);
  __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
  __m512bh xb = (__m512bh)_mm512_set1_epi32(0x3f803f80), yb = xb;
  asm volatile("" : "+v"(x), "+v"(y), "+v"(xb), "+v"(yb));
  auto t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < iters; ++it) {
    if (KIND == 0) {
#define F(v) _mm512_fmadd_ps(x, y, v)
      BODY(F)
    } else {
#define D(v) _mm512_dpbf16_ps(v, xb, yb)
      BODY(D)
    }
  }
  auto t1 = std::chrono::steady_clock::now();
  __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
     _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)), _mm512_add_ps(a8, a9)));
  if (_mm512_reduce_add_ps(s) == 12345.f) printf("x");
  return std::chrono::duration<double>(t1 - t0).count() / (iters * 10.0);
}
int main() {
  const long n = 50000000;
  for (int r = 0; r < 3; ++r) {
    double f = run<0>(n), d = run<1>(n);
    printf("ns/instr: fma %.4f  dpbf16 %.4f  dp/fma time ratio %.2f  => dpbf16 flop rate %.2fx fp32 fma\n", f * 1e9, d * 1e9, d / f, 2 * f / d);
  }
}
