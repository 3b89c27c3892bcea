// mlakv tests (CUDA builds): every op runs on its tensors' device and leaves the caller's current
// device as it was (CudaDevices, skipped with fewer than two visible devices). With cuda:0
// current, each launcher runs on cuda:1's tensors: its bytes must equal the CPU backend's, neither
// GPU may report an error, and cuda:0 must still be current afterwards. The backend-parameterized
// suites also run every case on cuda:1 (their "cuda1" instances, on the default stream); this
// adds a stream of cuda:1 with programmatic dependent launch and checked mode. CudaRefusals*: a
// stream of cuda:0, which the launch must refuse with an error that names both devices (two
// GPUs), and a refused call leaves no CUDA error behind (one GPU). CudaThreads: host threads
// launching on streams of their own at once (one GPU).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

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

  // Runs `op` on cuda:1's tensors while cuda:0 is current: it must finish without error on both
  // GPUs (a launch on cuda:0 with cuda:1's pointers faults there) and leave cuda:0 current.
  void expect_runs_on_gpu1(const std::string& what, const std::function<void()>& op) const {
    SCOPED_TRACE(what);
    ASSERT_NO_THROW(op());
    int current = -1;
    ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
    EXPECT_EQ(current, 0) << what << " changed the current device";
    ASSERT_NO_THROW(device_synchronize(gpu0_));
    ASSERT_NO_THROW(device_synchronize(gpu1_));
  }

  // Runs `op` on the host mirrors (the CPU backend: the expected bytes), then on cuda:1 with
  // expect_runs_on_gpu1, and compares every buffer of `outputs` with its mirror.
  template <typename Params, typename Fill>
  void expect_like_the_cpu_on_gpu1(const std::string& what,
                                   void (*op)(const Params&, const Context&), Fill&& fill,
                                   const std::vector<const Tensor*>& outputs) const {
    Params host, device;
    fill_host_and_device(host, device, fill);
    op(host, Context{});
    expect_runs_on_gpu1(what, [&] { op(device, Context{}); });
    for (const Tensor* t : outputs) EXPECT_TRUE(buffer_matches(*t->buffer, what));
  }

  // A mixed batch of DeepSeek-V3's shape with two heads: 12 tokens, 5 of them decode.
  static FusedSpec mixed_spec(const char* name) {
    FusedSpec spec;
    spec.name = name;
    spec.shape = kDeepSeekV3H2;
    spec.T = 12;
    spec.Td = 5;
    spec.entry = Entry::kMixed;
    return spec;
  }

  const Device gpu0_{DeviceType::kCUDA, 0};
  const Device gpu1_{DeviceType::kCUDA, 1};
  std::mt19937_64 rng_{20261205};
};

TEST_F(CudaDevices, EveryOpRunsOnItsTensorsGpuAndKeepsTheCurrentOne) {
  constexpr int64_t T = 5;
  constexpr int64_t N = 1536;
  const Tensor x = random_tensor(gpu1_, DType::kBFloat16, {T, N}, rng_);
  const Tensor w = random_tensor(gpu1_, DType::kBFloat16, {N}, rng_);

  const Tensor y = poisoned_tensor(gpu1_, DType::kBFloat16, {T, N});
  expect_like_the_cpu_on_gpu1<RmsNormParams>("rms_norm", rms_norm,
                                             [&](RmsNormParams* p, auto view) {
                                               p->num_tokens = T;
                                               p->input = view(x);
                                               p->weight = view(w);
                                               p->output = view(y);
                                             },
                                             {&y});

  const Tensor values = poisoned_tensor(gpu1_, DType::kFloat8E4M3, {T, N});
  const Tensor scales = poisoned_tensor(gpu1_, DType::kFloat32, {T, N / kDefaultQuantGroupSize});
  expect_like_the_cpu_on_gpu1<RmsNormQuantParams>("rmsnorm_quant", rmsnorm_quant,
                                                  [&](RmsNormQuantParams* p, auto view) {
                                                    p->num_tokens = T;
                                                    p->input = view(x);
                                                    p->weight = view(w);
                                                    p->quant.values = view(values);
                                                    p->quant.scales = view(scales);
                                                  },
                                                  {&values, &scales});

  constexpr int64_t kRot = 64;
  const Tensor positions = index_tensor(gpu1_, DType::kInt64, {0, 3, 1, 7, 2});
  const Tensor query = random_tensor(gpu1_, DType::kBFloat16, {T, 2, kRot}, rng_);
  const Tensor cos_sin = random_tensor(gpu1_, DType::kFloat32, {8, kRot}, rng_, 1.0f);
  expect_like_the_cpu_on_gpu1<RotaryEmbeddingParams>("rotary_embedding", rotary_embedding,
                                                     [&](RotaryEmbeddingParams* p, auto view) {
                                                       p->num_tokens = T;
                                                       p->positions = view(positions);
                                                       p->query = view(query);
                                                       p->cos_sin_cache = view(cos_sin);
                                                     },
                                                     {&query});

  const CacheGeometry geometry;
  TestCache cache = new_cache(gpu1_, geometry);
  fill_cache_with_entries(gpu1_, cache, rng_);
  const Tensor slots = index_tensor(gpu1_, DType::kInt64, {0, 17, -1, 40, 3});
  const Tensor out = poisoned_tensor(gpu1_, DType::kBFloat16, {T, geometry.L + geometry.R});
  expect_like_the_cpu_on_gpu1<GatherCacheSlotsParams>("gather_cache_slots", gather_cache_slots,
                                                      [&](GatherCacheSlotsParams* p, auto view) {
                                                        p->num_tokens = T;
                                                        p->kv_cache = view(cache);
                                                        p->slots = view(slots);
                                                        p->out = view(out);
                                                      },
                                                      {&out});

  // The fused op (mla_rope_cache's launcher; concat_and_cache_mla and decode_q_concat share it),
  // against the reference.
  FusedSpec spec;
  spec.name = "gpu1_mixed";
  spec.shape = kDeepSeekV3H2;
  spec.T = 9;
  spec.Td = 4;
  spec.entry = Entry::kMixed;
  spec.norm = true;
  expect_runs_on_gpu1("mla_rope_cache", [&] { run_fused_case(spec, gpu1_); });
}

// A stream of cuda:1, programmatic dependent launch and checked mode (counters read before and
// after on that stream), with cuda:0 current.
TEST_F(CudaDevices, TheFusedOpOnAStreamOfTheSecondGpu) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  const cudaError_t created = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(created, cudaSuccess);

  FusedSpec spec = mixed_spec("gpu1_stream");
  spec.q_out_dtype = DType::kFloat8E4M3;
  spec.q_scale = 0.5f;
  FusedProblem problem(spec, gpu1_);
  problem.run_reference();
  Context ctx;
  ctx.stream = stream;
  ctx.pdl = true;
  ctx.checked = true;
  ctx.error_counts = problem.counts.device_ptr();
  expect_runs_on_gpu1("mla_rope_cache_mixed on a cuda:1 stream", [&] { problem.launch(ctx); });
  problem.expect_matches();
  cudaStreamDestroy(stream);
}

// The refusals provoke CUDA API errors on purpose (compute-sanitizer reports each one), so their
// suites' names begin with CudaRefusals and scripts/gpu_run.sh leaves them out of its sanitizer
// runs.
class CudaRefusalsOnTwoGpus : public CudaDevices {};

// A stream of cuda:0 with the tensors on cuda:1: the launch fails (a kernel cannot be launched on
// a stream of a device other than the current one, and the dispatch made cuda:1 current), the error
// names both devices, nothing is written and cuda:0 stays current.
TEST_F(CudaRefusalsOnTwoGpus, AStreamOfAnotherGpuIsNamedInTheError) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);

  FusedProblem problem(mixed_spec("gpu0_stream"), gpu1_);
  Context ctx;
  ctx.stream = stream;
  try {
    problem.launch(ctx);
    ADD_FAILURE() << "a stream of cuda:0 for cuda:1's tensors was accepted";
  } catch (const Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("the stream belongs to cuda:0, the op's tensors to cuda:1"),
        std::string::npos)
        << e.what();
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the failed launch left its error behind";
  int current = -1;
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 0);
  ASSERT_NO_THROW(device_synchronize(gpu0_));
  ASSERT_NO_THROW(device_synchronize(gpu1_));
  const std::pair<const char*, std::shared_ptr<Buffer>> buffers[] = {
      {"kv_cache", problem.cache.data},
      {"k_pe", problem.k_pe.buffer},
      {"k_pe_out", problem.k_pe_out.buffer},
      {"q_pe", problem.q_pe.buffer},
      {"q_out", problem.q_out.buffer},
      {"q", problem.q.buffer},
      {"q_prefill_out", problem.q_prefill_out.buffer}};
  for (const auto& [what, buffer] : buffers) {
    if (buffer) EXPECT_TRUE(buffer->download() == buffer->initial) << what << " was written";
  }
  cudaStreamDestroy(stream);
}

// One GPU suffices: a call the runtime refuses (selecting a device past the last one, for an
// allocation and for an op) throws mlakv::Error and leaves no error behind for the caller's next
// cudaGetLastError, which PyTorch reads after each of its own kernels.
TEST(CudaRefusals, ARefusedCallLeavesNoErrorBehind) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) GTEST_SKIP() << "needs a CUDA device";
  const Device past_the_last{DeviceType::kCUDA, count};
  EXPECT_THROW(device_alloc(past_the_last, 256), Error);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "device_alloc left an error";

  std::mt19937_64 rng(7);
  const Tensor x = random_tensor(Device{DeviceType::kCUDA, 0}, DType::kBFloat16, {2, 512}, rng);
  const Tensor w = random_tensor(Device{DeviceType::kCUDA, 0}, DType::kBFloat16, {512}, rng);
  const Tensor y = poisoned_tensor(Device{DeviceType::kCUDA, 0}, DType::kBFloat16, {2, 512});
  RmsNormParams p;
  p.num_tokens = 2;
  p.input = x.device_view();
  p.weight = w.device_view();
  p.output = y.device_view();
  for (TensorView* t : {&p.input, &p.weight, &p.output}) t->device = past_the_last;
  try {
    rms_norm(p);
    ADD_FAILURE() << "rms_norm ran on cuda:" << count;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot select the tensors' device cuda:" +
                                         std::to_string(count)),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "rms_norm left an error";
}

// Two host threads launch rmsnorm_quant's generic kernel at once, each on a stream of its own, at
// two widths whose weight rows need more than the default 48 KB of shared memory (N = 25600: 50
// KB, N = 32768: 64 KB). The kernel's shared-memory opt-in is one value per device for every
// thread: a launch that set it to its own size could lower it under the other thread's between
// that thread's raise and its launch, which then failed.
TEST(CudaThreads, WideRowsFromTwoThreadsAtOnce) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) GTEST_SKIP() << "needs a CUDA device";
  const Device gpu{DeviceType::kCUDA, 0};
  std::atomic<int> failures{0};
  auto launch_many = [&](int64_t N) {
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    std::mt19937_64 rng(static_cast<uint64_t>(N));
    const Tensor input = random_tensor(gpu, DType::kBFloat16, {1, N}, rng);
    const Tensor weight = random_tensor(gpu, DType::kBFloat16, {N}, rng);
    const Tensor values = new_tensor(gpu, DType::kFloat8E4M3, {1, N});
    const Tensor scales = new_tensor(gpu, DType::kFloat32, {1, N / kDefaultQuantGroupSize});
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the uploads, before the stream's work
    RmsNormQuantParams p;
    p.num_tokens = 1;
    p.input = input.device_view();
    p.weight = weight.device_view();
    p.quant.values = values.device_view();
    p.quant.scales = scales.device_view();
    Context ctx;
    ctx.stream = stream;
    for (int i = 0; i < 2000; ++i) {
      try {
        rmsnorm_quant(p, ctx);
      } catch (const Error& e) {
        if (failures++ == 0) ADD_FAILURE() << "N " << N << ", launch " << i << ": " << e.what();
        break;
      }
    }
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    cudaStreamDestroy(stream);
  };
  std::thread wide(launch_many, 32768);
  std::thread narrower(launch_many, 25600);
  wide.join();
  narrower.join();
  EXPECT_EQ(failures.load(), 0);
}

}  // namespace
}  // namespace test
}  // namespace mlakv
