// mlakv tests: the memory-overlap helpers of src/core/spans.h (checked_mul_add, extent_bytes,
// span_of, bytes_span, cache_span, may_overlap, rows_overlap, MemoryCheck) against brute force over
// bytes: every element a view touches is enumerated into a set of bytes of one buffer, and the
// helpers' answers are compared with those sets (soundness: touched bytes in common => overlap)
// and, for the layouts the design promises to tell apart exactly (views interleaved in one
// padded matrix, adjacent ranges, nested strides), with the exact answer.
#include <gtest/gtest.h>

#include <algorithm>
#include <bitset>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/spans.h"
#include "mlakv/error.h"
#include "mlakv/tensor.h"

namespace mlakv {
namespace {

using core::kMaxExtentBytes;
using core::Span;

constexpr int64_t kBufBytes = 4096;
using ByteSet = std::bitset<kBufBytes>;

// The memory every view of these tests points into. Nothing is read or written through the
// views: the helpers only look at addresses.
char g_buf[kBufBytes];

uintptr_t buf_addr() { return reinterpret_cast<uintptr_t>(g_buf); }

// Bytes from the buffer's start to addr (negative below it).
int64_t buf_offset(uintptr_t addr) { return static_cast<int64_t>(addr - buf_addr()); }

TensorView view(void* data, DType dtype, const std::vector<int64_t>& shape,
                const std::vector<int64_t>& stride) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int32_t>(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    t.shape[d] = shape[d];
    t.stride[d] = stride[d];
  }
  return t;
}

int64_t elem_bytes(const TensorView& t) { return static_cast<int64_t>(dtype_size(t.dtype)); }

// Calls f(offset in bytes of the element from t.data, number of the element) for every element of
// t's rows [first_row, end_row) of dim 0 (end_row < 0: all), in row-major index order.
template <typename F>
void for_each_element(const TensorView& t, int64_t end_row, int64_t first_row, F f) {
  if (!t.present()) return;
  int64_t lo[kMaxDims] = {0, 0, 0, 0};
  int64_t hi[kMaxDims] = {0, 0, 0, 0};
  int64_t idx[kMaxDims] = {0, 0, 0, 0};
  for (int d = 0; d < t.ndim; ++d) hi[d] = t.shape[d];
  lo[0] = first_row;
  if (end_row >= 0) hi[0] = std::min(end_row, t.shape[0]);
  for (int d = 0; d < t.ndim; ++d) {
    if (hi[d] <= lo[d]) return;
    idx[d] = lo[d];
  }
  const int64_t elem = elem_bytes(t);
  for (int64_t n = 0;; ++n) {
    int64_t off = 0;
    for (int d = 0; d < t.ndim; ++d) off += idx[d] * t.stride[d];
    f(off * elem, n);
    int d = t.ndim - 1;
    for (; d >= 0; --d) {
      if (++idx[d] < hi[d]) break;
      idx[d] = lo[d];
    }
    if (d < 0) return;
  }
}

// The bytes of g_buf that rows [first_row, end_row) of t touch.
ByteSet bytes_of(const TensorView& t, int64_t end_row = -1, int64_t first_row = 0) {
  ByteSet s;
  const int64_t start = buf_offset(reinterpret_cast<uintptr_t>(t.data));
  const int64_t elem = elem_bytes(t);
  for_each_element(t, end_row, first_row, [&](int64_t off, int64_t) {
    for (int64_t k = 0; k < elem; ++k) s.set(static_cast<size_t>(start + off + k));
  });
  return s;
}

// Whether two distinct elements of t's rows [0, rows) (rows < 0: all) touch a common byte.
bool brute_rows_overlap(const TensorView& t, int64_t rows) {
  std::vector<int64_t> owner(kBufBytes, -1);
  const int64_t start = buf_offset(reinterpret_cast<uintptr_t>(t.data));
  const int64_t elem = elem_bytes(t);
  bool overlap = false;
  for_each_element(t, rows, 0, [&](int64_t off, int64_t n) {
    for (int64_t k = 0; k < elem; ++k) {
      int64_t& o = owner.at(static_cast<size_t>(start + off + k));
      if (o >= 0 && o != n) overlap = true;
      o = n;
    }
  });
  return overlap;
}

// The bytes a span stands for: those in [base, base + last_row + row_bytes) whose offset from
// base, modulo stride_gcd (when not 0), is below row_bytes. False when it leaves the buffer.
bool hull_of(const Span& s, ByteSet* out) {
  out->reset();
  if (s.row_bytes <= 0) return true;
  const int64_t lo = buf_offset(s.base);
  if (lo < 0 || lo >= kBufBytes || s.last_row < 0 || s.stride_gcd < 0 ||
      s.last_row + s.row_bytes > kBufBytes - lo) {
    return false;
  }
  for (int64_t x = 0; x < s.last_row + s.row_bytes; ++x) {
    if (s.stride_gcd == 0 || x % s.stride_gcd < s.row_bytes) out->set(static_cast<size_t>(lo + x));
  }
  return true;
}

// Span s against the bytes it stands for: empty exactly when they are; otherwise its first and
// last bytes are theirs (base and base + last_row + row_bytes - 1), every one of them lies in its
// hull, and it is one row (last_row 0) when stride_gcd is 0. Returns the hull.
ByteSet expect_span_of_bytes(const Span& s, const ByteSet& bytes, const std::string& what) {
  ByteSet hull;
  if (bytes.none()) {
    EXPECT_EQ(s.row_bytes, 0) << what;
    return hull;
  }
  int64_t first = -1;
  int64_t last = -1;
  for (int64_t i = 0; i < kBufBytes; ++i) {
    if (!bytes.test(static_cast<size_t>(i))) continue;
    if (first < 0) first = i;
    last = i;
  }
  EXPECT_GT(s.row_bytes, 0) << what;
  EXPECT_GE(s.last_row, 0) << what;
  EXPECT_GE(s.stride_gcd, 0) << what;
  if (s.stride_gcd == 0) {
    EXPECT_EQ(s.last_row, 0) << what << ": one row";
  }
  EXPECT_EQ(buf_offset(s.base), first) << what << ": base";
  EXPECT_EQ(buf_offset(s.base) + s.last_row + s.row_bytes - 1, last) << what << ": last byte";
  if (!hull_of(s, &hull)) {
    ADD_FAILURE() << what << ": the span leaves the buffer";
    return hull;
  }
  EXPECT_TRUE((bytes & ~hull).none()) << what << ": a touched byte outside the span's rows";
  return hull;
}

// The smallest and largest byte of a non-empty set.
std::pair<int64_t, int64_t> byte_range(const ByteSet& s) {
  int64_t first = -1;
  int64_t last = -1;
  for (int64_t i = 0; i < kBufBytes; ++i) {
    if (!s.test(static_cast<size_t>(i))) continue;
    if (first < 0) first = i;
    last = i;
  }
  return {first, last};
}

bool ranges_meet(const ByteSet& a, const ByteSet& b) {
  if (a.none() || b.none()) return false;
  const auto [a0, a1] = byte_range(a);
  const auto [b0, b1] = byte_range(b);
  return a0 <= b1 && b0 <= a1;
}

std::string describe(const TensorView& t, int64_t end_row, int64_t first_row) {
  return t.describe() + " at +" + std::to_string(buf_offset(reinterpret_cast<uintptr_t>(t.data))) +
         " rows [" + std::to_string(first_row) + ", " + std::to_string(end_row) + ")";
}

int64_t uniform(std::mt19937_64& rng, int64_t lo, int64_t hi) {  // [lo, hi]
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

template <typename T, size_t N>
T pick(std::mt19937_64& rng, const T (&values)[N]) {
  return values[static_cast<size_t>(uniform(rng, 0, static_cast<int64_t>(N) - 1))];
}

const DType kDTypes[] = {DType::kUInt8, DType::kBFloat16, DType::kFloat32};  // 1, 2 and 4 bytes

// Strides a size-1 dim may have (never used: any value is accepted there).
const int64_t kUnusedStrides[] = {0, 1, 3, 7, 1000, -1, -5, int64_t{1} << 40};

// ---- checked_mul_add ----------------------------------------------------------------------------

TEST(SpansCheckedMulAdd, BoundsAndOverflow) {
  const int64_t kMax = kMaxExtentBytes;
  int64_t out = -1;
  EXPECT_TRUE(core::checked_mul_add(0, 0, 0, &out));
  EXPECT_EQ(out, 0);
  EXPECT_TRUE(core::checked_mul_add(3, 5, 7, &out));
  EXPECT_EQ(out, 22);
  // The result just below 2^56 is accepted, 2^56 and above are not, from each term.
  EXPECT_TRUE(core::checked_mul_add(1, kMax - 1, 0, &out));
  EXPECT_EQ(out, kMax - 1);
  EXPECT_FALSE(core::checked_mul_add(1, kMax, 0, &out));
  EXPECT_TRUE(core::checked_mul_add(kMax - 1, 1, 0, &out));
  EXPECT_FALSE(core::checked_mul_add(kMax, 1, 0, &out));
  EXPECT_TRUE(core::checked_mul_add(0, 0, kMax - 1, &out));
  EXPECT_EQ(out, kMax - 1);
  EXPECT_FALSE(core::checked_mul_add(0, 0, kMax, &out));
  EXPECT_TRUE(core::checked_mul_add(kMax / 2 - 1, 2, 1, &out));
  EXPECT_EQ(out, kMax - 1);
  EXPECT_FALSE(core::checked_mul_add(kMax / 2 - 1, 2, 2, &out));
  EXPECT_FALSE(core::checked_mul_add(kMax / 2, 2, 0, &out));
  EXPECT_TRUE(core::checked_mul_add(int64_t{1} << 28, (int64_t{1} << 28) - 1,
                                    (int64_t{1} << 28) - 1, &out));
  EXPECT_EQ(out, kMax - 1);
  EXPECT_FALSE(
      core::checked_mul_add(int64_t{1} << 28, (int64_t{1} << 28) - 1, int64_t{1} << 28, &out));
  EXPECT_FALSE(core::checked_mul_add(int64_t{1} << 31, int64_t{1} << 31, 0, &out));
  EXPECT_FALSE(core::checked_mul_add(std::numeric_limits<int64_t>::max(), 1, 0, &out));
  // Negative operands, each alone (the result would be small and positive).
  EXPECT_FALSE(core::checked_mul_add(-1, 1, 5, &out));
  EXPECT_FALSE(core::checked_mul_add(1, -1, 5, &out));
  EXPECT_FALSE(core::checked_mul_add(1, 1, -1, &out));
  EXPECT_FALSE(core::checked_mul_add(-1, -1, 0, &out));
  EXPECT_FALSE(core::checked_mul_add(-3, 0, 1, &out));
  EXPECT_FALSE(core::checked_mul_add(0, -3, 1, &out));
  EXPECT_FALSE(core::checked_mul_add(-1, -1, -1, &out));
  // Overflow of the product (2^64 wraps to 0) and of the sum (wraps negative).
  EXPECT_FALSE(core::checked_mul_add(int64_t{1} << 32, int64_t{1} << 32, 0, &out));
  EXPECT_FALSE(core::checked_mul_add(int64_t{1} << 32, int64_t{1} << 32, 5, &out));
  EXPECT_FALSE(core::checked_mul_add(std::numeric_limits<int64_t>::max(), 2, 0, &out));
  EXPECT_FALSE(core::checked_mul_add(3, (int64_t{1} << 62) + 1, 0, &out));  // wraps to 2^62 + 3
  EXPECT_FALSE(core::checked_mul_add(1, std::numeric_limits<int64_t>::max(), 1, &out));
  EXPECT_FALSE(core::checked_mul_add(1, std::numeric_limits<int64_t>::max(),
                                     std::numeric_limits<int64_t>::max(), &out));
}

// ---- canonical_stride ---------------------------------------------------------------------------

TEST(SpansCanonicalStride, SizeOneDims) {
  const DType bf16 = DType::kBFloat16;
  // Dims of size > 1 keep their stride; a contiguous view's strides are its own.
  const TensorView c = view(g_buf, bf16, {2, 1, 1, 4}, {4, 4, 4, 1});
  for (int d = 0; d < c.ndim; ++d) EXPECT_EQ(core::canonical_stride(c, d), c.stride[d]) << d;
  // A size-1 dim under an outer dim of size > 1 takes that dim's stride ([T, 1, D] slices of a
  // wider buffer stay one run); without one, the contiguous stride over its inner dims.
  const TensorView slice = view(g_buf, bf16, {5, 1, 64}, {576, 7, 1});
  EXPECT_EQ(core::canonical_stride(slice, 1), 576);
  const TensorView one_token = view(g_buf, bf16, {1, 8, 64}, {3, 96, 1});
  EXPECT_EQ(core::canonical_stride(one_token, 0), 8 * 96);
  const TensorView transposed = view(g_buf, bf16, {1, 512}, {1, 1});  // torch [512, 1].t()
  EXPECT_EQ(core::canonical_stride(transposed, 0), 512);
  const TensorView single = view(g_buf, bf16, {1, 1, 1}, {5, 9, 3});
  EXPECT_EQ(core::canonical_stride(single, 2), 1);
  EXPECT_EQ(core::canonical_stride(single, 1), 1);
  EXPECT_EQ(core::canonical_stride(single, 0), 1);
  // The nearest outer dim of size > 1, not the outermost one, and past outer dims of size 1.
  const TensorView nested = view(g_buf, bf16, {3, 2, 1, 8}, {40, 16, 7, 1});
  EXPECT_EQ(core::canonical_stride(nested, 2), 16);
  const TensorView skip = view(g_buf, bf16, {3, 1, 1, 8}, {40, 5, 7, 1});
  EXPECT_EQ(core::canonical_stride(skip, 2), 40);
  EXPECT_EQ(core::canonical_stride(skip, 1), 40);
}

TEST(SpansCanonicalStride, EmptyViewsDoNotOverflow) {
  // An empty view's sizes and strides are bounded one by one (extent_bytes), not their products:
  // the contiguous stride over [2^20 + 1] rows of stride 2^50 does not fit in 64 bits. Any stride
  // serves a view that addresses nothing; the product must not be computed in signed arithmetic.
  const int64_t rows = (int64_t{1} << 20) + 1;
  const TensorView t = view(nullptr, DType::kBFloat16, {0, rows, 576}, {1, int64_t{1} << 50, 1});
  EXPECT_EQ(core::canonical_stride(t, 0), 0);
}

// ---- extent_bytes -------------------------------------------------------------------------------

TEST(SpansExtentBytes, SizeAndStrideBounds) {
  const int64_t kMax = kMaxExtentBytes;
  const int64_t kMin64 = std::numeric_limits<int64_t>::min();
  const int64_t kMax64 = std::numeric_limits<int64_t>::max();
  void* p = g_buf + 64;
  int64_t bytes = -1;
  auto ok = [&](const TensorView& t, int64_t expect) {
    bytes = -1;
    const bool r = core::extent_bytes(t, &bytes);
    EXPECT_TRUE(r) << t.describe();
    if (r) {
      EXPECT_EQ(bytes, expect) << t.describe();
    }
  };
  auto bad = [&](const TensorView& t) {
    EXPECT_FALSE(core::extent_bytes(t, &bytes)) << t.describe();
  };

  ok(TensorView{}, 0);  // absent
  // A size at the bound: the extent follows from it.
  ok(view(p, DType::kUInt8, {kMax - 1}, {1}), kMax - 1);
  bad(view(p, DType::kUInt8, {kMax}, {1}));
  ok(view(p, DType::kFloat32, {kMax / 4 - 1}, {1}), kMax - 4);
  bad(view(p, DType::kFloat32, {kMax / 4}, {1}));
  // Sizes and strides at the bound where they are not used: empty views and size-1 dims.
  ok(view(p, DType::kUInt8, {kMax - 1, 0}, {1, 1}), 0);
  bad(view(p, DType::kUInt8, {kMax, 0}, {1, 1}));
  bad(view(p, DType::kUInt8, {0, kMax}, {1, 1}));
  ok(view(p, DType::kUInt8, {0, kMax - 1}, {1, 1}), 0);
  ok(view(p, DType::kUInt8, {0, 3}, {kMax - 1, 1}), 0);
  bad(view(p, DType::kUInt8, {0, 3}, {kMax, 1}));
  ok(view(p, DType::kUInt8, {0, 3}, {-(kMax - 1), 1}), 0);
  bad(view(p, DType::kUInt8, {0, 3}, {-kMax, 1}));
  bad(view(p, DType::kUInt8, {3, 0}, {1, kMax}));
  bad(view(p, DType::kUInt8, {3, 0}, {1, -kMax}));
  ok(view(p, DType::kFloat32, {1, 5}, {kMax - 1, 1}), 20);
  bad(view(p, DType::kFloat32, {1, 5}, {kMax, 1}));
  ok(view(p, DType::kFloat32, {1, 5}, {-(kMax - 1), 1}), 20);
  bad(view(p, DType::kFloat32, {1, 5}, {-kMax, 1}));
  ok(view(p, DType::kFloat32, {5, 1}, {1, -(kMax - 1)}), 20);
  bad(view(p, DType::kFloat32, {5, 1}, {1, -kMax}));
  bad(view(p, DType::kFloat32, {5, 1}, {1, kMax}));
  bad(view(p, DType::kFloat32, {5, 1}, {1, kMin64}));
  bad(view(p, DType::kFloat32, {5, 1}, {1, kMax64}));
  ok(view(p, DType::kFloat32, {1}, {kMax - 1}), 4);
  bad(view(p, DType::kFloat32, {1}, {kMax}));
  // A stride at the bound on a used dim: the extent reaches it.
  ok(view(p, DType::kUInt8, {2}, {kMax - 2}), kMax - 1);
  bad(view(p, DType::kUInt8, {2}, {kMax - 1}));
  ok(view(p, DType::kUInt8, {2, 2}, {kMax / 2, kMax / 2 - 2}), kMax - 1);
  bad(view(p, DType::kUInt8, {2, 2}, {kMax / 2, kMax / 2 - 1}));
  ok(view(p, DType::kBFloat16, {2, 2}, {kMax / 4, kMax / 4 - 2}), kMax - 2);
  bad(view(p, DType::kBFloat16, {2, 2}, {kMax / 4, kMax / 4 - 1}));
  // Negative strides on dims of size > 1.
  bad(view(p, DType::kUInt8, {2}, {-1}));
  bad(view(p, DType::kUInt8, {2, 3}, {3, -1}));
  bad(view(p, DType::kUInt8, {2, 3}, {-3, 1}));
  ok(view(p, DType::kUInt8, {2, 3}, {0, 0}), 1);
}

TEST(SpansExtentBytes, EndOfTheAddressSpace) {
  int64_t bytes = -1;
  auto at = [](uintptr_t a) { return reinterpret_cast<void*>(a); };
  // One past the last byte must fit in uintptr_t.
  EXPECT_TRUE(core::extent_bytes(view(at(UINTPTR_MAX - 3), DType::kUInt8, {3}, {1}), &bytes));
  EXPECT_EQ(bytes, 3);
  EXPECT_FALSE(core::extent_bytes(view(at(UINTPTR_MAX - 3), DType::kUInt8, {4}, {1}), &bytes));
  EXPECT_FALSE(core::extent_bytes(view(at(UINTPTR_MAX - 3), DType::kFloat32, {1}, {1}), &bytes));
  EXPECT_TRUE(core::extent_bytes(view(at(UINTPTR_MAX - 4), DType::kFloat32, {1}, {1}), &bytes));
  EXPECT_EQ(bytes, 4);
  EXPECT_TRUE(core::extent_bytes(view(at(UINTPTR_MAX - 1), DType::kUInt8, {1}, {1}), &bytes));
  EXPECT_FALSE(core::extent_bytes(view(at(UINTPTR_MAX), DType::kUInt8, {1}, {1}), &bytes));
  EXPECT_TRUE(core::extent_bytes(view(at(UINTPTR_MAX), DType::kUInt8, {0}, {1}), &bytes));
  EXPECT_EQ(bytes, 0);
}

// Random small views (sizes 0-5, strides 0-40, arbitrary strides on size-1 dims): the extent is
// one past the largest byte offset of an element.
TEST(SpansExtentBytes, MatchesLargestOffset) {
  std::mt19937_64 rng(1234);
  for (int iter = 0; iter < 3000; ++iter) {
    const DType dtype = pick(rng, kDTypes);
    const int ndim = static_cast<int>(uniform(rng, 1, kMaxDims));
    std::vector<int64_t> shape;
    std::vector<int64_t> stride;
    for (int d = 0; d < ndim; ++d) {
      shape.push_back(uniform(rng, 0, 12) == 0 ? 0 : uniform(rng, 1, 5));
      stride.push_back(shape.back() == 1 ? pick(rng, kUnusedStrides) : uniform(rng, 0, 40));
    }
    const TensorView t = view(g_buf + uniform(rng, 0, 7), dtype, shape, stride);
    int64_t expect = 0;
    for_each_element(t, -1, 0,
                     [&](int64_t off, int64_t) { expect = std::max(expect, off + elem_bytes(t)); });
    int64_t bytes = -1;
    ASSERT_TRUE(core::extent_bytes(t, &bytes)) << t.describe();
    EXPECT_EQ(bytes, expect) << t.describe();
    // The same view, non-empty, with one dim of size > 1 made negative is refused.
    for (int d = 0; d < ndim && expect > 0; ++d) {
      if (t.shape[d] <= 1 || t.stride[d] == 0) continue;
      TensorView n = t;
      n.stride[d] = -n.stride[d];
      EXPECT_FALSE(core::extent_bytes(n, &bytes)) << n.describe();
    }
  }
}

// ---- span_of, bytes_span, cache_span ------------------------------------------------------------

TEST(SpansSpanOf, DocumentedRows) {
  // q [T, H, P + R] with contiguous heads: one row.
  const Span q = core::span_of("q", view(g_buf, DType::kBFloat16, {3, 2, 8}, {16, 8, 1}));
  EXPECT_STREQ(q.name, "q");
  EXPECT_EQ(q.base, buf_addr());
  EXPECT_EQ(q.row_bytes, 96);
  EXPECT_EQ(q.last_row, 0);
  EXPECT_EQ(q.stride_gcd, 0);
  // Column-major scales [T, G] with stride [1, 8]: rows along T.
  const TensorView scales = view(g_buf + 4, DType::kFloat32, {5, 3}, {1, 8});
  Span s = core::span_of("scales", scales);
  EXPECT_EQ(s.base, buf_addr() + 4);
  EXPECT_EQ(s.row_bytes, 20);
  EXPECT_EQ(s.last_row, 64);
  EXPECT_EQ(s.stride_gcd, 32);
  s = core::span_of("scales", scales, 3, 1);
  EXPECT_EQ(s.base, buf_addr() + 8);
  EXPECT_EQ(s.row_bytes, 8);
  EXPECT_EQ(s.last_row, 64);
  EXPECT_EQ(s.stride_gcd, 32);
  // Padded rows [4, 6] of pitch 10: rows [1, 3).
  s = core::span_of("x", view(g_buf, DType::kBFloat16, {4, 6}, {10, 1}), 3, 1);
  EXPECT_EQ(s.base, buf_addr() + 20);
  EXPECT_EQ(s.row_bytes, 12);
  EXPECT_EQ(s.last_row, 20);
  EXPECT_EQ(s.stride_gcd, 20);
  s = core::span_of("x", view(g_buf, DType::kBFloat16, {4, 6}, {10, 1}), 99, 3);
  EXPECT_EQ(s.base, buf_addr() + 60);
  EXPECT_EQ(s.row_bytes, 12);
  EXPECT_EQ(s.last_row, 0);
  EXPECT_EQ(s.stride_gcd, 0);
  // Empty: no rows, a size-0 dim, absent, null data.
  const TensorView x = view(g_buf, DType::kFloat32, {4, 6}, {6, 1});
  EXPECT_EQ(core::span_of("x", x, 2, 2).row_bytes, 0);
  EXPECT_EQ(core::span_of("x", x, 1, 2).row_bytes, 0);
  EXPECT_EQ(core::span_of("x", x, -1, 4).row_bytes, 0);
  EXPECT_EQ(core::span_of("x", x, 0).row_bytes, 0);
  EXPECT_EQ(core::span_of("x", view(g_buf, DType::kFloat32, {4, 0}, {6, 1})).row_bytes, 0);
  EXPECT_EQ(core::span_of("x", TensorView{}).row_bytes, 0);
  EXPECT_EQ(core::span_of("x", view(nullptr, DType::kFloat32, {4, 6}, {6, 1})).row_bytes, 0);
  // bytes_span.
  EXPECT_EQ(core::bytes_span("b", nullptr, 8).row_bytes, 0);
  EXPECT_EQ(core::bytes_span("b", g_buf, 0).row_bytes, 0);
  EXPECT_EQ(core::bytes_span("b", g_buf, -4).row_bytes, 0);
  s = core::bytes_span("b", g_buf + 3, 8);
  EXPECT_EQ(s.base, buf_addr() + 3);
  EXPECT_EQ(s.row_bytes, 8);
  EXPECT_EQ(s.last_row, 0);
  EXPECT_EQ(s.stride_gcd, 0);
}

// A view with its rows [first_row, end_row) of dim 0.
struct Sample {
  TensorView t;
  int64_t end_row = -1;
  int64_t first_row = 0;
};

Sample random_sample(std::mt19937_64& rng) {
  Sample s;
  const DType dtype = pick(rng, kDTypes);
  const int ndim = static_cast<int>(uniform(rng, 1, 3));
  std::vector<int64_t> shape;
  std::vector<int64_t> stride;
  for (int d = 0; d < ndim; ++d) {
    shape.push_back(uniform(rng, 0, 15) == 0 ? 0 : uniform(rng, 1, 5));
    if (shape.back() == 1) {
      stride.push_back(pick(rng, kUnusedStrides));
    } else {
      stride.push_back(uniform(rng, 0, 15) == 0 ? 0 : uniform(rng, 1, 40));
    }
  }
  s.t = view(g_buf + uniform(rng, 0, 1023), dtype, shape, stride);
  if (uniform(rng, 0, 2) == 0) s.first_row = uniform(rng, 0, shape[0]);
  s.end_row = uniform(rng, 0, 2) == 0 ? uniform(rng, 0, shape[0] + 1) : -1;
  return s;
}

// Random views in one buffer: each span bounds its view's bytes (first and last byte, the
// residues of its rows), may_overlap holds for every two that share a byte (soundness), and is
// exact where the spans' description allows it: when the span that starts first is one row or has
// a stride_gcd dividing the other's, may_overlap says whether their rows meet.
TEST(SpansMayOverlap, RandomViewsAgainstBytes) {
  std::mt19937_64 rng(42);
  constexpr int kViews = 300;
  std::vector<Sample> samples;
  std::vector<Span> spans;
  std::vector<ByteSet> bytes;
  std::vector<ByteSet> hulls;
  for (int i = 0; i < kViews; ++i) {
    samples.push_back(random_sample(rng));
    const Sample& s = samples.back();
    spans.push_back(core::span_of("v", s.t, s.end_row, s.first_row));
    bytes.push_back(bytes_of(s.t, s.end_row, s.first_row));
    hulls.push_back(
        expect_span_of_bytes(spans.back(), bytes.back(), describe(s.t, s.end_row, s.first_row)));
    if (::testing::Test::HasFatalFailure()) return;
  }
  int64_t interleaved_disjoint = 0;
  int64_t exact_checked = 0;
  for (int i = 0; i < kViews; ++i) {
    for (int j = i; j < kViews; ++j) {
      const Span& a = spans[static_cast<size_t>(i)];
      const Span& b = spans[static_cast<size_t>(j)];
      const bool ab = core::may_overlap(a, b);
      const bool ba = core::may_overlap(b, a);
      const bool share = (bytes[static_cast<size_t>(i)] & bytes[static_cast<size_t>(j)]).any();
      const bool hulls_meet = (hulls[static_cast<size_t>(i)] & hulls[static_cast<size_t>(j)]).any();
      auto what = [&] {
        const Sample& x = samples[static_cast<size_t>(i)];
        const Sample& y = samples[static_cast<size_t>(j)];
        return describe(x.t, x.end_row, x.first_row) + " vs " +
               describe(y.t, y.end_row, y.first_row);
      };
      EXPECT_EQ(ab, ba) << what();
      if (share) {
        EXPECT_TRUE(ab) << what() << ": sharing a byte";
      }
      if (hulls_meet) {
        EXPECT_TRUE(ab) << what() << ": rows meeting";
      }
      if (a.row_bytes == 0 || b.row_bytes == 0) {
        EXPECT_FALSE(ab) << what() << ": empty";
      }
      const Span& lower = a.base <= b.base ? a : b;
      const Span& upper = a.base <= b.base ? b : a;
      if (lower.stride_gcd == 0 || upper.stride_gcd % lower.stride_gcd == 0) {
        EXPECT_EQ(ab, hulls_meet) << what() << ": exact";
        ++exact_checked;
      }
      if (!ab && ranges_meet(bytes[static_cast<size_t>(i)], bytes[static_cast<size_t>(j)])) {
        ++interleaved_disjoint;
      }
    }
  }
  EXPECT_GT(interleaved_disjoint, 0);
  EXPECT_GT(exact_checked, 1000);
}

// Rectangular blocks of one padded matrix (rows [r0, r1), bytes [c0, c1) of each row), as 2-D and
// 3-D row-major views, column-major views, with rows chosen by span_of's first_row / end_row and
// with size-1 dims of any stride: the span describes exactly the block's bytes, and may_overlap of
// two blocks is exact (interleaved column blocks are disjoint).
struct Block {
  int64_t r0, r1, c0, c1;
};

Sample view_of_block(char* m, int64_t pitch, DType dtype, const Block& b, std::mt19937_64& rng) {
  const int64_t e = static_cast<int64_t>(dtype_size(dtype));
  const int64_t pe = pitch / e;
  const int64_t w = (b.c1 - b.c0) / e;
  const int64_t rows = b.r1 - b.r0;
  Sample s;
  switch (uniform(rng, 0, 3)) {
    case 0:
      s.t = view(m + b.r0 * pitch + b.c0, dtype, {rows, w}, {pe, 1});
      break;
    case 1: {
      const int64_t extra = uniform(rng, 0, 2);
      s.t = view(m + b.c0, dtype, {b.r1 + extra, w}, {pe, 1});
      s.first_row = b.r0;
      const int64_t ends[] = {-1, b.r1, b.r1 + 3};
      s.end_row = extra > 0 ? b.r1 : pick(rng, ends);
      break;
    }
    case 2: {
      std::vector<int64_t> divisors;
      for (int64_t h = 1; h <= rows; ++h) {
        if (rows % h == 0) divisors.push_back(h);
      }
      const int64_t h =
          divisors[static_cast<size_t>(uniform(rng, 0, static_cast<int64_t>(divisors.size()) - 1))];
      if (b.r0 % h == 0 && uniform(rng, 0, 1) == 0) {
        s.t = view(m + b.c0, dtype, {b.r1 / h, h, w}, {h * pe, pe, 1});
        s.first_row = b.r0 / h;
      } else {
        s.t = view(m + b.r0 * pitch + b.c0, dtype, {rows / h, h, w}, {h * pe, pe, 1});
      }
      break;
    }
    default: {
      const int64_t extra = b.c1 < pitch ? uniform(rng, 0, 1) : 0;
      s.t = view(m + b.r0 * pitch, dtype, {b.c1 / e + extra, rows}, {1, pe});
      s.first_row = b.c0 / e;
      const int64_t ends[] = {-1, b.c1 / e};
      s.end_row = extra > 0 ? b.c1 / e : pick(rng, ends);
      break;
    }
  }
  if (uniform(rng, 0, 1) == 0 && s.t.ndim < kMaxDims) {
    // A size-1 dim of any stride: it must not change the span.
    const bool all_rows = s.first_row == 0 && s.end_row < 0;
    const int pos = static_cast<int>(uniform(rng, all_rows ? 0 : 1, s.t.ndim));
    for (int d = s.t.ndim; d > pos; --d) {
      s.t.shape[d] = s.t.shape[d - 1];
      s.t.stride[d] = s.t.stride[d - 1];
    }
    s.t.shape[pos] = 1;
    s.t.stride[pos] = pick(rng, kUnusedStrides);
    ++s.t.ndim;
    if (pos == 0) {
      const int64_t ends[] = {-1, 1, 3};
      s.end_row = pick(rng, ends);
    }
  }
  return s;
}

ByteSet block_bytes(const char* m, int64_t pitch, const Block& b) {
  ByteSet s;
  const int64_t start = buf_offset(reinterpret_cast<uintptr_t>(m));
  for (int64_t r = b.r0; r < b.r1; ++r) {
    for (int64_t c = b.c0; c < b.c1; ++c) s.set(static_cast<size_t>(start + r * pitch + c));
  }
  return s;
}

TEST(SpansMayOverlap, BlocksOfAPaddedMatrixAreExact) {
  std::mt19937_64 rng(7);
  int64_t interleaved_disjoint = 0;
  int64_t adjacent = 0;
  for (int iter = 0; iter < 10000; ++iter) {
    const int64_t pitch = 4 * uniform(rng, 1, 16);
    const int64_t nrows = uniform(rng, 1, 6);
    char* m = g_buf + uniform(rng, 0, 15);
    Sample v[2];
    ByteSet expect[2];
    Span span[2];
    for (int k = 0; k < 2; ++k) {
      const DType dtype = pick(rng, kDTypes);
      const int64_t e = static_cast<int64_t>(dtype_size(dtype));
      Block b;
      b.r0 = uniform(rng, 0, nrows - 1);
      b.r1 = uniform(rng, b.r0 + 1, nrows);
      b.c0 = e * uniform(rng, 0, pitch / e - 1);
      b.c1 = e * uniform(rng, b.c0 / e + 1, pitch / e);
      v[k] = view_of_block(m, pitch, dtype, b, rng);
      expect[k] = block_bytes(m, pitch, b);
      const std::string what = describe(v[k].t, v[k].end_row, v[k].first_row);
      ASSERT_EQ(bytes_of(v[k].t, v[k].end_row, v[k].first_row), expect[k]) << what;
      span[k] = core::span_of("block", v[k].t, v[k].end_row, v[k].first_row);
      const ByteSet hull = expect_span_of_bytes(span[k], expect[k], what);
      EXPECT_EQ(hull, expect[k]) << what << ": the span is exactly the block";
      if (::testing::Test::HasFailure()) return;
    }
    const bool share = (expect[0] & expect[1]).any();
    const std::string what = describe(v[0].t, v[0].end_row, v[0].first_row) + " vs " +
                             describe(v[1].t, v[1].end_row, v[1].first_row) + " pitch " +
                             std::to_string(pitch);
    EXPECT_EQ(core::may_overlap(span[0], span[1]), share) << what;
    EXPECT_EQ(core::may_overlap(span[1], span[0]), share) << what;
    if (!share && ranges_meet(expect[0], expect[1])) ++interleaved_disjoint;
    if (!share && (expect[0] | expect[1]).count() == expect[0].count() + expect[1].count()) {
      const auto r0 = byte_range(expect[0]);
      const auto r1 = byte_range(expect[1]);
      if (r0.second + 1 == r1.first || r1.second + 1 == r0.first) ++adjacent;
    }
    if (::testing::Test::HasFailure()) return;
  }
  EXPECT_GT(interleaved_disjoint, 500);
  EXPECT_GT(adjacent, 10);
}

// The layouts DESIGN.md names, written out.
TEST(SpansMayOverlap, InterleavedViewsOfOneBuffer) {
  // kv_a's output [T, L + R]: kv_c = [:, :L], k_pe = [:, L:].
  {
    const int64_t T = 5, L = 32, R = 8;
    const TensorView kv_c = view(g_buf + 2, DType::kBFloat16, {T, L}, {L + R, 1});
    const TensorView k_pe = view(g_buf + 2 + 2 * L, DType::kBFloat16, {T, R}, {L + R, 1});
    const Span c = core::span_of("kv_c", kv_c);
    const Span p = core::span_of("k_pe", k_pe);
    EXPECT_FALSE(core::may_overlap(c, p));
    EXPECT_FALSE(core::may_overlap(p, c));
    const Span all = core::span_of("kv", view(g_buf + 2, DType::kBFloat16, {T, L + R}, {L + R, 1}));
    EXPECT_TRUE(core::may_overlap(c, all));
    EXPECT_TRUE(core::may_overlap(all, p));
    // k_pe one element to the left shares kv_c's last column; one to the right leaves a gap.
    const Span p_left =
        core::span_of("k_pe", view(g_buf + 2 * L, DType::kBFloat16, {T, R}, {L + R, 1}));
    EXPECT_TRUE(core::may_overlap(c, p_left));
    EXPECT_TRUE(core::may_overlap(p_left, c));
    const Span p_right =
        core::span_of("k_pe", view(g_buf + 4 + 2 * L, DType::kBFloat16, {T, R - 1}, {L + R, 1}));
    EXPECT_FALSE(core::may_overlap(c, p_right));
    EXPECT_FALSE(core::may_overlap(p_right, c));
    // k_pe one element wider wraps onto the next row's kv_c.
    const Span p_wide =
        core::span_of("k_pe", view(g_buf + 2 + 2 * L, DType::kBFloat16, {T, R + 1}, {L + R, 1}));
    EXPECT_TRUE(core::may_overlap(c, p_wide));
    EXPECT_TRUE(core::may_overlap(p_wide, c));
    // Rows of kv_c after the last row of k_pe: their byte ranges are disjoint.
    EXPECT_FALSE(
        core::may_overlap(core::span_of("kv_c", kv_c, -1, 3), core::span_of("k_pe", k_pe, 2, 0)));
  }
  // q_out [T, H, L + R]: nope = [..., :L], rope = [..., L:].
  {
    const int64_t T = 3, H = 4, L = 16, R = 8;
    const TensorView nope = view(g_buf + 1, DType::kFloat32, {T, H, L}, {H * (L + R), L + R, 1});
    const TensorView rope =
        view(g_buf + 1 + 4 * L, DType::kFloat32, {T, H, R}, {H * (L + R), L + R, 1});
    EXPECT_FALSE(core::may_overlap(core::span_of("nope", nope), core::span_of("rope", rope)));
    EXPECT_FALSE(core::may_overlap(core::span_of("rope", rope), core::span_of("nope", nope)));
    EXPECT_FALSE(
        core::may_overlap(core::span_of("nope", nope, 2, 1), core::span_of("rope", rope, 3, 0)));
    // A head-major view of rope ([H, T, R]) is the same memory.
    const TensorView rope_hm =
        view(g_buf + 1 + 4 * L, DType::kFloat32, {H, T, R}, {L + R, H * (L + R), 1});
    EXPECT_FALSE(core::may_overlap(core::span_of("nope", nope), core::span_of("rope", rope_hm)));
    const TensorView nope_wide =
        view(g_buf + 1, DType::kFloat32, {T, H, L + 1}, {H * (L + R), L + R, 1});
    EXPECT_TRUE(core::may_overlap(core::span_of("nope", nope_wide), core::span_of("rope", rope)));
  }
  // Three column blocks of one [6, 40-byte] matrix with padded rows.
  {
    char* m = g_buf + 8;
    const Span a = core::span_of("a", view(m, DType::kFloat32, {6, 3}, {10, 1}));        // [0, 12)
    const Span b = core::span_of("b", view(m + 12, DType::kUInt8, {6, 20}, {40, 1}));    // [12, 32)
    const Span c = core::span_of("c", view(m + 34, DType::kBFloat16, {6, 3}, {20, 1}));  // [34, 40)
    const Span d = core::span_of("d", view(m + 11, DType::kUInt8, {6, 2}, {40, 1}));     // [11, 13)
    for (const Span* x : {&a, &b, &c}) {
      for (const Span* y : {&a, &b, &c}) {
        EXPECT_EQ(core::may_overlap(*x, *y), x == y);
      }
    }
    EXPECT_TRUE(core::may_overlap(a, d));
    EXPECT_TRUE(core::may_overlap(d, b));
    EXPECT_FALSE(core::may_overlap(c, d));
    // Rows of d: [0, 5) within c's byte range; row 2 alone within a's and c's.
    const TensorView dv = view(m + 11, DType::kUInt8, {6, 2}, {40, 1});
    EXPECT_FALSE(core::may_overlap(c, core::span_of("d", dv, 5)));
    EXPECT_TRUE(core::may_overlap(a, core::span_of("d", dv, 3, 2)));
    EXPECT_FALSE(core::may_overlap(c, core::span_of("d", dv, 3, 2)));
    EXPECT_FALSE(core::may_overlap(core::span_of("d", dv, 3, 2), c));
  }
}

TEST(SpansMayOverlap, AdjacentAndSharedBytes) {
  char* p = g_buf + 100;
  const Span a = core::bytes_span("a", p, 16);
  EXPECT_FALSE(core::may_overlap(a, core::bytes_span("b", p + 16, 8)));
  EXPECT_FALSE(core::may_overlap(core::bytes_span("b", p + 16, 8), a));
  EXPECT_FALSE(core::may_overlap(a, core::bytes_span("b", p - 8, 8)));
  EXPECT_FALSE(core::may_overlap(core::bytes_span("b", p - 8, 8), a));
  EXPECT_TRUE(core::may_overlap(a, core::bytes_span("b", p + 15, 8)));
  EXPECT_TRUE(core::may_overlap(core::bytes_span("b", p + 15, 8), a));
  EXPECT_TRUE(core::may_overlap(a, core::bytes_span("b", p - 8, 9)));
  EXPECT_TRUE(core::may_overlap(core::bytes_span("b", p - 8, 9), a));
  EXPECT_TRUE(core::may_overlap(a, core::bytes_span("b", p + 3, 1)));
  EXPECT_TRUE(core::may_overlap(a, a));
  // Strided: rows of 4 bytes at pitch 10 ([0, 4), [10, 14), [20, 24)).
  const Span s = core::span_of("s", view(p, DType::kUInt8, {3, 4}, {10, 1}));
  EXPECT_TRUE(core::may_overlap(s, core::bytes_span("b", p + 23, 1)));
  EXPECT_TRUE(core::may_overlap(core::bytes_span("b", p + 23, 1), s));
  EXPECT_FALSE(core::may_overlap(s, core::bytes_span("b", p + 24, 1)));
  EXPECT_FALSE(core::may_overlap(core::bytes_span("b", p + 24, 1), s));
  EXPECT_FALSE(core::may_overlap(s, core::bytes_span("b", p - 1, 1)));
  EXPECT_TRUE(core::may_overlap(s, core::bytes_span("b", p + 13, 1)));
  EXPECT_FALSE(core::may_overlap(s, core::bytes_span("b", p + 14, 6)));
  EXPECT_FALSE(core::may_overlap(core::bytes_span("b", p + 14, 6), s));
  EXPECT_TRUE(core::may_overlap(s, core::bytes_span("b", p + 14, 7)));
  EXPECT_TRUE(core::may_overlap(core::bytes_span("b", p + 13, 7), s));
  // Contiguous blocks one after another.
  const TensorView x = view(p, DType::kFloat32, {4, 8}, {8, 1});
  EXPECT_FALSE(core::may_overlap(core::span_of("x", x, 2), core::span_of("x", x, 4, 2)));
  EXPECT_FALSE(core::may_overlap(core::span_of("x", x, 4, 2), core::span_of("x", x, 2)));
  EXPECT_TRUE(core::may_overlap(core::span_of("x", x, 3), core::span_of("x", x, 4, 2)));
}

TEST(SpansMayOverlap, WrapAndEmpty) {
  const void* top = reinterpret_cast<const void*>(static_cast<uintptr_t>(UINTPTR_MAX - 3));
  const Span wrap8 = core::bytes_span("top", top, 8);
  const Span wrap4 = core::bytes_span("top", top, 4);  // one past its last byte is 2^64
  const Span buf = core::bytes_span("buf", g_buf, kBufBytes);
  const Span strided = core::span_of("s", view(g_buf + 8, DType::kUInt8, {3, 4}, {10, 1}));
  for (const Span* w : {&wrap8, &wrap4}) {
    for (const Span* x : {&buf, &strided}) {
      EXPECT_TRUE(core::may_overlap(*w, *x));
      EXPECT_TRUE(core::may_overlap(*x, *w));
    }
  }
  // Near the top without wrapping: an ordinary span.
  const Span high = core::bytes_span(
      "high", reinterpret_cast<const void*>(static_cast<uintptr_t>(UINTPTR_MAX - 7)), 7);
  EXPECT_FALSE(core::may_overlap(high, buf));
  EXPECT_FALSE(core::may_overlap(buf, high));
  EXPECT_TRUE(core::may_overlap(high, high));
  // Empty spans overlap nothing, wherever they are.
  const Span empties[] = {
      core::bytes_span("e", g_buf + 8, 0),
      core::bytes_span("e", top, 0),
      Span{},
      core::span_of("e", view(g_buf + 8, DType::kFloat32, {0, 4}, {4, 1})),
      core::span_of("e", view(g_buf + 8, DType::kFloat32, {2, 4}, {4, 1}), 1, 1),
      core::cache_span("e", g_buf + 8, 0, 4, 64, 16, 16),
  };
  for (const Span& e : empties) {
    EXPECT_EQ(e.row_bytes, 0);
    for (const Span* x : {&buf, &strided, &wrap8, &wrap4, &e}) {
      EXPECT_FALSE(core::may_overlap(e, *x));
      EXPECT_FALSE(core::may_overlap(*x, e));
    }
  }
}

// cache_span against the entries' bytes (entry_bytes at data + b * stride_block + t *
// stride_token): its last row is the last entry's offset, its stride_gcd the gcd of all entries'
// offsets; the stride of a dim of size 1 plays no part, whatever it is.
TEST(SpansCacheSpan, AgainstEntries) {
  std::mt19937_64 rng(99);
  const int64_t kUnused[] = {0, 5, 7, -7, int64_t{1} << 40, (int64_t{1} << 40) + 3};
  std::vector<Span> spans;
  std::vector<ByteSet> sets;
  for (int iter = 0; iter < 2000; ++iter) {
    const int64_t num_blocks = uniform(rng, 0, 4);
    const int64_t block_size = uniform(rng, 1, 4);
    const int64_t entry = uniform(rng, 1, 16);
    const int64_t sb = num_blocks > 1 ? uniform(rng, 0, 96) : pick(rng, kUnused);
    const int64_t st = block_size > 1 ? uniform(rng, 0, 32) : pick(rng, kUnused);
    char* data = g_buf + uniform(rng, 0, 511);
    const Span s = core::cache_span("cache", data, num_blocks, block_size, sb, st, entry);
    ByteSet bytes;
    int64_t last = 0;
    int64_t g = 0;
    for (int64_t b = 0; b < num_blocks; ++b) {
      for (int64_t t = 0; t < block_size; ++t) {
        const int64_t off = (b > 0 ? b * sb : 0) + (t > 0 ? t * st : 0);
        last = std::max(last, off);
        g = std::gcd(g, off);
        for (int64_t k = 0; k < entry; ++k) {
          bytes.set(static_cast<size_t>(buf_offset(reinterpret_cast<uintptr_t>(data)) + off + k));
        }
      }
    }
    const std::string what = "cache " + std::to_string(num_blocks) + " x " +
                             std::to_string(block_size) + " strides " + std::to_string(sb) + ", " +
                             std::to_string(st) + " entry " + std::to_string(entry);
    expect_span_of_bytes(s, bytes, what);
    if (num_blocks > 0) {
      EXPECT_EQ(s.row_bytes, entry) << what;
      EXPECT_EQ(s.last_row, last) << what;
      EXPECT_EQ(s.stride_gcd, g) << what;
    }
    if (::testing::Test::HasFailure()) return;
    spans.push_back(s);
    sets.push_back(bytes);
  }
  // Soundness between caches (and exactness where the lower one's gcd divides the other's).
  for (size_t i = 0; i + 1 < spans.size(); i += 2) {
    const bool share = (sets[i] & sets[i + 1]).any();
    if (share) {
      EXPECT_TRUE(core::may_overlap(spans[i], spans[i + 1]));
    }
    if (share) {
      EXPECT_TRUE(core::may_overlap(spans[i + 1], spans[i]));
    }
  }
  // Two caches interleaved in one buffer (entries of 8 bytes at token stride 16), and a cache
  // against the view of its own memory.
  const Span k0 = core::cache_span("k0", g_buf, 3, 4, 64, 16, 8);
  const Span k1 = core::cache_span("k1", g_buf + 8, 3, 4, 64, 16, 8);
  const Span k2 = core::cache_span("k2", g_buf + 7, 3, 4, 64, 16, 8);
  EXPECT_FALSE(core::may_overlap(k0, k1));
  EXPECT_FALSE(core::may_overlap(k1, k0));
  EXPECT_TRUE(core::may_overlap(k0, k2));
  EXPECT_TRUE(core::may_overlap(k2, k1));
  const Span as_view = core::span_of("v", view(g_buf + 8, DType::kUInt8, {3, 4, 8}, {64, 16, 1}));
  EXPECT_TRUE(core::may_overlap(k1, as_view));
  EXPECT_FALSE(core::may_overlap(k0, as_view));
  // One block or one token per block: the unused stride is ignored.
  for (int64_t unused : kUnused) {
    const Span one_block = core::cache_span("c", g_buf, 1, 4, unused, 16, 8);
    EXPECT_EQ(one_block.last_row, 48);
    EXPECT_EQ(one_block.stride_gcd, 16);
    EXPECT_FALSE(core::may_overlap(one_block, core::cache_span("c", g_buf + 8, 1, 4, 0, 16, 8)));
    const Span one_token = core::cache_span("c", g_buf, 4, 1, 24, unused, 8);
    EXPECT_EQ(one_token.last_row, 72);
    EXPECT_EQ(one_token.stride_gcd, 24);
    EXPECT_FALSE(core::may_overlap(one_token, core::cache_span("c", g_buf + 8, 4, 1, 24, 0, 16)));
    const Span one_entry = core::cache_span("c", g_buf, 1, 1, unused, unused, 8);
    EXPECT_EQ(one_entry.last_row, 0);
    EXPECT_EQ(one_entry.stride_gcd, 0);
  }
}

// ---- rows_overlap -------------------------------------------------------------------------------

TEST(SpansRowsOverlap, Layouts) {
  void* p = g_buf + 16;
  struct Case {
    std::vector<int64_t> shape, stride;
    DType dtype;
    int64_t rows;
    bool overlap;
    const char* what;
  };
  const Case cases[] = {
      {{4, 3, 5}, {15, 5, 1}, DType::kFloat32, -1, false, "contiguous"},
      {{4, 5}, {8, 1}, DType::kBFloat16, -1, false, "padded rows"},
      {{2, 3, 4}, {24, 8, 1}, DType::kUInt8, -1, false, "padded rows and heads"},
      {{2, 3, 4}, {20, 8, 1}, DType::kUInt8, -1, false, "a stride exactly the reach"},
      {{2, 3, 4}, {19, 8, 1}, DType::kUInt8, -1, true, "a stride one element short of the reach"},
      {{2, 3, 4}, {20, 8, 1}, DType::kFloat32, -1, false, "the reach in 4-byte elements"},
      {{2, 3, 4}, {19, 8, 1}, DType::kFloat32, -1, true, "short in 4-byte elements"},
      {{3, 4}, {3, 1}, DType::kFloat32, -1, true, "rows one element short"},
      {{3, 4}, {4, 1}, DType::kFloat32, -1, false, "rows exactly contiguous"},
      {{5, 4}, {1, 5}, DType::kFloat32, -1, false, "transposed"},
      {{5, 4}, {1, 4}, DType::kFloat32, -1, true, "transposed, one element short"},
      {{5, 4}, {1, 4}, DType::kFloat32, 4, false, "transposed, rows [0, 4)"},
      {{5, 4}, {1, 4}, DType::kFloat32, 5, true, "transposed, rows [0, 5)"},
      {{5, 4}, {1, 4}, DType::kFloat32, 9, true, "transposed, rows past the size"},
      {{4, 4}, {2, 1}, DType::kFloat32, -1, true, "overlapping rows"},
      {{4, 4}, {2, 1}, DType::kFloat32, 2, true, "overlapping rows, rows [0, 2)"},
      {{4, 4}, {2, 1}, DType::kFloat32, 1, false, "overlapping rows, one row"},
      {{4, 4}, {2, 1}, DType::kFloat32, 0, false, "overlapping rows, no row"},
      {{4, 3}, {1, 1}, DType::kUInt8, 1, false, "one row of a dim-0 stride that overlaps"},
      {{4, 3}, {1, 1}, DType::kUInt8, 2, true, "two rows of a dim-0 stride that overlaps"},
      {{1, 3}, {0, 1}, DType::kFloat32, -1, false, "size-1 dim of stride 0"},
      {{3, 1, 2}, {2, -7, 1}, DType::kFloat32, -1, false, "size-1 dim of a negative stride"},
      {{3, 1, 2}, {2, 1, 1}, DType::kFloat32, -1, false, "size-1 dim of a small stride"},
      {{3, 2}, {2, 0}, DType::kFloat32, -1, true, "stride 0"},
      {{3, 2}, {0, 1}, DType::kFloat32, -1, true, "stride 0 on dim 0"},
      {{3, 2}, {0, 1}, DType::kFloat32, 1, false, "stride 0 on dim 0, one row"},
      {{3, 0}, {0, 0}, DType::kFloat32, -1, false, "empty"},
      {{2, 2, 2}, {1, 4, 2}, DType::kFloat32, -1, false, "permuted contiguous"},
      {{2, 2, 2}, {1, 3, 2}, DType::kFloat32, -1, true, "permuted, one short"},
      {{3, 2}, {2, 3}, DType::kFloat32, -1, true, "interleaving strides (conservative)"},
  };
  for (const Case& c : cases) {
    const TensorView t = view(p, c.dtype, c.shape, c.stride);
    EXPECT_EQ(core::rows_overlap(t, c.rows), c.overlap) << c.what << ": " << t.describe();
    if (!c.overlap) {
      EXPECT_FALSE(brute_rows_overlap(t, c.rows)) << c.what;
    }
  }
  EXPECT_FALSE(core::rows_overlap(TensorView{}, -1));
}

// Random layouts whose dims, taken by increasing stride, each step past what the smaller ones
// reach (strides = reach + padding): never overlapping; the same with one dim's stride one element
// short of the reach: overlapping (and the bytes show it).
TEST(SpansRowsOverlap, NestedLayouts) {
  std::mt19937_64 rng(5);
  for (int iter = 0; iter < 3000; ++iter) {
    const DType dtype = pick(rng, kDTypes);
    const int ndim = static_cast<int>(uniform(rng, 1, kMaxDims));
    std::vector<int64_t> shape;
    for (int d = 0; d < ndim; ++d) shape.push_back(uniform(rng, 1, 4));
    std::vector<int> order(static_cast<size_t>(ndim));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<int64_t> stride(static_cast<size_t>(ndim), 0);
    std::vector<int64_t> reach_below(static_cast<size_t>(ndim), 0);  // elements
    int64_t reach = 1;
    for (int d : order) {
      const size_t u = static_cast<size_t>(d);
      if (shape[u] == 1) {
        stride[u] = pick(rng, kUnusedStrides);
        continue;
      }
      reach_below[u] = reach;
      stride[u] = reach + (uniform(rng, 0, 1) == 0 ? 0 : uniform(rng, 1, 3));
      reach += (shape[u] - 1) * stride[u];
    }
    const TensorView t = view(g_buf, dtype, shape, stride);
    const int64_t rows_choices[] = {-1, shape[0], shape[0] + 2};
    const int64_t rows = pick(rng, rows_choices);
    EXPECT_FALSE(core::rows_overlap(t, rows)) << t.describe();
    EXPECT_FALSE(brute_rows_overlap(t, rows)) << t.describe();
    for (int d = 0; d < ndim; ++d) {
      const size_t u = static_cast<size_t>(d);
      if (shape[u] == 1) continue;
      TensorView s = t;
      s.stride[d] = reach_below[u] - 1;
      EXPECT_TRUE(brute_rows_overlap(s, rows)) << s.describe();
      EXPECT_TRUE(core::rows_overlap(s, rows)) << s.describe();
      if (d == 0) {
        EXPECT_FALSE(core::rows_overlap(s, 1)) << s.describe() << ": one row";
        EXPECT_TRUE(core::rows_overlap(s, 2)) << s.describe() << ": two rows";
      }
    }
    if (::testing::Test::HasFailure()) return;
  }
}

// Random views: two elements sharing a byte => rows_overlap.
TEST(SpansRowsOverlap, RandomViewsAgainstBytes) {
  std::mt19937_64 rng(11);
  int64_t overlapping = 0;
  for (int iter = 0; iter < 5000; ++iter) {
    const Sample s = random_sample(rng);
    if (brute_rows_overlap(s.t, s.end_row)) {
      ++overlapping;
      EXPECT_TRUE(core::rows_overlap(s.t, s.end_row)) << describe(s.t, s.end_row, 0);
    }
  }
  EXPECT_GT(overlapping, 100);
}

// ---- MemoryCheck --------------------------------------------------------------------------------

TEST(SpansMemoryCheck, AllowedPairsByNameInOrder) {
  const TensorView x = view(g_buf, DType::kFloat32, {4, 8}, {8, 1});
  const TensorView y = view(g_buf + 512, DType::kFloat32, {4, 8}, {8, 1});
  // An output that is an input: allowed only as (output, input), by the names' contents.
  auto out_in = [&](const std::vector<std::pair<std::string, std::string>>& allowed) {
    core::MemoryCheck mc("op");
    const char* out = mc.name("o" + std::string("ut"));
    const char* in = mc.name(std::string("in"));
    mc.output(out, x);
    mc.input(core::span_of(in, x));
    for (const auto& [o, i] : allowed) mc.allow(mc.name(o), mc.name(i));
    mc.check();
  };
  EXPECT_THROW(out_in({}), Error);
  EXPECT_NO_THROW(out_in({{"out", "in"}}));
  EXPECT_NO_THROW(out_in({{"a", "b"}, {"out", "in"}}));
  EXPECT_THROW(out_in({{"in", "out"}}), Error);
  EXPECT_THROW(out_in({{"out", "x"}}), Error);
  EXPECT_THROW(out_in({{"x", "in"}}), Error);
  EXPECT_THROW(out_in({{"out", "out"}, {"in", "in"}}), Error);
  EXPECT_THROW(out_in({{"ou", "in"}}), Error);
  EXPECT_THROW(out_in({{"out", "in2"}}), Error);
  {
    core::MemoryCheck mc("op");
    mc.output("out", x);
    mc.input(core::span_of("in", x));
    mc.allow("out", "in");
    EXPECT_NO_THROW(mc.check());
  }
  // Disjoint memory needs no allow.
  {
    core::MemoryCheck mc("op");
    mc.output("out", x);
    mc.input(core::span_of("in", y));
    mc.input(core::bytes_span("w", g_buf + 128, 384));
    EXPECT_NO_THROW(mc.check());
    mc.input(core::bytes_span("w2", g_buf + 127, 1));
    EXPECT_THROW(mc.check(), Error);
  }
  // Rows of an output: only [first_row, end_row) count.
  {
    core::MemoryCheck mc("op");
    mc.output("out", x, 4, 2);
    mc.input(core::span_of("in", x, 2));
    EXPECT_NO_THROW(mc.check());
    mc.input(core::span_of("in2", x, 3, 1));
    EXPECT_THROW(mc.check(), Error);
  }
  // Every output against every input.
  {
    core::MemoryCheck mc("op");
    mc.output("a", x);
    mc.output(core::span_of("b", y));
    mc.input(core::bytes_span("i0", g_buf + 200, 100));
    mc.input(core::bytes_span("i1", g_buf + 300, 100));
    EXPECT_NO_THROW(mc.check());
    mc.input(core::bytes_span("i2", g_buf + 636, 4));
    EXPECT_THROW(mc.check(), Error);
    mc.allow("b", "i2");
    EXPECT_NO_THROW(mc.check());
  }
  // An error message naming the op and both tensors.
  try {
    out_in({});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("op: out: expected memory disjoint from in"), std::string::npos)
        << e.message();
  }
}

TEST(SpansMemoryCheck, OutputsAgainstEachOther) {
  const TensorView x = view(g_buf, DType::kFloat32, {4, 8}, {8, 1});
  const TensorView half = view(g_buf + 64, DType::kFloat32, {2, 8}, {8, 1});
  const TensorView other = view(g_buf + 1024, DType::kFloat32, {4, 8}, {8, 1});
  auto outs = [&](const TensorView& second,
                  const std::vector<std::pair<std::string, std::string>>& allowed) {
    core::MemoryCheck mc("op");
    mc.output(mc.name("first"), x);
    mc.output(mc.name("mid"), other);
    mc.output(mc.name("second"), second);
    for (const auto& [o, i] : allowed) mc.allow(mc.name(o), mc.name(i));
    mc.check();
  };
  EXPECT_THROW(outs(half, {}), Error);
  EXPECT_NO_THROW(outs(half, {{"first", "second"}}));
  EXPECT_NO_THROW(outs(half, {{"second", "first"}}));
  EXPECT_THROW(outs(half, {{"first", "mid"}}), Error);
  EXPECT_THROW(outs(half, {{"mid", "second"}}), Error);
  EXPECT_THROW(outs(half, {{"first", "first"}}), Error);
  EXPECT_NO_THROW(outs(view(g_buf + 512, DType::kFloat32, {4, 8}, {8, 1}), {}));
  // Interleaved outputs in one buffer are disjoint.
  {
    core::MemoryCheck mc("op");
    mc.output("kv_c", view(g_buf, DType::kBFloat16, {4, 16}, {24, 1}));
    mc.output("k_pe", view(g_buf + 32, DType::kBFloat16, {4, 8}, {24, 1}));
    EXPECT_NO_THROW(mc.check());
  }
  // An output whose rows overlap one another is refused at once, unless one row is taken.
  {
    core::MemoryCheck mc("op");
    const TensorView self = view(g_buf, DType::kFloat32, {4, 8}, {4, 1});
    EXPECT_THROW(mc.output("self", self), Error);
    EXPECT_THROW(mc.output("self", self, 2), Error);
    EXPECT_NO_THROW(mc.output("self", self, 1));
    EXPECT_NO_THROW(mc.check());
  }
}

}  // namespace
}  // namespace mlakv
