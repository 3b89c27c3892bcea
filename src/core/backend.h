// mlakv internal: the entry points each backend implements, and the dispatch to them. Arguments
// are already validated (src/core/validate.cpp, src/core/rmsnorm_quant.cpp); a backend only runs
// them.
#pragma once

#include <cstddef>
#include <string>

#include "core/args.h"
#include "core/rmsnorm_quant_args.h"
#include "mlakv/context.h"
#include "mlakv/error.h"

// The ops of every backend, one list: X(entry point, its resolved arguments in namespace core).
#define MLAKV_BACKEND_OPS(X)                     \
  X(mla_rope_cache, MlaRopeCacheArgs)            \
  X(rotary_embedding, RotaryEmbeddingArgs)       \
  X(concat_and_cache_mla, ConcatAndCacheMlaArgs) \
  X(decode_q_concat, DecodeQConcatArgs)          \
  X(rms_norm, RmsNormArgs)                       \
  X(gather_cache, GatherCacheArgs)               \
  X(rmsnorm_quant, RmsNormQuantArgs)
#define MLAKV_DECLARE_BACKEND_OP(fn, Args) void fn(const core::Args& args, const Context& ctx);

namespace mlakv {

namespace cpu {
MLAKV_BACKEND_OPS(MLAKV_DECLARE_BACKEND_OP)
// The width of the CPU backend's row kernels' vectors (cpu_common.h kVecBytes: 16, 32 or 64), as
// the backend's sources were compiled (-march=MLAKV_CPU_ARCH): build_info reports it.
int vector_bytes();
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

MLAKV_BACKEND_OPS(MLAKV_DECLARE_BACKEND_OP)
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
#undef MLAKV_DECLARE_BACKEND_OP

// Runs backend op `fn` for public op `op` (its name, for messages) on `device` (validated): the
// CPU backend, or the CUDA backend with `device` current for the call (cuda::DeviceGuard).
#ifdef MLAKV_WITH_CUDA
#define MLAKV_DISPATCH(fn, op, device, args, ctx)             \
  do {                                                        \
    if ((device).type == ::mlakv::DeviceType::kCPU) {         \
      ::mlakv::cpu::fn((args), (ctx));                        \
    } else {                                                  \
      const ::mlakv::cuda::DeviceGuard guard((device).index); \
      ::mlakv::cuda::fn((args), (ctx));                       \
    }                                                         \
  } while (0)
#else
// Validation already rejects CUDA tensors in a CPU-only build; this is the second line of defence.
#define MLAKV_DISPATCH(fn, op, device, args, ctx)                       \
  do {                                                                  \
    MLAKV_CHECK((device).type == ::mlakv::DeviceType::kCPU, (op),       \
                ": device: ", ::mlakv::device_name(device),             \
                " given but mlakv was built without the CUDA backend"); \
    ::mlakv::cpu::fn((args), (ctx));                                    \
  } while (0)
#endif

}  // namespace mlakv
