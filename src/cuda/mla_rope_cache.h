// mlakv CUDA backend: the fused MLA RoPE + KV-cache kernel and its launcher. The same kernel also
// runs the unfused concat_and_cache_mla (K side without RoPE) and decode_q_concat (decode Q side
// without RoPE), so fused and unfused paths share every byte-producing line of code.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/fast_div.h"
#include "core/args.h"
#include "cuda/cuda_utils.h"
#include "mlakv/cache.h"

namespace mlakv {
namespace cuda {

// Shared memory each warp of the fused kernel stages its item's inputs in (cp.async): the K item's
// RMSNorm weight (L <= 1024 model-dtype values), or up to kStageBytes of the rows a rope or copy
// item moves, in flight at once without holding registers.
constexpr int kStageBytes = 8192;
// Warps of the kernel resident on one multiprocessor (6 blocks of 4 warps: the register cap of the
// 16-bit vector instances, and 6 x 32 KB of shared memory).
constexpr int kMlaResidentWarpsPerSm = 24;

// From this many tokens on, a launch's K items wait for their position and request its cos/sin
// entries before their rows, instead of requesting the rows first and the cos/sin entries when the
// position has arrived (the 16-byte path with q_out of the model dtype or no q_out, narrow shapes:
// kKNarrowMaxLatent below; both orders wait the same two round trips). On the H200
// (docs/perf-notes.md, sixteenth session, runs 52-56), table first: decode_nope_in_q_out T =
// 2048 25.3 -> 24.8 us, prefill T = 2048 25.3 -> 24.9 us, T = 1280-1920 every row faster or equal
// (decode_nope_in_q_out and prefill up to 3 %), T = 4096-8192 within 0.6 % either way; at T = 512
// and 1024 1-3 % slower (not at 768: the gain is not monotonic in T), and at T = 1-32 the rows'
// round trip behind the position's lengthens the launch's longest chain (3-6 % slower, eleventh
// session).
constexpr int64_t kKTableFirstMinTokens = 1280;
// A narrow shape (L <= kKNarrowMaxLatent, R <= kKNarrowMaxRope: DeepSeek-V3, Kimi-K2 and their
// kin) has K items that hold a token in half the registers of the widest shape (2 chunks and 2
// rope pairs a lane instead of 4 and 4), an instance of its own. In the widest instance, the fp8
// q_out kernels had spilled an in-flight load of the K item (the slot, or a rope pair) at 80
// registers, so that the item waited for it before issuing its next loads: a third round trip
// (docs/perf-notes.md, fiftieth session). The table-first order and K items of two tokens are
// compiled for narrow shapes only; a wider shape runs one token an item, rows first.
constexpr int64_t kKNarrowMaxLatent = 512;
constexpr int64_t kKNarrowMaxRope = 128;
// The launcher's and make_params' one test of a narrow shape.
constexpr bool k_items_narrow(int64_t kv_lora_rank, int64_t rope_dim) {
  return kv_lora_rank <= kKNarrowMaxLatent && rope_dim <= kKNarrowMaxRope;
}
// From this many tokens on, in the table-first order with a 16-bit model, a K item of a narrow
// shape holds two tokens instead of one (two narrow tokens take the registers of one token of the
// widest shape), each in the whole warp, with every load of both in flight together. A K item waits
// for two round trips (slot and position, then the cos/sin row) and moves only its token's 2.3 KB
// (DeepSeek-V3), so at a tensor-parallel shard's head counts, where the K side is a third of the
// bytes, a warp had too little in flight. docs/perf-notes.md, thirty-eighth session (H100): on the
// K-heavy rows at 16 heads (prefill, decode with the nope part in q_out), two tokens were 4-6 %
// faster than one from T = 4096 on (run 151); with the threshold moved (runs 152-153), 8-10 %
// faster at T = 1792 and 2048, 4-5 % at 3584, up to 1 % slower at 2560 and 3072 (where decode with
// RMSNorm was 1-4 % faster), and up to 2 % slower at 1280 and 1536. At 128 heads: within 0.5 % at
// 1280-2048, 1-2 % faster from 3072 on. On the H200 (thirty-ninth session, run 159, 128 heads):
// prefill T = 4096-16384 2-3 % faster than the last table before two tokens (run 135).
constexpr int64_t kKTwoTokensMinTokens = 1792;
static_assert(kKTwoTokensMinTokens >= kKTableFirstMinTokens,
              "K items of two tokens are compiled for the table-first order only");

// From this many decode tokens on (a device Td: tokens), with q_out of the model dtype, the decode
// copy's items also rotate their rows' rope parts (q_pe -> q_out[t, h, L:]) instead of the rope
// items, so that each q_out row is written whole by one warp: the rope items write 128 of every
// 1152 bytes (bf16), a pattern that by itself runs below a copy. Each copy item then also waits for
// its token's position and then its cos/sin columns, a round trip more than its own rows, which
// costs more than it saves until the launch is many waves long. On the H200 (docs/perf-notes.md,
// eighteenth session, runs 70-72): decode_bf16 T = 512 / 1024 / 2048 / 8192 41.3 / 79.9 / 156.2 /
// 612.8 -> 40.7 / 77.6 / 151.7 / 596.4 us, mixed_bf16 T = 4096 / 16384 1.8-1.9 % faster, T = 384
// even, T = 128-256 up to 6 % slower. With an fp8 q_out it was slower (decode_fp8 T = 512 33.4 ->
// 34.3 us) and is not compiled.
constexpr int64_t kRopeInCopyMinTokens = 512;

// One streaming-copy work list of the fused kernel: the nope part of rows (t, h), flat row index
// r = t * H + h in [row_begin, row_end). Item i moves up to 32 * slots chunks (8 elements each) of
// whole rows (segments_per_row == 1: rows_per_item rows from row_begin + i * rows_per_item) or one
// segment of a longer row (segments_per_row > 1: row row_begin + i / segments_per_row, chunks from
// 32 * slots * (i % segments_per_row)). Lane l takes the item's chunks l, l + 32, ...: from one to
// the next the chunk index in the row grows by chunk_step and the row by row_step, plus one when
// the chunk index wraps (chunk_step = 32 % chunks_per_row, row_step = 32 / chunks_per_row), so the
// element offsets grow by src_step / dst_step [wrapped] and, each time the row passes a token's
// last, by the token jumps. Rows laid out evenly (stride_token = H * stride_head on both sides,
// the usual [T, H, D] tensors) are one run: rows_per_token is then the whole list and the jumps 0.
struct CopyList {
  const void* src = nullptr;  // [T, H, >= row_elems], model dtype
  int64_t stride_src_token = 0, stride_src_head = 0;
  void* dst = nullptr;  // [T, H, >= row_elems], model dtype or fp8 (decode q_out)
  int64_t stride_dst_token = 0, stride_dst_head = 0;
  int64_t row_begin = 0, row_end = 0;
  int64_t row_elems = 0;                               // L (decode) or P (prefill)
  int64_t src_step[2] = {0, 0}, dst_step[2] = {0, 0};  // [chunk index wrapped]
  int64_t src_token_jump = 0, dst_token_jump = 0;      // stride_token - H * stride_head
  int32_t slots = 1;  // chunks a lane stages, <= kStageBytes / 32 / chunk bytes (one less for
                      // the decode list with decode_rope_in_copy: its rope chunk takes a slot)
  int32_t rows_per_item = 1;
  int32_t row_step = 0, chunk_step = 0;
  // The kernel's divisions, prepared here (fast_div.h: item and row indices are below 2^31); each
  // divisor is the count itself (segment_div.divisor is segments_per_row, and so on).
  FastDiv segment_div;  // by segments_per_row
  FastDiv chunk_div;    // by chunks_per_row = ceil(row_elems / 8)
  FastDiv token_div;    // by rows_per_token: H, or more than row_end when the rows are one run
  int64_t num_items = 0;
};

struct MlaRopeCacheKernelParams {
  // The dispatch and the rope items' placement first: a launch's parameter lines reach a warp one
  // constant-cache miss after another, so what every warp reads before its first loads leads.
  // Warp work items, in this order: K side (one or two tokens each), rope (one per token and group
  // of heads), decode nope copy, prefill nope copy.
  int64_t num_items = 0;  // all of them
  int64_t num_k_items = 0;
  int64_t num_rope_items = 0;
  int64_t rope_token_begin = 0;
  FastDiv rope_group_div;  // by the groups of heads a token has, ceil(H / rope_heads_per_item)
  int32_t rope_pairs_per_lane = 1;  // ceil(R / 2 / 32)
  int32_t rope_heads_per_item = 1;  // 8 / rope_pairs_per_lane
  // Rope items move whole 8-element chunks (GPT-J or no rotation, vector access, R / 8 divides
  // 32): a lane stages rope_chunk_slots chunks, rope_heads_per_item = rope_chunk_slots * 32 / (R /
  // 8) heads an item, and rope_pairs_per_lane is unused.
  int32_t rope_chunk_slots = 0;
  bool rope_chunked = false;
  bool apply_rope = true;  // false: concat_and_cache_mla / decode_q_concat (no rotation)
  // Read every parameter line before the programmatic wait (a PDL launch, where that time is
  // hidden behind the previous kernel); otherwise each item reads only the lines it uses.
  bool prefetch_params = false;
  // Two tokens a K item (kKTwoTokensMinTokens): num_k_items = ceil(T / 2). Read on the host only
  // (the kernel's kKTokens instance).
  bool k_two_tokens = false;
  int32_t* error_counts = nullptr;

  core::MlaRopeCacheArgs args;  // validated; the rope fields are unused when !apply_rope
  CopyList decode_copy;         // ql_nope -> q_out nope part, rows t < Td
  CopyList prefill_copy;        // q nope part -> q_prefill_out, rows t >= Td
  // The decode copy's items also rotate their rows' rope parts (kRopeInCopyMinTokens; the kernel's
  // kRopeInCopy instance), and the rope items skip the decode tokens (with a host Td there are
  // none). head_div divides a row index by H. Last, so that the other fields keep their lines.
  bool decode_rope_in_copy = false;
  FastDiv head_div;
};

// The kernel for model type T, cache format kFormat, q_out element type QOut and the vector-access
// flag (mla_rope_cache_kernel.cuh; instantiated in mla_rope_cache_{bf16,fp16,fp32}.cu).
template <typename T, CacheFormat kFormat, typename QOut, bool kVec>
void launch_mla_rope_cache_kernel(const MlaRopeCacheKernelParams& params, const Launch& launch);

}  // namespace cuda
}  // namespace mlakv
