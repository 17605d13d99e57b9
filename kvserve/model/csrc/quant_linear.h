// What the quantized linears (linear_quant.cpp, linear_kquant.cpp) share: their code
// paths, and the activation quantizer, each row of x per block of 32 k to int8 as
// llama.cpp's q8 blocks:
//   d_x = amax / 127,  q = round-to-nearest-even(x / d_x)  (d_x = 0: q = 0),
// plus the block's sum of q (whole, or per 16-k half) and sx = d_x * float(sum q), the
// factor of a block's minimum term, computed once here so every path multiplies the same
// value. The sums are exact int32, so the scalar and AVX-512 quantizers are bitwise equal.
//
// Rules for callers: K is a multiple of kBlock; the returned Act points into `buf`,
// valid until the next call with the same `buf` (each kernel keeps one per calling
// thread, reused across calls: no allocation on the decode path).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include <omp.h>

#include "kvs_common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvs {
namespace q8 {

constexpr int64_t kBlock = 32;  // k per block

// The paths a call may ask for: 1 scalar, 2 AVX2, 3 AVX512-VNNI (0: the best compiled in).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kHaveVnni = true;
#else
constexpr bool kHaveVnni = false;
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kHaveAvx2 = true;
#else
constexpr bool kHaveAvx2 = false;
#endif

// Bit 0: scalar; bit 1: AVX2; bit 2: AVX512-VNNI (those compiled in).
constexpr int paths() { return 1 | (kHaveAvx2 ? 2 : 0) | (kHaveVnni ? 4 : 0); }

// The path a call runs: 0 -> the best compiled in; -1 for one not compiled in or not 0..3.
constexpr int resolve_path(int path) {
  if (path == 0) path = kHaveVnni ? 3 : (kHaveAvx2 ? 2 : 1);
  if ((path == 3 && !kHaveVnni) || (path == 2 && !kHaveAvx2) || path < 1 || path > 3) return -1;
  return path;
}

// A call's quantized activations; row r: q[r * K ...], d and sx [r * nb ...], s
// [r * nb ...] (one sum per block) or [2 * r * nb ...] (halves: k 0..15, 16..31).
struct Act {
  int8_t* q = nullptr;
  float* d = nullptr;
  int32_t* s = nullptr;
  float* sx = nullptr;
  int64_t nb = 0;
};

struct Buffers {
  std::vector<int8_t> q;
  std::vector<float> d, sx;
  std::vector<int32_t> s;
};

// kHalves: s holds the two 16-k halves' sums of each block, else the block's sum.
template <bool kHalves, typename T>
void quantize_row_scalar(const T* x, int64_t nb, int8_t* q, float* d, int32_t* s, float* sx) {
  for (int64_t b = 0; b < nb; ++b) {
    float v[kBlock];
    float amax = 0.0f;
    for (int j = 0; j < kBlock; ++j) {
      v[j] = to_f32(x[b * kBlock + j]);
      amax = std::fmax(amax, std::fabs(v[j]));
    }
    const float db = amax / 127.0f;
    const float id = db > 0.0f ? 1.0f / db : 0.0f;
    int32_t h[2] = {0, 0};
    for (int j = 0; j < kBlock; ++j) {
      // nearbyint: round to nearest even under the default rounding mode, as cvtps2dq
      const auto qi = static_cast<int32_t>(std::nearbyint(v[j] * id));
      q[b * kBlock + j] = static_cast<int8_t>(qi);
      h[j / 16] += qi;
    }
    d[b] = db;
    if (kHalves) {
      s[2 * b] = h[0];
      s[2 * b + 1] = h[1];
    } else {
      s[b] = h[0] + h[1];
    }
    sx[b] = db * static_cast<float>(h[0] + h[1]);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The same arithmetic 16 lanes at a time (max is exact in any order; cvtps2dq rounds
// to nearest even like nearbyint): bitwise equal to quantize_row_scalar.
template <bool kHalves, typename T>
void quantize_row_avx512(const T* x, int64_t nb, int8_t* q, float* d, int32_t* s, float* sx) {
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 v0 = load16(x + b * kBlock);
    const __m512 v1 = load16(x + b * kBlock + 16);
    const __m512 a = _mm512_max_ps(_mm512_and_ps(v0, absmask), _mm512_and_ps(v1, absmask));
    const float amax = _mm512_reduce_max_ps(a);
    const float db = amax / 127.0f;
    const float id = db > 0.0f ? 1.0f / db : 0.0f;
    const __m512 vid = _mm512_set1_ps(id);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtepi32_epi8(q1));
    int32_t sum;
    if (kHalves) {
      s[2 * b] = _mm512_reduce_add_epi32(q0);
      s[2 * b + 1] = _mm512_reduce_add_epi32(q1);
      sum = s[2 * b] + s[2 * b + 1];
    } else {
      sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      s[b] = sum;
    }
    d[b] = db;
    sx[b] = db * static_cast<float>(sum);
  }
}
#endif

// vector: the AVX-512 quantizer where compiled in (false pins the scalar one).
template <bool kHalves, typename T>
void quantize_row(const T* x, int64_t nb, int8_t* q, float* d, int32_t* s, float* sx,
                  bool vector) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (vector) {
    quantize_row_avx512<kHalves>(x, nb, q, d, s, sx);
    return;
  }
#endif
  (void)vector;
  quantize_row_scalar<kHalves>(x, nb, q, d, s, sx);
}

// x: rows of K values (row stride xs elements), dtype 0 float32, else bfloat16.
template <bool kHalves>
Act quantize_activations(Buffers& buf, const void* x, int64_t xs, int64_t rows, int64_t K,
                         int dtype, int threads, bool vector) {
  constexpr int64_t kSums = kHalves ? 2 : 1;
  Act a;
  a.nb = K / kBlock;
  const auto nq = static_cast<size_t>(rows * K), nd = static_cast<size_t>(rows * a.nb);
  if (buf.q.size() < nq) buf.q.resize(nq);
  if (buf.d.size() < nd) {
    buf.d.resize(nd);
    buf.sx.resize(nd);
  }
  if (buf.s.size() < kSums * nd) buf.s.resize(kSums * nd);
  a.q = buf.q.data();
  a.d = buf.d.data();
  a.s = buf.s.data();
  a.sx = buf.sx.data();
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 16)
  for (int64_t r = 0; r < rows; ++r) {
    int8_t* q = a.q + r * K;
    float* d = a.d + r * a.nb;
    int32_t* s = a.s + kSums * r * a.nb;
    float* sx = a.sx + r * a.nb;
    if (dtype == 0) {
      quantize_row<kHalves>(static_cast<const float*>(x) + r * xs, a.nb, q, d, s, sx, vector);
    } else {
      quantize_row<kHalves>(static_cast<const bf16_t*>(x) + r * xs, a.nb, q, d, s, sx, vector);
    }
  }
  return a;
}

}  // namespace q8
}  // namespace kvs
