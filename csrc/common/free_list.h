// FreeList: blocks of one size kept for reuse, so an object made and freed once per op
// (an op's state, its queue entry) costs no heap allocation once the job is in steady
// state. Thread-safe: blocks are taken on API threads and given back on whichever thread
// drops the last reference.
//
// Lifetime: a FreeList is held by shared_ptr, and every allocator or deleter drawing on it
// holds a copy (an atomic increment, no allocation), so it outlives every block it handed
// out, whatever outlives the engine (a Python handle kept after shutdown()).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <vector>

namespace spark_hvd {

class FreeList {
 public:
  // Keeps at most `keep` free blocks (more are returned to the heap). The block size is
  // that of the first request; a request of another size goes to the heap.
  explicit FreeList(size_t keep) : keep_(keep) { free_.reserve(keep); }
  ~FreeList() {
    for (void* p : free_) ::operator delete(p);
  }
  FreeList(const FreeList&) = delete;
  FreeList& operator=(const FreeList&) = delete;

  void* Get(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (size_ == 0) size_ = bytes;
      if (bytes == size_ && !free_.empty()) {
        void* p = free_.back();
        free_.pop_back();
        return p;
      }
    }
    made_.fetch_add(1, std::memory_order_relaxed);
    return ::operator new(bytes);
  }
  void Put(void* p, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (bytes == size_ && free_.size() < keep_) {
        free_.push_back(p);  // within the reserved capacity: no allocation
        return;
      }
    }
    ::operator delete(p);
  }
  // Blocks taken from the heap so far: flat over steps once the job is in steady state.
  int64_t made() const { return made_.load(std::memory_order_relaxed); }

 private:
  std::mutex mu_;
  std::vector<void*> free_;
  size_t size_ = 0;
  const size_t keep_;
  std::atomic<int64_t> made_{0};
};

// Recycled<T>: a class that derives from it (class T : ..., public Recycled<T>) takes its
// objects' memory from a FreeList of its own, kept for the process's life: for an object
// made and deleted once per op on different threads (a backend's PendingWork, made on the
// engine thread, deleted by the InFlight thread's unique_ptr).
template <class T, size_t kKeep = 1024>
struct Recycled {
  static void* operator new(size_t bytes) { return List().Get(bytes); }
  static void operator delete(void* p, size_t bytes) { List().Put(p, bytes); }

 private:
  static FreeList& List() {
    static FreeList* list = new FreeList(kKeep);  // never destroyed: deletes may come at exit
    return *list;
  }
};

// A std allocator over a FreeList, for std::allocate_shared: the object and its control
// block come from the list and go back to it when the last reference (strong or weak) is
// gone, never earlier.
template <class T>
class FreeListAllocator {
 public:
  using value_type = T;
  explicit FreeListAllocator(std::shared_ptr<FreeList> list) : list_(std::move(list)) {}
  template <class U>
  FreeListAllocator(const FreeListAllocator<U>& other) : list_(other.list()) {}

  T* allocate(size_t n) {
    static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__, "over-aligned type");
    return static_cast<T*>(list_->Get(n * sizeof(T)));
  }
  void deallocate(T* p, size_t n) { list_->Put(p, n * sizeof(T)); }
  const std::shared_ptr<FreeList>& list() const { return list_; }

  template <class U>
  bool operator==(const FreeListAllocator<U>& o) const {
    return list_ == o.list();
  }
  template <class U>
  bool operator!=(const FreeListAllocator<U>& o) const {
    return list_ != o.list();
  }

 private:
  std::shared_ptr<FreeList> list_;
};

}  // namespace spark_hvd
