// Kvsum64Host against known answers and an independent reference (B assembled byte by byte,
// then the formula of layer_checksum.h word by word); invariance under any cut of the same
// bytes into spans (every single and double cut of a small buffer, random cuts with empty
// spans, spans at every address alignment); sensitivity to every single bit flip of a
// 4 KiB buffer, to swapping two different words, and to trailing zero bytes. Then the
// kernel's own per-thread code (cache/src/cuda/layer_checksum.cuh, ThreadSum over the
// table WriteTable builds) run on the host for every thread of every CTA, with loads that
// check the GPU's rules (vector loads aligned and inside a span, no aligned word touched
// that holds none of a span's bytes), against Kvsum64Host: random spans at odd offsets,
// tiny spans, every alignment, grids of 1 to 1056 CTAs. And what DeviceChecksummer::Create
// says where no GPU can be used.
#include "cache/src/cuda/layer_checksum.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

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

// ---- The kernel's per-thread code on the host ------------------------------------------

namespace ks = internal::kvsum64;

// HostLoads that also check what the GPU requires of the kernel's loads: Pair 16-byte
// aligned and inside one span; Word 8-byte aligned and holding at least one byte of a span
// (the funnel path reads the aligned words around a span's edge, never one beyond it);
// Byte inside a span. Violations are counted, with the first one described.
struct CheckedLoads {
  static std::vector<std::pair<uint64_t, uint64_t>>& Ranges() {  // sorted [begin, end)
    static std::vector<std::pair<uint64_t, uint64_t>> ranges;
    return ranges;
  }
  static int& Violations() {
    static int violations = 0;
    return violations;
  }
  static std::string& First() {
    static std::string first;
    return first;
  }
  static void Violation(const char* what, uint64_t address) {
    if (Violations()++ == 0) First() = std::string(what) + " at " + std::to_string(address);
  }
  // Whether [a, b) overlaps a span (any = true) or lies inside one (any = false).
  static bool Covered(uint64_t a, uint64_t b, bool any) {
    const auto& r = Ranges();
    auto it = std::upper_bound(r.begin(), r.end(), std::make_pair(a, ~uint64_t{0}));
    // Spans do not overlap in these tests: the candidates are the one starting at or before
    // a, and (for an overlap) the next one.
    if (it != r.begin()) {
      const auto& prev = *(it - 1);
      if (any ? prev.second > a : prev.second >= b) return true;
    }
    return any && it != r.end() && it->first < b;
  }
  static void SetSpans(absl::Span<const ChecksumSpan> spans) {
    auto& r = Ranges();
    r.clear();
    for (const ChecksumSpan& s : spans) {
      if (s.length == 0) continue;
      const uint64_t a = reinterpret_cast<uint64_t>(s.data);
      r.emplace_back(a, a + s.length);
    }
    std::sort(r.begin(), r.end());
    Violations() = 0;
    First().clear();
  }
  static uint64_t Word(uint64_t address) {
    if (address % 8 != 0) Violation("misaligned 8-byte load", address);
    if (!Covered(address, address + 8, /*any=*/true))
      Violation("8-byte load off every span", address);
    return ks::HostLoads::Word(address);
  }
  static ks::WordPair Pair(uint64_t address) {
    if (address % 16 != 0) Violation("misaligned 16-byte load", address);
    if (!Covered(address, address + 16, /*any=*/false))
      Violation("16-byte load outside a span", address);
    return ks::HostLoads::Pair(address);
  }
  static uint64_t Byte(uint64_t address) {
    if (!Covered(address, address + 1, /*any=*/false))
      Violation("byte load outside a span", address);
    return ks::HostLoads::Byte(address);
  }
};

// What the kernel computes over `spans` with `grid` CTAs, every thread's ThreadSum added up
// (the CTA and grid reductions are plain sums), over the table WriteTable lays out.
uint64_t EmulatedKernel(absl::Span<const ChecksumSpan> spans, uint64_t grid) {
  size_t n = 0;
  uint64_t total = 0;
  for (const ChecksumSpan& s : spans) {
    if (s.length == 0) continue;
    ++n;
    total += s.length;
  }
  const uint64_t chunks = ks::NumChunks(total);
  const ks::TableLayout layout = ks::LayoutFor(n, chunks);
  EXPECT_EQ(layout.bytes, DeviceChecksummer::StagingBytesFor(n, total));
  std::vector<uint64_t> storage(layout.bytes / 8 + 2);
  uint8_t* table = reinterpret_cast<uint8_t*>(storage.data());
  ks::WriteTable(spans, layout, total, table);
  ks::KernelParams p{};
  p.spans = reinterpret_cast<const ks::SpanEntry*>(table + layout.spans_offset);
  p.chunk_first_span = reinterpret_cast<const uint32_t*>(table + layout.map_offset);
  p.num_spans = n;
  p.total_bytes = total;
  p.num_chunks = chunks;
  CheckedLoads::SetSpans(spans);
  uint64_t sum = 0;
  for (uint64_t cta = 0; cta < grid; ++cta) {
    for (uint32_t t = 0; t < static_cast<uint32_t>(ks::kThreads); ++t) {
      sum += ks::ThreadSum<CheckedLoads>(p, cta, grid, t);
    }
  }
  return ks::Finish(sum, total);
}

// The kernel's grid for `total` bytes on a device with `resident` CTAs (the launcher's rule).
uint64_t GridFor(uint64_t total, uint64_t resident) {
  return std::max<uint64_t>(1, std::min<uint64_t>(ks::NumChunks(total), resident));
}

// Spans over an arena (8-byte aligned base): lengths from `length`, each starting `gap`
// bytes after the previous one ends (odd gaps: odd offsets), laid out in memory in a
// shuffled order unless `in_order`.
struct Arena {
  std::vector<uint64_t> storage;
  std::vector<ChecksumSpan> spans;
  uint8_t* base() { return reinterpret_cast<uint8_t*>(storage.data()); }
};

template <typename LengthFn, typename GapFn>
Arena MakeArena(int count, uint32_t seed, LengthFn length, GapFn gap, bool in_order) {
  std::mt19937 rng(seed);
  std::vector<uint64_t> lengths(static_cast<size_t>(count)), offsets(lengths.size());
  uint64_t at = 0;
  for (int i = 0; i < count; ++i) {
    at += gap(rng);
    lengths[static_cast<size_t>(i)] = length(rng);
    offsets[static_cast<size_t>(i)] = at;
    at += lengths[static_cast<size_t>(i)];
  }
  Arena a;
  a.storage.resize(at / 8 + 4);
  for (auto& w : a.storage) w = (uint64_t{rng()} << 32) | rng();
  std::vector<size_t> order(lengths.size());
  std::iota(order.begin(), order.end(), 0);
  if (!in_order) std::shuffle(order.begin(), order.end(), rng);
  for (size_t i : order) a.spans.push_back({a.base() + offsets[i], lengths[i]});
  return a;
}

void ExpectKernelMatchesHost(absl::Span<const ChecksumSpan> spans, const std::string& what) {
  uint64_t total = 0;
  for (const ChecksumSpan& s : spans) total += s.length;
  const uint64_t want = Kvsum64Host(spans);
  for (const uint64_t resident : {uint64_t{1}, uint64_t{3}, uint64_t{1056}}) {
    const uint64_t grid = GridFor(total, resident);
    EXPECT_EQ(EmulatedKernel(spans, grid), want) << what << ", grid " << grid;
    EXPECT_EQ(CheckedLoads::Violations(), 0)
        << what << ", grid " << grid << ": " << CheckedLoads::First();
  }
}

TEST(Kvsum64Kernel, EmptyInputs) {
  ExpectKernelMatchesHost({}, "no spans");
  std::vector<ChecksumSpan> empties(5, ChecksumSpan{nullptr, 0});
  ExpectKernelMatchesHost(empties, "only empty spans");
  EXPECT_EQ(EmulatedKernel({}, 1), 0u);
}

TEST(Kvsum64Kernel, RandomLengthsAtOddOffsets) {
  for (uint32_t seed = 1; seed <= 4; ++seed) {
    Arena a = MakeArena(
        60, seed, [](std::mt19937& r) { return 1 + r() % 100000; },
        [](std::mt19937& r) { return 2 * (r() % 8) + 1; }, /*in_order=*/seed % 2 == 0);
    ExpectKernelMatchesHost(a.spans, "random lengths, seed " + std::to_string(seed));
  }
}

TEST(Kvsum64Kernel, TinySpansSharingWords) {
  // Lengths 1 .. 9 at any gap: most words of B are assembled from several spans.
  Arena a = MakeArena(
      3000, 7, [](std::mt19937& r) { return 1 + r() % 9; }, [](std::mt19937& r) { return r() % 4; },
      /*in_order=*/false);
  ExpectKernelMatchesHost(a.spans, "tiny spans");
  Arena ones = MakeArena(
      200, 8, [](std::mt19937&) { return 1; }, [](std::mt19937& r) { return r() % 3; },
      /*in_order=*/false);
  ExpectKernelMatchesHost(ones.spans, "one-byte spans");
}

TEST(Kvsum64Kernel, EveryAlignmentOfAddressAndPositionInB) {
  // A prefix of p bytes (0 .. 15) puts the second span at position p of B; its address
  // offset o (0 .. 15) from a 16-byte boundary. Lengths around the 16-byte pair and the
  // item counts the deal turns on.
  for (uint64_t length : {uint64_t{1}, uint64_t{7}, uint64_t{8}, uint64_t{15}, uint64_t{16},
                          uint64_t{17}, uint64_t{40}, uint64_t{4099}, uint64_t{40000}}) {
    for (uint64_t prefix = 0; prefix < 16; ++prefix) {
      for (uint64_t offset = 0; offset < 16; ++offset) {
        std::vector<uint64_t> storage((length + prefix + 64) / 8 + 4);
        std::mt19937_64 rng(length * 256 + prefix * 16 + offset);
        for (auto& w : storage) w = rng();
        uint8_t* base = reinterpret_cast<uint8_t*>(storage.data());
        const ChecksumSpan spans[] = {{base + length + offset + 24, prefix},
                                      {base + offset, length},
                                      {base + length + offset + 8, 5}};
        ExpectKernelMatchesHost(spans, "length " + std::to_string(length) + " prefix " +
                                           std::to_string(prefix) + " offset " +
                                           std::to_string(offset));
        if (HasFailure()) return;
      }
    }
  }
}

TEST(Kvsum64Kernel, ShuffledBlocksOverManyChunks) {
  // A layer's K runs then V runs: 96 blocks of 32 KiB (aligned: the 16-byte path), then the
  // same with 1000-byte blocks (chunks cut through spans at every phase).
  for (const uint64_t block : {uint64_t{32768}, uint64_t{1000}}) {
    Arena k = MakeArena(
        96, 9, [block](std::mt19937&) { return block; }, [](std::mt19937&) { return 0; },
        /*in_order=*/false);
    Arena v = MakeArena(
        96, 10, [block](std::mt19937&) { return block; }, [](std::mt19937&) { return 0; },
        /*in_order=*/false);
    std::vector<ChecksumSpan> spans = k.spans;
    spans.insert(spans.end(), v.spans.begin(), v.spans.end());
    ExpectKernelMatchesHost(spans, "blocks of " + std::to_string(block));
  }
}

TEST(Kvsum64Kernel, TableLayoutAndChunkMap) {
  // Three spans over 100 000 bytes: chunks of 32 KiB start in spans 0, 0, 1, 2.
  std::vector<uint8_t> bytes(100000);
  const ChecksumSpan spans[] = {{bytes.data(), 40000},
                                {nullptr, 0},
                                {bytes.data() + 40000, 30000},
                                {bytes.data() + 70000, 30000}};
  const uint64_t chunks = ks::NumChunks(100000);
  ASSERT_EQ(chunks, 4u);
  const ks::TableLayout layout = ks::LayoutFor(3, chunks);
  EXPECT_EQ(layout.spans_offset, 16u);
  EXPECT_EQ(layout.map_offset, 16u + 3 * 16);
  EXPECT_EQ(layout.bytes, 16u + 3 * 16 + 16);
  EXPECT_EQ(DeviceChecksummer::StagingBytesFor(3, 100000), layout.bytes);
  std::vector<uint64_t> storage(layout.bytes / 8, ~uint64_t{0});
  uint8_t* table = reinterpret_cast<uint8_t*>(storage.data());
  ks::WriteTable(spans, layout, 100000, table);
  EXPECT_EQ(reinterpret_cast<const ks::TableHeader*>(table)->sum, 0u);
  EXPECT_EQ(reinterpret_cast<const ks::TableHeader*>(table)->done_ctas, 0u);
  const auto* entries = reinterpret_cast<const ks::SpanEntry*>(table + layout.spans_offset);
  EXPECT_EQ(entries[0].start, 0u);
  EXPECT_EQ(entries[1].start, 40000u);
  EXPECT_EQ(entries[2].start, 70000u);
  EXPECT_EQ(entries[1].address, reinterpret_cast<uint64_t>(bytes.data() + 40000));
  const auto* map = reinterpret_cast<const uint32_t*>(table + layout.map_offset);
  EXPECT_EQ(map[0], 0u);
  EXPECT_EQ(map[1], 0u);  // byte 32768 lies in span 0
  EXPECT_EQ(map[2], 1u);  // byte 65536 in span 1 (40000 .. 70000)
  EXPECT_EQ(map[3], 2u);  // byte 98304 in span 2
}

// ---- DeviceChecksummer without a GPU -----------------------------------------------------

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
  EXPECT_EQ(DeviceChecksummer::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options = DeviceChecksummer::Options();
  options.staging_bytes = 100;
  EXPECT_EQ(DeviceChecksummer::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvstream
