// mlakv tests: caches and rows past 4 GiB. An engine's cache takes most of the GPU's memory (tens
// of GiB), so entry offsets pass 2^31 and 2^32 bytes, and a 1-byte format's element indices do too:
// every op that writes or reads the cache must address it in 64 bits (the validators allow extents
// up to 2^56: decisions.md).
//
// Each test puts the blocks of a small TestCache at the end of a cache of just over 4 GiB (a
// FarCache), so that its blocks sit on both sides of the 2^32-byte mark, and runs the op there with
// the slots / block ids shifted to match. Afterwards the far blocks must hold exactly the bytes the
// reference wrote into (or read from) the small cache, and the head of the far cache, where an
// offset truncated to 32 bits would land, must still hold the sentinel. A truncation to a signed
// 32-bit offset points before the allocation: into another of the test's allocations (the
// comparisons see it) or outside any (ASan on the CPU, in CI; compute-sanitizer on CUDA). Per-token
// tensors get the same treatment from FarRows: rows far apart, the last at byte 2^33 (a prefill q
// of ~90K tokens passes 2^31 elements, one of ~180K tokens 2^32).
//
// Only the tail and the head of a far allocation are touched, so on the CPU the rest of it costs
// no memory. On CUDA it does: a test takes up to ~17 GB of device memory (two far tensors of
// 8.6 GB, or a split far cache and a far gather output), which a GPU of 24 GB or more has.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cli/util.h"
#include "fused_problem.h"
#include "reference/reference.h"

namespace mlakv {
namespace test {
namespace {

constexpr int64_t kMark = int64_t{1} << 32;  // the far blocks straddle this byte offset

// A far allocation: device memory without a host mirror (a harness Buffer mirrors every byte).
using FarMemory = cli::Buffer;
// Its bytes from `offset` on.
uint8_t* at(const FarMemory& m, int64_t offset) { return m.as<uint8_t>() + offset; }

// One part of a cache (the combined entries, or a split cache's latent or rope part): small's
// blocks are the last ones of a far allocation whose blocks are far_block_bytes apart (at least
// small's block_bytes; the rest of a far block is a gap that stays the sentinel).
struct FarPart {
  const Buffer* small = nullptr;
  int64_t num_blocks = 0;  // small's
  int64_t block_bytes = 0;
  int64_t far_block_bytes = 0;
  int64_t tail_offset = 0;  // shift_blocks * far_block_bytes
  std::unique_ptr<FarMemory> memory;

  int64_t tail_bytes() const { return num_blocks * far_block_bytes; }
  std::vector<uint8_t> download(int64_t offset, int64_t bytes) const {
    std::vector<uint8_t> out(static_cast<size_t>(bytes));
    device_synchronize(small->device());
    copy_device_to_host(small->device(), out.data(), at(*memory, offset), out.size());
    return out;
  }
};

// A cache of the small cache's geometry with shift_blocks more blocks in front of small's. Its
// tail starts with small's initial contents (Buffer::initial), its head (as many bytes as the
// tail) with the sentinel; nothing else of it is written or read. A split cache's rope blocks are
// as far apart as its latent blocks, so that both parts straddle the mark.
class FarCache {
 public:
  explicit FarCache(const TestCache& small) : small_(small) {
    const KVCacheView v = small.device_view();
    const int64_t n = small.geometry.num_blocks;
    // (A constructor cannot ASSERT: the test goes on, and its comparisons fail.)
    EXPECT_EQ(static_cast<int64_t>(small.data->bytes()), n * v.stride_block_bytes)
        << "blocks not packed";
    // The tail's middle at the mark: tail_offset <= kMark - tail / 2 < kMark < tail end.
    shift_blocks_ = (kMark - n * v.stride_block_bytes / 2) / v.stride_block_bytes;
    add_part(*small.data, v.stride_block_bytes, v.stride_block_bytes);
    if (small.rope_data)
      add_part(*small.rope_data, v.stride_rope_block_bytes, v.stride_block_bytes);
  }

  int64_t shift_blocks() const { return shift_blocks_; }
  int64_t shift_slots() const { return shift_blocks_ * small_.geometry.block_size; }
  // Byte offset in the far cache's latent part of small's slot s.
  int64_t far_offset(int64_t s) const {
    const KVCacheView v = small_.host_view();
    return parts_[0].tail_offset + s / v.block_size * v.stride_block_bytes +
           s % v.block_size * v.stride_token_bytes;
  }

  // The reference's side of a call (fill_host_and_device): the small cache.
  KVCacheView host_view() const { return small_.host_view(); }
  KVCacheView device_view() const {
    KVCacheView v = small_.device_view();
    v.num_blocks += shift_blocks_;
    v.data = parts_[0].memory->data();
    if (parts_.size() > 1) {
      v.rope_data = parts_[1].memory->data();
      v.stride_rope_block_bytes = parts_[1].far_block_bytes;
    }
    return v;
  }

  // Copies the far blocks into the small cache's device buffers, where the usual comparisons can
  // look at them, and expects each part's head and the gaps of its far blocks still to be the
  // sentinel.
  void copy_tail_to_small_and_check_head() const {
    for (const FarPart& part : parts_) {
      const std::vector<uint8_t> tail = part.download(part.tail_offset, part.tail_bytes());
      std::vector<uint8_t> blocks, gaps;
      for (int64_t b = 0; b < part.num_blocks; ++b) {
        const auto first = tail.begin() + b * part.far_block_bytes;
        blocks.insert(blocks.end(), first, first + part.block_bytes);
        gaps.insert(gaps.end(), first + part.block_bytes, first + part.far_block_bytes);
      }
      copy_host_to_device(part.small->device(), part.small->device_ptr(), blocks.data(),
                          blocks.size());
      EXPECT_TRUE(bytes_equal(gaps, std::vector<uint8_t>(gaps.size(), kSentinelByte),
                              "the gaps between the far cache's blocks"));
      const std::vector<uint8_t> head = part.download(0, part.tail_bytes());
      EXPECT_TRUE(bytes_equal(head, std::vector<uint8_t>(head.size(), kSentinelByte),
                              "the far cache's head"));
    }
  }

 private:
  void add_part(const Buffer& small, int64_t block_bytes, int64_t far_block_bytes) {
    const Device dev = small.device();
    FarPart part;
    part.small = &small;
    part.num_blocks = small_.geometry.num_blocks;
    part.block_bytes = block_bytes;
    part.far_block_bytes = far_block_bytes;
    part.tail_offset = shift_blocks_ * far_block_bytes;
    part.memory =
        std::make_unique<FarMemory>(dev, static_cast<size_t>(part.tail_offset + part.tail_bytes()));
    device_memset(dev, at(*part.memory, 0), kSentinelByte, static_cast<size_t>(part.tail_bytes()));
    device_memset(dev, at(*part.memory, part.tail_offset), kSentinelByte,
                  static_cast<size_t>(part.tail_bytes()));
    for (int64_t b = 0; b < part.num_blocks; ++b) {
      part.memory->upload(small.initial.data() + b * block_bytes, static_cast<size_t>(block_bytes),
                          static_cast<size_t>(part.tail_offset + b * far_block_bytes));
    }
    parts_.push_back(std::move(part));
  }

  const TestCache& small_;
  int64_t shift_blocks_ = 0;
  std::vector<FarPart> parts_;
};

// A tensor's rows moved far apart: row r of `t` (its dim 0) lives at r * row_stride_bytes of a
// far allocation, its last row at 2^33 bytes (2^32 elements of 16 bits) and the rows of its second
// half past 2^32 bytes, as in a prefill q of 90K-180K tokens. The rows start as t's initial
// contents (Buffer::initial); copy_back() puts them, as the op left them, into t's device buffer,
// where the usual comparisons see them.
class FarRows {
 public:
  explicit FarRows(const Tensor& t) : t_(t) {
    const int64_t elem = static_cast<int64_t>(dtype_size(t.dtype));
    const int64_t rows = t.shape[0];
    span_bytes_ = elem;
    for (size_t d = 1; d < t.shape.size(); ++d)
      span_bytes_ += (t.shape[d] - 1) * t.stride[d] * elem;
    // Rows of one piece each, apart from one another, at least two of them (the layouts of the
    // tensors moved here; a head-major view would need another copy).
    EXPECT_GE(rows, 2);
    EXPECT_LE(span_bytes_, t.stride[0] * elem) << "rows that overlap";
    // The last row at 2 * kMark or just past it (so row rows / 2 past kMark); 256-byte aligned.
    row_stride_bytes_ = ((2 * kMark + rows - 2) / std::max<int64_t>(rows - 1, 1) + 255) / 256 * 256;
    memory_ = std::make_unique<FarMemory>(
        t.buffer->device(), static_cast<size_t>((rows - 1) * row_stride_bytes_ + span_bytes_));
    for (int64_t r = 0; r < rows; ++r) {
      memory_->upload(t.buffer->initial.data() + row_offset(r), static_cast<size_t>(span_bytes_),
                      static_cast<size_t>(r * row_stride_bytes_));
    }
  }

  TensorView host_view() const { return t_.host_view(); }  // the reference's side: t itself
  TensorView device_view() const {
    TensorView v = t_.device_view();
    v.data = memory_->data();
    v.stride[0] = row_stride_bytes_ / static_cast<int64_t>(dtype_size(t_.dtype));
    return v;
  }

  void copy_back() const {
    const Device dev = t_.buffer->device();
    device_synchronize(dev);
    std::vector<uint8_t> row(static_cast<size_t>(span_bytes_));
    for (int64_t r = 0; r < t_.shape[0]; ++r) {
      copy_device_to_host(dev, row.data(), at(*memory_, r * row_stride_bytes_), row.size());
      copy_host_to_device(dev, static_cast<char*>(t_.buffer->device_ptr()) + row_offset(r),
                          row.data(), row.size());
    }
  }

 private:
  int64_t row_offset(int64_t r) const {
    return (t_.offset + r * t_.stride[0]) * static_cast<int64_t>(dtype_size(t_.dtype));
  }

  Tensor t_;
  int64_t span_bytes_ = 0;
  int64_t row_stride_bytes_ = 0;
  std::unique_ptr<FarMemory> memory_;
};

// Indices shifted into the far cache: non-negative values move by `shift` (an index past the
// small cache's end stays past the far cache's), negative ones (padding) stay. The host side is
// `indices` itself (the reference reads the small cache); the device side a shifted copy of the
// whole buffer behind it, viewed alike.
class Shifted {
 public:
  Shifted(const Tensor& indices, int64_t shift) : indices_(indices) {
    const int64_t count = static_cast<int64_t>(indices.buffer->bytes() / dtype_size(indices.dtype));
    const Tensor all = indices.view(0, {count}, {1});
    std::vector<int64_t> values(static_cast<size_t>(all.shape[0]));
    for (size_t i = 0; i < values.size(); ++i) {
      const int64_t v = all.host_index(static_cast<int64_t>(i));
      values[i] = v < 0 ? v : v + shift;
    }
    shifted_ = index_tensor(indices.buffer->device(), indices.dtype, values)
                   .view(indices.offset, indices.shape, indices.stride);
  }
  TensorView host_view() const { return indices_.host_view(); }
  TensorView device_view() const { return shifted_.device_view(); }

 private:
  Tensor indices_, shifted_;
};

// The problem's reference, then the library on its device params as `relocate` changes them
// (onto far buffers), with the reference's counters expected.
template <typename Relocate>
void run_fused_relocated(FusedProblem& problem, Relocate relocate) {
  const std::vector<int32_t> expected = problem.run_reference();
  MlaRopeCacheParams p = problem.params(false);
  relocate(&p);
  Context ctx;
  ctx.error_counts = problem.counts.device_ptr();
  mla_rope_cache(p, ctx);
  EXPECT_EQ(counts_to_string(problem.counts.read()), counts_to_string(expected));
}

// Expects the entries written (slot in [0, num_slots)) on both sides of the mark.
void expect_straddles(const FarCache& far, const TestCache& small, const Tensor& slots, int64_t n) {
  bool below = false, above = false;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = slots.host_index(i);
    if (s < 0 || s >= small.num_slots()) continue;
    (far.far_offset(s) < kMark ? below : above) = true;
  }
  EXPECT_TRUE(below && above) << "the test's entries should lie on both sides of 2^32 bytes";
}

struct LargeCase {
  std::string name;
  CacheFormat format;
  bool split;
  float scale;  // per-tensor fp8 only
};
void PrintTo(const LargeCase& c, std::ostream* os) { *os << c.name; }

std::vector<LargeCase> large_cases() {
  return {
      {"bf16", CacheFormat::kBFloat16, false, 0},
      {"e4m3_scaled", CacheFormat::kFloat8E4M3, false, 0.043f},
      {"dsmla", CacheFormat::kFloat8DsMla, false, 0},
      {"bf16_split", CacheFormat::kBFloat16, true, 0},
      {"e5m2_split_scaled", CacheFormat::kFloat8E5M2, true, 0.043f},
  };
}

class LargeCache : public testing::TestWithParam<std::tuple<Backend, LargeCase>> {
 protected:
  Device device() const { return std::get<0>(GetParam()).device; }
  const LargeCase& large_case() const { return std::get<1>(GetParam()); }
  CacheGeometry geometry() const {
    CacheGeometry g;
    g.format = large_case().format;
    g.split = large_case().split;
    g.scale = large_case().scale;
    g.block_size = 64;
    return g;
  }
};

// The fused op (a mixed batch with the K side's norm, padding and a slot past the end) writes the
// far blocks as the reference writes the small ones; its other outputs are the usual.
TEST_P(LargeCache, FusedOpWritesPast4GiB) {
  FusedSpec spec;
  spec.name = large_case().name;
  spec.shape = kDeepSeekV3Tp8;
  spec.T = 40;
  spec.Td = 13;
  spec.cache = geometry();
  spec.norm = true;
  spec.k_pe_out = true;
  spec.padding_every = 7;
  spec.bad_slots = 2;
  spec.seed = 2026;
  FusedProblem problem(spec, device());
  const FarCache far(problem.cache);
  expect_straddles(far, problem.cache, problem.slot_mapping, spec.T);
  const Shifted far_slots(problem.slot_mapping, far.shift_slots());
  run_fused_relocated(problem, [&](MlaRopeCacheParams* p) {
    p->kv_cache = far.device_view();
    p->slot_mapping = far_slots.device_view();
  });
  far.copy_tail_to_small_and_check_head();
  problem.expect_matches();
}

// concat_and_cache_mla, the unfused cache write.
TEST_P(LargeCache, ConcatAndCacheWritesPast4GiB) {
  const Device dev = device();
  std::mt19937_64 rng(31);
  CacheGeometry g = geometry();
  g.num_blocks = 4;
  TestCache small = new_cache(dev, g);
  small.data->upload();
  if (small.rope_data) small.rope_data->upload();
  if (small.scale.present()) small.scale.buffer->upload();
  FarCache far(small);
  const int64_t T = 50, rows = T + 2;
  Tensor kv_c = random_tensor(dev, DType::kBFloat16, {rows, g.L}, rng);
  Tensor k_pe = random_tensor(dev, DType::kBFloat16, {rows, g.R}, rng);
  std::vector<int64_t> slot_values(static_cast<size_t>(small.num_slots()));
  std::iota(slot_values.begin(), slot_values.end(), 0);
  std::shuffle(slot_values.begin(), slot_values.end(), rng);
  slot_values.resize(static_cast<size_t>(rows));
  slot_values[3] = -1;                  // padding
  slot_values[8] = small.num_slots();   // past the end: counted, not written
  slot_values[T] = slot_values[T + 1];  // rows >= T: never read
  Tensor slots = index_tensor(dev, DType::kInt64, slot_values);
  expect_straddles(far, small, slots, T);

  const Shifted far_slots(slots, far.shift_slots());
  const BothCounts counts = run_both<ConcatAndCacheMlaParams>(
      dev,
      [&](ConcatAndCacheMlaParams* p, auto v) {
        p->num_tokens = T;
        p->kv_c = v(kv_c);
        p->k_pe = v(k_pe);
        p->slot_mapping = v(far_slots);
        p->kv_cache = v(far);
      },
      [](const ConcatAndCacheMlaParams& p, int32_t* c) { ref::concat_and_cache_mla(p, c); },
      [](const ConcatAndCacheMlaParams& p, const Context& ctx) { concat_and_cache_mla(p, ctx); });
  EXPECT_EQ(counts.expected[kBadSlot], 1);
  EXPECT_EQ(counts_to_string(counts.got), counts_to_string(counts.expected));
  far.copy_tail_to_small_and_check_head();
  std::vector<int64_t> written;
  for (int64_t t = 0; t < T; ++t) {
    if (slot_values[t] >= 0 && slot_values[t] < small.num_slots())
      written.push_back(slot_values[t]);
  }
  expect_cache_matches(small, written, "kv_cache");
}

// The read-back: both gathers read the far blocks as the reference reads the small ones.
TEST_P(LargeCache, GathersReadPast4GiB) {
  const Device dev = device();
  std::mt19937_64 rng(37);
  CacheGeometry g = geometry();
  g.num_blocks = 4;
  TestCache small = new_cache(dev, g);
  fill_cache_with_entries(dev, small, rng);
  FarCache far(small);
  const int64_t n = small.num_slots(), D = g.L + g.R;

  // Slots: every entry once, shuffled, then padding and one past the end.
  std::vector<int64_t> slot_values(static_cast<size_t>(n));
  std::iota(slot_values.begin(), slot_values.end(), 0);
  std::shuffle(slot_values.begin(), slot_values.end(), rng);
  slot_values.push_back(-1);
  slot_values.push_back(n);
  const int64_t N = static_cast<int64_t>(slot_values.size());
  Tensor slots = index_tensor(dev, DType::kInt64, slot_values);
  expect_straddles(far, small, slots, N);
  Tensor out = poisoned_tensor(dev, DType::kBFloat16, {N, D});
  const Shifted far_slots(slots, far.shift_slots());
  const FarRows far_out(out);  // out's rows past 2^32 bytes too, as in a long context's gather
  const BothCounts counts = run_both<GatherCacheSlotsParams>(
      dev,
      [&](GatherCacheSlotsParams* p, auto v) {
        p->num_tokens = N;
        p->kv_cache = v(far);
        p->slots = v(far_slots);
        p->out = v(far_out);
      },
      [](const GatherCacheSlotsParams& p, int32_t* c) { ref::gather_cache_slots(p, c); },
      [](const GatherCacheSlotsParams& p, const Context& ctx) { gather_cache_slots(p, ctx); });
  EXPECT_EQ(counts.expected[kBadSlot], 1);
  EXPECT_EQ(counts_to_string(counts.got), counts_to_string(counts.expected));
  far_out.copy_back();
  EXPECT_TRUE(buffer_matches(*out.buffer, "out of the slots"));

  // Sequences: two of the small cache's blocks each, in reverse order, and one past the end.
  const int64_t B = 2, bs = g.block_size;
  const Tensor block_table =
      index_tensor(dev, DType::kInt32, {3, 2, 1, g.num_blocks}).view(0, {B, 2}, {2, 1});
  const Shifted far_table(block_table, far.shift_blocks());
  const Tensor cu_seq_lens = index_tensor(dev, DType::kInt32, {0, 2 * bs - 5, 4 * bs - 5});
  const Tensor seq_out = poisoned_tensor(dev, DType::kFloat32, {4 * bs - 5, D});
  const BothCounts seq_counts = run_both<GatherCacheSequencesParams>(
      dev,
      [&](GatherCacheSequencesParams* p, auto v) {
        p->num_seqs = B;
        p->kv_cache = v(far);
        p->block_table = v(far_table);
        p->cu_seq_lens = v(cu_seq_lens);
        p->out = v(seq_out);
      },
      [](const GatherCacheSequencesParams& p, int32_t* c) { ref::gather_cache_sequences(p, c); },
      [](const GatherCacheSequencesParams& p, const Context& ctx) {
        gather_cache_sequences(p, ctx);
      });
  EXPECT_GT(seq_counts.expected[kBadBlockIndex], 0);
  EXPECT_EQ(counts_to_string(seq_counts.got), counts_to_string(seq_counts.expected));
  EXPECT_TRUE(buffer_matches(*seq_out.buffer, "out of the sequences"));

  far.copy_tail_to_small_and_check_head();
  EXPECT_TRUE(buffer_unchanged(*small.data, "kv_cache"));
  if (small.rope_data) {
    EXPECT_TRUE(buffer_unchanged(*small.rope_data, "rope cache"));
  }
}

std::string case_name(const testing::TestParamInfo<std::tuple<Backend, LargeCase>>& info) {
  return std::get<0>(info.param).name + "_" + std::get<1>(info.param).name;
}

INSTANTIATE_TEST_SUITE_P(All, LargeCache,
                         testing::Combine(testing::ValuesIn(all_backends()),
                                          testing::ValuesIn(large_cases())),
                         case_name);

// The fused op with q (prefill rows, rotated in place) and q_out (decode rows) far apart (FarRows):
// each one's last row at 2^33 bytes, 2^32 elements of 16 bits. The cache stays small (one combined
// cache of each kind of entry).
class LargeRows : public testing::TestWithParam<Backend> {};

TEST_P(LargeRows, FusedOpQRowsPast4GiB) {
  for (CacheFormat format :
       {CacheFormat::kBFloat16, CacheFormat::kFloat8E4M3, CacheFormat::kFloat8DsMla}) {
    SCOPED_TRACE(cache_format_name(format));
    FusedSpec spec;
    spec.name = cache_format_name(format);
    spec.shape = kDeepSeekV3Tp8;
    // No rows past T, and q_out of exactly Td rows: the last row of each, written, is the one at
    // 2^33 bytes. Past 2^32 bytes: q_out rows 3-5, q rows 4-7 (4 and 5 are decode rows, which the
    // op does not touch in q).
    spec.T = 8;
    spec.Td = 6;
    spec.extra_rows = 0;
    spec.decode_rows_exact = true;
    spec.cache.format = format;
    spec.cache.block_size = 64;
    spec.cache.scale = format == CacheFormat::kFloat8E4M3 ? 0.043f : 0.0f;
    spec.norm = true;
    spec.seed = 2027;
    FusedProblem problem(spec, GetParam().device);
    const FarRows q(problem.q), q_out(problem.q_out);
    run_fused_relocated(problem, [&](MlaRopeCacheParams* p) {
      p->q = q.device_view();
      p->q_out = q_out.device_view();
    });
    q.copy_back();
    q_out.copy_back();
    problem.expect_matches();
  }
}

INSTANTIATE_TEST_SUITE_P(All, LargeRows, testing::ValuesIn(all_backends()), backend_param_name);

}  // namespace
}  // namespace test
}  // namespace mlakv
