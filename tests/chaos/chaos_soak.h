// The chaos soak: randomized iterations of a decode worker (consumer) handing requests to a
// prefill worker (producer), both real processes over UCX (shared memory, or TCP on
// loopback), with a fault drawn per iteration: SIGKILL of either side after a random delay
// or at a random layer of the stream, SIGSTOP past the connector's deadlines then SIGCONT
// or SIGKILL, restarts (a new producer on the same port, a new consumer under the same
// engine id) that run the same request ids again, hostile connections to the producer's
// control port mixed into any iteration, or nothing. Both load-error policies run.
//
// After every iteration: each request's tokens and logits are bit-identical to a colocated
// run of its prompt computed once up front, or, under `fail` only, the request is reported
// failed; every block is back in its pool on each side still running (the consumer after
// its run, the producer once it has no work). Peers that survive are reused by later
// iterations. Every wait of the driver has a deadline.
//
// An iteration's choices depend only on (seed, iteration): `--seed=S --iteration=I` replays
// one alone (with fresh peers, so what earlier iterations left in the peers is not
// replayed).
#ifndef KVSTREAM_TESTS_CHAOS_CHAOS_SOAK_H_
#define KVSTREAM_TESTS_CHAOS_CHAOS_SOAK_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvstream/serving/engine.h"
#include "tests/chaos/peer_process.h"

namespace kvstream {
namespace chaos {

enum class Fault {
  kNone,
  kKillProducerAfterDelay,
  kKillProducerAtLayer,
  kStopProducerAtLayer,    // then SIGCONT or SIGKILL
  kStopProducerAfterDelay, // then SIGCONT or SIGKILL
  kKillConsumerAfterDelay,
  kKillConsumerAtLayer,
  kStopConsumerAfterDelay, // then SIGCONT
  kHostileFrames,          // hostile connections alone (they are also mixed into others)
};
inline constexpr int kNumFaults = 9;
const char* FaultName(Fault fault);

// UCX before 1.14 aborts a process on an assertion (ucp_request.c: "got REP message", while
// purging the pending wireup reply of an endpoint whose TCP connect was refused) when its
// peer dies while UCX is still wiring up the endpoint between them; fixed upstream by
// openucx/ucx#8175. Over TCP a producer killed during its first layers on a new link does
// exactly that to its consumer, so on such a UCX the soak runs the faults that kill (or stop,
// then maybe kill) a producer over shared memory, and counts them as tcp_moved_to_shm.
bool UcxAbortsOnTcpWireupLoss();

// UCX before 1.19 crashes (SIGSEGV in uct_rkey_release, from ucp_rkey_destroy) when
// ucp_ep_rkey_unpack fails for one memory domain, e.g. a shared memory segment that no longer
// exists: it releases keys it never unpacked; fixed upstream by openucx/ucx#10380. A
// consumer killed while the producer is still importing its regions at the handshake makes
// the producer's import fail exactly so. On such a UCX the soak kills a consumer only after
// it got KV from the current producer (a warm-up run first when it has not).
bool UcxCrashesOnFailedRkeyUnpack();

// What the soak saw, summed over iterations.
struct SoakCounts {
  int64_t iterations = 0;
  std::map<std::string, int64_t> faults;  // by FaultName; also "producer_restarts",
                                          // "consumer_restarts", "not_reached"
  int64_t requests = 0;       // handed to a consumer (those of a killed consumer give no result)
  int64_t completed = 0;      // status OK (outputs equal to the colocated run)
  int64_t disaggregated = 0;  // completed with KV from the producer, not recomputed
  int64_t recomputed = 0;     // completed after a load error (recompute)
  int64_t failed = 0;         // reported failed (fail)
  int64_t hostile_connections = 0;
  int64_t hostile_frames = 0;
  int64_t tcp_iterations = 0;
  int64_t fail_policy_iterations = 0;
};

struct ReferenceOutput {
  std::vector<int32_t> tokens;
  std::vector<float> logits;
};

struct SoakOptions {
  uint64_t seed = 0;
  std::string self;     // this binary, started in the peer roles
  std::string log_dir;  // peer logs
  int tcp_one_in = 5;   // about one iteration in this many runs over TCP
  int only_fault = -1;  // >= 0: every iteration injects this Fault (debugging a kind)
};

class Soak {
 public:
  // Computes the colocated outputs of the prompt pool (once, in this process).
  static absl::StatusOr<std::unique_ptr<Soak>> Create(const SoakOptions& options);
  ~Soak();

  // Runs iteration `iteration`; an error is a soak failure whose message says what broke.
  absl::Status RunIteration(int64_t iteration);
  // Ends every peer ("quit", bounded wait, exit status 0 expected).
  absl::Status Shutdown();
  // Peer logs of the last failure worth showing.
  std::string FailureLogs() const;

  const SoakCounts& counts() const { return counts_; }

 private:
  struct Request {
    std::string id;
    int prompt = 0;  // index into prompts_
  };
  struct Iteration;  // one iteration's choices and state (chaos_soak.cc)

  explicit Soak(const SoakOptions& options) : options_(options) {}
  absl::Status RunIteration(int64_t index, Iteration& it);
  absl::StatusOr<PeerProcess*> Producer(const std::string& tls, int port = 0);
  absl::StatusOr<PeerProcess*> Consumer(const std::string& policy, const std::string& tls);
  absl::Status SendRun(PeerProcess& consumer, const PeerProcess& producer,
                       const std::vector<Request>& requests);
  // Reads a run's results and checks them (outputs, policy, blocks).
  absl::Status CheckRun(PeerProcess& consumer, const PeerProcess& producer,
                        const std::vector<Request>& requests);
  // Waits until the producer has no work and every block is free.
  absl::Status CheckProducerBlocks(PeerProcess& producer);
  // Sends an "arm" command and waits for its acknowledgement, so that the fault is armed
  // before the run that should reach it starts.
  absl::Status Arm(PeerProcess& peer, const std::string& command);
  absl::Status InjectFault(Iteration& it, PeerProcess& producer, PeerProcess& consumer);
  // Waits for the armed peer's "fault" line; false when the run ended without reaching it.
  absl::StatusOr<bool> WaitForFault(PeerProcess& armed, PeerProcess& consumer);
  absl::Status ProducerDied(const std::string& tls);

  SoakOptions options_;
  std::vector<std::vector<int32_t>> prompts_;
  std::vector<ReferenceOutput> reference_;
  std::map<std::string, std::unique_ptr<PeerProcess>> producers_;  // by tls
  std::map<std::string, std::unique_ptr<PeerProcess>> consumers_;  // by policy + tls
  // Consumer pid -> the producer pid its last run got KV from (so their handshake is over).
  std::map<pid_t, pid_t> linked_;
  std::map<std::string, int> ports_;  // by tls: the producer's last port, for restarts
  std::vector<std::string> recent_logs_;
  SoakCounts counts_;
  int64_t spawned_ = 0;
  int64_t status_seq_ = 0;
};

}  // namespace chaos
}  // namespace kvstream

#endif  // KVSTREAM_TESTS_CHAOS_CHAOS_SOAK_H_
