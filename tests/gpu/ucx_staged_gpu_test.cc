// GPU tests of the UCX transport's staged device path (transfer/src/ucx/staged_engine.h):
// two transports in this process, and this process writing into a peer process
// (ucx_staged_gpu_peer_main.cc), over shared memory and TCP on loopback. Blocks are
// scattered on both sides (random permutations), chunks are small so that one write takes
// many chunks and every slot's credit comes back several times, and every check is byte for
// byte. The destination is read on a non-blocking stream at the moment PollNotifications
// returns the notification, so a notification that overtook its scatter would show.
// Skips without a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gpu_test_util.h"
#include "gtest/gtest.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/transfer/transport.h"
#include "kvstream/transfer/ucx_transport.h"
#include "tests/integration/ucx_transport_peer.h"
#include "tests/unit/shuffled_slots.h"
#include "ucx_staged_kernels.h"

namespace kvstream {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kChunk = uint64_t{256} << 10;  // small: many chunks per write
constexpr int kSlots = 3;

absl::Time Deadline() { return absl::Now() + absl::Seconds(60); }

UcxTransportOptions Options(const std::string& tls) {
  UcxTransportOptions options;
  options.tls = tls;
  if (tls == "tcp") options.net_devices = "lo";
  options.staged_chunk_bytes = kChunk;
  options.staged_slots = kSlots;
  return options;
}

// Blocks of `block` bytes from shuffled source slots to shuffled destination slots.
std::vector<Segment> Scattered(size_t count, uint64_t block, size_t pool_blocks, uint32_t seed) {
  const testing_util::SlotPermutations slots =
      testing_util::ShuffledSlots(pool_blocks, pool_blocks, seed);
  std::vector<Segment> segments;
  for (size_t i = 0; i < count; ++i) {
    segments.push_back({slots.src[i] * block, slots.dst[i] * block, block});
  }
  return segments;
}

// What the destination holds after `segments` from a source with pattern `seed`, over
// `before` (its previous contents).
std::vector<char> Expected(std::vector<char> before, const std::vector<Segment>& segments,
                           uint32_t seed) {
  for (const Segment& s : segments) {
    for (uint64_t i = 0; i < s.length; ++i) {
      before[s.remote_offset + i] =
          static_cast<char>(gpu_test::PatternByte(seed, s.local_offset + i));
    }
  }
  return before;
}

// Reads device memory on a non-blocking stream (ordered after nothing of the transport's).
// Created on first use, so that a fixture on a machine without a GPU touches no CUDA.
class Reader {
 public:
  ~Reader() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  std::vector<char> Read(const void* device, size_t bytes) {
    if (stream_ == nullptr) {
      EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    }
    std::vector<char> out(bytes);
    EXPECT_EQ(cudaMemcpyAsync(out.data(), device, bytes, cudaMemcpyDeviceToHost, stream_),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    return out;
  }

 private:
  cudaStream_t stream_ = nullptr;
};

// "p" writes device memory into "d"'s device memory, both transports in this process.
class UcxStagedPairTest : public ::testing::TestWithParam<std::string> {
 protected:
  static constexpr uint64_t kBlock = 32 << 10;
  static constexpr size_t kPoolBlocks = 96;  // 3 MiB regions: 12 chunks for a full write
  static constexpr uint64_t kBytes = kBlock * kPoolBlocks;

  void SetUp() override {
    KVSTREAM_SKIP_WITHOUT_GPU();
    auto p = CreateUcxTransport(Options(GetParam()));
    auto d = CreateUcxTransport(Options(GetParam()));
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(d.ok()) << d.status();
    p_ = std::move(p).value();
    d_ = std::move(d).value();
    ASSERT_TRUE(p_->capabilities().device_memory);
    auto src = p_->AllocateMemory(kBytes, MemoryKind::kDevice);
    auto dst = d_->AllocateMemory(kBytes, MemoryKind::kDevice);
    ASSERT_TRUE(src.ok()) << src.status();
    ASSERT_TRUE(dst.ok()) << dst.status();
    src_ = std::move(src).value();
    dst_ = std::move(dst).value();
    ASSERT_EQ(gpu_test::LaunchFillPattern(src_->base(), kBytes, kSeed, nullptr), 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    auto peer = p_->Connect(*d_->LocalInfo());
    ASSERT_TRUE(peer.ok()) << peer.status();
    to_d_ = *peer;
    auto remote = p_->ImportRemote(to_d_, dst_->descriptor());
    ASSERT_TRUE(remote.ok()) << remote.status();
    remote_ = std::move(remote).value();
  }

  void TearDown() override {
    remote_.reset();
    src_.reset();
    dst_.reset();
  }

  // Progresses both until `done`; false at the deadline.
  bool ProgressUntil(const std::function<bool()>& done) {
    const absl::Time deadline = Deadline();
    while (absl::Now() < deadline) {
      EXPECT_TRUE(p_->Progress().ok());
      EXPECT_TRUE(d_->Progress().ok());
      if (done()) return true;
    }
    return false;
  }

  // Waits for the next notification and reads the destination the moment it is returned
  // (notifications that came together share that reading: all their data was in place).
  bool NextNotification(Notification* note, std::vector<char>* dst_at_delivery) {
    if (queued_.empty() && !ProgressUntil([&] {
          std::vector<Notification> notes = d_->PollNotifications();
          if (notes.empty()) return false;
          queued_dst_ = reader_.Read(dst_->base(), kBytes);
          for (Notification& n : notes) queued_.push_back(std::move(n));
          return true;
        })) {
      return false;
    }
    *note = std::move(queued_.front());
    queued_.pop_front();
    *dst_at_delivery = queued_dst_;
    return true;
  }

  absl::StatusOr<TransferState> Wait(TransferId id) {
    absl::StatusOr<TransferState> state = TransferState::kInProgress;
    ProgressUntil([&] {
      state = p_->Test(id);
      return !state.ok() || *state != TransferState::kInProgress;
    });
    return state;
  }

  static constexpr uint32_t kSeed = 11;
  std::deque<Notification> queued_;  // delivered, not yet looked at
  std::vector<char> queued_dst_;     // the destination when they were delivered
  std::unique_ptr<Transport> p_, d_;
  std::unique_ptr<MemoryRegistration> src_, dst_;
  std::unique_ptr<RemoteMemory> remote_;
  PeerId to_d_ = 0;
  Reader reader_;
};

TEST_P(UcxStagedPairTest, ScatteredWritesLandBeforeTheirNotifications) {
  std::vector<char> dst(kBytes, 0);
  // A full pool (12 chunks over 3 slots), then odd lengths at odd offsets (unaligned
  // pieces), then one block.
  std::vector<std::vector<Segment>> writes = {Scattered(kPoolBlocks, kBlock, kPoolBlocks, 1)};
  std::vector<Segment> odd = Scattered(40, kBlock, kPoolBlocks, 2);
  for (size_t i = 0; i < odd.size(); ++i) {
    odd[i].local_offset += i % 7;
    odd[i].remote_offset += (i * 5) % 11;
    odd[i].length = kBlock - 16 - i;
  }
  writes.push_back(odd);
  writes.push_back(Scattered(1, kBlock, kPoolBlocks, 3));
  for (size_t w = 0; w < writes.size(); ++w) {
    const std::string note = absl::StrCat("layer ", w);
    auto id = p_->PostWrite(to_d_, *src_, *remote_, writes[w], note);
    ASSERT_TRUE(id.ok()) << id.status();
    Notification n;
    std::vector<char> seen;
    ASSERT_TRUE(NextNotification(&n, &seen)) << "no notification for write " << w;
    EXPECT_EQ(n.payload, note);
    dst = Expected(dst, writes[w], kSeed);
    ASSERT_TRUE(seen == dst) << "write " << w << ": data not in place at its notification";
    auto state = Wait(*id);
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_EQ(*state, TransferState::kDone);
    p_->Release(*id);
  }
}

TEST_P(UcxStagedPairTest, NotificationWaitsForEveryEarlierWrite) {
  // K and V as two writes, only the second notified, then a notification alone.
  std::vector<Segment> k = Scattered(48, kBlock, kPoolBlocks, 4);
  std::vector<Segment> v = k;
  for (Segment& s : v) s.remote_offset = (s.remote_offset + kBytes / 2) % kBytes;
  auto a = p_->PostWrite(to_d_, *src_, *remote_, k, "");
  auto b = p_->PostWrite(to_d_, *src_, *remote_, v, "kv");
  auto c = p_->PostNotification(to_d_, "after");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  std::vector<char> expected = Expected(Expected(std::vector<char>(kBytes, 0), k, kSeed), v, kSeed);
  Notification n;
  std::vector<char> seen;
  ASSERT_TRUE(NextNotification(&n, &seen));
  EXPECT_EQ(n.payload, "kv");
  EXPECT_TRUE(seen == expected);
  ASSERT_TRUE(NextNotification(&n, &seen));
  EXPECT_EQ(n.payload, "after");
  for (TransferId id : {*a, *b, *c}) {
    auto state = Wait(id);
    ASSERT_TRUE(state.ok()) << state.status();
    p_->Release(id);
  }
}

TEST_P(UcxStagedPairTest, ReadyEventIsHonouredAndTailAppended) {
  // A producer stream rewrites the source with a new pattern after spinning for 200 ms and
  // writes an 8-byte tail into pinned memory; the write is posted at once, with the event
  // recorded after both. What lands must be the new pattern, and the tail the GPU's value.
  cudaStream_t producer = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking), cudaSuccess);
  uint64_t* tail = nullptr;
  ASSERT_EQ(cudaMallocHost(&tail, sizeof(uint64_t)), cudaSuccess);
  *tail = 0;
  constexpr uint32_t kNewSeed = 99;
  constexpr uint64_t kTail = 0x0123456789abcdefull;
  ASSERT_EQ(gpu_test::LaunchSlowFillPattern(src_->base(), kBytes, kNewSeed, 200, producer), 0);
  ASSERT_EQ(gpu_test::LaunchWriteTail(tail, kTail, producer), 0);
  cudaEvent_t ready = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(ready, producer), cudaSuccess);
  WriteOrder order;
  order.ready_event = ready;
  order.notification_tail = tail;
  order.notification_tail_bytes = sizeof(uint64_t);
  std::vector<Segment> segments = Scattered(64, kBlock, kPoolBlocks, 5);
  auto id = p_->PostWrite(to_d_, *src_, *remote_, segments, "sum:", order);
  ASSERT_TRUE(id.ok()) << id.status();
  // The event may be recorded again at once (its state was captured by PostWrite).
  ASSERT_EQ(cudaEventRecord(ready, producer), cudaSuccess);
  Notification n;
  std::vector<char> seen;
  ASSERT_TRUE(NextNotification(&n, &seen));
  std::string expected_note = "sum:";
  expected_note.append(reinterpret_cast<const char*>(&kTail), sizeof(kTail));
  EXPECT_EQ(n.payload, expected_note);
  EXPECT_TRUE(seen == Expected(std::vector<char>(kBytes, 0), segments, kNewSeed))
      << "the write did not wait for its ready event";
  ASSERT_TRUE(Wait(*id).ok());
  p_->Release(*id);
  cudaEventDestroy(ready);
  cudaStreamDestroy(producer);
  cudaFreeHost(tail);
}

TEST_P(UcxStagedPairTest, BadOrdersAndMixedMemoryAreRefused) {
  std::vector<Segment> one = Scattered(1, kBlock, kPoolBlocks, 6);
  uint64_t tail = 0;
  WriteOrder tail_without_event;
  tail_without_event.notification_tail = &tail;
  tail_without_event.notification_tail_bytes = 8;
  EXPECT_EQ(p_->PostWrite(to_d_, *src_, *remote_, one, "n", tail_without_event).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<char> host(kBytes);
  auto host_reg = p_->RegisterMemory(host.data(), host.size(), MemoryKind::kHost);
  ASSERT_TRUE(host_reg.ok());
  auto mixed = p_->PostWrite(to_d_, **host_reg, *remote_, one, "n");
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(mixed.status().message(), HasSubstr("host"));
  // Host memory is not device memory.
  EXPECT_EQ(p_->RegisterMemory(host.data(), host.size(), MemoryKind::kDevice).status().code(),
            absl::StatusCode::kInvalidArgument);
  Segment outside{kBytes - 8, 0, 16};
  EXPECT_EQ(p_->PostWrite(to_d_, *src_, *remote_, {outside}, "n").status().code(),
            absl::StatusCode::kOutOfRange);
}

TEST_P(UcxStagedPairTest, CancelledAndReleasedWritesLeaveTheStreamUsable) {
  // Writes cancelled or released right after posting (mid-chunk), their source destroyed
  // and freed at once; then a full write must still arrive, in place, with its notification.
  for (int i = 0; i < 6; ++i) {
    auto extra = p_->AllocateMemory(kBytes, MemoryKind::kDevice);
    ASSERT_TRUE(extra.ok());
    auto id = p_->PostWrite(to_d_, **extra, *remote_, Scattered(kPoolBlocks, kBlock, kPoolBlocks, 20 + i),
                            "dropped");
    ASSERT_TRUE(id.ok()) << id.status();
    for (int k = 0; k < i; ++k) ASSERT_TRUE(p_->Progress().ok());
    if (i % 2 == 0) {
      ASSERT_TRUE(p_->Cancel(*id).ok());
      auto state = p_->Test(*id);
      EXPECT_TRUE(!state.ok() || *state == TransferState::kDone) << "still in progress";
    }
    p_->Release(*id);
    extra->reset();  // waits for the GPU work that reads it, then frees it
  }
  std::vector<Segment> segments = Scattered(kPoolBlocks, kBlock, kPoolBlocks, 7);
  auto id = p_->PostWrite(to_d_, *src_, *remote_, segments, "final");
  ASSERT_TRUE(id.ok());
  Notification n;
  std::vector<char> seen;
  // Only "final" arrives (the cancelled writes' notifications are never sent).
  ASSERT_TRUE(NextNotification(&n, &seen));
  EXPECT_EQ(n.payload, "final");
  EXPECT_TRUE(seen == Expected(seen, segments, kSeed)) << "final write not in place";
  ASSERT_TRUE(Wait(*id).ok());
}

TEST_P(UcxStagedPairTest, DestroyingTheSenderWithWritesInFlightIsSafe) {
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(p_->PostWrite(to_d_, *src_, *remote_, Scattered(kPoolBlocks, kBlock, kPoolBlocks, i),
                              "x")
                    .ok());
  }
  remote_.reset();
  src_.reset();  // waits (bounded) for the gathers reading it
  p_.reset();    // waits (bounded) for every stream before freeing its buffers
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(d_->Progress().ok());
  dst_.reset();  // waits for scatters into it
  d_.reset();
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxStagedPairTest, ::testing::Values("shm", "tcp"));

// --- Two processes: this one writes, ucx_staged_gpu_peer receives ---

class UcxStagedProcessTest : public ::testing::TestWithParam<std::string> {
 protected:
  static constexpr uint64_t kBlock = 64 << 10;
  static constexpr size_t kPoolBlocks = 256;  // 16 MiB
  static constexpr uint64_t kBytes = kBlock * kPoolBlocks;

  void SetUp() override {
    KVSTREAM_SKIP_WITHOUT_GPU();
    auto child = test::ChildProcess::Spawn(
        {KVSTREAM_UCX_STAGED_PEER_BINARY, "--tls=" + GetParam(), absl::StrCat("--bytes=", kBytes),
         absl::StrCat("--chunk=", kChunk), absl::StrCat("--slots=", kSlots)});
    ASSERT_TRUE(child.ok()) << child.status();
    child_ = std::move(child).value();
    std::string info, descriptor;
    ASSERT_TRUE(ReadHex("INFO", &info));
    ASSERT_TRUE(ReadHex("DESC", &descriptor));
    auto ready = child_->reader().ReadLine(Deadline());
    ASSERT_TRUE(ready.ok() && *ready == "READY");
    auto t = CreateUcxTransport(Options(GetParam()));
    ASSERT_TRUE(t.ok()) << t.status();
    t_ = std::move(t).value();
    auto src = t_->AllocateMemory(kBytes, MemoryKind::kDevice);
    ASSERT_TRUE(src.ok()) << src.status();
    src_ = std::move(src).value();
    ASSERT_EQ(gpu_test::LaunchFillPattern(src_->base(), kBytes, kSeed, nullptr), 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    auto peer = t_->Connect(info);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
    auto remote = t_->ImportRemote(peer_, descriptor);
    ASSERT_TRUE(remote.ok()) << remote.status();
    remote_ = std::move(remote).value();
  }

  void TearDown() override {
    remote_.reset();
    src_.reset();
    t_.reset();
    child_.reset();
  }

  bool ReadHex(const std::string& tag, std::string* out) {
    auto line = child_->reader().ReadLine(Deadline());
    if (!line.ok() || !absl::StartsWith(*line, tag + " ")) return false;
    *out = absl::HexStringToBytes(line->substr(tag.size() + 1));
    return true;
  }

  // Posts `segments` with a "dump" notification and returns the region the peer saw when
  // that notification was delivered.
  std::vector<char> WriteAndDump(const std::vector<Segment>& segments, const std::string& tag) {
    auto id = t_->PostWrite(peer_, *src_, *remote_, segments, "dump " + tag);
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return {};
    auto state = WaitForTransfer(*t_, *id, Deadline());
    EXPECT_TRUE(state.ok()) << state.status();
    t_->Release(*id);
    // The peer answers only while this side keeps its endpoint alive: read with progress.
    std::vector<char> region(kBytes);
    const absl::Time deadline = Deadline();
    while (!child_->reader().Readable() && absl::Now() < deadline) EXPECT_TRUE(t_->Progress().ok());
    auto line = child_->reader().ReadLine(deadline);
    EXPECT_TRUE(line.ok()) << line.status();
    if (!line.ok()) return {};
    EXPECT_TRUE(absl::StartsWith(*line, "DUMP " + absl::BytesToHexString("dump " + tag))) << *line;
    EXPECT_TRUE(child_->reader().ReadExactly(region.data(), region.size(), deadline).ok());
    return region;
  }

  static constexpr uint32_t kSeed = 23;
  std::unique_ptr<test::ChildProcess> child_;
  std::unique_ptr<Transport> t_;
  std::unique_ptr<MemoryRegistration> src_;
  std::unique_ptr<RemoteMemory> remote_;
  PeerId peer_ = 0;
};

TEST_P(UcxStagedProcessTest, ScatteredWritesLandInThePeerBeforeItsNotification) {
  std::vector<char> expected(kBytes, 0);
  for (uint32_t round = 0; round < 3; ++round) {
    std::vector<Segment> segments = Scattered(kPoolBlocks - round * 50, kBlock, kPoolBlocks, round);
    expected = Expected(expected, segments, kSeed);
    std::vector<char> region = WriteAndDump(segments, absl::StrCat(round));
    ASSERT_TRUE(region == expected) << "round " << round;
  }
}

TEST_P(UcxStagedProcessTest, KilledPeerFailsTheWriteNamingIt) {
  // One write completes (the connection is up, so UCX watches the peer), then the peer is
  // killed while a long stream of writes is in flight.
  ASSERT_EQ(WriteAndDump(Scattered(16, kBlock, kPoolBlocks, 1), "warm").size(), kBytes);
  // 256 writes of 16 MiB (4 GiB: longer than 70 ms even at the PCIe ceiling); the peer is
  // killed as soon as the first has completed, so the stream is mid-way.
  std::vector<TransferId> ids;
  for (int i = 0; i < 256; ++i) {
    auto id = t_->PostWrite(peer_, *src_, *remote_, Scattered(kPoolBlocks, kBlock, kPoolBlocks, i),
                            "n");
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  auto first = WaitForTransfer(*t_, ids.front(), Deadline());
  ASSERT_TRUE(first.ok()) << first.status();
  child_->Kill();
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  auto state = WaitForTransfer(*t_, ids.back(), deadline);
  ASSERT_FALSE(state.ok()) << "a write to a dead peer reported success";
  EXPECT_NE(state.status().code(), absl::StatusCode::kDeadlineExceeded)
      << "the dead peer was not detected in 30 s: " << state.status();
  EXPECT_THAT(state.status().message(), HasSubstr("peer"));
  EXPECT_FALSE(t_->PeerStatus(peer_).ok());
  for (TransferId id : ids) t_->Release(id);
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxStagedProcessTest, ::testing::Values("shm", "tcp"));

}  // namespace
}  // namespace kvstream
