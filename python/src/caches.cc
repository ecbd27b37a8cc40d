// kvstream.KvCacheSpec and kvstream.KvCache: cache specs, and caches over arrays the caller
// owns (borrowed, no copy) or allocated by kvstream.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "absl/strings/str_cat.h"
#include "errors.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/cache/kv_cache_spec.h"
#include "kvstream/common/dtype.h"
#include "objects.h"
#include "tensors.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvstream::python {
namespace {

absl::StatusOr<KvQuantMode> ParseQuantMode(const std::string& name) {
  for (KvQuantMode m : {KvQuantMode::kNone, KvQuantMode::kPerTensor, KvQuantMode::kPerHead}) {
    if (name == KvQuantModeName(m)) return m;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown quant_mode '", name, "' (use none, per_tensor or per_head)"));
}

absl::StatusOr<MemoryKind> ParseMemoryKind(const std::string& name) {
  for (MemoryKind k : {MemoryKind::kHost, MemoryKind::kPinned, MemoryKind::kDevice}) {
    if (name == MemoryKindName(k)) return k;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown memory kind '", name, "' (use ", MemoryKindName(MemoryKind::kHost), ", ",
      MemoryKindName(MemoryKind::kPinned), " or ", MemoryKindName(MemoryKind::kDevice), ")"));
}

KvCacheSpec MakeSpec(int block_size, int num_kv_heads, int head_size, int head_size_v,
                     const std::string& dtype, const std::string& quant_mode) {
  KvCacheSpec spec;
  spec.block_size = block_size;
  spec.num_kv_heads = num_kv_heads;
  spec.head_size = head_size;
  spec.head_size_v = head_size_v == 0 ? head_size : head_size_v;
  spec.dtype = Unwrap(ParseDType(dtype));
  spec.quant_mode = Unwrap(ParseQuantMode(quant_mode));
  ThrowIfError(spec.Validate());
  return spec;
}

}  // namespace

void BindCaches(nb::module_& m) {
  nb::class_<KvCacheSpec>(m, "KvCacheSpec",
                          "One layer's paged KV cache shape: K is [num_blocks, block_size, "
                          "num_kv_heads, head_size], V the same with head_size_v.")
      .def("__init__",
           [](KvCacheSpec* self, int block_size, int num_kv_heads, int head_size,
              int head_size_v, const std::string& dtype, const std::string& quant_mode) {
             new (self) KvCacheSpec(
                 MakeSpec(block_size, num_kv_heads, head_size, head_size_v, dtype, quant_mode));
           },
           "block_size"_a = 16, "num_kv_heads"_a, "head_size"_a, "head_size_v"_a = 0,
           "dtype"_a = "bfloat16", "quant_mode"_a = "none",
           "Validates the spec (InvalidArgumentError naming what is wrong). head_size_v=0 "
           "means head_size. dtype: bfloat16, float16, float32, fp8_e4m3, fp8_e5m2; "
           "quant_mode: none, per_tensor, per_head (fp8 needs one of the last two).")
      .def_ro("block_size", &KvCacheSpec::block_size)
      .def_ro("num_kv_heads", &KvCacheSpec::num_kv_heads)
      .def_ro("head_size", &KvCacheSpec::head_size)
      .def_ro("head_size_v", &KvCacheSpec::head_size_v)
      .def_prop_ro("dtype", [](const KvCacheSpec& s) { return DTypeString(s.dtype); })
      .def_prop_ro("quant_mode",
                   [](const KvCacheSpec& s) { return std::string(KvQuantModeName(s.quant_mode)); })
      .def_prop_ro("bytes_per_token", &KvCacheSpec::BytesPerToken)
      .def_prop_ro("bytes_per_block", &KvCacheSpec::BytesPerBlock)
      .def_prop_ro("k_bytes_per_block", &KvCacheSpec::KBytesPerBlock)
      .def_prop_ro("v_bytes_per_block", &KvCacheSpec::VBytesPerBlock)
      .def("__eq__", [](const KvCacheSpec& a, const KvCacheSpec& b) { return a == b; })
      .def("__repr__", [](const KvCacheSpec& s) { return "KvCacheSpec(" + s.DebugString() + ")"; });

  m.def("resolve_kv_cache_dtype",
        [](const std::string& kv_cache_dtype, const std::string& model_dtype) {
          const KvCacheDType d = Unwrap(ParseKvCacheDType(kv_cache_dtype));
          return DTypeString(ResolveKvCacheDType(d, Unwrap(ParseDType(model_dtype))));
        },
        "kv_cache_dtype"_a, "model_dtype"_a = "bfloat16",
        "The storage dtype of a cache dtype as configured (\"auto\" -> model_dtype, \"fp8\" -> "
        "fp8_e4m3, ...). InvalidArgumentError for unknown names.");

  nb::class_<PyKvCache>(m, "KvCache",
                        "One layer's paged K and V buffers, borrowed from arrays the caller "
                        "owns (KvCache.borrow) or allocated by kvstream (KvCache.create).")
      .def_static(
          "borrow",
          [](const KvCacheSpec& spec, nb::object k, nb::object v) {
            Array ka = CastArray(k, "k");
            Array va = CastArray(v, "v");
            TensorView kv = Unwrap(ToTensorView(ka, "k", spec.dtype));
            TensorView vv = Unwrap(ToTensorView(va, "v", spec.dtype));
            auto out = std::make_unique<PyKvCache>();
            out->cache = Unwrap(KvCache::Borrow(spec, kv, vv));
            out->k_array = std::move(k);
            out->v_array = std::move(v);
            out->k_import = std::move(ka);
            out->v_import = std::move(va);
            return out.release();
          },
          "spec"_a, "k"_a, "v"_a, nb::rv_policy::take_ownership,
          "Wraps two DLPack arrays (numpy, torch CPU or CUDA, cupy) without copying. Each is "
          "4-D with logical shape [num_blocks, block_size, num_kv_heads, head_size(_v)], any "
          "non-negative strides with the last one 1 (a permuted view gives the HND layout), "
          "dtype spec.dtype or an unsigned integer of its size (raw storage: numpy has no "
          "bfloat16). A view into a larger allocation works. The cache keeps the arrays "
          "alive. InvalidArgumentError naming the mismatch.")
      .def_static(
          "create",
          [](const KvCacheSpec& spec, int64_t num_blocks, const std::string& layout,
             const std::string& memory) {
            KvCache::Options o;
            o.spec = spec;
            o.num_blocks = num_blocks;
            o.layout = Unwrap(ParseKvLayout(layout));
            o.memory = Unwrap(ParseMemoryKind(memory));
            auto out = std::make_unique<PyKvCache>();
            {
              nb::gil_scoped_release release;  // device memory: waits for the zero fill
              out->cache = Unwrap(KvCache::Create(o));
            }
            return out.release();
          },
          "spec"_a, "num_blocks"_a, "layout"_a = "NHD", "memory"_a = "host",
          nb::rv_policy::take_ownership,
          "Allocates zero-filled K and V buffers of `memory` (host, pinned, device) in "
          "`layout` (NHD, HND).")
      .def_prop_ro("spec", [](const PyKvCache& c) { return c.cache->spec(); })
      .def_prop_ro("num_blocks", [](const PyKvCache& c) { return c.cache->num_blocks(); })
      .def_prop_ro("layout",
                   [](const PyKvCache& c) -> std::optional<std::string> {
                     auto l = c.cache->layout();
                     if (!l.has_value()) return std::nullopt;
                     return std::string(KvLayoutName(*l));
                   },
                   "\"NHD\" or \"HND\" when the strides are one of the dense layouts, else None.")
      .def_prop_ro("owned", [](const PyKvCache& c) { return c.cache->owned(); })
      .def_prop_ro("memory",
                   [](const PyKvCache& c) {
                     return std::string(MemoryKindName(c.cache->view().memory));
                   })
      .def_prop_ro("k",
                   [](nb::handle self) {
                     PyKvCache& c = nb::cast<PyKvCache&>(self);
                     if (c.k_array.is_valid()) return c.k_array;
                     return ExportArray(c.cache->k(), self);
                   },
                   "The K array: the one borrowed, or an array over kvstream's memory (numpy for "
                   "host float32/float16, else DLPack).")
      .def_prop_ro("v",
                   [](nb::handle self) {
                     PyKvCache& c = nb::cast<PyKvCache&>(self);
                     if (c.v_array.is_valid()) return c.v_array;
                     return ExportArray(c.cache->v(), self);
                   })
      .def("set_scales",
           [](PyKvCache& c, const std::vector<float>& k_scale, const std::vector<float>& v_scale) {
             ThrowIfError(c.cache->SetScales(k_scale, v_scale));
           },
           "k_scale"_a, "v_scale"_a,
           "fp8 scales: 1 entry each (per_tensor) or num_kv_heads (per_head).")
      .def_prop_ro("k_scales",
                   [](const PyKvCache& c) {
                     auto s = c.cache->k_scales();
                     return std::vector<float>(s.begin(), s.end());
                   })
      .def_prop_ro("v_scales",
                   [](const PyKvCache& c) {
                     auto s = c.cache->v_scales();
                     return std::vector<float>(s.begin(), s.end());
                   })
      .def("__repr__", [](const PyKvCache& c) {
        return absl::StrCat("KvCache(", c.cache->spec().DebugString(), ", num_blocks=",
                            c.cache->num_blocks(), ", ", MemoryKindName(c.cache->view().memory),
                            c.cache->owned() ? ", owned)" : ", borrowed)");
      });
}

}  // namespace kvstream::python
