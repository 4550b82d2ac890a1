// The fake NCCL's pieces shared by the rank side (fake_nccl_comm.cc), the coordinator
// (fake_nccl_coordinator.cc) and the arithmetic (fake_nccl_math.cc): the operation
// descriptor, the framed messages between a rank and the coordinator, and names for
// messages. Everything travels over 127.0.0.1 between processes of one machine, so
// integers go in host byte order.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backends/cuda/api.h"

namespace shvd_fake {

// -- operations -------------------------------------------------------------------
enum OpKind : uint8_t { kAllReduce, kBroadcast, kAllGather, kReduceScatter, kSend, kRecv };
constexpr int kPreMulSum = ncclNumOps;  // OpDesc::red of a user op made by ncclRedOpCreatePreMulSum

// One call as the coordinator sees it. `count` is the call's own count argument;
// `seq` is the call's index among this rank's collectives on the communicator, or for
// send/recv among its sends to (receives from) that peer.
struct OpDesc {
  uint8_t kind = 0;
  int32_t dtype = 0;
  int32_t red = 0;   // ncclSum..ncclAvg or kPreMulSum (reductions only)
  int32_t peer = 0;  // broadcast: root; send/recv: the peer
  uint64_t count = 0;
  uint64_t seq = 0;
  uint64_t scalar = 0;  // kPreMulSum: the scalar's bytes, in dtype
};

size_t DtypeSize(int dtype);  // 0 for a value that is not an ncclDataType_t
bool IsFloating(int dtype);
const char* DtypeName(int dtype);
const char* OpName(uint8_t kind);
std::string Describe(const OpDesc& d);  // "ncclAllReduce(count=4, ncclFloat32, ncclSum)"

// The reduction of `inputs` (one buffer of `count` elements per rank, in rank order)
// under d.red, in d.dtype: floating types combine through float (double for float64)
// and round to nearest even after every step; integers wrap. ncclAvg is what real NCCL
// does: for floating types each input is first multiplied by (dtype)(1/n), for integers
// the wrapped sum is divided by n (truncating). kPreMulSum multiplies rank r's input by
// scalars[r] before summing.
std::string Reduce(const OpDesc& d, const std::vector<const char*>& inputs,
                   const std::vector<uint64_t>& scalars);

// -- messages ---------------------------------------------------------------------
// rank -> coordinator: kJoin, kOps, kBye (ncclCommDestroy), kAbort (ncclCommAbort).
// coordinator -> rank: kJoined, kResult, kFail (the communicator's async error),
// kDeparted (a rank destroyed or aborted its communicator), kByeAck.
enum MsgType : uint32_t {
  kJoin = 1,
  kJoined,
  kOps,
  kResult,
  kFail,
  kDeparted,
  kBye,
  kByeAck,
  kAbort
};

class Writer {
 public:
  template <typename T>
  Writer& Put(T v) {
    buf_.append(reinterpret_cast<const char*>(&v), sizeof v);
    return *this;
  }
  Writer& Bytes(const void* p, size_t n) {
    Put<uint64_t>(n);
    buf_.append(static_cast<const char*>(p), n);
    return *this;
  }
  Writer& Str(const std::string& s) { return Bytes(s.data(), s.size()); }
  Writer& Desc(const OpDesc& d) {
    return Put(d.kind).Put(d.dtype).Put(d.red).Put(d.peer).Put(d.count).Put(d.seq).Put(d.scalar);
  }
  const std::string& data() const { return buf_; }

 private:
  std::string buf_;
};

// Reads what Writer wrote; a short message leaves ok() false and yields zeros.
class Reader {
 public:
  explicit Reader(const std::string& s) : p_(s.data()), left_(s.size()) {}
  template <typename T>
  T Get() {
    T v{};
    if (Take(sizeof v)) std::memcpy(&v, p_ - sizeof v, sizeof v);
    return v;
  }
  std::string Str() {
    uint64_t n = Get<uint64_t>();
    if (!Take(n)) return std::string();
    return std::string(p_ - n, n);
  }
  OpDesc Desc() {
    OpDesc d;
    d.kind = Get<uint8_t>();
    d.dtype = Get<int32_t>();
    d.red = Get<int32_t>();
    d.peer = Get<int32_t>();
    d.count = Get<uint64_t>();
    d.seq = Get<uint64_t>();
    d.scalar = Get<uint64_t>();
    return d;
  }
  bool ok() const { return ok_; }

 private:
  bool Take(uint64_t n) {
    if (!ok_ || n > left_) return ok_ = false;
    p_ += n;
    left_ -= n;
    return true;
  }
  const char* p_;
  uint64_t left_;
  bool ok_ = true;
};

// Blocking framed I/O on a connected socket (MSG_NOSIGNAL: a closed peer is an error,
// not SIGPIPE). False on any failure or end of stream.
bool SendFrame(int fd, MsgType type, const std::string& payload);
bool RecvFrame(int fd, MsgType* type, std::string* payload);
// A connected, TCP_NODELAY socket to 127.0.0.1:port, or -1.
int ConnectLoopback(uint16_t port);
void SetNoDelay(int fd);

// Starts this process's coordinator for one communicator (fake_nccl_coordinator.cc):
// a thread listening on 127.0.0.1 at an ephemeral port. False if the socket fails.
bool StartCoordinator(uint16_t* port, uint64_t* nonce);

}  // namespace shvd_fake
