// mlakv CUDA backend internals (device side): index and cos/sin table reads, position clamping,
// conversions into every stored type, cache format traits and the warp reductions the kernels
// share. All value arithmetic goes through src/common/numerics.h so that it matches the CPU backend
// bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/numerics.h"
#include "core/args.h"
#include "mlakv/cache.h"
#include "mlakv/context.h"
#include "vec.cuh"

namespace mlakv {
namespace cuda {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
constexpr bool kIsFp8 = std::is_same_v<T, num::Fp8E4M3> || std::is_same_v<T, num::Fp8E5M2>;

__device__ __forceinline__ int64_t load_index(const core::IndexArg& index, int64_t i) {
  if (index.is_int64) return static_cast<const int64_t*>(index.data)[i * index.stride];
  return static_cast<const int32_t*>(index.data)[i * index.stride];
}

__device__ __forceinline__ void count_error(int32_t* error_counts, ErrorCounter counter) {
  if (error_counts != nullptr) atomicAdd(error_counts + counter, 1);
}

// Programmatic dependent launch (Context::pdl, cuda_utils.h launch_kernel). pdl_wait(): blocks
// until the previous kernel in the stream has finished and its writes are visible; every kernel
// calls it before its first read of an input (a no-op when launched without the attribute).
// pdl_launch_dependents(): lets the next kernel in the stream, if launched with the attribute,
// start its prologue now (it still waits for this whole grid before reading what it writes).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// A position clamped into [0, max_pos); counted in `error_counts` (may be null) when clamped.
// Separate from the load so that a kernel can request the position before its other loads and
// clamp it (waiting for it) only where it is used.
__device__ __forceinline__ int64_t clamp_position(int64_t pos, int64_t max_pos,
                                                  int32_t* error_counts) {
  if (pos >= 0 && pos < max_pos) return pos;
  count_error(error_counts, kBadPosition);
  return pos < 0 ? 0 : max_pos - 1;
}

// positions[t] clamped into [0, max_pos) (clamp_position).
__device__ __forceinline__ int64_t clamped_position(const core::IndexArg& positions,
                                                    int64_t max_pos, int64_t t,
                                                    int32_t* error_counts) {
  return clamp_position(load_index(positions, t), max_pos, error_counts);
}

// Entry `col` of table row `pos` as loaded: its bits (fp32, bf16 or fp16 table). Split from
// table_value so that a loop's loads of 16-bit entries go out together: converted inside the
// dtype's branch, an entry is waited for there (vec.cuh ChunkInFlight).
__device__ __forceinline__ uint32_t start_load_table(const core::RopeTableArg& rope, int64_t pos,
                                                     int64_t col) {
  const int64_t i = pos * rope.stride_pos + col;
  if (rope.dtype == DType::kBFloat16 || rope.dtype == DType::kFloat16) {
    return static_cast<const uint16_t*>(rope.data)[i];
  }
  return static_cast<const uint32_t*>(rope.data)[i];
}

// A lane's pairs of one rope row, pr = lane + 32 j for j < num_pairs (at most kMaxPairs) and
// pr < half: the loads of their cos (column pr) and sin (column half + pr) entries of table row
// `pos`, all issued before any is used. The other entries stay 0.
template <int kMaxPairs>
__device__ __forceinline__ void start_load_cos_sin(const core::RopeTableArg& rope, int64_t pos,
                                                   int half, int num_pairs, int lane,
                                                   uint32_t (&cs)[kMaxPairs],
                                                   uint32_t (&sn)[kMaxPairs]) {
#pragma unroll
  for (int j = 0; j < kMaxPairs; ++j) {
    const int pr = lane + kWarpSize * j;
    if (j < num_pairs && pr < half) {
      cs[j] = start_load_table(rope, pos, pr);
      sn[j] = start_load_table(rope, pos, half + pr);
    }
  }
}

// The value of a table entry start_load_table loaded (waits for it).
__device__ __forceinline__ float table_value(const core::RopeTableArg& rope, uint32_t bits) {
  switch (rope.dtype) {
    case DType::kBFloat16:
      return num::to_float(num::Bf16{static_cast<uint16_t>(bits)});
    case DType::kFloat16:
      return num::to_float(num::Half{static_cast<uint16_t>(bits)});
    default:
      return __uint_as_float(bits);
  }
}

// The values of the N table entries whose bits start_load_table loaded (waits for them).
template <int N>
__device__ __forceinline__ void table_values(const core::RopeTableArg& rope,
                                             const uint32_t (&bits)[N], float (&values)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) values[j] = table_value(rope, bits[j]);
}

// Pair p of a rope row: GPT-J (2p, 2p + 1), NeoX (p, p + half).
__device__ __forceinline__ int64_t pair_first(bool neox, int64_t p) { return neox ? p : 2 * p; }
__device__ __forceinline__ int64_t pair_second(bool neox, int64_t p, int64_t half) {
  return neox ? p + half : 2 * p + 1;
}

// RoPE of one pair of model-dtype values, rounded once to the model dtype.
template <typename T>
__device__ __forceinline__ Pair<T> rotate_pair(const Pair<T>& v, float c, float s) {
  float x, y;
  num::rope_rotate(num::to_float(v.x), num::to_float(v.y), c, s, x, y);
  return Pair<T>{num::from_float<T>(x), num::from_float<T>(y)};
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// Two floats to an fp8 pair by the hardware conversion (cvt.rn.satfinite: round to nearest even,
// +-max beyond the range; a NaN byte may carry the sign). The low byte comes from `lo`.
template <typename Fp8>
__device__ __forceinline__ uint16_t cvt_fp8x2_satfinite(float lo, float hi) {
  uint16_t w;
  if constexpr (std::is_same_v<Fp8, num::Fp8E4M3>) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(w) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(w) : "f"(hi), "f"(lo));
  }
  return w;
}
#endif

// Two floats as fp8 (OCP e4m3 / e5m2) with the bits of num::from_float<Fp8>: saturating to
// +-max (inf included), round-to-nearest-even, NaN -> 0x7f. On sm_89+ by the hardware conversion:
// the input is first clamped to [-max, max], which the software rule maps to the same byte as the
// unclamped value (every |x| >= max gives +-max) and which the conversion then rounds exactly
// (round-to-nearest-even of an in-range value, subnormals and signed zeros included); NaN is set
// to 0x7f from the input afterwards (fmaxf/fminf turn it into +-max, and the hardware's NaN byte
// may carry the sign).
template <typename Fp8>
__device__ __forceinline__ void fp8x2_from_float(float a, float b, Fp8& ra, Fp8& rb) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  constexpr bool kE4M3 = std::is_same_v<Fp8, num::Fp8E4M3>;
  constexpr float kMax = kE4M3 ? num::kE4M3Max : num::kE5M2Max;
  const float ca = fminf(fmaxf(a, -kMax), kMax);
  const float cb = fminf(fmaxf(b, -kMax), kMax);
  const uint16_t w = cvt_fp8x2_satfinite<Fp8>(ca, cb);  // low byte: a
  ra.bits = a != a ? uint8_t{0x7f} : static_cast<uint8_t>(w & 0xffu);
  rb.bits = b != b ? uint8_t{0x7f} : static_cast<uint8_t>(w >> 8);
#else
  ra = num::from_float<Fp8>(a);
  rb = num::from_float<Fp8>(b);
#endif
}

// x / b for many x and one b, bit-identical to __fdiv_rn(x, b) (IEEE division, what num::div_rn
// is on the device) at a third of its cost. The compiler's division of a by b is: y0 = MUFU.RCP(b),
// y = fma(y0, fma(y0, -b, 1), y0), q0 = a * y, q = fma(y, fma(q0, -b, a), q0), taken when a range
// check (FCHK) passes, else a slow subroutine. Here the reciprocal part (the MUFU, a quarter-rate
// unit, and two fmas) is done once per divisor instead of once per element, and each element runs
// the same three operations on the same y, so the quotient has the same bits; the range check is
// a stricter one of our own (|a| and |b| in [2^-60, 2^60]: no quotient, remainder or product near
// the subnormal or overflow range), and everything outside it (zeros, subnormals, inf, NaN, huge
// values) takes __fdiv_rn itself. Why that range suffices: inside it y, q0 and every nonzero
// remainder are normal floats, so the sequence commutes with scaling a and b by powers of two
// (MUFU.RCP too, for normal inputs), which reduces every case to operands near 1, where the
// compiler's division certainly takes this path and is IEEE-exact. tests/test_cuda_numerics.cu
// compares the two on every bf16 and fp16 dividend for ~100 divisors and on 4M random pairs.
struct Divisor {
  float b = 1.0f;
  float y = 1.0f;     // refined reciprocal of b
  bool fast = false;  // |b| in [2^-60, 2^60]
};

__device__ __forceinline__ bool div_fast_range(float v) {
  const float m = fabsf(v);
  return m >= 0x1p-60f && m <= 0x1p60f;  // false for NaN
}

__device__ __forceinline__ Divisor make_divisor(float b) {
  Divisor d;
  d.b = b;
  d.fast = div_fast_range(b);
  float y0;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y0) : "f"(b));
  d.y = __fmaf_rn(y0, __fmaf_rn(y0, -b, 1.0f), y0);
  return d;
}

// The three-operation quotient; exact (== __fdiv_rn) when d.fast and div_fast_range(a).
__device__ __forceinline__ float divide_fast(float a, const Divisor& d) {
  const float q0 = __fmul_rn(a, d.y);
  return __fmaf_rn(d.y, __fmaf_rn(q0, -d.b, a), q0);
}

__device__ __forceinline__ float divide(float a, const Divisor& d) {
  return d.fast && div_fast_range(a) ? divide_fast(a, d) : __fdiv_rn(a, d.b);
}

// A model-dtype value stored as Dst: the same bits when Dst is the model type, a rounding
// conversion to another float type, or an fp8 quantization by the scale (cvt(x / scale), the
// bits of num::quantize).
template <typename Dst, typename T>
__device__ __forceinline__ Dst encode(T m, const Divisor& scale) {
  if constexpr (std::is_same_v<Dst, T>) {
    return m;
  } else if constexpr (kIsFp8<Dst>) {
    return num::from_float<Dst>(divide(num::to_float(m), scale));
  } else {
    return num::from_float<Dst>(num::to_float(m));
  }
}

// Element by element (divide() picks the path of each): the form for register-tight callers.
template <typename Dst, typename T>
__device__ __forceinline__ Chunk<Dst> encode_chunk_each(const Chunk<T>& m, const Divisor& scale) {
  if constexpr (std::is_same_v<Dst, T>) {
    return m;  // as one value: rebuilt element by element, a 16-byte store became four
  } else if constexpr (kIsFp8<Dst>) {
    Chunk<Dst> out;
#pragma unroll
    for (int e = 0; e < kChunkElems; e += 2) {
      fp8x2_from_float(divide(num::to_float(m.v[e]), scale),
                       divide(num::to_float(m.v[e + 1]), scale), out.v[e], out.v[e + 1]);
    }
    return out;
  } else {
    Chunk<Dst> out;
#pragma unroll
    for (int e = 0; e < kChunkElems; ++e) out.v[e] = encode<Dst>(m.v[e], scale);
    return out;
  }
}

// The fp8 forms are num::quantize's cvt(x / scale). When every element and the scale are in the
// divisor's fast range (the common case), the quotients are finite and need neither NaN handling
// nor a clamp (satfinite saturates): divide_fast and the bare conversion, two at a time, and one
// branch for the chunk; otherwise encode_chunk_exact_words.
// (bf16 models only: an fp16 chunk's conversions need more registers, and the fused kernel's
// fp16 instances then spill under their 80-register cap; they keep encode_chunk_each.)
//
// The bf16 form works on the chunk's four packed words: the range test is the same predicate as
// div_fast_range on every element (bf16 holds 2^-60 and 2^60 exactly, and |x| orders like the
// 15-bit magnitude field), taken over the chunk as one max and one min of magnitudes (bf16x2
// max/min with .NaN: a NaN element makes the max NaN, which fails the test); the elements are
// formed from the words directly (bits << 16, bits & 0xffff0000: the bits of num::to_float); the
// fp8 bytes are packed into two words, so the fast and exact paths meet on two registers.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
__device__ __forceinline__ uint32_t bf16x2_absmax_nan(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;  // halves: max(|a|, |b|) (NaN if either is), sign bits meaningless
}
__device__ __forceinline__ uint32_t bf16x2_absmin_nan(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("min.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ uint32_t f16x2_absmax_nan(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("max.NaN.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
// Four floats to four e4m3 / e5m2 bytes (byte e = value e), bare satfinite conversion.
template <typename Fp8>
__device__ __forceinline__ uint32_t cvt_fp8x4_satfinite(float v0, float v1, float v2, float v3) {
  uint32_t w;
  if constexpr (std::is_same_v<Fp8, num::Fp8E4M3>) {
    asm("{\n\t.reg .b16 lo, hi;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n\t"
        "mov.b32 %0, {lo, hi};\n\t}"
        : "=r"(w)
        : "f"(v0), "f"(v1), "f"(v2), "f"(v3));
  } else {
    asm("{\n\t.reg .b16 lo, hi;\n\t"
        "cvt.rn.satfinite.e5m2x2.f32 lo, %2, %1;\n\t"
        "cvt.rn.satfinite.e5m2x2.f32 hi, %4, %3;\n\t"
        "mov.b32 %0, {lo, hi};\n\t}"
        : "=r"(w)
        : "f"(v0), "f"(v1), "f"(v2), "f"(v3));
  }
  return w;
}
#endif

// Every element of a chunk through __fdiv_rn and the full conversion (zeros, subnormals, inf,
// NaN, extreme scales), as the two words of an fp8 chunk: out of line, so that the common path
// stays short.
template <typename Dst, typename T>
__device__ __noinline__ uint2 encode_chunk_exact_words(const Chunk<T> m, const float scale) {
  detail::ChunkBits<Dst> u;
  Divisor exact;  // fast = false: divide() is __fdiv_rn for every element
  exact.b = scale;
  u.c = encode_chunk_each<Dst>(m, exact);
  return u.w[0];
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// encode_chunk's bf16 -> fp8 form on the chunk's word: the two words of the fp8 chunk. Callers
// that hold the chunk as its word (rmsnorm_quant_kernel) call it directly, so the chunk is never
// taken apart into 16-bit fields and put together again.
//
// The range test is bf16_chunk_range: `absmax` (halves: the largest magnitude of the chunk's
// even / odd elements, NaN if one is) and `bad` (zero iff every |x| is in [2^-60, 2^60], NaN
// excluded). rmsnorm_quant_rows_kernel, which needs the magnitudes for its amax too, takes the
// range itself and calls the fast path (encode_bf16_chunk_word_fast) or the exact one.
struct Bf16ChunkRange {
  uint32_t absmax;
  uint32_t bad;
};
__device__ __forceinline__ Bf16ChunkRange bf16_chunk_range(const uint4 w) {
  // Magnitude range of the chunk: every |x| in [2^-60, 2^60] (bf16 0x2180 .. 0x5d80), no NaN.
  const uint32_t mx =
      bf16x2_absmax_nan(bf16x2_absmax_nan(w.x, w.y), bf16x2_absmax_nan(w.z, w.w)) & 0x7fff7fffu;
  const uint32_t mn =
      bf16x2_absmin_nan(bf16x2_absmin_nan(w.x, w.y), bf16x2_absmin_nan(w.z, w.w)) & 0x7fff7fffu;
  // Bit 15 of each half: (mx + 0x227f) set iff mx > 0x5d80; (mn + 0x5e80) clear iff mn < 0x2180.
  return {mx, ((mx + 0x227f227fu) | ~(mn + 0x5e805e80u)) & 0x80008000u};
}

// The fast path alone: exact when scale.fast and bf16_chunk_range(w).bad == 0.
template <typename Dst>
__device__ __forceinline__ uint2 encode_bf16_chunk_word_fast(const uint4 w, const Divisor& scale) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  float q[kChunkElems];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    q[2 * i] = divide_fast(__uint_as_float(words[i] << 16), scale);
    q[2 * i + 1] = divide_fast(__uint_as_float(words[i] & 0xffff0000u), scale);
  }
  return make_uint2(cvt_fp8x4_satfinite<Dst>(q[0], q[1], q[2], q[3]),
                    cvt_fp8x4_satfinite<Dst>(q[4], q[5], q[6], q[7]));
}

template <typename Dst>
__device__ __forceinline__ uint2 encode_bf16_chunk_word(const uint4 w, const Divisor& scale) {
  static_assert(kIsFp8<Dst>, "fp8 destinations only");
  const uint32_t bad = bf16_chunk_range(w).bad;
  uint2 out;  // the two words of the fp8 chunk
  if (!(scale.fast && bad == 0u)) {
    detail::ChunkBits<num::Bf16> m;
    m.w[0] = w;
    out = encode_chunk_exact_words<Dst>(m.c, scale.b);
  } else {
    out = encode_bf16_chunk_word_fast<Dst>(w, scale);
  }
  return out;
}
#endif

template <typename Dst, typename T>
__device__ __forceinline__ Chunk<Dst> encode_chunk(const Chunk<T>& m, const Divisor& scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (kIsFp8<Dst> && std::is_same_v<T, num::Bf16>) {
    static_assert(sizeof(Chunk<Dst>) == sizeof(uint2), "fp8 chunk: 8 bytes");
    detail::ChunkBits<T> in;
    in.c = m;
    detail::ChunkBits<Dst> u;
    u.w[0] = encode_bf16_chunk_word<Dst>(in.w[0], scale);
    return u.c;
  } else {
    return encode_chunk_each<Dst>(m, scale);
  }
#else
  return encode_chunk_each<Dst>(m, scale);
#endif
}

// ---- RoPE of a chunk of adjacent pairs ---------------------------------------------------------
// How rotate_chunk rounds: rotate_pair's from_float, element by element, or the hardware
// conversion two at a time (bf16 / fp16 on sm_89+: cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32, round to
// nearest even with subnormals and overflow to inf, which is from_float's rounding of every
// non-NaN float; test CudaNumerics.HardwareRoundingMatchesFromFloat checks all 2^32 of them).
// kHardware is for chunks whose elements and cos/sin are all finite (chunk_finite, isfinite):
// they rotate to no NaN (an fma of finite x and c with an addend of +-inf is that infinity, and
// nothing else can make a NaN), so from_float's canonical NaN, which the hardware need not
// produce, never arises.
enum class ChunkRounding { kPairwise, kHardware };

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
template <typename T>
constexpr bool kHardwareRounding = std::is_same_v<T, num::Bf16> || std::is_same_v<T, num::Half>;
#else
template <typename T>
constexpr bool kHardwareRounding = false;
#endif

// Whether every element of a 16-bit chunk is finite: the largest magnitude of its halves (NaN if
// one is: bf16x2 / f16x2 max.NaN) below inf's (bf16 0x7f80, fp16 0x7c00); bit 15 of a half of
// (magnitude + k) is set iff the magnitude reaches inf's.
template <typename T>
__device__ __forceinline__ bool chunk_finite(const Chunk<T>& m) {
  static_assert(kHardwareRounding<T>, "16-bit chunks on sm_89+");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  constexpr bool kBf16 = std::is_same_v<T, num::Bf16>;
  detail::ChunkBits<T> u;
  u.c = m;
  const uint4 w = u.w[0];
  const uint32_t mx =
      kBf16 ? bf16x2_absmax_nan(bf16x2_absmax_nan(w.x, w.y), bf16x2_absmax_nan(w.z, w.w))
            : f16x2_absmax_nan(f16x2_absmax_nan(w.x, w.y), f16x2_absmax_nan(w.z, w.w));
  constexpr uint32_t k = kBf16 ? 0x00800080u : 0x04000400u;
  return (((mx & 0x7fff7fffu) + k) & 0x80008000u) == 0u;
#else
  return false;
#endif
}

// RoPE of a chunk's four adjacent (GPT-J) pairs, pair j = elements (2j, 2j + 1) by cos/sin
// (c[j], s[j]), each rounded once to T: rotate_pair's operations and bits (kRound above).
template <ChunkRounding kRound, typename T>
__device__ __forceinline__ Chunk<T> rotate_chunk(const Chunk<T>& m, const float (&c)[4],
                                                 const float (&s)[4]) {
  if constexpr (kRound == ChunkRounding::kHardware) {
    static_assert(kHardwareRounding<T>, "16-bit chunks on sm_89+");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float x, y;
      num::rope_rotate(num::to_float(m.v[2 * j]), num::to_float(m.v[2 * j + 1]), c[j], s[j], x, y);
      if constexpr (std::is_same_v<T, num::Bf16>) {  // the low half (element 2j) from x
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[j]) : "f"(y), "f"(x));
      } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w[j]) : "f"(y), "f"(x));
      }
    }
    detail::ChunkBits<T> u;
    u.w[0] = make_uint4(w[0], w[1], w[2], w[3]);
    return u.c;
#endif
  } else {
    Chunk<T> out = m;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const Pair<T> r = rotate_pair(Pair<T>{m.v[2 * j], m.v[2 * j + 1]}, c[j], s[j]);
      out.v[2 * j] = r.x;
      out.v[2 * j + 1] = r.y;
    }
    return out;
  }
}

// rotate_chunk of one chunk by the hardware rounding where it applies (16-bit chunks whose elements
// and cos/sin are all finite), else by rotate_pair's: the same bits either way.
template <typename T>
__device__ __forceinline__ Chunk<T> rotate_chunk_checked(const Chunk<T>& m, const float (&c)[4],
                                                         const float (&s)[4]) {
  if constexpr (kHardwareRounding<T>) {
    bool finite = chunk_finite(m);
#pragma unroll
    for (int j = 0; j < 4; ++j) finite &= isfinite(c[j]) && isfinite(s[j]);
    if (finite) return rotate_chunk<ChunkRounding::kHardware>(m, c, s);
  }
  return rotate_chunk<ChunkRounding::kPairwise>(m, c, s);
}

template <typename Dst, typename T>
__device__ __forceinline__ Pair<Dst> encode_pair(const Pair<T>& m, const Divisor& scale) {
  if constexpr (kIsFp8<Dst> && !std::is_same_v<Dst, T>) {
    Pair<Dst> out;
    fp8x2_from_float(divide(num::to_float(m.x), scale), divide(num::to_float(m.y), scale), out.x,
                     out.y);
    return out;
  } else {
    return Pair<Dst>{encode<Dst>(m.x, scale), encode<Dst>(m.y, scale)};
  }
}

// Reads one word of every 64-byte line of a kernel's parameter block, so that the item paths'
// field reads (an item count, then a pointer, then a stride ...) find their lines cached. A fresh
// launch finds them in no multiprocessor's constant cache. These reads compile to uniform loads,
// and each of their misses stalls the warp in turn: ~25-30 ns a line on the H200, ~0.4 us for
// the fused op's block. So the prefetch moves those misses to the kernel's head rather than
// overlapping them: worth it only where the head itself is hidden, before the programmatic wait
// of a PDL launch (perf-notes, fourteenth session); an indexed form (all lines requested at once)
// was slower (seventh session). `never` must be false at run time: the trap it guards only keeps
// the compiler from dropping the reads.
template <typename P>
__device__ __forceinline__ void prefetch_params(const P& p, bool never) {
  const uint32_t* words = reinterpret_cast<const uint32_t*>(&p);
  uint32_t x = 0;
#pragma unroll
  for (size_t i = 0; i < sizeof(P) / sizeof(uint32_t); i += 16) x ^= words[i];
  if (never && x == 0x5a5a5a5au) __trap();
}

// Element types of a cache format's latent and rope parts.
template <CacheFormat kFormat>
struct CacheTraits;
template <>
struct CacheTraits<CacheFormat::kBFloat16> {
  using Latent = num::Bf16;
  using Rope = num::Bf16;
};
template <>
struct CacheTraits<CacheFormat::kFloat16> {
  using Latent = num::Half;
  using Rope = num::Half;
};
template <>
struct CacheTraits<CacheFormat::kFloat32> {
  using Latent = float;
  using Rope = float;
};
template <>
struct CacheTraits<CacheFormat::kFloat8E4M3> {
  using Latent = num::Fp8E4M3;
  using Rope = num::Fp8E4M3;
};
template <>
struct CacheTraits<CacheFormat::kFloat8E5M2> {
  using Latent = num::Fp8E5M2;
  using Rope = num::Fp8E5M2;
};
template <>
struct CacheTraits<CacheFormat::kFloat8DsMla> {
  using Latent = num::Fp8E4M3;
  using Rope = num::Bf16;
};

// Byte offset of the rope part inside a combined entry.
template <CacheFormat kFormat>
__device__ __forceinline__ int64_t rope_offset_bytes(int64_t L) {
  if constexpr (kFormat == CacheFormat::kFloat8DsMla) {
    return kDsMlaLatentDim + kDsMlaNumTiles * static_cast<int64_t>(sizeof(float));
  } else {
    return L * static_cast<int64_t>(sizeof(typename CacheTraits<kFormat>::Latent));
  }
}

struct EntryPtrs {
  uint8_t* latent;
  uint8_t* rope;
};

// Cache entry of (block, offset): the rope part follows the latent part unless the layout is split.
template <CacheFormat kFormat>
__device__ __forceinline__ EntryPtrs cache_entry_at(const core::CacheArg& cache, int64_t block,
                                                    int64_t offset, int64_t L) {
  uint8_t* latent =
      cache.data + block * cache.stride_block_bytes + offset * cache.stride_token_bytes;
  uint8_t* rope = cache.rope_data != nullptr
                      ? cache.rope_data + block * cache.stride_rope_block_bytes +
                            offset * cache.stride_rope_token_bytes
                      : latent + rope_offset_bytes<kFormat>(L);
  return {latent, rope};
}

// Max over the `width` lanes of an aligned lane group (width a power of two <= 32), by xor
// shuffles. The inputs are non-negative and never NaN (num::amax_update skips NaN), so max is
// exact and order-free: every lane of the group ends with the same value.
__device__ __forceinline__ float group_max(float v, int width) {
  // The offsets width / 2, ..., 1 in that order (width a power of two <= 32), unrolled.
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    if (offset < width) {
      const float other = __shfl_xor_sync(kFullMask, v, offset);
      v = other > v ? other : v;
    }
  }
  return v;
}

// ---- RMSNorm's sum of squares: the pairwise tree over the element index ----------------------
// The library's one order (numerics.h, RMSNorm). The kernels build it from the bottom: a chunk of
// 8 elements in a lane's registers (num::chunk_square_sum), 32 chunks c0 .. c0 + 31 (c0 a
// multiple of 32) held by lanes 0 .. 31 of a warp (warp_pairwise_sum), then the run of such
// 256-element subtrees in row order (pairwise_sum, warp_slots_sum, num::PairwiseMerger).

// A model-dtype element as a float for arithmetic: num::to_float's value for every non-NaN
// element. fp16 widens by the hardware's conversion (cvt.f32.f16; fewer instructions and registers
// than num::to_float's bit manipulation), whose NaN may carry another payload; the GPU's arithmetic
// turns any NaN into the canonical NaN, so what the kernels compute from it has the same bits.
template <typename T>
__device__ __forceinline__ float widen(T v) {
  if constexpr (std::is_same_v<T, num::Half>) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
  } else {
    return num::to_float(v);
  }
}

template <typename T>
__device__ __forceinline__ float chunk_square_sum(const Chunk<T>& c) {
  float x[kChunkElems];
#pragma unroll
  for (int k = 0; k < kChunkElems; ++k) x[k] = widen(c.v[k]);
  return num::chunk_square_sum(x);
}

// The subtree of the 32 chunks the warp's lanes hold (lane l: chunk c0 + l's sum), on every lane:
// level k adds the lanes l and l ^ 2^k, whose sum is the same float in both (a + b = b + a).
__device__ __forceinline__ float warp_pairwise_sum(float v) {
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    v = num::add_rn(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

// The tree over v[0, kN) (adjacent pairs first, an odd level's last element carried up).
template <int kN>
__device__ __forceinline__ float pairwise_sum(const float (&v)[kN]) {
  static_assert(kN >= 1, "at least one value");
  if constexpr (kN == 1) {
    return v[0];
  } else {
    float next[(kN + 1) / 2];
#pragma unroll
    for (int j = 0; j < kN / 2; ++j) next[j] = num::add_rn(v[2 * j], v[2 * j + 1]);
    if constexpr (kN % 2 == 1) next[kN / 2] = v[kN - 1];
    return pairwise_sum(next);
  }
}

// A warp's run of kSlots 256-element subtrees: slot s of lane l holds the chunk sum of chunk
// c0 + 32 s + l (+0 past the row). Returns the subtree of the whole run on every lane.
template <int kSlots>
__device__ __forceinline__ float warp_slots_sum(float (&part)[kSlots]) {
#pragma unroll
  for (int s = 0; s < kSlots; ++s) part[s] = warp_pairwise_sum(part[s]);
  return pairwise_sum(part);
}

}  // namespace cuda
}  // namespace mlakv
