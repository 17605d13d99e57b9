// Linear layers over GGUF K-quant weights (Q4_K, Q5_K, Q6_K) in a packed panel layout
// that keeps the file's integers and scales as they are (no requantization): the
// executed weight is exactly what gguf's own dequantization gives.
//
// Layout (kvserve/model/quant/kquant.py packs it): output columns in panels of 16; a
// panel is its K/256 super-blocks ("tiles") in order; a tile is
//   8 blocks of 32 k, each: 256 bytes of low nibbles (64-byte chunk c: 16 columns x 4
//     consecutive k, k 4c..4c+3 in the low nibbles and 16+4c.. in the high ones, as
//     csrc/linear_quant.cpp's 4-bit blocks), then `planes` 64-byte bit planes (plane p,
//     byte col*4+t, bit j = bit 4+p of the value at k 4j+t of column col);
//   the sub-block scales: kq4/kq5 sc[8][16] u8 then mn[8][16] u8 (6-bit values);
//     kq6 sc[16][16] int8 (one per 16 k);
//   D[16] fp16 (the super-block scale d), and for kq4/kq5 M[16] fp16 (dmin).
// The weight:  kq4/kq5: w = (D * sc) * u - M * mn;  kq6: w = (D * sc) * (u - 32),
// u = nibble | planes << 4 (4, 5 or 6 bits). D * sc and M * mn are exact in fp32.
//
// Arithmetic (every path the same, so they are bitwise equal): activations quantized
// per row and 32-value block to int8 (d_x = amax/127, round to nearest even: quant_linear.h,
// shared with csrc/linear_quant.cpp); per block and column an exact int32 dot product of
// u and q (VNNI vpdpbusd; AVX2 vpmaddubsw + vpmaddwd, exact since u <= 63). kq4/kq5:
// acc = fma(float(a), (D * sc) * d_x, acc), then acc = fma(-(M * mn), d_x * float(sum q),
// acc); kq6, per 16-k half h: acc = fma(float(a_h - 32 s_h), (D * sc_h) * d_x, acc), s_h
// the half's sum of q; blocks in order, bias added at the end. The int32 dots are exact,
// so a path may sum their terms in any order (the VNNI kq4/kq5 dot runs two chains); the
// fp32 steps are the same on every path. A row's result does not depend on the other
// rows (per-row quantization, one accumulation order at any M).
//
// Bandwidth: one-row decode reads each weight byte once, so the SIMD paths prefetch the
// whole tile stream, scales and D/M included, kPrefetchBytes ahead into L2
// (prefetch_slice); the OpenMP split gives each thread one contiguous range of (row
// chunk, panel) pairs (at decode: of panels).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "kvs_common.h"
#include "quant_linear.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using kvs::half_to_float;

constexpr int64_t kCols = 16;
using kvs::q8::kBlock;
constexpr int64_t kSuper = 256;
constexpr int64_t kRowTile = 8;
constexpr int64_t kPrefetchBytes = 8192;  // weight stream prefetched into L2 this far ahead
constexpr int64_t kRowChunk = 64;


struct KFormat {
  int planes;    // high bit planes beyond the nibble (0, 1, 2)
  bool has_min;  // kq4/kq5: w = D sc u - M mn; kq6: w = D sc (u - 32)
  constexpr int64_t block_bytes() const { return 256 + 64 * planes; }
  constexpr int64_t scale_off() const { return 8 * block_bytes(); }
  constexpr int64_t d_off() const { return scale_off() + 256; }
  constexpr int64_t tile_bytes() const { return d_off() + (has_min ? 64 : 32); }
};

// fmt codes shared with kvserve/model/quant/kquant.py
inline bool kformat_of(int code, KFormat* f) {
  switch (code) {
    case 16: *f = {0, true}; return true;   // kq4 (GGUF Q4_K)
    case 17: *f = {1, true}; return true;   // kq5 (GGUF Q5_K)
    case 18: *f = {2, false}; return true;  // kq6 (GGUF Q6_K)
    default: return false;
  }
}

// value u of column col at k j (0..31) of a block
inline int weight_u(const uint8_t* blk, int planes, int col, int j) {
  const int half = j / 16, c = (j % 16) / 4, t = j % 4;
  const uint8_t byte = blk[c * 64 + col * 4 + t];
  int u = half ? (byte >> 4) : (byte & 15);
  const int jc = j / 4;  // 8-bit chunk index: k 4jc..4jc+3
  for (int p = 0; p < planes; ++p) {
    u |= ((blk[256 + p * 64 + col * 4 + t] >> jc) & 1) << (4 + p);
  }
  return u;
}

// A call's quantized activations (quant_linear.h): s holds the sums of q of each block's two
// 16-k halves, sx = d_x * float(sum q) of the block.
using Act = kvs::q8::Act;

Act quantize_activations(const void* x, int64_t xs, int64_t rows, int64_t K, int dtype,
                         int threads) {
  thread_local kvs::q8::Buffers buf;
  return kvs::q8::quantize_activations<true>(buf, x, xs, rows, K, dtype, threads, false);
}

// ---------------------------------------------------------------- scalar reference

// acc[r][col] for rows r0..r0+nr of one panel (wp: its first tile)
void panel_scalar(const KFormat& f, const uint8_t* wp, int64_t nsb, const Act& a, int64_t K,
                  int64_t r0, int nr, float acc[][kCols]) {
  for (int r = 0; r < nr; ++r) {
    for (int col = 0; col < kCols; ++col) acc[r][col] = 0.0f;
  }
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* tile = wp + s * f.tile_bytes();
    const uint8_t* sc = tile + f.scale_off();
    const auto* dh = reinterpret_cast<const uint16_t*>(tile + f.d_off());
    for (int b = 0; b < 8; ++b) {
      const uint8_t* blk = tile + b * f.block_bytes();
      const int64_t bi = s * 8 + b;
      for (int col = 0; col < kCols; ++col) {
        int u[kBlock];
        for (int j = 0; j < kBlock; ++j) u[j] = weight_u(blk, f.planes, col, j);
        const float D = half_to_float(dh[col]);
        for (int r = 0; r < nr; ++r) {
          const int64_t row = r0 + r;
          const int8_t* q = a.q + row * K + bi * kBlock;
          const float dx = a.d[row * a.nb + bi];
          if (f.has_min) {
            int32_t dot = 0;
            for (int j = 0; j < kBlock; ++j) dot += u[j] * q[j];
            const float ds = D * static_cast<float>(sc[b * 16 + col]);
            const float mm = half_to_float(dh[16 + col]) * static_cast<float>(sc[128 + b * 16 + col]);
            float v = std::fma(static_cast<float>(dot), ds * dx, acc[r][col]);
            acc[r][col] = std::fma(-mm, a.sx[row * a.nb + bi], v);
          } else {
            int32_t a1 = 0, a2 = 0;
            for (int j = 0; j < 16; ++j) a1 += u[j] * q[j];
            for (int j = 16; j < kBlock; ++j) a2 += u[j] * q[j];
            const int32_t* s16 = a.s + 2 * (row * a.nb + bi);
            const auto sc1 = static_cast<int32_t>(static_cast<int8_t>(sc[(2 * b) * 16 + col]));
            const auto sc2 = static_cast<int32_t>(static_cast<int8_t>(sc[(2 * b + 1) * 16 + col]));
            const float v = std::fma(static_cast<float>(a1 - 32 * s16[0]),
                                     (D * static_cast<float>(sc1)) * dx, acc[r][col]);
            acc[r][col] = std::fma(static_cast<float>(a2 - 32 * s16[1]),
                                   (D * static_cast<float>(sc2)) * dx, v);
          }
        }
      }
    }
  }
}

// Software prefetch of the weight stream: block b of a tile prefetches the b-th eighth
// of the tile kPrefetchBytes ahead (rounded up to whole lines), so every line of every
// tile, its scales included, is requested once the stream is running.
#if defined(__AVX2__) || defined(__AVX512F__)
inline void prefetch_slice(const uint8_t* tile, int64_t tile_bytes, int b) {
  const int64_t slice = (tile_bytes / 8 + 63) / 64 * 64;
  const uint8_t* p = tile + kPrefetchBytes + b * (tile_bytes / 8);
  for (int64_t l = 0; l < slice; l += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + l), _MM_HINT_T1);
  }
}
#endif

// ---------------------------------------------------------------- AVX512-VNNI

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// PLANES, MIN and the row count NR are compile-time so the loops unroll and the
// accumulators stay in registers.
template <int PLANES, bool MIN, int NR>
void panel_vnni_t(const uint8_t* wp, int64_t nsb, const Act& a, int64_t K, int64_t r0,
                  float out[][kCols]) {
  constexpr KFormat f{PLANES, MIN};
  constexpr int nr = NR;
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(15);
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* tile = wp + s * f.tile_bytes();
    const uint8_t* sc = tile + f.scale_off();
    const __m512 D = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + f.d_off())));
    const __m512 M = MIN ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(tile + f.d_off() + 32)))
                               : _mm512_setzero_ps();
    for (int b = 0; b < 8; ++b) {
      const uint8_t* blk = tile + b * f.block_bytes();
      prefetch_slice(tile, f.tile_bytes(), b);
      __m512i u[8];
      for (int c = 0; c < 4; ++c) {
        const __m512i nib = _mm512_loadu_si512(blk + c * 64);
        u[c] = _mm512_and_si512(nib, low);
        u[4 + c] = _mm512_and_si512(_mm512_srli_epi16(nib, 4), low);
      }
      for (int p = 0; p < PLANES; ++p) {
        const __m512i pl = _mm512_loadu_si512(blk + 256 + p * 64);
        const __m512i add = _mm512_set1_epi8(static_cast<char>(16 << p));
        for (int j = 0; j < 8; ++j) {
          const __mmask64 m = _mm512_test_epi8_mask(pl, _mm512_set1_epi8(static_cast<char>(1 << j)));
          u[j] = _mm512_mask_add_epi8(u[j], m, u[j], add);
        }
      }
      const int64_t bi = s * 8 + b;
      if constexpr (MIN) {
        const __m512 ds = _mm512_mul_ps(D, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b * 16)))));
        const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 128 + b * 16))));
        const __m512 mm = _mm512_mul_ps(M, mn);
        for (int r = 0; r < nr; ++r) {
          const int64_t row = r0 + r;
          const int8_t* q = a.q + row * K + bi * kBlock;
          __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
          for (int j = 0; j < 8; j += 2) {
            d0 = _mm512_dpbusd_epi32(d0, u[j], _mm512_set1_epi32(load_i32(q + 4 * j)));
            d1 = _mm512_dpbusd_epi32(d1, u[j + 1], _mm512_set1_epi32(load_i32(q + 4 * j + 4)));
          }
          const __m512i dot = _mm512_add_epi32(d0, d1);
          const __m512 ddx = _mm512_mul_ps(ds, _mm512_set1_ps(a.d[row * a.nb + bi]));
          __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), ddx, acc[r]);
          acc[r] = _mm512_fnmadd_ps(mm, _mm512_set1_ps(a.sx[row * a.nb + bi]), v);
        }
      } else {
        const __m512 ds1 = _mm512_mul_ps(D, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + (2 * b) * 16)))));
        const __m512 ds2 = _mm512_mul_ps(D, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + (2 * b + 1) * 16)))));
        for (int r = 0; r < nr; ++r) {
          const int64_t row = r0 + r;
          const int8_t* q = a.q + row * K + bi * kBlock;
          const int32_t* s16 = a.s + 2 * (row * a.nb + bi);
          __m512i a1 = _mm512_set1_epi32(-32 * s16[0]);
          __m512i a2 = _mm512_set1_epi32(-32 * s16[1]);
          for (int j = 0; j < 4; ++j) a1 = _mm512_dpbusd_epi32(a1, u[j], _mm512_set1_epi32(load_i32(q + 4 * j)));
          for (int j = 4; j < 8; ++j) a2 = _mm512_dpbusd_epi32(a2, u[j], _mm512_set1_epi32(load_i32(q + 4 * j)));
          const __m512 dx = _mm512_set1_ps(a.d[row * a.nb + bi]);
          const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), _mm512_mul_ps(ds1, dx), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a2), _mm512_mul_ps(ds2, dx), v);
        }
      }
    }
  }
  for (int r = 0; r < nr; ++r) _mm512_storeu_ps(out[r], acc[r]);
}
template <int PLANES, bool MIN>
void panel_vnni_rows(const uint8_t* wp, int64_t nsb, const Act& a, int64_t K, int64_t r0, int nr,
                     float out[][kCols]) {
  switch (nr) {
    case 1: panel_vnni_t<PLANES, MIN, 1>(wp, nsb, a, K, r0, out); break;
    case 2: panel_vnni_t<PLANES, MIN, 2>(wp, nsb, a, K, r0, out); break;
    case 3: panel_vnni_t<PLANES, MIN, 3>(wp, nsb, a, K, r0, out); break;
    case 4: panel_vnni_t<PLANES, MIN, 4>(wp, nsb, a, K, r0, out); break;
    case 5: panel_vnni_t<PLANES, MIN, 5>(wp, nsb, a, K, r0, out); break;
    case 6: panel_vnni_t<PLANES, MIN, 6>(wp, nsb, a, K, r0, out); break;
    case 7: panel_vnni_t<PLANES, MIN, 7>(wp, nsb, a, K, r0, out); break;
    default: panel_vnni_t<PLANES, MIN, 8>(wp, nsb, a, K, r0, out); break;
  }
}

void panel_vnni(const KFormat& f, const uint8_t* wp, int64_t nsb, const Act& a, int64_t K,
                int64_t r0, int nr, float out[][kCols]) {
  if (f.planes == 0) {
    panel_vnni_rows<0, true>(wp, nsb, a, K, r0, nr, out);
  } else if (f.planes == 1) {
    panel_vnni_rows<1, true>(wp, nsb, a, K, r0, nr, out);
  } else {
    panel_vnni_rows<2, false>(wp, nsb, a, K, r0, nr, out);
  }
}
#endif

// ---------------------------------------------------------------- AVX2

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline __m256i dot4(__m256i u, const int8_t* q) {  // 8 lanes: sum of 4 u8 x s8 (exact, u <= 63)
  int32_t v;
  std::memcpy(&v, q, 4);
  const __m256i p = _mm256_maddubs_epi16(u, _mm256_set1_epi32(v));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

template <int PLANES, bool MIN, int NR>
void panel_avx2_t(const uint8_t* wp, int64_t nsb, const Act& a, int64_t K, int64_t r0,
                  float out[][kCols]) {
  constexpr KFormat f{PLANES, MIN};
  constexpr int nr = NR;
  const __m256i low = _mm256_set1_epi8(15);
  for (int h = 0; h < 2; ++h) {  // 8 columns at a time
    __m256 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; ++s) {
      const uint8_t* tile = wp + s * f.tile_bytes();
      const uint8_t* sc = tile + f.scale_off() + h * 8;
      const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + f.d_off() + h * 16)));
      const __m256 M = MIN ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                       tile + f.d_off() + 32 + h * 16)))
                                 : _mm256_setzero_ps();
      for (int b = 0; b < 8; ++b) {
        const uint8_t* blk = tile + b * f.block_bytes();
        if (h == 0) prefetch_slice(tile, f.tile_bytes(), b);  // the h = 1 pass finds it in L2
        __m256i u[8];
        for (int c = 0; c < 4; ++c) {
          const __m256i nib = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + c * 64 + h * 32));
          u[c] = _mm256_and_si256(nib, low);
          u[4 + c] = _mm256_and_si256(_mm256_srli_epi16(nib, 4), low);
        }
        for (int p = 0; p < PLANES; ++p) {
          const __m256i pl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256 + p * 64 + h * 32));
          const __m256i add = _mm256_set1_epi8(static_cast<char>(16 << p));
          for (int j = 0; j < 8; ++j) {
            const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
            const __m256i m = _mm256_cmpeq_epi8(_mm256_and_si256(pl, bit), bit);
            u[j] = _mm256_add_epi8(u[j], _mm256_and_si256(m, add));
          }
        }
        const int64_t bi = s * 8 + b;
        if constexpr (MIN) {
          const __m256 ds = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + b * 16)))));
          const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 128 + b * 16))));
          const __m256 mm = _mm256_mul_ps(M, mn);
          for (int r = 0; r < nr; ++r) {
            const int64_t row = r0 + r;
            const int8_t* q = a.q + row * K + bi * kBlock;
            __m256i dot = _mm256_setzero_si256();
            for (int j = 0; j < 8; ++j) dot = _mm256_add_epi32(dot, dot4(u[j], q + 4 * j));
            const __m256 ddx = _mm256_mul_ps(ds, _mm256_set1_ps(a.d[row * a.nb + bi]));
            const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), ddx, acc[r]);
            acc[r] = _mm256_fnmadd_ps(mm, _mm256_set1_ps(a.sx[row * a.nb + bi]), v);
          }
        } else {
          const __m256 ds1 = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + (2 * b) * 16)))));
          const __m256 ds2 = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + (2 * b + 1) * 16)))));
          for (int r = 0; r < nr; ++r) {
            const int64_t row = r0 + r;
            const int8_t* q = a.q + row * K + bi * kBlock;
            const int32_t* s16 = a.s + 2 * (row * a.nb + bi);
            __m256i a1 = _mm256_set1_epi32(-32 * s16[0]);
            __m256i a2 = _mm256_set1_epi32(-32 * s16[1]);
            for (int j = 0; j < 4; ++j) a1 = _mm256_add_epi32(a1, dot4(u[j], q + 4 * j));
            for (int j = 4; j < 8; ++j) a2 = _mm256_add_epi32(a2, dot4(u[j], q + 4 * j));
            const __m256 dx = _mm256_set1_ps(a.d[row * a.nb + bi]);
            const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1), _mm256_mul_ps(ds1, dx), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a2), _mm256_mul_ps(ds2, dx), v);
          }
        }
      }
    }
    for (int r = 0; r < nr; ++r) _mm256_storeu_ps(out[r] + h * 8, acc[r]);
  }
}
template <int PLANES, bool MIN>
void panel_avx2_rows(const uint8_t* wp, int64_t nsb, const Act& a, int64_t K, int64_t r0, int nr,
                     float out[][kCols]) {
  switch (nr) {
    case 1: panel_avx2_t<PLANES, MIN, 1>(wp, nsb, a, K, r0, out); break;
    case 2: panel_avx2_t<PLANES, MIN, 2>(wp, nsb, a, K, r0, out); break;
    case 3: panel_avx2_t<PLANES, MIN, 3>(wp, nsb, a, K, r0, out); break;
    case 4: panel_avx2_t<PLANES, MIN, 4>(wp, nsb, a, K, r0, out); break;
    default:  // 5-8 rows: two passes of up to 4 (AVX2 has 16 registers)
      panel_avx2_t<PLANES, MIN, 4>(wp, nsb, a, K, r0, out);
      panel_avx2_rows<PLANES, MIN>(wp, nsb, a, K, r0 + 4, nr - 4, out + 4);
      break;
  }
}

void panel_avx2(const KFormat& f, const uint8_t* wp, int64_t nsb, const Act& a, int64_t K,
                int64_t r0, int nr, float out[][kCols]) {
  if (f.planes == 0) {
    panel_avx2_rows<0, true>(wp, nsb, a, K, r0, nr, out);
  } else if (f.planes == 1) {
    panel_avx2_rows<1, true>(wp, nsb, a, K, r0, nr, out);
  } else {
    panel_avx2_rows<2, false>(wp, nsb, a, K, r0, nr, out);
  }
}
#endif

void run_panel(int path, const KFormat& f, const uint8_t* wp, int64_t nsb, const Act& a,
               int64_t K, int64_t r0, int nr, float acc[][kCols]) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if (path == 3) {
    panel_vnni(f, wp, nsb, a, K, r0, nr, acc);
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if (path == 2) {
    panel_avx2(f, wp, nsb, a, K, r0, nr, acc);
    return;
  }
#endif
  (void)path;
  panel_scalar(f, wp, nsb, a, K, r0, nr, acc);
}

}  // namespace

extern "C" {

// 0: none; bit 0: scalar; bit 1: AVX2; bit 2: AVX512-VNNI (compiled in).
int kvs_linear_kquant_paths() {
  return kvs::q8::paths();
}

// y[rows, n] = x[rows, K] @ W^T + bias; arguments as kvs_linear_quant (csrc/linear_quant.cpp):
// x float32 (0) / bfloat16 (1) with row stride xs, last dim contiguous; w the layout
// above for fmt 16/17/18 with ceil(n/16) panels of K/256 tiles (K a multiple of 256);
// bias n fp32 or null; out out_dtype with row stride os; path 0 best, 1 scalar, 2 AVX2,
// 3 AVX512-VNNI. Returns 0, or -1 for a bad format/K/path/dtype.
int kvs_linear_kquant(const void* x, int64_t xs, int64_t rows, int64_t K, int x_dtype,
                      const uint8_t* w, int fmt, int64_t n, const float* bias, void* out,
                      int64_t os, int out_dtype, int path, int threads) {
  KFormat f;
  if (!kformat_of(fmt, &f) || K % kSuper != 0 || rows < 0 || n < 0) return -1;
  if (x_dtype < 0 || x_dtype > 1 || out_dtype < 0 || out_dtype > 1) return -1;
  path = kvs::q8::resolve_path(path);
  if (path < 0) return -1;
  if (threads < 1) threads = 1;
  if (rows == 0 || n == 0) return 0;
  const Act a = quantize_activations(x, xs, rows, K, x_dtype, threads);
  const int64_t nsb = K / kSuper;
  const int64_t panels = (n + kCols - 1) / kCols;
  const int64_t pbytes = nsb * f.tile_bytes();
  const int64_t chunks = (rows + kRowChunk - 1) / kRowChunk;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t ch = 0; ch < chunks; ++ch) {
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t rend = std::min(rows, (ch + 1) * kRowChunk);
      const int ncol = static_cast<int>(std::min<int64_t>(kCols, n - p * kCols));
      for (int64_t r0 = ch * kRowChunk; r0 < rend; r0 += kRowTile) {
        const int nr = static_cast<int>(std::min<int64_t>(kRowTile, rend - r0));
        alignas(64) float acc[kRowTile][kCols];
        run_panel(path, f, w + p * pbytes, nsb, a, K, r0, nr, acc);
        for (int r = 0; r < nr; ++r) {
          for (int col = 0; col < ncol; ++col) {
            const int64_t c = p * kCols + col;
            const float v = bias ? acc[r][col] + bias[c] : acc[r][col];
            const int64_t o = (r0 + r) * os + c;
            if (out_dtype == 0) {
              static_cast<float*>(out)[o] = v;
            } else {
              kvs::from_f32(v, static_cast<kvs::bf16_t*>(out) + o);
            }
          }
        }
      }
    }
  }
  return 0;
}

// out[t, :] = row ids[t] of W dequantized exactly (the formula above, fp32), stored as
// out_dtype (0 fp32, 1 bf16) with row stride K. Rule: every id in [0, n). Returns 0, or
// -1 for a bad format/K.
int kvs_kquant_embed(const uint8_t* w, int fmt, int64_t n, int64_t K, const int64_t* ids,
                     int64_t count, void* out, int out_dtype, int threads) {
  KFormat f;
  if (!kformat_of(fmt, &f) || K % kSuper != 0) return -1;
  (void)n;
  const int64_t nsb = K / kSuper;
#pragma omp parallel for num_threads(threads) schedule(static) if (count >= 8)
  for (int64_t t = 0; t < count; ++t) {
    const int64_t id = ids[t];
    const int col = static_cast<int>(id % kCols);
    const uint8_t* wp = w + (id / kCols) * nsb * f.tile_bytes();
    for (int64_t s = 0; s < nsb; ++s) {
      const uint8_t* tile = wp + s * f.tile_bytes();
      const uint8_t* sc = tile + f.scale_off();
      const auto* dh = reinterpret_cast<const uint16_t*>(tile + f.d_off());
      const float D = half_to_float(dh[col]);
      for (int b = 0; b < 8; ++b) {
        const uint8_t* blk = tile + b * f.block_bytes();
        for (int j = 0; j < kBlock; ++j) {
          const int u = weight_u(blk, f.planes, col, j);
          float v;
          if (f.has_min) {
            const float ds = D * static_cast<float>(sc[b * 16 + col]);
            const float mm = half_to_float(dh[16 + col]) * static_cast<float>(sc[128 + b * 16 + col]);
            v = ds * static_cast<float>(u) - mm;
          } else {
            const int g = 2 * b + j / 16;
            const float ds = D * static_cast<float>(static_cast<int8_t>(sc[g * 16 + col]));
            v = ds * static_cast<float>(u - 32);
          }
          const int64_t o = t * K + s * kSuper + b * kBlock + j;
          if (out_dtype == 0) {
            static_cast<float*>(out)[o] = v;
          } else {
            kvs::from_f32(v, static_cast<kvs::bf16_t*>(out) + o);
          }
        }
      }
    }
  }
  return 0;
}

// The tile layout above from raw GGUF rows (Q4_K / Q5_K / Q6_K super-blocks, fmt 16 / 17
// / 18): the integers and scales copied as they are (llama.cpp's block layouts), the
// padding columns of the last panel zero. raw: n rows of K/256 blocks; out:
// ceil(n/16) * K/256 * tile bytes. Returns 0, or -1 for a bad format/K.
int kvs_kquant_pack_gguf(const uint8_t* raw, int fmt, int64_t n, int64_t K, uint8_t* out,
                         int threads) {
  KFormat f;
  if (!kformat_of(fmt, &f) || K % kSuper != 0 || n < 0) return -1;
  const int64_t nsb = K / kSuper;
  const int64_t gb = fmt == 16 ? 144 : (fmt == 17 ? 176 : 210);  // GGUF block bytes
  const int64_t panels = (n + kCols - 1) / kCols;
  const int64_t tb = f.tile_bytes();
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t s = 0; s < nsb; ++s) {
      uint8_t* tile = out + (p * nsb + s) * tb;
      std::memset(tile, 0, static_cast<size_t>(tb));
      for (int col = 0; col < kCols; ++col) {
        const int64_t row = p * kCols + col;
        if (row >= n) break;
        const uint8_t* g = raw + (row * nsb + s) * gb;
        uint8_t u[kSuper];
        uint8_t* sc = tile + f.scale_off();
        uint8_t* dh = tile + f.d_off();
        if (fmt == 18) {  // Q6_K: ql[128] qh[64] sc[16] d
          for (int h = 0; h < 2; ++h) {
            for (int l = 0; l < 32; ++l) {
              const uint8_t* ql = g + h * 64;
              const uint8_t qh = g[128 + h * 32 + l];
              u[h * 128 + l] = static_cast<uint8_t>((ql[l] & 15) | ((qh & 3) << 4));
              u[h * 128 + 32 + l] = static_cast<uint8_t>((ql[32 + l] & 15) | (((qh >> 2) & 3) << 4));
              u[h * 128 + 64 + l] = static_cast<uint8_t>((ql[l] >> 4) | (((qh >> 4) & 3) << 4));
              u[h * 128 + 96 + l] = static_cast<uint8_t>((ql[32 + l] >> 4) | (((qh >> 6) & 3) << 4));
            }
          }
          for (int grp = 0; grp < 16; ++grp) sc[grp * 16 + col] = g[192 + grp];
          std::memcpy(dh + 2 * col, g + 208, 2);
        } else {  // Q4_K / Q5_K: d dmin scales[12] (qh[32]) qs[128]
          const uint8_t* q6 = g + 4;
          for (int j = 0; j < 8; ++j) {
            uint8_t scv, mnv;
            if (j < 4) {
              scv = q6[j] & 63;
              mnv = q6[j + 4] & 63;
            } else {
              scv = static_cast<uint8_t>((q6[j + 4] & 15) | ((q6[j - 4] >> 6) << 4));
              mnv = static_cast<uint8_t>((q6[j + 4] >> 4) | ((q6[j] >> 6) << 4));
            }
            sc[j * 16 + col] = scv;
            sc[128 + j * 16 + col] = mnv;
          }
          const uint8_t* qs = g + (fmt == 16 ? 16 : 48);
          for (int j = 0; j < 4; ++j) {
            for (int l = 0; l < 32; ++l) {
              u[j * 64 + l] = qs[j * 32 + l] & 15;
              u[j * 64 + 32 + l] = qs[j * 32 + l] >> 4;
            }
          }
          if (fmt == 17) {
            for (int sub = 0; sub < 8; ++sub) {
              for (int l = 0; l < 32; ++l) u[sub * 32 + l] |= static_cast<uint8_t>(((g[16 + l] >> sub) & 1) << 4);
            }
          }
          std::memcpy(dh + 2 * col, g, 2);
          std::memcpy(dh + 32 + 2 * col, g + 2, 2);
        }
        for (int b = 0; b < 8; ++b) {
          uint8_t* blk = tile + b * f.block_bytes();
          for (int j = 0; j < kBlock; ++j) {
            const int v = u[b * kBlock + j];
            const int half = j / 16, c = (j % 16) / 4, t = j % 4;
            blk[c * 64 + col * 4 + t] |= static_cast<uint8_t>(half ? (v & 15) << 4 : (v & 15));
            for (int pl = 0; pl < f.planes; ++pl) {
              blk[256 + pl * 64 + col * 4 + t] |= static_cast<uint8_t>(((v >> (4 + pl)) & 1) << (j / 4));
            }
          }
        }
      }
    }
  }
  return 0;
}

}  // extern "C"
