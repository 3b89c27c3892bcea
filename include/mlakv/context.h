// mlakv: how an op runs (stream, threads, error counters).
#pragma once

#include <cstdint>

namespace mlakv {

// Device-side error counters. An op that skips or clamps something counts it here (atomically on
// the op's device) instead of synchronizing; the host reads the counters whenever it likes.
enum ErrorCounter : int32_t {
  kBadSlot = 0,         // slot >= num_blocks * block_size: cache not written (fused op,
                        // concat_and_cache_mla) or a zero row read back (gather_cache_slots);
                        // slot < 0 is padding
  kBadPosition = 1,     // position outside [0, max_pos): clamped into the table
  kBadDecodeCount = 2,  // device Td outside [0, T]: clamped
  kBadBlockIndex = 3,   // gather: block id outside [0, num_blocks), or a token past its block-table
                        // row: zeros written
  kNumErrorCounters = 4,
};
const char* error_counter_name(int32_t counter);

struct Context {
  // cudaStream_t of the op (CUDA backend), a stream of the tensors' device; nullptr is that
  // device's legacy default stream. The op selects the tensors' device for its launch and restores
  // the caller's current device. A stream of another device fails the launch, with an error that
  // names both devices. Ignored on the CPU.
  void* stream = nullptr;
  // Optional [kNumErrorCounters] int32 in the op's device memory (host memory for the CPU backend).
  int32_t* error_counts = nullptr;
  // Debug mode: synchronize after the op and throw mlakv::Error if it counted anything. Needs
  // error_counts; reads device memory on the host, so not for CUDA-graph capture. The ops that
  // count nothing (rmsnorm_quant.h) ignore it and error_counts.
  bool checked = false;
  // CPU backend threads; 0 = OpenMP's default (omp_get_max_threads(): OMP_NUM_THREADS, else all
  // hardware threads); more than the hardware's threads count as all of them.
  int32_t num_threads = 0;
  // CUDA backend, sm_90+: programmatic dependent launch. The op's kernel may be scheduled while the
  // previous kernel in the stream is still running and waits for it (griddepcontrol.wait) before
  // reading any input, so a chain of kernels (a layer captured in a CUDA graph) hides the launch
  // latency between them; the op's kernel also lets the next one start early, which waits the same
  // way if it was launched with this attribute. Same results as without. Ignored on the CPU.
  bool pdl = false;
};

}  // namespace mlakv
