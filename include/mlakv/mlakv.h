// mlakv: fused RoPE + paged KV-cache write for Multi-head Latent Attention. Umbrella header.
#pragma once

#include <string>

#include "mlakv/cache.h"
#include "mlakv/context.h"
#include "mlakv/error.h"
#include "mlakv/memory.h"
#include "mlakv/ops.h"
#include "mlakv/rmsnorm_quant.h"
#include "mlakv/tables.h"
#include "mlakv/tensor.h"

namespace mlakv {

const char* version();
// Build facts for `mlakv info`: compiler, options, CUDA architectures.
const char* build_info();
bool cuda_backend_built();
// Number of visible CUDA devices (0 without the CUDA backend or without a GPU).
int cuda_device_count();
// One line per visible device: name, compute capability, memory, SMs.
std::string cuda_device_description(int index);

}  // namespace mlakv
