// mlakv: memory helpers for tests and tools (never used inside an op).
#include "mlakv/memory.h"

#include <cstring>
#include <new>

#include "core/backend.h"
#include "mlakv/error.h"

namespace mlakv {
namespace {

constexpr std::align_val_t kCpuAlignment{256};

#ifndef MLAKV_WITH_CUDA
[[noreturn]] void fail_no_cuda(const char* fn, Device device) {
  MLAKV_FAIL(fn, ": device: ", device_name(device),
             " given but mlakv was built without the CUDA backend");
}
#endif

}  // namespace

void* device_alloc(Device device, size_t bytes) {
  if (device.type == DeviceType::kCPU) {
    try {
      // A zero-byte request still returns a unique pointer that device_free accepts.
      return ::operator new(bytes == 0 ? 1 : bytes, kCpuAlignment);
    } catch (const std::bad_alloc&) {
      MLAKV_FAIL("device_alloc: bytes: could not allocate ", bytes, " bytes of CPU memory");
    }
  }
#ifdef MLAKV_WITH_CUDA
  return cuda::device_alloc(device.index, bytes);
#else
  fail_no_cuda("device_alloc", device);
#endif
}

void device_free(Device device, void* ptr) {
  if (ptr == nullptr) return;
  if (device.type == DeviceType::kCPU) {
    ::operator delete(ptr, kCpuAlignment);
    return;
  }
#ifdef MLAKV_WITH_CUDA
  cuda::device_free(device.index, ptr);
#else
  fail_no_cuda("device_free", device);
#endif
}

void copy_host_to_device(Device device, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  MLAKV_CHECK(dst != nullptr && src != nullptr,
              "copy_host_to_device: dst / src: expected non-null pointers for ", bytes, " bytes");
  if (device.type == DeviceType::kCPU) {
    std::memcpy(dst, src, bytes);
    return;
  }
#ifdef MLAKV_WITH_CUDA
  cuda::copy_host_to_device(device.index, dst, src, bytes);
#else
  fail_no_cuda("copy_host_to_device", device);
#endif
}

void copy_device_to_host(Device device, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  MLAKV_CHECK(dst != nullptr && src != nullptr,
              "copy_device_to_host: dst / src: expected non-null pointers for ", bytes, " bytes");
  if (device.type == DeviceType::kCPU) {
    std::memcpy(dst, src, bytes);
    return;
  }
#ifdef MLAKV_WITH_CUDA
  cuda::copy_device_to_host(device.index, dst, src, bytes);
#else
  fail_no_cuda("copy_device_to_host", device);
#endif
}

void device_memset(Device device, void* dst, int value, size_t bytes) {
  if (bytes == 0) return;
  MLAKV_CHECK(dst != nullptr, "device_memset: dst: expected a non-null pointer for ", bytes,
              " bytes");
  if (device.type == DeviceType::kCPU) {
    std::memset(dst, value, bytes);
    return;
  }
#ifdef MLAKV_WITH_CUDA
  cuda::device_memset(device.index, dst, value, bytes);
#else
  fail_no_cuda("device_memset", device);
#endif
}

void device_synchronize(Device device) {
  if (device.type == DeviceType::kCPU) return;
#ifdef MLAKV_WITH_CUDA
  cuda::device_synchronize(device.index);
#else
  fail_no_cuda("device_synchronize", device);
#endif
}

}  // namespace mlakv
