// Paged attention over an 8-bit KV cache (int8 or fp8 e4m3), read where it lies.
//
// Plain C ABI, loaded with ctypes by kvserve/model/kernels_kv8.py.
//
// Layout (see kvserve/model/kernels_kv8.py):
//   kv:   uint8 [2, Hk, num_blocks, block_size, D + 4]   ([0] = K, [1] = V)
//         each token row of a head: D codes, then its fp32 scale (native byte order)
//   fmt:  0 = int8   (x = code * scale, code in [-127, 127], scale = amax / 127)
//         1 = fp8 e4m3fn (x = e4m3(code) * scale, scale = amax / 448)
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
// Two paths: AVX-512 (head_dim 32/64/128) and a portable scalar reference; `isa`
// 0 = best available, 1 = portable.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "kvs_common.h"

namespace {

using kvs::bf16_t;
using kvs::from_f32;
using kvs::to_f32;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kPart = 512;  // keys per softmax pass at most (absolute boundaries)

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

template <typename T>
void write_rows(const T* k, const T* v, int64_t row_stride, int64_t rows, int Hk, int D,
                uint8_t* kv, int64_t num_slots, const int64_t* slots, int fmt, int nthreads) {
  const int64_t rb = D + 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 64)
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    for (int kvi = 0; kvi < 2; ++kvi)
      for (int h = 0; h < Hk; ++h) {
        const T* src = (kvi == 0 ? k : v) + t * row_stride + static_cast<int64_t>(h) * D;
        uint8_t* dst = kv + ((static_cast<int64_t>(kvi) * Hk + h) * num_slots + slot) * rb;
        float amax = 0.f;
        for (int i = 0; i < D; ++i) amax = std::max(amax, std::fabs(to_f32(src[i])));
        const float scale = amax / (fmt == 0 ? 127.f : 448.f);
        for (int i = 0; i < D; ++i) {
          const float y = scale > 0.f ? to_f32(src[i]) / scale : 0.f;
          if (fmt == 0) {
            const float r = std::min(127.f, std::max(-127.f, std::nearbyint(y)));
            dst[i] = static_cast<uint8_t>(static_cast<int8_t>(r));
          } else {
            dst[i] = fp8_encode(y);
          }
        }
        std::memcpy(dst + D, &scale, 4);
      }
  }
}

// ------------------------------------------------------------------ attention

struct Args {
  const void* q;
  int64_t q_row_stride, q_head_stride;
  void* out;
  const uint8_t* kv;
  int64_t num_blocks;
  int block_size, num_heads, num_kv_heads, head_dim;
  const int64_t* seqs;
  const int64_t* block_tables;
  int64_t max_blocks;
  int seg;
  float scale;
  float* lse;
  const int64_t* row_map;
  int merge;
};

struct Task {
  int64_t seq, r0, r1;
  int kvh;
};

inline int64_t batch_row(const Args& a, int64_t i) { return a.row_map ? a.row_map[i] : i; }

// end of the part that starts at p0: the next absolute boundary (segment, kPart) or lmax
inline int64_t part_end(const Args& a, int64_t p0, int64_t lmax) {
  int64_t p1 = std::min<int64_t>(lmax, (p0 / kPart + 1) * kPart);
  if (a.seg > 0) p1 = std::min<int64_t>(p1, (p0 / a.seg + 1) * a.seg);
  return p1;
}

inline void finish_row(const Args& a, int64_t row, int64_t head, float mx, float l, float& w_old,
                       float& w_acc) {
  const float mine = l > 0.f ? mx + std::log(l) : kNegInf;
  float lse_new = mine;
  w_old = 0.f;
  w_acc = l > 0.f ? 1.f / l : 0.f;
  if (a.merge && a.lse[row * a.num_heads + head] != kNegInf) {
    const float old = a.lse[row * a.num_heads + head];
    lse_new = std::max(old, mine) + std::log1p(std::exp(-std::fabs(old - mine)));
    w_old = std::exp(old - lse_new);
    w_acc *= mine == kNegInf ? 0.f : std::exp(mine - lse_new);
  }
  if (a.lse) a.lse[row * a.num_heads + head] = lse_new;
}

template <typename T>
struct View {
  int D, bs, g;
  int64_t rb, row_start, num_tokens, ctx, prior_only, r_end;
  int M;
  const int64_t* bt;
  const T* q;
  T* out;
  const uint8_t* kbase;
  const uint8_t* vbase;

  View(const Args& a, const Task& task) {
    D = a.head_dim;
    bs = a.block_size;
    g = a.num_heads / a.num_kv_heads;
    rb = D + 4;
    const int64_t* s = a.seqs + 5 * task.seq;
    row_start = s[0];
    num_tokens = s[2];
    ctx = s[3];
    prior_only = s[4];
    bt = a.block_tables + a.max_blocks * task.seq;
    q = static_cast<const T*>(a.q);
    out = static_cast<T*>(a.out);
    const int64_t head_bytes = a.num_blocks * bs * rb;
    kbase = a.kv + static_cast<int64_t>(task.kvh) * head_bytes;
    vbase = a.kv + (static_cast<int64_t>(a.num_kv_heads) + task.kvh) * head_bytes;
    r_end = std::min<int64_t>(task.r1, num_tokens);
    M = static_cast<int>(std::max<int64_t>(0, r_end - task.r0)) * g;
    for (int64_t r = std::max(task.r0, num_tokens); r < task.r1; ++r)
      for (int j = 0; j < g; ++j) {
        T* o = out + batch_row(a, row_start + r) * a.num_heads * D + (task.kvh * g + j) * D;
        for (int i = 0; i < D; ++i) from_f32(0.f, o + i);
      }
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

inline __m512 hsum16(const __m512* v) {
  __m512 t[8], w[4], z[2];
  for (int j = 0; j < 8; ++j)
    t[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                         _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j)
    w[j] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int j = 0; j < 2; ++j)
    z[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

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
      for (int i = 0; i < nk; ++i) {
        const uint8_t* k = kr + i * v.rb;
        for (int dv = 0; dv < DV; ++dv) _mm512_storeu_ps(kw + i * D + 16 * dv, widen16<FMT>(k + 16 * dv));
        ks[g0 - p0 + i] = row_scale(k, D) * code_scale * a.scale;
        vs[g0 - p0 + i] = row_scale(vr + i * v.rb, D) * code_scale;
        _mm_prefetch(reinterpret_cast<const char*>(vr + i * v.rb), _MM_HINT_T1);
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
          __m512 part[16];
          for (int i = 0; i < 16; ++i) {
            if (i >= nk) {
              part[i] = _mm512_setzero_ps();
              continue;
            }
            const float* k = kw + i * D;
            __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
            for (int dv = 1; dv < DV; ++dv) s = _mm512_fmadd_ps(qv[dv], _mm512_loadu_ps(k + 16 * dv), s);
            part[i] = s;
          }
          x = _mm512_mul_ps(hsum16(part), ksv);
        }
        _mm512_mask_storeu_ps(sc + m * PS + (g0 - p0), in_part, _mm512_mask_blend_ps(valid, neg_inf, x));
      }
      g0 += nk;
    }
    // 2. exact softmax of the part per query, merged into (max, sum, acc)
    for (int m = 0; m < m_hi; ++m) {
      float* row = sc + m * PS;
      __m512 vmax = neg_inf;
      for (int j = 0; j < n; j += 16) {
        const __mmask16 k = static_cast<__mmask16>(n - j >= 16 ? 0xffffu : (1u << (n - j)) - 1u);
        vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(neg_inf, k, row + j));
      }
      const float m_new = std::max(mx[m], _mm512_reduce_max_ps(vmax));
      const float corr = mx[m] == kNegInf ? 0.f : std::exp(mx[m] - m_new);
      const __m512 mn = _mm512_set1_ps(m_new);
      __m512 vsum = _mm512_setzero_ps();
      for (int j = 0; j < n; j += 16) {
        const __mmask16 k = static_cast<__mmask16>(n - j >= 16 ? 0xffffu : (1u << (n - j)) - 1u);
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

template <typename T, int FMT>
void dispatch(const Args& a, const Task& t, std::vector<float>& buf, int isa) {
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
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows = a.seqs[5 * s + 1];
    for (int64_t r0 = 0; r0 < rows; r0 += row_tile)
      for (int h = 0; h < a.num_kv_heads; ++h)
        tasks.push_back(Task{s, r0, std::min<int64_t>(r0 + row_tile, rows), h});
  }
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
                  int nthreads) {
  if (fmt != 0 && fmt != 1) return 1;
  auto* dst = static_cast<uint8_t*>(kv);
  if (dtype == 0) {
    write_rows<float>(static_cast<const float*>(k), static_cast<const float*>(v), row_stride, rows,
                      Hk, D, dst, num_slots, slots, fmt, nthreads);
  } else if (dtype == 1) {
    write_rows<bf16_t>(static_cast<const bf16_t*>(k), static_cast<const bf16_t*>(v), row_stride,
                       rows, Hk, D, dst, num_slots, slots, fmt, nthreads);
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

int kvs_kv8_avx512() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}
}
