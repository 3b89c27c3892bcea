// mlakv torch binding: the version counters of the tensors the ops write (ADInplaceOrView).
//
// Autograd finds a tensor modified in place after it was saved for backward by the tensor's
// version counter, which every in-place op of torch bumps. The schemas mark the tensors mlakv's
// ops write (Tensor(a!)); this kernel, between autograd and the backends, runs the op and then
// bumps the counter of each of those tensors that was given, as torch's own in-place ops do. A
// tensor made under torch.inference_mode has no counter and is left alone (inside inference mode
// this kernel is not reached at all).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <vector>

namespace mlakv {
namespace torch_binding {
namespace {

void bump_written_tensors(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                          torch::jit::Stack* stack) {
  const std::vector<c10::Argument>& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::AliasInfo* alias = args[i].alias_info();
    const c10::IValue& value = (*stack)[first + i];
    if (alias != nullptr && alias->isWrite() && value.isTensor()) {
      written.push_back(value.toTensor());
    }
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& t : written) {
    if (t.defined() && !t.is_inference()) torch::autograd::impl::bump_version(t);
  }
}

}  // namespace
}  // namespace torch_binding
}  // namespace mlakv

// Every op that writes into its arguments (the functional gathers write none).
TORCH_LIBRARY_IMPL(mlakv, ADInplaceOrView, m) {
  for (const char* op : {"mla_rope_cache", "mla_rope_cache.q_prefill_out", "rotary_embedding",
                         "concat_and_cache_mla", "decode_q_concat", "rms_norm",
                         "gather_cache_slots_out", "gather_cache_sequences_out", "rmsnorm_quant",
                         "mla_rmsnorm_quant", "per_token_group_quant_fp8"}) {
    m.impl(
        op,
        torch::CppFunction::makeFromBoxedFunction<&mlakv::torch_binding::bump_written_tensors>());
  }
}
