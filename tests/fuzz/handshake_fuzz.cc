// Fuzz target for the control channel's handshake (control_channel.h), both sides, against a
// peer that says whatever the input says: the input is a sequence of frames the "peer"
// sends, fed to HandshakeAsServer or HandshakeAsClient (first byte: which side, and whether a
// secret is set) over an in-memory connection whose Send only checks what it is given. The
// handshake must end with the peer's hello or an error, never a crash, a hang (every Receive
// returns at once) or an out-of-bounds read; its check decodes the peer's payload as the
// connector's hello does.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "connector/src/control_messages.h"
#include "kvstream/transfer/control_channel.h"
#include "kvstream/transfer/wire.h"

namespace {

// Plays the peer: Receive returns the input's frames in order, then end of stream.
class ScriptedConnection final : public kvstream::ControlConnection {
 public:
  explicit ScriptedConnection(absl::string_view script) : script_(script) {}

  absl::Status Send(const kvstream::ControlMessage& message, absl::Time) override {
    if (closed_) return absl::FailedPreconditionError("closed");
    absl::StatusOr<std::string> frame = kvstream::EncodeFrame(message);
    if (!frame.ok()) return frame.status();
    return absl::OkStatus();
  }
  absl::StatusOr<kvstream::ControlMessage> Receive(absl::Time) override {
    if (closed_) return absl::FailedPreconditionError("closed");
    if (script_.size() < kvstream::kFrameHeaderBytes) {
      closed_ = true;
      return absl::UnavailableError("peer closed the connection");
    }
    absl::StatusOr<kvstream::FrameHeader> header =
        kvstream::DecodeFrameHeader(script_.substr(0, kvstream::kFrameHeaderBytes));
    if (!header.ok()) {
      closed_ = true;
      return header.status();
    }
    script_.remove_prefix(kvstream::kFrameHeaderBytes);
    if (script_.size() < header->payload_len) {
      closed_ = true;
      return absl::UnavailableError("peer closed the connection mid-frame");
    }
    absl::StatusOr<kvstream::ControlMessage> m =
        kvstream::DecodePayload(header->type, script_.substr(0, header->payload_len));
    script_.remove_prefix(header->payload_len);
    if (!m.ok()) closed_ = true;
    return m;
  }
  bool closed() const override { return closed_; }
  void Close() override { closed_ = true; }
  std::string peer_address() const override { return "127.0.0.1:1"; }
  std::string local_address() const override { return "127.0.0.1:2"; }

 private:
  absl::string_view script_;
  bool closed_ = false;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  ScriptedConnection conn(absl::string_view(reinterpret_cast<const char*>(data) + 1, size - 1));
  kvstream::HandshakeOptions o;
  o.local.engine_id = "fuzz-0";
  o.local.payload = "introduction";
  if (mode & 2) o.secret = "secret";
  o.deadline = absl::InfiniteFuture();  // never reached: every Receive returns at once
  o.check = [](const kvstream::HelloMsg& peer) -> absl::Status {
    return kvstream::internal::DecodeConnectorHello(peer.payload).status();
  };
  if (mode & 1) {
    (void)kvstream::HandshakeAsServer(conn, o);
  } else {
    (void)kvstream::HandshakeAsClient(conn, o);
  }
  return 0;
}
