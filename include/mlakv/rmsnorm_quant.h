// mlakv: RMSNorm fused with FP8 per-token-group quantization (the MLA latent inputs), its dual form
// for q_c + kv_c, and the plain per-token-group quantization it replaces.
//
// An MLA layer normalizes q_c [T, 1536] (q_a_layernorm) and kv_c [T, 512] (kv_a_layernorm). With
// FP8 block-scaled weights (DeepSeek-V3's 128 x 128 scheme) the normalized q_c is quantized per
// token in groups of G = 128 before q_b_proj. These ops do that in one pass over the data.
//
// Numerics (identical on every backend, bit for bit; DESIGN.md "Numerics"):
//   s     = round_model(float(x) + float(residual))  only with a residual; written back
//   inv   = 1 / sqrt(sum_squares(s) / N + eps)        fp32 sum, fixed order (docs/rmsnorm_quant.md)
//   y     = round_model((s * inv) * w)                what normed_out holds and what is quantized
//   amax  = max |y| over the group of G values        NaN ignored
//   scale = max(amax / 448, scale_floor)              with pow2_scale: rounded up to a power of 2
//   q     = e4m3(y / scale)                           IEEE division, saturating, round to even
// The default floor, kDefaultScaleFloor = 1e-10f / 448, makes the scales bitwise equal to vLLM's
// and DeepGEMM's per_token_group_quant (scale = max(amax, 1e-10) / 448).
//
// Shapes and layouts: T = num_tokens (tensors may have more rows; rows >= T are never touched),
// N = hidden size (a multiple of 8, at most 32768), G = group_size (a power of two in [16, 256],
// N % G == 0). Model-dtype tensors and the e4m3 values: 2-D, innermost stride 1, rows
// that do not overlap, data pointer and row stride 16-byte aligned (the kernels move 16 bytes per
// access). The weight: [N], contiguous, model dtype, 16-byte aligned.
// Scales: fp32, viewed as [>=T, N/G], in one of two layouts, told apart by their strides:
//   row-major     strides [S, 1], S >= N/G: the scale of (t, g) at t * S + g;
//   column-major  strides [1, S], S >= rows of the view: the scale of (t, g) at g * S + t (the
//                 "MN-major" layout DeepGEMM-style block-scaled GEMMs read; S may be T padded up,
//                 e.g. to a multiple of 4; the padding is never written). column_major_scales_view
//                 builds such a view.
// Aliasing: normed_out may be the input itself (same pointer and strides: in place); no other
// output may overlap any other tensor of the op. Validation happens before anything is written and
// throws mlakv::Error naming the argument.
#pragma once

#include <cstdint>

#include "mlakv/context.h"
#include "mlakv/ops.h"
#include "mlakv/tensor.h"

namespace mlakv {

constexpr int64_t kDefaultQuantGroupSize = 128;
// max(amax / 448, 1e-10f / 448) == max(amax, 1e-10f) / 448 bit for bit (division is monotone).
constexpr float kDefaultScaleFloor = 1e-10f / 448.0f;
constexpr int64_t kMaxRmsNormQuantHidden = 32768;

// Where and how a per-token-group FP8 result is stored.
struct Fp8GroupQuantOutput {
  TensorView values;                            // [>=T, N], float8_e4m3fn
  TensorView scales;                            // [>=T, N/G], float32, row- or column-major (above)
  int64_t group_size = kDefaultQuantGroupSize;  // G
  float scale_floor = kDefaultScaleFloor;       // finite, >= FLT_MIN
  bool pow2_scale = false;                      // round every scale up to a power of two
};

// RMSNorm(x [+ residual], weight, eps) -> e4m3 values + per-(token, group) scales, optionally the
// normalized values in the model dtype.
struct RmsNormQuantParams {
  int64_t num_tokens = 0;  // T
  TensorView input;        // x [>=T, N], model dtype (bfloat16, float16 or float32)
  TensorView weight;       // [N], model dtype
  float eps = 1e-6f;       // >= 0, finite
  // Optional [>=T, N], model dtype: read, and overwritten with round_model(x + residual), the value
  // that is normalized (vLLM's fused_add_rms_norm convention).
  TensorView residual;
  TensorView normed_out;  // optional [>=T, N], model dtype; may be input itself
  Fp8GroupQuantOutput quant;
};
void rmsnorm_quant(const RmsNormQuantParams& params, const Context& ctx = {});

// The MLA layer's two norms in one launch: q_c -> q_a_layernorm -> e4m3 + scales (params.q), and
// kv_c -> kv_a_layernorm -> model dtype (params.kv, which may normalize kv_c in place). Each part
// has its own token count, weight and eps; both must live on one device.
struct MlaRmsNormQuantParams {
  RmsNormQuantParams q;  // q_c [>=T, 1536] for DeepSeek-V3
  RmsNormParams kv;      // kv_c [>=T, 512], same model dtype as q_c
};
void mla_rmsnorm_quant(const MlaRmsNormQuantParams& params, const Context& ctx = {});

// The unfused second step (the A/B baseline of rmsnorm_quant): x [>=T, N] model dtype -> e4m3 +
// scales, with the same group scale and rounding as above (y = x).
struct PerTokenGroupQuantParams {
  int64_t num_tokens = 0;  // T
  TensorView input;        // [>=T, N], model dtype
  Fp8GroupQuantOutput quant;
};
void per_token_group_quant_fp8(const PerTokenGroupQuantParams& params, const Context& ctx = {});

// A column-major scales view: shape [num_rows, num_groups], strides [1, stride_group]; the scale of
// (t, g) lives at data[g * stride_group + t]. stride_group >= num_rows (e.g. T rounded up to 4).
TensorView column_major_scales_view(float* data, int64_t num_rows, int64_t num_groups,
                                    int64_t stride_group, Device device = {});

}  // namespace mlakv
