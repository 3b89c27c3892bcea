// mlakv CLI: `mlakv check`'s unfused family (check.h): the primitives an engine runs without the
// fused op (rotary_embedding, concat_and_cache_mla, decode_q_concat, rms_norm), each against its
// own reference, over random shapes, dtypes, layouts and bad indices.
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

enum class UnfusedOp { kRotary, kRotaryMla, kConcat, kQConcat, kRmsNorm };

struct UnfusedConfig {
  const char* name;
  UnfusedOp op;
};

const std::vector<UnfusedConfig>& unfused_configs() {
  static const std::vector<UnfusedConfig> configs = {
      {"rotary_embedding any shape", UnfusedOp::kRotary},
      {"rotary_embedding MLA q, k_pe", UnfusedOp::kRotaryMla},
      {"concat_and_cache_mla", UnfusedOp::kConcat},
      {"decode_q_concat", UnfusedOp::kQConcat},
      {"rms_norm", UnfusedOp::kRmsNorm},
  };
  return configs;
}

const CacheFormat kUnfusedFormats[] = {CacheFormat::kBFloat16,   CacheFormat::kFloat16,
                                       CacheFormat::kFloat32,    CacheFormat::kFloat8E4M3,
                                       CacheFormat::kFloat8E5M2, CacheFormat::kFloat8DsMla};

// Every buffer a case may use, named as the ops' params name them.
enum UnfusedBufferId : int {
  kUPositions,
  kUTable,
  kUQuery,  // rotary_embedding's query (the MLA form: q [rows, H, P + R], its rope part rotated)
  kUKey,    // its key (the MLA form: [kv_c | k_pe] rows, k_pe rotated)
  kUKvC,    // concat_and_cache_mla's kv_c (and k_pe too when they share one row)
  kUKPe,
  kUSlots,
  kUCache,
  kUCacheRope,
  kUCacheScale,
  kUQlNope,
  kUQPe,
  kUQOut,
  kUQScale,
  kUInput,
  kUWeight,
  kUOutput,
  kNumUnfusedBuffers
};

const char* unfused_buffer_name(int id) {
  static const char* names[kNumUnfusedBuffers] = {
      "positions",    "cos_sin_cache", "query",
      "key",          "kv_c",          "k_pe",
      "slot_mapping", "kv_cache",      "kv_cache (rope part)",
      "cache scale",  "ql_nope",       "q_pe",
      "q_out",        "q_scale",       "input",
      "weight",       "output"};
  return names[id];
}

struct UnfusedCase {
  const UnfusedConfig* config = nullptr;
  uint64_t seed = 0;
  DType model = DType::kBFloat16;
  int64_t T = 0, pad_rows = 0;
  DType index_dtype = DType::kInt64;
  // rotary_embedding: query [rows, Hq, head] at a head stride of head + head_pad (the MLA form:
  // the rope part of q [rows, H, P + R]); key [rows, Hk, head] or absent (Hk = 0).
  int64_t Hq = 0, Hk = 0, head = 0, head_pad = 0, rot_dim = 0, P = 0;
  RopeStyle rope_style = RopeStyle::kGptJ;
  DType table_dtype = DType::kFloat32;
  int64_t max_pos = 0, table_row_stride = 0;
  std::vector<int64_t> positions;
  // concat_and_cache_mla / decode_q_concat: L, R (and H).
  int64_t H = 0, L = 0, R = 0;
  CacheLayout cache;
  bool joint_kv = false;  // kv_c and k_pe in one [rows, L + R + 8] buffer
  std::vector<int64_t> slots;
  DType q_out_dtype = DType::kBFloat16;
  bool q_scale = false;
  bool ql_nope_in_place = false, q_pe_in_place = false;
  // rms_norm: [rows, N], output separate or input itself.
  int64_t N = 0;
  bool norm_in_place = false;
  float eps = 1e-6f;

  int64_t rows() const { return T + pad_rows; }
  int64_t query_head_stride() const {
    return op() == UnfusedOp::kRotaryMla ? P + R : head + head_pad;
  }
  int64_t key_row() const { return op() == UnfusedOp::kRotaryMla ? L + R : Hk * head; }
  int64_t kv_row() const { return joint_kv ? L + R + 8 : L; }
  UnfusedOp op() const { return config->op; }

  std::string describe() const {
    std::ostringstream os;
    os << "seed " << seed << ": T " << T << " pad " << pad_rows << " " << dtype_name(model);
    switch (op()) {
      case UnfusedOp::kRotary:
      case UnfusedOp::kRotaryMla: {
        int64_t clamped = 0;
        for (int64_t t = 0; t < T; ++t) clamped += positions[t] < 0 || positions[t] >= max_pos;
        os << " Hq " << Hq << " Hk " << Hk << " head " << head << " (stride " << query_head_stride()
           << ") rot_dim " << rot_dim << " " << rope_style_name(rope_style) << " table "
           << dtype_name(table_dtype) << (table_row_stride != rot_dim ? " strided" : "") << " idx "
           << dtype_name(index_dtype);
        if (clamped > 0) os << " " << clamped << " positions clamped";
        break;
      }
      case UnfusedOp::kConcat: {
        int64_t padding = 0, past = 0;
        for (int64_t t = 0; t < T; ++t) {
          padding += slots[t] < 0 ? 1 : 0;
          past += slots[t] >= cache.num_slots() ? 1 : 0;
        }
        os << " L " << L << " R " << R << " " << cache.describe() << " idx "
           << dtype_name(index_dtype) << (joint_kv ? " joint-kv" : "");
        if (padding > 0) os << " " << padding << " padding slots";
        if (past > 0) os << " " << past << " slots past the cache";
        break;
      }
      case UnfusedOp::kQConcat:
        os << " H " << H << " L " << L << " R " << R << " q_out " << dtype_name(q_out_dtype)
           << (q_scale ? " q_scale" : "") << (ql_nope_in_place ? " ql_nope in q_out" : "")
           << (q_pe_in_place ? " q_pe in q_out" : "");
        break;
      case UnfusedOp::kRmsNorm:
        os << " N " << N << " eps " << eps << (norm_in_place ? " output=input" : " output");
        break;
    }
    return os.str();
  }
};

// Positions in [0, max_pos), a few outside (clamped and counted); padding rows get wild values
// the op must never read.
void draw_positions(UnfusedCase* c, Rng& rng) {
  c->max_pos = rng.between(c->T + 1, 4096);
  for (int64_t t = 0; t < c->rows(); ++t) {
    int64_t pos = t >= c->T ? -1000000 - t : rng.below(c->max_pos);
    if (t < c->T && rng.chance(0.03)) {
      pos = rng.chance(0.5) ? -1 - rng.below(5) : c->max_pos + rng.below(5);
    }
    c->positions.push_back(pos);
  }
}

UnfusedCase make_unfused_case(const UnfusedConfig& config, uint64_t seed, int format_index) {
  Rng rng = case_rng(seed, config.name, static_cast<uint64_t>(format_index));
  UnfusedCase c;
  c.config = &config;
  c.seed = seed;
  const double dtype_roll = rng.uniform(0.0f, 1.0f);
  c.model =
      dtype_roll < 0.6 ? DType::kBFloat16 : (dtype_roll < 0.8 ? DType::kFloat16 : DType::kFloat32);
  c.T = rng.chance(0.15) ? rng.between(65, 300) : rng.between(1, 64);
  c.pad_rows = rng.chance(0.5) ? rng.between(1, 4) : 0;
  c.index_dtype = rng.chance(0.5) ? DType::kInt64 : DType::kInt32;
  switch (config.op) {
    case UnfusedOp::kRotary:
    case UnfusedOp::kRotaryMla: {
      if (config.op == UnfusedOp::kRotary) {
        c.rot_dim = 2 * rng.between(1, 64);
        c.head = c.rot_dim + (rng.chance(0.5) ? 0 : 2 * rng.between(1, 32));
        c.head_pad = rng.chance(0.3) ? rng.between(1, 8) : 0;
        c.Hq = rng.between(1, 16);
        c.Hk = rng.chance(0.3) ? 0 : rng.between(1, 4);
      } else {
        // q [rows, H, P + R]: its rope part [rows, H, R] is the query; k_pe [rows, 1, R], the
        // rope part of [kv_c | k_pe] rows, is the key.
        c.L = 512;
        c.R = c.rot_dim = c.head = 64;
        c.P = 128;
        c.Hq = rng.chance(0.5) ? 128 : 16;
        c.Hk = 1;
      }
      c.rope_style = rng.chance(0.5) ? RopeStyle::kGptJ : RopeStyle::kNeox;
      const double table_roll = rng.uniform(0.0f, 1.0f);
      c.table_dtype = table_roll < 0.7    ? DType::kFloat32
                      : table_roll < 0.85 ? DType::kBFloat16
                                          : DType::kFloat16;
      draw_positions(&c, rng);
      c.table_row_stride = c.rot_dim + (rng.chance(0.2) ? 8 : 0);
      break;
    }
    case UnfusedOp::kConcat: {
      const bool ds_mla = format_index == 5;
      const bool small = !ds_mla && rng.chance(0.3);
      c.L = small ? 256 : 512;
      c.R = small ? 32 : 64;
      const CacheFormat format = kUnfusedFormats[format_index];
      // fp8_ds_mla stores the rope part as bf16: it takes a bf16 model only.
      if (format == CacheFormat::kFloat8DsMla) c.model = DType::kBFloat16;
      c.cache = CacheLayout::draw(rng, format, c.L, c.R, c.T + c.T / 2);
      c.joint_kv = rng.chance(0.3);
      const std::vector<int64_t> distinct = random_distinct_slots(c.T, c.cache.num_slots(), rng);
      for (int64_t t = 0; t < c.rows(); ++t) {
        int64_t slot = t >= c.T ? c.cache.num_slots() * 100 + t : distinct[t];
        if (t < c.T && rng.chance(0.08)) slot = -1;
        if (t < c.T && rng.chance(0.04)) slot = c.cache.num_slots() + rng.below(100);
        c.slots.push_back(slot);
      }
      break;
    }
    case UnfusedOp::kQConcat: {
      c.H = rng.chance(0.3) ? 128 : rng.between(1, 16);
      const bool small = rng.chance(0.3);
      c.L = small ? 16 * rng.between(1, 32) : 512;
      c.R = small ? 2 * rng.between(1, 32) : 64;
      const double q_roll = rng.uniform(0.0f, 1.0f);
      c.q_out_dtype =
          q_roll < 0.5 ? c.model : (q_roll < 0.75 ? DType::kFloat8E4M3 : DType::kFloat8E5M2);
      c.q_scale = is_float8(c.q_out_dtype) && rng.chance(0.85);
      if (!is_float8(c.q_out_dtype)) {
        c.ql_nope_in_place = rng.chance(0.4);
        c.q_pe_in_place = rng.chance(0.4);
      }
      break;
    }
    case UnfusedOp::kRmsNorm: {
      const int64_t widths[] = {512, 1536, 7168};
      c.N = rng.chance(0.5) ? widths[rng.below(3)] : rng.between(1, 4096);
      c.norm_in_place = rng.chance(0.3);
      c.eps = rng.chance(0.2) ? 1e-5f : 1e-6f;
      break;
    }
  }
  return c;
}

std::vector<std::vector<uint8_t>> unfused_initial_buffers(const UnfusedCase& c) {
  Rng rng(c.seed ^ 0x0f05edull);
  std::vector<std::vector<uint8_t>> b(kNumUnfusedBuffers);
  const DType m = c.model;
  const size_t mb = dtype_size(m);
  const int64_t rows = c.rows();
  switch (c.op()) {
    case UnfusedOp::kRotary:
    case UnfusedOp::kRotaryMla: {
      b[kUPositions] = index_bytes(c.positions, c.index_dtype);
      const std::vector<uint8_t> table = rope_table_bytes(c.max_pos, c.rot_dim, c.table_dtype);
      const size_t tb = dtype_size(c.table_dtype);
      b[kUTable] = random_values(c.table_dtype, c.max_pos * c.table_row_stride, 1.0f, rng);
      for (int64_t p = 0; p < c.max_pos; ++p) {
        std::memcpy(b[kUTable].data() + p * c.table_row_stride * tb,
                    table.data() + p * c.rot_dim * tb, c.rot_dim * tb);
      }
      b[kUQuery] = random_values(m, rows * c.Hq * c.query_head_stride(), 2.0f, rng);
      if (c.Hk > 0) b[kUKey] = random_values(m, rows * c.key_row(), 2.0f, rng);
      break;
    }
    case UnfusedOp::kConcat:
      b[kUSlots] = index_bytes(c.slots, c.index_dtype);
      b[kUKvC] = random_values(m, rows * c.kv_row(), 2.0f, rng);
      if (!c.joint_kv) b[kUKPe] = random_values(m, rows * c.R, 2.0f, rng);
      b[kUCache].assign(c.cache.data_bytes(), kSentinelByte);
      if (c.cache.split) b[kUCacheRope].assign(c.cache.rope_bytes(), kSentinelByte);
      if (c.cache.scaled) {
        const float scale = rng.uniform(0.004f, 0.05f);
        b[kUCacheScale].resize(4);
        std::memcpy(b[kUCacheScale].data(), &scale, 4);
      }
      break;
    case UnfusedOp::kQConcat: {
      const int64_t out_elems = rows * c.H * (c.L + c.R);
      // A part in place is an input: q_out then holds random values, else it is poisoned.
      if (c.ql_nope_in_place || c.q_pe_in_place) {
        b[kUQOut] = random_values(c.q_out_dtype, out_elems, 2.0f, rng);
      } else {
        b[kUQOut].assign(static_cast<size_t>(out_elems) * dtype_size(c.q_out_dtype), kPoisonByte);
      }
      if (!c.ql_nope_in_place) b[kUQlNope] = random_values(m, rows * c.H * c.L, 2.0f, rng);
      if (!c.q_pe_in_place) b[kUQPe] = random_values(m, rows * c.H * c.R, 2.0f, rng);
      if (c.q_scale) {
        const float scale = rng.uniform(0.004f, 0.05f);
        b[kUQScale].resize(4);
        std::memcpy(b[kUQScale].data(), &scale, 4);
      }
      break;
    }
    case UnfusedOp::kRmsNorm:
      b[kUInput] = random_values(m, rows * c.N, 2.0f, rng);
      b[kUWeight] = random_values(m, c.N, 1.5f, rng);
      if (!c.norm_in_place) b[kUOutput].assign(static_cast<size_t>(rows * c.N) * mb, kPoisonByte);
      break;
  }
  return b;
}

RotaryEmbeddingParams rotary_params(const UnfusedCase& c, const std::vector<void*>& base,
                                    Device device) {
  const int64_t rows = c.rows();
  RotaryEmbeddingParams p;
  p.num_tokens = c.T;
  p.positions = make_view(base[kUPositions], c.index_dtype, {rows}, device);
  p.cos_sin_cache = make_strided_view(base[kUTable], c.table_dtype, {c.max_pos, c.rot_dim},
                                      {c.table_row_stride, 1}, device);
  p.rope_style = c.rope_style;
  const size_t mb = dtype_size(c.model);
  const int64_t hs = c.query_head_stride();
  uint8_t* query = static_cast<uint8_t*>(base[kUQuery]);
  if (c.op() == UnfusedOp::kRotaryMla) query += c.P * mb;
  p.query = make_strided_view(query, c.model, {rows, c.Hq, c.head}, {c.Hq * hs, hs, 1}, device);
  if (c.Hk > 0) {
    uint8_t* key = static_cast<uint8_t*>(base[kUKey]);
    if (c.op() == UnfusedOp::kRotaryMla) key += c.L * mb;
    p.key = make_strided_view(key, c.model, {rows, c.Hk, c.head}, {c.key_row(), c.head, 1}, device);
  }
  return p;
}

ConcatAndCacheMlaParams concat_params(const UnfusedCase& c, const std::vector<void*>& base,
                                      Device device) {
  const int64_t rows = c.rows();
  ConcatAndCacheMlaParams p;
  p.num_tokens = c.T;
  p.kv_c = make_strided_view(base[kUKvC], c.model, {rows, c.L}, {c.kv_row(), 1}, device);
  if (c.joint_kv) {
    p.k_pe = make_strided_view(static_cast<uint8_t*>(base[kUKvC]) + c.L * dtype_size(c.model),
                               c.model, {rows, c.R}, {c.kv_row(), 1}, device);
  } else {
    p.k_pe = make_view(base[kUKPe], c.model, {rows, c.R}, device);
  }
  p.slot_mapping = make_view(base[kUSlots], c.index_dtype, {rows}, device);
  p.kv_cache = c.cache.view(base[kUCache], base[kUCacheRope],
                            static_cast<const float*>(base[kUCacheScale]), device);
  return p;
}

DecodeQConcatParams q_concat_params(const UnfusedCase& c, const std::vector<void*>& base,
                                    Device device) {
  const int64_t rows = c.rows();
  const int64_t width = c.L + c.R;
  DecodeQConcatParams p;
  p.num_tokens = c.T;
  p.q_out = make_view(base[kUQOut], c.q_out_dtype, {rows, c.H, width}, device);
  if (c.ql_nope_in_place) {
    p.ql_nope =
        make_strided_view(base[kUQOut], c.model, {rows, c.H, c.L}, {c.H * width, width, 1}, device);
  } else {
    p.ql_nope = make_view(base[kUQlNope], c.model, {rows, c.H, c.L}, device);
  }
  if (c.q_pe_in_place) {
    p.q_pe = make_strided_view(static_cast<uint8_t*>(base[kUQOut]) + c.L * dtype_size(c.model),
                               c.model, {rows, c.H, c.R}, {c.H * width, width, 1}, device);
  } else {
    p.q_pe = make_view(base[kUQPe], c.model, {rows, c.H, c.R}, device);
  }
  if (c.q_scale) p.q_scale = static_cast<const float*>(base[kUQScale]);
  return p;
}

RmsNormParams rms_norm_params(const UnfusedCase& c, const std::vector<void*>& base, Device device) {
  RmsNormParams p;
  p.num_tokens = c.T;
  p.input = make_view(base[kUInput], c.model, {c.rows(), c.N}, device);
  p.weight = make_view(base[kUWeight], c.model, {c.N}, device);
  p.eps = c.eps;
  p.output =
      c.norm_in_place ? p.input : make_view(base[kUOutput], c.model, {c.rows(), c.N}, device);
  return p;
}

class UnfusedFamily : public Family {
 public:
  int num_configs() const override { return static_cast<int>(unfused_configs().size()); }
  const char* config_name(int config) const override { return unfused_configs()[config].name; }

  void prepare(int config, int i, uint64_t seed) override {
    case_ = make_unfused_case(unfused_configs()[config], seed, i % 6);
    initial_ = unfused_initial_buffers(case_);
  }
  std::string describe() const override { return case_.describe(); }

  Run reference() const override {
    Run run = empty_run();
    run.result = initial_;
    const std::vector<void*> base = host_pointers(&run);
    const Device host{};
    switch (case_.op()) {
      case UnfusedOp::kRotary:
      case UnfusedOp::kRotaryMla:
        ref::rotary_embedding(rotary_params(case_, base, host), run.counts.data());
        break;
      case UnfusedOp::kConcat:
        ref::concat_and_cache_mla(concat_params(case_, base, host), run.counts.data());
        break;
      case UnfusedOp::kQConcat:
        ref::decode_q_concat(q_concat_params(case_, base, host));
        break;
      case UnfusedOp::kRmsNorm:
        ref::rms_norm(rms_norm_params(case_, base, host));
        break;
    }
    return run;
  }

  Run run(Device device) const override {
    const DeviceCopies copies(initial_, device);
    Buffer counts(device, kNumErrorCounters * sizeof(int32_t));
    reset_error_counts(counts.as<int32_t>(), device);
    Context ctx;
    ctx.error_counts = counts.as<int32_t>();
    switch (case_.op()) {
      case UnfusedOp::kRotary:
      case UnfusedOp::kRotaryMla:
        rotary_embedding(rotary_params(case_, copies.base, device), ctx);
        break;
      case UnfusedOp::kConcat:
        concat_and_cache_mla(concat_params(case_, copies.base, device), ctx);
        break;
      case UnfusedOp::kQConcat:
        decode_q_concat(q_concat_params(case_, copies.base, device), ctx);
        break;
      case UnfusedOp::kRmsNorm:
        rms_norm(rms_norm_params(case_, copies.base, device), ctx);
        break;
    }
    device_synchronize(device);
    Run run = empty_run();
    read_error_counts(counts.as<int32_t>(), device, run.counts.data());
    copies.read_back(initial_, &run);
    return run;
  }

 private:
  static Run empty_run() {
    Run run;
    run.names = unfused_buffer_name;
    return run;
  }

  UnfusedCase case_;
  std::vector<std::vector<uint8_t>> initial_;  // by UnfusedBufferId
};

}  // namespace

std::unique_ptr<Family> make_unfused_family() { return std::make_unique<UnfusedFamily>(); }

}  // namespace check
}  // namespace cli
}  // namespace mlakv
