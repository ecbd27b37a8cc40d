// Encoding and strict decoding of the step's metadata and the worker's output
// (connector_metadata.h).
#include "kvstream/connector/connector_metadata.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kvstream/common/byte_io.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/transfer/wire.h"

namespace kvstream {
namespace {

constexpr uint32_t kMetadataMagic = 0x444D564B;  // bytes "KVMD"
constexpr uint32_t kOutputMagic = 0x4F4D564B;    // bytes "KVMO"
constexpr uint16_t kVersion = 1;
constexpr uint32_t kMaxHostBytes = 255;
constexpr uint32_t kMaxEntries = 1u << 22;
constexpr int32_t kMaxStatusCode = static_cast<int32_t>(absl::StatusCode::kUnauthenticated);

absl::Status NonNegative(absl::string_view field, int64_t v) {
  if (v < 0) return absl::InvalidArgumentError(absl::StrCat(field, " ", v, " is negative"));
  return absl::OkStatus();
}

absl::Status PutCount(absl::string_view field, size_t n, ByteWriter& w) {
  if (n > kMaxEntries) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " has ", n, " entries, more than the limit of ", kMaxEntries));
  }
  w.U32(static_cast<uint32_t>(n));
  return absl::OkStatus();
}

absl::Status PutIds(absl::string_view field, const std::vector<int32_t>& ids, ByteWriter& w) {
  RETURN_IF_ERROR(PutCount(field, ids.size(), w));
  for (int32_t v : ids) {
    RETURN_IF_ERROR(NonNegative(field, v));
    w.I32(v);
  }
  return absl::OkStatus();
}

template <typename Strings>
absl::Status PutStrings(absl::string_view field, const Strings& strings, ByteWriter& w) {
  RETURN_IF_ERROR(PutCount(field, strings.size(), w));
  for (const std::string& s : strings) RETURN_IF_ERROR(w.Bytes(field, s, kMaxIdBytes));
  return absl::OkStatus();
}

absl::Status GetIds(absl::string_view field, ByteReader& r, std::vector<int32_t>* out) {
  uint32_t n = 0;
  RETURN_IF_ERROR(r.Count(field, kMaxEntries, 4, &n));
  out->reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    int32_t v = 0;
    RETURN_IF_ERROR(r.I32(field, &v));
    RETURN_IF_ERROR(NonNegative(field, v));
    out->push_back(v);
  }
  return absl::OkStatus();
}

absl::Status GetNonNegative(absl::string_view field, ByteReader& r, int32_t* out) {
  RETURN_IF_ERROR(r.I32(field, out));
  return NonNegative(field, *out);
}

absl::Status GetStringList(absl::string_view field, ByteReader& r, std::vector<std::string>* out) {
  uint32_t n = 0;
  RETURN_IF_ERROR(r.Count(field, kMaxEntries, 4, &n));
  out->reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    std::string s;
    RETURN_IF_ERROR(r.Bytes(field, kMaxIdBytes, &s));
    out->push_back(std::move(s));
  }
  return absl::OkStatus();
}

// A set travels in its own (increasing) order, each element once, so that an accepted
// encoding is exactly what the encoder writes for it.
absl::Status GetStringSet(absl::string_view field, ByteReader& r, std::set<std::string>* out) {
  std::vector<std::string> list;
  RETURN_IF_ERROR(GetStringList(field, r, &list));
  for (size_t i = 0; i < list.size(); ++i) {
    if (i > 0 && !(*out->rbegin() < list[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " lists a request twice or out of order (entry ", i, ")"));
    }
    out->insert(out->end(), std::move(list[i]));
  }
  return absl::OkStatus();
}

absl::Status GetHeader(ByteReader& r, uint32_t magic, absl::string_view what) {
  uint32_t m = 0;
  uint16_t v = 0;
  RETURN_IF_ERROR(r.U32(absl::StrCat(what, " magic"), &m));
  if (m != magic) return absl::InvalidArgumentError(absl::StrCat("not a kvstream ", what, " (bad magic)"));
  RETURN_IF_ERROR(r.U16(absl::StrCat(what, " version"), &v));
  if (v != kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " version ", v, " (this side reads ", kVersion, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> EncodeConnectorMetadata(const KvConnectorMetadata& m) {
  std::string out;
  ByteWriter w(&out);
  w.U32(kMetadataMagic);
  w.U16(kVersion);
  RETURN_IF_ERROR(PutCount("loads", m.loads.size(), w));
  for (const KvConnectorMetadata::Load& l : m.loads) {
    RETURN_IF_ERROR(w.Bytes("loads.request_id", l.request_id, kMaxIdBytes));
    RETURN_IF_ERROR(PutIds("loads.prompt_token_ids", l.prompt_token_ids, w));
    RETURN_IF_ERROR(PutIds("loads.block_ids", l.block_ids, w));
    RETURN_IF_ERROR(NonNegative("loads.num_tokens", l.num_tokens));
    w.I32(l.num_tokens);
    RETURN_IF_ERROR(w.Bytes("loads.remote.host", l.remote.host, kMaxHostBytes));
    if (l.remote.port < 0 || l.remote.port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("loads.remote.port ", l.remote.port, " is outside 0..65535"));
    }
    w.I32(l.remote.port);
  }
  RETURN_IF_ERROR(PutStrings("waits", m.waits, w));
  RETURN_IF_ERROR(PutCount("saves", m.saves.size(), w));
  for (const KvConnectorMetadata::Save& s : m.saves) {
    RETURN_IF_ERROR(w.Bytes("saves.request_id", s.request_id, kMaxIdBytes));
    RETURN_IF_ERROR(PutIds("saves.block_ids", s.block_ids, w));
    RETURN_IF_ERROR(NonNegative("saves.num_tokens", s.num_tokens));
    w.I32(s.num_tokens);
  }
  RETURN_IF_ERROR(PutStrings("finished", m.finished, w));
  return out;
}

absl::StatusOr<KvConnectorMetadata> DecodeConnectorMetadata(absl::string_view bytes) {
  ByteReader r(bytes);
  RETURN_IF_ERROR(GetHeader(r, kMetadataMagic, "connector metadata"));
  KvConnectorMetadata m;
  uint32_t n = 0;
  // The smallest load: five u32 fields (lengths and counts) and two i32.
  RETURN_IF_ERROR(r.Count("loads", kMaxEntries, 28, &n));
  m.loads.resize(n);
  for (KvConnectorMetadata::Load& l : m.loads) {
    RETURN_IF_ERROR(r.Bytes("loads.request_id", kMaxIdBytes, &l.request_id));
    RETURN_IF_ERROR(GetIds("loads.prompt_token_ids", r, &l.prompt_token_ids));
    RETURN_IF_ERROR(GetIds("loads.block_ids", r, &l.block_ids));
    RETURN_IF_ERROR(GetNonNegative("loads.num_tokens", r, &l.num_tokens));
    RETURN_IF_ERROR(r.Bytes("loads.remote.host", kMaxHostBytes, &l.remote.host));
    RETURN_IF_ERROR(r.I32("loads.remote.port", &l.remote.port));
    if (l.remote.port < 0 || l.remote.port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("loads.remote.port ", l.remote.port, " is outside 0..65535"));
    }
  }
  RETURN_IF_ERROR(GetStringList("waits", r, &m.waits));
  RETURN_IF_ERROR(r.Count("saves", kMaxEntries, 12, &n));
  m.saves.resize(n);
  for (KvConnectorMetadata::Save& s : m.saves) {
    RETURN_IF_ERROR(r.Bytes("saves.request_id", kMaxIdBytes, &s.request_id));
    RETURN_IF_ERROR(GetIds("saves.block_ids", r, &s.block_ids));
    RETURN_IF_ERROR(GetNonNegative("saves.num_tokens", r, &s.num_tokens));
  }
  RETURN_IF_ERROR(GetStringList("finished", r, &m.finished));
  RETURN_IF_ERROR(r.ExpectEnd("connector metadata"));
  return m;
}

absl::StatusOr<std::string> EncodeConnectorOutput(const KvConnectorOutput& o) {
  std::string out;
  ByteWriter w(&out);
  w.U32(kOutputMagic);
  w.U16(kVersion);
  RETURN_IF_ERROR(PutStrings("finished_sending", o.finished_sending, w));
  RETURN_IF_ERROR(PutStrings("finished_recving", o.finished_recving, w));
  RETURN_IF_ERROR(PutCount("load_errors", o.load_errors.size(), w));
  for (const LoadError& e : o.load_errors) {
    RETURN_IF_ERROR(w.Bytes("load_errors.request_id", e.request_id, kMaxIdBytes));
    RETURN_IF_ERROR(PutIds("load_errors.block_ids", e.block_ids, w));
    if (e.status.ok()) {
      return absl::InvalidArgumentError("load_errors.status is OK: a load error needs an error");
    }
    w.I32(static_cast<int32_t>(e.status.code()));
    RETURN_IF_ERROR(w.Bytes("load_errors.message",
                            e.status.message().substr(0, kMaxMessageBytes), kMaxMessageBytes));
  }
  RETURN_IF_ERROR(PutCount("incoming", o.incoming.size(), w));
  for (const IncomingRequest& in : o.incoming) {
    RETURN_IF_ERROR(w.Bytes("incoming.request_id", in.request_id, kMaxIdBytes));
    RETURN_IF_ERROR(PutIds("incoming.prompt_token_ids", in.prompt_token_ids, w));
    RETURN_IF_ERROR(NonNegative("incoming.num_tokens", in.num_tokens));
    w.I32(in.num_tokens);
  }
  return out;
}

absl::StatusOr<KvConnectorOutput> DecodeConnectorOutput(absl::string_view bytes) {
  ByteReader r(bytes);
  RETURN_IF_ERROR(GetHeader(r, kOutputMagic, "connector output"));
  KvConnectorOutput o;
  RETURN_IF_ERROR(GetStringSet("finished_sending", r, &o.finished_sending));
  RETURN_IF_ERROR(GetStringSet("finished_recving", r, &o.finished_recving));
  uint32_t n = 0;
  RETURN_IF_ERROR(r.Count("load_errors", kMaxEntries, 16, &n));
  o.load_errors.resize(n);
  for (LoadError& e : o.load_errors) {
    RETURN_IF_ERROR(r.Bytes("load_errors.request_id", kMaxIdBytes, &e.request_id));
    RETURN_IF_ERROR(GetIds("load_errors.block_ids", r, &e.block_ids));
    int32_t code = 0;
    RETURN_IF_ERROR(r.I32("load_errors.status_code", &code));
    if (code < 1 || code > kMaxStatusCode) {
      return absl::InvalidArgumentError(absl::StrCat("load_errors.status_code ", code,
                                                     " is not an error code (1..",
                                                     kMaxStatusCode, ")"));
    }
    std::string message;
    RETURN_IF_ERROR(r.Bytes("load_errors.message", kMaxMessageBytes, &message));
    e.status = absl::Status(static_cast<absl::StatusCode>(code), message);
  }
  RETURN_IF_ERROR(r.Count("incoming", kMaxEntries, 12, &n));
  o.incoming.resize(n);
  for (IncomingRequest& in : o.incoming) {
    RETURN_IF_ERROR(r.Bytes("incoming.request_id", kMaxIdBytes, &in.request_id));
    RETURN_IF_ERROR(GetIds("incoming.prompt_token_ids", r, &in.prompt_token_ids));
    RETURN_IF_ERROR(GetNonNegative("incoming.num_tokens", r, &in.num_tokens));
  }
  RETURN_IF_ERROR(r.ExpectEnd("connector output"));
  return o;
}

}  // namespace kvstream
