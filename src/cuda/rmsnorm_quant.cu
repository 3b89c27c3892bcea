// mlakv CUDA backend: the launcher of rmsnorm_quant / mla_rmsnorm_quant / per_token_group_quant_fp8
// and the kernel's instantiations.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/backend.h"
#include "core/rmsnorm_quant_args.h"
#include "cuda/cuda_utils.h"
#include "cuda/rmsnorm_quant.h"
#include "cuda/rmsnorm_quant_kernel.cuh"
#include "mlakv/error.h"

namespace mlakv {
namespace cuda {

namespace {

// The exact-fit kernel for task 0's rows of N0 (and task 1's of N1 > 0, the dual form; its rows
// always one chunk a thread), in the thread form the block counts ask for (rmsnorm_quant.h): the
// one-chunk form by the whole grid (`total`, both tasks' blocks: its wide blocks must all be
// resident at once), the two-chunk form by task 0's.
template <typename T, int kN0, int kN1>
void launch_rows(const RmsNormQuantKernelParams& params, int64_t num_blocks0, int64_t total,
                 int64_t max_norm_hidden, const Launch& launch) {
  constexpr int kFew = rmsq_rows_threads(kN0, kN1);
  constexpr int kOneChunk = kN0 / kChunkElems;
  constexpr int kTwoChunks = kN0 / kChunkElems / 2;
  // Task 1's threads in each form (no task 1: the form's own).
  constexpr int kOne1 = kN1 > 0 ? kN1 / kChunkElems : kOneChunk;
  constexpr int kTwo1 = kN1 > 0 ? kN1 / kChunkElems : kTwoChunks;
  constexpr int kFew1 = kN1 > 0 ? kN1 / kChunkElems : kFew;
  if constexpr (kOneChunk > kFew) {
    // A bounded instance's grid stays one wave up to its resident blocks (rmsnorm_quant.h).
    const int64_t one_chunk_max = std::max<int64_t>(
        kRmsqOneChunkMaxBlocks,
        int64_t{kRmsqRowsMinBlocks<T, kN0, kN1, kOneChunk>} * multiprocessor_count());
    if (total <= one_chunk_max) {
      launch_rmsnorm_quant_rows_kernel<T, kN0, kN1, kOneChunk, kOne1>(params, total,
                                                                      max_norm_hidden, launch);
      return;
    }
  }
  if constexpr (kTwoChunks > kFew && kTwoChunks * 2 * kChunkElems == kN0) {
    if (num_blocks0 <= (kN1 > 0 ? kRmsqDualTwoChunksMaxBlocks : kRmsqTwoChunksMaxBlocks)) {
      launch_rmsnorm_quant_rows_kernel<T, kN0, kN1, kTwoChunks, kTwo1>(params, total,
                                                                       max_norm_hidden, launch);
      return;
    }
  }
  launch_rmsnorm_quant_rows_kernel<T, kN0, kN1, kFew, kFew1>(params, total, max_norm_hidden,
                                                             launch);
}

// The exact-fit kernel (rmsnorm_quant_rows_kernel) for the row widths it is compiled for: one task
// of N = 512, 1024 or 1536 (DeepSeek-V3 / Kimi-K2 kv_c and q_c), or the dual form with q_c 1536
// and kv_c 512. Returns false (nothing launched) for other shapes, which take
// rmsnorm_quant_kernel. Wider rows (4 chunks a thread: N = 2048, 4096, 7168 ...) stay there: the
// two rows' 8 chunks a thread took 110 registers (2-3 resident blocks of 224 threads for 7168,
// fewer rows in flight than the generic kernel's 5), a trade not measured yet.
template <typename T, int kN>
bool launch_rows_if(const RmsNormQuantKernelParams& params, int64_t N, int64_t num_blocks,
                    int64_t max_norm_hidden, const Launch& launch) {
  if (N != kN) return false;
  launch_rows<T, kN, 0>(params, num_blocks, num_blocks, max_norm_hidden, launch);
  return true;
}

bool launch_exact_fit(const core::RmsNormQuantArgs& args, int64_t max_norm_hidden,
                      const Launch& launch) {
  RmsNormQuantKernelParams params;
  int64_t widths[2] = {0, 0};
  int64_t num_blocks[2] = {0, 0};
  int n = 0;  // tasks with rows, in order
  for (int i = 0; i < args.num_tasks; ++i) {
    const core::RmsNormQuantTask& task = args.tasks[i];
    if (task.num_tokens == 0) continue;
    // Compiled configurations (rmsq_two_rows_of): no residual or normed_out without a weight.
    if (task.weight == nullptr && (task.residual != nullptr || task.normed_out != nullptr)) {
      return false;
    }
    params.tasks[n] = task;
    widths[n] = task.hidden;
    num_blocks[n] = (task.num_tokens + kRmsqRowsPerBlock - 1) / kRmsqRowsPerBlock;
    ++n;
  }
  params.num_rows_first = params.tasks[0].num_tokens;
  params.num_blocks_first = num_blocks[0];
  const int64_t total = num_blocks[0] + num_blocks[1];
  bool launched = false;
  MLAKV_MODEL_DTYPE_SWITCH(args.model_dtype, "cuda::rmsnorm_quant: model_dtype", T, [&] {
    if (widths[1] != 0) {
      if (widths[0] == 1536 && widths[1] == 512) {
        launch_rows<T, 1536, 512>(params, num_blocks[0], total, max_norm_hidden, launch);
        launched = true;
      }
      return;
    }
    const int64_t N = widths[0];
    launched = launch_rows_if<T, 512>(params, N, total, max_norm_hidden, launch) ||
               launch_rows_if<T, 1024>(params, N, total, max_norm_hidden, launch) ||
               launch_rows_if<T, 1536>(params, N, total, max_norm_hidden, launch);
  });
  return launched;
}

}  // namespace

void rmsnorm_quant(const core::RmsNormQuantArgs& args, const Context& ctx) {
  RmsNormQuantKernelParams params;
  params.tasks[0] = args.tasks[0];
  if (args.num_tasks > 1) params.tasks[1] = args.tasks[1];
  params.num_rows_first = args.tasks[0].num_tokens;
  const int64_t num_blocks =
      args.tasks[0].num_tokens + (args.num_tasks > 1 ? args.tasks[1].num_tokens : 0);
  if (num_blocks == 0) return;

  // Threads: rmsq_threads_for the widest row.
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
  const int64_t threads = rmsq_threads_for(max_chunks);
  MLAKV_CHECK(threads <= kRmsqMaxThreads, "cuda::rmsnorm_quant: hidden: a row of ",
              max_chunks * kChunkElems, " elements needs more than ", kRmsqMaxThreads,
              " threads x ", kRmsqMaxChunksPerThread, " chunks");
  MLAKV_CHECK(num_blocks <= 0x7fffffff,
              "cuda::rmsnorm_quant: num_tokens: expected at most 2^31 - 1 rows in all, got ",
              num_blocks);

  const Launch launch = launch_of(ctx);
  if (launch_exact_fit(args, max_norm_hidden, launch)) return;
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

#define MLAKV_RMSQ_ROWS_INSTANCE(T, N0, N1, kThreads0, kThreads1)                  \
  template void launch_rmsnorm_quant_rows_kernel<T, N0, N1, kThreads0, kThreads1>( \
      const RmsNormQuantKernelParams&, int64_t, int64_t, const Launch&);
#define MLAKV_RMSQ_ROWS_INSTANCES(T)             \
  MLAKV_RMSQ_ROWS_INSTANCE(T, 512, 0, 64, 64)    \
  MLAKV_RMSQ_ROWS_INSTANCE(T, 1024, 0, 64, 64)   \
  MLAKV_RMSQ_ROWS_INSTANCE(T, 1024, 0, 128, 128) \
  MLAKV_RMSQ_ROWS_INSTANCE(T, 1536, 0, 64, 64)   \
  MLAKV_RMSQ_ROWS_INSTANCE(T, 1536, 0, 96, 96)   \
  MLAKV_RMSQ_ROWS_INSTANCE(T, 1536, 0, 192, 192) \
  MLAKV_RMSQ_ROWS_INSTANCE(T, 1536, 512, 64, 64) \
  MLAKV_RMSQ_ROWS_INSTANCE(T, 1536, 512, 96, 64) \
  MLAKV_RMSQ_ROWS_INSTANCE(T, 1536, 512, 192, 64)
MLAKV_RMSQ_ROWS_INSTANCES(num::Bf16)
MLAKV_RMSQ_ROWS_INSTANCES(num::Half)
MLAKV_RMSQ_ROWS_INSTANCES(float)
#undef MLAKV_RMSQ_ROWS_INSTANCES
#undef MLAKV_RMSQ_ROWS_INSTANCE

}  // namespace cuda
}  // namespace mlakv
