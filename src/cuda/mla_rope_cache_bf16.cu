// mlakv CUDA backend: the fused MLA kernel instantiated for a bf16 model dtype (one file per model
// dtype so that the instantiations compile in parallel).
#include "cuda/mla_rope_cache_kernel.cuh"

MLAKV_INSTANTIATE_MLA_ROPE_CACHE(mlakv::num::Bf16, mlakv::CacheFormat::kBFloat16)
MLAKV_INSTANTIATE_MLA_ROPE_CACHE(mlakv::num::Bf16, mlakv::CacheFormat::kFloat16)
MLAKV_INSTANTIATE_MLA_ROPE_CACHE(mlakv::num::Bf16, mlakv::CacheFormat::kFloat32)
MLAKV_INSTANTIATE_MLA_ROPE_CACHE(mlakv::num::Bf16, mlakv::CacheFormat::kFloat8E4M3)
MLAKV_INSTANTIATE_MLA_ROPE_CACHE(mlakv::num::Bf16, mlakv::CacheFormat::kFloat8E5M2)
MLAKV_INSTANTIATE_MLA_ROPE_CACHE(mlakv::num::Bf16, mlakv::CacheFormat::kFloat8DsMla)
