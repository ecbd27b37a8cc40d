// The control channel's wire format: versioned, length-prefixed frames, decoded strictly.
//
// Frame (all integers little-endian):
//   u32 magic 0x4353564B ("KVSC")   u16 version (kWireVersion)   u16 type   u32 payload_len
//   payload_len bytes of payload
// Payload fields, in order: integers fixed-width little-endian; strings and byte blobs as
// u32 length + bytes; lists as u32 count + elements. A payload must be consumed exactly.
//
// Decoding never trusts the input: a truncated frame, a payload longer than
// kMaxPayloadBytes, a wrong magic, an unknown version or type, a length or count running
// past the payload, an out-of-range value or trailing bytes is an InvalidArgument Status
// saying what was wrong; nothing is read or written out of bounds, and a list count is
// checked against the bytes that remain before anything is allocated for it.
//
// Value rules, enforced by the encoder and the decoder alike (so whatever we send, the peer
// accepts, and every accepted frame re-encodes to the same bytes): strings and blobs within
// the k*Bytes bound of their kind; Challenge nonce exactly 32 bytes; Hello nonce and
// auth_tag empty or exactly 32 bytes; Intro auth_tag exactly 32 bytes; status codes 0..16
// (absl::StatusCode).
//
// The channel knows frames, peers and the handshake, not what its users say: a Hello's
// `payload` and a Data message's `payload` are opaque bytes that the layer above (the
// connector) encodes and decodes itself. How the handshake uses the messages (which
// fields are empty when, what the tags cover) is written in control_channel.h.
//
// Version 3 (this one) added Intro and changed what the handshake's tags cover; a peer of
// another version is refused at its first frame header.
#ifndef KVSTREAM_TRANSFER_WIRE_H_
#define KVSTREAM_TRANSFER_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvstream {

inline constexpr uint32_t kWireMagic = 0x4353564B;  // bytes "KVSC"
inline constexpr uint16_t kWireVersion = 3;
inline constexpr size_t kFrameHeaderBytes = 12;
inline constexpr uint32_t kMaxPayloadBytes = 16u << 20;
// Bounds on individual fields (beyond the payload bound).
inline constexpr uint32_t kMaxIdBytes = 256;          // engine ids, request ids, names
inline constexpr uint32_t kMaxMessageBytes = 4096;    // human-readable texts
// Opaque payloads: what a frame can hold beside its other fields.
inline constexpr uint32_t kMaxHelloPayloadBytes = kMaxPayloadBytes - 8192;
inline constexpr uint32_t kMaxDataPayloadBytes = kMaxPayloadBytes - 4;

enum class MessageType : uint16_t {
  kChallenge = 1,
  kHello = 2,
  kHelloAck = 3,
  kData = 4,
  kError = 5,
  kIntro = 6,
};

// Sent by the accepting side first: a fresh nonce the connecting side must answer.
struct ChallengeMsg {
  std::string nonce;  // 32 random bytes
};

// The connecting side's introduction (and, in HelloAck, the accepting side's).
struct HelloMsg {
  std::string engine_id;
  // The user's introduction (opaque here), checked by its own check. Empty on the wire
  // when a secret is set: it then travels in an Intro, after both sides proved the secret.
  std::string payload;
  std::string nonce;     // the sender's own challenge to the other side (may be empty)
  std::string auth_tag;  // HandshakeTag (control_channel.h); empty = no secret
};

struct HelloAckMsg {
  HelloMsg hello;
  int32_t status_code = 0;  // absl::StatusCode; non-zero = rejected
  std::string message;
};

// After the handshake: one message of the channel's user (opaque here).
struct DataMsg {
  std::string payload;
};

struct ErrorMsg {
  int32_t status_code = 0;
  std::string message;
};

// With a secret, each side's introduction, sent once both sides have proved the secret.
struct IntroMsg {
  std::string payload;   // the user's introduction (opaque here), at most kMaxHelloPayloadBytes
  std::string auth_tag;  // HandshakeTag over the handshake and `payload`: exactly 32 bytes
};

using ControlMessage =
    std::variant<ChallengeMsg, HelloMsg, HelloAckMsg, DataMsg, ErrorMsg, IntroMsg>;

MessageType TypeOf(const ControlMessage& message);
absl::string_view MessageTypeName(MessageType type);

// A whole frame (header + payload). InvalidArgument when a field breaks the value rules
// above or the payload would exceed kMaxPayloadBytes.
absl::StatusOr<std::string> EncodeFrame(const ControlMessage& message);

// The header alone (exactly kFrameHeaderBytes bytes): returns the type and payload length.
// Errors for a wrong size, bad magic/version/type, or payload_len > kMaxPayloadBytes.
struct FrameHeader {
  MessageType type;
  uint32_t payload_len;
};
absl::StatusOr<FrameHeader> DecodeFrameHeader(absl::string_view header_bytes);

// A payload of a known type (the header already checked).
absl::StatusOr<ControlMessage> DecodePayload(MessageType type, absl::string_view payload);

// A whole frame: exactly one frame, no trailing bytes.
absl::StatusOr<ControlMessage> DecodeFrame(absl::string_view frame);

}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_WIRE_H_
