// mlakv tests (CUDA builds only; skipped without a visible GPU): programmatic dependent launch
// (Context::pdl). A chain of two ops where the second reads what the first writes: rms_norm
// normalizes kv_c into `normed`, then concat_and_cache_mla writes `normed` and k_pe into the cache,
// both launched with PDL (so the second kernel is scheduled while the first still runs). Before
// the chain, `normed` is poisoned in the stream; a second kernel that read its input before the
// first had finished would write poison into the cache. The cache must equal the one written by
// the same chain without PDL, eagerly and in a replayed CUDA graph.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/numerics.h"
#include "mlakv/mlakv.h"

namespace mlakv {
namespace {

#define PDL_CUDA_OK(call)                                                          \
  do {                                                                             \
    const cudaError_t status_ = (call);                                            \
    ASSERT_EQ(status_, cudaSuccess) << #call << ": " << cudaGetErrorName(status_); \
  } while (0)

struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) {
    if (cudaMalloc(&ptr, n) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

std::vector<uint8_t> random_bf16(int64_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<uint8_t> out(static_cast<size_t>(n) * 2);
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t bits = num::from_float<num::Bf16>(dist(rng)).bits;
    std::memcpy(out.data() + 2 * i, &bits, 2);
  }
  return out;
}

class CudaPdl : public testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no CUDA device";
  }
};

// One chain of T tokens (T a multiple of 64). Small T: the first kernel is one wave, so the second
// starts beside it at once; large T: the second starts while the first's last wave runs.
void run_chain(int64_t T) {
  SCOPED_TRACE("T = " + std::to_string(T));
  constexpr int64_t L = 512, R = 64, kBlockSize = 64;
  const int64_t kNumBlocks = T / kBlockSize;
  const Device dev{DeviceType::kCUDA, 0};
  std::mt19937_64 rng(7);
  const std::vector<uint8_t> kv_c_host = random_bf16(T * L, rng);
  const std::vector<uint8_t> k_pe_host = random_bf16(T * R, rng);
  const std::vector<uint8_t> weight_host = random_bf16(L, rng);
  std::vector<int64_t> slots_host(static_cast<size_t>(T));
  std::iota(slots_host.begin(), slots_host.end(), int64_t{0});
  std::shuffle(slots_host.begin(), slots_host.end(), rng);

  DeviceBuffer kv_c(kv_c_host.size()), k_pe(k_pe_host.size()), weight(weight_host.size()),
      normed(kv_c_host.size()), slots(slots_host.size() * sizeof(int64_t)),
      cache(static_cast<size_t>(cache_bytes(CacheFormat::kBFloat16, kNumBlocks, kBlockSize, L, R)));
  for (const DeviceBuffer* b : {&kv_c, &k_pe, &weight, &normed, &slots, &cache}) {
    ASSERT_NE(b->ptr, nullptr) << "cudaMalloc";
  }
  PDL_CUDA_OK(cudaMemcpy(kv_c.ptr, kv_c_host.data(), kv_c.bytes, cudaMemcpyHostToDevice));
  PDL_CUDA_OK(cudaMemcpy(k_pe.ptr, k_pe_host.data(), k_pe.bytes, cudaMemcpyHostToDevice));
  PDL_CUDA_OK(cudaMemcpy(weight.ptr, weight_host.data(), weight.bytes, cudaMemcpyHostToDevice));
  PDL_CUDA_OK(cudaMemcpy(slots.ptr, slots_host.data(), slots.bytes, cudaMemcpyHostToDevice));

  RmsNormParams norm;
  norm.num_tokens = T;
  norm.input = make_view(kv_c.ptr, DType::kBFloat16, {T, L}, dev);
  norm.weight = make_view(weight.ptr, DType::kBFloat16, {L}, dev);
  norm.output = make_view(normed.ptr, DType::kBFloat16, {T, L}, dev);
  ConcatAndCacheMlaParams concat;
  concat.num_tokens = T;
  concat.kv_c = norm.output;
  concat.k_pe = make_view(k_pe.ptr, DType::kBFloat16, {T, R}, dev);
  concat.slot_mapping = make_view(slots.ptr, DType::kInt64, {T}, dev);
  concat.kv_cache =
      make_cache_view(cache.ptr, CacheFormat::kBFloat16, kNumBlocks, kBlockSize, L, R, dev);

  cudaStream_t stream = nullptr;
  PDL_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Poison, then the chain; `pdl` on both ops or on neither.
  auto chain = [&](bool pdl) {
    Context ctx;
    ctx.stream = stream;
    ctx.pdl = pdl;
    if (cudaMemsetAsync(normed.ptr, 0xff, normed.bytes, stream) != cudaSuccess) return false;
    if (cudaMemsetAsync(cache.ptr, 0, cache.bytes, stream) != cudaSuccess) return false;
    rms_norm(norm, ctx);
    concat_and_cache_mla(concat, ctx);
    return true;
  };
  auto download_cache = [&] {
    std::vector<uint8_t> out(cache.bytes);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(out.data(), cache.ptr, cache.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  };

  ASSERT_TRUE(chain(false));
  const std::vector<uint8_t> expected = download_cache();
  // The poison never reaches the expected cache (0xffff is a bf16 NaN; the norm of finite inputs
  // is finite), so a read-before-write shows up as a difference.
  for (int rep = 0; rep < 3; ++rep) {
    ASSERT_TRUE(chain(true));
    EXPECT_TRUE(download_cache() == expected) << "eager PDL chain, repetition " << rep;
  }

  cudaGraph_t graph = nullptr;
  PDL_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const bool captured = chain(true);
  PDL_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(captured);
  cudaGraphExec_t exec = nullptr;
  PDL_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; ++rep) {
    PDL_CUDA_OK(cudaGraphLaunch(exec, stream));
    EXPECT_TRUE(download_cache() == expected) << "graph replay " << rep;
  }
  PDL_CUDA_OK(cudaGraphExecDestroy(exec));
  PDL_CUDA_OK(cudaGraphDestroy(graph));
  PDL_CUDA_OK(cudaStreamDestroy(stream));
}

TEST_F(CudaPdl, DependentOpWaitsForItsInput) {
  for (int64_t T : {1024, 4096, 32768}) run_chain(T);
}

}  // namespace
}  // namespace mlakv
