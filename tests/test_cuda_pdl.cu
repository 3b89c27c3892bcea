// mlakv tests (CUDA builds; skipped without a visible device or on one older than sm_90):
// programmatic dependent launch (Context::pdl). Every library kernel launched with PDL may start
// while the previous kernel in the stream still runs, and must wait for it (griddepcontrol.wait in
// pdl_wait()) before its first read of an input.
//
// A library producer cannot show a missing wait: it is fast, and its writes land before the
// consumer reads. So each case puts a test-local producer right before the op under test: it lets
// its dependents start at once (griddepcontrol.launch_dependents), spins for kSpinNs, then copies
// the real bytes of one input of the op (the "delayed" input, set to 0xff bytes in the stream
// before) from a staging copy. The op, launched with ctx.pdl, starts while the producer spins; if
// it read before waiting, it would read the poison. Its outputs must equal those of the same
// sequence run without PDL, byte for byte, eagerly and in a replayed CUDA graph.
//
// Two self-checks keep the test able to fail: each case runs the op once on the poison itself and
// requires an output to change (a poison the op ignored would prove nothing), and
// CudaPdlProducer checks that a test-local reader launched with PDL after the producer does see the
// poison unless it waits (the producer really overlaps its dependents on this device and driver).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda_utils.h"
#include "cuda_graph.h"
#include "fused_problem.h"

namespace mlakv {
namespace test {
namespace {

// The delayed input's poison: NaN in bf16 / fp16 / fp32, -1 in int32 / int64 indices.
constexpr uint8_t kDelayPoisonByte = 0xff;

// ---- the test-local kernels --------------------------------------------------------------------
constexpr int kProducerThreads = 256;
// How long the producer holds the delayed input back. Eagerly, the host enqueues the op after the
// producer has started: the spin must outlast that launch (microseconds, more on a loaded host) for
// the op to start before the copy. In a graph both are submitted together.
constexpr uint64_t kSpinNs = 1000 * 1000;
// Ends the spin after about 1 s of SM cycles even if the global timer stood still: no hang.
constexpr long long kSpinGuardCycles = 2000LL * 1000 * 1000;

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

// One block. `staging` and `dst` are device_alloc'ed (256-byte aligned): 16-byte words, then the
// tail.
__global__ void delayed_copy_kernel(const uint8_t* staging, uint8_t* dst, int64_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // From here on only the dependent kernel's own wait keeps it from reading dst before the copy.
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
  if (threadIdx.x == 0) {
    const uint64_t start_ns = global_timer_ns();
    const long long start_cycles = clock64();
    while (global_timer_ns() - start_ns < kSpinNs && clock64() - start_cycles < kSpinGuardCycles) {
    }
  }
  __syncthreads();
  const int64_t words = bytes / 16;
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) {
    reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(staging)[i];
  }
  for (int64_t i = words * 16 + threadIdx.x; i < bytes; i += blockDim.x) dst[i] = staging[i];
}

// The canary consumer: copies src[0] to seen[0], after griddepcontrol.wait when `wait`. Written
// here, not with the library's pdl_wait(), so that it means the same in every build of the library.
__global__ void early_read_kernel(const int64_t* src, int64_t* seen, bool wait) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (wait) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  *seen = *static_cast<const volatile int64_t*>(src);
}

// ---- a case and its runs -----------------------------------------------------------------------
struct NamedBuffer {
  std::string name;
  std::shared_ptr<Buffer> buffer;
};

// What a case hands the runner. Every buffer must hold its initial contents on the device.
struct PdlSetup {
  NamedBuffer delayed;               // the input the producer delivers late
  std::vector<NamedBuffer> outputs;  // every buffer the op writes, in-place inputs included
  std::function<void(const Context&)> launch;  // the op (or ops) under test
  // Every other buffer the launch's views point into: keeps them alive.
  std::vector<std::shared_ptr<Buffer>> inputs;
};

struct PdlCase {
  const char* name;
  std::function<PdlSetup(Device)> setup;
};
void PrintTo(const PdlCase& c, std::ostream* os) { *os << c.name; }

// A device copy of a buffer's current device contents.
std::unique_ptr<Buffer> device_snapshot(const Buffer& buffer) {
  auto copy = std::make_unique<Buffer>(buffer.device(), buffer.bytes());
  MLAKV_CUDA_CHECK(cudaMemcpy(copy->device_ptr(), buffer.device_ptr(), buffer.bytes(),
                              cudaMemcpyDeviceToDevice));
  return copy;
}

// One case's sequence in a stream: the outputs restored to their initial contents, the delayed
// input poisoned, the producer, the op. Stream-ordered only, so it can be captured in a graph.
class DelayedInputRunner {
 public:
  DelayedInputRunner(const PdlSetup& setup, cudaStream_t stream)
      : setup_(setup), stream_(stream), staging_(device_snapshot(*setup.delayed.buffer)) {
    for (const NamedBuffer& out : setup.outputs) {
      initial_outputs_.push_back(device_snapshot(*out.buffer));
    }
    // A device-to-device cudaMemcpy (and the uploads before it) may still run on the legacy
    // stream when it returns, and the test's stream does not wait for that stream
    // (cudaStreamNonBlocking): without this the producer once copied an unfinished staging
    // snapshot.
    MLAKV_CUDA_CHECK(cudaDeviceSynchronize());
  }

  // With deliver == false the producer is left out: the op reads the poison itself.
  void enqueue(bool pdl, bool deliver) const {
    for (size_t i = 0; i < setup_.outputs.size(); ++i) {
      const Buffer& out = *setup_.outputs[i].buffer;
      MLAKV_CUDA_CHECK(cudaMemcpyAsync(out.device_ptr(), initial_outputs_[i]->device_ptr(),
                                       out.bytes(), cudaMemcpyDeviceToDevice, stream_));
    }
    const Buffer& delayed = *setup_.delayed.buffer;
    MLAKV_CUDA_CHECK(
        cudaMemsetAsync(delayed.device_ptr(), kDelayPoisonByte, delayed.bytes(), stream_));
    if (deliver) {
      delayed_copy_kernel<<<1, kProducerThreads, 0, stream_>>>(
          static_cast<const uint8_t*>(staging_->device_ptr()),
          static_cast<uint8_t*>(delayed.device_ptr()), static_cast<int64_t>(delayed.bytes()));
      MLAKV_CUDA_CHECK(cudaGetLastError());
    }
    Context ctx;
    ctx.stream = stream_;
    ctx.pdl = pdl;
    setup_.launch(ctx);
  }

  std::vector<std::vector<uint8_t>> download_outputs() const {
    std::vector<std::vector<uint8_t>> out;
    for (const NamedBuffer& b : setup_.outputs) out.push_back(b.buffer->download());
    return out;
  }

  // Whether some output differs from `expected`, the delayed buffer itself left out: an input
  // the op updates in place differs when poisoned whether the op reads it or not.
  bool other_output_differs(const std::vector<std::vector<uint8_t>>& expected) const {
    const std::vector<std::vector<uint8_t>> got = download_outputs();
    for (size_t i = 0; i < got.size(); ++i) {
      if (setup_.outputs[i].buffer != setup_.delayed.buffer && got[i] != expected[i]) return true;
    }
    return false;
  }

  void expect_outputs_equal(const std::vector<std::vector<uint8_t>>& expected,
                            const std::string& what) const {
    const std::vector<std::vector<uint8_t>> got = download_outputs();
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(bytes_equal(got[i], expected[i], what + ", " + setup_.outputs[i].name));
    }
  }

 private:
  const PdlSetup& setup_;
  cudaStream_t stream_;
  std::unique_ptr<Buffer> staging_;                       // the delayed input's real bytes
  std::vector<std::unique_ptr<Buffer>> initial_outputs_;  // parallel to setup_.outputs
};

// ---- the cases ---------------------------------------------------------------------------------
// Tokens of every case: several blocks of every kernel. Shapes: DeepSeek-V3 at TP8.
constexpr int64_t kT = 64;
constexpr int64_t kH = 16, kL = 512, kR = 64;
constexpr int64_t kQLoraRank = 1536;  // q_c's width: rmsnorm_quant's hidden size
// DeepSeek-V3's hidden size: a width that rmsnorm_quant runs in its generic kernel
// (rmsnorm_quant_kernel), launched apart from the exact-fit one of q_c's and kv_c's widths.
constexpr int64_t kHidden = 7168;
// Elements at the end of every per-token row of the padded cases: no row stride is then a multiple
// of 16 bytes, so the fused kernel runs its element-wise instance (kVec false), which the launcher
// dispatches apart from the 16-byte one that every other fused / concat case takes.
constexpr int64_t kUnalignedRowPad = 3;
constexpr DType kModel = DType::kBFloat16;

// mla_rope_cache through FusedProblem (random inputs, poisoned outputs, a sentinel cache).
FusedSpec fused_decode_spec() {
  FusedSpec s;
  s.name = "pdl_decode";
  s.T = kT;
  s.entry = Entry::kDecode;
  s.norm = true;
  s.k_pe_out = true;
  s.kv_c_out = true;
  s.prefill_q = false;
  s.seed = 11;
  return s;
}

FusedSpec fused_decode_padded_spec() {
  FusedSpec s = fused_decode_spec();
  s.name = "pdl_decode_padded";
  s.row_pad = kUnalignedRowPad;
  s.seed = 13;
  return s;
}

FusedSpec fused_mixed_spec(bool device_td) {
  FusedSpec s;
  s.name = "pdl_mixed";
  s.T = kT;
  s.Td = 16;
  s.entry = Entry::kMixed;
  s.prefill_out = true;  // q stays an input: its poison shows in q_prefill_out
  s.device_td = device_td;
  s.device_td_value = static_cast<int32_t>(s.Td);
  s.seed = 12;
  return s;
}

PdlSetup fused_case(const FusedSpec& spec, Tensor FusedProblem::*delayed, const char* name,
                    Device dev) {
  auto problem = std::make_shared<const FusedProblem>(spec, dev);
  PdlSetup s;
  s.delayed = {name, ((*problem).*delayed).buffer};
  s.outputs.push_back({"kv_cache", problem->cache.data});
  const std::pair<const char*, Tensor FusedProblem::*> outputs[] = {
      {"k_pe_out", &FusedProblem::k_pe_out},
      {"kv_c_out", &FusedProblem::kv_c_out},
      {"q_out", &FusedProblem::q_out},
      {"q_prefill_out", &FusedProblem::q_prefill_out}};
  for (const auto& [output_name, member] : outputs) {
    const Tensor& t = (*problem).*member;
    if (t.present()) s.outputs.push_back({output_name, t.buffer});
  }
  if (spec.prefill_q && !spec.prefill_out) s.outputs.push_back({"q", problem->q.buffer});
  s.launch = [problem](const Context& ctx) { problem->launch(ctx); };
  return s;
}

PdlSetup rms_norm_case(Device dev) {
  std::mt19937_64 rng(21);
  const Tensor input = random_tensor(dev, kModel, {kT, kL}, rng);
  const Tensor weight = random_tensor(dev, kModel, {kL}, rng);
  const Tensor output = poisoned_tensor(dev, kModel, {kT, kL});
  RmsNormParams p;
  p.num_tokens = kT;
  p.input = input.device_view();
  p.weight = weight.device_view();
  p.output = output.device_view();
  PdlSetup s;
  s.delayed = {"input", input.buffer};
  s.outputs = {{"output", output.buffer}};
  s.launch = [p](const Context& ctx) { rms_norm(p, ctx); };
  s.inputs = {weight.buffer};
  return s;
}

PdlSetup rotary_embedding_case(Device dev) {
  std::mt19937_64 rng(22);
  constexpr int64_t kMaxPos = 257;
  std::vector<int64_t> pos(static_cast<size_t>(kT));
  for (int64_t t = 0; t < kT; ++t) pos[t] = (t * 37) % kMaxPos;
  const Tensor positions = index_tensor(dev, DType::kInt64, pos);
  const Tensor table = random_tensor(dev, DType::kFloat32, {kMaxPos, kR}, rng);
  const Tensor query = random_tensor(dev, kModel, {kT, kH, kR}, rng);
  const Tensor key = random_tensor(dev, kModel, {kT, 1, kR}, rng);
  RotaryEmbeddingParams p;
  p.num_tokens = kT;
  p.positions = positions.device_view();
  p.query = query.device_view();
  p.key = key.device_view();
  p.cos_sin_cache = table.device_view();
  PdlSetup s;
  s.delayed = {"positions", positions.buffer};
  s.outputs = {{"query", query.buffer}, {"key", key.buffer}};
  s.launch = [p](const Context& ctx) { rotary_embedding(p, ctx); };
  s.inputs = {table.buffer};
  return s;
}

// concat_and_cache_mla with k_pe delayed; or, with normalize_first, the library chain rms_norm ->
// concat_and_cache_mla (both launched with ctx.pdl) with rms_norm's input kv_c delayed: the
// rms_norm kernel waits for the producer, the concat kernel for rms_norm's output `normed`. kv_c
// and k_pe rows end with `row_pad` unused elements.
PdlSetup concat_and_cache_case(Device dev, bool normalize_first, int64_t row_pad = 0) {
  std::mt19937_64 rng(normalize_first ? 24 : 23);
  CacheGeometry g;
  g.num_blocks = kT / g.block_size + 2;  // some blocks stay untouched
  TestCache cache = new_cache(dev, g);
  cache.data->upload();
  std::vector<int64_t> slots(static_cast<size_t>(cache.num_slots()));
  std::iota(slots.begin(), slots.end(), int64_t{0});
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(static_cast<size_t>(kT));
  const Tensor slot_mapping = index_tensor(dev, DType::kInt64, slots);
  const Tensor kv_c = randomized(padded_rows(dev, kModel, kT, kL, row_pad), rng);
  const Tensor k_pe = randomized(padded_rows(dev, kModel, kT, kR, row_pad), rng);
  ConcatAndCacheMlaParams concat;
  concat.num_tokens = kT;
  concat.kv_c = kv_c.device_view();
  concat.k_pe = k_pe.device_view();
  concat.slot_mapping = slot_mapping.device_view();
  concat.kv_cache = cache.device_view();
  PdlSetup s;
  s.outputs = {{"kv_cache", cache.data}};
  s.inputs = {slot_mapping.buffer, kv_c.buffer, k_pe.buffer};
  if (!normalize_first) {
    s.delayed = {"k_pe", k_pe.buffer};
    s.launch = [concat](const Context& ctx) { concat_and_cache_mla(concat, ctx); };
    return s;
  }
  const Tensor weight = random_tensor(dev, kModel, {kL}, rng);
  const Tensor normed = poisoned_tensor(dev, kModel, {kT, kL});
  RmsNormParams norm;
  norm.num_tokens = kT;
  norm.input = kv_c.device_view();
  norm.weight = weight.device_view();
  norm.output = normed.device_view();
  concat.kv_c = normed.device_view();
  s.delayed = {"kv_c", kv_c.buffer};
  s.outputs.push_back({"normed", normed.buffer});
  s.launch = [norm, concat](const Context& ctx) {
    rms_norm(norm, ctx);
    concat_and_cache_mla(concat, ctx);
  };
  s.inputs.push_back(weight.buffer);
  return s;
}

PdlSetup decode_q_concat_case(Device dev) {
  std::mt19937_64 rng(25);
  const Tensor ql_nope = random_tensor(dev, kModel, {kT, kH, kL}, rng);
  const Tensor q_pe = random_tensor(dev, kModel, {kT, kH, kR}, rng);
  const Tensor q_out = poisoned_tensor(dev, kModel, {kT, kH, kL + kR});
  DecodeQConcatParams p;
  p.num_tokens = kT;
  p.ql_nope = ql_nope.device_view();
  p.q_pe = q_pe.device_view();
  p.q_out = q_out.device_view();
  PdlSetup s;
  s.delayed = {"q_pe", q_pe.buffer};
  s.outputs = {{"q_out", q_out.buffer}};
  s.launch = [p](const Context& ctx) { decode_q_concat(p, ctx); };
  s.inputs = {ql_nope.buffer};
  return s;
}

// A bf16 cache with a real entry in every slot.
TestCache filled_cache(Device dev, std::mt19937_64& rng) {
  CacheGeometry g;
  g.num_blocks = kT / g.block_size + 2;
  TestCache cache = new_cache(dev, g);
  fill_cache_with_entries(dev, cache, rng);
  return cache;
}

PdlSetup gather_cache_slots_case(Device dev) {
  std::mt19937_64 rng(26);
  const TestCache cache = filled_cache(dev, rng);
  std::vector<int64_t> slot_values(static_cast<size_t>(kT));
  std::uniform_int_distribution<int64_t> any_slot(0, cache.num_slots() - 1);
  for (int64_t& v : slot_values) v = any_slot(rng);
  const Tensor slots = index_tensor(dev, DType::kInt64, slot_values);
  const Tensor out = poisoned_tensor(dev, kModel, {kT, kL + kR});
  GatherCacheSlotsParams p;
  p.num_tokens = kT;
  p.kv_cache = cache.device_view();
  p.slots = slots.device_view();
  p.out = out.device_view();
  PdlSetup s;
  s.delayed = {"slots", slots.buffer};
  s.outputs = {{"out", out.buffer}};
  s.launch = [p](const Context& ctx) { gather_cache_slots(p, ctx); };
  s.inputs = {cache.data};
  return s;
}

PdlSetup gather_cache_sequences_case(Device dev) {
  std::mt19937_64 rng(27);
  const TestCache cache = filled_cache(dev, rng);
  const int64_t block_size = cache.geometry.block_size;
  const std::vector<int64_t> lens = {5, 37, kT - 42};  // kT rows in all
  const int64_t num_seqs = static_cast<int64_t>(lens.size());
  const int64_t max_blocks =
      (*std::max_element(lens.begin(), lens.end()) + block_size - 1) / block_size;
  std::vector<int64_t> table_values(static_cast<size_t>(num_seqs * max_blocks));
  std::uniform_int_distribution<int64_t> any_block(0, cache.geometry.num_blocks - 1);
  for (int64_t& b : table_values) b = any_block(rng);
  std::vector<int64_t> cu(static_cast<size_t>(num_seqs + 1), 0);
  std::partial_sum(lens.begin(), lens.end(), cu.begin() + 1);
  const Tensor block_table = index_tensor(dev, DType::kInt32, table_values)
                                 .view(0, {num_seqs, max_blocks}, {max_blocks, 1});
  const Tensor cu_seq_lens = index_tensor(dev, DType::kInt32, cu);
  const Tensor out = poisoned_tensor(dev, kModel, {kT, kL + kR});
  GatherCacheSequencesParams p;
  p.num_seqs = num_seqs;
  p.kv_cache = cache.device_view();
  p.block_table = block_table.device_view();
  p.cu_seq_lens = cu_seq_lens.device_view();
  p.out = out.device_view();
  PdlSetup s;
  s.delayed = {"kv_cache", cache.data};
  s.outputs = {{"out", out.buffer}};
  s.launch = [p](const Context& ctx) { gather_cache_sequences(p, ctx); };
  s.inputs = {block_table.buffer, cu_seq_lens.buffer};
  return s;
}

// e4m3 values and row-major fp32 scales of a [kT, hidden] per-token-group quantization, poisoned.
struct QuantTensors {
  Tensor values, scales;
  Fp8GroupQuantOutput view() const {
    Fp8GroupQuantOutput q;
    q.values = values.device_view();
    q.scales = scales.device_view();
    return q;
  }
};
QuantTensors quant_tensors(Device dev, int64_t hidden) {
  return {poisoned_tensor(dev, DType::kFloat8E4M3, {kT, hidden}),
          poisoned_tensor(dev, DType::kFloat32, {kT, hidden / kDefaultQuantGroupSize})};
}

PdlSetup rmsnorm_quant_case(Device dev, int64_t hidden) {
  std::mt19937_64 rng(hidden == kQLoraRank ? 28 : 31);
  const Tensor input = random_tensor(dev, kModel, {kT, hidden}, rng);
  const Tensor weight = random_tensor(dev, kModel, {hidden}, rng);
  const Tensor residual = random_tensor(dev, kModel, {kT, hidden}, rng);
  const Tensor normed = poisoned_tensor(dev, kModel, {kT, hidden});
  const QuantTensors quant = quant_tensors(dev, hidden);
  RmsNormQuantParams p;
  p.num_tokens = kT;
  p.input = input.device_view();
  p.weight = weight.device_view();
  p.residual = residual.device_view();
  p.normed_out = normed.device_view();
  p.quant = quant.view();
  PdlSetup s;
  s.delayed = {"input", input.buffer};
  s.outputs = {{"residual", residual.buffer},
               {"normed_out", normed.buffer},
               {"values", quant.values.buffer},
               {"scales", quant.scales.buffer}};
  s.launch = [p](const Context& ctx) { rmsnorm_quant(p, ctx); };
  s.inputs = {weight.buffer};
  return s;
}

PdlSetup mla_rmsnorm_quant_case(Device dev) {
  std::mt19937_64 rng(29);
  const Tensor q_c = random_tensor(dev, kModel, {kT, kQLoraRank}, rng);
  const Tensor q_weight = random_tensor(dev, kModel, {kQLoraRank}, rng);
  const QuantTensors quant = quant_tensors(dev, kQLoraRank);
  const Tensor kv_c = random_tensor(dev, kModel, {kT, kL}, rng);
  const Tensor kv_weight = random_tensor(dev, kModel, {kL}, rng);
  const Tensor kv_normed = poisoned_tensor(dev, kModel, {kT, kL});
  MlaRmsNormQuantParams p;
  p.q.num_tokens = kT;
  p.q.input = q_c.device_view();
  p.q.weight = q_weight.device_view();
  p.q.quant = quant.view();
  p.kv.num_tokens = kT;
  p.kv.input = kv_c.device_view();
  p.kv.weight = kv_weight.device_view();
  p.kv.output = kv_normed.device_view();
  PdlSetup s;
  s.delayed = {"kv_c", kv_c.buffer};
  s.outputs = {{"values", quant.values.buffer},
               {"scales", quant.scales.buffer},
               {"kv_normed", kv_normed.buffer}};
  s.launch = [p](const Context& ctx) { mla_rmsnorm_quant(p, ctx); };
  s.inputs = {q_c.buffer, q_weight.buffer, kv_weight.buffer};
  return s;
}

PdlSetup per_token_group_quant_case(Device dev) {
  std::mt19937_64 rng(30);
  const Tensor input = random_tensor(dev, kModel, {kT, kQLoraRank}, rng);
  const QuantTensors quant = quant_tensors(dev, kQLoraRank);
  PerTokenGroupQuantParams p;
  p.num_tokens = kT;
  p.input = input.device_view();
  p.quant = quant.view();
  PdlSetup s;
  s.delayed = {"input", input.buffer};
  s.outputs = {{"values", quant.values.buffer}, {"scales", quant.scales.buffer}};
  s.launch = [p](const Context& ctx) { per_token_group_quant_fp8(p, ctx); };
  return s;
}

// Each comment says what the poison turns into, i.e. why the case fails if the op reads early.
std::vector<PdlCase> pdl_cases() {
  return {
      // NaN kv_c: NaN rows out of the RMSNorm, into the cache and kv_c_out.
      {"fused_decode_kv_c",
       [](Device d) { return fused_case(fused_decode_spec(), &FusedProblem::kv_c, "kv_c", d); }},
      // The same in the element-wise instance (padded rows).
      {"fused_decode_padded_kv_c",
       [](Device d) {
         return fused_case(fused_decode_padded_spec(), &FusedProblem::kv_c, "kv_c", d);
       }},
      // NaN q_pe: NaN rope parts of q_out.
      {"fused_decode_q_pe",
       [](Device d) { return fused_case(fused_decode_spec(), &FusedProblem::q_pe, "q_pe", d); }},
      // Position -1 is clamped to 0, an identity rotation; the real positions are random in
      // [0, 1024), so k_pe in the cache, k_pe_out and the rope parts of q_out change.
      {"fused_decode_positions",
       [](Device d) {
         return fused_case(fused_decode_spec(), &FusedProblem::positions, "positions", d);
       }},
      // NaN q: NaN prefill rows of q_prefill_out.
      {"fused_mixed_q",
       [](Device d) { return fused_case(fused_mixed_spec(false), &FusedProblem::q, "q", d); }},
      // NaN ql_nope: NaN nope parts of the decode rows of q_out.
      {"fused_mixed_ql_nope",
       [](Device d) {
         return fused_case(fused_mixed_spec(false), &FusedProblem::ql_nope, "ql_nope", d);
       }},
      // Device Td -1 is clamped to 0: no decode rows, so rows [0, 16) of q_out keep their 0xA5
      // poison and those of q_prefill_out are written.
      {"fused_mixed_device_td",
       [](Device d) {
         return fused_case(fused_mixed_spec(true), &FusedProblem::device_td,
                           "num_decode_tokens_device", d);
       }},
      // NaN input: NaN output rows.
      {"rms_norm_input", rms_norm_case},
      // Position -1 is clamped to 0; the table is random, so its row 0 differs from the rows of
      // the real positions (t * 37 % 257, non-zero for t > 0): query and key change.
      {"rotary_embedding_positions", rotary_embedding_case},
      // NaN k_pe: NaN rope parts of the cache entries.
      {"concat_and_cache_mla_k_pe", [](Device d) { return concat_and_cache_case(d, false); }},
      // The same in the element-wise instance (padded rows).
      {"concat_and_cache_mla_padded_k_pe",
       [](Device d) { return concat_and_cache_case(d, false, kUnalignedRowPad); }},
      // NaN kv_c: NaN normed rows and cache latents (if rms_norm reads early); concat reading
      // `normed` before rms_norm wrote it would cache its 0xA5 poison.
      {"rms_norm_then_concat_and_cache_mla_kv_c",
       [](Device d) { return concat_and_cache_case(d, true); }},
      // NaN q_pe: NaN rope parts of q_out.
      {"decode_q_concat_q_pe", decode_q_concat_case},
      // Slot -1 is padding and gives zero rows; the real slots hold random non-zero entries.
      {"gather_cache_slots_slots", gather_cache_slots_case},
      // NaN cache entries: NaN output rows.
      {"gather_cache_sequences_kv_cache", gather_cache_sequences_case},
      // NaN input: NaN residual, normed_out and e4m3 codes; the scales fall to the floor (the
      // group max ignores NaN).
      {"rmsnorm_quant_input", [](Device d) { return rmsnorm_quant_case(d, kQLoraRank); }},
      // The same in the generic kernel (N = 7168).
      {"rmsnorm_quant_generic_input", [](Device d) { return rmsnorm_quant_case(d, kHidden); }},
      // NaN kv_c (the second task's blocks): NaN kv_normed rows.
      {"mla_rmsnorm_quant_kv_c", mla_rmsnorm_quant_case},
      // NaN input: NaN e4m3 codes, scales at the floor.
      {"per_token_group_quant_fp8_input", per_token_group_quant_case},
  };
}

// ---- the tests ---------------------------------------------------------------------------------
class PdlDeviceTest : public testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no CUDA device";
    int major = 0;
    ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
    if (major < 9) {
      GTEST_SKIP() << "programmatic dependent launch needs sm_90 or newer; device 0 is sm_" << major
                   << "x";
    }
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  const Device device_{DeviceType::kCUDA, 0};
  cudaStream_t stream_ = nullptr;
};

class CudaPdl : public PdlDeviceTest, public testing::WithParamInterface<PdlCase> {};

TEST_P(CudaPdl, OpWaitsForItsDelayedInput) {
  const PdlSetup setup = GetParam().setup(device_);
  const DelayedInputRunner runner(setup, stream_);
  runner.enqueue(/*pdl=*/false, /*deliver=*/true);
  const std::vector<std::vector<uint8_t>> expected = runner.download_outputs();
  runner.enqueue(/*pdl=*/false, /*deliver=*/false);
  EXPECT_TRUE(runner.other_output_differs(expected))
      << "the op writes the same outputs from a poisoned " << setup.delayed.name
      << ": this case could not fail";

  constexpr int kRepetitions = 3;
  for (int rep = 0; rep < kRepetitions; ++rep) {
    runner.enqueue(/*pdl=*/true, /*deliver=*/true);
    runner.expect_outputs_equal(expected, "eager PDL run " + std::to_string(rep));
  }
  const CapturedGraph graph(stream_, [&] { runner.enqueue(/*pdl=*/true, /*deliver=*/true); });
  EXPECT_GE(graph.num_programmatic_edges(), 1);
  for (int rep = 0; rep < kRepetitions; ++rep) {
    graph.launch(stream_);
    runner.expect_outputs_equal(expected, "graph replay " + std::to_string(rep));
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, CudaPdl, testing::ValuesIn(pdl_cases()),
                         [](const testing::TestParamInfo<PdlCase>& info) {
                           return std::string(info.param.name);
                         });

// The mechanism itself, with a test-local consumer in a graph (both kernels submitted together, so
// the host's timing plays no part): read before griddepcontrol.wait, the delayed word is still the
// poison; read after it, the real value. If the first half failed, a missing wait in a library
// kernel could pass the cases above unnoticed. It needs the two kernels to overlap, which
// compute-sanitizer prevents (it serializes kernels): scripts/gpu_run.sh's sanitizer runs leave
// it out.
using CudaPdlProducer = PdlDeviceTest;

TEST_F(CudaPdlProducer, ExposesAReadBeforeTheWait) {
  constexpr int64_t kRealValue = 0x0123456789abcdefLL;
  for (bool wait : {false, true}) {
    SCOPED_TRACE(wait ? "reader waits" : "reader does not wait");
    const Tensor word = index_tensor(device_, DType::kInt64, {kRealValue});
    const Tensor seen = index_tensor(device_, DType::kInt64, {0});
    PdlSetup setup;
    setup.delayed = {"word", word.buffer};
    setup.outputs = {{"seen", seen.buffer}};
    const auto* src = static_cast<const int64_t*>(word.device_view().data);
    auto* dst = static_cast<int64_t*>(seen.device_view().data);
    setup.launch = [src, dst, wait](const Context& ctx) {
      cuda::launch_kernel("early_read_kernel", early_read_kernel, 1, 1, 0, cuda::launch_of(ctx),
                          src, dst, wait);
    };
    const DelayedInputRunner runner(setup, stream_);
    const CapturedGraph graph(stream_, [&] { runner.enqueue(/*pdl=*/true, /*deliver=*/true); });
    EXPECT_EQ(graph.num_programmatic_edges(), 1);
    graph.launch(stream_);
    const std::vector<uint8_t> got = seen.buffer->download();
    const std::vector<uint8_t> delivered = word.buffer->download();
    EXPECT_EQ(delivered, word.buffer->initial) << "the producer's copy";
    const std::vector<uint8_t> poison(got.size(), kDelayPoisonByte);
    EXPECT_EQ(got, wait ? word.buffer->initial : poison);
  }
}

}  // namespace
}  // namespace test
}  // namespace mlakv
