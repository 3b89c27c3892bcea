// mlakv CUDA backend: the cache read-back kernel.
//
// One warp per output row r < num_rows (block b's warp w: r = b * 4 + w).
//   slots mode:     entry of slots[r]; slot < 0 -> zeros, slot >= num_slots -> zeros + kBadSlot.
//   sequences mode: b = the sequence with cu_seq_lens[b] <= r < cu_seq_lens[b + 1] (binary search
//                   over the non-decreasing cu_seq_lens; rows of no sequence are not written),
//                   i = r - cu_seq_lens[b], block = block_table[b, i / block_size] (an index past
//                   max_blocks_per_seq or a block outside [0, num_blocks) -> zeros +
//                   kBadBlockIndex), offset i % block_size.
// Lane l dequantizes latent chunks k = l, l + 32, ... (8 values: 8 fp8 bytes, 16 bytes of bf16 /
// fp16, 32 of fp32) into 8 output values, and rope values e = l, l + 32, ... one by one.
// Dequantization: raw formats convert (a bit copy when the types agree); fp8 formats give
// from_float<Out>(to_float(byte) * scale), scale = the per-tensor scale or the entry's tile scale
// (fp8_ds_mla: fp32 at byte 512 + 4 * (k / 16)).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_utils.h"
#include "cuda/device_common.cuh"
#include "cuda/gather_cache.h"
#include "cuda/vec.cuh"

namespace mlakv {
namespace cuda {

constexpr int kGatherThreads = 128;
constexpr int kGatherWarps = kGatherThreads / kWarpSize;
constexpr int kGatherLatentSlots = 1024 / kChunkElems / kWarpSize;  // L <= 1024: 4

template <typename Out, typename C>
__device__ __forceinline__ Out dequantize(C v, float scale) {
  if constexpr (kIsFp8<C>) {
    return num::from_float<Out>(num::mul_rn(num::to_float(v), scale));
  } else {
    return encode<Out>(v, Divisor{});  // a conversion: no division happens
  }
}

template <CacheFormat kFormat, typename Out, bool kVec>
__global__ void __launch_bounds__(kGatherThreads)
    gather_cache_kernel(const __grid_constant__ GatherKernelParams p) {
  pdl_wait();
  pdl_launch_dependents();
  using Latent = typename CacheTraits<kFormat>::Latent;
  using RopeT = typename CacheTraits<kFormat>::Rope;
  constexpr bool kDsMla = kFormat == CacheFormat::kFloat8DsMla;
  const core::GatherCacheArgs& a = p.args;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t r =
      static_cast<int64_t>(blockIdx.x) * kGatherWarps + static_cast<int>(threadIdx.x) / kWarpSize;
  if (r >= a.num_rows) return;
  const int64_t L = a.kv_lora_rank;
  const int64_t R = a.rope_dim;
  const int cpr = static_cast<int>(L / kChunkElems);

  // Locate the entry (block, offset); valid == false writes zeros.
  bool valid = false;
  int64_t block = 0;
  int64_t offset = 0;
  if (!a.sequences) {
    const int64_t slot = load_index(a.slots, r);
    if (slot >= a.cache.num_slots) {
      if (lane == 0) count_error(p.error_counts, kBadSlot);
    } else if (slot >= 0) {
      valid = true;
      block = slot / a.cache.block_size;
      offset = slot - block * a.cache.block_size;
    }
  } else {
    // Largest b in [0, B) with cu_seq_lens[b] <= r.
    int64_t lo = 0;
    int64_t hi = a.num_seqs;  // invariant: answer in [lo, hi), or none when cu[0] > r
    if (a.num_seqs <= 0 || a.cu_seq_lens[0] > r) return;
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (a.cu_seq_lens[mid] <= r) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    const int64_t begin = a.cu_seq_lens[lo];
    if (begin < 0 || r >= a.cu_seq_lens[lo + 1]) return;  // past the last sequence
    const int64_t i = r - begin;
    const int64_t block_index = i / a.cache.block_size;
    block = block_index < a.max_blocks_per_seq
                ? a.block_table[lo * a.stride_block_table_seq + block_index]
                : -1;
    if (block < 0 || block >= a.num_blocks) {
      if (lane == 0) count_error(p.error_counts, kBadBlockIndex);
    } else {
      valid = true;
      offset = i - block_index * a.cache.block_size;
    }
  }

  Out* out = static_cast<Out*>(a.out) + r * a.stride_out_token;
  if (!valid) {
    Chunk<Out> zero;
#pragma unroll
    for (int e = 0; e < kChunkElems; ++e) zero.v[e] = Out{};
    for (int k = lane; k < cpr; k += kWarpSize)
      store_chunk<kVec>(out + k * kChunkElems, zero, kChunkElems);
    for (int64_t e = lane; e < R; e += kWarpSize) out[L + e] = Out{};
    return;
  }

  const EntryPtrs entry = cache_entry_at<kFormat>(a.cache, block, offset, L);
  float scale = 1.0f;
  if constexpr (!kDsMla && kIsFp8<Latent>) {
    if (a.cache.scale != nullptr) scale = *a.cache.scale;
  }
  const Latent* latent = reinterpret_cast<const Latent*>(entry.latent);
  // The chunks stay in flight (vec.cuh ChunkInFlight) until every load of the row is issued.
  ChunkInFlight<kVec, Latent> v_in[kGatherLatentSlots];
  float tile_scale[kGatherLatentSlots];
#pragma unroll
  for (int s = 0; s < kGatherLatentSlots; ++s) {
    const int k = lane + kWarpSize * s;
    tile_scale[s] = scale;
    if (k < cpr) {
      v_in[s] = start_load_chunk<kVec>(latent + k * kChunkElems, kChunkElems);
      if constexpr (kDsMla) {
        tile_scale[s] = reinterpret_cast<const float*>(
            entry.latent + kDsMlaLatentDim)[k / (kDsMlaTileElems / kChunkElems)];
      }
    }
  }
  const RopeT* rope = reinterpret_cast<const RopeT*>(entry.rope);
  for (int64_t e = lane; e < R; e += kWarpSize) out[L + e] = dequantize<Out>(rope[e], scale);
#pragma unroll
  for (int s = 0; s < kGatherLatentSlots; ++s) {
    const int k = lane + kWarpSize * s;
    if (k < cpr) {
      const Chunk<Latent> v = finish_load_chunk<kVec, Latent>(v_in[s]);
      Chunk<Out> o;
#pragma unroll
      for (int e = 0; e < kChunkElems; ++e) o.v[e] = dequantize<Out>(v.v[e], tile_scale[s]);
      store_chunk<kVec>(out + k * kChunkElems, o, kChunkElems);
    }
  }
}

template <CacheFormat kFormat, typename Out, bool kVec>
void launch_gather_cache_kernel(const GatherKernelParams& params, const Launch& launch) {
  const int64_t grid = (params.args.num_rows + kGatherWarps - 1) / kGatherWarps;
  MLAKV_CHECK(grid <= 0x7fffffff, "gather_cache: ", params.args.num_rows,
              " rows exceed one launch");
  launch_kernel("gather_cache_kernel", gather_cache_kernel<kFormat, Out, kVec>,
                static_cast<unsigned>(grid), kGatherThreads, 0, launch, params);
}

}  // namespace cuda
}  // namespace mlakv
