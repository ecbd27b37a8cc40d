// Encoding and strict decoding of the UCX transport's worker info, memory descriptors and
// notification headers (format in ucx_wire.h), over common/byte_io.h.
#include "ucx/ucx_wire.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvstream/common/byte_io.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {
namespace {

constexpr uint32_t kWorkerInfoMagic = 0x57555653;    // bytes "SVUW"
constexpr uint32_t kDescriptorMagic = 0x4D555653;    // bytes "SVUM"
constexpr uint32_t kNotificationMagic = 0x4E555653;  // bytes "SVUN"
constexpr uint32_t kWriteMagic = 0x44555653;         // bytes "SVUD"

// Prefixes a ByteReader's error with what was being decoded.
absl::Status In(absl::string_view what, absl::Status status) {
  if (status.ok()) return status;
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", status.message()));
}

// Checks magic, version and the reserved field.
absl::Status ReadPreamble(ByteReader& r, uint32_t magic, absl::string_view what) {
  uint32_t m = 0;
  uint16_t version = 0, reserved = 0;
  RETURN_IF_ERROR(In(what, r.U32("magic", &m)));
  if (m != magic) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": wrong magic (not a ", what, ")"));
  }
  RETURN_IF_ERROR(In(what, r.U16("version", &version)));
  if (version != kUcxWireVersion) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": unsupported version ", version,
                                                   " (this build reads version ",
                                                   kUcxWireVersion, ")"));
  }
  RETURN_IF_ERROR(In(what, r.U16("reserved", &reserved)));
  if (reserved != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": reserved field is not zero"));
  }
  return absl::OkStatus();
}

// Checks the trailing checksum over everything before it and that nothing follows.
absl::Status ReadChecksum(ByteReader& r, absl::string_view bytes, absl::string_view what) {
  const size_t covered = r.position();
  uint64_t sum = 0;
  RETURN_IF_ERROR(In(what, r.U64("checksum", &sum)));
  RETURN_IF_ERROR(In(what, r.ExpectEnd(what)));
  if (sum != UcxChecksum(bytes.substr(0, covered))) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": checksum mismatch (garbled)"));
  }
  return absl::OkStatus();
}

void PutChecksum(std::string& out) {
  const uint64_t sum = UcxChecksum(out);
  ByteWriter(&out).U64(sum);
}

}  // namespace

uint64_t UcxChecksum(absl::string_view bytes) {
  uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a-64
  for (unsigned char c : bytes) {
    hash ^= c;
    hash *= 0x100000001b3ull;
  }
  return hash;
}

void PutUcxPreamble(std::string& out, uint32_t magic) {
  ByteWriter w(&out);
  w.U32(magic);
  w.U16(kUcxWireVersion);
  w.U16(0);
}

std::string EncodeWorkerInfo(const UcxWorkerInfo& info) {
  std::string out;
  PutUcxPreamble(out, kWorkerInfoMagic);
  ByteWriter w(&out);
  w.U64(info.uid);
  w.U64(info.fence_epoch);
  w.U32(static_cast<uint32_t>(info.address.size()));
  w.Raw(info.address);
  PutChecksum(out);
  return out;
}

absl::StatusOr<UcxWorkerInfo> DecodeWorkerInfo(absl::string_view bytes) {
  constexpr absl::string_view kWhat = "UCX worker info";
  ByteReader r(bytes);
  RETURN_IF_ERROR(ReadPreamble(r, kWorkerInfoMagic, kWhat));
  UcxWorkerInfo info;
  RETURN_IF_ERROR(In(kWhat, r.U64("uid", &info.uid)));
  RETURN_IF_ERROR(In(kWhat, r.U64("fence epoch", &info.fence_epoch)));
  RETURN_IF_ERROR(In(kWhat, r.Bytes("worker address", kMaxUcxAddressBytes, &info.address)));
  if (info.address.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": empty worker address"));
  }
  RETURN_IF_ERROR(ReadChecksum(r, bytes, kWhat));
  return info;
}

std::string EncodeMemoryDescriptor(const UcxMemoryDescriptor& d) {
  std::string out;
  PutUcxPreamble(out, kDescriptorMagic);
  ByteWriter w(&out);
  w.U8(static_cast<uint8_t>(d.kind));
  w.U8(0);
  w.U16(0);
  w.U64(d.address);
  w.U64(d.length);
  w.U64(d.region_id);
  w.U32(static_cast<uint32_t>(d.rkey.size()));
  w.Raw(d.rkey);
  PutChecksum(out);
  return out;
}

absl::StatusOr<UcxMemoryDescriptor> DecodeMemoryDescriptor(absl::string_view bytes) {
  constexpr absl::string_view kWhat = "UCX memory descriptor";
  ByteReader r(bytes);
  RETURN_IF_ERROR(ReadPreamble(r, kDescriptorMagic, kWhat));
  UcxMemoryDescriptor d;
  uint8_t kind = 0, reserved8 = 0;
  uint16_t reserved16 = 0;
  RETURN_IF_ERROR(In(kWhat, r.U8("kind", &kind)));
  RETURN_IF_ERROR(In(kWhat, r.U8("reserved", &reserved8)));
  RETURN_IF_ERROR(In(kWhat, r.U16("reserved", &reserved16)));
  RETURN_IF_ERROR(In(kWhat, r.U64("address", &d.address)));
  RETURN_IF_ERROR(In(kWhat, r.U64("length", &d.length)));
  RETURN_IF_ERROR(In(kWhat, r.U64("region id", &d.region_id)));
  RETURN_IF_ERROR(In(kWhat, r.Bytes("rkey", kMaxUcxRkeyBytes, &d.rkey)));
  RETURN_IF_ERROR(ReadChecksum(r, bytes, kWhat));
  if (reserved8 != 0 || reserved16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": reserved field is not zero"));
  }
  if (kind == static_cast<uint8_t>(UcxRegionKind::kHost)) {
    d.kind = UcxRegionKind::kHost;
    if (d.rkey.empty() || d.region_id != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          kWhat, ": a host region needs an rkey and region id 0 (rkey ", d.rkey.size(),
          " bytes, region id ", d.region_id, ")"));
    }
  } else if (kind == static_cast<uint8_t>(UcxRegionKind::kDevice)) {
    d.kind = UcxRegionKind::kDevice;
    if (!d.rkey.empty() || d.region_id == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          kWhat, ": a device region carries no rkey and a non-zero region id (rkey ",
          d.rkey.size(), " bytes, region id ", d.region_id, ")"));
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": unknown memory kind ",
                                                   static_cast<int>(kind)));
  }
  if (d.length == 0 || d.address > UINT64_MAX - d.length) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": bad region (address ", d.address,
                                                   ", length ", d.length, ")"));
  }
  return d;
}

NotificationHeader EncodeNotificationHeader(uint64_t sender_uid, uint64_t stamp,
                                            uint64_t watermark) {
  std::string out;
  PutUcxPreamble(out, kNotificationMagic);
  ByteWriter w(&out);
  w.U64(sender_uid);
  w.U64(stamp);
  w.U64(watermark);
  NotificationHeader header;
  std::memcpy(header.data(), out.data(), header.size());
  return header;
}

absl::StatusOr<NotificationHeaderFields> DecodeNotificationHeader(absl::string_view bytes) {
  constexpr absl::string_view kWhat = "UCX notification header";
  ByteReader r(bytes);
  RETURN_IF_ERROR(ReadPreamble(r, kNotificationMagic, kWhat));
  NotificationHeaderFields fields;
  RETURN_IF_ERROR(In(kWhat, r.U64("uid", &fields.sender_uid)));
  RETURN_IF_ERROR(In(kWhat, r.U64("stamp", &fields.stamp)));
  RETURN_IF_ERROR(In(kWhat, r.U64("watermark", &fields.watermark)));
  RETURN_IF_ERROR(In(kWhat, r.ExpectEnd(kWhat)));
  return fields;
}

WriteHeader EncodeWriteHeader(uint64_t sender_uid, uint64_t stamp, uint64_t address) {
  std::string out;
  PutUcxPreamble(out, kWriteMagic);
  ByteWriter w(&out);
  w.U64(sender_uid);
  w.U64(stamp);
  w.U64(address);
  WriteHeader header;
  std::memcpy(header.data(), out.data(), header.size());
  return header;
}

absl::StatusOr<WriteHeaderFields> DecodeWriteHeader(absl::string_view bytes) {
  constexpr absl::string_view kWhat = "UCX write header";
  ByteReader r(bytes);
  RETURN_IF_ERROR(ReadPreamble(r, kWriteMagic, kWhat));
  WriteHeaderFields fields;
  RETURN_IF_ERROR(In(kWhat, r.U64("uid", &fields.sender_uid)));
  RETURN_IF_ERROR(In(kWhat, r.U64("stamp", &fields.stamp)));
  RETURN_IF_ERROR(In(kWhat, r.U64("address", &fields.address)));
  RETURN_IF_ERROR(In(kWhat, r.ExpectEnd(kWhat)));
  return fields;
}

}  // namespace internal
}  // namespace kvstream
