// The chaos soak driver's handle on one peer process (chaos_peer.h) and the registry of
// every process it started, which the watchdog kills when an iteration overruns.
#ifndef KVSTREAM_TESTS_CHAOS_PEER_PROCESS_H_
#define KVSTREAM_TESTS_CHAOS_PEER_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tests/chaos/chaos_peer.h"
#include "tests/integration/ucx_transport_peer.h"

namespace kvstream {
namespace chaos {

// Every peer pid started by this process (live or not): for the watchdog (SIGKILL to the
// live ones) and for the final check that none of them left shared memory behind.
// Thread-safe.
void RegisterPid(pid_t pid);
void UnregisterPid(pid_t pid);  // reaped
std::set<pid_t> AllPidsEverStarted();
void KillRegisteredPids();      // SIGKILL to every pid not yet reaped

class PeerProcess {
 public:
  // Starts `self` (this binary) in the peer role `options` describes and waits (bounded)
  // for its "ready" line. An "error" line or a death before it is an error with the peer's
  // message.
  static absl::StatusOr<std::unique_ptr<PeerProcess>> Start(const std::string& self,
                                                            const PeerOptions& options);
  ~PeerProcess();  // SIGKILL and reap if still running

  absl::Status Send(const std::string& line);
  // The next line; DeadlineExceeded, or Unavailable when the peer closed its end (died).
  absl::StatusOr<std::string> ReadLine(absl::Time deadline);
  bool Readable() { return child_->reader().Readable(); }

  // Signals the process (SIGSTOP, SIGCONT). SIGKILL goes through Kill.
  void Signal(int signal_number);
  // SIGKILL (a continue first is not needed: SIGKILL ends a stopped process) and reap.
  void Kill();
  // After "quit": the exit status (bounded); an error for a signal death or a timeout.
  absl::StatusOr<int> WaitExit(absl::Time deadline);

  pid_t pid() const { return pid_; }
  bool alive() const { return alive_; }
  const std::string& host() const { return host_; }
  int port() const { return port_; }
  const PeerOptions& options() const { return options_; }

 private:
  PeerProcess() = default;

  PeerOptions options_;
  std::unique_ptr<test::ChildProcess> child_;
  pid_t pid_ = -1;
  bool alive_ = false;
  std::string host_;
  int port_ = 0;
};

// The last `max_bytes` of a peer's log file (for a failure report).
std::string LogTail(const std::string& path, size_t max_bytes = 3000);

}  // namespace chaos
}  // namespace kvstream

#endif  // KVSTREAM_TESTS_CHAOS_PEER_PROCESS_H_
