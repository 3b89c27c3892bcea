// mlakv CUDA backend: the one vectorized access helper.
//
// Every row the kernels stream is cut into chunks of kChunkElems = 8 consecutive elements, whatever
// the element type, so that a chunk index means the same values for every dtype (an fp8_ds_mla tile
// of 128 values is always 16 chunks, a bf16 row chunk is 16 bytes, an fp32 chunk 32 bytes, an fp8
// chunk 8 bytes). A chunk is moved with 16-byte (or 8-byte, for 1-byte types) accesses when kVec,
// else element by element.
//
// kVec is decided on the host (cuda_utils.h VecCheck): every base pointer 16-byte aligned and every
// stride a multiple of 16 bytes. Chunk k of a row starts k * 8 * sizeof(T) bytes into it, so it is
// then aligned to min(16, sizeof(Chunk<T>)). Without kVec only the element alignment the validator
// guarantees is assumed.
//
// Pair<T> is the two elements of one RoPE rotation; with kVec and adjacent elements (GPT-J) it is
// one 2 * sizeof(T) access (pair p starts at element 2p of a 16-byte aligned row).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/numerics.h"

namespace mlakv {
namespace cuda {

constexpr int kChunkElems = 8;

template <typename T>
struct alignas(sizeof(T) * kChunkElems >= 16 ? 16 : sizeof(T) * kChunkElems) Chunk {
  T v[kChunkElems];
};

template <typename T>
struct alignas(2 * sizeof(T)) Pair {
  T x;
  T y;
};

namespace detail {
// The access word of a chunk: 16 bytes, or 8 for chunks of 1-byte types.
template <typename T>
using ChunkWord = std::conditional_t<(sizeof(Chunk<T>) >= 16), uint4, uint2>;
template <typename T>
constexpr int kChunkWords = static_cast<int>(sizeof(Chunk<T>) / sizeof(ChunkWord<T>));

template <typename T>
struct ChunkWords {
  ChunkWord<T> w[kChunkWords<T>];
};
template <typename T>
union ChunkBits {
  ChunkWord<T> w[kChunkWords<T>];
  Chunk<T> c;
};
// The access word of a pair (one access for adjacent elements with kVec).
template <typename T>
using PairWord = std::conditional_t<sizeof(T) == 4, uint2,
                                    std::conditional_t<sizeof(T) == 2, uint32_t, uint16_t>>;
template <typename T>
struct PairWords {
  PairWord<T> w;
};
template <typename T>
union PairBits {
  PairWord<T> w;
  Pair<T> p;
};
}  // namespace detail

// A chunk whose load is issued but not yet split into elements: with kVec its access words as
// loaded, else its elements (each loaded into its own register, nothing to split). A loop that
// loads chunks under a per-lane guard (`if (k < chunks)`) keeps them in this form and splits them
// after the loop: a 16-bit chunk split inside its guard is waited for there (ptxas puts the
// splitting moves in the guarded block), so the loop's loads would go out one round trip after
// another instead of together.
template <bool kVec, typename T>
using ChunkInFlight = std::conditional_t<kVec, detail::ChunkWords<T>, Chunk<T>>;

// Issues the loads of elements [0, n) of a chunk (n == kChunkElems whenever kVec); without kVec
// the rest are zero bits.
template <bool kVec, typename T>
__device__ __forceinline__ ChunkInFlight<kVec, T> start_load_chunk(const T* src, int n) {
  if constexpr (kVec) {
    detail::ChunkWords<T> r;
    const auto* words = reinterpret_cast<const detail::ChunkWord<T>*>(src);
#pragma unroll
    for (int i = 0; i < detail::kChunkWords<T>; ++i) r.w[i] = words[i];
    return r;
  } else {
    Chunk<T> c;
#pragma unroll
    for (int e = 0; e < kChunkElems; ++e) c.v[e] = e < n ? src[e] : T{};
    return c;
  }
}

// The elements of a chunk whose loads start_load_chunk issued (waits for them).
template <bool kVec, typename T>
__device__ __forceinline__ Chunk<T> finish_load_chunk(const ChunkInFlight<kVec, T>& in) {
  if constexpr (kVec) {
    detail::ChunkBits<T> u;
#pragma unroll
    for (int i = 0; i < detail::kChunkWords<T>; ++i) u.w[i] = in.w[i];
    return u.c;
  } else {
    return in;
  }
}

// Loads elements [0, n) of a chunk (n == kChunkElems whenever kVec); the rest are zero bits.
template <bool kVec, typename T>
__device__ __forceinline__ Chunk<T> load_chunk(const T* src, int n) {
  return finish_load_chunk<kVec, T>(start_load_chunk<kVec>(src, n));
}

// Stores elements [0, n) of a chunk (n == kChunkElems whenever kVec).
template <bool kVec, typename T>
__device__ __forceinline__ void store_chunk(T* dst, const Chunk<T>& c, int n) {
  if constexpr (kVec) {
    detail::ChunkBits<T> u;
    u.c = c;
    auto* words = reinterpret_cast<detail::ChunkWord<T>*>(dst);
#pragma unroll
    for (int i = 0; i < detail::kChunkWords<T>; ++i) words[i] = u.w[i];
  } else {
#pragma unroll
    for (int e = 0; e < kChunkElems; ++e) {
      if (e < n) dst[e] = c.v[e];
    }
  }
}

// A pair whose loads are issued but not yet split (as ChunkInFlight). kOneAccess (kVec and
// adjacent elements, GPT-J): its one access word, split by finish_load_pair; else its two
// elements, each loaded into its own register (nothing to split). A loop over several pairs picks
// the form at compile time: one form for both would have to pack two separate elements into the
// word inside their guard, waiting for them there.
template <bool kOneAccess, typename T>
using PairInFlight = std::conditional_t<kOneAccess, detail::PairWords<T>, Pair<T>>;

// Issues the loads of the pair (row[first], row[second]); kOneAccess needs second == first + 1,
// first even and kVec's alignment.
template <bool kOneAccess, typename T>
__device__ __forceinline__ PairInFlight<kOneAccess, T> start_load_pair(const T* row, int64_t first,
                                                                       int64_t second) {
  if constexpr (kOneAccess) {
    return detail::PairWords<T>{*reinterpret_cast<const detail::PairWord<T>*>(row + first)};
  } else {
    return Pair<T>{row[first], row[second]};
  }
}

// The pair whose loads start_load_pair issued (waits for them).
template <bool kOneAccess, typename T>
__device__ __forceinline__ Pair<T> finish_load_pair(const PairInFlight<kOneAccess, T>& in) {
  if constexpr (kOneAccess) {
    detail::PairBits<T> u;
    u.w = in.w;
    return u.p;
  } else {
    return in;
  }
}

// Calls f with the pair form of a loop over several pairs, as a std::integral_constant<bool, ...>
// tag: one access (kOneAccess) for GPT-J's adjacent pairs under kVec, two elements for NeoX's
// (neox: the pair's elements are half a head apart).
template <bool kVec, typename F>
__device__ __forceinline__ void with_pair_form(bool neox, F&& f) {
  if (neox) {
    f(std::false_type{});
  } else {
    f(std::integral_constant<bool, kVec>{});
  }
}

// The K item's form, one type for both layouts: with kVec, adjacent elements are one access kept
// in flight, and two separate elements are packed into the word as they arrive (waiting for them
// there; the K item waits for every load at its position's clamp right after, and holding the two
// forms apart cost the fused kernel registers it does not have).
template <bool kVec, typename T>
__device__ __forceinline__ PairInFlight<kVec, T> start_load_pair_packed(const T* row, int64_t first,
                                                                        int64_t second,
                                                                        bool adjacent) {
  if constexpr (kVec) {
    if (adjacent) return start_load_pair<true>(row, first, second);
    detail::PairBits<T> u;
    u.p = Pair<T>{row[first], row[second]};
    return detail::PairWords<T>{u.w};
  } else {
    return start_load_pair<false>(row, first, second);
  }
}

// Stores the pair at (row[first], row[second]); `adjacent` (second == first + 1, first even)
// allows one access when kVec.
template <bool kVec, typename T>
__device__ __forceinline__ void store_pair(T* row, int64_t first, int64_t second, bool adjacent,
                                           const Pair<T>& p) {
  if (kVec && adjacent) {
    *reinterpret_cast<Pair<T>*>(row + first) = p;
  } else {
    row[first] = p.x;
    row[second] = p.y;
  }
}

// Asynchronous global -> shared copy of one chunk (cp.async, 16-byte pieces), for 16-byte aligned
// chunks only; completes at cp_async_wait_all() of the issuing thread. `smem_dst` as a
// shared-space address (__cvta_generic_to_shared), for callers that step it. Streamed data
// bypasses L1 (.cg); kCached (.ca) keeps it there, for data every block of a multiprocessor
// reads again (a norm weight).
template <typename T, bool kCached = false>
__device__ __forceinline__ void copy_chunk_async(unsigned dst, const T* global_src) {
  static_assert(sizeof(Chunk<T>) % 16 == 0, "cp.async copies whole 16-byte pieces");
  const char* src = reinterpret_cast<const char*>(global_src);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(Chunk<T>) / 16); ++i) {
    if constexpr (kCached) {
      asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(dst + 16 * i),
                   "l"(src + 16 * i));
    } else {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst + 16 * i),
                   "l"(src + 16 * i));
    }
  }
}
template <typename T, bool kCached = false>
__device__ __forceinline__ void copy_chunk_async(T* smem_dst, const T* global_src) {
  copy_chunk_async<T, kCached>(static_cast<unsigned>(__cvta_generic_to_shared(smem_dst)),
                               global_src);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

}  // namespace cuda
}  // namespace mlakv
