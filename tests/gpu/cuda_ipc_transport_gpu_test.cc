// GPU tests of the cuda_ipc transport between two processes on one GPU: this process and
// tests/gpu/cuda_ipc_peer_main.cc, forked and exec'd (the child calls only async-signal-
// safe functions before exec, so it starts with a CUDA runtime of its own even though this
// process initialised CUDA to decide whether to skip). They exchange peer info and
// descriptors over pipes (the line protocol of tests/integration/ucx_transport_peer.h).
//
// What is checked, byte for byte, against a host mirror of the expected memory:
// - scattered writes (random permutations of 1024 blocks of 32 KiB on both sides, then
//   segments of odd lengths at odd offsets, more than a parameter table holds, then long
//   segments cut into pieces) land before their notifications: the receiver copies its
//   whole region to the host the moment PollNotifications returns one;
// - the copy waits for WriteOrder::ready_event (the source is written by a slow kernel on
//   another stream just before the post, and the event is re-recorded right after it) and
//   the notification carries WriteOrder::notification_tail, written by that kernel's stream;
// - both of the above under every variant of the copy path (kernel shape and where its
//   table goes, CudaIpcTransportOptions), so that one GPU run proves each correct;
// - two regions carved from one cudaMalloc, imported by the writer, are opened once, and a
//   receiver names a sender that never connected back;
// - registration refuses pinned host memory and stream-ordered pool memory saying why, and
//   describes a sub-range of AllocateMemory's memory by its offset in the allocation;
// - imports are checked against what was mapped, not what a descriptor claims;
// - Disconnect closes the mappings and the peer sees a goodbye, not a failure;
// - a peer killed (SIGKILL) with writes in flight fails them with an error naming it,
//   before a deadline, and the mappings close once the copies are done.
// Skips, saying why, where no GPU can be used.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cuda_ipc_test_kernels.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/transfer/cuda_ipc_transport.h"
#include "tests/integration/ucx_transport_peer.h"
#include "transport_pair_test.h"
#include "transfer/src/cuda_ipc/cuda_ipc_wire.h"

#ifndef KVSTREAM_CUDA_IPC_PEER_BINARY
#error "KVSTREAM_CUDA_IPC_PEER_BINARY must name the peer program"
#endif

namespace kvstream {
namespace test {
namespace {

using ::testing::HasSubstr;

bool LaunchSlowFillChecked(void* dst, size_t bytes, uint32_t seed, void* stream,
                           int spin_ms = 300) {
  const absl::Status status = gpu_test::LaunchSlowFill(dst, bytes, seed, spin_ms, stream);
  if (!status.ok()) ADD_FAILURE() << status;
  return status.ok();
}

class CudaIpcGpuTest : public TransportPairTest {
 protected:
  void SetUp() override {
    if (GpuCount() == 0) GTEST_SKIP() << "no usable GPU: " << CudaAvailability();
  }

  // The peer program with `args`.
  void Spawn(std::vector<std::string> args) {
    args.insert(args.begin(), KVSTREAM_CUDA_IPC_PEER_BINARY);
    TransportPairTest::Spawn(args);
  }

  void MakeTransport() {
    auto transport = CreateCudaIpcTransport(options_);
    ASSERT_TRUE(transport.ok()) << transport.status();
    transport_ = std::move(transport).value();
  }

  CudaIpcTransportOptions options_;
};

// A variant of the copy path under test.
struct CopyVariant {
  const char* name;
  CudaIpcTransportOptions options;
};

// gtest prints a parameter by its name, not its bytes.
void PrintTo(const CopyVariant& v, std::ostream* os) { *os << v.name; }

CopyVariant Variant(const char* name, CudaIpcKernel kernel, CudaIpcTableMode table,
                    int vectors = 8) {
  CopyVariant v{name, CudaIpcTransportOptions{}};
  v.options.kernel = kernel;
  v.options.table = table;
  v.options.vectors_per_thread = vectors;
  return v;
}

std::vector<CopyVariant> CopyVariants() {
  using K = CudaIpcKernel;
  using T = CudaIpcTableMode;
  std::vector<CopyVariant> v = {
      {"Default", CudaIpcTransportOptions{}},
      Variant("ChunkedStreamCopy", K::kChunked, T::kStreamCopy, 4),
      Variant("ChunkedSideCopy", K::kChunked, T::kSideStreamCopy, 2),
      Variant("ChunkedZeroCopy", K::kChunked, T::kZeroCopy, 8),
      Variant("CtaStreamCopy", K::kCtaPerSegment, T::kStreamCopy),
      Variant("CtaSideCopy", K::kCtaPerSegment, T::kSideStreamCopy),
      Variant("CtaZeroCopy", K::kCtaPerSegment, T::kZeroCopy, 4),
      Variant("ChunkedAuto", K::kChunked, T::kAuto, 4),
      Variant("WarpAuto", K::kWarpPerSegment, T::kAuto),
      Variant("CtaParamsV2", K::kCtaPerSegment, T::kParams, 2),
      Variant("WarpParams", K::kWarpPerSegment, T::kParams),
      Variant("WarpZeroCopy", K::kWarpPerSegment, T::kZeroCopy, 4),
      Variant("WarpSideCopy", K::kWarpPerSegment, T::kSideStreamCopy, 2),
      Variant("WideCtaZeroCopyV2", K::kWideCtaPerSegment, T::kZeroCopy, 2),
      Variant("WideCtaParamsV4", K::kWideCtaPerSegment, T::kParams, 4),
      Variant("WideCtaStreamCopyV8", K::kWideCtaPerSegment, T::kStreamCopy, 8),
  };
  CopyVariant per_entry{"CtaParamsUnitPerEntry", CudaIpcTransportOptions{}};
  per_entry.options.table = T::kParams;
  per_entry.options.unit_per_entry = true;
  v.push_back(per_entry);
  CopyVariant wide_per_entry = Variant("WideCtaZeroCopyUnitPerEntry", K::kWideCtaPerSegment,
                                       T::kZeroCopy, 2);
  wide_per_entry.options.unit_per_entry = true;
  v.push_back(wide_per_entry);
  CopyVariant warp_per_entry = Variant("WarpZeroCopyUnitPerEntry", K::kWarpPerSegment,
                                       T::kZeroCopy);
  warp_per_entry.options.unit_per_entry = true;
  v.push_back(warp_per_entry);
  // 4 KiB pieces: every block is 8 entries, more than any parameter table holds.
  CopyVariant small{"CtaParamsSmallPieces", CudaIpcTransportOptions{}};
  small.options.table = T::kParams;
  small.options.max_piece_bytes = 4 << 10;
  v.push_back(small);
  // Long segments through the copy engine, the rest through the kernel.
  CopyVariant engine{"CopyEngineForLong", CudaIpcTransportOptions{}};
  engine.options.copy_engine_min_bytes = 1 << 20;
  v.push_back(engine);
  // A ring that starts tiny and must grow while earlier tables are still in use.
  CopyVariant tiny = Variant("CtaZeroCopyTinyRing", K::kCtaPerSegment, T::kZeroCopy);
  tiny.options.staging_segments = 16;
  v.push_back(tiny);
  // The same with the default table mode: the ring grows under tables copied on the side
  // stream and tables read in place.
  CopyVariant tiny_auto{"DefaultTinyRing", CudaIpcTransportOptions{}};
  tiny_auto.options.staging_segments = 16;
  v.push_back(tiny_auto);
  return v;
}

class CudaIpcVariantGpuTest : public CudaIpcGpuTest,
                              public ::testing::WithParamInterface<CopyVariant> {
 protected:
  void SetUp() override {
    CudaIpcGpuTest::SetUp();
    options_ = GetParam().options;
  }
};

INSTANTIATE_TEST_SUITE_P(Variants, CudaIpcVariantGpuTest, ::testing::ValuesIn(CopyVariants()),
                         [](const ::testing::TestParamInfo<CopyVariant>& param) {
                           return std::string(param.param.name);
                         });

// Long segments (cut into several table entries by the per-segment kernels) at
// `area` .. `area + 4 MiB`: one whose source and destination are aligned differently (copied
// byte by byte) and one aligned alike but not to 16 bytes (vector body, byte head and tail).
std::vector<Segment> LongSegments(uint64_t area) {
  std::vector<Segment> segments(2);
  segments[0].local_offset = 17;
  segments[0].remote_offset = area + 3;
  segments[0].length = (2 << 20) + 5;
  segments[1].local_offset = 4096 + 5;
  segments[1].remote_offset = area + (2 << 20) + 64 + 5;
  segments[1].length = (1 << 20) + 1000;
  return segments;
}

TEST_P(CudaIpcVariantGpuTest, ScatteredBlocksLandBeforeTheirNotifications) {
  constexpr size_t kBlock = 32 << 10;
  constexpr size_t kBlocks = 1024;
  constexpr size_t kAreaA = kBlock * kBlocks;  // 32 MiB of whole blocks
  constexpr size_t kAreaB = 8 << 20;            // odd segments
  constexpr size_t kAreaC = 4 << 20;            // long segments
  constexpr size_t kBytes = kAreaA + kAreaB + kAreaC;
  ASSERT_NO_FATAL_FAILURE(Spawn({"--role=receiver", absl::StrCat("--bytes=", kBytes)}));
  ASSERT_NO_FATAL_FAILURE(MakeTransport());
  ASSERT_NO_FATAL_FAILURE(ConnectToReceiver());
  std::vector<char> host(kBytes);
  FillPattern(host.data(), host.size(), 11);
  ASSERT_NO_FATAL_FAILURE(MakeSource(host));

  std::vector<char> expected(kBytes, 0);
  const std::vector<Segment> blocks = ScatteredSegments(kBlocks, kBlock, kBlocks, 1);
  // More odd segments than a parameter table holds (kIpcMaxParamSegments).
  const std::vector<Segment> odd = OddSegments(1500, kAreaA, kAreaB, kAreaA, kAreaB, 2);
  const std::vector<Segment> long_segments = LongSegments(kAreaA + kAreaB);
  Apply(blocks, host, expected);
  std::vector<TransferId> ids;
  for (const auto& [segments, name] :
       {std::make_pair(&blocks, "layer 0"), std::make_pair(&odd, "layer 1"),
        std::make_pair(&long_segments, "layer 2")}) {
    auto id = transport_->PostWrite(peer_, *src_, *remote_, *segments, name);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  // A notification alone follows the data of every earlier write.
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
  // Only what layer 1 and the writes before it cover: layer 2's long segments may have
  // landed by the time the snapshot is taken.
  EXPECT_EQ(Mismatches(second->snapshot, expected, 0, kAreaA + kAreaB), 0u)
      << "layer 1 was notified before all of its (odd) segments landed";
  Apply(long_segments, host, expected);
  auto third = ReadNote();
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->payload, "layer 2");
  EXPECT_EQ(Mismatches(third->snapshot, expected, 0, kBytes), 0u)
      << "layer 2 was notified before all of its long segments landed";
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
  // Nothing was posted for a batch with a segment out of range.
  std::vector<Segment> bad = blocks;
  bad[17].remote_offset = kBytes - 1;
  auto refused = transport_->PostWrite(peer_, *src_, *remote_, bad, "bad");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kOutOfRange) << refused.status();
  SayExitAndReap();
}

TEST_P(CudaIpcVariantGpuTest, CopyWaitsForTheReadyEventAndCarriesTheTail) {
  constexpr size_t kBlock = 32 << 10;
  constexpr size_t kBlocks = 512;
  constexpr size_t kBytes = kBlock * kBlocks;
  constexpr size_t kTail = 16;
  constexpr uint32_t kDataSeed = 5;
  constexpr uint32_t kTailSeed = 77;
  ASSERT_NO_FATAL_FAILURE(Spawn({"--role=receiver", absl::StrCat("--bytes=", kBytes)}));
  ASSERT_NO_FATAL_FAILURE(MakeTransport());
  ASSERT_NO_FATAL_FAILURE(ConnectToReceiver());
  // Old data (zeros) in the source until the slow kernel writes the new.
  ASSERT_NO_FATAL_FAILURE(MakeSource(std::vector<char>(kBytes, 0)));
  auto producer = CudaStream::Create();
  auto idle = CudaStream::Create();
  auto ready = CudaEvent::Create();
  ASSERT_TRUE(producer.ok() && idle.ok() && ready.ok());
  void* tail = nullptr;
  ASSERT_TRUE(CudaOk(cudaHostAlloc(&tail, kTail, cudaHostAllocMapped), "cudaHostAlloc").ok());
  std::memset(tail, 0, kTail);

  ASSERT_TRUE(LaunchSlowFillChecked(src_->base(), kBytes, kDataSeed, producer->get()));
  ASSERT_TRUE(gpu_test::LaunchWriteTail(tail, kTail, kTailSeed, producer->get()).ok());
  ASSERT_TRUE(ready->Record(producer->get()).ok());
  const std::vector<Segment> blocks = ScatteredSegments(kBlocks, kBlock, kBlocks, 9);
  WriteOrder order;
  order.ready_event = ready->get();
  order.notification_tail = tail;
  order.notification_tail_bytes = kTail;
  auto id = transport_->PostWrite(peer_, *src_, *remote_, blocks, "ready", order);
  ASSERT_TRUE(id.ok()) << id.status();
  // The event's state was captured by PostWrite: recording it again at once on an idle
  // stream (where it completes immediately) must not let the copy start early.
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
      << "the copy did not wait for ready_event (old data landed)";
  auto state = WaitForTransfer(*transport_, *id, Deadline());
  ASSERT_TRUE(state.ok()) << state.status();
  transport_->Release(*id);
  SayExitAndReap();
  EXPECT_TRUE(producer->Synchronize(absl::Seconds(30)).ok());
  cudaFreeHost(tail);
}

TEST_F(CudaIpcGpuTest, SubRangesOfOneAllocationAreMappedOnceAndNamedSendersAreReported) {
  constexpr size_t kAlloc = 8 << 20;
  constexpr size_t kBlock = 8 << 10;
  constexpr size_t kCount = 100;
  constexpr uint32_t kSeed = 21;
  const size_t offsets[2] = {1 << 20, 5 << 20};
  const size_t lengths[2] = {2 << 20, (3 << 20) - 4096};
  // The writer's source holds at least as many blocks as the larger region.
  constexpr size_t kSource = 4 << 20;
  ASSERT_NO_FATAL_FAILURE(Spawn({"--role=writer", absl::StrCat("--bytes=", kSource),
                                 "--regions=2", absl::StrCat("--block=", kBlock),
                                 absl::StrCat("--count=", kCount),
                                 absl::StrCat("--seed=", kSeed)}));
  ASSERT_NO_FATAL_FAILURE(MakeTransport());
  // Memory the transport did not allocate, as an engine's caching allocator hands it out.
  void* alloc = nullptr;
  ASSERT_TRUE(CudaOk(cudaMalloc(&alloc, kAlloc), "cudaMalloc").ok());
  ASSERT_TRUE(CudaOk(cudaMemset(alloc, 0, kAlloc), "cudaMemset").ok());
  char* base = static_cast<char*>(alloc);
  std::vector<std::unique_ptr<MemoryRegistration>> regions;
  for (int r = 0; r < 2; ++r) {
    auto reg = transport_->RegisterMemory(base + offsets[r], lengths[r], MemoryKind::kDevice);
    ASSERT_TRUE(reg.ok()) << reg.status();
    auto d = internal::DecodeCudaIpcDescriptor((*reg)->descriptor());
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->offset, offsets[r]) << "the offset in the allocation";
    EXPECT_GE(d->allocation_size, kAlloc);
    EXPECT_EQ(d->length, lengths[r]);
    regions.push_back(std::move(reg).value());
  }
  // A range that runs past its allocation is refused, naming why.
  auto past = transport_->RegisterMemory(base + kAlloc - 64, 1 << 20, MemoryKind::kDevice);
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument) << past.status();
  EXPECT_THAT(past.status().message(), HasSubstr("runs past its allocation"));

  ASSERT_TRUE(WriteLine(child_->to_child(),
                        "INFO " + absl::BytesToHexString(*transport_->LocalInfo()))
                  .ok());
  for (const auto& reg : regions) {
    ASSERT_TRUE(
        WriteLine(child_->to_child(), "DESC " + absl::BytesToHexString(reg->descriptor())).ok());
  }
  auto mappings = ReadLineProgressing();
  ASSERT_TRUE(mappings.ok()) << mappings.status();
  EXPECT_EQ(*mappings, "MAPPINGS 1") << "two regions of one allocation were opened twice";

  std::vector<char> src(kSource);
  FillPattern(src.data(), src.size(), kSeed);
  std::vector<char> expected(kAlloc, 0);
  for (int r = 0; r < 2; ++r) {
    for (const Segment& s :
         ScatteredSegments(kCount, kBlock, lengths[r] / kBlock, kSeed + r)) {
      std::memcpy(expected.data() + offsets[r] + s.remote_offset, src.data() + s.local_offset,
                  s.length);
    }
  }
  std::vector<Notification> notes;
  const absl::Time deadline = Deadline();
  while (notes.empty()) {
    ASSERT_TRUE(transport_->Progress().ok());
    notes = transport_->PollNotifications();
    ASSERT_LT(absl::Now(), deadline) << "no notification from the writer";
  }
  std::vector<char> got(kAlloc);
  ASSERT_TRUE(CudaOk(cudaMemcpy(got.data(), alloc, kAlloc, cudaMemcpyDeviceToHost), "download")
                  .ok());
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].payload, "written");
  EXPECT_EQ(Mismatches(got, expected, 0, kAlloc), 0u)
      << "the notification came before (all of) the data, or bytes outside the regions moved";
  // This side never connected to the writer, and still knows it by a healthy peer id.
  EXPECT_TRUE(transport_->PeerStatus(notes[0].peer).ok());
  auto done = ReadLineProgressing();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(*done, "DONE OK");
  ASSERT_TRUE(WriteLine(child_->to_child(), "exit").ok());
  auto code = child_->Wait(Deadline());
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  regions.clear();
  cudaFree(alloc);
}

TEST_F(CudaIpcGpuTest, RegistrationSaysWhatCannotBeExported) {
  ASSERT_NO_FATAL_FAILURE(MakeTransport());
  // Pinned host memory.
  void* pinned = nullptr;
  ASSERT_TRUE(CudaOk(cudaMallocHost(&pinned, 1 << 16), "cudaMallocHost").ok());
  auto host = transport_->RegisterMemory(pinned, 1 << 16, MemoryKind::kDevice);
  EXPECT_EQ(host.status().code(), absl::StatusCode::kInvalidArgument) << host.status();
  EXPECT_THAT(host.status().message(), HasSubstr("host memory"));
  cudaFreeHost(pinned);
  // Stream-ordered pool memory cannot be exported with cudaIpcGetMemHandle.
  void* pooled = nullptr;
  ASSERT_TRUE(CudaOk(cudaMallocAsync(&pooled, 1 << 20, nullptr), "cudaMallocAsync").ok());
  ASSERT_TRUE(CudaOk(cudaStreamSynchronize(nullptr), "sync").ok());
  auto pool = transport_->RegisterMemory(pooled, 1 << 20, MemoryKind::kDevice);
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kFailedPrecondition) << pool.status();
  EXPECT_THAT(pool.status().message(), HasSubstr("cudaIpcGetMemHandle"));
  cudaFreeAsync(pooled, nullptr);
  ASSERT_TRUE(CudaOk(cudaStreamSynchronize(nullptr), "sync").ok());
  // A sub-range of memory from AllocateMemory: the descriptor says where it lies.
  auto whole = transport_->AllocateMemory(1 << 20, MemoryKind::kDevice);
  ASSERT_TRUE(whole.ok()) << whole.status();
  auto part = transport_->RegisterMemory(static_cast<char*>((*whole)->base()) + 4096, 8192,
                                         MemoryKind::kDevice);
  ASSERT_TRUE(part.ok()) << part.status();
  auto d = internal::DecodeCudaIpcDescriptor((*part)->descriptor());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->offset, 4096u);
  EXPECT_EQ(d->length, 8192u);
  EXPECT_GE(d->allocation_size, uint64_t{1} << 20);
  // AllocateMemory zero-fills.
  std::vector<char> bytes(1 << 20, 1);
  ASSERT_TRUE(CudaOk(cudaMemcpy(bytes.data(), (*whole)->base(), bytes.size(),
                                cudaMemcpyDeviceToHost),
                     "download")
                  .ok());
  EXPECT_EQ(std::count(bytes.begin(), bytes.end(), 0), static_cast<long>(bytes.size()));
  part->reset();
  whole->reset();
}

TEST_F(CudaIpcGpuTest, ImportsAreCheckedAgainstWhatWasMapped) {
  constexpr size_t kBytes = 1 << 20;
  ASSERT_NO_FATAL_FAILURE(Spawn({"--role=receiver", absl::StrCat("--bytes=", kBytes)}));
  ASSERT_NO_FATAL_FAILURE(MakeTransport());
  ASSERT_NO_FATAL_FAILURE(ConnectToReceiver());
  auto d = internal::DecodeCudaIpcDescriptor(descriptor_);
  ASSERT_TRUE(d.ok()) << d.status();
  // A peer that claims a region larger than its allocation.
  internal::CudaIpcMemoryDescriptor big = *d;
  big.allocation_size = uint64_t{1} << 40;
  big.length = uint64_t{1} << 39;
  auto lie = transport_->ImportRemote(peer_, internal::EncodeCudaIpcDescriptor(big));
  EXPECT_EQ(lie.status().code(), absl::StatusCode::kInvalidArgument) << lie.status();
  EXPECT_THAT(lie.status().message(), HasSubstr("as mapped here"));
  // A descriptor of another transport than the peer's.
  internal::CudaIpcMemoryDescriptor other = *d;
  other.owner_uid ^= 1;
  auto foreign = transport_->ImportRemote(peer_, internal::EncodeCudaIpcDescriptor(other));
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kInvalidArgument) << foreign.status();
  // Garbage, and an unknown peer.
  EXPECT_EQ(transport_->ImportRemote(peer_, "garbage").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(transport_->ImportRemote(peer_ + 100, descriptor_).status().code(),
            absl::StatusCode::kNotFound);
  // The second import of the same allocation reuses the mapping.
  auto again = transport_->ImportRemote(peer_, descriptor_);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(CudaIpcOpenMappingCount(*transport_), 1u);
  SayExitAndReap();
}

TEST_F(CudaIpcGpuTest, DisconnectClosesTheMappingsAndSaysGoodbye) {
  constexpr size_t kBytes = 4 << 20;
  ASSERT_NO_FATAL_FAILURE(Spawn({"--role=receiver", absl::StrCat("--bytes=", kBytes)}));
  ASSERT_NO_FATAL_FAILURE(MakeTransport());
  ASSERT_NO_FATAL_FAILURE(ConnectToReceiver());
  std::vector<char> host(kBytes);
  FillPattern(host.data(), host.size(), 3);
  ASSERT_NO_FATAL_FAILURE(MakeSource(host));
  EXPECT_EQ(CudaIpcOpenMappingCount(*transport_), 1u);
  auto id = transport_->PostWrite(peer_, *src_, *remote_,
                                  ScatteredSegments(64, 64 << 10, 64, 4), "one");
  ASSERT_TRUE(id.ok()) << id.status();
  auto note = ReadNote();
  ASSERT_TRUE(note.ok()) << note.status();
  auto state = WaitForTransfer(*transport_, *id, Deadline());
  ASSERT_TRUE(state.ok()) << state.status();

  ASSERT_TRUE(transport_->Disconnect(peer_).ok());
  ASSERT_TRUE(transport_->Progress().ok());
  EXPECT_EQ(CudaIpcOpenMappingCount(*transport_), 0u);
  EXPECT_EQ(transport_->PeerStatus(peer_).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(transport_->PostNotification(peer_, "late").status().code(),
            absl::StatusCode::kNotFound);
  // The receiver took the end of our connection for a goodbye, not a death.
  ASSERT_TRUE(WriteLine(child_->to_child(), "exit").ok());
  auto peer_line = child_->reader().ReadLine(Deadline());
  ASSERT_TRUE(peer_line.ok()) << peer_line.status();
  EXPECT_EQ(*peer_line, "PEER OK");
  auto code = child_->Wait(Deadline());
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
}

TEST_F(CudaIpcGpuTest, PeerKilledMidStreamFailsTransfersNamingIt) {
  constexpr size_t kBlock = 32 << 10;
  constexpr size_t kBlocks = 512;
  constexpr size_t kBytes = kBlock * kBlocks;
  ASSERT_NO_FATAL_FAILURE(Spawn({"--role=receiver", absl::StrCat("--bytes=", kBytes)}));
  ASSERT_NO_FATAL_FAILURE(MakeTransport());
  ASSERT_NO_FATAL_FAILURE(ConnectToReceiver());
  ASSERT_NO_FATAL_FAILURE(MakeSource(std::vector<char>(kBytes, 1)));
  std::vector<std::pair<PeerId, absl::Status>> reported;
  transport_->SetPeerErrorCallback(
      [&](PeerId peer, const absl::Status& error) { reported.emplace_back(peer, error); });
  // Every write waits behind a slow producer, so all are in flight when the peer dies.
  auto producer = CudaStream::Create();
  auto ready = CudaEvent::Create();
  ASSERT_TRUE(producer.ok() && ready.ok());
  ASSERT_TRUE(LaunchSlowFillChecked(src_->base(), kBytes, 1, producer->get(), 3000));
  ASSERT_TRUE(ready->Record(producer->get()).ok());
  WriteOrder order;
  order.ready_event = ready->get();
  std::vector<TransferId> ids;
  for (int i = 0; i < 16; ++i) {
    auto id = transport_->PostWrite(peer_, *src_, *remote_,
                                    ScatteredSegments(128, kBlock, kBlocks, i), "layer", order);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  ASSERT_TRUE(transport_->Progress().ok());
  for (TransferId id : ids) {
    auto state = transport_->Test(id);
    ASSERT_TRUE(state.ok()) << state.status();
    ASSERT_EQ(*state, TransferState::kInProgress) << "the slow producer did not hold it back";
  }

  child_->Kill();
  for (TransferId id : ids) {
    auto state = WaitForTransfer(*transport_, id, absl::Now() + absl::Seconds(20));
    ASSERT_FALSE(state.ok()) << "transfer " << id << " completed to a dead peer";
    ASSERT_NE(state.status().code(), absl::StatusCode::kDeadlineExceeded)
        << "the peer's death was not detected: " << state.status();
    EXPECT_THAT(state.status().message(), HasSubstr(absl::StrCat("peer ", peer_)));
  }
  absl::Status peer_status = transport_->PeerStatus(peer_);
  EXPECT_FALSE(peer_status.ok());
  EXPECT_THAT(peer_status.message(), HasSubstr(absl::StrCat("peer ", peer_)));
  ASSERT_TRUE(transport_->Progress().ok());
  ASSERT_EQ(reported.size(), 1u);
  EXPECT_EQ(reported[0].first, peer_);
  auto later = transport_->PostWrite(peer_, *src_, *remote_,
                                     ScatteredSegments(1, kBlock, kBlocks, 1), "late");
  EXPECT_EQ(later.status().code(), absl::StatusCode::kFailedPrecondition) << later.status();
  // The copies still run (behind the producer); their mapping closes once they are done.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (CudaIpcOpenMappingCount(*transport_) != 0) {
    ASSERT_TRUE(transport_->Progress().ok());
    ASSERT_LT(absl::Now(), deadline) << "the dead peer's mapping was never closed";
    absl::SleepFor(absl::Milliseconds(1));
  }
  // And the GPU is still healthy.
  EXPECT_TRUE(producer->Synchronize(absl::Seconds(30)).ok());
}

}  // namespace
}  // namespace test
}  // namespace kvstream
