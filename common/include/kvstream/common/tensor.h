// A minimal strided tensor view and an owning host tensor, enough for kvstream's layer
// and kernel interfaces. kvstream does not do tensor algebra; these carry a pointer, a
// dtype, a shape and strides (in elements) across API boundaries, whether the memory is
// kvstream's own or borrowed from an engine.
//
//   Tensor q = Tensor::Zeros({num_tokens, num_heads * head_size}, DType::kBFloat16);
//   ASSIGN_OR_RETURN(TensorView q3, q.view().Reshape({num_tokens, num_heads, head_size}));
#ifndef KVSTREAM_COMMON_TENSOR_H_
#define KVSTREAM_COMMON_TENSOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvstream/common/dtype.h"

namespace kvstream {

// Non-owning view. Copyable; the memory must outlive it. Thread-compatible.
class TensorView {
 public:
  TensorView() = default;
  // Contiguous (row-major) view of `shape` at `data`.
  TensorView(void* data, DType dtype, std::vector<int64_t> shape,
             MemoryKind memory = MemoryKind::kHost);
  // Strided view. REQUIRES: strides.size() == shape.size(); strides in elements.
  TensorView(void* data, DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides,
             MemoryKind memory = MemoryKind::kHost);

  void* data() const { return data_; }
  template <typename T>
  T* data_as() const { return static_cast<T*>(data_); }
  DType dtype() const { return dtype_; }
  MemoryKind memory() const { return memory_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  int dim() const { return static_cast<int>(shape_.size()); }
  int64_t size(int d) const { return shape_[d]; }
  int64_t stride(int d) const { return strides_[d]; }
  int64_t numel() const;
  bool is_contiguous() const;
  bool empty() const { return data_ == nullptr; }

  // The same memory seen with another shape, as torch's view(): the dimensions being
  // merged or split must be contiguous with respect to each other. One entry may be -1
  // (inferred). Errors name both shapes.
  absl::StatusOr<TensorView> Reshape(std::vector<int64_t> new_shape) const;

  // "[2, 3, 4] bfloat16"
  std::string DebugString() const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kFloat32;
  MemoryKind memory_ = MemoryKind::kHost;
  std::vector<int64_t> shape_;
  std::vector<int64_t> strides_;
};

// Contiguous row-major strides of `shape`.
std::vector<int64_t> ContiguousStrides(absl::Span<const int64_t> shape);

// Owning, contiguous host tensor (64-byte aligned). Move-only.
class Tensor {
 public:
  Tensor() = default;
  // Zero-filled. Shapes with negative entries give an empty tensor.
  static Tensor Zeros(std::vector<int64_t> shape, DType dtype);

  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  TensorView view() const { return view_; }
  void* data() const { return view_.data(); }
  template <typename T>
  T* data_as() const { return view_.data_as<T>(); }
  DType dtype() const { return view_.dtype(); }
  const std::vector<int64_t>& shape() const { return view_.shape(); }
  int64_t numel() const { return view_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype()); }

  // Element i (flat) converted to float / written from float (rounded to the dtype).
  // REQUIRES: floating-point dtype, 0 <= i < numel().
  float GetFloat(int64_t i) const;
  void SetFloat(int64_t i, float value);

 private:
  struct FreeDeleter {
    void operator()(void* p) const;
  };
  std::unique_ptr<void, FreeDeleter> storage_;
  TensorView view_;
};

}  // namespace kvstream

#endif  // KVSTREAM_COMMON_TENSOR_H_
