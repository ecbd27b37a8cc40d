// kvstream_bench_cuda_ipc: one layer's KV blocks moved between two processes on one GPU by
// the cuda_ipc transport, beside one contiguous device-to-device cudaMemcpyAsync of the same
// bytes in this process, measured in the same run.
//
//   kvstream_bench_cuda_ipc [--device=N] [--layers=N] [--sweep[=SUBSTRING]] [--post-cost]
//
// The program spawns itself as the receiver (--role=receiver: a 256 MiB pool from
// AllocateMemory, progressed until told to stop). Layers are Llama-3-8B's: 8 KV heads of
// head size 128 in bf16, 2 KiB per token per tensor, K and V each a block of
// block_size x 2 KiB; a layer of T tokens is 2 x T / block_size segments, one per block,
// with block ids drawn at random from the pool on both sides (nothing is contiguous), and
// then again with the layer's blocks a shuffled permutation of a region of the layer's own
// size on both sides (fewer pages of the address space touched; still nothing contiguous).
// Each row posts --layers layers back to back (one PostWrite each, with a notification)
// and stops the clock when the last is done (its notification handed to the socket);
// the ceiling row enqueues as many contiguous cudaMemcpyAsync of the layer's bytes on one
// stream and stops when an event after the last has completed, polled the same way. GB/s
// are of KV bytes (1e9 bytes per second). Then, to separate the copy from what surrounds
// it, one more burst with the transport's copy timing on (CudaIpcSetCopyTiming) gives, per
// layer (medians): the host time of PostWrite ("post us"), the device time from the write's
// first operation on the copy stream to its completion event ("stream us": table copy,
// waits, kernel) and of the kernel alone ("kernel us"), beside the device time of one
// contiguous memcpy of the layer ("memcpy us", an event pair around the burst / layers);
// "kern ratio" = memcpy us / kernel us is the kernel's own speed against the copy engine.
//
// --sweep repeats every row (16- and 64-token blocks, 1k, 8k and 32k tokens) for every
// variant of the copy path (kernel shape, where the table goes, vectors per thread, piece
// size, grid, copy engine for long segments; CudaIpcTransportOptions) and ends with the
// best variant per row (--sweep=SUBSTRING: only the variants whose label contains it);
// --post-cost times the PostWrite call alone (median of 50, each
// after the previous write completed) for 64 to 16384 segments of 8 KiB, which should stay
// flat per call apart from writing the table.
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
  std::string sweep_filter;  // empty: every variant
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
// slots of the pool; `permuted`: the slots are the first `count` of each pool, in a random
// order on each side (a layer whose blocks fill a region of its own size, shuffled).
std::vector<Segment> ShuffledBlocks(size_t count, size_t bytes, uint32_t seed,
                                    bool permuted = false) {
  const size_t slots = permuted ? count : kPoolBytes / bytes;
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

// Seconds for `layers` layers posted back to back until the last is done; `post_us`, if
// given, gets the mean host time of one PostWrite.
double TimeLayers(Sender& s, const std::vector<Segment>& segments, int layers,
                  double* post_us = nullptr) {
  std::vector<TransferId> ids;
  ids.reserve(static_cast<size_t>(layers));
  double posting = 0;
  const absl::Time start = absl::Now();
  for (int i = 0; i < layers; ++i) {
    const absl::Time before = absl::Now();
    ids.push_back(Value(s.transport->PostWrite(s.peer, *s.pool, *s.remote, segments, "layer"),
                        "PostWrite"));
    posting += absl::ToDoubleMicroseconds(absl::Now() - before);
  }
  for (TransferId id : ids) {
    Check(WaitForTransfer(*s.transport, id, absl::Now() + absl::Seconds(60)).status(),
          "WaitForTransfer");
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  for (TransferId id : ids) s.transport->Release(id);
  if (post_us != nullptr) *post_us = posting / layers;
  return seconds;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
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
  bool permuted = false;  // ShuffledBlocks' `permuted`
};

// What one row measured.
struct Result {
  std::string label;
  Row row;
  double ratio = 0;
  double kernel_ratio = 0;
  double gbs = 0;
};

void PrintHeader(const char* first) {
  std::printf("%-34s %5s %6s %6s %7s %8s %8s %6s %7s %7s %7s %7s %6s\n", first, "block",
              "tokens", "segs", "KV MiB", "ipc GB/s", "cpy GB/s", "ratio", "post us",
              "strm us", "kern us", "cpy us", "kern r");
}

// Device microseconds of one contiguous memcpy of `bytes`, over a burst of `layers`.
double MemcpyDeviceUs(void* dst, const void* src, size_t bytes, int layers, cudaStream_t stream,
                      CudaEvent& start, CudaEvent& end) {
  Check(start.Record(stream), "cudaEventRecord");
  for (int i = 0; i < layers; ++i) {
    Check(CudaErrorToStatus(static_cast<int>(cudaMemcpyAsync(dst, src, bytes,
                                                             cudaMemcpyDeviceToDevice, stream)),
                            "cudaMemcpyAsync"),
          "memcpy");
  }
  Check(end.Record(stream), "cudaEventRecord");
  Check(end.Synchronize(absl::Seconds(60)), "cudaEventSynchronize");
  return static_cast<double>(Value(CudaEvent::ElapsedMilliseconds(start, end), "elapsed")) *
         1e3 / layers;
}

struct Scratch {
  void* a;
  void* b;
  cudaStream_t stream;
  CudaEvent* done;
  CudaEvent* start;
  CudaEvent* end;
};

Result RunRow(Sender& s, const Row& row, int layers, const std::string& label,
              const Scratch& x) {
  const size_t block_bytes = static_cast<size_t>(row.block_size) * kTokenBytesPerTensor;
  const size_t blocks = static_cast<size_t>(row.tokens / row.block_size);
  const std::vector<Segment> segments =
      ShuffledBlocks(2 * blocks, block_bytes, row.tokens, row.permuted);
  const size_t bytes = 2 * blocks * block_bytes;
  TimeLayers(s, segments, kWarmupLayers);
  TimeMemcpy(x.b, x.a, bytes, kWarmupLayers, x.stream, *x.done);
  // Interleaved, best of three, so that clock drift during the run does not pick a side.
  double ipc = 1e30, copy = 1e30;
  for (int round = 0; round < 3; ++round) {
    ipc = std::min(ipc, TimeLayers(s, segments, layers));
    copy = std::min(copy, TimeMemcpy(x.b, x.a, bytes, layers, x.stream, *x.done));
  }
  // The burst again with device timing, for where the time goes.
  CudaIpcSetCopyTiming(*s.transport, true);
  double post_us = 0;
  TimeLayers(s, segments, layers, &post_us);
  CudaIpcSetCopyTiming(*s.transport, false);
  std::vector<double> stream_us, kernel_us;
  for (const CudaIpcCopyTiming& t : CudaIpcTakeCopyTimings(*s.transport)) {
    stream_us.push_back(t.stream_us);
    kernel_us.push_back(t.kernel_us);
  }
  const double memcpy_us = MemcpyDeviceUs(x.b, x.a, bytes, layers, x.stream, *x.start, *x.end);
  Result r;
  r.label = label;
  r.row = row;
  r.gbs = static_cast<double>(bytes) * layers / ipc / 1e9;
  const double copy_gbs = static_cast<double>(bytes) * layers / copy / 1e9;
  r.ratio = r.gbs / copy_gbs;
  const double kernel = Median(kernel_us);
  r.kernel_ratio = kernel > 0 ? memcpy_us / kernel : 0;
  std::printf("%-34s %5d %6d %6zu %7.1f %8.1f %8.1f %6.3f %7.2f %7.2f %7.2f %7.2f %6.3f\n",
              label.c_str(), row.block_size, row.tokens, segments.size(),
              static_cast<double>(bytes) / (1 << 20), r.gbs, copy_gbs, r.ratio, post_us,
              Median(stream_us), kernel, memcpy_us, r.kernel_ratio);
  std::fflush(stdout);
  return r;
}

// One variant of the copy path, as options.
struct Variant {
  std::string label;
  CudaIpcTransportOptions options;
};

std::vector<Variant> SweepVariants(const CudaIpcTransportOptions& defaults) {
  std::vector<Variant> out;
  // Each variant is the defaults with the table read in place (kZeroCopy) unless its edit
  // says otherwise.
  auto add = [&](std::string label, auto edit) {
    CudaIpcTransportOptions o = defaults;
    o.table = CudaIpcTableMode::kZeroCopy;
    edit(o);
    out.push_back({std::move(label), o});
  };
  using K = CudaIpcKernel;
  using T = CudaIpcTableMode;
  // The kernel and table of the first GPU run, and the chunked kernel with other tables.
  add("chunked v4 stream-copy (old)", [](auto& o) {
    o.kernel = K::kChunked; o.table = T::kStreamCopy; o.vectors_per_thread = 4;
  });
  add("chunked v8 stream-copy", [](auto& o) { o.kernel = K::kChunked; o.table = T::kStreamCopy; });
  add("chunked v4 side-copy", [](auto& o) {
    o.kernel = K::kChunked; o.table = T::kSideStreamCopy; o.vectors_per_thread = 4;
  });
  add("chunked v4 zero-copy", [](auto& o) {
    o.kernel = K::kChunked; o.table = T::kZeroCopy; o.vectors_per_thread = 4;
  });
  // Whole entries per CTA: every table placement.
  add("cta v8 params", [](auto& o) { o.table = T::kParams; });
  add("cta v8 auto (default)", [](auto& o) { o.table = T::kAuto; });
  add("cta v8 zero-copy", [](auto&) {});
  add("cta v8 stream-copy", [](auto& o) { o.table = T::kStreamCopy; });
  add("cta v8 side-copy", [](auto& o) { o.table = T::kSideStreamCopy; });
  // Shapes around the default.
  add("cta v4 zero-copy", [](auto& o) { o.vectors_per_thread = 4; });
  add("cta v8 zero-copy 1 cta/SM", [](auto& o) { o.ctas_per_sm = 1; });
  add("cta v8 zero-copy 2 cta/SM", [](auto& o) { o.ctas_per_sm = 2; });
  add("cta v8 zero-copy piece 32K", [](auto& o) { o.max_piece_bytes = 32 << 10; });
  add("cta v8 zero-copy piece 1M", [](auto& o) { o.max_piece_bytes = 1 << 20; });
  add("cta v8 zero-copy unit/entry", [](auto& o) { o.unit_per_entry = true; });
  add("cta v8 params unit/entry", [](auto& o) {
    o.table = T::kParams; o.unit_per_entry = true;
  });
  add("cta v8 side-copy unit/entry", [](auto& o) {
    o.table = T::kSideStreamCopy; o.unit_per_entry = true;
  });
  add("cta v8 side-copy piece 1M", [](auto& o) {
    o.table = T::kSideStreamCopy; o.max_piece_bytes = 1 << 20;
  });
  add("cta v8 side-copy 2 cta/SM", [](auto& o) { o.table = T::kSideStreamCopy; o.ctas_per_sm = 2; });
  add("cta v8 zero-copy CE>=64K", [](auto& o) { o.copy_engine_min_bytes = 64 << 10; });
  // Whole entries per 1024-thread CTA.
  for (int v : {2, 4}) {
    add(absl::StrCat("wide v", v, " zero-copy"), [v](auto& o) {
      o.kernel = K::kWideCtaPerSegment; o.vectors_per_thread = v;
    });
    add(absl::StrCat("wide v", v, " zero-copy unit/entry"), [v](auto& o) {
      o.kernel = K::kWideCtaPerSegment; o.vectors_per_thread = v; o.unit_per_entry = true;
    });
    add(absl::StrCat("wide v", v, " params"), [v](auto& o) {
      o.kernel = K::kWideCtaPerSegment; o.vectors_per_thread = v; o.table = T::kParams;
    });
    add(absl::StrCat("wide v", v, " stream-copy"), [v](auto& o) {
      o.kernel = K::kWideCtaPerSegment; o.vectors_per_thread = v; o.table = T::kStreamCopy;
    });
  }
  // Whole entries per warp.
  add("warp v8 params", [](auto& o) { o.kernel = K::kWarpPerSegment; o.table = T::kParams; });
  add("warp v4 params", [](auto& o) {
    o.kernel = K::kWarpPerSegment; o.vectors_per_thread = 4; o.table = T::kParams;
  });
  add("warp v8 zero-copy", [](auto& o) { o.kernel = K::kWarpPerSegment; o.table = T::kZeroCopy; });
  add("warp v8 zero-copy piece 16K", [](auto& o) {
    o.kernel = K::kWarpPerSegment; o.max_piece_bytes = 16 << 10;
  });
  return out;
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
  auto timing_start = Value(CudaEvent::Create(/*enable_timing=*/true), "CudaEvent::Create");
  auto timing_end = Value(CudaEvent::Create(/*enable_timing=*/true), "CudaEvent::Create");
  const Scratch x{scratch_a.data(), scratch_b.data(), static_cast<cudaStream_t>(stream.get()),
                  &done, &timing_start, &timing_end};
  CudaIpcTransportOptions defaults;
  defaults.device = f.device;
  Sender s = Connect(receiver, defaults);
  PrintHeader("default copy path");
  for (const Row& row : rows) RunRow(s, row, f.layers, "default", x);
  // The same layers with their blocks a shuffled permutation of a region of their own size
  // on both sides, rather than drawn from the whole pool.
  for (Row row : rows) {
    row.permuted = true;
    RunRow(s, row, f.layers, "default, permuted region", x);
  }
  if (f.post_cost) RunPostCost(s);
  Drop(s);
  if (f.sweep) {
    const absl::Time sweep_start = absl::Now();
    std::printf("\n");
    PrintHeader("variant");
    std::vector<Result> results;
    for (const Variant& v : SweepVariants(defaults)) {
      if (!absl::StrContains(v.label, f.sweep_filter)) continue;
      Sender t = Connect(receiver, v.options);
      for (const Row& row : rows) {
        // Copy-engine variants differ only where blocks reach the threshold.
        const size_t block_bytes = static_cast<size_t>(row.block_size) * kTokenBytesPerTensor;
        if (v.options.copy_engine_min_bytes > block_bytes) continue;
        results.push_back(RunRow(t, row, f.layers, v.label, x));
      }
      Drop(t);
    }
    std::printf("\nbest variant per row (sweep took %.1f s)\n",
                absl::ToDoubleSeconds(absl::Now() - sweep_start));
    std::printf("%5s %6s  %-34s %6s %8s  %-34s %6s\n", "block", "tokens", "best end to end",
                "ratio", "GB/s", "fastest kernel", "kern r");
    for (const Row& row : rows) {
      const Result* best = nullptr;
      const Result* fastest = nullptr;
      for (const Result& r : results) {
        if (r.row.block_size != row.block_size || r.row.tokens != row.tokens) continue;
        if (best == nullptr || r.ratio > best->ratio) best = &r;
        if (fastest == nullptr || r.kernel_ratio > fastest->kernel_ratio) fastest = &r;
      }
      if (best == nullptr) continue;
      std::printf("%5d %6d  %-34s %6.3f %8.1f  %-34s %6.3f\n", row.block_size, row.tokens,
                  best->label.c_str(), best->ratio, best->gbs, fastest->label.c_str(),
                  fastest->kernel_ratio);
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
    } else if (absl::ConsumePrefix(&arg, "--sweep=")) {
      f.sweep = true;
      f.sweep_filter = std::string(arg);
    } else if (arg == "--post-cost") {
      f.post_cost = true;
    } else {
      ok = false;
    }
    if (!ok) {
      kvstream::Die(absl::StrCat("bad flag ", argv[i],
                                 " (flags: --device=N --layers=N --sweep[=SUBSTRING] --post-cost)"));
    }
  }
  if (f.role == "receiver") return kvstream::RunReceiver(f);
  return kvstream::RunSender(f);
}
