// The chaos soak's peer processes: a prefill worker (producer) or a decode worker (consumer)
// running the toy model through the real Engine and LayerwiseConnector over UCX, driven by
// the soak's driver through the line protocol of chaos_setup.h. The soak binary runs itself
// in a peer role (`--role=producer|consumer`), so that every fault hits a real process.
#ifndef KVSTREAM_TESTS_CHAOS_CHAOS_PEER_H_
#define KVSTREAM_TESTS_CHAOS_CHAOS_PEER_H_

#include <string>

namespace kvstream {
namespace chaos {

struct PeerOptions {
  std::string role;       // "producer" or "consumer"
  std::string engine_id;
  std::string tls = "shm";
  std::string policy = "recompute";
  int port = 0;           // producer: control port (0: any free one)
  std::string log_path;   // stdout and stderr go here (appended) when set
};

// Runs the peer until "quit", its stdin closing, or an error (reported as an "error" line).
// Returns the process exit status: 0 after "quit", 1 after an error.
int RunPeer(const PeerOptions& options);

}  // namespace chaos
}  // namespace kvstream

#endif  // KVSTREAM_TESTS_CHAOS_CHAOS_PEER_H_
