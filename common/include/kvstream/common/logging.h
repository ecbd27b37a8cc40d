// The logging facade. Debian 12's Abseil has no absl/log, so kvstream logs through this
// one function; an engine that embeds kvstream can redirect it with SetLogSink().
//
//   Log(LogLevel::kWarning, absl::StrCat("peer ", name, " slow: ", ms, " ms"));
//
// Thread-safe. The default sink writes "[kvstream W] message" lines to stderr for levels
// at or above the threshold (default kWarning).
#ifndef KVSTREAM_COMMON_LOGGING_H_
#define KVSTREAM_COMMON_LOGGING_H_

#include <functional>
#include "absl/strings/string_view.h"

namespace kvstream {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

using LogSink = std::function<void(LogLevel, absl::string_view)>;

// Replaces the sink; an empty function restores the default. Returns the previous one.
LogSink SetLogSink(LogSink sink);
// Messages below `level` are dropped before they reach the sink.
void SetLogThreshold(LogLevel level);
void Log(LogLevel level, absl::string_view message);

}  // namespace kvstream

#endif  // KVSTREAM_COMMON_LOGGING_H_
