#include "common/alloc_count.h"

#include <atomic>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

namespace spark_hvd {
namespace {

std::atomic<int64_t> g_counted{0};
thread_local int t_depth = 0;  // > 0: this thread is counted

void* Allocate(std::size_t bytes) {
  if (t_depth > 0) g_counted.fetch_add(1, std::memory_order_relaxed);
  if (bytes == 0) bytes = 1;
  while (true) {
    if (void* p = std::malloc(bytes)) return p;
    std::new_handler h = std::get_new_handler();
    if (h == nullptr) throw std::bad_alloc();
    h();
  }
}

void* AllocateAligned(std::size_t bytes, std::size_t align) {
  if (t_depth > 0) g_counted.fetch_add(1, std::memory_order_relaxed);
  if (bytes == 0) bytes = 1;
  bytes = (bytes + align - 1) / align * align;  // aligned_alloc wants a multiple
  while (true) {
    if (void* p = std::aligned_alloc(align, bytes)) return p;
    std::new_handler h = std::get_new_handler();
    if (h == nullptr) throw std::bad_alloc();
    h();
  }
}

}  // namespace

CountAllocations::CountAllocations() { ++t_depth; }
CountAllocations::~CountAllocations() { --t_depth; }

int64_t CountedAllocations() { return g_counted.load(std::memory_order_relaxed); }

int64_t ProbeCountedAllocations() {
  CountAllocations counted;
  const int64_t before = CountedAllocations();
  {
    std::vector<int64_t> v;
    v.push_back(1);
    std::string s(64, 'x');  // past the small-string buffer
    s.append(200, 'y');      // grown by the library's out-of-line code
  }
  return CountedAllocations() - before;
}

}  // namespace spark_hvd

// The replaceable global allocation functions (every form; the deleting ones pair with
// malloc). The array and nothrow forms default to these in the standard library, but
// are replaced too so that no form escapes the count.
void* operator new(std::size_t n) { return spark_hvd::Allocate(n); }
void* operator new[](std::size_t n) { return spark_hvd::Allocate(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return spark_hvd::Allocate(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return operator new(n, std::nothrow);
}
void* operator new(std::size_t n, std::align_val_t a) {
  return spark_hvd::AllocateAligned(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return spark_hvd::AllocateAligned(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
