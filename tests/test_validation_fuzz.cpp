// mlakv tests: argument validation under systematic breakage. Each case builds a valid call on a
// backend's memory, breaks one argument in a way the contract forbids, and expects mlakv::Error
// whose message names that argument, with nothing written: every buffer (outputs, cache, in-place
// inputs, error counters) keeps its initial bytes. test_validation.cpp holds one hand-written case
// per rule; this file applies every rule below to every tensor of a few calls of every op (the
// fused op through mla_rope_cache, the unfused primitives, the three rmsnorm_quant ops, both
// gathers). Each call, unbroken, must be accepted, so that every refusal is its breakage's.
//
// The breakages of a tensor (the general rules of validate.cpp's Validator::tensor and
// rmsnorm_quant.cpp's validator, and the ops' dtype checks):
//   - one dim more (a trailing dim of size 1) or one fewer;
//   - a negative size;
//   - an innermost stride of 2, or a negative or zero outer stride (on a dim of size > 1);
//   - an unknown dtype, or one of the wrong kind (an integer type for values, a float for
//     indices);
//   - data misaligned for its dtype, or null for a view of bytes;
//   - another device than the op's. When the broken tensor is the first one checked, the op's
//     device comes from it and the message names the next tensor, so for this breakage only the
//     refusal and the untouched buffers are checked.
// And of the fused op's call: a negative token count, a host Td past T or negative, a negative or
// NaN eps, an unknown RoPE style, and a cache with a bad geometry, format, stride or null data.
// A refusal must name the broken argument as the argument at fault: "<op>: <name>: expected ...".
#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "fused_problem.h"

namespace mlakv {
namespace test {
namespace {

enum class Breakage {
  kMoreDims,
  kFewerDims,
  kNegativeSize,
  kInnerStride,
  kNegativeStride,
  kZeroStride,
  kUnknownDtype,
  kWrongKindDtype,
  kMisaligned,
  kNull,
  kOtherDevice,
};
// Every breakage, with its name for messages.
struct NamedBreakage {
  Breakage breakage;
  const char* name;
};
constexpr NamedBreakage kBreakages[] = {
    {Breakage::kMoreDims, "one dim more"},
    {Breakage::kFewerDims, "one dim fewer"},
    {Breakage::kNegativeSize, "a negative size"},
    {Breakage::kInnerStride, "innermost stride 2"},
    {Breakage::kNegativeStride, "a negative outer stride"},
    {Breakage::kZeroStride, "a zero outer stride"},
    {Breakage::kUnknownDtype, "an unknown dtype"},
    {Breakage::kWrongKindDtype, "a dtype of the wrong kind"},
    {Breakage::kMisaligned, "misaligned data"},
    {Breakage::kNull, "null data"},
    {Breakage::kOtherDevice, "another device"},
};

bool is_index_dtype(DType d) { return d == DType::kInt32 || d == DType::kInt64; }

// `t` broken by `b`, or false where the breakage does not apply to this view (a view it cannot
// break: an innermost dim of size 1 has no stride to break, a 1-byte dtype no alignment).
bool break_view(TensorView* t, Breakage b, Device op_device) {
  const int n = t->ndim;
  switch (b) {
    case Breakage::kMoreDims:
      if (n >= kMaxDims) return false;
      t->shape[n] = 1;
      t->stride[n] = 1;
      t->ndim = n + 1;
      return true;
    case Breakage::kFewerDims:
      if (n < 2) return false;  // no dims at all means absent, which optional views may be
      t->ndim = n - 1;
      return true;
    case Breakage::kNegativeSize:
      t->shape[n - 1] = -1;
      return true;
    case Breakage::kInnerStride:
      if (t->shape[n - 1] <= 1) return false;
      t->stride[n - 1] = 2;
      return true;
    case Breakage::kNegativeStride:
    case Breakage::kZeroStride:
      for (int d = 0; d + 1 < n; ++d) {
        if (t->shape[d] > 1) {
          t->stride[d] = b == Breakage::kZeroStride ? 0 : -t->stride[d];
          return true;
        }
      }
      return false;
    case Breakage::kUnknownDtype:
      t->dtype = static_cast<DType>(99);
      return true;
    case Breakage::kWrongKindDtype:
      t->dtype = is_index_dtype(t->dtype) ? DType::kFloat32 : DType::kInt32;
      return true;
    case Breakage::kMisaligned:
      if (dtype_size(t->dtype) < 2 || t->data == nullptr) return false;
      t->data = static_cast<char*>(t->data) + 1;
      return true;
    case Breakage::kNull:
      if (t->data == nullptr || t->numel() == 0) return false;
      t->data = nullptr;
      return true;
    case Breakage::kOtherDevice:
      t->device = op_device.type == DeviceType::kCPU ? Device{DeviceType::kCUDA, 0} : Device{};
      return true;
  }
  return false;
}

// Calls `call`, expecting mlakv::Error whose message puts `name` (when not empty) at fault.
void expect_refused(const std::function<void()>& call, const std::string& name,
                    const std::string& what) {
  SCOPED_TRACE(what);
  try {
    call();
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    if (!name.empty()) {
      EXPECT_NE(e.message().find(": " + name + ": "), std::string::npos)
          << "the message does not put " << name << " at fault: " << e.message();
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected mlakv::Error, got another exception: " << e.what();
  }
}

// Every buffer of `buffers` still holds its initial bytes, and the counters are 0.
void expect_untouched(const std::vector<Buffer*>& buffers, const ErrorCounts& counts,
                      const std::string& what) {
  SCOPED_TRACE(what);
  for (const Buffer* b : buffers) EXPECT_TRUE(buffer_unchanged(*b, "a buffer of the call"));
  EXPECT_EQ(counts_to_string(counts.read()), counts_to_string({0, 0, 0, 0}));
}

// The buffers of tensors (absent ones skipped) and of a cache.
std::vector<Buffer*> buffers_of(std::initializer_list<const Tensor*> tensors,
                                const TestCache* cache = nullptr) {
  std::vector<Buffer*> out;
  for (const Tensor* t : tensors) {
    if (t->present()) out.push_back(t->buffer.get());
  }
  if (cache != nullptr) {
    out.push_back(cache->data.get());
    if (cache->rope_data) out.push_back(cache->rope_data.get());
    if (cache->scale.present()) out.push_back(cache->scale.buffer.get());
  }
  return out;
}

// A call's tensors, by the names its messages use.
using Tensors = std::vector<std::pair<std::string, TensorView*>>;

// One valid call of an op: its params (device views, made afresh for every breakage), its tensors
// by the names its messages use, and how to run it.
template <typename Params>
struct Call {
  std::string label;
  std::function<Params()> params;
  std::function<Tensors(Params*)> tensors;
  std::function<void(const Params&, const Context&)> run;
  std::vector<Buffer*> buffers;  // every buffer the call reads or writes (restored after it)
};

// Breaks every present tensor of the call with every breakage that applies; returns how many
// broken calls were made (each one that is not refused is a failure already).
template <typename Params>
int break_every_tensor(const Call<Params>& call, Device device) {
  const ErrorCounts counts(device);
  Context ctx;
  ctx.error_counts = counts.device_ptr();
  int broken = 0;
  for (const NamedBreakage& b : kBreakages) {
    Params probe = call.params();
    const size_t num_tensors = call.tensors(&probe).size();
    int applied = 0;
    for (size_t i = 0; i < num_tensors; ++i) {
      Params p = call.params();
      auto [name, view] = call.tensors(&p)[i];
      if (!view->present() || !break_view(view, b.breakage, device)) continue;
      const std::string what = call.label + ": " + name + " with " + b.name;
      expect_refused([&] { call.run(p, ctx); }, b.breakage == Breakage::kOtherDevice ? "" : name,
                     what);
      expect_untouched(call.buffers, counts, what);
      ++applied;
    }
    // Every call has tensors of two dims, of 16-bit or wider elements, with rows: each breakage
    // applies to at least one of them.
    EXPECT_GT(applied, 0) << call.label << ": " << b.name << " applied to no tensor";
    broken += applied;
  }
  // The unbroken call is accepted, so that each refusal above was its breakage's. The buffers
  // then get their initial bytes back for the next call.
  EXPECT_NO_THROW(call.run(call.params(), ctx)) << call.label << ": the unbroken call";
  device_synchronize(device);
  for (Buffer* b : call.buffers) b->upload();
  return broken;
}

std::vector<Buffer*> buffers_of(const FusedProblem& f) {
  return buffers_of({&f.positions, &f.slot_mapping, &f.cos_sin, &f.kv_c, &f.k_pe, &f.weight,
                     &f.k_pe_out, &f.kv_c_out, &f.q_pe, &f.ql_nope, &f.q_out, &f.q_scale, &f.q,
                     &f.q_prefill_out, &f.device_td},
                    &f.cache);
}

// The tensors of a fused call, by the names its messages use.
Tensors tensors_of(MlaRopeCacheParams* p) {
  return {{"positions", &p->positions},
          {"slot_mapping", &p->slot_mapping},
          {"cos_sin_cache", &p->cos_sin_cache},
          {"kv_c", &p->kv_c},
          {"k_pe", &p->k_pe},
          {"kv_norm_weight", &p->kv_norm_weight},
          {"k_pe_out", &p->k_pe_out},
          {"kv_c_out", &p->kv_c_out},
          {"q_pe", &p->q_pe},
          {"ql_nope", &p->ql_nope},
          {"q_out", &p->q_out},
          {"q", &p->q},
          {"q_prefill_out", &p->q_prefill_out}};
}

std::vector<FusedSpec> fuzz_specs() {
  std::vector<FusedSpec> specs;
  FusedSpec s;
  s.name = "bf16_norm_outs";
  s.T = 9;
  s.Td = 4;
  s.norm = true;
  s.k_pe_out = true;
  s.kv_c_out = true;
  specs.push_back(s);

  s = FusedSpec{};
  s.name = "e4m3_qout_fp8_prefill_out";
  s.T = 6;
  s.Td = 2;
  s.cache.format = CacheFormat::kFloat8E4M3;
  s.cache.scale = 0.05f;
  s.q_out_dtype = DType::kFloat8E4M3;
  s.q_scale = 0.02f;
  s.prefill_out = true;
  s.index32 = true;
  specs.push_back(s);

  s = FusedSpec{};
  s.name = "dsmla_joint_kv_fp16_table";  // kv_c and k_pe: column views of one buffer
  s.T = 5;
  s.Td = 5;
  s.cache.format = CacheFormat::kFloat8DsMla;
  s.kv_a_fused = true;
  s.table_dtype = DType::kFloat16;
  specs.push_back(s);

  s = FusedSpec{};
  s.name = "fp16_split_cache_device_td";
  s.T = 7;
  s.Td = 3;
  s.model = DType::kFloat16;
  s.cache.format = CacheFormat::kFloat16;
  s.cache.split = true;
  s.device_td = true;
  s.device_td_value = 3;
  s.style = RopeStyle::kNeox;
  specs.push_back(s);
  return specs;
}

class ValidationFuzz : public testing::TestWithParam<Backend> {};

TEST_P(ValidationFuzz, FusedOpRefusesEveryBrokenTensor) {
  const Device dev = GetParam().device;
  int broken = 0;
  for (const FusedSpec& spec : fuzz_specs()) {
    const FusedProblem problem(spec, dev);
    const Call<MlaRopeCacheParams> call{
        spec.name, [&] { return problem.params(false); }, tensors_of,
        [](const MlaRopeCacheParams& p, const Context& ctx) { mla_rope_cache(p, ctx); },
        buffers_of(problem)};
    broken += break_every_tensor(call, dev);
  }
  EXPECT_GT(broken, 300);  // the breakages applied, not skipped
}

// The unfused primitives, on the tensors of a decode-only fused problem (whose shapes are theirs).
TEST_P(ValidationFuzz, UnfusedOpsRefuseEveryBrokenTensor) {
  const Device dev = GetParam().device;
  FusedSpec spec;
  spec.name = "decode";
  spec.T = 6;
  spec.Td = 6;
  spec.norm = true;
  spec.kv_c_out = true;
  const FusedProblem f(spec, dev);
  const int64_t T = spec.T, R = spec.shape.R;
  const std::vector<Buffer*> buffers = buffers_of(f);
  int broken = 0;

  const Call<ConcatAndCacheMlaParams> concat{
      "concat_and_cache_mla",
      [&] {
        ConcatAndCacheMlaParams p;
        p.num_tokens = T;
        p.kv_c = f.kv_c.device_view();
        p.k_pe = f.k_pe.device_view();
        p.slot_mapping = f.slot_mapping.device_view();
        p.kv_cache = f.cache.device_view();
        return p;
      },
      [](ConcatAndCacheMlaParams* p) -> Tensors {
        return {{"kv_c", &p->kv_c}, {"k_pe", &p->k_pe}, {"slot_mapping", &p->slot_mapping}};
      },
      [](const ConcatAndCacheMlaParams& p, const Context& ctx) { concat_and_cache_mla(p, ctx); },
      buffers};
  broken += break_every_tensor(concat, dev);

  const Call<DecodeQConcatParams> decode{
      "decode_q_concat",
      [&] {
        DecodeQConcatParams p;
        p.num_tokens = T;
        p.ql_nope = f.ql_nope.device_view();
        p.q_pe = f.q_pe.device_view();
        p.q_out = f.q_out.device_view();
        return p;
      },
      [](DecodeQConcatParams* p) -> Tensors {
        return {{"ql_nope", &p->ql_nope}, {"q_pe", &p->q_pe}, {"q_out", &p->q_out}};
      },
      [](const DecodeQConcatParams& p, const Context& ctx) { decode_q_concat(p, ctx); }, buffers};
  broken += break_every_tensor(decode, dev);

  const Call<RotaryEmbeddingParams> rotary{
      "rotary_embedding",
      [&] {
        RotaryEmbeddingParams p;
        p.num_tokens = T;
        p.positions = f.positions.device_view();
        p.query = f.q_pe.device_view();
        p.key = f.k_pe.view(f.k_pe.offset, {f.rows, 1, R}, {f.k_pe.stride[0], R, 1}).device_view();
        p.cos_sin_cache = f.cos_sin.device_view();
        return p;
      },
      [](RotaryEmbeddingParams* p) -> Tensors {
        return {{"positions", &p->positions},
                {"query", &p->query},
                {"key", &p->key},
                {"cos_sin_cache", &p->cos_sin_cache}};
      },
      [](const RotaryEmbeddingParams& p, const Context& ctx) { rotary_embedding(p, ctx); },
      buffers};
  broken += break_every_tensor(rotary, dev);

  const Call<RmsNormParams> norm{
      "rms_norm",
      [&] {
        RmsNormParams p;
        p.num_tokens = T;
        p.input = f.kv_c.device_view();
        p.weight = f.weight.device_view();
        p.output = f.kv_c_out.device_view();
        return p;
      },
      [](RmsNormParams* p) -> Tensors {
        return {{"input", &p->input}, {"weight", &p->weight}, {"output", &p->output}};
      },
      [](const RmsNormParams& p, const Context& ctx) { rms_norm(p, ctx); }, buffers};
  broken += break_every_tensor(norm, dev);
  EXPECT_GT(broken, 100);
}

// rmsnorm_quant with a residual and a normalized output, its scales row- or column-major, at
// T = 5 and T = 1 (where only the first of the tensors' rows is used), two padding rows after T.
TEST_P(ValidationFuzz, RmsNormQuantRefusesEveryBrokenTensor) {
  const Device dev = GetParam().device;
  std::mt19937_64 rng(71);
  int broken = 0;
  for (const int64_t T : {int64_t{5}, int64_t{1}}) {
    for (const int64_t N : {int64_t{1536}, int64_t{512}}) {
      for (const bool column_major : {false, true}) {
        const int64_t rows = T + 2, G = 128;
        const Tensor x = random_tensor(dev, DType::kBFloat16, {rows, N}, rng);
        const Tensor w = random_tensor(dev, DType::kBFloat16, {N}, rng);
        const Tensor residual = random_tensor(dev, DType::kBFloat16, {rows, N}, rng);
        const Tensor normed = poisoned_tensor(dev, DType::kBFloat16, {rows, N});
        const Tensor values = poisoned_tensor(dev, DType::kFloat8E4M3, {rows, N});
        const int64_t S = rows + 1;  // column-major: groups S floats apart
        const Tensor scale_buffer = poisoned_tensor(dev, DType::kFloat32, {(N / G) * S});
        const Tensor scales = column_major ? scale_buffer.view(0, {rows, N / G}, {1, S})
                                           : scale_buffer.view(0, {rows, N / G}, {N / G, 1});
        const Call<RmsNormQuantParams> call{
            "T " + std::to_string(T) + " N " + std::to_string(N) +
                (column_major ? " column-major" : " row-major"),
            [&] {
              RmsNormQuantParams p;
              p.num_tokens = T;
              p.input = x.device_view();
              p.weight = w.device_view();
              p.residual = residual.device_view();
              p.normed_out = normed.device_view();
              p.quant.values = values.device_view();
              p.quant.scales = scales.device_view();
              p.quant.group_size = G;
              return p;
            },
            [](RmsNormQuantParams* p) -> Tensors {
              return {{"input", &p->input},
                      {"weight", &p->weight},
                      {"residual", &p->residual},
                      {"normed_out", &p->normed_out},
                      {"quant.values", &p->quant.values},
                      {"quant.scales", &p->quant.scales}};
            },
            [](const RmsNormQuantParams& p, const Context& ctx) { rmsnorm_quant(p, ctx); },
            buffers_of({&x, &w, &residual, &normed, &values, &scale_buffer})};
        broken += break_every_tensor(call, dev);

        const Call<PerTokenGroupQuantParams> quant{
            call.label + " per_token_group_quant_fp8",
            [&] {
              PerTokenGroupQuantParams p;
              p.num_tokens = T;
              p.input = x.device_view();
              p.quant = call.params().quant;
              return p;
            },
            [](PerTokenGroupQuantParams* p) -> Tensors {
              return {{"input", &p->input},
                      {"quant.values", &p->quant.values},
                      {"quant.scales", &p->quant.scales}};
            },
            [](const PerTokenGroupQuantParams& p, const Context& ctx) {
              per_token_group_quant_fp8(p, ctx);
            },
            call.buffers};
        broken += break_every_tensor(quant, dev);

        // The dual form: this call as its q part (no residual or normalized output), and the
        // residual's rows normalized into normed_out as its kv part.
        const Call<MlaRmsNormQuantParams> dual{
            call.label + " mla_rmsnorm_quant",
            [&] {
              MlaRmsNormQuantParams p;
              p.q = call.params();
              p.q.residual = TensorView{};
              p.q.normed_out = TensorView{};
              p.kv.num_tokens = T;
              p.kv.input = residual.device_view();
              p.kv.weight = w.device_view();
              p.kv.output = normed.device_view();
              return p;
            },
            [](MlaRmsNormQuantParams* p) -> Tensors {
              return {{"q.input", &p->q.input},
                      {"q.weight", &p->q.weight},
                      {"q.quant.values", &p->q.quant.values},
                      {"q.quant.scales", &p->q.quant.scales},
                      {"kv.input", &p->kv.input},
                      {"kv.weight", &p->kv.weight},
                      {"kv.output", &p->kv.output}};
            },
            [](const MlaRmsNormQuantParams& p, const Context& ctx) { mla_rmsnorm_quant(p, ctx); },
            call.buffers};
        broken += break_every_tensor(dual, dev);
      }
    }
  }
  EXPECT_GT(broken, 800);
}

// Both gathers, from a split fp8 cache and a combined fp8_ds_mla one.
TEST_P(ValidationFuzz, GathersRefuseEveryBrokenTensor) {
  const Device dev = GetParam().device;
  std::mt19937_64 rng(73);
  int broken = 0;
  for (const CacheFormat format : {CacheFormat::kFloat8E4M3, CacheFormat::kFloat8DsMla}) {
    CacheGeometry g;
    g.format = format;
    g.split = format == CacheFormat::kFloat8E4M3;
    g.scale = g.split ? 0.05f : 0.0f;
    g.num_blocks = 4;
    g.block_size = 16;
    TestCache cache = new_cache(dev, g);
    fill_cache_with_entries(dev, cache, rng);
    const int64_t D = g.L + g.R;
    const Tensor slots = index_tensor(dev, DType::kInt64, {3, 60, -1, 17, 0});
    const Tensor out = poisoned_tensor(dev, DType::kFloat32, {5, D});
    const Call<GatherCacheSlotsParams> slots_call{
        std::string(cache_format_name(format)) + " slots",
        [&] {
          GatherCacheSlotsParams p;
          p.num_tokens = 5;
          p.kv_cache = cache.device_view();
          p.slots = slots.device_view();
          p.out = out.device_view();
          return p;
        },
        [](GatherCacheSlotsParams* p) -> Tensors {
          return {{"slots", &p->slots}, {"out", &p->out}};
        },
        [](const GatherCacheSlotsParams& p, const Context& ctx) { gather_cache_slots(p, ctx); },
        buffers_of({&slots, &out}, &cache)};
    broken += break_every_tensor(slots_call, dev);

    const Tensor table = index_tensor(dev, DType::kInt32, {2, 0, 3, 1}).view(0, {2, 2}, {2, 1});
    const Tensor cu = index_tensor(dev, DType::kInt32, {0, 20, 29});
    const Tensor seq_out = poisoned_tensor(dev, DType::kBFloat16, {29, D});
    const Call<GatherCacheSequencesParams> seq_call{
        std::string(cache_format_name(format)) + " sequences",
        [&] {
          GatherCacheSequencesParams p;
          p.num_seqs = 2;
          p.kv_cache = cache.device_view();
          p.block_table = table.device_view();
          p.cu_seq_lens = cu.device_view();
          p.out = seq_out.device_view();
          return p;
        },
        [](GatherCacheSequencesParams* p) -> Tensors {
          return {
              {"block_table", &p->block_table}, {"cu_seq_lens", &p->cu_seq_lens}, {"out", &p->out}};
        },
        [](const GatherCacheSequencesParams& p, const Context& ctx) {
          gather_cache_sequences(p, ctx);
        },
        buffers_of({&table, &cu, &seq_out}, &cache)};
    broken += break_every_tensor(seq_call, dev);
  }
  EXPECT_GT(broken, 60);
}

// The call's other arguments: counts, eps, the RoPE style and the cache.
TEST_P(ValidationFuzz, FusedOpRefusesEveryBrokenScalarAndCache) {
  const Device dev = GetParam().device;
  for (const FusedSpec& spec : fuzz_specs()) {
    const FusedProblem problem(spec, dev);
    const int64_t T = spec.T;
    const std::vector<std::pair<std::string, std::function<void(MlaRopeCacheParams*)>>> breaks = {
        {"num_tokens", [](MlaRopeCacheParams* p) { p->num_tokens = -1; }},
        {"num_decode_tokens", [&](MlaRopeCacheParams* p) { p->num_decode_tokens = T + 1; }},
        {"num_decode_tokens", [](MlaRopeCacheParams* p) { p->num_decode_tokens = -1; }},
        {"kv_norm_eps", [](MlaRopeCacheParams* p) { p->kv_norm_eps = -1.0f; }},
        {"kv_norm_eps",
         [](MlaRopeCacheParams* p) { p->kv_norm_eps = std::numeric_limits<float>::quiet_NaN(); }},
        {"rope_style", [](MlaRopeCacheParams* p) { p->rope_style = static_cast<RopeStyle>(7); }},
        {"kv_cache", [](MlaRopeCacheParams* p) { p->kv_cache.block_size = 0; }},
        {"kv_cache", [](MlaRopeCacheParams* p) { p->kv_cache.num_blocks = -1; }},
        {"kv_cache",
         [](MlaRopeCacheParams* p) { p->kv_cache.format = static_cast<CacheFormat>(42); }},
        {"kv_cache", [](MlaRopeCacheParams* p) { p->kv_cache.data = nullptr; }},
        {"kv_cache", [](MlaRopeCacheParams* p) { p->kv_cache.stride_token_bytes = -1; }},
    };
    for (const auto& [name, apply] : breaks) {
      MlaRopeCacheParams p = problem.params(false);
      // eps is looked at only with a norm weight. A host Td out of range is refused beside a
      // device Td too (it must be 0 there).
      if (name == "kv_norm_eps" && !p.kv_norm_weight.present()) continue;
      apply(&p);
      const std::string what = spec.name + ": " + name;
      Context ctx;
      ctx.error_counts = problem.counts.device_ptr();
      expect_refused([&] { mla_rope_cache(p, ctx); }, name, what);
      expect_untouched(buffers_of(problem), problem.counts, what);
    }
    Context ctx;
    ctx.error_counts = problem.counts.device_ptr();
    EXPECT_NO_THROW(mla_rope_cache(problem.params(false), ctx)) << spec.name << ": unbroken";
  }
}

INSTANTIATE_TEST_SUITE_P(All, ValidationFuzz, testing::ValuesIn(all_backends()),
                         backend_param_name);

}  // namespace
}  // namespace test
}  // namespace mlakv
