// FaultyTransport (faulty_transport.h).
#include "tests/testing/faulty_transport.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace kvstream {

enum FaultyTransport::Kind : int {
  kFailPost,
  kFailCompletion,
  kStallCompletion,
  kFlipSource,
  kTruncateWrite,
  kDrop,
  kTruncateNotification,
  kFlipNotification,
  kDuplicate,
  kDelay,
  kReorder,
  kKinds,
};

namespace {

// Each kind's rate in the plan, its count, and its name in reports; indexed by Kind.
struct KindInfo {
  FaultRate FaultPlan::*rate;
  int64_t FaultCounts::*count;
  const char* name;
};

constexpr KindInfo kKindInfo[] = {
    {&FaultPlan::fail_post, &FaultCounts::failed_posts, "failed_posts"},
    {&FaultPlan::fail_completion, &FaultCounts::failed_completions, "failed_completions"},
    {&FaultPlan::stall_completion, &FaultCounts::stalled_completions, "stalled_completions"},
    {&FaultPlan::flip_source_byte, &FaultCounts::flipped_source_bytes, "flipped_source_bytes"},
    {&FaultPlan::truncate_write, &FaultCounts::truncated_writes, "truncated_writes"},
    {&FaultPlan::drop_notification, &FaultCounts::dropped_notifications,
     "dropped_notifications"},
    {&FaultPlan::truncate_notification, &FaultCounts::truncated_notifications,
     "truncated_notifications"},
    {&FaultPlan::flip_notification_byte, &FaultCounts::flipped_notification_bytes,
     "flipped_notification_bytes"},
    {&FaultPlan::duplicate_notification, &FaultCounts::duplicated_notifications,
     "duplicated_notifications"},
    {&FaultPlan::delay_notification, &FaultCounts::delayed_notifications,
     "delayed_notifications"},
    {&FaultPlan::reorder_notification, &FaultCounts::reordered_notifications,
     "reordered_notifications"},
};

absl::Status CheckPlan(const FaultPlan& plan) {
  for (const KindInfo& k : kKindInfo) {
    const FaultRate& r = plan.*k.rate;
    if (!(r.probability >= 0 && r.probability <= 1) || r.every_nth < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("FaultPlan: the rate of ", k.name,
                       " needs a probability in [0, 1] and every_nth >= 0, got ", r.probability,
                       " and ", r.every_nth));
    }
  }
  if (plan.max_delay < absl::ZeroDuration() || plan.max_hold < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("FaultPlan: max_delay and max_hold must not be negative");
  }
  return absl::OkStatus();
}

}  // namespace

int64_t FaultCounts::injected() const {
  int64_t n = 0;
  for (const KindInfo& k : kKindInfo) n += this->*k.count;
  return n;
}

FaultCounts& FaultCounts::operator+=(const FaultCounts& other) {
  posts += other.posts;
  notifications += other.notifications;
  for (const KindInfo& k : kKindInfo) this->*k.count += other.*k.count;
  return *this;
}

std::string FaultCounts::ToString() const {
  std::vector<std::string> parts = {absl::StrCat("posts=", posts),
                                    absl::StrCat("notifications=", notifications)};
  for (const KindInfo& k : kKindInfo) {
    if (this->*k.count != 0) parts.push_back(absl::StrCat(k.name, "=", this->*k.count));
  }
  return absl::StrJoin(parts, " ");
}

absl::StatusOr<std::unique_ptr<FaultyTransport>> FaultyTransport::Create(
    std::unique_ptr<Transport> target, const FaultPlan& plan) {
  if (target == nullptr) return absl::InvalidArgumentError("FaultyTransport: null transport");
  if (absl::Status s = CheckPlan(plan); !s.ok()) return s;
  return std::unique_ptr<FaultyTransport>(new FaultyTransport(std::move(target), plan));
}

FaultyTransport::FaultyTransport(std::unique_ptr<Transport> target, const FaultPlan& plan)
    : TransportWrapper(std::move(target)), plan_(plan), rng_(plan.seed), seen_(kKinds, 0) {
  static_assert(sizeof(kKindInfo) / sizeof(kKindInfo[0]) == kKinds, "one KindInfo per Kind");
}

absl::Status FaultyTransport::SetPlan(const FaultPlan& plan) {
  if (absl::Status s = CheckPlan(plan); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  plan_ = plan;
  rng_.seed(plan.seed);
  return absl::OkStatus();
}

FaultCounts FaultyTransport::counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

size_t FaultyTransport::held_notifications() const {
  absl::MutexLock lock(&mu_);
  return held_.size();
}

bool FaultyTransport::Strike(Kind kind) {
  const FaultRate& rate = plan_.*kKindInfo[kind].rate;
  int64_t& strikes = counts_.*kKindInfo[kind].count;
  const int64_t seen = ++seen_[kind];
  if (rate.max_strikes >= 0 && strikes >= rate.max_strikes) return false;
  bool hit = rate.every_nth > 0 && seen % rate.every_nth == 0;
  if (!hit && rate.probability > 0) {
    hit = std::uniform_real_distribution<double>(0, 1)(rng_) < rate.probability;
  }
  if (hit) ++strikes;
  return hit;
}

uint64_t FaultyTransport::Uniform(uint64_t lo, uint64_t hi) {
  return std::uniform_int_distribution<uint64_t>(lo, hi)(rng_);
}

bool FaultyTransport::FailThisPost() {
  ++counts_.posts;
  if (plan_.fail_posts_after >= 0 && counts_.posts > plan_.fail_posts_after) {
    ++counts_.failed_posts;
    return true;
  }
  return Strike(kFailPost);
}

absl::StatusOr<TransferId> FaultyTransport::PostWrite(PeerId peer, const MemoryRegistration& local,
                                                      const RemoteMemory& remote,
                                                      absl::Span<const Segment> segments,
                                                      absl::string_view notification,
                                                      const WriteOrder& order) {
  std::vector<Segment> segs(segments.begin(), segments.end());
  bool fail_completion = false;
  bool stall_completion = false;
  {
    absl::MutexLock lock(&mu_);
    if (FailThisPost()) {
      return absl::UnavailableError(absl::StrCat("FaultyTransport: injected failure of post ",
                                                 counts_.posts, " (a write to peer ", peer, ")"));
    }
    uint64_t total = 0;
    for (const Segment& s : segs) total += s.length;
    // Only bytes inside the local registration are touched, so a batch the wrapped
    // transport will refuse (OutOfRange) never makes this write out of bounds.
    uint64_t flippable = 0;
    for (const Segment& s : segs) {
      if (s.length <= local.length() && s.local_offset <= local.length() - s.length) {
        flippable += s.length;
      }
    }
    if (flippable > 0 && local.memory_kind() == MemoryKind::kHost && Strike(kFlipSource)) {
      uint64_t at = Uniform(0, flippable - 1);
      for (const Segment& s : segs) {
        if (!(s.length <= local.length() && s.local_offset <= local.length() - s.length)) continue;
        if (at < s.length) {
          const uint8_t mask = static_cast<uint8_t>(Uniform(1, 255));
          static_cast<uint8_t*>(local.base())[s.local_offset + at] ^= mask;
          break;
        }
        at -= s.length;
      }
    }
    if (total > 0 && Strike(kTruncateWrite)) {
      uint64_t cut = Uniform(1, total);
      while (cut > 0 && !segs.empty()) {
        Segment& last = segs.back();
        const uint64_t n = std::min(cut, last.length);
        last.length -= n;
        cut -= n;
        if (last.length == 0) segs.pop_back();
      }
    }
    fail_completion = Strike(kFailCompletion);
    stall_completion = !fail_completion && Strike(kStallCompletion);
  }
  absl::StatusOr<TransferId> id =
      TransportWrapper::PostWrite(peer, local, remote, segs, notification, order);
  AfterPost(id, fail_completion, stall_completion);
  return id;
}

TransportCapabilities FaultyTransport::capabilities() const {
  TransportCapabilities caps = TransportWrapper::capabilities();
  absl::MutexLock lock(&mu_);
  if (plan_.completion_before_delivery) caps.delivered_at_completion = false;
  return caps;
}

void FaultyTransport::AfterPost(const absl::StatusOr<TransferId>& id, bool fail, bool stall) {
  if (id.ok()) {
    absl::MutexLock lock(&mu_);
    if (hold_writes_ && held_done_) held_done_ids_.insert(*id);
  }
  if (!fail && !stall) return;
  {
    absl::MutexLock lock(&mu_);
    if (!id.ok()) {
      // Nothing was posted to fail or stall.
      --(fail ? counts_.failed_completions : counts_.stalled_completions);
      return;
    }
    (fail ? failing_ : stalled_).insert(*id);
  }
  if (fail) (void)TransportWrapper::Cancel(*id);
}

absl::StatusOr<TransferId> FaultyTransport::PostNotification(PeerId peer,
                                                             absl::string_view payload) {
  bool fail_completion = false;
  bool stall_completion = false;
  {
    absl::MutexLock lock(&mu_);
    if (FailThisPost()) {
      return absl::UnavailableError(absl::StrCat("FaultyTransport: injected failure of post ",
                                                 counts_.posts, " (a notification to peer ",
                                                 peer, ")"));
    }
    fail_completion = Strike(kFailCompletion);
    stall_completion = !fail_completion && Strike(kStallCompletion);
  }
  absl::StatusOr<TransferId> id = TransportWrapper::PostNotification(peer, payload);
  AfterPost(id, fail_completion, stall_completion);
  return id;
}

absl::StatusOr<TransferState> FaultyTransport::Test(TransferId id) {
  {
    absl::MutexLock lock(&mu_);
    if (hold_writes_ && held_done_ids_.count(id) != 0) return TransferState::kDone;
  }
  absl::StatusOr<TransferState> state = TransportWrapper::Test(id);
  if (!state.ok() && absl::IsNotFound(state.status())) return state;  // unknown or released
  absl::MutexLock lock(&mu_);
  if (stalled_.count(id) != 0) {
    if (cancelled_.count(id) == 0) return TransferState::kInProgress;
    return absl::CancelledError(
        absl::StrCat("FaultyTransport: stalled transfer ", id, " cancelled"));
  }
  if (failing_.count(id) != 0 && state.ok() && *state == TransferState::kDone) {
    return absl::InternalError(
        absl::StrCat("FaultyTransport: injected failure of transfer ", id, " after it was posted"));
  }
  return state;
}

absl::Status FaultyTransport::Cancel(TransferId id) {
  {
    absl::MutexLock lock(&mu_);
    if (hold_writes_) return absl::OkStatus();  // already "in the socket"
  }
  absl::Status s = TransportWrapper::Cancel(id);
  if (s.ok()) {
    absl::MutexLock lock(&mu_);
    if (stalled_.count(id) != 0) cancelled_.insert(id);
  }
  return s;
}

void FaultyTransport::Release(TransferId id) {
  {
    absl::MutexLock lock(&mu_);
    if (hold_writes_ && held_done_ids_.count(id) != 0) {
      deferred_releases_.push_back(id);  // releasing would drop it from the "socket"
      return;
    }
    failing_.erase(id);
    stalled_.erase(id);
    cancelled_.erase(id);
  }
  TransportWrapper::Release(id);
}

absl::Status FaultyTransport::Progress() {
  {
    absl::MutexLock lock(&mu_);
    if (hold_writes_) return absl::OkStatus();
  }
  return TransportWrapper::Progress();
}

void FaultyTransport::HoldWrites(bool hold, bool report_done) {
  std::vector<TransferId> releases;
  {
    absl::MutexLock lock(&mu_);
    hold_writes_ = hold;
    held_done_ = hold && report_done;
    if (hold) return;
    held_done_ids_.clear();
    releases.swap(deferred_releases_);
  }
  (void)TransportWrapper::Progress();  // what was held goes now
  for (TransferId id : releases) TransportWrapper::Release(id);
}

void FaultyTransport::HoldNotifications(bool hold) {
  absl::MutexLock lock(&mu_);
  hold_all_ = hold;
  if (hold) return;
  const absl::Time now = absl::Now();
  for (Held& h : held_) {
    if (!h.paused) continue;
    h.paused = false;
    h.due = now;  // due order is arrival order: stable_sort keeps it
  }
}

void FaultyTransport::Route(Notification n, uint64_t seq, absl::Time now,
                            std::vector<Notification>& out, uint64_t& newest_out) {
  if (hold_all_) {
    ++counts_.delayed_notifications;
    held_.push_back({std::move(n), seq, absl::InfiniteFuture(), false, true});
    return;
  }
  if (Strike(kDelay)) {
    const int64_t max_us = absl::ToInt64Microseconds(plan_.max_delay);
    const absl::Duration delay =
        absl::Microseconds(static_cast<int64_t>(Uniform(0, static_cast<uint64_t>(max_us))));
    held_.push_back({std::move(n), seq, now + delay, false, false});
    return;
  }
  if (Strike(kReorder)) {
    held_.push_back({std::move(n), seq, now + plan_.max_hold, true, false});
    return;
  }
  newest_out = std::max(newest_out, seq);
  out.push_back(std::move(n));
}

std::vector<Notification> FaultyTransport::PollNotifications() {
  std::vector<Notification> in = TransportWrapper::PollNotifications();
  std::vector<Notification> out;
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  uint64_t newest_out = 0;  // the latest-received notification delivered by this poll
  for (Notification& n : in) {
    ++counts_.notifications;
    const uint64_t seq = next_seq_++;
    if (Strike(kDrop)) continue;
    if (n.payload.size() >= 2 && Strike(kTruncateNotification)) {
      n.payload.resize(Uniform(1, n.payload.size() - 1));
    }
    if (!n.payload.empty() && Strike(kFlipNotification)) {
      const size_t at = Uniform(0, n.payload.size() - 1);
      n.payload[at] = static_cast<char>(static_cast<uint8_t>(n.payload[at]) ^
                                        static_cast<uint8_t>(Uniform(1, 255)));
    }
    if (Strike(kDuplicate)) {
      Notification copy = n;
      Route(std::move(n), seq, now, out, newest_out);
      Route(std::move(copy), seq, now, out, newest_out);
    } else {
      Route(std::move(n), seq, now, out, newest_out);
    }
  }
  // Held notifications whose time came, or (reorder) that a later one overtook, go after
  // everything this poll delivered fresh: delayed ones in due order, overtaken ones in a
  // shuffled order among themselves.
  std::vector<Held> delayed;
  std::vector<Notification> overtaken;
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->reorder && (newest_out > it->seq || it->due <= now)) {
      overtaken.push_back(std::move(it->notification));
      it = held_.erase(it);
    } else if (!it->reorder && it->due <= now) {
      delayed.push_back(std::move(*it));
      it = held_.erase(it);
    } else {
      ++it;
    }
  }
  std::stable_sort(delayed.begin(), delayed.end(),
                   [](const Held& a, const Held& b) { return a.due < b.due; });
  for (Held& h : delayed) out.push_back(std::move(h.notification));
  std::shuffle(overtaken.begin(), overtaken.end(), rng_);
  for (Notification& n : overtaken) out.push_back(std::move(n));
  return out;
}

}  // namespace kvstream
