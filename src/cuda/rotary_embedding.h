// mlakv CUDA backend: vLLM's rotary_embedding (RoPE on the first rot_dim values of every head of
// query and key, in place).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/args.h"

namespace mlakv {
namespace cuda {

struct RotaryKernelParams {
  core::RotaryEmbeddingArgs args;
  int32_t* error_counts = nullptr;
  int32_t pairs_per_lane = 1;      // ceil(rot_dim / 2 / 32)
  int32_t heads_per_item = 1;      // 8 / pairs_per_lane
  int64_t q_groups_per_token = 0;  // ceil(Hq / heads_per_item)
  int64_t k_groups_per_token = 0;  // ceil(Hk / heads_per_item), 0 without key
  int64_t num_items = 0;           // T * (q_groups_per_token + k_groups_per_token)
};

template <typename T, bool kVec>
void launch_rotary_embedding_kernel(const RotaryKernelParams& params, const Launch& launch);

}  // namespace cuda
}  // namespace mlakv
