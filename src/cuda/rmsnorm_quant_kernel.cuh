// mlakv CUDA backend: the RMSNorm + FP8 per-token-group quantization kernel.
//
// One block per token row; the grid covers the rows of task 0 (q_c, or the only task), then the
// rows of task 1 (kv_c of the dual form), so both norms of an MLA layer run in one launch.
//
// Thread -> data mapping (chunk = 8 consecutive elements: 16 bytes of bf16/fp16, 32 of fp32, and
// 8 bytes of e4m3 output), thread tid of a block of B threads holds chunks c = tid + i * B,
// i < 4, in registers:
//
//   row  |c0 c1 ... c(B-1)|cB ... c(2B-1)|...          N = 1536 bf16, B = 64: 3 chunks a thread
//         t0 t1 ... t(B-1) t0 ... t(B-1)
//   group g of G values = chunks [g * G/8, (g+1) * G/8) = G/8 consecutive lanes of one warp
//         (G = 128: 16 lanes, 256 bytes of bf16 in, 128 bytes of e4m3 out)
//
// Phases of a block:
//   1. load the chunks (16-byte accesses); with a residual, s = round(x + residual) is stored back
//      into the residual; with a weight, the squares s*s go to shared memory sq[N];
//   2. warp 0: lane k < 16 sums sq[k], sq[k + 16], ... in order, then the 16 partial sums are
//      combined pairwise: exactly the CPU backend's order, so CPU and CUDA agree bit for bit;
//   3. y = round((s * inv) * w) per chunk (16-byte weight loads through the read-only path), the
//      normalized row streamed out (normed_out), the group amax reduced over the group's lanes by
//      xor shuffles, scale = group_scale(amax), e4m3(y / scale) streamed out 8 bytes a lane, and
//      the group's first lane stores the scale at t * stride_scales_token + g * stride_scales_group
//      (row- or column-major).
// Stores use the streaming (evict-first) hint: the outputs are read by the next kernel, not this
// one. normed_out may be the input itself: every element is read (phase 1) before it is written
// (phase 3) by the same thread.
//
// Numerics: src/common/numerics.h for the arithmetic (mul_rn, add_rn, div_rn, rms_inv, rms_apply);
// the roundings use the hardware conversions, which are round-to-nearest-even like num::from_float
// (cvt.rn.bf16x2 / f16x2), and the quantization is the fused kernel's encode_chunk
// (device_common.cuh), so the bytes equal num::quantize's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/numerics.h"
#include "core/rmsnorm_quant_args.h"
#include "cuda/cuda_utils.h"
#include "cuda/device_common.cuh"
#include "cuda/rmsnorm_quant.h"
#include "cuda/vec.cuh"

namespace mlakv {
namespace cuda {
namespace rmsq {

// ---- conversions -----------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ float to_f(T v) {
  return num::to_float(v);
}
template <>
__device__ __forceinline__ float to_f<num::Half>(num::Half v) {
  return __half2float(__ushort_as_half(v.bits));  // exact
}

// Round two floats to the model dtype (round-to-nearest-even, as num::from_float).
template <typename T>
__device__ __forceinline__ void round2(float a, float b, T& ra, T& rb) {
  if constexpr (std::is_same_v<T, num::Bf16>) {
    const __nv_bfloat162 r = __floats2bfloat162_rn(a, b);
    ra = num::Bf16{__bfloat16_as_ushort(r.x)};
    rb = num::Bf16{__bfloat16_as_ushort(r.y)};
  } else if constexpr (std::is_same_v<T, num::Half>) {
    const __half2 r = __floats2half2_rn(a, b);
    ra = num::Half{__half_as_ushort(r.x)};
    rb = num::Half{__half_as_ushort(r.y)};
  } else {
    ra = a;
    rb = b;
  }
}

// ---- 16-byte accesses ------------------------------------------------------------------------
// Weight chunks: read-only for the kernel's lifetime and shared by every block.
template <typename T>
__device__ __forceinline__ Chunk<T> load_chunk_ro(const T* src) {
  cuda::detail::ChunkBits<T> u;
  const auto* words = reinterpret_cast<const cuda::detail::ChunkWord<T>*>(src);
#pragma unroll
  for (int i = 0; i < cuda::detail::kChunkWords<T>; ++i) u.w[i] = __ldg(words + i);
  return u.c;
}

// Streaming (evict-first) stores of a chunk.
template <typename T>
__device__ __forceinline__ void store_chunk_cs(T* dst, const Chunk<T>& c) {
  cuda::detail::ChunkBits<T> u;
  u.c = c;
  auto* words = reinterpret_cast<cuda::detail::ChunkWord<T>*>(dst);
#pragma unroll
  for (int i = 0; i < cuda::detail::kChunkWords<T>; ++i) __stcs(words + i, u.w[i]);
}

// ---- the kernel ------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kRmsqMaxThreads)
    rmsnorm_quant_kernel(const __grid_constant__ RmsNormQuantKernelParams params) {
  extern __shared__ float sq[];  // [N] squares of the row (normalizing tasks only)
  __shared__ float s_inv;
  pdl_wait();
  pdl_launch_dependents();

  const bool second = static_cast<int64_t>(blockIdx.x) >= params.num_rows_first;
  // The task's fields once into registers (indexing the parameter block by a run-time task number
  // would re-read every field from it at each use).
  const core::RmsNormQuantTask task = params.tasks[second ? 1 : 0];
  const int64_t t = static_cast<int64_t>(blockIdx.x) - (second ? params.num_rows_first : 0);
  const int N = static_cast<int>(task.hidden);  // <= kMaxRmsNormQuantHidden
  const int num_chunks = N / kChunkElems;
  const int tid = static_cast<int>(threadIdx.x);
  const int threads = static_cast<int>(blockDim.x);
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const bool normalize = task.weight != nullptr;

  const T* x = static_cast<const T*>(task.input) + t * task.stride_input_token;
  T* residual = task.residual != nullptr
                    ? static_cast<T*>(task.residual) + t * task.stride_residual_token
                    : nullptr;

  // Phase 1: s (model dtype) in registers, squares to shared memory.
  Chunk<T> s[kRmsqMaxChunksPerThread];
#pragma unroll
  for (int i = 0; i < kRmsqMaxChunksPerThread; ++i) {
    const int c = i * threads + tid;
    if (c >= num_chunks) continue;
    s[i] = load_chunk<true>(x + c * kChunkElems, kChunkElems);
    if (residual != nullptr) {
      const Chunk<T> r = load_chunk<true>(residual + c * kChunkElems, kChunkElems);
#pragma unroll
      for (int e = 0; e < kChunkElems; e += 2) {
        round2<T>(num::add_rn(to_f(s[i].v[e]), to_f(r.v[e])),
                  num::add_rn(to_f(s[i].v[e + 1]), to_f(r.v[e + 1])), s[i].v[e], s[i].v[e + 1]);
      }
      store_chunk<true>(residual + c * kChunkElems, s[i], kChunkElems);
    }
    if (normalize) {
      float v2[kChunkElems];
#pragma unroll
      for (int e = 0; e < kChunkElems; ++e) {
        const float v = to_f(s[i].v[e]);
        v2[e] = num::mul_rn(v, v);
      }
      float4* dst = reinterpret_cast<float4*>(sq + c * kChunkElems);
      dst[0] = make_float4(v2[0], v2[1], v2[2], v2[3]);
      dst[1] = make_float4(v2[4], v2[5], v2[6], v2[7]);
    }
  }

  // Phase 2: the CPU backend's sum order (16 interleaved partial sums, then pairwise).
  float inv = 1.0f;
  if (normalize) {
    __syncthreads();
    if (warp == 0) {
      float acc = 0.0f;
      if (lane < kSumLanes) {
        // In order; the unrolled loads run ahead of the dependent adds.
#pragma unroll 8
        for (int k = lane; k < N; k += kSumLanes) acc = num::add_rn(acc, sq[k]);
      }
      acc = combine_partial_sums(acc, lane);
      if (lane == 0) s_inv = num::rms_inv(acc, N, task.eps);
    }
    __syncthreads();
    inv = s_inv;
  }

  // Phase 3: normalize, store, quantize.
  const T* w = static_cast<const T*>(task.weight);
  T* normed = task.normed_out != nullptr
                  ? static_cast<T*>(task.normed_out) + t * task.stride_normed_out_token
                  : nullptr;
  uint8_t* q = task.quant_values != nullptr ? task.quant_values + t * task.stride_quant_values_token
                                            : nullptr;
  // G is a power of two (validated): lanes_per_group = 2^group_shift.
  const int lanes_per_group = static_cast<int>(task.group_size / kChunkElems);
  const int group_shift = __ffs(lanes_per_group) - 1;
#pragma unroll
  for (int i = 0; i < kRmsqMaxChunksPerThread; ++i) {
    const int c = i * threads + tid;
    // Warp-uniform: the warp's first chunk exists. Groups never straddle the end of the row
    // (N % G == 0), so lanes past it only feed zeros into shuffles of groups nobody stores.
    if (i * threads + warp * kWarpSize >= num_chunks) continue;
    const bool active = c < num_chunks;
    Chunk<T> y = s[i];
    float amax = 0.0f;
    if (active) {
      if (normalize) {
        const Chunk<T> wc = load_chunk_ro(w + c * kChunkElems);
#pragma unroll
        for (int e = 0; e < kChunkElems; e += 2) {
          round2<T>(num::rms_apply(to_f(s[i].v[e]), inv, to_f(wc.v[e])),
                    num::rms_apply(to_f(s[i].v[e + 1]), inv, to_f(wc.v[e + 1])), y.v[e],
                    y.v[e + 1]);
        }
      }
      if (normed != nullptr) store_chunk_cs(normed + c * kChunkElems, y);
#pragma unroll
      for (int e = 0; e < kChunkElems; ++e) amax = num::amax_update(amax, to_f(y.v[e]));
    }
    if (q == nullptr) continue;
    amax = group_max(amax, lanes_per_group);
    if (!active) continue;
    const float scale = num::group_scale(amax, task.scale_floor, task.pow2_scale);
    // The fused kernel's quantization of a chunk (device_common.cuh encode_chunk: the bits of
    // num::quantize, one range test per chunk on its fast path).
    cuda::detail::ChunkBits<num::Fp8E4M3> bytes;
    bytes.c = encode_chunk<num::Fp8E4M3>(y, make_divisor(scale));
    __stcs(reinterpret_cast<uint2*>(q + c * kChunkElems), bytes.w[0]);
    if ((lane & (lanes_per_group - 1)) == 0) {
      const int64_t g = c >> group_shift;
      __stcs(task.scales + t * task.stride_scales_token + g * task.stride_scales_group, scale);
    }
  }
}

}  // namespace rmsq

template <typename T>
void launch_rmsnorm_quant_kernel(const RmsNormQuantKernelParams& params, int64_t num_blocks,
                                 int threads, size_t smem_bytes, const Launch& launch) {
  // Rows wider than 12288 elements need more than the default 48 KB of dynamic shared memory.
  constexpr size_t kDefaultSmemBytes = 48 * 1024;
  if (smem_bytes > kDefaultSmemBytes) {
    MLAKV_CUDA_CHECK(cudaFuncSetAttribute(rmsq::rmsnorm_quant_kernel<T>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem_bytes)));
  }
  launch_kernel("rmsnorm_quant_kernel", rmsq::rmsnorm_quant_kernel<T>,
                static_cast<unsigned>(num_blocks), static_cast<unsigned>(threads), smem_bytes,
                launch, params);
}

}  // namespace cuda
}  // namespace mlakv
