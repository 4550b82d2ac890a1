// Every SPARK_HVD_* knob of the core, read once (at first use) through cached getters.
// Python mirrors the names and defaults in spark_hvd/_config.py.
#pragma once

#include <cstdint>
#include <string>

namespace spark_hvd {
namespace env {

int64_t GetInt(const char* name, int64_t default_value);
double GetDouble(const char* name, double default_value);
std::string GetString(const char* name, const std::string& default_value);

// Fusion buffer size in bytes; 0 disables fusion.
inline int64_t FusionThresholdBytes() {
  static const int64_t v = GetInt("SPARK_HVD_FUSION_THRESHOLD", 64 * 1024 * 1024);
  return v;
}
// Background cycle period.
inline double CycleTimeMs() {
  static const double v = GetDouble("SPARK_HVD_CYCLE_TIME_MS", 1.0);
  return v;
}
// Longest pause between negotiation cycles while no rank has anything pending:
// idle cycles back off from the cycle time, doubling, up to this. A rank that
// enqueues work starts a cycle at once; peers with no work of their own join it
// within this bound.
inline double IdleCycleTimeMs() {
  static const double v = GetDouble("SPARK_HVD_IDLE_CYCLE_TIME_MS", 10.0);
  return v;
}
// Response cache entries; 0 disables the cache.
inline int64_t CacheCapacity() {
  static const int64_t v = GetInt("SPARK_HVD_CACHE_CAPACITY", 1024);
  return v;
}
// Seconds before a tensor waiting for some ranks is reported.
inline double StallCheckTimeS() {
  static const double v = GetDouble("SPARK_HVD_STALL_CHECK_TIME_S", 60.0);
  return v;
}
// Seconds before stalled tensors fail with an error on every rank; 0 = never.
inline double StallShutdownTimeS() {
  static const double v = GetDouble("SPARK_HVD_STALL_SHUTDOWN_TIME_S", 0.0);
  return v;
}
// Transport timeout: how long a rank waits on a silent peer before declaring it lost.
inline double TimeoutS() {
  static const double v = GetDouble("SPARK_HVD_TIMEOUT_S", 30.0);
  return v;
}

// How the Gloo backend moves tensors: "tcp" (spark_hvd's own connections, see
// backends/tcp/mesh.h) or "gloo" (Gloo's pairs and algorithms: halving-doubling
// allreduce, its allgatherv, broadcast, alltoallv and barrier). The control plane
// always uses the own connections. Must be equal on every rank.
inline const std::string& GlooDataPlane() {
  static const std::string v = GetString("SPARK_HVD_GLOO_DATA_PLANE", "tcp");
  return v;
}

// With the "gloo" data plane, allreduces larger than this run as consecutive pieces of
// this many bytes (rounded down to whole elements). Must be equal on every rank.
inline int64_t GlooChunkBytes() {
  static const int64_t v = GetInt("SPARK_HVD_GLOO_CHUNK_BYTES", 16 * 1024 * 1024);
  return v;
}

}  // namespace env
}  // namespace spark_hvd
