// ProducerPeers: a consumer's producers by control address ("host:port"): each one's
// lifecycle (peer_lifecycle.h: new, connecting, up, down with a reconnect backoff), its live
// control link, and that link's reader thread.
//
// A load asks LinkFor(address): a live link is returned at once; a new peer, or a down one
// whose retry time came, is connected and handshaken on the calling thread (bounded by the
// handshake deadline the dialer applies); a down one before its retry time is refused at
// once with Unavailable, saying since when it is down and why. A link ends when its reader
// sees the connection close or fail, or when the consumer gives it up (Lose); the peer then
// goes down and the consumer is told (its requests on that link fail), and a later load
// reconnects to whatever answers at that address: a restarted producer is handshaken anew.
//
// Links are numbered (Link::serial, never reused), so that requests name the link they were
// handed to: the loss of an old link fails only its own requests, never those a
// reconnection has handed to the new one. A link's end runs Options::on_end first, before
// the peer goes down (so before any redial), then on_lost: the consumer fences the
// producer's transport off in on_end, which a redial's Accept must come after.
//
// Thread safety: thread-safe. The handlers are called without any lock of this class held
// (from a reader thread, or from the thread calling Lose), so they may call back into it.
#ifndef KVSTREAM_CONNECTOR_SRC_PRODUCER_PEERS_H_
#define KVSTREAM_CONNECTOR_SRC_PRODUCER_PEERS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "control_messages.h"
#include "kvstream/transfer/control_channel.h"
#include "kvstream/transfer/transport.h"
#include "peer_lifecycle.h"

namespace kvstream {
namespace internal {

class ProducerPeers {
 public:
  struct Link {
    std::unique_ptr<ControlConnection> conn;
    std::string address;
    std::string engine_id;  // from its hello
    uint64_t serial = 0;    // > 0, unique among this consumer's links
    // The producer's transport as this side's transport knows it (Transport::Accept),
    // while its writes are accepted; none where the dialer did not accept it.
    std::optional<PeerId> transport_peer;
    std::atomic<bool> alive{true};
  };

  // Connects to `address` and handshakes (with its own deadline); the connection, the
  // producer's engine id and its transport peer.
  struct Dialed {
    std::unique_ptr<ControlConnection> conn;
    std::string engine_id;
    std::optional<PeerId> transport_peer;
  };
  using Dialer = std::function<absl::StatusOr<Dialed>(const std::string& host, int port)>;
  // A message the producer sent on `link` (from its reader thread).
  using MessageHandler = std::function<void(Link& link, ConnectorMessage message)>;
  // `link` ended with `why` (once per link).
  using LostHandler = std::function<void(Link& link, const absl::Status& why)>;
  using EndHandler = std::function<void(Link& link)>;

  struct Options {
    ReconnectPolicy reconnect;
    size_t max_connections = 256;  // live links at once
    Dialer dial;
    MessageHandler on_message;
    // When a link ends, once: on_end before its peer goes down (nothing can dial it yet),
    // then on_lost.
    EndHandler on_end;
    LostHandler on_lost;
    // Set when the consumer stops: readers end.
    const std::atomic<bool>* stopping = nullptr;
  };

  explicit ProducerPeers(Options options) : options_(std::move(options)) {}
  ~ProducerPeers() { Stop(); }
  ProducerPeers(const ProducerPeers&) = delete;
  ProducerPeers& operator=(const ProducerPeers&) = delete;

  // The live link to the producer at host:port, connecting first where its lifecycle
  // allows (blocks for the dial). Unavailable while it is down and not yet due for another
  // attempt, or with the dial's error when the attempt fails (the peer is then down);
  // ResourceExhausted when max_connections links are open.
  absl::StatusOr<std::shared_ptr<Link>> LinkFor(const std::string& host, int port);

  // The live link to `address`, or null.
  std::shared_ptr<Link> Find(const std::string& address) const;

  // Ends `link` (closes its connection): its peer goes down and on_lost is called, once.
  void Lose(Link& link, const absl::Status& why);

  // The peer's state and how many times it came up (0, kNew for an unknown address), and
  // the engine id it gave at its last handshake (empty: none yet), which names it in
  // metrics while it is down.
  PeerState state(const std::string& address) const;
  std::string engine_id(const std::string& address) const;
  int64_t times_up(const std::string& address) const;

  // Links whose reader was not yet joined.
  int64_t connections() const;

  // Joins the readers (REQUIRES: *options.stopping is set, or every link lost) and forgets
  // every peer. Idempotent.
  void Stop();

 private:
  struct Peer {
    explicit Peer(PeerLifecycle l) : lifecycle(std::move(l)) {}
    PeerLifecycle lifecycle;
    std::shared_ptr<Link> link;  // the live one, while kUp
    std::string engine_id;       // from the last handshake
  };
  struct Reader {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };

  void ReaderLoop(const std::shared_ptr<Link>& link);
  void JoinFinished() ABSL_EXCLUSIVE_LOCKS_REQUIRED(threads_mu_);

  const Options options_;

  mutable absl::Mutex mu_;
  std::map<std::string, Peer> peers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_serial_ ABSL_GUARDED_BY(mu_) = 1;

  // One reader per link, joined once it is done, so that links that come and go do not pile
  // up threads. Lock order: threads_mu_ before mu_.
  mutable absl::Mutex threads_mu_;
  std::vector<Reader> readers_ ABSL_GUARDED_BY(threads_mu_);
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_SRC_PRODUCER_PEERS_H_
