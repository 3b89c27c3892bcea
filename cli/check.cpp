// mlakv CLI: `mlakv check`. A randomized differential test of the ops, by family (--ops): the fused
// op (mla_rope_cache) and the input norms (rmsnorm_quant, mla_rmsnorm_quant,
// per_token_group_quant_fp8). For every named config and seed, one random case (fused: model dtype,
// cache format and layout, rope style, T, Td, block size, padding rows and slots, out-of-range
// slots and positions, RMSNorm, optional outputs, aliasing, device Td; norms: model dtype, width,
// T, group size, scale layout and floor, residual, normed_out) is run by the host reference and by
// every backend; every byte of every buffer (inputs included: they must stay untouched) must match
// the reference, and CUDA must match the CPU, RMSNorm-derived values included (docs/decisions.md:
// one fixed sum order).
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "mlakv/mlakv.h"
#include "reference/reference.h"
#include "util.h"

namespace mlakv {
namespace cli {
namespace {

constexpr uint8_t kPoisonByte = 0xA5;
constexpr uint8_t kSentinelByte = 0x5C;

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

const CacheFormat kAllFormats[] = {CacheFormat::kBFloat16,   CacheFormat::kFloat16,
                                   CacheFormat::kFloat32,    CacheFormat::kFloat8E4M3,
                                   CacheFormat::kFloat8E5M2, CacheFormat::kFloat8DsMla};

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

enum class Alias { kNone, kSeparate, kInPlace };

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
  CacheFormat format = CacheFormat::kBFloat16;
  int64_t block_size = 0, num_blocks = 0;
  bool split_cache = false;
  int64_t token_pad_bytes = 0;  // extra bytes after every cache entry (combined layout)
  bool cache_scale = false;     // per-tensor fp8 with a scale pointer
  bool pow2 = false;
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
       << " pad " << pad_rows << " " << dtype_name(model_dtype) << " cache "
       << cache_format_name(format) << (split_cache ? " split" : "") << " bs " << block_size
       << " blocks " << num_blocks << (cache_scale ? " scaled" : "") << (pow2 ? " pow2" : "") << " "
       << rope_style_name(rope_style) << " table " << dtype_name(table_dtype)
       << (table_row_stride != R ? " strided" : "") << " idx " << dtype_name(index_dtype)
       << (rms_norm ? " rmsnorm" : "") << (joint_kv ? " joint-kv" : "");
    // The rows the op must skip or clamp and count (padding rows excluded: never read).
    int64_t padding_slots = 0, slots_past = 0, positions_clamped = 0;
    for (int64_t t = 0; t < T; ++t) {
      padding_slots += slots[t] < 0 ? 1 : 0;
      slots_past += slots[t] >= num_blocks * block_size ? 1 : 0;
      positions_clamped += positions[t] < 0 || positions[t] >= max_pos ? 1 : 0;
    }
    if (padding_slots > 0) os << " " << padding_slots << " padding slots";
    if (slots_past > 0) os << " " << slots_past << " slots past the cache";
    if (positions_clamped > 0) os << " " << positions_clamped << " positions clamped";
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

// The random source of one case: seeded from a hash of the seed, the config's name (FNV-1a:
// configs with equal shapes differ) and `salt`, so that seed s + 1 is not seed s's stream one draw
// later (SplitMix64 seeded with s * its own increment would be).
Rng case_rng(uint64_t seed, const char* config_name, uint64_t salt) {
  uint64_t name_hash = 1469598103934665603ull;
  for (const char* ch = config_name; *ch != '\0'; ++ch) {
    name_hash = (name_hash ^ static_cast<uint8_t>(*ch)) * 1099511628211ull;
  }
  return Rng(Rng(seed * 0x9e3779b97f4a7c15ull + salt * 7919u + name_hash).next());
}

Case make_case(const ModelConfig& model, uint64_t seed, int format_index) {
  Rng rng = case_rng(seed, model.name, static_cast<uint64_t>(format_index));
  Case c;
  c.model = &model;
  c.seed = seed;
  c.H = model.H;
  c.L = model.L;
  c.R = model.R;
  c.P = model.P;
  c.format = kAllFormats[format_index];
  const double dtype_roll = rng.uniform(0.0f, 1.0f);
  c.model_dtype =
      dtype_roll < 0.6 ? DType::kBFloat16 : (dtype_roll < 0.8 ? DType::kFloat16 : DType::kFloat32);
  // fp8_ds_mla stores the rope part as bf16: it takes a bf16 model only.
  if (c.format == CacheFormat::kFloat8DsMla) c.model_dtype = DType::kBFloat16;
  c.T = rng.chance(0.15) ? rng.between(65, 300) : rng.between(1, 64);
  c.pad_rows = rng.chance(0.5) ? rng.between(1, 4) : 0;
  c.index_dtype = rng.chance(0.5) ? DType::kInt64 : DType::kInt32;
  const double table_roll = rng.uniform(0.0f, 1.0f);
  c.table_dtype =
      table_roll < 0.7 ? DType::kFloat32 : (table_roll < 0.85 ? DType::kBFloat16 : DType::kFloat16);
  c.max_pos = rng.between(c.T + 1, 4096);
  c.table_row_stride = c.R + (rng.chance(0.2) ? 8 : 0);
  c.rope_style = rng.chance(0.5) ? RopeStyle::kGptJ : RopeStyle::kNeox;
  const int64_t block_sizes[] = {1, 2, 3, 16, 17, 64, 128};
  c.block_size = block_sizes[rng.below(7)];
  c.num_blocks = (c.T + c.T / 2 + c.block_size - 1) / c.block_size + rng.between(1, 3);
  c.split_cache = c.format != CacheFormat::kFloat8DsMla && rng.chance(0.25);
  c.token_pad_bytes = !c.split_cache && rng.chance(0.2) ? 32 : 0;
  c.cache_scale = cache_is_per_tensor_fp8(c.format) && rng.chance(0.85);
  c.pow2 = c.format == CacheFormat::kFloat8DsMla && rng.chance(0.5);
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
    // An out-of-range device Td is clamped to [0, T] and counted.
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

  // Positions: random, a few outside [0, max_pos) (clamped and counted). Slots: distinct, a few
  // padding (-1) and a few past the cache (skipped and counted); padding rows get wild values the
  // op must never read.
  const int64_t num_slots = c.num_blocks * c.block_size;
  std::vector<int64_t> distinct = random_distinct_slots(c.T, num_slots, rng);
  for (int64_t t = 0; t < c.rows(); ++t) {
    if (t >= c.T) {
      c.positions.push_back(-1000000 - t);
      c.slots.push_back(num_slots * 100 + t);
      continue;
    }
    int64_t pos = rng.below(c.max_pos);
    if (rng.chance(0.03)) pos = rng.chance(0.5) ? -1 - rng.below(5) : c.max_pos + rng.below(5);
    c.positions.push_back(pos);
    int64_t slot = distinct[t];
    if (rng.chance(0.08)) slot = -1;
    if (rng.chance(0.04)) slot = num_slots + rng.below(100);
    c.slots.push_back(slot);
  }
  return c;
}

int64_t cache_entry_stride(const Case& c) {
  if (c.split_cache) return c.L * static_cast<int64_t>(dtype_size(cache_latent_dtype(c.format)));
  return cache_entry_bytes(c.format, c.L, c.R) + c.token_pad_bytes;
}

// Bytes and initial contents of every buffer of a case, by BufferId (empty: not used).
std::vector<std::vector<uint8_t>> initial_buffers(const Case& c) {
  Rng rng(c.seed ^ 0xda7a5eedull);
  std::vector<std::vector<uint8_t>> b(kNumBuffers);
  const DType m = c.model_dtype;
  const size_t mb = c.model_bytes();
  b[kPositions] = index_bytes(c.positions, c.index_dtype);
  b[kSlots] = index_bytes(c.slots, c.index_dtype);
  {
    const std::vector<uint8_t> table = rope_table_bytes(c.max_pos, c.R, c.table_dtype);
    const size_t tb = dtype_size(c.table_dtype);
    std::vector<uint8_t> strided =
        random_values(c.table_dtype, c.max_pos * c.table_row_stride, 1.0f, rng);
    for (int64_t p = 0; p < c.max_pos; ++p) {
      std::memcpy(strided.data() + p * c.table_row_stride * tb, table.data() + p * c.R * tb,
                  c.R * tb);
    }
    b[kTable] = std::move(strided);
  }
  b[kKvC] = random_values(m, c.rows() * c.kv_row(), 2.0f, rng);
  if (!c.joint_kv) b[kKPe] = random_values(m, c.rows() * c.R, 2.0f, rng);
  if (c.rms_norm) b[kNormWeight] = random_values(m, c.L, 1.5f, rng);
  const int64_t entry_stride = cache_entry_stride(c);
  b[kCache].assign(static_cast<size_t>(c.num_blocks * c.block_size * entry_stride), kSentinelByte);
  if (c.split_cache) {
    b[kCacheRope].assign(static_cast<size_t>(c.num_blocks * c.block_size * c.R) *
                             dtype_size(cache_rope_dtype(c.format)),
                         kSentinelByte);
  }
  if (c.cache_scale) {
    const float scale = rng.uniform(0.004f, 0.05f);
    b[kCacheScale].resize(4);
    std::memcpy(b[kCacheScale].data(), &scale, 4);
  }
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
    if (c.q_scale) {
      const float scale = rng.uniform(0.004f, 0.05f);
      b[kQScale].resize(4);
      std::memcpy(b[kQScale].data(), &scale, 4);
    }
  }
  if (c.prefill_side) {
    b[kQ] = random_values(m, c.rows() * c.H * (c.P + c.R), 2.0f, rng);
    if (c.q_prefill_out) {
      b[kQPrefillOut].assign(c.rows() * c.H * (c.P + c.R) * mb, kPoisonByte);
    }
  }
  // A decode side of zero rows (Td = 0, no padding) still gets a real, never-touched allocation.
  for (int id : {kQPe, kQlNope, kQOut}) {
    const bool used = c.decode_side && (id != kQlNope || c.ql_nope);
    if (used && b[id].empty()) b[id].assign(64, kPoisonByte);
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
    p.k_pe = make_strided_view(static_cast<uint8_t*>(base[kKvC]) + c.L * c.model_bytes(), m,
                               {rows, c.R}, {c.kv_row(), 1}, device);
  } else {
    p.kv_c = make_view(base[kKvC], m, {rows, c.L}, device);
    p.k_pe = make_view(base[kKPe], m, {rows, c.R}, device);
  }
  if (c.rms_norm) {
    p.kv_norm_weight = make_view(base[kNormWeight], m, {c.L}, device);
    p.kv_norm_eps = 1e-6f;
  }
  if (c.split_cache) {
    p.kv_cache = make_split_cache_view(base[kCache], base[kCacheRope], c.format, c.num_blocks,
                                       c.block_size, c.L, c.R, device);
  } else {
    p.kv_cache =
        make_cache_view(base[kCache], c.format, c.num_blocks, c.block_size, c.L, c.R, device);
    p.kv_cache.stride_token_bytes = cache_entry_stride(c);
    p.kv_cache.stride_block_bytes = cache_entry_stride(c) * c.block_size;
  }
  if (c.cache_scale) p.kv_cache.scale = static_cast<const float*>(base[kCacheScale]);
  p.kv_cache.ds_mla_pow2_scale = c.pow2;
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

// ---- comparison: every byte (RMSNorm outputs too: the reference sums in the library's order) ----

// What one run of a case left in its buffers (by buffer id; empty: not used by the case) and in the
// error counters. `names` names the buffers of the case's op family.
struct Run {
  const char* (*names)(int) = nullptr;
  std::vector<std::vector<uint8_t>> result;
  std::array<int32_t, kNumErrorCounters> counts = {};
  bool ran() const { return !result.empty(); }
};

struct Mismatch {
  bool found = false;
  std::string text;
};

Mismatch compare_buffer(const char* name, const std::vector<uint8_t>& got,
                        const std::vector<uint8_t>& expected, const char* versus) {
  Mismatch m;
  if (got.size() != expected.size()) {
    m.found = true;
    m.text = std::string(name) + ": size differs";
    return m;
  }
  const int64_t first = first_difference(got.data(), expected.data(), got.size());
  if (first < 0) return m;
  const size_t at = static_cast<size_t>(first);
  char buf[64];
  std::snprintf(buf, sizeof(buf), " 0x%02x vs %s 0x%02x", got[at], versus, expected[at]);
  m.found = true;
  m.text = std::string(name) + ": byte " + std::to_string(at) + " of " +
           std::to_string(got.size()) + ":" + buf;
  return m;
}

Mismatch compare_runs(const Run& got, const Run& expected, const char* versus) {
  for (size_t id = 0; id < expected.result.size(); ++id) {
    const Mismatch m = compare_buffer(expected.names(static_cast<int>(id)), got.result[id],
                                      expected.result[id], versus);
    if (m.found) return m;
  }
  for (int k = 0; k < kNumErrorCounters; ++k) {
    if (got.counts[k] != expected.counts[k]) {
      Mismatch m;
      m.found = true;
      m.text = std::string("error counter ") + error_counter_name(k) + ": " +
               std::to_string(got.counts[k]) + " vs " + versus + " " +
               std::to_string(expected.counts[k]);
      return m;
    }
  }
  return {};
}

// Copies of `initial` on `device` (nullptr for an unused buffer); the run's result is read back
// from them, cut to each buffer's size.
struct DeviceCopies {
  std::vector<Buffer> buffers;
  std::vector<void*> base;

  DeviceCopies(const std::vector<std::vector<uint8_t>>& initial, Device device)
      : buffers(initial.size()), base(initial.size(), nullptr) {
    for (size_t id = 0; id < initial.size(); ++id) {
      if (initial[id].empty()) continue;
      buffers[id] = Buffer(device, initial[id].size());
      buffers[id].upload(initial[id]);
      base[id] = buffers[id].data();
    }
  }
  void read_back(const std::vector<std::vector<uint8_t>>& initial, Run* run) const {
    run->result.resize(initial.size());
    for (size_t id = 0; id < initial.size(); ++id) {
      if (initial[id].empty()) continue;
      run->result[id] = buffers[id].download();
      run->result[id].resize(initial[id].size());
    }
  }
};

// The host reference's pointers into a run's buffers (nullptr for an unused buffer).
std::vector<void*> host_pointers(Run* run) {
  std::vector<void*> host(run->result.size(), nullptr);
  for (size_t id = 0; id < host.size(); ++id) {
    if (!run->result[id].empty()) host[id] = run->result[id].data();
  }
  return host;
}

// ---- the op families `check` covers ------------------------------------------------------------

// One family of ops: named configs, and for each (config, seed) one random case that the host
// reference and every backend run on copies of the same initial buffers.
class Family {
 public:
  virtual ~Family() = default;
  virtual int num_configs() const = 0;
  virtual const char* config_name(int config) const = 0;
  // Makes case `i` (of seed `seed`) of `config` the current case.
  virtual void prepare(int config, int i, uint64_t seed) = 0;
  virtual std::string describe() const = 0;
  virtual Run reference() const = 0;
  virtual Run run(Device device) const = 0;
  // Printed after a config's tallies (what its cases covered), or "".
  virtual std::string config_note(int /*config*/) const { return ""; }
};

// mla_rope_cache: the model configs, the cache format cycling by seed.
class FusedFamily : public Family {
 public:
  int num_configs() const override { return static_cast<int>(model_configs().size()); }
  const char* config_name(int config) const override { return model_configs()[config].name; }

  void prepare(int config, int i, uint64_t seed) override {
    const ModelConfig& model = model_configs()[config];
    if (i == 0) formats_seen_ = 0;
    // Cycle through the cache formats (fp8_ds_mla only where L = 512, R = 64).
    int format_index = i % 6;
    if (format_index == 5 && (model.L != kDsMlaLatentDim || model.R != kDsMlaRopeDim)) {
      format_index = static_cast<int>(seed % 5);
    }
    formats_seen_ |= 1 << format_index;
    case_ = make_case(model, seed, format_index);
    initial_ = initial_buffers(case_);
  }
  std::string describe() const override { return case_.describe(); }

  Run reference() const override {
    Run run = empty_run();
    run.result = initial_;
    ref::mla_rope_cache(build_params(case_, host_pointers(&run), Device{}), run.counts.data());
    return run;
  }

  Run run(Device device) const override {
    const DeviceCopies copies(initial_, device);
    Buffer counts(device, kNumErrorCounters * sizeof(int32_t));
    reset_error_counts(counts.as<int32_t>(), device);
    Context ctx;
    ctx.error_counts = counts.as<int32_t>();
    mla_rope_cache(build_params(case_, copies.base, device), ctx);
    device_synchronize(device);
    Run run = empty_run();
    read_error_counts(counts.as<int32_t>(), device, run.counts.data());
    copies.read_back(initial_, &run);
    return run;
  }

  std::string config_note(int /*config*/) const override {
    int formats = 0;
    for (int f = 0; f < 6; ++f) formats += (formats_seen_ >> f) & 1;
    return "(" + std::to_string(formats) + " cache formats)";
  }

 private:
  static Run empty_run() {
    Run run;
    run.names = buffer_name;
    return run;
  }

  Case case_;
  std::vector<std::vector<uint8_t>> initial_;  // by BufferId
  int formats_seen_ = 0;
};

// rmsnorm_quant, mla_rmsnorm_quant and per_token_group_quant_fp8 (include/mlakv/rmsnorm_quant.h):
// DeepSeek-V3's widths and random ones, random T, group size, scale layout and floor, residual and
// normed_out (in place or not); every output is poisoned first, every input compared afterwards.
enum class NormOp { kRmsNormQuant, kDual, kGroupQuant };

struct NormConfig {
  const char* name;
  NormOp op;
  int64_t N;  // the row width (the dual form: q_c's; kv_c is 512); 0: random
};

const std::vector<NormConfig>& norm_configs() {
  static const std::vector<NormConfig> configs = {
      {"rmsnorm_quant 1536", NormOp::kRmsNormQuant, 1536},
      {"rmsnorm_quant 7168", NormOp::kRmsNormQuant, 7168},
      {"rmsnorm_quant any N", NormOp::kRmsNormQuant, 0},
      {"mla_rmsnorm_quant", NormOp::kDual, 1536},
      {"per_token_group_quant", NormOp::kGroupQuant, 0},
  };
  return configs;
}

// The buffers of a case (named as the ops' params name them; the dual form's q half by its q_c
// names, its kv half as kv_c, kv_weight, kv_c_out).
enum NormBufferId : int {
  kNInput,
  kNWeight,
  kNResidual,
  kNNormedOut,
  kNValues,
  kNScales,
  kNKvInput,
  kNKvWeight,
  kNKvOut,
  kNumNormBuffers
};

const char* norm_buffer_name(int id) {
  static const char* names[kNumNormBuffers] = {"input",      "weight",    "residual",
                                               "normed_out", "values",    "scales",
                                               "kv_c",       "kv_weight", "kv_c_out"};
  return names[id];
}

constexpr int64_t kKvWidth = 512;

struct NormCase {
  const NormConfig* config = nullptr;
  uint64_t seed = 0;
  DType model = DType::kBFloat16;
  int64_t T = 0, pad_rows = 0, N = 0, G = 0;
  bool residual = false;  // rmsnorm_quant, and the dual form's q half
  Alias normed_out = Alias::kNone;
  Alias kv_out = Alias::kSeparate;  // the dual form's kv_c_out: separate or kv_c itself
  bool column_major = false;
  int64_t scale_stride = 0;  // row-major: >= N / G; column-major: >= rows
  bool pow2 = false;
  float eps = 1e-6f;
  float scale_floor = kDefaultScaleFloor;
  int64_t zero_rows = 0;  // leading rows of zeros (their scales are the floor)

  int64_t rows() const { return T + pad_rows; }
  int64_t groups() const { return N / G; }
  int64_t scale_floats() const {
    return column_major ? groups() * scale_stride : rows() * scale_stride;
  }

  std::string describe() const {
    std::ostringstream os;
    os << "seed " << seed << ": T " << T << " pad " << pad_rows << " " << dtype_name(model) << " N "
       << N << " G " << G << (column_major ? " column-major" : " row-major") << " scales (stride "
       << scale_stride << ")" << (pow2 ? " pow2" : "");
    if (scale_floor != kDefaultScaleFloor) os << " floor " << scale_floor;
    if (config->op != NormOp::kGroupQuant) os << " eps " << eps;
    if (residual) os << " residual";
    if (normed_out != Alias::kNone) {
      os << (normed_out == Alias::kInPlace ? " normed_out=input" : " normed_out");
    }
    if (config->op == NormOp::kDual) {
      os << (kv_out == Alias::kInPlace ? " kv_c_out=kv_c" : " kv_c_out");
    }
    if (zero_rows > 0) os << " " << zero_rows << " zero rows";
    return os.str();
  }
};

NormCase make_norm_case(const NormConfig& config, uint64_t seed) {
  Rng rng = case_rng(seed, config.name, 0);
  NormCase c;
  c.config = &config;
  c.seed = seed;
  const double dtype_roll = rng.uniform(0.0f, 1.0f);
  c.model =
      dtype_roll < 0.6 ? DType::kBFloat16 : (dtype_roll < 0.8 ? DType::kFloat16 : DType::kFloat32);
  // T: mostly small; sometimes large. For the widths of the CUDA exact-fit kernel (N <= 1536) a
  // large T crosses its thread-form thresholds (T = 1056 / 1536 / 2048 / 4096,
  // docs/rmsnorm_quant.md); the wider rows stay below 1200 tokens (the reference is scalar).
  const bool narrow = config.N > 0 && config.N <= 1536;
  const double t_roll = rng.uniform(0.0f, 1.0f);
  if (t_roll < 0.75) {
    c.T = rng.between(1, 64);
  } else if (t_roll < 0.88) {
    c.T = rng.between(65, 300);
  } else {
    c.T = narrow ? rng.between(1000, 8200) : rng.between(300, 1200);
  }
  c.pad_rows = rng.chance(0.5) ? rng.between(1, 4) : 0;
  const int64_t groups[] = {16, 32, 64, 128, 256};
  if (config.N > 0) {
    c.N = config.N;
    c.G = rng.chance(0.7) ? 128 : groups[rng.below(5)];
    while (c.N % c.G != 0) c.G /= 2;
  } else {
    c.G = rng.chance(0.5) ? 128 : groups[rng.below(5)];
    c.N = c.G * rng.between(1, 24);
  }
  c.residual = config.op != NormOp::kGroupQuant && rng.chance(0.4);  // the dual form: q_c's
  if (config.op != NormOp::kGroupQuant && rng.chance(0.4)) {
    c.normed_out = rng.chance(0.3) ? Alias::kInPlace : Alias::kSeparate;
  }
  if (config.op == NormOp::kDual && rng.chance(0.5)) c.kv_out = Alias::kInPlace;
  c.column_major = rng.chance(0.5);
  const int64_t pad = rng.chance(0.3) ? rng.between(1, 3) : 0;
  c.scale_stride = c.column_major ? (c.rows() + 3) / 4 * 4 + pad : c.groups() + pad;
  c.pow2 = rng.chance(0.3);
  c.eps = rng.chance(0.2) ? 1e-5f : 1e-6f;
  if (rng.chance(0.2)) c.scale_floor = rng.uniform(1e-4f, 1e-2f);
  c.zero_rows = rng.chance(0.15) ? std::min<int64_t>(c.T, rng.between(1, 3)) : 0;
  return c;
}

std::vector<std::vector<uint8_t>> norm_initial_buffers(const NormCase& c) {
  Rng rng(c.seed ^ 0xda7a5eedull);
  std::vector<std::vector<uint8_t>> b(kNumNormBuffers);
  const size_t mb = dtype_size(c.model);
  const int64_t rows = c.rows();
  b[kNInput] = random_values(c.model, rows * c.N, 2.0f, rng);
  std::fill(b[kNInput].begin(), b[kNInput].begin() + c.zero_rows * c.N * mb, uint8_t{0});
  if (c.config->op != NormOp::kGroupQuant) b[kNWeight] = random_values(c.model, c.N, 1.5f, rng);
  if (c.residual) {
    b[kNResidual] = random_values(c.model, rows * c.N, 2.0f, rng);
    std::fill(b[kNResidual].begin(), b[kNResidual].begin() + c.zero_rows * c.N * mb, uint8_t{0});
  }
  if (c.normed_out == Alias::kSeparate) b[kNNormedOut].assign(rows * c.N * mb, kPoisonByte);
  b[kNValues].assign(static_cast<size_t>(rows * c.N), kPoisonByte);
  b[kNScales].assign(static_cast<size_t>(c.scale_floats()) * 4, kPoisonByte);
  if (c.config->op == NormOp::kDual) {
    b[kNKvInput] = random_values(c.model, rows * kKvWidth, 2.0f, rng);
    b[kNKvWeight] = random_values(c.model, kKvWidth, 1.5f, rng);
    if (c.kv_out == Alias::kSeparate) b[kNKvOut].assign(rows * kKvWidth * mb, kPoisonByte);
  }
  return b;
}

// The views of a case over one copy of its buffers (`base[id]`, on `device`).
struct NormViews {
  RmsNormQuantParams q;  // rmsnorm_quant; the dual form's q half; the group quant's input + quant
  RmsNormParams kv;      // the dual form's kv half
};

NormViews norm_views(const NormCase& c, const std::vector<void*>& base, Device device) {
  const DType m = c.model;
  const int64_t rows = c.rows();
  NormViews v;
  RmsNormQuantParams& q = v.q;
  q.num_tokens = c.T;
  q.input = make_view(base[kNInput], m, {rows, c.N}, device);
  if (base[kNWeight] != nullptr) q.weight = make_view(base[kNWeight], m, {c.N}, device);
  q.eps = c.eps;
  if (c.residual) q.residual = make_view(base[kNResidual], m, {rows, c.N}, device);
  if (c.normed_out == Alias::kSeparate) {
    q.normed_out = make_view(base[kNNormedOut], m, {rows, c.N}, device);
  }
  if (c.normed_out == Alias::kInPlace) q.normed_out = q.input;
  q.quant.values = make_view(base[kNValues], DType::kFloat8E4M3, {rows, c.N}, device);
  float* scales = static_cast<float*>(base[kNScales]);
  q.quant.scales = c.column_major
                       ? column_major_scales_view(scales, rows, c.groups(), c.scale_stride, device)
                       : make_strided_view(scales, DType::kFloat32, {rows, c.groups()},
                                           {c.scale_stride, 1}, device);
  q.quant.group_size = c.G;
  q.quant.scale_floor = c.scale_floor;
  q.quant.pow2_scale = c.pow2;
  if (c.config->op == NormOp::kDual) {
    v.kv.num_tokens = c.T;
    v.kv.input = make_view(base[kNKvInput], m, {rows, kKvWidth}, device);
    v.kv.weight = make_view(base[kNKvWeight], m, {kKvWidth}, device);
    v.kv.eps = c.eps;
    v.kv.output = c.kv_out == Alias::kInPlace
                      ? v.kv.input
                      : make_view(base[kNKvOut], m, {rows, kKvWidth}, device);
  }
  return v;
}

class NormFamily : public Family {
 public:
  int num_configs() const override { return static_cast<int>(norm_configs().size()); }
  const char* config_name(int config) const override { return norm_configs()[config].name; }
  void prepare(int config, int /*i*/, uint64_t seed) override {
    case_ = make_norm_case(norm_configs()[config], seed);
    initial_ = norm_initial_buffers(case_);
  }
  std::string describe() const override { return case_.describe(); }

  Run reference() const override {
    Run run;
    run.names = norm_buffer_name;
    run.result = initial_;
    const NormViews v = norm_views(case_, host_pointers(&run), Device{});
    ref::rmsnorm_quant(v.q);  // without a weight (the group quant) it only quantizes
    if (case_.config->op == NormOp::kDual) {
      RmsNormQuantParams kv;  // no quant: it only normalizes, into normed_out
      kv.num_tokens = v.kv.num_tokens;
      kv.input = v.kv.input;
      kv.weight = v.kv.weight;
      kv.eps = v.kv.eps;
      kv.normed_out = v.kv.output;
      ref::rmsnorm_quant(kv);
    }
    return run;
  }

  Run run(Device device) const override {
    const DeviceCopies copies(initial_, device);
    const NormViews v = norm_views(case_, copies.base, device);
    switch (case_.config->op) {
      case NormOp::kRmsNormQuant:
        rmsnorm_quant(v.q);
        break;
      case NormOp::kDual: {
        MlaRmsNormQuantParams p;
        p.q = v.q;
        p.kv = v.kv;
        mla_rmsnorm_quant(p);
        break;
      }
      case NormOp::kGroupQuant: {
        PerTokenGroupQuantParams p;
        p.num_tokens = v.q.num_tokens;
        p.input = v.q.input;
        p.quant = v.q.quant;
        per_token_group_quant_fp8(p);
        break;
      }
    }
    device_synchronize(device);
    Run run;
    run.names = norm_buffer_name;
    copies.read_back(initial_, &run);
    return run;
  }

 private:
  NormCase case_;
  std::vector<std::vector<uint8_t>> initial_;
};

struct Tally {
  int cases = 0;
  int failures = 0;
};

}  // namespace

int run_check(const CheckOptions& options) {
  std::vector<std::pair<std::string, Device>> backends;
  const bool want_cpu = options.backend == "cpu" || options.backend == "all";
  const bool want_cuda = options.backend == "cuda" || options.backend == "all";
  if (want_cpu) backends.push_back({"cpu", Device{DeviceType::kCPU, 0}});
  if (want_cuda) {
    if (cuda_available()) {
      check_cuda_device("check", options.device);
      backends.push_back({"cuda", Device{DeviceType::kCUDA, options.device}});
    } else if (options.backend == "cuda") {
      std::fprintf(stderr, "mlakv check: --backend cuda: %s\n",
                   cuda_backend_built() ? "no CUDA device is visible"
                                        : "mlakv was built without the CUDA backend");
      return 2;
    } else {
      std::printf("cuda: skipped (%s)\n",
                  cuda_backend_built() ? "no CUDA device visible" : "CUDA backend not built");
    }
  }
  const bool on_cuda = !backends.empty() && backends.back().first == "cuda";
  MLAKV_CHECK(on_cuda || options.device == 0, "check: --device: names the CUDA backend's GPU, ",
              "but no CUDA backend runs (--backend ", options.backend, ")");
  const bool cross = backends.size() == 2;
  std::printf("mlakv check: %s, %d seeds per config, backends:",
              options.ops == "all" ? "mla_rope_cache and rmsnorm_quant" : options.ops.c_str(),
              options.seeds);
  for (const auto& b : backends) std::printf(" %s", b.first.c_str());
  std::printf(" (vs host reference%s)", cross ? "; cuda also vs cpu" : "");
  if (on_cuda) std::printf("; cuda = %s", device_name(backends.back().second).c_str());
  std::printf("\n");
  std::fflush(stdout);

  const bool progress = stderr_is_terminal();
  int total_cases = 0, total_failures = 0;
  FusedFamily fused;
  NormFamily norm;
  std::vector<Family*> families;
  if (options.ops == "all" || options.ops == "mla_rope_cache") families.push_back(&fused);
  if (options.ops == "all" || options.ops == "rmsnorm_quant") families.push_back(&norm);
  for (Family* family : families) {
    for (int config = 0; config < family->num_configs(); ++config) {
      const char* config_name = family->config_name(config);
      std::vector<Tally> tallies(backends.size());
      Tally cross_tally;
      std::vector<std::string> failures;
      for (int i = 0; i < options.seeds; ++i) {
        const uint64_t seed = options.first_seed + static_cast<uint64_t>(i);
        family->prepare(config, i, seed);
        const std::string described = family->describe();
        if (progress) {
          std::fprintf(stderr, "\r\033[K%s [%d/%d] %s", config_name, i + 1, options.seeds,
                       described.substr(0, 100).c_str());
        }
        const Run reference = family->reference();
        std::vector<Run> runs;
        for (size_t b = 0; b < backends.size(); ++b) {
          Mismatch m;
          try {
            runs.push_back(family->run(backends[b].second));
            m = compare_runs(runs.back(), reference, "reference");
          } catch (const Error& e) {
            runs.emplace_back();
            m.found = true;
            m.text = std::string("threw: ") + e.what();
          }
          ++tallies[b].cases;
          if (m.found) {
            ++tallies[b].failures;
            failures.push_back(backends[b].first + " vs reference: " + described + ": " + m.text);
          }
        }
        if (cross && runs[0].ran() && runs[1].ran()) {
          const Mismatch m = compare_runs(runs[1], runs[0], "cpu");
          ++cross_tally.cases;
          if (m.found) {
            ++cross_tally.failures;
            failures.push_back("cuda vs cpu: " + described + ": " + m.text);
          }
        }
        if (options.verbose) {
          if (progress) std::fprintf(stderr, "\r\033[K");
          std::printf("  %s: %s\n", described.c_str(),
                      failures.empty() ? "ok" : "MISMATCH (see below)");
        }
      }
      if (progress) std::fprintf(stderr, "\r\033[K");

      std::printf("%-22s", config_name);
      bool ok = true;
      for (size_t b = 0; b < backends.size(); ++b) {
        std::printf("  %s %d/%d ok", backends[b].first.c_str(),
                    tallies[b].cases - tallies[b].failures, tallies[b].cases);
        ok = ok && tallies[b].failures == 0;
        total_cases += tallies[b].cases;
        total_failures += tallies[b].failures;
      }
      if (cross) {
        std::printf("  cuda==cpu %d/%d", cross_tally.cases - cross_tally.failures,
                    cross_tally.cases);
        ok = ok && cross_tally.failures == 0;
        total_cases += cross_tally.cases;
        total_failures += cross_tally.failures;
      }
      const std::string note = family->config_note(config);
      std::printf("  %s%s%s\n", note.c_str(), note.empty() ? "" : "  ", ok ? "PASS" : "FAIL");
      const size_t shown = std::min<size_t>(failures.size(), 5);
      for (size_t k = 0; k < shown; ++k) std::printf("    MISMATCH %s\n", failures[k].c_str());
      if (failures.size() > shown) {
        std::printf("    ... and %zu more\n", failures.size() - shown);
      }
      std::fflush(stdout);
    }
  }
  std::printf("summary: %d comparisons, %d mismatches: %s\n", total_cases, total_failures,
              total_failures == 0 ? "PASS" : "FAIL");
  return total_failures == 0 ? 0 : 1;
}

}  // namespace cli
}  // namespace mlakv
