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
//
// kvs_linear_bf16_amx runs the same bfloat16 panels on AMX tiles for 5-32 rows, where
// the vdpbf16ps kernel runs out of registers and oneDNN's AMX GEMM reads the weights at
// 12-19 GB/s: a panel's [K/2][32][2] layout is, 32 k at a time, two B tiles as they lie
// (16 k pairs x 16 columns, row stride 128 bytes), so the weights stream once, in order,
// and up to 32 rows (two A tiles) accumulate in four 16 x 16 fp32 tiles.
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "kvs_common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;     // columns per packed panel (two zmm)
constexpr int64_t kPrefetch = 32;  // panel rows (4 KiB) prefetched ahead: +30-50 % at 8-32 rows

// bfloat16 panels one call walks together (1 when one row block covers M): with more row
// blocks, each block's rows run over a group of panels that together fit in ~1 MiB of
// L2, so the weights are read from memory once and the x rows once per group rather
// than once per panel (prefill: the whole x re-read from L3 per 32 columns before).
// Groups never drop below one per thread. Grouping changes no sum: each output is still
// one panel's k loop for one row.
inline int64_t panel_group(int64_t K, int64_t M, int64_t rows_per_block, int64_t panels,
                           int64_t nthreads) {
  if (M <= rows_per_block) return 1;
  const int64_t panel_bytes = K * kPanel * 2;
  int64_t g = (int64_t{1} << 20) / panel_bytes;
  g = g > 16 ? 16 : g;
  const int64_t per_thread = (panels + (nthreads < 1 ? 1 : nthreads) - 1) / (nthreads < 1 ? 1 : nthreads);
  g = g > per_thread ? per_thread : g;
  return g < 1 ? 1 : g;
}

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

#if defined(KVS_HAVE_AMX)
constexpr int64_t kAmxPrefetch = 4;  // 32-k steps (8 KiB of panel) prefetched ahead

// Rows [m0, m0 + rows) (rows <= 32) of x, tiled (``a``: two 16-row blocks of K / 32 A
// tiles of 16 x 32, each 1 KiB contiguous, zero rows past M) times one packed panel ->
// out columns [n0, n0 + nvalid). Tiles: 0-3 fp32 accumulators (row block 0/1 x column half 0/1), 4-5 A, 6-7 B. Rule: tiles configured.
inline void amx_panel(const kvs::bf16_t* a, int64_t K, int64_t rows, const kvs::bf16_t* wp,
                      const float* bias, kvs::bf16_t* out, int64_t os, int64_t n0,
                      int64_t nvalid, bool prefetch, float (*c)[kPanel]) {
  const bool two = rows > 16;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    const kvs::bf16_t* b = wp + kb * 16 * 2 * kPanel;  // 16 k pairs x 32 columns x 2
    if (prefetch) {  // the panel's first pass: 2 KiB per step, kAmxPrefetch steps ahead
      const char* ahead = reinterpret_cast<const char*>(b + kAmxPrefetch * 16 * 2 * kPanel);
      for (int line = 0; line < 32; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    }
    _tile_loadd(6, b, 4 * kPanel);
    _tile_loadd(7, b + kPanel, 4 * kPanel);
    _tile_loadd(4, a + kb * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a + (K / 32 + kb) * 512, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, &c[0][0], 4 * kPanel);
  _tile_stored(1, &c[0][16], 4 * kPanel);
  if (two) {
    _tile_stored(2, &c[16][0], 4 * kPanel);
    _tile_stored(3, &c[16][16], 4 * kPanel);
  }
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {  // fp32, padded to the panel
    b0 = _mm512_loadu_ps(bias + n0);
    b1 = _mm512_loadu_ps(bias + n0 + 16);
  }
  for (int64_t r = 0; r < rows; ++r) {
    kvs::bf16_t* o = out + r * os + n0;
    const __m512 y0 = _mm512_add_ps(_mm512_loadu_ps(&c[r][0]), b0);
    const __m512 y1 = _mm512_add_ps(_mm512_loadu_ps(&c[r][16]), b1);
    if (nvalid == kPanel) {
      kvs::store16(o, y0);
      kvs::store16(o + 16, y1);
    } else {
      kvs::bf16_t tmp[kPanel];
      kvs::store16(tmp, y0);
      kvs::store16(tmp + 16, y1);
      std::memcpy(o, tmp, static_cast<size_t>(nvalid) * sizeof(kvs::bf16_t));
    }
  }
}
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
  const int64_t group = panel_group(K, M, 8, panels, nthreads);
  const int64_t groups = (panels + group - 1) / group;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (panels > 1 && M * N * K > 65536)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t p_end = (g + 1) * group < panels ? (g + 1) * group : panels;
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int64_t mr = M - m0 < 8 ? M - m0 : 8;
      for (int64_t p = g * group; p < p_end; ++p) {
        const int64_t n0 = p * kPanel;
        const int64_t nvalid = N - n0 < kPanel ? N - n0 : kPanel;
        kPanelBf16Fns[mr](x + m0 * xs, xs, k2, wp + p * K * kPanel, bias, out + m0 * os, os, n0,
                          nvalid);
      }
    }
  }
  return 0;
#else
  (void)x, (void)xs, (void)wp, (void)bias, (void)out, (void)os, (void)nthreads;
  return 1;
#endif
}

// 1 when this build and process can run kvs_linear_bf16_amx (AMX-BF16, tile state granted).
int kvs_linear_bf16_amx_available() {
#if defined(KVS_HAVE_AMX)
  return kvs::amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// kvs_linear_bf16 on AMX tiles: same arguments, packing and result (fp32 sums, rounded
// once), for K a multiple of 32, any M: 5-32 rows stream each panel once; more rows run
// 32-row blocks over L2-sized panel groups (panel_group). Returns 0, 1 without AMX, 2 for
// bad sizes.
int kvs_linear_bf16_amx(const uint16_t* x, int64_t xs, int64_t M, int64_t K, const uint16_t* wp,
                        int64_t N, const float* bias, uint16_t* out, int64_t os, int nthreads) {
  if (M < 0 || K <= 0 || N <= 0 || K % 32 != 0) return 2;
#if defined(KVS_HAVE_AMX)
  if (!kvs::amx_permitted()) return 1;
  if (M == 0) return 0;
  // x copied into A tiles ([16-row block][K / 32][16][32], zero rows past M), so every A
  // tile load is in bounds and reads 1 KiB in order
  const int64_t padded_rows = (M + 31) / 32 * 32;
  const int64_t kt = K / 32;
  std::vector<uint16_t> xp(static_cast<size_t>(padded_rows * K), 0);
  for (int64_t r = 0; r < M; ++r) {
    uint16_t* dst = xp.data() + (r / 16) * kt * 512 + (r % 16) * 32;
    for (int64_t kb = 0; kb < kt; ++kb) std::memcpy(dst + kb * 512, x + r * xs + kb * 32, 64);
  }
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t group = panel_group(K, M, 32, panels, nthreads);
  const int64_t groups = (panels + group - 1) / group;
#pragma omp parallel num_threads(panels > 1 ? nthreads : 1)
  {
    kvs::configure_tiles();
    alignas(64) float c[32][kPanel];
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t p_end = (g + 1) * group < panels ? (g + 1) * group : panels;
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const int64_t rows = M - m0 < 32 ? M - m0 : 32;
        for (int64_t p = g * group; p < p_end; ++p) {
          const int64_t n0 = p * kPanel;
          const int64_t nvalid = N - n0 < kPanel ? N - n0 : kPanel;
          amx_panel(xp.data() + m0 * K, K, rows, wp + p * K * kPanel, bias, out + m0 * os, os,
                    n0, nvalid, m0 == 0, c);
        }
      }
    }
    _tile_release();  // leave no tile state behind for oneDNN or anyone else
  }
  return 0;
#else
  (void)x, (void)xs, (void)wp, (void)bias, (void)out, (void)os, (void)nthreads;
  return 1;
#endif
}

}  // extern "C"
