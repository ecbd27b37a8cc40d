// The second process of the nccl transport's GPU tests (nccl_transport_gpu_test.cc forks and
// execs it): a receiver on its own GPU. It speaks the line protocol of
// tests/integration/ucx_transport_peer.h on stdin and fd 3.
//
//   --role=receiver --device=D --bytes=N [--job=J] [--staging=S]
//       An nccl transport on GPU D (job J, staging slots of S bytes), AllocateMemory(N);
//       prints "INFO <hex>", "DESC <hex>", "READY"; then progresses. For every notification
//       it copies its whole region to the host at once and prints "NOTE <hex payload> <N>"
//       followed by the N raw bytes; the payload "stall" makes it print "STALLED" and stop
//       progressing (alive, so that only a deadline can end the writer's wait); "exit"
//       makes it print "BYE" and exit. A line "comms" on stdin makes it print "COMMS <live
//       communicators>"; a line "exit" makes it print "PEER <status of the last peer it heard
//       from>" and exit.
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/transfer/nccl_transport.h"
#include "tests/integration/ucx_transport_peer.h"

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

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "nccl peer: %s\n", what.c_str());
  (void)WriteLine(kPeerOutFd, "FATAL " + what);
  std::_Exit(2);
}

void Check(const absl::Status& status, const std::string& what) {
  if (!status.ok()) Die(absl::StrCat(what, ": ", status.ToString()));
}

absl::Time Deadline() { return absl::Now() + absl::Seconds(120); }

int Receiver(const Flags& f) {
  NcclTransportOptions options;
  options.device = f.device;
  options.job_id = f.job;
  if (f.staging > 0) {
    options.staging_bytes = f.staging;
    options.in_place_min_bytes = std::min(options.in_place_min_bytes, f.staging);
  }
  auto transport = CreateNcclTransport(options);
  Check(transport.status(), "CreateNcclTransport");
  auto region = (*transport)->AllocateMemory(f.bytes, MemoryKind::kDevice);
  Check(region.status(), "AllocateMemory");
  auto info = (*transport)->LocalInfo();
  Check(info.status(), "LocalInfo");
  Check(WriteLine(kPeerOutFd, "INFO " + absl::BytesToHexString(*info)), "write");
  Check(WriteLine(kPeerOutFd, "DESC " + absl::BytesToHexString((*region)->descriptor())),
        "write");
  Check(WriteLine(kPeerOutFd, "READY"), "write");
  PipeReader in(0);
  std::vector<char> snapshot(f.bytes);
  PeerId last_peer = 0;
  bool heard = false;
  for (;;) {
    Check((*transport)->Progress(), "Progress");
    for (Notification& n : (*transport)->PollNotifications()) {
      // The region as it is the moment the notification is seen.
      Check(CudaErrorToStatus(static_cast<int>(cudaMemcpy(snapshot.data(), (*region)->base(),
                                                          f.bytes, cudaMemcpyDeviceToHost)),
                              "cudaMemcpy of the region"),
            "snapshot");
      last_peer = n.peer;
      heard = true;
      Check(WriteLine(kPeerOutFd, absl::StrCat("NOTE ", absl::BytesToHexString(n.payload), " ",
                                               f.bytes)),
            "write");
      Check(WriteAll(kPeerOutFd, snapshot.data(), snapshot.size()), "write");
      if (n.payload == "exit") {
        Check(WriteLine(kPeerOutFd, "BYE"), "write");
        return 0;
      }
      if (n.payload == "stall") {
        Check(WriteLine(kPeerOutFd, "STALLED"), "write");
        for (;;) ::pause();  // until killed
      }
    }
    if (in.Readable()) {
      auto line = in.ReadLine(Deadline());
      if (line.ok() && *line == "comms") {
        Check(WriteLine(kPeerOutFd,
                        absl::StrCat("COMMS ", NcclLiveCommunicatorCount(**transport))),
              "write");
        continue;
      }
      if (!line.ok() || *line == "exit") {
        const std::string status =
            !heard ? std::string("NONE") : (*transport)->PeerStatus(last_peer).ToString();
        Check(WriteLine(kPeerOutFd, "PEER " + status), "write");
        return 0;
      }
    }
  }
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
    if (!ok) kvstream::test::Die(absl::StrCat("bad flag ", argv[i]));
  }
  if (f.role != "receiver" || f.bytes == 0) kvstream::test::Die("usage: --role=receiver --bytes=N");
  return kvstream::test::Receiver(f);
}
