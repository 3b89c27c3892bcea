// mlakv CUDA backend internals (device side): index and cos/sin table reads, position clamping,
// conversions into every stored type, cache format traits and the warp reductions the kernels
// share. All value arithmetic goes through src/common/numerics.h so that it matches the CPU backend
// bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/numerics.h"
#include "core/args.h"
#include "mlakv/cache.h"
#include "mlakv/context.h"
#include "vec.cuh"

namespace mlakv {
namespace cuda {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
// RMSNorm sums squares in this many interleaved partial sums (element i into sum i % 16), then
// combines them pairwise; the CPU backend uses the same order, so normalized values are bitwise
// equal across backends and between the fused op and rms_norm.
constexpr int kSumLanes = 16;

template <typename T>
constexpr bool kIsFp8 = std::is_same_v<T, num::Fp8E4M3> || std::is_same_v<T, num::Fp8E5M2>;

__device__ __forceinline__ int64_t load_index(const core::IndexArg& index, int64_t i) {
  if (index.is_int64) return static_cast<const int64_t*>(index.data)[i * index.stride];
  return static_cast<const int32_t*>(index.data)[i * index.stride];
}

__device__ __forceinline__ void count_error(int32_t* error_counts, ErrorCounter counter) {
  if (error_counts != nullptr) atomicAdd(error_counts + counter, 1);
}

// positions[t] clamped into [0, max_pos); counted in `error_counts` (may be null) when clamped.
__device__ __forceinline__ int64_t clamped_position(const core::IndexArg& positions,
                                                    int64_t max_pos, int64_t t,
                                                    int32_t* error_counts) {
  const int64_t pos = load_index(positions, t);
  if (pos >= 0 && pos < max_pos) return pos;
  count_error(error_counts, kBadPosition);
  return pos < 0 ? 0 : max_pos - 1;
}

// Entry `col` of table row `pos` as float (fp32, bf16 or fp16 table).
__device__ __forceinline__ float load_table(const core::RopeTableArg& rope, int64_t pos,
                                            int64_t col) {
  const int64_t i = pos * rope.stride_pos + col;
  switch (rope.dtype) {
    case DType::kBFloat16:
      return num::to_float(static_cast<const num::Bf16*>(rope.data)[i]);
    case DType::kFloat16:
      return num::to_float(static_cast<const num::Half*>(rope.data)[i]);
    default:
      return static_cast<const float*>(rope.data)[i];
  }
}

// Pair p of a rope row: GPT-J (2p, 2p + 1), NeoX (p, p + half).
__device__ __forceinline__ int64_t pair_first(bool neox, int64_t p) { return neox ? p : 2 * p; }
__device__ __forceinline__ int64_t pair_second(bool neox, int64_t p, int64_t half) {
  return neox ? p + half : 2 * p + 1;
}

// RoPE of one pair of model-dtype values, rounded once to the model dtype.
template <typename T>
__device__ __forceinline__ Pair<T> rotate_pair(const Pair<T>& v, float c, float s) {
  float x, y;
  num::rope_rotate(num::to_float(v.x), num::to_float(v.y), c, s, x, y);
  return Pair<T>{num::from_float<T>(x), num::from_float<T>(y)};
}

// Two floats as fp8 (OCP e4m3 / e5m2) with the bits of num::from_float<Fp8>: saturating to
// +-max (inf included), round-to-nearest-even, NaN -> 0x7f. On sm_89+ by the hardware conversion:
// the input is first clamped to [-max, max], which the software rule maps to the same byte as the
// unclamped value (every |x| >= max gives +-max) and which the conversion then rounds exactly
// (round-to-nearest-even of an in-range value, subnormals and signed zeros included); NaN is set
// to 0x7f from the input afterwards (fmaxf/fminf turn it into +-max, and the hardware's NaN byte
// may carry the sign). src/cuda/rmsnorm_quant_kernel.cuh (rmsq::e4m3x4) relies on the same
// conversion with the NaN byte fixed instead.
template <typename Fp8>
__device__ __forceinline__ void fp8x2_from_float(float a, float b, Fp8& ra, Fp8& rb) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  constexpr bool kE4M3 = std::is_same_v<Fp8, num::Fp8E4M3>;
  constexpr float kMax = kE4M3 ? num::kE4M3Max : num::kE5M2Max;
  const float ca = fminf(fmaxf(a, -kMax), kMax);
  const float cb = fminf(fmaxf(b, -kMax), kMax);
  uint16_t w;  // low byte: a
  if constexpr (kE4M3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(w) : "f"(cb), "f"(ca));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(w) : "f"(cb), "f"(ca));
  }
  ra.bits = a != a ? uint8_t{0x7f} : static_cast<uint8_t>(w & 0xffu);
  rb.bits = b != b ? uint8_t{0x7f} : static_cast<uint8_t>(w >> 8);
#else
  ra = num::from_float<Fp8>(a);
  rb = num::from_float<Fp8>(b);
#endif
}

// A model-dtype value stored as Dst: the same bits when Dst is the model type, a rounding
// conversion to another float type, or an fp8 quantization by `scale` (cvt(x / scale)).
template <typename Dst, typename T>
__device__ __forceinline__ Dst encode(T m, float scale) {
  if constexpr (std::is_same_v<Dst, T>) {
    return m;
  } else if constexpr (kIsFp8<Dst>) {
    return num::quantize<Dst>(num::to_float(m), scale);
  } else {
    return num::from_float<Dst>(num::to_float(m));
  }
}

// The fp8 forms are num::quantize's cvt(div_rn(x, scale)) with the conversion two at a time.
template <typename Dst, typename T>
__device__ __forceinline__ Chunk<Dst> encode_chunk(const Chunk<T>& m, float scale) {
  Chunk<Dst> out;
  if constexpr (kIsFp8<Dst> && !std::is_same_v<Dst, T>) {
#pragma unroll
    for (int e = 0; e < kChunkElems; e += 2) {
      fp8x2_from_float(num::div_rn(num::to_float(m.v[e]), scale),
                       num::div_rn(num::to_float(m.v[e + 1]), scale), out.v[e], out.v[e + 1]);
    }
  } else {
#pragma unroll
    for (int e = 0; e < kChunkElems; ++e) out.v[e] = encode<Dst>(m.v[e], scale);
  }
  return out;
}

template <typename Dst, typename T>
__device__ __forceinline__ Pair<Dst> encode_pair(const Pair<T>& m, float scale) {
  if constexpr (kIsFp8<Dst> && !std::is_same_v<Dst, T>) {
    Pair<Dst> out;
    fp8x2_from_float(num::div_rn(num::to_float(m.x), scale), num::div_rn(num::to_float(m.y), scale),
                     out.x, out.y);
    return out;
  } else {
    return Pair<Dst>{encode<Dst>(m.x, scale), encode<Dst>(m.y, scale)};
  }
}

// Element types of a cache format's latent and rope parts.
template <CacheFormat kFormat>
struct CacheTraits;
template <>
struct CacheTraits<CacheFormat::kBFloat16> {
  using Latent = num::Bf16;
  using Rope = num::Bf16;
};
template <>
struct CacheTraits<CacheFormat::kFloat16> {
  using Latent = num::Half;
  using Rope = num::Half;
};
template <>
struct CacheTraits<CacheFormat::kFloat32> {
  using Latent = float;
  using Rope = float;
};
template <>
struct CacheTraits<CacheFormat::kFloat8E4M3> {
  using Latent = num::Fp8E4M3;
  using Rope = num::Fp8E4M3;
};
template <>
struct CacheTraits<CacheFormat::kFloat8E5M2> {
  using Latent = num::Fp8E5M2;
  using Rope = num::Fp8E5M2;
};
template <>
struct CacheTraits<CacheFormat::kFloat8DsMla> {
  using Latent = num::Fp8E4M3;
  using Rope = num::Bf16;
};

// Byte offset of the rope part inside a combined entry.
template <CacheFormat kFormat>
__device__ __forceinline__ int64_t rope_offset_bytes(int64_t L) {
  if constexpr (kFormat == CacheFormat::kFloat8DsMla) {
    return kDsMlaLatentDim + kDsMlaNumTiles * static_cast<int64_t>(sizeof(float));
  } else {
    return L * static_cast<int64_t>(sizeof(typename CacheTraits<kFormat>::Latent));
  }
}

struct EntryPtrs {
  uint8_t* latent;
  uint8_t* rope;
};

// Cache entry of (block, offset): the rope part follows the latent part unless the layout is split.
template <CacheFormat kFormat>
__device__ __forceinline__ EntryPtrs cache_entry_at(const core::CacheArg& cache, int64_t block,
                                                    int64_t offset, int64_t L) {
  uint8_t* latent =
      cache.data + block * cache.stride_block_bytes + offset * cache.stride_token_bytes;
  uint8_t* rope = cache.rope_data != nullptr
                      ? cache.rope_data + block * cache.stride_rope_block_bytes +
                            offset * cache.stride_rope_token_bytes
                      : latent + rope_offset_bytes<kFormat>(L);
  return {latent, rope};
}

// Max over the `width` lanes of an aligned lane group (width a power of two <= 32), by xor
// shuffles. The inputs are non-negative and never NaN (num::amax_update skips NaN), so max is
// exact and order-free: every lane of the group ends with the same value.
__device__ __forceinline__ float group_max(float v, int width) {
  for (int offset = width / 2; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(kFullMask, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

// The CPU backend's sum of squares: partial sum k < 16 adds x[i]^2 for i = k, k + 16, ... in order,
// then partial k += partial k + w for w = 8, 4, 2, 1. `row` (per-warp shared memory) holds elements
// [i_begin, i_end) at row[i - i_begin]; i_begin is a multiple of 16 and `acc` is the running
// partial sum of this lane (lanes >= 16 keep 0). All lanes call it.
template <typename T>
__device__ __forceinline__ float accumulate_squares(const T* row, int64_t i_begin, int64_t i_end,
                                                    float acc, int lane) {
  __syncwarp();
  if (lane < kSumLanes) {
    for (int64_t i = i_begin + lane; i < i_end; i += kSumLanes) {
      const float v = num::to_float(row[i - i_begin]);
      acc = num::add_rn(acc, num::mul_rn(v, v));
    }
  }
  __syncwarp();
  return acc;
}

// Combines the 16 partial sums (lane k holds partial k) pairwise as the CPU does; the total is
// returned on every lane.
__device__ __forceinline__ float combine_partial_sums(float acc, int lane) {
#pragma unroll
  for (int width = kSumLanes / 2; width > 0; width /= 2) {
    const float other = __shfl_down_sync(kFullMask, acc, width);
    if (lane < width) acc = num::add_rn(acc, other);
  }
  return __shfl_sync(kFullMask, acc, 0);
}

}  // namespace cuda
}  // namespace mlakv
