// Tests of the nccl transport's batch planner (transfer/src/nccl/nccl_plan.h), with the whole
// protocol played on the host: the writer's plan gathers into a staging slot and cuts
// messages, each message travels as one byte string (what ncclSend/ncclRecv move), the
// header goes through the wire codec, and the receiver's plan receives in place or into its
// slot and scatters. The destination must then equal a direct copy of every segment, over
// random scattered writes of odd sizes, under small limits that force splits across
// batches, many messages and many pieces. Also: what moves in place on each side, the
// limits a batch keeps, refused limits, hostile headers at the receiver, and the copy
// kernel's table (pieces cut at max_piece).
#include "transfer/src/nccl/nccl_plan.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvstream/common/status_macros.h"
#include "transfer/src/nccl/nccl_wire.h"

namespace kvstream {
namespace internal {
namespace {

using ::testing::HasSubstr;

struct Sim {
  std::vector<char> src, dst, want;
  size_t gathers = 0, scatters = 0, in_place_sends = 0, in_place_receives = 0, batches = 0;
};

// Plays every batch of `segments` from sim.src into sim.dst; returns the first error.
absl::Status Play(Sim& sim, const std::vector<Segment>& segments, const NcclPlanLimits& writer,
                  uint64_t receiver_staging) {
  for (const Segment& s : segments) {
    std::memcpy(sim.want.data() + s.remote_offset, sim.src.data() + s.local_offset, s.length);
  }
  ASSIGN_OR_RETURN(std::vector<NcclSendBatch> batches, PlanNcclWrite(segments, writer));
  uint64_t serial = 0;
  for (NcclSendBatch& b : batches) {
    ++sim.batches;
    if (b.messages.size() > writer.max_messages || b.header.pieces.size() > writer.max_pieces ||
        b.staged_bytes > writer.staged_bytes) {
      return absl::InternalError("a batch breaks its limits");
    }
    std::vector<char> send_slot(writer.staged_bytes, '\0');
    if (!b.gather.empty()) ++sim.gathers;
    for (const Segment& g : b.gather) {
      std::memcpy(send_slot.data() + g.remote_offset, sim.src.data() + g.local_offset, g.length);
    }
    std::vector<std::string> wire;
    for (const NcclMessagePlace& m : b.messages) {
      const char* from = m.in_place ? sim.src.data() + m.offset : send_slot.data() + m.offset;
      sim.in_place_sends += m.in_place;
      wire.emplace_back(from, m.bytes);
    }
    b.header.serial = serial++;
    b.header.region_id = 1;
    ASSIGN_OR_RETURN(NcclBatchHeader header, DecodeNcclBatch(EncodeNcclBatch(b.header)));
    ASSIGN_OR_RETURN(NcclRecvBatch r, PlanNcclReceive(header, sim.dst.size(), receiver_staging));
    if (r.messages.size() != wire.size()) return absl::InternalError("message counts differ");
    std::vector<char> recv_slot(receiver_staging, '\0');
    for (size_t i = 0; i < wire.size(); ++i) {
      const NcclMessagePlace& m = r.messages[i];
      if (m.bytes != wire[i].size()) return absl::InternalError("message sizes differ");
      char* into = m.in_place ? sim.dst.data() + m.offset : recv_slot.data() + m.offset;
      sim.in_place_receives += m.in_place;
      std::memcpy(into, wire[i].data(), wire[i].size());
    }
    if (!r.scatter.empty()) ++sim.scatters;
    for (const Segment& s : r.scatter) {
      std::memcpy(sim.dst.data() + s.remote_offset, recv_slot.data() + s.local_offset, s.length);
    }
  }
  return absl::OkStatus();
}

Sim NewSim(size_t src_bytes, size_t dst_bytes, uint32_t seed) {
  Sim sim;
  std::mt19937 rng(seed);
  sim.src.resize(src_bytes);
  for (char& c : sim.src) c = static_cast<char>(1 + rng() % 255);
  sim.dst.assign(dst_bytes, '\0');
  sim.want = sim.dst;
  return sim;
}

// `count` blocks of `block` bytes between random distinct slots of both pools.
std::vector<Segment> Shuffled(size_t count, size_t block, size_t pool, uint32_t seed) {
  std::vector<uint64_t> a(pool), b(pool);
  std::iota(a.begin(), a.end(), 0);
  std::iota(b.begin(), b.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(a.begin(), a.end(), rng);
  std::shuffle(b.begin(), b.end(), rng);
  std::vector<Segment> out;
  for (size_t i = 0; i < count; ++i) out.push_back({a[i] * block, b[i] * block, block});
  return out;
}

NcclPlanLimits Limits(uint64_t staged, uint64_t in_place_min) {
  NcclPlanLimits l;
  l.staged_bytes = staged;
  l.in_place_min_bytes = in_place_min;
  return l;
}

TEST(NcclPlanTest, ScatteredBlocksArriveExactly) {
  for (size_t block : {16u, 4096u, 32768u}) {
    Sim sim = NewSim(block * 300, block * 300, static_cast<uint32_t>(block));
    const std::vector<Segment> segs = Shuffled(257, block, 300, 3);
    ASSERT_TRUE(Play(sim, segs, Limits(1 << 20, 1 << 20), 1 << 20).ok());
    EXPECT_EQ(sim.dst, sim.want) << "block " << block;
    EXPECT_GT(sim.gathers, 0u);
    EXPECT_GT(sim.scatters, 0u);
  }
}

TEST(NcclPlanTest, RandomWritesOfOddSizesUnderSmallLimitsArriveExactly) {
  std::mt19937 rng(11);
  for (int round = 0; round < 200; ++round) {
    const size_t area = 1 + rng() % 5000;  // bytes per destination slot
    const size_t count = 1 + rng() % 64;
    Sim sim = NewSim(area * count + 1000, area * count + 1000, static_cast<uint32_t>(round));
    std::vector<Segment> segs;
    for (size_t i = 0; i < count; ++i) {
      const uint64_t len = rng() % (area + 1);  // empty segments too
      const uint64_t dst = i * area + rng() % (area - len + 1);
      const uint64_t src = rng() % (sim.src.size() - len + 1);
      segs.push_back({src, dst, len});
    }
    NcclPlanLimits l = Limits(64 + rng() % 4096, 0);
    l.in_place_min_bytes = 1 + rng() % l.staged_bytes;
    l.max_messages = 1 + rng() % 5;
    l.max_pieces = 1 + rng() % 7;
    const uint64_t receiver = l.staged_bytes + rng() % 100;
    absl::Status played = Play(sim, segs, l, receiver);
    ASSERT_TRUE(played.ok()) << played << " round " << round;
    ASSERT_EQ(sim.dst, sim.want) << "round " << round;
  }
}

TEST(NcclPlanTest, ContiguousRunsAreCoalescedAndMoveInPlace) {
  // 64 blocks contiguous on both sides: one run, one message, nothing staged.
  Sim sim = NewSim(1 << 20, 1 << 20, 1);
  std::vector<Segment> segs;
  for (uint64_t i = 0; i < 64; ++i) segs.push_back({4096 * i, 65536 + 4096 * i, 4096});
  auto batches = PlanNcclWrite(segs, Limits(1 << 20, 64 << 10));
  ASSERT_TRUE(batches.ok());
  ASSERT_EQ(batches->size(), 1u);
  ASSERT_EQ((*batches)[0].messages.size(), 1u);
  EXPECT_TRUE((*batches)[0].messages[0].in_place);
  EXPECT_EQ((*batches)[0].messages[0].bytes, 64u * 4096);
  EXPECT_TRUE((*batches)[0].gather.empty());
  ASSERT_TRUE(Play(sim, segs, Limits(1 << 20, 64 << 10), 1 << 20).ok());
  EXPECT_EQ(sim.dst, sim.want);
  EXPECT_EQ(sim.in_place_receives, 1u);
  EXPECT_EQ(sim.scatters, 0u);
}

TEST(NcclPlanTest, EachSideMovesInPlaceWhatIsOneRangeOnIt) {
  // Scattered locally, contiguous remotely: gathered, received in place.
  std::vector<Segment> gather_only;
  for (uint64_t i = 0; i < 8; ++i) gather_only.push_back({(7 - i) * 1000, i * 1000, 1000});
  Sim a = NewSim(8000, 8000, 2);
  ASSERT_TRUE(Play(a, gather_only, Limits(1 << 20, 1 << 20), 1 << 20).ok());
  EXPECT_EQ(a.dst, a.want);
  EXPECT_EQ(a.gathers, 1u);
  EXPECT_EQ(a.in_place_receives, 1u);
  EXPECT_EQ(a.scatters, 0u);
  // Contiguous locally, scattered remotely: sent in place, scattered.
  std::vector<Segment> scatter_only;
  for (uint64_t i = 0; i < 8; ++i) scatter_only.push_back({i * 1000, (7 - i) * 1000, 1000});
  Sim b = NewSim(8000, 8000, 3);
  ASSERT_TRUE(Play(b, scatter_only, Limits(1 << 20, 1 << 20), 1 << 20).ok());
  EXPECT_EQ(b.dst, b.want);
  EXPECT_EQ(b.gathers, 0u);
  EXPECT_EQ(b.in_place_sends, 1u);
  EXPECT_EQ(b.scatters, 1u);
}

TEST(NcclPlanTest, LongRunsAreMessagesOfTheirOwnAndShortOnesArePacked) {
  std::vector<Segment> segs = {{0, 0, 100}, {1000, 5000, 9000}, {200, 300, 50}};
  auto batches = PlanNcclWrite(segs, Limits(4096, 4096));
  ASSERT_TRUE(batches.ok());
  ASSERT_EQ(batches->size(), 1u);
  const NcclSendBatch& b = (*batches)[0];
  ASSERT_EQ(b.messages.size(), 2u);
  EXPECT_TRUE(b.messages[0].in_place);  // the 9000-byte run, longer than a slot
  EXPECT_EQ(b.messages[0].bytes, 9000u);
  EXPECT_FALSE(b.messages[1].in_place);  // the two short ones, packed last
  EXPECT_EQ(b.messages[1].bytes, 150u);
  EXPECT_EQ(b.staged_bytes, 150u);
  EXPECT_EQ(b.header.message_pieces, (std::vector<uint32_t>{1, 2}));
}

TEST(NcclPlanTest, ASlotFullSplitsARunAcrossBatches) {
  std::vector<Segment> segs = {{0, 0, 3000}, {10000, 20000, 3000}};
  auto batches = PlanNcclWrite(segs, Limits(4096, 4096));
  ASSERT_TRUE(batches.ok());
  ASSERT_EQ(batches->size(), 2u);
  EXPECT_EQ((*batches)[0].staged_bytes, 4096u);
  EXPECT_EQ((*batches)[1].messages[0].bytes, 3000u - (4096u - 3000u));
  Sim sim = NewSim(20000, 30000, 5);
  ASSERT_TRUE(Play(sim, segs, Limits(4096, 4096), 4096).ok());
  EXPECT_EQ(sim.dst, sim.want);
}

TEST(NcclPlanTest, EmptyWritesHaveNoBatch) {
  auto none = PlanNcclWrite({}, Limits(4096, 1024));
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  auto empties = PlanNcclWrite(std::vector<Segment>{{0, 0, 0}, {5, 5, 0}}, Limits(4096, 1024));
  ASSERT_TRUE(empties.ok());
  EXPECT_TRUE(empties->empty());
}

TEST(NcclPlanTest, LimitsOutOfRangeAreRefused) {
  std::vector<NcclPlanLimits> bad = {Limits(0, 1), Limits(4096, 0), Limits(4096, 4097)};
  bad.push_back(Limits(4096, 1024));
  bad.back().max_messages = 0;
  bad.push_back(Limits(4096, 1024));
  bad.back().max_pieces = kMaxNcclPiecesPerBatch + 1;
  for (const NcclPlanLimits& l : bad) {
    EXPECT_EQ(PlanNcclWrite(std::vector<Segment>{{0, 0, 1}}, l).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(NcclPlanTest, TheReceiverChecksEveryPieceAndItsStaging) {
  NcclBatchHeader h;
  h.serial = 9;
  h.region_id = 1;
  h.message_pieces = {2};
  h.pieces = {{0, 100}, {500, 100}};
  EXPECT_TRUE(PlanNcclReceive(h, 600, 200).ok());
  // A piece past the region's end, or one whose end overflows.
  auto outside = PlanNcclReceive(h, 599, 200);
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(outside.status().message(), HasSubstr("piece 1"));
  h.pieces[1] = {~uint64_t{0} - 10, 100};
  EXPECT_EQ(PlanNcclReceive(h, 600, 200).status().code(), absl::StatusCode::kOutOfRange);
  // More to scatter than the receiver's slot (a writer that ignored the welcome).
  h.pieces[1] = {500, 100};
  auto big = PlanNcclReceive(h, 600, 199);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  // Headers whose counts disagree (built by hand, not through the decoder).
  h.message_pieces = {3};
  EXPECT_FALSE(PlanNcclReceive(h, 600, 200).ok());
  h.message_pieces = {1};
  EXPECT_FALSE(PlanNcclReceive(h, 600, 200).ok());
}

TEST(NcclPlanTest, CopyTablesCutLongPieces) {
  const std::vector<Segment> segs = {{0, 100, 10}, {1000, 0, 4096 * 3 + 1}};
  EXPECT_EQ(CountCopyEntries(segs, 4096), 1u + 4u);
  std::vector<IpcCopySegment> table(5);
  std::vector<char> src(20000), dst(20000);
  ASSERT_EQ(FillCopyEntries(segs, src.data(), dst.data(), 4096, table.data()), 5u);
  EXPECT_EQ(table[0].src, reinterpret_cast<uint64_t>(src.data()));
  EXPECT_EQ(table[0].dst, reinterpret_cast<uint64_t>(dst.data() + 100));
  EXPECT_EQ(table[0].length, 10u);
  uint64_t total = 0;
  for (size_t i = 1; i < 5; ++i) {
    EXPECT_EQ(table[i].src, reinterpret_cast<uint64_t>(src.data() + 1000 + total));
    EXPECT_EQ(table[i].dst, reinterpret_cast<uint64_t>(dst.data() + total));
    EXPECT_LE(table[i].length, 4096u);
    total += table[i].length;
  }
  EXPECT_EQ(total, 4096u * 3 + 1);
}

}  // namespace
}  // namespace internal
}  // namespace kvstream
