// DLPack tensors (numpy, torch CPU and CUDA, cupy, ...) as kvstream TensorViews, through
// nanobind's ndarray, without copying: the view points at the caller's memory, with its
// shape, strides (in elements) and offset, whatever larger allocation it lies in.
//
//   TensorView q = Unwrap(ToTensorView(query, "query"));
//
// The caller keeps the Python object alive while the view is used.
#ifndef KVSTREAM_PYTHON_TENSORS_H_
#define KVSTREAM_PYTHON_TENSORS_H_

#include <optional>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvstream/common/dtype.h"
#include "kvstream/common/tensor.h"

namespace kvstream::python {

// Any DLPack-capable array, writable, on any device.
using Array = nanobind::ndarray<>;

// The kvstream dtype of a DLPack dtype; InvalidArgument naming `what` for dtypes kvstream
// has none of (e.g. float64, complex, vectors of lanes).
absl::StatusOr<DType> ToDType(const nanobind::dlpack::dtype& dtype, absl::string_view what);

// Where the array lives: CPU -> kHost, CUDA host (pinned) -> kPinned, CUDA -> kDevice;
// InvalidArgument for other devices (managed memory, ROCm, ...).
absl::StatusOr<MemoryKind> ToMemoryKind(const Array& array, absl::string_view what);

// The array as a view. With `raw_as`, an unsigned-integer array whose elements have the size
// of `raw_as` is taken as raw storage of that dtype (numpy has no bfloat16 or fp8, and
// engines keep fp8 caches as uint8); arrays of dtype `raw_as` itself are taken as they are.
// InvalidArgument naming `what` for a dtype kvstream lacks or a raw dtype of another size.
absl::StatusOr<TensorView> ToTensorView(const Array& array, absl::string_view what,
                                        std::optional<DType> raw_as = std::nullopt);

// `object` as an array (any DLPack or buffer-protocol object, writable); InvalidArgumentError
// naming `what` when it is none (as a StatusError).
Array CastArray(nanobind::handle object, absl::string_view what);

// Memory kvstream owns as a Python array; `owner` stays alive while the array does. Host
// memory of a dtype numpy has (float32, float16, int32, int64, uint8) becomes a numpy array;
// anything else (bfloat16, fp8, pinned or device memory) a DLPack array
// (torch.from_dlpack, cupy.from_dlpack, np.from_dlpack).
nanobind::object ExportArray(const TensorView& view, nanobind::handle owner);

// "float32", ... for messages and Python properties.
std::string DTypeString(DType dtype);

}  // namespace kvstream::python

#endif  // KVSTREAM_PYTHON_TENSORS_H_
