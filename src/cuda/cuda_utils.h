// mlakv CUDA backend internals (host side): the CUDA error check, the dispatch switches that turn
// runtime values into template arguments at the launchers, the alignment test of the 16-byte
// access path, and a device guard.
//
// Device selection: the core passes only a Context, so every launcher runs on the caller's current
// device, as PyTorch extensions do; the caller (the torch binding, an engine) makes the tensors'
// device current before calling an op. Launch sizes depend on the work (one item per warp); the
// fused kernel's item size also on the current device's multiprocessor count (read once per
// device and cached, mla_rope_cache.cu), the one device property a launcher reads.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/numerics.h"
#include "mlakv/cache.h"
#include "mlakv/error.h"
#include "mlakv/tensor.h"

// MLAKV_CUDA_CHECK(call): throws mlakv::Error naming the call and the CUDA error.
#define MLAKV_CUDA_CHECK(call)                                                                 \
  do {                                                                                         \
    const cudaError_t mlakv_cuda_err_ = (call);                                                \
    if (mlakv_cuda_err_ != cudaSuccess) {                                                      \
      throw ::mlakv::Error(                                                                    \
          __FILE__, __LINE__,                                                                  \
          ::mlakv::detail::concat(#call, " failed: ", cudaGetErrorName(mlakv_cuda_err_), ": ", \
                                  cudaGetErrorString(mlakv_cuda_err_)));                       \
    }                                                                                          \
  } while (0)

// After a <<<...>>> launch: a bad launch configuration shows up here, synchronously.
#define MLAKV_CUDA_CHECK_LAUNCH(kernel_name)                                                       \
  do {                                                                                             \
    const cudaError_t mlakv_cuda_err_ = cudaGetLastError();                                        \
    if (mlakv_cuda_err_ != cudaSuccess) {                                                          \
      throw ::mlakv::Error(__FILE__, __LINE__,                                                     \
                           ::mlakv::detail::concat("launch of ", kernel_name,                      \
                                                   " failed: ", cudaGetErrorName(mlakv_cuda_err_), \
                                                   ": ", cudaGetErrorString(mlakv_cuda_err_)));    \
    }                                                                                              \
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

// Selects `device` for the lifetime of the guard, then restores the previous device (host code:
// the runtime helpers and rmsnorm_quant, which take the tensors' device index).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    MLAKV_CUDA_CHECK(cudaGetDevice(&previous_));
    if (device != previous_) {
      MLAKV_CUDA_CHECK(cudaSetDevice(device));
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);  // a destructor must not throw
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace cuda
}  // namespace mlakv
