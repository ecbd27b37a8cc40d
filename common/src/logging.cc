#include "kvstream/common/logging.h"

#include <atomic>
#include <cstdio>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvstream {
namespace {

absl::Mutex sink_mu;
LogSink& Sink() ABSL_EXCLUSIVE_LOCKS_REQUIRED(sink_mu) {
  static LogSink* sink = new LogSink();
  return *sink;
}
std::atomic<int> threshold{static_cast<int>(LogLevel::kWarning)};

void DefaultSink(LogLevel level, absl::string_view message) {
  static const char kLetters[] = {'D', 'I', 'W', 'E'};
  std::fprintf(stderr, "[kvstream %c] %.*s\n", kLetters[static_cast<int>(level)],
               static_cast<int>(message.size()), message.data());
}

}  // namespace

LogSink SetLogSink(LogSink sink) {
  absl::MutexLock lock(&sink_mu);
  LogSink previous = std::move(Sink());
  Sink() = std::move(sink);
  return previous;
}

void SetLogThreshold(LogLevel level) { threshold.store(static_cast<int>(level)); }

void Log(LogLevel level, absl::string_view message) {
  if (static_cast<int>(level) < threshold.load()) return;
  absl::MutexLock lock(&sink_mu);
  if (Sink()) {
    Sink()(level, message);
  } else {
    DefaultSink(level, message);
  }
}

}  // namespace kvstream
