// mlakv torch binding: conversions from at::Tensor to the core's views (see binding.h).
#include "binding.h"

#include <cctype>
#include <string>

#include "common/float_env.h"

namespace mlakv {
namespace torch_binding {

DType to_dtype(const char* name, at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kFloat8_e4m3fn:
      return DType::kFloat8E4M3;
    case at::kFloat8_e5m2:
      return DType::kFloat8E5M2;
    case at::kInt:
      return DType::kInt32;
    case at::kLong:
      return DType::kInt64;
    case at::kByte:
      return DType::kUInt8;
    default:
      // No op takes this dtype; each argument's own list comes from the core, for the dtypes
      // some op takes.
      TORCH_CHECK(false, "mlakv: ", name,
                  ": expected a dtype of mlakv's ops (float32, float16, bfloat16, float8_e4m3fn, "
                  "float8_e5m2, int32, int64 or uint8; each argument takes some of them), got ",
                  type);
  }
}

Device to_device(const char* name, const at::Device& device) {
  if (device.is_cpu()) return Device{DeviceType::kCPU, 0};
  TORCH_CHECK(device.is_cuda(), "mlakv: ", name, ": expected a cpu or cuda tensor, got one on ",
              device);
  return Device{DeviceType::kCUDA, device.has_index() ? device.index() : 0};
}

TensorView to_view(const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), "mlakv: ", name, ": expected a tensor, got an undefined one");
  TORCH_CHECK(t.dim() >= 1 && t.dim() <= kMaxDims, "mlakv: ", name, ": expected 1 to ", kMaxDims,
              " dims, got ", t.dim(), " (shape ", t.sizes(), ")");
  TensorView v;
  v.data = t.data_ptr();
  v.dtype = to_dtype(name, t.scalar_type());
  v.ndim = static_cast<int32_t>(t.dim());
  v.device = to_device(name, t.device());
  for (int64_t d = 0; d < t.dim(); ++d) {
    v.shape[d] = t.size(d);
    v.stride[d] = t.stride(d);
  }
  return v;
}

TensorView to_view(const char* name, const OptTensor& t) {
  if (!t.has_value() || !t->defined()) return TensorView{};
  return to_view(name, *t);
}

TensorView to_view_squeeze_heads(const char* name, const at::Tensor& t) {
  if (t.dim() == 3 && t.size(1) == 1) return to_view(name, t.select(1, 0));
  return to_view(name, t);
}

float to_float(double value) {
  const DefaultFloatEnv env;
  // The volatile accesses keep the conversion between the environment's set and its restore.
  volatile double in = value;
  volatile float out = static_cast<float>(in);
  return out;
}

const float* to_scale(const char* name, const OptTensor& t, const at::Device& device) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat, "mlakv: ", name,
              ": expected a float32 scale tensor, got ", t->scalar_type());
  TORCH_CHECK(t->numel() >= 1, "mlakv: ", name, ": expected at least one element, got shape ",
              t->sizes());
  TORCH_CHECK(t->device() == device, "mlakv: ", name, ": expected a tensor on ", device,
              " (the op's device), got one on ", t->device());
  return t->data_ptr<float>();
}

CacheFormat to_cache_format(c10::string_view name, const at::Tensor& kv_cache) {
  const std::string format(name.data(), name.size());
  if (format == "fp8") return CacheFormat::kFloat8E4M3;
  if (format != "auto") {
    try {
      return parse_cache_format(format.c_str());
    } catch (const Error& e) {
      // The core's message ("parse_cache_format: name: expected one of <its names>, got ...")
      // names its own parameter: name the op's argument, with the two names only it takes.
      std::string text = e.message();
      text.erase(0, text.find("expected"));
      text.insert(text.find(", got "), ", fp8 or auto");
      TORCH_CHECK(false, "mlakv: cache_format: ", text);
    }
  }
  switch (kv_cache.scalar_type()) {
    case at::kBFloat16:
      return CacheFormat::kBFloat16;
    case at::kHalf:
      return CacheFormat::kFloat16;
    case at::kFloat:
      return CacheFormat::kFloat32;
    case at::kFloat8_e4m3fn:
      return CacheFormat::kFloat8E4M3;
    case at::kFloat8_e5m2:
      return CacheFormat::kFloat8E5M2;
    default:
      TORCH_CHECK(false,
                  "mlakv: cache_format: \"auto\" needs a typed cache (bfloat16, float16, "
                  "float32, float8_e4m3fn, float8_e5m2); a ",
                  kv_cache.scalar_type(),
                  " cache needs an explicit format (bf16, fp16, fp32, fp8_e4m3, fp8_e5m2, "
                  "fp8_ds_mla)");
  }
}

namespace {

// The cache tensor's element type must be bytes, or the format's own element type.
void check_cache_dtype(const char* name, const at::Tensor& t, CacheFormat format, DType elem) {
  TORCH_CHECK(t.dim() == 3, "mlakv: ", name,
              ": expected [num_blocks, block_size, entry] (3 dims), got shape ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 || t.size(2) <= 1, "mlakv: ", name,
              ": expected a contiguous entry (innermost stride 1), got strides ", t.strides());
  TORCH_CHECK(t.stride(0) >= 0 && t.stride(1) >= 0, "mlakv: ", name,
              ": expected non-negative strides, got ", t.strides());
  if (t.scalar_type() == at::kByte) return;
  TORCH_CHECK(format != CacheFormat::kFloat8DsMla, "mlakv: ", name,
              ": an fp8_ds_mla cache is a uint8 byte tensor, got ", t.scalar_type());
  TORCH_CHECK(to_dtype(name, t.scalar_type()) == elem, "mlakv: ", name, ": a ",
              cache_format_name(format), " cache is a uint8 or ", dtype_name(elem), " tensor, got ",
              t.scalar_type());
}

}  // namespace

KVCacheView to_cache_view(const at::Tensor& kv_cache, c10::string_view cache_format,
                          const OptTensor& kv_cache_scale, const OptTensor& kv_cache_rope,
                          int64_t kv_lora_rank, int64_t rope_dim, const char* widths_from,
                          bool ds_mla_pow2_scale) {
  TORCH_CHECK(kv_cache.defined(), "mlakv: kv_cache: expected a tensor, got an undefined one");
  const CacheFormat format = to_cache_format(cache_format, kv_cache);
  const DType latent = cache_latent_dtype(format);
  const int64_t latent_bytes = static_cast<int64_t>(dtype_size(latent));
  check_cache_dtype("kv_cache", kv_cache, format, latent);
  const int64_t elem = kv_cache.element_size();

  KVCacheView v;
  v.format = format;
  v.device = to_device("kv_cache", kv_cache.device());
  v.num_blocks = kv_cache.size(0);
  v.block_size = kv_cache.size(1);
  v.data = kv_cache.data_ptr();
  v.stride_block_bytes = kv_cache.stride(0) * elem;
  v.stride_token_bytes = kv_cache.stride(1) * elem;
  v.ds_mla_pow2_scale = ds_mla_pow2_scale;
  v.scale = to_scale("kv_cache_scale", kv_cache_scale, kv_cache.device());

  const int64_t entry_bytes = kv_cache.size(2) * elem;
  int64_t L = kv_lora_rank;
  int64_t R = rope_dim;
  if (kv_cache_rope.has_value() && kv_cache_rope->defined()) {
    const at::Tensor& rope = *kv_cache_rope;
    TORCH_CHECK(format != CacheFormat::kFloat8DsMla,
                "mlakv: kv_cache_rope: fp8_ds_mla has only the combined layout");
    check_cache_dtype("kv_cache_rope", rope, format, latent);
    TORCH_CHECK(rope.size(0) == v.num_blocks && rope.size(1) == v.block_size,
                "mlakv: kv_cache_rope: expected [", v.num_blocks, ", ", v.block_size,
                ", R] like kv_cache, got shape ", rope.sizes());
    TORCH_CHECK(rope.device() == kv_cache.device(), "mlakv: kv_cache_rope: expected a tensor on ",
                kv_cache.device(), ", got one on ", rope.device());
    const int64_t rope_elem = rope.element_size();
    // Byte tensors must hold whole values of the format's element type.
    TORCH_CHECK(entry_bytes % latent_bytes == 0 && rope.size(2) * rope_elem % latent_bytes == 0,
                "mlakv: kv_cache, kv_cache_rope: a ", cache_format_name(format),
                " cache holds whole values of ", latent_bytes, " bytes, got entries of ",
                entry_bytes, " and ", rope.size(2) * rope_elem, " bytes");
    const int64_t rope_width = rope.size(2) * rope_elem / latent_bytes;
    const int64_t latent_width = entry_bytes / latent_bytes;
    TORCH_CHECK(L < 0 || L == latent_width, "mlakv: kv_cache: expected a latent part of ", L,
                " values (L, from ", widths_from, "), got ", latent_width);
    TORCH_CHECK(R < 0 || R == rope_width, "mlakv: kv_cache_rope: expected ", R,
                " values per token (R, from ", widths_from, "), got ", rope_width);
    L = latent_width;
    R = rope_width;
    v.rope_data = rope.data_ptr();
    v.stride_rope_block_bytes = rope.stride(0) * rope_elem;
    v.stride_rope_token_bytes = rope.stride(1) * rope_elem;
  } else {
    TORCH_CHECK(L >= 0, "mlakv: kv_lora_rank: expected >= 0, got ", L);
    const bool r_of_cache = R < 0;  // R taken from the cache (its format or its entry width)
    if (r_of_cache) {
      R = format == CacheFormat::kFloat8DsMla ? kDsMlaRopeDim : entry_bytes / latent_bytes - L;
      TORCH_CHECK(R >= 0, "mlakv: kv_lora_rank: expected at most ", entry_bytes / latent_bytes,
                  " (the values of a kv_cache entry), got ", L);
    }
    // (cache_entry_bytes would refuse these too, but name itself rather than the argument.)
    TORCH_CHECK(format != CacheFormat::kFloat8DsMla || (L == kDsMlaLatentDim && R == kDsMlaRopeDim),
                "mlakv: kv_cache: fp8_ds_mla needs L = ", kDsMlaLatentDim,
                " and R = ", kDsMlaRopeDim, ", got L = ", L, ", R = ", R, " (",
                r_of_cache ? "L from " : "from ", widths_from, ")");
    const int64_t expected = cache_entry_bytes(format, L, R);
    TORCH_CHECK(entry_bytes == expected, "mlakv: kv_cache: a ", cache_format_name(format),
                " entry with L = ", L, ", R = ", R, " (", r_of_cache ? "L from " : "from ",
                widths_from, r_of_cache ? ", R from the cache" : "", ") is ", expected,
                " bytes, got ", entry_bytes, " bytes per entry (shape ", kv_cache.sizes(), ", ",
                kv_cache.scalar_type(), ")");
  }
  v.kv_lora_rank = L;
  v.rope_dim = R;
  return v;
}

int64_t cache_entry_width(const KVCacheView& cache) { return cache.kv_lora_rank + cache.rope_dim; }

namespace {

bool name_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// Replaces each whole-name occurrence of `from` in `s` by `to`. A name ends where the next
// character neither continues it nor starts a longer path ('.' then a name character).
void replace_name(std::string& s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at)) {
    const size_t end = at + from.size();
    const bool starts = at == 0 || !(name_char(s[at - 1]) || s[at - 1] == '.');
    const bool ends =
        end == s.size() ||
        !(name_char(s[end]) || (s[end] == '.' && end + 1 < s.size() && name_char(s[end + 1])));
    if (starts && ends) {
      s.replace(at, from.size(), to);
      at += to.size();
    } else {
      at = end;
    }
  }
}

}  // namespace

std::string torch_names(std::string message, Renames renames) {
  for (const auto& r : renames) replace_name(message, r.first, r.second);
  static constexpr std::pair<const char*, const char*> kShared[] = {
      {"kv_cache's scale", "kv_cache_scale"},
      {"kv_cache's rope_data", "kv_cache_rope"},
      {"ctx.error_counts", "error_counts"},
  };
  for (const auto& r : kShared) replace_name(message, r.first, r.second);
  return message;
}

int32_t* to_error_counts(const OptTensor& error_counts, const at::Device& device) {
  if (!error_counts.has_value() || !error_counts->defined()) return nullptr;
  const at::Tensor& t = *error_counts;
  TORCH_CHECK(t.scalar_type() == at::kInt, "mlakv: error_counts: expected int32, got ",
              t.scalar_type());
  TORCH_CHECK(t.numel() >= kNumErrorCounters && t.is_contiguous(),
              "mlakv: error_counts: expected a contiguous tensor of at least ", kNumErrorCounters,
              " elements, got shape ", t.sizes());
  TORCH_CHECK(t.device() == device, "mlakv: error_counts: expected a tensor on ", device,
              " (the op's device), got one on ", t.device());
  return t.data_ptr<int32_t>();
}

}  // namespace torch_binding
}  // namespace mlakv
