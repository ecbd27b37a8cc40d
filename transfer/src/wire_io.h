// Bounds-checked little-endian writer and reader for wire.h payloads. Private to transfer/.
//
// The reader is the only code that touches untrusted bytes: every read checks the remaining
// length first, every length-prefixed field is checked against its bound before any byte is
// copied, and list counts are checked against what the remaining bytes could possibly hold
// before the caller reserves memory for them.
#ifndef KVSTREAM_TRANSFER_SRC_WIRE_IO_H_
#define KVSTREAM_TRANSFER_SRC_WIRE_IO_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {

// Appends fixed-width little-endian integers and u32-length-prefixed byte strings.
class WireWriter {
 public:
  explicit WireWriter(std::string* out) : out_(out) {}

  void U8(uint8_t v) { out_->push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { PutLe(v, 2); }
  void U32(uint32_t v) { PutLe(v, 4); }
  void U64(uint64_t v) { PutLe(v, 8); }
  // Two's complement, as every supported platform stores it.
  void I32(int32_t v) { U32(static_cast<uint32_t>(v)); }

  // u32 length + bytes. InvalidArgument (nothing written) when longer than `max_bytes`.
  absl::Status Bytes(absl::string_view field, absl::string_view bytes, uint32_t max_bytes) {
    if (bytes.size() > max_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " is ", bytes.size(), " bytes, more than the limit of ", max_bytes));
    }
    U32(static_cast<uint32_t>(bytes.size()));
    out_->append(bytes.data(), bytes.size());
    return absl::OkStatus();
  }

 private:
  void PutLe(uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out_->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }

  std::string* out_;
};

// Consumes a payload front to back. Every method either fills its output and advances, or
// returns InvalidArgument naming the field and leaves the position unspecified (callers stop
// at the first error).
class WireReader {
 public:
  explicit WireReader(absl::string_view data) : data_(data) {}

  size_t remaining() const { return data_.size() - pos_; }

  absl::Status U8(absl::string_view field, uint8_t* out) {
    uint64_t v = 0;
    RETURN_IF_ERROR(GetLe(field, 1, &v));
    *out = static_cast<uint8_t>(v);
    return absl::OkStatus();
  }
  absl::Status U16(absl::string_view field, uint16_t* out) {
    uint64_t v = 0;
    RETURN_IF_ERROR(GetLe(field, 2, &v));
    *out = static_cast<uint16_t>(v);
    return absl::OkStatus();
  }
  absl::Status U32(absl::string_view field, uint32_t* out) {
    uint64_t v = 0;
    RETURN_IF_ERROR(GetLe(field, 4, &v));
    *out = static_cast<uint32_t>(v);
    return absl::OkStatus();
  }
  absl::Status U64(absl::string_view field, uint64_t* out) { return GetLe(field, 8, out); }
  absl::Status I32(absl::string_view field, int32_t* out) {
    uint32_t v = 0;
    RETURN_IF_ERROR(U32(field, &v));
    // Well-defined two's complement reinterpretation (no implementation-defined narrowing).
    *out = v <= 0x7fffffffu ? static_cast<int32_t>(v) : -static_cast<int32_t>(~v) - 1;
    return absl::OkStatus();
  }

  // u32 length + bytes. The length is checked against `max_bytes` and against the bytes
  // left before anything is copied.
  absl::Status Bytes(absl::string_view field, uint32_t max_bytes, std::string* out) {
    uint32_t len = 0;
    RETURN_IF_ERROR(U32(field, &len));
    if (len > max_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " length ", len, " exceeds the limit of ", max_bytes));
    }
    if (len > remaining()) {
      return absl::InvalidArgumentError(absl::StrCat(field, " length ", len, " runs past the end (",
                                                     remaining(), " bytes left)"));
    }
    out->assign(data_.data() + pos_, len);
    pos_ += len;
    return absl::OkStatus();
  }

  // u32 list count, checked against `max_entries` and against the bytes left given that
  // each element takes at least `min_element_bytes`, so that a hostile count can never make
  // the caller reserve more than the payload could describe.
  absl::Status Count(absl::string_view field, uint32_t max_entries, size_t min_element_bytes,
                     uint32_t* out) {
    uint32_t count = 0;
    RETURN_IF_ERROR(U32(field, &count));
    if (count > max_entries) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " count ", count, " exceeds the limit of ", max_entries));
    }
    if (min_element_bytes > 0 && count > remaining() / min_element_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " count ", count, " runs past the end (", remaining(), " bytes left)"));
    }
    *out = count;
    return absl::OkStatus();
  }

  // A payload must be consumed exactly.
  absl::Status ExpectEnd(absl::string_view what) const {
    if (remaining() != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(remaining(), " trailing bytes after the ", what, " payload"));
    }
    return absl::OkStatus();
  }

 private:
  absl::Status GetLe(absl::string_view field, int bytes, uint64_t* out) {
    if (remaining() < static_cast<size_t>(bytes)) {
      return absl::InvalidArgumentError(absl::StrCat("truncated payload: ", field, " needs ", bytes,
                                                     " bytes, ", remaining(), " left"));
    }
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) {
      v |= static_cast<uint64_t>(static_cast<unsigned char>(data_[pos_ + i])) << (8 * i);
    }
    pos_ += bytes;
    *out = v;
    return absl::OkStatus();
  }

  absl::string_view data_;
  size_t pos_ = 0;
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_WIRE_IO_H_
