// mlakv internal: the entry points each backend implements. Arguments are already validated
// (src/core/validate.cpp); a backend only runs them.
#pragma once

#include <cstddef>
#include <string>

#include "core/args.h"
#include "mlakv/context.h"

namespace mlakv {

namespace cpu {
void mla_rope_cache(const core::MlaRopeCacheArgs& args, const Context& ctx);
void rotary_embedding(const core::RotaryEmbeddingArgs& args, const Context& ctx);
void concat_and_cache_mla(const core::ConcatAndCacheMlaArgs& args, const Context& ctx);
void decode_q_concat(const core::DecodeQConcatArgs& args, const Context& ctx);
void rms_norm(const core::RmsNormArgs& args, const Context& ctx);
void gather_cache(const core::GatherCacheArgs& args, const Context& ctx);
}  // namespace cpu

#ifdef MLAKV_WITH_CUDA
namespace cuda {
// Selects `device` for its lifetime, then restores the caller's current device. The dispatch
// (ops.cpp, rmsnorm_quant.cpp) holds one around every CUDA op, so each op runs on its tensors'
// device and on ctx.stream, which must belong to it; the memory and counter helpers below hold
// their own. A previous device without a context yet (a thread that never used cuda:0, which
// cudaGetDevice reports by default) is not restored: since CUDA 12 cudaSetDevice creates the
// context, hundreds of MiB on a GPU the caller never used (PyTorch's device guards skip it too).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

void mla_rope_cache(const core::MlaRopeCacheArgs& args, const Context& ctx);
void rotary_embedding(const core::RotaryEmbeddingArgs& args, const Context& ctx);
void concat_and_cache_mla(const core::ConcatAndCacheMlaArgs& args, const Context& ctx);
void decode_q_concat(const core::DecodeQConcatArgs& args, const Context& ctx);
void rms_norm(const core::RmsNormArgs& args, const Context& ctx);
void gather_cache(const core::GatherCacheArgs& args, const Context& ctx);
// Error counters and device facts (src/cuda/runtime.cu).
void reset_error_counts(int32_t* error_counts, int device_index, void* stream);
void read_error_counts(const int32_t* error_counts, int device_index, int32_t* host_out,
                       void* stream);
int device_count();
std::string device_description(int index);
// Memory helpers behind mlakv/memory.h.
void* device_alloc(int device_index, size_t bytes);
void device_free(int device_index, void* ptr);
void copy_host_to_device(int device_index, void* dst, const void* src, size_t bytes);
void copy_device_to_host(int device_index, void* dst, const void* src, size_t bytes);
void device_memset(int device_index, void* dst, int value, size_t bytes);
void device_synchronize(int device_index);
}  // namespace cuda
#endif

}  // namespace mlakv
