// Kvsum64Host against known answers and an independent reference (B assembled byte by byte,
// then the formula of layer_checksum.h word by word); invariance under any cut of the same
// bytes into spans (every single and double cut of a small buffer, random cuts with empty
// spans, spans at every address alignment); sensitivity to every single bit flip of a
// 4 KiB buffer, to swapping two different words, and to trailing zero bytes; and what
// DeviceChecksummer::Create says where no GPU can be used.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kvstream/cache/layer_checksum.h"
#include "kvstream/common/cuda_status.h"

namespace kvstream {
namespace {

// The reference, written from the definition alone.
uint64_t RefMix(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ull;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBull;
  z ^= z >> 31;
  return z;
}

uint64_t RefKvsum64(const std::vector<std::vector<uint8_t>>& pieces) {
  std::vector<uint8_t> b;
  for (const auto& piece : pieces) b.insert(b.end(), piece.begin(), piece.end());
  const uint64_t n = b.size();
  while (b.size() % 8 != 0) b.push_back(0);
  uint64_t sum = 0;
  for (size_t j = 0; j < b.size() / 8; ++j) {
    uint64_t w = 0;
    for (int k = 0; k < 8; ++k) w |= uint64_t{b[8 * j + k]} << (8 * k);
    sum += RefMix(w + (j + 1) * 0x9E3779B97F4A7C15ull);
  }
  return RefMix(sum ^ n);
}

uint64_t Sum(const std::vector<uint8_t>& bytes) {
  const ChecksumSpan span{bytes.data(), bytes.size()};
  return Kvsum64Host({&span, 1});
}

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> bytes(n);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

// `bytes` cut at the sorted positions `cuts` (repeats give empty spans).
std::vector<ChecksumSpan> CutAt(const std::vector<uint8_t>& bytes, std::vector<size_t> cuts) {
  std::sort(cuts.begin(), cuts.end());
  std::vector<ChecksumSpan> spans;
  size_t at = 0;
  for (size_t c : cuts) {
    spans.push_back({bytes.data() + at, c - at});
    at = c;
  }
  spans.push_back({bytes.data() + at, bytes.size() - at});
  return spans;
}

TEST(Kvsum64Host, MixIsTheSplitmix64Finaliser) {
  // splitmix64 seeded with 0 outputs Mix(1 * golden), Mix(2 * golden), ... : its published
  // first outputs are 0xE220A8397B1DCDAF and 0x6E789E6AA1B965F4. Sixteen zero bytes are two
  // zero words, so their sum is exactly those two outputs; N = 16.
  EXPECT_EQ(RefMix(0x9E3779B97F4A7C15ull), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(RefMix(2 * 0x9E3779B97F4A7C15ull), 0x6E789E6AA1B965F4ull);
  EXPECT_EQ(Sum(std::vector<uint8_t>(16, 0)),
            RefMix((0xE220A8397B1DCDAFull + 0x6E789E6AA1B965F4ull) ^ 16));
  EXPECT_EQ(Sum(std::vector<uint8_t>(16, 0)), 0xF55364D1BDCE1C61ull);
}

TEST(Kvsum64Host, KnownAnswers) {
  // Empty: no words, sum 0, N = 0; Mix(0) = 0.
  EXPECT_EQ(Kvsum64Host({}), 0u);
  EXPECT_EQ(Sum({}), 0u);
  // One byte 0x01: w_0 = 1, term Mix(1 + golden) = Mix(0x9E3779B97F4A7C16)
  // = 0x910A2DEC89025CC1; then Mix(0x910A2DEC89025CC1 ^ 1).
  EXPECT_EQ(RefMix(0x9E3779B97F4A7C16ull), 0x910A2DEC89025CC1ull);
  EXPECT_EQ(Sum({0x01}), RefMix(0x910A2DEC89025CC1ull ^ 1));
  EXPECT_EQ(Sum({0x01}), 0x5C52BD4054E958C9ull);
  // One zero byte differs from the empty input only through N.
  EXPECT_EQ(Sum({0x00}), RefMix(0xE220A8397B1DCDAFull ^ 1));
  EXPECT_EQ(Sum({0x00}), 0x9E0160293A33AAF7ull);
  // 01 .. 08: one word, 0x0807060504030201 (little-endian).
  EXPECT_EQ(Sum({1, 2, 3, 4, 5, 6, 7, 8}),
            RefMix(RefMix(0x0807060504030201ull + 0x9E3779B97F4A7C15ull) ^ 8));
  EXPECT_EQ(Sum({1, 2, 3, 4, 5, 6, 7, 8}), 0x17F412D6DA1DA365ull);
  // 01 .. 09: that word, then w_1 = 9 (zero-padded) at index 1.
  EXPECT_EQ(Sum({1, 2, 3, 4, 5, 6, 7, 8, 9}),
            RefMix((RefMix(0x0807060504030201ull + 0x9E3779B97F4A7C15ull) +
                    RefMix(9 + 2 * 0x9E3779B97F4A7C15ull)) ^
                   9));
  EXPECT_EQ(Sum({1, 2, 3, 4, 5, 6, 7, 8, 9}), 0x576BEEB74350D108ull);
  std::vector<uint8_t> seventeen(17);
  for (int i = 0; i < 17; ++i) seventeen[i] = static_cast<uint8_t>(i);
  EXPECT_EQ(Sum(seventeen), 0x1114625037A6A0A2ull);
}

TEST(Kvsum64Host, MatchesTheReferenceOnEverySmallSize) {
  for (size_t n = 0; n <= 300; ++n) {
    const std::vector<uint8_t> bytes = RandomBytes(n, static_cast<uint32_t>(n));
    EXPECT_EQ(Sum(bytes), RefKvsum64({bytes})) << "n = " << n;
  }
  const std::vector<uint8_t> large = RandomBytes(1 << 20, 7);
  EXPECT_EQ(Sum(large), RefKvsum64({large}));
}

TEST(Kvsum64Host, EveryCutOfTheSameBytesGivesTheSameSum) {
  const std::vector<uint8_t> bytes = RandomBytes(67, 11);
  const uint64_t whole = Sum(bytes);
  ASSERT_EQ(whole, RefKvsum64({bytes}));
  for (size_t a = 0; a <= bytes.size(); ++a) {
    EXPECT_EQ(Kvsum64Host(CutAt(bytes, {a})), whole) << "cut at " << a;
    for (size_t b = a; b <= bytes.size(); ++b) {
      ASSERT_EQ(Kvsum64Host(CutAt(bytes, {a, b})), whole) << "cuts at " << a << ", " << b;
    }
  }
}

TEST(Kvsum64Host, RandomCutsWithEmptySpansGiveTheSameSum) {
  std::mt19937 rng(3);
  for (int round = 0; round < 200; ++round) {
    const size_t n = rng() % 5000;
    const std::vector<uint8_t> bytes = RandomBytes(n, static_cast<uint32_t>(round));
    const uint64_t whole = RefKvsum64({bytes});
    std::vector<size_t> cuts(rng() % 40);
    for (auto& c : cuts) c = n == 0 ? 0 : rng() % (n + 1);
    ASSERT_EQ(Kvsum64Host(CutAt(bytes, cuts)), whole) << "round " << round;
  }
}

TEST(Kvsum64Host, SpansAtAnyAddressAlignment) {
  // The same pieces copied to every offset 0 .. 15 from an aligned base.
  const std::vector<uint8_t> a = RandomBytes(1001, 21);
  const std::vector<uint8_t> b = RandomBytes(37, 22);
  const std::vector<uint8_t> c = RandomBytes(4096 + 5, 23);
  const uint64_t want = RefKvsum64({a, b, c});
  for (size_t offset = 0; offset < 16; ++offset) {
    std::vector<uint64_t> storage((a.size() + b.size() + c.size()) / 8 + 64);
    uint8_t* base = reinterpret_cast<uint8_t*>(storage.data()) + offset;
    std::memcpy(base, c.data(), c.size());  // out of order in memory, in order in B
    std::memcpy(base + c.size() + 3, a.data(), a.size());
    std::memcpy(base + c.size() + 3 + a.size() + 1, b.data(), b.size());
    const ChecksumSpan spans[] = {{base + c.size() + 3, a.size()},
                                  {base + c.size() + 3 + a.size() + 1, b.size()},
                                  {base, c.size()}};
    EXPECT_EQ(Kvsum64Host(spans), want) << "offset " << offset;
  }
}

TEST(Kvsum64Host, EverySingleBitFlipChangesTheSum) {
  std::vector<uint8_t> bytes = RandomBytes(4096, 31);
  const uint64_t base = Sum(bytes);
  int unchanged = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      bytes[i] ^= static_cast<uint8_t>(1u << bit);
      if (Sum(bytes) == base) ++unchanged;
      bytes[i] ^= static_cast<uint8_t>(1u << bit);
    }
  }
  EXPECT_EQ(unchanged, 0);
  EXPECT_EQ(Sum(bytes), base);
}

TEST(Kvsum64Host, SwappingTwoDifferentWordsChangesTheSum) {
  std::vector<uint8_t> bytes = RandomBytes(4096, 41);
  const uint64_t base = Sum(bytes);
  const size_t words = bytes.size() / 8;
  auto swap_words = [&](size_t x, size_t y) {
    for (int k = 0; k < 8; ++k) std::swap(bytes[8 * x + k], bytes[8 * y + k]);
  };
  int unchanged = 0;
  int tried = 0;
  // Every neighbouring pair, every pair with the first word, and random pairs.
  std::vector<std::pair<size_t, size_t>> pairs;
  for (size_t x = 0; x + 1 < words; ++x) pairs.emplace_back(x, x + 1);
  for (size_t y = 1; y < words; ++y) pairs.emplace_back(0, y);
  std::mt19937 rng(5);
  for (int i = 0; i < 5000; ++i) pairs.emplace_back(rng() % words, rng() % words);
  for (const auto& [x, y] : pairs) {
    if (std::memcmp(&bytes[8 * x], &bytes[8 * y], 8) == 0) continue;  // x == y too
    ++tried;
    swap_words(x, y);
    if (Sum(bytes) == base) ++unchanged;
    swap_words(x, y);
  }
  EXPECT_GT(tried, 5000);
  EXPECT_EQ(unchanged, 0);
  // Whole 32 KiB blocks in swapped order (a misplaced KV block) change it too.
  const std::vector<uint8_t> k0 = RandomBytes(32768, 1), k1 = RandomBytes(32768, 2);
  const ChecksumSpan in_order[] = {{k0.data(), k0.size()}, {k1.data(), k1.size()}};
  const ChecksumSpan swapped[] = {{k1.data(), k1.size()}, {k0.data(), k0.size()}};
  EXPECT_NE(Kvsum64Host(in_order), Kvsum64Host(swapped));
}

TEST(Kvsum64Host, TrailingZeroBytesChangeTheSum) {
  std::vector<uint8_t> bytes = RandomBytes(100, 51);
  const uint64_t base = Sum(bytes);
  for (int extra = 1; extra <= 16; ++extra) {
    bytes.push_back(0);
    EXPECT_NE(Sum(bytes), base) << extra << " zero bytes appended";
  }
}

TEST(DeviceChecksummer, CreateSaysWhyItCannotRunWithoutAGpu) {
  DeviceChecksummer::Options options;
  absl::StatusOr<std::unique_ptr<DeviceChecksummer>> summer = DeviceChecksummer::Create(options);
  if (!BuiltWithCuda()) {
    ASSERT_EQ(summer.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(summer.status().message().find("without CUDA"), absl::string_view::npos)
        << summer.status();
    return;
  }
  if (GpuCount() > 0) GTEST_SKIP() << "a GPU is present: tests/gpu/layer_checksum_gpu_test.cc";
  EXPECT_EQ(summer.status().code(), absl::StatusCode::kFailedPrecondition) << summer.status();
}

TEST(DeviceChecksummer, CreateRejectsOptionsOutOfRange) {
  if (!BuiltWithCuda()) GTEST_SKIP() << "built without CUDA: Create always fails";
  DeviceChecksummer::Options options;
  options.max_in_flight = 0;
  EXPECT_EQ(DeviceChecksummer::Create(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = DeviceChecksummer::Options();
  options.staging_bytes = 100;
  EXPECT_EQ(DeviceChecksummer::Create(options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvstream
