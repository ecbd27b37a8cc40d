// Encoding and strict decoding of the connector's control messages (control_messages.h).
#include "control_messages.h"

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "kvstream/common/byte_io.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/transfer/wire.h"

namespace kvstream {
namespace internal {
namespace {

constexpr uint32_t kHelloMagic = 0x4843564B;  // bytes "KVCH"
constexpr int32_t kMaxStatusCode = static_cast<int32_t>(absl::StatusCode::kUnauthenticated);
constexpr size_t kMinRegionBytes = 4 + 1 + 4;  // layer, tensor, descriptor length
constexpr size_t kInt32Bytes = 4;

enum class Kind : uint16_t { kHandOff = 1, kAck = 2, kAbort = 3 };

absl::Status CheckStatusCode(absl::string_view field, int32_t code) {
  if (code < 0 || code > kMaxStatusCode) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " ", code, " is not a status code (0..", kMaxStatusCode, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckRegion(const RegionDescriptor& region) {
  if (region.layer < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Hello.regions.layer ", region.layer, " is negative"));
  }
  if (region.tensor > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("Hello.regions.tensor ", region.tensor, " is neither 0 (K) nor 1 (V)"));
  }
  return absl::OkStatus();
}

absl::Status CheckIndexList(absl::string_view field, const std::vector<int32_t>& values) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "] ", values[i], " is negative"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckHandOff(const HandOffMsg& m) {
  RETURN_IF_ERROR(CheckIndexList("HandOff.prompt_token_ids", m.prompt_token_ids));
  RETURN_IF_ERROR(CheckIndexList("HandOff.dest_block_ids", m.dest_block_ids));
  if (m.num_tokens > m.prompt_token_ids.size()) {
    return absl::InvalidArgumentError(absl::StrCat("HandOff.num_tokens ", m.num_tokens,
                                                   " exceeds the prompt's ",
                                                   m.prompt_token_ids.size(), " tokens"));
  }
  return absl::OkStatus();
}

absl::Status EncodeCount(absl::string_view field, size_t count, ByteWriter& w) {
  if (count > kMaxListEntries) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " has ", count, " entries, more than the limit of ", kMaxListEntries));
  }
  w.U32(static_cast<uint32_t>(count));
  return absl::OkStatus();
}

absl::Status EncodeInt32List(absl::string_view field, const std::vector<int32_t>& values,
                             ByteWriter& w) {
  RETURN_IF_ERROR(EncodeCount(field, values.size(), w));
  for (int32_t v : values) w.I32(v);
  return absl::OkStatus();
}

absl::Status DecodeInt32List(absl::string_view field, ByteReader& r, std::vector<int32_t>* out) {
  uint32_t count = 0;
  RETURN_IF_ERROR(r.Count(field, kMaxListEntries, kInt32Bytes, &count));
  out->reserve(count);  // bounded by the bytes actually present
  for (uint32_t i = 0; i < count; ++i) {
    int32_t v = 0;
    RETURN_IF_ERROR(r.I32(field, &v));
    out->push_back(v);
  }
  return absl::OkStatus();
}

absl::Status Encode(const HandOffMsg& m, ByteWriter& w) {
  RETURN_IF_ERROR(CheckHandOff(m));
  w.U16(static_cast<uint16_t>(Kind::kHandOff));
  RETURN_IF_ERROR(w.Bytes("HandOff.request_id", m.request_id, kMaxIdBytes));
  RETURN_IF_ERROR(EncodeInt32List("HandOff.prompt_token_ids", m.prompt_token_ids, w));
  RETURN_IF_ERROR(EncodeInt32List("HandOff.dest_block_ids", m.dest_block_ids, w));
  w.U32(m.num_tokens);
  w.U64(m.attempt);
  return absl::OkStatus();
}

absl::Status Encode(const HandOffAckMsg& m, ByteWriter& w) {
  RETURN_IF_ERROR(CheckStatusCode("HandOffAck.status_code", m.status_code));
  w.U16(static_cast<uint16_t>(Kind::kAck));
  RETURN_IF_ERROR(w.Bytes("HandOffAck.request_id", m.request_id, kMaxIdBytes));
  w.I32(m.status_code);
  return w.Bytes("HandOffAck.message", m.message, kMaxMessageBytes);
}

absl::Status Encode(const AbortMsg& m, ByteWriter& w) {
  w.U16(static_cast<uint16_t>(Kind::kAbort));
  RETURN_IF_ERROR(w.Bytes("Abort.request_id", m.request_id, kMaxIdBytes));
  RETURN_IF_ERROR(w.Bytes("Abort.reason", m.reason, kMaxMessageBytes));
  w.U64(m.attempt);
  return absl::OkStatus();
}

absl::Status Decode(ByteReader& r, HandOffMsg* m) {
  RETURN_IF_ERROR(r.Bytes("HandOff.request_id", kMaxIdBytes, &m->request_id));
  RETURN_IF_ERROR(DecodeInt32List("HandOff.prompt_token_ids", r, &m->prompt_token_ids));
  RETURN_IF_ERROR(DecodeInt32List("HandOff.dest_block_ids", r, &m->dest_block_ids));
  RETURN_IF_ERROR(r.U32("HandOff.num_tokens", &m->num_tokens));
  RETURN_IF_ERROR(r.U64("HandOff.attempt", &m->attempt));
  return CheckHandOff(*m);
}

absl::Status Decode(ByteReader& r, HandOffAckMsg* m) {
  RETURN_IF_ERROR(r.Bytes("HandOffAck.request_id", kMaxIdBytes, &m->request_id));
  RETURN_IF_ERROR(r.I32("HandOffAck.status_code", &m->status_code));
  RETURN_IF_ERROR(CheckStatusCode("HandOffAck.status_code", m->status_code));
  return r.Bytes("HandOffAck.message", kMaxMessageBytes, &m->message);
}

absl::Status Decode(ByteReader& r, AbortMsg* m) {
  RETURN_IF_ERROR(r.Bytes("Abort.request_id", kMaxIdBytes, &m->request_id));
  RETURN_IF_ERROR(r.Bytes("Abort.reason", kMaxMessageBytes, &m->reason));
  return r.U64("Abort.attempt", &m->attempt);
}

template <typename Msg>
absl::StatusOr<ConnectorMessage> DecodeAs(ByteReader& r, absl::string_view name) {
  Msg m;
  RETURN_IF_ERROR(Decode(r, &m));
  RETURN_IF_ERROR(r.ExpectEnd(name));
  return ConnectorMessage(std::move(m));
}

}  // namespace

absl::string_view ConnectorMessageName(const ConnectorMessage& message) {
  static constexpr absl::string_view kNames[] = {"HandOff", "HandOffAck", "Abort"};
  return kNames[message.index()];
}

absl::StatusOr<std::string> EncodeConnectorHello(const ConnectorHello& h) {
  std::string out;
  ByteWriter w(&out);
  w.U32(kHelloMagic);
  w.U16(kConnectorWireVersion);
  w.U32(h.protocol_version);
  w.U64(h.compat_hash);
  RETURN_IF_ERROR(w.Bytes("Hello.compat_description", h.compat_description, kMaxMessageBytes));
  RETURN_IF_ERROR(w.Bytes("Hello.transport", h.transport, kMaxIdBytes));
  RETURN_IF_ERROR(w.Bytes("Hello.transport_info", h.transport_info, kMaxBlobBytes));
  RETURN_IF_ERROR(w.Bytes("Hello.group", h.group, kMaxIdBytes));
  RETURN_IF_ERROR(EncodeCount("Hello.regions", h.regions.size(), w));
  for (const RegionDescriptor& region : h.regions) {
    RETURN_IF_ERROR(CheckRegion(region));
    w.I32(region.layer);
    w.U8(region.tensor);
    RETURN_IF_ERROR(w.Bytes("Hello.regions.descriptor", region.descriptor, kMaxBlobBytes));
  }
  if (out.size() > kMaxHelloPayloadBytes) {
    return absl::InvalidArgumentError(absl::StrCat("the connector's hello is ", out.size(),
                                                   " bytes, more than the limit of ",
                                                   kMaxHelloPayloadBytes));
  }
  return out;
}

absl::StatusOr<ConnectorHello> DecodeConnectorHello(absl::string_view payload) {
  ByteReader r(payload);
  uint32_t magic = 0;
  uint16_t version = 0;
  RETURN_IF_ERROR(r.U32("Hello.magic", &magic));
  if (magic != kHelloMagic) {
    return absl::InvalidArgumentError("Hello payload is not a kvstream connector's (bad magic)");
  }
  RETURN_IF_ERROR(r.U16("Hello.version", &version));
  if (version != kConnectorWireVersion) {
    return absl::InvalidArgumentError(absl::StrCat("Hello payload version ", version,
                                                   " (this side speaks ",
                                                   kConnectorWireVersion, ")"));
  }
  ConnectorHello h;
  RETURN_IF_ERROR(r.U32("Hello.protocol_version", &h.protocol_version));
  RETURN_IF_ERROR(r.U64("Hello.compat_hash", &h.compat_hash));
  RETURN_IF_ERROR(r.Bytes("Hello.compat_description", kMaxMessageBytes, &h.compat_description));
  RETURN_IF_ERROR(r.Bytes("Hello.transport", kMaxIdBytes, &h.transport));
  RETURN_IF_ERROR(r.Bytes("Hello.transport_info", kMaxBlobBytes, &h.transport_info));
  RETURN_IF_ERROR(r.Bytes("Hello.group", kMaxIdBytes, &h.group));
  uint32_t count = 0;
  RETURN_IF_ERROR(r.Count("Hello.regions", kMaxListEntries, kMinRegionBytes, &count));
  h.regions.reserve(count);  // bounded by the bytes actually present
  for (uint32_t i = 0; i < count; ++i) {
    RegionDescriptor region;
    RETURN_IF_ERROR(r.I32("Hello.regions.layer", &region.layer));
    RETURN_IF_ERROR(r.U8("Hello.regions.tensor", &region.tensor));
    RETURN_IF_ERROR(r.Bytes("Hello.regions.descriptor", kMaxBlobBytes, &region.descriptor));
    RETURN_IF_ERROR(CheckRegion(region));
    h.regions.push_back(std::move(region));
  }
  RETURN_IF_ERROR(r.ExpectEnd("Hello"));
  return h;
}

absl::StatusOr<std::string> EncodeConnectorMessage(const ConnectorMessage& message) {
  std::string out;
  ByteWriter w(&out);
  RETURN_IF_ERROR(std::visit([&w](const auto& m) { return Encode(m, w); }, message));
  if (out.size() > kMaxDataPayloadBytes) {
    return absl::InvalidArgumentError(absl::StrCat(ConnectorMessageName(message), " is ",
                                                   out.size(), " bytes, more than the limit of ",
                                                   kMaxDataPayloadBytes));
  }
  return out;
}

absl::StatusOr<ConnectorMessage> DecodeConnectorMessage(absl::string_view payload) {
  ByteReader r(payload);
  uint16_t kind = 0;
  RETURN_IF_ERROR(r.U16("message kind", &kind));
  switch (static_cast<Kind>(kind)) {
    case Kind::kHandOff:
      return DecodeAs<HandOffMsg>(r, "HandOff");
    case Kind::kAck:
      return DecodeAs<HandOffAckMsg>(r, "HandOffAck");
    case Kind::kAbort:
      return DecodeAs<AbortMsg>(r, "Abort");
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown connector message kind ", kind));
}

absl::Status SendConnectorMessage(ControlConnection& connection, const ConnectorMessage& message,
                                  absl::Time deadline) {
  DataMsg data;
  ASSIGN_OR_RETURN(data.payload, EncodeConnectorMessage(message));
  return connection.Send(data, deadline);
}

absl::StatusOr<ConnectorMessage> ReceiveConnectorMessage(ControlConnection& connection,
                                                         absl::Time deadline) {
  ASSIGN_OR_RETURN(ControlMessage frame, connection.Receive(deadline));
  const DataMsg* data = std::get_if<DataMsg>(&frame);
  if (data == nullptr) {
    connection.Close();
    if (const ErrorMsg* error = std::get_if<ErrorMsg>(&frame)) {
      return absl::Status(static_cast<absl::StatusCode>(error->status_code == 0
                                                            ? int(absl::StatusCode::kUnknown)
                                                            : error->status_code),
                          absl::StrCat(connection.peer_address(), " sent an error: ",
                                       absl::CHexEscape(error->message)));
    }
    return absl::InvalidArgumentError(absl::StrCat(connection.peer_address(),
                                                   " sent an unexpected ",
                                                   MessageTypeName(TypeOf(frame)), " frame"));
  }
  absl::StatusOr<ConnectorMessage> message = DecodeConnectorMessage(data->payload);
  if (!message.ok()) {
    connection.Close();
    return absl::InvalidArgumentError(absl::StrCat("malformed message from ",
                                                   connection.peer_address(), ": ",
                                                   message.status().message()));
  }
  return message;
}

}  // namespace internal
}  // namespace kvstream
