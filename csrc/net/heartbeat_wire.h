// The heartbeats' records and limits (heartbeat.h's protocol), shared by heartbeat.cc
// (the thread, verdicts, leaving) and heartbeat_ring.cc (set-up and healing). Internal
// to csrc/net/.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>

#include "net/socket.h"

namespace spark_hvd {
namespace heartbeat {

using net::After;
using net::Clock;
using net::SecondsSince;

constexpr char kBeat = 'H';
constexpr char kLostRecord = 'L';
constexpr char kLeftRecord = 'G';
constexpr char kBye = 'B';
constexpr size_t kLostRecordBytes = 1 + 4 + 1 + 4;
constexpr size_t kLeftRecordBytes = 1 + 4;
constexpr double kLeaveWaitS = 0.5;     // step 6: for the neighbours to close their side
constexpr double kHelloTimeoutS = 5.0;  // per accepted connection, for its whole hello
constexpr int kBook = 16;               // successors' addresses read at set-up
constexpr int kProbeBatch = 8;          // would-be successors tried at once (step 5)
constexpr int kBacklog = 128;

inline void Signal(int efd) {
  const uint64_t one = 1;
  ssize_t w = ::write(efd, &one, sizeof(one));
  (void)w;  // an eventfd write of 1 cannot fail short of overflow
}

inline std::string Seconds(double s) {
  std::ostringstream os;
  os.precision(2);
  os << std::fixed << s;
  return os.str();
}

inline Clock::duration Duration(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

inline std::string LostRecord(int32_t rank, uint8_t how, int32_t reporter) {
  std::string r(1, kLostRecord);
  r.append(reinterpret_cast<const char*>(&rank), sizeof(rank));
  r.push_back(static_cast<char>(how));
  r.append(reinterpret_cast<const char*>(&reporter), sizeof(reporter));
  return r;
}

inline std::string LeftRecord(int32_t rank) {
  std::string r(1, kLeftRecord);
  r.append(reinterpret_cast<const char*>(&rank), sizeof(rank));
  return r;
}

}  // namespace heartbeat
}  // namespace spark_hvd
