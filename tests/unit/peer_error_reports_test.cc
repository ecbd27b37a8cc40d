// Tests of PeerErrorReports (transfer/src/peer_error_reports.h): failures are told once, in
// order, to the callback current when they were taken; none without a callback.
#include "transfer/src/peer_error_reports.h"

#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace kvstream {
namespace internal {
namespace {

using Told = std::vector<std::pair<PeerId, absl::Status>>;

TEST(PeerErrorReportsTest, TellsEachFailureOnceInOrder) {
  PeerErrorReports reports;
  Told told;
  reports.SetCallback([&told](PeerId p, const absl::Status& s) { told.emplace_back(p, s); });
  reports.Add(3, absl::UnavailableError("a"));
  reports.Add(1, absl::InternalError("b"));
  PeerErrorReports::Pending pending = reports.Take();
  EXPECT_TRUE(told.empty()) << "told before Deliver";
  pending.Deliver();
  EXPECT_EQ(told, (Told{{3, absl::UnavailableError("a")}, {1, absl::InternalError("b")}}));
  told.clear();
  reports.Take().Deliver();  // nothing new
  EXPECT_TRUE(told.empty());
}

TEST(PeerErrorReportsTest, TheCallbackIsTheOneCurrentAtTake) {
  PeerErrorReports reports;
  reports.Add(2, absl::UnavailableError("before any callback"));
  reports.Take().Deliver();  // dropped: nobody to tell
  Told first;
  Told second;
  reports.SetCallback([&first](PeerId p, const absl::Status& s) { first.emplace_back(p, s); });
  reports.Add(4, absl::UnavailableError("x"));
  PeerErrorReports::Pending pending = reports.Take();
  reports.SetCallback([&second](PeerId p, const absl::Status& s) { second.emplace_back(p, s); });
  pending.Deliver();
  EXPECT_EQ(first.size(), 1u);
  EXPECT_TRUE(second.empty());
}

}  // namespace
}  // namespace internal
}  // namespace kvstream
