// Tests of the cuda_ipc transport that run on any machine: created by name without a usable
// GPU it fails with FailedPrecondition saying why (no GPU, or a build without CUDA);
// options out of range are InvalidArgument before any GPU is touched; with a GPU it
// reports its capabilities and refuses host memory. The GPU behaviour (two processes) is
// tested in tests/gpu/cuda_ipc_transport_gpu_test.cc.
#include "kvstream/transfer/cuda_ipc_transport.h"

#include <algorithm>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/transfer/transport_factory.h"

namespace kvstream {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

TEST(CudaIpcTransportTest, CreatedByNameFailsClearlyWithoutAGpu) {
  TransportOptions options;
  options.name = "cuda_ipc";
  auto transport = CreateTransport(options);
  if (GpuCount() > 0) {
    ASSERT_TRUE(transport.ok()) << transport.status();
    EXPECT_EQ((*transport)->name(), "cuda_ipc");
    return;
  }
  ASSERT_FALSE(transport.ok());
  EXPECT_EQ(transport.status().code(), absl::StatusCode::kFailedPrecondition)
      << transport.status();
  EXPECT_THAT(transport.status().message(), HasSubstr("cuda_ipc"));
  // Why: no device, no driver, or no CUDA in this build.
  EXPECT_THAT(transport.status().message(),
              AnyOf(HasSubstr("CUDA device"), HasSubstr("without CUDA"), HasSubstr("driver")));
}

TEST(CudaIpcTransportTest, OptionsOutOfRangeAreInvalidArguments) {
  if (!BuiltWithCuda()) GTEST_SKIP() << "built without CUDA: options are not read";
  std::vector<CudaIpcTransportOptions> bad(8);
  bad[0].device = -1;
  bad[1].staging_segments = 0;
  bad[2].ctas_per_sm = -2;
  bad[3].vectors_per_thread = 3;
  bad[4].shutdown_timeout = absl::Seconds(-1);
  bad[5].max_piece_bytes = 48 << 10;  // not a power of two
  bad[6].max_piece_bytes = 1 << 10;   // too small
  bad[7].kernel = CudaIpcKernel::kChunked;  // the chunked kernel cannot take kParams
  bad[7].table = CudaIpcTableMode::kParams;
  for (const CudaIpcTransportOptions& o : bad) {
    auto t = CreateCudaIpcTransport(o);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  }
}

TEST(CudaIpcTransportTest, NamedByTheFactoryWhereBuiltAndDefaultForDeviceCaches) {
  const std::vector<std::string> names = TransportNames();
  const bool listed = std::find(names.begin(), names.end(), "cuda_ipc") != names.end();
  EXPECT_EQ(listed, BuiltWithCuda());
  EXPECT_EQ(DefaultTransportName(MemoryKind::kDevice), BuiltWithCuda() ? "cuda_ipc" : "ucx");
}

TEST(CudaIpcTransportTest, WithAGpuRefusesHostMemoryAndSaysWhatItCan) {
  if (GpuCount() == 0) GTEST_SKIP() << "no usable GPU: " << CudaAvailability();
  auto transport = CreateCudaIpcTransport(CudaIpcTransportOptions{});
  ASSERT_TRUE(transport.ok()) << transport.status();
  const TransportCapabilities caps = (*transport)->capabilities();
  EXPECT_TRUE(caps.device_memory && caps.inter_process && caps.one_sided_write &&
              caps.notifications);
  EXPECT_FALSE(caps.host_memory);
  std::vector<char> host(4096);
  auto reg = (*transport)->RegisterMemory(host.data(), host.size(), MemoryKind::kHost);
  EXPECT_EQ(reg.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(reg.status().message(), HasSubstr("device memory only"));
  // Host memory passed off as device memory is found out.
  reg = (*transport)->RegisterMemory(host.data(), host.size(), MemoryKind::kDevice);
  EXPECT_EQ(reg.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(reg.status().message(), HasSubstr("not CUDA memory"));
  auto alloc = (*transport)->AllocateMemory(4096, MemoryKind::kHost);
  EXPECT_EQ(alloc.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvstream
