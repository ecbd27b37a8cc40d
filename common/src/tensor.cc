#include "kvstream/common/tensor.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvstream/common/numeric.h"

namespace kvstream {

std::vector<int64_t> ContiguousStrides(absl::Span<const int64_t> shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

TensorView::TensorView(void* data, DType dtype, std::vector<int64_t> shape, MemoryKind memory)
    : data_(data), dtype_(dtype), memory_(memory), shape_(std::move(shape)) {
  strides_ = ContiguousStrides(shape_);
}

TensorView::TensorView(void* data, DType dtype, std::vector<int64_t> shape,
                       std::vector<int64_t> strides, MemoryKind memory)
    : data_(data),
      dtype_(dtype),
      memory_(memory),
      shape_(std::move(shape)),
      strides_(std::move(strides)) {}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape_) n *= d;
  return n;
}

bool TensorView::is_contiguous() const {
  // As torch: a size-1 dimension may carry any stride (Reshape() gives such dimensions
  // stride 1, engines give them anything), and a view with no elements is contiguous.
  if (strides_.size() != shape_.size()) return false;
  for (int64_t d : shape_) {
    if (d == 0) return true;
  }
  int64_t expected = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] != 1 && strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

std::string TensorView::DebugString() const {
  return absl::StrCat("[", absl::StrJoin(shape_, ", "), "] ", DTypeName(dtype_));
}

absl::StatusOr<TensorView> TensorView::Reshape(std::vector<int64_t> new_shape) const {
  const int64_t total = numel();
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < new_shape.size(); ++i) {
    if (new_shape[i] == -1) {
      if (infer >= 0) return absl::InvalidArgumentError("reshape: more than one -1 in the new shape");
      infer = static_cast<int>(i);
    } else if (new_shape[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("reshape: negative size in [", absl::StrJoin(new_shape, ", "), "]"));
    } else {
      known *= new_shape[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || total % known != 0) {
      return absl::InvalidArgumentError(absl::StrCat("cannot view ", DebugString(), " as [",
                                                     absl::StrJoin(new_shape, ", "), "]"));
    }
    new_shape[infer] = total / known;
    known = total;
  }
  if (known != total) {
    return absl::InvalidArgumentError(absl::StrCat("cannot view ", DebugString(), " as [",
                                                   absl::StrJoin(new_shape, ", "),
                                                   "]: element counts differ"));
  }
  // Walk old and new dimensions in groups of equal element count, as torch's view does:
  // inside a group the old dimensions must be contiguous with respect to each other.
  std::vector<int64_t> new_strides(new_shape.size(), 1);
  if (total == 0) {
    new_strides = ContiguousStrides(new_shape);
    return TensorView(data_, dtype_, std::move(new_shape), std::move(new_strides), memory_);
  }
  size_t oi = 0, ni = 0;
  const size_t on = shape_.size(), nn = new_shape.size();
  while (oi < on || ni < nn) {
    // Skip size-1 dims; they take any stride.
    if (oi < on && shape_[oi] == 1) { ++oi; continue; }
    if (ni < nn && new_shape[ni] == 1) { new_strides[ni] = 1; ++ni; continue; }
    if (oi >= on || ni >= nn) break;
    size_t og_begin = oi, ng_begin = ni;
    int64_t osz = shape_[oi++], nsz = new_shape[ni++];
    while (osz != nsz) {
      if (osz < nsz) {
        while (oi < on && shape_[oi] == 1) ++oi;
        if (oi >= on) break;
        osz *= shape_[oi++];
      } else {
        while (ni < nn && new_shape[ni] == 1) ++ni;
        if (ni >= nn) break;
        nsz *= new_shape[ni++];
      }
    }
    // Old dims [og_begin, oi) must be mutually contiguous.
    int64_t last_stride = 0;
    bool first = true;
    for (size_t k = og_begin; k < oi; ++k) {
      if (shape_[k] == 1) continue;
      if (!first && last_stride != strides_[k] * shape_[k]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cannot view ", DebugString(), " as [", absl::StrJoin(new_shape, ", "),
            "]: the merged dimensions are not contiguous"));
      }
      last_stride = strides_[k];
      first = false;
    }
    // New dims in the group get contiguous strides ending at the group's innermost stride.
    int64_t s = last_stride;
    for (size_t k = ni; k-- > ng_begin;) {
      new_strides[k] = s;
      s *= new_shape[k];
    }
  }
  return TensorView(data_, dtype_, std::move(new_shape), std::move(new_strides), memory_);
}

void Tensor::FreeDeleter::operator()(void* p) const { std::free(p); }

Tensor Tensor::Zeros(std::vector<int64_t> shape, DType dtype) {
  Tensor t;
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return t;
    n *= d;
  }
  size_t bytes = static_cast<size_t>(n) * DTypeSize(dtype);
  const size_t alloc = ((bytes + 63) / 64) * 64 + 64;  // never zero, multiple of 64
  void* p = std::aligned_alloc(64, alloc);
  if (p == nullptr) return t;
  std::memset(p, 0, alloc);
  t.storage_.reset(p);
  t.view_ = TensorView(p, dtype, std::move(shape), MemoryKind::kHost);
  return t;
}

float Tensor::GetFloat(int64_t i) const { return LoadAsFloat(view_.data(), view_.dtype(), i); }
void Tensor::SetFloat(int64_t i, float value) {
  StoreFromFloat(view_.data(), view_.dtype(), i, value);
}

}  // namespace kvstream
