// The synthetic model's CUDA pieces in builds without CUDA: each says why it cannot run.
#include "cuda/cublas_gemm.h"
#include "cuda/model_ops.h"
#include "kvstream/serving/cuda_model.h"

#include <memory>
#include <string>
#include <utility>

namespace kvstream {
namespace internal {
namespace {

absl::Status NoCuda(const char* what) {
  return absl::FailedPreconditionError(
      std::string(what) + ": kvstream was built without CUDA (KVSTREAM_CUDA=OFF or no nvcc)");
}

}  // namespace

absl::Status LaunchRandomBf16(uint32_t, uint64_t, int64_t, float, float, uint16_t*, void*) {
  return NoCuda("LaunchRandomBf16");
}
absl::Status LaunchEmbed(const uint16_t*, int64_t, int64_t, const int32_t*, int64_t, uint16_t*,
                         void*) {
  return NoCuda("LaunchEmbed");
}
absl::Status LaunchRmsNorm(const uint16_t*, const uint16_t*, int64_t, int64_t, float, uint16_t*,
                           void*) {
  return NoCuda("LaunchRmsNorm");
}
absl::Status LaunchRotary(uint16_t*, int64_t, int64_t, int, int, const int32_t*, double, void*) {
  return NoCuda("LaunchRotary");
}
absl::Status LaunchSiluMul(const uint16_t*, int64_t, int64_t, uint16_t*, void*) {
  return NoCuda("LaunchSiluMul");
}
absl::Status LaunchArgmax(const float*, int64_t, int64_t, int32_t*, void*) {
  return NoCuda("LaunchArgmax");
}

struct CublasGemm::Handle {};

absl::StatusOr<CublasGemm> CublasGemm::Create(void*) { return NoCuda("CublasGemm"); }
CublasGemm::CublasGemm(std::unique_ptr<Handle> handle) : handle_(std::move(handle)) {}
CublasGemm::CublasGemm(CublasGemm&&) noexcept = default;
CublasGemm& CublasGemm::operator=(CublasGemm&&) noexcept = default;
CublasGemm::~CublasGemm() = default;
absl::Status CublasGemm::MatMulBf16(const uint16_t*, const uint16_t*, uint16_t*, int64_t,
                                    int64_t, int64_t, float) {
  return NoCuda("CublasGemm");
}
absl::Status CublasGemm::MatMulBf16ToF32(const uint16_t*, const uint16_t*, float*, int64_t,
                                         int64_t, int64_t) {
  return NoCuda("CublasGemm");
}
absl::Status CublasGemm::Gemm(const uint16_t*, const uint16_t*, void*, bool, int64_t, int64_t,
                              int64_t, float) {
  return NoCuda("CublasGemm");
}

}  // namespace internal

struct CudaModel::State {};

absl::StatusOr<std::unique_ptr<CudaModel>> CudaModel::Create(const ToyModelConfig&, int64_t,
                                                             LayerRegistry*, const Allocator&,
                                                             std::optional<LayerRange>) {
  return internal::NoCuda("CudaModel");
}
CudaModel::CudaModel(std::unique_ptr<State> state) : state_(std::move(state)) {}
CudaModel::~CudaModel() = default;
absl::StatusOr<std::vector<float>> CudaModel::Forward(absl::Span<const int32_t>,
                                                      absl::Span<const int32_t>,
                                                      absl::Span<const int32_t>,
                                                      absl::Span<const int64_t>, absl::Duration) {
  return internal::NoCuda("CudaModel");
}
const ToyModelConfig& CudaModel::config() const {
  static const ToyModelConfig kNone;
  return kNone;
}
const LayerRange& CudaModel::layers() const {
  static const LayerRange kNone{};
  return kNone;
}
KvCache* CudaModel::cache(int) const { return nullptr; }

}  // namespace kvstream
