// The harness the device transports' two-process GPU tests share (cuda_ipc_transport_gpu_test,
// nccl_transport_gpu_test): this process writes through its transport, a peer program
// (forked and exec'd; its receiver side is transport_pair_peer.h) receives. They speak the
// line protocol of tests/integration/ucx_transport_peer.h: the receiver prints
// "INFO <hex>", "DESC <hex>", "READY", and for every notification "NOTE <hex payload> <N>"
// with a snapshot of its whole region taken the moment the notification was seen, so that a
// test checks byte for byte, against a host mirror, that the data landed before it.
//
//   class MyGpuTest : public TransportPairTest {
//     void MakeTransport() { transport_ = ...; }
//   };
//   ASSERT_NO_FATAL_FAILURE(Spawn({KVSTREAM_PEER_BINARY, "--role=receiver", "--bytes=N"}));
//   ASSERT_NO_FATAL_FAILURE(MakeTransport());
//   ASSERT_NO_FATAL_FAILURE(ConnectToReceiver());
//   ASSERT_NO_FATAL_FAILURE(MakeSource(host));
//   ... transport_->PostWrite(peer_, *src_, *remote_, segments, "layer 0") ...
//   auto note = ReadNote();   // note->snapshot vs the mirror (Apply, Mismatches)
//   SayExitAndReap();
#ifndef KVSTREAM_TESTS_GPU_TRANSPORT_PAIR_TEST_H_
#define KVSTREAM_TESTS_GPU_TRANSPORT_PAIR_TEST_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kvstream/transfer/transport.h"
#include "tests/integration/ucx_transport_peer.h"

namespace kvstream {
namespace test {

// What every wait of the harness and its tests allows.
absl::Time Deadline();

absl::Status CudaOk(cudaError_t e, absl::string_view what);

// A receiver's notification and its region as it was when the notification was seen.
struct Note {
  std::string payload;
  std::vector<char> snapshot;
};

// Bytes of [begin, end) where `got` and `want` differ.
size_t Mismatches(const std::vector<char>& got, const std::vector<char>& want, size_t begin,
                  size_t end);

// What `segments` do to `dst` when they copy from `src` (the host mirror of a write).
void Apply(const std::vector<Segment>& segments, const std::vector<char>& src,
           std::vector<char>& dst);

// `count` segments of odd lengths (every 50th, from the 7th, empty) at odd offsets into
// disjoint destination slots of [area, area + area_bytes); sources anywhere in
// [source_begin, source_begin + source_bytes) (they may overlap: they are only read).
// Shuffled.
std::vector<Segment> OddSegments(size_t count, uint64_t area, uint64_t area_bytes,
                                 uint64_t source_begin, uint64_t source_bytes, uint32_t seed);

// The writer's side of a pair. Subclasses create transport_ (their transport's options).
class TransportPairTest : public ::testing::Test {
 protected:
  // Destroys the handles, then the child (killed if still running), then the transport.
  void TearDown() override;

  // Forks and execs `args` (args[0]: the peer program) as child_.
  void Spawn(const std::vector<std::string>& args);
  // The child's next line "<tag> <hex>", decoded (a failure is a test failure; then "").
  std::string ReadHex(absl::string_view tag);
  // Reads the receiver's INFO/DESC/READY: `info` gets its peer info, descriptor_ its
  // region's descriptor.
  void ReadReceiver(std::string* info);
  // Connects to `info` (peer_) and imports descriptor_ (remote_).
  void ConnectTo(const std::string& info);
  // ReadReceiver, then ConnectTo.
  void ConnectToReceiver();
  // A line from the child, progressing this side meanwhile (what the child waits for may be
  // a notification this side has yet to send).
  absl::StatusOr<std::string> ReadLineProgressing();
  // The receiver's next "NOTE <hex> <bytes>" and its snapshot.
  absl::StatusOr<Note> ReadNote();
  // src_: device memory of this side from AllocateMemory, uploaded from `host`.
  void MakeSource(const std::vector<char>& host);
  // Notifies "exit", reads its NOTE and the receiver's "BYE", and reaps it (exit code 0).
  void SayExitAndReap();

  std::unique_ptr<Transport> transport_;
  std::unique_ptr<ChildProcess> child_;
  std::unique_ptr<MemoryRegistration> src_;
  std::unique_ptr<RemoteMemory> remote_;
  std::string descriptor_;
  PeerId peer_ = 0;
};

}  // namespace test
}  // namespace kvstream

#endif  // KVSTREAM_TESTS_GPU_TRANSPORT_PAIR_TEST_H_
