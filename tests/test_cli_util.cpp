// mlakv tests: the helpers behind the `mlakv` tool's verdicts and numbers (cli/util.h): the byte
// comparison `mlakv check` and `mlakv bench` report mismatches by, the percentiles of the bench's
// median and spread, the check of its copy kernel, its random cases, slot and index data and
// cos/sin table, its number formats, and the CPU timer (cli/timer_cpu.cpp): sample counts, rotation
// and the copies it times.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "cli/timer.h"
#include "cli/util.h"
#include "common/numerics.h"
#include "mlakv/error.h"
#include "mlakv/tables.h"

namespace mlakv {
namespace cli {
namespace {

// The first index where two byte vectors differ, by std::mismatch, or -1.
int64_t mismatch_at(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  const auto it = std::mismatch(a.begin(), a.end(), b.begin());
  return it.first == a.end() ? -1 : static_cast<int64_t>(it.first - a.begin());
}

TEST(CliFirstDifference, FindsTheFirstDifferingByte) {
  std::mt19937_64 rng(17);
  for (size_t n = 0; n <= 300; n += (n < 40 ? 1 : 37)) {
    std::vector<uint8_t> a(n);
    for (auto& v : a) v = static_cast<uint8_t>(rng());
    std::vector<uint8_t> b = a;
    ASSERT_EQ(first_difference(a.data(), b.data(), n), -1) << "n " << n;
    if (n == 0) continue;
    // One byte, then a second one later: the first is reported.
    for (const size_t at : {size_t{0}, n / 2, n - 1}) {
      std::vector<uint8_t> c = a;
      c[at] ^= static_cast<uint8_t>(1u << (at % 8));
      if (at + 1 < n) c[n - 1] ^= 0x80;
      ASSERT_EQ(first_difference(a.data(), c.data(), n), mismatch_at(a, c))
          << "n " << n << " at " << at;
      ASSERT_EQ(first_difference(a.data(), c.data(), n), static_cast<int64_t>(at));
    }
  }
  // Only the first n bytes count.
  const uint8_t x[4] = {1, 2, 3, 4};
  const uint8_t y[4] = {1, 2, 3, 5};
  EXPECT_EQ(first_difference(x, y, 3), -1);
  EXPECT_EQ(first_difference(x, y, 4), 3);
}

// The bench's check of its copy kernel: a copy short by one byte, one byte past a span, a byte
// missed or stray inside, in any set, is named by its set; the exact copy passes.
TEST(CliCopyCheck, NamesTheFirstBadlyCopiedSet) {
  for (const int sets : {1, 2, 5}) {
    for (const size_t bytes : {size_t{1}, size_t{16}, size_t{100}}) {
      const size_t stride = bytes + 37;
      const size_t total = stride * static_cast<size_t>(sets) + 11;  // room after the last set
      std::vector<uint8_t> good(total, 0);
      for (int s = 0; s < sets; ++s) {
        std::fill_n(good.begin() + s * static_cast<std::ptrdiff_t>(stride), bytes, uint8_t{1});
      }
      ASSERT_EQ(first_badly_copied_set(good, sets, stride, bytes), -1) << sets << " " << bytes;
      for (int s = 0; s < sets; ++s) {
        const size_t begin = static_cast<size_t>(s) * stride;
        const size_t end = s + 1 < sets ? begin + stride : total;
        for (const size_t at :
             {begin, begin + bytes / 2, begin + bytes - 1, begin + bytes, end - 1}) {
          std::vector<uint8_t> bad = good;
          bad[at] ^= 1;  // a byte missed (1 -> 0) or written where it should not be (0 -> 1)
          EXPECT_EQ(first_badly_copied_set(bad, sets, stride, bytes), s)
              << "sets " << sets << " bytes " << bytes << " byte " << at;
        }
      }
    }
  }
}

TEST(CliPercentile, LinearBetweenTheSortedValues) {
  EXPECT_EQ(percentile({}, 50.0), 0.0);
  EXPECT_EQ(percentile({7.0}, 0.0), 7.0);
  EXPECT_EQ(percentile({7.0}, 90.0), 7.0);
  // Unsorted input; rank p / 100 * (n - 1) between the sorted values.
  const std::vector<double> v = {4.0, 1.0, 3.0, 2.0};
  EXPECT_DOUBLE_EQ(percentile(v, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(percentile(v, 100.0), 4.0);
  EXPECT_DOUBLE_EQ(percentile(v, 50.0), 2.5);
  EXPECT_DOUBLE_EQ(percentile(v, 10.0), 1.3);
  EXPECT_DOUBLE_EQ(percentile(v, 90.0), 3.7);
  EXPECT_DOUBLE_EQ(percentile({10.0, 30.0, 20.0}, 50.0), 20.0);
  EXPECT_DOUBLE_EQ(percentile({10.0, 30.0, 20.0}, 25.0), 15.0);

  // Random data: within the values and non-decreasing in p.
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(0.5, 50.0);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<double> w(1 + rng() % 40);
    for (auto& e : w) e = u(rng);
    const auto [lo, hi] = std::minmax_element(w.begin(), w.end());
    double last = *lo;
    for (int p = 0; p <= 100; p += 5) {
      const double q = percentile(w, p);
      ASSERT_GE(q, last) << "p " << p;
      ASSERT_LE(q, *hi);
      last = q;
    }
    ASSERT_EQ(percentile(w, 0.0), *lo);
    ASSERT_EQ(percentile(w, 100.0), *hi);
  }
}

TEST(CliPercentile, SummarizeReportsTheMedianAndSpread) {
  std::vector<double> us;
  for (int i = 10; i >= 0; --i) us.push_back(static_cast<double>(i));  // 0 .. 10, reversed
  const Timing t = summarize(us, 4);
  EXPECT_DOUBLE_EQ(t.median_us, 5.0);
  EXPECT_DOUBLE_EQ(t.p10_us, 1.0);
  EXPECT_DOUBLE_EQ(t.p90_us, 9.0);
  EXPECT_EQ(t.samples, 11);
  EXPECT_EQ(t.launches_per_sample, 4);
}

TEST(CliRandomData, DistinctSlotsInRange) {
  Rng rng(3);
  // Sparse (count * 4 <= num_slots) and dense (a partial shuffle) requests, and all slots.
  for (const auto& [count, num_slots] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 10}, {1, 1}, {5, 1000}, {250, 1000}, {251, 1000}, {999, 1000}, {1000, 1000}}) {
    const std::vector<int64_t> slots = random_distinct_slots(count, num_slots, rng);
    ASSERT_EQ(static_cast<int64_t>(slots.size()), count);
    const std::set<int64_t> seen(slots.begin(), slots.end());
    ASSERT_EQ(static_cast<int64_t>(seen.size()), count) << count << " of " << num_slots;
    if (count > 0) {
      ASSERT_GE(*seen.begin(), 0);
      ASSERT_LT(*seen.rbegin(), num_slots);
    }
  }
  EXPECT_THROW(random_distinct_slots(11, 10, rng), Error);
}

TEST(CliRandomData, IndexBytes) {
  const std::vector<int64_t> values = {0, -1, 7, 2147483647, -2147483648LL};
  const std::vector<uint8_t> b32 = index_bytes(values, DType::kInt32);
  const std::vector<uint8_t> b64 = index_bytes(values, DType::kInt64);
  ASSERT_EQ(b32.size(), values.size() * 4);
  ASSERT_EQ(b64.size(), values.size() * 8);
  for (size_t i = 0; i < values.size(); ++i) {
    int32_t v32;
    int64_t v64;
    std::memcpy(&v32, b32.data() + i * 4, 4);
    std::memcpy(&v64, b64.data() + i * 8, 8);
    EXPECT_EQ(v32, values[i]);
    EXPECT_EQ(v64, values[i]);
  }
  EXPECT_THROW(index_bytes(values, DType::kFloat32), Error);
}

TEST(CliFormat, BytesAndMicroseconds) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(999), "999 B");
  EXPECT_EQ(format_bytes(1000), "1.00 KB");
  EXPECT_EQ(format_bytes(35.09e3), "35.09 KB");
  EXPECT_EQ(format_bytes(1.5e6), "1.50 MB");
  EXPECT_EQ(format_bytes(2.43e9), "2.43 GB");
  EXPECT_EQ(format_bytes(5e15), "5000.00 TB");
  EXPECT_EQ(format_us(2.734), "2.73");
  EXPECT_EQ(format_us(9.994), "9.99");
  EXPECT_EQ(format_us(10.0), "10.0");
  EXPECT_EQ(format_us(12.26), "12.3");
  EXPECT_EQ(format_us(151.64), "151.6");
  EXPECT_EQ(format_us(1000.0), "1000");
  EXPECT_EQ(format_us(1234.4), "1234");
}

// The random cases of `mlakv check` are only as broad as these draws: both ends of between(),
// chance() at its probability, uniform() over its whole range.
TEST(CliRandomData, RngDrawsCoverTheirRanges) {
  Rng rng(11);
  std::set<int64_t> seen;
  for (int i = 0; i < 2000; ++i) {
    const int64_t v = rng.between(-3, 4);
    ASSERT_GE(v, -3);
    ASSERT_LE(v, 4);
    seen.insert(v);
  }
  EXPECT_EQ(seen.size(), 8u);  // -3 .. 4, both ends included

  int hits = 0;
  for (int i = 0; i < 10000; ++i) hits += rng.chance(0.2) ? 1 : 0;
  EXPECT_NEAR(hits, 2000, 200);
  EXPECT_FALSE(rng.chance(0.0));
  EXPECT_TRUE(rng.chance(1.0));

  float lo = 1e9f, hi = -1e9f;
  for (int i = 0; i < 10000; ++i) {
    const float u = rng.uniform(-2.0f, 6.0f);
    ASSERT_GE(u, -2.0f);
    ASSERT_LT(u, 6.0f);
    lo = std::min(lo, u);
    hi = std::max(hi, u);
  }
  EXPECT_LT(lo, -1.99f);
  EXPECT_GT(hi, 5.99f);
}

// random_values: the draws of uniform(-amplitude, amplitude), each rounded to the dtype.
TEST(CliRandomData, RandomValuesAreUniformDrawsRoundedToTheDtype) {
  constexpr int64_t kCount = 4096;
  constexpr float kAmplitude = 2.0f;
  auto expect_rounded_draws = [&](DType dtype, auto tag) {
    using T = decltype(tag);
    Rng rng(21), same(21);
    const std::vector<uint8_t> bytes = random_values(dtype, kCount, kAmplitude, rng);
    ASSERT_EQ(bytes.size(), static_cast<size_t>(kCount) * sizeof(T));
    int negative = 0;
    for (int64_t i = 0; i < kCount; ++i) {
      const T want = num::from_float<T>(same.uniform(-kAmplitude, kAmplitude));
      ASSERT_EQ(std::memcmp(bytes.data() + i * sizeof(T), &want, sizeof(T)), 0)
          << dtype_name(dtype) << " value " << i;
      negative += num::to_float(want) < 0.0f ? 1 : 0;
    }
    EXPECT_NEAR(negative, kCount / 2, kCount / 10) << dtype_name(dtype);
  };
  expect_rounded_draws(DType::kFloat32, float{});
  expect_rounded_draws(DType::kFloat16, num::Half{});
  expect_rounded_draws(DType::kBFloat16, num::Bf16{});
  expect_rounded_draws(DType::kFloat8E4M3, num::Fp8E4M3{});
  expect_rounded_draws(DType::kFloat8E5M2, num::Fp8E5M2{});
  Rng rng(1);
  EXPECT_THROW(random_values(DType::kInt32, 4, 1.0f, rng), Error);
}

// The check's cos/sin table: every row of [max_pos, R], the last one included, in the dtype.
TEST(CliRandomData, RopeTableBytesIsTheWholeTable) {
  constexpr int64_t kMaxPos = 37, kR = 8;
  RopeTableConfig config;
  config.rotary_dim = kR;
  config.max_position = kMaxPos;
  const std::vector<double> table = rope_cos_sin_table(config);
  ASSERT_EQ(table.size(), static_cast<size_t>(kMaxPos * kR));
  const std::vector<uint8_t> f32 = rope_table_bytes(kMaxPos, kR, DType::kFloat32);
  ASSERT_EQ(f32.size(), table.size() * 4);
  for (int64_t p = 0; p < kMaxPos; ++p) {
    for (int64_t i = 0; i < kR / 2; ++i) {
      const double angle = static_cast<double>(p) * std::pow(10000.0, -2.0 * i / kR);
      float c, s;
      std::memcpy(&c, f32.data() + (p * kR + i) * 4, 4);
      std::memcpy(&s, f32.data() + (p * kR + kR / 2 + i) * 4, 4);
      ASSERT_NEAR(c, std::cos(angle), 1e-6) << "row " << p << " column " << i;
      ASSERT_NEAR(s, std::sin(angle), 1e-6) << "row " << p << " column " << i;
    }
  }
  std::vector<uint8_t> bf16(table.size() * 2);
  round_table(table, DType::kBFloat16, bf16.data());
  EXPECT_EQ(rope_table_bytes(kMaxPos, kR, DType::kBFloat16), bf16);
}

// The CPU timer: `iters` samples (0: adaptive, at least 5), every input set in turn.
TEST(CliCpuTimer, SamplesAndRotation) {
  for (const int iters : {1, 7, 0}) {
    std::vector<int> calls(3, 0);
    std::vector<Op> ops;
    for (int k = 0; k < 3; ++k) ops.push_back([&calls, k](void*) { ++calls[k]; });
    const Timing t = make_cpu_timer(iters)->time(ops);
    if (iters > 0) {
      EXPECT_EQ(t.samples, iters);
    } else {
      EXPECT_GE(t.samples, 5);
    }
    EXPECT_EQ(t.launches_per_sample, 1);
    EXPECT_LE(t.p10_us, t.median_us);
    EXPECT_LE(t.median_us, t.p90_us);
    const auto [lo, hi] = std::minmax_element(calls.begin(), calls.end());
    EXPECT_GE(*lo, 1) << "iters " << iters;
    EXPECT_LE(*hi - *lo, 1) << "iters " << iters;  // round robin over the sets
  }
}

// A fixed --iters is honoured even when the samples are slow (only the adaptive count stops early).
TEST(CliCpuTimer, FixedItersAreAllTaken) {
  const Op slow = [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(65)); };
  EXPECT_EQ(make_cpu_timer(6)->time({slow}).samples, 6);
}

// The copy reference the bench's %copy is measured against moves exactly the bytes asked.
TEST(CliCpuTimer, CopiesMoveExactlyTheBytesAsked) {
  const std::unique_ptr<Timer> timer = make_cpu_timer(1);
  std::mt19937_64 rng(9);
  for (const size_t bytes : {size_t{0}, size_t{1}, size_t{4095}, size_t{70001}, size_t{1} << 20}) {
    std::vector<uint8_t> src(bytes + 64), dst(bytes + 64, 0xEE);
    for (auto& v : src) v = static_cast<uint8_t>(rng());
    timer->copy_op(dst.data(), src.data(), bytes)(nullptr);
    ASSERT_EQ(std::memcmp(dst.data(), src.data(), bytes), 0) << bytes << " bytes";
    ASSERT_TRUE(std::all_of(dst.begin() + static_cast<std::ptrdiff_t>(bytes), dst.end(),
                            [](uint8_t b) { return b == 0xEE; }))
        << bytes << " bytes";
  }
  // Pitched rows: 13 rows of 24 bytes from a pitch of 40 to a pitch of 56.
  constexpr size_t kRows = 13, kWidth = 24, kSrcPitch = 40, kDstPitch = 56;
  std::vector<uint8_t> src(kRows * kSrcPitch), dst(kRows * kDstPitch, 0xEE);
  for (auto& v : src) v = static_cast<uint8_t>(rng());
  timer->copy_2d_op(dst.data(), kDstPitch, src.data(), kSrcPitch, kWidth, kRows)(nullptr);
  for (size_t r = 0; r < kRows; ++r) {
    for (size_t b = 0; b < kDstPitch; ++b) {
      const uint8_t want = b < kWidth ? src[r * kSrcPitch + b] : 0xEE;
      ASSERT_EQ(dst[r * kDstPitch + b], want) << "row " << r << " byte " << b;
    }
  }
}

}  // namespace
}  // namespace cli
}  // namespace mlakv
