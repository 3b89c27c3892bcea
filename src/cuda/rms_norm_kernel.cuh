// mlakv CUDA backend: the RMSNorm kernel.
//
// One warp per token t (block b's warp w: t = b * 4 + w). Lane l handles chunks k = l, l + 32, ...
// (8 elements each) of the row:
//   pass 1, per segment of 1024 elements (4 chunks a lane): each chunk's squares summed as a
//           subtree (chunk_square_sum), the 32 chunks of a slot by xor shuffles
//           (warp_pairwise_sum), the segment's 4 slots pairwise, the segments merged in row order
//           (num::PairwiseMerger): the pairwise tree over the row, the library's one order, so the
//           result is bitwise equal to the CPU backend and to the fused op's K side;
//   inv_rms = rms_inv(sum, N, eps);
//   pass 2: each lane re-reads its own chunks, applies (x * inv_rms) * w, rounds once, stores.
// output may be input itself: a lane writes only chunks that it alone read, and all of pass 1 is
// done (shuffles) before pass 2 writes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_utils.h"
#include "cuda/device_common.cuh"
#include "cuda/rms_norm.h"
#include "cuda/vec.cuh"

namespace mlakv {
namespace cuda {

constexpr int kRmsThreads = 128;
constexpr int kRmsWarps = kRmsThreads / kWarpSize;
constexpr int kRmsSegment = 1024;  // elements per pass-1 segment: 4 chunks per lane
constexpr int kRmsSlots = kRmsSegment / kChunkElems / kWarpSize;

template <typename T, bool kVec>
__global__ void __launch_bounds__(kRmsThreads)
    rms_norm_kernel(const __grid_constant__ core::RmsNormArgs a) {
  pdl_wait();
  pdl_launch_dependents();
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRmsWarps + warp;
  if (t >= a.num_tokens) return;
  const int64_t N = a.hidden;
  const int64_t num_chunks = (N + kChunkElems - 1) / kChunkElems;
  const T* in = static_cast<const T*>(a.input) + t * a.stride_input_token;
  const T* weight = static_cast<const T*>(a.weight);
  T* out = static_cast<T*>(a.output) + t * a.stride_output_token;

  // Segments of 1024 elements are whole subtrees of the row's tree (a short last one padded with
  // +0), merged in row order.
  num::PairwiseMerger merger;
  for (int64_t seg = 0; seg < N; seg += kRmsSegment) {
    const int64_t chunk0 = seg / kChunkElems;
    // Every load of the segment issued before the first square (vec.cuh ChunkInFlight).
    ChunkInFlight<kVec, T> x_in[kRmsSlots];
#pragma unroll
    for (int s = 0; s < kRmsSlots; ++s) {
      const int64_t k = chunk0 + lane + kWarpSize * s;
      if (k < num_chunks) {
        const int64_t e0 = k * kChunkElems;
        const int n = N - e0 < kChunkElems ? static_cast<int>(N - e0) : kChunkElems;
        x_in[s] = start_load_chunk<kVec>(in + e0, n);  // missing elements: +0
      }
    }
    float part[kRmsSlots];
#pragma unroll
    for (int s = 0; s < kRmsSlots; ++s) {
      const bool in_row = chunk0 + lane + kWarpSize * s < num_chunks;
      part[s] = in_row ? chunk_square_sum(finish_load_chunk<kVec, T>(x_in[s])) : 0.0f;
    }
    merger.add(warp_slots_sum(part));
  }
  const float inv_rms = num::rms_inv(merger.total(), N, a.eps);

  for (int64_t k0 = 0; k0 < num_chunks; k0 += kWarpSize * kRmsSlots) {
    ChunkInFlight<kVec, T> x_in[kRmsSlots];
    ChunkInFlight<kVec, T> w_in[kRmsSlots];
#pragma unroll
    for (int s = 0; s < kRmsSlots; ++s) {
      const int64_t k = k0 + lane + kWarpSize * s;
      if (k < num_chunks) {
        const int64_t e0 = k * kChunkElems;
        const int n = N - e0 < kChunkElems ? static_cast<int>(N - e0) : kChunkElems;
        x_in[s] = start_load_chunk<kVec>(in + e0, n);
        w_in[s] = start_load_chunk<kVec>(weight + e0, n);
      }
    }
#pragma unroll
    for (int s = 0; s < kRmsSlots; ++s) {
      const int64_t k = k0 + lane + kWarpSize * s;
      if (k < num_chunks) {
        const int64_t e0 = k * kChunkElems;
        const int n = N - e0 < kChunkElems ? static_cast<int>(N - e0) : kChunkElems;
        const Chunk<T> x = finish_load_chunk<kVec, T>(x_in[s]);
        const Chunk<T> w = finish_load_chunk<kVec, T>(w_in[s]);
        Chunk<T> y;
#pragma unroll
        for (int e = 0; e < kChunkElems; ++e) {
          y.v[e] = num::from_float<T>(
              num::rms_apply(num::to_float(x.v[e]), inv_rms, num::to_float(w.v[e])));
        }
        store_chunk<kVec>(out + e0, y, n);
      }
    }
  }
}

template <typename T, bool kVec>
void launch_rms_norm_kernel(const core::RmsNormArgs& args, const Launch& launch) {
  const int64_t grid = (args.num_tokens + kRmsWarps - 1) / kRmsWarps;
  MLAKV_CHECK(grid <= 0x7fffffff, "rms_norm: ", args.num_tokens, " tokens exceed one launch");
  launch_kernel("rms_norm_kernel", rms_norm_kernel<T, kVec>, static_cast<unsigned>(grid),
                kRmsThreads, 0, launch, args);
}

}  // namespace cuda
}  // namespace mlakv
