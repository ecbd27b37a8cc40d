// Tests of transports created by name (transport_factory.h).
#include "kvstream/transfer/transport_factory.h"

#include <algorithm>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvstream {
namespace {

using ::testing::HasSubstr;

TEST(TransportFactoryTest, UnknownNameIsNotFoundAndListsTheChoices) {
  TransportOptions o;
  o.name = "carrier-pigeon";
  auto t = CreateTransport(o);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(t.status().message(), HasSubstr("carrier-pigeon"));
  for (const std::string& name : TransportNames()) {
    EXPECT_THAT(t.status().message(), HasSubstr(name));
  }
}

TEST(TransportFactoryTest, CreatesEachTransportByItsName) {
  TransportOptions o;
  for (const char* name : {"ucx", "loopback"}) {
    o.name = name;
    auto t = CreateTransport(o);
    ASSERT_TRUE(t.ok()) << name << ": " << t.status();
    EXPECT_EQ((*t)->name(), name);
  }
}

TEST(TransportFactoryTest, LoopbackTransportsByNameShareOneFabric) {
  TransportOptions o;
  o.name = "loopback";
  o.loopback_name = "factory-a";
  auto a = CreateTransport(o);
  o.loopback_name = "factory-b";
  auto b = CreateTransport(o);
  ASSERT_TRUE(a.ok() && b.ok());
  auto info = (*b)->LocalInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE((*a)->Connect(*info).ok());
  // Names are unique on the fabric.
  o.loopback_name = "factory-a";
  EXPECT_FALSE(CreateTransport(o).ok());
}

TEST(TransportFactoryTest, DefaultsByMemoryKind) {
  EXPECT_EQ(DefaultTransportName(MemoryKind::kHost), "ucx");
  const std::vector<std::string> names = TransportNames();
  const bool have_ipc = std::find(names.begin(), names.end(), "cuda_ipc") != names.end();
  EXPECT_EQ(DefaultTransportName(MemoryKind::kDevice), have_ipc ? "cuda_ipc" : "ucx");
}

}  // namespace
}  // namespace kvstream
