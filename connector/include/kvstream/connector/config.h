// Connector configuration, read from vLLM's `kv_transfer_config` JSON:
//
//   {"kv_connector": "LayerwiseConnector", "kv_role": "kv_consumer", "kv_rank": 1,
//    "kv_parallel_size": 2, "kv_ip": "127.0.0.1", "kv_port": 14579,
//    "engine_id": "decode-0", "kv_buffer_device": "cpu", "kv_load_failure_policy": "recompute",
//    "kv_connector_extra_config": {"transport": "ucx", "ucx_tls": "shm", "load_timeout_ms": 5000}}
//
// Every key of vLLM's KVTransferConfig is accepted; kvstream's own settings live under
// kv_connector_extra_config (KvstreamSettings below). An unknown key, a value of the wrong
// type or out of range is an InvalidArgument naming the key and the value.
#ifndef KVSTREAM_CONNECTOR_CONFIG_H_
#define KVSTREAM_CONNECTOR_CONFIG_H_

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvstream/connector/layer_routing.h"

namespace kvstream {

enum class KvRole { kProducer, kConsumer, kBoth };
absl::string_view KvRoleName(KvRole role);  // "kv_producer", "kv_consumer", "kv_both"

enum class LoadFailurePolicy { kRecompute, kFail };
absl::string_view LoadFailurePolicyName(LoadFailurePolicy policy);  // "recompute", "fail"

// kvstream's settings (kv_connector_extra_config).
struct KvstreamSettings {
  // A TransportNames() name; empty: DefaultTransportName of kv_buffer_device's memory
  // ("cuda_ipc" for "cuda" where built, "ucx" otherwise).
  std::string transport;
  int32_t cuda_device = 0;        // the GPU of this worker's caches (device transports)
  std::string ucx_tls = "shm";    // UcxTransportOptions::tls
  std::string ucx_net_devices;    // UcxTransportOptions::net_devices
  int32_t ucx_copy_threads = 0;   // UcxTransportOptions::copy_threads (0 .. kMaxCopyThreads)
  // nccl (NcclTransportOptions): the job id peers must share (at most 256 bytes), and the
  // numeric IPv4 address (or "localhost") its side connection listens on; peers on other
  // hosts need an address of this host they can reach.
  std::string nccl_job_id;
  std::string nccl_listen_host = "127.0.0.1";
  int64_t load_timeout_ms = 10000;       // consumer: a layer must arrive within this
  int64_t send_timeout_ms = 10000;       // producer: transfers in flight must finish within
                                         // this of the last layer posted
  int64_t handshake_timeout_ms = 5000;
  // Consumer: after a producer's link is lost, or an attempt to reach it fails, loads to it
  // fail at once (Unavailable, saying since when it is down and why) until the backoff has
  // passed; the next load then tries once more. The backoff starts at reconnect_backoff_ms
  // (after a lost link and after the first failed attempt), doubles after each further
  // failed attempt up to reconnect_backoff_max_ms, and a successful handshake resets it.
  // 0: every load tries (each costs up to handshake_timeout_ms when the host is silent).
  int64_t reconnect_backoff_ms = 200;
  int64_t reconnect_backoff_max_ms = 5000;
  bool verify_checksum = true;           // per-layer checksum checked by the consumer
  // Consumer: false (the default), a request whose KV comes from a producer runs its first
  // step at once, the forward pass waiting for each layer as it arrives; true, it runs once
  // all of its layers arrived and were verified (vLLM's asynchronous load). The first hides
  // the decode worker's own compute of the request behind the stream on separate GPUs; the
  // second keeps a GPU that the producer shares free for the producer's prefill.
  bool load_async = false;
  std::string secret;                    // shared secret for the control channel; empty = none
  // Pipeline-parallel decode (consumers only): this worker is stage `pipeline_rank` of a
  // decode group of `pipeline_parallel_size` stages. It registers, receives and waits for
  // only its stage's layers; the producer sends each layer of a request to the stage that
  // owns it once every stage has handed the request over. `pipeline_layers` lists every
  // stage's layers in stage order (a partition of [0, N)); empty = vLLM's even split of the
  // producer's N layers (EvenPipelinePartition).
  int32_t pipeline_parallel_size = 1;
  int32_t pipeline_rank = 0;
  std::vector<LayerRange> pipeline_layers;
  // Consumers only: the key that the stages of one decode group share, which the producer
  // uses to join their hand-offs of one request id into one request (request ids are scoped
  // by it there). Empty: the engine id without a trailing "-pp<rank>" (PipelineGroup).
  std::string pipeline_group;
  // Bounds a producer keeps against its peers (a consumer keeps max_connections too):
  // control connections served at once (beyond: refused at accept, logged), and per
  // consumer, requests and prompt tokens handed over and not yet finished (beyond: the
  // hand-off is refused with ResourceExhausted).
  int32_t max_connections = 256;
  int32_t max_requests_per_consumer = 1024;
  int64_t max_tokens_per_consumer = int64_t{1} << 22;
};

struct KvTransferConfig {
  std::string kv_connector;              // connector name for the factory
  std::string engine_id;                 // default: generated
  std::string kv_buffer_device = "cpu";  // "cpu" or "cuda"
  double kv_buffer_size = 1e9;
  KvRole kv_role = KvRole::kBoth;
  int32_t kv_rank = 0;
  int32_t kv_parallel_size = 1;
  std::string kv_ip = "127.0.0.1";       // producer: listen address; consumer: the producer's
  int32_t kv_port = 14579;               // control port (0 = any free port, producer only)
  std::string kv_connector_module_path;  // accepted for compatibility; unused by C++
  LoadFailurePolicy kv_load_failure_policy = LoadFailurePolicy::kRecompute;
  KvstreamSettings kvstream;
};

// Parses the JSON text. InvalidArgument for malformed JSON (with the parser's position),
// unknown keys (named), wrong types and bad values (named, with the value), and for
// nesting deeper than kMaxConfigDepth (refused while parsing, before it costs stack).
inline constexpr int kMaxConfigDepth = 64;
absl::StatusOr<KvTransferConfig> ParseKvTransferConfig(absl::string_view json);

// The pipeline group a consumer's hello names: empty without pipeline parallelism, else
// pipeline_group, else the engine id with a trailing "-pp<digits>" removed.
std::string PipelineGroup(const KvTransferConfig& config);

// The layers this worker's pipeline stage owns in a model of `num_layers` layers: all of
// them without pipeline parallelism, else stage pipeline_rank of pipeline_layers or of the
// even split. InvalidArgument when pipeline_layers does not end at num_layers (layers no
// stage owns, or layers the model lacks) or the model has fewer layers than stages.
absl::StatusOr<LayerRange> PipelineStageLayers(const KvstreamSettings& settings,
                                               int32_t num_layers);

// A consumer's check at handshake: whether the layers it registered (`mine`) are the ones a
// producer (named `producer`) with layers `theirs` will send it: all of them without
// pipeline parallelism, else its stage's range of them (PipelineStageLayers of the
// producer's layer count). FailedPrecondition naming both sets of layers.
absl::Status CheckStageLayers(const KvstreamSettings& settings, const std::set<int32_t>& mine,
                              const std::set<int32_t>& theirs, absl::string_view producer);

}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_CONFIG_H_
