// mlakv: the public ops: validate everything, then dispatch on the tensors' device.
#include "mlakv/ops.h"

#include <cstring>
#include <string>

#include "core/backend.h"
#include "core/validate.h"
#include "mlakv/error.h"

namespace mlakv {
namespace {

void copy_counts(const int32_t* error_counts, Device device, int32_t* host_out, void* stream) {
  if (device.type == DeviceType::kCPU) {
    std::memcpy(host_out, error_counts, sizeof(int32_t) * kNumErrorCounters);
    return;
  }
#ifdef MLAKV_WITH_CUDA
  cuda::read_error_counts(error_counts, device.index, host_out, stream);
#else
  MLAKV_FAIL("read_error_counts: device: ", device_name(device),
             " given but mlakv was built without the CUDA backend");
#endif
}

// Context::checked: the counters before and after the op; every counter that grew is an error.
template <typename Run>
void run_checked(const char* op, Device device, const Context& ctx, Run&& run) {
  if (!ctx.checked) {
    run();
    return;
  }
  int32_t before[kNumErrorCounters];
  int32_t after[kNumErrorCounters];
  copy_counts(ctx.error_counts, device, before, ctx.stream);
  run();
  copy_counts(ctx.error_counts, device, after, ctx.stream);
  std::string grown;
  for (int32_t i = 0; i < kNumErrorCounters; ++i) {
    if (after[i] != before[i]) {
      grown += detail::concat(grown.empty() ? "" : ", ", error_counter_name(i), " +",
                              static_cast<int64_t>(after[i]) - before[i]);
    }
  }
  MLAKV_CHECK(grown.empty(), op, ": checked mode: the op counted errors (", grown,
              "); see ctx.error_counts");
}

void run_mla_rope_cache(const char* op, const MlaRopeCacheParams& params, const Context& ctx) {
  Device device;
  const core::MlaRopeCacheArgs args = core::validate_mla_rope_cache(op, params, ctx, &device);
  run_checked(op, device, ctx, [&] { MLAKV_DISPATCH(mla_rope_cache, op, device, args, ctx); });
}

}  // namespace

void mla_rope_cache(const MlaRopeCacheParams& params, const Context& ctx) {
  run_mla_rope_cache("mla_rope_cache", params, ctx);
}

void mla_rope_cache_decode(MlaRopeCacheParams params, const Context& ctx) {
  params.num_decode_tokens = params.num_tokens;
  params.num_decode_tokens_device = nullptr;
  run_mla_rope_cache("mla_rope_cache_decode", params, ctx);
}

void mla_rope_cache_prefill(MlaRopeCacheParams params, const Context& ctx) {
  MLAKV_CHECK(params.q.present(), "mla_rope_cache_prefill: q: expected 3 dims [T, H, P + R] ",
              "(the prefill Q side), got absent");
  params.num_decode_tokens = 0;
  params.num_decode_tokens_device = nullptr;
  run_mla_rope_cache("mla_rope_cache_prefill", params, ctx);
}

void mla_rope_cache_mixed(const MlaRopeCacheParams& params, const Context& ctx) {
  run_mla_rope_cache("mla_rope_cache_mixed", params, ctx);
}

void rotary_embedding(const RotaryEmbeddingParams& params, const Context& ctx) {
  const char* op = "rotary_embedding";
  Device device;
  const core::RotaryEmbeddingArgs args = core::validate_rotary_embedding(op, params, ctx, &device);
  run_checked(op, device, ctx, [&] { MLAKV_DISPATCH(rotary_embedding, op, device, args, ctx); });
}

void concat_and_cache_mla(const ConcatAndCacheMlaParams& params, const Context& ctx) {
  const char* op = "concat_and_cache_mla";
  Device device;
  const core::ConcatAndCacheMlaArgs args =
      core::validate_concat_and_cache_mla(op, params, ctx, &device);
  run_checked(op, device, ctx,
              [&] { MLAKV_DISPATCH(concat_and_cache_mla, op, device, args, ctx); });
}

void decode_q_concat(const DecodeQConcatParams& params, const Context& ctx) {
  const char* op = "decode_q_concat";
  Device device;
  const core::DecodeQConcatArgs args = core::validate_decode_q_concat(op, params, ctx, &device);
  run_checked(op, device, ctx, [&] {
    // Both parts already in q_out: nothing to do (inside run_checked, which still synchronizes).
    if (args.ql_nope == nullptr && args.q_pe == nullptr) return;
    MLAKV_DISPATCH(decode_q_concat, op, device, args, ctx);
  });
}

void rms_norm(const RmsNormParams& params, const Context& ctx) {
  const char* op = "rms_norm";
  Device device;
  const core::RmsNormArgs args = core::validate_rms_norm(op, params, ctx, &device);
  run_checked(op, device, ctx, [&] { MLAKV_DISPATCH(rms_norm, op, device, args, ctx); });
}

void gather_cache_slots(const GatherCacheSlotsParams& params, const Context& ctx) {
  const char* op = "gather_cache_slots";
  Device device;
  const core::GatherCacheArgs args = core::validate_gather_cache_slots(op, params, ctx, &device);
  run_checked(op, device, ctx, [&] { MLAKV_DISPATCH(gather_cache, op, device, args, ctx); });
}

void gather_cache_sequences(const GatherCacheSequencesParams& params, const Context& ctx) {
  const char* op = "gather_cache_sequences";
  Device device;
  const core::GatherCacheArgs args =
      core::validate_gather_cache_sequences(op, params, ctx, &device);
  run_checked(op, device, ctx, [&] { MLAKV_DISPATCH(gather_cache, op, device, args, ctx); });
}

void reset_error_counts(int32_t* error_counts, Device device, void* stream) {
  core::validate_error_counts("reset_error_counts", error_counts, device);
  if (device.type == DeviceType::kCPU) {
    std::memset(error_counts, 0, sizeof(int32_t) * kNumErrorCounters);
    return;
  }
#ifdef MLAKV_WITH_CUDA
  cuda::reset_error_counts(error_counts, device.index, stream);
#endif
}

void read_error_counts(const int32_t* error_counts, Device device, int32_t* host_out, void* stream,
                       bool throw_if_nonzero) {
  core::validate_error_counts("read_error_counts", error_counts, device);
  MLAKV_CHECK(host_out != nullptr, "read_error_counts: host_out: expected a host int32[",
              kNumErrorCounters, "] buffer, got nullptr");
  copy_counts(error_counts, device, host_out, stream);
  if (!throw_if_nonzero) return;
  std::string nonzero;
  for (int32_t i = 0; i < kNumErrorCounters; ++i) {
    if (host_out[i] != 0) {
      nonzero +=
          detail::concat(nonzero.empty() ? "" : ", ", error_counter_name(i), " = ", host_out[i]);
    }
  }
  MLAKV_CHECK(nonzero.empty(), "read_error_counts: error_counts: non-zero counters: ", nonzero);
}

}  // namespace mlakv
