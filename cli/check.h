// mlakv CLI: `mlakv check`'s op families (check_{fused,norm,unfused,gather}.cpp) and
// what they share with the driver (check.cpp): a run's buffers and counters, the device copies a
// backend runs on, the random source of a case.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "mlakv/mlakv.h"
#include "util.h"

namespace mlakv {
namespace cli {
namespace check {

constexpr uint8_t kPoisonByte = 0xA5;    // the outputs' bytes before the op
constexpr uint8_t kSentinelByte = 0x5C;  // bytes the op must leave alone

// An optional output: absent, its own buffer, or the input it replaces (in place).
enum class Alias { kNone, kSeparate, kInPlace };

// What one run of a case left in its buffers (by buffer id; empty: not used by the case) and in the
// error counters. `names` names the buffers of the case's op family; `overrun` names the first
// buffer (or "error_counts") whose guard bytes changed (a write outside it), or is empty.
struct Run {
  const char* (*names)(int) = nullptr;
  std::vector<std::vector<uint8_t>> result;
  std::array<int32_t, kNumErrorCounters> counts = {};
  std::string overrun;
  bool ran() const { return !result.empty(); }
};

// The random source of one case: seeded from a hash of the seed, the config's name (FNV-1a:
// configs with equal shapes differ) and `salt`, so that seed s + 1 is not seed s's stream one draw
// later (SplitMix64 seeded with s * its own increment would be).
Rng case_rng(uint64_t seed, const char* config_name, uint64_t salt);

// Copies of `initial` on `device` (nullptr for an unused buffer), each between kGuardBytes guard
// bytes on either side; the run's result is read back from them, and a changed guard byte is
// reported as an overrun. (A write further than kGuardBytes outside a buffer may land in another
// allocation, unseen.)
struct DeviceCopies {
  static constexpr size_t kGuardBytes = 256;  // keeps every copy 256-byte aligned
  static constexpr uint8_t kGuardByte = 0xC3;
  std::vector<Buffer> buffers;
  std::vector<void*> base;

  DeviceCopies(const std::vector<std::vector<uint8_t>>& initial, Device device);
  // Buffer `id`'s bytes (its guards cut off), and whether its guards were kept.
  std::vector<uint8_t> read(size_t id, bool* guards_kept) const;
  // Every buffer into run->result (by id; empty: unused), the first with a changed guard into
  // run->overrun.
  void read_back(Run* run) const;
};

// `bytes` into buffer `base` (a view of part of its rows), or nullptr for a buffer of no bytes: a
// view of zero rows keeps null data, and no offset is added to a null pointer.
inline void* offset_bytes(void* base, int64_t bytes) {
  return base == nullptr ? nullptr : static_cast<uint8_t*>(base) + bytes;
}

// The host reference's pointers into a run's buffers (nullptr for an unused buffer).
std::vector<void*> host_pointers(Run* run);

// One run of an op on `device`: copies of `initial`, error counters, `op(base, ctx)`, then the
// buffers and counters read back.
template <typename Op>
Run run_on(Device device, const std::vector<std::vector<uint8_t>>& initial,
           const char* (*names)(int), const Op& op) {
  const DeviceCopies copies(initial, device);
  // The counters, zero, between guards of their own.
  const DeviceCopies counters({std::vector<uint8_t>(sizeof(Run::counts), 0)}, device);
  Context ctx;
  ctx.error_counts = static_cast<int32_t*>(counters.base[0]);
  op(copies.base, ctx);
  device_synchronize(device);
  Run run;
  run.names = names;
  copies.read_back(&run);
  bool guards_kept = true;
  const std::vector<uint8_t> counts = counters.read(0, &guards_kept);
  std::memcpy(run.counts.data(), counts.data(), sizeof(Run::counts));
  if (!guards_kept && run.overrun.empty()) run.overrun = "error_counts";
  return run;
}

// The host reference's run: `ref(base, counts)` on host copies of `initial`.
template <typename Ref>
Run run_reference(const std::vector<std::vector<uint8_t>>& initial, const char* (*names)(int),
                  const Ref& ref) {
  Run run;
  run.names = names;
  run.result = initial;
  ref(host_pointers(&run), run.counts.data());
  return run;
}

// Whether case (seed, config) is an empty batch (T = 0, or no sequences): about 3 % of the cases,
// decided by a stream of its own, so that every other case draws what it drew before. Its tensors
// of zero rows have null data (as torch's empty tensors), unless padding rows give them bytes.
bool empty_batch(uint64_t seed, const char* config_name);

// Index values of T rows (and rows - T padding rows of wild values the op must never read).
// Slots: in [0, num_slots) (distinct: each at most once), a few padding (< 0), a few past the
// cache, a few far out of range (far_index).
// Positions: in [0, max_pos), a few outside, a few far outside, as slots.
std::vector<int64_t> draw_slots(Rng& rng, int64_t T, int64_t rows, int64_t num_slots,
                                DType index_dtype, bool distinct);
std::vector<int64_t> draw_positions(Rng& rng, int64_t T, int64_t rows, int64_t max_pos,
                                    DType index_dtype);
// An index far out of range of [0, n) for `index_dtype`: int32: INT32_MIN or INT32_MAX; int64:
// 2^32 past a valid index (a backend that drops the high word lands on it), INT64_MAX or
// INT64_MIN.
int64_t far_index(Rng& rng, int64_t n, DType index_dtype);

// A model dtype: bfloat16 (60 %), float16 (20 %) or float32.
DType draw_model_dtype(Rng& rng);
// A cos/sin table dtype: float32 (70 %), bfloat16 (15 %) or float16.
DType draw_table_dtype(Rng& rng);

// What a case's first T indices hold that the op must skip or clamp (and count), for its
// description: " N padding slots M slots past the cache", " K positions clamped" (or "").
std::string bad_slots_note(const std::vector<int64_t>& slots, int64_t T, int64_t num_slots);
std::string clamped_positions_note(const std::vector<int64_t>& positions, int64_t T,
                                   int64_t max_pos);

// A random fp32 scale in [0.004, 0.05) as its 4 bytes (a cache's or q_out's per-tensor scale).
std::vector<uint8_t> scale_bytes(Rng& rng);

// A cos/sin table [max_pos, R] whose rows lie row_stride elements apart (the gaps random).
std::vector<uint8_t> strided_rope_table(int64_t max_pos, int64_t R, DType dtype, int64_t row_stride,
                                        Rng& rng);

// The cache formats, cycled over a config's cases.
inline constexpr CacheFormat kCacheFormats[] = {
    CacheFormat::kBFloat16,   CacheFormat::kFloat16,    CacheFormat::kFloat32,
    CacheFormat::kFloat8E4M3, CacheFormat::kFloat8E5M2, CacheFormat::kFloat8DsMla};
constexpr int kNumCacheFormats = 6;
// Case i's format: the formats in turn, fp8_ds_mla only where L = 512 and R = 64 (elsewhere one
// of the others, by seed).
int cycled_format_index(int i, int64_t L, int64_t R, uint64_t seed);

// The formats a config's cases used: "(N cache formats)".
class FormatTally {
 public:
  void reset() { seen_ = 0; }
  void add(CacheFormat format);
  std::string note() const;

 private:
  int seen_ = 0;
};

// A random paged cache of one format: its geometry and layout (combined, or split into a latent
// and a rope part; entries and blocks sometimes padded apart), and its per-tensor fp8 scale or
// fp8_ds_mla pow2 rounding.
struct CacheLayout {
  CacheFormat format = CacheFormat::kBFloat16;
  int64_t L = 0, R = 0, block_size = 0, num_blocks = 0;
  bool split = false;
  int64_t token_pad_bytes = 0;       // after every entry (split: every latent part)
  int64_t rope_token_pad_bytes = 0;  // split: after every rope part
  int64_t block_pad_bytes = 0;       // after every block (both parts)
  bool scaled = false;               // per-tensor fp8 with a scale pointer
  bool pow2 = false;                 // fp8_ds_mla: tile scales rounded up to powers of two

  // At least `min_slots` slots in one of a few block sizes (1 to 128), a few blocks to spare.
  static CacheLayout draw(Rng& rng, CacheFormat format, int64_t L, int64_t R, int64_t min_slots);
  int64_t num_slots() const { return num_blocks * block_size; }
  // Bytes from one entry (split: latent part) to the next, and of the two buffers.
  int64_t entry_stride() const;
  int64_t rope_entry_stride() const;  // split only
  size_t data_bytes() const;
  size_t rope_bytes() const;  // 0 unless split
  KVCacheView view(void* data, void* rope_data, const float* scale, Device device) const;
  // "cache fp8_e4m3 split padded bs 16 blocks 7 scaled"
  std::string describe() const;
};

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

// mla_rope_cache (check_fused.cpp).
std::unique_ptr<Family> make_fused_family();
// rmsnorm_quant, mla_rmsnorm_quant, per_token_group_quant_fp8 (check_norm.cpp).
std::unique_ptr<Family> make_norm_family();
// rotary_embedding, concat_and_cache_mla, decode_q_concat, rms_norm (check_unfused.cpp).
std::unique_ptr<Family> make_unfused_family();
// gather_cache_slots, gather_cache_sequences (check_gather.cpp).
std::unique_ptr<Family> make_gather_family();

}  // namespace check
}  // namespace cli
}  // namespace mlakv
