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
  // rotary_embedding: query [rows, Hq, head] and key [rows, Hk, head] (absent: Hk = 0), their
  // heads query_head_stride / key_head_stride apart and their rows row_pad elements more than
  // their heads. The MLA form: query the rope part of q [rows, Hq, P + R], key the rope part of
  // [kv_c | k_pe] rows [rows, L + R].
  int64_t Hq = 0, Hk = 0, head = 0, head_pad = 0, key_head_pad = 0, row_pad = 0, rot_dim = 0;
  int64_t P = 0;
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
  // ql_nope as a bmm's transposed output ([H, rows, L] viewed as [rows, H, L]); q_pe as the rope
  // part of q [rows, H, q_nope + R] (q_nope 0: its own tensor).
  bool ql_nope_transposed = false;
  int64_t q_nope = 0;
  // rms_norm: [rows, N] rows input_stride / output_stride apart; output separate or input itself.
  int64_t N = 0, input_stride = 0, output_stride = 0;
  bool norm_in_place = false;
  float eps = 1e-6f;

  UnfusedOp op() const { return config->op; }
  int64_t rows() const { return T + pad_rows; }
  bool mla_rotary() const { return op() == UnfusedOp::kRotaryMla; }
  int64_t query_head_stride() const { return mla_rotary() ? P + R : head + head_pad; }
  int64_t query_row() const { return Hq * query_head_stride() + (mla_rotary() ? 0 : row_pad); }
  int64_t key_head_stride() const { return head + key_head_pad; }
  int64_t key_row() const { return mla_rotary() ? L + R : Hk * key_head_stride() + row_pad; }
  int64_t kv_row() const { return joint_kv ? L + R + 8 : L; }

  std::string describe() const {
    std::ostringstream os;
    os << "seed " << seed << ": T " << T << " pad " << pad_rows << " " << dtype_name(model);
    switch (op()) {
      case UnfusedOp::kRotary:
      case UnfusedOp::kRotaryMla:
        os << " Hq " << Hq << " Hk " << Hk << " head " << head << " (query heads "
           << query_head_stride() << " apart, rows " << query_row() << ")";
        if (Hk > 0)
          os << " (key heads " << key_head_stride() << " apart, rows " << key_row() << ")";
        os << " rot_dim " << rot_dim << " " << rope_style_name(rope_style) << " table "
           << dtype_name(table_dtype) << (table_row_stride != rot_dim ? " strided" : "") << " idx "
           << dtype_name(index_dtype) << clamped_positions_note(positions, T, max_pos);
        break;
      case UnfusedOp::kConcat:
        os << " L " << L << " R " << R << " " << cache.describe() << " idx "
           << dtype_name(index_dtype) << (joint_kv ? " joint-kv" : "")
           << bad_slots_note(slots, T, cache.num_slots());
        break;
      case UnfusedOp::kQConcat:
        os << " H " << H << " L " << L << " R " << R << " q_out " << dtype_name(q_out_dtype)
           << (q_scale ? " q_scale" : "")
           << (ql_nope_in_place     ? " ql_nope in q_out"
               : ql_nope_transposed ? " ql_nope transposed"
                                    : "")
           << (q_pe_in_place ? " q_pe in q_out"
               : q_nope > 0  ? " q_pe in q"
                             : "");
        break;
      case UnfusedOp::kRmsNorm:
        os << " N " << N << " eps " << eps << " input rows " << input_stride
           << (norm_in_place ? " output=input" : " output rows " + std::to_string(output_stride));
        break;
    }
    return os.str();
  }
};

UnfusedCase make_unfused_case(const UnfusedConfig& config, uint64_t seed, int i) {
  Rng rng = case_rng(seed, config.name, static_cast<uint64_t>(i % kNumCacheFormats));
  UnfusedCase c;
  c.config = &config;
  c.seed = seed;
  c.model = draw_model_dtype(rng);
  c.T = rng.chance(0.15) ? rng.between(65, 300) : rng.between(1, 64);
  if (empty_batch(seed, config.name)) c.T = 0;
  c.pad_rows = rng.chance(0.5) ? rng.between(1, 4) : 0;
  c.index_dtype = rng.chance(0.5) ? DType::kInt64 : DType::kInt32;
  switch (config.op) {
    case UnfusedOp::kRotary:
    case UnfusedOp::kRotaryMla: {
      if (config.op == UnfusedOp::kRotary) {
        c.rot_dim = 2 * rng.between(1, 64);
        c.head = c.rot_dim + (rng.chance(0.5) ? 0 : 2 * rng.between(1, 32));
        c.head_pad = rng.chance(0.3) ? rng.between(1, 8) : 0;
        c.key_head_pad = rng.chance(0.3) ? rng.between(1, 8) : 0;
        c.row_pad = rng.chance(0.3) ? rng.between(1, 16) : 0;
        c.Hq = rng.between(1, 16);
        c.Hk = rng.chance(0.3) ? 0 : rng.between(1, 4);
      } else {
        c.L = 512;
        c.R = c.rot_dim = c.head = 64;
        c.P = 128;
        c.Hq = rng.chance(0.5) ? 128 : 16;
        c.Hk = 1;
      }
      c.rope_style = rng.chance(0.5) ? RopeStyle::kGptJ : RopeStyle::kNeox;
      c.table_dtype = draw_table_dtype(rng);
      c.max_pos = rng.between(c.T + 1, 4096);
      c.positions = draw_positions(rng, c.T, c.rows(), c.max_pos, c.index_dtype);
      c.table_row_stride = c.rot_dim + (rng.chance(0.2) ? 8 : 0);
      break;
    }
    case UnfusedOp::kConcat: {
      const bool small = rng.chance(0.3);
      c.L = small ? 256 : 512;
      c.R = small ? 32 : 64;
      const CacheFormat format = kCacheFormats[cycled_format_index(i, c.L, c.R, seed)];
      // fp8_ds_mla stores the rope part as bf16: it takes a bf16 model only.
      if (format == CacheFormat::kFloat8DsMla) c.model = DType::kBFloat16;
      c.cache = CacheLayout::draw(rng, format, c.L, c.R, c.T + c.T / 2);
      c.joint_kv = rng.chance(0.3);
      c.slots = draw_slots(rng, c.T, c.rows(), c.cache.num_slots(), c.index_dtype, true);
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
      c.ql_nope_transposed = !c.ql_nope_in_place && rng.chance(0.4);
      if (!c.q_pe_in_place && rng.chance(0.4)) c.q_nope = 128;
      break;
    }
    case UnfusedOp::kRmsNorm: {
      const int64_t widths[] = {512, 1536, 7168};
      c.N = rng.chance(0.5) ? widths[rng.below(3)] : rng.between(1, 4096);
      c.norm_in_place = rng.chance(0.3);
      // Rows 64 elements apart (N = 512: kv_c as the latent part of kv_a_proj's [T, L + R]
      // rows) or any row stride.
      const double stride_roll = rng.uniform(0.0f, 1.0f);
      c.input_stride =
          stride_roll < 0.5 ? c.N : c.N + (stride_roll < 0.75 ? 64 : rng.between(1, 9));
      c.output_stride =
          c.norm_in_place ? c.input_stride : c.N + (rng.chance(0.3) ? rng.between(1, 9) : 0);
      c.eps = rng.chance(0.1) ? 0.0f : rng.chance(0.2) ? 1e-5f : 1e-6f;
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
    case UnfusedOp::kRotaryMla:
      b[kUPositions] = index_bytes(c.positions, c.index_dtype);
      b[kUTable] = strided_rope_table(c.max_pos, c.rot_dim, c.table_dtype, c.table_row_stride, rng);
      b[kUQuery] = random_values(m, rows * c.query_row(), 2.0f, rng);
      if (c.Hk > 0) b[kUKey] = random_values(m, rows * c.key_row(), 2.0f, rng);
      break;
    case UnfusedOp::kConcat:
      b[kUSlots] = index_bytes(c.slots, c.index_dtype);
      b[kUKvC] = random_values(m, rows * c.kv_row(), 2.0f, rng);
      if (!c.joint_kv) b[kUKPe] = random_values(m, rows * c.R, 2.0f, rng);
      b[kUCache].assign(c.cache.data_bytes(), kSentinelByte);
      if (c.cache.split) b[kUCacheRope].assign(c.cache.rope_bytes(), kSentinelByte);
      if (c.cache.scaled) b[kUCacheScale] = scale_bytes(rng);
      break;
    case UnfusedOp::kQConcat: {
      const int64_t width = c.L + c.R;
      const size_t ob = dtype_size(c.q_out_dtype);
      // The parts in place are inputs (random); every other byte of q_out is poisoned.
      b[kUQOut] = random_values(c.q_out_dtype, rows * c.H * width, 2.0f, rng);
      for (int64_t h = 0; h < rows * c.H; ++h) {
        uint8_t* row = b[kUQOut].data() + h * width * ob;
        if (!c.ql_nope_in_place) std::fill(row, row + c.L * ob, kPoisonByte);
        if (!c.q_pe_in_place) std::fill(row + c.L * ob, row + width * ob, kPoisonByte);
      }
      if (!c.ql_nope_in_place) b[kUQlNope] = random_values(m, rows * c.H * c.L, 2.0f, rng);
      if (!c.q_pe_in_place) b[kUQPe] = random_values(m, rows * c.H * (c.q_nope + c.R), 2.0f, rng);
      if (c.q_scale) b[kUQScale] = scale_bytes(rng);
      break;
    }
    case UnfusedOp::kRmsNorm:
      b[kUInput] = random_values(m, rows * c.input_stride, 2.0f, rng);
      b[kUWeight] = random_values(m, c.N, 1.5f, rng);
      if (!c.norm_in_place) {
        b[kUOutput].assign(static_cast<size_t>(rows * c.output_stride) * mb, kPoisonByte);
      }
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
  void* query = offset_bytes(base[kUQuery], c.mla_rotary() ? c.P * mb : 0);
  p.query = make_strided_view(query, c.model, {rows, c.Hq, c.head},
                              {c.query_row(), c.query_head_stride(), 1}, device);
  if (c.Hk > 0) {
    void* key = offset_bytes(base[kUKey], c.mla_rotary() ? c.L * mb : 0);
    p.key = make_strided_view(key, c.model, {rows, c.Hk, c.head},
                              {c.key_row(), c.key_head_stride(), 1}, device);
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
    p.k_pe = make_strided_view(offset_bytes(base[kUKvC], c.L * dtype_size(c.model)), c.model,
                               {rows, c.R}, {c.kv_row(), 1}, device);
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
  const size_t mb = dtype_size(c.model);
  DecodeQConcatParams p;
  p.num_tokens = c.T;
  p.q_out = make_view(base[kUQOut], c.q_out_dtype, {rows, c.H, width}, device);
  if (c.ql_nope_in_place) {
    p.ql_nope =
        make_strided_view(base[kUQOut], c.model, {rows, c.H, c.L}, {c.H * width, width, 1}, device);
  } else if (c.ql_nope_transposed) {
    p.ql_nope =
        make_strided_view(base[kUQlNope], c.model, {rows, c.H, c.L}, {c.L, rows * c.L, 1}, device);
  } else {
    p.ql_nope = make_view(base[kUQlNope], c.model, {rows, c.H, c.L}, device);
  }
  if (c.q_pe_in_place) {
    p.q_pe = make_strided_view(offset_bytes(base[kUQOut], c.L * mb), c.model, {rows, c.H, c.R},
                               {c.H * width, width, 1}, device);
  } else {
    const int64_t q_width = c.q_nope + c.R;
    p.q_pe = make_strided_view(offset_bytes(base[kUQPe], c.q_nope * mb), c.model, {rows, c.H, c.R},
                               {c.H * q_width, q_width, 1}, device);
  }
  if (c.q_scale) p.q_scale = static_cast<const float*>(base[kUQScale]);
  return p;
}

RmsNormParams rms_norm_params(const UnfusedCase& c, const std::vector<void*>& base, Device device) {
  RmsNormParams p;
  p.num_tokens = c.T;
  p.input = make_strided_view(base[kUInput], c.model, {c.rows(), c.N}, {c.input_stride, 1}, device);
  p.weight = make_view(base[kUWeight], c.model, {c.N}, device);
  p.eps = c.eps;
  p.output = c.norm_in_place ? p.input
                             : make_strided_view(base[kUOutput], c.model, {c.rows(), c.N},
                                                 {c.output_stride, 1}, device);
  return p;
}

class UnfusedFamily : public Family {
 public:
  int num_configs() const override { return static_cast<int>(unfused_configs().size()); }
  const char* config_name(int config) const override { return unfused_configs()[config].name; }

  void prepare(int config, int i, uint64_t seed) override {
    case_ = make_unfused_case(unfused_configs()[config], seed, i);
    initial_ = unfused_initial_buffers(case_);
  }
  std::string describe() const override { return case_.describe(); }

  Run reference() const override {
    return run_reference(initial_, unfused_buffer_name,
                         [&](const std::vector<void*>& base, int32_t* counts) {
                           const Device host{};
                           switch (case_.op()) {
                             case UnfusedOp::kRotary:
                             case UnfusedOp::kRotaryMla:
                               ref::rotary_embedding(rotary_params(case_, base, host), counts);
                               break;
                             case UnfusedOp::kConcat:
                               ref::concat_and_cache_mla(concat_params(case_, base, host), counts);
                               break;
                             case UnfusedOp::kQConcat:
                               ref::decode_q_concat(q_concat_params(case_, base, host));
                               break;
                             case UnfusedOp::kRmsNorm:
                               ref::rms_norm(rms_norm_params(case_, base, host));
                               break;
                           }
                         });
  }

  Run run(Device device) const override {
    return run_on(device, initial_, unfused_buffer_name,
                  [&](const std::vector<void*>& base, const Context& ctx) {
                    switch (case_.op()) {
                      case UnfusedOp::kRotary:
                      case UnfusedOp::kRotaryMla:
                        rotary_embedding(rotary_params(case_, base, device), ctx);
                        break;
                      case UnfusedOp::kConcat:
                        concat_and_cache_mla(concat_params(case_, base, device), ctx);
                        break;
                      case UnfusedOp::kQConcat:
                        decode_q_concat(q_concat_params(case_, base, device), ctx);
                        break;
                      case UnfusedOp::kRmsNorm:
                        rms_norm(rms_norm_params(case_, base, device), ctx);
                        break;
                    }
                  });
  }

 private:
  UnfusedCase case_;
  std::vector<std::vector<uint8_t>> initial_;  // by UnfusedBufferId
};

}  // namespace

std::unique_ptr<Family> make_unfused_family() { return std::make_unique<UnfusedFamily>(); }

}  // namespace check
}  // namespace cli
}  // namespace mlakv
