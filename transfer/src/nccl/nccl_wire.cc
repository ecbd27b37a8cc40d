// The nccl transport's wire formats (nccl_wire.h).
#include "nccl/nccl_wire.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "kvstream/common/byte_io.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {
namespace {

constexpr uint32_t kPeerInfoMagic = 0x494E564B;    // "KVNI"
constexpr uint32_t kDescriptorMagic = 0x444E564B;  // "KVND"
constexpr uint16_t kPeerInfoVersion = 1;
constexpr uint16_t kDescriptorVersion = 1;

absl::Status CheckHead(ByteReader& r, uint32_t magic, uint16_t version, absl::string_view what) {
  uint32_t got_magic = 0;
  RETURN_IF_ERROR(r.U32(absl::StrCat(what, " magic"), &got_magic));
  if (got_magic != magic) {
    return absl::InvalidArgumentError(
        absl::StrCat("not an nccl ", what, " (magic ", absl::Hex(got_magic), ")"));
  }
  uint16_t got_version = 0;
  RETURN_IF_ERROR(r.U16(absl::StrCat(what, " version"), &got_version));
  if (got_version != version) {
    return absl::InvalidArgumentError(absl::StrCat("nccl ", what, " version ", got_version,
                                                   " (this build reads version ", version, ")"));
  }
  return absl::OkStatus();
}

// Decoding errors all read "malformed nccl <what>: <why>".
template <typename T>
absl::StatusOr<T> Wrap(absl::StatusOr<T> decoded, absl::string_view what) {
  if (decoded.ok()) return decoded;
  return absl::InvalidArgumentError(
      absl::StrCat("malformed nccl ", what, ": ", decoded.status().message()));
}

void PutString(ByteWriter& w, absl::string_view s) {
  w.U32(static_cast<uint32_t>(s.size()));
  w.Raw(s);
}

// A fixed-size field, padded or cut to `n` bytes (the encoders' inputs are ours).
void PutFixed(ByteWriter& w, const std::string& s, size_t n) {
  std::string fixed = s;
  fixed.resize(n, '\0');
  w.Raw(fixed);
}

absl::StatusOr<NcclPeerInfo> PeerInfoFields(absl::string_view bytes) {
  ByteReader r(bytes);
  RETURN_IF_ERROR(CheckHead(r, kPeerInfoMagic, kPeerInfoVersion, "peer info"));
  NcclPeerInfo info;
  RETURN_IF_ERROR(r.U64("uid", &info.uid));
  RETURN_IF_ERROR(r.U32("pid", &info.pid));
  RETURN_IF_ERROR(r.Bytes("job id", kMaxNcclJobIdBytes, &info.job_id));
  RETURN_IF_ERROR(r.U32("NCCL version", &info.nccl_version));
  RETURN_IF_ERROR(r.I32("device", &info.device));
  RETURN_IF_ERROR(r.Raw("device uuid", kNcclUuidBytes, &info.device_uuid));
  RETURN_IF_ERROR(r.Bytes("host", kMaxNcclHostBytes, &info.host));
  RETURN_IF_ERROR(r.U16("port", &info.port));
  RETURN_IF_ERROR(r.ExpectEnd("peer info"));
  if (info.uid == 0) return absl::InvalidArgumentError("uid is 0");
  if (info.device < 0) return absl::InvalidArgumentError(absl::StrCat("device ", info.device));
  if (info.host.empty() || info.host.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError("host is empty or holds a NUL");
  }
  if (info.port == 0) return absl::InvalidArgumentError("port is 0");
  return info;
}

absl::StatusOr<NcclMemoryDescriptor> DescriptorFields(absl::string_view bytes) {
  ByteReader r(bytes);
  RETURN_IF_ERROR(CheckHead(r, kDescriptorMagic, kDescriptorVersion, "memory descriptor"));
  NcclMemoryDescriptor d;
  RETURN_IF_ERROR(r.U64("owner uid", &d.owner_uid));
  RETURN_IF_ERROR(r.U64("region id", &d.region_id));
  RETURN_IF_ERROR(r.U64("length", &d.length));
  RETURN_IF_ERROR(r.I32("device", &d.device));
  RETURN_IF_ERROR(r.ExpectEnd("memory descriptor"));
  if (d.owner_uid == 0) return absl::InvalidArgumentError("owner uid is 0");
  if (d.region_id == 0) return absl::InvalidArgumentError("region id is 0");
  if (d.length == 0) return absl::InvalidArgumentError("length is 0");
  if (d.device < 0) return absl::InvalidArgumentError(absl::StrCat("device ", d.device));
  return d;
}

absl::StatusOr<NcclHello> HelloFields(absl::string_view payload) {
  ByteReader r(payload);
  NcclHello h;
  RETURN_IF_ERROR(r.U64("uid", &h.uid));
  RETURN_IF_ERROR(r.U32("pid", &h.pid));
  RETURN_IF_ERROR(r.Bytes("job id", kMaxNcclJobIdBytes, &h.job_id));
  RETURN_IF_ERROR(r.U32("NCCL version", &h.nccl_version));
  RETURN_IF_ERROR(r.Raw("device uuid", kNcclUuidBytes, &h.device_uuid));
  RETURN_IF_ERROR(r.Raw("unique id", kNcclUniqueIdBytes, &h.unique_id));
  RETURN_IF_ERROR(r.ExpectEnd("hello"));
  if (h.uid == 0) return absl::InvalidArgumentError("uid is 0");
  return h;
}

absl::StatusOr<NcclWelcome> WelcomeFields(absl::string_view payload) {
  ByteReader r(payload);
  NcclWelcome w;
  uint8_t ok = 0;
  RETURN_IF_ERROR(r.U8("verdict", &ok));
  if (ok > 1) return absl::InvalidArgumentError(absl::StrCat("verdict ", int{ok}));
  w.ok = ok == 1;
  if (w.ok) {
    RETURN_IF_ERROR(r.U64("max staged bytes", &w.max_staged_bytes));
    if (w.max_staged_bytes == 0) return absl::InvalidArgumentError("max staged bytes is 0");
    RETURN_IF_ERROR(r.U32("max pieces", &w.max_pieces));
    if (w.max_pieces == 0 || w.max_pieces > kMaxNcclPiecesPerBatch) {
      return absl::InvalidArgumentError(absl::StrCat("max pieces ", w.max_pieces, " (1..",
                                                     kMaxNcclPiecesPerBatch, ")"));
    }
  } else {
    RETURN_IF_ERROR(r.Bytes("reason", kMaxNcclReasonBytes, &w.reason));
  }
  RETURN_IF_ERROR(r.ExpectEnd("welcome"));
  return w;
}

absl::StatusOr<NcclBatchHeader> BatchFields(absl::string_view payload) {
  ByteReader r(payload);
  NcclBatchHeader h;
  RETURN_IF_ERROR(r.U64("serial", &h.serial));
  RETURN_IF_ERROR(r.U64("region id", &h.region_id));
  if (h.region_id == 0) return absl::InvalidArgumentError("region id is 0");
  uint32_t messages = 0;
  RETURN_IF_ERROR(r.Count("message", kMaxNcclMessagesPerBatch, sizeof(uint32_t), &messages));
  if (messages == 0) return absl::InvalidArgumentError("no message");
  h.message_pieces.resize(messages);
  uint64_t sum = 0;
  for (uint32_t i = 0; i < messages; ++i) {
    RETURN_IF_ERROR(r.U32("message piece count", &h.message_pieces[i]));
    if (h.message_pieces[i] == 0) {
      return absl::InvalidArgumentError(absl::StrCat("message ", i, " has no piece"));
    }
    sum += h.message_pieces[i];
  }
  uint32_t pieces = 0;
  RETURN_IF_ERROR(r.Count("piece", kMaxNcclPiecesPerBatch, 2 * sizeof(uint64_t), &pieces));
  if (sum != pieces) {
    return absl::InvalidArgumentError(
        absl::StrCat("the messages name ", sum, " pieces, the batch holds ", pieces));
  }
  h.pieces.resize(pieces);
  size_t next = 0;
  for (uint32_t m = 0; m < messages; ++m) {
    uint64_t bytes = 0;
    for (uint32_t k = 0; k < h.message_pieces[m]; ++k, ++next) {
      NcclRemotePiece& p = h.pieces[next];
      RETURN_IF_ERROR(r.U64("piece offset", &p.offset));
      RETURN_IF_ERROR(r.U64("piece length", &p.length));
      if (p.length == 0) return absl::InvalidArgumentError(absl::StrCat("piece ", next, " is empty"));
      if (p.length > std::numeric_limits<uint64_t>::max() - bytes) {
        return absl::InvalidArgumentError(absl::StrCat("message ", m, "'s length overflows"));
      }
      bytes += p.length;
    }
  }
  RETURN_IF_ERROR(r.ExpectEnd("batch"));
  return h;
}

}  // namespace

std::string EncodeNcclPeerInfo(const NcclPeerInfo& info) {
  std::string out;
  ByteWriter w(&out);
  w.U32(kPeerInfoMagic);
  w.U16(kPeerInfoVersion);
  w.U64(info.uid);
  w.U32(info.pid);
  PutString(w, info.job_id);
  w.U32(info.nccl_version);
  w.I32(info.device);
  PutFixed(w, info.device_uuid, kNcclUuidBytes);
  PutString(w, info.host);
  w.U16(info.port);
  return out;
}

absl::StatusOr<NcclPeerInfo> DecodeNcclPeerInfo(absl::string_view bytes) {
  return Wrap(PeerInfoFields(bytes), "peer info");
}

std::string EncodeNcclDescriptor(const NcclMemoryDescriptor& d) {
  std::string out;
  ByteWriter w(&out);
  w.U32(kDescriptorMagic);
  w.U16(kDescriptorVersion);
  w.U64(d.owner_uid);
  w.U64(d.region_id);
  w.U64(d.length);
  w.I32(d.device);
  return out;
}

absl::StatusOr<NcclMemoryDescriptor> DecodeNcclDescriptor(absl::string_view bytes) {
  return Wrap(DescriptorFields(bytes), "memory descriptor");
}

std::string EncodeNcclHello(const NcclHello& h) {
  std::string out;
  ByteWriter w(&out);
  w.U64(h.uid);
  w.U32(h.pid);
  PutString(w, h.job_id);
  w.U32(h.nccl_version);
  PutFixed(w, h.device_uuid, kNcclUuidBytes);
  PutFixed(w, h.unique_id, kNcclUniqueIdBytes);
  return out;
}

absl::StatusOr<NcclHello> DecodeNcclHello(absl::string_view payload) {
  return Wrap(HelloFields(payload), "hello");
}

std::string EncodeNcclWelcome(const NcclWelcome& welcome) {
  std::string out;
  ByteWriter w(&out);
  w.U8(welcome.ok ? 1 : 0);
  if (welcome.ok) {
    w.U64(welcome.max_staged_bytes);
    w.U32(welcome.max_pieces);
  } else {
    PutString(w, absl::string_view(welcome.reason).substr(0, kMaxNcclReasonBytes));
  }
  return out;
}

absl::StatusOr<NcclWelcome> DecodeNcclWelcome(absl::string_view payload) {
  return Wrap(WelcomeFields(payload), "welcome");
}

std::string EncodeNcclBatch(const NcclBatchHeader& h) {
  std::string out;
  out.reserve(32 + 4 * h.message_pieces.size() + 16 * h.pieces.size());
  ByteWriter w(&out);
  w.U64(h.serial);
  w.U64(h.region_id);
  w.U32(static_cast<uint32_t>(h.message_pieces.size()));
  for (uint32_t n : h.message_pieces) w.U32(n);
  w.U32(static_cast<uint32_t>(h.pieces.size()));
  for (const NcclRemotePiece& p : h.pieces) {
    w.U64(p.offset);
    w.U64(p.length);
  }
  return out;
}

absl::StatusOr<NcclBatchHeader> DecodeNcclBatch(absl::string_view payload) {
  return Wrap(BatchFields(payload), "batch");
}

}  // namespace internal
}  // namespace kvstream
