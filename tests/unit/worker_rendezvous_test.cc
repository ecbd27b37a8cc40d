// How `kvstream worker`s find each other (launch/worker_rendezvous.h): the address file's
// format and its deadlines, and the wait for a prefill worker that answers or does not.
#include "worker_rendezvous.h"

#include <unistd.h>

#include <fstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvstream/transfer/socket.h"
#include "tests/testing/temp_dir.h"

namespace kvstream {
namespace internal {
namespace {

class WorkerRendezvousTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(tmp_.ok()); }
  TempDir tmp_;
  const std::string& dir_ = tmp_.path();
};

TEST_F(WorkerRendezvousTest, AddressFileNamesCarryThePrefillIndexOnlyWhenThereAreSeveral) {
  WorkerOptions o;
  o.address_file = "/run/addr";
  o.num_prefill = 1;
  EXPECT_EQ(AddressFileOf(o, 0), "/run/addr");
  o.num_prefill = 3;
  EXPECT_EQ(AddressFileOf(o, 2), "/run/addr.2");
}

TEST_F(WorkerRendezvousTest, WrittenAddressReadsBackAsHostAndPort) {
  const std::string path = dir_ + "/addr";
  ASSERT_TRUE(WriteAddressFile(path, "10.0.0.7:43210").ok());
  EXPECT_NE(access((path + ".tmp").c_str(), F_OK), 0) << "the temporary file was left behind";
  auto read = ReadAddressFile(path, absl::Seconds(1));
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->first, "10.0.0.7");
  EXPECT_EQ(read->second, 43210);
}

TEST_F(WorkerRendezvousTest, AnAddressWrittenWhileTheReaderWaitsIsRead) {
  const std::string path = dir_ + "/late";
  std::thread writer([&] {
    absl::SleepFor(absl::Milliseconds(100));
    ASSERT_TRUE(WriteAddressFile(path, "127.0.0.1:5000").ok());
  });
  auto read = ReadAddressFile(path, absl::Seconds(10));
  writer.join();
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->second, 5000);
}

TEST_F(WorkerRendezvousTest, AMissingFileIsADeadlineNamingIt) {
  const std::string path = dir_ + "/never";
  auto read = ReadAddressFile(path, absl::Milliseconds(50));
  ASSERT_EQ(read.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(read.status().message().find(path), std::string::npos) << read.status();
  const absl::Status waited = WaitForFile(path, absl::Now() + absl::Milliseconds(50));
  ASSERT_EQ(waited.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(waited.message().find(path), std::string::npos) << waited;
}

TEST_F(WorkerRendezvousTest, ALineThatIsNotHostAndPortIsInvalid) {
  const std::string path = dir_ + "/bad";
  { std::ofstream(path) << "no-port-here\n"; }
  auto read = ReadAddressFile(path, absl::Seconds(1));
  ASSERT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(read.status().message().find("no-port-here"), std::string::npos) << read.status();
}

TEST_F(WorkerRendezvousTest, AnUnwritableAddressFileIsAnError) {
  const absl::Status s = WriteAddressFile(dir_ + "/no/such/dir/addr", "127.0.0.1:1");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
}

TEST_F(WorkerRendezvousTest, NobodyListeningIsUnavailableAfterTheTimeout) {
  // A port that was free a moment ago: nothing listens there.
  uint16_t port = 0;
  {
    auto fd = ListenTcp("127.0.0.1", 0);
    ASSERT_TRUE(fd.ok()) << fd.status();
    auto bound = BoundTcpPort(fd->get());
    ASSERT_TRUE(bound.ok()) << bound.status();
    port = *bound;
  }
  const absl::Status s = WaitForProducer("127.0.0.1", port, absl::Milliseconds(200));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find(absl::StrCat("127.0.0.1:", port)), std::string::npos) << s;
}

TEST_F(WorkerRendezvousTest, WaitForFileReturnsOnceTheFileExists) {
  const std::string path = dir_ + "/gate";
  { std::ofstream(path) << ""; }
  EXPECT_TRUE(WaitForFile(path, absl::Now() + absl::Seconds(1)).ok());
}

}  // namespace
}  // namespace internal
}  // namespace kvstream
