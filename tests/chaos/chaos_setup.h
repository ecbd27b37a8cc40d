// What the chaos soak's driver (chaos_soak_main.cc) and its peer processes (chaos_peer.cc)
// share: the model both sides build, the connector configuration they run, and the line
// protocol on the pipes between the driver and a peer.
//
// Protocol (driver -> peer on the peer's stdin; peer -> driver on kPeerOutFd, one line each):
//   peer   : "ready <pid> <control address or ->"     once, when it can take commands
//   driver : "arm <layer> <kill|stop>"  peer -> "armed"; from then on, the next hook call
//                                       for <layer> raises SIGKILL / SIGSTOP in the peer,
//                                       right after the peer said "fault <kill|stop> <layer>";
//                                       "arm -1 -" disarms (also answered "armed"); a
//                                       consumer whose run never reached the layer says
//                                       "fault none" before its results
//   driver : "status <seq>" producer -> "status <seq> <served> <free> <total> <has_work 0|1>
//                           <connector's blocks in flight>"
//   driver : "run <host> <port> <n>" then n lines "req <id> <max_new_tokens> <t,t,...>"
//            consumer -> n lines "result <id> <status code> <recomputed 0|1> <remote tokens>
//                        <t,t,...|-> <logits hex|-> <escaped status message|->", then
//                        "done <free> <total>"
//   driver : "quit"         the peer exits 0 (a producer once it has no work)
//   peer   : "error <escaped message>"                 before exiting 1
// A peer whose stdin closes (the driver is gone) exits at once.
#ifndef KVSTREAM_TESTS_CHAOS_CHAOS_SETUP_H_
#define KVSTREAM_TESTS_CHAOS_CHAOS_SETUP_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "kvstream/serving/toy_model.h"

namespace kvstream {
namespace chaos {

// Deadlines of the connector on both sides. Short, so that the faults that wait for one
// (a stopped peer) cost little; a deadline that passes without a fault (a loaded machine)
// is a load error like any other, which the checks accept for what it is (recomputed, or
// failed under `fail`).
inline constexpr int64_t kLoadTimeoutMs = 400;
inline constexpr int64_t kSendTimeoutMs = 400;
inline constexpr int64_t kHandshakeTimeoutMs = 1000;
inline constexpr int kNumBlocks = 64;

// Small shapes: an iteration costs milliseconds of compute. Three layers, so a fault can
// land before, inside and after the middle of the stream.
inline ToyModelConfig ChaosModel() {
  ToyModelConfig m;
  m.vocab_size = 256;
  m.num_layers = 3;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.head_size = 16;
  m.intermediate_size = 64;
  m.block_size = 16;
  m.seed = 5;
  m.blas_threads = 1;
  return m;
}

// kv_transfer_config of a peer. `role`: "kv_producer" or "kv_consumer"; `tls`: "shm" or
// "tcp" (over loopback); `policy`: "recompute" or "fail"; `port`: the producer's control
// port (0: any free one).
inline std::string ChaosTransferConfig(const std::string& role, const std::string& engine_id,
                                       const std::string& tls, const std::string& policy,
                                       int port) {
  return absl::StrCat(
      "{\"kv_connector\": \"LayerwiseConnector\", \"kv_role\": \"", role,
      "\", \"kv_ip\": \"127.0.0.1\", \"kv_port\": ", port, ", \"engine_id\": \"", engine_id,
      "\", \"kv_load_failure_policy\": \"", policy,
      "\", \"kv_connector_extra_config\": {\"ucx_tls\": \"", tls, "\"",
      tls == "tcp" ? ", \"ucx_net_devices\": \"lo\"" : "", ", \"load_timeout_ms\": ",
      kLoadTimeoutMs, ", \"send_timeout_ms\": ", kSendTimeoutMs,
      ", \"handshake_timeout_ms\": ", kHandshakeTimeoutMs, "}}");
}

}  // namespace chaos
}  // namespace kvstream

#endif  // KVSTREAM_TESTS_CHAOS_CHAOS_SETUP_H_
