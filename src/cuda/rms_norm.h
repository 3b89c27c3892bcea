// mlakv CUDA backend: RMSNorm over rows of N values (the unfused kv_a_layernorm).
#pragma once

#include <cuda_runtime.h>

#include "core/args.h"

namespace mlakv {
namespace cuda {

template <typename T, bool kVec>
void launch_rms_norm_kernel(const core::RmsNormArgs& args, const Launch& launch);

}  // namespace cuda
}  // namespace mlakv
