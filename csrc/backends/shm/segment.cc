#include "backends/shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <string>

#include "common/status.h"

namespace spark_hvd {
namespace shm {
namespace {

[[noreturn]] void Throw(const std::string& what, int err) {
  throw StatusError(Status::Internal("shm: " + what + ": " + std::strerror(err)));
}

}  // namespace

Mapping::~Mapping() {
  if (base_ != nullptr) ::munmap(base_, bytes_);
}

Mapping& Mapping::operator=(Mapping&& o) noexcept {
  if (this != &o) {
    if (base_ != nullptr) ::munmap(base_, bytes_);
    base_ = o.base_;
    bytes_ = o.bytes_;
    o.base_ = nullptr;
  }
  return *this;
}

int CreateSegment(size_t slot_bytes, int rank, Mapping* out) {
  const size_t bytes = SegmentBytes(slot_bytes);
  const int fd = ::memfd_create("spark_hvd-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) Throw("memfd_create", errno);
  auto fail = [fd](const char* what) {
    const int err = errno;
    ::close(fd);
    Throw(what, err);
  };
  if (::fchmod(fd, 0600) != 0) fail("fchmod 0600");
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) fail("ftruncate");
  if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) fail("seal");
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) fail("mmap");
  *out = Mapping(base, bytes);
  ::madvise(base, bytes, MADV_DONTFORK);  // a forked child (a data loader) never holds it
  Header* h = new (base) Header{};
  h->magic = kMagic;
  h->rank = rank;
  h->pid = static_cast<int32_t>(::getpid());
  h->slot_bytes = slot_bytes;
  return fd;
}

Mapping MapSegment(int fd, size_t slot_bytes, int peer) {
  struct stat st{};
  if (::fstat(fd, &st) != 0) Throw("fstat of rank " + std::to_string(peer) + "'s segment", errno);
  const size_t bytes = SegmentBytes(slot_bytes);
  if (static_cast<size_t>(st.st_size) != bytes) {
    const size_t theirs =
        st.st_size > static_cast<off_t>(kHeaderBytes) ? (st.st_size - kHeaderBytes) / 2 : 0;
    throw StatusError(Status::InvalidArgument(
        "shm: rank " + std::to_string(peer) + " uses slots of " + std::to_string(theirs) +
        " bytes, this rank " + std::to_string(slot_bytes) +
        ": set SPARK_HVD_SHM_SLOT_BYTES to the same value on every rank"));
  }
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
    throw StatusError(Status::Internal("shm: the segment rank " + std::to_string(peer) +
                                       " sent is not sealed against shrinking"));
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) Throw("mmap of rank " + std::to_string(peer) + "'s segment", errno);
  Mapping m(base, bytes);
  ::madvise(base, bytes, MADV_DONTFORK);
  const Header* h = m.header();
  if (h->magic != kMagic || h->rank != peer || h->slot_bytes != slot_bytes) {
    throw StatusError(Status::Internal(
        "shm: the segment rank " + std::to_string(peer) + " sent has a header for rank " +
        std::to_string(h->rank) + " with slots of " + std::to_string(h->slot_bytes) + " bytes"));
  }
  return m;
}

}  // namespace shm
}  // namespace spark_hvd
