// Leveled, per-subsystem logging to stderr, prefixed "[rank N]".
// Level from SPARK_HVD_LOG_LEVEL: trace, debug, info, warning (default), error.
#pragma once

#include <sstream>
#include <string>

namespace spark_hvd {

enum class LogLevel : int { kTrace = 0, kDebug = 1, kInfo = 2, kWarning = 3, kError = 4 };

LogLevel CurrentLogLevel();
void SetLogRank(int rank);
void EmitLog(LogLevel level, const char* subsystem, const std::string& message);

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* subsystem) : level_(level), subsystem_(subsystem) {}
  ~LogMessage() { EmitLog(level_, subsystem_, os_.str()); }
  std::ostream& stream() { return os_; }

 private:
  LogLevel level_;
  const char* subsystem_;
  std::ostringstream os_;
};

}  // namespace spark_hvd

#define SHVD_LOG(level, subsystem)                                     \
  if (::spark_hvd::LogLevel::level < ::spark_hvd::CurrentLogLevel()) { \
  } else                                                               \
    ::spark_hvd::LogMessage(::spark_hvd::LogLevel::level, subsystem).stream()
