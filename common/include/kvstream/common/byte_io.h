// ByteWriter and ByteReader: kvstream's one little-endian encoder and bounds-checked decoder,
// for everything it puts on a wire or hands to a peer (control frames, layer notices,
// transport descriptors, the connector's step metadata).
//
//   std::string out;
//   ByteWriter w(&out);
//   w.U32(7);
//   RETURN_IF_ERROR(w.Bytes("request id", id, kMaxIdBytes));
//   ByteReader r(out);
//   uint32_t n;
//   RETURN_IF_ERROR(r.U32("count", &n));
//
// The reader is the code that touches untrusted bytes: every read checks the remaining
// length first, every length-prefixed field is checked against its bound before any byte is
// copied, and list counts are checked against what the remaining bytes could possibly hold
// before the caller reserves memory for them. Thread-compatible.
#ifndef KVSTREAM_COMMON_BYTE_IO_H_
#define KVSTREAM_COMMON_BYTE_IO_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {

// Appends fixed-width little-endian integers and u32-length-prefixed byte strings.
class ByteWriter {
 public:
  explicit ByteWriter(std::string* out) : out_(out) {}

  void U8(uint8_t v) { out_->push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { PutLe(v, 2); }
  void U32(uint32_t v) { PutLe(v, 4); }
  void U64(uint64_t v) { PutLe(v, 8); }
  // Two's complement, as every supported platform stores it.
  void I32(int32_t v) { U32(static_cast<uint32_t>(v)); }

  // The bytes as they are, with no length (fixed-size fields such as magics and nonces).
  void Raw(absl::string_view bytes) { out_->append(bytes.data(), bytes.size()); }

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
class ByteReader {
 public:
  explicit ByteReader(absl::string_view data) : data_(data) {}

  size_t remaining() const { return data_.size() - pos_; }
  // Bytes consumed so far.
  size_t position() const { return pos_; }

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

  // Exactly `n` bytes with no length prefix (fixed-size fields).
  absl::Status Raw(absl::string_view field, size_t n, std::string* out) {
    if (n > remaining()) {
      return absl::InvalidArgumentError(absl::StrCat("truncated payload: ", field, " needs ", n,
                                                     " bytes, ", remaining(), " left"));
    }
    out->assign(data_.data() + pos_, n);
    pos_ += n;
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

}  // namespace kvstream

#endif  // KVSTREAM_COMMON_BYTE_IO_H_
