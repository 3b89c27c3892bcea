// mlakv CLI: shared helpers.
#include "util.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <unordered_set>
#include <utility>

#include "common/numerics.h"
#include "timer.h"

namespace mlakv {
namespace cli {

Buffer::Buffer(Device device, size_t bytes) : device_(device), bytes_(bytes) {
  // Zero-sized tensors still get a distinct, aligned pointer.
  data_ = device_alloc(device, std::max<size_t>(bytes, 256));
}

Buffer::~Buffer() { release(); }

Buffer::Buffer(Buffer&& other) noexcept
    : device_(other.device_), data_(other.data_), bytes_(other.bytes_) {
  other.data_ = nullptr;
  other.bytes_ = 0;
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    device_ = other.device_;
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void Buffer::release() {
  if (data_ != nullptr) {
    // A destructor must not throw; a failing free at exit is not worth a crash.
    try {
      device_free(device_, data_);
    } catch (const Error&) {
    }
    data_ = nullptr;
  }
}

void Buffer::upload(const void* host, size_t bytes, size_t offset_bytes) {
  MLAKV_CHECK(offset_bytes + bytes <= bytes_, "Buffer::upload: ", bytes, " bytes at offset ",
              offset_bytes, " exceed the buffer's ", bytes_, " bytes");
  if (bytes > 0)
    copy_host_to_device(device_, static_cast<uint8_t*>(data_) + offset_bytes, host, bytes);
}

std::vector<uint8_t> Buffer::download() const {
  std::vector<uint8_t> host(bytes_);
  if (bytes_ > 0) copy_device_to_host(device_, host.data(), data_, bytes_);
  return host;
}

void Buffer::fill_byte(int value) {
  if (bytes_ > 0) device_memset(device_, data_, value, bytes_);
}

namespace {
template <typename T>
void fill_typed(uint8_t* out, int64_t count, float amplitude, Rng& rng) {
  for (int64_t i = 0; i < count; ++i) {
    const T v = num::from_float<T>(rng.uniform(-amplitude, amplitude));
    std::memcpy(out + i * sizeof(T), &v, sizeof(T));
  }
}
}  // namespace

std::vector<uint8_t> random_values(DType dtype, int64_t count, float amplitude, Rng& rng) {
  std::vector<uint8_t> out(static_cast<size_t>(count) * dtype_size(dtype));
  switch (dtype) {
    case DType::kFloat32:
      fill_typed<float>(out.data(), count, amplitude, rng);
      break;
    case DType::kFloat16:
      fill_typed<num::Half>(out.data(), count, amplitude, rng);
      break;
    case DType::kBFloat16:
      fill_typed<num::Bf16>(out.data(), count, amplitude, rng);
      break;
    case DType::kFloat8E4M3:
      fill_typed<num::Fp8E4M3>(out.data(), count, amplitude, rng);
      break;
    case DType::kFloat8E5M2:
      fill_typed<num::Fp8E5M2>(out.data(), count, amplitude, rng);
      break;
    default:
      MLAKV_FAIL("random_values: dtype must be a float dtype, got ", dtype_name(dtype));
  }
  return out;
}

std::vector<int64_t> random_distinct_slots(int64_t count, int64_t num_slots, Rng& rng) {
  MLAKV_CHECK(count <= num_slots, "random_distinct_slots: ", count, " slots requested from ",
              num_slots);
  std::vector<int64_t> slots;
  slots.reserve(static_cast<size_t>(count));
  if (count * 4 > num_slots) {
    // Dense: a partial Fisher-Yates shuffle of all slots.
    std::vector<int64_t> all(static_cast<size_t>(num_slots));
    std::iota(all.begin(), all.end(), 0);
    for (int64_t i = 0; i < count; ++i) {
      std::swap(all[i], all[i + rng.below(num_slots - i)]);
      slots.push_back(all[i]);
    }
  } else {
    std::unordered_set<int64_t> used;
    while (static_cast<int64_t>(slots.size()) < count) {
      const int64_t s = rng.below(num_slots);
      if (used.insert(s).second) slots.push_back(s);
    }
  }
  return slots;
}

std::vector<uint8_t> index_bytes(const std::vector<int64_t>& values, DType dtype) {
  MLAKV_CHECK(dtype == DType::kInt32 || dtype == DType::kInt64,
              "index_bytes: dtype must be int32 or int64, got ", dtype_name(dtype));
  std::vector<uint8_t> out(values.size() * dtype_size(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kInt64) {
      std::memcpy(out.data() + i * 8, &values[i], 8);
    } else {
      const int32_t v = static_cast<int32_t>(values[i]);
      std::memcpy(out.data() + i * 4, &v, 4);
    }
  }
  return out;
}

std::vector<uint8_t> rope_table_bytes(int64_t max_pos, int64_t R, DType dtype) {
  RopeTableConfig config;
  config.rotary_dim = R;
  config.max_position = max_pos;
  const std::vector<double> table = rope_cos_sin_table(config);
  std::vector<uint8_t> out(static_cast<size_t>(max_pos * R) * dtype_size(dtype));
  round_table(table, dtype, out.data());
  return out;
}

int64_t first_difference(const uint8_t* a, const uint8_t* b, size_t n) {
  if (n == 0 || std::memcmp(a, b, n) == 0) return -1;
  for (size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

int64_t first_badly_copied_set(const std::vector<uint8_t>& dst, int sets, size_t stride,
                               size_t bytes) {
  const auto all_equal = [&](size_t begin, size_t end, uint8_t value) {
    return std::all_of(dst.begin() + static_cast<std::ptrdiff_t>(begin),
                       dst.begin() + static_cast<std::ptrdiff_t>(end),
                       [value](uint8_t b) { return b == value; });
  };
  for (int s = 0; s < sets; ++s) {
    const size_t begin = static_cast<size_t>(s) * stride;
    const size_t end = s + 1 < sets ? begin + stride : dst.size();
    if (!all_equal(begin, begin + bytes, 1) || !all_equal(begin + bytes, end, 0)) return s;
  }
  return -1;
}

double percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const double rank = p / 100.0 * static_cast<double>(values.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, values.size() - 1);
  const double frac = rank - static_cast<double>(lo);
  return values[lo] * (1.0 - frac) + values[hi] * frac;
}

Timing summarize(const std::vector<double>& per_launch_us, int launches_per_sample) {
  Timing t;
  t.median_us = percentile(per_launch_us, 50.0);
  t.p10_us = percentile(per_launch_us, 10.0);
  t.p90_us = percentile(per_launch_us, 90.0);
  t.samples = static_cast<int>(per_launch_us.size());
  t.launches_per_sample = launches_per_sample;
  return t;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (bytes >= 1000.0 && u < 4) {
    bytes /= 1000.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

std::string format_us(double us) {
  char buf[32];
  if (us < 10.0) {
    std::snprintf(buf, sizeof(buf), "%.2f", us);
  } else if (us < 1000.0) {
    std::snprintf(buf, sizeof(buf), "%.1f", us);
  } else {
    std::snprintf(buf, sizeof(buf), "%.0f", us);
  }
  return buf;
}

bool stderr_is_terminal() { return isatty(STDERR_FILENO) == 1; }

bool cuda_available() { return cuda_backend_built() && cuda_device_count() > 0; }

void check_cuda_device(const char* command, int device) {
  const int count = cuda_device_count();
  MLAKV_CHECK(device >= 0 && device < count, command, ": --device: expected a GPU index below ",
              count, " (the visible CUDA devices), got ", device);
}

}  // namespace cli
}  // namespace mlakv
