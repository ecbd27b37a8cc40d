// GPU tests of the nccl transport between two processes on two GPUs: this process writes
// from GPU 0, tests/gpu/nccl_peer_main.cc (forked and exec'd) receives on GPU 1. They
// exchange peer info and descriptors over pipes (the line protocol of
// tests/integration/ucx_transport_peer.h). NCCL cannot put two ranks on one GPU, so every
// test skips, saying so, where fewer than two GPUs are visible. NCCL_NVLS_ENABLE=0 is set
// before NCCL is first used (and the peer inherits it).
//
// What is checked, byte for byte, against a host mirror of the expected memory:
// - scattered writes (a random permutation of 1024 blocks of 32 KiB on both sides; segments
//   of odd lengths at odd offsets; runs long enough to move in place; a run contiguous on
//   both sides), with 4 MiB staging slots so that writes span many batches and both slots,
//   land before their notifications: the receiver copies its whole region to the host the
//   moment PollNotifications returns one; a notification alone follows every earlier write;
// - the batches wait for WriteOrder::ready_event (the source is written by a slow kernel on
//   another stream just before the post, and the event is re-recorded right after it) and
//   the notification carries WriteOrder::notification_tail;
// - a receiver killed (SIGKILL) with writes in flight fails them with an error naming it
//   before the wait's deadline, its communicator is aborted, later posts are refused;
// - a receiver that stops progressing (alive) fails the write at op_timeout;
// - a receiver of another job refuses a writer that forged its job id, and says why;
// - Disconnect aborts the communicator and the receiver sees a goodbye, not a failure.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "cuda_ipc_test_kernels.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/transfer/nccl_transport.h"
#include "tests/integration/ucx_transport_peer.h"
#include "transfer/src/nccl/nccl_wire.h"

#ifndef KVSTREAM_NCCL_PEER_BINARY
#error "KVSTREAM_NCCL_PEER_BINARY must name the peer program"
#endif

namespace kvstream {
namespace test {
namespace {

using ::testing::HasSubstr;

// Before any NCCL call of this process (and inherited by the peer).
const bool kNvlsOff = [] { return setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/1) == 0; }();

constexpr uint64_t kStaging = 4 << 20;
constexpr size_t kBlock = 32 << 10;

absl::Time Deadline() { return absl::Now() + absl::Seconds(60); }

absl::Status CudaOk(cudaError_t e, absl::string_view what) {
  return CudaErrorToStatus(static_cast<int>(e), what);
}

struct Note {
  std::string payload;
  std::vector<char> snapshot;
};

size_t Mismatches(const std::vector<char>& got, const std::vector<char>& want, size_t begin,
                  size_t end) {
  size_t n = 0;
  for (size_t i = begin; i < end; ++i) n += got[i] != want[i];
  return n;
}

void Apply(const std::vector<Segment>& segments, const std::vector<char>& src,
           std::vector<char>& dst) {
  for (const Segment& s : segments) {
    std::memcpy(dst.data() + s.remote_offset, src.data() + s.local_offset, s.length);
  }
}

// `count` segments of odd lengths at odd offsets into disjoint destination slots of
// [area, area + area_bytes); sources anywhere in [0, source_bytes).
std::vector<Segment> OddSegments(size_t count, uint64_t area, uint64_t area_bytes,
                                 uint64_t source_bytes, uint32_t seed) {
  std::mt19937_64 rng(seed);
  const uint64_t slot = area_bytes / count;
  std::vector<Segment> segments;
  for (size_t i = 0; i < count; ++i) {
    Segment s;
    const uint64_t skew = rng() % 17;
    s.remote_offset = area + i * slot + skew;
    s.length = i % 50 == 7 ? 0 : 1 + rng() % (slot - skew - 1);
    s.local_offset = rng() % (source_bytes - s.length);
    segments.push_back(s);
  }
  std::shuffle(segments.begin(), segments.end(), rng);
  return segments;
}

class NcclGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kNvlsOff);
    if (!BuiltWithNccl()) GTEST_SKIP() << "kvstream was built without NCCL";
    const int gpus = GpuCount();
    if (gpus < 2) {
      GTEST_SKIP() << "the nccl transport needs two GPUs (NCCL never puts two ranks on one "
                      "GPU); "
                   << gpus << " visible" << (gpus == 0 ? absl::StrCat(": ", CudaAvailability().ToString()) : "");
    }
    options_.device = 0;
    options_.staging_bytes = kStaging;
    options_.in_place_min_bytes = 1 << 20;
  }

  void TearDown() override {
    remote_.reset();
    src_.reset();
    child_.reset();
    transport_.reset();
  }

  void Spawn(size_t bytes, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {KVSTREAM_NCCL_PEER_BINARY, "--role=receiver", "--device=1",
                                     absl::StrCat("--bytes=", bytes),
                                     absl::StrCat("--staging=", kStaging)};
    args.insert(args.end(), extra.begin(), extra.end());
    auto child = ChildProcess::Spawn(args);
    ASSERT_TRUE(child.ok()) << child.status();
    child_ = std::move(child).value();
  }

  void MakeTransport() {
    auto transport = CreateNcclTransport(options_);
    ASSERT_TRUE(transport.ok()) << transport.status();
    transport_ = std::move(transport).value();
  }

  std::string ReadHex(absl::string_view tag) {
    auto line = child_->reader().ReadLine(Deadline());
    EXPECT_TRUE(line.ok()) << line.status();
    if (!line.ok()) return "";
    absl::string_view rest = *line;
    EXPECT_TRUE(absl::ConsumePrefix(&rest, tag) && absl::ConsumePrefix(&rest, " ")) << *line;
    return absl::HexStringToBytes(rest);
  }

  // Reads the receiver's INFO/DESC/READY; `info` gets its peer info.
  void ReadReceiver(std::string* info) {
    *info = ReadHex("INFO");
    descriptor_ = ReadHex("DESC");
    auto ready = child_->reader().ReadLine(Deadline());
    ASSERT_TRUE(ready.ok()) << ready.status();
    ASSERT_EQ(*ready, "READY");
  }

  void ConnectTo(const std::string& info) {
    auto peer = transport_->Connect(info);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
    auto remote = transport_->ImportRemote(peer_, descriptor_);
    ASSERT_TRUE(remote.ok()) << remote.status();
    remote_ = std::move(remote).value();
  }

  void StartPair(size_t bytes) {
    ASSERT_NO_FATAL_FAILURE(Spawn(bytes));
    ASSERT_NO_FATAL_FAILURE(MakeTransport());
    std::string info;
    ASSERT_NO_FATAL_FAILURE(ReadReceiver(&info));
    ASSERT_NO_FATAL_FAILURE(ConnectTo(info));
  }

  absl::StatusOr<std::string> ReadLineProgressing() {
    return test::ReadLineProgressing(child_->reader(), *transport_, Deadline());
  }

  absl::StatusOr<Note> ReadNote() {
    auto line = ReadLineProgressing();
    if (!line.ok()) return line.status();
    std::vector<std::string> parts = absl::StrSplit(*line, ' ');
    size_t bytes = 0;
    if (parts.size() != 3 || parts[0] != "NOTE" || !absl::SimpleAtoi(parts[2], &bytes)) {
      return absl::InternalError(absl::StrCat("expected NOTE, got '", *line, "'"));
    }
    Note note;
    note.payload = absl::HexStringToBytes(parts[1]);
    note.snapshot.resize(bytes);
    absl::Status read = child_->reader().ReadExactly(note.snapshot.data(), bytes, Deadline());
    if (!read.ok()) return read;
    return note;
  }

  void MakeSource(const std::vector<char>& host) {
    auto src = transport_->AllocateMemory(host.size(), MemoryKind::kDevice);
    ASSERT_TRUE(src.ok()) << src.status();
    src_ = std::move(src).value();
    ASSERT_TRUE(CudaOk(cudaMemcpy(src_->base(), host.data(), host.size(), cudaMemcpyHostToDevice),
                       "upload")
                    .ok());
  }

  void SayExitAndReap() {
    auto bye = transport_->PostNotification(peer_, "exit");
    ASSERT_TRUE(bye.ok()) << bye.status();
    auto note = ReadNote();
    ASSERT_TRUE(note.ok()) << note.status();
    EXPECT_EQ(note->payload, "exit");
    auto line = ReadLineProgressing();
    ASSERT_TRUE(line.ok()) << line.status();
    EXPECT_EQ(*line, "BYE");
    auto code = child_->Wait(Deadline());
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0);
  }

  NcclTransportOptions options_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<ChildProcess> child_;
  std::unique_ptr<MemoryRegistration> src_;
  std::unique_ptr<RemoteMemory> remote_;
  std::string descriptor_;
  PeerId peer_ = 0;
};

TEST_F(NcclGpuTest, ScatteredBlocksLandBeforeTheirNotifications) {
  constexpr size_t kBlocks = 1024;
  constexpr size_t kAreaA = kBlock * kBlocks;  // 32 MiB of whole blocks: 8 batches
  constexpr size_t kAreaB = 8 << 20;           // odd segments
  constexpr size_t kAreaC = 8 << 20;           // runs that move in place
  constexpr size_t kBytes = kAreaA + kAreaB + kAreaC;
  ASSERT_NO_FATAL_FAILURE(StartPair(kBytes));
  std::vector<char> host(kBytes);
  FillPattern(host.data(), host.size(), 11);
  ASSERT_NO_FATAL_FAILURE(MakeSource(host));

  std::vector<char> expected(kBytes, 0);
  const std::vector<Segment> blocks = ScatteredSegments(kBlocks, kBlock, kBlocks, 1);
  const std::vector<Segment> odd = OddSegments(1500, kAreaA, kAreaB, kBytes, 2);
  // Two runs of 3 MiB at odd offsets (in place on both sides) between short ones, and a run
  // of 64 blocks contiguous on both sides (coalesced into one message).
  std::vector<Segment> runs_built = {{17, kAreaA + kAreaB + 3, 3 << 20},
                               {5, kAreaA + kAreaB + (3 << 20) + 100, 999},
                               {(7 << 20) + 1, kAreaA + kAreaB + (4 << 20) + 7, 3 << 20}};
  for (uint64_t i = 0; i < 16; ++i) {
    runs_built.push_back({(12 << 20) + i * 4096, kAreaA + kAreaB + (7 << 20) + i * 4096, 4096});
  }
  const std::vector<Segment> runs = runs_built;
  Apply(blocks, host, expected);
  std::vector<TransferId> ids;
  for (const auto& [segments, name] :
       {std::make_pair(&blocks, "layer 0"), std::make_pair(&odd, "layer 1"),
        std::make_pair(&runs, "layer 2")}) {
    auto id = transport_->PostWrite(peer_, *src_, *remote_, *segments, name);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  auto fin = transport_->PostNotification(peer_, "fin");
  ASSERT_TRUE(fin.ok()) << fin.status();
  ids.push_back(*fin);

  auto first = ReadNote();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->payload, "layer 0");
  EXPECT_EQ(Mismatches(first->snapshot, expected, 0, kAreaA), 0u)
      << "layer 0 was notified before all of its blocks landed";
  Apply(odd, host, expected);
  auto second = ReadNote();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->payload, "layer 1");
  EXPECT_EQ(Mismatches(second->snapshot, expected, 0, kAreaA + kAreaB), 0u)
      << "layer 1 was notified before all of its odd segments landed";
  Apply(runs, host, expected);
  auto third = ReadNote();
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->payload, "layer 2");
  EXPECT_EQ(Mismatches(third->snapshot, expected, 0, kBytes), 0u)
      << "layer 2 was notified before its in-place runs landed";
  auto fourth = ReadNote();
  ASSERT_TRUE(fourth.ok()) << fourth.status();
  EXPECT_EQ(fourth->payload, "fin");
  EXPECT_TRUE(fourth->snapshot == expected);
  for (TransferId id : ids) {
    auto state = WaitForTransfer(*transport_, id, Deadline());
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_EQ(*state, TransferState::kDone);
    transport_->Release(id);
  }
  std::vector<Segment> bad = blocks;
  bad[17].remote_offset = kBytes - 1;
  auto refused = transport_->PostWrite(peer_, *src_, *remote_, bad, "bad");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kOutOfRange) << refused.status();
  EXPECT_EQ(NcclLiveCommunicatorCount(*transport_), 1u);
  SayExitAndReap();
}

TEST_F(NcclGpuTest, BatchesWaitForTheReadyEventAndTheNoticeCarriesTheTail) {
  constexpr size_t kBlocks = 512;
  constexpr size_t kBytes = kBlock * kBlocks;
  constexpr size_t kTail = 16;
  constexpr uint32_t kDataSeed = 5;
  constexpr uint32_t kTailSeed = 77;
  ASSERT_NO_FATAL_FAILURE(StartPair(kBytes));
  ASSERT_NO_FATAL_FAILURE(MakeSource(std::vector<char>(kBytes, 0)));
  auto producer = CudaStream::Create();
  auto idle = CudaStream::Create();
  auto ready = CudaEvent::Create();
  ASSERT_TRUE(producer.ok() && idle.ok() && ready.ok());
  void* tail = nullptr;
  ASSERT_TRUE(CudaOk(cudaHostAlloc(&tail, kTail, cudaHostAllocMapped), "cudaHostAlloc").ok());
  std::memset(tail, 0, kTail);
  ASSERT_TRUE(gpu_test::LaunchSlowFill(src_->base(), kBytes, kDataSeed, 300, producer->get()).ok());
  ASSERT_TRUE(gpu_test::LaunchWriteTail(tail, kTail, kTailSeed, producer->get()).ok());
  ASSERT_TRUE(ready->Record(producer->get()).ok());
  const std::vector<Segment> blocks = ScatteredSegments(kBlocks, kBlock, kBlocks, 9);
  WriteOrder order;
  order.ready_event = ready->get();
  order.notification_tail = tail;
  order.notification_tail_bytes = kTail;
  auto id = transport_->PostWrite(peer_, *src_, *remote_, blocks, "ready", order);
  ASSERT_TRUE(id.ok()) << id.status();
  // Captured by PostWrite: re-recorded at once where it completes immediately, it must not
  // let the batches start early.
  ASSERT_TRUE(ready->Record(idle->get()).ok());

  std::vector<char> fresh(kBytes);
  for (size_t i = 0; i < kBytes; ++i) {
    fresh[i] = static_cast<char>(gpu_test::IpcPatternByte(i, kDataSeed));
  }
  std::vector<char> expected(kBytes, 0);
  Apply(blocks, fresh, expected);
  std::string want_payload = "ready";
  for (size_t i = 0; i < kTail; ++i) {
    want_payload.push_back(static_cast<char>(gpu_test::IpcPatternByte(i, kTailSeed)));
  }
  auto note = ReadNote();
  ASSERT_TRUE(note.ok()) << note.status();
  EXPECT_EQ(absl::BytesToHexString(note->payload), absl::BytesToHexString(want_payload))
      << "the notification does not carry the tail the GPU wrote";
  EXPECT_EQ(Mismatches(note->snapshot, expected, 0, kBytes), 0u)
      << "the batches did not wait for ready_event (old data landed)";
  auto state = WaitForTransfer(*transport_, *id, Deadline());
  ASSERT_TRUE(state.ok()) << state.status();
  transport_->Release(*id);
  SayExitAndReap();
  EXPECT_TRUE(producer->Synchronize(absl::Seconds(30)).ok());
  cudaFreeHost(tail);
}

TEST_F(NcclGpuTest, AReceiverKilledFailsTheWritesInFlightBeforeTheDeadline) {
  constexpr size_t kBlocks = 2048;
  constexpr size_t kBytes = kBlock * kBlocks;  // 64 MiB
  ASSERT_NO_FATAL_FAILURE(StartPair(kBytes));
  std::vector<char> host(kBytes);
  FillPattern(host.data(), host.size(), 3);
  ASSERT_NO_FATAL_FAILURE(MakeSource(host));
  std::vector<PeerId> failed_peers;
  transport_->SetPeerErrorCallback(
      [&](PeerId peer, const absl::Status&) { failed_peers.push_back(peer); });
  // The communicator is up once one write went through.
  auto warm = transport_->PostWrite(peer_, *src_, *remote_,
                                    ScatteredSegments(64, kBlock, kBlocks, 1), "warm");
  ASSERT_TRUE(warm.ok()) << warm.status();
  auto note = ReadNote();
  ASSERT_TRUE(note.ok()) << note.status();
  std::vector<TransferId> ids;
  for (uint32_t i = 0; i < 16; ++i) {
    auto id = transport_->PostWrite(peer_, *src_, *remote_,
                                    ScatteredSegments(kBlocks, kBlock, kBlocks, 10 + i),
                                    absl::StrCat("layer ", i));
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  ASSERT_TRUE(transport_->Progress().ok());
  child_->Kill();
  // The wait's own deadline is far beyond what noticing the death takes; only the
  // transport's error may end it.
  const absl::Time deadline = absl::Now() + absl::Seconds(50);
  size_t failures = 0;
  for (TransferId id : ids) {
    auto state = WaitForTransfer(*transport_, id, deadline);
    if (state.ok()) continue;  // finished before the kill
    ++failures;
    EXPECT_THAT(state.status().message(), HasSubstr("nccl peer"));
    EXPECT_THAT(state.status().message(), ::testing::Not(HasSubstr("before its deadline")));
  }
  EXPECT_GT(failures, 0u) << "every write finished before the kill: nothing was tested";
  const absl::Status peer = transport_->PeerStatus(peer_);
  EXPECT_FALSE(peer.ok());
  EXPECT_THAT(peer.message(), HasSubstr("nccl peer"));
  EXPECT_EQ(failed_peers, std::vector<PeerId>{peer_});
  EXPECT_EQ(NcclLiveCommunicatorCount(*transport_), 0u) << "the communicator was not aborted";
  auto later = transport_->PostWrite(peer_, *src_, *remote_,
                                     ScatteredSegments(4, kBlock, kBlocks, 99), "later");
  EXPECT_EQ(later.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(NcclGpuTest, AReceiverThatStopsProgressingFailsTheWriteAtOpTimeout) {
  options_.op_timeout = absl::Seconds(3);
  constexpr size_t kBytes = kBlock * 512;
  ASSERT_NO_FATAL_FAILURE(StartPair(kBytes));
  ASSERT_NO_FATAL_FAILURE(MakeSource(std::vector<char>(kBytes, 1)));
  auto stall = transport_->PostNotification(peer_, "stall");
  ASSERT_TRUE(stall.ok());
  auto note = ReadNote();
  ASSERT_TRUE(note.ok()) << note.status();
  auto line = ReadLineProgressing();
  ASSERT_TRUE(line.ok() && *line == "STALLED") << (line.ok() ? *line : line.status().ToString());
  // Its receives are never posted: the send spins on the GPU until the deadline aborts it.
  auto id = transport_->PostWrite(peer_, *src_, *remote_,
                                  ScatteredSegments(512, kBlock, 512, 4), "never");
  ASSERT_TRUE(id.ok()) << id.status();
  auto state = WaitForTransfer(*transport_, *id, absl::Now() + absl::Seconds(50));
  ASSERT_FALSE(state.ok());
  EXPECT_EQ(state.status().code(), absl::StatusCode::kDeadlineExceeded) << state.status();
  EXPECT_THAT(state.status().message(), HasSubstr("op_timeout"));
  EXPECT_EQ(NcclLiveCommunicatorCount(*transport_), 0u);
}

TEST_F(NcclGpuTest, AReceiverOfAnotherJobRefusesAWriterThatForgedItsJob) {
  constexpr size_t kBytes = 1 << 20;
  options_.job_id = "job-a";
  ASSERT_NO_FATAL_FAILURE(Spawn(kBytes, {"--job=job-b"}));
  ASSERT_NO_FATAL_FAILURE(MakeTransport());
  std::string info;
  ASSERT_NO_FATAL_FAILURE(ReadReceiver(&info));
  // Refused at once from the peer info...
  auto at_once = transport_->Connect(info);
  EXPECT_EQ(at_once.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(at_once.status().message(), HasSubstr("job 'job-b'"));
  // ...and by the receiver itself, when the info lies.
  auto decoded = internal::DecodeNcclPeerInfo(info);
  ASSERT_TRUE(decoded.ok());
  decoded->job_id = "job-a";
  ASSERT_NO_FATAL_FAILURE(ConnectTo(internal::EncodeNcclPeerInfo(*decoded)));
  ASSERT_NO_FATAL_FAILURE(MakeSource(std::vector<char>(kBytes, 2)));
  auto id = transport_->PostWrite(peer_, *src_, *remote_, {{0, 0, 4096}}, "x");
  ASSERT_TRUE(id.ok()) << id.status();
  auto state = WaitForTransfer(*transport_, *id, Deadline());
  ASSERT_FALSE(state.ok());
  EXPECT_EQ(state.status().code(), absl::StatusCode::kFailedPrecondition) << state.status();
  EXPECT_THAT(state.status().message(), HasSubstr("refused this writer"));
  EXPECT_THAT(state.status().message(), HasSubstr("job-b"));
}

TEST_F(NcclGpuTest, DisconnectAbortsTheCommunicatorAndThePeerSeesAGoodbye) {
  constexpr size_t kBytes = kBlock * 64;
  ASSERT_NO_FATAL_FAILURE(StartPair(kBytes));
  ASSERT_NO_FATAL_FAILURE(MakeSource(std::vector<char>(kBytes, 3)));
  auto id = transport_->PostWrite(peer_, *src_, *remote_, ScatteredSegments(64, kBlock, 64, 5),
                                  "one");
  ASSERT_TRUE(id.ok());
  auto note = ReadNote();
  ASSERT_TRUE(note.ok()) << note.status();
  ASSERT_TRUE(WaitForTransfer(*transport_, *id, Deadline()).ok());
  remote_.reset();
  ASSERT_TRUE(transport_->Disconnect(peer_).ok());
  EXPECT_EQ(NcclLiveCommunicatorCount(*transport_), 0u);
  // The receiver ends its receive link when it reads the goodbye.
  const absl::Time deadline = Deadline();
  for (;;) {
    ASSERT_TRUE(WriteLine(child_->to_child(), "comms").ok());
    auto comms = child_->reader().ReadLine(deadline);
    ASSERT_TRUE(comms.ok()) << comms.status();
    if (*comms == "COMMS 0") break;
    ASSERT_EQ(*comms, "COMMS 1");
    ASSERT_LT(absl::Now(), deadline) << "the receiver kept its communicator";
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(WriteLine(child_->to_child(), "exit").ok());
  auto line = child_->reader().ReadLine(Deadline());
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_EQ(*line, "PEER OK") << "the receiver took a goodbye for a failure";
}

}  // namespace
}  // namespace test
}  // namespace kvstream
