// UCX configuration and start-up for one transport (ucx_setup.h).
#include "ucx/ucx_setup.h"

#include <unistd.h>

#include <random>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "kvstream/common/status_macros.h"
#include "transport_uid.h"
#include "ucx/ucx_status.h"

namespace kvstream {
namespace internal {
namespace {

// UCX_TLS for the options' tls.
std::string TlsFor(const std::string& tls) {
  if (tls == "shm") return "sm,self";
  if (tls == "tcp") return "tcp,self";
  return tls;
}

// Whether UCX_TLS allows a transport that reaches other hosts (anything but shared memory
// and self).
bool AllowsNetwork(const std::string& tls) {
  for (absl::string_view name : absl::StrSplit(tls, ',')) {
    if (!name.empty() && name[0] == '^') return true;  // "all but ...": networks included
    if (name != "sm" && name != "shm" && name != "posix" && name != "sysv" && name != "cma" &&
        name != "knem" && name != "xpmem" && name != "self") {
      return true;
    }
  }
  return false;
}

// Whether UCX_TLS may select UCX's posix/sysv shared-memory transports (to avoid UCX's
// warning about a setting no selected transport uses).
bool MayUseSharedMemory(const std::string& tls) {
  for (absl::string_view name : absl::StrSplit(tls, ',')) {
    if (name == "sm" || name == "shm" || name == "posix" || name == "sysv" || name == "all" ||
        (!name.empty() && name[0] == '^')) {
      return true;
    }
  }
  return false;
}

// Whether UCX_TLS may select UCX's tcp transport.
bool MayUseTcp(const std::string& tls) {
  for (absl::string_view name : absl::StrSplit(tls, ',')) {
    if (name == "tcp" || name == "all" || (!name.empty() && name[0] == '^')) return true;
  }
  return false;
}

// Whether UCX_TLS names nothing but tcp and self: then every put between two processes is
// an emulated one (rma_am over tcp).
bool OnlyTcp(const std::string& tls) {
  bool tcp = false;
  for (absl::string_view name : absl::StrSplit(tls, ',')) {
    if (name == "tcp") {
      tcp = true;
    } else if (name != "self") {
      return false;
    }
  }
  return tcp;
}

}  // namespace

bool UsesActiveMessageWrites(const UcxTransportOptions& options) {
  switch (options.write_protocol) {
    case UcxWriteProtocol::kPut:
      return false;
    case UcxWriteProtocol::kActiveMessage:
      return true;
    case UcxWriteProtocol::kAuto:
      break;
  }
  return OnlyTcp(TlsFor(options.tls));
}

UcxSettings UcxConfigFor(const UcxTransportOptions& options) {
  UcxSettings settings;
  const std::string tls = TlsFor(options.tls);
  auto set = [&](const char* name, std::string value) {
    settings.emplace_back(name, std::move(value));
  };
  set("TLS", tls);
  if (!options.net_devices.empty()) set("NET_DEVICES", options.net_devices);
  // Keepalive probes are how a peer that died without closing its sockets, or whose
  // shared-memory segment just stops being read, is detected.
  const int64_t keepalive_ms = absl::ToInt64Milliseconds(options.keepalive_interval);
  if (keepalive_ms > 0) set("KEEPALIVE_INTERVAL", absl::StrCat(keepalive_ms, "ms"));
  // Error mode PEER excludes transports without peer-failure support, and UCX's
  // shared-memory transports (posix, sysv) only advertise it when asked to; without them no
  // shared-memory transport carries active messages. The key is the field's name within the
  // transports' common "MM_" table (the environment spells it UCX_POSIX_ERROR_HANDLING).
  // UCX's adaptive progress leaves out of the worker's progress every interface that no local
  // endpoint uses, and arms it for events instead. A receiver never connects back over the
  // interface its peers write to (notifications arrive on the shared-memory FIFO), so with
  // it every notification found the receiver's interface armed and the sender paid a
  // sendto() to wake the receiver's async thread: about 10 us per transfer inside
  // ucp_am_send_nbx, half the time of a 1 MiB layer (docs/benchmarks-transfer.md, Run F).
  // Progressing every interface costs a few polls per Progress() with the few this
  // transport opens.
  set("ADAPTIVE_PROGRESS", "n");
  if (MayUseSharedMemory(tls)) {
    set("MM_ERROR_HANDLING", "y");
    // Puts into ordinary memory travel as active-message fragments of at most one FIFO
    // segment; 64 KiB segments (UCX's default is 8 KiB) carry a typical KV block in one
    // fragment and doubled the bandwidth of 16-64 MiB layers here (docs/benchmarks.md).
    // The cost is shared memory: FIFO_SIZE (64) segments per worker, 4 MiB.
    set("MM_SEG_SIZE", "64k");
  }
  if (MayUseTcp(tls)) {
    // Writes over TCP (kvstream's write pieces, ucx/am_writes.h, or UCX's emulated puts)
    // travel as active-message fragments of at most TX_SEG_SIZE (UCX's default 8 KiB: one
    // send per 8 KiB); 256 KiB fragments (the receive side must be at least as large)
    // tripled a link's KV throughput between two hosts, 5 -> 16 Gbit/s on an unlimited veth
    // link, against 21 for a plain TCP stream (docs/scale-out.md). The
    // cost is memory: buffers of that size per endpoint while a fragment is in flight. The
    // keys are the fields of UCX's tcp table (the environment spells them UCX_TCP_*).
    set("TX_SEG_SIZE", "256k");
    set("RX_SEG_SIZE", "256k");
  }
  // The caller's own settings come last, so UCX applies them over kvstream's.
  for (const auto& [name, value] : options.ucx_config) settings.emplace_back(name, value);
  return settings;
}

absl::StatusOr<std::shared_ptr<UcxCore>> CreateUcxCore(const UcxTransportOptions& options) {
  ucp_config_t* raw_config = nullptr;
  RETURN_IF_ERROR(UcxStatusToStatus(ucp_config_read(nullptr, nullptr, &raw_config),
                                    "config_read"));
  UcxConfig config(NoOwner{}, raw_config);
  const std::string tls = TlsFor(options.tls);
  for (const auto& [name, value] : UcxConfigFor(options)) {
    RETURN_IF_ERROR(
        UcxStatusToStatus(ucp_config_modify(config.get(), name.c_str(), value.c_str()),
                          absl::StrCat("config_modify ", name, "=", value)));
  }

  auto core = std::make_shared<UcxCore>();
  ucp_params_t params;
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
  params.mt_workers_shared = 0;
  ucp_context_h context = nullptr;
  RETURN_IF_ERROR(UcxStatusToStatus(ucp_init(&params, config.get(), &context),
                                    absl::StrCat("init (UCX_TLS=", tls, ")")));
  core->context = UcxContext(NoOwner{}, context);

  ucp_worker_params_t worker_params;
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  ucp_worker_h worker = nullptr;
  RETURN_IF_ERROR(UcxStatusToStatus(ucp_worker_create(context, &worker_params, &worker),
                                    "worker_create"));
  core->worker = UcxWorker(NoOwner{}, worker);
  RETURN_IF_ERROR(core->InstallHandlers());

  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  RETURN_IF_ERROR(UcxStatusToStatus(ucp_worker_get_address(worker, &address, &address_length),
                                    "worker_get_address"));
  core->uid = internal::NewTransportUid();
  core->worker_address.assign(reinterpret_cast<const char*>(address), address_length);
  ucp_worker_release_address(worker, address);
  {
    absl::MutexLock lock(&core->mu);
    core->RefreshLocalInfo();
  }
  core->network = AllowsNetwork(tls);
  core->am_writes = UsesActiveMessageWrites(options);
  return core;
}

}  // namespace internal
}  // namespace kvstream
