// mlakv CUDA backend: the gather_cache launcher and its instantiations.
#include "core/backend.h"
#include "cuda/cuda_utils.h"
#include "cuda/gather_cache.h"
#include "cuda/gather_cache_kernel.cuh"

namespace mlakv {
namespace cuda {

#define MLAKV_INSTANTIATE_GATHER(kFormat, Out)                                \
  template void launch_gather_cache_kernel<CacheFormat::kFormat, Out, true>(  \
      const GatherKernelParams&, const Launch&);                              \
  template void launch_gather_cache_kernel<CacheFormat::kFormat, Out, false>( \
      const GatherKernelParams&, const Launch&);
#define MLAKV_INSTANTIATE_GATHER_FORMAT(kFormat) \
  MLAKV_INSTANTIATE_GATHER(kFormat, float)       \
  MLAKV_INSTANTIATE_GATHER(kFormat, num::Bf16)
MLAKV_INSTANTIATE_GATHER_FORMAT(kBFloat16)
MLAKV_INSTANTIATE_GATHER_FORMAT(kFloat16)
MLAKV_INSTANTIATE_GATHER_FORMAT(kFloat32)
MLAKV_INSTANTIATE_GATHER_FORMAT(kFloat8E4M3)
MLAKV_INSTANTIATE_GATHER_FORMAT(kFloat8E5M2)
MLAKV_INSTANTIATE_GATHER_FORMAT(kFloat8DsMla)
#undef MLAKV_INSTANTIATE_GATHER_FORMAT
#undef MLAKV_INSTANTIATE_GATHER

namespace {

template <CacheFormat kFormat, typename Out>
void dispatch_vec(const GatherKernelParams& p, bool vec, const Launch& launch) {
  if (vec) {
    launch_gather_cache_kernel<kFormat, Out, true>(p, launch);
  } else {
    launch_gather_cache_kernel<kFormat, Out, false>(p, launch);
  }
}

template <typename Out>
void dispatch_format(const GatherKernelParams& p, bool vec, const Launch& launch) {
  switch (p.args.cache.format) {
    case CacheFormat::kBFloat16:
      return dispatch_vec<CacheFormat::kBFloat16, Out>(p, vec, launch);
    case CacheFormat::kFloat16:
      return dispatch_vec<CacheFormat::kFloat16, Out>(p, vec, launch);
    case CacheFormat::kFloat32:
      return dispatch_vec<CacheFormat::kFloat32, Out>(p, vec, launch);
    case CacheFormat::kFloat8E4M3:
      return dispatch_vec<CacheFormat::kFloat8E4M3, Out>(p, vec, launch);
    case CacheFormat::kFloat8E5M2:
      return dispatch_vec<CacheFormat::kFloat8E5M2, Out>(p, vec, launch);
    case CacheFormat::kFloat8DsMla:
      return dispatch_vec<CacheFormat::kFloat8DsMla, Out>(p, vec, launch);
  }
  MLAKV_FAIL("kv_cache: unknown cache format ", static_cast<int>(p.args.cache.format));
}

}  // namespace

void gather_cache(const core::GatherCacheArgs& args, const Context& ctx) {
  if (args.num_rows <= 0) return;
  MLAKV_CHECK(args.kv_lora_rank <= 1024 && args.kv_lora_rank % kChunkElems == 0,
              "kv_cache: ", "expected L <= 1024 and a multiple of 8 on the CUDA backend, got ",
              args.kv_lora_rank);
  GatherKernelParams p;
  p.args = args;
  p.error_counts = args.error_counts != nullptr ? args.error_counts : ctx.error_counts;
  const int64_t out_elem = static_cast<int64_t>(dtype_size(args.out_dtype));
  VecCheck v;
  v.ptr(args.cache.data)
      .stride_bytes(args.cache.stride_block_bytes)
      .stride_bytes(args.cache.stride_token_bytes);
  v.ptr(args.out).stride(args.stride_out_token, out_elem);
  const bool vec = v.ok();
  const Launch launch = launch_of(ctx);
  switch (args.out_dtype) {
    case DType::kFloat32:
      return dispatch_format<float>(p, vec, launch);
    case DType::kBFloat16:
      return dispatch_format<num::Bf16>(p, vec, launch);
    default:
      MLAKV_FAIL("out: expected float32 or bfloat16, got ", dtype_name(args.out_dtype));
  }
}

}  // namespace cuda
}  // namespace mlakv
