// How the workers of `kvstream worker` find each other (worker.h): a prefill worker writes
// the control address it can be dialed at to an address file; a decode worker reads that
// file and waits until the prefill worker answers; waves of requests are gated by files.
// Every wait has a deadline.
#ifndef KVSTREAM_LAUNCH_WORKER_RENDEZVOUS_H_
#define KVSTREAM_LAUNCH_WORKER_RENDEZVOUS_H_

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker.h"

namespace kvstream {
namespace internal {

// Prefill worker `prefill_index`'s address file: options.address_file, suffixed with the
// index when there are several prefill workers.
std::string AddressFileOf(const WorkerOptions& options, int prefill_index);

// Writes "address\n" to `path` through a temporary file and a rename, so that a reader sees
// the whole line or nothing. Internal naming the file when it cannot be written.
absl::Status WriteAddressFile(const std::string& path, const std::string& address);

// Waits (at most `timeout`) for the address file at `path` and returns its host and port.
// DeadlineExceeded when it does not appear in time, InvalidArgument when its line is not
// host:port.
absl::StatusOr<std::pair<std::string, int>> ReadAddressFile(const std::string& path,
                                                            absl::Duration timeout);

// Dials the prefill worker at host:port until its control channel answers, at most
// `timeout`; Unavailable with the last error otherwise.
absl::Status WaitForProducer(const std::string& host, int port, absl::Duration timeout);

// Waits until `path` exists; DeadlineExceeded naming it at `deadline`.
absl::Status WaitForFile(const std::string& path, absl::Time deadline);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_LAUNCH_WORKER_RENDEZVOUS_H_
