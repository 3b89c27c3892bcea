// mlakv tests (CUDA builds; skipped without a visible device): which kernel instance a launcher
// chooses. The results of every instance are checked elsewhere (test_fused.cpp and
// test_rmsnorm_quant.cpp, against the CPU backend and the reference); this checks the choice
// itself, so that a launcher that silently stopped choosing an instance fails here instead of
// passing with another instance's results. The op is captured into a CUDA graph (not run), and the
// graph's kernel node names the instance.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda_utils.h"
#include "cuda/mla_rope_cache.h"
#include "cuda/rmsnorm_quant.h"
#include "cuda_graph.h"
#include "fused_problem.h"

namespace mlakv {
namespace test {
namespace {

// The kernel and its template arguments, without namespaces or parameters:
// "void mlakv::cuda::rmsq::k<float, 2>(mlakv::cuda::P)" -> "k<float, 2>".
std::string instance_of(const std::string& name) {
  const size_t open = name.find('<');
  const size_t close = name.find(">(");
  if (open == std::string::npos || close == std::string::npos || close < open) return name;
  const size_t scope = name.rfind("::", open);
  const size_t begin = scope == std::string::npos ? 0 : scope + 2;
  return name.substr(begin, close + 1 - begin);
}

// Uninitialized e4m3 values [T, N] and fp32 scales [T, N / 128]: the graphs are captured, not run.
struct QuantOut {
  QuantOut(Device device, int64_t T, int64_t N)
      : values(new_tensor(device, DType::kFloat8E4M3, {T, N})),
        scales(new_tensor(device, DType::kFloat32, {T, N / kDefaultQuantGroupSize})) {}
  Fp8GroupQuantOutput view() const {
    Fp8GroupQuantOutput q;
    q.values = values.device_view();
    q.scales = scales.device_view();
    return q;
  }
  Tensor values, scales;
};

class CudaKernelChoice : public testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // The demangled names of the kernels that `launch` enqueues.
  std::vector<std::string> kernels_of(const std::function<void(const Context&)>& launch) const {
    MLAKV_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads, before the capture
    Context ctx;
    ctx.stream = stream_;
    const CapturedGraph graph(stream_, [&] { launch(ctx); });
    return graph.kernel_names();
  }
  // Expects `launch` to enqueue one kernel, the instance `expected` (as instance_of spells it).
  void expect_instance(const std::function<void(const Context&)>& launch,
                       const std::string& expected) const {
    const std::vector<std::string> names = kernels_of(launch);
    ASSERT_EQ(names.size(), 1u);
    EXPECT_EQ(instance_of(names[0]), expected) << names[0];
  }
  std::vector<std::string> kernels_of(const FusedSpec& spec) const {
    const FusedProblem problem(spec, device_);
    return kernels_of([&](const Context& ctx) { problem.launch(ctx); });
  }

  const Device device_{DeviceType::kCUDA, 0};
  cudaStream_t stream_ = nullptr;
};

// The template arguments of mla_rope_cache_kernel<...> as the demangled name spells them, split at
// ", " (T, kFormat, QOut, kVec, kKTokens, kKTableFirst, kRopeInCopy, kKNarrow), or empty if
// `name` is not that kernel.
std::vector<std::string> fused_arguments(const std::string& name) {
  const std::string kernel = "mla_rope_cache_kernel<";
  const size_t begin = name.find(kernel);
  const size_t end = name.find(">(");
  std::vector<std::string> args;
  if (begin == std::string::npos || end == std::string::npos || end < begin) return args;
  size_t from = begin + kernel.size();
  while (from <= end) {
    const size_t comma = std::min(name.find(", ", from), end);
    args.push_back(name.substr(from, comma - from));
    from = comma + 2;
  }
  return args;
}

// Two template arguments of the fused kernel (kKTableFirst, kRopeInCopy), as the demangled name
// spells them ("true, false"), or "" if `name` is not that kernel.
std::string fused_flags(const std::string& name) {
  const std::vector<std::string> args = fused_arguments(name);
  return args.size() == 8 ? args[5] + ", " + args[6] : "";
}

// kDeepSeekV3H2 (the K items are what the order changes), a bf16 model and cache.
FusedSpec spec_of(const char* name, Entry entry, int64_t T, int64_t Td) {
  FusedSpec s;
  s.name = name;
  s.shape = kDeepSeekV3H2;
  s.entry = entry;
  s.T = T;
  s.Td = Td;
  s.prefill_q = entry != Entry::kDecode;
  return s;
}

struct ChoiceCase {
  FusedSpec spec;
  const char* flags;  // the kernel's kKTableFirst and kRopeInCopy arguments
};

class CudaFusedKernelChoice : public CudaKernelChoice {
 protected:
  void expect_flags(const std::vector<ChoiceCase>& cases) const {
    for (const ChoiceCase& c : cases) {
      SCOPED_TRACE(c.spec.name);
      const std::vector<std::string> names = kernels_of(c.spec);
      ASSERT_EQ(names.size(), 1u) << "expected one kernel, the fused one";
      EXPECT_EQ(fused_flags(names[0]), c.flags) << names[0];
    }
  }
};

// (The decode rows of these launches with a bf16 q_out take the kRopeInCopy instance from
// kRopeInCopyMinTokens on.)
TEST_F(CudaFusedKernelChoice, KItemsTableFirstFromTheThreshold) {
  constexpr int64_t kMin = cuda::kKTableFirstMinTokens;
  static_assert(kMin > cuda::kRopeInCopyMinTokens);
  std::vector<ChoiceCase> cases = {
      {spec_of("decode_below", Entry::kDecode, kMin - 1, kMin - 1), "false, true"},
      {spec_of("decode_at", Entry::kDecode, kMin, kMin), "true, true"},
      {spec_of("mixed_above", Entry::kMixed, kMin + 769, 700), "true, true"},
      {spec_of("small", Entry::kFused, 7, 3), "false, false"},
  };
  // Compiled for q_out of the model dtype only: an e4m3 q_out keeps the rows-first order.
  FusedSpec fp8 = spec_of("qout_e4m3_above", Entry::kDecode, kMin + 769, kMin + 769);
  fp8.q_out_dtype = DType::kFloat8E4M3;
  fp8.q_scale = 0.05f;
  cases.push_back({fp8, "false, false"});
  expect_flags(cases);
}

// The decode rows' rope parts in the copy items (cuda/mla_rope_cache.h kRopeInCopyMinTokens): from
// that many decode tokens (a device Td: tokens) on, with q_out of the model dtype, for chunked
// rope items (GPT-J) whose copy items leave a stage slot free.
TEST_F(CudaFusedKernelChoice, RopeInCopyFromTheThreshold) {
  constexpr int64_t kMin = cuda::kRopeInCopyMinTokens;
  std::vector<ChoiceCase> cases = {
      {spec_of("decode_below", Entry::kDecode, kMin - 1, kMin - 1), "false, false"},
      {spec_of("decode_at", Entry::kDecode, kMin, kMin), "false, true"},
      {spec_of("mixed_decode_below", Entry::kMixed, kMin + 100, kMin - 1), "false, false"},
      {spec_of("mixed_decode_at", Entry::kMixed, kMin + 100, kMin), "false, true"},
  };
  // A device Td counts every token: the decode rows are known only on the device.
  FusedSpec dev = spec_of("device_td_below", Entry::kFused, kMin - 1, 0);
  dev.device_td = true;
  dev.device_td_value = 5;
  cases.push_back({dev, "false, false"});
  dev.name = "device_td_at";
  dev.T = kMin;
  cases.push_back({dev, "false, true"});
  // Not for an fp8 q_out.
  FusedSpec fp8 = spec_of("qout_e4m3_at", Entry::kDecode, kMin, kMin);
  fp8.q_out_dtype = DType::kFloat8E4M3;
  fp8.q_scale = 0.05f;
  cases.push_back({fp8, "false, false"});
  // NeoX rope items are not chunked.
  FusedSpec neox = spec_of("neox_at", Entry::kDecode, kMin, kMin);
  neox.style = RopeStyle::kNeox;
  cases.push_back({neox, "false, false"});
  // fp32 rows: 16 heads' copy items of 4 slots fill the stage (4 slots of 32-byte chunks). One
  // head of L = 64 (4 rows an item, 32 rope chunks) takes 1 slot, a free one, on a GPU of 44
  // multiprocessors or more; on a smaller one, 2 or more (mla_rope_cache.cu copy_fill_warps sizes
  // items by the resident warps).
  FusedSpec fp32 = spec_of("fp32_h16_at", Entry::kDecode, kMin, kMin);
  fp32.shape = kDeepSeekV3Tp8;
  fp32.model = DType::kFloat32;
  cases.push_back({fp32, "false, false"});
  if (cuda::multiprocessor_count() >= 44) {
    fp32.name = "fp32_h1_l64_at";
    fp32.shape = ModelShape{"h1l64", 1, 64, 64, 128};
    cases.push_back({fp32, "false, true"});
  }
  expect_flags(cases);
}

// The unfused decode_q_concat runs the same kernel without rotation, and takes the same path.
TEST_F(CudaFusedKernelChoice, DecodeQConcatRopeInCopyFromTheThreshold) {
  constexpr int64_t kMin = cuda::kRopeInCopyMinTokens;
  constexpr int64_t H = 8, L = 512, R = 64;
  for (const int64_t T : {kMin - 1, kMin}) {
    SCOPED_TRACE("T " + std::to_string(T));
    const Tensor ql_nope = new_tensor(device_, DType::kBFloat16, {T, H, L});
    const Tensor q_pe = new_tensor(device_, DType::kBFloat16, {T, H, R});
    const Tensor q_out = new_tensor(device_, DType::kBFloat16, {T, H, L + R});
    DecodeQConcatParams p;
    p.num_tokens = T;
    p.ql_nope = ql_nope.device_view();
    p.q_pe = q_pe.device_view();
    p.q_out = q_out.device_view();
    const std::vector<std::string> names =
        kernels_of([&](const Context& ctx) { decode_q_concat(p, ctx); });
    ASSERT_EQ(names.size(), 1u) << "expected one kernel";
    EXPECT_EQ(fused_flags(names[0]), T >= kMin ? "false, true" : "false, false") << names[0];
  }
}

// A part already in q_out is not copied (DecodeQConcatArgs): with q_pe in place the copy items do
// not take the rope parts (kRopeInCopy off, even from the threshold on), and with both parts in
// place nothing is launched.
TEST_F(CudaFusedKernelChoice, DecodeQConcatPartsInPlace) {
  constexpr int64_t T = cuda::kRopeInCopyMinTokens;
  constexpr int64_t H = 8, L = 512, R = 64;
  const Tensor ql_nope = new_tensor(device_, DType::kBFloat16, {T, H, L});
  const Tensor q_pe = new_tensor(device_, DType::kBFloat16, {T, H, R});
  const Tensor q_out = new_tensor(device_, DType::kBFloat16, {T, H, L + R});
  const TensorView out = q_out.device_view();
  const TensorView out_nope = q_out.view(q_out.offset, {T, H, L}, q_out.stride).device_view();
  const TensorView out_pe = q_out.view(q_out.offset + L, {T, H, R}, q_out.stride).device_view();
  struct Case {
    const char* name;
    TensorView nope, pe;
    size_t kernels;
  };
  for (const Case& c : {Case{"q_pe in place", ql_nope.device_view(), out_pe, 1},
                        Case{"both in place", out_nope, out_pe, 0}}) {
    SCOPED_TRACE(c.name);
    DecodeQConcatParams p;
    p.num_tokens = T;
    p.ql_nope = c.nope;
    p.q_pe = c.pe;
    p.q_out = out;
    const std::vector<std::string> names =
        kernels_of([&](const Context& ctx) { decode_q_concat(p, ctx); });
    ASSERT_EQ(names.size(), c.kernels);
    if (c.kernels == 1) EXPECT_EQ(fused_flags(names[0]), "false, false") << names[0];
  }
}

// `names` (one launch's kernels) is the fused kernel alone: its template arguments into *args.
void fused_kernel_arguments(const std::vector<std::string>& names, std::vector<std::string>* args) {
  ASSERT_EQ(names.size(), 1u) << "expected one kernel, the fused one";
  *args = fused_arguments(names[0]);
  ASSERT_EQ(args->size(), 8u) << names[0];
}

// `names` is the fused kernel alone, in its 16-byte instance (kVec) or not.
void expect_fused_instance(const std::vector<std::string>& names, const char* vec) {
  std::vector<std::string> args;
  ASSERT_NO_FATAL_FAILURE(fused_kernel_arguments(names, &args));
  EXPECT_EQ(args[3], vec) << names[0];
}

// K items of two tokens (cuda/mla_rope_cache.h kKTwoTokensMinTokens): from that many tokens on, in
// the table-first instance of a 16-bit model (q_out of the model dtype or none), where L <= 512
// and R <= 128; one token below the threshold, for an fp32 model and an e4m3 q_out, and one token
// in the rows-first order for wider shapes (the table-first order is compiled for narrow ones).
TEST_F(CudaFusedKernelChoice, KItemsOfTwoTokensFromTheThreshold) {
  constexpr int64_t kMin = cuda::kKTwoTokensMinTokens;
  static_assert(kMin >= cuda::kKTableFirstMinTokens);
  static_assert(kMin == 1792, "the TwoTokenK specs (test_fused.cpp) take T = 1792-1795");
  static_assert(cuda::kKNarrowMaxLatent == 512 && cuda::kKNarrowMaxRope == 128,
                "the widths below are the limits");
  struct Case {
    FusedSpec spec;
    const char* tokens;       // kKTokens
    const char* table_first;  // kKTableFirst
  };
  std::vector<Case> cases = {
      {spec_of("decode_below", Entry::kDecode, kMin - 1, kMin - 1), "1", "true"},
      {spec_of("decode_at", Entry::kDecode, kMin, kMin), "2", "true"},
      {spec_of("mixed_above", Entry::kMixed, kMin + 3, 1000), "2", "true"},
      {spec_of("prefill_at", Entry::kPrefill, kMin, 0), "2", "true"},
  };
  FusedSpec s = spec_of("l512_r128_at", Entry::kPrefill, kMin, 0);
  s.shape = ModelShape{"l512r128", 2, 512, 128, 128};
  cases.push_back({s, "2", "true"});
  s.name = "l512_r136_at";
  s.shape = ModelShape{"l512r136", 2, 512, 136, 128};
  cases.push_back({s, "1", "false"});
  s.name = "l1024_at";
  s.shape = ModelShape{"l1024", 2, 1024, 64, 128};
  cases.push_back({s, "1", "false"});
  s = spec_of("fp16_at", Entry::kMixed, kMin, 100);
  s.model = DType::kFloat16;
  cases.push_back({s, "2", "true"});
  s.name = "fp32_at";
  s.model = DType::kFloat32;
  cases.push_back({s, "1", "true"});
  s = spec_of("qout_e4m3_at", Entry::kDecode, kMin, kMin);
  s.q_out_dtype = DType::kFloat8E4M3;
  s.q_scale = 0.05f;
  cases.push_back({s, "1", "false"});
  auto expect_args = [](const std::vector<std::string>& names, const char* tokens,
                        const char* table_first) {
    std::vector<std::string> args;
    ASSERT_NO_FATAL_FAILURE(fused_kernel_arguments(names, &args));
    EXPECT_EQ(args[4], tokens) << names[0];
    EXPECT_EQ(args[5], table_first) << names[0];
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.spec.name);
    expect_args(kernels_of(c.spec), c.tokens, c.table_first);
  }
  // concat_and_cache_mla (no rotation) keeps one token an item at any T.
  SCOPED_TRACE("concat_and_cache_mla");
  CacheGeometry g;
  g.num_blocks = kMin / g.block_size + 2;
  const TestCache cache = new_cache(device_, g);
  const Tensor kv_c = new_tensor(device_, DType::kBFloat16, {kMin, g.L});
  const Tensor k_pe = new_tensor(device_, DType::kBFloat16, {kMin, g.R});
  const Tensor slots = new_tensor(device_, DType::kInt64, {kMin});
  ConcatAndCacheMlaParams concat;
  concat.num_tokens = kMin;
  concat.kv_c = kv_c.device_view();
  concat.k_pe = k_pe.device_view();
  concat.slot_mapping = slots.device_view();
  concat.kv_cache = cache.device_view();
  expect_args(kernels_of([&](const Context& ctx) { concat_and_cache_mla(concat, ctx); }), "1",
              "false");
}

// Narrow K items (cuda/mla_rope_cache.h kKNarrowMaxLatent): the 16-byte instances of shapes with
// L <= 512 and R <= 128 at any T (a bf16 and an e4m3 q_out, a bf16 and an fp32 model here); the
// widest instance for wider shapes and for the element-wise path (rows padded by 3 elements).
TEST_F(CudaFusedKernelChoice, KItemsNarrowForNarrowShapes) {
  static_assert(cuda::kKNarrowMaxLatent == 512 && cuda::kKNarrowMaxRope == 128,
                "the widths below are the limits");
  struct Case {
    FusedSpec spec;
    const char* narrow;  // kKNarrow
  };
  std::vector<Case> cases;
  for (const int64_t T : {int64_t{1}, int64_t{33}, cuda::kKTwoTokensMinTokens}) {
    FusedSpec s = spec_of("dsv3_decode", Entry::kDecode, T, T);
    s.name = "dsv3_decode_T" + std::to_string(T);
    cases.push_back({s, "true"});
    s.name = "dsv3_qout_e4m3_T" + std::to_string(T);
    s.q_out_dtype = DType::kFloat8E4M3;
    s.q_scale = 0.05f;
    s.cache.format = CacheFormat::kFloat8E4M3;
    s.cache.scale = 0.05f;
    cases.push_back({s, "true"});
    s = spec_of("l512_r128", Entry::kMixed, T, T / 2);
    s.name = "l512_r128_T" + std::to_string(T);
    s.shape = ModelShape{"l512r128", 2, 512, 128, 128};
    cases.push_back({s, "true"});
    s.name = "l512_r136_T" + std::to_string(T);
    s.shape = ModelShape{"l512r136", 2, 512, 136, 128};
    cases.push_back({s, "false"});
    s.name = "l1024_qout_e4m3_T" + std::to_string(T);
    s.shape = ModelShape{"l1024", 2, 1024, 64, 128};
    s.q_out_dtype = DType::kFloat8E4M3;
    s.q_scale = 0.05f;
    cases.push_back({s, "false"});
  }
  FusedSpec s = spec_of("fp32_decode", Entry::kDecode, 8, 8);
  s.model = DType::kFloat32;
  cases.push_back({s, "true"});
  s = spec_of("padded", Entry::kDecode, 8, 8);
  s.row_pad = 3;
  cases.push_back({s, "false"});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.spec.name);
    std::vector<std::string> args;
    ASSERT_NO_FATAL_FAILURE(fused_kernel_arguments(kernels_of(c.spec), &args));
    EXPECT_EQ(args[3], c.spec.row_pad != 0 ? "false" : "true");  // kVec
    EXPECT_EQ(args[7], c.narrow);
  }
}

// The stride of a size-1 cache dim is never used, and validation hands the backend 0 for it: a
// caller's junk value there (here 7 bytes, which no 16-byte access could take) leaves the launch
// on the 16-byte path, as a packed stride does.
TEST_F(CudaFusedKernelChoice, UnusedCacheStrideKeepsTheVectorPath) {
  for (const bool one_block : {true, false}) {
    SCOPED_TRACE(one_block ? "one block" : "blocks of one entry");
    FusedSpec spec = spec_of("unused_stride", Entry::kFused, 9, 4);
    if (one_block) {
      spec.cache.num_blocks = 1;
    } else {
      spec.cache.block_size = 1;
      spec.cache.num_blocks = 64;
    }
    for (const int64_t junk : {int64_t{0}, int64_t{7}}) {
      SCOPED_TRACE("unused stride " + std::to_string(junk));
      spec.cache.unused_stride_bytes = junk;
      const std::vector<std::string> names = kernels_of(spec);
      ASSERT_NO_FATAL_FAILURE(expect_fused_instance(names, "true"));
    }
  }
}

// The same for the tensors: validation hands the backend the canonical stride of a size-1 dim
// (core::canonical_stride), so junk there (1: a transposed kv_c [512, 1] -> [1, 512] has strides
// (1, 1); 3: an odd head stride of q_pe, ql_nope, q_out and q at H = 1) leaves the launch on the
// 16-byte path. One token of one-row tensors (every token stride unused) and one head over 9
// tokens (every head stride unused).
TEST_F(CudaFusedKernelChoice, UnusedTensorStridesKeepTheVectorPath) {
  FusedSpec one_token = spec_of("one_token", Entry::kFused, 1, 1);
  one_token.shape = ModelShape{"h1", 1, 512, 64, 128};
  one_token.extra_rows = 0;
  one_token.k_pe_out = true;
  one_token.kv_c_out = true;
  one_token.prefill_out = true;
  FusedSpec one_head = one_token;
  one_head.name = "one_head";
  one_head.T = 9;
  one_head.Td = 4;
  one_head.extra_rows = 2;
  for (const FusedSpec& spec : {one_token, one_head}) {
    const FusedProblem problem(spec, device_);
    for (const int64_t junk : {int64_t{0}, int64_t{1}, int64_t{3}}) {
      SCOPED_TRACE(spec.name + (junk != 0 ? ", unused strides " + std::to_string(junk) : ""));
      const MlaRopeCacheParams p =
          junk != 0 ? with_unused_strides(problem.params(false), junk) : problem.params(false);
      const std::vector<std::string> names =
          kernels_of([&](const Context& ctx) { mla_rope_cache(p, ctx); });
      ASSERT_NO_FATAL_FAILURE(expect_fused_instance(names, "true"));
    }
  }
}

// Rows padded by 3 elements (row strides no multiple of 16 bytes) take the element-wise instance
// (kVec false), through mla_rope_cache and concat_and_cache_mla: test_cuda_pdl.cu's padded cases
// rely on it to reach that instance's own launch.
TEST_F(CudaFusedKernelChoice, UnalignedRowsTakeTheElementWisePath) {
  constexpr int64_t T = 64, kPad = 3;
  FusedSpec spec = spec_of("decode_padded", Entry::kDecode, T, T);
  spec.shape = kDeepSeekV3Tp8;
  spec.norm = spec.k_pe_out = spec.kv_c_out = true;
  spec.row_pad = kPad;
  CacheGeometry g;
  g.num_blocks = T / g.block_size + 2;
  const TestCache cache = new_cache(device_, g);
  const Tensor slot_mapping = new_tensor(device_, DType::kInt64, {T});
  const Tensor kv_c = padded_rows(device_, DType::kBFloat16, T, g.L, kPad);
  const Tensor k_pe = padded_rows(device_, DType::kBFloat16, T, g.R, kPad);
  ConcatAndCacheMlaParams concat;
  concat.num_tokens = T;
  concat.kv_c = kv_c.device_view();
  concat.k_pe = k_pe.device_view();
  concat.slot_mapping = slot_mapping.device_view();
  concat.kv_cache = cache.device_view();
  const std::pair<const char*, std::vector<std::string>> launches[] = {
      {"mla_rope_cache", kernels_of(spec)},
      {"concat_and_cache_mla",
       kernels_of([&](const Context& ctx) { concat_and_cache_mla(concat, ctx); })},
  };
  for (const auto& [op, names] : launches) {
    SCOPED_TRACE(op);
    ASSERT_NO_FATAL_FAILURE(expect_fused_instance(names, "false"));
  }
}

// rmsnorm_quant's exact-fit kernel in the thread form of the grid's size (cuda/rmsnorm_quant.h):
// one chunk a thread while the whole grid is at most kRmsqOneChunkMaxBlocks blocks of two rows,
// two up to kRmsqTwoChunksMaxBlocks of q_c's, then 64 threads; other widths take the generic
// kernel.
TEST_F(CudaKernelChoice, RmsNormQuantThreadForms) {
  constexpr int64_t kOne = cuda::kRmsqOneChunkMaxBlocks * cuda::kRmsqRowsPerBlock;
  constexpr int64_t kTwo = cuda::kRmsqTwoChunksMaxBlocks * cuda::kRmsqRowsPerBlock;
  struct Case {
    int64_t T, N;
    const char* instance;
  };
  const Case cases[] = {
      {1, 1536, "rmsnorm_quant_rows_kernel<mlakv::num::Bf16, 1536, 0, 192, 192>"},
      {kOne, 1536, "rmsnorm_quant_rows_kernel<mlakv::num::Bf16, 1536, 0, 192, 192>"},
      {kOne + 1, 1536, "rmsnorm_quant_rows_kernel<mlakv::num::Bf16, 1536, 0, 96, 96>"},
      {kTwo, 1536, "rmsnorm_quant_rows_kernel<mlakv::num::Bf16, 1536, 0, 96, 96>"},
      {kTwo + 1, 1536, "rmsnorm_quant_rows_kernel<mlakv::num::Bf16, 1536, 0, 64, 64>"},
      {kOne, 512, "rmsnorm_quant_rows_kernel<mlakv::num::Bf16, 512, 0, 64, 64>"},
      {kTwo + 1, 1024, "rmsnorm_quant_rows_kernel<mlakv::num::Bf16, 1024, 0, 64, 64>"},
      {16, 7168, "rmsnorm_quant_kernel<mlakv::num::Bf16>"},
  };
  std::mt19937_64 rng(41);
  for (const Case& c : cases) {
    SCOPED_TRACE("T " + std::to_string(c.T) + ", N " + std::to_string(c.N));
    const Tensor input = new_tensor(device_, DType::kBFloat16, {c.T, c.N});
    const Tensor weight = random_tensor(device_, DType::kBFloat16, {c.N}, rng);
    const QuantOut quant(device_, c.T, c.N);
    RmsNormQuantParams p;
    p.num_tokens = c.T;
    p.input = input.device_view();
    p.weight = weight.device_view();
    p.quant = quant.view();
    expect_instance([&](const Context& ctx) { rmsnorm_quant(p, ctx); }, c.instance);
  }
}

// The dual form (q_c 1536 + kv_c 512): the one-chunk instance bounded for
// kRmsqDualOneChunkBlocksPerSm resident blocks while the whole grid fits them, the two-chunk form
// while q_c has at most kRmsqDualTwoChunksMaxBlocks blocks, then the few-thread instance, bounded
// for kRmsqDualFewBlocksPerSm in bf16 only (fp16 rows spill under that bound: unbounded). The
// bound changes no result, so only the instance's name shows it.
TEST_F(CudaKernelChoice, MlaRmsNormQuantForms) {
  const int64_t one_chunk_blocks =
      std::max<int64_t>(cuda::kRmsqOneChunkMaxBlocks,
                        int64_t{cuda::kRmsqDualOneChunkBlocksPerSm} * cuda::multiprocessor_count());
  // Equal token counts: T blocks of two rows in all, half of them q_c's.
  const int64_t one_chunk_T = one_chunk_blocks / 2 * cuda::kRmsqRowsPerBlock;
  const int64_t two_chunks_T = cuda::kRmsqDualTwoChunksMaxBlocks * cuda::kRmsqRowsPerBlock;
  ASSERT_LT(one_chunk_T, two_chunks_T) << "the cases below assume the forms in this order";
  struct Case {
    DType dtype;
    int64_t T;
    const char* instance;
  };
  constexpr DType kBf16 = DType::kBFloat16, kFp16 = DType::kFloat16;
  const Case cases[] = {
      {kBf16, 1, "rmsnorm_quant_rows_kernel_bounded<mlakv::num::Bf16, 1536, 512, 192, 64>"},
      {kBf16, one_chunk_T,
       "rmsnorm_quant_rows_kernel_bounded<mlakv::num::Bf16, 1536, 512, 192, 64>"},
      {kBf16, one_chunk_T + 2 * cuda::kRmsqRowsPerBlock,
       "rmsnorm_quant_rows_kernel<mlakv::num::Bf16, 1536, 512, 96, 64>"},
      {kBf16, two_chunks_T, "rmsnorm_quant_rows_kernel<mlakv::num::Bf16, 1536, 512, 96, 64>"},
      {kBf16, two_chunks_T + 1,
       "rmsnorm_quant_rows_kernel_bounded<mlakv::num::Bf16, 1536, 512, 64, 64>"},
      // fp16: the one-chunk bound (16-bit rows) but not the few-thread one.
      {kFp16, one_chunk_T,
       "rmsnorm_quant_rows_kernel_bounded<mlakv::num::Half, 1536, 512, 192, 64>"},
      {kFp16, two_chunks_T, "rmsnorm_quant_rows_kernel<mlakv::num::Half, 1536, 512, 96, 64>"},
      {kFp16, two_chunks_T + 1, "rmsnorm_quant_rows_kernel<mlakv::num::Half, 1536, 512, 64, 64>"},
  };
  constexpr int64_t kQ = 1536, kKv = 512;
  std::mt19937_64 rng(42);
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(dtype_name(c.dtype)) + ", T " + std::to_string(c.T));
    const Tensor q_c = new_tensor(device_, c.dtype, {c.T, kQ});
    const Tensor q_weight = random_tensor(device_, c.dtype, {kQ}, rng);
    const QuantOut quant(device_, c.T, kQ);
    const Tensor kv_c = new_tensor(device_, c.dtype, {c.T, kKv});
    const Tensor kv_weight = random_tensor(device_, c.dtype, {kKv}, rng);
    const Tensor kv_normed = new_tensor(device_, c.dtype, {c.T, kKv});
    MlaRmsNormQuantParams p;
    p.q.num_tokens = c.T;
    p.q.input = q_c.device_view();
    p.q.weight = q_weight.device_view();
    p.q.quant = quant.view();
    p.kv.num_tokens = c.T;
    p.kv.input = kv_c.device_view();
    p.kv.weight = kv_weight.device_view();
    p.kv.output = kv_normed.device_view();
    expect_instance([&](const Context& ctx) { mla_rmsnorm_quant(p, ctx); }, c.instance);
  }
}

}  // namespace
}  // namespace test
}  // namespace mlakv
