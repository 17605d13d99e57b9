// Paged attention over kvserve's KV cache, read where it lies (no gather copy).
//
// Plain C ABI (loaded with ctypes by kvserve/model/kernels/paged_attention.py), so it builds in a
// second with any C++17 compiler and needs no PyTorch headers. OpenMP threads come
// from the libgomp that PyTorch already loaded (same soname), so there is one pool.
//
// Layout (see kvserve/model/attention.py):
//   kv:   [2, Hk, num_blocks, block_size, D]   ([0] = K, [1] = V), float32 or bfloat16
//   q:    [T, H, D] strided (row stride, head stride; the last dim contiguous)
//   out:  [T, H, D] contiguous, same dtype as q
//   seqs: [num_seqs, 5] int64 = (row_start, num_rows, num_tokens, cached_seq_len, prior_only)
//   lse:  [T, H] fp32 or null: log-sum-exp of each row's scaled scores (-inf: no key)
//   block_tables: [num_seqs, max_blocks] int64 (0 = null block)
//   row_map: [*] int64 or null: token j of a seq is batch row row_map[row_start + j]
//            (null: row_start + j), for q, out and lse alike
//   merge: out and lse already hold another part of the rows' attention (their
//          suffix, for a cascade group's shared prefix): merge into them exactly
//
// Query row j of a sequence (j < num_tokens) sits at position cached_seq_len + j and
// attends to keys [0, cached_seq_len + j] (its own KV was written before the call),
// or, with prior_only = 1, to the prior context [0, cached_seq_len) alone (the caller
// attends the new tokens among themselves and merges with the returned lse; a row
// with no key gets output 0 and lse -inf).
// Rows j >= num_tokens are padding: their output is zero. The keys are walked in
// parts at ABSOLUTE positions: [0, P), [P, 2P), ... with P = seg (seg <= 0: 512),
// further split at multiples of 512, each part bounded at the last key any row of the
// tile sees (rows see only keys below their own limit: the rest score -inf). The
// split points depend on seg alone, never on cached_seq_len, the tile or the batch,
// so a query row at position p gets bitwise the same result as a decode row at p,
// in any chunk, tile or batch (BATCH INVARIANCE, docs/determinism.md): keys past a
// row's limit give it probability 0, which leaves its max, sums and output
// unchanged. Each part's softmax is taken against the part's own max (its state:
// max, sum, P.V), and the parts are merged in order into the running state with the
// exact log-sum-exp rule (merge_part: both sides rescaled to the new max), so a part's
// state does not depend on the parts before it: where a few long rows leave threads
// idle, one row's parts run on several threads and are merged afterwards in the same
// order with the same arithmetic (run_all), bitwise the same as one thread's walk.
// A new decode specialisation must keep exactly this arithmetic per row (same parts,
// same 16-key groups from the block start, same sum order) or the invariance tests
// fail. (The portable run_task, the fallback without AVX-512, walks block by block
// with a running max: its own arithmetic, never mixed with the AVX-512 path's.)
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
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
#if defined(__AVX512F__)
using kvs::exp512;
using kvs::load16;
#endif

template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int d) {
#pragma omp simd
  for (int i = 0; i < d; ++i) dst[i] = to_f32(src[i]);
}

inline float dot(const float* __restrict a, const float* __restrict b, int d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

// exp(x) for x <= 0 (x = -inf gives 0): 2^n * e^r, |r| <= ln2/2, degree-7 Taylor
// polynomial; relative error < 2e-7 over the range. Written so the compiler
// vectorizes it inside `omp simd` loops.
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.4426950408889634f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

using namespace kvs::walk;  // csrc/paged_walk.h

// The key parts of a task: part k is [part_start(k), part_start(k + 1)) clipped at
// lmax, split points from part_end (absolute positions).
inline int64_t count_parts(int seg, int64_t lmax) {
  int64_t n = 0;
  for (int64_t p0 = 0; p0 < lmax; p0 = part_end(seg, p0)) ++n;
  return n;
}

// Keys a task sees (the walk's lmax): rows [r0, min(r1, num_tokens)) of its request.
inline int64_t task_keys(const Args& a, const Task& t) {
  const int64_t* s = a.seqs + 5 * t.seq;
  const int64_t r_end = std::min<int64_t>(t.r1, s[2]);
  if (r_end <= t.r0) return 0;
  return s[4] ? s[3] : s[3] + r_end;
}

// A unit of work a thread runs: a task's key parts from `part` on (all of them, or
// the one part of a split task). The thread's next unit is handed to the current one
// so that its last part's P.V pass prefetches the next unit's first K blocks: memory
// stays busy across task boundaries. Prefetches only: no result depends on them.
struct Work {
  const Task* task;
  int64_t part;
};

// What every task reads (kvs::walk::TaskRows) and its K/V base pointers.
template <typename T>
struct TaskView : kvs::walk::TaskRows<T> {
  const T* kbase;
  const T* vbase;

  TaskView(const Args& a, const Task& task) : kvs::walk::TaskRows<T>(a, task) {
    const T* kv = static_cast<const T*>(a.kv);
    const int64_t head_stride = a.num_blocks * this->bs * this->D;  // elements per (K|V, head)
    kbase = kv + static_cast<int64_t>(task.kvh) * head_stride;
    vbase = kv + (static_cast<int64_t>(a.num_kv_heads) + task.kvh) * head_stride;
  }
};

template <typename T>
void run_task(const Args& a, const Task& task, std::vector<float>& buf) {
  const TaskView<T> v(a, task);
  const int D = v.D, bs = v.bs, g = v.g, M = v.M;
  const int64_t row_start = v.row_start, ctx = v.ctx, prior_only = v.prior_only, r_end = v.r_end;
  const int64_t* bt = v.bt;
  const T *q = v.q, *kbase = v.kbase, *vbase = v.vbase;
  T* out = v.out;
  if (M == 0) return;

  const size_t need = static_cast<size_t>(M) * (2 * D + bs + 3) + 2 * D;
  if (buf.size() < need) buf.resize(need);
  float* qf = buf.data();          // [M, D] scaled queries
  float* acc = qf + M * D;         // [M, D]
  float* sc = acc + M * D;         // [M, bs] scores -> probabilities
  float* mx = sc + M * bs;         // [M]
  float* l = mx + M;               // [M]
  float* lim = l + M;              // [M] number of keys each query sees
  float* kf = lim + M;             // [D]
  float* vf = kf + D;              // [D]

  int64_t lmax = 0;
  for (int64_t r = task.r0; r < r_end; ++r)
    for (int j = 0; j < g; ++j) {
      const int m = static_cast<int>(r - task.r0) * g + j;
      const T* qr = q + batch_row(a, row_start + r) * a.q_row_stride + (task.kvh * g + j) * a.q_head_stride;
      for (int i = 0; i < D; ++i) qf[m * D + i] = to_f32(qr[i]) * a.scale;
      std::fill(acc + m * D, acc + (m + 1) * D, 0.f);
      mx[m] = kNegInf;
      l[m] = 0.f;
      const int64_t n = prior_only ? ctx : ctx + r + 1;
      lim[m] = static_cast<float>(n);
      lmax = std::max(lmax, n);
    }

  int64_t t0 = 0;
  while (t0 < lmax) {
    // end of this part: block boundary, segment boundary (prior context), lmax
    int64_t t1 = std::min<int64_t>((t0 / bs + 1) * bs, lmax);
    t1 = std::min(t1, part_end(a.seg, t0));  // absolute split points (see the top)
    const int nk = static_cast<int>(t1 - t0);
    const int64_t block = bt[t0 / bs];
    const int64_t off = (block * bs + t0 % bs) * D;
    const T* krow = kbase + off;
    const T* vrow = vbase + off;
    for (int i = 0; i < nk; ++i) {
      load_row(krow + static_cast<int64_t>(i) * D, kf, D);
      const float key_pos = static_cast<float>(t0 + i);
      for (int m = 0; m < M; ++m)
        sc[m * bs + i] = key_pos < lim[m] ? dot(qf + m * D, kf, D) : kNegInf;
    }
    for (int m = 0; m < M; ++m) {
      if (static_cast<float>(t0) >= lim[m]) {  // no key of this part is visible
        for (int i = 0; i < nk; ++i) sc[m * bs + i] = 0.f;
        continue;
      }
      float* p = sc + m * bs;
      float bm = kNegInf;
      for (int i = 0; i < nk; ++i) bm = std::max(bm, p[i]);
      const float m_new = std::max(mx[m], bm);
      const float corr = exp_nonpos(mx[m] - m_new);  // 0 when mx was -inf
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int i = 0; i < nk; ++i) {
        const float e = p[i] == kNegInf ? 0.f : exp_nonpos(p[i] - m_new);
        p[i] = e;
        sum += e;
      }
      l[m] = l[m] * corr + sum;
      mx[m] = m_new;
      if (corr != 1.f) {
        float* am = acc + m * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) am[d] *= corr;
      }
    }
    for (int i = 0; i < nk; ++i) {
      load_row(vrow + static_cast<int64_t>(i) * D, vf, D);
      for (int m = 0; m < M; ++m) {
        const float pv = sc[m * bs + i];
        if (pv == 0.f) continue;
        float* am = acc + m * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) am[d] += pv * vf[d];
      }
    }
    t0 = t1;
  }

  for (int64_t r = task.r0; r < r_end; ++r)
    for (int j = 0; j < g; ++j) {
      const int m = static_cast<int>(r - task.r0) * g + j;
      const int64_t head = task.kvh * g + j, row = batch_row(a, row_start + r);
      float w_old, w_acc;
      finish_row(a, row, head, mx[m], l[m], w_old, w_acc);
      T* o = out + row * a.num_heads * D + head * D;
      for (int d = 0; d < D; ++d)
        from_f32((w_old != 0.f ? to_f32(o[d]) * w_old : 0.f) + acc[m * D + d] * w_acc, o + d);
    }
}


#if defined(__AVX512F__)
// ---------------------------------------------------------------- AVX-512 path
// For head_dim = 16 * DV. Keys are taken 16 at a time: K converted once to fp32, the
// 16 dot products of a query become one vector (a transpose-add reduction), the
// softmax update runs on that vector, then V is accumulated with broadcast weights.

// bfloat16 K and V rows are widened to fp32 without a lane crossing: a 32-element bf16
// vector gives its even elements by a 16-bit left shift of each 32-bit lane and its odd
// ones by masking the low half. Rows are kept in that "split" order: slot (dv, lane)
// of a widened row holds head dim split_dim(dv, lane). Dot products do not care about
// the order (the queries are split the same way) and P.V accumulates in it, undone
// when the output is written. (vdpbf16ps would skip the widening, but it issues at
// about a quarter of the rate of fp32 FMAs on the CPUs this was measured on.)
inline int split_dim(int dv, int lane) { return 32 * (dv / 2) + 2 * lane + (dv % 2); }

// one bf16 row of D = 16 * DV elements -> DV fp32 vectors in split order
template <int DV>
inline void widen_split(const bf16_t* row, __m512* out) {
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int j = 0; j < DV / 2; ++j) {
    const __m512i x = _mm512_loadu_si512(row + 32 * j);
    out[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    out[2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, hi_mask));
  }
}

// acc[m] += sum_i p[m * ps + i] * V[i] for MC queries and V rows vrow[0..nk), fp32
// FMAs; bf16 rows are widened once per row for all MC queries, in split order.
template <typename T, int DV, int MC>
inline void accumulate_pv(float* acc, const float* p, int64_t ps, const T* vrow, int nk) {
  constexpr int D = 16 * DV;
  __m512 av[MC][DV];
  for (int m = 0; m < MC; ++m)
    for (int dv = 0; dv < DV; ++dv) av[m][dv] = _mm512_loadu_ps(acc + m * D + dv * 16);
  for (int i = 0; i < nk; ++i) {
    __m512 vv[DV];
    if constexpr (std::is_same_v<T, bf16_t>) {
      widen_split<DV>(vrow + i * D, vv);
    } else {
      for (int dv = 0; dv < DV; ++dv) vv[dv] = _mm512_loadu_ps(vrow + i * D + 16 * dv);
    }
    for (int m = 0; m < MC; ++m) {
      const __m512 w = _mm512_set1_ps(p[m * ps + i]);
      for (int dv = 0; dv < DV; ++dv) av[m][dv] = _mm512_fmadd_ps(w, vv[dv], av[m][dv]);
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int dv = 0; dv < DV; ++dv) _mm512_storeu_ps(acc + m * D + dv * 16, av[m][dv]);
}

// accumulate_pv for mcount (1-4) queries, unrolled per count so accumulators stay in
// registers
template <typename T, int DV>
inline void accumulate_pv_n(float* acc, const float* p, int64_t ps, int mcount, const T* vrow,
                            int nk) {
  switch (mcount) {
    case 1: return accumulate_pv<T, DV, 1>(acc, p, ps, vrow, nk);
    case 2: return accumulate_pv<T, DV, 2>(acc, p, ps, vrow, nk);
    case 3: return accumulate_pv<T, DV, 3>(acc, p, ps, vrow, nk);
    default: return accumulate_pv<T, DV, 4>(acc, p, ps, vrow, nk);
  }
}

#if defined(__AVX512BF16__)
// ------------------------------------------------- bfloat16 products with vdpbf16ps
// Where vdpbf16ps issues at the fp32 FMA rate (AMD Zen 5: measured 0.273 ns per zmm
// instruction for both with 10 independent chains, i.e. twice the FLOP rate), bf16 K
// and V are used as they lie: Q.K is a dot product over head-dim pairs (no widening),
// P.V a dot product over key pairs (two V rows interleaved by one permute per 16 dims,
// P rounded to bf16, the rounding the AMX kernel applies too). On Intel CPUs it issues
// at ~1/4 of the FMA rate and the widened fp32 path above stays (see kvs::use_bf16_dot,
// kvs_common.h).
typedef uint32_t u32a __attribute__((may_alias));

// One query's 16 partial dot products with bf16 keys krow[0..nk) (zero past nk).
template <int DV>
inline __m512 scores16_dp(const __m512bh* qb, const bf16_t* krow, int nk) {
  return scores16_of(nk, [&](int i) {
    const bf16_t* k = krow + i * 16 * DV;
    __m512 x = _mm512_setzero_ps();
    for (int j = 0; j < DV / 2; ++j)
      x = _mm512_dpbf16_ps(x, qb[j], (__m512bh)_mm512_loadu_si512(k + 32 * j));
    return x;
  });
}

// acc[m] += sum_i p[m * ps + i] * V[i] for MC queries, V rows vrow[0..nk) taken in
// pairs; pb: bf16 probabilities (one past nk readable; its V partner is zero).
template <int DV, int MC>
inline void accumulate_pv_dp(float* acc, const bf16_t* pb, int64_t ps, const bf16_t* vrow, int nk) {
  constexpr int D = 16 * DV;
  // lane 2n <- x[n], lane 2n + 1 <- y[n], for n in the low / high 16 of 32
  const __m512i idx_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                          40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                          32, 0);
  const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
  __m512 av[MC][DV];
  for (int m = 0; m < MC; ++m)
    for (int dv = 0; dv < DV; ++dv) av[m][dv] = _mm512_loadu_ps(acc + m * D + dv * 16);
  for (int i = 0; i < nk; i += 2) {
    __m512bh vv[DV];
    const bf16_t* x = vrow + i * D;
    for (int j = 0; j < DV / 2; ++j) {
      const __m512i xv = _mm512_loadu_si512(x + 32 * j);
      const __m512i yv = i + 1 < nk ? _mm512_loadu_si512(x + D + 32 * j) : _mm512_setzero_si512();
      vv[2 * j] = (__m512bh)_mm512_permutex2var_epi16(xv, idx_lo, yv);
      vv[2 * j + 1] = (__m512bh)_mm512_permutex2var_epi16(xv, idx_hi, yv);
    }
    for (int m = 0; m < MC; ++m) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(
          static_cast<int>(*reinterpret_cast<const u32a*>(pb + m * ps + i)));
      for (int dv = 0; dv < DV; ++dv) av[m][dv] = _mm512_dpbf16_ps(av[m][dv], w, vv[dv]);
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int dv = 0; dv < DV; ++dv) _mm512_storeu_ps(acc + m * D + dv * 16, av[m][dv]);
}

template <int DV>
inline void accumulate_pv_dp_n(float* acc, const bf16_t* pb, int64_t ps, int mcount,
                               const bf16_t* vrow, int nk) {
  switch (mcount) {
    case 1: return accumulate_pv_dp<DV, 1>(acc, pb, ps, vrow, nk);
    case 2: return accumulate_pv_dp<DV, 2>(acc, pb, ps, vrow, nk);
    case 3: return accumulate_pv_dp<DV, 3>(acc, pb, ps, vrow, nk);
    default: return accumulate_pv_dp<DV, 4>(acc, pb, ps, vrow, nk);
  }
}
#endif  // __AVX512BF16__

constexpr int kMaxPart = static_cast<int>(kPartMax);  // keys per softmax pass (longer segments are split exactly)
// K is prefetched this many blocks ahead of the block being scored, into L2 (_MM_HINT_T1),
// across part boundaries (the stream runs over the task's whole key range) and from the
// task's first block. Measured on AMD Zen 5 (2 cores, 16 decode rows x 1k/4k keys,
// scattered 16-token blocks, interleaved A/B): L2 hints instead of L1 (_MM_HINT_T0) and
// the unbroken stream read bf16 KV ~40 % and fp32 KV ~20 % faster; 2, 8 or 16 blocks
// ahead were no better than 4, and an extra L1 prefetch one block ahead did not help.
// The stream also runs on during P.V, one block per V block (so up to a part ahead, the
// next part's K), and past the end of a unit of work into the first K blocks of the
// unit the thread runs next (Work, claim_ahead): memory no longer idles while a part's
// softmax and P.V run, nor at a task's start. Measured on AMD Zen 5 (1 thread, CPU
// clock, huge pages, interleaved A/B against the kernel without it): at load ~13,
// medians of 5: +11 % at 1 row x 4k keys, +6 % at 16 x 1k, +4 % at 16 x 4k; at load
// ~17, paired medians of 11: +17 % at 1 x 1k, +1 % at 1 x 4k, 0 % at 16 x 1k, +6 % at
// 16 x 4k. The kernel then reads its scattered 2 KB pages about as fast as a plain
// prefetched read of them (read_pages), and random 2 KB pieces cap one Zen 5 core at
// ~16 GB/s, about half its stream rate (docs/kernels.md).
// (benchmarks/decode_attention_micro.py)
constexpr int kKeyLanesMinM = 8;  // queries per tile from which Q.K runs in key lanes
typedef uint32_t u32k __attribute__((may_alias));

// The 16 scores of one query against a transposed key group kt ([D units][16 keys]):
// the same numbers, bit for bit, as scores16 / scores16_dp. Those compute, per key,
// lane l of a 16-lane vector (the products of head-dim unit l, 16 + l, ... chained in
// that order: mul then FMAs, or vdpbf16ps from zero for kDp) and reduce the 16 lanes
// with hsum16, whose tree is ((G0 + G1) + (G2 + G3)), G_q = (x[4q] + x[4q + 2]) +
// (x[4q + 1] + x[4q + 3]). Here the lanes are the keys: P[l] is lane l of every key
// at once (the same chain, the query unit broadcast), then the same tree over P.
// q: the query as run_task_avx512 keeps it (fp32, split order for bf16; raw bf16
// pairs for kDp).
template <int DV, bool kDp>
inline __m512 scores16_keylanes(const float* q, const float* kt) {
  __m512 P[16];
  if constexpr (kDp) {
#if defined(__AVX512BF16__)
    const u32k* qd = reinterpret_cast<const u32k*>(q);
    const u32k* kd = reinterpret_cast<const u32k*>(kt);
    for (int l = 0; l < 16; ++l) {
      __m512 x = _mm512_setzero_ps();
      for (int j = 0; j < DV / 2; ++j)
        x = _mm512_dpbf16_ps(x, (__m512bh)_mm512_set1_epi32(static_cast<int>(qd[16 * j + l])),
                             (__m512bh)_mm512_loadu_si512(kd + (16 * j + l) * 16));
      P[l] = x;
    }
#endif
  } else {
    for (int l = 0; l < 16; ++l) {
      __m512 x = _mm512_mul_ps(_mm512_set1_ps(q[l]), _mm512_loadu_ps(kt + l * 16));
      for (int dv = 1; dv < DV; ++dv)
        x = _mm512_fmadd_ps(_mm512_set1_ps(q[16 * dv + l]), _mm512_loadu_ps(kt + (16 * dv + l) * 16), x);
      P[l] = x;
    }
  }
  __m512 G[4];
  for (int g = 0; g < 4; ++g)
    G[g] = _mm512_add_ps(_mm512_add_ps(P[4 * g], P[4 * g + 2]), _mm512_add_ps(P[4 * g + 1], P[4 * g + 3]));
  return _mm512_add_ps(_mm512_add_ps(G[0], G[1]), _mm512_add_ps(G[2], G[3]));
}
#ifndef KVS_PREFETCH_BLOCKS
#define KVS_PREFETCH_BLOCKS 4
#endif
constexpr int64_t kPrefetchBlocks = KVS_PREFETCH_BLOCKS;

// The K blocks of a unit of work, prefetched into L2 in order from its first block.
template <typename T>
struct KStream {
  const char* kbase = nullptr;
  const int64_t* bt = nullptr;
  int64_t lmax = 0, first = 0, next = 0, row_bytes = 0;
  int bs = 0;
  void init(const Args& a, const Task& t, int64_t part) {
    lmax = task_keys(a, t);
    int64_t p0 = 0;
    for (int64_t k = 0; k < part && p0 < lmax; ++k) p0 = part_end(a.seg, p0);
    if (p0 >= lmax) return;  // nothing to read: kbase stays null
    bs = a.block_size;
    row_bytes = static_cast<int64_t>(a.head_dim) * static_cast<int64_t>(sizeof(T));
    kbase = static_cast<const char*>(a.kv) + static_cast<int64_t>(t.kvh) * a.num_blocks * bs * row_bytes;
    bt = a.block_tables + a.max_blocks * t.seq;
    first = next = p0 / bs;
  }
  // prefetch blocks [next, end_block) (bounded at the unit's keys)
  void prefetch_to(int64_t end_block) {
    for (; next < end_block && next * bs < lmax; ++next) {
      const int64_t n1 = std::min<int64_t>(lmax - next * bs, bs) * row_bytes;
      const char* k0 = kbase + bt[next] * bs * row_bytes;
      for (int64_t o = 0; o < n1; o += 64) _mm_prefetch(k0 + o, _MM_HINT_T1);
    }
  }
};

// Writes a finished task's rows (state mx, l, acc as run_task_avx512 keeps it).
template <typename T, int DV, bool kSplit>
void finish_task(const Args& a, const Task& task, const TaskView<T>& v, const float* mx,
                 const float* l, const float* acc) {
  constexpr int D = 16 * DV;
  const int g = v.g;
  for (int64_t r = task.r0; r < v.r_end; ++r)
    for (int j = 0; j < g; ++j) {
      const int m = static_cast<int>(r - task.r0) * g + j;
      const int64_t head = task.kvh * g + j, row = batch_row(a, v.row_start + r);
      float w_old, w_acc;
      finish_row(a, row, head, mx[m], l[m], w_old, w_acc);
      T* o = v.out + row * a.num_heads * D + head * D;
      if constexpr (kSplit) {
        for (int dv = 0; dv < DV; ++dv)
          for (int ln = 0; ln < 16; ++ln) {
            T* od = o + split_dim(dv, ln);
            from_f32((w_old != 0.f ? to_f32(*od) * w_old : 0.f) + acc[m * D + dv * 16 + ln] * w_acc, od);
          }
      } else {
        for (int d = 0; d < D; ++d)
          from_f32((w_old != 0.f ? to_f32(o[d]) * w_old : 0.f) + acc[m * D + d] * w_acc, o + d);
      }
    }
}

// The state (max m, sum l, output acc) after one more key part: merge the part's own
// state (mp, lp, accp: its softmax taken against its own max) into the running one.
// Every merge of the kernel goes through here (in the task's walk and in the merge of a
// task whose parts ran on several threads), in part order, from the state (-inf, 0, 0):
// so a row's bits do not depend on which thread computed which part. The first merge
// gives exactly the first part's state (cs = 0, cp = 1). A part without a visible key
// (mp = -inf) leaves the state as it is.
template <int DV>
inline void merge_part(float& mx, float& l, float* acc, float mp, float lp, const float* accp) {
  if (mp == kNegInf) return;
  const float m_new = std::max(mx, mp);
  const float cs = mx == kNegInf ? 0.f : std::exp(mx - m_new);
  const float cp = std::exp(mp - m_new);
  l = std::fma(l, cs, lp * cp);
  mx = m_new;
  const __m512 vs = _mm512_set1_ps(cs), vp = _mm512_set1_ps(cp);
  for (int dv = 0; dv < DV; ++dv)
    _mm512_storeu_ps(acc + dv * 16, _mm512_fmadd_ps(_mm512_loadu_ps(acc + dv * 16), vs,
                                                    _mm512_mul_ps(_mm512_loadu_ps(accp + dv * 16), vp)));
}

// One task: `g` query heads of one KV head for rows [r0, r1) of one request. Keys are
// walked part by part (segments of the prior context, then the new tokens); a part's
// scores for all queries go to a buffer, one exact softmax pass per query against the
// part's own max, P.V of the part (its V rows read once per 4 queries), then the part
// is merged into the running state (merge_part). With `parts` set, only the parts
// [part_lo, part_hi) are walked and each part's state is stored there instead, at
// parts + k * M * (D + 2): [M] max, [M] sum, [M, D] acc (split order for bf16), for
// merge_task to merge (the task's parts then run on several threads).
template <typename T, int DV, bool kDp = false>
void run_task_avx512(const Args& a, const Task& task, std::vector<float>& buf, int64_t part_lo = 0,
                     int64_t part_hi = INT64_MAX, float* parts = nullptr, const Work* next = nullptr) {
  constexpr int D = 16 * DV;
  // bf16 rows widened in split order (kDp: bf16 rows used as they lie, vdpbf16ps)
  constexpr bool kSplit = std::is_same_v<T, bf16_t> && !kDp;
  static_assert(!kDp || std::is_same_v<T, bf16_t>, "kDp is for bfloat16");
  constexpr int MB = 4;  // queries per PV pass
  const TaskView<T> v(a, task);
  const int bs = v.bs, g = v.g, M = v.M;
  const int64_t row_start = v.row_start, ctx = v.ctx, prior_only = v.prior_only, r_end = v.r_end;
  const int64_t* bt = v.bt;
  const T *q = v.q, *kbase = v.kbase, *vbase = v.vbase;
  if (M == 0) return;

  constexpr int64_t PS = kMaxPart + 32;  // row stride of the score buffers
  const size_t need =
      static_cast<size_t>(M) * (3 * D + PS + 6) + 32 * D + 16 + (kDp ? M * PS / 2 + 16 : 0);
  if (buf.size() < need) buf.resize(need);
  float* qf = buf.data();   // [M, D] queries, fp32 (split order for bf16)
  float* acc = qf + M * D;  // [M, D] (split order for bf16)
  float* accp = acc + M * D;  // [M, D] the part's P.V
  float* sc = accp + M * D;  // [M, PS] scores, then probabilities
  float* mx = sc + M * PS;  // [M]
  float* l = mx + M;        // [M]
  float* mpart = l + M;     // [M] the part's max
  float* lpart = mpart + M;  // [M] the part's sum
  int64_t* lim = reinterpret_cast<int64_t*>(lpart + M);  // [M] keys each query sees
  float* kw = reinterpret_cast<float*>(lim + M);     // [16, D] widened K rows (bf16)
  float* kt = kw + 16 * D;                            // [D, 16] a key group transposed
  bf16_t* pb = reinterpret_cast<bf16_t*>(kt + 16 * D);  // [M, PS] bf16 probabilities (kDp)
  // Q.K in key lanes (one K transpose per 16 keys, shared by the tile's M queries)
  // where the tile is big enough to pay for the transpose; bitwise equal to the
  // per-query form (see scores16_keylanes), so the choice never changes a result.
  const bool keylanes = M >= kKeyLanesMinM;

  int64_t lmax = 0;
  for (int64_t r = task.r0; r < r_end; ++r)
    for (int j = 0; j < g; ++j) {
      const int m = static_cast<int>(r - task.r0) * g + j;
      const T* qr = q + batch_row(a, row_start + r) * a.q_row_stride + (task.kvh * g + j) * a.q_head_stride;
      if constexpr (kDp) {  // raw bf16 in the first half of the row
        std::memcpy(qf + m * D, qr, D * sizeof(bf16_t));
      } else if constexpr (kSplit) {
        for (int dv = 0; dv < DV; ++dv)
          for (int ln = 0; ln < 16; ++ln) qf[m * D + dv * 16 + ln] = to_f32(qr[split_dim(dv, ln)]);
      } else {
        for (int i = 0; i < D; ++i) qf[m * D + i] = to_f32(qr[i]);
      }
      std::fill(acc + m * D, acc + (m + 1) * D, 0.f);
      mx[m] = kNegInf;
      l[m] = 0.f;
      lim[m] = prior_only ? ctx : ctx + r + 1;
      lmax = std::max(lmax, lim[m]);
    }
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  const __m512 scale = _mm512_set1_ps(a.scale);
  // the first blocks' K: the stream below prefetches kPrefetchBlocks ahead of the block
  // it reads, so start it
  int64_t kpf = 0;  // the next block whose K is prefetched
  int64_t p0 = 0, part = 0;
  for (; part < part_lo && p0 < lmax; ++part) p0 = part_end(a.seg, p0);  // this call's first part
  kpf = p0 / bs;
  const auto prefetch_k_to = [&](int64_t end_block) {
    for (; kpf < end_block && kpf * bs < lmax; ++kpf) {
      const int64_t n1 = std::min<int64_t>(lmax - kpf * bs, bs) * D * static_cast<int64_t>(sizeof(T));
      const char* k0 = reinterpret_cast<const char*>(kbase + bt[kpf] * bs * D);
      for (int64_t o = 0; o < n1; o += 64) _mm_prefetch(k0 + o, _MM_HINT_T1);
    }
  };
  prefetch_k_to(kpf + kPrefetchBlocks);
  KStream<T> next_k;  // the K of the work this thread runs next (see Work)
  if (next != nullptr) next_k.init(a, *next->task, next->part);
  // the K stream runs on past this call's last block into the next unit's first ones
  int64_t call_end = p0;  // key end of this call's parts
  for (int64_t k = part; k < part_hi && call_end < lmax; ++k) call_end = part_end(a.seg, call_end);
  const int64_t end_block = (std::min(call_end, lmax) + bs - 1) / bs;
  const auto prefetch_k_stream = [&](int64_t target) {
    prefetch_k_to(std::min(target, end_block));
    if (target > end_block && next_k.kbase != nullptr) next_k.prefetch_to(next_k.first + (target - end_block));
  };

  for (; p0 < lmax && part < part_hi; ++part) {
    // the part [p0, p1): absolute split points (see the top), bounded at lmax
    const int64_t p1 = std::min<int64_t>(part_end(a.seg, p0), lmax);
    const int n = static_cast<int>(p1 - p0);

    // 1. scores of every query against the part's keys, -inf where not visible
    int m_hi = 0;  // queries [0, m_hi) see at least one key of the part
    for (int m = 0; m < M; ++m)
      if (lim[m] > p0) m_hi = m + 1;
    for (int64_t c0 = p0; c0 < p1;) {
      const int64_t c1 = std::min<int64_t>(p1, (c0 / bs + 1) * bs);  // within one block
      const int64_t off = (bt[c0 / bs] * bs + c0 % bs) * D;
      {  // blocks are scattered: prefetch the next block's K and this block's V
        const int64_t bytes = (c1 - c0) * D * static_cast<int64_t>(sizeof(T));
        const char* vcur = reinterpret_cast<const char*>(vbase + off);
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(vcur + b, _MM_HINT_T1);
        prefetch_k_stream(c0 / bs + 1 + kPrefetchBlocks);  // K a few blocks ahead
      }
      for (int64_t g0 = c0; g0 < c1; g0 += 16) {
        const int nk = static_cast<int>(std::min<int64_t>(16, c1 - g0));
        const T* krow = kbase + off + (g0 - c0) * D;
        const float* kf = reinterpret_cast<const float*>(krow);
        if constexpr (kSplit) {  // widen the group's K rows once for every query
          for (int i = 0; i < nk; ++i) {
            __m512 w[DV];
            widen_split<DV>(krow + i * D, w);
            for (int dv = 0; dv < DV; ++dv) _mm512_storeu_ps(kw + i * D + 16 * dv, w[dv]);
          }
          kf = kw;
        }
        if (keylanes) {  // kt[u][i] = unit u of key i (a float, or a bf16 pair for kDp)
          constexpr int U = kDp ? D / 2 : D;
          const u32k* src = kDp ? reinterpret_cast<const u32k*>(krow) : reinterpret_cast<const u32k*>(kf);
          u32k* dst = reinterpret_cast<u32k*>(kt);
          for (int i = 0; i < 16; ++i)
            for (int u = 0; u < U; ++u) dst[u * 16 + i] = i < nk ? src[i * U + u] : 0u;
        }
        const __mmask16 in_part = static_cast<__mmask16>((1u << nk) - 1u);
        for (int m = 0; m < m_hi; ++m) {
          const int64_t vis = lim[m] - g0;  // keys of these 16 this query sees
          const __mmask16 valid =
              vis >= 16 ? in_part
                        : (vis <= 0 ? 0 : static_cast<__mmask16>(in_part & ((1u << vis) - 1u)));
          __m512 x = neg_inf;
          if (keylanes) {
            if (valid) x = _mm512_mul_ps(scores16_keylanes<DV, kDp>(qf + m * D, kt), scale);
          } else
#if defined(__AVX512BF16__)
          if constexpr (kDp) {
            __m512bh qb[DV / 2];
            for (int j = 0; j < DV / 2; ++j)
              qb[j] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const bf16_t*>(qf + m * D) + 32 * j);
            if (valid) x = _mm512_mul_ps(scores16_dp<DV>(qb, reinterpret_cast<const bf16_t*>(krow), nk), scale);
          } else
#endif
          {
            __m512 qv[DV];
            for (int dv = 0; dv < DV; ++dv) qv[dv] = _mm512_loadu_ps(qf + m * D + dv * 16);
            if (valid) x = _mm512_mul_ps(scores16<DV>(qv, kf, nk), scale);
          }
          _mm512_mask_storeu_ps(sc + m * PS + (g0 - p0), in_part,
                                _mm512_mask_blend_ps(valid, neg_inf, x));
        }
      }
      c0 = c1;
    }
    // 2. exact softmax of the part per query, merged into the running (max, sum, acc)
    for (int m = 0; m < m_hi; ++m) {
      float* row = sc + m * PS;
      const float m_new = part_max(row, n);  // the part's own max
      mpart[m] = m_new;
      const __m512 mn = _mm512_set1_ps(m_new);
      __m512 vsum = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
      bf16_t* prow = pb + m * PS;  // kDp: the probabilities go to P.V as bf16 only
#endif
      for (int j = 0; j < n; j += 16) {
        const __mmask16 k = tail_mask16(n - j);
        const __m512 x = _mm512_mask_loadu_ps(neg_inf, k, row + j);
        const __mmask16 fin = _mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ);
        const __m512 e = _mm512_maskz_mov_ps(fin, exp512(_mm512_sub_ps(x, mn)));
#if defined(__AVX512BF16__)
        if constexpr (kDp) {  // lanes past n are zero
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j), (__m256i)_mm512_cvtneps_pbh(e));
        } else
#endif
        {
          _mm512_storeu_ps(row + j, e);  // lanes past n are scratch (zero)
        }
        vsum = _mm512_add_ps(vsum, e);
      }
      lpart[m] = _mm512_reduce_add_ps(vsum);
      std::fill(accp + m * D, accp + (m + 1) * D, 0.f);
#if defined(__AVX512BF16__)
      if constexpr (kDp)  // zero past n (one more zero vector: the odd key's V partner)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + (n + 15) / 16 * 16), _mm256_setzero_si256());
#endif
    }
    // 3. accp = P . V, V rows read once per MB queries
    for (int64_t c0 = p0; c0 < p1;) {
      const int64_t c1 = std::min<int64_t>(p1, (c0 / bs + 1) * bs);
      const int64_t off = (bt[c0 / bs] * bs + c0 % bs) * D;
      const int64_t j0 = c0 - p0;
      // the K stream runs on during P.V, one block per block: the next part's (or the
      // next unit's) K, so memory stays busy while the part's arithmetic runs
      prefetch_k_stream(p1 / bs + (c0 - p0) / bs + 1 + kPrefetchBlocks);
      for (int m0 = 0; m0 < m_hi; m0 += MB) {
#if defined(__AVX512BF16__)
        if constexpr (kDp) {
          accumulate_pv_dp_n<DV>(accp + m0 * D, pb + m0 * PS + j0, PS, std::min(MB, m_hi - m0),
                                 reinterpret_cast<const bf16_t*>(vbase + off), static_cast<int>(c1 - c0));
          continue;
        }
#endif
        accumulate_pv_n<T, DV>(accp + m0 * D, sc + m0 * PS + j0, PS, std::min(MB, m_hi - m0),
                               vbase + off, static_cast<int>(c1 - c0));
      }
      c0 = c1;
    }
    // 4. merge the part into the running state, or store it (see the top)
    if (parts != nullptr) {
      float* st = parts + part * M * (D + 2);
      for (int m = 0; m < M; ++m) {
        st[m] = m < m_hi ? mpart[m] : kNegInf;
        st[M + m] = m < m_hi ? lpart[m] : 0.f;
      }
      std::memcpy(st + 2 * M, accp, sizeof(float) * m_hi * D);
    } else {
      for (int m = 0; m < m_hi; ++m)
        merge_part<DV>(mx[m], l[m], acc + m * D, mpart[m], lpart[m], accp + m * D);
    }
    p0 = p1;
  }
  if (parts == nullptr) finish_task<T, DV, kSplit>(a, task, v, mx, l, acc);
}

// A task whose parts ran as separate calls (run_task_avx512 with `parts`): merge its
// parts' states in part order, from (-inf, 0, 0), exactly as the walk does, and write
// the rows.
template <typename T, int DV, bool kDp = false>
void merge_task(const Args& a, const Task& task, int64_t nparts, const float* parts,
                std::vector<float>& buf) {
  constexpr int D = 16 * DV;
  constexpr bool kSplit = std::is_same_v<T, bf16_t> && !kDp;
  const TaskView<T> v(a, task);
  const int M = v.M;
  if (M == 0) return;
  if (buf.size() < static_cast<size_t>(M) * (D + 2)) buf.resize(static_cast<size_t>(M) * (D + 2));
  float* acc = buf.data();
  float* mx = acc + M * D;
  float* l = mx + M;
  std::fill(acc, acc + M * D, 0.f);
  for (int m = 0; m < M; ++m) mx[m] = kNegInf, l[m] = 0.f;
  for (int64_t k = 0; k < nparts; ++k) {
    const float* st = parts + k * M * (D + 2);
    for (int m = 0; m < M; ++m)
      if (st[m] != kNegInf) merge_part<DV>(mx[m], l[m], acc + m * D, st[m], st[M + m], st + 2 * M + m * D);
  }
  finish_task<T, DV, kSplit>(a, task, v, mx, l, acc);
}

#endif  // __AVX512F__

// The AVX-512 task functions for T and head_dim (null where only the portable run_task
// applies: then a task never splits across threads).
template <typename T>
struct TaskFns {
  void (*run)(const Args&, const Task&, std::vector<float>&, int64_t, int64_t, float*, const Work*) = nullptr;
  void (*merge)(const Args&, const Task&, int64_t, const float*, std::vector<float>&) = nullptr;
};

template <typename T>
TaskFns<T> task_fns(const Args& a) {
  TaskFns<T> f;
#if defined(__AVX512F__)
#define KVS_FNS(DV, DP) \
  f.run = run_task_avx512<T, DV, DP>; \
  f.merge = merge_task<T, DV, DP>; \
  return f
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16_t>) {
    if (kvs::use_bf16_dot()) {
      switch (a.head_dim) {
        case 32: KVS_FNS(2, true);
        case 64: KVS_FNS(4, true);
        case 128: KVS_FNS(8, true);
        default: break;
      }
    }
  }
#endif
  switch (a.head_dim) {
    case 32: KVS_FNS(2, false);
    case 64: KVS_FNS(4, false);
    case 128: KVS_FNS(8, false);
    default: break;
  }
#undef KVS_FNS
#endif
  (void)a;
  return f;
}

// A dynamic schedule in which each thread claims its next item before it runs the
// current one: body(i, next) runs item i knowing the item this thread runs after it
// (-1: none), so that it can prefetch that item's first K blocks (Work). Which thread
// runs an item never changes its result. Call inside a parallel region; `counter`
// starts at 0 and is shared by the region's threads.
template <typename F>
void claim_ahead_loop(std::atomic<int64_t>& counter, int64_t n, F&& body) {
  int64_t cur = counter.fetch_add(1, std::memory_order_relaxed);
  while (cur < n) {
    const int64_t nxt = counter.fetch_add(1, std::memory_order_relaxed);
    body(cur, nxt < n ? nxt : -1);
    cur = nxt;
  }
}

template <typename F>
void claim_ahead(int64_t n, int num_threads, F&& body) {
  std::atomic<int64_t> counter{0};
#pragma omp parallel num_threads(num_threads)
  claim_ahead_loop(counter, n, body);
}

// Threads: one task per (request, row tile, KV head), dynamic schedule. Where there are
// fewer than two tasks per thread (a few long decodes: 1 request x 3 KV heads on 2
// cores leaves one core idle a third of the time), each task's key parts run as
// separate work items and merge_task merges them afterwards, in part order: the same
// arithmetic as one walk (merge_part), so a row's bits never depend on the split.
template <typename T>
void run_all(const Args& a, int64_t num_seqs, int row_tile, int num_threads) {
  const std::vector<Task> tasks = make_tasks(a, num_seqs, row_tile);
  const int64_t n = static_cast<int64_t>(tasks.size());
  const TaskFns<T> fns = task_fns<T>(a);
  // Scratch per thread, kept across calls (OpenMP pool threads persist): a fresh
  // buffer per call would be page-faulted in every time.
  static thread_local std::vector<float> buf;
  const auto run = [&](int64_t i, int64_t next) {
    if (fns.run != nullptr) {
      const Work w{next >= 0 ? &tasks[next] : nullptr, 0};
      fns.run(a, tasks[i], buf, 0, INT64_MAX, nullptr, next >= 0 ? &w : nullptr);
    } else {
      run_task<T>(a, tasks[i], buf);
    }
  };
  if (num_threads <= 1 || n < 1) {
    for (int64_t i = 0; i < n; ++i) run(i, i + 1 < n ? i + 1 : -1);
    return;
  }
  // parts of each task, where its key parts are split across threads
  std::vector<int64_t> nparts, offset;
  std::vector<std::pair<int64_t, int64_t>> items;  // (task, part)
  int64_t total = 0;
  if (fns.run != nullptr && n < 2 * num_threads) {
    const int g = a.num_heads / a.num_kv_heads;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t* s = a.seqs + 5 * tasks[i].seq;
      const int64_t r_end = std::min<int64_t>(tasks[i].r1, s[2]);
      const int64_t rows = std::max<int64_t>(0, r_end - tasks[i].r0);
      nparts.push_back(count_parts(a.seg, task_keys(a, tasks[i])));
      offset.push_back(total);
      total += nparts.back() * rows * g * (a.head_dim + 2);
      for (int64_t k = 0; k < nparts.back(); ++k) items.emplace_back(i, k);
    }
  }
  if (static_cast<int64_t>(items.size()) <= n) {  // no task has two parts: one item per task
    claim_ahead(n, num_threads, run);
    return;
  }
  std::vector<float> states(static_cast<size_t>(total));
  const int64_t ni = static_cast<int64_t>(items.size());
  std::atomic<int64_t> counter{0};
#pragma omp parallel num_threads(num_threads)
  {
    claim_ahead_loop(counter, ni, [&](int64_t j, int64_t next) {
      const auto [i, k] = items[j];
      const Work w{next >= 0 ? &tasks[items[next].first] : nullptr, next >= 0 ? items[next].second : 0};
      fns.run(a, tasks[i], buf, k, k + 1, states.data() + offset[i], next >= 0 ? &w : nullptr);
    });
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) fns.merge(a, tasks[i], nparts[i], states.data() + offset[i], buf);
  }
}


// ------------------------------------------------ the bandwidth limit, measured fairly
// What the decode kernel is held against (kvserve/bench/attention_bench.py): the same
// OpenMP threads reading memory with 512-bit loads and no arithmetic beyond an OR.
// read_slices: a contiguous buffer, one slice per thread (the machine's stream-read
// bandwidth). read_pages: the K and V bytes a kernel call over (seqs, block_tables)
// reads, task by task in the kernel's order and schedule (one task per request and KV
// head, scattered blocks, K prefetched kPrefetchBlocks ahead): the access pattern's
// own limit, no scores or softmax. Both return the OR of the 64-bit little-endian
// words read (counted from 64-byte aligned offsets of the slice / page).
inline uint64_t or_bytes(const char* p, int64_t n) {
#if defined(__AVX512F__)
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 256 <= n; i += 256) {
    a0 = _mm512_or_si512(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_or_si512(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_or_si512(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_or_si512(a3, _mm512_loadu_si512(p + i + 192));
  }
  for (; i + 64 <= n; i += 64) a0 = _mm512_or_si512(a0, _mm512_loadu_si512(p + i));
  const __m512i r = _mm512_or_si512(_mm512_or_si512(a0, a1), _mm512_or_si512(a2, a3));
  uint64_t s = static_cast<uint64_t>(_mm512_reduce_or_epi64(r));
#else
  uint64_t s = 0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t x;
    std::memcpy(&x, p + i, 8);
    s |= x;
  }
#endif
  for (; i < n; ++i) s |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * (i & 7));
  return s;
}

uint64_t read_slices(const char* buf, int64_t bytes, int num_threads) {
  uint64_t s = 0;
#pragma omp parallel num_threads(std::max(1, num_threads)) reduction(| : s)
  {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = (bytes / nt) & ~int64_t{63};
    const int64_t b0 = per * t, b1 = t == nt - 1 ? bytes : b0 + per;
    s |= or_bytes(buf + b0, b1 - b0);
  }
  return s;
}

uint64_t read_pages(const Args& a, int64_t num_seqs, int elem, int num_threads) {
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int h = 0; h < a.num_kv_heads; ++h) tasks.push_back(Task{s, 0, a.seqs[5 * s + 1], h});
  const int64_t n = static_cast<int64_t>(tasks.size());
  const int64_t row = static_cast<int64_t>(a.head_dim) * elem, bs = a.block_size;
  const int64_t head_stride = a.num_blocks * bs * row;
  uint64_t sum = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::max(1, num_threads)) reduction(| : sum)
  for (int64_t i = 0; i < n; ++i) {
    const Task& task = tasks[i];
    const int64_t* s = a.seqs + 5 * task.seq;
    const int64_t keys = s[4] ? s[3] : s[3] + s[2];
    const int64_t* bt = a.block_tables + a.max_blocks * task.seq;
    const char* kb = static_cast<const char*>(a.kv) + task.kvh * head_stride;
    const char* vb = static_cast<const char*>(a.kv) + (a.num_kv_heads + task.kvh) * head_stride;
    const int64_t nblk = (keys + bs - 1) / bs;
    constexpr int64_t ahead = 4;  // the AVX-512 kernel's kPrefetchBlocks
    for (int64_t b = 0; b < std::min(nblk, ahead); ++b)
      for (int64_t o = 0; o < bs * row; o += 64) __builtin_prefetch(kb + bt[b] * bs * row + o, 0, 2);
    for (int64_t b = 0; b < nblk; ++b) {
      const int64_t nbytes = std::min(bs, keys - b * bs) * row;
      if (b + ahead < nblk)
        for (int64_t o = 0; o < bs * row; o += 64)
          __builtin_prefetch(kb + bt[b + ahead] * bs * row + o, 0, 2);
      sum |= or_bytes(kb + bt[b] * bs * row, nbytes) | or_bytes(vb + bt[b] * bs * row, nbytes);
    }
  }
  return sum;
}

}  // namespace

extern "C" {

// Returns 0 on success, 1 for an unsupported dtype, 4 for merge without lse. dtype: 0 = float32, 1 = bfloat16
// (q, out and kv share it).
int kvs_paged_attention(const void* q, int64_t q_row_stride, int64_t q_head_stride, void* out,
                        const void* kv, int64_t num_blocks, int block_size, int num_heads,
                        int num_kv_heads, int head_dim, const int64_t* seqs, int64_t num_seqs,
                        const int64_t* block_tables, int64_t max_blocks, int seg, float scale,
                        int dtype, int row_tile, int num_threads, float* lse,
                        const int64_t* row_map, int merge) {
  if (merge && lse == nullptr) return 4;
  Args a{q,         q_row_stride, q_head_stride, out,          kv,         num_blocks, block_size,
         num_heads, num_kv_heads, head_dim,      seqs,         block_tables, max_blocks, seg,
         scale,     lse,          row_map,       merge};
  if (dtype == 0) {
    run_all<float>(a, num_seqs, row_tile, num_threads);
  } else if (dtype == 1) {
    run_all<bf16_t>(a, num_seqs, row_tile, num_threads);
  } else {
    return 1;
  }
  return 0;
}

// The reads the decode kernel is held against (see read_slices / read_pages); the
// results are an OR of the bytes read (returned so that no read is optimised away).
uint64_t kvs_read_slices(const void* buf, int64_t bytes, int num_threads) {
  return read_slices(static_cast<const char*>(buf), bytes, num_threads);
}

uint64_t kvs_read_pages(const void* kv, int64_t num_blocks, int block_size, int num_kv_heads,
                        int head_dim, int elem_size, const int64_t* seqs, int64_t num_seqs,
                        const int64_t* block_tables, int64_t max_blocks, int num_threads) {
  Args a{};
  a.kv = kv;
  a.num_blocks = num_blocks;
  a.block_size = block_size;
  a.num_kv_heads = num_kv_heads;
  a.head_dim = head_dim;
  a.seqs = seqs;
  a.block_tables = block_tables;
  a.max_blocks = max_blocks;
  return read_pages(a, num_seqs, elem_size, num_threads);
}

int kvs_abi_version() { return 1; }
}
