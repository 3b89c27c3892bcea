// mlakv: RoPE cos/sin tables (plain and DeepSeek YaRN), computed in double on the host.
#pragma once

#include <cstdint>
#include <vector>

#include "mlakv/tensor.h"

namespace mlakv {

// Plain RoPE: inv_freq[i] = base^(-2i / rotary_dim), row p = [cos(p * inv_freq) | sin(p *
// inv_freq)].
struct RopeTableConfig {
  double base = 10000.0;
  int64_t rotary_dim = 64;  // R, even
  int64_t max_position = 4096;
};

// DeepSeek YaRN (vLLM's DeepseekScalingRotaryEmbedding); max positions = ceil(original * factor).
struct YarnRopeConfig {
  double base = 10000.0;
  int64_t rotary_dim = 64;
  double factor = 40.0;
  int64_t original_max_position = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 1.0;
  double attn_factor = 1.0;
  double extrapolation_factor = 1.0;

  // ceil(original_max_position * factor); an mlakv::Error when that is not finite or passes 2^53.
  int64_t max_position() const;
};

// [max_position * rotary_dim] doubles, row-major: the exact table before rounding. A table of
// more than 2^53 entries, a non-finite base, factor or beta, and a failed allocation are refused
// with an mlakv::Error.
std::vector<double> rope_cos_sin_table(const RopeTableConfig& config);
std::vector<double> yarn_cos_sin_table(const YarnRopeConfig& config);

// Rounds a double table to `dtype` (float32, bfloat16 or float16) into host memory `out`
// (rows * cols elements, contiguous). Each value is rounded once, directly from the double, to
// nearest even (no double rounding through float for bfloat16 / float16).
void round_table(const std::vector<double>& table, DType dtype, void* out);

// yarn_get_mscale(factor, m) = 0.1 * m * ln(factor) + 1 for factor > 1, else 1.
double yarn_get_mscale(double factor, double mscale);
// The multiplier of the attention softmax scale: yarn_get_mscale(factor, mscale_all_dim)^2.
double yarn_softmax_scale_multiplier(double factor, double mscale_all_dim);

}  // namespace mlakv
