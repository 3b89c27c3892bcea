// mlakv CUDA backend: RMSNorm + FP8 per-token-group quantization (rmsnorm_quant,
// mla_rmsnorm_quant's two tasks in one grid, per_token_group_quant_fp8) -- kernel parameters and
// the launcher template (rmsnorm_quant_kernel.cuh; instantiated in rmsnorm_quant.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/numerics.h"
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

// The most 256-element subtrees of a row's sum of squares (kMaxRmsNormQuantHidden / 256): the
// generic kernel's shared array of their sums.
constexpr int kRmsqMaxSubtrees = kRmsqMaxThreads * kRmsqMaxChunksPerThread / 32;

// Dynamic shared memory of a block (either kernel) whose widest normalizing row has N elements:
// the staged weight (16-bit rows).
template <typename T>
constexpr size_t rmsq_smem_bytes(int64_t N) {
  return static_cast<size_t>(N) * (kRmsqStagesWeight<T> ? sizeof(T) : 0);
}

// Threads of a block whose widest row has max_chunks chunks: at most kRmsqMaxChunksPerThread
// chunks a thread, a multiple of 32, at least two warps (N = 512: 64 threads, one chunk each;
// N = 1536: 64 x 3; N = 7168: 224 x 4).
constexpr int64_t rmsq_threads_for(int64_t max_chunks) {
  const int64_t t = (max_chunks + kRmsqMaxChunksPerThread - 1) / kRmsqMaxChunksPerThread;
  const int64_t warps = (t + 31) / 32;
  return (warps < 2 ? 2 : warps) * 32;
}

// The exact-fit kernel (rmsnorm_quant_rows_kernel), compiled for a few row widths (N0, and N1 > 0
// for the dual form): in one of the thread forms below, every thread holding the same number of
// chunks of every row (kChunks, a compile-time constant like the offsets between them), a block
// taking kRmsqRowsPerBlock rows of one task.
constexpr int kRmsqRowsPerBlock = 2;

// The exact-fit kernel's thread forms (the dual form's kv_c blocks always run one chunk a thread
// on their first N1 / 8 threads): while the whole grid has at most kRmsqOneChunkMaxBlocks blocks
// (q_c alone: T <= 1536; the 16-bit dual form: see below), one chunk a thread (N0 / 8 threads);
// else while task 0 (q_c) has at most kRmsqTwoChunksMaxBlocks (q_c alone: T <= 4096; the dual
// form: kRmsqDualTwoChunksMaxBlocks, T0 <= 2048), two (N0 / 16, where that is more than
// rmsq_rows_threads); above, rmsq_rows_threads's few threads of up to 4 chunks. A small grid's time
// is one block's chain of dependent instructions, which a wider block shortens, as long as the
// grid's blocks are all resident at once; a large grid's is its memory traffic, moved with fewer
// instructions by fewer threads. On the H200 (q_c, N = 1536, docs/perf-notes.md, seventh and
// eighth sessions): T = 1 2.8 -> 2.2 us, T = 1024 5.3 -> 4.8 us, T = 2048 7.2 -> 6.9 us with the
// forms, T = 16384 unchanged.
constexpr int64_t kRmsqOneChunkMaxBlocks = 768;
constexpr int64_t kRmsqTwoChunksMaxBlocks = 2048;
// The dual form leaves the two-chunk form at half that: its kv_c blocks double the grid, and
// there the few-thread form's smaller blocks (more resident a multiprocessor) take fewer waves.
// On the H200 (docs/perf-notes.md, twelfth session): T = 4096 11.3 -> 11.0 us in the few-thread
// form, T = 3072 within 1 % either way.
constexpr int64_t kRmsqDualTwoChunksMaxBlocks = 1024;
constexpr int rmsq_rows_threads(int N0, int N1) {
  return static_cast<int>(rmsq_threads_for((N0 > N1 ? N0 : N1) / 8));
}

// Two instances of the dual form are compiled for more resident blocks a multiprocessor than
// ptxas's unbounded register counts allow (rmsnorm_quant_rows_kernel_bounded), so that its grids,
// whose kv_c blocks are light (64 active threads), take fewer waves:
// - the one-chunk instance for 16-bit rows: kRmsqDualOneChunkBlocksPerSm (at most 40 registers for
//   192 threads; fp32 rows would spill). It takes grids of up to that many blocks a
//   multiprocessor, past kRmsqOneChunkMaxBlocks: what counts is that the whole grid is one wave.
//   At T = 1024 (1024 blocks; 7 resident a multiprocessor at the unbounded 47 registers, 8 at 40)
//   the H200 ran it in 4.9 us bounded and 5.2 us in the two-chunk form (docs/perf-notes.md,
//   eighth session).
// - the few-thread instance (64 threads) for bf16 rows: kRmsqDualFewBlocksPerSm (64 registers, 71
//   unbounded: 14 blocks; only the calls of the rare exact quantization path spill, a few bytes
//   in encode_chunk_exact_words and the IEEE division's slow path). On the H200
//   (docs/perf-notes.md, fifteenth session, run 44): T = 4096 unchanged, T = 8192 18.4 -> 18.2 us,
//   T = 16384 34.4 -> 33.7 us. q_c alone ran as fast either way under the same bound, and fp16
//   rows spill at 64 registers: those instances stay unbounded.
constexpr int kRmsqDualOneChunkBlocksPerSm = 8;
constexpr int kRmsqDualFewBlocksPerSm = 16;
// The resident blocks a multiprocessor the exact-fit instance (rows of N0 and N1 on kThreads0
// threads) is compiled for; 0: no bound. The launcher's form rule and its kernel choice both ask.
template <typename T, int kN0, int kN1, int kThreads0>
constexpr int kRmsqRowsMinBlocks =
    kN1 == 0 || sizeof(T) != 2 ? 0
    : kThreads0 * 8 == kN0     ? kRmsqDualOneChunkBlocksPerSm
    : kThreads0 == rmsq_rows_threads(kN0, kN1) && std::is_same_v<T, num::Bf16>
        ? kRmsqDualFewBlocksPerSm
        : 0;

// The two block counts come first: with them, task 0's num_tokens, input and stride_input_token
// lie in the parameter block's first 64-byte line, all that a block reads before its first loads.
struct RmsNormQuantKernelParams {
  int64_t num_rows_first = 0;  // blocks [0, num_rows_first) take tasks[0], the rest tasks[1]
  // Exact-fit kernel: blocks [0, num_blocks_first) take rows (2b, 2b + 1) of tasks[0], the rest
  // those of tasks[1].
  int64_t num_blocks_first = 0;
  core::RmsNormQuantTask tasks[2];  // validated; tasks[1] unused unless the dual form
};

// One block per row of either task; `threads` a multiple of 32 that covers the widest row in
// kRmsqMaxChunksPerThread chunks per thread; `max_norm_hidden` = N of the widest normalizing task
// (0: none normalizes).
template <typename T>
void launch_rmsnorm_quant_kernel(const RmsNormQuantKernelParams& params, int64_t num_blocks,
                                 int threads, int64_t max_norm_hidden, const Launch& launch);

// The exact-fit kernel for rows of N0 (task 0) and N1 (task 1, dual form; 0: none) elements:
// `num_blocks` = ceil(T0 / 2) + ceil(T1 / 2).
template <typename T, int kN0, int kN1, int kThreads0, int kThreads1>
void launch_rmsnorm_quant_rows_kernel(const RmsNormQuantKernelParams& params, int64_t num_blocks,
                                      int64_t max_norm_hidden, const Launch& launch);

}  // namespace cuda
}  // namespace mlakv
