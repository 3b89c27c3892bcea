// mlakv tests: the CPU backend and the host-built RoPE tables give the same bytes whatever
// floating-point environment the caller left on its thread (src/common/float_env.h): another
// rounding mode, or flush-to-zero / denormals-are-zero as a -ffast-math library sets them. Each op
// runs on this thread (one thread) and on a fresh thread whose environment its OpenMP workers
// inherit (two threads), and the caller's environment is intact afterwards.
#include <gtest/gtest.h>

#include <cfenv>
#include <cstdint>
#include <cstring>
#include <functional>
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
  bool ftz_daz;
};
std::vector<CallerEnv> caller_envs() {
  std::vector<CallerEnv> envs = {{"upward", FE_UPWARD, false},
                                 {"downward", FE_DOWNWARD, false},
                                 {"toward zero", FE_TOWARDZERO, false}};
#if defined(__x86_64__)
  envs.push_back({"ftz+daz", FE_TONEAREST, true});
  envs.push_back({"upward, ftz+daz", FE_UPWARD, true});
#endif
  return envs;
}

#if defined(__x86_64__)
constexpr unsigned kFtzDaz = 0x8040;  // MXCSR: flush-to-zero (bit 15), denormals-are-zero (bit 6)
#endif

// Sets `env` on this thread.
void set_env(const CallerEnv& env) {
  std::fesetround(env.rounding);
#if defined(__x86_64__)
  if (env.ftz_daz) _mm_setcsr(_mm_getcsr() | kFtzDaz);
#endif
}

// Runs f with `env` set on this thread, then checks that the environment is still `env` (the
// library put the caller's back) and restores the default.
void in_env(const CallerEnv& env, const std::function<void()>& f) {
  set_env(env);
  f();
  const int rounding_after = std::fegetround();
#if defined(__x86_64__)
  const unsigned ftz_daz_after = _mm_getcsr() & kFtzDaz;
  _mm_setcsr(_mm_getcsr() & ~kFtzDaz);
#endif
  std::fesetround(FE_TONEAREST);
  EXPECT_EQ(rounding_after, env.rounding) << env.name << ": the caller's rounding mode changed";
#if defined(__x86_64__)
  EXPECT_EQ(ftz_daz_after, env.ftz_daz ? kFtzDaz : 0u) << env.name << ": FTZ / DAZ changed";
#endif
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

Tensor table(std::mt19937_64& rng) {
  Tensor t = new_tensor(kCpu, DType::kFloat32, {256, kR});
  fill_random(*t.buffer, DType::kFloat32, rng, 1.0f);
  t.buffer->upload();
  return t;
}

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
    Tensor cs = table(rng);
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

OpRun rms_norm_run() {
  return [](const Context& ctx, const Around& around) {
    std::mt19937_64 rng(14);
    Tensor in = random_tensor(kCpu, DType::kBFloat16, {kT, kL}, rng);
    Tensor w = random_tensor(kCpu, DType::kBFloat16, {kL}, rng);
    Tensor out = poisoned_tensor(kCpu, DType::kBFloat16, {kT, kL});
    RmsNormParams p;
    p.num_tokens = kT;
    p.input = in.device_view();
    p.weight = w.device_view();
    p.output = out.device_view();
    around([&] { rms_norm(p, ctx); });
    return std::vector<std::vector<uint8_t>>{out.buffer->download()};
  };
}

OpRun gather_run() {
  return [](const Context& ctx, const Around& around) {
    std::mt19937_64 rng(15);
    CacheGeometry g;
    g.format = CacheFormat::kFloat8E4M3;
    g.scale = 0.0625f;
    TestCache cache = new_cache(kCpu, g);
    fill_cache_with_entries(kCpu, cache, rng);
    Tensor slot = index_tensor(kCpu, DType::kInt64, slots());
    Tensor out = poisoned_tensor(kCpu, DType::kBFloat16, {kT, kL + kR});
    GatherCacheSlotsParams p;
    p.num_tokens = kT;
    p.kv_cache = cache.device_view();
    p.slots = slot.device_view();
    p.out = out.device_view();
    around([&] { gather_cache_slots(p, ctx); });
    return std::vector<std::vector<uint8_t>>{out.buffer->download()};
  };
}

OpRun rmsnorm_quant_run(bool tiny) {
  return [tiny](const Context& ctx, const Around& around) {
    std::mt19937_64 rng(16);
    constexpr int64_t N = 1536;
    // tiny: values whose squares are subnormal (|x| <= 1e-20, x^2 <= 1e-40 < FLT_MIN), which
    // flush-to-zero would drop from the sum of squares; eps keeps the mean normal.
    const float amplitude = tiny ? 1e-20f : 2.0f;
    Tensor in = random_tensor(kCpu, DType::kFloat32, {kT, N}, rng, amplitude);
    Tensor w = random_tensor(kCpu, DType::kFloat32, {N}, rng);
    Tensor residual = random_tensor(kCpu, DType::kFloat32, {kT, N}, rng, amplitude);
    Tensor normed = poisoned_tensor(kCpu, DType::kFloat32, {kT, N});
    Tensor values = poisoned_tensor(kCpu, DType::kFloat8E4M3, {kT, N});
    Tensor scales = poisoned_tensor(kCpu, DType::kFloat32, {kT, N / 128});
    RmsNormQuantParams p;
    p.num_tokens = kT;
    p.input = in.device_view();
    p.weight = w.device_view();
    p.eps = tiny ? 1e-38f : 1e-6f;
    p.residual = residual.device_view();
    p.normed_out = normed.device_view();
    p.quant.values = values.device_view();
    p.quant.scales = scales.device_view();
    around([&] { rmsnorm_quant(p, ctx); });
    return std::vector<std::vector<uint8_t>>{residual.buffer->download(), normed.buffer->download(),
                                             values.buffer->download(), scales.buffer->download()};
  };
}

TEST(CallerFloatEnv, EveryOpGivesTheDefaultEnvironmentsBytes) {
  const std::vector<std::pair<const char*, OpRun>> ops = {
      {"rotary_embedding", rotary_run()},
      {"concat_and_cache_mla", concat_run()},
      {"decode_q_concat", decode_q_run()},
      {"rms_norm", rms_norm_run()},
      {"gather_cache_slots", gather_run()},
      {"rmsnorm_quant", rmsnorm_quant_run(false)},
      {"rmsnorm_quant, tiny rows", rmsnorm_quant_run(true)}};
  for (const auto& [name, run] : ops) {
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
