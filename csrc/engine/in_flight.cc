#include "engine/in_flight.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <sstream>
#include <string>

#include "common/env.h"
#include "common/logging.h"
#include "engine/timeline.h"

namespace spark_hvd {
InFlight::InFlight(Completions* completions) : completions_(completions) {
  thread_ = std::thread([this] {
#ifdef __linux__
    pthread_setname_np(pthread_self(), "shvd_inflight");
#endif
    Loop();
  });
}

InFlight::~InFlight() {
  AbortAll(Status::NotInitialized("spark_hvd was shut down"));
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void InFlight::Add(std::unique_ptr<PendingWork> work,
                   std::vector<std::unique_ptr<TensorEntry>> entries) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    items_.push_back(Item{std::move(work), std::move(entries), NowMicros()});
  }
  cv_.notify_all();
}

Status InFlight::failure() {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void InFlight::Finish(Item& item, const Status& status) {
  for (auto& e : item.entries) {
    if (e) completions_->Complete(*e->state, status);
  }
  item.entries.clear();  // the buffers may go now
}

namespace {

std::string FormatSeconds(double s) {
  std::ostringstream out;
  out << s;
  return out.str();
}

}  // namespace

// "allreduce 'a', 'b', 'c' and 3 more": what a timed-out item was doing, for its error.
std::string InFlight::Describe(const Item& item) {
  std::vector<const TensorEntry*> mine;
  for (const auto& e : item.entries) {
    if (e) mine.push_back(e.get());
  }
  if (mine.empty()) return "no tensor of this rank";
  std::string out = std::string(OpTypeName(mine[0]->req.op)) + " '" + mine[0]->req.name + "'";
  const size_t shown = std::min<size_t>(mine.size(), 3);
  for (size_t i = 1; i < shown; ++i) out += ", '" + mine[i]->req.name + "'";
  if (mine.size() > shown) out += " and " + std::to_string(mine.size() - shown) + " more";
  return out;
}

void InFlight::Loop() {
  // Poll the oldest item (Poll never blocks, so the lock is held throughout and
  // AbortAll cannot race with it); sleep a little between polls while work is
  // queued (a device op takes microseconds to seconds), block while there is none.
  auto pause = std::chrono::microseconds(20);
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || !items_.empty(); });
    if (items_.empty()) return;  // stop_
    Item& item = items_.front();
    Status status;
    bool done = item.work->Poll(&status);
    if (!done && NowMicros() - item.started_us > env::TimeoutS() * 1e6) {
      done = true;
      status = Status::Timeout("a GPU collective (" + Describe(item) +
                               ") did not finish within SPARK_HVD_TIMEOUT_S=" +
                               FormatSeconds(env::TimeoutS()) +
                               " s; its communicator was aborted (a peer, or this rank's GPU, "
                               "may be stuck)");
    }
    if (!done) {
      cv_.wait_for(lock, pause, [this] { return stop_; });
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
      continue;
    }
    if (!status.ok()) {
      item.work->Abort();
      SHVD_LOG(kWarning, "inflight") << status.message();
      if (failure_.ok()) failure_ = status;
    }
    Finish(item, status);
    items_.pop_front();
    pause = std::chrono::microseconds(20);
    cv_.notify_all();  // Drain
  }
}

void InFlight::Drain(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool drained = cv_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                                    [this] { return items_.empty(); });
  lock.unlock();
  if (!drained) AbortAll(Status::Timeout("GPU work still running at shutdown"));
}

void InFlight::AbortAll(const Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& item : items_) {
    item.work->Abort();
    Finish(item, why);
  }
  items_.clear();
  cv_.notify_all();
}

}  // namespace spark_hvd
