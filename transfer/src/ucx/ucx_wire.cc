// Encoding and strict decoding of the UCX transport's worker info, memory descriptors and
// notification headers (format in ucx_wire.h).
#include "ucx/ucx_wire.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {
namespace {

constexpr uint32_t kWorkerInfoMagic = 0x57555653;    // bytes "SVUW"
constexpr uint32_t kDescriptorMagic = 0x4D555653;    // bytes "SVUM"
constexpr uint32_t kNotificationMagic = 0x4E555653;  // bytes "SVUN"
constexpr size_t kPreambleBytes = 8;
constexpr size_t kChecksumBytes = 8;

uint64_t Fnv1a64(absl::string_view bytes) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    hash ^= c;
    hash *= 0x100000001b3ull;
  }
  return hash;
}

void PutLe(std::string& out, uint64_t value, size_t bytes) {
  for (size_t i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

// Reads little-endian integers and blobs from a byte string, failing (never reading past
// the end) when the input is too short.
class Reader {
 public:
  Reader(absl::string_view bytes, absl::string_view what) : bytes_(bytes), what_(what) {}

  absl::StatusOr<uint64_t> Int(size_t width, absl::string_view field) {
    if (bytes_.size() - pos_ < width) return Truncated(field);
    uint64_t value = 0;
    for (size_t i = 0; i < width; ++i) {
      value |= static_cast<uint64_t>(static_cast<unsigned char>(bytes_[pos_ + i])) << (8 * i);
    }
    pos_ += width;
    return value;
  }

  absl::StatusOr<std::string> Blob(uint32_t max_bytes, absl::string_view field) {
    ASSIGN_OR_RETURN(uint64_t n, Int(4, field));
    if (n == 0 || n > max_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(what_, ": ", field, " length ", n, " is outside [1, ", max_bytes, "]"));
    }
    if (bytes_.size() - pos_ < n) return Truncated(field);
    std::string blob(bytes_.substr(pos_, n));
    pos_ += n;
    return blob;
  }

  // Checks magic, version and the reserved field.
  absl::Status Preamble(uint32_t magic) {
    ASSIGN_OR_RETURN(uint64_t m, Int(4, "magic"));
    if (m != magic) {
      return absl::InvalidArgumentError(absl::StrCat(what_, ": wrong magic (not a ", what_, ")"));
    }
    ASSIGN_OR_RETURN(uint64_t version, Int(2, "version"));
    if (version != kUcxWireVersion) {
      return absl::InvalidArgumentError(absl::StrCat(what_, ": unsupported version ", version,
                                                     " (this build reads version ",
                                                     kUcxWireVersion, ")"));
    }
    ASSIGN_OR_RETURN(uint64_t reserved, Int(2, "reserved"));
    if (reserved != 0) {
      return absl::InvalidArgumentError(absl::StrCat(what_, ": reserved field is not zero"));
    }
    return absl::OkStatus();
  }

  // Checks the trailing checksum over everything before it and that nothing follows.
  absl::Status Checksum() {
    const size_t covered = pos_;
    ASSIGN_OR_RETURN(uint64_t sum, Int(kChecksumBytes, "checksum"));
    if (pos_ != bytes_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what_, ": ", bytes_.size() - pos_, " trailing bytes"));
    }
    if (sum != Fnv1a64(bytes_.substr(0, covered))) {
      return absl::InvalidArgumentError(absl::StrCat(what_, ": checksum mismatch (garbled)"));
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Truncated(absl::string_view field) const {
    return absl::InvalidArgumentError(absl::StrCat(what_, ": truncated at ", field, " (",
                                                   bytes_.size(), " bytes)"));
  }

  absl::string_view bytes_;
  absl::string_view what_;
  size_t pos_ = 0;
};

void PutPreamble(std::string& out, uint32_t magic) {
  PutLe(out, magic, 4);
  PutLe(out, kUcxWireVersion, 2);
  PutLe(out, 0, 2);
}

void PutChecksum(std::string& out) { PutLe(out, Fnv1a64(out), kChecksumBytes); }

}  // namespace

std::string EncodeWorkerInfo(const UcxWorkerInfo& info) {
  std::string out;
  out.reserve(kPreambleBytes + 12 + info.address.size() + kChecksumBytes);
  PutPreamble(out, kWorkerInfoMagic);
  PutLe(out, info.uid, 8);
  PutLe(out, info.address.size(), 4);
  out += info.address;
  PutChecksum(out);
  return out;
}

absl::StatusOr<UcxWorkerInfo> DecodeWorkerInfo(absl::string_view bytes) {
  Reader reader(bytes, "UCX worker info");
  RETURN_IF_ERROR(reader.Preamble(kWorkerInfoMagic));
  UcxWorkerInfo info;
  ASSIGN_OR_RETURN(info.uid, reader.Int(8, "uid"));
  ASSIGN_OR_RETURN(info.address, reader.Blob(kMaxUcxAddressBytes, "worker address"));
  RETURN_IF_ERROR(reader.Checksum());
  return info;
}

std::string EncodeMemoryDescriptor(const UcxMemoryDescriptor& descriptor) {
  std::string out;
  out.reserve(kPreambleBytes + 20 + descriptor.rkey.size() + kChecksumBytes);
  PutPreamble(out, kDescriptorMagic);
  PutLe(out, descriptor.address, 8);
  PutLe(out, descriptor.length, 8);
  PutLe(out, descriptor.rkey.size(), 4);
  out += descriptor.rkey;
  PutChecksum(out);
  return out;
}

absl::StatusOr<UcxMemoryDescriptor> DecodeMemoryDescriptor(absl::string_view bytes) {
  Reader reader(bytes, "UCX memory descriptor");
  RETURN_IF_ERROR(reader.Preamble(kDescriptorMagic));
  UcxMemoryDescriptor d;
  ASSIGN_OR_RETURN(d.address, reader.Int(8, "address"));
  ASSIGN_OR_RETURN(d.length, reader.Int(8, "length"));
  ASSIGN_OR_RETURN(d.rkey, reader.Blob(kMaxUcxRkeyBytes, "rkey"));
  RETURN_IF_ERROR(reader.Checksum());
  if (d.length == 0 || d.address > UINT64_MAX - d.length) {
    return absl::InvalidArgumentError(absl::StrCat("UCX memory descriptor: bad region (address ",
                                                   d.address, ", length ", d.length, ")"));
  }
  return d;
}

NotificationHeader EncodeNotificationHeader(uint64_t sender_uid) {
  std::string out;
  PutPreamble(out, kNotificationMagic);
  PutLe(out, sender_uid, 8);
  NotificationHeader header;
  std::memcpy(header.data(), out.data(), header.size());
  return header;
}

absl::StatusOr<uint64_t> DecodeNotificationHeader(absl::string_view bytes) {
  Reader reader(bytes, "UCX notification header");
  RETURN_IF_ERROR(reader.Preamble(kNotificationMagic));
  ASSIGN_OR_RETURN(uint64_t uid, reader.Int(8, "uid"));
  if (bytes.size() != kNotificationHeaderBytes) {
    return absl::InvalidArgumentError("UCX notification header: wrong size");
  }
  return uid;
}

}  // namespace internal
}  // namespace kvstream
