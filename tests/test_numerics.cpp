// mlakv tests: the scalar numerics. Both the library's src/common/numerics.h and the reference's
// own codec against a table of known values, then cross-checked against each other exhaustively;
// numerics.h's two forms of the fp16 / fp8 rounding (device, host) against each other; the CPU
// backend's vectorized row conversions (src/cpu/cpu_common.h) against the reference; RMSNorm's
// fp32 sum of squares against its documented order, and the CPU group amax (amax_of) against a
// plain loop, with NaNs of every payload.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "common/fast_div.h"
#include "common/numerics.h"
#include "core/backend.h"
#include "cpu/cpu_common.h"
#include "reference/reference.h"

namespace mlakv {
namespace {

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Known {
  float input;
  uint8_t code;
  const char* why;
};

const Known kE4M3Known[] = {
    {0.0f, 0x00, "zero"},
    {-0.0f, 0x80, "negative zero keeps its sign"},
    {std::ldexp(1.0f, -9), 0x01, "smallest subnormal 2^-9"},
    {-std::ldexp(1.0f, -9), 0x81, "negative smallest subnormal"},
    {std::ldexp(1.0f, -10), 0x00, "half the smallest subnormal: tie to even 0"},
    {std::ldexp(1.0f, -10) * 1.001f, 0x01, "just above half the smallest subnormal"},
    {3.0f * std::ldexp(1.0f, -10), 0x02, "subnormal tie 1.5 units -> 2"},
    {5.0f * std::ldexp(1.0f, -10), 0x02, "subnormal tie 2.5 units -> 2"},
    {7.5f * std::ldexp(1.0f, -9), 0x08, "tie between largest subnormal and 2^-6 -> 2^-6"},
    {std::ldexp(1.0f, -6), 0x08, "smallest normal"},
    {1.0f, 0x38, "one"},
    {1.0625f, 0x38, "tie 1.0 / 1.125 -> 1.0"},
    {1.1875f, 0x3a, "tie 1.125 / 1.25 -> 1.25"},
    {-1.1875f, 0xba, "negative tie"},
    {1.07f, 0x39, "nearest 1.125"},
    {448.0f, 0x7e, "max"},
    {-448.0f, 0xfe, "-max"},
    {449.0f, 0x7e, "above max saturates"},
    {464.0f, 0x7e, "tie toward the unrepresentable 480 saturates"},
    {500.0f, 0x7e, "saturates"},
    {1e9f, 0x7e, "saturates"},
    {-1e9f, 0xfe, "saturates negative"},
    {kInf, 0x7e, "+inf saturates"},
    {-kInf, 0xfe, "-inf saturates"},
    {FLT_MAX, 0x7e, "FLT_MAX saturates"},
    {1e-30f, 0x00, "tiny -> 0"},
    {-1e-30f, 0x80, "tiny negative -> -0"},
};

const Known kE5M2Known[] = {
    {0.0f, 0x00, "zero"},
    {-0.0f, 0x80, "negative zero"},
    {std::ldexp(1.0f, -16), 0x01, "smallest subnormal 2^-16"},
    {-std::ldexp(1.0f, -16), 0x81, "negative smallest subnormal"},
    {std::ldexp(1.0f, -17), 0x00, "half the smallest subnormal: tie to even 0"},
    {3.0f * std::ldexp(1.0f, -17), 0x02, "subnormal tie 1.5 units -> 2"},
    {std::ldexp(1.0f, -14), 0x04, "smallest normal"},
    {1.0f, 0x3c, "one"},
    {1.125f, 0x3c, "tie 1.0 / 1.25 -> 1.0"},
    {1.375f, 0x3e, "tie 1.25 / 1.5 -> 1.5"},
    {57344.0f, 0x7b, "max"},
    {-57344.0f, 0xfb, "-max"},
    {61440.0f, 0x7b, "tie toward inf saturates"},
    {60000.0f, 0x7b, "saturates"},
    {1e9f, 0x7b, "saturates"},
    {kInf, 0x7b, "+inf saturates"},
    {-kInf, 0xfb, "-inf saturates"},
};

void expect_known(const Known* table, size_t n, DType dtype) {
  for (size_t i = 0; i < n; ++i) {
    const Known& k = table[i];
    const uint8_t lib = dtype == DType::kFloat8E4M3 ? num::float_to_e4m3(k.input).bits
                                                    : num::float_to_e5m2(k.input).bits;
    EXPECT_EQ(int{lib}, int{k.code})
        << "numerics.h " << dtype_name(dtype) << "(" << k.input << "): " << k.why;
    EXPECT_EQ(int{ref::float_to_fp8(k.input, dtype)}, int{k.code})
        << "reference " << dtype_name(dtype) << "(" << k.input << "): " << k.why;
    // The decoded value of the code is the rounded value.
    if (!std::isinf(k.input) && std::fabs(k.input) <= 448.0f && dtype == DType::kFloat8E4M3) {
      EXPECT_EQ(num::to_float(num::Fp8E4M3{k.code}), ref::fp8_to_float(k.code, dtype));
    }
  }
}

TEST(Fp8Known, E4M3) { expect_known(kE4M3Known, std::size(kE4M3Known), DType::kFloat8E4M3); }
TEST(Fp8Known, E5M2) { expect_known(kE5M2Known, std::size(kE5M2Known), DType::kFloat8E5M2); }

TEST(Fp8Known, NaNStaysNaN) {
  for (float nan : {kNaN, -kNaN, bits_to_float(0x7f800001u), bits_to_float(0xffc00123u)}) {
    EXPECT_EQ(int{num::float_to_e4m3(nan).bits}, 0x7f);
    EXPECT_EQ(int{ref::float_to_fp8(nan, DType::kFloat8E4M3)}, 0x7f);
    EXPECT_TRUE(std::isnan(num::to_float(num::float_to_e5m2(nan))));
    EXPECT_TRUE(std::isnan(
        ref::fp8_to_float(ref::float_to_fp8(nan, DType::kFloat8E5M2), DType::kFloat8E5M2)));
  }
  EXPECT_TRUE(std::isnan(num::to_float(num::Fp8E4M3{0x7f})));
  EXPECT_TRUE(std::isnan(num::to_float(num::Fp8E4M3{0xff})));
  EXPECT_TRUE(std::isnan(ref::fp8_to_float(0xff, DType::kFloat8E4M3)));
}

// fp32 storage: every NaN becomes 0x7fffffff (whatever its sign and payload, as the GPU's
// arithmetic gives), every other value keeps its bits.
TEST(FromFloat, Float32NaNIsCanonical) {
  for (uint32_t bits : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xffc00001u, 0x7fffffffu}) {
    EXPECT_EQ(num::float_bits(num::from_float<float>(bits_to_float(bits))), 0x7fffffffu) << bits;
  }
  for (uint32_t bits : {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x3f800000u,
                        0x7f7fffffu, 0x7f800000u, 0xff800000u}) {
    EXPECT_EQ(num::float_bits(num::from_float<float>(bits_to_float(bits))), bits) << bits;
  }
}

// bf16 and fp16 storage: every NaN becomes 0x7fff, whatever its sign and payload (an x86 invalid
// operation gives a negative NaN, a GPU a positive one: a kept sign would split the backends).
TEST(FromFloat, SixteenBitNaNIsCanonical) {
  for (uint32_t bits :
       {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fc00001u, 0xffffffffu}) {
    const float f = bits_to_float(bits);
    EXPECT_EQ(num::float_to_bf16(f).bits, 0x7fff) << std::hex << bits;
    EXPECT_EQ(num::float_to_half(f).bits, 0x7fff) << std::hex << bits;
    EXPECT_EQ(num::from_float<num::Bf16>(f).bits, 0x7fff) << std::hex << bits;
    EXPECT_EQ(num::from_float<num::Half>(f).bits, 0x7fff) << std::hex << bits;
  }
}

TEST(Fp8Decode, AllCodesAgree) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const float a = num::to_float(num::Fp8E4M3{code});
    const float b = ref::fp8_to_float(code, DType::kFloat8E4M3);
    if (std::isnan(b)) {
      EXPECT_TRUE(std::isnan(a)) << "e4m3 code " << c;
    } else {
      EXPECT_EQ(a, b) << "e4m3 code " << c;
      EXPECT_EQ(std::signbit(a), std::signbit(b)) << "e4m3 code " << c;
    }
    const float x = num::to_float(num::Fp8E5M2{code});
    const float y = ref::fp8_to_float(code, DType::kFloat8E5M2);
    if (std::isnan(y)) {
      EXPECT_TRUE(std::isnan(x)) << "e5m2 code " << c;
    } else {
      EXPECT_EQ(x, y) << "e5m2 code " << c;
      EXPECT_EQ(std::signbit(x), std::signbit(y)) << "e5m2 code " << c;
    }
  }
}

// Counts disagreements between numerics.h and the reference on one float; reports a few.
struct CrossCheck {
  int64_t failures = 0;
  void check(float f) {
    const uint8_t a4 = num::float_to_e4m3(f).bits;
    const uint8_t b4 = ref::float_to_fp8(f, DType::kFloat8E4M3);
    const uint8_t a5 = num::float_to_e5m2(f).bits;
    const uint8_t b5 = ref::float_to_fp8(f, DType::kFloat8E5M2);
    const uint16_t abf = num::float_to_bf16(f).bits;
    const uint16_t bbf = ref::float_to_bf16(f);
    const uint16_t ah = num::float_to_half(f).bits;
    const uint16_t bh = ref::float_to_fp16(f);
    bool ok = a4 == b4 && a5 == b5;
    if (std::isnan(f)) {
      ok = ok && std::isnan(num::to_float(num::Bf16{abf})) && std::isnan(ref::bf16_to_float(bbf)) &&
           std::isnan(num::to_float(num::Half{ah})) && std::isnan(ref::fp16_to_float(bh));
    } else {
      ok = ok && abf == bbf && ah == bh;
    }
    if (!ok && failures++ < 8) {
      uint32_t u;
      std::memcpy(&u, &f, 4);
      ADD_FAILURE() << "float " << f << " (0x" << std::hex << u << "): e4m3 lib 0x" << int{a4}
                    << " ref 0x" << int{b4} << "; e5m2 lib 0x" << int{a5} << " ref 0x" << int{b5}
                    << "; bf16 lib 0x" << abf << " ref 0x" << bbf << "; fp16 lib 0x" << ah
                    << " ref 0x" << bh;
    }
  }
};

TEST(NumericsCrossCheck, AllBf16Patterns) {
  CrossCheck cc;
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const float f = bits_to_float(b << 16);
    cc.check(f);
    // Values between bf16 neighbours exercise the 16-bit roundings' ties and near-ties.
    cc.check(bits_to_float((b << 16) | 0x8000u));
    cc.check(bits_to_float((b << 16) | 0x7fffu));
  }
  EXPECT_EQ(cc.failures, 0);
}

// Every rounding position of every exponent: the bits below position p all zeros, just under, at
// and just over half a unit there, and all ones; above them both parities of bit p and random
// higher bits. Each format rounds at one p per exponent (a subnormal result's p moves with the
// exponent), so its exact values, ties and near-ties are all here, which whole bf16 patterns give
// only for fp8 and random floats hardly ever. The exponents 0 and 255 give zeros, subnormals,
// infinities and NaNs.
std::vector<float> rounding_position_floats() {
  std::vector<float> out;
  std::mt19937 rng(77);
  for (uint32_t sign = 0; sign < 2; ++sign) {
    for (uint32_t exp = 0; exp < 256; ++exp) {
      for (uint32_t p = 1; p < 23; ++p) {
        const uint32_t half = 1u << (p - 1);
        for (uint32_t low : {0u, half - 1u, half, half + 1u, 2 * half - 1u}) {
          for (int k = 0; k < 4; ++k) {
            const uint32_t high = (static_cast<uint32_t>(rng()) & (0x7fffffu >> p) & ~1u) |
                                  static_cast<uint32_t>(k & 1);
            out.push_back(bits_to_float((sign << 31) | (exp << 23) | (high << p) | low));
          }
        }
      }
    }
  }
  return out;
}

TEST(NumericsCrossCheck, TiesAtEveryBitOfEveryExponent) {
  CrossCheck cc;
  for (float f : rounding_position_floats()) cc.check(f);
  EXPECT_EQ(cc.failures, 0);
}

// Runs row(offset, n) over [0, size) in rows of every length from 1 to 67 in turn, so that each
// loop runs its vector body and every tail from every start offset modulo 8.
template <typename Row>
void over_rows(size_t size, const Row& row) {
  for (size_t i = 0, len = 1; i < size; i += len, len = len % 67 + 1) {
    row(i, static_cast<int64_t>(std::min(len, size - i)));
  }
}

// Whether v is the reference's conversion of x: the same bits, or for a NaN any NaN (the library
// makes NaNs canonical, the reference need not).
bool is_ref_of(num::Half v, float x) {
  return std::isnan(x) ? std::isnan(num::to_float(v)) : v.bits == ref::float_to_fp16(x);
}
bool is_ref_of(num::Bf16 v, float x) {
  return std::isnan(x) ? std::isnan(num::to_float(v)) : v.bits == ref::float_to_bf16(x);
}
bool is_ref_of(num::Fp8E4M3 v, float x) {
  return v.bits == ref::float_to_fp8(x, DType::kFloat8E4M3);
}
bool is_ref_of(num::Fp8E5M2 v, float x) {
  return v.bits == ref::float_to_fp8(x, DType::kFloat8E5M2);
}

// This file's copies of cpu_common.h's inline row kernels are compiled as the library's (CMakeLists
// gives it the CPU sources' -march): one vector width, so the loops tested here and the ones the
// library runs in the other tests are the ones it ships.
TEST(NumericsCrossCheck, CpuVectorWidthIsTheLibrarys) {
  EXPECT_EQ(cpu::detail::kVecBytes, cpu::vector_bytes());
}

// The CPU backend's row loops (cpu_common.h convert_row and quantize_row, which the compiler
// vectorizes) against the reference element by element: floats at every rounding position of
// every exponent (above), and every fp16 and bf16 pattern, into fp16, bf16, e4m3 and e5m2.
TEST(NumericsCrossCheck, CpuRowLoopsEqualTheReference) {
  using cpu::detail::convert_row;
  using cpu::detail::quantize_row;
  int64_t failures = 0;
  auto expect = [&](bool ok, const char* what, uint32_t in_bits) {
    if (!ok && failures++ < 8) {
      ADD_FAILURE() << what << " of input bits 0x" << std::hex << in_bits;
    }
  };
  const std::vector<float> f = rounding_position_floats();
  std::vector<num::Half> h(f.size());
  std::vector<num::Bf16> b(f.size());
  std::vector<num::Fp8E4M3> e4(f.size());
  std::vector<num::Fp8E5M2> e5(f.size());
  over_rows(f.size(), [&](size_t i, int64_t n) {
    convert_row(f.data() + i, h.data() + i, n);
    convert_row(f.data() + i, b.data() + i, n);
    quantize_row(f.data() + i, e4.data() + i, n, 1.0f);
    quantize_row(f.data() + i, e5.data() + i, n, 1.0f);
  });
  for (size_t i = 0; i < f.size(); ++i) {
    const uint32_t u = float_to_bits(f[i]);
    expect(is_ref_of(h[i], f[i]), "float -> fp16", u);
    expect(is_ref_of(b[i], f[i]), "float -> bf16", u);
    expect(is_ref_of(e4[i], f[i]), "float -> e4m3", u);
    expect(is_ref_of(e5[i], f[i]), "float -> e5m2", u);
  }

  // Every 16-bit pattern into the other 16-bit type and into fp8, at scale 1 and at a scale that
  // makes the quantization a real division.
  std::vector<num::Half> all_h(0x10000);
  std::vector<num::Bf16> all_b(0x10000);
  for (uint32_t v = 0; v < 0x10000u; ++v) {
    all_h[v] = num::Half{static_cast<uint16_t>(v)};
    all_b[v] = num::Bf16{static_cast<uint16_t>(v)};
  }
  for (float scale : {1.0f, 0.037f}) {
    over_rows(0x10000, [&](size_t i, int64_t n) {
      convert_row(all_h.data() + i, b.data() + i, n);
      convert_row(all_b.data() + i, h.data() + i, n);
      quantize_row(all_h.data() + i, e4.data() + i, n, scale);
      quantize_row(all_b.data() + i, e5.data() + i, n, scale);
    });
    for (uint32_t v = 0; v < 0x10000u; ++v) {
      const float xh = ref::fp16_to_float(static_cast<uint16_t>(v));
      const float xb = ref::bf16_to_float(static_cast<uint16_t>(v));
      expect(is_ref_of(b[v], xh), "fp16 -> bf16", v);
      expect(is_ref_of(h[v], xb), "bf16 -> fp16", v);
      expect(is_ref_of(e4[v], xh / scale), "fp16 -> e4m3", v);
      expect(is_ref_of(e5[v], xb / scale), "bf16 -> e5m2", v);
    }
  }
  EXPECT_EQ(failures, 0);
}

// numerics.h's two forms of the fp16 / fp8 rounding (the device's by selects, the host's by masks;
// test_cuda_numerics.cu compares them on the GPU for every float): on the host, at every rounding
// position of every exponent (above) and on random floats.
template <typename F>
int64_t narrow_forms_differ(float f) {
  return num::detail::narrow_bits_by_selects<F>(f) != num::detail::narrow_bits_by_masks<F>(f);
}

TEST(NumericsCrossCheck, NarrowFormsAgree) {
  int64_t differ = 0;
  auto check = [&](float f) {
    const int64_t d = narrow_forms_differ<num::Fp16Format>(f) +
                      narrow_forms_differ<num::E4M3Format>(f) +
                      narrow_forms_differ<num::E5M2Format>(f);
    if (d != 0 && differ < 8) ADD_FAILURE() << "float bits 0x" << std::hex << float_to_bits(f);
    differ += d;
  };
  for (float f : rounding_position_floats()) check(f);
  std::mt19937 rng(78);
  for (int i = 0; i < 1000000; ++i) check(bits_to_float(static_cast<uint32_t>(rng())));
  EXPECT_EQ(differ, 0);
}

TEST(NumericsCrossCheck, RandomFloats) {
  CrossCheck cc;
  std::mt19937_64 rng(1234);
  for (int i = 0; i < 1000000; ++i) cc.check(bits_to_float(static_cast<uint32_t>(rng())));
  // Dense in the fp8 ranges, where the interesting roundings are.
  std::uniform_real_distribution<float> wide(-70000.0f, 70000.0f);
  std::uniform_real_distribution<float> narrow(-2.0f, 2.0f);
  std::uniform_real_distribution<float> tiny(-0.02f, 0.02f);
  for (int i = 0; i < 300000; ++i) {
    cc.check(wide(rng));
    cc.check(narrow(rng));
    cc.check(tiny(rng));
  }
  EXPECT_EQ(cc.failures, 0);
}

// fp8 with a scale: cvt(x / scale), IEEE float division, in both.
TEST(NumericsCrossCheck, QuantizeWithScale) {
  std::mt19937_64 rng(99);
  std::uniform_real_distribution<float> dist(-20.0f, 20.0f);
  int64_t failures = 0;
  for (float scale : {0.037f, 1.0f, 0.5f, 3.3f, 1e-3f}) {
    for (int i = 0; i < 100000; ++i) {
      const float x = dist(rng);
      const uint8_t a = num::quantize<num::Fp8E4M3>(x, scale).bits;
      const uint8_t b = ref::float_to_fp8(x / scale, DType::kFloat8E4M3);
      const uint8_t c = num::quantize<num::Fp8E5M2>(x, scale).bits;
      const uint8_t d = ref::float_to_fp8(x / scale, DType::kFloat8E5M2);
      if ((a != b || c != d) && failures++ < 8) {
        ADD_FAILURE() << "x " << x << " scale " << scale << ": e4m3 " << int{a} << " vs " << int{b}
                      << ", e5m2 " << int{c} << " vs " << int{d};
      }
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(NumericsCrossCheck, DecodeBf16AndFp16AllPatterns) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const uint16_t u = static_cast<uint16_t>(b);
    const float a = num::to_float(num::Bf16{u});
    const float r = ref::bf16_to_float(u);
    const float h = num::to_float(num::Half{u});
    const float g = ref::fp16_to_float(u);
    if (std::isnan(r)) {
      ASSERT_TRUE(std::isnan(a)) << "bf16 0x" << std::hex << b;
    } else {
      ASSERT_EQ(a, r) << "bf16 0x" << std::hex << b;
      ASSERT_EQ(std::signbit(a), std::signbit(r)) << "bf16 0x" << std::hex << b;
    }
    if (std::isnan(g)) {
      ASSERT_TRUE(std::isnan(h)) << "fp16 0x" << std::hex << b;
    } else {
      ASSERT_EQ(h, g) << "fp16 0x" << std::hex << b;
      ASSERT_EQ(std::signbit(h), std::signbit(g)) << "fp16 0x" << std::hex << b;
    }
  }
}

// The RoPE rotation is the float fma formula in both.
TEST(NumericsCrossCheck, RopeRotate) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  for (int i = 0; i < 100000; ++i) {
    const float x = dist(rng), y = dist(rng), c = dist(rng) / 4, s = dist(rng) / 4;
    float xo, yo;
    num::rope_rotate(x, y, c, s, xo, yo);
    ASSERT_EQ(xo, std::fma(x, c, -(y * s)));
    ASSERT_EQ(yo, std::fma(y, c, x * s));
  }
}

// FastDiv (the GPU work items' index decoding) equals the division for numerators below 2^31
// (its whole domain, sampled): divisors 1-1000, every power of two and its neighbours up to
// 2^31 - 1, random ones; numerators 0, 1, 2^31 - 1, around small and the largest multiples of
// the divisor, the largest n = d - 1 (mod d), and random ones.
TEST(FastDiv, EqualsDivisionBelow2To31) {
  std::vector<uint32_t> divisors;
  for (uint32_t d = 1; d <= 1000; ++d) divisors.push_back(d);
  for (int k = 1; k <= 31; ++k) {
    for (int64_t delta = -2; delta <= 2; ++delta) {
      const int64_t d = (int64_t{1} << k) + delta;
      if (d >= 1 && d < (int64_t{1} << 31)) divisors.push_back(static_cast<uint32_t>(d));
    }
  }
  std::mt19937_64 rng(0xfa57d1f);
  for (int i = 0; i < 2000; ++i) divisors.push_back(1 + static_cast<uint32_t>(rng() % 0x7fffffff));
  constexpr uint32_t kMax = 0x7fffffffu;
  int64_t checked = 0;
  for (const uint32_t d : divisors) {
    const FastDiv f(d);
    ASSERT_EQ(f.divisor, d);
    // The largest n below 2^31 with n % d == d - 1: the remainder that leaves the least margin.
    const uint32_t top = (kMax - (d - 1)) / d * d + (d - 1);
    std::vector<uint32_t> numerators = {0, 1, kMax, kMax - 1, d - 1, d, top};
    for (uint32_t m : {2u, 3u, 1000u, kMax / d}) {
      const uint64_t base = uint64_t{m} * d;
      for (int64_t delta = -1; delta <= 1; ++delta) {
        const int64_t n = static_cast<int64_t>(base) + delta;
        if (n >= 0 && n <= kMax) numerators.push_back(static_cast<uint32_t>(n));
      }
    }
    for (int j = 0; j < 64; ++j) numerators.push_back(static_cast<uint32_t>(rng() & kMax));
    for (const uint32_t n : numerators) {
      if (n > kMax) continue;
      ASSERT_EQ(f.div(n), n / d) << n << " / " << d;
      ++checked;
    }
  }
  EXPECT_GT(checked, 100000);
}

// ---- RMSNorm's sum of squares ------------------------------------------------------------------
// The library's previous order: 16 interleaved partial sums, then partial[k] += partial[k + w].
float sixteen_partials_sum(const std::vector<float>& squares) {
  float partial[16] = {};
  for (size_t i = 0; i < squares.size(); ++i) partial[i % 16] += squares[i];
  for (int w = 8; w > 0; w /= 2) {
    for (int k = 0; k < w; ++k) partial[k] += partial[k + w];
  }
  return partial[0];
}

float sequential_sum(const std::vector<float>& squares) {
  float sum = 0.0f;
  for (float q : squares) sum += q;
  return sum;
}

// A row of T: random signs and magnitudes in [2^min_exp, 2^(max_exp + 1)), never zero; the
// values and their fp32 squares as the reference sees them, through the reference's own decoders.
template <typename T>
struct SumSquaresRow {
  std::vector<T> stored;
  std::vector<float> values;
  std::vector<float> squares;
};

template <typename T>
SumSquaresRow<T> random_row(int64_t n, int min_exp, int max_exp, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(min_exp, max_exp);
  std::bernoulli_distribution negative(0.5);
  SumSquaresRow<T> r;
  for (int64_t i = 0; i < n; ++i) {
    const float v = (negative(rng) ? -1.0f : 1.0f) * std::ldexp(mantissa(rng), exponent(rng));
    float value = v;
    if constexpr (std::is_same_v<T, float>) {
      r.stored.push_back(v);
    } else if constexpr (std::is_same_v<T, num::Bf16>) {
      r.stored.push_back(T{ref::float_to_bf16(v)});
      value = ref::bf16_to_float(r.stored.back().bits);
    } else {
      r.stored.push_back(T{ref::float_to_fp16(v)});
      value = ref::fp16_to_float(r.stored.back().bits);
    }
    r.values.push_back(value);
    r.squares.push_back(value * value);
  }
  return r;
}

// sum_squares equals the tree bit for bit at every n; the data tells the orders apart (the old
// 16-partial order and the sequential sum each give another float for some n), so a wrong order
// cannot pass.
template <typename T>
void expect_tree_order(const char* dtype, int min_exp, int max_exp) {
  // With the CPU's tiles of 2048 elements: a partial tile of 256 chunks (2041, 2047), whole tiles
  // with and without a partial one after them (2048, 2049, 4096, 6143, 6144, 10241).
  const int64_t kSizes[] = {0,    1,    2,    3,    7,    8,    9,    31,
                            255,  256,  257,  512,  1000, 1536, 2041, 2047,
                            2048, 2049, 4096, 5000, 6143, 6144, 7168, 10241};
  std::mt19937_64 rng(0x5eed5a + static_cast<uint64_t>(sizeof(T)));
  int differs_from_partials = 0;
  int differs_from_sequential = 0;
  for (int trial = 0; trial < 3; ++trial) {
    for (const int64_t n : kSizes) {
      const SumSquaresRow<T> r = random_row<T>(n, min_exp, max_exp, rng);
      for (size_t i = 0; i < r.values.size(); ++i) {
        ASSERT_EQ(num::to_float(r.stored[i]), r.values[i]) << dtype << " element " << i;
      }
      const float expected = ref::tree_sum_squares(r.values);
      const float got = cpu::detail::sum_squares(r.stored.data(), n);
      ASSERT_EQ(float_to_bits(got), float_to_bits(expected))
          << dtype << " n " << n << " trial " << trial << ": sum_squares " << got << ", tree "
          << expected;
      if (float_to_bits(sixteen_partials_sum(r.squares)) != float_to_bits(expected)) {
        ++differs_from_partials;
      }
      if (float_to_bits(sequential_sum(r.squares)) != float_to_bits(expected)) {
        ++differs_from_sequential;
      }
    }
  }
  EXPECT_GT(differs_from_partials, 0) << dtype << ": the data does not tell the orders apart";
  EXPECT_GT(differs_from_sequential, 0) << dtype << ": the data does not tell the orders apart";
}

TEST(SumSquares, PairwiseTreeFloat32) { expect_tree_order<float>("float32", -20, 20); }
TEST(SumSquares, PairwiseTreeBFloat16) { expect_tree_order<num::Bf16>("bfloat16", -20, 20); }
// fp16: below 2^-14 the values are subnormal; 2^15 would overflow near 2^16 (max 65504).
TEST(SumSquares, PairwiseTreeFloat16) { expect_tree_order<num::Half>("float16", -20, 14); }

// Rows with an infinity, a NaN, subnormals or zeros among finite values, on both sides of a
// tile boundary: the tree's value (a NaN as any NaN), as the backends' RMSNorm then sees it.
TEST(SumSquares, SpecialValuesFloat32) {
  std::mt19937_64 rng(0x5bec);
  const float kSpecial[] = {kInf, -kInf, kNaN, -kNaN, bits_to_float(0x7f800001u), 1e-40f, -0.0f};
  for (const int64_t n : {1, 9, 2047, 2049}) {
    for (const float special : kSpecial) {
      for (const int64_t at : {int64_t{0}, n / 2, n - 1}) {
        SumSquaresRow<float> r = random_row<float>(n, -20, 20, rng);
        r.stored[static_cast<size_t>(at)] = special;
        r.values[static_cast<size_t>(at)] = special;
        const float expected = ref::tree_sum_squares(r.values);
        const float got = cpu::detail::sum_squares(r.stored.data(), n);
        if (std::isnan(expected)) {
          ASSERT_TRUE(std::isnan(got)) << "n " << n << " at " << at << ": " << got;
        } else {
          ASSERT_EQ(float_to_bits(got), float_to_bits(expected))
              << "n " << n << " special " << special << " at " << at;
        }
      }
    }
  }
}

// The examples of docs/rmsnorm_quant.md written out: n = 3 is (q0 + q1) + q2, n = 6 is
// ((q0 + q1) + (q2 + q3)) + (q4 + q5).
TEST(SumSquares, SmallTreesWrittenOut) {
  std::mt19937_64 rng(61);
  for (int trial = 0; trial < 1000; ++trial) {
    const SumSquaresRow<float> r = random_row<float>(6, -20, 20, rng);
    const std::vector<float>& q = r.squares;
    const float three = (q[0] + q[1]) + q[2];
    const float six = ((q[0] + q[1]) + (q[2] + q[3])) + (q[4] + q[5]);
    ASSERT_EQ(float_to_bits(cpu::detail::sum_squares(r.stored.data(), 3)), float_to_bits(three));
    ASSERT_EQ(float_to_bits(cpu::detail::sum_squares(r.stored.data(), 6)), float_to_bits(six));
  }
}

// A NaN of V with a random sign and payload (quiet or signaling): the bit patterns a raw input can
// carry, which num::from_float would have made canonical.
template <typename V>
V random_nan(std::mt19937_64& rng) {
  const uint64_t r = rng();
  if constexpr (std::is_same_v<V, float>) {
    const uint32_t payload = 1u + static_cast<uint32_t>(r % 0x7fffffu);  // 1 .. 2^23 - 1
    return bits_to_float(((r >> 32) & 1u) << 31 | 0x7f800000u | payload);
  } else {
    constexpr int kMantissaBits = std::is_same_v<V, num::Bf16> ? 7 : 10;
    constexpr uint32_t kExponent = std::is_same_v<V, num::Bf16> ? 0x7f80u : 0x7c00u;
    const uint32_t payload = 1u + static_cast<uint32_t>(r % ((1u << kMantissaBits) - 1u));
    return V{static_cast<uint16_t>(((r >> 32) & 1u) << 15 | kExponent | payload)};
  }
}

// amax_of (a maximum of bit patterns) against one float compare a value: the largest |v| with NaN
// skipped and +0 for none, at every length up to 70 (every vector tail), with NaN of any sign and
// payload, -0 and -inf among the values.
template <typename V>
void expect_amax_of(const char* dtype) {
  std::mt19937_64 rng(0xa3a0f + sizeof(V));
  std::uniform_real_distribution<float> value(-8.0f, 8.0f);
  std::uniform_int_distribution<int> kind(0, 15);
  for (int trial = 0; trial < 20; ++trial) {
    for (int64_t n = 0; n <= 70; ++n) {
      std::vector<V> v(static_cast<size_t>(n));
      float expected = 0.0f;
      for (auto& e : v) {
        const int k = kind(rng);
        if (k == 0) {
          e = random_nan<V>(rng);
        } else {
          const float f = k == 1 ? -0.0f : k == 2 && trial % 5 == 0 ? -kInf : value(rng);
          e = num::from_float<V>(f);
        }
        const float stored = std::fabs(num::to_float(e));
        if (!std::isnan(stored) && stored > expected) expected = stored;
      }
      const float got = cpu::detail::amax_of(v.data(), n);
      ASSERT_EQ(float_to_bits(got), float_to_bits(expected))
          << dtype << " n " << n << " trial " << trial << ": amax_of " << got << ", expected "
          << expected;
    }
  }
}

TEST(AmaxOf, EveryTailFloat32) { expect_amax_of<float>("float32"); }
TEST(AmaxOf, EveryTailBFloat16) { expect_amax_of<num::Bf16>("bfloat16"); }
TEST(AmaxOf, EveryTailFloat16) { expect_amax_of<num::Half>("float16"); }

}  // namespace
}  // namespace mlakv
