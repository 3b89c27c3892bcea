// mlakv torch binding: torch.ops.mlakv.rmsnorm_quant, mla_rmsnorm_quant and
// per_token_group_quant_fp8 (include/mlakv/rmsnorm_quant.h), CPU and CUDA kernels. Their fake
// kernels, for FakeTensor / torch.compile, are in python/mlakv/_fake.py with every other op's.
//
// Scales: a float32 [T, N / G] tensor, row-major (contiguous) or column-major, e.g.
//   torch.empty(N // G, T_pad, dtype=torch.float32, device=d).t()[:T]    (DeepGEMM's layout)
// The token count is num_tokens when given, else input.size(0). scale_floor None means
// kDefaultScaleFloor (vLLM's scales: max(amax, 1e-10) / 448).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

#include "binding.h"
#include "mlakv/rmsnorm_quant.h"

namespace mlakv {
namespace torch_binding {
namespace {

// T: num_tokens when given, else the rows of `input` (the argument `name` of `op`).
int64_t token_count(const char* op, const char* name, const std::optional<int64_t>& num_tokens,
                    const at::Tensor& input) {
  if (num_tokens.has_value()) return *num_tokens;
  TORCH_CHECK(input.dim() >= 1, "mlakv: ", op, ": ", name, ": expected a [T, N] tensor, got shape ",
              input.sizes());
  return input.size(0);
}

// The core's names of Fp8GroupQuantOutput's fields, as the single-task ops' schemas name them.
constexpr Renames kQuantNames = {{"quant.values", "out"},
                                 {"quant.scales", "scales"},
                                 {"quant.group_size", "group_size"},
                                 {"quant.scale_floor", "scale_floor"}};

// mla_rmsnorm_quant's core names (MlaRmsNormQuantParams' paths), as its schema names them.
constexpr Renames kDualNames = {{"q.input", "q_c"},
                                {"q.weight", "q_weight"},
                                {"q.eps", "q_eps"},
                                {"q.normed_out", "q_normed_out"},
                                {"q.residual", "q_residual"},
                                {"q.quant.values", "q_out"},
                                {"q.quant.scales", "q_scales"},
                                {"q.quant.group_size", "group_size"},
                                {"q.quant.scale_floor", "scale_floor"},
                                {"q.num_tokens", "num_tokens"},
                                {"kv.input", "kv_c"},
                                {"kv.weight", "kv_weight"},
                                {"kv.eps", "kv_eps"},
                                {"kv.output", "kv_c_out"},
                                {"kv.num_tokens", "num_tokens"}};

Fp8GroupQuantOutput quant_output(const at::Tensor& out, const at::Tensor& scales,
                                 int64_t group_size, const std::optional<double>& scale_floor,
                                 bool pow2_scale) {
  Fp8GroupQuantOutput q;
  q.values = to_view("out", out);
  q.scales = to_view("scales", scales);
  q.group_size = group_size;
  q.scale_floor = scale_floor.has_value() ? to_float(*scale_floor) : kDefaultScaleFloor;
  q.pow2_scale = pow2_scale;
  return q;
}

template <typename Env>
void rmsnorm_quant_op(const at::Tensor& input, const at::Tensor& weight, double eps,
                      at::Tensor& out, at::Tensor& scales, int64_t group_size,
                      std::optional<double> scale_floor, bool pow2_scale, const OptTensor& residual,
                      const OptTensor& normed_out, std::optional<int64_t> num_tokens) {
  translate_errors(kQuantNames, [&] {
    Env env("input", input, std::nullopt);
    RmsNormQuantParams p;
    p.num_tokens = token_count("rmsnorm_quant", "input", num_tokens, input);
    p.input = to_view("input", input);
    p.weight = to_view("weight", weight);
    p.eps = to_float(eps);
    p.residual = to_view("residual", residual);
    p.normed_out = to_view("normed_out", normed_out);
    p.quant = quant_output(out, scales, group_size, scale_floor, pow2_scale);
    rmsnorm_quant(p, env.ctx);
  });
}

template <typename Env>
void mla_rmsnorm_quant_op(const at::Tensor& q_c, const at::Tensor& q_weight, double q_eps,
                          at::Tensor& q_out, at::Tensor& q_scales, const at::Tensor& kv_c,
                          const at::Tensor& kv_weight, double kv_eps, at::Tensor& kv_c_out,
                          int64_t group_size, std::optional<double> scale_floor, bool pow2_scale,
                          const OptTensor& q_normed_out, const OptTensor& q_residual,
                          std::optional<int64_t> num_tokens) {
  translate_errors(kDualNames, [&] {
    Env env("q_c", q_c, std::nullopt);
    MlaRmsNormQuantParams p;
    p.q.num_tokens = token_count("mla_rmsnorm_quant", "q_c", num_tokens, q_c);
    p.q.input = to_view("q_c", q_c);
    p.q.weight = to_view("q_weight", q_weight);
    p.q.eps = to_float(q_eps);
    p.q.normed_out = to_view("q_normed_out", q_normed_out);
    p.q.residual = to_view("q_residual", q_residual);
    p.q.quant = quant_output(q_out, q_scales, group_size, scale_floor, pow2_scale);
    p.kv.num_tokens = token_count("mla_rmsnorm_quant", "kv_c", num_tokens, kv_c);
    p.kv.input = to_view("kv_c", kv_c);
    p.kv.weight = to_view("kv_weight", kv_weight);
    p.kv.eps = to_float(kv_eps);
    p.kv.output = to_view("kv_c_out", kv_c_out);
    mla_rmsnorm_quant(p, env.ctx);
  });
}

template <typename Env>
void per_token_group_quant_fp8_op(const at::Tensor& input, at::Tensor& out, at::Tensor& scales,
                                  int64_t group_size, std::optional<double> scale_floor,
                                  bool pow2_scale, std::optional<int64_t> num_tokens) {
  translate_errors(kQuantNames, [&] {
    Env env("input", input, std::nullopt);
    PerTokenGroupQuantParams p;
    p.num_tokens = token_count("per_token_group_quant_fp8", "input", num_tokens, input);
    p.input = to_view("input", input);
    p.quant = quant_output(out, scales, group_size, scale_floor, pow2_scale);
    per_token_group_quant_fp8(p, env.ctx);
  });
}

template <typename Env>
void register_rmsnorm_quant_kernels(torch::Library& m) {
  m.impl("rmsnorm_quant", &rmsnorm_quant_op<Env>);
  m.impl("mla_rmsnorm_quant", &mla_rmsnorm_quant_op<Env>);
  m.impl("per_token_group_quant_fp8", &per_token_group_quant_fp8_op<Env>);
}

}  // namespace
}  // namespace torch_binding
}  // namespace mlakv

TORCH_LIBRARY_FRAGMENT(mlakv, m) {
  m.def(
      "rmsnorm_quant(Tensor input, Tensor weight, float eps, Tensor(a!) out, Tensor(b!) scales, "
      "int group_size=128, float? scale_floor=None, bool pow2_scale=False, "
      "Tensor(c!)? residual=None, Tensor(d!)? normed_out=None, SymInt? num_tokens=None) -> ()");
  m.def(
      "mla_rmsnorm_quant(Tensor q_c, Tensor q_weight, float q_eps, Tensor(a!) q_out, "
      "Tensor(b!) q_scales, Tensor kv_c, Tensor kv_weight, float kv_eps, Tensor(c!) kv_c_out, "
      "int group_size=128, float? scale_floor=None, bool pow2_scale=False, "
      "Tensor(d!)? q_normed_out=None, Tensor(e!)? q_residual=None, "
      "SymInt? num_tokens=None) -> ()");
  m.def(
      "per_token_group_quant_fp8(Tensor input, Tensor(a!) out, Tensor(b!) scales, "
      "int group_size=128, float? scale_floor=None, bool pow2_scale=False, "
      "SymInt? num_tokens=None) -> ()");
}

TORCH_LIBRARY_IMPL(mlakv, CPU, m) {
  mlakv::torch_binding::register_rmsnorm_quant_kernels<mlakv::torch_binding::CpuEnv>(m);
}

#ifdef MLAKV_TORCH_CUDA
TORCH_LIBRARY_IMPL(mlakv, CUDA, m) {
  mlakv::torch_binding::register_rmsnorm_quant_kernels<mlakv::torch_binding::CudaEnv>(m);
}
#endif
