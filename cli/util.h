// mlakv CLI: buffers on a device, random data, statistics and formatting shared by the commands.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "mlakv/mlakv.h"

namespace mlakv {
namespace cli {

// Owns memory on a device (CPU or CUDA) through mlakv/memory.h; move-only.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Device device, size_t bytes);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

  void upload(const void* host, size_t bytes, size_t offset_bytes = 0);
  void upload(const std::vector<uint8_t>& host) { upload(host.data(), host.size()); }
  std::vector<uint8_t> download() const;
  void fill_byte(int value);

 private:
  void release();

  Device device_ = {};
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// SplitMix64: fast, seedable, identical on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n).
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
  // Uniform in [lo, hi].
  int64_t between(int64_t lo, int64_t hi) { return lo + below(hi - lo + 1); }
  // Uniform float in [lo, hi).
  float uniform(float lo, float hi) {
    return lo + (hi - lo) * static_cast<float>(next() >> 40) * (1.0f / 16777216.0f);
  }
  bool chance(double p) { return static_cast<double>(next() >> 11) * 0x1.0p-53 < p; }

 private:
  uint64_t state_;
};

// `count` random values of a float dtype (float32 / float16 / bfloat16 / float8), uniform in
// [-amplitude, amplitude) and rounded to the dtype, as raw bytes.
std::vector<uint8_t> random_values(DType dtype, int64_t count, float amplitude, Rng& rng);
// `count` distinct slots in [0, num_slots), random order.
std::vector<int64_t> random_distinct_slots(int64_t count, int64_t num_slots, Rng& rng);
// int64 values as raw bytes of `dtype` (int32 or int64).
std::vector<uint8_t> index_bytes(const std::vector<int64_t>& values, DType dtype);

// A DeepSeek-style cos/sin table [max_pos, R] (plain RoPE, base 10000) in `dtype`, as raw bytes.
std::vector<uint8_t> rope_table_bytes(int64_t max_pos, int64_t R, DType dtype);

// The first differing byte of two byte ranges of n bytes each, or -1 when they are equal.
int64_t first_difference(const uint8_t* a, const uint8_t* b, size_t n);

// The bench's check of its copy kernel: `sets` copies of `bytes` bytes each, `stride` apart, from a
// source of 1s into `dst`, which held 0s. The first set whose span does not hold only 1s, or whose
// gap after it (up to the next set; after the last, to dst's end) not only 0s, or -1.
int64_t first_badly_copied_set(const std::vector<uint8_t>& dst, int sets, size_t stride,
                               size_t bytes);

// Percentile p in [0, 100] of `values` (linear interpolation); values need not be sorted.
double percentile(std::vector<double> values, double p);

std::string format_bytes(double bytes);  // "1.50 MB" (decimal units)
std::string format_us(double us);        // "12.3", "1234"

bool stderr_is_terminal();

// The backends the command line can name: "cpu", "cuda"; "cuda" needs the CUDA backend and a GPU.
bool cuda_available();
// Throws (the command exits 2) unless cuda:`device` is a visible GPU; names `command`'s --device.
void check_cuda_device(const char* command, int device);

}  // namespace cli
}  // namespace mlakv
