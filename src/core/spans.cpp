// mlakv internal: the bytes an op's tensors touch (see spans.h).
#include "core/spans.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>

#include "mlakv/error.h"

namespace mlakv {
namespace core {

namespace {

// (stride bytes, size) of a view's dims of size > 1, in increasing stride order.
struct Dims {
  std::pair<int64_t, int64_t> dim[kMaxDims];
  int count = 0;
  void add(int64_t stride_bytes, int64_t size) {
    int i = count++;
    // Insertion: at most kMaxDims entries (std::sort on so small an array trips -Warray-bounds).
    for (; i > 0 && dim[i - 1] > std::pair{stride_bytes, size}; --i) dim[i] = dim[i - 1];
    dim[i] = {stride_bytes, size};
  }
};

}  // namespace

int64_t canonical_stride(const TensorView& t, int d) {
  if (t.shape[d] > 1) return t.stride[d];
  if (d + 1 >= t.ndim) return 1;
  for (int outer = d - 1; outer >= 0; --outer) {
    if (t.shape[outer] > 1) return t.stride[outer];
  }
  // Only an empty view can overflow here (a non-empty one spans less than 2^56 bytes); it
  // addresses nothing, so any stride does.
  int64_t stride = 0;
  if (__builtin_mul_overflow(t.shape[d + 1], canonical_stride(t, d + 1), &stride)) return 0;
  return stride;
}

bool checked_mul_add(int64_t a, int64_t b, int64_t c, int64_t* out) {
  int64_t product = 0;
  if (a < 0 || b < 0 || c < 0 || __builtin_mul_overflow(a, b, &product) ||
      __builtin_add_overflow(product, c, out)) {
    return false;
  }
  return *out < kMaxExtentBytes;
}

bool extent_bytes(const TensorView& t, int64_t* bytes) {
  *bytes = 0;
  if (!t.present()) return true;
  // Every size and stride below 2^56, those of empty views and size-1 dims too: a count taken from
  // a size (B + 1 rows) or a stride times an element size can then never overflow.
  bool empty = false;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] >= kMaxExtentBytes || t.stride[d] >= kMaxExtentBytes ||
        t.stride[d] <= -kMaxExtentBytes) {
      return false;
    }
    empty = empty || t.shape[d] == 0;
  }
  if (empty) return true;
  int64_t last = 0;  // elements from the first to the last
  for (int d = 0; d < t.ndim; ++d) {
    // The stride of a size-1 dim is never used (it may be anything, as in PyTorch).
    if (t.shape[d] > 1 && !checked_mul_add(t.shape[d] - 1, t.stride[d], last, &last)) return false;
  }
  const int64_t elem = static_cast<int64_t>(dtype_size(t.dtype));
  if (!checked_mul_add(last + 1, elem, 0, bytes)) return false;
  return reinterpret_cast<uintptr_t>(t.data) <= UINTPTR_MAX - static_cast<uintptr_t>(*bytes);
}

Span span_of(const char* name, const TensorView& t, int64_t end_row, int64_t first_row) {
  Span s;
  s.name = name;
  if (!t.present() || t.data == nullptr) return s;
  const int64_t elem = static_cast<int64_t>(dtype_size(t.dtype));
  Dims dims;
  for (int d = 0; d < t.ndim; ++d) {
    const int64_t n =
        d > 0 ? t.shape[d] : (end_row < 0 ? t.shape[0] : std::min(end_row, t.shape[0])) - first_row;
    if (n <= 0) return s;
    if (n > 1) dims.add(t.stride[d] * elem, n);
  }
  s.row_bytes = elem;
  int i = 0;
  for (; i < dims.count && dims.dim[i].first == s.row_bytes; ++i) s.row_bytes *= dims.dim[i].second;
  for (; i < dims.count; ++i) {
    s.last_row += (dims.dim[i].second - 1) * dims.dim[i].first;
    s.stride_gcd = std::gcd(s.stride_gcd, dims.dim[i].first);
  }
  s.base =
      reinterpret_cast<uintptr_t>(t.data) + static_cast<uintptr_t>(first_row * t.stride[0] * elem);
  return s;
}

Span bytes_span(const char* name, const void* ptr, int64_t bytes) {
  Span s;
  s.name = name;
  if (ptr == nullptr || bytes <= 0) return s;
  s.base = reinterpret_cast<uintptr_t>(ptr);
  s.row_bytes = bytes;
  return s;
}

Span cache_span(const char* name, const void* data, int64_t num_blocks, int64_t block_size,
                int64_t stride_block_bytes, int64_t stride_token_bytes, int64_t entry_bytes) {
  Span s;
  s.name = name;
  if (data == nullptr || num_blocks <= 0) return s;
  s.base = reinterpret_cast<uintptr_t>(data);
  s.row_bytes = entry_bytes;
  if (num_blocks > 1) {
    s.last_row += (num_blocks - 1) * stride_block_bytes;
    s.stride_gcd = std::gcd(s.stride_gcd, stride_block_bytes);
  }
  if (block_size > 1) {
    s.last_row += (block_size - 1) * stride_token_bytes;
    s.stride_gcd = std::gcd(s.stride_gcd, stride_token_bytes);
  }
  return s;
}

bool may_overlap(const Span& a, const Span& b) {
  if (a.row_bytes <= 0 || b.row_bytes <= 0) return false;
  const uintptr_t a_end = a.base + static_cast<uintptr_t>(a.last_row + a.row_bytes);
  const uintptr_t b_end = b.base + static_cast<uintptr_t>(b.last_row + b.row_bytes);
  // A span that wraps the address space (a raw scalar pointer at its top) counts as overlapping.
  if (a_end <= a.base || b_end <= b.base) return true;
  if (a_end <= b.base || b_end <= a.base) return false;
  const uintptr_t m = static_cast<uintptr_t>(std::gcd(a.stride_gcd, b.stride_gcd));
  if (m == 0) return true;  // two single rows whose ranges meet
  const uintptr_t b_after_a = (b.base % m + m - a.base % m) % m;
  const uintptr_t a_after_b = (a.base % m + m - b.base % m) % m;
  return !(b_after_a >= static_cast<uintptr_t>(a.row_bytes) &&
           a_after_b >= static_cast<uintptr_t>(b.row_bytes));
}

bool rows_overlap(const TensorView& t, int64_t rows) {
  if (!t.present()) return false;
  const int64_t elem = static_cast<int64_t>(dtype_size(t.dtype));
  Dims dims;
  for (int d = 0; d < t.ndim; ++d) {
    const int64_t n = d == 0 && rows >= 0 ? std::min(rows, t.shape[0]) : t.shape[d];
    if (n <= 0) return false;
    if (n > 1) dims.add(t.stride[d] * elem, n);
  }
  int64_t reach = elem;  // bytes spanned by the dims taken so far
  for (int i = 0; i < dims.count; ++i) {
    if (dims.dim[i].first < reach) return true;
    reach += (dims.dim[i].second - 1) * dims.dim[i].first;
  }
  return false;
}

void MemoryCheck::output(const char* name, const TensorView& t, int64_t end_row,
                         int64_t first_row) {
  MLAKV_CHECK(!rows_overlap(t, end_row), op_, ": ", name,
              ": expected rows that do not overlap each other (the op writes them), got ",
              t.describe());
  outputs_.push_back(span_of(name, t, end_row, first_row));
}

void MemoryCheck::check() const {
  for (size_t i = 0; i < outputs_.size(); ++i) {
    const Span& o = outputs_[i];
    for (const Span& in : inputs_) {
      MLAKV_CHECK(
          allowed(o.name, in.name) || !may_overlap(o, in), op_, ": ", o.name,
          ": expected memory disjoint from ", in.name,
          " (a tensor the op writes may be an input only exactly: the same data and strides, "
          "where the op allows it), got overlapping memory");
    }
    for (size_t j = i + 1; j < outputs_.size(); ++j) {
      const Span& other = outputs_[j];
      MLAKV_CHECK(
          allowed(o.name, other.name) || allowed(other.name, o.name) || !may_overlap(o, other), op_,
          ": ", o.name, ": expected memory disjoint from ", other.name,
          " (the op writes both), got overlapping memory");
    }
  }
}

bool MemoryCheck::allowed(const char* output, const char* input) const {
  for (const auto& [o, i] : allowed_) {
    if (std::strcmp(o, output) == 0 && std::strcmp(i, input) == 0) return true;
  }
  return false;
}

}  // namespace core
}  // namespace mlakv
