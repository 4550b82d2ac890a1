// Heap allocations counted per thread, for the rule "no allocation per op in steady
// state": the engine's thread, any thread while it runs an engine cycle (RunCycle, on
// an API thread that Drives), and the InFlight thread that completes device work opt in
// (CountAllocations), and every operator new they make
// meanwhile, in the core or in the C++ library, adds one to a process-wide count that
// tests read (`_core.engine_allocations()`). Other threads and times (Python's own work,
// the heartbeats') are not counted, so a test sees the engine's allocations alone.
//
// The C++ library's out-of-line code (std::string growth) reaches this operator new only
// when the core was loaded before any other library that loads libstdc++ (numpy does):
// ProbeCountedAllocations tells, and the allocation test imports the core first.
//
// The count comes from the replaceable operator new (alloc_count.cc): one thread-local
// read per allocation, plus a relaxed atomic increment on a counted thread; no lock.
// malloc() called directly (C code) is not counted: the engine allocates through new.
#pragma once

#include <cstdint>

namespace spark_hvd {

// While alive, the calling thread's heap allocations are counted. Nests.
class CountAllocations {
 public:
  CountAllocations();
  ~CountAllocations();
  CountAllocations(const CountAllocations&) = delete;
  CountAllocations& operator=(const CountAllocations&) = delete;
};

// Allocations made by counted threads since the process started.
int64_t CountedAllocations();

// Self-check of the hook (tests): the allocations counted while this thread makes a
// std::vector and a std::string grow on the heap (>= 2 when the hook sees both).
int64_t ProbeCountedAllocations();

}  // namespace spark_hvd
