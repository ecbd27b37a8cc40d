// The second process of the cuda_ipc transport's GPU tests (cuda_ipc_transport_gpu_test.cc
// forks and execs it). It speaks the line protocol of tests/integration/ucx_transport_peer.h
// on stdin and fd 3.
//
//   --role=receiver --bytes=N
//       AllocateMemory(N) on the GPU; prints "INFO <hex>", "DESC <hex>", "READY"; then
//       progresses. For every notification it copies its whole region to the host at once
//       and prints "NOTE <hex payload> <N>" followed by the N raw bytes; the payload "stall"
//       makes it print "STALLED" and stop progressing (to be killed); "exit" makes it print
//       "BYE" and exit. A line "exit" on stdin makes it print "PEER <status of the last
//       peer it heard from>" and exit.
//   --role=writer --bytes=N --regions=K --block=B --count=C --seed=S
//       Reads "INFO <hex>" and K lines "DESC <hex>"; connects, imports the K regions,
//       prints "MAPPINGS <open mappings>"; fills N bytes of its own GPU memory with
//       FillPattern(S) and writes, into region r, ScatteredSegments(C, B, region bytes / B,
//       S + r), notifying "written" after the last region; prints "DONE OK" (or "DONE
//       <error>"), then waits for "exit" on stdin.
#include <cuda_runtime.h>
#include <poll.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/transfer/cuda_ipc_transport.h"
#include "tests/integration/ucx_transport_peer.h"

namespace kvstream {
namespace test {
namespace {

struct Flags {
  std::string role;
  size_t bytes = 0;
  int regions = 1;
  size_t block = 0;
  size_t count = 0;
  uint32_t seed = 0;
};

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "cuda_ipc peer: %s\n", what.c_str());
  (void)WriteLine(kPeerOutFd, "FATAL " + what);
  std::_Exit(2);
}

void Check(const absl::Status& status, const std::string& what) {
  if (!status.ok()) Die(absl::StrCat(what, ": ", status.ToString()));
}

bool StdinHasLine(PipeReader& in) { return in.Readable(); }

absl::Status CudaOk(cudaError_t e) { return CudaErrorToStatus(static_cast<int>(e), "CUDA"); }

absl::Time Deadline() { return absl::Now() + absl::Seconds(120); }

std::string ReadHex(PipeReader& in, absl::string_view tag) {
  auto line = in.ReadLine(Deadline());
  if (!line.ok()) Die(absl::StrCat("reading ", tag, ": ", line.status().ToString()));
  absl::string_view rest = *line;
  if (!absl::ConsumePrefix(&rest, tag) || !absl::ConsumePrefix(&rest, " ")) {
    Die(absl::StrCat("expected ", tag, ", got '", *line, "'"));
  }
  return absl::HexStringToBytes(rest);
}

int Receiver(const Flags& f) {
  auto transport = CreateCudaIpcTransport(CudaIpcTransportOptions{});
  Check(transport.status(), "CreateCudaIpcTransport");
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
      Check(CudaOk(cudaMemcpy(snapshot.data(), (*region)->base(), f.bytes,
                                                cudaMemcpyDeviceToHost)),
            "cudaMemcpy of the region");
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
    if (StdinHasLine(in)) {
      auto line = in.ReadLine(Deadline());
      if (!line.ok() || *line == "exit") {
        const std::string status =
            !heard ? std::string("NONE") : (*transport)->PeerStatus(last_peer).ToString();
        Check(WriteLine(kPeerOutFd, "PEER " + status), "write");
        return 0;
      }
    }
  }
}

int Writer(const Flags& f) {
  PipeReader in(0);
  const std::string info = ReadHex(in, "INFO");
  std::vector<std::string> descriptors;
  for (int r = 0; r < f.regions; ++r) descriptors.push_back(ReadHex(in, "DESC"));
  auto transport = CreateCudaIpcTransport(CudaIpcTransportOptions{});
  Check(transport.status(), "CreateCudaIpcTransport");
  Transport& t = **transport;
  auto peer = t.Connect(info);
  Check(peer.status(), "Connect");
  std::vector<std::unique_ptr<RemoteMemory>> remotes;
  for (const std::string& d : descriptors) {
    auto remote = t.ImportRemote(*peer, d);
    Check(remote.status(), "ImportRemote");
    remotes.push_back(std::move(remote).value());
  }
  Check(WriteLine(kPeerOutFd, absl::StrCat("MAPPINGS ", CudaIpcOpenMappingCount(t))), "write");
  auto src = t.AllocateMemory(f.bytes, MemoryKind::kDevice);
  Check(src.status(), "AllocateMemory");
  std::vector<char> pattern(f.bytes);
  FillPattern(pattern.data(), pattern.size(), f.seed);
  Check(CudaOk(cudaMemcpy((*src)->base(), pattern.data(), f.bytes,
                                            cudaMemcpyHostToDevice)),
        "cudaMemcpy of the source");
  std::vector<TransferId> ids;
  for (int r = 0; r < f.regions; ++r) {
    const size_t pool = remotes[r]->length() / f.block;
    auto id = t.PostWrite(*peer, **src, *remotes[r],
                          ScatteredSegments(f.count, f.block, pool, f.seed + r),
                          r + 1 == f.regions ? "written" : "");
    Check(id.status(), "PostWrite");
    ids.push_back(*id);
  }
  std::string result = "OK";
  for (TransferId id : ids) {
    auto state = WaitForTransfer(t, id, Deadline());
    if (!state.ok()) {
      result = state.status().ToString();
      break;
    }
  }
  Check(WriteLine(kPeerOutFd, "DONE " + result), "write");
  for (;;) {
    Check(t.Progress(), "Progress");
    if (StdinHasLine(in)) return 0;
    absl::SleepFor(absl::Milliseconds(1));
  }
}

}  // namespace
}  // namespace test
}  // namespace kvstream

int main(int argc, char** argv) {
  using kvstream::test::Flags;
  Flags f;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    bool ok = true;
    if (absl::ConsumePrefix(&arg, "--role=")) {
      f.role = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--bytes=")) {
      ok = absl::SimpleAtoi(arg, &f.bytes);
    } else if (absl::ConsumePrefix(&arg, "--regions=")) {
      ok = absl::SimpleAtoi(arg, &f.regions);
    } else if (absl::ConsumePrefix(&arg, "--block=")) {
      ok = absl::SimpleAtoi(arg, &f.block);
    } else if (absl::ConsumePrefix(&arg, "--count=")) {
      ok = absl::SimpleAtoi(arg, &f.count);
    } else if (absl::ConsumePrefix(&arg, "--seed=")) {
      ok = absl::SimpleAtoi(arg, &f.seed);
    } else {
      ok = false;
    }
    if (!ok) kvstream::test::Die(absl::StrCat("bad flag ", argv[i]));
  }
  if (f.bytes == 0) kvstream::test::Die("--bytes is required");
  if (f.role == "receiver") return kvstream::test::Receiver(f);
  if (f.role == "writer" && f.block > 0 && f.regions > 0) return kvstream::test::Writer(f);
  kvstream::test::Die("--role=receiver|writer (writer: --block, --count, --regions)");
}
