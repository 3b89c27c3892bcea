// mlakv: the default floating-point environment for the length of a scope (host code only).
//
// The CPU backend's bytes, and the RoPE tables built on the host, are the CUDA backend's and the
// reference's only in the default environment: round to nearest even, subnormals kept (no
// flush-to-zero, no denormals-are-zero), no exception traps. A caller may have left another one
// on its thread: fesetround, feenableexcept, or a shared library built with -ffast-math that sets
// FTZ / DAZ when it loads; and a thread inherits its creator's environment, OpenMP's workers
// included. Every parallel region of the CPU backend (on each of its threads) and every table
// builder holds a DefaultFloatEnv, as does the torch binding's conversion of its float arguments:
// inside, the environment is the default one; afterwards, the thread's own again, exactly (its
// exception flags as they were: those the library raised are dropped).
//
// The compiler does not order arithmetic on registers with the environment's writes (C++ has no
// FENV_ACCESS, and GCC does not model it): it may compute a value from function arguments before
// the scope starts, or a value it returns after the scope ends. Results the scope stores to memory
// (the ops' outputs, a table) are safe, since the writes are calls that may touch memory; scalar
// arguments and results pass through volatiles inside the scope (src/core/tables.cpp,
// torch/binding.cpp to_float).
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
  // DAZ off, no exception flag raised. The caller's value comes back whole at the end, so the
  // exception flags raised inside are dropped, as with fesetenv below.
  DefaultFloatEnv() : saved_(_mm_getcsr()) { _mm_setcsr(kDefault); }
  ~DefaultFloatEnv() { _mm_setcsr(saved_); }
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
  unsigned saved_;
#else
  std::fenv_t saved_;
#endif
};

}  // namespace mlakv
