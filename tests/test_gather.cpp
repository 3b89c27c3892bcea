// mlakv tests: cache read-back (gather_cache_slots, gather_cache_sequences) against the reference
// for every cache format and both output dtypes: dequantized values exact, padding / bad slots and
// bad block ids give zeros and are counted, rows the op must not write stay poisoned.
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "harness.h"
#include "reference/reference.h"

namespace mlakv {
namespace test {
namespace {

struct GatherCase {
  std::string name;
  CacheFormat format;
  float scale;
  bool split;
  int64_t L, R, block_size;
  DType out_dtype;
  // out's rows at a stride of L + R + out_row_pad, starting out_offset() elements into the buffer
  // (the gaps stay poisoned); the block table a column view of a table with this many more
  // columns of valid block ids (a read at the wrong place copies a real entry, not zeros).
  int64_t out_row_pad = 0;
  int64_t table_extra_cols = 0;
  // out_row_pad rounded up to 8 elements: a padded out starts 16-byte aligned for 16-bit and
  // fp32 outputs, so its row stride alone decides CUDA's 16-byte path.
  int64_t out_offset() const { return (out_row_pad + 7) / 8 * 8; }
};
void PrintTo(const GatherCase& c, std::ostream* os) { *os << c.name; }

// A cache whose every slot holds a real entry, written by the reference from random values (so
// fp8_ds_mla tile scales are sane and no NaN code appears).
TestCache filled_cache(Device dev, const GatherCase& c, std::mt19937_64& rng) {
  CacheGeometry g;
  g.format = c.format;
  g.L = c.L;
  g.R = c.R;
  g.block_size = c.block_size;
  g.num_blocks = 96 / c.block_size + 3;
  g.split = c.split;
  g.scale = c.scale;
  if (c.split) g.token_pad_bytes = 16;
  TestCache cache = new_cache(dev, g);
  fill_cache_with_entries(dev, cache, rng);
  return cache;
}

class GatherCache : public testing::TestWithParam<std::tuple<Backend, GatherCase>> {};

// gather_cache_slots of the first N of `slot_values` (a `dtype` index tensor of them all) into a
// poisoned out of one row per value, against the reference: `bad` slots counted (the reference's
// count, and the library's equal to it), out equal to the reference's, rows >= N still poisoned.
void expect_slots_gather(const TestCache& cache, const GatherCase& c, DType dtype,
                         const std::vector<int64_t>& slot_values, int64_t N, int32_t bad) {
  const Device dev = cache.data->device();
  const int64_t rows = static_cast<int64_t>(slot_values.size());
  Tensor slots = index_tensor(dev, dtype, slot_values);
  Tensor out =
      poisoned(padded_rows(dev, c.out_dtype, rows, c.L + c.R, c.out_row_pad, c.out_offset()));
  const BothCounts counts = gather_slots_both(cache, N, slots, out);
  EXPECT_EQ(counts.expected[kBadSlot], bad);
  EXPECT_EQ(counts_to_string(counts.got), counts_to_string(counts.expected));
  EXPECT_TRUE(buffer_matches(*out.buffer, "out"));
}

TEST_P(GatherCache, SlotsMatchReference) {
  const Device dev = std::get<0>(GetParam()).device;
  const GatherCase& c = std::get<1>(GetParam());
  std::mt19937_64 rng(static_cast<uint64_t>(c.format) * 11 + c.block_size);
  TestCache cache = filled_cache(dev, c, rng);
  const int64_t n = cache.num_slots();
  const int64_t N = 41, rows = N + 3;
  std::vector<int64_t> slot_values(static_cast<size_t>(rows));
  std::uniform_int_distribution<int64_t> any_slot(0, n - 1);
  for (auto& s : slot_values) s = any_slot(rng);
  slot_values[0] = n - 1;                                       // the very last entry
  slot_values[4] = -1;                                          // padding: zeros, not counted
  slot_values[9] = n;                                           // past the end: zeros, counted
  slot_values[10] = n + 5;                                      // likewise
  slot_values[11] = slot_values[12];                            // repeats are fine
  for (int64_t i = N; i < rows; ++i) slot_values[i] = n + 100;  // rows >= N: never read
  expect_slots_gather(cache, c, DType::kInt32, slot_values, N, 2);
  EXPECT_TRUE(buffer_unchanged(*cache.data, "kv_cache"));
  if (cache.rope_data) {
    EXPECT_TRUE(buffer_unchanged(*cache.rope_data, "rope cache"));
  }
}

TEST_P(GatherCache, SequencesMatchReference) {
  const Device dev = std::get<0>(GetParam()).device;
  const GatherCase& c = std::get<1>(GetParam());
  std::mt19937_64 rng(static_cast<uint64_t>(c.format) * 13 + c.block_size);
  TestCache cache = filled_cache(dev, c, rng);
  const int64_t bs = c.block_size, D = c.L + c.R;
  const int64_t num_blocks = cache.geometry.num_blocks;
  // Sequences of 5, 0, 37 and 1 tokens; the last block of sequence 2 and the first of sequence 0
  // are bad ids.
  const std::vector<int64_t> lens = {5, 0, 37, 1};
  const int64_t B = static_cast<int64_t>(lens.size());
  int64_t max_blocks = 0;
  for (int64_t len : lens) max_blocks = std::max(max_blocks, (len + bs - 1) / bs);
  max_blocks += 1;
  // block_table [B + 1, max_blocks]: columns first .. first + max_blocks - 1 of a table W wide.
  const int64_t W = max_blocks + c.table_extra_cols, first = c.table_extra_cols > 0 ? 1 : 0;
  Tensor table = new_tensor(dev, DType::kInt32, {B + 1, W});
  std::vector<int64_t> table_values(static_cast<size_t>((B + 1) * W));
  std::uniform_int_distribution<int64_t> any_block(0, num_blocks - 1);
  for (auto& b : table_values) b = any_block(rng);
  auto entry = [&](int64_t seq, int64_t i) -> int64_t& {
    return table_values[seq * W + first + i];
  };
  const int64_t last_block_of_seq2 = (lens[2] - 1) / bs;
  entry(2, last_block_of_seq2) = num_blocks + 2;
  if (last_block_of_seq2 > 0) entry(2, 0) = -1;
  entry(0, 0) = num_blocks;  // sequence 0's first block: one past the cache's last
  set_indices(table.view(0, {(B + 1) * W}, {1}), table_values);
  table.buffer->upload();
  const Tensor block_table = table.view(first, {B + 1, max_blocks}, {W, 1});
  std::vector<int64_t> cu(static_cast<size_t>(B + 1), 0);
  for (int64_t b = 0; b < B; ++b) cu[b + 1] = cu[b] + lens[b];
  Tensor cu_seq_lens = index_tensor(dev, DType::kInt32, cu);
  // The output view ends 2 rows before the last sequence's end (those rows are not written), and
  // the buffer has 3 more rows past the view.
  const int64_t out_rows = cu[B] - 2;
  Tensor out =
      poisoned(padded_rows(dev, c.out_dtype, out_rows + 3, D, c.out_row_pad, c.out_offset()));
  out = out.view(out.offset, {out_rows, D}, out.stride);

  const BothCounts counts = gather_sequences_both(cache, B, block_table, cu_seq_lens, out);
  EXPECT_GT(counts.expected[kBadBlockIndex], 0);
  EXPECT_EQ(counts_to_string(counts.got), counts_to_string(counts.expected));
  EXPECT_TRUE(buffer_matches(*out.buffer, "out"));
  EXPECT_TRUE(buffer_unchanged(*cache.data, "kv_cache"));
  if (cache.rope_data) {
    EXPECT_TRUE(buffer_unchanged(*cache.rope_data, "rope cache"));
  }
  EXPECT_TRUE(buffer_unchanged(*table.buffer, "block_table"));
}

// Slots of int64 past 2^31 and 2^32: past the cache, so zeros and counted, as a truncation to 32
// bits would not give ((1 << 32) + 5 would read slot 5); in between, slots that hold entries.
TEST_P(GatherCache, LargeInt64SlotsArePastTheCache) {
  const Device dev = std::get<0>(GetParam()).device;
  const GatherCase& c = std::get<1>(GetParam());
  std::mt19937_64 rng(static_cast<uint64_t>(c.format) * 19 + c.block_size);
  TestCache cache = filled_cache(dev, c, rng);
  const std::vector<int64_t> slot_values = {(int64_t{1} << 32) + 5, 5, int64_t{1} << 40,
                                            (int64_t{1} << 31) + 1, 1, -1};
  expect_slots_gather(cache, c, DType::kInt64, slot_values,
                      static_cast<int64_t>(slot_values.size()), 3);
}

// A call of a single row is work like any other (a decode step of one token; a context of one
// sequence of one token): that row holds its entry in both modes, the row after it stays poisoned.
TEST_P(GatherCache, OneRow) {
  const Device dev = std::get<0>(GetParam()).device;
  const GatherCase& c = std::get<1>(GetParam());
  std::mt19937_64 rng(static_cast<uint64_t>(c.format) * 17 + c.block_size);
  TestCache cache = filled_cache(dev, c, rng);
  const int64_t D = c.L + c.R, last_block = cache.geometry.num_blocks - 1;
  Tensor slots = index_tensor(dev, DType::kInt64, {cache.num_slots() - 1, 0});
  Tensor out = poisoned(padded_rows(dev, c.out_dtype, 2, D, c.out_row_pad, c.out_offset()));
  const BothCounts slot_counts = gather_slots_both(cache, 1, slots, out);
  EXPECT_EQ(counts_to_string(slot_counts.got), counts_to_string(slot_counts.expected));
  EXPECT_TRUE(buffer_matches(*out.buffer, "out of gather_cache_slots"));

  // Sequences mode: block_table [1, 1] and out [1, D], a view of the first of two rows.
  const Tensor block_table = index_tensor(dev, DType::kInt32, {last_block}).view(0, {1, 1}, {1, 1});
  Tensor cu_seq_lens = index_tensor(dev, DType::kInt32, {0, 1});
  Tensor seq_out = poisoned(padded_rows(dev, c.out_dtype, 2, D, c.out_row_pad, c.out_offset()));
  seq_out = seq_out.view(seq_out.offset, {1, D}, seq_out.stride);
  const BothCounts seq_counts = gather_sequences_both(cache, 1, block_table, cu_seq_lens, seq_out);
  EXPECT_EQ(counts_to_string(seq_counts.got), counts_to_string(seq_counts.expected));
  EXPECT_TRUE(buffer_matches(*seq_out.buffer, "out of gather_cache_sequences"));
}

std::vector<GatherCase> gather_cases() {
  const auto bf16 = DType::kBFloat16, f32 = DType::kFloat32;
  std::vector<GatherCase> out;
  for (DType o : {bf16, f32}) {
    const std::string on = o == bf16 ? "_out_bf16" : "_out_fp32";
    out.push_back({"bf16" + on, CacheFormat::kBFloat16, 0, false, 512, 64, 16, o});
    out.push_back({"fp16_split" + on, CacheFormat::kFloat16, 0, true, 512, 64, 7, o});
    out.push_back({"fp32_minicpm3" + on, CacheFormat::kFloat32, 0, false, 256, 32, 1, o});
    out.push_back({"e4m3_scaled" + on, CacheFormat::kFloat8E4M3, 0.037f, false, 512, 64, 16, o});
    out.push_back({"e4m3_noscale_split" + on, CacheFormat::kFloat8E4M3, 0, true, 512, 64, 64, o});
    out.push_back({"e5m2_scaled" + on, CacheFormat::kFloat8E5M2, 0.037f, false, 256, 32, 16, o});
    out.push_back({"dsmla" + on, CacheFormat::kFloat8DsMla, 0, false, 512, 64, 64, o});
    out.push_back({"bf16_padded_rows_table_columns" + on, CacheFormat::kBFloat16, 0, false, 512, 64,
                   4, o, 8, 3});
    // Rows 4 elements apart from whole: 8-byte aligned bf16 rows (CUDA's element-wise kernel),
    // 16-byte aligned fp32 ones.
    out.push_back({"bf16_rows_pad4" + on, CacheFormat::kBFloat16, 0, false, 512, 64, 16, o, 4});
  }
  return out;
}

std::string case_name(const testing::TestParamInfo<std::tuple<Backend, GatherCase>>& info) {
  return std::get<0>(info.param).name + "_" + std::get<1>(info.param).name;
}

INSTANTIATE_TEST_SUITE_P(All, GatherCache,
                         testing::Combine(testing::ValuesIn(all_backends()),
                                          testing::ValuesIn(gather_cases())),
                         case_name);

}  // namespace
}  // namespace test
}  // namespace mlakv
