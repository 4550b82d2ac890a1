// KeptVector: a vector whose elements outlive clear(). The next push_back (or Add)
// assigns to an element kept from before, so its strings and vectors keep their
// capacity: a list refilled every cycle (the controller's responses) allocates nothing
// once it has held as many elements, as large, as it will. Copy assignment copies
// element-wise into the kept ones. Never shrinks; the elements past size() are stale.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace spark_hvd {

// Copies src into *dst; a string too small grows to twice src's length (at least 64
// bytes), so a kept string refilled with names of similar lengths allocates once, not
// each time a slightly longer one comes.
inline void AssignKept(std::string* dst, const std::string& src) {
  if (dst->capacity() < src.size()) dst->reserve(std::max<size_t>(2 * src.size(), 64));
  dst->assign(src);
}

template <class T>
class KeptVector {
 public:
  KeptVector() = default;
  KeptVector(const KeptVector& o) { *this = o; }
  KeptVector(KeptVector&& o) noexcept : items_(std::move(o.items_)), n_(o.n_) { o.n_ = 0; }
  KeptVector& operator=(const KeptVector& o) {
    if (this == &o) return *this;
    clear();
    for (const T& x : o) push_back(x);
    return *this;
  }
  KeptVector& operator=(KeptVector&& o) noexcept {
    items_.swap(o.items_);
    std::swap(n_, o.n_);
    o.clear();
    return *this;
  }

  // The next element, as last left (the caller assigns what it needs).
  T& Add() {
    if (n_ == items_.size()) items_.emplace_back();
    return items_[n_++];
  }
  void push_back(const T& x) { Add() = x; }
  void push_back(T&& x) { Add() = std::move(x); }
  void pop_back() { --n_; }
  void clear() { n_ = 0; }
  // Shrinking keeps the elements past n; growing adds elements as last left.
  void resize(size_t n) {
    while (items_.size() < n) items_.emplace_back();
    n_ = n;
  }

  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  T& operator[](size_t i) { return items_[i]; }
  const T& operator[](size_t i) const { return items_[i]; }
  T& front() { return items_[0]; }
  const T& front() const { return items_[0]; }
  T& back() { return items_[n_ - 1]; }
  const T& back() const { return items_[n_ - 1]; }
  T* begin() { return items_.data(); }
  T* end() { return items_.data() + n_; }
  const T* begin() const { return items_.data(); }
  const T* end() const { return items_.data() + n_; }

 private:
  std::vector<T> items_;
  size_t n_ = 0;
};

}  // namespace spark_hvd
