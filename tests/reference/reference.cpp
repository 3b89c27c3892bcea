// mlakv tests: the independent host reference (see reference.h for what it shares and what not).
#include "reference/reference.h"

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "mlakv/context.h"

namespace mlakv {
namespace ref {
namespace {

// ---- IEEE binary formats via double ------------------------------------------------------------
// A format with `mant_bits` stored mantissa bits, exponent bias `bias` and `exp_bits` exponent
// bits.
struct Format {
  int mant_bits;
  int exp_bits;
  int bias;
};
constexpr Format kBf16{7, 8, 127};
constexpr Format kFp16{10, 5, 15};

// Rounds |x| (finite, double) to the format's grid with ties to even; subnormals included. The
// scaling by a power of two is exact in double, so nearbyint (round-half-even) does all rounding.
double round_magnitude(double a, const Format& f) {
  if (a == 0.0) return 0.0;
  int e2 = 0;
  std::frexp(a, &e2);  // a = m * 2^e2, m in [0.5, 1): the leading bit has weight 2^(e2 - 1)
  const int emin = 1 - f.bias;
  const int lead = std::max(e2 - 1, emin);
  const double quantum = std::ldexp(1.0, lead - f.mant_bits);
  return std::nearbyint(a / quantum) * quantum;
}

// Bits of a non-negative value that is exactly on the format's grid (or beyond max: inf).
uint32_t encode_magnitude(double r, const Format& f) {
  const int emin = 1 - f.bias;
  const int exp_all_ones = (1 << f.exp_bits) - 1;
  const double max_finite =
      std::ldexp(2.0 - std::ldexp(1.0, -f.mant_bits), exp_all_ones - 1 - f.bias);
  if (r > max_finite) return static_cast<uint32_t>(exp_all_ones) << f.mant_bits;
  if (r < std::ldexp(1.0, emin)) {
    return static_cast<uint32_t>(r / std::ldexp(1.0, emin - f.mant_bits));
  }
  int e2 = 0;
  std::frexp(r, &e2);
  const int e = e2 - 1;
  const double mant = r / std::ldexp(1.0, e - f.mant_bits) - std::ldexp(1.0, f.mant_bits);
  return (static_cast<uint32_t>(e + f.bias) << f.mant_bits) | static_cast<uint32_t>(mant);
}

uint16_t round_to_format(float x, const Format& f) {
  const uint32_t sign_bit = 1u << (f.mant_bits + f.exp_bits);
  if (std::isnan(x)) return 0x7fff;
  const uint32_t sign = std::signbit(x) ? sign_bit : 0u;
  const double a = std::fabs(static_cast<double>(x));
  const uint32_t mag =
      std::isinf(x) ? encode_magnitude(INFINITY, f) : encode_magnitude(round_magnitude(a, f), f);
  return static_cast<uint16_t>(sign | mag);
}

float decode_format(uint32_t bits, const Format& f) {
  const uint32_t sign_bit = 1u << (f.mant_bits + f.exp_bits);
  const int exp_all_ones = (1 << f.exp_bits) - 1;
  const int e = static_cast<int>((bits >> f.mant_bits) & static_cast<uint32_t>(exp_all_ones));
  const uint32_t mant = bits & ((1u << f.mant_bits) - 1);
  double v;
  if (e == exp_all_ones) {
    v = mant ? std::numeric_limits<double>::quiet_NaN() : INFINITY;
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(mant), 1 - f.bias - f.mant_bits);
  } else {
    v = std::ldexp(1.0 + std::ldexp(static_cast<double>(mant), -f.mant_bits), e - f.bias);
  }
  return static_cast<float>((bits & sign_bit) ? -v : v);
}

// ---- fp8: a table of every code's value, searched for the nearest ------------------------------
struct Fp8Table {
  std::array<double, 128> value;  // non-negative codes 0..max_code, increasing
  int max_code;
};

double fp8_code_value(uint8_t code, bool e4m3) {
  const int exp_bits = e4m3 ? 4 : 5;
  const int mant_bits = e4m3 ? 3 : 2;
  const int bias = e4m3 ? 7 : 15;
  const int e = (code >> mant_bits) & ((1 << exp_bits) - 1);
  const int mant = code & ((1 << mant_bits) - 1);
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  if (e4m3 && (code & 0x7f) == 0x7f) return std::numeric_limits<double>::quiet_NaN();
  if (!e4m3 && e == 31) return mant ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (e == 0) return sign * mant * std::ldexp(1.0, 1 - bias - mant_bits);
  return sign * (1.0 + mant / static_cast<double>(1 << mant_bits)) * std::ldexp(1.0, e - bias);
}

const Fp8Table& fp8_table(bool e4m3) {
  static const Fp8Table e4m3_table = [] {
    Fp8Table t;
    t.max_code = 0x7e;
    for (int c = 0; c <= t.max_code; ++c)
      t.value[c] = fp8_code_value(static_cast<uint8_t>(c), true);
    return t;
  }();
  static const Fp8Table e5m2_table = [] {
    Fp8Table t;
    t.max_code = 0x7b;
    for (int c = 0; c <= t.max_code; ++c) {
      t.value[c] = fp8_code_value(static_cast<uint8_t>(c), false);
    }
    return t;
  }();
  return e4m3 ? e4m3_table : e5m2_table;
}

uint8_t nearest_fp8(float x, bool e4m3) {
  if (std::isnan(x)) return 0x7f;
  const Fp8Table& t = fp8_table(e4m3);
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  int code;
  if (a >= t.value[t.max_code]) {
    code = t.max_code;  // saturate (inf included)
  } else {
    // First code whose value is >= a; the answer is it or its predecessor.
    const double* first = t.value.data();
    const int hi = static_cast<int>(std::lower_bound(first, first + t.max_code + 1, a) - first);
    if (hi == 0 || t.value[hi] == a) {
      code = hi;
    } else {
      const double below = a - t.value[hi - 1];
      const double above = t.value[hi] - a;
      if (below < above) {
        code = hi - 1;
      } else if (above < below) {
        code = hi;
      } else {
        code = (hi % 2 == 0) ? hi : hi - 1;  // tie: the even code
      }
    }
  }
  return static_cast<uint8_t>(sign | code);
}

// ---- views -------------------------------------------------------------------------------------
size_t elem_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kInt64:
      return 8;
    default:
      return 1;
  }
}

void* at(const TensorView& v, int64_t i0, int64_t i1 = 0, int64_t i2 = 0) {
  int64_t off = i0 * v.stride[0];
  if (v.ndim > 1) off += i1 * v.stride[1];
  if (v.ndim > 2) off += i2 * v.stride[2];
  return static_cast<char*>(v.data) + off * static_cast<int64_t>(elem_size(v.dtype));
}

int64_t load_index(const TensorView& v, int64_t i) {
  const void* p = at(v, i);
  if (v.dtype == DType::kInt64) {
    int64_t x;
    std::memcpy(&x, p, 8);
    return x;
  }
  int32_t x;
  std::memcpy(&x, p, 4);
  return x;
}

void count(int32_t* error_counts, int32_t counter) {
  if (error_counts) ++error_counts[counter];
}

std::vector<float> load_row(const TensorView& v, int64_t i0, int64_t i1, int64_t begin, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    out[i] = load_value(v.ndim == 2 ? at(v, i0, begin + i) : at(v, i0, i1, begin + i), v.dtype);
  }
  return out;
}

// ---- RoPE --------------------------------------------------------------------------------------
struct CosSin {
  std::vector<float> cos, sin;  // R/2 each
};

CosSin table_row(const TensorView& table, int64_t pos) {
  const int64_t half = table.shape[1] / 2;
  CosSin cs{std::vector<float>(half), std::vector<float>(half)};
  for (int64_t i = 0; i < half; ++i) {
    cs.cos[i] = load_value(at(table, pos, i), table.dtype);
    cs.sin[i] = load_value(at(table, pos, half + i), table.dtype);
  }
  return cs;
}

// The position of token t, clamped into the table; a clamp is counted.
int64_t clamped_position(const TensorView& positions, const TensorView& table, int64_t t,
                         int32_t* error_counts) {
  const int64_t pos = load_index(positions, t);
  const int64_t max_pos = table.shape[0];
  if (pos >= 0 && pos < max_pos) return pos;
  count(error_counts, kBadPosition);
  return pos < 0 ? 0 : max_pos - 1;
}

// DESIGN.md's definition, in float: x' = fma(x, c, -(y*s)), y' = fma(y, c, x*s).
std::vector<float> rope(const std::vector<float>& x, const CosSin& cs, RopeStyle style) {
  const int64_t R = static_cast<int64_t>(x.size());
  std::vector<float> out(x.size());
  for (int64_t i = 0; i < R / 2; ++i) {
    const int64_t a = style == RopeStyle::kNeox ? i : 2 * i;
    const int64_t b = style == RopeStyle::kNeox ? i + R / 2 : 2 * i + 1;
    const float c = cs.cos[i];
    const float s = cs.sin[i];
    const float ys = x[b] * s;
    const float xs = x[a] * s;
    out[a] = std::fma(x[a], c, -ys);
    out[b] = std::fma(x[b], c, xs);
  }
  return out;
}

// ---- RMSNorm -----------------------------------------------------------------------------------
// fp32 sum of the squares of x[lo, lo + size), size a power of two, as the complete binary tree
// over the index (RMSNorm's documented order): the left half's sum plus the right half's.
// Indices past the row are +0 leaves, which leave every sum unchanged.
float tree_sum_squares(const std::vector<float>& x, size_t lo, size_t size) {
  if (lo >= x.size()) return 0.0f;
  if (size == 1) return x[lo] * x[lo];
  const size_t half = size / 2;
  return tree_sum_squares(x, lo, half) + tree_sum_squares(x, lo + half, half);
}

// RMSNorm of one row before rounding, as docs/rmsnorm_quant.md writes it, every step one IEEE fp32
// operation (no contraction: -ffp-contract=off): sum = the tree above, inv = 1 / sqrt(sum / N +
// eps), y = (x * inv) * w. The same order as the library's, so its outputs compare exactly.
std::vector<float> rms_normalize(const std::vector<float>& x, const TensorView& weight, float eps) {
  const float mean = ref::tree_sum_squares(x) / static_cast<float>(x.size());
  const float inv = 1.0f / std::sqrt(mean + eps);
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    out[i] = (x[i] * inv) * load_value(at(weight, static_cast<int64_t>(i)), weight.dtype);
  }
  return out;
}

// ---- the cache ---------------------------------------------------------------------------------
bool is_ds_mla(const KVCacheView& c) { return c.format == CacheFormat::kFloat8DsMla; }

DType latent_dtype(CacheFormat f) {
  switch (f) {
    case CacheFormat::kBFloat16:
      return DType::kBFloat16;
    case CacheFormat::kFloat16:
      return DType::kFloat16;
    case CacheFormat::kFloat32:
      return DType::kFloat32;
    case CacheFormat::kFloat8E5M2:
      return DType::kFloat8E5M2;
    default:
      return DType::kFloat8E4M3;
  }
}
DType rope_dtype(CacheFormat f) {
  return f == CacheFormat::kFloat8DsMla ? DType::kBFloat16 : latent_dtype(f);
}
bool per_tensor_fp8(CacheFormat f) {
  return f == CacheFormat::kFloat8E4M3 || f == CacheFormat::kFloat8E5M2;
}

uint8_t* rope_base(const KVCacheView& c) {
  return static_cast<uint8_t*>(c.is_split() ? c.rope_data : c.data);
}

// Writes one entry: latent (already rounded to the model dtype) and rotated rope (likewise).
void write_entry(const KVCacheView& c, int64_t slot, const std::vector<float>& latent,
                 const std::vector<float>& rope_vals) {
  uint8_t* lat = static_cast<uint8_t*>(c.data) + cache_latent_offset_bytes(c, slot);
  uint8_t* rp = rope_base(c) + cache_rope_offset_bytes(c, slot);
  if (is_ds_mla(c)) {
    for (int64_t tile = 0; tile < kDsMlaNumTiles; ++tile) {
      float amax = 0.0f;
      for (int64_t i = 0; i < kDsMlaTileElems; ++i) {
        const float a = std::fabs(latent[tile * kDsMlaTileElems + i]);
        if (a > amax) amax = a;
      }
      float scale = amax / 448.0f;
      if (!(scale >= FLT_MIN)) scale = FLT_MIN;
      if (c.ds_mla_pow2_scale) {
        int e = 0;
        const float m = std::frexp(scale, &e);
        if (m != 0.5f) scale = std::ldexp(1.0f, e);
      }
      for (int64_t i = 0; i < kDsMlaTileElems; ++i) {
        const int64_t j = tile * kDsMlaTileElems + i;
        lat[j] = float_to_fp8(latent[j] / scale, DType::kFloat8E4M3);
      }
      std::memcpy(lat + kDsMlaLatentDim + 4 * tile, &scale, 4);
    }
    for (size_t i = 0; i < rope_vals.size(); ++i) {
      store_value(rp + 2 * i, DType::kBFloat16, rope_vals[i]);
    }
    return;
  }
  const DType dt = latent_dtype(c.format);
  const size_t es = elem_size(dt);
  const float scale = (per_tensor_fp8(c.format) && c.scale) ? *c.scale : 1.0f;
  auto put = [&](uint8_t* p, float v) {
    if (per_tensor_fp8(c.format)) {
      *p = float_to_fp8(v / scale, dt);
    } else {
      store_value(p, dt, v);
    }
  };
  for (size_t i = 0; i < latent.size(); ++i) put(lat + i * es, latent[i]);
  for (size_t i = 0; i < rope_vals.size(); ++i) put(rp + i * es, rope_vals[i]);
}

// Reads one entry, dequantized, as L + R floats.
std::vector<float> read_entry(const KVCacheView& c, int64_t slot) {
  const int64_t L = c.kv_lora_rank;
  const int64_t R = c.rope_dim;
  std::vector<float> out(static_cast<size_t>(L + R));
  const uint8_t* lat = static_cast<const uint8_t*>(c.data) + cache_latent_offset_bytes(c, slot);
  const uint8_t* rp = rope_base(c) + cache_rope_offset_bytes(c, slot);
  if (is_ds_mla(c)) {
    for (int64_t j = 0; j < L; ++j) {
      float scale;
      std::memcpy(&scale, lat + kDsMlaLatentDim + 4 * (j / kDsMlaTileElems), 4);
      out[j] = fp8_to_float(lat[j], DType::kFloat8E4M3) * scale;
    }
    for (int64_t j = 0; j < R; ++j) out[L + j] = load_value(rp + 2 * j, DType::kBFloat16);
    return out;
  }
  const DType dt = latent_dtype(c.format);
  const size_t es = elem_size(dt);
  const float scale = (per_tensor_fp8(c.format) && c.scale) ? *c.scale : 1.0f;
  auto get = [&](const uint8_t* p) {
    const float v = load_value(p, dt);
    return per_tensor_fp8(c.format) ? v * scale : v;
  };
  for (int64_t j = 0; j < L; ++j) out[j] = get(lat + j * es);
  for (int64_t j = 0; j < R; ++j) out[L + j] = get(rp + j * es);
  return out;
}

// Model-dtype values of a row after rounding (what every consumer sees).
std::vector<float> rounded(std::vector<float> v, DType dtype) {
  for (float& x : v) x = round_to(x, dtype);
  return v;
}

void store_row(const TensorView& v, int64_t i0, int64_t i1, int64_t begin,
               const std::vector<float>& vals, const float* q_scale = nullptr) {
  const float scale = q_scale ? *q_scale : 1.0f;
  for (size_t i = 0; i < vals.size(); ++i) {
    const int64_t j = begin + static_cast<int64_t>(i);
    void* p = v.ndim == 2 ? at(v, i0, j) : at(v, i0, i1, j);
    if (v.dtype == DType::kFloat8E4M3 || v.dtype == DType::kFloat8E5M2) {
      *static_cast<uint8_t*>(p) = float_to_fp8(vals[i] / scale, v.dtype);
    } else {
      store_value(p, v.dtype, vals[i]);
    }
  }
}

// Writes the K side of token t (cache entry unless padding / bad slot, plus the optional outputs).
void write_k_side(const KVCacheView& cache, const TensorView& slot_mapping, int64_t t,
                  const std::vector<float>& latent, const std::vector<float>& rope_vals,
                  int32_t* error_counts) {
  const int64_t slot = load_index(slot_mapping, t);
  if (slot < 0) return;
  if (slot >= cache.num_slots()) {
    count(error_counts, kBadSlot);
    return;
  }
  write_entry(cache, slot, latent, rope_vals);
}

}  // namespace

float tree_sum_squares(const std::vector<float>& x) {
  size_t size = 1;
  while (size < x.size()) size *= 2;
  return tree_sum_squares(x, 0, size);
}

// ---- scalar conversions ------------------------------------------------------------------------
uint16_t float_to_bf16(float x) { return round_to_format(x, kBf16); }
float bf16_to_float(uint16_t bits) { return decode_format(bits, kBf16); }
uint16_t float_to_fp16(float x) { return round_to_format(x, kFp16); }
float fp16_to_float(uint16_t bits) { return decode_format(bits, kFp16); }

uint8_t float_to_fp8(float x, DType fp8_dtype) {
  return nearest_fp8(x, fp8_dtype == DType::kFloat8E4M3);
}
float fp8_to_float(uint8_t code, DType fp8_dtype) {
  return static_cast<float>(fp8_code_value(code, fp8_dtype == DType::kFloat8E4M3));
}

float load_value(const void* p, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kBFloat16:
    case DType::kFloat16: {
      uint16_t u;
      std::memcpy(&u, p, 2);
      return dtype == DType::kBFloat16 ? bf16_to_float(u) : fp16_to_float(u);
    }
    default:
      return fp8_to_float(*static_cast<const uint8_t*>(p), dtype);
  }
}

void store_value(void* p, DType dtype, float v) {
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(p, &v, 4);
      return;
    case DType::kBFloat16:
    case DType::kFloat16: {
      const uint16_t u = dtype == DType::kBFloat16 ? float_to_bf16(v) : float_to_fp16(v);
      std::memcpy(p, &u, 2);
      return;
    }
    default:
      *static_cast<uint8_t*>(p) = float_to_fp8(v, dtype);
  }
}

float round_to(float v, DType dtype) {
  uint8_t buf[4];
  store_value(buf, dtype, v);
  return load_value(buf, dtype);
}

// ---- cache addressing --------------------------------------------------------------------------
int64_t cache_latent_offset_bytes(const KVCacheView& c, int64_t slot) {
  return (slot / c.block_size) * c.stride_block_bytes +
         (slot % c.block_size) * c.stride_token_bytes;
}

int64_t cache_rope_offset_bytes(const KVCacheView& c, int64_t slot) {
  if (c.is_split()) {
    return (slot / c.block_size) * c.stride_rope_block_bytes +
           (slot % c.block_size) * c.stride_rope_token_bytes;
  }
  return cache_latent_offset_bytes(c, slot) + cache_latent_bytes(c);
}

int64_t cache_latent_bytes(const KVCacheView& c) {
  if (is_ds_mla(c)) return kDsMlaLatentDim + 4 * kDsMlaNumTiles;
  return c.kv_lora_rank * static_cast<int64_t>(elem_size(latent_dtype(c.format)));
}

int64_t cache_rope_bytes(const KVCacheView& c) {
  return c.rope_dim * static_cast<int64_t>(elem_size(rope_dtype(c.format)));
}

// ---- ops ---------------------------------------------------------------------------------------
void mla_rope_cache(const MlaRopeCacheParams& p, int32_t* error_counts) {
  const int64_t T = p.num_tokens;
  const int64_t L = p.kv_cache.kv_lora_rank;
  const int64_t R = p.kv_cache.rope_dim;
  const DType model = p.kv_c.dtype;
  // With T = 0 nothing is read, a device Td included (ops.h): nothing to count.
  if (T == 0) return;
  int64_t Td = p.num_decode_tokens;
  if (p.num_decode_tokens_device) {
    Td = *p.num_decode_tokens_device;
    if (Td < 0 || Td > T) {
      count(error_counts, kBadDecodeCount);
      Td = std::min<int64_t>(std::max<int64_t>(Td, 0), T);
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    const CosSin cs =
        table_row(p.cos_sin_cache, clamped_position(p.positions, p.cos_sin_cache, t, error_counts));

    // K side.
    std::vector<float> latent = load_row(p.kv_c, t, 0, 0, L);
    if (p.kv_norm_weight.present()) latent = rms_normalize(latent, p.kv_norm_weight, p.kv_norm_eps);
    latent = rounded(latent, model);
    const std::vector<float> k_rot =
        rounded(rope(load_row(p.k_pe, t, 0, 0, R), cs, p.rope_style), model);
    write_k_side(p.kv_cache, p.slot_mapping, t, latent, k_rot, error_counts);
    if (p.k_pe_out.present()) store_row(p.k_pe_out, t, 0, 0, k_rot);
    if (p.kv_c_out.present()) store_row(p.kv_c_out, t, 0, 0, latent);

    // Q side.
    const int64_t H = t < Td ? p.q_pe.shape[1] : p.q.present() ? p.q.shape[1] : 0;
    for (int64_t h = 0; h < H; ++h) {
      if (t < Td && p.q_out.present()) {
        const std::vector<float> q_rot =
            rounded(rope(load_row(p.q_pe, t, h, 0, R), cs, p.rope_style), model);
        const bool copy_nope = p.ql_nope.present() && p.ql_nope.data != p.q_out.data;
        if (copy_nope) store_row(p.q_out, t, h, 0, load_row(p.ql_nope, t, h, 0, L), p.q_scale);
        store_row(p.q_out, t, h, L, q_rot, p.q_scale);
      } else if (t >= Td && p.q.present()) {
        const int64_t P = p.q.shape[2] - R;
        const std::vector<float> q_rot =
            rounded(rope(load_row(p.q, t, h, P, R), cs, p.rope_style), model);
        if (p.q_prefill_out.present()) {
          store_row(p.q_prefill_out, t, h, 0, load_row(p.q, t, h, 0, P));
          store_row(p.q_prefill_out, t, h, P, q_rot);
        } else {
          store_row(p.q, t, h, P, q_rot);
        }
      }
    }
  }
}

void rotary_embedding(const RotaryEmbeddingParams& p, int32_t* error_counts) {
  const int64_t rot_dim = p.cos_sin_cache.shape[1];
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const CosSin cs =
        table_row(p.cos_sin_cache, clamped_position(p.positions, p.cos_sin_cache, t, error_counts));
    for (const TensorView* v : {&p.query, &p.key}) {
      if (!v->present()) continue;
      for (int64_t h = 0; h < v->shape[1]; ++h) {
        store_row(*v, t, h, 0, rope(load_row(*v, t, h, 0, rot_dim), cs, p.rope_style));
      }
    }
  }
}

void concat_and_cache_mla(const ConcatAndCacheMlaParams& p, int32_t* error_counts) {
  const int64_t L = p.kv_cache.kv_lora_rank;
  const int64_t R = p.kv_cache.rope_dim;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    write_k_side(p.kv_cache, p.slot_mapping, t, load_row(p.kv_c, t, 0, 0, L),
                 load_row(p.k_pe, t, 0, 0, R), error_counts);
  }
}

void decode_q_concat(const DecodeQConcatParams& p) {
  const int64_t L = p.ql_nope.shape[2];
  const int64_t R = p.q_pe.shape[2];
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    for (int64_t h = 0; h < p.q_pe.shape[1]; ++h) {
      store_row(p.q_out, t, h, 0, load_row(p.ql_nope, t, h, 0, L), p.q_scale);
      store_row(p.q_out, t, h, L, load_row(p.q_pe, t, h, 0, R), p.q_scale);
    }
  }
}

void rms_norm(const RmsNormParams& p) {
  const int64_t N = p.input.shape[1];
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    store_row(p.output, t, 0, 0, rms_normalize(load_row(p.input, t, 0, 0, N), p.weight, p.eps));
  }
}

void rmsnorm_quant(const RmsNormQuantParams& p) {
  const int64_t N = p.input.shape[1];
  const DType model = p.input.dtype;
  const Fp8GroupQuantOutput& q = p.quant;
  constexpr float kE4M3Max = 448.0f;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    std::vector<float> s = load_row(p.input, t, 0, 0, N);
    if (p.residual.present()) {
      const std::vector<float> r = load_row(p.residual, t, 0, 0, N);
      for (int64_t i = 0; i < N; ++i) s[i] = round_to(s[i] + r[i], model);
      store_row(p.residual, t, 0, 0, s);
    }
    // Without a weight: quantization only (per_token_group_quant_fp8), of the model values.
    const std::vector<float> y =
        p.weight.present() ? rounded(rms_normalize(s, p.weight, p.eps), model) : s;
    if (p.normed_out.present()) store_row(p.normed_out, t, 0, 0, y);
    if (!q.values.present()) continue;
    for (int64_t g = 0; g < N / q.group_size; ++g) {
      float amax = 0.0f;
      for (int64_t i = g * q.group_size; i < (g + 1) * q.group_size; ++i) {
        if (std::fabs(y[i]) > amax) amax = std::fabs(y[i]);  // a NaN never compares greater
      }
      float scale = amax / kE4M3Max;
      if (!(scale >= q.scale_floor)) scale = q.scale_floor;
      if (q.pow2_scale && std::isfinite(scale)) {
        int e = 0;
        const float m = std::frexp(scale, &e);  // scale = m * 2^e, m in [0.5, 1)
        scale = std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
      }
      std::memcpy(at(q.scales, t, g), &scale, sizeof(float));
      for (int64_t i = g * q.group_size; i < (g + 1) * q.group_size; ++i) {
        *static_cast<uint8_t*>(at(q.values, t, i)) = float_to_fp8(y[i] / scale, DType::kFloat8E4M3);
      }
    }
  }
}

void gather_cache_slots(const GatherCacheSlotsParams& p, int32_t* error_counts) {
  const int64_t D = p.kv_cache.kv_lora_rank + p.kv_cache.rope_dim;
  for (int64_t i = 0; i < p.num_tokens; ++i) {
    const int64_t slot = load_index(p.slots, i);
    std::vector<float> row(static_cast<size_t>(D), 0.0f);
    if (slot >= p.kv_cache.num_slots()) count(error_counts, kBadSlot);
    if (slot >= 0 && slot < p.kv_cache.num_slots()) row = read_entry(p.kv_cache, slot);
    store_row(p.out, i, 0, 0, row);
  }
}

void gather_cache_sequences(const GatherCacheSequencesParams& p, int32_t* error_counts) {
  const int64_t D = p.kv_cache.kv_lora_rank + p.kv_cache.rope_dim;
  const int64_t bs = p.kv_cache.block_size;
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    const int64_t begin = load_index(p.cu_seq_lens, b);
    const int64_t end = load_index(p.cu_seq_lens, b + 1);
    if (begin < 0) continue;  // outside the contract: skipped whole (ops.h)
    for (int64_t i = 0; i < end - begin; ++i) {
      const int64_t row_index = begin + i;
      if (row_index >= p.out.shape[0]) break;
      // A token past its block-table row has no block: a bad id, never the next row's entry.
      const int64_t block = i / bs < p.block_table.shape[1]
                                ? *static_cast<const int32_t*>(at(p.block_table, b, i / bs))
                                : -1;
      std::vector<float> row(static_cast<size_t>(D), 0.0f);
      if (block < 0 || block >= p.kv_cache.num_blocks) {
        count(error_counts, kBadBlockIndex);
      } else {
        row = read_entry(p.kv_cache, block * bs + i % bs);
      }
      store_row(p.out, row_index, 0, 0, row);
    }
  }
}

}  // namespace ref
}  // namespace mlakv
