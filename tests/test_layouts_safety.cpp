// mlakv tests: the fused op on strided / aliased layouts, split and padded caches, and the safety
// rules (padding slots, slots past the cache, positions past the table, device Td, rows >= T,
// checked mode, for every counter), always against the reference and with exact error counts.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/validate.h"
#include "fused_problem.h"

namespace mlakv {
namespace test {
namespace {

FusedSpec named(const std::string& name, CacheFormat format = CacheFormat::kBFloat16,
                float scale = 0.0f) {
  static uint64_t seed = 500;
  FusedSpec s;
  s.name = name;
  s.T = 33;
  s.Td = 13;
  s.cache.format = format;
  s.cache.scale = scale;
  s.k_pe_out = true;
  s.kv_c_out = true;
  s.seed = seed++;
  return s;
}

std::vector<FusedSpec> layout_specs() {
  std::vector<FusedSpec> out;
  {
    FusedSpec s = named("kv_a_columns");
    s.kv_a_fused = true;
    out.push_back(s);
    s = named("kv_a_columns_padded_in_place_norm");
    s.kv_a_fused = true;
    s.row_pad = 8;
    s.outs_in_place = true;
    s.norm = true;
    out.push_back(s);
  }
  for (int64_t pad : {8, 3}) {
    FusedSpec s = named("row_pad" + std::to_string(pad));
    s.row_pad = pad;
    s.prefill_out = pad == 3;
    out.push_back(s);
  }
  {
    FusedSpec s = named("q_pe_view_of_q");
    s.q_pe_in_q = true;
    out.push_back(s);
    s = named("q_pe_view_of_q_fp8_qout");
    s.q_pe_in_q = true;
    s.q_out_dtype = DType::kFloat8E4M3;
    s.q_scale = 0.02f;
    out.push_back(s);
    s = named("q_pe_head_major");
    s.q_pe_head_major = true;
    out.push_back(s);
    s = named("q_pe_head_major_neox_minicpm3");
    s.shape = kMiniCpm3;
    s.q_pe_head_major = true;
    s.style = RopeStyle::kNeox;
    out.push_back(s);
  }
  {
    FusedSpec s = named("index32");
    s.index32 = true;
    out.push_back(s);
    s = named("no_extra_rows");
    s.extra_rows = 0;
    out.push_back(s);
    s = named("many_extra_rows");
    s.extra_rows = 40;
    out.push_back(s);
    s = named("decode_rows_exactly_td");
    s.decode_rows_exact = true;
    out.push_back(s);
  }
  // Split latent / rope caches, contiguous and with custom (padded) strides.
  struct F {
    const char* name;
    CacheFormat format;
    float scale;
  };
  const F split_formats[] = {{"bf16", CacheFormat::kBFloat16, 0.0f},
                             {"fp16", CacheFormat::kFloat16, 0.0f},
                             {"fp32", CacheFormat::kFloat32, 0.0f},
                             {"e4m3", CacheFormat::kFloat8E4M3, 0.037f},
                             {"e5m2", CacheFormat::kFloat8E5M2, 0.037f}};
  for (const F& f : split_formats) {
    for (bool padded : {false, true}) {
      FusedSpec s =
          named(std::string("split_") + f.name + (padded ? "_padded" : ""), f.format, f.scale);
      s.cache.split = true;
      s.cache.block_size = padded ? 7 : 16;
      if (padded) {
        s.cache.token_pad_bytes = 32;
        s.cache.block_pad_bytes = 96;
      }
      s.norm = padded;
      out.push_back(s);
    }
  }
  const F combined_formats[] = {{"bf16", CacheFormat::kBFloat16, 0.0f},
                                {"e4m3", CacheFormat::kFloat8E4M3, 0.037f},
                                {"dsmla", CacheFormat::kFloat8DsMla, 0.0f}};
  for (const F& f : combined_formats) {
    FusedSpec s = named(std::string("combined_padded_") + f.name, f.format, f.scale);
    s.cache.token_pad_bytes = 16;
    s.cache.block_pad_bytes = 48;
    s.cache.block_size = 64;
    s.norm = true;
    out.push_back(s);
  }
  // Every per-head tensor's heads padded, the outputs' differently from the inputs': every head
  // stride differs from the packed one and from every other tensor's.
  {
    FusedSpec s = named("heads_padded");
    s.out_head_pad = 8;
    s.in_head_pad = 16;
    s.row_pad = 3;
    s.prefill_out = true;
    out.push_back(s);
    s = named("heads_padded_fp8_qout");
    s.out_head_pad = 16;
    s.q_out_dtype = DType::kFloat8E4M3;
    s.q_scale = 0.02f;
    out.push_back(s);
  }
  return out;
}

std::vector<FusedSpec> safety_specs() {
  std::vector<FusedSpec> out;
  for (CacheFormat f :
       {CacheFormat::kBFloat16, CacheFormat::kFloat8E4M3, CacheFormat::kFloat8DsMla}) {
    const std::string fname = cache_format_name(f);
    FusedSpec s = named("padding_" + fname, f, 0.037f);
    s.padding_every = 3;
    out.push_back(s);
    s = named("bad_slots_" + fname, f, 0.037f);
    s.bad_slots = 5;
    out.push_back(s);
    s = named("bad_positions_" + fname, f, 0.037f);
    s.bad_positions = 4;
    out.push_back(s);
    s = named("all_bad_" + fname, f, 0.037f);
    s.padding_every = 4;
    s.bad_slots = 3;
    s.bad_positions = 5;
    s.cache.block_size = 1;
    out.push_back(s);
    s.name = "all_bad_index32_" + fname;
    s.index32 = true;
    out.push_back(s);
  }
  // Blocks of one entry with a token stride that no entry could use (3 bytes: below an entry and
  // misaligned): the stride of a size-1 dim is never used, so the op takes it and writes the
  // same bytes as with a packed one.
  for (CacheFormat f :
       {CacheFormat::kBFloat16, CacheFormat::kFloat8E4M3, CacheFormat::kFloat8DsMla}) {
    FusedSpec s = named("unused_token_stride_" + std::string(cache_format_name(f)), f, 0.037f);
    s.cache.block_size = 1;
    s.cache.unused_stride_bytes = 3;
    s.padding_every = 4;
    out.push_back(s);
  }
  {
    FusedSpec s = named("unused_token_stride_split_bf16");
    s.cache.split = true;
    s.cache.block_size = 1;
    s.cache.unused_stride_bytes = 3;
    out.push_back(s);
    // Negative, as a tensor's size-1 dim may have (docs/decisions.md, "Strides and sizes").
    s.name = "unused_token_stride_negative_split_bf16";
    s.cache.unused_stride_bytes = -3;
    out.push_back(s);
  }
  {
    FusedSpec s = named("all_padding");
    s.padding_every = 1;
    out.push_back(s);
  }
  // Td from a device int32: 0, T, in between, too large and negative (both clamped, counted).
  for (int32_t td : {0, 33, 13, 1000, -3}) {
    FusedSpec s = named("device_td_" + std::to_string(td < 0 ? 1000 - td : td));
    s.device_td = true;
    s.device_td_value = td;
    s.Td = 5;  // the host value is ignored when the device one is given
    out.push_back(s);
  }
  {
    FusedSpec s = named("device_td_mixed_entry_padding");
    s.entry = Entry::kMixed;
    s.device_td = true;
    s.device_td_value = 20;
    s.padding_every = 5;
    s.bad_positions = 2;
    out.push_back(s);
  }
  // The decode and prefill entry points fix Td: a device Td given to them is not read (neither
  // used nor counted, even out of range).
  for (int32_t td : {4, -3}) {
    const std::string v = td < 0 ? "neg" : std::to_string(td);
    FusedSpec s = named("device_td_" + v + "_ignored_by_decode");
    s.entry = Entry::kDecode;
    s.device_td = true;
    s.device_td_value = td;
    out.push_back(s);
    s = named("device_td_" + v + "_ignored_by_prefill");
    s.entry = Entry::kPrefill;
    s.device_td = true;
    s.device_td_value = td;
    out.push_back(s);
  }
  return out;
}

using Param = std::tuple<Backend, FusedSpec>;

class FusedLayouts : public testing::TestWithParam<Param> {};

TEST_P(FusedLayouts, MatchesReference) {
  run_fused_case(std::get<1>(GetParam()), std::get<0>(GetParam()).device);
}

std::string param_name(const testing::TestParamInfo<Param>& info) {
  return std::get<0>(info.param).name + "_" + std::get<1>(info.param).name;
}

INSTANTIATE_TEST_SUITE_P(Layouts, FusedLayouts,
                         testing::Combine(testing::ValuesIn(all_backends()),
                                          testing::ValuesIn(layout_specs())),
                         param_name);
INSTANTIATE_TEST_SUITE_P(Safety, FusedLayouts,
                         testing::Combine(testing::ValuesIn(all_backends()),
                                          testing::ValuesIn(safety_specs())),
                         param_name);

// Context::checked turns a counted problem into an mlakv::Error (after the op ran).
class CheckedMode : public testing::TestWithParam<Backend> {};

TEST_P(CheckedMode, ThrowsWhenSomethingWasCounted) {
  FusedSpec s = named("checked_bad_slot");
  s.bad_slots = 1;
  FusedProblem problem(s, GetParam().device);
  EXPECT_THROW(problem.run_library(/*checked=*/true), Error);

  FusedSpec p = named("checked_bad_position");
  p.bad_positions = 1;
  FusedProblem problem2(p, GetParam().device);
  EXPECT_THROW(problem2.run_library(/*checked=*/true), Error);

  // Every counter: a device Td past T (clamped), and the gathers' bad slot and bad block id. The
  // message names the counter that grew.
  auto expect_counted = [](const char* counter, const std::function<void()>& run) {
    try {
      run();
      ADD_FAILURE() << "checked mode did not throw for " << counter;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string(counter) + " +1"), std::string::npos)
          << e.what();
    }
  };
  FusedSpec td = named("checked_device_td");
  td.device_td = true;
  td.device_td_value = static_cast<int32_t>(td.T) + 1000;
  FusedProblem problem3(td, GetParam().device);
  expect_counted("bad_decode_count", [&] { problem3.run_library(/*checked=*/true); });

  const Device dev = GetParam().device;
  std::mt19937_64 rng(71);
  CacheGeometry g;
  g.num_blocks = 3;
  g.block_size = 4;
  TestCache cache = new_cache(dev, g);
  fill_cache_with_entries(dev, cache, rng);
  const int64_t D = g.L + g.R;
  ErrorCounts counts(dev);
  Context ctx;
  ctx.error_counts = counts.device_ptr();
  ctx.checked = true;
  Tensor slots = index_tensor(dev, DType::kInt64, {0, cache.num_slots()});
  Tensor out = poisoned(padded_rows(dev, DType::kFloat32, 2, D, 0));
  GatherCacheSlotsParams gs;
  gs.num_tokens = 2;
  gs.kv_cache = cache.device_view();
  gs.slots = slots.device_view();
  gs.out = out.device_view();
  expect_counted("bad_slot", [&] { gather_cache_slots(gs, ctx); });
  Tensor block_table = index_tensor(dev, DType::kInt32, {g.num_blocks}).view(0, {1, 1}, {1, 1});
  Tensor cu_seq_lens = index_tensor(dev, DType::kInt32, {0, 1});
  GatherCacheSequencesParams gq;
  gq.num_seqs = 1;
  gq.kv_cache = cache.device_view();
  gq.block_table = block_table.device_view();
  gq.cu_seq_lens = cu_seq_lens.device_view();
  gq.out = out.device_view();
  expect_counted("bad_block_index", [&] { gather_cache_sequences(gq, ctx); });
}

TEST_P(CheckedMode, SilentWhenNothingWasCounted) {
  FusedSpec s = named("checked_clean");
  s.padding_every = 3;  // padding is not an error
  FusedProblem problem(s, GetParam().device);
  problem.run_reference();
  EXPECT_NO_THROW(problem.run_library(/*checked=*/true));
  problem.expect_matches();
}

TEST_P(CheckedMode, ReadErrorCountsThrowsIfAsked) {
  FusedSpec s = named("read_counts_bad_slot");
  s.bad_slots = 2;
  FusedProblem problem(s, GetParam().device);
  problem.run_library();
  int32_t host[kNumErrorCounters];
  EXPECT_THROW(read_error_counts(problem.counts.device_ptr(), GetParam().device, host, nullptr,
                                 /*throw_if_nonzero=*/true),
               Error);
  EXPECT_EQ(host[kBadSlot], 2);
  reset_error_counts(problem.counts.device_ptr(), GetParam().device);
  EXPECT_EQ(counts_to_string(problem.counts.read()), counts_to_string({0, 0, 0, 0}));
}

// read_error_counts and reset_error_counts cover every counter of the backend's memory, the last
// one included.
TEST_P(CheckedMode, ReadAndResetEveryCounter) {
  ErrorCounts counts(GetParam().device);
  int32_t* host_mirror = reinterpret_cast<int32_t*>(counts.tensor.buffer->host.data());
  for (int32_t i = 0; i < kNumErrorCounters; ++i) host_mirror[i] = 10 + i;
  counts.tensor.buffer->upload();
  EXPECT_EQ(counts_to_string(counts.read()), counts_to_string({10, 11, 12, 13}));
  reset_error_counts(counts.device_ptr(), GetParam().device);
  EXPECT_EQ(counts_to_string(counts.read()), counts_to_string({0, 0, 0, 0}));
}

INSTANTIATE_TEST_SUITE_P(All, CheckedMode, testing::ValuesIn(all_backends()), backend_param_name);

// Without ctx.error_counts (no counter array to write) every problem is still handled as usual: a
// device Td outside [0, T] is clamped, bad slots skipped, bad positions clamped (the reference's
// bytes), and nothing dereferences the absent counters (the CPU backend's null check, the CUDA
// kernel's; under compute-sanitizer on the GPU).
class NoCounters : public testing::TestWithParam<Backend> {};

TEST_P(NoCounters, DeviceTdClampedBadSlotsAndPositionsHandled) {
  for (int32_t td : {1000, -3}) {
    FusedSpec s = named("no_counters_device_td_" + std::to_string(td));
    s.device_td = true;
    s.device_td_value = td;
    s.bad_slots = 2;
    s.bad_positions = 2;
    SCOPED_TRACE(s.name);
    FusedProblem problem(s, GetParam().device);
    problem.run_reference();
    problem.launch(Context{});
    problem.expect_matches();
  }
}

INSTANTIATE_TEST_SUITE_P(All, NoCounters, testing::ValuesIn(all_backends()), backend_param_name);

// ---- strides of size-1 dims ---------------------------------------------------------------------
// A size-1 dim's stride is never used for addressing and may be anything (PyTorch gives kv_c
// [512, 1].t() the strides (1, 1)). Validation hands the backends the canonical stride
// (core::canonical_stride) instead, so that no launcher test of the strides it gets (the CUDA
// launchers' 16-byte vector test, the copy lists' one-run test) sees the caller's value: a junk
// stride there must give the backends exactly the arguments of the contiguous tensor.

// One head (the head stride unused) of DeepSeek-V3's widths.
constexpr ModelShape kOneHead{"h1", 1, 512, 64, 128};

// The unused-stride specs: one token of per-token tensors of one row (every token stride unused),
// decode and prefill, and a head count of 1 over several tokens, packed and with padded rows.
std::vector<FusedSpec> unused_stride_specs() {
  FusedSpec s = named("one_token_decode");
  s.shape = kOneHead;
  s.T = 1;
  s.Td = 1;
  s.extra_rows = 0;
  s.norm = true;
  s.prefill_out = true;
  std::vector<FusedSpec> out = {s};
  s.name = "one_token_prefill";
  s.Td = 0;
  out.push_back(s);
  s = named("one_head");
  s.shape = kOneHead;
  s.T = 5;
  s.Td = 3;
  s.prefill_out = true;
  out.push_back(s);
  s.name = "one_head_padded_rows";
  s.row_pad = 8;
  out.push_back(s);
  return out;
}

core::MlaRopeCacheArgs fused_args(const MlaRopeCacheParams& p) {
  Device device;
  return core::validate_mla_rope_cache("mla_rope_cache", p, Context{}, &device);
}

// Every stride of the fused op's args (those of the cache included).
void expect_same_strides(const core::MlaRopeCacheArgs& got, const core::MlaRopeCacheArgs& want) {
#define MLAKV_EXPECT_FIELD(field) EXPECT_EQ(got.field, want.field) << #field
  MLAKV_EXPECT_FIELD(positions.stride);
  MLAKV_EXPECT_FIELD(slot_mapping.stride);
  MLAKV_EXPECT_FIELD(rope.stride_pos);
  MLAKV_EXPECT_FIELD(stride_kv_c_token);
  MLAKV_EXPECT_FIELD(stride_k_pe_token);
  MLAKV_EXPECT_FIELD(stride_k_pe_out_token);
  MLAKV_EXPECT_FIELD(stride_kv_c_out_token);
  MLAKV_EXPECT_FIELD(stride_q_pe_token);
  MLAKV_EXPECT_FIELD(stride_q_pe_head);
  MLAKV_EXPECT_FIELD(stride_ql_nope_token);
  MLAKV_EXPECT_FIELD(stride_ql_nope_head);
  MLAKV_EXPECT_FIELD(stride_q_out_token);
  MLAKV_EXPECT_FIELD(stride_q_out_head);
  MLAKV_EXPECT_FIELD(stride_q_token);
  MLAKV_EXPECT_FIELD(stride_q_head);
  MLAKV_EXPECT_FIELD(stride_q_prefill_out_token);
  MLAKV_EXPECT_FIELD(stride_q_prefill_out_head);
  MLAKV_EXPECT_FIELD(cache.stride_block_bytes);
  MLAKV_EXPECT_FIELD(cache.stride_token_bytes);
#undef MLAKV_EXPECT_FIELD
}

TEST(UnusedStrides, FusedArgsEqualTheContiguousTensors) {
  for (const FusedSpec& spec : unused_stride_specs()) {
    SCOPED_TRACE(spec.name);
    const FusedProblem problem(spec, Device{});
    const MlaRopeCacheParams p = problem.params(false);
    const core::MlaRopeCacheArgs want = fused_args(p);
    for (const int64_t junk : {int64_t{1}, int64_t{3}, int64_t{-5}}) {
      SCOPED_TRACE("junk stride " + std::to_string(junk));
      const core::MlaRopeCacheArgs got = fused_args(with_unused_strides(p, junk));
      expect_same_strides(got, want);
      // One head: the head stride is the token stride's, so the rows of a padded tensor stay one
      // run (cuda/mla_rope_cache.cu make_copy_list).
      if (spec.shape.H == 1 && spec.T > 1) {
        EXPECT_EQ(got.stride_ql_nope_head, got.stride_ql_nope_token);
        EXPECT_EQ(got.stride_q_out_head, got.stride_q_out_token);
        EXPECT_EQ(got.stride_q_head, got.stride_q_token);
        EXPECT_EQ(got.stride_q_prefill_out_head, got.stride_q_prefill_out_token);
      }
    }
    if (spec.T == 1) {  // the contiguous strides themselves
      EXPECT_EQ(want.stride_kv_c_token, spec.shape.L);
      EXPECT_EQ(want.stride_q_out_token, spec.shape.L + spec.shape.R);
      EXPECT_EQ(want.stride_q_out_head, spec.shape.L + spec.shape.R);
    }
  }
}

// The issue's own tensor: kv_c [1, 512] bf16 with strides (1, 1) (a transposed [512, 1]).
TEST(UnusedStrides, TransposedKvCGetsTheRowStride) {
  FusedSpec spec = unused_stride_specs()[0];
  const FusedProblem problem(spec, Device{});
  MlaRopeCacheParams p = problem.params(false);
  p.kv_c = make_strided_view(p.kv_c.data, DType::kBFloat16, {1, 512}, {1, 1});
  EXPECT_EQ(fused_args(p).stride_kv_c_token, 512);
}

TEST(UnusedStrides, GatherArgsEqualTheContiguousTensors) {
  CacheGeometry g;
  g.num_blocks = 4;
  const TestCache cache = new_cache(Device{}, g);
  const Tensor out = poisoned_tensor(Device{}, DType::kBFloat16, {1, g.L + g.R});
  const Tensor slots = index_tensor(Device{}, DType::kInt64, {5});
  const Tensor block_table = new_tensor(Device{}, DType::kInt32, {1, 3});  // not read
  const Tensor cu_seq_lens = index_tensor(Device{}, DType::kInt32, {0, 1});
  GatherCacheSlotsParams s;
  s.num_tokens = 1;
  s.kv_cache = cache.device_view();
  s.slots = slots.device_view();
  s.out = out.device_view();
  GatherCacheSequencesParams q;
  q.num_seqs = 1;
  q.kv_cache = cache.device_view();
  q.block_table = block_table.device_view();
  q.cu_seq_lens = cu_seq_lens.device_view();
  q.out = out.device_view();
  Device device;
  const core::GatherCacheArgs want_slots =
      core::validate_gather_cache_slots("gather_cache_slots", s, Context{}, &device);
  const core::GatherCacheArgs want_seqs =
      core::validate_gather_cache_sequences("gather_cache_sequences", q, Context{}, &device);
  for (const int64_t junk : {int64_t{1}, int64_t{3}}) {
    SCOPED_TRACE("junk stride " + std::to_string(junk));
    GatherCacheSlotsParams js = s;
    js.slots = with_unused_strides(s.slots, junk);
    js.out = with_unused_strides(s.out, junk);
    const core::GatherCacheArgs got_slots =
        core::validate_gather_cache_slots("gather_cache_slots", js, Context{}, &device);
    EXPECT_EQ(got_slots.stride_out_token, want_slots.stride_out_token);
    EXPECT_EQ(got_slots.slots.stride, want_slots.slots.stride);
    GatherCacheSequencesParams jq = q;
    jq.block_table = with_unused_strides(q.block_table, junk);
    jq.out = with_unused_strides(q.out, junk);
    const core::GatherCacheArgs got_seqs =
        core::validate_gather_cache_sequences("gather_cache_sequences", jq, Context{}, &device);
    EXPECT_EQ(got_seqs.stride_block_table_seq, want_seqs.stride_block_table_seq);
    EXPECT_EQ(got_seqs.stride_out_token, want_seqs.stride_out_token);
  }
  EXPECT_EQ(want_slots.stride_out_token, g.L + g.R);
  EXPECT_EQ(want_seqs.stride_block_table_seq, 3);
}

// The bytes: junk strides of size-1 dims give every output byte (q_out, the cache, the optional
// outputs, q / q_prefill_out) the contiguous tensors give, and the reference's.
class UnusedStridesOutputs : public testing::TestWithParam<Backend> {};

TEST_P(UnusedStridesOutputs, FusedOutputsEqualTheContiguousTensors) {
  for (const FusedSpec& spec : unused_stride_specs()) {
    for (const int64_t junk : {int64_t{1}, int64_t{3}}) {
      SCOPED_TRACE(spec.name + ", junk stride " + std::to_string(junk));
      FusedProblem contiguous(spec, GetParam().device);
      contiguous.run_library();
      FusedProblem junked(spec, GetParam().device);
      junked.run_reference();
      Context ctx;
      ctx.error_counts = junked.counts.device_ptr();
      mla_rope_cache(with_unused_strides(junked.params(false), junk), ctx);
      EXPECT_EQ(counts_to_string(junked.counts.read()), counts_to_string({0, 0, 0, 0}));
      junked.expect_matches();
      const auto same = [](const Tensor& a, const Tensor& b, const char* what) {
        if (!a.present()) return;
        EXPECT_TRUE(bytes_equal(b.buffer->download(), a.buffer->download(), what));
      };
      same(contiguous.q_out, junked.q_out, "q_out");
      same(contiguous.q, junked.q, "q");
      same(contiguous.q_prefill_out, junked.q_prefill_out, "q_prefill_out");
      same(contiguous.k_pe_out, junked.k_pe_out, "k_pe_out");
      same(contiguous.kv_c_out, junked.kv_c_out, "kv_c_out");
      EXPECT_TRUE(
          bytes_equal(junked.cache.data->download(), contiguous.cache.data->download(), "cache"));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, UnusedStridesOutputs, testing::ValuesIn(all_backends()),
                         backend_param_name);

}  // namespace
}  // namespace test
}  // namespace mlakv
