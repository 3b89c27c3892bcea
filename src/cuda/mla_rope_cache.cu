// mlakv CUDA backend: launchers of the fused MLA RoPE + KV-cache op and of the two unfused
// primitives that run through the same kernel (concat_and_cache_mla, decode_q_concat).
#include <algorithm>
#include <type_traits>

#include "core/backend.h"
#include "cuda/cuda_utils.h"
#include "cuda/mla_rope_cache.h"

namespace mlakv {
namespace cuda {
namespace {

constexpr int kRopeSlotsHost = 8;  // mla_rope_cache_kernel.cuh kRopeSlots
// Chunks a lane stages at most in a rope or copy item: 8 (4 KB of bf16 a warp) measured as fast as
// 16 at large T and faster for a model-dtype copy, and faster for an fp8 q_out copy too (decode_fp8
// T = 512 35.4 -> 33.8 us, T = 2048 124.1 -> 121.9 us on the H200, docs/perf-notes.md, ninth
// session).
constexpr int64_t kItemSlotsHost = 8;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Chunks a lane stages in the kernel's kStageBytes per warp (chunks of 8 model-dtype elements).
int64_t stage_slots(int64_t elem_bytes) { return kStageBytes / (32 * 8 * elem_bytes); }

// Warps of the fused kernel resident on the current device at once (kMlaResidentWarpsPerSm on each
// multiprocessor).
int64_t resident_warps() { return int64_t{multiprocessor_count()} * kMlaResidentWarpsPerSm; }

// Slots per lane for a list of `chunks` chunks: items as large as the stage allows (`most`), but
// small enough that the list first fills `fill_warps` warps, in powers of two. Measured on the
// H200 (decode, T = 1 .. 8192): items of 16 slots were up to 2x slower than 2-4 slots at T <= 128,
// and no faster than 8 at T >= 2048.
int64_t slots_for(int64_t chunks, int64_t most, int64_t fill_warps) {
  int64_t slots = 1;
  while (slots * 2 <= most && chunks >= 32 * slots * 2 * fill_warps) slots *= 2;
  return slots;
}

// The warps a rope list fills first: half a wave (an item also waits for its position and its
// cos/sin row, so a latency-bound launch is fastest spread over every multiprocessor).
int64_t rope_fill_warps(int64_t wave_warps) { return wave_warps / 2; }

// The warps a copy list fills first: a sixteenth of a wave. Its items only stream rows, and fewer,
// larger ones leave the multiprocessors to the launch's chain items: on the H200 (run 82,
// docs/perf-notes.md) decode copies of 8 slots a lane took decode_bf16 T = 8 / 32 from 3.77 / 5.37
// to 3.59 / 5.20 us (decode_fp8 4.31 / 5.67 -> 4.14 / 5.57) against the half wave's 1 / 4 slots.
int64_t copy_fill_warps(int64_t wave_warps) { return std::max<int64_t>(1, wave_warps / 16); }

CopyList make_copy_list(const void* src, int64_t stride_src_token, int64_t stride_src_head,
                        void* dst, int64_t stride_dst_token, int64_t stride_dst_head,
                        int64_t token_begin, int64_t token_end, int64_t H, int64_t row_elems,
                        int64_t most_slots, int64_t wave_warps) {
  CopyList c;
  if (token_end <= token_begin || row_elems <= 0 || H <= 0) return c;
  c.src = src;
  c.stride_src_token = stride_src_token;
  c.stride_src_head = stride_src_head;
  c.dst = dst;
  c.stride_dst_token = stride_dst_token;
  c.stride_dst_head = stride_dst_head;
  c.row_begin = token_begin * H;
  c.row_end = token_end * H;
  // The kernel indexes rows in 32 bits, with FastDivs (below 2^31, past the last row included).
  MLAKV_CHECK(c.row_end < (int64_t{1} << 30), "mla_rope_cache: ", c.row_end,
              " rows (tokens x heads) exceed one launch");
  c.row_elems = row_elems;
  const int64_t cpr = ceil_div(row_elems, 8);
  MLAKV_CHECK(cpr < (int64_t{1} << 30), "mla_rope_cache: rows of ", row_elems,
              " elements are too long for one launch");
  const int64_t slots =
      slots_for((c.row_end - c.row_begin) * cpr, most_slots, copy_fill_warps(wave_warps));
  const int64_t capacity = 32 * slots;  // chunks an item stages
  int64_t segments_per_row = 1;
  if (cpr <= capacity) {
    c.rows_per_item = static_cast<int32_t>(capacity / cpr);
    c.slots = static_cast<int32_t>(ceil_div(c.rows_per_item * cpr, 32));
    c.num_items = ceil_div(c.row_end - c.row_begin, c.rows_per_item);
  } else {
    segments_per_row = ceil_div(cpr, capacity);
    c.slots = static_cast<int32_t>(slots);
    c.num_items = (c.row_end - c.row_begin) * segments_per_row;
  }
  c.row_step = static_cast<int32_t>(32 / cpr);
  c.chunk_step = static_cast<int32_t>(32 % cpr);
  const bool one_run =
      stride_src_token == H * stride_src_head && stride_dst_token == H * stride_dst_head;
  const int64_t rows_per_token = one_run ? c.row_end + 1 : H;
  c.src_token_jump = one_run ? 0 : stride_src_token - H * stride_src_head;
  c.dst_token_jump = one_run ? 0 : stride_dst_token - H * stride_dst_head;
  c.segment_div = FastDiv(static_cast<uint32_t>(segments_per_row));
  c.chunk_div = FastDiv(static_cast<uint32_t>(cpr));
  c.token_div = FastDiv(static_cast<uint32_t>(rows_per_token));
  for (int wrapped = 0; wrapped < 2; ++wrapped) {
    const int64_t rows = c.row_step + wrapped;
    const int64_t elems = 8 * (c.chunk_step - (wrapped != 0 ? cpr : 0));
    c.src_step[wrapped] = rows * stride_src_head + elems;
    c.dst_step[wrapped] = rows * stride_dst_head + elems;
  }
  return c;
}

// The work lists of one launch. Host Td: each Q list covers exactly its rows. Device Td: both
// decode and prefill lists cover all T rows and the kernel skips the rows on the other side.
MlaRopeCacheKernelParams make_params(const core::MlaRopeCacheArgs& a, bool apply_rope, bool vec,
                                     int32_t* error_counts, int64_t wave_warps) {
  MlaRopeCacheKernelParams p;
  p.args = a;
  p.apply_rope = apply_rope;
  p.error_counts = error_counts;
  const int64_t T = a.num_tokens;
  const int64_t H = a.num_heads;
  const int64_t elem_bytes = static_cast<int64_t>(dtype_size(a.model_dtype));
  const int64_t item_slots = std::min(kItemSlotsHost, stage_slots(elem_bytes));
  const bool device_td = a.num_decode_tokens_device != nullptr;
  const int64_t td = std::min<int64_t>(std::max<int64_t>(a.num_decode_tokens, 0), T);
  const int64_t decode_end = device_td ? T : td;
  const int64_t prefill_begin = device_td ? 0 : td;
  const bool has_decode = a.q_out != nullptr && H > 0 && decode_end > 0;
  const bool has_prefill = a.q != nullptr && H > 0 && prefill_begin < T;

  // Two tokens a K item (kKTwoTokensMinTokens) only where the launcher takes the table-first
  // instance of a 16-bit model: the 16-byte path with rotation and q_out of the model dtype or
  // none.
  p.k_two_tokens = a.kv_c != nullptr && vec && apply_rope && elem_bytes == 2 &&
                   T >= kKTwoTokensMinTokens && k_items_narrow(a.kv_lora_rank, a.rope_dim) &&
                   (a.q_out == nullptr || a.q_out_dtype == a.model_dtype);
  p.num_k_items = a.kv_c != nullptr ? (p.k_two_tokens ? ceil_div(T, 2) : T) : 0;

  const int64_t half = a.rope_dim / 2;
  const int64_t ppl = std::max<int64_t>(1, ceil_div(half, 32));
  p.rope_pairs_per_lane = static_cast<int32_t>(ppl);
  p.rope_heads_per_item = static_cast<int32_t>(std::max<int64_t>(1, kRopeSlotsHost / ppl));
  // The chunked rope path: pairs are adjacent (GPT-J, or no rotation), every chunk is one aligned
  // vector access (vec: L, P multiples of 8, 16-byte strides; R a multiple of 8) and a warp row of
  // 32 lanes holds whole heads (R / 8 divides 32), so a lane's chunk column is fixed.
  const int64_t cph = a.rope_dim / 8;
  p.rope_chunked = vec && (!apply_rope || a.rope.style == RopeStyle::kGptJ) &&
                   a.rope_dim % 8 == 0 && cph > 0 && 32 % cph == 0;
  if (has_decode && a.copy_nope && a.ql_nope != nullptr) {
    p.decode_copy = make_copy_list(a.ql_nope, a.stride_ql_nope_token, a.stride_ql_nope_head,
                                   a.q_out, a.stride_q_out_token, a.stride_q_out_head, 0,
                                   decode_end, H, a.kv_lora_rank, item_slots, wave_warps);
  }
  // The decode rows' rope parts go with their nope parts (mla_rope_cache.h
  // kRopeInCopyMinTokens) when q_out has the model dtype, a copy item's rows have at most one rope
  // chunk a lane and the stage has a slot left for it.
  const CopyList& dc = p.decode_copy;
  // No q_pe (decode_q_concat's rope parts already in q_out): the decode rows have no rope work.
  const bool decode_rope = has_decode && a.q_pe != nullptr && half > 0;
  p.decode_rope_in_copy = p.rope_chunked && decode_rope && decode_end >= kRopeInCopyMinTokens &&
                          a.q_out_dtype == a.model_dtype && dc.num_items > 0 &&
                          dc.slots < stage_slots(elem_bytes) &&
                          (dc.segment_div.divisor > 1 || int64_t{dc.rows_per_item} * cph <= 32);
  p.head_div = FastDiv(static_cast<uint32_t>(std::max<int64_t>(H, 1)));
  const bool rope_decode = decode_rope && !p.decode_rope_in_copy;
  const bool has_rope = (rope_decode || has_prefill) && half > 0;
  p.rope_token_begin = rope_decode ? 0 : prefill_begin;
  const int64_t rope_tokens = has_rope ? (has_prefill ? T : decode_end) - p.rope_token_begin : 0;
  if (p.rope_chunked) {
    // Whole slots of 32 / cph heads, no more slots than the heads need (H = 8: 2 of them).
    const int64_t hps = 32 / cph;
    // A rope item also waits for its position and cos/sin row: counted as 4x the work of its
    // bytes, and at least 2 slots (measured: 2-4 slots fastest at T <= 128, 8 at T >= 2048).
    // One token an item even where a token's heads fill fewer slots (H <= 16): items of two
    // tokens in the two-token instance were 5-10 % faster at T = 16384 but 9-14 % slower at
    // T = 1792-4096, and their code cost the 128-head rows 3-5 % (run 165, docs/perf-notes.md).
    const int64_t slots = std::clamp<int64_t>(
        std::min(std::max<int64_t>(2, slots_for(4 * rope_tokens * H * cph, item_slots,
                                                rope_fill_warps(wave_warps))),
                 ceil_div(H, hps)),
        1, item_slots);
    p.rope_chunk_slots = static_cast<int32_t>(slots);
    p.rope_heads_per_item = static_cast<int32_t>(hps * slots);
  }
  const int64_t rope_groups_per_token = H > 0 ? ceil_div(H, p.rope_heads_per_item) : 1;
  p.rope_group_div = FastDiv(static_cast<uint32_t>(rope_groups_per_token));
  p.num_rope_items = rope_tokens * rope_groups_per_token;
  if (has_prefill && a.q_prefill_out != nullptr) {
    p.prefill_copy = make_copy_list(a.q, a.stride_q_token, a.stride_q_head, a.q_prefill_out,
                                    a.stride_q_prefill_out_token, a.stride_q_prefill_out_head,
                                    prefill_begin, T, H, a.nope_dim, item_slots, wave_warps);
  }
  p.num_items =
      p.num_k_items + p.num_rope_items + p.decode_copy.num_items + p.prefill_copy.num_items;
  return p;
}

// 16-byte accesses are safe when every pointer and stride the kernel touches allows them (and the
// prefill nope part is whole chunks, so its rope part starts 16-byte aligned too).
bool vec_ok(const core::MlaRopeCacheArgs& a) {
  const int64_t elem = static_cast<int64_t>(dtype_size(a.model_dtype));
  const int64_t q_out_elem =
      a.q_out != nullptr ? static_cast<int64_t>(dtype_size(a.q_out_dtype)) : elem;
  VecCheck v;
  v.ptr(a.kv_c).stride(a.stride_kv_c_token, elem);
  v.ptr(a.k_pe).stride(a.stride_k_pe_token, elem);
  v.ptr(a.kv_norm_weight);
  v.ptr(a.kv_c_out).stride(a.stride_kv_c_out_token, elem);
  v.ptr(a.k_pe_out).stride(a.stride_k_pe_out_token, elem);
  v.ptr(a.cache.data)
      .stride_bytes(a.cache.stride_block_bytes)
      .stride_bytes(a.cache.stride_token_bytes);
  v.ptr(a.cache.rope_data)
      .stride_bytes(a.cache.stride_rope_block_bytes)
      .stride_bytes(a.cache.stride_rope_token_bytes);
  v.ptr(a.q_pe).stride(a.stride_q_pe_token, elem).stride(a.stride_q_pe_head, elem);
  v.ptr(a.ql_nope).stride(a.stride_ql_nope_token, elem).stride(a.stride_ql_nope_head, elem);
  v.ptr(a.q_out).stride(a.stride_q_out_token, q_out_elem).stride(a.stride_q_out_head, q_out_elem);
  v.ptr(a.q).stride(a.stride_q_token, elem).stride(a.stride_q_head, elem);
  v.ptr(a.q_prefill_out)
      .stride(a.stride_q_prefill_out_token, elem)
      .stride(a.stride_q_prefill_out_head, elem);
  v.require(a.q == nullptr || a.nope_dim % 8 == 0);
  v.require(a.kv_lora_rank % 8 == 0);
  return v.ok();
}

template <typename T, CacheFormat kFormat, typename QOut>
void dispatch_vec(const MlaRopeCacheKernelParams& p, bool vec, const Launch& launch) {
  if (vec) {
    launch_mla_rope_cache_kernel<T, kFormat, QOut, true>(p, launch);
  } else {
    launch_mla_rope_cache_kernel<T, kFormat, QOut, false>(p, launch);
  }
}

template <typename T, CacheFormat kFormat>
void dispatch_q_out(const MlaRopeCacheKernelParams& p, bool vec, const Launch& launch) {
  if (p.args.q_out == nullptr || p.args.q_out_dtype == p.args.model_dtype) {
    dispatch_vec<T, kFormat, T>(p, vec, launch);
    return;
  }
  switch (p.args.q_out_dtype) {
    case DType::kFloat8E4M3:
      dispatch_vec<T, kFormat, num::Fp8E4M3>(p, vec, launch);
      return;
    case DType::kFloat8E5M2:
      dispatch_vec<T, kFormat, num::Fp8E5M2>(p, vec, launch);
      return;
    default:
      MLAKV_FAIL("q_out: expected the model dtype ", dtype_name(p.args.model_dtype),
                 " or a float8 dtype, got ", dtype_name(p.args.q_out_dtype));
  }
}

template <typename T>
void dispatch_format(const MlaRopeCacheKernelParams& p, bool vec, const Launch& launch) {
  switch (p.args.cache.format) {
    case CacheFormat::kBFloat16:
      return dispatch_q_out<T, CacheFormat::kBFloat16>(p, vec, launch);
    case CacheFormat::kFloat16:
      return dispatch_q_out<T, CacheFormat::kFloat16>(p, vec, launch);
    case CacheFormat::kFloat32:
      return dispatch_q_out<T, CacheFormat::kFloat32>(p, vec, launch);
    case CacheFormat::kFloat8E4M3:
      return dispatch_q_out<T, CacheFormat::kFloat8E4M3>(p, vec, launch);
    case CacheFormat::kFloat8E5M2:
      return dispatch_q_out<T, CacheFormat::kFloat8E5M2>(p, vec, launch);
    case CacheFormat::kFloat8DsMla:
      // The validator admits fp8_ds_mla with a bfloat16 model only; only that is instantiated.
      if constexpr (std::is_same_v<T, num::Bf16>) {
        return dispatch_q_out<T, CacheFormat::kFloat8DsMla>(p, vec, launch);
      } else {
        MLAKV_FAIL("kv_cache: fp8_ds_mla needs a bfloat16 model dtype, got ",
                   dtype_name(p.args.model_dtype));
      }
  }
  MLAKV_FAIL("kv_cache: unknown cache format ", static_cast<int>(p.args.cache.format));
}

void run(const core::MlaRopeCacheArgs& a, bool apply_rope, const Context& ctx) {
  if (a.num_tokens <= 0) return;
  MLAKV_CHECK(a.kv_lora_rank <= 1024 && a.kv_lora_rank % 8 == 0, "kv_c: expected L <= 1024 and ",
              "a multiple of 8 on the CUDA backend, got ", a.kv_lora_rank);
  MLAKV_CHECK(a.rope_dim <= 256 && a.rope_dim % 2 == 0, "k_pe: expected an even R <= 256 on the ",
              "CUDA backend, got ", a.rope_dim);
  int32_t* error_counts = a.error_counts != nullptr ? a.error_counts : ctx.error_counts;
  const bool vec = vec_ok(a);
  MlaRopeCacheKernelParams p = make_params(a, apply_rope, vec, error_counts, resident_warps());
  if (p.num_items <= 0) return;
  const Launch launch = launch_of(ctx);
  p.prefetch_params = launch.pdl;
  MLAKV_MODEL_DTYPE_SWITCH(a.model_dtype, "kv_c", T, [&] { dispatch_format<T>(p, vec, launch); });
}

}  // namespace

void mla_rope_cache(const core::MlaRopeCacheArgs& args, const Context& ctx) {
  run(args, /*apply_rope=*/true, ctx);
}

void concat_and_cache_mla(const core::ConcatAndCacheMlaArgs& args, const Context& ctx) {
  core::MlaRopeCacheArgs a;
  a.num_tokens = args.num_tokens;
  a.kv_lora_rank = args.kv_lora_rank;
  a.rope_dim = args.rope_dim;
  a.model_dtype = args.model_dtype;
  a.slot_mapping = args.slot_mapping;
  a.kv_c = args.kv_c;
  a.stride_kv_c_token = args.stride_kv_c_token;
  a.k_pe = args.k_pe;
  a.stride_k_pe_token = args.stride_k_pe_token;
  a.cache = args.cache;
  a.error_counts = args.error_counts;
  run(a, /*apply_rope=*/false, ctx);
}

void decode_q_concat(const core::DecodeQConcatArgs& args, const Context& ctx) {
  if (args.num_heads <= 0) return;
  core::MlaRopeCacheArgs a;
  a.num_tokens = args.num_tokens;
  a.num_heads = args.num_heads;
  a.kv_lora_rank = args.kv_lora_rank;
  a.rope_dim = args.rope_dim;
  a.num_decode_tokens = args.num_tokens;
  a.model_dtype = args.model_dtype;
  a.q_pe = args.q_pe;
  a.stride_q_pe_token = args.stride_q_pe_token;
  a.stride_q_pe_head = args.stride_q_pe_head;
  a.ql_nope = args.ql_nope;
  a.stride_ql_nope_token = args.stride_ql_nope_token;
  a.stride_ql_nope_head = args.stride_ql_nope_head;
  a.copy_nope = args.ql_nope != nullptr;
  a.q_out = args.q_out;
  a.stride_q_out_token = args.stride_q_out_token;
  a.stride_q_out_head = args.stride_q_out_head;
  a.q_out_dtype = args.q_out_dtype;
  a.q_scale = args.q_scale;
  // No K side: the cache format only picks an instantiation.
  a.cache.format = CacheFormat::kBFloat16;
  run(a, /*apply_rope=*/false, ctx);
}

}  // namespace cuda
}  // namespace mlakv
