// The connector's messages on the control channel. The channel (transfer/control_channel.h)
// carries them as opaque bytes: the introduction in the handshake's HelloMsg::payload, the
// rest in DataMsg::payload. They are the only messages that name layers, requests and
// blocks.
//
// Hello payload (all integers little-endian; strings and blobs u32 length + bytes; lists u32
// count + elements):
//   u32 magic "KVCH"   u16 kConnectorWireVersion   u32 protocol_version   u64 compat_hash
//   str compat_description   str transport   blob transport_info   str group
//   list of regions: i32 layer, u8 tensor (0 K, 1 V), blob descriptor
// Data payload: u16 kind, then
//   kind 1 hand-off:  str request_id, list i32 prompt_token_ids, list i32 dest_block_ids,
//                     u32 num_tokens, u64 attempt
//   kind 2 ack:       str request_id, i32 status_code, str message
//   kind 3 abort:     str request_id, str reason, u64 attempt
//
// Decoding is strict (byte_io.h): a truncated or oversized field, a count past the bytes
// left, trailing bytes, an unknown kind or version, a negative token/block id or layer, a
// tensor other than 0/1, num_tokens beyond the prompt, a status code outside 0..16 are all
// InvalidArgument naming the field. The encoder enforces the same rules, so whatever we send
// the peer accepts, and every accepted payload re-encodes to the same bytes.
#ifndef KVSTREAM_CONNECTOR_SRC_CONTROL_MESSAGES_H_
#define KVSTREAM_CONNECTOR_SRC_CONTROL_MESSAGES_H_

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kvstream/transfer/control_channel.h"

namespace kvstream {
namespace internal {

// 2: the hello's group; 3: attempts; 4: the abort's attempt, and stop notices (layer_notice.h)
inline constexpr uint16_t kConnectorWireVersion = 4;
inline constexpr uint32_t kMaxBlobBytes = 1u << 20;    // transport info, memory descriptors
inline constexpr uint32_t kMaxListEntries = 1u << 22;  // tokens, blocks, regions

// One registered region of the sender's cache.
struct RegionDescriptor {
  int32_t layer = 0;
  uint8_t tensor = 0;  // 0 = K, 1 = V
  std::string descriptor;  // the transport's MemoryRegistration::descriptor()
};

// What a worker says about itself at handshake.
struct ConnectorHello {
  uint32_t protocol_version = 0;
  uint64_t compat_hash = 0;
  std::string compat_description;  // what was hashed, human-readable, for error messages
  std::string transport;           // transport name, e.g. "ucx"
  std::string transport_info;      // Transport::LocalInfo()
  // A pipeline stage's decode group (PipelineGroup): the stages of one group share it, and
  // the producer joins their hand-offs of one request id. Empty: not a pipeline stage.
  std::string group;
  std::vector<RegionDescriptor> regions;
};

// The decode side hands a request to the prefill side.
struct HandOffMsg {
  std::string request_id;
  std::vector<int32_t> prompt_token_ids;
  std::vector<int32_t> dest_block_ids;  // the receiver's blocks, in token order
  uint32_t num_tokens = 0;              // tokens whose KV the receiver expects (prefix)
  // Names this hand-off among the request's attempts (a retry reuses the id): the producer
  // carries it in every layer notice, and a notice of another attempt is ignored.
  uint64_t attempt = 0;
};

// The prefill side's verdict on a hand-off (status_code 0: accepted).
struct HandOffAckMsg {
  std::string request_id;
  int32_t status_code = 0;
  std::string message;
};

// Either side: stop (consumer to producer), or stopped, and why (producer to consumer). The
// consumer lets the request's blocks go only at the producer's stop notice, which travels
// behind the data (layer_notice.h), or when it gives the link up.
struct AbortMsg {
  std::string request_id;
  std::string reason;
  uint64_t attempt = 0;  // the hand-off's (HandOffMsg::attempt)
};

using ConnectorMessage = std::variant<HandOffMsg, HandOffAckMsg, AbortMsg>;
absl::string_view ConnectorMessageName(const ConnectorMessage& message);

absl::StatusOr<std::string> EncodeConnectorHello(const ConnectorHello& hello);
absl::StatusOr<ConnectorHello> DecodeConnectorHello(absl::string_view payload);

absl::StatusOr<std::string> EncodeConnectorMessage(const ConnectorMessage& message);
absl::StatusOr<ConnectorMessage> DecodeConnectorMessage(absl::string_view payload);

// Sends `message` as one DataMsg frame (errors as ControlConnection::Send).
absl::Status SendConnectorMessage(ControlConnection& connection, const ConnectorMessage& message,
                                  absl::Time deadline);
// Receives one DataMsg frame and decodes it. Errors as ControlConnection::Receive; a frame of
// another type or an undecodable payload is InvalidArgument (the connection is then closed,
// since the peer does not speak this protocol).
absl::StatusOr<ConnectorMessage> ReceiveConnectorMessage(ControlConnection& connection,
                                                         absl::Time deadline);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_SRC_CONTROL_MESSAGES_H_
