// mlakv: the command-line tool. `mlakv info | check | bench`.
#include <CLI/CLI.hpp>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "commands.h"
#include "mlakv/mlakv.h"

namespace {

// A float option that must be finite and at least FLT_MIN: CLI::PositiveNumber lets NaN through
// (it fails no comparison), and a value past FLT_MAX would become inf as a float.
const CLI::Validator kPositiveNormalFloat(
    [](std::string& text) {
      char* end = nullptr;
      const float v = std::strtof(text.c_str(), &end);
      if (end == text.c_str() || *end != '\0' || !std::isfinite(v) || v < FLT_MIN) {
        char min[32];
        std::snprintf(min, sizeof(min), "%g", static_cast<double>(FLT_MIN));
        return "expected a finite float of at least " + std::string(min) + ", got " + text;
      }
      return std::string();
    },
    "FLOAT > 0");

// Builds the options and runs the chosen command; main turns what it throws (mlakv::Error, and
// anything the option setup itself could throw) into exit status 2.
int run(int argc, char** argv) {
  using mlakv::cli::BenchOptions;
  using mlakv::cli::CheckOptions;

  CLI::App app{"mlakv: fused RoPE + paged KV-cache write for Multi-head Latent Attention"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string(mlakv::version()));

  CLI::App* info = app.add_subcommand("info", "Version, build options, backends and devices");

  CheckOptions check_options;
  CLI::App* check = app.add_subcommand(
      "check",
      "Differential test of every backend against the host reference (exit 1 on any "
      "mismatch)");
  check->add_option("--seeds", check_options.seeds, "Random cases per named config")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  check->add_option("--first-seed", check_options.first_seed, "Seed of the first case")
      ->capture_default_str();
  check->add_option("--backend", check_options.backend, "Backends to test")
      ->check(CLI::IsMember({"cpu", "cuda", "all"}))
      ->capture_default_str();
  check
      ->add_option("--ops", check_options.ops,
                   "The ops to test: mla_rope_cache (the fused op), rmsnorm_quant (with "
                   "mla_rmsnorm_quant and per_token_group_quant_fp8), unfused (rotary_embedding, "
                   "concat_and_cache_mla, decode_q_concat, rms_norm), gather "
                   "(gather_cache_slots and gather_cache_sequences), or all")
      ->check(CLI::IsMember({"mla_rope_cache", "rmsnorm_quant", "unfused", "gather", "all"}))
      ->capture_default_str();
  check->add_flag("-v,--verbose", check_options.verbose, "One line per case");
  check
      ->add_option("--device", check_options.device,
                   "The CUDA backend's GPU, cuda:N (the current device stays cuda:0)")
      ->check(CLI::Range(0, 1023))
      ->capture_default_str();

  BenchOptions bench_options;
  CLI::App* bench = app.add_subcommand(
      "bench", "DeepSeek-V3 shapes: fused op vs unfused primitives vs a copy of the same bytes");
  bench
      ->add_option("--backend", bench_options.backend,
                   "auto: CUDA if built and a GPU is visible, else CPU")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  bench
      ->add_option("--workload", bench_options.workloads,
                   "Workloads (comma separated): decode_bf16, decode_bf16_norm, decode_fp8, "
                   "decode_fp8_cache, decode_ds_mla, decode_nope_in_q_out, prefill_bf16, "
                   "mixed_bf16, rmsnorm_quant_qc, mla_rmsnorm_quant; default all")
      ->delimiter(',');
  // T up to 2^24: the byte counts of the largest row (T * H * (L + R) * ...) stay far from int64.
  bench->add_option("--tokens", bench_options.tokens, "Token counts T (comma separated)")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  bench->add_option("--iters", bench_options.iters, "Timed runs per measurement (0: adaptive)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  bench->add_option("--json", bench_options.json_path, "Write every number to this JSON file");
  bench->add_flag("--skip-check", bench_options.skip_check,
                  "Skip the correctness check before timing");
  bench->add_flag("--pdl", bench_options.pdl,
                  "CUDA: launch every timed op (fused, unfused, the launch floor's kernel) with "
                  "programmatic dependent launch (Context::pdl)");
  bench
      ->add_option("--q-scale", bench_options.q_scale,
                   "The fp8 q_out workloads' q_scale (the scale q_out is quantized by)")
      ->check(kPositiveNormalFloat)
      ->capture_default_str();
  bench
      ->add_option("--heads", bench_options.heads,
                   "Query heads on the device: 128 for DeepSeek-V3 without tensor parallelism, "
                   "128 / TP with it (16 at TP 8); Kimi-K2 has DeepSeek-V3's widths with 64 heads "
                   "(8 at TP 8) (the mla_rope_cache workloads; the norm rows do not depend on it)")
      ->check(CLI::Range(int64_t{1}, int64_t{1024}))
      ->capture_default_str();
  bench->add_flag("--shared-indices", bench_options.shared_indices,
                  "The mla_rope_cache rows' input sets share one positions and one slot_mapping, "
                  "as the layers of one step do (their cos/sin rows then stay in cache); each set "
                  "writes a cache of its own, as each layer does");
  bench->add_option("--device", bench_options.device, "The CUDA backend's GPU, cuda:N")
      ->check(CLI::Range(0, 1023))
      ->capture_default_str();

  CLI11_PARSE(app, argc, argv);

  if (info->parsed()) return mlakv::cli::run_info();
  if (check->parsed()) return mlakv::cli::run_check(check_options);
  if (bench->parsed()) return mlakv::cli::run_bench(bench_options);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // mlakv::Error included
    std::fprintf(stderr, "mlakv: error: %s\n", e.what());
    return 2;
  }
}
