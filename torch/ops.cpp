// mlakv torch binding: the torch.ops.mlakv.* schemas and their CPU and CUDA kernels.
//
// Every op of include/mlakv/ops.h, with vLLM-style arguments. Schemas mark every tensor the op
// writes (Tensor(a!)); ops that write return nothing; the gather ops return a new tensor and
// mutate nothing (their *_out forms write into a given tensor and take the error counters).
// The token count of the ops that write the cache is slot_mapping.size(0), so inputs with more
// rows (CUDA-graph padding) work as engines pass them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "binding.h"

namespace mlakv {
namespace torch_binding {
namespace {

const int32_t* to_decode_count(const OptTensor& t, const at::Device& device) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kInt && t->numel() >= 1,
              "mlakv: num_decode_tokens_device: expected an int32 tensor of at least one element "
              "(the first is Td), got ",
              t->scalar_type(), " of shape ", t->sizes());
  TORCH_CHECK(t->device() == device, "mlakv: num_decode_tokens_device: expected a tensor on ",
              device, " (the op's device), got one on ", t->device());
  return t->data_ptr<int32_t>();
}

void check_1d(const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 1, "mlakv: ", name, ": expected a 1-D tensor, got shape ", t.sizes());
}

// t.size(0) with a clear error for a 0-dim tensor (size(0) alone raises an IndexError).
int64_t leading_size(const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.dim() >= 1, "mlakv: ", name, ": expected at least 1 dim, got a 0-dim tensor");
  return t.size(0);
}

// A [T, H * head_size] tensor seen as [T, H, head_size] (vLLM's query / key layout).
TensorView heads_view(const char* name, const at::Tensor& t, int64_t head_size) {
  if (t.dim() != 2) return to_view(name, t);
  TORCH_CHECK(head_size > 0 && t.size(1) % head_size == 0, "mlakv: ", name, ": a [T, ", t.size(1),
              "] tensor is not a whole number of heads of head_size ", head_size);
  return to_view(name, t.view({t.size(0), t.size(1) / head_size, head_size}));
}

template <typename Env>
void mla_rope_cache_op(const at::Tensor& positions, const at::Tensor& slot_mapping,
                       const at::Tensor& cos_sin_cache, bool is_neox, const at::Tensor& kv_c,
                       const at::Tensor& k_pe, at::Tensor& kv_cache, c10::string_view cache_format,
                       const OptTensor& kv_cache_scale, const OptTensor& kv_cache_rope,
                       const OptTensor& kv_norm_weight, double kv_norm_eps,
                       const OptTensor& k_pe_out, const OptTensor& kv_c_out, const OptTensor& q_pe,
                       const OptTensor& ql_nope, const OptTensor& q_out, const OptTensor& q_scale,
                       const OptTensor& q, const OptTensor& q_prefill_out,
                       int64_t num_decode_tokens, const OptTensor& num_decode_tokens_device,
                       const OptTensor& error_counts, bool ds_mla_pow2_scale) {
  translate_errors([&] {
    Env env("kv_c", kv_c, error_counts);
    check_1d("slot_mapping", slot_mapping);
    MlaRopeCacheParams p;
    p.num_tokens = slot_mapping.size(0);
    p.num_decode_tokens = num_decode_tokens;
    p.num_decode_tokens_device = to_decode_count(num_decode_tokens_device, kv_c.device());
    p.positions = to_view("positions", positions);
    p.slot_mapping = to_view("slot_mapping", slot_mapping);
    p.cos_sin_cache = to_view("cos_sin_cache", cos_sin_cache);
    p.rope_style = is_neox ? RopeStyle::kNeox : RopeStyle::kGptJ;
    p.kv_c = to_view("kv_c", kv_c);
    p.k_pe = to_view_squeeze_heads("k_pe", k_pe);
    p.kv_norm_weight = to_view("kv_norm_weight", kv_norm_weight);
    p.kv_norm_eps = to_float(kv_norm_eps);
    p.kv_cache = to_cache_view(kv_cache, cache_format, kv_cache_scale, kv_cache_rope, kv_c.size(-1),
                               p.k_pe.shape[p.k_pe.ndim - 1], "the widths of kv_c and k_pe",
                               ds_mla_pow2_scale);
    if (k_pe_out.has_value()) p.k_pe_out = to_view_squeeze_heads("k_pe_out", *k_pe_out);
    p.kv_c_out = to_view("kv_c_out", kv_c_out);
    p.q_pe = to_view("q_pe", q_pe);
    p.ql_nope = to_view("ql_nope", ql_nope);
    p.q_out = to_view("q_out", q_out);
    if (q_out.has_value()) p.q_scale = to_scale("q_scale", q_scale, q_out->device());
    TORCH_CHECK(q_out.has_value() || !q_scale.has_value(), "mlakv: q_scale: given without q_out");
    p.q = to_view("q", q);
    p.q_prefill_out = to_view("q_prefill_out", q_prefill_out);
    mla_rope_cache(p, env.ctx);
  });
}

// mla_rope_cache.q_prefill_out: the same op with the prefill rows' output in q_prefill_out, so q
// is read only. Its schema says so (the default overload marks q written, as the in-place form
// writes it), and torch.compile then need not copy a q that the caller still reads. A
// q_prefill_out that shares q's memory (q[:], the in-place form) is still written as the core
// allows: torch treats a write through one of two aliased arguments as a write to both.
template <typename Env>
void mla_rope_cache_q_prefill_out_op(
    const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& cos_sin_cache,
    bool is_neox, const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& kv_cache,
    c10::string_view cache_format, const OptTensor& kv_cache_scale, const OptTensor& kv_cache_rope,
    const OptTensor& kv_norm_weight, double kv_norm_eps, const OptTensor& k_pe_out,
    const OptTensor& kv_c_out, const OptTensor& q_pe, const OptTensor& ql_nope,
    const OptTensor& q_out, const OptTensor& q_scale, const at::Tensor& q,
    const at::Tensor& q_prefill_out, int64_t num_decode_tokens,
    const OptTensor& num_decode_tokens_device, const OptTensor& error_counts,
    bool ds_mla_pow2_scale) {
  mla_rope_cache_op<Env>(positions, slot_mapping, cos_sin_cache, is_neox, kv_c, k_pe, kv_cache,
                         cache_format, kv_cache_scale, kv_cache_rope, kv_norm_weight, kv_norm_eps,
                         k_pe_out, kv_c_out, q_pe, ql_nope, q_out, q_scale, q, q_prefill_out,
                         num_decode_tokens, num_decode_tokens_device, error_counts,
                         ds_mla_pow2_scale);
}

template <typename Env>
void rotary_embedding_op(const at::Tensor& positions, at::Tensor& query, const OptTensor& key,
                         int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox,
                         const OptTensor& error_counts) {
  translate_errors([&] {
    Env env("query", query, error_counts);
    check_1d("positions", positions);
    RotaryEmbeddingParams p;
    p.num_tokens = positions.size(0);
    p.positions = to_view("positions", positions);
    p.query = heads_view("query", query, head_size);
    if (key.has_value()) p.key = heads_view("key", *key, head_size);
    p.cos_sin_cache = to_view("cos_sin_cache", cos_sin_cache);
    p.rope_style = is_neox ? RopeStyle::kNeox : RopeStyle::kGptJ;
    // A query of another rank gets the core's message (it expects [T, H, head_size]).
    TORCH_CHECK(p.query.ndim != 3 || p.query.shape[2] == head_size,
                "mlakv: query: expected head_size ", head_size, ", got ", p.query.shape[2]);
    rotary_embedding(p, env.ctx);
  });
}

template <typename Env>
void concat_and_cache_mla_op(const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& kv_cache,
                             const at::Tensor& slot_mapping, c10::string_view cache_format,
                             const OptTensor& kv_cache_scale, const OptTensor& kv_cache_rope,
                             const OptTensor& error_counts, bool ds_mla_pow2_scale) {
  translate_errors([&] {
    Env env("kv_c", kv_c, error_counts);
    check_1d("slot_mapping", slot_mapping);
    ConcatAndCacheMlaParams p;
    p.num_tokens = slot_mapping.size(0);
    p.kv_c = to_view("kv_c", kv_c);
    p.k_pe = to_view_squeeze_heads("k_pe", k_pe);
    p.slot_mapping = to_view("slot_mapping", slot_mapping);
    p.kv_cache = to_cache_view(kv_cache, cache_format, kv_cache_scale, kv_cache_rope, kv_c.size(-1),
                               p.k_pe.shape[p.k_pe.ndim - 1], "the widths of kv_c and k_pe",
                               ds_mla_pow2_scale);
    concat_and_cache_mla(p, env.ctx);
  });
}

template <typename Env>
void decode_q_concat_op(const at::Tensor& ql_nope, const at::Tensor& q_pe, at::Tensor& q_out,
                        const OptTensor& q_scale) {
  translate_errors([&] {
    Env env("q_out", q_out, std::nullopt);
    DecodeQConcatParams p;
    p.num_tokens = leading_size("q_out", q_out);
    p.ql_nope = to_view("ql_nope", ql_nope);
    p.q_pe = to_view("q_pe", q_pe);
    p.q_out = to_view("q_out", q_out);
    p.q_scale = to_scale("q_scale", q_scale, q_out.device());
    decode_q_concat(p, env.ctx);
  });
}

template <typename Env>
void rms_norm_op(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps) {
  translate_errors({{"output", "out"}}, [&] {
    Env env("input", input, std::nullopt);
    RmsNormParams p;
    p.num_tokens = leading_size("input", input);
    p.input = to_view("input", input);
    p.weight = to_view("weight", weight);
    p.eps = to_float(eps);
    p.output = to_view("out", out);
    rms_norm(p, env.ctx);
  });
}

void check_gather_dtype(at::ScalarType out_dtype) {
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16,
              "mlakv: out_dtype: expected float32 or bfloat16, got ", out_dtype);
}

template <typename Env>
void gather_cache_slots_out_op(at::Tensor& out, const at::Tensor& kv_cache,
                               c10::string_view cache_format, const OptTensor& kv_cache_scale,
                               const OptTensor& kv_cache_rope, const at::Tensor& slots,
                               int64_t kv_lora_rank, const OptTensor& error_counts) {
  translate_errors([&] {
    Env env("kv_cache", kv_cache, error_counts);
    check_1d("slots", slots);
    GatherCacheSlotsParams p;
    p.num_tokens = slots.size(0);
    p.kv_cache = to_cache_view(kv_cache, cache_format, kv_cache_scale, kv_cache_rope, kv_lora_rank,
                               -1, "kv_lora_rank", false);
    p.slots = to_view("slots", slots);
    p.out = to_view("out", out);
    gather_cache_slots(p, env.ctx);
  });
}

// The functional form allocates its result; it takes no error counters, so that it mutates
// nothing (torch.compile lowers an op that both returns and mutates poorly).
template <typename Env>
at::Tensor gather_cache_slots_op(const at::Tensor& kv_cache, c10::string_view cache_format,
                                 const OptTensor& kv_cache_scale, const OptTensor& kv_cache_rope,
                                 const at::Tensor& slots, int64_t kv_lora_rank,
                                 at::ScalarType out_dtype) {
  at::Tensor out = translate_errors([&] {
    check_gather_dtype(out_dtype);
    const KVCacheView cache = to_cache_view(kv_cache, cache_format, kv_cache_scale, kv_cache_rope,
                                            kv_lora_rank, -1, "kv_lora_rank", false);
    return at::empty({leading_size("slots", slots), cache_entry_width(cache)},
                     kv_cache.options().dtype(out_dtype));
  });
  gather_cache_slots_out_op<Env>(out, kv_cache, cache_format, kv_cache_scale, kv_cache_rope, slots,
                                 kv_lora_rank, std::nullopt);
  return out;
}

template <typename Env>
void gather_cache_sequences_out_op(at::Tensor& out, const at::Tensor& kv_cache,
                                   c10::string_view cache_format, const OptTensor& kv_cache_scale,
                                   const OptTensor& kv_cache_rope, const at::Tensor& block_table,
                                   const at::Tensor& cu_seq_lens, int64_t kv_lora_rank,
                                   const OptTensor& error_counts) {
  translate_errors([&] {
    Env env("kv_cache", kv_cache, error_counts);
    check_1d("cu_seq_lens", cu_seq_lens);
    TORCH_CHECK(cu_seq_lens.size(0) >= 1,
                "mlakv: cu_seq_lens: expected B + 1 >= 1 elements, got none");
    GatherCacheSequencesParams p;
    p.num_seqs = cu_seq_lens.size(0) - 1;
    p.kv_cache = to_cache_view(kv_cache, cache_format, kv_cache_scale, kv_cache_rope, kv_lora_rank,
                               -1, "kv_lora_rank", false);
    p.block_table = to_view("block_table", block_table);
    p.cu_seq_lens = to_view("cu_seq_lens", cu_seq_lens);
    p.out = to_view("out", out);
    gather_cache_sequences(p, env.ctx);
  });
}

template <typename Env>
at::Tensor gather_cache_sequences_op(const at::Tensor& kv_cache, c10::string_view cache_format,
                                     const OptTensor& kv_cache_scale,
                                     const OptTensor& kv_cache_rope, const at::Tensor& block_table,
                                     const at::Tensor& cu_seq_lens, int64_t num_out_rows,
                                     int64_t kv_lora_rank, at::ScalarType out_dtype) {
  at::Tensor out = translate_errors([&] {
    check_gather_dtype(out_dtype);
    TORCH_CHECK(num_out_rows >= 0, "mlakv: num_out_rows: expected >= 0, got ", num_out_rows);
    const KVCacheView cache = to_cache_view(kv_cache, cache_format, kv_cache_scale, kv_cache_rope,
                                            kv_lora_rank, -1, "kv_lora_rank", false);
    // Rows past cu_seq_lens[B] belong to no sequence: zeros, never uninitialized memory.
    return at::zeros({num_out_rows, cache_entry_width(cache)}, kv_cache.options().dtype(out_dtype));
  });
  gather_cache_sequences_out_op<Env>(out, kv_cache, cache_format, kv_cache_scale, kv_cache_rope,
                                     block_table, cu_seq_lens, kv_lora_rank, std::nullopt);
  return out;
}

template <typename Env>
void register_kernels(torch::Library& m) {
  m.impl("mla_rope_cache", &mla_rope_cache_op<Env>);
  m.impl("mla_rope_cache.q_prefill_out", &mla_rope_cache_q_prefill_out_op<Env>);
  m.impl("rotary_embedding", &rotary_embedding_op<Env>);
  m.impl("concat_and_cache_mla", &concat_and_cache_mla_op<Env>);
  m.impl("decode_q_concat", &decode_q_concat_op<Env>);
  m.impl("rms_norm", &rms_norm_op<Env>);
  m.impl("gather_cache_slots", &gather_cache_slots_op<Env>);
  m.impl("gather_cache_slots_out", &gather_cache_slots_out_op<Env>);
  m.impl("gather_cache_sequences", &gather_cache_sequences_op<Env>);
  m.impl("gather_cache_sequences_out", &gather_cache_sequences_out_op<Env>);
}

}  // namespace
}  // namespace torch_binding
}  // namespace mlakv

TORCH_LIBRARY(mlakv, m) {
  // Fake (meta) kernels live in Python; torch imports this module when it needs them.
  m.set_python_module("mlakv._fake");
  m.def(
      "mla_rope_cache(Tensor positions, Tensor slot_mapping, Tensor cos_sin_cache, bool is_neox, "
      "Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, str cache_format, Tensor? kv_cache_scale, "
      "Tensor(b!)? kv_cache_rope, Tensor? kv_norm_weight, float kv_norm_eps, "
      "Tensor(c!)? k_pe_out, Tensor(d!)? kv_c_out, Tensor? q_pe, Tensor? ql_nope, "
      "Tensor(e!)? q_out, Tensor? q_scale, Tensor(f!)? q, Tensor(g!)? q_prefill_out, "
      "SymInt num_decode_tokens, Tensor? num_decode_tokens_device, Tensor(h!)? error_counts, "
      "bool ds_mla_pow2_scale=False) -> ()");
  // The same arguments, with q read only and q_prefill_out required (see the kernel above).
  m.def(
      "mla_rope_cache.q_prefill_out(Tensor positions, Tensor slot_mapping, Tensor cos_sin_cache, "
      "bool is_neox, Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, str cache_format, "
      "Tensor? kv_cache_scale, Tensor(b!)? kv_cache_rope, Tensor? kv_norm_weight, "
      "float kv_norm_eps, Tensor(c!)? k_pe_out, Tensor(d!)? kv_c_out, Tensor? q_pe, "
      "Tensor? ql_nope, Tensor(e!)? q_out, Tensor? q_scale, Tensor q, Tensor(f!) q_prefill_out, "
      "SymInt num_decode_tokens, Tensor? num_decode_tokens_device, Tensor(h!)? error_counts, "
      "bool ds_mla_pow2_scale=False) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
      "Tensor cos_sin_cache, bool is_neox, Tensor(c!)? error_counts=None) -> ()");
  m.def(
      "concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "str cache_format, Tensor? kv_cache_scale=None, Tensor(b!)? kv_cache_rope=None, "
      "Tensor(c!)? error_counts=None, bool ds_mla_pow2_scale=False) -> ()");
  m.def("decode_q_concat(Tensor ql_nope, Tensor q_pe, Tensor(a!) q_out, Tensor? q_scale) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float eps) -> ()");
  m.def(
      "gather_cache_slots(Tensor kv_cache, str cache_format, Tensor? kv_cache_scale, "
      "Tensor? kv_cache_rope, Tensor slots, int kv_lora_rank, ScalarType out_dtype) -> Tensor");
  m.def(
      "gather_cache_slots_out(Tensor(a!) out, Tensor kv_cache, str cache_format, "
      "Tensor? kv_cache_scale, Tensor? kv_cache_rope, Tensor slots, int kv_lora_rank, "
      "Tensor(b!)? error_counts) -> ()");
  m.def(
      "gather_cache_sequences(Tensor kv_cache, str cache_format, Tensor? kv_cache_scale, "
      "Tensor? kv_cache_rope, Tensor block_table, Tensor cu_seq_lens, SymInt num_out_rows, "
      "int kv_lora_rank, ScalarType out_dtype) -> Tensor");
  m.def(
      "gather_cache_sequences_out(Tensor(a!) out, Tensor kv_cache, str cache_format, "
      "Tensor? kv_cache_scale, Tensor? kv_cache_rope, Tensor block_table, Tensor cu_seq_lens, "
      "int kv_lora_rank, Tensor(b!)? error_counts) -> ()");
}

TORCH_LIBRARY_IMPL(mlakv, CPU, m) {
  mlakv::torch_binding::register_kernels<mlakv::torch_binding::CpuEnv>(m);
}

#ifdef MLAKV_TORCH_CUDA
TORCH_LIBRARY_IMPL(mlakv, CUDA, m) {
  mlakv::torch_binding::register_kernels<mlakv::torch_binding::CudaEnv>(m);
}
#endif
