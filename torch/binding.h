// mlakv torch binding: at::Tensor -> mlakv views, the per-device op environment, error translation.
//
// Shared by every torch/*.cpp. An op entry is a template over its environment (CpuEnv, CudaEnv):
// the environment holds the device guard and fills the mlakv::Context (stream, threads, error
// counters, PDL), so one function body serves both dispatch keys.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

#include "mlakv/mlakv.h"

#ifdef MLAKV_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace mlakv {
namespace torch_binding {

using OptTensor = std::optional<at::Tensor>;

// The mlakv dtype of a torch dtype; `name` is the argument named in the error.
DType to_dtype(const char* name, at::ScalarType type);
Device to_device(const char* name, const at::Device& device);

// A view of `t` (1 to 4 dims); strides in elements. An absent optional gives an absent view.
TensorView to_view(const char* name, const at::Tensor& t);
TensorView to_view(const char* name, const OptTensor& t);
// `t` with a leading [T, 1, N] squeezed to [T, N] (vLLM passes k_pe as [T, 1, R]).
TensorView to_view_squeeze_heads(const char* name, const at::Tensor& t);

// An fp32 scalar in device memory (scale tensors): nullptr when absent.
const float* to_scale(const char* name, const OptTensor& t, const at::Device& device);
// A schema's float argument (a double) as the float the core takes, rounded to nearest even in
// any floating-point environment of the calling thread (a directed rounding mode or
// flush-to-zero would change eps or a scale floor otherwise; docs/decisions.md).
float to_float(double value);

// The cache format: an mlakv name ("bf16", "fp8_e4m3", "fp8_ds_mla", ...), "fp8" for fp8_e4m3,
// or "auto" for the format of a typed cache tensor.
CacheFormat to_cache_format(c10::string_view name, const at::Tensor& kv_cache);

// A KVCacheView of kv_cache [num_blocks, block_size, entry] (uint8 bytes for every format, or the
// format's own element type for the raw and per-tensor fp8 formats; byte strides), or of the split
// pair kv_cache [.., L] + kv_cache_rope [.., R]. L = kv_lora_rank; R = rope_dim, or derived from
// the entry width when rope_dim < 0. `widths_from` says where L and R came from, for the messages
// of a cache that does not fit them ("kv_lora_rank", "the widths of kv_c and k_pe").
KVCacheView to_cache_view(const at::Tensor& kv_cache, c10::string_view cache_format,
                          const OptTensor& kv_cache_scale, const OptTensor& kv_cache_rope,
                          int64_t kv_lora_rank, int64_t rope_dim, const char* widths_from,
                          bool ds_mla_pow2_scale);

// L + R of a cache (what the gather ops return per row).
int64_t cache_entry_width(const KVCacheView& cache);

// The optional int32 [>= kNumErrorCounters] error counters on `device`.
int32_t* to_error_counts(const OptTensor& error_counts, const at::Device& device);

// The process-wide programmatic dependent launch switch (torch.ops.mlakv.set_pdl, env MLAKV_PDL=1
// at load; pdl.cpp): every CUDA op copies it into Context::pdl when it launches.
bool pdl_enabled();

// {core name, torch name}: an argument the core's messages name by its C++ parameter path
// ("quant.values", "kv.output") and the torch op by its schema name ("out", "kv_c_out").
using Renames = std::initializer_list<std::pair<const char*, const char*>>;

// `message` with every core name that stands as a whole name (not part of a longer name such as
// "q.quant.values" or "output_x") replaced by its torch name: `renames`, then the names every op
// shares ("kv_cache's scale" is kv_cache_scale, "ctx.error_counts" is error_counts, ...).
std::string torch_names(std::string message, Renames renames);

// Runs `fn` and turns an mlakv::Error into a c10::Error (a Python RuntimeError) carrying the core's
// message, prefixed "mlakv: " as the binding's own messages are (without the core's file:line),
// with the arguments named as the torch op names them (`renames`, then torch_names' shared ones).
template <typename Fn>
decltype(auto) translate_errors(Renames renames, Fn&& fn) {
  try {
    return std::forward<Fn>(fn)();
  } catch (const Error& e) {
    TORCH_CHECK(false, "mlakv: ", torch_names(e.message(), renames));
  }
}

// translate_errors for an op whose core names are its torch names.
template <typename Fn>
decltype(auto) translate_errors(Fn&& fn) {
  return translate_errors({}, std::forward<Fn>(fn));
}

// The dispatcher picks an op's kernel from the devices of all its tensors; the environment takes
// its device from one of them, `name` (device_tensor), which must then be on the kernel's device
// type (the core checks every other tensor against it).
inline at::Device kernel_device(const char* name, const at::Tensor& device_tensor,
                                at::DeviceType type) {
  TORCH_CHECK(device_tensor.device().type() == type, "mlakv: ", name, ": expected a tensor on ",
              c10::DeviceTypeName(type, /*lower_case=*/true),
              " (where the op's other tensors are), got one on ", device_tensor.device());
  return device_tensor.device();
}

// CPU ops: torch's intra-op thread count.
struct CpuEnv {
  CpuEnv(const char* name, const at::Tensor& device_tensor, const OptTensor& error_counts) {
    kernel_device(name, device_tensor, at::kCPU);
    ctx.num_threads = at::get_num_threads();
    ctx.error_counts = to_error_counts(error_counts, device_tensor.device());
  }
  Context ctx;
};

#ifdef MLAKV_TORCH_CUDA
// CUDA ops: the tensor's device is made current and the op runs on torch's current stream of
// that device, so it orders with surrounding torch work and is captured by CUDA graphs. Its kernels
// launch with programmatic dependent launch while the process-wide switch is on and the device
// has it (sm_90+; the core's launch_kernel passes the attribute without looking at the device).
struct CudaEnv {
  CudaEnv(const char* name, const at::Tensor& device_tensor, const OptTensor& error_counts)
      : guard(kernel_device(name, device_tensor, at::kCUDA)) {
    const c10::DeviceIndex index = device_tensor.device().index();
    ctx.stream = at::cuda::getCurrentCUDAStream(index).stream();
    ctx.error_counts = to_error_counts(error_counts, device_tensor.device());
    // getDeviceProperties is torch's per-device cache: no CUDA call after the first.
    ctx.pdl = pdl_enabled() && at::cuda::getDeviceProperties(index)->major >= 9;
  }
  c10::cuda::CUDAGuard guard;
  Context ctx;
};
#endif

}  // namespace torch_binding
}  // namespace mlakv
