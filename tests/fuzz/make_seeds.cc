// Writes the seed corpus of the fuzz targets (tests/fuzz/corpus/): valid encodings of every
// message kind at small and edge sizes, so that fuzzing and the replay tests start from
// inputs the decoders accept. Run from the checkout:
//
//   build/tests/fuzz/kvstream_make_fuzz_seeds tests/fuzz/corpus
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "connector/src/control_messages.h"
#include "connector/src/layer_notice.h"
#include "kvstream/connector/connector_metadata.h"
#include "kvstream/transfer/wire.h"

namespace kvstream {
namespace {

void Write(const std::string& dir, const std::string& name, char prefix, const std::string& body,
           bool with_prefix = true) {
  std::ofstream f(dir + "/" + name, std::ios::binary);
  if (with_prefix) f.put(prefix);
  f << body;
}

int Run(const std::string& root) {
  const std::string md = root + "/connector_metadata", msg = root + "/connector_messages",
                    cfg = root + "/config", wire = root + "/wire";
  KvConnectorMetadata m;
  Write(md, "metadata_empty", 0, *EncodeConnectorMetadata(m));
  m.loads.push_back({"req-0", {5, 6, 7}, {3, 1}, 2, {"127.0.0.1", 14579}});
  m.waits = {"req-0"};
  m.saves.push_back({"req-1", {9}, 4});
  m.finished = {"req-2"};
  Write(md, "metadata_full", 0, *EncodeConnectorMetadata(m));
  KvConnectorOutput o;
  Write(md, "output_empty", 1, *EncodeConnectorOutput(o));
  o.finished_sending = {"a", "b"};
  o.finished_recving = {"c"};
  o.load_errors.push_back({"c", {1, 2}, absl::UnavailableError("lost producer")});
  o.incoming.push_back({"in", {1, 2, 3}, 2});
  Write(md, "output_full", 1, *EncodeConnectorOutput(o));

  Write(msg, "handoff", 0,
        *internal::EncodeConnectorMessage(internal::HandOffMsg{"req-0", {1, 2, 3}, {7, 8}, 2}));
  Write(msg, "ack", 0,
        *internal::EncodeConnectorMessage(internal::HandOffAckMsg{"req-0", 11, "out of range"}));
  Write(msg, "abort", 0,
        *internal::EncodeConnectorMessage(internal::AbortMsg{"req-0", "stop", 7}));
  internal::ConnectorHello h;
  h.protocol_version = 1;
  h.compat_hash = 42;
  h.compat_description = "bf16 NHD";
  h.transport = "ucx";
  h.transport_info = "info";
  h.regions = {{0, 0, "k0"}, {0, 1, "v0"}};
  Write(msg, "hello", 1, *internal::EncodeConnectorHello(h));
  internal::LayerNotice n;
  n.request_id = "req-0";
  n.layer = 3;
  n.bytes = 4096;
  n.checksum_kind = internal::ChecksumKind::kXxh3;
  n.post_ns = 1;
  n.checksum = 0x1234;
  Write(msg, "notice", 2, *internal::EncodeLayerNotice(n));
  Write(msg, "stop", 3, *internal::EncodeStopNotice(internal::StopNotice{"req-0", 7, "stop"}));

  Write(cfg, "vllm", 0,
        R"({"kv_connector": "LayerwiseConnector", "kv_role": "kv_consumer", "kv_port": 14579,
            "kv_connector_extra_config": {"transport": "ucx", "load_timeout_ms": 500,
                                          "pipeline_layers": "0-1,2-3"}})",
        false);
  Write(cfg, "empty", 0, "{}", false);

  Write(wire, "challenge", 0, *EncodeFrame(ChallengeMsg{std::string(32, 'n')}), false);
  HelloMsg hello;
  hello.engine_id = "decode-0";
  hello.payload = "payload";
  Write(wire, "hello", 0, *EncodeFrame(hello), false);
  Write(wire, "data", 0, *EncodeFrame(DataMsg{"bytes"}), false);
  Write(wire, "error", 0, *EncodeFrame(ErrorMsg{9, "refused"}), false);

  // The handshake as the peer plays it (no secret): to a client, a challenge then the
  // server's answer; to a server, the client's hello. The payload is a connector hello.
  const std::string hs = root + "/handshake";
  HelloMsg peer;
  peer.engine_id = "peer-0";
  peer.payload = *internal::EncodeConnectorHello(h);
  HelloAckMsg ack;
  ack.hello = peer;
  Write(hs, "client_no_secret", 0,
        *EncodeFrame(ChallengeMsg{std::string(32, 'n')}) + *EncodeFrame(ack));
  Write(hs, "server_no_secret", 1, *EncodeFrame(peer));
  Write(hs, "client_secret", 2, *EncodeFrame(ChallengeMsg{std::string(32, 'n')}) + *EncodeFrame(ack));
  Write(hs, "client_refused", 0,
        *EncodeFrame(ChallengeMsg{std::string(32, 'n')}) + *EncodeFrame(ErrorMsg{9, "no"}));
  std::printf("seeds written under %s\n", root.c_str());
  return 0;
}

}  // namespace
}  // namespace kvstream

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: kvstream_make_fuzz_seeds CORPUS_ROOT\n");
    return 1;
  }
  return kvstream::Run(argv[1]);
}
