// Prefill attention on vector units (AVX-512 or AVX2), reading K/V from kvserve's
// paged cache: the design of prefill_amx.cpp for CPUs without AMX.
//
// Each query row attends to every key up to its own position, [0, cached_seq_len + j]
// (or [0, cached_seq_len) with prior_only), prior context and the chunk's own tokens
// alike, all read from the pages in one pass (the caller wrote the chunk's K/V first).
// Keys are taken in chunks of 64 at absolute positions (0, 64, 128, ...), and the
// chunks merge with the exact online-softmax rule (running max m, running sum l,
// output rescaled by exp(m_old - m_new)); kv_segment_size boundaries (multiples of 64)
// are chunk boundaries, so the per-segment softmax + merge of the portable path is
// the same computation.
//
// Layout: that of paged_attention.cpp / prefill_amx.cpp (kv [2, Hk, blocks, bs, D],
// q [T, H, D] strided, out [T, H, D] contiguous, seqs [S, 5] = (row_start, num_rows,
// num_tokens, cached_seq_len, prior_only), lse [T, H] fp32 or null, row_map, merge).
// Rows j >= num_tokens are padding: output zero, lse -inf.
//
// Work: per (seq, KV head, L stacked query rows) task -- the H/Hk query heads sharing a
// KV head are stacked as rows, token-major -- everything is computed transposed
// (S^T = K.Q^T, O^T = V^T.P^T), so the L query rows are the L lanes of every register
// (L = 16 for AVX-512, 8 for AVX2): scores, max, exp, sums and rescaling are vertical,
// one register per key or per head dim, and the products are broadcast FMAs (a key's
// or value's element broadcast from memory against a vector of L rows).
//
// Products, by ISA and dtype:
//   - AVX-512 + AVX512_BF16, bfloat16: vdpbf16ps on bf16 pairs (Q.K over head-dim
//     pairs straight from the pages; P.V over key pairs of V, repacked once per
//     (seq, KV head) into pair-interleaved rows). Measured on AMD EPYC Zen 5 with a
//     probe of 10 independent zmm chains: vdpbf16ps issues at the same rate as an
//     fp32 FMA (0.273 ns each), i.e. twice the FLOP rate of widened fp32 FMAs (on the
//     Intel Sapphire Rapids machine it issued at ~1/4 of the FMA rate; AMX serves
//     bfloat16 there). The default picks it on AMD CPUs only (KVSERVE_PREFILL_VEC
//     names a variant to force one).
//   - otherwise fp32 FMAs (bfloat16 K/V widened on the broadcast, P kept in fp32).
//
// Determinism (a row's result does not depend on its chunk): a lane's arithmetic
// depends only on its own query, its own key limit and the K/V. Chunks sit at fixed
// absolute positions; every chunk is processed whole (64 keys, masked past the row's
// limit, P = 0 there); the extra chunks a tile walks past a row's own limit leave
// that row bitwise unchanged (its max stays, alpha = 2^0 = 1 exactly, P = 0).
// Rows from different chunkings of the same prompt therefore get bitwise equal
// outputs. (Decode rows use paged_attention.cpp, whose head-dim-lane dot products
// sum in another order: see docs/architecture.md.)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <immintrin.h>
#include <omp.h>

#include "kvs_common.h"

namespace {

using kvs::bf16_t;
using kvs::from_f32;
using kvs::to_f32;

typedef uint32_t u32a __attribute__((may_alias));

constexpr int kKC = 64;  // keys per softmax chunk, at absolute multiples of 64
constexpr int kInvTiles = 4;  // row tiles per invariant task (run_task_inv)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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
  float scale;
  float* lse;
  const int64_t* row_map;
  int merge;
};

inline int64_t batch_row(const Args& a, int64_t i) { return a.row_map ? a.row_map[i] : i; }

inline int64_t num_keys(const Args& a, int64_t s) {
  const int64_t* e = a.seqs + 5 * s;
  return e[4] ? e[3] : e[3] + e[2];
}

struct Task {
  int64_t seq;
  int h;
  int64_t r0;  // first stacked row (row = token * g + head in group)
};

// K (which = 0) or V (1) row of position p of a seq
template <typename T>
inline const T* kv_row(const Args& a, const int64_t* bt, int which, int h, int64_t p) {
  const int64_t bs = a.block_size;
  const int64_t base = (static_cast<int64_t>(which) * a.num_kv_heads + h) * a.num_blocks;
  return static_cast<const T*>(a.kv) + ((base + bt[p / bs]) * bs + p % bs) * a.head_dim;
}

// pointers to the rows of positions [p0, p0 + n), walking the block table without a
// division per key
template <typename T>
inline void row_ptrs(const Args& a, const int64_t* bt, int which, int h, int64_t p0, int n,
                     const T** dst) {
  const int64_t bs = a.block_size, D = a.head_dim;
  const int64_t base = (static_cast<int64_t>(which) * a.num_kv_heads + h) * a.num_blocks;
  const T* kv = static_cast<const T*>(a.kv);
  int64_t blk = p0 / bs, off = p0 % bs;
  for (int k = 0; k < n; ++k) {
    dst[k] = kv + ((base + bt[blk]) * bs + off) * D;
    if (++off == bs) off = 0, ++blk;
  }
}

// Q^T of one task's row tile: its L stacked query rows (row r: token r / g of the seq,
// query head h * g + r % g; rows from m_hi on are padding, zero) as fp32 (qt) or in
// head-dim pairs (qp, kDp), and each row's visible-key limit in lim (0 for padding).
// Sets max_lim / min_lim to the largest / smallest limit of the tile.
template <typename T, int D, bool kDp, int L>
inline void load_q_tile(const Args& a, const Task& t, int m_hi, float (&qt)[kDp ? 1 : D][L],
                        uint32_t (&qp)[kDp ? D / 2 : 1][L], int32_t (&lim)[L], int64_t& max_lim,
                        int64_t& min_lim) {
  const int64_t* s = a.seqs + 5 * t.seq;
  const int64_t row_start = s[0], cached = s[3], prior_only = s[4];
  const int g = a.num_heads / a.num_kv_heads;
  max_lim = 0;
  min_lim = std::numeric_limits<int64_t>::max();
  for (int m = 0; m < L; ++m) {
    if (m < m_hi) {
      const int64_t r = t.r0 + m, j = r / g;
      const int head = t.h * g + static_cast<int>(r % g);
      const T* src = static_cast<const T*>(a.q) + batch_row(a, row_start + j) * a.q_row_stride +
                     head * a.q_head_stride;
      if constexpr (kDp) {
        const u32a* s32 = reinterpret_cast<const u32a*>(src);
        for (int p = 0; p < D / 2; ++p) qp[p][m] = s32[p];
      } else {
        for (int d = 0; d < D; ++d) qt[d][m] = to_f32(src[d]);
      }
      lim[m] = static_cast<int32_t>(prior_only ? cached : cached + j + 1);
      max_lim = std::max<int64_t>(max_lim, lim[m]);
    } else {
      if constexpr (kDp) {
        for (int p = 0; p < D / 2; ++p) qp[p][m] = 0;
      } else {
        for (int d = 0; d < D; ++d) qt[d][m] = 0.f;
      }
      lim[m] = 0;
    }
    min_lim = std::min<int64_t>(min_lim, lim[m]);
  }
}

// ------------------------------------------------------------------ vector traits
#if defined(__AVX512F__) && defined(__AVX512BW__)
struct V512 {
  using vec = __m512;
  using ivec = __m512i;
  static constexpr int L = 16;   // query rows per register
  static constexpr int KG = 16;  // keys per Q.K register block (accumulators)
  static constexpr int DB = 16;  // head dims per P.V register block
  static vec zero() { return _mm512_setzero_ps(); }
  static vec set1(float x) { return _mm512_set1_ps(x); }
  static vec load(const float* p) { return _mm512_load_ps(p); }
  static void store(float* p, vec v) { _mm512_store_ps(p, v); }
  static vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
  static vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
  static vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
  static vec max(vec a, vec b) { return _mm512_max_ps(a, b); }
  static vec bcast(const float* p) { return _mm512_set1_ps(*p); }
  static vec bcast(const bf16_t* p) { return _mm512_set1_ps(to_f32(*p)); }
  static ivec loadi(const int32_t* p) { return _mm512_load_si512(p); }
  // v where lim > pos, else -inf
  static vec visible(ivec lim, int32_t pos, vec v) {
    return _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(lim, _mm512_set1_epi32(pos)),
                                _mm512_set1_ps(kNegInf), v);
  }
  // v where x != -inf, else 0
  static vec finite_or_zero(vec x, vec v) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ), v);
  }
  // 2^x, x clamped to [-126, 126]: 2^n * p(f), |f| <= 1/2, p the degree-6 Taylor
  // polynomial of e^(f ln2) (relative error < 2e-7); 2^0 = 1 exactly
  static vec exp2(vec x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-126.0f)), _mm512_set1_ps(126.0f));
    const vec n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vec f = _mm512_sub_ps(x, n);
    vec p = _mm512_set1_ps(1.5403530393381609e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022650695910071f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718055994531f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
  }
};
#define KVS_PF_HAVE_512 1
#if defined(__AVX512BF16__)
#define KVS_PF_HAVE_DP 1
#endif
#endif

#if defined(__AVX2__) && defined(__FMA__)
struct V256 {
  using vec = __m256;
  using ivec = __m256i;
  static constexpr int L = 8;
  static constexpr int KG = 8;  // 16 ymm registers: 8 accumulators + operands
  static constexpr int DB = 8;
  static vec zero() { return _mm256_setzero_ps(); }
  static vec set1(float x) { return _mm256_set1_ps(x); }
  static vec load(const float* p) { return _mm256_load_ps(p); }
  static void store(float* p, vec v) { _mm256_store_ps(p, v); }
  static vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
  static vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
  static vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
  static vec max(vec a, vec b) { return _mm256_max_ps(a, b); }
  static vec bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static vec bcast(const bf16_t* p) { return _mm256_set1_ps(to_f32(*p)); }
  static ivec loadi(const int32_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
  static vec visible(ivec lim, int32_t pos, vec v) {
    const vec m = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, _mm256_set1_epi32(pos)));
    return _mm256_blendv_ps(_mm256_set1_ps(kNegInf), v, m);
  }
  static vec finite_or_zero(vec x, vec v) {
    return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(kNegInf), _CMP_NEQ_OQ), v);
  }
  static vec exp2(vec x) {  // as V512::exp2
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-126.0f)), _mm256_set1_ps(126.0f));
    const vec n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vec f = _mm256_sub_ps(x, n);
    vec p = _mm256_set1_ps(1.5403530393381609e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.24022650695910071f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.69314718055994531f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
};
#define KVS_PF_HAVE_256 1
#endif

#if defined(KVS_PF_HAVE_DP)
// acc += q . broadcast(*p) (bf16 pairs) with the broadcast folded into the instruction
// ({1to16} memory operand): the compiler emits a separate vpbroadcastd otherwise.
inline __m512 dp_bcast(__m512 acc, __m512bh q, const u32a* p) {
  __asm__("vdpbf16ps %[m]%{1to16%}, %[q], %[acc]" : [acc] "+v"(acc) : [q] "v"(q), [m] "m"(*p));
  return acc;
}

// V of one (seq, KV head) in key pairs: vp[kk][d] = V[2kk][d] | V[2kk + 1][d] << 16 (bf16
// bits), keys padded with zeros to a multiple of kKC: the broadcast operand of P.V.
void pack_v_pairs(const Args& a, const int64_t* bt, int h, int64_t keys, uint32_t* vp) {
  const int D = a.head_dim;
  const int64_t padded = (keys + kKC - 1) / kKC * kKC;
  // lane 2n <- x[n], lane 2n + 1 <- y[n], for n in the low / high 16 of 32
  const __m512i idx_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                          40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                          32, 0);
  const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
  for (int64_t p = 0; p < padded; p += 2) {
    uint32_t* dst = vp + (p / 2) * D;
    const bf16_t* x = p < keys ? kv_row<bf16_t>(a, bt, 1, h, p) : nullptr;
    const bf16_t* y = p + 1 < keys ? kv_row<bf16_t>(a, bt, 1, h, p + 1) : nullptr;
    for (int d0 = 0; d0 < D; d0 += 32) {
      const __m512i xv = x ? _mm512_loadu_si512(x + d0) : _mm512_setzero_si512();
      const __m512i yv = y ? _mm512_loadu_si512(y + d0) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d0, _mm512_permutex2var_epi16(xv, idx_lo, yv));
      _mm512_storeu_si512(dst + d0 + 16, _mm512_permutex2var_epi16(xv, idx_hi, yv));
    }
  }
}
#endif

#if defined(KVS_PF_HAVE_512)
// ------------------------------------------------------- the batch-invariant variant
// kvs_prefill_attention_inv: the same contract, but each row's arithmetic is exactly
// that of paged_attention.cpp's AVX-512 path (the decode form), so a position's
// attention is bitwise the same whether it runs here as a prefill row or there as a
// decode row (docs/determinism.md). The rows stay in the lanes (16 stacked query
// rows per register), but every number is formed as the paged kernel forms it:
//   - keys in parts at absolute positions ([0, P), [P, 2P), ... P = seg, split at
//     multiples of 512: part_end below, the paged kernel's), each part bounded at the
//     tile's last visible key;
//   - a score: per head-dim lane l (0..15) the chain of products of units l, 16 + l,
//     ... (mul then FMAs in fp32, split order for bf16; vdpbf16ps from zero over
//     pairs 16j + l for the dot variant), the 16 lane sums reduced with hsum16's tree
//     ((G0 + G1) + (G2 + G3)), G_q = (P[4q] + P[4q + 2]) + (P[4q + 1] + P[4q + 3]),
//     then times scale (natural-log units);
//   - per part: the part's own max mp, exp512(x - mp) (0 where masked), the part's sum
//     lp of the exponentials in 16 key-offset lanes reduced with GCC's
//     _mm512_reduce_add_ps tree, the part's P.V from zero, then the part merged as the
//     paged kernel's merge_part does (m = max(m, mp), cs = exp(m_old - m) (0 for the
//     first), cp = exp(mp - m), l = fma(l, cs, lp * cp), acc = fma(acc, cs, accp * cp)); P.V in key order (fp32 FMAs; P rounded to bf16 and V in key
//     pairs for the dot variant, pairs at even positions: block_size must be even);
//   - the row finished as finish_row does (1 / l, the lse merge).
// The dot variant is the paged kernel's choice, one function for both
// (kvs::use_bf16_dot, kvs_common.h: AMD CPUs with AVX512_BF16, KVSERVE_BF16_DOT=fma|dp
// overrides): tests/model/test_attention_invariance.py compares them bit for bit.
// Work (none of it changes a row's arithmetic): a part takes two passes over its keys
// per tile, scores (with the running max) and then exp + sum + P . V's operand (bf16
// pairs written in place over the scores); tasks go KV head by KV head, longest rows
// first, a few row tiles of one head per task walking the parts together (a part's
// K/V then comes from cache for every tile). What bounds it (AMD EPYC family 25
// model 17, bf16, 2,048 tokens, one thread): the 64 vdpbf16ps per 16 rows x 1 key
// (32 for Q.K, 32 for P.V) run at about one per cycle in P.V and ~1.25 cycles in Q.K
// (15 adds of the lane tree, the broadcast loads), plus ~14 vector ops of exp512 per
// 16 (row, key) pairs: within ~25 % of that arithmetic's issue-rate floor.
// Measured again (session 5, same CPU, knock-out builds, one thread, 2,048 tokens):
// ~92-97 cycles per 16 rows x 1 key against a floor of ~75 (64 vdpbf16ps + exp512's
// 10 FMA-unit ops); Q.K ~44 of them (the same loop alone in a small function: ~36),
// exp ~14, P.V ~31 (1 vdpbf16ps per cycle). The exponentials run 8 keys in lockstep
// (one Horner chain alone left the units waiting on its latency), and wholly visible
// parts skip the mask; fusing the softmax into P.V's first head dims, unrolling the
// quads or moving Q.K into a function of its own measured no better.
constexpr int64_t kPartMax = 512;
constexpr int kPfKeys = 8;  // K rows prefetched this many keys ahead in the score loop

inline int64_t part_end(int seg, int64_t p0) {  // as kvs::walk::part_end (paged_walk.h)
  int64_t e = (p0 / kPartMax + 1) * kPartMax;
  if (seg > 0) e = std::min<int64_t>(e, (p0 / seg + 1) * seg);
  return e;
}

// exp512(x) of kvs_common.h where x <= 0 (or NaN: -87 there as well), the lanes not in
// `keep` zero: bitwise maskz_mov(keep, exp512(x)). (Its upper clamp at 88 never acts
// on x <= 0, and the zeroing is folded into the last instruction.)
inline __m512 exp512_nonpos_maskz(__mmask16 keep, __m512 x) {
  __m512 p, n;
  kvs::exp512_parts(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), p, n);
  return _mm512_maskz_scalef_ps(keep, p, n);
}

// exp512_nonpos_maskz of N vectors in lockstep (in place): each lane's arithmetic is
// that of one call; the N independent chains interleaved give the scheduler work that
// a single Horner chain (one step ready per ~4 cycles) does not.
template <int N>
inline void exp512_nonpos_maskz_n(const __mmask16* keep, __m512* x) {
  __m512 nn[N], p[N];
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) x[i] = _mm512_max_ps(x[i], _mm512_set1_ps(-87.0f));
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i)
    nn[i] = _mm512_roundscale_ps(_mm512_mul_ps(x[i], _mm512_set1_ps(1.4426950408889634f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) x[i] = _mm512_fnmadd_ps(nn[i], _mm512_set1_ps(0.693145751953125f), x[i]);
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) x[i] = _mm512_fnmadd_ps(nn[i], _mm512_set1_ps(1.428606765330187e-06f), x[i]);
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) p[i] = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 5040.0f), x[i], _mm512_set1_ps(1.0f / 720.0f));
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) p[i] = _mm512_fmadd_ps(p[i], x[i], _mm512_set1_ps(1.0f / 120.0f));
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) p[i] = _mm512_fmadd_ps(p[i], x[i], _mm512_set1_ps(1.0f / 24.0f));
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) p[i] = _mm512_fmadd_ps(p[i], x[i], _mm512_set1_ps(1.0f / 6.0f));
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) p[i] = _mm512_fmadd_ps(p[i], x[i], _mm512_set1_ps(0.5f));
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) p[i] = _mm512_fmadd_ps(p[i], x[i], _mm512_set1_ps(1.0f));
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) p[i] = _mm512_fmadd_ps(p[i], x[i], _mm512_set1_ps(1.0f));
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) x[i] = _mm512_maskz_scalef_ps(keep[i], p[i], nn[i]);
}

// the head dim that unit (dv, lane) of a score chain multiplies: natural order for
// float32, the paged kernel's split order for widened bfloat16
template <typename T>
constexpr int inv_dim(int dv, int lane) {
  if constexpr (std::is_same_v<T, bf16_t>) return 32 * (dv / 2) + 2 * lane + (dv % 2);
  return 16 * dv + lane;
}

// The tiles of one task: up to kInvTiles row tiles of one (seq, KV head), walked part
// by part together (each tile's parts as it would walk them alone), so a part's K and
// V rows are read from cache by every tile in turn instead of each tile streaming the
// whole context. A tile's arithmetic does not depend on the others. (kInvTiles: at
// the top, run_all uses it on every ISA.)

template <typename T, int D, bool kDp>
void run_task_inv(const Args& a, int seg, const Task* tasks, int ntiles, const uint32_t* vp) {
  using V = V512;
  using vec = __m512;
  constexpr int L = 16, DV = D / 16, DB = 16, KB = 4;
  const Task& t0 = tasks[0];  // every tile: this seq and KV head
  const int64_t* s = a.seqs + 5 * t0.seq;
  const int64_t row_start = s[0], num_tokens = s[2];
  const int g = a.num_heads / a.num_kv_heads;
  const int64_t m_total = num_tokens * g;
  const int64_t* bt = a.block_tables + t0.seq * a.max_blocks;

  alignas(64) float QT[kInvTiles][kDp ? 1 : D][L];
  alignas(64) uint32_t QP[kInvTiles][kDp ? D / 2 : 1][L];
  alignas(64) float OBUF[kInvTiles][D][L];
  alignas(64) int32_t LIM[kInvTiles][L];
  alignas(64) float MXA[kInvTiles][L], LA[kInvTiles][L];
  int64_t MAXLIM[kInvTiles], MINLIM[kInvTiles];
  alignas(64) float sbuf[kPartMax][L];  // scores, then P (P in key pairs for kDp)
  alignas(64) float pbuf[D][L];  // the part's own P.V
  alignas(64) float mna[L], csa[L], cpa[L];
  const T* kptr[kPartMax];
  const T* vptr[kPartMax];
  int64_t max_all = 0;
  for (int ti = 0; ti < ntiles; ++ti) {
    const Task& t = tasks[ti];
    const int m_hi = static_cast<int>(std::min<int64_t>(L, m_total - t.r0));
    auto& qt = QT[ti];
    auto& qp = QP[ti];
    auto& lim_arr = LIM[ti];
    int64_t max_lim, min_lim;
    load_q_tile<T, D, kDp, L>(a, t, m_hi, qt, qp, lim_arr, max_lim, min_lim);
    for (int m = 0; m < L; ++m) {
      MXA[ti][m] = kNegInf;
      LA[ti][m] = 0.f;
    }
    for (int d = 0; d < D; ++d) V::store(OBUF[ti][d], V::zero());
    MAXLIM[ti] = max_lim;
    MINLIM[ti] = min_lim;
    max_all = std::max(max_all, max_lim);
  }
  const vec scale = V::set1(a.scale);
  const vec neg_inf = V::set1(kNegInf);

  for (int64_t p0 = 0; p0 < max_all;) {
    const int64_t pe = part_end(seg, p0);
    {  // the rows of the part's keys that any tile reads
      const int n_all = static_cast<int>(std::min<int64_t>(pe, max_all) - p0);
      row_ptrs<T>(a, bt, 0, t0.h, p0, n_all, kptr);
      if constexpr (!kDp) row_ptrs<T>(a, bt, 1, t0.h, p0, n_all, vptr);
    }
   for (int ti = 0; ti < ntiles; ++ti) {
    if (MAXLIM[ti] <= p0) continue;
    // the tile's part [p0, p1): bounded at the tile's last visible key
    const int64_t p1 = std::min<int64_t>(pe, MAXLIM[ti]);
    const int n = static_cast<int>(p1 - p0);
    [[maybe_unused]] auto& qt = QT[ti];
    [[maybe_unused]] auto& qp = QP[ti];
    auto& obuf = OBUF[ti];
    auto& mxa = MXA[ti];
    auto& la = LA[ti];
    const __m512i lim = V::loadi(LIM[ti]);
    // 1. scores, KB keys at a time (rows past n point at key 0 of the part: unused),
    // and the part's max per row (the max of the same values in any order)
    vec vmax = neg_inf;
    // whole groups of KB keys, each visible to all 16 lanes (visible() would keep x)
    const bool all_visible = MINLIM[ti] >= p1 && n % KB == 0;
    for (int k0 = 0; k0 < n; k0 += KB) {
      const int nk = std::min(KB, n - k0);
      const T* kr[KB];
      for (int kk = 0; kk < KB; ++kk) kr[kk] = kptr[k0 + (kk < nk ? kk : 0)];
      if (k0 + kPfKeys < n) {  // K a few keys ahead (blocks are scattered)
        const char* nx = reinterpret_cast<const char*>(kptr[k0 + kPfKeys]);
        for (int o = 0; o < static_cast<int>(D * sizeof(T)); o += 64) _mm_prefetch(nx + o, _MM_HINT_T0);
      }
      vec h01[KB], g2[KB], sc[KB];
      for (int q4 = 0; q4 < 4; ++q4) {
        vec P[KB][4];
        if constexpr (kDp) {
#if defined(KVS_PF_HAVE_DP)
          // pair j of every (key, lane) chain before pair j + 1: a chain's next
          // vdpbf16ps comes 16 instructions after its last (its latency hidden)
          for (int kk = 0; kk < KB; ++kk)
            for (int li = 0; li < 4; ++li) P[kk][li] = V::zero();
          for (int j = 0; j < D / 32; ++j) {
            for (int li = 0; li < 4; ++li) {
              const int ln = 4 * q4 + li;
              const __m512bh qv = (__m512bh)_mm512_load_si512(qp[16 * j + ln]);
              for (int kk = 0; kk < KB; ++kk)
                P[kk][li] = dp_bcast(P[kk][li], qv, reinterpret_cast<const u32a*>(kr[kk]) + 16 * j + ln);
            }
          }
#endif
        }
        for (int li = 0; li < 4 && !kDp; ++li) {
          const int ln = 4 * q4 + li;
          {
            {
              const vec qv = V::load(qt[inv_dim<T>(0, ln)]);
              for (int kk = 0; kk < KB; ++kk) P[kk][li] = V::mul(V::bcast(kr[kk] + inv_dim<T>(0, ln)), qv);
            }
            for (int dv = 1; dv < DV; ++dv) {
              const vec qv = V::load(qt[inv_dim<T>(dv, ln)]);
              for (int kk = 0; kk < KB; ++kk)
                P[kk][li] = V::fma(V::bcast(kr[kk] + inv_dim<T>(dv, ln)), qv, P[kk][li]);
            }
          }
        }
        for (int kk = 0; kk < KB; ++kk) {
          const vec G = V::add(V::add(P[kk][0], P[kk][2]), V::add(P[kk][1], P[kk][3]));
          if (q4 == 0) h01[kk] = G;
          else if (q4 == 1) h01[kk] = V::add(h01[kk], G);
          else if (q4 == 2) g2[kk] = G;
          else sc[kk] = V::add(h01[kk], V::add(g2[kk], G));
        }
      }
      if (all_visible) {  // every key of the part visible to every lane: no mask
        for (int kk = 0; kk < KB; ++kk) {
          const vec x = V::mul(sc[kk], scale);
          V::store(sbuf[k0 + kk], x);
          vmax = V::max(vmax, x);
        }
      } else if (nk == KB) {
        for (int kk = 0; kk < KB; ++kk) {
          const vec x = V::visible(lim, static_cast<int32_t>(p0 + k0 + kk), V::mul(sc[kk], scale));
          V::store(sbuf[k0 + kk], x);
          vmax = V::max(vmax, x);
        }
      } else {
        for (int kk = 0; kk < nk; ++kk) {
          const vec x = V::visible(lim, static_cast<int32_t>(p0 + k0 + kk), V::mul(sc[kk], scale));
          V::store(sbuf[k0 + kk], x);
          vmax = V::max(vmax, x);
        }
      }
    }
    // 2. the part's own softmax per row (against the part's max) and its sum: keys in
    // 16 key-offset lanes (key k of the part in lane k % 16, as the paged kernel's
    // vector over the part's row), keys past n as -inf (they add exact zeros); rows
    // that see no key of the part are left as they are (the paged kernel skips them).
    // The dot variant writes the probabilities as bf16 key pairs in place: pair kk
    // over score row kk (rows 2kk, 2kk + 1 are read first).
    const int n16 = (n + 15) / 16 * 16;
    for (int k = n; k < n16; ++k) V::store(sbuf[k], neg_inf);
    const __mmask16 active = _mm512_cmpgt_epi32_mask(lim, _mm512_set1_epi32(static_cast<int32_t>(p0)));
    V::store(mna, vmax);
    vec vs[16];
    for (int r = 0; r < 16; ++r) vs[r] = V::zero();
    [[maybe_unused]] uint32_t(*pp)[L] = reinterpret_cast<uint32_t(*)[L]>(sbuf);
    // NE keys' exponentials in lockstep: a single Horner chain leaves the FMA units
    // waiting on its latency (measured: 3-4 % of the kernel's time at 2,048 tokens)
    constexpr int NE = 8;
    for (int k16 = 0; k16 < n16; k16 += 16) {
      for (int i = 0; i < 16; i += NE) {
        vec e[NE];
        __mmask16 keep[NE];
        for (int u = 0; u < NE; ++u) {
          const vec x = V::load(sbuf[k16 + i + u]);
          keep[u] = _mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ);
          e[u] = _mm512_sub_ps(x, vmax);
        }
        exp512_nonpos_maskz_n<NE>(keep, e);
        for (int u = 0; u < NE; ++u) vs[i + u] = V::add(vs[i + u], e[u]);
        for (int u = 0; u < NE; u += 2) {
          if constexpr (kDp) {
#if defined(KVS_PF_HAVE_DP)
            // lane 2m <- x[m], lane 2m + 1 <- y[m] for the 32 bf16 of cvtne2ps_pbh(y, x)
            const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
            const __m512bh pair = _mm512_cvtne2ps_pbh(e[u + 1], e[u]);
            _mm512_store_si512(pp[(k16 + i + u) / 2], _mm512_permutexvar_epi16(interleave, (__m512i)pair));
#endif
          } else {
            V::store(sbuf[k16 + i + u], e[u]);
            V::store(sbuf[k16 + i + u + 1], e[u + 1]);
          }
        }
      }
    }
    vec lpart;
    {  // GCC's _mm512_reduce_add_ps tree over the 16 key-offset lanes
      vec t3[8], t6[4];
      for (int i = 0; i < 8; ++i) t3[i] = V::add(vs[8 + i], vs[i]);
      for (int i = 0; i < 4; ++i) t6[i] = V::add(t3[4 + i], t3[i]);
      lpart = V::add(V::add(t6[0], t6[2]), V::add(t6[1], t6[3]));
    }
    // 3. the part's P . V in key order, from zero
    if constexpr (kDp) {
#if defined(KVS_PF_HAVE_DP)
      const int npairs = (n + 1) / 2;
      const uint32_t* vc = vp + (p0 / 2) * D;
      for (int d0 = 0; d0 < D; d0 += DB) {
        vec acc[DB];
        for (int j = 0; j < DB; ++j) acc[j] = V::zero();
        for (int kk = 0; kk < npairs; ++kk) {
          const __m512bh pv = (__m512bh)_mm512_load_si512(pp[kk]);
          const u32a* vr = reinterpret_cast<const u32a*>(vc + kk * D + d0);
          for (int j = 0; j < DB; ++j) acc[j] = dp_bcast(acc[j], pv, vr + j);
        }
        for (int j = 0; j < DB; ++j) V::store(pbuf[d0 + j], acc[j]);
      }
#endif
    } else {
      for (int d0 = 0; d0 < D; d0 += DB) {
        vec acc[DB];
        for (int j = 0; j < DB; ++j) acc[j] = V::zero();
        for (int k = 0; k < n; ++k) {
          const vec pk = V::load(sbuf[k]);
          const T* vr = vptr[k] + d0;
          for (int j = 0; j < DB; ++j) acc[j] = V::fma(V::bcast(vr + j), pk, acc[j]);
        }
        for (int j = 0; j < DB; ++j) V::store(pbuf[d0 + j], acc[j]);
      }
    }
    // 4. merge the part into the running state exactly as paged_attention.cpp's
    // merge_part: m = max(m, mp), l = fma(l, cs, lp * cp), acc = fma(acc, cs, accp * cp)
    for (int m = 0; m < L; ++m) {
      if (!((active >> m) & 1)) {
        csa[m] = 1.f;
        cpa[m] = 0.f;
        continue;
      }
      const float m_new = std::max(mxa[m], mna[m]);
      csa[m] = mxa[m] == kNegInf ? 0.f : std::exp(mxa[m] - m_new);
      cpa[m] = std::exp(mna[m] - m_new);
      mxa[m] = m_new;
    }
    {
      const vec cs = V::load(csa), cp = V::load(cpa);
      V::store(la, _mm512_mask_mov_ps(V::load(la), active,
                                      _mm512_fmadd_ps(V::load(la), cs, V::mul(lpart, cp))));
      for (int d = 0; d < D; ++d)
        V::store(obuf[d], _mm512_mask_mov_ps(V::load(obuf[d]), active,
                                             _mm512_fmadd_ps(V::load(obuf[d]), cs, V::mul(V::load(pbuf[d]), cp))));
    }
   }
    p0 = pe;
  }

  T* out = static_cast<T*>(a.out);
  for (int ti = 0; ti < ntiles; ++ti) {
  const Task& t = tasks[ti];
  const int m_hi = static_cast<int>(std::min<int64_t>(L, m_total - t.r0));
  auto& obuf = OBUF[ti];
  auto& mxa = MXA[ti];
  auto& la = LA[ti];
  for (int m = 0; m < m_hi; ++m) {  // kvs::walk::finish_row (paged_walk.h)
    const int64_t r = t.r0 + m, row = batch_row(a, row_start + r / g);
    const int head = t.h * g + static_cast<int>(r % g);
    T* o = out + (row * a.num_heads + head) * D;
    const float mx = mxa[m], l = la[m];
    const float mine = l > 0.f ? mx + std::log(l) : kNegInf;
    float lse_new = mine, w_old = 0.f, w_acc = l > 0.f ? 1.f / l : 0.f;
    float* lse = a.lse ? a.lse + row * a.num_heads + head : nullptr;
    if (a.merge && *lse != kNegInf) {
      const float old = *lse;
      lse_new = std::max(old, mine) + std::log1p(std::exp(-std::fabs(old - mine)));
      w_old = std::exp(old - lse_new);
      w_acc *= mine == kNegInf ? 0.f : std::exp(mine - lse_new);
    }
    if (lse) *lse = lse_new;
    for (int d = 0; d < D; ++d)
      from_f32(std::fma(obuf[d][m], w_acc, w_old != 0.f ? to_f32(o[d]) * w_old : 0.f), o + d);
  }
  }
}
#endif  // KVS_PF_HAVE_512

// One task: L stacked query rows of one (seq, KV head) against all their keys.
// kDp: bfloat16 products with vdpbf16ps (V512 only; vp = the packed V pairs).
template <class V, typename T, int D, bool kDp>
void run_task(const Args& a, const Task& t, const uint32_t* vp) {
  using vec = typename V::vec;
  constexpr int L = V::L, KG = V::KG, DB = V::DB;
  static_assert(D % DB == 0 && D % 2 == 0, "head_dim");
  const int64_t* s = a.seqs + 5 * t.seq;
  const int64_t row_start = s[0], num_tokens = s[2];
  const int g = a.num_heads / a.num_kv_heads;
  const int64_t m_total = num_tokens * g;
  const int m_hi = static_cast<int>(std::min<int64_t>(L, m_total - t.r0));
  const int64_t* bt = a.block_tables + t.seq * a.max_blocks;
  const bool contiguous = a.block_size % KG == 0;  // a KG-key group lies in one block

  alignas(64) float qt[kDp ? 1 : D][L];          // Q^T (fp32 path)
  alignas(64) uint32_t qp[kDp ? D / 2 : 1][L];   // Q^T in dim pairs (dp path)
  alignas(64) float obuf[D][L];                  // O^T
  alignas(64) float sbuf[kKC][L];                // S^T, then P^T (fp32 path)
  alignas(64) uint32_t pp[kDp ? kKC / 2 : 1][L];  // P^T in key pairs (dp path)
  alignas(64) int32_t lim_arr[L];
  alignas(64) T kscr[KG][D];  // a key group copied together when blocks split it
  const T* vptr[kKC];
  int64_t max_lim, min_lim;
  load_q_tile<T, D, kDp, L>(a, t, m_hi, qt, qp, lim_arr, max_lim, min_lim);
  for (int d = 0; d < D; ++d) V::store(obuf[d], V::zero());
  // scores in base 2: exp(s * scale - m) = 2^(s * scale * log2(e) - m / ln 2)
  const vec scale = V::set1(a.scale * 1.4426950408889634f);
  const vec neg_inf = V::set1(kNegInf);
  const typename V::ivec lim = V::loadi(lim_arr);
  vec mx = neg_inf, l = V::zero();

  for (int64_t c0 = 0; c0 < max_lim; c0 += kKC) {
    const int nvalid = static_cast<int>(std::min<int64_t>(kKC, max_lim - c0));  // keys read
    // 1. S^T = K . Q^T, KG keys at a time; key groups past max_lim are -inf
    for (int k0 = 0; k0 < kKC; k0 += KG) {
      if (k0 >= nvalid) {
        for (int k = k0; k < kKC; ++k) V::store(sbuf[k], neg_inf);
        break;
      }
      const int nk = std::min(KG, nvalid - k0);
      const T* kg;  // KG rows of D, contiguous (rows past nk: don't-care, masked)
      if (contiguous) {
        kg = kv_row<T>(a, bt, 0, t.h, c0 + k0);
      } else {
        const T* rp[KG];
        row_ptrs<T>(a, bt, 0, t.h, c0 + k0, nk, rp);
        for (int k = 0; k < nk; ++k) std::memcpy(kscr[k], rp[k], D * sizeof(T));
        kg = &kscr[0][0];
      }
      vec acc[KG];
      for (int k = 0; k < KG; ++k) acc[k] = V::zero();
      if constexpr (kDp) {
#if defined(KVS_PF_HAVE_DP)
        const u32a* k32 = reinterpret_cast<const u32a*>(kg);
        for (int p = 0; p < D / 2; ++p) {
          const __m512bh qv = (__m512bh)_mm512_load_si512(qp[p]);
          for (int k = 0; k < KG; ++k)
            acc[k] = dp_bcast(acc[k], qv, k32 + k * (D / 2) + p);
        }
#endif
      } else {
        for (int d = 0; d < D; ++d) {
          const vec qv = V::load(qt[d]);
          for (int k = 0; k < KG; ++k) acc[k] = V::fma(V::bcast(kg + k * D + d), qv, acc[k]);
        }
      }
      for (int k = 0; k < KG; ++k) V::store(sbuf[k0 + k], acc[k]);
    }
    // 2. online softmax over the chunk (lanes = rows)
    const bool full = c0 + kKC <= min_lim;
    vec vmax = neg_inf;
    for (int k = 0; k < kKC; ++k) {
      vec v = V::load(sbuf[k]);
      if (!full) {
        v = V::visible(lim, static_cast<int32_t>(c0 + k), v);
        V::store(sbuf[k], v);
      }
      vmax = V::max(vmax, v);
    }
    // running max in base-2 units (scale > 0). Rows with no visible key yet keep max
    // -inf: use 0 there so exp2() gives 0, not NaN.
    const vec m_all = V::max(mx, V::mul(vmax, scale));
    const vec m_new = V::finite_or_zero(m_all, m_all);
    const vec neg_m = V::mul(m_new, V::set1(-1.0f));
    const vec alpha = V::finite_or_zero(mx, V::exp2(V::add(mx, neg_m)));
    vec sum = V::zero();
    for (int k = 0; k < kKC; k += 2) {
      const vec x0 = V::load(sbuf[k]), x1 = V::load(sbuf[k + 1]);
      vec e0 = V::exp2(V::fma(x0, scale, neg_m));
      vec e1 = V::exp2(V::fma(x1, scale, neg_m));
      if (!full) {  // masked keys (-inf) would give 2^-126, not 0
        e0 = V::finite_or_zero(x0, e0);
        e1 = V::finite_or_zero(x1, e1);
      }
      if constexpr (kDp) {
#if defined(KVS_PF_HAVE_DP)
        // lane 2m <- x[m], lane 2m + 1 <- y[m] for the 32 bf16 of cvtne2ps_pbh(y, x)
        const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                    23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        const __m512bh pair = _mm512_cvtne2ps_pbh(e1, e0);
        _mm512_store_si512(pp[k / 2], _mm512_permutexvar_epi16(interleave, (__m512i)pair));
#endif
      } else {
        V::store(sbuf[k], e0);
        V::store(sbuf[k + 1], e1);
      }
      sum = V::add(sum, V::add(e0, e1));
    }
    l = V::fma(l, alpha, sum);
    mx = m_all;
    // 3. O^T = O^T * alpha + V^T . P^T, DB head dims at a time
    if constexpr (kDp) {
#if defined(KVS_PF_HAVE_DP)
      const uint32_t* vc = vp + (c0 / 2) * D;  // the chunk's 32 key pairs (zero-padded)
      for (int d0 = 0; d0 < D; d0 += DB) {
        vec acc[DB];
        for (int j = 0; j < DB; ++j) acc[j] = V::mul(V::load(obuf[d0 + j]), alpha);
        for (int kk = 0; kk < kKC / 2; ++kk) {
          const __m512bh pv = (__m512bh)_mm512_load_si512(pp[kk]);
          const u32a* vr = vc + kk * D + d0;
          for (int j = 0; j < DB; ++j) acc[j] = dp_bcast(acc[j], pv, vr + j);
        }
        for (int j = 0; j < DB; ++j) V::store(obuf[d0 + j], acc[j]);
      }
#endif
    } else {
      // keys past max_lim have P = 0 for every row: skipping them adds nothing
      row_ptrs<T>(a, bt, 1, t.h, c0, nvalid, vptr);
      for (int d0 = 0; d0 < D; d0 += DB) {
        vec acc[DB];
        for (int j = 0; j < DB; ++j) acc[j] = V::mul(V::load(obuf[d0 + j]), alpha);
        for (int k = 0; k < nvalid; ++k) {
          const vec pk = V::load(sbuf[k]);
          const T* vr = vptr[k] + d0;
          for (int j = 0; j < DB; ++j) acc[j] = V::fma(V::bcast(vr + j), pk, acc[j]);
        }
        for (int j = 0; j < DB; ++j) V::store(obuf[d0 + j], acc[j]);
      }
    }
  }

  alignas(64) float lv[L], mv[L];
  V::store(lv, l);
  V::store(mv, mx);
  T* out = static_cast<T*>(a.out);
  for (int m = 0; m < m_hi; ++m) {
    const int64_t r = t.r0 + m, row = batch_row(a, row_start + r / g);
    const int head = t.h * g + static_cast<int>(r % g);
    T* o = out + (row * a.num_heads + head) * D;
    float* lse = a.lse ? a.lse + row * a.num_heads + head : nullptr;
    const float mine = lv[m] > 0.f ? mv[m] * 0.6931471805599453f + std::log(lv[m]) : kNegInf;
    float w_mine = lv[m] > 0.f ? 1.f / lv[m] : 0.f, w_old = 0.f, lse_new = mine;
    if (a.merge && *lse != kNegInf) {  // exact merge with the part already in out/lse
      const float old = *lse;
      lse_new = std::max(old, mine) + std::log1p(std::exp(-std::fabs(old - mine)));
      w_old = std::exp(old - lse_new);
      w_mine *= mine == kNegInf ? 0.f : std::exp(mine - lse_new);
    }
    for (int d = 0; d < D; ++d) {
      const float prev = w_old != 0.f ? to_f32(o[d]) * w_old : 0.f;
      from_f32(prev + obuf[d][m] * w_mine, o + d);
    }
    if (lse) *lse = lse_new;
  }
}

template <class V, typename T, int D, bool kDp, bool kInv = false>
void run_all(const Args& a, int64_t num_seqs, int num_threads, int seg = 0) {
  constexpr int L = V::L;
  const int g = a.num_heads / a.num_kv_heads;
  const int64_t hk = a.num_kv_heads;
  // packed V pairs (dp path): one buffer per (seq, KV head), kept on the calling thread
  static thread_local std::vector<uint32_t> store;
  std::vector<int64_t> offset(kDp ? num_seqs * hk + 1 : 1, 0);
  if constexpr (kDp) {
    for (int64_t s = 0; s < num_seqs; ++s) {
      const int64_t padded = (num_keys(a, s) + kKC - 1) / kKC * kKC;
      for (int64_t h = 0; h < hk; ++h) offset[s * hk + h + 1] = offset[s * hk + h] + padded / 2 * a.head_dim;
    }
    if (store.size() < static_cast<size_t>(offset.back())) store.resize(offset.back());
  }
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t m_total = a.seqs[5 * s + 2] * g;
    // longest rows (latest positions, most keys) first: better load balance. The
    // invariant variant walks KV head by KV head, so the threads share one head's K
    // (and packed V) at a time and a thread's L2 holds one head's instead of cycling
    // through all of them (measured: 4 % less CPU time at 2,048 tokens, 9-11 % at
    // 4,096, one thread, SmolLM2's 3 KV heads; benchmarks/prefill_inv_micro.py)
    if (kInv) {
      for (int h = 0; h < a.num_kv_heads; ++h)
        for (int64_t r0 = (m_total - 1) / L * L; r0 >= 0; r0 -= L) tasks.push_back(Task{s, h, r0});
      continue;
    }
    for (int64_t r0 = (m_total - 1) / L * L; r0 >= 0; r0 -= L)
      for (int h = 0; h < a.num_kv_heads; ++h) tasks.push_back(Task{s, h, r0});
  }
  const int64_t num_packs = kDp ? num_seqs * hk : 0;
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  // the invariant variant runs consecutive row tiles of one (seq, KV head) together
  // (run_task_inv), tiles [group_start[i], group_start[i + 1]); as many per group as
  // leave at least 8 groups per thread (short calls keep one tile per item)
  std::vector<int64_t> group_start;
  if constexpr (kInv) {
    const int64_t per = std::clamp<int64_t>(num_tasks / (8 * std::max(1, num_threads)), 1, kInvTiles);
    for (int64_t i = 0, run = 0; i < num_tasks; ++i, ++run) {
      if (i == 0 || run == per || tasks[i].seq != tasks[i - 1].seq || tasks[i].h != tasks[i - 1].h) {
        group_start.push_back(i);
        run = 0;
      }
    }
    group_start.push_back(num_tasks);
  }
  const int64_t num_items = kInv ? static_cast<int64_t>(group_start.size()) - 1 : num_tasks;
  uint32_t* base = store.data();
#pragma omp parallel num_threads(std::max(1, num_threads))
  {
#if defined(KVS_PF_HAVE_DP)
    if constexpr (kDp) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < num_packs; ++i) {
        const int64_t s = i / hk;
        pack_v_pairs(a, a.block_tables + s * a.max_blocks, static_cast<int>(i % hk), num_keys(a, s),
                     base + offset[i]);
      }
    }
#else
    (void)num_packs, (void)base;
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) {
      const Task& t = tasks[kInv ? group_start[i] : i];
      const uint32_t* vpk = kDp ? base + offset[t.seq * hk + t.h] : nullptr;
#if defined(KVS_PF_HAVE_512)
      if constexpr (kInv) {
        run_task_inv<T, D, kDp>(a, seg, &t, static_cast<int>(group_start[i + 1] - group_start[i]), vpk);
        continue;
      }
#endif
      run_task<V, T, D, kDp>(a, t, vpk);
    }
  }
  // padding rows: zero output, lse -inf
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t row_start = a.seqs[5 * s], rows = a.seqs[5 * s + 1], toks = a.seqs[5 * s + 2];
    for (int64_t j = toks; j < rows; ++j) {
      const int64_t row = batch_row(a, row_start + j);
      std::memset(static_cast<T*>(a.out) + row * a.num_heads * a.head_dim, 0,
                  a.num_heads * a.head_dim * sizeof(T));
      if (a.lse)
        for (int hh = 0; hh < a.num_heads; ++hh) a.lse[row * a.num_heads + hh] = kNegInf;
    }
  }
}

// isa: 1 = AVX2 (fp32 FMAs), 2 = AVX-512 fp32 FMAs, 3 = AVX-512 vdpbf16ps (bf16 only)
template <typename T, int D>
int dispatch(const Args& a, int64_t num_seqs, int num_threads, int isa) {
  switch (isa) {
#if defined(KVS_PF_HAVE_DP)
    case 3:
      if constexpr (std::is_same_v<T, bf16_t>) {
        run_all<V512, T, D, true>(a, num_seqs, num_threads);
        return 0;
      }
      return 2;
#endif
#if defined(KVS_PF_HAVE_512)
    case 2: run_all<V512, T, D, false>(a, num_seqs, num_threads); return 0;
#endif
#if defined(KVS_PF_HAVE_256)
    case 1: run_all<V256, T, D, false>(a, num_seqs, num_threads); return 0;
#endif
    default: return 2;
  }
}

#if defined(KVS_PF_HAVE_512)
template <typename T, int D>
void dispatch_inv(const Args& a, int64_t num_seqs, int num_threads, int seg) {
#if defined(KVS_PF_HAVE_DP)
  if constexpr (std::is_same_v<T, bf16_t>) {
    if (kvs::use_bf16_dot()) return run_all<V512, T, D, true, true>(a, num_seqs, num_threads, seg);
  }
#endif
  run_all<V512, T, D, false, true>(a, num_seqs, num_threads, seg);
}
#endif

// The ISAs this build has and this CPU runs, as a bit set (1 << isa).
int available_isas() {
  int bits = 0;
#if defined(KVS_PF_HAVE_256)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) bits |= 1 << 1;
#endif
#if defined(KVS_PF_HAVE_512)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) bits |= 1 << 2;
#endif
#if defined(KVS_PF_HAVE_DP)
  if ((bits & (1 << 2)) && __builtin_cpu_supports("avx512bf16")) bits |= 1 << 3;
#endif
  return bits;
}

}  // namespace

extern "C" {

// Bit set of the usable variants: bit 1 AVX2, bit 2 AVX-512 fp32, bit 3 AVX-512 bf16 dot.
int kvs_prefill_vec_isas() { return available_isas(); }

// Returns 0 on success; 1: unsupported dtype; 2: the requested ISA is unavailable
// (isa 0 = the best usable one: vdpbf16ps for bfloat16 on AMD CPUs that have it, else
// AVX-512 fp32, else AVX2); 3: unsupported shape (head_dim 32, 64 or 128; num_heads a multiple
// of num_kv_heads); 4: merge without lse. dtype: 0 = float32, 1 = bfloat16.
int kvs_prefill_attention_vec(const void* q, int64_t q_row_stride, int64_t q_head_stride,
                              void* out, const void* kv, int64_t num_blocks, int block_size,
                              int num_heads, int num_kv_heads, int head_dim, const int64_t* seqs,
                              int64_t num_seqs, const int64_t* block_tables, int64_t max_blocks,
                              float scale, int dtype, int isa, int num_threads, float* lse,
                              const int64_t* row_map, int merge) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || block_size <= 0) return 3;
  if (head_dim != 32 && head_dim != 64 && head_dim != 128) return 3;
  if (merge && lse == nullptr) return 4;
  if (dtype != 0 && dtype != 1) return 1;
  const int bits = available_isas();
  if (isa == 0) {  // vdpbf16ps where it was measured fast (AMD), see the top of this file
    if (dtype == 1 && (bits & (1 << 3)) && __builtin_cpu_is("amd")) isa = 3;
    else if (bits & (1 << 2)) isa = 2;
    else if (bits & (1 << 1)) isa = 1;
    else return 2;
  }
  if (isa < 1 || isa > 3 || !(bits & (1 << isa)) || (isa == 3 && dtype != 1)) return 2;
  Args a{q,         q_row_stride, q_head_stride, out,          kv,        num_blocks, block_size,
         num_heads, num_kv_heads, head_dim,      seqs,         block_tables, max_blocks, scale,
         lse,       row_map,      merge};
  if (dtype == 0) {
    switch (head_dim) {
      case 32: return dispatch<float, 32>(a, num_seqs, num_threads, isa);
      case 64: return dispatch<float, 64>(a, num_seqs, num_threads, isa);
      default: return dispatch<float, 128>(a, num_seqs, num_threads, isa);
    }
  }
  switch (head_dim) {
    case 32: return dispatch<bf16_t, 32>(a, num_seqs, num_threads, isa);
    case 64: return dispatch<bf16_t, 64>(a, num_seqs, num_threads, isa);
    default: return dispatch<bf16_t, 128>(a, num_seqs, num_threads, isa);
  }
}

// The batch-invariant variant (see run_task_inv): the arguments of
// kvs_prefill_attention_vec without isa, plus seg (kv_segment_size, 0: none).
// Returns 0 on success; 1: unsupported dtype; 2: no AVX-512 (F + BW) here; 3:
// unsupported shape (head_dim 32, 64 or 128, num_heads a multiple of num_kv_heads,
// an even block_size, seg a multiple of 2); 4: merge without lse.
int kvs_prefill_attention_inv(const void* q, int64_t q_row_stride, int64_t q_head_stride,
                              void* out, const void* kv, int64_t num_blocks, int block_size,
                              int num_heads, int num_kv_heads, int head_dim, const int64_t* seqs,
                              int64_t num_seqs, const int64_t* block_tables, int64_t max_blocks,
                              int seg, float scale, int dtype, int num_threads, float* lse,
                              const int64_t* row_map, int merge) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || block_size <= 0) return 3;
  if (head_dim != 32 && head_dim != 64 && head_dim != 128) return 3;
  if (block_size % 2 != 0 || seg < 0 || seg % 2 != 0) return 3;
  if (merge && lse == nullptr) return 4;
  if (dtype != 0 && dtype != 1) return 1;
#if defined(KVS_PF_HAVE_512)
  if (!(available_isas() & (1 << 2))) return 2;
  Args a{q,         q_row_stride, q_head_stride, out,          kv,        num_blocks, block_size,
         num_heads, num_kv_heads, head_dim,      seqs,         block_tables, max_blocks, scale,
         lse,       row_map,      merge};
  if (dtype == 0) {
    switch (head_dim) {
      case 32: dispatch_inv<float, 32>(a, num_seqs, num_threads, seg); return 0;
      case 64: dispatch_inv<float, 64>(a, num_seqs, num_threads, seg); return 0;
      default: dispatch_inv<float, 128>(a, num_seqs, num_threads, seg); return 0;
    }
  }
  switch (head_dim) {
    case 32: dispatch_inv<bf16_t, 32>(a, num_seqs, num_threads, seg); return 0;
    case 64: dispatch_inv<bf16_t, 64>(a, num_seqs, num_threads, seg); return 0;
    default: dispatch_inv<bf16_t, 128>(a, num_seqs, num_threads, seg); return 0;
  }
#else
  (void)q_row_stride, (void)q_head_stride, (void)out, (void)kv, (void)num_blocks, (void)seqs,
      (void)num_seqs, (void)block_tables, (void)max_blocks, (void)scale, (void)num_threads,
      (void)lse, (void)row_map, (void)q;
  return 2;
#endif
}
}
