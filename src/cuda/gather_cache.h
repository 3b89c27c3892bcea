// mlakv CUDA backend: cache read-back (gather_cache_slots / gather_cache_sequences), dequantized to
// bf16 or fp32 rows of L + R values.
#pragma once

#include <cuda_runtime.h>

#include "core/args.h"
#include "mlakv/cache.h"

namespace mlakv {
namespace cuda {

struct GatherKernelParams {
  core::GatherCacheArgs args;
  int32_t* error_counts = nullptr;
};

template <CacheFormat kFormat, typename Out, bool kVec>
void launch_gather_cache_kernel(const GatherKernelParams& params, const Launch& launch);

}  // namespace cuda
}  // namespace mlakv
