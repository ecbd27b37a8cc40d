// Tests of host writes sent as active messages over TCP (transfer/src/ucx/am_writes.h),
// inside one process over loopback: segments longer than a piece, at odd offsets and sizes,
// land byte for byte before their notification with either write protocol and with UCX's
// small default TCP segments (pieces then span several fragments); a piece whose
// destination is no longer registered at the receiver is dropped, not written, and so is
// what a sender the receiver disconnected from writes until it accepts (or connects to) it
// again and the sender connected with its new info; Accept names the peer its notifications come from; the write header decodes
// strictly.
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvstream/transfer/transport.h"
#include "kvstream/transfer/ucx_transport.h"
#include "ucx/am_writes.h"
#include "ucx/ucx_setup.h"
#include "ucx/ucx_wire.h"

namespace kvstream {
namespace internal {
namespace {

constexpr size_t kBytes = size_t{3} << 20;

struct Protocol {
  const char* name;
  UcxWriteProtocol protocol;
  bool small_segments;  // UCX's 8 KiB TCP segments instead of kvstream's 256 KiB
};

std::unique_ptr<Transport> MakeTcp(const Protocol& p) {
  UcxTransportOptions options;
  options.tls = "tcp";
  options.net_devices = "lo";
  options.write_protocol = p.protocol;
  if (p.small_segments) options.ucx_config = {{"TX_SEG_SIZE", "8k"}, {"RX_SEG_SIZE", "8k"}};
  auto t = CreateUcxTransport(options);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(t).value() : nullptr;
}

class UcxWritePiecesTest : public ::testing::TestWithParam<Protocol> {
 protected:
  void SetUp() override {
    p_ = MakeTcp(GetParam());
    d_ = MakeTcp(GetParam());
    ASSERT_NE(p_, nullptr);
    ASSERT_NE(d_, nullptr);
    src_.resize(kBytes);
    dst_.assign(kBytes, 0);
    std::mt19937 rng(77);
    for (char& c : src_) c = static_cast<char>(1 + rng() % 255);
    auto src = p_->RegisterMemory(src_.data(), src_.size(), MemoryKind::kHost);
    auto dst = d_->RegisterMemory(dst_.data(), dst_.size(), MemoryKind::kHost);
    ASSERT_TRUE(src.ok() && dst.ok());
    src_reg_ = std::move(src).value();
    dst_reg_ = std::move(dst).value();
    auto peer = p_->Connect(*d_->LocalInfo());
    ASSERT_TRUE(peer.ok()) << peer.status();
    to_d_ = *peer;
    auto remote = p_->ImportRemote(to_d_, dst_reg_->descriptor());
    ASSERT_TRUE(remote.ok()) << remote.status();
    remote_ = std::move(remote).value();
  }

  void TearDown() override {
    remote_.reset();
    src_reg_.reset();
    dst_reg_.reset();
  }

  // Progresses both sides until a notification arrives at d (empty on timeout).
  // Both sides progress until the sender is done with `id` (the receiver must read for the
  // last pieces to leave), then a bounded number of turns more for what is still in the
  // sockets; no notification may reach the receiver meanwhile.
  void ExpectDropped(TransferId id, const char* whose) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    absl::StatusOr<TransferState> state = TransferState::kInProgress;
    for (int turns_after = 0; turns_after < 2000;) {
      ASSERT_TRUE(p_->Progress().ok());
      ASSERT_TRUE(d_->Progress().ok());
      ASSERT_TRUE(d_->PollNotifications().empty()) << whose << " notification came";
      if (state.ok() && *state == TransferState::kInProgress) {
        ASSERT_LT(absl::Now(), deadline) << "the sender's write did not finish";
        state = p_->Test(id);
      } else {
        ASSERT_TRUE(state.ok()) << state.status();
        ASSERT_EQ(*state, TransferState::kDone);
        ++turns_after;
      }
    }
  }

  std::vector<Notification> WaitForNotification() {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline) {
      EXPECT_TRUE(p_->Progress().ok());
      EXPECT_TRUE(d_->Progress().ok());
      std::vector<Notification> notes = d_->PollNotifications();
      if (!notes.empty()) return notes;
    }
    return {};
  }

  std::unique_ptr<Transport> p_, d_;
  std::vector<char> src_, dst_;
  std::unique_ptr<MemoryRegistration> src_reg_, dst_reg_;
  std::unique_ptr<RemoteMemory> remote_;
  PeerId to_d_ = 0;
};

TEST_P(UcxWritePiecesTest, LongAndOddSegmentsLandBeforeTheirNotification) {
  // A piece exactly, one byte more and less, several pieces with a tail, a few bytes, all
  // at odd offsets, in both orders of local and remote.
  const std::vector<Segment> segments = {
      {1, 3, kWriteMessageBytes},
      {kWriteMessageBytes + 11, kWriteMessageBytes + 5, kWriteMessageBytes + 1},
      {2 * kWriteMessageBytes + 100, 2 * kWriteMessageBytes + 37, kWriteMessageBytes - 1},
      {1 << 20, (2 << 20) - 13, (1 << 20) / 2 + 7},
      {(2 << 20) + 1, (1 << 20) + 3, (5 * kWriteMessageBytes) / 2 + 1},
      {kBytes - 7, kBytes - 7, 7},
  };
  std::vector<char> expected(kBytes, 0);
  for (const Segment& s : segments) {
    std::memcpy(expected.data() + s.remote_offset, src_.data() + s.local_offset, s.length);
  }
  auto id = p_->PostWrite(to_d_, *src_reg_, *remote_, segments, "odd");
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<Notification> notes = WaitForNotification();
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].payload, "odd");
  EXPECT_TRUE(dst_ == expected) << "the notification came before its data";
  auto state = WaitForTransfer(*p_, *id, absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(*state, TransferState::kDone);
  p_->Release(*id);
}

// Only kvstream's own pieces can be checked at the receiver (an emulated put writes
// wherever its address says).
TEST_P(UcxWritePiecesTest, PiecesIntoMemoryNoLongerRegisteredAreDropped) {
  if (GetParam().protocol != UcxWriteProtocol::kActiveMessage) {
    GTEST_SKIP() << "emulated puts are not checked at the receiver";
  }
  // Wired up first (the handshake needs both sides), then d stops progressing.
  auto warm = p_->PostNotification(to_d_, "warm-up");
  ASSERT_TRUE(warm.ok()) << warm.status();
  ASSERT_EQ(WaitForNotification().size(), 1u);
  // Posted while d still has the region; d deregisters it before it handles the pieces.
  auto id = p_->PostWrite(to_d_, *src_reg_, *remote_, {Segment{0, 0, kBytes}}, "late");
  ASSERT_TRUE(id.ok()) << id.status();
  remote_.reset();
  dst_reg_.reset();
  std::vector<Notification> notes = WaitForNotification();
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].payload, "late");
  EXPECT_TRUE(dst_ == std::vector<char>(kBytes, 0)) << "a piece landed in deregistered memory";
}

// The receiver gives the sender up (Disconnect on the peer Accept named, which its
// notifications come from): what the sender writes afterwards, data and notification, is
// dropped; once the receiver accepts it again, what the sender still sends under its old
// connection (as a TCP stream still holding a given-up request's pieces would deliver them)
// stays dropped, and its writes land again once it connected with the receiver's info
// from after the fence (its new fence epoch).
TEST_P(UcxWritePiecesTest, DisconnectedSendersWritesAreRefusedUntilAcceptedAgain) {
  if (GetParam().protocol != UcxWriteProtocol::kActiveMessage) {
    GTEST_SKIP() << "emulated puts are not checked at the receiver";
  }
  auto warm = p_->PostNotification(to_d_, "warm-up");
  ASSERT_TRUE(warm.ok()) << warm.status();
  std::vector<Notification> notes = WaitForNotification();
  ASSERT_EQ(notes.size(), 1u);
  auto from_p = d_->Accept(*p_->LocalInfo());
  ASSERT_TRUE(from_p.ok()) << from_p.status();
  EXPECT_EQ(*from_p, notes[0].peer) << "Accept names another peer than the notifications";
  ASSERT_TRUE(d_->Disconnect(*from_p).ok());

  const Segment first{0, 0, kBytes / 2};
  auto refused = p_->PostWrite(to_d_, *src_reg_, *remote_, {first}, "refused");
  ASSERT_TRUE(refused.ok()) << refused.status();
  ASSERT_NO_FATAL_FAILURE(ExpectDropped(*refused, "a refused sender's"));
  auto back = d_->Accept(*p_->LocalInfo());
  ASSERT_TRUE(back.ok()) << back.status();
  // Accepted again, but not yet connected with the receiver's new info: still dropped.
  const Segment stale{kBytes / 4, kBytes / 4, kBytes / 4};
  auto old_stream = p_->PostWrite(to_d_, *src_reg_, *remote_, {stale}, "stale");
  ASSERT_TRUE(old_stream.ok()) << old_stream.status();
  ASSERT_NO_FATAL_FAILURE(ExpectDropped(*old_stream, "a stale write's"));
  EXPECT_TRUE(dst_ == std::vector<char>(kBytes, 0))
      << "what the sender wrote before it connected with the receiver's new info landed";
  auto reconnected = p_->Connect(*d_->LocalInfo());
  ASSERT_TRUE(reconnected.ok()) << reconnected.status();
  EXPECT_EQ(*reconnected, to_d_);
  const Segment second{kBytes / 2, kBytes / 2, kBytes / 2};
  auto accepted = p_->PostWrite(to_d_, *src_reg_, *remote_, {second}, "accepted");
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  notes = WaitForNotification();
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].payload, "accepted");
  EXPECT_EQ(notes[0].peer, *back);
  std::vector<char> expected(kBytes, 0);
  std::memcpy(expected.data() + kBytes / 2, src_.data() + kBytes / 2, kBytes / 2);
  EXPECT_TRUE(dst_ == expected) << "refused data landed, or accepted data did not";
}

// Connect lifts the fence as Accept does (once the sender connected with the receiver's
// info from after it).
TEST_P(UcxWritePiecesTest, ConnectingBackAlsoLiftsTheFence) {
  if (GetParam().protocol != UcxWriteProtocol::kActiveMessage) {
    GTEST_SKIP() << "emulated puts are not checked at the receiver";
  }
  auto from_p = d_->Accept(*p_->LocalInfo());
  ASSERT_TRUE(from_p.ok()) << from_p.status();
  const std::string before = *d_->LocalInfo();
  ASSERT_TRUE(d_->Disconnect(*from_p).ok());
  EXPECT_NE(*d_->LocalInfo(), before) << "the fence epoch did not change the receiver's info";
  auto back = d_->Connect(*p_->LocalInfo());
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_TRUE(p_->Connect(*d_->LocalInfo()).ok());
  auto id = p_->PostWrite(to_d_, *src_reg_, *remote_, {Segment{0, 0, kBytes}}, "after");
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<Notification> notes = WaitForNotification();
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].payload, "after");
  EXPECT_TRUE(dst_ == src_) << "the writes of a peer connected to again did not land";
}

INSTANTIATE_TEST_SUITE_P(
    Protocols, UcxWritePiecesTest,
    ::testing::Values(Protocol{"pieces", UcxWriteProtocol::kActiveMessage, false},
                      Protocol{"pieces_small_segments", UcxWriteProtocol::kActiveMessage, true},
                      Protocol{"puts", UcxWriteProtocol::kPut, false}),
    [](const ::testing::TestParamInfo<Protocol>& param) { return param.param.name; });

// Accept before any traffic: the id the peer's notifications will carry; this transport's
// own info and malformed info are refused.
TEST(UcxAcceptTest, NamesThePeerBeforeItsFirstNotification) {
  const Protocol pieces{"pieces", UcxWriteProtocol::kActiveMessage, false};
  std::unique_ptr<Transport> p = MakeTcp(pieces), d = MakeTcp(pieces);
  ASSERT_TRUE(p != nullptr && d != nullptr);
  auto from_p = d->Accept(*p->LocalInfo());
  ASSERT_TRUE(from_p.ok()) << from_p.status();
  auto again = d->Accept(*p->LocalInfo());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *from_p) << "one peer, two ids";
  auto to_d = p->Connect(*d->LocalInfo());
  ASSERT_TRUE(to_d.ok()) << to_d.status();
  ASSERT_TRUE(p->PostNotification(*to_d, "hello").ok());
  std::vector<Notification> notes;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (notes.empty() && absl::Now() < deadline) {
    ASSERT_TRUE(p->Progress().ok());
    ASSERT_TRUE(d->Progress().ok());
    notes = d->PollNotifications();
  }
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].peer, *from_p);
  EXPECT_EQ(d->Accept(*d->LocalInfo()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(d->Accept("not ucx info").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(UcxWriteProtocolTest, AutoMeansPiecesWhereUcxOnlyEmulatesPuts) {
  UcxTransportOptions options;
  for (const char* tls : {"tcp", "tcp,self", "self,tcp"}) {
    options.tls = tls;
    EXPECT_TRUE(UsesActiveMessageWrites(options)) << tls;
  }
  for (const char* tls : {"shm", "sm,self", "tcp,sm,self", "all", "^ib", "rc,tcp", "self"}) {
    options.tls = tls;
    EXPECT_FALSE(UsesActiveMessageWrites(options)) << tls;
  }
  options.tls = "tcp";
  options.write_protocol = UcxWriteProtocol::kPut;
  EXPECT_FALSE(UsesActiveMessageWrites(options));
  options.tls = "shm";
  options.write_protocol = UcxWriteProtocol::kActiveMessage;
  EXPECT_TRUE(UsesActiveMessageWrites(options));
}

TEST(UcxWriteHeaderTest, RoundTripsAndDecodesStrictly) {
  const WriteHeader header = EncodeWriteHeader(0x1122334455667788u, 7, 0xdeadbeef00u);
  const std::string bytes(header.data(), header.size());
  auto fields = DecodeWriteHeader(bytes);
  ASSERT_TRUE(fields.ok()) << fields.status();
  EXPECT_EQ(fields->sender_uid, 0x1122334455667788u);
  EXPECT_EQ(fields->stamp, 7u);
  EXPECT_EQ(fields->address, 0xdeadbeef00u);
  // Short, long, another message's magic, another version, a reserved field set.
  EXPECT_FALSE(DecodeWriteHeader(bytes.substr(0, bytes.size() - 1)).ok());
  EXPECT_FALSE(DecodeWriteHeader(bytes + "x").ok());
  const NotificationHeader note = EncodeNotificationHeader(1, 2, 3);
  EXPECT_FALSE(DecodeWriteHeader(std::string(note.data(), note.size())).ok());
  for (size_t at : {4, 6}) {
    std::string bad = bytes;
    bad[at] = static_cast<char>(bad[at] + 1);
    EXPECT_FALSE(DecodeWriteHeader(bad).ok()) << "byte " << at;
  }
}

}  // namespace
}  // namespace internal
}  // namespace kvstream
