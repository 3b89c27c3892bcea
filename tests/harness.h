// mlakv tests: backends under test, mirrored host/device buffers, fills and bitwise comparisons.
//
// Every test follows one pattern: fill host buffers (random inputs, POISONED outputs, a SENTINEL
// cache), upload them to the backend's device, run the reference on the host copies and the library
// on the device copies, then download every buffer and compare it with its host copy, byte for
// byte (all of it: rows past T, gaps between strided rows and untouched cache entries included).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "mlakv/mlakv.h"
#include "reference/reference.h"

namespace mlakv {
namespace test {

constexpr uint8_t kPoisonByte = 0xA5;
constexpr uint8_t kSentinelByte = 0x5C;

// ---- backends ----------------------------------------------------------------------------------
struct Backend {
  std::string name;  // "cpu", "cuda0", "cuda1"
  Device device;
};
// CPU always; cuda:0 when the CUDA backend is built and a GPU is visible; cuda:1 when two are.
std::vector<Backend> all_backends();
void PrintTo(const Backend& backend, std::ostream* os);
std::string backend_param_name(const testing::TestParamInfo<Backend>& info);

// ---- buffers -----------------------------------------------------------------------------------
// One allocation on a backend's device with a host mirror. `host` holds the initial contents until
// the reference has run on it, then the expected contents; `initial` keeps the initial contents.
class Buffer {
 public:
  Buffer(Device device, size_t bytes);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  size_t bytes() const { return host.size(); }
  void* device_ptr() const { return device_ptr_; }
  Device device() const { return device_; }
  // host -> device, and snapshot `initial`.
  void upload();
  std::vector<uint8_t> download() const;

  std::vector<uint8_t> host;
  std::vector<uint8_t> initial;

 private:
  Device device_;
  void* device_ptr_ = nullptr;
};

// A strided view (element strides, element offset) into a Buffer; yields the same view on the
// host mirror and on the device copy.
struct Tensor {
  std::shared_ptr<Buffer> buffer;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<int64_t> stride;
  int64_t offset = 0;

  bool present() const { return buffer != nullptr; }
  TensorView host_view() const;
  TensorView device_view() const;
  // The same buffer seen with another offset (elements of dtype), shape and strides.
  Tensor view(int64_t new_offset, std::vector<int64_t> new_shape,
              std::vector<int64_t> new_stride) const;
  // Byte offset of an element inside the buffer.
  int64_t byte_offset(std::initializer_list<int64_t> index) const;
  int64_t host_index(int64_t i) const;  // 1-d int tensors: the element i
};

// A contiguous tensor with its own buffer of `dtype` (element strides derived from shape).
Tensor new_tensor(Device device, DType dtype, std::vector<int64_t> shape);
// A tensor over a raw buffer of `total_elems`, viewed with explicit shape/strides/offset.
Tensor new_strided_tensor(Device device, DType dtype, int64_t total_elems,
                          std::vector<int64_t> shape, std::vector<int64_t> stride,
                          int64_t offset = 0);
// Row-major [rows, cols] whose rows end with `row_pad` unused elements, `offset` elements in
// front; [rows, H, cols] whose heads also end with `head_pad` (the strides of an engine's padded
// or sliced tensors). Only the host mirror exists (zeros): fill and upload it (randomized,
// poisoned) before use.
Tensor padded_rows(Device device, DType dtype, int64_t rows, int64_t cols, int64_t row_pad,
                   int64_t offset = 0);
Tensor padded_heads(Device device, DType dtype, int64_t rows, int64_t H, int64_t cols,
                    int64_t row_pad, int64_t head_pad = 0);

// `t` with the stride of every size-1 dim set to `junk`. Such a stride is never used for addressing
// and may be anything (PyTorch: torch.empty(512, 1).t() is [1, 512] with strides (1, 1)).
TensorView with_unused_strides(TensorView t, int64_t junk);

// ---- fills -------------------------------------------------------------------------------------
// Random values of `dtype` in [-amplitude, amplitude] over the WHOLE buffer (gaps included),
// never exactly zero. Integer dtypes get random bytes.
void fill_random(Buffer& buffer, DType dtype, std::mt19937_64& rng, float amplitude = 2.0f);
void fill_bytes(Buffer& buffer, uint8_t byte);
// 1-d int tensor (int32 / int64) set from values; the rest of the buffer keeps its contents.
void set_indices(const Tensor& tensor, const std::vector<int64_t>& values);
void set_scalar_f32(const Tensor& tensor, float value);
// Contiguous tensors with their own buffers, filled on the host and uploaded: random values
// (fill_random), the poison byte (an output), or a 1-d int32 / int64 index tensor of `values`.
Tensor random_tensor(Device device, DType dtype, std::vector<int64_t> shape, std::mt19937_64& rng,
                     float amplitude = 2.0f);
Tensor poisoned_tensor(Device device, DType dtype, std::vector<int64_t> shape);
// The same fills of a tensor made another way (padded_rows, padded_heads): its whole buffer, then
// uploaded.
Tensor randomized(Tensor tensor, std::mt19937_64& rng, float amplitude = 2.0f);
Tensor poisoned(Tensor tensor);
Tensor index_tensor(Device device, DType dtype, const std::vector<int64_t>& values);

// The same call's params on the host mirrors and on the device copies: fill(&host, view), then
// fill(&device, view), where view(x) is x.host_view() the first time and x.device_view() the second
// (a Tensor or a TestCache).
template <typename Params, typename Fill>
void fill_host_and_device(Params& host, Params& device, Fill&& fill) {
  fill(&host, [](const auto& x) { return x.host_view(); });
  fill(&device, [](const auto& x) { return x.device_view(); });
}

// ---- comparisons -------------------------------------------------------------------------------
// Compares `got` with `expected` byte for byte. Reports the first mismatches (index, got,
// expected) and returns whether they were equal.
testing::AssertionResult bytes_equal(const std::vector<uint8_t>& got,
                                     const std::vector<uint8_t>& expected, const std::string& what);
// Downloads the buffer and compares it with its host mirror.
testing::AssertionResult buffer_matches(const Buffer& buffer, const std::string& what);
// Downloads the buffer and compares it with its initial contents (an input the op must not touch).
testing::AssertionResult buffer_unchanged(const Buffer& buffer, const std::string& what);

// ---- caches ------------------------------------------------------------------------------------
struct CacheGeometry {
  CacheFormat format = CacheFormat::kBFloat16;
  int64_t num_blocks = 8;
  int64_t block_size = 16;
  int64_t L = 512;
  int64_t R = 64;
  bool split = false;
  int64_t token_pad_bytes = 0;  // extra bytes after every entry (combined) / latent row (split)
  int64_t block_pad_bytes = 0;  // extra bytes after every block
  float scale = 0.0f;           // per-tensor fp8: the fp32 scale; 0 = no scale pointer (1.0)
  bool pow2 = false;            // fp8_ds_mla power-of-two tile scales
  // The stride given for a size-1 dim (blocks of one entry: the token strides; a cache of one
  // block: the block strides), which is never used and may be anything; 0: the packed value.
  int64_t unused_stride_bytes = 0;
};

// A cache filled with the sentinel byte, with its scale tensor when the geometry asks for one.
struct TestCache {
  CacheGeometry geometry;
  std::shared_ptr<Buffer> data;
  std::shared_ptr<Buffer> rope_data;  // split only
  Tensor scale;                       // [1] fp32, or absent
  KVCacheView host_view() const;
  KVCacheView device_view() const;
  int64_t num_slots() const { return geometry.num_blocks * geometry.block_size; }
};
TestCache new_cache(Device device, const CacheGeometry& geometry);
// Writes a real entry into every slot of `cache` (random kv_c / k_pe through the reference's
// concat_and_cache_mla: fp32 values into fp32 and fp16 caches, so that reading them back into
// bf16 rounds, bf16 values into the others) and uploads it: a cache to read back from.
void fill_cache_with_entries(Device device, TestCache& cache, std::mt19937_64& rng);

// Compares a cache with its host mirror byte for byte, RMSNorm's latent values included (the
// reference sums in the library's order). Independently of the reference, every byte outside the
// entries of `written_slots` must still be the sentinel.
void expect_cache_matches(const TestCache& cache, const std::vector<int64_t>& written_slots,
                          const std::string& what);

// ---- error counters ----------------------------------------------------------------------------
// A zeroed counter array on the device, and its read-back.
struct ErrorCounts {
  explicit ErrorCounts(Device device);
  int32_t* device_ptr() const;
  std::vector<int32_t> read() const;
  Tensor tensor;
};
std::string counts_to_string(const std::vector<int32_t>& counts);

// ---- the cache read-back on both sides ---------------------------------------------------------
// Runs a gather op on the reference (host views: the mirrors become the expected bytes) and on the
// backend (device views, counting into a fresh ErrorCounts); both sides' counters.
struct BothCounts {
  std::vector<int32_t> expected, got;
};
// `fill` sets both sides' params (fill_host_and_device); `reference` runs on the host side's, `op`
// (the backend) on the device side's, counting into a fresh ErrorCounts on `device`.
template <typename Params, typename Fill, typename Ref, typename Op>
BothCounts run_both(Device device, Fill fill, Ref reference, Op op) {
  Params host, dev;
  fill_host_and_device(host, dev, fill);
  std::vector<int32_t> expected(kNumErrorCounters, 0);
  reference(host, expected.data());
  ErrorCounts counts(device);
  Context ctx;
  ctx.error_counts = counts.device_ptr();
  op(dev, ctx);
  return {expected, counts.read()};
}
BothCounts gather_slots_both(const TestCache& cache, int64_t num_tokens, const Tensor& slots,
                             const Tensor& out);
BothCounts gather_sequences_both(const TestCache& cache, int64_t num_seqs,
                                 const Tensor& block_table, const Tensor& cu_seq_lens,
                                 const Tensor& out);

}  // namespace test
}  // namespace mlakv
