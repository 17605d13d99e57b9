// Quantized linear layers: y[M, N] = x[M, K] @ W^T (+ bias) with W in 4- or 8-bit
// blocks of 32 along K (GGUF's Q4_0, Q4_1 and Q8_0, and formats repacked into them),
// plus the quantized embedding gather (kvs_quant_embed).
//
// Weight layout ("panels", made once at load by kvserve/model/quant/formats.py):
// columns in panels of 16, each panel a contiguous run of K/32 blocks; a block holds
//   bits 4: 4 chunks of 64 bytes; chunk c, byte 4*col + t: low nibble = u[col][4c + t],
//           high nibble = u[col][16 + 4c + t];
//   bits 8: 8 chunks of 64 bytes; chunk r, byte 4*col + t = u[col][4r + t];
// then fp16 d[16] and, for formats with a minimum, fp16 m[16]. A weight is
//   w = d * (u - zero)   (symmetric formats: Q4_0 zero 8, Q8_0 zero 128)
//   w = d * u + m        (formats with a minimum: Q4_1).
// Each 64-byte chunk is one vpdpbusd operand: 16 columns x 4 consecutive k.
//
// Activations are quantized per row and per block of 32 to int8 (d_x = amax / 127,
// q = round-to-nearest-even(x / d_x)), as llama.cpp's q8 blocks. A block's dot product
// is then exact in int32: isum = sum u * q (vpdpbusd: u unsigned, q signed), and
//   acc += float(isum - zero * sum(q)) * (d * d_x)       (symmetric)
//   acc += float(isum) * (d * d_x);  acc += m * (d_x * sum(q))   (with minimum)
// in fp32 FMAs, blocks in order. DETERMINISM: every row's accumulation is that one
// sequence at any M and any row tiling (the integer part is exact, the float part has
// one order), so a row's output does not depend on the other rows of the call, and the
// AVX512-VNNI, AVX2 and scalar paths give bitwise equal results.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "kvs_common.h"
#include "quant_linear.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using kvs::half_to_float;

constexpr int64_t kCols = 16;   // columns per panel
using kvs::q8::kBlock;  // k per block
constexpr int64_t kRowTile = 8;
constexpr int64_t kRowChunk = 64;  // rows whose quantized activations stay in cache per pass
// The weight stream is prefetched into L2 this many blocks ahead (measured on Zen 5 at
// M = 1-2: 10-18 % faster than an L1 prefetch 4 blocks ahead, about equal to the
// hardware prefetcher alone at M = 1 and 1.3x faster than it at M = 8; noisy shared
// machine, see docs/quantization.md).
constexpr int64_t kPrefetch = 16;

struct Format {
  int bits;
  int zero;
  bool has_min;
};

// fmt codes shared with kvserve/model/quant/formats.py
inline bool format_of(int code, Format* f) {
  switch (code) {
    case 0: *f = {4, 0, true}; return true;     // Q4_1 (and anything with d, m per 32)
    case 1: *f = {4, 8, false}; return true;    // Q4_0
    case 2: *f = {8, 128, false}; return true;  // Q8_0 (stored u = q + 128)
    case 3: *f = {8, 0, true}; return true;     // 8-bit unsigned with minimum (Q5_K repack)
    default: return false;
  }
}

inline int64_t block_bytes(const Format& f) {
  return f.bits * 64 + 32 + (f.has_min ? 32 : 0);
}

// A call's quantized activations (quant_linear.h): s holds one sum of q per block.
using QuantAct = kvs::q8::Act;

// vector: use the AVX-512 quantizer where compiled in (the scalar path pins the scalar one).
QuantAct quantize_activations(const void* x, int64_t xs, int64_t rows, int64_t K, int dtype,
                              int threads, bool vector) {
  thread_local kvs::q8::Buffers buf;
  return kvs::q8::quantize_activations<false>(buf, x, xs, rows, K, dtype, threads, vector);
}

// ----------------------------------------------------------------- scalar (portable)

// Unsigned weight value of column col, k-offset j within a block.
inline int weight_u(const uint8_t* blk, int bits, int col, int j) {
  const int quad = j / 4, t = j % 4;
  if (bits == 4) {
    const uint8_t byte = blk[64 * (quad % 4) + 4 * col + t];
    return quad < 4 ? (byte & 0x0f) : (byte >> 4);
  }
  return blk[64 * quad + 4 * col + t];
}

void panel_scalar(const Format& f, const uint8_t* wp, int64_t nb, const QuantAct& a, int64_t r0,
                  int64_t nrows, int64_t K, float* acc /* [nrows][16] */) {
  const int64_t bb = block_bytes(f);
  for (int64_t r = 0; r < nrows; ++r) {
    for (int c = 0; c < kCols; ++c) acc[r * kCols + c] = 0.0f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wp + b * bb;
    const uint16_t* dh = reinterpret_cast<const uint16_t*>(blk + f.bits * 64);
    const uint16_t* mh = dh + 16;
    for (int64_t r = 0; r < nrows; ++r) {
      const int8_t* q = a.q + (r0 + r) * K + b * kBlock;
      const float dx = a.d[(r0 + r) * nb + b];
      const int32_t sq = a.s[(r0 + r) * nb + b];
      const float sx = a.sx[(r0 + r) * nb + b];
      for (int c = 0; c < kCols; ++c) {
        int32_t isum = 0;
        for (int j = 0; j < kBlock; ++j) isum += weight_u(blk, f.bits, c, j) * q[j];
        const float d = half_to_float(dh[c]);
        float& o = acc[r * kCols + c];
        if (f.has_min) {
          o = std::fma(static_cast<float>(isum), d * dx, o);
          o = std::fma(half_to_float(mh[c]), sx, o);
        } else {
          o = std::fma(static_cast<float>(isum - f.zero * sq), d * dx, o);
        }
      }
    }
  }
}

// ----------------------------------------------------------------- AVX2

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Same arithmetic as panel_scalar, 8 columns per ymm: the 16-bit products of
// maddubs could saturate for 8-bit weights, so bytes widen to 16 bits and madd sums
// pairs into int32 (exact).
void panel_avx2(const Format& f, const uint8_t* wp, int64_t nb, const QuantAct& a, int64_t r0,
                int64_t nrows, int64_t K, float* acc) {
  const int64_t bb = block_bytes(f);
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  for (int64_t r0t = 0; r0t < nrows; r0t += 4) {
    const int64_t nr = nrows - r0t < 4 ? nrows - r0t : 4;
    __m256 o[4][2];
    for (int r = 0; r < 4; ++r) o[r][0] = o[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wp + b * bb;
      // w[quad][half]: 8 columns x 4 bytes of quad `quad`, columns 8*half..
      __m256i w[8][2];
      for (int quad = 0; quad < 8; ++quad) {
        for (int h = 0; h < 2; ++h) {
          if (f.bits == 4) {
            const __m256i v = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(blk + 64 * (quad % 4) + 32 * h));
            w[quad][h] = quad < 4 ? _mm256_and_si256(v, low4)
                                  : _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          } else {
            w[quad][h] =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * quad + 32 * h));
          }
        }
      }
      const __m128i* dh = reinterpret_cast<const __m128i*>(blk + f.bits * 64);
      const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(dh));
      const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128(dh + 1));
      __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
      if (f.has_min) {
        m0 = _mm256_cvtph_ps(_mm_loadu_si128(dh + 2));
        m1 = _mm256_cvtph_ps(_mm_loadu_si128(dh + 3));
      }
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t row = r0 + r0t + r;
        const int8_t* q = a.q + row * K + b * kBlock;
        const float dx = a.d[row * nb + b];
        const int32_t sq = a.s[row * nb + b];
        const float sx = a.sx[row * nb + b];
        __m256i is[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int quad = 0; quad < 8; ++quad) {
          int32_t x4;
          std::memcpy(&x4, q + 4 * quad, 4);
          const __m256i xb = _mm256_set1_epi32(x4);
          const __m256i xlo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(xb));  // 4 bytes x 4
          for (int h = 0; h < 2; ++h) {
            const __m256i wl = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(w[quad][h]));
            const __m256i wh = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(w[quad][h], 1));
            // pairs of 16-bit products -> int32: lanes (col, t0+t1), (col, t2+t3)
            const __m256i pl = _mm256_madd_epi16(wl, xlo);  // cols 0-3 of the half
            const __m256i ph = _mm256_madd_epi16(wh, xlo);  // cols 4-7
            // add adjacent int32 pairs -> one int32 per column (order: cols 0,1,4,5,2,3,6,7)
            const __m256i s = _mm256_hadd_epi32(pl, ph);
            is[h] = _mm256_add_epi32(is[h], s);
          }
        }
        for (int h = 0; h < 2; ++h) {
          // undo hadd's lane order: [c0 c1 c4 c5 | c2 c3 c6 c7] -> [c0..c7]
          __m256i v = _mm256_permute4x64_epi64(is[h], 0xd8);  // [c0 c1 c2 c3 | c4 c5 c6 c7]
          const __m256 d = h ? d1 : d0;
          const __m256 ddx = _mm256_mul_ps(d, _mm256_set1_ps(dx));
          if (f.has_min) {
            o[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), ddx, o[r][h]);
            o[r][h] = _mm256_fmadd_ps(h ? m1 : m0, _mm256_set1_ps(sx),
                                      o[r][h]);
          } else {
            v = _mm256_sub_epi32(v, _mm256_set1_epi32(f.zero * sq));
            o[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), ddx, o[r][h]);
          }
        }
      }
    }
    for (int64_t r = 0; r < nr; ++r) {
      _mm256_storeu_ps(acc + (r0t + r) * kCols, o[r][0]);
      _mm256_storeu_ps(acc + (r0t + r) * kCols + 8, o[r][1]);
    }
  }
}
#endif

// ----------------------------------------------------------------- AVX512-VNNI

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// MR rows x NP panels (each panel 16 columns; panel j at wp + j * pstride bytes) in one
// pass over the K blocks: the weights of a block are unpacked once into registers and
// reused by every row, and each row's broadcast activations by every panel (the engine
// runs NP = 1, see group_vnni). acc: panel j's [MR][16] at acc + j * acc_ps floats.
// Per (row, column) the float sequence is the one of panel_scalar.
template <int BITS, bool MIN, int MR, int NP>
inline void tile_vnni(const uint8_t* wp, int64_t pstride, int64_t nb, int zero,
                      const QuantAct& a, int64_t row0, int64_t K, float* acc, int64_t acc_ps) {
  constexpr int64_t bb = BITS * 64 + 32 + (MIN ? 32 : 0);
  constexpr int kLines = static_cast<int>((bb + 63) / 64);
  __m512 o[NP][MR];
  for (int j = 0; j < NP; ++j) {
    for (int r = 0; r < MR; ++r) o[j][r] = _mm512_setzero_ps();
  }
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[NP][8];
    __m512 d[NP], m[NP];
    for (int j = 0; j < NP; ++j) {
      const uint8_t* blk = wp + j * pstride + b * bb;
      for (int l = 0; l < kLines; ++l) {
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch * bb + 64 * l), _MM_HINT_T1);
      }
      if (BITS == 4) {
        for (int c = 0; c < 4; ++c) {
          const __m512i v = _mm512_loadu_si512(blk + 64 * c);
          w[j][c] = _mm512_and_si512(v, low4);
          w[j][c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
      } else {
        for (int c = 0; c < 8; ++c) w[j][c] = _mm512_loadu_si512(blk + 64 * c);
      }
      const __m256i* dh = reinterpret_cast<const __m256i*>(blk + BITS * 64);
      d[j] = _mm512_cvtph_ps(_mm256_loadu_si256(dh));
      m[j] = MIN ? _mm512_cvtph_ps(_mm256_loadu_si256(dh + 1)) : _mm512_setzero_ps();
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t row = row0 + r;
      const int32_t* q = reinterpret_cast<const int32_t*>(a.q + row * K + b * kBlock);
      __m512i xq[8];
      for (int c = 0; c < 8; ++c) xq[c] = _mm512_set1_epi32(q[c]);
      const __m512 dx = _mm512_set1_ps(a.d[row * nb + b]);
      for (int j = 0; j < NP; ++j) {
        // four dependency chains (integer sums: exact in any order)
        __m512i is = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[j][0], xq[0]);
        __m512i is1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[j][4], xq[4]);
        __m512i is2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[j][1], xq[1]);
        __m512i is3 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[j][5], xq[5]);
        is = _mm512_dpbusd_epi32(is, w[j][2], xq[2]);
        is1 = _mm512_dpbusd_epi32(is1, w[j][6], xq[6]);
        is2 = _mm512_dpbusd_epi32(is2, w[j][3], xq[3]);
        is3 = _mm512_dpbusd_epi32(is3, w[j][7], xq[7]);
        is = _mm512_add_epi32(_mm512_add_epi32(is, is1), _mm512_add_epi32(is2, is3));
        const __m512 ddx = _mm512_mul_ps(d[j], dx);
        if (MIN) {
          o[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), ddx, o[j][r]);
          o[j][r] = _mm512_fmadd_ps(m[j], _mm512_set1_ps(a.sx[row * nb + b]), o[j][r]);
        } else {
          is = _mm512_sub_epi32(is, _mm512_set1_epi32(zero * a.s[row * nb + b]));
          o[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), ddx, o[j][r]);
        }
      }
    }
  }
  for (int j = 0; j < NP; ++j) {
    for (int r = 0; r < MR; ++r) _mm512_storeu_ps(acc + j * acc_ps + r * kCols, o[j][r]);
  }
}

template <int BITS, bool MIN, int NP>
void rows_vnni(const uint8_t* wp, int64_t pstride, int64_t nb, int zero, const QuantAct& a,
               int64_t r0, int64_t nrows, int64_t K, float* acc, int64_t acc_ps) {
  int64_t r = 0;
  for (; r + kRowTile <= nrows; r += kRowTile) {
    tile_vnni<BITS, MIN, kRowTile, NP>(wp, pstride, nb, zero, a, r0 + r, K, acc + r * kCols,
                                       acc_ps);
  }
  float* o = acc + r * kCols;
  const int64_t row = r0 + r;
  switch (nrows - r) {
    case 1: tile_vnni<BITS, MIN, 1, NP>(wp, pstride, nb, zero, a, row, K, o, acc_ps); break;
    case 2: tile_vnni<BITS, MIN, 2, NP>(wp, pstride, nb, zero, a, row, K, o, acc_ps); break;
    case 3: tile_vnni<BITS, MIN, 3, NP>(wp, pstride, nb, zero, a, row, K, o, acc_ps); break;
    case 4: tile_vnni<BITS, MIN, 4, NP>(wp, pstride, nb, zero, a, row, K, o, acc_ps); break;
    case 5: tile_vnni<BITS, MIN, 5, NP>(wp, pstride, nb, zero, a, row, K, o, acc_ps); break;
    case 6: tile_vnni<BITS, MIN, 6, NP>(wp, pstride, nb, zero, a, row, K, o, acc_ps); break;
    case 7: tile_vnni<BITS, MIN, 7, NP>(wp, pstride, nb, zero, a, row, K, o, acc_ps); break;
    default: break;
  }
}

// Panels wp and wp + pstride (np = 2) or wp alone, rows r0..r0+nrows: one pass per
// panel in 8-row tiles. (Two panels in one pass at M <= 2, sharing each row's
// broadcasts, measured 0.74x of this on Zen 5: tile_vnni keeps the NP parameter.)
template <int BITS, bool MIN>
void group_vnni(const uint8_t* wp, int64_t pstride, int np, int64_t nb, int zero,
                const QuantAct& a, int64_t r0, int64_t nrows, int64_t K, float* acc,
                int64_t acc_ps) {
  for (int j = 0; j < np; ++j) {
    rows_vnni<BITS, MIN, 1>(wp + j * pstride, 0, nb, zero, a, r0, nrows, K, acc + j * acc_ps,
                            acc_ps);
  }
}

void group_vnni_dispatch(const Format& f, const uint8_t* wp, int64_t pstride, int np,
                         int64_t nb, const QuantAct& a, int64_t r0, int64_t nrows, int64_t K,
                         float* acc, int64_t acc_ps) {
  if (f.bits == 4 && f.has_min) {
    group_vnni<4, true>(wp, pstride, np, nb, f.zero, a, r0, nrows, K, acc, acc_ps);
  } else if (f.bits == 4) {
    group_vnni<4, false>(wp, pstride, np, nb, f.zero, a, r0, nrows, K, acc, acc_ps);
  } else if (f.has_min) {
    group_vnni<8, true>(wp, pstride, np, nb, f.zero, a, r0, nrows, K, acc, acc_ps);
  } else {
    group_vnni<8, false>(wp, pstride, np, nb, f.zero, a, r0, nrows, K, acc, acc_ps);
  }
}
#endif

// One group of np panels (at wp, wp + pstride) for rows r0..r0+nrows on `path`, into
// acc (panel j at acc + j * acc_ps).
void compute_group(int path, const Format& f, const uint8_t* wp, int64_t pstride, int np,
                   int64_t nb, const QuantAct& a, int64_t r0, int64_t nrows, int64_t K,
                   float* acc, int64_t acc_ps) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if (path == 3) {
    group_vnni_dispatch(f, wp, pstride, np, nb, a, r0, nrows, K, acc, acc_ps);
    return;
  }
#endif
  for (int j = 0; j < np; ++j) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (path == 2) {
      panel_avx2(f, wp + j * pstride, nb, a, r0, nrows, K, acc + j * acc_ps);
      continue;
    }
#endif
    panel_scalar(f, wp + j * pstride, nb, a, r0, nrows, K, acc + j * acc_ps);
  }
}

// v + bias (bias may be null), rounded to T: 16 columns at once where the panel is full
// (the same values as kvs::from_f32, NaN included), column by column otherwise.
template <typename T>
void store_cols(const float* acc, const float* bias, int64_t n0, int64_t nvalid, T* out) {
#if defined(__AVX512F__)
  if (nvalid == kCols) {
    __m512 v = _mm512_loadu_ps(acc);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0));
    if constexpr (std::is_same_v<T, float>) {
      _mm512_storeu_ps(out + n0, v);
    } else {
      const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      if (nan == 0) {
        kvs::store16(out + n0, v);
        return;
      }
    }
    if constexpr (std::is_same_v<T, float>) return;
  }
#endif
  for (int64_t c = 0; c < nvalid; ++c) {
    const float v = bias != nullptr ? acc[c] + bias[n0 + c] : acc[c];
    kvs::from_f32(v, out + n0 + c);
  }
}

#if defined(__AVX512F__)
// v rounded to T and back to fp32 (bf16: round to nearest even, as kvs::from_f32 for
// values that are not NaN; the caller checks for NaN).
template <typename T>
inline __m512 round_to(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(-65536)));
  }
}
#endif

// silu(g) * u for 16 columns, g and u rounded to T first: the arithmetic of
// kvs_silu_mul (csrc/fused_ops.cpp) on a [g | u] row in T, so the fused call gives what
// the linear followed by kvs_silu_mul gives (bitwise
// where no value is NaN; NaN stays NaN).
template <typename T>
void store_silu(const float* g, const float* u, const float* bg, const float* bu, int64_t n0,
                int64_t nvalid, T* out) {
#if defined(__AVX512F__)
  if (nvalid == kCols) {
    __m512 gv = _mm512_loadu_ps(g), uv = _mm512_loadu_ps(u);
    if (bg != nullptr) {
      gv = _mm512_add_ps(gv, _mm512_loadu_ps(bg + n0));
      uv = _mm512_add_ps(uv, _mm512_loadu_ps(bu + n0));
    }
    const __mmask16 nan =
        _mm512_cmp_ps_mask(gv, gv, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(uv, uv, _CMP_UNORD_Q);
    if (nan == 0) {
      const __m512 one = _mm512_set1_ps(1.f);
      const __m512 a = round_to<T>(gv);
      __m512 sig;
      if constexpr (std::is_same_v<T, kvs::bf16_t>) {
        const __m512 neg_log2e = _mm512_set1_ps(-1.4426950408889634f);
        sig = _mm512_rcp14_ps(_mm512_add_ps(one, kvs::exp2_bf16(_mm512_mul_ps(a, neg_log2e))));
      } else {
        sig = _mm512_div_ps(
            one, _mm512_add_ps(one, kvs::exp512(_mm512_sub_ps(_mm512_setzero_ps(), a))));
      }
      kvs::store16(out + n0, _mm512_mul_ps(_mm512_mul_ps(a, sig), round_to<T>(uv)));
      return;
    }
  }
#endif
  // column by column (a partial panel, NaN, or no AVX-512): kvs_silu_mul's scalar form
  for (int64_t c = 0; c < nvalid; ++c) {
    T gr, ur;
    kvs::from_f32(bg != nullptr ? g[c] + bg[n0 + c] : g[c], &gr);
    kvs::from_f32(bu != nullptr ? u[c] + bu[n0 + c] : u[c], &ur);
    const float gs = kvs::to_f32(gr), us = kvs::to_f32(ur);
    kvs::from_f32(gs / (1.f + std::exp(-gs)) * us, out + n0 + c);
  }
}

struct Call {
  int64_t rows, K, n;
  const uint8_t* w;
  Format f;
  const float* bias;
  void* out;
  int64_t os;
  int out_dtype, path, threads;
};

// Runs the panels of a call; silu: n = 2I columns [gate | up] (I % 16 == 0), out [rows, I]
// = silu(gate) * up. Work items: (64-row chunk, group of panels), split statically.
void run_call(const Call& c, const QuantAct& a, bool silu) {
  const int64_t nb = c.K / kBlock;
  const int64_t panel_bytes = nb * block_bytes(c.f);
  const int64_t panels = (c.n + kCols - 1) / kCols;
  const int64_t chunks = (c.rows + kRowChunk - 1) / kRowChunk;
  // plain: pairs of neighbouring panels (decode rows share a pass); silu: gate panel p
  // with up panel p + I/16
  const int64_t groups = silu ? panels / 2 : (panels + 1) / 2;
  const int64_t pstride = silu ? (panels / 2) * panel_bytes : panel_bytes;
  const int64_t inter = c.n / 2;
#pragma omp parallel for collapse(2) schedule(static) num_threads(c.threads) if (c.threads > 1)
  for (int64_t ch = 0; ch < chunks; ++ch) {
    for (int64_t g = 0; g < groups; ++g) {
      alignas(64) float acc[2 * kRowChunk * kCols];
      constexpr int64_t acc_ps = kRowChunk * kCols;
      const int64_t r0 = ch * kRowChunk;
      const int64_t nr = c.rows - r0 < kRowChunk ? c.rows - r0 : kRowChunk;
      const int64_t p0 = silu ? g : 2 * g;
      const int np = silu ? 2 : (p0 + 1 < panels ? 2 : 1);
      compute_group(c.path, c.f, c.w + p0 * panel_bytes, pstride, np, nb, a, r0, nr, c.K, acc,
                    acc_ps);
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t row = r0 + r;
        if (silu) {
          const int64_t n0 = p0 * kCols;
          const int64_t nvalid = inter - n0 < kCols ? inter - n0 : kCols;
          const float* bu = c.bias != nullptr ? c.bias + inter : nullptr;
          if (c.out_dtype == 0) {
            store_silu(acc + r * kCols, acc + acc_ps + r * kCols, c.bias, bu, n0, nvalid,
                       static_cast<float*>(c.out) + row * c.os);
          } else {
            store_silu(acc + r * kCols, acc + acc_ps + r * kCols, c.bias, bu, n0, nvalid,
                       static_cast<kvs::bf16_t*>(c.out) + row * c.os);
          }
          continue;
        }
        for (int j = 0; j < np; ++j) {
          const float* src = acc + j * acc_ps + r * kCols;
          const int64_t n0 = (p0 + j) * kCols;
          const int64_t nvalid = c.n - n0 < kCols ? c.n - n0 : kCols;
          if (c.out_dtype == 0) {
            store_cols(src, c.bias, n0, nvalid, static_cast<float*>(c.out) + row * c.os);
          } else {
            store_cols(src, c.bias, n0, nvalid, static_cast<kvs::bf16_t*>(c.out) + row * c.os);
          }
        }
      }
    }
  }
}

int prepare_call(const void* x, int64_t xs, int64_t rows, int64_t K, int x_dtype,
                 const uint8_t* w, int fmt, int64_t n, const float* bias, void* out, int64_t os,
                 int out_dtype, int path, int threads, Call* c) {
  Format f;
  if (!format_of(fmt, &f) || K % kBlock != 0 || rows < 0) return -1;
  if (x_dtype < 0 || x_dtype > 1 || out_dtype < 0 || out_dtype > 1) return -1;
  path = kvs::q8::resolve_path(path);
  if (path < 0) return -1;
  (void)x;
  (void)xs;
  *c = {rows, K, n, w, f, bias, out, os, out_dtype, path, threads < 1 ? 1 : threads};
  return 0;
}

}  // namespace

extern "C" {

// 0: none; bit 0: scalar; bit 1: AVX2; bit 2: AVX512-VNNI (compiled in and usable).
int kvs_linear_quant_paths() {
  return kvs::q8::paths();
}

// y[rows, n] = x[rows, K] @ W^T + bias. x: float32 (x_dtype 0) or bfloat16 (1), row
// stride xs elements, last dim contiguous; w: the panel layout above for format code
// fmt with ceil(n / 16) panels of K / 32 blocks (K a multiple of 32); bias: n fp32 or
// null; out: out_dtype 0/1, row stride os. path: 0 best available, 1 scalar, 2 AVX2,
// 3 AVX512-VNNI. Returns 0, or -1 for a bad format/K/path.
int kvs_linear_quant(const void* x, int64_t xs, int64_t rows, int64_t K, int x_dtype,
                     const uint8_t* w, int fmt, int64_t n, const float* bias, void* out,
                     int64_t os, int out_dtype, int path, int threads) {
  Call c;
  if (prepare_call(x, xs, rows, K, x_dtype, w, fmt, n, bias, out, os, out_dtype, path, threads,
                   &c) != 0) {
    return -1;
  }
  if (rows == 0 || n == 0) return 0;
  const QuantAct a = quantize_activations(x, xs, rows, K, x_dtype, c.threads, c.path != 1);
  run_call(c, a, false);
  return 0;
}

// out[rows, n/2] = silu(g) * u where [g | u] = x @ W^T + bias (n = 2I columns, gate rows
// first, as a fused gate_up weight; I a multiple of 16): the linear and kvs_silu_mul in
// one pass, each gate panel next to its up panel, the product rounded as the two calls
// round it (g and u to out_dtype, then kvs_silu_mul's arithmetic). Arguments as
// kvs_linear_quant; out row stride os. Returns 0, or -1 for a bad format/K/path/n.
int kvs_linear_quant_silu_mul(const void* x, int64_t xs, int64_t rows, int64_t K, int x_dtype,
                              const uint8_t* w, int fmt, int64_t n, const float* bias,
                              void* out, int64_t os, int out_dtype, int path, int threads) {
  Call c;
  if (n % (2 * kCols) != 0 ||
      prepare_call(x, xs, rows, K, x_dtype, w, fmt, n, bias, out, os, out_dtype, path, threads,
                   &c) != 0) {
    return -1;
  }
  if (rows == 0 || n == 0) return 0;
  const QuantAct a = quantize_activations(x, xs, rows, K, x_dtype, c.threads, c.path != 1);
  run_call(c, a, true);
  return 0;
}

// out[t, :] = row ids[t] of W (the [n, K] matrix of the panels), dequantized:
// d * (u - zero) or d * u + m in fp32, stored as out_dtype (0 fp32, 1 bf16), row
// stride K. Rule: every id in [0, n). Returns 0, or -1 for a bad format/K.
int kvs_quant_embed(const uint8_t* w, int fmt, int64_t n, int64_t K, const int64_t* ids,
                    int64_t count, void* out, int out_dtype, int threads) {
  Format f;
  if (!format_of(fmt, &f) || K % kBlock != 0) return -1;
  (void)n;
  const int64_t nb = K / kBlock;
  const int64_t bb = block_bytes(f);
#pragma omp parallel for num_threads(threads) schedule(static) if (count >= 8)
  for (int64_t t = 0; t < count; ++t) {
    const int64_t id = ids[t];
    const int64_t p = id / kCols;
    const int col = static_cast<int>(id % kCols);
    const uint8_t* wp = w + p * nb * bb;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wp + b * bb;
      const uint16_t* dh = reinterpret_cast<const uint16_t*>(blk + f.bits * 64);
      const float d = half_to_float(dh[col]);
      const float m = f.has_min ? half_to_float(dh[16 + col]) : 0.0f;
      for (int j = 0; j < kBlock; ++j) {
        const int u = weight_u(blk, f.bits, col, j);
        const float v = f.has_min ? d * static_cast<float>(u) + m
                                  : d * static_cast<float>(u - f.zero);
        const int64_t o = t * K + b * kBlock + j;
        if (out_dtype == 0) {
          static_cast<float*>(out)[o] = v;
        } else {
          kvs::from_f32(v, static_cast<kvs::bf16_t*>(out) + o);
        }
      }
    }
  }
  return 0;
}

}  // extern "C"
