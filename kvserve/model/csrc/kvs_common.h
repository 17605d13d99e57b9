// Shared by kvserve's native kernels: bf16 storage type and conversions, and the
// AVX-512 helpers (16-lane loads/stores in either dtype, a vector exp, the bf16 dot choice).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVS_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvs {

using bf16_t = uint16_t;

inline float to_f32(float x) { return x; }
inline float to_f32(bf16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void from_f32(float x, float* dst) { *dst = x; }
inline void from_f32(float x, bf16_t* dst) {  // round to nearest even, as PyTorch does
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *dst = static_cast<bf16_t>((u >> 16) | 0x40u);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *dst = static_cast<bf16_t>(u >> 16);
}

// IEEE fp16 bits -> float, exactly (subnormals normalized; inf and NaN kept): the
// quantized formats' block scales.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      u = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(bf16_t* p, __m512 x) {  // round to nearest even
  __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}
// exp(x) = 2^n * p for x in [-87, 88] (the caller clamps): n = round(x / ln2), p the
// degree-7 Taylor polynomial of e^r, r = x - n ln2, |r| <= ln2/2 (relative error < 2e-7)
inline void exp512_parts(__m512 x, __m512& p, __m512& n) {
  n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
}
// exp(x), x clamped to [-87, 88] (exp512_parts)
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  __m512 p, n;
  exp512_parts(x, p, n);
  return _mm512_scalef_ps(p, n);
}
// 2^x for x <= 0, clamped at -126 (-inf gives 2^-126, not 0: callers mask): 2^n * p(f),
// |f| <= 1/2, p the degree-4 Taylor polynomial of e^(f ln2), relative error < 5e-5.
// For values that end up in bfloat16 (rounding error 4e-3), where exp512's precision
// buys nothing.
inline __m512 exp2_nonpos_bf16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(0.0096181291f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0555041087f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265070f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471806f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
// 2^x for any x, clamped to [-126, 126]; same precision.
inline __m512 exp2_bf16(__m512 x) {
  return exp2_nonpos_bf16(_mm512_min_ps(x, _mm512_set1_ps(126.0f)));
}

// Whether the bfloat16 attention kernels (paged decode, invariant prefill) take Q.K and
// P.V with vdpbf16ps instead of widened fp32 FMAs: on AMD CPUs with AVX512_BF16 (where
// it was measured fast), unless KVSERVE_BF16_DOT=fma; KVSERVE_BF16_DOT=dp forces it
// elsewhere. Decided once per process, the same for every kernel that asks (their
// rows must agree bit for bit).
inline bool use_bf16_dot() {
  static const bool v = [] {
    const char* e = std::getenv("KVSERVE_BF16_DOT");
    if (e != nullptr && std::strcmp(e, "fma") == 0) return false;
    if (e != nullptr && std::strcmp(e, "dp") == 0) return true;
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_is("amd");
  }();
  return v;
}
#endif

#if defined(KVS_HAVE_AMX)
// AMX tile configuration (palette 1), as ldtilecfg reads it.
struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux asks each process to request the AMX tile state once; true when granted.
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// This thread's 8 tiles as 16 rows x 64 bytes. Rule: amx_permitted() holds, and the
// caller ends with _tile_release() so no tile state outlives its call.
inline void configure_tiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}
#endif

}  // namespace kvs
