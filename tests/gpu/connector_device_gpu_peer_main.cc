// The producer (prefill worker) of the connector's device-cache GPU test: a minimal engine
// over DeviceModel whose caches the layerwise connector streams, layer by layer, to the
// test's consumer over the transport named by --transport.
//
//   kvstream_connector_device_peer --transport=cuda_ipc [--crash-after-layer=N]
//
// Protocol (connector_device_gpu_test.cc): it writes "ready <port>" on fd 3 once listening,
// serves hand-offs until "quit" arrives on stdin, then for each request whose sends ended
// "timeline <consumer id> ok|failed <ready ns,...> <sent ns,...>" (RequestSendStats), then
// "served <n>", and exits 0. With
// --crash-after-layer=N it SIGKILLs itself right after posting layer N of its first
// request (as a crash would: no cleanup).
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "connector_device_model.h"
#include "kvstream/connector/factory.h"
#include "tests/integration/ucx_transport_peer.h"

namespace kvstream {
namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "connector device peer: %s\n", s.ToString().c_str());
  return 1;
}

// Whether stdin has a line "quit" (or reached its end: the test went away).
bool QuitRequested() {
  pollfd p{0, POLLIN, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  char buf[64];
  const ssize_t n = ::read(0, buf, sizeof(buf));
  return n <= 0 || absl::StrContains(absl::string_view(buf, static_cast<size_t>(n)), "quit");
}

int Run(int argc, char** argv) {
  std::string transport = "cuda_ipc";
  int crash_after_layer = -1;
  for (int i = 1; i < argc; ++i) {
    absl::string_view a = argv[i];
    if (absl::ConsumePrefix(&a, "--transport=")) transport = std::string(a);
    if (absl::ConsumePrefix(&a, "--crash-after-layer=") && !absl::SimpleAtoi(a, &crash_after_layer)) {
      return Fail(absl::InvalidArgumentError("bad --crash-after-layer"));
    }
  }
  KvTransferConfig config;
  config.kv_connector = "LayerwiseConnector";
  config.kv_role = KvRole::kProducer;
  config.kv_port = 0;
  config.engine_id = "prefill-gpu";
  config.kv_buffer_device = "cuda";
  config.kvstream.transport = transport;
  config.kvstream.send_timeout_ms = 10000;
  test::DeviceModel model;
  if (absl::Status s = model.Init(/*one_allocation=*/false); !s.ok()) return Fail(s);
  auto scheduler = CreateKvConnectorScheduler(config, test::kDeviceBlock);
  if (!scheduler.ok()) return Fail(scheduler.status());
  auto worker = CreateKvConnectorWorker(config);
  if (!worker.ok()) return Fail(worker.status());
  if (absl::Status s = (*worker)->RegisterKvCaches(model.Caches()); !s.ok()) return Fail(s);
  model.registry().SetTransferHook(worker->get());
  const std::string address = (*worker)->control_address();
  if (!test::WriteLine(test::kPeerOutFd,
                       absl::StrCat("ready ", address.substr(address.rfind(':') + 1)))
           .ok()) {
    return 1;
  }
  // Blocks handed out in a shuffled order, so that no request's blocks are contiguous.
  std::vector<int32_t> free_blocks(test::kDeviceBlocks);
  for (int32_t i = 0; i < test::kDeviceBlocks; ++i) free_blocks[i] = i;
  std::shuffle(free_blocks.begin(), free_blocks.end(), std::mt19937(5));
  std::map<std::string, std::vector<int32_t>> held;
  int served = 0;
  std::vector<RequestSendStats> timelines;
  while (!QuitRequested()) {
    for (RequestSendStats& t : (*worker)->TakeSendStats()) timelines.push_back(std::move(t));
    auto out = (*worker)->TakeOutput();
    if (!out.ok()) return Fail(out.status());
    if (absl::Status s = (*scheduler)->UpdateConnectorOutput(*out); !s.ok()) return Fail(s);
    for (const std::string& id : out->finished_sending) {
      auto it = held.find(id);
      if (it == held.end()) continue;
      free_blocks.insert(free_blocks.end(), it->second.begin(), it->second.end());
      held.erase(it);
    }
    for (const KvRequest& r : (*scheduler)->TakeIncomingRequests()) {
      const int32_t n = static_cast<int32_t>(r.prompt_token_ids.size());
      const size_t need = static_cast<size_t>((n + test::kDeviceBlock - 1) / test::kDeviceBlock);
      if (need > free_blocks.size()) return Fail(absl::ResourceExhaustedError("out of blocks"));
      std::vector<int32_t> blocks(free_blocks.end() - need, free_blocks.end());
      free_blocks.resize(free_blocks.size() - need);
      if (absl::Status s = (*scheduler)->UpdateStateAfterAlloc(r, blocks, 0); !s.ok()) return Fail(s);
      auto meta = (*scheduler)->BuildConnectorMeta({{r.request_id, 0, n}});
      if (!meta.ok()) return Fail(meta.status());
      if (absl::Status s = (*worker)->BindConnectorMetadata(*meta); !s.ok()) return Fail(s);
      test::DeviceSeq seq{{0, n, blocks}, static_cast<uint32_t>(r.prompt_token_ids[0])};
      auto ran = model.Step({seq}, [&](int layer) {
        if (layer == crash_after_layer) {
          std::fflush(nullptr);
          ::raise(SIGKILL);
        }
      });
      if (!ran.ok()) return Fail(ran.status());
      if (absl::Status s = (*worker)->WaitForSave(); !s.ok()) return Fail(s);
      (*worker)->ClearConnectorMetadata();
      auto delay = (*scheduler)->RequestFinished(r.request_id);
      if (!delay.ok()) return Fail(delay.status());
      if (*delay) {
        held[r.request_id] = blocks;
      } else {
        free_blocks.insert(free_blocks.end(), blocks.begin(), blocks.end());
      }
      ++served;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  // The progress loop settles the last sends shortly after their notices left.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (static_cast<int>(timelines.size()) < served && absl::Now() < deadline) {
    for (RequestSendStats& t : (*worker)->TakeSendStats()) timelines.push_back(std::move(t));
    absl::SleepFor(absl::Milliseconds(1));
  }
  for (const RequestSendStats& t : timelines) {
    const std::string line = absl::StrCat("timeline ", t.consumer_request_id, " ",
                                          t.ok ? "ok" : "failed", " ",
                                          absl::StrJoin(t.layer_ready_ns, ","), " ",
                                          absl::StrJoin(t.layer_sent_ns, ","));
    if (!test::WriteLine(test::kPeerOutFd, line).ok()) return 1;
  }
  return test::WriteLine(test::kPeerOutFd, absl::StrCat("served ", served)).ok() ? 0 : 1;
}

}  // namespace
}  // namespace kvstream

int main(int argc, char** argv) { return kvstream::Run(argc, argv); }
