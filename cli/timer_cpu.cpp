// mlakv CLI: the CPU timer (steady_clock around each launch).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>

#include "timer.h"
#include "util.h"

namespace mlakv {
namespace cli {
namespace {

class CpuTimer : public Timer {
 public:
  explicit CpuTimer(int iters) : iters_(iters) {}

  Device device() const override { return Device{DeviceType::kCPU, 0}; }

  Timing time(const std::vector<Op>& ops) override {
    MLAKV_CHECK(!ops.empty(), "CpuTimer::time: ops: expected at least one op, got none");
    size_t next = 0;
    auto launch = [&]() {
      const auto start = std::chrono::steady_clock::now();
      ops[next](nullptr);
      const auto stop = std::chrono::steady_clock::now();
      next = (next + 1) % ops.size();
      return std::chrono::duration<double, std::micro>(stop - start).count();
    };
    // Warm-up: every input set once (pages touched, threads spun up), at least 20 ms.
    std::vector<double> warm;
    double warm_total_us = 0.0;
    while (warm.size() < std::max<size_t>(ops.size(), 3) || warm_total_us < 20e3) {
      warm.push_back(launch());
      warm_total_us += warm.back();
      if (warm.size() >= 1000) break;
    }
    const double estimate_us = std::max(percentile(warm, 50.0), 0.01);
    int samples = iters_;
    if (samples <= 0) {
      samples = static_cast<int>(std::clamp(kTargetUs / estimate_us, 5.0, 5000.0));
    }
    std::vector<double> times;
    times.reserve(static_cast<size_t>(samples));
    // On a loaded machine single launches can take far longer than the warm-up suggested: stop
    // early (with at least 5 samples) rather than run for minutes.
    double total_us = 0.0;
    for (int i = 0; i < samples; ++i) {
      times.push_back(launch());
      total_us += times.back();
      if (iters_ <= 0 && times.size() >= 5 && total_us > 3 * kTargetUs) break;
    }
    return summarize(times);
  }

  // The CPU backend's fixed cost: one OpenMP fork and join over its threads.
  Op empty_op() override {
    return [](void*) {
      int touched = 0;
#pragma omp parallel num_threads(omp_get_max_threads()) reduction(+ : touched)
      touched += 1;
      (void)touched;
    };
  }

  Op copy_op(void* dst, const void* src, size_t bytes) override {
    // As many threads as the CPU backend uses: a single-threaded memcpy underestimates the
    // bandwidth the machine offers.
    return [dst, src, bytes](void*) {
      const int threads = omp_get_max_threads();
      const size_t chunk = ((bytes + threads - 1) / threads + 4095) / 4096 * 4096;
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int i = 0; i < threads; ++i) {
        const size_t begin = std::min(bytes, static_cast<size_t>(i) * chunk);
        const size_t end = std::min(bytes, begin + chunk);
        if (end > begin) {
          std::memcpy(static_cast<uint8_t*>(dst) + begin, static_cast<const uint8_t*>(src) + begin,
                      end - begin);
        }
      }
    };
  }

  Op copy_2d_op(void* dst, size_t dst_pitch_bytes, const void* src, size_t src_pitch_bytes,
                size_t width_bytes, size_t rows) override {
    return [=](void*) {
      const int64_t num_rows = static_cast<int64_t>(rows);
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < num_rows; ++r) {
        std::memcpy(static_cast<uint8_t*>(dst) + r * dst_pitch_bytes,
                    static_cast<const uint8_t*>(src) + r * src_pitch_bytes, width_bytes);
      }
    };
  }

  size_t rotation_bytes() const override { return size_t{64} << 20; }

 private:
  static constexpr double kTargetUs = 100e3;
  int iters_;
};

}  // namespace

std::unique_ptr<Timer> make_cpu_timer(int iters) { return std::make_unique<CpuTimer>(iters); }

}  // namespace cli
}  // namespace mlakv
