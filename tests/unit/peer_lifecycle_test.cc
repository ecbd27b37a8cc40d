// Tests of connector/src/peer_lifecycle.h: a consumer's view of one producer (new,
// connecting, up, down with a reconnect backoff), with explicit times.
#include "connector/src/peer_lifecycle.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/time/time.h"

namespace kvstream {
namespace internal {
namespace {

using ::testing::HasSubstr;
using Action = PeerLifecycle::Action;

const absl::Time kT0 = absl::FromUnixSeconds(1000000);

ReconnectPolicy Policy(int64_t initial_ms, int64_t max_ms) {
  ReconnectPolicy p;
  p.initial = absl::Milliseconds(initial_ms);
  p.max = absl::Milliseconds(max_ms);
  return p;
}

TEST(PeerLifecycleTest, FirstLoadConnectsAndThenUsesTheLink) {
  PeerLifecycle p("10.0.0.1:7000", Policy(100, 1000));
  EXPECT_EQ(p.state(), PeerState::kNew);
  auto a = p.Admit(kT0);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, Action::kConnect);
  EXPECT_EQ(p.state(), PeerState::kConnecting);
  p.Connected(kT0);
  EXPECT_EQ(p.state(), PeerState::kUp);
  EXPECT_EQ(p.times_up(), 1);
  for (int i = 0; i < 3; ++i) {
    auto b = p.Admit(kT0 + absl::Seconds(i));
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(*b, Action::kUseLink);
  }
}

TEST(PeerLifecycleTest, OnlyOneAttemptAtATime) {
  PeerLifecycle p("h:1", Policy(100, 1000));
  ASSERT_TRUE(p.Admit(kT0).ok());
  auto second = p.Admit(kT0);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.state(), PeerState::kConnecting);
}

TEST(PeerLifecycleTest, LostLinkIsDownUntilTheInitialBackoffThenReconnects) {
  PeerLifecycle p("10.0.0.1:7000", Policy(200, 5000));
  ASSERT_TRUE(p.Admit(kT0).ok());
  p.Connected(kT0);
  const absl::Time lost = kT0 + absl::Seconds(10);
  p.Lost(lost, absl::UnavailableError("connection reset by peer"));
  EXPECT_EQ(p.state(), PeerState::kDown);
  EXPECT_EQ(p.down_since(), lost);
  EXPECT_EQ(p.retry_at(), lost + absl::Milliseconds(200));

  auto early = p.Admit(lost + absl::Milliseconds(50));
  ASSERT_FALSE(early.ok());
  EXPECT_EQ(early.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(early.status().message(), HasSubstr("producer 10.0.0.1:7000 is down"));
  EXPECT_THAT(early.status().message(), HasSubstr("for 0.05 s"));
  EXPECT_THAT(early.status().message(), HasSubstr("connection reset by peer"));
  EXPECT_THAT(early.status().message(), HasSubstr("next connection attempt in 0.15 s"));
  EXPECT_EQ(p.state(), PeerState::kDown);

  auto due = p.Admit(lost + absl::Milliseconds(200));
  ASSERT_TRUE(due.ok());
  EXPECT_EQ(*due, Action::kConnect);
  p.Connected(lost + absl::Milliseconds(201));
  EXPECT_EQ(p.state(), PeerState::kUp);
  EXPECT_EQ(p.times_up(), 2);
  EXPECT_EQ(p.down_since(), absl::InfinitePast());
}

TEST(PeerLifecycleTest, FailedAttemptsDoubleTheBackoffUpToTheMaximum) {
  PeerLifecycle p("h:1", Policy(100, 700));
  absl::Time now = kT0;
  ASSERT_TRUE(p.Admit(now).ok());
  // Waits after each failed attempt: 100, 200, 400, 700 (capped), 700.
  const int64_t waits[] = {100, 200, 400, 700, 700};
  for (int64_t wait : waits) {
    p.Failed(now, absl::UnavailableError("connection refused"));
    EXPECT_EQ(p.state(), PeerState::kDown);
    EXPECT_EQ(p.retry_at(), now + absl::Milliseconds(wait)) << wait;
    // The peer has been down since the first failure.
    EXPECT_EQ(p.down_since(), kT0);
    EXPECT_FALSE(p.Admit(now + absl::Milliseconds(wait - 1)).ok()) << wait;
    now += absl::Milliseconds(wait);
    auto a = p.Admit(now);
    ASSERT_TRUE(a.ok()) << wait;
    EXPECT_EQ(*a, Action::kConnect);
  }
  EXPECT_EQ(p.times_up(), 0);
}

TEST(PeerLifecycleTest, SuccessResetsTheBackoff) {
  PeerLifecycle p("h:1", Policy(100, 10000));
  ASSERT_TRUE(p.Admit(kT0).ok());
  p.Failed(kT0, absl::UnavailableError("refused"));
  ASSERT_TRUE(p.Admit(kT0 + absl::Milliseconds(100)).ok());
  p.Failed(kT0 + absl::Milliseconds(100), absl::UnavailableError("refused"));  // next: 400
  ASSERT_TRUE(p.Admit(kT0 + absl::Milliseconds(300)).ok());
  p.Connected(kT0 + absl::Milliseconds(300));
  const absl::Time lost = kT0 + absl::Seconds(5);
  p.Lost(lost, absl::UnavailableError("closed"));
  EXPECT_EQ(p.retry_at(), lost + absl::Milliseconds(100));
  ASSERT_TRUE(p.Admit(lost + absl::Milliseconds(100)).ok());
  p.Failed(lost + absl::Milliseconds(100), absl::UnavailableError("refused"));
  // After the lost link, the first failed reconnect waits twice the initial backoff.
  EXPECT_EQ(p.retry_at(), lost + absl::Milliseconds(300));
  EXPECT_EQ(p.down_since(), lost);
}

TEST(PeerLifecycleTest, ZeroBackoffLetsEveryLoadTry) {
  PeerLifecycle p("h:1", Policy(0, 0));
  for (int i = 0; i < 4; ++i) {
    auto a = p.Admit(kT0);
    ASSERT_TRUE(a.ok()) << i;
    EXPECT_EQ(*a, Action::kConnect);
    p.Failed(kT0, absl::UnavailableError("refused"));
  }
}

TEST(PeerLifecycleTest, TransitionsOutOfTheirStateAreIgnored) {
  PeerLifecycle p("h:1", Policy(100, 1000));
  p.Lost(kT0, absl::UnavailableError("x"));  // not up: nothing
  p.Connected(kT0);                          // not connecting: nothing
  p.Failed(kT0, absl::UnavailableError("x"));
  EXPECT_EQ(p.state(), PeerState::kNew);
  EXPECT_TRUE(p.last_error().ok());
  EXPECT_EQ(PeerStateName(PeerState::kDown), "down");
}

}  // namespace
}  // namespace internal
}  // namespace kvstream
