// mlakv: RoPE cos/sin tables in double, following vLLM's RotaryEmbedding and
// DeepseekScalingRotaryEmbedding (which compute in fp32; double here gives the exact table, which
// is then rounded once to the table dtype).
#include "mlakv/tables.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <vector>

#include "common/float_env.h"
#include "common/numerics.h"
#include "mlakv/error.h"

namespace mlakv {
namespace {

constexpr double kPi = 3.14159265358979323846;

// A table holds at most 2^53 doubles (2^56 bytes, the library's bound on a view's extent).
constexpr int64_t kMaxTableElements = int64_t{1} << 53;

void check_rotary_dim(const char* fn, int64_t rotary_dim) {
  MLAKV_CHECK(rotary_dim >= 2 && rotary_dim % 2 == 0, fn,
              ": rotary_dim: expected an even value >= 2, got ", rotary_dim);
}

// max_position * rotary_dim within kMaxTableElements (checked before anything is allocated).
void check_table_size(const char* fn, int64_t max_position, int64_t rotary_dim) {
  MLAKV_CHECK(max_position <= kMaxTableElements / rotary_dim, fn,
              ": max_position * rotary_dim: expected at most 2^53 table entries, got ",
              max_position, " * ", rotary_dim);
}

// std::vector<double>(n), with an allocation failure reported as an mlakv::Error.
std::vector<double> doubles(const char* fn, int64_t n) {
  try {
    return std::vector<double>(static_cast<size_t>(n));
  } catch (const std::bad_alloc&) {
    MLAKV_FAIL(fn, ": could not allocate ", n, " doubles on the host");
  }
}

// Row p = [cos(p * inv_freq[i]) * mscale for i < R/2 | sin(p * inv_freq[i]) * mscale].
std::vector<double> build_table(const char* fn, const std::vector<double>& inv_freq,
                                int64_t max_position, double mscale) {
  const int64_t half = static_cast<int64_t>(inv_freq.size());
  const int64_t R = 2 * half;
  std::vector<double> table = doubles(fn, max_position * R);
  for (int64_t p = 0; p < max_position; ++p) {
    double* row = table.data() + p * R;
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(p) * inv_freq[static_cast<size_t>(i)];
      row[i] = std::cos(angle) * mscale;
      row[half + i] = std::sin(angle) * mscale;
    }
  }
  return table;
}

// vLLM's _yarn_find_correction_dim: the rotary dimension whose wavelength makes num_rotations
// turns over the original context.
double yarn_correction_dim(double num_rotations, int64_t R, double base, int64_t orig_max) {
  return (static_cast<double>(R) *
          std::log(static_cast<double>(orig_max) / (num_rotations * 2.0 * kPi))) /
         (2.0 * std::log(base));
}

// double -> float with round-to-odd: a following round-to-nearest-even to a format with at least
// two fewer significand bits (bf16: 8, fp16: 11, float: 24) then equals a single correctly rounded
// conversion from double, so the table is rounded once, not twice.
float double_to_float_round_odd(double d) {
  if (std::isnan(d)) return static_cast<float>(d);
  float f = static_cast<float>(d);
  if (static_cast<double>(f) == d) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(d)) {
    f = std::nextafter(f, 0.0f);  // truncate toward zero (also brings an overflowed inf back)
  }
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u |= 1u;  // inexact: make the last bit sticky
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

int64_t YarnRopeConfig::max_position() const {
  const DefaultFloatEnv float_env;
  // vLLM: torch.arange(max_position_embeddings * scaling_factor) -> ceil of the product. The
  // product goes through memory inside float_env's scope (see float_env.h).
  const volatile double product = static_cast<double>(original_max_position) * factor;
  const double positions = std::ceil(product);
  MLAKV_CHECK(std::fabs(positions) <= static_cast<double>(kMaxTableElements),
              "YarnRopeConfig::max_position: original_max_position * factor: expected a finite "
              "value within 2^53, got ",
              original_max_position, " * ", factor);
  return static_cast<int64_t>(positions);
}

std::vector<double> rope_cos_sin_table(const RopeTableConfig& config) {
  // The table is the same in any caller environment; it is stored to memory, so the compiler
  // computes it inside float_env's scope (float_env.h).
  const DefaultFloatEnv float_env;
  check_rotary_dim("rope_cos_sin_table", config.rotary_dim);
  MLAKV_CHECK(config.max_position >= 1, "rope_cos_sin_table: max_position: expected >= 1, got ",
              config.max_position);
  MLAKV_CHECK(config.base > 0.0 && std::isfinite(config.base),
              "rope_cos_sin_table: base: expected a finite value > 0, got ", config.base);
  const int64_t R = config.rotary_dim;
  check_table_size("rope_cos_sin_table", config.max_position, R);
  std::vector<double> inv_freq = doubles("rope_cos_sin_table", R / 2);
  for (int64_t i = 0; i < R / 2; ++i) {
    inv_freq[static_cast<size_t>(i)] =
        1.0 / std::pow(config.base, static_cast<double>(2 * i) / static_cast<double>(R));
  }
  return build_table("rope_cos_sin_table", inv_freq, config.max_position, 1.0);
}

std::vector<double> yarn_cos_sin_table(const YarnRopeConfig& config) {
  const DefaultFloatEnv float_env;
  check_rotary_dim("yarn_cos_sin_table", config.rotary_dim);
  MLAKV_CHECK(config.base > 1.0 && std::isfinite(config.base),
              "yarn_cos_sin_table: base: expected a finite value > 1, got ", config.base);
  MLAKV_CHECK(config.factor > 0.0 && std::isfinite(config.factor),
              "yarn_cos_sin_table: factor: expected a finite value > 0, got ", config.factor);
  MLAKV_CHECK(config.original_max_position >= 1,
              "yarn_cos_sin_table: original_max_position: expected >= 1, got ",
              config.original_max_position);
  MLAKV_CHECK(config.beta_fast > 0.0 && config.beta_slow > 0.0 && std::isfinite(config.beta_fast) &&
                  std::isfinite(config.beta_slow),
              "yarn_cos_sin_table: beta_fast / beta_slow: expected finite values > 0, got ",
              config.beta_fast, " / ", config.beta_slow);
  const int64_t R = config.rotary_dim;
  const int64_t half = R / 2;
  const int64_t max_position = config.max_position();
  check_table_size("yarn_cos_sin_table", max_position, R);

  // vLLM's _yarn_find_correction_range.
  const double low = std::max(std::floor(yarn_correction_dim(config.beta_fast, R, config.base,
                                                             config.original_max_position)),
                              0.0);
  double high = std::min(std::ceil(yarn_correction_dim(config.beta_slow, R, config.base,
                                                       config.original_max_position)),
                         static_cast<double>(R - 1));
  if (low == high) high += 0.001;  // vLLM's _yarn_linear_ramp_mask avoids a zero division

  std::vector<double> inv_freq = doubles("yarn_cos_sin_table", half);
  for (int64_t i = 0; i < half; ++i) {
    const double pos_freq =
        std::pow(config.base, static_cast<double>(2 * i) / static_cast<double>(R));
    const double inv_freq_extra = 1.0 / pos_freq;
    const double inv_freq_inter = 1.0 / (config.factor * pos_freq);
    double ramp = (static_cast<double>(i) - low) / (high - low);
    ramp = std::min(std::max(ramp, 0.0), 1.0);
    const double mask = (1.0 - ramp) * config.extrapolation_factor;
    inv_freq[static_cast<size_t>(i)] = inv_freq_inter * (1.0 - mask) + inv_freq_extra * mask;
  }
  const double mscale = yarn_get_mscale(config.factor, config.mscale) /
                        yarn_get_mscale(config.factor, config.mscale_all_dim) * config.attn_factor;
  return build_table("yarn_cos_sin_table", inv_freq, max_position, mscale);
}

void round_table(const std::vector<double>& table, DType dtype, void* out) {
  const DefaultFloatEnv float_env;
  MLAKV_CHECK(out != nullptr || table.empty(), "round_table: out: expected a host buffer of ",
              table.size(), " elements, got nullptr");
  const size_t n = table.size();
  switch (dtype) {
    case DType::kFloat32: {
      float* o = static_cast<float*>(out);
      for (size_t i = 0; i < n; ++i) o[i] = static_cast<float>(table[i]);
      return;
    }
    case DType::kBFloat16: {
      num::Bf16* o = static_cast<num::Bf16*>(out);
      for (size_t i = 0; i < n; ++i) o[i] = num::float_to_bf16(double_to_float_round_odd(table[i]));
      return;
    }
    case DType::kFloat16: {
      num::Half* o = static_cast<num::Half*>(out);
      for (size_t i = 0; i < n; ++i) o[i] = num::float_to_half(double_to_float_round_odd(table[i]));
      return;
    }
    default:
      MLAKV_FAIL("round_table: dtype: expected float32, bfloat16 or float16, got ",
                 dtype_name(dtype));
  }
}

// The arguments are read, and the results written, through volatiles inside float_env's scope:
// the compiler would otherwise be free to compute in registers before or after it (float_env.h).
double yarn_get_mscale(double factor, double mscale) {
  const DefaultFloatEnv float_env;
  const volatile double f = factor;
  const volatile double m = mscale;
  if (f <= 1.0) return 1.0;
  const volatile double result = 0.1 * m * std::log(f) + 1.0;
  return result;
}

double yarn_softmax_scale_multiplier(double factor, double mscale_all_dim) {
  const DefaultFloatEnv float_env;
  const volatile double m = yarn_get_mscale(factor, mscale_all_dim);
  const volatile double result = m * m;
  return result;
}

}  // namespace mlakv
