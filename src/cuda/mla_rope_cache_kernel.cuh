// mlakv CUDA backend: the fused MLA RoPE + KV-cache kernel (one launch for the K side, the decode Q
// side and the prefill Q side of a mixed batch).
//
// Work is a flat list of warp items; block b's warp w takes item b * 4 + w (one item per warp, no
// grid-stride loop: such a loop keeps the invariants of every item kind live at once, which tripled
// the register count):
//
//   [0, K)                     K item, one token t = i (K = T), or two tokens t = 2i, 2i + 1
//                                (K = ceil(T / 2), kKTokens: large launches of narrow shapes,
//                                mla_rope_cache.h kKTwoTokensMinTokens), each held by the whole
//                                warp as below, the loads of both in flight together:
//                                lane l holds kv_c chunks k = l, l + 32, ... (8 elements each):
//                                  kv_c[t] |c0 c1 ... c31|c32 ... c63|   (L = 512: 2 per lane)
//                                           l0 l1 ... l31 l0  ... l31
//                                and k_pe pairs p = l, l + 32, ... (R = 64: one pair per lane).
//                                RMSNorm: the squares' pairwise tree (chunks of 8 in registers,
//                                then xor shuffles: the CPU backend's order); the weight goes
//                                global -> shared by cp.async, in flight with the row loads.
//                                fp8_ds_mla: the 16 lanes holding one 128-value tile reduce its
//                                amax by xor shuffles.
//                                Cache entry (combined layout, bytes):
//                                  [0, L*c) latent | [L*c, (L+R)*c) rope            raw / fp8
//                                  [0,512) e4m3 | [512,528) 4 fp32 scales | [528,656) bf16 rope
//   [K, K + T*G)               rope item, one token t and a group of heads (G groups per token);
//                                t < Td: q_pe -> q_out[t, h, L:] (none with kRopeInCopy: the copy
//                                items do those); t >= Td: q[t, h, P:] -> in place or
//                                q_prefill_out[t, h, P:]. Two mappings (p.rope_chunked, host):
//                                chunked (GPT-J or no rotation, 16-byte path, R / 8 = cph divides
//                                32): hps = 32 / cph heads per slot, up to 8 slots (the launcher's
//                                cap) staged in the warp's shared memory; slot s of lane l holds
//                                the chunk c = l % cph (elements 8c .. 8c + 7 = pairs 4c .. 4c + 3)
//                                of head h0 + s * hps + l / cph:
//                                  R = 64 bf16: |h0 c0..c7|h1 c0..c7|h2 ..|h3 ..|  slot 0
//                                                l0 .. l7  l8 .. l15 ...          |h4 .. h7| slot 1
//                                  (32 heads an item for H >= 32: the position requested, then
//                                  4 KB by cp.async at once, then cos/sin columns 4c .. 4c + 3
//                                  read once per item, then each slot rotated and stored);
//                                otherwise (NeoX, unaligned, other R): up to 8 / ppl heads, slot
//                                s < 8 of lane l: head h0 + s / ppl, pair l + 32 * (s % ppl)
//                                (ppl = pairs per lane = ceil(R / 64)); all pair loads of the item
//                                are in flight together, in registers.
//   then decode copy items     ql_nope[t, h, :L] -> q_out[t, h, :L] (converted / quantized), rows
//                                t < Td; lane l moves chunks l, l + 32, ... of the item's rows
//                                laid end to end (L = 512 bf16, 8 slots: 64 chunks a row, 4 rows
//                                = 4 KB an item, 8 chunks a lane), all staged in the warp's shared
//                                memory by cp.async before the first is converted and stored: a
//                                pure streaming copy with 4 KB a warp in flight and few registers.
//                                kRopeInCopy (large decode launches, mla_rope_cache.h
//                                kRopeInCopyMinTokens): the item also rotates its rows' rope parts
//                                (lane l: chunk l % (R / 8) of the item's row l / (R / 8); of a
//                                row cut into segments, the first segment's lanes < R / 8), staged
//                                in the slot after the nope chunks, and the rope items leave the
//                                decode rows alone, so that each q_out row is written whole by
//                                one warp.
//   then prefill copy items    q[t, h, :P] -> q_prefill_out[t, h, :P], rows t >= Td, same mapping
//                                (rows longer than an item are cut into segments).
//
// Shared memory: kStageBytes (8 KB) per warp, 32 KB a block: a K item's RMSNorm weight, or
// the chunks a rope / copy item stages (at most 8 slots: 4 KB for 16-bit models, 8 KB for fp32;
// with kRopeInCopy a copy item's rope chunk takes one more, which the launcher leaves free).
// Each lane reads back only what it staged itself (after its own cp.async.wait_all), so the stage
// needs no barrier. Without 16-byte access (kVec false) copy items stage through registers instead
// of cp.async.
//
// Aliasing: k_pe_out may be k_pe, kv_c_out may be kv_c, q_out's rope part may be q_pe,
// q_prefill_out may be q: each element is read and written by the same lane (in both rope
// mappings), all reads before the writes. Td from the device is read by every warp (never on the
// host), clamped to [0, T]; block 0 counts.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/numerics.h"
#include "cuda/cuda_utils.h"
#include "cuda/device_common.cuh"
#include "cuda/mla_rope_cache.h"
#include "cuda/vec.cuh"

namespace mlakv {
namespace cuda {

constexpr int kMlaThreads = 128;
constexpr int kMlaWarps = kMlaThreads / kWarpSize;
constexpr int kMaxLatent = 1024;  // DESIGN.md: L <= 1024
constexpr int kMaxLatentChunksPerLane = kMaxLatent / kChunkElems / kWarpSize;  // 4
constexpr int kMaxRopePairsPerLane = 256 / 2 / kWarpSize;                      // R <= 256: 4
constexpr int kRopeSlots = 8;
// A narrow K item (mla_rope_cache.h kKNarrowMaxLatent) holds a token in half of a lane's chunk
// and pair registers: 2 chunks and 2 pairs.
constexpr int kNarrowLatentChunksPerLane = kKNarrowMaxLatent / kChunkElems / kWarpSize;  // 2
constexpr int kNarrowRopePairsPerLane = kKNarrowMaxRope / 2 / kWarpSize;                 // 2
static_assert(2 * kNarrowLatentChunksPerLane == kMaxLatentChunksPerLane &&
                  2 * kNarrowRopePairsPerLane == kMaxRopePairsPerLane,
              "two narrow tokens take a lane's registers for one token of the widest shape");
// Chunks a lane stages in its warp's kStageBytes (bf16 / fp16: 16, fp32: 8).
template <typename T>
constexpr int kStageSlots = kStageBytes / kWarpSize / static_cast<int>(sizeof(Chunk<T>));
// The K item's RMSNorm weight (kMaxLatent values, fp32 at the widest) at the start of the stage.
static_assert(kStageBytes >= kMaxLatent * static_cast<int>(sizeof(float)),
              "the K item's RMSNorm weight fits in the stage");

namespace mla_detail {

// a[j] for a run-time j < 4 without dynamic register indexing.
__device__ __forceinline__ float pick(const float (&a)[kMaxRopePairsPerLane], int j) {
  float r = a[0];
#pragma unroll
  for (int i = 1; i < kMaxRopePairsPerLane; ++i) {
    if (j == i) r = a[i];
  }
  return r;
}

// K item of kKTokens (1 or 2) tokens t0, t0 + 1 (those below T): each token is held by the whole
// warp exactly as one token is, with every load of both tokens issued before the first is used, so
// that a warp has twice the bytes in flight behind the same chain of round trips. kKNarrow: a
// narrow shape's registers, L <= 512 (2 chunks a lane a token) and R <= 128 (2 pairs); two tokens
// are narrow (the launcher takes them only there, mla_rope_cache.h kKTwoTokensMinTokens).
template <typename T, CacheFormat kFormat, bool kVec, int kKTokens, bool kKTableFirst,
          bool kKNarrow>
__device__ __forceinline__ void k_side_item(const MlaRopeCacheKernelParams& p, int64_t t0, int lane,
                                            T* w_smem, float cache_scale) {
  static_assert(kKTokens == 1 || kKTokens == 2, "a K item holds one or two tokens");
  static_assert(kKTokens == 1 || kKNarrow, "two tokens a K item hold a narrow shape's registers");
  // w_smem: the warp's stage, where the RMSNorm weight row lands.
  using Latent = typename CacheTraits<kFormat>::Latent;
  using RopeT = typename CacheTraits<kFormat>::Rope;
  // A lane's chunks and rope pairs of one token.
  constexpr int kChunks = kKNarrow ? kNarrowLatentChunksPerLane : kMaxLatentChunksPerLane;
  constexpr int kPairs = kKNarrow ? kNarrowRopePairsPerLane : kMaxRopePairsPerLane;
  const core::MlaRopeCacheArgs& a = p.args;
  const int64_t L = a.kv_lora_rank;
  const int half = static_cast<int>(a.rope_dim / 2);
  const int cpr = static_cast<int>(L / kChunkElems);
  const bool has_norm = a.kv_norm_weight != nullptr;
  const bool neox = p.apply_rope && a.rope.style == RopeStyle::kNeox;
  // The item's tokens below T (warp-uniform): the first always; a second past the launch (T odd)
  // loads, writes and counts nothing.
  bool live[kKTokens];
#pragma unroll
  for (int u = 0; u < kKTokens; ++u) live[u] = u == 0 || t0 + u < a.num_tokens;

  // Every input of the tokens is requested before the first use: the slot, then the position
  // (ahead of the rows: it heads the item's longest chain, position -> cos/sin -> cache entry),
  // then the rows. The position is clamped (and counted, which keeps the compiler from hoisting
  // later loads above the test) and the cos/sin entries requested after the rows, so that the
  // position's round trip overlaps the rows'; with kKTableFirst (large launches of narrow shapes,
  // mla_rope_cache.h kKTableFirstMinTokens) before them, so that the rows wait behind the position.
  int64_t slot[kKTokens], raw_pos[kKTokens];
#pragma unroll
  for (int u = 0; u < kKTokens; ++u) {
    slot[u] = live[u] ? load_index(a.slot_mapping, t0 + u) : -1;
    raw_pos[u] = live[u] && p.apply_rope ? load_index(a.positions, t0 + u) : 0;
  }
  uint32_t cs_in[kKTokens][kPairs] = {};
  uint32_t sn_in[kKTokens][kPairs] = {};
  auto request_tables = [&] {
#pragma unroll
    for (int u = 0; u < kKTokens; ++u) {
      if (!live[u]) continue;
      const int64_t pos =
          clamp_position(raw_pos[u], a.rope.max_pos, lane == 0 ? p.error_counts : nullptr);
      start_load_cos_sin(a.rope, pos, half, kPairs, lane, cs_in[u], sn_in[u]);
    }
  };
  if (kKTableFirst && p.apply_rope) request_tables();
  const T* weight = static_cast<const T*>(a.kv_norm_weight);
  // The rows stay in flight (vec.cuh ChunkInFlight) until every load of the item is issued.
  ChunkInFlight<kVec, T> x_in[kKTokens][kChunks];
#pragma unroll
  for (int u = 0; u < kKTokens; ++u) {
    const T* kv_c = static_cast<const T*>(a.kv_c) + (t0 + u) * a.stride_kv_c_token;
#pragma unroll
    for (int s = 0; s < kChunks; ++s) {
      const int k = lane + kWarpSize * s;
      if (live[u] && k < cpr) {
        x_in[u][s] = start_load_chunk<kVec>(kv_c + k * kChunkElems, kChunkElems);
        // The weight goes straight to shared memory (no registers held while the loads fly),
        // once for the item's tokens.
        if (kVec && has_norm && u == 0) {
          copy_chunk_async<T, /*kCached=*/true>(w_smem + k * kChunkElems, weight + k * kChunkElems);
        }
      }
    }
  }
  if (kVec && has_norm) cp_async_commit();
  PairInFlight<kVec, T> r_in[kKTokens][kPairs];
#pragma unroll
  for (int u = 0; u < kKTokens; ++u) {
    const T* k_pe = static_cast<const T*>(a.k_pe) + (t0 + u) * a.stride_k_pe_token;
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      const int pr = lane + kWarpSize * j;
      if (live[u] && pr < half) {
        r_in[u][j] = start_load_pair_packed<kVec>(k_pe, pair_first(neox, pr),
                                                  pair_second(neox, pr, half), !neox);
      }
    }
  }
  if (!kKTableFirst && p.apply_rope) request_tables();

  // After the loads are in flight: the scale's divisor (fp8 caches; unused and dropped otherwise).
  const Divisor cache_div = make_divisor(cache_scale);
  // Each token in turn: its latent (normalized, quantized, stored) and its rope pairs (rotated,
  // stored). A narrow item of one token does the latent first, while its cos/sin entries may still
  // be in flight (in the rows-first order of small launches they are its last round trip: position
  // -> table); the rope first put the latent's work (a divide and a convert per element for fp8
  // caches, the tile maxima for fp8_ds_mla) behind the table's arrival, on the launch's longest
  // chain at small T. In table-first launches the order was not measured apart: they are large,
  // and bytes-bound.
#pragma unroll
  for (int u = 0; u < kKTokens; ++u) {
    if (!live[u]) continue;
    const int64_t t = t0 + u;
    // The slot is the same on every lane: the whole warp skips or writes the entry together.
    const bool to_cache = slot[u] >= 0 && slot[u] < a.cache.num_slots;
    if (slot[u] >= a.cache.num_slots && lane == 0) count_error(p.error_counts, kBadSlot);
    EntryPtrs entry{};
    if (to_cache) {
      const int64_t block = slot[u] / a.cache.block_size;
      entry = cache_entry_at<kFormat>(a.cache, block, slot[u] - block * a.cache.block_size, L);
    }

    // The latent: normalized, written to kv_c_out, quantized into the entry.
    auto latent_part = [&] {
      Chunk<T> x[kChunks];
#pragma unroll
      for (int s = 0; s < kChunks; ++s) {
        if (lane + kWarpSize * s < cpr) x[s] = finish_load_chunk<kVec, T>(x_in[u][s]);
      }
      if (has_norm) {
        // The pairwise tree of the row's squares (device_common.cuh): slot s holds chunks 32s ..
        // 32s + 31, one subtree of 256 elements; chunks past the row enter as +0.
        float part[kChunks];
#pragma unroll
        for (int s = 0; s < kChunks; ++s) {
          part[s] = lane + kWarpSize * s < cpr ? chunk_square_sum(x[s]) : 0.0f;
        }
        const float inv_rms = num::rms_inv(warp_slots_sum(part), L, a.kv_norm_eps);
        if (kVec) cp_async_wait_all();  // this lane's own weight chunks have landed
#pragma unroll
        for (int s = 0; s < kChunks; ++s) {
          const int k = lane + kWarpSize * s;
          if (k < cpr) {
            const Chunk<T> w = kVec ? *reinterpret_cast<const Chunk<T>*>(w_smem + k * kChunkElems)
                                    : load_chunk<kVec>(weight + k * kChunkElems, kChunkElems);
#pragma unroll
            for (int e = 0; e < kChunkElems; ++e) {
              x[s].v[e] = num::from_float<T>(
                  num::rms_apply(num::to_float(x[s].v[e]), inv_rms, num::to_float(w.v[e])));
            }
          }
        }
      }
      if (a.kv_c_out != nullptr) {
        T* out = static_cast<T*>(a.kv_c_out) + t * a.stride_kv_c_out_token;
#pragma unroll
        for (int s = 0; s < kChunks; ++s) {
          const int k = lane + kWarpSize * s;
          if (k < cpr) store_chunk<kVec>(out + k * kChunkElems, x[s], kChunkElems);
        }
      }
      if (to_cache) {
        Latent* latent = reinterpret_cast<Latent*>(entry.latent);
        if constexpr (kFormat == CacheFormat::kFloat8DsMla) {
          constexpr int kLanesPerTile = static_cast<int>(kDsMlaTileElems / kChunkElems);  // 16
#pragma unroll
          for (int s = 0; s < kChunks; ++s) {
            // L = 512 (validated): 64 chunks, so s = 0, 1 hold a chunk on every lane and the
            // shuffles see the full warp; tile k / 16 is held by an aligned group of 16 lanes.
            if (kWarpSize * s < cpr) {
              const int k = lane + kWarpSize * s;
              float amax = 0.0f;
#pragma unroll
              for (int e = 0; e < kChunkElems; ++e)
                amax = num::amax_update(amax, num::to_float(x[s].v[e]));
              amax = group_max(amax, kLanesPerTile);
              const float scale = num::ds_mla_tile_scale(amax, a.cache.ds_mla_pow2_scale);
              store_chunk<kVec>(latent + k * kChunkElems,
                                encode_chunk_each<Latent>(x[s], make_divisor(scale)), kChunkElems);
              if (k % kLanesPerTile == 0) {
                reinterpret_cast<float*>(entry.latent + kDsMlaLatentDim)[k / kLanesPerTile] = scale;
              }
            }
          }
        } else {
#pragma unroll
          for (int s = 0; s < kChunks; ++s) {
            const int k = lane + kWarpSize * s;
            if (k < cpr) {
              store_chunk<kVec>(latent + k * kChunkElems, encode_chunk<Latent>(x[s], cache_div),
                                kChunkElems);
            }
          }
        }
      }
    };
    // The rope pair: rotated, written to k_pe_out and into the entry.
    auto rope_part = [&] {
      Pair<T> r[kPairs];
#pragma unroll
      for (int j = 0; j < kPairs; ++j) {
        if (lane + kWarpSize * j < half) r[j] = finish_load_pair<kVec, T>(r_in[u][j]);
      }
      if (p.apply_rope) {
        float cs[kPairs], sn[kPairs];
        table_values(a.rope, cs_in[u], cs);
        table_values(a.rope, sn_in[u], sn);
#pragma unroll
        for (int j = 0; j < kPairs; ++j) {
          if (lane + kWarpSize * j < half) r[j] = rotate_pair(r[j], cs[j], sn[j]);
        }
      }
      if (a.k_pe_out != nullptr) {
        T* out = static_cast<T*>(a.k_pe_out) + t * a.stride_k_pe_out_token;
#pragma unroll
        for (int j = 0; j < kPairs; ++j) {
          const int pr = lane + kWarpSize * j;
          if (pr < half) {
            store_pair<kVec>(out, pair_first(neox, pr), pair_second(neox, pr, half), !neox, r[j]);
          }
        }
      }
      if (to_cache) {
        RopeT* rope = reinterpret_cast<RopeT*>(entry.rope);
#pragma unroll
        for (int j = 0; j < kPairs; ++j) {
          const int pr = lane + kWarpSize * j;
          if (pr < half) {
            store_pair<kVec>(rope, pair_first(neox, pr), pair_second(neox, pr, half), !neox,
                             encode_pair<RopeT>(r[j], cache_div));
          }
        }
      }
    };
    if constexpr (kKTokens == 1 && kKNarrow) {
      latent_part();
      rope_part();
    } else {
      // Two tokens and the widest shapes: the rope first, for registers. The latent first spilled
      // the fp8 caches' two-token instances and the fp8 q_out's widest ones at 80 registers
      // (ptxas, sm_90a), and a spilled in-flight load stalls the item until it arrives.
      rope_part();
      latent_part();
    }
  }
}

// Where rope item i works: token t, heads [h0, h0 + rope_heads_per_item), the decode side
// (q_pe -> q_out[.., L:]) when t < Td (which kRopeInCopy leaves to the copy items), else the
// prefill side (q[.., P:] in place or into q_prefill_out[.., P:]). Shared by both rope mappings.
struct RopeItemPlace {
  int64_t t = 0;
  int64_t h0 = 0;
  bool decode = false;
};

__device__ __forceinline__ RopeItemPlace rope_item_place(const MlaRopeCacheKernelParams& p,
                                                         int64_t i, int64_t td) {
  RopeItemPlace r;
  // A FastDiv (the launcher keeps the item count below 2^31): a run-time division is ~20
  // dependent instructions at the head of every item's chain.
  const uint32_t item = static_cast<uint32_t>(i);
  const uint32_t group = p.rope_group_div.div(item);
  r.t = p.rope_token_begin + group;
  r.h0 = static_cast<int64_t>(item - group * p.rope_group_div.divisor) * p.rope_heads_per_item;
  r.decode = r.t < td;
  return r;
}

// The rope part of row (t, h) this item reads, and the one it writes (as Out: QOut on the decode
// side, T on the prefill side).
template <typename T>
__device__ __forceinline__ const T* rope_src(const core::MlaRopeCacheArgs& a, bool decode,
                                             int64_t t, int64_t h) {
  return decode
             ? static_cast<const T*>(a.q_pe) + t * a.stride_q_pe_token + h * a.stride_q_pe_head
             : static_cast<const T*>(a.q) + t * a.stride_q_token + h * a.stride_q_head + a.nope_dim;
}

template <typename Out>
__device__ __forceinline__ Out* rope_dst(const core::MlaRopeCacheArgs& a, bool decode, int64_t t,
                                         int64_t h) {
  if (decode) {
    return static_cast<Out*>(a.q_out) + t * a.stride_q_out_token + h * a.stride_q_out_head +
           a.kv_lora_rank;
  }
  return a.q_prefill_out != nullptr
             ? static_cast<Out*>(a.q_prefill_out) + t * a.stride_q_prefill_out_token +
                   h * a.stride_q_prefill_out_head + a.nope_dim
             : static_cast<Out*>(a.q) + t * a.stride_q_token + h * a.stride_q_head + a.nope_dim;
}

// Rope item i: token t, heads [h0, h0 + heads_per_item).
template <typename T, typename QOut, bool kVec>
__device__ __forceinline__ void rope_item(const MlaRopeCacheKernelParams& p, int64_t i, int64_t td,
                                          float q_scale, int lane) {
  const core::MlaRopeCacheArgs& a = p.args;
  // Named members, not a structured binding: the lambda below captures them (C++17).
  const RopeItemPlace place = rope_item_place(p, i, td);
  const int64_t t = place.t, h0 = place.h0;
  const bool decode = place.decode;
  if (decode ? a.q_out == nullptr : a.q == nullptr) return;
  const int64_t H = a.num_heads;
  const int half = static_cast<int>(a.rope_dim / 2);
  const int ppl = p.rope_pairs_per_lane;
  const int hpi = p.rope_heads_per_item;
  const bool neox = p.apply_rope && a.rope.style == RopeStyle::kNeox;

  uint32_t cs_in[kMaxRopePairsPerLane] = {};
  uint32_t sn_in[kMaxRopePairsPerLane] = {};
  if (p.apply_rope) {
    // Bad positions are counted once per token, by its K item.
    const int64_t pos = clamped_position(a.positions, a.rope.max_pos, t, nullptr);
    start_load_cos_sin(a.rope, pos, half, ppl, lane, cs_in, sn_in);
  }

  // The pairs in the form of their layout (vec.cuh PairInFlight), all in flight before the first
  // is split.
  auto rotate_pairs = [&](auto one_access_tag) {
    constexpr bool kOneAccess = decltype(one_access_tag)::value;
    PairInFlight<kOneAccess, T> v_in[kRopeSlots];
#pragma unroll
    for (int s = 0; s < kRopeSlots; ++s) {
      const int g = s / ppl;
      const int64_t h = h0 + g;
      const int pr = lane + kWarpSize * (s - g * ppl);
      if (g < hpi && h < H && pr < half) {
        v_in[s] = start_load_pair<kOneAccess>(rope_src<T>(a, decode, t, h), pair_first(neox, pr),
                                              pair_second(neox, pr, half));
      }
    }
    const Divisor q_div = make_divisor(q_scale);  // fp8 q_out only
    float cs[kMaxRopePairsPerLane], sn[kMaxRopePairsPerLane];
    table_values(a.rope, cs_in, cs);
    table_values(a.rope, sn_in, sn);
#pragma unroll
    for (int s = 0; s < kRopeSlots; ++s) {
      const int g = s / ppl;
      const int j = s - g * ppl;
      const int64_t h = h0 + g;
      const int pr = lane + kWarpSize * j;
      if (g < hpi && h < H && pr < half) {
        const Pair<T> v = finish_load_pair<kOneAccess, T>(v_in[s]);
        const Pair<T> m = p.apply_rope ? rotate_pair(v, pick(cs, j), pick(sn, j)) : v;
        const int64_t first = pair_first(neox, pr);
        const int64_t second = pair_second(neox, pr, half);
        if (decode) {
          store_pair<kVec>(rope_dst<QOut>(a, true, t, h), first, second, !neox,
                           encode_pair<QOut>(m, q_div));
        } else {
          store_pair<kVec>(rope_dst<T>(a, false, t, h), first, second, !neox, m);
        }
      }
    }
  };
  with_pair_form<kVec>(neox, rotate_pairs);
}

// The cos/sin columns of chunk c of a GPT-J rope row (pairs 4c .. 4c + 3) at the position `raw_pos`
// as loaded (clamped here, uncounted: bad positions are counted once per token, by its K item),
// requested into cs_in / sn_in (table_values waits for them).
__device__ __forceinline__ void request_chunk_table(const core::RopeTableArg& rope, int64_t raw_pos,
                                                    int c, int half,
                                                    uint32_t (&cs_in)[kChunkElems / 2],
                                                    uint32_t (&sn_in)[kChunkElems / 2]) {
  constexpr int kPairs = kChunkElems / 2;
  const int64_t pos = clamp_position(raw_pos, rope.max_pos, nullptr);
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    cs_in[j] = start_load_table(rope, pos, c * kPairs + j);
    sn_in[j] = start_load_table(rope, pos, half + c * kPairs + j);
  }
}

// Rope item i of the chunked path (GPT-J or no rotation, kVec, R / 8 divides 32; decided on the
// host, p.rope_chunked): token t, heads [h0, h0 + rope_heads_per_item). The rope part of a head is
// cph = R / 8 chunks of 8 elements (4 adjacent pairs, 16 bytes of bf16); slot s < rope_chunk_slots
// of lane l holds chunk c = l % cph of head h0 + s * (32 / cph) + l / cph, so a lane's 4 pairs use
// the same cos/sin columns 4c .. 4c + 3 in every slot (read once). The position is requested
// first, then every slot at once into the warp's stage (cp.async: no registers held while they
// fly, up to 64 heads of bf16 at R = 64), then the cos/sin columns are read, then each slot is
// rotated and stored. Every element gets exactly rotate_pair / encode_pair's operations.
template <typename T, typename QOut, bool kRopeInCopy>
__device__ __forceinline__ void rope_item_chunked(const MlaRopeCacheKernelParams& p, int64_t i,
                                                  int64_t td, float q_scale, int lane,
                                                  Chunk<T>* stage) {
  const core::MlaRopeCacheArgs& a = p.args;
  // Named members, not a structured binding: the lambda below captures them (C++17).
  const RopeItemPlace place = rope_item_place(p, i, td);
  const int64_t t = place.t, h0 = place.h0;
  const bool decode = place.decode;
  // kRopeInCopy: the decode copy items rotate the decode rows (a device Td leaves such items).
  if (decode ? a.q_out == nullptr || kRopeInCopy : a.q == nullptr) return;
  const int64_t H = a.num_heads;
  const int half = static_cast<int>(a.rope_dim / 2);
  const int cph = static_cast<int>(a.rope_dim / kChunkElems);
  const int hps = kWarpSize / cph;  // heads per slot
  const int c = lane % cph;
  const int64_t e0 = static_cast<int64_t>(c) * kChunkElems;
  const int slots = p.rope_chunk_slots;
  // The position first (it heads the chain position -> cos/sin -> stores), then the rows.
  const int64_t raw_pos = p.apply_rope ? load_index(a.positions, t) : 0;

#pragma unroll
  for (int s = 0; s < kStageSlots<T>; ++s) {
    if (s >= slots) break;
    const int64_t h = h0 + s * hps + lane / cph;
    if (h < H) copy_chunk_async(stage[s * kWarpSize + lane].v, rope_src<T>(a, decode, t, h) + e0);
  }
  cp_async_commit();
  constexpr int kPairs = kChunkElems / 2;
  uint32_t cs_in[kPairs] = {};
  uint32_t sn_in[kPairs] = {};
  if (p.apply_rope) request_chunk_table(a.rope, raw_pos, c, half, cs_in, sn_in);
  const Divisor q_div = make_divisor(q_scale);  // fp8 q_out only
  float cs[kPairs], sn[kPairs];
  table_values(a.rope, cs_in, cs);
  table_values(a.rope, sn_in, sn);
  // This lane's own chunks have landed after the wait.
  cp_async_wait_all();
  // Each slot rotated by kRound's rounding (rotate_chunk: hardware or rotate_pair's), encoded and
  // stored. The two roundings are two loops, not a test per chunk: one loop with both paths
  // needed registers beyond the kernel's budget.
  auto rotate_and_store = [&](auto round_tag) {
    constexpr ChunkRounding kRound = decltype(round_tag)::value;
#pragma unroll
    for (int s = 0; s < kStageSlots<T>; ++s) {
      if (s >= slots) break;
      const int64_t h = h0 + s * hps + lane / cph;
      if (h < H) {
        Chunk<T> m = stage[s * kWarpSize + lane];
        if (p.apply_rope) m = rotate_chunk<kRound>(m, cs, sn);
        if (decode) {
          store_chunk<true>(rope_dst<QOut>(a, true, t, h) + e0, encode_chunk<QOut>(m, q_div),
                            kChunkElems);
        } else {
          store_chunk<true>(rope_dst<T>(a, false, t, h) + e0, m, kChunkElems);
        }
      }
    }
  };
  if constexpr (kHardwareRounding<T>) {
    // The hardware rounding when this lane's chunks and cos/sin columns are all finite.
    bool finite = true;
#pragma unroll
    for (int j = 0; j < kPairs; ++j) finite &= isfinite(cs[j]) && isfinite(sn[j]);
#pragma unroll
    for (int s = 0; s < kStageSlots<T>; ++s) {
      if (s >= slots) break;
      // Only the slots this lane staged (heads h >= H were not: their stage words are stale).
      if (h0 + s * hps + lane / cph < H) finite &= chunk_finite(stage[s * kWarpSize + lane]);
    }
    if (finite) {
      rotate_and_store(std::integral_constant<ChunkRounding, ChunkRounding::kHardware>{});
      return;
    }
  }
  rotate_and_store(std::integral_constant<ChunkRounding, ChunkRounding::kPairwise>{});
}

// Stages elements [0, n) of a chunk: cp.async with kVec (n == 8, 16-byte aligned), else through
// registers.
template <bool kVec, typename T>
__device__ __forceinline__ void stage_chunk(Chunk<T>* slot, const T* src, int n) {
  if constexpr (kVec) {
    copy_chunk_async(slot->v, src);
  } else {
    *slot = load_chunk<false>(src, n);
  }
}

// Copy item i of list c (CopyList in mla_rope_cache.h: whole rows or one segment of a row) on the
// decode rows (t < Td, i.e. r < Td * H) or the prefill rows. Lane l stages the item's chunks l,
// l + 32, ... (up to c.slots of them) into the warp's stage, all in flight together, then
// converts and stores them.
template <typename T, typename Dst, bool kVec, bool kRope>
__device__ __forceinline__ void copy_item(const MlaRopeCacheKernelParams& p, const CopyList& c,
                                          int64_t i, bool decode, int64_t td, int64_t H,
                                          float scale, int lane, Chunk<T>* stage) {
  // The list's FastDivs (the launcher keeps item and row counts below 2^31; see
  // rope_item_place).
  int64_t r0 = c.row_begin + i * c.rows_per_item;
  int k0 = 0;
  if (c.segment_div.divisor > 1) {  // segments_per_row
    const uint32_t item = static_cast<uint32_t>(i);
    const uint32_t row = c.segment_div.div(item);
    r0 = c.row_begin + row;
    k0 = static_cast<int>(item - row * c.segment_div.divisor) * c.slots * kWarpSize;
  }
  const int64_t rows_left = c.row_end - r0;
  const int rows = static_cast<int>(rows_left < c.rows_per_item ? rows_left : c.rows_per_item);
  const int cpr = static_cast<int>(c.chunk_div.divisor);  // chunks_per_row
  const int64_t split = td * H;                           // first prefill row
  const int q = k0 + lane;
  const int first_rl = static_cast<int>(c.chunk_div.div(static_cast<uint32_t>(q)));
  const int first_k = q - first_rl * cpr;
  int64_t first_t, first_h;  // of row r0 + first_rl, in runs of rows_per_token rows
  {
    const uint32_t r = static_cast<uint32_t>(r0 + first_rl);
    const uint32_t tok = c.token_div.div(r);
    first_t = tok;
    first_h = r - tok * c.token_div.divisor;
  }

  // f(slot, element offset) for each chunk this lane moves: chunk q + 32 s of the item (row
  // (q + 32 s) / cpr, chunk (q + 32 s) % cpr), the offsets stepped from the first.
  // An item whose rows are all on its side (always so with a host Td) and whose lists need no
  // token jumps (rows laid out as one run: token_jump == 0, so the h loop below only changes h)
  // runs the same loop without the side test and the h bookkeeping: the same chunks and offsets.
  const bool simple =
      c.src_token_jump == 0 && c.dst_token_jump == 0 && (decode ? r0 + rows <= split : r0 >= split);

  // kRope (p.decode_rope_in_copy): the item also rotates its rows' rope parts, q_pe -> q_out[t, h,
  // L:], so that each q_out row is written whole by one warp. Lane l takes chunk l % cph of the
  // item's row l / cph (a segment item: of its row when it is the row's first segment); its
  // position is requested first (position -> cos/sin -> store is the item's longest chain), its
  // q_pe chunk staged behind the nope chunks, its cos/sin columns requested once the position
  // has arrived, and the chunk rotated and stored after the nope part.
  [[maybe_unused]] const core::MlaRopeCacheArgs& a = p.args;
  [[maybe_unused]] bool rope_lane = false;
  [[maybe_unused]] int64_t rope_t = 0, rope_h = 0, raw_pos = 0;
  [[maybe_unused]] int rope_c = 0;
  if constexpr (kRope) {
    const int cph = static_cast<int>(a.rope_dim / kChunkElems);
    const int j = lane / cph;
    rope_c = lane - j * cph;
    const int item_rows = c.segment_div.divisor > 1 ? (k0 == 0 ? 1 : 0) : rows;
    const int64_t r = r0 + j;
    if (j < item_rows && r < split) {
      rope_lane = true;
      const uint32_t tok = p.head_div.div(static_cast<uint32_t>(r));
      rope_t = tok;
      rope_h = r - int64_t{tok} * H;
      if (p.apply_rope) raw_pos = load_index(a.positions, rope_t);
    }
  }
  auto run = [&](auto simple_tag) {
    constexpr bool kSimple = decltype(simple_tag)::value;
    auto for_each_chunk = [&](int64_t stride_token, int64_t stride_head, const int64_t(&step)[2],
                              int64_t token_jump, auto&& f) {
      int rl = first_rl;
      int k = first_k;
      [[maybe_unused]] int64_t h = first_h;
      int64_t off = first_t * stride_token + first_h * stride_head + int64_t{k} * kChunkElems;
#pragma unroll 4
      for (int s = 0; s < kStageSlots<T>; ++s) {
        if (s >= c.slots || rl >= rows) break;
        if (kSimple || decode == (r0 + rl < split)) f(s, off, k);
        k += c.chunk_step;
        const bool wrapped = k >= cpr;
        if (wrapped) k -= cpr;
        const int dr = c.row_step + (wrapped ? 1 : 0);
        rl += dr;
        off += step[wrapped ? 1 : 0];
        if constexpr (!kSimple) {
          h += dr;
          const int64_t rows_per_token = c.token_div.divisor;
          while (h >= rows_per_token) {
            h -= rows_per_token;
            off += token_jump;
          }
        }
      }
    };
    auto chunk_elems = [&](int k) {
      const int64_t left = c.row_elems - int64_t{k} * kChunkElems;
      return left < kChunkElems ? static_cast<int>(left) : kChunkElems;
    };

    const T* src = static_cast<const T*>(c.src);
    for_each_chunk(c.stride_src_token, c.stride_src_head, c.src_step, c.src_token_jump,
                   [&](int s, int64_t off, int k) {
                     stage_chunk<kVec>(stage + s * kWarpSize + lane, src + off, chunk_elems(k));
                   });
    [[maybe_unused]] uint32_t cs_in[kChunkElems / 2] = {};
    [[maybe_unused]] uint32_t sn_in[kChunkElems / 2] = {};
    if constexpr (kRope) {
      if (rope_lane) {
        copy_chunk_async(stage[c.slots * kWarpSize + lane].v,
                         rope_src<T>(a, true, rope_t, rope_h) + rope_c * kChunkElems);
      }
    }
    if constexpr (kVec) cp_async_commit();
    if constexpr (kRope) {
      if (rope_lane && p.apply_rope) {
        request_chunk_table(a.rope, raw_pos, rope_c, static_cast<int>(a.rope_dim / 2), cs_in,
                            sn_in);
      }
    }
    if constexpr (kVec) cp_async_wait_all();  // this lane's own chunks have landed
    const Divisor div = make_divisor(scale);  // fp8 destinations only
    Dst* dst = static_cast<Dst*>(c.dst);
    for_each_chunk(c.stride_dst_token, c.stride_dst_head, c.dst_step, c.dst_token_jump,
                   [&](int s, int64_t off, int k) {
                     store_chunk<kVec>(dst + off,
                                       encode_chunk<Dst>(stage[s * kWarpSize + lane], div),
                                       chunk_elems(k));
                   });
    if constexpr (kRope) {
      if (rope_lane) {
        float cs[kChunkElems / 2], sn[kChunkElems / 2];
        table_values(a.rope, cs_in, cs);
        table_values(a.rope, sn_in, sn);
        Chunk<T> m = stage[c.slots * kWarpSize + lane];
        if (p.apply_rope) m = rotate_chunk_checked(m, cs, sn);
        store_chunk<true>(rope_dst<Dst>(a, true, rope_t, rope_h) + rope_c * kChunkElems,
                          encode_chunk<Dst>(m, div), kChunkElems);
      }
    }
  };
  if (simple) {
    run(std::true_type{});
  } else {
    run(std::false_type{});
  }
}

}  // namespace mla_detail

// 6 resident blocks (24 warps, <= 80 registers) for the 16-byte path of 16-bit models, which fits
// every cache format and q_out type without spilling now that the fp8 conversions are the hardware
// ones (fp8x2_from_float); the element-wise path and fp32 models take what they need.
template <typename T, CacheFormat kFormat, typename QOut, bool kVec>
constexpr int kMlaMinBlocks = kVec && sizeof(T) == 2 ? 6 : 1;
// The launcher's item sizes assume this residency (mla_rope_cache.h).
static_assert(kMlaMinBlocks<num::Bf16, CacheFormat::kBFloat16, num::Bf16, true> * kMlaWarps ==
                  kMlaResidentWarpsPerSm,
              "kMlaResidentWarpsPerSm: the resident warps of the 16-bit vector instances");

// kKTokens: the tokens of a K item (k_side_item; 2 in large launches of narrow shapes,
// mla_rope_cache.h kKTwoTokensMinTokens). kKTableFirst: the K items' order of large launches
// (k_side_item). kRopeInCopy (16-byte path, q_out of the model dtype): the decode copy items also
// rotate their rows' rope parts (p.decode_rope_in_copy, copy_item). kKNarrow: the K items'
// registers of a narrow shape (mla_rope_cache.h kKNarrowMaxLatent).
template <typename T, CacheFormat kFormat, typename QOut, bool kVec, int kKTokens,
          bool kKTableFirst, bool kRopeInCopy, bool kKNarrow>
__global__ void __launch_bounds__(kMlaThreads, (kMlaMinBlocks<T, kFormat, QOut, kVec>))
    mla_rope_cache_kernel(const __grid_constant__ MlaRopeCacheKernelParams p) {
  // Each warp's stage: its K item's RMSNorm weight, or the chunks of its rope or copy item.
  __shared__ __align__(16) unsigned char stage_bytes[kMlaWarps][kStageBytes];
  // The parameter block's fields compile to uniform constant loads, and a fresh launch's 64-byte
  // lines reach a warp one miss after another (~25-30 ns each on the H200). Without PDL each item
  // reads only the lines it uses, the dispatch's first (mla_rope_cache.h), the later ones while
  // its loads are in flight: reading every line first put ~14 misses ahead of every item's first
  // loads (0.3 us at T = 1). With PDL that read runs before the wait, behind the previous kernel.
  if (p.prefetch_params) prefetch_params(p, p.num_items <= 0);
  pdl_wait();  // the parameter block is not an input: its reads may precede the wait
  pdl_launch_dependents();
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const core::MlaRopeCacheArgs& a = p.args;

  int64_t td = a.num_decode_tokens;
  if (a.num_decode_tokens_device != nullptr) {
    const int64_t value = *a.num_decode_tokens_device;
    td = value < 0 ? 0 : (value > a.num_tokens ? a.num_tokens : value);
    // Only block 0's first thread waits for the value here; every other warp uses it late.
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      if (td != value) count_error(p.error_counts, kBadDecodeCount);
    }
  }
  float q_scale = 1.0f;
  if constexpr (kIsFp8<QOut>) {
    if (a.q_scale != nullptr) q_scale = *a.q_scale;
  }
  float cache_scale = 1.0f;
  if constexpr (kFormat == CacheFormat::kFloat8E4M3 || kFormat == CacheFormat::kFloat8E5M2) {
    if (a.cache.scale != nullptr) cache_scale = *a.cache.scale;
  }

  // One item per warp: a grid-stride loop would keep every path's loop invariants live at once.
  int64_t i = static_cast<int64_t>(blockIdx.x) * kMlaWarps + warp;
  if (i >= p.num_items) return;
  unsigned char* const my_stage = stage_bytes[warp];
  Chunk<T>* const stage = reinterpret_cast<Chunk<T>*>(my_stage);
  if (i < p.num_k_items) {
    mla_detail::k_side_item<T, kFormat, kVec, kKTokens, kKTableFirst, kKNarrow>(
        p, i * kKTokens, lane, reinterpret_cast<T*>(my_stage), cache_scale);
    return;
  }
  i -= p.num_k_items;
  if (i < p.num_rope_items) {
    if constexpr (kVec) {
      if (p.rope_chunked) {
        mla_detail::rope_item_chunked<T, QOut, kRopeInCopy>(p, i, td, q_scale, lane, stage);
        return;
      }
    }
    mla_detail::rope_item<T, QOut, kVec>(p, i, td, q_scale, lane);
    return;
  }
  i -= p.num_rope_items;
  if (i < p.decode_copy.num_items) {
    mla_detail::copy_item<T, QOut, kVec, kRopeInCopy>(p, p.decode_copy, i, true, td, a.num_heads,
                                                      q_scale, lane, stage);
    return;
  }
  i -= p.decode_copy.num_items;
  mla_detail::copy_item<T, T, kVec, false>(p, p.prefill_copy, i, false, td, a.num_heads, 1.0f, lane,
                                           stage);
}

template <typename T, CacheFormat kFormat, typename QOut, bool kVec>
void launch_mla_rope_cache_kernel(const MlaRopeCacheKernelParams& params, const Launch& launch) {
  if (params.num_items <= 0) return;
  // Items and rows are indexed in 32 bits in the kernel (rope_item_place, copy_item).
  MLAKV_CHECK(params.num_items <= 0x7fffffff, "mla_rope_cache: ", params.num_items,
              " work items exceed one launch");
  const int64_t grid = (params.num_items + kMlaWarps - 1) / kMlaWarps;
  // The rope items leave the decode rows to the copy items only where that instance exists.
  MLAKV_CHECK(
      !params.decode_rope_in_copy || (kVec && std::is_same_v<QOut, T>),
      "mla_rope_cache: the copy items' rope path is compiled for the 16-byte path with q_out "
      "of the model dtype only");
  // Each choice is its own kernel, so that the others keep their registers and schedule. The rope
  // parts in the copy items (mla_rope_cache.h kRopeInCopyMinTokens) are compiled for the 16-byte
  // path with q_out of the model dtype only (an fp8 q_out was measured slower with them).
  auto go = [&](auto k_tokens_tag, auto table_first_tag, auto narrow_tag) {
    constexpr int kKTokens = decltype(k_tokens_tag)::value;
    constexpr bool kTableFirst = decltype(table_first_tag)::value;
    constexpr bool kNarrow = decltype(narrow_tag)::value;
    if constexpr (kVec && std::is_same_v<QOut, T>) {
      if (params.decode_rope_in_copy) {
        launch_kernel(
            "mla_rope_cache_kernel",
            mla_rope_cache_kernel<T, kFormat, QOut, kVec, kKTokens, kTableFirst, true, kNarrow>,
            static_cast<unsigned>(grid), kMlaThreads, 0, launch, params);
        return;
      }
    }
    launch_kernel(
        "mla_rope_cache_kernel",
        mla_rope_cache_kernel<T, kFormat, QOut, kVec, kKTokens, kTableFirst, false, kNarrow>,
        static_cast<unsigned>(grid), kMlaThreads, 0, launch, params);
  };
  // The narrow K items (mla_rope_cache.h kKNarrowMaxLatent) are compiled for the 16-byte path
  // (below); the element-wise path keeps one instance, the widest.
  const bool narrow = k_items_narrow(params.args.kv_lora_rank, params.args.rope_dim);
  // The K items' table-first order (mla_rope_cache.h kKTableFirstMinTokens) is compiled for the
  // 16-byte path with q_out of the model dtype or no q_out only (the workloads it was measured on),
  // and for narrow shapes only; K items of two tokens (make_params, kKTwoTokensMinTokens) for its
  // 16-bit models only.
  constexpr bool kTableFirstCompiled = kVec && std::is_same_v<QOut, T>;
  const bool table_first = kTableFirstCompiled && narrow && params.apply_rope &&
                           params.num_k_items > 0 &&
                           params.args.num_tokens >= kKTableFirstMinTokens;
  // num_k_items counts items of two tokens: only their instance may run them.
  MLAKV_CHECK(!params.k_two_tokens || (table_first && sizeof(T) == 2),
              "mla_rope_cache: K items of two tokens are compiled for the table-first order of "
              "16-bit models with L <= ",
              kKNarrowMaxLatent, " and R <= ", kKNarrowMaxRope);
  using OneToken = std::integral_constant<int, 1>;
  if constexpr (kVec) {
    if (narrow) {
      if constexpr (kTableFirstCompiled) {
        if (table_first) {
          if constexpr (sizeof(T) == 2) {
            if (params.k_two_tokens) {
              go(std::integral_constant<int, 2>{}, std::true_type{}, std::true_type{});
              return;
            }
          }
          go(OneToken{}, std::true_type{}, std::true_type{});
          return;
        }
      }
      go(OneToken{}, std::false_type{}, std::true_type{});
      return;
    }
  }
  go(OneToken{}, std::false_type{}, std::false_type{});
}

}  // namespace cuda
}  // namespace mlakv

// Explicit instantiations of one model type and cache format for every q_out type and both
// access widths.
#define MLAKV_INSTANTIATE_MLA_ROPE_CACHE_QOUT(T, kFormat, QOut)                     \
  template void mlakv::cuda::launch_mla_rope_cache_kernel<T, kFormat, QOut, true>(  \
      const mlakv::cuda::MlaRopeCacheKernelParams&, const Launch&);                 \
  template void mlakv::cuda::launch_mla_rope_cache_kernel<T, kFormat, QOut, false>( \
      const mlakv::cuda::MlaRopeCacheKernelParams&, const Launch&);
#define MLAKV_INSTANTIATE_MLA_ROPE_CACHE(T, kFormat)                     \
  MLAKV_INSTANTIATE_MLA_ROPE_CACHE_QOUT(T, kFormat, T)                   \
  MLAKV_INSTANTIATE_MLA_ROPE_CACHE_QOUT(T, kFormat, mlakv::num::Fp8E4M3) \
  MLAKV_INSTANTIATE_MLA_ROPE_CACHE_QOUT(T, kFormat, mlakv::num::Fp8E5M2)
