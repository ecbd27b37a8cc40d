// The Python-side owners of kvstream's C++ objects, shared by the binding files: each holds
// its C++ object and strong references to the Python objects whose memory or lifetime it
// depends on (a borrowed cache its arrays, a layer its registry, a worker its registered
// caches), so that Python's reference counting keeps every C++ contract about lifetimes.
#ifndef KVSTREAM_PYTHON_OBJECTS_H_
#define KVSTREAM_PYTHON_OBJECTS_H_

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include "kvstream/attention/attention.h"
#include "kvstream/attention/layer_registry.h"
#include "kvstream/attention/metadata.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/connector/kv_connector_scheduler.h"
#include "kvstream/connector/kv_connector_worker.h"

namespace kvstream::python {

// kvstream.KvCache. `k_array`/`v_array`: the borrowed objects (none for owned caches);
// `k_import`/`v_import`: nanobind's imports of them, which hold the DLPack exporter's
// tensor (the memory's owner when the object was a bare DLPack capsule).
struct PyKvCache {
  std::unique_ptr<KvCache> cache;
  nanobind::object k_array;
  nanobind::object v_array;
  nanobind::ndarray<> k_import;
  nanobind::ndarray<> v_import;
};

// kvstream.AttentionMetadata.
struct PyAttentionMetadata {
  AttentionMetadata metadata;
};

// kvstream.ConnectorScheduler.
struct PyConnectorScheduler {
  std::unique_ptr<KvConnectorScheduler> scheduler;
};

// kvstream.ConnectorWorker. The worker is destroyed before the caches it registered
// (their references are dropped after it, so their memory outlives its registrations).
struct PyConnectorWorker {
  std::unique_ptr<KvConnectorWorker> worker;
  std::map<std::string, nanobind::object> caches;  // layer name -> PyKvCache
  // Blocks of the load errors in the outputs taken since get_block_ids_with_load_errors.
  std::set<int32_t> load_error_blocks;
  ~PyConnectorWorker();
};

// kvstream.LayerRegistry. The registry is held by pointer so that layers (which refer to it)
// can keep it alive through `self` references; the bound caches, the hook and the device
// metadata arrays are referenced until replaced.
struct PyLayerRegistry {
  std::unique_ptr<LayerRegistry> registry = std::make_unique<LayerRegistry>();
  std::map<std::string, nanobind::object> caches;
  nanobind::object hook;                // PyConnectorWorker or None
  // Forwards to the hook's worker while it is open (FailedPrecondition once closed), so
  // that closing a worker bound here never leaves the registry a dangling pointer.
  std::unique_ptr<TransferHook> hook_adapter;
  nanobind::object metadata;            // PyAttentionMetadata or None
  std::vector<nanobind::object> device_arrays;
  DeviceAttentionMetadata device;
};

// kvstream.Attention: the layer and its registry (which must outlive it).
struct PyAttention {
  std::unique_ptr<Attention> layer;
  nanobind::object registry;  // PyLayerRegistry
  ~PyAttention() { layer.reset(); }  // unregisters while the registry is alive
};

void BindCaches(nanobind::module_& m);
void BindAttention(nanobind::module_& m);
void BindConnector(nanobind::module_& m);
void BindConnectorMessages(nanobind::module_& m);

}  // namespace kvstream::python

#endif  // KVSTREAM_PYTHON_OBJECTS_H_
