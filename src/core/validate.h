// mlakv internal: argument validation of the public ops.
//
// Each validate_* function checks every argument of one op (shapes, dtypes, strides, alignment,
// devices, supported combinations) and returns the resolved core::*Args the backends consume, plus
// the device the op runs on. It throws mlakv::Error naming the argument ("op: arg: expected ...,
// got ...") and never writes anything, so an op that rejects its arguments leaves every output and
// the cache untouched. `op` is the public entry point's name, used as the message prefix.
#pragma once

#include "core/args.h"
#include "mlakv/context.h"
#include "mlakv/ops.h"
#include "mlakv/tensor.h"

namespace mlakv {
namespace core {

MlaRopeCacheArgs validate_mla_rope_cache(const char* op, const MlaRopeCacheParams& params,
                                         const Context& ctx, Device* device);
RotaryEmbeddingArgs validate_rotary_embedding(const char* op, const RotaryEmbeddingParams& params,
                                              const Context& ctx, Device* device);
ConcatAndCacheMlaArgs validate_concat_and_cache_mla(const char* op,
                                                    const ConcatAndCacheMlaParams& params,
                                                    const Context& ctx, Device* device);
DecodeQConcatArgs validate_decode_q_concat(const char* op, const DecodeQConcatParams& params,
                                           const Context& ctx, Device* device);
RmsNormArgs validate_rms_norm(const char* op, const RmsNormParams& params, const Context& ctx,
                              Device* device);
GatherCacheArgs validate_gather_cache_slots(const char* op, const GatherCacheSlotsParams& params,
                                            const Context& ctx, Device* device);
GatherCacheArgs validate_gather_cache_sequences(const char* op,
                                                const GatherCacheSequencesParams& params,
                                                const Context& ctx, Device* device);

// The error-counter buffer of reset_error_counts / read_error_counts.
void validate_error_counts(const char* op, const int32_t* error_counts, Device device);

}  // namespace core
}  // namespace mlakv
