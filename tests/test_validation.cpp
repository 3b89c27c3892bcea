// Argument validation: every rejected argument throws mlakv::Error whose message names it, and
// nothing (cache, outputs, in-place inputs) is written. CPU memory only, but for the CUDA
// backend's launch limit (never-dereferenced device views, skipped without a GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "mlakv/mlakv.h"

namespace {

using mlakv::CacheFormat;
using mlakv::DType;
using mlakv::TensorView;

constexpr uint8_t kSentinel = 0xa5;

// 256-byte aligned CPU buffer from the library's own allocator.
class Buffer {
 public:
  explicit Buffer(size_t bytes) : bytes_(bytes), data_(mlakv::device_alloc({}, bytes)) {}
  ~Buffer() { mlakv::device_free({}, data_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  std::vector<uint8_t> snapshot() const {
    const uint8_t* p = static_cast<const uint8_t*>(data_);
    return std::vector<uint8_t>(p, p + bytes_);
  }

 private:
  size_t bytes_;
  void* data_;
};

// Every buffer of a test: random inputs (bf16 values in [-2, 2), valid indices) and
// sentinel-filled outputs; snapshots of all of them prove that a rejected call wrote nothing.
class Arena {
 public:
  void* random_bf16(size_t elems) {
    Buffer& b = add(elems * 2);
    uint16_t* p = static_cast<uint16_t*>(b.data());
    std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
    for (size_t i = 0; i < elems; ++i) {
      float f = dist(rng_);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      p[i] = static_cast<uint16_t>(u >> 16);
    }
    return b.data();
  }
  void* random_f32(size_t elems) {
    Buffer& b = add(elems * 4);
    float* p = static_cast<float*>(b.data());
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (size_t i = 0; i < elems; ++i) p[i] = dist(rng_);
    return b.data();
  }
  void* indices(std::vector<int64_t> values) {
    Buffer& b = add(values.size() * 8);
    std::memcpy(b.data(), values.data(), values.size() * 8);
    return b.data();
  }
  void* indices32(std::vector<int32_t> values) {
    Buffer& b = add(values.size() * 4);
    std::memcpy(b.data(), values.data(), values.size() * 4);
    return b.data();
  }
  void* sentinel(size_t bytes) {
    Buffer& b = add(bytes);
    std::memset(b.data(), kSentinel, bytes);
    return b.data();
  }
  std::vector<std::vector<uint8_t>> snapshot() const {
    std::vector<std::vector<uint8_t>> s;
    for (const auto& b : buffers_) s.push_back(b->snapshot());
    return s;
  }

 private:
  Buffer& add(size_t bytes) {
    buffers_.push_back(std::make_unique<Buffer>(bytes));
    return *buffers_.back();
  }
  std::mt19937 rng_{20261202};
  std::vector<std::unique_ptr<Buffer>> buffers_;
};

// Calls fn, expects an mlakv::Error whose message contains `argument`, and that no buffer of the
// arena changed.
void expect_rejected(const Arena& arena, const std::function<void()>& fn,
                     const std::string& argument) {
  const auto before = arena.snapshot();
  bool thrown = false;
  try {
    fn();
  } catch (const mlakv::Error& e) {
    thrown = true;
    EXPECT_NE(std::string(e.what()).find(argument), std::string::npos)
        << "message does not name '" << argument << "': " << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected mlakv::Error, got another exception: " << e.what();
    return;
  }
  EXPECT_TRUE(thrown) << "expected mlakv::Error naming '" << argument << "', nothing thrown";
  EXPECT_TRUE(arena.snapshot() == before) << "a rejected call wrote memory";
}

// A small valid mixed batch: T = 4 (Td = 2), H = 2, L = 512, R = 64, P = 16, bf16, combined bf16
// cache of 2 blocks of 4 slots.
class MlaValidation : public ::testing::Test {
 protected:
  static constexpr int64_t T = 4, Td = 2, H = 2, L = 512, R = 64, P = 16, kMaxPos = 32;
  static constexpr int64_t kBlocks = 2, kBlockSize = 4;

  MlaValidation() {
    cache_ = arena_.sentinel(
        static_cast<size_t>(mlakv::cache_bytes(CacheFormat::kBFloat16, kBlocks, kBlockSize, L, R)));
    ds_cache_ = arena_.sentinel(static_cast<size_t>(
        mlakv::cache_bytes(CacheFormat::kFloat8DsMla, kBlocks, kBlockSize, L, R)));
    error_counts_ = static_cast<int32_t*>(arena_.sentinel(4 * mlakv::kNumErrorCounters));
    std::memset(error_counts_, 0, 4 * mlakv::kNumErrorCounters);

    p_.num_tokens = T;
    p_.num_decode_tokens = Td;
    p_.positions = mlakv::make_view(arena_.indices({3, 0, 17, 31}), DType::kInt64, {T});
    p_.slot_mapping = mlakv::make_view(arena_.indices({5, -1, 0, 7}), DType::kInt64, {T});
    p_.cos_sin_cache =
        mlakv::make_view(arena_.random_f32(kMaxPos * R), DType::kFloat32, {kMaxPos, R});
    p_.kv_c = mlakv::make_view(arena_.random_bf16(T * L), DType::kBFloat16, {T, L});
    p_.k_pe = mlakv::make_view(arena_.random_bf16(T * R), DType::kBFloat16, {T, R});
    p_.kv_norm_weight = mlakv::make_view(arena_.random_bf16(L), DType::kBFloat16, {L});
    p_.kv_cache = mlakv::make_cache_view(cache_, CacheFormat::kBFloat16, kBlocks, kBlockSize, L, R);
    p_.k_pe_out = mlakv::make_view(arena_.sentinel(T * R * 2), DType::kBFloat16, {T, R});
    p_.kv_c_out = mlakv::make_view(arena_.sentinel(T * L * 2), DType::kBFloat16, {T, L});
    p_.q_pe = mlakv::make_view(arena_.random_bf16(T * H * R), DType::kBFloat16, {T, H, R});
    p_.ql_nope = mlakv::make_view(arena_.random_bf16(T * H * L), DType::kBFloat16, {T, H, L});
    p_.q_out =
        mlakv::make_view(arena_.sentinel(T * H * (L + R) * 2), DType::kBFloat16, {T, H, L + R});
    fp8_q_out_ =
        mlakv::make_view(arena_.sentinel(T * H * (L + R)), DType::kFloat8E4M3, {T, H, L + R});
    p_.q = mlakv::make_view(arena_.random_bf16(T * H * (P + R)), DType::kBFloat16, {T, H, P + R});
    p_.q_prefill_out =
        mlakv::make_view(arena_.sentinel(T * H * (P + R) * 2), DType::kBFloat16, {T, H, P + R});
    scale_ = static_cast<float*>(arena_.sentinel(4));
    *scale_ = 0.5f;
  }

  void reject(const mlakv::MlaRopeCacheParams& p, const std::string& argument,
              const mlakv::Context& ctx = {}) {
    expect_rejected(
        arena_, [&] { mlakv::mla_rope_cache(p, ctx); }, argument);
  }

  // p_ with the K side only (no Q tensor, Td = 0) writing the fp8_ds_mla cache: what a test of
  // fp8_ds_mla's geometry rules narrows further.
  mlakv::MlaRopeCacheParams ds_mla_k_side_only() const {
    mlakv::MlaRopeCacheParams p = p_;
    for (TensorView* t : {&p.q_out, &p.q_pe, &p.ql_nope, &p.q, &p.q_prefill_out}) *t = TensorView{};
    p.num_decode_tokens = 0;
    p.kv_cache =
        mlakv::make_cache_view(ds_cache_, CacheFormat::kFloat8DsMla, kBlocks, kBlockSize, L, R);
    return p;
  }

  Arena arena_;
  void* cache_ = nullptr;
  void* ds_cache_ = nullptr;
  int32_t* error_counts_ = nullptr;
  float* scale_ = nullptr;
  TensorView fp8_q_out_;
  mlakv::MlaRopeCacheParams p_;
};

TEST_F(MlaValidation, ValidCallSucceeds) {
  mlakv::Context ctx;
  ctx.error_counts = error_counts_;
  ctx.checked = true;
  const auto before = arena_.snapshot();
  EXPECT_NO_THROW(mlakv::mla_rope_cache(p_, ctx));
  // Slot 5 (token 0) was written; the positive control for the "nothing written" checks.
  const uint8_t* entry = static_cast<const uint8_t*>(cache_) +
                         5 * mlakv::cache_entry_bytes(CacheFormat::kBFloat16, L, R);
  bool changed = false;
  for (int64_t i = 0; i < (L + R) * 2; ++i) changed |= entry[i] != kSentinel;
  EXPECT_TRUE(changed);
  EXPECT_FALSE(arena_.snapshot() == before);
}

TEST_F(MlaValidation, ValidVariantsSucceed) {
  mlakv::MlaRopeCacheParams p = p_;
  p.q_out = fp8_q_out_;
  p.q_scale = scale_;
  EXPECT_NO_THROW(mlakv::mla_rope_cache(p));
  p = p_;
  p.k_pe_out = p.k_pe;  // exact alias: in place
  p.kv_c_out = p.kv_c;
  p.q_prefill_out = TensorView{};
  EXPECT_NO_THROW(mlakv::mla_rope_cache(p));
  p = p_;
  p.kv_cache =
      mlakv::make_cache_view(ds_cache_, CacheFormat::kFloat8DsMla, kBlocks, kBlockSize, L, R);
  p.kv_cache.ds_mla_pow2_scale = true;
  EXPECT_NO_THROW(mlakv::mla_rope_cache(p));
  p = p_;
  // Split per-tensor fp8 cache: latent block 0 at cache_, rope block 0 after it.
  p.kv_cache = mlakv::make_split_cache_view(cache_, static_cast<uint8_t*>(cache_) + 4096,
                                            CacheFormat::kFloat8E5M2, 1, kBlockSize, L, R);
  p.kv_cache.scale = scale_;
  p.slot_mapping = mlakv::make_view(arena_.indices32({3, -1, 0, 1}), DType::kInt32, {T});
  EXPECT_NO_THROW(mlakv::mla_rope_cache(p));
  p = p_;
  p.q = TensorView{};  // K side and decode Q side only
  p.q_prefill_out = TensorView{};
  EXPECT_NO_THROW(mlakv::mla_rope_cache(p));
  EXPECT_NO_THROW(mlakv::mla_rope_cache_decode(p));
  p.num_tokens = 0;
  p.num_decode_tokens = 0;
  EXPECT_NO_THROW(mlakv::mla_rope_cache(p));
}

TEST_F(MlaValidation, NegativeNumTokens) {
  p_.num_tokens = -1;
  reject(p_, "num_tokens");
}

TEST_F(MlaValidation, KvCAbsent) {
  p_.kv_c = TensorView{};
  reject(p_, "kv_c");
}

TEST_F(MlaValidation, KvCWrongDims) {
  p_.kv_c = mlakv::make_view(p_.kv_c.data, DType::kBFloat16, {T, L, 1});
  reject(p_, "kv_c");
}

TEST_F(MlaValidation, KvCNotAModelDtype) {
  p_.kv_c.dtype = DType::kInt32;
  reject(p_, "kv_c");
}

TEST_F(MlaValidation, KPeDtypeDiffersFromKvC) {
  p_.k_pe.dtype = DType::kFloat16;
  reject(p_, "k_pe");
}

TEST_F(MlaValidation, LatentNotMultipleOf16) {
  p_.kv_c = mlakv::make_view(p_.kv_c.data, DType::kBFloat16, {T, 504});
  reject(p_, "kv_c");
}

TEST_F(MlaValidation, LatentTooWide) {
  p_.kv_c = mlakv::make_view(p_.kv_c.data, DType::kBFloat16, {1, 1040});
  reject(p_, "kv_c");
}

TEST_F(MlaValidation, RopeDimOdd) {
  p_.k_pe = mlakv::make_view(p_.k_pe.data, DType::kBFloat16, {T, 63});
  reject(p_, "k_pe");
}

TEST_F(MlaValidation, KvCTooFewRows) {
  p_.kv_c.shape[0] = T - 1;
  reject(p_, "kv_c");
}

TEST_F(MlaValidation, InnermostStrideNotOne) {
  p_.k_pe = mlakv::make_strided_view(p_.k_pe.data, DType::kBFloat16, {2, R / 2}, {R, 2});
  p_.num_tokens = 2;
  p_.num_decode_tokens = 2;
  reject(p_, "k_pe");
}

TEST_F(MlaValidation, ZeroStrideOnRowDim) {
  p_.kv_c.stride[0] = 0;
  reject(p_, "kv_c");
}

TEST_F(MlaValidation, NegativeStride) {
  p_.q_out.stride[1] = -(L + R);
  reject(p_, "q_out");
}

TEST_F(MlaValidation, MisalignedBf16Pointer) {
  p_.kv_c.data = static_cast<uint8_t*>(p_.kv_c.data) + 1;
  reject(p_, "kv_c");
}

TEST_F(MlaValidation, NullData) {
  p_.k_pe.data = nullptr;
  reject(p_, "k_pe");
}

TEST_F(MlaValidation, PositionsFloat) {
  p_.positions.dtype = DType::kFloat32;
  reject(p_, "positions");
}

TEST_F(MlaValidation, SlotMappingTooShort) {
  p_.slot_mapping.shape[0] = T - 1;
  reject(p_, "slot_mapping");
}

TEST_F(MlaValidation, CosSinWrongWidth) {
  p_.cos_sin_cache = mlakv::make_view(p_.cos_sin_cache.data, DType::kFloat32, {kMaxPos / 2, 2 * R});
  reject(p_, "cos_sin_cache");
}

TEST_F(MlaValidation, CosSinWrongDtype) {
  p_.cos_sin_cache.dtype = DType::kFloat8E4M3;
  reject(p_, "cos_sin_cache");
}

TEST_F(MlaValidation, CosSinNoRows) {
  p_.cos_sin_cache.shape[0] = 0;
  reject(p_, "cos_sin_cache");
}

TEST_F(MlaValidation, NormWeightWrongSize) {
  p_.kv_norm_weight.shape[0] = L - 16;
  reject(p_, "kv_norm_weight");
}

TEST_F(MlaValidation, NormEpsNegativeOrNotFinite) {
  for (const float eps : {-1e-6f, -1e-30f, NAN, INFINITY}) {
    p_.kv_norm_eps = eps;
    reject(p_, "kv_norm_eps");
  }
}

TEST_F(MlaValidation, CacheGeometryMismatch) {
  p_.kv_cache.kv_lora_rank = 256;
  reject(p_, "kv_cache");
}

TEST_F(MlaValidation, CacheBlockSizeZero) {
  p_.kv_cache.block_size = 0;
  reject(p_, "kv_cache");
}

TEST_F(MlaValidation, CacheNegativeBlocks) {
  p_.kv_cache.num_blocks = -1;
  reject(p_, "kv_cache");
}

TEST_F(MlaValidation, CacheTokenStrideTooSmall) {
  p_.kv_cache.stride_token_bytes -= 2;
  reject(p_, "kv_cache");
}

TEST_F(MlaValidation, CacheBlockStrideTooSmall) {
  p_.kv_cache.stride_block_bytes -= 2;
  reject(p_, "kv_cache");
}

TEST_F(MlaValidation, CacheStrideMisaligned) {
  p_.kv_cache.stride_token_bytes += 1;
  p_.kv_cache.stride_block_bytes = kBlockSize * p_.kv_cache.stride_token_bytes;
  reject(p_, "kv_cache");
}

// The stride of a size-1 dim is never used, so any value is taken, as for every tensor (a torch
// view of one block, or of blocks of one entry, may carry any): the entries written are those of
// the packed view. Used strides with the same values are rejected above.
TEST_F(MlaValidation, CacheUnusedStridesTakeAnyValue) {
  const size_t bytes =
      static_cast<size_t>(mlakv::cache_bytes(CacheFormat::kBFloat16, kBlocks, kBlockSize, L, R));
  uint8_t* cache = static_cast<uint8_t*>(cache_);
  auto run = [&](const mlakv::KVCacheView& view) {
    std::memset(cache, kSentinel, bytes);
    mlakv::MlaRopeCacheParams p = p_;
    p.kv_cache = view;
    std::memset(error_counts_, 0, 4 * mlakv::kNumErrorCounters);
    mlakv::Context ctx;
    ctx.error_counts = error_counts_;
    ctx.checked = true;  // throws if anything is counted: every slot (5, padding, 0, 7) fits
    mlakv::mla_rope_cache(p, ctx);
    return std::vector<uint8_t>(cache, cache + bytes);
  };
  const auto packed = run(p_.kv_cache);
  ASSERT_NE(packed, std::vector<uint8_t>(bytes, kSentinel));
  for (int64_t junk :
       {int64_t{0}, int64_t{3}, int64_t{1} << 40, int64_t{-1}, -(int64_t{1} << 40)}) {
    SCOPED_TRACE(junk);
    // One block of all kBlocks * kBlockSize slots: the block stride is unused.
    mlakv::KVCacheView one_block =
        mlakv::make_cache_view(cache_, CacheFormat::kBFloat16, 1, kBlocks * kBlockSize, L, R);
    one_block.stride_block_bytes = junk;
    EXPECT_EQ(run(one_block), packed);
    // Blocks of one entry: the token stride is unused.
    mlakv::KVCacheView one_entry =
        mlakv::make_cache_view(cache_, CacheFormat::kBFloat16, kBlocks * kBlockSize, 1, L, R);
    one_entry.stride_token_bytes = junk;
    EXPECT_EQ(run(one_entry), packed);
  }
  // Still bounded like every stride: |stride| < 2^56.
  mlakv::KVCacheView one_block =
      mlakv::make_cache_view(cache_, CacheFormat::kBFloat16, 1, kBlocks * kBlockSize, L, R);
  one_block.stride_block_bytes = -(int64_t{1} << 56);
  mlakv::MlaRopeCacheParams p = p_;
  p.kv_cache = one_block;
  std::memset(cache, kSentinel, bytes);
  reject(p, "kv_cache: expected stride_token_bytes and stride_block_bytes in [0, 2^56)");
}

// Sizes whose byte products pass 2^56 (or int64) are rejected before any product is used: no
// offset an op computes can wrap.
TEST_F(MlaValidation, ViewPastTheExtentLimit) {
  p_.kv_c.shape[0] = int64_t{1} << 50;  // 2^50 rows of 1 KB
  reject(p_, "kv_c: expected a view within 2^56 bytes");
}

TEST_F(MlaValidation, CacheSlotCountOverflows) {
  p_.kv_cache.num_blocks = int64_t{1} << 61;  // num_blocks * block_size passes int64
  reject(p_, "kv_cache: expected num_blocks * block_size below 2^56");
}

TEST_F(MlaValidation, CacheBlockStrideProductOverflows) {
  p_.kv_cache.block_size = int64_t{1} << 40;  // block_size * stride_token_bytes passes int64
  p_.kv_cache.stride_token_bytes = int64_t{1} << 30;
  reject(p_, "kv_cache: expected stride_block_bytes >= block_size * stride_token_bytes");
}

TEST_F(MlaValidation, CachePastTheExtentLimit) {
  // Strides consistent with each other, the entries 2^57 bytes long in all.
  p_.kv_cache.num_blocks = int64_t{1} << 44;
  p_.kv_cache.stride_block_bytes = int64_t{1} << 13;  // 4 entries of 2 KB
  p_.kv_cache.stride_token_bytes = int64_t{1} << 11;
  reject(p_, "kv_cache: expected entries spanning less than 2^56 bytes");
}

TEST_F(MlaValidation, CacheMisalignedData) {
  p_.kv_cache.data = static_cast<uint8_t*>(cache_) + 1;
  reject(p_, "kv_cache");
}

TEST_F(MlaValidation, CacheUnknownFormat) {
  p_.kv_cache.format = static_cast<CacheFormat>(42);
  reject(p_, "kv_cache");
}

TEST_F(MlaValidation, ScaleOnBf16Cache) {
  p_.kv_cache.scale = scale_;
  reject(p_, "kv_cache");
}

// fp8_ds_mla keeps a scale per tile in each entry: it takes no per-tensor scale either.
TEST_F(MlaValidation, ScaleOnDsMlaCache) {
  mlakv::MlaRopeCacheParams p = ds_mla_k_side_only();
  p.kv_cache.scale = scale_;
  reject(p, "kv_cache: a scale is taken by the per-tensor fp8 formats only");
}

TEST_F(MlaValidation, Pow2ScaleOnBf16Cache) {
  p_.kv_cache.ds_mla_pow2_scale = true;
  reject(p_, "kv_cache");
}

TEST_F(MlaValidation, DsMlaNeedsL512) {
  // L = 256 everywhere, cache view geometry included: the format itself rejects it.
  mlakv::MlaRopeCacheParams p = ds_mla_k_side_only();
  p.kv_c = mlakv::make_view(p_.kv_c.data, DType::kBFloat16, {T, 256});
  p.kv_norm_weight = TensorView{};
  p.kv_c_out = TensorView{};
  p.kv_cache.kv_lora_rank = 256;
  reject(p, "kv_cache");
}

TEST_F(MlaValidation, DsMlaNeedsBf16) {
  p_.kv_cache =
      mlakv::make_cache_view(ds_cache_, CacheFormat::kFloat8DsMla, kBlocks, kBlockSize, L, R);
  for (TensorView* t : {&p_.kv_c, &p_.k_pe, &p_.kv_norm_weight, &p_.k_pe_out, &p_.kv_c_out,
                        &p_.q_pe, &p_.ql_nope, &p_.q_out, &p_.q, &p_.q_prefill_out}) {
    t->dtype = DType::kFloat16;
  }
  reject(p_, "kv_cache");
}

TEST_F(MlaValidation, DsMlaSplitRejected) {
  p_.kv_cache =
      mlakv::make_cache_view(ds_cache_, CacheFormat::kFloat8DsMla, kBlocks, kBlockSize, L, R);
  p_.kv_cache.rope_data = cache_;
  reject(p_, "kv_cache");
}

TEST_F(MlaValidation, SplitCacheRopeStrideTooSmall) {
  p_.kv_cache = mlakv::make_split_cache_view(cache_, static_cast<uint8_t*>(cache_) + 4096,
                                             CacheFormat::kBFloat16, 1, kBlockSize, L, R);
  p_.kv_cache.stride_rope_token_bytes = R * 2 - 2;
  reject(p_, "kv_cache");
}

// The split layout without its latent data: with slots, the non-null data rule rejects it; with
// none, the split layout's own rule does.
TEST_F(MlaValidation, SplitCacheMissingLatentData) {
  const std::pair<int64_t, const char*> cases[] = {
      {1, "kv_cache: expected non-null data for 4 slots"},
      {0, "kv_cache: split layout needs both data and rope_data"}};
  for (const auto& [num_blocks, message] : cases) {
    SCOPED_TRACE(num_blocks);
    p_.kv_cache = mlakv::make_split_cache_view(nullptr, cache_, CacheFormat::kBFloat16, num_blocks,
                                               kBlockSize, L, R);
    reject(p_, message);
  }
}

TEST_F(MlaValidation, DeviceMismatch) {
  // A CUDA k_pe next to a CPU kv_c: rejected whether or not the CUDA backend is built.
  p_.k_pe.device = {mlakv::DeviceType::kCUDA, 0};
  reject(p_, "k_pe");
}

TEST_F(MlaValidation, CacheDeviceMismatch) {
  p_.kv_cache.device = {mlakv::DeviceType::kCUDA, 0};
  reject(p_, "kv_cache");
}

TEST_F(MlaValidation, DecodeCountAboveT) {
  p_.num_decode_tokens = T + 1;
  reject(p_, "num_decode_tokens");
}

TEST_F(MlaValidation, DecodeCountNegative) {
  p_.num_decode_tokens = -1;
  reject(p_, "num_decode_tokens");
}

TEST_F(MlaValidation, DecodeTokensNeedQOut) {
  p_.q_out = TensorView{};
  p_.q_pe = TensorView{};
  p_.ql_nope = TensorView{};
  reject(p_, "q_out");
}

TEST_F(MlaValidation, DecodeOpNeedsQOut) {
  p_.q_out = TensorView{};
  p_.q_pe = TensorView{};
  p_.ql_nope = TensorView{};
  p_.num_decode_tokens = 0;
  expect_rejected(
      arena_, [&] { mlakv::mla_rope_cache_decode(p_); }, "q_out");
}

TEST_F(MlaValidation, PrefillOpNeedsQ) {
  p_.q = TensorView{};
  p_.q_prefill_out = TensorView{};
  expect_rejected(
      arena_, [&] { mlakv::mla_rope_cache_prefill(p_); }, "q");
}

TEST_F(MlaValidation, QOutWithoutQPe) {
  p_.q_pe = TensorView{};
  reject(p_, "q_pe");
}

TEST_F(MlaValidation, QPeWithoutQOut) {
  p_.q_out = TensorView{};
  p_.num_decode_tokens = 0;
  reject(p_, "q_pe");
}

TEST_F(MlaValidation, QOutWrongLastDim) {
  p_.q_out.shape[2] = L + R - 2;
  reject(p_, "q_out");
}

TEST_F(MlaValidation, QOutTooFewRowsForTd) {
  p_.q_out.shape[0] = Td - 1;
  reject(p_, "q_out");
}

TEST_F(MlaValidation, DeviceTdNeedsTRows) {
  // With Td on the device, decode tensors need T rows; Td rows are not enough.
  const int32_t* device_td = static_cast<const int32_t*>(arena_.indices32({Td}));
  p_.num_decode_tokens_device = device_td;
  p_.num_decode_tokens = 0;
  p_.q_out.shape[0] = Td;
  reject(p_, "q_out");
}

TEST_F(MlaValidation, DeviceTdWithAHostTd) {
  // The host Td would be ignored beside a device Td: any value but 0 is refused, in range or not.
  p_.num_decode_tokens_device = static_cast<const int32_t*>(arena_.indices32({Td}));
  for (const int64_t host_td : {int64_t{Td}, int64_t{-7}, int64_t{1000000}}) {
    p_.num_decode_tokens = host_td;
    reject(p_, "num_decode_tokens: expected 0 with num_decode_tokens_device");
  }
}

TEST_F(MlaValidation, QOutHeadsDifferFromQPe) {
  p_.q_pe.shape[1] = 1;
  reject(p_, "q_pe");
}

TEST_F(MlaValidation, QOutWrongDtype) {
  // The validator's own rule, not the CPU backend's dispatch (which names q_out too).
  p_.q_out.dtype = DType::kFloat16;
  reject(p_, "q_out: expected the model dtype bfloat16 (from kv_c)");
}

TEST_F(MlaValidation, Fp8QOutNeedsQlNope) {
  p_.q_out = fp8_q_out_;
  p_.ql_nope = TensorView{};
  reject(p_, "ql_nope");
}

TEST_F(MlaValidation, Fp8QOutMustNotAliasQlNope) {
  // ql_nope read from the bytes of the fp8 q_out it would be quantized into.
  p_.q_out = fp8_q_out_;
  p_.ql_nope = mlakv::make_view(fp8_q_out_.data, DType::kBFloat16, {T / 2, H, L});
  p_.num_decode_tokens = T / 2;
  reject(p_, "ql_nope");
}

TEST_F(MlaValidation, Fp8QOutMustNotAliasQPe) {
  p_.q_out = fp8_q_out_;
  p_.q_pe = mlakv::make_view(fp8_q_out_.data, DType::kBFloat16, {T / 2, H, R});
  p_.num_decode_tokens = T / 2;
  reject(p_, "q_pe");
}

TEST_F(MlaValidation, QPeInsideBf16QOutIsAllowed) {
  // The absorb path may leave q_pe in q_out's rope part: rotated in place.
  p_.q_pe = mlakv::make_strided_view(static_cast<uint16_t*>(p_.q_out.data) + L, DType::kBFloat16,
                                     {T, H, R}, {H * (L + R), L + R, 1});
  p_.ql_nope =
      mlakv::make_strided_view(p_.q_out.data, DType::kBFloat16, {T, H, L}, {H * (L + R), L + R, 1});
  EXPECT_NO_THROW(mlakv::mla_rope_cache(p_));
}

TEST_F(MlaValidation, QlNopePartialAlias) {
  // Starts at q_out but with another head stride: neither q_out's nope part nor disjoint.
  p_.ql_nope =
      mlakv::make_strided_view(p_.q_out.data, DType::kBFloat16, {T, H, L}, {H * (L + R), L, 1});
  reject(p_, "ql_nope");
}

TEST_F(MlaValidation, QScaleWithBf16QOut) {
  p_.q_scale = scale_;
  reject(p_, "q_scale");
}

TEST_F(MlaValidation, QScaleMisaligned) {
  p_.q_out = fp8_q_out_;
  p_.q_scale = reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(scale_) + 2);
  reject(p_, "q_scale");
}

TEST_F(MlaValidation, QWidthBelowR) {
  p_.q = mlakv::make_view(p_.q.data, DType::kBFloat16, {T, H, R - 2});
  p_.q_prefill_out = TensorView{};
  reject(p_, "q");
}

TEST_F(MlaValidation, QHeadsDifferFromQOut) {
  p_.q.shape[1] = 1;
  reject(p_, "q");
}

TEST_F(MlaValidation, QPrefillOutWithoutQ) {
  p_.q = TensorView{};
  reject(p_, "q_prefill_out");
}

TEST_F(MlaValidation, QPrefillOutWrongShape) {
  p_.q_prefill_out.shape[2] = P;
  reject(p_, "q_prefill_out");
}

TEST_F(MlaValidation, KPeOutPartialAlias) {
  p_.k_pe_out = mlakv::make_strided_view(p_.k_pe.data, DType::kBFloat16, {T / 2, R}, {2 * R, 1});
  p_.num_tokens = T / 2;
  p_.num_decode_tokens = T / 2;
  reject(p_, "k_pe_out");
}

// ---- memory shared between tensors: an output shares no byte with another tensor, except as
// the exact aliases (the same data and strides) the op allows.

TEST_F(MlaValidation, KPeOutOneRowAfterKPe) {
  // The same strides one row later: token t's k_pe_out would overwrite token t + 1's k_pe.
  p_.k_pe_out =
      mlakv::make_view(static_cast<uint16_t*>(p_.k_pe.data) + R, DType::kBFloat16, {T - 1, R});
  p_.num_tokens = T - 1;
  reject(p_, "k_pe_out");
}

TEST_F(MlaValidation, KvCOutInsideTheCache) {
  p_.kv_c_out = mlakv::make_view(cache_, DType::kBFloat16, {T, L});
  reject(p_, "kv_c_out");
}

TEST_F(MlaValidation, QOutOverlapsKvCOut) {
  p_.q_out = mlakv::make_view(p_.kv_c_out.data, DType::kBFloat16, {1, 1, L + R});
  p_.q_pe = mlakv::make_view(p_.q_pe.data, DType::kBFloat16, {1, 1, R});
  p_.ql_nope = mlakv::make_view(p_.ql_nope.data, DType::kBFloat16, {1, 1, L});
  p_.num_decode_tokens = 1;
  p_.q = TensorView{};
  p_.q_prefill_out = TensorView{};
  reject(p_, "q_out");
}

TEST_F(MlaValidation, QPeShiftedInsideBf16QOut) {
  // Inside q_out's rope part but two elements off: neither exact nor disjoint.
  p_.q_pe = mlakv::make_strided_view(static_cast<uint16_t*>(p_.q_out.data) + L + 2,
                                     DType::kBFloat16, {T - 1, H, R}, {H * (L + R), L + R, 1});
  p_.num_tokens = T - 1;
  reject(p_, "q_pe");
}

TEST_F(MlaValidation, ErrorCountsInsideAnOutput) {
  mlakv::Context ctx;
  ctx.error_counts = static_cast<int32_t*>(p_.k_pe_out.data);
  reject(p_, "error_counts", ctx);
}

TEST_F(MlaValidation, SplitCacheRopeInsideLatent) {
  p_.kv_cache = mlakv::make_split_cache_view(cache_, static_cast<uint8_t*>(cache_) + 512,
                                             CacheFormat::kBFloat16, 1, kBlockSize, L, R);
  reject(p_, "kv_cache");
}

TEST_F(MlaValidation, InterleavedViewsOfOneBufferAreDisjoint) {
  // kv_c and k_pe as the kv_a projection's [T, L + R] output, kv_c_out and k_pe_out as one
  // [T, L + R] buffer: interleaved, never overlapping. The outputs equal those of separate ones.
  void* in = arena_.random_bf16(T * (L + R));
  p_.kv_c = mlakv::make_strided_view(in, DType::kBFloat16, {T, L}, {L + R, 1});
  p_.k_pe = mlakv::make_strided_view(static_cast<uint16_t*>(in) + L, DType::kBFloat16, {T, R},
                                     {L + R, 1});
  EXPECT_NO_THROW(mlakv::mla_rope_cache(p_));
  std::vector<uint16_t> kv_c_out(T * L), k_pe_out(T * R);
  std::memcpy(kv_c_out.data(), p_.kv_c_out.data, kv_c_out.size() * 2);
  std::memcpy(k_pe_out.data(), p_.k_pe_out.data, k_pe_out.size() * 2);

  auto* out = static_cast<uint16_t*>(arena_.sentinel(T * (L + R) * 2));
  p_.kv_c_out = mlakv::make_strided_view(out, DType::kBFloat16, {T, L}, {L + R, 1});
  p_.k_pe_out = mlakv::make_strided_view(out + L, DType::kBFloat16, {T, R}, {L + R, 1});
  EXPECT_NO_THROW(mlakv::mla_rope_cache(p_));
  for (int64_t t = 0; t < T; ++t) {
    EXPECT_EQ(std::memcmp(out + t * (L + R), kv_c_out.data() + t * L, L * 2), 0) << "row " << t;
    EXPECT_EQ(std::memcmp(out + t * (L + R) + L, k_pe_out.data() + t * R, R * 2), 0) << "row " << t;
  }
  // And in place, both in the input buffer.
  p_.kv_c_out = p_.kv_c;
  p_.k_pe_out = p_.k_pe;
  EXPECT_NO_THROW(mlakv::mla_rope_cache(p_));
}

TEST_F(MlaValidation, QPeViewOfQNeedsDisjointRows) {
  // q_pe may be the decode rows' rope part of q (rows [0, Td)) while q's prefill rows [Td, T)
  // are rotated in place; not a prefill row's.
  p_.q_prefill_out = TensorView{};
  p_.q_pe = mlakv::make_strided_view(static_cast<uint16_t*>(p_.q.data) + P, DType::kBFloat16,
                                     {T, H, R}, {H * (P + R), P + R, 1});
  EXPECT_NO_THROW(mlakv::mla_rope_cache(p_));
  // One decode row whose q_pe is token 1's rope part of q: a prefill row, rotated in place.
  p_.q_out = mlakv::make_view(arena_.sentinel(H * (L + R) * 2), DType::kBFloat16, {1, H, L + R});
  p_.ql_nope = mlakv::make_view(arena_.random_bf16(H * L), DType::kBFloat16, {1, H, L});
  p_.q_pe.shape[0] = 1;
  p_.num_decode_tokens = 1;
  p_.q_pe.data = static_cast<uint16_t*>(p_.q.data) + H * (P + R) + P;  // token 1: a prefill row
  reject(p_, "q");
}

TEST_F(MlaValidation, KvCOutWrongWidth) {
  p_.kv_c_out.shape[1] = L / 2;
  reject(p_, "kv_c_out");
}

TEST_F(MlaValidation, CheckedNeedsErrorCounts) {
  mlakv::Context ctx;
  ctx.checked = true;
  reject(p_, "error_counts", ctx);
}

TEST_F(MlaValidation, MisalignedErrorCounts) {
  mlakv::Context ctx;
  ctx.error_counts = reinterpret_cast<int32_t*>(reinterpret_cast<uint8_t*>(error_counts_) + 1);
  reject(p_, "error_counts", ctx);
}

TEST_F(MlaValidation, CheckedModeReportsBadSlot) {
  mlakv::Context ctx;
  ctx.error_counts = error_counts_;
  ctx.checked = true;
  p_.slot_mapping =
      mlakv::make_view(arena_.indices({5, -1, 0, kBlocks * kBlockSize}), DType::kInt64, {T});
  try {
    mlakv::mla_rope_cache(p_, ctx);
    ADD_FAILURE() << "checked mode did not report the out-of-range slot";
  } catch (const mlakv::Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad_slot"), std::string::npos) << e.what();
  }
  int32_t counts[mlakv::kNumErrorCounters];
  mlakv::read_error_counts(error_counts_, {}, counts);
  EXPECT_EQ(counts[mlakv::kBadSlot], 1);
  EXPECT_THROW(mlakv::read_error_counts(error_counts_, {}, counts, nullptr, true), mlakv::Error);
  mlakv::reset_error_counts(error_counts_, {});
  EXPECT_NO_THROW(mlakv::read_error_counts(error_counts_, {}, counts, nullptr, true));
}

// ---- mutation round 4: rules that no test above would notice if they were broken -------------

// A device type that is neither cpu nor cuda is rejected by validation (the dispatch would
// otherwise send it to the CUDA backend in a CUDA build), naming the argument.
TEST_F(MlaValidation, UnknownDeviceType) {
  const mlakv::Device unknown{static_cast<mlakv::DeviceType>(7), 0};
  mlakv::MlaRopeCacheParams p = p_;
  p.kv_c.device = unknown;
  reject(p, "kv_c: expected a cpu or cuda device");
  p = p_;
  p.kv_cache.device = unknown;
  reject(p, "kv_cache: expected a cpu or cuda device");
}

// Every tensor and the cache on one CUDA device: one device, so only the backend rule rejects it
// in a CPU-only build, naming the first argument (not just the dispatch's second line of defence).
// In a CUDA build, index -1 is rejected by the index rule.
TEST_F(MlaValidation, AllTensorsOnCudaWithoutTheBackendOrWithIndexMinusOne) {
  for (const int index : {0, -1}) {
    SCOPED_TRACE(index);
    if (mlakv::cuda_backend_built() && index >= 0) continue;  // a real launch on host memory
    const mlakv::Device gpu{mlakv::DeviceType::kCUDA, index};
    mlakv::MlaRopeCacheParams p = p_;
    for (TensorView* t :
         {&p.positions, &p.slot_mapping, &p.cos_sin_cache, &p.kv_c, &p.k_pe, &p.kv_norm_weight,
          &p.k_pe_out, &p.kv_c_out, &p.q_pe, &p.ql_nope, &p.q_out, &p.q, &p.q_prefill_out}) {
      t->device = gpu;
    }
    p.kv_cache.device = gpu;
    reject(p, mlakv::cuda_backend_built() ? "kv_c: expected a CUDA device index >= 0"
                                          : "kv_c: CUDA tensors given but mlakv was built without");
  }
}

// Tensors on two GPUs: the first tensor on another GPU than the ones before it is named (nothing
// launches, so no GPU is needed; a CPU-only build rejects CUDA tensors first).
TEST_F(MlaValidation, TensorsOnTwoGpus) {
  mlakv::MlaRopeCacheParams p = p_;
  for (TensorView* t :
       {&p.positions, &p.slot_mapping, &p.cos_sin_cache, &p.kv_c, &p.k_pe, &p.kv_norm_weight,
        &p.k_pe_out, &p.kv_c_out, &p.q_pe, &p.ql_nope, &p.q_out, &p.q, &p.q_prefill_out}) {
    t->device = {mlakv::DeviceType::kCUDA, 0};
  }
  p.kv_cache.device = {mlakv::DeviceType::kCUDA, 0};
  p.q_out.device = {mlakv::DeviceType::kCUDA, 1};
  reject(p, mlakv::cuda_backend_built() ? "q_out: expected to be on cuda:0"
                                        : "kv_c: CUDA tensors given but mlakv was built without");
}

// A dtype value outside the enum is named as such (dtype_size would throw a message without the
// argument's name).
TEST_F(MlaValidation, UnknownDtypeValue) {
  p_.kv_c.dtype = static_cast<DType>(42);
  reject(p_, "kv_c: expected a known dtype, got dtype value 42");
}

// kv_c sets the model dtype: consistent non-model dtypes everywhere (k_pe and every output in the
// same dtype) are rejected by the model-dtype rule itself, not by a mismatch with kv_c.
TEST_F(MlaValidation, ConsistentNonModelDtype) {
  for (const DType dtype : {DType::kFloat8E4M3, DType::kUInt8}) {
    mlakv::MlaRopeCacheParams p = p_;
    for (TensorView* t : {&p.kv_c, &p.k_pe, &p.kv_norm_weight, &p.k_pe_out, &p.kv_c_out, &p.q_pe,
                          &p.ql_nope, &p.q_out, &p.q, &p.q_prefill_out}) {
      t->dtype = dtype;
    }
    reject(p, "kv_c: expected float32, float16 or bfloat16");
  }
}

// The innermost-stride rule exempts only dims of size <= 1: a size-2 innermost dim (R = 2) with
// stride 2 is rejected.
TEST_F(MlaValidation, InnermostStrideOnASizeTwoDim) {
  p_.positions = mlakv::make_strided_view(p_.positions.data, DType::kInt64, {2}, {2});
  p_.num_tokens = 2;
  reject(p_, "positions: expected a contiguous innermost dim");
}

// The positive-stride rule exempts only dims of size <= 1: two heads of q_out at stride 0 would
// write one another's bytes.
TEST_F(MlaValidation, ZeroStrideOnASizeTwoDim) {
  ASSERT_EQ(H, 2);
  p_.q_out.stride[1] = 0;
  reject(p_, "q_out: expected positive strides");
}

// The latent and rope width rules at their bounds, each with enough rows that no other rule
// rejects the view first: L in [16, 1024] a multiple of 16, R even in [2, 256].
TEST_F(MlaValidation, LatentAndRopeWidthBounds) {
  void* wide = arena_.random_bf16(T * 1040);
  for (const int64_t width : {int64_t{0}, int64_t{1040}}) {
    SCOPED_TRACE(width);
    mlakv::MlaRopeCacheParams p = p_;
    p.kv_c = mlakv::make_strided_view(wide, DType::kBFloat16, {T, width}, {1040, 1});
    reject(p, "kv_c: expected L (kv_lora_rank) a multiple of 16 in [16, 1024]");
  }
  void* rope = arena_.random_bf16(T * 258);
  for (const int64_t width : {int64_t{0}, int64_t{258}}) {
    SCOPED_TRACE(width);
    mlakv::MlaRopeCacheParams p = p_;
    p.k_pe = mlakv::make_strided_view(rope, DType::kBFloat16, {T, width}, {258, 1});
    reject(p, "k_pe: expected R (rope dim) even in [2, 256]");
  }
}

// A combined cache with slots and no data (the split layout's rule is tested above): every write
// would go to a null address.
TEST_F(MlaValidation, CacheNullData) {
  p_.kv_cache.data = nullptr;
  reject(p_, "kv_cache: expected non-null data for 8 slots");
}

// fp8_ds_mla's own rules, each alone: R = 32 with L = 512 (the entry is 656 bytes for R = 64
// only), and a rope_data part with strides that would pass for a split cache.
TEST_F(MlaValidation, DsMlaNeedsR64AndTheCombinedLayout) {
  mlakv::MlaRopeCacheParams p = ds_mla_k_side_only();
  p.k_pe = mlakv::make_view(p_.k_pe.data, DType::kBFloat16, {T, 32});
  p.cos_sin_cache = mlakv::make_view(p_.cos_sin_cache.data, DType::kFloat32, {kMaxPos, 32});
  p.k_pe_out = TensorView{};
  p.kv_cache.rope_dim = 32;
  reject(p, "kv_cache: fp8_ds_mla needs L = 512 and R = 64");

  p = p_;
  p.kv_cache =
      mlakv::make_cache_view(ds_cache_, CacheFormat::kFloat8DsMla, kBlocks, kBlockSize, L, R);
  p.kv_cache.rope_data = arena_.sentinel(kBlocks * kBlockSize * R * 2);
  p.kv_cache.stride_rope_token_bytes = R * 2;
  p.kv_cache.stride_rope_block_bytes = kBlockSize * R * 2;
  reject(p, "kv_cache: fp8_ds_mla has only the combined layout");
}

TEST_F(MlaValidation, CacheScaleMisaligned) {
  p_.kv_cache = mlakv::make_cache_view(cache_, CacheFormat::kFloat8E4M3, kBlocks, kBlockSize, L, R);
  p_.kv_cache.scale = reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(scale_) + 2);
  reject(p_, "kv_cache: expected a 4-byte aligned fp32 scale");
}

// fp8_ds_mla entries hold fp32 tile scales: the data and the strides must be 4-byte aligned, not
// only aligned to the e4m3 latent's one byte. One block, so that the slots written (0; 5 and 7
// are out of range) stay inside the buffer even if the rule were missing.
TEST_F(MlaValidation, DsMlaNeedsFourByteAlignment) {
  mlakv::MlaRopeCacheParams p = p_;
  p.kv_cache = mlakv::make_cache_view(static_cast<uint8_t*>(ds_cache_) + 2,
                                      CacheFormat::kFloat8DsMla, 1, kBlockSize, L, R);
  reject(p, "kv_cache: expected data aligned to 4 bytes");
  p.kv_cache = mlakv::make_cache_view(ds_cache_, CacheFormat::kFloat8DsMla, 1, kBlockSize, L, R);
  p.kv_cache.stride_token_bytes += 2;
  reject(p, "kv_cache: expected stride_token_bytes and stride_block_bytes multiples of 4");
}

// Unused strides are still bounded, as every tensor's: a token stride of -2^56 (blocks of one
// entry), a block stride of 2^56 (one block), as the unused block stride of -2^56 is in
// CacheUnusedStridesTakeAnyValue. A used stride of -1 is rejected.
TEST_F(MlaValidation, CacheUnusedStridesStillBounded) {
  p_.kv_cache =
      mlakv::make_cache_view(cache_, CacheFormat::kBFloat16, kBlocks * kBlockSize, 1, L, R);
  mlakv::MlaRopeCacheParams p = p_;
  p.kv_cache.stride_token_bytes = -(int64_t{1} << 56);
  reject(p, "kv_cache: expected stride_token_bytes and stride_block_bytes in [0, 2^56)");
  p = p_;
  p.kv_cache = mlakv::make_cache_view(cache_, CacheFormat::kBFloat16, kBlocks, kBlockSize, L, R);
  p.kv_cache.stride_token_bytes = -1;
  reject(p, "kv_cache: expected stride_token_bytes and stride_block_bytes in [0, 2^56)");
  // And above: an unused block stride of 2^56 (one block).
  p = p_;
  p.kv_cache =
      mlakv::make_cache_view(cache_, CacheFormat::kBFloat16, 1, kBlocks * kBlockSize, L, R);
  p.kv_cache.stride_block_bytes = int64_t{1} << 56;
  reject(p, "kv_cache: expected stride_token_bytes and stride_block_bytes in [0, 2^56)");
}

// The entry and block strides at their exact bounds: one byte short is rejected. An fp8 cache,
// whose 1-byte alignment lets no alignment rule reject the odd strides first.
TEST_F(MlaValidation, CacheStridesOneByteShort) {
  const int64_t entry = mlakv::cache_entry_bytes(CacheFormat::kFloat8E4M3, L, R);
  p_.kv_cache = mlakv::make_cache_view(cache_, CacheFormat::kFloat8E4M3, kBlocks, kBlockSize, L, R);
  ASSERT_EQ(p_.kv_cache.stride_token_bytes, entry);
  mlakv::MlaRopeCacheParams p = p_;
  p.kv_cache.stride_token_bytes = entry - 1;
  p.kv_cache.stride_block_bytes = kBlockSize * (entry - 1);
  reject(p, "kv_cache: expected stride_token_bytes >= 576 (the entry)");
  p = p_;
  p.kv_cache.stride_block_bytes = kBlockSize * entry - 1;
  reject(p, "kv_cache: expected stride_block_bytes >= block_size * stride_token_bytes");
}

// A used block stride must be a multiple of the alignment too, with an aligned token stride.
TEST_F(MlaValidation, CacheBlockStrideMisaligned) {
  p_.kv_cache.stride_block_bytes += 1;
  reject(p_, "kv_cache: expected stride_token_bytes and stride_block_bytes multiples of 2");
}

// The extent of one block of 2^45 + 1 entries 2 KB apart passes 2^56 through the token term alone.
TEST_F(MlaValidation, CacheTokenTermPastTheExtentLimit) {
  p_.kv_cache.num_blocks = 1;
  p_.kv_cache.block_size = (int64_t{1} << 45) + 1;
  p_.kv_cache.stride_token_bytes = int64_t{1} << 11;
  reject(p_, "kv_cache: expected entries spanning less than 2^56 bytes");
}

// A cache whose last entry would pass the top of the address space (never dereferenced).
TEST_F(MlaValidation, CacheAddressWraps) {
  p_.kv_cache.data = reinterpret_cast<void*>(~uintptr_t{4095});
  reject(p_, "kv_cache: expected entries spanning less than 2^56 bytes from the cache's address");
}

TEST_F(MlaValidation, NegativeThreadCount) {
  mlakv::Context ctx;
  ctx.num_threads = -1;
  reject(p_, "ctx.num_threads: expected >= 0", ctx);
}

TEST_F(MlaValidation, UnknownRopeStyle) {
  p_.rope_style = static_cast<mlakv::RopeStyle>(9);
  reject(p_, "rope_style: expected kGptJ or kNeox");
}

// An empty output at its input's address is no alias, whatever its strides (no byte is shared):
// accepted with T = 0.
TEST_F(MlaValidation, EmptyOutputAtItsInputsAddress) {
  p_.num_tokens = 0;
  p_.num_decode_tokens = 0;
  p_.q_prefill_out = mlakv::make_strided_view(p_.q.data, DType::kBFloat16, {0, H, P + R},
                                              {H * (P + R), 2 * (P + R), 1});
  EXPECT_NO_THROW(mlakv::mla_rope_cache(p_));
}

// An exact alias need not match the stride of a size-1 dim (never used): one token's k_pe_out
// over k_pe with another row stride is k_pe rotated in place.
TEST_F(MlaValidation, ExactAliasIgnoresSizeOneStrides) {
  p_.num_tokens = 1;
  p_.num_decode_tokens = 1;
  p_.k_pe_out = mlakv::make_strided_view(p_.k_pe.data, DType::kBFloat16, {1, R}, {7, 1});
  const std::vector<uint8_t> before(static_cast<uint8_t*>(p_.k_pe.data),
                                    static_cast<uint8_t*>(p_.k_pe.data) + R * 2);
  EXPECT_NO_THROW(mlakv::mla_rope_cache(p_));
  EXPECT_NE(std::memcmp(before.data(), p_.k_pe.data, R * 2), 0) << "k_pe not rotated in place";
}

// q_pe is read for the Td decode rows: fewer rows would be read past its end.
TEST_F(MlaValidation, QPeTooFewRowsForTd) {
  p_.q_pe.shape[0] = Td - 1;
  reject(p_, "q_pe: expected shape[0] >= Td = 2");
}

// q of the rope part only (P = 0) is a valid prefill query.
TEST_F(MlaValidation, QOfTheRopePartOnly) {
  p_.q = mlakv::make_view(p_.q.data, DType::kBFloat16, {T, H, R});
  p_.q_prefill_out = TensorView{};
  EXPECT_NO_THROW(mlakv::mla_rope_cache(p_));
}

// ---- the other ops --------------------------------------------------------------------------

class OpsValidation : public ::testing::Test {
 protected:
  static constexpr int64_t T = 3, H = 2, L = 64, R = 32, kHead = 48, kMaxPos = 16;

  Arena arena_;
};

TEST_F(OpsValidation, RotaryEmbedding) {
  mlakv::RotaryEmbeddingParams p;
  p.num_tokens = T;
  p.positions = mlakv::make_view(arena_.indices({0, 5, 15}), DType::kInt64, {T});
  p.query = mlakv::make_view(arena_.random_bf16(T * H * kHead), DType::kBFloat16, {T, H, kHead});
  p.key = mlakv::make_view(arena_.random_bf16(T * 1 * kHead), DType::kBFloat16, {T, 1, kHead});
  p.cos_sin_cache = mlakv::make_view(arena_.random_f32(kMaxPos * R), DType::kFloat32, {kMaxPos, R});
  EXPECT_NO_THROW(mlakv::rotary_embedding(p));

  mlakv::RotaryEmbeddingParams bad = p;
  bad.cos_sin_cache = mlakv::make_view(p.cos_sin_cache.data, DType::kFloat32, {kMaxPos / 4, 64});
  expect_rejected(
      arena_, [&] { mlakv::rotary_embedding(bad); }, "cos_sin_cache");
  bad = p;
  bad.query = mlakv::make_view(arena_.random_bf16(1 * 1 * 520), DType::kBFloat16, {1, 1, 520});
  bad.key = TensorView{};
  bad.num_tokens = 1;
  bad.cos_sin_cache = mlakv::make_view(arena_.random_f32(2 * 258), DType::kFloat32, {2, 258});
  expect_rejected(
      arena_, [&] { mlakv::rotary_embedding(bad); }, "cos_sin_cache");
  bad = p;
  bad.key.shape[2] = kHead - 2;
  expect_rejected(
      arena_, [&] { mlakv::rotary_embedding(bad); }, "key");
  bad = p;
  bad.key.dtype = DType::kFloat32;
  expect_rejected(
      arena_, [&] { mlakv::rotary_embedding(bad); }, "key");
  bad = p;
  bad.query.shape[0] = T - 1;
  expect_rejected(
      arena_, [&] { mlakv::rotary_embedding(bad); }, "query");
  bad = p;
  bad.positions.dtype = DType::kUInt8;
  expect_rejected(
      arena_, [&] { mlakv::rotary_embedding(bad); }, "positions");
  bad = p;
  bad.key = mlakv::make_view(p.query.data, DType::kBFloat16, {T, 1, kHead});  // inside query
  expect_rejected(
      arena_, [&] { mlakv::rotary_embedding(bad); }, "key");
}

TEST_F(OpsValidation, ConcatAndCacheMla) {
  void* cache = arena_.sentinel(
      static_cast<size_t>(mlakv::cache_bytes(CacheFormat::kFloat8E4M3, 1, 4, L, R)));
  mlakv::ConcatAndCacheMlaParams p;
  p.num_tokens = T;
  p.kv_c = mlakv::make_view(arena_.random_bf16(T * L), DType::kBFloat16, {T, L});
  p.k_pe = mlakv::make_view(arena_.random_bf16(T * R), DType::kBFloat16, {T, R});
  p.slot_mapping = mlakv::make_view(arena_.indices32({0, 3, -1}), DType::kInt32, {T});
  p.kv_cache = mlakv::make_cache_view(cache, CacheFormat::kFloat8E4M3, 1, 4, L, R);
  EXPECT_NO_THROW(mlakv::concat_and_cache_mla(p));

  mlakv::ConcatAndCacheMlaParams bad = p;
  bad.slot_mapping.dtype = DType::kFloat32;
  expect_rejected(
      arena_, [&] { mlakv::concat_and_cache_mla(bad); }, "slot_mapping");
  bad = p;
  bad.kv_cache.rope_dim = 16;
  expect_rejected(
      arena_, [&] { mlakv::concat_and_cache_mla(bad); }, "kv_cache");
  bad = p;
  bad.kv_cache.format = CacheFormat::kFloat8DsMla;
  expect_rejected(
      arena_, [&] { mlakv::concat_and_cache_mla(bad); }, "kv_cache");
  bad = p;
  bad.k_pe = mlakv::make_view(p.k_pe.data, DType::kBFloat16, {T, R / 2});
  expect_rejected(
      arena_, [&] { mlakv::concat_and_cache_mla(bad); }, "kv_cache");
  bad = p;  // the cache over the input it is written from
  bad.kv_cache = mlakv::make_cache_view(p.kv_c.data, CacheFormat::kFloat8E4M3, 1, 1, L, R);
  expect_rejected(
      arena_, [&] { mlakv::concat_and_cache_mla(bad); }, "kv_cache");
}

TEST_F(OpsValidation, DecodeQConcat) {
  mlakv::DecodeQConcatParams p;
  p.num_tokens = T;
  p.ql_nope = mlakv::make_view(arena_.random_bf16(T * H * L), DType::kBFloat16, {T, H, L});
  p.q_pe = mlakv::make_view(arena_.random_bf16(T * H * R), DType::kBFloat16, {T, H, R});
  void* out8 = arena_.sentinel(T * H * (L + R));
  p.q_out = mlakv::make_view(out8, DType::kFloat8E5M2, {T, H, L + R});
  EXPECT_NO_THROW(mlakv::decode_q_concat(p));

  mlakv::DecodeQConcatParams bad = p;
  bad.ql_nope = mlakv::make_strided_view(out8, DType::kBFloat16, {1, H, L},
                                         {H * (L + R) / 2, (L + R) / 2, 1});
  bad.num_tokens = 1;
  expect_rejected(
      arena_, [&] { mlakv::decode_q_concat(bad); }, "ql_nope");
  bad = p;
  bad.q_out =
      mlakv::make_view(arena_.sentinel(T * H * (L + R) * 2), DType::kBFloat16, {T, H, L + R});
  bad.q_scale = static_cast<const float*>(arena_.random_f32(1));
  expect_rejected(
      arena_, [&] { mlakv::decode_q_concat(bad); }, "q_scale");
  bad = p;
  bad.q_pe.shape[2] = R - 2;
  expect_rejected(
      arena_, [&] { mlakv::decode_q_concat(bad); }, "q_out");
  bad = p;  // a bf16 q_out over ql_nope shifted by one head: neither exact nor disjoint
  bad.q_out = mlakv::make_strided_view(static_cast<uint16_t*>(p.ql_nope.data) + L, DType::kBFloat16,
                                       {1, 1, L + R}, {H * (L + R), L + R, 1});
  bad.num_tokens = 1;
  expect_rejected(
      arena_, [&] { mlakv::decode_q_concat(bad); }, "q_out");
}

TEST_F(OpsValidation, RmsNorm) {
  mlakv::RmsNormParams p;
  p.num_tokens = T;
  p.input = mlakv::make_view(arena_.random_bf16(T * L), DType::kBFloat16, {T, L});
  p.weight = mlakv::make_view(arena_.random_bf16(L), DType::kBFloat16, {L});
  p.output = p.input;  // in place is allowed
  EXPECT_NO_THROW(mlakv::rms_norm(p));

  mlakv::RmsNormParams bad = p;
  bad.weight.shape[0] = L - 1;
  expect_rejected(
      arena_, [&] { mlakv::rms_norm(bad); }, "weight");
  bad = p;
  bad.eps = -1.0f;
  expect_rejected(
      arena_, [&] { mlakv::rms_norm(bad); }, "eps");
  bad = p;  // a row of 2^31 elements (4 GiB: views that are never dereferenced)
  bad.num_tokens = 1;
  bad.input = mlakv::make_view(p.input.data, DType::kBFloat16, {1, int64_t{1} << 31});
  bad.weight = mlakv::make_view(p.weight.data, DType::kBFloat16, {int64_t{1} << 31});
  bad.output = mlakv::make_view(arena_.sentinel(2 * L), DType::kBFloat16, {1, int64_t{1} << 31});
  expect_rejected(
      arena_, [&] { mlakv::rms_norm(bad); }, "input: expected N = shape[1] in [1, 2^31)");
  bad = p;
  bad.output = mlakv::make_strided_view(p.input.data, DType::kBFloat16, {1, L}, {2 * L, 1});
  bad.output.shape[0] = T;
  expect_rejected(
      arena_, [&] { mlakv::rms_norm(bad); }, "output");
  bad = p;  // one row after the input: row t's output would overwrite row t + 1's input
  bad.output =
      mlakv::make_view(static_cast<uint16_t*>(p.input.data) + L, DType::kBFloat16, {T - 1, L});
  bad.num_tokens = T - 1;
  expect_rejected(
      arena_, [&] { mlakv::rms_norm(bad); }, "output");
  bad = p;  // rows that overlap one another
  bad.output =
      mlakv::make_strided_view(arena_.sentinel(T * L * 2), DType::kBFloat16, {T, L}, {L / 2, 1});
  expect_rejected(
      arena_, [&] { mlakv::rms_norm(bad); }, "output");
  bad = p;
  bad.output = mlakv::make_view(arena_.sentinel(T * L * 2), DType::kBFloat16, {T, L});
  bad.weight = mlakv::make_view(bad.output.data, DType::kBFloat16, {L});
  expect_rejected(
      arena_, [&] { mlakv::rms_norm(bad); }, "output");
}

TEST_F(OpsValidation, GatherCache) {
  void* cache =
      arena_.sentinel(static_cast<size_t>(mlakv::cache_bytes(CacheFormat::kBFloat16, 2, 4, L, R)));
  mlakv::GatherCacheSlotsParams p;
  p.num_tokens = T;
  p.kv_cache = mlakv::make_cache_view(cache, CacheFormat::kBFloat16, 2, 4, L, R);
  p.slots = mlakv::make_view(arena_.indices({1, -1, 7}), DType::kInt64, {T});
  p.out = mlakv::make_view(arena_.sentinel(T * (L + R) * 4), DType::kFloat32, {T, L + R});
  EXPECT_NO_THROW(mlakv::gather_cache_slots(p));

  mlakv::GatherCacheSlotsParams bad = p;
  bad.out.dtype = DType::kFloat16;
  expect_rejected(
      arena_, [&] { mlakv::gather_cache_slots(bad); }, "out");
  bad = p;
  bad.slots.shape[0] = T - 1;
  expect_rejected(
      arena_, [&] { mlakv::gather_cache_slots(bad); }, "slots");
  bad = p;
  bad.out = mlakv::make_view(cache, DType::kFloat32, {T, L + R});  // the read-back into the cache
  expect_rejected(
      arena_, [&] { mlakv::gather_cache_slots(bad); }, "out");

  mlakv::GatherCacheSequencesParams s;
  s.num_seqs = 2;
  s.kv_cache = p.kv_cache;
  s.block_table = mlakv::make_view(arena_.indices32({0, 1, 1, 0}), DType::kInt32, {2, 2});
  s.cu_seq_lens = mlakv::make_view(arena_.indices32({0, 3, 8}), DType::kInt32, {3});
  s.out = mlakv::make_view(arena_.sentinel(8 * (L + R) * 2), DType::kBFloat16, {8, L + R});
  EXPECT_NO_THROW(mlakv::gather_cache_sequences(s));

  mlakv::GatherCacheSequencesParams sbad = s;
  sbad.block_table.dtype = DType::kInt64;
  expect_rejected(
      arena_, [&] { mlakv::gather_cache_sequences(sbad); }, "block_table");
  sbad = s;
  sbad.cu_seq_lens.shape[0] = 2;
  expect_rejected(
      arena_, [&] { mlakv::gather_cache_sequences(sbad); }, "cu_seq_lens");
  sbad = s;
  sbad.out.shape[1] = L;
  expect_rejected(
      arena_, [&] { mlakv::gather_cache_sequences(sbad); }, "out");
  sbad = s;
  sbad.out = mlakv::make_view(s.cu_seq_lens.data, DType::kBFloat16, {1, L + R});
  expect_rejected(
      arena_, [&] { mlakv::gather_cache_sequences(sbad); }, "out");
  // An empty block table of INT64_MAX rows and num_seqs = INT64_MAX: B + 1 would wrap, and the
  // cu_seq_lens check with it (the CPU backend then read past cu_seq_lens).
  sbad = s;
  sbad.num_seqs = INT64_MAX;
  sbad.block_table.shape[0] = INT64_MAX;
  sbad.block_table.shape[1] = 0;
  expect_rejected(
      arena_, [&] { mlakv::gather_cache_sequences(sbad); },
      "num_seqs: expected >= 0 and below 2^56");
  sbad.num_seqs = 2;
  expect_rejected(
      arena_, [&] { mlakv::gather_cache_sequences(sbad); },
      "block_table: expected a view within 2^56 bytes");
}

// A negative size is rejected in dims that no other rule bounds (the block table's width, the
// sequences' output rows): without the sizes >= 0 rule, -1 spans one element and passes.
TEST_F(OpsValidation, NegativeSizesInUnboundDims) {
  void* cache =
      arena_.sentinel(static_cast<size_t>(mlakv::cache_bytes(CacheFormat::kBFloat16, 2, 4, L, R)));
  mlakv::GatherCacheSequencesParams s;
  s.num_seqs = 2;
  s.kv_cache = mlakv::make_cache_view(cache, CacheFormat::kBFloat16, 2, 4, L, R);
  s.block_table = mlakv::make_view(arena_.indices32({0, 1, 1, 0}), DType::kInt32, {2, 2});
  s.cu_seq_lens = mlakv::make_view(arena_.indices32({0, 3, 8}), DType::kInt32, {3});
  s.out = mlakv::make_view(arena_.sentinel(8 * (L + R) * 2), DType::kBFloat16, {8, L + R});
  EXPECT_NO_THROW(mlakv::gather_cache_sequences(s));
  mlakv::GatherCacheSequencesParams bad = s;
  bad.block_table.shape[1] = -1;
  expect_rejected(
      arena_, [&] { mlakv::gather_cache_sequences(bad); }, "block_table: expected sizes >= 0");
  bad = s;
  bad.out.shape[0] = -1;
  expect_rejected(
      arena_, [&] { mlakv::gather_cache_sequences(bad); }, "out: expected sizes >= 0");
}

// gather_cache_slots writes N rows of out: fewer rows would be written past its end.
TEST_F(OpsValidation, GatherSlotsOutTooFewRows) {
  void* cache =
      arena_.sentinel(static_cast<size_t>(mlakv::cache_bytes(CacheFormat::kBFloat16, 2, 4, L, R)));
  mlakv::GatherCacheSlotsParams p;
  p.num_tokens = T;
  p.kv_cache = mlakv::make_cache_view(cache, CacheFormat::kBFloat16, 2, 4, L, R);
  p.slots = mlakv::make_view(arena_.indices({1, -1, 7}), DType::kInt64, {T});
  p.out = mlakv::make_view(arena_.sentinel(T * (L + R) * 4), DType::kFloat32, {T - 1, L + R});
  expect_rejected(
      arena_, [&] { mlakv::gather_cache_slots(p); }, "out: expected shape[0] >= N = 3");
}

// ---- names, errors, small helpers ------------------------------------------------------------

TEST(Validation, UnknownCacheFormatName) {
  try {
    mlakv::parse_cache_format("fp8_e4m3fnuz");
    ADD_FAILURE() << "no exception";
  } catch (const mlakv::Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp8_e4m3fnuz"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("name"), std::string::npos) << e.what();
  }
  EXPECT_THROW(mlakv::parse_cache_format(nullptr), mlakv::Error);
}

TEST(Validation, CacheFormatNamesRoundTrip) {
  for (CacheFormat f :
       {CacheFormat::kBFloat16, CacheFormat::kFloat16, CacheFormat::kFloat32,
        CacheFormat::kFloat8E4M3, CacheFormat::kFloat8E5M2, CacheFormat::kFloat8DsMla}) {
    EXPECT_EQ(mlakv::parse_cache_format(mlakv::cache_format_name(f)), f);
  }
  EXPECT_EQ(mlakv::cache_entry_bytes(CacheFormat::kFloat8DsMla, 512, 64), 656);
  EXPECT_EQ(mlakv::cache_entry_bytes(CacheFormat::kBFloat16, 512, 64), 1152);
  EXPECT_EQ(mlakv::cache_entry_bytes(CacheFormat::kFloat8E4M3, 512, 64), 576);
  EXPECT_EQ(mlakv::cache_latent_dtype(CacheFormat::kFloat8DsMla), DType::kFloat8E4M3);
  EXPECT_EQ(mlakv::cache_rope_dtype(CacheFormat::kFloat8DsMla), DType::kBFloat16);
  EXPECT_THROW(mlakv::cache_entry_bytes(CacheFormat::kFloat8DsMla, 256, 64), mlakv::Error);
}

// Each cache format's element types and scale kind (the kernels dispatch on the format itself, so
// a wrong dtype of the same size shows only here and in the Python and torch wrappers), and the
// names of the small enums, unknown values included.
TEST(Validation, CacheFormatDtypesAndEnumNames) {
  struct Case {
    CacheFormat format;
    DType latent, rope;
    bool per_tensor_fp8;
  };
  const Case cases[] = {
      {CacheFormat::kBFloat16, DType::kBFloat16, DType::kBFloat16, false},
      {CacheFormat::kFloat16, DType::kFloat16, DType::kFloat16, false},
      {CacheFormat::kFloat32, DType::kFloat32, DType::kFloat32, false},
      {CacheFormat::kFloat8E4M3, DType::kFloat8E4M3, DType::kFloat8E4M3, true},
      {CacheFormat::kFloat8E5M2, DType::kFloat8E5M2, DType::kFloat8E5M2, true},
      {CacheFormat::kFloat8DsMla, DType::kFloat8E4M3, DType::kBFloat16, false},
  };
  for (const Case& c : cases) {
    const std::string name = mlakv::cache_format_name(c.format);
    EXPECT_EQ(mlakv::cache_latent_dtype(c.format), c.latent) << name;
    EXPECT_EQ(mlakv::cache_rope_dtype(c.format), c.rope) << name;
    EXPECT_EQ(mlakv::cache_is_per_tensor_fp8(c.format), c.per_tensor_fp8) << name;
  }
  EXPECT_STREQ(mlakv::cache_format_name(static_cast<CacheFormat>(42)), "unknown_cache_format");
  EXPECT_STREQ(mlakv::rope_style_name(mlakv::RopeStyle::kGptJ), "gptj");
  EXPECT_STREQ(mlakv::rope_style_name(mlakv::RopeStyle::kNeox), "neox");
  EXPECT_STREQ(mlakv::rope_style_name(static_cast<mlakv::RopeStyle>(7)), "unknown_rope_style");
  EXPECT_STREQ(mlakv::error_counter_name(mlakv::kBadSlot), "bad_slot");
  EXPECT_STREQ(mlakv::error_counter_name(mlakv::kBadPosition), "bad_position");
  EXPECT_STREQ(mlakv::error_counter_name(mlakv::kBadDecodeCount), "bad_decode_count");
  EXPECT_STREQ(mlakv::error_counter_name(mlakv::kBadBlockIndex), "bad_block_index");
  EXPECT_STREQ(mlakv::error_counter_name(mlakv::kNumErrorCounters), "unknown_counter");
  EXPECT_STREQ(mlakv::error_counter_name(-1), "unknown_counter");
}

TEST(Validation, ErrorWhatIsBasenameLineMessage) {
  try {
    MLAKV_FAIL("some_arg: expected ", 1, ", got ", 2);
  } catch (const mlakv::Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.message(), "some_arg: expected 1, got 2");
    EXPECT_EQ(what.rfind("test_validation.cpp:", 0), 0u) << what;
    EXPECT_EQ(what.substr(what.size() - e.message().size()), e.message());
  }
}

TEST(Validation, DescribeAndViews) {
  int64_t dummy[8] = {};
  TensorView v = mlakv::make_view(dummy, DType::kBFloat16, {2, 4});
  EXPECT_EQ(v.describe(), "bfloat16[2, 4] strides [4, 1] on cpu");
  EXPECT_EQ(v.numel(), 8);
  EXPECT_TRUE(v.is_contiguous());
  TensorView s = mlakv::make_strided_view(dummy, DType::kFloat32, {2, 2}, {4, 1});
  EXPECT_FALSE(s.is_contiguous());
  EXPECT_EQ(mlakv::device_name({mlakv::DeviceType::kCUDA, 3}), "cuda:3");
  EXPECT_THROW(mlakv::make_strided_view(dummy, DType::kFloat32, {2, 2}, {1}), mlakv::Error);
}

// tensor.h's view helpers at their edges: an absent view has no elements, size-1 dims do not
// constrain their stride (as in PyTorch), and make_view takes 1 to kMaxDims dims.
TEST(Validation, ViewHelpersEdges) {
  int64_t dummy[8] = {};
  EXPECT_EQ(TensorView{}.numel(), 0);
  EXPECT_FALSE(TensorView{}.present());
  EXPECT_TRUE(
      mlakv::make_strided_view(dummy, DType::kFloat32, {2, 1, 4}, {4, 99, 1}).is_contiguous());
  EXPECT_TRUE(mlakv::make_strided_view(dummy, DType::kFloat32, {1, 8}, {3, 1}).is_contiguous());
  EXPECT_FALSE(
      mlakv::make_strided_view(dummy, DType::kFloat32, {2, 1, 4}, {8, 4, 1}).is_contiguous());
  const TensorView v4 = mlakv::make_view(dummy, DType::kFloat32, {1, 2, 2, 2});
  EXPECT_EQ(v4.ndim, mlakv::kMaxDims);
  EXPECT_EQ(v4.numel(), 8);
  EXPECT_EQ(v4.stride[0], 8);
  EXPECT_TRUE(v4.is_contiguous());
  EXPECT_THROW(mlakv::make_view(dummy, DType::kFloat32, {1, 1, 2, 2, 2}), mlakv::Error);
  EXPECT_THROW(mlakv::make_view(dummy, DType::kFloat32, {}), mlakv::Error);
  // An empty tensor's view, written the natural way (null data, as the ops allow for no rows).
  const TensorView empty = mlakv::make_view(nullptr, DType::kInt64, {0});
  EXPECT_TRUE(empty.present());
  EXPECT_EQ(empty.data, nullptr);
  EXPECT_EQ(empty.numel(), 0);
}

// Sizes whose products pass int64 (run under UBSan in CI: each product below overflowed once).
// make_view refuses strides it cannot represent, but needs no product of all sizes; a strided view
// computes none; is_contiguous answers false where its expected stride would pass int64, and for
// a view of more dims than it holds (describe() says how many).
TEST(Validation, ViewHelpersProductsPastInt64) {
  int64_t dummy[8] = {};
  constexpr int64_t k32 = int64_t{1} << 32;
  EXPECT_THROW(mlakv::make_view(dummy, DType::kBFloat16, {2, k32, k32}), mlakv::Error);
  const TensorView outer = mlakv::make_view(dummy, DType::kBFloat16, {int64_t{1} << 62, 4});
  EXPECT_EQ(outer.stride[0], 4);
  EXPECT_EQ(outer.numel(), INT64_MAX);
  const TensorView strided = mlakv::make_strided_view(dummy, DType::kBFloat16, {k32, k32}, {1, 1});
  EXPECT_EQ(strided.stride[0], 1);
  EXPECT_FALSE(strided.is_contiguous());
  // Rows 0 and 1 at one address: the wrapped product 2^32 * 2^32 * 2 = 0 once made this "true".
  EXPECT_FALSE(mlakv::make_strided_view(dummy, DType::kBFloat16, {2, k32, k32}, {0, k32, 1})
                   .is_contiguous());
  EXPECT_TRUE(mlakv::make_strided_view(dummy, DType::kBFloat16, {1, k32, k32}, {7, k32, 1})
                  .is_contiguous());
  TensorView six = mlakv::make_view(dummy, DType::kFloat32, {1, 1, 1, 1});
  six.ndim = 6;  // built by hand: no helper makes one
  EXPECT_FALSE(six.is_contiguous());
  EXPECT_EQ(six.describe().rfind("ndim 6 (at most 4, first dims) float32[1, 1, 1, 1]", 0), 0u)
      << six.describe();
}

// memory.h's helpers on the CPU: copies and memset move exactly the bytes asked for (the bytes
// after them keep the sentinel); a call for 0 bytes does nothing (null pointers allowed, as empty
// tensors have them); a null pointer with bytes to move is rejected.
TEST(Validation, CpuMemoryHelpers) {
  const mlakv::Device cpu{};
  constexpr int kMoved = 64, kAll = 80;  // bytes moved, and the buffers with a sentinel tail
  Buffer a(kAll), b(kAll);
  uint8_t src[kAll], back[kAll];
  for (int i = 0; i < kAll; ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  std::memset(a.data(), kSentinel, kAll);
  std::memset(back, kSentinel, kAll);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 256, 0u);
  mlakv::copy_host_to_device(cpu, a.data(), src, kMoved);
  mlakv::device_memset(cpu, a.data(), 0x5c, 16);
  const std::vector<uint8_t> device_side = a.snapshot();
  mlakv::copy_device_to_host(cpu, back, a.data(), kMoved - 8);
  for (int i = 0; i < kAll; ++i) {
    const int want = i < 16 ? 0x5c : i < kMoved ? src[i] : kSentinel;
    EXPECT_EQ(device_side[i], want) << "device byte " << i;
    EXPECT_EQ(back[i], i < kMoved - 8 ? want : kSentinel) << "host byte " << i;
  }
  EXPECT_NO_THROW(mlakv::copy_host_to_device(cpu, nullptr, nullptr, 0));
  EXPECT_NO_THROW(mlakv::copy_device_to_host(cpu, nullptr, nullptr, 0));
  EXPECT_NO_THROW(mlakv::device_memset(cpu, nullptr, 0, 0));
  EXPECT_THROW(mlakv::copy_host_to_device(cpu, b.data(), nullptr, 4), mlakv::Error);
  EXPECT_THROW(mlakv::copy_host_to_device(cpu, nullptr, src, 4), mlakv::Error);
  EXPECT_THROW(mlakv::copy_device_to_host(cpu, back, nullptr, 4), mlakv::Error);
  EXPECT_THROW(mlakv::copy_device_to_host(cpu, nullptr, a.data(), 4), mlakv::Error);
  EXPECT_THROW(mlakv::device_memset(cpu, nullptr, 0, 4), mlakv::Error);
  void* empty = mlakv::device_alloc(cpu, 0);
  EXPECT_NE(empty, nullptr);
  mlakv::device_free(cpu, empty);
  mlakv::device_free(cpu, nullptr);
}

// A view whose last byte would pass the top of the address space, and one past 2^56 bytes, are
// rejected by every validator (the rms_norm and rmsnorm_quant ones here; the views are never
// dereferenced). numel() saturates instead of overflowing; the cache helpers check their products.
TEST(Validation, ExtentLimits) {
  constexpr int64_t N = 1024;
  std::vector<uint16_t> weight(N), rows(4 * N);
  mlakv::RmsNormParams p;
  p.num_tokens = 2;
  p.weight = mlakv::make_view(weight.data(), DType::kBFloat16, {N});
  p.output = mlakv::make_view(rows.data(), DType::kBFloat16, {2, N});
  // 4 KB (its size) before the top of the address space: one past its last byte wraps to 0.
  p.input = mlakv::make_view(reinterpret_cast<void*>(UINTPTR_MAX - 4095), DType::kBFloat16, {2, N});
  expect_rejected(
      Arena{}, [&] { mlakv::rms_norm(p); }, "input: expected a view within 2^56 bytes");
  p.input = mlakv::make_view(rows.data() + 2 * N, DType::kBFloat16, {2, N});
  p.output.shape[0] = int64_t{1} << 47;  // 2^47 rows of 2 KB
  expect_rejected(
      Arena{}, [&] { mlakv::rms_norm(p); }, "output: expected a view within 2^56 bytes");

  std::vector<uint8_t> values(2 * N);
  std::vector<float> scales(2 * 8);
  mlakv::RmsNormQuantParams q;
  q.num_tokens = 2;
  q.input = mlakv::make_view(rows.data(), DType::kBFloat16, {2, N});
  q.weight = p.weight;
  q.quant.values = mlakv::make_view(values.data(), DType::kFloat8E4M3, {2, N});
  q.quant.scales = mlakv::make_view(scales.data(), DType::kFloat32, {2, 8});
  q.quant.scales.shape[0] = int64_t{1} << 55;  // 2^55 rows of 32 bytes
  expect_rejected(
      Arena{}, [&] { mlakv::rmsnorm_quant(q); }, "quant.scales: expected a view within 2^56 bytes");
  q.quant.scales.shape[0] = 2;
  q.input.stride[0] = int64_t{1} << 62;
  expect_rejected(
      Arena{}, [&] { mlakv::rmsnorm_quant(q); }, "input: expected a view within 2^56 bytes");
  // One token: the row stride is never used, but a stride times the element size must not
  // overflow in the validator (2 * (2^62 + 8) did, and wrapped to a multiple of 16 bytes).
  q.num_tokens = 1;
  q.input.stride[0] = (int64_t{1} << 62) + 8;
  expect_rejected(
      Arena{}, [&] { mlakv::rmsnorm_quant(q); }, "input: expected a view within 2^56 bytes");

  // A size-1 dim's stride is never used: any value below 2^56 is accepted (PyTorch gives such
  // strides), with the bytes of the usual layout.
  mlakv::RmsNormParams one;
  one.num_tokens = 1;
  one.weight = p.weight;
  one.input = mlakv::make_view(rows.data(), DType::kBFloat16, {1, N});
  one.output = mlakv::make_view(rows.data() + 2 * N, DType::kBFloat16, {1, N});
  for (int i = 0; i < N; ++i) {
    rows[i] = static_cast<uint16_t>(0x3f80 + (i % 7) * 0x10);  // bf16 1.0, 1.125, ...
    weight[i] = 0x3f80;
  }
  EXPECT_NO_THROW(mlakv::rms_norm(one));
  const std::vector<uint16_t> usual(rows.begin() + 2 * N, rows.begin() + 3 * N);
  std::fill(rows.begin() + 2 * N, rows.begin() + 3 * N, uint16_t{0});
  one.input.stride[0] = (int64_t{1} << 56) - 1;
  one.output.stride[0] = -5;  // dim 0 of size 1; the innermost stride stays 1
  EXPECT_NO_THROW(mlakv::rms_norm(one));
  EXPECT_TRUE(std::equal(usual.begin(), usual.end(), rows.begin() + 2 * N));
  one.input.stride[0] = int64_t{1} << 56;
  expect_rejected(
      Arena{}, [&] { mlakv::rms_norm(one); }, "input: expected a view within 2^56 bytes");

  TensorView big = mlakv::make_view(static_cast<void*>(nullptr), DType::kBFloat16, {1, 1});
  big.shape[0] = big.shape[1] = int64_t{1} << 40;
  EXPECT_EQ(big.numel(), INT64_MAX);
  big.ndim = 3;
  big.shape[2] = 0;
  EXPECT_EQ(big.numel(), 0);
  EXPECT_THROW(mlakv::make_cache_view(static_cast<void*>(nullptr), CacheFormat::kBFloat16,
                                      int64_t{1} << 50, 64, 512, 64),
               mlakv::Error);
  EXPECT_THROW(mlakv::cache_bytes(CacheFormat::kBFloat16, int64_t{1} << 62, 4, 512, 64),
               mlakv::Error);
  EXPECT_THROW(mlakv::cache_entry_bytes(CacheFormat::kBFloat16, int64_t{1} << 62, 64),
               mlakv::Error);
  // No block, but one block's bytes (the view's stride_block_bytes) would overflow.
  EXPECT_THROW(mlakv::make_cache_view(static_cast<void*>(nullptr), CacheFormat::kBFloat16, 0,
                                      int64_t{1} << 62, 512, 64),
               mlakv::Error);
  EXPECT_THROW(mlakv::make_split_cache_view(static_cast<void*>(nullptr), nullptr,
                                            CacheFormat::kBFloat16, 0, int64_t{1} << 62, 512, 64),
               mlakv::Error);
  mlakv::KVCacheView huge;
  huge.num_blocks = huge.block_size = int64_t{1} << 40;
  EXPECT_EQ(huge.num_slots(), INT64_MAX);
}

// The cache-view helpers' geometry: every stride of both layouts, the accepted and rejected
// block counts and sizes, and entry sizes whose L + R alone would overflow int64.
TEST(Validation, CacheViewHelpers) {
  int64_t dummy[4] = {};
  const mlakv::KVCacheView fp16 =
      mlakv::make_cache_view(dummy, CacheFormat::kFloat16, 3, 16, 512, 64);
  EXPECT_EQ(fp16.data, static_cast<void*>(dummy));
  EXPECT_EQ(fp16.num_blocks, 3);
  EXPECT_EQ(fp16.block_size, 16);
  EXPECT_EQ(fp16.kv_lora_rank, 512);
  EXPECT_EQ(fp16.rope_dim, 64);
  EXPECT_EQ(fp16.stride_token_bytes, 1152);
  EXPECT_EQ(fp16.stride_block_bytes, 16 * 1152);
  EXPECT_EQ(
      mlakv::make_cache_view(dummy, CacheFormat::kFloat8E4M3, 3, 16, 512, 64).stride_block_bytes,
      16 * 576);
  EXPECT_EQ(mlakv::cache_bytes(CacheFormat::kFloat8E4M3, 3, 16, 512, 64), 3 * 16 * 576);

  const mlakv::KVCacheView split =
      mlakv::make_split_cache_view(dummy, dummy + 2, CacheFormat::kBFloat16, 3, 16, 512, 64);
  EXPECT_EQ(split.data, static_cast<void*>(dummy));
  EXPECT_EQ(split.rope_data, static_cast<void*>(dummy + 2));
  EXPECT_EQ(split.stride_token_bytes, 1024);
  EXPECT_EQ(split.stride_block_bytes, 16 * 1024);
  EXPECT_EQ(split.stride_rope_token_bytes, 128);
  EXPECT_EQ(split.stride_rope_block_bytes, 16 * 128);
  const mlakv::KVCacheView split32 =
      mlakv::make_split_cache_view(dummy, dummy + 2, CacheFormat::kFloat32, 2, 8, 256, 32);
  EXPECT_EQ(split32.stride_token_bytes, 1024);
  EXPECT_EQ(split32.stride_block_bytes, 8 * 1024);
  EXPECT_EQ(split32.stride_rope_token_bytes, 128);
  EXPECT_EQ(split32.stride_rope_block_bytes, 8 * 128);

  // No block is a valid (empty) cache; a block of no entries is not.
  EXPECT_EQ(mlakv::make_cache_view(dummy, CacheFormat::kBFloat16, 0, 16, 512, 64).num_blocks, 0);
  EXPECT_EQ(
      mlakv::make_split_cache_view(dummy, dummy, CacheFormat::kBFloat16, 0, 16, 512, 64).num_blocks,
      0);
  EXPECT_EQ(mlakv::cache_bytes(CacheFormat::kBFloat16, 0, 16, 512, 64), 0);
  EXPECT_EQ(mlakv::cache_bytes(CacheFormat::kBFloat16, 4, 0, 512, 64), 0);
  for (const auto& [blocks, block_size] : {std::pair<int64_t, int64_t>{2, 0}, {-1, 16}, {2, -1}}) {
    EXPECT_THROW(mlakv::make_cache_view(dummy, CacheFormat::kBFloat16, blocks, block_size, 512, 64),
                 mlakv::Error)
        << blocks << " x " << block_size;
    EXPECT_THROW(mlakv::make_split_cache_view(dummy, dummy, CacheFormat::kBFloat16, blocks,
                                              block_size, 512, 64),
                 mlakv::Error)
        << blocks << " x " << block_size;
  }
  EXPECT_THROW(mlakv::cache_bytes(CacheFormat::kBFloat16, -1, 16, 512, 64), mlakv::Error);
  EXPECT_THROW(mlakv::cache_bytes(CacheFormat::kBFloat16, 2, -1, 512, 64), mlakv::Error);

  EXPECT_EQ(mlakv::cache_entry_bytes(CacheFormat::kFloat32, 512, 64), 2304);
  EXPECT_EQ(mlakv::cache_entry_bytes(CacheFormat::kFloat8DsMla, 512, 64), 656);
  EXPECT_THROW(mlakv::cache_entry_bytes(CacheFormat::kBFloat16, INT64_MAX, 1), mlakv::Error);
  EXPECT_THROW(mlakv::cache_entry_bytes(CacheFormat::kBFloat16, 1, INT64_MAX), mlakv::Error);
  EXPECT_THROW(mlakv::cache_entry_bytes(CacheFormat::kFloat8E4M3, -1, 64), mlakv::Error);
  // fp8_ds_mla's fixed entry needs both L = 512 and R = 64, and has only the combined layout.
  EXPECT_THROW(mlakv::cache_entry_bytes(CacheFormat::kFloat8DsMla, 512, 32), mlakv::Error);
  EXPECT_THROW(
      mlakv::make_split_cache_view(dummy, dummy + 2, CacheFormat::kFloat8DsMla, 3, 16, 512, 64),
      mlakv::Error);

  // The whole cache below 2^56 bytes, where the slot count and one block's bytes are far below:
  // 2^44 slots of 1152 bytes pass, 2^49 do not.
  EXPECT_EQ(mlakv::cache_bytes(CacheFormat::kBFloat16, int64_t{1} << 40, 16, 512, 64),
            (int64_t{1} << 44) * 1152);
  EXPECT_THROW(mlakv::cache_bytes(CacheFormat::kBFloat16, int64_t{1} << 45, 16, 512, 64),
               mlakv::Error);
  EXPECT_THROW(mlakv::make_cache_view(dummy, CacheFormat::kBFloat16, int64_t{1} << 45, 16, 512, 64),
               mlakv::Error);

  // A negative block count is named as such, not as a cache too large.
  const std::function<void()> negative_blocks[] = {
      [&] { mlakv::make_cache_view(dummy, CacheFormat::kBFloat16, -1, 16, 512, 64); },
      [&] { mlakv::make_split_cache_view(dummy, dummy, CacheFormat::kBFloat16, -1, 16, 512, 64); },
      [&] { mlakv::cache_bytes(CacheFormat::kBFloat16, -1, 16, 512, 64); },
  };
  for (const auto& fn : negative_blocks) {
    expect_rejected(Arena{}, fn, "expected num_blocks >= 0");
  }

  // A bad L or R is reported under the name of the function called, not of a helper.
  const std::pair<const char*, std::function<void()>> bad_dims[] = {
      {"make_cache_view: expected L >= 0",
       [&] { mlakv::make_cache_view(dummy, CacheFormat::kBFloat16, 2, 16, -1, 64); }},
      {"make_split_cache_view: expected L >= 0",
       [&] { mlakv::make_split_cache_view(dummy, dummy, CacheFormat::kBFloat16, 2, 16, 512, -1); }},
      {"cache_bytes: expected L >= 0",
       [&] { mlakv::cache_bytes(CacheFormat::kBFloat16, 2, 16, -1, 64); }},
      {"cache_entry_bytes: expected L >= 0",
       [&] { mlakv::cache_entry_bytes(CacheFormat::kBFloat16, 512, -1); }},
      {"make_cache_view: fp8_ds_mla: expected L = 512",
       [&] { mlakv::make_cache_view(dummy, CacheFormat::kFloat8DsMla, 2, 16, 512, 32); }},
      {"make_cache_view: expected an entry below",
       [&] { mlakv::make_cache_view(dummy, CacheFormat::kBFloat16, 2, 16, INT64_MAX, 1); }},
  };
  for (const auto& [message, fn] : bad_dims) {
    expect_rejected(Arena{}, fn, message);
  }
}

TEST(Validation, ErrorCountsArguments) {
  int32_t host[mlakv::kNumErrorCounters];
  expect_rejected(
      Arena{}, [&] { mlakv::read_error_counts(nullptr, {}, host); }, "error_counts");
  expect_rejected(
      Arena{}, [&] { mlakv::reset_error_counts(nullptr, {}); }, "error_counts");
}

// read_error_counts and reset_error_counts cover every counter, the last one included.
TEST(Validation, ErrorCountsReadAndResetEveryCounter) {
  Buffer buffer(sizeof(int32_t) * mlakv::kNumErrorCounters);
  int32_t* counts = static_cast<int32_t*>(buffer.data());
  for (int32_t i = 0; i < mlakv::kNumErrorCounters; ++i) counts[i] = 10 + i;
  int32_t host[mlakv::kNumErrorCounters] = {};
  try {
    mlakv::read_error_counts(counts, {}, host, nullptr, /*throw_if_nonzero=*/true);
    ADD_FAILURE() << "non-zero counters, nothing thrown";
  } catch (const mlakv::Error& e) {
    for (int32_t i = 0; i < mlakv::kNumErrorCounters; ++i) {
      EXPECT_NE(std::string(e.what()).find(mlakv::error_counter_name(i)), std::string::npos)
          << e.what();
    }
  }
  for (int32_t i = 0; i < mlakv::kNumErrorCounters; ++i) EXPECT_EQ(host[i], 10 + i) << i;
  mlakv::reset_error_counts(counts, {});
  for (int32_t i = 0; i < mlakv::kNumErrorCounters; ++i) EXPECT_EQ(counts[i], 0) << i;
  EXPECT_NO_THROW(mlakv::read_error_counts(counts, {}, host, nullptr, true));
}

TEST(Validation, CudaMemoryWithoutBackend) {
  if (mlakv::cuda_backend_built()) GTEST_SKIP() << "CUDA backend built";
  EXPECT_THROW(mlakv::device_alloc({mlakv::DeviceType::kCUDA, 0}, 16), mlakv::Error);
  EXPECT_EQ(mlakv::cuda_device_count(), 0);
  EXPECT_THROW(mlakv::cuda_device_description(0), mlakv::Error);
}

// The facts `mlakv info` and the bench's JSON report: the version CMake gives the library, first
// in build_info(), and whether the CUDA backend was built.
TEST(Validation, BuildInfo) {
  const std::string version = mlakv::version();
  EXPECT_FALSE(version.empty());
  EXPECT_NE(version, "unknown");
  const std::string info = mlakv::build_info();
  EXPECT_EQ(info.rfind("mlakv " + version + "\n", 0), 0u) << info;
  const bool on = info.find("CUDA backend: on") != std::string::npos;
  const bool off = info.find("CUDA backend: off") != std::string::npos;
  EXPECT_EQ(on, mlakv::cuda_backend_built()) << info;
  EXPECT_EQ(off, !mlakv::cuda_backend_built()) << info;
  EXPECT_TRUE(info.find("\nCPU backend: 16-byte vectors\n") != std::string::npos ||
              info.find("\nCPU backend: 32-byte vectors\n") != std::string::npos ||
              info.find("\nCPU backend: 64-byte vectors\n") != std::string::npos)
      << info;
}

// The CUDA backend's launch limits (docs/decisions.md, "One fused launch's size"): 2^30 copied
// query rows or more, or 2^31 work items or more, fail with an error on the host before anything
// runs. The views point at addresses that are never dereferenced (no such buffers could be
// allocated: a launch would fault), 2^42 bytes apart so that they do not overlap.
TEST(Validation, CudaLaunchLimit) {
  if (mlakv::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
  const mlakv::Device gpu{mlakv::DeviceType::kCUDA, 0};
  auto never = [](int i) {
    return reinterpret_cast<void*>((uintptr_t{1} << 44) + (static_cast<uintptr_t>(i) << 42));
  };
  constexpr int64_t kH = 128, kL = 512, kR = 64;
  for (const int64_t T : {(int64_t{1} << 30) / kH, (int64_t{1} << 30) / kH + 1}) {
    mlakv::DecodeQConcatParams p;
    p.num_tokens = T;
    p.ql_nope = mlakv::make_view(never(0), DType::kBFloat16, {T, kH, kL}, gpu);
    p.q_pe = mlakv::make_view(never(1), DType::kBFloat16, {T, kH, kR}, gpu);
    p.q_out = mlakv::make_view(never(2), DType::kBFloat16, {T, kH, kL + kR}, gpu);
    expect_rejected(
        Arena{}, [&] { mlakv::decode_q_concat(p); }, "rows (tokens x heads) exceed one launch");
  }
  // The item limit, where no row is copied: concat_and_cache_mla's one K item a token.
  const int64_t T = int64_t{1} << 31;
  mlakv::ConcatAndCacheMlaParams c;
  c.num_tokens = T;
  c.kv_c = mlakv::make_view(never(0), DType::kBFloat16, {T, kL}, gpu);
  c.k_pe = mlakv::make_view(never(1), DType::kBFloat16, {T, kR}, gpu);
  c.slot_mapping = mlakv::make_view(never(2), DType::kInt64, {T}, gpu);
  c.kv_cache = mlakv::make_cache_view(never(3), CacheFormat::kBFloat16, 4, 64, kL, kR, gpu);
  expect_rejected(
      Arena{}, [&] { mlakv::concat_and_cache_mla(c); }, "work items exceed one launch");
}

}  // namespace
