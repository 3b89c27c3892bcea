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

// 16-bit model dtypes stage the weight row in shared memory while the row loads (cp.async:
// holding it in registers would spill under the 64-register cap of 1024-thread blocks); fp32 rows
// read it after the sum.
template <typename T>
constexpr bool kRmsqStagesWeight = sizeof(T) == 2;

// Dynamic shared memory of a block whose widest normalizing row has N elements: the row's fp32
// squares, then the staged weight.
template <typename T>
constexpr size_t rmsq_smem_bytes(int64_t N) {
  return static_cast<size_t>(N) * (sizeof(float) + (kRmsqStagesWeight<T> ? sizeof(T) : 0));
}

struct RmsNormQuantKernelParams {
  core::RmsNormQuantTask tasks[2];  // validated; tasks[1] unused unless the dual form
  int64_t num_rows_first = 0;       // blocks [0, num_rows_first) take tasks[0], the rest tasks[1]
};

// One block per row of either task; `threads` a multiple of 32 that covers the widest row in
// kRmsqMaxChunksPerThread chunks per thread; `max_norm_hidden` = N of the widest normalizing task
// (0: none normalizes).
template <typename T>
void launch_rmsnorm_quant_kernel(const RmsNormQuantKernelParams& params, int64_t num_blocks,
                                 int threads, int64_t max_norm_hidden, const Launch& launch);

}  // namespace cuda
}  // namespace mlakv
