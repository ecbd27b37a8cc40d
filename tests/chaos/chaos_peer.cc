// The chaos soak's peer processes (chaos_peer.h).
#include "tests/chaos/chaos_peer.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/connector/config.h"
#include "kvstream/connector/factory.h"
#include "kvstream/connector/layer_name.h"
#include "kvstream/serving/engine.h"
#include "kvstream/serving/pipeline_link.h"
#include "tests/chaos/chaos_setup.h"
#include "tests/integration/ucx_transport_peer.h"

namespace kvstream {
namespace chaos {
namespace {

using test::kPeerOutFd;
using test::PipeReader;
using test::WriteLine;

// How long a consumer's run may take before the peer calls it a hang: far above what the
// connector's own deadlines (chaos_setup.h) allow for, so only a wait without a deadline
// reaches it.
constexpr absl::Duration kRunLimit = absl::Seconds(30);

void Say(const std::string& line) { (void)WriteLine(kPeerOutFd, line); }

// Forwards to the connector; raises the armed signal once the armed layer's hook has run
// (producer: after attention, when the layer's send was posted; consumer: before attention,
// when the layer's wait returned). The line saying so goes out first, so that the driver
// knows the fault was reached and where.
class FaultHook : public TransferHook {
 public:
  FaultHook(TransferHook* inner, bool producer) : inner_(inner), producer_(producer) {}

  void Arm(int layer, int signal_number) {
    layer_ = layer;
    signal_ = signal_number;
  }
  // Disarms; whether the fault was still armed.
  bool Disarm() { return std::exchange(layer_, -1) >= 0; }

  absl::Status BeforeAttention(absl::string_view layer_name, void* stream) override {
    absl::Status s = inner_->BeforeAttention(layer_name, stream);
    if (!producer_) MaybeFire(layer_name);
    return s;
  }
  absl::Status AfterAttention(absl::string_view layer_name, const KvCache& cache,
                              const AttentionMetadata& md, void* stream) override {
    absl::Status s = inner_->AfterAttention(layer_name, cache, md, stream);
    if (producer_) MaybeFire(layer_name);
    return s;
  }

 private:
  void MaybeFire(absl::string_view layer_name) {
    if (layer_ < 0) return;
    auto index = ParseLayerIndex(layer_name);
    if (!index.ok() || *index != layer_) return;
    const int signal_number = signal_;
    layer_ = -1;  // once: a stopped peer that is continued runs on
    Say(absl::StrCat("fault ", signal_number == SIGKILL ? "kill" : "stop", " ", *index));
    ::raise(signal_number);
  }

  TransferHook* inner_;
  bool producer_;
  int layer_ = -1;
  int signal_ = 0;
};

int Fail(const absl::Status& s) {
  Say(absl::StrCat("error ", absl::CHexEscape(s.ToString())));
  std::fprintf(stderr, "chaos peer: %s\n", s.ToString().c_str());
  return 1;
}

// "arm <layer> <kill|stop>".
absl::Status HandleArm(const std::vector<std::string>& words, FaultHook& hook) {
  int layer = -1;
  if (words.size() != 3 || !absl::SimpleAtoi(words[1], &layer)) {
    return absl::InvalidArgumentError("arm: want 'arm <layer> <kill|stop>'");
  }
  hook.Arm(layer, words[2] == "stop" ? SIGSTOP : SIGKILL);
  Say("armed");
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> ParseTokens(absl::string_view csv) {
  std::vector<int32_t> out;
  for (absl::string_view t : absl::StrSplit(csv, ',')) {
    int32_t v = 0;
    if (!absl::SimpleAtoi(t, &v)) return absl::InvalidArgumentError("bad token list");
    out.push_back(v);
  }
  return out;
}

std::string ResultLine(const RequestResult& r) {
  const std::string tokens =
      r.output_tokens.empty() ? "-" : absl::StrJoin(r.output_tokens, ",");
  const std::string logits =
      r.logits.empty()
          ? "-"
          : absl::BytesToHexString(absl::string_view(
                reinterpret_cast<const char*>(r.logits.data()), r.logits.size() * sizeof(float)));
  const std::string message = r.status.ok() ? "-" : absl::CHexEscape(r.status.ToString());
  return absl::StrCat("result ", r.id, " ", static_cast<int>(r.status.code()), " ",
                      r.recomputed ? 1 : 0, " ", r.remote_tokens, " ", tokens, " ", logits, " ",
                      message);
}

// "run <host> <port> <n>" and its n request lines: hands the requests to the producer at
// host:port, runs them to the end, answers with their results and the block count.
absl::Status HandleRun(const std::vector<std::string>& words, PipeReader& in, Engine& engine,
                       FaultHook& hook) {
  int port = 0, n = 0;
  if (words.size() != 4 || !absl::SimpleAtoi(words[2], &port) || !absl::SimpleAtoi(words[3], &n)) {
    return absl::InvalidArgumentError("run: want 'run <host> <port> <n>'");
  }
  for (int i = 0; i < n; ++i) {
    auto line = in.ReadLine(absl::Now() + absl::Seconds(10));
    if (!line.ok()) return line.status();
    std::vector<std::string> f = absl::StrSplit(*line, ' ');
    RequestSpec spec;
    if (f.size() != 4 || f[0] != "req" || !absl::SimpleAtoi(f[2], &spec.max_new_tokens)) {
      return absl::InvalidArgumentError(absl::StrCat("run: bad request line '", *line, "'"));
    }
    spec.id = f[1];
    auto tokens = ParseTokens(f[3]);
    if (!tokens.ok()) return tokens.status();
    spec.prompt = *std::move(tokens);
    spec.remote = RemotePrefill{words[1], port};
    RETURN_IF_ERROR(engine.AddRequest(std::move(spec)));
  }
  const absl::Time deadline = absl::Now() + kRunLimit;
  while (engine.HasWork()) {
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("the consumer's run did not end within ", absl::FormatDuration(kRunLimit)));
    }
    auto ran = engine.Step();
    if (!ran.ok()) return ran.status();
    if (!*ran) absl::SleepFor(absl::Milliseconds(1));
  }
  // A run with no forward pass (every request failed at its hand-off) never reached the
  // armed layer: say so where the driver waits for the fault.
  if (hook.Disarm()) Say("fault none");
  for (const RequestResult& r : engine.TakeFinished()) Say(ResultLine(r));
  Say(absl::StrCat("done ", engine.num_free_blocks(), " ", engine.num_blocks()));
  return absl::OkStatus();
}

}  // namespace

int RunPeer(const PeerOptions& o) {
  if (!o.log_path.empty()) {
    // UCX and the connector log to stdout and stderr; one file per peer keeps them for a
    // failing iteration's report.
    if (std::freopen(o.log_path.c_str(), "a", stdout) == nullptr ||
        std::freopen(o.log_path.c_str(), "a", stderr) == nullptr) {
      return Fail(absl::InternalError(absl::StrCat("cannot open ", o.log_path)));
    }
    // Reopened streams are fully buffered: what a peer logged just before it was killed, or
    // while the driver reads its log, would be missing.
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    std::setvbuf(stderr, nullptr, _IONBF, 0);
  }
  const bool producer = o.role == "producer";
  if (!producer && o.role != "consumer") {
    return Fail(absl::InvalidArgumentError(absl::StrCat("unknown role '", o.role, "'")));
  }
  auto config = ParseKvTransferConfig(ChaosTransferConfig(
      producer ? "kv_producer" : "kv_consumer", o.engine_id, o.tls, o.policy, o.port));
  if (!config.ok()) return Fail(config.status());
  const ToyModelConfig model = ChaosModel();
  auto scheduler = CreateKvConnectorScheduler(*config, model.block_size);
  if (!scheduler.ok()) return Fail(scheduler.status());
  auto connector = CreateKvConnectorWorker(*config);
  if (!connector.ok()) return Fail(connector.status());
  FaultHook hook(connector->get(), producer);
  EngineOptions eo;
  eo.model = model;
  eo.num_blocks = kNumBlocks;
  eo.scheduler = scheduler->get();
  eo.worker = connector->get();
  eo.hook = &hook;
  eo.failure_policy = config->kv_load_failure_policy;
  eo.scatter_seed = producer ? 11 : 23;
  auto engine = Engine::Create(eo);
  if (!engine.ok()) return Fail(engine.status());
  Say(absl::StrCat("ready ", ::getpid(), " ",
                   producer ? DialableAddress((*connector)->control_address()) : "-"));

  PipeReader in(0);
  bool quitting = false;
  while (true) {
    if (producer) {
      // Serve hand-offs whenever no command is waiting.
      auto ran = (*engine)->Step();
      if (!ran.ok()) return Fail(ran.status());
      if (quitting && !(*engine)->HasWork()) return 0;
      if (!in.Readable()) {
        if (!*ran) absl::SleepFor(absl::Milliseconds(1));
        continue;
      }
    }
    // A consumer waits for its next command; a producer has one waiting. Either way a
    // closed stdin (the driver is gone) ends the peer.
    auto line = in.ReadLine(absl::Now() + absl::Minutes(30));
    if (!line.ok()) return Fail(line.status());
    const std::vector<std::string> words = absl::StrSplit(*line, ' ');
    absl::Status s;
    if (words[0] == "arm") {
      s = HandleArm(words, hook);
    } else if (words[0] == "status" && producer && words.size() == 2) {
      Say(absl::StrCat("status ", words[1], " ", (*engine)->served(), " ", (*engine)->num_free_blocks(), " ",
                       (*engine)->num_blocks(), " ", (*engine)->HasWork() ? 1 : 0, " ",
                       (*connector)->stats().blocks_in_flight));
    } else if (words[0] == "run" && !producer) {
      s = HandleRun(words, in, **engine, hook);
    } else if (words[0] == "quit") {
      if (!producer) return 0;
      quitting = true;
    } else {
      s = absl::InvalidArgumentError(absl::StrCat("unknown command '", *line, "'"));
    }
    if (!s.ok()) return Fail(s);
  }
}

}  // namespace chaos
}  // namespace kvstream
