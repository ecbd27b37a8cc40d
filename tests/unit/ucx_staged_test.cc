// Tests of the UCX transport's staged device path that need no GPU: the chunk planner
// (transfer/src/ucx/staged_plan.h: every byte planned exactly once, chunk and piece bounds,
// staging alignment, the receiver's recomputed layout agreeing with the sender's), the
// staged messages (staged_wire.h) and the version-2 memory descriptor and notification
// header (ucx_wire.h): round trips and strict decoding of hostile bytes.
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvstream/common/byte_io.h"
#include "transfer/src/ucx/staged_plan.h"
#include "transfer/src/ucx/staged_wire.h"
#include "transfer/src/ucx/ucx_wire.h"

namespace kvstream {
namespace internal {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kChunk = uint64_t{1} << 20;

// Checks a plan against its segments: every chunk within bounds, pieces aligned as the
// rule says, and every byte of every segment planned exactly once, from its source to its
// destination (each piece lies inside one segment at the segment's source-to-destination
// shift; pieces never overlap at the destination; the lengths add up).
void CheckPlan(const std::vector<Segment>& segments, const std::vector<StagedChunk>& chunks,
               uint64_t chunk_bytes) {
  std::map<uint64_t, Segment> by_remote;  // destination start -> segment
  uint64_t total = 0;
  for (const Segment& s : segments) {
    if (s.length == 0) continue;
    by_remote[s.remote_offset] = s;
    total += s.length;
  }
  // Runs the planner may coalesce: contiguous at the destination with the same shift.
  for (auto it = by_remote.begin(); it != by_remote.end();) {
    auto next = std::next(it);
    if (next != by_remote.end() &&
        it->second.remote_offset + it->second.length == next->second.remote_offset &&
        it->second.local_offset + it->second.length == next->second.local_offset) {
      it->second.length += next->second.length;
      by_remote.erase(next);
    } else {
      it = next;
    }
  }
  std::vector<StagedPiece> all;
  for (const StagedChunk& chunk : chunks) {
    ASSERT_FALSE(chunk.pieces.empty());
    ASSERT_LE(chunk.pieces.size(), kMaxStagedPiecesPerChunk);
    ASSERT_LE(chunk.staged_bytes, chunk_bytes);
    std::vector<uint64_t> lengths;
    uint64_t end = 0;
    for (size_t i = 0; i < chunk.pieces.size(); ++i) {
      const StagedPiece& p = chunk.pieces[i];
      ASSERT_GE(p.length, 1u);
      ASSERT_LE(p.length, kStagedPieceBytes);
      EXPECT_EQ(p.staging_offset, i == 0 ? 0 : NextStagingOffset(end));
      EXPECT_EQ(p.staging_offset % kStagingAlignment, 0u);
      end = p.staging_offset + p.length;
      lengths.push_back(p.length);
      all.push_back(p);
    }
    EXPECT_EQ(chunk.staged_bytes, end);
    // The receiver, which sees only the lengths, derives the same staging offsets.
    std::vector<uint64_t> offsets;
    absl::StatusOr<uint64_t> staged = StagingLayout(lengths, chunk_bytes, &offsets);
    ASSERT_TRUE(staged.ok()) << staged.status();
    EXPECT_EQ(*staged, chunk.staged_bytes);
    for (size_t i = 0; i < offsets.size(); ++i) {
      EXPECT_EQ(offsets[i], chunk.pieces[i].staging_offset);
    }
  }
  std::sort(all.begin(), all.end(), [](const StagedPiece& a, const StagedPiece& b) {
    return a.remote_offset < b.remote_offset;
  });
  uint64_t planned = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const StagedPiece& p = all[i];
    if (i > 0) {
      ASSERT_LE(all[i - 1].remote_offset + all[i - 1].length, p.remote_offset) << "overlap";
    }
    auto it = by_remote.upper_bound(p.remote_offset);
    ASSERT_NE(it, by_remote.begin());
    --it;
    const Segment& s = it->second;
    ASSERT_LE(p.remote_offset + p.length, s.remote_offset + s.length);
    EXPECT_EQ(p.local_offset - s.local_offset, p.remote_offset - s.remote_offset);
    planned += p.length;
  }
  EXPECT_EQ(planned, total);
}

TEST(StagedPlanTest, ShuffledBlocksEveryByteOnceWithinBounds) {
  std::mt19937 rng(7);
  for (uint64_t block : {uint64_t{16}, uint64_t{100}, uint64_t{4096}, uint64_t{32768},
                         uint64_t{65537}, uint64_t{262144}}) {
    const size_t blocks = std::max<uint64_t>(8, (uint64_t{6} << 20) / block / 4);
    std::vector<uint64_t> src(blocks), dst(blocks);
    for (size_t i = 0; i < blocks; ++i) src[i] = dst[i] = i;
    std::shuffle(src.begin(), src.end(), rng);
    std::shuffle(dst.begin(), dst.end(), rng);
    std::vector<Segment> segments;
    for (size_t i = 0; i < blocks; ++i) segments.push_back({src[i] * block, dst[i] * block, block});
    auto chunks = PlanStagedChunks(segments, kChunk);
    ASSERT_TRUE(chunks.ok()) << chunks.status();
    CheckPlan(segments, *chunks, kChunk);
  }
}

TEST(StagedPlanTest, CoalescesRunsAndCutsThemIntoPieces) {
  // Eight blocks of 32 KiB, contiguous on both sides: one 256 KiB run, four pieces.
  std::vector<Segment> segments;
  for (uint64_t i = 0; i < 8; ++i) segments.push_back({i * 32768, 1000000 + i * 32768, 32768});
  auto chunks = PlanStagedChunks(segments, kChunk);
  ASSERT_TRUE(chunks.ok());
  ASSERT_EQ(chunks->size(), 1u);
  ASSERT_EQ((*chunks)[0].pieces.size(), 4u);
  for (const StagedPiece& p : (*chunks)[0].pieces) EXPECT_EQ(p.length, kStagedPieceBytes);
  CheckPlan(segments, *chunks, kChunk);
  // Contiguous locally only: not coalesced.
  std::vector<Segment> apart = {{0, 0, 4096}, {4096, 8192, 4096}};
  auto two = PlanStagedChunks(apart, kChunk);
  ASSERT_TRUE(two.ok());
  EXPECT_EQ((*two)[0].pieces.size(), 2u);
}

TEST(StagedPlanTest, LargeSegmentSpansChunksAndEmptyOnesVanish) {
  std::vector<Segment> segments = {{0, 0, 0}, {5, 3, 3 * kChunk + 12345}, {0, 0, 0}};
  auto chunks = PlanStagedChunks(segments, kChunk);
  ASSERT_TRUE(chunks.ok());
  EXPECT_EQ(chunks->size(), 4u);
  CheckPlan(segments, *chunks, kChunk);
  auto none = PlanStagedChunks(std::vector<Segment>{{0, 0, 0}}, kChunk);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

TEST(StagedPlanTest, TinySegmentsHitThePieceLimit) {
  // 10000 one-byte segments, scattered: each its own piece, at most 4096 per chunk.
  std::vector<Segment> segments;
  for (uint64_t i = 0; i < 10000; ++i) segments.push_back({i * 2, i * 3, 1});
  auto chunks = PlanStagedChunks(segments, kChunk);
  ASSERT_TRUE(chunks.ok());
  ASSERT_EQ(chunks->size(), 3u);
  EXPECT_EQ((*chunks)[0].pieces.size(), kMaxStagedPiecesPerChunk);
  CheckPlan(segments, *chunks, kChunk);
}

TEST(StagedPlanTest, RejectsBadChunkSizes) {
  std::vector<Segment> segments = {{0, 0, 64}};
  for (uint64_t bad : {uint64_t{0}, kMinStagedChunkBytes - 16, kMinStagedChunkBytes + 8,
                       kMaxStagedChunkBytes + 16}) {
    EXPECT_EQ(PlanStagedChunks(segments, bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(StagedPlanTest, StagingLayoutRefusesWhatCannotFit) {
  std::vector<uint64_t> offsets;
  EXPECT_FALSE(StagingLayout(std::vector<uint64_t>{0}, kChunk, &offsets).ok());
  EXPECT_FALSE(StagingLayout(std::vector<uint64_t>{kStagedPieceBytes + 1}, kChunk, &offsets).ok());
  // 17 pieces of 64 KiB do not fit 1 MiB; 16 do.
  EXPECT_FALSE(StagingLayout(std::vector<uint64_t>(17, kStagedPieceBytes), kChunk, &offsets).ok());
  auto fits = StagingLayout(std::vector<uint64_t>(16, kStagedPieceBytes), kChunk, &offsets);
  ASSERT_TRUE(fits.ok());
  EXPECT_EQ(*fits, kChunk);
  // Alignment padding counts: 1 + pad 15 + 16 = 32.
  auto padded = StagingLayout(std::vector<uint64_t>{1, 16}, kChunk, &offsets);
  ASSERT_TRUE(padded.ok());
  EXPECT_EQ(*padded, 32u);
  EXPECT_EQ(offsets, (std::vector<uint64_t>{0, 16}));
}

// Every strict prefix of `good` and `good` + a trailing byte fail to decode.
template <typename Decode>
void ExpectTruncationsAndTrailingFail(const std::string& good, Decode decode) {
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_EQ(decode(good.substr(0, n)).status().code(), absl::StatusCode::kInvalidArgument)
        << "prefix of " << n << " bytes";
  }
  EXPECT_EQ(decode(good + "x").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(StagedWireTest, HeaderRoundTripAndStrictness) {
  const std::string good = EncodeStagedHeader(StagedType::kChunk, 0x1234567890abcdefull, 9);
  ASSERT_EQ(good.size(), kStagedHeaderBytes);
  auto h = DecodeStagedHeader(good);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->type, StagedType::kChunk);
  EXPECT_EQ(h->sender_uid, 0x1234567890abcdefull);
  EXPECT_EQ(h->stamp, 9u);
  ExpectTruncationsAndTrailingFail(good, DecodeStagedHeader);
  for (size_t i : {size_t{0}, size_t{4}, size_t{6}, size_t{7}}) {  // magic, version, type, reserved
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x40);
    EXPECT_EQ(DecodeStagedHeader(bad).status().code(), absl::StatusCode::kInvalidArgument) << i;
  }
  std::string unknown = good;
  unknown[6] = 0;
  EXPECT_THAT(DecodeStagedHeader(unknown).status().message(), HasSubstr("unknown type"));
}

TEST(StagedWireTest, MessagesRoundTrip) {
  auto hello = DecodeHello(EncodeHello("worker-info-bytes"));
  ASSERT_TRUE(hello.ok());
  EXPECT_EQ(*hello, "worker-info-bytes");

  StagedWelcome w;
  w.ok = true;
  w.slots = 4;
  w.slot_bytes = kChunk;
  w.landing_descriptor = "descriptor";
  auto welcome = DecodeWelcome(EncodeWelcome(w));
  ASSERT_TRUE(welcome.ok()) << welcome.status();
  EXPECT_TRUE(welcome->ok);
  EXPECT_EQ(welcome->slots, 4u);
  EXPECT_EQ(welcome->slot_bytes, kChunk);
  EXPECT_EQ(welcome->landing_descriptor, "descriptor");
  StagedWelcome refusal;
  refusal.reason = "no device memory";
  auto refused = DecodeWelcome(EncodeWelcome(refusal));
  ASSERT_TRUE(refused.ok());
  EXPECT_FALSE(refused->ok);
  EXPECT_EQ(refused->reason, "no device memory");

  StagedChunkMessage c;
  c.seq = 77;
  c.index = 2;
  c.count = 5;
  c.slot = 3;
  c.region_id = 9;
  c.pieces = {{0, 4096}, {1 << 20, 100}};
  auto chunk = DecodeChunk(EncodeChunk(c));
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  EXPECT_EQ(chunk->seq, 77u);
  EXPECT_EQ(chunk->index, 2u);
  EXPECT_EQ(chunk->count, 5u);
  EXPECT_EQ(chunk->slot, 3u);
  EXPECT_EQ(chunk->region_id, 9u);
  ASSERT_EQ(chunk->pieces.size(), 2u);
  EXPECT_EQ(chunk->pieces[1].remote_offset, uint64_t{1} << 20);
  EXPECT_EQ(chunk->pieces[1].length, 100u);

  auto credits = DecodeCredits(EncodeCredits({0, 3, 1}));
  ASSERT_TRUE(credits.ok());
  EXPECT_EQ(*credits, (std::vector<uint32_t>{0, 3, 1}));

  auto abort = DecodeAbort(EncodeAbort(StagedAbort{12, 3}));
  ASSERT_TRUE(abort.ok());
  EXPECT_EQ(abort->seq, 12u);
  EXPECT_EQ(abort->chunks_sent, 3u);

  ExpectTruncationsAndTrailingFail(EncodeHello("x"), DecodeHello);
  ExpectTruncationsAndTrailingFail(EncodeWelcome(w), DecodeWelcome);
  ExpectTruncationsAndTrailingFail(EncodeWelcome(refusal), DecodeWelcome);
  ExpectTruncationsAndTrailingFail(EncodeChunk(c), DecodeChunk);
  ExpectTruncationsAndTrailingFail(EncodeCredits({1, 2}), DecodeCredits);
  ExpectTruncationsAndTrailingFail(EncodeAbort(StagedAbort{1, 1}), DecodeAbort);
}

TEST(StagedWireTest, HostileFieldsAreRefused) {
  StagedChunkMessage c;
  c.count = 1;
  c.pieces = {{0, 16}};
  // Index outside its count, no chunks, no pieces.
  c.index = 1;
  EXPECT_FALSE(DecodeChunk(EncodeChunk(c)).ok());
  c.index = 0;
  c.count = 0;
  EXPECT_FALSE(DecodeChunk(EncodeChunk(c)).ok());
  c.count = 1;
  c.pieces.clear();
  EXPECT_FALSE(DecodeChunk(EncodeChunk(c)).ok());
  // A piece count over the limit, and one claiming more pieces than the bytes hold.
  for (uint32_t count : {kMaxStagedPiecesPerChunk + 1, uint32_t{1000}}) {
    std::string body;
    ByteWriter w(&body);
    w.U64(0);
    w.U32(0);
    w.U32(1);
    w.U32(0);
    w.U64(1);
    w.U32(count);
    w.U64(0);
    w.U64(16);
    EXPECT_EQ(DecodeChunk(body).status().code(), absl::StatusCode::kInvalidArgument) << count;
  }
  // Credits: a count the bytes cannot hold.
  std::string credits;
  ByteWriter(&credits).U32(0xffffffffu);
  EXPECT_FALSE(DecodeCredits(credits).ok());
  // Welcome: slot counts and sizes out of range, an unknown status.
  StagedWelcome w;
  w.ok = true;
  w.landing_descriptor = "d";
  for (auto [slots, bytes] : std::vector<std::pair<uint32_t, uint64_t>>{
           {0, kChunk}, {kMaxStagedSlots + 1, kChunk}, {4, 100}, {4, kChunk + 8}}) {
    w.slots = slots;
    w.slot_bytes = bytes;
    EXPECT_FALSE(DecodeWelcome(EncodeWelcome(w)).ok()) << slots << " " << bytes;
  }
  std::string unknown = EncodeWelcome(StagedWelcome{});
  unknown[0] = 7;
  EXPECT_FALSE(DecodeWelcome(unknown).ok());
}

TEST(UcxWireV2Test, DescriptorRoundTripsHostAndDevice) {
  UcxMemoryDescriptor host;
  host.kind = UcxRegionKind::kHost;
  host.address = 0x7f0000001000;
  host.length = 4096;
  host.rkey = "packed-rkey";
  auto h = DecodeMemoryDescriptor(EncodeMemoryDescriptor(host));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->kind, UcxRegionKind::kHost);
  EXPECT_EQ(h->address, host.address);
  EXPECT_EQ(h->length, 4096u);
  EXPECT_EQ(h->region_id, 0u);
  EXPECT_EQ(h->rkey, "packed-rkey");

  UcxMemoryDescriptor device;
  device.kind = UcxRegionKind::kDevice;
  device.address = 0x7e0000000000;
  device.length = uint64_t{1} << 30;
  device.region_id = 42;
  const std::string good = EncodeMemoryDescriptor(device);
  auto d = DecodeMemoryDescriptor(good);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->kind, UcxRegionKind::kDevice);
  EXPECT_EQ(d->region_id, 42u);
  EXPECT_TRUE(d->rkey.empty());
  ExpectTruncationsAndTrailingFail(good, DecodeMemoryDescriptor);
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x5a);
    EXPECT_EQ(DecodeMemoryDescriptor(bad).status().code(), absl::StatusCode::kInvalidArgument)
        << "flipped byte " << i;
  }
}

// A descriptor with arbitrary fields and a correct checksum (what a buggy or hostile peer
// could send), to reach the checks behind the checksum.
std::string RawDescriptor(uint8_t kind, uint8_t reserved, uint64_t length, uint64_t region_id,
                          const std::string& rkey) {
  std::string out;
  PutUcxPreamble(out, 0x4D555653);
  ByteWriter w(&out);
  w.U8(kind);
  w.U8(reserved);
  w.U16(0);
  w.U64(0x1000);
  w.U64(length);
  w.U64(region_id);
  w.U32(static_cast<uint32_t>(rkey.size()));
  w.Raw(rkey);
  const uint64_t sum = UcxChecksum(out);
  w.U64(sum);
  return out;
}

TEST(UcxWireV2Test, DescriptorKindMustMatchItsFields) {
  EXPECT_TRUE(DecodeMemoryDescriptor(RawDescriptor(1, 0, 64, 0, "k")).ok());
  EXPECT_TRUE(DecodeMemoryDescriptor(RawDescriptor(2, 0, 64, 5, "")).ok());
  struct Case {
    uint8_t kind, reserved;
    uint64_t length, region_id;
    std::string rkey;
    const char* why;
  };
  for (const Case& c : std::vector<Case>{
           {1, 0, 64, 0, "", "a host region needs an rkey"},
           {1, 0, 64, 3, "k", "a host region needs an rkey and region id 0"},
           {2, 0, 64, 5, "k", "a device region carries no rkey"},
           {2, 0, 64, 0, "", "a device region carries no rkey and a non-zero region id"},
           {3, 0, 64, 0, "k", "unknown memory kind 3"},
           {0, 0, 64, 0, "k", "unknown memory kind 0"},
           {1, 1, 64, 0, "k", "reserved"},
           {1, 0, 0, 0, "k", "bad region"},
       }) {
    auto r = DecodeMemoryDescriptor(RawDescriptor(c.kind, c.reserved, c.length, c.region_id, c.rkey));
    ASSERT_FALSE(r.ok()) << c.why;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr(c.why));
  }
}

TEST(UcxWireV2Test, NotificationHeaderCarriesTheWatermark) {
  const NotificationHeader header = EncodeNotificationHeader(0xabcdef, 5, 17);
  const std::string good(header.data(), header.size());
  auto fields = DecodeNotificationHeader(good);
  ASSERT_TRUE(fields.ok()) << fields.status();
  EXPECT_EQ(fields->sender_uid, 0xabcdefu);
  EXPECT_EQ(fields->stamp, 5u);
  EXPECT_EQ(fields->watermark, 17u);
  ExpectTruncationsAndTrailingFail(good, DecodeNotificationHeader);
  std::string old = good;
  old[4] = 1;
  EXPECT_THAT(DecodeNotificationHeader(old).status().message(), HasSubstr("version 1"));
}

}  // namespace
}  // namespace internal
}  // namespace kvstream
