// The second process of the cuda_ipc transport's GPU tests (cuda_ipc_transport_gpu_test.cc
// forks and execs it). It speaks the line protocol of tests/integration/ucx_transport_peer.h
// on stdin and fd 3.
//
//   --role=receiver --bytes=N
//       PairPeer::Receive (transport_pair_peer.h) of N bytes on a cuda_ipc transport.
//   --role=writer --bytes=N --regions=K --block=B --count=C --seed=S
//       Reads "INFO <hex>" and K lines "DESC <hex>"; connects, imports the K regions,
//       prints "MAPPINGS <open mappings>"; fills N bytes of its own GPU memory with
//       FillPattern(S) and writes, into region r, ScatteredSegments(C, B, region bytes / B,
//       S + r), notifying "written" after the last region; prints "DONE OK" (or "DONE
//       <error>"), then waits for "exit" on stdin.
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/transfer/cuda_ipc_transport.h"
#include "tests/integration/ucx_transport_peer.h"
#include "transport_pair_peer.h"

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

const PairPeer kSelf("cuda_ipc peer");

absl::Status CudaOk(cudaError_t e) { return CudaErrorToStatus(static_cast<int>(e), "CUDA"); }

int Receiver(const Flags& f) {
  auto transport = CreateCudaIpcTransport(CudaIpcTransportOptions{});
  kSelf.Check(transport.status(), "CreateCudaIpcTransport");
  return kSelf.Receive(**transport, f.bytes, nullptr);
}

int Writer(const Flags& f) {
  PipeReader in(0);
  const std::string info = kSelf.ReadHex(in, "INFO");
  std::vector<std::string> descriptors;
  for (int r = 0; r < f.regions; ++r) descriptors.push_back(kSelf.ReadHex(in, "DESC"));
  auto transport = CreateCudaIpcTransport(CudaIpcTransportOptions{});
  kSelf.Check(transport.status(), "CreateCudaIpcTransport");
  Transport& t = **transport;
  auto peer = t.Connect(info);
  kSelf.Check(peer.status(), "Connect");
  std::vector<std::unique_ptr<RemoteMemory>> remotes;
  for (const std::string& d : descriptors) {
    auto remote = t.ImportRemote(*peer, d);
    kSelf.Check(remote.status(), "ImportRemote");
    remotes.push_back(std::move(remote).value());
  }
  kSelf.Check(WriteLine(kPeerOutFd, absl::StrCat("MAPPINGS ", CudaIpcOpenMappingCount(t))),
              "write");
  auto src = t.AllocateMemory(f.bytes, MemoryKind::kDevice);
  kSelf.Check(src.status(), "AllocateMemory");
  std::vector<char> pattern(f.bytes);
  FillPattern(pattern.data(), pattern.size(), f.seed);
  kSelf.Check(CudaOk(cudaMemcpy((*src)->base(), pattern.data(), f.bytes,
                                            cudaMemcpyHostToDevice)),
        "cudaMemcpy of the source");
  std::vector<TransferId> ids;
  for (int r = 0; r < f.regions; ++r) {
    const size_t pool = remotes[r]->length() / f.block;
    auto id = t.PostWrite(*peer, **src, *remotes[r],
                          ScatteredSegments(f.count, f.block, pool, f.seed + r),
                          r + 1 == f.regions ? "written" : "");
    kSelf.Check(id.status(), "PostWrite");
    ids.push_back(*id);
  }
  std::string result = "OK";
  for (TransferId id : ids) {
    auto state = WaitForTransfer(t, id, PairPeer::Deadline());
    if (!state.ok()) {
      result = state.status().ToString();
      break;
    }
  }
  kSelf.Check(WriteLine(kPeerOutFd, "DONE " + result), "write");
  for (;;) {
    kSelf.Check(t.Progress(), "Progress");
    if (in.Readable()) return 0;
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
    if (!ok) kvstream::test::kSelf.Die(absl::StrCat("bad flag ", argv[i]));
  }
  if (f.bytes == 0) kvstream::test::kSelf.Die("--bytes is required");
  if (f.role == "receiver") return kvstream::test::Receiver(f);
  if (f.role == "writer" && f.block > 0 && f.regions > 0) return kvstream::test::Writer(f);
  kvstream::test::kSelf.Die("--role=receiver|writer (writer: --block, --count, --regions)");
}
