// The chaos soak's iterations (chaos_soak.h).
#include "tests/chaos/chaos_soak.h"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <iostream>
#include <set>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "kvstream/common/status_macros.h"
#include "ucp/api/ucp.h"
#include "tests/chaos/chaos_setup.h"
#include "tests/chaos/hostile_client.h"

namespace kvstream {
namespace chaos {
namespace {

constexpr int kMaxNewTokens = 3;
// Above the consumer's own limit for a run (chaos_peer.cc), so that a hang inside it is
// reported by the consumer with its state rather than as silence.
constexpr absl::Duration kResultLimit = absl::Seconds(45);
// A producer whose consumer is gone or was stopped must have freed everything once its
// send deadline passed; this leaves room for a loaded machine.
constexpr absl::Duration kProducerDrainLimit = absl::Seconds(15);

std::string LogitsHex(const std::vector<float>& logits) {
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(logits.data()),
                                                  logits.size() * sizeof(float)));
}

// Waits (bounded) until `pid` is in the stopped state, so that a SIGCONT sent next cannot
// overtake the SIGSTOP the process raised itself.
absl::Status WaitStopped(pid_t pid) {
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (absl::Now() < deadline) {
    std::ifstream f(absl::StrCat("/proc/", pid, "/stat"));
    std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const size_t paren = stat.rfind(')');
    if (paren != std::string::npos && paren + 2 < stat.size()) {
      const char state = stat[paren + 2];
      if (state == 'T' || state == 't') return absl::OkStatus();
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  return absl::DeadlineExceededError(absl::StrCat("peer ", pid, " did not stop"));
}

bool KillsOrStopsProducer(Fault fault) {
  return fault == Fault::kKillProducerAfterDelay || fault == Fault::kKillProducerAtLayer ||
         fault == Fault::kStopProducerAtLayer || fault == Fault::kStopProducerAfterDelay;
}

}  // namespace

bool UcxCrashesOnFailedRkeyUnpack() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return major < 1 || (major == 1 && minor < 19);
}

bool UcxAbortsOnTcpWireupLoss() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return major < 1 || (major == 1 && minor < 14);
}

const char* FaultName(Fault fault) {
  switch (fault) {
    case Fault::kNone: return "none";
    case Fault::kKillProducerAfterDelay: return "kill_producer_delay";
    case Fault::kKillProducerAtLayer: return "kill_producer_layer";
    case Fault::kStopProducerAtLayer: return "stop_producer_layer";
    case Fault::kStopProducerAfterDelay: return "stop_producer_delay";
    case Fault::kKillConsumerAfterDelay: return "kill_consumer_delay";
    case Fault::kKillConsumerAtLayer: return "kill_consumer_layer";
    case Fault::kStopConsumerAfterDelay: return "stop_consumer_delay";
    case Fault::kHostileFrames: return "hostile_only";
  }
  return "?";
}

struct Soak::Iteration {
  int64_t index = 0;
  std::mt19937_64 rng;
  std::string tls;
  std::string policy;
  Fault fault = Fault::kNone;
  std::vector<Request> requests;
  bool hostile = false;
  bool producer_killed = false;
  bool producer_continued = false;  // stopped past the deadlines, then continued
  bool consumer_killed = false;
  std::string note;  // what happened, for the iteration's line
};

absl::StatusOr<std::unique_ptr<Soak>> Soak::Create(const SoakOptions& options) {
  std::unique_ptr<Soak> soak(new Soak(options));
  // Lengths around block edges (16 tokens a block): a last block of one token, a full one,
  // one past it.
  const int lengths[] = {3, 5, 9, 16, 17, 31, 33, 47};
  std::mt19937 rng(1234);
  const ToyModelConfig model = ChaosModel();
  EngineOptions eo;
  eo.model = model;
  eo.num_blocks = kNumBlocks;
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> colocated, Engine::Create(eo));
  for (size_t i = 0; i < std::size(lengths); ++i) {
    std::vector<int32_t> prompt(static_cast<size_t>(lengths[i]));
    for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(model.vocab_size));
    soak->prompts_.push_back(prompt);
    RequestSpec spec;
    spec.id = absl::StrCat(i);
    spec.prompt = prompt;
    spec.max_new_tokens = kMaxNewTokens;
    RETURN_IF_ERROR(colocated->AddRequest(std::move(spec)));
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (colocated->HasWork()) {
    if (absl::Now() > deadline) return absl::DeadlineExceededError("the colocated run hung");
    ASSIGN_OR_RETURN(bool ran, colocated->Step());
    (void)ran;
  }
  soak->reference_.resize(soak->prompts_.size());
  for (RequestResult& r : colocated->TakeFinished()) {
    RETURN_IF_ERROR(r.status);
    size_t i = 0;
    if (!absl::SimpleAtoi(r.id, &i) || i >= soak->reference_.size()) {
      return absl::InternalError("colocated run: unknown id");
    }
    soak->reference_[i] = {r.output_tokens, r.logits};
  }
  return soak;
}

Soak::~Soak() = default;

absl::StatusOr<PeerProcess*> Soak::Producer(const std::string& tls, int port) {
  std::unique_ptr<PeerProcess>& p = producers_[tls];
  if (p != nullptr && p->alive()) return p.get();
  PeerOptions o;
  o.role = "producer";
  o.engine_id = "chaos-prefill-" + tls;
  o.tls = tls;
  o.port = port;
  o.log_path = absl::StrCat(options_.log_dir, "/prefill-", tls, "-", spawned_++, ".log");
  recent_logs_.push_back(o.log_path);
  auto started = PeerProcess::Start(options_.self, o);
  if (!started.ok() && port != 0) {
    // The old port can be taken by another process meanwhile: a new one is still a restart.
    o.port = 0;
    started = PeerProcess::Start(options_.self, o);
  }
  if (!started.ok()) return started.status();
  p = *std::move(started);
  ports_[tls] = p->port();
  return p.get();
}

absl::StatusOr<PeerProcess*> Soak::Consumer(const std::string& policy, const std::string& tls) {
  std::unique_ptr<PeerProcess>& c = consumers_[policy + "-" + tls];
  if (c != nullptr && c->alive()) return c.get();
  PeerOptions o;
  o.role = "consumer";
  o.engine_id = absl::StrCat("chaos-decode-", policy, "-", tls);
  o.tls = tls;
  o.policy = policy;
  o.log_path = absl::StrCat(options_.log_dir, "/decode-", policy, "-", tls, "-", spawned_++, ".log");
  recent_logs_.push_back(o.log_path);
  ASSIGN_OR_RETURN(c, PeerProcess::Start(options_.self, o));
  return c.get();
}

absl::Status Soak::SendRun(PeerProcess& consumer, const PeerProcess& producer,
                           const std::vector<Request>& requests) {
  RETURN_IF_ERROR(consumer.Send(
      absl::StrCat("run ", producer.host(), " ", producer.port(), " ", requests.size())));
  for (const Request& r : requests) {
    RETURN_IF_ERROR(consumer.Send(absl::StrCat("req ", r.id, " ", kMaxNewTokens, " ",
                                               absl::StrJoin(prompts_[r.prompt], ","))));
  }
  counts_.requests += static_cast<int64_t>(requests.size());
  return absl::OkStatus();
}

absl::Status Soak::CheckRun(PeerProcess& consumer, const PeerProcess& producer,
                            const std::vector<Request>& requests) {
  linked_.erase(consumer.pid());
  const int64_t disaggregated = counts_.disaggregated;
  const bool fail_policy = consumer.options().policy == "fail";
  std::map<std::string, int> want;
  for (const Request& r : requests) want[r.id] = r.prompt;
  const absl::Time deadline = absl::Now() + kResultLimit;
  while (true) {
    auto line = consumer.ReadLine(deadline);
    if (!line.ok()) {
      return absl::InternalError(absl::StrCat("consumer ", consumer.options().engine_id,
                                              " gave no result (crashed or hung): ",
                                              line.status().ToString()));
    }
    std::vector<std::string> f = absl::StrSplit(*line, absl::MaxSplits(' ', 7));
    if (f[0] == "error") {
      return absl::InternalError(absl::StrCat("consumer failed: ", *line));
    }
    if (f[0] == "done") {
      int free_blocks = -1, total = -2;
      if (f.size() != 3 || !absl::SimpleAtoi(f[1], &free_blocks) ||
          !absl::SimpleAtoi(f[2], &total)) {
        return absl::InternalError(absl::StrCat("bad line from the consumer: ", *line));
      }
      if (free_blocks != total) {
        return absl::InternalError(absl::StrCat("BLOCKS LEAKED on the consumer: ", free_blocks,
                                                " of ", total, " free after its run"));
      }
      break;
    }
    int code = 0, recomputed = 0;
    int64_t remote = 0;
    if (f.size() != 8 || f[0] != "result" || !absl::SimpleAtoi(f[2], &code) ||
        !absl::SimpleAtoi(f[3], &recomputed) || !absl::SimpleAtoi(f[4], &remote)) {
      return absl::InternalError(absl::StrCat("bad line from the consumer: ", *line));
    }
    auto w = want.find(f[1]);
    if (w == want.end()) {
      return absl::InternalError(absl::StrCat("result for a request not in this run (or twice): ",
                                              f[1]));
    }
    const ReferenceOutput& ref = reference_[static_cast<size_t>(w->second)];
    if (code == 0) {
      const std::string want_tokens = absl::StrJoin(ref.tokens, ",");
      if (f[5] != want_tokens || f[6] != LogitsHex(ref.logits)) {
        return absl::InternalError(absl::StrCat(
            "WRONG OUTPUT for ", f[1], " (prompt ", w->second, ", ",
            recomputed ? "recomputed" : absl::StrCat(remote, " tokens from the producer"),
            "): tokens [", f[5], "], colocated [", want_tokens, "]",
            f[5] == want_tokens ? "; the logits differ" : ""));
      }
      ++counts_.completed;
      if (recomputed) ++counts_.recomputed;
      if (!recomputed && remote > 0) ++counts_.disaggregated;
    } else {
      std::string message;
      absl::CUnescape(f[7], &message);
      if (!fail_policy) {
        return absl::InternalError(
            absl::StrCat("request ", f[1], " FAILED under recompute: ", message));
      }
      if (recomputed) {
        return absl::InternalError(absl::StrCat("request ", f[1], " recomputed under fail"));
      }
      ++counts_.failed;
    }
    want.erase(w);
  }
  if (!want.empty()) {
    return absl::InternalError(
        absl::StrCat("no result for ", want.size(), " request(s), e.g. ", want.begin()->first));
  }
  if (counts_.disaggregated > disaggregated) linked_[consumer.pid()] = producer.pid();
  return absl::OkStatus();
}

absl::Status Soak::CheckProducerBlocks(PeerProcess& producer) {
  const absl::Time deadline = absl::Now() + kProducerDrainLimit;
  std::string last;
  while (true) {
    const int64_t seq = ++status_seq_;
    RETURN_IF_ERROR(producer.Send(absl::StrCat("status ", seq)));
    std::vector<std::string> f;
    int64_t got_seq = -1;
    while (got_seq != seq) {
      auto line = producer.ReadLine(absl::Now() + absl::Seconds(5));
      if (!line.ok()) {
        return absl::InternalError(absl::StrCat("producer ", producer.options().engine_id,
                                                " does not answer (crashed or hung): ",
                                                line.status().ToString()));
      }
      if (*line == "armed") continue;  // the answer to a disarm sent while stopped
      f = absl::StrSplit(*line, ' ');
      if (f.size() != 7 || f[0] != "status" || !absl::SimpleAtoi(f[1], &got_seq)) {
        return absl::InternalError(absl::StrCat("bad line from the producer: ", *line));
      }
      last = *line;
    }
    int64_t served = 0;
    int free_blocks = 0, total = 0, has_work = 1;
    if (!absl::SimpleAtoi(f[2], &served) || !absl::SimpleAtoi(f[3], &free_blocks) ||
        !absl::SimpleAtoi(f[4], &total) || !absl::SimpleAtoi(f[5], &has_work)) {
      return absl::InternalError(absl::StrCat("bad line from the producer: ", last));
    }
    if (has_work == 0) {
      if (free_blocks != total) {
        return absl::InternalError(absl::StrCat("BLOCKS LEAKED on the producer: ", free_blocks,
                                                " of ", total, " free with no work left"));
      }
      return absl::OkStatus();
    }
    if (absl::Now() > deadline) {
      return absl::InternalError(absl::StrCat(
          "the producer still holds work ", absl::FormatDuration(kProducerDrainLimit),
          " after the iteration (", last, ")"));
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
}

absl::StatusOr<bool> Soak::WaitForFault(PeerProcess& armed, PeerProcess& consumer) {
  const absl::Time deadline = absl::Now() + kResultLimit;
  const bool armed_is_consumer = &armed == &consumer;
  while (absl::Now() < deadline) {
    if (armed.Readable()) {
      auto line = armed.ReadLine(deadline);
      if (!line.ok()) return line.status();
      if (!absl::StartsWith(*line, "fault ")) {
        return absl::InternalError(absl::StrCat("expected the armed fault, got: ", *line));
      }
      return *line != "fault none";
    }
    if (!armed_is_consumer && consumer.Readable()) {
      // The run ended (or the consumer is reporting) before the producer reached the
      // layer. Disarm; a fault that fired meanwhile comes before the answer "armed" (which
      // a producer stopped by it gives once continued, and CheckProducerBlocks skips).
      RETURN_IF_ERROR(armed.Send("arm -1 -"));
      auto line = armed.ReadLine(absl::Now() + absl::Seconds(5));
      if (!line.ok()) return line.status();
      return absl::StartsWith(*line, "fault ");
    }
    absl::SleepFor(absl::Microseconds(500));
  }
  return absl::DeadlineExceededError("the armed fault was never reached");
}

absl::Status Soak::Arm(PeerProcess& peer, const std::string& command) {
  RETURN_IF_ERROR(peer.Send(command));
  auto line = peer.ReadLine(absl::Now() + absl::Seconds(5));
  if (!line.ok()) return line.status();
  if (*line != "armed") {
    return absl::InternalError(absl::StrCat("expected 'armed' from the peer, got: ", *line));
  }
  return absl::OkStatus();
}

absl::Status Soak::InjectFault(Iteration& it, PeerProcess& producer, PeerProcess& consumer) {
  auto delay = [&it] { absl::SleepFor(absl::Milliseconds(static_cast<int64_t>(it.rng() % 60))); };
  auto hold = [&it](int64_t deadline_ms) {
    absl::SleepFor(absl::Milliseconds(deadline_ms + 100 + static_cast<int64_t>(it.rng() % 300)));
  };
  // A stopped producer is continued or killed, at random.
  auto stopped_producer = [&]() -> absl::Status {
    RETURN_IF_ERROR(WaitStopped(producer.pid()));
    hold(kLoadTimeoutMs);
    if (it.rng() % 2 == 0) {
      producer.Signal(SIGCONT);
      it.producer_continued = true;
      absl::StrAppend(&it.note, ", continued");
    } else {
      absl::StrAppend(&it.note, ", killed");
      producer.Kill();
      it.producer_killed = true;
    }
    return absl::OkStatus();
  };
  switch (it.fault) {
    case Fault::kNone:
    case Fault::kHostileFrames:
      return absl::OkStatus();
    case Fault::kKillProducerAfterDelay:
      delay();
      producer.Kill();
      it.producer_killed = true;
      return absl::OkStatus();
    case Fault::kKillProducerAtLayer:
    case Fault::kStopProducerAtLayer: {
      ASSIGN_OR_RETURN(bool reached, WaitForFault(producer, consumer));
      if (!reached) {
        ++counts_.faults["not_reached"];
        absl::StrAppend(&it.note, " (not reached)");
        return absl::OkStatus();
      }
      if (it.fault == Fault::kStopProducerAtLayer) return stopped_producer();
      producer.Kill();  // reaps the process that killed itself
      it.producer_killed = true;
      return absl::OkStatus();
    }
    case Fault::kStopProducerAfterDelay:
      delay();
      producer.Signal(SIGSTOP);
      return stopped_producer();
    case Fault::kKillConsumerAfterDelay:
      delay();
      consumer.Kill();
      it.consumer_killed = true;
      return absl::OkStatus();
    case Fault::kKillConsumerAtLayer: {
      ASSIGN_OR_RETURN(bool reached, WaitForFault(consumer, consumer));
      if (!reached) {
        ++counts_.faults["not_reached"];
        absl::StrAppend(&it.note, " (not reached)");
        return absl::OkStatus();
      }
      consumer.Kill();
      it.consumer_killed = true;
      return absl::OkStatus();
    }
    case Fault::kStopConsumerAfterDelay:
      delay();
      consumer.Signal(SIGSTOP);
      RETURN_IF_ERROR(WaitStopped(consumer.pid()));
      hold(kSendTimeoutMs);
      consumer.Signal(SIGCONT);
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

absl::Status Soak::RunIteration(int64_t index) {
  Iteration it;
  absl::Status s = RunIteration(index, it);
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(it.note, ": ", s.message()));
}

absl::Status Soak::RunIteration(int64_t index, Iteration& it) {
  const absl::Time start = absl::Now();
  it.index = index;
  it.rng.seed(options_.seed ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(index + 1)));
  it.tls = it.rng() % static_cast<uint64_t>(options_.tcp_one_in) == 0 ? "tcp" : "shm";
  it.policy = it.rng() % 2 == 0 ? "recompute" : "fail";
  it.fault = static_cast<Fault>(it.rng() % kNumFaults);
  if (options_.only_fault >= 0) it.fault = static_cast<Fault>(options_.only_fault);
  it.hostile = it.fault == Fault::kHostileFrames || it.rng() % 4 == 0;
  if (it.tls == "tcp" && KillsOrStopsProducer(it.fault) && UcxAbortsOnTcpWireupLoss()) {
    // See UcxAbortsOnTcpWireupLoss (chaos_soak.h): this fault runs over shared memory.
    it.tls = "shm";
    ++counts_.faults["tcp_moved_to_shm"];
  }
  const int n = 1 + static_cast<int>(it.rng() % 3);
  for (int i = 0; i < n; ++i) {
    it.requests.push_back(
        {absl::StrCat("it", index, "-r", i), static_cast<int>(it.rng() % prompts_.size())});
  }
  const SoakCounts before = counts_;
  ++counts_.iterations;
  ++counts_.faults[FaultName(it.fault)];
  if (it.tls == "tcp") ++counts_.tcp_iterations;
  if (it.policy == "fail") ++counts_.fail_policy_iterations;
  recent_logs_.clear();

  ASSIGN_OR_RETURN(PeerProcess * producer, Producer(it.tls));
  ASSIGN_OR_RETURN(PeerProcess * consumer, Consumer(it.policy, it.tls));
  recent_logs_ = {producer->options().log_path, consumer->options().log_path};
  const int layer = static_cast<int>(it.rng() % static_cast<uint64_t>(ChaosModel().num_layers));
  it.note = absl::StrCat("it ", index, ": ", it.tls, " ", it.policy, " ", FaultName(it.fault));
  if ((it.fault == Fault::kKillConsumerAfterDelay || it.fault == Fault::kKillConsumerAtLayer) &&
      UcxCrashesOnFailedRkeyUnpack()) {
    // See UcxCrashesOnFailedRkeyUnpack (chaos_soak.h): the consumer is killed only once its
    // handshake with this producer is over, which a request served by the producer proves.
    for (int w = 0; w < 3 && linked_[consumer->pid()] != producer->pid(); ++w) {
      const std::vector<Request> warm_up = {{absl::StrCat("it", index, "-w", w), 0}};
      RETURN_IF_ERROR(SendRun(*consumer, *producer, warm_up));
      RETURN_IF_ERROR(CheckRun(*consumer, *producer, warm_up));
      ++counts_.faults["warm_ups"];
      absl::StrAppend(&it.note, " (after a warm-up run)");
    }
  }
  if (it.fault == Fault::kKillProducerAtLayer || it.fault == Fault::kStopProducerAtLayer ||
      it.fault == Fault::kKillConsumerAtLayer) {
    absl::StrAppend(&it.note, " at layer ", layer);
  }
  if (it.fault == Fault::kKillProducerAtLayer || it.fault == Fault::kStopProducerAtLayer) {
    RETURN_IF_ERROR(Arm(*producer, absl::StrCat(
        "arm ", layer, it.fault == Fault::kKillProducerAtLayer ? " kill" : " stop")));
  }
  if (it.fault == Fault::kKillConsumerAtLayer) {
    RETURN_IF_ERROR(Arm(*consumer, absl::StrCat("arm ", layer, " kill")));
  }
  RETURN_IF_ERROR(SendRun(*consumer, *producer, it.requests));

  std::thread hostile;
  std::atomic<int64_t> connections{0}, frames{0};
  if (it.hostile) {
    HostileTarget target{producer->port(), consumer->options().engine_id, it.requests[0].id};
    hostile = std::thread([target, seed = it.rng(), &connections, &frames] {
      std::mt19937_64 rng(seed);
      const int count = 1 + static_cast<int>(rng() % 4);
      for (int i = 0; i < count; ++i) {
        const auto kind = static_cast<HostileKind>(rng() % kNumHostileKinds);
        frames += PlayHostileConnection(rng, target, kind);
        ++connections;
        absl::SleepFor(absl::Milliseconds(static_cast<int64_t>(rng() % 20)));
      }
    });
  }
  absl::Status status = InjectFault(it, *producer, *consumer);
  if (status.ok() && !it.consumer_killed) status = CheckRun(*consumer, *producer, it.requests);
  if (hostile.joinable()) hostile.join();
  counts_.hostile_connections += connections;
  counts_.hostile_frames += frames;
  RETURN_IF_ERROR(status);

  if (it.producer_continued && it.rng() % 2 == 0) {
    // The same ids again at once, to the producer that may still be prefilling (or sending)
    // their first attempts, which the consumer gave up on.
    ++counts_.faults["same_ids_after_producer_continue"];
    absl::StrAppend(&it.note, ", same ids again");
    RETURN_IF_ERROR(SendRun(*consumer, *producer, it.requests));
    RETURN_IF_ERROR(CheckRun(*consumer, *producer, it.requests));
  }
  if (it.producer_killed) {
    // A new producer on the same port; half of the time the consumer hands it the same
    // request ids again, which must then run as if new.
    const int old_port = ports_[it.tls];
    ASSIGN_OR_RETURN(producer, Producer(it.tls, old_port));
    if (producer->port() != old_port) absl::StrAppend(&it.note, " (on a new port)");
    ++counts_.faults["producer_restarts"];
    absl::StrAppend(&it.note, ", producer restarted");
    recent_logs_.push_back(producer->options().log_path);
    if (it.rng() % 2 == 0) {
      ++counts_.faults["same_ids_after_producer_restart"];
      absl::StrAppend(&it.note, ", same ids again");
      RETURN_IF_ERROR(SendRun(*consumer, *producer, it.requests));
      RETURN_IF_ERROR(CheckRun(*consumer, *producer, it.requests));
    }
  }
  if (it.consumer_killed) {
    // A new consumer under the same engine id, at once (the producer may still hold the
    // dead one's requests); half of the time with the same request ids.
    ASSIGN_OR_RETURN(consumer, Consumer(it.policy, it.tls));
    ++counts_.faults["consumer_restarts"];
    absl::StrAppend(&it.note, ", consumer restarted");
    recent_logs_.push_back(consumer->options().log_path);
    if (it.rng() % 2 == 0) {
      ++counts_.faults["same_ids_after_consumer_restart"];
      absl::StrAppend(&it.note, ", same ids again");
      RETURN_IF_ERROR(SendRun(*consumer, *producer, it.requests));
      RETURN_IF_ERROR(CheckRun(*consumer, *producer, it.requests));
    }
  }
  RETURN_IF_ERROR(CheckProducerBlocks(*producer));
  absl::StrAppend(&it.note, "; ",
                  counts_.requests - before.requests, " requests: ",
                  counts_.disaggregated - before.disaggregated, " from the producer, ",
                  counts_.recomputed - before.recomputed, " recomputed, ",
                  counts_.failed - before.failed, " failed; hostile connections ",
                  counts_.hostile_connections - before.hostile_connections, "; ",
                  absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(1))));
  std::cout << it.note << std::endl;
  return absl::OkStatus();
}

absl::Status Soak::Shutdown() {
  absl::Status result;
  for (auto* group : {&consumers_, &producers_}) {
    for (auto& [name, peer] : *group) {
      if (peer == nullptr || !peer->alive()) continue;
      absl::Status sent = peer->Send("quit");
      auto rc = sent.ok() ? peer->WaitExit(absl::Now() + absl::Seconds(20))
                          : absl::StatusOr<int>(sent);
      if (!rc.ok() || *rc != 0) {
        result.Update(absl::InternalError(absl::StrCat(
            name, " did not exit cleanly: ",
            rc.ok() ? absl::StrCat("exit status ", *rc) : rc.status().ToString(), "\n",
            LogTail(peer->options().log_path))));
      }
      peer->Kill();
    }
    group->clear();
  }
  return result;
}

std::string Soak::FailureLogs() const {
  std::string out;
  for (const std::string& path : recent_logs_) {
    absl::StrAppend(&out, "--- ", path, "\n", LogTail(path), "\n");
  }
  return out;
}

}  // namespace chaos
}  // namespace kvstream
