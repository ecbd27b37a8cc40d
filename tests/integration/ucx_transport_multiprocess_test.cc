// Multi-process tests of the UCX transport, over shared memory and over TCP on loopback:
// a real second process (tests/integration/ucx_transport_peer_main.cc, forked and exec'd)
// exchanges its worker info and memory descriptor with this one over a pipe. Checks that
// scattered writes land byte for byte before their notification in both directions, into
// registered heap memory and into memory from Transport::AllocateMemory, and that
// a peer killed with SIGKILL mid-stream makes every outstanding transfer fail (before a
// generous deadline: no hang) with an error naming the peer. A hostile receiver whose
// descriptor claims more memory than it registered is refused where this process would
// write into the mapping itself, and cannot crash this process elsewhere.
#include <algorithm>
#include <cstdint>
#include <cstring>
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
#include "gtest/gtest.h"
#include "kvstream/transfer/transport.h"
#include "kvstream/transfer/ucx_transport.h"
#include "tests/integration/ucx_transport_peer.h"

#ifndef KVSTREAM_UCX_PEER_BINARY
#error "KVSTREAM_UCX_PEER_BINARY must name the peer program"
#endif

namespace kvstream {
namespace test {
namespace {

using ::testing::HasSubstr;

absl::Time Deadline() { return absl::Now() + absl::Seconds(60); }

class UcxMultiProcessTest : public ::testing::TestWithParam<std::string> {
 protected:
  // "shm_copy": shared memory with two copy threads on both sides.
  static bool Copying() { return GetParam() == "shm_copy"; }
  static std::string Tls() { return Copying() ? "shm" : GetParam(); }

  void SetUp() override {
    UcxTransportOptions options;
    options.tls = Tls();
    if (options.tls == "tcp") options.net_devices = "lo";
    if (Copying()) options.copy_threads = 2;
    auto transport = CreateUcxTransport(options);
    ASSERT_TRUE(transport.ok()) << transport.status();
    transport_ = std::move(transport).value();
  }

  void TearDown() override {
    remote_.reset();
    reg_.reset();
    child_.reset();
    transport_.reset();
  }

  void Spawn(std::vector<std::string> args) {
    args.insert(args.begin(), {KVSTREAM_UCX_PEER_BINARY, "--tls=" + Tls()});
    if (Copying()) args.push_back("--copy-threads=2");
    auto child = ChildProcess::Spawn(args);
    ASSERT_TRUE(child.ok()) << child.status();
    child_ = std::move(child).value();
  }

  // Reads "<tag> <hex>" from the child.
  std::string ReadHex(absl::string_view tag) {
    auto line = child_->reader().ReadLine(Deadline());
    EXPECT_TRUE(line.ok()) << line.status();
    if (!line.ok()) return "";
    absl::string_view rest = *line;
    EXPECT_TRUE(absl::ConsumePrefix(&rest, tag) && absl::ConsumePrefix(&rest, " ")) << *line;
    return absl::HexStringToBytes(rest);
  }

  // Reads the receiver's INFO/DESC/READY, connects and imports its region.
  void ConnectToReceiver() {
    const std::string info = ReadHex("INFO");
    const std::string descriptor = ReadHex("DESC");
    auto ready = child_->reader().ReadLine(Deadline());
    ASSERT_TRUE(ready.ok()) << ready.status();
    ASSERT_EQ(*ready, "READY");
    auto peer = transport_->Connect(info);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
    auto remote = transport_->ImportRemote(peer_, descriptor);
    ASSERT_TRUE(remote.ok()) << remote.status();
    remote_ = std::move(remote).value();
  }

  // Reads a line from the child, progressing this side meanwhile (what the child waits for
  // may need this side's progress, e.g. an active message queued over TCP).
  absl::StatusOr<std::string> ReadLineProgressing() {
    return test::ReadLineProgressing(child_->reader(), *transport_, Deadline());
  }

  void RegisterLocal(std::vector<char>& buffer) {
    auto reg = transport_->RegisterMemory(buffer.data(), buffer.size(), MemoryKind::kHost);
    ASSERT_TRUE(reg.ok()) << reg.status();
    reg_ = std::move(reg).value();
  }

  void ScatteredLayersLandBeforeTheirNotifications(const std::string& memory);
  void ChildWritesAndNotifiesAfterItsData(bool allocate);
  void WriteAndCheck(const RemoteMemory& remote, const std::vector<Segment>& segments,
                     const std::vector<char>& src, std::vector<char>& expected,
                     const std::string& tag);
  void ForgedRegionClaim(const std::string& memory);

  std::unique_ptr<Transport> transport_;
  std::unique_ptr<ChildProcess> child_;
  std::unique_ptr<MemoryRegistration> reg_;
  std::unique_ptr<RemoteMemory> remote_;
  PeerId peer_ = 0;
};

// Four "layers", each a scattered set of blocks in its own area, posted back to back with a
// "dump" notification each. The receiver copies out its whole buffer the moment it sees a
// notification, so every byte of that layer and the ones before must already be in place.
// `memory`: where the receiver's region comes from ("heap": RegisterMemory of its own buffer;
// "transport": AllocateMemory, which over shm the writer maps and copies into directly).
void UcxMultiProcessTest::ScatteredLayersLandBeforeTheirNotifications(const std::string& memory) {
  constexpr size_t kBlock = 16 << 10;
  constexpr size_t kPoolBlocks = 48;   // per layer area
  constexpr size_t kBlocksPerLayer = 32;
  constexpr int kLayers = 4;
  constexpr size_t kLayerBytes = kBlock * kPoolBlocks;
  constexpr size_t kBytes = kLayerBytes * kLayers;
  Spawn({"--role=receiver", absl::StrCat("--bytes=", kBytes), "--memory=" + memory});
  ASSERT_NO_FATAL_FAILURE(ConnectToReceiver());
  std::vector<char> src(kBytes);
  FillPattern(src.data(), src.size(), 99);
  ASSERT_NO_FATAL_FAILURE(RegisterLocal(src));

  std::vector<char> expected(kBytes, 0);
  std::vector<TransferId> ids;
  for (int layer = 0; layer < kLayers; ++layer) {
    std::vector<Segment> segments =
        ScatteredSegments(kBlocksPerLayer, kBlock, kPoolBlocks, 1000 + layer);
    for (Segment& s : segments) {
      s.local_offset += layer * kLayerBytes;
      s.remote_offset += layer * kLayerBytes;
      std::memcpy(expected.data() + s.remote_offset, src.data() + s.local_offset, s.length);
    }
    auto id = transport_->PostWrite(peer_, *reg_, *remote_, segments, absl::StrCat("dump ", layer));
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }

  std::vector<char> snapshot(kBytes);
  for (int layer = 0; layer < kLayers; ++layer) {
    auto line = ReadLineProgressing();
    ASSERT_TRUE(line.ok()) << line.status();
    ASSERT_EQ(*line, absl::StrCat("DUMP dump ", layer, " ", kBytes));
    ASSERT_TRUE(child_->reader().ReadExactly(snapshot.data(), kBytes, Deadline()).ok());
    // Every byte of this layer's area and the earlier ones, including the untouched zeros.
    const size_t checked = (layer + 1) * kLayerBytes;
    size_t mismatches = 0;
    for (size_t i = 0; i < checked; ++i) mismatches += snapshot[i] != expected[i];
    EXPECT_EQ(mismatches, 0u) << "layer " << layer << " notified before its data landed";
  }
  // The last snapshot is the whole region: later layers' areas must match too.
  EXPECT_TRUE(snapshot == expected);
  for (TransferId id : ids) {
    auto state = WaitForTransfer(*transport_, id, Deadline());
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_EQ(*state, TransferState::kDone);
    transport_->Release(id);
  }
  auto bye = transport_->PostNotification(peer_, "exit");
  ASSERT_TRUE(bye.ok());
  auto line = ReadLineProgressing();
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_EQ(*line, "BYE");
  auto exit_code = child_->Wait(Deadline());
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
}

TEST_P(UcxMultiProcessTest, ScatteredLayersLandBeforeTheirNotifications) {
  ScatteredLayersLandBeforeTheirNotifications("heap");
}

TEST_P(UcxMultiProcessTest, ScatteredLayersIntoAllocatedMemoryLandBeforeTheirNotifications) {
  ScatteredLayersLandBeforeTheirNotifications("transport");
}

// The other direction: the child writes scattered blocks into this process's memory (a heap
// buffer, or memory from AllocateMemory when `allocate`); at the moment its notification is
// polled here, every byte must be in place.
void UcxMultiProcessTest::ChildWritesAndNotifiesAfterItsData(bool allocate) {
  constexpr size_t kBlock = 8 << 10;
  constexpr size_t kPoolBlocks = 256;
  constexpr size_t kCount = 200;
  constexpr size_t kBytes = kBlock * kPoolBlocks;
  constexpr uint32_t kSeed = 4242;
  std::vector<char> heap(allocate ? 0 : kBytes, 0);
  if (allocate) {
    auto reg = transport_->AllocateMemory(kBytes, MemoryKind::kHost);
    ASSERT_TRUE(reg.ok()) << reg.status();
    reg_ = std::move(reg).value();
  } else {
    ASSERT_NO_FATAL_FAILURE(RegisterLocal(heap));
  }
  const char* dst = static_cast<const char*>(reg_->base());
  Spawn({"--role=writer", absl::StrCat("--bytes=", kBytes), absl::StrCat("--block=", kBlock),
         absl::StrCat("--count=", kCount), absl::StrCat("--seed=", kSeed)});
  ASSERT_TRUE(WriteLine(child_->to_child(),
                        "INFO " + absl::BytesToHexString(*transport_->LocalInfo()))
                  .ok());
  ASSERT_TRUE(WriteLine(child_->to_child(), "DESC " + absl::BytesToHexString(reg_->descriptor()))
                  .ok());

  std::vector<char> src(kBytes);
  FillPattern(src.data(), src.size(), kSeed);
  std::vector<char> expected(kBytes, 0);
  for (const Segment& s : ScatteredSegments(kCount, kBlock, kPoolBlocks, kSeed)) {
    std::memcpy(expected.data() + s.remote_offset, src.data() + s.local_offset, s.length);
  }
  std::vector<Notification> notes;
  const absl::Time deadline = Deadline();
  while (notes.empty()) {
    ASSERT_TRUE(transport_->Progress().ok());
    notes = transport_->PollNotifications();
    ASSERT_LT(absl::Now(), deadline) << "no notification from the writer";
  }
  // Compared before anything else can run in this process.
  const bool all_bytes_match = std::equal(dst, dst + kBytes, expected.begin());
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].payload, "written");
  EXPECT_TRUE(all_bytes_match) << "the notification arrived before (all of) its data";
  EXPECT_TRUE(transport_->PeerStatus(notes[0].peer).ok());

  // The writer reports its own view of the transfer.
  auto line = ReadLineProgressing();
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_EQ(*line, "DONE OK");
  ASSERT_TRUE(WriteLine(child_->to_child(), "exit").ok());
  auto exit_code = child_->Wait(Deadline());
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
}

TEST_P(UcxMultiProcessTest, ChildWritesAndNotifiesAfterItsData) {
  ChildWritesAndNotifiesAfterItsData(/*allocate=*/false);
}

TEST_P(UcxMultiProcessTest, ChildWritesIntoAllocatedMemoryAndNotifiesAfterItsData) {
  ChildWritesAndNotifiesAfterItsData(/*allocate=*/true);
}

// The receiver, once connected (a peer that dies before UCX's connection handshake finished
// is not detected by UCX 1.13: the sender's deadline is the only guard there), stops
// progressing, so transfers to it pile up in flight; then it is killed. Every transfer still
// in flight must fail with an error naming the peer, the peer's status must turn to that
// error, the callback must report it once, and later posts must fail. With copy threads the
// receiver's region is from AllocateMemory, so that the writes are copies into its mapped
// segment (which outlives the dead process in this one), and more transfers are posted:
// their data lands without the receiver, so only a full notification queue keeps them in
// flight.
TEST_P(UcxMultiProcessTest, PeerKilledMidStreamFailsOutstandingTransfers) {
  constexpr size_t kBlock = 64 << 10;
  constexpr size_t kPoolBlocks = 64;
  constexpr size_t kBytes = kBlock * kPoolBlocks;
  Spawn({"--role=receiver", absl::StrCat("--bytes=", kBytes),
         Copying() ? "--memory=transport" : "--memory=heap"});
  ASSERT_NO_FATAL_FAILURE(ConnectToReceiver());
  ASSERT_EQ(UcxWritesAreCopied(*remote_), Copying());
  std::vector<char> src(kBytes, 7);
  ASSERT_NO_FATAL_FAILURE(RegisterLocal(src));
  std::vector<std::pair<PeerId, absl::Status>> reported;
  transport_->SetPeerErrorCallback(
      [&](PeerId peer, const absl::Status& error) { reported.emplace_back(peer, error); });
  auto warmup = transport_->PostWrite(peer_, *reg_, *remote_,
                                      ScatteredSegments(8, kBlock, kPoolBlocks, 0), "stall");
  ASSERT_TRUE(warmup.ok()) << warmup.status();
  auto stalled = ReadLineProgressing();
  ASSERT_TRUE(stalled.ok()) << stalled.status();
  ASSERT_EQ(*stalled, "STALLED");
  auto warm = WaitForTransfer(*transport_, *warmup, Deadline());
  ASSERT_TRUE(warm.ok()) << warm.status();

  std::vector<TransferId> ids;
  for (int i = 0; i < (Copying() ? 512 : 64); ++i) {
    auto id = transport_->PostWrite(peer_, *reg_, *remote_,
                                    ScatteredSegments(8, kBlock, kPoolBlocks, i), "layer");
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
    ASSERT_TRUE(transport_->Progress().ok());
  }
  std::vector<TransferId> in_flight;
  for (TransferId id : ids) {
    auto state = transport_->Test(id);
    ASSERT_TRUE(state.ok()) << state.status();
    if (*state == TransferState::kInProgress) in_flight.push_back(id);
  }
  ASSERT_FALSE(in_flight.empty()) << "nothing in flight: the test would prove nothing";

  child_->Kill();
  // With copy threads, a transfer still copying at the kill may yet complete: its data lands
  // in the segment and its notification in the dead receiver's queue while there is room,
  // which this side cannot tell from a live receiver. The rest must fail.
  int failed = 0;
  for (TransferId id : in_flight) {
    auto state = WaitForTransfer(*transport_, id, Deadline());
    if (state.ok()) {
      ASSERT_TRUE(Copying()) << "transfer " << id << " completed to a dead peer";
      continue;
    }
    ASSERT_NE(state.status().code(), absl::StatusCode::kDeadlineExceeded)
        << "the peer's death was not detected: " << state.status();
    EXPECT_THAT(state.status().message(), HasSubstr(absl::StrCat("peer ", peer_)));
    ++failed;
  }
  EXPECT_GT(failed, 0);
  absl::Status peer_status = transport_->PeerStatus(peer_);
  EXPECT_FALSE(peer_status.ok());
  EXPECT_THAT(peer_status.message(), HasSubstr(absl::StrCat("peer ", peer_)));
  ASSERT_TRUE(transport_->Progress().ok());
  ASSERT_EQ(reported.size(), 1u);
  EXPECT_EQ(reported[0].first, peer_);
  auto later = transport_->PostWrite(peer_, *reg_, *remote_,
                                     ScatteredSegments(1, kBlock, kPoolBlocks, 1), "late");
  EXPECT_EQ(later.status().code(), absl::StatusCode::kFailedPrecondition) << later.status();
  // Disconnecting a failed peer force-closes its endpoint and forgets it.
  EXPECT_TRUE(transport_->Disconnect(peer_).ok());
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(transport_->Progress().ok());
  EXPECT_EQ(transport_->PeerStatus(peer_).code(), absl::StatusCode::kNotFound);
}

// Over TCP, the writer's data still queued in the sockets when the writer goes away lands
// at the receiver after the writer's connection is gone, the case of a prefill worker that
// dies with writes in flight or whose partition heals after it was given up
// (docs/scale-out.md). The receiver must live through it. With UCX's emulated puts it did
// not: the receiver acknowledges every put fragment, and UCX 1.13 aborted it ("Fatal:
// unexpected error") when the acknowledgement met the reset connection. Here the receiver
// is stopped (SIGSTOP) while a large write fills the sockets, this side's transport is
// destroyed (its connections closed), and the receiver continues and drains what arrives.
TEST_P(UcxMultiProcessTest, LateWritesFromAWriterThatIsGoneDoNotKillTheReceiver) {
  if (GetParam() != "tcp") GTEST_SKIP() << "late socket data is a TCP case";
  constexpr size_t kBytes = size_t{32} << 20;
  Spawn({"--role=receiver", absl::StrCat("--bytes=", kBytes), "--memory=heap"});
  ASSERT_NO_FATAL_FAILURE(ConnectToReceiver());
  std::vector<char> src(kBytes, 7);
  ASSERT_NO_FATAL_FAILURE(RegisterLocal(src));
  // A first write, so that the endpoint is wired up before the receiver stops.
  auto hello = transport_->PostWrite(peer_, *reg_, *remote_, {Segment{0, 0, 4096}}, "hello");
  ASSERT_TRUE(hello.ok()) << hello.status();
  auto noted = ReadLineProgressing();
  ASSERT_TRUE(noted.ok()) << noted.status();
  ASSERT_EQ(*noted, "NOTE hello");
  ASSERT_TRUE(WaitForTransfer(*transport_, *hello, Deadline()).ok());

  child_->Stop();
  // The whole region in one write: more than the sockets hold, so some of it waits here
  // and the rest sits in the sockets until the receiver reads again.
  auto big = transport_->PostWrite(peer_, *reg_, *remote_, {Segment{0, 0, kBytes}}, "late");
  ASSERT_TRUE(big.ok()) << big.status();
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(transport_->Progress().ok());
  auto state = transport_->Test(*big);
  ASSERT_TRUE(state.ok()) << state.status();
  ASSERT_EQ(*state, TransferState::kInProgress) << "nothing in flight: the test proves nothing";
  transport_.reset();  // closes this side's connections; the registrations go after it
  remote_.reset();
  reg_.reset();

  child_->Continue();
  ASSERT_TRUE(WriteLine(child_->to_child(), "drain").ok());
  auto landed = child_->reader().ReadLine(Deadline());
  if (!landed.ok()) {
    auto exit_code = child_->Wait(Deadline());
    FAIL() << "the receiver died draining the late writes: " << landed.status() << "; "
           << (exit_code.ok() ? absl::StrCat("exit ", *exit_code) : exit_code.status().ToString());
  }
  absl::string_view count = *landed;
  size_t bytes = 0;
  ASSERT_TRUE(absl::ConsumePrefix(&count, "LANDED ") && absl::SimpleAtoi(count, &bytes))
      << *landed;
  // The receiver must have handled late data for the test to mean anything (the first
  // 4096 bytes are the first write's).
  EXPECT_GT(bytes, 4096u) << "no late data reached the receiver";
  ASSERT_TRUE(WriteLine(child_->to_child(), "exit").ok());
  auto exit_code = child_->Wait(Deadline());
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
}

// Writes `segments` from the local registration into `remote` with a "dump" notification
// and checks the receiver's whole region (as it dumps it) against `expected`, updated here.
void UcxMultiProcessTest::WriteAndCheck(const RemoteMemory& remote,
                                        const std::vector<Segment>& segments,
                                        const std::vector<char>& src, std::vector<char>& expected,
                                        const std::string& tag) {
  for (const Segment& s : segments) {
    std::memcpy(expected.data() + s.remote_offset, src.data() + s.local_offset, s.length);
  }
  auto id = transport_->PostWrite(peer_, *reg_, remote, segments, "dump " + tag);
  ASSERT_TRUE(id.ok()) << id.status();
  auto line = ReadLineProgressing();
  ASSERT_TRUE(line.ok()) << line.status();
  ASSERT_EQ(*line, absl::StrCat("DUMP dump ", tag, " ", expected.size()));
  std::vector<char> snapshot(expected.size());
  ASSERT_TRUE(child_->reader().ReadExactly(snapshot.data(), snapshot.size(), Deadline()).ok());
  EXPECT_TRUE(snapshot == expected) << "the receiver's region does not hold what was written";
  auto state = WaitForTransfer(*transport_, *id, Deadline());
  ASSERT_TRUE(state.ok()) << state.status();
  transport_->Release(*id);
}

// A hostile receiver registers kBytes (`memory`: "transport", from AllocateMemory, which
// over shm this process maps and writes into itself; "guarded", a buffer followed by
// inaccessible pages, which UCX reaches through the kernel or the network) and hands out a
// descriptor claiming four times as much. Where this process would write into the mapping
// itself, the import is refused, naming the peer and the sizes. Elsewhere the claim cannot
// be checked here (UCX places the bytes on the receiver's side): a write into the
// claimed-but-unregistered part must still end (done, or with an error naming the peer)
// without crashing this process; the lying receiver may crash itself.
// Either way writes within the real region (through the forged descriptor where it was
// accepted, and through the real one) land byte for byte.
void UcxMultiProcessTest::ForgedRegionClaim(const std::string& memory) {
  constexpr size_t kBlock = 16 << 10;
  constexpr size_t kBlocks = 64;
  constexpr size_t kBytes = kBlock * kBlocks;
  constexpr size_t kClaim = 4 * kBytes;
  Spawn({"--role=receiver", absl::StrCat("--bytes=", kBytes), "--memory=" + memory,
         absl::StrCat("--claim-bytes=", kClaim)});
  const std::string info = ReadHex("INFO");
  const std::string forged = ReadHex("DESC");
  const std::string real = ReadHex("REAL");
  auto ready = child_->reader().ReadLine(Deadline());
  ASSERT_TRUE(ready.ok()) << ready.status();
  ASSERT_EQ(*ready, "READY");
  auto peer = transport_->Connect(info);
  ASSERT_TRUE(peer.ok()) << peer.status();
  peer_ = *peer;
  std::vector<char> src(kClaim);
  FillPattern(src.data(), src.size(), 31);
  ASSERT_NO_FATAL_FAILURE(RegisterLocal(src));
  std::vector<char> expected(kBytes, 0);

  auto imported = transport_->ImportRemote(peer_, forged);
  // Over shm, AllocateMemory's segment is mapped here; a heap or mmap'd buffer never is.
  if (Tls() == "shm" && memory == "transport") {
    ASSERT_FALSE(imported.ok()) << "a region claiming more than its key maps was imported";
    EXPECT_EQ(imported.status().code(), absl::StatusCode::kInvalidArgument) << imported.status();
    EXPECT_THAT(imported.status().message(), HasSubstr(absl::StrCat("peer ", peer_)));
    EXPECT_THAT(imported.status().message(), HasSubstr(absl::StrCat("claims ", kClaim, " bytes")));
    // The peer's real descriptor still imports, and writes through it land.
    auto honest = transport_->ImportRemote(peer_, real);
    ASSERT_TRUE(honest.ok()) << honest.status();
    remote_ = std::move(honest).value();
    EXPECT_EQ(UcxWritesAreCopied(*remote_), Copying());
    ASSERT_NO_FATAL_FAILURE(WriteAndCheck(*remote_, ScatteredSegments(24, kBlock, kBlocks, 5),
                                          src, expected, "real"));
    auto bye = transport_->PostNotification(peer_, "exit");
    ASSERT_TRUE(bye.ok()) << bye.status();
    auto line = ReadLineProgressing();
    ASSERT_TRUE(line.ok()) << line.status();
    EXPECT_EQ(*line, "BYE");
    auto exit_code = child_->Wait(Deadline());
    ASSERT_TRUE(exit_code.ok()) << exit_code.status();
    EXPECT_EQ(*exit_code, 0);
    return;
  }
  // Nothing maps the region here, so nothing can check the claim here: it is accepted.
  ASSERT_TRUE(imported.ok()) << imported.status();
  remote_ = std::move(imported).value();
  ASSERT_FALSE(UcxWritesAreCopied(*remote_));
  ASSERT_NO_FATAL_FAILURE(WriteAndCheck(*remote_, ScatteredSegments(24, kBlock, kBlocks, 5),
                                        src, expected, "in"));
  // One block inside the claimed range, past the registration: UCX places it in the
  // receiver's address space on the receiver's side (software RMA, TCP), where the lie
  // may bring the liar down. This process must stay up and the transfer must end, done (the
  // bytes left before the receiver failed) or with an error naming the peer; never hang.
  const std::vector<Segment> beyond = {{0, kBytes + 2 * kBlock, kBlock}};
  auto id = transport_->PostWrite(peer_, *reg_, *remote_, beyond, "dump beyond");
  ASSERT_TRUE(id.ok()) << id.status();
  const absl::Time deadline = Deadline();
  absl::StatusOr<TransferState> state = TransferState::kInProgress;
  while (state.ok() && *state == TransferState::kInProgress) {
    ASSERT_LT(absl::Now(), deadline) << "the write past the registration never ended";
    ASSERT_TRUE(transport_->Progress().ok());
    state = transport_->Test(*id);
    // A receiver that died is reaped, as its parent would: UCX tells a dead peer from a live
    // one only once its process is gone.
    (void)child_->Wait(absl::Now());
  }
  if (!state.ok()) {
    EXPECT_THAT(state.status().message(), HasSubstr(absl::StrCat("peer ", peer_)));
  }
  transport_->Release(*id);
}

TEST_P(UcxMultiProcessTest, ForgedClaimOnAllocatedMemory) { ForgedRegionClaim("transport"); }
TEST_P(UcxMultiProcessTest, ForgedClaimOnGuardedMemory) { ForgedRegionClaim("guarded"); }

INSTANTIATE_TEST_SUITE_P(Tls, UcxMultiProcessTest, ::testing::Values("shm", "shm_copy", "tcp"),
                         [](const ::testing::TestParamInfo<std::string>& param) {
                           return param.param;
                         });

}  // namespace
}  // namespace test
}  // namespace kvstream
