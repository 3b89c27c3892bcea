// RoPE tables: the DeepSeek-V3 YaRN table and the plain table against values computed by hand
// (python3 with math, double precision) from vLLM's formulas, written here as literals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "mlakv/mlakv.h"

namespace {

using mlakv::DType;

// DeepSeek-V3: rope_theta 10000, qk_rope_head_dim 64, factor 40, original 4096, beta_fast 32,
// beta_slow 1, mscale 1, mscale_all_dim 1.
mlakv::YarnRopeConfig deepseek_v3() {
  mlakv::YarnRopeConfig c;
  c.base = 10000.0;
  c.rotary_dim = 64;
  c.factor = 40.0;
  c.original_max_position = 4096;
  c.beta_fast = 32.0;
  c.beta_slow = 1.0;
  c.mscale = 1.0;
  c.mscale_all_dim = 1.0;
  return c;
}

constexpr int64_t kR = 64;

double at(const std::vector<double>& t, int64_t p, int64_t col) {
  return t[static_cast<size_t>(p * kR + col)];
}

TEST(Tables, YarnMaxPositionIsOriginalTimesFactor) {
  EXPECT_EQ(deepseek_v3().max_position(), 4096 * 40);
}

TEST(Tables, YarnSoftmaxMultiplier) {
  // yarn_get_mscale(40, 1) = 0.1 * ln(40) + 1 = 1.3688879454113936; squared:
  EXPECT_NEAR(mlakv::yarn_get_mscale(40.0, 1.0), 1.3688879454113936, 1e-15);
  EXPECT_NEAR(mlakv::yarn_softmax_scale_multiplier(40.0, 1.0), 1.8738542070926265, 1e-15);
  EXPECT_EQ(mlakv::yarn_get_mscale(1.0, 1.0), 1.0);
  EXPECT_EQ(mlakv::yarn_get_mscale(0.5, 1.0), 1.0);
}

// Correction range: find_correction_dim(n) = (R * ln(4096 / (n * 2 * pi))) / (2 * ln(10000)):
// beta_fast 32 -> 10.472240810318025 -> low = floor = 10; beta_slow 1 -> 22.513440636877274 ->
// high = ceil = 23. So inv_freq[i] is pure extrapolation (1 / 10000^(2i/64)) for i <= 10, pure
// interpolation (that / 40) for i >= 23, and mixed with mask = 1 - (i - 10) / 13 between.
// At p = 1 the table row is [cos(inv_freq) | sin(inv_freq)] (mscale = 1 for V3), so
// atan2(sin, cos) recovers inv_freq.
TEST(Tables, YarnInvFreqFromRowOne) {
  const std::vector<double> t = mlakv::yarn_cos_sin_table(deepseek_v3());
  ASSERT_EQ(t.size(), static_cast<size_t>(4096 * 40 * kR));
  struct Expected {
    int64_t i;
    double inv_freq;
  };
  const Expected expected[] = {
      {0, 1.0},                     // extrapolation
      {5, 0.23713737056616555},     // 10000^(-10/64)
      {10, 0.056234132519034905},   // 10000^(-20/64), ramp 0 at i = low
      {11, 0.03900692656714386},    // mask 12/13: (1/40 * 1/13 + 12/13) * 10000^(-22/64)
      {15, 0.008334508951020777},   // mask 8/13:  (1/40 * 5/13 + 8/13) * 10000^(-30/64)
      {20, 0.0007905694150420945},  // mask 3/13
      {22, 0.0001778279410038922},  // mask 1/13
      {23, 3.33380358040831e-05},   // 10000^(-46/64) / 40, ramp 1 at i = high
      {31, 3.33380358040831e-06},   // 10000^(-62/64) / 40
  };
  for (const Expected& e : expected) {
    const double got = std::atan2(at(t, 1, 32 + e.i), at(t, 1, e.i));
    EXPECT_NEAR(got, e.inv_freq, 1e-15 * e.inv_freq + 1e-17) << "i = " << e.i;
  }
}

// The correction range at its clips (same formulas, factor 2 for a small table):
// - beta_slow 1e-6 puts find_correction_dim at 70.51344063687728, above R - 1: high = 63, so the
//   ramp runs (i - 10) / 53 over every i > 10;
// - beta_fast = beta_slow = 658.4176333734474 (4096 / (2 pi) * 1.01) puts both at
//   -0.034570990261140626: low = max(floor, 0) = 0 = high = ceil, an empty range that vLLM
//   widens by 0.001 (pure extrapolation at i = 0, pure interpolation from i = 1 on).
TEST(Tables, YarnCorrectionRangeAtItsClips) {
  struct Expected {
    int64_t i;
    double inv_freq;
  };
  struct Case {
    double beta_fast, beta_slow;
    std::vector<Expected> expected;
  };
  const Case cases[] = {
      {32.0,
       1e-6,
       {{0, 1.0},
        {10, 0.056234132519034905},
        {11, 0.04177182345283126},
        {20, 0.002863949579020419},
        {31, 0.00010693332239045522}}},
      {658.4176333734474,
       658.4176333734474,
       {{0, 1.0}, {1, 0.37494710466622794}, {2, 0.28117066259517454}, {31, 6.66760716081662e-05}}},
  };
  for (const Case& c : cases) {
    mlakv::YarnRopeConfig config = deepseek_v3();
    config.factor = 2.0;
    config.beta_fast = c.beta_fast;
    config.beta_slow = c.beta_slow;
    const std::vector<double> t = mlakv::yarn_cos_sin_table(config);
    ASSERT_EQ(t.size(), static_cast<size_t>(4096 * 2 * kR));
    for (const Expected& e : c.expected) {
      const double got = std::atan2(at(t, 1, 32 + e.i), at(t, 1, e.i));
      EXPECT_NEAR(got, e.inv_freq, 1e-15 * e.inv_freq + 1e-17)
          << "beta_fast = " << c.beta_fast << ", i = " << e.i;
    }
  }
}

// vLLM sizes the table torch.arange(original * factor): the ceiling of a fractional product.
TEST(Tables, YarnMaxPositionRoundsUp) {
  mlakv::YarnRopeConfig c = deepseek_v3();
  c.original_max_position = 4097;
  c.factor = 1.5;
  EXPECT_EQ(c.max_position(), 6146);
  c.original_max_position = 3;
  c.factor = 2.5;
  EXPECT_EQ(c.max_position(), 8);
  EXPECT_EQ(mlakv::yarn_cos_sin_table(c).size(), static_cast<size_t>(8 * kR));
}

TEST(Tables, YarnCosSinValues) {
  const std::vector<double> t = mlakv::yarn_cos_sin_table(deepseek_v3());
  struct Expected {
    int64_t p, i;
    double cos, sin;
  };
  // cos(p * inv_freq[i]), sin(p * inv_freq[i]) with the inv_freq above.
  const Expected expected[] = {
      {0, 0, 1.0, 0.0},
      {0, 31, 1.0, 0.0},
      {1, 0, 0.5403023058681398, 0.8414709848078965},
      {1, 15, 0.9999652681813244, 0.008334412459912809},
      {1, 31, 0.9999999999944429, 3.333803580402135e-06},
      {100, 0, 0.8623188722876839, -0.5063656411097588},
      {100, 15, 0.6723252229365845, 0.740255898053688},
      {100, 31, 0.9999999444287689, 0.00033338035186537867},
      {4095, 0, -0.0659759965580649, -0.9978212103769744},
      {4095, 15, -0.9099200590136653, 0.4147836619306114},
      {4095, 31, 0.9999068139101732, 0.013651501602613886},
      {163839, 0, 0.2286846488279413, -0.9735005554135248},
      {163839, 15, -0.4755631022212, 0.879681610473783},
      {163839, 31, 0.8545009141248134, 0.5194498895561133},
  };
  for (const Expected& e : expected) {
    // The angle p * inv_freq carries p times the last-bit error of inv_freq.
    const double tol = 1e-15 * static_cast<double>(e.p + 1) + 1e-15;
    EXPECT_NEAR(at(t, e.p, e.i), e.cos, tol) << "p = " << e.p << ", i = " << e.i;
    EXPECT_NEAR(at(t, e.p, 32 + e.i), e.sin, tol) << "p = " << e.p << ", i = " << e.i;
  }
}

TEST(Tables, YarnMscaleScalesTheTable) {
  // mscale 1 with mscale_all_dim 0: the table is multiplied by yarn_get_mscale(40, 1) / 1.
  mlakv::YarnRopeConfig c = deepseek_v3();
  c.mscale_all_dim = 0.0;
  const std::vector<double> t = mlakv::yarn_cos_sin_table(c);
  EXPECT_NEAR(at(t, 0, 0), 1.3688879454113936, 1e-15);
  EXPECT_NEAR(at(t, 1, 0), 0.5403023058681398 * 1.3688879454113936, 1e-15);
  EXPECT_NEAR(at(t, 1, 32), 0.8414709848078965 * 1.3688879454113936, 1e-15);
}

TEST(Tables, PlainTable) {
  mlakv::RopeTableConfig c;
  c.base = 10000.0;
  c.rotary_dim = kR;
  c.max_position = 1024;
  const std::vector<double> t = mlakv::rope_cos_sin_table(c);
  ASSERT_EQ(t.size(), static_cast<size_t>(1024 * kR));
  struct Expected {
    int64_t p, i;
    double cos, sin;
  };
  // inv_freq[i] = 10000^(-2i/64); cos/sin(p * inv_freq[i]).
  const Expected expected[] = {
      {0, 5, 1.0, 0.0},
      {1, 0, 0.5403023058681398, 0.8414709848078965},
      {1, 1, 0.7317609757987247, 0.6815613503552693},
      {1, 31, 0.9999999911086029, 0.00013335214282110343},
      {7, 0, 0.7539022543433046, 0.6569865987187891},
      {7, 1, 0.5114492661142418, -0.859313474927051},
      {7, 31, 0.9999995643215762, 0.0009334648669508024},
      {1000, 0, 0.5623790762907029, 0.8268795405320025},
      {1000, 1, -0.5845793142368709, 0.8113365672557534},
      {1000, 31, 0.9911217712989062, 0.13295726553038986},
  };
  for (const Expected& e : expected) {
    const double tol = 1e-15 * static_cast<double>(e.p + 1) + 1e-15;
    EXPECT_NEAR(at(t, e.p, e.i), e.cos, tol) << "p = " << e.p << ", i = " << e.i;
    EXPECT_NEAR(at(t, e.p, 32 + e.i), e.sin, tol) << "p = " << e.p << ", i = " << e.i;
  }
}

TEST(Tables, RejectsBadConfig) {
  mlakv::RopeTableConfig c;
  c.rotary_dim = 63;
  EXPECT_THROW(mlakv::rope_cos_sin_table(c), mlakv::Error);
  c.rotary_dim = 64;
  c.max_position = 0;  // a table of no rows: no position could be looked up
  EXPECT_THROW(mlakv::rope_cos_sin_table(c), mlakv::Error);
  mlakv::YarnRopeConfig y = deepseek_v3();
  y.rotary_dim = 0;
  EXPECT_THROW(mlakv::yarn_cos_sin_table(y), mlakv::Error);
}

// Sizes and factors the tables cannot hold are refused with an mlakv::Error before anything is
// allocated: a max_position * rotary_dim past 2^53 entries (2^58 + 1 rows of 64 wrapped the size
// to 64 doubles and wrote past them), and a YaRN factor whose position count is not finite or
// passes 2^53 (its conversion to int64 was undefined, and gave an empty table).
TEST(Tables, RejectsSizesPastTheLimit) {
  const auto expect_error = [](auto fn, const char* what) {
    try {
      fn();
      ADD_FAILURE() << "not refused: " << what;
    } catch (const mlakv::Error& e) {
      EXPECT_NE(std::string(e.message()).find(what), std::string::npos) << e.message();
    }
  };
  mlakv::RopeTableConfig c;
  c.max_position = (int64_t{1} << 58) + 1;
  expect_error([&] { mlakv::rope_cos_sin_table(c); }, "max_position * rotary_dim");
  c.max_position = int64_t{1} << 47;  // 2^53 entries of R = 64 would pass; 2^47 + 1 rows would not
  c.max_position += 1;
  expect_error([&] { mlakv::rope_cos_sin_table(c); }, "max_position * rotary_dim");
  c.max_position = 4;
  c.rotary_dim = (int64_t{1} << 52) + 2;
  expect_error([&] { mlakv::rope_cos_sin_table(c); }, "max_position * rotary_dim");
  c.rotary_dim = 64;
  c.base = INFINITY;
  expect_error([&] { mlakv::rope_cos_sin_table(c); }, "base");

  for (const double factor : {double{INFINITY}, double{NAN}, 1e300, 0x1p58}) {
    SCOPED_TRACE(factor);
    mlakv::YarnRopeConfig y = deepseek_v3();
    y.original_max_position = 1;
    y.factor = factor;
    expect_error([&] { y.max_position(); }, "original_max_position * factor");
    expect_error([&] { mlakv::yarn_cos_sin_table(y); }, "factor");
  }
  mlakv::YarnRopeConfig y = deepseek_v3();
  y.factor = 0x1p40;  // 2^52 positions: a valid count, but 2^58 entries
  EXPECT_EQ(y.max_position(), int64_t{4096} << 40);
  expect_error([&] { mlakv::yarn_cos_sin_table(y); }, "max_position * rotary_dim");
  y = deepseek_v3();
  y.beta_fast = INFINITY;
  expect_error([&] { mlakv::yarn_cos_sin_table(y); }, "beta_fast");
  y = deepseek_v3();
  y.base = INFINITY;
  expect_error([&] { mlakv::yarn_cos_sin_table(y); }, "base");
}

// Within the limit, a table the host cannot allocate is an mlakv::Error too (not std::bad_alloc).
// AddressSanitizer aborts on such an allocation instead of failing it, so this case runs only
// without it.
#if defined(__SANITIZE_ADDRESS__)
#define MLAKV_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MLAKV_TEST_ASAN 1
#endif
#endif
TEST(Tables, AllocationFailureIsAnMlakvError) {
#ifdef MLAKV_TEST_ASAN
  GTEST_SKIP() << "AddressSanitizer aborts on allocations it cannot serve";
#else
  mlakv::RopeTableConfig c;
  c.max_position = int64_t{1} << 46;  // 2^52 doubles: 32 PiB
  try {
    mlakv::rope_cos_sin_table(c);
    ADD_FAILURE() << "a 32 PiB table was allocated";
  } catch (const mlakv::Error& e) {
    EXPECT_NE(std::string(e.message()).find("could not allocate"), std::string::npos)
        << e.message();
  }
#endif
}

uint16_t bits16(const std::vector<uint16_t>& v, size_t i) { return v[i]; }

// Rounding is once, directly from the double: 1 + 2^-8 + 2^-30 lies just above the bf16 midpoint
// between 1 and 1 + 2^-7, but rounds to the midpoint 1 + 2^-8 in float, which would then tie to
// even (1.0) -- the double rounding round_table avoids.
TEST(Tables, RoundTableRoundsOnceFromDouble) {
  const std::vector<double> table = {1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30),
                                     1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40), -0.5, 0.0,
                                     1.0 + std::ldexp(1.0, -8)};
  std::vector<uint16_t> bf16(table.size());
  mlakv::round_table(table, DType::kBFloat16, bf16.data());
  EXPECT_EQ(bits16(bf16, 0), 0x3f81);  // 1 + 2^-7
  EXPECT_EQ(bits16(bf16, 2), 0xbf00);  // -0.5
  EXPECT_EQ(bits16(bf16, 3), 0x0000);
  EXPECT_EQ(bits16(bf16, 4), 0x3f80);  // an exact tie still goes to even

  std::vector<uint16_t> half(table.size());
  mlakv::round_table(table, DType::kFloat16, half.data());
  EXPECT_EQ(bits16(half, 1), 0x3c01);  // 1 + 2^-10: above the midpoint 1 + 2^-11
  EXPECT_EQ(bits16(half, 2), 0xb800);  // -0.5

  std::vector<float> f32(table.size());
  mlakv::round_table(table, DType::kFloat32, f32.data());
  for (size_t i = 0; i < table.size(); ++i) EXPECT_EQ(f32[i], static_cast<float>(table[i]));

  EXPECT_THROW(mlakv::round_table(table, DType::kInt32, f32.data()), mlakv::Error);
  // No buffer for a non-empty table is rejected (an empty one needs none).
  EXPECT_THROW(mlakv::round_table(table, DType::kFloat32, nullptr), mlakv::Error);
  EXPECT_NO_THROW(mlakv::round_table({}, DType::kFloat32, nullptr));
}

}  // namespace
