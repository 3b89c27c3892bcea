// mlakv tests: edge cases of every op. T = 0 (an empty batch, e.g. a CUDA-graph replay with no
// tokens) must succeed and write nothing: every output keeps its poison, the cache its sentinel and
// the counters stay 0, independently of the reference. gather_cache_sequences with sequences
// longer than their block-table row: the rows past the row's coverage are zeros and counted, rows
// at or past out.shape[0] are never written, an empty block table (null data) reads nothing, and a
// sequence whose start is negative (outside the contract) is skipped. ctx.num_threads above the
// hardware's is capped.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "fused_problem.h"
#include "reference/reference.h"

namespace mlakv {
namespace test {
namespace {

const std::string kNoErrors = counts_to_string(std::vector<int32_t>(kNumErrorCounters, 0));

TestCache sentinel_cache(Device dev) {
  TestCache cache = new_cache(dev, CacheGeometry{});
  cache.data->upload();
  if (cache.rope_data) cache.rope_data->upload();
  return cache;
}

void expect_cache_untouched(const TestCache& cache) {
  EXPECT_TRUE(buffer_unchanged(*cache.data, "kv_cache"));
  if (cache.rope_data) {
    EXPECT_TRUE(buffer_unchanged(*cache.rope_data, "rope cache"));
  }
  expect_cache_matches(cache, {}, "kv_cache");
}

class ZeroTokens : public testing::TestWithParam<Backend> {};

// Every entry point, host and device Td, optional outputs present: nothing happens.
TEST_P(ZeroTokens, FusedWritesNothing) {
  const Device dev = GetParam().device;
  struct Variant {
    std::string name;
    Entry entry;
    bool device_td, decode_q, prefill_q, prefill_out;
  };
  const Variant variants[] = {
      {"fused", Entry::kFused, false, true, true, false},
      {"fused_prefill_out", Entry::kFused, false, true, true, true},
      {"fused_device_td", Entry::kFused, true, true, true, false},
      {"fused_device_td_k_side_only", Entry::kFused, true, false, false, false},
      {"decode", Entry::kDecode, false, true, false, false},
      {"decode_device_td", Entry::kDecode, true, true, false, false},
      {"prefill", Entry::kPrefill, false, false, true, true},
      {"mixed", Entry::kMixed, false, true, true, false},
      {"mixed_device_td", Entry::kMixed, true, true, true, false},
  };
  uint64_t seed = 900;
  for (const Variant& v : variants) {
    FusedSpec s;
    s.name = "T0_" + v.name;
    s.T = 0;
    s.Td = 0;
    s.entry = v.entry;
    s.norm = true;
    s.k_pe_out = s.kv_c_out = true;
    s.decode_q = v.decode_q;
    s.prefill_q = v.prefill_q;
    s.prefill_out = v.prefill_out;
    s.device_td = v.device_td;
    s.device_td_value = 0;
    s.seed = seed++;
    SCOPED_TRACE(s.name);
    FusedProblem problem(s, dev);
    EXPECT_EQ(counts_to_string(problem.run_reference()), kNoErrors) << "reference counters";
    EXPECT_EQ(counts_to_string(problem.run_library()), kNoErrors) << "error counters";
    problem.expect_matches();
    // Independently of the reference: every buffer, outputs included, is as it was.
    for (const Tensor* t : {&problem.k_pe_out, &problem.kv_c_out, &problem.q_out, &problem.q,
                            &problem.q_prefill_out, &problem.kv_c, &problem.k_pe}) {
      if (t->present()) {
        EXPECT_TRUE(buffer_unchanged(*t->buffer, "an output or input"));
      }
    }
    expect_cache_untouched(problem.cache);
  }
}

// A device Td left over from an earlier batch (outside [0, 0]) with T = 0: still nothing happens,
// and nothing is counted (every backend and the reference return before reading it).
TEST_P(ZeroTokens, FusedStaleDeviceTdNotCounted) {
  const Device dev = GetParam().device;
  for (int32_t td : {5, -2}) {
    FusedSpec s;
    s.name = "T0_stale_device_td_" + std::to_string(td);
    s.T = 0;
    s.Td = 0;
    s.entry = Entry::kMixed;
    s.device_td = true;
    s.device_td_value = td;
    s.seed = 920;
    SCOPED_TRACE(s.name);
    FusedProblem problem(s, dev);
    EXPECT_EQ(counts_to_string(problem.run_reference()), kNoErrors) << "reference counters";
    EXPECT_EQ(counts_to_string(problem.run_library()), kNoErrors) << "error counters";
    problem.expect_matches();
    expect_cache_untouched(problem.cache);
  }
}

TEST_P(ZeroTokens, RotaryEmbeddingWritesNothing) {
  const Device dev = GetParam().device;
  std::mt19937_64 rng(901);
  const int64_t rows = 3, H = 4, head_size = 96, rot_dim = 64, max_pos = 64;
  Tensor positions = index_tensor(dev, DType::kInt64, {1, 2, 3});
  Tensor query = random_tensor(dev, DType::kBFloat16, {rows, H, head_size}, rng);
  Tensor key = random_tensor(dev, DType::kBFloat16, {rows, 1, head_size}, rng);
  Tensor cos_sin = random_tensor(dev, DType::kFloat32, {max_pos, rot_dim}, rng);
  ErrorCounts counts(dev);
  RotaryEmbeddingParams host, device;
  fill_host_and_device(host, device, [&](auto* p, auto v) {
    p->num_tokens = 0;
    p->positions = v(positions);
    p->query = v(query);
    p->key = v(key);
    p->cos_sin_cache = v(cos_sin);
  });
  std::vector<int32_t> expected(kNumErrorCounters, 0);
  ref::rotary_embedding(host, expected.data());
  Context ctx;
  ctx.error_counts = counts.device_ptr();
  rotary_embedding(device, ctx);
  EXPECT_EQ(counts_to_string(expected), kNoErrors);
  EXPECT_EQ(counts_to_string(counts.read()), kNoErrors);
  EXPECT_TRUE(buffer_unchanged(*query.buffer, "query"));
  EXPECT_TRUE(buffer_unchanged(*key.buffer, "key"));
}

TEST_P(ZeroTokens, ConcatAndCacheWritesNothing) {
  const Device dev = GetParam().device;
  std::mt19937_64 rng(902);
  TestCache cache = sentinel_cache(dev);
  const int64_t rows = 3, L = cache.geometry.L, R = cache.geometry.R;
  Tensor kv_c = random_tensor(dev, DType::kBFloat16, {rows, L}, rng);
  Tensor k_pe = random_tensor(dev, DType::kBFloat16, {rows, R}, rng);
  Tensor slots = index_tensor(dev, DType::kInt64, {0, 5, 17});
  ErrorCounts counts(dev);
  ConcatAndCacheMlaParams host, device;
  fill_host_and_device(host, device, [&](auto* p, auto v) {
    p->num_tokens = 0;
    p->kv_c = v(kv_c);
    p->k_pe = v(k_pe);
    p->slot_mapping = v(slots);
    p->kv_cache = v(cache);
  });
  std::vector<int32_t> expected(kNumErrorCounters, 0);
  ref::concat_and_cache_mla(host, expected.data());
  Context ctx;
  ctx.error_counts = counts.device_ptr();
  concat_and_cache_mla(device, ctx);
  EXPECT_EQ(counts_to_string(expected), kNoErrors);
  EXPECT_EQ(counts_to_string(counts.read()), kNoErrors);
  expect_cache_untouched(cache);
}

TEST_P(ZeroTokens, DecodeQConcatWritesNothing) {
  const Device dev = GetParam().device;
  std::mt19937_64 rng(903);
  const int64_t rows = 2, H = 4, L = 512, R = 64;
  Tensor ql_nope = random_tensor(dev, DType::kBFloat16, {rows, H, L}, rng);
  Tensor q_pe = random_tensor(dev, DType::kBFloat16, {rows, H, R}, rng);
  for (DType qd : {DType::kBFloat16, DType::kFloat8E4M3}) {
    SCOPED_TRACE(dtype_name(qd));
    Tensor q_out = poisoned_tensor(dev, qd, {rows, H, L + R});
    DecodeQConcatParams host, device;
    fill_host_and_device(host, device, [&](auto* p, auto v) {
      p->num_tokens = 0;
      p->ql_nope = v(ql_nope);
      p->q_pe = v(q_pe);
      p->q_out = v(q_out);
    });
    ref::decode_q_concat(host);
    ErrorCounts counts(dev);
    Context ctx;
    ctx.error_counts = counts.device_ptr();
    decode_q_concat(device, ctx);
    EXPECT_EQ(counts_to_string(counts.read()), kNoErrors);
    EXPECT_TRUE(buffer_matches(*q_out.buffer, "q_out"));
    EXPECT_TRUE(buffer_unchanged(*q_out.buffer, "q_out"));
  }
}

TEST_P(ZeroTokens, RmsNormWritesNothing) {
  const Device dev = GetParam().device;
  std::mt19937_64 rng(904);
  const int64_t rows = 2, N = 512;
  Tensor input = random_tensor(dev, DType::kBFloat16, {rows, N}, rng);
  Tensor weight = random_tensor(dev, DType::kBFloat16, {N}, rng);
  Tensor output = poisoned_tensor(dev, DType::kBFloat16, {rows, N});
  for (bool in_place : {false, true}) {
    SCOPED_TRACE(in_place ? "in place" : "separate output");
    const Tensor& out = in_place ? input : output;
    RmsNormParams host, device;
    fill_host_and_device(host, device, [&](auto* p, auto v) {
      p->num_tokens = 0;
      p->input = v(input);
      p->weight = v(weight);
      p->output = v(out);
    });
    ref::rms_norm(host);
    ErrorCounts counts(dev);
    Context ctx;
    ctx.error_counts = counts.device_ptr();
    rms_norm(device, ctx);
    EXPECT_EQ(counts_to_string(counts.read()), kNoErrors);
    EXPECT_TRUE(buffer_unchanged(*out.buffer, "output"));
    EXPECT_TRUE(buffer_unchanged(*input.buffer, "input"));
  }
}

TEST_P(ZeroTokens, GatherCacheSlotsWritesNothing) {
  const Device dev = GetParam().device;
  TestCache cache = sentinel_cache(dev);
  const int64_t D = cache.geometry.L + cache.geometry.R;
  // Valid, padding and out-of-range slots: none may be read, zeroed or counted.
  Tensor slots = index_tensor(dev, DType::kInt64, {0, -1, cache.num_slots() + 3});
  for (DType od : {DType::kBFloat16, DType::kFloat32}) {
    SCOPED_TRACE(dtype_name(od));
    Tensor out = poisoned_tensor(dev, od, {3, D});
    const BothCounts counts = gather_slots_both(cache, 0, slots, out);
    EXPECT_EQ(counts_to_string(counts.expected), kNoErrors);
    EXPECT_EQ(counts_to_string(counts.got), kNoErrors);
    EXPECT_TRUE(buffer_unchanged(*out.buffer, "out"));
    expect_cache_untouched(cache);
  }
}

INSTANTIATE_TEST_SUITE_P(All, ZeroTokens, testing::ValuesIn(all_backends()), backend_param_name);

// ---- helpers of the gather cases ---------------------------------------------------------------
// A bf16 cache of `num_blocks` blocks of 4 tokens whose every slot holds a real entry (written by
// the reference from random values).
TestCache entries_cache(Device dev, int64_t num_blocks, std::mt19937_64& rng) {
  CacheGeometry g;
  g.block_size = 4;
  g.num_blocks = num_blocks;
  TestCache cache = new_cache(dev, g);
  fill_cache_with_entries(dev, cache, rng);
  return cache;
}

// The bytes of `slot`'s row in an `od` output: a one-slot gather of the reference.
std::vector<uint8_t> reference_row(const TestCache& cache, int64_t slot, DType od) {
  const Device host{};
  Tensor one_slot = index_tensor(host, DType::kInt64, {slot});
  Tensor one_row = new_tensor(host, od, {1, cache.geometry.L + cache.geometry.R});
  GatherCacheSlotsParams p;
  p.num_tokens = 1;
  p.kv_cache = cache.host_view();
  p.slots = one_slot.host_view();
  p.out = one_row.host_view();
  ref::gather_cache_slots(p);
  return one_row.buffer->host;
}

// gather_cache_sequences on the backend alone (cases the reference does not cover); its counters.
std::vector<int32_t> gather_sequences_on(const TestCache& cache, int64_t num_seqs,
                                         const TensorView& block_table, const Tensor& cu_seq_lens,
                                         const Tensor& out) {
  ErrorCounts counts(cache.data->device());
  GatherCacheSequencesParams p;
  p.num_seqs = num_seqs;
  p.kv_cache = cache.device_view();
  p.block_table = block_table;
  p.cu_seq_lens = cu_seq_lens.device_view();
  p.out = out.device_view();
  Context ctx;
  ctx.error_counts = counts.device_ptr();
  gather_cache_sequences(p, ctx);
  return counts.read();
}

// ---- gather_cache_sequences past the block-table row -------------------------------------------
// ops.h: token i of sequence b lives in block block_table[b, i / block_size]; a block id outside
// [0, num_blocks) gives zeros and is counted; rows at or past out.shape[0] are never written. A
// token with i / block_size >= max_blocks_per_seq has no block-table entry at all: its row is
// zeros and counted (kBadBlockIndex) once, and the next row of the table is never used for it.
class GatherPastTable : public testing::TestWithParam<std::tuple<Backend, DType>> {};

TEST_P(GatherPastTable, ZerosCountedAndOutputBounded) {
  const Device dev = std::get<0>(GetParam()).device;
  const DType od = std::get<1>(GetParam());
  std::mt19937_64 rng(905);
  TestCache cache = entries_cache(dev, 12, rng);
  const int64_t bs = cache.geometry.block_size, D = cache.geometry.L + cache.geometry.R;
  // max_blocks_per_seq = 2 covers 8 tokens. Sequence 0 has 11 (3 rows past its row), sequence 1
  // has 8 (exactly covered), sequence 2 has 10 (2 past), the last has 6, of which only 3 fit in
  // out. Every table entry, the spare row after the last sequence included, is a valid block, so
  // a backend reading past a row would copy real data instead of zeros.
  const int64_t max_blocks = 2;
  const std::vector<int64_t> lens = {11, 8, 10, 6};
  const int64_t B = static_cast<int64_t>(lens.size());
  std::vector<int64_t> cu(static_cast<size_t>(B + 1), 0);
  for (int64_t b = 0; b < B; ++b) cu[b + 1] = cu[b] + lens[b];
  const int64_t out_rows = cu[B] - 3;
  Tensor block_table = new_tensor(dev, DType::kInt32, {B + 1, max_blocks});
  std::vector<int64_t> table_values(static_cast<size_t>((B + 1) * max_blocks));
  std::uniform_int_distribution<int64_t> any_block(0, cache.geometry.num_blocks - 1);
  for (auto& b : table_values) b = any_block(rng);
  set_indices(block_table.view(0, {(B + 1) * max_blocks}, {1}), table_values);
  block_table.buffer->upload();
  Tensor cu_seq_lens = index_tensor(dev, DType::kInt32, cu);
  // The buffer has 4 more rows past the view: the last sequence's rows past out.shape[0] and
  // beyond must stay poisoned.
  Tensor out = poisoned_tensor(dev, od, {out_rows + 4, D});
  out = out.view(0, {out_rows, D}, out.stride);

  // The contract, independently of the reference: which rows are zeros, which are entries.
  const int64_t elem = dtype_size(od);
  std::vector<uint8_t> planned = out.buffer->initial;
  int32_t planned_bad = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < lens[b] && cu[b] + i < out_rows; ++i) {
      uint8_t* row = planned.data() + (cu[b] + i) * D * elem;
      if (i / bs >= max_blocks) {
        std::fill(row, row + D * elem, uint8_t{0});
        ++planned_bad;
        continue;
      }
      const int64_t slot = table_values[b * max_blocks + i / bs] * bs + i % bs;
      const std::vector<uint8_t> entry = reference_row(cache, slot, od);
      std::copy(entry.begin(), entry.end(), row);
    }
  }
  EXPECT_EQ(planned_bad, 3 + 2);

  const BothCounts counts = gather_sequences_both(cache, B, block_table, cu_seq_lens, out);
  EXPECT_EQ(counts.expected[kBadBlockIndex], planned_bad)
      << "the reference's count disagrees with ops.h";
  EXPECT_TRUE(bytes_equal(out.buffer->host, planned, "reference out vs ops.h"));
  std::vector<int32_t> planned_counts(kNumErrorCounters, 0);
  planned_counts[kBadBlockIndex] = planned_bad;
  EXPECT_EQ(counts_to_string(counts.got), counts_to_string(planned_counts));
  EXPECT_TRUE(bytes_equal(out.buffer->download(), planned, "out"));
  EXPECT_TRUE(buffer_unchanged(*cache.data, "kv_cache"));
  EXPECT_TRUE(buffer_unchanged(*block_table.buffer, "block_table"));
}

std::string past_table_name(const testing::TestParamInfo<std::tuple<Backend, DType>>& info) {
  return std::get<0>(info.param).name + "_out_" + dtype_name(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(All, GatherPastTable,
                         testing::Combine(testing::ValuesIn(all_backends()),
                                          testing::Values(DType::kBFloat16, DType::kFloat32)),
                         past_table_name);

// ---- gather_cache_sequences with an empty block table -------------------------------------------
// An empty block_table ([B, 0]: no entries a sequence; [0, M]: no sequences) may come with a null
// data pointer (torch gives empty tensors one). ops.h, independently of the reference: with
// [B, 0] every token of every sequence has no block-table entry, so its row is zeros and counted
// (kBadBlockIndex); with B = 0 no row is written and nothing is counted.
class GatherEmptyTable : public testing::TestWithParam<Backend> {};

TEST_P(GatherEmptyTable, NullTableData) {
  const Device dev = GetParam().device;
  const DType od = DType::kFloat32;
  std::mt19937_64 rng(906);
  TestCache cache = entries_cache(dev, 6, rng);
  const int64_t D = cache.geometry.L + cache.geometry.R;
  const int64_t elem = dtype_size(od);
  struct Case {
    std::vector<int64_t> cu;  // cu_seq_lens: B + 1 values
    int64_t table_cols;       // block_table [B, table_cols]
    int64_t out_rows;
  };
  for (const Case& c : {Case{{0, 2, 3, 5}, 0, 6}, Case{{0}, 4, 3}, Case{{0}, 0, 2}}) {
    const int64_t B = static_cast<int64_t>(c.cu.size()) - 1;
    SCOPED_TRACE("B = " + std::to_string(B) + ", block_table [B, " + std::to_string(c.table_cols) +
                 "], out rows " + std::to_string(c.out_rows));
    Tensor cu_seq_lens = index_tensor(dev, DType::kInt32, c.cu);
    Tensor out = poisoned_tensor(dev, od, {c.out_rows, D});
    const TensorView null_table = make_strided_view(nullptr, DType::kInt32, {B, c.table_cols},
                                                    {std::max<int64_t>(c.table_cols, 1), 1}, dev);
    const std::vector<int32_t> counts = gather_sequences_on(cache, B, null_table, cu_seq_lens, out);

    std::vector<uint8_t> planned = out.buffer->initial;
    const int64_t rows = std::min(c.cu.back(), c.out_rows);
    std::fill(planned.begin(), planned.begin() + rows * D * elem, uint8_t{0});
    std::vector<int32_t> planned_counts(kNumErrorCounters, 0);
    planned_counts[kBadBlockIndex] = static_cast<int32_t>(rows);
    EXPECT_EQ(counts_to_string(counts), counts_to_string(planned_counts));
    EXPECT_TRUE(bytes_equal(out.buffer->download(), planned, "out"));
    EXPECT_TRUE(buffer_unchanged(*cache.data, "kv_cache"));
  }
}

INSTANTIATE_TEST_SUITE_P(All, GatherEmptyTable, testing::ValuesIn(all_backends()),
                         backend_param_name);

// ---- gather_cache_sequences with a negative sequence start -------------------------------------
// ops.h asks for cu_seq_lens[0] = 0; device data may still break that (a stale graph input). A
// sequence whose start is negative is skipped whole on every backend: nothing is written before
// out's first row (the buffer has poisoned rows there), its rows in out keep their contents, it is
// not counted, and the sequences after it are read as usual. The expected bytes are built
// independently of the reference, which must then give the same.
class GatherNegativeStart : public testing::TestWithParam<Backend> {};

TEST_P(GatherNegativeStart, SequenceSkippedNothingWrittenBeforeOut) {
  const Device dev = GetParam().device;
  const DType od = DType::kFloat32;
  std::mt19937_64 rng(909);
  TestCache cache = entries_cache(dev, 6, rng);
  const int64_t bs = cache.geometry.block_size, D = cache.geometry.L + cache.geometry.R;
  const int64_t elem = dtype_size(od);
  // Sequence 0 starts at -3 (its 5 tokens would be rows -3 .. 1), sequence 1 is rows 2 .. 5.
  // Sequence 0's first block id is bad: reading its tokens would count.
  const std::vector<int64_t> cu = {-3, 2, 6};
  const std::vector<int64_t> table_values = {-1, 4, 5, 2};  // block_table [2, 2]
  Tensor cu_seq_lens = index_tensor(dev, DType::kInt32, cu);
  Tensor block_table = new_tensor(dev, DType::kInt32, {2, 2});
  set_indices(block_table.view(0, {4}, {1}), table_values);
  block_table.buffer->upload();
  // out [6, D] starts 4 rows into its buffer.
  const int64_t rows = 6, before = 4;
  Tensor out = poisoned(padded_rows(dev, od, rows, D, 0, before * D));
  const std::vector<int32_t> counts =
      gather_sequences_on(cache, 2, block_table.device_view(), cu_seq_lens, out);

  std::vector<uint8_t> planned = out.buffer->initial;
  for (int64_t i = 0; i < cu[2] - cu[1]; ++i) {
    const std::vector<uint8_t> entry =
        reference_row(cache, table_values[2 + i / bs] * bs + i % bs, od);
    std::copy(entry.begin(), entry.end(), planned.begin() + (before + cu[1] + i) * D * elem);
  }
  EXPECT_EQ(counts_to_string(counts), kNoErrors);
  EXPECT_TRUE(bytes_equal(out.buffer->download(), planned, "out"));
  EXPECT_TRUE(buffer_unchanged(*cache.data, "kv_cache"));

  // The reference skips it too (it used to write rows -3 .. -1, before out).
  GatherCacheSequencesParams rp;
  rp.num_seqs = 2;
  rp.kv_cache = cache.host_view();
  rp.block_table = block_table.host_view();
  rp.cu_seq_lens = cu_seq_lens.host_view();
  rp.out = out.host_view();
  std::vector<int32_t> ref_counts(kNumErrorCounters, 0);
  ref::gather_cache_sequences(rp, ref_counts.data());
  EXPECT_EQ(counts_to_string(ref_counts), kNoErrors);
  EXPECT_TRUE(bytes_equal(out.buffer->host, planned, "the reference's out"));
}

INSTANTIATE_TEST_SUITE_P(All, GatherNegativeStart, testing::ValuesIn(all_backends()),
                         backend_param_name);

// ---- rms_norm with eps = 0 ---------------------------------------------------------------------
// eps = 0 is a valid RMSNorm eps (as in rmsnorm_quant): a nonzero row is normalized as the
// reference does; an all-zero row gives NaN everywhere (0 * rsqrt(0 + 0)), on every backend.
class RmsNormEpsZero : public testing::TestWithParam<Backend> {};

TEST_P(RmsNormEpsZero, NonzeroRowsNormalizedZeroRowsNaN) {
  const Device dev = GetParam().device;
  std::mt19937_64 rng(908);
  const int64_t N = 512;
  Tensor input = random_tensor(dev, DType::kBFloat16, {2, N}, rng, 3.0f);
  std::fill(input.buffer->host.begin() + N * 2, input.buffer->host.end(), uint8_t{0});  // row 1
  Tensor weight = random_tensor(dev, DType::kBFloat16, {N}, rng, 1.5f);
  Tensor output = poisoned_tensor(dev, DType::kBFloat16, {2, N});
  for (const Tensor* t : {&input, &weight, &output}) t->buffer->upload();
  RmsNormParams host, device;
  fill_host_and_device(host, device, [&](auto* p, auto v) {
    p->num_tokens = 2;
    p->input = v(input);
    p->weight = v(weight);
    p->eps = 0.0f;
    p->output = v(output);
  });
  ref::rms_norm(host);
  rms_norm(device);
  // Row 0 equals the reference's bytes; row 1 is the canonical NaN 0x7fff everywhere, on every
  // backend (numerics.h: a NaN's sign and payload are the platform's, so storage drops them).
  const std::vector<uint8_t> got = output.buffer->download();
  const std::vector<uint8_t>& expected = output.buffer->host;
  EXPECT_TRUE(bytes_equal({got.begin(), got.begin() + 2 * N},
                          {expected.begin(), expected.begin() + 2 * N}, "output row 0"));
  int64_t not_canonical = 0;
  for (int64_t i = N; i < 2 * N; ++i) {
    const uint16_t bits = static_cast<uint16_t>(got[2 * i] | got[2 * i + 1] << 8);
    not_canonical += bits != 0x7fff;
  }
  EXPECT_EQ(not_canonical, 0) << "elements of the all-zero row that are not the NaN 0x7fff";
}

INSTANTIATE_TEST_SUITE_P(All, RmsNormEpsZero, testing::ValuesIn(all_backends()),
                         backend_param_name);

// ---- ctx.num_threads above the hardware's ------------------------------------------------------
// context.h: more threads than the hardware has count as all of them (never handed to the OpenMP
// runtime as asked). rms_norm over [T, N] with the default count and with `requested` threads:
// the same bytes.
void expect_thread_count_capped(int64_t T, int64_t N, int requested, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Tensor input = random_tensor(Device{}, DType::kBFloat16, {T, N}, rng, 3.0f);
  Tensor weight = random_tensor(Device{}, DType::kBFloat16, {N}, rng, 1.5f);
  Tensor outputs[2] = {poisoned_tensor(Device{}, DType::kBFloat16, {T, N}),
                       poisoned_tensor(Device{}, DType::kBFloat16, {T, N})};
  for (int k = 0; k < 2; ++k) {
    RmsNormParams p;
    p.num_tokens = T;
    p.input = input.host_view();
    p.weight = weight.host_view();
    p.output = outputs[k].host_view();
    Context ctx;
    ctx.num_threads = k == 0 ? 0 : requested;
    rms_norm(p, ctx);
  }
  EXPECT_TRUE(bytes_equal(outputs[1].buffer->host, outputs[0].buffer->host, "output"));
}

// A row block large enough to run in parallel.
TEST(CpuThreads, CountAboveTheHardwareIsCapped) {
  expect_thread_count_capped(2048, 1024, 1 << 20, 907);
}

// Rows that alone would ask for more threads than the system can start (2^18 rows of 8 values:
// every row its own work item). Uncapped, the OpenMP runtime aborts the test program (that is
// what fails, not the byte comparison).
TEST(CpuThreads, CountAboveTheSystemsThreadsIsCapped) {
  expect_thread_count_capped(int64_t{1} << 18, 8, INT32_MAX, 910);
}

// A batch without decode tokens may pass its decode buffers empty ([0, H, ...]) with any H the
// view rules allow: the op runs its K side alone. The CPU backend's estimate of the bytes it moves
// once multiplied H into a prefill term with no work behind it and passed int64 (UBSan in CI).
TEST(CpuThreads, EmptyDecodeBuffersWithAnyHeadCount) {
  constexpr int64_t T = 1, L = 512, R = 64, H = int64_t{1} << 55;
  std::vector<uint16_t> kv_c(L), k_pe(R, 0x3f80), cache(L + R, 0xffff);
  for (int64_t i = 0; i < L; ++i) kv_c[i] = static_cast<uint16_t>(0x3f80 + i);
  std::vector<int64_t> position(1, 0), slot(1, 0);
  std::vector<float> table(R, 0.5f);
  MlaRopeCacheParams p;
  p.num_tokens = T;
  p.num_decode_tokens = 0;
  p.positions = make_view(position.data(), DType::kInt64, {T});
  p.slot_mapping = make_view(slot.data(), DType::kInt64, {T});
  p.cos_sin_cache = make_view(table.data(), DType::kFloat32, {1, R});
  p.kv_c = make_view(kv_c.data(), DType::kBFloat16, {T, L});
  p.k_pe = make_view(k_pe.data(), DType::kBFloat16, {T, R});
  p.kv_cache = make_cache_view(cache.data(), CacheFormat::kBFloat16, 1, 1, L, R);
  p.q_out = make_strided_view(nullptr, DType::kBFloat16, {0, H, L + R}, {1, 1, 1});
  p.q_pe = make_strided_view(nullptr, DType::kBFloat16, {0, H, R}, {1, 1, 1});
  mla_rope_cache(p);
  EXPECT_TRUE(std::equal(kv_c.begin(), kv_c.end(), cache.begin())) << "the latent not cached";
  EXPECT_NE(cache[L], 0xffff) << "the rope part not cached";
}

}  // namespace
}  // namespace test
}  // namespace mlakv
