// mlakv CPU backend internals: threading, dtype dispatch, cache entry addressing, error tallies and
// the row kernels (conversion, RoPE, quantization) that the ops in src/cpu/*.cpp share.
//
// Every row kernel works on one contiguous row and is written as plain loops over float temporaries
// so that GCC vectorizes it (plain copies are spelled as vector moves: copy_bytes, stream_bytes);
// all rounding goes through src/common/numerics.h, so the results are the bits the CUDA backend
// produces. Every parallel region holds a DefaultFloatEnv (src/common/float_env.h) on each thread,
// so the caller's floating-point environment (rounding mode, FTZ / DAZ) does not change them.
#pragma once

#include <omp.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "common/float_env.h"
#include "common/numerics.h"
#include "core/args.h"
#include "mlakv/cache.h"
#include "mlakv/context.h"
#include "mlakv/error.h"
#include "mlakv/tensor.h"

namespace mlakv {
namespace cpu {
namespace detail {

// Widest rows the kernels keep on the stack (DESIGN.md: L <= 1024, R <= 256). rms_norm keeps no
// row buffer, so its rows have no limit.
constexpr int64_t kMaxLatent = 1024;
constexpr int64_t kMaxRope = 256;
// Below this much memory traffic a parallel region costs more than it saves.
constexpr int64_t kSerialBytes = 32 * 1024;
// Heads handled per work item on the Q side: cos/sin are loaded once per item.
constexpr int64_t kHeadChunk = 32;
// From this much q_out per call on, the fused op writes q_out with streaming stores (see
// stream_bytes): more than the private caches hold, so it is not in cache when attention reads it.
constexpr int64_t kStreamBytes = 4 * 1024 * 1024;

// ctx.num_threads, at most the hardware's threads (an absurd count must not reach the OpenMP
// runtime, which may abort when it cannot create the threads); 0: OpenMP's default.
inline int max_threads(const Context& ctx) {
  return ctx.num_threads > 0 ? std::min(ctx.num_threads, omp_get_num_procs())
                             : omp_get_max_threads();
}

// Threads for a call that moves `bytes` of memory over `items` independent work items.
inline int threads_for(const Context& ctx, int64_t bytes, int64_t items) {
  if (bytes < kSerialBytes || items < 2) return 1;
  return static_cast<int>(std::min<int64_t>(max_threads(ctx), items));
}

// Per-thread error counts, added to the shared counters once at the end of a parallel region.
struct ErrorTally {
  int32_t counts[kNumErrorCounters] = {};

  void add(ErrorCounter counter) { ++counts[counter]; }
  void flush(int32_t* error_counts) const {
    if (error_counts == nullptr) return;
    for (int i = 0; i < kNumErrorCounters; ++i) {
      if (counts[i] != 0) {
#pragma omp atomic
        error_counts[i] += counts[i];
      }
    }
  }
};

inline int64_t read_index(const core::IndexArg& index, int64_t i) {
  if (index.is_int64) return static_cast<const int64_t*>(index.data)[i * index.stride];
  return static_cast<const int32_t*>(index.data)[i * index.stride];
}

// ---- dtype dispatch -------------------------------------------------------------------------
// f(T{}) with T the storage type of a model dtype: float, num::Bf16 or num::Half.
template <typename F>
void dispatch_model_dtype(DType dtype, const char* what, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      f(float{});
      return;
    case DType::kBFloat16:
      f(num::Bf16{});
      return;
    case DType::kFloat16:
      f(num::Half{});
      return;
    default:
      MLAKV_FAIL(what, ": expected a model dtype (float32, float16, bfloat16), got ",
                 dtype_name(dtype));
  }
}

// f(T{}) with T the storage type of a model dtype or an fp8 dtype (q_out).
template <typename F>
void dispatch_value_dtype(DType dtype, const char* what, F&& f) {
  switch (dtype) {
    case DType::kFloat8E4M3:
      f(num::Fp8E4M3{});
      return;
    case DType::kFloat8E5M2:
      f(num::Fp8E5M2{});
      return;
    default:
      dispatch_model_dtype(dtype, what, std::forward<F>(f));
  }
}

template <typename T>
constexpr bool kIsFp8 = std::is_same_v<T, num::Fp8E4M3> || std::is_same_v<T, num::Fp8E5M2>;

// Cache format tags: Raw<C> stores C values, PerTensorFp8<F> one-scale fp8, DsMla FlashMLA's entry.
template <typename C>
struct Raw {
  using Latent = C;
  using Rope = C;
};
template <typename F>
struct PerTensorFp8 {
  using Latent = F;
  using Rope = F;
};
struct DsMla {
  using Latent = num::Fp8E4M3;
  using Rope = num::Bf16;
};

template <typename F>
void dispatch_cache_format(CacheFormat format, F&& f) {
  switch (format) {
    case CacheFormat::kBFloat16:
      f(Raw<num::Bf16>{});
      return;
    case CacheFormat::kFloat16:
      f(Raw<num::Half>{});
      return;
    case CacheFormat::kFloat32:
      f(Raw<float>{});
      return;
    case CacheFormat::kFloat8E4M3:
      f(PerTensorFp8<num::Fp8E4M3>{});
      return;
    case CacheFormat::kFloat8E5M2:
      f(PerTensorFp8<num::Fp8E5M2>{});
      return;
    case CacheFormat::kFloat8DsMla:
      f(DsMla{});
      return;
  }
  MLAKV_FAIL("kv_cache.format: unknown cache format ", static_cast<int>(format));
}

// ---- cache entry addressing -----------------------------------------------------------------
struct EntryPtrs {
  uint8_t* latent;
  uint8_t* rope;
};

// Entry of (block, offset); the rope part follows `latent_bytes` of latent unless split.
inline EntryPtrs cache_entry_at(const core::CacheArg& cache, int64_t block, int64_t offset,
                                int64_t latent_bytes) {
  uint8_t* latent =
      cache.data + block * cache.stride_block_bytes + offset * cache.stride_token_bytes;
  uint8_t* rope = cache.rope_data != nullptr
                      ? cache.rope_data + block * cache.stride_rope_block_bytes +
                            offset * cache.stride_rope_token_bytes
                      : latent + latent_bytes;
  return {latent, rope};
}

inline EntryPtrs cache_entry(const core::CacheArg& cache, int64_t slot, int64_t latent_bytes) {
  return cache_entry_at(cache, slot / cache.block_size, slot % cache.block_size, latent_bytes);
}

// Byte offset of the rope part inside a combined entry.
template <typename Fmt>
constexpr int64_t rope_offset_bytes(int64_t L) {
  if constexpr (std::is_same_v<Fmt, DsMla>) {
    return kDsMlaLatentDim + kDsMlaNumTiles * static_cast<int64_t>(sizeof(float));
  } else {
    return L * static_cast<int64_t>(sizeof(typename Fmt::Latent));
  }
}

inline float scale_or_one(const float* scale) { return scale != nullptr ? *scale : 1.0f; }

// ---- row kernels ----------------------------------------------------------------------------
// The widest vector of the target (the CPU sources are built with -march=native by default); GCC
// and Clang lower a wider vector type to narrower moves where needed.
#if defined(__AVX512F__)
#define MLAKV_CPU_VEC_BYTES 64
#elif defined(__AVX__)
#define MLAKV_CPU_VEC_BYTES 32
#else
#define MLAKV_CPU_VEC_BYTES 16
#endif
constexpr int64_t kVecBytes = MLAKV_CPU_VEC_BYTES;
// A typedef, not a `using` alias: Clang drops aligned(1) from an alias and then emits aligned
// moves.
typedef char VecBytes __attribute__((vector_size(MLAKV_CPU_VEC_BYTES), aligned(1), may_alias));

// Whether the byte ranges [a, a + bytes) and [b, b + bytes) overlap.
inline bool ranges_overlap(const void* a, const void* b, int64_t bytes) {
  const uintptr_t x = reinterpret_cast<uintptr_t>(a);
  const uintptr_t y = reinterpret_cast<uintptr_t>(b);
  return x < y + static_cast<uintptr_t>(bytes) && y < x + static_cast<uintptr_t>(bytes);
}

// dst[0, bytes) = src[0, bytes), front to back in whole vectors, then the tail; overlapping rows
// go through memmove. Spelled as vector moves on purpose: GCC turns a plain copy loop back into a
// memmove call, and glibc's memmove on rows of ~1 KB (the q_out nope part, a cache entry's latent
// part) made the decode op 25-40 % slower on the development machine than this loop.
inline void copy_bytes(const void* src, void* dst, int64_t bytes) {
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  if (ranges_overlap(s, d, bytes)) {
    if (s != d) std::memmove(d, s, static_cast<size_t>(bytes));
    return;
  }
  int64_t i = 0;
  for (; i + kVecBytes <= bytes; i += kVecBytes) {
    *reinterpret_cast<VecBytes*>(d + i) = *reinterpret_cast<const VecBytes*>(s + i);
  }
  if (i < bytes) std::memcpy(d + i, s + i, static_cast<size_t>(bytes - i));
}

// dst[0, bytes) = src[0, bytes) with non-temporal (streaming) stores where the target has them: a
// regular store first reads the line it writes (read-for-ownership), a streaming store of a whole
// vector does not, and it does not evict the inputs. The bytes before dst's first vector-aligned
// address and after its last whole vector are copied with regular stores (with 32-byte vectors a
// cache line can thus be part streamed, part regular: slower, not wrong). Streamed data is ordered
// by stream_fence() only: call it before the data is read by another thread (before the end of a
// parallel region).
inline void stream_bytes(const void* src, void* dst, int64_t bytes) {
#if defined(__SSE2__)
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  if (ranges_overlap(s, d, bytes)) {
    copy_bytes(s, d, bytes);
    return;
  }
  const int64_t head = std::min<int64_t>(
      bytes, static_cast<int64_t>(-reinterpret_cast<uintptr_t>(d) & (kVecBytes - 1)));
  if (head > 0) std::memcpy(d, s, static_cast<size_t>(head));
  int64_t i = head;
  for (; i + kVecBytes <= bytes; i += kVecBytes) {
#if defined(__AVX512F__)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), _mm512_loadu_si512(s + i));
#elif defined(__AVX__)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
#else
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
#endif
  }
  if (i < bytes) std::memcpy(d + i, s + i, static_cast<size_t>(bytes - i));
#else
  copy_bytes(src, dst, bytes);
#endif
}

inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// dst[i] = src[i] converted (round-to-nearest-even); a plain copy when the types agree. dst may be
// src itself.
template <typename Src, typename Dst>
inline void convert_row(const Src* src, Dst* dst, int64_t n) {
  if constexpr (std::is_same_v<Src, Dst>) {
    copy_bytes(src, dst, n * static_cast<int64_t>(sizeof(Src)));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = num::from_float<Dst>(num::to_float(src[i]));
  }
}

// dst[i] = quantize(src[i], scale); src and dst do not overlap (different element sizes).
template <typename F, typename Src>
inline void quantize_row(const Src* __restrict src, F* __restrict dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = num::quantize<F>(num::to_float(src[i]), scale);
}

// Model-dtype row into a value of type V: a conversion, or an fp8 quantization by `scale`.
template <typename V, typename T>
inline void store_row(const T* src, V* dst, int64_t n, float scale) {
  if constexpr (kIsFp8<V>) {
    quantize_row<V>(src, dst, n, scale);
  } else {
    convert_row(src, dst, n);
  }
}

// Position of token t clamped into [0, max_pos); counts when it had to clamp.
inline int64_t clamped_position(const core::IndexArg& positions, const core::RopeTableArg& rope,
                                int64_t t, ErrorTally* tally) {
  const int64_t pos = read_index(positions, t);
  if (pos >= 0 && pos < rope.max_pos) return pos;
  if (tally != nullptr) tally->add(kBadPosition);
  return pos < 0 ? 0 : rope.max_pos - 1;
}

// cos/sin of one position spread over the R elements of a row, so that RoPE becomes one
// contiguous loop for both pair styles:
//   out[j] = fma(v[j], cos_at[j], v[partner(j)] * sin_at[j])
// with sin_at = -sin for the first element of a pair. -(y * s) == y * (-s) exactly (rounding is
// sign-symmetric), so this is num::rope_rotate's x' = fma(x, c, -(y*s)), y' = fma(y, c, x*s).
struct CosSin {
  alignas(64) float cos_at[kMaxRope];
  alignas(64) float sin_at[kMaxRope];
  bool neox = false;
};

template <typename S>
inline void expand_cos_sin(const S* row, int64_t R, bool neox, CosSin& cs) {
  const int64_t half = R / 2;
  cs.neox = neox;
  if (neox) {
    for (int64_t i = 0; i < half; ++i) {
      const float c = num::to_float(row[i]);
      const float s = num::to_float(row[half + i]);
      cs.cos_at[i] = c;
      cs.cos_at[half + i] = c;
      cs.sin_at[i] = -s;
      cs.sin_at[half + i] = s;
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float c = num::to_float(row[i]);
      const float s = num::to_float(row[half + i]);
      cs.cos_at[2 * i] = c;
      cs.cos_at[2 * i + 1] = c;
      cs.sin_at[2 * i] = -s;
      cs.sin_at[2 * i + 1] = s;
    }
  }
}

// The cos/sin table row of `pos` (already clamped), for rows of R elements.
inline void load_cos_sin(const core::RopeTableArg& rope, int64_t pos, int64_t R, CosSin& cs) {
  const bool neox = rope.style == RopeStyle::kNeox;
  switch (rope.dtype) {
    case DType::kBFloat16:
      expand_cos_sin(static_cast<const num::Bf16*>(rope.data) + pos * rope.stride_pos, R, neox, cs);
      return;
    case DType::kFloat16:
      expand_cos_sin(static_cast<const num::Half*>(rope.data) + pos * rope.stride_pos, R, neox, cs);
      return;
    default:
      expand_cos_sin(static_cast<const float*>(rope.data) + pos * rope.stride_pos, R, neox, cs);
      return;
  }
}

// Prefetch hints for rows whose address the hardware prefetchers cannot guess (short rows at a
// large stride, a cos/sin row at a random position, a scattered cache entry): a thread asks for
// rows it reads a little later while it works on the current ones. Whole 64-byte lines are asked
// for (a hint: never faults, never changes a value).
template <int kWrite>
inline void prefetch_lines(const void* p, int64_t bytes) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t line = begin & ~uintptr_t{63}; line < begin + bytes; line += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(line), kWrite);
  }
}
inline void prefetch_read(const void* p, int64_t bytes) { prefetch_lines<0>(p, bytes); }
inline void prefetch_write(const void* p, int64_t bytes) { prefetch_lines<1>(p, bytes); }

// The cos/sin table row of `pos` (already clamped), R elements of the table's dtype.
inline void prefetch_cos_sin(const core::RopeTableArg& rope, int64_t pos, int64_t R) {
  const int64_t elem = rope.dtype == DType::kFloat32 ? 4 : 2;
  prefetch_read(static_cast<const char*>(rope.data) + pos * rope.stride_pos * elem, R * elem);
}

// dst = RoPE(src) over R values (kR: R fixed at compile time, 0 = runtime), rounded to T. dst may
// be src itself (each pair is read before it is written); a dst that overlaps src otherwise reads
// a copy of src. One loop per pair style with both values of a pair in registers: GCC vectorizes
// it (GPT-J with an in-lane swap) without the round trip through stack arrays that a separate
// partner array cost (it halved the rope time of a head).
template <typename T, typename D, int64_t kR, typename Encode>
inline void rope_row_impl(const T* src, D* dst, const CosSin& cs, int64_t runtime_R,
                          const Encode& encode) {
  const int64_t R = kR > 0 ? kR : runtime_R;
  const int64_t half = R / 2;
  alignas(64) T src_copy[kMaxRope];
  if constexpr (std::is_same_v<T, D>) {
    if (src != dst && ranges_overlap(src, dst, R * static_cast<int64_t>(sizeof(T)))) {
      std::memcpy(src_copy, src, static_cast<size_t>(R) * sizeof(T));
      src = src_copy;
    }
  }
  const float* c = cs.cos_at;
  const float* s = cs.sin_at;
  if (cs.neox) {
    for (int64_t i = 0; i < half; ++i) {
      const float x = num::to_float(src[i]);
      const float y = num::to_float(src[half + i]);
      dst[i] = encode(num::fma_rn(x, c[i], num::mul_rn(y, s[i])));
      dst[half + i] = encode(num::fma_rn(y, c[half + i], num::mul_rn(x, s[half + i])));
    }
  } else {
    for (int64_t j = 0; j < R; j += 2) {
      const float x = num::to_float(src[j]);
      const float y = num::to_float(src[j + 1]);
      dst[j] = encode(num::fma_rn(x, c[j], num::mul_rn(y, s[j])));
      dst[j + 1] = encode(num::fma_rn(y, c[j + 1], num::mul_rn(x, s[j + 1])));
    }
  }
}

// The common rope widths get fixed-length loops (fully unrolled vector code).
template <typename T, typename D, typename Encode>
inline void rope_row_widths(const T* src, D* dst, const CosSin& cs, int64_t R,
                            const Encode& encode) {
  switch (R) {
    case 64:
      rope_row_impl<T, D, 64>(src, dst, cs, R, encode);
      return;
    case 32:
      rope_row_impl<T, D, 32>(src, dst, cs, R, encode);
      return;
    case 128:
      rope_row_impl<T, D, 128>(src, dst, cs, R, encode);
      return;
    default:
      rope_row_impl<T, D, 0>(src, dst, cs, R, encode);
      return;
  }
}

// dst = RoPE(src) rounded to T; dst may be src itself.
template <typename T>
inline void rope_row(const T* src, T* dst, const CosSin& cs, int64_t R) {
  rope_row_widths(src, dst, cs, R, [](float v) { return num::from_float<T>(v); });
}

// dst = quantize(RoPE(src) rounded to T, scale): the bytes of rope_row into a row of T followed by
// quantize_row from it, in one pass with the rotated values in registers. Going through a stack
// row cost the fp8 decode op 7-9 % on the development machine (one thread, inputs in cache): the
// row was read back right after its vector stores. src and dst do not overlap (the fp8 q_out is
// checked against q_pe). flatten: without it GCC 12 stopped inlining num::to_float in the decode
// item's copy of the loop and left it scalar (ten times slower).
template <typename F, typename T>
__attribute__((flatten)) inline void rope_quantize_row(const T* __restrict src, F* __restrict dst,
                                                       const CosSin& cs, int64_t R, float scale) {
  rope_row_widths(src, dst, cs, R,
                  [scale](float v) { return num::quantize<F>(num::round_to<T>(v), scale); });
}

// The subtree sums of `chunks` whole chunks of 8 elements (num::chunk_square_sum), in a loop of
// its own so that the compiler vectorizes it across chunks.
template <typename T>
inline void chunk_square_sums(const T* __restrict x, float* __restrict out, int64_t chunks) {
  for (int64_t c = 0; c < chunks; ++c) {
    float v[8];
    for (int k = 0; k < 8; ++k) v[k] = num::to_float(x[8 * c + k]);
    out[c] = num::chunk_square_sum(v);
  }
}

// One level of the pairwise tree (numerics.h): dst[j] = src[2j] + src[2j + 1], an odd count's
// last value carried up unchanged. Returns the next level's count.
inline int64_t tree_level(const float* __restrict src, float* __restrict dst, int64_t m) {
  for (int64_t j = 0; j < m / 2; ++j) dst[j] = num::add_rn(src[2 * j], src[2 * j + 1]);
  if (m % 2 != 0) dst[m / 2] = src[m - 1];
  return (m + 1) / 2;
}

// The pairwise tree's sum of m >= 1 values in a, level by level between a and b (both
// overwritten).
inline float tree_sum(float* a, float* b, int64_t m) {
  while (m > 1) {
    m = tree_level(a, b, m);
    std::swap(a, b);
  }
  return a[0];
}

// fp32 sum of squares in the library's one order, the pairwise tree over the element index
// (numerics.h, RMSNorm). The row goes in tiles of 2048 elements, each one aligned subtree: its 256
// chunk subtrees (num::chunk_square_sum), then the levels above them, each a vectorized loop. The
// tiles are merged by num::PairwiseMerger, and the last partial tile (a short last chunk padded
// with +0) is the tree's right edge: its sum enters total() first. The fixed order makes
// rms_norm, rmsnorm_quant and the fused op agree bitwise on every backend. (Before, every chunk
// went through the merger one at a time, a serial chain: 0.87 -> 0.41 us for a row of 1536 bf16
// values on the development machine, AVX2.)
template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  constexpr int64_t kChunk = 8;
  constexpr int64_t kTileChunks = 256;
  constexpr int64_t kTile = kTileChunks * kChunk;
  alignas(32) float a[kTileChunks];
  alignas(32) float b[kTileChunks];
  num::PairwiseMerger tiles;
  int64_t e0 = 0;
  for (; e0 + kTile <= n; e0 += kTile) {
    chunk_square_sums(x + e0, a, kTileChunks);
    tiles.add(tree_sum(a, b, kTileChunks));
  }
  const int64_t len = n - e0;
  if (len == 0) return tiles.total();
  int64_t chunks = len / kChunk;
  chunk_square_sums(x + e0, a, chunks);
  if (chunks * kChunk < len) {
    float v[kChunk];
    for (int64_t k = 0; k < kChunk; ++k) {
      v[k] = chunks * kChunk + k < len ? num::to_float(x[e0 + chunks * kChunk + k]) : 0.0f;
    }
    a[chunks++] = num::chunk_square_sum(v);
  }
  return tiles.total(tree_sum(a, b, chunks));
}

// out[i] = from_float<T>(rms_apply(x[i], inv_rms, w[i])); out may be x itself.
template <typename T>
inline void rms_apply_row(const T* x, const T* __restrict w, T* out, int64_t n, float inv_rms) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = num::from_float<T>(num::rms_apply(num::to_float(x[i]), inv_rms, num::to_float(w[i])));
  }
}

// The amax of n values, num::amax_update over all of them (the maximum does not depend on the
// order), taken on the magnitudes' bit patterns: for floats >= +0 their order is the values'
// order, and a NaN (a pattern above infinity's) is masked to +0, as amax_update skips it. Integer
// maxima vectorize; the float compare that skips NaN did not (GCC 12 on AVX2 kept one vmaxss a
// value, also as 16 running maxima): 41 -> 16 ns for 128 floats on the development machine.
template <typename V>
inline float amax_of(const V* v, int64_t n) {
  uint32_t amax = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t mag = num::float_bits(num::to_float(v[i])) & 0x7fffffffu;
    const uint32_t nan = 0u - static_cast<uint32_t>(mag > 0x7f800000u);  // all ones for a NaN
    const uint32_t m = mag & ~nan;
    amax = amax > m ? amax : m;
  }
  return num::bits_float(amax);
}

// ---- cache entry writers --------------------------------------------------------------------
// Writes one entry from model-dtype rows (latent [L], rope [R]).
template <typename Fmt, typename T>
inline void write_entry(const core::CacheArg& cache, const EntryPtrs& entry, const T* latent,
                        const T* rope, int64_t L, int64_t R) {
  if constexpr (std::is_same_v<Fmt, DsMla>) {
    auto* bytes = reinterpret_cast<num::Fp8E4M3*>(entry.latent);
    float scales[kDsMlaNumTiles];
    for (int64_t tile = 0; tile < kDsMlaNumTiles; ++tile) {
      const T* v = latent + tile * kDsMlaTileElems;
      const float scale =
          num::ds_mla_tile_scale(amax_of(v, kDsMlaTileElems), cache.ds_mla_pow2_scale);
      scales[tile] = scale;
      quantize_row<num::Fp8E4M3>(v, bytes + tile * kDsMlaTileElems, kDsMlaTileElems, scale);
    }
    std::memcpy(entry.latent + kDsMlaLatentDim, scales, sizeof(scales));
    convert_row(rope, reinterpret_cast<num::Bf16*>(entry.rope), R);
  } else if constexpr (kIsFp8<typename Fmt::Latent>) {
    using F = typename Fmt::Latent;
    const float scale = scale_or_one(cache.scale);
    quantize_row<F>(latent, reinterpret_cast<F*>(entry.latent), L, scale);
    quantize_row<F>(rope, reinterpret_cast<F*>(entry.rope), R, scale);
  } else {
    using C = typename Fmt::Latent;
    convert_row(latent, reinterpret_cast<C*>(entry.latent), L);
    convert_row(rope, reinterpret_cast<C*>(entry.rope), R);
  }
}

// The entry of `slot` from model-dtype rows: nothing for a padding slot (< 0), a kBadSlot count
// for one past the cache; the K side of the fused op and concat_and_cache_mla both write this way.
template <typename Fmt, typename T>
inline void write_slot(const core::CacheArg& cache, int64_t slot, const T* latent, const T* rope,
                       int64_t L, int64_t R, ErrorTally& tally) {
  if (slot < 0) return;
  if (slot >= cache.num_slots) {
    tally.add(kBadSlot);
    return;
  }
  write_entry<Fmt>(cache, cache_entry(cache, slot, rope_offset_bytes<Fmt>(L)), latent, rope, L, R);
}

}  // namespace detail
}  // namespace cpu
}  // namespace mlakv
