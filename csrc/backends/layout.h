// SegmentLayout: the bytes of an allreduce as one logical buffer over several memory
// segments (tensors reduced in place, without a fusion buffer). Used by the backends
// that work on the tensors' own memory (tcp, shm).
#pragma once

#include <sys/uio.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#include "backends/communicator.h"

namespace spark_hvd {

class SegmentLayout {
 public:
  // One to keep (a communicator's): room for a fusion of 64 tensors from the start.
  SegmentLayout() {
    ptrs_.reserve(64);
    starts_.reserve(64);
  }
  SegmentLayout(const std::vector<Segment>& segments, size_t elem) { Reset(segments, elem); }
  // Lays out `segments` anew, reusing this layout's vectors (a communicator keeps one:
  // no allocation per op).
  void Reset(const std::vector<Segment>& segments, size_t elem) {
    ptrs_.clear();
    starts_.clear();
    bytes_ = 0;
    for (const auto& seg : segments) {
      if (seg.count <= 0) continue;
      ptrs_.push_back(static_cast<char*>(seg.data));
      starts_.push_back(bytes_);
      bytes_ += static_cast<size_t>(seg.count) * elem;
    }
  }
  size_t bytes() const { return bytes_; }

  // fn(pointer, length) for each contiguous piece of [off, off + len).
  template <typename F>
  void Pieces(size_t off, size_t len, F&& fn) const {
    size_t i = Find(off);
    while (len > 0) {
      const size_t end = i + 1 < starts_.size() ? starts_[i + 1] : bytes_;
      const size_t n = std::min(len, end - off);
      fn(ptrs_[i] + (off - starts_[i]), n);
      off += n;
      len -= n;
      ++i;
    }
  }

  // Describes [off, off + len) as at most kMaxIov entries of iov; returns how many.
  int Iov(size_t off, size_t len, iovec* iov) const {
    int k = 0;
    size_t i = Find(off);
    while (len > 0 && k < kMaxIov) {
      const size_t end = i + 1 < starts_.size() ? starts_[i + 1] : bytes_;
      const size_t n = std::min(len, end - off);
      iov[k].iov_base = ptrs_[i] + (off - starts_[i]);
      iov[k].iov_len = n;
      ++k;
      off += n;
      len -= n;
      ++i;
    }
    return k;
  }

  // Bytes [off, off + len) copied out to / in from a contiguous buffer.
  void CopyOut(size_t off, size_t len, char* to) const {
    Pieces(off, len, [&](char* p, size_t n) {
      std::memcpy(to, p, n);
      to += n;
    });
  }
  void CopyIn(size_t off, size_t len, const char* from) const {
    Pieces(off, len, [&](char* p, size_t n) {
      std::memcpy(p, from, n);
      from += n;
    });
  }
  // All the bytes.
  void CopyOut(char* to) const { CopyOut(0, bytes_, to); }
  void CopyIn(const char* from) const { CopyIn(0, bytes_, from); }

  static constexpr int kMaxIov = 64;

 private:
  size_t Find(size_t off) const {
    auto it = std::upper_bound(starts_.begin(), starts_.end(), off);
    return static_cast<size_t>(it - starts_.begin()) - 1;
  }
  std::vector<char*> ptrs_;
  std::vector<size_t> starts_;
  size_t bytes_ = 0;
};

}  // namespace spark_hvd
