// Row-wise sampling helpers over fp32 [rows, vocab] tensors (same library and C ABI as
// paged_attention.cpp). Each row is independent; rows are spread over threads.
#include <algorithm>
#include <cstring>
#include <cstdint>
#include <vector>

#include <omp.h>

#include <cmath>

#include "kvs_common.h"

extern "C" {

// out[r] = index of the first maximum of row r (NaN rows: index of the first NaN,
// as torch.argmax). Two passes over the row, both vectorized: the maximum (and
// whether a NaN occurs), then the first index holding it. -0.0 == 0.0, so ties
// between zeros also go to the first, as a single scalar pass would.
static int64_t kvs_argmax_row(const float* row, int64_t cols) {
  int64_t i = 0;
  float mx = row[0];
  bool nan = mx != mx;
#if defined(__AVX512F__)
  if (cols >= 16) {
    __m512 vmx = _mm512_loadu_ps(row);
    __mmask16 unord = _mm512_cmp_ps_mask(vmx, vmx, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= cols; i += 16) {
      const __m512 v = _mm512_loadu_ps(row + i);
      unord |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vmx = _mm512_max_ps(vmx, v);
    }
    nan = nan || unord != 0;
    mx = _mm512_reduce_max_ps(vmx);
  }
#endif
  for (; i < cols; ++i) {
    const float v = row[i];
    nan = nan || v != v;
    mx = v > mx ? v : mx;
  }
  if (nan) {
    for (int64_t j = 0; j < cols; ++j)
      if (row[j] != row[j]) return j;
  }
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(mx);
  for (; j + 16 <= cols; j += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), vm, _CMP_EQ_OQ);
    if (eq) return j + __builtin_ctz(static_cast<unsigned>(eq));
  }
#endif
  for (; j < cols; ++j)
    if (row[j] == mx) return j;
  return 0;  // unreachable: mx is an element of the row
}

// Smallest / largest element of a row (NaNs skipped unless the row starts with one,
// as a scalar `v < m ? v : m` pass would), vectorized.
static float row_min(const float* row, int64_t cols) {
  float m = row[0];
  int64_t i = 0;
#if defined(__AVX512F__)
  if (cols >= 16) {
    __m512 acc = _mm512_set1_ps(m);
    for (; i + 16 <= cols; i += 16) acc = _mm512_min_ps(_mm512_loadu_ps(row + i), acc);
    m = _mm512_reduce_min_ps(acc);
  }
#endif
  for (; i < cols; ++i) m = row[i] < m ? row[i] : m;
  return m;
}

static float row_max(const float* row, int64_t cols) {
  float m = row[0];
  int64_t i = 0;
#if defined(__AVX512F__)
  if (cols >= 16) {
    __m512 acc = _mm512_set1_ps(m);
    for (; i + 16 <= cols; i += 16) acc = _mm512_max_ps(_mm512_loadu_ps(row + i), acc);
    m = _mm512_reduce_max_ps(acc);
  }
#endif
  for (; i < cols; ++i) m = row[i] > m ? row[i] : m;
  return m;
}

void kvs_argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t* out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * cols > 65536)
  for (int64_t r = 0; r < rows; ++r) out[r] = kvs_argmax_row(x + r * cols, cols);
}

// Nucleus threshold per row: with the row's probabilities sorted descending
// (p1 >= p2 >= ...), token i is kept while the mass ranked above it is < top_p[r];
// out[r] = the smallest kept probability (ties with it are kept by the caller's
// `probs >= threshold`). Rows with top_p >= 1 get 0. Expected O(vocab) per row
// (quickselect on mass, sums in double).
void kvs_top_p_threshold(const float* probs, int64_t rows, int64_t cols, const float* top_p,
                         float* out, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (rows * cols > 65536)
  {
    std::vector<float> cand, next;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; ++r) {
      const double p = top_p[r];
      if (p >= 1.0) {
        out[r] = 0.f;
        continue;
      }
      const float* row = probs + r * cols;
      // Bucket by float exponent (ordered like the values, a factor 2 per bucket):
      // every bucket above the one where the running mass reaches p is kept whole,
      // so only that bucket's tokens need selecting.
      // eight interleaved histograms, unrolled: neighbours often share a bucket, and
      // one array chains every add on the previous one's store (8x faster per row)
      double hists[8][264] = {{0.0}};  // rows 2,112 bytes apart: no 4 KiB aliasing
      const float smallest = row_min(row, cols);
      const auto bucket_of = [row](int64_t i) {
        uint32_t bits;
        std::memcpy(&bits, row + i, 4);
        return (bits >> 23) & 0xffu;
      };
      int64_t i = 0;
#if defined(__AVX512F__)
      // widen 8 values at once: a scalar float->double conversion merges into its
      // destination register and chained every add on the previous one (~10 cycles
      // per value)
      for (; i + 8 <= cols; i += 8) {
        alignas(64) double dv[8];
        _mm512_store_pd(dv, _mm512_cvtps_pd(_mm256_loadu_ps(row + i)));
        for (int j = 0; j < 8; ++j) hists[j][bucket_of(i + j)] += dv[j];
      }
#endif
      for (; i < cols; ++i) hists[0][bucket_of(i)] += row[i];
      double hist[256];
      for (int b = 0; b < 256; ++b) {
        double sum = 0.0;
        for (int j = 0; j < 8; ++j) sum += hists[j][b];
        hist[b] = sum;
      }
      double above = 0.0;  // mass of the tokens ranked above every candidate
      int bucket = 255;
      for (; bucket >= 0; --bucket) {
        if (above + hist[bucket] >= p) break;
        above += hist[bucket];
      }
      if (bucket < 0) {  // rounding left the total below p: the whole row is kept
        out[r] = smallest;
        continue;
      }
      cand.resize(static_cast<size_t>(cols));
      size_t ncand = 0;
      int64_t c = 0;
#if defined(__AVX512F__)
      // the bucket's values, kept in order by compress-stores
      const __m512i vb = _mm512_set1_epi32(bucket), ff = _mm512_set1_epi32(0xff);
      for (; c + 16 <= cols; c += 16) {
        const __m512i bits = _mm512_loadu_si512(row + c);
        const __mmask16 m =
            _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_srli_epi32(bits, 23), ff), vb);
        _mm512_mask_compressstoreu_ps(cand.data() + ncand, m, _mm512_castsi512_ps(bits));
        ncand += static_cast<size_t>(__builtin_popcount(m));
      }
#endif
      for (; c < cols; ++c)
        if (static_cast<int>(bucket_of(c)) == bucket) cand[ncand++] = row[c];
      cand.resize(ncand);
      float threshold = 0.f;
      uint64_t seed = 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(r);
      while (!cand.empty()) {
        // pivot: median of three pseudo-random candidates
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        const size_t n = cand.size();
        const float a = cand[(seed >> 33) % n], b = cand[(seed >> 13) % n], c = cand[(seed >> 43) % n];
        const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));
        double mass_gt = 0.0, mass_eq = 0.0;
        next.clear();
        for (float v : cand) {
          if (v > pivot) {
            next.push_back(v);
            mass_gt += v;
          } else if (v == pivot) {
            mass_eq += v;
          }
        }
        if (above + mass_gt >= p && !next.empty()) {
          // The prefix reaches p among the tokens above the pivot: the last kept token
          // is one of them, and only their own masses decide which.
          cand.swap(next);
          continue;
        }
        // Every token above the pivot is kept, and so is the first pivot tie (the mass
        // above it, above + mass_gt, is < p). The pivot is the smallest kept value if
        // the mass through the ties reaches p, else all ties are kept and the search
        // goes on below the pivot. `above` stays < p throughout.
        above += mass_gt;
        threshold = pivot;
        if (above + mass_eq >= p) break;
        above += mass_eq;
        next.clear();
        for (float v : cand)
          if (v < pivot) next.push_back(v);
        cand.swap(next);  // empty: the whole row is kept, the pivot was its minimum
      }
      out[r] = threshold;
    }
  }
}
}

extern "C" {

// Inverse-CDF draw per row over the tokens with prob >= threshold[r] (the others count
// as 0): the first such token whose running mass exceeds u[r] * (kept mass); if
// rounding leaves none, the last kept token. A zero-probability token is never drawn.
void kvs_sample_rows(const float* probs, int64_t rows, int64_t cols, const float* threshold,
                     const double* u, int64_t* out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * cols > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = probs + r * cols;
    const float thr = threshold[r];
    const auto kept = [thr](float v) { return v >= thr && v > 0.f; };
    int64_t i = 0;
    double total = 0.0;
#if defined(__AVX512F__)
    // kept mass in 16 double lanes (the order of a sum of fp32 values in double
    // changes nothing a draw can see), then blocks of 16: skip a block whose kept mass
    // stays within the target, walk the one that crosses it
    const __m512 vthr = _mm512_set1_ps(thr), zero = _mm512_setzero_ps();
    const auto block_mask = [&](const __m512 v) {
      return static_cast<__mmask16>(_mm512_cmp_ps_mask(v, vthr, _CMP_GE_OQ) &
                                    _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ));
    };
    const auto block_sum = [](const __m512 v, __mmask16 m) {
      const __m512 z = _mm512_maskz_mov_ps(m, v);
      return _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(z)),
                           _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1))));
    };
    __m512d acc = _mm512_setzero_pd();
    for (; i + 16 <= cols; i += 16) {
      const __m512 v = _mm512_loadu_ps(row + i);
      acc = _mm512_add_pd(acc, block_sum(v, block_mask(v)));
    }
    total = _mm512_reduce_add_pd(acc);
#endif
    for (; i < cols; ++i)
      if (kept(row[i])) total += row[i];
    const double target = u[r] * total;
    double run = 0.0;
    int64_t pick = -1, last = 0, j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= cols; j += 16) {
      const __m512 v = _mm512_loadu_ps(row + j);
      const __mmask16 m = block_mask(v);
      if (!m) continue;
      const double bsum = _mm512_reduce_add_pd(block_sum(v, m));
      if (run + bsum > target) break;  // the draw is in this block: walk it below
      run += bsum;
      last = j + 31 - __builtin_clz(static_cast<unsigned>(m));
    }
#endif
    for (; j < cols; ++j) {
      const float v = row[j];
      if (!kept(v)) continue;
      last = j;
      run += v;
      if (run > target) {
        pick = j;
        break;
      }
    }
    out[r] = pick >= 0 ? pick : last;
  }
}
}

extern "C" {

// out[r] = softmax(x[r] * inv_temp[r]) (inv_temp > 0), in fp32; rows of -inf-only
// logits give NaN, as torch.softmax does.
void kvs_softmax_rows(const float* x, int64_t rows, int64_t cols, const float* inv_temp,
                      float* out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * cols > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    float* o = out + r * cols;
    const float it = inv_temp[r];
    const float mx = row_max(row, cols);
    double sum = 0.0;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 vmx = _mm512_set1_ps(mx), vit = _mm512_set1_ps(it);
    __m512 vsum = _mm512_setzero_ps();
    for (; i + 16 <= cols; i += 16) {
      const __m512 e = kvs::exp512(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row + i), vmx), vit));
      _mm512_storeu_ps(o + i, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    sum = _mm512_reduce_add_ps(vsum);
#endif
    for (; i < cols; ++i) {
      o[i] = std::exp((row[i] - mx) * it);
      sum += o[i];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t k = 0; k < cols; ++k) o[k] *= inv;
  }
}
}
