// mlakv CLI: `mlakv info`.
#include <omp.h>

#include <cstdio>
#include <string>
#include <thread>

#include "commands.h"
#include "mlakv/mlakv.h"

namespace mlakv {
namespace cli {

int run_info() {
  std::printf("mlakv %s\n\n", version());
  std::printf("build:\n");
  // build_info() is several lines; indent each for readability.
  std::string info = build_info();
  size_t start = 0;
  while (start <= info.size()) {
    const size_t end = info.find('\n', start);
    const std::string line = info.substr(start, end == std::string::npos ? end : end - start);
    if (!line.empty()) std::printf("  %s\n", line.c_str());
    if (end == std::string::npos) break;
    start = end + 1;
  }
  std::printf("\nbackends:\n");
  std::printf("  cpu: %d OpenMP threads (%u hardware threads)\n", omp_get_max_threads(),
              std::thread::hardware_concurrency());
  if (!cuda_backend_built()) {
    std::printf("  cuda: not built (configure with -DMLAKV_CUDA=ON)\n");
    return 0;
  }
  const int count = cuda_device_count();
  std::printf("  cuda: built, %d visible device%s\n", count, count == 1 ? "" : "s");
  for (int i = 0; i < count; ++i) {
    std::printf("    %s\n", cuda_device_description(i).c_str());  // "cuda:N <name>, ..."
  }
  return 0;
}

}  // namespace cli
}  // namespace mlakv
