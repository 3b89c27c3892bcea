// mlakv torch binding: the process-wide programmatic dependent launch switch
// (torch.ops.mlakv.set_pdl / get_pdl), read by every CUDA op into Context::pdl (binding.h CudaEnv).
//
// A host-side setting, not a tensor op: the two ops take and return no tensors, so they have one
// kernel for every dispatch key and need no fake kernel. CUDA ops read the switch when they launch,
// so a CUDA graph keeps the setting it was captured with.
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "binding.h"

namespace mlakv {
namespace torch_binding {
namespace {

// MLAKV_PDL=1 at load time (import mlakv) turns the switch on; anything else leaves it off.
bool pdl_from_env() {
  const char* value = std::getenv("MLAKV_PDL");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

// Relaxed: the flag orders nothing else; an op sees the value set before it was called on the
// same thread, and some recent value from any other thread.
std::atomic<bool> pdl_flag{pdl_from_env()};

void set_pdl_op(bool enabled) { pdl_flag.store(enabled, std::memory_order_relaxed); }

bool get_pdl_op() { return pdl_enabled(); }

}  // namespace

bool pdl_enabled() { return pdl_flag.load(std::memory_order_relaxed); }

}  // namespace torch_binding
}  // namespace mlakv

TORCH_LIBRARY_FRAGMENT(mlakv, m) {
  m.def("set_pdl(bool enabled) -> ()", &mlakv::torch_binding::set_pdl_op);
  m.def("get_pdl() -> bool", &mlakv::torch_binding::get_pdl_op);
}
