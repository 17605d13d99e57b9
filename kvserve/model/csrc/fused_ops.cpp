// Fused per-token elementwise ops of the decoder layer (same library as the attention
// kernel, same plain C ABI, see paged_attention.cpp for the dtype codes).
//
// At decode batch sizes each of these replaces several small PyTorch ops whose
// dispatch cost dominates their work. All math is in fp32; the residual stream is
// fp32 whatever the model dtype.
#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using bf16_t = uint16_t;

inline float ld(const float* p, int64_t i) { return p[i]; }
inline float ld(const bf16_t* p, int64_t i) {
  uint32_t u = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void st(float* p, int64_t i, float x) { p[i] = x; }
inline void st(bf16_t* p, int64_t i, float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    p[i] = static_cast<bf16_t>((u >> 16) | 0x40u);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  p[i] = static_cast<bf16_t>(u >> 16);
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

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(bf16_t* p, __m512 x) {  // round to nearest even, as PyTorch does
  __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}
// exp(x), x clamped to [-87, 88]: 2^n * e^r with a degree-7 polynomial (rel. error < 2e-7)
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

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
