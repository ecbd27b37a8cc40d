// Parsing of vLLM's kv_transfer_config JSON into KvTransferConfig.
#include "kvstream/connector/config.h"

#include <algorithm>
#include <random>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/transfer/nccl_transport.h"
#include "kvstream/transfer/socket.h"
#include "kvstream/transfer/transport_factory.h"
#include "kvstream/transfer/ucx_transport.h"

namespace kvstream {
namespace {

using nlohmann::json;

absl::Status KeyError(absl::string_view key, const json& value, absl::string_view expected) {
  return absl::InvalidArgumentError(absl::StrCat("kv_transfer_config: ", key, " = ",
                                                 value.dump(), " is not ", expected));
}

absl::Status GetString(const json& j, absl::string_view key, std::string& out) {
  if (!j.is_string()) return KeyError(key, j, "a string");
  out = j.get<std::string>();
  return absl::OkStatus();
}

absl::Status GetInt(const json& j, absl::string_view key, int64_t lo, int64_t hi, int64_t& out) {
  if (!j.is_number_integer()) return KeyError(key, j, "an integer");
  const int64_t v = j.get<int64_t>();
  if (v < lo || v > hi) return KeyError(key, j, absl::StrCat("in [", lo, ", ", hi, "]"));
  out = v;
  return absl::OkStatus();
}

absl::Status GetInt32(const json& j, absl::string_view key, int64_t lo, int64_t hi, int32_t& out) {
  int64_t v = 0;
  RETURN_IF_ERROR(GetInt(j, key, lo, hi, v));
  out = static_cast<int32_t>(v);
  return absl::OkStatus();
}

absl::Status GetBool(const json& j, absl::string_view key, bool& out) {
  if (!j.is_boolean()) return KeyError(key, j, "true or false");
  out = j.get<bool>();
  return absl::OkStatus();
}

absl::Status ParseExtra(const json& extra, KvstreamSettings& s) {
  if (!extra.is_object()) return KeyError("kv_connector_extra_config", extra, "an object");
  bool has_pp_size = false;
  for (auto it = extra.begin(); it != extra.end(); ++it) {
    const std::string key = absl::StrCat("kv_connector_extra_config.", it.key());
    const json& v = it.value();
    if (it.key() == "transport") {
      RETURN_IF_ERROR(GetString(v, key, s.transport));
      const std::vector<std::string> names = TransportNames();
      if (std::find(names.begin(), names.end(), s.transport) == names.end()) {
        return KeyError(key, v, absl::StrCat("one of ", absl::StrJoin(names, ", ")));
      }
    } else if (it.key() == "cuda_device") {
      RETURN_IF_ERROR(GetInt32(v, key, 0, 1023, s.cuda_device));
    } else if (it.key() == "ucx_tls") {
      RETURN_IF_ERROR(GetString(v, key, s.ucx_tls));
      if (s.ucx_tls.empty()) return KeyError(key, v, "a non-empty UCX_TLS value");
    } else if (it.key() == "ucx_net_devices") {
      RETURN_IF_ERROR(GetString(v, key, s.ucx_net_devices));
    } else if (it.key() == "ucx_copy_threads") {
      RETURN_IF_ERROR(GetInt32(v, key, 0, kMaxCopyThreads, s.ucx_copy_threads));
    } else if (it.key() == "nccl_job_id") {
      RETURN_IF_ERROR(GetString(v, key, s.nccl_job_id));
      // The transport's own bound on a job id, so that the two never disagree.
      NcclTransportOptions nccl;
      nccl.job_id = s.nccl_job_id;
      absl::Status valid = ValidateNcclTransportOptions(nccl);
      if (!valid.ok()) return KeyError(key, v, absl::StrCat("a job id: ", valid.message()));
    } else if (it.key() == "nccl_listen_host") {
      RETURN_IF_ERROR(GetString(v, key, s.nccl_listen_host));
      absl::Status valid = CheckTcpHost(s.nccl_listen_host);
      if (!valid.ok()) return KeyError(key, v, absl::StrCat("a listen address: ", valid.message()));
    } else if (it.key() == "load_timeout_ms") {
      RETURN_IF_ERROR(GetInt(v, key, 1, 3600000, s.load_timeout_ms));
    } else if (it.key() == "send_timeout_ms") {
      RETURN_IF_ERROR(GetInt(v, key, 1, 3600000, s.send_timeout_ms));
    } else if (it.key() == "handshake_timeout_ms") {
      RETURN_IF_ERROR(GetInt(v, key, 1, 3600000, s.handshake_timeout_ms));
    } else if (it.key() == "reconnect_backoff_ms") {
      RETURN_IF_ERROR(GetInt(v, key, 0, 3600000, s.reconnect_backoff_ms));
    } else if (it.key() == "reconnect_backoff_max_ms") {
      RETURN_IF_ERROR(GetInt(v, key, 0, 3600000, s.reconnect_backoff_max_ms));
    } else if (it.key() == "verify_checksum") {
      RETURN_IF_ERROR(GetBool(v, key, s.verify_checksum));
    } else if (it.key() == "load_async") {
      RETURN_IF_ERROR(GetBool(v, key, s.load_async));
    } else if (it.key() == "secret") {
      RETURN_IF_ERROR(GetString(v, key, s.secret));
    } else if (it.key() == "pipeline_parallel_size") {
      RETURN_IF_ERROR(GetInt32(v, key, 1, 1024, s.pipeline_parallel_size));
      has_pp_size = true;
    } else if (it.key() == "pipeline_rank") {
      RETURN_IF_ERROR(GetInt32(v, key, 0, 1023, s.pipeline_rank));
    } else if (it.key() == "pipeline_group") {
      RETURN_IF_ERROR(GetString(v, key, s.pipeline_group));
      if (s.pipeline_group.size() > 200) return KeyError(key, v, "at most 200 characters");
    } else if (it.key() == "max_connections") {
      RETURN_IF_ERROR(GetInt32(v, key, 1, 65536, s.max_connections));
    } else if (it.key() == "max_requests_per_consumer") {
      RETURN_IF_ERROR(GetInt32(v, key, 1, 1 << 24, s.max_requests_per_consumer));
    } else if (it.key() == "max_tokens_per_consumer") {
      RETURN_IF_ERROR(GetInt(v, key, 1, int64_t{1} << 40, s.max_tokens_per_consumer));
    } else if (it.key() == "pipeline_layers") {
      std::string text;
      RETURN_IF_ERROR(GetString(v, key, text));
      auto ranges = ParseLayerRanges(text);
      if (!ranges.ok()) return KeyError(key, v, absl::StrCat("valid: ", ranges.status().message()));
      absl::Status partition = ValidatePipelinePartition(*ranges);
      if (!partition.ok()) {
        return KeyError(key, v, absl::StrCat("a partition of the layers: ", partition.message()));
      }
      s.pipeline_layers = std::move(*ranges);
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv_transfer_config: unknown key ", key,
          " (known: transport, cuda_device, ucx_tls, ucx_net_devices, ucx_copy_threads, "
          "nccl_job_id, nccl_listen_host, load_timeout_ms, send_timeout_ms, "
          "handshake_timeout_ms, reconnect_backoff_ms, reconnect_backoff_max_ms, "
          "verify_checksum, load_async, secret, pipeline_parallel_size, "
          "pipeline_rank, pipeline_layers, pipeline_group, max_connections, "
          "max_requests_per_consumer, max_tokens_per_consumer)"));
    }
  }
  // pipeline_layers alone gives the number of stages.
  const int32_t stages = static_cast<int32_t>(s.pipeline_layers.size());
  if (!s.pipeline_layers.empty()) {
    if (!has_pp_size) {
      s.pipeline_parallel_size = stages;
    } else if (s.pipeline_parallel_size != stages) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv_transfer_config: kv_connector_extra_config.pipeline_layers = \"",
          FormatLayerRanges(s.pipeline_layers), "\" has ", stages,
          " stages but pipeline_parallel_size is ", s.pipeline_parallel_size));
    }
  }
  if (s.reconnect_backoff_max_ms < s.reconnect_backoff_ms) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_transfer_config: kv_connector_extra_config.reconnect_backoff_max_ms ",
        s.reconnect_backoff_max_ms, " is below reconnect_backoff_ms ", s.reconnect_backoff_ms));
  }
  if (s.pipeline_rank >= s.pipeline_parallel_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_transfer_config: kv_connector_extra_config.pipeline_rank ", s.pipeline_rank,
        " must be below pipeline_parallel_size ", s.pipeline_parallel_size));
  }
  return absl::OkStatus();
}

std::string RandomEngineId() {
  std::random_device rd;
  return absl::StrCat("engine-", absl::Hex(rd()), absl::Hex(rd()));
}

}  // namespace

absl::StatusOr<LayerRange> PipelineStageLayers(const KvstreamSettings& s, int32_t num_layers) {
  if (s.pipeline_parallel_size <= 1) return LayerRange{0, num_layers};
  if (s.pipeline_rank < 0 || s.pipeline_rank >= s.pipeline_parallel_size) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline_rank ", s.pipeline_rank,
                                                   " is not below pipeline_parallel_size ",
                                                   s.pipeline_parallel_size));
  }
  if (s.pipeline_layers.empty()) {
    ASSIGN_OR_RETURN(std::vector<LayerRange> even,
                     EvenPipelinePartition(num_layers, s.pipeline_parallel_size));
    return even[s.pipeline_rank];
  }
  if (static_cast<int32_t>(s.pipeline_layers.size()) != s.pipeline_parallel_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline_layers ", FormatLayerRanges(s.pipeline_layers), " has ",
                     s.pipeline_layers.size(), " stages, pipeline_parallel_size is ",
                     s.pipeline_parallel_size));
  }
  RETURN_IF_ERROR(ValidatePipelinePartition(s.pipeline_layers));
  const int32_t end = s.pipeline_layers.back().end;
  if (end < num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline_layers ", FormatLayerRanges(s.pipeline_layers), " leave layers ",
        FormatLayerRange({end, num_layers}), " of the model's ", num_layers,
        " owned by no decode stage"));
  }
  if (end > num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline_layers ", FormatLayerRanges(s.pipeline_layers), " name layers up to ",
        end - 1, " but the model has ", num_layers, " layers"));
  }
  return s.pipeline_layers[s.pipeline_rank];
}

absl::string_view KvRoleName(KvRole role) {
  switch (role) {
    case KvRole::kProducer: return "kv_producer";
    case KvRole::kConsumer: return "kv_consumer";
    case KvRole::kBoth: return "kv_both";
  }
  return "unknown";
}

absl::string_view LoadFailurePolicyName(LoadFailurePolicy policy) {
  return policy == LoadFailurePolicy::kFail ? "fail" : "recompute";
}

std::string PipelineGroup(const KvTransferConfig& config) {
  const KvstreamSettings& k = config.kvstream;
  if (k.pipeline_parallel_size <= 1) return std::string();
  if (!k.pipeline_group.empty()) return k.pipeline_group;
  // "decode0-pp1" -> "decode0": the launcher names a group's stages so.
  const std::string& id = config.engine_id;
  size_t digits = id.size();
  while (digits > 0 && id[digits - 1] >= '0' && id[digits - 1] <= '9') --digits;
  if (digits < id.size() && digits >= 3 && id.compare(digits - 3, 3, "-pp") == 0 && digits > 3) {
    return id.substr(0, digits - 3);
  }
  return id;
}

absl::StatusOr<KvTransferConfig> ParseKvTransferConfig(absl::string_view text) {
  // Values are built recursively (and destroyed so), so deep nesting would exhaust the
  // stack: the callback refuses it as soon as the parser opens a value too deep, and the
  // parse stops there (the callback's discard ends it with is_discarded()).
  bool too_deep = false;
  const json::parser_callback_t depth_guard = [&too_deep](int depth, json::parse_event_t event,
                                                          json& /*parsed*/) {
    if ((event == json::parse_event_t::object_start ||
         event == json::parse_event_t::array_start) &&
        depth >= kMaxConfigDepth) {
      too_deep = true;
    }
    return !too_deep;
  };
  json j = json::parse(text.begin(), text.end(), depth_guard, /*allow_exceptions=*/false);
  if (too_deep) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_transfer_config: nested deeper than ", kMaxConfigDepth, " levels"));
  }
  if (j.is_discarded()) {
    // Re-parse with exceptions off is silent about the position; ask the SAX parser.
    try {
      json again = json::parse(text.begin(), text.end());
      (void)again;
    } catch (const json::exception& e) {  // parse_error, and out_of_range for huge numbers
      return absl::InvalidArgumentError(absl::StrCat("kv_transfer_config: malformed JSON: ", e.what()));
    }
    return absl::InvalidArgumentError("kv_transfer_config: malformed JSON");
  }
  if (!j.is_object()) return KeyError("kv_transfer_config", j, "a JSON object");

  KvTransferConfig c;
  bool has_engine_id = false;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (v.is_null()) continue;  // vLLM writes unset optionals as null
    if (key == "kv_connector") {
      RETURN_IF_ERROR(GetString(v, key, c.kv_connector));
    } else if (key == "engine_id") {
      RETURN_IF_ERROR(GetString(v, key, c.engine_id));
      if (c.engine_id.empty() || c.engine_id.size() > 200) {
        return KeyError(key, v, "a non-empty id of at most 200 characters");
      }
      has_engine_id = true;
    } else if (key == "kv_buffer_device") {
      RETURN_IF_ERROR(GetString(v, key, c.kv_buffer_device));
      if (c.kv_buffer_device != "cpu" && c.kv_buffer_device != "cuda") {
        return KeyError(key, v, "\"cpu\" or \"cuda\"");
      }
    } else if (key == "kv_buffer_size") {
      if (!v.is_number() || !(v.get<double>() > 0)) return KeyError(key, v, "a positive number");
      c.kv_buffer_size = v.get<double>();
    } else if (key == "kv_role") {
      std::string role;
      RETURN_IF_ERROR(GetString(v, key, role));
      if (role == "kv_producer") {
        c.kv_role = KvRole::kProducer;
      } else if (role == "kv_consumer") {
        c.kv_role = KvRole::kConsumer;
      } else if (role == "kv_both") {
        c.kv_role = KvRole::kBoth;
      } else {
        return KeyError(key, v, "\"kv_producer\", \"kv_consumer\" or \"kv_both\"");
      }
    } else if (key == "kv_rank") {
      RETURN_IF_ERROR(GetInt32(v, key, 0, 1 << 20, c.kv_rank));
    } else if (key == "kv_parallel_size") {
      RETURN_IF_ERROR(GetInt32(v, key, 1, 1 << 20, c.kv_parallel_size));
    } else if (key == "kv_ip") {
      RETURN_IF_ERROR(GetString(v, key, c.kv_ip));
      if (c.kv_ip.empty()) return KeyError(key, v, "a host address");
    } else if (key == "kv_port") {
      RETURN_IF_ERROR(GetInt32(v, key, 0, 65535, c.kv_port));
    } else if (key == "kv_connector_module_path") {
      RETURN_IF_ERROR(GetString(v, key, c.kv_connector_module_path));
    } else if (key == "kv_load_failure_policy") {
      std::string p;
      RETURN_IF_ERROR(GetString(v, key, p));
      if (p == "recompute") {
        c.kv_load_failure_policy = LoadFailurePolicy::kRecompute;
      } else if (p == "fail") {
        c.kv_load_failure_policy = LoadFailurePolicy::kFail;
      } else {
        return KeyError(key, v, "\"recompute\" or \"fail\"");
      }
    } else if (key == "kv_connector_extra_config") {
      RETURN_IF_ERROR(ParseExtra(v, c.kvstream));
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv_transfer_config: unknown key ", key,
          " (known: kv_connector, engine_id, kv_buffer_device, kv_buffer_size, kv_role, "
          "kv_rank, kv_parallel_size, kv_ip, kv_port, kv_connector_module_path, "
          "kv_load_failure_policy, kv_connector_extra_config)"));
    }
  }
  if (c.kv_rank >= c.kv_parallel_size) {
    return absl::InvalidArgumentError(absl::StrCat("kv_transfer_config: kv_rank ", c.kv_rank,
                                                   " must be below kv_parallel_size ",
                                                   c.kv_parallel_size));
  }
  if (!has_engine_id) c.engine_id = RandomEngineId();
  return c;
}

absl::Status CheckStageLayers(const KvstreamSettings& k, const std::set<int32_t>& mine,
                              const std::set<int32_t>& theirs, absl::string_view producer) {
  if (k.pipeline_parallel_size <= 1) {
    if (mine == theirs) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "KV cache compatibility mismatch with peer ", producer, ": it has layers ",
        FormatLayerSet(theirs), ", we have layers ", FormatLayerSet(mine),
        " (a decode worker that is one stage of a pipeline sets pipeline_parallel_size, "
        "pipeline_rank and pipeline_layers)"));
  }
  const int32_t num_layers = theirs.empty() ? 0 : *theirs.rbegin() + 1;
  auto range = PipelineStageLayers(k, num_layers);
  if (!range.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("producer ", producer, " has layers ",
                                                      FormatLayerSet(theirs), ": ",
                                                      range.status().message()));
  }
  std::set<int32_t> expected;
  for (int32_t l : theirs) {
    if (range->Contains(l)) expected.insert(l);
  }
  if (mine != expected) {
    return absl::FailedPreconditionError(absl::StrCat(
        "pipeline rank ", k.pipeline_rank, " of ", k.pipeline_parallel_size,
        " should receive layers ", FormatLayerSet(expected), " of producer ", producer,
        " (which has layers ", FormatLayerSet(theirs), "), but registered layers ",
        FormatLayerSet(mine)));
  }
  return absl::OkStatus();
}

}  // namespace kvstream
