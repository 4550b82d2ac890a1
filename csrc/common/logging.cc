#include "common/logging.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/env.h"

namespace spark_hvd {
namespace {

std::atomic<int> g_log_rank{-1};

LogLevel ParseLevel() {
  const std::string& s = env::LogLevelName();  // lower case (a Name)
  if (s == "trace") return LogLevel::kTrace;
  if (s == "debug") return LogLevel::kDebug;
  if (s == "info") return LogLevel::kInfo;
  if (s == "error" || s == "fatal") return LogLevel::kError;  // fatal: Horovod's level
  return LogLevel::kWarning;
}

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace:
      return "TRACE";
    case LogLevel::kDebug:
      return "DEBUG";
    case LogLevel::kInfo:
      return "INFO";
    case LogLevel::kWarning:
      return "WARNING";
    case LogLevel::kError:
      return "ERROR";
  }
  return "?";
}

}  // namespace

LogLevel CurrentLogLevel() {
  static const LogLevel level = ParseLevel();
  return level;
}

void SetLogRank(int rank) { g_log_rank.store(rank); }

void EmitLog(LogLevel level, const char* subsystem, const std::string& message) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  int rank = g_log_rank.load();
  if (rank >= 0) {
    std::fprintf(stderr, "[rank %d] spark_hvd %s %s: %s\n", rank, LevelName(level), subsystem,
                 message.c_str());
  } else {
    std::fprintf(stderr, "spark_hvd %s %s: %s\n", LevelName(level), subsystem, message.c_str());
  }
  std::fflush(stderr);
}

}  // namespace spark_hvd
