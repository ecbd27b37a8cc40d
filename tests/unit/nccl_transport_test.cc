// Tests of the nccl transport that run on any machine: its options are checked before any GPU
// is touched (each bad field InvalidArgument, in every build); created without a GPU or
// without NCCL it fails with FailedPrecondition saying why; the factory names it where it is
// built; NCCL's result codes become the Status codes nccl_status.h promises. With one GPU
// it reports its capabilities, refuses host memory and refuses to connect to itself or to a
// peer of another job, of another NCCL or on its own GPU (a second transport on the same
// GPU), with messages saying so. What needs two GPUs is in
// tests/gpu/nccl_transport_gpu_test.cc.
#include "kvstream/transfer/nccl_transport.h"

#include <algorithm>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/transfer/transport_factory.h"
#include "transfer/src/nccl/nccl_status.h"
#include "transfer/src/nccl/nccl_wire.h"

namespace kvstream {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

TEST(NcclTransportTest, OptionsOutOfRangeAreInvalidArgumentsInEveryBuild) {
  std::vector<NcclTransportOptions> bad(14);
  bad[0].device = -1;
  bad[1].job_id = std::string(257, 'j');
  bad[2].listen_host = "";
  bad[3].staging_bytes = 1000;
  bad[4].staging_bytes = uint64_t{2} << 30;
  bad[5].in_place_min_bytes = 100;
  bad[6].in_place_min_bytes = bad[6].staging_bytes + 1;
  bad[7].max_piece_bytes = 48 << 10;  // not a power of two
  bad[8].table_entries = 100;
  bad[9].table_entries = 4096;  // too few for 64 MiB cut at 4 KiB
  bad[9].max_piece_bytes = 4096;
  bad[10].copy_ctas = -1;
  bad[11].join_timeout = absl::ZeroDuration();
  bad[12].op_timeout = absl::Seconds(-1);
  bad[13].shutdown_timeout = absl::Seconds(-1);
  for (size_t i = 0; i < bad.size(); ++i) {
    const absl::Status checked = ValidateNcclTransportOptions(bad[i]);
    EXPECT_EQ(checked.code(), absl::StatusCode::kInvalidArgument) << i << ": " << checked;
    EXPECT_THAT(checked.message(), HasSubstr("nccl transport"));
    auto created = CreateNcclTransport(bad[i]);
    ASSERT_FALSE(created.ok());
    EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument) << i;
  }
  EXPECT_TRUE(ValidateNcclTransportOptions(NcclTransportOptions{}).ok());
}

TEST(NcclTransportTest, CreatedWithoutAGpuOrNcclFailsSayingWhy) {
  if (BuiltWithNccl() && GpuCount() > 0) GTEST_SKIP() << "a GPU and NCCL are here";
  TransportOptions options;
  options.name = "nccl";
  auto transport = CreateTransport(options);
  ASSERT_FALSE(transport.ok());
  EXPECT_EQ(transport.status().code(), absl::StatusCode::kFailedPrecondition)
      << transport.status();
  EXPECT_THAT(transport.status().message(), HasSubstr("nccl"));
  EXPECT_THAT(transport.status().message(),
              AnyOf(HasSubstr("CUDA device"), HasSubstr("without NCCL"), HasSubstr("driver")));
}

TEST(NcclTransportTest, NamedByTheFactoryWhereBuilt) {
  const std::vector<std::string> names = TransportNames();
  const bool listed = std::find(names.begin(), names.end(), "nccl") != names.end();
  EXPECT_EQ(listed, BuiltWithNccl());
  // Never the default: it needs a second GPU and a peer that speaks it.
  EXPECT_NE(DefaultTransportName(MemoryKind::kDevice), "nccl");
}

TEST(NcclTransportTest, NcclResultsBecomeStatusCodes) {
  using internal::NcclResultToStatus;
  EXPECT_TRUE(NcclResultToStatus(internal::kNcclSuccess, "op").ok());
  EXPECT_TRUE(NcclResultToStatus(internal::kNcclInProgress, "op").ok());
  const absl::Status remote =
      NcclResultToStatus(internal::kNcclRemoteError, "ncclSend", "peer 2", "socket closed");
  EXPECT_EQ(remote.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(remote.message(), HasSubstr("NCCL ncclSend (peer 2): remote error [6]: socket closed"));
  EXPECT_EQ(NcclResultToStatus(internal::kNcclSystemError, "x").code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(NcclResultToStatus(internal::kNcclInvalidArgument, "x").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclResultToStatus(internal::kNcclInvalidUsage, "x").code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(NcclResultToStatus(internal::kNcclUnhandledCudaError, "x").code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(NcclResultToStatus(internal::kNcclInternalError, "x").code(),
            absl::StatusCode::kInternal);
  EXPECT_THAT(NcclResultToStatus(42, "x").message(), HasSubstr("unknown result [42]"));
}

class NcclOneGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!BuiltWithNccl()) GTEST_SKIP() << "built without NCCL";
    if (GpuCount() == 0) GTEST_SKIP() << "no usable GPU: " << CudaAvailability();
    NcclTransportOptions options;
    options.job_id = "job-a";
    auto transport = CreateNcclTransport(options);
    ASSERT_TRUE(transport.ok()) << transport.status();
    transport_ = std::move(transport).value();
  }

  // A peer info as another transport would give it, from this one's with fields changed.
  std::string PeerInfo(const std::string& job, uint32_t version_delta, bool same_gpu) {
    auto mine = transport_->LocalInfo();
    EXPECT_TRUE(mine.ok());
    auto info = internal::DecodeNcclPeerInfo(*mine);
    EXPECT_TRUE(info.ok());
    info->uid ^= 1;
    info->job_id = job;
    info->nccl_version += version_delta;
    if (!same_gpu) info->device_uuid[0] = static_cast<char>(info->device_uuid[0] ^ 1);
    return internal::EncodeNcclPeerInfo(*info);
  }

  std::unique_ptr<Transport> transport_;
};

TEST_F(NcclOneGpuTest, RefusesHostMemoryAndSaysWhatItCan) {
  const TransportCapabilities caps = transport_->capabilities();
  EXPECT_TRUE(caps.device_memory && caps.inter_process && caps.notifications);
  EXPECT_FALSE(caps.host_memory);
  std::vector<char> host(4096);
  auto reg = transport_->RegisterMemory(host.data(), host.size(), MemoryKind::kHost);
  EXPECT_EQ(reg.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(reg.status().message(), HasSubstr("device memory only"));
  reg = transport_->RegisterMemory(host.data(), host.size(), MemoryKind::kDevice);
  EXPECT_EQ(reg.status().code(), absl::StatusCode::kInvalidArgument);
  auto alloc = transport_->AllocateMemory(1 << 20, MemoryKind::kDevice);
  ASSERT_TRUE(alloc.ok()) << alloc.status();
  EXPECT_FALSE((*alloc)->descriptor().empty());
}

TEST_F(NcclOneGpuTest, RefusesPeersItCannotShareACommunicatorWith) {
  auto own = transport_->LocalInfo();
  ASSERT_TRUE(own.ok());
  EXPECT_EQ(transport_->Connect(*own).status().code(), absl::StatusCode::kInvalidArgument);
  auto other_job = transport_->Connect(PeerInfo("job-b", 0, false));
  EXPECT_EQ(other_job.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other_job.status().message(), HasSubstr("job 'job-b'"));
  EXPECT_THAT(other_job.status().message(), HasSubstr("job 'job-a'"));
  auto other_nccl = transport_->Connect(PeerInfo("job-a", 100, false));
  EXPECT_EQ(other_nccl.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other_nccl.status().message(), HasSubstr("same NCCL"));
  auto same_gpu = transport_->Connect(PeerInfo("job-a", 0, true));
  EXPECT_EQ(same_gpu.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(same_gpu.status().message(), HasSubstr("two ranks on one GPU"));
  EXPECT_EQ(transport_->Connect("garbage").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvstream
