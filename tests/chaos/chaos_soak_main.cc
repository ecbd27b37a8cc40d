// kvstream_chaos_soak: the chaos soak's driver (chaos_soak.h), and, started by it with
// --role, its peer processes (chaos_peer.h).
//
//   kvstream_chaos_soak [--iterations=N] [--seed=S] [--iteration=I] [--tcp-one-in=K]
//                       [--iteration-limit-s=T] [--fault=NAME]
//
// Prints the seed first; on a failure the iteration, the seed and the command that replays
// that iteration alone, with the logs of the peers involved. Ends with one line
// "chaos summary: key=value ..." of what was injected and what came of the requests. A
// watchdog ends the soak (SIGKILL to every peer, exit 1) when one iteration runs past
// --iteration-limit-s. After the last iteration: no child process may be left, and no
// System V shared memory segment created by a peer.
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/chaos/chaos_peer.h"
#include "tests/chaos/chaos_soak.h"
#include "tests/chaos/peer_process.h"

namespace kvstream {
namespace chaos {
namespace {

struct Flags {
  PeerOptions peer;
  int64_t iterations = 200;
  int64_t only_iteration = -1;
  bool seed_given = false;
  uint64_t seed = 0;
  int tcp_one_in = 5;
  int64_t iteration_limit_s = 60;
  std::string fault;
};

bool ParseFlags(int argc, char** argv, Flags& f) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view a = argv[i];
    auto value = [&a](absl::string_view name, std::string* out) {
      if (!absl::ConsumePrefix(&a, name)) return false;
      *out = std::string(a);
      return true;
    };
    std::string v;
    if (value("--role=", &f.peer.role) || value("--engine-id=", &f.peer.engine_id) ||
        value("--tls=", &f.peer.tls) || value("--policy=", &f.peer.policy) ||
        value("--log=", &f.peer.log_path) || value("--fault=", &f.fault)) {
      continue;
    }
    bool ok = true;
    if (value("--port=", &v)) {
      ok = absl::SimpleAtoi(v, &f.peer.port);
    } else if (value("--iterations=", &v)) {
      ok = absl::SimpleAtoi(v, &f.iterations) && f.iterations > 0;
    } else if (value("--iteration=", &v)) {
      ok = absl::SimpleAtoi(v, &f.only_iteration) && f.only_iteration >= 0;
    } else if (value("--seed=", &v)) {
      ok = absl::SimpleAtoi(v, &f.seed);
      f.seed_given = true;
    } else if (value("--tcp-one-in=", &v)) {
      ok = absl::SimpleAtoi(v, &f.tcp_one_in) && f.tcp_one_in > 0;
    } else if (value("--iteration-limit-s=", &v)) {
      ok = absl::SimpleAtoi(v, &f.iteration_limit_s) && f.iteration_limit_s > 0;
    } else {
      ok = false;
    }
    if (!ok) {
      std::cerr << "kvstream_chaos_soak: bad flag " << argv[i] << "\n";
      return false;
    }
  }
  return true;
}

std::string SelfPath() {
  char buffer[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buffer, sizeof(buffer) - 1);
  return n > 0 ? std::string(buffer, static_cast<size_t>(n)) : std::string();
}

// Processes whose parent is this one (read from /proc).
std::vector<pid_t> ChildPids() {
  std::vector<pid_t> out;
  DIR* dir = ::opendir("/proc");
  if (dir == nullptr) return out;
  const pid_t self = ::getpid();
  while (dirent* e = ::readdir(dir)) {
    pid_t pid = 0;
    if (!absl::SimpleAtoi(e->d_name, &pid)) continue;
    std::ifstream f(absl::StrCat("/proc/", pid, "/stat"));
    std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const size_t paren = stat.rfind(')');
    if (paren == std::string::npos) continue;
    std::vector<std::string> fields = absl::StrSplit(stat.substr(paren + 2), ' ');
    pid_t ppid = 0;
    if (fields.size() > 1 && absl::SimpleAtoi(fields[1], &ppid) && ppid == self) {
      out.push_back(pid);
    }
  }
  ::closedir(dir);
  return out;
}

// The shared memory that exists before the soak starts: System V segments by shmid, /dev/shm
// entries by name. Left out of what the soak's peers may have left behind, since a pid of
// the soak's may be the reused pid of a process that left them long before.
struct SharedMemoryBefore {
  std::set<std::string> sysv_ids;
  std::set<std::string> posix_names;
};

// Every System V segment's line of /proc/sysvipc/shm, split into fields.
std::vector<std::vector<std::string>> SysvSegments() {
  std::vector<std::vector<std::string>> out;
  std::ifstream f("/proc/sysvipc/shm");
  std::string line;
  std::getline(f, line);  // header: key shmid perms size cpid lpid nattch ...
  while (std::getline(f, line)) {
    std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (fields.size() > 4) out.push_back(std::move(fields));
  }
  return out;
}

// Every entry of /dev/shm.
std::vector<std::string> PosixSegments() {
  std::vector<std::string> out;
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return out;
  while (dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") out.push_back(name);
  }
  ::closedir(dir);
  return out;
}

SharedMemoryBefore SnapshotSharedMemory() {
  SharedMemoryBefore s;
  for (const std::vector<std::string>& fields : SysvSegments()) s.sysv_ids.insert(fields[1]);
  for (std::string& name : PosixSegments()) s.posix_names.insert(std::move(name));
  return s;
}

// System V shared memory segments (/proc/sysvipc/shm) created by one of `pids` and not there
// `before`.
std::vector<std::string> SysvSegmentsOf(const std::set<pid_t>& pids,
                                        const SharedMemoryBefore& before) {
  std::vector<std::string> out;
  for (const std::vector<std::string>& fields : SysvSegments()) {
    pid_t cpid = 0;
    if (before.sysv_ids.count(fields[1]) == 0 && absl::SimpleAtoi(fields[4], &cpid) &&
        pids.count(cpid) > 0) {
      out.push_back(absl::StrJoin(fields, " "));
    }
  }
  return out;
}

// /dev/shm entries named after one of `pids` (UCX's and kvstream's posix segments carry
// their creator's pid) and not there `before`.
std::vector<std::string> PosixSegmentsOf(const std::set<pid_t>& pids,
                                         const SharedMemoryBefore& before) {
  std::vector<std::string> out;
  for (const std::string& name : PosixSegments()) {
    if (before.posix_names.count(name) > 0) continue;
    for (pid_t pid : pids) {
      const std::string p = absl::StrCat(pid);
      size_t at = name.find(p);
      while (at != std::string::npos) {
        // The pid as a word of the name ("x_123_0", not the digits of "ucx_shm_posix_5a123").
        const bool left = at == 0 || !std::isalnum(static_cast<unsigned char>(name[at - 1]));
        const size_t end = at + p.size();
        const bool right = end == name.size() || !std::isalnum(static_cast<unsigned char>(name[end]));
        if (left && right) {
          out.push_back(name);
          break;
        }
        at = name.find(p, at + 1);
      }
    }
  }
  return out;
}

std::atomic<int64_t> g_iteration{-1};
std::atomic<int64_t> g_iteration_deadline_ns{0};  // 0: no iteration running

void Watchdog(uint64_t seed, int64_t limit_s, std::string log_dir, const std::atomic<bool>* done) {
  while (!done->load()) {
    const int64_t deadline = g_iteration_deadline_ns.load();
    if (deadline != 0 && absl::GetCurrentTimeNanos() > deadline) {
      const int64_t it = g_iteration.load();
      std::fprintf(stderr,
                   "chaos soak FAILED: iteration %lld (seed %llu) ran past its %lld s watchdog "
                   "(a hang); replay it alone with --seed=%llu --iteration=%lld; peer logs "
                   "in %s\n",
                   static_cast<long long>(it), static_cast<unsigned long long>(seed),
                   static_cast<long long>(limit_s), static_cast<unsigned long long>(seed),
                   static_cast<long long>(it), log_dir.c_str());
      std::fflush(stderr);
      KillRegisteredPids();
      std::_Exit(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

int RunSoak(const Flags& flags) {
  // A peer killed by the soak closes its end of the pipes: writing to it must be an error,
  // not the end of the driver.
  ::signal(SIGPIPE, SIG_IGN);
  uint64_t seed = flags.seed;
  if (!flags.seed_given) seed = (uint64_t{std::random_device()()} << 32) | std::random_device()();
  const int64_t first = flags.only_iteration >= 0 ? flags.only_iteration : 0;
  const int64_t last = flags.only_iteration >= 0 ? flags.only_iteration + 1 : flags.iterations;
  std::cout << "chaos soak: seed " << seed << ", iterations " << first << ".." << last - 1
            << " (replay one alone with --seed=" << seed << " --iteration=I)" << std::endl;

  char dir_template[] = "/tmp/kvstream-chaos-XXXXXX";
  if (::mkdtemp(dir_template) == nullptr) {
    std::cerr << "chaos soak: cannot make a log directory\n";
    return 1;
  }
  SoakOptions so;
  so.seed = seed;
  so.self = SelfPath();
  so.log_dir = dir_template;
  so.tcp_one_in = flags.tcp_one_in;
  for (int k = 0; k < kNumFaults; ++k) {
    if (flags.fault == FaultName(static_cast<Fault>(k))) so.only_fault = k;
  }
  if (!flags.fault.empty() && so.only_fault < 0) {
    std::cerr << "chaos soak: unknown --fault=" << flags.fault << "\n";
    return 2;
  }
  const SharedMemoryBefore shared_before = SnapshotSharedMemory();
  auto soak = Soak::Create(so);
  if (!soak.ok()) {
    std::cerr << "chaos soak: " << soak.status() << "\n";
    return 1;
  }
  std::atomic<bool> done{false};
  std::thread watchdog(Watchdog, seed, flags.iteration_limit_s, so.log_dir, &done);
  const absl::Time start = absl::Now();
  int rc = 0;
  for (int64_t i = first; i < last && rc == 0; ++i) {
    g_iteration = i;
    g_iteration_deadline_ns =
        absl::GetCurrentTimeNanos() + flags.iteration_limit_s * int64_t{1000000000};
    absl::Status s = (*soak)->RunIteration(i);
    g_iteration_deadline_ns = 0;
    if (!s.ok()) {
      std::cout << "chaos soak FAILED at iteration " << i << " (seed " << seed
                << "): " << s.message() << "\nreplay it alone with --seed=" << seed
                << " --iteration=" << i << "\n"
                << (*soak)->FailureLogs() << std::flush;
      rc = 1;
    }
  }
  g_iteration_deadline_ns = absl::GetCurrentTimeNanos() + int64_t{60} * 1000000000;
  absl::Status shutdown = (*soak)->Shutdown();
  g_iteration_deadline_ns = 0;
  done = true;
  watchdog.join();
  const double wall_s = absl::ToDoubleSeconds(absl::Now() - start);
  if (rc == 0 && !shutdown.ok()) {
    std::cout << "chaos soak FAILED at shutdown: " << shutdown.message() << "\n";
    rc = 1;
  }
  // Nothing may outlive the soak: processes, or shared memory of its peers.
  const std::vector<pid_t> children = ChildPids();
  if (!children.empty()) {
    std::cout << "chaos soak FAILED: " << children.size() << " child process(es) left, e.g. pid "
              << children[0] << "\n";
    rc = 1;
  }
  const std::set<pid_t> pids = AllPidsEverStarted();
  for (const std::string& seg : SysvSegmentsOf(pids, shared_before)) {
    std::cout << "chaos soak FAILED: System V shared memory left by a peer: " << seg << "\n";
    rc = 1;
  }
  for (const std::string& seg : PosixSegmentsOf(pids, shared_before)) {
    std::cout << "chaos soak FAILED: /dev/shm/" << seg << " left by a peer\n";
    rc = 1;
  }
  const SoakCounts& c = (*soak)->counts();
  // A soak in which no request ever got its KV from the producer did not test the stream.
  if (rc == 0 && c.iterations >= 20 && c.disaggregated == 0) {
    std::cout << "chaos soak FAILED: no request of " << c.requests
              << " completed with KV from the producer\n";
    rc = 1;
  }
  std::string summary = absl::StrCat(
      "chaos summary: seed=", seed, " iterations=", c.iterations, " wall_s=",
      static_cast<int64_t>(wall_s * 10) / 10.0, " tcp_iterations=", c.tcp_iterations,
      " fail_policy_iterations=", c.fail_policy_iterations);
  for (const auto& [name, count] : c.faults) absl::StrAppend(&summary, " ", name, "=", count);
  absl::StrAppend(&summary, " requests=", c.requests, " completed=", c.completed,
                  " disaggregated=", c.disaggregated, " recomputed=", c.recomputed,
                  " failed=", c.failed, " hostile_connections=", c.hostile_connections,
                  " hostile_frames=", c.hostile_frames, " peers_started=", pids.size(),
                  " result=", rc == 0 ? "PASS" : "FAIL");
  std::cout << summary << std::endl;
  if (rc == 0) {
    std::error_code ignored;
    std::filesystem::remove_all(so.log_dir, ignored);
  } else {
    std::cout << "peer logs kept in " << so.log_dir << "\n";
  }
  return rc;
}

}  // namespace
}  // namespace chaos
}  // namespace kvstream

int main(int argc, char** argv) {
  kvstream::chaos::Flags flags;
  if (!kvstream::chaos::ParseFlags(argc, argv, flags)) return 2;
  if (!flags.peer.role.empty()) return kvstream::chaos::RunPeer(flags.peer);
  return kvstream::chaos::RunSoak(flags);
}
