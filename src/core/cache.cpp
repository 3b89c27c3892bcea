// mlakv: cache formats, cache views, and the names of the small enums of the API.
#include "mlakv/cache.h"

#include <cstring>

#include "core/spans.h"
#include "mlakv/context.h"
#include "mlakv/error.h"
#include "mlakv/ops.h"

namespace mlakv {
namespace {

struct FormatName {
  CacheFormat format;
  const char* name;
};
constexpr FormatName kFormatNames[] = {
    {CacheFormat::kBFloat16, "bf16"},       {CacheFormat::kFloat16, "fp16"},
    {CacheFormat::kFloat32, "fp32"},        {CacheFormat::kFloat8E4M3, "fp8_e4m3"},
    {CacheFormat::kFloat8E5M2, "fp8_e5m2"}, {CacheFormat::kFloat8DsMla, "fp8_ds_mla"},
};

}  // namespace

int64_t KVCacheView::num_slots() const {
  int64_t n = 0;
  return __builtin_mul_overflow(num_blocks, block_size, &n) ? INT64_MAX : n;
}

const char* cache_format_name(CacheFormat format) {
  for (const FormatName& f : kFormatNames) {
    if (f.format == format) return f.name;
  }
  return "unknown_cache_format";
}

CacheFormat parse_cache_format(const char* name) {
  MLAKV_CHECK(name != nullptr, "parse_cache_format: name: expected a format name, got nullptr");
  for (const FormatName& f : kFormatNames) {
    if (std::strcmp(f.name, name) == 0) return f.format;
  }
  MLAKV_FAIL(
      "parse_cache_format: name: expected one of bf16, fp16, fp32, fp8_e4m3, fp8_e5m2, "
      "fp8_ds_mla, got \"",
      name, "\"");
}

DType cache_latent_dtype(CacheFormat format) {
  switch (format) {
    case CacheFormat::kBFloat16:
      return DType::kBFloat16;
    case CacheFormat::kFloat16:
      return DType::kFloat16;
    case CacheFormat::kFloat32:
      return DType::kFloat32;
    case CacheFormat::kFloat8E4M3:
    case CacheFormat::kFloat8DsMla:
      return DType::kFloat8E4M3;
    case CacheFormat::kFloat8E5M2:
      return DType::kFloat8E5M2;
  }
  MLAKV_FAIL("cache_latent_dtype: format: unknown cache format value ", static_cast<int>(format));
}

DType cache_rope_dtype(CacheFormat format) {
  if (format == CacheFormat::kFloat8DsMla) return DType::kBFloat16;
  return cache_latent_dtype(format);
}

bool cache_is_per_tensor_fp8(CacheFormat format) {
  return format == CacheFormat::kFloat8E4M3 || format == CacheFormat::kFloat8E5M2;
}

namespace {
// One entry's bytes, or an error naming `op`, the public function the caller called.
int64_t entry_bytes(const char* op, CacheFormat format, int64_t L, int64_t R) {
  MLAKV_CHECK(L >= 0 && R >= 0, op, ": expected L >= 0 and R >= 0, got L = ", L, ", R = ", R);
  if (format == CacheFormat::kFloat8DsMla) {
    MLAKV_CHECK(L == kDsMlaLatentDim && R == kDsMlaRopeDim, op,
                ": fp8_ds_mla: expected L = ", kDsMlaLatentDim, " and R = ", kDsMlaRopeDim,
                ", got L = ", L, ", R = ", R);
    return kDsMlaEntryBytes;
  }
  int64_t bytes = 0;
  MLAKV_CHECK(
      L < core::kMaxExtentBytes && R < core::kMaxExtentBytes &&
          core::checked_mul_add(L + R, static_cast<int64_t>(dtype_size(cache_latent_dtype(format))),
                                0, &bytes),
      op, ": expected an entry below 2^", core::kMaxExtentLog2, " bytes, got L = ", L, ", R = ", R);
  return bytes;
}

// num_blocks * block_size entries, in bytes, below core::kMaxExtentBytes (or an error naming op).
int64_t checked_cache_bytes(const char* op, CacheFormat format, int64_t num_blocks,
                            int64_t block_size, int64_t L, int64_t R) {
  const int64_t entry = entry_bytes(op, format, L, R);
  int64_t slots = 0, bytes = 0, block_bytes = 0;
  // One block's bytes too: the view's stride_block_bytes, also when there is no block.
  MLAKV_CHECK(core::checked_mul_add(block_size, entry, 0, &block_bytes) &&
                  core::checked_mul_add(num_blocks, block_size, 0, &slots) &&
                  core::checked_mul_add(slots, entry, 0, &bytes),
              op, ": expected a cache below 2^", core::kMaxExtentLog2, " bytes, got ", num_blocks,
              " blocks of ", block_size, " entries of ", entry, " bytes");
  return bytes;
}

// The geometry both layouts share; `op` names the caller in the error message.
KVCacheView cache_geometry(const char* op, CacheFormat format, int64_t num_blocks,
                           int64_t block_size, int64_t L, int64_t R, Device device) {
  MLAKV_CHECK(num_blocks >= 0 && block_size >= 1, op, ": expected num_blocks >= 0 and ",
              "block_size >= 1, got num_blocks = ", num_blocks, ", block_size = ", block_size);
  checked_cache_bytes(op, format, num_blocks, block_size, L, R);
  KVCacheView v;
  v.format = format;
  v.device = device;
  v.num_blocks = num_blocks;
  v.block_size = block_size;
  v.kv_lora_rank = L;
  v.rope_dim = R;
  return v;
}
}  // namespace

int64_t cache_entry_bytes(CacheFormat format, int64_t L, int64_t R) {
  return entry_bytes("cache_entry_bytes", format, L, R);
}

KVCacheView make_cache_view(void* data, CacheFormat format, int64_t num_blocks, int64_t block_size,
                            int64_t L, int64_t R, Device device) {
  KVCacheView v = cache_geometry("make_cache_view", format, num_blocks, block_size, L, R, device);
  v.data = data;
  v.stride_token_bytes = entry_bytes("make_cache_view", format, L, R);
  v.stride_block_bytes = block_size * v.stride_token_bytes;
  return v;
}

KVCacheView make_split_cache_view(void* latent_data, void* rope_data, CacheFormat format,
                                  int64_t num_blocks, int64_t block_size, int64_t L, int64_t R,
                                  Device device) {
  MLAKV_CHECK(format != CacheFormat::kFloat8DsMla,
              "make_split_cache_view: format: fp8_ds_mla has only the combined layout");
  KVCacheView v =
      cache_geometry("make_split_cache_view", format, num_blocks, block_size, L, R, device);
  const int64_t elem = static_cast<int64_t>(dtype_size(cache_latent_dtype(format)));
  v.data = latent_data;
  v.stride_token_bytes = L * elem;
  v.stride_block_bytes = block_size * L * elem;
  v.rope_data = rope_data;
  v.stride_rope_token_bytes = R * elem;
  v.stride_rope_block_bytes = block_size * R * elem;
  return v;
}

int64_t cache_bytes(CacheFormat format, int64_t num_blocks, int64_t block_size, int64_t L,
                    int64_t R) {
  MLAKV_CHECK(num_blocks >= 0 && block_size >= 0, "cache_bytes: expected num_blocks >= 0 and ",
              "block_size >= 0, got num_blocks = ", num_blocks, ", block_size = ", block_size);
  return checked_cache_bytes("cache_bytes", format, num_blocks, block_size, L, R);
}

const char* rope_style_name(RopeStyle style) {
  switch (style) {
    case RopeStyle::kGptJ:
      return "gptj";
    case RopeStyle::kNeox:
      return "neox";
  }
  return "unknown_rope_style";
}

const char* error_counter_name(int32_t counter) {
  switch (counter) {
    case kBadSlot:
      return "bad_slot";
    case kBadPosition:
      return "bad_position";
    case kBadDecodeCount:
      return "bad_decode_count";
    case kBadBlockIndex:
      return "bad_block_index";
    default:
      return "unknown_counter";
  }
}

}  // namespace mlakv
