// Prefill attention on Intel AMX tiles, reading K/V from kvserve's paged cache.
//
// For prefill chunks of many rows (bfloat16, head_dim 64): each query row attends to
// every key up to its own position, [0, cached_seq_len + j], prior context and the
// chunk's own tokens alike, all read from the pages (the caller wrote the chunk's K/V
// before the call). Q.K^T and P.V run as AMX bf16 tile products (TDPBF16PS), the
// softmax in AVX-512 fp32, merged chunk by chunk with the exact online-softmax rule
// (running max m, running sum l, output rescaled by exp(m_old - m_new)). Key chunks
// are 64 tokens, so segment boundaries (multiples of 512) are chunk boundaries: the
// per-segment softmax + merge of the portable path is the same computation.
//
// Same layout as paged_attention.cpp:
//   kv:   [2, Hk, num_blocks, block_size, D] bfloat16, block_size a multiple of 16
//   q:    [T, H, D] strided (row stride, head stride; the last dim contiguous)
//   out:  [T, H, D] contiguous bfloat16; only the rows of the given seqs are written
//   seqs: [num_seqs, 5] int64 = (row_start, num_rows, num_tokens, cached_seq_len, prior_only)
//   lse:  [T, H] fp32 or null
//   row_map: [*] int64 or null: token j of a seq is batch row row_map[row_start + j]
//            (null: row_start + j), for q, out and lse alike
// Rows j >= num_tokens are padding: output zero, lse -inf. With prior_only = 1 every
// row of the seq attends to [0, cached_seq_len) alone, whatever its position.
//
// Cascade (shared-prefix) decode: decode rows of several requests whose block tables
// start with the same blocks are one seq (prior_only = 1, cached_seq_len = the shared
// length, row_map = their rows), so the shared K/V are read and packed once for all of
// them and their queries fill the tiles. With merge = 1, out and lse already hold each
// row's attention over its other keys (its own suffix, from the vector kernel): the
// result is merged into them exactly (lse = logaddexp, weights exp(lse_i - lse)).
//
// Work: 1. per (seq, KV head), K and V are repacked once into the tile layouts
// (K^T and V in pairs of rows, "VNNI"); 2. per (seq, KV head, 16 stacked query rows)
// task -- the H/Hk query heads sharing a KV head are stacked as rows (token-major) --
// the tile loop. Tiles: 0-1 Q (dims 0-31, 32-63), 2-3 B operands, 4-7 accumulators.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

#include "kvs_common.h"  // defines KVS_HAVE_AMX where the build has AMX-BF16

namespace {

using kvs::bf16_t;

#if defined(KVS_HAVE_AMX)
using kvs::amx_permitted;
using kvs::configure_tiles;

constexpr int kD = 64;     // head dim
constexpr int kKC = 64;    // keys per softmax chunk (the S^T tiles below assume 64)
constexpr int kRows = 16;  // stacked query rows per task
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Args {
  const bf16_t* q;
  int64_t q_row_stride, q_head_stride;
  bf16_t* out;
  const bf16_t* kv;
  int64_t num_blocks;
  int block_size, num_heads, num_kv_heads;
  const int64_t* seqs;
  const int64_t* block_tables;
  int64_t max_blocks;
  float scale;
  float* lse;
  const int64_t* row_map;
  int merge;
};

inline int64_t batch_row(const Args& a, int64_t i) { return a.row_map ? a.row_map[i] : i; }

// keys a seq's rows read: [0, cached_seq_len) with prior_only, else up to the last token
inline int64_t num_keys(const Args& a, int64_t s) {
  const int64_t* e = a.seqs + 5 * s;
  return e[4] ? e[3] : e[3] + e[2];
}

// V of one (seq, KV head) transposed into tile operands, keys padded with zeros to
// a multiple of kKC: per 32-key group, four 16x32 bf16 tiles (dims 16c..16c+15):
//   vt[g][c][d][k] = V[32g + k][16c + d]
// K needs no repacking: 16 consecutive keys of a block are a tile operand as they lie.
struct Packed {
  bf16_t* vt;
  int64_t num_keys;  // cached_seq_len + num_tokens
};

inline const bf16_t* key_row(const Args& a, const int64_t* bt, int which, int h, int64_t p) {
  const int64_t bs = a.block_size;
  const int64_t base = (static_cast<int64_t>(which) * a.num_kv_heads + h) * a.num_blocks;
  return a.kv + ((base + bt[p / bs]) * bs + p % bs) * kD;
}

// In-register transpose of a 16x16 matrix of 32-bit elements (r[i] is row i).
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + j], 128-bit lane L: column 4L + j of rows 4i..4i+3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // gather lane L of u[j], u[4+j], u[8+j], u[12+j]
    const __m512i x0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);   // lanes 0, 2
    const __m512i x1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i y0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);   // lanes 1, 3
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_shuffle_i32x4(x0, x1, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(x0, x1, 0xDD);
    r[4 + j] = _mm512_shuffle_i32x4(y0, y1, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(y0, y1, 0xDD);
  }
}

void pack(const Args& a, const int64_t* bt, int h, const Packed& pk) {
  const int64_t padded = (pk.num_keys + kKC - 1) / kKC * kKC;
  // lane 2n <- x[n], lane 2n + 1 <- y[n]: one key pair per 32-bit element
  const __m512i idx_lo = _mm512_set_epi16(
      47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t g0 = 0; g0 < padded; g0 += 32) {
    bf16_t* dst = pk.vt + g0 * kD;  // [64 d][32 k]
    __m512i rows[4][16];  // [16-dim block][key pair] -> 16 dims of (V[2kp], V[2kp + 1])
    // a 16-key run never straddles a block (block_size % 16 == 0): one lookup per run
    const bf16_t* run[2] = {
        g0 < pk.num_keys ? key_row(a, bt, 1, h, g0) : nullptr,
        g0 + 16 < pk.num_keys ? key_row(a, bt, 1, h, g0 + 16) : nullptr};
    for (int kp = 0; kp < 16; ++kp) {
      const int64_t p0 = g0 + 2 * kp, p1 = p0 + 1;
      const bf16_t* base = run[kp >> 3];
      const bf16_t* v0 = p0 < pk.num_keys ? base + (2 * kp & 15) * kD : nullptr;
      const bf16_t* v1 = p1 < pk.num_keys ? base + ((2 * kp & 15) + 1) * kD : nullptr;
      const __m512i a0 = v0 ? _mm512_loadu_si512(v0) : zero, a1 = v0 ? _mm512_loadu_si512(v0 + 32) : zero;
      const __m512i b0 = v1 ? _mm512_loadu_si512(v1) : zero, b1 = v1 ? _mm512_loadu_si512(v1 + 32) : zero;
      rows[0][kp] = _mm512_permutex2var_epi16(a0, idx_lo, b0);  // dims 0..15
      rows[1][kp] = _mm512_permutex2var_epi16(a0, idx_hi, b0);  // dims 16..31
      rows[2][kp] = _mm512_permutex2var_epi16(a1, idx_lo, b1);  // dims 32..47
      rows[3][kp] = _mm512_permutex2var_epi16(a1, idx_hi, b1);  // dims 48..63
    }
    for (int c = 0; c < 4; ++c) {  // [key pair][dim] -> [dim][key pair] = [dim][32 keys]
      transpose16x16(rows[c]);
      for (int d = 0; d < 16; ++d) _mm512_storeu_si512(dst + (16 * c + d) * 32, rows[c][d]);
    }
  }
}

struct Task {
  int64_t seq;
  int h;
  int64_t r0;  // first stacked row (row = token * g + head in group)
};

// One task: 16 stacked query rows of one (seq, KV head) against all their keys.
// Everything is computed transposed -- S^T = K.Q^T and O^T = V^T.P^T -- so the 16
// query rows are the 16 lanes of every AVX-512 register in the softmax: max, exp,
// sums and rescaling are vertical, one register per key or per head dim.
void run_task(const Args& a, const Task& t, const Packed& pk, const int64_t* bt) {
  const int64_t* s = a.seqs + 5 * t.seq;
  const int64_t row_start = s[0], num_tokens = s[2], cached = s[3], prior_only = s[4];
  const int g = a.num_heads / a.num_kv_heads;
  const int64_t m_total = num_tokens * g;
  const int m_hi = static_cast<int>(std::min<int64_t>(kRows, m_total - t.r0));

  alignas(64) uint32_t qt[2 * 16 * 16];  // Q^T in pairs: qt[half][kk][m] = Q[m] dims 32h+2kk..+1
  alignas(64) float sbuf[kKC * kRows];    // S^T [key][row]
  alignas(64) bf16_t pbuf[kKC * kRows];   // P^T in pairs: [kk][row][2]
  alignas(64) float obuf[kD * kRows];     // O^T [dim][row]
  alignas(64) float tbuf[kD * kRows];
  alignas(64) int32_t lim_arr[kRows];
  int64_t max_lim = 0, min_lim = std::numeric_limits<int64_t>::max();
  for (int m = 0; m < kRows; ++m) {
    if (m < m_hi) {
      const int64_t r = t.r0 + m, j = r / g;
      const int head = t.h * g + static_cast<int>(r % g);
      const uint32_t* src = reinterpret_cast<const uint32_t*>(
          a.q + batch_row(a, row_start + j) * a.q_row_stride + head * a.q_head_stride);
      for (int d = 0; d < 32; ++d) qt[(d >> 4) * 256 + (d & 15) * 16 + m] = src[d];
      lim_arr[m] = static_cast<int32_t>(prior_only ? cached : cached + j + 1);
      max_lim = std::max<int64_t>(max_lim, lim_arr[m]);
      min_lim = std::min<int64_t>(min_lim, lim_arr[m]);
    } else {
      for (int d = 0; d < 32; ++d) qt[(d >> 4) * 256 + (d & 15) * 16 + m] = 0;
      lim_arr[m] = 0;
      min_lim = 0;
    }
  }
  std::memset(obuf, 0, sizeof(obuf));
  _tile_loadd(0, qt, 64);
  _tile_loadd(1, qt + 256, 64);
  // scores in base 2: exp(s * scale - m) = 2^(s * scale * log2(e) - m / ln 2)
  const __m512 scale = _mm512_set1_ps(a.scale * 1.4426950408889634f);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  const __m512i lim = _mm512_load_si512(lim_arr);
  __m512 mx = neg_inf, l = _mm512_setzero_ps();
  // lane 2m <- x[m], lane 2m + 1 <- y[m] for the 32 bf16 of cvtne2ps_pbh(y, x)
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);

  for (int64_t c0 = 0; c0 < max_lim; c0 += kKC) {
    // S^T = K . Q^T for keys [c0, c0 + 64): tiles 4-7, 16 keys each. Key groups past
    // the last key read the last valid group instead (their scores are masked).
    const bf16_t* kg[4];
    for (int gi = 0; gi < 4; ++gi)
      kg[gi] = key_row(a, bt, 0, t.h, std::min<int64_t>(c0 + 16 * gi, (pk.num_keys - 1) / 16 * 16));
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    _tile_loadd(2, kg[0], kD * 2);
    _tile_loadd(3, kg[0] + 32, kD * 2);
    _tile_dpbf16ps(4, 2, 0);
    _tile_dpbf16ps(4, 3, 1);
    _tile_loadd(2, kg[1], kD * 2);
    _tile_loadd(3, kg[1] + 32, kD * 2);
    _tile_dpbf16ps(5, 2, 0);
    _tile_dpbf16ps(5, 3, 1);
    _tile_loadd(2, kg[2], kD * 2);
    _tile_loadd(3, kg[2] + 32, kD * 2);
    _tile_dpbf16ps(6, 2, 0);
    _tile_dpbf16ps(6, 3, 1);
    _tile_loadd(2, kg[3], kD * 2);
    _tile_loadd(3, kg[3] + 32, kD * 2);
    _tile_dpbf16ps(7, 2, 0);
    _tile_dpbf16ps(7, 3, 1);
    _tile_stored(4, sbuf, kRows * 4);
    _tile_stored(5, sbuf + 16 * kRows, kRows * 4);
    _tile_stored(6, sbuf + 32 * kRows, kRows * 4);
    _tile_stored(7, sbuf + 48 * kRows, kRows * 4);
    // online softmax, one register per key (lanes = query rows)
    const bool full = c0 + kKC <= min_lim;
    __m512 x[kKC];  // raw scores, -inf where masked
    __m512 vmax = neg_inf;
    for (int k = 0; k < kKC; ++k) {
      __m512 v = _mm512_load_ps(sbuf + k * kRows);
      if (!full) {
        const __mmask16 vis = _mm512_cmpgt_epi32_mask(lim, _mm512_set1_epi32(static_cast<int32_t>(c0 + k)));
        v = _mm512_mask_blend_ps(vis, neg_inf, v);
      }
      x[k] = v;
      vmax = _mm512_max_ps(vmax, v);
    }
    // running max in scaled (base-2) units; scale > 0, so max(s * scale) = max(s) * scale.
    // Rows with no visible key yet keep max -inf: use 0 there so exp2() gives 0, not NaN.
    const __m512 m_all = _mm512_max_ps(mx, _mm512_mul_ps(vmax, scale));
    const __mmask16 has = _mm512_cmp_ps_mask(m_all, neg_inf, _CMP_NEQ_OQ);
    const __m512 m_new = _mm512_maskz_mov_ps(has, m_all);
    const __m512 neg_m = _mm512_sub_ps(_mm512_setzero_ps(), m_new);
    const __mmask16 had = _mm512_cmp_ps_mask(mx, neg_inf, _CMP_NEQ_OQ);
    const __m512 alpha = _mm512_maskz_mov_ps(had, kvs::exp2_bf16(_mm512_add_ps(mx, neg_m)));
    __m512 sum = _mm512_setzero_ps();
    for (int k = 0; k < kKC; k += 2) {
      const __m512 e0 = kvs::exp2_nonpos_bf16(_mm512_fmadd_ps(x[k], scale, neg_m));
      const __m512 e1 = kvs::exp2_nonpos_bf16(_mm512_fmadd_ps(x[k + 1], scale, neg_m));
      // masked keys (-inf) would give 2^-126, not 0: zero them unless the chunk is full
      const __m512 z0 = full ? e0 : _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x[k], neg_inf, _CMP_NEQ_OQ), e0);
      const __m512 z1 = full ? e1 : _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x[k + 1], neg_inf, _CMP_NEQ_OQ), e1);
      const __m512bh pair = _mm512_cvtne2ps_pbh(z1, z0);  // [z0 as bf16 | z1 as bf16]
      _mm512_store_si512(pbuf + k * kRows, _mm512_permutexvar_epi16(interleave, (__m512i)pair));
      sum = _mm512_add_ps(sum, _mm512_add_ps(z0, z1));
    }
    l = _mm512_fmadd_ps(l, alpha, sum);
    mx = m_all;
    // T^T = V^T . P^T: four 16x16 accumulators (16 dims each) over two 32-key groups
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int kb = 0; kb < kKC / 32; ++kb) {
      const bf16_t* vg = pk.vt + (c0 + 32 * kb) * kD;
      _tile_loadd(3, pbuf + 32 * kb * kRows, 64);
      _tile_loadd(2, vg, 64);
      _tile_dpbf16ps(4, 2, 3);
      _tile_loadd(2, vg + 512, 64);
      _tile_dpbf16ps(5, 2, 3);
      _tile_loadd(2, vg + 1024, 64);
      _tile_dpbf16ps(6, 2, 3);
      _tile_loadd(2, vg + 1536, 64);
      _tile_dpbf16ps(7, 2, 3);
    }
    _tile_stored(4, tbuf, 64);
    _tile_stored(5, tbuf + 256, 64);
    _tile_stored(6, tbuf + 512, 64);
    _tile_stored(7, tbuf + 768, 64);
    for (int d = 0; d < kD; ++d) {
      float* o = obuf + d * kRows;
      _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_load_ps(o), alpha, _mm512_load_ps(tbuf + d * kRows)));
    }
  }

  alignas(64) float lv[kRows], mv[kRows];
  _mm512_store_ps(lv, l);
  _mm512_store_ps(mv, mx);
  for (int m = 0; m < m_hi; ++m) {
    const int64_t r = t.r0 + m, row = batch_row(a, row_start + r / g);
    const int head = t.h * g + static_cast<int>(r % g);
    bf16_t* o = a.out + row * a.num_heads * kD + head * kD;
    float* lse = a.lse ? a.lse + row * a.num_heads + head : nullptr;
    const float mine = lv[m] > 0.f ? mv[m] * 0.6931471805599453f + std::log(lv[m]) : kNegInf;
    float w_mine = lv[m] > 0.f ? 1.f / lv[m] : 0.f, w_old = 0.f, lse_new = mine;
    if (a.merge && *lse != kNegInf) {  // exact merge with the part already in out/lse
      const float old = *lse;
      lse_new = std::max(old, mine) + std::log1p(std::exp(-std::fabs(old - mine)));
      w_old = std::exp(old - lse_new);
      w_mine *= mine == kNegInf ? 0.f : std::exp(mine - lse_new);
    }
    for (int d = 0; d < kD; ++d) {
      const float prev = w_old != 0.f ? kvs::to_f32(o[d]) * w_old : 0.f;
      kvs::from_f32(prev + obuf[d * kRows + m] * w_mine, o + d);
    }
    if (lse) *lse = lse_new;
  }
}


int run_all(const Args& a, int64_t num_seqs, int num_threads) {
  if (!amx_permitted()) return 2;
  const int g = a.num_heads / a.num_kv_heads;
  // packed buffers: one per (seq, KV head), kept across calls on the calling thread
  static thread_local std::vector<bf16_t> store;
  std::vector<int64_t> offset(num_seqs * a.num_kv_heads + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t keys = num_keys(a, s);
    const int64_t padded = (keys + kKC - 1) / kKC * kKC;
    for (int h = 0; h < a.num_kv_heads; ++h) {
      const int64_t i = s * a.num_kv_heads + h;
      offset[i + 1] = offset[i] + padded * kD;
    }
  }
  if (store.size() < static_cast<size_t>(offset.back())) store.resize(offset.back());
  std::vector<Packed> packed(num_seqs * a.num_kv_heads);
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t keys = num_keys(a, s);
    for (int h = 0; h < a.num_kv_heads; ++h) {
      const int64_t i = s * a.num_kv_heads + h;
      packed[i] = Packed{store.data() + offset[i], keys};
    }
    const int64_t m_total = a.seqs[5 * s + 2] * g;
    // longest rows (latest positions, most keys) first: better load balance
    for (int64_t r0 = (m_total - 1) / kRows * kRows; r0 >= 0; r0 -= kRows)
      for (int h = 0; h < a.num_kv_heads; ++h) tasks.push_back(Task{s, h, r0});
  }
  const int64_t num_packs = static_cast<int64_t>(packed.size());
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel num_threads(std::max(1, num_threads))
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_packs; ++i) {
      const int64_t s = i / a.num_kv_heads;
      pack(a, a.block_tables + s * a.max_blocks, static_cast<int>(i % a.num_kv_heads), packed[i]);
    }
    configure_tiles();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tasks; ++i)
      run_task(a, tasks[i], packed[tasks[i].seq * a.num_kv_heads + tasks[i].h],
               a.block_tables + tasks[i].seq * a.max_blocks);
    _tile_release();  // leave no tile state behind for oneDNN or anyone else
  }
  // padding rows: zero output, lse -inf
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t row_start = a.seqs[5 * s], rows = a.seqs[5 * s + 1], toks = a.seqs[5 * s + 2];
    for (int64_t j = toks; j < rows; ++j) {
      const int64_t row = batch_row(a, row_start + j);
      std::memset(a.out + row * a.num_heads * kD, 0, a.num_heads * kD * sizeof(bf16_t));
      if (a.lse)
        for (int hh = 0; hh < a.num_heads; ++hh) a.lse[row * a.num_heads + hh] = kNegInf;
    }
  }
  return 0;
}
#endif  // KVS_HAVE_AMX

}  // namespace

extern "C" {

// 1 when this build has the AMX path and the OS lets this process use AMX tiles.
int kvs_prefill_amx_available() {
#if defined(KVS_HAVE_AMX)
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// Returns 0 on success; 2: AMX unavailable; 3: unsupported shape (head_dim must be
// 64, block_size a multiple of 16, num_heads a multiple of num_kv_heads); 4: merge
// without lse.
int kvs_prefill_attention_amx(const void* q, int64_t q_row_stride, int64_t q_head_stride,
                              void* out, const void* kv, int64_t num_blocks, int block_size,
                              int num_heads, int num_kv_heads, int head_dim, const int64_t* seqs,
                              int64_t num_seqs, const int64_t* block_tables, int64_t max_blocks,
                              float scale, int num_threads, float* lse, const int64_t* row_map,
                              int merge) {
#if defined(KVS_HAVE_AMX)
  if (head_dim != kD || block_size % 16 != 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0)
    return 3;
  if (merge && lse == nullptr) return 4;
  Args a{static_cast<const bf16_t*>(q), q_row_stride, q_head_stride, static_cast<bf16_t*>(out),
         static_cast<const bf16_t*>(kv), num_blocks, block_size, num_heads, num_kv_heads,
         seqs, block_tables, max_blocks, scale, lse, row_map, merge};
  return run_all(a, num_seqs, num_threads);
#else
  (void)q, (void)q_row_stride, (void)q_head_stride, (void)out, (void)kv, (void)num_blocks;
  (void)block_size, (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)seqs;
  (void)num_seqs, (void)block_tables, (void)max_blocks, (void)scale, (void)num_threads, (void)lse;
  (void)row_map, (void)merge;
  return 2;
#endif
}
}
