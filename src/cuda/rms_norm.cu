// mlakv CUDA backend: the rms_norm launcher and its instantiations.
#include "core/backend.h"
#include "cuda/cuda_utils.h"
#include "cuda/rms_norm.h"
#include "cuda/rms_norm_kernel.cuh"

namespace mlakv {
namespace cuda {

template void launch_rms_norm_kernel<float, true>(const core::RmsNormArgs&, const Launch&);
template void launch_rms_norm_kernel<float, false>(const core::RmsNormArgs&, const Launch&);
template void launch_rms_norm_kernel<num::Half, true>(const core::RmsNormArgs&, const Launch&);
template void launch_rms_norm_kernel<num::Half, false>(const core::RmsNormArgs&, const Launch&);
template void launch_rms_norm_kernel<num::Bf16, true>(const core::RmsNormArgs&, const Launch&);
template void launch_rms_norm_kernel<num::Bf16, false>(const core::RmsNormArgs&, const Launch&);

void rms_norm(const core::RmsNormArgs& args, const Context& ctx) {
  if (args.num_tokens <= 0 || args.hidden <= 0) return;
  const int64_t elem = static_cast<int64_t>(dtype_size(args.model_dtype));
  VecCheck v;
  v.ptr(args.input).stride(args.stride_input_token, elem);
  v.ptr(args.weight);
  v.ptr(args.output).stride(args.stride_output_token, elem);
  v.require(args.hidden % kChunkElems == 0);
  const bool vec = v.ok();
  const Launch launch = launch_of(ctx);
  MLAKV_MODEL_DTYPE_SWITCH(args.model_dtype, "input", T, [&] {
    if (vec) {
      launch_rms_norm_kernel<T, true>(args, launch);
    } else {
      launch_rms_norm_kernel<T, false>(args, launch);
    }
  });
}

}  // namespace cuda
}  // namespace mlakv
