// Batched LoRA delta over a mixed batch (bindings: kvserve.lora.ops; also called by the
// fused decode step, csrc/decode_step.cpp).
//
// For each row t whose slot s = row_slot[t] >= 0, after the base linear y = W x:
//   xa[j] = A[s][j] . x[t]                       j in [0, P*R)   (A: [S, P*R, in])
//   y[t, off[p]:off[p+1]] += sum_r xa[p*R + r] * Bt[s][r][off[p]:off[p+1]]
// (Bt: [S, R, out], the scale folded in). Rows of slot -1 are not touched. x and y are
// float32 or bfloat16 (dtype 0 / 1), A and Bt float32 or bfloat16 (w_dtype 0 / 1); the
// sums run in float32 and y is rounded once.
//
// Rows of one slot run in tiles of up to kTile that share each load of A and Bt; the
// shrink (x . A) is register-blocked over kTile rows x kRanks rows of A, the expand
// (xa . Bt) over kTile rows x kCols 16-column blocks (bf16 rows and bf16 Bt with an even
// rank: xa rounded to bf16 and two ranks per vdpbf16ps). Weights are prefetched one
// block ahead. Every (row, output) sum runs in
// one fixed order whatever the tile and block sizes, so a row's result does not depend
// on the other rows of the batch or on the thread count. Paths: AVX-512 (with
// AVX512_BF16, bf16 rows times bf16 A use vdpbf16ps, 32 products per instruction;
// otherwise every element is widened to float32 and FMA'd), and portable loops.

#include <omp.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvs_common.h"

namespace {

using kvs::bf16_t;

constexpr int kTile = 4;   // rows of one slot sharing each load of A and Bt
constexpr int kRanks = 4;  // rows of A per shrink block
constexpr int kCols = 4;   // 16-column blocks per expand block
constexpr int kPairCols = 2;  // 32-column blocks per bf16 pair expand block
constexpr int kMaxPairRanks = 128;  // parts x rank / 2 held for the pair expand
// blocks ahead that the shrink and the expand prefetch the weights they read (1, 2
// and 4 measured: 1 was fastest for decode rows, AMD EPYC Zen 4)
constexpr int kPrefetchBlocks = 1;
// weight elements read per thread below which another thread costs more than it
// saves (a decode step's delta is a few hundred thousand per call)
constexpr int64_t kWorkPerThread = 1 << 17;

#if defined(__AVX512F__)
// Shrink block for N rows x NJ rows of A: xa[k*pr + j + jj] for k < N, jj < NJ; rows
// widened to float32 in xf [N, in_f].
template <int N, int NJ, typename W>
inline void shrink_block(const float* xf, int64_t in_f, const W* a, int64_t pr, int64_t j,
                         float* xa) {
  __m512 v[N][NJ];
  for (int k = 0; k < N; ++k)
    for (int jj = 0; jj < NJ; ++jj) v[k][jj] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= in_f; i += 16) {
    __m512 av[NJ];
    for (int jj = 0; jj < NJ; ++jj) av[jj] = kvs::load16(a + (j + jj) * in_f + i);
    for (int k = 0; k < N; ++k) {
      const __m512 xv = _mm512_loadu_ps(xf + k * in_f + i);
      for (int jj = 0; jj < NJ; ++jj) v[k][jj] = _mm512_fmadd_ps(av[jj], xv, v[k][jj]);
    }
  }
  for (int k = 0; k < N; ++k)
    for (int jj = 0; jj < NJ; ++jj) {
      float t = _mm512_reduce_add_ps(v[k][jj]);
      const W* ar = a + (j + jj) * in_f;
      for (int64_t ii = i; ii < in_f; ++ii) t += kvs::to_f32(ar[ii]) * xf[k * in_f + ii];
      xa[k * pr + j + jj] = t;
    }
}
#endif

#if defined(__AVX512BF16__)
// The same block for bf16 rows and bf16 A: vdpbf16ps over pairs, 32 elements a step
// (a masked last step covers in_f % 32); rows read in place.
template <int N, int NJ>
inline void shrink_block_bf16(const bf16_t* const* xr, int64_t in_f, const bf16_t* a, int64_t pr,
                              int64_t j, float* xa) {
  __m512 v[N][NJ];
  for (int k = 0; k < N; ++k)
    for (int jj = 0; jj < NJ; ++jj) v[k][jj] = _mm512_setzero_ps();
  for (int64_t i = 0; i < in_f; i += 32) {
    const int64_t left = in_f - i;
    const __mmask32 m = left >= 32 ? ~__mmask32(0) : ((__mmask32(1) << left) - 1);
    __m512bh av[NJ];
    for (int jj = 0; jj < NJ; ++jj) {
      av[jj] = (__m512bh)_mm512_maskz_loadu_epi16(m, a + (j + jj) * in_f + i);
      // rows of A kPrefetchBlocks blocks on: a row is only in_f elements, a few cache
      // lines, too short for the hardware prefetcher to ramp up on
      if (j + jj + kPrefetchBlocks * NJ < pr)
        _mm_prefetch(reinterpret_cast<const char*>(a + (j + jj + kPrefetchBlocks * NJ) * in_f + i),
                     _MM_HINT_T0);
    }
    for (int k = 0; k < N; ++k) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, xr[k] + i);
      for (int jj = 0; jj < NJ; ++jj) v[k][jj] = _mm512_dpbf16_ps(v[k][jj], av[jj], xv);
    }
  }
  for (int k = 0; k < N; ++k)
    for (int jj = 0; jj < NJ; ++jj) xa[k * pr + j + jj] = _mm512_reduce_add_ps(v[k][jj]);
}
#endif

// xa[k*pr + j] = A[j] . x_k for the tile's N rows (xr: their row pointers).
template <int N, typename T, typename W>
void shrink(const T* const* xr, int64_t in_f, const W* a, int64_t pr, float* xf, float* xa) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16_t> && std::is_same_v<W, bf16_t>) {
    int64_t j = 0;
    for (; j + kRanks <= pr; j += kRanks) shrink_block_bf16<N, kRanks>(xr, in_f, a, pr, j, xa);
    for (; j < pr; ++j) shrink_block_bf16<N, 1>(xr, in_f, a, pr, j, xa);
    return;
  }
#endif
  for (int k = 0; k < N; ++k)
    for (int64_t i = 0; i < in_f; ++i) xf[k * in_f + i] = kvs::to_f32(xr[k][i]);
#if defined(__AVX512F__)
  int64_t j = 0;
  for (; j + kRanks <= pr; j += kRanks) shrink_block<N, kRanks>(xf, in_f, a, pr, j, xa);
  for (; j < pr; ++j) shrink_block<N, 1>(xf, in_f, a, pr, j, xa);
#else
  for (int64_t j = 0; j < pr; ++j)
    for (int k = 0; k < N; ++k) {
      float t = 0.f;
      for (int64_t i = 0; i < in_f; ++i) t += kvs::to_f32(a[j * in_f + i]) * xf[k * in_f + i];
      xa[k * pr + j] = t;
    }
#endif
}

#if defined(__AVX512F__)
// Expand block: columns [c, c + 16 NC) of the tile's N rows, y += sum_r xp[r] * Bt[r].
template <int N, int NC, typename T, typename W>
inline void expand_block(T* const* yr, const W* b, int64_t out_f, const float* xp, int64_t pr,
                         int rank, int64_t c) {
  __m512 v[N][NC];
  for (int k = 0; k < N; ++k)
    for (int cc = 0; cc < NC; ++cc) v[k][cc] = _mm512_setzero_ps();
  // the same rows of Bt kPrefetchBlocks blocks on (rank short streams at once)
  const int64_t ahead = c + kPrefetchBlocks * 16 * NC;
  constexpr int kLines = static_cast<int>((16 * NC * sizeof(W) + 63) / 64);
  for (int r = 0; r < rank; ++r) {
    __m512 bv[NC];
    const W* br = b + static_cast<int64_t>(r) * out_f;
    for (int cc = 0; cc < NC; ++cc) bv[cc] = kvs::load16(br + c + 16 * cc);
    if (ahead < out_f)
      for (int ln = 0; ln < kLines; ++ln)
        _mm_prefetch(reinterpret_cast<const char*>(br + ahead) + 64 * ln, _MM_HINT_T0);
    for (int k = 0; k < N; ++k) {
      const __m512 xb = _mm512_set1_ps(xp[k * pr + r]);
      for (int cc = 0; cc < NC; ++cc) v[k][cc] = _mm512_fmadd_ps(xb, bv[cc], v[k][cc]);
    }
  }
  for (int k = 0; k < N; ++k)
    for (int cc = 0; cc < NC; ++cc) {
      T* p = yr[k] + c + 16 * cc;
      kvs::store16(p, _mm512_add_ps(kvs::load16(p), v[k][cc]));
    }
}
#endif

#if defined(__AVX512BF16__)
// Expand block for bfloat16 rows and bfloat16 Bt with xa rounded to bfloat16 (xh:
// the tile's xa as bf16 pairs, xh[k * pr / 2 + r / 2] = (xa[r], xa[r + 1])): columns
// [c, c + 32 NC), two ranks per vdpbf16ps. Rows r and r + 1 of Bt are interleaved by
// unpacklo/hi_epi16, so within each 128-bit lane the lo sums hold columns 0-3 and the
// hi sums columns 4-7 of that lane's 8; y is split the same way and packed back.
template <int N, int NC>
inline void expand_block_bf16(bf16_t* const* yr, const bf16_t* b, int64_t out_f,
                              const uint32_t* xh, int64_t pr, int rank, int64_t c) {
  __m512 vl[N][NC], vh[N][NC];
  for (int k = 0; k < N; ++k)
    for (int cc = 0; cc < NC; ++cc) vl[k][cc] = vh[k][cc] = _mm512_setzero_ps();
  const int64_t ahead = c + kPrefetchBlocks * 32 * NC;
  for (int r = 0; r < rank; r += 2) {
    const bf16_t* b0 = b + static_cast<int64_t>(r) * out_f;
    const bf16_t* b1 = b0 + out_f;
    __m512bh bl[NC], bh[NC];
    for (int cc = 0; cc < NC; ++cc) {
      const __m512i w0 = _mm512_loadu_si512(b0 + c + 32 * cc);
      const __m512i w1 = _mm512_loadu_si512(b1 + c + 32 * cc);
      bl[cc] = (__m512bh)_mm512_unpacklo_epi16(w0, w1);
      bh[cc] = (__m512bh)_mm512_unpackhi_epi16(w0, w1);
    }
    if (ahead < out_f)
      for (int ln = 0; ln < NC; ++ln) {
        _mm_prefetch(reinterpret_cast<const char*>(b0 + ahead) + 64 * ln, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(b1 + ahead) + 64 * ln, _MM_HINT_T0);
      }
    for (int k = 0; k < N; ++k) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xh[k * (pr / 2) + r / 2]));
      for (int cc = 0; cc < NC; ++cc) {
        vl[k][cc] = _mm512_dpbf16_ps(vl[k][cc], bl[cc], xb);
        vh[k][cc] = _mm512_dpbf16_ps(vh[k][cc], bh[cc], xb);
      }
    }
  }
  const __m512i zero = _mm512_setzero_si512(), bias = _mm512_set1_epi32(0x7fff),
                one = _mm512_set1_epi32(1);
  auto round_hi = [&](__m512 v) {  // round to nearest even as kvs::store16, bits >> 16
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, lsb)), 16);
  };
  for (int k = 0; k < N; ++k)
    for (int cc = 0; cc < NC; ++cc) {
      bf16_t* p = yr[k] + c + 32 * cc;
      const __m512i yv = _mm512_loadu_si512(p);
      const __m512 sl = _mm512_add_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, yv)), vl[k][cc]);
      const __m512 sh = _mm512_add_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, yv)), vh[k][cc]);
      _mm512_storeu_si512(p, _mm512_packus_epi32(round_hi(sl), round_hi(sh)));
    }
}
#endif

// One tile: N rows of one slot (row pointers xr into x, yr into y).
template <int N, typename T, typename W>
void lora_tile(const T* const* xr, T* const* yr, int64_t in_f, int64_t out_f, const W* As,
               const W* Bs, const int64_t* offsets, int parts, int rank, float* xf, float* xa) {
  const int64_t pr = static_cast<int64_t>(parts) * rank;
  shrink<N>(xr, in_f, As, pr, xf, xa);
#if defined(__AVX512BF16__)
  // bf16 rows and bf16 Bt, even rank: the expand reads xa rounded to bf16 (as the
  // model's own dtype; vLLM's expand does the same), two ranks per instruction
  constexpr bool kPairs = std::is_same_v<T, bf16_t> && std::is_same_v<W, bf16_t>;
  uint32_t xh[kTile * kMaxPairRanks];
  const bool pairs = kPairs && rank % 2 == 0 && pr <= 2 * kMaxPairRanks;
  if (pairs)
    for (int k = 0; k < N; ++k)
      for (int64_t j = 0; j < pr; j += 2) {
        bf16_t lo16, hi16;
        kvs::from_f32(xa[k * pr + j], &lo16);
        kvs::from_f32(xa[k * pr + j + 1], &hi16);
        xa[k * pr + j] = kvs::to_f32(lo16);  // the tails below read the same values
        xa[k * pr + j + 1] = kvs::to_f32(hi16);
        xh[k * (pr / 2) + j / 2] = static_cast<uint32_t>(lo16) | (static_cast<uint32_t>(hi16) << 16);
      }
#endif
  for (int p = 0; p < parts; ++p) {
    const int64_t lo = offsets[p], hi = offsets[p + 1];
    const float* xp = xa + static_cast<int64_t>(p) * rank;
    int64_t c = lo;
#if defined(__AVX512BF16__)
    if constexpr (kPairs)
      if (pairs)
        for (; c + 32 * kPairCols <= hi; c += 32 * kPairCols)
          expand_block_bf16<N, kPairCols>(reinterpret_cast<bf16_t* const*>(yr),
                                          reinterpret_cast<const bf16_t*>(Bs), out_f,
                                          xh + p * (rank / 2), pr, rank, c);
#endif
#if defined(__AVX512F__)
    for (; c + 16 * kCols <= hi; c += 16 * kCols)
      expand_block<N, kCols>(yr, Bs, out_f, xp, pr, rank, c);
    for (; c + 16 <= hi; c += 16) expand_block<N, 1>(yr, Bs, out_f, xp, pr, rank, c);
#endif
    for (; c < hi; ++c) {
      for (int k = 0; k < N; ++k) {
        float d = 0.f;
        for (int r = 0; r < rank; ++r)
          d += xp[k * pr + r] * kvs::to_f32(Bs[static_cast<int64_t>(r) * out_f + c]);
        kvs::from_f32(kvs::to_f32(yr[k][c]) + d, yr[k] + c);
      }
    }
  }
}

template <typename T, typename W>
void run_tile(const T* x, int64_t x_stride, T* y, int64_t y_stride, const int64_t* rows, int n,
              int64_t in_f, int64_t out_f, const W* As, const W* Bs, const int64_t* offsets,
              int parts, int rank, float* xf, float* xa) {
  const T* xr[kTile];
  T* yr[kTile];
  for (int k = 0; k < n; ++k) {
    xr[k] = x + rows[k] * x_stride;
    yr[k] = y + rows[k] * y_stride;
  }
  switch (n) {
    case 1: lora_tile<1>(xr, yr, in_f, out_f, As, Bs, offsets, parts, rank, xf, xa); break;
    case 2: lora_tile<2>(xr, yr, in_f, out_f, As, Bs, offsets, parts, rank, xf, xa); break;
    case 3: lora_tile<3>(xr, yr, in_f, out_f, As, Bs, offsets, parts, rank, xf, xa); break;
    default: lora_tile<4>(xr, yr, in_f, out_f, As, Bs, offsets, parts, rank, xf, xa); break;
  }
}

template <typename T, typename W>
void lora_delta(const T* x, int64_t x_stride, T* y, int64_t y_stride, int64_t rows, int64_t in_f,
                int64_t out_f, const W* A, const W* Bt, const int32_t* row_slot,
                const int64_t* offsets, int parts, int rank, int nthreads) {
  static_assert(kTile == 4, "run_tile dispatches 1..4 rows");
  const int64_t pr = static_cast<int64_t>(parts) * rank;
  // rows of each slot together (stable: ascending row order within a slot), in tiles
  std::vector<int64_t> order;
  order.reserve(rows);
  for (int64_t t = 0; t < rows; ++t)
    if (row_slot[t] >= 0) order.push_back(t);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return row_slot[a] < row_slot[b]; });
  std::vector<std::pair<int64_t, int>> tiles;  // (first index in order, rows)
  for (size_t i = 0; i < order.size();) {
    size_t j = i;
    while (j < order.size() && j - i < kTile && row_slot[order[j]] == row_slot[order[i]]) ++j;
    tiles.emplace_back(static_cast<int64_t>(i), static_cast<int>(j - i));
    i = j;
  }
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  if (num_tiles == 0) return;
  // weights read per tile, plus the multiply-adds of its rows beyond the first
  const int64_t per_tile = pr * in_f + static_cast<int64_t>(rank) * out_f;
  int64_t work = 0;
  for (const auto& t : tiles) work += per_tile * (1 + (t.second - 1) / 2);
  const int threads = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>({nthreads, num_tiles, work / kWorkPerThread})));
  auto one = [&](int64_t ti, float* xf, float* xa) {
    const int64_t* tr = order.data() + tiles[ti].first;
    const int64_t s = row_slot[tr[0]];
    run_tile<T, W>(x, x_stride, y, y_stride, tr, tiles[ti].second, in_f, out_f, A + s * pr * in_f,
                   Bt + s * rank * out_f, offsets, parts, rank, xf, xa);
  };
  if (threads <= 1) {
    std::vector<float> xf(kTile * in_f), xa(kTile * pr);
    for (int64_t ti = 0; ti < num_tiles; ++ti) one(ti, xf.data(), xa.data());
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> xf(kTile * in_f), xa(kTile * pr);
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < num_tiles; ++ti) one(ti, xf.data(), xa.data());
  }
}

template <typename W>
int lora_delta_w(const void* x, int64_t x_stride, void* y, int64_t y_stride, int64_t rows,
                 int64_t in_f, int64_t out_f, const W* A, const W* Bt, const int32_t* row_slot,
                 const int64_t* offsets, int parts, int rank, int dtype, int nthreads) {
  if (dtype == 0) {
    lora_delta<float, W>(static_cast<const float*>(x), x_stride, static_cast<float*>(y), y_stride,
                         rows, in_f, out_f, A, Bt, row_slot, offsets, parts, rank, nthreads);
  } else if (dtype == 1) {
    lora_delta<bf16_t, W>(static_cast<const bf16_t*>(x), x_stride, static_cast<bf16_t*>(y),
                          y_stride, rows, in_f, out_f, A, Bt, row_slot, offsets, parts, rank,
                          nthreads);
  } else {
    return 1;
  }
  return 0;
}

}  // namespace

extern "C" {

// Rules: x [rows, in_f] (row stride x_stride) and y [rows, out_f] (row stride y_stride)
// in dtype; A [S, parts*rank, in_f] and Bt [S, rank, out_f] contiguous in w_dtype;
// row_slot [rows] int32 (-1: untouched, else < S); offsets [parts + 1] int64, 0 to out_f.
// nthreads: the most threads to use (fewer where the work is small). Returns 0, or 1
// for an unknown dtype, 2 for an unknown w_dtype.
int kvs_lora_delta(const void* x, int64_t x_stride, void* y, int64_t y_stride, int64_t rows,
                   int64_t in_f, int64_t out_f, const void* A, const void* Bt,
                   const int32_t* row_slot, const int64_t* offsets, int parts, int rank, int dtype,
                   int w_dtype, int nthreads) {
  if (w_dtype == 0)
    return lora_delta_w<float>(x, x_stride, y, y_stride, rows, in_f, out_f,
                               static_cast<const float*>(A), static_cast<const float*>(Bt),
                               row_slot, offsets, parts, rank, dtype, nthreads);
  if (w_dtype == 1)
    return lora_delta_w<bf16_t>(x, x_stride, y, y_stride, rows, in_f, out_f,
                                static_cast<const bf16_t*>(A), static_cast<const bf16_t*>(Bt),
                                row_slot, offsets, parts, rank, dtype, nthreads);
  return 2;
}

}  // extern "C"
