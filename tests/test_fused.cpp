// mlakv tests: the fused op against the reference, over named model configs, cache formats, model
// dtypes, block sizes, RoPE styles, optional outputs, q_out variants and entry points.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fused_problem.h"

namespace mlakv {
namespace test {
namespace {

struct FormatCase {
  const char* name;
  CacheFormat format;
  float scale;
  bool pow2;
};
const FormatCase kFormats[] = {
    {"bf16", CacheFormat::kBFloat16, 0.0f, false},
    {"fp16", CacheFormat::kFloat16, 0.0f, false},
    {"fp32", CacheFormat::kFloat32, 0.0f, false},
    {"e4m3", CacheFormat::kFloat8E4M3, 0.037f, false},
    {"e4m3noscale", CacheFormat::kFloat8E4M3, 0.0f, false},
    {"e5m2", CacheFormat::kFloat8E5M2, 0.037f, false},
    {"dsmla", CacheFormat::kFloat8DsMla, 0.0f, false},
    {"dsmlapow2", CacheFormat::kFloat8DsMla, 0.0f, true},
};

FusedSpec base(const ModelShape& shape, const FormatCase& f, int64_t T, int64_t Td) {
  FusedSpec s;
  s.shape = shape;
  s.T = T;
  s.Td = Td;
  s.cache.format = f.format;
  s.cache.scale = f.scale;
  s.cache.pow2 = f.pow2;
  s.name = std::string(shape.name) + "_" + f.name + "_T" + std::to_string(T) + "_Td" +
           std::to_string(Td);
  return s;
}

bool format_fits(const ModelShape& shape, CacheFormat f) {
  return f != CacheFormat::kFloat8DsMla || (shape.L == 512 && shape.R == 64);
}

// Every named model x every cache format, mixed batch, both optional outputs, RMSNorm on the
// fp8 formats (where the normalized values reach the quantizer) and off on the others.
std::vector<FusedSpec> model_format_specs() {
  std::vector<FusedSpec> out;
  const ModelShape shapes[] = {kDeepSeekV3, kDeepSeekV3Tp8, kKimiK2, kDeepSeekV2Lite, kMiniCpm3};
  uint64_t seed = 100;
  for (const ModelShape& shape : shapes) {
    for (const FormatCase& f : kFormats) {
      if (!format_fits(shape, f.format)) continue;
      const bool big = shape.H >= 64;
      FusedSpec s = base(shape, f, big ? 9 : 33, big ? 4 : 13);
      s.norm = f.format == CacheFormat::kFloat8E4M3 || f.format == CacheFormat::kFloat8DsMla;
      s.k_pe_out = true;
      s.kv_c_out = true;
      s.seed = seed++;
      out.push_back(s);
    }
  }
  return out;
}

// Block sizes 1, 7 (odd), 16, 64, 128 with T = 130 (several pages; block 128 spans two).
std::vector<FusedSpec> block_size_specs() {
  std::vector<FusedSpec> out;
  uint64_t seed = 200;
  for (int64_t bs : {1, 7, 16, 64, 128}) {
    for (const FormatCase& f : {kFormats[0], kFormats[3], kFormats[6]}) {
      FusedSpec s = base(kDeepSeekV3Tp8, f, 130, 50);
      s.name += "_bs" + std::to_string(bs);
      s.cache.block_size = bs;
      s.norm = true;
      s.seed = seed++;
      out.push_back(s);
    }
  }
  return out;
}

// Model dtypes fp16 and fp32 with the formats they pair with; NeoX; bf16 / fp16 tables.
std::vector<FusedSpec> dtype_style_specs() {
  std::vector<FusedSpec> out;
  uint64_t seed = 300;
  for (DType model : {DType::kFloat16, DType::kFloat32}) {
    for (const FormatCase& f : {kFormats[0], kFormats[1], kFormats[2], kFormats[3], kFormats[5]}) {
      for (bool norm : {false, true}) {
        FusedSpec s = base(kDeepSeekV3Tp8, f, 7, 3);
        s.model = model;
        s.norm = norm;
        s.k_pe_out = s.kv_c_out = true;
        s.name += std::string("_") + dtype_name(model) + (norm ? "_norm" : "");
        s.seed = seed++;
        out.push_back(s);
      }
    }
  }
  for (const ModelShape& shape : {kDeepSeekV3Tp8, kMiniCpm3}) {
    for (DType table : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      for (const FormatCase& f : {kFormats[0], kFormats[3]}) {
        // The table's row stride is honoured (DESIGN.md): with the e4m3 cache, every table dtype
        // also gets rows padded by 3 elements (row_pad pads kv_c, k_pe, q and q_out too).
        const bool padded = f.format == CacheFormat::kFloat8E4M3;
        FusedSpec s = base(shape, f, 33, 10);
        s.style = RopeStyle::kNeox;
        s.table_dtype = table;
        s.row_pad = padded ? 3 : 0;
        const std::string pad_name = padded ? "_pad3" : "";
        s.name += std::string("_neox_table_") + dtype_name(table) + pad_name;
        s.seed = seed++;
        out.push_back(s);
        s.style = RopeStyle::kGptJ;
        s.name = base(shape, f, 33, 10).name + "_gptj_table_" + dtype_name(table) + pad_name;
        s.seed = seed++;
        out.push_back(s);
      }
    }
  }
  return out;
}

// Collects specs, each named with a suffix after its base name and seeded from a first seed up.
class SpecAdder {
 public:
  explicit SpecAdder(uint64_t first_seed) : seed_(first_seed) {}
  void operator()(FusedSpec s, const std::string& suffix) {
    s.name += "_" + suffix;
    s.seed = seed_++;
    specs_.push_back(std::move(s));
  }
  std::vector<FusedSpec> specs() && { return std::move(specs_); }

 private:
  uint64_t seed_;
  std::vector<FusedSpec> specs_;
};

// q_out and entry-point variants.
std::vector<FusedSpec> q_side_specs() {
  SpecAdder add(400);
  const FusedSpec b = base(kDeepSeekV3Tp8, kFormats[0], 33, 13);
  {
    FusedSpec s = b;
    s.q_out_dtype = DType::kFloat8E4M3;
    s.q_scale = 0.05f;
    add(s, "qout_e4m3_scaled");
    s.q_scale = 0.0f;
    add(s, "qout_e4m3_noscale");
    s.q_out_dtype = DType::kFloat8E5M2;
    s.q_scale = 0.3f;
    add(s, "qout_e5m2_scaled");
    s.amplitude = 30.0f;
    s.q_out_dtype = DType::kFloat8E4M3;
    s.q_scale = 0.037f;
    s.cache.format = CacheFormat::kFloat8E4M3;
    s.cache.scale = 0.037f;
    add(s, "qout_e4m3_and_cache_saturating");
    // e5m2's largest finite value is 57344: |x| / 1e-4 up to 3e5 saturates (to 0x7b / 0xfb, never
    // inf) in q_out's both parts and in the cache.
    s.q_out_dtype = DType::kFloat8E5M2;
    s.q_scale = 1e-4f;
    s.cache.format = CacheFormat::kFloat8E5M2;
    s.cache.scale = 1e-4f;
    add(s, "qout_e5m2_and_cache_saturating");
  }
  // An fp8 q_out's rope part is rotated and quantized in one pass on the CPU: every model dtype,
  // both pair styles, and rope widths with a fixed-length loop (64, 32) and without (16, in
  // work_split_specs).
  for (const ModelShape& shape : {kDeepSeekV3Tp8, kMiniCpm3}) {
    for (DType model : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      for (RopeStyle style : {RopeStyle::kGptJ, RopeStyle::kNeox}) {
        FusedSpec s = base(shape, kFormats[0], 33, 13);
        s.model = model;
        s.style = style;
        s.q_out_dtype = model == DType::kFloat16 ? DType::kFloat8E5M2 : DType::kFloat8E4M3;
        s.q_scale = 0.05f;
        add(s, std::string("qout_fp8_") + dtype_name(model) +
                   (style == RopeStyle::kNeox ? "_neox" : "_gptj"));
      }
    }
  }
  // Rope widths up to DESIGN.md's largest, R = 256, and R = 128 (a fixed-length loop on the CPU):
  // bf16 and e4m3 q_out, both pair styles, k_pe_out into a poisoned buffer (a value left unrotated
  // or unwritten shows). The e4m3 q_out goes with an e4m3 cache.
  auto add_rope_width = [&](const ModelShape& shape) {
    for (bool fp8 : {false, true}) {
      for (RopeStyle style : {RopeStyle::kGptJ, RopeStyle::kNeox}) {
        FusedSpec s = base(shape, fp8 ? kFormats[3] : kFormats[0], 9, 4);
        s.style = style;
        s.k_pe_out = true;
        if (fp8) {
          s.q_out_dtype = DType::kFloat8E4M3;
          s.q_scale = 0.05f;
        }
        add(s, std::string(fp8 ? "qout_e4m3" : "qout_bf16") +
                   (style == RopeStyle::kNeox ? "_neox" : "_gptj"));
      }
    }
  };
  add_rope_width(ModelShape{"rope128", 4, 256, 128, 64});
  add_rope_width(ModelShape{"rope256", 2, 128, 256, 32});
  {
    // All-zero fp8_ds_mla tiles without a norm: scale FLT_MIN, bytes 0; and tiles of tiny values
    // (amax / 448 under FLT_MIN): scale FLT_MIN, bytes not 0.
    FusedSpec s = base(kDeepSeekV3Tp8, kFormats[6], 33, 13);
    s.zero_tiles = 5;
    s.tiny_tiles = 5;
    s.k_pe_out = s.kv_c_out = true;
    add(s, "zero_tiles");
  }
  {
    FusedSpec s = b;
    s.nope = Nope::kAbsent;
    add(s, "nope_absent");
    s.nope = Nope::kAliased;
    add(s, "nope_aliased");
    s.model = DType::kFloat16;
    add(s, "nope_aliased_fp16");
  }
  {
    FusedSpec s = b;
    s.prefill_out = true;
    add(s, "prefill_out");
    s.prefill_out = false;
    // No q_out: the decode rows get their K side only. The validator accepts that with a device
    // Td (or a host Td of 0), not with a host Td > 0.
    s.decode_q = false;
    s.device_td = true;
    s.device_td_value = 13;
    add(s, "no_decode_q_device_td");
    s.device_td = false;
    s.decode_q = true;
    s.prefill_q = false;
    add(s, "no_prefill_q");
    s.decode_q = false;
    s.Td = 0;
    add(s, "k_side_only");
    // Both Q sides' buffers given with no rows for one of them (docs/decisions.md): accepted,
    // and that side's buffer is left as it was (the reference writes nothing there).
    s.decode_q = s.prefill_q = true;
    add(s, "q_out_without_decode_rows");
    s.Td = s.T;
    add(s, "q_without_prefill_rows");
  }
  {
    FusedSpec s = b;
    s.k_pe_out = s.kv_c_out = true;
    s.outs_in_place = true;
    add(s, "outs_in_place");
    s.norm = true;
    add(s, "outs_in_place_norm");
    s.cache.format = CacheFormat::kFloat8DsMla;
    add(s, "outs_in_place_norm_dsmla");
  }
  for (Entry e : {Entry::kDecode, Entry::kPrefill, Entry::kMixed}) {
    for (const FormatCase& f : {kFormats[0], kFormats[6]}) {
      FusedSpec s = base(kDeepSeekV3Tp8, f, 33, 13);
      s.entry = e;
      s.decode_q = e != Entry::kPrefill;
      s.prefill_q = e != Entry::kDecode;
      s.prefill_out = e == Entry::kPrefill;
      s.k_pe_out = true;
      add(s, e == Entry::kDecode    ? "entry_decode"
             : e == Entry::kPrefill ? "entry_prefill"
                                    : "entry_mixed");
    }
  }
  for (int64_t Td : {0, 1, 32, 33}) {
    FusedSpec s = base(kDeepSeekV3Tp8, kFormats[0], 33, Td);
    add(s, "host_td");
  }
  for (int64_t T : {1, 2}) {
    FusedSpec s = base(kDeepSeekV3, kFormats[6], T, T == 1 ? 1 : 0);
    s.norm = true;
    add(s, "tiny");
  }
  {
    // q_out past the CPU backend's streaming-store threshold (4 MB: 30 decode tokens of H 128,
    // bf16): aligned rows, then rows padded by 3 elements (unaligned vector heads and tails), and
    // mixed with prefill rows.
    FusedSpec s = base(kDeepSeekV3, kFormats[0], 36, 36);
    s.entry = Entry::kDecode;
    s.prefill_q = false;
    s.norm = true;
    add(s, "large_decode");
    s.row_pad = 3;
    add(s, "large_decode_padded");
    FusedSpec m = base(kDeepSeekV3, kFormats[0], 40, 36);
    m.norm = true;
    m.row_pad = 3;
    add(m, "large_mixed_padded");
  }
  // More rope widths (last, so the cases above keep their seeds). On CUDA: R = 48 and 96 are
  // multiples of 8 whose R / 8 does not divide a warp's 32 lanes (element-wise rope items, even
  // for GPT-J), and R = 128 with 16 heads has more heads than one element-wise rope item takes
  // (8 / ceil(R / 64) = 4).
  add_rope_width(ModelShape{"rope128h16", 16, 256, 128, 64});
  add_rope_width(ModelShape{"rope48", 8, 256, 48, 64});
  add_rope_width(ModelShape{"rope96", 6, 256, 96, 64});
  {
    // The floor of power-of-two tile scales (FLT_MIN is one): zero and tiny tiles.
    FusedSpec s = base(kDeepSeekV3Tp8, kFormats[7], 33, 13);
    s.zero_tiles = 5;
    s.tiny_tiles = 5;
    add(s, "zero_tiles_pow2");
  }
  for (const ModelShape& shape : {kDeepSeekV3, kMiniCpm3}) {
    // A separate prefill output past the CPU backend's first chunk of 32 heads.
    FusedSpec s = base(shape, kFormats[0], 9, 4);
    s.prefill_out = true;
    add(s, "prefill_out");
  }
  for (float eps : {0.5f, 0.0f}) {
    // The RMSNorm's eps reaches the op: 0.5 is of the order of the rows' mean square (amplitude
    // 2: about 1.3), 0 leaves it out.
    FusedSpec s = base(kDeepSeekV3Tp8, kFormats[0], 9, 4);
    s.norm = true;
    s.kv_norm_eps = eps;
    add(s, eps == 0.0f ? "norm_eps0" : "norm_eps_half");
  }
  return std::move(add).specs();
}

// Shapes that reach every branch of the CUDA kernel's work split (mla_rope_cache.h CopyList): rows
// of fewer than 32 chunks and of chunk counts that do not divide 32 (a lane's chunks then wrap
// across rows and, with H = 3, across tokens), rope items with fewer heads than a slot holds, rows
// longer than one item (P = 4400: 550 chunks, several segments per row), each through the vector
// path and through the element-wise one (rows padded by 3 elements), with a host and a device Td;
// and RMSNorm on both rows.
std::vector<FusedSpec> work_split_specs() {
  std::vector<FusedSpec> out;
  uint64_t seed = 500;
  constexpr ModelShape kOdd{"odd", 3, 208, 16, 40};
  constexpr ModelShape kWide{"wide", 2, 1024, 64, 4400};
  for (const ModelShape& shape : {kOdd, kWide}) {
    for (DType model : {DType::kBFloat16, DType::kFloat32}) {
      for (int64_t pad : {0, 3}) {
        for (bool device_td : {false, true}) {
          FusedSpec s = base(shape, kFormats[0], shape.H > 2 ? 33 : 7, shape.H > 2 ? 13 : 3);
          s.model = model;
          s.row_pad = pad;
          s.prefill_out = true;
          s.device_td = device_td;
          s.device_td_value = static_cast<int32_t>(s.Td);
          s.name += std::string("_") + dtype_name(model) + "_pad" + std::to_string(pad) +
                    (device_td ? "_devtd" : "");
          s.seed = seed++;
          out.push_back(s);
        }
      }
    }
    FusedSpec s = base(shape, kFormats[3], shape.H > 2 ? 33 : 7, shape.H > 2 ? 13 : 3);
    s.q_out_dtype = DType::kFloat8E4M3;
    s.q_scale = 0.05f;
    s.prefill_out = true;
    s.name += "_qout_e4m3";
    s.seed = seed++;
    out.push_back(s);
    // RMSNorm on these latent rows: L = 208 is not a power of two (the sum's tree padded with +0,
    // a mean whose division by L is not exact), L = 1024 the widest.
    for (DType model : {DType::kBFloat16, DType::kFloat32}) {
      FusedSpec n = base(shape, kFormats[0], shape.H > 2 ? 33 : 7, shape.H > 2 ? 13 : 3);
      n.model = model;
      n.norm = true;
      n.kv_c_out = true;
      n.name += std::string("_") + dtype_name(model) + "_norm";
      n.seed = seed++;
      out.push_back(n);
    }
  }
  return out;
}

// Large launches, for two choices of the CUDA launcher (src/cuda/mla_rope_cache.h):
// - from 1280 tokens (kKTableFirstMinTokens) the K items request their position and cos/sin
//   before their rows (the 16-byte path with q_out of the model dtype or none): mixed batches with
//   RMSNorm over the cache formats, padding tokens and bad positions (counted once per token in
//   either order), decode only at exactly the threshold, a device Td, an fp16 model; and an e4m3
//   q_out, which keeps the rows-first order at every T;
// - from 512 decode tokens (kRopeInCopyMinTokens) the decode copy items also write the rows' rope
//   parts (see below).
std::vector<FusedSpec> large_launch_specs() {
  SpecAdder add(600);
  for (const FormatCase& f : {kFormats[0], kFormats[3], kFormats[6]}) {
    FusedSpec s = base(kDeepSeekV3H2, f, 2050, 1000);
    s.norm = true;
    s.k_pe_out = s.kv_c_out = true;
    s.padding_every = 7;
    s.bad_positions = 3;
    add(s, "large");
  }
  FusedSpec s = base(kDeepSeekV3H2, kFormats[0], 1280, 1280);
  s.entry = Entry::kDecode;
  s.prefill_q = false;
  add(s, "large_decode");
  // The decode rows' rope parts in the copy items (CUDA: from 512 decode tokens, q_out of the
  // model dtype): 1 row an item (large_decode), 4 (large_tp8, q_pe in a head-major buffer), one
  // of a row's two segments (large_seg, fp16), fp32 rows (large_fp32), the decode side of a device
  // Td (large_devtd), a mixed batch (large); with 3 heads, items of 2 rows across tokens with a
  // bf16 table and bad positions on decode tokens (large_h3), and across a device Td's odd split
  // (large_h3_devtd).
  s = base(kDeepSeekV3Tp8, kFormats[0], 520, 520);
  s.entry = Entry::kDecode;
  s.prefill_q = false;
  s.q_pe_head_major = true;
  add(s, "large_tp8");
  s = base(kDeepSeekV3H2, kFormats[0], 600, 600);
  s.entry = Entry::kDecode;
  s.prefill_q = false;
  s.model = DType::kFloat16;
  add(s, "large_seg");
  s.model = DType::kFloat32;
  add(s, "large_fp32");
  s = base(kDeepSeekV3H3, kFormats[0], 1100, 1100);
  s.entry = Entry::kDecode;
  s.prefill_q = false;
  s.table_dtype = DType::kBFloat16;
  s.bad_positions = 3;
  add(s, "large_h3");
  s = base(kDeepSeekV3H3, kFormats[0], 1101, 777);
  s.device_td = true;
  s.device_td_value = 777;
  add(s, "large_h3_devtd");
  s = base(kDeepSeekV3H2, kFormats[0], 2049, 700);
  s.device_td = true;
  s.device_td_value = 700;
  s.prefill_out = true;
  add(s, "large_devtd");
  s = base(kDeepSeekV3H2, kFormats[1], 2049, 300);
  s.model = DType::kFloat16;
  s.norm = true;
  add(s, "large_fp16");
  s = base(kDeepSeekV3H2, kFormats[3], 2049, 2049);
  s.q_out_dtype = DType::kFloat8E4M3;
  s.q_scale = 0.05f;
  s.norm = true;
  add(s, "large_qout_e4m3");
  return std::move(add).specs();
}

// K items of two tokens (CUDA: from kKTwoTokensMinTokens = 1792 tokens, in the table-first order
// with a 16-bit model, L <= 512 and R <= 128): T odd and even (the last item's second token past
// the launch or not), bad slots and bad positions on an item's first token and on its second,
// padding, every optional output, RMSNorm into the bf16, e4m3 and fp8_ds_mla caches, tensors of
// exactly T rows; NeoX and GPT-J (outputs in place) at R = 128, two pairs a lane; L = 208 with
// R = 16 (a lane's second chunk past the row on most lanes, 24 of 32 lanes without a pair) with
// int32 indices and a bf16 table; L = 256 with R = 32, an fp16 model and an e5m2 cache; a device
// Td with q_prefill_out; a decode launch (the copy items' rope instance); and shapes and types
// that keep one token: L = 1024, R = 136, an e4m3 q_out.
std::vector<FusedSpec> two_token_k_specs() {
  SpecAdder add(700);
  // kKTwoTokensMinTokens (cuda/mla_rope_cache.h), which test_cuda_kernel_choice.cu asserts.
  constexpr int64_t kMin = 1792;
  constexpr ModelShape kR128{"l512r128", 2, 512, 128, 128};
  constexpr ModelShape kL208{"l208r16", 2, 208, 16, 64};
  constexpr ModelShape kL256{"l256r32", 2, 256, 32, 64};
  constexpr ModelShape kL1024{"l1024", 2, 1024, 64, 128};
  constexpr ModelShape kR136{"l512r136", 2, 512, 136, 128};
  for (const FormatCase& f : {kFormats[0], kFormats[3], kFormats[6]}) {
    for (const int64_t T : {kMin, kMin + 3}) {
      FusedSpec s = base(kDeepSeekV3H2, f, T, 700);
      s.norm = true;
      s.k_pe_out = s.kv_c_out = true;
      s.padding_every = 5;
      s.bad_slots = 3;
      s.bad_slot_start = T % 2 == 0 ? 0 : 1;  // first tokens at T = kMin, second at kMin + 3
      s.bad_positions = 3;  // from T - 1: second tokens at T = kMin, first at kMin + 3
      s.zero_tiles = f.format == CacheFormat::kFloat8DsMla ? 5 : 0;
      add(s, "twotok");
    }
  }
  FusedSpec s = base(kR128, kFormats[0], kMin + 1, 900);
  s.style = RopeStyle::kNeox;
  s.k_pe_out = true;
  s.bad_positions = 2;
  add(s, "twotok_neox");
  s.style = RopeStyle::kGptJ;
  s.outs_in_place = s.kv_c_out = true;
  s.norm = true;
  add(s, "twotok_inplace");
  s = base(kL208, kFormats[0], kMin + 2, 500);
  s.norm = true;
  s.kv_c_out = s.k_pe_out = true;
  s.index32 = true;
  s.table_dtype = DType::kBFloat16;
  s.bad_slots = 1;
  s.bad_slot_start = kMin;  // the first token of the last item, whose second is T - 1
  add(s, "twotok_l208");
  // Tensors of exactly T rows: the item past the last token reads nothing (under memcheck).
  s = base(kDeepSeekV3H2, kFormats[0], kMin + 1, 900);
  s.extra_rows = 0;
  s.k_pe_out = s.kv_c_out = true;
  s.norm = true;
  add(s, "twotok_exact_rows");
  s = base(kL256, kFormats[5], kMin + 3, kMin + 3);
  s.model = DType::kFloat16;
  s.norm = true;
  s.kv_c_out = true;
  add(s, "twotok_fp16");
  s = base(kDeepSeekV3H2, kFormats[7], kMin + 1, 617);
  s.device_td = true;
  s.device_td_value = 617;
  s.prefill_out = true;
  s.norm = true;
  add(s, "twotok_devtd");
  s = base(kDeepSeekV3H2, kFormats[0], kMin, kMin);
  s.entry = Entry::kDecode;
  s.prefill_q = false;
  s.bad_positions = 1;
  add(s, "twotok_decode");
  for (const ModelShape& one : {kL1024, kR136}) {
    s = base(one, kFormats[0], kMin + 1, 100);
    s.norm = true;
    s.k_pe_out = true;
    add(s, "onetok");
  }
  s = base(kDeepSeekV3H2, kFormats[3], kMin + 1, kMin + 1);
  s.q_out_dtype = DType::kFloat8E4M3;
  s.q_scale = 0.05f;
  s.norm = true;
  add(s, "onetok_qout_e4m3");
  return std::move(add).specs();
}

using Param = std::tuple<Backend, FusedSpec>;

class FusedOp : public testing::TestWithParam<Param> {};

TEST_P(FusedOp, MatchesReference) {
  run_fused_case(std::get<1>(GetParam()), std::get<0>(GetParam()).device);
}

std::string param_name(const testing::TestParamInfo<Param>& info) {
  return std::get<0>(info.param).name + "_" + std::get<1>(info.param).name;
}

INSTANTIATE_TEST_SUITE_P(Models, FusedOp,
                         testing::Combine(testing::ValuesIn(all_backends()),
                                          testing::ValuesIn(model_format_specs())),
                         param_name);
INSTANTIATE_TEST_SUITE_P(BlockSizes, FusedOp,
                         testing::Combine(testing::ValuesIn(all_backends()),
                                          testing::ValuesIn(block_size_specs())),
                         param_name);
INSTANTIATE_TEST_SUITE_P(DtypesStyles, FusedOp,
                         testing::Combine(testing::ValuesIn(all_backends()),
                                          testing::ValuesIn(dtype_style_specs())),
                         param_name);
INSTANTIATE_TEST_SUITE_P(WorkSplit, FusedOp,
                         testing::Combine(testing::ValuesIn(all_backends()),
                                          testing::ValuesIn(work_split_specs())),
                         param_name);
INSTANTIATE_TEST_SUITE_P(QSide, FusedOp,
                         testing::Combine(testing::ValuesIn(all_backends()),
                                          testing::ValuesIn(q_side_specs())),
                         param_name);
INSTANTIATE_TEST_SUITE_P(LargeLaunch, FusedOp,
                         testing::Combine(testing::ValuesIn(all_backends()),
                                          testing::ValuesIn(large_launch_specs())),
                         param_name);
INSTANTIATE_TEST_SUITE_P(TwoTokenK, FusedOp,
                         testing::Combine(testing::ValuesIn(all_backends()),
                                          testing::ValuesIn(two_token_k_specs())),
                         param_name);

}  // namespace
}  // namespace test
}  // namespace mlakv
