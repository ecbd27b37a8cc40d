// `kvstream worker` (worker.h).
#include "worker.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <signal.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "engine.h"
#include "metrics_server.h"
#include "kvstream/connector/config.h"
#include "kvstream/connector/factory.h"
#include "kvstream/connector/layer_name.h"
#include "kvstream/transfer/control_channel.h"

namespace kvstream {
namespace {

// Fault injection for the kill tests: forwards to the connector, then kills this process
// (SIGKILL: no cleanup, as a crash) once the given layer's hook has run.
class CrashingHook : public TransferHook {
 public:
  CrashingHook(TransferHook* inner, int layer) : inner_(inner), layer_(layer) {}
  absl::Status BeforeAttention(absl::string_view layer_name) override {
    absl::Status s = inner_->BeforeAttention(layer_name);
    MaybeCrash(layer_name, /*producer_side=*/false);
    return s;
  }
  absl::Status AfterAttention(absl::string_view layer_name, const KvCache& cache,
                              const AttentionMetadata& md) override {
    absl::Status s = inner_->AfterAttention(layer_name, cache, md);
    MaybeCrash(layer_name, /*producer_side=*/true);
    return s;
  }
  bool producer = false;
  bool armed = false;  // set once the step carries remote traffic

 private:
  void MaybeCrash(absl::string_view layer_name, bool producer_side) {
    if (!armed || producer_side != producer) return;
    auto index = ParseLayerIndex(layer_name);
    if (index.ok() && *index == layer_) {
      std::fprintf(stderr, "worker: crashing on purpose after layer %d\n", layer_);
      std::fflush(stderr);
      raise(SIGKILL);
    }
  }
  TransferHook* inner_;
  int layer_;
};

std::string AddressFileOf(const WorkerOptions& o, int prefill_index) {
  return o.num_prefill > 1 ? absl::StrCat(o.address_file, ".", prefill_index) : o.address_file;
}

// Requests a prefill worker serves in an xPyD run: request i of decode worker d goes to
// prefill worker (i + d) % num_prefill.
}  // namespace

nlohmann::json ConnectorStatsJson(const ConnectorStats& s) {
  return {{"bytes_sent", s.bytes_sent},           {"bytes_received", s.bytes_received},
          {"layers_sent", s.layers_sent},         {"layers_received", s.layers_received},
          {"load_errors", s.load_errors},         {"send_failures", s.send_failures},
          {"wait_ms", s.wait_ms},                 {"exposed_transfer_ms", s.exposed_ms},
          {"blocks_in_flight", s.blocks_in_flight},
          {"layer_latency_sum_ms", s.latency_sum_ms}};
}

int RequestsServedBy(const WorkerOptions& o, int prefill_index) {
  int n = 0;
  for (int d = 0; d < o.num_decode; ++d) {
    for (size_t i = 0; i < o.prompt_lengths.size(); ++i) {
      if (static_cast<int>((i + d) % o.num_prefill) == prefill_index) ++n;
    }
  }
  return n;
}

namespace {

std::vector<RequestSpec> MakeRequests(const WorkerOptions& o) {
  std::vector<RequestSpec> out;
  std::mt19937 rng(o.model.seed * 7919u + 17u);
  for (size_t i = 0; i < o.prompt_lengths.size(); ++i) {
    RequestSpec r;
    r.id = o.num_decode > 1 ? absl::StrCat("d", o.index, "-req-", i) : absl::StrCat("req-", i);
    for (int t = 0; t < o.prompt_lengths[i]; ++t) {
      r.prompt.push_back(static_cast<int32_t>(rng() % static_cast<uint32_t>(o.model.vocab_size)));
    }
    r.max_new_tokens = o.decode_steps;
    out.push_back(std::move(r));
  }
  return out;
}

// Runs `engine` until it has no work or `deadline` passes. With `progress`, a line every
// second of a long run says how far it got.
absl::Status Drain(Engine& engine, absl::Time deadline, std::ostream* progress = nullptr,
                   absl::string_view what = "") {
  const absl::Time start = absl::Now();
  absl::Time next_report = start + absl::Seconds(1);
  while (engine.HasWork()) {
    const absl::Time now = absl::Now();
    if (now > deadline) {
      return absl::DeadlineExceededError("the engine did not finish its requests in time");
    }
    if (progress != nullptr && now > next_report) {
      *progress << absl::StrFormat("  %s: %.0f s, %d steps\n", what,
                                   absl::ToDoubleSeconds(now - start), engine.steps())
                << std::flush;
      next_report = now + absl::Seconds(1);
    }
    auto ran = engine.Step();
    if (!ran.ok()) return ran.status();
    if (!*ran) absl::SleepFor(absl::Milliseconds(1));
  }
  return absl::OkStatus();
}

absl::Status WaitForProducer(const std::string& host, int port, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status last;
  while (absl::Now() < deadline) {
    auto conn = ConnectControl(host, static_cast<uint16_t>(port), deadline);
    if (conn.ok()) {
      (*conn)->Close();
      return absl::OkStatus();
    }
    last = conn.status();
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::UnavailableError(absl::StrCat("no prefill worker at ", host, ":", port, " within ",
                                             absl::FormatDuration(timeout), ": ", last.message()));
}

// Waits for the prefill worker's address file; returns "host:port".
absl::StatusOr<std::pair<std::string, int>> ReadAddressFile(const std::string& path,
                                                           absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    std::ifstream f(path);
    std::string line;
    if (f && std::getline(f, line) && !line.empty()) {
      const size_t colon = line.rfind(':');
      int port = 0;
      if (colon == std::string::npos || !absl::SimpleAtoi(line.substr(colon + 1), &port)) {
        return absl::InvalidArgumentError(absl::StrCat("address file ", path, " holds '", line,
                                                       "', not host:port"));
      }
      return std::make_pair(line.substr(0, colon), port);
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("the prefill worker did not write ", path, " in time"));
}

// The address peers should dial: a wildcard listen address is replaced by this host's
// first non-loopback IPv4 address (for runs across hosts).
std::string DialableAddress(const std::string& address) {
  if (address.rfind("0.0.0.0:", 0) != 0) return address;
  const std::string port = address.substr(8);
  struct ifaddrs* ifs = nullptr;
  std::string ip = "127.0.0.1";
  if (getifaddrs(&ifs) == 0) {
    for (struct ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
      char buf[INET_ADDRSTRLEN];
      const auto* sin = reinterpret_cast<const struct sockaddr_in*>(i->ifa_addr);
      if (inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof(buf)) == nullptr) continue;
      if (std::string(buf).rfind("127.", 0) == 0) continue;
      ip = buf;
      break;
    }
    freeifaddrs(ifs);
  }
  return ip + ":" + port;
}

int Fail(std::ostream& err, const absl::Status& s) {
  err << "kvstream worker: " << s << "\n";
  return 1;
}

}  // namespace

int RunWorker(const WorkerOptions& o, std::ostream& out, std::ostream& err,
              DecodeReport* decode_report) {
  auto config = ParseKvTransferConfig(o.kv_transfer_config.empty() ? "{}" : o.kv_transfer_config);
  if (!config.ok()) return Fail(err, config.status());
  if (config->kv_connector.empty()) config->kv_connector = "LayerwiseConnector";
  const bool prefill = o.role == "prefill";
  if (!prefill && o.role != "decode") {
    return Fail(err, absl::InvalidArgumentError(
                         absl::StrCat("--role must be prefill or decode, not '", o.role, "'")));
  }
  config->kv_role = prefill ? KvRole::kProducer : KvRole::kConsumer;
  absl::StrAppend(&config->engine_id, prefill ? "-prefill" : "-decode", o.index);

  auto connector = CreateKvConnector(*config);
  if (!connector.ok()) return Fail(err, connector.status());
  std::unique_ptr<CrashingHook> crash;
  EngineOptions eo;
  eo.model = o.model;
  eo.num_blocks = o.num_blocks;
  eo.connector = connector->get();
  eo.failure_policy = config->kv_load_failure_policy;
  eo.scatter_seed = prefill ? 11 : 23;  // different scatter on each side
  if (o.crash_after_layer >= 0) {
    crash = std::make_unique<CrashingHook>(connector->get(), o.crash_after_layer);
    crash->producer = prefill;
    crash->armed = true;
    eo.hook = crash.get();
  }
  auto engine = Engine::Create(eo);
  if (!engine.ok()) return Fail(err, engine.status());
  std::unique_ptr<MetricsServer> metrics;
  if (o.metrics_port >= 0) {
    KvConnector* c = connector->get();
    const std::string role(KvRoleName(config->kv_role));
    const std::string id = config->engine_id;
    auto m = MetricsServer::Start(o.metrics_port, [c, role, id] {
      return RenderConnectorMetrics(c->stats(), role, id);
    });
    if (!m.ok()) return Fail(err, m.status());
    metrics = std::move(*m);
    out << "metrics on http://0.0.0.0:" << metrics->port() << "/metrics" << std::endl;
  }

  if (prefill) {
    out << "prefill worker " << config->engine_id << " listening on "
        << (*connector)->control_address() << std::endl;
    if (!o.address_file.empty()) {
      // Write then rename, so the decode worker never reads half a line.
      const std::string path = AddressFileOf(o, o.index);
      const std::string tmp = path + ".tmp";
      {
        std::ofstream f(tmp);
        f << DialableAddress((*connector)->control_address()) << "\n";
      }
      if (std::rename(tmp.c_str(), path.c_str()) != 0) {
        return Fail(err, absl::InternalError(absl::StrCat("cannot write ", path)));
      }
    }
    absl::Time last_work = absl::Now();
    while (true) {
      auto ran = (*engine)->Step();
      if (!ran.ok()) return Fail(err, ran.status());
      if (*ran || (*engine)->HasWork()) last_work = absl::Now();
      if (o.serve > 0 && (*engine)->served() >= o.serve && !(*engine)->HasWork()) break;
      if (absl::Now() - last_work > absl::Seconds(o.idle_timeout_s)) {
        out << "prefill worker: idle for " << o.idle_timeout_s << " s, exiting" << std::endl;
        break;
      }
      if (!*ran) absl::SleepFor(absl::Milliseconds(1));
    }
    const int32_t free_blocks = (*engine)->num_free_blocks();
    out << "prefill worker: served " << (*engine)->served() << " requests in "
        << (*engine)->steps() << " steps; " << free_blocks << "/" << (*engine)->num_blocks()
        << " blocks free" << std::endl;
    if (free_blocks != (*engine)->num_blocks()) {
      err << "kvstream worker: blocks leaked on the prefill worker\n";
      return 4;
    }
    return 0;
  }

  // Decode worker: find every prefill worker.
  std::vector<RemotePrefill> producers;
  for (int p = 0; p < o.num_prefill; ++p) {
    RemotePrefill remote{config->kv_ip, config->kv_port};
    if (!o.address_file.empty()) {
      auto addr = ReadAddressFile(AddressFileOf(o, p), absl::Seconds(o.connect_timeout_s));
      if (!addr.ok()) return Fail(err, addr.status());
      remote = RemotePrefill{addr->first, addr->second};
    }
    absl::Status ready =
        WaitForProducer(remote.host, remote.port, absl::Seconds(o.connect_timeout_s));
    if (!ready.ok()) return Fail(err, ready);
    producers.push_back(remote);
  }
  const std::vector<RequestSpec> requests = MakeRequests(o);
  const absl::Time t0 = absl::Now();
  for (size_t i = 0; i < requests.size(); ++i) {
    RequestSpec r = requests[i];
    r.remote = producers[(i + o.index) % producers.size()];
    absl::Status s = (*engine)->AddRequest(std::move(r));
    if (!s.ok()) return Fail(err, s);
  }
  const absl::Duration budget = absl::Seconds(120) + absl::Milliseconds(
      2 * (config->kvstream.load_timeout_ms + config->kvstream.send_timeout_ms));
  absl::Status drained = Drain(**engine, t0 + budget, o.progress, "disaggregated run");
  if (!drained.ok()) return Fail(err, drained);
  const double total_ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
  std::vector<RequestResult> results = (*engine)->TakeFinished();
  std::sort(results.begin(), results.end(),
            [](const RequestResult& a, const RequestResult& b) { return a.id < b.id; });

  std::vector<RequestResult> colocated;
  if (o.check_colocated) {
    EngineOptions co;
    co.model = o.model;
    co.num_blocks = o.num_blocks;
    auto ref = Engine::Create(co);
    if (!ref.ok()) return Fail(err, ref.status());
    for (const RequestSpec& r : requests) {
      absl::Status s = (*ref)->AddRequest(r);
      if (!s.ok()) return Fail(err, s);
    }
    absl::Status s = Drain(**ref, absl::Now() + absl::Seconds(600), o.progress, "colocated run");
    if (!s.ok()) return Fail(err, s);
    colocated = (*ref)->TakeFinished();
    std::sort(colocated.begin(), colocated.end(),
              [](const RequestResult& a, const RequestResult& b) { return a.id < b.id; });
  }

  bool all_ok = true, all_match = true;
  nlohmann::json report;
  report["requests"] = nlohmann::json::array();
  for (size_t i = 0; i < results.size(); ++i) {
    const RequestResult& r = results[i];
    bool match = true;
    if (o.check_colocated) {
      const RequestResult* c = i < colocated.size() && colocated[i].id == r.id ? &colocated[i] : nullptr;
      match = c != nullptr && r.status.ok() && c->output_tokens == r.output_tokens &&
              c->logits.size() == r.logits.size() &&
              std::memcmp(c->logits.data(), r.logits.data(), r.logits.size() * sizeof(float)) == 0;
    }
    all_ok &= r.status.ok();
    all_match &= match;
    out << absl::StrFormat("  %s: prompt %4d tokens (%4d from the prefill worker%s), ttft %8.2f ms, "
                           "%d tokens [%s]%s%s\n",
                           r.id, r.prompt_tokens, r.remote_tokens,
                           r.recomputed ? ", recomputed after a load error" : "", r.ttft_ms,
                           r.output_tokens.size(), absl::StrJoin(r.output_tokens, " "),
                           o.check_colocated ? (match ? "  == colocated" : "  != COLOCATED") : "",
                           r.status.ok() ? "" : absl::StrCat("  FAILED: ", r.status.ToString()));
    report["requests"].push_back({{"id", r.id},
                                  {"prompt_tokens", r.prompt_tokens},
                                  {"remote_tokens", r.remote_tokens},
                                  {"ttft_ms", r.ttft_ms},
                                  {"output_tokens", r.output_tokens},
                                  {"recomputed", r.recomputed},
                                  {"status", r.status.ToString()},
                                  {"matches_colocated", match}});
  }
  const int32_t free_blocks = (*engine)->num_free_blocks();
  const bool leak = free_blocks != (*engine)->num_blocks();
  out << absl::StrFormat("decode worker: %d requests in %.1f ms, %d steps; %d/%d blocks free; %s\n",
                         results.size(), total_ms, (*engine)->steps(), free_blocks,
                         (*engine)->num_blocks(),
                         o.check_colocated
                             ? (all_match ? "outputs bit-identical to the colocated run"
                                          : "OUTPUTS DIFFER from the colocated run")
                             : "colocated check skipped");
  report["tokens_match"] = all_match;
  report["all_ok"] = all_ok;
  report["blocks_leaked"] = leak;
  report["total_ms"] = total_ms;
  report["connector"] = ConnectorStatsJson((*connector)->stats());
  if (decode_report != nullptr) {
    DecodeReport& d = *decode_report;
    d.results = results;
    for (const auto& r : report["requests"]) d.matches_colocated.push_back(r["matches_colocated"]);
    for (RequestTransferStats& t : (*connector)->TakeRequestStats()) {
      d.transfer[t.request_id] = std::move(t);
    }
    d.stats = (*connector)->stats();
    d.total_ms = total_ms;
    d.steps = (*engine)->steps();
    d.tokens_match = all_match;
    d.all_ok = all_ok;
    d.blocks_leaked = leak;
  }
  if (!o.json_path.empty()) {
    std::ofstream f(o.json_path);
    f << report.dump(2) << "\n";
  }
  if (leak) {
    err << "kvstream worker: blocks leaked on the decode worker\n";
    return 4;
  }
  if (!all_ok) return 3;
  if (!all_match) return 2;
  return 0;
}

}  // namespace kvstream
