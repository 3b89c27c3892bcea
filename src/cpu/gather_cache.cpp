// Cache read-back on the CPU: entries dequantized into [L + R] rows of fp32 or bf16.
//
// Slots mode splits the rows statically over the threads. Sequences mode walks the sequences in
// order and splits each sequence's tokens over the threads, so one long sequence (a chunked-prefill
// context) still uses every thread.
#include <algorithm>
#include <cstring>

#include "core/backend.h"
#include "cpu/cpu_common.h"

namespace mlakv {
namespace cpu {
namespace {

using core::GatherCacheArgs;
using detail::ErrorTally;

// The 256 values of an fp8 byte: the conversion is exact, so a table gives the same bits.
template <typename F>
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) value[b] = num::to_float(F{static_cast<uint8_t>(b)});
  }
};

template <typename F>
const Fp8Table<F>& fp8_table() {
  static const Fp8Table<F> table;
  return table;
}

// out[i] = from_float<O>(value(bytes[i]) * scale).
template <typename F, typename O>
inline void dequantize_row(const uint8_t* __restrict bytes, O* __restrict out, int64_t n,
                           float scale) {
  const float* __restrict table = fp8_table<F>().value;
  for (int64_t i = 0; i < n; ++i) out[i] = num::from_float<O>(num::mul_rn(table[bytes[i]], scale));
}

template <typename Fmt, typename O>
void read_entry(const core::CacheArg& cache, const detail::EntryPtrs& entry, O* out, int64_t L,
                int64_t R) {
  if constexpr (std::is_same_v<Fmt, detail::DsMla>) {
    float scales[kDsMlaNumTiles];
    std::memcpy(scales, entry.latent + kDsMlaLatentDim, sizeof(scales));
    for (int64_t tile = 0; tile < kDsMlaNumTiles; ++tile) {
      dequantize_row<num::Fp8E4M3>(entry.latent + tile * kDsMlaTileElems,
                                   out + tile * kDsMlaTileElems, kDsMlaTileElems, scales[tile]);
    }
    detail::convert_row(reinterpret_cast<const num::Bf16*>(entry.rope), out + L, R);
  } else if constexpr (detail::kIsFp8<typename Fmt::Latent>) {
    using F = typename Fmt::Latent;
    const float scale = detail::scale_or_one(cache.scale);
    dequantize_row<F>(entry.latent, out, L, scale);
    dequantize_row<F>(entry.rope, out + L, R, scale);
  } else {
    using C = typename Fmt::Latent;
    detail::convert_row(reinterpret_cast<const C*>(entry.latent), out, L);
    detail::convert_row(reinterpret_cast<const C*>(entry.rope), out + L, R);
  }
}

template <typename Fmt, typename O>
void gather_impl(const GatherCacheArgs& a, const Context& ctx) {
  const int64_t L = a.kv_lora_rank;
  const int64_t R = a.rope_dim;
  const int64_t D = L + R;
  const int64_t rope_offset = detail::rope_offset_bytes<Fmt>(L);
  const int64_t bytes = a.num_rows * D * static_cast<int64_t>(sizeof(O)) * 2;
  const int threads = detail::threads_for(ctx, bytes, a.num_rows);
  O* out_base = static_cast<O*>(a.out);
  auto zero_row = [&](O* out) { std::memset(out, 0, static_cast<size_t>(D) * sizeof(O)); };

  if (!a.sequences) {
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      const DefaultFloatEnv float_env;
      ErrorTally tally;
#pragma omp for schedule(static) nowait
      for (int64_t i = 0; i < a.num_rows; ++i) {
        O* out = out_base + i * a.stride_out_token;
        const int64_t slot = detail::read_index(a.slots, i);
        if (slot < 0 || slot >= a.cache.num_slots) {
          if (slot >= 0) tally.add(kBadSlot);
          zero_row(out);
          continue;
        }
        read_entry<Fmt>(a.cache, detail::cache_entry(a.cache, slot, rope_offset), out, L, R);
      }
      tally.flush(a.error_counts);
    }
    return;
  }

#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const DefaultFloatEnv float_env;
    ErrorTally tally;
    for (int64_t b = 0; b < a.num_seqs; ++b) {
      const int64_t begin = a.cu_seq_lens[b];
      const int64_t end = std::min<int64_t>(a.cu_seq_lens[b + 1], a.num_rows);
      if (begin < 0 || end <= begin) continue;
#pragma omp for schedule(static) nowait
      for (int64_t row = begin; row < end; ++row) {
        const int64_t i = row - begin;
        O* out = out_base + row * a.stride_out_token;
        const int64_t block_index = i / a.cache.block_size;
        const int64_t block = block_index < a.max_blocks_per_seq
                                  ? a.block_table[b * a.stride_block_table_seq + block_index]
                                  : -1;
        if (block < 0 || block >= a.num_blocks) {
          tally.add(kBadBlockIndex);
          zero_row(out);
          continue;
        }
        const detail::EntryPtrs entry =
            detail::cache_entry_at(a.cache, block, i % a.cache.block_size, rope_offset);
        read_entry<Fmt>(a.cache, entry, out, L, R);
      }
    }
    tally.flush(a.error_counts);
  }
}

}  // namespace

void gather_cache(const core::GatherCacheArgs& args, const Context& ctx) {
  if (args.num_rows <= 0) return;
  detail::dispatch_cache_format(args.cache.format, [&](auto fmt) {
    using Fmt = decltype(fmt);
    switch (args.out_dtype) {
      case DType::kFloat32:
        gather_impl<Fmt, float>(args, ctx);
        return;
      case DType::kBFloat16:
        gather_impl<Fmt, num::Bf16>(args, ctx);
        return;
      default:
        MLAKV_FAIL("out: expected float32 or bfloat16, got ", dtype_name(args.out_dtype));
    }
  });
}

}  // namespace cpu
}  // namespace mlakv
