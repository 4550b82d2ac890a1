// One rank's shared-memory segment of backend "shm": a header of counters and two
// data slots, made by the rank itself and shared with the other members of its
// communicator only (connect.cc), never through a name in a filesystem.
//
//   [ Header (4 KiB) | slot 0 (slot_bytes) | slot 1 (slot_bytes) ]
//
// Collectives run in rounds numbered 1, 2, ... alike on every member (group.h); round
// g uses slot g % 2 of each member, so a member fills one slot while its peers may
// still read the other (the protocol: communicator.h).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace spark_hvd {
namespace shm {

constexpr uint64_t kMagic = 0x316d687364766873ULL;  // "shvdshm1"
constexpr size_t kHeaderBytes = 4096;

// The start of every segment. Its first fields are written once by the owner before
// the segment is shared; `started` and `reduced` only by the owner; `bell` by any
// member (a futex word), `sleeping` by the owner.
struct Header {
  uint64_t magic;
  int32_t rank;  // the owner's rank in the communicator
  int32_t pid;
  uint64_t slot_bytes;
  // The last round the owner started: its slot holds its data for that round, and it
  // has finished reading every earlier round's slots (its own and its peers').
  alignas(64) std::atomic<uint64_t> started;
  // The last round whose piece of an allreduce the owner reduced into its slot.
  alignas(64) std::atomic<uint64_t> reduced;
  // Rung (incremented, then FUTEX_WAKE) by a member that posts while the owner sleeps.
  alignas(64) std::atomic<uint32_t> bell;
  alignas(64) std::atomic<uint32_t> sleeping;  // 1 while the owner waits on its bell
  // Set (release) by the owner when its communicator failed, after the failure's code
  // and the job ranks it blamed: its connections then close because it stops, not
  // because it died, and a peer that sees them close reports the original failure.
  std::atomic<uint32_t> failed;
  int32_t failed_code;
  int32_t blamed_count;
  int32_t blamed[16];
};
static_assert(sizeof(Header) <= kHeaderBytes, "the header fits its page");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "atomics in shared memory");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "atomics in shared memory");

inline size_t SegmentBytes(size_t slot_bytes) { return kHeaderBytes + 2 * slot_bytes; }

// A mapped segment (this rank's or a peer's); unmapped when destroyed.
class Mapping {
 public:
  Mapping() = default;
  Mapping(void* base, size_t bytes) : base_(static_cast<char*>(base)), bytes_(bytes) {}
  ~Mapping();
  Mapping(Mapping&& o) noexcept : base_(o.base_), bytes_(o.bytes_) { o.base_ = nullptr; }
  Mapping& operator=(Mapping&& o) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  Header* header() const { return reinterpret_cast<Header*>(base_); }
  size_t slot_bytes() const { return (bytes_ - kHeaderBytes) / 2; }
  char* slot(uint64_t round) const { return base_ + kHeaderBytes + (round & 1) * slot_bytes(); }

 private:
  char* base_ = nullptr;
  size_t bytes_ = 0;
};

// Creates this rank's segment: an anonymous memory file (memfd) of mode 0600, sized for
// two slots and sealed at that size (no member can shrink it under another's mapping),
// mapped, its header written. Returns the file's descriptor (the caller shares it, then
// closes it). Throws StatusError (kInternal: the system refused, with its error).
int CreateSegment(size_t slot_bytes, int rank, Mapping* out);

// Maps a peer's segment from the descriptor it sent, after checking that its size is
// SegmentBytes(slot_bytes) and that it is sealed against shrinking. Throws StatusError
// (kInvalidArgument naming `peer` when the sizes differ: SPARK_HVD_SHM_SLOT_BYTES must be
// the same on every rank).
Mapping MapSegment(int fd, size_t slot_bytes, int peer);

}  // namespace shm
}  // namespace spark_hvd
