#include "engine/in_flight.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <sstream>
#include <string>

#include "common/alloc_count.h"
#include "common/env.h"
#include "common/logging.h"
#include "engine/timeline.h"

namespace spark_hvd {
InFlight::InFlight(Completions* completions) : completions_(completions) {
  thread_ = std::thread([this] {
#ifdef __linux__
    pthread_setname_np(pthread_self(), "shvd_inflight");
#endif
    CountAllocations counted;  // _core.engine_allocations() (common/alloc_count.h)
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
  // What an abort left queued ends soon (aborted collectives return at once); wait
  // briefly for it, then keep the rest's buffers for good.
  const int64_t until = NowMicros() + 2000000;
  std::lock_guard<std::mutex> lock(mu_);
  while (!draining_.empty() && NowMicros() < until) {
    Sweep(1e9);
    if (!draining_.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  Sweep(0);
}

void InFlight::Add(std::unique_ptr<PendingWork> work, std::vector<EntryPtr>* entries) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (spare_.empty()) spare_.emplace_back();  // a new high-water mark of items in flight
    items_.splice(items_.end(), spare_, spare_.begin());
    Item& item = items_.back();
    item.work = std::move(work);
    item.entries.clear();
    item.entries.swap(*entries);
    item.started_us = NowMicros();
    item.noted = false;
  }
  cv_.notify_all();
}

void InFlight::Retain(std::unique_ptr<PendingWork> work, std::vector<EntryPtr>* entries) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    KeepUntilQuiesced(Item{std::move(work), std::move(*entries), 0});
    entries->clear();
  }
  cv_.notify_all();
}

Status InFlight::failure() {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void InFlight::Finish(Item& item, const Status& status) {
  // Work that finished gives back what it held (pinned staging buffers, events) before
  // its ops complete, so that the next step finds them in their pools.
  if (status.ok()) {
    item.work.reset();
    ReleaseThenComplete(&item.entries, status, completions_, &done_);
    return;
  }
  for (auto& e : item.entries) {
    if (e) completions_->Complete(*e->state, status);
  }
  KeepUntilQuiesced(std::move(item));
}

void InFlight::KeepUntilQuiesced(Item item) {
  if (item.work->Quiesced()) return;  // the entries (and buffers) go now
  item.started_us = NowMicros();
  draining_.push_back(std::move(item));
}

void InFlight::Sweep(double deadline_s) {
  const int64_t now = NowMicros();
  for (auto it = draining_.begin(); it != draining_.end();) {
    if (it->work->Quiesced()) {
      it = draining_.erase(it);  // releases the entries, and their buffers
    } else if (now - it->started_us > deadline_s * 1e6) {
      SHVD_LOG(kWarning, "inflight")
          << "GPU work of a failed " << Describe(*it) << " has not ended "
          << (now - it->started_us) / 1000 << " ms after its abort; its buffers are kept "
          << "(never freed) so that it cannot write into reused memory";
      for (auto& e : it->entries) {
        if (e && e->owner) new std::shared_ptr<void>(std::move(e->owner));  // leaked
        if (e && e->state) new std::shared_ptr<OpState>(std::move(e->state));
      }
      (void)it->work.release();  // its event and communicator stay too
      it = draining_.erase(it);
    } else {
      ++it;
    }
  }
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
    cv_.wait(lock, [this] { return stop_ || !items_.empty() || !draining_.empty(); });
    if (stop_ && items_.empty()) return;
    Sweep(env::TimeoutS());
    if (items_.empty()) {
      if (!draining_.empty()) cv_.wait_for(lock, std::chrono::milliseconds(1));
      continue;
    }
    Item& item = items_.front();
    Status status;
    bool done = item.work->Poll(&status);
    const double timeout_s = env::TimeoutS();
    const int64_t waited_us = NowMicros() - item.started_us;
    if (!done && !item.noted && waited_us > std::min(1.0, timeout_s / 2) * 1e6) {
      item.noted = true;  // slow path: the peers may want to know who waits
      item.work->NoteWaiting();
    }
    if (!done && waited_us > timeout_s * 1e6) {
      done = true;
      std::vector<int32_t> ranks;
      std::string who = item.work->WhoIsMissing(&ranks);
      if (who.empty()) who = "a peer, or this rank's GPU, may be stuck";
      status =
          Status(StatusCode::kTimeout,
                 "a GPU collective (" + Describe(item) +
                     ") did not finish within SPARK_HVD_TIMEOUT_S=" + FormatSeconds(timeout_s) +
                     " s: " + who + "; its communicator was aborted",
                 ranks);
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
    spare_.splice(spare_.begin(), items_, items_.begin());  // its node is reused
    Finish(spare_.front(), status);
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
  std::list<Item> items;
  items.swap(items_);
  for (auto& item : items) {
    item.work->Abort();
    // The op's error says which of its collectives was cut short, whatever the reason.
    Finish(item, Status(why.code(),
                        why.message() + " (the GPU collective " + Describe(item) +
                            " was in flight and was aborted)",
                        why.ranks()));
  }
  cv_.notify_all();
}

}  // namespace spark_hvd
