// The receiving peer process of ucx_staged_gpu_test's two-process cases: a UCX transport
// with a device region, written into by the test process through the staged path.
//
//   kvstream_ucx_staged_gpu_peer --tls=shm|tcp --bytes=N [--chunk=B] [--slots=S]
//     Allocates N zeroed bytes of device memory (Transport::AllocateMemory) and writes
//     "INFO <hex worker info>", "DESC <hex descriptor>", "READY" to fd 3. Then progresses;
//     for each notification whose payload starts with "dump": copies the region to the host
//     and writes "DUMP <hex payload> <N>" followed by the N bytes (the region as it is at
//     the moment the notification was delivered); "exit": writes "BYE" and exits 0;
//     anything else: "NOTE <hex payload>".
//
// Exits non-zero with a message on stderr on any error. Lives only as long as its parent.
#include <cuda_runtime.h>
#include <poll.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "kvstream/transfer/transport.h"
#include "kvstream/transfer/ucx_transport.h"
#include "tests/integration/ucx_transport_peer.h"

namespace kvstream {
namespace test {
namespace {

int Fail(const std::string& message) {
  std::fprintf(stderr, "ucx_staged_gpu_peer: %s\n", message.c_str());
  return 1;
}

std::map<std::string, std::string> ParseFlags(int argc, char** argv) {
  std::map<std::string, std::string> flags;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (!absl::ConsumePrefix(&arg, "--")) continue;
    const size_t eq = arg.find('=');
    flags[std::string(arg.substr(0, eq))] =
        eq == absl::string_view::npos ? "true" : std::string(arg.substr(eq + 1));
  }
  return flags;
}

bool StdinClosed() {
  pollfd p{0, POLLIN, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  char buffer[256];
  return ::read(0, buffer, sizeof(buffer)) <= 0;
}

int Main(int argc, char** argv) {
  std::map<std::string, std::string> flags = ParseFlags(argc, argv);
  UcxTransportOptions options;
  options.tls = flags.count("tls") ? flags["tls"] : "shm";
  if (options.tls == "tcp") options.net_devices = "lo";
  uint64_t bytes = 0, value = 0;
  if (!absl::SimpleAtoi(flags["bytes"], &bytes) || bytes == 0) return Fail("bad --bytes");
  if (flags.count("chunk")) {
    if (!absl::SimpleAtoi(flags["chunk"], &value)) return Fail("bad --chunk");
    options.staged_chunk_bytes = value;
  }
  if (flags.count("slots")) {
    if (!absl::SimpleAtoi(flags["slots"], &value)) return Fail("bad --slots");
    options.staged_slots = static_cast<int>(value);
  }
  auto transport = CreateUcxTransport(options);
  if (!transport.ok()) return Fail(transport.status().ToString());
  Transport& t = **transport;
  auto region = t.AllocateMemory(bytes, MemoryKind::kDevice);
  if (!region.ok()) return Fail(region.status().ToString());
  auto info = t.LocalInfo();
  if (!info.ok()) return Fail(info.status().ToString());
  if (!WriteLine(kPeerOutFd, "INFO " + absl::BytesToHexString(*info)).ok() ||
      !WriteLine(kPeerOutFd, "DESC " + absl::BytesToHexString((*region)->descriptor())).ok() ||
      !WriteLine(kPeerOutFd, "READY").ok()) {
    return Fail("cannot write to the parent");
  }
  std::vector<char> host(bytes);
  // Dumps read on a non-blocking stream, which does not wait for the transport's streams:
  // a notification delivered before its scatter finished would show as missing bytes.
  cudaStream_t dump_stream = nullptr;
  if (cudaStreamCreateWithFlags(&dump_stream, cudaStreamNonBlocking) != cudaSuccess) {
    return Fail("cudaStreamCreateWithFlags failed");
  }
  while (!StdinClosed()) {
    absl::Status progress = t.Progress();
    if (!progress.ok()) return Fail(progress.ToString());
    for (const Notification& n : t.PollNotifications()) {
      if (n.payload == "exit") {
        (void)WriteLine(kPeerOutFd, "BYE");
        return 0;
      }
      const std::string hex = absl::BytesToHexString(n.payload);
      if (absl::StartsWith(n.payload, "dump")) {
        if (cudaMemcpyAsync(host.data(), (*region)->base(), bytes, cudaMemcpyDeviceToHost,
                            dump_stream) != cudaSuccess ||
            cudaStreamSynchronize(dump_stream) != cudaSuccess) {
          return Fail("cudaMemcpy of the region failed");
        }
        absl::Status s = WriteLine(kPeerOutFd, absl::StrCat("DUMP ", hex, " ", bytes));
        if (s.ok()) s = WriteAll(kPeerOutFd, host.data(), bytes);
        if (!s.ok()) return Fail(s.ToString());
      } else if (!WriteLine(kPeerOutFd, "NOTE " + hex).ok()) {
        return Fail("cannot write to the parent");
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace test
}  // namespace kvstream

int main(int argc, char** argv) { return kvstream::test::Main(argc, argv); }
