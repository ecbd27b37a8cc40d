// Encoding and strict decoding of control-channel frames (the format is written in wire.h).
//
// The encoder enforces the same bounds as the decoder, so that whatever we send, our peer
// accepts; and the decoder accepts exactly the encoder's image, so that every accepted frame
// re-encodes to the same bytes (the mutation test relies on that).
#include "kvstream/transfer/wire.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kvstream/common/byte_io.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace {

constexpr size_t kNonceBytes = 32;    // challenge nonces
constexpr size_t kAuthTagBytes = 32;  // HMAC-SHA256
// absl::StatusCode spans kOk (0) .. kUnauthenticated (16).
constexpr int32_t kMaxStatusCode = static_cast<int32_t>(absl::StatusCode::kUnauthenticated);

// ---- Value checks shared by encoder and decoder ----

absl::Status CheckStatusCode(absl::string_view field, int32_t code) {
  if (code < 0 || code > kMaxStatusCode) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " ", code, " is not a status code (0..", kMaxStatusCode, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckOptionalFixed(absl::string_view field, const std::string& bytes, size_t size) {
  if (!bytes.empty() && bytes.size() != size) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " is ", bytes.size(), " bytes; must be 0 or ", size));
  }
  return absl::OkStatus();
}

// ---- Encoders ----

absl::Status Encode(const ChallengeMsg& m, ByteWriter& w) {
  if (m.nonce.size() != kNonceBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("Challenge.nonce is ", m.nonce.size(), " bytes; must be ", kNonceBytes));
  }
  return w.Bytes("Challenge.nonce", m.nonce, kNonceBytes);
}

absl::Status Encode(const HelloMsg& m, ByteWriter& w) {
  RETURN_IF_ERROR(w.Bytes("Hello.engine_id", m.engine_id, kMaxIdBytes));
  RETURN_IF_ERROR(w.Bytes("Hello.payload", m.payload, kMaxHelloPayloadBytes));
  RETURN_IF_ERROR(CheckOptionalFixed("Hello.nonce", m.nonce, kNonceBytes));
  RETURN_IF_ERROR(w.Bytes("Hello.nonce", m.nonce, kNonceBytes));
  RETURN_IF_ERROR(CheckOptionalFixed("Hello.auth_tag", m.auth_tag, kAuthTagBytes));
  return w.Bytes("Hello.auth_tag", m.auth_tag, kAuthTagBytes);
}

absl::Status Encode(const HelloAckMsg& m, ByteWriter& w) {
  RETURN_IF_ERROR(Encode(m.hello, w));
  RETURN_IF_ERROR(CheckStatusCode("HelloAck.status_code", m.status_code));
  w.I32(m.status_code);
  return w.Bytes("HelloAck.message", m.message, kMaxMessageBytes);
}

absl::Status Encode(const DataMsg& m, ByteWriter& w) {
  return w.Bytes("Data.payload", m.payload, kMaxDataPayloadBytes);
}

absl::Status Encode(const ErrorMsg& m, ByteWriter& w) {
  RETURN_IF_ERROR(CheckStatusCode("Error.status_code", m.status_code));
  w.I32(m.status_code);
  return w.Bytes("Error.message", m.message, kMaxMessageBytes);
}

absl::Status CheckIntroTag(const std::string& tag) {
  if (tag.size() != kAuthTagBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("Intro.auth_tag is ", tag.size(), " bytes; must be ", kAuthTagBytes));
  }
  return absl::OkStatus();
}

absl::Status Encode(const IntroMsg& m, ByteWriter& w) {
  RETURN_IF_ERROR(w.Bytes("Intro.payload", m.payload, kMaxHelloPayloadBytes));
  RETURN_IF_ERROR(CheckIntroTag(m.auth_tag));
  return w.Bytes("Intro.auth_tag", m.auth_tag, kAuthTagBytes);
}

// ---- Decoders ----

absl::Status Decode(ByteReader& r, ChallengeMsg* m) {
  RETURN_IF_ERROR(r.Bytes("Challenge.nonce", kNonceBytes, &m->nonce));
  if (m->nonce.size() != kNonceBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("Challenge.nonce is ", m->nonce.size(), " bytes; must be ", kNonceBytes));
  }
  return absl::OkStatus();
}

absl::Status Decode(ByteReader& r, HelloMsg* m) {
  RETURN_IF_ERROR(r.Bytes("Hello.engine_id", kMaxIdBytes, &m->engine_id));
  RETURN_IF_ERROR(r.Bytes("Hello.payload", kMaxHelloPayloadBytes, &m->payload));
  RETURN_IF_ERROR(r.Bytes("Hello.nonce", kNonceBytes, &m->nonce));
  RETURN_IF_ERROR(CheckOptionalFixed("Hello.nonce", m->nonce, kNonceBytes));
  RETURN_IF_ERROR(r.Bytes("Hello.auth_tag", kAuthTagBytes, &m->auth_tag));
  return CheckOptionalFixed("Hello.auth_tag", m->auth_tag, kAuthTagBytes);
}

absl::Status Decode(ByteReader& r, HelloAckMsg* m) {
  RETURN_IF_ERROR(Decode(r, &m->hello));
  RETURN_IF_ERROR(r.I32("HelloAck.status_code", &m->status_code));
  RETURN_IF_ERROR(CheckStatusCode("HelloAck.status_code", m->status_code));
  return r.Bytes("HelloAck.message", kMaxMessageBytes, &m->message);
}

absl::Status Decode(ByteReader& r, DataMsg* m) {
  return r.Bytes("Data.payload", kMaxDataPayloadBytes, &m->payload);
}

absl::Status Decode(ByteReader& r, ErrorMsg* m) {
  RETURN_IF_ERROR(r.I32("Error.status_code", &m->status_code));
  RETURN_IF_ERROR(CheckStatusCode("Error.status_code", m->status_code));
  return r.Bytes("Error.message", kMaxMessageBytes, &m->message);
}

absl::Status Decode(ByteReader& r, IntroMsg* m) {
  RETURN_IF_ERROR(r.Bytes("Intro.payload", kMaxHelloPayloadBytes, &m->payload));
  RETURN_IF_ERROR(r.Bytes("Intro.auth_tag", kAuthTagBytes, &m->auth_tag));
  return CheckIntroTag(m->auth_tag);
}

template <typename Msg>
absl::StatusOr<ControlMessage> DecodeAs(MessageType type, absl::string_view payload) {
  ByteReader reader(payload);
  Msg message;
  RETURN_IF_ERROR(Decode(reader, &message));
  RETURN_IF_ERROR(reader.ExpectEnd(MessageTypeName(type)));
  return ControlMessage(std::move(message));
}

bool IsKnownType(uint16_t type) {
  return type >= static_cast<uint16_t>(MessageType::kChallenge) &&
         type <= static_cast<uint16_t>(MessageType::kIntro);
}

}  // namespace

MessageType TypeOf(const ControlMessage& message) {
  // The variant's alternatives are declared in MessageType order, starting at 1.
  static_assert(std::is_same_v<std::variant_alternative_t<0, ControlMessage>, ChallengeMsg>);
  static_assert(std::is_same_v<std::variant_alternative_t<4, ControlMessage>, ErrorMsg>);
  static_assert(std::is_same_v<std::variant_alternative_t<5, ControlMessage>, IntroMsg>);
  static_assert(std::variant_size_v<ControlMessage> == 6);
  return static_cast<MessageType>(message.index() + 1);
}

absl::string_view MessageTypeName(MessageType type) {
  switch (type) {
    case MessageType::kChallenge:
      return "Challenge";
    case MessageType::kHello:
      return "Hello";
    case MessageType::kHelloAck:
      return "HelloAck";
    case MessageType::kData:
      return "Data";
    case MessageType::kError:
      return "Error";
    case MessageType::kIntro:
      return "Intro";
  }
  return "Unknown";
}

absl::StatusOr<std::string> EncodeFrame(const ControlMessage& message) {
  std::string frame;
  ByteWriter writer(&frame);
  writer.U32(kWireMagic);
  writer.U16(kWireVersion);
  writer.U16(static_cast<uint16_t>(TypeOf(message)));
  writer.U32(0);  // payload_len, patched below once known
  RETURN_IF_ERROR(std::visit([&writer](const auto& m) { return Encode(m, writer); }, message));
  const size_t payload_len = frame.size() - kFrameHeaderBytes;
  if (payload_len > kMaxPayloadBytes) {
    return absl::InvalidArgumentError(absl::StrCat(MessageTypeName(TypeOf(message)), " payload is ",
                                                   payload_len, " bytes, more than the limit of ",
                                                   kMaxPayloadBytes));
  }
  for (int i = 0; i < 4; ++i) {
    frame[8 + i] = static_cast<char>((payload_len >> (8 * i)) & 0xff);
  }
  return frame;
}

absl::StatusOr<FrameHeader> DecodeFrameHeader(absl::string_view header_bytes) {
  if (header_bytes.size() != kFrameHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("frame header is ", header_bytes.size(),
                                                   " bytes; must be ", kFrameHeaderBytes));
  }
  ByteReader reader(header_bytes);
  uint32_t magic = 0;
  uint16_t version = 0;
  uint16_t type = 0;
  uint32_t payload_len = 0;
  RETURN_IF_ERROR(reader.U32("magic", &magic));
  RETURN_IF_ERROR(reader.U16("version", &version));
  RETURN_IF_ERROR(reader.U16("type", &type));
  RETURN_IF_ERROR(reader.U32("payload_len", &payload_len));
  if (magic != kWireMagic) {
    return absl::InvalidArgumentError(absl::StrCat("bad frame magic 0x", absl::Hex(magic),
                                                   " (expected 0x", absl::Hex(kWireMagic), ")"));
  }
  if (version != kWireVersion) {
    return absl::InvalidArgumentError(absl::StrCat("unsupported wire version ", version,
                                                   " (this side speaks ", kWireVersion, ")"));
  }
  if (!IsKnownType(type)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown message type ", type));
  }
  if (payload_len > kMaxPayloadBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("payload_len ", payload_len, " exceeds the limit of ", kMaxPayloadBytes));
  }
  FrameHeader header;
  header.type = static_cast<MessageType>(type);
  header.payload_len = payload_len;
  return header;
}

absl::StatusOr<ControlMessage> DecodePayload(MessageType type, absl::string_view payload) {
  if (payload.size() > kMaxPayloadBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "payload of ", payload.size(), " bytes exceeds the limit of ", kMaxPayloadBytes));
  }
  switch (type) {
    case MessageType::kChallenge:
      return DecodeAs<ChallengeMsg>(type, payload);
    case MessageType::kHello:
      return DecodeAs<HelloMsg>(type, payload);
    case MessageType::kHelloAck:
      return DecodeAs<HelloAckMsg>(type, payload);
    case MessageType::kData:
      return DecodeAs<DataMsg>(type, payload);
    case MessageType::kError:
      return DecodeAs<ErrorMsg>(type, payload);
    case MessageType::kIntro:
      return DecodeAs<IntroMsg>(type, payload);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown message type ", static_cast<uint16_t>(type)));
}

absl::StatusOr<ControlMessage> DecodeFrame(absl::string_view frame) {
  if (frame.size() < kFrameHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("truncated frame header: ", frame.size(), " of ",
                                                   kFrameHeaderBytes, " bytes"));
  }
  ASSIGN_OR_RETURN(FrameHeader header, DecodeFrameHeader(frame.substr(0, kFrameHeaderBytes)));
  const absl::string_view payload = frame.substr(kFrameHeaderBytes);
  if (payload.size() < header.payload_len) {
    return absl::InvalidArgumentError(absl::StrCat("truncated ", MessageTypeName(header.type),
                                                   " frame: payload has ", payload.size(), " of ",
                                                   header.payload_len, " bytes"));
  }
  if (payload.size() > header.payload_len) {
    return absl::InvalidArgumentError(absl::StrCat(payload.size() - header.payload_len,
                                                   " trailing bytes after the ",
                                                   MessageTypeName(header.type), " frame"));
  }
  return DecodePayload(header.type, payload);
}

}  // namespace kvstream
