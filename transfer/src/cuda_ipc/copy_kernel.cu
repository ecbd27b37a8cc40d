// Launchers of the cuda_ipc copy kernels (copy_kernel.h): dispatch on the kernel's shape,
// where its table is, and vectors per thread.
#include <cstring>
#include <type_traits>

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "cuda_ipc/copy_kernel.cuh"
#include "kvstream/common/cuda_status.h"

namespace kvstream {
namespace internal {
namespace {

template <int kVectors>
absl::StatusOr<int> MaxCtas() {
  int ctas = 0;
  const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &ctas, IpcCopyKernel<kVectors>, kIpcCopyThreads, 0);
  if (e != cudaSuccess) {
    return CudaErrorToStatus(static_cast<int>(e), "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  }
  return ctas;
}

template <typename Kernel>
absl::StatusOr<int> Occupancy(Kernel kernel, int threads) {
  int ctas = 0;
  const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, threads, 0);
  if (e != cudaSuccess) {
    return CudaErrorToStatus(static_cast<int>(e), "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  }
  return ctas;
}

absl::Status NoVariant(int vectors_per_thread) {
  return absl::InvalidArgumentError(absl::StrCat(
      "cuda_ipc copy kernel: no variant for ", vectors_per_thread, " vectors per thread"));
}

absl::Status Launched(const char* what) {
  return CudaErrorToStatus(static_cast<int>(cudaGetLastError()), what);
}

template <IpcTableSource kSource, IpcCopyUnit kUnit, int kVectors>
void LaunchRingVariant(const IpcCopySegment* segments, uint32_t n, int grid, cudaStream_t s) {
  IpcSegmentCopyKernel<kSource, kUnit, kVectors>
      <<<grid, kIpcUnitCtaThreads<kUnit>, 0, s>>>(segments, n);
}

template <IpcTableSource kSource, IpcCopyUnit kUnit>
absl::Status LaunchRing(const IpcCopySegment* segments, uint32_t n, int vectors, int grid,
                        cudaStream_t s) {
  switch (vectors) {
    case 2: LaunchRingVariant<kSource, kUnit, 2>(segments, n, grid, s); break;
    case 4: LaunchRingVariant<kSource, kUnit, 4>(segments, n, grid, s); break;
    case 8: LaunchRingVariant<kSource, kUnit, 8>(segments, n, grid, s); break;
    default: return NoVariant(vectors);
  }
  return Launched("cuda_ipc per-segment copy kernel launch");
}

template <uint32_t kCapacity, IpcCopyUnit kUnit, int kVectors>
void LaunchParamsVariant(const IpcParamTable<kCapacity>& table, int grid, cudaStream_t s) {
  IpcSegmentCopyParamKernel<kCapacity, kUnit, kVectors>
      <<<grid, kIpcUnitCtaThreads<kUnit>, 0, s>>>(table);
}

template <uint32_t kCapacity, IpcCopyUnit kUnit>
absl::Status LaunchParams(const IpcParamTable<kCapacity>& table, int vectors, int grid,
                          cudaStream_t s) {
  switch (vectors) {
    case 2: LaunchParamsVariant<kCapacity, kUnit, 2>(table, grid, s); break;
    case 4: LaunchParamsVariant<kCapacity, kUnit, 4>(table, grid, s); break;
    case 8: LaunchParamsVariant<kCapacity, kUnit, 8>(table, grid, s); break;
    default: return NoVariant(vectors);
  }
  return Launched("cuda_ipc per-segment copy kernel launch (table in the parameters)");
}

// The first table.num_segments entries in a smaller table, launched as that.
template <uint32_t kCapacity, IpcCopyUnit kUnit>
absl::Status LaunchSmallerParams(const IpcParamTable<kIpcParamSegments>& table, int vectors,
                                 int grid, cudaStream_t s) {
  IpcParamTable<kCapacity> small;
  small.num_segments = table.num_segments;
  std::memcpy(small.segments, table.segments, table.num_segments * sizeof(IpcParamSegment));
  return LaunchParams<kCapacity, kUnit>(small, vectors, grid, s);
}

template <IpcCopyUnit kUnit>
absl::Status LaunchParamsOfUnit(const IpcParamTable<kIpcParamSegments>& table, int vectors,
                                int grid, cudaStream_t s) {
  if (table.num_segments <= kIpcParamSegmentsSmall) {
    return LaunchSmallerParams<kIpcParamSegmentsSmall, kUnit>(table, vectors, grid, s);
  }
  if (table.num_segments <= kIpcParamSegmentsMedium) {
    return LaunchSmallerParams<kIpcParamSegmentsMedium, kUnit>(table, vectors, grid, s);
  }
  return LaunchParams<kIpcParamSegments, kUnit>(table, vectors, grid, s);
}

}  // namespace

bool IpcCopyVectorsSupported(int vectors_per_thread) {
  return vectors_per_thread == 2 || vectors_per_thread == 4 || vectors_per_thread == 8;
}

absl::StatusOr<int> IpcCopyMaxCtasPerSm(int vectors_per_thread) {
  switch (vectors_per_thread) {
    case 2: return MaxCtas<2>();
    case 4: return MaxCtas<4>();
    case 8: return MaxCtas<8>();
    default: break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("cuda_ipc copy kernel: no variant for ", vectors_per_thread,
                   " vectors per thread (2, 4 or 8)"));
}

absl::Status LaunchIpcCopy(const IpcCopyParams& params, int vectors_per_thread, int grid,
                           void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (vectors_per_thread) {
    case 2: IpcCopyKernel<2><<<grid, kIpcCopyThreads, 0, s>>>(params); break;
    case 4: IpcCopyKernel<4><<<grid, kIpcCopyThreads, 0, s>>>(params); break;
    case 8: IpcCopyKernel<8><<<grid, kIpcCopyThreads, 0, s>>>(params); break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda_ipc copy kernel: no variant for ", vectors_per_thread, " vectors per thread"));
  }
  return CudaErrorToStatus(static_cast<int>(cudaGetLastError()), "cuda_ipc copy kernel launch");
}

template <IpcCopyUnit kUnit>
absl::StatusOr<int> UnitOccupancy(int vectors_per_thread) {
  constexpr IpcTableSource kDev = IpcTableSource::kDevice;
  constexpr int kThreads = kIpcUnitCtaThreads<kUnit>;
  switch (vectors_per_thread) {
    case 2: return Occupancy(IpcSegmentCopyKernel<kDev, kUnit, 2>, kThreads);
    case 4: return Occupancy(IpcSegmentCopyKernel<kDev, kUnit, 4>, kThreads);
    case 8: return Occupancy(IpcSegmentCopyKernel<kDev, kUnit, 8>, kThreads);
    default: break;
  }
  return NoVariant(vectors_per_thread);
}

absl::StatusOr<int> IpcSegmentCopyMaxCtasPerSm(IpcCopyUnit unit, int vectors_per_thread) {
  switch (unit) {
    case IpcCopyUnit::kCta: return UnitOccupancy<IpcCopyUnit::kCta>(vectors_per_thread);
    case IpcCopyUnit::kWarp: return UnitOccupancy<IpcCopyUnit::kWarp>(vectors_per_thread);
    case IpcCopyUnit::kWideCta: return UnitOccupancy<IpcCopyUnit::kWideCta>(vectors_per_thread);
  }
  return absl::InvalidArgumentError("cuda_ipc copy kernel: unknown unit");
}

absl::Status LaunchIpcSegmentCopy(const IpcCopySegment* segments, uint32_t num_segments,
                                  IpcTableSource source, IpcCopyUnit unit,
                                  int vectors_per_thread, int grid, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  auto launch = [&](auto source_tag) -> absl::Status {
    constexpr IpcTableSource kSource = decltype(source_tag)::value;
    switch (unit) {
      case IpcCopyUnit::kCta:
        return LaunchRing<kSource, IpcCopyUnit::kCta>(segments, num_segments, vectors_per_thread,
                                                      grid, s);
      case IpcCopyUnit::kWarp:
        return LaunchRing<kSource, IpcCopyUnit::kWarp>(segments, num_segments,
                                                       vectors_per_thread, grid, s);
      case IpcCopyUnit::kWideCta:
        return LaunchRing<kSource, IpcCopyUnit::kWideCta>(segments, num_segments,
                                                          vectors_per_thread, grid, s);
    }
    return absl::InvalidArgumentError("cuda_ipc copy kernel: unknown unit");
  };
  switch (source) {
    case IpcTableSource::kDevice:
      return launch(std::integral_constant<IpcTableSource, IpcTableSource::kDevice>{});
    case IpcTableSource::kZeroCopy:
      return launch(std::integral_constant<IpcTableSource, IpcTableSource::kZeroCopy>{});
    case IpcTableSource::kParams:
      break;
  }
  return absl::InvalidArgumentError(
      "cuda_ipc copy kernel: a table in the parameters goes through LaunchIpcSegmentCopyParams");
}

absl::Status LaunchIpcSegmentCopyParams(const IpcParamTable<kIpcParamSegments>& table,
                                        IpcCopyUnit unit, int vectors_per_thread, int grid,
                                        void* stream) {
  if (table.num_segments > kIpcParamSegments) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc copy kernel: ", table.num_segments,
                                                   " entries in a parameter table of ",
                                                   kIpcParamSegments));
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (unit) {
    case IpcCopyUnit::kCta:
      return LaunchParamsOfUnit<IpcCopyUnit::kCta>(table, vectors_per_thread, grid, s);
    case IpcCopyUnit::kWarp:
      return LaunchParamsOfUnit<IpcCopyUnit::kWarp>(table, vectors_per_thread, grid, s);
    case IpcCopyUnit::kWideCta:
      return LaunchParamsOfUnit<IpcCopyUnit::kWideCta>(table, vectors_per_thread, grid, s);
  }
  return absl::InvalidArgumentError("cuda_ipc copy kernel: unknown unit");
}

}  // namespace internal
}  // namespace kvstream
