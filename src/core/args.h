// mlakv internal: the resolved, validated arguments every backend consumes.
//
// src/core/validate.cpp turns the public params (TensorViews) into these flat structs once all
// checks passed: raw pointers, element strides (int64) and enums. Backends never re-validate; they
// receive only arguments that are safe to run. Strides are in elements of the tensor's own dtype
// unless the name ends in _bytes. The innermost stride of every tensor is 1.
#pragma once

#include <cstdint>

#include "mlakv/cache.h"
#include "mlakv/context.h"
#include "mlakv/ops.h"
#include "mlakv/tensor.h"

namespace mlakv {
namespace core {

// Positions / slots / Td come as int32 or int64.
struct IndexArg {
  const void* data = nullptr;
  bool is_int64 = true;
  int64_t stride = 1;
};

struct RopeTableArg {
  const void* data = nullptr;  // [max_pos, R]
  DType dtype = DType::kFloat32;
  int64_t max_pos = 0;
  int64_t stride_pos = 0;  // elements between rows
  RopeStyle style = RopeStyle::kGptJ;
};

struct CacheArg {
  CacheFormat format = CacheFormat::kBFloat16;
  int64_t num_slots = 0;
  int64_t block_size = 1;
  uint8_t* data = nullptr;
  int64_t stride_block_bytes = 0;
  int64_t stride_token_bytes = 0;
  uint8_t* rope_data = nullptr;  // split layout, else nullptr (rope part follows the latent part)
  int64_t stride_rope_block_bytes = 0;
  int64_t stride_rope_token_bytes = 0;
  const float* scale = nullptr;  // per-tensor fp8; nullptr = 1.0
  bool ds_mla_pow2_scale = false;
};

struct MlaRopeCacheArgs {
  int64_t num_tokens = 0;                             // T
  int64_t num_heads = 0;                              // H (0 when no Q side is present)
  int64_t kv_lora_rank = 0;                           // L
  int64_t rope_dim = 0;                               // R
  int64_t nope_dim = 0;                               // P (prefill q only)
  int64_t num_decode_tokens = 0;                      // Td from the host
  const int32_t* num_decode_tokens_device = nullptr;  // wins when set; clamp to [0, T] and count
  DType model_dtype = DType::kBFloat16;

  IndexArg positions;
  IndexArg slot_mapping;
  RopeTableArg rope;

  // K side
  const void* kv_c = nullptr;
  int64_t stride_kv_c_token = 0;  // [T, L]
  const void* k_pe = nullptr;
  int64_t stride_k_pe_token = 0;         // [T, R]
  const void* kv_norm_weight = nullptr;  // [L] or nullptr
  float kv_norm_eps = 1e-6f;
  CacheArg cache;
  void* k_pe_out = nullptr;
  int64_t stride_k_pe_out_token = 0;  // [T, R] or nullptr
  void* kv_c_out = nullptr;
  int64_t stride_kv_c_out_token = 0;  // [T, L] or nullptr

  // Decode Q side (q_out == nullptr: skipped)
  const void* q_pe = nullptr;
  int64_t stride_q_pe_token = 0, stride_q_pe_head = 0;
  const void* ql_nope = nullptr;
  int64_t stride_ql_nope_token = 0, stride_ql_nope_head = 0;
  bool copy_nope = true;  // false: q_out's nope part already holds ql_nope
  void* q_out = nullptr;
  int64_t stride_q_out_token = 0, stride_q_out_head = 0;
  DType q_out_dtype = DType::kBFloat16;
  const float* q_scale = nullptr;

  // Prefill Q side (q == nullptr: skipped)
  void* q = nullptr;
  int64_t stride_q_token = 0, stride_q_head = 0;
  void* q_prefill_out = nullptr;
  int64_t stride_q_prefill_out_token = 0, stride_q_prefill_out_head = 0;

  int32_t* error_counts = nullptr;
};

struct RotaryEmbeddingArgs {
  int64_t num_tokens = 0;
  int64_t head_size = 0;
  int64_t rot_dim = 0;
  DType model_dtype = DType::kBFloat16;
  IndexArg positions;
  RopeTableArg rope;
  void* query = nullptr;
  int64_t num_q_heads = 0;
  int64_t stride_query_token = 0, stride_query_head = 0;
  void* key = nullptr;
  int64_t num_k_heads = 0;
  int64_t stride_key_token = 0, stride_key_head = 0;
  int32_t* error_counts = nullptr;
};

struct ConcatAndCacheMlaArgs {
  int64_t num_tokens = 0;
  int64_t kv_lora_rank = 0;
  int64_t rope_dim = 0;
  DType model_dtype = DType::kBFloat16;
  const void* kv_c = nullptr;
  int64_t stride_kv_c_token = 0;
  const void* k_pe = nullptr;
  int64_t stride_k_pe_token = 0;
  IndexArg slot_mapping;
  CacheArg cache;
  int32_t* error_counts = nullptr;
};

struct DecodeQConcatArgs {
  int64_t num_tokens = 0;
  int64_t num_heads = 0;
  int64_t kv_lora_rank = 0;
  int64_t rope_dim = 0;
  DType model_dtype = DType::kBFloat16;
  const void* ql_nope = nullptr;  // nullptr: q_out's nope part already holds it (no copy)
  int64_t stride_ql_nope_token = 0, stride_ql_nope_head = 0;
  const void* q_pe = nullptr;  // nullptr: q_out's rope part already holds it (no copy)
  int64_t stride_q_pe_token = 0, stride_q_pe_head = 0;
  void* q_out = nullptr;
  int64_t stride_q_out_token = 0, stride_q_out_head = 0;
  DType q_out_dtype = DType::kBFloat16;
  const float* q_scale = nullptr;
};

struct RmsNormArgs {
  int64_t num_tokens = 0;
  int64_t hidden = 0;  // N
  DType model_dtype = DType::kBFloat16;
  const void* input = nullptr;
  int64_t stride_input_token = 0;
  const void* weight = nullptr;
  float eps = 1e-6f;
  void* output = nullptr;
  int64_t stride_output_token = 0;
};

struct GatherCacheArgs {
  int64_t kv_lora_rank = 0;
  int64_t rope_dim = 0;
  CacheArg cache;
  int64_t num_blocks = 0;
  // Slots mode (!sequences): out row i < num_rows reads slots[i].
  IndexArg slots;
  // Sequences mode: num_seqs sequences via block_table / cu_seq_lens; rows >= num_rows never
  // written. The mode is this flag, not block_table's pointer: an empty block_table ([0, M] or
  // [B, 0]) may have a null data pointer.
  bool sequences = false;
  const int32_t* block_table = nullptr;
  int64_t stride_block_table_seq = 0;
  int64_t max_blocks_per_seq = 0;
  const int32_t* cu_seq_lens = nullptr;
  int64_t num_seqs = 0;
  int64_t num_rows = 0;
  void* out = nullptr;
  DType out_dtype = DType::kFloat32;
  int64_t stride_out_token = 0;
  int32_t* error_counts = nullptr;
};

}  // namespace core
}  // namespace mlakv
