// mlakv CLI: `mlakv check`. A randomized differential test of the ops, by family (--ops): the fused
// op (mla_rope_cache, check_fused.cpp), the input norms (rmsnorm_quant, mla_rmsnorm_quant,
// per_token_group_quant_fp8, check_norm.cpp), the unfused primitives (rotary_embedding,
// concat_and_cache_mla, decode_q_concat, rms_norm, check_unfused.cpp) and the cache read-back
// (gather_cache_slots, gather_cache_sequences, check_gather.cpp). For every named config and seed,
// one random case is run by the host reference and by every backend; every byte of every buffer
// (inputs included: they must stay untouched) and every error counter must match the reference, and
// CUDA must match the CPU, RMSNorm-derived values included (docs/decisions.md: one fixed sum
// order).
#include "check.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "mlakv/mlakv.h"
#include "util.h"

namespace mlakv {
namespace cli {
namespace check {

Rng case_rng(uint64_t seed, const char* config_name, uint64_t salt) {
  uint64_t name_hash = 1469598103934665603ull;
  for (const char* ch = config_name; *ch != '\0'; ++ch) {
    name_hash = (name_hash ^ static_cast<uint8_t>(*ch)) * 1099511628211ull;
  }
  return Rng(Rng(seed * 0x9e3779b97f4a7c15ull + salt * 7919u + name_hash).next());
}

bool empty_batch(uint64_t seed, const char* config_name) {
  constexpr uint64_t kEmptyBatchSalt = 0xe3b7;
  return case_rng(seed, config_name, kEmptyBatchSalt).chance(0.03);
}

DeviceCopies::DeviceCopies(const std::vector<std::vector<uint8_t>>& initial, Device device)
    : buffers(initial.size()), base(initial.size(), nullptr) {
  for (size_t id = 0; id < initial.size(); ++id) {
    if (initial[id].empty()) continue;
    std::vector<uint8_t> bytes(initial[id].size() + 2 * kGuardBytes, kGuardByte);
    std::copy(initial[id].begin(), initial[id].end(), bytes.begin() + kGuardBytes);
    buffers[id] = Buffer(device, bytes.size());
    buffers[id].upload(bytes);
    base[id] = static_cast<uint8_t*>(buffers[id].data()) + kGuardBytes;
  }
}

std::vector<uint8_t> DeviceCopies::read(size_t id, bool* guards_kept) const {
  std::vector<uint8_t> bytes = buffers[id].download();
  const auto guard = [](uint8_t b) { return b == kGuardByte; };
  *guards_kept = std::all_of(bytes.begin(), bytes.begin() + kGuardBytes, guard) &&
                 std::all_of(bytes.end() - kGuardBytes, bytes.end(), guard);
  return std::vector<uint8_t>(bytes.begin() + kGuardBytes, bytes.end() - kGuardBytes);
}

void DeviceCopies::read_back(Run* run) const {
  run->result.resize(buffers.size());
  for (size_t id = 0; id < buffers.size(); ++id) {
    if (base[id] == nullptr) continue;
    bool guards_kept = true;
    run->result[id] = read(id, &guards_kept);
    if (!guards_kept && run->overrun.empty()) run->overrun = run->names(static_cast<int>(id));
  }
}

std::vector<void*> host_pointers(Run* run) {
  std::vector<void*> host(run->result.size(), nullptr);
  for (size_t id = 0; id < host.size(); ++id) {
    if (!run->result[id].empty()) host[id] = run->result[id].data();
  }
  return host;
}

int64_t far_index(Rng& rng, int64_t n, DType index_dtype) {
  if (index_dtype == DType::kInt32) {
    return rng.chance(0.5) ? std::numeric_limits<int32_t>::min()
                           : std::numeric_limits<int32_t>::max();
  }
  // Past int32 by exactly 2^32 (a backend that drops the high word lands on a real index), or an
  // extreme.
  const double roll = rng.uniform(0.0f, 1.0f);
  return roll < 0.6   ? (int64_t{1} << 32) + rng.below(n)
         : roll < 0.8 ? std::numeric_limits<int64_t>::max()
                      : std::numeric_limits<int64_t>::min();
}

std::vector<int64_t> draw_slots(Rng& rng, int64_t T, int64_t rows, int64_t num_slots,
                                DType index_dtype, bool distinct) {
  std::vector<int64_t> slots =
      distinct ? random_distinct_slots(T, num_slots, rng) : std::vector<int64_t>();
  slots.resize(static_cast<size_t>(rows));
  for (int64_t t = 0; t < rows; ++t) {
    int64_t& slot = slots[t];
    if (t >= T) {
      slot = num_slots * 100 + t;
      continue;
    }
    if (!distinct) slot = rng.below(num_slots);
    if (rng.chance(0.08)) slot = -1 - rng.below(4);
    if (rng.chance(0.04)) slot = num_slots + rng.below(100);
    if (rng.chance(0.01)) slot = far_index(rng, num_slots, index_dtype);
  }
  return slots;
}

std::vector<int64_t> draw_positions(Rng& rng, int64_t T, int64_t rows, int64_t max_pos,
                                    DType index_dtype) {
  std::vector<int64_t> positions(static_cast<size_t>(rows));
  for (int64_t t = 0; t < rows; ++t) {
    int64_t& pos = positions[t];
    if (t >= T) {
      pos = -1000000 - t;
      continue;
    }
    pos = rng.below(max_pos);
    if (rng.chance(0.03)) pos = rng.chance(0.5) ? -1 - rng.below(5) : max_pos + rng.below(5);
    if (rng.chance(0.01)) pos = far_index(rng, max_pos, index_dtype);
  }
  return positions;
}

DType draw_model_dtype(Rng& rng) {
  const double roll = rng.uniform(0.0f, 1.0f);
  return roll < 0.6 ? DType::kBFloat16 : (roll < 0.8 ? DType::kFloat16 : DType::kFloat32);
}

DType draw_table_dtype(Rng& rng) {
  const double roll = rng.uniform(0.0f, 1.0f);
  return roll < 0.7 ? DType::kFloat32 : (roll < 0.85 ? DType::kBFloat16 : DType::kFloat16);
}

std::string bad_slots_note(const std::vector<int64_t>& slots, int64_t T, int64_t num_slots) {
  int64_t padding = 0, past = 0;
  for (int64_t t = 0; t < T; ++t) {
    padding += slots[t] < 0 ? 1 : 0;
    past += slots[t] >= num_slots ? 1 : 0;
  }
  std::string s;
  if (padding > 0) s += " " + std::to_string(padding) + " padding slots";
  if (past > 0) s += " " + std::to_string(past) + " slots past the cache";
  return s;
}

std::string clamped_positions_note(const std::vector<int64_t>& positions, int64_t T,
                                   int64_t max_pos) {
  int64_t clamped = 0;
  for (int64_t t = 0; t < T; ++t) clamped += positions[t] < 0 || positions[t] >= max_pos ? 1 : 0;
  return clamped > 0 ? " " + std::to_string(clamped) + " positions clamped" : "";
}

std::vector<uint8_t> scale_bytes(Rng& rng) {
  const float scale = rng.uniform(0.004f, 0.05f);
  std::vector<uint8_t> b(sizeof(float));
  std::memcpy(b.data(), &scale, sizeof(float));
  return b;
}

std::vector<uint8_t> strided_rope_table(int64_t max_pos, int64_t R, DType dtype, int64_t row_stride,
                                        Rng& rng) {
  const std::vector<uint8_t> table = rope_table_bytes(max_pos, R, dtype);
  const size_t tb = dtype_size(dtype);
  std::vector<uint8_t> strided = random_values(dtype, max_pos * row_stride, 1.0f, rng);
  for (int64_t p = 0; p < max_pos; ++p) {
    std::memcpy(strided.data() + p * row_stride * tb, table.data() + p * R * tb, R * tb);
  }
  return strided;
}

int cycled_format_index(int i, int64_t L, int64_t R, uint64_t seed) {
  const int index = i % kNumCacheFormats;
  const bool ds_mla_fits = L == kDsMlaLatentDim && R == kDsMlaRopeDim;
  return index == 5 && !ds_mla_fits ? static_cast<int>(seed % 5) : index;
}

void FormatTally::add(CacheFormat format) {
  for (int f = 0; f < kNumCacheFormats; ++f) {
    if (kCacheFormats[f] == format) seen_ |= 1 << f;
  }
}

std::string FormatTally::note() const {
  int formats = 0;
  for (int f = 0; f < kNumCacheFormats; ++f) formats += (seen_ >> f) & 1;
  return "(" + std::to_string(formats) + " cache formats)";
}

CacheLayout CacheLayout::draw(Rng& rng, CacheFormat format, int64_t L, int64_t R,
                              int64_t min_slots) {
  CacheLayout c;
  c.format = format;
  c.L = L;
  c.R = R;
  const int64_t block_sizes[] = {1, 2, 3, 16, 17, 64, 128};
  c.block_size = block_sizes[rng.below(7)];
  c.num_blocks = (min_slots + c.block_size - 1) / c.block_size + rng.between(1, 3);
  c.split = format != CacheFormat::kFloat8DsMla && rng.chance(0.25);
  // Pads keep the alignment the validator asks (the latent element; fp8_ds_mla: its fp32 tile
  // scales), sometimes no more than that.
  const int64_t align = format == CacheFormat::kFloat8DsMla
                            ? 4
                            : static_cast<int64_t>(dtype_size(cache_latent_dtype(format)));
  const auto pad = [&] { return rng.chance(0.5) ? align : 32; };
  if (rng.chance(0.2)) c.token_pad_bytes = pad();
  if (c.split && rng.chance(0.3)) {
    c.rope_token_pad_bytes = static_cast<int64_t>(dtype_size(cache_rope_dtype(format))) * 2;
  }
  if (rng.chance(0.15)) c.block_pad_bytes = pad() * 2;
  c.scaled = cache_is_per_tensor_fp8(format) && rng.chance(0.85);
  c.pow2 = format == CacheFormat::kFloat8DsMla && rng.chance(0.5);
  return c;
}

int64_t CacheLayout::entry_stride() const {
  const int64_t entry = split ? L * static_cast<int64_t>(dtype_size(cache_latent_dtype(format)))
                              : cache_entry_bytes(format, L, R);
  return entry + token_pad_bytes;
}

int64_t CacheLayout::rope_entry_stride() const {
  return R * static_cast<int64_t>(dtype_size(cache_rope_dtype(format))) + rope_token_pad_bytes;
}

size_t CacheLayout::data_bytes() const {
  return static_cast<size_t>(num_blocks * (block_size * entry_stride() + block_pad_bytes));
}

size_t CacheLayout::rope_bytes() const {
  if (!split) return 0;
  return static_cast<size_t>(num_blocks * (block_size * rope_entry_stride() + block_pad_bytes));
}

KVCacheView CacheLayout::view(void* data, void* rope_data, const float* scale,
                              Device device) const {
  KVCacheView v;
  if (split) {
    v = make_split_cache_view(data, rope_data, format, num_blocks, block_size, L, R, device);
    v.stride_rope_token_bytes = rope_entry_stride();
    v.stride_rope_block_bytes = rope_entry_stride() * block_size + block_pad_bytes;
  } else {
    v = make_cache_view(data, format, num_blocks, block_size, L, R, device);
  }
  v.stride_token_bytes = entry_stride();
  v.stride_block_bytes = entry_stride() * block_size + block_pad_bytes;
  if (scaled) v.scale = scale;
  v.ds_mla_pow2_scale = pow2;
  return v;
}

std::string CacheLayout::describe() const {
  const bool padded = token_pad_bytes > 0 || rope_token_pad_bytes > 0 || block_pad_bytes > 0;
  return std::string("cache ") + cache_format_name(format) + (split ? " split" : "") +
         (padded ? " padded" : "") + " bs " + std::to_string(block_size) + " blocks " +
         std::to_string(num_blocks) + (scaled ? " scaled" : "") + (pow2 ? " pow2" : "");
}

}  // namespace check

namespace {

using check::Family;
using check::Run;

// ---- comparison: every byte (RMSNorm outputs too: the reference sums in the library's order) ----

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
  if (!got.overrun.empty()) {
    Mismatch m;
    m.found = true;
    m.text = got.overrun + ": bytes outside it were written";
    return m;
  }
  for (size_t id = 0; id < expected.result.size(); ++id) {
    Mismatch m = compare_buffer(expected.names(static_cast<int>(id)), got.result[id],
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
              options.ops == "all" ? "mla_rope_cache, rmsnorm_quant, unfused and gather"
                                   : options.ops.c_str(),
              options.seeds);
  for (const auto& b : backends) std::printf(" %s", b.first.c_str());
  std::printf(" (vs host reference%s)", cross ? "; cuda also vs cpu" : "");
  if (on_cuda) std::printf("; cuda = %s", device_name(backends.back().second).c_str());
  std::printf("\n");
  std::fflush(stdout);

  const bool progress = stderr_is_terminal();
  int total_cases = 0, total_failures = 0;
  std::vector<std::unique_ptr<Family>> families;
  const auto wanted = [&](const char* ops) { return options.ops == "all" || options.ops == ops; };
  if (wanted("mla_rope_cache")) families.push_back(check::make_fused_family());
  if (wanted("rmsnorm_quant")) families.push_back(check::make_norm_family());
  if (wanted("unfused")) families.push_back(check::make_unfused_family());
  if (wanted("gather")) families.push_back(check::make_gather_family());
  for (const std::unique_ptr<Family>& family : families) {
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
        const size_t failures_before = failures.size();
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
                      failures.size() == failures_before ? "ok" : "MISMATCH (see below)");
        }
      }
      if (progress) std::fprintf(stderr, "\r\033[K");

      std::printf("%-31s", config_name);
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
