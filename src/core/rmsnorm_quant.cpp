// mlakv: validation and dispatch of rmsnorm_quant, mla_rmsnorm_quant and per_token_group_quant_fp8.
//
// Every argument is checked before any backend runs, so a rejected call writes nothing. Messages
// read "<op>: <argument>: expected ..., got ...".
#include "mlakv/rmsnorm_quant.h"

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <string>

#include "core/backend.h"
#include "core/rmsnorm_quant_args.h"
#include "core/spans.h"
#include "mlakv/error.h"

namespace mlakv {
namespace {

constexpr int64_t kVectorBytes = 16;
// Backends move rows in chunks of 8 elements; a group is 2 to 32 chunks (lanes of one warp).
constexpr int64_t kChunkElems = 8;
constexpr int64_t kMinGroupSize = 16;
constexpr int64_t kMaxGroupSize = 256;

bool is_pow2(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

class Validator {
 public:
  Validator(const char* op, int64_t num_tokens) : op_(op), num_tokens_(num_tokens) {}

  [[noreturn]] void fail(const std::string& arg, const std::string& what) const {
    MLAKV_FAIL(op_, ": ", arg, ": ", what);
  }

  // All tensors of an op share one device; the first one checked sets it.
  void check_device(const std::string& arg, const TensorView& v) {
    if (!have_device_) {
      device_ = v.device;
      have_device_ = true;
      if (device_.type != DeviceType::kCPU && device_.type != DeviceType::kCUDA) {
        fail(arg, "expected a cpu or cuda device, got " + device_name(device_));
      }
      if (device_.type == DeviceType::kCUDA && device_.index < 0) {
        fail(arg, "expected a CUDA device index >= 0, got " + v.describe());
      }
#ifndef MLAKV_WITH_CUDA
      if (device_.type == DeviceType::kCUDA) {
        fail(arg, "expected a cpu tensor (mlakv was built without the CUDA backend), got " +
                      v.describe());
      }
#endif
      return;
    }
    if (v.device != device_) {
      fail(arg, "expected a tensor on " + device_name(device_) +
                    " (the device of the op's other tensors), got " + v.describe());
    }
  }

  void check_aligned(const std::string& arg, const TensorView& v, int64_t bytes) const {
    if (reinterpret_cast<uintptr_t>(v.data) % static_cast<uintptr_t>(bytes) != 0) {
      fail(arg, "expected a data pointer aligned to " + std::to_string(bytes) + " bytes, got " +
                    pointer_string(v.data) + " (" + v.describe() + ")");
    }
  }

  // The view's bytes fit below core::kMaxExtentBytes from its address (spans.h); sizes are checked
  // non-negative first, and the strides of dims of size > 1 positive, as for every op
  // (validate.cpp), even where the op reads one row only (T <= 1 of a tensor with padding rows).
  // An empty view addresses nothing: its strides may be anything (column-major scales of 0 rows
  // have the group stride 0, see column_major_scales_view).
  void check_extent(const std::string& arg, const TensorView& v) const {
    bool empty = false;
    for (int d = 0; d < v.ndim; ++d) {
      if (v.shape[d] < 0) fail(arg, "expected sizes >= 0, got " + v.describe());
      empty = empty || v.shape[d] == 0;
    }
    for (int d = 0; d < v.ndim && !empty; ++d) {
      if (v.shape[d] > 1 && v.stride[d] <= 0) {
        fail(arg, "expected positive strides (any on size-1 dims or in an empty view), got " +
                      v.describe());
      }
    }
    int64_t bytes = 0;
    if (!core::extent_bytes(v, &bytes)) {
      const std::string limit = "2^" + std::to_string(core::kMaxExtentLog2);
      fail(arg, "expected a view within " + limit +
                    " bytes (sizes, strides and the bytes spanned from its address below " + limit +
                    "), got " + v.describe() + " at address " + pointer_string(v.data));
    }
  }

  // A [>=T, N] per-token tensor of `dtype`, innermost stride 1, 16-byte aligned rows.
  void check_rows(const std::string& arg, const TensorView& v, DType dtype, int64_t N,
                  const char* dtype_text) {
    if (!v.present()) fail(arg, "expected a " + std::string(dtype_text) + " tensor, got none");
    if (v.ndim != 2) {
      fail(arg, "expected 2 dims [>=" + std::to_string(num_tokens_) + ", " + std::to_string(N) +
                    "], got " + v.describe());
    }
    check_device(arg, v);
    if (v.dtype != dtype) {
      fail(arg, "expected dtype " + std::string(dtype_name(dtype)) + ", got " + v.describe());
    }
    if (v.shape[0] < num_tokens_ || v.shape[1] != N) {
      fail(arg, "expected shape [>=" + std::to_string(num_tokens_) + ", " + std::to_string(N) +
                    "], got " + v.describe());
    }
    if (v.stride[1] != 1) fail(arg, "expected innermost stride 1, got " + v.describe());
    check_extent(arg, v);
    if (num_tokens_ > 1 && v.stride[0] < N) {
      fail(arg, "expected a row stride >= " + std::to_string(N) + " (rows must not overlap), got " +
                    v.describe());
    }
    const int64_t elem = static_cast<int64_t>(dtype_size(dtype));
    if (core::canonical_stride(v, 0) % (kVectorBytes / elem) != 0) {
      fail(arg, "expected a row stride that is a multiple of " +
                    std::to_string(kVectorBytes / elem) + " elements (16 bytes), got " +
                    v.describe());
    }
    if (num_tokens_ > 0 && v.data == nullptr) fail(arg, "expected non-null data, got nullptr");
    check_aligned(arg, v, kVectorBytes);
  }

  // The RMSNorm weight: [N], contiguous, model dtype, 16-byte aligned.
  void check_weight(const std::string& arg, const TensorView& v, DType dtype, int64_t N) {
    if (!v.present()) fail(arg, "expected a [" + std::to_string(N) + "] weight, got none");
    check_device(arg, v);
    if (v.ndim != 1 || v.shape[0] != N) {
      fail(arg, "expected shape [" + std::to_string(N) + "], got " + v.describe());
    }
    if (v.dtype != dtype) {
      fail(arg, "expected dtype " + std::string(dtype_name(dtype)) +
                    " (the dtype of the input), got " + v.describe());
    }
    if (N > 1 && v.stride[0] != 1) fail(arg, "expected stride 1, got " + v.describe());
    check_extent(arg, v);
    if (v.data == nullptr) fail(arg, "expected non-null data, got nullptr");
    check_aligned(arg, v, kVectorBytes);
  }

  Device device() const { return device_; }

 private:
  static std::string pointer_string(const void* p) { return detail::concat(p); }

  const char* op_;
  int64_t num_tokens_;
  Device device_{};
  bool have_device_ = false;
};

// Validates one RMSNorm (+ quantization) job; fills `task` and adds its tensors to `m`.
// `prefix` names the job's arguments ("" or "q." / "kv.").
// `required_dtype` (the dual form's kv part) must match the q part's model dtype. An output named
// `normed_out_name` that is exactly the input is allowed to be it.
void validate_task(const std::string& prefix, int64_t num_tokens, const TensorView& input,
                   const TensorView* weight, float eps, const TensorView* residual,
                   const TensorView* normed_out, const std::string& normed_out_name,
                   const Fp8GroupQuantOutput* quant, const DType* required_dtype, Validator& v,
                   core::RmsNormQuantTask& task, core::MemoryCheck& m) {
  const std::string& p = prefix;
  if (num_tokens < 0) v.fail(p + "num_tokens", "expected >= 0, got " + std::to_string(num_tokens));
  if (!input.present()) v.fail(p + "input", "expected a [T, N] model-dtype tensor, got none");
  if (input.ndim != 2) v.fail(p + "input", "expected 2 dims [T, N], got " + input.describe());
  if (!is_model_dtype(input.dtype)) {
    v.fail(p + "input", "expected dtype bfloat16, float16 or float32, got " + input.describe());
  }
  if (required_dtype != nullptr && *required_dtype != input.dtype) {
    v.fail(p + "input", "expected dtype " + std::string(dtype_name(*required_dtype)) +
                            " (the dtype of q.input), got " + input.describe());
  }
  const DType dt = input.dtype;
  const int64_t N = input.shape[1];
  if (N <= 0 || N > kMaxRmsNormQuantHidden) {
    v.fail(p + "input", "expected a hidden size N in [1, " +
                            std::to_string(kMaxRmsNormQuantHidden) + "], got " + input.describe());
  }
  if (N % kChunkElems != 0) {
    v.fail(p + "input", "expected a hidden size N that is a multiple of " +
                            std::to_string(kChunkElems) + ", got " + input.describe());
  }
  v.check_rows(p + "input", input, dt, N, "model-dtype");

  task.num_tokens = num_tokens;
  task.hidden = N;
  task.input = input.data;
  task.stride_input_token = core::canonical_stride(input, 0);
  const char* input_name = m.name(p + "input");
  m.input(core::span_of(input_name, input, num_tokens));

  if (weight != nullptr) {
    v.check_weight(p + "weight", *weight, dt, N);
    if (!std::isfinite(eps) || eps < 0.0f) {
      v.fail(p + "eps", "expected a finite value >= 0, got " + detail::concat(eps));
    }
    task.weight = weight->data;
    task.eps = eps;
    m.input(core::span_of(m.name(p + "weight"), *weight));
  }

  if (residual != nullptr && residual->present()) {
    v.check_rows(p + "residual", *residual, dt, N, "model-dtype");
    task.residual = residual->data;
    task.stride_residual_token = core::canonical_stride(*residual, 0);
    m.output(m.name(p + "residual"), *residual, num_tokens);
  }

  if (normed_out != nullptr && normed_out->present()) {
    const std::string on = p + normed_out_name;
    v.check_rows(on, *normed_out, dt, N, "model-dtype");
    task.normed_out = normed_out->data;
    task.stride_normed_out_token = core::canonical_stride(*normed_out, 0);
    const bool in_place = normed_out->data == input.data &&
                          (normed_out->stride[0] == input.stride[0] || num_tokens <= 1);
    const char* out_name = m.name(on);
    if (in_place) m.allow(out_name, input_name);
    m.output(out_name, *normed_out, num_tokens);
  }

  if (quant == nullptr) return;
  const int64_t G = quant->group_size;
  if (!is_pow2(G) || G < kMinGroupSize || G > kMaxGroupSize) {
    v.fail(p + "quant.group_size", "expected a power of two in [" + std::to_string(kMinGroupSize) +
                                       ", " + std::to_string(kMaxGroupSize) + "], got " +
                                       std::to_string(G));
  }
  if (N % G != 0) {
    v.fail(p + "quant.group_size", "expected a divisor of the hidden size N = " +
                                       std::to_string(N) + ", got " + std::to_string(G));
  }
  if (!std::isfinite(quant->scale_floor) || !(quant->scale_floor >= FLT_MIN)) {
    v.fail(p + "quant.scale_floor",
           "expected a finite normal value >= FLT_MIN, got " + detail::concat(quant->scale_floor));
  }
  v.check_rows(p + "quant.values", quant->values, DType::kFloat8E4M3, N, "float8_e4m3fn");

  const int64_t num_groups = N / G;
  const TensorView& s = quant->scales;
  const std::string sn = p + "quant.scales";
  const std::string shape_text =
      "[>=" + std::to_string(num_tokens) + ", " + std::to_string(num_groups) + "]";
  if (!s.present()) v.fail(sn, "expected a float32 " + shape_text + " tensor, got none");
  if (s.ndim != 2) v.fail(sn, "expected 2 dims " + shape_text + ", got " + s.describe());
  v.check_device(sn, s);
  if (s.dtype != DType::kFloat32) v.fail(sn, "expected dtype float32, got " + s.describe());
  if (s.shape[0] < num_tokens || s.shape[1] != num_groups) {
    v.fail(sn, "expected shape " + shape_text + " (N / group_size = " + std::to_string(N) + " / " +
                   std::to_string(G) + " groups), got " + s.describe());
  }
  v.check_extent(sn, s);
  const int64_t rows = s.shape[0];
  // The stride of a size-1 dim (one row, or one group: N == G) takes part in neither test.
  const bool row_major =
      (s.stride[1] == 1 || num_groups <= 1) && (s.stride[0] >= num_groups || rows <= 1);
  const bool col_major =
      (s.stride[0] == 1 || rows <= 1) && (s.stride[1] >= rows || num_groups <= 1);
  if (!row_major && !col_major) {
    v.fail(sn, "expected row-major strides [>=" + std::to_string(num_groups) +
                   ", 1] or column-major strides [1, >=" + std::to_string(rows) +
                   "] (the group stride must cover the view's rows), got " + s.describe());
  }
  if (num_tokens > 0 && s.data == nullptr) v.fail(sn, "expected non-null data, got nullptr");
  v.check_aligned(sn, s, 4);

  task.quant_values = static_cast<uint8_t*>(quant->values.data);
  task.stride_quant_values_token = core::canonical_stride(quant->values, 0);
  task.scales = static_cast<float*>(s.data);
  // The layout is chosen from the caller's strides (above); the task gets the canonical ones.
  task.stride_scales_token = row_major ? core::canonical_stride(s, 0) : 1;
  task.stride_scales_group = row_major ? 1 : core::canonical_stride(s, 1);
  task.group_size = G;
  task.scale_floor = quant->scale_floor;
  task.pow2_scale = quant->pow2_scale;

  m.output(m.name(p + "quant.values"), quant->values, num_tokens);
  m.output(m.name(sn), s, num_tokens);
}

// The Context fields these ops use (they count no errors: error_counts and checked are unused).
void check_context(const char* op, const Context& ctx) {
  MLAKV_CHECK(ctx.num_threads >= 0, op, ": ctx.num_threads: expected >= 0 (0 = all threads), got ",
              ctx.num_threads);
}

void dispatch(const char* op, const core::RmsNormQuantArgs& args, Device device,
              const Context& ctx) {
  bool any = false;
  for (int i = 0; i < args.num_tasks; ++i) any = any || args.tasks[i].num_tokens > 0;
  if (!any) return;
  MLAKV_DISPATCH(rmsnorm_quant, op, device, args, ctx);
}

}  // namespace

namespace core {

RmsNormQuantArgs validate_rmsnorm_quant(const RmsNormQuantParams& params, const Context& ctx,
                                        Device* device) {
  constexpr const char* kOp = "rmsnorm_quant";
  Validator v(kOp, params.num_tokens);
  RmsNormQuantArgs args;
  args.num_tasks = 1;
  MemoryCheck m(kOp);
  validate_task("", params.num_tokens, params.input, &params.weight, params.eps, &params.residual,
                &params.normed_out, "normed_out", &params.quant, nullptr, v, args.tasks[0], m);
  args.model_dtype = params.input.dtype;
  m.check();
  check_context(kOp, ctx);
  *device = v.device();
  return args;
}

}  // namespace core

void rmsnorm_quant(const RmsNormQuantParams& params, const Context& ctx) {
  Device device;
  const core::RmsNormQuantArgs args = core::validate_rmsnorm_quant(params, ctx, &device);
  dispatch("rmsnorm_quant", args, device, ctx);
}

void mla_rmsnorm_quant(const MlaRmsNormQuantParams& params, const Context& ctx) {
  constexpr const char* kOp = "mla_rmsnorm_quant";
  core::RmsNormQuantArgs args;
  args.num_tasks = 2;
  core::MemoryCheck m(kOp);
  Validator vq(kOp, params.q.num_tokens);
  validate_task("q.", params.q.num_tokens, params.q.input, &params.q.weight, params.q.eps,
                &params.q.residual, &params.q.normed_out, "normed_out", &params.q.quant, nullptr,
                vq, args.tasks[0], m);
  args.model_dtype = params.q.input.dtype;
  // The kv part continues the q part's device check: one op, one device.
  Validator vkv(kOp, params.kv.num_tokens);
  vkv.check_device("q.input", params.q.input);
  if (!params.kv.output.present()) {
    vkv.fail("kv.output", "expected a [T, N] model-dtype tensor (may be kv.input), got none");
  }
  validate_task("kv.", params.kv.num_tokens, params.kv.input, &params.kv.weight, params.kv.eps,
                nullptr, &params.kv.output, "output", nullptr, &args.model_dtype, vkv,
                args.tasks[1], m);
  m.check();
  check_context(kOp, ctx);
  dispatch(kOp, args, vq.device(), ctx);
}

void per_token_group_quant_fp8(const PerTokenGroupQuantParams& params, const Context& ctx) {
  constexpr const char* kOp = "per_token_group_quant_fp8";
  Validator v(kOp, params.num_tokens);
  core::RmsNormQuantArgs args;
  args.num_tasks = 1;
  core::MemoryCheck m(kOp);
  validate_task("", params.num_tokens, params.input, nullptr, 0.0f, nullptr, nullptr, "",
                &params.quant, nullptr, v, args.tasks[0], m);
  args.model_dtype = params.input.dtype;
  m.check();
  check_context(kOp, ctx);
  dispatch(kOp, args, v.device(), ctx);
}

TensorView column_major_scales_view(float* data, int64_t num_rows, int64_t num_groups,
                                    int64_t stride_group, Device device) {
  MLAKV_CHECK(num_rows >= 0 && num_groups >= 0,
              "column_major_scales_view: num_rows / num_groups: expected >= 0, got ", num_rows,
              " / ", num_groups);
  MLAKV_CHECK(stride_group >= num_rows,
              "column_major_scales_view: stride_group: expected >= ", num_rows, " (num_rows), got ",
              stride_group);
  return make_strided_view(data, DType::kFloat32, {num_rows, num_groups}, {1, stride_group},
                           device);
}

}  // namespace mlakv
