// mlakv CUDA backend: vLLM's rotary_embedding kernel.
//
// Warp item i = (token t, tensor query|key, group of up to 8 / ppl heads), ppl = ceil(rot_dim / 64)
// pairs per lane:
//   items [t * (Gq + Gk), t * (Gq + Gk) + Gq)      query head groups of token t
//   items [.. + Gq, (t + 1) * (Gq + Gk))           key head groups of token t
//   slot s < 8 of lane l: head h0 + s / ppl, pair l + 32 * (s % ppl)
// GPT-J pair p = elements (2p, 2p + 1) of the head (one 2-element access when kVec), NeoX pair
// p = (p, p + rot_dim / 2); cos/sin column p and rot_dim / 2 + p of row positions[t]. All pair
// loads of an item are in flight together; each pair is read and written by the same lane (in
// place). Bad positions are counted once per token (by its first query group).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/cuda_utils.h"
#include "cuda/device_common.cuh"
#include "cuda/rotary_embedding.h"
#include "cuda/vec.cuh"

namespace mlakv {
namespace cuda {

constexpr int kRotaryThreads = 128;
constexpr int kRotaryWarps = kRotaryThreads / kWarpSize;
constexpr int kRotarySlots = 8;
constexpr int kRotaryMaxPairsPerLane = 4;  // rot_dim <= 256

template <typename T, bool kVec>
__global__ void __launch_bounds__(kRotaryThreads)
    rotary_embedding_kernel(const __grid_constant__ RotaryKernelParams p) {
  pdl_wait();
  pdl_launch_dependents();
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t item =
      static_cast<int64_t>(blockIdx.x) * kRotaryWarps + static_cast<int>(threadIdx.x) / kWarpSize;
  if (item >= p.num_items) return;
  const core::RotaryEmbeddingArgs& a = p.args;
  const int64_t groups = p.q_groups_per_token + p.k_groups_per_token;
  const int64_t t = item / groups;
  int64_t g0 = item - t * groups;
  const bool is_key = g0 >= p.q_groups_per_token;
  if (is_key) g0 -= p.q_groups_per_token;
  const int64_t h0 = g0 * p.heads_per_item;
  const int64_t num_heads = is_key ? a.num_k_heads : a.num_q_heads;
  T* base = static_cast<T*>(is_key ? a.key : a.query) +
            t * (is_key ? a.stride_key_token : a.stride_query_token);
  const int64_t stride_head = is_key ? a.stride_key_head : a.stride_query_head;
  const int half = static_cast<int>(a.rot_dim / 2);
  const int ppl = p.pairs_per_lane;
  const int hpi = p.heads_per_item;
  const bool neox = a.rope.style == RopeStyle::kNeox;

  const bool counts = !is_key && g0 == 0 && lane == 0;
  const int64_t pos =
      clamped_position(a.positions, a.rope.max_pos, t, counts ? p.error_counts : nullptr);
  // Every load issued before any is used (vec.cuh ChunkInFlight: split or converted inside its
  // guard, a value would be waited for there).
  uint32_t cs_in[kRotaryMaxPairsPerLane] = {};
  uint32_t sn_in[kRotaryMaxPairsPerLane] = {};
  start_load_cos_sin(a.rope, pos, half, ppl, lane, cs_in, sn_in);
  // The pairs in the form of their layout (vec.cuh PairInFlight).
  auto rotate_pairs = [&](auto one_access_tag) {
    constexpr bool kOneAccess = decltype(one_access_tag)::value;
    PairInFlight<kOneAccess, T> v_in[kRotarySlots];
#pragma unroll
    for (int s = 0; s < kRotarySlots; ++s) {
      const int g = s / ppl;
      const int pr = lane + kWarpSize * (s - g * ppl);
      if (g < hpi && h0 + g < num_heads && pr < half) {
        v_in[s] = start_load_pair<kOneAccess>(base + (h0 + g) * stride_head, pair_first(neox, pr),
                                              pair_second(neox, pr, half));
      }
    }
    float cs[kRotaryMaxPairsPerLane], sn[kRotaryMaxPairsPerLane];
    table_values(a.rope, cs_in, cs);
    table_values(a.rope, sn_in, sn);
#pragma unroll
    for (int s = 0; s < kRotarySlots; ++s) {
      const int g = s / ppl;
      const int j = s - g * ppl;
      const int pr = lane + kWarpSize * j;
      if (g < hpi && h0 + g < num_heads && pr < half) {
        float c = cs[0];
        float sv = sn[0];
#pragma unroll
        for (int q = 1; q < kRotaryMaxPairsPerLane; ++q) {
          if (j == q) {
            c = cs[q];
            sv = sn[q];
          }
        }
        store_pair<kVec>(base + (h0 + g) * stride_head, pair_first(neox, pr),
                         pair_second(neox, pr, half), !neox,
                         rotate_pair(finish_load_pair<kOneAccess, T>(v_in[s]), c, sv));
      }
    }
  };
  with_pair_form<kVec>(neox, rotate_pairs);
}

template <typename T, bool kVec>
void launch_rotary_embedding_kernel(const RotaryKernelParams& params, const Launch& launch) {
  if (params.num_items <= 0) return;
  const int64_t grid = (params.num_items + kRotaryWarps - 1) / kRotaryWarps;
  MLAKV_CHECK(grid <= 0x7fffffff, "rotary_embedding: ", params.num_items,
              " work items exceed one launch");
  launch_kernel("rotary_embedding_kernel", rotary_embedding_kernel<T, kVec>,
                static_cast<unsigned>(grid), kRotaryThreads, 0, launch, params);
}

}  // namespace cuda
}  // namespace mlakv
