// Tests of transfer/ucx_transport.h inside one process: two transports talking over shared
// memory (with UCX puts, and with copy threads: "shm_copy") and over TCP on loopback
// (Progress on both), notification-after-data, bounds and lookup errors, strict decoding of
// worker info and memory descriptors, cancel, release, disconnect, a destroyed peer, and
// destruction with transfers outstanding; with copy threads also the order of notifications
// behind copies, and handles destroyed while their copies run.
#include "kvstream/transfer/ucx_transport.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/shuffled_slots.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/logging.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {
namespace {

using ::testing::HasSubstr;

constexpr size_t kBlock = 4096;
constexpr size_t kBlocks = 64;
constexpr size_t kBytes = kBlock * kBlocks;

absl::Time Deadline() { return absl::Now() + absl::Seconds(60); }

// "shm_copy": shared memory with two copy threads.
UcxTransportOptions OptionsFor(const std::string& param) {
  UcxTransportOptions options;
  options.tls = param == "shm_copy" ? "shm" : param;
  if (param == "tcp") options.net_devices = "lo";
  if (param == "shm_copy") options.copy_threads = 2;
  return options;
}

std::unique_ptr<Transport> MakeTransport(const std::string& tls) {
  auto t = CreateUcxTransport(OptionsFor(tls));
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(t).value() : nullptr;
}

// "p" writes into "d"; both registered, p connected to d with d's region imported.
class UcxPairTest : public ::testing::TestWithParam<std::string> {
 protected:
  static bool Shm() { return GetParam() != "tcp"; }
  static bool Copying() { return GetParam() == "shm_copy"; }

  void SetUp() override {
    p_ = MakeTransport(GetParam());
    d_ = MakeTransport(GetParam());
    ASSERT_NE(p_, nullptr);
    ASSERT_NE(d_, nullptr);
    src_.resize(kBytes);
    dst_.assign(kBytes, 0);
    std::mt19937 rng(1234);
    for (char& c : src_) c = static_cast<char>(1 + rng() % 255);
    src_reg_ = Register(*p_, src_);
    dst_reg_ = Register(*d_, dst_);
    ASSERT_NE(src_reg_, nullptr);
    ASSERT_NE(dst_reg_, nullptr);
    auto info = d_->LocalInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    auto peer = p_->Connect(*info);
    ASSERT_TRUE(peer.ok()) << peer.status();
    to_d_ = *peer;
    auto remote = p_->ImportRemote(to_d_, dst_reg_->descriptor());
    ASSERT_TRUE(remote.ok()) << remote.status();
    remote_ = std::move(remote).value();
  }

  void TearDown() override {
    // Handles before their transports, as the contract requires.
    remote_.reset();
    src_reg_.reset();
    dst_reg_.reset();
  }

  static std::unique_ptr<MemoryRegistration> Register(Transport& t, std::vector<char>& buffer) {
    auto reg = t.RegisterMemory(buffer.data(), buffer.size(), MemoryKind::kHost);
    EXPECT_TRUE(reg.ok()) << reg.status();
    return reg.ok() ? std::move(reg).value() : nullptr;
  }

  static std::vector<Segment> Scattered(size_t count, uint32_t seed, size_t length = kBlock) {
    const testing_util::SlotPermutations slots =
        testing_util::ShuffledSlots(kBlocks, kBlocks, seed);
    std::vector<Segment> segments;
    for (size_t i = 0; i < count; ++i) {
      Segment s;
      s.local_offset = slots.src[i] * kBlock;
      s.remote_offset = slots.dst[i] * kBlock;
      s.length = length;
      segments.push_back(s);
    }
    return segments;
  }

  std::vector<char> Expected(const std::vector<Segment>& segments) const {
    std::vector<char> expected(kBytes, 0);
    for (const Segment& s : segments) {
      std::memcpy(expected.data() + s.remote_offset, src_.data() + s.local_offset, s.length);
    }
    return expected;
  }

  // Progresses both sides until `done` or the deadline; false on timeout.
  bool ProgressUntil(const std::function<bool()>& done) {
    const absl::Time deadline = Deadline();
    while (absl::Now() < deadline) {
      EXPECT_TRUE(p_->Progress().ok());
      EXPECT_TRUE(d_->Progress().ok());
      if (done()) return true;
    }
    return false;
  }

  // Waits for the sender's transfer while the receiver progresses too (TCP puts need the
  // target's progress).
  absl::StatusOr<TransferState> Wait(TransferId id) {
    absl::StatusOr<TransferState> state = TransferState::kInProgress;
    ProgressUntil([&] {
      state = p_->Test(id);
      return !state.ok() || *state != TransferState::kInProgress;
    });
    return state;
  }

  // One notification with both sides progressing, which completes UCX's connection
  // handshake (that needs the receiver); afterwards the receiver may stop progressing.
  void WarmUp() {
    auto id = p_->PostNotification(to_d_, "warm-up");
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_EQ(WaitForNotifications(1).size(), 1u);
    auto state = Wait(*id);
    ASSERT_TRUE(state.ok()) << state.status();
    p_->Release(*id);
  }

  std::vector<Notification> WaitForNotifications(size_t count) {
    std::vector<Notification> notes;
    ProgressUntil([&] {
      for (Notification& n : d_->PollNotifications()) notes.push_back(std::move(n));
      return notes.size() >= count;
    });
    return notes;
  }

  std::unique_ptr<Transport> p_, d_;
  std::vector<char> src_, dst_;
  std::unique_ptr<MemoryRegistration> src_reg_, dst_reg_;
  std::unique_ptr<RemoteMemory> remote_;
  PeerId to_d_ = 0;
};

TEST_P(UcxPairTest, Capabilities) {
  EXPECT_EQ(p_->name(), "ucx");
  TransportCapabilities caps = p_->capabilities();
  EXPECT_TRUE(caps.one_sided_write);
  EXPECT_TRUE(caps.notifications);
  EXPECT_TRUE(caps.host_memory);
  // Device memory is staged through pinned host memory wherever the build has CUDA.
  EXPECT_EQ(caps.device_memory, BuiltWithCuda());
  EXPECT_TRUE(caps.inter_process);
  EXPECT_EQ(caps.inter_node, GetParam() == "tcp");
}

TEST_P(UcxPairTest, ScatteredWriteThenNotificationWithDataInPlace) {
  std::vector<Segment> segments = Scattered(kBlocks / 2, 42);
  auto id = p_->PostWrite(to_d_, *src_reg_, *remote_, segments, "layer 7");
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<Notification> notes = WaitForNotifications(1);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].payload, "layer 7");
  // Checked at the moment the notification is seen: the data must already be there.
  EXPECT_EQ(dst_, Expected(segments));
  auto state = Wait(*id);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(*state, TransferState::kDone);
  p_->Release(*id);
  EXPECT_EQ(p_->Test(*id).status().code(), absl::StatusCode::kNotFound);

  // The receiver names the sender by the id it gets when connecting to it.
  auto to_p = d_->Connect(*p_->LocalInfo());
  ASSERT_TRUE(to_p.ok()) << to_p.status();
  EXPECT_EQ(notes[0].peer, *to_p);
}

TEST_P(UcxPairTest, WriteWithoutNotificationCompletes) {
  std::vector<Segment> segments = Scattered(kBlocks, 3);
  auto id = p_->PostWrite(to_d_, *src_reg_, *remote_, segments, "");
  ASSERT_TRUE(id.ok()) << id.status();
  auto state = Wait(*id);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(dst_, Expected(segments));
  EXPECT_TRUE(d_->PollNotifications().empty());
}

TEST_P(UcxPairTest, ManyTransfersNotificationsInOrder) {
  constexpr int kTransfers = 200;
  std::vector<TransferId> ids;
  std::vector<Segment> all;
  for (int i = 0; i < kTransfers; ++i) {
    std::vector<Segment> one = Scattered(1, i, kBlock / 2);
    all.push_back(one[0]);
    auto id = p_->PostWrite(to_d_, *src_reg_, *remote_, one, absl::StrCat("n", i));
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  std::vector<Notification> notes = WaitForNotifications(kTransfers);
  ASSERT_EQ(notes.size(), static_cast<size_t>(kTransfers));
  for (int i = 0; i < kTransfers; ++i) EXPECT_EQ(notes[i].payload, absl::StrCat("n", i));
  EXPECT_EQ(dst_, Expected(all));
  for (TransferId id : ids) {
    auto state = Wait(id);
    ASSERT_TRUE(state.ok()) << state.status();
    p_->Release(id);
  }
}

TEST_P(UcxPairTest, NotificationAloneAndFromAPeerNeverConnectedBack) {
  auto id = p_->PostNotification(to_d_, std::string(10000, 'x'));  // several fragments
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<Notification> notes = WaitForNotifications(1);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].payload, std::string(10000, 'x'));
  const PeerId sender = notes[0].peer;
  EXPECT_TRUE(d_->PeerStatus(sender).ok());
  EXPECT_EQ(d_->PostNotification(sender, "back").status().code(),
            absl::StatusCode::kFailedPrecondition);
  auto connected = d_->Connect(*p_->LocalInfo());
  ASSERT_TRUE(connected.ok()) << connected.status();
  EXPECT_EQ(*connected, sender);
  EXPECT_EQ(p_->PostNotification(to_d_, "").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(UcxPairTest, OutOfRangeSegmentsPostNothing) {
  const uint64_t kMax = UINT64_MAX;
  const std::vector<std::vector<Segment>> bad = {
      {{0, 0, kBytes + 1}},
      {{kBytes - 8, 0, 16}},
      {{0, kBytes - 8, 16}},
      {{kMax - 4, 0, 16}},
      {{0, kMax - 4, 16}},
      {{0, 0, kBlock}, {kBlock, kBlock, kBlock}, {0, kBytes, 1}},
  };
  for (const auto& segments : bad) {
    auto id = p_->PostWrite(to_d_, *src_reg_, *remote_, segments, "bad");
    ASSERT_FALSE(id.ok());
    EXPECT_EQ(id.status().code(), absl::StatusCode::kOutOfRange) << id.status();
  }
  // A marker transfer: once its notification arrives, anything posted before it would have.
  auto marker = p_->PostNotification(to_d_, "marker");
  ASSERT_TRUE(marker.ok());
  std::vector<Notification> notes = WaitForNotifications(1);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].payload, "marker");
  EXPECT_EQ(dst_, std::vector<char>(kBytes, 0));
}

TEST_P(UcxPairTest, UnknownPeersTransfersAndForeignHandles) {
  EXPECT_EQ(p_->PostNotification(999, "x").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(p_->ImportRemote(999, dst_reg_->descriptor()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(p_->PeerStatus(999).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(p_->Disconnect(999).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(p_->Test(5555).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(p_->Cancel(5555).code(), absl::StatusCode::kNotFound);
  p_->Release(5555);
  // d's registration is not p's: rejected before anything is posted.
  EXPECT_EQ(p_->PostWrite(to_d_, *dst_reg_, *remote_, Scattered(1, 1), "").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p_->PostWrite(to_d_ + 1, *src_reg_, *remote_, Scattered(1, 1), "").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(UcxPairTest, RegisterMemoryRejectsBadRanges) {
  char byte = 0;
  EXPECT_EQ(p_->RegisterMemory(nullptr, 8, MemoryKind::kHost).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p_->RegisterMemory(&byte, 0, MemoryKind::kHost).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Host memory is not device memory: refused as such (InvalidArgument), or, in a build
  // with CUDA on a machine without a GPU, because no device can be asked (FailedPrecondition).
  const absl::Status device = p_->RegisterMemory(&byte, 1, MemoryKind::kDevice).status();
  EXPECT_TRUE(device.code() == absl::StatusCode::kInvalidArgument ||
              (BuiltWithCuda() && device.code() == absl::StatusCode::kFailedPrecondition))
      << device;
}

TEST_P(UcxPairTest, CancelAndReleaseNeverLeaveATransferInProgress) {
  for (int i = 0; i < 20; ++i) {
    auto id = p_->PostWrite(to_d_, *src_reg_, *remote_, Scattered(8, i), "c");
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_TRUE(p_->Cancel(*id).ok());
    auto state = Wait(*id);
    // Either the cancel won (Cancelled) or the transfer had already handed its notification
    // over (kDone); never an endless kInProgress.
    if (!state.ok()) {
      EXPECT_EQ(state.status().code(), absl::StatusCode::kCancelled) << state.status();
    }
    p_->Release(*id);
    auto released = p_->PostWrite(to_d_, *src_reg_, *remote_, Scattered(8, i), "r");
    ASSERT_TRUE(released.ok());
    p_->Release(*released);
    EXPECT_EQ(p_->Test(*released).status().code(), absl::StatusCode::kNotFound);
  }
  // The transport still works afterwards.
  auto id = p_->PostWrite(to_d_, *src_reg_, *remote_, Scattered(2, 99), "");
  ASSERT_TRUE(id.ok());
  auto state = Wait(*id);
  EXPECT_TRUE(state.ok()) << state.status();
}

TEST_P(UcxPairTest, DisconnectForgetsThePeer) {
  auto id = p_->PostWrite(to_d_, *src_reg_, *remote_, Scattered(4, 1), "x");
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(p_->Disconnect(to_d_).ok());
  auto state = p_->Test(*id);
  // Cancelled unless it had completed inside PostWrite already.
  if (!state.ok()) {
    EXPECT_EQ(state.status().code(), absl::StatusCode::kCancelled);
  }
  EXPECT_EQ(p_->PeerStatus(to_d_).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(p_->PostWrite(to_d_, *src_reg_, *remote_, Scattered(1, 1), "").status().code(),
            absl::StatusCode::kNotFound);
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(p_->Progress().ok());  // finishes the close
  // Reconnecting gives a fresh, working peer.
  auto again = p_->Connect(*d_->LocalInfo());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(*again, to_d_);
  auto remote = p_->ImportRemote(*again, dst_reg_->descriptor());
  ASSERT_TRUE(remote.ok()) << remote.status();
  std::vector<Segment> segments = Scattered(4, 2);
  auto id2 = p_->PostWrite(*again, *src_reg_, **remote, segments, "again");
  ASSERT_TRUE(id2.ok()) << id2.status();
  std::vector<Notification> notes = WaitForNotifications(1);
  bool seen = false;
  for (const Notification& n : notes) seen = seen || n.payload == "again";
  EXPECT_TRUE(seen);
}

TEST_P(UcxPairTest, DestroyWithTransfersOutstanding) {
  // Many transfers posted and never waited for; the receiver never progresses. Destroying
  // the sender must neither crash nor hang.
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(p_->PostWrite(to_d_, *src_reg_, *remote_, Scattered(16, i), "n").ok());
  }
  remote_.reset();
  src_reg_.reset();
  p_.reset();
  // The receiver survives its peer's departure.
  EXPECT_TRUE(d_->Progress().ok());
}

TEST_P(UcxPairTest, DescriptorDecodingIsStrict) {
  const std::string good = dst_reg_->descriptor();
  // Every truncation.
  for (size_t n = 0; n < good.size(); ++n) {
    auto r = p_->ImportRemote(to_d_, good.substr(0, n));
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  }
  // Trailing bytes.
  EXPECT_EQ(p_->ImportRemote(to_d_, good + "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  // Every single flipped byte (magic, version, lengths, rkey bytes, checksum).
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x5a);
    auto r = p_->ImportRemote(to_d_, bad);
    ASSERT_FALSE(r.ok()) << "flipped byte " << i;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  }
  // Garbage of many lengths.
  std::mt19937 rng(5);
  for (size_t n : {1, 7, 8, 16, 33, 64, 200, 4096}) {
    std::string junk(n, '\0');
    for (char& c : junk) c = static_cast<char>(rng());
    EXPECT_EQ(p_->ImportRemote(to_d_, junk).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  // A future version is refused by its version, not misread.
  std::string future = good;
  future[4] = 4;
  auto r = p_->ImportRemote(to_d_, future);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("version 4"));
  // And so are the earlier versions (no memory kind; no fence epoch).
  for (char version : {1, 2}) {
    std::string old = good;
    old[4] = version;
    EXPECT_THAT(p_->ImportRemote(to_d_, old).status().message(),
                HasSubstr(absl::StrCat("version ", static_cast<int>(version))));
  }
  // A worker info is not a memory descriptor.
  EXPECT_EQ(p_->ImportRemote(to_d_, *d_->LocalInfo()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(UcxPairTest, WorkerInfoDecodingIsStrict) {
  const std::string good = *d_->LocalInfo();
  for (size_t n = 0; n < good.size(); n += 3) {
    EXPECT_EQ(p_->Connect(good.substr(0, n)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << n;
  }
  for (size_t i = 0; i < good.size(); i += 5) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x21);
    EXPECT_EQ(p_->Connect(bad).status().code(), absl::StatusCode::kInvalidArgument) << i;
  }
  std::string future = good;
  future[4] = 7;
  auto r = p_->Connect(future);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("version 7"));
  EXPECT_EQ(p_->Connect(dst_reg_->descriptor()).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Connecting twice to the same transport gives the same peer.
  auto again = p_->Connect(good);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, to_d_);
}

// --- AllocateMemory ---

std::unique_ptr<MemoryRegistration> Allocate(Transport& t, size_t length) {
  auto reg = t.AllocateMemory(length, MemoryKind::kHost);
  EXPECT_TRUE(reg.ok()) << reg.status();
  return reg.ok() ? std::move(reg).value() : nullptr;
}

// The packed remote key inside a descriptor (layout in transfer/src/ucx/ucx_wire.h: 8 bytes
// of preamble, 4 of kind, address, length, region id, a 4-byte key length, the key, an
// 8-byte checksum).
std::string RkeyOf(const std::string& descriptor) {
  return descriptor.size() < 48 ? std::string() : descriptor.substr(40, descriptor.size() - 48);
}

bool AllZero(const char* p, size_t n) {
  return std::all_of(p, p + n, [](char c) { return c == 0; });
}

TEST_P(UcxPairTest, AllocateMemoryIsZeroedAlignedAndOwned) {
  for (size_t length : {size_t{1}, size_t{100}, size_t{4096}, size_t{3} << 20}) {
    auto reg = Allocate(*d_, length);
    ASSERT_NE(reg, nullptr);
    EXPECT_EQ(reg->length(), length);
    EXPECT_EQ(reg->memory_kind(), MemoryKind::kHost);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(reg->base()) % kMinAllocationAlignment, 0u);
    EXPECT_TRUE(AllZero(static_cast<const char*>(reg->base()), length)) << length;
    // Writable by its owner throughout.
    std::memset(reg->base(), 0x33, length);
    EXPECT_FALSE(reg->descriptor().empty());
  }
}

TEST_P(UcxPairTest, AllocateMemoryRejectsBadArguments) {
  EXPECT_EQ(d_->AllocateMemory(0, MemoryKind::kHost).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto device = d_->AllocateMemory(4096, MemoryKind::kDevice);
  if (!BuiltWithCuda()) {
    EXPECT_EQ(device.status().code(), absl::StatusCode::kInvalidArgument);
  } else if (GpuCount() == 0) {
    EXPECT_EQ(device.status().code(), absl::StatusCode::kFailedPrecondition) << device.status();
  } else {
    ASSERT_TRUE(device.ok()) << device.status();
    EXPECT_EQ((*device)->memory_kind(), MemoryKind::kDevice);
  }
  EXPECT_EQ(d_->AllocateMemory(4096, MemoryKind::kPinned).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Both sides' memory allocated by the transport: a scattered write and its notification,
// the data in place when the notification is seen; the allocation's other bytes untouched.
TEST_P(UcxPairTest, WritesIntoAllocatedMemoryLandBeforeTheirNotification) {
  auto src = Allocate(*p_, kBytes);
  auto dst = Allocate(*d_, kBytes);
  ASSERT_NE(src, nullptr);
  ASSERT_NE(dst, nullptr);
  std::memcpy(src->base(), src_.data(), kBytes);
  auto remote = p_->ImportRemote(to_d_, dst->descriptor());
  ASSERT_TRUE(remote.ok()) << remote.status();
  std::vector<Segment> segments = Scattered(kBlocks / 2, 77);
  auto id = p_->PostWrite(to_d_, *src, **remote, segments, "allocated");
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<Notification> notes = WaitForNotifications(1);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].payload, "allocated");
  const char* data = static_cast<const char*>(dst->base());
  EXPECT_TRUE(std::equal(data, data + kBytes, Expected(segments).begin()));
  auto state = Wait(*id);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(*state, TransferState::kDone);
  p_->Release(*id);
  remote->reset();
}

// Over shared memory, puts into allocated memory are copies by the writer into the mapped
// segment: they complete, and the bytes are in place, while the receiver never progresses
// (puts into registered heap memory would be active messages waiting for it; see
// ucx_transport.h). The notification still needs the receiver's progress to be seen.
TEST_P(UcxPairTest, SharedMemoryWritesIntoAllocatedMemoryNeedNoReceiverProgress) {
  if (!Shm()) GTEST_SKIP() << "one-sided only over shared memory";
  ASSERT_NO_FATAL_FAILURE(WarmUp());
  auto dst = Allocate(*d_, kBytes);
  ASSERT_NE(dst, nullptr);
  auto remote = p_->ImportRemote(to_d_, dst->descriptor());
  ASSERT_TRUE(remote.ok()) << remote.status();
  for (int round = 0; round < 3; ++round) {
    std::vector<Segment> segments = Scattered(kBlocks, 500 + round);
    auto id = p_->PostWrite(to_d_, *src_reg_, **remote, segments, "");
    ASSERT_TRUE(id.ok()) << id.status();
    // Only the sender progresses.
    auto state = WaitForTransfer(*p_, *id, absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(state.ok()) << state.status()
                            << " (the write needed the receiver: emulated, not one-sided)";
    EXPECT_EQ(*state, TransferState::kDone);
    p_->Release(*id);
    const char* data = static_cast<const char*>(dst->base());
    EXPECT_TRUE(std::equal(data, data + kBytes, Expected(segments).begin())) << round;
  }
  // With a notification: the data lands without the receiver; the notification waits for it.
  std::memset(dst->base(), 0, kBytes);
  std::vector<Segment> segments = Scattered(kBlocks / 2, 9);
  auto id = p_->PostWrite(to_d_, *src_reg_, **remote, segments, "late reader");
  ASSERT_TRUE(id.ok()) << id.status();
  const std::vector<char> expected = Expected(segments);
  const char* data = static_cast<const char*>(dst->base());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!std::equal(data, data + kBytes, expected.begin()) && absl::Now() < deadline) {
    ASSERT_TRUE(p_->Progress().ok());
  }
  EXPECT_TRUE(std::equal(data, data + kBytes, expected.begin()));
  std::vector<Notification> notes = WaitForNotifications(1);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].payload, "late reader");
  remote->reset();
}

// RegisterMemory of ranges inside allocations reuses the allocation's key: the descriptor
// carries it, writes through the sub-range's descriptor land at the right place in the
// allocation (without the receiver's progress over shared memory), and a sub-range works as
// a write's source too.
TEST_P(UcxPairTest, RegistrationsInsideAnAllocationReuseIt) {
  auto first = Allocate(*d_, kBytes);
  auto second = Allocate(*d_, 3 * kBytes);
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);
  char* base = static_cast<char*>(second->base());
  auto sub = d_->RegisterMemory(base + kBytes, kBytes, MemoryKind::kHost);
  ASSERT_TRUE(sub.ok()) << sub.status();
  EXPECT_EQ((*sub)->base(), base + kBytes);
  EXPECT_EQ((*sub)->length(), kBytes);
  EXPECT_EQ(RkeyOf((*sub)->descriptor()), RkeyOf(second->descriptor()));
  EXPECT_NE((*sub)->descriptor(), second->descriptor());  // its own address and length
  // The whole allocation and its last byte alone are inside it too.
  auto whole = d_->RegisterMemory(base, 3 * kBytes, MemoryKind::kHost);
  auto last = d_->RegisterMemory(base + 3 * kBytes - 1, 1, MemoryKind::kHost);
  ASSERT_TRUE(whole.ok() && last.ok());
  EXPECT_EQ(RkeyOf((*whole)->descriptor()), RkeyOf(second->descriptor()));
  EXPECT_EQ(RkeyOf((*last)->descriptor()), RkeyOf(second->descriptor()));
  // Ordinary memory keeps an ordinary registration.
  if (Shm()) {
    EXPECT_NE(RkeyOf(dst_reg_->descriptor()), RkeyOf(second->descriptor()));
  }

  // The source: a sub-range of an allocation on the sender.
  auto src_alloc = Allocate(*p_, 2 * kBytes);
  ASSERT_NE(src_alloc, nullptr);
  char* src_base = static_cast<char*>(src_alloc->base());
  std::memcpy(src_base + kBytes / 2, src_.data(), kBytes);
  auto src_sub = p_->RegisterMemory(src_base + kBytes / 2, kBytes, MemoryKind::kHost);
  ASSERT_TRUE(src_sub.ok()) << src_sub.status();

  ASSERT_NO_FATAL_FAILURE(WarmUp());
  auto remote = p_->ImportRemote(to_d_, (*sub)->descriptor());
  ASSERT_TRUE(remote.ok()) << remote.status();
  EXPECT_EQ((*remote)->length(), kBytes);
  std::vector<Segment> segments = Scattered(kBlocks / 2, 31);
  auto id = p_->PostWrite(to_d_, **src_sub, **remote, segments, "");
  ASSERT_TRUE(id.ok()) << id.status();
  // A segment past the sub-range is refused although the allocation extends beyond it.
  Segment beyond;
  beyond.remote_offset = kBytes;
  beyond.length = 1;
  EXPECT_EQ(p_->PostWrite(to_d_, **src_sub, **remote, {beyond}, "").status().code(),
            absl::StatusCode::kOutOfRange);
  absl::StatusOr<TransferState> state =
      Shm() ? WaitForTransfer(*p_, *id, absl::Now() + absl::Seconds(10))
                          : Wait(*id);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(*state, TransferState::kDone);
  p_->Release(*id);
  EXPECT_TRUE(AllZero(base, kBytes));
  EXPECT_TRUE(std::equal(base + kBytes, base + 2 * kBytes, Expected(segments).begin()));
  EXPECT_TRUE(AllZero(base + 2 * kBytes, kBytes));
  EXPECT_TRUE(AllZero(static_cast<const char*>(first->base()), kBytes));

  // Sub-range registrations go first, as the contract requires.
  remote->reset();
  src_sub->reset();
  sub->reset();
  whole->reset();
  last->reset();
}

// Copy threads: which writes take them. Only allocated memory over shared memory is mapped
// into the writer; heap memory registered over shared memory, and anything over TCP, is put.
TEST_P(UcxPairTest, CopyThreadsTakeWritesIntoMappedMemoryOnly) {
  auto dst = Allocate(*d_, kBytes);
  ASSERT_NE(dst, nullptr);
  auto remote = p_->ImportRemote(to_d_, dst->descriptor());
  ASSERT_TRUE(remote.ok()) << remote.status();
  EXPECT_EQ(UcxWritesAreCopied(**remote), Copying());
  EXPECT_FALSE(UcxWritesAreCopied(*remote_));  // heap memory registered by the receiver
  remote->reset();
}

// Large writes through the copy threads (scattered 16 KiB blocks, a segment cut into
// several pieces, odd lengths), several in flight: every notification arrives in post order
// and, when it arrives, its write and every earlier one are in place.
TEST_P(UcxPairTest, CopiedWritesLandBeforeTheirNotificationsInOrder) {
  constexpr size_t kPool = 16 << 20;
  constexpr size_t kSlot = 16 << 10;
  auto src = Allocate(*p_, kPool);
  auto dst = Allocate(*d_, kPool);
  ASSERT_NE(src, nullptr);
  ASSERT_NE(dst, nullptr);
  std::mt19937 rng(42);
  char* src_bytes = static_cast<char*>(src->base());
  for (size_t i = 0; i < kPool; ++i) src_bytes[i] = static_cast<char>(1 + rng() % 255);
  auto remote = p_->ImportRemote(to_d_, dst->descriptor());
  ASSERT_TRUE(remote.ok()) << remote.status();
  ASSERT_EQ(UcxWritesAreCopied(**remote), Copying());
  ASSERT_NO_FATAL_FAILURE(WarmUp());
  // Write w: 96 blocks of 16 KiB (+ w bytes, so lengths are odd) into slots of its own, and
  // write 5 adds one 2.5 MiB segment (cut into pieces of at most 1 MiB).
  constexpr int kWrites = 6;
  std::vector<size_t> slots(kPool / kSlot);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<std::vector<Segment>> writes(kWrites);
  size_t next = 0;
  for (int w = 0; w < kWrites; ++w) {
    for (int b = 0; b < 96; ++b) {
      Segment s;
      s.local_offset = slots[(next + 300) % slots.size()] * kSlot;
      s.remote_offset = slots[next] * kSlot;
      s.length = kSlot - 64 + static_cast<size_t>(w);
      writes[w].push_back(s);
      ++next;
    }
  }
  Segment big;
  big.local_offset = 0;
  big.remote_offset = kPool - (5 << 19) - 3;
  big.length = (5 << 19) + 3;
  // Keep the big segment clear of every block of the earlier writes.
  for (auto& write : writes) {
    write.erase(std::remove_if(write.begin(), write.end(),
                               [&](const Segment& s) {
                                 return s.remote_offset + s.length > big.remote_offset;
                               }),
                write.end());
  }
  writes[kWrites - 1].push_back(big);
  std::vector<std::vector<char>> expected(kWrites);
  std::vector<char> image(kPool, 0);
  for (int w = 0; w < kWrites; ++w) {
    for (const Segment& s : writes[w]) {
      std::memcpy(image.data() + s.remote_offset, src_bytes + s.local_offset, s.length);
    }
    expected[w] = image;
  }
  std::vector<TransferId> ids;
  for (int w = 0; w < kWrites; ++w) {
    auto id = p_->PostWrite(to_d_, *src, **remote, writes[w], absl::StrCat("w", w));
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  // On every notification, the receiver's memory must hold at least that write and the ones
  // before it: the bytes of those writes equal the image after them (later writes only
  // touch slots of their own).
  const char* data = static_cast<const char*>(dst->base());
  int seen = 0;
  ProgressUntil([&] {
    for (const Notification& n : d_->PollNotifications()) {
      EXPECT_EQ(n.payload, absl::StrCat("w", seen));
      for (int w = 0; w <= seen && w < kWrites; ++w) {
        size_t wrong = 0;
        for (const Segment& s : writes[w]) {
          wrong += std::memcmp(data + s.remote_offset, expected[seen].data() + s.remote_offset,
                               s.length) != 0;
        }
        EXPECT_EQ(wrong, 0u) << "write " << w << " not in place at notification " << seen;
      }
      ++seen;
    }
    return seen >= kWrites;
  });
  ASSERT_EQ(seen, kWrites);
  EXPECT_TRUE(std::equal(data, data + kPool, expected[kWrites - 1].begin()));
  for (TransferId id : ids) {
    auto state = Wait(id);
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_EQ(*state, TransferState::kDone);
    p_->Release(id);
  }
  remote->reset();
}

// A notification alone, and a write that UCX puts (into registered heap memory), posted
// behind a write still being copied, are delivered after it, in post order.
TEST_P(UcxPairTest, NotificationsAndPutsPostedBehindCopiesWaitForThem) {
  constexpr size_t kPool = 32 << 20;
  auto src = Allocate(*p_, kPool);
  auto dst = Allocate(*d_, kPool);
  ASSERT_NE(src, nullptr);
  ASSERT_NE(dst, nullptr);
  std::memset(src->base(), 0x5a, kPool);
  auto remote = p_->ImportRemote(to_d_, dst->descriptor());
  ASSERT_TRUE(remote.ok()) << remote.status();
  ASSERT_NO_FATAL_FAILURE(WarmUp());
  std::vector<Segment> blocks;
  for (size_t off = 0; off < kPool; off += 16 << 10) {
    Segment s;
    s.local_offset = off;
    s.remote_offset = kPool - (16 << 10) - off;  // reversed order
    s.length = 16 << 10;
    blocks.push_back(s);
  }
  const std::vector<Segment> puts = Scattered(kBlocks / 2, 5);
  auto a = p_->PostWrite(to_d_, *src, **remote, blocks, "copies");
  auto b = p_->PostNotification(to_d_, "alone");
  auto c = p_->PostWrite(to_d_, *src_reg_, *remote_, puts, "puts");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  const char* data = static_cast<const char*>(dst->base());
  std::vector<std::string> order;
  ProgressUntil([&] {
    for (const Notification& n : d_->PollNotifications()) {
      order.push_back(n.payload);
      // The copied write is complete whenever any of the three is seen.
      EXPECT_TRUE(std::all_of(data, data + kPool, [](char x) { return x == 0x5a; }))
          << "at " << n.payload;
      if (n.payload == "puts") {
        EXPECT_TRUE(std::equal(dst_.begin(), dst_.end(), Expected(puts).begin()));
      }
    }
    return order.size() >= 3;
  });
  EXPECT_EQ(order, (std::vector<std::string>{"copies", "alone", "puts"}));
  for (TransferId id : {*a, *b, *c}) {
    auto state = Wait(id);
    ASSERT_TRUE(state.ok()) << state.status();
    p_->Release(id);
  }
  remote->reset();
}

// Cancelling, releasing, and destroying the remote or the local handle while a large write
// is being copied: the transfer ends Cancelled (or kDone if it had finished), never stays in
// progress, the handles go away safely, and the transport keeps working.
TEST_P(UcxPairTest, CopiesStopWhenCancelledReleasedOrTheirMemoryGoes) {
  // (Over shared memory without copy threads the puts are copied inside PostWrite: the same
  // calls must still end every transfer. Over TCP the writes would need the receiver.)
  if (!Shm()) GTEST_SKIP() << "writes complete without the receiver only over shared memory";
  constexpr size_t kPool = 64 << 20;
  auto dst = Allocate(*d_, kPool);
  ASSERT_NE(dst, nullptr);
  ASSERT_NO_FATAL_FAILURE(WarmUp());
  std::vector<Segment> blocks;
  for (size_t off = 0; off < kPool; off += 16 << 10) {
    Segment s;
    s.local_offset = off;
    s.remote_offset = off;
    s.length = 16 << 10;
    blocks.push_back(s);
  }
  auto ends_cancelled_or_done = [&](TransferId id, const char* how) {
    auto state = WaitForTransfer(*p_, id, Deadline());
    if (!state.ok()) {
      EXPECT_EQ(state.status().code(), absl::StatusCode::kCancelled) << how << state.status();
    }
  };
  for (int how = 0; how < 4; ++how) {
    auto src = Allocate(*p_, kPool);
    ASSERT_NE(src, nullptr);
    auto remote = p_->ImportRemote(to_d_, dst->descriptor());
    ASSERT_TRUE(remote.ok()) << remote.status();
    auto id = p_->PostWrite(to_d_, *src, **remote, blocks, "doomed");
    ASSERT_TRUE(id.ok()) << id.status();
    switch (how) {
      case 0:
        ASSERT_TRUE(p_->Cancel(*id).ok());
        ends_cancelled_or_done(*id, "cancel: ");
        p_->Release(*id);
        remote->reset();
        break;
      case 1:
        p_->Release(*id);
        EXPECT_EQ(p_->Test(*id).status().code(), absl::StatusCode::kNotFound);
        remote->reset();
        break;
      case 2: {
        remote->reset();
        auto state = WaitForTransfer(*p_, *id, Deadline());
        if (!state.ok()) {
          EXPECT_EQ(state.status().code(), absl::StatusCode::kCancelled) << state.status();
          EXPECT_THAT(state.status().message(), HasSubstr("remote memory"));
        }
        p_->Release(*id);
        break;
      }
      case 3: {
        src.reset();
        auto state = WaitForTransfer(*p_, *id, Deadline());
        if (!state.ok()) {
          EXPECT_EQ(state.status().code(), absl::StatusCode::kCancelled) << state.status();
          EXPECT_THAT(state.status().message(), HasSubstr("local registration"));
        }
        p_->Release(*id);
        remote->reset();
        break;
      }
    }
  }
  // Notifications of the doomed writes may or may not have gone out; drain them.
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(d_->Progress().ok());
  d_->PollNotifications();
  // Still working: a write and its notification.
  auto src = Allocate(*p_, kPool);
  ASSERT_NE(src, nullptr);
  std::memset(src->base(), 7, 1 << 20);
  auto remote = p_->ImportRemote(to_d_, dst->descriptor());
  ASSERT_TRUE(remote.ok()) << remote.status();
  Segment s;
  s.length = 1 << 20;
  auto id = p_->PostWrite(to_d_, *src, **remote, {s}, "after");
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<Notification> notes = WaitForNotifications(1);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].payload, "after");
  const char* data = static_cast<const char*>(dst->base());
  EXPECT_TRUE(std::all_of(data, data + (1 << 20), [](char x) { return x == 7; }));
  p_->Release(*id);
  remote->reset();
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxPairTest, ::testing::Values("shm", "shm_copy", "tcp"),
                         [](const ::testing::TestParamInfo<std::string>& param) {
                           return param.param;
                         });

// Over TCP a peer that goes away closes its sockets: the sender's outstanding transfers
// fail, its status turns to an error naming it and the callback fires, without a hang.
TEST(UcxPeerFailureTest, DestroyedTcpPeerFailsOutstandingTransfers) {
  auto p = MakeTransport("tcp");
  auto d = MakeTransport("tcp");
  ASSERT_NE(p, nullptr);
  ASSERT_NE(d, nullptr);
  std::vector<char> src(kBytes, 1), dst(kBytes, 0);
  auto src_reg = p->RegisterMemory(src.data(), src.size(), MemoryKind::kHost);
  auto dst_reg = d->RegisterMemory(dst.data(), dst.size(), MemoryKind::kHost);
  ASSERT_TRUE(src_reg.ok() && dst_reg.ok());
  auto peer = p->Connect(*d->LocalInfo());
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto remote = p->ImportRemote(*peer, (*dst_reg)->descriptor());
  ASSERT_TRUE(remote.ok()) << remote.status();
  // One completed round first, so the connection is established.
  auto first = p->PostNotification(*peer, "hello");
  ASSERT_TRUE(first.ok());
  const absl::Time deadline = Deadline();
  while (absl::Now() < deadline && d->PollNotifications().empty()) {
    ASSERT_TRUE(p->Progress().ok());
    ASSERT_TRUE(d->Progress().ok());
  }
  ASSERT_TRUE(WaitForTransfer(*p, *first, Deadline()).ok());

  std::vector<std::pair<PeerId, absl::Status>> reported;
  p->SetPeerErrorCallback(
      [&](PeerId id, const absl::Status& error) { reported.emplace_back(id, error); });
  // The receiver does not progress, so these stay outstanding (TCP puts need it).
  std::vector<TransferId> ids;
  Segment whole;
  whole.length = kBytes;
  for (int i = 0; i < 8; ++i) {
    auto id = p->PostWrite(*peer, **src_reg, **remote, {whole}, "x");
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  dst_reg->reset();
  d.reset();
  int failed = 0;
  for (TransferId id : ids) {
    auto state = WaitForTransfer(*p, id, Deadline());
    ASSERT_NE(state.status().code(), absl::StatusCode::kDeadlineExceeded) << state.status();
    if (!state.ok()) ++failed;
  }
  EXPECT_GT(failed, 0);
  absl::Status status = p->PeerStatus(*peer);
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("peer ", *peer)));
  ASSERT_TRUE(p->Progress().ok());
  ASSERT_EQ(reported.size(), 1u);
  EXPECT_EQ(reported[0].first, *peer);
  auto later = p->PostWrite(*peer, **src_reg, **remote, {whole}, "late");
  EXPECT_EQ(later.status().code(), absl::StatusCode::kFailedPrecondition) << later.status();
  remote->reset();
}

TEST(UcxCreateTest, RejectsBadCopyThreadCounts) {
  UcxTransportOptions options;
  options.copy_threads = -1;
  auto t = CreateUcxTransport(options);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("copy_threads"));
  options.copy_threads = kMaxCopyThreads + 1;
  EXPECT_EQ(CreateUcxTransport(options).status().code(), absl::StatusCode::kInvalidArgument);
  // More copy threads than CPUs still works, with a warning that names the counts.
  std::vector<std::string> warnings;
  LogSink previous = SetLogSink([&](LogLevel level, absl::string_view message) {
    if (level == LogLevel::kWarning) warnings.emplace_back(message);
  });
  options.copy_threads = kMaxCopyThreads;
  EXPECT_TRUE(CreateUcxTransport(options).ok());
  SetLogSink(previous);
  const unsigned cpus = std::thread::hardware_concurrency();
  if (cpus != 0 && cpus <= static_cast<unsigned>(kMaxCopyThreads)) {
    ASSERT_EQ(warnings.size(), 1u);
    EXPECT_THAT(warnings[0], HasSubstr(absl::StrCat(kMaxCopyThreads, " copy threads on ", cpus,
                                                    " CPUs")));
  }
}

TEST(UcxCreateTest, RejectsUnknownTransports) {
  UcxTransportOptions options;
  options.tls = "";
  EXPECT_EQ(CreateUcxTransport(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.tls = "no_such_transport";
  auto t = CreateUcxTransport(options);
  // UCX either refuses the name or ends up with a worker nothing can reach; it must not
  // crash. When it refuses, the message names the operation.
  if (!t.ok()) {
    EXPECT_THAT(t.status().message(), HasSubstr("UCX"));
  }
}

}  // namespace
}  // namespace kvstream
