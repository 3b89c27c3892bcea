// mlakv internal: argument validation of the public ops (see validate.h).
#include "core/validate.h"

#include <cmath>
#include <cstdint>
#include <string>

#include "core/spans.h"
#include "mlakv/cache.h"
#include "mlakv/error.h"

namespace mlakv {
namespace core {
namespace {

constexpr int64_t kMaxLatentDim = 1024;
constexpr int64_t kMaxRopeDim = 256;
constexpr int64_t kLatentMultiple = 16;

bool aligned(const void* ptr, size_t alignment) {
  return reinterpret_cast<uintptr_t>(ptr) % alignment == 0;
}

// Throws mlakv::Error "op: name: parts..." when cond is false. A macro, so that the message parts
// (describe() strings and the like) are built only on failure: validation runs on every op call.
#define MLAKV_ARG_CHECK(validator, cond, name, ...)                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      throw ::mlakv::Error(                                                          \
          __FILE__, __LINE__,                                                        \
          ::mlakv::detail::concat((validator).op(), ": ", name, ": ", __VA_ARGS__)); \
    }                                                                                \
  } while (0)

// Accumulates the device of the op (the first tensor or cache checked) and checks each argument
// against it; every message starts with "op: argument: ".
class Validator {
 public:
  explicit Validator(const char* op) : op_(op) {}

  const char* op() const { return op_; }

  Device device() const { return device_; }

  template <typename Given>  // Given: a callable returning the description, built on failure only
  void device_of(const char* name, Device device, const Given& given) {
    MLAKV_ARG_CHECK(*this, device.type == DeviceType::kCPU || device.type == DeviceType::kCUDA,
                    name, "expected a cpu or cuda device, got ", given());
#ifndef MLAKV_WITH_CUDA
    MLAKV_ARG_CHECK(*this, device.type != DeviceType::kCUDA, name,
                    "CUDA tensors given but mlakv was built without the CUDA backend; got ",
                    given());
#endif
    MLAKV_ARG_CHECK(*this, device.type == DeviceType::kCPU || device.index >= 0, name,
                    "expected a CUDA device index >= 0, got ", given());
    if (!has_device_) {
      has_device_ = true;
      device_ = device;
      device_source_ = name;
      return;
    }
    MLAKV_ARG_CHECK(*this, device == device_, name, "expected to be on ", device_name(device_),
                    " (the device of ", device_source_, "), got ", given());
  }

  // Layout rules of every tensor: ndim, sizes >= 0, innermost stride 1 and other strides > 0 (any
  // on size-1 dims), sizes and strides within 2^56 bytes (spans.h), data non-null when non-empty
  // and aligned to the element size, one device.
  void tensor(const char* name, const TensorView& t, int ndim, const char* dims) {
    MLAKV_ARG_CHECK(*this, t.present(), name, "expected ", ndim, " dims ", dims, ", got absent");
    MLAKV_ARG_CHECK(*this, t.ndim == ndim, name, "expected ", ndim, " dims ", dims, ", got ",
                    t.describe());
    for (int d = 0; d < ndim; ++d) {
      MLAKV_ARG_CHECK(*this, t.shape[d] >= 0, name, "expected sizes >= 0, got ", t.describe());
    }
    MLAKV_ARG_CHECK(*this, t.shape[ndim - 1] <= 1 || t.stride[ndim - 1] == 1, name,
                    "expected a contiguous innermost dim (stride 1), got ", t.describe());
    for (int d = 0; d + 1 < ndim; ++d) {
      // A size-1 dim's stride is never used: any value (bounded by extent_bytes below).
      MLAKV_ARG_CHECK(*this, t.stride[d] > 0 || t.shape[d] <= 1, name,
                      "expected positive strides (any on size-1 dims), got ", t.describe());
    }
    MLAKV_ARG_CHECK(*this,
                    static_cast<int>(t.dtype) >= static_cast<int>(DType::kFloat32) &&
                        static_cast<int>(t.dtype) <= static_cast<int>(DType::kUInt8),
                    name, "expected a known dtype, got dtype value ", static_cast<int>(t.dtype));
    int64_t bytes = 0;
    MLAKV_ARG_CHECK(*this, extent_bytes(t, &bytes), name, "expected a view within 2^",
                    kMaxExtentLog2, " bytes (sizes, strides and the bytes spanned from its address",
                    " below 2^", kMaxExtentLog2, "), got ", t.describe(), " at address ", t.data);
    MLAKV_ARG_CHECK(*this, t.data != nullptr || bytes == 0, name, "expected non-null data for ",
                    t.numel(), " elements, got nullptr for ", t.describe());
    const size_t elem = dtype_size(t.dtype);
    MLAKV_ARG_CHECK(*this, aligned(t.data, elem), name, "expected data aligned to ", elem,
                    " bytes (", dtype_name(t.dtype), "), got address ", t.data, " for ",
                    t.describe());
    device_of(name, t.device, [&] { return t.describe(); });
  }

  void dtype(const char* name, const TensorView& t, DType expected, const char* why) {
    MLAKV_ARG_CHECK(*this, t.dtype == expected, name, "expected ", dtype_name(expected), " (", why,
                    "), got ", t.describe());
  }
  void model_dtype(const char* name, const TensorView& t) {
    MLAKV_ARG_CHECK(*this, is_model_dtype(t.dtype), name,
                    "expected float32, float16 or bfloat16 (the model dtype), got ", t.describe());
  }
  void index_dtype(const char* name, const TensorView& t) {
    MLAKV_ARG_CHECK(*this, t.dtype == DType::kInt32 || t.dtype == DType::kInt64, name,
                    "expected int32 or int64, got ", t.describe());
  }
  void rows(const char* name, const TensorView& t, int64_t min_rows, const char* what) {
    MLAKV_ARG_CHECK(*this, t.shape[0] >= min_rows, name, "expected shape[0] >= ", what, " = ",
                    min_rows, ", got ", t.describe());
  }
  void dim(const char* name, const TensorView& t, int d, int64_t expected, const char* what) {
    MLAKV_ARG_CHECK(*this, t.shape[d] == expected, name, "expected shape[", d, "] == ", what, " = ",
                    expected, ", got ", t.describe());
  }
  void scalar_ptr(const char* name, const void* ptr, const char* what) {
    MLAKV_ARG_CHECK(*this, aligned(ptr, 4), name, "expected a 4-byte aligned ", what,
                    ", got address ", ptr);
  }

  template <typename Given>
  void latent_dim(const char* name, int64_t L, const Given& given) {
    MLAKV_ARG_CHECK(*this, L >= kLatentMultiple && L <= kMaxLatentDim && L % kLatentMultiple == 0,
                    name, "expected L (kv_lora_rank) a multiple of ", kLatentMultiple, " in [",
                    kLatentMultiple, ", ", kMaxLatentDim, "], got L = ", L, " from ", given());
  }
  template <typename Given>
  void rope_dim(const char* name, int64_t R, const Given& given) {
    MLAKV_ARG_CHECK(*this, R >= 2 && R <= kMaxRopeDim && R % 2 == 0, name,
                    "expected R (rope dim) even in [2, ", kMaxRopeDim, "], got R = ", R, " from ",
                    given());
  }

  // The paged cache: format, geometry (L, R), strides and alignment, scale, device. model_dtype is
  // the op's model dtype, or nullptr for read-back ops.
  CacheArg cache(const char* name, const KVCacheView& c, int64_t L, int64_t R,
                 const DType* model_dtype) {
    const int format_value = static_cast<int>(c.format);
    MLAKV_ARG_CHECK(*this,
                    format_value >= static_cast<int>(CacheFormat::kBFloat16) &&
                        format_value <= static_cast<int>(CacheFormat::kFloat8DsMla),
                    name, "expected a known cache format, got format value ", format_value);
    const char* format = cache_format_name(c.format);
    device_of(name, c.device,
              [&] { return std::string(format) + " cache on " + device_name(c.device); });
    MLAKV_ARG_CHECK(*this, c.kv_lora_rank == L && c.rope_dim == R, name,
                    "expected entry geometry (L, R) = (", L, ", ", R, "), got (", c.kv_lora_rank,
                    ", ", c.rope_dim, ")");
    MLAKV_ARG_CHECK(*this, c.num_blocks >= 0, name, "expected num_blocks >= 0, got ", c.num_blocks);
    MLAKV_ARG_CHECK(*this, c.block_size >= 1, name, "expected block_size >= 1, got ", c.block_size);
    int64_t num_slots = 0;
    MLAKV_ARG_CHECK(*this, checked_mul_add(c.num_blocks, c.block_size, 0, &num_slots), name,
                    "expected num_blocks * block_size below 2^", kMaxExtentLog2, ", got ",
                    c.num_blocks, " * ", c.block_size);
    MLAKV_ARG_CHECK(*this, c.data != nullptr || num_slots == 0, name, "expected non-null data for ",
                    num_slots, " slots, got nullptr");

    const bool ds_mla = c.format == CacheFormat::kFloat8DsMla;
    if (ds_mla) {
      MLAKV_ARG_CHECK(*this, L == kDsMlaLatentDim && R == kDsMlaRopeDim, name,
                      "fp8_ds_mla needs L = ", kDsMlaLatentDim, " and R = ", kDsMlaRopeDim,
                      ", got L = ", L, ", R = ", R);
      MLAKV_ARG_CHECK(*this, model_dtype == nullptr || *model_dtype == DType::kBFloat16, name,
                      "fp8_ds_mla needs a bfloat16 model dtype, got ",
                      model_dtype ? dtype_name(*model_dtype) : "");
      MLAKV_ARG_CHECK(*this, !c.is_split(), name,
                      "fp8_ds_mla has only the combined layout, got rope_data set");
    }
    MLAKV_ARG_CHECK(*this, !c.ds_mla_pow2_scale || ds_mla, name,
                    "ds_mla_pow2_scale applies to fp8_ds_mla only, got it set on a ", format,
                    " cache");
    if (c.scale != nullptr) {
      MLAKV_ARG_CHECK(*this, cache_is_per_tensor_fp8(c.format), name,
                      "a scale is taken by the per-tensor fp8 formats only, got one for a ", format,
                      " cache");
      scalar_ptr(name, c.scale, "fp32 scale");
    }

    const int64_t latent_elem = static_cast<int64_t>(dtype_size(cache_latent_dtype(c.format)));
    const int64_t rope_elem = static_cast<int64_t>(dtype_size(cache_rope_dtype(c.format)));
    CacheArg a;
    a.format = c.format;
    a.num_slots = num_slots;
    a.block_size = c.block_size;
    a.data = static_cast<uint8_t*>(c.data);
    // The strides of size-1 dims are never used (strides() below): 0 in the arg, so that no
    // offset or alignment test of a backend sees the caller's arbitrary value.
    a.stride_block_bytes = c.num_blocks > 1 ? c.stride_block_bytes : 0;
    a.stride_token_bytes = c.block_size > 1 ? c.stride_token_bytes : 0;
    a.scale = c.scale;
    a.ds_mla_pow2_scale = c.ds_mla_pow2_scale;
    if (!c.is_split()) {
      // fp8_ds_mla entries hold fp32 tile scales: 4-byte alignment.
      const int64_t align = ds_mla ? 4 : latent_elem;
      const int64_t entry = cache_entry_bytes(c.format, L, R);
      strides(name, "", c.stride_token_bytes, c.stride_block_bytes, entry, c.num_blocks,
              c.block_size, align, c.data);
      return a;
    }
    MLAKV_ARG_CHECK(*this, c.data != nullptr, name,
                    "split layout needs both data and rope_data, got data nullptr");
    strides(name, "", c.stride_token_bytes, c.stride_block_bytes, L * latent_elem, c.num_blocks,
            c.block_size, latent_elem, c.data);
    strides(name, "rope_", c.stride_rope_token_bytes, c.stride_rope_block_bytes, R * rope_elem,
            c.num_blocks, c.block_size, rope_elem, c.rope_data);
    a.rope_data = static_cast<uint8_t*>(c.rope_data);
    a.stride_rope_block_bytes = c.num_blocks > 1 ? c.stride_rope_block_bytes : 0;
    a.stride_rope_token_bytes = c.block_size > 1 ? c.stride_rope_token_bytes : 0;
    return a;
  }

 private:
  // The entries of one part of the cache: strides that keep entries and blocks apart, aligned,
  // and all of it below kMaxExtentBytes from data (computed without overflow). As for every tensor,
  // the stride of a size-1 dim is never used and may be anything: the token stride of blocks of one
  // entry, the block stride of a cache of one block (a torch view of one block may carry any).
  void strides(const char* name, const char* part, int64_t token_bytes, int64_t block_bytes,
               int64_t entry_bytes, int64_t num_blocks, int64_t block_size, int64_t align,
               const void* data) {
    const bool tokens = block_size > 1;  // token_bytes is used
    const bool blocks = num_blocks > 1;  // block_bytes is used
    // A used stride is in [0, 2^56); an unused one, like a tensor's, anywhere in (-2^56, 2^56).
    const auto in_range = [](int64_t stride, bool used) {
      return stride < kMaxExtentBytes && (used ? stride >= 0 : stride > -kMaxExtentBytes);
    };
    MLAKV_ARG_CHECK(*this, in_range(token_bytes, tokens) && in_range(block_bytes, blocks), name,
                    "expected stride_", part, "token_bytes and stride_", part,
                    "block_bytes in [0, 2^", kMaxExtentLog2, ") (one of a size-1 dim: in (-2^",
                    kMaxExtentLog2, ", 2^", kMaxExtentLog2, ")), got ", token_bytes, " and ",
                    block_bytes);
    if (tokens) {
      MLAKV_ARG_CHECK(*this, token_bytes >= entry_bytes, name, "expected stride_", part,
                      "token_bytes >= ", entry_bytes, " (the entry), got ", token_bytes);
    }
    if (blocks) {
      int64_t block_min = entry_bytes;
      MLAKV_ARG_CHECK(*this,
                      (!tokens || checked_mul_add(block_size, token_bytes, 0, &block_min)) &&
                          block_bytes >= block_min,
                      name, "expected stride_", part, "block_bytes >= block_size * stride_", part,
                      "token_bytes = ", block_size, " * ", tokens ? token_bytes : entry_bytes,
                      ", got ", block_bytes);
    }
    MLAKV_ARG_CHECK(
        *this, (!tokens || token_bytes % align == 0) && (!blocks || block_bytes % align == 0), name,
        "expected stride_", part, "token_bytes and stride_", part, "block_bytes multiples of ",
        align, ", got ", token_bytes, " and ", block_bytes);
    MLAKV_ARG_CHECK(*this, aligned(data, static_cast<size_t>(align)), name, "expected ", part,
                    "data aligned to ", align, " bytes, got address ", data);
    // The last entry ends (num_blocks - 1) * block_bytes + (block_size - 1) * token_bytes + entry
    // bytes after data (the terms of unused strides are 0).
    int64_t extent = entry_bytes;
    MLAKV_ARG_CHECK(
        *this,
        num_blocks == 0 ||
            ((!blocks || checked_mul_add(num_blocks - 1, block_bytes, extent, &extent)) &&
             (!tokens || checked_mul_add(block_size - 1, token_bytes, extent, &extent)) &&
             reinterpret_cast<uintptr_t>(data) <= UINTPTR_MAX - static_cast<uintptr_t>(extent)),
        name, "expected ", part, "entries spanning less than 2^", kMaxExtentLog2,
        " bytes from the cache's address, got ", num_blocks, " blocks of stride_", part,
        "block_bytes = ", block_bytes, " at address ", data);
  }

  const char* op_;
  bool has_device_ = false;
  Device device_{};
  const char* device_source_ = "";
};

IndexArg index_arg(const TensorView& t) {
  IndexArg a;
  a.data = t.data;
  a.is_int64 = t.dtype == DType::kInt64;
  a.stride = canonical_stride(t, 0);
  return a;
}

// A count given beside the tensors (T, num_seqs): >= 0 and below 2^56, like every size, so that
// n + 1 and the like cannot overflow.
void check_num_tokens(Validator& v, const char* name, int64_t n) {
  MLAKV_ARG_CHECK(v, n >= 0 && n < kMaxExtentBytes, name, "expected >= 0 and below 2^",
                  kMaxExtentLog2, ", got ", n);
}

// RMSNorm's eps, the same rule in every op (rmsnorm_quant.cpp too): finite and >= 0 (with 0, an
// all-zero row normalizes to NaN, as the formula says).
void check_eps(Validator& v, const char* name, float eps) {
  MLAKV_ARG_CHECK(v, std::isfinite(eps) && eps >= 0.0f, name, "expected a finite value >= 0, got ",
                  eps);
}

void check_context(Validator& v, const Context& ctx) {
  MLAKV_ARG_CHECK(v, ctx.num_threads >= 0, "ctx.num_threads",
                  "expected >= 0 (0 = all threads), got ", ctx.num_threads);
  if (ctx.error_counts != nullptr) {
    v.scalar_ptr("ctx.error_counts", ctx.error_counts, "int32 counter array");
  }
  MLAKV_ARG_CHECK(v, !ctx.checked || ctx.error_counts != nullptr, "ctx.checked",
                  "checked mode needs ctx.error_counts, got nullptr");
}

// The decode query q_out [rows, H, L + R]: the model dtype (named by `model_from`) or float8.
void check_q_out_dtype(Validator& v, const TensorView& q_out, DType model, const char* model_from) {
  MLAKV_ARG_CHECK(v, is_model_dtype(q_out.dtype) ? q_out.dtype == model : is_float8(q_out.dtype),
                  "q_out", "expected the model dtype ", dtype_name(model), " (from ", model_from,
                  ") or float8_e4m3fn / float8_e5m2, got ", q_out.describe());
}

// q_scale: only with an fp8 q_out, one readable fp32.
void check_q_scale(Validator& v, const float* q_scale, const TensorView& q_out) {
  if (q_scale == nullptr) return;
  MLAKV_ARG_CHECK(v, is_float8(q_out.dtype), "q_scale",
                  "only an fp8 q_out takes a scale, got one with q_out ", q_out.describe());
  v.scalar_ptr("q_scale", q_scale, "fp32 scale");
}

// positions / slot_mapping / slots: [>=n] int32 or int64.
IndexArg index_tensor(Validator& v, const char* name, const TensorView& t, int64_t n,
                      const char* what) {
  v.tensor(name, t, 1, "[T]");
  v.index_dtype(name, t);
  v.rows(name, t, n, what);
  return index_arg(t);
}

// cos_sin_cache: [max_pos >= 1, R] fp32 / bf16 / fp16.
RopeTableArg rope_table(Validator& v, const char* name, const TensorView& t, int64_t R,
                        const char* r_name, RopeStyle style) {
  v.tensor(name, t, 2, "[max_pos, R]");
  MLAKV_ARG_CHECK(
      v, t.dtype == DType::kFloat32 || t.dtype == DType::kBFloat16 || t.dtype == DType::kFloat16,
      name, "expected float32, bfloat16 or float16, got ", t.describe());
  MLAKV_ARG_CHECK(v, t.shape[0] >= 1, name, "expected max_pos = shape[0] >= 1, got ", t.describe());
  v.dim(name, t, 1, R, r_name);
  MLAKV_ARG_CHECK(v, style == RopeStyle::kGptJ || style == RopeStyle::kNeox, "rope_style",
                  "expected kGptJ or kNeox, got value ", static_cast<int>(style));
  RopeTableArg a;
  a.data = t.data;
  a.dtype = t.dtype;
  a.max_pos = t.shape[0];
  a.stride_pos = canonical_stride(t, 0);
  a.style = style;
  return a;
}

// An output that may be its input: allowed when it is the same memory with the same strides,
// rejected when it starts at the input's address with another layout (a partial alias). `offset`
// (elements of out) places the input inside out's innermost dim (q_pe in q_out's rope part).
bool exact_alias(Validator& v, const char* name, const TensorView& out, const char* in_name,
                 const TensorView& in, int64_t offset = 0) {
  // Null first: an empty out may have no data, and no offset may be added to a null pointer.
  if (out.data == nullptr || out.numel() == 0) return false;
  const uint8_t* at =
      static_cast<const uint8_t*>(out.data) + offset * static_cast<int64_t>(dtype_size(out.dtype));
  if (at != in.data) return false;
  for (int d = 0; d + 1 < out.ndim; ++d) {
    // The stride of a size-1 dim is never used, so it need not match.
    MLAKV_ARG_CHECK(v, out.shape[d] <= 1 || out.stride[d] == in.stride[d], name, "may alias ",
                    in_name, " only exactly (same data and strides), got ", out.describe(), " vs ",
                    in.describe());
  }
  return true;
}

// ---- the memory an op's tensors share (spans.h) ----

// The spans of a validated cache (the rope part of a split cache as its own span), as outputs
// (the writing ops) or inputs (the read-back ops).
void add_cache(MemoryCheck& m, const KVCacheView& c, bool written) {
  const int64_t L = c.kv_lora_rank;
  const int64_t R = c.rope_dim;
  const int64_t latent_elem = static_cast<int64_t>(dtype_size(cache_latent_dtype(c.format)));
  const int64_t rope_elem = static_cast<int64_t>(dtype_size(cache_rope_dtype(c.format)));
  const int64_t entry = c.is_split() ? L * latent_elem : cache_entry_bytes(c.format, L, R);
  const Span latent = cache_span("kv_cache", c.data, c.num_blocks, c.block_size,
                                 c.stride_block_bytes, c.stride_token_bytes, entry);
  const Span rope =
      c.is_split() ? cache_span("kv_cache's rope_data", c.rope_data, c.num_blocks, c.block_size,
                                c.stride_rope_block_bytes, c.stride_rope_token_bytes, R * rope_elem)
                   : Span{};
  const Span scale = bytes_span("kv_cache's scale", c.scale, 4);
  if (written) {
    m.output(latent);
    m.output(rope);
  } else {
    m.input(latent);
    m.input(rope);
  }
  m.input(scale);
}

// The context's error counters: written by every op that has them.
void add_error_counts(MemoryCheck& m, const Context& ctx) {
  m.output(bytes_span("ctx.error_counts", ctx.error_counts, 4 * kNumErrorCounters));
}

// kv_c [T, L] and k_pe [T, R] in the model dtype (kv_c's): the K-side inputs of the fused op and
// of concat_and_cache_mla.
struct KInputs {
  DType model;
  int64_t L;
  int64_t R;
};
KInputs check_k_inputs(Validator& v, const TensorView& kv_c, const TensorView& k_pe, int64_t T) {
  v.tensor("kv_c", kv_c, 2, "[T, L]");
  v.model_dtype("kv_c", kv_c);
  const DType model = kv_c.dtype;
  const int64_t L = kv_c.shape[1];
  v.latent_dim("kv_c", L, [&] { return kv_c.describe(); });
  v.rows("kv_c", kv_c, T, "T");
  v.tensor("k_pe", k_pe, 2, "[T, R]");
  v.dtype("k_pe", k_pe, model, "the model dtype, from kv_c");
  const int64_t R = k_pe.shape[1];
  v.rope_dim("k_pe", R, [&] { return k_pe.describe(); });
  v.rows("k_pe", k_pe, T, "T");
  return {model, L, R};
}

}  // namespace

MlaRopeCacheArgs validate_mla_rope_cache(const char* op, const MlaRopeCacheParams& p,
                                         const Context& ctx, Device* device) {
  Validator v(op);
  const int64_t T = p.num_tokens;
  check_num_tokens(v, "num_tokens", T);

  const KInputs k = check_k_inputs(v, p.kv_c, p.k_pe, T);
  const DType model = k.model;
  const int64_t L = k.L;
  const int64_t R = k.R;

  MlaRopeCacheArgs a;
  a.positions = index_tensor(v, "positions", p.positions, T, "T");
  a.slot_mapping = index_tensor(v, "slot_mapping", p.slot_mapping, T, "T");
  a.rope = rope_table(v, "cos_sin_cache", p.cos_sin_cache, R, "R", p.rope_style);

  if (p.kv_norm_weight.present()) {
    v.tensor("kv_norm_weight", p.kv_norm_weight, 1, "[L]");
    v.dtype("kv_norm_weight", p.kv_norm_weight, model, "the model dtype, from kv_c");
    v.dim("kv_norm_weight", p.kv_norm_weight, 0, L, "L");
    check_eps(v, "kv_norm_eps", p.kv_norm_eps);
  }
  a.cache = v.cache("kv_cache", p.kv_cache, L, R, &model);

  bool k_pe_in_place = false;
  bool kv_c_in_place = false;
  if (p.k_pe_out.present()) {
    v.tensor("k_pe_out", p.k_pe_out, 2, "[T, R]");
    v.dtype("k_pe_out", p.k_pe_out, model, "the model dtype, from kv_c");
    v.rows("k_pe_out", p.k_pe_out, T, "T");
    v.dim("k_pe_out", p.k_pe_out, 1, R, "R");
    k_pe_in_place = exact_alias(v, "k_pe_out", p.k_pe_out, "k_pe", p.k_pe);
  }
  if (p.kv_c_out.present()) {
    v.tensor("kv_c_out", p.kv_c_out, 2, "[T, L]");
    v.dtype("kv_c_out", p.kv_c_out, model, "the model dtype, from kv_c");
    v.rows("kv_c_out", p.kv_c_out, T, "T");
    v.dim("kv_c_out", p.kv_c_out, 1, L, "L");
    kv_c_in_place = exact_alias(v, "kv_c_out", p.kv_c_out, "kv_c", p.kv_c);
  }

  // Td: from the device (clamped by the backend, so decode tensors need T rows) or the host.
  const bool device_td = p.num_decode_tokens_device != nullptr;
  int64_t decode_rows = T;
  const char* decode_rows_name = "T (device Td)";
  if (device_td) {
    v.scalar_ptr("num_decode_tokens_device", p.num_decode_tokens_device, "int32");
    // The host Td would be ignored: a value left there is a bug in the caller.
    MLAKV_ARG_CHECK(v, p.num_decode_tokens == 0, "num_decode_tokens",
                    "expected 0 with num_decode_tokens_device (the device Td is read instead), "
                    "got ",
                    p.num_decode_tokens);
  } else {
    MLAKV_ARG_CHECK(v, p.num_decode_tokens >= 0 && p.num_decode_tokens <= T, "num_decode_tokens",
                    "expected 0 <= Td <= T = ", T, ", got ", p.num_decode_tokens);
    decode_rows = p.num_decode_tokens;
    decode_rows_name = "Td";
  }

  int64_t H = 0;
  bool q_pe_in_place = false;
  bool ql_nope_in_place = false;
  if (p.q_out.present()) {
    v.tensor("q_out", p.q_out, 3, "[Td, H, L + R]");
    check_q_out_dtype(v, p.q_out, model, "kv_c");
    v.rows("q_out", p.q_out, decode_rows, decode_rows_name);
    v.dim("q_out", p.q_out, 2, L + R, "L + R");
    H = p.q_out.shape[1];
    MLAKV_ARG_CHECK(v, H >= 1, "q_out", "expected H = shape[1] >= 1, got ", p.q_out.describe());

    MLAKV_ARG_CHECK(v, p.q_pe.present(), "q_pe",
                    "expected 3 dims [Td, H, R] (required with q_out), got absent");
    v.tensor("q_pe", p.q_pe, 3, "[Td, H, R]");
    v.dtype("q_pe", p.q_pe, model, "the model dtype, from kv_c");
    v.rows("q_pe", p.q_pe, decode_rows, decode_rows_name);
    v.dim("q_pe", p.q_pe, 1, H, "H (from q_out)");
    v.dim("q_pe", p.q_pe, 2, R, "R");

    const bool fp8_out = is_float8(p.q_out.dtype);
    // A model-dtype q_out may hold q_pe in its rope part (rotated in place); an fp8 one may not
    // (it shares no byte with its sources: the memory check below).
    if (!fp8_out) q_pe_in_place = exact_alias(v, "q_pe", p.q_out, "q_out's rope part", p.q_pe, L);
    bool copy_nope = false;
    if (p.ql_nope.present()) {
      v.tensor("ql_nope", p.ql_nope, 3, "[Td, H, L]");
      v.dtype("ql_nope", p.ql_nope, model, "the model dtype, from kv_c");
      v.rows("ql_nope", p.ql_nope, decode_rows, decode_rows_name);
      v.dim("ql_nope", p.ql_nope, 1, H, "H (from q_out)");
      v.dim("ql_nope", p.ql_nope, 2, L, "L");
      if (fp8_out) {
        copy_nope = true;
      } else {
        ql_nope_in_place = exact_alias(v, "ql_nope", p.ql_nope, "q_out's nope part", p.q_out);
        copy_nope = !ql_nope_in_place;
      }
    } else {
      MLAKV_ARG_CHECK(v, !fp8_out, "ql_nope",
                      "expected 3 dims [Td, H, L] (required with an fp8 q_out), ", "got absent");
    }
    check_q_scale(v, p.q_scale, p.q_out);

    a.q_pe = p.q_pe.data;
    a.stride_q_pe_token = canonical_stride(p.q_pe, 0);
    a.stride_q_pe_head = canonical_stride(p.q_pe, 1);
    if (copy_nope) {
      a.ql_nope = p.ql_nope.data;
      a.stride_ql_nope_token = canonical_stride(p.ql_nope, 0);
      a.stride_ql_nope_head = canonical_stride(p.ql_nope, 1);
    }
    a.copy_nope = copy_nope;
    a.q_out = p.q_out.data;
    a.stride_q_out_token = canonical_stride(p.q_out, 0);
    a.stride_q_out_head = canonical_stride(p.q_out, 1);
    a.q_out_dtype = p.q_out.dtype;
    a.q_scale = p.q_scale;
  } else {
    MLAKV_ARG_CHECK(v, device_td || p.num_decode_tokens == 0, "q_out",
                    "num_decode_tokens = ", p.num_decode_tokens, " > 0 needs q_out, got absent");
    MLAKV_ARG_CHECK(v, !p.q_pe.present(), "q_pe",
                    "given without q_out (the decode Q side runs only with ", "q_out), got ",
                    p.q_pe.describe());
    MLAKV_ARG_CHECK(v, !p.ql_nope.present(), "ql_nope",
                    "given without q_out (the decode Q side runs only ", "with q_out), got ",
                    p.ql_nope.describe());
    MLAKV_ARG_CHECK(v, p.q_scale == nullptr, "q_scale", "given without q_out");
  }

  int64_t P = 0;
  bool q_in_place = false;
  if (p.q.present()) {
    v.tensor("q", p.q, 3, "[T, H, P + R]");
    v.dtype("q", p.q, model, "the model dtype, from kv_c");
    v.rows("q", p.q, T, "T");
    MLAKV_ARG_CHECK(v, p.q.shape[2] >= R, "q", "expected shape[2] = P + R >= R = ", R, ", got ",
                    p.q.describe());
    MLAKV_ARG_CHECK(v, p.q.shape[1] >= 1, "q", "expected H = shape[1] >= 1, got ", p.q.describe());
    if (H != 0) v.dim("q", p.q, 1, H, "H (from q_out)");
    H = p.q.shape[1];
    P = p.q.shape[2] - R;
    a.q = p.q.data;
    a.stride_q_token = canonical_stride(p.q, 0);
    a.stride_q_head = canonical_stride(p.q, 1);
    if (p.q_prefill_out.present()) {
      v.tensor("q_prefill_out", p.q_prefill_out, 3, "[T, H, P + R]");
      v.dtype("q_prefill_out", p.q_prefill_out, model, "the model dtype, from kv_c");
      v.rows("q_prefill_out", p.q_prefill_out, T, "T");
      v.dim("q_prefill_out", p.q_prefill_out, 1, H, "H (from q)");
      v.dim("q_prefill_out", p.q_prefill_out, 2, P + R, "P + R (from q)");
      q_in_place = exact_alias(v, "q_prefill_out", p.q_prefill_out, "q", p.q);
      if (!q_in_place) {
        a.q_prefill_out = p.q_prefill_out.data;
        a.stride_q_prefill_out_token = canonical_stride(p.q_prefill_out, 0);
        a.stride_q_prefill_out_head = canonical_stride(p.q_prefill_out, 1);
      }
    }
  } else {
    MLAKV_ARG_CHECK(v, !p.q_prefill_out.present(), "q_prefill_out", "given without q, got ",
                    p.q_prefill_out.describe());
  }
  check_context(v, ctx);

  a.num_tokens = T;
  a.num_heads = H;
  a.kv_lora_rank = L;
  a.rope_dim = R;
  a.nope_dim = P;
  a.num_decode_tokens = device_td ? 0 : p.num_decode_tokens;
  a.num_decode_tokens_device = p.num_decode_tokens_device;
  a.model_dtype = model;
  a.kv_c = p.kv_c.data;
  a.stride_kv_c_token = canonical_stride(p.kv_c, 0);
  a.k_pe = p.k_pe.data;
  a.stride_k_pe_token = canonical_stride(p.k_pe, 0);
  if (p.kv_norm_weight.present()) {
    a.kv_norm_weight = p.kv_norm_weight.data;
    a.kv_norm_eps = p.kv_norm_eps;
  }
  if (p.k_pe_out.present()) {
    a.k_pe_out = p.k_pe_out.data;
    a.stride_k_pe_out_token = canonical_stride(p.k_pe_out, 0);
  }
  if (p.kv_c_out.present()) {
    a.kv_c_out = p.kv_c_out.data;
    a.stride_kv_c_out_token = canonical_stride(p.kv_c_out, 0);
  }

  MemoryCheck m(v.op());
  m.input(span_of("kv_c", p.kv_c, T));
  m.input(span_of("k_pe", p.k_pe, T));
  m.input(span_of("positions", p.positions, T));
  m.input(span_of("slot_mapping", p.slot_mapping, T));
  m.input(span_of("cos_sin_cache", p.cos_sin_cache));
  m.input(span_of("kv_norm_weight", p.kv_norm_weight));
  m.input(bytes_span("num_decode_tokens_device", p.num_decode_tokens_device, 4));
  add_cache(m, p.kv_cache, true);
  add_error_counts(m, ctx);
  if (p.k_pe_out.present()) m.output("k_pe_out", p.k_pe_out, T);
  if (k_pe_in_place) m.allow("k_pe_out", "k_pe");
  if (p.kv_c_out.present()) m.output("kv_c_out", p.kv_c_out, T);
  if (kv_c_in_place) m.allow("kv_c_out", "kv_c");
  if (p.q_out.present()) {
    m.output("q_out", p.q_out, decode_rows);
    m.input(span_of("q_pe", p.q_pe, decode_rows));
    m.input(span_of("ql_nope", p.ql_nope, decode_rows));
    m.input(bytes_span("q_scale", p.q_scale, 4));
    if (q_pe_in_place) m.allow("q_out", "q_pe");
    if (ql_nope_in_place) m.allow("q_out", "ql_nope");
  }
  if (p.q.present()) {
    // The prefill rows [Td, T) of q (or q_prefill_out); without a separate q_prefill_out, q's rope
    // parts are rotated in place: q is an output. With a device Td the split is not known here,
    // so the decode tensors may be other rows of the same memory (q_pe a view of q's decode
    // rows): those pairs are not checked.
    const int64_t first = device_td ? 0 : p.num_decode_tokens;
    const char* q_name = "q";
    if (p.q_prefill_out.present() && !q_in_place) {
      m.input(span_of("q", p.q, T, first));
      m.output("q_prefill_out", p.q_prefill_out, T, first);
      q_name = "q_prefill_out";
    } else {
      m.output("q", p.q, T, first);
    }
    if (device_td) {
      for (const char* decode_tensor : {"q_pe", "ql_nope", "q_out"}) m.allow(q_name, decode_tensor);
      m.allow("q_out", "q");
    }
  }
  m.check();

  a.error_counts = ctx.error_counts;
  *device = v.device();
  return a;
}

RotaryEmbeddingArgs validate_rotary_embedding(const char* op, const RotaryEmbeddingParams& p,
                                              const Context& ctx, Device* device) {
  Validator v(op);
  const int64_t T = p.num_tokens;
  check_num_tokens(v, "num_tokens", T);
  v.tensor("query", p.query, 3, "[T, Hq, head_size]");
  v.model_dtype("query", p.query);
  const DType model = p.query.dtype;
  v.rows("query", p.query, T, "T");
  MLAKV_ARG_CHECK(v, p.query.shape[1] >= 1, "query", "expected Hq = shape[1] >= 1, got ",
                  p.query.describe());
  const int64_t head_size = p.query.shape[2];

  RotaryEmbeddingArgs a;
  a.positions = index_tensor(v, "positions", p.positions, T, "T");
  v.tensor("cos_sin_cache", p.cos_sin_cache, 2, "[max_pos, rot_dim]");
  const int64_t rot_dim = p.cos_sin_cache.shape[1];
  MLAKV_ARG_CHECK(
      v, rot_dim >= 2 && rot_dim % 2 == 0 && rot_dim <= head_size && rot_dim <= kMaxRopeDim,
      "cos_sin_cache", "expected rot_dim = shape[1] even, >= 2, <= ", kMaxRopeDim,
      " and <= head_size = ", head_size, ", got ", p.cos_sin_cache.describe());
  a.rope = rope_table(v, "cos_sin_cache", p.cos_sin_cache, rot_dim, "rot_dim", p.rope_style);

  if (p.key.present()) {
    v.tensor("key", p.key, 3, "[T, Hk, head_size]");
    v.dtype("key", p.key, model, "the model dtype, from query");
    v.rows("key", p.key, T, "T");
    MLAKV_ARG_CHECK(v, p.key.shape[1] >= 1, "key", "expected Hk = shape[1] >= 1, got ",
                    p.key.describe());
    v.dim("key", p.key, 2, head_size, "head_size (from query)");
    a.key = p.key.data;
    a.num_k_heads = p.key.shape[1];
    a.stride_key_token = canonical_stride(p.key, 0);
    a.stride_key_head = canonical_stride(p.key, 1);
  }
  check_context(v, ctx);

  a.num_tokens = T;
  a.head_size = head_size;
  a.rot_dim = rot_dim;
  a.model_dtype = model;
  a.query = p.query.data;
  a.num_q_heads = p.query.shape[1];
  a.stride_query_token = canonical_stride(p.query, 0);
  a.stride_query_head = canonical_stride(p.query, 1);

  // query and key are rotated in place: both outputs.
  MemoryCheck m(v.op());
  m.input(span_of("positions", p.positions, T));
  m.input(span_of("cos_sin_cache", p.cos_sin_cache));
  add_error_counts(m, ctx);
  m.output("query", p.query, T);
  if (p.key.present()) m.output("key", p.key, T);
  m.check();

  a.error_counts = ctx.error_counts;
  *device = v.device();
  return a;
}

ConcatAndCacheMlaArgs validate_concat_and_cache_mla(const char* op,
                                                    const ConcatAndCacheMlaParams& p,
                                                    const Context& ctx, Device* device) {
  Validator v(op);
  const int64_t T = p.num_tokens;
  check_num_tokens(v, "num_tokens", T);
  const KInputs k = check_k_inputs(v, p.kv_c, p.k_pe, T);
  const DType model = k.model;
  const int64_t L = k.L;
  const int64_t R = k.R;

  ConcatAndCacheMlaArgs a;
  a.slot_mapping = index_tensor(v, "slot_mapping", p.slot_mapping, T, "T");
  a.cache = v.cache("kv_cache", p.kv_cache, L, R, &model);
  check_context(v, ctx);

  a.num_tokens = T;
  a.kv_lora_rank = L;
  a.rope_dim = R;
  a.model_dtype = model;
  a.kv_c = p.kv_c.data;
  a.stride_kv_c_token = canonical_stride(p.kv_c, 0);
  a.k_pe = p.k_pe.data;
  a.stride_k_pe_token = canonical_stride(p.k_pe, 0);

  MemoryCheck m(v.op());
  m.input(span_of("kv_c", p.kv_c, T));
  m.input(span_of("k_pe", p.k_pe, T));
  m.input(span_of("slot_mapping", p.slot_mapping, T));
  add_cache(m, p.kv_cache, true);
  add_error_counts(m, ctx);
  m.check();

  a.error_counts = ctx.error_counts;
  *device = v.device();
  return a;
}

DecodeQConcatArgs validate_decode_q_concat(const char* op, const DecodeQConcatParams& p,
                                           const Context& ctx, Device* device) {
  Validator v(op);
  const int64_t T = p.num_tokens;
  check_num_tokens(v, "num_tokens", T);
  v.tensor("ql_nope", p.ql_nope, 3, "[T, H, L]");
  v.model_dtype("ql_nope", p.ql_nope);
  const DType model = p.ql_nope.dtype;
  v.rows("ql_nope", p.ql_nope, T, "T");
  const int64_t H = p.ql_nope.shape[1];
  MLAKV_ARG_CHECK(v, H >= 1, "ql_nope", "expected H = shape[1] >= 1, got ", p.ql_nope.describe());
  const int64_t L = p.ql_nope.shape[2];
  v.latent_dim("ql_nope", L, [&] { return p.ql_nope.describe(); });

  v.tensor("q_pe", p.q_pe, 3, "[T, H, R]");
  v.dtype("q_pe", p.q_pe, model, "the model dtype, from ql_nope");
  v.rows("q_pe", p.q_pe, T, "T");
  v.dim("q_pe", p.q_pe, 1, H, "H (from ql_nope)");
  const int64_t R = p.q_pe.shape[2];
  v.rope_dim("q_pe", R, [&] { return p.q_pe.describe(); });

  v.tensor("q_out", p.q_out, 3, "[T, H, L + R]");
  check_q_out_dtype(v, p.q_out, model, "ql_nope");
  v.rows("q_out", p.q_out, T, "T");
  v.dim("q_out", p.q_out, 1, H, "H (from ql_nope)");
  v.dim("q_out", p.q_out, 2, L + R, "L + R");
  const bool fp8_out = is_float8(p.q_out.dtype);
  bool ql_nope_in_place = false;
  bool q_pe_in_place = false;
  // An fp8 q_out shares no byte with its sources (the memory check below).
  if (!fp8_out) {
    ql_nope_in_place = exact_alias(v, "ql_nope", p.ql_nope, "q_out's nope part", p.q_out);
    q_pe_in_place = exact_alias(v, "q_pe", p.q_out, "q_out's rope part", p.q_pe, L);
  }
  check_q_scale(v, p.q_scale, p.q_out);
  check_context(v, ctx);

  MemoryCheck m(v.op());
  m.input(span_of("ql_nope", p.ql_nope, T));
  m.input(span_of("q_pe", p.q_pe, T));
  m.input(bytes_span("q_scale", p.q_scale, 4));
  m.output("q_out", p.q_out, T);
  if (ql_nope_in_place) m.allow("q_out", "ql_nope");
  if (q_pe_in_place) m.allow("q_out", "q_pe");
  m.check();

  DecodeQConcatArgs a;
  a.num_tokens = T;
  a.num_heads = H;
  a.kv_lora_rank = L;
  a.rope_dim = R;
  a.model_dtype = model;
  // A part already in its place in q_out is not copied onto itself (nullptr, as the fused op's
  // ql_nope); with both in place the op has nothing to do.
  if (!ql_nope_in_place) {
    a.ql_nope = p.ql_nope.data;
    a.stride_ql_nope_token = canonical_stride(p.ql_nope, 0);
    a.stride_ql_nope_head = canonical_stride(p.ql_nope, 1);
  }
  if (!q_pe_in_place) {
    a.q_pe = p.q_pe.data;
    a.stride_q_pe_token = canonical_stride(p.q_pe, 0);
    a.stride_q_pe_head = canonical_stride(p.q_pe, 1);
  }
  a.q_out = p.q_out.data;
  a.stride_q_out_token = canonical_stride(p.q_out, 0);
  a.stride_q_out_head = canonical_stride(p.q_out, 1);
  a.q_out_dtype = p.q_out.dtype;
  a.q_scale = p.q_scale;
  *device = v.device();
  return a;
}

RmsNormArgs validate_rms_norm(const char* op, const RmsNormParams& p, const Context& ctx,
                              Device* device) {
  Validator v(op);
  const int64_t T = p.num_tokens;
  check_num_tokens(v, "num_tokens", T);
  v.tensor("input", p.input, 2, "[T, N]");
  v.model_dtype("input", p.input);
  const DType model = p.input.dtype;
  v.rows("input", p.input, T, "T");
  const int64_t N = p.input.shape[1];
  // A row's sum of squares is the pairwise tree of numerics.h, whose binary counter holds 2^32 - 1
  // arrivals (the CPU backend adds 8 elements an arrival): rows below 2^31 elements stay far
  // inside it.
  MLAKV_ARG_CHECK(v, N >= 1 && N < (int64_t{1} << 31), "input",
                  "expected N = shape[1] in [1, 2^31), got ", p.input.describe());
  v.tensor("weight", p.weight, 1, "[N]");
  v.dtype("weight", p.weight, model, "the model dtype, from input");
  v.dim("weight", p.weight, 0, N, "N (from input)");
  check_eps(v, "eps", p.eps);
  v.tensor("output", p.output, 2, "[T, N]");
  v.dtype("output", p.output, model, "the model dtype, from input");
  v.rows("output", p.output, T, "T");
  v.dim("output", p.output, 1, N, "N (from input)");
  const bool in_place = exact_alias(v, "output", p.output, "input", p.input);
  check_context(v, ctx);

  MemoryCheck m(v.op());
  m.input(span_of("input", p.input, T));
  m.input(span_of("weight", p.weight));
  m.output("output", p.output, T);
  if (in_place) m.allow("output", "input");
  m.check();

  RmsNormArgs a;
  a.num_tokens = T;
  a.hidden = N;
  a.model_dtype = model;
  a.input = p.input.data;
  a.stride_input_token = canonical_stride(p.input, 0);
  a.weight = p.weight.data;
  a.eps = p.eps;
  a.output = p.output.data;
  a.stride_output_token = canonical_stride(p.output, 0);
  *device = v.device();
  return a;
}

namespace {

// The cache and the dequantized output rows [rows, L + R] of both read-back ops.
GatherCacheArgs gather_common(Validator& v, const KVCacheView& cache, const TensorView& out,
                              const char* out_dims) {
  const int64_t L = cache.kv_lora_rank;
  const int64_t R = cache.rope_dim;
  const auto geometry = [&] {
    return "kv_lora_rank " + std::to_string(L) + ", rope_dim " + std::to_string(R);
  };
  v.latent_dim("kv_cache", L, geometry);
  v.rope_dim("kv_cache", R, geometry);
  GatherCacheArgs a;
  a.cache = v.cache("kv_cache", cache, L, R, nullptr);
  v.tensor("out", out, 2, out_dims);
  MLAKV_ARG_CHECK(v, out.dtype == DType::kBFloat16 || out.dtype == DType::kFloat32, "out",
                  "expected bfloat16 or float32, got ", out.describe());
  v.dim("out", out, 1, L + R, "L + R (from kv_cache)");
  a.kv_lora_rank = L;
  a.rope_dim = R;
  a.num_blocks = cache.num_blocks;
  a.out = out.data;
  a.out_dtype = out.dtype;
  a.stride_out_token = canonical_stride(out, 0);
  return a;
}

}  // namespace

GatherCacheArgs validate_gather_cache_slots(const char* op, const GatherCacheSlotsParams& p,
                                            const Context& ctx, Device* device) {
  Validator v(op);
  const int64_t N = p.num_tokens;
  check_num_tokens(v, "num_tokens", N);
  GatherCacheArgs a = gather_common(v, p.kv_cache, p.out, "[N, L + R]");
  v.rows("out", p.out, N, "N");
  a.slots = index_tensor(v, "slots", p.slots, N, "N");
  check_context(v, ctx);

  MemoryCheck m(v.op());
  add_cache(m, p.kv_cache, false);
  m.input(span_of("slots", p.slots, N));
  add_error_counts(m, ctx);
  m.output("out", p.out, N);
  m.check();
  a.num_rows = N;
  a.error_counts = ctx.error_counts;
  *device = v.device();
  return a;
}

GatherCacheArgs validate_gather_cache_sequences(const char* op, const GatherCacheSequencesParams& p,
                                                const Context& ctx, Device* device) {
  Validator v(op);
  const int64_t B = p.num_seqs;
  check_num_tokens(v, "num_seqs", B);
  GatherCacheArgs a = gather_common(v, p.kv_cache, p.out, "[num_out_rows, L + R]");
  v.tensor("block_table", p.block_table, 2, "[B, max_blocks_per_seq]");
  v.dtype("block_table", p.block_table, DType::kInt32, "block ids");
  v.rows("block_table", p.block_table, B, "B");
  v.tensor("cu_seq_lens", p.cu_seq_lens, 1, "[B + 1]");
  v.dtype("cu_seq_lens", p.cu_seq_lens, DType::kInt32, "cumulative sequence lengths");
  v.rows("cu_seq_lens", p.cu_seq_lens, B + 1, "B + 1");
  check_context(v, ctx);

  MemoryCheck m(v.op());
  add_cache(m, p.kv_cache, false);
  m.input(span_of("block_table", p.block_table, B));
  m.input(span_of("cu_seq_lens", p.cu_seq_lens, B + 1));
  add_error_counts(m, ctx);
  m.output("out", p.out);
  m.check();
  a.sequences = true;
  a.block_table = static_cast<const int32_t*>(p.block_table.data);
  a.stride_block_table_seq = canonical_stride(p.block_table, 0);
  a.max_blocks_per_seq = p.block_table.shape[1];
  a.cu_seq_lens = static_cast<const int32_t*>(p.cu_seq_lens.data);
  a.num_seqs = B;
  a.num_rows = p.out.shape[0];
  a.error_counts = ctx.error_counts;
  *device = v.device();
  return a;
}

void validate_error_counts(const char* op, const int32_t* error_counts, Device device) {
  Validator v(op);
  MLAKV_ARG_CHECK(v, error_counts != nullptr, "error_counts", "expected an int32[",
                  kNumErrorCounters, "] buffer, got nullptr");
  v.scalar_ptr("error_counts", error_counts, "int32 counter array");
  v.device_of("device", device, [&] { return device_name(device); });
}

}  // namespace core
}  // namespace mlakv
