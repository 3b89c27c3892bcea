// mlakv CUDA backend: RMSNorm + FP8 per-token-group quantization (rmsnorm_quant,
// mla_rmsnorm_quant's two tasks in one grid, per_token_group_quant_fp8) -- kernel parameters and
// the launcher template (rmsnorm_quant_kernel.cuh; instantiated in rmsnorm_quant.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/rmsnorm_quant_args.h"

namespace mlakv {
namespace cuda {

// Threads per block: 32 to 1024, a multiple of 32; a block holds at most kRmsqMaxChunksPerThread
// chunks of 8 elements per thread, so N <= 1024 * 4 * 8 = 32768 (kMaxRmsNormQuantHidden).
constexpr int kRmsqMaxThreads = 1024;
constexpr int kRmsqMaxChunksPerThread = 4;

struct RmsNormQuantKernelParams {
  core::RmsNormQuantTask tasks[2];  // validated; tasks[1] unused unless the dual form
  int64_t num_rows_first = 0;       // blocks [0, num_rows_first) take tasks[0], the rest tasks[1]
};

// One block per row of either task; `threads` a multiple of 32 that covers the widest row in
// kRmsqMaxChunksPerThread chunks per thread; `smem_bytes` = 4 * N of the widest normalizing task.
template <typename T>
void launch_rmsnorm_quant_kernel(const RmsNormQuantKernelParams& params, int64_t num_blocks,
                                 int threads, size_t smem_bytes, const Launch& launch);

}  // namespace cuda
}  // namespace mlakv
