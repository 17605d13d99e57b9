// The decoder layers of a decode-only step in one call (kvs_decode_layers): the same
// kernels, in the same order and with the same arguments, as the model's native layer
// loop in Python (kvserve/model/llama_native.py), so its results are bitwise those of
// that loop; what it removes is the Python work between the ~8 kernel calls of each
// layer (argument marshalling, tensor allocation, ctypes dispatch: about 1.5 ms of a
// 30-layer step at one row).
//
// Per layer (float KV cache, decode rows and whole short chunks):
//   y = add_rms_norm(residual, pending, ln1)      (pending: the last layer's down output)
//   qkv = linear(y, Wqkv) ; [head_rms_norm(q, k heads)] ; rope_and_cache(qkv)
//   attn = paged_attention(q)
//   o = linear(attn, Wo) ; y = add_rms_norm(residual, o, ln2)
//   act = linear_silu_mul(y, Wgate_up) ; pending = linear(act, Wdown)
// and after the last layer residual += pending (fp32, one rounding: what torch's += gives).
// Each linear is the kernels the Python loop calls for it (QuantLinear / FastLinear):
// - format code >= 0: a one-part quantized weight, kvs_linear_quant (codes below
//   kKCodes) or kvs_linear_kquant (GGUF K-quants); a gate_up with this code runs the
//   fused kvs_linear_quant_silu_mul;
// - kDenseFmt: packed float panels in the step's dtype, kvs_linear_f32 / kvs_linear_bf16;
// - kPartsFmt: a quantized weight in parts (e.g. q/k Q4_K and v Q6_K of one qkv) or
//   with act-order inputs, the word pointing at a table [P, silu, then (weight, code,
//   n, bias, perm) per part]: each part reads x's columns in its stored order (perm:
//   int64 [K], x gathered into the xg scratch as index_select does; 0: as they are) and
//   writes its columns of the output in order; silu (one part only): a gate_up whose
//   linear and SiLU run as one kvs_linear_quant_silu_mul;
// a gate_up of the last two kinds otherwise runs the linear, then kvs_silu_mul over its
// output.
//
// With a LoRA table (a step with adapter rows), each linear's output gets the batched
// low-rank delta right after it, kvs_lora_delta (csrc/lora.cpp) on the linear's input
// and output with the same arguments as kvserve/lora/weights.py's LoRAWeights.apply,
// and gate_up always runs its linear into gu, the delta, then kvs_silu_mul (what the
// layer loop does with adapter rows; a silu table is refused). The table, int64 words:
//   [0] rank R, [1] the weights' dtype (0 float32, 1 bfloat16), then per fused linear
//   f in (qkv, o, gate_up, down): [2 + 2f] its offsets [P+1] int64, [3 + 2f] P;
//   then per layer, per f: A [S, P*R, in], Bt [S, R, out], row slots [rows] int32
//   (the rows of slots that do not target f set to -1), or 0 for row slots where no
//   slot present targets f (no delta).
#include <cstdint>

extern "C" {
int kvs_add_rms_norm(float* residual, const void* x, int64_t x_stride, const void* w, void* out,
                     int64_t rows, int64_t hidden, float eps, int dtype, int nthreads);
int kvs_rope_and_cache(void* qkv, int64_t row_stride, int64_t rows, int num_heads,
                       int num_kv_heads, int head_dim, const int64_t* positions, const float* cos,
                       const float* sin, void* kv, int64_t num_slots, const int64_t* slots,
                       int dtype, int nthreads);
int kvs_paged_attention(const void* q, int64_t q_row_stride, int64_t q_head_stride, void* out,
                        const void* kv, int64_t num_blocks, int block_size, int num_heads,
                        int num_kv_heads, int head_dim, const int64_t* seqs, int64_t num_seqs,
                        const int64_t* block_tables, int64_t max_blocks, int seg, float scale,
                        int dtype, int row_tile, int num_threads, float* lse,
                        const int64_t* row_map, int merge);
int kvs_linear_quant(const void* x, int64_t xs, int64_t rows, int64_t K, int x_dtype,
                     const uint8_t* w, int fmt, int64_t n, const float* bias, void* out,
                     int64_t os, int out_dtype, int path, int threads);
int kvs_linear_f32(const float* x, int64_t xs, int64_t M, int64_t K, const float* wp, int64_t N,
                   const float* bias, float* out, int64_t os, int nthreads);
int kvs_linear_bf16(const uint16_t* x, int64_t xs, int64_t M, int64_t K, const uint16_t* wp,
                    int64_t N, const float* bias, uint16_t* out, int64_t os, int nthreads);
int kvs_silu_mul(const void* gu, void* out, int64_t rows, int64_t inter, int dtype, int nthreads);
int kvs_head_rms_norm(void* qkv, int64_t row_stride, int64_t rows, int heads, int head_dim,
                      const void* w, float eps, int dtype, int nthreads);
int kvs_linear_kquant(const void* x, int64_t xs, int64_t rows, int64_t K, int x_dtype,
                      const uint8_t* w, int fmt, int64_t n, const float* bias, void* out,
                      int64_t os, int out_dtype, int path, int threads);
int kvs_lora_delta(const void* x, int64_t x_stride, void* y, int64_t y_stride, int64_t rows,
                   int64_t in_f, int64_t out_f, const void* A, const void* Bt,
                   const int32_t* row_slot, const int64_t* offsets, int parts, int rank, int dtype,
                   int w_dtype, int nthreads);
int kvs_linear_quant_silu_mul(const void* x, int64_t xs, int64_t rows, int64_t K, int x_dtype,
                              const uint8_t* w, int fmt, int64_t n, const float* bias,
                              void* out, int64_t os, int out_dtype, int path, int threads);
}

namespace {

// One layer's arguments, as int64 words (pointers, format codes, sizes); the order is
// kvserve/model/llama_native.py's LAYER_FIELDS.
struct Layer {
  int64_t ln1, qkv_w, qkv_fmt, qkv_b, o_w, o_fmt, o_b, ln2, gu_w, gu_fmt, gu_b, dn_w, dn_fmt,
      dn_b, qk_norm, kv;  // qk_norm: [H + Hk, D] per-head RMSNorm weight (Qwen3), or 0
};
static_assert(sizeof(Layer) == 16 * sizeof(int64_t), "Layer must be 16 words");

template <typename P>
inline P* as_ptr(int64_t v) {
  return reinterpret_cast<P*>(static_cast<intptr_t>(v));
}

// A layer word's format codes besides the quantized ones (>= 0): packed float panels in
// the step's dtype, and a table of quantized parts (kvserve/model/llama_native.py's
// DENSE_FMT, PARTS_FMT); quantized codes from kKCodes on are GGUF K-quants (K_CODES).
constexpr int64_t kDenseFmt = -1;
constexpr int64_t kPartsFmt = -2;
constexpr int64_t kKCodes = 16;

// out[rows, n] (row stride os) = x[rows, K] (row stride xs) @ W^T + b for one weight
// (fmt >= 0 or kDenseFmt), with the kernel the Python layer loop runs for it.
inline int linear_one(const void* x, int64_t xs, int64_t rows, int64_t K, int dtype, int64_t w,
                      int64_t fmt, int64_t n, int64_t b, void* out, int64_t os, int nthreads) {
  if (fmt >= kKCodes)
    return kvs_linear_kquant(x, xs, rows, K, dtype, as_ptr<const uint8_t>(w), static_cast<int>(fmt),
                             n, as_ptr<const float>(b), out, os, dtype, 0, nthreads);
  if (fmt == kDenseFmt) {
    if (dtype == 0)
      return kvs_linear_f32(static_cast<const float*>(x), xs, rows, K, as_ptr<const float>(w), n,
                            as_ptr<const float>(b), static_cast<float*>(out), os, nthreads);
    return kvs_linear_bf16(static_cast<const uint16_t*>(x), xs, rows, K, as_ptr<const uint16_t>(w),
                           n, as_ptr<const float>(b), static_cast<uint16_t*>(out), os, nthreads);
  }
  return kvs_linear_quant(x, xs, rows, K, dtype, as_ptr<const uint8_t>(w), static_cast<int>(fmt), n,
                          as_ptr<const float>(b), out, os, dtype, 0, nthreads);
}

// x's columns in the stored order of an act-order weight: xg[r][j] = x[r][perm[j]]
// (xg [rows, K] contiguous, elements of elem bytes), what x.index_select(1, perm) gives.
inline void gather_columns(const void* x, int64_t xs, int64_t rows, int64_t K, int64_t elem,
                           const int64_t* perm, void* xg) {
  const char* src = static_cast<const char*>(x);
  char* dst = static_cast<char*>(xg);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < K; ++j)
      __builtin_memcpy(dst + (r * K + j) * elem, src + (r * xs + perm[j]) * elem, elem);
}

// linear_one, or each part of a kPartsFmt table (see the top) into its columns
// [col, col + n_p) of out, in order (what QuantLinear.eager does); with the table's
// silu flag and `silu` set, the one part's fused linear + SiLU into out [rows, n / 2].
// Returns 10 where the parts do not add up to n, 11 for an act-order part without xg,
// 12 for a silu table called without `silu` or the reverse.
inline int linear(const void* x, int64_t xs, int64_t rows, int64_t K, int dtype, int64_t w,
                  int64_t fmt, int64_t n, int64_t b, void* out, int64_t os, void* xg,
                  int nthreads, bool silu = false) {
  if (fmt != kPartsFmt)
    return silu ? 12 : linear_one(x, xs, rows, K, dtype, w, fmt, n, b, out, os, nthreads);
  const int64_t* t = as_ptr<const int64_t>(w);
  if ((t[1] != 0) != silu) return 12;
  const int64_t elem = dtype == 0 ? 4 : 2;
  int64_t col = 0;
  for (int64_t p = 0; p < t[0]; ++p) {
    const int64_t* e = t + 2 + 5 * p;
    const void* in = x;
    int64_t ins = xs;
    if (e[4] != 0) {  // act order: the inputs in the stored column order
      if (xg == nullptr) return 11;
      gather_columns(x, xs, rows, K, elem, as_ptr<const int64_t>(e[4]), xg);
      in = xg;
      ins = K;
    }
    char* o = static_cast<char*>(out) + col * elem;
    const int rc =
        silu ? kvs_linear_quant_silu_mul(in, ins, rows, K, dtype, as_ptr<const uint8_t>(e[0]),
                                         static_cast<int>(e[1]), e[2], as_ptr<const float>(e[3]), o,
                                         os, dtype, 0, nthreads)
             : linear_one(in, ins, rows, K, dtype, e[0], e[1], e[2], e[3], o, os, nthreads);
    if (rc != 0) return rc;
    col += e[2];
  }
  return col == n ? 0 : 10;
}

// Whether a layer word's linear is a table with the silu flag (see the top).
inline bool silu_table(int64_t w, int64_t fmt) {
  return fmt == kPartsFmt && as_ptr<const int64_t>(w)[1] != 0;
}

// The LoRA table's words (see the top).
constexpr int64_t kLoraHeader = 10;
constexpr int64_t kLoraLayerWords = 12;

// y [rows, out_f] += the delta of fused linear f (0 qkv, 1 o, 2 gate_up, 3 down) of the
// layer whose words start at lw, for input x [rows, in_f]; nothing without a table or
// where the layer's row slots word is 0.
inline int lora(const int64_t* table, const int64_t* lw, int f, const void* x, int64_t in_f,
                void* y, int64_t out_f, int64_t rows, int dtype, int nthreads) {
  if (table == nullptr || lw[3 * f + 2] == 0) return 0;
  return kvs_lora_delta(x, in_f, y, out_f, rows, in_f, out_f, as_ptr<const void>(lw[3 * f]),
                        as_ptr<const void>(lw[3 * f + 1]), as_ptr<const int32_t>(lw[3 * f + 2]),
                        as_ptr<const int64_t>(table[2 + 2 * f]), static_cast<int>(table[3 + 2 * f]),
                        static_cast<int>(table[0]), dtype, static_cast<int>(table[1]), nthreads);
}

}  // namespace

extern "C" {

// Rules: layers [num_layers] of Layer (weights in linear_quant.cpp's panel layout,
// gate_up fused [gate; up] with inter % 16 == 0, biases fp32 or 0, kv each layer's
// [2, Hk, num_blocks, block_size, D] cache in dtype); residual [rows, hidden] fp32 (the
// embedding on entry, the stream before the final norm on return); positions, slots
// [rows] int64 (slot -1: not written); cos/sin fp32 [max_pos, D/2] covering positions;
// seqs [num_seqs, 5] and block_tables [num_seqs, max_blocks] as kvs_paged_attention's,
// each seq a decode row or a short chunk the paged kernel computes whole (prior_only
// 0: a speculative verification; no cascade); scratch buffers in dtype: y
// [rows, hidden], qkv [rows, (H + 2 Hk) D], attn [rows, H D], o [rows, hidden], act
// [rows, inter], down [rows, hidden], and gu [rows, 2 inter] where a gate_up weight is
// dense or in parts (null otherwise), and xg [rows, max(hidden, inter)] where a linear
// has act-order inputs (null otherwise); gu also whenever lora is set. lora: the LoRA
// table (see the top), or null for none. Returns 0, 9 for a gate_up without the gu it
// needs, 13 for a silu table with lora, or the first failing kernel's code plus
// 100 * (its position in the layer, 1-8).
int kvs_decode_layers(const int64_t* layers, int64_t num_layers, float* residual, int64_t rows,
                      int64_t hidden, int num_heads, int num_kv_heads, int head_dim,
                      int64_t inter, float eps, const int64_t* positions, const float* cos,
                      const float* sin, int64_t num_blocks, int block_size, const int64_t* slots,
                      const int64_t* seqs, int64_t num_seqs, const int64_t* block_tables,
                      int64_t max_blocks, int seg, float scale, int dtype, void* y, void* qkv,
                      void* attn, void* o, void* act, void* down, void* gu, void* xg,
                      const int64_t* lora_table, int nthreads) {
  if (rows <= 0) return 0;
  const int64_t qkv_n = static_cast<int64_t>(num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t q_n = static_cast<int64_t>(num_heads) * head_dim;
  const int64_t num_slots = num_blocks * block_size;
  const Layer* ls = reinterpret_cast<const Layer*>(layers);
  int rc = 0;
  for (int64_t i = 0; i < num_layers; ++i) {
    const Layer& l = ls[i];
    const int64_t* lw =
        lora_table == nullptr ? nullptr : lora_table + kLoraHeader + kLoraLayerWords * i;
    rc = kvs_add_rms_norm(residual, i == 0 ? nullptr : down, hidden, as_ptr<const void>(l.ln1),
                          y, rows, hidden, eps, dtype, nthreads);
    if (rc != 0) return rc + 100;
    rc = linear(y, hidden, rows, hidden, dtype, l.qkv_w, l.qkv_fmt, qkv_n, l.qkv_b, qkv, qkv_n, xg,
                nthreads);
    if (rc == 0) rc = lora(lora_table, lw, 0, y, hidden, qkv, qkv_n, rows, dtype, nthreads);
    if (rc == 0 && l.qk_norm != 0)  // Qwen3: q and k heads normed before RoPE
      rc = kvs_head_rms_norm(qkv, qkv_n, rows, num_heads + num_kv_heads, head_dim,
                             as_ptr<const void>(l.qk_norm), eps, dtype, nthreads);
    if (rc != 0) return rc + 200;
    rc = kvs_rope_and_cache(qkv, qkv_n, rows, num_heads, num_kv_heads, head_dim, positions, cos,
                            sin, as_ptr<void>(l.kv), num_slots, slots, dtype, nthreads);
    if (rc != 0) return rc + 300;
    rc = kvs_paged_attention(qkv, qkv_n, head_dim, attn, as_ptr<const void>(l.kv), num_blocks,
                             block_size, num_heads, num_kv_heads, head_dim, seqs, num_seqs,
                             block_tables, max_blocks, seg, scale, dtype, 16, nthreads, nullptr,
                             nullptr, 0);
    if (rc != 0) return rc + 400;
    rc = linear(attn, q_n, rows, q_n, dtype, l.o_w, l.o_fmt, hidden, l.o_b, o, hidden, xg, nthreads);
    if (rc == 0) rc = lora(lora_table, lw, 1, attn, q_n, o, hidden, rows, dtype, nthreads);
    if (rc != 0) return rc + 500;
    rc = kvs_add_rms_norm(residual, o, hidden, as_ptr<const void>(l.ln2), y, rows, hidden, eps,
                          dtype, nthreads);
    if (rc != 0) return rc + 600;
    if (silu_table(l.gu_w, l.gu_fmt)) {  // act-order gate_up with the fused SiLU
      if (lora_table != nullptr) return 13;
      rc = linear(y, hidden, rows, hidden, dtype, l.gu_w, l.gu_fmt, 2 * inter, l.gu_b, act, inter,
                  xg, nthreads, true);
    } else if (l.gu_fmt == kDenseFmt || l.gu_fmt == kPartsFmt || lora_table != nullptr) {
      if (gu == nullptr) return 9;  // the linear, [the delta,] then SiLU
      rc = linear(y, hidden, rows, hidden, dtype, l.gu_w, l.gu_fmt, 2 * inter, l.gu_b, gu,
                  2 * inter, xg, nthreads);
      if (rc == 0) rc = lora(lora_table, lw, 2, y, hidden, gu, 2 * inter, rows, dtype, nthreads);
      if (rc == 0) rc = kvs_silu_mul(gu, act, rows, inter, dtype, nthreads);
    } else {
      rc = kvs_linear_quant_silu_mul(y, hidden, rows, hidden, dtype, as_ptr<const uint8_t>(l.gu_w),
                                     static_cast<int>(l.gu_fmt), 2 * inter,
                                     as_ptr<const float>(l.gu_b), act, inter, dtype, 0, nthreads);
    }
    if (rc != 0) return rc + 700;
    rc = linear(act, inter, rows, inter, dtype, l.dn_w, l.dn_fmt, hidden, l.dn_b, down, hidden, xg,
                nthreads);
    if (rc == 0) rc = lora(lora_table, lw, 3, act, inter, down, hidden, rows, dtype, nthreads);
    if (rc != 0) return rc + 800;
  }
  if (num_layers > 0) {  // residual += pending, in fp32 (one rounding per value)
    const int64_t count = rows * hidden;
    if (dtype == 0) {
      const float* d = static_cast<const float*>(down);
      for (int64_t j = 0; j < count; ++j) residual[j] += d[j];
    } else {
      const uint16_t* d = static_cast<const uint16_t*>(down);
      for (int64_t j = 0; j < count; ++j) {
        const uint32_t u = static_cast<uint32_t>(d[j]) << 16;
        float f;
        __builtin_memcpy(&f, &u, 4);
        residual[j] += f;
      }
    }
  }
  return 0;
}

}  // extern "C"
