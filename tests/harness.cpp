// mlakv tests: the harness (see harness.h).
#include "harness.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>

#include "reference/reference.h"

namespace mlakv {
namespace test {

// ---- backends ----------------------------------------------------------------------------------
std::vector<Backend> all_backends() {
  std::vector<Backend> out{{"cpu", Device{DeviceType::kCPU, 0}}};
  const int gpus = cuda_backend_built() ? cuda_device_count() : 0;
  if (gpus > 0) out.push_back({"cuda0", Device{DeviceType::kCUDA, 0}});
  // A second GPU's tensors while cuda:0 stays the current device: each op must select its
  // tensors' device itself.
  if (gpus > 1) out.push_back({"cuda1", Device{DeviceType::kCUDA, 1}});
  return out;
}

void PrintTo(const Backend& backend, std::ostream* os) { *os << backend.name; }

std::string backend_param_name(const testing::TestParamInfo<Backend>& info) {
  return info.param.name;
}

// ---- buffers -----------------------------------------------------------------------------------
Buffer::Buffer(Device device, size_t bytes) : host(bytes), device_(device) {
  device_ptr_ = device_alloc(device, std::max<size_t>(bytes, 1));
}

Buffer::~Buffer() {
  if (device_ptr_ == nullptr) return;
  // A kernel that faulted leaves the device's error sticky, and freeing reports it again. A
  // destructor must not throw (a test's buffers are destroyed while its first failure unwinds).
  try {
    device_free(device_, device_ptr_);
  } catch (const Error& e) {
    ADD_FAILURE() << "freeing a test buffer: " << e.what();
  }
}

void Buffer::upload() {
  initial = host;
  copy_host_to_device(device_, device_ptr_, host.data(), host.size());
}

std::vector<uint8_t> Buffer::download() const {
  std::vector<uint8_t> out(host.size());
  device_synchronize(device_);
  copy_device_to_host(device_, out.data(), device_ptr_, out.size());
  return out;
}

namespace {
TensorView view_on(const Tensor& t, void* base, Device device) {
  TensorView v;
  v.data = static_cast<char*>(base) + t.offset * static_cast<int64_t>(dtype_size(t.dtype));
  v.dtype = t.dtype;
  v.ndim = static_cast<int32_t>(t.shape.size());
  for (size_t d = 0; d < t.shape.size(); ++d) {
    v.shape[d] = t.shape[d];
    v.stride[d] = t.stride[d];
  }
  v.device = device;
  return v;
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> stride(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) {
    stride[d] = stride[d + 1] * shape[d + 1];
  }
  return stride;
}
}  // namespace

TensorView Tensor::host_view() const {
  if (!present()) return TensorView{};
  return view_on(*this, buffer->host.data(), Device{});
}

TensorView Tensor::device_view() const {
  if (!present()) return TensorView{};
  return view_on(*this, buffer->device_ptr(), buffer->device());
}

Tensor Tensor::view(int64_t new_offset, std::vector<int64_t> new_shape,
                    std::vector<int64_t> new_stride) const {
  Tensor t = *this;
  t.offset = new_offset;
  t.shape = std::move(new_shape);
  t.stride = std::move(new_stride);
  return t;
}

int64_t Tensor::byte_offset(std::initializer_list<int64_t> index) const {
  int64_t off = offset;
  size_t d = 0;
  for (int64_t i : index) off += i * stride[d++];
  return off * static_cast<int64_t>(dtype_size(dtype));
}

int64_t Tensor::host_index(int64_t i) const {
  const uint8_t* p = buffer->host.data() + byte_offset({i});
  if (dtype == DType::kInt64) {
    int64_t v;
    std::memcpy(&v, p, 8);
    return v;
  }
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

TensorView with_unused_strides(TensorView t, int64_t junk) {
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 1) t.stride[d] = junk;
  }
  return t;
}

Tensor new_tensor(Device device, DType dtype, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return new_strided_tensor(device, dtype, n, shape, contiguous_strides(shape));
}

Tensor new_strided_tensor(Device device, DType dtype, int64_t total_elems,
                          std::vector<int64_t> shape, std::vector<int64_t> stride, int64_t offset) {
  Tensor t;
  t.buffer = std::make_shared<Buffer>(device, static_cast<size_t>(total_elems) * dtype_size(dtype));
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.stride = std::move(stride);
  t.offset = offset;
  return t;
}

Tensor padded_rows(Device device, DType dtype, int64_t rows, int64_t cols, int64_t row_pad,
                   int64_t offset) {
  const int64_t row = cols + row_pad;
  return new_strided_tensor(device, dtype, offset + rows * row, {rows, cols}, {row, 1}, offset);
}

Tensor padded_heads(Device device, DType dtype, int64_t rows, int64_t H, int64_t cols,
                    int64_t row_pad, int64_t head_pad) {
  const int64_t head = cols + head_pad, row = H * head + row_pad;
  return new_strided_tensor(device, dtype, rows * row, {rows, H, cols}, {row, head, 1});
}

// ---- fills -------------------------------------------------------------------------------------
void fill_random(Buffer& buffer, DType dtype, std::mt19937_64& rng, float amplitude) {
  std::uniform_real_distribution<float> dist(-amplitude, amplitude);
  const size_t es = dtype_size(dtype);
  auto& h = buffer.host;
  if (dtype == DType::kInt32 || dtype == DType::kInt64 || dtype == DType::kUInt8) {
    for (auto& b : h) b = static_cast<uint8_t>(rng());
    return;
  }
  for (size_t i = 0; i + es <= h.size(); i += es) {
    float v = 0.0f;
    while (ref::round_to(v, dtype) == 0.0f) v = dist(rng);
    ref::store_value(h.data() + i, dtype, v);
  }
}

void fill_bytes(Buffer& buffer, uint8_t byte) {
  std::fill(buffer.host.begin(), buffer.host.end(), byte);
}

void set_indices(const Tensor& tensor, const std::vector<int64_t>& values) {
  for (size_t i = 0; i < values.size(); ++i) {
    uint8_t* p = tensor.buffer->host.data() + tensor.byte_offset({static_cast<int64_t>(i)});
    if (tensor.dtype == DType::kInt64) {
      std::memcpy(p, &values[i], 8);
    } else {
      const int32_t v = static_cast<int32_t>(values[i]);
      std::memcpy(p, &v, 4);
    }
  }
}

void set_scalar_f32(const Tensor& tensor, float value) {
  std::memcpy(tensor.buffer->host.data() + tensor.byte_offset({0}), &value, 4);
}

Tensor random_tensor(Device device, DType dtype, std::vector<int64_t> shape, std::mt19937_64& rng,
                     float amplitude) {
  return randomized(new_tensor(device, dtype, std::move(shape)), rng, amplitude);
}

Tensor poisoned_tensor(Device device, DType dtype, std::vector<int64_t> shape) {
  return poisoned(new_tensor(device, dtype, std::move(shape)));
}

Tensor randomized(Tensor tensor, std::mt19937_64& rng, float amplitude) {
  fill_random(*tensor.buffer, tensor.dtype, rng, amplitude);
  tensor.buffer->upload();
  return tensor;
}

Tensor poisoned(Tensor tensor) {
  fill_bytes(*tensor.buffer, kPoisonByte);
  tensor.buffer->upload();
  return tensor;
}

Tensor index_tensor(Device device, DType dtype, const std::vector<int64_t>& values) {
  Tensor t = new_tensor(device, dtype, {static_cast<int64_t>(values.size())});
  set_indices(t, values);
  t.buffer->upload();
  return t;
}

// ---- comparisons -------------------------------------------------------------------------------
namespace {
std::string hex(uint32_t v, int bytes) {
  std::ostringstream os;
  os << "0x" << std::hex;
  os.width(2 * bytes);
  os.fill('0');
  os << v;
  return os.str();
}
}  // namespace

testing::AssertionResult bytes_equal(const std::vector<uint8_t>& got,
                                     const std::vector<uint8_t>& expected,
                                     const std::string& what) {
  if (got.size() != expected.size()) {
    return testing::AssertionFailure()
           << what << ": size " << got.size() << " != expected " << expected.size();
  }
  constexpr int kMaxShown = 8;
  int64_t mismatches = 0;
  std::ostringstream os;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == expected[i]) continue;
    if (mismatches < kMaxShown) {
      os << "\n  byte " << i << ": got " << hex(got[i], 1) << ", expected " << hex(expected[i], 1);
    }
    ++mismatches;
  }
  if (mismatches == 0) return testing::AssertionSuccess();
  return testing::AssertionFailure() << what << ": " << mismatches << " mismatches of "
                                     << got.size() << " bytes; first:" << os.str();
}

testing::AssertionResult buffer_matches(const Buffer& buffer, const std::string& what) {
  return bytes_equal(buffer.download(), buffer.host, what);
}

testing::AssertionResult buffer_unchanged(const Buffer& buffer, const std::string& what) {
  return bytes_equal(buffer.download(), buffer.initial, what + " (must be unchanged)");
}

// ---- caches ------------------------------------------------------------------------------------
namespace {
KVCacheView cache_view(const TestCache& c, bool host) {
  const CacheGeometry& g = c.geometry;
  KVCacheView v;
  v.format = g.format;
  v.device = host ? Device{} : c.data->device();
  v.num_blocks = g.num_blocks;
  v.block_size = g.block_size;
  v.kv_lora_rank = g.L;
  v.rope_dim = g.R;
  v.data = host ? static_cast<void*>(c.data->host.data()) : c.data->device_ptr();
  const int64_t entry = cache_entry_bytes(g.format, g.L, g.R);
  if (g.split) {
    const int64_t es = static_cast<int64_t>(dtype_size(cache_latent_dtype(g.format)));
    v.stride_token_bytes = g.L * es + g.token_pad_bytes;
    v.stride_block_bytes = g.block_size * v.stride_token_bytes + g.block_pad_bytes;
    v.rope_data = host ? static_cast<void*>(c.rope_data->host.data()) : c.rope_data->device_ptr();
    v.stride_rope_token_bytes = g.R * es + g.token_pad_bytes;
    v.stride_rope_block_bytes = g.block_size * v.stride_rope_token_bytes + g.block_pad_bytes;
  } else {
    v.stride_token_bytes = entry + g.token_pad_bytes;
    v.stride_block_bytes = g.block_size * v.stride_token_bytes + g.block_pad_bytes;
  }
  if (g.unused_stride_bytes != 0 && g.block_size == 1) {
    v.stride_token_bytes = g.unused_stride_bytes;
    if (g.split) v.stride_rope_token_bytes = g.unused_stride_bytes;
  }
  if (g.unused_stride_bytes != 0 && g.num_blocks == 1) {
    v.stride_block_bytes = g.unused_stride_bytes;
    if (g.split) v.stride_rope_block_bytes = g.unused_stride_bytes;
  }
  if (c.scale.present()) {
    v.scale =
        static_cast<const float*>(host ? c.scale.host_view().data : c.scale.device_view().data);
  }
  v.ds_mla_pow2_scale = g.pow2;
  return v;
}
}  // namespace

KVCacheView TestCache::host_view() const { return cache_view(*this, true); }
KVCacheView TestCache::device_view() const { return cache_view(*this, false); }

TestCache new_cache(Device device, const CacheGeometry& g) {
  TestCache c;
  c.geometry = g;
  const int64_t entry = cache_entry_bytes(g.format, g.L, g.R);
  if (g.split) {
    const int64_t es = static_cast<int64_t>(dtype_size(cache_latent_dtype(g.format)));
    const int64_t lat_block = g.block_size * (g.L * es + g.token_pad_bytes) + g.block_pad_bytes;
    const int64_t rope_block = g.block_size * (g.R * es + g.token_pad_bytes) + g.block_pad_bytes;
    c.data = std::make_shared<Buffer>(device, static_cast<size_t>(g.num_blocks * lat_block));
    c.rope_data = std::make_shared<Buffer>(device, static_cast<size_t>(g.num_blocks * rope_block));
    fill_bytes(*c.rope_data, kSentinelByte);
  } else {
    const int64_t block = g.block_size * (entry + g.token_pad_bytes) + g.block_pad_bytes;
    c.data = std::make_shared<Buffer>(device, static_cast<size_t>(g.num_blocks * block));
  }
  fill_bytes(*c.data, kSentinelByte);
  if (g.scale > 0.0f) {
    c.scale = new_tensor(device, DType::kFloat32, {1});
    set_scalar_f32(c.scale, g.scale);
  }
  return c;
}

void fill_cache_with_entries(Device device, TestCache& cache, std::mt19937_64& rng) {
  const CacheGeometry& g = cache.geometry;
  const int64_t n = cache.num_slots();
  // fp32 values into fp32 and fp16 caches, so that a gather into bf16 must round them.
  const DType model = g.format == CacheFormat::kFloat32 || g.format == CacheFormat::kFloat16
                          ? DType::kFloat32
                          : DType::kBFloat16;
  Tensor kv_c = new_tensor(device, model, {n, g.L});
  Tensor k_pe = new_tensor(device, model, {n, g.R});
  Tensor slots = new_tensor(device, DType::kInt64, {n});
  fill_random(*kv_c.buffer, model, rng, 4.0f);
  fill_random(*k_pe.buffer, model, rng, 4.0f);
  std::vector<int64_t> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  set_indices(slots, all);
  ConcatAndCacheMlaParams p;
  p.num_tokens = n;
  p.kv_c = kv_c.host_view();
  p.k_pe = k_pe.host_view();
  p.slot_mapping = slots.host_view();
  p.kv_cache = cache.host_view();
  ref::concat_and_cache_mla(p);
  cache.data->upload();
  if (cache.rope_data) cache.rope_data->upload();
  if (cache.scale.present()) cache.scale.buffer->upload();
}

void expect_cache_matches(const TestCache& cache, const std::vector<int64_t>& written_slots,
                          const std::string& what) {
  const KVCacheView v = cache.host_view();
  const int64_t lat_bytes = ref::cache_latent_bytes(v);
  const int64_t rope_bytes = ref::cache_rope_bytes(v);
  const std::vector<uint8_t> got = cache.data->download();
  std::vector<uint8_t> got_rope;
  if (cache.rope_data) got_rope = cache.rope_data->download();

  // Sentinel: independent of the reference.
  std::vector<uint8_t> mask(got.size(), 0), rope_mask(got_rope.size(), 0);
  for (int64_t slot : written_slots) {
    const int64_t lo = ref::cache_latent_offset_bytes(v, slot);
    std::fill(mask.begin() + lo, mask.begin() + lo + lat_bytes, 1);
    const int64_t ro = ref::cache_rope_offset_bytes(v, slot);
    auto& m = cache.rope_data ? rope_mask : mask;
    std::fill(m.begin() + ro, m.begin() + ro + rope_bytes, 1);
  }
  auto check_sentinel = [&](const std::vector<uint8_t>& bytes, const std::vector<uint8_t>& m,
                            const char* part) {
    int64_t bad = 0;
    int64_t first = -1;
    for (size_t i = 0; i < bytes.size(); ++i) {
      if (!m[i] && bytes[i] != kSentinelByte) {
        if (first < 0) first = static_cast<int64_t>(i);
        ++bad;
      }
    }
    EXPECT_EQ(bad, 0) << what << " " << part << ": " << bad
                      << " bytes outside the written entries changed; first at byte " << first;
  };
  check_sentinel(got, mask, "cache");
  if (cache.rope_data) check_sentinel(got_rope, rope_mask, "rope cache");

  // Against the reference, exactly (RMSNorm's latent values and fp8_ds_mla tile scales included).
  EXPECT_TRUE(bytes_equal(got, cache.data->host, what + " cache"));
  if (cache.rope_data) {
    EXPECT_TRUE(bytes_equal(got_rope, cache.rope_data->host, what + " rope cache"));
  }
}

// ---- error counters ----------------------------------------------------------------------------
ErrorCounts::ErrorCounts(Device device)
    : tensor(new_tensor(device, DType::kInt32, {kNumErrorCounters})) {
  fill_bytes(*tensor.buffer, 0);
  tensor.buffer->upload();
}

int32_t* ErrorCounts::device_ptr() const {
  return static_cast<int32_t*>(tensor.device_view().data);
}

std::vector<int32_t> ErrorCounts::read() const {
  std::vector<int32_t> out(kNumErrorCounters);
  read_error_counts(device_ptr(), tensor.buffer->device(), out.data());
  return out;
}

std::string counts_to_string(const std::vector<int32_t>& counts) {
  std::ostringstream os;
  for (size_t i = 0; i < counts.size(); ++i) {
    os << (i ? ", " : "") << error_counter_name(static_cast<int32_t>(i)) << "=" << counts[i];
  }
  return os.str();
}

BothCounts gather_slots_both(const TestCache& cache, int64_t num_tokens, const Tensor& slots,
                             const Tensor& out) {
  auto fill = [&](GatherCacheSlotsParams* p, auto v) {
    p->num_tokens = num_tokens;
    p->kv_cache = v(cache);
    p->slots = v(slots);
    p->out = v(out);
  };
  return run_both<GatherCacheSlotsParams>(
      cache.data->device(), fill,
      [](const GatherCacheSlotsParams& p, int32_t* c) { ref::gather_cache_slots(p, c); },
      [](const GatherCacheSlotsParams& p, const Context& ctx) { gather_cache_slots(p, ctx); });
}

BothCounts gather_sequences_both(const TestCache& cache, int64_t num_seqs,
                                 const Tensor& block_table, const Tensor& cu_seq_lens,
                                 const Tensor& out) {
  auto fill = [&](GatherCacheSequencesParams* p, auto v) {
    p->num_seqs = num_seqs;
    p->kv_cache = v(cache);
    p->block_table = v(block_table);
    p->cu_seq_lens = v(cu_seq_lens);
    p->out = v(out);
  };
  return run_both<GatherCacheSequencesParams>(
      cache.data->device(), fill,
      [](const GatherCacheSequencesParams& p, int32_t* c) { ref::gather_cache_sequences(p, c); },
      [](const GatherCacheSequencesParams& p, const Context& ctx) {
        gather_cache_sequences(p, ctx);
      });
}

}  // namespace test
}  // namespace mlakv
