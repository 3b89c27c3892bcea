// mlakv: the paged MLA KV cache and its entry formats.
#pragma once

#include <cstdint>

#include "mlakv/tensor.h"

namespace mlakv {

// How one token's cache entry (latent kv_c of width L, then rotated k_pe of width R) is stored.
enum class CacheFormat : int32_t {
  kBFloat16 = 0,  // D = L + R bf16 values
  kFloat16,       // D fp16 values
  kFloat32,       // D fp32 values
  kFloat8E4M3,    // D e4m3 bytes, value = byte * scale, one per-tensor fp32 scale
  kFloat8E5M2,    // D e5m2 bytes, one per-tensor fp32 scale
  // FlashMLA's sparse-attention format, 656 bytes per token (L = 512, R = 64 only):
  //   bytes [0, 512)   512 e4m3 values of kv_c, four tiles of 128
  //   bytes [512, 528) four fp32 tile scales, scale = max(amax / 448, FLT_MIN) (or a power of two)
  //   bytes [528, 656) 64 bf16 values of the rotated k_pe, not quantized
  kFloat8DsMla,
};

const char* cache_format_name(CacheFormat format);  // "bf16", "fp16", "fp32", "fp8_e4m3", ...
// Parses the names above; throws mlakv::Error for an unknown name.
CacheFormat parse_cache_format(const char* name);
// The element type of the latent part (kFloat8DsMla: kFloat8E4M3) and of the rope part
// (kFloat8DsMla: kBFloat16).
DType cache_latent_dtype(CacheFormat format);
DType cache_rope_dtype(CacheFormat format);
bool cache_is_per_tensor_fp8(CacheFormat format);

constexpr int64_t kDsMlaLatentDim = 512;
constexpr int64_t kDsMlaRopeDim = 64;
constexpr int64_t kDsMlaTileElems = 128;
constexpr int64_t kDsMlaNumTiles = 4;
constexpr int64_t kDsMlaEntryBytes = 656;

// Bytes of one combined entry (latent then rope) for latent width L and rope width R.
int64_t cache_entry_bytes(CacheFormat format, int64_t L, int64_t R);

// A view of a paged cache: num_blocks blocks of block_size token entries. A token with slot s lives
// in block s / block_size at offset s % block_size. Strides are in BYTES (entries mix dtypes in
// fp8_ds_mla).
//
// Combined layout (rope_data == nullptr): the entry of (block, offset) starts at
//   data + block * stride_block_bytes + offset * stride_token_bytes
// and holds the latent part followed by the rope part (cache_entry_bytes bytes).
// Split layout (rope_data != nullptr; raw and per-tensor fp8 formats only): the latent part lives
// at data + block * stride_block_bytes + offset * stride_token_bytes (L elements), the rope part at
// rope_data + block * stride_rope_block_bytes + offset * stride_rope_token_bytes (R elements).
struct KVCacheView {
  CacheFormat format = CacheFormat::kBFloat16;
  Device device = {};
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t kv_lora_rank = 0;  // L
  int64_t rope_dim = 0;      // R
  void* data = nullptr;
  int64_t stride_block_bytes = 0;
  int64_t stride_token_bytes = 0;
  void* rope_data = nullptr;
  int64_t stride_rope_block_bytes = 0;
  int64_t stride_rope_token_bytes = 0;
  // [1] fp32 in the cache's device memory, per-tensor fp8 formats only; nullptr means 1.0.
  const float* scale = nullptr;
  // fp8_ds_mla only: round each tile scale up to a power of two (FlashMLA's reader prefers it).
  bool ds_mla_pow2_scale = false;

  // num_blocks * block_size; INT64_MAX past int64 (a view that no validator accepts).
  int64_t num_slots() const;
  bool is_split() const { return rope_data != nullptr; }
};

// A contiguous combined cache [num_blocks, block_size, cache_entry_bytes(format, L, R)].
KVCacheView make_cache_view(void* data, CacheFormat format, int64_t num_blocks, int64_t block_size,
                            int64_t L, int64_t R, Device device = {});
// Contiguous split caches: latent [num_blocks, block_size, L] and rope [num_blocks, block_size, R].
KVCacheView make_split_cache_view(void* latent_data, void* rope_data, CacheFormat format,
                                  int64_t num_blocks, int64_t block_size, int64_t L, int64_t R,
                                  Device device = {});
// Bytes a contiguous combined cache of this geometry occupies.
int64_t cache_bytes(CacheFormat format, int64_t num_blocks, int64_t block_size, int64_t L,
                    int64_t R);

}  // namespace mlakv
