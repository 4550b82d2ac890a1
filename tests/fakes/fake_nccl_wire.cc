// Names and framed socket I/O of the fake NCCL (declared in fake_nccl_wire.h).
#include "fake_nccl_wire.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

namespace shvd_fake {

size_t DtypeSize(int dtype) {
  switch (dtype) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 0;
  }
}

bool IsFloating(int dtype) {
  return dtype == ncclFloat16 || dtype == ncclFloat32 || dtype == ncclFloat64 ||
         dtype == ncclBfloat16;
}

const char* DtypeName(int dtype) {
  static const char* const names[] = {"ncclInt8",    "ncclUint8",   "ncclInt32",   "ncclUint32",
                                      "ncclInt64",   "ncclUint64",  "ncclFloat16", "ncclFloat32",
                                      "ncclFloat64", "ncclBfloat16"};
  return dtype >= 0 && dtype <= ncclBfloat16 ? names[dtype] : "(invalid datatype)";
}

const char* OpName(uint8_t kind) {
  static const char* const names[] = {"ncclAllReduce",     "ncclBroadcast", "ncclAllGather",
                                      "ncclReduceScatter", "ncclSend",      "ncclRecv"};
  return kind <= kRecv ? names[kind] : "(invalid operation)";
}

static const char* RedName(int red) {
  static const char* const names[] = {"ncclSum", "ncclProd", "ncclMax",
                                      "ncclMin", "ncclAvg",  "PreMulSum"};
  return red >= 0 && red <= kPreMulSum ? names[red] : "(invalid op)";
}

std::string Describe(const OpDesc& d) {
  std::string s =
      std::string(OpName(d.kind)) + "(count=" + std::to_string(d.count) + ", " + DtypeName(d.dtype);
  if (d.kind == kAllReduce || d.kind == kReduceScatter) s += std::string(", ") + RedName(d.red);
  if (d.kind == kBroadcast) s += ", root=" + std::to_string(d.peer);
  if (d.kind == kSend || d.kind == kRecv) s += ", peer=" + std::to_string(d.peer);
  return s + ")";
}

namespace {

struct FrameHeader {
  uint32_t type;
  uint32_t reserved;
  uint64_t bytes;
};

bool SendAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= size_t(k);
  }
  return true;
}

bool RecvAll(int fd, char* p, size_t n) {
  while (n > 0) {
    ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= size_t(k);
  }
  return true;
}

}  // namespace

bool SendFrame(int fd, MsgType type, const std::string& payload) {
  FrameHeader h{type, 0, payload.size()};
  std::string frame(reinterpret_cast<const char*>(&h), sizeof h);
  frame += payload;  // one send: no Nagle-sized gap between header and body
  return SendAll(fd, frame.data(), frame.size());
}

bool RecvFrame(int fd, MsgType* type, std::string* payload) {
  FrameHeader h;
  if (!RecvAll(fd, reinterpret_cast<char*>(&h), sizeof h)) return false;
  payload->resize(h.bytes);
  if (!RecvAll(fd, &(*payload)[0], h.bytes)) return false;
  *type = MsgType(h.type);
  return true;
}

void SetNoDelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

int ConnectLoopback(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int rc;
  do {
    rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  } while (rc < 0 && errno == EINTR);
  if (rc < 0) {
    ::close(fd);
    return -1;
  }
  SetNoDelay(fd);
  return fd;
}

}  // namespace shvd_fake
