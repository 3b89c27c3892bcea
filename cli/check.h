// mlakv CLI: `mlakv check`'s op families (check_{fused,norm,unfused,gather}.cpp) and
// what they share with the driver (check.cpp): a run's buffers and counters, the device copies a
// backend runs on, the random source of a case.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mlakv/mlakv.h"
#include "util.h"

namespace mlakv {
namespace cli {
namespace check {

constexpr uint8_t kPoisonByte = 0xA5;    // outputs before the op: every byte must be written
constexpr uint8_t kSentinelByte = 0x5C;  // bytes the op must leave alone

// An optional output: absent, its own buffer, or the input it replaces (in place).
enum class Alias { kNone, kSeparate, kInPlace };

// What one run of a case left in its buffers (by buffer id; empty: not used by the case) and in the
// error counters. `names` names the buffers of the case's op family.
struct Run {
  const char* (*names)(int) = nullptr;
  std::vector<std::vector<uint8_t>> result;
  std::array<int32_t, kNumErrorCounters> counts = {};
  bool ran() const { return !result.empty(); }
};

// The random source of one case: seeded from a hash of the seed, the config's name (FNV-1a:
// configs with equal shapes differ) and `salt`, so that seed s + 1 is not seed s's stream one draw
// later (SplitMix64 seeded with s * its own increment would be).
Rng case_rng(uint64_t seed, const char* config_name, uint64_t salt);

// Copies of `initial` on `device` (nullptr for an unused buffer); the run's result is read back
// from them, cut to each buffer's size.
struct DeviceCopies {
  std::vector<Buffer> buffers;
  std::vector<void*> base;

  DeviceCopies(const std::vector<std::vector<uint8_t>>& initial, Device device);
  void read_back(const std::vector<std::vector<uint8_t>>& initial, Run* run) const;
};

// The host reference's pointers into a run's buffers (nullptr for an unused buffer).
std::vector<void*> host_pointers(Run* run);

// A random paged cache of one format: its geometry and layout (combined, with or without padding
// after each entry, or split), and whether a per-tensor fp8 cache has a scale.
struct CacheLayout {
  CacheFormat format = CacheFormat::kBFloat16;
  int64_t L = 0, R = 0, block_size = 0, num_blocks = 0;
  bool split = false;
  int64_t token_pad_bytes = 0;  // extra bytes after every entry (combined layout)
  bool scaled = false;

  // At least `min_slots` slots in one of a few block sizes (1 to 128), a few blocks to spare.
  static CacheLayout draw(Rng& rng, CacheFormat format, int64_t L, int64_t R, int64_t min_slots);
  int64_t num_slots() const { return num_blocks * block_size; }
  // Bytes from one entry (split: latent part) to the next, and of the two buffers.
  int64_t entry_stride() const;
  size_t data_bytes() const;
  size_t rope_bytes() const;  // 0 unless split
  KVCacheView view(void* data, void* rope_data, const float* scale, Device device) const;
  // "cache fp8_e4m3 split bs 16 blocks 7 scaled"
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
