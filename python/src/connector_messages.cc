// The two messages between the connector's sides (connector_metadata.h) as Python dicts,
// for engines that need to look into them (a plugin mapping the worker's output onto its
// engine's own report) and for tests. The bytes stay the contract; these only decode and
// re-encode them with kvstream's own strict codecs.
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/set.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "absl/strings/str_cat.h"
#include "errors.h"
#include "kvstream/connector/connector_metadata.h"
#include "objects.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvstream::python {
namespace {

std::string FromBytes(nb::bytes b) { return std::string(b.c_str(), b.size()); }

// dict[key] as T; InvalidArgumentError naming the key when it is missing or of another type.
template <typename T>
T Field(const nb::dict& d, const char* key, const char* what) {
  if (!d.contains(key)) {
    ThrowStatus(absl::InvalidArgumentError(absl::StrCat(what, ": missing key '", key, "'")));
  }
  T value;
  if (!nb::try_cast<T>(d[key], value)) {
    ThrowStatus(absl::InvalidArgumentError(absl::StrCat(what, ": key '", key, "' has the wrong type")));
  }
  return value;
}

nb::dict MetadataToDict(const KvConnectorMetadata& m) {
  nb::list loads, saves;
  for (const KvConnectorMetadata::Load& l : m.loads) {
    nb::dict d;
    d["request_id"] = l.request_id;
    d["prompt_token_ids"] = nb::cast(l.prompt_token_ids);
    d["block_ids"] = nb::cast(l.block_ids);
    d["num_tokens"] = l.num_tokens;
    d["remote_host"] = l.remote.host;
    d["remote_port"] = l.remote.port;
    loads.append(d);
  }
  for (const KvConnectorMetadata::Save& s : m.saves) {
    nb::dict d;
    d["request_id"] = s.request_id;
    d["block_ids"] = nb::cast(s.block_ids);
    d["num_tokens"] = s.num_tokens;
    saves.append(d);
  }
  nb::dict d;
  d["loads"] = loads;
  d["waits"] = nb::cast(m.waits);
  d["saves"] = saves;
  d["finished"] = nb::cast(m.finished);
  return d;
}

nb::dict OutputToDict(const KvConnectorOutput& o) {
  nb::list errors, incoming;
  for (const LoadError& e : o.load_errors) {
    nb::dict d;
    d["request_id"] = e.request_id;
    d["block_ids"] = nb::cast(e.block_ids);
    d["code"] = absl::StatusCodeToString(e.status.code());
    d["message"] = std::string(e.status.message());
    errors.append(d);
  }
  for (const IncomingRequest& r : o.incoming) {
    nb::dict d;
    d["request_id"] = r.request_id;
    d["prompt_token_ids"] = nb::cast(r.prompt_token_ids);
    d["num_tokens"] = r.num_tokens;
    incoming.append(d);
  }
  nb::dict d;
  d["finished_sending"] = nb::cast(o.finished_sending);
  d["finished_recving"] = nb::cast(o.finished_recving);
  d["load_errors"] = errors;
  d["incoming"] = incoming;
  return d;
}

KvConnectorMetadata MetadataFromDict(const nb::dict& d) {
  const char* what = "connector metadata";
  KvConnectorMetadata m;
  for (nb::handle h : Field<nb::list>(d, "loads", what)) {
    nb::dict l = nb::cast<nb::dict>(h);
    KvConnectorMetadata::Load load;
    load.request_id = Field<std::string>(l, "request_id", "load");
    load.prompt_token_ids = Field<std::vector<int32_t>>(l, "prompt_token_ids", "load");
    load.block_ids = Field<std::vector<int32_t>>(l, "block_ids", "load");
    load.num_tokens = Field<int32_t>(l, "num_tokens", "load");
    load.remote.host = Field<std::string>(l, "remote_host", "load");
    load.remote.port = Field<int32_t>(l, "remote_port", "load");
    m.loads.push_back(std::move(load));
  }
  m.waits = Field<std::vector<std::string>>(d, "waits", what);
  for (nb::handle h : Field<nb::list>(d, "saves", what)) {
    nb::dict s = nb::cast<nb::dict>(h);
    KvConnectorMetadata::Save save;
    save.request_id = Field<std::string>(s, "request_id", "save");
    save.block_ids = Field<std::vector<int32_t>>(s, "block_ids", "save");
    save.num_tokens = Field<int32_t>(s, "num_tokens", "save");
    m.saves.push_back(std::move(save));
  }
  m.finished = Field<std::vector<std::string>>(d, "finished", what);
  return m;
}

absl::StatusCode ParseCode(const std::string& name) {
  for (int c = 1; c <= 16; ++c) {
    if (absl::StatusCodeToString(static_cast<absl::StatusCode>(c)) == name) {
      return static_cast<absl::StatusCode>(c);
    }
  }
  ThrowStatus(absl::InvalidArgumentError(
      absl::StrCat("connector output: unknown load error code '", name, "'")));
}

KvConnectorOutput OutputFromDict(const nb::dict& d) {
  const char* what = "connector output";
  KvConnectorOutput o;
  o.finished_sending = Field<std::set<std::string>>(d, "finished_sending", what);
  o.finished_recving = Field<std::set<std::string>>(d, "finished_recving", what);
  for (nb::handle h : Field<nb::list>(d, "load_errors", what)) {
    nb::dict e = nb::cast<nb::dict>(h);
    LoadError err;
    err.request_id = Field<std::string>(e, "request_id", "load error");
    err.block_ids = Field<std::vector<int32_t>>(e, "block_ids", "load error");
    err.status = absl::Status(ParseCode(Field<std::string>(e, "code", "load error")),
                              Field<std::string>(e, "message", "load error"));
    o.load_errors.push_back(std::move(err));
  }
  for (nb::handle h : Field<nb::list>(d, "incoming", what)) {
    nb::dict r = nb::cast<nb::dict>(h);
    IncomingRequest in;
    in.request_id = Field<std::string>(r, "request_id", "incoming request");
    in.prompt_token_ids = Field<std::vector<int32_t>>(r, "prompt_token_ids", "incoming request");
    in.num_tokens = Field<int32_t>(r, "num_tokens", "incoming request");
    o.incoming.push_back(std::move(in));
  }
  return o;
}

}  // namespace

void BindConnectorMessages(nb::module_& m) {
  m.def("decode_connector_metadata",
        [](nb::bytes b) { return MetadataToDict(Unwrap(DecodeConnectorMetadata(FromBytes(b)))); },
        "metadata"_a,
        "build_connector_meta's bytes as a dict: loads, waits, saves, finished. "
        "InvalidArgumentError naming the field for malformed bytes.");
  m.def("encode_connector_metadata",
        [](const nb::dict& d) {
          std::string s = Unwrap(EncodeConnectorMetadata(MetadataFromDict(d)));
          return nb::bytes(s.data(), s.size());
        },
        "metadata"_a,
        "The inverse of decode_connector_metadata (e.g. a worker of tensor-parallel rank r "
        "pointing its loads at the producer's rank r). Checked as the decoder checks.");
  m.def("decode_connector_output",
        [](nb::bytes b) { return OutputToDict(Unwrap(DecodeConnectorOutput(FromBytes(b)))); },
        "output"_a,
        "take_output's bytes as a dict: finished_sending, finished_recving (sets of request "
        "ids), load_errors (request_id, block_ids, code, message), incoming (request_id, "
        "prompt_token_ids, num_tokens).");
  m.def("encode_connector_output",
        [](const nb::dict& d) {
          std::string s = Unwrap(EncodeConnectorOutput(OutputFromDict(d)));
          return nb::bytes(s.data(), s.size());
        },
        "output"_a,
        "The inverse of decode_connector_output (e.g. to merge several workers' outputs).");
}

}  // namespace kvstream::python
