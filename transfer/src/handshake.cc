// The control-channel handshake: challenge/response authentication with an optional shared
// secret (HMAC-SHA256 over a fresh nonce, in both directions), then the caller's check of
// the peer's (opaque) introduction.
//
//   server                                  client
//   Challenge{nonce_s}                  ->
//                                       <-  Hello{local, nonce_c, H(secret, nonce_s || client id)}
//   verify tag, run check
//   HelloAck{local, nonce_s, H(secret, nonce_c || server id), status 0}  ->
//                                           verify tag, run check
//
// The server reveals its own tag only after it has verified the client's, so a client
// without the secret learns nothing it could replay. A side that refuses the other sends an
// ErrorMsg with the status before closing, so both ends report the same code. Presence of
// a tag must match presence of a secret on both sides: otherwise a misconfigured pair (one
// side with a secret, one without) would be accepted by the side without.
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <climits>
#include <cstddef>
#include <string>
#include <utility>
#include <variant>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/transfer/control_channel.h"
#include "kvstream/transfer/wire.h"

namespace kvstream {
namespace {

constexpr size_t kNonceBytes = 32;

absl::StatusOr<std::string> RandomNonce() {
  std::string nonce(kNonceBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(&nonce[0]), static_cast<int>(nonce.size())) !=
      1) {
    char err[256] = {0};
    ERR_error_string_n(ERR_get_error(), err, sizeof(err));
    return absl::InternalError(absl::StrCat("RAND_bytes failed: ", err));
  }
  return nonce;
}

// Names the other side in messages; engine ids come from the wire, so they are escaped.
std::string PeerName(const ControlConnection& connection, const HelloMsg* peer) {
  if (peer == nullptr) return absl::StrCat("peer ", connection.peer_address());
  return absl::StrCat("peer '", absl::CHexEscape(peer->engine_id), "' at ",
                      connection.peer_address());
}

// Tells the peer why we refuse it (best effort: it may already be gone), then closes.
absl::Status Reject(ControlConnection& connection, absl::Time deadline, absl::Status status) {
  Log(LogLevel::kWarning, absl::StrCat("control handshake with ", connection.peer_address(),
                                       " rejected: ", status.ToString()));
  ErrorMsg error;
  const int code = static_cast<int>(status.code());
  error.status_code = code >= 1 && code <= static_cast<int>(absl::StatusCode::kUnauthenticated)
                          ? code
                          : static_cast<int>(absl::StatusCode::kUnknown);
  error.message = std::string(status.message().substr(0, kMaxMessageBytes));
  connection.Send(error, deadline).IgnoreError();
  connection.Close();
  return status;
}

// The status the peer refused us with, as our result.
absl::Status PeerRejection(const ControlConnection& connection, int32_t code,
                           absl::string_view message) {
  const absl::StatusCode status_code =
      code == 0 ? absl::StatusCode::kUnknown : static_cast<absl::StatusCode>(code);
  return absl::Status(status_code, absl::StrCat(PeerName(connection, nullptr),
                                                " rejected the handshake: ", message));
}

// The message expected at this step, or: the peer's ErrorMsg as its status; anything else
// is a protocol violation, which we report to the peer.
template <typename Msg>
absl::StatusOr<Msg> Expect(ControlConnection& connection, absl::Time deadline,
                           ControlMessage message) {
  if (Msg* m = std::get_if<Msg>(&message)) return std::move(*m);
  if (const ErrorMsg* error = std::get_if<ErrorMsg>(&message)) {
    return PeerRejection(connection, error->status_code, error->message);
  }
  return Reject(connection, deadline,
                absl::InvalidArgumentError(absl::StrCat(
                    "handshake: expected ", MessageTypeName(TypeOf(Msg())), " from ",
                    connection.peer_address(), ", got ", MessageTypeName(TypeOf(message)))));
}

bool TagsEqual(absl::string_view expected, absl::string_view received) {
  return expected.size() == received.size() &&
         CRYPTO_memcmp(expected.data(), received.data(), expected.size()) == 0;
}

// Checks the peer's answer to `our_nonce`.
absl::Status VerifyPeerTag(const ControlConnection& connection, const HandshakeOptions& options,
                           absl::string_view our_nonce, const HelloMsg& peer) {
  const std::string who = PeerName(connection, &peer);
  if (options.secret.empty()) {
    if (!peer.auth_tag.empty()) {
      return absl::PermissionDeniedError(absl::StrCat(
          who, " authenticates with a shared secret but this side has none configured"));
    }
    return absl::OkStatus();
  }
  if (peer.auth_tag.empty()) {
    return absl::PermissionDeniedError(
        absl::StrCat(who, " sent no auth tag but this side requires the shared secret"));
  }
  if (!TagsEqual(AuthTag(options.secret, our_nonce, peer.engine_id), peer.auth_tag)) {
    return absl::PermissionDeniedError(
        absl::StrCat(who, " failed authentication (wrong shared secret)"));
  }
  return absl::OkStatus();
}

// Runs the caller's check (which decodes the peer's opaque payload and says what differed).
absl::Status RunCheck(const HandshakeOptions& options, const HelloMsg& peer) {
  if (!options.check) return absl::OkStatus();
  return options.check(peer);
}

absl::StatusOr<HelloMsg> ServerSteps(ControlConnection& connection,
                                     const HandshakeOptions& options) {
  const absl::Time deadline = options.deadline;
  ASSIGN_OR_RETURN(std::string our_nonce, RandomNonce());
  ChallengeMsg challenge;
  challenge.nonce = our_nonce;
  RETURN_IF_ERROR(connection.Send(challenge, deadline));

  ASSIGN_OR_RETURN(ControlMessage received, connection.Receive(deadline));
  ASSIGN_OR_RETURN(HelloMsg peer, Expect<HelloMsg>(connection, deadline, std::move(received)));
  if (!options.secret.empty() && peer.nonce.empty()) {
    return Reject(connection, deadline,
                  absl::PermissionDeniedError(
                      absl::StrCat(PeerName(connection, &peer),
                                   " sent no nonce, so this side cannot authenticate itself")));
  }
  if (absl::Status s = VerifyPeerTag(connection, options, our_nonce, peer); !s.ok()) {
    return Reject(connection, deadline, std::move(s));
  }
  if (absl::Status s = RunCheck(options, peer); !s.ok()) {
    return Reject(connection, deadline, std::move(s));
  }

  HelloAckMsg ack;
  ack.hello = options.local;
  ack.hello.nonce = our_nonce;
  ack.hello.auth_tag =
      options.secret.empty() ? "" : AuthTag(options.secret, peer.nonce, options.local.engine_id);
  ack.status_code = 0;
  RETURN_IF_ERROR(connection.Send(ack, deadline));
  return peer;
}

absl::StatusOr<HelloMsg> ClientSteps(ControlConnection& connection,
                                     const HandshakeOptions& options) {
  const absl::Time deadline = options.deadline;
  ASSIGN_OR_RETURN(ControlMessage received, connection.Receive(deadline));
  ASSIGN_OR_RETURN(ChallengeMsg challenge,
                   Expect<ChallengeMsg>(connection, deadline, std::move(received)));

  ASSIGN_OR_RETURN(std::string our_nonce, RandomNonce());
  HelloMsg hello = options.local;
  hello.nonce = our_nonce;
  hello.auth_tag = options.secret.empty()
                       ? ""
                       : AuthTag(options.secret, challenge.nonce, options.local.engine_id);
  RETURN_IF_ERROR(connection.Send(hello, deadline));

  ASSIGN_OR_RETURN(received, connection.Receive(deadline));
  ASSIGN_OR_RETURN(HelloAckMsg ack, Expect<HelloAckMsg>(connection, deadline, std::move(received)));
  if (ack.status_code != 0) return PeerRejection(connection, ack.status_code, ack.message);
  if (absl::Status s = VerifyPeerTag(connection, options, our_nonce, ack.hello); !s.ok()) {
    return Reject(connection, deadline, std::move(s));
  }
  if (absl::Status s = RunCheck(options, ack.hello); !s.ok()) {
    return Reject(connection, deadline, std::move(s));
  }
  return std::move(ack.hello);
}

}  // namespace

std::string AuthTag(absl::string_view secret, absl::string_view nonce,
                    absl::string_view engine_id) {
  // An empty result can never match a 32-byte tag, so failure here fails closed.
  if (secret.size() > static_cast<size_t>(INT_MAX)) return "";
  const std::string data = absl::StrCat(nonce, engine_id);
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int out_len = 0;
  // Never hand OpenSSL a null key pointer (an empty string_view may have one).
  const void* key = secret.empty() ? static_cast<const void*>("") : secret.data();
  if (HMAC(EVP_sha256(), key, static_cast<int>(secret.size()),
           reinterpret_cast<const unsigned char*>(data.data()), data.size(), out,
           &out_len) == nullptr) {
    return "";
  }
  return std::string(reinterpret_cast<const char*>(out), out_len);
}

absl::StatusOr<HelloMsg> HandshakeAsClient(ControlConnection& connection,
                                           const HandshakeOptions& options) {
  absl::StatusOr<HelloMsg> peer = ClientSteps(connection, options);
  // A handshake cut short leaves the stream in an unknown protocol state.
  if (!peer.ok()) connection.Close();
  return peer;
}

absl::StatusOr<HelloMsg> HandshakeAsServer(ControlConnection& connection,
                                           const HandshakeOptions& options) {
  absl::StatusOr<HelloMsg> peer = ServerSteps(connection, options);
  if (!peer.ok()) connection.Close();
  return peer;
}

}  // namespace kvstream
