// The peer programs' side of the device transports' two-process GPU tests
// (cuda_ipc_peer_main.cc, nccl_peer_main.cc; the writer's side is transport_pair_test.h):
// fatal errors that the test reads as a line, and the receiver both programs run. It speaks
// the line protocol of tests/integration/ucx_transport_peer.h on stdin and fd 3.
//
//   const PairPeer kSelf("nccl peer");
//   auto transport = CreateNcclTransport(options);
//   kSelf.Check(transport.status(), "CreateNcclTransport");
//   return kSelf.Receive(**transport, bytes, nullptr);
#ifndef KVSTREAM_TESTS_GPU_TRANSPORT_PAIR_PEER_H_
#define KVSTREAM_TESTS_GPU_TRANSPORT_PAIR_PEER_H_

#include <cstddef>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kvstream/transfer/transport.h"
#include "tests/integration/ucx_transport_peer.h"

namespace kvstream {
namespace test {

class PairPeer {
 public:
  // `name` ("cuda_ipc peer") prefixes what it prints on stderr.
  explicit PairPeer(std::string name) : name_(std::move(name)) {}

  // Prints `what` on stderr and "FATAL <what>" on fd 3, and exits with 2.
  [[noreturn]] void Die(const std::string& what) const;
  // Die("<what>: <status>") unless `status` is OK.
  void Check(const absl::Status& status, const std::string& what) const;
  // The next line of `in`, "<tag> <hex>", decoded; Die otherwise.
  std::string ReadHex(PipeReader& in, absl::string_view tag) const;

  // The receiver: AllocateMemory(bytes) on `transport`; prints "INFO <hex>", "DESC <hex>",
  // "READY"; then progresses. For every notification it copies its whole region to the host
  // at once and prints "NOTE <hex payload> <bytes>" followed by the raw bytes; the payload
  // "stall" makes it print "STALLED" and stop progressing (alive, until killed); "exit"
  // makes it print "BYE" and return 0. A line on stdin goes to `on_line` first (when set),
  // which returns true when it answered it; otherwise a line "exit" (or the end of stdin)
  // makes it print "PEER <status of the last peer it heard from, or NONE>" and return 0.
  int Receive(Transport& transport, size_t bytes,
              const std::function<bool(const std::string& line)>& on_line) const;

  // What every wait of a peer program allows.
  static absl::Time Deadline();

 private:
  std::string name_;
};

}  // namespace test
}  // namespace kvstream

#endif  // KVSTREAM_TESTS_GPU_TRANSPORT_PAIR_PEER_H_
