// mlakv tests: the helpers behind the `mlakv` tool's verdicts and numbers (cli/util.h): the byte
// comparison `mlakv check` and `mlakv bench` report mismatches by, the percentiles of the bench's
// median and spread, its slot and index data, and its number formats.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "cli/timer.h"
#include "cli/util.h"
#include "mlakv/error.h"

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
  EXPECT_EQ(format_us(12.26), "12.3");
  EXPECT_EQ(format_us(151.64), "151.6");
  EXPECT_EQ(format_us(1234.4), "1234");
}

}  // namespace
}  // namespace cli
}  // namespace mlakv
