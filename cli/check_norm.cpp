// mlakv CLI: `mlakv check`'s rmsnorm_quant family (check.h): rmsnorm_quant, mla_rmsnorm_quant and
// per_token_group_quant_fp8.
#include <algorithm>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "check.h"
#include "mlakv/mlakv.h"
#include "reference/reference.h"
#include "util.h"

namespace mlakv {
namespace cli {
namespace check {
namespace {

// rmsnorm_quant, mla_rmsnorm_quant and per_token_group_quant_fp8 (include/mlakv/rmsnorm_quant.h):
// DeepSeek-V3's widths and random ones, random T, group size, scale layout and floor, residual and
// normed_out (in place or not); every output is poisoned first, every input compared afterwards.
enum class NormOp { kRmsNormQuant, kDual, kGroupQuant };

struct NormConfig {
  const char* name;
  NormOp op;
  int64_t N;  // the row width (the dual form: q_c's; kv_c is 512); 0: random
};

const std::vector<NormConfig>& norm_configs() {
  static const std::vector<NormConfig> configs = {
      {"rmsnorm_quant 1536", NormOp::kRmsNormQuant, 1536},
      {"rmsnorm_quant 7168", NormOp::kRmsNormQuant, 7168},
      {"rmsnorm_quant any N", NormOp::kRmsNormQuant, 0},
      {"mla_rmsnorm_quant", NormOp::kDual, 1536},
      {"per_token_group_quant", NormOp::kGroupQuant, 0},
  };
  return configs;
}

// The buffers of a case (named as the ops' params name them; the dual form's q half by its q_c
// names, its kv half as kv_c, kv_weight, kv_c_out).
enum NormBufferId : int {
  kNInput,
  kNWeight,
  kNResidual,
  kNNormedOut,
  kNValues,
  kNScales,
  kNKvInput,
  kNKvWeight,
  kNKvOut,
  kNumNormBuffers
};

const char* norm_buffer_name(int id) {
  static const char* names[kNumNormBuffers] = {"input",      "weight",    "residual",
                                               "normed_out", "values",    "scales",
                                               "kv_c",       "kv_weight", "kv_c_out"};
  return names[id];
}

constexpr int64_t kKvWidth = 512;

struct NormCase {
  const NormConfig* config = nullptr;
  uint64_t seed = 0;
  DType model = DType::kBFloat16;
  int64_t T = 0, pad_rows = 0, N = 0, G = 0;
  bool residual = false;  // rmsnorm_quant, and the dual form's q half
  Alias normed_out = Alias::kNone;
  Alias kv_out = Alias::kSeparate;  // the dual form's kv_c_out: separate or kv_c itself
  bool column_major = false;
  int64_t scale_stride = 0;  // row-major: >= N / G; column-major: >= rows
  bool pow2 = false;
  float eps = 1e-6f;
  float scale_floor = kDefaultScaleFloor;
  // Leading rows of zeros (their scales are the floor; the dual form: kv_c's rows too).
  int64_t zero_rows = 0;
  // The input's rows lie input_stride elements apart (the dual form's kv_c's, kv_stride). joint:
  // the dual form's q_c and kv_c share rows [q_c | kv_c | k_pe], as fused_qkv_a_proj writes them.
  int64_t input_stride = 0, kv_stride = kKvWidth;
  bool joint = false;

  int64_t rows() const { return T + pad_rows; }
  int64_t groups() const { return N / G; }
  int64_t scale_floats() const {
    return column_major ? groups() * scale_stride : rows() * scale_stride;
  }

  std::string describe() const {
    std::ostringstream os;
    os << "seed " << seed << ": T " << T << " pad " << pad_rows << " " << dtype_name(model) << " N "
       << N << " G " << G << (column_major ? " column-major" : " row-major") << " scales (stride "
       << scale_stride << ")" << (pow2 ? " pow2" : "");
    if (scale_floor != kDefaultScaleFloor) os << " floor " << scale_floor;
    if (config->op != NormOp::kGroupQuant) os << " eps " << eps;
    if (residual) os << " residual";
    if (normed_out != Alias::kNone) {
      os << (normed_out == Alias::kInPlace ? " normed_out=input" : " normed_out");
    }
    if (config->op == NormOp::kDual) {
      os << (kv_out == Alias::kInPlace ? " kv_c_out=kv_c" : " kv_c_out");
    }
    if (zero_rows > 0) os << " " << zero_rows << " zero rows";
    if (joint) {
      os << " joint q_c|kv_c rows " << input_stride;
    } else {
      if (input_stride != N) os << " input rows " << input_stride;
      if (kv_stride != kKvWidth) os << " kv_c rows " << kv_stride;
    }
    return os.str();
  }
};

NormCase make_norm_case(const NormConfig& config, uint64_t seed) {
  Rng rng = case_rng(seed, config.name, 0);
  NormCase c;
  c.config = &config;
  c.seed = seed;
  c.model = draw_model_dtype(rng);
  // T: mostly small; sometimes large. For the widths of the CUDA exact-fit kernel (N <= 1536) a
  // large T crosses its thread-form thresholds (T = 1056 / 1536 / 2048 / 4096,
  // docs/rmsnorm_quant.md); the wider rows stay below 1200 tokens (the reference is scalar).
  const bool narrow = config.N > 0 && config.N <= 1536;
  const double t_roll = rng.uniform(0.0f, 1.0f);
  if (t_roll < 0.75) {
    c.T = rng.between(1, 64);
  } else if (t_roll < 0.88) {
    c.T = rng.between(65, 300);
  } else {
    c.T = narrow ? rng.between(1000, 8200) : rng.between(300, 1200);
  }
  if (empty_batch(seed, config.name)) c.T = 0;
  c.pad_rows = rng.chance(0.5) ? rng.between(1, 4) : 0;
  const int64_t groups[] = {16, 32, 64, 128, 256};
  if (config.N > 0) {
    c.N = config.N;
    c.G = rng.chance(0.7) ? 128 : groups[rng.below(5)];
    while (c.N % c.G != 0) c.G /= 2;
  } else {
    c.G = rng.chance(0.5) ? 128 : groups[rng.below(5)];
    c.N = c.G * rng.between(1, 24);
  }
  c.residual = config.op != NormOp::kGroupQuant && rng.chance(0.4);  // the dual form: q_c's
  if (config.op != NormOp::kGroupQuant && rng.chance(0.4)) {
    c.normed_out = rng.chance(0.3) ? Alias::kInPlace : Alias::kSeparate;
  }
  if (config.op == NormOp::kDual && rng.chance(0.5)) c.kv_out = Alias::kInPlace;
  c.column_major = rng.chance(0.5);
  const int64_t pad = rng.chance(0.3) ? rng.between(1, 3) : 0;
  c.scale_stride = c.column_major ? (c.rows() + 3) / 4 * 4 + pad : c.groups() + pad;
  c.pow2 = rng.chance(0.3);
  c.eps = rng.chance(0.2) ? 1e-5f : 1e-6f;
  if (rng.chance(0.2)) c.scale_floor = rng.uniform(1e-4f, 1e-2f);
  c.zero_rows = rng.chance(0.15) ? std::min<int64_t>(c.T, rng.between(1, 3)) : 0;
  if (config.op == NormOp::kDual && rng.chance(0.4)) {
    c.joint = true;
    c.input_stride = c.kv_stride = c.N + kKvWidth + 64;
  } else {
    const double roll = rng.uniform(0.0f, 1.0f);
    // Rows 16-byte aligned, as the ops ask.
    const int64_t align = 16 / static_cast<int64_t>(dtype_size(c.model));
    c.input_stride = roll < 0.6 ? c.N : (roll < 0.8 ? c.N + 64 : c.N + align * rng.between(1, 3));
    if (config.op == NormOp::kDual && rng.chance(0.3)) c.kv_stride = kKvWidth + 64;
  }
  return c;
}

std::vector<std::vector<uint8_t>> norm_initial_buffers(const NormCase& c) {
  Rng rng(c.seed ^ 0xda7a5eedull);
  std::vector<std::vector<uint8_t>> b(kNumNormBuffers);
  const size_t mb = dtype_size(c.model);
  const int64_t rows = c.rows();
  b[kNInput] = random_values(c.model, rows * c.input_stride, 2.0f, rng);
  std::fill(b[kNInput].begin(), b[kNInput].begin() + c.zero_rows * c.input_stride * mb, uint8_t{0});
  if (c.config->op != NormOp::kGroupQuant) b[kNWeight] = random_values(c.model, c.N, 1.5f, rng);
  if (c.residual) {
    b[kNResidual] = random_values(c.model, rows * c.N, 2.0f, rng);
    std::fill(b[kNResidual].begin(), b[kNResidual].begin() + c.zero_rows * c.N * mb, uint8_t{0});
  }
  if (c.normed_out == Alias::kSeparate) b[kNNormedOut].assign(rows * c.N * mb, kPoisonByte);
  b[kNValues].assign(static_cast<size_t>(rows * c.N), kPoisonByte);
  b[kNScales].assign(static_cast<size_t>(c.scale_floats()) * 4, kPoisonByte);
  if (c.config->op == NormOp::kDual) {
    if (!c.joint) {
      b[kNKvInput] = random_values(c.model, rows * c.kv_stride, 2.0f, rng);
      std::fill(b[kNKvInput].begin(), b[kNKvInput].begin() + c.zero_rows * c.kv_stride * mb,
                uint8_t{0});
    }
    b[kNKvWeight] = random_values(c.model, kKvWidth, 1.5f, rng);
    if (c.kv_out == Alias::kSeparate) b[kNKvOut].assign(rows * kKvWidth * mb, kPoisonByte);
  }
  return b;
}

// The views of a case over one copy of its buffers (`base[id]`, on `device`).
struct NormViews {
  RmsNormQuantParams q;  // rmsnorm_quant; the dual form's q half; the group quant's input + quant
  RmsNormParams kv;      // the dual form's kv half
};

NormViews norm_views(const NormCase& c, const std::vector<void*>& base, Device device) {
  const DType m = c.model;
  const int64_t rows = c.rows();
  NormViews v;
  RmsNormQuantParams& q = v.q;
  q.num_tokens = c.T;
  q.input = make_strided_view(base[kNInput], m, {rows, c.N}, {c.input_stride, 1}, device);
  if (base[kNWeight] != nullptr) q.weight = make_view(base[kNWeight], m, {c.N}, device);
  q.eps = c.eps;
  if (c.residual) q.residual = make_view(base[kNResidual], m, {rows, c.N}, device);
  if (c.normed_out == Alias::kSeparate) {
    q.normed_out = make_view(base[kNNormedOut], m, {rows, c.N}, device);
  }
  if (c.normed_out == Alias::kInPlace) q.normed_out = q.input;
  q.quant.values = make_view(base[kNValues], DType::kFloat8E4M3, {rows, c.N}, device);
  float* scales = static_cast<float*>(base[kNScales]);
  q.quant.scales = c.column_major
                       ? column_major_scales_view(scales, rows, c.groups(), c.scale_stride, device)
                       : make_strided_view(scales, DType::kFloat32, {rows, c.groups()},
                                           {c.scale_stride, 1}, device);
  q.quant.group_size = c.G;
  q.quant.scale_floor = c.scale_floor;
  q.quant.pow2_scale = c.pow2;
  if (c.config->op == NormOp::kDual) {
    v.kv.num_tokens = c.T;
    void* kv_input = c.joint ? offset_bytes(base[kNInput], c.N * dtype_size(m)) : base[kNKvInput];
    v.kv.input = make_strided_view(kv_input, m, {rows, kKvWidth}, {c.kv_stride, 1}, device);
    v.kv.weight = make_view(base[kNKvWeight], m, {kKvWidth}, device);
    v.kv.eps = c.eps;
    v.kv.output = c.kv_out == Alias::kInPlace
                      ? v.kv.input
                      : make_view(base[kNKvOut], m, {rows, kKvWidth}, device);
  }
  return v;
}

class NormFamily : public Family {
 public:
  int num_configs() const override { return static_cast<int>(norm_configs().size()); }
  const char* config_name(int config) const override { return norm_configs()[config].name; }
  void prepare(int config, int /*i*/, uint64_t seed) override {
    case_ = make_norm_case(norm_configs()[config], seed);
    initial_ = norm_initial_buffers(case_);
  }
  std::string describe() const override { return case_.describe(); }

  Run reference() const override {
    return run_reference(initial_, norm_buffer_name, [&](const std::vector<void*>& base, int32_t*) {
      const NormViews v = norm_views(case_, base, Device{});
      ref::rmsnorm_quant(v.q);  // without a weight (the group quant) it only quantizes
      if (case_.config->op == NormOp::kDual) ref::rms_norm(v.kv);
    });
  }

  Run run(Device device) const override {
    return run_on(device, initial_, norm_buffer_name,
                  [&](const std::vector<void*>& base, const Context& ctx) {
                    const NormViews v = norm_views(case_, base, device);
                    switch (case_.config->op) {
                      case NormOp::kRmsNormQuant:
                        rmsnorm_quant(v.q, ctx);
                        break;
                      case NormOp::kDual: {
                        MlaRmsNormQuantParams p;
                        p.q = v.q;
                        p.kv = v.kv;
                        mla_rmsnorm_quant(p, ctx);
                        break;
                      }
                      case NormOp::kGroupQuant: {
                        PerTokenGroupQuantParams p;
                        p.num_tokens = v.q.num_tokens;
                        p.input = v.q.input;
                        p.quant = v.q.quant;
                        per_token_group_quant_fp8(p, ctx);
                        break;
                      }
                    }
                  });
  }

 private:
  NormCase case_;
  std::vector<std::vector<uint8_t>> initial_;
};

}  // namespace

std::unique_ptr<Family> make_norm_family() { return std::make_unique<NormFamily>(); }

}  // namespace check
}  // namespace cli
}  // namespace mlakv
