// Status: how every fallible native call reports failure. Codes map 1:1 onto
// spark_hvd/exceptions.py (the `code` attribute of each exception class).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

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

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status OK() { return Status(); }
  static Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status Mismatch(std::string m) { return {StatusCode::kMismatch, std::move(m)}; }
  static Status NotInitialized(std::string m) { return {StatusCode::kNotInitialized, std::move(m)}; }
  static Status Timeout(std::string m) { return {StatusCode::kTimeout, std::move(m)}; }
  static Status PeerLost(std::string m) { return {StatusCode::kPeerLost, std::move(m)}; }
  static Status StoreError(std::string m) { return {StatusCode::kStoreError, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
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
#define SHVD_CHECK_OP(a, op, b)                                                          \
  do {                                                                                   \
    if (!((a)op(b))) {                                                                   \
      std::ostringstream shvd_os_;                                                       \
      shvd_os_ << "internal check failed at " << __FILE__ << ":" << __LINE__ << ": " #a  \
               << " " #op " " #b " (" << (a) << " vs " << (b) << ")";                    \
      throw ::spark_hvd::StatusError(::spark_hvd::Status::Internal(shvd_os_.str()));     \
    }                                                                                    \
  } while (0)
#define SHVD_CHECK_EQ(a, b) SHVD_CHECK_OP(a, ==, b)
#define SHVD_CHECK_LE(a, b) SHVD_CHECK_OP(a, <=, b)
#define SHVD_CHECK_LT(a, b) SHVD_CHECK_OP(a, <, b)
#define SHVD_CHECK(cond)                                                                 \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::ostringstream shvd_os_;                                                       \
      shvd_os_ << "internal check failed at " << __FILE__ << ":" << __LINE__ << ": " #cond; \
      throw ::spark_hvd::StatusError(::spark_hvd::Status::Internal(shvd_os_.str()));     \
    }                                                                                    \
  } while (0)
