// mlakv CUDA backend: error counters, device facts and the memory helpers behind mlakv/memory.h.
//
// The memory helpers and device facts take a device index and select it for the call (restoring
// the caller's device afterwards); the error-counter calls are stream-ordered on the given stream.
#include <cuda.h>  // the driver API's types only: its functions are reached through the runtime
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "core/backend.h"
#include "cuda/cuda_utils.h"
#include "mlakv/context.h"

namespace mlakv {
namespace cuda {

namespace {

// A driver API function by name, reached through the runtime (no link against libcuda); nullptr
// when the driver lacks it.
void* driver_function(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cleared_cuda_error(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault,
                                                          &found)) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return fn;
}

// Whether `device`'s primary context exists (the driver's cuDevicePrimaryCtxGetState); true
// when it cannot be asked.
bool primary_context_active(int device) {
  using DeviceGet = CUresult (*)(CUdevice*, int);
  using GetState = CUresult (*)(CUdevice, unsigned int*, int*);
  static const auto device_get = reinterpret_cast<DeviceGet>(driver_function("cuDeviceGet"));
  static const auto get_state =
      reinterpret_cast<GetState>(driver_function("cuDevicePrimaryCtxGetState"));
  CUdevice dev = 0;
  unsigned int flags = 0;
  int active = 0;
  if (device_get == nullptr || get_state == nullptr || device_get(&dev, device) != CUDA_SUCCESS ||
      get_state(dev, &flags, &active) != CUDA_SUCCESS) {
    return true;
  }
  return active != 0;
}

}  // namespace

DeviceGuard::DeviceGuard(int device) {
  MLAKV_CUDA_CHECK(cudaGetDevice(&previous_));
  if (device == previous_) return;
  const cudaError_t err = cleared_cuda_error(cudaSetDevice(device));
  if (err != cudaSuccess) {
    MLAKV_FAIL("cannot select the tensors' device cuda:", device, ": ", cudaGetErrorName(err), ": ",
               cudaGetErrorString(err));
  }
  switched_ = true;
}

DeviceGuard::~DeviceGuard() {
  // A destructor must not throw: a failed restore is left to the caller's next CUDA call.
  if (switched_ && primary_context_active(previous_)) cudaSetDevice(previous_);
}

std::string stream_device_note(cudaStream_t stream) {
  int stream_device = -1;
  int current = -1;
  // No answer: the launch's own error stands alone.
  if (cleared_cuda_error(cudaStreamGetDevice(stream, &stream_device)) != cudaSuccess ||
      cleared_cuda_error(cudaGetDevice(&current)) != cudaSuccess) {
    return {};
  }
  if (stream_device == current) return {};
  return detail::concat("; the stream belongs to cuda:", stream_device,
                        ", the op's tensors to cuda:", current);
}

int multiprocessor_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> sm_counts[kMaxDevices];
  int device = 0;
  MLAKV_CUDA_CHECK(cudaGetDevice(&device));
  int sms = device < kMaxDevices ? sm_counts[device].load(std::memory_order_relaxed) : 0;
  if (sms == 0) {
    MLAKV_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    if (device < kMaxDevices) sm_counts[device].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

void reset_error_counts(int32_t* error_counts, int device_index, void* stream) {
  DeviceGuard guard(device_index);
  MLAKV_CUDA_CHECK(cudaMemsetAsync(error_counts, 0, sizeof(int32_t) * kNumErrorCounters,
                                   static_cast<cudaStream_t>(stream)));
}

void read_error_counts(const int32_t* error_counts, int device_index, int32_t* host_out,
                       void* stream) {
  DeviceGuard guard(device_index);
  auto s = static_cast<cudaStream_t>(stream);
  MLAKV_CUDA_CHECK(cudaMemcpyAsync(host_out, error_counts, sizeof(int32_t) * kNumErrorCounters,
                                   cudaMemcpyDeviceToHost, s));
  MLAKV_CUDA_CHECK(cudaStreamSynchronize(s));
}

int device_count() {
  int count = 0;
  const cudaError_t err = cleared_cuda_error(cudaGetDeviceCount(&count));
  // No device is an answer, not an error.
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) return 0;
  MLAKV_CUDA_CHECK(err);
  return count;
}

std::string device_description(int index) {
  cudaDeviceProp prop{};
  MLAKV_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  int driver = 0;
  int runtime = 0;
  MLAKV_CUDA_CHECK(cudaDriverGetVersion(&driver));
  MLAKV_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  return detail::concat("cuda:", index, " ", prop.name, ", sm_", prop.major, prop.minor, ", ",
                        prop.multiProcessorCount, " SMs, ", prop.totalGlobalMem / (1024 * 1024),
                        " MiB, L2 ", prop.l2CacheSize / 1024, " KiB, driver ", driver / 1000, ".",
                        (driver % 1000) / 10, ", runtime ", runtime / 1000, ".",
                        (runtime % 1000) / 10);
}

void* device_alloc(int device_index, size_t bytes) {
  DeviceGuard guard(device_index);
  void* ptr = nullptr;
  // cudaMalloc memory is at least 256-byte aligned.
  MLAKV_CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(bytes, 1)));
  return ptr;
}

void device_free(int device_index, void* ptr) {
  if (ptr == nullptr) return;
  DeviceGuard guard(device_index);
  MLAKV_CUDA_CHECK(cudaFree(ptr));
}

void copy_host_to_device(int device_index, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  DeviceGuard guard(device_index);
  MLAKV_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

void copy_device_to_host(int device_index, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  DeviceGuard guard(device_index);
  MLAKV_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

void device_memset(int device_index, void* dst, int value, size_t bytes) {
  if (bytes == 0) return;
  DeviceGuard guard(device_index);
  MLAKV_CUDA_CHECK(cudaMemset(dst, value, bytes));
}

void device_synchronize(int device_index) {
  DeviceGuard guard(device_index);
  MLAKV_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace cuda
}  // namespace mlakv
