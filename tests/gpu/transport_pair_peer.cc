// The peer programs' side of the device transports' GPU tests (transport_pair_peer.h).
#include "transport_pair_peer.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "kvstream/common/cuda_status.h"

namespace kvstream {
namespace test {

absl::Time PairPeer::Deadline() { return absl::Now() + absl::Seconds(120); }

void PairPeer::Die(const std::string& what) const {
  std::fprintf(stderr, "%s: %s\n", name_.c_str(), what.c_str());
  (void)WriteLine(kPeerOutFd, "FATAL " + what);
  std::_Exit(2);
}

void PairPeer::Check(const absl::Status& status, const std::string& what) const {
  if (!status.ok()) Die(absl::StrCat(what, ": ", status.ToString()));
}

std::string PairPeer::ReadHex(PipeReader& in, absl::string_view tag) const {
  auto line = in.ReadLine(Deadline());
  if (!line.ok()) Die(absl::StrCat("reading ", tag, ": ", line.status().ToString()));
  absl::string_view rest = *line;
  if (!absl::ConsumePrefix(&rest, tag) || !absl::ConsumePrefix(&rest, " ")) {
    Die(absl::StrCat("expected ", tag, ", got '", *line, "'"));
  }
  return absl::HexStringToBytes(rest);
}

int PairPeer::Receive(Transport& transport, size_t bytes,
                      const std::function<bool(const std::string& line)>& on_line) const {
  auto region = transport.AllocateMemory(bytes, MemoryKind::kDevice);
  Check(region.status(), "AllocateMemory");
  auto info = transport.LocalInfo();
  Check(info.status(), "LocalInfo");
  Check(WriteLine(kPeerOutFd, "INFO " + absl::BytesToHexString(*info)), "write");
  Check(WriteLine(kPeerOutFd, "DESC " + absl::BytesToHexString((*region)->descriptor())),
        "write");
  Check(WriteLine(kPeerOutFd, "READY"), "write");
  PipeReader in(0);
  std::vector<char> snapshot(bytes);
  PeerId last_peer = 0;
  bool heard = false;
  for (;;) {
    Check(transport.Progress(), "Progress");
    for (Notification& n : transport.PollNotifications()) {
      // The region as it is the moment the notification is seen.
      Check(CudaErrorToStatus(static_cast<int>(cudaMemcpy(snapshot.data(), (*region)->base(),
                                                          bytes, cudaMemcpyDeviceToHost)),
                              "CUDA"),
            "cudaMemcpy of the region");
      last_peer = n.peer;
      heard = true;
      Check(WriteLine(kPeerOutFd,
                      absl::StrCat("NOTE ", absl::BytesToHexString(n.payload), " ", bytes)),
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
      if (line.ok() && on_line && on_line(*line)) continue;
      if (!line.ok() || *line == "exit") {
        const std::string status =
            !heard ? std::string("NONE") : transport.PeerStatus(last_peer).ToString();
        Check(WriteLine(kPeerOutFd, "PEER " + status), "write");
        return 0;
      }
    }
  }
}

}  // namespace test
}  // namespace kvstream
