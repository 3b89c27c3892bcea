// mlakv tests: one fused-op problem (mla_rope_cache and its entry points), built from a spec,
// run on the reference (host mirror) and on a backend, and compared buffer by buffer.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "harness.h"

namespace mlakv {
namespace test {

// A named model shape.
struct ModelShape {
  const char* name;
  int64_t H, L, R, P;
};
constexpr ModelShape kDeepSeekV3{"dsv3", 128, 512, 64, 128};
constexpr ModelShape kDeepSeekV3Tp8{"dsv3tp8", 16, 512, 64, 128};
constexpr ModelShape kKimiK2{"kimik2", 64, 512, 64, 128};
constexpr ModelShape kDeepSeekV2Lite{"dsv2lite", 16, 512, 64, 128};
constexpr ModelShape kMiniCpm3{"minicpm3", 40, 256, 32, 64};
// DeepSeek-V3's widths on 2 heads: large launches whose K items dominate (the K items' order).
constexpr ModelShape kDeepSeekV3H2{"dsv3h2", 2, 512, 64, 128};
// And on 3 heads: a head count that items of 2 rows do not divide.
constexpr ModelShape kDeepSeekV3H3{"dsv3h3", 3, 512, 64, 128};

enum class Entry { kFused, kDecode, kPrefill, kMixed };
// How q_out's nope part is produced: copied from ql_nope, already there (ql_nope absent), or
// ql_nope given as a view of q_out's own nope part.
enum class Nope { kCopy, kAbsent, kAliased };

struct FusedSpec {
  std::string name;
  ModelShape shape = kDeepSeekV3Tp8;
  int64_t T = 7;
  int64_t Td = 3;  // host Td (kFused / kMixed)
  Entry entry = Entry::kFused;
  DType model = DType::kBFloat16;
  DType table_dtype = DType::kFloat32;
  RopeStyle style = RopeStyle::kGptJ;
  int64_t max_pos = 1024;
  CacheGeometry cache;  // format, block_size, split/pads, scale, pow2 (L, R, num_blocks derived)
  float amplitude = 2.0f;
  // Tokens 0, 2, 4, ... (this many, < T) get one whole 128-value tile of kv_c set to exactly 0
  // (tile k % 4 for the k-th of them; fill_random never makes a 0): an all-zero fp8_ds_mla tile,
  // whose scale is the floor FLT_MIN and whose bytes are all 0 (DESIGN.md). Needs L >= 512.
  int64_t zero_tiles = 0;
  // Tokens 1, 3, 5, ... (this many, < T) get one whole tile of kv_c (tile (k + 1) % 4) of tiny
  // nonzero values, |x| <= 4e-37, so that amax / 448 is under FLT_MIN: an fp8_ds_mla tile whose
  // scale is the floor FLT_MIN (DESIGN.md) and whose bytes are not 0. Needs L >= 512 and a bf16
  // or fp32 model (fp16 has no such values).
  int64_t tiny_tiles = 0;

  bool norm = false;
  float kv_norm_eps = 1e-6f;  // the RMSNorm's eps (with norm)
  bool k_pe_out = false;
  bool kv_c_out = false;
  bool outs_in_place = false;  // k_pe_out = k_pe, kv_c_out = kv_c

  bool decode_q = true;
  DType q_out_dtype = DType::kBFloat16;  // replaced by `model` unless float8
  float q_scale = 0.0f;                  // fp8 q_out: the q_scale tensor value; 0 = none
  Nope nope = Nope::kCopy;
  bool prefill_q = true;
  bool prefill_out = false;  // q_prefill_out instead of in place

  // Layouts.
  int64_t extra_rows = 2;   // per-token tensors have T + extra_rows rows
  int64_t row_pad = 0;      // extra elements at the end of every row of kv_c / k_pe / q / q_out
  bool kv_a_fused = false;  // kv_c and k_pe: column views of one [rows, L + R] buffer
  bool q_pe_in_q = false;   // decode q_pe: a view of q[..., P:] (rows < Td)
  bool q_pe_head_major = false;    // q_pe [rows, H, R] viewed from a [H, rows, R] buffer
  bool index32 = false;            // int32 positions and slots
  bool decode_rows_exact = false;  // decode-only tensors have exactly Td rows (host Td)
  int64_t out_head_pad = 0;        // extra elements after every head of q_out / q_prefill_out
  int64_t in_head_pad = 0;         // ... of q, q_pe and ql_nope

  // Safety.
  int64_t padding_every = 0;   // every k-th token (k > 0) is padding (slot -1)
  int64_t bad_slots = 0;       // number of tokens with a slot past the cache end
  int64_t bad_slot_start = 1;  // ... the first of them; then every second token
  int64_t bad_positions = 0;   // number of tokens with a position outside the table
  bool device_td = false;      // given to every entry point; kDecode / kPrefill must ignore it
  int32_t device_td_value = 0;
  uint64_t seed = 1;
};

// gtest prints parameters with these (the spec's name, the backend's name).
void PrintTo(const FusedSpec& spec, std::ostream* os);

// Expected counters of a spec, derived from the spec alone (not from the reference).
std::vector<int32_t> planned_error_counts(const FusedSpec& spec);

class FusedProblem {
 public:
  FusedProblem(const FusedSpec& spec, Device device);
  // Runs the reference on the host mirrors and returns its counters.
  std::vector<int32_t> run_reference();
  // Runs the library on the device copies; returns its counters.
  std::vector<int32_t> run_library(bool checked = false);
  // Launches the spec's entry point on the device copies with `ctx` (no counters read back).
  void launch(const Context& ctx) const;
  // Compares every buffer with its host mirror (reference output), checks the cache sentinel and
  // that inputs are unchanged.
  void expect_matches() const;

  MlaRopeCacheParams params(bool host) const;
  int64_t effective_host_td() const;

  FusedSpec spec;
  Device device;
  int64_t rows = 0;
  Tensor positions, slot_mapping, cos_sin, kv_c, k_pe, weight, k_pe_out, kv_c_out;
  Tensor q_pe, ql_nope, q_out, q_scale, q, q_prefill_out, device_td;
  TestCache cache;
  ErrorCounts counts;
};

// `p` with with_unused_strides(view, junk) applied to every tensor view in it (the cache keeps its
// own: CacheGeometry::unused_stride_bytes).
MlaRopeCacheParams with_unused_strides(MlaRopeCacheParams p, int64_t junk);

// Runs one spec on one backend against the reference, with all checks.
void run_fused_case(const FusedSpec& spec, Device device);

}  // namespace test
}  // namespace mlakv
