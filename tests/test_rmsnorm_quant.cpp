// mlakv tests: rmsnorm_quant, mla_rmsnorm_quant and per_token_group_quant_fp8 against an
// independent reference written here.
//
// The reference works in double and rounds to float after every step (exact: every fp32 op on two
// floats is correctly rounded when computed in double and rounded once), and rounds to bf16 /
// fp16 / e4m3 with its own round-to-nearest-even on doubles, not with src/common/numerics.h. It
// sums the squares in the library's documented order (the pairwise tree over the element index,
// the row padded with +0 to a power of two), so results must match byte for byte on every backend
// (the CUDA kernels sum in that order too): values, scales, normalized outputs, residual
// write-back, and every byte the op must not touch (rows past T, gaps of strided rows, padding of
// column-major scales).
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/rmsnorm_quant_args.h"
#include "harness.h"
#include "mlakv/mlakv.h"
#include "mlakv/rmsnorm_quant.h"

namespace mlakv {
namespace test {
namespace {

// ---- independent reference ---------------------------------------------------------------------

// A binary float format: mant_bits explicit mantissa bits, emin the exponent of the smallest
// normal, max_finite, and what happens beyond it.
struct Format {
  int mant_bits;
  int exp_bits;
  int emin;
  double max_finite;
  bool saturate;  // true: clamp to max_finite (e4m3 "satfinite"); false: overflow to inf
};
const Format kBf16{7, 8, -126, 3.3895313892515355e38, false};
const Format kFp16{10, 5, -14, 65504.0, false};
const Format kE4M3{3, 4, -6, 448.0, true};

// Round to nearest, ties to even, on doubles (exact: the scaled value fits in 53 bits).
double round_format(double v, const Format& f) {
  if (std::isnan(v) || v == 0.0) return v;
  const double a = std::fabs(v);
  int e2 = 0;
  std::frexp(a, &e2);  // a = m * 2^e2, m in [0.5, 1): leading bit at 2^(e2 - 1)
  const int lead = std::max(e2 - 1, f.emin);
  const int quantum = lead - f.mant_bits;
  const double n = std::nearbyint(std::ldexp(a, -quantum));
  double r = std::ldexp(n, quantum);
  if (r > f.max_finite) r = f.saturate ? f.max_finite : HUGE_VAL;
  return std::copysign(r, v);
}

// Bits of a value exactly representable in f (sign, biased exponent, mantissa).
uint32_t encode_format(double v, const Format& f) {
  const uint32_t sign = std::signbit(v) ? 1u : 0u;
  const int total = 1 + f.exp_bits + f.mant_bits;
  const int bias = 1 - f.emin;
  const double a = std::fabs(v);
  uint32_t exp_field = 0, mant = 0;
  if (std::isinf(a)) {
    exp_field = (1u << f.exp_bits) - 1;
  } else if (a != 0.0) {
    int e2 = 0;
    std::frexp(a, &e2);
    const int lead = e2 - 1;
    if (lead < f.emin) {  // subnormal
      mant = static_cast<uint32_t>(std::ldexp(a, f.mant_bits - f.emin));
    } else {
      exp_field = static_cast<uint32_t>(lead + bias);
      mant = static_cast<uint32_t>(std::ldexp(a, f.mant_bits - lead)) - (1u << f.mant_bits);
    }
  }
  return (sign << (total - 1)) | (exp_field << f.mant_bits) | mant;
}

double decode_format(uint32_t bits, const Format& f) {
  const int total = 1 + f.exp_bits + f.mant_bits;
  const bool neg = (bits >> (total - 1)) & 1u;
  const uint32_t exp_field = (bits >> f.mant_bits) & ((1u << f.exp_bits) - 1);
  const uint32_t mant = bits & ((1u << f.mant_bits) - 1);
  const int bias = 1 - f.emin;
  double a;
  if (exp_field == 0) {
    a = std::ldexp(static_cast<double>(mant), f.emin - f.mant_bits);
  } else {
    a = std::ldexp(static_cast<double>(mant + (1u << f.mant_bits)),
                   static_cast<int>(exp_field) - bias - f.mant_bits);
  }
  return neg ? -a : a;
}

// fp32 rounding of a double (the C++ conversion rounds to nearest even).
double f32(double v) { return static_cast<double>(static_cast<float>(v)); }

// Model-dtype element access on host mirrors.
double read_model(const uint8_t* p, DType dt) {
  if (dt == DType::kFloat32) {
    float v;
    std::memcpy(&v, p, 4);
    return v;
  }
  uint16_t b;
  std::memcpy(&b, p, 2);
  return decode_format(b, dt == DType::kBFloat16 ? kBf16 : kFp16);
}
double round_model(double v, DType dt) {
  if (dt == DType::kFloat32) return f32(v);
  return round_format(f32(v), dt == DType::kBFloat16 ? kBf16 : kFp16);
}
void write_model(uint8_t* p, DType dt, double v) {
  if (dt == DType::kFloat32) {
    const float f = static_cast<float>(v);
    std::memcpy(p, &f, 4);
    return;
  }
  const uint16_t b =
      static_cast<uint16_t>(encode_format(v, dt == DType::kBFloat16 ? kBf16 : kFp16));
  std::memcpy(p, &b, 2);
}

uint8_t* host_at(const Tensor& t, int64_t i, int64_t j) {
  return t.buffer->host.data() + t.byte_offset({i, j});
}

struct RefJob {
  int64_t num_tokens = 0;
  Tensor input, weight, residual, normed_out, values, scales;  // absent = not used
  double eps = 1e-6;
  int64_t group_size = 128;
  double scale_floor = kDefaultScaleFloor;
  bool pow2 = false;
};

double ref_group_scale(double amax, double floor, bool pow2) {
  double s = f32(amax / 448.0);
  if (!(s >= floor)) s = floor;
  if (pow2) {
    int e2 = 0;
    const double m = std::frexp(s, &e2);
    if (m != 0.5) s = std::ldexp(1.0, e2);  // the next power of two above a non-power
  }
  return s;
}

// Runs the reference on the host mirrors of the job's tensors.
void reference(const RefJob& job) {
  const DType dt = job.input.dtype;
  const int64_t N = job.input.shape[1];
  const int64_t G = job.group_size;
  std::vector<double> s(N), y(N);
  for (int64_t t = 0; t < job.num_tokens; ++t) {
    for (int64_t j = 0; j < N; ++j) {
      s[j] = read_model(host_at(job.input, t, j), dt);
      if (job.residual.present()) {
        s[j] = round_model(s[j] + read_model(host_at(job.residual, t, j), dt), dt);
        write_model(host_at(job.residual, t, j), dt, s[j]);
      }
    }
    if (job.weight.present()) {
      // The pairwise tree, level by level: elements 2j and 2j + 1 of a level add into element j
      // of the next; an odd level's last element moves up unchanged.
      std::vector<double> level(N);
      for (int64_t j = 0; j < N; ++j) level[j] = f32(s[j] * s[j]);
      while (level.size() > 1) {
        const size_t n = level.size();
        for (size_t j = 0; j < n / 2; ++j) level[j] = f32(level[2 * j] + level[2 * j + 1]);
        if (n % 2 != 0) level[n / 2] = level[n - 1];
        level.resize((n + 1) / 2);
      }
      const double mean = f32(level[0] / static_cast<double>(N));
      const double inv = f32(1.0 / f32(std::sqrt(f32(mean + f32(job.eps)))));
      for (int64_t j = 0; j < N; ++j) {
        const double w =
            read_model(job.weight.buffer->host.data() + job.weight.byte_offset({j}), dt);
        y[j] = round_model(f32(f32(s[j] * inv) * w), dt);
      }
    } else {
      y = s;
    }
    if (job.normed_out.present()) {
      for (int64_t j = 0; j < N; ++j) write_model(host_at(job.normed_out, t, j), dt, y[j]);
    }
    if (!job.values.present()) continue;
    for (int64_t g = 0; g < N / G; ++g) {
      double amax = 0.0;
      for (int64_t j = g * G; j < (g + 1) * G; ++j) amax = std::max(amax, std::fabs(y[j]));
      const double scale = ref_group_scale(amax, f32(job.scale_floor), job.pow2);
      const float scale_f = static_cast<float>(scale);
      std::memcpy(host_at(job.scales, t, g), &scale_f, 4);
      for (int64_t j = g * G; j < (g + 1) * G; ++j) {
        const double q = round_format(f32(y[j] / scale), kE4M3);
        *host_at(job.values, t, j) = static_cast<uint8_t>(encode_format(q, kE4M3));
      }
    }
  }
}

// ---- test data ---------------------------------------------------------------------------------

// Random model-dtype values over the whole buffer: magnitudes spread over 2^-6 .. 2^6 and a few
// outliers, never zero, so group scales and the fp8 range are exercised.
void fill_activations(const Tensor& t, std::mt19937_64& rng, double row_spread = 1.0) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::uniform_int_distribution<int> e(-6, 6);
  std::uniform_int_distribution<int> outlier(0, 199);
  const size_t es = dtype_size(t.dtype);
  auto& h = t.buffer->host;
  for (size_t i = 0; i + es <= h.size(); i += es) {
    double v = 0.0;
    while (round_model(v, t.dtype) == 0.0) {
      v = u(rng) * std::ldexp(1.0, e(rng)) * row_spread;
      if (outlier(rng) == 0) v *= 64.0;
    }
    write_model(h.data() + i, t.dtype, round_model(v, t.dtype));
  }
}

void fill_weight(const Tensor& t, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(0.05, 2.5);
  const size_t es = dtype_size(t.dtype);
  auto& h = t.buffer->host;
  for (size_t i = 0; i + es <= h.size(); i += es) {
    write_model(h.data() + i, t.dtype, round_model(u(rng), t.dtype));
  }
}

enum class ScaleLayout { kRowMajor, kColumnMajor };

// Scales [rows, groups]: row-major with `pad` extra per row, or column-major with stride rows +
// pad.
Tensor scales_tensor(Device device, int64_t rows, int64_t groups, ScaleLayout layout, int64_t pad) {
  if (layout == ScaleLayout::kRowMajor) {
    return new_strided_tensor(device, DType::kFloat32, rows * (groups + pad), {rows, groups},
                              {groups + pad, 1});
  }
  return new_strided_tensor(device, DType::kFloat32, groups * (rows + pad), {rows, groups},
                            {1, rows + pad});
}

// ---- one case ----------------------------------------------------------------------------------

struct Case {
  std::string name;
  DType dtype = DType::kBFloat16;
  int64_t N = 1536;
  int64_t T = 64;
  int64_t extra_rows = 2;  // rows past T (graph padding): never touched
  bool residual = false;
  enum NormedOut { kNone, kSeparate, kInPlace } normed = kNone;
  ScaleLayout layout = ScaleLayout::kRowMajor;
  int64_t scale_pad = 0;
  bool pow2 = false;
  int64_t group_size = 128;
  int64_t row_pad = 0;  // extra elements per row of every per-token tensor (strided views)
  // The residual's and normed_out's own row pads (-1: row_pad), so that each tensor can have its
  // own row stride.
  int64_t residual_row_pad = -1;
  int64_t normed_row_pad = -1;
  float scale_floor = kDefaultScaleFloor;
  float eps = 1e-6f;
};

// A case by its name, dtype, width and tokens; the rest Case's defaults.
Case make_case(std::string name, DType dtype, int64_t N, int64_t T) {
  Case c;
  c.name = std::move(name);
  c.dtype = dtype;
  c.N = N;
  c.T = T;
  return c;
}

std::string case_label(const Case& c) {
  std::string s = c.name + " " + dtype_name(c.dtype) + " N=" + std::to_string(c.N) +
                  " T=" + std::to_string(c.T) + " G=" + std::to_string(c.group_size);
  if (c.residual) s += " residual";
  if (c.normed == Case::kSeparate) s += " normed_out";
  if (c.normed == Case::kInPlace) s += " normed_out=input";
  s += c.layout == ScaleLayout::kRowMajor ? " row-major" : " column-major";
  if (c.scale_pad) s += "+" + std::to_string(c.scale_pad);
  if (c.pow2) s += " pow2";
  if (c.row_pad) s += " row_pad=" + std::to_string(c.row_pad);
  return s;
}

struct Job {
  Tensor input, weight, residual, normed_out, values, scales;
};

Job make_job(Device device, const Case& c, std::mt19937_64& rng, bool with_weight,
             bool with_quant) {
  const int64_t rows = c.T + c.extra_rows;
  Job j;
  j.input = padded_rows(device, c.dtype, rows, c.N, c.row_pad, c.row_pad ? 8 : 0);
  fill_activations(j.input, rng);
  if (with_weight) {
    j.weight = new_tensor(device, c.dtype, {c.N});
    fill_weight(j.weight, rng);
  }
  if (c.residual) {
    j.residual = padded_rows(device, c.dtype, rows, c.N,
                             c.residual_row_pad < 0 ? c.row_pad : c.residual_row_pad);
    fill_activations(j.residual, rng);
  }
  if (c.normed == Case::kSeparate) {
    j.normed_out = padded_rows(device, c.dtype, rows, c.N,
                               c.normed_row_pad < 0 ? c.row_pad : c.normed_row_pad);
    fill_bytes(*j.normed_out.buffer, kPoisonByte);
  } else if (c.normed == Case::kInPlace) {
    j.normed_out = j.input;
  }
  if (with_quant) {
    j.values = padded_rows(device, DType::kFloat8E4M3, rows, c.N, c.row_pad ? 32 : 0);
    fill_bytes(*j.values.buffer, kPoisonByte);
    j.scales = scales_tensor(device, rows, c.N / c.group_size, c.layout, c.scale_pad);
    fill_bytes(*j.scales.buffer, kPoisonByte);
  }
  return j;
}

void upload(const Job& j) {
  for (const Tensor* t : {&j.input, &j.weight, &j.residual, &j.normed_out, &j.values, &j.scales}) {
    if (t->present()) t->buffer->upload();
  }
}

Fp8GroupQuantOutput quant_view(const Job& j, const Case& c) {
  Fp8GroupQuantOutput q;
  q.values = j.values.device_view();
  q.scales = j.scales.device_view();
  q.group_size = c.group_size;
  q.scale_floor = c.scale_floor;
  q.pow2_scale = c.pow2;
  return q;
}

// rmsnorm_quant's parameters for a job: its input, weight, eps, and the residual and normed_out
// it has, if any.
RmsNormQuantParams job_params(const Job& j, const Case& c) {
  RmsNormQuantParams p;
  p.num_tokens = c.T;
  p.input = j.input.device_view();
  p.weight = j.weight.device_view();
  p.eps = c.eps;
  p.residual = j.residual.device_view();
  p.normed_out = j.normed_out.device_view();
  p.quant = quant_view(j, c);
  return p;
}

// The dual form's parameters: q_c's job normalized and quantized (with the residual and
// normed_out it has, if any), kv_c's job normalized into its normed_out.
MlaRmsNormQuantParams dual_params(const Job& q, const Case& qc, const Job& kv, const Case& kc) {
  MlaRmsNormQuantParams p;
  p.q = job_params(q, qc);
  p.kv.num_tokens = kc.T;
  p.kv.input = kv.input.device_view();
  p.kv.weight = kv.weight.device_view();
  p.kv.eps = kc.eps;
  p.kv.output = kv.normed_out.device_view();
  return p;
}

RefJob ref_job(const Job& j, const Case& c) {
  RefJob r;
  r.num_tokens = c.T;
  r.input = j.input;
  r.weight = j.weight;
  r.residual = j.residual;
  r.normed_out = j.normed_out;
  r.values = j.values;
  r.scales = j.scales;
  r.eps = c.eps;
  r.group_size = c.group_size;
  r.scale_floor = c.scale_floor;
  r.pow2 = c.pow2;
  return r;
}

void expect_job_matches(const Job& j, const Case& c, const std::string& label) {
  EXPECT_TRUE(buffer_matches(*j.input.buffer, label + " input"));
  if (j.weight.present()) {
    EXPECT_TRUE(buffer_unchanged(*j.weight.buffer, label + " weight"));
  }
  if (j.residual.present()) {
    EXPECT_TRUE(buffer_matches(*j.residual.buffer, label + " residual"));
  }
  if (c.normed == Case::kSeparate) {
    EXPECT_TRUE(buffer_matches(*j.normed_out.buffer, label + " normed_out"));
  }
  if (j.values.present()) {
    EXPECT_TRUE(buffer_matches(*j.values.buffer, label + " values"));
    EXPECT_TRUE(buffer_matches(*j.scales.buffer, label + " scales"));
  }
}

class RmsNormQuantTest : public testing::TestWithParam<Backend> {
 protected:
  Device device() const { return GetParam().device; }

  // mla_rmsnorm_quant on random data of the two cases (q_c, kv_c), against the reference.
  void run_dual(const Case& qc, const Case& kc, uint64_t seed) {
    const std::string label = case_label(qc) + " / " + case_label(kc);
    SCOPED_TRACE(label);
    std::mt19937_64 rng(seed);
    Job q = make_job(device(), qc, rng, true, true);
    Job kv = make_job(device(), kc, rng, true, false);
    upload(q);
    upload(kv);
    reference(ref_job(q, qc));
    reference(ref_job(kv, kc));
    mla_rmsnorm_quant(dual_params(q, qc, kv, kc));
    expect_job_matches(q, qc, label + " q");
    expect_job_matches(kv, kc, label + " kv");
  }

  // per_token_group_quant_fp8 (no weight) on random data, against the reference; `prepare` as
  // below.
  void run_group_quant(const Case& c, uint64_t seed,
                       const std::function<void(Job&)>& prepare = {}) {
    const std::string label = case_label(c) + " (per_token_group_quant_fp8)";
    SCOPED_TRACE(label);
    std::mt19937_64 rng(seed);
    Job j = make_job(device(), c, rng, false, true);
    if (prepare) prepare(j);
    upload(j);
    reference(ref_job(j, c));
    PerTokenGroupQuantParams p;
    p.num_tokens = c.T;
    p.input = j.input.device_view();
    p.quant = quant_view(j, c);
    per_token_group_quant_fp8(p);
    expect_job_matches(j, c, label);
  }

  // `prepare` may change the job's host data (its inputs and weight) before the upload.
  void run_rmsnorm_quant(const Case& c, uint64_t seed,
                         const std::function<void(Job&)>& prepare = {}) {
    const std::string label = case_label(c);
    SCOPED_TRACE(label);
    std::mt19937_64 rng(seed);
    Job j = make_job(device(), c, rng, true, true);
    if (prepare) prepare(j);
    upload(j);
    reference(ref_job(j, c));
    rmsnorm_quant(job_params(j, c));
    expect_job_matches(j, c, label);
  }
};

// ---- value tests -------------------------------------------------------------------------------

TEST_P(RmsNormQuantTest, ShapesAndTokenCounts) {
  uint64_t seed = 100;
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    for (int64_t N : {512, 1536, 7168}) {
      for (int64_t T : {1, 3, 64, 1000, 4096}) {
        // The largest products add time, not coverage.
        if (N == 7168 && T == 4096) continue;
        if (dt == DType::kFloat16 && T >= 1000) continue;
        Case c = make_case("shapes", dt, N, T);
        run_rmsnorm_quant(c, ++seed);
      }
    }
  }
}

TEST_P(RmsNormQuantTest, OptionsCombined) {
  uint64_t seed = 200;
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    for (bool residual : {false, true}) {
      for (auto normed : {Case::kNone, Case::kSeparate, Case::kInPlace}) {
        for (ScaleLayout layout : {ScaleLayout::kRowMajor, ScaleLayout::kColumnMajor}) {
          Case c = make_case("options", dt, 1536, 67);
          c.residual = residual;
          c.normed = normed;
          c.layout = layout;
          c.scale_pad =
              layout == ScaleLayout::kColumnMajor ? 1 : 3;  // 67 + 1 = 68: a multiple of 4
          c.pow2 = residual;
          c.row_pad = normed == Case::kSeparate ? 64 : 0;
          run_rmsnorm_quant(c, ++seed);
        }
      }
    }
  }
}

TEST_P(RmsNormQuantTest, GroupSizesPow2AndFloat32) {
  uint64_t seed = 300;
  for (int64_t G : {16, 32, 64, 128, 256}) {
    Case c;
    c.name = "group";
    c.N = 512;
    c.T = 33;
    c.group_size = G;
    c.pow2 = G == 64;
    c.layout = G % 32 == 0 ? ScaleLayout::kColumnMajor : ScaleLayout::kRowMajor;
    c.normed = Case::kSeparate;
    run_rmsnorm_quant(c, ++seed);
  }
  for (int64_t G : {16, 128}) {
    Case c;
    c.name = "float32";
    c.dtype = DType::kFloat32;
    c.N = 1536;
    c.T = 19;
    c.group_size = G;
    c.residual = true;
    c.normed = Case::kSeparate;
    run_rmsnorm_quant(c, ++seed);
  }
  // A hidden size that is no power of two and not a multiple of 128 or of a warp's 256 elements:
  // N = 336, 42 chunks of 8, so the sum's tree has odd levels.
  Case odd;
  odd.name = "odd";
  odd.N = 336;
  odd.T = 5;
  odd.group_size = 16;
  run_rmsnorm_quant(odd, ++seed);
}

// Row widths of the CUDA backend's exact-fit kernel (512, 1024; 1536 in most other tests; two
// rows a block, so odd T leaves a block with one row; its thread forms by grid size) and of its
// generic kernel (the others), with the residual, normed_out (separate or in place), pow2 scales,
// group sizes and scale layouts varied over the widths.
TEST_P(RmsNormQuantTest, ExactFitAndGenericWidths) {
  uint64_t seed = 1100;
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (int64_t N : {512, 768, 1024, 2048, 2560, 4096, 5120, 8192, 32768}) {
      // 32768, the widest row (kMaxRmsNormQuantHidden): 1024 threads of 4 chunks on CUDA, all 128
      // subtrees of the sum, and for 16-bit rows a 64 KB staged weight (past the default 48 KB).
      if (N == 32768 && dt == DType::kFloat32) continue;
      // N = 1024 also at T = 3001 (1501 blocks): the exact-fit kernel's 64-thread form, T = 5
      // its one-chunk form (see "groups" below for N = 1536).
      for (int64_t T : {int64_t{5}, int64_t{3001}}) {
        if (T == 3001 && N != 1024) continue;
        Case c = make_case("widths", dt, N, N >= 4096 ? 3 : T);
        c.residual = (N / 256) % 2 == 0;
        c.normed = c.residual ? Case::kSeparate : Case::kInPlace;
        c.group_size = N == 2048 ? 64 : 128;
        c.pow2 = N == 1024 || N == 5120;
        c.layout = (N / 512) % 2 == 0 ? ScaleLayout::kColumnMajor : ScaleLayout::kRowMajor;
        run_rmsnorm_quant(c, ++seed);
      }
    }
  }
  // Every group size on the exact-fit kernel's widest row, in each of its CUDA thread forms (by
  // grid's blocks of two rows, rmsnorm_quant.h): T = 5 one chunk a thread, T = 3001 two (96
  // threads: a thread's scales are 96 / lanes-per-group groups apart), T = 4501 three (a group is
  // 2 to 32 lanes, and a thread's chunks lie in different groups).
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    for (int64_t G : {16, 32, 64, 256}) {
      for (int64_t T : {5, 3001, 4501}) {
        Case c = make_case("groups", dt, 1536, T);
        c.group_size = G;
        c.residual = G != 32;
        c.normed = c.residual ? Case::kSeparate : Case::kInPlace;
        c.layout = G == 64 ? ScaleLayout::kColumnMajor : ScaleLayout::kRowMajor;
        run_rmsnorm_quant(c, ++seed);
      }
    }
  }
}

// The exact-fit widths' two configurations without a residual or normed_out (rmsnorm_quant of q_c,
// and per_token_group_quant_fp8) in each CUDA thread form of each width, with DeepSeek-V3's group
// of 128 (a compile-time constant in some instances: rmsnorm_quant_rows says which; the run-time
// group in the others) and another group size: N = 1536 at T = 5, 3001, 4501 (one, two and three
// chunks a thread), N = 1024 at T = 5 and 3001 (one, and two in 64 threads), N = 512 (one chunk
// in 64 threads). The CPU backend has no thread forms: it runs the smallest T only.
TEST_P(RmsNormQuantTest, ExactFitWithoutResidualOrNormedOut) {
  uint64_t seed = 2000;
  struct Width {
    int64_t N;
    std::vector<int64_t> token_counts;
  };
  const Width widths[] = {{1536, {5, 3001, 4501}}, {1024, {5, 3001}}, {512, {5, 3001}}};
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (const Width& w : widths) {
      // float32 rows: N = 1536 only, in each of its thread forms.
      if (dt == DType::kFloat32 && w.N != 1536) continue;
      for (int64_t T : w.token_counts) {
        if (T > 5 && device().type == DeviceType::kCPU) continue;
        for (int64_t G : {128, 64}) {
          Case c = make_case("plain", dt, w.N, T);
          c.group_size = G;
          c.layout = T == 3001 ? ScaleLayout::kColumnMajor : ScaleLayout::kRowMajor;
          c.pow2 = G == 64;
          run_rmsnorm_quant(c, ++seed);
          run_group_quant(c, ++seed);
        }
      }
    }
  }
}

// NaN, infinities, signed zeros, subnormals and huge values in the input and the weight, for the
// exact-fit and generic CUDA kernels and the fast / exact quantization paths: every output byte
// still equals the CPU backend's (SpecialValuesEqualTheCpuBackend and its dual form below).
// Bits of a special value in the model dtype: +-inf, a quiet NaN with the sign bit set, -0.
void write_special(uint8_t* p, DType dt, char kind) {
  if (dt == DType::kFloat32) {
    const uint32_t b = kind == 'i'   ? 0x7f800000u
                       : kind == 'I' ? 0xff800000u
                       : kind == 'n' ? 0xffc00001u
                                     : 0x80000000u;
    std::memcpy(p, &b, 4);
    return;
  }
  const bool bf16 = dt == DType::kBFloat16;
  const uint16_t b = kind == 'i'   ? (bf16 ? 0x7f80 : 0x7c00)
                     : kind == 'I' ? (bf16 ? 0xff80 : 0xfc00)
                     : kind == 'n' ? (bf16 ? 0xffc1 : 0xfe01)
                                   : 0x8000;
  std::memcpy(p, &b, 2);
}

void write_special_values(const Job& j, const Case& c) {
  const DType dt = c.dtype;
  const bool fp16 = dt == DType::kFloat16;
  const double huge = fp16 ? 60000.0 : std::ldexp(1.0, 100);
  const double tiny = fp16 ? std::ldexp(1.0, -24) : std::ldexp(1.0, -130);
  auto x = [&](int64_t t, int64_t k, double v) { write_model(host_at(j.input, t, k), dt, v); };
  auto special = [&](int64_t t, int64_t k, char kind) {
    write_special(host_at(j.input, t, k), dt, kind);
  };
  const int64_t N = c.N;
  special(0, 5, 'n');                           // row 0: NaN
  special(1, 130, 'i');                         // row 1: +inf
  special(1, 131, 'I');                         //        and -inf
  for (int64_t k = 0; k < c.group_size; ++k) {  // row 2: a group of +0 and -0
    if (k % 2) {
      special(2, k, 'z');
    } else {
      x(2, k, 0.0);
    }
  }
  for (int64_t k = 0; k < 16; ++k) x(3, N - 16 + k, k % 3 ? tiny : -tiny);  // row 3: subnormals
  x(4, N / 2, huge);                                                        // row 4: one huge value
  x(4, N / 2 + 1, -huge);
  special(5, 200, 'n');  // row 5: NaN next to a finite group
  x(5, 201, 3.0);
  if (j.weight.present()) {
    // Tiny and huge weights: normalized values outside the fast division range.
    const double w_tiny = fp16 ? std::ldexp(1.0, -20) : std::ldexp(1.0, -90);
    const double w_huge = fp16 ? 30000.0 : std::ldexp(1.0, 90);
    for (int64_t k = 0; k < 8; ++k) {
      write_model(j.weight.buffer->host.data() + j.weight.byte_offset({N - 128 + k}), dt, w_tiny);
      write_model(j.weight.buffer->host.data() + j.weight.byte_offset({N - 256 + 2 * k}), dt,
                  w_huge);
    }
  }
}

// The test reference works in doubles and does not model NaN and infinities, so these cases
// compare the backend with the CPU backend (the oracle, DESIGN.md: bitwise equal outputs) on the
// same data (a CUDA-backend test: on the CPU it is skipped).
void run_op(const Job& j, const Case& c, bool with_weight) {
  if (with_weight) {
    rmsnorm_quant(job_params(j, c));
  } else {
    PerTokenGroupQuantParams p;
    p.num_tokens = c.T;
    p.input = j.input.device_view();
    p.quant = quant_view(j, c);
    per_token_group_quant_fp8(p);
  }
}

TEST_P(RmsNormQuantTest, SpecialValuesEqualTheCpuBackend) {
  if (device().type == DeviceType::kCPU) GTEST_SKIP() << "compares a GPU backend with the CPU";
  uint64_t seed = 1200;
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (int64_t N : {1536, 768}) {
      for (int variant = 0; variant < 3; ++variant) {
        Case c = make_case("special", dt, N, 7);
        const bool with_weight = variant < 2;
        c.residual = variant == 1;
        c.normed = with_weight ? Case::kSeparate : Case::kNone;
        c.pow2 = variant == 1;
        c.layout = variant == 2 ? ScaleLayout::kColumnMajor : ScaleLayout::kRowMajor;
        const std::string label = case_label(c);
        SCOPED_TRACE(label);
        ++seed;
        Job jobs[2];
        const Device devices[2] = {device(), Device{}};
        for (int k = 0; k < 2; ++k) {
          std::mt19937_64 rng(seed);
          jobs[k] = make_job(devices[k], c, rng, with_weight, true);
          write_special_values(jobs[k], c);
          upload(jobs[k]);
          run_op(jobs[k], c, with_weight);
        }
        for (auto member : {&Job::residual, &Job::normed_out, &Job::values, &Job::scales}) {
          const Tensor& got = jobs[0].*member;
          if (!got.present()) continue;
          EXPECT_TRUE(bytes_equal(got.buffer->download(), (jobs[1].*member).buffer->download(),
                                  label + ": against the CPU backend"));
        }
      }
    }
  }
}

// The same special values in both inputs of the dual form (the exact-fit kernel's q_c 1536 +
// kv_c 512 instance on CUDA), against the CPU backend.
TEST_P(RmsNormQuantTest, DualSpecialValuesEqualTheCpuBackend) {
  if (device().type == DeviceType::kCPU) GTEST_SKIP() << "compares a GPU backend with the CPU";
  uint64_t seed = 1400;
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    Case qc = make_case("dual special q_c", dt, 1536, 7);
    qc.residual = dt != DType::kFloat16;
    qc.normed = Case::kSeparate;
    qc.pow2 = dt == DType::kBFloat16;
    Case kc = make_case("dual special kv_c", dt, 512, 7);
    kc.normed = dt == DType::kFloat32 ? Case::kInPlace : Case::kSeparate;
    const std::string label = case_label(qc) + " / " + case_label(kc);
    SCOPED_TRACE(label);
    ++seed;
    Job q[2], kv[2];
    const Device devices[2] = {device(), Device{}};
    for (int k = 0; k < 2; ++k) {
      std::mt19937_64 rng(seed);
      q[k] = make_job(devices[k], qc, rng, true, true);
      kv[k] = make_job(devices[k], kc, rng, true, false);
      write_special_values(q[k], qc);
      write_special_values(kv[k], kc);
      upload(q[k]);
      upload(kv[k]);
      mla_rmsnorm_quant(dual_params(q[k], qc, kv[k], kc));
    }
    for (auto member : {&Job::residual, &Job::normed_out, &Job::values, &Job::scales}) {
      if (!(q[0].*member).present()) continue;
      EXPECT_TRUE(bytes_equal((q[0].*member).buffer->download(), (q[1].*member).buffer->download(),
                              label + ": q_c vs the CPU"));
    }
    EXPECT_TRUE(bytes_equal(kv[0].normed_out.buffer->download(),
                            kv[1].normed_out.buffer->download(), label + ": kv_c vs the CPU"));
  }
}

// ---- a NaN in a group: hand-computed bytes ------------------------------------------------------
// The documented rules, not the code (docs/rmsnorm_quant.md, docs/decisions.md): amax = max |y|
// over the group with NaN ignored; scale = max(amax / 448, scale_floor); q = e4m3(y / scale) with
// IEEE division, saturating, round to nearest even; a NaN becomes the byte 0x7f. Four groups of
// G = 16 in a row of N = 64:
//   group 0: NaN, 3, -3, 1.5, then 0s: amax 3, so scale = fl(3 / 448); 3 / scale is 448 within an
//            ulp and rounds (or saturates) to 448 = 0x7e, -3 gives 0xfe, 1.5 gives 224 = 0x76,
//            NaN 0x7f, 0 0x00. (Were the NaN counted, the scale would be the floor and 1.5 would
//            saturate to 0x7e.)
//   group 1: group 0 with 0 in the NaN's place: the same scale and bytes, 0x00 for the NaN's.
//   groups 2, 3: all 0: the floor, bytes 0x00.
constexpr int64_t kNanN = 64;
constexpr int64_t kNanG = 16;

// Writes the row's values (model dtype) at `at(k)`; the NaN is a quiet NaN with the sign set.
void write_nan_groups(DType dt, const std::function<uint8_t*(int64_t)>& at) {
  for (int64_t k = 0; k < kNanN; ++k) write_model(at(k), dt, 0.0);
  write_special(at(0), dt, 'n');
  for (int64_t g : {0, 1}) {
    write_model(at(g * kNanG + 1), dt, 3.0);
    write_model(at(g * kNanG + 2), dt, -3.0);
    write_model(at(g * kNanG + 3), dt, 1.5);
  }
}

// Row 0's e4m3 bytes and scales against the hand-computed ones above.
void expect_nan_groups(const Job& j, float scale_floor, const std::string& label) {
  std::vector<uint8_t> bytes(kNanN, 0x00);
  bytes[0] = 0x7f;
  for (int64_t g : {0, 1}) {
    bytes[g * kNanG + 1] = 0x7e;
    bytes[g * kNanG + 2] = 0xfe;
    bytes[g * kNanG + 3] = 0x76;
  }
  const float scales[kNanN / kNanG] = {3.0f / 448.0f, 3.0f / 448.0f, scale_floor, scale_floor};
  const std::vector<uint8_t> got_values = j.values.buffer->download();
  const std::vector<uint8_t> got_scales = j.scales.buffer->download();
  for (int64_t k = 0; k < kNanN; ++k) {
    EXPECT_EQ(int{got_values[j.values.byte_offset({0, k})]}, int{bytes[k]})
        << label << ": value " << k;
  }
  for (int64_t g = 0; g < kNanN / kNanG; ++g) {
    float got;
    std::memcpy(&got, got_scales.data() + j.scales.byte_offset({0, g}), 4);
    EXPECT_EQ(got, scales[g]) << label << ": scale of group " << g;
  }
}

// rmsnorm_quant with the NaN in the weight (a NaN in x would make the whole row NaN): x = 1
// everywhere and eps = 0, so inv = 1 / sqrt(64 / 64 + 0) = 1 and y = round_model((1 * 1) * w) = w.
// per_token_group_quant_fp8 with the NaN in its input (y = x).
TEST_P(RmsNormQuantTest, NanInAGroupIsIgnoredByItsScale) {
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (bool with_weight : {true, false}) {
      Case c;
      c.name = with_weight ? "nan rmsnorm_quant" : "nan per_token_group_quant";
      c.dtype = dt;
      c.N = kNanN;
      c.T = 1;
      c.group_size = kNanG;
      c.eps = 0.0f;
      const std::string label = case_label(c);
      SCOPED_TRACE(label);
      std::mt19937_64 rng(1500);
      Job j = make_job(device(), c, rng, with_weight, true);
      if (with_weight) {
        for (int64_t k = 0; k < kNanN; ++k) write_model(host_at(j.input, 0, k), dt, 1.0);
        write_nan_groups(dt, [&](int64_t k) {
          return j.weight.buffer->host.data() + j.weight.byte_offset({k});
        });
      } else {
        write_nan_groups(dt, [&](int64_t k) { return host_at(j.input, 0, k); });
      }
      upload(j);
      run_op(j, c, with_weight);
      expect_nan_groups(j, c.scale_floor, label);
    }
  }
}

TEST_P(RmsNormQuantTest, TinyValuesHitTheScaleFloor) {
  Case c;
  c.name = "floor";
  c.N = 512;
  c.T = 8;
  c.scale_floor = 0.5f;  // every group's amax / 448 is below it
  c.normed = Case::kSeparate;
  run_rmsnorm_quant(c, 400);
  c.scale_floor = 1.5f;  // not a power of two: pow2 rounds it up to 2
  c.pow2 = true;
  run_rmsnorm_quant(c, 401);
}

// Multiplies the input rows t % 3 == 1 by 2^row_shift and the weight's group g by
// 2^group_shifts[g % size], rounded to the model dtype (exact for bf16 at these shifts; fp16 values
// may turn subnormal or 0). So groups and the two rows of a CUDA exact-fit block get amax of very
// different magnitudes.
void shift_magnitudes(const Job& j, const Case& c, int row_shift,
                      const std::vector<int>& group_shifts) {
  auto shift = [&](uint8_t* p, int e) {
    write_model(p, c.dtype, round_model(std::ldexp(read_model(p, c.dtype), e), c.dtype));
  };
  for (int64_t t = 1; t < j.input.shape[0]; t += 3) {
    for (int64_t k = 0; k < c.N; ++k) shift(host_at(j.input, t, k), row_shift);
  }
  for (int64_t k = 0; k < c.N; ++k) {
    const size_t g = static_cast<size_t>(k / c.group_size);
    shift(j.weight.buffer->host.data() + j.weight.byte_offset({k}),
          group_shifts[g % group_shifts.size()]);
  }
}

// Scale floors outside [2^-60, 2^59], the range of group scales for which the CUDA bf16 exact-fit
// kernel takes its fast path (quantize_two_bf16_chunks), and at its edges: a tiny floor under
// groups whose amax / 448 lies below 2^-60 (amax inside or below the fast amax range, and scales
// under the floor), and floors at and above 2^59 under groups whose amax / 448 lies below, near
// and above the floor. Exact-fit widths (512, 1536) and a generic one (7168).
TEST_P(RmsNormQuantTest, ScaleFloorOutsideTheFastRange) {
  uint64_t seed = 1600;
  const float floors[] = {std::ldexp(1.0f, -70), std::ldexp(1.0f, -60), std::ldexp(1.0f, 59),
                          std::ldexp(1.5f, 59),  std::ldexp(1.0f, 60),  1e20f};
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    const bool bf16 = dt == DType::kBFloat16;
    // A normalized group's amax is about 2^3 times its weights' scale 2^shift. bf16, small floors:
    // amax near 8 (0: the fast path), 2^-55 (-58: amax in the fast range, amax / 448 under 2^-60),
    // 2^-63 and 2^-72 (-66, -75: amax under 2^-60, scale = floor), 2^-51 (-54: amax / 448 near
    // 2^-60) and 2^-27 (-30); large floors: amax near 2^59 (56: scale = floor), 8 (0: bytes 0),
    // 2^65 (62: amax over 2^60, still floored), 2^71 and 2^75 (68, 72: amax / 448 over the floor)
    // and 2^53 (50). The rows shifted by 2^-40 (eps 1e-6 dominates their norm, so they come out
    // as their raw values times about 2^-30, the others near their weights' scale), so the two rows
    // of a block often take different paths. fp16 cannot go that far (its values stay in [2^-24,
    // 65504]): a tiny floor shows only in the group whose weights round to 0 (-30), and under the
    // large floors every byte is a zero of either sign.
    const std::vector<int> small_shifts =
        bf16 ? std::vector<int>{0, -58, -66, -30, -54, -75} : std::vector<int>{0, -8, -30, -20};
    const std::vector<int> large_shifts =
        bf16 ? std::vector<int>{56, 0, 62, 68, 72, 50} : std::vector<int>{4, 0, -8, 2};
    const int row_shift = bf16 ? -40 : -16;
    for (float scale_floor : floors) {
      for (int64_t N : {1536, 512, 7168}) {
        for (int64_t T : {1, 3, 64}) {
          for (bool pow2 : {false, true}) {
            Case c;
            char name[32];
            std::snprintf(name, sizeof(name), "scale_floor %a", scale_floor);
            c.name = name;
            c.dtype = dt;
            c.N = N;
            c.T = T;
            c.scale_floor = scale_floor;
            c.pow2 = pow2;
            c.normed = T == 3 ? Case::kInPlace : Case::kSeparate;
            c.layout = T == 3 ? ScaleLayout::kColumnMajor : ScaleLayout::kRowMajor;
            c.scale_pad = T == 3 ? 1 : 0;
            const std::vector<int>& shifts = scale_floor < 1.0f ? small_shifts : large_shifts;
            run_rmsnorm_quant(c, ++seed,
                              [&](const Job& j) { shift_magnitudes(j, c, row_shift, shifts); });
          }
        }
      }
    }
  }
}

// T = 0, with padding rows and without: a view of no rows is empty, so its strides address
// nothing and any are accepted (column-major scales of 0 rows have the group stride 0 that
// column_major_scales_view gives them).
TEST_P(RmsNormQuantTest, ZeroTokensWritesNothing) {
  uint64_t seed = 500;
  for (ScaleLayout layout : {ScaleLayout::kRowMajor, ScaleLayout::kColumnMajor}) {
    for (int64_t extra_rows : {2, 0}) {
      Case c;
      c.name = "empty";
      c.T = 0;
      c.extra_rows = extra_rows;
      c.layout = layout;
      c.residual = true;
      c.normed = Case::kSeparate;
      run_rmsnorm_quant(c, ++seed);
      run_group_quant(c, ++seed);
    }
  }
}

// The unfused second step, including an all-zero group (scale = floor, bytes 0).
TEST_P(RmsNormQuantTest, PerTokenGroupQuant) {
  uint64_t seed = 600;
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (ScaleLayout layout : {ScaleLayout::kRowMajor, ScaleLayout::kColumnMajor}) {
      Case c = make_case("quant", dt, 7168, 37);
      c.layout = layout;
      c.scale_pad = 3;
      c.pow2 = layout == ScaleLayout::kColumnMajor;
      c.row_pad = dt == DType::kFloat16 ? 16 : 0;
      run_group_quant(c, ++seed, [&](Job& j) {
        for (int64_t k = 0; k < c.group_size; ++k) {
          write_model(host_at(j.input, 2, 256 + k), dt, 0.0);
        }
      });
    }
  }
}

// Per-token-group quant of rms_norm's output equals the fused op (DESIGN.md: the unfused path
// writes identical bytes on one backend).
TEST_P(RmsNormQuantTest, FusedEqualsUnfused) {
  Case c;
  c.name = "fused-vs-unfused";
  c.N = 1536;
  c.T = 50;
  c.normed = Case::kSeparate;
  std::mt19937_64 rng(700);
  Job j = make_job(device(), c, rng, true, true);
  upload(j);
  RmsNormQuantParams p;
  p.num_tokens = c.T;
  p.input = j.input.device_view();
  p.weight = j.weight.device_view();
  p.normed_out = j.normed_out.device_view();
  p.quant = quant_view(j, c);
  rmsnorm_quant(p);

  Tensor normed = new_tensor(device(), c.dtype, {c.T, c.N});
  Tensor values = new_tensor(device(), DType::kFloat8E4M3, {c.T, c.N});
  Tensor scales = scales_tensor(device(), c.T, c.N / 128, ScaleLayout::kRowMajor, 0);
  for (const Tensor* t : {&normed, &values, &scales}) t->buffer->upload();
  RmsNormParams rn;
  rn.num_tokens = c.T;
  rn.input = j.input.device_view();
  rn.weight = j.weight.device_view();
  rn.eps = c.eps;
  rn.output = normed.device_view();
  rms_norm(rn);
  PerTokenGroupQuantParams q;
  q.num_tokens = c.T;
  q.input = normed.device_view();
  q.quant.values = values.device_view();
  q.quant.scales = scales.device_view();
  per_token_group_quant_fp8(q);

  const auto fused_normed = j.normed_out.buffer->download();
  const auto fused_values = j.values.buffer->download();
  const auto fused_scales = j.scales.buffer->download();
  const int64_t row_bytes = c.N * 2;
  std::vector<uint8_t> a(fused_normed.begin(), fused_normed.begin() + c.T * row_bytes);
  EXPECT_TRUE(bytes_equal(normed.buffer->download(), a, "rms_norm vs rmsnorm_quant normed_out"));
  std::vector<uint8_t> b(fused_values.begin(), fused_values.begin() + c.T * c.N);
  EXPECT_TRUE(bytes_equal(values.buffer->download(), b, "unfused vs fused values"));
  std::vector<uint8_t> s(fused_scales.begin(), fused_scales.begin() + c.T * (c.N / 128) * 4);
  EXPECT_TRUE(bytes_equal(scales.buffer->download(), s, "unfused vs fused scales"));
}

// ---- the dual form -----------------------------------------------------------------------------

// T = 1601: the grid (801 blocks of q_c, 801 of kv_c) is over the one-chunk form's limits
// (DualFormTokenCounts), the CUDA exact-fit kernel's two-chunk thread form (96 threads, the kv_c
// blocks on the first 64); below, its one-chunk form (192).
TEST_P(RmsNormQuantTest, DualForm) {
  uint64_t seed = 800;
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    for (int64_t T : {1, 64, 1601}) {
      for (bool in_place : {false, true}) {
        Case qc = make_case("dual q_c", dt, 1536, T);
        qc.layout = in_place ? ScaleLayout::kColumnMajor : ScaleLayout::kRowMajor;
        qc.scale_pad = in_place ? (4 - T % 4) % 4 : 0;
        qc.normed = in_place ? Case::kSeparate : Case::kNone;
        Case kc = make_case("dual kv_c", dt, 512, T);
        kc.eps = 1e-5f;
        kc.normed = in_place ? Case::kInPlace : Case::kSeparate;
        kc.row_pad = in_place ? 0 : 64;  // kv_c as a strided view
        run_dual(qc, kc, ++seed);
      }
    }
  }
}

// Different token counts for the two tasks (one may be 0): the CUDA exact-fit kernel's blocks
// take two rows of one task each, ceil(T_q / 2) blocks of q_c first; its thread form is one chunk
// a thread while the whole grid has at most kRmsqOneChunkMaxBlocks = 768 blocks ({3, 1201}: 603,
// {768, 768}: 768, one chunk in every dtype), for 16-bit rows at most 8 a multiprocessor (1056 on
// an H200: {770, 768} 769, {1601, 3} and {3, 1601} 803, {2101, 3} 1053 blocks take one chunk for
// 16-bit rows; for fp32 {1601, 3} takes two, {2101, 3} three), else two while q_c has at most
// kRmsqDualTwoChunksMaxBlocks = 1024 ({2047, 200}: 1124 blocks, q_c's 1024), else three
// ({2201, 3}: q_c's 1101; {4097, 3}).
TEST_P(RmsNormQuantTest, DualFormTokenCounts) {
  uint64_t seed = 1300;
  const int64_t counts[][2] = {{5, 3},    {0, 4},    {3, 0},     {2, 7},     {1601, 3},
                               {4097, 3}, {3, 1601}, {3, 1201},  {768, 768}, {770, 768},
                               {2101, 3}, {2201, 3}, {2047, 200}};
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (const auto& tc : counts) {
      Case qc = make_case("dual q_c", dt, 1536, tc[0]);
      qc.residual = tc[0] == 5;
      qc.normed = Case::kSeparate;
      Case kc = make_case("dual kv_c", dt, 512, tc[1]);
      kc.normed = Case::kSeparate;
      run_dual(qc, kc, ++seed);
    }
  }
}

// The dual form with q_c normalized in place (q.normed_out = q.input: the aliasing the API allows
// on q_c, besides kv.output = kv.input on kv_c), with and without q_c's residual (written back
// while q_c's input is overwritten), kv_c in place or separate, contiguous and strided rows, on the
// CUDA exact-fit pair (1536 + 512) and a generic one (768 + 256).
TEST_P(RmsNormQuantTest, DualFormQcInPlace) {
  uint64_t seed = 1700;
  const int64_t widths[][2] = {{1536, 512}, {768, 256}};
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (const auto& w : widths) {
      for (int64_t T : {1, 3, 64}) {
        for (bool residual : {false, true}) {
          Case qc = make_case("dual q_c in place", dt, w[0], T);
          qc.residual = residual;
          qc.normed = Case::kInPlace;
          qc.pow2 = residual;
          qc.layout = T == 3 ? ScaleLayout::kColumnMajor : ScaleLayout::kRowMajor;
          qc.scale_pad = T == 3 ? 1 : 0;
          qc.row_pad = T == 64 ? 64 : 0;
          Case kc = make_case("dual kv_c", dt, w[1], T);
          kc.eps = 1e-5f;
          kc.normed = residual ? Case::kInPlace : Case::kSeparate;
          run_dual(qc, kc, ++seed);
        }
      }
    }
  }
}

// The dual form's kv_c part at widths that are not a multiple of 256 (the CPU backend normalizes an
// unquantized row in pieces of at most 256 values: the last piece is short), wider and narrower
// than one piece, separate and in place.
TEST_P(RmsNormQuantTest, DualKvWidthsNotAMultipleOf256) {
  uint64_t seed = 1900;
  for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
    for (int64_t N : {264, 1000, 200}) {
      Case qc = make_case("dual q_c", dt, 1536, 5);
      Case kc = make_case("dual kv_c", dt, N, 3);
      kc.normed = N == 1000 ? Case::kInPlace : Case::kSeparate;
      run_dual(qc, kc, ++seed);
    }
  }
}

// The dual form's kv_c part is the library's rms_norm, bit for bit, on one backend.
TEST_P(RmsNormQuantTest, DualKvEqualsRmsNorm) {
  Case qc;
  qc.N = 1536;
  qc.T = 40;
  Case kc;
  kc.N = 512;
  kc.T = 40;
  kc.normed = Case::kSeparate;
  std::mt19937_64 rng(900);
  Job q = make_job(device(), qc, rng, true, true);
  Job kv = make_job(device(), kc, rng, true, false);
  upload(q);
  upload(kv);
  MlaRmsNormQuantParams p = dual_params(q, qc, kv, kc);
  mla_rmsnorm_quant(p);

  Tensor out = new_tensor(device(), kc.dtype, {kc.T + kc.extra_rows, kc.N});
  fill_bytes(*out.buffer, kPoisonByte);
  out.buffer->upload();
  RmsNormParams rn;
  rn.num_tokens = kc.T;
  rn.input = kv.input.device_view();
  rn.weight = kv.weight.device_view();
  rn.eps = kc.eps;
  rn.output = out.device_view();
  rms_norm(rn);
  EXPECT_TRUE(bytes_equal(out.buffer->download(), kv.normed_out.buffer->download(),
                          "rms_norm vs mla_rmsnorm_quant kv output"));
}

// Every per-token tensor with its own row stride (input, residual, normed_out; kv_c and kv_c_out in
// the dual form), so that a row address taken with another tensor's stride cannot pass.
TEST_P(RmsNormQuantTest, EveryTensorItsOwnRowStride) {
  uint64_t seed = 1500;
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    Case c = make_case("own row strides", dt, 1536, 67);
    c.residual = true;
    c.normed = Case::kSeparate;
    c.row_pad = 8;
    c.residual_row_pad = 24;
    c.normed_row_pad = 40;
    run_rmsnorm_quant(c, ++seed);

    Case qc = c;
    qc.name = "dual q_c, own row strides";
    qc.residual = false;
    Case kc = make_case("dual kv_c, own row strides", dt, 512, 67);
    kc.normed = Case::kSeparate;
    kc.row_pad = 16;
    kc.normed_row_pad = 48;
    run_dual(qc, kc, ++seed);
  }
}

// ---- bad arguments -----------------------------------------------------------------------------

struct Valid {
  Case c;
  Job j;
  RmsNormQuantParams p;
};

Valid valid_setup(Device device) {
  Valid v;
  v.c.N = 1536;
  v.c.T = 16;
  v.c.residual = true;
  v.c.normed = Case::kSeparate;
  std::mt19937_64 rng(1000);
  v.j = make_job(device, v.c, rng, true, true);
  upload(v.j);
  v.p.num_tokens = v.c.T;
  v.p.input = v.j.input.device_view();
  v.p.weight = v.j.weight.device_view();
  v.p.residual = v.j.residual.device_view();
  v.p.normed_out = v.j.normed_out.device_view();
  v.p.quant = quant_view(v.j, v.c);
  return v;
}

void expect_nothing_written(const Valid& v, const std::string& what) {
  for (const Tensor* t :
       {&v.j.input, &v.j.weight, &v.j.residual, &v.j.normed_out, &v.j.values, &v.j.scales}) {
    EXPECT_TRUE(buffer_unchanged(*t->buffer, what));
  }
}

void expect_error(const std::function<void()>& fn, const std::string& arg,
                  const std::string& what) {
  try {
    fn();
    ADD_FAILURE() << what << ": expected mlakv::Error naming " << arg << ", nothing thrown";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find(arg), std::string::npos)
        << what << ": the message does not name " << arg << ": " << e.message();
  }
}

TEST_P(RmsNormQuantTest, BadArgumentsWriteNothing) {
  const Device dev = device();
  struct Mutation {
    std::string what;
    std::string arg;
    std::function<void(RmsNormQuantParams&)> apply;
  };
  const Device other =
      dev.type == DeviceType::kCPU ? Device{DeviceType::kCUDA, 0} : Device{DeviceType::kCPU, 0};
  auto offset_bytes = [](TensorView& t, int64_t bytes) {
    t.data = static_cast<char*>(t.data) + bytes;
  };
  const std::vector<Mutation> mutations = {
      {"negative num_tokens", "num_tokens", [](auto& p) { p.num_tokens = -1; }},
      {"input missing", "input", [](auto& p) { p.input = TensorView{}; }},
      {"input dtype int32", "input", [](auto& p) { p.input.dtype = DType::kInt32; }},
      {"input 3-d", "input",
       [](auto& p) {
         p.input.ndim = 3;
         p.input.shape[2] = 1;
         p.input.stride[2] = 1;
       }},
      {"input rows < T", "input", [](auto& p) { p.input.shape[0] = p.num_tokens - 1; }},
      {"input innermost stride 2", "input", [](auto& p) { p.input.stride[1] = 2; }},
      {"input row stride not 16 B", "input", [](auto& p) { p.input.stride[0] = 1540; }},
      {"input rows overlap", "input", [](auto& p) { p.input.stride[0] = 8; }},
      {"input rows overlap at T = 2", "input",
       [](auto& p) {
         p.num_tokens = 2;
         p.input.stride[0] = 8;
       }},
      {"input misaligned", "input", [&](auto& p) { offset_bytes(p.input, 2); }},
      {"input rows overlap by one chunk", "input: expected a row stride >= 1536",
       [](auto& p) { p.input.stride[0] = 1536 - 8; }},
      {"input hidden size 0", "input: expected a hidden size N in [1, 32768]",
       [](auto& p) { p.input.shape[1] = 0; }},
      {"input unknown device type", "input: expected a cpu or cuda device",
       [](auto& p) {
         p.input.device = {static_cast<DeviceType>(7), 0};
       }},
      {"input cuda index -1", "input",
       [](auto& p) {
         p.input.device = {DeviceType::kCUDA, -1};
       }},
      {"weight dtype", "weight", [](auto& p) { p.weight.dtype = DType::kFloat16; }},
      {"weight shape", "weight", [](auto& p) { p.weight.shape[0] = 1535; }},
      {"weight missing", "weight", [](auto& p) { p.weight = TensorView{}; }},
      {"weight device", "weight", [&](auto& p) { p.weight.device = other; }},
      {"weight misaligned", "weight", [&](auto& p) { offset_bytes(p.weight, 8); }},
      {"eps NaN", "eps", [](auto& p) { p.eps = std::nanf(""); }},
      {"eps negative", "eps", [](auto& p) { p.eps = -1.0f; }},
      {"residual dtype", "residual", [](auto& p) { p.residual.dtype = DType::kFloat16; }},
      {"residual shape", "residual", [](auto& p) { p.residual.shape[1] = 512; }},
      {"residual device", "residual", [&](auto& p) { p.residual.device = other; }},
      {"residual is input", "residual", [](auto& p) { p.residual = p.input; }},
      {"normed_out dtype", "normed_out", [](auto& p) { p.normed_out.dtype = DType::kFloat32; }},
      {"normed_out rows", "normed_out", [](auto& p) { p.normed_out.shape[0] = 3; }},
      {"normed_out is residual", "normed_out", [](auto& p) { p.normed_out = p.residual; }},
      {"normed_out at input's address, another row stride", "normed_out",
       [](auto& p) {
         // T rows 8 elements apart more than the input's: still inside the input's T + 2 rows.
         p.normed_out.data = p.input.data;
         p.normed_out.shape[0] = p.num_tokens;
         p.normed_out.stride[0] = p.input.stride[0] + 8;
       }},
      {"group size 100", "quant.group_size", [](auto& p) { p.quant.group_size = 100; }},
      {"group size 512", "quant.group_size", [](auto& p) { p.quant.group_size = 512; }},
      {"group size 8", "quant.group_size", [](auto& p) { p.quant.group_size = 8; }},
      {"scale_floor 0", "quant.scale_floor", [](auto& p) { p.quant.scale_floor = 0.0f; }},
      {"scale_floor inf", "quant.scale_floor", [](auto& p) { p.quant.scale_floor = INFINITY; }},
      {"scale_floor subnormal", "quant.scale_floor",
       [](auto& p) { p.quant.scale_floor = FLT_MIN / 2; }},
      {"values dtype bf16", "quant.values",
       [](auto& p) { p.quant.values.dtype = DType::kBFloat16; }},
      {"values dtype e5m2", "quant.values",
       [](auto& p) { p.quant.values.dtype = DType::kFloat8E5M2; }},
      {"values missing", "quant.values", [](auto& p) { p.quant.values = TensorView{}; }},
      {"values shape", "quant.values", [](auto& p) { p.quant.values.shape[1] = 1024; }},
      {"values device", "quant.values", [&](auto& p) { p.quant.values.device = other; }},
      {"values misaligned", "quant.values", [&](auto& p) { offset_bytes(p.quant.values, 4); }},
      {"values misaligned by one byte", "quant.values",
       [&](auto& p) { offset_bytes(p.quant.values, 1); }},
      {"scales dtype", "quant.scales", [](auto& p) { p.quant.scales.dtype = DType::kBFloat16; }},
      {"scales missing", "quant.scales", [](auto& p) { p.quant.scales = TensorView{}; }},
      {"scales groups", "quant.scales", [](auto& p) { p.quant.scales.shape[1] = 24; }},
      {"scales rows", "quant.scales", [](auto& p) { p.quant.scales.shape[0] = 15; }},
      {"scales row stride too small", "quant.scales",
       [](auto& p) { p.quant.scales.stride[0] = 11; }},
      {"scales column-major stride too small", "quant.scales",
       [](auto& p) {
         p.quant.scales.stride[0] = 1;
         p.quant.scales.stride[1] = p.quant.scales.shape[0] - 1;
       }},
      {"scales misaligned", "quant.scales", [&](auto& p) { offset_bytes(p.quant.scales, 2); }},
      {"scales device", "quant.scales", [&](auto& p) { p.quant.scales.device = other; }},
      {"scales overlap input", "quant.scales",
       [](auto& p) {
         p.quant.scales.data = p.input.data;
         p.quant.scales.device = p.input.device;
       }},
  };
  for (const Mutation& m : mutations) {
    Valid v = valid_setup(dev);
    m.apply(v.p);
    expect_error([&] { rmsnorm_quant(v.p); }, m.arg, m.what);
    expect_nothing_written(v, m.what);
  }
  {
    Valid v = valid_setup(dev);
    Context ctx;
    ctx.num_threads = -1;
    expect_error([&] { rmsnorm_quant(v.p, ctx); }, "ctx.num_threads", "negative num_threads");
    expect_nothing_written(v, "negative num_threads");
  }

  // N % G != 0 (N = 1552 = 97 * 16, G = 32).
  {
    Case c;
    c.N = 1552;
    c.T = 4;
    c.group_size = 32;
    std::mt19937_64 rng(1001);
    Job j = make_job(dev, c, rng, true, false);
    j.values = new_tensor(dev, DType::kFloat8E4M3, {c.T, c.N});
    j.scales = scales_tensor(dev, c.T, 48, ScaleLayout::kRowMajor, 0);
    upload(j);
    RmsNormQuantParams p;
    p.num_tokens = c.T;
    p.input = j.input.device_view();
    p.weight = j.weight.device_view();
    p.quant = quant_view(j, c);
    expect_error([&] { rmsnorm_quant(p); }, "quant.group_size", "N % G != 0");
    EXPECT_TRUE(buffer_unchanged(*j.values.buffer, "N % G values"));
    EXPECT_TRUE(buffer_unchanged(*j.scales.buffer, "N % G scales"));
  }
}

TEST_P(RmsNormQuantTest, DualBadArgumentsWriteNothing) {
  const Device dev = device();
  Case qc;
  qc.T = 8;
  Case kc;
  kc.N = 512;
  kc.T = 8;
  kc.normed = Case::kSeparate;
  std::mt19937_64 rng(1100);
  Job q = make_job(dev, qc, rng, true, true);
  Job kv = make_job(dev, kc, rng, true, false);
  upload(q);
  upload(kv);
  auto valid = [&] { return dual_params(q, qc, kv, kc); };
  const Device other =
      dev.type == DeviceType::kCPU ? Device{DeviceType::kCUDA, 0} : Device{DeviceType::kCPU, 0};
  struct Mutation {
    std::string what;
    std::string arg;
    std::function<void(MlaRmsNormQuantParams&)> apply;
  };
  const std::vector<Mutation> mutations = {
      {"kv dtype differs", "kv.input", [](auto& p) { p.kv.input.dtype = DType::kFloat16; }},
      {"kv output missing", "kv.output", [](auto& p) { p.kv.output = TensorView{}; }},
      {"kv output dtype", "kv.output", [](auto& p) { p.kv.output.dtype = DType::kFloat16; }},
      {"kv weight shape", "kv.weight", [](auto& p) { p.kv.weight.shape[0] = 1536; }},
      {"kv on another device", "kv.input", [&](auto& p) { p.kv.input.device = other; }},
      {"kv rows < T", "kv.input", [](auto& p) { p.kv.num_tokens = 11; }},
      {"kv output is q values", "kv.output",
       [](auto& p) { p.kv.output.data = p.q.quant.values.data; }},
      {"q group size", "q.quant.group_size", [](auto& p) { p.q.quant.group_size = 48; }},
      {"q scales stride", "q.quant.scales", [](auto& p) { p.q.quant.scales.stride[0] = 2; }},
  };
  for (const Mutation& m : mutations) {
    MlaRmsNormQuantParams p = valid();
    m.apply(p);
    expect_error([&] { mla_rmsnorm_quant(p); }, m.arg, m.what);
    for (const Job* j : {&q, &kv}) {
      for (const Tensor* t : {&j->input, &j->weight, &j->normed_out, &j->values, &j->scales}) {
        if (t->present()) {
          EXPECT_TRUE(buffer_unchanged(*t->buffer, m.what));
        }
      }
    }
  }

  // per_token_group_quant_fp8: the same checks on its arguments.
  PerTokenGroupQuantParams pq;
  pq.num_tokens = qc.T;
  pq.input = q.input.device_view();
  pq.quant = quant_view(q, qc);
  pq.quant.scales.dtype = DType::kFloat16;
  expect_error([&] { per_token_group_quant_fp8(pq); }, "quant.scales", "quant scales dtype");
  pq.quant = quant_view(q, qc);
  pq.input.dtype = DType::kFloat8E4M3;
  expect_error([&] { per_token_group_quant_fp8(pq); }, "input", "quant input dtype");
  EXPECT_TRUE(buffer_unchanged(*q.values.buffer, "per_token_group_quant_fp8 values"));
  EXPECT_TRUE(buffer_unchanged(*q.scales.buffer, "per_token_group_quant_fp8 scales"));
}

// ---- strides of size-1 dims ---------------------------------------------------------------------
// A one-row tensor's row stride and a one-group scales tensor's group stride are never used (docs/
// decisions.md, "Strides and sizes"): validation hands the backends the canonical stride
// (core::canonical_stride), and a junk one there is accepted and writes the contiguous bytes.

// T rows of N bf16 in groups of G with a residual and a separate normed_out, no graph rows (so
// that a one-row call's tensors have one row).
Case one_row_case(int64_t T, int64_t N, int64_t G) {
  Case c = make_case("unused strides", DType::kBFloat16, N, T);
  c.group_size = G;
  c.residual = true;
  c.normed = Case::kSeparate;
  c.extra_rows = 0;
  return c;
}

TEST(RmsNormQuantUnusedStrides, ArgsEqualTheContiguousTensors) {
  const Case c = one_row_case(1, 64, 32);
  std::mt19937_64 rng(61);
  const Job j = make_job(Device{}, c, rng, true, true);
  upload(j);
  RmsNormQuantParams p = job_params(j, c);
  Device device;
  const core::RmsNormQuantTask want = core::validate_rmsnorm_quant(p, Context{}, &device).tasks[0];
  // A row stride of one element: no 16-byte multiple, which a single row may have.
  constexpr int64_t kJunk = 1;
  for (TensorView* t : {&p.input, &p.residual, &p.normed_out, &p.quant.values, &p.quant.scales}) {
    *t = with_unused_strides(*t, kJunk);
  }
  const core::RmsNormQuantTask got = core::validate_rmsnorm_quant(p, Context{}, &device).tasks[0];
  EXPECT_EQ(got.stride_input_token, want.stride_input_token);
  EXPECT_EQ(got.stride_residual_token, want.stride_residual_token);
  EXPECT_EQ(got.stride_normed_out_token, want.stride_normed_out_token);
  EXPECT_EQ(got.stride_quant_values_token, want.stride_quant_values_token);
  EXPECT_EQ(got.stride_scales_token, want.stride_scales_token);
  EXPECT_EQ(got.stride_scales_group, want.stride_scales_group);
  EXPECT_EQ(want.stride_input_token, c.N);
}

// The bytes of contiguous tensors for a one-row call whose tensors carry a row stride of one
// element (rejected before: it is no 16-byte multiple), and for scales of one group ([T, 1],
// N == G) taken from a wider buffer (strides (8, 2): the group dim's stride is unused).
TEST(RmsNormQuantUnusedStrides, OneRowAndOneGroupWriteTheContiguousBytes) {
  for (const Case& c : {one_row_case(1, 64, 32), one_row_case(3, 32, 32)}) {
    SCOPED_TRACE(case_label(c));
    const int64_t groups = c.N / c.group_size;
    // The outputs in row order (scales as [T, groups] floats), from one run.
    auto run = [&](bool junk) {
      std::mt19937_64 rng(62);
      Job j = make_job(Device{}, c, rng, true, true);
      if (junk && groups == 1) {
        j.scales = new_strided_tensor(Device{}, DType::kFloat32, 8 * c.T, {c.T, 1}, {8, 2});
        fill_bytes(*j.scales.buffer, kPoisonByte);
      }
      upload(j);
      RmsNormQuantParams p = job_params(j, c);
      if (junk) {
        for (TensorView* t : {&p.input, &p.residual, &p.normed_out, &p.quant.values}) {
          *t = with_unused_strides(*t, 1);
        }
      }
      rmsnorm_quant(p);
      std::vector<float> scale_values;
      const std::vector<uint8_t> scale_bytes = j.scales.buffer->download();
      for (int64_t t = 0; t < c.T; ++t) {
        for (int64_t g = 0; g < groups; ++g) {
          float v = 0.0f;
          std::memcpy(&v, scale_bytes.data() + j.scales.byte_offset({t, g}), sizeof(v));
          scale_values.push_back(v);
        }
      }
      return std::make_tuple(j.residual.buffer->download(), j.normed_out.buffer->download(),
                             j.values.buffer->download(), scale_values);
    };
    const auto want = run(false);
    const auto got = run(true);
    EXPECT_EQ(std::get<0>(got), std::get<0>(want)) << "residual";
    EXPECT_EQ(std::get<1>(got), std::get<1>(want)) << "normed_out";
    EXPECT_EQ(std::get<2>(got), std::get<2>(want)) << "quant.values";
    EXPECT_EQ(std::get<3>(got), std::get<3>(want)) << "quant.scales";
  }
}

TEST(RmsNormQuantHelpers, ColumnMajorScalesView) {
  float data[16];
  const TensorView v = column_major_scales_view(data, 3, 4, 4);
  EXPECT_EQ(v.ndim, 2);
  EXPECT_EQ(v.shape[0], 3);
  EXPECT_EQ(v.shape[1], 4);
  EXPECT_EQ(v.stride[0], 1);
  EXPECT_EQ(v.stride[1], 4);
  EXPECT_THROW(column_major_scales_view(data, 5, 4, 4), Error);
  // The default floor reproduces vLLM's max(amax, 1e-10) / 448 for a tiny amax.
  EXPECT_EQ(kDefaultScaleFloor, 1e-10f / 448.0f);
}

// The reference itself: a few hand-checked roundings.
TEST(RmsNormQuantReference, Roundings) {
  EXPECT_EQ(round_format(1.0625, kE4M3), 1.0);   // tie -> even mantissa
  EXPECT_EQ(round_format(1.1875, kE4M3), 1.25);  // tie -> even mantissa
  EXPECT_EQ(round_format(460.0, kE4M3), 448.0);  // saturates
  EXPECT_EQ(round_format(1e9, kE4M3), 448.0);
  EXPECT_EQ(round_format(std::ldexp(1.0, -10), kE4M3), 0.0);  // half the smallest subnormal: even
  EXPECT_EQ(round_format(std::ldexp(3.0, -10), kE4M3), std::ldexp(1.0, -8));
  EXPECT_EQ(encode_format(448.0, kE4M3), 0x7eu);
  EXPECT_EQ(encode_format(-std::ldexp(1.0, -9), kE4M3), 0x81u);
  EXPECT_EQ(encode_format(1.0, kBf16), 0x3f80u);
  EXPECT_EQ(encode_format(65504.0, kFp16), 0x7bffu);
  EXPECT_EQ(round_format(65520.0, kFp16), HUGE_VAL);
  EXPECT_EQ(decode_format(0x0001u, kFp16), std::ldexp(1.0, -24));
  EXPECT_EQ(ref_group_scale(448.0 * 3.0, 1e-10, true), 4.0);
  EXPECT_EQ(ref_group_scale(448.0 * 4.0, 1e-10, true), 4.0);
}

INSTANTIATE_TEST_SUITE_P(Backends, RmsNormQuantTest, testing::ValuesIn(all_backends()),
                         backend_param_name);

}  // namespace
}  // namespace test
}  // namespace mlakv
