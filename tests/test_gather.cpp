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

TEST_P(GatherCache, SlotsMatchReference) {
  const Device dev = std::get<0>(GetParam()).device;
  const GatherCase& c = std::get<1>(GetParam());
  std::mt19937_64 rng(static_cast<uint64_t>(c.format) * 11 + c.block_size);
  TestCache cache = filled_cache(dev, c, rng);
  const int64_t n = cache.num_slots();
  const int64_t N = 41, rows = N + 3, D = c.L + c.R;
  std::vector<int64_t> slot_values(static_cast<size_t>(rows));
  std::uniform_int_distribution<int64_t> any_slot(0, n - 1);
  for (auto& s : slot_values) s = any_slot(rng);
  slot_values[0] = n - 1;                                       // the very last entry
  slot_values[4] = -1;                                          // padding: zeros, not counted
  slot_values[9] = n;                                           // past the end: zeros, counted
  slot_values[10] = n + 5;                                      // likewise
  slot_values[11] = slot_values[12];                            // repeats are fine
  for (int64_t i = N; i < rows; ++i) slot_values[i] = n + 100;  // rows >= N: never read
  Tensor slots = new_tensor(dev, DType::kInt32, {rows});
  set_indices(slots, slot_values);
  Tensor out = new_tensor(dev, c.out_dtype, {rows, D});
  fill_bytes(*out.buffer, kPoisonByte);
  ErrorCounts counts(dev);
  slots.buffer->upload();
  out.buffer->upload();

  GatherCacheSlotsParams host, device;
  for (auto [p, on_host] : {std::pair{&host, true}, std::pair{&device, false}}) {
    p->num_tokens = N;
    p->kv_cache = on_host ? cache.host_view() : cache.device_view();
    p->slots = on_host ? slots.host_view() : slots.device_view();
    p->out = on_host ? out.host_view() : out.device_view();
  }
  std::vector<int32_t> expected(kNumErrorCounters, 0);
  ref::gather_cache_slots(host, expected.data());
  Context ctx;
  ctx.error_counts = counts.device_ptr();
  gather_cache_slots(device, ctx);
  EXPECT_EQ(expected[kBadSlot], 2);
  EXPECT_EQ(counts_to_string(counts.read()), counts_to_string(expected));
  EXPECT_TRUE(buffer_matches(*out.buffer, "out"));
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
  std::vector<int64_t> blocks(static_cast<size_t>(num_blocks));
  std::iota(blocks.begin(), blocks.end(), 0);
  Tensor block_table = new_tensor(dev, DType::kInt32, {B + 1, max_blocks});
  std::vector<int64_t> table_values(static_cast<size_t>((B + 1) * max_blocks));
  std::uniform_int_distribution<int64_t> any_block(0, num_blocks - 1);
  for (auto& b : table_values) b = any_block(rng);
  const int64_t last_block_of_seq2 = (lens[2] - 1) / bs;
  table_values[2 * max_blocks + last_block_of_seq2] = num_blocks + 2;
  if (last_block_of_seq2 > 0) table_values[2 * max_blocks] = -1;
  table_values[0] = num_blocks;  // sequence 0's first block: one past the cache's last
  set_indices(block_table.view(0, {(B + 1) * max_blocks}, {1}), table_values);
  std::vector<int64_t> cu(static_cast<size_t>(B + 1), 0);
  for (int64_t b = 0; b < B; ++b) cu[b + 1] = cu[b] + lens[b];
  Tensor cu_seq_lens = new_tensor(dev, DType::kInt32, {B + 1});
  set_indices(cu_seq_lens, cu);
  // The output view ends 2 rows before the last sequence's end (those rows are not written), and
  // the buffer has 3 more rows past the view.
  const int64_t out_rows = cu[B] - 2;
  Tensor out = new_strided_tensor(dev, c.out_dtype, (out_rows + 3) * D, {out_rows, D}, {D, 1});
  fill_bytes(*out.buffer, kPoisonByte);
  ErrorCounts counts(dev);
  block_table.buffer->upload();
  cu_seq_lens.buffer->upload();
  out.buffer->upload();

  GatherCacheSequencesParams host, device;
  for (auto [p, on_host] : {std::pair{&host, true}, std::pair{&device, false}}) {
    p->num_seqs = B;
    p->kv_cache = on_host ? cache.host_view() : cache.device_view();
    p->block_table = on_host ? block_table.host_view() : block_table.device_view();
    p->cu_seq_lens = on_host ? cu_seq_lens.host_view() : cu_seq_lens.device_view();
    p->out = on_host ? out.host_view() : out.device_view();
  }
  std::vector<int32_t> expected(kNumErrorCounters, 0);
  ref::gather_cache_sequences(host, expected.data());
  Context ctx;
  ctx.error_counts = counts.device_ptr();
  gather_cache_sequences(device, ctx);
  EXPECT_GT(expected[kBadBlockIndex], 0);
  EXPECT_EQ(counts_to_string(counts.read()), counts_to_string(expected));
  EXPECT_TRUE(buffer_matches(*out.buffer, "out"));
  EXPECT_TRUE(buffer_unchanged(*cache.data, "kv_cache"));
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
