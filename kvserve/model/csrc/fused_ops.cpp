// Fused per-token elementwise ops of the decoder layer (same library as the attention
// kernel, same plain C ABI, see paged_attention.cpp for the dtype codes).
//
// At decode batch sizes each of these replaces several small PyTorch ops whose
// dispatch cost dominates their work. All math is in fp32; the residual stream is
// fp32 whatever the model dtype.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <omp.h>

#include "kvs_common.h"

namespace {

using kvs::bf16_t;
#if defined(__AVX512F__)
using kvs::exp512;
using kvs::load16;
using kvs::store16;
#endif

template <typename T>
inline float ld(const T* p, int64_t i) {
  return kvs::to_f32(p[i]);
}
template <typename T>
inline void st(T* p, int64_t i, float x) {
  kvs::from_f32(x, p + i);
}

// residual[t] += x[t] (x may be null); out[t] = residual[t] * rsqrt(mean(residual[t]^2) + eps) * w
template <typename T>
void add_rms_norm(float* residual, const T* x, int64_t x_stride, const T* w, T* out, int64_t rows,
                  int64_t hidden, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * hidden > 32768)
  for (int64_t t = 0; t < rows; ++t) {
    float* r = residual + t * hidden;
    float ss = 0.f;
    if (x != nullptr) {
      const T* xr = x + t * x_stride;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < hidden; ++i) {
        const float v = r[i] + ld(xr, i);
        r[i] = v;
        ss += v * v;
      }
    } else {
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < hidden; ++i) ss += r[i] * r[i];
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
    T* o = out + t * hidden;
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) st(o, i, r[i] * inv * ld(w, i));
  }
}

// out[t, i] = silu(gu[t, i]) * gu[t, inter + i]
template <typename T>
void silu_mul(const T* gu, T* out, int64_t rows, int64_t inter, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * inter > 65536)
  for (int64_t t = 0; t < rows; ++t) {
    const T* g = gu + t * 2 * inter;
    T* o = out + t * inter;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.f);
    if constexpr (std::is_same_v<T, bf16_t>) {
      // bfloat16 output: a 2^-14 reciprocal and a degree-4 exp are exact enough
      const __m512 neg_log2e = _mm512_set1_ps(-1.4426950408889634f);
      for (; i + 16 <= inter; i += 16) {
        const __m512 a = load16(g + i);
        const __m512 sig = _mm512_rcp14_ps(_mm512_add_ps(one, kvs::exp2_bf16(_mm512_mul_ps(a, neg_log2e))));
        store16(o + i, _mm512_mul_ps(_mm512_mul_ps(a, sig), load16(g + inter + i)));
      }
    }
    for (; i + 16 <= inter; i += 16) {
      const __m512 a = load16(g + i);
      const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), a))));
      store16(o + i, _mm512_mul_ps(_mm512_mul_ps(a, sig), load16(g + inter + i)));
    }
#endif
    for (; i < inter; ++i) {
      const float a = ld(g, i);
      st(o, i, a / (1.f + std::exp(-a)) * ld(g, inter + i));
    }
  }
}

// RoPE (rotate-half form) on the q and k heads of each row of qkv, in place, then K
// and V of rows with slot >= 0 are copied into the cache [2, Hk, slots, D].
// cos/sin: [max_pos, D/2] fp32 (attention scaling included).
template <typename T>
void rope_and_cache(T* qkv, int64_t row_stride, int64_t rows, int num_heads, int num_kv_heads,
                    int head_dim, const int64_t* positions, const float* cos, const float* sin,
                    T* kv, int64_t num_slots, const int64_t* slots, int nthreads) {
  const int half = head_dim / 2;
  const int nh = num_heads + num_kv_heads;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 64)
  for (int64_t t = 0; t < rows; ++t) {
    T* row = qkv + t * row_stride;
    const float* c = cos + positions[t] * half;
    const float* s = sin + positions[t] * half;
    for (int h = 0; h < nh; ++h) {
      T* x = row + static_cast<int64_t>(h) * head_dim;
#pragma omp simd
      for (int i = 0; i < half; ++i) {
        const float a = ld(x, i), b = ld(x, i + half);
        st(x, i, a * c[i] - b * s[i]);
        st(x, i + half, b * c[i] + a * s[i]);
      }
    }
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    for (int h = 0; h < num_kv_heads; ++h) {
      const T* k = row + static_cast<int64_t>(num_heads + h) * head_dim;
      const T* v = row + static_cast<int64_t>(nh + h) * head_dim;
      T* kd = kv + (static_cast<int64_t>(h) * num_slots + slot) * head_dim;
      T* vd = kv + (static_cast<int64_t>(num_kv_heads + h) * num_slots + slot) * head_dim;
      std::memcpy(kd, k, head_dim * sizeof(T));
      std::memcpy(vd, v, head_dim * sizeof(T));
    }
  }
}

}  // namespace

extern "C" {

int kvs_add_rms_norm(float* residual, const void* x, int64_t x_stride, const void* w, void* out,
                     int64_t rows, int64_t hidden, float eps, int dtype, int nthreads) {
  if (dtype == 0) {
    add_rms_norm<float>(residual, static_cast<const float*>(x), x_stride,
                        static_cast<const float*>(w), static_cast<float*>(out), rows, hidden, eps,
                        nthreads);
  } else if (dtype == 1) {
    add_rms_norm<bf16_t>(residual, static_cast<const bf16_t*>(x), x_stride,
                         static_cast<const bf16_t*>(w), static_cast<bf16_t*>(out), rows, hidden,
                         eps, nthreads);
  } else {
    return 1;
  }
  return 0;
}

// Per-head RMSNorm in place (Qwen3's q_norm / k_norm), on the first `heads` heads of
// each row of qkv [rows] (row stride row_stride elements, heads of head_dim contiguous):
// x <- round(x * rsqrt(mean(x^2) + eps)) * w[head], the fp32 sum of squares in order,
// the normalised value rounded to the dtype before the weight multiply (as
// transformers' Qwen3RMSNorm: normalise in fp32, cast, then weight * x). w [heads,
// head_dim] in the dtype. Returns 0, or 1 for an unknown dtype.
int kvs_head_rms_norm(void* qkv, int64_t row_stride, int64_t rows, int heads, int head_dim,
                      const void* w, float eps, int dtype, int nthreads) {
  if (dtype != 0 && dtype != 1) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * heads * head_dim > 32768)
  for (int64_t t = 0; t < rows; ++t) {
    for (int h = 0; h < heads; ++h) {
      const int64_t off = t * row_stride + static_cast<int64_t>(h) * head_dim;
      const int64_t woff = static_cast<int64_t>(h) * head_dim;
      if (dtype == 0) {
        float* x = static_cast<float*>(qkv) + off;
        const float* wr = static_cast<const float*>(w) + woff;
        float ss = 0.f;
        for (int i = 0; i < head_dim; ++i) ss += x[i] * x[i];
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(head_dim) + eps);
        for (int i = 0; i < head_dim; ++i) x[i] = (x[i] * inv) * wr[i];
      } else {
        bf16_t* x = static_cast<bf16_t*>(qkv) + off;
        const bf16_t* wr = static_cast<const bf16_t*>(w) + woff;
        float ss = 0.f;
        for (int i = 0; i < head_dim; ++i) ss += ld(x, i) * ld(x, i);
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(head_dim) + eps);
        for (int i = 0; i < head_dim; ++i) {
          bf16_t n;
          kvs::from_f32(ld(x, i) * inv, &n);
          st(x, i, kvs::to_f32(n) * ld(wr, i));
        }
      }
    }
  }
  return 0;
}

int kvs_silu_mul(const void* gu, void* out, int64_t rows, int64_t inter, int dtype, int nthreads) {
  if (dtype == 0) {
    silu_mul<float>(static_cast<const float*>(gu), static_cast<float*>(out), rows, inter, nthreads);
  } else if (dtype == 1) {
    silu_mul<bf16_t>(static_cast<const bf16_t*>(gu), static_cast<bf16_t*>(out), rows, inter,
                     nthreads);
  } else {
    return 1;
  }
  return 0;
}

int kvs_rope_and_cache(void* qkv, int64_t row_stride, int64_t rows, int num_heads,
                       int num_kv_heads, int head_dim, const int64_t* positions, const float* cos,
                       const float* sin, void* kv, int64_t num_slots, const int64_t* slots,
                       int dtype, int nthreads) {
  if (dtype == 0) {
    rope_and_cache<float>(static_cast<float*>(qkv), row_stride, rows, num_heads, num_kv_heads,
                          head_dim, positions, cos, sin, static_cast<float*>(kv), num_slots, slots,
                          nthreads);
  } else if (dtype == 1) {
    rope_and_cache<bf16_t>(static_cast<bf16_t*>(qkv), row_stride, rows, num_heads, num_kv_heads,
                           head_dim, positions, cos, sin, static_cast<bf16_t*>(kv), num_slots,
                           slots, nthreads);
  } else {
    return 1;
  }
  return 0;
}
}
