// How the workers of `kvstream worker` find each other (worker_rendezvous.h).
#include "worker_rendezvous.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvstream/transfer/control_channel.h"

namespace kvstream {
namespace internal {

std::string AddressFileOf(const WorkerOptions& o, int prefill_index) {
  return o.num_prefill > 1 ? absl::StrCat(o.address_file, ".", prefill_index) : o.address_file;
}

absl::Status WriteAddressFile(const std::string& path, const std::string& address) {
  // Write then rename, so that a decode worker never reads half a line.
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << address << "\n";
    if (!f.flush()) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot write ", path));
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
        return absl::InvalidArgumentError(
            absl::StrCat("address file ", path, " holds '", line, "', not host:port"));
      }
      return std::make_pair(line.substr(0, colon), port);
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("the prefill worker did not write ", path, " in time"));
}

absl::Status WaitForFile(const std::string& path, absl::Time deadline) {
  while (access(path.c_str(), F_OK) != 0) {
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("waited in vain for ", path));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace kvstream
