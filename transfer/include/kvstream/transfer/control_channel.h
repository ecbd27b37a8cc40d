// The control channel between workers: TCP connections carrying wire.h frames, with every
// read and write bounded by a deadline, and the handshake (optional shared-secret
// authentication, then compatibility check).
//
//   ASSIGN_OR_RETURN(auto listener, ControlListener::Listen("127.0.0.1", 0));
//   ... peer: ASSIGN_OR_RETURN(auto conn, ConnectControl("127.0.0.1", port, deadline));
//   ASSIGN_OR_RETURN(auto conn, listener->Accept(deadline));
//   ASSIGN_OR_RETURN(ControlMessage m, conn->Receive(deadline));
//
// A connection that receives a malformed frame closes itself and returns the decode error;
// every later call returns FailedPrecondition. Thread safety: one thread may Send while
// another Receives; two concurrent Sends (or Receives) are serialised; closed(), Close(),
// peer_address() and local_address() may be called from any thread. Hosts are numeric IPv4
// addresses or "localhost" (names are not resolved: resolution could not honour a
// deadline). SIGPIPE is never raised.
//
// Memory: what a peer can make us hold is bounded. A connection receives one frame at a
// time (Receive is serialised), so each peer has at most one frame in flight; its buffer
// grows only as the bytes arrive (never to the announced length up front: at most twice
// what arrived or 64 KiB, three times for the moment it grows), and a frame costs at most
// twice its payload while it is decoded. Frames larger than ReceiveBudgetLimits::free_frame_bytes are charged to a
// ReceiveBudget shared by connections (by default one for the whole process); a frame that
// does not fit in what is left of it, or that announces more than the connection's
// max_frame_bytes, closes that connection with ResourceExhausted, never the process.
#ifndef KVSTREAM_TRANSFER_CONTROL_CHANNEL_H_
#define KVSTREAM_TRANSFER_CONTROL_CHANNEL_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kvstream/transfer/wire.h"

namespace kvstream {

// ---- Receive memory budget ----

struct ReceiveBudgetLimits {
  // The bytes that all frames being received on the budget's connections may hold
  // together (buffers and decoded copies).
  size_t max_total_bytes = size_t{64} << 20;
  // Frames whose payload is at most this size are not charged, so that ordinary control
  // traffic is never refused because large frames hold the budget; what they hold is
  // bounded by the number of connections instead (at most twice this each).
  size_t free_frame_bytes = size_t{64} << 10;
};

// Counts the bytes that frames being received hold; thread-safe. Connections charge it
// before they allocate, and release what they charged when Receive returns.
class ReceiveBudget {
 public:
  explicit ReceiveBudget(ReceiveBudgetLimits limits) : limits_(limits) {}
  ReceiveBudget(const ReceiveBudget&) = delete;
  ReceiveBudget& operator=(const ReceiveBudget&) = delete;

  // The process-wide budget (default limits) that connections use unless given another.
  static const std::shared_ptr<ReceiveBudget>& Process();

  // Charges `bytes` if they fit under max_total_bytes: true; otherwise charges nothing,
  // counts a refusal and returns false.
  bool TryAcquire(size_t bytes);
  // Returns `bytes` charged earlier.
  void Release(size_t bytes);

  const ReceiveBudgetLimits& limits() const { return limits_; }
  size_t in_use_bytes() const { return in_use_.load(std::memory_order_relaxed); }
  // The most ever charged at once.
  size_t peak_bytes() const { return peak_.load(std::memory_order_relaxed); }
  uint64_t refusals() const { return refusals_.load(std::memory_order_relaxed); }

 private:
  const ReceiveBudgetLimits limits_;
  std::atomic<size_t> in_use_{0};
  std::atomic<size_t> peak_{0};
  std::atomic<uint64_t> refusals_{0};
};

struct ControlChannelOptions {
  // Null: ReceiveBudget::Process().
  std::shared_ptr<ReceiveBudget> budget;
  // The largest payload one frame may announce on this connection (at most
  // kMaxPayloadBytes, which the decoder enforces anyway).
  uint32_t max_frame_bytes = kMaxPayloadBytes;
};

class ControlConnection {
 public:
  virtual ~ControlConnection() = default;
  // Sends one frame; DeadlineExceeded if it cannot be written in time (the connection is
  // then closed: a partial frame cannot be recovered); Unavailable (closed) when the peer
  // is gone. A message breaking wire.h's value rules is InvalidArgument before anything is
  // written, and the connection stays open.
  virtual absl::Status Send(const ControlMessage& message, absl::Time deadline) = 0;
  // Receives one frame. DeadlineExceeded when none arrives in time (the connection stays
  // usable if no byte of a frame was read); Unavailable when the peer closed; the decode
  // error (connection closed) for a malformed frame; ResourceExhausted (connection closed)
  // for a frame over max_frame_bytes or one the receive budget has no room for.
  virtual absl::StatusOr<ControlMessage> Receive(absl::Time deadline) = 0;
  // True once closed by either side or by an error.
  virtual bool closed() const = 0;
  // Idempotent. Wakes a Send or Receive blocked in another thread (they then return
  // FailedPrecondition); the peer sees end of stream after whatever was already sent. The
  // socket itself is released when the object is destroyed.
  virtual void Close() = 0;
  // "ip:port" of the other end, as this side's socket sees it.
  virtual std::string peer_address() const = 0;
  // "ip:port" of this end, as this side's socket sees it.
  virtual std::string local_address() const = 0;
};

class ControlListener {
 public:
  // Listens on host:port (port 0 = any free port). InvalidArgument for a bad host;
  // Unavailable when the address cannot be bound (the message names it and errno).
  // Accepted connections use `options`.
  static absl::StatusOr<std::unique_ptr<ControlListener>> Listen(
      const std::string& host, uint16_t port, ControlChannelOptions options = {});
  virtual ~ControlListener() = default;
  virtual uint16_t port() const = 0;
  // Waits for one connection until `deadline` (DeadlineExceeded).
  virtual absl::StatusOr<std::unique_ptr<ControlConnection>> Accept(absl::Time deadline) = 0;
};

// Connects to host:port. Unavailable (with errno text) when refused; DeadlineExceeded.
absl::StatusOr<std::unique_ptr<ControlConnection>> ConnectControl(
    const std::string& host, uint16_t port, absl::Time deadline,
    ControlChannelOptions options = {});

// ---- Handshake ----
//
// Without a secret (today's deployments that configure none) nothing is authenticated and
// nothing can be: anyone who can reach the port can introduce itself as any engine, and a
// hello recorded from a real worker can be replayed. The payloads travel at once:
//
//   server                                  client
//   Challenge{nonce_s}                  ->
//                                       <-  Hello{id_c, payload_c, nonce_c}
//   check(payload_c)
//   HelloAck{id_s, payload_s, nonce_s}  ->
//                                           check(payload_s)
//
// With a secret, both sides prove it before either says anything about itself, and every
// tag (HMAC-SHA256 under the secret, see HandshakeTag) covers both nonces, both engine ids
// (the server's from its HelloAck on), the step (so a tag of one direction never passes for
// the other), each side's introduction, and the connection's two TCP endpoints as each side
// sees them (so a handshake relayed through a middle process, whose two connections have
// other endpoints, fails, and a hello recorded on one connection is worthless on another):
//
//   Challenge{nonce_s}                  ->
//                                       <-  Hello{id_c, nonce_c, tag kClientHello}
//   verify
//   HelloAck{id_s, nonce_s, tag kServerHello}  ->
//                                           verify
//                                       <-  Intro{payload_c, tag kClientIntro}
//   verify, check(payload_c)
//   Intro{payload_s, tag kServerIntro}  ->
//                                           verify, check(payload_s)
//
// A peer that has not proved the secret gets no payload, and a rejection it gets says only
// why authentication failed, nothing about this side's cache. What the secret does not
// give: the frames after the handshake carry no tags and nothing is encrypted, so a
// process on the path itself (one that can rewrite packets of the same TCP connection)
// can still read or inject traffic once the handshake is over. Binding to endpoints also
// means that a secret cannot be used across NAT, where the two sides see different
// addresses (bind_to_endpoints = false on both sides allows that, and relays with it).

struct HandshakeOptions {
  // This side's hello: engine id and the caller's opaque payload (nonce and auth_tag are
  // filled in by the handshake).
  HelloMsg local;
  std::string secret;  // shared secret; empty = no authentication
  absl::Time deadline = absl::InfiniteFuture();
  // Decides whether the peer's hello is acceptable (decodes its payload, compares
  // compatibility); an error rejects the peer with that status, whose message should say
  // what differed on both sides, since the peer sees it too (with a secret, only a peer
  // that proved it). Peer strings it quotes should be escaped (absl::CHexEscape): the
  // handshake passes the message on as it is. Empty = accept every peer.
  std::function<absl::Status(const HelloMsg& peer)> check;
  // The largest peer payload handed to `check`; a larger one is refused with
  // ResourceExhausted before `check` runs.
  size_t max_peer_payload_bytes = kMaxHelloPayloadBytes;
  // With a secret: whether the tags cover the connection's TCP endpoints (see above). Both
  // sides must agree.
  bool bind_to_endpoints = true;
};

// Connecting side: the client half of the exchange above. Returns the peer's hello (its
// engine id, payload and nonce; its Hello tag when a secret is set). PermissionDenied when
// authentication fails either way (a side with a secret requires a tag from the peer; a
// side without one refuses a peer that sends one; a relayed connection or an altered
// introduction fails verification); the peer's rejection status (e.g. FailedPrecondition
// for a compatibility mismatch) when it refuses us; the check's error when we refuse it
// (we then tell the peer with an ErrorMsg and close); ResourceExhausted for a peer payload
// over max_peer_payload_bytes. On any failure the connection is closed. Blocks until
// options.deadline at most.
absl::StatusOr<HelloMsg> HandshakeAsClient(ControlConnection& connection,
                                           const HandshakeOptions& options);

// Accepting side: send a challenge, receive and verify the client, run the check, answer
// (on rejection: an ErrorMsg with the status and reason instead; then close). Returns the
// peer's hello; on any failure the connection is closed. The server has answered before
// the client runs its own check, so a refusal by the client's check reaches the server as
// an ErrorMsg from the first Receive after the handshake. Blocks until options.deadline at
// most.
absl::StatusOr<HelloMsg> HandshakeAsServer(ControlConnection& connection,
                                           const HandshakeOptions& options);

// What a handshake tag is bound to. Endpoints are "ip:port" as ControlConnection names them
// (empty when bind_to_endpoints is off).
struct HandshakeBinding {
  std::string server_nonce;
  std::string client_nonce;
  std::string client_engine_id;
  std::string server_engine_id;  // not covered by kClientHello: the client does not know it yet
  std::string client_endpoint;   // the connecting side's address
  std::string server_endpoint;   // the accepting side's address
};

enum class HandshakeStep : uint8_t {
  kClientHello = 1,
  kServerHello = 2,
  kClientIntro = 3,
  kServerIntro = 4,
};

// HMAC-SHA256(secret, label "kvstream handshake v3", step (one byte), the fields of
// `binding` in declaration order, `payload`), every string as u32 length + bytes. `payload`
// is empty for the Hello steps. Exposed for tests (hand-played peers). An empty result
// (never a valid tag) if HMAC fails.
std::string HandshakeTag(absl::string_view secret, HandshakeStep step,
                         const HandshakeBinding& binding, absl::string_view payload);

// HMAC-SHA256(key, data), exposed for tests.
std::string HmacSha256(absl::string_view key, absl::string_view data);

}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_CONTROL_CHANNEL_H_
