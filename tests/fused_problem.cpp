// mlakv tests: the fused-op problem builder (see fused_problem.h).
#include "fused_problem.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include "reference/reference.h"

namespace mlakv {
namespace test {
namespace {

enum class Kind { kNormal, kPadding, kBadSlot };

// Which tokens t < T are padding / bad slots / bad positions: a function of the spec only.
std::vector<Kind> slot_kinds(const FusedSpec& s) {
  std::vector<Kind> kinds(static_cast<size_t>(s.T), Kind::kNormal);
  if (s.padding_every > 0) {
    for (int64_t t = s.padding_every - 1; t < s.T; t += s.padding_every) kinds[t] = Kind::kPadding;
  }
  int64_t left = s.bad_slots;
  for (int64_t t = s.bad_slot_start; t < s.T && left > 0; t += 2) {
    if (kinds[t] == Kind::kNormal) {
      kinds[t] = Kind::kBadSlot;
      --left;
    }
  }
  return kinds;
}

std::vector<bool> bad_position_tokens(const FusedSpec& s) {
  std::vector<bool> bad(static_cast<size_t>(s.T), false);
  int64_t left = s.bad_positions;
  for (int64_t t = s.T - 1; t >= 0 && left > 0; t -= 2, --left) bad[t] = true;
  return bad;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The decode and prefill entry points fix Td (ops.h): they ignore a device Td.
bool entry_reads_device_td(Entry entry) { return entry == Entry::kFused || entry == Entry::kMixed; }

void fill_table(const Tensor& table, int64_t R) {
  const int64_t half = R / 2;
  auto& h = table.buffer->host;
  for (int64_t p = 0; p < table.shape[0]; ++p) {
    for (int64_t i = 0; i < half; ++i) {
      const double inv_freq = std::pow(10000.0, -2.0 * static_cast<double>(i) / R);
      const double angle = static_cast<double>(p) * inv_freq;
      ref::store_value(h.data() + table.byte_offset({p, i}), table.dtype,
                       static_cast<float>(std::cos(angle)));
      ref::store_value(h.data() + table.byte_offset({p, half + i}), table.dtype,
                       static_cast<float>(std::sin(angle)));
    }
  }
}

}  // namespace

void PrintTo(const FusedSpec& spec, std::ostream* os) { *os << spec.name; }

std::vector<int32_t> planned_error_counts(const FusedSpec& spec) {
  std::vector<int32_t> counts(kNumErrorCounters, 0);
  for (Kind k : slot_kinds(spec)) counts[kBadSlot] += k == Kind::kBadSlot;
  for (bool b : bad_position_tokens(spec)) counts[kBadPosition] += b;
  if (spec.device_td && entry_reads_device_td(spec.entry) &&
      (spec.device_td_value < 0 || spec.device_td_value > spec.T)) {
    counts[kBadDecodeCount] = 1;
  }
  return counts;
}

int64_t FusedProblem::effective_host_td() const {
  switch (spec.entry) {
    case Entry::kDecode:
      return spec.T;
    case Entry::kPrefill:
      return 0;
    default:
      return spec.Td;
  }
}

FusedProblem::FusedProblem(const FusedSpec& s, Device dev) : spec(s), device(dev), counts(dev) {
  std::mt19937_64 rng(spec.seed);
  const int64_t H = spec.shape.H, L = spec.shape.L, R = spec.shape.R, P = spec.shape.P;
  const int64_t T = spec.T;
  const int64_t pad = spec.row_pad;
  const DType model = spec.model;
  const DType idx = spec.index32 ? DType::kInt32 : DType::kInt64;
  rows = T + spec.extra_rows;

  // Cache: a few blocks more than needed, so some blocks stay entirely untouched.
  CacheGeometry g = spec.cache;
  g.L = L;
  g.R = R;
  g.num_blocks = ceil_div(rows + 5, g.block_size) + 2;
  if (!cache_is_per_tensor_fp8(g.format)) g.scale = 0.0f;
  cache = new_cache(dev, g);
  const int64_t num_slots = cache.num_slots();

  // Slots: distinct, shuffled (tokens land across page boundaries); rows >= T get slots no token
  // uses and out-of-table positions, so touching them shows up in the cache or the counters.
  std::vector<int64_t> perm(static_cast<size_t>(num_slots));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  const std::vector<Kind> kinds = slot_kinds(spec);
  const std::vector<bool> bad_pos = bad_position_tokens(spec);
  // The cache's last slot goes to the first normally written token (swapped into its place in
  // the permutation, so slots stay distinct): the edge slot < num_slots is written, not skipped.
  for (int64_t t = 0; t < T; ++t) {
    if (kinds[t] != Kind::kNormal) continue;
    std::swap(perm[t], *std::find(perm.begin(), perm.end(), num_slots - 1));
    break;
  }
  std::vector<int64_t> slots(static_cast<size_t>(rows)), pos(static_cast<size_t>(rows));
  std::uniform_int_distribution<int64_t> pos_dist(0, spec.max_pos - 1);
  const int64_t bad_pos_values[] = {-1, spec.max_pos, spec.max_pos + 1000, -100000};
  int64_t bad_slot_index = 0, bad_pos_index = 0;
  for (int64_t t = 0; t < rows; ++t) {
    slots[t] = perm[t];
    pos[t] = pos_dist(rng);
    if (t >= T) {
      pos[t] = spec.max_pos + 7;
      continue;
    }
    if (kinds[t] == Kind::kPadding) slots[t] = -1 - (t % 3);
    if (kinds[t] == Kind::kBadSlot) {
      const int64_t k = bad_slot_index++;
      slots[t] = (k % 3 == 2 && !spec.index32) ? (int64_t{1} << 40) : num_slots + 13 * k;
    }
    if (bad_pos[t]) pos[t] = bad_pos_values[bad_pos_index++ % 4];
  }
  // The table's last row: the first and the last token with a valid position (a decode and a
  // prefill token in a mixed batch) read row max_pos - 1, which is in range, not clamped.
  for (int64_t t = 0; t < T; ++t) {
    if (bad_pos[t]) continue;
    pos[t] = spec.max_pos - 1;
    break;
  }
  for (int64_t t = T - 1; t >= 0; --t) {
    if (bad_pos[t]) continue;
    pos[t] = spec.max_pos - 1;
    break;
  }
  positions = new_tensor(dev, idx, {rows});
  fill_random(*positions.buffer, idx, rng);
  set_indices(positions, pos);
  slot_mapping = new_tensor(dev, idx, {rows});
  set_indices(slot_mapping, slots);

  cos_sin = new_strided_tensor(dev, spec.table_dtype, spec.max_pos * (R + pad), {spec.max_pos, R},
                               {R + pad, 1});
  fill_random(*cos_sin.buffer, spec.table_dtype, rng);
  fill_table(cos_sin, R);

  // K side.
  if (spec.kv_a_fused) {
    Tensor kv_a = padded_rows(dev, model, rows, L + R, pad);
    kv_c = kv_a.view(0, {rows, L}, {L + R + pad, 1});
    k_pe = kv_a.view(L, {rows, R}, {L + R + pad, 1});
    fill_random(*kv_a.buffer, model, rng, spec.amplitude);
  } else {
    kv_c = padded_rows(dev, model, rows, L, pad);
    k_pe = padded_rows(dev, model, rows, R, pad);
    fill_random(*kv_c.buffer, model, rng, spec.amplitude);
    fill_random(*k_pe.buffer, model, rng, spec.amplitude);
  }
  for (int64_t k = 0; k < spec.zero_tiles && 2 * k < T; ++k) {
    for (int64_t i = 0; i < kDsMlaTileElems; ++i) {
      const int64_t col = (k % kDsMlaNumTiles) * kDsMlaTileElems + i;
      ref::store_value(kv_c.buffer->host.data() + kv_c.byte_offset({2 * k, col}), model, 0.0f);
    }
  }
  for (int64_t k = 0; k < spec.tiny_tiles && 2 * k + 1 < T; ++k) {
    for (int64_t i = 0; i < kDsMlaTileElems; ++i) {
      const int64_t col = ((k + 1) % kDsMlaNumTiles) * kDsMlaTileElems + i;
      const float x = (i % 2 == 0 ? 1e-37f : -1e-37f) * (1.0f + static_cast<float>(i % 13) / 4.0f);
      ref::store_value(kv_c.buffer->host.data() + kv_c.byte_offset({2 * k + 1, col}), model, x);
    }
  }
  if (spec.norm) {
    weight = new_tensor(dev, model, {L});
    fill_random(*weight.buffer, model, rng, 1.5f);
  }
  if (spec.k_pe_out) {
    k_pe_out = spec.outs_in_place ? k_pe : padded_rows(dev, model, rows, R, pad);
    if (!spec.outs_in_place) fill_bytes(*k_pe_out.buffer, kPoisonByte);
  }
  if (spec.kv_c_out) {
    kv_c_out = spec.outs_in_place ? kv_c : padded_rows(dev, model, rows, L, pad);
    if (!spec.outs_in_place) fill_bytes(*kv_c_out.buffer, kPoisonByte);
  }

  // Prefill q (also the home of the decode q_pe when q_pe_in_q).
  if (spec.prefill_q || spec.q_pe_in_q) {
    q = padded_heads(dev, model, rows, H, P + R, pad, spec.in_head_pad);
    fill_random(*q.buffer, model, rng, spec.amplitude);
  }
  if (spec.prefill_q && spec.prefill_out) {
    q_prefill_out = padded_heads(dev, model, rows, H, P + R, pad, spec.out_head_pad);
    fill_bytes(*q_prefill_out.buffer, kPoisonByte);
  }

  // Decode q.
  if (spec.decode_q) {
    const int64_t qrows = spec.decode_rows_exact ? effective_host_td() : rows;
    const DType qd = is_float8(spec.q_out_dtype) ? spec.q_out_dtype : model;
    if (spec.q_pe_in_q) {
      q_pe = q.view(q.offset + P, {qrows, H, R}, {q.stride[0], q.stride[1], 1});
    } else if (spec.q_pe_head_major) {
      q_pe = new_strided_tensor(dev, model, H * qrows * R, {qrows, H, R}, {R, qrows * R, 1});
      fill_random(*q_pe.buffer, model, rng, spec.amplitude);
    } else {
      q_pe = padded_heads(dev, model, qrows, H, R, pad, spec.in_head_pad);
      fill_random(*q_pe.buffer, model, rng, spec.amplitude);
    }
    q_out = padded_heads(dev, qd, qrows, H, L + R, pad, spec.out_head_pad);
    if (spec.nope == Nope::kCopy) {
      fill_bytes(*q_out.buffer, kPoisonByte);
      ql_nope = padded_heads(dev, model, qrows, H, L, pad, spec.in_head_pad);
      fill_random(*ql_nope.buffer, model, rng, spec.amplitude);
    } else {
      // The absorb GEMM's output already sits in q_out's nope part; it must stay as it is.
      fill_random(*q_out.buffer, qd, rng, spec.amplitude);
      if (spec.nope == Nope::kAliased) {
        ql_nope = q_out.view(q_out.offset, {qrows, H, L}, {q_out.stride[0], q_out.stride[1], 1});
      }
    }
    if (spec.q_scale > 0.0f) {
      q_scale = new_tensor(dev, DType::kFloat32, {1});
      set_scalar_f32(q_scale, spec.q_scale);
    }
  }
  if (spec.device_td) {
    device_td = new_tensor(dev, DType::kInt32, {1});
    set_indices(device_td, {spec.device_td_value});
  }

  // Upload every buffer once (views share buffers).
  std::vector<Buffer*> uploaded;
  for (const Tensor* t :
       {&positions, &slot_mapping, &cos_sin, &kv_c, &k_pe, &weight, &k_pe_out, &kv_c_out, &q_pe,
        &ql_nope, &q_out, &q_scale, &q, &q_prefill_out, &device_td, &cache.scale}) {
    if (!t->present()) continue;
    if (std::find(uploaded.begin(), uploaded.end(), t->buffer.get()) != uploaded.end()) continue;
    uploaded.push_back(t->buffer.get());
    t->buffer->upload();
  }
  cache.data->upload();
  if (cache.rope_data) cache.rope_data->upload();
}

MlaRopeCacheParams FusedProblem::params(bool host) const {
  auto v = [&](const Tensor& t) { return host ? t.host_view() : t.device_view(); };
  MlaRopeCacheParams p;
  p.num_tokens = spec.T;
  p.num_decode_tokens = spec.Td;
  if (host) p.num_decode_tokens = effective_host_td();
  // The library gets the device Td whatever the entry point; the reference only where it is read.
  // (With it, the host Td must be 0; the decode entry point sets its own.)
  if (device_td.present() && (!host || entry_reads_device_td(spec.entry))) {
    p.num_decode_tokens_device = static_cast<const int32_t*>(v(device_td).data);
    p.num_decode_tokens = 0;
  }
  p.positions = v(positions);
  p.slot_mapping = v(slot_mapping);
  p.cos_sin_cache = v(cos_sin);
  p.rope_style = spec.style;
  p.kv_c = v(kv_c);
  p.k_pe = v(k_pe);
  p.kv_norm_weight = v(weight);
  p.kv_norm_eps = spec.kv_norm_eps;
  p.kv_cache = host ? cache.host_view() : cache.device_view();
  p.k_pe_out = v(k_pe_out);
  p.kv_c_out = v(kv_c_out);
  if (spec.decode_q) {
    p.q_pe = v(q_pe);
    p.ql_nope = v(ql_nope);
    p.q_out = v(q_out);
    if (q_scale.present()) p.q_scale = static_cast<const float*>(v(q_scale).data);
  }
  if (spec.prefill_q) {
    p.q = v(q);
    p.q_prefill_out = v(q_prefill_out);
  }
  return p;
}

std::vector<int32_t> FusedProblem::run_reference() {
  std::vector<int32_t> c(kNumErrorCounters, 0);
  ref::mla_rope_cache(params(true), c.data());
  return c;
}

std::vector<int32_t> FusedProblem::run_library(bool checked) {
  Context ctx;
  ctx.error_counts = counts.device_ptr();
  ctx.checked = checked;
  launch(ctx);
  return counts.read();
}

void FusedProblem::launch(const Context& ctx) const {
  const MlaRopeCacheParams p = params(false);
  switch (spec.entry) {
    case Entry::kFused:
      mla_rope_cache(p, ctx);
      break;
    case Entry::kDecode:
      mla_rope_cache_decode(p, ctx);
      break;
    case Entry::kPrefill:
      mla_rope_cache_prefill(p, ctx);
      break;
    case Entry::kMixed:
      mla_rope_cache_mixed(p, ctx);
      break;
  }
}

void FusedProblem::expect_matches() const {
  const int64_t T = spec.T;
  std::map<const Buffer*, std::string> buffers;  // aliased tensors share a buffer: one name
  std::vector<const Buffer*> outputs;
  auto add = [&](const Tensor& t, const std::string& name, bool output) {
    if (!t.present()) return;
    std::string& names = buffers[t.buffer.get()];
    names += names.empty() ? name : "/" + name;
    if (output) outputs.push_back(t.buffer.get());
  };
  add(positions, "positions", false);
  add(slot_mapping, "slot_mapping", false);
  add(cos_sin, "cos_sin_cache", false);
  add(kv_c, "kv_c", false);
  add(k_pe, "k_pe", false);
  add(weight, "kv_norm_weight", false);
  add(k_pe_out, "k_pe_out", true);
  add(kv_c_out, "kv_c_out", true);
  add(q_pe, "q_pe", false);
  add(ql_nope, "ql_nope", false);
  add(q_out, "q_out", spec.decode_q);
  add(q_scale, "q_scale", false);
  add(q, "q", spec.prefill_q && !spec.prefill_out);
  add(q_prefill_out, "q_prefill_out", true);
  add(device_td, "num_decode_tokens_device", false);
  add(cache.scale, "cache scale", false);
  for (const auto& [buffer, names] : buffers) {
    EXPECT_TRUE(buffer_matches(*buffer, names));
    if (std::find(outputs.begin(), outputs.end(), buffer) == outputs.end()) {
      EXPECT_TRUE(buffer_unchanged(*buffer, names));
    }
  }
  std::vector<int64_t> written;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slot_mapping.host_index(t);
    if (s >= 0 && s < cache.num_slots()) written.push_back(s);
  }
  expect_cache_matches(cache, written, "kv_cache");
}

MlaRopeCacheParams with_unused_strides(MlaRopeCacheParams p, int64_t junk) {
  for (TensorView* t :
       {&p.positions, &p.slot_mapping, &p.cos_sin_cache, &p.kv_c, &p.k_pe, &p.kv_norm_weight,
        &p.k_pe_out, &p.kv_c_out, &p.q_pe, &p.ql_nope, &p.q_out, &p.q, &p.q_prefill_out}) {
    *t = with_unused_strides(*t, junk);
  }
  return p;
}

void run_fused_case(const FusedSpec& spec, Device device) {
  SCOPED_TRACE("spec " + spec.name + " on " + device_name(device));
  FusedProblem problem(spec, device);
  const std::vector<int32_t> expected = problem.run_reference();
  EXPECT_EQ(counts_to_string(expected), counts_to_string(planned_error_counts(spec)))
      << "the reference's counters disagree with the plan";
  const std::vector<int32_t> got = problem.run_library();
  EXPECT_EQ(counts_to_string(got), counts_to_string(expected)) << "error counters";
  problem.expect_matches();
}

}  // namespace test
}  // namespace mlakv
