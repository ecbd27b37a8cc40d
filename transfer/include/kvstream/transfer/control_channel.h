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
// another Receives; two concurrent Sends (or Receives) are serialised; closed(), Close()
// and peer_address() may be called from any thread. Hosts are numeric IPv4 addresses or
// "localhost" (names are not resolved: resolution could not honour a deadline). SIGPIPE is
// never raised.
#ifndef KVSTREAM_TRANSFER_CONTROL_CHANNEL_H_
#define KVSTREAM_TRANSFER_CONTROL_CHANNEL_H_

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
  // error (connection closed) for a malformed frame.
  virtual absl::StatusOr<ControlMessage> Receive(absl::Time deadline) = 0;
  // True once closed by either side or by an error.
  virtual bool closed() const = 0;
  // Idempotent. Wakes a Send or Receive blocked in another thread (they then return
  // FailedPrecondition); the peer sees end of stream after whatever was already sent. The
  // socket itself is released when the object is destroyed.
  virtual void Close() = 0;
  // "ip:port" of the other end.
  virtual std::string peer_address() const = 0;
};

class ControlListener {
 public:
  // Listens on host:port (port 0 = any free port). InvalidArgument for a bad host;
  // Unavailable when the address cannot be bound (the message names it and errno).
  static absl::StatusOr<std::unique_ptr<ControlListener>> Listen(const std::string& host,
                                                                 uint16_t port);
  virtual ~ControlListener() = default;
  virtual uint16_t port() const = 0;
  // Waits for one connection until `deadline` (DeadlineExceeded).
  virtual absl::StatusOr<std::unique_ptr<ControlConnection>> Accept(absl::Time deadline) = 0;
};

// Connects to host:port. Unavailable (with errno text) when refused; DeadlineExceeded.
absl::StatusOr<std::unique_ptr<ControlConnection>> ConnectControl(const std::string& host,
                                                                  uint16_t port,
                                                                  absl::Time deadline);

// ---- Handshake ----

struct HandshakeOptions {
  // This side's hello: engine id and the caller's opaque payload (nonce and auth_tag are
  // filled in by the handshake).
  HelloMsg local;
  std::string secret;  // shared secret; empty = no authentication
  absl::Time deadline = absl::InfiniteFuture();
  // Decides whether the peer's hello is acceptable (decodes its payload, compares
  // compatibility); an error rejects the peer with that status, whose message should say
  // what differed on both sides, since the peer sees it too. Empty = accept every peer.
  std::function<absl::Status(const HelloMsg& peer)> check;
};

// Connecting side: receive the challenge, send Hello (answering it, and challenging back),
// receive HelloAck and verify the other side's answer and its status. Returns the peer's
// hello. PermissionDenied when authentication fails either way (a side with a secret
// requires a tag from the peer; a side without one refuses a peer that sends one); the
// peer's rejection status (e.g. FailedPrecondition for a compatibility mismatch) when it
// refuses us; the check's error when we refuse it (we then tell the peer with an ErrorMsg
// and close). On any failure the connection is closed.
absl::StatusOr<HelloMsg> HandshakeAsClient(ControlConnection& connection,
                                           const HandshakeOptions& options);

// Accepting side: send a challenge, receive and verify Hello, run the check, answer with
// HelloAck (on rejection: an ErrorMsg with the status and reason instead; then close).
// Returns the peer's hello; on any failure the connection is closed. The server has
// answered before the client runs its own check, so a refusal by the client's check
// reaches the server as an ErrorMsg from the first Receive after the handshake.
absl::StatusOr<HelloMsg> HandshakeAsServer(ControlConnection& connection,
                                           const HandshakeOptions& options);

// HMAC-SHA256(secret, nonce || engine_id), exposed for tests.
std::string AuthTag(absl::string_view secret, absl::string_view nonce,
                    absl::string_view engine_id);

}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_CONTROL_CHANNEL_H_
