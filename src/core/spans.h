// mlakv internal: the bytes an op's tensors touch, and the memory-sharing rule every validator
// applies (docs/decisions.md "Aliasing").
//
// DESIGN.md: an op writes only its outputs, and an input is modified only where the caller passes
// an output that IS that input. So every output must share no byte with any other tensor of the
// op (nor with itself across rows), except the exact aliases the validators allow.
//
// A Span is the bytes a validated view touches (non-negative strides): rows of row_bytes
// contiguous bytes, at base + sum(i_d * stride_d) over the other dims. Every byte of a span lies at
// a residue in [base, base + row_bytes) modulo gcd, the gcd of those strides in bytes. Two spans
// are disjoint when their byte ranges are, or when those residue intervals, taken modulo the gcd
// of both spans' gcds, do not meet: views interleaved in one buffer (kv_c and k_pe of the kv_a
// projection's [T, L + R] output, q_out's nope and rope parts). Anything else counts as
// overlapping, so the test is conservative.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "mlakv/tensor.h"

namespace mlakv {
namespace core {

// Byte extents are kept below this (2^56: far above any device's memory), so that every offset
// an op computes from a validated view fits in int64 with room to spare.
constexpr int kMaxExtentLog2 = 56;
constexpr int64_t kMaxExtentBytes = int64_t{1} << kMaxExtentLog2;

// The bytes from view t's first element to one past its last (0 when it is empty), computed
// without overflow. Returns false when a size or a stride's magnitude reaches kMaxExtentBytes
// (empty views and size-1 dims included), the extent reaches kMaxExtentBytes, one past the last
// byte does not fit in the address space, or a dim of size > 1 has a negative stride; *bytes is
// then unspecified. t must have sizes >= 0.
bool extent_bytes(const TensorView& t, int64_t* bytes);

// The stride of dim d that validators hand the backends. A dim of size 0 or 1 is never used for
// addressing, so its stride may be anything (as in PyTorch: torch.empty(512, 1).t() has strides
// (1, 1)); a backend that tests every stride it gets (16-byte alignment, rows laid out as one
// run) must not see that value. An innermost such dim gets 1. Any other gets the stride it would
// have if it were merged into the nearest outer dim of size > 1 (that dim's stride: [T, 1, D]
// keeps stride_token == stride_head, so a one-run layout stays one), or, without one, the
// contiguous stride over its inner dims (shape[d + 1] * the canonical stride of d + 1; 0 for an
// empty view whose product passes 64 bits). For a non-empty contiguous view (make_view's
// strides) this is its own stride, so a junk size-1 stride gives the backend exactly the
// arguments of the contiguous tensor. Dims of size > 1 keep theirs. Error messages and the
// alias/overlap checks use the caller's strides, not these.
int64_t canonical_stride(const TensorView& t, int d);

// a * b + c for non-negative operands, false when the result reaches kMaxExtentBytes.
bool checked_mul_add(int64_t a, int64_t b, int64_t c, int64_t* out);

struct Span {
  const char* name = "";
  uintptr_t base = 0;
  int64_t row_bytes = 0;   // 0: empty
  int64_t last_row = 0;    // bytes from base to the last row's start
  int64_t stride_gcd = 0;  // gcd of the other dims' strides (bytes, dims of size > 1); 0: one row
};

// The span of view t's rows [first_row, end_row) of dim 0 (end_row < 0: all). The row is the dim
// of the smallest stride, joined by the dims whose stride continues it (q [T, H, P + R] with
// contiguous heads; column-major scales [T, G] with stride [1, >= T] have rows along T).
Span span_of(const char* name, const TensorView& t, int64_t end_row = -1, int64_t first_row = 0);

// `bytes` contiguous bytes at ptr (a scalar, the error counters, a weight).
Span bytes_span(const char* name, const void* ptr, int64_t bytes);

// The entries of a validated cache: rows of entry_bytes at data + block * stride_block +
// token * stride_token.
Span cache_span(const char* name, const void* data, int64_t num_blocks, int64_t block_size,
                int64_t stride_block_bytes, int64_t stride_token_bytes, int64_t entry_bytes);

bool may_overlap(const Span& a, const Span& b);

// True when two rows [0, rows) of dim 0 (rows < 0: all) of view t may be the same memory: its dims
// of size > 1, from the smallest stride up, must each step past everything the smaller ones reach
// (a layout that interleaves its own rows counts as overlapping).
bool rows_overlap(const TensorView& t, int64_t rows);

// The outputs and inputs of one op call; check() throws mlakv::Error ("op: output: expected
// memory disjoint from ...") for the first output that shares memory with another tensor, unless
// the pair is allowed (an exact alias the validator accepted).
class MemoryCheck {
 public:
  explicit MemoryCheck(const char* op) : op_(op) {}

  // A stable copy of a name built at run time ("q.input"), for the spans and allow().
  const char* name(std::string s) {
    names_.push_back(std::move(s));
    return names_.back().c_str();
  }

  void input(const Span& s) { inputs_.push_back(s); }
  // An output view's rows [first_row, end_row) (end_row < 0: all); its rows [0, end_row) are
  // also checked against one another.
  void output(const char* name, const TensorView& t, int64_t end_row = -1, int64_t first_row = 0);
  void output(const Span& s) { outputs_.push_back(s); }
  void allow(const char* output, const char* input) { allowed_.emplace_back(output, input); }

  void check() const;

 private:
  bool allowed(const char* output, const char* input) const;

  const char* op_;
  std::deque<std::string> names_;  // a deque: push_back keeps earlier strings in place
  std::vector<Span> inputs_;
  std::vector<Span> outputs_;
  std::vector<std::pair<const char*, const char*>> allowed_;
};

}  // namespace core
}  // namespace mlakv
