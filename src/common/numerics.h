// mlakv internal: the numerics shared by the CPU and CUDA backends (DESIGN.md "Numerics").
//
// Everything here is plain integer/IEEE-float code that compiles for host and device and gives the
// same bits on both: conversions are done in software (round-to-nearest-even, saturating fp8), the
// products that must not be fused use mul_rn, divisions use div_rn. The host build must not
// contract floating-point expressions (-ffp-contract=off) and neither build may use fast-math.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MLAKV_HD __host__ __device__ __forceinline__
#else
#define MLAKV_HD inline
#endif

namespace mlakv {
namespace num {

// Storage types: 16-bit and 8-bit floats held as their bits.
struct Bf16 {
  uint16_t bits;
};
struct Half {
  uint16_t bits;
};
struct Fp8E4M3 {
  uint8_t bits;
};
struct Fp8E5M2 {
  uint8_t bits;
};

constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;

MLAKV_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

MLAKV_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// Products and quotients rounded once, never contracted into an fma.
MLAKV_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MLAKV_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
MLAKV_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
MLAKV_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
MLAKV_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// ---- bf16 ----------------------------------------------------------------------------------
MLAKV_HD float to_float(Bf16 v) { return bits_float(static_cast<uint32_t>(v.bits) << 16); }

MLAKV_HD Bf16 float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{0x7fff};  // NaN -> canonical NaN
  u += 0x7fffu + ((u >> 16) & 1u);                           // round to nearest even
  return Bf16{static_cast<uint16_t>(u >> 16)};
}

// ---- fp16 ----------------------------------------------------------------------------------
MLAKV_HD float to_float(Half v) {
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000u) << 16;
  const uint32_t exp = (v.bits >> 10) & 0x1fu;
  const uint32_t mant = v.bits & 0x3ffu;
  if (exp == 0) {
    // Subnormal or zero: mant * 2^-24 is exact in float.
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return bits_float(float_bits(mag) | sign);
  }
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// ---- narrower float formats (fp16, fp8) -----------------------------------------------------
// The bits of f in a binary format of kWidth bits with kMant mantissa bits and exponent bias kBias,
// rounded to nearest even, |f| limited to kLimitBits (a float's bits): the format's max where it
// saturates (fp8: +-inf and everything beyond max give +-max), 2^16 for fp16 (every value that
// rounds past fp16's max rounds to 2^16, whose bits are inf's). Every NaN gives kNaN, without a
// sign: a NaN's sign is the platform's (an x86 invalid operation gives a negative NaN, a GPU a
// positive one), so keeping it would make the CPU and CUDA backends differ.
//
// Two forms of the same rounding, the device's and the host's (narrow_float_bits below picks):
// test_numerics.cpp holds them equal on the host (and the host's to the reference's codec), and
// test_cuda_numerics.cu on the GPU for all 2^32 floats. Both compute every value for every input
// and choose by selects or masks.
//
// A format: kWidth bits, kMant mantissa bits, exponent bias kBias, |f| limited to kLimitBits,
// kNaN for every NaN; the rest derived.
template <int kWidth_, int kMant_, int kBias_, uint32_t kLimitBits_, uint32_t kNaN_>
struct NarrowFormat {
  static constexpr int kWidth = kWidth_;
  static constexpr uint32_t kLimitBits = kLimitBits_;
  static constexpr uint32_t kNaN = kNaN_;
  static constexpr uint32_t kSign = 1u << (kWidth - 1);
  static constexpr uint32_t kMinNormal = static_cast<uint32_t>(128 - kBias_) << 23;  // 2^(1-bias)
  static constexpr uint32_t kRebias = static_cast<uint32_t>(127 - kBias_) << 23;
  static constexpr uint32_t kUlpShift = 23 - kMant_;
  // 2^(24 - kBias - kMant): added to a float below 2^(1 - kBias), it puts the format's subnormal
  // unit at the float's last mantissa bit.
  static constexpr uint32_t kSubnormalUnit = static_cast<uint32_t>(151 - kBias_ - kMant_) << 23;
  static constexpr uint32_t kLimitCode = (kLimitBits - kRebias) >> kUlpShift;
};
using Fp16Format = NarrowFormat<16, 10, 15, 0x47800000u, 0x7fffu>;  // limit 2^16: inf's bits
using E4M3Format = NarrowFormat<8, 3, 7, 0x43e00000u, 0x7fu>;       // limit 448
using E5M2Format = NarrowFormat<8, 2, 15, 0x47600000u, 0x7fu>;      // limit 57344

namespace detail {
// The device's form: a normal result by integer rounding at bit 23 - kMant, a subnormal one by the
// FPU's rounding of |f| + the subnormal unit's magic, then selects. (The host's form, compiled for
// the device, took up to 8 more registers in the fused kernel's instances that quantize a
// per-tensor fp8 cache entry by it.)
template <typename F>
MLAKV_HD uint32_t narrow_bits_by_selects(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> (32 - F::kWidth)) & F::kSign;
  const uint32_t abs = u & 0x7fffffffu;
  // (Below kLimitBits, a value of the format, the rounding never passes the limit's code.)
  const uint32_t normal =
      (abs - F::kRebias + ((1u << (F::kUlpShift - 1)) - 1u) + ((abs >> F::kUlpShift) & 1u)) >>
      F::kUlpShift;
  const uint32_t subnormal =
      float_bits(add_rn(bits_float(abs), bits_float(F::kSubnormalUnit))) - F::kSubnormalUnit;
  uint32_t out = abs < F::kMinNormal ? subnormal : normal;
  out = abs >= F::kLimitBits ? F::kLimitCode : out;
  return abs > 0x7f800000u ? F::kNaN : (out | sign);
}

// The host's form. GCC keeps floating-point traps by default, so it vectorizes a loop over a
// conversion only if no floating-point operation sits under a branch; without AVX-512's masked
// lanes it turned the selects of the device's form into branches around the addition, and every
// conversion loop (the fp8 cache and q_out, rmsnorm_quant's values) ran scalar. Here the FPU rounds
// every input: a + 2^(e + 23 - kMant), e the exponent of a but at least the format's smallest
// normal one, puts the format's ulp at a at the float's last mantissa bit, and subtracting it again
// is exact. The result's bits are a rebias and shift for a normal or, for a subnormal, the count of
// units read off result + the subnormal unit's magic; the choices are integer masks, and the NaN
// case an addition.
template <typename F>
MLAKV_HD uint32_t narrow_bits_by_masks(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> (32 - F::kWidth)) & F::kSign;
  const uint32_t abs = u & 0x7fffffffu;
  const uint32_t nan = 0u - static_cast<uint32_t>(abs > 0x7f800000u);  // all ones for a NaN
  const uint32_t a = abs < F::kLimitBits ? abs : F::kLimitBits;        // a NaN too
  uint32_t magic = a & 0x7f800000u;
  magic = (magic < F::kMinNormal ? F::kMinNormal : magic) + (F::kUlpShift << 23);
  const float rounded = add_rn(add_rn(bits_float(a), bits_float(magic)), -bits_float(magic));
  const uint32_t subnormal = 0u - static_cast<uint32_t>(a < F::kMinNormal);  // all ones
  const uint32_t t = float_bits(add_rn(rounded, bits_float(subnormal & F::kSubnormalUnit)));
  const uint32_t code = (t - (F::kRebias + (subnormal & (F::kSubnormalUnit - F::kRebias)))) >>
                        (~subnormal & F::kUlpShift);
  // A NaN's a is the limit: its code, plus the difference to kNaN, without the sign.
  return (code | (sign & ~nan)) + (nan & (F::kNaN - F::kLimitCode));
}
}  // namespace detail

template <typename F>
MLAKV_HD uint32_t narrow_float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return detail::narrow_bits_by_selects<F>(f);
#else
  return detail::narrow_bits_by_masks<F>(f);
#endif
}

MLAKV_HD Half float_to_half(float f) {
  return Half{static_cast<uint16_t>(narrow_float_bits<Fp16Format>(f))};
}

// ---- fp8 (OCP) -----------------------------------------------------------------------------
// Saturating, round-to-nearest-even; NaN -> 0x7f; +-inf and anything beyond max -> +-max.
MLAKV_HD Fp8E4M3 float_to_e4m3(float f) {
  return Fp8E4M3{static_cast<uint8_t>(narrow_float_bits<E4M3Format>(f))};
}

MLAKV_HD Fp8E5M2 float_to_e5m2(float f) {
  return Fp8E5M2{static_cast<uint8_t>(narrow_float_bits<E5M2Format>(f))};
}

MLAKV_HD float to_float(Fp8E4M3 v) {
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x80u) << 24;
  const uint32_t exp = (v.bits >> 3) & 0xfu;
  const uint32_t mant = v.bits & 0x7u;
  if ((v.bits & 0x7fu) == 0x7fu) return bits_float(0x7fc00000u | sign);
  if (exp == 0) return bits_float(float_bits(static_cast<float>(mant) * 0.001953125f) | sign);
  return bits_float(sign | ((exp + 120u) << 23) | (mant << 20));
}

MLAKV_HD float to_float(Fp8E5M2 v) {
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x80u) << 24;
  const uint32_t exp = (v.bits >> 2) & 0x1fu;
  const uint32_t mant = v.bits & 0x3u;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 21));
  if (exp == 0) return bits_float(float_bits(static_cast<float>(mant) * 1.52587890625e-5f) | sign);
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 21));
}

MLAKV_HD float to_float(float v) { return v; }

// Round a float to storage type T. float: the value itself, except that every NaN becomes the
// canonical NaN 0x7fffffff (what the GPU's arithmetic produces; an x86 operation passes an
// operand's payload and sign on), so that fp32 results agree bitwise across backends as the 16-bit
// roundings' canonical NaNs do.
template <typename T>
MLAKV_HD T from_float(float f);
template <>
MLAKV_HD float from_float<float>(float f) {
  return (float_bits(f) & 0x7fffffffu) > 0x7f800000u ? bits_float(0x7fffffffu) : f;
}
template <>
MLAKV_HD Bf16 from_float<Bf16>(float f) {
  return float_to_bf16(f);
}
template <>
MLAKV_HD Half from_float<Half>(float f) {
  return float_to_half(f);
}
template <>
MLAKV_HD Fp8E4M3 from_float<Fp8E4M3>(float f) {
  return float_to_e4m3(f);
}
template <>
MLAKV_HD Fp8E5M2 from_float<Fp8E5M2>(float f) {
  return float_to_e5m2(f);
}

// Round to T and back: the value a consumer of T sees.
template <typename T>
MLAKV_HD float round_to(float f) {
  return to_float(from_float<T>(f));
}

// ---- RoPE ----------------------------------------------------------------------------------
// One rotation in fp32 with explicit fma: x' = fma(x, c, -(y*s)), y' = fma(y, c, x*s).
MLAKV_HD void rope_rotate(float x, float y, float c, float s, float& x_out, float& y_out) {
  x_out = fma_rn(x, c, -mul_rn(y, s));
  y_out = fma_rn(y, c, mul_rn(x, s));
}

// Pair p (p < R/2) is elements (2p, 2p+1) in GPT-J style and (p, p + R/2) in NeoX style; it
// rotates by cos/sin column p in both.

// ---- RMSNorm -------------------------------------------------------------------------------
// The fp32 sum of squares in the library's one order, the pairwise tree over the element index
// (docs/rmsnorm_quant.md): the squares are the leaves, each level adds elements 2j and 2j + 1 into
// element j of the next and carries an odd level's last element up unchanged, until one is left.
// That is the complete tree over the row padded with +0 to a power of two (a square is >= +0 or
// NaN, so adding +0 changes nothing): any aligned run of 2^k elements is one subtree, and
// elements past the row may enter as +0. Both backends build it from these two pieces (the CPU in
// cpu_common.h sum_squares; CUDA in device_common.cuh, with xor shuffles for the levels between a
// chunk and 256 elements).

// The subtree of a chunk of 8 elements: ((q0 + q1) + (q2 + q3)) + ((q4 + q5) + (q6 + q7)),
// q_k = x_k * x_k.
MLAKV_HD float chunk_square_sum(const float (&x)[8]) {
  const float q01 = add_rn(mul_rn(x[0], x[0]), mul_rn(x[1], x[1]));
  const float q23 = add_rn(mul_rn(x[2], x[2]), mul_rn(x[3], x[3]));
  const float q45 = add_rn(mul_rn(x[4], x[4]), mul_rn(x[5], x[5]));
  const float q67 = add_rn(mul_rn(x[6], x[6]), mul_rn(x[7], x[7]));
  return add_rn(add_rn(q01, q23), add_rn(q45, q67));
}

// The tree over subtrees of equal size arriving left to right (a row's chunks or segments), as a
// binary counter: pending[k] holds a subtree of 2^k arrivals while bit k of `count` is set; add()
// merges the carries (pending[k] + v for each trailing 1 bit) and stores at the first clear bit;
// total(acc) adds the pending subtrees, smallest first, each to the one on its left, starting
// from acc: +0, or a right edge summed apart (cpu_common.h sum_squares' partial last tile). Every
// index is a loop counter (unrolled on the GPU: the array stays in registers). 32 levels: 2^32 - 1
// arrivals.
struct PairwiseMerger {
  static constexpr int kLevels = 32;
  float pending[kLevels] = {};
  uint32_t count = 0;
  MLAKV_HD void add(float v) {
    bool carry = true;
#if defined(__CUDACC__)
#pragma unroll
#endif
    for (int k = 0; k < kLevels; ++k) {
      const bool set = ((count >> k) & 1u) != 0;
      if (carry && set) v = add_rn(pending[k], v);
      if (carry && !set) pending[k] = v;
      carry = carry && set;
#if !defined(__CUDA_ARCH__)
      if (!carry) break;  // the host leaves early; the GPU keeps every index a constant
#endif
    }
    ++count;
  }
  MLAKV_HD float total(float acc = 0.0f) const {
#if defined(__CUDACC__)
#pragma unroll
#endif
    for (int k = 0; k < kLevels; ++k) {
      if (((count >> k) & 1u) != 0) acc = add_rn(pending[k], acc);
    }
    return acc;
  }
};

// inv_rms from the fp32 sum of squares over N values: 1 / sqrt(sum / N + eps), IEEE ops.
MLAKV_HD float rms_inv(float sum_squares, int64_t N, float eps) {
  const float mean = div_rn(sum_squares, static_cast<float>(N));
  return div_rn(1.0f, sqrt_rn(add_rn(mean, eps)));
}
// One normalized value before rounding to the output dtype: (x * inv_rms) * w.
MLAKV_HD float rms_apply(float x, float inv_rms, float w) { return mul_rn(mul_rn(x, inv_rms), w); }

// ---- fp8 quantization ----------------------------------------------------------------------
// Stored value = cvt(x / scale), IEEE division.
template <typename Fp8>
MLAKV_HD Fp8 quantize(float x, float scale) {
  return from_float<Fp8>(div_rn(x, scale));
}

// The e4m3 scale of a group of values from its amax: max(amax / 448, floor), optionally rounded up
// to a power of two. A NaN quotient falls back to the floor (amax_update never yields NaN).
MLAKV_HD float group_scale(float amax, float scale_floor, bool pow2) {
  float scale = div_rn(amax, kE4M3Max);
  if (!(scale >= scale_floor)) scale = scale_floor;
  if (pow2) {
    uint32_t u = float_bits(scale);
    if ((u & 0x007fffffu) != 0u && (u & 0x7f800000u) != 0x7f800000u) {
      u = (u & 0x7f800000u) + 0x00800000u;  // next power of two (an inf stays inf)
    }
    scale = bits_float(u);
  }
  return scale;
}

// fp8_ds_mla tile scale: the group scale with the floor FLT_MIN.
MLAKV_HD float ds_mla_tile_scale(float amax, bool pow2) { return group_scale(amax, FLT_MIN, pow2); }

// Running amax that ignores NaN and is independent of the order of updates.
MLAKV_HD float amax_update(float amax, float v) {
  const float a = fabsf(v);
  return a > amax ? a : amax;
}

}  // namespace num
}  // namespace mlakv
