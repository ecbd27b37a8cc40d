// Hostile connections to a producer's control port, for the chaos soak: a third process's
// view (the soak's driver) of a worker whose port anyone can reach. Each connection plays
// one kind of abuse drawn at random; none of them may cost the producer more than that
// connection (the soak checks that the iteration's real requests still complete and that
// every block comes back).
#ifndef KVSTREAM_TESTS_CHAOS_HOSTILE_CLIENT_H_
#define KVSTREAM_TESTS_CHAOS_HOSTILE_CLIENT_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace kvstream {
namespace chaos {

enum class HostileKind {
  kRandomBytes,    // up to 2 KiB of noise, half of the time behind a valid magic
  kTruncatedFrame, // a prefix of a valid Hello frame, then end of stream
  kWrongVersion,   // a valid Hello frame under another wire version
  kHugeLength,     // a header announcing more than the channel takes, or a large payload
                   // of which only a few bytes come
  kReplayedHello,  // after the producer's challenge, a Hello naming a live consumer (its
                   // engine id, a well-formed connector hello) sent twice, then a hand-off
                   // of a live request id, and the same bytes again on a second connection
                   // without waiting for its challenge
  kSilent,         // connects and says nothing for up to 300 ms
};
inline constexpr int kNumHostileKinds = 6;
const char* HostileKindName(HostileKind kind);

struct HostileTarget {
  int port = 0;                   // the producer's control port on 127.0.0.1
  std::string victim_engine_id;   // a consumer the producer is serving
  std::string victim_request_id;  // one of that consumer's live requests
};

// Plays one connection (two for kReplayedHello) of a random kind against `target`. Returns
// the number of frames (or noise writes) sent; errors of the connection itself (refused,
// reset by the producer) are expected and not reported. Bounded: every socket call has a
// deadline of at most a second.
int PlayHostileConnection(std::mt19937_64& rng, const HostileTarget& target, HostileKind kind);

}  // namespace chaos
}  // namespace kvstream

#endif  // KVSTREAM_TESTS_CHAOS_HOSTILE_CLIENT_H_
