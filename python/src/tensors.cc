#include "tensors.h"

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "errors.h"
#include <nanobind/stl/string.h>

namespace nb = nanobind;

namespace kvstream::python {
namespace {

std::string DlpackDTypeName(const nb::dlpack::dtype& d) {
  return absl::StrCat("DLPack dtype (code ", static_cast<int>(d.code), ", ",
                      static_cast<int>(d.bits), " bits, ", static_cast<int>(d.lanes), " lanes)");
}

}  // namespace

absl::StatusOr<DType> ToDType(const nb::dlpack::dtype& d, absl::string_view what) {
  using Code = nb::dlpack::dtype_code;
  if (d.lanes == 1) {
    switch (static_cast<Code>(d.code)) {
      case Code::Float:
        if (d.bits == 32) return DType::kFloat32;
        if (d.bits == 16) return DType::kFloat16;
        break;
      case Code::Bfloat:
        if (d.bits == 16) return DType::kBFloat16;
        break;
      case Code::Float8_E4M3FN:
        if (d.bits == 8) return DType::kFloat8E4M3;
        break;
      case Code::Float8_E5M2:
        if (d.bits == 8) return DType::kFloat8E5M2;
        break;
      case Code::Int:
        if (d.bits == 32) return DType::kInt32;
        if (d.bits == 64) return DType::kInt64;
        break;
      case Code::UInt:
        if (d.bits == 8) return DType::kUInt8;
        break;
      default:
        break;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      what, ": kvstream has no dtype for ", DlpackDTypeName(d),
      "; use float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int32, int64 or uint8"));
}

absl::StatusOr<MemoryKind> ToMemoryKind(const Array& array, absl::string_view what) {
  const int type = array.device_type();
  if (type == nb::device::cpu::value) return MemoryKind::kHost;
  if (type == nb::device::cuda::value) return MemoryKind::kDevice;
  if (type == nb::device::cuda_host::value) return MemoryKind::kPinned;
  return absl::InvalidArgumentError(absl::StrCat(
      what, ": memory on DLPack device type ", type,
      " is not supported (CPU, CUDA and CUDA host memory are)"));
}

absl::StatusOr<TensorView> ToTensorView(const Array& array, absl::string_view what,
                                        std::optional<DType> raw_as) {
  if (!array.is_valid()) return absl::InvalidArgumentError(absl::StrCat(what, ": no array"));
  const nb::dlpack::dtype d = array.dtype();
  DType dtype;
  if (raw_as.has_value() && d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt) &&
      d.lanes == 1) {
    if (static_cast<size_t>(d.bits) != DTypeSize(*raw_as) * 8) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": a raw uint", static_cast<int>(d.bits), " array cannot hold ",
          DTypeName(*raw_as), " elements (", DTypeSize(*raw_as) * 8, " bits each)"));
    }
    dtype = *raw_as;
  } else {
    auto parsed = ToDType(d, what);
    if (!parsed.ok()) return parsed.status();
    dtype = *parsed;
  }
  auto memory = ToMemoryKind(array, what);
  if (!memory.ok()) return memory.status();
  std::vector<int64_t> shape(array.ndim()), strides(array.ndim());
  for (size_t i = 0; i < array.ndim(); ++i) {
    shape[i] = static_cast<int64_t>(array.shape(i));
    strides[i] = array.stride(i);
  }
  // data() adds DLPack's byte_offset: torch exports a view into a larger allocation as the
  // allocation's base plus an offset.
  return TensorView(static_cast<void*>(array.data()), dtype, std::move(shape),
                    std::move(strides), *memory);
}

Array CastArray(nb::handle object, absl::string_view what) {
  Array array;
  if (!nb::try_cast<Array>(object, array, /*convert=*/false)) {
    ThrowStatus(absl::InvalidArgumentError(absl::StrCat(
        what, ": expected a writable DLPack array (numpy, torch, cupy, ...), got ",
        nb::cast<std::string>(nb::str(nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(object.ptr()))))))));
  }
  return array;
}

nb::object ExportArray(const TensorView& view, nb::handle owner) {
  using Code = nb::dlpack::dtype_code;
  auto dt = [](Code c, int bits) {
    return nb::dlpack::dtype{static_cast<uint8_t>(c), static_cast<uint8_t>(bits), 1};
  };
  nb::dlpack::dtype d;
  bool numpy_has_it = true;
  switch (view.dtype()) {
    case DType::kFloat32: d = dt(Code::Float, 32); break;
    case DType::kFloat16: d = dt(Code::Float, 16); break;
    case DType::kBFloat16: d = dt(Code::Bfloat, 16); numpy_has_it = false; break;
    case DType::kFloat8E4M3: d = dt(Code::Float8_E4M3FN, 8); numpy_has_it = false; break;
    case DType::kFloat8E5M2: d = dt(Code::Float8_E5M2, 8); numpy_has_it = false; break;
    case DType::kInt32: d = dt(Code::Int, 32); break;
    case DType::kInt64: d = dt(Code::Int, 64); break;
    case DType::kUInt8: d = dt(Code::UInt, 8); break;
  }
  const int device = view.memory() == MemoryKind::kDevice   ? nb::device::cuda::value
                     : view.memory() == MemoryKind::kPinned ? nb::device::cuda_host::value
                                                            : nb::device::cpu::value;
  std::vector<size_t> shape(view.shape().begin(), view.shape().end());
  const std::vector<int64_t>& strides = view.strides();
  if (numpy_has_it && view.memory() == MemoryKind::kHost) {
    return nb::cast(nb::ndarray<nb::numpy>(view.data(), shape.size(), shape.data(), owner,
                                           strides.data(), d, device),
                    nb::rv_policy::reference);
  }
  return nb::cast(nb::ndarray<nb::array_api>(view.data(), shape.size(), shape.data(), owner,
                                             strides.data(), d, device),
                  nb::rv_policy::reference);
}

std::string DTypeString(DType dtype) { return std::string(DTypeName(dtype)); }

}  // namespace kvstream::python
