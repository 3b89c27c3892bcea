// mlakv CPU backend: RMSNorm + FP8 per-token-group quantization (rmsnorm_quant and kin).
//
// Tokens are spread over OpenMP threads; a row is processed in passes over its N values (the row
// stays in L1/L2 between them):
//   1. with a residual: s = round_model(x + residual), written back into the residual;
//   2. the fp32 sum of squares of s, in the CPU backend's one fixed order (detail::sum_squares), so
//      the kv_c part of the dual form equals rms_norm bit for bit;
//   3. per group of G values: y = round_model((s * inv) * w) into a small stack buffer, the group
//      amax, the scale, then the e4m3 bytes (and y into normed_out).
// The CUDA backend sums in the same order: the two agree bit for bit.
#include <omp.h>

#include <cstdint>

#include "common/numerics.h"
#include "core/backend.h"
#include "core/rmsnorm_quant_args.h"
#include "cpu/cpu_common.h"
#include "mlakv/error.h"

namespace mlakv {
namespace cpu {
namespace {

using core::RmsNormQuantTask;

constexpr int64_t kMaxGroupElems = 256;

template <typename T>
float load(const T* p, int64_t j) {
  return num::to_float(p[j]);
}

template <typename T>
void store(T* p, int64_t j, float v) {
  p[j] = num::from_float<T>(v);
}

// residual[t] = round_model(x[t] + residual[t]): the value that is normalized.
template <typename T>
void add_residual(const RmsNormQuantTask& task, int64_t t) {
  const T* x = static_cast<const T*>(task.input) + t * task.stride_input_token;
  T* r = static_cast<T*>(task.residual) + t * task.stride_residual_token;
  for (int64_t j = 0; j < task.hidden; ++j) {
    r[j] = num::from_float<T>(num::add_rn(load(x, j), load(r, j)));
  }
}

template <typename T>
void run_row(const RmsNormQuantTask& task, int64_t t) {
  const int64_t N = task.hidden;
  const bool normalize = task.weight != nullptr;
  if (task.residual != nullptr) add_residual<T>(task, t);
  // From here on the value to normalize lives in the residual (when given), else in the input.
  const T* s = task.residual != nullptr
                   ? static_cast<const T*>(task.residual) + t * task.stride_residual_token
                   : static_cast<const T*>(task.input) + t * task.stride_input_token;
  const float inv = normalize ? num::rms_inv(detail::sum_squares(s, N), N, task.eps) : 1.0f;
  const T* w = static_cast<const T*>(task.weight);
  T* normed = task.normed_out == nullptr
                  ? nullptr
                  : static_cast<T*>(task.normed_out) + t * task.stride_normed_out_token;
  uint8_t* q = task.quant_values == nullptr
                   ? nullptr
                   : task.quant_values + t * task.stride_quant_values_token;

  const int64_t G = q != nullptr ? task.group_size : (N < kMaxGroupElems ? N : kMaxGroupElems);
  float y[kMaxGroupElems];
  for (int64_t g0 = 0; g0 < N; g0 += G) {
    const int64_t len = N - g0 < G ? N - g0 : G;
    if (normalize) {
      for (int64_t j = 0; j < len; ++j) {
        y[j] = num::round_to<T>(num::rms_apply(load(s, g0 + j), inv, load(w, g0 + j)));
      }
    } else {
      for (int64_t j = 0; j < len; ++j) y[j] = load(s, g0 + j);
    }
    // In place (normed == input) is safe: this group's inputs are all read above.
    if (normed != nullptr) {
      for (int64_t j = 0; j < len; ++j) store(normed, g0 + j, y[j]);
    }
    if (q == nullptr) continue;
    const float scale =
        num::group_scale(detail::amax_of(y, len), task.scale_floor, task.pow2_scale);
    task.scales[t * task.stride_scales_token + (g0 / G) * task.stride_scales_group] = scale;
    for (int64_t j = 0; j < len; ++j) {
      q[g0 + j] = num::quantize<num::Fp8E4M3>(y[j], scale).bits;
    }
  }
}

template <typename T>
void run(const core::RmsNormQuantArgs& args, const Context& ctx) {
  const int64_t t0 = args.tasks[0].num_tokens;
  const int64_t total = t0 + (args.num_tasks > 1 ? args.tasks[1].num_tokens : 0);
  int64_t bytes = 0;
  for (int i = 0; i < args.num_tasks; ++i) {
    bytes += args.tasks[i].num_tokens * args.tasks[i].hidden * static_cast<int64_t>(sizeof(T));
  }
  const int threads = detail::threads_for(ctx, bytes, total);
  // Each task's rows are split evenly over the threads, task after task without a barrier between
  // them: a q_c row (quantized, 1536 wide) costs several kv_c rows, so splitting the two tasks'
  // rows as one index space gave one thread all the quantization (the dual form ran at half speed).
#pragma omp parallel num_threads(threads)
  {
    const DefaultFloatEnv float_env;
    for (int k = 0; k < args.num_tasks; ++k) {
      const RmsNormQuantTask& task = args.tasks[k];
#pragma omp for schedule(static) nowait
      for (int64_t t = 0; t < task.num_tokens; ++t) {
        // The next row's first pass (its sum of squares) starts at a cold row otherwise: T = 1024
        // 1.59 -> 1.20 ms on the development machine.
        if (t + 1 < task.num_tokens) {
          detail::prefetch_read(
              static_cast<const T*>(task.input) + (t + 1) * task.stride_input_token,
              task.hidden * static_cast<int64_t>(sizeof(T)));
        }
        run_row<T>(task, t);
      }
    }
  }
}

}  // namespace

void rmsnorm_quant(const core::RmsNormQuantArgs& args, const Context& ctx) {
  switch (args.model_dtype) {
    case DType::kBFloat16:
      run<num::Bf16>(args, ctx);
      return;
    case DType::kFloat16:
      run<num::Half>(args, ctx);
      return;
    case DType::kFloat32:
      run<float>(args, ctx);
      return;
    default:
      MLAKV_FAIL("cpu::rmsnorm_quant: model_dtype: expected bfloat16, float16 or float32, got ",
                 dtype_name(args.model_dtype));
  }
}

}  // namespace cpu
}  // namespace mlakv
