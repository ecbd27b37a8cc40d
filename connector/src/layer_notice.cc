// Encoding and strict decoding of layer notices (layer_notice.h).
#include "layer_notice.h"

#include "absl/strings/str_cat.h"
#include "kvstream/common/byte_io.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/transfer/wire.h"

namespace kvstream {
namespace internal {
namespace {

constexpr uint32_t kNoticeMagic = 0x334E564B;  // bytes "KVN3"
constexpr uint32_t kStopMagic = 0x3153564B;    // bytes "KVS1"

// The notice's first field; InvalidArgument unless it is `magic`.
absl::Status ExpectMagic(ByteReader& r, uint32_t magic, absl::string_view what) {
  uint32_t got = 0;
  RETURN_IF_ERROR(r.U32(absl::StrCat(what, " magic"), &got));
  if (got != magic) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": bad magic (not a kvstream ", what, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> EncodeLayerNoticeHead(const LayerNotice& n) {
  std::string out;
  ByteWriter w(&out);
  w.U32(kNoticeMagic);
  RETURN_IF_ERROR(w.Bytes("layer notice request id", n.request_id, kMaxIdBytes));
  w.U64(n.attempt);
  w.U32(n.layer);
  w.U64(n.bytes);
  w.U8(static_cast<uint8_t>(n.checksum_kind));
  w.U64(n.post_ns);
  return out;
}

absl::StatusOr<std::string> EncodeLayerNotice(const LayerNotice& n) {
  ASSIGN_OR_RETURN(std::string out, EncodeLayerNoticeHead(n));
  ByteWriter(&out).U64(n.checksum);
  return out;
}

absl::StatusOr<LayerNotice> DecodeLayerNotice(absl::string_view payload) {
  ByteReader r(payload);
  RETURN_IF_ERROR(ExpectMagic(r, kNoticeMagic, "layer notice"));
  LayerNotice n;
  RETURN_IF_ERROR(r.Bytes("layer notice request id", kMaxIdBytes, &n.request_id));
  RETURN_IF_ERROR(r.U64("layer notice attempt", &n.attempt));
  RETURN_IF_ERROR(r.U32("layer notice layer", &n.layer));
  RETURN_IF_ERROR(r.U64("layer notice bytes", &n.bytes));
  uint8_t kind = 0;
  RETURN_IF_ERROR(r.U8("layer notice checksum kind", &kind));
  if (kind > static_cast<uint8_t>(ChecksumKind::kKvsum64)) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer notification: unknown checksum kind ", int(kind)));
  }
  n.checksum_kind = static_cast<ChecksumKind>(kind);
  RETURN_IF_ERROR(r.U64("layer notice post time", &n.post_ns));
  RETURN_IF_ERROR(r.U64("layer notice checksum", &n.checksum));
  RETURN_IF_ERROR(r.ExpectEnd("layer notice"));
  return n;
}

absl::StatusOr<std::string> EncodeStopNotice(const StopNotice& n) {
  std::string out;
  ByteWriter w(&out);
  w.U32(kStopMagic);
  RETURN_IF_ERROR(w.Bytes("stop notice request id", n.request_id, kMaxIdBytes));
  w.U64(n.attempt);
  RETURN_IF_ERROR(w.Bytes("stop notice reason", n.reason, kMaxStopReasonBytes));
  return out;
}

bool IsStopNotice(absl::string_view payload) {
  ByteReader r(payload);
  return ExpectMagic(r, kStopMagic, "stop notice").ok();
}

absl::StatusOr<StopNotice> DecodeStopNotice(absl::string_view payload) {
  ByteReader r(payload);
  RETURN_IF_ERROR(ExpectMagic(r, kStopMagic, "stop notice"));
  StopNotice n;
  RETURN_IF_ERROR(r.Bytes("stop notice request id", kMaxIdBytes, &n.request_id));
  RETURN_IF_ERROR(r.U64("stop notice attempt", &n.attempt));
  RETURN_IF_ERROR(r.Bytes("stop notice reason", kMaxStopReasonBytes, &n.reason));
  RETURN_IF_ERROR(r.ExpectEnd("stop notice"));
  return n;
}

}  // namespace internal
}  // namespace kvstream
