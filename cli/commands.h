// mlakv CLI: the three commands and their options.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mlakv {
namespace cli {

// `mlakv info`: version, build options, backends and devices.
int run_info();

struct CheckOptions {
  int seeds = 20;  // random cases per named config
  uint64_t first_seed = 1;
  std::string backend = "all";  // cpu | cuda | all
  bool verbose = false;         // one line per case as well as the one per config
  int device = 0;               // the CUDA backend's GPU (cuda:N)
  // mla_rope_cache | rmsnorm_quant (with mla_rmsnorm_quant, per_token_group_quant_fp8) | unfused
  // (rotary_embedding, concat_and_cache_mla, decode_q_concat, rms_norm) | gather
  // (gather_cache_slots, gather_cache_sequences) | all
  std::string ops = "all";
};
// `mlakv check`: randomized differential test of every backend against the reference.
int run_check(const CheckOptions& options);

struct BenchOptions {
  std::string backend = "auto";        // auto | cpu | cuda
  std::vector<std::string> workloads;  // empty: all
  std::vector<int64_t> tokens;         // empty: each workload's default list
  int iters = 0;                       // timed runs per measurement; 0: adaptive
  std::string json_path;               // empty: no JSON
  bool skip_check = false;             // skip the correctness check before timing
  bool pdl = false;                    // CUDA: every timed op with programmatic dependent launch
  float q_scale = 0.01953125f;         // the fp8 q_out workloads' q_scale (5 / 256)
  int device = 0;                      // the CUDA backend's GPU (cuda:N)
  // Query heads on the GPU: 128 (DeepSeek-V3 without tensor parallelism, or with data-parallel
  // attention), 128 / TP with it (16 at TP 8); Kimi-K2 has the same widths with 64 heads.
  int64_t heads = 128;
  // The mla_rope_cache rows' input sets share one positions and one slot_mapping (set 0's), as
  // the layers of one engine step share them, and each set writes a cache of its own, as each
  // layer has its own. Without it every set has its own indices and all sets write one cache.
  bool shared_indices = false;
};
// `mlakv bench`: DeepSeek-V3 shapes, fused op vs unfused primitives vs a copy of the same bytes.
int run_bench(const BenchOptions& options);

}  // namespace cli
}  // namespace mlakv
