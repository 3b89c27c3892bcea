// mlakv CLI: `mlakv bench`. DeepSeek-V3 shapes; for every workload and token count: a correctness
// check, then the fused op, the unfused primitives an engine runs today, and a copy of the same
// bytes, timed on one backend. Two families of workloads: the K/Q-side data path (mla_rope_cache,
// class Row) and the layer's input norms (rmsnorm_quant / mla_rmsnorm_quant, class NormRow).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "commands.h"
#include "mlakv/mlakv.h"
#include "reference/reference.h"
#include "timer.h"
#include "util.h"

namespace mlakv {
namespace cli {
namespace {

// DeepSeek-V3's widths: kv_lora_rank 512, rope 64, nope 128. The query heads on the GPU are an
// option (BenchOptions::heads): 128 without tensor parallelism, 128 / TP with it.
constexpr int64_t kModelHeads = 128;
constexpr int64_t kL = 512;
constexpr int64_t kR = 64;
constexpr int64_t kP = 128;
constexpr int64_t kQc = 1536;         // q_lora_rank: the width of q_c
constexpr int64_t kQuantGroup = 128;  // G of the FP8 block-scaled q_b_proj (DeepSeek-V3: 128 x 128)
constexpr int64_t kBlockSize = 64;
constexpr DType kModel = DType::kBFloat16;
constexpr int64_t kModelBytes = 2;
constexpr int64_t kIndexBytes = 8;  // int64 positions and slots
constexpr float kNormEps = 1e-6f;   // q/kv_a_layernorm's eps (DeepSeek-V3 rms_norm_eps)
// The DeepSeek-V3 YaRN table has 4096 * 40 positions; decode positions are spread over all of it.
constexpr int64_t kMaxPos = 163840;
constexpr float kFp8CacheScale = 0.0234375f;
// Enough sets that every mla_rope_cache row's inputs exceed the timer's rotation (200 MiB on CUDA:
// 706 sets of decode_bf16 T = 1); only the smallest rows of decode_nope_in_q_out and the norms
// stay below it (the `sets` column says how many were rotated).
constexpr int kMaxSets = 1024;
// The reference is a scalar host loop: check it against the fused op at every T up to this.
constexpr int64_t kMaxReferenceTokens = 512;
constexpr uint8_t kPoisonByte = 0xA5;

// kDecode / kPrefill / kMixed: mla_rope_cache (Row). kNormQuant: rmsnorm_quant of q_c;
// kDualNorm: mla_rmsnorm_quant of q_c and kv_c (NormRow).
enum class Kind { kDecode, kPrefill, kMixed, kNormQuant, kDualNorm };

struct Workload {
  const char* name;
  const char* description;
  Kind kind;
  CacheFormat cache_format;  // mla_rope_cache workloads only, as q_out_dtype .. kv_norm
  DType q_out_dtype;
  bool nope_in_q_out;  // the absorb GEMM already wrote ql_nope into q_out
  bool kv_norm;        // kv_a_layernorm inside the fused op (unfused: an rms_norm launch first)
  std::vector<int64_t> cuda_tokens;
  std::vector<int64_t> cpu_tokens;  // capped so that the whole CPU bench stays under 2 minutes
};

const std::vector<Workload>& all_workloads() {
  static const std::vector<Workload> workloads = {
      {"decode_bf16",
       "decode, bf16 cache, bf16 q_out",
       Kind::kDecode,
       CacheFormat::kBFloat16,
       DType::kBFloat16,
       false,
       false,
       {1, 8, 32, 128, 512, 2048, 8192},
       {1, 8, 32, 128, 512, 2048}},
      {"decode_bf16_norm",
       "decode, bf16, kv_a_layernorm in the op",
       Kind::kDecode,
       CacheFormat::kBFloat16,
       DType::kBFloat16,
       false,
       true,
       {1, 8, 32, 128, 512, 2048},
       {1, 32, 128, 512}},
      {"decode_fp8",
       "decode, fp8 e4m3 cache, fp8 e4m3 q_out",
       Kind::kDecode,
       CacheFormat::kFloat8E4M3,
       DType::kFloat8E4M3,
       false,
       false,
       {1, 8, 32, 128, 512, 2048, 8192},
       {1, 8, 32, 128, 512, 2048}},
      {"decode_fp8_cache",
       "decode, fp8 e4m3 cache, bf16 q_out",
       Kind::kDecode,
       CacheFormat::kFloat8E4M3,
       DType::kBFloat16,
       false,
       false,
       {1, 8, 32, 128, 512, 2048, 8192},
       {1, 32, 512}},
      {"decode_ds_mla",
       "decode, fp8_ds_mla cache (656-byte entries, tile scales), bf16 q_out",
       Kind::kDecode,
       CacheFormat::kFloat8DsMla,
       DType::kBFloat16,
       false,
       false,
       {1, 8, 32, 128, 512, 2048, 8192},
       {1, 32, 512}},
      {"decode_nope_in_q_out",
       "decode, bf16, ql_nope already in q_out",
       Kind::kDecode,
       CacheFormat::kBFloat16,
       DType::kBFloat16,
       true,
       false,
       {1, 8, 32, 128, 512, 2048, 8192},
       {1, 8, 32, 128, 512, 2048}},
      {"prefill_bf16",
       "prefill, bf16 cache, q rotated in place",
       Kind::kPrefill,
       CacheFormat::kBFloat16,
       DType::kBFloat16,
       false,
       false,
       {128, 1024, 4096, 8192, 16384},
       {128, 1024, 4096}},
      {"mixed_bf16",
       "half decode then half prefill, bf16",
       Kind::kMixed,
       CacheFormat::kBFloat16,
       DType::kBFloat16,
       false,
       false,
       {128, 1024, 4096, 16384},
       {128, 1024, 4096}},
      {"rmsnorm_quant_qc",
       "q_c [T, 1536] bf16 -> RMSNorm -> e4m3 + column-major scales (G 128)",
       Kind::kNormQuant,
       CacheFormat::kBFloat16,
       DType::kBFloat16,
       false,
       true,
       {1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384},
       {1, 32, 512, 4096}},
      {"mla_rmsnorm_quant",
       "q_c as rmsnorm_quant_qc, kv_c [T, 512] -> RMSNorm -> bf16, one launch",
       Kind::kDualNorm,
       CacheFormat::kBFloat16,
       DType::kBFloat16,
       false,
       true,
       {1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384},
       {1, 32, 512, 4096}},
  };
  return workloads;
}

int64_t decode_tokens(Kind kind, int64_t T) {
  switch (kind) {
    case Kind::kDecode:
      return T;
    case Kind::kPrefill:
      return 0;
    case Kind::kMixed:
      return T / 2;
    case Kind::kNormQuant:
    case Kind::kDualNorm:
      return 0;
  }
  return 0;
}

// The fused op's minimal traffic: every input read once, every output written once. The cos/sin
// rows (256 B a token, shared by all its heads) are not counted, which understates GB/s and %copy
// by as much: 0.1-0.7 % of a row's bytes at H = 128, 4 % at H = 16, 10 % at H = 1 (prefill).
int64_t fused_bytes(const Workload& w, int64_t T, int64_t H) {
  const int64_t Td = decode_tokens(w.kind, T);
  const int64_t q_out_bytes = static_cast<int64_t>(dtype_size(w.q_out_dtype));
  const int64_t entry_bytes = cache_entry_bytes(w.cache_format, kL, kR);
  // K side and indices, every token: kv_c + k_pe + position + slot read, one cache entry written.
  int64_t bytes = T * ((kL + kR) * kModelBytes + 2 * kIndexBytes + entry_bytes);
  // Decode Q side: q_pe read, rope part of q_out written; plus ql_nope read and the nope part of
  // q_out written unless the nope part is already in place.
  bytes += Td * H * kR * (kModelBytes + q_out_bytes);
  if (!w.nope_in_q_out) bytes += Td * H * kL * (kModelBytes + q_out_bytes);
  // Prefill Q side: the rope part of q read and written.
  bytes += (T - Td) * H * kR * kModelBytes * 2;
  // The RMSNorm weight, read once.
  if (w.kv_norm) bytes += kL * kModelBytes;
  return bytes;
}

struct HostInputs {
  std::vector<uint8_t> positions, slots, kv_c, k_pe, q_pe, ql_nope, q;
};

struct InputSet {
  HostInputs host;  // kept for the checked sets only (restore after the check, reference)
  Buffer positions, slots, kv_c, k_pe, q_pe, ql_nope, q_out, q;
};

std::string row_label(const Workload& w, int64_t T) {
  return std::string(w.name) + " T=" + std::to_string(T);
}

void expect_same(const std::string& label, const char* what, const char* versus,
                 const std::vector<uint8_t>& got, const std::vector<uint8_t>& expected,
                 size_t begin, size_t end) {
  MLAKV_CHECK(got.size() >= end && expected.size() >= end, label, ": ", what,
              ": buffer sizes differ");
  const int64_t at = first_difference(got.data() + begin, expected.data() + begin, end - begin);
  if (at >= 0) {
    const size_t i = begin + static_cast<size_t>(at);
    char buf[160];
    std::snprintf(buf, sizeof(buf), "byte %zu of %zu: fused 0x%02x, %s 0x%02x", i, end, got[i],
                  versus, expected[i]);
    throw std::runtime_error(label + ": CORRECTNESS CHECK FAILED: " + what + " differs from " +
                             versus + " at " + buf);
  }
}

// An input the op must not write: its device buffer still holds its upload (an empty host copy:
// the row has no such input).
void expect_unchanged(const std::string& label, const char* what, const Buffer& device,
                      const std::vector<uint8_t>& uploaded) {
  if (uploaded.empty()) return;
  expect_same(label, what, "its upload", device.download(), uploaded, 0, uploaded.size());
}

// One (workload, T) row of the table: its input sets, ops and correctness check.
class BenchRow {
 public:
  virtual ~BenchRow() = default;
  virtual int num_sets() const = 0;
  virtual int64_t bytes() const = 0;
  virtual int64_t decode_tokens() const = 0;
  virtual Op fused_op(int s) const = 0;
  virtual Op unfused_op(int s) const = 0;
  // The fused op's bytes equal the unfused path's on set 0, and the reference's when asked.
  virtual void check(bool with_reference) = 0;
};

// Input sets rotated through: enough to exceed the timer's rotation size, at most kMaxSets.
int rotation_sets(const Timer& timer, int64_t bytes) {
  const size_t rotation = timer.rotation_bytes();
  return static_cast<size_t>(bytes) >= rotation
             ? 1
             : std::min<int>(kMaxSets, static_cast<int>((rotation + bytes - 1) / bytes));
}

// Shared by every mla_rope_cache row: the YaRN cos/sin table, the fp8 scales and the error
// counters. The host copies are what the reference reads and what the inputs are checked against
// after the fused op (a read-back would let a fused op that wrote them agree with itself).
struct SharedInputs {
  Buffer table, cache_scale, q_scale, error_counts;
  std::vector<uint8_t> table_host, cache_scale_host, q_scale_host;
};

// The buffers, params and ops of one mla_rope_cache (workload, T) row.
class Row : public BenchRow {
 public:
  Row(const Workload& w, int64_t T, int64_t H, bool shared_indices, Timer& timer,
      const SharedInputs& shared, int workload_index)
      : w_(w),
        T_(T),
        Td_(cli::decode_tokens(w.kind, T)),
        H_(H),
        shared_indices_(shared_indices),
        device_(timer.device()),
        timer_(timer),
        shared_(shared) {
    bytes_ = fused_bytes(w, T, H);
    num_sets_ = rotation_sets(timer, bytes_);
    // Scattered slots over a cache twice as large as the tokens that write it: every set's tokens
    // into one cache, or, where the sets share their slots (shared_indices_), each set's tokens
    // into a cache of its own, as each layer of a step has its own.
    const int64_t writers = shared_indices_ ? T : T * num_sets_;
    const int64_t min_slots = std::max<int64_t>(2 * writers, 4 * kBlockSize);
    num_blocks_ = (min_slots + kBlockSize - 1) / kBlockSize;
    const int64_t one_cache = cache_bytes(w.cache_format, num_blocks_, kBlockSize, kL, kR);
    cache_set_stride_ = shared_indices_ ? static_cast<size_t>(one_cache) : 0;
    cache_ = Buffer(device_, static_cast<size_t>(one_cache) * (shared_indices_ ? num_sets_ : 1));
    cache_.fill_byte(0);
    if (w.kv_norm) {
      // The RMSNorm weight (shared by every set) and the unfused path's normalized kv_c.
      Rng weight_rng(0x4e0f0000u + static_cast<uint64_t>(T));
      norm_weight_host_ = random_values(kModel, kL, 2.0f, weight_rng);
      norm_weight_ = Buffer(device_, norm_weight_host_.size());
      norm_weight_.upload(norm_weight_host_);
      kv_c_normed_ = Buffer(device_, static_cast<size_t>(T * kL * kModelBytes));
    }
    Rng slot_rng(0x5eed0000u + 7919u * static_cast<uint64_t>(workload_index) +
                 static_cast<uint64_t>(T));
    const std::vector<int64_t> all_slots =
        random_distinct_slots(writers, num_blocks_ * kBlockSize, slot_rng);
    for (int s = 0; s < num_sets_; ++s) {
      Rng rng(0xbe4c0000u + 1000003u * static_cast<uint64_t>(workload_index) +
              31u * static_cast<uint64_t>(T) + static_cast<uint64_t>(s));
      const int64_t first = shared_indices_ ? 0 : s * T;
      std::vector<int64_t> slots(all_slots.begin() + first, all_slots.begin() + first + T);
      sets_.push_back(make_set(rng, slots, /*keep_host=*/is_checked(s),
                               /*own_indices=*/s == 0 || !shared_indices_));
    }
  }

  int num_sets() const override { return num_sets_; }
  int64_t bytes() const override { return bytes_; }
  int64_t decode_tokens() const override { return Td_; }

  Op fused_op(int s) const override {
    const MlaRopeCacheParams params = fused_params(s);
    int32_t* counts = shared_.error_counts.as<int32_t>();
    const Timer* timer = &timer_;
    return [params, counts, timer](void* stream) {
      Context ctx = timer->context(stream);
      ctx.error_counts = counts;
      mla_rope_cache(params, ctx);
    };
  }

  // What an engine runs today: rotary_embedding on q's rope part (decode: q_pe) and k_pe in place,
  // concat_and_cache_mla, then the decode-query concat (or, with ql_nope already in q_out, a
  // strided copy of the rotated q_pe into q_out, as torch's copy_ would do).
  Op unfused_op(int s) const override {
    const InputSet& in = sets_[s];
    RotaryEmbeddingParams rope;
    rope.num_tokens = T_;
    rope.positions = index_view(indices_of(s).positions);
    rope.query = w_.kind == Kind::kDecode ? make_view(in.q_pe.data(), kModel, {T_, H_, kR}, device_)
                                          : q_rope_view(in, T_);
    rope.key = make_view(in.k_pe.data(), kModel, {T_, 1, kR}, device_);
    rope.cos_sin_cache = table_view();
    rope.rope_style = RopeStyle::kGptJ;

    // With kv_a_layernorm: rms_norm of kv_c into a scratch tensor, which concat then reads.
    RmsNormParams norm;
    if (w_.kv_norm) {
      norm.num_tokens = T_;
      norm.input = make_view(in.kv_c.data(), kModel, {T_, kL}, device_);
      norm.weight = make_view(norm_weight_.data(), kModel, {kL}, device_);
      norm.eps = kNormEps;
      norm.output = make_view(kv_c_normed_.data(), kModel, {T_, kL}, device_);
    }
    ConcatAndCacheMlaParams concat;
    concat.num_tokens = T_;
    concat.kv_c = w_.kv_norm ? norm.output : make_view(in.kv_c.data(), kModel, {T_, kL}, device_);
    concat.k_pe = make_view(in.k_pe.data(), kModel, {T_, kR}, device_);
    concat.slot_mapping = index_view(indices_of(s).slots);
    concat.kv_cache = cache_view(s);

    const bool q_concat = Td_ > 0 && !w_.nope_in_q_out;
    DecodeQConcatParams q_params;
    if (q_concat) {
      q_params.num_tokens = Td_;
      q_params.ql_nope = make_view(in.ql_nope.data(), kModel, {Td_, H_, kL}, device_);
      q_params.q_pe = decode_q_pe_view(in);
      q_params.q_out = make_view(in.q_out.data(), w_.q_out_dtype, {Td_, H_, kL + kR}, device_);
      if (is_float8(w_.q_out_dtype)) q_params.q_scale = shared_.q_scale.as<float>();
    }
    Op q_copy;
    if (Td_ > 0 && w_.nope_in_q_out) {
      const size_t q_out_elem = dtype_size(w_.q_out_dtype);
      q_copy = timer_.copy_2d_op(in.q_out.as<uint8_t>() + kL * q_out_elem, (kL + kR) * q_out_elem,
                                 in.q_pe.data(), kR * kModelBytes, kR * kModelBytes,
                                 static_cast<size_t>(Td_ * H_));
    }
    int32_t* counts = shared_.error_counts.as<int32_t>();
    const bool kv_norm = w_.kv_norm;
    const Timer* timer = &timer_;
    return [rope, norm, kv_norm, concat, q_concat, q_params, q_copy, counts, timer](void* stream) {
      Context ctx = timer->context(stream);
      ctx.error_counts = counts;
      if (kv_norm) rms_norm(norm, ctx);
      rotary_embedding(rope, ctx);
      concat_and_cache_mla(concat, ctx);
      if (q_concat) decode_q_concat(q_params, ctx);
      if (q_copy) q_copy(stream);
    };
  }

  // fused == unfused byte for byte (cache, q_out, q), and fused == reference when asked: on set 0,
  // and with shared indices also on the last set, which reads set 0's positions and slot_mapping
  // and must write its own cache (checked against the reference, which writes there).
  void check(bool with_reference) override {
    for (int s = 0; s < num_sets_; ++s) {
      if (is_checked(s)) check_set(s, with_reference);
    }
  }

 private:
  // The sets check() compares (their host inputs are kept): set 0, and with shared indices the
  // last set too.
  bool is_checked(int s) const { return s == 0 || (shared_indices_ && s == num_sets_ - 1); }

  void check_set(int s, bool with_reference) {
    const std::string label =
        row_label(w_, T_) + (s == 0 ? std::string() : " set " + std::to_string(s));
    InputSet& in = sets_[s];
    const InputSet& idx = indices_of(s);
    reset_error_counts(shared_.error_counts.as<int32_t>(), device_);

    poison_outputs(in);
    fused_op(s)(nullptr);
    device_synchronize(device_);
    const std::vector<uint8_t> cache_fused = cache_.download();
    const std::vector<uint8_t> q_out_fused = Td_ > 0 ? in.q_out.download() : std::vector<uint8_t>();
    const std::vector<uint8_t> q_fused = has_q() ? in.q.download() : std::vector<uint8_t>();
    // The fused op writes none of its inputs (q's prefill rows are its in-place output, compared
    // below; a mixed row's decode rows of q hold its q_pe).
    expect_unchanged(label, "cos_sin_cache", shared_.table, shared_.table_host);
    if (is_float8(w_.q_out_dtype)) {
      expect_unchanged(label, "q_scale", shared_.q_scale, shared_.q_scale_host);
    }
    if (cache_is_per_tensor_fp8(w_.cache_format)) {
      expect_unchanged(label, "kv_cache_scale", shared_.cache_scale, shared_.cache_scale_host);
    }
    expect_unchanged(label, "positions", idx.positions, idx.host.positions);
    expect_unchanged(label, "slot_mapping", idx.slots, idx.host.slots);
    expect_unchanged(label, "kv_c", in.kv_c, in.host.kv_c);
    expect_unchanged(label, "k_pe", in.k_pe, in.host.k_pe);
    expect_unchanged(label, "q_pe", in.q_pe, in.host.q_pe);
    expect_unchanged(label, "ql_nope", in.ql_nope, in.host.ql_nope);
    const size_t q_row_bytes = static_cast<size_t>(H_ * (kP + kR) * kModelBytes);
    if (has_q() && Td_ > 0) {
      expect_same(label, "q (decode rows)", "its upload", q_fused, in.host.q, 0,
                  static_cast<size_t>(Td_) * q_row_bytes);
    }

    restore_inputs(in);
    poison_outputs(in);
    unfused_op(s)(nullptr);
    device_synchronize(device_);
    expect_same(label, "cache", "unfused", cache_fused, cache_.download(), 0, cache_.bytes());
    if (Td_ > 0) {
      expect_same(label, "q_out", "unfused", q_out_fused, in.q_out.download(), 0,
                  q_out_fused.size());
    }
    if (has_q()) {
      // The unfused path also rotates the decode rows of q in place (the fused op reads them as
      // q_pe): compare the prefill rows only.
      expect_same(label, "q (prefill rows)", "unfused", q_fused, in.q.download(),
                  static_cast<size_t>(Td_) * q_row_bytes, static_cast<size_t>(T_) * q_row_bytes);
    }
    restore_inputs(in);

    int32_t counts[kNumErrorCounters] = {};
    read_error_counts(shared_.error_counts.as<int32_t>(), device_, counts, nullptr,
                      /*throw_if_nonzero=*/true);

    if (!with_reference) return;
    std::vector<uint8_t> cache_ref(cache_.bytes(), kPoisonByte);
    std::vector<uint8_t> q_out_ref(Td_ > 0 ? in.q_out.bytes() : 0, kPoisonByte);
    std::vector<uint8_t> q_ref = in.host.q;
    std::vector<uint8_t> q_pe_ref = in.host.q_pe;
    std::vector<uint8_t> k_pe_ref = in.host.k_pe;
    const float cache_scale = kFp8CacheScale;
    float q_scale = 1.0f;
    std::memcpy(&q_scale, shared_.q_scale_host.data(), sizeof(q_scale));
    MlaRopeCacheParams p = fused_params(s);
    const Device host{DeviceType::kCPU, 0};
    auto rebase = [&](TensorView& v, void* data) {
      if (!v.present()) return;
      v.data = data;
      v.device = host;
    };
    rebase(p.positions, const_cast<uint8_t*>(idx.host.positions.data()));
    rebase(p.slot_mapping, const_cast<uint8_t*>(idx.host.slots.data()));
    rebase(p.cos_sin_cache, const_cast<uint8_t*>(shared_.table_host.data()));
    rebase(p.kv_c, in.host.kv_c.data());
    rebase(p.kv_norm_weight, norm_weight_host_.data());
    rebase(p.k_pe, k_pe_ref.data());
    rebase(p.ql_nope, in.host.ql_nope.data());
    rebase(p.q_out, q_out_ref.data());
    rebase(p.q, q_ref.data());
    if (w_.kind == Kind::kMixed) {
      rebase(p.q_pe, q_ref.data() + kP * kModelBytes);
    } else {
      rebase(p.q_pe, q_pe_ref.data());
    }
    // Set s's own cache: the s-th of the buffer's equal parts (shared indices) or the one cache,
    // found from the buffer's size, not from the stride the op's view was given.
    const size_t own_cache =
        shared_indices_ ? static_cast<size_t>(s) * (cache_ref.size() / num_sets_) : 0;
    p.kv_cache.data = cache_ref.data() + own_cache;
    p.kv_cache.device = host;
    if (p.kv_cache.scale != nullptr) p.kv_cache.scale = &cache_scale;
    if (p.q_scale != nullptr) p.q_scale = &q_scale;
    ref::mla_rope_cache(p);
    // Every byte, the normalized latent too (the reference sums in the library's order).
    expect_same(label, "cache", "reference", cache_fused, cache_ref, 0, cache_ref.size());
    if (Td_ > 0)
      expect_same(label, "q_out", "reference", q_out_fused, q_out_ref, 0, q_out_ref.size());
    if (has_q()) expect_same(label, "q", "reference", q_fused, q_ref, 0, q_ref.size());
  }

  bool has_q() const { return w_.kind != Kind::kDecode; }

  // own_indices: the set gets its own positions and slot_mapping (otherwise it reads set 0's).
  InputSet make_set(Rng& rng, const std::vector<int64_t>& slot_values, bool keep_host,
                    bool own_indices) {
    InputSet in;
    HostInputs host;
    std::vector<int64_t> positions(static_cast<size_t>(T_));
    for (auto& p : positions) p = rng.below(kMaxPos);
    host.positions = index_bytes(positions, DType::kInt64);
    host.slots = index_bytes(slot_values, DType::kInt64);
    host.kv_c = random_values(kModel, T_ * kL, 2.0f, rng);
    host.k_pe = random_values(kModel, T_ * kR, 2.0f, rng);
    if (w_.kind == Kind::kDecode) host.q_pe = random_values(kModel, T_ * H_ * kR, 2.0f, rng);
    if (Td_ > 0 && !w_.nope_in_q_out) {
      host.ql_nope = random_values(kModel, Td_ * H_ * kL, 2.0f, rng);
    }
    if (has_q()) host.q = random_values(kModel, T_ * H_ * (kP + kR), 2.0f, rng);

    auto upload = [&](Buffer& b, const std::vector<uint8_t>& h) {
      b = Buffer(device_, h.size());
      b.upload(h);
    };
    if (own_indices) {
      upload(in.positions, host.positions);
      upload(in.slots, host.slots);
    }
    upload(in.kv_c, host.kv_c);
    upload(in.k_pe, host.k_pe);
    if (!host.q_pe.empty()) upload(in.q_pe, host.q_pe);
    if (!host.ql_nope.empty()) upload(in.ql_nope, host.ql_nope);
    if (!host.q.empty()) upload(in.q, host.q);
    if (Td_ > 0) {
      in.q_out =
          Buffer(device_, static_cast<size_t>(Td_ * H_ * (kL + kR)) * dtype_size(w_.q_out_dtype));
      in.q_out.fill_byte(0);
    }
    if (keep_host) in.host = std::move(host);
    return in;
  }

  void poison_outputs(InputSet& in) {
    cache_.fill_byte(kPoisonByte);
    if (Td_ > 0) in.q_out.fill_byte(kPoisonByte);
  }

  void restore_inputs(InputSet& in) {
    in.k_pe.upload(in.host.k_pe);
    if (!in.host.q_pe.empty()) in.q_pe.upload(in.host.q_pe);
    if (!in.host.q.empty()) in.q.upload(in.host.q);
  }

  TensorView table_view() const {
    return make_view(shared_.table.data(), DType::kFloat32, {kMaxPos, kR}, device_);
  }

  // The set whose positions and slot_mapping set s reads: itself, or set 0 (shared_indices_).
  const InputSet& indices_of(int s) const { return sets_[shared_indices_ ? 0 : s]; }

  TensorView index_view(const Buffer& indices) const {
    return make_view(indices.data(), DType::kInt64, {T_}, device_);
  }

  // The cache set s writes: the one cache, or its own (shared_indices_).
  KVCacheView cache_view(int s) const {
    KVCacheView v =
        make_cache_view(cache_.as<uint8_t>() + static_cast<size_t>(s) * cache_set_stride_,
                        w_.cache_format, num_blocks_, kBlockSize, kL, kR, device_);
    if (cache_is_per_tensor_fp8(w_.cache_format)) v.scale = shared_.cache_scale.as<float>();
    return v;
  }

  // The rope part of q's first `rows` rows: [rows, H, R] with q's strides.
  TensorView q_rope_view(const InputSet& in, int64_t rows) const {
    return make_strided_view(in.q.as<uint8_t>() + kP * kModelBytes, kModel, {rows, H_, kR},
                             {H_ * (kP + kR), kP + kR, 1}, device_);
  }

  // Decode rows' q_pe: its own tensor (decode), or the rope part of q's first Td rows (mixed, as
  // vLLM slices it out of q_b_proj's output).
  TensorView decode_q_pe_view(const InputSet& in) const {
    if (w_.kind == Kind::kMixed) return q_rope_view(in, Td_);
    return make_view(in.q_pe.data(), kModel, {Td_, H_, kR}, device_);
  }

  MlaRopeCacheParams fused_params(int s) const {
    const InputSet& in = sets_[s];
    MlaRopeCacheParams p;
    p.num_tokens = T_;
    p.num_decode_tokens = Td_;
    p.positions = index_view(indices_of(s).positions);
    p.slot_mapping = index_view(indices_of(s).slots);
    p.cos_sin_cache = table_view();
    p.rope_style = RopeStyle::kGptJ;
    p.kv_c = make_view(in.kv_c.data(), kModel, {T_, kL}, device_);
    p.k_pe = make_view(in.k_pe.data(), kModel, {T_, kR}, device_);
    p.kv_cache = cache_view(s);
    if (w_.kv_norm) {
      p.kv_norm_weight = make_view(norm_weight_.data(), kModel, {kL}, device_);
      p.kv_norm_eps = kNormEps;
    }
    if (Td_ > 0) {
      p.q_pe = decode_q_pe_view(in);
      if (!w_.nope_in_q_out) {
        p.ql_nope = make_view(in.ql_nope.data(), kModel, {Td_, H_, kL}, device_);
      }
      p.q_out = make_view(in.q_out.data(), w_.q_out_dtype, {Td_, H_, kL + kR}, device_);
      if (is_float8(w_.q_out_dtype)) p.q_scale = shared_.q_scale.as<float>();
    }
    if (has_q()) p.q = make_view(in.q.data(), kModel, {T_, H_, kP + kR}, device_);
    return p;
  }

  const Workload& w_;
  int64_t T_;
  int64_t Td_;
  int64_t H_;  // query heads
  // The sets share set 0's positions and slot_mapping and each writes a cache of its own
  // (BenchOptions::shared_indices).
  bool shared_indices_;
  Device device_;
  Timer& timer_;
  const SharedInputs& shared_;
  int64_t bytes_ = 0;
  int num_sets_ = 1;
  int64_t num_blocks_ = 0;       // of one cache view
  size_t cache_set_stride_ = 0;  // bytes from one set's cache to the next (0: one cache)
  Buffer cache_;
  Buffer norm_weight_;                     // kv_norm: [L]
  std::vector<uint8_t> norm_weight_host_;  // kv_norm: the same, for the reference
  Buffer kv_c_normed_;                     // kv_norm: the unfused path's rms_norm output [T, L]
  std::vector<InputSet> sets_;
};

// rmsnorm_quant of q_c (kNormQuant) or mla_rmsnorm_quant of q_c and kv_c (kDualNorm), bf16, eps
// 1e-6, G = 128, the scales column-major [N/G, T rounded up to 4] (the MN-major layout a
// DeepGEMM-style FP8 block-scaled GEMM reads; the padding is never written). Unfused: rms_norm into
// a scratch tensor, then per_token_group_quant_fp8 (kNormQuant); rmsnorm_quant of q_c, then
// rms_norm of kv_c (kDualNorm: the 2-op sequence of scripts/bench_rmsnorm_quant.py).
class NormRow : public BenchRow {
 public:
  NormRow(const Workload& w, int64_t T, const Timer& timer, int workload_index)
      : w_(w),
        T_(T),
        dual_(w.kind == Kind::kDualNorm),
        device_(timer.device()),
        pdl_(timer.pdl()),
        scale_stride_((T + 3) / 4 * 4) {
    // Minimal traffic: q_c read, e4m3 values and scales written, the weights read once; the dual
    // form also reads kv_c and writes the normalized kv_c.
    bytes_ = T * kQc * (kModelBytes + 1) + T * (kQc / kQuantGroup) * 4 + kQc * kModelBytes;
    if (dual_) bytes_ += T * kL * 2 * kModelBytes + kL * kModelBytes;
    num_sets_ = rotation_sets(timer, bytes_);
    Rng weight_rng(0x4e0f1000u + static_cast<uint64_t>(T));
    q_weight_host_ = random_values(kModel, kQc, 2.0f, weight_rng);
    q_weight_ = upload(q_weight_host_);
    if (dual_) {
      kv_weight_host_ = random_values(kModel, kL, 2.0f, weight_rng);
      kv_weight_ = upload(kv_weight_host_);
    } else {
      q_normed_ = Buffer(device_, static_cast<size_t>(T * kQc * kModelBytes));
    }
    for (int s = 0; s < num_sets_; ++s) {
      Rng rng(0xbe4d0000u + 1000003u * static_cast<uint64_t>(workload_index) +
              31u * static_cast<uint64_t>(T) + static_cast<uint64_t>(s));
      Set set;
      std::vector<uint8_t> q_c = random_values(kModel, T * kQc, 2.0f, rng);
      set.q_c = upload(q_c);
      set.values = Buffer(device_, static_cast<size_t>(T * kQc));
      set.scales = Buffer(device_, static_cast<size_t>(kQc / kQuantGroup * scale_stride_ * 4));
      std::vector<uint8_t> kv_c;
      if (dual_) {
        kv_c = random_values(kModel, T * kL, 2.0f, rng);
        set.kv_c = upload(kv_c);
        set.kv_c_out = Buffer(device_, static_cast<size_t>(T * kL * kModelBytes));
      }
      if (s == 0) {
        q_c_host_ = std::move(q_c);
        kv_c_host_ = std::move(kv_c);
      }
      sets_.push_back(std::move(set));
    }
  }

  int num_sets() const override { return num_sets_; }
  int64_t bytes() const override { return bytes_; }
  int64_t decode_tokens() const override { return 0; }

  Op fused_op(int s) const override {
    const RmsNormQuantParams q = q_params(sets_[s], device_);
    if (!dual_) {
      return [q, pdl = pdl_](void* stream) { rmsnorm_quant(q, stream_context(stream, pdl)); };
    }
    MlaRmsNormQuantParams p;
    p.q = q;
    p.kv = kv_params(sets_[s], device_);
    return [p, pdl = pdl_](void* stream) { mla_rmsnorm_quant(p, stream_context(stream, pdl)); };
  }

  Op unfused_op(int s) const override {
    const Set& in = sets_[s];
    const RmsNormQuantParams q = q_params(in, device_);
    if (dual_) {
      const RmsNormParams kv = kv_params(in, device_);
      return [q, kv, pdl = pdl_](void* stream) {
        const Context ctx = stream_context(stream, pdl);
        rmsnorm_quant(q, ctx);
        rms_norm(kv, ctx);
      };
    }
    RmsNormParams norm;
    norm.num_tokens = T_;
    norm.input = q.input;
    norm.weight = q.weight;
    norm.eps = kNormEps;
    norm.output = make_view(q_normed_.data(), kModel, {T_, kQc}, device_);
    PerTokenGroupQuantParams quant;
    quant.num_tokens = T_;
    quant.input = norm.output;
    quant.quant = q.quant;
    return [norm, quant, pdl = pdl_](void* stream) {
      const Context ctx = stream_context(stream, pdl);
      rms_norm(norm, ctx);
      per_token_group_quant_fp8(quant, ctx);
    };
  }

  void check(bool with_reference) override {
    const std::string label = row_label(w_, T_);
    Set& in = sets_[0];
    poison_outputs(in);
    fused_op(0)(nullptr);
    device_synchronize(device_);
    const Outputs fused = download(in);
    expect_unchanged(label, "q_c", in.q_c, q_c_host_);
    expect_unchanged(label, "kv_c", in.kv_c, kv_c_host_);  // the dual form's (empty otherwise)
    poison_outputs(in);
    unfused_op(0)(nullptr);
    device_synchronize(device_);
    expect_all_same(label, "unfused", fused, download(in));
    if (!with_reference) return;

    // The reference on host copies, its outputs poisoned as the device ones were.
    Outputs ref;
    ref.values.assign(in.values.bytes(), kPoisonByte);
    ref.scales.assign(in.scales.bytes(), kPoisonByte);
    ref.kv_c_out.assign(in.kv_c_out.bytes(), kPoisonByte);
    const Device cpu{DeviceType::kCPU, 0};
    RmsNormQuantParams q = q_params(in, cpu);
    q.input.data = q_c_host_.data();
    q.weight.data = q_weight_host_.data();
    q.quant.values.data = ref.values.data();
    q.quant.scales.data = ref.scales.data();
    ref::rmsnorm_quant(q);
    if (dual_) {
      RmsNormQuantParams kv;
      kv.num_tokens = T_;
      kv.input = make_view(kv_c_host_.data(), kModel, {T_, kL}, cpu);
      kv.weight = make_view(kv_weight_host_.data(), kModel, {kL}, cpu);
      kv.eps = kNormEps;
      kv.normed_out = make_view(ref.kv_c_out.data(), kModel, {T_, kL}, cpu);
      ref::rmsnorm_quant(kv);
    }
    expect_all_same(label, "reference", fused, ref);
  }

 private:
  struct Set {
    Buffer q_c;       // [T, 1536], bf16
    Buffer values;    // [T, 1536], e4m3
    Buffer scales;    // [1536 / G, T rounded up to 4], fp32: column-major scales of [T, 1536 / G]
    Buffer kv_c;      // dual: [T, 512], bf16
    Buffer kv_c_out;  // dual: [T, 512], bf16
  };
  struct Outputs {
    std::vector<uint8_t> values, scales, kv_c_out;
  };

  static Context stream_context(void* stream, bool pdl) {
    Context ctx;
    ctx.stream = stream;
    ctx.pdl = pdl;
    return ctx;
  }

  Buffer upload(const std::vector<uint8_t>& host) const {
    Buffer b(device_, host.size());
    b.upload(host);
    return b;
  }

  // The views of a set on `device` (the reference rebases the data pointers to host copies).
  RmsNormQuantParams q_params(const Set& in, Device device) const {
    RmsNormQuantParams p;
    p.num_tokens = T_;
    p.input = make_view(in.q_c.data(), kModel, {T_, kQc}, device);
    p.weight = make_view(q_weight_.data(), kModel, {kQc}, device);
    p.eps = kNormEps;
    p.quant.values = make_view(in.values.data(), DType::kFloat8E4M3, {T_, kQc}, device);
    p.quant.scales = column_major_scales_view(in.scales.as<float>(), T_, kQc / kQuantGroup,
                                              scale_stride_, device);
    p.quant.group_size = kQuantGroup;
    return p;
  }

  RmsNormParams kv_params(const Set& in, Device device) const {
    RmsNormParams p;
    p.num_tokens = T_;
    p.input = make_view(in.kv_c.data(), kModel, {T_, kL}, device);
    p.weight = make_view(kv_weight_.data(), kModel, {kL}, device);
    p.eps = kNormEps;
    p.output = make_view(in.kv_c_out.data(), kModel, {T_, kL}, device);
    return p;
  }

  void poison_outputs(Set& in) {
    in.values.fill_byte(kPoisonByte);
    in.scales.fill_byte(kPoisonByte);
    if (dual_) in.kv_c_out.fill_byte(kPoisonByte);
  }

  Outputs download(const Set& in) const {
    Outputs out;
    out.values = in.values.download();
    out.scales = in.scales.download();
    if (dual_) out.kv_c_out = in.kv_c_out.download();
    return out;
  }

  // Every byte, padding of the scales included (poisoned before each run, never written).
  void expect_all_same(const std::string& label, const char* versus, const Outputs& fused,
                       const Outputs& other) const {
    expect_same(label, "q_c values", versus, fused.values, other.values, 0, fused.values.size());
    expect_same(label, "q_c scales", versus, fused.scales, other.scales, 0, fused.scales.size());
    if (dual_) {
      expect_same(label, "kv_c_out", versus, fused.kv_c_out, other.kv_c_out, 0,
                  fused.kv_c_out.size());
    }
  }

  const Workload& w_;
  int64_t T_;
  bool dual_;
  Device device_;
  bool pdl_;
  int64_t scale_stride_;  // T rounded up to 4: 16-byte aligned columns of the scales
  int64_t bytes_ = 0;
  int num_sets_ = 1;
  Buffer q_weight_, kv_weight_;  // [1536], [512] (dual), bf16
  std::vector<uint8_t> q_weight_host_, kv_weight_host_;
  Buffer q_normed_;                            // kNormQuant: the unfused path's rms_norm output
  std::vector<uint8_t> q_c_host_, kv_c_host_;  // set 0, for the reference
  std::vector<Set> sets_;
};

nlohmann::json timing_json(const Timing& t) {
  return {{"median_us", t.median_us},
          {"p10_us", t.p10_us},
          {"p90_us", t.p90_us},
          {"samples", t.samples},
          {"launches_per_sample", t.launches_per_sample}};
}

// The copy reference: `bytes` copied from src + s * stride to dst + s * stride, rotated over
// `sets` buffer pairs, by the timer's copy_op and, where it has one, its kernel_copy_op; the
// faster of the two is the reference. Fills src with 1 and dst with 0 first, and checks that the
// kernel copied exactly the bytes asked.
struct CopyTimes {
  Timing memcpy;
  std::optional<Timing> kernel;
  const Timing& best() const {
    return kernel && kernel->median_us < memcpy.median_us ? *kernel : memcpy;
  }
};

CopyTimes time_copy(Timer& timer, Buffer& dst, Buffer& src, size_t stride, int sets, size_t bytes) {
  const size_t span = stride * static_cast<size_t>(sets - 1) + bytes;
  MLAKV_CHECK(
      sets >= 1 && (sets == 1 || bytes <= stride) && span <= std::min(dst.bytes(), src.bytes()),
      "time_copy: ", sets, " sets of ", bytes, " bytes do not fit the buffers");
  std::vector<Op> memcpys, kernels;
  for (int s = 0; s < sets; ++s) {
    uint8_t* d = dst.as<uint8_t>() + s * stride;
    const uint8_t* from = src.as<uint8_t>() + s * stride;
    memcpys.push_back(timer.copy_op(d, from, bytes));
    Op k = timer.kernel_copy_op(d, from, bytes);
    if (k) kernels.push_back(std::move(k));
  }
  src.fill_byte(1);
  dst.fill_byte(0);
  // Fills ran on the legacy stream; the CUDA timer's stream does not wait for it.
  device_synchronize(dst.device());
  CopyTimes t;
  t.memcpy = timer.time(memcpys);
  if (kernels.empty()) return t;
  dst.fill_byte(0);
  device_synchronize(dst.device());
  t.kernel = timer.time(kernels);
  const int64_t bad = first_badly_copied_set(dst.download(), sets, stride, bytes);
  MLAKV_CHECK(bad < 0, "bench: the copy kernel did not copy exactly bytes [", bad * stride, ", ",
              bad * stride + bytes, ")");
  return t;
}

// Bandwidth (bytes read + bytes written over the time) of a copy timed by time_copy.
double copy_gbps(size_t bytes, const Timing& t) {
  return 2.0 * static_cast<double>(bytes) / (t.median_us * 1e3);
}

class Progress {
 public:
  Progress() : enabled_(stderr_is_terminal()) {}
  void show(const std::string& text) {
    if (enabled_) std::fprintf(stderr, "\r\033[K%s", text.c_str());
  }
  void clear() {
    if (enabled_) std::fprintf(stderr, "\r\033[K");
  }

 private:
  bool enabled_;
};

}  // namespace

int run_bench(const BenchOptions& options) {
  std::string backend = options.backend;
  if (backend == "auto") backend = cuda_available() ? "cuda" : "cpu";
  std::unique_ptr<Timer> timer;
  std::string device_text;
  if (backend == "cuda") {
#ifdef MLAKV_WITH_CUDA
    MLAKV_CHECK(cuda_device_count() > 0, "bench: --backend cuda: no CUDA device is visible");
    check_cuda_device("bench", options.device);
    timer = make_cuda_timer(options.device, options.iters, options.pdl);
    device_text = cuda_device_description(timer->device().index);  // the GPU it times on
#else
    MLAKV_FAIL("bench: --backend cuda: mlakv was built without the CUDA backend");
#endif
  } else {
    MLAKV_CHECK(!options.pdl, "bench: --pdl: programmatic dependent launch is a CUDA feature, got ",
                "--backend ", backend);
    MLAKV_CHECK(options.device == 0, "bench: --device: names a GPU, got --backend ", backend);
    timer = make_cpu_timer(options.iters);
    device_text = "cpu";
  }
  const bool on_cuda = backend == "cuda";
  const Device device = timer->device();

  std::vector<const Workload*> selected;
  for (const Workload& w : all_workloads()) {
    if (options.workloads.empty() || std::find(options.workloads.begin(), options.workloads.end(),
                                               w.name) != options.workloads.end()) {
      selected.push_back(&w);
    }
  }
  for (const std::string& name : options.workloads) {
    bool known = false;
    for (const Workload& w : all_workloads()) known = known || name == w.name;
    if (!known) {
      std::string names;
      for (const Workload& w : all_workloads()) names += std::string(" ") + w.name;
      MLAKV_FAIL("bench: --workload: unknown workload '", name, "', expected one of:", names);
    }
  }

  // Opened before anything is timed: a path that cannot be written fails now, not after the run.
  std::ofstream json_file;
  if (!options.json_path.empty()) {
    json_file.open(options.json_path);
    MLAKV_CHECK(json_file.good(), "bench: --json: cannot open '", options.json_path,
                "' for writing");
  }

  Progress progress;
  progress.show("measuring copy bandwidth...");
  const size_t roofline_bytes = on_cuda ? (size_t{1} << 30) : (size_t{256} << 20);
  CopyTimes roofline;
  {
    Buffer src(device, roofline_bytes);
    Buffer dst(device, roofline_bytes);
    roofline = time_copy(*timer, dst, src, 0, 1, roofline_bytes);
  }
  const double roofline_gbps = copy_gbps(roofline_bytes, roofline.best());
  progress.show("measuring the launch floor...");
  const Timing floor = timer->time({timer->empty_op()});
  progress.clear();

  // Shared by every mla_rope_cache row: the YaRN cos/sin table, the fp8 scales and the error
  // counters.
  SharedInputs shared;
  {
    YarnRopeConfig yarn;
    yarn.rotary_dim = kR;
    MLAKV_CHECK(yarn.max_position() == kMaxPos, "bench: YaRN table has ", yarn.max_position(),
                " positions, expected ", kMaxPos);
    shared.table_host.resize(static_cast<size_t>(kMaxPos * kR) * sizeof(float));
    round_table(yarn_cos_sin_table(yarn), DType::kFloat32, shared.table_host.data());
    auto float_bytes = [](float v) {
      std::vector<uint8_t> bytes(sizeof(v));
      std::memcpy(bytes.data(), &v, sizeof(v));
      return bytes;
    };
    shared.cache_scale_host = float_bytes(kFp8CacheScale);
    shared.q_scale_host = float_bytes(options.q_scale);
    auto upload = [&](const std::vector<uint8_t>& host) {
      Buffer buffer(device, host.size());
      buffer.upload(host);
      return buffer;
    };
    shared.table = upload(shared.table_host);
    shared.cache_scale = upload(shared.cache_scale_host);
    shared.q_scale = upload(shared.q_scale_host);
  }
  shared.error_counts = Buffer(device, kNumErrorCounters * sizeof(int32_t));
  reset_error_counts(shared.error_counts.as<int32_t>(), device);

  std::printf("mlakv bench: %s\n", device_text.c_str());
  std::printf(
      "DeepSeek-V3: H %lld%s, L %lld, R %lld, P %lld, GPT-J RoPE (YaRN table, %lld "
      "positions), bf16 model dtype, block size %lld, scattered slots, fp8 q_out scale %g\n",
      static_cast<long long>(options.heads),
      options.heads == kModelHeads  ? ""
      : options.heads < kModelHeads ? " (--heads: a shard of the model's 128)"
                                    : " (--heads: more than the model's 128)",
      static_cast<long long>(kL), static_cast<long long>(kR), static_cast<long long>(kP),
      static_cast<long long>(kMaxPos), static_cast<long long>(kBlockSize),
      static_cast<double>(options.q_scale));
  if (options.shared_indices) {
    std::printf(
        "--shared-indices: the mla_rope_cache rows' input sets share one positions and one "
        "slot_mapping, as the layers of one step do, so those and the cos/sin rows they pick "
        "stay in cache; each set writes a cache of its own, as each layer does\n");
  }
  if (roofline.kernel) {
    std::printf(
        "copy roofline %.1f GB/s (1 GiB, read + write: cudaMemcpyAsync D2D %.1f, a streaming "
        "copy kernel %.1f); bytes = the fused op's minimal traffic; copy = the faster of the two "
        "copying bytes/2 (the same traffic), same rotation\n",
        roofline_gbps, copy_gbps(roofline_bytes, roofline.memcpy),
        copy_gbps(roofline_bytes, *roofline.kernel));
  } else {
    std::printf(
        "copy roofline %.1f GB/s (one 256 MiB memcpy over all threads, read + write); bytes = "
        "the fused op's minimal traffic; copy = a memcpy of bytes/2 (the same traffic), same "
        "rotation\n",
        roofline_gbps);
  }
  std::printf("launch floor %.2f us (%s, timed as the ops are)%s\n", floor.median_us,
              on_cuda ? "an empty one-warp kernel" : "an empty OpenMP parallel region",
              timer->pdl() ? "; every op launched with programmatic dependent launch (--pdl)" : "");
  std::printf("spread = p10-p90; speedup = unfused / fused time\n\n");
  std::printf("%-21s %6s %10s %19s %10s %8s %6s %9s %10s %8s %5s\n", "workload", "T", "fused_us",
              "spread_us", "bytes", "GB/s", "%copy", "copy_us", "unfused_us", "speedup", "sets");
  std::fflush(stdout);

  nlohmann::json rows = nlohmann::json::array();
  int total_rows = 0;
  for (const Workload* w : selected) {
    const auto& tokens =
        !options.tokens.empty() ? options.tokens : (on_cuda ? w->cuda_tokens : w->cpu_tokens);
    total_rows += static_cast<int>(tokens.size());
  }
  int row_index = 0;
  for (const Workload* w : selected) {
    const int workload_index = static_cast<int>(w - all_workloads().data());
    const auto& tokens =
        !options.tokens.empty() ? options.tokens : (on_cuda ? w->cuda_tokens : w->cpu_tokens);
    for (const int64_t T : tokens) {
      ++row_index;
      const std::string prefix = "[" + std::to_string(row_index) + "/" +
                                 std::to_string(total_rows) + "] " + row_label(*w, T) + ": ";
      progress.show(prefix + "preparing inputs");
      std::unique_ptr<BenchRow> row;
      if (w->kind == Kind::kNormQuant || w->kind == Kind::kDualNorm) {
        row = std::make_unique<NormRow>(*w, T, *timer, workload_index);
      } else {
        row = std::make_unique<Row>(*w, T, options.heads, options.shared_indices, *timer, shared,
                                    workload_index);
      }
      std::string check = "skipped";
      if (!options.skip_check) {
        const bool with_reference = T <= kMaxReferenceTokens;
        progress.show(prefix + (with_reference ? "checking (fused == unfused == reference)"
                                               : "checking (fused == unfused)"));
        row->check(with_reference);
        check = with_reference ? "fused == unfused == reference" : "fused == unfused";
      }
      std::vector<Op> fused, unfused;
      for (int s = 0; s < row->num_sets(); ++s) {
        fused.push_back(row->fused_op(s));
        unfused.push_back(row->unfused_op(s));
      }
      // The copy moves the same traffic: bytes/2 read and bytes/2 written, rotated like the op.
      const size_t half = static_cast<size_t>(row->bytes() / 2);
      const size_t chunk = (half + 255) / 256 * 256;
      Buffer copy_src(device, chunk * row->num_sets());
      Buffer copy_dst(device, chunk * row->num_sets());
      // Uploads ran on the legacy stream; the CUDA timer's stream does not wait for it.
      device_synchronize(device);
      progress.show(prefix + "timing fused");
      const Timing t_fused = timer->time(fused);
      progress.show(prefix + "timing unfused");
      const Timing t_unfused = timer->time(unfused);
      progress.show(prefix + "timing copy");
      const CopyTimes copy = time_copy(*timer, copy_dst, copy_src, chunk, row->num_sets(), half);
      const Timing& t_copy = copy.best();
      progress.clear();

      const double gbps = static_cast<double>(row->bytes()) / (t_fused.median_us * 1e3);
      const double copy_gbps = static_cast<double>(row->bytes()) / (t_copy.median_us * 1e3);
      const double pct_copy = 100.0 * t_copy.median_us / t_fused.median_us;
      const double speedup = t_unfused.median_us / t_fused.median_us;
      const std::string spread = format_us(t_fused.p10_us) + "-" + format_us(t_fused.p90_us);
      std::printf("%-21s %6lld %10s %19s %10s %8.1f %5.0f%% %9s %10s %7.2fx %5d\n", w->name,
                  static_cast<long long>(T), format_us(t_fused.median_us).c_str(), spread.c_str(),
                  format_bytes(static_cast<double>(row->bytes())).c_str(), gbps, pct_copy,
                  format_us(t_copy.median_us).c_str(), format_us(t_unfused.median_us).c_str(),
                  speedup, row->num_sets());
      std::fflush(stdout);
      rows.push_back({{"workload", w->name},
                      {"description", w->description},
                      {"T", T},
                      {"Td", row->decode_tokens()},
                      {"bytes", row->bytes()},
                      {"input_sets", row->num_sets()},
                      {"check", check},
                      {"fused", timing_json(t_fused)},
                      {"unfused", timing_json(t_unfused)},
                      {"copy", timing_json(t_copy)},
                      {"copy_memcpy", timing_json(copy.memcpy)},
                      {"copy_kernel", copy.kernel ? timing_json(*copy.kernel) : nlohmann::json()},
                      {"fused_gbps", gbps},
                      {"copy_gbps", copy_gbps},
                      {"pct_of_copy", pct_copy},
                      {"speedup_vs_unfused", speedup}});
    }
  }

  if (!options.json_path.empty()) {
    nlohmann::json out = {
        {"backend", backend},
        {"device", device_text},
        {"mlakv_version", version()},
        {"build_info", build_info()},
        {"config",
         {{"H", options.heads},
          {"L", kL},
          {"R", kR},
          {"P", kP},
          {"block_size", kBlockSize},
          {"model_dtype", dtype_name(kModel)},
          {"rope_style", "gptj"},
          {"max_pos", kMaxPos},
          {"fp8_cache_scale", kFp8CacheScale},
          {"fp8_q_scale", options.q_scale},
          {"shared_indices", options.shared_indices}}},
        {"copy_roofline_gbps", roofline_gbps},
        {"copy_roofline_memcpy_gbps", copy_gbps(roofline_bytes, roofline.memcpy)},
        {"copy_roofline_kernel_gbps",
         roofline.kernel ? nlohmann::json(copy_gbps(roofline_bytes, *roofline.kernel))
                         : nlohmann::json()},
        {"launch_floor", timing_json(floor)},
        {"pdl", timer->pdl()},
        {"rows", rows}};
    json_file << out.dump(2) << "\n";
    json_file.flush();
    MLAKV_CHECK(json_file.good(), "bench: --json: writing '", options.json_path, "' failed");
  }
  return 0;
}

}  // namespace cli
}  // namespace mlakv
