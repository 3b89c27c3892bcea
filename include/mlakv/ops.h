// mlakv: the fused MLA RoPE + KV-cache op, the unfused primitives it replaces, and cache read-back.
//
// Terms (DESIGN.md): T tokens (decode tokens first, then prefill), Td decode tokens, H query heads,
// L = kv_lora_rank, R = qk_rope_head_dim, P = per-head nope width of the un-absorbed query.
// "model dtype" is the dtype of kv_c: float32, float16 or bfloat16; every model-dtype tensor of an
// op has that dtype. Per-token tensors may have more rows than T (CUDA-graph padding); rows >= T
// are never touched. The innermost dimension of every tensor must be contiguous (stride 1) and
// every pointer aligned to its element size.
//
// Every op validates all its arguments before it writes anything and throws mlakv::Error naming
// the argument on a violation. The backend follows the tensors' device (all must agree). Ops never
// allocate, synchronize or read device data on the host (except Context::checked), so they can be
// captured in a CUDA graph.
#pragma once

#include <cstdint>

#include "mlakv/cache.h"
#include "mlakv/context.h"
#include "mlakv/tensor.h"

namespace mlakv {

// GPT-J pairs (2i, 2i+1) use cos/sin index i (DeepSeek); NeoX pairs (i, i + R/2) use index i.
enum class RopeStyle : int32_t { kGptJ = 0, kNeox = 1 };
const char* rope_style_name(RopeStyle style);

// ---------------------------------------------------------------------------------------------
// The fused op.
//
// K side, every token t < T: kv_c[t] -> RMSNorm (if kv_norm_weight) -> rounded to model dtype;
// k_pe[t] -> RoPE at positions[t] -> rounded to model dtype; both quantized per the cache format
// and written as one entry at slot_mapping[t] (slot < 0: padding, not written; slot >= num_slots:
// skipped and counted). Optional k_pe_out / kv_c_out receive the rotated k_pe / normalized kv_c.
//
// Decode Q side, rows t < Td (when q_out is given):
//   q_out[t, h] = [ql_nope[t, h] (L) | RoPE(q_pe[t, h]) (R)], q_out in model dtype or fp8 (value /
//   q_scale). If ql_nope is absent or is the same memory as q_out's nope part, the nope part is
//   left as it is (the absorb GEMM already wrote it); with an fp8 q_out ql_nope must be given and
//   must not alias q_out.
// Prefill Q side, rows Td <= t < T (when q is given): RoPE on the last R values of each head of q
//   [T, H, P + R], in place, or into q_prefill_out (which then receives the whole head: nope part
//   copied, rope part rotated).
// Td: num_decode_tokens_device (a device int32, clamped to [0, T] and counted) if given, else
// num_decode_tokens (host, must be in [0, T]). With a device Td, decode tensors need T rows too,
// and num_decode_tokens must be 0 (it would be ignored).
// A host Td > 0 requires q_out; q_pe / ql_nope / q_scale without q_out, or q_prefill_out without q,
// are rejected. With a device Td and no q_out the decode rows get no Q work (K side only).
// With T = 0 the op reads nothing: a device Td, whatever its value, is neither read nor counted.
struct MlaRopeCacheParams {
  int64_t num_tokens = 0;                             // T
  int64_t num_decode_tokens = 0;                      // Td (host)
  const int32_t* num_decode_tokens_device = nullptr;  // [1] int32 on the op's device, or nullptr

  TensorView positions;      // [>=T], int64 or int32
  TensorView slot_mapping;   // [>=T], int64 or int32; < 0 = padding
  TensorView cos_sin_cache;  // [max_pos, R], fp32 / bf16 / fp16: R/2 cos then R/2 sin per row
  RopeStyle rope_style = RopeStyle::kGptJ;

  // K side.
  TensorView kv_c;            // [>=T, L], model dtype
  TensorView k_pe;            // [>=T, R], model dtype
  TensorView kv_norm_weight;  // optional [L], model dtype: RMSNorm weight (kv_a_layernorm)
  float kv_norm_eps = 1e-6f;  // finite, >= 0
  KVCacheView kv_cache;       // entry geometry L, R
  TensorView k_pe_out;        // optional [>=T, R], model dtype; may be k_pe itself
  TensorView kv_c_out;        // optional [>=T, L], model dtype; may be kv_c itself

  // Decode Q side, rows [0, Td).
  TensorView q_pe;                 // [>=Td, H, R], model dtype
  TensorView ql_nope;              // optional [>=Td, H, L], model dtype
  TensorView q_out;                // [>=Td, H, L + R], model dtype or float8 (e4m3 / e5m2)
  const float* q_scale = nullptr;  // [1] fp32 on the op's device, fp8 q_out only; nullptr = 1.0

  // Prefill Q side, rows [Td, T).
  TensorView q;              // [>=T, H, P + R], model dtype; rope part rotated in place
  TensorView q_prefill_out;  // optional [>=T, H, P + R], model dtype
};

// The fused op: all of the above in one launch.
void mla_rope_cache(const MlaRopeCacheParams& params, const Context& ctx = {});
// Thin entry points that fix Td: all decode (Td = T), all prefill (Td = 0; q required), or mixed
// (as given). The decode and prefill ones ignore num_decode_tokens_device (it is neither read nor
// counted).
void mla_rope_cache_decode(MlaRopeCacheParams params, const Context& ctx = {});
void mla_rope_cache_prefill(MlaRopeCacheParams params, const Context& ctx = {});
void mla_rope_cache_mixed(const MlaRopeCacheParams& params, const Context& ctx = {});

// ---------------------------------------------------------------------------------------------
// Unfused primitives (what engines run today), with the fused op's numerics: the A/B baseline.

// vLLM `rotary_embedding`: rotate the first rot_dim values of every head of query (and key) in
// place, rot_dim = cos_sin_cache.shape[1] <= head_size.
struct RotaryEmbeddingParams {
  int64_t num_tokens = 0;    // T
  TensorView positions;      // [>=T], int64 or int32
  TensorView query;          // [>=T, Hq, head_size], model dtype, rotated in place
  TensorView key;            // optional [>=T, Hk, head_size], model dtype, rotated in place
  TensorView cos_sin_cache;  // [max_pos, rot_dim]
  RopeStyle rope_style = RopeStyle::kGptJ;
};
void rotary_embedding(const RotaryEmbeddingParams& params, const Context& ctx = {});

// vLLM `concat_and_cache_mla`: write [kv_c[t] | k_pe[t]] (k_pe already rotated) at slot_mapping[t].
struct ConcatAndCacheMlaParams {
  int64_t num_tokens = 0;   // T
  TensorView kv_c;          // [>=T, L], model dtype
  TensorView k_pe;          // [>=T, R], model dtype
  TensorView slot_mapping;  // [>=T], int64 or int32
  KVCacheView kv_cache;
};
void concat_and_cache_mla(const ConcatAndCacheMlaParams& params, const Context& ctx = {});

// The decode-query concat: q_out[t, h] = [ql_nope[t, h] | q_pe[t, h]] (q_pe already rotated).
// With a model-dtype q_out, ql_nope may be q_out's nope part itself and q_pe its rope part; a part
// already in place is not copied onto itself (both in place: nothing is written).
struct DecodeQConcatParams {
  int64_t num_tokens = 0;          // T
  TensorView ql_nope;              // [>=T, H, L], model dtype
  TensorView q_pe;                 // [>=T, H, R], model dtype
  TensorView q_out;                // [>=T, H, L + R], model dtype or float8
  const float* q_scale = nullptr;  // [1] fp32, fp8 q_out only; nullptr = 1.0
};
void decode_q_concat(const DecodeQConcatParams& params, const Context& ctx = {});

// RMSNorm: output[t] = input[t] * rsqrt(mean(input[t]^2) + eps) * weight, rounded once.
struct RmsNormParams {
  int64_t num_tokens = 0;  // T
  TensorView input;        // [>=T, N], model dtype, 1 <= N < 2^31
  TensorView weight;       // [N], model dtype
  float eps = 1e-6f;       // finite, >= 0
  TensorView output;       // [>=T, N], model dtype; may be input itself
};
void rms_norm(const RmsNormParams& params, const Context& ctx = {});

// ---------------------------------------------------------------------------------------------
// Cache read-back, dequantized (what chunked prefill needs for its context).

// out[i] = entry at slots[i], i < num_tokens, as [L + R] values. slot < 0 or >= num_slots: zeros
// (out-of-range slots are counted).
struct GatherCacheSlotsParams {
  int64_t num_tokens = 0;  // N
  KVCacheView kv_cache;
  TensorView slots;  // [>=N], int64 or int32
  TensorView out;    // [>=N, L + R], bfloat16 or float32
};
void gather_cache_slots(const GatherCacheSlotsParams& params, const Context& ctx = {});

// Whole sequences: sequence b (b < num_seqs) has cu_seq_lens[b + 1] - cu_seq_lens[b] tokens; its
// token i lives in block block_table[b, i / block_size] at offset i % block_size and goes to out
// row cu_seq_lens[b] + i. Rows at or past out.shape[0] are never written; block ids outside
// [0, num_blocks), and tokens past their block-table row (i / block_size >= max_blocks_per_seq),
// give zeros and are counted (kBadBlockIndex, once per row). cu_seq_lens outside its contract
// (device data of an earlier batch) still moves no write outside out's rows; which rows get
// written is then not defined, except that leading sequences whose start is negative are skipped
// whole, neither written nor counted, on every backend.
struct GatherCacheSequencesParams {
  int64_t num_seqs = 0;  // B
  KVCacheView kv_cache;
  TensorView block_table;  // [>=B, max_blocks_per_seq], int32
  TensorView cu_seq_lens;  // [>=B + 1], int32, non-decreasing, cu_seq_lens[0] = 0
  TensorView out;          // [num_out_rows, L + R], bfloat16 or float32
};
void gather_cache_sequences(const GatherCacheSequencesParams& params, const Context& ctx = {});

// ---------------------------------------------------------------------------------------------
// Error counters.

// Zeroes the counters at `error_counts` on `device` (stream-ordered on `stream`; graph-safe).
void reset_error_counts(int32_t* error_counts, Device device, void* stream = nullptr);
// Copies the counters to the host (synchronizes the stream); throws mlakv::Error naming every
// non-zero counter when `throw_if_nonzero`.
void read_error_counts(const int32_t* error_counts, Device device, int32_t* host_out,
                       void* stream = nullptr, bool throw_if_nonzero = false);

}  // namespace mlakv
