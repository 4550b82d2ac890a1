// Timeline: a Chrome-trace JSON file (chrome://tracing, Perfetto) with one row
// per tensor name and one complete event per phase of its life:
// NEGOTIATE_<OP> (enqueue -> agreed by all ranks), then the op's own phase
// (<BACKEND>_<OP>, e.g. TCP_ALLREDUCE).
// Enabled by SPARK_HVD_TIMELINE=path at init, or start_timeline()/stop_timeline().
#pragma once

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <unordered_map>

namespace spark_hvd {

int64_t NowMicros();

class Timeline {
 public:
  ~Timeline() { Stop(); }
  // Starts writing to `path` (truncates). Returns false when the file can't be opened.
  bool Start(const std::string& path, int rank);
  void Stop();
  bool active() const { return file_ != nullptr; }
  // One complete event on `tensor`'s row.
  void Event(const std::string& tensor, const std::string& phase, int64_t start_us, int64_t end_us);

 private:
  int Row(const std::string& tensor);  // caller holds mu_
  std::mutex mu_;
  std::FILE* file_ = nullptr;
  int rank_ = 0;
  bool first_ = true;
  std::unordered_map<std::string, int> rows_;
};

}  // namespace spark_hvd
