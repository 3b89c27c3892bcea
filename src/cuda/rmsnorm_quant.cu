// mlakv CUDA backend: the launcher of rmsnorm_quant / mla_rmsnorm_quant / per_token_group_quant_fp8
// and the kernel's instantiations.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/rmsnorm_quant_args.h"
#include "cuda/cuda_utils.h"
#include "cuda/rmsnorm_quant.h"
#include "cuda/rmsnorm_quant_kernel.cuh"
#include "mlakv/error.h"

namespace mlakv {
namespace cuda {

void rmsnorm_quant(const core::RmsNormQuantArgs& args, const Context& ctx, int device_index) {
  RmsNormQuantKernelParams params;
  params.tasks[0] = args.tasks[0];
  if (args.num_tasks > 1) params.tasks[1] = args.tasks[1];
  params.num_rows_first = args.tasks[0].num_tokens;
  const int64_t num_blocks =
      args.tasks[0].num_tokens + (args.num_tasks > 1 ? args.tasks[1].num_tokens : 0);
  if (num_blocks == 0) return;

  // Threads: the widest row in at most kRmsqMaxChunksPerThread chunks a thread, at least two
  // warps (N = 512: 64 threads, one chunk each; N = 1536: 64 x 3; N = 7168: 224 x 4).
  int64_t max_chunks = 0;
  int64_t max_norm_hidden = 0;
  for (int i = 0; i < args.num_tasks; ++i) {
    const core::RmsNormQuantTask& task = args.tasks[i];
    if (task.num_tokens == 0) continue;
    max_chunks = std::max(max_chunks, task.hidden / kChunkElems);
    if (task.weight != nullptr) {
      max_norm_hidden = std::max(max_norm_hidden, task.hidden);
    }
  }
  int64_t threads = (max_chunks + kRmsqMaxChunksPerThread - 1) / kRmsqMaxChunksPerThread;
  threads = (threads + kWarpSize - 1) / kWarpSize * kWarpSize;
  threads = std::max<int64_t>(threads, 2 * kWarpSize);
  MLAKV_CHECK(threads <= kRmsqMaxThreads, "cuda::rmsnorm_quant: hidden: a row of ",
              max_chunks * kChunkElems, " elements needs more than ", kRmsqMaxThreads,
              " threads x ", kRmsqMaxChunksPerThread, " chunks");
  MLAKV_CHECK(num_blocks <= 0x7fffffff,
              "cuda::rmsnorm_quant: num_tokens: expected at most 2^31 - 1 rows in all, got ",
              num_blocks);

  DeviceGuard guard(device_index);
  const Launch launch = launch_of(ctx);
  MLAKV_MODEL_DTYPE_SWITCH(args.model_dtype, "cuda::rmsnorm_quant: model_dtype", T, [&] {
    launch_rmsnorm_quant_kernel<T>(params, num_blocks, static_cast<int>(threads), max_norm_hidden,
                                   launch);
  });
}

template void launch_rmsnorm_quant_kernel<num::Bf16>(const RmsNormQuantKernelParams&, int64_t, int,
                                                     int64_t, const Launch&);
template void launch_rmsnorm_quant_kernel<num::Half>(const RmsNormQuantKernelParams&, int64_t, int,
                                                     int64_t, const Launch&);
template void launch_rmsnorm_quant_kernel<float>(const RmsNormQuantKernelParams&, int64_t, int,
                                                 int64_t, const Launch&);

}  // namespace cuda
}  // namespace mlakv
