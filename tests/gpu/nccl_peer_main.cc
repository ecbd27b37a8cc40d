// The second process of the nccl transport's GPU tests (nccl_transport_gpu_test.cc forks and
// execs it): a receiver on its own GPU. It speaks the line protocol of
// tests/integration/ucx_transport_peer.h on stdin and fd 3.
//
//   --role=receiver --device=D --bytes=N [--job=J] [--staging=S]
//       PairPeer::Receive (transport_pair_peer.h) of N bytes on an nccl transport on GPU D
//       (job J, staging slots of S bytes); "stall" keeps it alive, so that only a deadline
//       can end the writer's wait. A line "comms" on stdin makes it print "COMMS <live
//       communicators>".
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "kvstream/transfer/nccl_transport.h"
#include "tests/integration/ucx_transport_peer.h"
#include "transport_pair_peer.h"

namespace kvstream {
namespace test {
namespace {

struct Flags {
  std::string role;
  int device = 1;
  size_t bytes = 0;
  std::string job;
  uint64_t staging = 0;
};

const PairPeer kSelf("nccl peer");

int Receiver(const Flags& f) {
  NcclTransportOptions options;
  options.device = f.device;
  options.job_id = f.job;
  if (f.staging > 0) {
    options.staging_bytes = f.staging;
    options.in_place_min_bytes = std::min(options.in_place_min_bytes, f.staging);
  }
  auto transport = CreateNcclTransport(options);
  kSelf.Check(transport.status(), "CreateNcclTransport");
  return kSelf.Receive(**transport, f.bytes, [&transport](const std::string& line) {
    if (line != "comms") return false;
    kSelf.Check(WriteLine(kPeerOutFd,
                          absl::StrCat("COMMS ", NcclLiveCommunicatorCount(**transport))),
                "write");
    return true;
  });
}

}  // namespace
}  // namespace test
}  // namespace kvstream

int main(int argc, char** argv) {
  using kvstream::test::Flags;
  // NVLink multicast stays off on these machines (NCCL reads this at its first call).
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/1);
  Flags f;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    bool ok = true;
    if (absl::ConsumePrefix(&arg, "--role=")) {
      f.role = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--device=")) {
      ok = absl::SimpleAtoi(arg, &f.device);
    } else if (absl::ConsumePrefix(&arg, "--bytes=")) {
      ok = absl::SimpleAtoi(arg, &f.bytes);
    } else if (absl::ConsumePrefix(&arg, "--job=")) {
      f.job = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--staging=")) {
      ok = absl::SimpleAtoi(arg, &f.staging);
    } else {
      ok = false;
    }
    if (!ok) kvstream::test::kSelf.Die(absl::StrCat("bad flag ", argv[i]));
  }
  if (f.role != "receiver" || f.bytes == 0) {
    kvstream::test::kSelf.Die("usage: --role=receiver --bytes=N");
  }
  return kvstream::test::Receiver(f);
}
