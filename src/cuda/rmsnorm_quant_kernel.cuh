// mlakv CUDA backend: the RMSNorm + FP8 per-token-group quantization kernels.
//
// Two kernels with the same numerics. rmsnorm_quant_rows_kernel (the exact-fit kernel, below)
// takes the row widths it is compiled for (rmsnorm_quant.cu: N = 512, 1024, 1536, and the dual
// form q_c 1536 + kv_c 512); rmsnorm_quant_kernel (the generic kernel, first) takes every other
// shape.
//
// ---- the generic kernel ----
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
//   1. a: every load of the thread's chunks at once (16-byte accesses: x, the residual of bf16
//      rows, and for 16-bit rows the weight chunks copied into shared memory by cp.async, which
//      holds no registers), so that a row waits for one memory round trip before its sum;
//      b: with a residual, s = round(x + residual) is stored back into the residual; with a
//      weight, the sum of each chunk's squares (the pairwise tree's 8-element subtree,
//      num::chunk_square_sum);
//   2. the rest of the pairwise tree, the CPU backend's order, so CPU and CUDA agree bit for bit:
//      chunk i of a warp's 32 lanes is one 256-element subtree (xor shuffles), stored in
//      s_part in row order; after one barrier every warp adds up the row's subtrees and every
//      thread computes rms_inv;
//   3. y = round((s * inv) * w) per chunk (w from shared memory, or for fp32 rows 16-byte
//      read-only loads), the normalized row streamed out (normed_out), the group amax reduced
//      over the group's lanes by five xor shuffles (offsets outside the group masked to 0),
//      scale = group_scale(amax), e4m3(y / scale) streamed out 8 bytes a lane, and the group's
//      first lane stores the scale at t * stride_scales_token + g * stride_scales_group (row- or
//      column-major; g steps by threads / lanes_per_group from one chunk of a thread to the next).
// Chunks are held as their 16-byte words (Bits<T>) from load to store; bf16 elements are formed
// from the words (bits << 16, bits & 0xffff0000) and packed back by cvt.rn.bf16x2.
// Stores use the streaming (evict-first) hint: the outputs are read by the next kernel, not this
// one. normed_out may be the input itself: every element is read (phase 1a) before it is written
// (phase 3) by the same thread.
//
// Shared memory (normalizing tasks): the subtree sums (s_part, static), and for 16-bit rows [N] T
// the weight (dynamic: rmsq_smem_bytes, rmsnorm_quant.h).
//
// Numerics: src/common/numerics.h for the arithmetic (mul_rn, add_rn, rms_inv, rms_apply,
// group_scale); the roundings use the hardware conversions, which are round-to-nearest-even like
// num::from_float (cvt.rn.bf16x2 / f16x2), amax is num::amax_update written as fmaxf (equal for
// inputs >= +0, chunk_amax), and the quantization is the fused kernel's encode_chunk
// (device_common.cuh; for bf16 its word form encode_bf16_chunk_word), so the bytes equal
// num::quantize's.
//
// ---- the exact-fit kernel ----
// For rows of N = kChunks * 8 * threads elements (kChunks, N and threads compile-time; threads
// as for the generic kernel, rmsq_threads_for, or N / 8 or N / 16 for smaller grids: one or two
// chunks a thread, kRmsqOneChunkMaxBlocks in rmsnorm_quant.h): block b takes rows t0 = 2b and
// t0 + 1 of one task, and thread tid holds chunk c = tid + i * threads of BOTH rows, i < kChunks,
// so that chunk i of the two rows shares its weight chunk, its lanes and its group:
//
//   row t0      |c0 ... c(B-1)|cB ... |...      q_c (N = 1536, B = 64): 3 chunks a row a thread
//   row t0 + 1  |c0 ... c(B-1)|cB ... |...      (the same thread for the same c)
//
// Without a row t0 + 1 (odd T) the second row is the first again (row strides 0): the same loads
// and values, stored to the same places by the same thread after all its loads, so no store is
// tested. Every offset is a compile-time constant; the weight, residual and normed_out cases are
// template variants chosen once per block (rmsq_two_rows_of), so no branch or register move
// joins them.
//   1. a: every load of both rows at once (x; the weight chunks by cp.async into shared memory,
//      in bf16's three-chunk form before any instruction waits for x, kStageWeightFirst; the
//      residual of bf16 rows); b: the residual sum, stored back; the elements kept as floats in
//      registers;
//   2. both rows' pairwise trees as in the generic kernel, their shuffles interleaved: the
//      kN / 256 subtree sums of each row to shared memory, one barrier, then every thread adds
//      them up and computes both rms_inv (a short chain: 3 levels in a chunk, 5 shuffles,
//      log2(kN / 256) adds);
//   3. per chunk i: y = round((s * inv) * w) of both rows (one weight chunk), normed_out, then
//      for bf16 quantize_two_bf16_chunks: the amax of both rows from packed bf16x2 magnitudes in
//      one word and one set of five xor shuffles, the scales, and the e4m3 bytes by the
//      precomputed reciprocal with one branch into the exact path (its comment says when it is
//      taken and why the fast path is exact); fp16 and fp32 rows take the generic kernel's amax,
//      group_scale and encode_e4m3 per row.
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
    ra = num::from_float<T>(a);
    rb = num::from_float<T>(b);
  }
}

// ---- chunks as words ---------------------------------------------------------------------------
// The kernel holds a chunk as the words it is loaded and stored as (Bits: one uint4 for 16-bit
// types, two for fp32): taken apart into 16-bit fields, a bf16 chunk would cost a split and a
// re-pack (12 instructions) on the way from its load to its arithmetic.
template <typename T>
using Bits = cuda::detail::ChunkBits<T>;
template <typename T>
using Word = cuda::detail::ChunkWord<T>;
template <typename T>
constexpr int kWords = cuda::detail::kChunkWords<T>;

template <typename T>
__device__ __forceinline__ Bits<T> load_bits(const T* src) {
  Bits<T> u;
#pragma unroll
  for (int i = 0; i < kWords<T>; ++i) u.w[i] = reinterpret_cast<const Word<T>*>(src)[i];
  return u;
}
// Weight chunks: read-only for the kernel's lifetime and shared by every block.
template <typename T>
__device__ __forceinline__ Bits<T> load_bits_ro(const T* src) {
  Bits<T> u;
#pragma unroll
  for (int i = 0; i < kWords<T>; ++i) u.w[i] = __ldg(reinterpret_cast<const Word<T>*>(src) + i);
  return u;
}
template <typename T>
__device__ __forceinline__ void store_bits(T* dst, const Bits<T>& u) {
#pragma unroll
  for (int i = 0; i < kWords<T>; ++i) reinterpret_cast<Word<T>*>(dst)[i] = u.w[i];
}
// Streaming (evict-first) stores: the outputs are read by the next kernel, not this one.
template <typename T>
__device__ __forceinline__ void store_bits_cs(T* dst, const Bits<T>& u) {
#pragma unroll
  for (int i = 0; i < kWords<T>; ++i) __stcs(reinterpret_cast<Word<T>*>(dst) + i, u.w[i]);
}

// The eight elements of a chunk as floats (exact). bf16 straight from the words (bits << 16 and
// bits & 0xffff0000: the bits of num::to_float), one operation an element.
template <typename T>
__device__ __forceinline__ void unpack_chunk(const Bits<T>& u, float (&f)[kChunkElems]) {
  if constexpr (std::is_same_v<T, num::Bf16>) {
    const uint32_t words[4] = {u.w[0].x, u.w[0].y, u.w[0].z, u.w[0].w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f[2 * k] = __uint_as_float(words[k] << 16);
      f[2 * k + 1] = __uint_as_float(words[k] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kChunkElems; ++k) f[k] = widen(u.c.v[k]);
  }
}

// Eight floats rounded to the model dtype (round-to-nearest-even, as num::from_float), a packed
// pair at a time.
template <typename T>
__device__ __forceinline__ Bits<T> pack_chunk_rn(const float (&f)[kChunkElems]) {
  Bits<T> u;
  if constexpr (std::is_same_v<T, num::Bf16>) {
    uint32_t words[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const __nv_bfloat162 r = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);  // .x: low half
      words[k] = *reinterpret_cast<const uint32_t*>(&r);
    }
    u.w[0] = make_uint4(words[0], words[1], words[2], words[3]);
  } else {
#pragma unroll
    for (int k = 0; k < kChunkElems; k += 2) round2<T>(f[k], f[k + 1], u.c.v[k], u.c.v[k + 1]);
  }
  return u;
}

// The largest |y| of a chunk, NaN ignored (>= +0): num::amax_update as fmaxf. amax_update's
// `|y| > amax ? |y| : amax` keeps amax for a NaN |y|, as fmaxf does, and both are >= +0, so the two
// agree bit for bit; a max is order-free.
template <typename T>
__device__ __forceinline__ float chunk_amax(const Bits<T>& y) {
  float v[kChunkElems];
  unpack_chunk(y, v);
  float amax = 0.0f;
#pragma unroll
  for (int k = 0; k < kChunkElems; ++k) amax = fmaxf(amax, fabsf(v[k]));
  return amax;
}

// ---- the kernel ------------------------------------------------------------------------------
// The e4m3 bytes of a chunk as two words: the fused kernel's quantization (device_common.cuh
// encode_chunk: the bits of num::quantize, one range test per chunk on its fast path), for bf16
// straight from the chunk's word.
template <typename T>
__device__ __forceinline__ uint2 encode_e4m3(const Bits<T>& y, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (std::is_same_v<T, num::Bf16>) {
    return encode_bf16_chunk_word<num::Fp8E4M3>(y.w[0], make_divisor(scale));
  } else  // NOLINT(readability/braces)
#endif
  {
    cuda::detail::ChunkBits<num::Fp8E4M3> bytes;
    bytes.c = encode_chunk<num::Fp8E4M3>(y.c, make_divisor(scale));
    return bytes.w[0];
  }
}

// Max over the lanes of an aligned group of 2^k lanes (device_common.cuh group_max) without
// branches or predicates: level l shuffles with the xor offset (16 >> l) & (lanes_per_group - 1),
// which is 0 (the lane's own value, a no-op for max) for the levels wider than the group, so the
// five levels are two instructions each (skipping the no-op levels by a uniform branch measured
// slower on the H200: q_c T = 1024 4.36 -> 4.43 us). The inputs are >= +0 and never NaN, so
// fmaxf is `other > v ? other : v`, and the result is order-free.
// kLanes > 0: the offsets are compile-time constants (quant_groups_fixed), and the no-op levels
// fold away.
template <int kLanes = 0>
__device__ __forceinline__ float group_max_xor(float v, const int (&offsets)[5]) {
#pragma unroll
  for (int l = 0; l < 5; ++l) {
    if (kLanes > 0 && offsets[l] == 0) continue;
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offsets[l]));
  }
  return v;
}

// Where a thread's groups and scales are. G is a power of two (validated): lanes_per_group =
// G / 8 = 2^group_shift, and `threads` (a multiple of 32) is a multiple of it, so chunk i of a
// thread lies in the group of its first chunk plus i * (threads >> group_shift): its scale is
// scale_step further on. The first lane of a group stores its scale.
struct QuantGroups {
  int64_t scale_step;   // scale elements from one chunk of the thread to the next
  int64_t first_scale;  // scale elements from the row's first scale to the thread's first chunk's
  int xor_offsets[5];   // group_max_xor's: 16, 8, 4, 2, 1 where inside the group, else 0
  bool first_lane;      // the thread is its group's first lane
};
__device__ __forceinline__ QuantGroups quant_groups(const core::RmsNormQuantTask& task, int threads,
                                                    int tid) {
  QuantGroups g;
  const int lanes_per_group = static_cast<int>(task.group_size / kChunkElems);
  const int group_shift = __ffs(lanes_per_group) - 1;
  g.scale_step = static_cast<int64_t>(threads >> group_shift) * task.stride_scales_group;
  g.first_scale = static_cast<int64_t>(tid >> group_shift) * task.stride_scales_group;
#pragma unroll
  for (int l = 0; l < 5; ++l) g.xor_offsets[l] = (kWarpSize / 2 >> l) & (lanes_per_group - 1);
  g.first_lane = (tid & (lanes_per_group - 1)) == 0;
  return g;
}

// quant_groups for a compile-time group of kLanes lanes (a power of two, G = 8 kLanes).
template <int kLanes>
__device__ __forceinline__ QuantGroups quant_groups_fixed(const core::RmsNormQuantTask& task,
                                                          int threads, int tid) {
  static_assert(kLanes >= 2 && kLanes <= kWarpSize && (kLanes & (kLanes - 1)) == 0, "G / 8");
  QuantGroups g;
  g.scale_step = static_cast<int64_t>(threads / kLanes) * task.stride_scales_group;
  g.first_scale = static_cast<int64_t>(tid / kLanes) * task.stride_scales_group;
#pragma unroll
  for (int l = 0; l < 5; ++l) g.xor_offsets[l] = (kWarpSize / 2 >> l) & (kLanes - 1);
  g.first_lane = (tid & (kLanes - 1)) == 0;
  return g;
}

template <typename T>
__global__ void __launch_bounds__(kRmsqMaxThreads)
    rmsnorm_quant_kernel(const __grid_constant__ RmsNormQuantKernelParams params) {
  // Normalizing 16-bit rows only: [N] T the weight, indexed in chunks (16 bytes).
  extern __shared__ uint4 smem16[];
  // The row's 256-element subtree sums (its tree's level 8), in row order.
  __shared__ float s_part[kRmsqMaxSubtrees];
  constexpr bool kWeightEarly = kRmsqStagesWeight<T>;
  constexpr bool kResidualEarly = std::is_same_v<T, num::Bf16>;
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
  // Chunk i of this thread is chunk i * threads + tid of the row: its elements start at
  // e0 + i * step (32-bit offsets: N <= 32768).
  const int step = threads * kChunkElems;
  const int e0 = tid * kChunkElems;

  const T* x = static_cast<const T*>(task.input) + t * task.stride_input_token + e0;
  const T* w = normalize ? static_cast<const T*>(task.weight) + e0 : nullptr;
  const int w_staged = tid;  // kWeightEarly: chunk i at smem16[w_staged + i * threads]
  const unsigned w_staged_addr = static_cast<unsigned>(__cvta_generic_to_shared(smem16 + w_staged));
  T* residual = task.residual != nullptr
                    ? static_cast<T*>(task.residual) + t * task.stride_residual_token + e0
                    : nullptr;

  // Phase 1a: every load of the row at once (x; the residual of bf16 rows, whose registers fit;
  // the weight of 16-bit rows by cp.async into shared memory, which holds no registers), so that
  // a row waits for one memory round trip before its sum.
  Bits<T> s[kRmsqMaxChunksPerThread];
  Bits<T> r[kRmsqMaxChunksPerThread];
#pragma unroll
  for (int i = 0; i < kRmsqMaxChunksPerThread; ++i) {
    if (i * threads + tid >= num_chunks) continue;
    s[i] = load_bits(x + i * step);
    if (kResidualEarly && residual != nullptr) {
      r[i] = load_bits(residual + i * step);
    }
    if (kWeightEarly && normalize) {
      copy_chunk_async<T, /*kCached=*/true>(w_staged_addr + i * threads * 16u, w + i * step);
    }
  }
  // Phase 1b: s = round(x + residual) stored back into the residual; the subtree sum of each
  // chunk's squares (chunks past the row: +0).
  float part[kRmsqMaxChunksPerThread];
#pragma unroll
  for (int i = 0; i < kRmsqMaxChunksPerThread; ++i) {
    part[i] = 0.0f;
    if (i * threads + tid >= num_chunks) continue;
    if (residual != nullptr) {
      if (!kResidualEarly) r[i] = load_bits(residual + i * step);
      float a[kChunkElems], b[kChunkElems];
      unpack_chunk(s[i], a);
      unpack_chunk(r[i], b);
#pragma unroll
      for (int k = 0; k < kChunkElems; ++k) a[k] = num::add_rn(a[k], b[k]);
      s[i] = pack_chunk_rn<T>(a);
      store_bits(residual + i * step, s[i]);
    }
    if (normalize) {
      float v[kChunkElems];
      unpack_chunk(s[i], v);
      part[i] = num::chunk_square_sum(v);
    }
  }

  // Phase 2: the pairwise tree of the squares. Chunk i of warp w's lanes are the row's chunks
  // 32 (i * warps + w) .. + 31, one 256-element subtree (s_part[i * warps + w]); every warp then
  // combines the row's subtrees (at most 128, lane l taking 4l .. 4l + 3, +0 past the row).
  float inv = 1.0f;
  if (normalize) {
    const int warps = threads / kWarpSize;
    const int num_subtrees = (num_chunks + kWarpSize - 1) / kWarpSize;
#pragma unroll
    for (int i = 0; i < kRmsqMaxChunksPerThread; ++i) {
      if (i * threads + warp * kWarpSize >= num_chunks) continue;  // warp-uniform
      const float sum = warp_pairwise_sum(part[i]);
      if (lane == 0) s_part[i * warps + warp] = sum;
    }
    __syncthreads();
    float leaves[kRmsqMaxSubtrees / kWarpSize];
#pragma unroll
    for (int j = 0; j < kRmsqMaxSubtrees / kWarpSize; ++j) {
      const int b = lane * (kRmsqMaxSubtrees / kWarpSize) + j;
      leaves[j] = b < num_subtrees ? s_part[b] : 0.0f;
    }
    inv = num::rms_inv(warp_pairwise_sum(pairwise_sum(leaves)), N, task.eps);
    // A thread reads back only the weight chunks it staged itself: no barrier needed.
    if (kWeightEarly) cp_async_wait_all();
  }

  // Phase 3: normalize, store, quantize.
  T* normed = task.normed_out != nullptr
                  ? static_cast<T*>(task.normed_out) + t * task.stride_normed_out_token + e0
                  : nullptr;
  uint8_t* q = task.quant_values != nullptr
                   ? task.quant_values + t * task.stride_quant_values_token + e0
                   : nullptr;
  const QuantGroups groups = quant_groups(task, threads, tid);
  const int64_t scale_step = groups.scale_step;
  const bool stores_scale = q != nullptr && groups.first_lane;
  float* scale_ptr =
      q != nullptr ? task.scales + t * task.stride_scales_token + groups.first_scale : nullptr;
#pragma unroll
  for (int i = 0; i < kRmsqMaxChunksPerThread; ++i) {
    if (i > 0 && q != nullptr) scale_ptr += scale_step;
    // Warp-uniform: the warp's first chunk exists. Groups never straddle the end of the row
    // (N % G == 0), so lanes past it only feed zeros into shuffles of groups nobody stores.
    if (i * threads + warp * kWarpSize >= num_chunks) continue;
    const bool active = i * threads + tid < num_chunks;
    Bits<T> y = s[i];
    float amax = 0.0f;
    if (active) {
      if (normalize) {
        Bits<T> wk;
        if constexpr (kWeightEarly) {
          wk.w[0] = smem16[w_staged + i * threads];
        } else {
          wk = load_bits_ro(w + i * step);
        }
        float xv[kChunkElems], wv[kChunkElems];
        unpack_chunk(s[i], xv);
        unpack_chunk(wk, wv);
#pragma unroll
        for (int k = 0; k < kChunkElems; ++k) xv[k] = num::rms_apply(xv[k], inv, wv[k]);
        y = pack_chunk_rn<T>(xv);
      }
      if (normed != nullptr) store_bits_cs(normed + i * step, y);
      amax = chunk_amax(y);
    }
    if (q == nullptr) continue;
    amax = group_max_xor(amax, groups.xor_offsets);
    if (active) {
      const float scale = num::group_scale(amax, task.scale_floor, task.pow2_scale);
      __stcs(reinterpret_cast<uint2*>(q + i * step), encode_e4m3(y, scale));
      if (stores_scale) __stcs(scale_ptr, scale);
    }
  }
}

// ---- the exact-fit kernel ---------------------------------------------------------------------
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
__device__ __forceinline__ uint32_t bf16x2_max(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;  // halves: max(a, b), the other one where one is NaN
}
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// Whether a positive float's bits lie in [lo, hi] (one unsigned compare).
__device__ __forceinline__ bool bits_in(float v, uint32_t lo, uint32_t hi) {
  return __float_as_uint(v) - lo <= hi - lo;
}

// Quantizes chunk i of both rows of a bf16 block (y[r]: its words) and stores the e4m3 bytes at
// q + r * dq and, from the group's first lane, the scale at scale_ptr + r * dscale:
// num::group_scale and num::quantize's bytes, in two ways.
//   Amax: the chunk's magnitudes as packed halves (bf16_chunk_range); unless the chunk has an
//   element outside [2^-60, 2^60] (`bad`), none is NaN and its absmax is num::amax_update's max;
//   otherwise the NaN-ignoring max is taken per element (rare). The two rows' amax share one word
//   (row r in half r) and one set of shuffles; a max of bf16 magnitudes is a bf16 value, so the
//   halves are the exact float amax.
//   Fast path, taken when neither chunk is `bad`, both amax are in [2^-60, 2^60] and both scales
//   before the power-of-two rounding in [2^-60, 2^59] (so after it in [2^-60, 2^60]): amax / 448
//   and y / scale by divide_fast (exact in that range, cuda::Divisor), max(q, floor) as fmaxf (q
//   is not NaN), the power-of-two rounding of a normal positive scale as (u + 0x7fffff) &
//   0xff800000 (the next power of two unless the mantissa is 0: num::group_scale's rounding of
//   such scales), no branch but the one into the exact path.
//   Exact path (any other chunk pair): num::group_scale and encode_chunk_exact_words, element by
//   element.
template <int kLanes>
__device__ __forceinline__ void quantize_two_bf16_chunks(
    const Bits<num::Bf16> (&y)[kRmsqRowsPerBlock], const int (&xor_offsets)[5],
    const Divisor& by_e4m3_max, float scale_floor, bool pow2, uint8_t* q, int64_t dq,
    float* scale_ptr, int64_t dscale, bool stores_scale) {
  constexpr int kRows = kRmsqRowsPerBlock;
  const Bf16ChunkRange range0 = bf16_chunk_range(y[0].w[0]);
  const Bf16ChunkRange range1 = bf16_chunk_range(y[1].w[0]);
  uint32_t m[kRows] = {range0.absmax, range1.absmax};
  const uint32_t bad = range0.bad | range1.bad;
  if (bad != 0u) {
#pragma unroll
    for (int row = 0; row < kRows; ++row) {
      m[row] = (__float_as_uint(chunk_amax(y[row])) >> 16) * 0x00010001u;
    }
  }
  uint32_t both = bf16x2_max(__byte_perm(m[0], m[1], 0x5410), __byte_perm(m[0], m[1], 0x7632));
#pragma unroll
  for (int l = 0; l < 5; ++l) {
    // A compile-time group (kLanes > 0) has constant offsets: its no-op levels fold away.
    if (kLanes > 0 && xor_offsets[l] == 0) continue;
    both = bf16x2_max(both, __shfl_xor_sync(kFullMask, both, xor_offsets[l]));
  }
  const float amax[kRows] = {__uint_as_float(both << 16), __uint_as_float(both & 0xffff0000u)};
  // Both halves of `both` in [2^-60, 2^60] (bf16 0x2180 .. 0x5d80), as in bf16_chunk_range.
  bool fast = (bad | (((both + 0x227f227fu) | ~(both + 0x5e805e80u)) & 0x80008000u)) == 0u;
  Divisor div[kRows];
  float scale[kRows];
#pragma unroll
  for (int row = 0; row < kRows; ++row) {
    const float s0 = fmaxf(divide_fast(amax[row], by_e4m3_max), scale_floor);
    fast = fast && bits_in(s0, 0x21800000u, 0x5d000000u);  // [2^-60, 2^59]
    const float s1 = __uint_as_float((__float_as_uint(s0) + 0x007fffffu) & 0xff800000u);
    scale[row] = pow2 ? s1 : s0;
    div[row].b = scale[row];
    float y0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y0) : "f"(scale[row]));
    div[row].y = __fmaf_rn(y0, __fmaf_rn(y0, -scale[row], 1.0f), y0);
  }
  uint2 bytes[kRows];
  if (fast) {
#pragma unroll
    for (int row = 0; row < kRows; ++row) {
      bytes[row] = encode_bf16_chunk_word_fast<num::Fp8E4M3>(y[row].w[0], div[row]);
    }
  } else {
#pragma unroll
    for (int row = 0; row < kRows; ++row) {
      scale[row] = num::group_scale(amax[row], scale_floor, pow2);
      bytes[row] = encode_chunk_exact_words<num::Fp8E4M3>(y[row].c, scale[row]);
    }
  }
#pragma unroll
  for (int row = 0; row < kRows; ++row) {
    __stcs(reinterpret_cast<uint2*>(q + row * dq), bytes[row]);
    if (stores_scale) __stcs(scale_ptr + row * dscale, scale[row]);
  }
}
#endif

// A barrier of the block's first kThreads threads (its other threads, if any, have returned).
template <int kThreads>
__device__ __forceinline__ void rows_barrier() {
  asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory");
}

template <int kN, int kThreads>
constexpr int kRowsChunks = kN / kChunkElems / kThreads;  // chunks of a row a thread holds

// Phase 1a's first loads: both rows' x chunks (row r of a per-token tensor starts at row 0's
// pointer + r * stride; for a missing second row the stride is 0: it reads row 0 again and stores
// nothing). They need only the input's fields, so rmsq_two_rows_of issues them before it reads
// the fields that choose the variant (the parameter block's next line).
template <typename T, int kN, int kThreads>
__device__ __forceinline__ void load_two_rows(
    const core::RmsNormQuantTask& task, int64_t t0,
    Bits<T> (&s)[kRmsqRowsPerBlock][kRowsChunks<kN, kThreads>]) {
  constexpr int kChunks = kRowsChunks<kN, kThreads>;
  static_assert(kChunks * kChunkElems * kThreads == kN && kChunks <= kRmsqMaxChunksPerThread,
                "an exact fit");
  constexpr int kStep = kThreads * kChunkElems;
  const int e0 = static_cast<int>(threadIdx.x) * kChunkElems;
  const T* x = static_cast<const T*>(task.input) + t0 * task.stride_input_token + e0;
  const int64_t dx = t0 + 1 < task.num_tokens ? task.stride_input_token : 0;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
#pragma unroll
    for (int row = 0; row < kRmsqRowsPerBlock; ++row)
      s[row][i] = load_bits(x + row * dx + i * kStep);
  }
}

// Where phase 1a stages the weight of 16-bit rows. Inside the variant (rmsq_two_rows), after the
// x loads in the PTX, its cp.async comes after x's first squares in the SASS (ptxas moves the
// arithmetic up), so the weight's round trip starts only once x has landed. Issued before the
// branch into the variant (rmsq_two_rows_of), it starts with x's. Measured on the H200 (docs/
// perf-notes.md, tenth session): faster in the three-chunk form (N = 1536 on 64 threads: q_c
// T = 16384 26.5 -> 25.0 us, the dual form 36.7 -> 34.3 us; 70 registers instead of 80); in the
// one-chunk form no faster at T >= 1024 (q_c T = 1024 4.30 -> 4.33 us), and in the two-chunk form
// slower at T = 2048 (6.09 -> 6.26 us) though faster at T = 4096 (9.44 -> 9.15 us), so those two
// forms keep it inside the variant. bf16 only: for fp16 rows the three-chunk form needed 86
// registers with it (80 without), and the bench has no fp16 row to say whether that pays.
template <typename T, int kChunks>
constexpr bool kStageWeightFirst = (std::is_same_v<T, num::Bf16> && kChunks >= 3);
static_assert(kRmsqStagesWeight<num::Bf16>, "kStageWeightFirst stages the weight of bf16 rows");

// Phase 1a's weight chunks (16-bit rows): chunk c of the weight by cp.async into smem16[c], the
// thread's own chunks.
template <typename T, int kN, int kThreads>
__device__ __forceinline__ void stage_weight(const core::RmsNormQuantTask& task, uint4* smem16) {
  constexpr int kChunks = kRowsChunks<kN, kThreads>;
  constexpr int kStep = kThreads * kChunkElems;
  const int tid = static_cast<int>(threadIdx.x);
  const T* w = static_cast<const T*>(task.weight) + tid * kChunkElems;
  const unsigned w_staged_addr = static_cast<unsigned>(__cvta_generic_to_shared(smem16 + tid));
#pragma unroll
  for (int i = 0; i < kChunks; ++i)
    copy_chunk_async<T, /*kCached=*/true>(w_staged_addr + i * kThreads * 16u, w + i * kStep);
}

// Rows t0 and t0 + 1 of one task whose rows are kN wide, on the block's first kThreads threads
// (kChunks chunks a thread). Without a row t0 + 1 (t0 = T - 1) the second row is the first again:
// the same loads, the same values, stored to the same places (after every load, by the same
// thread), so no store needs a test. kNormalize: the task has a weight, kResidual: a residual,
// kNormed: a normed_out (compile-time, so that no register moves merge the paths with and without
// them).
// s: the rows' x chunks (load_two_rows), replaced by the residual sums.
template <typename T, int kN, int kThreads, bool kNormalize, bool kResidual, bool kNormed,
          int kLanes = 0>
__device__ __forceinline__ void rmsq_two_rows(
    const core::RmsNormQuantTask& task, int64_t t0,
    Bits<T> (&s)[kRmsqRowsPerBlock][kRowsChunks<kN, kThreads>], uint4* smem16, float* s_part) {
  constexpr int kRows = kRmsqRowsPerBlock;
  constexpr int kChunks = kRowsChunks<kN, kThreads>;
  constexpr int kStep = kThreads * kChunkElems;  // elements from one chunk of a thread to the next
  constexpr int kWarps = kThreads / kWarpSize;
  constexpr int kSubtrees = kN / (kWarpSize * kChunkElems);  // 256-element subtrees of a row
  constexpr bool kWeightEarly = kRmsqStagesWeight<T>;
  constexpr bool kResidualEarly = std::is_same_v<T, num::Bf16>;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  constexpr bool kPackedAmax = std::is_same_v<T, num::Bf16>;
#else
  constexpr bool kPackedAmax = false;
#endif
  const bool has_b = t0 + 1 < task.num_tokens;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int e0 = tid * kChunkElems;

  // Row r of a per-token tensor starts at row 0's pointer + r * stride (0 for a missing second
  // row, as in load_two_rows).
  const T* w = kNormalize ? static_cast<const T*>(task.weight) + e0 : nullptr;
  // kWeightEarly: weight chunk c at smem16[c] (stage_weight, here or in rmsq_two_rows_of).
  T* residual =
      kResidual ? static_cast<T*>(task.residual) + t0 * task.stride_residual_token + e0 : nullptr;
  const int64_t dres = has_b ? task.stride_residual_token : 0;

  // Phase 1a: every other load of both rows at once (x's are in flight: load_two_rows, and with
  // kStageWeightFirst the weight's).
  Bits<T> r[kRows][kChunks];
  if (kResidualEarly && kResidual) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
#pragma unroll
      for (int row = 0; row < kRows; ++row)
        r[row][i] = load_bits(residual + row * dres + i * kStep);
    }
  }
  if (kWeightEarly && kNormalize && !kStageWeightFirst<T, kChunks>) {
    stage_weight<T, kN, kThreads>(task, smem16);
  }
  // Phase 1b: s = round(x + residual) stored back into the residual; the elements of s kept as
  // floats for phases 2 and 3.
  if (kResidual) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      if (!kResidualEarly) {  // both rows' loads before either store (the rows may be one)
#pragma unroll
        for (int row = 0; row < kRows; ++row)
          r[row][i] = load_bits(residual + row * dres + i * kStep);
      }
#pragma unroll
      for (int row = 0; row < kRows; ++row) {
        float a[kChunkElems], b[kChunkElems];
        unpack_chunk(s[row][i], a);
        unpack_chunk(r[row][i], b);
#pragma unroll
        for (int k = 0; k < kChunkElems; ++k) a[k] = num::add_rn(a[k], b[k]);
        s[row][i] = pack_chunk_rn<T>(a);
        store_bits(residual + row * dres + i * kStep, s[row][i]);
      }
    }
  }
  float sf[kRows][kChunks][kChunkElems];
  float inv[kRows] = {1.0f, 1.0f};
  if constexpr (kNormalize) {
    // Phase 2: the pairwise tree of each row's squares. Chunk i of warp w's lanes are the row's
    // chunks 32 (i * kWarps + w) .. + 31: one 256-element subtree, whose sum lane 0 stores at
    // s_part[row * kSubtrees + i * kWarps + w]; after the barrier every thread adds up the row's
    // kSubtrees (no second barrier: each thread computes rms_inv itself).
    float part[kRows][kChunks];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
#pragma unroll
      for (int row = 0; row < kRows; ++row) {
        unpack_chunk(s[row][i], sf[row][i]);
        part[row][i] = num::chunk_square_sum(sf[row][i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
#pragma unroll
      for (int row = 0; row < kRows; ++row) part[row][i] = warp_pairwise_sum(part[row][i]);
    }
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
#pragma unroll
        for (int row = 0; row < kRows; ++row)
          s_part[row * kSubtrees + i * kWarps + warp] = part[row][i];
      }
    }
    rows_barrier<kThreads>();
    // Even lanes compute row 0's rms_inv, odd lanes row 1's (one division-and-root chain a lane
    // instead of two in turn), then each lane takes both from its pair.
    const int my_row = lane & 1;
    float subtrees[kSubtrees];
#pragma unroll
    for (int j = 0; j < kSubtrees; ++j) subtrees[j] = s_part[my_row * kSubtrees + j];
    const float my_inv = num::rms_inv(pairwise_sum(subtrees), kN, task.eps);
    static_assert(kRows == 2, "one row per lane of a pair");
    inv[0] = __shfl_sync(kFullMask, my_inv, lane & ~1);
    inv[1] = __shfl_sync(kFullMask, my_inv, lane | 1);
    if (kWeightEarly) cp_async_wait_all();  // this thread's own weight chunks
  }

  // Phase 3: normalize, store, quantize; chunk i of both rows together (same lanes, same group).
  T* normed =
      kNormed ? static_cast<T*>(task.normed_out) + t0 * task.stride_normed_out_token + e0 : nullptr;
  const int64_t dnormed = has_b ? task.stride_normed_out_token : 0;
  // kLanes > 0: the task quantizes, in groups of 8 kLanes (rmsq_two_rows_of).
  uint8_t* q = kLanes > 0 || task.quant_values != nullptr
                   ? task.quant_values + t0 * task.stride_quant_values_token + e0
                   : nullptr;
  const int64_t dq = has_b ? task.stride_quant_values_token : 0;
  QuantGroups groups;
  if constexpr (kLanes > 0) {
    groups = quant_groups_fixed<kLanes>(task, kThreads, tid);
  } else {
    groups = quant_groups(task, kThreads, tid);
  }
  const int64_t scale_step = groups.scale_step;
  const bool stores_scale = groups.first_lane;
  float* scale_ptr = kLanes > 0 || q != nullptr
                         ? task.scales + t0 * task.stride_scales_token + groups.first_scale
                         : nullptr;
  const int64_t dscale = has_b ? task.stride_scales_token : 0;
  const Divisor by_e4m3_max = make_divisor(num::kE4M3Max);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    Bits<T> y[kRows];
    if constexpr (kNormalize) {
      Bits<T> wk;
      if constexpr (kWeightEarly) {
        wk.w[0] = smem16[tid + i * kThreads];
      } else {
        wk = load_bits_ro(w + i * kStep);
      }
      float wv[kChunkElems];
      unpack_chunk(wk, wv);
#pragma unroll
      for (int row = 0; row < kRows; ++row) {
        float v[kChunkElems];
#pragma unroll
        for (int k = 0; k < kChunkElems; ++k) v[k] = num::rms_apply(sf[row][i][k], inv[row], wv[k]);
        y[row] = pack_chunk_rn<T>(v);
      }
    } else {
#pragma unroll
      for (int row = 0; row < kRows; ++row) y[row] = s[row][i];
    }
    if constexpr (kNormed) {
#pragma unroll
      for (int row = 0; row < kRows; ++row)
        store_bits_cs(normed + row * dnormed + i * kStep, y[row]);
    }
    if (kLanes == 0 && q == nullptr) continue;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    if constexpr (kPackedAmax) {
      quantize_two_bf16_chunks<kLanes>(y, groups.xor_offsets, by_e4m3_max, task.scale_floor,
                                       task.pow2_scale, q + i * kStep, dq,
                                       scale_ptr + i * scale_step, dscale, stores_scale);
    } else  // NOLINT(readability/braces)
#endif
    {
      // The group amax of each row (num::amax_update: the largest non-NaN |y|, >= +0).
#pragma unroll
      for (int row = 0; row < kRows; ++row) {
        const float a = group_max_xor<kLanes>(chunk_amax(y[row]), groups.xor_offsets);
        const float scale = num::group_scale(a, task.scale_floor, task.pow2_scale);
        __stcs(reinterpret_cast<uint2*>(q + row * dq + i * kStep), encode_e4m3(y[row], scale));
        if (stores_scale) __stcs(scale_ptr + row * dscale + i * scale_step, scale);
      }
    }
  }
}

// The group size whose lanes rmsq_two_rows_of compiles in (kLanes).
constexpr int64_t kRmsqFixedGroup = 128;

// The configurations the exact-fit kernel is compiled for (launch_exact_fit checks them on the
// host): a weight with or without a residual and a normed_out, or neither of the three
// (per_token_group_quant_fp8).
template <typename T, int kN, int kThreads, bool kFixedGroup>
__device__ __forceinline__ void rmsq_two_rows_of(const core::RmsNormQuantTask& task, int64_t t0,
                                                 uint4* smem16, float* s_part) {
  Bits<T> s[kRmsqRowsPerBlock][kRowsChunks<kN, kThreads>];
  load_two_rows<T, kN, kThreads>(task, t0, s);
  if (kStageWeightFirst<T, kRowsChunks<kN, kThreads>> && task.weight != nullptr) {
    stage_weight<T, kN, kThreads>(task, smem16);
  }
  const bool residual = task.residual != nullptr;
  const bool normed = task.normed_out != nullptr;
  // The common group size (DeepSeek-V3's 128) compiled in, for the two variants without a
  // residual or normed_out (per_token_group_quant_fp8, and q_c's rmsnorm_quant), in the instances
  // whose kFixedGroup is set (rmsnorm_quant_rows says which).
  const bool g128 =
      kFixedGroup && task.quant_values != nullptr && task.group_size == kRmsqFixedGroup;
  constexpr int kLanes = kRmsqFixedGroup / kChunkElems;
  if (task.weight == nullptr) {
    if (g128) {
      rmsq_two_rows<T, kN, kThreads, false, false, false, kLanes>(task, t0, s, smem16, s_part);
    } else {
      rmsq_two_rows<T, kN, kThreads, false, false, false>(task, t0, s, smem16, s_part);
    }
  } else if (residual) {
    if (normed) {
      rmsq_two_rows<T, kN, kThreads, true, true, true>(task, t0, s, smem16, s_part);
    } else {
      rmsq_two_rows<T, kN, kThreads, true, true, false>(task, t0, s, smem16, s_part);
    }
  } else if (normed) {
    rmsq_two_rows<T, kN, kThreads, true, false, true>(task, t0, s, smem16, s_part);
  } else if (g128) {
    rmsq_two_rows<T, kN, kThreads, true, false, false, kLanes>(task, t0, s, smem16, s_part);
  } else {
    rmsq_two_rows<T, kN, kThreads, true, false, false>(task, t0, s, smem16, s_part);
  }
}

// Exact-fit rows (rmsnorm_quant.h): blocks [0, num_blocks_first) take rows (2b, 2b + 1) of task
// 0 (rows kN0 wide) on kThreads0 threads, the rest (kN1 > 0: the dual form) rows of task 1 (kN1
// wide) on kThreads1 <= kThreads0 threads (the block's others return at once).
template <typename T, int kN0, int kN1, int kThreads0, int kThreads1>
__device__ __forceinline__ void rmsnorm_quant_rows(const RmsNormQuantKernelParams& params) {
  static_assert(kThreads1 <= kThreads0, "the block has kThreads0 threads");
  static_assert(kThreads0 % kWarpSize == 0 && kThreads1 % kWarpSize == 0, "whole warps");
  extern __shared__ uint4 smem16[];
  static_assert(kN1 <= kN0, "task 0 has the wider rows");
  __shared__ float s_part[kRmsqRowsPerBlock * kN0 / (kWarpSize * kChunkElems)];
  // The group of 128 compiled in only where the H200 ran it (perf-notes run 103): 16-bit rows of
  // N = 1536 in the forms where a thread holds one or two chunks of a row (q_c T <= 4096: 2-8 %
  // faster), and of N = 512 (one chunk in 64 threads). N = 1536's few-thread form (three chunks a
  // thread, q_c T >= 8192) lost 1-2 % with it, and the register-capped instances
  // (rmsnorm_quant_rows_kernel_bounded) spilled (40 registers: 12 bytes a thread). Those, float32
  // rows and N = 1024 keep the run-time group, and compile to the code they had without it.
  // (Task 1 of the dual form, kv_c, never quantizes: its fixed-group path is never taken.)
  constexpr bool kFixedGroup = kRmsqRowsMinBlocks<T, kN0, kN1, kThreads0> == 0 &&
                               kRowsChunks<kN0, kThreads0> <= 2 && sizeof(T) == 2 &&
                               (kN0 == 1536 || kN0 == 512);
  pdl_wait();
  pdl_launch_dependents();
  const int64_t block = static_cast<int64_t>(blockIdx.x);
  if (kN1 > 0 && block >= params.num_blocks_first) {
    if (kThreads1 < kThreads0 && threadIdx.x >= kThreads1) return;
    rmsq_two_rows_of<T, (kN1 > 0 ? kN1 : kN0), kThreads1, kFixedGroup>(
        params.tasks[1], kRmsqRowsPerBlock * (block - params.num_blocks_first), smem16, s_part);
  } else {
    rmsq_two_rows_of<T, kN0, kThreads0, kFixedGroup>(params.tasks[0], kRmsqRowsPerBlock * block,
                                                     smem16, s_part);
  }
}

template <typename T, int kN0, int kN1, int kThreads0, int kThreads1>
__global__ void __launch_bounds__(kThreads0)
    rmsnorm_quant_rows_kernel(const __grid_constant__ RmsNormQuantKernelParams params) {
  rmsnorm_quant_rows<T, kN0, kN1, kThreads0, kThreads1>(params);
}

// The same for a register cap of kRmsqRowsMinBlocks resident blocks (two instances of the dual
// form, rmsnorm_quant.h). A separate kernel: a minimum-blocks bound of 1 on the others is not the
// same as none (ptxas then gave the 64-thread instances 111 registers, not 80, and T = 4096 ran
// 4-6 % slower).
template <typename T, int kN0, int kN1, int kThreads0, int kThreads1>
__global__ void __launch_bounds__(kThreads0, (kRmsqRowsMinBlocks<T, kN0, kN1, kThreads0>))
    rmsnorm_quant_rows_kernel_bounded(const __grid_constant__ RmsNormQuantKernelParams params) {
  rmsnorm_quant_rows<T, kN0, kN1, kThreads0, kThreads1>(params);
}

}  // namespace rmsq

template <typename T>
void launch_rmsnorm_quant_kernel(const RmsNormQuantKernelParams& params, int64_t num_blocks,
                                 int threads, int64_t max_norm_hidden, const Launch& launch) {
  // 16-bit rows wider than 24576 stage more than the default 48 KB of shared memory (the weight):
  // launch_kernel opts the kernel in. fp32 rows stage nothing.
  const size_t smem_bytes = rmsq_smem_bytes<T>(max_norm_hidden);
  launch_kernel("rmsnorm_quant_kernel", rmsq::rmsnorm_quant_kernel<T>,
                static_cast<unsigned>(num_blocks), static_cast<unsigned>(threads), smem_bytes,
                launch, params);
}

template <typename T, int kN0, int kN1, int kThreads0, int kThreads1>
void launch_rmsnorm_quant_rows_kernel(const RmsNormQuantKernelParams& params, int64_t num_blocks,
                                      int64_t max_norm_hidden, const Launch& launch) {
  const size_t smem_bytes = rmsq_smem_bytes<T>(max_norm_hidden);
  if constexpr ((kRmsqRowsMinBlocks<T, kN0, kN1, kThreads0>) > 0) {
    launch_kernel("rmsnorm_quant_rows_kernel_bounded",
                  rmsq::rmsnorm_quant_rows_kernel_bounded<T, kN0, kN1, kThreads0, kThreads1>,
                  static_cast<unsigned>(num_blocks), static_cast<unsigned>(kThreads0), smem_bytes,
                  launch, params);
  } else {
    launch_kernel("rmsnorm_quant_rows_kernel",
                  rmsq::rmsnorm_quant_rows_kernel<T, kN0, kN1, kThreads0, kThreads1>,
                  static_cast<unsigned>(num_blocks), static_cast<unsigned>(kThreads0), smem_bytes,
                  launch, params);
  }
}

}  // namespace cuda
}  // namespace mlakv
