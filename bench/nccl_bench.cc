// kvstream_bench_nccl: one layer's KV blocks moved from GPU 0 to GPU 1 (two processes) by the
// nccl transport, beside a raw contiguous ncclSend/ncclRecv of the same bytes on a
// communicator of the benchmark's own, measured in the same run.
//
//   NCCL_NVLS_ENABLE=0 kvstream_bench_nccl [--device=0] [--peer-device=1] [--layers=20]
//                                          [--staging-mib=64]
//
// The program spawns itself as the receiver (--role=receiver, on --peer-device: the nccl
// transport with a 256 MiB pool from AllocateMemory, progressed all the time, and rank 1 of
// the raw communicator, whose ncclUniqueId it gets on its command line). Layers are
// Llama-3-8B's: 8 KV heads of head size 128 in bf16, 2 KiB per token per tensor; a layer of
// T tokens is 2 x T / block_size blocks of block_size x 2 KiB, drawn at random from the pool
// on both sides ("shuffled": nothing is contiguous), or one contiguous run ("contiguous":
// the in-place path). Each row posts --layers layers back to back (one PostWrite each, with a
// notification) and stops the clock when the last is done; the raw row enqueues as many
// contiguous ncclSend of a layer's bytes on one stream (the receiver as many ncclRecv) and
// stops when an event after the last has completed, polled the same way. GB/s are of KV
// bytes (1e9 bytes per second); "ratio" is the transport's rate over the raw one of the
// same bytes. The receiver's raw receives are posted before the sender's clock starts, so
// the raw rows measure NCCL alone.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <nccl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/transfer/nccl_transport.h"
#include "kvstream/transfer/transport.h"

extern char** environ;

namespace kvstream {
namespace {

constexpr size_t kPoolBytes = size_t{256} << 20;
constexpr size_t kTokenBytesPerTensor = 8 * 128 * 2;
constexpr int kWarmupLayers = 3;

struct Flags {
  std::string role = "sender";
  int device = 0;
  int peer_device = 1;
  int layers = 20;
  uint64_t staging_mib = 64;
  std::string raw_id;  // receiver: the raw communicator's unique id, hex
};

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "kvstream_bench_nccl: %s\n", what.c_str());
  std::exit(1);
}

void Check(const absl::Status& status, const std::string& what) {
  if (!status.ok()) Die(absl::StrCat(what, ": ", status.ToString()));
}

void CheckNccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) Die(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

void CheckCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) Die(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

template <typename T>
T Value(absl::StatusOr<T> v, const std::string& what) {
  Check(v.status(), what);
  return std::move(v).value();
}

NcclTransportOptions TransportOptions(const Flags& f, int device) {
  NcclTransportOptions o;
  o.device = device;
  o.staging_bytes = f.staging_mib << 20;
  o.in_place_min_bytes = std::min<uint64_t>(o.in_place_min_bytes, o.staging_bytes);
  o.table_entries = size_t{1} << 18;
  return o;
}

// Polls until `event` completed (the same way the transport's completions are seen).
void Poll(cudaEvent_t event) {
  for (;;) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) CheckCuda(e, "cudaEventQuery");
  }
}

// --- The receiver: commands on stdin ("RAW <bytes> <count>", "STOP"), "READY"/"DONE" on
// stdout; the transport progressed between them. ---

int RunReceiver(const Flags& f) {
  CheckCuda(cudaSetDevice(f.device), "cudaSetDevice");
  auto transport = Value(CreateNcclTransport(TransportOptions(f, f.device)), "CreateNcclTransport");
  auto pool = Value(transport->AllocateMemory(kPoolBytes, MemoryKind::kDevice), "AllocateMemory");
  std::printf("INFO %s\nDESC %s\n", absl::BytesToHexString(*transport->LocalInfo()).c_str(),
              absl::BytesToHexString(pool->descriptor()).c_str());
  std::fflush(stdout);
  const std::string id_bytes = absl::HexStringToBytes(f.raw_id);
  if (id_bytes.size() != sizeof(ncclUniqueId)) Die("bad --raw-id");
  ncclUniqueId id;
  std::copy(id_bytes.begin(), id_bytes.end(), id.internal);
  ncclComm_t raw = nullptr;
  CheckNccl(ncclCommInitRank(&raw, 2, id, 1), "ncclCommInitRank (receiver)");
  cudaStream_t stream = nullptr;
  CheckCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  std::string line;
  for (;;) {
    Check(transport->Progress(), "Progress");
    (void)transport->PollNotifications();
    pollfd p{0, POLLIN, 0};
    if (poll(&p, 1, 0) <= 0) continue;
    char c = 0;
    if (read(0, &c, 1) != 1) return 0;  // the sender is gone
    if (c != '\n') {
      line.push_back(c);
      continue;
    }
    std::vector<std::string> parts = absl::StrSplit(line, ' ');
    line.clear();
    if (parts[0] == "STOP") break;
    size_t bytes = 0;
    int count = 0;
    if (parts.size() != 3 || parts[0] != "RAW" || !absl::SimpleAtoi(parts[1], &bytes) ||
        !absl::SimpleAtoi(parts[2], &count) || bytes > kPoolBytes) {
      Die("bad command");
    }
    for (int i = 0; i < count; ++i) {
      CheckNccl(ncclRecv(pool->base(), bytes, ncclUint8, 0, raw, stream), "ncclRecv");
    }
    std::printf("READY\n");
    std::fflush(stdout);
    CheckCuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    std::printf("DONE\n");
    std::fflush(stdout);
  }
  CheckNccl(ncclCommDestroy(raw), "ncclCommDestroy");
  return 0;
}

// --- The sender ---

struct Receiver {
  pid_t pid = -1;
  int to = -1;    // its stdin
  int from = -1;  // its stdout
  std::string pending;
  std::string info, descriptor;

  std::string ReadLine() {
    const absl::Time deadline = absl::Now() + absl::Seconds(120);
    for (;;) {
      const size_t nl = pending.find('\n');
      if (nl != std::string::npos) {
        std::string out = pending.substr(0, nl);
        pending.erase(0, nl + 1);
        return out;
      }
      pollfd p{from, POLLIN, 0};
      if (poll(&p, 1, 100) > 0) {
        char buf[4096];
        const ssize_t n = read(from, buf, sizeof(buf));
        if (n <= 0) Die("the receiver exited");
        pending.append(buf, static_cast<size_t>(n));
      }
      if (absl::Now() > deadline) Die("the receiver does not answer");
    }
  }
  void Say(const std::string& line) {
    const std::string l = line + "\n";
    if (write(to, l.data(), l.size()) != static_cast<ssize_t>(l.size())) Die("write to receiver");
  }
};

Receiver SpawnReceiver(const char* self, const Flags& f, const ncclUniqueId& id) {
  int in[2], out[2];
  if (pipe(in) != 0 || pipe(out) != 0) Die("pipe");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[0], 0);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  posix_spawn_file_actions_addclose(&actions, in[1]);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  const std::string device = absl::StrCat("--device=", f.peer_device);
  const std::string staging = absl::StrCat("--staging-mib=", f.staging_mib);
  const std::string raw =
      absl::StrCat("--raw-id=", absl::BytesToHexString(absl::string_view(id.internal, sizeof(id.internal))));
  char* argv[] = {const_cast<char*>(self), const_cast<char*>("--role=receiver"),
                  const_cast<char*>(device.c_str()), const_cast<char*>(staging.c_str()),
                  const_cast<char*>(raw.c_str()), nullptr};
  Receiver r;
  if (posix_spawn(&r.pid, self, &actions, nullptr, argv, environ) != 0) Die("posix_spawn");
  posix_spawn_file_actions_destroy(&actions);
  close(in[0]);
  close(out[1]);
  r.to = in[1];
  r.from = out[0];
  for (int i = 0; i < 2; ++i) {
    std::string line = r.ReadLine();
    absl::string_view rest = line;
    if (absl::ConsumePrefix(&rest, "INFO ")) r.info = absl::HexStringToBytes(rest);
    if (absl::ConsumePrefix(&rest, "DESC ")) r.descriptor = absl::HexStringToBytes(rest);
  }
  if (r.info.empty() || r.descriptor.empty()) Die("the receiver's first lines");
  return r;
}

std::vector<Segment> Blocks(size_t count, size_t bytes, bool shuffled, uint32_t seed) {
  const size_t slots = kPoolBytes / bytes;
  if (count > slots) Die("layer larger than the pool");
  std::vector<uint64_t> src(slots), dst(slots);
  std::iota(src.begin(), src.end(), 0);
  std::iota(dst.begin(), dst.end(), 0);
  if (shuffled) {
    std::mt19937_64 rng(seed);
    std::shuffle(src.begin(), src.end(), rng);
    std::shuffle(dst.begin(), dst.end(), rng);
  }
  std::vector<Segment> segments(count);
  for (size_t i = 0; i < count; ++i) segments[i] = {src[i] * bytes, dst[i] * bytes, bytes};
  return segments;
}

double Gbps(double bytes, absl::Duration d) { return bytes / absl::ToDoubleSeconds(d) / 1e9; }

int RunSender(const char* self, const Flags& f) {
  CheckCuda(cudaSetDevice(f.device), "cudaSetDevice");
  ncclUniqueId id;
  CheckNccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  Receiver r = SpawnReceiver(self, f, id);
  auto transport = Value(CreateNcclTransport(TransportOptions(f, f.device)), "CreateNcclTransport");
  auto pool = Value(transport->AllocateMemory(kPoolBytes, MemoryKind::kDevice), "AllocateMemory");
  const PeerId peer = Value(transport->Connect(r.info), "Connect");
  auto remote = Value(transport->ImportRemote(peer, r.descriptor), "ImportRemote");
  ncclComm_t raw = nullptr;
  CheckNccl(ncclCommInitRank(&raw, 2, id, 0), "ncclCommInitRank (sender)");
  cudaStream_t stream = nullptr;
  CheckCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaEvent_t done = nullptr;
  CheckCuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");

  auto raw_row = [&](size_t bytes, int count) {
    r.Say(absl::StrCat("RAW ", bytes, " ", count));
    if (r.ReadLine() != "READY") Die("receiver not ready");
    const absl::Time t0 = absl::Now();
    for (int i = 0; i < count; ++i) {
      CheckNccl(ncclSend(pool->base(), bytes, ncclUint8, 1, raw, stream), "ncclSend");
    }
    CheckCuda(cudaEventRecord(done, stream), "cudaEventRecord");
    Poll(done);
    const absl::Duration d = absl::Now() - t0;
    if (r.ReadLine() != "DONE") Die("receiver not done");
    return d;
  };
  auto transport_row = [&](const std::vector<std::vector<Segment>>& layers) {
    const absl::Time t0 = absl::Now();
    std::vector<TransferId> ids;
    for (size_t i = 0; i < layers.size(); ++i) {
      ids.push_back(Value(transport->PostWrite(peer, *pool, *remote, layers[i],
                                               absl::StrCat("layer ", i)),
                          "PostWrite"));
    }
    for (TransferId t : ids) {
      Value(WaitForTransfer(*transport, t, absl::Now() + absl::Seconds(120)), "WaitForTransfer");
      transport->Release(t);
    }
    return absl::Now() - t0;
  };

  std::printf("%-10s %6s %6s %10s %12s %12s %8s\n", "layout", "tokens", "block", "layer MiB",
              "nccl GB/s", "raw GB/s", "ratio");
  for (bool shuffled : {true, false}) {
    for (size_t tokens : {1024u, 8192u, 32768u}) {
      for (size_t block : {16u, 64u}) {
        if (!shuffled && block == 64) continue;  // one run: the block size does not matter
        const size_t block_bytes = block * kTokenBytesPerTensor;
        const size_t count = 2 * tokens / block;
        const size_t layer_bytes = count * block_bytes;
        std::vector<std::vector<Segment>> layers;
        for (int i = 0; i < f.layers; ++i) {
          layers.push_back(Blocks(count, block_bytes, shuffled, static_cast<uint32_t>(i)));
        }
        transport_row({layers.begin(), layers.begin() + kWarmupLayers});
        raw_row(layer_bytes, kWarmupLayers);
        const absl::Duration ours = transport_row(layers);
        const absl::Duration theirs = raw_row(layer_bytes, f.layers);
        const double bytes = static_cast<double>(layer_bytes) * f.layers;
        const double a = Gbps(bytes, ours);
        const double b = Gbps(bytes, theirs);
        std::printf("%-10s %6zu %6zu %10.1f %12.1f %12.1f %8.3f\n",
                    shuffled ? "shuffled" : "contiguous", tokens, block,
                    static_cast<double>(layer_bytes) / (1 << 20), a, b, a / b);
        std::fflush(stdout);
      }
    }
  }
  r.Say("STOP");
  remote.reset();
  Check(transport->Disconnect(peer), "Disconnect");
  CheckNccl(ncclCommDestroy(raw), "ncclCommDestroy");
  int status = 0;
  waitpid(r.pid, &status, 0);
  return 0;
}

}  // namespace
}  // namespace kvstream

int main(int argc, char** argv) {
  using kvstream::Flags;
  Flags f;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    bool ok = true;
    if (absl::ConsumePrefix(&arg, "--role=")) {
      f.role = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--device=")) {
      ok = absl::SimpleAtoi(arg, &f.device);
    } else if (absl::ConsumePrefix(&arg, "--peer-device=")) {
      ok = absl::SimpleAtoi(arg, &f.peer_device);
    } else if (absl::ConsumePrefix(&arg, "--layers=")) {
      ok = absl::SimpleAtoi(arg, &f.layers) && f.layers > kvstream::kWarmupLayers;
    } else if (absl::ConsumePrefix(&arg, "--staging-mib=")) {
      ok = absl::SimpleAtoi(arg, &f.staging_mib);
    } else if (absl::ConsumePrefix(&arg, "--raw-id=")) {
      f.raw_id = std::string(arg);
    } else {
      ok = false;
    }
    if (!ok) kvstream::Die(absl::StrCat("bad flag ", argv[i]));
  }
  if (kvstream::GpuCount() < 2) {
    std::printf("SKIPPED: kvstream_bench_nccl needs two GPUs (%d visible)\n", kvstream::GpuCount());
    return 0;
  }
  return f.role == "receiver" ? kvstream::RunReceiver(f) : kvstream::RunSender(argv[0], f);
}
