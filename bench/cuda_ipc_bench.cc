// kvstream_bench_cuda_ipc: one layer's KV blocks moved between two processes on one GPU by
// the cuda_ipc transport, beside one contiguous device-to-device cudaMemcpyAsync of the same
// bytes in this process, measured in the same run.
//
//   kvstream_bench_cuda_ipc [--device=N] [--layers=N] [--sweep] [--post-cost]
//
// The program spawns itself as the receiver (--role=receiver: a 256 MiB pool from
// AllocateMemory, progressed until told to stop). Layers are Llama-3-8B's: 8 KV heads of
// head size 128 in bf16, 2 KiB per token per tensor, K and V each a block of
// block_size x 2 KiB; a layer of T tokens is 2 x T / block_size segments, one per block,
// with block ids drawn at random from the pool on both sides (nothing is contiguous).
// Each row posts --layers layers back to back (one PostWrite each, with a notification)
// and stops the clock when the last is done (its notification handed to the socket);
// the ceiling row enqueues as many contiguous cudaMemcpyAsync of the layer's bytes on one
// stream and stops when an event after the last has completed, polled the same way. GB/s
// are of KV bytes (1e9 bytes per second).
//
// --sweep repeats the 8k- and 32k-token rows for every kernel shape (CTAs per SM, 16-byte
// vectors per thread) and with long segments on the copy engine; --post-cost times the
// PostWrite call alone (median of 50, each after the previous write completed) for 64 to
// 16384 segments of 8 KiB, which should stay flat per call apart from writing the table.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/transfer/cuda_ipc_transport.h"
#include "kvstream/transfer/transport.h"

extern char** environ;

namespace kvstream {
namespace {

constexpr size_t kPoolBytes = size_t{256} << 20;  // per side: twice the largest layer
constexpr size_t kTokenBytesPerTensor = 8 * 128 * 2;  // 8 KV heads x 128 x bf16
constexpr int kWarmupLayers = 3;

struct Flags {
  std::string role = "sender";
  int device = 0;
  int layers = 20;
  bool sweep = false;
  bool post_cost = false;
};

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "kvstream_bench_cuda_ipc: %s\n", what.c_str());
  std::exit(1);
}

void Check(const absl::Status& status, const std::string& what) {
  if (!status.ok()) Die(absl::StrCat(what, ": ", status.ToString()));
}

template <typename T>
T Value(absl::StatusOr<T> v, const std::string& what) {
  Check(v.status(), what);
  return std::move(v).value();
}

// --- The receiver ---

int RunReceiver(const Flags& f) {
  CudaIpcTransportOptions options;
  options.device = f.device;
  auto transport = Value(CreateCudaIpcTransport(options), "CreateCudaIpcTransport");
  auto pool = Value(transport->AllocateMemory(kPoolBytes, MemoryKind::kDevice), "AllocateMemory");
  std::printf("INFO %s\nDESC %s\n", absl::BytesToHexString(*transport->LocalInfo()).c_str(),
              absl::BytesToHexString(pool->descriptor()).c_str());
  std::fflush(stdout);
  const pid_t parent = getppid();
  for (int spins = 0;; ++spins) {
    Check(transport->Progress(), "Progress");
    for (const Notification& n : transport->PollNotifications()) {
      if (n.payload == "stop") return 0;
    }
    if ((spins & 0xffff) == 0 && getppid() != parent) return 0;  // the sender is gone
  }
}

// --- The sender ---

struct Receiver {
  pid_t pid = -1;
  std::string info;
  std::string descriptor;
};

Receiver SpawnReceiver(const char* self, const Flags& f) {
  int out[2];
  if (pipe(out) != 0) Die("pipe");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  const std::string device = absl::StrCat("--device=", f.device);
  char* argv[] = {const_cast<char*>(self), const_cast<char*>("--role=receiver"),
                  const_cast<char*>(device.c_str()), nullptr};
  Receiver r;
  if (posix_spawn(&r.pid, self, &actions, nullptr, argv, environ) != 0) Die("posix_spawn");
  posix_spawn_file_actions_destroy(&actions);
  close(out[1]);
  std::string text;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (std::count(text.begin(), text.end(), '\n') < 2) {
    pollfd p{out[0], POLLIN, 0};
    if (poll(&p, 1, 100) > 0) {
      char buf[4096];
      const ssize_t n = read(out[0], buf, sizeof(buf));
      if (n <= 0) Die("the receiver exited before it was ready");
      text.append(buf, static_cast<size_t>(n));
    }
    if (absl::Now() > deadline) Die("the receiver did not start");
  }
  close(out[0]);
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::ConsumePrefix(&line, "INFO ")) r.info = absl::HexStringToBytes(line);
    if (absl::ConsumePrefix(&line, "DESC ")) r.descriptor = absl::HexStringToBytes(line);
  }
  if (r.info.empty() || r.descriptor.empty()) Die("the receiver's first lines: " + text);
  return r;
}

// `count` segments of `bytes` from random distinct slots of the pool to random distinct
// slots of the pool.
std::vector<Segment> ShuffledBlocks(size_t count, size_t bytes, uint32_t seed) {
  const size_t slots = kPoolBytes / bytes;
  if (count > slots) Die("layer larger than the pool");
  std::vector<uint64_t> src(slots), dst(slots);
  std::iota(src.begin(), src.end(), 0);
  std::iota(dst.begin(), dst.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(src.begin(), src.end(), rng);
  std::shuffle(dst.begin(), dst.end(), rng);
  std::vector<Segment> segments(count);
  for (size_t i = 0; i < count; ++i) {
    segments[i].local_offset = src[i] * bytes;
    segments[i].remote_offset = dst[i] * bytes;
    segments[i].length = bytes;
  }
  return segments;
}

// One sender transport connected to the receiver, with its pool.
struct Sender {
  std::unique_ptr<Transport> transport;
  std::unique_ptr<MemoryRegistration> pool;
  std::unique_ptr<RemoteMemory> remote;
  PeerId peer = 0;
};

Sender Connect(const Receiver& r, const CudaIpcTransportOptions& options) {
  Sender s;
  s.transport = Value(CreateCudaIpcTransport(options), "CreateCudaIpcTransport");
  s.pool = Value(s.transport->AllocateMemory(kPoolBytes, MemoryKind::kDevice), "AllocateMemory");
  s.peer = Value(s.transport->Connect(r.info), "Connect");
  s.remote = Value(s.transport->ImportRemote(s.peer, r.descriptor), "ImportRemote");
  return s;
}

void Drop(Sender& s) {
  s.remote.reset();
  Check(s.transport->Disconnect(s.peer), "Disconnect");
  s.pool.reset();
  s.transport.reset();
}

// Seconds for `layers` layers posted back to back until the last is done.
double TimeLayers(Sender& s, const std::vector<Segment>& segments, int layers) {
  std::vector<TransferId> ids;
  const absl::Time start = absl::Now();
  for (int i = 0; i < layers; ++i) {
    ids.push_back(Value(s.transport->PostWrite(s.peer, *s.pool, *s.remote, segments, "layer"),
                        "PostWrite"));
  }
  for (TransferId id : ids) {
    Check(WaitForTransfer(*s.transport, id, absl::Now() + absl::Seconds(60)).status(),
          "WaitForTransfer");
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  for (TransferId id : ids) s.transport->Release(id);
  return seconds;
}

// Seconds for `layers` contiguous device-to-device copies of `bytes`, polled like the above.
double TimeMemcpy(void* dst, const void* src, size_t bytes, int layers, cudaStream_t stream,
                  CudaEvent& done) {
  const absl::Time start = absl::Now();
  for (int i = 0; i < layers; ++i) {
    Check(CudaErrorToStatus(static_cast<int>(cudaMemcpyAsync(dst, src, bytes,
                                                             cudaMemcpyDeviceToDevice, stream)),
                            "cudaMemcpyAsync"),
          "memcpy");
  }
  Check(done.Record(stream), "cudaEventRecord");
  while (!Value(done.Query(), "cudaEventQuery")) {
  }
  return absl::ToDoubleSeconds(absl::Now() - start);
}

struct Row {
  int block_size;
  int tokens;
};

void PrintHeader(const char* extra) {
  std::printf("%-28s %6s %7s %9s %10s %10s %10s %7s\n", extra, "block", "tokens", "segments",
              "KV MiB", "ipc GB/s", "memcpy GB/s", "ratio");
}

void RunRow(Sender& s, const Row& row, int layers, const char* label, void* scratch_a,
            void* scratch_b, cudaStream_t stream, CudaEvent& done) {
  const size_t block_bytes = static_cast<size_t>(row.block_size) * kTokenBytesPerTensor;
  const size_t blocks = static_cast<size_t>(row.tokens / row.block_size);
  const std::vector<Segment> segments = ShuffledBlocks(2 * blocks, block_bytes, row.tokens);
  const size_t bytes = 2 * blocks * block_bytes;
  TimeLayers(s, segments, kWarmupLayers);
  TimeMemcpy(scratch_b, scratch_a, bytes, kWarmupLayers, stream, done);
  // Interleaved, best of three, so that clock drift during the run does not pick a side.
  double ipc = 1e30, copy = 1e30;
  for (int round = 0; round < 3; ++round) {
    ipc = std::min(ipc, TimeLayers(s, segments, layers));
    copy = std::min(copy, TimeMemcpy(scratch_b, scratch_a, bytes, layers, stream, done));
  }
  const double ipc_gbs = static_cast<double>(bytes) * layers / ipc / 1e9;
  const double copy_gbs = static_cast<double>(bytes) * layers / copy / 1e9;
  std::printf("%-28s %6d %7d %9zu %10.1f %10.1f %10.1f %7.3f\n", label, row.block_size,
              row.tokens, segments.size(), static_cast<double>(bytes) / (1 << 20), ipc_gbs,
              copy_gbs, ipc_gbs / copy_gbs);
  std::fflush(stdout);
}

void RunPostCost(Sender& s) {
  std::printf("\nPostWrite host time (median of 50 calls, each after the previous completed)\n");
  std::printf("%9s %12s %14s\n", "segments", "us per call", "ns per segment");
  for (size_t count : {64, 256, 1024, 4096, 16384}) {
    const std::vector<Segment> segments = ShuffledBlocks(count, 8 << 10, 7);
    std::vector<double> us;
    for (int i = 0; i < 55; ++i) {
      const absl::Time start = absl::Now();
      TransferId id =
          Value(s.transport->PostWrite(s.peer, *s.pool, *s.remote, segments, "c"), "PostWrite");
      const double took = absl::ToDoubleMicroseconds(absl::Now() - start);
      Check(WaitForTransfer(*s.transport, id, absl::Now() + absl::Seconds(60)).status(), "wait");
      s.transport->Release(id);
      if (i >= 5) us.push_back(took);
    }
    std::sort(us.begin(), us.end());
    const double median = us[us.size() / 2];
    std::printf("%9zu %12.2f %14.1f\n", count, median, median * 1000 / count);
  }
}

int RunSender(const Flags& f) {
  Check(CudaAvailability(), "CUDA");
  // This very program, whatever argv[0] says.
  char self[4096] = {0};
  const ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (len <= 0) Die("readlink /proc/self/exe");
  Receiver receiver = SpawnReceiver(self, f);
  CudaDeviceScope scope(f.device);
  Check(scope.status(), "cudaSetDevice");
  auto stream = Value(CudaStream::Create(f.device), "CudaStream::Create");
  auto done = Value(CudaEvent::Create(), "CudaEvent::Create");
  auto scratch_a = Value(DeviceBuffer::CreateZeroed(kPoolBytes / 2, MemoryKind::kDevice), "a");
  auto scratch_b = Value(DeviceBuffer::CreateZeroed(kPoolBytes / 2, MemoryKind::kDevice), "b");
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, f.device);
  std::printf("cuda_ipc between two processes on %s (device %d), %d layers per measurement, "
              "best of 3\n\n",
              prop.name, f.device, f.layers);
  const std::vector<Row> rows = {{16, 1024}, {16, 8192}, {16, 32768},
                                 {64, 1024}, {64, 8192}, {64, 32768}};
  CudaIpcTransportOptions defaults;
  defaults.device = f.device;
  Sender s = Connect(receiver, defaults);
  PrintHeader("default kernel");
  for (const Row& row : rows) {
    RunRow(s, row, f.layers, "default", scratch_a.data(), scratch_b.data(),
           static_cast<cudaStream_t>(stream.get()), done);
  }
  if (f.post_cost) RunPostCost(s);
  Drop(s);
  if (f.sweep) {
    std::printf("\n");
    PrintHeader("ctas/SM x vectors [CE>=]");
    for (int vectors : {2, 4, 8}) {
      for (int ctas : {1, 2, 4, 0}) {
        for (size_t engine : {size_t{0}, size_t{64} << 10}) {
          CudaIpcTransportOptions o = defaults;
          o.vectors_per_thread = vectors;
          o.ctas_per_sm = ctas;
          o.copy_engine_min_bytes = engine;
          Sender t = Connect(receiver, o);
          const std::string label =
              absl::StrCat(ctas == 0 ? std::string("max") : absl::StrCat(ctas), " x ", vectors,
                           engine > 0 ? absl::StrCat(" CE>=", engine >> 10, "K") : "");
          for (const Row& row : {Row{16, 8192}, Row{16, 32768}, Row{64, 32768}}) {
            // Blocks of 16 tokens (32 KiB) never reach the 64 KiB copy-engine threshold.
            if (engine > 0 && row.block_size * kTokenBytesPerTensor < engine) continue;
            RunRow(t, row, f.layers, label.c_str(), scratch_a.data(), scratch_b.data(),
                   static_cast<cudaStream_t>(stream.get()), done);
          }
          Drop(t);
        }
      }
    }
  }
  // Tell the receiver to stop, through a last sender.
  Sender last = Connect(receiver, defaults);
  TransferId stop = Value(last.transport->PostNotification(last.peer, "stop"), "stop");
  Check(WaitForTransfer(*last.transport, stop, absl::Now() + absl::Seconds(10)).status(), "stop");
  int status = 0;
  waitpid(receiver.pid, &status, 0);
  Drop(last);
  return 0;
}

}  // namespace
}  // namespace kvstream

int main(int argc, char** argv) {
  kvstream::Flags f;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    bool ok = true;
    if (absl::ConsumePrefix(&arg, "--role=")) {
      f.role = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--device=")) {
      ok = absl::SimpleAtoi(arg, &f.device);
    } else if (absl::ConsumePrefix(&arg, "--layers=")) {
      ok = absl::SimpleAtoi(arg, &f.layers) && f.layers > 0;
    } else if (arg == "--sweep") {
      f.sweep = true;
    } else if (arg == "--post-cost") {
      f.post_cost = true;
    } else {
      ok = false;
    }
    if (!ok) {
      kvstream::Die(absl::StrCat("bad flag ", argv[i],
                                 " (flags: --device=N --layers=N --sweep --post-cost)"));
    }
  }
  if (f.role == "receiver") return kvstream::RunReceiver(f);
  return kvstream::RunSender(f);
}
