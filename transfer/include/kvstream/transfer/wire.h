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
// the k*Bytes bound of their kind; lists within kMaxListEntries; Challenge nonce exactly 32
// bytes; Hello nonce and auth_tag empty or exactly 32 bytes; RegionDescriptor layer >= 0 and
// tensor 0 or 1; status codes 0..16 (absl::StatusCode); token and block ids >= 0;
// RequestMsg::num_tokens <= prompt_token_ids.size().
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
inline constexpr uint16_t kWireVersion = 1;
inline constexpr size_t kFrameHeaderBytes = 12;
inline constexpr uint32_t kMaxPayloadBytes = 16u << 20;
// Bounds on individual fields (beyond the payload bound).
inline constexpr uint32_t kMaxIdBytes = 256;          // engine ids, request ids, names
inline constexpr uint32_t kMaxMessageBytes = 4096;    // human-readable texts
inline constexpr uint32_t kMaxBlobBytes = 1u << 20;   // transport info, memory descriptors
inline constexpr uint32_t kMaxListEntries = 1u << 22; // tokens, blocks, regions

enum class MessageType : uint16_t {
  kChallenge = 1,
  kHello = 2,
  kHelloAck = 3,
  kRequest = 4,
  kRequestAck = 5,
  kAbort = 6,
  kError = 7,
};

// Sent by the accepting side first: a fresh nonce the connecting side must answer.
struct ChallengeMsg {
  std::string nonce;  // 32 random bytes
};

// One registered region of the sender's cache: layer index, which tensor, descriptor.
struct RegionDescriptor {
  int32_t layer = 0;
  uint8_t tensor = 0;  // 0 = K, 1 = V
  std::string descriptor;
};

// The connecting side's introduction (and, in HelloAck, the accepting side's).
struct HelloMsg {
  std::string engine_id;
  uint32_t protocol_version = 0;
  uint64_t compat_hash = 0;
  std::string compat_description;  // what was hashed, human-readable, for error messages
  std::string transport;           // transport name, e.g. "ucx"
  std::string transport_info;      // Transport::LocalInfo()
  std::vector<RegionDescriptor> regions;
  std::string nonce;     // the sender's own challenge to the other side (may be empty)
  std::string auth_tag;  // HMAC-SHA256(secret, other side's nonce || engine_id); empty = none
};

struct HelloAckMsg {
  HelloMsg hello;
  int32_t status_code = 0;  // absl::StatusCode; non-zero = rejected
  std::string message;
};

// The decode side hands a request to the prefill side.
struct RequestMsg {
  std::string request_id;
  std::vector<int32_t> prompt_token_ids;
  std::vector<int32_t> dest_block_ids;  // the receiver's blocks, in token order
  uint32_t num_tokens = 0;              // tokens whose KV the receiver expects (prefix)
};

struct RequestAckMsg {
  std::string request_id;
  int32_t status_code = 0;
  std::string message;
};

struct AbortMsg {
  std::string request_id;
  std::string reason;
};

struct ErrorMsg {
  int32_t status_code = 0;
  std::string message;
};

using ControlMessage = std::variant<ChallengeMsg, HelloMsg, HelloAckMsg, RequestMsg,
                                    RequestAckMsg, AbortMsg, ErrorMsg>;

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
