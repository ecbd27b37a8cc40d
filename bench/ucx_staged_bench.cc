// Benchmark: the UCX transport's staged device path between two processes on one GPU
// (device memory -> gather kernel -> pinned landing slot -> host-to-device copy -> scatter
// kernel), with Llama-3-8B layer shapes: 8 KV heads, head size 128, bf16, so one token's K
// is 8 * 128 * 2 = 2 KiB and its K plus V 4 KiB per layer; a block of 16 tokens is 32 KiB
// of K (and as much V), one of 64 tokens 128 KiB.
//
// For each block size (16, 64) and prompt length (1k, 8k, 32k tokens) this process (the
// prefill side) posts `--layers` layer writes back to back - each the layer's K blocks and
// V blocks, from shuffled slots of a pool twice the size needed into shuffled slots of the
// peer's pool, with a notification - and the peer process (this program with
// --role=receiver) answers every notification it gets with an "ack". The figure is the
// layers' KV bytes over the time from the first post to the last ack (best of --reps).
// The ceiling, measured in the same run in this process: the same bytes copied device ->
// pinned host and pinned host -> device with cudaMemcpyAsync, timed back to back:
// bytes / (t_d2h + t_h2d). Printed: GB/s, ceiling GB/s, ratio.
//
//   kvstream_bench_ucx_staged [--tls=shm|tcp] [--layers=32] [--reps=3]
//                             [--chunk=4194304] [--slots=4]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "kvstream/transfer/transport.h"
#include "kvstream/transfer/ucx_transport.h"
#include "tests/integration/ucx_transport_peer.h"

namespace kvstream {
namespace {

constexpr uint64_t kTokenKBytes = 8 * 128 * 2;  // one token of K (or V), one layer
constexpr uint64_t kMaxTokens = 32768;
// The pool: twice the blocks needed, K pool then V pool.
constexpr uint64_t kRegionBytes = 2 * (2 * kMaxTokens * kTokenKBytes);

int Fail(const std::string& message) {
  std::fprintf(stderr, "ucx_staged_bench: %s\n", message.c_str());
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

uint64_t Flag(const std::map<std::string, std::string>& flags, const std::string& name,
              uint64_t fallback) {
  auto it = flags.find(name);
  uint64_t value = fallback;
  if (it != flags.end() && !absl::SimpleAtoi(it->second, &value)) {
    std::fprintf(stderr, "ucx_staged_bench: bad --%s\n", name.c_str());
    std::exit(2);
  }
  return value;
}

UcxTransportOptions Options(const std::map<std::string, std::string>& flags) {
  UcxTransportOptions options;
  options.tls = flags.count("tls") ? flags.at("tls") : "shm";
  if (options.tls == "tcp") options.net_devices = "lo";
  options.staged_chunk_bytes = Flag(flags, "chunk", options.staged_chunk_bytes);
  options.staged_slots = static_cast<int>(Flag(flags, "slots", options.staged_slots));
  return options;
}

// The receiving side: a device region; every notification but "exit" is answered "ack".
int RunReceiver(const std::map<std::string, std::string>& flags) {
  auto transport = CreateUcxTransport(Options(flags));
  if (!transport.ok()) return Fail(transport.status().ToString());
  Transport& t = **transport;
  auto region = t.AllocateMemory(kRegionBytes, MemoryKind::kDevice);
  if (!region.ok()) return Fail(region.status().ToString());
  if (!test::WriteLine(test::kPeerOutFd, "INFO " + absl::BytesToHexString(*t.LocalInfo())).ok() ||
      !test::WriteLine(test::kPeerOutFd, "DESC " + absl::BytesToHexString((*region)->descriptor()))
           .ok() ||
      !test::WriteLine(test::kPeerOutFd, "READY").ok()) {
    return Fail("cannot write to the parent");
  }
  std::vector<TransferId> acks;
  while (true) {
    absl::Status progress = t.Progress();
    if (!progress.ok()) return Fail(progress.ToString());
    for (const Notification& n : t.PollNotifications()) {
      if (n.payload == "exit") return 0;
      auto id = t.PostNotification(n.peer, "ack");
      if (!id.ok()) return Fail(id.status().ToString());
      acks.push_back(*id);
    }
    // Acks are released once sent.
    acks.erase(std::remove_if(acks.begin(), acks.end(),
                              [&](TransferId id) {
                                auto state = t.Test(id);
                                if (state.ok() && *state == TransferState::kInProgress) {
                                  return false;
                                }
                                t.Release(id);
                                return true;
                              }),
               acks.end());
  }
}

// One layer: K blocks then V blocks, shuffled on both sides within pools twice as large.
std::vector<Segment> LayerSegments(uint64_t tokens, uint64_t block_tokens, uint32_t seed) {
  const uint64_t block = block_tokens * kTokenKBytes;
  const uint64_t blocks = tokens / block_tokens;
  const uint64_t pool = 2 * blocks;
  const uint64_t pool_bytes = pool * block;  // V pool starts here
  std::vector<Segment> segments =
      test::ScatteredSegments(blocks, block, pool, seed);  // K, in the K pool
  std::vector<Segment> v = test::ScatteredSegments(blocks, block, pool, seed + 1);
  for (Segment& s : v) {
    s.local_offset += pool_bytes;
    s.remote_offset += pool_bytes;
    segments.push_back(s);
  }
  return segments;
}

// bytes / (t_d2h + t_h2d), cudaMemcpyAsync between device memory and pinned host memory,
// each direction timed by events (best of 5).
absl::StatusOr<double> CeilingGBps(uint64_t bytes) {
  void* device = nullptr;
  void* host = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t a = nullptr, b = nullptr, c = nullptr;
  if (cudaMalloc(&device, bytes) != cudaSuccess || cudaMallocHost(&host, bytes) != cudaSuccess ||
      cudaStreamCreate(&stream) != cudaSuccess || cudaEventCreate(&a) != cudaSuccess ||
      cudaEventCreate(&b) != cudaSuccess || cudaEventCreate(&c) != cudaSuccess) {
    return absl::InternalError("ceiling: CUDA setup failed");
  }
  float best = 1e30f;
  for (int rep = 0; rep < 6; ++rep) {
    cudaEventRecord(a, stream);
    cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream);
    cudaEventRecord(b, stream);
    cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream);
    cudaEventRecord(c, stream);
    if (cudaStreamSynchronize(stream) != cudaSuccess) {
      return absl::InternalError("ceiling: copies failed");
    }
    float d2h = 0, h2d = 0;
    cudaEventElapsedTime(&d2h, a, b);
    cudaEventElapsedTime(&h2d, b, c);
    if (rep > 0) best = std::min(best, d2h + h2d);  // the first warms up
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaEventDestroy(c);
  cudaStreamDestroy(stream);
  cudaFreeHost(host);
  cudaFree(device);
  return static_cast<double>(bytes) / (best * 1e-3) / 1e9;
}

int RunSender(const std::map<std::string, std::string>& flags, const std::string& self) {
  const uint64_t layers = Flag(flags, "layers", 32);
  const uint64_t reps = Flag(flags, "reps", 3);
  const UcxTransportOptions options = Options(flags);
  std::vector<std::string> argv = {self, "--role=receiver", "--tls=" + options.tls,
                                   absl::StrCat("--chunk=", options.staged_chunk_bytes),
                                   absl::StrCat("--slots=", options.staged_slots)};
  auto child = test::ChildProcess::Spawn(argv);
  if (!child.ok()) return Fail(child.status().ToString());
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  auto info = (*child)->reader().ReadLine(deadline);
  auto descriptor = (*child)->reader().ReadLine(deadline);
  auto ready = (*child)->reader().ReadLine(deadline);
  if (!info.ok() || !descriptor.ok() || !ready.ok() || *ready != "READY" ||
      !absl::StartsWith(*info, "INFO ") || !absl::StartsWith(*descriptor, "DESC ")) {
    return Fail("the receiver did not start");
  }
  auto transport = CreateUcxTransport(options);
  if (!transport.ok()) return Fail(transport.status().ToString());
  Transport& t = **transport;
  auto src = t.AllocateMemory(kRegionBytes, MemoryKind::kDevice);
  if (!src.ok()) return Fail(src.status().ToString());
  auto peer = t.Connect(absl::HexStringToBytes(info->substr(5)));
  if (!peer.ok()) return Fail(peer.status().ToString());
  auto remote = t.ImportRemote(*peer, absl::HexStringToBytes(descriptor->substr(5)));
  if (!remote.ok()) return Fail(remote.status().ToString());

  std::printf("UCX staged device path, tls=%s, chunk %llu bytes, %d slots, %llu layers per "
              "run, best of %llu\n",
              options.tls.c_str(), static_cast<unsigned long long>(options.staged_chunk_bytes),
              options.staged_slots, static_cast<unsigned long long>(layers),
              static_cast<unsigned long long>(reps));
  std::printf("%-6s %-7s %-12s %10s %12s %7s\n", "block", "tokens", "layer bytes", "GB/s",
              "ceiling GB/s", "ratio");
  for (uint64_t block_tokens : {uint64_t{16}, uint64_t{64}}) {
    for (uint64_t tokens : {uint64_t{1024}, uint64_t{8192}, uint64_t{32768}}) {
      const std::vector<Segment> segments = LayerSegments(tokens, block_tokens, 7);
      const uint64_t layer_bytes = tokens * 2 * kTokenKBytes;
      double best_seconds = 1e30;
      for (uint64_t rep = 0; rep <= reps; ++rep) {  // rep 0 warms up
        const uint64_t n = rep == 0 ? 2 : layers;
        std::vector<TransferId> ids;
        const absl::Time start = absl::Now();
        for (uint64_t l = 0; l < n; ++l) {
          auto id = t.PostWrite(*peer, **src, **remote, segments, absl::StrCat("layer ", l));
          if (!id.ok()) return Fail(id.status().ToString());
          ids.push_back(*id);
        }
        uint64_t acked = 0;
        const absl::Time run_deadline = absl::Now() + absl::Seconds(120);
        while (acked < n) {
          if (absl::Now() > run_deadline) return Fail("timed out waiting for acks");
          absl::Status progress = t.Progress();
          if (!progress.ok()) return Fail(progress.ToString());
          for (const Notification& note : t.PollNotifications()) acked += note.payload == "ack";
        }
        const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
        for (TransferId id : ids) {
          auto state = WaitForTransfer(t, id, run_deadline);
          if (!state.ok()) return Fail(state.status().ToString());
          t.Release(id);
        }
        if (rep > 0) best_seconds = std::min(best_seconds, seconds);
      }
      const double gbps = static_cast<double>(layers * layer_bytes) / best_seconds / 1e9;
      absl::StatusOr<double> ceiling = CeilingGBps(layer_bytes);
      if (!ceiling.ok()) return Fail(ceiling.status().ToString());
      std::printf("%-6llu %-7llu %-12llu %10.2f %12.2f %7.3f\n",
                  static_cast<unsigned long long>(block_tokens),
                  static_cast<unsigned long long>(tokens),
                  static_cast<unsigned long long>(layer_bytes), gbps, *ceiling, gbps / *ceiling);
      std::fflush(stdout);
    }
  }
  auto bye = t.PostNotification(*peer, "exit");
  if (bye.ok()) (void)WaitForTransfer(t, *bye, absl::Now() + absl::Seconds(10));
  remote->reset();
  src->reset();
  return 0;
}

}  // namespace
}  // namespace kvstream

int main(int argc, char** argv) {
  const auto flags = kvstream::ParseFlags(argc, argv);
  if (flags.count("role") && flags.at("role") == "receiver") {
    return kvstream::RunReceiver(flags);
  }
  return kvstream::RunSender(flags, "/proc/self/exe");
}
