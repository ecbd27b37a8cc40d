// The control-channel handshake (the exchange is drawn in control_channel.h): without a
// secret, one round of introductions; with one, mutual challenge/response bound to the
// connection first, and the introductions only then, each under its own tag.
//
// Rules the code keeps:
// - With a secret, nothing the caller put in its payload leaves this side before the peer
//   has proved the secret, and a rejection sent before that says only why authentication
//   failed (our own words, never the check's, which may describe our cache).
// - Presence of a tag must match presence of a secret on both sides: otherwise a
//   misconfigured pair (one side with a secret, one without) would be accepted by the side
//   without.
// - A side that refuses the other sends an ErrorMsg with the status before closing, so both
//   ends report the same code.
// - Strings that came from the peer (engine ids, its rejection text) are escaped before
//   they go into a Status or the log.
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
#include "kvstream/common/byte_io.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/transfer/control_channel.h"
#include "kvstream/transfer/wire.h"

namespace kvstream {
namespace {

constexpr size_t kNonceBytes = 32;
constexpr absl::string_view kTagLabel = "kvstream handshake v3";

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

// Where a rejection's message came from: our own words (peer strings in them already
// escaped), or the caller's check, whose text may quote the peer and is escaped for the log.
enum class Words { kOurs, kCheck };

// Tells the peer why we refuse it (best effort: it may already be gone), then closes.
absl::Status Reject(ControlConnection& connection, absl::Time deadline, absl::Status status,
                    Words words = Words::kOurs) {
  const std::string logged = words == Words::kOurs ? std::string(status.message())
                                                   : absl::CHexEscape(status.message());
  Log(LogLevel::kWarning,
      absl::StrCat("control handshake with ", connection.peer_address(), " rejected: ",
                   absl::StatusCodeToString(status.code()), ": ", logged));
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

// The status the peer refused us with, as our result (its text escaped: it is the peer's).
absl::Status PeerRejection(const ControlConnection& connection, int32_t code,
                           absl::string_view message) {
  const absl::StatusCode status_code =
      code == 0 ? absl::StatusCode::kUnknown : static_cast<absl::StatusCode>(code);
  return absl::Status(status_code, absl::StrCat(PeerName(connection, nullptr),
                                                " rejected the handshake: ",
                                                absl::CHexEscape(message)));
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
  return !expected.empty() && expected.size() == received.size() &&
         CRYPTO_memcmp(expected.data(), received.data(), expected.size()) == 0;
}

// Without a secret on this side: the peer must not use one either.
absl::Status RequireNoTag(const ControlConnection& connection, const HelloMsg& peer) {
  if (peer.auth_tag.empty()) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat(PeerName(connection, &peer),
                   " authenticates with a shared secret but this side has none configured"));
}

// With a secret on this side: the peer's tag for `step` must be there and right.
absl::Status VerifyTag(const ControlConnection& connection, const HandshakeOptions& options,
                       HandshakeStep step, const HandshakeBinding& binding,
                       absl::string_view payload, absl::string_view tag, const HelloMsg& peer) {
  const std::string who = PeerName(connection, &peer);
  if (tag.empty()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "authentication failed: ", who, " sent no auth tag but this side requires the shared "
        "secret"));
  }
  if (TagsEqual(HandshakeTag(options.secret, step, binding, payload), tag)) {
    return absl::OkStatus();
  }
  if (step == HandshakeStep::kClientIntro || step == HandshakeStep::kServerIntro) {
    // The hello of this connection verified, so the secret is right: the introduction was
    // changed on its way.
    return absl::PermissionDeniedError(absl::StrCat(
        "authentication failed: the introduction from ", who,
        " does not match its tag (altered in transit)"));
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "authentication failed: ", who, " answered with another tag (wrong shared secret",
      options.bind_to_endpoints ? ", or a relayed connection: this side sees client " +
                                      binding.client_endpoint + " and server " +
                                      binding.server_endpoint
                                : std::string(),
      ")"));
}

// Bounds the peer's payload, then runs the caller's check (which decodes it and says what
// differed); a refusal is told to the peer, and the connection closed.
absl::Status AcceptPeer(ControlConnection& connection, const HandshakeOptions& options,
                        const HelloMsg& peer) {
  if (peer.payload.size() > options.max_peer_payload_bytes) {
    return Reject(connection, options.deadline,
                  absl::ResourceExhaustedError(absl::StrCat(
                      "the introduction from ", PeerName(connection, &peer), " is ",
                      peer.payload.size(), " bytes, more than this side accepts (",
                      options.max_peer_payload_bytes, ")")));
  }
  if (!options.check) return absl::OkStatus();
  absl::Status status = options.check(peer);
  if (!status.ok()) return Reject(connection, options.deadline, std::move(status), Words::kCheck);
  return absl::OkStatus();
}

HandshakeBinding Binding(const ControlConnection& connection, const HandshakeOptions& options,
                         bool we_are_server) {
  HandshakeBinding b;
  if (options.bind_to_endpoints) {
    b.client_endpoint = we_are_server ? connection.peer_address() : connection.local_address();
    b.server_endpoint = we_are_server ? connection.local_address() : connection.peer_address();
  }
  return b;
}

// ---- Without a secret ----

absl::StatusOr<HelloMsg> ServerOpen(ControlConnection& connection, const HandshakeOptions& options,
                                    const std::string& our_nonce, HelloMsg peer) {
  const absl::Time deadline = options.deadline;
  if (absl::Status s = RequireNoTag(connection, peer); !s.ok()) {
    return Reject(connection, deadline, std::move(s));
  }
  RETURN_IF_ERROR(AcceptPeer(connection, options, peer));
  HelloAckMsg ack;
  ack.hello = options.local;
  ack.hello.nonce = our_nonce;
  ack.hello.auth_tag.clear();
  ack.status_code = 0;
  RETURN_IF_ERROR(connection.Send(ack, deadline));
  return peer;
}

absl::StatusOr<HelloMsg> ClientOpen(ControlConnection& connection,
                                    const HandshakeOptions& options) {
  const absl::Time deadline = options.deadline;
  ASSIGN_OR_RETURN(std::string our_nonce, RandomNonce());
  HelloMsg hello = options.local;
  hello.nonce = our_nonce;
  hello.auth_tag.clear();
  RETURN_IF_ERROR(connection.Send(hello, deadline));

  ASSIGN_OR_RETURN(ControlMessage received, connection.Receive(deadline));
  ASSIGN_OR_RETURN(HelloAckMsg ack, Expect<HelloAckMsg>(connection, deadline, std::move(received)));
  if (ack.status_code != 0) return PeerRejection(connection, ack.status_code, ack.message);
  if (absl::Status s = RequireNoTag(connection, ack.hello); !s.ok()) {
    return Reject(connection, deadline, std::move(s));
  }
  RETURN_IF_ERROR(AcceptPeer(connection, options, ack.hello));
  return std::move(ack.hello);
}

// ---- With a secret ----

// A payload before authentication is a protocol violation: refusing it (rather than
// ignoring it) keeps a peer of a confused implementation from believing it was read.
absl::Status RequireNoPayload(const ControlConnection& connection, absl::string_view message,
                              const HelloMsg& peer) {
  if (peer.payload.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("handshake: ", message, " from ", PeerName(connection, &peer),
                   " carries an introduction before authentication"));
}

absl::StatusOr<HelloMsg> ServerSecret(ControlConnection& connection,
                                      const HandshakeOptions& options,
                                      const std::string& our_nonce, HelloMsg peer) {
  const absl::Time deadline = options.deadline;
  HandshakeBinding binding = Binding(connection, options, /*we_are_server=*/true);
  binding.server_nonce = our_nonce;
  binding.client_nonce = peer.nonce;
  binding.client_engine_id = peer.engine_id;
  if (absl::Status s = VerifyTag(connection, options, HandshakeStep::kClientHello, binding, "",
                                 peer.auth_tag, peer);
      !s.ok()) {
    return Reject(connection, deadline, std::move(s));
  }
  if (peer.nonce.empty()) {
    return Reject(connection, deadline,
                  absl::PermissionDeniedError(
                      absl::StrCat(PeerName(connection, &peer),
                                   " sent no nonce, so this side cannot authenticate itself")));
  }
  if (absl::Status s = RequireNoPayload(connection, "Hello", peer); !s.ok()) {
    return Reject(connection, deadline, std::move(s));
  }
  binding.server_engine_id = options.local.engine_id;

  HelloAckMsg ack;
  ack.hello.engine_id = options.local.engine_id;
  ack.hello.nonce = our_nonce;
  ack.hello.auth_tag = HandshakeTag(options.secret, HandshakeStep::kServerHello, binding, "");
  ack.status_code = 0;
  RETURN_IF_ERROR(connection.Send(ack, deadline));

  ASSIGN_OR_RETURN(ControlMessage received, connection.Receive(deadline));
  ASSIGN_OR_RETURN(IntroMsg intro, Expect<IntroMsg>(connection, deadline, std::move(received)));
  if (absl::Status s = VerifyTag(connection, options, HandshakeStep::kClientIntro, binding,
                                 intro.payload, intro.auth_tag, peer);
      !s.ok()) {
    return Reject(connection, deadline, std::move(s));
  }
  peer.payload = std::move(intro.payload);
  // The peer has proved the secret: from here on the check may say what differed.
  RETURN_IF_ERROR(AcceptPeer(connection, options, peer));
  IntroMsg ours;
  ours.payload = options.local.payload;
  ours.auth_tag = HandshakeTag(options.secret, HandshakeStep::kServerIntro, binding, ours.payload);
  RETURN_IF_ERROR(connection.Send(ours, deadline));
  return peer;
}

absl::StatusOr<HelloMsg> ClientSecret(ControlConnection& connection,
                                      const HandshakeOptions& options,
                                      const ChallengeMsg& challenge) {
  const absl::Time deadline = options.deadline;
  ASSIGN_OR_RETURN(std::string our_nonce, RandomNonce());
  HandshakeBinding binding = Binding(connection, options, /*we_are_server=*/false);
  binding.server_nonce = challenge.nonce;
  binding.client_nonce = our_nonce;
  binding.client_engine_id = options.local.engine_id;
  HelloMsg hello;
  hello.engine_id = options.local.engine_id;
  hello.nonce = our_nonce;
  hello.auth_tag = HandshakeTag(options.secret, HandshakeStep::kClientHello, binding, "");
  RETURN_IF_ERROR(connection.Send(hello, deadline));

  ASSIGN_OR_RETURN(ControlMessage received, connection.Receive(deadline));
  ASSIGN_OR_RETURN(HelloAckMsg ack, Expect<HelloAckMsg>(connection, deadline, std::move(received)));
  if (ack.status_code != 0) return PeerRejection(connection, ack.status_code, ack.message);
  HelloMsg peer = std::move(ack.hello);
  binding.server_engine_id = peer.engine_id;
  if (absl::Status s = VerifyTag(connection, options, HandshakeStep::kServerHello, binding, "",
                                 peer.auth_tag, peer);
      !s.ok()) {
    return Reject(connection, deadline, std::move(s));
  }
  if (peer.nonce != challenge.nonce) {
    return Reject(connection, deadline,
                  absl::PermissionDeniedError(absl::StrCat(
                      "authentication failed: ", PeerName(connection, &peer),
                      " names another nonce in its HelloAck than in its challenge")));
  }
  if (absl::Status s = RequireNoPayload(connection, "HelloAck", peer); !s.ok()) {
    return Reject(connection, deadline, std::move(s));
  }

  // The server has proved the secret: now it may learn about us.
  IntroMsg ours;
  ours.payload = options.local.payload;
  ours.auth_tag = HandshakeTag(options.secret, HandshakeStep::kClientIntro, binding, ours.payload);
  RETURN_IF_ERROR(connection.Send(ours, deadline));

  ASSIGN_OR_RETURN(received, connection.Receive(deadline));
  ASSIGN_OR_RETURN(IntroMsg intro, Expect<IntroMsg>(connection, deadline, std::move(received)));
  if (absl::Status s = VerifyTag(connection, options, HandshakeStep::kServerIntro, binding,
                                 intro.payload, intro.auth_tag, peer);
      !s.ok()) {
    return Reject(connection, deadline, std::move(s));
  }
  peer.payload = std::move(intro.payload);
  RETURN_IF_ERROR(AcceptPeer(connection, options, peer));
  return peer;
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
  if (options.secret.empty()) return ServerOpen(connection, options, our_nonce, std::move(peer));
  return ServerSecret(connection, options, our_nonce, std::move(peer));
}

absl::StatusOr<HelloMsg> ClientSteps(ControlConnection& connection,
                                     const HandshakeOptions& options) {
  const absl::Time deadline = options.deadline;
  ASSIGN_OR_RETURN(ControlMessage received, connection.Receive(deadline));
  ASSIGN_OR_RETURN(ChallengeMsg challenge,
                   Expect<ChallengeMsg>(connection, deadline, std::move(received)));
  if (options.secret.empty()) return ClientOpen(connection, options);
  return ClientSecret(connection, options, challenge);
}

}  // namespace

std::string HmacSha256(absl::string_view key, absl::string_view data) {
  // An empty result can never match a 32-byte tag, so failure here fails closed.
  if (key.size() > static_cast<size_t>(INT_MAX)) return "";
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int out_len = 0;
  // Never hand OpenSSL a null pointer (an empty string_view may have one).
  const void* key_bytes = key.empty() ? static_cast<const void*>("") : key.data();
  const unsigned char* data_bytes = reinterpret_cast<const unsigned char*>(
      data.empty() ? static_cast<const void*>("") : data.data());
  if (HMAC(EVP_sha256(), key_bytes, static_cast<int>(key.size()), data_bytes, data.size(), out,
           &out_len) == nullptr) {
    return "";
  }
  return std::string(reinterpret_cast<const char*>(out), out_len);
}

std::string HandshakeTag(absl::string_view secret, HandshakeStep step,
                         const HandshakeBinding& binding, absl::string_view payload) {
  std::string data;
  ByteWriter w(&data);
  // Every field length-prefixed, so no two different bindings give the same bytes.
  auto field = [&w](absl::string_view bytes) {
    w.U32(static_cast<uint32_t>(bytes.size()));
    w.Raw(bytes);
  };
  field(kTagLabel);
  w.U8(static_cast<uint8_t>(step));
  field(binding.server_nonce);
  field(binding.client_nonce);
  field(binding.client_engine_id);
  field(step == HandshakeStep::kClientHello ? absl::string_view() : binding.server_engine_id);
  field(binding.client_endpoint);
  field(binding.server_endpoint);
  field(payload);
  return HmacSha256(secret, data);
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
