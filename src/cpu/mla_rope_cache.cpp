// The fused MLA RoPE + KV-cache op on the CPU.
//
// One parallel region runs three work lists, each split statically into contiguous ranges (no
// barrier between them, so a thread that finishes one list early starts on the next). Static
// ranges keep each thread's reads and writes sequential: handing items out dynamically interleaved
// the threads' streams and cost a third of the bandwidth on the 2-core development machine.
//   K side      one item per token t < T: RMSNorm, RoPE on k_pe, cache entry, optional outputs;
//   decode Q    one item per (t < Td, chunk of kHeadChunk heads): q_out = [ql_nope | RoPE(q_pe)];
//   prefill Q   one item per (Td <= t < T, chunk of heads): RoPE on the last R values of q.
// A Q item loads cos/sin once for its heads. Bad positions are counted on the K side only (every
// token has one K item), so a token counts once however many heads it has.
//
// Items ask ahead for what the following items of their list read at addresses the hardware
// prefetchers do not guess: the cos/sin row of the next token (a random row of a table of tens of
// MB), the next token's cache entry (a random slot) and, for prefill, the rope parts of the heads
// kHeadChunk places ahead (128 bytes out of every 384-byte head row for DeepSeek-V3). A thread's
// static range usually continues there; at the end of a range a few lines are fetched in vain.
// A large q_out is written with streaming stores (detail::stream_bytes, kStreamBytes).
#include <algorithm>
#include <cstring>

#include "core/backend.h"
#include "cpu/cpu_common.h"

namespace mlakv {
namespace cpu {
namespace {

using core::MlaRopeCacheArgs;
using detail::CosSin;
using detail::ErrorTally;

using KSideFn = void (*)(const MlaRopeCacheArgs&, int64_t, ErrorTally&);
using QItemFn = void (*)(const MlaRopeCacheArgs&, int64_t, int64_t, int64_t);

// Bytes of a cache entry: the latent part (up to the rope offset), then the rope part.
template <typename Fmt>
constexpr int64_t entry_bytes(int64_t L, int64_t R) {
  return detail::rope_offset_bytes<Fmt>(L) + R * static_cast<int64_t>(sizeof(typename Fmt::Rope));
}

// The cos/sin row of token t, asked for by the item of token t - 1.
void prefetch_next_cos_sin(const MlaRopeCacheArgs& a, int64_t t) {
  detail::prefetch_cos_sin(a.rope, detail::clamped_position(a.positions, a.rope, t, nullptr),
                           a.rope_dim);
}

// The cos/sin row and the cache entry of token t (for k_side_token(t - 1)).
void prefetch_k_side(const MlaRopeCacheArgs& a, int64_t t, int64_t rope_offset, int64_t bytes) {
  prefetch_next_cos_sin(a, t);
  const int64_t slot = detail::read_index(a.slot_mapping, t);
  if (slot < 0 || slot >= a.cache.num_slots) return;
  const detail::EntryPtrs entry = detail::cache_entry(a.cache, slot, rope_offset);
  if (a.cache.rope_data == nullptr) {
    detail::prefetch_write(entry.latent, bytes);
  } else {
    detail::prefetch_write(entry.latent, rope_offset);
    detail::prefetch_write(entry.rope, bytes - rope_offset);
  }
}

template <typename T, typename Fmt>
void k_side_token(const MlaRopeCacheArgs& a, int64_t t, ErrorTally& tally) {
  const int64_t L = a.kv_lora_rank;
  const int64_t R = a.rope_dim;
  const int64_t pos = detail::clamped_position(a.positions, a.rope, t, &tally);
  const int64_t slot = detail::read_index(a.slot_mapping, t);
  const T* kv_c = static_cast<const T*>(a.kv_c) + t * a.stride_kv_c_token;
  const T* k_pe = static_cast<const T*>(a.k_pe) + t * a.stride_k_pe_token;
  if (t + 1 < a.num_tokens)
    prefetch_k_side(a, t + 1, detail::rope_offset_bytes<Fmt>(L), entry_bytes<Fmt>(L, R));

  // Both rows are complete here before anything is written: kv_c_out / k_pe_out may alias them.
  alignas(64) T latent_buf[detail::kMaxLatent];
  alignas(64) T rope_buf[detail::kMaxRope];
  const T* latent = kv_c;
  if (a.kv_norm_weight != nullptr) {
    const float inv_rms = num::rms_inv(detail::sum_squares(kv_c, L), L, a.kv_norm_eps);
    detail::rms_apply_row(kv_c, static_cast<const T*>(a.kv_norm_weight), latent_buf, L, inv_rms);
    latent = latent_buf;
  }
  CosSin cs;
  detail::load_cos_sin(a.rope, pos, R, cs);
  detail::rope_row(k_pe, rope_buf, cs, R);

  detail::write_slot<Fmt>(a.cache, slot, latent, rope_buf, L, R, tally);
  if (a.kv_c_out != nullptr) {
    detail::convert_row(latent, static_cast<T*>(a.kv_c_out) + t * a.stride_kv_c_out_token, L);
  }
  if (a.k_pe_out != nullptr) {
    std::memcpy(static_cast<T*>(a.k_pe_out) + t * a.stride_k_pe_out_token, rope_buf,
                static_cast<size_t>(R) * sizeof(T));
  }
}

// q_out[t, h] for h in [h0, h1): nope part converted / quantized, rope part rotated. kStream (q_out
// in the model dtype, nope part copied): q_out rows are written with streaming stores, the rope
// part through a stack buffer.
template <typename T, typename QOut, bool kStream>
void decode_q_item(const MlaRopeCacheArgs& a, int64_t t, int64_t h0, int64_t h1) {
  const int64_t L = a.kv_lora_rank;
  const int64_t R = a.rope_dim;
  const int64_t pos = detail::clamped_position(a.positions, a.rope, t, nullptr);
  const float q_scale = detail::scale_or_one(a.q_scale);
  const bool copy_nope = a.copy_nope && a.ql_nope != nullptr;
  CosSin cs;
  detail::load_cos_sin(a.rope, pos, R, cs);
  if (h0 == 0 && t + 1 < a.num_tokens) prefetch_next_cos_sin(a, t + 1);
  // The q_pe rows are short and sit between long copies, so the hardware prefetcher does not
  // catch them: ask for all of this item's rows up front.
  for (int64_t h = h0; h < h1; ++h) {
    detail::prefetch_read(
        static_cast<const T*>(a.q_pe) + t * a.stride_q_pe_token + h * a.stride_q_pe_head,
        R * static_cast<int64_t>(sizeof(T)));
  }
  // Head by head, nope part then rope part: q_out is written front to back.
  for (int64_t h = h0; h < h1; ++h) {
    QOut* out = static_cast<QOut*>(a.q_out) + t * a.stride_q_out_token + h * a.stride_q_out_head;
    const T* q_pe =
        static_cast<const T*>(a.q_pe) + t * a.stride_q_pe_token + h * a.stride_q_pe_head;
    const T* ql_nope = copy_nope ? static_cast<const T*>(a.ql_nope) + t * a.stride_ql_nope_token +
                                       h * a.stride_ql_nope_head
                                 : nullptr;
    if constexpr (kStream) {
      static_assert(std::is_same_v<T, QOut>, "streaming stores copy model-dtype rows");
      constexpr int64_t kElem = sizeof(T);
      alignas(64) T rope_buf[detail::kMaxRope];
      if (copy_nope) detail::stream_bytes(ql_nope, out, L * kElem);
      detail::rope_row(q_pe, rope_buf, cs, R);
      detail::stream_bytes(rope_buf, out + L, R * kElem);
    } else {
      if (copy_nope) {
        // The next head's ql_nope row: the quantizing loop runs behind the hardware prefetcher
        // and stalled on every line (decode_fp8 T = 128: 7.7 -> 2.8 ms on the development machine).
        if (h + 1 < h1) {
          detail::prefetch_read(ql_nope + a.stride_ql_nope_head,
                                L * static_cast<int64_t>(sizeof(T)));
        }
        detail::store_row(ql_nope, out, L, q_scale);
      }
      if constexpr (std::is_same_v<T, QOut>) {
        detail::rope_row(q_pe, out + L, cs, R);
      } else {
        detail::rope_quantize_row(q_pe, out + L, cs, R, q_scale);
      }
    }
  }
}

// Prefill heads [h0, h1) of token t: RoPE on the last R values, in place or into q_prefill_out.
template <typename T>
void prefill_q_item(const MlaRopeCacheArgs& a, int64_t t, int64_t h0, int64_t h1) {
  const int64_t P = a.nope_dim;
  const int64_t R = a.rope_dim;
  const int64_t pos = detail::clamped_position(a.positions, a.rope, t, nullptr);
  CosSin cs;
  detail::load_cos_sin(a.rope, pos, R, cs);
  if (h0 == 0 && t + 1 < a.num_tokens) prefetch_next_cos_sin(a, t + 1);
  // In place, the rope parts are short rows at the head stride, read and written back: each head
  // asks for the one kHeadChunk places later in (token, head) order, which spreads the requests
  // over the item (a burst of a whole item's requests at its start stalled on the miss queue).
  // With q_prefill_out whole head rows are read, which the hardware prefetchers follow.
  const bool in_place = a.q_prefill_out == nullptr;
  int64_t ahead_t = t;
  int64_t ahead_h = h0 + detail::kHeadChunk;
  while (ahead_h >= a.num_heads) {
    ahead_h -= a.num_heads;
    ++ahead_t;
  }
  for (int64_t h = h0; h < h1; ++h) {
    if (in_place && ahead_t < a.num_tokens) {
      detail::prefetch_write(
          static_cast<const T*>(a.q) + ahead_t * a.stride_q_token + ahead_h * a.stride_q_head + P,
          R * static_cast<int64_t>(sizeof(T)));
      if (++ahead_h == a.num_heads) {
        ahead_h = 0;
        ++ahead_t;
      }
    }
    T* q = static_cast<T*>(a.q) + t * a.stride_q_token + h * a.stride_q_head;
    if (!in_place) {
      T* out = static_cast<T*>(a.q_prefill_out) + t * a.stride_q_prefill_out_token +
               h * a.stride_q_prefill_out_head;
      detail::convert_row(q, out, P);
      detail::rope_row(q + P, out + P, cs, R);
    } else {
      detail::rope_row(q + P, q + P, cs, R);
    }
  }
}

template <typename T>
KSideFn select_k_side(CacheFormat format) {
  KSideFn fn = nullptr;
  detail::dispatch_cache_format(format, [&](auto fmt) { fn = &k_side_token<T, decltype(fmt)>; });
  return fn;
}

template <typename T>
QItemFn select_decode_q(DType q_out_dtype, bool stream) {
  QItemFn fn = nullptr;
  detail::dispatch_value_dtype(q_out_dtype, "q_out", [&](auto q_out_tag) {
    using QOut = decltype(q_out_tag);
    if constexpr (std::is_same_v<QOut, T>) {
      fn = stream ? &decode_q_item<T, QOut, true> : &decode_q_item<T, QOut, false>;
    } else if constexpr (detail::kIsFp8<QOut>) {
      fn = &decode_q_item<T, QOut, false>;
    } else {
      MLAKV_FAIL("q_out: expected the model dtype of kv_c or a float8 dtype, got ",
                 dtype_name(q_out_dtype));
    }
  });
  return fn;
}

// Td: the device value (host memory here) wins, clamped into [0, T] and counted when clamped.
int64_t resolve_num_decode_tokens(const MlaRopeCacheArgs& a) {
  if (a.num_decode_tokens_device == nullptr) return a.num_decode_tokens;
  const int64_t value = *a.num_decode_tokens_device;
  const int64_t clamped = std::min<int64_t>(std::max<int64_t>(value, 0), a.num_tokens);
  if (clamped != value && a.error_counts != nullptr) {
#pragma omp atomic
    a.error_counts[kBadDecodeCount] += 1;
  }
  return clamped;
}

}  // namespace

void mla_rope_cache(const core::MlaRopeCacheArgs& args, const Context& ctx) {
  const int64_t T = args.num_tokens;
  if (T <= 0) return;
  const int64_t Td = resolve_num_decode_tokens(args);
  const int64_t H = args.num_heads;
  const int64_t L = args.kv_lora_rank;
  const int64_t R = args.rope_dim;
  const int64_t P = args.nope_dim;
  MLAKV_CHECK(L <= detail::kMaxLatent, "kv_c: expected kv_lora_rank <= ", detail::kMaxLatent,
              " on the CPU backend, got ", L);
  MLAKV_CHECK(R <= detail::kMaxRope, "k_pe: expected rope_dim <= ", detail::kMaxRope,
              " on the CPU backend, got ", R);

  detail::dispatch_model_dtype(args.model_dtype, "kv_c", [&](auto model_tag) {
    using T_ = decltype(model_tag);
    const KSideFn k_side = select_k_side<T_>(args.cache.format);
    const int64_t elem = static_cast<int64_t>(sizeof(T_));
    // Streaming stores pay off when whole q_out rows are copied (model-dtype q_out, nope part
    // copied) and q_out is too large to be found in cache by its reader. An fp8 q_out is bound by
    // the quantization, not by memory: regular stores.
    const bool stream_q_out = args.q_out_dtype == args.model_dtype && args.copy_nope &&
                              args.ql_nope != nullptr &&
                              Td * H * (L + R) * elem >= detail::kStreamBytes;
    const QItemFn decode_q = args.q_out != nullptr && H > 0 && Td > 0
                                 ? select_decode_q<T_>(args.q_out_dtype, stream_q_out)
                                 : nullptr;
    const QItemFn prefill_q = args.q != nullptr && H > 0 && Td < T ? &prefill_q_item<T_> : nullptr;

    const int64_t chunks = H > 0 ? (H + detail::kHeadChunk - 1) / detail::kHeadChunk : 0;
    const int64_t decode_items = decode_q != nullptr ? Td * chunks : 0;
    const int64_t prefill_items = prefill_q != nullptr ? (T - Td) * chunks : 0;
    // Bytes moved, each Q term only where its work runs: its views then hold those bytes (within
    // 2^56 each, so no product overflows; an empty q_out may have any H).
    const int64_t bytes =
        T * (L + R) * elem * 2 + (decode_q != nullptr ? Td * H * (L + R) * elem * 2 : 0) +
        (prefill_q != nullptr
             ? (T - Td) * H * (args.q_prefill_out != nullptr ? P + R : R) * elem * 2
             : 0);
    const int threads = detail::threads_for(ctx, bytes, T + decode_items + prefill_items);

#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      const DefaultFloatEnv float_env;
      ErrorTally tally;
#pragma omp for schedule(static) nowait
      for (int64_t t = 0; t < T; ++t) k_side(args, t, tally);
      if (decode_items > 0) {
#pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < decode_items; ++i) {
          const int64_t h0 = (i % chunks) * detail::kHeadChunk;
          decode_q(args, i / chunks, h0, std::min(H, h0 + detail::kHeadChunk));
        }
      }
      if (prefill_items > 0) {
#pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < prefill_items; ++i) {
          const int64_t h0 = (i % chunks) * detail::kHeadChunk;
          prefill_q(args, Td + i / chunks, h0, std::min(H, h0 + detail::kHeadChunk));
        }
      }
      if (stream_q_out) detail::stream_fence();
      tally.flush(args.error_counts);
    }
  });
}

}  // namespace cpu
}  // namespace mlakv
