// mlakv CLI: `mlakv check`'s gather family (check.h): the cache read-back, gather_cache_slots and
// gather_cache_sequences, over every cache format and layout, from a cache whose every entry holds
// random values (fp8_ds_mla: random tile scales too).
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

enum class GatherOp { kSlots, kSequences, kEither };

struct GatherConfig {
  const char* name;
  GatherOp op;
  int64_t L, R;  // 0: random
};

const std::vector<GatherConfig>& gather_configs() {
  static const std::vector<GatherConfig> configs = {
      {"gather_cache_slots L512 R64", GatherOp::kSlots, 512, 64},
      {"gather_cache_sequences L512 R64", GatherOp::kSequences, 512, 64},
      {"gather_cache_slots L256 R32", GatherOp::kSlots, 256, 32},
      {"gather_cache_sequences L256 R32", GatherOp::kSequences, 256, 32},
      {"gather either, any L R", GatherOp::kEither, 0, 0},
  };
  return configs;
}

enum GatherBufferId : int {
  kGCache,
  kGCacheRope,
  kGCacheScale,
  kGSlots,
  kGBlockTable,
  kGCuSeqLens,
  kGOut,
  kNumGatherBuffers
};

const char* gather_buffer_name(int id) {
  static const char* names[kNumGatherBuffers] = {"kv_cache", "kv_cache (rope part)", "cache scale",
                                                 "slots",    "block_table",          "cu_seq_lens",
                                                 "out"};
  return names[id];
}

struct GatherCase {
  const GatherConfig* config = nullptr;
  uint64_t seed = 0;
  bool sequences = false;
  CacheLayout cache;
  DType out_dtype = DType::kBFloat16;
  int64_t out_row_pad = 0;  // out's row stride is L + R + out_row_pad
  int64_t out_rows = 0;     // out.shape[0]
  // gather_cache_slots: N slots (and pad_rows more that the op never reads).
  int64_t N = 0, pad_rows = 0;
  DType index_dtype = DType::kInt64;
  std::vector<int64_t> slots;
  // gather_cache_sequences: B sequences, a [B + pad_rows, max_blocks] table whose rows lie
  // table_row_stride apart, cu_seq_lens [B + 1].
  int64_t B = 0, max_blocks = 0, table_row_stride = 0;
  std::vector<int64_t> block_table, cu_seq_lens;

  int64_t num_slots() const { return cache.num_slots(); }

  std::string describe() const {
    std::ostringstream os;
    os << "seed " << seed << ": " << (sequences ? "sequences B " : "slots N ")
       << (sequences ? B : N) << " out rows " << out_rows << " L " << cache.L << " R " << cache.R
       << " " << cache.describe() << " out " << dtype_name(out_dtype)
       << (out_row_pad > 0 ? " (row pad " + std::to_string(out_row_pad) + ")" : "");
    if (!sequences) {
      os << " idx " << dtype_name(index_dtype) << " pad " << pad_rows
         << bad_slots_note(slots, N, num_slots());
      return os.str();
    }
    int64_t bad_ids = 0, past_row = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t len = cu_seq_lens[b + 1] - cu_seq_lens[b];
      const int64_t used = (len + cache.block_size - 1) / cache.block_size;
      past_row += std::max<int64_t>(0, len - max_blocks * cache.block_size);
      for (int64_t j = 0; j < std::min(used, max_blocks); ++j) {
        const int64_t id = block_table[b * table_row_stride + j];
        bad_ids += id < 0 || id >= cache.num_blocks ? 1 : 0;
      }
    }
    os << " table cols " << max_blocks << (table_row_stride != max_blocks ? " strided" : "")
       << " tokens " << cu_seq_lens[B];
    if (bad_ids > 0) os << " " << bad_ids << " bad block ids";
    if (past_row > 0) os << " " << past_row << " tokens past their table row";
    return os.str();
  }
};

// Case i of `config` (its cache format the i-th in turn, check.h).
GatherCase make_gather_case(const GatherConfig& config, uint64_t seed, int i) {
  Rng rng = case_rng(seed, config.name, static_cast<uint64_t>(i % kNumCacheFormats));
  GatherCase c;
  c.config = &config;
  c.seed = seed;
  c.sequences =
      config.op == GatherOp::kEither ? rng.chance(0.5) : config.op == GatherOp::kSequences;
  int64_t L = config.L > 0 ? config.L : 16 * rng.between(1, 64);
  int64_t R = config.R > 0 ? config.R : 2 * rng.between(1, 64);
  // On fp8_ds_mla's turn in the format cycle the random-shape config takes that format's one shape
  // (L 512, R 64), so that it reads back all six formats, each with its other random draws.
  if (config.L == 0 && kCacheFormats[i % kNumCacheFormats] == CacheFormat::kFloat8DsMla) {
    L = kDsMlaLatentDim;
    R = kDsMlaRopeDim;
  }
  const CacheFormat format = kCacheFormats[cycled_format_index(i, L, R, seed)];
  c.out_dtype = rng.chance(0.6) ? DType::kBFloat16 : DType::kFloat32;
  const double pad_roll = rng.uniform(0.0f, 1.0f);
  c.out_row_pad = pad_roll < 0.6 ? 0 : (pad_roll < 0.8 ? 8 : rng.between(1, 7));

  if (!c.sequences) {
    c.N = rng.chance(0.15) ? rng.between(65, 600) : rng.between(1, 64);
    if (empty_batch(seed, config.name)) c.N = 0;
    c.pad_rows = rng.chance(0.5) ? rng.between(1, 4) : 0;
    c.index_dtype = rng.chance(0.5) ? DType::kInt64 : DType::kInt32;
    c.cache = CacheLayout::draw(rng, format, L, R, c.N);
    // Slots anywhere in the cache (repeats allowed: a read-back), a few bad ones (zeros; those
    // past the cache counted), padding rows wild.
    c.slots = draw_slots(rng, c.N, c.N + c.pad_rows, c.num_slots(), c.index_dtype, false);
    // out: N rows, sometimes more (left alone).
    c.out_rows = c.N + (rng.chance(0.3) ? rng.between(1, 3) : 0);
    return c;
  }

  c.cache = CacheLayout::draw(rng, format, L, R, 1);  // its block count follows from the table
  const int64_t bs = c.cache.block_size;
  c.B = rng.chance(0.2) ? rng.between(9, 40) : rng.between(1, 8);
  if (empty_batch(seed, config.name)) c.B = 0;
  const int64_t max_len = rng.chance(0.2) ? 600 : 150;
  c.cu_seq_lens.push_back(0);
  int64_t longest = 0;
  for (int64_t b = 0; b < c.B; ++b) {
    const int64_t len = rng.chance(0.1) ? 0 : rng.between(1, max_len);
    longest = std::max(longest, len);
    c.cu_seq_lens.push_back(c.cu_seq_lens.back() + len);
  }
  // The table: as many columns as the longest sequence needs, sometimes more (never read),
  // sometimes fewer (the tokens past a row give zeros and are counted); its rows sometimes a
  // column view of a wider table.
  c.max_blocks = std::max<int64_t>(1, (longest + bs - 1) / bs);
  const double cols_roll = rng.uniform(0.0f, 1.0f);
  if (cols_roll < 0.2) c.max_blocks += rng.between(1, 3);
  if (cols_roll > 0.75 && c.max_blocks > 1) c.max_blocks -= 1;
  c.table_row_stride = c.max_blocks + (rng.chance(0.3) ? rng.between(1, 4) : 0);
  c.pad_rows = rng.chance(0.5) ? rng.between(1, 3) : 0;
  const int64_t blocks = rng.between(std::max<int64_t>(2, c.max_blocks / 2), c.max_blocks * 2 + 4);
  c.cache.num_blocks = blocks;
  for (int64_t b = 0; b < c.B + c.pad_rows; ++b) {
    for (int64_t j = 0; j < c.table_row_stride; ++j) {
      int64_t id = rng.below(blocks);
      if (b < c.B && j < c.max_blocks && rng.chance(0.03)) {
        const double roll = rng.uniform(0.0f, 1.0f);
        id = roll < 0.4   ? -1 - rng.below(3)
             : roll < 0.8 ? blocks + rng.below(5)
                          : far_index(rng, blocks, DType::kInt32);
      }
      c.block_table.push_back(id);
    }
  }
  // out: all the tokens, sometimes fewer rows (the rest never written) or more (left alone).
  const int64_t total = c.cu_seq_lens.back();
  const double rows_roll = rng.uniform(0.0f, 1.0f);
  c.out_rows = rows_roll < 0.15 && total > 1 ? rng.between(1, total - 1)
               : rows_roll < 0.3             ? total + rng.between(1, 3)
                                             : total;
  if (c.B > 0) c.out_rows = std::max<int64_t>(c.out_rows, 1);  // an empty batch: maybe no out
  return c;
}

KVCacheView cache_view(const GatherCase& c, const std::vector<void*>& base, Device device) {
  return c.cache.view(base[kGCache], base[kGCacheRope],
                      static_cast<const float*>(base[kGCacheScale]), device);
}

std::vector<std::vector<uint8_t>> gather_initial_buffers(const GatherCase& c) {
  Rng rng(c.seed ^ 0x9a7e5eedull);
  std::vector<std::vector<uint8_t>> b(kNumGatherBuffers);
  const CacheLayout& cache = c.cache;
  b[kGCache].assign(cache.data_bytes(), kSentinelByte);
  if (cache.split) b[kGCacheRope].assign(cache.rope_bytes(), kSentinelByte);
  // Every entry random: its latent part (fp8_ds_mla: then its 4 tile scales) and its rope part,
  // placed by the reference's addressing.
  {
    std::vector<void*> base(kNumGatherBuffers, nullptr);
    base[kGCache] = b[kGCache].data();
    if (cache.split) base[kGCacheRope] = b[kGCacheRope].data();
    const KVCacheView v = cache_view(c, base, Device{});
    const int64_t slots = cache.num_slots();
    const DType latent = cache_latent_dtype(cache.format);
    const DType rope = cache_rope_dtype(cache.format);
    const std::vector<uint8_t> latent_values = random_values(latent, slots * cache.L, 2.0f, rng);
    const std::vector<uint8_t> rope_values = random_values(rope, slots * cache.R, 2.0f, rng);
    const size_t latent_row = static_cast<size_t>(cache.L) * dtype_size(latent);
    const size_t rope_row = static_cast<size_t>(cache.R) * dtype_size(rope);
    uint8_t* rope_base = static_cast<uint8_t*>(cache.split ? base[kGCacheRope] : base[kGCache]);
    for (int64_t s = 0; s < slots; ++s) {
      uint8_t* entry = b[kGCache].data() + ref::cache_latent_offset_bytes(v, s);
      std::memcpy(entry, latent_values.data() + s * latent_row, latent_row);
      if (cache.format == CacheFormat::kFloat8DsMla) {
        for (int64_t tile = 0; tile < kDsMlaNumTiles; ++tile) {
          const float scale = rng.uniform(0.001f, 0.05f);
          std::memcpy(entry + latent_row + tile * sizeof(float), &scale, sizeof(float));
        }
      }
      std::memcpy(rope_base + ref::cache_rope_offset_bytes(v, s), rope_values.data() + s * rope_row,
                  rope_row);
    }
  }
  if (cache.scaled) b[kGCacheScale] = scale_bytes(rng);
  if (c.sequences) {
    b[kGBlockTable] = index_bytes(c.block_table, DType::kInt32);
    b[kGCuSeqLens] = index_bytes(c.cu_seq_lens, DType::kInt32);
  } else {
    b[kGSlots] = index_bytes(c.slots, c.index_dtype);
  }
  const int64_t row = cache.L + cache.R + c.out_row_pad;
  b[kGOut].assign(static_cast<size_t>(c.out_rows * row) * dtype_size(c.out_dtype), kPoisonByte);
  return b;
}

class GatherFamily : public Family {
 public:
  int num_configs() const override { return static_cast<int>(gather_configs().size()); }
  const char* config_name(int config) const override { return gather_configs()[config].name; }

  void prepare(int config, int i, uint64_t seed) override {
    if (i == 0) formats_.reset();
    case_ = make_gather_case(gather_configs()[config], seed, i);
    formats_.add(case_.cache.format);
    initial_ = gather_initial_buffers(case_);
  }
  std::string describe() const override { return case_.describe(); }

  Run reference() const override {
    return run_reference(initial_, gather_buffer_name,
                         [&](const std::vector<void*>& base, int32_t* counts) {
                           if (case_.sequences) {
                             ref::gather_cache_sequences(sequences_params(base, Device{}), counts);
                           } else {
                             ref::gather_cache_slots(slots_params(base, Device{}), counts);
                           }
                         });
  }

  Run run(Device device) const override {
    return run_on(device, initial_, gather_buffer_name,
                  [&](const std::vector<void*>& base, const Context& ctx) {
                    if (case_.sequences) {
                      gather_cache_sequences(sequences_params(base, device), ctx);
                    } else {
                      gather_cache_slots(slots_params(base, device), ctx);
                    }
                  });
  }

  std::string config_note(int /*config*/) const override { return formats_.note(); }

 private:
  TensorView out_view(const std::vector<void*>& base, Device device) const {
    const GatherCase& c = case_;
    const int64_t width = c.cache.L + c.cache.R;
    return make_strided_view(base[kGOut], c.out_dtype, {c.out_rows, width},
                             {width + c.out_row_pad, 1}, device);
  }

  GatherCacheSlotsParams slots_params(const std::vector<void*>& base, Device device) const {
    const GatherCase& c = case_;
    GatherCacheSlotsParams p;
    p.num_tokens = c.N;
    p.kv_cache = cache_view(c, base, device);
    p.slots = make_view(base[kGSlots], c.index_dtype, {c.N + c.pad_rows}, device);
    p.out = out_view(base, device);
    return p;
  }

  GatherCacheSequencesParams sequences_params(const std::vector<void*>& base, Device device) const {
    const GatherCase& c = case_;
    GatherCacheSequencesParams p;
    p.num_seqs = c.B;
    p.kv_cache = cache_view(c, base, device);
    p.block_table =
        make_strided_view(base[kGBlockTable], DType::kInt32, {c.B + c.pad_rows, c.max_blocks},
                          {c.table_row_stride, 1}, device);
    p.cu_seq_lens = make_view(base[kGCuSeqLens], DType::kInt32, {c.B + 1}, device);
    p.out = out_view(base, device);
    return p;
  }

  GatherCase case_;
  std::vector<std::vector<uint8_t>> initial_;  // by GatherBufferId
  FormatTally formats_;
};

}  // namespace

std::unique_ptr<Family> make_gather_family() { return std::make_unique<GatherFamily>(); }

}  // namespace check
}  // namespace cli
}  // namespace mlakv
