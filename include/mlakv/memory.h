// mlakv: small memory helpers for tests, tools and engines without a framework allocator. Never
// used inside an op. CPU memory comes from aligned new; CUDA memory from cudaMalloc.
#pragma once

#include <cstddef>

#include "mlakv/tensor.h"

namespace mlakv {

// 256-byte aligned memory on `device`; throws mlakv::Error on failure or for CUDA without the CUDA
// backend.
void* device_alloc(Device device, size_t bytes);
void device_free(Device device, void* ptr);
// Synchronous copies between host memory and `device` (plain memcpy for the CPU).
void copy_host_to_device(Device device, void* dst, const void* src, size_t bytes);
void copy_device_to_host(Device device, void* dst, const void* src, size_t bytes);
void device_memset(Device device, void* dst, int value, size_t bytes);
void device_synchronize(Device device);

}  // namespace mlakv
