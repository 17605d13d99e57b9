// Paged attention over an 8-bit KV cache (int8 or fp8 e4m3), read where it lies.
//
// Plain C ABI, loaded with ctypes by kvserve/model/kernels/kv8.py.
//
// Layout (see kvserve/model/kernels/kv8.py):
//   kv:   [2, Hk, num_blocks, block_size, D + 4] bytes ([0] = K, [1] = V); the bytes
//         of one (K|V, head, block) are a page of block_size * (D + 4) bytes.
//   fmt 1 = fp8 e4m3fn (x = e4m3(code) * scale, scale = amax / 448), row layout: token
//         row t of the page is D codes then its fp32 scale.
//   fmt 0 = int8 (x = code * scale, code in [-127, 127], scale = amax / 127), page
//         layout made for AVX512-VNNI: codes first, then the block_size fp32 scales
//         (scale of token t at byte block_size * D + 4 t); K code (t, d) at byte
//         (d / 4) * 4 bs + 4 t + d % 4 (16 tokens x 4 dims = one 64-byte vector);
//         V code (t, d) at (t / 2) * 2 D + 2 d + t % 2 (token pairs interleaved; row
//         layout t * D + d when block_size is odd).
//   q, out, lse, seqs, block_tables, row_map, merge: the contract of
//         kvs_paged_attention in paged_attention.cpp (q/out float32 or bfloat16).
//
// Query row j of a sequence attends to keys [0, cached_seq_len + j] (prior_only = 1:
// [0, cached_seq_len)); every key is read from the cache (the caller writes the step's
// K/V first with kvs_kv8_write). The keys are walked in parts whose boundaries are
// absolute positions (multiples of `seg` when seg > 0 and of kPart), never the
// chunk's cached_seq_len, so a row's result depends only on its position and the keys
// it sees: not on the other rows of the call, nor on how its prompt was chunked.
// Parts merge with the exact online-softmax rule.
//
// int8 arithmetic (both paths, so they agree up to float rounding): each query row is
// quantized to int8 with its own scale (amax / 127) and Q.K is an exact integer dot
// product; each part's P.V weights (probability x V scale) are quantized to int16
// against the part's largest weight (w * (16383 / max)) and P.V is an exact integer sum,
// rescaled into the fp32 accumulator once per part. fp8 runs fp32 arithmetic on the
// decoded values.
//
// Two paths: AVX-512 (head_dim 32/64/128; int8 also needs AVX512-VNNI and block_size
// a multiple of 16) and a portable scalar reference; `isa` 0 = best, 1 = portable.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "kvs_common.h"
#include "paged_walk.h"

namespace {

using kvs::bf16_t;
using kvs::from_f32;
using kvs::to_f32;

using namespace kvs::walk;  // csrc/paged_walk.h
constexpr int64_t kPart = kvs::walk::kPartMax;  // keys per softmax pass at most
// Pages (K and V of one block) are prefetched into L2 (_MM_HINT_T1) this many blocks
// ahead of the key walk, as one unbroken stream over the task's keys (across parts,
// from its first block). L1 hints (_MM_HINT_T0) keep fewer misses in flight: on Zen 5
// (1 thread, scattered 1 KB pages on huge pages) a plain read reached ~9 GB/s with L1
// hints and ~13-14 GB/s with L2 hints; 2 or 8 blocks ahead measured no better than 4.
constexpr int64_t kPrefetchBlocks = 4;

// ------------------------------------------------------------------ 8-bit codecs

inline float fp8_decode(uint8_t c) {
  const int e = (c >> 3) & 0xf, m = c & 7;
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                           : std::ldexp(1.f + static_cast<float>(m) / 8.f, e - 7);
  return (c & 0x80) ? -mag : mag;
}

// round to nearest even, saturating at 448 (e4m3fn has no infinity)
inline uint8_t fp8_encode(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  float a = std::fabs(x);
  if (!(a <= 448.f)) a = 448.f;  // NaN saturates too (never produced by the writer)
  if (a < 0.015625f) {           // below 2^-6: subnormals in steps of 2^-9 (8 = 2^-6)
    return static_cast<uint8_t>(sign | static_cast<int>(std::nearbyint(a * 512.f)));
  }
  int e2;
  const float f = std::frexp(a, &e2);  // a = f * 2^e2, f in [0.5, 1)
  int ex = e2 - 1;
  int q = static_cast<int>(std::nearbyint((2.f * f - 1.f) * 8.f));
  if (q == 8) {
    q = 0;
    ++ex;
  }
  return static_cast<uint8_t>(sign | ((ex + 7) << 3) | q);
}

struct Lut {
  float v[256];
  Lut() {
    for (int i = 0; i < 256; ++i) v[i] = fp8_decode(static_cast<uint8_t>(i));
  }
};
const Lut kFp8Lut;

template <int FMT>
inline float decode(uint8_t c) {
  if constexpr (FMT == 0) return static_cast<float>(static_cast<int8_t>(c));
  return kFp8Lut.v[c];
}

inline float row_scale(const uint8_t* row, int D) {
  float s;
  std::memcpy(&s, row + D, 4);
  return s;
}

// ------------------------------------------------------------------ cache writes

// int8 page offsets of code (t, d) (see the top of the file)
inline int64_t k_off(int64_t t, int d, int64_t bs) { return (d / 4) * 4 * bs + 4 * t + d % 4; }
inline int64_t v_off(int64_t t, int d, int64_t bs, int D) {
  return bs % 2 ? t * D + d : (t / 2) * 2 * D + 2 * d + t % 2;
}

template <typename T>
void write_rows(const T* k, const T* v, int64_t row_stride, int64_t rows, int Hk, int D,
                uint8_t* kv, int64_t num_slots, const int64_t* slots, int fmt, int bs,
                int nthreads) {
  const int64_t rb = D + 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 64)
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    for (int kvi = 0; kvi < 2; ++kvi)
      for (int h = 0; h < Hk; ++h) {
        const T* src = (kvi == 0 ? k : v) + t * row_stride + static_cast<int64_t>(h) * D;
        float amax = 0.f;
        for (int i = 0; i < D; ++i) amax = std::max(amax, std::fabs(to_f32(src[i])));
        const float scale = amax / (fmt == 0 ? 127.f : 448.f);
        if (fmt == 0) {
          const int64_t b = slot / bs, t = slot % bs;
          uint8_t* page = kv + ((static_cast<int64_t>(kvi) * Hk + h) * (num_slots / bs) + b) * bs * rb;
          for (int i = 0; i < D; ++i) {
            const float y = scale > 0.f ? to_f32(src[i]) / scale : 0.f;
            const float r = std::min(127.f, std::max(-127.f, std::nearbyint(y)));
            page[kvi == 0 ? k_off(t, i, bs) : v_off(t, i, bs, D)] =
                static_cast<uint8_t>(static_cast<int8_t>(r));
          }
          std::memcpy(page + bs * D + 4 * t, &scale, 4);
          continue;
        }
        uint8_t* dst = kv + ((static_cast<int64_t>(kvi) * Hk + h) * num_slots + slot) * rb;
        for (int i = 0; i < D; ++i) dst[i] = fp8_encode(scale > 0.f ? to_f32(src[i]) / scale : 0.f);
        std::memcpy(dst + D, &scale, 4);
      }
  }
}

// ------------------------------------------------------------------ attention

// end of the part that starts at p0: the next absolute boundary (kvs::walk::part_end) or lmax
inline int64_t part_end(const Args& a, int64_t p0, int64_t lmax) {
  return std::min<int64_t>(lmax, kvs::walk::part_end(a.seg, p0));
}

// What every task reads (kvs::walk::TaskRows) and its K/V page bases (rb bytes a row).
template <typename T>
struct View : kvs::walk::TaskRows<T> {
  using Rows = kvs::walk::TaskRows<T>;
  using Rows::bs;
  using Rows::bt;
  using Rows::D;
  using Rows::g;
  using Rows::out;
  using Rows::q;
  using Rows::row_start;
  int64_t rb;
  const uint8_t* kbase;
  const uint8_t* vbase;

  View(const Args& a, const Task& task) : kvs::walk::TaskRows<T>(a, task) {
    rb = a.head_dim + 4;
    const uint8_t* kv = static_cast<const uint8_t*>(a.kv);
    const int64_t head_bytes = a.num_blocks * bs * rb;
    kbase = kv + static_cast<int64_t>(task.kvh) * head_bytes;
    vbase = kv + (static_cast<int64_t>(a.num_kv_heads) + task.kvh) * head_bytes;
  }
  // the cache row of position t (K or V base)
  const uint8_t* row(const uint8_t* base, int64_t t) const {
    return base + (bt[t / bs] * bs + t % bs) * rb;
  }
  const T* qrow(const Args& a, int64_t r, int j, int kvh) const {
    return q + batch_row(a, row_start + r) * a.q_row_stride + (kvh * g + j) * a.q_head_stride;
  }
  void write_out(const Args& a, int64_t r, int j, int kvh, float mx, float l, const float* acc) const {
    const int64_t head = kvh * g + j, orow = batch_row(a, row_start + r);
    float w_old, w_acc;
    finish_row(a, orow, head, mx, l, w_old, w_acc);
    T* o = out + orow * a.num_heads * D + head * D;
    for (int d = 0; d < D; ++d)
      from_f32((w_old != 0.f ? to_f32(o[d]) * w_old : 0.f) + acc[d] * w_acc, o + d);
  }
};

#if defined(__AVX512F__)
// The prefetch stream of a task: K and V pages of blocks [next, end) into L2.
struct PageStream {
  const uint8_t* kbase;
  const uint8_t* vbase;
  const int64_t* bt;
  int64_t page, bs, lmax, next = 0;
  void to(int64_t end_block) {
    for (; next < end_block && next * bs < lmax; ++next) {
      const char* kn = reinterpret_cast<const char*>(kbase + bt[next] * page);
      const char* vn = reinterpret_cast<const char*>(vbase + bt[next] * page);
      for (int64_t b = 0; b < page; b += 64) {
        _mm_prefetch(kn + b, _MM_HINT_T1);
        _mm_prefetch(vn + b, _MM_HINT_T1);
      }
    }
  }
};
#endif

// Portable reference: one query at a time, keys one at a time within each part.
template <typename T, int FMT>
void run_task_ref(const Args& a, const Task& task, std::vector<float>& buf) {
  const View<T> v(a, task);
  if (v.M == 0) return;
  const int D = v.D;
  const size_t need = static_cast<size_t>(3 * D + kPart);
  if (buf.size() < need) buf.resize(need);
  float* qf = buf.data();
  float* acc = qf + D;
  float* kf = acc + D;
  float* sc = kf + D;
  for (int64_t r = task.r0; r < v.r_end; ++r)
    for (int j = 0; j < v.g; ++j) {
      const T* qr = v.qrow(a, r, j, task.kvh);
      for (int i = 0; i < D; ++i) qf[i] = to_f32(qr[i]);
      std::fill(acc, acc + D, 0.f);
      float mx = kNegInf, l = 0.f;
      const int64_t lim = v.prior_only ? v.ctx : v.ctx + r + 1;
      for (int64_t p0 = 0; p0 < lim;) {
        const int64_t p1 = part_end(a, p0, lim);
        float bm = kNegInf;
        for (int64_t t = p0; t < p1; ++t) {
          const uint8_t* kr = v.row(v.kbase, t);
          float s = 0.f;
          for (int i = 0; i < D; ++i) s += qf[i] * decode<FMT>(kr[i]);
          s = s * row_scale(kr, D) * a.scale;
          sc[t - p0] = s;
          bm = std::max(bm, s);
        }
        const float m_new = std::max(mx, bm);
        const float corr = mx == kNegInf ? 0.f : std::exp(mx - m_new);
        float sum = 0.f;
        for (int64_t t = p0; t < p1; ++t) {
          const float e = std::exp(sc[t - p0] - m_new);
          sc[t - p0] = e;
          sum += e;
        }
        l = l * corr + sum;
        mx = m_new;
        for (int d = 0; d < D; ++d) acc[d] *= corr;
        for (int64_t t = p0; t < p1; ++t) {
          const uint8_t* vr = v.row(v.vbase, t);
          const float w = sc[t - p0] * row_scale(vr, D);
          for (int d = 0; d < D; ++d) acc[d] += w * decode<FMT>(vr[d]);
        }
        p0 = p1;
      }
      v.write_out(a, r, j, task.kvh, mx, l, acc);
    }
}

#if defined(__AVX512F__)
// 16 codes -> 16 floats (fp8: times 2^-8, folded into the row scale by the caller)
template <int FMT>
inline __m512 widen16(const uint8_t* p) {
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (FMT == 0) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
  } else {
    // e4m3 bits moved into fp16 positions: fp16(x) = e4m3(x) * 2^-8 for every code
    const __m256i x = _mm256_cvtepu8_epi16(c);
    const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), 7);
    const __m256i sgn = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8);
    return _mm512_cvtph_ps(_mm256_or_si256(mag, sgn));
  }
}
template <int FMT>
constexpr float kCodeScale = FMT == 0 ? 1.f : 256.f;

// AVX-512: a part's keys are widened 16 at a time (once for all g * rows queries of
// the task), scores of 16 keys become one vector, the softmax pass is vectorized, and
// P.V widens each V row once for up to 4 queries.
template <typename T, int FMT, int DV>
void run_task_avx512(const Args& a, const Task& task, std::vector<float>& buf) {
  constexpr int D = 16 * DV;
  constexpr int64_t PS = kPart + 16;
  constexpr int MB = 4;
  const View<T> v(a, task);
  const int M = v.M;
  if (M == 0) return;
  const size_t need = static_cast<size_t>(M) * (2 * D + PS + 4) + 16 * D + 2 * PS;
  if (buf.size() < need) buf.resize(need);
  float* qf = buf.data();
  float* acc = qf + M * D;
  float* sc = acc + M * D;
  float* mx = sc + M * PS;
  float* l = mx + M;
  int64_t* lim = reinterpret_cast<int64_t*>(l + M);
  float* kw = reinterpret_cast<float*>(lim + M);  // [16, D] widened K rows
  float* ks = kw + 16 * D;                        // [PS] K row scales of the part
  float* vs = ks + PS;                            // [PS] V row scales of the part

  int64_t lmax = 0;
  for (int64_t r = task.r0; r < v.r_end; ++r)
    for (int j = 0; j < v.g; ++j) {
      const int m = static_cast<int>(r - task.r0) * v.g + j;
      const T* qr = v.qrow(a, r, j, task.kvh);
      for (int i = 0; i < D; ++i) qf[m * D + i] = to_f32(qr[i]);
      std::fill(acc + m * D, acc + (m + 1) * D, 0.f);
      mx[m] = kNegInf;
      l[m] = 0.f;
      lim[m] = v.prior_only ? v.ctx : v.ctx + r + 1;
      lmax = std::max(lmax, lim[m]);
    }
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  const float code_scale = kCodeScale<FMT>;
  PageStream pf{v.kbase, v.vbase, v.bt, v.bs * v.rb, v.bs, lmax};
  pf.to(kPrefetchBlocks);

  for (int64_t p0 = 0; p0 < lmax;) {
    const int64_t p1 = part_end(a, p0, lmax);
    const int n = static_cast<int>(p1 - p0);
    int m_hi = 0;
    for (int m = 0; m < M; ++m)
      if (lim[m] > p0) m_hi = m + 1;
    // 1. scores, 16 keys at a time (groups never cross a block: bs % 16 == 0 or
    //    the group is cut at the block end)
    for (int64_t g0 = p0; g0 < p1;) {
      const int64_t blk_end = (g0 / v.bs + 1) * v.bs;
      const int nk = static_cast<int>(std::min<int64_t>({16, p1 - g0, blk_end - g0}));
      const uint8_t* kr = v.row(v.kbase, g0);
      const uint8_t* vr = v.row(v.vbase, g0);
      if (g0 % v.bs == 0) pf.to(g0 / v.bs + 1 + kPrefetchBlocks);  // scattered blocks
      for (int i = 0; i < nk; ++i) {
        const uint8_t* k = kr + i * v.rb;
        for (int dv = 0; dv < DV; ++dv) _mm512_storeu_ps(kw + i * D + 16 * dv, widen16<FMT>(k + 16 * dv));
        ks[g0 - p0 + i] = row_scale(k, D) * code_scale * a.scale;
        vs[g0 - p0 + i] = row_scale(vr + i * v.rb, D) * code_scale;
      }
      const __mmask16 in_part = static_cast<__mmask16>((1u << nk) - 1u);
      const __m512 ksv = _mm512_maskz_loadu_ps(in_part, ks + (g0 - p0));
      for (int m = 0; m < m_hi; ++m) {
        const int64_t vis = lim[m] - g0;
        const __mmask16 valid =
            vis >= 16 ? in_part
                      : (vis <= 0 ? 0 : static_cast<__mmask16>(in_part & ((1u << vis) - 1u)));
        __m512 x = neg_inf;
        if (valid) {
          __m512 qv[DV];
          for (int dv = 0; dv < DV; ++dv) qv[dv] = _mm512_loadu_ps(qf + m * D + dv * 16);
          x = _mm512_mul_ps(scores16<DV>(qv, kw, nk), ksv);
        }
        _mm512_mask_storeu_ps(sc + m * PS + (g0 - p0), in_part, _mm512_mask_blend_ps(valid, neg_inf, x));
      }
      g0 += nk;
    }
    // 2. exact softmax of the part per query, merged into (max, sum, acc)
    for (int m = 0; m < m_hi; ++m) {
      float* row = sc + m * PS;
      const float m_new = std::max(mx[m], part_max(row, n));
      const float corr = mx[m] == kNegInf ? 0.f : std::exp(mx[m] - m_new);
      const __m512 mn = _mm512_set1_ps(m_new);
      __m512 vsum = _mm512_setzero_ps();
      for (int j = 0; j < n; j += 16) {
        const __mmask16 k = tail_mask16(n - j);
        const __m512 x = _mm512_mask_loadu_ps(neg_inf, k, row + j);
        const __mmask16 fin = _mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ);
        const __m512 e = _mm512_maskz_mov_ps(fin, kvs::exp512(_mm512_sub_ps(x, mn)));
        vsum = _mm512_add_ps(vsum, e);
        // the V row scale goes into the weight (after the sum)
        _mm512_storeu_ps(row + j, _mm512_mul_ps(e, _mm512_maskz_loadu_ps(k, vs + j)));
      }
      l[m] = l[m] * corr + _mm512_reduce_add_ps(vsum);
      mx[m] = m_new;
      if (corr != 1.f) {
        const __m512 cv = _mm512_set1_ps(corr);
        for (int dv = 0; dv < DV; ++dv)
          _mm512_storeu_ps(acc + m * D + dv * 16, _mm512_mul_ps(_mm512_loadu_ps(acc + m * D + dv * 16), cv));
      }
    }
    // 3. acc += P . V, each V row widened once per MB queries
    for (int m0 = 0; m0 < m_hi; m0 += MB) {
      const int mc = std::min(MB, m_hi - m0);
      __m512 av[MB][DV];
      for (int m = 0; m < mc; ++m)
        for (int dv = 0; dv < DV; ++dv) av[m][dv] = _mm512_loadu_ps(acc + (m0 + m) * D + dv * 16);
      for (int64_t t = p0; t < p1; ++t) {
        const uint8_t* vr = v.row(v.vbase, t);
        __m512 vv[DV];
        for (int dv = 0; dv < DV; ++dv) vv[dv] = widen16<FMT>(vr + 16 * dv);
        for (int m = 0; m < mc; ++m) {
          const __m512 w = _mm512_set1_ps(sc[(m0 + m) * PS + (t - p0)]);
          for (int dv = 0; dv < DV; ++dv) av[m][dv] = _mm512_fmadd_ps(w, vv[dv], av[m][dv]);
        }
      }
      for (int m = 0; m < mc; ++m)
        for (int dv = 0; dv < DV; ++dv) _mm512_storeu_ps(acc + (m0 + m) * D + dv * 16, av[m][dv]);
    }
    p0 = p1;
  }
  for (int64_t r = task.r0; r < v.r_end; ++r)
    for (int j = 0; j < v.g; ++j) {
      const int m = static_cast<int>(r - task.r0) * v.g + j;
      v.write_out(a, r, j, task.kvh, mx[m], l[m], acc + m * D);
    }
}
#endif  // __AVX512F__

// ------------------------------------------------------------------ int8 pages

// q row -> int8 codes with scale amax / 127 (0 when the row is zero) and their sum
template <typename T>
inline void quantize_query(const T* qr, int D, int8_t* q8, float& qs, int32_t& qsum) {
  float amax = 0.f;
  for (int i = 0; i < D; ++i) amax = std::max(amax, std::fabs(to_f32(qr[i])));
  qs = amax / 127.f;
  qsum = 0;
  for (int i = 0; i < D; ++i) {
    const float y = qs > 0.f ? to_f32(qr[i]) / qs : 0.f;
    q8[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(y))));
    qsum += q8[i];
  }
}

constexpr float kW16 = 16383.f;
// int16 P.V weights: part max -> 16383 (no int32 overflow)

inline float page_scale(const uint8_t* page, int64_t bs, int D, int64_t t) {
  float s;
  std::memcpy(&s, page + bs * D + 4 * t, 4);
  return s;
}

// Portable reference of the int8 arithmetic (see the top of the file).
template <typename T>
void run_task_ref_i8(const Args& a, const Task& task, std::vector<float>& buf) {
  const View<T> v(a, task);
  if (v.M == 0) return;
  const int D = v.D;
  const int64_t bs = v.bs, P = bs * v.rb;
  const size_t need = static_cast<size_t>(2 * D + 2 * kPart + D);
  if (buf.size() < need) buf.resize(need);
  float* acc = buf.data();
  float* sc = acc + D;
  int32_t* w16 = reinterpret_cast<int32_t*>(sc + kPart);
  int32_t* acci = w16 + kPart;
  int8_t* q8 = reinterpret_cast<int8_t*>(acci + D);
  for (int64_t r = task.r0; r < v.r_end; ++r)
    for (int j = 0; j < v.g; ++j) {
      float qs;
      int32_t qsum;
      quantize_query(v.qrow(a, r, j, task.kvh), D, q8, qs, qsum);
      const float qsc = qs * a.scale;
      std::fill(acc, acc + D, 0.f);
      float mx = kNegInf, l = 0.f;
      const int64_t lim = v.prior_only ? v.ctx : v.ctx + r + 1;
      for (int64_t p0 = 0; p0 < lim;) {
        const int64_t p1 = part_end(a, p0, lim);
        float bm = kNegInf;
        for (int64_t t = p0; t < p1; ++t) {
          const uint8_t* page = v.kbase + v.bt[t / bs] * P;
          const int64_t tb = t % bs;
          int32_t s = 0;
          for (int d = 0; d < D; ++d) s += static_cast<int8_t>(page[k_off(tb, d, bs)]) * q8[d];
          sc[t - p0] = static_cast<float>(s) * (page_scale(page, bs, D, tb) * qsc);
          bm = std::max(bm, sc[t - p0]);
        }
        const float m_new = std::max(mx, bm);
        const float corr = mx == kNegInf ? 0.f : std::exp(mx - m_new);
        float sum = 0.f, wmax = 0.f;
        for (int64_t t = p0; t < p1; ++t) {
          const float e = std::exp(sc[t - p0] - m_new);
          sum += e;
          const uint8_t* page = v.vbase + v.bt[t / bs] * P;
          sc[t - p0] = e * page_scale(page, bs, D, t % bs);
          wmax = std::max(wmax, sc[t - p0]);
        }
        l = l * corr + sum;
        mx = m_new;
        for (int d = 0; d < D; ++d) acc[d] *= corr;
        const float ws = wmax / kW16;
        if (ws > 0.f) {
          const float inv = 1.f / ws;
          for (int64_t t = p0; t < p1; ++t)
            w16[t - p0] = static_cast<int32_t>(std::nearbyint(sc[t - p0] * inv));
          std::fill(acci, acci + D, 0);
          for (int64_t t = p0; t < p1; ++t) {
            const uint8_t* page = v.vbase + v.bt[t / bs] * P;
            const int64_t tb = t % bs;
            for (int d = 0; d < D; ++d)
              acci[d] += w16[t - p0] * static_cast<int8_t>(page[v_off(tb, d, bs, D)]);
          }
          for (int d = 0; d < D; ++d) acc[d] += static_cast<float>(acci[d]) * ws;
        }
        p0 = p1;
      }
      v.write_out(a, r, j, task.kvh, mx, l, acc);
    }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KVS_KV8_VNNI 1
// Q.K of MC queries against 16 keys (one group of every 4 dims per 64-byte vector),
// exact int32 sums of (k + 128) * q.
template <int DV, int MC>
inline void qk_group(const uint8_t* kcodes, int64_t bs, const int8_t* q8, __m512i* acc) {
  constexpr int D = 16 * DV;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int m = 0; m < MC; ++m) acc[m] = _mm512_setzero_si512();
  for (int j = 0; j < D / 4; ++j) {
    const __m512i kv = _mm512_xor_si512(_mm512_loadu_si512(kcodes + j * 4 * bs), bias);
    for (int m = 0; m < MC; ++m) {
      int32_t qw;
      std::memcpy(&qw, q8 + m * D + 4 * j, 4);
      acc[m] = _mm512_dpbusd_epi32(acc[m], kv, _mm512_set1_epi32(qw));
    }
  }
}

// acci[m] += sum over key pairs of w16 pair x V pair for MC queries; vpages walks the
// part's blocks: pairs [c0, c1) of one block, codes at vp + (tb / 2) * 2D.
template <int DV, int MC>
inline void pv_block(const uint8_t* vp, int64_t tb0, int64_t n, const int16_t* w, int64_t ps,
                     __m512i (*acci)[DV]) {
  constexpr int D = 16 * DV;
  for (int64_t i = 0; i < n; i += 2) {
    const uint8_t* pr = vp + ((tb0 + i) / 2) * 2 * D;
    __m512i vv[DV];
    for (int dv = 0; dv < DV; ++dv)
      vv[dv] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pr + 32 * dv)));
    for (int m = 0; m < MC; ++m) {
      int32_t wp;
      std::memcpy(&wp, w + m * ps + i, 4);
      const __m512i wv = _mm512_set1_epi32(wp);
      for (int dv = 0; dv < DV; ++dv) acci[m][dv] = _mm512_dpwssd_epi32(acci[m][dv], vv[dv], wv);
    }
  }
}

// The int8 arithmetic on AVX512-VNNI: vpdpbusd for Q.K over 16 keys x 4 dims per
// instruction (no horizontal sums), vpdpwssd for P.V over key pairs.
template <typename T, int DV>
void run_task_i8_avx512(const Args& a, const Task& task, std::vector<float>& buf) {
  constexpr int D = 16 * DV;
  constexpr int64_t PS = kPart + 32;
  constexpr int MQ = 4;                   // queries per Q.K pass
  constexpr int MB = DV >= 8 ? 2 : 4;     // queries per P.V pass (accumulators in registers)
  const View<T> v(a, task);
  const int M = v.M;
  if (M == 0) return;
  const int64_t bs = v.bs, P = bs * v.rb;
  const int Mp = (M + MQ - 1) / MQ * MQ;  // padded: whole Q.K passes read zero queries
  const size_t need = static_cast<size_t>(Mp) * (D + PS + PS / 2 + 8 + D / 4) + 2 * PS + 64;
  if (buf.size() < need) buf.resize(need);
  float* acc = buf.data();                                     // [M, D]
  float* sc = acc + Mp * D;                                    // [M, PS]
  int16_t* w16 = reinterpret_cast<int16_t*>(sc + Mp * PS);     // [M, PS]
  float* mx = reinterpret_cast<float*>(w16 + Mp * PS);         // [M]
  float* l = mx + Mp;
  float* qsc = l + Mp;
  float* wsc = qsc + Mp;
  int32_t* qbias = reinterpret_cast<int32_t*>(wsc + Mp);       // 128 * sum(q8)
  int64_t* lim = reinterpret_cast<int64_t*>(qbias + Mp + (Mp & 1));
  float* vs = reinterpret_cast<float*>(lim + Mp);              // [PS] V scales of the part
  int8_t* q8 = reinterpret_cast<int8_t*>(vs + PS);             // [Mp, D]

  int64_t lmax = 0;
  std::memset(q8, 0, static_cast<size_t>(Mp) * D);
  for (int m = 0; m < Mp; ++m) {
    qbias[m] = 0;
    lim[m] = 0;
  }
  for (int64_t r = task.r0; r < v.r_end; ++r)
    for (int j = 0; j < v.g; ++j) {
      const int m = static_cast<int>(r - task.r0) * v.g + j;
      float qs;
      int32_t qsum;
      quantize_query(v.qrow(a, r, j, task.kvh), D, q8 + m * D, qs, qsum);
      qsc[m] = qs * a.scale;
      qbias[m] = 128 * qsum;
      std::fill(acc + m * D, acc + (m + 1) * D, 0.f);
      mx[m] = kNegInf;
      l[m] = 0.f;
      lim[m] = v.prior_only ? v.ctx : v.ctx + r + 1;
      lmax = std::max(lmax, lim[m]);
    }
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  PageStream pf{v.kbase, v.vbase, v.bt, P, bs, lmax};
  pf.to(kPrefetchBlocks);

  for (int64_t p0 = 0; p0 < lmax;) {
    const int64_t p1 = part_end(a, p0, lmax);
    const int n = static_cast<int>(p1 - p0);
    int m_hi = 0;
    for (int m = 0; m < M; ++m)
      if (lim[m] > p0) m_hi = m + 1;
    // 1. scores, 16 keys at a time (p0 and block starts are multiples of 16)
    for (int64_t g0 = p0; g0 < p1; g0 += 16) {
      const int nk = static_cast<int>(std::min<int64_t>(16, p1 - g0));
      const int64_t tb = g0 % bs;
      const uint8_t* kpage = v.kbase + v.bt[g0 / bs] * P;
      const uint8_t* vpage = v.vbase + v.bt[g0 / bs] * P;
      if (tb == 0) pf.to(g0 / bs + 1 + kPrefetchBlocks);  // scattered blocks
      const __mmask16 in_part = static_cast<__mmask16>((1u << nk) - 1u);
      const __m512 ksc = _mm512_maskz_loadu_ps(in_part, kpage + bs * D + 4 * tb);
      _mm512_storeu_ps(vs + (g0 - p0), _mm512_maskz_loadu_ps(in_part, vpage + bs * D + 4 * tb));
      for (int m0 = 0; m0 < m_hi; m0 += MQ) {
        __m512i s[MQ];
        const uint8_t* kc = kpage + 4 * tb;
        switch (std::min(MQ, m_hi - m0)) {  // unrolled per query count
          case 1: qk_group<DV, 1>(kc, bs, q8 + m0 * D, s); break;
          case 2: qk_group<DV, 2>(kc, bs, q8 + m0 * D, s); break;
          case 3: qk_group<DV, 3>(kc, bs, q8 + m0 * D, s); break;
          default: qk_group<DV, 4>(kc, bs, q8 + m0 * D, s); break;
        }
        for (int mm = 0; mm < MQ && m0 + mm < m_hi; ++mm) {
          const int m = m0 + mm;
          const int64_t vis = lim[m] - g0;
          const __mmask16 valid =
              vis >= 16 ? in_part
                        : (vis <= 0 ? 0 : static_cast<__mmask16>(in_part & ((1u << vis) - 1u)));
          const __m512 x = _mm512_mul_ps(
              _mm512_cvtepi32_ps(_mm512_sub_epi32(s[mm], _mm512_set1_epi32(qbias[m]))),
              _mm512_mul_ps(ksc, _mm512_set1_ps(qsc[m])));
          _mm512_mask_storeu_ps(sc + m * PS + (g0 - p0), in_part, _mm512_mask_blend_ps(valid, neg_inf, x));
        }
      }
    }
    // 2. exact softmax of the part per query; int16 weights (probability x V scale)
    for (int m = 0; m < m_hi; ++m) {
      float* row = sc + m * PS;
      const float m_new = std::max(mx[m], part_max(row, n));
      const float corr = mx[m] == kNegInf ? 0.f : std::exp(mx[m] - m_new);
      const __m512 mn = _mm512_set1_ps(m_new);
      __m512 vsum = _mm512_setzero_ps(), wmax = _mm512_setzero_ps();
      for (int j = 0; j < n; j += 16) {
        const __mmask16 k = tail_mask16(n - j);
        const __m512 x = _mm512_mask_loadu_ps(neg_inf, k, row + j);
        const __mmask16 fin = _mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ);
        const __m512 e = _mm512_maskz_mov_ps(fin, kvs::exp512(_mm512_sub_ps(x, mn)));
        vsum = _mm512_add_ps(vsum, e);
        const __m512 w = _mm512_mul_ps(e, _mm512_maskz_loadu_ps(k, vs + j));
        _mm512_storeu_ps(row + j, w);
        wmax = _mm512_max_ps(wmax, w);
      }
      l[m] = l[m] * corr + _mm512_reduce_add_ps(vsum);
      mx[m] = m_new;
      const float ws = _mm512_reduce_max_ps(wmax) / kW16;
      wsc[m] = ws;
      int16_t* wr = w16 + m * PS;
      const __m512 wsv = _mm512_set1_ps(ws > 0.f ? 1.f / ws : 0.f);
      for (int j = 0; j < n; j += 16) {
        const __mmask16 k = tail_mask16(n - j);
        const __m512i q = _mm512_maskz_cvtps_epi32(k, _mm512_mul_ps(_mm512_loadu_ps(row + j), wsv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(wr + j), _mm512_cvtepi32_epi16(q));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wr + (n + 15) / 16 * 16), _mm256_setzero_si256());
      if (corr != 1.f) {
        const __m512 cv = _mm512_set1_ps(corr);
        for (int dv = 0; dv < DV; ++dv)
          _mm512_storeu_ps(acc + m * D + dv * 16, _mm512_mul_ps(_mm512_loadu_ps(acc + m * D + dv * 16), cv));
      }
    }
    // 3. acc += ws * (int16 weights . int8 V), exact int32 sums over the part
    for (int m0 = 0; m0 < m_hi; m0 += MB) {
      const int mc = std::min(MB, m_hi - m0);
      __m512i acci[MB][DV];
      for (int m = 0; m < MB; ++m)
        for (int dv = 0; dv < DV; ++dv) acci[m][dv] = _mm512_setzero_si512();
      for (int64_t c0 = p0; c0 < p1;) {
        const int64_t c1 = std::min<int64_t>(p1, (c0 / bs + 1) * bs);
        const uint8_t* vp = v.vbase + v.bt[c0 / bs] * P;
        const int16_t* w = w16 + m0 * PS + (c0 - p0);
        // one V widening for all mc queries (unrolled per count: registers)
        switch (mc) {
          case 1: pv_block<DV, 1>(vp, c0 % bs, c1 - c0, w, PS, acci); break;
          case 2: pv_block<DV, 2>(vp, c0 % bs, c1 - c0, w, PS, acci); break;
          case 3:
            if constexpr (MB >= 3) pv_block<DV, 3>(vp, c0 % bs, c1 - c0, w, PS, acci);
            break;
          default:
            if constexpr (MB >= 4) pv_block<DV, 4>(vp, c0 % bs, c1 - c0, w, PS, acci);
            break;
        }
        c0 = c1;
      }
      for (int mm = 0; mm < mc; ++mm) {
        const int m = m0 + mm;
        if (!(wsc[m] > 0.f)) continue;
        const __m512 wsv = _mm512_set1_ps(wsc[m]);
        for (int dv = 0; dv < DV; ++dv) {
          float* am = acc + m * D + dv * 16;
          _mm512_storeu_ps(am, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acci[mm][dv]), wsv, _mm512_loadu_ps(am)));
        }
      }
    }
    p0 = p1;
  }
  for (int64_t r = task.r0; r < v.r_end; ++r)
    for (int j = 0; j < v.g; ++j) {
      const int m = static_cast<int>(r - task.r0) * v.g + j;
      v.write_out(a, r, j, task.kvh, mx[m], l[m], acc + m * D);
    }
}
#endif  // VNNI

template <typename T>
void dispatch_i8(const Args& a, const Task& t, std::vector<float>& buf, int isa) {
#if defined(KVS_KV8_VNNI)
  if (isa == 0 && a.block_size % 16 == 0 && (a.seg <= 0 || a.seg % 16 == 0)) {
    switch (a.head_dim) {
      case 32: return run_task_i8_avx512<T, 2>(a, t, buf);
      case 64: return run_task_i8_avx512<T, 4>(a, t, buf);
      case 128: return run_task_i8_avx512<T, 8>(a, t, buf);
      default: break;
    }
  }
#endif
  run_task_ref_i8<T>(a, t, buf);
}

template <typename T, int FMT>
void dispatch(const Args& a, const Task& t, std::vector<float>& buf, int isa) {
  if constexpr (FMT == 0) {
    return dispatch_i8<T>(a, t, buf, isa);
  }
#if defined(__AVX512F__)
  if (isa == 0) {
    switch (a.head_dim) {
      case 32: return run_task_avx512<T, FMT, 2>(a, t, buf);
      case 64: return run_task_avx512<T, FMT, 4>(a, t, buf);
      case 128: return run_task_avx512<T, FMT, 8>(a, t, buf);
      default: break;
    }
  }
#endif
  run_task_ref<T, FMT>(a, t, buf);
}

template <typename T, int FMT>
void run_all(const Args& a, int64_t num_seqs, int row_tile, int num_threads, int isa) {
  const std::vector<Task> tasks = make_tasks(a, num_seqs, row_tile);
  const int64_t n = static_cast<int64_t>(tasks.size());
  static thread_local std::vector<float> buf;
  if (num_threads <= 1 || n <= 1) {
    for (const Task& t : tasks) dispatch<T, FMT>(a, t, buf, isa);
    return;
  }
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) dispatch<T, FMT>(a, tasks[i], buf, isa);
  }
}

}  // namespace

extern "C" {

// Quantize K/V rows into their slots. k, v: [rows, Hk, D] rows `row_stride` elements
// apart (heads contiguous), dtype 0 = float32, 1 = bfloat16; kv: the layer's uint8
// cache with num_slots = num_blocks * block_size; slots [rows] int64, -1 = skip.
// Returns 0, or 1 for a bad dtype / fmt.
int kvs_kv8_write(const void* k, const void* v, int64_t row_stride, int64_t rows, int Hk, int D,
                  int dtype, void* kv, int64_t num_slots, const int64_t* slots, int fmt,
                  int block_size, int nthreads) {
  if (fmt != 0 && fmt != 1) return 1;
  auto* dst = static_cast<uint8_t*>(kv);
  if (dtype == 0) {
    write_rows<float>(static_cast<const float*>(k), static_cast<const float*>(v), row_stride, rows,
                      Hk, D, dst, num_slots, slots, fmt, block_size, nthreads);
  } else if (dtype == 1) {
    write_rows<bf16_t>(static_cast<const bf16_t*>(k), static_cast<const bf16_t*>(v), row_stride,
                       rows, Hk, D, dst, num_slots, slots, fmt, block_size, nthreads);
  } else {
    return 1;
  }
  return 0;
}

// Paged attention over the 8-bit cache: kvs_paged_attention's contract (see the top
// of this file for the differences). Returns 0, 1 for a bad dtype / fmt, 4 for merge
// without lse.
int kvs_kv8_attention(const void* q, int64_t q_row_stride, int64_t q_head_stride, void* out,
                      const void* kv, int64_t num_blocks, int block_size, int num_heads,
                      int num_kv_heads, int head_dim, const int64_t* seqs, int64_t num_seqs,
                      const int64_t* block_tables, int64_t max_blocks, int seg, float scale,
                      int dtype, int fmt, int isa, int row_tile, int num_threads, float* lse,
                      const int64_t* row_map, int merge) {
  if (merge && lse == nullptr) return 4;
  Args a{q,         q_row_stride, q_head_stride, out,          static_cast<const uint8_t*>(kv),
         num_blocks, block_size,  num_heads,     num_kv_heads, head_dim,
         seqs,      block_tables, max_blocks,    seg,          scale,
         lse,       row_map,      merge};
  if (dtype == 0 && fmt == 0) {
    run_all<float, 0>(a, num_seqs, row_tile, num_threads, isa);
  } else if (dtype == 0 && fmt == 1) {
    run_all<float, 1>(a, num_seqs, row_tile, num_threads, isa);
  } else if (dtype == 1 && fmt == 0) {
    run_all<bf16_t, 0>(a, num_seqs, row_tile, num_threads, isa);
  } else if (dtype == 1 && fmt == 1) {
    run_all<bf16_t, 1>(a, num_seqs, row_tile, num_threads, isa);
  } else {
    return 1;
  }
  return 0;
}

// bit 0: the fp8 AVX-512 path is built; bit 1: the int8 AVX512-VNNI path
int kvs_kv8_avx512() {
  int bits = 0;
#if defined(__AVX512F__)
  bits |= 1;
#endif
#if defined(KVS_KV8_VNNI)
  bits |= 2;
#endif
  return bits;
}
}
