// mlakv tests (CUDA builds only): the device numerics that are not the host's code, run on the GPU
// and held bit for bit against the host's IEEE operations (skipped without a visible GPU):
// - cuda::divide, the division by a shared divisor behind every fp8 quantization, against
//   __fdiv_rn and the host's a / b, exhaustively over every bf16 and fp16 value for a set of
//   divisors, and over random fp32 pairs;
// - cuda::fp8x2_from_float (the hardware conversion) against num::from_float<Fp8>;
// - cuda::encode_chunk (the kernels' fp8 quantization of 8 values, fast and exact paths) against
//   num::quantize;
// - num::from_float's fp16 / fp8 rounding in the device's form against the host's
//   (num::detail::narrow_bits_by_selects / _by_masks), both run on the GPU, on all 2^32 floats;
// - the hardware bf16 / fp16 rounding (cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32) against
//   num::from_float on all 2^32 floats but NaNs, and cuda::rotate_chunk (the fused kernel's RoPE
//   of a chunk: that rounding on finite chunks and cos/sin, rotate_pair's otherwise) against the
//   host's num::rope_rotate + from_float;
// - FastDiv's __umulhi path (the fused kernel's work-item decoding) against the division, on
//   random divisor / numerator pairs;
// - cuda::chunk_square_sum of fp16 chunks (RMSNorm's sum of squares, widening by cvt.f32.f16)
//   against num::to_float + num::chunk_square_sum, with every fp16 value in every position.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <random>
#include <type_traits>
#include <vector>

#include "common/fast_div.h"
#include "common/numerics.h"
#include "cuda/device_common.cuh"

namespace mlakv {
namespace {

#define TEST_CUDA_OK(call)                                                         \
  do {                                                                             \
    const cudaError_t status_ = (call);                                            \
    ASSERT_EQ(status_, cudaSuccess) << #call << ": " << cudaGetErrorName(status_); \
  } while (0)

__global__ void divide_kernel(const float* a, const float* b, int64_t n, uint32_t* fast,
                              uint32_t* ieee) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const cuda::Divisor d = cuda::make_divisor(b[i]);
  fast[i] = __float_as_uint(cuda::divide(a[i], d));
  ieee[i] = __float_as_uint(__fdiv_rn(a[i], b[i]));
}

__global__ void fast_div_kernel(const FastDiv* divs, const uint32_t* n, int64_t count,
                                uint32_t* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) out[i] = divs[i].div(n[i]);
}

template <typename Fp8>
__global__ void fp8_kernel(const float* x, int64_t n, uint8_t* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (2 * i + 1 >= n) return;
  Fp8 lo, hi;
  cuda::fp8x2_from_float(x[2 * i], x[2 * i + 1], lo, hi);
  out[2 * i] = lo.bits;
  out[2 * i + 1] = hi.bits;
}

// encode_chunk: 8 bf16 values -> 8 fp8 bytes by one scale (the fused kernel's q_out and cache
// quantization: the fast path, or encode_chunk_exact when any value or the scale is outside it).
template <typename Fp8>
__global__ void encode_chunk_kernel(const num::Bf16* x, int64_t chunks, float scale, uint8_t* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= chunks) return;
  cuda::Chunk<num::Bf16> m;
  for (int e = 0; e < cuda::kChunkElems; ++e) m.v[e] = x[i * cuda::kChunkElems + e];
  const cuda::Chunk<Fp8> q = cuda::encode_chunk<Fp8>(m, cuda::make_divisor(scale));
  for (int e = 0; e < cuda::kChunkElems; ++e) out[i * cuda::kChunkElems + e] = q.v[e].bits;
}

// Every float u = start .. start + n - 1 (bits) through Differs{}(u) (a device check: true where
// two computations of u's bits disagree): mismatches counted, the first few recorded.
template <typename Differs>
__global__ void every_float_kernel(uint64_t start, uint64_t n, unsigned long long* bad,
                                   uint32_t* first_bad) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const uint32_t u = static_cast<uint32_t>(start + i);
    if (Differs{}(u)) {
      const unsigned long long k = atomicAdd(bad, 1ull);
      if (k < 4) first_bad[k] = u;
    }
  }
}

// A float rounded by the hardware and by num::from_float on the device; NaN inputs skipped
// (rotate_chunk never rounds one by the hardware).
template <typename T>
struct HardwareRoundingDiffers {
  __device__ bool operator()(uint32_t u) const {
    const float f = __uint_as_float(u);
    if (f != f) return false;
    uint32_t w;
    if constexpr (std::is_same_v<T, num::Bf16>) {
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(0.0f), "f"(f));
    } else {
      asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(0.0f), "f"(f));
    }
    return (w & 0xffffu) != num::from_float<T>(f).bits;
  }
};

// A float rounded to format F by numerics.h's two forms (the device's, which the kernels run, and
// the host's, which the CPU backend runs; both are IEEE operations, so the GPU gives each form's
// host bits).
template <typename F>
struct NarrowFormsDiffer {
  __device__ bool operator()(uint32_t u) const {
    const float f = __uint_as_float(u);
    return num::detail::narrow_bits_by_selects<F>(f) != num::detail::narrow_bits_by_masks<F>(f);
  }
};

// rotate_chunk on chunk i of x by cos/sin columns cs[4 i .. 4 i + 3], sn[...].
template <typename T>
__global__ void rotate_chunk_kernel(const T* x, const float* cs, const float* sn, int64_t chunks,
                                    T* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= chunks) return;
  cuda::Chunk<T> m;
  for (int e = 0; e < cuda::kChunkElems; ++e) m.v[e] = x[i * cuda::kChunkElems + e];
  float c[4], s[4];
  for (int j = 0; j < 4; ++j) {
    c[j] = cs[4 * i + j];
    s[j] = sn[4 * i + j];
  }
  // The fused kernel's choice (the hardware rounding when everything is finite).
  const cuda::Chunk<T> r = cuda::rotate_chunk_checked(m, c, s);
  for (int e = 0; e < cuda::kChunkElems; ++e) out[i * cuda::kChunkElems + e] = r.v[e];
}

// Chunk i of x: widen of element i % 8 (its float bits) and chunk_square_sum of the chunk.
__global__ void square_sum_kernel(const num::Half* x, int64_t chunks, uint32_t* widened,
                                  float* sums) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= chunks) return;
  cuda::Chunk<num::Half> c;
  for (int e = 0; e < cuda::kChunkElems; ++e) c.v[e] = x[i * cuda::kChunkElems + e];
  widened[i] = __float_as_uint(cuda::widen(c.v[i % cuda::kChunkElems]));
  sums[i] = cuda::chunk_square_sum(c);
}

bool has_gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

uint32_t host_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float host_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Device buffer of n T, freed on scope exit.
template <typename T>
struct DeviceArray {
  T* ptr = nullptr;
  explicit DeviceArray(size_t n) {
    if (cudaMalloc(&ptr, n * sizeof(T)) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
};

// Runs divide_kernel over the pairs and checks every quotient: the fast one equals __fdiv_rn's and
// the host's IEEE quotient bit for bit (NaN: any NaN).
void check_division(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  const int64_t n = static_cast<int64_t>(a.size());
  DeviceArray<float> da(a.size()), db(b.size());
  DeviceArray<uint32_t> fast(a.size()), ieee(a.size());
  ASSERT_TRUE(da.ptr && db.ptr && fast.ptr && ieee.ptr);
  TEST_CUDA_OK(cudaMemcpy(da.ptr, a.data(), a.size() * 4, cudaMemcpyHostToDevice));
  TEST_CUDA_OK(cudaMemcpy(db.ptr, b.data(), b.size() * 4, cudaMemcpyHostToDevice));
  const int threads = 256;
  divide_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0, cudaStream_t{}>>>(
      da.ptr, db.ptr, n, fast.ptr, ieee.ptr);
  TEST_CUDA_OK(cudaGetLastError());
  std::vector<uint32_t> hf(a.size()), hi(a.size());
  TEST_CUDA_OK(cudaMemcpy(hf.data(), fast.ptr, a.size() * 4, cudaMemcpyDeviceToHost));
  TEST_CUDA_OK(cudaMemcpy(hi.data(), ieee.ptr, a.size() * 4, cudaMemcpyDeviceToHost));
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float expect = a[i] / b[i];
    const bool nan = std::isnan(expect);
    const bool ok_fast = nan ? std::isnan(host_float(hf[i])) : hf[i] == host_bits(expect);
    const bool ok_ieee = nan ? std::isnan(host_float(hi[i])) : hi[i] == host_bits(expect);
    if (!ok_fast || !ok_ieee) {
      if (++bad <= 5) {
        ADD_FAILURE() << what << ": " << a[i] << " / " << b[i] << " = " << expect << " (0x"
                      << std::hex << host_bits(expect) << "), divide 0x" << hf[i]
                      << ", __fdiv_rn 0x" << hi[i] << std::dec;
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << n << " quotients";
}

// Divisors: special ones, powers of two at the edges of the fast range and past them, and random
// ones spread over the exponent range (log-uniform).
std::vector<float> divisors(std::mt19937& rng, int random_count) {
  std::vector<float> d = {1.0f,          448.0f,       57344.0f,        0.5f,           3.0f,
                          1.0f / 3.0f,   0.0171f,      1.1754944e-38f,  1e-45f,         -2.5f,
                          0x1p-60f,      0x1p60f,      0x1.fffffep-61f, 0x1.000002p60f, 3.4e38f,
                          0x1.fffffep0f, 0x1.000002p0f};
  std::uniform_real_distribution<float> exponent(-80.0f, 80.0f);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  for (int i = 0; i < random_count; ++i)
    d.push_back(std::ldexp(mantissa(rng), static_cast<int>(exponent(rng))));
  return d;
}

// FastDiv's device path (__umulhi) equals the division, as the host path does (test_numerics.cpp).
TEST(CudaNumerics, FastDivMatchesDivision) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device visible";
  std::mt19937_64 rng(0xd1f);
  std::vector<FastDiv> divs;
  std::vector<uint32_t> n, want;
  for (int i = 0; i < (1 << 20); ++i) {
    const uint32_t d = i % 4 == 0   ? 1 + static_cast<uint32_t>(rng() % 0x7ffffffe)
                       : i % 4 == 1 ? 1 + static_cast<uint32_t>(rng() % 4096)
                                    : static_cast<uint32_t>(1u << (rng() % 31)) +
                                          static_cast<uint32_t>(rng() % 3) - 1 + (i % 4 == 2);
    const uint32_t x = i % 8 == 0 ? 0x7fffffffu - static_cast<uint32_t>(rng() % 4)
                                  : static_cast<uint32_t>(rng() & 0x7fffffffu);
    divs.emplace_back(d == 0 ? 1 : d);
    n.push_back(x);
    want.push_back(x / divs.back().divisor);
  }
  const int64_t count = static_cast<int64_t>(n.size());
  FastDiv* d_divs = nullptr;
  uint32_t *d_n = nullptr, *d_out = nullptr;
  TEST_CUDA_OK(cudaMalloc(&d_divs, sizeof(FastDiv) * count));
  TEST_CUDA_OK(cudaMalloc(&d_n, sizeof(uint32_t) * count));
  TEST_CUDA_OK(cudaMalloc(&d_out, sizeof(uint32_t) * count));
  TEST_CUDA_OK(cudaMemcpy(d_divs, divs.data(), sizeof(FastDiv) * count, cudaMemcpyHostToDevice));
  TEST_CUDA_OK(cudaMemcpy(d_n, n.data(), sizeof(uint32_t) * count, cudaMemcpyHostToDevice));
  fast_div_kernel<<<static_cast<unsigned>((count + 255) / 256), 256, 0, cudaStream_t{}>>>(
      d_divs, d_n, count, d_out);
  TEST_CUDA_OK(cudaGetLastError());
  std::vector<uint32_t> got(n.size());
  TEST_CUDA_OK(cudaMemcpy(got.data(), d_out, sizeof(uint32_t) * count, cudaMemcpyDeviceToHost));
  cudaFree(d_divs);
  cudaFree(d_n);
  cudaFree(d_out);
  int64_t bad = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (got[i] != want[i] && ++bad <= 5) {
      ADD_FAILURE() << n[i] << " / " << divs[i].divisor << ": " << got[i] << ", expected "
                    << want[i];
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST(CudaNumerics, DivideMatchesIeeeOnEveryBf16Value) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device visible";
  std::mt19937 rng(1234);
  const std::vector<float> ds = divisors(rng, 48);
  std::vector<float> a, b;
  a.reserve(ds.size() << 16);
  b.reserve(ds.size() << 16);
  for (float d : ds) {
    for (uint32_t u = 0; u < 65536; ++u) {
      a.push_back(host_float(u << 16));
      b.push_back(d);
    }
  }
  check_division(a, b, "bf16 / divisor");
}

TEST(CudaNumerics, DivideMatchesIeeeOnEveryFp16Value) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device visible";
  std::mt19937 rng(99);
  const std::vector<float> ds = divisors(rng, 16);
  std::vector<float> a, b;
  for (float d : ds) {
    for (uint32_t u = 0; u < 65536; ++u) {
      a.push_back(num::to_float(num::Half{static_cast<uint16_t>(u)}));
      b.push_back(d);
    }
  }
  check_division(a, b, "fp16 / divisor");
}

TEST(CudaNumerics, DivideMatchesIeeeOnRandomFp32Pairs) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device visible";
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> any_bits;
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> near_exponent(-70, 70);
  const size_t n = size_t{1} << 22;
  std::vector<float> a(n), b(n);
  for (size_t i = 0; i < n; ++i) {
    // Half the pairs from all bit patterns (every class of float), half of moderate magnitude
    // (the fast path), with significands of every kind.
    if (i % 2 == 0) {
      a[i] = host_float(any_bits(rng));
      b[i] = host_float(any_bits(rng));
    } else {
      a[i] = std::ldexp(mantissa(rng), near_exponent(rng)) * (i % 4 == 1 ? -1.0f : 1.0f);
      b[i] = std::ldexp(mantissa(rng), near_exponent(rng));
    }
  }
  check_division(a, b, "fp32 / fp32");
}

template <typename Fp8>
void check_fp8_conversion(const char* what) {
  std::vector<float> x;
  for (uint32_t u = 0; u < 65536; ++u) x.push_back(host_float(u << 16));  // every bf16 value
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < (1 << 20); ++i) x.push_back(host_float(any_bits(rng)));
  const int64_t n = static_cast<int64_t>(x.size());
  DeviceArray<float> dx(x.size());
  DeviceArray<uint8_t> dout(x.size());
  ASSERT_TRUE(dx.ptr && dout.ptr);
  TEST_CUDA_OK(cudaMemcpy(dx.ptr, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  const int threads = 256;
  fp8_kernel<Fp8>
      <<<static_cast<unsigned>((n / 2 + threads - 1) / threads), threads, 0, cudaStream_t{}>>>(
          dx.ptr, n, dout.ptr);
  TEST_CUDA_OK(cudaGetLastError());
  std::vector<uint8_t> out(x.size());
  TEST_CUDA_OK(cudaMemcpy(out.data(), dout.ptr, x.size(), cudaMemcpyDeviceToHost));
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t expect = num::from_float<Fp8>(x[i]).bits;
    if (out[i] != expect && ++bad <= 5) {
      ADD_FAILURE() << what << ": " << x[i] << " (0x" << std::hex << host_bits(x[i])
                    << ") -> device 0x" << int{out[i]} << ", host 0x" << int{expect} << std::dec;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << n << " values";
}

// Random bf16 chunks, some with a special value (0, -0, NaN, +-inf, a subnormal, 2^+-61, a huge
// value, the fast range's bounds 2^+-60 and their bf16 neighbours outside it) at a random place,
// then every bf16 value, so that both encode_chunk paths run and its range test is probed at its
// edges; every byte against the host's num::quantize, for scales inside and outside the fast
// range, powers of two among them.
template <typename Fp8>
void check_encode_chunk(const char* what) {
  const float specials[] = {0.0f,      -0.0f,      std::nanf(""), INFINITY,   -INFINITY, 1e-39f,
                            0x1p61f,   -0x1p-61f,  3e38f,         0x1p-60f,   0x1p60f,   -0x1p60f,
                            -0x1p-60f, 0x1.02p60f, -0x1.02p60f,   0x1.fcp-61f};
  // Random chunks, then every bf16 value once (8192 chunks of consecutive bit patterns).
  const int64_t random_chunks = 1 << 16;
  const int64_t chunks = random_chunks + (1 << 16) / 8;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::uniform_int_distribution<int> pick(0, 31);
  std::vector<num::Bf16> x(static_cast<size_t>(chunks) * 8);
  for (int64_t c = 0; c < random_chunks; ++c) {
    for (int e = 0; e < 8; ++e) x[c * 8 + e] = num::from_float<num::Bf16>(normal(rng));
    const int k = pick(rng);  // a special value in about half of the chunks
    if (k < static_cast<int>(std::size(specials))) {
      x[c * 8 + (pick(rng) % 8)] = num::from_float<num::Bf16>(specials[k]);
    }
  }
  for (uint32_t bits = 0; bits < (1u << 16); ++bits) {
    x[random_chunks * 8 + bits] = num::Bf16{static_cast<uint16_t>(bits)};
  }
  DeviceArray<num::Bf16> dx(x.size());
  DeviceArray<uint8_t> dout(x.size());
  ASSERT_TRUE(dx.ptr && dout.ptr);
  TEST_CUDA_OK(cudaMemcpy(dx.ptr, x.data(), x.size() * sizeof(num::Bf16), cudaMemcpyHostToDevice));
  // Powers of two among them, inside the fast range (its bounds included) and outside it.
  for (const float scale : {1.0f, 0.037f, 448.0f, -2.5f, 0x1p-70f, 0x1p61f, 1e-40f, 0.25f,
                            -0x1p-20f, 0x1p20f, 0x1p-60f, -0x1p60f, 0x1p-61f}) {
    const int threads = 256;
    encode_chunk_kernel<Fp8>
        <<<static_cast<unsigned>((chunks + threads - 1) / threads), threads, 0, cudaStream_t{}>>>(
            dx.ptr, chunks, scale, dout.ptr);
    TEST_CUDA_OK(cudaGetLastError());
    std::vector<uint8_t> out(x.size());
    TEST_CUDA_OK(cudaMemcpy(out.data(), dout.ptr, out.size(), cudaMemcpyDeviceToHost));
    int64_t bad = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const uint8_t expect = num::quantize<Fp8>(num::to_float(x[i]), scale).bits;
      if (out[i] != expect && ++bad <= 5) {
        ADD_FAILURE() << what << ": " << num::to_float(x[i]) << " / " << scale << " -> device 0x"
                      << std::hex << int{out[i]} << ", host 0x" << int{expect} << std::dec;
      }
    }
    EXPECT_EQ(bad, 0) << what << ", scale " << scale << ": " << x.size() << " values";
  }
}

TEST(CudaNumerics, EncodeChunkE4M3MatchesHost) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device visible";
  check_encode_chunk<num::Fp8E4M3>("encode_chunk e4m3");
}

TEST(CudaNumerics, EncodeChunkE5M2MatchesHost) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device visible";
  check_encode_chunk<num::Fp8E5M2>("encode_chunk e5m2");
}

TEST(CudaNumerics, Fp8E4M3ConversionMatchesHost) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device visible";
  check_fp8_conversion<num::Fp8E4M3>("e4m3");
}

TEST(CudaNumerics, Fp8E5M2ConversionMatchesHost) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device visible";
  check_fp8_conversion<num::Fp8E5M2>("e5m2");
}

// every_float_kernel<Differs> over all 2^32 floats, each mismatch reported.
using EveryFloatKernel = void (*)(uint64_t, uint64_t, unsigned long long*, uint32_t*);
void expect_every_float_agrees(EveryFloatKernel kernel, const char* what, const char* which) {
  DeviceArray<unsigned long long> bad(1);
  DeviceArray<uint32_t> first(4);
  ASSERT_TRUE(bad.ptr && first.ptr);
  TEST_CUDA_OK(cudaMemset(bad.ptr, 0, sizeof(unsigned long long)));
  kernel<<<4096, 256, 0, cudaStream_t{}>>>(0, uint64_t{1} << 32, bad.ptr, first.ptr);
  TEST_CUDA_OK(cudaGetLastError());
  unsigned long long count = 0;
  uint32_t firsts[4] = {};
  TEST_CUDA_OK(cudaMemcpy(&count, bad.ptr, sizeof(count), cudaMemcpyDeviceToHost));
  TEST_CUDA_OK(cudaMemcpy(firsts, first.ptr, sizeof(firsts), cudaMemcpyDeviceToHost));
  for (unsigned long long k = 0; k < count && k < 4; ++k) {
    ADD_FAILURE() << what << ": float bits 0x" << std::hex << firsts[k] << std::dec
                  << " rounds differently";
  }
  EXPECT_EQ(count, 0u) << what << ": " << which;
}

TEST(CudaNumerics, HardwareRoundingMatchesFromFloat) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device visible";
  const char* which = "all 2^32 floats but NaNs";
  expect_every_float_agrees(every_float_kernel<HardwareRoundingDiffers<num::Bf16>>,
                            "cvt.rn.bf16x2.f32", which);
  expect_every_float_agrees(every_float_kernel<HardwareRoundingDiffers<num::Half>>,
                            "cvt.rn.f16x2.f32", which);
}

TEST(CudaNumerics, NarrowFormsAgreeOnEveryFloat) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device visible";
  const char* which = "the two forms, all 2^32 floats";
  expect_every_float_agrees(every_float_kernel<NarrowFormsDiffer<num::Fp16Format>>, "fp16", which);
  expect_every_float_agrees(every_float_kernel<NarrowFormsDiffer<num::E4M3Format>>, "e4m3", which);
  expect_every_float_agrees(every_float_kernel<NarrowFormsDiffer<num::E5M2Format>>, "e5m2", which);
}

// Random chunks and cos/sin with special values (NaN, +-inf, huge, subnormal, signed zeros) in
// some of them, so that both rotate_chunk paths run: every element against the host's
// rope_rotate + from_float (rotate_pair's definition).
template <typename T>
void check_rotate_chunk(const char* what) {
  const float specials[] = {0.0f,   -0.0f, std::nanf(""), INFINITY, -INFINITY,
                            1e-39f, 3e38f, -3e38f,        6e4f,     -65504.0f};
  const int64_t chunks = 1 << 16;
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::uniform_real_distribution<float> angle(-3.2f, 3.2f);
  std::uniform_int_distribution<int> pick(0, 63);
  std::vector<T> x(static_cast<size_t>(chunks) * 8);
  std::vector<float> cs(static_cast<size_t>(chunks) * 4), sn(cs.size());
  for (int64_t c = 0; c < chunks; ++c) {
    for (int e = 0; e < 8; ++e) x[c * 8 + e] = num::from_float<T>(normal(rng));
    for (int j = 0; j < 4; ++j) {
      const float a = angle(rng);
      cs[c * 4 + j] = std::cos(a) * 1.2f;  // a YaRN-like mscale above 1
      sn[c * 4 + j] = std::sin(a) * 1.2f;
    }
    int k = pick(rng);  // a special element in about a sixth of the chunks
    if (k < static_cast<int>(std::size(specials))) {
      x[c * 8 + (pick(rng) % 8)] = num::from_float<T>(specials[k]);
    }
    k = pick(rng);  // a special table entry in fewer
    if (k < 4) (k % 2 ? cs : sn)[c * 4 + (pick(rng) % 4)] = specials[2 + k];
  }
  DeviceArray<T> dx(x.size()), dout(x.size());
  DeviceArray<float> dcs(cs.size()), dsn(sn.size());
  ASSERT_TRUE(dx.ptr && dout.ptr && dcs.ptr && dsn.ptr);
  TEST_CUDA_OK(cudaMemcpy(dx.ptr, x.data(), x.size() * sizeof(T), cudaMemcpyHostToDevice));
  TEST_CUDA_OK(cudaMemcpy(dcs.ptr, cs.data(), cs.size() * sizeof(float), cudaMemcpyHostToDevice));
  TEST_CUDA_OK(cudaMemcpy(dsn.ptr, sn.data(), sn.size() * sizeof(float), cudaMemcpyHostToDevice));
  const int threads = 256;
  rotate_chunk_kernel<T>
      <<<static_cast<unsigned>((chunks + threads - 1) / threads), threads, 0, cudaStream_t{}>>>(
          dx.ptr, dcs.ptr, dsn.ptr, chunks, dout.ptr);
  TEST_CUDA_OK(cudaGetLastError());
  std::vector<T> out(x.size());
  TEST_CUDA_OK(cudaMemcpy(out.data(), dout.ptr, out.size() * sizeof(T), cudaMemcpyDeviceToHost));
  int64_t bad = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    for (int j = 0; j < 4; ++j) {
      float rx, ry;
      num::rope_rotate(num::to_float(x[c * 8 + 2 * j]), num::to_float(x[c * 8 + 2 * j + 1]),
                       cs[c * 4 + j], sn[c * 4 + j], rx, ry);
      const uint16_t ex = num::from_float<T>(rx).bits, ey = num::from_float<T>(ry).bits;
      if ((out[c * 8 + 2 * j].bits != ex || out[c * 8 + 2 * j + 1].bits != ey) && ++bad <= 5) {
        ADD_FAILURE() << what << ": chunk " << c << " pair " << j << " -> device 0x" << std::hex
                      << out[c * 8 + 2 * j].bits << " 0x" << out[c * 8 + 2 * j + 1].bits
                      << ", host 0x" << ex << " 0x" << ey << std::dec;
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << chunks << " chunks";
}

TEST(CudaNumerics, RotateChunkMatchesHost) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device visible";
  check_rotate_chunk<num::Bf16>("rotate_chunk bf16");
  check_rotate_chunk<num::Half>("rotate_chunk fp16");
}

// Every fp16 value (subnormals, signed zeros, infinities, NaNs with every payload) in each of the
// 8 positions of a chunk whose other elements are random halves of moderate magnitude: the
// widened value equals num::to_float bit for bit (a NaN: any NaN), and the chunk's sum of squares
// equals the host's num::chunk_square_sum of num::to_float's values bit for bit (NaN: both NaN).
TEST(CudaNumerics, ChunkSquareSumMatchesHostOnEveryFp16Value) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device visible";
  const int64_t values = 1 << 16;
  const int64_t chunks = values * cuda::kChunkElems;
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 20.0f);
  std::vector<num::Half> x(static_cast<size_t>(chunks) * cuda::kChunkElems);
  for (int64_t c = 0; c < chunks; ++c) {
    const int pos = static_cast<int>(c % cuda::kChunkElems);
    for (int e = 0; e < cuda::kChunkElems; ++e) {
      x[c * cuda::kChunkElems + e] = e == pos
                                         ? num::Half{static_cast<uint16_t>(c / cuda::kChunkElems)}
                                         : num::from_float<num::Half>(normal(rng));
    }
  }
  DeviceArray<num::Half> dx(x.size());
  DeviceArray<uint32_t> dwide(static_cast<size_t>(chunks));
  DeviceArray<float> dsum(static_cast<size_t>(chunks));
  ASSERT_TRUE(dx.ptr && dwide.ptr && dsum.ptr);
  TEST_CUDA_OK(cudaMemcpy(dx.ptr, x.data(), x.size() * sizeof(num::Half), cudaMemcpyHostToDevice));
  const int threads = 256;
  square_sum_kernel<<<static_cast<unsigned>((chunks + threads - 1) / threads), threads, 0,
                      cudaStream_t{}>>>(dx.ptr, chunks, dwide.ptr, dsum.ptr);
  TEST_CUDA_OK(cudaGetLastError());
  std::vector<uint32_t> wide(static_cast<size_t>(chunks));
  std::vector<float> sum(static_cast<size_t>(chunks));
  TEST_CUDA_OK(
      cudaMemcpy(wide.data(), dwide.ptr, wide.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  TEST_CUDA_OK(
      cudaMemcpy(sum.data(), dsum.ptr, sum.size() * sizeof(float), cudaMemcpyDeviceToHost));
  int64_t bad = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    float v[cuda::kChunkElems];
    for (int e = 0; e < cuda::kChunkElems; ++e) v[e] = num::to_float(x[c * cuda::kChunkElems + e]);
    const float want = num::chunk_square_sum(v);
    const int pos = static_cast<int>(c % cuda::kChunkElems);
    const bool wide_ok =
        std::isnan(v[pos]) ? std::isnan(host_float(wide[c])) : wide[c] == host_bits(v[pos]);
    const bool sum_ok =
        std::isnan(want) ? std::isnan(sum[c]) : host_bits(sum[c]) == host_bits(want);
    if ((!wide_ok || !sum_ok) && ++bad <= 5) {
      ADD_FAILURE() << "chunk " << c << " (fp16 0x" << std::hex
                    << x[c * cuda::kChunkElems + pos].bits << "): widened 0x" << wide[c]
                    << " against 0x" << host_bits(v[pos]) << ", sum 0x" << host_bits(sum[c])
                    << " against 0x" << host_bits(want) << std::dec;
    }
  }
  EXPECT_EQ(bad, 0) << chunks << " chunks";
}

}  // namespace
}  // namespace mlakv
