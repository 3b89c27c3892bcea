// mlakv CLI: the CUDA timer. Each measurement captures the op (rotated over its input sets) in a
// CUDA graph on a non-default stream and times graph replays with CUDA events.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "mlakv/error.h"
#include "timer.h"
#include "util.h"

#define MLAKV_CLI_CUDA_CHECK(call)                                                           \
  do {                                                                                       \
    const cudaError_t status_ = (call);                                                      \
    MLAKV_CHECK(status_ == cudaSuccess, #call, " failed: ", cudaGetErrorName(status_), " (", \
                cudaGetErrorString(status_), ")");                                           \
  } while (0)

namespace mlakv {
namespace cli {
namespace {

// The dependent-launch handshake every op does first (a no-op when launched without PDL).
__device__ __forceinline__ void dependent_launch_handshake() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// The launch floor's kernel: nothing but the handshake.
__global__ void empty_kernel() { dependent_launch_handshake(); }

// The copy reference's kernel: a plain streaming copy, kCopyVecs 16-byte vectors a thread (all
// loads issued before the first store), then the last bytes % 16 bytes by the first threads.
// cudaMemcpyAsync D2D is not always the fastest copy (on the H200 it moved 1 GiB at 2.7 TB/s,
// 300 MB at 4.2 TB/s), so the bench times both and takes the faster as the reference.
constexpr int kCopyThreads = 256;
constexpr int kCopyVecs = 4;

__global__ void __launch_bounds__(kCopyThreads)
    copy_kernel(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, size_t bytes) {
  dependent_launch_handshake();
  const size_t vecs = bytes / 16;
  const size_t first = static_cast<size_t>(blockIdx.x) * kCopyThreads * kCopyVecs + threadIdx.x;
  uint4 v[kCopyVecs];
#pragma unroll
  for (int i = 0; i < kCopyVecs; ++i) {
    const size_t k = first + static_cast<size_t>(i) * kCopyThreads;
    if (k < vecs) v[i] = __ldcs(reinterpret_cast<const uint4*>(src) + k);
  }
#pragma unroll
  for (int i = 0; i < kCopyVecs; ++i) {
    const size_t k = first + static_cast<size_t>(i) * kCopyThreads;
    if (k < vecs) __stcs(reinterpret_cast<uint4*>(dst) + k, v[i]);
  }
  const size_t tail = vecs * 16 + static_cast<size_t>(blockIdx.x) * kCopyThreads + threadIdx.x;
  if (tail < bytes) dst[tail] = src[tail];
}

// The unfused baseline's strided copy (rows of width bytes between pitched buffers, all three
// multiples of 16), as torch's copy_ of a strided view runs it: an elementwise kernel, kCopyVecs
// 16-byte vectors a thread. cudaMemcpy2DAsync moves rows this narrow (128 bytes: q_pe into
// q_out's rope part) at a fraction of the copy bandwidth, which would flatter the fused op.
__global__ void __launch_bounds__(kCopyThreads)
    copy_2d_kernel(uint8_t* __restrict__ dst, size_t dst_pitch, const uint8_t* __restrict__ src,
                   size_t src_pitch, size_t vecs_per_row, size_t vecs) {
  dependent_launch_handshake();
  const size_t first = static_cast<size_t>(blockIdx.x) * kCopyThreads * kCopyVecs + threadIdx.x;
  uint4 v[kCopyVecs];
  size_t row[kCopyVecs], col[kCopyVecs];  // vector k: row k / vecs_per_row, vector col in it
#pragma unroll
  for (int i = 0; i < kCopyVecs; ++i) {
    const size_t k = first + static_cast<size_t>(i) * kCopyThreads;
    row[i] = k / vecs_per_row;
    col[i] = k - row[i] * vecs_per_row;
    if (k < vecs) v[i] = __ldcs(reinterpret_cast<const uint4*>(src + row[i] * src_pitch) + col[i]);
  }
#pragma unroll
  for (int i = 0; i < kCopyVecs; ++i) {
    if (first + static_cast<size_t>(i) * kCopyThreads < vecs) {
      __stcs(reinterpret_cast<uint4*>(dst + row[i] * dst_pitch) + col[i], v[i]);
    }
  }
}

// Launches one of the bench's own kernels on `stream`, with programmatic dependent launch when
// `pdl` (as the ops are launched under --pdl; the library's launch_kernel in src/cuda/cuda_utils.h
// is internal to the library).
template <typename... Params, typename... Args>
void launch(void* stream, unsigned grid, unsigned block, bool pdl, void (*kernel)(Params...),
            Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  if (pdl) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  MLAKV_CLI_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
}

// Owns a set of events, a graph and its executable; frees them on every exit path.
struct GraphResources {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::vector<cudaEvent_t> events;
  ~GraphResources() {
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (graph != nullptr) cudaGraphDestroy(graph);
  }
  cudaEvent_t new_event() {
    cudaEvent_t e = nullptr;
    MLAKV_CLI_CUDA_CHECK(cudaEventCreate(&e));
    events.push_back(e);
    return e;
  }
};

class CudaTimer : public Timer {
 public:
  CudaTimer(int device_index, int iters, bool pdl) : device_index_(device_index), iters_(iters) {
    pdl_ = pdl;
    MLAKV_CLI_CUDA_CHECK(cudaSetDevice(device_index));
    MLAKV_CLI_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~CudaTimer() override { cudaStreamDestroy(stream_); }

  Device device() const override { return Device{DeviceType::kCUDA, device_index_}; }

  Timing time(const std::vector<Op>& ops) override {
    MLAKV_CHECK(!ops.empty(), "CudaTimer::time: ops: expected at least one op, got none");
    const int num_sets = static_cast<int>(ops.size());
    GraphResources res;

    // Eager pass over every input set: argument errors surface here, outside the capture, and
    // it gives a first estimate of one launch.
    for (const Op& op : ops) op(stream_);
    MLAKV_CLI_CUDA_CHECK(cudaStreamSynchronize(stream_));
    cudaEvent_t start = res.new_event();
    cudaEvent_t stop = res.new_event();
    MLAKV_CLI_CUDA_CHECK(cudaEventRecord(start, stream_));
    for (const Op& op : ops) op(stream_);
    MLAKV_CLI_CUDA_CHECK(cudaEventRecord(stop, stream_));
    MLAKV_CLI_CUDA_CHECK(cudaEventSynchronize(stop));
    float eager_ms = 0.0f;
    MLAKV_CLI_CUDA_CHECK(cudaEventElapsedTime(&eager_ms, start, stop));
    const double estimate_us = std::max(1.0, 1e3 * eager_ms / num_sets);

    // One graph = whole rotations over the input sets, long enough (>= kMinGraphUs) that the
    // graph launch itself is hidden; the per-launch time is the replay time / launches. Several
    // rotations only while they stay within kMaxLaunchesPerGraph; a rotation of more sets (up to
    // bench.cpp's 1024) is one graph of its own.
    int rotations = static_cast<int>(std::ceil(kMinGraphUs / (estimate_us * num_sets)));
    rotations = std::clamp(rotations, 1, std::max(1, kMaxLaunchesPerGraph / num_sets));
    const int launches = rotations * num_sets;

    MLAKV_CLI_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    try {
      for (int r = 0; r < rotations; ++r) {
        for (const Op& op : ops) op(stream_);
      }
    } catch (...) {
      cudaGraph_t partial = nullptr;
      cudaStreamEndCapture(stream_, &partial);
      if (partial != nullptr) cudaGraphDestroy(partial);
      throw;
    }
    MLAKV_CLI_CUDA_CHECK(cudaStreamEndCapture(stream_, &res.graph));
    MLAKV_CLI_CUDA_CHECK(cudaGraphInstantiate(&res.exec, res.graph, 0));
    MLAKV_CLI_CUDA_CHECK(cudaGraphUpload(res.exec, stream_));
    for (int i = 0; i < 3; ++i) MLAKV_CLI_CUDA_CHECK(cudaGraphLaunch(res.exec, stream_));
    MLAKV_CLI_CUDA_CHECK(cudaStreamSynchronize(stream_));

    // Re-estimate from a timed replay, then size the sample count to ~kTargetUs per measurement.
    MLAKV_CLI_CUDA_CHECK(cudaEventRecord(start, stream_));
    MLAKV_CLI_CUDA_CHECK(cudaGraphLaunch(res.exec, stream_));
    MLAKV_CLI_CUDA_CHECK(cudaEventRecord(stop, stream_));
    MLAKV_CLI_CUDA_CHECK(cudaEventSynchronize(stop));
    float replay_ms = 0.0f;
    MLAKV_CLI_CUDA_CHECK(cudaEventElapsedTime(&replay_ms, start, stop));
    int samples = iters_;
    if (samples <= 0) {
      samples =
          static_cast<int>(std::clamp(kTargetUs / std::max(1.0, 1e3 * replay_ms), 20.0, 200.0));
    }

    // Back-to-back replays, an event between each: the host runs ahead, so the GPU never idles
    // between them and each interval is one replay.
    std::vector<cudaEvent_t> marks;
    marks.reserve(static_cast<size_t>(samples) + 1);
    for (int i = 0; i <= samples; ++i) marks.push_back(res.new_event());
    MLAKV_CLI_CUDA_CHECK(cudaEventRecord(marks[0], stream_));
    for (int i = 0; i < samples; ++i) {
      MLAKV_CLI_CUDA_CHECK(cudaGraphLaunch(res.exec, stream_));
      MLAKV_CLI_CUDA_CHECK(cudaEventRecord(marks[i + 1], stream_));
    }
    MLAKV_CLI_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::vector<double> per_launch_us;
    per_launch_us.reserve(static_cast<size_t>(samples));
    for (int i = 0; i < samples; ++i) {
      float ms = 0.0f;
      MLAKV_CLI_CUDA_CHECK(cudaEventElapsedTime(&ms, marks[i], marks[i + 1]));
      per_launch_us.push_back(1e3 * ms / launches);
    }
    return summarize(per_launch_us, launches);
  }

  Op copy_op(void* dst, const void* src, size_t bytes) override {
    return [dst, src, bytes](void* stream) {
      MLAKV_CLI_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                           static_cast<cudaStream_t>(stream)));
    };
  }

  Op kernel_copy_op(void* dst, const void* src, size_t bytes) override {
    MLAKV_CHECK(
        reinterpret_cast<uintptr_t>(dst) % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0,
        "kernel_copy_op: expected 16-byte aligned buffers");
    const bool pdl = pdl_;
    return [dst, src, bytes, pdl](void* stream) {
      const size_t per_block = size_t{kCopyThreads} * kCopyVecs * 16;
      const size_t grid = std::max<size_t>(1, (bytes + per_block - 1) / per_block);
      MLAKV_CHECK(grid <= 0x7fffffff, "kernel_copy_op: ", bytes, " bytes exceed one launch");
      launch(stream, static_cast<unsigned>(grid), kCopyThreads, pdl, copy_kernel,
             static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), bytes);
    };
  }

  Op copy_2d_op(void* dst, size_t dst_pitch_bytes, const void* src, size_t src_pitch_bytes,
                size_t width_bytes, size_t rows) override {
    const bool vectors = (reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                          dst_pitch_bytes | src_pitch_bytes | width_bytes) %
                             16 ==
                         0;
    if (!vectors || width_bytes == 0) {
      return [=](void* stream) {
        MLAKV_CLI_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch_bytes, src, src_pitch_bytes,
                                               width_bytes, rows, cudaMemcpyDeviceToDevice,
                                               static_cast<cudaStream_t>(stream)));
      };
    }
    const size_t vecs_per_row = width_bytes / 16;
    const size_t vecs = vecs_per_row * rows;
    const size_t per_block = size_t{kCopyThreads} * kCopyVecs;
    const size_t grid = std::max<size_t>(1, (vecs + per_block - 1) / per_block);
    MLAKV_CHECK(grid <= 0x7fffffff, "copy_2d_op: ", rows, " rows exceed one launch");
    const bool pdl = pdl_;
    return [=](void* stream) {
      launch(stream, static_cast<unsigned>(grid), kCopyThreads, pdl, copy_2d_kernel,
             static_cast<uint8_t*>(dst), dst_pitch_bytes, static_cast<const uint8_t*>(src),
             src_pitch_bytes, vecs_per_row, vecs);
    };
  }

  Op empty_op() override {
    const bool pdl = pdl_;
    return [pdl](void* stream) { launch(stream, 1, 32, pdl, empty_kernel); };
  }

  // Several times the H200's 60 MB L2.
  size_t rotation_bytes() const override { return size_t{200} << 20; }

 private:
  static constexpr double kMinGraphUs = 200.0;
  static constexpr int kMaxLaunchesPerGraph = 400;  // for repeating a rotation (see time())
  static constexpr double kTargetUs = 200e3;
  int device_index_;
  int iters_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

std::unique_ptr<Timer> make_cuda_timer(int device_index, int iters, bool pdl) {
  return std::make_unique<CudaTimer>(device_index, iters, pdl);
}

}  // namespace cli
}  // namespace mlakv
