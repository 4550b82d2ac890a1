#include "engine/autotune.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "common/env.h"
#include "common/logging.h"
#include "engine/timeline.h"

namespace spark_hvd {
namespace {

constexpr int64_t kMiB = 1024 * 1024;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2.0;
}

std::string Describe(const TunedParams& p) {
  std::ostringstream os;
  os << "fusion threshold " << p.fusion_threshold_bytes << " bytes, cycle time " << p.cycle_time_ms
     << " ms";
  return os.str();
}

}  // namespace

void Autotuner::Reset(int32_t rank) {
  std::lock_guard<std::mutex> lock(mu_);
  own_ = {env::FusionThresholdBytes(), env::CycleTimeMs()};
  current_ = own_;
  tuned_ = searching_view_ = false;
  history_.clear();
  autotune_ = rank == 0 && env::Autotune() != 0;
  threshold_fixed_ = env::FusionThresholdBytesIsSet();
  cycle_fixed_ = env::CycleTimeMsIsSet();
  steps_per_sample_ = std::max<int64_t>(1, env::AutotuneStepsPerSample());
  samples_per_config_ = static_cast<size_t>(std::max<int64_t>(1, env::AutotuneSamples()));
  warmup_left_ = std::max<int64_t>(0, env::AutotuneWarmupSamples());
  queue_.clear();
  scored_.clear();
  cycle_sweep_ = false;
  step_names_.clear();
  window_open_ = false;
  samples_.clear();
  if (log_.is_open()) log_.close();
  proposed_ = own_;
  searching_ = false;
  if (!autotune_) return;

  if (!threshold_fixed_) {
    for (int64_t mib : kThresholdsMiB) queue_.push_back({mib * kMiB, own_.cycle_time_ms});
  } else if (!cycle_fixed_) {
    cycle_sweep_ = true;
    for (double ms : kCycleTimesMs) queue_.push_back({own_.fusion_threshold_bytes, ms});
  }
  if (queue_.empty()) {
    SHVD_LOG(kWarning, "autotune") << "the fusion threshold and the cycle time are both set "
                                      "explicitly: there is nothing to tune";
  } else {
    searching_ = true;
    proposed_ = queue_.front();
    queue_.erase(queue_.begin());
  }
  const std::string& path = env::AutotuneLog();
  if (!path.empty()) {
    log_.open(path, std::ios::out | std::ios::trunc);
    if (!log_) {
      SHVD_LOG(kWarning, "autotune") << "cannot open the autotune log " << path;
    } else {
      log_ << "fusion_threshold_bytes,cycle_time_ms,bytes_per_second,best" << std::endl;
    }
  }
  SHVD_LOG(kInfo, "autotune") << "searching from " << Describe(proposed_)
                              << (threshold_fixed_ ? " (threshold fixed)" : "")
                              << (cycle_fixed_ ? " (cycle time fixed)" : "");
}

void Autotuner::Publish(CycleHeader* header) const {
  if (!autotune_) return;
  header->flags |= kFlagTuned | (searching_ ? kFlagSearching : 0u);
  header->fusion_threshold_kib =
      threshold_fixed_ ? kKeepOwn : static_cast<uint32_t>(proposed_.fusion_threshold_bytes / 1024);
  header->cycle_time_us =
      cycle_fixed_ ? kKeepOwn : static_cast<uint32_t>(std::lround(proposed_.cycle_time_ms * 1000));
}

void Autotuner::Apply(const CycleHeader& root, int64_t cycle) {
  const bool tuned = (root.flags & kFlagTuned) != 0;
  TunedParams p = own_;
  if (tuned && root.fusion_threshold_kib != kKeepOwn) {
    p.fusion_threshold_bytes = static_cast<int64_t>(root.fusion_threshold_kib) * 1024;
  }
  if (tuned && root.cycle_time_us != kKeepOwn) p.cycle_time_ms = root.cycle_time_us / 1000.0;
  const bool searching = (root.flags & kFlagSearching) != 0;
  if (p == current_ && tuned == tuned_ && searching == searching_view_) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (p != current_) {
    current_ = p;
    history_.push_back({cycle, p});
  }
  tuned_ = tuned;
  searching_view_ = searching;
}

void Autotuner::Measure(const ResponseList& responses) {
  if (!searching_ || responses.empty()) return;
  bool boundary = false;  // a name comes again: this cycle begins a new step
  int64_t bytes = 0;
  for (const Response& r : responses) {
    if (r.error != StatusCode::kOk) continue;
    for (const auto& t : r.tensors) {
      boundary = boundary || step_names_.count(TensorKey(r.process_set, t.name)) > 0;
    }
    if (r.op == OpType::kAllreduce) {
      bytes += r.TotalElements() * static_cast<int64_t>(DataTypeSize(r.dtype));
    }
  }
  if (boundary) {
    step_names_.clear();
    const int64_t now = NowMicros();
    if (!window_open_) {
      window_open_ = true;
      window_start_us_ = now;
      window_steps_ = window_bytes_ = 0;
    } else if (++window_steps_ == steps_per_sample_) {
      const double seconds = std::max<int64_t>(1, now - window_start_us_) / 1e6;
      const double score = static_cast<double>(window_bytes_) / seconds;
      window_start_us_ = now;
      window_steps_ = window_bytes_ = 0;
      Sampled(score);  // may switch: then the window is closed
    }
  }
  for (const Response& r : responses) {
    if (r.error != StatusCode::kOk) continue;
    for (const auto& t : r.tensors) step_names_.insert(TensorKey(r.process_set, t.name));
  }
  if (window_open_) window_bytes_ += bytes;
}

void Autotuner::Sampled(double score) {
  if (warmup_left_ > 0) {
    --warmup_left_;
    return;
  }
  samples_.push_back(score);
  if (samples_.size() < samples_per_config_) return;
  const double median = Median(samples_);
  samples_.clear();
  scored_.push_back({proposed_, median});
  Log(proposed_, median, false);
  SHVD_LOG(kInfo, "autotune") << Describe(proposed_) << ": " << median << " bytes/s";
  Next();
  window_open_ = false;  // the step in progress ran the old parameters
}

void Autotuner::Next() {
  auto best = [this] {
    // The first best, or the job's own settings when they tie with it.
    const Scored* b = &scored_.front();
    for (const Scored& s : scored_) {
      if (s.score > b->score || (s.score == b->score && s.params == own_)) b = &s;
    }
    return *b;
  };
  if (queue_.empty() && !cycle_sweep_ && !cycle_fixed_) {
    cycle_sweep_ = true;
    const int64_t threshold = best().params.fusion_threshold_bytes;
    for (double ms : kCycleTimesMs) {
      const TunedParams p{threshold, ms};
      if (std::none_of(scored_.begin(), scored_.end(),
                       [&](const Scored& s) { return s.params == p; })) {
        queue_.push_back(p);
      }
    }
  }
  if (!queue_.empty()) {
    proposed_ = queue_.front();
    queue_.erase(queue_.begin());
    return;
  }
  const Scored b = best();
  proposed_ = b.params;
  searching_ = false;
  Log(b.params, b.score, true);
  SHVD_LOG(kInfo, "autotune") << "chose " << Describe(b.params) << " (" << b.score
                              << " bytes/s) after " << scored_.size() << " configurations";
}

void Autotuner::Log(const TunedParams& p, double score, bool best) {
  if (!log_.is_open()) return;
  log_ << p.fusion_threshold_bytes << ',' << p.cycle_time_ms << ',' << std::llround(score) << ','
       << (best ? 1 : 0) << std::endl;
}

TuneState Autotuner::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  TuneState s;
  s.current = current_;
  s.tuned = tuned_;
  s.searching = searching_view_;
  s.history = history_;
  return s;
}

}  // namespace spark_hvd
