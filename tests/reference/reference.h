// mlakv tests: an independent, deliberately simple reference of every op in mlakv/ops.h.
//
// It runs on HOST memory only and takes the library's own params structs, so a caller builds one
// set of views on host copies and one on device copies with identical geometry. Scalar loops, one
// token at a time; nothing is shared with src/ (its own bf16/fp16 rounding in double, its own fp8
// codec by nearest-code search) except the definitions DESIGN.md fixes: RoPE is the float fma
// formula, RMSNorm the fp32 sum of squares in the documented pairwise-tree order
// (docs/rmsnorm_quant.md, written here as recursive halving) with (x * inv) * w, quantization an
// IEEE float division. Every output, RMSNorm's included, equals the library's bit for bit.
// Arguments are assumed valid (the library validates; the reference does not).
#pragma once

#include <cstdint>
#include <vector>

#include "mlakv/cache.h"
#include "mlakv/ops.h"
#include "mlakv/rmsnorm_quant.h"
#include "mlakv/tensor.h"

namespace mlakv {
namespace ref {

// ---- scalar conversions ------------------------------------------------------------------------
// Round-to-nearest-even; bf16/fp16 overflow to inf, NaN -> canonical quiet NaN (0x7fff / 0x7fff).
uint16_t float_to_bf16(float x);
float bf16_to_float(uint16_t bits);
uint16_t float_to_fp16(float x);
float fp16_to_float(uint16_t bits);
// OCP fp8 (dtype kFloat8E4M3 or kFloat8E5M2): saturating to +-max (inf included), NaN -> 0x7f.
uint8_t float_to_fp8(float x, DType fp8_dtype);
float fp8_to_float(uint8_t code, DType fp8_dtype);

// One element of `dtype` (model dtypes and fp8) at p.
float load_value(const void* p, DType dtype);
void store_value(void* p, DType dtype, float v);
// The value a reader of `dtype` sees after storing v.
float round_to(float v, DType dtype);

// ---- ops ---------------------------------------------------------------------------------------
// Every pointer in the params (tensors, cache, scales, device Td) must be host memory.
// error_counts: optional host int32[kNumErrorCounters], incremented exactly as the library counts
// (one count per token whose slot / position / block id is bad, one for a clamped Td).
void mla_rope_cache(const MlaRopeCacheParams& params, int32_t* error_counts = nullptr);
void rotary_embedding(const RotaryEmbeddingParams& params, int32_t* error_counts = nullptr);
void concat_and_cache_mla(const ConcatAndCacheMlaParams& params, int32_t* error_counts = nullptr);
void decode_q_concat(const DecodeQConcatParams& params);
void rms_norm(const RmsNormParams& params);
// Without quant.values it only normalizes into normed_out (the kv_c half of mla_rmsnorm_quant);
// without a weight it only quantizes the input (per_token_group_quant_fp8).
void rmsnorm_quant(const RmsNormQuantParams& params);
void gather_cache_slots(const GatherCacheSlotsParams& params, int32_t* error_counts = nullptr);
void gather_cache_sequences(const GatherCacheSequencesParams& params,
                            int32_t* error_counts = nullptr);

// ---- cache addressing (shared with the tests' sentinel checks) ---------------------------------
// Byte offsets of a slot's latent part (from kv_cache.data) and rope part (from kv_cache.data, or
// from kv_cache.rope_data for a split cache); for fp8_ds_mla the tile scales follow the latent
// part.
int64_t cache_latent_offset_bytes(const KVCacheView& cache, int64_t slot);
int64_t cache_rope_offset_bytes(const KVCacheView& cache, int64_t slot);
// Bytes of the latent part (fp8_ds_mla: the 512 e4m3 bytes plus the 16 scale bytes) and of the
// rope part of one entry.
int64_t cache_latent_bytes(const KVCacheView& cache);
int64_t cache_rope_bytes(const KVCacheView& cache);

// fp32 sum of the squares of x (each x_i * x_i rounded to fp32) as the complete binary tree over
// the index, the row padded with +0 to a power of two: RMSNorm's documented order
// (docs/rmsnorm_quant.md), written as its definition (recursive halving).
float tree_sum_squares(const std::vector<float>& x);

}  // namespace ref
}  // namespace mlakv
