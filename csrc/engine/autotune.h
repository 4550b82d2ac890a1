// Autotune (SPARK_HVD_AUTOTUNE, Horovod's HOROVOD_AUTOTUNE): during the first steps
// of a job, rank 0 tries fusion thresholds and cycle times, scores each by the bytes
// allreduced per second of wall time, and keeps the best. Every rank applies the same
// parameters at the same cycle because rank 0 publishes them in its CycleHeader.
//
// The search, deterministic given the scores (rank 0 only):
//  1. A step is a training step: it ends when a tensor name (per process set) comes
//     again. A sample is SPARK_HVD_AUTOTUNE_STEPS_PER_SAMPLE steps; its score is the
//     bytes of the allreduce responses negotiated in it over its wall time.
//  2. The first SPARK_HVD_AUTOTUNE_WARMUP_SAMPLES samples are discarded; then each
//     configuration is scored by the median of SPARK_HVD_AUTOTUNE_SAMPLES samples.
//  3. A coordinate sweep: the fusion thresholds of kThresholdsMiB at the job's cycle
//     time, then the cycle times of kCycleTimesMs at the best threshold (a
//     configuration already scored is not tried again). A parameter set explicitly
//     (SPARK_HVD_FUSION_THRESHOLD, SPARK_HVD_CYCLE_TIME_MS or their Horovod names) is
//     fixed: not searched, and published as kKeepOwn.
//  4. A switch chosen in cycle N is published and applied at cycle N+1; the step in
//     progress at the switch is not measured (its first part ran the old parameters),
//     the next sample starts at the next step boundary.
//  5. Then the best configuration (ties: the job's own settings) is published for
//     the rest of the job and measuring stops.
// Every rank applies the header of rank 0 before fusion (protocol step 6); without
// autotune on rank 0 (no kFlagTuned) every rank uses its own settings, as before.
#pragma once

#include <cstdint>
#include <fstream>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "engine/message.h"
#include "engine/negotiation.h"

namespace spark_hvd {

struct TunedParams {
  int64_t fusion_threshold_bytes = 0;
  double cycle_time_ms = 0.0;
  bool operator==(const TunedParams& o) const {
    return fusion_threshold_bytes == o.fusion_threshold_bytes && cycle_time_ms == o.cycle_time_ms;
  }
  bool operator!=(const TunedParams& o) const { return !(*this == o); }
};

// What spark_hvd._core.tuned_parameters() reports; identical on every rank after the
// same cycle.
struct TuneState {
  TunedParams current;
  bool tuned = false;      // rank 0 publishes parameters (SPARK_HVD_AUTOTUNE there)
  bool searching = false;  // ... and is still searching
  struct Switch {
    int64_t cycle;
    TunedParams params;
  };
  std::vector<Switch> history;  // every change of `current`, with the cycle it applied at
};

class Autotuner {
 public:
  static constexpr int64_t kThresholdsMiB[] = {1, 4, 16, 64, 128};
  static constexpr double kCycleTimesMs[] = {0.5, 1.0, 2.5, 5.0};

  // Reads the settings (at init, on the engine thread); rank 0 with SPARK_HVD_AUTOTUNE
  // plans the search and opens SPARK_HVD_AUTOTUNE_LOG.
  void Reset(int32_t rank);
  // Protocol step 2, rank 0: the parameters for this cycle, into its header.
  void Publish(CycleHeader* header) const;
  // Before fusion, every rank: takes rank 0's parameters (or its own settings).
  void Apply(const CycleHeader& root, int64_t cycle);
  // After fusion, rank 0 while searching: measures this cycle's responses and may
  // choose the parameters of the next cycle.
  void Measure(const ResponseList& responses);

  // The parameters in force (engine thread).
  int64_t fusion_threshold_bytes() const { return current_.fusion_threshold_bytes; }
  double cycle_time_ms() const { return current_.cycle_time_ms; }
  // Any thread.
  TuneState Snapshot() const;

 private:
  struct Scored {
    TunedParams params;
    double score;
  };
  void Sampled(double score);  // a sample of proposed_ is complete
  void Next();                 // proposes the next configuration, or the best
  void Log(const TunedParams& p, double score, bool best);

  // Every rank, written by the engine thread under mu_ (Snapshot reads them).
  mutable std::mutex mu_;
  TunedParams own_;  // this rank's settings
  TunedParams current_;
  bool tuned_ = false;
  bool searching_view_ = false;
  std::vector<TuneState::Switch> history_;

  // Rank 0's search.
  bool autotune_ = false;  // this rank runs the search (rank 0 with the setting)
  bool searching_ = false;
  bool threshold_fixed_ = false;
  bool cycle_fixed_ = false;
  int64_t steps_per_sample_ = 1;
  size_t samples_per_config_ = 1;
  int64_t warmup_left_ = 0;
  TunedParams proposed_;
  std::vector<TunedParams> queue_;  // still to try in this sweep
  bool cycle_sweep_ = false;        // the second sweep (cycle times) has begun
  std::vector<Scored> scored_;
  // Measurement: steps by repeated names, samples between step boundaries.
  std::unordered_set<std::string> step_names_;
  bool window_open_ = false;
  int64_t window_start_us_ = 0;
  int64_t window_steps_ = 0;
  int64_t window_bytes_ = 0;
  std::vector<double> samples_;
  std::ofstream log_;
};

}  // namespace spark_hvd
