// The unfused primitives on the CPU (rotary_embedding, concat_and_cache_mla, decode_q_concat,
// rms_norm), sharing the fused op's row kernels so that both paths write identical bytes.
#include <algorithm>
#include <cstring>

#include "core/backend.h"
#include "cpu/cpu_common.h"

namespace mlakv {
namespace cpu {
namespace {

using detail::CosSin;
using detail::ErrorTally;

template <typename T>
void rotary_embedding_impl(const core::RotaryEmbeddingArgs& a, const Context& ctx) {
  const int64_t T_count = a.num_tokens;
  const int64_t R = a.rot_dim;
  const int64_t heads = a.num_q_heads + (a.key != nullptr ? a.num_k_heads : 0);
  const int64_t bytes = T_count * heads * R * static_cast<int64_t>(sizeof(T)) * 2;
  const int threads = detail::threads_for(ctx, bytes, T_count);

#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const DefaultFloatEnv float_env;
    ErrorTally tally;
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < T_count; ++t) {
      const int64_t pos = detail::clamped_position(a.positions, a.rope, t, &tally);
      CosSin cs;
      detail::load_cos_sin(a.rope, pos, R, cs);
      for (int64_t h = 0; h < a.num_q_heads; ++h) {
        T* q = static_cast<T*>(a.query) + t * a.stride_query_token + h * a.stride_query_head;
        detail::rope_row(q, q, cs, R);
      }
      if (a.key != nullptr) {
        for (int64_t h = 0; h < a.num_k_heads; ++h) {
          T* k = static_cast<T*>(a.key) + t * a.stride_key_token + h * a.stride_key_head;
          detail::rope_row(k, k, cs, R);
        }
      }
    }
    tally.flush(a.error_counts);
  }
}

template <typename T, typename Fmt>
void concat_and_cache_mla_impl(const core::ConcatAndCacheMlaArgs& a, const Context& ctx) {
  const int64_t L = a.kv_lora_rank;
  const int64_t R = a.rope_dim;
  const int64_t bytes = a.num_tokens * (L + R) * static_cast<int64_t>(sizeof(T)) * 2;
  const int threads = detail::threads_for(ctx, bytes, a.num_tokens);

#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const DefaultFloatEnv float_env;
    ErrorTally tally;
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < a.num_tokens; ++t) {
      const T* kv_c = static_cast<const T*>(a.kv_c) + t * a.stride_kv_c_token;
      const T* k_pe = static_cast<const T*>(a.k_pe) + t * a.stride_k_pe_token;
      detail::write_slot<Fmt>(a.cache, detail::read_index(a.slot_mapping, t), kv_c, k_pe, L, R,
                              tally);
    }
    tally.flush(a.error_counts);
  }
}

template <typename T, typename QOut>
void decode_q_concat_impl(const core::DecodeQConcatArgs& a, const Context& ctx) {
  const int64_t L = a.kv_lora_rank;
  const int64_t R = a.rope_dim;
  const int64_t H = a.num_heads;
  const float q_scale = detail::scale_or_one(a.q_scale);
  const bool copy_nope = a.ql_nope != nullptr;
  const bool copy_rope = a.q_pe != nullptr;
  const int64_t chunks = (H + detail::kHeadChunk - 1) / detail::kHeadChunk;
  const int64_t items = a.num_tokens * chunks;
  const int64_t bytes = a.num_tokens * H * ((copy_nope ? L : 0) + (copy_rope ? R : 0)) *
                        static_cast<int64_t>(sizeof(T)) * 2;
  const int threads = detail::threads_for(ctx, bytes, items);

#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const DefaultFloatEnv float_env;
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < items; ++i) {
      const int64_t t = i / chunks;
      const int64_t h0 = (i % chunks) * detail::kHeadChunk;
      const int64_t h1 = std::min(H, h0 + detail::kHeadChunk);
      for (int64_t h = h0; h < h1; ++h) {
        QOut* out =
            static_cast<QOut*>(a.q_out) + t * a.stride_q_out_token + h * a.stride_q_out_head;
        if (copy_nope) {
          const T* ql_nope = static_cast<const T*>(a.ql_nope) + t * a.stride_ql_nope_token +
                             h * a.stride_ql_nope_head;
          if (detail::kIsFp8<QOut> && h + 1 < h1) {  // as decode_q_item (mla_rope_cache.cpp)
            detail::prefetch_read(ql_nope + a.stride_ql_nope_head,
                                  L * static_cast<int64_t>(sizeof(T)));
          }
          detail::store_row(ql_nope, out, L, q_scale);
        }
        if (copy_rope) {
          const T* q_pe =
              static_cast<const T*>(a.q_pe) + t * a.stride_q_pe_token + h * a.stride_q_pe_head;
          detail::store_row(q_pe, out + L, R, q_scale);
        }
      }
    }
  }
}

template <typename T>
void rms_norm_impl(const core::RmsNormArgs& a, const Context& ctx) {
  const int64_t N = a.hidden;
  const int64_t bytes = a.num_tokens * N * static_cast<int64_t>(sizeof(T)) * 2;
  const int threads = detail::threads_for(ctx, bytes, a.num_tokens);
  const T* weight = static_cast<const T*>(a.weight);

#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const DefaultFloatEnv float_env;
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < a.num_tokens; ++t) {
      const T* in = static_cast<const T*>(a.input) + t * a.stride_input_token;
      T* out = static_cast<T*>(a.output) + t * a.stride_output_token;
      const float inv_rms = num::rms_inv(detail::sum_squares(in, N), N, a.eps);
      detail::rms_apply_row(in, weight, out, N, inv_rms);
    }
  }
}

}  // namespace

void rotary_embedding(const core::RotaryEmbeddingArgs& args, const Context& ctx) {
  if (args.num_tokens <= 0) return;
  MLAKV_CHECK(args.rot_dim <= detail::kMaxRope,
              "cos_sin_cache: expected rot_dim <= ", detail::kMaxRope, " on the CPU backend, got ",
              args.rot_dim);
  detail::dispatch_model_dtype(args.model_dtype, "query", [&](auto model_tag) {
    rotary_embedding_impl<decltype(model_tag)>(args, ctx);
  });
}

void concat_and_cache_mla(const core::ConcatAndCacheMlaArgs& args, const Context& ctx) {
  if (args.num_tokens <= 0) return;
  detail::dispatch_model_dtype(args.model_dtype, "kv_c", [&](auto model_tag) {
    detail::dispatch_cache_format(args.cache.format, [&](auto fmt) {
      concat_and_cache_mla_impl<decltype(model_tag), decltype(fmt)>(args, ctx);
    });
  });
}

void decode_q_concat(const core::DecodeQConcatArgs& args, const Context& ctx) {
  if (args.num_tokens <= 0 || args.num_heads <= 0) return;
  detail::dispatch_model_dtype(args.model_dtype, "ql_nope", [&](auto model_tag) {
    using T = decltype(model_tag);
    detail::dispatch_value_dtype(args.q_out_dtype, "q_out", [&](auto q_out_tag) {
      using QOut = decltype(q_out_tag);
      if constexpr (detail::kIsFp8<QOut> || std::is_same_v<QOut, T>) {
        decode_q_concat_impl<T, QOut>(args, ctx);
      } else {
        MLAKV_FAIL("q_out: expected the model dtype of ql_nope or a float8 dtype, got ",
                   dtype_name(args.q_out_dtype));
      }
    });
  });
}

void rms_norm(const core::RmsNormArgs& args, const Context& ctx) {
  if (args.num_tokens <= 0) return;
  detail::dispatch_model_dtype(args.model_dtype, "input", [&](auto model_tag) {
    rms_norm_impl<decltype(model_tag)>(args, ctx);
  });
}

int vector_bytes() { return static_cast<int>(detail::kVecBytes); }

}  // namespace cpu
}  // namespace mlakv
