// mlakv CUDA backend: the rotary_embedding launcher and its instantiations.
#include <algorithm>

#include "core/backend.h"
#include "cuda/cuda_utils.h"
#include "cuda/rotary_embedding.h"
#include "cuda/rotary_embedding_kernel.cuh"

namespace mlakv {
namespace cuda {

template void launch_rotary_embedding_kernel<float, true>(const RotaryKernelParams&, const Launch&);
template void launch_rotary_embedding_kernel<float, false>(const RotaryKernelParams&,
                                                           const Launch&);
template void launch_rotary_embedding_kernel<num::Half, true>(const RotaryKernelParams&,
                                                              const Launch&);
template void launch_rotary_embedding_kernel<num::Half, false>(const RotaryKernelParams&,
                                                               const Launch&);
template void launch_rotary_embedding_kernel<num::Bf16, true>(const RotaryKernelParams&,
                                                              const Launch&);
template void launch_rotary_embedding_kernel<num::Bf16, false>(const RotaryKernelParams&,
                                                               const Launch&);

void rotary_embedding(const core::RotaryEmbeddingArgs& args, const Context& ctx) {
  if (args.num_tokens <= 0) return;
  MLAKV_CHECK(args.rot_dim % 2 == 0 && args.rot_dim <= 2 * kWarpSize * kRotaryMaxPairsPerLane,
              "cos_sin_cache: expected an even rot_dim <= 256 on the CUDA backend, got ",
              args.rot_dim);
  RotaryKernelParams p;
  p.args = args;
  p.error_counts = args.error_counts != nullptr ? args.error_counts : ctx.error_counts;
  const int64_t half = args.rot_dim / 2;
  const int64_t ppl = std::max<int64_t>(1, (half + kWarpSize - 1) / kWarpSize);
  p.pairs_per_lane = static_cast<int32_t>(ppl);
  p.heads_per_item = static_cast<int32_t>(std::max<int64_t>(1, kRotarySlots / ppl));
  const int64_t hpi = p.heads_per_item;
  // At least one (possibly empty) query group per token: it counts the token's bad position.
  p.q_groups_per_token = std::max<int64_t>(1, (args.num_q_heads + hpi - 1) / hpi);
  p.k_groups_per_token = args.key != nullptr ? (args.num_k_heads + hpi - 1) / hpi : 0;
  p.num_items = half > 0 ? args.num_tokens * (p.q_groups_per_token + p.k_groups_per_token) : 0;

  const int64_t elem = static_cast<int64_t>(dtype_size(args.model_dtype));
  VecCheck v;
  v.ptr(args.query).stride(args.stride_query_token, elem).stride(args.stride_query_head, elem);
  v.ptr(args.key).stride(args.stride_key_token, elem).stride(args.stride_key_head, elem);
  const bool vec = v.ok();
  const Launch launch = launch_of(ctx);
  MLAKV_MODEL_DTYPE_SWITCH(args.model_dtype, "query", T, [&] {
    if (vec) {
      launch_rotary_embedding_kernel<T, true>(p, launch);
    } else {
      launch_rotary_embedding_kernel<T, false>(p, launch);
    }
  });
}

}  // namespace cuda
}  // namespace mlakv
