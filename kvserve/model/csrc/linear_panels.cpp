// Linear layers for decode-sized batches: y[M, N] = x[M, K] @ W^T (+ bias), float32
// (kvs_linear_f32) and bfloat16 (kvs_linear_bf16, AVX512-BF16 dot products).
//
// Same library and plain C ABI as the other kernels. At M <= ~32 rows a float32
// decode step is bound by reading the weights, but oneDNN's and MKL's GEMMs reach
// only 8-14 GB/s there: their weight layout makes each 32-column panel a strided
// walk. Here the weight is packed once as [ceil(N/32)][K][32] (column panels, zero
// padded), so every panel is one contiguous stream the hardware prefetcher follows,
// and each panel is read once per call while up to 8 rows accumulate in registers
// (16 zmm accumulators per 8-row block; more rows re-read the panel from L2).
//
// Sums run over k in order per output, in fp32 FMAs (no reassociation across k), so
// results differ from another GEMM's only by rounding order.
#include <cstdint>
#include <cstring>

#include <omp.h>

#include "kvs_common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;     // columns per packed panel (two zmm)
constexpr int64_t kPrefetch = 32;  // panel rows (4 KiB) prefetched ahead: +30-50 % at 8-32 rows

#if defined(__AVX512F__)
// rows [0, MR) of x (row stride xs) times one packed panel -> out columns [n0, n0 + nvalid)
template <int MR>
inline void panel_rows(const float* x, int64_t xs, int64_t K, const float* wp, const float* bias,
                       float* out, int64_t os, int64_t n0, int64_t nvalid) {
  __m512 a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) {
    a0[r] = _mm512_setzero_ps();
    a1[r] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    // past the panel's end this touches the next panel (or harmless memory: prefetches
    // never fault)
    _mm_prefetch(reinterpret_cast<const char*>(wp + (k + kPrefetch) * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wp + (k + kPrefetch) * kPanel + 16), _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(wp + k * kPanel);
    const __m512 w1 = _mm512_loadu_ps(wp + k * kPanel + 16);
    for (int r = 0; r < MR; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * xs + k]);
      a0[r] = _mm512_fmadd_ps(b, w0, a0[r]);
      a1[r] = _mm512_fmadd_ps(b, w1, a1[r]);
    }
  }
  const __mmask16 m0 = nvalid >= 16 ? __mmask16(0xffff) : __mmask16((1u << nvalid) - 1u);
  const __mmask16 m1 =
      nvalid >= 32 ? __mmask16(0xffff) : (nvalid <= 16 ? __mmask16(0) : __mmask16((1u << (nvalid - 16)) - 1u));
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    b0 = _mm512_maskz_loadu_ps(m0, bias + n0);
    b1 = _mm512_maskz_loadu_ps(m1, bias + n0 + 16);
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(out + r * os + n0, m0, _mm512_add_ps(a0[r], b0));
    _mm512_mask_storeu_ps(out + r * os + n0 + 16, m1, _mm512_add_ps(a1[r], b1));
  }
}

using PanelFn = void (*)(const float*, int64_t, int64_t, const float*, const float*, float*,
                         int64_t, int64_t, int64_t);
constexpr PanelFn kPanelFns[9] = {nullptr,          panel_rows<1>, panel_rows<2>,
                                  panel_rows<3>,    panel_rows<4>, panel_rows<5>,
                                  panel_rows<6>,    panel_rows<7>, panel_rows<8>};
#endif

#if defined(__AVX512BF16__)
// bfloat16: the weight packed as [ceil(N/32)][ceil(K/2)][32][2] (each column's k pair
// adjacent, zero padded), so one vdpbf16ps adds x[r, 2kk] * w[2kk] + x[r, 2kk+1] *
// w[2kk+1] to 16 columns' fp32 sums. x rows need an even K (the caller pads).
template <int MR>
inline void panel_rows_bf16(const kvs::bf16_t* x, int64_t xs, int64_t K2, const kvs::bf16_t* wp,
                            const float* bias, kvs::bf16_t* out, int64_t os, int64_t n0,
                            int64_t nvalid) {
  __m512 a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) {
    a0[r] = _mm512_setzero_ps();
    a1[r] = _mm512_setzero_ps();
  }
  for (int64_t kk = 0; kk < K2; ++kk) {
    const kvs::bf16_t* w = wp + kk * 2 * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(w + 2 * kPanel * kPrefetch), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 2 * kPanel * kPrefetch + 32), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    for (int r = 0; r < MR; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * xs + 2 * kk, 4);
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      a0[r] = _mm512_dpbf16_ps(a0[r], b, w0);
      a1[r] = _mm512_dpbf16_ps(a1[r], b, w1);
    }
  }
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {  // fp32, padded to the panel
    b0 = _mm512_loadu_ps(bias + n0);
    b1 = _mm512_loadu_ps(bias + n0 + 16);
  }
  for (int r = 0; r < MR; ++r) {
    kvs::bf16_t* o = out + r * os + n0;
    if (nvalid == kPanel) {
      kvs::store16(o, _mm512_add_ps(a0[r], b0));
      kvs::store16(o + 16, _mm512_add_ps(a1[r], b1));
    } else {
      kvs::bf16_t tmp[kPanel];
      kvs::store16(tmp, _mm512_add_ps(a0[r], b0));
      kvs::store16(tmp + 16, _mm512_add_ps(a1[r], b1));
      std::memcpy(o, tmp, static_cast<size_t>(nvalid) * sizeof(kvs::bf16_t));
    }
  }
}

using PanelBf16Fn = void (*)(const kvs::bf16_t*, int64_t, int64_t, const kvs::bf16_t*,
                             const float*, kvs::bf16_t*, int64_t, int64_t, int64_t);
constexpr PanelBf16Fn kPanelBf16Fns[9] = {
    nullptr,              panel_rows_bf16<1>, panel_rows_bf16<2>, panel_rows_bf16<3>,
    panel_rows_bf16<4>,   panel_rows_bf16<5>, panel_rows_bf16<6>, panel_rows_bf16<7>,
    panel_rows_bf16<8>};
#endif

}  // namespace

extern "C" {

// 1 when this build has the AVX-512 path (otherwise kvs_linear_f32 returns 1 and the
// caller keeps its own GEMM).
int kvs_linear_f32_available() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

// out[M, N] (row stride os) = x[M, K] (row stride xs, last dim contiguous) @ W^T + bias.
// wp: W packed as [ceil(N/32)][K][32], zero padded past N; bias: [N] or null.
// Returns 0, or 1 without the AVX-512 path, 2 for bad sizes.
int kvs_linear_f32(const float* x, int64_t xs, int64_t M, int64_t K, const float* wp, int64_t N,
                   const float* bias, float* out, int64_t os, int nthreads) {
  if (M < 0 || K <= 0 || N <= 0) return 2;
#if defined(__AVX512F__)
  const int64_t panels = (N + kPanel - 1) / kPanel;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (panels > 1 && M * N * K > 65536)
  for (int64_t p = 0; p < panels; ++p) {
    const float* w = wp + p * K * kPanel;
    const int64_t n0 = p * kPanel;
    const int64_t nvalid = N - n0 < kPanel ? N - n0 : kPanel;
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int64_t mr = M - m0 < 8 ? M - m0 : 8;
      kPanelFns[mr](x + m0 * xs, xs, K, w, bias, out + m0 * os, os, n0, nvalid);
    }
  }
  return 0;
#else
  (void)x, (void)xs, (void)wp, (void)bias, (void)out, (void)os, (void)nthreads;
  return 1;
#endif
}

// 1 when this build has the AVX512-BF16 path (otherwise kvs_linear_bf16 returns 1).
int kvs_linear_bf16_available() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// out[M, N] bf16 (row stride os) = x[M, K] bf16 (row stride xs, K even, last dim
// contiguous) @ W^T + bias, sums in fp32, rounded to nearest even once.
// wp: W packed as [ceil(N/32)][K/2][32][2]; bias: fp32 [ceil(N/32) * 32] or null.
// Returns 0, or 1 without the AVX512-BF16 path, 2 for bad sizes.
int kvs_linear_bf16(const uint16_t* x, int64_t xs, int64_t M, int64_t K, const uint16_t* wp,
                    int64_t N, const float* bias, uint16_t* out, int64_t os, int nthreads) {
  if (M < 0 || K <= 0 || N <= 0 || K % 2 != 0) return 2;
#if defined(__AVX512BF16__)
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t k2 = K / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (panels > 1 && M * N * K > 65536)
  for (int64_t p = 0; p < panels; ++p) {
    const uint16_t* w = wp + p * K * kPanel;
    const int64_t n0 = p * kPanel;
    const int64_t nvalid = N - n0 < kPanel ? N - n0 : kPanel;
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int64_t mr = M - m0 < 8 ? M - m0 : 8;
      kPanelBf16Fns[mr](x + m0 * xs, xs, k2, w, bias, out + m0 * os, os, n0, nvalid);
    }
  }
  return 0;
#else
  (void)x, (void)xs, (void)wp, (void)bias, (void)out, (void)os, (void)nthreads;
  return 1;
#endif
}

}  // extern "C"
