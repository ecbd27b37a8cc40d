// The device transports' shared wire pieces (transport_wire.h).
#include "transport_wire.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {

void WriteWireHead(ByteWriter& w, uint32_t magic, uint16_t version) {
  w.U32(magic);
  w.U16(version);
}

absl::Status ReadWireHead(ByteReader& r, uint32_t magic, uint16_t version, const WireName& name,
                          absl::string_view what) {
  uint32_t got_magic = 0;
  RETURN_IF_ERROR(r.U32(absl::StrCat(what, " magic"), &got_magic));
  if (got_magic != magic) {
    return absl::InvalidArgumentError(absl::StrCat("not ", name.with_article, " ", what,
                                                   " (magic ", absl::Hex(got_magic), ")"));
  }
  uint16_t got_version = 0;
  RETURN_IF_ERROR(r.U16(absl::StrCat(what, " version"), &got_version));
  if (got_version != version) {
    return absl::InvalidArgumentError(absl::StrCat(name.name, " ", what, " version ", got_version,
                                                   " (this build reads version ", version, ")"));
  }
  return absl::OkStatus();
}

void PutWireString(ByteWriter& w, absl::string_view s) {
  w.U32(static_cast<uint32_t>(s.size()));
  w.Raw(s);
}

void PutWireFixed(ByteWriter& w, absl::string_view s, size_t n) {
  std::string fixed(s.substr(0, n));
  fixed.resize(n, '\0');
  w.Raw(fixed);
}

absl::Status MalformedWire(const absl::Status& status, const WireName& name,
                           absl::string_view what) {
  if (status.ok()) return status;
  return absl::InvalidArgumentError(
      absl::StrCat("malformed ", name.name, " ", what, ": ", status.message()));
}

}  // namespace internal
}  // namespace kvstream
