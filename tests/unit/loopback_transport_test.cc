// Tests of transfer/loopback_transport.h: data lands only inside Progress(), notifications
// after their data, bounds and lookup errors, FailEndpoint, cancel/release/disconnect, many
// transfers, and concurrent use.
#include "kvstream/transfer/loopback_transport.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/shuffled_slots.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {
namespace {

using ::testing::HasSubstr;

constexpr size_t kBlock = 256;
constexpr size_t kBlocks = 64;
constexpr size_t kBytes = kBlock * kBlocks;

absl::Time Deadline() { return absl::Now() + absl::Seconds(30); }

// Two transports on one fabric, "p" writing into "d", each with a registered buffer and the
// other's region imported.
class LoopbackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    p_ = Make("p");
    d_ = Make("d");
    src_.resize(kBytes);
    dst_.assign(kBytes, 0);
    for (size_t i = 0; i < kBytes; ++i) src_[i] = static_cast<char>(1 + i % 251);
    src_reg_ = Register(*p_, src_);
    dst_reg_ = Register(*d_, dst_);
    auto d_info = d_->LocalInfo();
    ASSERT_TRUE(d_info.ok()) << d_info.status();
    auto peer = p_->Connect(*d_info);
    ASSERT_TRUE(peer.ok()) << peer.status();
    to_d_ = *peer;
    auto remote = p_->ImportRemote(to_d_, dst_reg_->descriptor());
    ASSERT_TRUE(remote.ok()) << remote.status();
    remote_ = std::move(remote).value();
  }

  std::unique_ptr<Transport> Make(const std::string& name) {
    auto t = fabric_.CreateTransport(name);
    EXPECT_TRUE(t.ok()) << t.status();
    return std::move(t).value();
  }

  static std::unique_ptr<MemoryRegistration> Register(Transport& t, std::vector<char>& buffer) {
    auto reg = t.RegisterMemory(buffer.data(), buffer.size(), MemoryKind::kHost);
    EXPECT_TRUE(reg.ok()) << reg.status();
    return std::move(reg).value();
  }

  // Block i of the source to block perm[i] of the destination, for `count` blocks.
  static std::vector<Segment> Scattered(size_t count, uint32_t seed) {
    const testing_util::SlotPermutations slots =
        testing_util::ShuffledSlots(kBlocks, kBlocks, seed);
    std::vector<Segment> segments;
    for (size_t i = 0; i < count; ++i) {
      Segment s;
      s.local_offset = slots.src[i] * kBlock;
      s.remote_offset = slots.dst[i] * kBlock;
      s.length = kBlock;
      segments.push_back(s);
    }
    return segments;
  }

  // The destination as it must be after `segments` landed on a zeroed buffer.
  std::vector<char> Expected(const std::vector<Segment>& segments) const {
    std::vector<char> expected(kBytes, 0);
    for (const Segment& s : segments) {
      std::memcpy(expected.data() + s.remote_offset, src_.data() + s.local_offset, s.length);
    }
    return expected;
  }

  TransferId Post(const std::vector<Segment>& segments, const std::string& note) {
    auto id = p_->PostWrite(to_d_, *src_reg_, *remote_, segments, note);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : 0;
  }

  LoopbackFabric fabric_;
  std::unique_ptr<Transport> p_, d_;
  std::vector<char> src_, dst_;
  std::unique_ptr<MemoryRegistration> src_reg_, dst_reg_;
  std::unique_ptr<RemoteMemory> remote_;
  PeerId to_d_ = 0;
};

TEST_F(LoopbackTest, CapabilitiesAndName) {
  EXPECT_EQ(p_->name(), "loopback");
  TransportCapabilities caps = p_->capabilities();
  EXPECT_TRUE(caps.one_sided_write);
  EXPECT_TRUE(caps.notifications);
  EXPECT_TRUE(caps.host_memory);
  EXPECT_FALSE(caps.device_memory);
  EXPECT_FALSE(caps.inter_process);
}

TEST_F(LoopbackTest, ScatteredSegmentsLandOnlyInsideProgress) {
  std::vector<Segment> segments = Scattered(kBlocks / 2, 7);
  TransferId id = Post(segments, "");
  auto state = p_->Test(id);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(*state, TransferState::kInProgress);
  EXPECT_EQ(dst_, std::vector<char>(kBytes, 0)) << "data landed before Progress()";
  // The receiver's progress does not move the sender's transfers.
  ASSERT_TRUE(d_->Progress().ok());
  EXPECT_EQ(dst_, std::vector<char>(kBytes, 0));

  auto done = WaitForTransfer(*p_, id, Deadline());
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(*done, TransferState::kDone);
  EXPECT_EQ(dst_, Expected(segments));
}

TEST_F(LoopbackTest, NotificationArrivesWithItsDataInPlace) {
  std::vector<Segment> segments = Scattered(kBlocks, 11);
  TransferId id = Post(segments, "layer 0");
  EXPECT_TRUE(d_->PollNotifications().empty());
  ASSERT_TRUE(p_->Progress().ok());
  std::vector<Notification> notes = d_->PollNotifications();
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].payload, "layer 0");
  EXPECT_EQ(dst_, Expected(segments)) << "the notification arrived before its data";
  EXPECT_TRUE(d_->PollNotifications().empty()) << "PollNotifications must clear";
  EXPECT_EQ(*p_->Test(id), TransferState::kDone);

  // The receiver names the sender with the id it gets by connecting to it.
  auto to_p = d_->Connect(*p_->LocalInfo());
  ASSERT_TRUE(to_p.ok()) << to_p.status();
  EXPECT_EQ(notes[0].peer, *to_p);
}

TEST_F(LoopbackTest, NotificationFromAPeerNeverConnectedBack) {
  ASSERT_TRUE(p_->PostNotification(to_d_, "hello").ok());
  ASSERT_TRUE(p_->Progress().ok());
  std::vector<Notification> notes = d_->PollNotifications();
  ASSERT_EQ(notes.size(), 1u);
  const PeerId sender = notes[0].peer;
  EXPECT_TRUE(d_->PeerStatus(sender).ok());
  // Known, but with no connection: posting to it is a precondition error.
  auto post = d_->PostNotification(sender, "back");
  EXPECT_EQ(post.status().code(), absl::StatusCode::kFailedPrecondition) << post.status();
  auto connected = d_->Connect(*p_->LocalInfo());
  ASSERT_TRUE(connected.ok());
  EXPECT_EQ(*connected, sender);
  EXPECT_TRUE(d_->PostNotification(sender, "back").ok());
}

TEST_F(LoopbackTest, ManyTransfersCompleteWithNotificationsInOrder) {
  constexpr int kTransfers = 500;
  std::vector<TransferId> ids;
  std::vector<Segment> all;
  for (int i = 0; i < kTransfers; ++i) {
    Segment s;
    s.local_offset = (i % kBlocks) * kBlock;
    s.remote_offset = ((i * 7) % kBlocks) * kBlock;
    s.length = kBlock;
    all.push_back(s);
    ids.push_back(Post({s}, absl::StrCat("n", i)));
  }
  for (TransferId id : ids) {
    auto state = WaitForTransfer(*p_, id, Deadline());
    ASSERT_TRUE(state.ok()) << state.status();
    p_->Release(id);
  }
  std::vector<Notification> notes = d_->PollNotifications();
  ASSERT_EQ(notes.size(), static_cast<size_t>(kTransfers));
  for (int i = 0; i < kTransfers; ++i) EXPECT_EQ(notes[i].payload, absl::StrCat("n", i));
  // Later writes to the same block win, as they were posted in order.
  EXPECT_EQ(dst_, Expected(all));
  for (TransferId id : ids) {
    EXPECT_EQ(p_->Test(id).status().code(), absl::StatusCode::kNotFound);
  }
}

TEST_F(LoopbackTest, OutOfRangeSegmentsPostNothing) {
  const uint64_t kMax = UINT64_MAX;
  const std::vector<std::vector<Segment>> bad = {
      {{0, 0, kBytes + 1}},                  // longer than both regions
      {{kBytes - 8, 0, 16}},                 // past the local end
      {{0, kBytes - 8, 16}},                 // past the remote end
      {{kMax - 4, 0, 16}},                   // offset + length overflows
      {{0, kMax, 1}},                        // remote offset far outside
      {{0, 0, kBlock}, {0, kBytes, 1}},      // the second segment is bad: nothing posts
  };
  for (const auto& segments : bad) {
    auto id = p_->PostWrite(to_d_, *src_reg_, *remote_, segments, "bad");
    ASSERT_FALSE(id.ok());
    EXPECT_EQ(id.status().code(), absl::StatusCode::kOutOfRange) << id.status();
  }
  ASSERT_TRUE(p_->Progress().ok());
  EXPECT_EQ(dst_, std::vector<char>(kBytes, 0));
  EXPECT_TRUE(d_->PollNotifications().empty());
  // Exactly at the ends is fine, and so is an empty segment at the end.
  std::vector<Segment> edge = {{kBytes - kBlock, kBytes - kBlock, kBlock}, {kBytes, kBytes, 0}};
  auto ok = WaitForTransfer(*p_, Post(edge, ""), Deadline());
  EXPECT_TRUE(ok.ok()) << ok.status();
}

TEST_F(LoopbackTest, GpuOrderingIsRefusedByAHostTransport) {
  std::vector<Segment> one = {{0, 0, kBlock}};
  int not_an_event = 0;
  WriteOrder with_event;
  with_event.ready_event = &not_an_event;
  auto id = p_->PostWrite(to_d_, *src_reg_, *remote_, one, "n", with_event);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << id.status();
  const uint64_t tail = 7;
  WriteOrder with_tail;
  with_tail.notification_tail = &tail;
  with_tail.notification_tail_bytes = sizeof(tail);
  EXPECT_EQ(p_->PostWrite(to_d_, *src_reg_, *remote_, one, "n", with_tail).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(p_->Progress().ok());
  EXPECT_EQ(dst_, std::vector<char>(kBytes, 0));
}

TEST_F(LoopbackTest, UnknownPeersTransfersAndMalformedInput) {
  const PeerId kNoPeer = 999;
  // Remote memory imported from another peer than the one named.
  EXPECT_EQ(p_->PostWrite(kNoPeer, *src_reg_, *remote_, {}, "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p_->PostNotification(kNoPeer, "x").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(p_->PostNotification(to_d_, "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p_->ImportRemote(kNoPeer, dst_reg_->descriptor()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(p_->PeerStatus(kNoPeer).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(p_->Disconnect(kNoPeer).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(p_->Test(12345).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(p_->Cancel(12345).code(), absl::StatusCode::kNotFound);
  p_->Release(12345);  // harmless

  for (const char* info : {"", "garbage", "kvstream-loopback:1:x:d", "kvstream-loopback:9:2:d"}) {
    EXPECT_EQ(p_->Connect(info).status().code(), absl::StatusCode::kInvalidArgument) << info;
  }
  EXPECT_EQ(p_->Connect("kvstream-loopback:1:4242:ghost").status().code(),
            absl::StatusCode::kNotFound);
  const std::string& good = dst_reg_->descriptor();
  for (const std::string& descriptor :
       {std::string(), std::string("junk"), good.substr(0, good.size() - 1), good + ":1",
        std::string("kvstream-loopback-mem:2:1:1:1")}) {
    EXPECT_EQ(p_->ImportRemote(to_d_, descriptor).status().code(),
              absl::StatusCode::kInvalidArgument)
        << descriptor;
  }
  // A descriptor of p's own memory is not one of d's regions.
  EXPECT_EQ(p_->ImportRemote(to_d_, src_reg_->descriptor()).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Registrations and remote memory of another transport are rejected.
  EXPECT_EQ(p_->PostWrite(to_d_, *dst_reg_, *remote_, {}, "x").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(LoopbackTest, RegisterMemoryRejectsBadRanges) {
  char byte = 0;
  EXPECT_EQ(p_->RegisterMemory(nullptr, 8, MemoryKind::kHost).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p_->RegisterMemory(&byte, 0, MemoryKind::kHost).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p_->RegisterMemory(&byte, 1, MemoryKind::kDevice).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(LoopbackTest, AllocateMemoryIsZeroedAlignedAndRejectsBadArguments) {
  for (size_t length : {size_t{1}, size_t{100}, size_t{4096}, size_t{1} << 20}) {
    auto reg = p_->AllocateMemory(length, MemoryKind::kHost);
    ASSERT_TRUE(reg.ok()) << reg.status();
    EXPECT_EQ((*reg)->length(), length);
    EXPECT_EQ((*reg)->memory_kind(), MemoryKind::kHost);
    EXPECT_EQ(reinterpret_cast<uintptr_t>((*reg)->base()) % kMinAllocationAlignment, 0u);
    const char* data = static_cast<const char*>((*reg)->base());
    EXPECT_TRUE(std::all_of(data, data + length, [](char c) { return c == 0; })) << length;
    std::memset((*reg)->base(), 0x44, length);
  }
  EXPECT_EQ(p_->AllocateMemory(0, MemoryKind::kHost).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p_->AllocateMemory(64, MemoryKind::kDevice).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p_->AllocateMemory(64, MemoryKind::kPinned).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Allocated memory on both sides, and a registration of a range inside the receiver's
// allocation: writes through it land at the right place, notification after data.
TEST_F(LoopbackTest, WritesIntoAllocatedMemoryAndSubRanges) {
  auto src = p_->AllocateMemory(kBytes, MemoryKind::kHost);
  auto dst = d_->AllocateMemory(3 * kBytes, MemoryKind::kHost);
  ASSERT_TRUE(src.ok() && dst.ok());
  std::memcpy((*src)->base(), src_.data(), kBytes);
  char* base = static_cast<char*>((*dst)->base());
  auto sub = d_->RegisterMemory(base + kBytes, kBytes, MemoryKind::kHost);
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto whole = p_->ImportRemote(to_d_, (*dst)->descriptor());
  auto part = p_->ImportRemote(to_d_, (*sub)->descriptor());
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_TRUE(part.ok()) << part.status();
  EXPECT_EQ((*whole)->length(), 3 * kBytes);
  EXPECT_EQ((*part)->length(), kBytes);

  std::vector<Segment> segments = Scattered(kBlocks / 2, 21);
  auto id = p_->PostWrite(to_d_, **src, **part, segments, "sub");
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(p_->Progress().ok());
  std::vector<Notification> notes = d_->PollNotifications();
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].payload, "sub");
  const std::vector<char> expected = Expected(segments);
  auto zero = [](const char* p, size_t n) {
    return std::all_of(p, p + n, [](char c) { return c == 0; });
  };
  EXPECT_TRUE(zero(base, kBytes));
  EXPECT_TRUE(std::equal(base + kBytes, base + 2 * kBytes, expected.begin()));
  EXPECT_TRUE(zero(base + 2 * kBytes, kBytes));

  // Through the whole allocation's descriptor, into its last area.
  std::vector<Segment> shifted = segments;
  for (Segment& s : shifted) s.remote_offset += 2 * kBytes;
  auto id2 = p_->PostWrite(to_d_, **src, **whole, shifted, "");
  ASSERT_TRUE(id2.ok()) << id2.status();
  auto state = WaitForTransfer(*p_, *id2, Deadline());
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_TRUE(std::equal(base + 2 * kBytes, base + 3 * kBytes, expected.begin()));
  part->reset();
  whole->reset();
  sub->reset();  // before the allocation, as the contract requires
}

TEST_F(LoopbackTest, CreateTransportRejectsDuplicateAndEmptyNames) {
  EXPECT_EQ(fabric_.CreateTransport("p").status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(fabric_.CreateTransport("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(LoopbackTest, FailEndpointFailsOutstandingAndLaterPosts) {
  std::vector<PeerId> reported;
  absl::Status reported_error;
  p_->SetPeerErrorCallback([&](PeerId peer, const absl::Status& error) {
    reported.push_back(peer);
    reported_error = error;
  });
  std::vector<TransferId> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(Post(Scattered(4, i), absl::StrCat("n", i)));

  fabric_.FailEndpoint("d", absl::UnavailableError("process died"));
  for (TransferId id : ids) {
    auto state = WaitForTransfer(*p_, id, Deadline());
    ASSERT_FALSE(state.ok());
    EXPECT_EQ(state.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(state.status().message(), HasSubstr("'d'"));
    EXPECT_THAT(state.status().message(), HasSubstr("process died"));
  }
  EXPECT_EQ(dst_, std::vector<char>(kBytes, 0));
  EXPECT_TRUE(d_->PollNotifications().empty());
  EXPECT_EQ(p_->PeerStatus(to_d_).code(), absl::StatusCode::kUnavailable);
  ASSERT_EQ(reported.size(), 1u);
  EXPECT_EQ(reported[0], to_d_);
  EXPECT_THAT(reported_error.message(), HasSubstr("'d'"));

  auto later = p_->PostWrite(to_d_, *src_reg_, *remote_, Scattered(1, 1), "late");
  EXPECT_EQ(later.status().code(), absl::StatusCode::kFailedPrecondition) << later.status();
  EXPECT_THAT(later.status().message(), HasSubstr("'d'"));
}

TEST_F(LoopbackTest, DestroyedPeerFailsTransfersToIt) {
  TransferId id = Post(Scattered(2, 3), "x");
  remote_.reset();
  dst_reg_.reset();
  d_.reset();
  auto state = WaitForTransfer(*p_, id, Deadline());
  ASSERT_FALSE(state.ok());
  EXPECT_EQ(state.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(state.status().message(), HasSubstr("'d'"));
}

TEST_F(LoopbackTest, CancelBeforeProgressWritesNothing) {
  TransferId id = Post(Scattered(8, 5), "cancelled");
  ASSERT_TRUE(p_->Cancel(id).ok());
  auto state = WaitForTransfer(*p_, id, Deadline());
  EXPECT_EQ(state.status().code(), absl::StatusCode::kCancelled) << state.status();
  EXPECT_EQ(dst_, std::vector<char>(kBytes, 0));
  EXPECT_TRUE(d_->PollNotifications().empty());

  // Cancelling a finished transfer leaves it finished.
  TransferId done = Post(Scattered(1, 6), "");
  ASSERT_TRUE(WaitForTransfer(*p_, done, Deadline()).ok());
  EXPECT_TRUE(p_->Cancel(done).ok());
  EXPECT_EQ(*p_->Test(done), TransferState::kDone);
}

TEST_F(LoopbackTest, ReleaseOfAQueuedTransferDropsIt) {
  TransferId id = Post(Scattered(8, 9), "released");
  p_->Release(id);
  ASSERT_TRUE(p_->Progress().ok());
  EXPECT_EQ(p_->Test(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(dst_, std::vector<char>(kBytes, 0));
  EXPECT_TRUE(d_->PollNotifications().empty());
}

TEST_F(LoopbackTest, DisconnectCancelsOutstanding) {
  TransferId id = Post(Scattered(8, 9), "x");
  ASSERT_TRUE(p_->Disconnect(to_d_).ok());
  auto state = p_->Test(id);
  EXPECT_EQ(state.status().code(), absl::StatusCode::kCancelled) << state.status();
  ASSERT_TRUE(p_->Progress().ok());
  EXPECT_EQ(dst_, std::vector<char>(kBytes, 0));
  EXPECT_EQ(p_->PeerStatus(to_d_).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(p_->PostNotification(to_d_, "x").status().code(), absl::StatusCode::kNotFound);
}

// The receiver's side of Disconnect: a writer it gave up (the peer Accept named) has its
// writes and notifications dropped, queued ones included, until Accept or Connect again.
TEST_F(LoopbackTest, AReceiverFencesOffAWriterItDisconnectedFrom) {
  auto from_p = d_->Accept(*p_->LocalInfo());
  ASSERT_TRUE(from_p.ok()) << from_p.status();
  TransferId before = Post(Scattered(4, 3), "queued before");
  ASSERT_TRUE(d_->Disconnect(*from_p).ok());
  TransferId after = Post(Scattered(4, 5), "posted after");
  for (TransferId id : {before, after}) {
    auto state = WaitForTransfer(*p_, id, Deadline());
    EXPECT_EQ(state.status().code(), absl::StatusCode::kFailedPrecondition) << state.status();
  }
  EXPECT_EQ(dst_, std::vector<char>(kBytes, 0)) << "a fenced-off writer's data landed";
  EXPECT_TRUE(d_->PollNotifications().empty()) << "a fenced-off writer's notification came";

  auto again = d_->Accept(*p_->LocalInfo());
  ASSERT_TRUE(again.ok()) << again.status();
  std::vector<Segment> segments = Scattered(4, 7);
  auto done = WaitForTransfer(*p_, Post(segments, "accepted"), Deadline());
  ASSERT_TRUE(done.ok()) << done.status();
  std::vector<Notification> notes = d_->PollNotifications();
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].peer, *again) << "Accept names another peer than the notifications";
  EXPECT_EQ(dst_, Expected(segments));

  // Connect lifts the fence too.
  ASSERT_TRUE(d_->Disconnect(*again).ok());
  ASSERT_TRUE(d_->Connect(*p_->LocalInfo()).ok());
  done = WaitForTransfer(*p_, Post(segments, "connected"), Deadline());
  EXPECT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(d_->PollNotifications().size(), 1u);
}

TEST_F(LoopbackTest, AcceptRefusesItsOwnAndMalformedInfo) {
  EXPECT_EQ(d_->Accept(*d_->LocalInfo()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(d_->Accept("loopback:nonsense").status().code(), absl::StatusCode::kInvalidArgument);
  auto other = Make("other");
  const std::string info = *other->LocalInfo();
  other.reset();
  EXPECT_EQ(d_->Accept(info).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(LoopbackTest, DeregisteredDestinationFailsTheTransfer) {
  TransferId id = Post(Scattered(2, 4), "x");
  dst_reg_.reset();
  auto state = WaitForTransfer(*p_, id, Deadline());
  EXPECT_EQ(state.status().code(), absl::StatusCode::kFailedPrecondition) << state.status();
  EXPECT_EQ(dst_, std::vector<char>(kBytes, 0));
}

TEST_F(LoopbackTest, WaitForTransferHonoursItsDeadline) {
  // Nothing but Progress() moves it, and the deadline has passed: the wait still reports
  // the outcome of one progress step rather than a spurious timeout.
  TransferId id = Post(Scattered(1, 1), "");
  auto state = WaitForTransfer(*p_, id, absl::InfinitePast());
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(*state, TransferState::kDone);
  EXPECT_EQ(WaitForTransfer(*p_, 777, Deadline()).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(LoopbackTest, ConcurrentPostersAndProgress) {
  constexpr int kThreads = 4;
  constexpr int kPerThread = 200;
  std::atomic<bool> stop{false};
  std::thread progress([&] {
    while (!stop.load()) {
      EXPECT_TRUE(p_->Progress().ok());
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> posters;
  std::atomic<int> done{0};
  for (int t = 0; t < kThreads; ++t) {
    posters.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        Segment s;
        s.local_offset = static_cast<uint64_t>(t) * kBlock;
        s.remote_offset = static_cast<uint64_t>(t) * kBlock;
        s.length = kBlock;
        auto id = p_->PostWrite(to_d_, *src_reg_, *remote_, {s}, "c");
        ASSERT_TRUE(id.ok()) << id.status();
        auto state = WaitForTransfer(*p_, *id, Deadline());
        ASSERT_TRUE(state.ok()) << state.status();
        p_->Release(*id);
        done.fetch_add(1);
      }
    });
  }
  for (auto& th : posters) th.join();
  stop.store(true);
  progress.join();
  EXPECT_EQ(done.load(), kThreads * kPerThread);
  EXPECT_EQ(d_->PollNotifications().size(), static_cast<size_t>(kThreads * kPerThread));
}

}  // namespace
}  // namespace kvstream
