// kvstream.LayerRegistry, kvstream.AttentionMetadata and kvstream.Attention: the attention
// layer's forward on caller-owned arrays (CPU; CUDA in builds with it), wrapped by the
// registry's transfer hook (a ConnectorWorker).
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "errors.h"
#include "kvstream/attention/attention.h"
#include "kvstream/attention/cuda_attention.h"
#include "kvstream/attention/metadata.h"
#include "objects.h"
#include "tensors.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvstream::python {
namespace {

using Sequence = std::tuple<int32_t, int32_t, std::vector<int32_t>>;

// A host tensor handed to Python: the array owns it through a capsule.
nb::object TensorToArray(Tensor tensor) {
  auto* owned = new Tensor(std::move(tensor));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  return ExportArray(owned->view(), owner);
}

// A device array of the metadata, checked against its host copy: CUDA memory, `dtype`,
// 1-D, contiguous, `n` elements.
const void* DeviceArray(nb::handle object, const char* what, DType dtype, size_t n) {
  Array a = CastArray(object, what);
  TensorView v = Unwrap(ToTensorView(a, what));
  if (v.memory() != MemoryKind::kDevice || v.dtype() != dtype || v.dim() != 1 ||
      static_cast<size_t>(v.numel()) != n || !v.is_contiguous()) {
    ThrowStatus(absl::InvalidArgumentError(absl::StrCat(
        "device metadata ", what, ": expected a contiguous 1-D CUDA array of ", n, " ",
        DTypeName(dtype), ", got ", v.DebugString(), " in ", MemoryKindName(v.memory()),
        " memory")));
  }
  return v.data();
}

class WorkerHook final : public TransferHook {
 public:
  explicit WorkerHook(PyConnectorWorker* worker) : worker_(worker) {}
  absl::Status BeforeAttention(absl::string_view layer_name, void* stream) override {
    if (worker_->worker == nullptr) return Closed();
    return worker_->worker->BeforeAttention(layer_name, stream);
  }
  absl::Status AfterAttention(absl::string_view layer_name, const KvCache& kv_cache,
                              const AttentionMetadata& metadata, void* stream) override {
    if (worker_->worker == nullptr) return Closed();
    return worker_->worker->AfterAttention(layer_name, kv_cache, metadata, stream);
  }

 private:
  static absl::Status Closed() {
    return absl::FailedPreconditionError("transfer hook: the ConnectorWorker is closed");
  }
  PyConnectorWorker* worker_;  // kept alive by PyLayerRegistry::hook
};

std::unique_ptr<PyAttention> MakeAttention(
    nb::object registry, int num_heads, int head_size, float scale,
    std::optional<int> num_kv_heads, std::vector<float> alibi_slopes,
    std::optional<int> sliding_window, std::string kv_cache_dtype,
    std::optional<float> logits_soft_cap, std::string attn_type,
    std::optional<std::string> kv_sharing_target_layer_name, std::optional<nb::dict> kv_cache_scheme,
    std::string prefix, std::optional<int> head_size_v, std::string dtype, int block_size,
    std::string backend, bool batch_invariant) {
  PyLayerRegistry& r = nb::cast<PyLayerRegistry&>(registry);
  AttentionOptions o;
  o.num_heads = num_heads;
  o.head_size = head_size;
  o.scale = scale;
  o.num_kv_heads = num_kv_heads;
  o.alibi_slopes = std::move(alibi_slopes);
  o.sliding_window = sliding_window;
  o.kv_cache_dtype = std::move(kv_cache_dtype);
  o.logits_soft_cap = logits_soft_cap;
  o.attn_type = Unwrap(ParseAttentionType(attn_type));
  o.kv_sharing_target_layer_name = std::move(kv_sharing_target_layer_name);
  if (kv_cache_scheme.has_value()) {
    KvCacheScheme s;
    for (auto [key, value] : *kv_cache_scheme) {
      const std::string k = nb::cast<std::string>(key);
      if (k == "type") s.type = nb::cast<std::string>(value);
      else if (k == "num_bits") s.num_bits = nb::cast<int>(value);
      else if (k == "strategy") s.strategy = nb::cast<std::string>(value);
      else if (k == "dynamic") s.dynamic = nb::cast<bool>(value);
      else if (k == "symmetric") s.symmetric = nb::cast<bool>(value);
      else {
        ThrowStatus(absl::InvalidArgumentError(absl::StrCat(
            "kv_cache_scheme: unknown key '", k,
            "' (known: type, num_bits, strategy, dynamic, symmetric)")));
      }
    }
    o.quant_config = QuantConfig{s};
  }
  o.prefix = std::move(prefix);
  o.head_size_v = head_size_v;
  o.dtype = Unwrap(ParseDType(dtype));
  o.block_size = block_size;
  o.backend = std::move(backend);
  o.batch_invariant = batch_invariant;
  auto out = std::make_unique<PyAttention>();
  {
    nb::gil_scoped_release release;  // the CUDA backend creates a stream
    out->layer = Unwrap(Attention::Create(o, r.registry.get()));
  }
  out->registry = std::move(registry);
  return out;
}

}  // namespace

void BindAttention(nb::module_& m) {
  nb::class_<PyAttentionMetadata>(
      m, "AttentionMetadata",
      "One forward step's batch: per sequence its query rows, key count and block table "
      "row, and the slot of each new key token. Build it with build_attention_metadata.")
      .def("__init__",
           [](PyAttentionMetadata* self, std::vector<int32_t> query_start_loc,
              std::vector<int32_t> seq_lens, std::vector<int32_t> block_table,
              int32_t max_blocks_per_seq, std::vector<int64_t> slot_mapping,
              int64_t num_actual_tokens, int32_t max_query_len, int32_t max_seq_len) {
             new (self) PyAttentionMetadata();
             AttentionMetadata& md = self->metadata;
             md.query_start_loc = std::move(query_start_loc);
             md.seq_lens = std::move(seq_lens);
             md.block_table = std::move(block_table);
             md.max_blocks_per_seq = max_blocks_per_seq;
             md.slot_mapping = std::move(slot_mapping);
             md.num_actual_tokens = num_actual_tokens;
             md.max_query_len = max_query_len;
             md.max_seq_len = max_seq_len;
           },
           "query_start_loc"_a, "seq_lens"_a, "block_table"_a, "max_blocks_per_seq"_a,
           "slot_mapping"_a, "num_actual_tokens"_a, "max_query_len"_a, "max_seq_len"_a,
           "The fields as lists, unchecked; validate() checks them.")
      .def_prop_ro("query_start_loc", [](const PyAttentionMetadata& p) { return p.metadata.query_start_loc; })
      .def_prop_ro("seq_lens", [](const PyAttentionMetadata& p) { return p.metadata.seq_lens; })
      .def_prop_ro("block_table", [](const PyAttentionMetadata& p) { return p.metadata.block_table; })
      .def_prop_ro("max_blocks_per_seq", [](const PyAttentionMetadata& p) { return p.metadata.max_blocks_per_seq; })
      .def_prop_ro("slot_mapping", [](const PyAttentionMetadata& p) { return p.metadata.slot_mapping; })
      .def_prop_ro("num_actual_tokens", [](const PyAttentionMetadata& p) { return p.metadata.num_actual_tokens; })
      .def_prop_ro("max_query_len", [](const PyAttentionMetadata& p) { return p.metadata.max_query_len; })
      .def_prop_ro("max_seq_len", [](const PyAttentionMetadata& p) { return p.metadata.max_seq_len; })
      .def_prop_ro("num_seqs", [](const PyAttentionMetadata& p) { return p.metadata.num_seqs(); })
      .def("validate",
           [](const PyAttentionMetadata& p, int block_size, int64_t num_blocks) {
             ThrowIfError(p.metadata.Validate(block_size, num_blocks));
           },
           "block_size"_a, "num_blocks"_a);

  m.def("build_attention_metadata",
        [](const std::vector<Sequence>& sequences, int block_size, int num_padding_tokens) {
          std::vector<SequenceSchedule> s;
          s.reserve(sequences.size());
          for (const auto& [context_len, query_len, block_ids] : sequences) {
            s.push_back({context_len, query_len, block_ids});
          }
          auto out = std::make_unique<PyAttentionMetadata>();
          out->metadata = Unwrap(BuildAttentionMetadata(s, block_size, num_padding_tokens));
          return out.release();
        },
        "sequences"_a, "block_size"_a, "num_padding_tokens"_a = 0, nb::rv_policy::take_ownership,
        "sequences: (context_len, query_len, block_ids) per sequence; query tokens of a "
        "sequence sit at positions context_len .. context_len + query_len - 1.");

  nb::class_<PyLayerRegistry>(
      m, "LayerRegistry",
      "One engine's attention layers by name, their caches, the step's forward context and "
      "the transfer hook. Not thread-safe: drive it from one thread at a time.")
      .def(nb::init<>())
      .def_prop_ro("layer_names", [](const PyLayerRegistry& r) { return r.registry->layer_names(); })
      .def("__contains__", [](const PyLayerRegistry& r, const std::string& name) {
        return r.registry->Contains(name);
      })
      .def("bind_kv_cache",
           [](PyLayerRegistry& r, const std::string& name, nb::object cache) {
             PyKvCache& c = nb::cast<PyKvCache&>(cache);
             ThrowIfError(r.registry->BindKvCache(name, c.cache.get()));
             r.caches[name] = std::move(cache);
           },
           "layer_name"_a, "cache"_a,
           "NotFoundError for an unknown layer, InvalidArgumentError when the cache's spec "
           "is not the layer's, FailedPreconditionError for a KV-sharing layer.")
      .def("set_forward_context",
           [](PyLayerRegistry& r, std::optional<nb::object> metadata, bool dummy_run,
              std::optional<nb::tuple> device) {
             ForwardContext c;
             c.dummy_run = dummy_run;
             std::vector<nb::object> device_arrays;
             DeviceAttentionMetadata dev;
             if (metadata.has_value()) {
               const AttentionMetadata& md = nb::cast<PyAttentionMetadata&>(*metadata).metadata;
               c.metadata = &md;
               if (device.has_value()) {
                 if (device->size() != 4) {
                   ThrowStatus(absl::InvalidArgumentError(
                       "device: expected (query_start_loc, seq_lens, block_table, slot_mapping)"));
                 }
                 dev.query_start_loc = static_cast<const int32_t*>(DeviceArray(
                     (*device)[0], "query_start_loc", DType::kInt32, md.query_start_loc.size()));
                 dev.seq_lens = static_cast<const int32_t*>(
                     DeviceArray((*device)[1], "seq_lens", DType::kInt32, md.seq_lens.size()));
                 dev.block_table = static_cast<const int32_t*>(DeviceArray(
                     (*device)[2], "block_table", DType::kInt32, md.block_table.size()));
                 dev.slot_mapping = static_cast<const int64_t*>(DeviceArray(
                     (*device)[3], "slot_mapping", DType::kInt64, md.slot_mapping.size()));
                 for (size_t i = 0; i < 4; ++i) device_arrays.push_back(nb::borrow((*device)[i]));
               }
             }
             r.device = dev;
             if (device.has_value() && metadata.has_value()) c.device = &r.device;
             r.registry->SetForwardContext(c);
             r.metadata = metadata.has_value() ? *metadata : nb::none();
             r.device_arrays = std::move(device_arrays);
           },
           "metadata"_a = nb::none(), "dummy_run"_a = false, "device"_a = nb::none(),
           "The step's batch. metadata None or dummy_run: a profiling run (layers write "
           "zeros, update no cache, call no hook). Layers over device caches also need "
           "`device`: the same arrays in CUDA memory, (query_start_loc int32, seq_lens int32, "
           "block_table int32, slot_mapping int64). The registry keeps them alive until the "
           "next call.")
      .def("set_transfer_hook",
           [](PyLayerRegistry& r, std::optional<nb::object> hook) {
             if (!hook.has_value()) {
               r.registry->SetTransferHook(nullptr);
               r.hook_adapter.reset();
               r.hook = nb::none();
               return;
             }
             PyConnectorWorker& w = nb::cast<PyConnectorWorker&>(*hook);
             if (w.worker == nullptr) {
               ThrowStatus(absl::FailedPreconditionError("set_transfer_hook: the worker is closed"));
             }
             auto adapter = std::make_unique<WorkerHook>(&w);
             r.registry->SetTransferHook(adapter.get());
             r.hook_adapter = std::move(adapter);
             r.hook = *hook;
           },
           "worker"_a.none(),
           "Every layer's forward then calls the worker's wait_for_layer_load before its "
           "attention and save_kv_layer after it. None unbinds.");

  nb::class_<PyAttention>(m, "Attention",
                          "The attention layer with vLLM's constructor surface, over a paged "
                          "KvCache bound in its registry.")
      .def("__init__",
           [](PyAttention* self, nb::object registry, int num_heads, int head_size, float scale,
              std::optional<int> num_kv_heads, std::vector<float> alibi_slopes,
              std::optional<int> sliding_window, std::string kv_cache_dtype,
              std::optional<float> logits_soft_cap, std::string attn_type,
              std::optional<std::string> kv_sharing_target_layer_name,
              std::optional<nb::dict> kv_cache_scheme, std::string prefix,
              std::optional<int> head_size_v, std::string dtype, int block_size,
              std::string backend, bool batch_invariant) {
             std::unique_ptr<PyAttention> a = MakeAttention(
                 std::move(registry), num_heads, head_size, scale, num_kv_heads,
                 std::move(alibi_slopes), sliding_window, std::move(kv_cache_dtype),
                 logits_soft_cap, std::move(attn_type), std::move(kv_sharing_target_layer_name),
                 std::move(kv_cache_scheme), std::move(prefix), head_size_v, std::move(dtype),
                 block_size, std::move(backend), batch_invariant);
             new (self) PyAttention();
             self->layer = std::move(a->layer);
             self->registry = std::move(a->registry);
           },
           "registry"_a, "num_heads"_a, "head_size"_a, "scale"_a, "num_kv_heads"_a = nb::none(),
           "alibi_slopes"_a = std::vector<float>(), "sliding_window"_a = nb::none(),
           "kv_cache_dtype"_a = "auto", "logits_soft_cap"_a = nb::none(),
           "attn_type"_a = "decoder", "kv_sharing_target_layer_name"_a = nb::none(),
           "kv_cache_scheme"_a = nb::none(), "prefix"_a = "", "head_size_v"_a = nb::none(),
           "dtype"_a = "bfloat16", "block_size"_a = 16, "backend"_a = "cpu",
           "batch_invariant"_a = false,
           "Creates the layer and registers it in `registry` under `prefix` (the layer name). "
           "InvalidArgumentError naming a bad option, AlreadyExistsError for a duplicate "
           "name. backend: cpu, cpu_reference, cuda (builds with CUDA).")
      .def("forward",
           [](PyAttention& a, nb::handle query, nb::handle key, nb::handle value,
              nb::handle output) -> nb::object {
             Array qa = CastArray(query, "query");
             TensorView q = Unwrap(ToTensorView(qa, "query"));
             Array ka, va;
             TensorView k, v;
             if (!key.is_none()) {
               ka = CastArray(key, "key");
               k = Unwrap(ToTensorView(ka, "key"));
             }
             if (!value.is_none()) {
               va = CastArray(value, "value");
               v = Unwrap(ToTensorView(va, "value"));
             }
             if (!output.is_none()) {
               Array oa = CastArray(output, "output");
               TensorView o = Unwrap(ToTensorView(oa, "output"));
               absl::Status s;
               {
                 nb::gil_scoped_release release;
                 s = a.layer->Forward(q, k, v, o);
               }
               ThrowIfError(s);
               return nb::borrow(output);
             }
             absl::StatusOr<Tensor> out;
             {
               nb::gil_scoped_release release;
               out = a.layer->Forward(q, k, v);
             }
             return TensorToArray(Unwrap(std::move(out)));
           },
           "query"_a, "key"_a.none() = nb::none(), "value"_a.none() = nb::none(),
           "output"_a.none() = nb::none(),
           "One forward pass in the registry's forward context: cache update, the hook's "
           "wait, attention, the hook's send. query [num_tokens, num_heads * head_size] (or "
           "3-D); key/value [num_kv_tokens, num_kv_heads * head_size(_v)] or None; output "
           "written when given (device caches: required, and written on the layer's stream, "
           "see synchronize), else a new host array is returned. The GIL is released.")
      .def("synchronize",
           [](PyAttention& a, double timeout_s) {
             CudaAttentionBackend* cuda = AsCudaAttentionBackend(&a.layer->backend());
             if (cuda == nullptr) return;  // CPU backends finish inside forward
             absl::Status s;
             {
               nb::gil_scoped_release release;
               s = cuda->Synchronize(absl::Seconds(timeout_s));
             }
             ThrowIfError(s);
           },
           "timeout_s"_a = 60.0,
           "Waits until the layer's enqueued work has finished (CUDA backend; no-op on the "
           "CPU). DeadlineExceededError after timeout_s.")
      .def_prop_ro("stream",
                   [](PyAttention& a) -> uintptr_t {
                     CudaAttentionBackend* cuda = AsCudaAttentionBackend(&a.layer->backend());
                     return cuda == nullptr ? 0 : reinterpret_cast<uintptr_t>(cuda->stream());
                   },
                   "The cudaStream_t the CUDA backend enqueues on (as an int), 0 on the CPU.")
      .def_prop_ro("kv_cache_spec", [](const PyAttention& a) { return a.layer->kv_cache_spec(); })
      .def_prop_ro("layer_name", [](const PyAttention& a) { return a.layer->layer_name(); })
      .def_prop_ro("num_kv_heads", [](const PyAttention& a) { return a.layer->num_kv_heads(); })
      .def_prop_ro("head_size_v", [](const PyAttention& a) { return a.layer->head_size_v(); })
      .def_prop_ro("kv_cache_dtype",
                   [](const PyAttention& a) { return std::string(KvCacheDTypeName(a.layer->kv_cache_dtype())); })
      .def_prop_ro("shares_kv", [](const PyAttention& a) { return a.layer->shares_kv(); })
      .def_prop_ro("kv_cache_owner", [](const PyAttention& a) { return a.layer->kv_cache_owner(); })
      .def_prop_ro("backend", [](PyAttention& a) { return std::string(a.layer->backend().name()); })
      .def_prop_rw("kv_cache_update_bypass",
                   [](const PyAttention& a) { return a.layer->kv_cache_update_bypass(); },
                   [](PyAttention& a, bool b) { a.layer->set_kv_cache_update_bypass(b); });

  m.def("attention_backend_names", &AttentionBackendNames);
}

}  // namespace kvstream::python
