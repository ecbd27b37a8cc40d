// kvstream_bench_transfer: layer-sized transfers of scattered KV blocks between two processes
// on this machine through the UCX transport, beside ucx_perftest's ucp_put_bw measured in the
// same run on the same UCX settings.
//
//   kvstream_bench_transfer [--tls=shm|tcp] [--memory=transport|heap] [--depth=N]
//                           [--copy-threads=N] [--perftest=PATH|none] [--perftest-heap=false]
//                           [--ucx=NAME=VALUE ...] [--pin=false] [Google Benchmark flags]
//
// The program forks and execs itself as the receiver (--role=receiver), which sets up a
// 128 MiB pool and progresses until told to stop. Both sides' pools come from
// Transport::AllocateMemory (--memory=transport, the default: over shared memory the sender
// maps the receiver's pool and puts are plain copies) or are heap buffers the transport
// registers (--memory=heap: what an engine that owns its KV cache gets; puts are emulated
// with active messages over shared memory, see ucx_transport.h). Each benchmark iteration is one layer: one
// PostWrite of every block as its own segment (block ids random on both sides, fixed per
// benchmark, so nothing can be coalesced), which the transport turns into puts + one flush +
// the notification; with --depth=N up to N layers are in flight. --copy-threads=N gives the
// sender's transport N copy threads (UcxTransportOptions::copy_threads; with transport memory
// over shared memory they copy the blocks in place of UCX puts). Block sizes: 16 and 64
// tokens of 8x128 bf16 (4 KiB/token), 2x128 bf16 and 8x64 fp8 (1 KiB/token); layers of
// 256 KiB to 64 MiB. After the benchmarks, with the receiver stopped, ucx_perftest runs as
// server and client on localhost (pinned like sender and receiver) and a table follows the
// benchmark output: see PrintTable for its columns.
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "benchmark/benchmark.h"
#include "kvstream/transfer/socket.h"
#include "kvstream/transfer/transport.h"
#include "kvstream/transfer/ucx_transport.h"

extern char** environ;

namespace kvstream {
namespace {

constexpr size_t kPoolBytes = 128u << 20;  // per side: twice the largest layer
constexpr int kOutFd = 3;                  // the receiver's protocol fd (stdout stays UCX's)
constexpr double kMinSeconds = 0.5;        // per benchmark run
constexpr int kPerftestRuns = 3;           // per configuration; the table shows the median

struct Flags {
  std::string tls = "shm";
  std::string memory = "transport";  // where the KV pools come from: transport | heap
  std::string perftest = "ucx_perftest";
  bool perftest_heap = true;  // also the heap/* columns (emulated puts: slow at large sizes)
  int depth = 1;  // layers in flight
  int copy_threads = 0;  // the sender transport's copy threads
  // Sender on CPU 0 (its copy threads on CPUs 2, 3, ...), receiver on CPU 1; perftest's client
  // and server on CPUs 0 and 1.
  bool pin = true;
  std::vector<std::pair<std::string, std::string>> ucx_config;  // --ucx=NAME=VALUE
  bool receiver = false;
};

// Shared-memory puts from ordinary memory are completed by the receiver's progress (see
// ucx_transport.h): if the two spinning processes share a core, each FIFO's worth of data
// waits for a scheduler tick. Pinning them apart keeps figures meaningful on a busy machine.
bool CanPin() { return ::sysconf(_SC_NPROCESSORS_ONLN) >= 2; }

// Pins the calling thread (and the threads it starts later) to `cpus`.
void PinTo(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int cpu : cpus) CPU_SET(cpu, &set);
  if (::sched_setaffinity(0, sizeof(set), &set) != 0) {
    std::fprintf(stderr, "sched_setaffinity(%s): %s\n", absl::StrJoin(cpus, ",").c_str(),
                 std::strerror(errno));
  }
}

// The sender's CPUs: 0, and for copy threads 2, 3, ... (the receiver has CPU 1), as far as
// this machine has them.
std::vector<int> SenderCpus(const Flags& flags) {
  std::vector<int> cpus = {0};
  const int online = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  for (int cpu = 2; cpu < online && cpu < 2 + flags.copy_threads; ++cpu) cpus.push_back(cpu);
  return cpus;
}

UcxTransportOptions OptionsFor(const Flags& flags) {
  UcxTransportOptions options;
  options.tls = flags.tls;
  if (flags.tls == "tcp") options.net_devices = "lo";
  options.ucx_config = flags.ucx_config;
  options.copy_threads = flags.copy_threads;
  return options;
}

// The UCX settings the transport applies for these flags, as environment for ucx_perftest,
// so that both run on the same UCX configuration (see ucx_transport.cc).
std::vector<std::string> UcxEnvFor(const Flags& flags) {
  std::vector<std::string> env = {"UCX_ADAPTIVE_PROGRESS=n"};
  if (flags.tls == "shm") {
    env.insert(env.end(), {"UCX_TLS=sm,self", "UCX_MM_SEG_SIZE=64k"});
  } else if (flags.tls == "tcp") {
    env.insert(env.end(), {"UCX_TLS=tcp,self", "UCX_NET_DEVICES=lo"});
  } else {
    env.push_back("UCX_TLS=" + flags.tls);
  }
  for (const auto& [name, value] : flags.ucx_config) env.push_back("UCX_" + name + "=" + value);
  return env;
}

void Die(const std::string& message) {
  std::fprintf(stderr, "kvstream_bench_transfer: %s\n", message.c_str());
  std::exit(1);
}

bool WriteLine(int fd, const std::string& line) {
  std::string data = line + "\n";
  const char* p = data.data();
  size_t left = data.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    left -= static_cast<size_t>(n);
  }
  return true;
}

// Reads one line from `fd` (byte by byte: only a few short lines cross this pipe).
bool ReadLine(int fd, std::string* line, absl::Duration timeout) {
  line->clear();
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    char c;
    ssize_t n = ::read(fd, &c, 1);
    if (n <= 0) return false;
    if (c == '\n') return true;
    line->push_back(c);
  }
  return false;
}

// fork + exec with stdin/`out_fd` redirected and an explicit environment (built before the
// fork: after it, in a process with UCX's threads, only async-signal-safe calls are safe).
// With `extra_env`, the child's UCX_* settings are those alone (ucx_perftest); without, it
// inherits this process's environment (the receiver, to match this side).
pid_t Spawn(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env,
            int stdin_fd, int out_fd, int out_target, bool quiet) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    if (extra_env.empty() || !absl::StartsWith(*e, "UCX_")) {
      env_strings.push_back(*e);
    }
  }
  env_strings.insert(env_strings.end(), extra_env.begin(), extra_env.end());
  std::vector<char*> args, env;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  for (const std::string& e : env_strings) env.push_back(const_cast<char*>(e.c_str()));
  env.push_back(nullptr);
  const int devnull = quiet ? ::open("/dev/null", O_WRONLY | O_CLOEXEC) : -1;
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(126);
    // dup2 onto itself would keep O_CLOEXEC: clear the flag in that case.
    if (stdin_fd == 0) {
      ::fcntl(0, F_SETFD, 0);
    } else if (stdin_fd >= 0) {
      ::dup2(stdin_fd, 0);
    }
    if (out_fd >= 0 && out_fd == out_target) {
      ::fcntl(out_fd, F_SETFD, 0);
    } else if (out_fd >= 0) {
      ::dup2(out_fd, out_target);
    }
    if (devnull >= 0) {
      if (out_fd < 0 || out_target != 1) ::dup2(devnull, 1);
      ::dup2(devnull, 2);
    }
    ::execve(args[0], args.data(), env.data());
    ::_exit(127);
  }
  if (devnull >= 0) ::close(devnull);
  if (pid < 0) Die(absl::StrCat("fork: ", std::strerror(errno)));
  return pid;
}

// Resolves a program name through PATH (execve does not).
std::string FindProgram(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  const char* path = std::getenv("PATH");
  for (absl::string_view dir : absl::StrSplit(path ? path : "/usr/bin:/bin", ':')) {
    std::string candidate = absl::StrCat(dir, "/", name);
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// --- The receiver process ---

// The pool of one side: memory from the transport, or `heap` (resized here) registered.
std::unique_ptr<MemoryRegistration> MakePool(Transport& transport, const Flags& flags,
                                             std::vector<char>& heap) {
  absl::StatusOr<std::unique_ptr<MemoryRegistration>> reg;
  if (flags.memory == "transport") {
    reg = transport.AllocateMemory(kPoolBytes, MemoryKind::kHost);
  } else {
    heap.assign(kPoolBytes, 0);
    reg = transport.RegisterMemory(heap.data(), heap.size(), MemoryKind::kHost);
  }
  if (!reg.ok()) Die(reg.status().ToString());
  return std::move(reg).value();
}

int RunReceiver(const Flags& flags) {
  if (flags.pin && CanPin()) PinTo({1});
  auto transport = CreateUcxTransport(OptionsFor(flags));
  if (!transport.ok()) Die(transport.status().ToString());
  std::vector<char> pool;
  auto reg = MakePool(**transport, flags, pool);
  if (!WriteLine(kOutFd, "INFO " + absl::BytesToHexString(*(*transport)->LocalInfo())) ||
      !WriteLine(kOutFd, "DESC " + absl::BytesToHexString(reg->descriptor()))) {
    Die("cannot write to the parent");
  }
  uint64_t notifications = 0;
  while (true) {
    if (!(*transport)->Progress().ok()) Die("progress failed");
    for (const Notification& n : (*transport)->PollNotifications()) {
      if (n.payload == "exit") {
        WriteLine(kOutFd, absl::StrCat("COUNT ", notifications));
        return 0;
      }
      ++notifications;
    }
  }
}

// --- The sender (this process) ---

struct Receiver {
  pid_t pid = -1;
  int to_child = -1;
  int from_child = -1;
};

struct Context {
  Flags flags;
  std::unique_ptr<Transport> transport;
  std::vector<char> pool;
  std::unique_ptr<MemoryRegistration> local;
  std::unique_ptr<RemoteMemory> remote;
  PeerId peer = 0;
  Receiver receiver;
  uint64_t notifications_sent = 0;
};

Context* g_context = nullptr;

void StartReceiver(Context& ctx, const std::string& self) {
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) Die("pipe2 failed");
  std::vector<std::string> args = {self, "--role=receiver", "--tls=" + ctx.flags.tls,
                                   "--memory=" + ctx.flags.memory};
  if (!ctx.flags.pin) args.push_back("--pin=false");
  for (const auto& [name, value] : ctx.flags.ucx_config) {
    args.push_back("--ucx=" + name + "=" + value);
  }
  ctx.receiver.pid = Spawn(args, {}, in[0], out[1], kOutFd, /*quiet=*/false);
  ::close(in[0]);
  ::close(out[1]);
  ctx.receiver.to_child = in[1];
  ctx.receiver.from_child = out[0];
  std::string info_line, desc_line;
  if (!ReadLine(ctx.receiver.from_child, &info_line, absl::Seconds(60)) ||
      !ReadLine(ctx.receiver.from_child, &desc_line, absl::Seconds(60))) {
    Die("the receiver did not start");
  }
  absl::string_view info = info_line, desc = desc_line;
  if (!absl::ConsumePrefix(&info, "INFO ") || !absl::ConsumePrefix(&desc, "DESC ")) {
    Die("unexpected receiver output");
  }
  auto peer = ctx.transport->Connect(absl::HexStringToBytes(info));
  if (!peer.ok()) Die(peer.status().ToString());
  ctx.peer = *peer;
  auto remote = ctx.transport->ImportRemote(ctx.peer, absl::HexStringToBytes(desc));
  if (!remote.ok()) Die(remote.status().ToString());
  ctx.remote = std::move(remote).value();
}

void StopReceiver(Context& ctx) {
  auto id = ctx.transport->PostNotification(ctx.peer, "exit");
  if (!id.ok()) Die(id.status().ToString());
  auto state = WaitForTransfer(*ctx.transport, *id, absl::Now() + absl::Seconds(60));
  if (!state.ok()) Die(state.status().ToString());
  std::string line;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (true) {
    pollfd p{ctx.receiver.from_child, POLLIN, 0};
    if (::poll(&p, 1, 0) > 0) break;
    (void)ctx.transport->Progress();
    if (absl::Now() > deadline) Die("the receiver did not stop");
  }
  if (!ReadLine(ctx.receiver.from_child, &line, absl::Seconds(10))) Die("no COUNT line");
  uint64_t count = 0;
  absl::string_view rest = line;
  if (!absl::ConsumePrefix(&rest, "COUNT ") || !absl::SimpleAtoi(rest, &count) ||
      count != ctx.notifications_sent) {
    Die(absl::StrCat("the receiver saw '", line, "' notifications, expected ",
                     ctx.notifications_sent));
  }
  ::waitpid(ctx.receiver.pid, nullptr, 0);
  ::close(ctx.receiver.to_child);
  ::close(ctx.receiver.from_child);
  ctx.remote.reset();
  (void)ctx.transport->Disconnect(ctx.peer);
}

struct Shape {
  const char* name;
  size_t bytes_per_token;  // K and V
};
// 8 KV heads x 128 bf16 = 4 KiB/token; 2 x 128 bf16 and 8 x 64 fp8 = 1 KiB/token.
constexpr Shape kShapes[] = {{"8x128_bf16", 2 * 8 * 128 * 2},
                             {"2x128_bf16", 2 * 2 * 128 * 2},
                             {"8x64_fp8", 2 * 8 * 64 * 1}};
constexpr size_t kBlockTokens[] = {16, 64};
constexpr size_t kLayerBytes[] = {256u << 10, 1u << 20, 4u << 20, 16u << 20, 64u << 20};

struct Result {
  std::string shape;
  size_t layer = 0;
  size_t block = 0;
  std::vector<double> gbps;  // one per measured run (repetitions); the table shows the median
};

// The median; -1 for none. On a shared machine single runs stray both ways.
double Median(std::vector<double> values) {
  if (values.empty()) return -1;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}
std::vector<Result> g_results;

// `count` distinct random block ids out of the pool, independently for each side.
std::vector<Segment> RandomBlocks(size_t count, size_t block, uint32_t seed) {
  const size_t pool_blocks = kPoolBytes / block;
  std::vector<uint64_t> src(pool_blocks), dst(pool_blocks);
  std::iota(src.begin(), src.end(), 0);
  std::iota(dst.begin(), dst.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(src.begin(), src.end(), rng);
  std::shuffle(dst.begin(), dst.end(), rng);
  std::vector<Segment> segments(count);
  for (size_t i = 0; i < count; ++i) {
    segments[i].local_offset = src[i] * block;
    segments[i].remote_offset = dst[i] * block;
    segments[i].length = block;
  }
  return segments;
}

void BM_LayerTransfer(benchmark::State& state, Shape shape, size_t block_tokens,
                      size_t layer_bytes) {
  Context& ctx = *g_context;
  const size_t block = shape.bytes_per_token * block_tokens;
  const size_t blocks = std::max<size_t>(1, layer_bytes / block);
  const std::vector<Segment> segments =
      RandomBlocks(blocks, block, static_cast<uint32_t>(block * 31 + layer_bytes));
  const size_t bytes = blocks * block;
  const std::string note = "layer";
  // Up to `depth` layers in flight, as a connector posts each layer as soon as it is computed;
  // an iteration posts one layer and, when the window is full, waits for the oldest.
  std::vector<TransferId> window;
  auto wait_oldest = [&]() -> bool {
    auto done = WaitForTransfer(*ctx.transport, window.front(), absl::Now() + absl::Seconds(60));
    ctx.transport->Release(window.front());
    window.erase(window.begin());
    if (!done.ok()) state.SkipWithError(done.status().ToString().c_str());
    return done.ok();
  };
  const absl::Time start = absl::Now();
  for (auto _ : state) {
    auto id = ctx.transport->PostWrite(ctx.peer, *ctx.local, *ctx.remote, segments, note);
    if (!id.ok()) {
      state.SkipWithError(id.status().ToString().c_str());
      return;
    }
    ++ctx.notifications_sent;
    window.push_back(*id);
    if (static_cast<int>(window.size()) >= ctx.flags.depth && !wait_oldest()) return;
  }
  while (!window.empty()) {
    if (!wait_oldest()) return;
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["segments"] = static_cast<double>(blocks);
  state.counters["block_bytes"] = static_cast<double>(block);
  const double gbps = static_cast<double>(state.iterations() * bytes) / seconds / 1e9;
  // Google Benchmark first calls each benchmark with one iteration to size the run; only runs
  // with enough iterations to have met the minimum time are kept.
  if (seconds < 0.5 * kMinSeconds) return;
  for (Result& r : g_results) {
    if (r.shape == shape.name && r.layer == layer_bytes && r.block == block) {
      r.gbps.push_back(gbps);
      return;
    }
  }
  g_results.push_back(Result{shape.name, layer_bytes, block, {gbps}});
}

// --- ucx_perftest ---

// A loopback port free right now (0 if none could be had), from the socket helper.
int FreePort() {
  absl::StatusOr<ScopedFd> fd = ListenTcp("127.0.0.1", 0);
  if (!fd.ok()) return 0;
  absl::StatusOr<uint16_t> port = BoundTcpPort(fd->get());
  return port.ok() ? *port : 0;
}

// ucp_put_bw of `bytes`-sized messages; GB/s (1e9), or a negative value on failure.
double RunPerftest(const std::string& program, const Flags& flags, size_t bytes,
                   bool ucx_memory, bool pin) {
  std::vector<std::string> env = UcxEnvFor(flags);
  if (!ucx_memory) env.push_back("UCX_ALLOC_PRIO=heap");
  // About 2 GiB per run, at least 20 iterations, a tenth of that as warm-up.
  const size_t iterations = std::max<size_t>(20, (size_t{2} << 30) / bytes);
  for (int attempt = 0; attempt < 3; ++attempt) {
    const std::string port = std::to_string(FreePort());
    std::vector<std::string> server_args = {program, "-p", port};
    if (pin) server_args.insert(server_args.end(), {"-c", "1"});
    pid_t server = Spawn(server_args, env, -1, -1, 1, /*quiet=*/true);
    ::usleep(300 * 1000);
    int out[2];
    if (::pipe2(out, O_CLOEXEC) != 0) Die("pipe2 failed");
    const size_t warmup = std::max<size_t>(2, iterations / 10);
    std::vector<std::string> client_args = {
        program, "127.0.0.1", "-p", port, "-t", "ucp_put_bw", "-s", std::to_string(bytes),
        "-n", std::to_string(iterations), "-w", std::to_string(warmup)};
    if (pin) client_args.insert(client_args.end(), {"-c", "0"});
    pid_t client = Spawn(client_args, env, -1, out[1], 1, /*quiet=*/false);
    ::close(out[1]);
    std::string output, line;
    while (ReadLine(out[0], &line, absl::Seconds(300))) output += line + "\n";
    ::close(out[0]);
    ::waitpid(client, nullptr, 0);
    ::kill(server, SIGKILL);
    ::waitpid(server, nullptr, 0);
    for (absl::string_view l : absl::StrSplit(output, '\n')) {
      if (!absl::StartsWith(l, "Final:")) continue;
      std::vector<absl::string_view> fields = absl::StrSplit(l, ' ', absl::SkipEmpty());
      double mib_per_s = 0;
      // Final: iters p50 avg overall bw_avg bw_overall rate_avg rate_overall
      if (fields.size() >= 7 && absl::SimpleAtod(fields[6], &mib_per_s)) {
        return mib_per_s * 1048576.0 / 1e9;  // perftest's MB are MiB
      }
    }
  }
  return -1;
}

std::string Size(size_t bytes) {
  if (bytes >= (1u << 20)) return absl::StrCat(bytes >> 20, " MiB");
  return absl::StrCat(bytes >> 10, " KiB");
}

std::string Fixed(double value, int digits) {
  if (value < 0) return "n/a";
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.*f", digits, value);
  return buffer;
}

// GB/s of memcpy of the same scattered blocks between two pools of this process, on one
// core: what a single copy of this access pattern costs on this machine.
double MemcpyRoofline(const char* src, char* dst, size_t layer, size_t block) {
  const size_t blocks = std::max<size_t>(1, layer / block);
  const std::vector<Segment> segments =
      RandomBlocks(blocks, block, static_cast<uint32_t>(block * 31 + layer));
  const int iterations = static_cast<int>(std::max<size_t>(5, (size_t{2} << 30) / layer));
  for (const Segment& s : segments) std::memcpy(dst + s.remote_offset, src + s.local_offset, block);
  const absl::Time start = absl::Now();
  for (int i = 0; i < iterations; ++i) {
    for (const Segment& s : segments) {
      std::memcpy(dst + s.remote_offset, src + s.local_offset, s.length);
    }
    benchmark::ClobberMemory();
  }
  return static_cast<double>(blocks * block) * iterations /
         absl::ToDoubleSeconds(absl::Now() - start) / 1e9;
}

void PrintTable(const Flags& flags, const char* pool) {
  const bool pin = flags.pin && CanPin();
  std::vector<char> scratch(kPoolBytes, 1);
  std::map<std::pair<size_t, size_t>, double> roofline;
  for (const Result& r : g_results) {
    auto key = std::make_pair(r.layer, r.block);
    if (!roofline.count(key)) {
      roofline[key] = MemcpyRoofline(pool, scratch.data(), r.layer, r.block);
    }
  }
  // Message size -> GB/s, for heap memory and for UCX-allocated memory.
  std::map<size_t, double> heap, ucxmem;
  if (flags.perftest != "none") {
    const std::string program = FindProgram(flags.perftest);
    if (program.empty()) {
      std::fprintf(stderr, "ucx_perftest not found; its columns stay empty\n");
    } else {
      for (const Result& r : g_results) {
        auto measure = [&](size_t size, bool ucx_memory) {
          std::vector<double> runs;
          for (int i = 0; i < kPerftestRuns; ++i) {
            double gbps = RunPerftest(program, flags, size, ucx_memory, pin);
            if (gbps > 0) runs.push_back(gbps);
          }
          return Median(runs);
        };
        for (size_t size : {r.layer, r.block}) {
          if (flags.perftest_heap && !heap.count(size)) heap[size] = measure(size, false);
        }
        for (size_t size : {r.layer, r.block}) {
          if (!ucxmem.count(size)) ucxmem[size] = measure(size, true);
        }
      }
    }
  }
  auto get = [](const std::map<size_t, double>& m, size_t size) {
    auto it = m.find(size);
    return it == m.end() ? -1.0 : it->second;
  };
  auto ratio = [](double a, double b) { return b > 0 ? Fixed(a / b, 2) : std::string("n/a"); };
  const std::string copying =
      flags.copy_threads == 0
          ? std::string("puts + flush + notification")
          : absl::StrCat("copies by ", flags.copy_threads,
                         " copy thread(s) where the receiver's pool is mapped, else puts; then "
                         "flush + notification");
  std::printf(
      "\nkvstream UCX transport (%s, %s memory): layer-sized transfers of randomly scattered\n"
      "blocks, one segment per block, each transfer = %s, %d layer(s)\n"
      "in flight.\n"
      "Beside it ucx_perftest -t ucp_put_bw on the same UCX settings, same run:\n"
      "  heap/layer:   message = layer size, UCX_ALLOC_PRIO=heap (ordinary memory that UCX\n"
      "                registers, as kvstream must: engines own their KV buffers)\n"
      "  heap/block:   message = block size, heap memory: the puts kvstream issues, but from one\n"
      "                cache-hot buffer\n"
      "  ucxmem/layer: message = layer size, memory UCX allocates itself (shared segments that\n"
      "                the sender writes with plain copies): the path of --memory=transport\n"
      "  ucxmem/block: message = block size, memory UCX allocates itself\n"
      "  memcpy:       memcpy of the same scattered blocks inside one process on one core\n"
      "GB/s = 1e9 bytes/s, medians of the runs (use --benchmark_repetitions=N for more than\n"
      "one kvstream run; perftest runs %d times); r = kvstream / that column. %s.\n\n",
      flags.tls.c_str(), flags.memory.c_str(), copying.c_str(), flags.depth, kPerftestRuns,
      pin ? absl::StrCat("Senders pinned to CPU(s) ", absl::StrJoin(SenderCpus(flags), ","),
                         " (perftest's to 0), receivers to CPU 1")
                .c_str()
          : "Not pinned");
  std::printf("%-10s %-7s %-7s %5s %8s | %10s %5s | %10s %5s | %12s %5s | %12s %5s | %7s %5s\n",
              "shape", "layer", "block", "segs", "kvstream", "heap/layer", "r", "heap/block", "r",
              "ucxmem/layer", "r", "ucxmem/block", "r", "memcpy", "r");
  for (const Result& r : g_results) {
    const double hl = get(heap, r.layer), hb = get(heap, r.block), ul = get(ucxmem, r.layer);
    const double ub = get(ucxmem, r.block);
    const double mc = roofline[std::make_pair(r.layer, r.block)];
    const double kv = Median(r.gbps);
    std::printf("%-10s %-7s %-7s %5zu %8s | %10s %5s | %10s %5s | %12s %5s | %12s %5s | %7s %5s\n",
                r.shape.c_str(), Size(r.layer).c_str(), Size(r.block).c_str(), r.layer / r.block,
                Fixed(kv, 2).c_str(), Fixed(hl, 2).c_str(), ratio(kv, hl).c_str(),
                Fixed(hb, 2).c_str(), ratio(kv, hb).c_str(), Fixed(ul, 2).c_str(),
                ratio(kv, ul).c_str(), Fixed(ub, 2).c_str(), ratio(kv, ub).c_str(),
                Fixed(mc, 2).c_str(), ratio(kv, mc).c_str());
  }
}

// Takes this program's flags out of argv, leaving Google Benchmark's.
Flags ParseFlags(int* argc, char** argv) {
  Flags flags;
  int kept = 1;
  for (int i = 1; i < *argc; ++i) {
    absl::string_view arg = argv[i];
    if (absl::ConsumePrefix(&arg, "--tls=")) {
      flags.tls = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--memory=")) {
      flags.memory = std::string(arg);
      if (flags.memory != "transport" && flags.memory != "heap") {
        Die("--memory takes transport or heap");
      }
    } else if (absl::ConsumePrefix(&arg, "--perftest=")) {
      flags.perftest = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--depth=")) {
      if (!absl::SimpleAtoi(arg, &flags.depth) || flags.depth < 1) Die("bad --depth");
    } else if (absl::ConsumePrefix(&arg, "--copy-threads=")) {
      if (!absl::SimpleAtoi(arg, &flags.copy_threads) || flags.copy_threads < 0 ||
          flags.copy_threads > kMaxCopyThreads) {
        Die(absl::StrCat("bad --copy-threads (0..", kMaxCopyThreads, ")"));
      }
    } else if (absl::ConsumePrefix(&arg, "--ucx=")) {
      size_t eq = arg.find('=');
      if (eq == absl::string_view::npos) Die("--ucx takes NAME=VALUE");
      flags.ucx_config.emplace_back(std::string(arg.substr(0, eq)),
                                    std::string(arg.substr(eq + 1)));
    } else if (arg == "--perftest-heap=false") {
      flags.perftest_heap = false;
    } else if (arg == "--pin=false") {
      flags.pin = false;
    } else if (arg == "--role=receiver") {
      flags.receiver = true;
    } else {
      argv[kept++] = argv[i];
    }
  }
  *argc = kept;
  return flags;
}

int Main(int argc, char** argv) {
  Flags flags = ParseFlags(&argc, argv);
  if (flags.receiver) return RunReceiver(flags);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;

  if (flags.pin && CanPin()) PinTo(SenderCpus(flags));
  Context ctx;
  ctx.flags = flags;
  auto transport = CreateUcxTransport(OptionsFor(flags));
  if (!transport.ok()) Die(transport.status().ToString());
  ctx.transport = std::move(transport).value();
  ctx.local = MakePool(*ctx.transport, flags, ctx.pool);
  std::mt19937 rng(7);
  char* pool = static_cast<char*>(ctx.local->base());
  for (size_t i = 0; i < kPoolBytes; ++i) pool[i] = static_cast<char>(rng());
  char self[4096];
  ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) Die("cannot find this program");
  self[n] = '\0';
  StartReceiver(ctx, self);
  g_context = &ctx;

  for (size_t layer : kLayerBytes) {
    for (const Shape& shape : kShapes) {
      for (size_t tokens : kBlockTokens) {
        const std::string name =
            absl::StrCat("layer_transfer/", flags.tls, "/", flags.memory, "/", shape.name,
                         "/block", tokens,
                         "tok/", absl::StrReplaceAll(Size(layer), {{" ", ""}}));
        benchmark::RegisterBenchmark(name.c_str(),
                                     [shape, tokens, layer](benchmark::State& state) {
                                       BM_LayerTransfer(state, shape, tokens, layer);
                                     })
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond)
            ->MinTime(kMinSeconds);
      }
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  StopReceiver(ctx);
  PrintTable(flags, pool);
  benchmark::Shutdown();
  ctx.local.reset();
  return 0;
}

}  // namespace
}  // namespace kvstream

int main(int argc, char** argv) { return kvstream::Main(argc, argv); }
