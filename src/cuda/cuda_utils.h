// mlakv CUDA backend internals (host side): the CUDA error check, the dispatch switches that turn
// runtime values into template arguments at the launchers, the alignment test of the 16-byte
// access path.
//
// Device selection: the dispatch holds a DeviceGuard (core/backend.h) around every launcher, so a
// launcher runs on the current device, the tensors'. Launch sizes depend on the work (one item
// per warp); the fused kernel's item size also on the device's multiprocessor count (read once
// per device and cached, runtime.cu), the one device property a launcher reads.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "common/numerics.h"
#include "mlakv/cache.h"
#include "mlakv/context.h"
#include "mlakv/error.h"
#include "mlakv/tensor.h"

// MLAKV_CUDA_CHECK(call): throws mlakv::Error naming the call and the CUDA error. The runtime's
// last error is cleared first (cleared_cuda_error), so that the caller's next cudaGetLastError
// (PyTorch checks one after each of its kernels) does not report a failure mlakv already threw.
#define MLAKV_CUDA_CHECK(call)                                                                 \
  do {                                                                                         \
    const cudaError_t mlakv_cuda_err_ = ::mlakv::cuda::cleared_cuda_error(call);               \
    if (mlakv_cuda_err_ != cudaSuccess) {                                                      \
      throw ::mlakv::Error(                                                                    \
          __FILE__, __LINE__,                                                                  \
          ::mlakv::detail::concat(#call, " failed: ", cudaGetErrorName(mlakv_cuda_err_), ": ", \
                                  cudaGetErrorString(mlakv_cuda_err_)));                       \
    }                                                                                          \
  } while (0)

// MLAKV_MODEL_DTYPE_SWITCH(dtype, TypeName, ...): TypeName = float / num::Half / num::Bf16.
#define MLAKV_MODEL_DTYPE_SWITCH(dtype, what, TypeName, ...)                            \
  [&] {                                                                                 \
    switch (dtype) {                                                                    \
      case ::mlakv::DType::kFloat32: {                                                  \
        using TypeName = float;                                                         \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      case ::mlakv::DType::kFloat16: {                                                  \
        using TypeName = ::mlakv::num::Half;                                            \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      case ::mlakv::DType::kBFloat16: {                                                 \
        using TypeName = ::mlakv::num::Bf16;                                            \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      default:                                                                          \
        MLAKV_FAIL(what, ": expected a model dtype (float32, float16, bfloat16), got ", \
                   ::mlakv::dtype_name(dtype));                                         \
    }                                                                                   \
  }()

namespace mlakv {
namespace cuda {

// `err`, with the runtime's last error reset when it is a failure: mlakv reports a failed call by
// throwing, and a sticky error (a faulted kernel) stays in the context whatever this does.
inline cudaError_t cleared_cuda_error(cudaError_t err) {
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err;
}

// How a launcher launches: the op's stream, and programmatic dependent launch (Context::pdl).
struct Launch {
  cudaStream_t stream = nullptr;
  bool pdl = false;
};

inline Launch launch_of(const Context& ctx) {
  Launch l;
  l.stream = static_cast<cudaStream_t>(ctx.stream);
  l.pdl = ctx.pdl;
  return l;
}

// Only for an error message, after a failed launch: "; the stream belongs to cuda:S, the op's
// tensors to cuda:D" when the stream is not one of the current device's (a launch on such a
// stream fails; the dispatch made the tensors' device current), else "".
std::string stream_device_note(cudaStream_t stream);

// kernel<<<grid, block, smem_bytes, launch.stream>>>(args...), with the programmatic stream
// serialization attribute when launch.pdl: the kernel may then start before the previous kernel in
// the stream has finished, and waits for it in pdl_wait() (device_common.cuh) before reading any
// input. A bad configuration throws here, synchronously.
template <typename... Params, typename... Args>
void launch_kernel(const char* name, void (*kernel)(Params...), unsigned grid, unsigned block,
                   size_t smem_bytes, const Launch& launch, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = launch.stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  if (launch.pdl) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  // A block may use 48 KB of shared memory, static and dynamic together, unless its kernel opts in
  // to more. The kernels that ask for dynamic shared memory (rmsnorm_quant's two) have under 1 KB
  // of static shared memory, so only a dynamic size within 1 KB of the limit needs the kernel's
  // attributes read (rmsnorm_quant's dynamic memory is a 16-bit weight row: 48 KB at N = 24576).
  // A kernel with more static shared memory that also asks for dynamic memory must raise
  // kStaticSmemBound. The opt-in is one value per kernel and device, shared by every host thread:
  // it is raised to the device's whole per-block opt-in (less the static part), the same value
  // for every caller, never to this call's size, which a thread launching a wider row between
  // another's raise and launch would find too small.
  constexpr size_t kDefaultSmemLimit = 48 * 1024;
  constexpr size_t kStaticSmemBound = 1024;
  if (smem_bytes + kStaticSmemBound > kDefaultSmemLimit) {
    cudaFuncAttributes attributes = {};
    MLAKV_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    if (attributes.sharedSizeBytes + smem_bytes > kDefaultSmemLimit &&
        static_cast<size_t>(attributes.maxDynamicSharedSizeBytes) < smem_bytes) {
      int device = 0;
      int optin = 0;
      MLAKV_CUDA_CHECK(cudaGetDevice(&device));
      MLAKV_CUDA_CHECK(
          cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
      MLAKV_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            optin - static_cast<int>(attributes.sharedSizeBytes)));
    }
  }
  const cudaError_t err =
      cleared_cuda_error(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
  if (err != cudaSuccess) {
    MLAKV_FAIL("launch of ", name, " failed: ", cudaGetErrorName(err), ": ",
               cudaGetErrorString(err), stream_device_note(launch.stream));
  }
}

// Multiprocessors of the current device, cached per device (launchers size grids by it).
int multiprocessor_count();

inline bool aligned_to(const void* ptr, int64_t alignment) {
  return reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(alignment) == 0;
}

// A pointer (nullptr counts as aligned: an absent tensor) and the byte sizes of its strides are
// all multiples of 16, so every 16-byte chunk the kernels access is 16-byte aligned.
class VecCheck {
 public:
  VecCheck& ptr(const void* p) {
    ok_ = ok_ && aligned_to(p, 16);
    return *this;
  }
  VecCheck& stride(int64_t stride_elems, int64_t elem_bytes) {
    ok_ = ok_ && (stride_elems * elem_bytes) % 16 == 0;
    return *this;
  }
  VecCheck& stride_bytes(int64_t bytes) {
    ok_ = ok_ && bytes % 16 == 0;
    return *this;
  }
  VecCheck& require(bool cond) {
    ok_ = ok_ && cond;
    return *this;
  }
  bool ok() const { return ok_; }

 private:
  bool ok_ = true;
};

}  // namespace cuda
}  // namespace mlakv
