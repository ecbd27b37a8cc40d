// The chaos soak driver's peer processes (peer_process.h).
#include "tests/chaos/peer_process.h"

#include <signal.h>

#include <fstream>
#include <mutex>
#include <sstream>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace kvstream {
namespace chaos {
namespace {

std::mutex g_mu;
std::set<pid_t>& LivePids() {
  static auto* s = new std::set<pid_t>();
  return *s;
}
std::set<pid_t>& EverPids() {
  static auto* s = new std::set<pid_t>();
  return *s;
}

// Start-up builds a model and a UCX context: seconds at most, even on a loaded machine.
constexpr absl::Duration kStartLimit = absl::Seconds(30);

}  // namespace

void RegisterPid(pid_t pid) {
  std::lock_guard<std::mutex> lock(g_mu);
  LivePids().insert(pid);
  EverPids().insert(pid);
}
void UnregisterPid(pid_t pid) {
  std::lock_guard<std::mutex> lock(g_mu);
  LivePids().erase(pid);
}
std::set<pid_t> AllPidsEverStarted() {
  std::lock_guard<std::mutex> lock(g_mu);
  return EverPids();
}
void KillRegisteredPids() {
  std::lock_guard<std::mutex> lock(g_mu);
  for (pid_t pid : LivePids()) ::kill(pid, SIGKILL);
}

absl::StatusOr<std::unique_ptr<PeerProcess>> PeerProcess::Start(const std::string& self,
                                                                const PeerOptions& o) {
  std::vector<std::string> argv = {self,
                                   "--role=" + o.role,
                                   "--engine-id=" + o.engine_id,
                                   "--tls=" + o.tls,
                                   "--policy=" + o.policy,
                                   absl::StrCat("--port=", o.port)};
  if (!o.log_path.empty()) argv.push_back("--log=" + o.log_path);
  auto child = test::ChildProcess::Spawn(argv);
  if (!child.ok()) return child.status();
  std::unique_ptr<PeerProcess> p(new PeerProcess());
  p->options_ = o;
  p->child_ = *std::move(child);
  p->alive_ = true;
  auto line = p->child_->reader().ReadLine(absl::Now() + kStartLimit);
  if (!line.ok()) {
    p->Kill();
    return absl::UnavailableError(absl::StrCat(o.role, " ", o.engine_id,
                                               " did not start: ", line.status().ToString(),
                                               "; its log:\n", LogTail(o.log_path)));
  }
  std::vector<std::string> words = absl::StrSplit(*line, ' ');
  int pid = 0;
  if (words.size() != 3 || words[0] != "ready" || !absl::SimpleAtoi(words[1], &pid)) {
    p->Kill();
    absl::string_view rest = *line;
    std::string message = *line;
    std::string unescaped;
    if (absl::ConsumePrefix(&rest, "error ") && absl::CUnescape(rest, &unescaped)) {
      message = unescaped;
    }
    return absl::UnavailableError(
        absl::StrCat(o.role, " ", o.engine_id, " did not start: ", message));
  }
  p->pid_ = pid;
  RegisterPid(pid);
  if (words[2] != "-") {
    const size_t colon = words[2].rfind(':');
    if (colon == std::string::npos || !absl::SimpleAtoi(words[2].substr(colon + 1), &p->port_)) {
      p->Kill();
      return absl::InternalError(absl::StrCat("bad address in '", *line, "'"));
    }
    p->host_ = words[2].substr(0, colon);
  }
  return p;
}

PeerProcess::~PeerProcess() { Kill(); }

absl::Status PeerProcess::Send(const std::string& line) {
  if (!alive_) return absl::FailedPreconditionError("the peer is not running");
  return test::WriteLine(child_->to_child(), line);
}

absl::StatusOr<std::string> PeerProcess::ReadLine(absl::Time deadline) {
  if (!alive_) return absl::FailedPreconditionError("the peer is not running");
  return child_->reader().ReadLine(deadline);
}

void PeerProcess::Signal(int signal_number) {
  if (alive_ && pid_ > 0) ::kill(pid_, signal_number);
}

void PeerProcess::Kill() {
  if (!alive_) return;
  child_->Kill();
  alive_ = false;
  if (pid_ > 0) UnregisterPid(pid_);
}

absl::StatusOr<int> PeerProcess::WaitExit(absl::Time deadline) {
  if (!alive_) return absl::FailedPreconditionError("the peer is not running");
  absl::StatusOr<int> rc = child_->Wait(deadline);
  if (rc.ok() || !absl::IsDeadlineExceeded(rc.status())) {
    alive_ = false;
    UnregisterPid(pid_);
  }
  return rc;
}

std::string LogTail(const std::string& path, size_t max_bytes) {
  std::ifstream f(path);
  if (!f) return "(no log)";
  std::stringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  return s.size() > max_bytes ? "..." + s.substr(s.size() - max_bytes) : s;
}

}  // namespace chaos
}  // namespace kvstream
