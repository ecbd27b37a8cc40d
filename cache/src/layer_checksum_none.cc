// DeviceChecksummer in builds without CUDA: the class exists so that callers link in every
// build; Create says why it cannot run, so no instance (and no other member) is reachable.
// StagingBytesFor, plain arithmetic, is in layer_checksum.cc.
#include "kvstream/cache/layer_checksum.h"

namespace kvstream {

absl::StatusOr<std::unique_ptr<DeviceChecksummer>> DeviceChecksummer::Create(
    const Options& /*options*/) {
  return absl::FailedPreconditionError(
      "DeviceChecksummer: kvstream was built without CUDA (KVSTREAM_CUDA=OFF or no nvcc)");
}

DeviceChecksummer::~DeviceChecksummer() = default;

absl::Status DeviceChecksummer::Enqueue(absl::Span<const ChecksumSpan> /*spans*/, void* /*stream*/,
                                        uint64_t* /*result*/) {
  return absl::FailedPreconditionError(
      "DeviceChecksummer: kvstream was built without CUDA (KVSTREAM_CUDA=OFF or no nvcc)");
}

}  // namespace kvstream
