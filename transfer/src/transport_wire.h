// What the device transports' own wire formats (cuda_ipc/cuda_ipc_wire.h, nccl/nccl_wire.h)
// share on top of common/'s ByteWriter and ByteReader: the head of a descriptor or peer
// info (magic u32, version u16), the strings and fixed-size fields their encoders write,
// and the one shape of their decoding errors ("malformed <transport> <what>: <why>").
//
//   const WireName kName{"nccl", "an nccl"};
//   WriteWireHead(w, kMagic, 1);
//   RETURN_IF_ERROR(ReadWireHead(r, kMagic, 1, kName, "peer info"));
//   return Malformed(DecodeFields(bytes), kName, "peer info");
#ifndef KVSTREAM_TRANSFER_SRC_TRANSPORT_WIRE_H_
#define KVSTREAM_TRANSFER_SRC_TRANSPORT_WIRE_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvstream/common/byte_io.h"

namespace kvstream {
namespace internal {

// A transport's name in its wire errors, alone ("nccl") and with its article ("an nccl").
struct WireName {
  absl::string_view name;
  absl::string_view with_article;
};

void WriteWireHead(ByteWriter& w, uint32_t magic, uint16_t version);
// InvalidArgument "not <with_article> <what> (magic ...)" or "<name> <what> version v (this
// build reads version w)".
absl::Status ReadWireHead(ByteReader& r, uint32_t magic, uint16_t version, const WireName& name,
                          absl::string_view what);

// u32 length + bytes, unchecked: the encoders' inputs are the transport's own, bounded
// where they are made, and every decoder checks the bound again.
void PutWireString(ByteWriter& w, absl::string_view s);
// Exactly `n` bytes: `s` padded with NULs or cut (fixed-size fields: uuids, IPC handles).
void PutWireFixed(ByteWriter& w, absl::string_view s, size_t n);

// `status` as InvalidArgument "malformed <name> <what>: <message>" (OK stays OK).
absl::Status MalformedWire(const absl::Status& status, const WireName& name,
                           absl::string_view what);
template <typename T>
absl::StatusOr<T> Malformed(absl::StatusOr<T> decoded, const WireName& name,
                            absl::string_view what) {
  if (decoded.ok()) return decoded;
  return MalformedWire(decoded.status(), name, what);
}

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_TRANSPORT_WIRE_H_
