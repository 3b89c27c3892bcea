// mlakv: dtypes, devices and the non-owning tensor view every op takes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace mlakv {

enum class DType : int32_t {
  kFloat32 = 0,
  kFloat16,
  kBFloat16,
  kFloat8E4M3,  // OCP e4m3fn, max 448, no infinities
  kFloat8E5M2,  // OCP e5m2, max 57344
  kInt32,
  kInt64,
  kUInt8,
};

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);  // "float32", "bfloat16", "float8_e4m3fn", ...
bool is_float8(DType dtype);
// The dtypes a model computes in: float32, float16, bfloat16.
bool is_model_dtype(DType dtype);

enum class DeviceType : int32_t { kCPU = 0, kCUDA = 1 };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int32_t index = 0;  // CUDA ordinal; 0 for the CPU
};
inline bool operator==(Device a, Device b) {
  return a.type == b.type && (a.type == DeviceType::kCPU || a.index == b.index);
}
inline bool operator!=(Device a, Device b) { return !(a == b); }
std::string device_name(Device device);  // "cpu", "cuda:0"

constexpr int kMaxDims = 4;

// A non-owning view of a strided tensor. Strides are in elements (as in PyTorch), int64. A view
// with ndim == 0 is "absent": optional arguments are passed that way. Data may live on the CPU or
// on a CUDA device; the library never reads device data on the host.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int32_t ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int64_t stride[kMaxDims] = {0, 0, 0, 0};
  Device device = {};

  bool present() const { return ndim > 0; }
  int64_t size(int dim) const { return shape[dim]; }
  int64_t numel() const;         // the sizes' product: 0 when one is <= 0, INT64_MAX past int64
  bool is_contiguous() const;    // false for ndim > kMaxDims
  std::string describe() const;  // "bfloat16[16, 128, 576] strides [73728, 576, 1] on cuda:0"
};

// A contiguous view of `data` with the given shape.
TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                     Device device = {});
TensorView make_view(const void* data, DType dtype, std::initializer_list<int64_t> shape,
                     Device device = {});
// make_view(nullptr, ...): an empty tensor's view (the ops take null data where there is nothing).
inline TensorView make_view(std::nullptr_t, DType dtype, std::initializer_list<int64_t> shape,
                            Device device = {}) {
  return make_view(static_cast<void*>(nullptr), dtype, shape, device);
}
// A view with explicit strides (elements).
TensorView make_strided_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                             std::initializer_list<int64_t> strides, Device device = {});

}  // namespace mlakv
