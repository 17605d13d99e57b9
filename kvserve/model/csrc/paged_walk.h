// The paged-KV walk the attention kernels share: paged_attention.cpp (float32 /
// bfloat16 caches) and attention_kv8.cpp (8-bit caches) take the same call arguments,
// split the same tasks, walk keys in parts whose boundaries are absolute positions
// (multiples of kPartMax and of the segment size: a row's result depends only on its
// position and the keys it sees), and finish a row with the same log-sum-exp merge.
// Only how a page's bytes hold K and V differs; that stays in each kernel.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvs_common.h"

namespace kvs {
namespace walk {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kPartMax = 512;  // keys per part at most (the AVX-512 score buffers)

// The C ABI's arguments (see kvs_paged_attention in paged_attention.cpp); kv is the
// layer's cache, [2, Hk, num_blocks, block_size, row] in the kernel's own row format.
struct Args {
  const void* q;
  int64_t q_row_stride, q_head_stride;
  void* out;
  const void* kv;
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

// Rows [r0, r1) of request `seq` against KV head `kvh`.
struct Task {
  int64_t seq, r0, r1;
  int kvh;
};

// The tasks of a call, in order: per request, per tile of row_tile rows, per KV head.
inline std::vector<Task> make_tasks(const Args& a, int64_t num_seqs, int row_tile) {
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows = a.seqs[5 * s + 1];
    for (int64_t r0 = 0; r0 < rows; r0 += row_tile)
      for (int h = 0; h < a.num_kv_heads; ++h)
        tasks.push_back(Task{s, r0, std::min<int64_t>(r0 + row_tile, rows), h});
  }
  return tasks;
}

inline int64_t batch_row(const Args& a, int64_t i) { return a.row_map ? a.row_map[i] : i; }

// End of the key part that starts at the absolute position p0 (itself a split point):
// the next multiple of seg (seg <= 0: no segments) or of kPartMax, whichever is first.
// Depends on seg and p0 only (batch invariance).
inline int64_t part_end(int seg, int64_t p0) {
  int64_t e = (p0 / kPartMax + 1) * kPartMax;
  if (seg > 0) e = std::min<int64_t>(e, (p0 / seg + 1) * seg);
  return e;
}

// How a finished row is written: out = old * w_old + acc * w_acc, where acc is the
// unnormalised sum (running sum l, max mx). Also stores the row's log-sum-exp, merged
// with the one already there when a.merge.
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

// What every task reads of its request: its rows, context, block table, q and out;
// the constructor zeroes the output of the task's padding rows (r >= num_tokens).
template <typename T>
struct TaskRows {
  int D, bs, g;
  int64_t row_start, num_tokens, ctx, prior_only, r_end;
  int M;  // queries: real rows of the tile x query heads of the KV head
  const int64_t* bt;
  const T* q;
  T* out;

  TaskRows(const Args& a, const Task& task) {
    D = a.head_dim;
    bs = a.block_size;
    g = a.num_heads / a.num_kv_heads;
    const int64_t* s = a.seqs + 5 * task.seq;
    row_start = s[0];
    num_tokens = s[2];
    ctx = s[3];
    prior_only = s[4];
    bt = a.block_tables + a.max_blocks * task.seq;
    q = static_cast<const T*>(a.q);
    out = static_cast<T*>(a.out);
    r_end = std::min<int64_t>(task.r1, num_tokens);
    M = static_cast<int>(std::max<int64_t>(0, r_end - task.r0)) * g;
    for (int64_t r = std::max(task.r0, num_tokens); r < task.r1; ++r)
      for (int j = 0; j < g; ++j) {
        T* o = out + batch_row(a, row_start + r) * a.num_heads * D + (task.kvh * g + j) * D;
        for (int i = 0; i < D; ++i) from_f32(0.f, o + i);
      }
  }
};

#if defined(__AVX512F__)
// lane i of the result: the sum of the lanes of v[i] (a transpose-add tree, one order)
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

// The 16 dot products of one query with keys [0, nk) as one vector (zero past nk);
// dot(i): key i's 16 partial products, summed by hsum16.
template <typename Dot>
inline __m512 scores16_of(int nk, Dot&& dot) {
  __m512 part[16];
  for (int i = 0; i < 16; ++i) part[i] = i < nk ? dot(i) : _mm512_setzero_ps();
  return hsum16(part);
}

// One query's 16 partial dot products with keys krow[0..nk) (zero past nk), fp32 rows.
template <int DV>
inline __m512 scores16(const __m512* qv, const float* krow, int nk) {
  return scores16_of(nk, [&](int i) {
    const float* k = krow + i * 16 * DV;
    __m512 x = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
    for (int dv = 1; dv < DV; ++dv) x = _mm512_fmadd_ps(qv[dv], _mm512_loadu_ps(k + 16 * dv), x);
    return x;
  });
}

// Lanes [0, left) of a 16-lane step over a part's scores (all 16 when left >= 16).
inline __mmask16 tail_mask16(int left) {
  return static_cast<__mmask16>(left >= 16 ? 0xffffu : (1u << left) - 1u);
}

// The max of a part's scores row[0, n) (-inf for none), 16 lanes at a time.
inline float part_max(const float* row, int n) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  __m512 vmax = neg_inf;
  for (int j = 0; j < n; j += 16)
    vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(neg_inf, tail_mask16(n - j), row + j));
  return _mm512_reduce_max_ps(vmax);
}
#endif

}  // namespace walk
}  // namespace kvs
