#include "common/traffic.h"

namespace spark_hvd {
namespace {

TrafficCount g_traffic[kTrafficSenders][kTrafficKinds];
ConnectionCount g_connections;
thread_local TrafficKind t_kind = TrafficKind::kData;

}  // namespace

const char* TrafficKindName(TrafficKind kind) {
  switch (kind) {
    case TrafficKind::kControl:
      return "control";
    case TrafficKind::kData:
      return "data";
    case TrafficKind::kLiveness:
      return "liveness";
  }
  return "?";
}

const char* TrafficSenderName(TrafficSender sender) {
  switch (sender) {
    case TrafficSender::kTcp:
      return "tcp";
    case TrafficSender::kShm:
      return "shm";
    case TrafficSender::kGloo:
      return "gloo";
    case TrafficSender::kMpi:
      return "mpi";
    case TrafficSender::kHeartbeat:
      return "heartbeat";
  }
  return "?";
}

ScopedTrafficKind::ScopedTrafficKind(TrafficKind kind) : saved_(t_kind) { t_kind = kind; }
ScopedTrafficKind::~ScopedTrafficKind() { t_kind = saved_; }

TrafficKind CurrentTrafficKind() { return t_kind; }

void CountMessage(TrafficSender sender, TrafficKind kind, int64_t bytes) {
  TrafficCount& c = g_traffic[static_cast<int>(sender)][static_cast<int>(kind)];
  c.messages.fetch_add(1, std::memory_order_relaxed);
  c.bytes.fetch_add(bytes, std::memory_order_relaxed);
}

void CountMessage(TrafficSender sender, int64_t bytes) { CountMessage(sender, t_kind, bytes); }

const TrafficCount& Traffic(TrafficSender sender, TrafficKind kind) {
  return g_traffic[static_cast<int>(sender)][static_cast<int>(kind)];
}

ConnectionCount& Connections() { return g_connections; }

}  // namespace spark_hvd
