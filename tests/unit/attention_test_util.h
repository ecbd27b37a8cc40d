// Test fixtures for the CPU attention kernels: a paged cache with any of several stride
// layouts, a mixed batch with shuffled block ids, queries and an output buffer, all built
// from one AttnCase description; and PromptData, one prompt's values, which can be written
// into any sequence of any batch so that its output rows can be compared across batches.
//
// Every byte that a kernel must not read (block padding, unused blocks, query padding) is
// filled with a NaN pattern, so reading it shows up as NaN in the output; every output
// byte that a kernel must not write is a sentinel that the tests check afterwards.
#ifndef KVSTREAM_TESTS_UNIT_ATTENTION_TEST_UTIL_H_
#define KVSTREAM_TESTS_UNIT_ATTENTION_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "dtype_names.h"  // ShortDType
#include "kvstream/attention/backend.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/cache/kv_cache_spec.h"
#include "kvstream/common/dtype.h"
#include "kvstream/common/numeric.h"

namespace kvstream {
namespace testing_util {

// Physical orders of a cache tensor. kPadded has odd gaps between heads, tokens and
// blocks (an engine's tensor with padding); kDimStrided keeps the head dimension strided
// ([block][head][dim][token]), which no dense layout does.
enum class TestLayout { kNHD, kHND, kPadded, kDimStrided };

inline const char* TestLayoutName(TestLayout layout) {
  switch (layout) {
    case TestLayout::kNHD: return "NHD";
    case TestLayout::kHND: return "HND";
    case TestLayout::kPadded: return "Padded";
    case TestLayout::kDimStrided: return "DimStrided";
  }
  return "?";
}

inline CacheStrides MakeTestStrides(TestLayout layout, int block_size, int heads, int dim) {
  CacheStrides s;
  switch (layout) {
    case TestLayout::kNHD:
      s.dim = 1;
      s.head = dim;
      s.token = int64_t{heads} * dim;
      s.block = int64_t{block_size} * s.token;
      break;
    case TestLayout::kHND:
      s.dim = 1;
      s.token = dim;
      s.head = int64_t{block_size} * dim;
      s.block = int64_t{heads} * s.head;
      break;
    case TestLayout::kPadded:
      s.dim = 1;
      s.head = dim + 3;
      s.token = int64_t{heads} * s.head + 5;
      s.block = int64_t{block_size} * s.token + 7;
      break;
    case TestLayout::kDimStrided:
      s.token = 1;
      s.dim = block_size;
      s.head = int64_t{dim} * block_size;
      s.block = int64_t{heads} * s.head;
      break;
  }
  return s;
}

struct SeqSpec {
  int context_len = 0;  // cached keys before this step's tokens
  int query_len = 1;
};

// One attention call to build. Defaults: a small GQA problem in float32.
struct AttnCase {
  int block_size = 16;
  int num_kv_heads = 2;
  int group = 4;  // query heads per KV head
  int head_size = 64;
  int head_size_v = 64;
  DType q_dtype = DType::kFloat32;
  DType out_dtype = DType::kFloat32;
  DType cache_dtype = DType::kFloat32;
  KvQuantMode quant = KvQuantMode::kNone;
  TestLayout layout = TestLayout::kNHD;
  bool causal = true;
  int sliding_window = 0;
  float soft_cap = 0;
  bool alibi = false;
  float scale = 0;  // 0: 1 / sqrt(head_size)
  // Prefill, chunked prefill and decode together by default.
  std::vector<SeqSpec> seqs = {{0, 7}, {26, 7}, {99, 1}, {0, 1}, {32, 1}};
  int pad_tokens = 2;  // query rows after the last sequence; must stay untouched
  uint32_t seed = 1;
};

// The keys, values and queries of one prompt, position by position, so that the same
// prompt can be written into any sequence of any batch (AttnProblem::FillSequence) and its
// output rows compared across batches.
struct PromptData {
  int len = 0;
  int num_kv_heads = 0;
  int num_heads = 0;
  int head_size = 0;
  int head_size_v = 0;
  std::vector<float> k, v;  // [len][num_kv_heads][head_size or head_size_v]
  std::vector<float> q;     // [len][num_heads][head_size]

  // Values uniform in [-1, 1), drawn from `seed`; shapes from `c`.
  static PromptData Random(const AttnCase& c, int len, uint32_t seed) {
    PromptData d;
    d.len = len;
    d.num_kv_heads = c.num_kv_heads;
    d.num_heads = c.num_kv_heads * c.group;
    d.head_size = c.head_size;
    d.head_size_v = c.head_size_v;
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    d.k.resize(static_cast<size_t>(len) * c.num_kv_heads * c.head_size);
    d.v.resize(static_cast<size_t>(len) * c.num_kv_heads * c.head_size_v);
    d.q.resize(static_cast<size_t>(len) * d.num_heads * c.head_size);
    for (float& x : d.k) x = uni(rng);
    for (float& x : d.v) x = uni(rng);
    for (float& x : d.q) x = uni(rng);
    return d;
  }

  float K(int j, int g, int dim) const {
    return k[(static_cast<size_t>(j) * num_kv_heads + g) * head_size + dim];
  }
  float V(int j, int g, int dim) const {
    return v[(static_cast<size_t>(j) * num_kv_heads + g) * head_size_v + dim];
  }
  float Q(int j, int h, int dim) const {
    return q[(static_cast<size_t>(j) * num_heads + h) * head_size + dim];
  }
};

// Owns every buffer of one call. params() points into it.
class AttnProblem {
 public:
  explicit AttnProblem(const AttnCase& c) : c_(c), rng_(c.seed) {
    num_heads_ = c.num_kv_heads * c.group;
    spec_.block_size = c.block_size;
    spec_.num_kv_heads = c.num_kv_heads;
    spec_.head_size = c.head_size;
    spec_.head_size_v = c.head_size_v;
    spec_.dtype = c.cache_dtype;
    spec_.quant_mode = IsFp8(c.cache_dtype) ? c.quant : KvQuantMode::kNone;

    // Batch layout and block ids: every block of every sequence, shuffled over a cache
    // with spare blocks, so that neither order nor contiguity can be relied on.
    int64_t total_blocks = 0;
    int max_blocks = 1;
    query_start_loc_.push_back(0);
    for (const SeqSpec& s : c.seqs) {
      const int seq_len = s.context_len + s.query_len;
      const int blocks = (seq_len + c.block_size - 1) / c.block_size;
      total_blocks += blocks;
      max_blocks = std::max(max_blocks, blocks);
      seq_lens_.push_back(seq_len);
      query_start_loc_.push_back(query_start_loc_.back() + s.query_len);
      max_query_len_ = std::max(max_query_len_, s.query_len);
      max_seq_len_ = std::max(max_seq_len_, seq_len);
    }
    num_blocks_ = total_blocks + 3;
    std::vector<int32_t> ids(static_cast<size_t>(num_blocks_));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng_);
    block_table_stride_ = max_blocks + 1;  // a spare column holding garbage
    block_table_.assign(c.seqs.size() * static_cast<size_t>(block_table_stride_), -1);
    size_t next = 0;
    for (size_t s = 0; s < c.seqs.size(); ++s) {
      const int blocks = (seq_lens_[s] + c.block_size - 1) / c.block_size;
      for (int b = 0; b < blocks; ++b) {
        block_table_[s * static_cast<size_t>(block_table_stride_) + static_cast<size_t>(b)] =
            ids[next++];
      }
    }
    num_tokens_ = query_start_loc_.back() + c.pad_tokens;

    // Cache tensors, NaN everywhere first.
    k_strides_ = MakeTestStrides(c.layout, c.block_size, c.num_kv_heads, c.head_size);
    v_strides_ = MakeTestStrides(c.layout, c.block_size, c.num_kv_heads, c.head_size_v);
    k_.assign(TensorBytes(k_strides_, c.head_size), 0xff);
    v_.assign(TensorBytes(v_strides_, c.head_size_v), 0xff);
    if (IsFp8(c.cache_dtype)) {
      const int n = c.quant == KvQuantMode::kPerHead ? c.num_kv_heads : 1;
      for (int i = 0; i < n; ++i) {
        // Distinct per head, and small enough that values near 1 use fp8's range.
        k_scale_.push_back(0.004f * static_cast<float>(i + 1) + 0.001f);
        v_scale_.push_back(0.003f * static_cast<float>(i + 2));
      }
    }
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    for (size_t s = 0; s < c.seqs.size(); ++s) {
      for (int j = 0; j < seq_lens_[s]; ++j) {
        for (int g = 0; g < c.num_kv_heads; ++g) {
          for (int d = 0; d < c.head_size; ++d) SetCache(false, s, j, g, d, uni(rng_));
          for (int d = 0; d < c.head_size_v; ++d) SetCache(true, s, j, g, d, uni(rng_));
        }
      }
    }

    // Queries with a padded token stride; the padding is NaN too.
    q_token_stride_ = int64_t{num_heads_} * c.head_size + 3;
    q_.assign(static_cast<size_t>(num_tokens_ * q_token_stride_) * DTypeSize(c.q_dtype), 0xff);
    for (int64_t t = 0; t < query_start_loc_.back(); ++t) {
      for (int h = 0; h < num_heads_; ++h) {
        for (int d = 0; d < c.head_size; ++d) SetQuery(t, h, d, uni(rng_));
      }
    }
    o_token_stride_ = int64_t{num_heads_} * c.head_size_v + 5;

    for (int h = 0; h < num_heads_; ++h) {
      alibi_.push_back(std::pow(2.0f, -8.0f * static_cast<float>(h + 1) / num_heads_));
    }
  }

  // Writes the dequantised value x of element (position j of sequence s, KV head g, d).
  void SetCache(bool is_value, size_t s, int j, int g, int d, float x) {
    const CacheStrides& st = is_value ? v_strides_ : k_strides_;
    const int32_t block =
        block_table_[s * static_cast<size_t>(block_table_stride_) +
                     static_cast<size_t>(j / c_.block_size)];
    const int64_t offset = st.Offset(block, j % c_.block_size, g, d);
    float stored = x;
    if (IsFp8(c_.cache_dtype)) {
      const std::vector<float>& scales = is_value ? v_scale_ : k_scale_;
      stored = x / scales[scales.size() == 1 ? 0 : static_cast<size_t>(g)];
    }
    StoreFromFloat(is_value ? v_.data() : k_.data(), c_.cache_dtype, offset, stored);
  }

  void SetQuery(int64_t row, int h, int d, float x) {
    StoreFromFloat(q_.data(), c_.q_dtype, row * q_token_stride_ + int64_t{h} * c_.head_size + d,
                   x);
  }

  // Makes sequence s hold `prompt`: keys and values of its positions 0 .. seq_len-1, and
  // the queries of its query tokens, which sit at the last query_len positions.
  // REQUIRES: seq_len(s) <= prompt.len, and the same head counts and sizes.
  void FillSequence(size_t s, const PromptData& prompt) {
    const int seq_len = seq_lens_[s];
    const int query_len = query_start_loc_[s + 1] - query_start_loc_[s];
    for (int j = 0; j < seq_len; ++j) {
      for (int g = 0; g < c_.num_kv_heads; ++g) {
        for (int d = 0; d < c_.head_size; ++d) SetCache(false, s, j, g, d, prompt.K(j, g, d));
        for (int d = 0; d < c_.head_size_v; ++d) SetCache(true, s, j, g, d, prompt.V(j, g, d));
      }
    }
    for (int t = 0; t < query_len; ++t) {
      const int j = seq_len - query_len + t;
      for (int h = 0; h < num_heads_; ++h) {
        for (int d = 0; d < c_.head_size; ++d) {
          SetQuery(query_start_loc_[s] + t, h, d, prompt.Q(j, h, d));
        }
      }
    }
  }

  // The bytes of output row `row`, every head, for bitwise comparison.
  std::vector<uint8_t> OutRow(const std::vector<uint8_t>& out, int64_t row) const {
    const size_t elem = DTypeSize(c_.out_dtype);
    const auto first = out.begin() + static_cast<std::ptrdiff_t>(row * o_token_stride_ * elem);
    return std::vector<uint8_t>(
        first, first + static_cast<std::ptrdiff_t>(int64_t{num_heads_} * c_.head_size_v * elem));
  }

  // An output buffer filled with the sentinel byte.
  std::vector<uint8_t> NewOut() const {
    return std::vector<uint8_t>(
        static_cast<size_t>(num_tokens_ * o_token_stride_) * DTypeSize(c_.out_dtype), kSentinel);
  }

  PagedAttentionParams params(std::vector<uint8_t>& out) {
    PagedAttentionParams p;
    p.q = q_.data();
    p.q_dtype = c_.q_dtype;
    p.q_token_stride = q_token_stride_;
    p.q_head_stride = c_.head_size;
    p.out = out.data();
    p.out_dtype = c_.out_dtype;
    p.o_token_stride = o_token_stride_;
    p.o_head_stride = c_.head_size_v;
    p.num_tokens = num_tokens_;
    p.cache.k = k_.data();
    p.cache.v = v_.data();
    p.cache.k_strides = k_strides_;
    p.cache.v_strides = v_strides_;
    p.cache.num_blocks = num_blocks_;
    p.cache.spec = spec_;
    if (IsFp8(c_.cache_dtype)) {
      p.cache.k_scale = k_scale_.data();
      p.cache.v_scale = v_scale_.data();
      p.cache.num_scales = static_cast<int>(k_scale_.size());
    }
    p.query_start_loc = query_start_loc_.data();
    p.seq_lens = seq_lens_.data();
    p.block_table = block_table_.data();
    p.block_table_stride = block_table_stride_;
    p.num_seqs = static_cast<int32_t>(seq_lens_.size());
    p.max_query_len = max_query_len_;
    p.max_seq_len = max_seq_len_;
    p.num_heads = num_heads_;
    p.scale = c_.scale > 0 ? c_.scale : 1.0f / std::sqrt(static_cast<float>(c_.head_size));
    p.causal = c_.causal;
    p.sliding_window = c_.sliding_window;
    p.logits_soft_cap = c_.soft_cap;
    p.alibi_slopes = c_.alibi ? alibi_.data() : nullptr;
    return p;
  }

  // Output element (query row, head, d) as float.
  float Out(const std::vector<uint8_t>& out, int64_t row, int h, int d) const {
    return LoadAsFloat(out.data(), c_.out_dtype,
                       row * o_token_stride_ + int64_t{h} * c_.head_size_v + d);
  }
  // Whether the kernel may write element `index` of the output buffer.
  bool Writable(int64_t index) const {
    const int64_t row = index / o_token_stride_;
    const int64_t col = index % o_token_stride_;
    return row >= query_start_loc_.front() && row < query_start_loc_.back() &&
           col < int64_t{num_heads_} * c_.head_size_v;
  }
  // Count of output bytes outside the writable region that no longer hold the sentinel.
  int64_t CountStrayWrites(const std::vector<uint8_t>& out) const {
    const int64_t elem = static_cast<int64_t>(DTypeSize(c_.out_dtype));
    int64_t stray = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(out.size()); ++i) {
      if (!Writable(i / elem) && out[static_cast<size_t>(i)] != kSentinel) ++stray;
    }
    return stray;
  }

  // The raw buffers params() points into (queries, K cache, V cache), for copies to a
  // device.
  const std::vector<uint8_t>& q_bytes() const { return q_; }
  const std::vector<uint8_t>& k_bytes() const { return k_; }
  const std::vector<uint8_t>& v_bytes() const { return v_; }

  const AttnCase& config() const { return c_; }
  int num_heads() const { return num_heads_; }
  int32_t query_start(size_t s) const { return query_start_loc_[s]; }
  int32_t seq_len(size_t s) const { return seq_lens_[s]; }
  std::vector<int32_t>& block_table() { return block_table_; }
  std::vector<int32_t>& query_start_loc() { return query_start_loc_; }
  std::vector<int32_t>& seq_lens() { return seq_lens_; }
  std::vector<float>& k_scales() { return k_scale_; }
  std::vector<float>& v_scales() { return v_scale_; }
  std::vector<float>& alibi_slopes() { return alibi_; }
  int64_t num_blocks() const { return num_blocks_; }

  static constexpr uint8_t kSentinel = 0x5a;

 private:
  size_t TensorBytes(const CacheStrides& st, int dim) const {
    const int64_t last = st.Offset(num_blocks_ - 1, c_.block_size - 1, c_.num_kv_heads - 1,
                                   dim - 1);
    return static_cast<size_t>(last + 1) * DTypeSize(c_.cache_dtype);
  }

  AttnCase c_;
  std::mt19937 rng_;
  KvCacheSpec spec_;
  int num_heads_ = 0;
  int64_t num_tokens_ = 0;
  int64_t num_blocks_ = 0;
  int32_t max_query_len_ = 0;
  int32_t max_seq_len_ = 0;
  std::vector<int32_t> query_start_loc_, seq_lens_, block_table_;
  int64_t block_table_stride_ = 0;
  CacheStrides k_strides_, v_strides_;
  std::vector<uint8_t> k_, v_, q_;
  std::vector<float> k_scale_, v_scale_, alibi_;
  int64_t q_token_stride_ = 0;
  int64_t o_token_stride_ = 0;
};

// Absolute tolerance for comparing two outputs of `dtype` whose values lie in [-1, 1]:
// about two units in the last place of the output format near 1.
inline float OutputTolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 1e-4f;
    case DType::kFloat16: return 2e-3f;
    default: return 1e-2f;  // bfloat16
  }
}

// A cache dtype with its fp8 scale mode.
struct CacheKind {
  DType dtype;
  KvQuantMode quant;
};

// Every cache dtype (float32, float16, bfloat16, fp8 e4m3 and e5m2 each per tensor and per
// head), as the dtype grids of the CPU and GPU tests take them.
inline std::vector<CacheKind> AllCacheKinds() {
  return {{DType::kFloat32, KvQuantMode::kNone},
          {DType::kFloat16, KvQuantMode::kNone},
          {DType::kBFloat16, KvQuantMode::kNone},
          {DType::kFloat8E4M3, KvQuantMode::kPerTensor},
          {DType::kFloat8E4M3, KvQuantMode::kPerHead},
          {DType::kFloat8E5M2, KvQuantMode::kPerTensor},
          {DType::kFloat8E5M2, KvQuantMode::kPerHead}};
}

// The scale mode's part of a test name: "PerHead", "PerTensor" or "".
inline const char* QuantSuffix(KvQuantMode quant) {
  return quant == KvQuantMode::kPerHead ? "PerHead"
         : quant == KvQuantMode::kPerTensor ? "PerTensor"
                                            : "";
}


// The dtype grid of the attention tests (CPU, and the CUDA decode and backend tests): every
// q dtype (float32, float16, bfloat16) x cache kind x layout (NHD, HND), with test names
// "q<q>_cache<cache><scale mode>_<layout>" (DTypeGridName).
using DTypeGridParam = std::tuple<DType, CacheKind, TestLayout>;
inline auto DTypeGrid() {
  return ::testing::Combine(
      ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
      ::testing::ValuesIn(AllCacheKinds()), ::testing::Values(TestLayout::kNHD, TestLayout::kHND));
}
// A case of the grid point: q and out of its q dtype, its cache dtype, scale mode and
// layout; everything else at AttnCase's defaults.
inline AttnCase DTypeGridCase(const DTypeGridParam& param) {
  const auto& [q_dtype, cache, layout] = param;
  AttnCase c;
  c.q_dtype = q_dtype;
  c.out_dtype = q_dtype;
  c.cache_dtype = cache.dtype;
  c.quant = cache.quant;
  c.layout = layout;
  return c;
}
inline std::string DTypeGridName(const ::testing::TestParamInfo<DTypeGridParam>& info) {
  const CacheKind& cache = std::get<1>(info.param);
  return absl::StrCat("q", ShortDType(std::get<0>(info.param)), "_cache", ShortDType(cache.dtype),
                      QuantSuffix(cache.quant), "_", TestLayoutName(std::get<2>(info.param)));
}

// The shape grids of the attention tests: KV heads x group size, and head sizes (K, V).
struct HeadConfig {
  int num_kv_heads;
  int group;
};
struct HeadSizes {
  int k;
  int v;
};
// A shape grid's case: block size, heads and head sizes on a bfloat16 cache, HND for block
// size 5 and NHD otherwise; dtypes of q and out, sequences and seed are the caller's.
inline AttnCase ShapeGridCase(int block_size, const HeadConfig& heads, const HeadSizes& sizes) {
  AttnCase c;
  c.block_size = block_size;
  c.num_kv_heads = heads.num_kv_heads;
  c.group = heads.group;
  c.head_size = sizes.k;
  c.head_size_v = sizes.v;
  c.cache_dtype = DType::kBFloat16;
  c.layout = block_size == 5 ? TestLayout::kHND : TestLayout::kNHD;
  return c;
}
// "bs<block size>_kv<KV heads>x<group>[MQA]_d<k>_dv<v>".
inline std::string ShapeGridName(int block_size, const HeadConfig& h, const HeadSizes& s) {
  return absl::StrCat("bs", block_size, "_kv", h.num_kv_heads, "x", h.group,
                      h.num_kv_heads == 1 ? "MQA" : "", "_d", s.k, "_dv", s.v);
}

// The feature grid of the attention tests (CPU and CUDA decode): causal or not x sliding
// window (0, 5, 70) x ALiBi x soft cap x head_size_v (64, 48) x layout (NHD, HND), named
// by FeatureGridName.
using FeatureGridParam = std::tuple<bool, int, bool, bool, int, TestLayout>;
inline auto FeatureGrid() {
  return ::testing::Combine(::testing::Bool(), ::testing::Values(0, 5, 70), ::testing::Bool(),
                            ::testing::Bool(), ::testing::Values(64, 48),
                            ::testing::Values(TestLayout::kNHD, TestLayout::kHND));
}
inline std::string FeatureGridName(const ::testing::TestParamInfo<FeatureGridParam>& info) {
  const auto& [causal, window, alibi, cap, head_size_v, layout] = info.param;
  return absl::StrCat(causal ? "causal" : "bidir", "_window", window, alibi ? "_alibi" : "",
                      cap ? "_cap" : "", "_dv", head_size_v, "_", TestLayoutName(layout));
}
// A case of the grid point on a bfloat16 cache, block size 16, with a sharp softmax (scale
// 0.3), so that masks and caps change the answer visibly; sequences are the caller's.
inline AttnCase FeatureGridCase(const FeatureGridParam& param) {
  const auto& [causal, window, alibi, cap, head_size_v, layout] = param;
  AttnCase c;
  c.causal = causal;
  c.sliding_window = window;
  c.alibi = alibi;
  c.soft_cap = cap ? 2.0f : 0.0f;
  c.head_size_v = head_size_v;
  c.layout = layout;
  c.cache_dtype = DType::kBFloat16;
  c.scale = 0.3f;
  c.block_size = 16;
  c.seed = 11;
  return c;
}

// One output element of a batch's query rows: sequence s, its token t (output row `row`),
// head h, element d of the head.
struct QueryOutput {
  size_t s;
  int t;
  int64_t row;
  int h;
  int d;
};

// Calls fn(QueryOutput) for every output element of the batch's query rows, in order.
template <typename Fn>
void ForEachQueryOutput(const AttnProblem& pb, Fn&& fn) {
  const AttnCase& c = pb.config();
  for (size_t s = 0; s < c.seqs.size(); ++s) {
    for (int t = 0; t < c.seqs[s].query_len; ++t) {
      const int64_t row = pb.query_start(s) + t;
      for (int h = 0; h < pb.num_heads(); ++h) {
        for (int d = 0; d < c.head_size_v; ++d) fn(QueryOutput{s, t, row, h, d});
      }
    }
  }
}

}  // namespace testing_util
}  // namespace kvstream

#endif  // KVSTREAM_TESTS_UNIT_ATTENTION_TEST_UTIL_H_
