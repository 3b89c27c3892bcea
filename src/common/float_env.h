// mlakv: the default floating-point environment for the length of a scope (host code only).
//
// The CPU backend's bytes, and the RoPE tables built on the host, are the CUDA backend's and the
// reference's only in the default environment: round to nearest even, subnormals kept (no
// flush-to-zero, no denormals-are-zero), no exception traps. A caller may have left another one
// on its thread: fesetround, feenableexcept, or a shared library built with -ffast-math that sets
// FTZ / DAZ when it loads; and a thread inherits its creator's environment, OpenMP's workers
// included. Every parallel region of the CPU backend (on each of its threads) and every table
// builder holds a DefaultFloatEnv: inside, the environment is the default one; afterwards, the
// caller's again, its exception flags included.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#else
#include <cfenv>
#endif

namespace mlakv {

class DefaultFloatEnv {
 public:
#if defined(__x86_64__)
  // float and double arithmetic runs on SSE here, controlled by MXCSR alone (x87 only serves long
  // double, which mlakv does not use). 0x1f80: every exception masked, round to nearest, FTZ and
  // DAZ off. Reading it costs one instruction; it is written only when the control bits differ.
  DefaultFloatEnv() : saved_(_mm_getcsr()) {
    if ((saved_ & ~kFlags) != kDefault) _mm_setcsr(kDefault);
  }
  ~DefaultFloatEnv() {
    if ((saved_ & ~kFlags) != kDefault) _mm_setcsr(saved_);
  }
#else
  DefaultFloatEnv() {
    std::fegetenv(&saved_);
    std::fesetenv(FE_DFL_ENV);
  }
  ~DefaultFloatEnv() { std::fesetenv(&saved_); }
#endif
  DefaultFloatEnv(const DefaultFloatEnv&) = delete;
  DefaultFloatEnv& operator=(const DefaultFloatEnv&) = delete;

 private:
#if defined(__x86_64__)
  static constexpr unsigned kDefault = 0x1f80;
  static constexpr unsigned kFlags = 0x3f;  // the sticky exception flags
  unsigned saved_;
#else
  std::fenv_t saved_;
#endif
};

}  // namespace mlakv
