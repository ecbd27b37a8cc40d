// The attention backends known by name ("cuda" lives in cuda/cuda_backend.cc), and the CPU
// backend classes that wrap the kernels.
#include "kvstream/attention/backend.h"

#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvstream/attention/cpu_attention.h"
#include "kvstream/attention/cuda_attention.h"

namespace kvstream {
namespace {

// Runs the CPU cache update and one of the CPU attention implementations.
class CpuBackend final : public AttentionBackend {
 public:
  using Kernel = absl::Status (*)(const PagedAttentionParams&);
  CpuBackend(absl::string_view name, Kernel kernel) : name_(name), kernel_(kernel) {}

  absl::string_view name() const override { return name_; }
  bool SupportsMemory(MemoryKind memory) const override {
    return memory == MemoryKind::kHost || memory == MemoryKind::kPinned;
  }
  absl::Status UpdateCache(const CacheUpdateParams& params) override {
    return CacheUpdateCpu(params);
  }
  absl::Status Forward(const PagedAttentionParams& params) override { return kernel_(params); }

 private:
  absl::string_view name_;
  Kernel kernel_;
};

}  // namespace

std::vector<std::string> AttentionBackendNames() {
#ifdef KVSTREAM_HAVE_CUDA
  return {"cpu", "cpu_reference", "cuda"};
#else
  return {"cpu", "cpu_reference"};
#endif
}

absl::StatusOr<std::unique_ptr<AttentionBackend>> CreateAttentionBackend(absl::string_view name,
                                                                         bool batch_invariant) {
  if (name == "cpu") return std::make_unique<CpuBackend>("cpu", &RunAttentionCpu);
  if (name == "cpu_reference") {
    return std::make_unique<CpuBackend>("cpu_reference", &RunAttentionReference);
  }
  // Known in every build, so that a CPU-only build says "built without CUDA" (and a machine
  // without a GPU says so) rather than "unknown backend". Device 0, a stream of its own.
  if (name == "cuda") {
    CudaBackendOptions options;
    options.batch_invariant = batch_invariant;
    return CreateCudaAttentionBackend(options);
  }
  return absl::NotFoundError(absl::StrCat("unknown attention backend '", name, "' (choices: ",
                                          absl::StrJoin(AttentionBackendNames(), ", "), ")"));
}

}  // namespace kvstream
