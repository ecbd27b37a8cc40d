// Encoding and strict decoding of the staged path's active messages (staged_wire.h).
#include "ucx/staged_wire.h"

#include "absl/strings/str_cat.h"
#include "kvstream/common/byte_io.h"
#include "kvstream/common/status_macros.h"
#include "ucx/staged_plan.h"
#include "ucx/ucx_wire.h"

namespace kvstream {
namespace internal {
namespace {

constexpr uint32_t kStagedMagic = 0x53555653;  // bytes "SVUS"
constexpr uint32_t kMaxHelloBytes = kMaxUcxAddressBytes + 64;
constexpr uint32_t kMaxLandingDescriptorBytes = kMaxUcxRkeyBytes + 64;

absl::Status In(absl::string_view what, absl::Status status) {
  if (status.ok()) return status;
  return absl::InvalidArgumentError(absl::StrCat("UCX staged ", what, ": ", status.message()));
}

}  // namespace

std::string EncodeStagedHeader(StagedType type, uint64_t sender_uid, uint64_t stamp) {
  std::string out;
  ByteWriter w(&out);
  w.U32(kStagedMagic);
  w.U16(kUcxWireVersion);
  w.U8(static_cast<uint8_t>(type));
  w.U8(0);
  w.U64(sender_uid);
  w.U64(stamp);
  return out;
}

absl::StatusOr<StagedHeader> DecodeStagedHeader(absl::string_view bytes) {
  ByteReader r(bytes);
  uint32_t magic = 0;
  uint16_t version = 0;
  uint8_t type = 0, reserved = 0;
  StagedHeader h;
  RETURN_IF_ERROR(In("header", r.U32("magic", &magic)));
  if (magic != kStagedMagic) return absl::InvalidArgumentError("UCX staged header: wrong magic");
  RETURN_IF_ERROR(In("header", r.U16("version", &version)));
  if (version != kUcxWireVersion) {
    return absl::InvalidArgumentError(absl::StrCat("UCX staged header: unsupported version ",
                                                   version, " (this build reads version ",
                                                   kUcxWireVersion, ")"));
  }
  RETURN_IF_ERROR(In("header", r.U8("type", &type)));
  RETURN_IF_ERROR(In("header", r.U8("reserved", &reserved)));
  RETURN_IF_ERROR(In("header", r.U64("sender uid", &h.sender_uid)));
  RETURN_IF_ERROR(In("header", r.U64("stamp", &h.stamp)));
  RETURN_IF_ERROR(In("header", r.ExpectEnd("header")));
  if (reserved != 0) return absl::InvalidArgumentError("UCX staged header: reserved byte set");
  if (type < static_cast<uint8_t>(StagedType::kHello) ||
      type > static_cast<uint8_t>(StagedType::kAbort)) {
    return absl::InvalidArgumentError(absl::StrCat("UCX staged header: unknown type ",
                                                   static_cast<int>(type)));
  }
  h.type = static_cast<StagedType>(type);
  return h;
}

std::string EncodeHello(absl::string_view worker_info) {
  std::string out;
  ByteWriter w(&out);
  w.U32(static_cast<uint32_t>(worker_info.size()));
  w.Raw(worker_info);
  return out;
}

absl::StatusOr<std::string> DecodeHello(absl::string_view body) {
  ByteReader r(body);
  std::string info;
  RETURN_IF_ERROR(In("hello", r.Bytes("worker info", kMaxHelloBytes, &info)));
  RETURN_IF_ERROR(In("hello", r.ExpectEnd("hello")));
  return info;
}

std::string EncodeWelcome(const StagedWelcome& welcome) {
  std::string out;
  ByteWriter w(&out);
  w.U8(welcome.ok ? 0 : 1);
  if (welcome.ok) {
    w.U32(welcome.slots);
    w.U64(welcome.slot_bytes);
    w.U32(static_cast<uint32_t>(welcome.landing_descriptor.size()));
    w.Raw(welcome.landing_descriptor);
  } else {
    const absl::string_view reason =
        absl::string_view(welcome.reason).substr(0, kMaxRefusalBytes);
    w.U32(static_cast<uint32_t>(reason.size()));
    w.Raw(reason);
  }
  return out;
}

absl::StatusOr<StagedWelcome> DecodeWelcome(absl::string_view body) {
  ByteReader r(body);
  StagedWelcome welcome;
  uint8_t status = 0;
  RETURN_IF_ERROR(In("welcome", r.U8("status", &status)));
  if (status == 0) {
    welcome.ok = true;
    RETURN_IF_ERROR(In("welcome", r.U32("slots", &welcome.slots)));
    RETURN_IF_ERROR(In("welcome", r.U64("slot bytes", &welcome.slot_bytes)));
    RETURN_IF_ERROR(In("welcome", r.Bytes("landing descriptor", kMaxLandingDescriptorBytes,
                                          &welcome.landing_descriptor)));
    if (welcome.slots < 1 || welcome.slots > kMaxStagedSlots) {
      return absl::InvalidArgumentError(absl::StrCat("UCX staged welcome: ", welcome.slots,
                                                     " slots (allowed 1..", kMaxStagedSlots,
                                                     ")"));
    }
    if (welcome.slot_bytes < kMinStagedChunkBytes || welcome.slot_bytes > kMaxStagedChunkBytes ||
        welcome.slot_bytes % kStagingAlignment != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("UCX staged welcome: bad slot size ", welcome.slot_bytes));
    }
  } else if (status == 1) {
    RETURN_IF_ERROR(In("welcome", r.Bytes("reason", kMaxRefusalBytes, &welcome.reason)));
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("UCX staged welcome: unknown status ", static_cast<int>(status)));
  }
  RETURN_IF_ERROR(In("welcome", r.ExpectEnd("welcome")));
  return welcome;
}

std::string EncodeChunk(const StagedChunkMessage& chunk) {
  std::string out;
  out.reserve(36 + 16 * chunk.pieces.size());
  ByteWriter w(&out);
  w.U64(chunk.seq);
  w.U32(chunk.index);
  w.U32(chunk.count);
  w.U32(chunk.slot);
  w.U64(chunk.region_id);
  w.U32(static_cast<uint32_t>(chunk.pieces.size()));
  for (const StagedChunkPiece& p : chunk.pieces) {
    w.U64(p.remote_offset);
    w.U64(p.length);
  }
  return out;
}

absl::StatusOr<StagedChunkMessage> DecodeChunk(absl::string_view body) {
  ByteReader r(body);
  StagedChunkMessage c;
  uint32_t n = 0;
  RETURN_IF_ERROR(In("chunk", r.U64("seq", &c.seq)));
  RETURN_IF_ERROR(In("chunk", r.U32("chunk index", &c.index)));
  RETURN_IF_ERROR(In("chunk", r.U32("chunk count", &c.count)));
  RETURN_IF_ERROR(In("chunk", r.U32("slot", &c.slot)));
  RETURN_IF_ERROR(In("chunk", r.U64("region id", &c.region_id)));
  RETURN_IF_ERROR(In("chunk", r.Count("pieces", kMaxStagedPiecesPerChunk, 16, &n)));
  c.pieces.resize(n);
  for (StagedChunkPiece& p : c.pieces) {
    RETURN_IF_ERROR(In("chunk", r.U64("remote offset", &p.remote_offset)));
    RETURN_IF_ERROR(In("chunk", r.U64("length", &p.length)));
  }
  RETURN_IF_ERROR(In("chunk", r.ExpectEnd("chunk")));
  if (c.count == 0 || c.index >= c.count) {
    return absl::InvalidArgumentError(absl::StrCat("UCX staged chunk: index ", c.index,
                                                   " of ", c.count, " chunks"));
  }
  if (n == 0) return absl::InvalidArgumentError("UCX staged chunk: no pieces");
  return c;
}

std::string EncodeCredits(const std::vector<uint32_t>& slots) {
  std::string out;
  ByteWriter w(&out);
  w.U32(static_cast<uint32_t>(slots.size()));
  for (uint32_t s : slots) w.U32(s);
  return out;
}

absl::StatusOr<std::vector<uint32_t>> DecodeCredits(absl::string_view body) {
  ByteReader r(body);
  uint32_t n = 0;
  RETURN_IF_ERROR(In("credit", r.Count("slots", kMaxStagedCredits, 4, &n)));
  std::vector<uint32_t> slots(n);
  for (uint32_t& s : slots) RETURN_IF_ERROR(In("credit", r.U32("slot", &s)));
  RETURN_IF_ERROR(In("credit", r.ExpectEnd("credit")));
  return slots;
}

std::string EncodeAbort(const StagedAbort& abort) {
  std::string out;
  ByteWriter w(&out);
  w.U64(abort.seq);
  w.U32(abort.chunks_sent);
  return out;
}

absl::StatusOr<StagedAbort> DecodeAbort(absl::string_view body) {
  ByteReader r(body);
  StagedAbort a;
  RETURN_IF_ERROR(In("abort", r.U64("seq", &a.seq)));
  RETURN_IF_ERROR(In("abort", r.U32("chunks sent", &a.chunks_sent)));
  RETURN_IF_ERROR(In("abort", r.ExpectEnd("abort")));
  return a;
}

}  // namespace internal
}  // namespace kvstream
