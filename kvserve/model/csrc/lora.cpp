// Batched LoRA delta over a mixed batch (bindings: kvserve.lora.ops).
//
// For each row t whose slot s = row_slot[t] >= 0, after the base linear y = W x:
//   xa[j] = A[s][j] . x[t]                       j in [0, P*R)   (A: [S, P*R, in])
//   y[t, off[p]:off[p+1]] += sum_r xa[p*R + r] * Bt[s][r][off[p]:off[p+1]]
// (Bt: [S, R, out], the scale folded in). Rows of slot -1 are not touched. Rows of one
// slot run in tiles of up to 4 that share each load of A and Bt; every row's sums run
// in one fixed order, so a row's result does not depend on the other rows of the batch. x and y are float32 or bfloat16 (dtype 0 / 1); the sums
// run in float32 and y is rounded once. An AVX-512 path and a portable one.

#include <omp.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "kvs_common.h"

namespace {

using kvs::bf16_t;

constexpr int kTile = 4;  // rows of one slot sharing each load of A and Bt

// One tile: rows rows[0..n) (n <= kTile) of slot s. Each row's sums run in the same
// order whatever n is, so a row's result does not depend on its tile mates.
template <typename T>
void lora_tile(const T* x, int64_t x_stride, T* y, int64_t y_stride, const int64_t* rows, int n,
               int64_t in_f, int64_t out_f, const float* As, const float* Bs,
               const int64_t* offsets, int parts, int rank, float* xf, float* xa) {
  const int64_t pr = static_cast<int64_t>(parts) * rank;
  for (int k = 0; k < n; ++k) {
    const T* xr = x + rows[k] * x_stride;
    for (int64_t i = 0; i < in_f; ++i) xf[k * in_f + i] = kvs::to_f32(xr[i]);
  }
  for (int64_t j = 0; j < pr; ++j) {
    const float* a = As + j * in_f;
    float sum[kTile] = {0.f, 0.f, 0.f, 0.f};
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 v[kTile];
    for (int k = 0; k < kTile; ++k) v[k] = _mm512_setzero_ps();
    for (; i + 16 <= in_f; i += 16) {
      const __m512 av = _mm512_loadu_ps(a + i);
      for (int k = 0; k < n; ++k)
        v[k] = _mm512_fmadd_ps(av, _mm512_loadu_ps(xf + k * in_f + i), v[k]);
    }
    for (int k = 0; k < n; ++k) sum[k] = _mm512_reduce_add_ps(v[k]);
#endif
    for (int k = 0; k < n; ++k) {
      float t = sum[k];
      for (int64_t ii = i; ii < in_f; ++ii) t += a[ii] * xf[k * in_f + ii];
      xa[k * pr + j] = t;
    }
  }
  for (int p = 0; p < parts; ++p) {
    const int64_t lo = offsets[p], hi = offsets[p + 1];
    const float* xp = xa + static_cast<int64_t>(p) * rank;
    int64_t c = lo;
#if defined(__AVX512F__)
    for (; c + 16 <= hi; c += 16) {
      __m512 v[kTile];
      for (int k = 0; k < kTile; ++k) v[k] = _mm512_setzero_ps();
      for (int r = 0; r < rank; ++r) {
        const __m512 bv = _mm512_loadu_ps(Bs + static_cast<int64_t>(r) * out_f + c);
        for (int k = 0; k < n; ++k) v[k] = _mm512_fmadd_ps(_mm512_set1_ps(xp[k * pr + r]), bv, v[k]);
      }
      for (int k = 0; k < n; ++k) {
        T* yr = y + rows[k] * y_stride;
        kvs::store16(yr + c, _mm512_add_ps(kvs::load16(yr + c), v[k]));
      }
    }
#endif
    for (; c < hi; ++c) {
      for (int k = 0; k < n; ++k) {
        float d = 0.f;
        for (int r = 0; r < rank; ++r) d += xp[k * pr + r] * Bs[static_cast<int64_t>(r) * out_f + c];
        T* yr = y + rows[k] * y_stride;
        kvs::from_f32(kvs::to_f32(yr[c]) + d, yr + c);
      }
    }
  }
}

template <typename T>
void lora_delta(const T* x, int64_t x_stride, T* y, int64_t y_stride, int64_t rows, int64_t in_f,
                int64_t out_f, const float* A, const float* Bt, const int32_t* row_slot,
                const int64_t* offsets, int parts, int rank, int nthreads) {
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
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> xf(kTile * in_f), xa(kTile * pr);
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < num_tiles; ++ti) {
      const int64_t* tr = order.data() + tiles[ti].first;
      const int64_t s = row_slot[tr[0]];
      lora_tile<T>(x, x_stride, y, y_stride, tr, tiles[ti].second, in_f, out_f, A + s * pr * in_f,
                   Bt + s * rank * out_f, offsets, parts, rank, xf.data(), xa.data());
    }
  }
}

}  // namespace

extern "C" {

// Returns 0, or 1 for an unknown dtype.
int kvs_lora_delta(const void* x, int64_t x_stride, void* y, int64_t y_stride, int64_t rows,
                   int64_t in_f, int64_t out_f, const float* A, const float* Bt,
                   const int32_t* row_slot, const int64_t* offsets, int parts, int rank, int dtype,
                   int nthreads) {
  if (dtype == 0) {
    lora_delta<float>(static_cast<const float*>(x), x_stride, static_cast<float*>(y), y_stride,
                      rows, in_f, out_f, A, Bt, row_slot, offsets, parts, rank, nthreads);
  } else if (dtype == 1) {
    lora_delta<bf16_t>(static_cast<const bf16_t*>(x), x_stride, static_cast<bf16_t*>(y), y_stride,
                       rows, in_f, out_f, A, Bt, row_slot, offsets, parts, rank, nthreads);
  } else {
    return 1;
  }
  return 0;
}

}  // extern "C"
