// Tests of the UCX configuration kvstream derives from UcxTransportOptions
// (transfer/src/ucx/ucx_setup.h): fragment sizes per transport, the caller's settings last.
#include <string>
#include <utility>

#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transfer/src/ucx/ucx_setup.h"

namespace kvstream {
namespace internal {
namespace {

using ::testing::Contains;
using ::testing::Not;
using ::testing::Pair;

UcxTransportOptions WithTls(std::string tls) {
  UcxTransportOptions options;
  options.tls = std::move(tls);
  return options;
}

TEST(UcxConfigForTest, TcpGetsLargeFragmentsBothWays) {
  for (const char *tls : {"tcp", "tcp,sm,self", "^ib", "all"}) {
    const UcxSettings settings = UcxConfigFor(WithTls(tls));
    EXPECT_THAT(settings, Contains(Pair("TX_SEG_SIZE", "256k"))) << tls;
    EXPECT_THAT(settings, Contains(Pair("RX_SEG_SIZE", "256k"))) << tls;
  }
}

TEST(UcxConfigForTest, SharedMemoryOnlyLeavesTcpAlone) {
  const UcxSettings settings = UcxConfigFor(WithTls("shm"));
  EXPECT_THAT(settings, Contains(Pair("TLS", "sm,self")));
  EXPECT_THAT(settings, Contains(Pair("MM_SEG_SIZE", "64k")));
  EXPECT_THAT(settings, Not(Contains(Pair("TX_SEG_SIZE", ::testing::_))));
  EXPECT_THAT(settings, Not(Contains(Pair("RX_SEG_SIZE", ::testing::_))));
}

TEST(UcxConfigForTest, TcpOnlyLeavesSharedMemoryAlone) {
  const UcxSettings settings = UcxConfigFor(WithTls("tcp"));
  EXPECT_THAT(settings, Contains(Pair("TLS", "tcp,self")));
  EXPECT_THAT(settings, Not(Contains(Pair("MM_SEG_SIZE", ::testing::_))));
}

TEST(UcxConfigForTest, DevicesAndKeepaliveFromTheOptions) {
  UcxTransportOptions options = WithTls("tcp");
  options.net_devices = "eth0";
  options.keepalive_interval = absl::Milliseconds(250);
  const UcxSettings settings = UcxConfigFor(options);
  EXPECT_THAT(settings, Contains(Pair("NET_DEVICES", "eth0")));
  EXPECT_THAT(settings, Contains(Pair("KEEPALIVE_INTERVAL", "250ms")));
  options.net_devices.clear();
  options.keepalive_interval = absl::ZeroDuration();
  EXPECT_THAT(UcxConfigFor(options), Not(Contains(Pair("NET_DEVICES", ::testing::_))));
  EXPECT_THAT(UcxConfigFor(options), Not(Contains(Pair("KEEPALIVE_INTERVAL", ::testing::_))));
}

TEST(UcxConfigForTest, CallersSettingsComeLastSoTheyWin) {
  UcxTransportOptions options = WithTls("tcp");
  options.ucx_config = {{"TX_SEG_SIZE", "8k"}, {"RX_SEG_SIZE", "64k"}};
  const UcxSettings settings = UcxConfigFor(options);
  ASSERT_GE(settings.size(), 2u);
  EXPECT_EQ(settings[settings.size() - 2],
            (std::pair<std::string, std::string>("TX_SEG_SIZE", "8k")));
  EXPECT_EQ(settings.back(), (std::pair<std::string, std::string>("RX_SEG_SIZE", "64k")));
}

}  // namespace
}  // namespace internal
}  // namespace kvstream
