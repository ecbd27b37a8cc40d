// kvstream.Request, kvstream.ConnectorScheduler and kvstream.ConnectorWorker: the
// connector's two sides, created from a kv_transfer_config dict, exchanging the step's
// metadata and the worker's output as bytes (connector_metadata.h's encodings).
#include "connector.h"

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/set.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "absl/strings/str_cat.h"
#include "errors.h"
#include "kvstream/connector/connector_metadata.h"
#include "kvstream/connector/factory.h"
#include "kvstream/connector/kv_connector.h"
#include "objects.h"
#include "tensors.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvstream::python {

KvTransferConfig ConfigFromPython(nb::handle config) {
  std::string json;
  if (nb::isinstance<nb::str>(config)) {
    json = nb::cast<std::string>(config);
  } else if (nb::isinstance<nb::dict>(config)) {
    json = nb::cast<std::string>(nb::module_::import_("json").attr("dumps")(config));
  } else {
    ThrowStatus(absl::InvalidArgumentError(
        "kv_transfer_config: expected a dict (or its JSON text)"));
  }
  return Unwrap(ParseKvTransferConfig(json));
}

nb::dict StatsToDict(const ConnectorStats& s) {
  nb::dict d;
  d["bytes_sent"] = s.bytes_sent;
  d["layers_sent"] = s.layers_sent;
  d["bytes_received"] = s.bytes_received;
  d["layers_received"] = s.layers_received;
  d["load_errors"] = s.load_errors;
  d["send_failures"] = s.send_failures;
  d["wait_ms"] = s.wait_ms;
  d["exposed_ms"] = s.exposed_ms;
  d["blocks_in_flight"] = s.blocks_in_flight;
  d["control_connections"] = s.control_connections;
  d["connections_refused"] = s.connections_refused;
  d["handshakes"] = s.handshakes;
  d["handshake_failures"] = s.handshake_failures;
  nb::list buckets, counts;
  for (double b : ConnectorStats::kLatencyBucketsMs) buckets.append(b);
  for (uint64_t c : s.latency_counts) counts.append(c);
  d["latency_buckets_ms"] = buckets;  // upper bounds; counts has one more entry (+Inf)
  d["latency_counts"] = counts;
  d["latency_sum_ms"] = s.latency_sum_ms;
  return d;
}

namespace {

using Scheduled = std::tuple<std::string, int32_t, int32_t>;

KvConnectorScheduler& Scheduler(PyConnectorScheduler& s) { return *s.scheduler; }

KvConnectorWorker& Worker(PyConnectorWorker& w) {
  if (w.worker == nullptr) {
    ThrowStatus(absl::FailedPreconditionError("ConnectorWorker: closed"));
  }
  return *w.worker;
}

nb::bytes Bytes(const std::string& s) { return nb::bytes(s.data(), s.size()); }

std::string FromBytes(nb::bytes b) { return std::string(b.c_str(), b.size()); }

// Runs `f` with the GIL released and raises its error.
template <typename F>
auto Released(F&& f) {
  using R = decltype(f());
  if constexpr (std::is_same_v<R, absl::Status>) {
    absl::Status s;
    {
      nb::gil_scoped_release release;
      s = f();
    }
    ThrowIfError(s);
  } else {
    std::optional<R> r;
    {
      nb::gil_scoped_release release;
      r.emplace(f());
    }
    return Unwrap(std::move(*r));
  }
}

void CloseWorker(PyConnectorWorker& w) {
  {
    // Joins the worker's threads and closes its sockets and transport.
    nb::gil_scoped_release release;
    w.worker.reset();
  }
  w.caches.clear();
}

nb::dict RequestStatsToDict(const RequestTransferStats& r) {
  nb::dict d;
  d["request_id"] = r.request_id;
  d["bytes"] = r.bytes;
  d["layer_arrival_ms"] = nb::cast(r.layer_arrival_ms);
  d["wait_ms"] = r.wait_ms;
  d["transfer_ms"] = r.transfer_ms;
  d["exposed_ms"] = r.exposed_ms;
  d["layer_in_flight_ms"] = nb::cast(r.layer_in_flight_ms);
  d["handoff_ns"] = r.handoff_ns;
  return d;
}

nb::dict SendStatsToDict(const RequestSendStats& r) {
  nb::dict d;
  d["request_id"] = r.request_id;
  d["consumer_request_id"] = r.consumer_request_id;
  d["ok"] = r.ok;
  d["bytes"] = r.bytes;
  d["layer_ready_ns"] = nb::cast(r.layer_ready_ns);
  d["layer_sent_ns"] = nb::cast(r.layer_sent_ns);
  return d;
}

}  // namespace

PyConnectorWorker::~PyConnectorWorker() {
  // Explicitly first: its registrations of the caches' memory go before the caches.
  worker.reset();
}

void BindConnector(nb::module_& m) {
  nb::class_<KvRequest>(m, "Request",
                        "A request as the connector sees it: its id, prompt tokens and, on a "
                        "consumer, where its prompt is prefilled (remote_prefill).")
      .def("__init__",
           [](KvRequest* self, std::string request_id, std::vector<int32_t> prompt_token_ids,
              std::optional<std::pair<std::string, int32_t>> remote_prefill) {
             new (self) KvRequest();
             self->request_id = std::move(request_id);
             self->prompt_token_ids = std::move(prompt_token_ids);
             if (remote_prefill.has_value()) {
               self->remote_prefill = RemotePrefill{remote_prefill->first, remote_prefill->second};
             }
           },
           "request_id"_a, "prompt_token_ids"_a, "remote_prefill"_a = nb::none(),
           "remote_prefill: (host, port) of the producer's control address, or None.")
      .def_rw("request_id", &KvRequest::request_id)
      .def_rw("prompt_token_ids", &KvRequest::prompt_token_ids)
      .def_prop_rw(
          "remote_prefill",
          [](const KvRequest& r) -> std::optional<std::pair<std::string, int32_t>> {
            if (!r.remote_prefill.has_value()) return std::nullopt;
            return std::make_pair(r.remote_prefill->host, r.remote_prefill->port);
          },
          [](KvRequest& r, std::optional<std::pair<std::string, int32_t>> v) {
            if (v.has_value()) {
              r.remote_prefill = RemotePrefill{v->first, v->second};
            } else {
              r.remote_prefill.reset();
            }
          },
          nb::arg("value").none())
      .def("__repr__", [](const KvRequest& r) {
        return absl::StrCat("Request(", r.request_id, ", ", r.prompt_token_ids.size(),
                            " prompt tokens",
                            r.remote_prefill.has_value()
                                ? absl::StrCat(", remote ", r.remote_prefill->host, ":",
                                               r.remote_prefill->port)
                                : "",
                            ")");
      });

  using SchedulerPtr = PyConnectorScheduler;
  nb::class_<SchedulerPtr>(
      m, "ConnectorScheduler",
      "The connector's scheduler side (vLLM's scheduler process): per request, how many "
      "tokens come from remote, its blocks, and the step's metadata as bytes. Not "
      "thread-safe: call it from one thread.")
      .def("__init__",
           [](SchedulerPtr* self, nb::handle kv_transfer_config, int32_t block_size) {
             KvTransferConfig c = ConfigFromPython(kv_transfer_config);
             std::unique_ptr<KvConnectorScheduler> s =
                 Released([&] { return CreateKvConnectorScheduler(c, block_size); });
             new (self) SchedulerPtr();
             self->scheduler = std::move(s);
           },
           "kv_transfer_config"_a, "block_size"_a,
           "kv_transfer_config: a dict with the keys of vLLM's KVTransferConfig (kvstream's "
           "own settings under kv_connector_extra_config); block_size: tokens per cache block.")
      .def_prop_ro("role",
                   [](SchedulerPtr& s) { return std::string(KvRoleName(Scheduler(s).role())); })
      .def("get_num_new_matched_tokens",
           [](SchedulerPtr& s, const KvRequest& request, int32_t num_computed_tokens) {
             MatchedTokens t = Unwrap(Scheduler(s).GetNumNewMatchedTokens(request, num_computed_tokens));
             return std::make_tuple(t.num_tokens, t.load_async);
           },
           "request"_a, "num_computed_tokens"_a,
           "(num_tokens, load_async): prompt tokens beyond num_computed_tokens whose KV comes "
           "from remote, and whether the load is asynchronous.")
      .def("update_state_after_alloc",
           [](SchedulerPtr& s, const KvRequest& request, std::vector<int32_t> block_ids,
              int32_t num_external_tokens) {
             ThrowIfError(Scheduler(s).UpdateStateAfterAlloc(request, block_ids, num_external_tokens));
           },
           "request"_a, "block_ids"_a, "num_external_tokens"_a)
      .def("build_connector_meta",
           [](SchedulerPtr& s, const std::vector<Scheduled>& scheduled) {
             std::vector<ScheduledRequest> rs;
             for (const auto& [id, computed, count] : scheduled) rs.push_back({id, computed, count});
             KvConnectorMetadata meta = Unwrap(Scheduler(s).BuildConnectorMeta(rs));
             return Bytes(Unwrap(EncodeConnectorMetadata(meta)));
           },
           "scheduled"_a,
           "The step's metadata, encoded: scheduled is a list of (request_id, "
           "num_computed_tokens, num_scheduled_tokens).")
      .def("update_connector_output",
           [](SchedulerPtr& s, nb::bytes output) {
             KvConnectorOutput out = Unwrap(DecodeConnectorOutput(FromBytes(output)));
             ThrowIfError(Scheduler(s).UpdateConnectorOutput(out));
           },
           "output"_a, "A worker's take_output() bytes. InvalidArgumentError for malformed bytes.")
      .def("request_finished",
           [](SchedulerPtr& s, const std::string& request_id) {
             return Unwrap(Scheduler(s).RequestFinished(request_id));
           },
           "request_id"_a,
           "True when a worker still uses the request's blocks (free them once an output "
           "lists the request finished sending or receiving).")
      .def("take_incoming_requests",
           [](SchedulerPtr& s) { return Scheduler(s).TakeIncomingRequests(); },
           "Producer: requests handed over by consumers since the last call.");

  nb::class_<PyConnectorWorker>(
      m, "ConnectorWorker",
      "The connector's worker side (each vLLM worker process): owns the transport, the "
      "control channel and the caches' registrations, loads and saves around every layer. "
      "Methods may be called from any thread; the blocking ones release the GIL.")
      .def("__init__",
           [](PyConnectorWorker* self, nb::handle kv_transfer_config) {
             KvTransferConfig c = ConfigFromPython(kv_transfer_config);
             std::unique_ptr<KvConnectorWorker> w =
                 Released([&] { return CreateKvConnectorWorker(c); });
             new (self) PyConnectorWorker();
             self->worker = std::move(w);
           },
           "kv_transfer_config"_a,
           "Creates the transport (by kv_connector_extra_config.transport, default by "
           "kv_buffer_device); a producer starts listening at once.")
      .def_prop_ro("role", [](PyConnectorWorker& w) { return std::string(KvRoleName(Worker(w).role())); })
      .def_prop_ro("engine_id", [](PyConnectorWorker& w) { return Worker(w).config().engine_id; })
      .def_prop_ro("control_address", [](PyConnectorWorker& w) { return Worker(w).control_address(); },
                   "Producer: the \"ip:port\" it listens on.")
      .def_prop_ro("closed", [](const PyConnectorWorker& w) { return w.worker == nullptr; })
      .def("set_model_info",
           [](PyConnectorWorker& w, int32_t vocab_size, int64_t max_model_len,
              std::string fingerprint) {
             KvModelInfo info{vocab_size, max_model_len, std::move(fingerprint)};
             ThrowIfError(Worker(w).SetModelInfo(info));
           },
           "vocab_size"_a = 0, "max_model_len"_a = 0, "fingerprint"_a = "",
           "Before register_kv_caches: what the model allows (checked per hand-off, hashed "
           "into the compatibility check). 0 / empty: unknown.")
      .def("allocate_cache_memory",
           [](PyConnectorWorker& w, size_t nbytes, const std::string& memory) -> nb::object {
             MemoryKind kind;
             if (memory == "host") kind = MemoryKind::kHost;
             else if (memory == "device") kind = MemoryKind::kDevice;
             else {
               ThrowStatus(absl::InvalidArgumentError(absl::StrCat(
                   "allocate_cache_memory: memory '", memory, "' (use host or device)")));
             }
             KvConnectorWorker& worker = Worker(w);
             std::shared_ptr<void> mem =
                 Released([&] { return worker.AllocateCacheMemory(nbytes, kind); });
             auto* holder = new std::shared_ptr<void>(std::move(mem));
             nb::capsule owner(holder, [](void* p) noexcept {
               delete static_cast<std::shared_ptr<void>*>(p);
             });
             TensorView view(holder->get(), DType::kUInt8, {static_cast<int64_t>(nbytes)},
                             kind);
             return ExportArray(view, owner);
           },
           "nbytes"_a, "memory"_a = "host",
           "Zero-filled, 64-byte aligned memory that peers write fastest (UCX over shared "
           "memory: one-sided copies), as a uint8 array: numpy for host memory, a DLPack "
           "array for device memory (torch.from_dlpack). Carve caches out of it with views "
           "and KvCache.borrow.")
      .def("register_kv_caches",
           [](PyConnectorWorker& w, std::map<std::string, nb::object> caches) {
             std::map<std::string, KvCache*> by_name;
             for (auto& [name, obj] : caches) {
               PyKvCache* c = nullptr;
               if (!nb::try_cast<PyKvCache*>(obj, c, false) || c == nullptr) {
                 ThrowStatus(absl::InvalidArgumentError(
                     absl::StrCat("register_kv_caches: ", name, " is not a kvstream.KvCache")));
               }
               by_name[name] = c->cache.get();
             }
             KvConnectorWorker& worker = Worker(w);
             Released([&] { return worker.RegisterKvCaches(by_name); });
             for (auto& [name, obj] : caches) w.caches[name] = obj;
           },
           "caches"_a,
           "{layer name: KvCache}, once, before any step; registers their memory with the "
           "transport. The worker keeps the caches alive.")
      .def("bind_connector_metadata",
           [](PyConnectorWorker& w, nb::bytes metadata) {
             KvConnectorMetadata meta = Unwrap(DecodeConnectorMetadata(FromBytes(metadata)));
             ThrowIfError(Worker(w).BindConnectorMetadata(meta));
           },
           "metadata"_a, "The step's metadata bytes from build_connector_meta.")
      .def("start_load_kv",
           [](PyConnectorWorker& w) {
             KvConnectorWorker& worker = Worker(w);
             Released([&] { return worker.StartLoadKv(); });
           },
           "Consumer: hands the step's loads to their producers (connecting on first use); "
           "does not wait for KV.")
      .def("wait_for_layer_load",
           [](PyConnectorWorker& w, const std::string& layer_name, uintptr_t stream) {
             KvConnectorWorker& worker = Worker(w);
             Released([&] {
               return worker.BeforeAttention(layer_name, reinterpret_cast<void*>(stream));
             });
           },
           "layer_name"_a, "stream"_a = 0,
           "The hook before a layer's attention: blocks (GIL released) until the layer's KV "
           "has arrived for every request of the step, or the load timeout. stream: the "
           "layer's cudaStream_t as an int for device caches, 0 for host caches.")
      .def("save_kv_layer",
           [](PyConnectorWorker& w, const std::string& layer_name, std::optional<nb::object> kv_cache,
              std::optional<nb::object> metadata, uintptr_t stream) {
             KvConnectorWorker& worker = Worker(w);
             const KvCache* cache = nullptr;
             if (kv_cache.has_value()) {
               cache = nb::cast<PyKvCache&>(*kv_cache).cache.get();
             } else {
               auto it = w.caches.find(layer_name);
               // A layer with no cache of its own (it shares another's KV) sends nothing,
               // as the C++ hook does for layers it has not registered.
               if (it == w.caches.end()) return;
               cache = nb::cast<PyKvCache&>(it->second).cache.get();
             }
             AttentionMetadata empty;
             const AttentionMetadata* md = &empty;
             if (metadata.has_value()) md = &nb::cast<PyAttentionMetadata&>(*metadata).metadata;
             Released([&] {
               return worker.AfterAttention(layer_name, *cache, *md, reinterpret_cast<void*>(stream));
             });
           },
           "layer_name"_a, "kv_cache"_a = nb::none(), "metadata"_a = nb::none(), "stream"_a = 0,
           "The hook after a layer's attention: posts the layer's blocks of the step's saves "
           "without waiting. kv_cache: default the one registered under layer_name (a layer "
           "with none, e.g. one sharing another's KV, sends nothing); stream: "
           "for device caches the stream the cache update was enqueued on (as an int).")
      .def("wait_for_save",
           [](PyConnectorWorker& w) {
             KvConnectorWorker& worker = Worker(w);
             Released([&] { return worker.WaitForSave(); });
           },
           "The end of a step's saves: the first error a save of this step met.")
      .def("clear_connector_metadata", [](PyConnectorWorker& w) { Worker(w).ClearConnectorMetadata(); })
      .def("take_output",
           [](PyConnectorWorker& w) {
             KvConnectorOutput out = Unwrap(Worker(w).TakeOutput());
             for (const LoadError& e : out.load_errors) {
               w.load_error_blocks.insert(e.block_ids.begin(), e.block_ids.end());
             }
             return Bytes(Unwrap(EncodeConnectorOutput(out)));
           },
           "What happened since the last call (sends and loads finished, load errors, "
           "hand-offs), encoded for the scheduler's update_connector_output. Never blocks.")
      .def("get_block_ids_with_load_errors",
           [](PyConnectorWorker& w) {
             std::set<int32_t> ids = std::move(w.load_error_blocks);
             w.load_error_blocks.clear();
             return ids;
           },
           "The blocks of the load errors in the outputs taken (take_output) since the last "
           "call: their contents are garbage.")
      .def("stats", [](PyConnectorWorker& w) { return StatsToDict(Worker(w).stats()); },
           "Totals over every peer, as a dict. Never blocks on transfers.")
      .def("peer_stats",
           [](PyConnectorWorker& w) {
             nb::dict d;
             for (const PeerConnectorStats& p : Worker(w).peer_stats()) {
               d[nb::str(p.peer.c_str())] = StatsToDict(p.stats);
             }
             return d;
           },
           "{peer: stats dict}.")
      .def("take_request_stats",
           [](PyConnectorWorker& w) {
             nb::list l;
             for (const RequestTransferStats& r : Worker(w).TakeRequestStats()) {
               l.append(RequestStatsToDict(r));
             }
             return l;
           })
      .def("take_send_stats",
           [](PyConnectorWorker& w) {
             nb::list l;
             for (const RequestSendStats& r : Worker(w).TakeSendStats()) l.append(SendStatsToDict(r));
             return l;
           })
      .def("close", &CloseWorker,
           "Destroys the worker (GIL released: joins its threads, closes its transport), "
           "then drops the registered caches. Later calls raise FailedPreconditionError.")
      .def("__enter__", [](nb::handle self) { return nb::borrow(self); })
      .def("__exit__", [](PyConnectorWorker& w, nb::args) { CloseWorker(w); });

  m.def("kv_connector_names", &KvConnectorNames);
}

}  // namespace kvstream::python
