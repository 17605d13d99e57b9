// Batched LoRA delta over a mixed batch (bindings: kvserve.lora.ops).
//
// For each row t whose slot s = row_slot[t] >= 0, after the base linear y = W x:
//   xa[j] = A[s][j] . x[t]                       j in [0, P*R)   (A: [S, P*R, in])
//   y[t, off[p]:off[p+1]] += sum_r xa[p*R + r] * Bt[s][r][off[p]:off[p+1]]
// (Bt: [S, R, out], the scale folded in). Rows of slot -1 are not touched. Each row is
// computed on its own, in a fixed order, so a row's result does not depend on the
// other rows of the batch. x and y are float32 or bfloat16 (dtype 0 / 1); the sums
// run in float32 and y is rounded once. An AVX-512 path and a portable one.

#include <omp.h>

#include <vector>

#include "kvs_common.h"

namespace {

using kvs::bf16_t;

template <typename T>
void lora_delta(const T* x, int64_t x_stride, T* y, int64_t y_stride, int64_t rows, int64_t in_f,
                int64_t out_f, const float* A, const float* Bt, const int32_t* row_slot,
                const int64_t* offsets, int parts, int rank, int nthreads) {
  const int64_t pr = static_cast<int64_t>(parts) * rank;
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> xf(in_f), xa(pr), acc(out_f);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
      const int32_t s = row_slot[t];
      if (s < 0) continue;
      const T* xr = x + t * x_stride;
      for (int64_t i = 0; i < in_f; ++i) xf[i] = kvs::to_f32(xr[i]);
      const float* As = A + static_cast<int64_t>(s) * pr * in_f;
      for (int64_t j = 0; j < pr; ++j) {
        const float* a = As + j * in_f;
        int64_t i = 0;
        float sum = 0.f;
#if defined(__AVX512F__)
        __m512 v = _mm512_setzero_ps();
        for (; i + 16 <= in_f; i += 16)
          v = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(xf.data() + i), v);
        sum = _mm512_reduce_add_ps(v);
#endif
        for (; i < in_f; ++i) sum += a[i] * xf[i];
        xa[j] = sum;
      }
      const float* Bs = Bt + static_cast<int64_t>(s) * rank * out_f;
      T* yr = y + t * y_stride;
      for (int p = 0; p < parts; ++p) {
        const int64_t lo = offsets[p], hi = offsets[p + 1];
        int64_t c = lo;
#if defined(__AVX512F__)
        for (; c + 16 <= hi; c += 16) {
          __m512 v = _mm512_setzero_ps();
          for (int r = 0; r < rank; ++r)
            v = _mm512_fmadd_ps(_mm512_set1_ps(xa[p * rank + r]),
                                _mm512_loadu_ps(Bs + static_cast<int64_t>(r) * out_f + c), v);
          kvs::store16(yr + c, _mm512_add_ps(kvs::load16(yr + c), v));
        }
#endif
        for (; c < hi; ++c) {
          float d = 0.f;
          for (int r = 0; r < rank; ++r) d += xa[p * rank + r] * Bs[static_cast<int64_t>(r) * out_f + c];
          kvs::from_f32(kvs::to_f32(yr[c]) + d, yr + c);
        }
      }
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
