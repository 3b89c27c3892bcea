// mlakv CLI: `mlakv check`'s fused-op family (check.h): mla_rope_cache over model configs, every
// cache format, random T / Td / layouts / padding / bad slots and positions / optional outputs.
#include <algorithm>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "check.h"
#include "mlakv/mlakv.h"
#include "reference/reference.h"
#include "util.h"

namespace mlakv {
namespace cli {
namespace check {
namespace {

struct ModelConfig {
  const char* name;
  int64_t H, L, R, P;
};

const std::vector<ModelConfig>& model_configs() {
  static const std::vector<ModelConfig> configs = {
      {"DeepSeek-V3 H128", 128, 512, 64, 128}, {"DeepSeek-V3 TP8 H16", 16, 512, 64, 128},
      {"Kimi-K2 H64", 64, 512, 64, 128},       {"DeepSeek-V2-Lite H16", 16, 512, 64, 128},
      {"MiniCPM3 L256 R32", 40, 256, 32, 64},
  };
  return configs;
}

// Every buffer a case may use. Views are built over these for the reference (host copies) and
// for each backend (device copies) with identical geometry.
enum BufferId : int {
  kPositions,
  kSlots,
  kTable,
  kKvC,  // kv_c, and k_pe too when they share one row ([kv_c | k_pe], as kv_a_proj writes them)
  kKPe,
  kNormWeight,
  kCache,
  kCacheRope,
  kCacheScale,
  kKPeOut,
  kKvCOut,
  kQPe,
  kQlNope,
  kQOut,
  kQScale,
  kQ,
  kQPrefillOut,
  kTdDevice,
  kNumBuffers
};

const char* buffer_name(int id) {
  static const char* names[kNumBuffers] = {
      "positions",     "slot_mapping",   "cos_sin_cache", "kv_c",
      "k_pe",          "kv_norm_weight", "kv_cache",      "kv_cache (rope part)",
      "cache scale",   "k_pe_out",       "kv_c_out",      "q_pe",
      "ql_nope",       "q_out",          "q_scale",       "q",
      "q_prefill_out", "Td (device)"};
  return names[id];
}

struct Case {
  const ModelConfig* model = nullptr;
  uint64_t seed = 0;
  int64_t H = 0, L = 0, R = 0, P = 0;
  int64_t T = 0, Td = 0, pad_rows = 0;
  DType model_dtype = DType::kBFloat16;
  DType index_dtype = DType::kInt64;
  DType table_dtype = DType::kFloat32;
  int64_t max_pos = 0, table_row_stride = 0;
  RopeStyle rope_style = RopeStyle::kGptJ;
  CacheLayout cache;
  bool joint_kv = false;  // kv_c and k_pe in one [rows, L + R + 8] buffer
  bool rms_norm = false;
  Alias k_pe_out = Alias::kNone;
  Alias kv_c_out = Alias::kNone;
  bool decode_side = false;  // q_out present
  DType q_out_dtype = DType::kBFloat16;
  bool ql_nope = true;  // false: ql_nope absent, the nope part already in q_out
  bool q_scale = false;
  bool prefill_side = false;  // q present
  bool q_prefill_out = false;
  bool device_td = false;
  int32_t device_td_value = 0;
  std::vector<int64_t> positions, slots;  // T + pad_rows values each

  int64_t rows() const { return T + pad_rows; }
  // Rows of the decode tensors: Td (+ padding), or T with a device Td.
  int64_t decode_rows() const { return (device_td ? T : Td) + pad_rows; }
  size_t model_bytes() const { return dtype_size(model_dtype); }
  int64_t kv_row() const { return joint_kv ? L + R + 8 : L; }

  std::string describe() const {
    std::ostringstream os;
    os << "seed " << seed << ": T " << T << " Td " << (device_td ? "device " : "") << Td
       << (device_td && device_td_value != Td ? "(given " + std::to_string(device_td_value) + ")"
                                              : "")
       << " pad " << pad_rows << " " << dtype_name(model_dtype) << " " << cache.describe() << " "
       << rope_style_name(rope_style) << " table " << dtype_name(table_dtype)
       << (table_row_stride != R ? " strided" : "") << " idx " << dtype_name(index_dtype)
       << (rms_norm ? " rmsnorm" : "") << (joint_kv ? " joint-kv" : "");
    // The rows the op must skip or clamp and count (padding rows excluded: never read).
    os << bad_slots_note(slots, T, cache.num_slots())
       << clamped_positions_note(positions, T, max_pos);
    if (k_pe_out != Alias::kNone)
      os << (k_pe_out == Alias::kInPlace ? " k_pe_out=k_pe" : " k_pe_out");
    if (kv_c_out != Alias::kNone)
      os << (kv_c_out == Alias::kInPlace ? " kv_c_out=kv_c" : " kv_c_out");
    if (decode_side) {
      os << " q_out " << dtype_name(q_out_dtype) << (ql_nope ? "" : " (nope in place)")
         << (q_scale ? " q_scale" : "");
    }
    if (prefill_side) os << " q" << (q_prefill_out ? " -> q_prefill_out" : " in place");
    return os.str();
  }
};

Case make_case(const ModelConfig& model, uint64_t seed, int format_index) {
  Rng rng = case_rng(seed, model.name, static_cast<uint64_t>(format_index));
  Case c;
  c.model = &model;
  c.seed = seed;
  c.H = model.H;
  c.L = model.L;
  c.R = model.R;
  c.P = model.P;
  const CacheFormat format = kCacheFormats[format_index];
  c.model_dtype = draw_model_dtype(rng);
  // fp8_ds_mla stores the rope part as bf16: it takes a bf16 model only.
  if (format == CacheFormat::kFloat8DsMla) c.model_dtype = DType::kBFloat16;
  c.T = rng.chance(0.15) ? rng.between(65, 300) : rng.between(1, 64);
  if (empty_batch(seed, model.name)) c.T = 0;
  c.pad_rows = rng.chance(0.5) ? rng.between(1, 4) : 0;
  c.index_dtype = rng.chance(0.5) ? DType::kInt64 : DType::kInt32;
  c.table_dtype = draw_table_dtype(rng);
  c.max_pos = rng.between(c.T + 1, 4096);
  c.table_row_stride = c.R + (rng.chance(0.2) ? 8 : 0);
  c.rope_style = rng.chance(0.5) ? RopeStyle::kGptJ : RopeStyle::kNeox;
  c.cache = CacheLayout::draw(rng, format, c.L, c.R, c.T + c.T / 2);
  c.joint_kv = rng.chance(0.3);
  c.rms_norm = rng.chance(0.5);
  const Alias aliases[] = {Alias::kNone, Alias::kSeparate, Alias::kInPlace};
  c.k_pe_out = aliases[rng.below(3)];
  c.kv_c_out = aliases[rng.below(3)];

  c.device_td = rng.chance(0.2);
  const double td_roll = rng.uniform(0.0f, 1.0f);
  c.Td = td_roll < 0.3 ? c.T : (td_roll < 0.45 ? 0 : rng.between(0, c.T));
  c.device_td_value = static_cast<int32_t>(c.Td);
  if (c.device_td && rng.chance(0.15)) {
    // An out-of-range device Td is clamped to [0, T] and counted; with T = 0 it is neither read nor
    // counted (ops.h).
    c.device_td_value = rng.chance(0.5) ? static_cast<int32_t>(c.T + 3) : -2;
    c.Td = c.device_td_value < 0 ? 0 : c.T;
  }
  c.decode_side = c.device_td || c.Td > 0 || rng.chance(0.2);
  if (c.decode_side) {
    const double q_roll = rng.uniform(0.0f, 1.0f);
    c.q_out_dtype =
        q_roll < 0.65 ? c.model_dtype : (q_roll < 0.85 ? DType::kFloat8E4M3 : DType::kFloat8E5M2);
    c.ql_nope = is_float8(c.q_out_dtype) || rng.chance(0.75);
    c.q_scale = is_float8(c.q_out_dtype) && rng.chance(0.85);
  }
  c.prefill_side = c.device_td || c.Td < c.T || rng.chance(0.2);
  if (c.prefill_side) c.q_prefill_out = rng.chance(0.4);

  // Positions and slots (check.h): a few clamped or skipped and counted, padding rows wild.
  c.positions = draw_positions(rng, c.T, c.rows(), c.max_pos, c.index_dtype);
  c.slots = draw_slots(rng, c.T, c.rows(), c.cache.num_slots(), c.index_dtype, true);
  return c;
}

// Bytes and initial contents of every buffer of a case, by BufferId (empty: not used).
std::vector<std::vector<uint8_t>> initial_buffers(const Case& c) {
  Rng rng(c.seed ^ 0xda7a5eedull);
  std::vector<std::vector<uint8_t>> b(kNumBuffers);
  const DType m = c.model_dtype;
  const size_t mb = c.model_bytes();
  b[kPositions] = index_bytes(c.positions, c.index_dtype);
  b[kSlots] = index_bytes(c.slots, c.index_dtype);
  b[kTable] = strided_rope_table(c.max_pos, c.R, c.table_dtype, c.table_row_stride, rng);
  b[kKvC] = random_values(m, c.rows() * c.kv_row(), 2.0f, rng);
  if (!c.joint_kv) b[kKPe] = random_values(m, c.rows() * c.R, 2.0f, rng);
  if (c.rms_norm) b[kNormWeight] = random_values(m, c.L, 1.5f, rng);
  b[kCache].assign(c.cache.data_bytes(), kSentinelByte);
  if (c.cache.split) b[kCacheRope].assign(c.cache.rope_bytes(), kSentinelByte);
  if (c.cache.scaled) b[kCacheScale] = scale_bytes(rng);
  if (c.k_pe_out == Alias::kSeparate) b[kKPeOut].assign(c.rows() * c.R * mb, kPoisonByte);
  if (c.kv_c_out == Alias::kSeparate) b[kKvCOut].assign(c.rows() * c.L * mb, kPoisonByte);
  if (c.decode_side) {
    const int64_t dr = c.decode_rows();
    b[kQPe] = random_values(m, dr * c.H * c.R, 2.0f, rng);
    if (c.ql_nope) b[kQlNope] = random_values(m, dr * c.H * c.L, 2.0f, rng);
    // Without ql_nope the nope part is already in q_out (the absorb GEMM wrote it): random data
    // the op must leave alone. Otherwise q_out is poisoned.
    if (c.ql_nope) {
      b[kQOut].assign(dr * c.H * (c.L + c.R) * dtype_size(c.q_out_dtype), kPoisonByte);
    } else {
      b[kQOut] = random_values(c.q_out_dtype, dr * c.H * (c.L + c.R), 2.0f, rng);
    }
    if (c.q_scale) b[kQScale] = scale_bytes(rng);
  }
  if (c.prefill_side) {
    b[kQ] = random_values(m, c.rows() * c.H * (c.P + c.R), 2.0f, rng);
    if (c.q_prefill_out) {
      b[kQPrefillOut].assign(c.rows() * c.H * (c.P + c.R) * mb, kPoisonByte);
    }
  }
  // A decode side of zero rows (Td = 0, no padding) in a batch of prefill rows still gets a real,
  // never-touched allocation; in an empty batch it has null data, as every tensor of zero rows.
  for (int id : {kQPe, kQlNope, kQOut}) {
    const bool used = c.decode_side && (id != kQlNope || c.ql_nope);
    if (used && b[id].empty() && c.T > 0) b[id].assign(64, kPoisonByte);
  }
  if (c.device_td) {
    b[kTdDevice].resize(4);
    std::memcpy(b[kTdDevice].data(), &c.device_td_value, 4);
  }
  return b;
}

// The op's params over one copy of the buffers (`base[id]`, on `device`).
MlaRopeCacheParams build_params(const Case& c, const std::vector<void*>& base, Device device) {
  const DType m = c.model_dtype;
  const int64_t rows = c.rows();
  MlaRopeCacheParams p;
  p.num_tokens = c.T;
  p.num_decode_tokens = c.device_td ? 0 : c.Td;
  if (c.device_td) p.num_decode_tokens_device = static_cast<const int32_t*>(base[kTdDevice]);
  p.positions = make_view(base[kPositions], c.index_dtype, {rows}, device);
  p.slot_mapping = make_view(base[kSlots], c.index_dtype, {rows}, device);
  p.cos_sin_cache = make_strided_view(base[kTable], c.table_dtype, {c.max_pos, c.R},
                                      {c.table_row_stride, 1}, device);
  p.rope_style = c.rope_style;
  if (c.joint_kv) {
    p.kv_c = make_strided_view(base[kKvC], m, {rows, c.L}, {c.kv_row(), 1}, device);
    p.k_pe = make_strided_view(offset_bytes(base[kKvC], c.L * c.model_bytes()), m, {rows, c.R},
                               {c.kv_row(), 1}, device);
  } else {
    p.kv_c = make_view(base[kKvC], m, {rows, c.L}, device);
    p.k_pe = make_view(base[kKPe], m, {rows, c.R}, device);
  }
  if (c.rms_norm) {
    p.kv_norm_weight = make_view(base[kNormWeight], m, {c.L}, device);
    p.kv_norm_eps = 1e-6f;
  }
  p.kv_cache = c.cache.view(base[kCache], base[kCacheRope],
                            static_cast<const float*>(base[kCacheScale]), device);
  if (c.k_pe_out == Alias::kSeparate) p.k_pe_out = make_view(base[kKPeOut], m, {rows, c.R}, device);
  if (c.k_pe_out == Alias::kInPlace) p.k_pe_out = p.k_pe;
  if (c.kv_c_out == Alias::kSeparate) p.kv_c_out = make_view(base[kKvCOut], m, {rows, c.L}, device);
  if (c.kv_c_out == Alias::kInPlace) p.kv_c_out = p.kv_c;
  if (c.decode_side) {
    const int64_t dr = c.decode_rows();
    p.q_pe = make_view(base[kQPe], m, {dr, c.H, c.R}, device);
    if (c.ql_nope) p.ql_nope = make_view(base[kQlNope], m, {dr, c.H, c.L}, device);
    p.q_out = make_view(base[kQOut], c.q_out_dtype, {dr, c.H, c.L + c.R}, device);
    if (c.q_scale) p.q_scale = static_cast<const float*>(base[kQScale]);
  }
  if (c.prefill_side) {
    p.q = make_view(base[kQ], m, {rows, c.H, c.P + c.R}, device);
    if (c.q_prefill_out) {
      p.q_prefill_out = make_view(base[kQPrefillOut], m, {rows, c.H, c.P + c.R}, device);
    }
  }
  return p;
}

// mla_rope_cache: the model configs, the cache format cycling by seed.
class FusedFamily : public Family {
 public:
  int num_configs() const override { return static_cast<int>(model_configs().size()); }
  const char* config_name(int config) const override { return model_configs()[config].name; }

  void prepare(int config, int i, uint64_t seed) override {
    const ModelConfig& model = model_configs()[config];
    if (i == 0) formats_.reset();
    case_ = make_case(model, seed, cycled_format_index(i, model.L, model.R, seed));
    formats_.add(case_.cache.format);
    initial_ = initial_buffers(case_);
  }
  std::string describe() const override { return case_.describe(); }

  Run reference() const override {
    return run_reference(initial_, buffer_name,
                         [&](const std::vector<void*>& base, int32_t* counts) {
                           ref::mla_rope_cache(build_params(case_, base, Device{}), counts);
                         });
  }

  Run run(Device device) const override {
    return run_on(device, initial_, buffer_name,
                  [&](const std::vector<void*>& base, const Context& ctx) {
                    mla_rope_cache(build_params(case_, base, device), ctx);
                  });
  }

  std::string config_note(int /*config*/) const override { return formats_.note(); }

 private:
  Case case_;
  std::vector<std::vector<uint8_t>> initial_;  // by BufferId
  FormatTally formats_;
};

}  // namespace

std::unique_ptr<Family> make_fused_family() { return std::make_unique<FusedFamily>(); }

}  // namespace check
}  // namespace cli
}  // namespace mlakv
