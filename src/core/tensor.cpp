// mlakv: dtypes, devices and TensorView helpers.
#include "mlakv/tensor.h"

#include <cstdint>
#include <sstream>
#include <string>

#include "mlakv/error.h"

namespace mlakv {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
    case DType::kUInt8:
      return 1;
    case DType::kInt64:
      return 8;
  }
  MLAKV_FAIL("dtype_size: unknown dtype value ", static_cast<int>(dtype));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat8E4M3:
      return "float8_e4m3fn";
    case DType::kFloat8E5M2:
      return "float8_e5m2";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kUInt8:
      return "uint8";
  }
  return "unknown_dtype";
}

bool is_float8(DType dtype) { return dtype == DType::kFloat8E4M3 || dtype == DType::kFloat8E5M2; }

bool is_model_dtype(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

std::string device_name(Device device) {
  switch (device.type) {
    case DeviceType::kCPU:
      return "cpu";
    case DeviceType::kCUDA:
      return "cuda:" + std::to_string(device.index);
  }
  return "unknown_device";
}

int64_t TensorView::numel() const {
  if (ndim <= 0) return 0;
  for (int d = 0; d < ndim && d < kMaxDims; ++d) {
    if (shape[d] <= 0) return 0;
  }
  int64_t n = 1;
  for (int d = 0; d < ndim && d < kMaxDims; ++d) {
    if (__builtin_mul_overflow(n, shape[d], &n)) return INT64_MAX;
  }
  return n;
}

// Size-1 dimensions do not constrain their stride (as in PyTorch). A view of more than kMaxDims
// dims is not one, and one whose inner sizes' product passes int64 cannot have the strides.
bool TensorView::is_contiguous() const {
  if (ndim > kMaxDims) return false;
  int64_t expected = 1;
  bool past_int64 = false;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && (past_int64 || stride[d] != expected)) return false;
    past_int64 = past_int64 || __builtin_mul_overflow(expected, shape[d], &expected);
  }
  return true;
}

std::string TensorView::describe() const {
  if (!present()) return "absent (ndim 0)";
  std::ostringstream os;
  if (ndim > kMaxDims) os << "ndim " << ndim << " (at most " << kMaxDims << ", first dims) ";
  os << dtype_name(dtype) << "[";
  for (int d = 0; d < ndim && d < kMaxDims; ++d) os << (d ? ", " : "") << shape[d];
  os << "] strides [";
  for (int d = 0; d < ndim && d < kMaxDims; ++d) os << (d ? ", " : "") << stride[d];
  os << "] on " << device_name(device);
  return os.str();
}

namespace {

// A view of `shape` without strides (the callers set them).
TensorView shaped_view(const char* fn, void* data, DType dtype,
                       std::initializer_list<int64_t> shape, Device device) {
  MLAKV_CHECK(shape.size() >= 1 && shape.size() <= static_cast<size_t>(kMaxDims), fn,
              ": shape: expected 1 to ", kMaxDims, " dims, got ", shape.size());
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.ndim = static_cast<int32_t>(shape.size());
  v.device = device;
  int d = 0;
  for (int64_t s : shape) {
    MLAKV_CHECK(s >= 0, fn, ": shape: expected sizes >= 0, got ", s, " in dim ", d);
    v.shape[d++] = s;
  }
  return v;
}

}  // namespace

TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device) {
  TensorView v = shaped_view("make_view", data, dtype, shape, device);
  // Each stride is the product of the sizes after its dim; the product of all sizes is not needed.
  v.stride[v.ndim - 1] = 1;
  for (int d = v.ndim - 1; d > 0; --d) {
    if (__builtin_mul_overflow(v.stride[d], v.shape[d], &v.stride[d - 1])) {
      std::ostringstream sizes;
      for (int i = 0; i < v.ndim; ++i) sizes << (i ? ", " : "") << v.shape[i];
      MLAKV_FAIL("make_view: shape: expected the sizes after dim 0 to multiply within int64, got [",
                 sizes.str(), "]");
    }
  }
  return v;
}

TensorView make_view(const void* data, DType dtype, std::initializer_list<int64_t> shape,
                     Device device) {
  // Views do not carry constness; the ops' contracts say which tensors they never write.
  return make_view(const_cast<void*>(data), dtype, shape, device);
}

TensorView make_strided_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                             std::initializer_list<int64_t> strides, Device device) {
  MLAKV_CHECK(shape.size() == strides.size(), "make_strided_view: strides: expected ", shape.size(),
              " strides (one per dim of shape), got ", strides.size());
  TensorView v = shaped_view("make_strided_view", data, dtype, shape, device);
  int d = 0;
  for (int64_t s : strides) v.stride[d++] = s;
  return v;
}

}  // namespace mlakv
