// mlakv tests: a deliberately faulty library under the real `mlakv` tool (target mlakv_faulty).
// The tool's object files are linked with `--wrap` on the ops they call, so each call lands here
// first; MLAKV_FAULT picks one op and one way to get it wrong, and `mlakv check` / `mlakv bench`
// must then report a mismatch and exit non-zero (the cli.fault.* ctest entries). A check that
// cannot see a wrong byte is the defect these tests exist to find.
//
//   MLAKV_FAULT=<op>[@cuda]:<what>[:last|:past]
//     op    mla_rope_cache, concat_and_cache_mla, decode_q_concat, rotary_embedding, rms_norm,
//           rmsnorm_quant, mla_rmsnorm_quant, per_token_group_quant_fp8, gather_cache_slots,
//           gather_cache_sequences (the library), ref.mla_rope_cache, ref.rmsnorm_quant,
//           ref.rms_norm, ref.gather_cache_slots (the host reference)
//     what  a buffer of the op's params (named as in its struct; mla_rope_cache:
//           kv_cache.rope_data for a split cache's rope part, kv_cache.scale and q_scale for its
//           scales; mla_rmsnorm_quant: kv_c and kv_c_out for its kv half, else its q half's
//           names): one byte of it is flipped after the op ran
//           (its first byte, its last with `:last`, or with `:past` the byte after its last:
//           outside the view, and for a cache or a view of unpadded rows outside its buffer, which
//           only `check`'s library runs may be asked for: their buffers have guard bytes);
//           `counter`: error counter 0 gains one; `throw`: the op throws mlakv::Error; `skip`: the
//           op is not run at all. A name the op does not fault (a misspelling) makes it throw "has
//           no buffer" after it ran.
//     @cuda the byte or counter is changed only where it lies in CUDA device memory, so that
//           `mlakv check --backend all` must find the CUDA run apart from the CPU run.
//
// A byte in host memory is flipped through its pointer. One in CUDA device memory (a CUDA build)
// is read back, flipped and written again after cudaDeviceSynchronize of its GPU. While the op's
// stream is being captured into a CUDA graph (the bench's timed runs) no byte is changed: the eager
// runs before the capture are the ones checked. CMakeLists.txt passes `--wrap` for every mangled
// mlakv name spelled in this file.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>

#include "mlakv/mlakv.h"
#include "reference/reference.h"

#if MLAKV_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

struct Fault {
  std::string op, what;
  bool last = false;
  bool past = false;       // the byte after the last
  bool cuda_only = false;  // @cuda
};

// The fault asked for in MLAKV_FAULT, or an empty op.
Fault requested_fault() {
  Fault f;
  const char* env = std::getenv("MLAKV_FAULT");
  if (env == nullptr) return f;
  const std::string spec(env);
  const size_t colon = spec.find(':');
  MLAKV_CHECK(colon != std::string::npos, "MLAKV_FAULT: expected <op>:<what>[:last|:past], got '",
              spec, "'");
  f.op = spec.substr(0, colon);
  f.what = spec.substr(colon + 1);
  const std::string at_cuda = "@cuda";
  if (f.op.size() > at_cuda.size() &&
      f.op.compare(f.op.size() - at_cuda.size(), at_cuda.size(), at_cuda) == 0) {
    f.op.resize(f.op.size() - at_cuda.size());
    f.cuda_only = true;
    MLAKV_CHECK(f.what != "throw" && f.what != "skip", "MLAKV_FAULT: @cuda changes a buffer or ",
                "counter, not '", f.what, "'");
  }
  for (const std::string suffix : {":last", ":past"}) {
    if (f.what.size() > suffix.size() &&
        f.what.compare(f.what.size() - suffix.size(), suffix.size(), suffix) == 0) {
      f.what.resize(f.what.size() - suffix.size());
      (suffix == ":last" ? f.last : f.past) = true;
    }
  }
  MLAKV_CHECK(!f.past || f.op.rfind("ref.", 0) != 0, "MLAKV_FAULT: the host reference's buffers ",
              "have no guard bytes: no :past for ", f.op);
  return f;
}

const Fault& fault() {
  static const Fault f = requested_fault();
  return f;
}

bool faulting(const char* op) { return fault().op == op; }

#if MLAKV_WITH_CUDA
// Without a usable device (a CUDA build on a machine without a GPU) both queries fail: every
// pointer is then host memory and nothing is being captured. The GPU that holds `p`, or -1.
int device_of(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? a.device : -1;
}

bool capturing(const mlakv::Context& ctx) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(ctx.stream), &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}
#else
int device_of(const void*) { return -1; }
bool capturing(const mlakv::Context&) { return false; }
#endif

// Applies `change` to the T at `p`, in host or CUDA device memory; with @cuda, only in device
// memory.
template <typename T, typename Change>
void modify(T* p, Change change) {
  const int device = device_of(p);
  if (device < 0) {
    if (!fault().cuda_only) change(*p);
    return;
  }
  // On the GPU that holds p (the op ran there; `check --device N` keeps cuda:0 current): the
  // library's memory helpers select it and restore the current device.
  const mlakv::Device gpu{mlakv::DeviceType::kCUDA, device};
  T value;
  mlakv::device_synchronize(gpu);
  mlakv::copy_device_to_host(gpu, &value, p, sizeof(T));
  change(value);
  mlakv::copy_host_to_device(gpu, p, &value, sizeof(T));
}

void flip(void* data, int64_t offset_bytes) {
  modify(static_cast<uint8_t*>(data) + offset_bytes, [](uint8_t& b) { b ^= 0x01; });
}

// Flips the first or the last byte a view spans, or the one after it; an absent view is left
// alone (a fault that changes nothing fails its test).
void flip(const mlakv::TensorView& v) {
  if (!v.present() || v.numel() == 0) return;
  int64_t offset = 0;
  if (fault().last || fault().past) {
    const int64_t elem = static_cast<int64_t>(mlakv::dtype_size(v.dtype));
    for (int d = 0; d < v.ndim; ++d) offset += (v.shape[d] - 1) * v.stride[d] * elem;
    offset += fault().past ? elem : elem - 1;
  }
  flip(v.data, offset);
}

// Flips the first or the last of `end` bytes at `data`, or the one after them.
void flip_span(void* data, int64_t end) {
  flip(data, fault().past ? end : fault().last ? end - 1 : 0);
}

// The (latent or combined) cache's span.
void flip(const mlakv::KVCacheView& c) { flip_span(c.data, c.num_blocks * c.stride_block_bytes); }

// A split cache's rope part; a combined cache has none and is left alone (its cases run
// unchanged).
void flip_rope_part(const mlakv::KVCacheView& c) {
  if (c.is_split()) flip_span(c.rope_data, c.num_blocks * c.stride_rope_block_bytes);
}

// Before the op: throw or skip it. Returns whether the op is to run.
bool before(const char* op) {
  if (!faulting(op)) return true;
  if (fault().what == "throw") MLAKV_FAIL("MLAKV_FAULT: ", op, " throws as asked");
  return fault().what != "skip";
}

void bump_counter(int32_t* error_counts) {
  MLAKV_CHECK(error_counts != nullptr, "MLAKV_FAULT: the op has no error counters");
  modify(error_counts, [](int32_t& n) { n += 1; });
}

[[noreturn]] void unknown(const char* op) {
  MLAKV_FAIL("MLAKV_FAULT: ", op, " has no buffer '", fault().what, "'");
}

using NamedViews = std::initializer_list<std::pair<const char*, const mlakv::TensorView*>>;

// Flips the view the fault names among `views`; `throw` and `skip` acted before the op, and any
// other name is an error.
void flip_named(const char* op, NamedViews views) {
  const std::string& w = fault().what;
  for (const auto& [name, view] : views) {
    if (w == name) return flip(*view);
  }
  if (w != "throw" && w != "skip") unknown(op);
}

// The ops with one buffer to corrupt: `name` flips it, any other name but `throw` / `skip` is an
// error.
void corrupt_one(const char* op, const char* name, const mlakv::TensorView& view) {
  if (faulting(op)) flip_named(op, {{name, &view}});
}

void corrupt(const char* op, const mlakv::ConcatAndCacheMlaParams& p) {
  if (!faulting(op)) return;
  if (fault().what == "kv_cache") return flip(p.kv_cache);
  flip_named(op, {});  // no view to flip: only the error for any name but `throw` / `skip`
}

void corrupt(const char* op, const mlakv::MlaRopeCacheParams& p, int32_t* error_counts) {
  if (!faulting(op)) return;
  const std::string& w = fault().what;
  if (w == "kv_cache") return flip(p.kv_cache);
  if (w == "kv_cache.rope_data") return flip_rope_part(p.kv_cache);
  if (w == "counter") return bump_counter(error_counts);
  if (w == "q_scale" || w == "kv_cache.scale") {
    // The op's scale floats; a case without one runs unchanged.
    const float* scale = w == "q_scale" ? p.q_scale : p.kv_cache.scale;
    if (scale != nullptr) flip(const_cast<float*>(scale), fault().last ? 3 : 0);
    return;
  }
  if (w == "num_decode_tokens_device") {
    // Only the cases with a device Td have one; the others run unchanged.
    if (p.num_decode_tokens_device != nullptr) {
      flip(const_cast<int32_t*>(p.num_decode_tokens_device), fault().last ? 3 : 0);
    }
    return;
  }
  flip_named(op, {{"positions", &p.positions},
                  {"slot_mapping", &p.slot_mapping},
                  {"cos_sin_cache", &p.cos_sin_cache},
                  {"kv_c", &p.kv_c},
                  {"k_pe", &p.k_pe},
                  {"kv_norm_weight", &p.kv_norm_weight},
                  {"k_pe_out", &p.k_pe_out},
                  {"kv_c_out", &p.kv_c_out},
                  {"q_pe", &p.q_pe},
                  {"ql_nope", &p.ql_nope},
                  {"q_out", &p.q_out},
                  {"q", &p.q},
                  {"q_prefill_out", &p.q_prefill_out}});
}

void corrupt(const char* op, const mlakv::RmsNormQuantParams& p) {
  if (!faulting(op)) return;
  flip_named(op, {{"input", &p.input},
                  {"normed_out", &p.normed_out},
                  {"values", &p.quant.values},
                  {"scales", &p.quant.scales}});
}

void corrupt(const char* op, const mlakv::RotaryEmbeddingParams& p) {
  if (!faulting(op)) return;
  flip_named(op, {{"query", &p.query}, {"key", &p.key}});
}

void corrupt(const char* op, const mlakv::RmsNormParams& p) {
  if (!faulting(op)) return;
  flip_named(op, {{"input", &p.input}, {"output", &p.output}});
}

// mla_rmsnorm_quant: `kv_c` and `kv_c_out` name its kv half; the other names its q half.
void corrupt(const char* op, const mlakv::MlaRmsNormQuantParams& p) {
  if (!faulting(op)) return;
  if (fault().what == "kv_c") return flip(p.kv.input);
  if (fault().what == "kv_c_out") return flip(p.kv.output);
  corrupt(op, p.q);
}

// The read-back ops: `out`, or `counter`.
template <typename Params>
void corrupt_gather(const char* op, const Params& p, int32_t* error_counts) {
  if (!faulting(op)) return;
  if (fault().what == "counter") return bump_counter(error_counts);
  flip_named(op, {{"out", &p.out}});
}

}  // namespace

// The wrapped symbols: `--wrap=S` sends the tool's calls of S to __wrap_S; __real_S is the op.
extern "C" {

#define MLAKV_FAULT_WRAP(mangled, Params, op, ...)                    \
  void __real_##mangled(const Params&, const mlakv::Context&);        \
  void __wrap_##mangled(const Params& p, const mlakv::Context& ctx) { \
    if (before(op)) __real_##mangled(p, ctx);                         \
    if (!capturing(ctx)) __VA_ARGS__;                                 \
  }

MLAKV_FAULT_WRAP(_ZN5mlakv14mla_rope_cacheERKNS_18MlaRopeCacheParamsERKNS_7ContextE,
                 mlakv::MlaRopeCacheParams, "mla_rope_cache",
                 corrupt("mla_rope_cache", p, ctx.error_counts))
MLAKV_FAULT_WRAP(_ZN5mlakv20concat_and_cache_mlaERKNS_23ConcatAndCacheMlaParamsERKNS_7ContextE,
                 mlakv::ConcatAndCacheMlaParams, "concat_and_cache_mla",
                 corrupt("concat_and_cache_mla", p))
MLAKV_FAULT_WRAP(_ZN5mlakv15decode_q_concatERKNS_19DecodeQConcatParamsERKNS_7ContextE,
                 mlakv::DecodeQConcatParams, "decode_q_concat",
                 corrupt_one("decode_q_concat", "q_out", p.q_out))
MLAKV_FAULT_WRAP(_ZN5mlakv16rotary_embeddingERKNS_21RotaryEmbeddingParamsERKNS_7ContextE,
                 mlakv::RotaryEmbeddingParams, "rotary_embedding", corrupt("rotary_embedding", p))
MLAKV_FAULT_WRAP(_ZN5mlakv8rms_normERKNS_13RmsNormParamsERKNS_7ContextE, mlakv::RmsNormParams,
                 "rms_norm", corrupt("rms_norm", p))
MLAKV_FAULT_WRAP(_ZN5mlakv13rmsnorm_quantERKNS_18RmsNormQuantParamsERKNS_7ContextE,
                 mlakv::RmsNormQuantParams, "rmsnorm_quant", corrupt("rmsnorm_quant", p))
MLAKV_FAULT_WRAP(_ZN5mlakv17mla_rmsnorm_quantERKNS_21MlaRmsNormQuantParamsERKNS_7ContextE,
                 mlakv::MlaRmsNormQuantParams, "mla_rmsnorm_quant", corrupt("mla_rmsnorm_quant", p))
MLAKV_FAULT_WRAP(
    _ZN5mlakv25per_token_group_quant_fp8ERKNS_24PerTokenGroupQuantParamsERKNS_7ContextE,
    mlakv::PerTokenGroupQuantParams, "per_token_group_quant_fp8",
    corrupt_one("per_token_group_quant_fp8", "scales", p.quant.scales))

MLAKV_FAULT_WRAP(_ZN5mlakv18gather_cache_slotsERKNS_22GatherCacheSlotsParamsERKNS_7ContextE,
                 mlakv::GatherCacheSlotsParams, "gather_cache_slots",
                 corrupt_gather("gather_cache_slots", p, ctx.error_counts))
MLAKV_FAULT_WRAP(_ZN5mlakv22gather_cache_sequencesERKNS_26GatherCacheSequencesParamsERKNS_7ContextE,
                 mlakv::GatherCacheSequencesParams, "gather_cache_sequences",
                 corrupt_gather("gather_cache_sequences", p, ctx.error_counts))

#undef MLAKV_FAULT_WRAP

// The host reference (tests/reference): its outputs are what the tool compares against. Its ops
// take the error counters as a pointer, or none.
#define MLAKV_REF_FAULT_WRAP(mangled, Params, op, ...) \
  void __real_##mangled(const Params&);                \
  void __wrap_##mangled(const Params& p) {             \
    if (before(op)) __real_##mangled(p);               \
    __VA_ARGS__;                                       \
  }
#define MLAKV_REF_FAULT_WRAP_COUNTED(mangled, Params, op, ...)    \
  void __real_##mangled(const Params&, int32_t*);                 \
  void __wrap_##mangled(const Params& p, int32_t* error_counts) { \
    if (before(op)) __real_##mangled(p, error_counts);            \
    __VA_ARGS__;                                                  \
  }

MLAKV_REF_FAULT_WRAP_COUNTED(_ZN5mlakv3ref14mla_rope_cacheERKNS_18MlaRopeCacheParamsEPi,
                             mlakv::MlaRopeCacheParams, "ref.mla_rope_cache",
                             corrupt("ref.mla_rope_cache", p, error_counts))
MLAKV_REF_FAULT_WRAP(_ZN5mlakv3ref13rmsnorm_quantERKNS_18RmsNormQuantParamsE,
                     mlakv::RmsNormQuantParams, "ref.rmsnorm_quant",
                     corrupt("ref.rmsnorm_quant", p))
MLAKV_REF_FAULT_WRAP_COUNTED(_ZN5mlakv3ref18gather_cache_slotsERKNS_22GatherCacheSlotsParamsEPi,
                             mlakv::GatherCacheSlotsParams, "ref.gather_cache_slots",
                             corrupt_gather("ref.gather_cache_slots", p, error_counts))
MLAKV_REF_FAULT_WRAP(_ZN5mlakv3ref8rms_normERKNS_13RmsNormParamsE, mlakv::RmsNormParams,
                     "ref.rms_norm", corrupt("ref.rms_norm", p))

#undef MLAKV_REF_FAULT_WRAP
#undef MLAKV_REF_FAULT_WRAP_COUNTED

}  // extern "C"
