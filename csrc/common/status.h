// Status: how every fallible native call reports failure. Codes map 1:1 onto
// spark_hvd/exceptions.py (the `code` attribute of each exception class); Python
// sees this enum as spark_hvd._core.StatusCode.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace spark_hvd {

enum class StatusCode : int {
  kOk = 0,
  kUnknown = 1,
  kInvalidArgument = 2,
  kMismatch = 3,
  kNotInitialized = 4,
  kTimeout = 5,
  kPeerLost = 6,
  kStoreError = 7,
  kAuthentication = 8,
  kInternal = 9,
};

// A failure carries its evidence as fields as well as in its message; Python
// gets them as the exception's `ranks` and `tensor` attributes:
// - ranks: the ranks the failure is about (PeerLost: the lost or departed ones;
//   Timeout from the stall check: the ranks that never submitted the tensor;
//   Mismatch: the two ranks that disagree). Empty when unknown.
// - tensor: the name of the op that failed. Empty when the failure is not one op's.
class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message, std::vector<int32_t> ranks = {})
      : code_(code), message_(std::move(message)), ranks_(std::move(ranks)) {}

  static Status OK() { return Status(); }
  static Status InvalidArgument(std::string m) {
    return {StatusCode::kInvalidArgument, std::move(m)};
  }
  static Status Mismatch(std::string m) { return {StatusCode::kMismatch, std::move(m)}; }
  static Status NotInitialized(std::string m) {
    return {StatusCode::kNotInitialized, std::move(m)};
  }
  static Status Timeout(std::string m) { return {StatusCode::kTimeout, std::move(m)}; }
  // `lost`: the peers that are gone, when the caller knows them.
  static Status PeerLost(std::string m, std::vector<int32_t> lost = {}) {
    return {StatusCode::kPeerLost, std::move(m), std::move(lost)};
  }
  static Status StoreError(std::string m) { return {StatusCode::kStoreError, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

  // The same failure, as the failure of the op named `tensor`.
  Status WithTensor(std::string tensor) const {
    Status s = *this;
    s.tensor_ = std::move(tensor);
    return s;
  }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  const std::vector<int32_t>& ranks() const { return ranks_; }
  const std::string& tensor() const { return tensor_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
  std::vector<int32_t> ranks_;
  std::string tensor_;
};

// Thrown inside the core where unwinding is simpler than threading a Status
// through; caught at the engine / binding boundary and turned back into Status.
class StatusError : public std::runtime_error {
 public:
  explicit StatusError(Status s) : std::runtime_error(s.message()), status_(std::move(s)) {}
  const Status& status() const { return status_; }

 private:
  Status status_;
};

}  // namespace spark_hvd

// Internal invariant: prints both values and file:line. A failure is a bug.
#define SHVD_CHECK_OP(a, op, b)                                                         \
  do {                                                                                  \
    if (!((a)op(b))) {                                                                  \
      std::ostringstream shvd_os_;                                                      \
      shvd_os_ << "internal check failed at " << __FILE__ << ":" << __LINE__ << ": " #a \
               << " " #op " " #b " (" << (a) << " vs " << (b) << ")";                   \
      throw ::spark_hvd::StatusError(::spark_hvd::Status::Internal(shvd_os_.str()));    \
    }                                                                                   \
  } while (0)
#define SHVD_CHECK_EQ(a, b) SHVD_CHECK_OP(a, ==, b)
#define SHVD_CHECK_LE(a, b) SHVD_CHECK_OP(a, <=, b)
#define SHVD_CHECK(cond)                                                                    \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      std::ostringstream shvd_os_;                                                          \
      shvd_os_ << "internal check failed at " << __FILE__ << ":" << __LINE__ << ": " #cond; \
      throw ::spark_hvd::StatusError(::spark_hvd::Status::Internal(shvd_os_.str()));        \
    }                                                                                       \
  } while (0)
