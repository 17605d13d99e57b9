// Row-wise sampling helpers over fp32 [rows, vocab] tensors (same library and C ABI as
// paged_attention.cpp). Each row is independent; rows are spread over threads.
#include <algorithm>
#include <cstdint>
#include <vector>

#include <omp.h>

extern "C" {

// out[r] = index of the first maximum of row r (NaN rows: index of the first NaN,
// as torch.argmax).
void kvs_argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t* out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * cols > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    int64_t best = 0;
    float bv = row[0];
    if (bv != bv) {
      out[r] = 0;
      continue;
    }
    for (int64_t i = 1; i < cols; ++i) {
      const float v = row[i];
      if (v != v) {  // NaN wins, as in torch.argmax
        best = i;
        break;
      }
      if (v > bv) {
        bv = v;
        best = i;
      }
    }
    out[r] = best;
  }
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
      cand.assign(row, row + cols);
      double above = 0.0;  // mass of the tokens ranked above every candidate
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
    double total = 0.0;
    for (int64_t i = 0; i < cols; ++i)
      if (row[i] >= thr && row[i] > 0.f) total += row[i];
    const double target = u[r] * total;
    double run = 0.0;
    int64_t pick = -1, last = 0;
    for (int64_t i = 0; i < cols; ++i) {
      const float v = row[i];
      if (!(v >= thr && v > 0.f)) continue;
      last = i;
      run += v;
      if (run > target) {
        pick = i;
        break;
      }
    }
    out[r] = pick >= 0 ? pick : last;
  }
}
}
