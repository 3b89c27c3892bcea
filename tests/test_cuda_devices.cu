// mlakv tests (CUDA builds; skipped with fewer than two visible devices): every op runs on its
// tensors' device and leaves the caller's current device as it was. The values of each op on a
// second GPU are checked by the backend-parameterized suites (their "cuda1" instances, run while
// cuda:0 stays current); this checks the current device around each launch.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <random>
#include <string>

#include "fused_problem.h"
#include "harness.h"

namespace mlakv {
namespace test {
namespace {

class CudaDevices : public testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2) {
      GTEST_SKIP() << "needs two CUDA devices";
    }
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  }

  // Runs `op` on cuda:1's tensors while cuda:0 is current; the op must finish without error on
  // cuda:1 and leave cuda:0 current.
  void expect_runs_on_gpu1(const std::string& what, const std::function<void()>& op) const {
    SCOPED_TRACE(what);
    ASSERT_NO_THROW(op());
    int current = -1;
    ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
    EXPECT_EQ(current, 0) << what << " changed the current device";
    ASSERT_NO_THROW(device_synchronize(gpu1_));
  }

  const Device gpu1_{DeviceType::kCUDA, 1};
  std::mt19937_64 rng_{20261205};
};

TEST_F(CudaDevices, EveryOpKeepsTheCallersCurrentDevice) {
  constexpr int64_t T = 5;
  constexpr int64_t N = 1536;

  FusedSpec spec;
  spec.name = "gpu1_mixed";
  spec.shape = kDeepSeekV3H2;
  spec.T = 9;
  spec.Td = 4;
  spec.entry = Entry::kMixed;
  spec.prefill_q = true;
  spec.norm = true;
  // The fused op (mla_rope_cache's launcher; concat_and_cache_mla and decode_q_concat share it),
  // with its values checked against the reference.
  expect_runs_on_gpu1("mla_rope_cache", [&] { run_fused_case(spec, gpu1_); });

  const Tensor x = random_tensor(gpu1_, DType::kBFloat16, {T, N}, rng_);
  const Tensor w = random_tensor(gpu1_, DType::kBFloat16, {N}, rng_);
  const Tensor y = poisoned_tensor(gpu1_, DType::kBFloat16, {T, N});
  RmsNormParams norm;
  norm.num_tokens = T;
  norm.input = x.device_view();
  norm.weight = w.device_view();
  norm.output = y.device_view();
  expect_runs_on_gpu1("rms_norm", [&] { rms_norm(norm); });

  const Tensor values = poisoned_tensor(gpu1_, DType::kFloat8E4M3, {T, N});
  const Tensor scales = poisoned_tensor(gpu1_, DType::kFloat32, {T, N / kDefaultQuantGroupSize});
  RmsNormQuantParams quant;
  quant.num_tokens = T;
  quant.input = x.device_view();
  quant.weight = w.device_view();
  quant.quant.values = values.device_view();
  quant.quant.scales = scales.device_view();
  expect_runs_on_gpu1("rmsnorm_quant", [&] { rmsnorm_quant(quant); });

  constexpr int64_t kRot = 64;
  const Tensor positions = index_tensor(gpu1_, DType::kInt64, {0, 3, 1, 7, 2});
  const Tensor query = random_tensor(gpu1_, DType::kBFloat16, {T, 2, kRot}, rng_);
  const Tensor cos_sin = random_tensor(gpu1_, DType::kFloat32, {8, kRot}, rng_, 1.0f);
  RotaryEmbeddingParams rotary;
  rotary.num_tokens = T;
  rotary.positions = positions.device_view();
  rotary.query = query.device_view();
  rotary.cos_sin_cache = cos_sin.device_view();
  expect_runs_on_gpu1("rotary_embedding", [&] { rotary_embedding(rotary); });

  CacheGeometry geometry;
  TestCache cache = new_cache(gpu1_, geometry);
  fill_cache_with_entries(gpu1_, cache, rng_);
  const Tensor slots = index_tensor(gpu1_, DType::kInt64, {0, 17, -1, 40, 3});
  const Tensor out = poisoned_tensor(gpu1_, DType::kBFloat16, {T, geometry.L + geometry.R});
  GatherCacheSlotsParams gather;
  gather.num_tokens = T;
  gather.kv_cache = cache.device_view();
  gather.slots = slots.device_view();
  gather.out = out.device_view();
  expect_runs_on_gpu1("gather_cache_slots", [&] { gather_cache_slots(gather); });
}

}  // namespace
}  // namespace test
}  // namespace mlakv
