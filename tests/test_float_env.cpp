// mlakv tests: the CPU backend and the host-built RoPE tables give the same bytes whatever
// floating-point environment the caller left on its thread (src/common/float_env.h): another
// rounding mode, flush-to-zero / denormals-are-zero as a -ffast-math library sets them, or a trap.
// Each op runs on this thread (one thread) and on a fresh thread whose OpenMP workers are left in
// that environment too (two threads), and every thread's environment is intact afterwards.
#include <gtest/gtest.h>
#include <omp.h>

#include <cfenv>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "fused_problem.h"
#include "harness.h"

namespace mlakv {
namespace test {
namespace {

constexpr Device kCpu{};

// The environments a caller may leave: directed rounding, and (x86-64) FTZ + DAZ with round to
// nearest, the pair -ffast-math's startup code sets.
struct CallerEnv {
  const char* name;
  int rounding;
  bool ftz_daz = false;
  bool trap_invalid = false;  // feenableexcept(FE_INVALID): an invalid operation raises SIGFPE
};
std::vector<CallerEnv> caller_envs() {
  std::vector<CallerEnv> envs = {
      {"upward", FE_UPWARD}, {"downward", FE_DOWNWARD}, {"toward zero", FE_TOWARDZERO}};
#if defined(__x86_64__)
  envs.push_back({"ftz+daz", FE_TONEAREST, true});
  envs.push_back({"upward, ftz+daz", FE_UPWARD, true});
#endif
#if defined(__GLIBC__)
  envs.push_back({"trap on invalid", FE_TONEAREST, false, true});
#endif
  return envs;
}

#if defined(__x86_64__)
constexpr unsigned kFtzDaz = 0x8040;  // MXCSR: flush-to-zero (bit 15), denormals-are-zero (bit 6)
#endif

// Sets `env` on this thread; whether it is still set; back to the default.
void set_env(const CallerEnv& env) {
  std::fesetround(env.rounding);
#if defined(__x86_64__)
  if (env.ftz_daz) _mm_setcsr(_mm_getcsr() | kFtzDaz);
#endif
#if defined(__GLIBC__)
  if (env.trap_invalid) feenableexcept(FE_INVALID);
#endif
}

bool has_env(const CallerEnv& env) {
  bool same = std::fegetround() == env.rounding;
#if defined(__x86_64__)
  same = same && (_mm_getcsr() & kFtzDaz) == (env.ftz_daz ? kFtzDaz : 0u);
#endif
#if defined(__GLIBC__)
  same = same && ((fegetexcept() & FE_INVALID) != 0) == env.trap_invalid;
#endif
  return same;
}

void clear_env() {
#if defined(__GLIBC__)
  fedisableexcept(FE_ALL_EXCEPT);
#endif
#if defined(__x86_64__)
  _mm_setcsr(_mm_getcsr() & ~kFtzDaz);
#endif
  std::fesetround(FE_TONEAREST);
  std::feclearexcept(FE_ALL_EXCEPT);
}

// Runs f with `env` set on this thread, then checks that the environment is still `env` (the
// library put the caller's back) and restores the default.
void in_env(const CallerEnv& env, const std::function<void()>& f) {
  set_env(env);
  f();
  const bool kept = has_env(env);
  clear_env();
  EXPECT_TRUE(kept) << env.name << ": the caller's environment changed";
}

// Runs a call (given as `f`) in `env`: Around takes it and runs it.
using Around = std::function<void(const std::function<void()>&)>;

// Calls g(ctx, around) twice: with one thread, `around` running the call in `env` on this thread;
// with two threads, on a fresh thread in `env` whose OpenMP workers were left in `env` too (by a
// parallel region of the caller's own before the call: the library's regions reuse the workers).
void in_env_both_ways(const CallerEnv& env,
                      const std::function<void(const Context&, const Around&)>& g) {
  Context one;
  one.num_threads = 1;
  g(one, [&](const std::function<void()>& f) { in_env(env, f); });
  Context two;
  two.num_threads = 2;
  g(two, [&](const std::function<void()>& f) {
    std::thread thread([&] {
      in_env(env, [&] {
#pragma omp parallel num_threads(2)
        set_env(env);
        f();
        // The library's regions put every worker's own environment back.
        int restored[2] = {0, 0};
#pragma omp parallel num_threads(2)
        restored[omp_get_thread_num() % 2] = has_env(env) ? 1 : 0;
        EXPECT_TRUE(restored[0] == 1 && restored[1] == 1) << env.name << ": a worker's environment";
#pragma omp parallel num_threads(2)
        if (omp_get_thread_num() != 0) clear_env();  // the workers; in_env clears this thread
      });
    });
    thread.join();
  });
}

// ---- the fused op, against the reference -------------------------------------------------------

FusedSpec env_spec(const std::string& name, CacheFormat format) {
  FusedSpec s;
  s.name = name;
  s.T = 64;  // 64 tokens of 16 heads: past kSerialBytes, so two threads are used
  s.Td = 24;
  s.cache.format = format;
  s.cache.num_blocks = 8;
  s.norm = true;
  s.k_pe_out = true;
  s.kv_c_out = true;
  return s;
}

TEST(CallerFloatEnv, FusedOpGivesTheReferenceBytes) {
  std::vector<FusedSpec> specs;
  FusedSpec fp8 = env_spec("fp8 cache, fp8 q_out", CacheFormat::kFloat8E4M3);
  fp8.cache.scale = 0.0625f;
  fp8.q_out_dtype = DType::kFloat8E4M3;
  fp8.q_scale = 0.02f;
  specs.push_back(fp8);
  FusedSpec ds = env_spec("fp8_ds_mla, tiny tiles", CacheFormat::kFloat8DsMla);
  ds.tiny_tiles = 8;
  ds.prefill_out = true;
  specs.push_back(ds);
  specs.push_back(env_spec("bf16 cache", CacheFormat::kBFloat16));
  for (const FusedSpec& spec : specs) {
    for (const CallerEnv& env : caller_envs()) {
      SCOPED_TRACE(spec.name + std::string(", ") + env.name);
      in_env_both_ways(env, [&](const Context& ctx, const Around& around) {
        FusedProblem p(spec, kCpu);
        p.run_reference();  // in the default environment
        around([&] { p.launch(ctx); });
        p.expect_matches();
      });
    }
  }
}

// ---- every other op, against its own bytes in the default environment ------------------------

// One op's call on fresh inputs of a fixed seed (made in the default environment), the call run by
// `around`; returns the bytes of everything it writes.
using OpRun = std::function<std::vector<std::vector<uint8_t>>(const Context&, const Around&)>;

constexpr int64_t kT = 64, kL = 512, kR = 64, kH = 16;

std::vector<int64_t> positions() {
  std::vector<int64_t> p(kT);
  for (int64_t t = 0; t < kT; ++t) p[static_cast<size_t>(t)] = (t * 37) % 256;
  return p;
}

std::vector<int64_t> slots() {
  std::vector<int64_t> s(kT);
  for (int64_t t = 0; t < kT; ++t) s[static_cast<size_t>(t)] = (t * 5) % 128;  // 128 slots
  return s;
}

OpRun rotary_run() {
  return [](const Context& ctx, const Around& around) {
    std::mt19937_64 rng(11);
    Tensor q = random_tensor(kCpu, DType::kBFloat16, {kT, kH, kR}, rng);
    Tensor k = random_tensor(kCpu, DType::kBFloat16, {kT, 1, kR}, rng);
    Tensor cs = random_tensor(kCpu, DType::kFloat32, {256, kR}, rng, 1.0f);  // a cos/sin table
    Tensor pos = index_tensor(kCpu, DType::kInt64, positions());
    RotaryEmbeddingParams p;
    p.num_tokens = kT;
    p.positions = pos.device_view();
    p.query = q.device_view();
    p.key = k.device_view();
    p.cos_sin_cache = cs.device_view();
    around([&] { rotary_embedding(p, ctx); });
    return std::vector<std::vector<uint8_t>>{q.buffer->download(), k.buffer->download()};
  };
}

OpRun concat_run() {
  return [](const Context& ctx, const Around& around) {
    std::mt19937_64 rng(12);
    Tensor kv_c = random_tensor(kCpu, DType::kBFloat16, {kT, kL}, rng);
    Tensor k_pe = random_tensor(kCpu, DType::kBFloat16, {kT, kR}, rng);
    Tensor slot = index_tensor(kCpu, DType::kInt64, slots());
    CacheGeometry g;
    g.format = CacheFormat::kFloat8E4M3;
    g.scale = 0.0625f;
    TestCache cache = new_cache(kCpu, g);
    cache.data->upload();
    cache.scale.buffer->upload();
    ConcatAndCacheMlaParams p;
    p.num_tokens = kT;
    p.kv_c = kv_c.device_view();
    p.k_pe = k_pe.device_view();
    p.slot_mapping = slot.device_view();
    p.kv_cache = cache.device_view();
    around([&] { concat_and_cache_mla(p, ctx); });
    return std::vector<std::vector<uint8_t>>{cache.data->download()};
  };
}

OpRun decode_q_run() {
  return [](const Context& ctx, const Around& around) {
    std::mt19937_64 rng(13);
    Tensor nope = random_tensor(kCpu, DType::kBFloat16, {kT, kH, kL}, rng);
    Tensor pe = random_tensor(kCpu, DType::kBFloat16, {kT, kH, kR}, rng);
    Tensor out = poisoned_tensor(kCpu, DType::kFloat8E4M3, {kT, kH, kL + kR});
    const float q_scale = 0.03f;
    DecodeQConcatParams p;
    p.num_tokens = kT;
    p.ql_nope = nope.device_view();
    p.q_pe = pe.device_view();
    p.q_out = out.device_view();
    p.q_scale = &q_scale;
    around([&] { decode_q_concat(p, ctx); });
    return std::vector<std::vector<uint8_t>>{out.buffer->download()};
  };
}

// tiny: |x| <= 1e-20, whose squares are subnormal (flush-to-zero drops them from the sum).
OpRun rms_norm_run(bool tiny) {
  return [tiny](const Context& ctx, const Around& around) {
    std::mt19937_64 rng(14);
    Tensor in = random_tensor(kCpu, DType::kBFloat16, {kT, kL}, rng, tiny ? 1e-20f : 2.0f);
    Tensor w = random_tensor(kCpu, DType::kBFloat16, {kL}, rng);
    Tensor out = poisoned_tensor(kCpu, DType::kBFloat16, {kT, kL});
    RmsNormParams p;
    p.num_tokens = kT;
    p.input = in.device_view();
    p.weight = w.device_view();
    p.output = out.device_view();
    p.eps = tiny ? 1e-38f : 1e-6f;
    around([&] { rms_norm(p, ctx); });
    return std::vector<std::vector<uint8_t>>{out.buffer->download()};
  };
}

// The cache is written with scale 0.0417 (not a power of two: the read-back's products round) and
// read back with `read_scale`; 3e-38 makes most products subnormal (flush-to-zero drops them).
OpRun gather_run(bool sequences, float read_scale) {
  return [sequences, read_scale](const Context& ctx, const Around& around) {
    std::mt19937_64 rng(15);
    CacheGeometry g;
    g.format = CacheFormat::kFloat8E4M3;
    g.scale = 0.0417f;
    TestCache cache = new_cache(kCpu, g);
    fill_cache_with_entries(kCpu, cache, rng);
    set_scalar_f32(cache.scale, read_scale);
    cache.scale.buffer->upload();
    Tensor out = poisoned_tensor(kCpu, DType::kBFloat16, {kT, kL + kR});
    if (!sequences) {
      Tensor slot = index_tensor(kCpu, DType::kInt64, slots());
      GatherCacheSlotsParams p;
      p.num_tokens = kT;
      p.kv_cache = cache.device_view();
      p.slots = slot.device_view();
      p.out = out.device_view();
      around([&] { gather_cache_slots(p, ctx); });
    } else {
      // Two sequences of 40 and 24 tokens over blocks of 16.
      Tensor table = new_tensor(kCpu, DType::kInt32, {2, 3});
      const int32_t blocks[6] = {5, 0, 7, 2, 6, 1};
      std::memcpy(table.buffer->host.data(), blocks, sizeof blocks);
      table.buffer->upload();
      Tensor cu = index_tensor(kCpu, DType::kInt32, {0, 40, kT});
      GatherCacheSequencesParams p;
      p.num_seqs = 2;
      p.kv_cache = cache.device_view();
      p.block_table = table.device_view();
      p.cu_seq_lens = cu.device_view();
      p.out = out.device_view();
      around([&] { gather_cache_sequences(p, ctx); });
    }
    return std::vector<std::vector<uint8_t>>{out.buffer->download()};
  };
}

// The rmsnorm_quant family on fp32 rows of 1536 (q_c's width). tiny: values whose squares are
// subnormal (|x| <= 1e-20, x^2 <= 1e-40 < FLT_MIN), which flush-to-zero would drop from the sum of
// squares; eps keeps the mean normal. Row 3 holds an inf: its sum of squares is inf, and inf times
// the row's 1 / rms (0) is an invalid operation (NaN), which a caller's trap would turn into
// SIGFPE.
enum class NormOp { kRmsNormQuant, kDual, kGroupQuant };
OpRun norm_quant_run(NormOp op, bool tiny) {
  return [op, tiny](const Context& ctx, const Around& around) {
    std::mt19937_64 rng(16);
    constexpr int64_t N = 1536;
    const float amplitude = tiny ? 1e-20f : 2.0f;
    Tensor in = random_tensor(kCpu, DType::kFloat32, {kT, N}, rng, amplitude);
    const float inf = std::numeric_limits<float>::infinity();
    std::memcpy(in.buffer->host.data() + (3 * N + 5) * sizeof(float), &inf, sizeof inf);
    in.buffer->upload();
    Tensor w = random_tensor(kCpu, DType::kFloat32, {N}, rng);
    Tensor residual = random_tensor(kCpu, DType::kFloat32, {kT, N}, rng, amplitude);
    Tensor normed = poisoned_tensor(kCpu, DType::kFloat32, {kT, N});
    Tensor values = poisoned_tensor(kCpu, DType::kFloat8E4M3, {kT, N});
    Tensor scales = poisoned_tensor(kCpu, DType::kFloat32, {kT, N / 128});
    Tensor kv = random_tensor(kCpu, DType::kFloat32, {kT, kL}, rng, amplitude);
    Tensor kv_w = random_tensor(kCpu, DType::kFloat32, {kL}, rng);
    Tensor kv_out = poisoned_tensor(kCpu, DType::kFloat32, {kT, kL});
    RmsNormQuantParams p;
    p.num_tokens = kT;
    p.input = in.device_view();
    p.weight = w.device_view();
    p.eps = tiny ? 1e-38f : 1e-6f;
    p.residual = residual.device_view();
    p.normed_out = normed.device_view();
    p.quant.values = values.device_view();
    p.quant.scales = scales.device_view();
    switch (op) {
      case NormOp::kRmsNormQuant:
        around([&] { rmsnorm_quant(p, ctx); });
        break;
      case NormOp::kDual: {
        MlaRmsNormQuantParams d;
        d.q = p;
        d.kv.num_tokens = kT;
        d.kv.input = kv.device_view();
        d.kv.weight = kv_w.device_view();
        d.kv.eps = p.eps;
        d.kv.output = kv_out.device_view();
        around([&] { mla_rmsnorm_quant(d, ctx); });
        break;
      }
      case NormOp::kGroupQuant: {
        PerTokenGroupQuantParams g;
        g.num_tokens = kT;
        g.input = in.device_view();
        g.quant = p.quant;
        around([&] { per_token_group_quant_fp8(g, ctx); });
        break;
      }
    }
    return std::vector<std::vector<uint8_t>>{residual.buffer->download(), normed.buffer->download(),
                                             values.buffer->download(), scales.buffer->download(),
                                             kv_out.buffer->download()};
  };
}

TEST(CallerFloatEnv, EveryOpGivesTheDefaultEnvironmentsBytes) {
  const std::vector<std::pair<const char*, OpRun>> ops = {
      {"rotary_embedding", rotary_run()},
      {"concat_and_cache_mla", concat_run()},
      {"decode_q_concat", decode_q_run()},
      {"rms_norm", rms_norm_run(false)},
      {"rms_norm, tiny rows", rms_norm_run(true)},
      {"gather_cache_slots", gather_run(false, 0.0417f)},
      {"gather_cache_slots, subnormal products", gather_run(false, 3e-38f)},
      {"gather_cache_sequences", gather_run(true, 0.0417f)},
      {"gather_cache_sequences, subnormal products", gather_run(true, 3e-38f)},
      {"rmsnorm_quant", norm_quant_run(NormOp::kRmsNormQuant, false)},
      {"rmsnorm_quant, tiny rows", norm_quant_run(NormOp::kRmsNormQuant, true)},
      {"mla_rmsnorm_quant", norm_quant_run(NormOp::kDual, false)},
      {"mla_rmsnorm_quant, tiny rows", norm_quant_run(NormOp::kDual, true)},
      {"per_token_group_quant_fp8", norm_quant_run(NormOp::kGroupQuant, false)},
      {"per_token_group_quant_fp8, tiny rows", norm_quant_run(NormOp::kGroupQuant, true)}};
  for (const auto& op : ops) {
    // Named copies: a lambda cannot capture a structured binding in C++17.
    const char* name = op.first;
    const OpRun& run = op.second;
    const std::vector<std::vector<uint8_t>> want =
        run(Context{}, [](const std::function<void()>& f) { f(); });
    for (const CallerEnv& env : caller_envs()) {
      SCOPED_TRACE(std::string(name) + ", " + env.name);
      in_env_both_ways(env, [&](const Context& ctx, const Around& around) {
        const std::vector<std::vector<uint8_t>> got = run(ctx, around);
        ASSERT_EQ(got.size(), want.size());
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_TRUE(bytes_equal(got[i], want[i],
                                  std::string(name) + " output " + std::to_string(i) + ", " +
                                      std::to_string(ctx.num_threads) + " thread(s)"));
        }
      });
    }
  }
}

// ---- the tables ---------------------------------------------------------------------------------

TEST(CallerFloatEnv, TablesAreTheSame) {
  RopeTableConfig rope;
  rope.max_position = 512;
  YarnRopeConfig yarn;
  yarn.original_max_position = 64;
  auto build = [&] {
    std::vector<std::vector<uint8_t>> out;
    for (const std::vector<double>& t : {rope_cos_sin_table(rope), yarn_cos_sin_table(yarn)}) {
      for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
        std::vector<uint8_t> bytes(t.size() * dtype_size(dt));
        round_table(t, dt, bytes.data());
        out.push_back(bytes);
      }
    }
    const double m = yarn_softmax_scale_multiplier(40.0, 0.707);
    const int64_t positions = yarn.max_position();
    std::vector<uint8_t> scalars(sizeof m + sizeof positions);
    std::memcpy(scalars.data(), &m, sizeof m);
    std::memcpy(scalars.data() + sizeof m, &positions, sizeof positions);
    out.push_back(scalars);
    return out;
  };
  const std::vector<std::vector<uint8_t>> want = build();
  for (const CallerEnv& env : caller_envs()) {
    SCOPED_TRACE(env.name);
    in_env(env, [&] {
      const std::vector<std::vector<uint8_t>> got = build();
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_TRUE(bytes_equal(got[i], want[i], "table " + std::to_string(i)));
      }
    });
  }
}

}  // namespace
}  // namespace test
}  // namespace mlakv
