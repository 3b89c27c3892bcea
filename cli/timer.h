// mlakv CLI: how `mlakv bench` times an operation on a backend.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mlakv/context.h"
#include "mlakv/tensor.h"

namespace mlakv {
namespace cli {

// One launch of an operation on the given stream (a cudaStream_t on CUDA, nullptr on the CPU).
using Op = std::function<void(void* stream)>;

struct Timing {
  double median_us = 0.0;
  double p10_us = 0.0;
  double p90_us = 0.0;
  int samples = 0;  // timed measurements behind the statistics
  int launches_per_sample = 1;
};

// Median and p10-p90 of per-launch times (us), with how many samples and launches per sample.
Timing summarize(const std::vector<double>& per_launch_us, int launches_per_sample = 1);

class Timer {
 public:
  virtual ~Timer() = default;
  virtual Device device() const = 0;
  // Time of ONE launch. `ops` holds the same operation over different input sets; the timer
  // rotates among them so that the inputs of consecutive launches are not in cache.
  virtual Timing time(const std::vector<Op>& ops) = 0;
  // An op that copies `bytes` from src to dst on the device (memcpy / cudaMemcpyAsync D2D).
  virtual Op copy_op(void* dst, const void* src, size_t bytes) = 0;
  // Another way to copy `bytes` on the device, timed beside copy_op (the bench's copy reference is
  // the faster of the two): a plain streaming copy kernel on CUDA (16-byte aligned buffers); an
  // empty Op where copy_op is the only way (the CPU).
  virtual Op kernel_copy_op(void* /*dst*/, const void* /*src*/, size_t /*bytes*/) { return {}; }
  // An op that copies `rows` rows of `width_bytes` between pitched buffers, as torch's strided
  // copy_ does (CUDA: an elementwise copy kernel, cudaMemcpy2DAsync where the rows are not
  // 16-byte vectors; the CPU: a memcpy a row over the OpenMP threads).
  virtual Op copy_2d_op(void* dst, size_t dst_pitch_bytes, const void* src, size_t src_pitch_bytes,
                        size_t width_bytes, size_t rows) = 0;
  // An op that does nothing on the device (an empty one-warp kernel on CUDA, an empty OpenMP
  // parallel region on the CPU): timed like the ops, the fixed cost of one launch. (Small CPU ops
  // run on the calling thread without a parallel region and can come in under it.)
  virtual Op empty_op() = 0;
  // Input bytes beyond which rotation stops helping (a few times the last-level cache).
  virtual size_t rotation_bytes() const = 0;
  // The Context of the timed ops on `stream`: programmatic dependent launch on when the timer was
  // made with it (the CUDA timer's --pdl), so that consecutive launches overlap as in an engine's
  // CUDA graph of a layer.
  Context context(void* stream) const {
    Context ctx;
    ctx.stream = stream;
    ctx.pdl = pdl_;
    return ctx;
  }
  bool pdl() const { return pdl_; }

 protected:
  bool pdl_ = false;
};

// `iters` timed samples per measurement; 0 picks a count that keeps each measurement ~0.1 s.
std::unique_ptr<Timer> make_cpu_timer(int iters);
#ifdef MLAKV_WITH_CUDA
// pdl: launch the ops (and the empty op) with programmatic dependent launch.
std::unique_ptr<Timer> make_cuda_timer(int device_index, int iters, bool pdl);
#endif

}  // namespace cli
}  // namespace mlakv
