// mlakv internal: the resolved arguments of rmsnorm_quant, mla_rmsnorm_quant and
// per_token_group_quant_fp8 (the backends' entry point: core/backend.h; the group-scale rule both
// backends share is num::group_scale, src/common/numerics.h).
//
// All three public ops become one RmsNormQuantArgs of one or two row jobs ("tasks"): the dual form
// is two tasks in one launch. src/core/rmsnorm_quant.cpp validates and fills it; backends never
// re-validate. Strides are in elements of the tensor's own dtype; the innermost stride is 1 except
// for the scales, whose two strides are both given.
#pragma once

#include <cstdint>

#include "mlakv/context.h"
#include "mlakv/rmsnorm_quant.h"
#include "mlakv/tensor.h"

namespace mlakv {
namespace core {

// One row job: rows t < num_tokens of one [T, N] tensor.
struct RmsNormQuantTask {
  int64_t num_tokens = 0;  // T (0: nothing to do)
  int64_t hidden = 0;      // N

  const void* input = nullptr;  // [T, N], model dtype
  int64_t stride_input_token = 0;
  void* residual = nullptr;  // [T, N], model dtype, or nullptr; receives round(x + residual)
  int64_t stride_residual_token = 0;
  const void* weight = nullptr;  // [N], model dtype; nullptr: no normalization (y = x)
  float eps = 1e-6f;
  void* normed_out = nullptr;  // [T, N], model dtype, or nullptr; may equal input
  int64_t stride_normed_out_token = 0;

  uint8_t* quant_values = nullptr;  // [T, N], e4m3 bytes, or nullptr: no quantization
  int64_t stride_quant_values_token = 0;
  float* scales = nullptr;  // scale of (t, g) at t * stride_scales_token + g * stride_scales_group
  int64_t stride_scales_token = 0;
  int64_t stride_scales_group = 0;
  int64_t group_size = 128;  // G, a power of two in [16, 256]
  float scale_floor = 0.0f;
  bool pow2_scale = false;
};

struct RmsNormQuantArgs {
  DType model_dtype = DType::kBFloat16;
  int32_t num_tasks = 0;  // 1, or 2 for the dual form (task 0: q_c, task 1: kv_c)
  RmsNormQuantTask tasks[2];
};

// rmsnorm_quant's validation (src/core/rmsnorm_quant.cpp): the args its backends get and the
// device, or mlakv::Error naming the argument. Exposed for the tests of the resolved arguments.
RmsNormQuantArgs validate_rmsnorm_quant(const RmsNormQuantParams& params, const Context& ctx,
                                        Device* device);

}  // namespace core

}  // namespace mlakv
