// The cuda_ipc transport's wire formats (cuda_ipc_wire.h).
#include "cuda_ipc/cuda_ipc_wire.h"

#include "absl/strings/str_cat.h"
#include "kvstream/common/byte_io.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/transfer/socket.h"

namespace kvstream {
namespace internal {
namespace {

constexpr uint32_t kDescriptorMagic = 0x4449564B;  // "KVID"
constexpr uint32_t kPeerInfoMagic = 0x4949564B;    // "KVII"
constexpr uint16_t kDescriptorVersion = 1;
constexpr uint16_t kPeerInfoVersion = 1;

absl::Status CheckMagic(ByteReader& r, uint32_t want, absl::string_view what) {
  uint32_t magic = 0;
  RETURN_IF_ERROR(r.U32(absl::StrCat(what, " magic"), &magic));
  if (magic != want) {
    return absl::InvalidArgumentError(absl::StrCat("not a cuda_ipc ", what, " (magic ",
                                                   absl::Hex(magic), ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckVersion(ByteReader& r, uint16_t want, absl::string_view what) {
  uint16_t version = 0;
  RETURN_IF_ERROR(r.U16(absl::StrCat(what, " version"), &version));
  if (version != want) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc ", what, " version ", version,
                                                   " (this build reads version ", want, ")"));
  }
  return absl::OkStatus();
}

absl::Status Wrap(const absl::Status& status, absl::string_view what) {
  if (status.ok()) return status;
  return absl::InvalidArgumentError(absl::StrCat("malformed cuda_ipc ", what, ": ",
                                                 status.message()));
}

absl::StatusOr<CudaIpcMemoryDescriptor> DecodeDescriptorFields(absl::string_view bytes) {
  ByteReader r(bytes);
  RETURN_IF_ERROR(CheckMagic(r, kDescriptorMagic, "memory descriptor"));
  RETURN_IF_ERROR(CheckVersion(r, kDescriptorVersion, "memory descriptor"));
  CudaIpcMemoryDescriptor d;
  RETURN_IF_ERROR(r.U64("owner uid", &d.owner_uid));
  RETURN_IF_ERROR(r.I32("device", &d.device));
  RETURN_IF_ERROR(r.Raw("device uuid", kCudaUuidBytes, &d.device_uuid));
  RETURN_IF_ERROR(r.Raw("ipc handle", kCudaIpcHandleBytes, &d.ipc_handle));
  RETURN_IF_ERROR(r.U64("allocation size", &d.allocation_size));
  RETURN_IF_ERROR(r.U64("offset", &d.offset));
  RETURN_IF_ERROR(r.U64("length", &d.length));
  RETURN_IF_ERROR(r.ExpectEnd("memory descriptor"));
  if (d.owner_uid == 0) return absl::InvalidArgumentError("owner uid is 0");
  if (d.device < 0) return absl::InvalidArgumentError(absl::StrCat("device ", d.device));
  if (d.length == 0) return absl::InvalidArgumentError("length is 0");
  if (d.offset > d.allocation_size || d.length > d.allocation_size - d.offset) {
    return absl::InvalidArgumentError(absl::StrCat("region at offset ", d.offset, " of ",
                                                   d.length, " bytes is outside its allocation of ",
                                                   d.allocation_size, " bytes"));
  }
  return d;
}

absl::StatusOr<CudaIpcPeerInfo> DecodePeerInfoFields(absl::string_view bytes) {
  ByteReader r(bytes);
  RETURN_IF_ERROR(CheckMagic(r, kPeerInfoMagic, "peer info"));
  RETURN_IF_ERROR(CheckVersion(r, kPeerInfoVersion, "peer info"));
  CudaIpcPeerInfo info;
  RETURN_IF_ERROR(r.U64("uid", &info.uid));
  RETURN_IF_ERROR(r.U32("pid", &info.pid));
  RETURN_IF_ERROR(r.Bytes("socket name", kMaxUnixSocketNameBytes, &info.socket_name));
  RETURN_IF_ERROR(r.ExpectEnd("peer info"));
  if (info.uid == 0) return absl::InvalidArgumentError("uid is 0");
  if (info.socket_name.empty() || info.socket_name.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError("socket name is empty or holds a NUL");
  }
  return info;
}

}  // namespace

std::string EncodeCudaIpcDescriptor(const CudaIpcMemoryDescriptor& d) {
  std::string out;
  ByteWriter w(&out);
  w.U32(kDescriptorMagic);
  w.U16(kDescriptorVersion);
  w.U64(d.owner_uid);
  w.I32(d.device);
  std::string uuid = d.device_uuid;
  uuid.resize(kCudaUuidBytes, '\0');
  w.Raw(uuid);
  std::string handle = d.ipc_handle;
  handle.resize(kCudaIpcHandleBytes, '\0');
  w.Raw(handle);
  w.U64(d.allocation_size);
  w.U64(d.offset);
  w.U64(d.length);
  return out;
}

absl::StatusOr<CudaIpcMemoryDescriptor> DecodeCudaIpcDescriptor(absl::string_view bytes) {
  absl::StatusOr<CudaIpcMemoryDescriptor> d = DecodeDescriptorFields(bytes);
  if (!d.ok()) return Wrap(d.status(), "memory descriptor");
  return d;
}

std::string EncodeCudaIpcPeerInfo(const CudaIpcPeerInfo& info) {
  std::string out;
  ByteWriter w(&out);
  w.U32(kPeerInfoMagic);
  w.U16(kPeerInfoVersion);
  w.U64(info.uid);
  w.U32(info.pid);
  // The name is ours (bounded by construction); a longer one would fail decoding loudly.
  w.U32(static_cast<uint32_t>(info.socket_name.size()));
  w.Raw(info.socket_name);
  return out;
}

absl::StatusOr<CudaIpcPeerInfo> DecodeCudaIpcPeerInfo(absl::string_view bytes) {
  absl::StatusOr<CudaIpcPeerInfo> info = DecodePeerInfoFields(bytes);
  if (!info.ok()) return Wrap(info.status(), "peer info");
  return info;
}

std::string EncodeFrame(const FrameFormat& format, uint8_t type, absl::string_view payload) {
  std::string out;
  out.reserve(kIpcFrameHeaderBytes + payload.size());
  ByteWriter w(&out);
  w.U32(format.magic);
  w.U8(format.version);
  w.U8(type);
  w.U16(0);
  w.U32(static_cast<uint32_t>(payload.size()));
  w.Raw(payload);
  return out;
}

std::string EncodeIpcHello(const IpcHello& hello) {
  std::string out;
  ByteWriter w(&out);
  w.U64(hello.uid);
  w.U32(hello.pid);
  return out;
}

absl::StatusOr<IpcHello> DecodeIpcHello(absl::string_view payload) {
  ByteReader r(payload);
  IpcHello hello;
  absl::Status status = r.U64("hello uid", &hello.uid);
  if (status.ok()) status = r.U32("hello pid", &hello.pid);
  if (status.ok()) status = r.ExpectEnd("hello");
  if (status.ok() && hello.uid == 0) status = absl::InvalidArgumentError("hello uid is 0");
  if (!status.ok()) return Wrap(status, "hello frame");
  return hello;
}

void IpcFrameReader::Append(const char* data, size_t n) {
  // Drop consumed bytes once they are most of the buffer, so it does not grow without end.
  if (pos_ > 0 && pos_ >= buffer_.size() / 2) {
    buffer_.erase(0, pos_);
    pos_ = 0;
  }
  buffer_.append(data, n);
}

absl::StatusOr<bool> IpcFrameReader::NextFrame(uint8_t* type, std::string* payload) {
  if (buffered() < kIpcFrameHeaderBytes) return false;
  ByteReader r(absl::string_view(buffer_).substr(pos_, kIpcFrameHeaderBytes));
  uint32_t magic = 0;
  uint8_t version = 0;
  uint8_t raw_type = 0;
  uint16_t reserved = 0;
  uint32_t length = 0;
  // The header's size is checked above: these reads cannot fail.
  (void)r.U32("magic", &magic);
  (void)r.U8("version", &version);
  (void)r.U8("type", &raw_type);
  (void)r.U16("reserved", &reserved);
  (void)r.U32("payload length", &length);
  if (magic != format_.magic) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed ", format_.name, ": magic ", absl::Hex(magic)));
  }
  if (version != format_.version) {
    return absl::InvalidArgumentError(absl::StrCat(format_.name, " version ", version,
                                                   " (this build reads version ",
                                                   format_.version, ")"));
  }
  if (raw_type < 1 || raw_type > format_.max_type || reserved != 0) {
    return absl::InvalidArgumentError(absl::StrCat("malformed ", format_.name, ": type ",
                                                   raw_type, ", reserved ", reserved));
  }
  if (length > kMaxIpcFramePayloadBytes) {
    return absl::InvalidArgumentError(absl::StrCat("malformed ", format_.name,
                                                   ": payload length ", length,
                                                   " exceeds the limit of ",
                                                   kMaxIpcFramePayloadBytes));
  }
  if (buffered() < kIpcFrameHeaderBytes + length) return false;
  *type = raw_type;
  payload->assign(buffer_, pos_ + kIpcFrameHeaderBytes, length);
  pos_ += kIpcFrameHeaderBytes + length;
  if (pos_ == buffer_.size()) {
    buffer_.clear();
    pos_ = 0;
  }
  return true;
}

}  // namespace internal
}  // namespace kvstream
