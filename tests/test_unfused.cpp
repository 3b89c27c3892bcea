// mlakv tests: the unfused primitives (rotary_embedding, concat_and_cache_mla, decode_q_concat,
// rms_norm) against the reference, and "fused == unfused sequence" byte for byte on each backend
// (DESIGN.md: switching MLAKV_FUSED never changes a result).
#include <gtest/gtest.h>

#include <cfloat>
#include <cstring>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "core/validate.h"
#include "fused_problem.h"
#include "reference/reference.h"

namespace mlakv {
namespace test {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

Tensor cos_sin_table(Device dev, DType dtype, int64_t max_pos, int64_t rot_dim,
                     std::mt19937_64& rng) {
  Tensor t = new_tensor(dev, dtype, {max_pos, rot_dim});
  std::uniform_real_distribution<double> angle(-3.2, 3.2);
  for (int64_t p = 0; p < max_pos; ++p) {
    for (int64_t i = 0; i < rot_dim / 2; ++i) {
      const double a = angle(rng);
      ref::store_value(t.buffer->host.data() + t.byte_offset({p, i}), dtype,
                       static_cast<float>(std::cos(a)));
      ref::store_value(t.buffer->host.data() + t.byte_offset({p, rot_dim / 2 + i}), dtype,
                       static_cast<float>(std::sin(a)));
    }
  }
  return t;
}

void upload_all(std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors) {
    if (t->present()) t->buffer->upload();
  }
}

// Unused elements after every row and every head of a tensor (padded_heads): the gaps of an input
// hold random values that must not be read, those of an output poison that must stay.
struct Pad {
  int64_t row = 0, head = 0;
};

// ---- rotary_embedding --------------------------------------------------------------------------
struct RotaryCase {
  std::string name;
  int64_t T, Hq, Hk, head_size, rot_dim;
  DType model;
  DType table;
  RopeStyle style;
  int64_t bad_positions;
  Pad q_pad{}, k_pad{};
};

class RotaryEmbedding : public testing::TestWithParam<std::tuple<Backend, RotaryCase>> {};

TEST_P(RotaryEmbedding, MatchesReference) {
  const Device dev = std::get<0>(GetParam()).device;
  const RotaryCase& c = std::get<1>(GetParam());
  std::mt19937_64 rng(c.T * 31 + c.head_size);
  const int64_t rows = c.T + 3, max_pos = 257;
  std::vector<int64_t> pos(static_cast<size_t>(rows));
  for (int64_t t = 0; t < rows; ++t) pos[t] = (t * 37) % max_pos;
  for (int64_t k = 0; k < c.bad_positions; ++k) pos[2 * k] = k % 2 ? -1 - k : max_pos + k;
  for (int64_t t = c.T; t < rows; ++t) pos[t] = max_pos + 100;  // rows >= T: never read
  Tensor positions = index_tensor(dev, DType::kInt64, pos);
  Tensor table = cos_sin_table(dev, c.table, max_pos, c.rot_dim, rng);
  Tensor query = randomized(
      padded_heads(dev, c.model, rows, c.Hq, c.head_size, c.q_pad.row, c.q_pad.head), rng);
  Tensor key;
  if (c.Hk > 0) {
    key = randomized(padded_heads(dev, c.model, rows, c.Hk, c.head_size, c.k_pad.row, c.k_pad.head),
                     rng);
  }
  ErrorCounts counts(dev);
  upload_all({&positions, &table, &query, &key});

  RotaryEmbeddingParams host, device;
  fill_host_and_device(host, device, [&](auto* p, auto v) {
    p->num_tokens = c.T;
    p->positions = v(positions);
    p->query = v(query);
    p->key = v(key);
    p->cos_sin_cache = v(table);
    p->rope_style = c.style;
  });
  std::vector<int32_t> expected(kNumErrorCounters, 0);
  ref::rotary_embedding(host, expected.data());
  Context ctx;
  ctx.error_counts = counts.device_ptr();
  rotary_embedding(device, ctx);
  EXPECT_EQ(counts_to_string(counts.read()), counts_to_string(expected));
  EXPECT_EQ(expected[kBadPosition], c.bad_positions);
  EXPECT_TRUE(buffer_matches(*query.buffer, "query"));
  if (key.present()) {
    EXPECT_TRUE(buffer_matches(*key.buffer, "key"));
  }
  EXPECT_TRUE(buffer_unchanged(*positions.buffer, "positions"));
  EXPECT_TRUE(buffer_unchanged(*table.buffer, "cos_sin_cache"));
}

std::vector<RotaryCase> rotary_cases() {
  return {
      {"q_only_gptj_bf16", 7, 16, 0, 64, 64, DType::kBFloat16, DType::kFloat32, RopeStyle::kGptJ,
       0},
      {"qk_neox_bf16_partial", 33, 8, 2, 128, 64, DType::kBFloat16, DType::kFloat32,
       RopeStyle::kNeox, 3},
      {"qk_gptj_fp16_partial_bf16table", 33, 4, 1, 192, 64, DType::kFloat16, DType::kBFloat16,
       RopeStyle::kGptJ, 0},
      {"qk_neox_fp32_fp16table", 9, 3, 3, 96, 32, DType::kFloat32, DType::kFloat16,
       RopeStyle::kNeox, 2},
      {"t1", 1, 128, 1, 64, 64, DType::kBFloat16, DType::kFloat32, RopeStyle::kGptJ, 0},
      // rot_dim 128 (a fixed-length loop on the CPU) and DESIGN.md's largest, 256.
      {"qk_gptj_bf16_rot128", 5, 4, 1, 128, 128, DType::kBFloat16, DType::kFloat32,
       RopeStyle::kGptJ, 0},
      {"qk_neox_fp16_partial_rot128_bf16table", 5, 2, 2, 192, 128, DType::kFloat16,
       DType::kBFloat16, RopeStyle::kNeox, 1},
      {"qk_neox_bf16_rot256", 5, 2, 1, 256, 256, DType::kBFloat16, DType::kFloat32,
       RopeStyle::kNeox, 0},
      {"q_only_gptj_fp32_rot256_fp16table", 3, 2, 0, 256, 256, DType::kFloat32, DType::kFloat16,
       RopeStyle::kGptJ, 0},
      // More heads than one CUDA item takes at rot_dim 128 (8 / ceil(64 / 32) = 4), for both.
      {"qk_neox_bf16_rot128_many_heads", 5, 16, 6, 128, 128, DType::kBFloat16, DType::kFloat32,
       RopeStyle::kNeox, 0},
      // Every row and head padded, the query's and the key's differently.
      {"qk_gptj_bf16_padded_heads",
       5,
       4,
       2,
       96,
       64,
       DType::kBFloat16,
       DType::kFloat32,
       RopeStyle::kGptJ,
       0,
       {3, 8},
       {5, 24}},
      {"qk_neox_bf16_padded_heads",
       5,
       4,
       2,
       96,
       64,
       DType::kBFloat16,
       DType::kFloat32,
       RopeStyle::kNeox,
       1,
       {3, 8},
       {5, 24}},
  };
}

// ---- concat_and_cache_mla ----------------------------------------------------------------------
struct ConcatCase {
  std::string name;
  CacheFormat format;
  float scale;
  bool pow2;
  bool split;
  DType model;
  int64_t L, R, block_size;
};

class ConcatAndCacheMla : public testing::TestWithParam<std::tuple<Backend, ConcatCase>> {};

TEST_P(ConcatAndCacheMla, MatchesReference) {
  const Device dev = std::get<0>(GetParam()).device;
  const ConcatCase& c = std::get<1>(GetParam());
  std::mt19937_64 rng(static_cast<uint64_t>(c.format) * 7 + c.block_size);
  const int64_t T = 40, rows = T + 2;
  CacheGeometry g;
  g.format = c.format;
  g.L = c.L;
  g.R = c.R;
  g.block_size = c.block_size;
  g.num_blocks = ceil_div(rows, c.block_size) + 2;
  g.split = c.split;
  g.scale = c.scale;
  g.pow2 = c.pow2;
  TestCache cache = new_cache(dev, g);
  std::vector<int64_t> perm(static_cast<size_t>(cache.num_slots()));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int64_t> slots(perm.begin(), perm.begin() + rows);
  slots[3] = -1;                        // padding
  slots[8] = cache.num_slots();         // past the end: skipped, counted
  slots[11] = cache.num_slots() + 999;  // likewise
  Tensor slot_mapping = index_tensor(dev, DType::kInt32, slots);
  Tensor kv_c = random_tensor(dev, c.model, {rows, c.L}, rng);
  Tensor k_pe = random_tensor(dev, c.model, {rows, c.R}, rng);
  if (c.format == CacheFormat::kFloat8DsMla) {
    // All-zero tiles (fill_random never makes a 0): tokens 0, 5 and 17 get tiles 1, 0 and 3 set
    // to 0. Their scale is the floor FLT_MIN and their bytes 0 (DESIGN.md).
    for (auto [t, tile] : {std::pair<int64_t, int64_t>{0, 1}, {5, 0}, {17, 3}}) {
      for (int64_t i = 0; i < kDsMlaTileElems; ++i) {
        ref::store_value(
            kv_c.buffer->host.data() + kv_c.byte_offset({t, tile * kDsMlaTileElems + i}), c.model,
            0.0f);
      }
    }
  }
  ErrorCounts counts(dev);
  upload_all({&slot_mapping, &kv_c, &k_pe, &cache.scale});
  cache.data->upload();
  if (cache.rope_data) cache.rope_data->upload();

  ConcatAndCacheMlaParams host, device;
  fill_host_and_device(host, device, [&](auto* p, auto v) {
    p->num_tokens = T;
    p->kv_c = v(kv_c);
    p->k_pe = v(k_pe);
    p->slot_mapping = v(slot_mapping);
    p->kv_cache = v(cache);
  });
  std::vector<int32_t> expected(kNumErrorCounters, 0);
  ref::concat_and_cache_mla(host, expected.data());
  Context ctx;
  ctx.error_counts = counts.device_ptr();
  concat_and_cache_mla(device, ctx);
  EXPECT_EQ(expected[kBadSlot], 2);
  EXPECT_EQ(counts_to_string(counts.read()), counts_to_string(expected));
  std::vector<int64_t> written;
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] >= 0 && slots[t] < cache.num_slots()) written.push_back(slots[t]);
  }
  expect_cache_matches(cache, written, "kv_cache");
  EXPECT_TRUE(buffer_unchanged(*kv_c.buffer, "kv_c"));
  EXPECT_TRUE(buffer_unchanged(*k_pe.buffer, "k_pe"));
}

std::vector<ConcatCase> concat_cases() {
  const auto bf16 = DType::kBFloat16;
  return {
      {"bf16", CacheFormat::kBFloat16, 0, false, false, bf16, 512, 64, 16},
      {"bf16_split_bs7", CacheFormat::kBFloat16, 0, false, true, bf16, 512, 64, 7},
      {"fp16_from_bf16", CacheFormat::kFloat16, 0, false, false, bf16, 512, 64, 16},
      {"fp32_from_fp16", CacheFormat::kFloat32, 0, false, false, DType::kFloat16, 256, 32, 1},
      {"bf16_from_fp32", CacheFormat::kBFloat16, 0, false, false, DType::kFloat32, 256, 32, 64},
      {"e4m3_scaled", CacheFormat::kFloat8E4M3, 0.037f, false, false, bf16, 512, 64, 16},
      {"e4m3_noscale_split", CacheFormat::kFloat8E4M3, 0, false, true, bf16, 512, 64, 16},
      {"e5m2_scaled_minicpm3", CacheFormat::kFloat8E5M2, 0.037f, false, false, bf16, 256, 32, 128},
      {"dsmla", CacheFormat::kFloat8DsMla, 0, false, false, bf16, 512, 64, 64},
      {"dsmla_pow2", CacheFormat::kFloat8DsMla, 0, true, false, bf16, 512, 64, 1},
  };
}

// ---- fp8_ds_mla tiles with NaN and zeros: hand-computed bytes -----------------------------------
// The documented rules, not the code (DESIGN.md, docs/decisions.md): a tile's amax starts at 0 and
// ignores NaN; scale = max(amax / 448, FLT_MIN), rounded up to a power of two with pow2; byte =
// e4m3(x / scale) with IEEE division, saturating, round to nearest even; NaN becomes 0x7f; the rope
// part is k_pe in bf16, unquantized. One token, bf16, its four tiles:
//   tile 0: NaN, 3, -3, 1.5, then 0s: amax 3. scale = fl(3 / 448); 3 / scale is 448 within an ulp
//           and rounds (or saturates) to 448 = 0x7e, -3 gives 0xfe, 1.5 gives 224 = 0x76.
//           pow2: 3 / 448 = 0.0067 rounds up to 2^-7, and 3 -> 384 = 0x7c, -3 -> 0xfc,
//           1.5 -> 192 = 0x74. NaN -> 0x7f, 0 -> 0x00 in both. (Were the NaN counted, the scale
//           would be the floor and 1.5 would saturate.)
//   tile 1: tile 0 with 0 in the NaN's place: the same scale and bytes, 0x00 for the NaN's.
//   tile 2: all 0: amax 0, scale FLT_MIN (a power of two already), bytes 0x00.
//   tile 3: all NaN: amax 0 (nothing counted), scale FLT_MIN, bytes 0x7f.
class DsMlaTiles : public testing::TestWithParam<Backend> {};

TEST_P(DsMlaTiles, NanAndZeroTilesHandComputed) {
  const Device dev = GetParam().device;
  for (bool pow2 : {false, true}) {
    SCOPED_TRACE(pow2 ? "pow2" : "plain");
    CacheGeometry g;
    g.format = CacheFormat::kFloat8DsMla;
    g.num_blocks = 1;
    g.block_size = 2;
    g.pow2 = pow2;
    TestCache cache = new_cache(dev, g);
    std::mt19937_64 rng(77);
    Tensor kv_c = new_tensor(dev, DType::kBFloat16, {1, 512});
    Tensor k_pe = random_tensor(dev, DType::kBFloat16, {1, 64}, rng);
    auto at = [&](int64_t k) { return kv_c.buffer->host.data() + kv_c.byte_offset({0, k}); };
    for (int64_t k = 0; k < 512; ++k) ref::store_value(at(k), DType::kBFloat16, 0.0f);
    for (int64_t k = 384; k < 512; ++k) std::memcpy(at(k), "\xc0\x7f", 2);  // bf16 NaN 0x7fc0
    std::memcpy(at(0), "\xc0\x7f", 2);
    for (int64_t tile : {0, 1}) {
      ref::store_value(at(tile * 128 + 1), DType::kBFloat16, 3.0f);
      ref::store_value(at(tile * 128 + 2), DType::kBFloat16, -3.0f);
      ref::store_value(at(tile * 128 + 3), DType::kBFloat16, 1.5f);
    }
    Tensor slot_mapping = index_tensor(dev, DType::kInt64, {1});
    upload_all({&kv_c, &k_pe});
    cache.data->upload();

    ConcatAndCacheMlaParams p;
    p.num_tokens = 1;
    p.kv_c = kv_c.device_view();
    p.k_pe = k_pe.device_view();
    p.slot_mapping = slot_mapping.device_view();
    p.kv_cache = cache.device_view();
    concat_and_cache_mla(p);

    std::vector<uint8_t> entry(kDsMlaLatentDim, 0x00);
    entry[0] = 0x7f;
    for (int64_t tile : {0, 1}) {
      entry[tile * 128 + 1] = pow2 ? 0x7c : 0x7e;
      entry[tile * 128 + 2] = pow2 ? 0xfc : 0xfe;
      entry[tile * 128 + 3] = pow2 ? 0x74 : 0x76;
    }
    std::fill(entry.begin() + 384, entry.end(), uint8_t{0x7f});
    const float scale = pow2 ? 0.0078125f : 3.0f / 448.0f;
    const float scales[kDsMlaNumTiles] = {scale, scale, FLT_MIN, FLT_MIN};
    entry.insert(entry.end(), reinterpret_cast<const uint8_t*>(scales),
                 reinterpret_cast<const uint8_t*>(scales) + sizeof(scales));
    entry.insert(entry.end(), k_pe.buffer->host.begin(), k_pe.buffer->host.end());
    ASSERT_EQ(static_cast<int64_t>(entry.size()), cache_entry_bytes(g.format, g.L, g.R));

    // Slot 1 holds the entry; slot 0 keeps the sentinel.
    std::vector<uint8_t> expected(cache.data->bytes(), kSentinelByte);
    std::copy(entry.begin(), entry.end(),
              expected.begin() + ref::cache_latent_offset_bytes(cache.host_view(), 1));
    EXPECT_TRUE(bytes_equal(cache.data->download(), expected, "fp8_ds_mla cache"));
  }
}

INSTANTIATE_TEST_SUITE_P(All, DsMlaTiles, testing::ValuesIn(all_backends()), backend_param_name);

// ---- decode_q_concat ---------------------------------------------------------------------------
struct QConcatCase {
  std::string name;
  DType model;
  DType q_out;
  float q_scale;
  int64_t H, L, R;
  int64_t T = 9;
  Pad nope_pad{}, pe_pad{}, out_pad{};
};

class DecodeQConcat : public testing::TestWithParam<std::tuple<Backend, QConcatCase>> {};

// The same decode_q_concat call on the host mirrors (first) and on the device copies (second).
std::pair<DecodeQConcatParams, DecodeQConcatParams> q_concat_params(int64_t T,
                                                                    const Tensor& ql_nope,
                                                                    const Tensor& q_pe,
                                                                    const Tensor& q_out,
                                                                    const Tensor& q_scale) {
  std::pair<DecodeQConcatParams, DecodeQConcatParams> calls;
  fill_host_and_device(calls.first, calls.second, [&](auto* p, auto v) {
    p->num_tokens = T;
    p->ql_nope = v(ql_nope);
    p->q_pe = v(q_pe);
    p->q_out = v(q_out);
    if (q_scale.present()) p->q_scale = static_cast<const float*>(v(q_scale).data);
  });
  return calls;
}

TEST_P(DecodeQConcat, MatchesReference) {
  const Device dev = std::get<0>(GetParam()).device;
  const QConcatCase& c = std::get<1>(GetParam());
  std::mt19937_64 rng(c.H * 5 + c.L);
  const int64_t T = c.T, rows = T + 2;
  auto padded = [&](DType dtype, int64_t cols, Pad pad) {
    return padded_heads(dev, dtype, rows, c.H, cols, pad.row, pad.head);
  };
  Tensor ql_nope = randomized(padded(c.model, c.L, c.nope_pad), rng, 8.0f);
  Tensor q_pe = randomized(padded(c.model, c.R, c.pe_pad), rng, 8.0f);
  Tensor q_out = poisoned(padded(c.q_out, c.L + c.R, c.out_pad));
  Tensor q_scale;
  if (c.q_scale > 0) {
    q_scale = new_tensor(dev, DType::kFloat32, {1});
    set_scalar_f32(q_scale, c.q_scale);
  }
  upload_all({&ql_nope, &q_pe, &q_out, &q_scale});
  const auto [host, device] = q_concat_params(T, ql_nope, q_pe, q_out, q_scale);
  ref::decode_q_concat(host);
  decode_q_concat(device);
  EXPECT_TRUE(buffer_matches(*q_out.buffer, "q_out"));
  EXPECT_TRUE(buffer_unchanged(*ql_nope.buffer, "ql_nope"));
  EXPECT_TRUE(buffer_unchanged(*q_pe.buffer, "q_pe"));
}

// Parts already in q_out (as an absorbed bmm writes ql_nope; q_pe placed by an earlier step):
// those keep their values, the others are copied, and the validated args leave each part's copy
// onto itself out (nullptr: DecodeQConcatArgs); with both in place the call writes nothing.
TEST_P(DecodeQConcat, PartsAlreadyInQOut) {
  const Device dev = std::get<0>(GetParam()).device;
  const QConcatCase& c = std::get<1>(GetParam());
  if (is_float8(c.q_out)) GTEST_SKIP() << "an fp8 q_out shares no byte with its sources";
  std::mt19937_64 rng(c.H * 7 + c.R);
  const int64_t T = c.T, rows = T + 2;
  struct InPlace {
    bool nope, pe;
    const char* name;
  };
  for (const InPlace in_place :
       {InPlace{true, false, "ql_nope in place, q_pe apart"}, InPlace{true, true, "both in place"},
        InPlace{false, true, "ql_nope apart, q_pe in place"}}) {
    SCOPED_TRACE(in_place.name);
    Tensor q_out = randomized(
        padded_heads(dev, c.q_out, rows, c.H, c.L + c.R, c.out_pad.row, c.out_pad.head), rng, 8.0f);
    const Tensor ql_nope = in_place.nope ? q_out.view(q_out.offset, {rows, c.H, c.L}, q_out.stride)
                                         : randomized(padded_heads(dev, c.model, rows, c.H, c.L,
                                                                   c.nope_pad.row, c.nope_pad.head),
                                                      rng, 8.0f);
    const Tensor q_pe =
        in_place.pe
            ? q_out.view(q_out.offset + c.L, {rows, c.H, c.R}, q_out.stride)
            : randomized(padded_heads(dev, c.model, rows, c.H, c.R, c.pe_pad.row, c.pe_pad.head),
                         rng, 8.0f);
    const auto [host, device] = q_concat_params(T, ql_nope, q_pe, q_out, Tensor{});
    Device validated;
    const core::DecodeQConcatArgs args =
        core::validate_decode_q_concat("decode_q_concat", device, Context{}, &validated);
    EXPECT_EQ(args.ql_nope, in_place.nope ? nullptr : device.ql_nope.data);
    EXPECT_EQ(args.q_pe, in_place.pe ? nullptr : device.q_pe.data);
    ref::decode_q_concat(host);
    decode_q_concat(device);
    EXPECT_TRUE(buffer_matches(*q_out.buffer, "q_out"));
    if (!in_place.nope) {
      EXPECT_TRUE(buffer_unchanged(*ql_nope.buffer, "ql_nope"));
    }
    if (!in_place.pe) {
      EXPECT_TRUE(buffer_unchanged(*q_pe.buffer, "q_pe"));
    }
  }
}

std::vector<QConcatCase> q_concat_cases() {
  const auto bf16 = DType::kBFloat16;
  return {
      {"bf16", bf16, bf16, 0, 16, 512, 64},
      {"fp16", DType::kFloat16, DType::kFloat16, 0, 40, 256, 32},
      {"fp32", DType::kFloat32, DType::kFloat32, 0, 3, 512, 64},
      {"e4m3_scaled", bf16, DType::kFloat8E4M3, 0.02f, 16, 512, 64},
      {"e4m3_noscale", bf16, DType::kFloat8E4M3, 0, 128, 512, 64},
      {"e5m2_scaled_fp16", DType::kFloat16, DType::kFloat8E5M2, 0.3f, 40, 256, 32},
      // One head (DeepSeek-V3's 128 heads over 128 ranks): a single head is work, not an empty
      // call.
      {"bf16_one_head", bf16, bf16, 0, 1, 512, 64},
      {"e4m3_scaled_one_head", bf16, DType::kFloat8E4M3, 0.02f, 1, 512, 64},
      // Launches whose copy items also move the rope parts (CUDA: from 512 tokens, q_out of the
      // model dtype): 2 rows an item, and 1 row of R = 32 (4 lanes).
      {"bf16_T520", bf16, bf16, 0, 8, 512, 64, 520},
      {"fp16_T512_r32", DType::kFloat16, DType::kFloat16, 0, 2, 256, 32, 512},
      // Every row and head padded, each tensor differently.
      {"bf16_padded_heads", bf16, bf16, 0, 3, 512, 64, 5, {2, 8}, {6, 16}, {4, 24}},
      {"e4m3_padded_heads",
       bf16,
       DType::kFloat8E4M3,
       0.02f,
       3,
       512,
       64,
       5,
       {2, 8},
       {6, 16},
       {4, 24}},
  };
}

// ---- rms_norm ----------------------------------------------------------------------------------
struct RmsCase {
  std::string name;
  DType model;
  int64_t N;
  bool in_place;
  int64_t input_row_pad = 0, output_row_pad = 0;
};

class RmsNorm : public testing::TestWithParam<std::tuple<Backend, RmsCase>> {};

TEST_P(RmsNorm, MatchesReferenceBitwise) {
  const Device dev = std::get<0>(GetParam()).device;
  const RmsCase& c = std::get<1>(GetParam());
  std::mt19937_64 rng(c.N);
  const int64_t T = 33, rows = T + 2;
  Tensor input = randomized(padded_rows(dev, c.model, rows, c.N, c.input_row_pad), rng, 3.0f);
  Tensor weight = random_tensor(dev, c.model, {c.N}, rng, 1.5f);
  Tensor output =
      c.in_place ? input : poisoned(padded_rows(dev, c.model, rows, c.N, c.output_row_pad));
  RmsNormParams host, device;
  fill_host_and_device(host, device, [&](auto* p, auto v) {
    p->num_tokens = T;
    p->input = v(input);
    p->weight = v(weight);
    p->eps = 1e-6f;
    p->output = v(output);
  });
  ref::rms_norm(host);
  rms_norm(device);
  EXPECT_TRUE(buffer_matches(*output.buffer, "output"));
  if (!c.in_place) {
    EXPECT_TRUE(buffer_unchanged(*input.buffer, "input"));
  }
  EXPECT_TRUE(buffer_unchanged(*weight.buffer, "weight"));
}

// A GPU backend sums the squares in the CPU backend's order (the pairwise tree, numerics.h), so
// their outputs are equal byte for byte, for every row width: chunks cut short (N = 7 bf16, 1000
// fp16, 3001 fp32), several 1024-element segments merged (3001 fp32, 7168 and 9000 bf16), and the
// other cases' widths.
TEST_P(RmsNorm, EqualsTheCpuBackendBitwise) {
  const Device dev = std::get<0>(GetParam()).device;
  if (dev.type == DeviceType::kCPU) GTEST_SKIP() << "compares a GPU backend with the CPU";
  const RmsCase& c = std::get<1>(GetParam());
  const int64_t T = 21;
  Tensor outputs[2];
  const Device devices[2] = {dev, Device{}};
  for (int k = 0; k < 2; ++k) {
    std::mt19937_64 rng(c.N + 7);
    Tensor input = randomized(padded_rows(devices[k], c.model, T, c.N, c.input_row_pad), rng, 3.0f);
    Tensor weight = random_tensor(devices[k], c.model, {c.N}, rng, 1.5f);
    outputs[k] =
        c.in_place ? input : poisoned(padded_rows(devices[k], c.model, T, c.N, c.output_row_pad));
    RmsNormParams p;
    p.num_tokens = T;
    p.input = input.device_view();
    p.weight = weight.device_view();
    p.eps = 1e-6f;
    p.output = outputs[k].device_view();
    rms_norm(p);
  }
  EXPECT_TRUE(bytes_equal(outputs[0].buffer->download(), outputs[1].buffer->download(),
                          c.name + ": against the CPU backend"));
}

std::vector<RmsCase> rms_cases() {
  return {{"bf16_512", DType::kBFloat16, 512, false},
          {"bf16_512_in_place", DType::kBFloat16, 512, true},
          {"fp16_256", DType::kFloat16, 256, false},
          {"fp32_1024", DType::kFloat32, 1024, false},
          {"bf16_7168", DType::kBFloat16, 7168, false},
          {"bf16_7", DType::kBFloat16, 7, false},
          {"fp16_1000", DType::kFloat16, 1000, false},
          {"fp32_3001", DType::kFloat32, 3001, false},
          {"bf16_9000", DType::kBFloat16, 9000, false},
          {"bf16_512_padded_rows", DType::kBFloat16, 512, false, 8, 24},
          // Rows 8-byte aligned only, the input's or the output's: CUDA's element-wise kernel.
          {"bf16_512_input_rows_8_bytes", DType::kBFloat16, 512, false, 4, 0},
          {"bf16_512_output_rows_8_bytes", DType::kBFloat16, 512, false, 0, 4}};
}

// ---- fused == unfused --------------------------------------------------------------------------
// The fused op and the unfused sequence rms_norm -> rotary_embedding (k_pe, decode q_pe, prefill
// q's rope part) -> concat_and_cache_mla -> decode_q_concat, on the same backend, give the same
// bytes: cache, q_out, q, k_pe_out and kv_c_out. Exact, RMSNorm included.
class FusedEqualsUnfused : public testing::TestWithParam<std::tuple<Backend, FusedSpec>> {};

TEST_P(FusedEqualsUnfused, SameBytes) {
  const Device dev = std::get<0>(GetParam()).device;
  const FusedSpec& spec = std::get<1>(GetParam());
  SCOPED_TRACE(spec.name);
  FusedProblem fused(spec, dev);
  FusedProblem unfused(spec, dev);  // same seed: identical inputs
  fused.run_library();
  const int64_t T = spec.T, Td = spec.Td, H = spec.shape.H, L = spec.shape.L, R = spec.shape.R,
                P = spec.shape.P;
  const int64_t es = static_cast<int64_t>(dtype_size(spec.model));
  // Copies the first `n` elements of a contiguous tensor into another (rows >= T stay poisoned,
  // as the fused op leaves them).
  auto copy_elems = [&](const Tensor& from, const Tensor& to, int64_t n) {
    std::vector<uint8_t> bytes = from.buffer->download();
    copy_host_to_device(dev, to.buffer->device_ptr(), bytes.data(), static_cast<size_t>(n * es));
  };
  // 1. RMSNorm of kv_c into kv_c_out (without a norm: kv_c itself).
  if (spec.norm) {
    RmsNormParams norm;
    norm.num_tokens = T;
    norm.input = unfused.kv_c.device_view();
    norm.weight = unfused.weight.device_view();
    norm.eps = 1e-6f;
    norm.output = unfused.kv_c_out.device_view();
    rms_norm(norm);
  } else {
    copy_elems(unfused.kv_c, unfused.kv_c_out, T * L);
  }
  // 2. RoPE: k_pe copied into k_pe_out and rotated there; decode q_pe likewise; prefill q in place.
  copy_elems(unfused.k_pe, unfused.k_pe_out, T * R);
  RotaryEmbeddingParams rk;
  rk.num_tokens = T;
  rk.positions = unfused.positions.device_view();
  rk.cos_sin_cache = unfused.cos_sin.device_view();
  rk.rope_style = spec.style;
  const int64_t k_stride = unfused.k_pe_out.stride[0];
  rk.query = unfused.k_pe_out.view(0, {unfused.rows, 1, R}, {k_stride, R, 1}).device_view();
  rotary_embedding(rk);
  Tensor q_pe_rot = new_tensor(dev, spec.model, {std::max<int64_t>(Td, 1), H, R});
  {
    copy_elems(unfused.q_pe, q_pe_rot, Td * H * R);
    RotaryEmbeddingParams rq = rk;
    rq.num_tokens = Td;
    rq.query = q_pe_rot.device_view();
    if (Td > 0) rotary_embedding(rq);
    RotaryEmbeddingParams rp = rk;
    rp.num_tokens = T - Td;
    rp.positions = unfused.positions.view(Td, {unfused.rows - Td}, {1}).device_view();
    const Tensor& q = unfused.q;
    rp.query = q.view(q.offset + Td * q.stride[0] + P, {unfused.rows - Td, H, R},
                      {q.stride[0], q.stride[1], 1})
                   .device_view();
    if (T - Td > 0) rotary_embedding(rp);
  }
  // 3. The cache, from the normalized kv_c and the rotated k_pe.
  ConcatAndCacheMlaParams cc;
  cc.num_tokens = T;
  cc.kv_c = unfused.kv_c_out.device_view();
  cc.k_pe = unfused.k_pe_out.device_view();
  cc.slot_mapping = unfused.slot_mapping.device_view();
  cc.kv_cache = unfused.cache.device_view();
  concat_and_cache_mla(cc);
  // 4. The decode query.
  if (Td > 0) {
    DecodeQConcatParams dq;
    dq.num_tokens = Td;
    dq.ql_nope = unfused.ql_nope.device_view();
    dq.q_pe = q_pe_rot.device_view();
    dq.q_out = unfused.q_out.device_view();
    if (unfused.q_scale.present()) {
      dq.q_scale = static_cast<const float*>(unfused.q_scale.device_view().data);
    }
    decode_q_concat(dq);
  }
  EXPECT_TRUE(bytes_equal(unfused.cache.data->download(), fused.cache.data->download(), "cache"));
  EXPECT_TRUE(
      bytes_equal(unfused.q_out.buffer->download(), fused.q_out.buffer->download(), "q_out"));
  EXPECT_TRUE(bytes_equal(unfused.q.buffer->download(), fused.q.buffer->download(), "q"));
  EXPECT_TRUE(bytes_equal(unfused.k_pe_out.buffer->download(), fused.k_pe_out.buffer->download(),
                          "k_pe_out"));
  EXPECT_TRUE(bytes_equal(unfused.kv_c_out.buffer->download(), fused.kv_c_out.buffer->download(),
                          "kv_c_out"));
}

std::vector<FusedSpec> equivalence_specs() {
  std::vector<FusedSpec> out;
  struct F {
    const char* name;
    CacheFormat format;
    float scale;
    bool pow2;
  };
  const F formats[] = {{"bf16", CacheFormat::kBFloat16, 0, false},
                       {"fp32", CacheFormat::kFloat32, 0, false},
                       {"e4m3", CacheFormat::kFloat8E4M3, 0.037f, false},
                       {"e5m2", CacheFormat::kFloat8E5M2, 0.037f, false},
                       {"dsmla", CacheFormat::kFloat8DsMla, 0, false},
                       {"dsmlapow2", CacheFormat::kFloat8DsMla, 0, true}};
  uint64_t seed = 900;
  for (const F& f : formats) {
    for (bool norm : {false, true}) {
      for (DType q_out : {DType::kBFloat16, DType::kFloat8E4M3}) {
        FusedSpec s;
        s.shape = kDeepSeekV3Tp8;
        s.T = 33;
        s.Td = 13;
        s.cache.format = f.format;
        s.cache.scale = f.scale;
        s.cache.pow2 = f.pow2;
        s.cache.block_size = 16;
        s.norm = norm;
        s.k_pe_out = s.kv_c_out = true;
        s.q_out_dtype = q_out;
        s.q_scale = q_out == DType::kFloat8E4M3 ? 0.05f : 0.0f;
        s.seed = seed++;
        s.name = std::string(f.name) + (norm ? "_norm" : "") +
                 (q_out == DType::kFloat8E4M3 ? "_qout_e4m3" : "");
        out.push_back(s);
      }
    }
  }
  FusedSpec s = out.front();
  s.shape = kMiniCpm3;
  s.style = RopeStyle::kNeox;
  s.model = DType::kFloat16;
  s.norm = true;
  s.name = "minicpm3_neox_fp16_norm";
  out.push_back(s);
  s.shape = kDeepSeekV3;
  s.model = DType::kBFloat16;
  s.style = RopeStyle::kGptJ;
  s.T = 9;
  s.Td = 9;
  s.name = "dsv3_all_decode_norm";
  out.push_back(s);
  s.Td = 0;
  s.name = "dsv3_all_prefill_norm";
  out.push_back(s);
  return out;
}

template <typename C>
std::string case_name(const testing::TestParamInfo<std::tuple<Backend, C>>& info) {
  return std::get<0>(info.param).name + "_" + std::get<1>(info.param).name;
}

void PrintTo(const RotaryCase& c, std::ostream* os) { *os << c.name; }
void PrintTo(const ConcatCase& c, std::ostream* os) { *os << c.name; }
void PrintTo(const QConcatCase& c, std::ostream* os) { *os << c.name; }
void PrintTo(const RmsCase& c, std::ostream* os) { *os << c.name; }

INSTANTIATE_TEST_SUITE_P(All, RotaryEmbedding,
                         testing::Combine(testing::ValuesIn(all_backends()),
                                          testing::ValuesIn(rotary_cases())),
                         case_name<RotaryCase>);
INSTANTIATE_TEST_SUITE_P(All, ConcatAndCacheMla,
                         testing::Combine(testing::ValuesIn(all_backends()),
                                          testing::ValuesIn(concat_cases())),
                         case_name<ConcatCase>);
INSTANTIATE_TEST_SUITE_P(All, DecodeQConcat,
                         testing::Combine(testing::ValuesIn(all_backends()),
                                          testing::ValuesIn(q_concat_cases())),
                         case_name<QConcatCase>);
INSTANTIATE_TEST_SUITE_P(All, RmsNorm,
                         testing::Combine(testing::ValuesIn(all_backends()),
                                          testing::ValuesIn(rms_cases())),
                         case_name<RmsCase>);
INSTANTIATE_TEST_SUITE_P(All, FusedEqualsUnfused,
                         testing::Combine(testing::ValuesIn(all_backends()),
                                          testing::ValuesIn(equivalence_specs())),
                         case_name<FusedSpec>);

}  // namespace
}  // namespace test
}  // namespace mlakv
