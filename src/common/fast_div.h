// mlakv: division of 32-bit unsigned numbers below 2^31 by a divisor fixed on the host (a
// multiply-high and a shift instead of the ~20 dependent instructions of a run-time division), for
// the work-item decoding at the head of every GPU work item.
//
// For d >= 2, l = ceil(log2 d), p = 31 + l and m = ceil(2^p / d) < 2^32: n / d = (n * m) >> p for
// every n < 2^31 (m * d = 2^p + e with 0 <= e < d, so n * m / 2^p = n / d + n * e / (d * 2^p) and
// the second term is below 1 / d because n * e < 2^31 * 2^l). d = 1 is n itself.
#pragma once

#include <cstdint>

#include "common/numerics.h"  // MLAKV_HD

namespace mlakv {

struct FastDiv {
  uint32_t divisor = 1;
  uint32_t multiplier = 0;
  uint32_t shift = 0;  // p - 32

  FastDiv() = default;
  // d in [1, 2^31).
  explicit FastDiv(uint32_t d) : divisor(d) {
    if (d <= 1) return;
    uint32_t l = 0;
    while ((uint64_t{1} << l) < d) ++l;
    const uint64_t p = 31 + l;
    multiplier = static_cast<uint32_t>(((uint64_t{1} << p) + d - 1) / d);
    shift = static_cast<uint32_t>(p - 32);
  }

  // n / divisor, for n < 2^31.
  MLAKV_HD uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(n, multiplier);
#else
    const uint32_t hi = static_cast<uint32_t>((uint64_t{n} * multiplier) >> 32);
#endif
    return divisor == 1 ? n : hi >> shift;
  }
};

}  // namespace mlakv
