// mlakv: version and build facts (for `mlakv info`).
#include <omp.h>

#include <sstream>
#include <string>

#include "core/backend.h"
#include "mlakv/mlakv.h"

#ifndef MLAKV_VERSION_STRING
#define MLAKV_VERSION_STRING "unknown"
#endif
#ifndef MLAKV_BUILD_TYPE
#define MLAKV_BUILD_TYPE "unknown"
#endif
#ifndef MLAKV_CXX_COMPILER
#define MLAKV_CXX_COMPILER "unknown"
#endif

namespace mlakv {

const char* version() { return MLAKV_VERSION_STRING; }

const char* build_info() {
  // Built once; the returned pointer stays valid for the life of the program.
  static const std::string info = [] {
    std::ostringstream os;
    os << "mlakv " << MLAKV_VERSION_STRING << "\n";
    os << "build type: " << MLAKV_BUILD_TYPE << "\n";
    os << "C++ compiler: " << MLAKV_CXX_COMPILER << " (C++" << (__cplusplus / 100 % 100) << ")\n";
#ifdef MLAKV_WITH_CUDA
#ifdef MLAKV_CUDA_GENCODE_STRING
    os << "CUDA backend: on, " << MLAKV_CUDA_GENCODE_STRING << "\n";
#else
    os << "CUDA backend: on\n";
#endif
#else
    os << "CUDA backend: off\n";
#endif
    os << "CPU backend: " << cpu::vector_bytes() << "-byte vectors\n";
    os << "OpenMP: " << _OPENMP << ", max threads " << omp_get_max_threads();
    return os.str();
  }();
  return info.c_str();
}

bool cuda_backend_built() {
#ifdef MLAKV_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
#ifdef MLAKV_WITH_CUDA
  return cuda::device_count();
#else
  return 0;
#endif
}

std::string cuda_device_description(int index) {
#ifdef MLAKV_WITH_CUDA
  const int count = cuda::device_count();
  MLAKV_CHECK(index >= 0 && index < count, "cuda_device_description: index: expected 0 <= index < ",
              count, ", got ", index);
  return cuda::device_description(index);
#else
  MLAKV_FAIL("cuda_device_description: index ", index,
             ": mlakv was built without the CUDA backend");
#endif
}

}  // namespace mlakv
