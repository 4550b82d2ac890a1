#include "backends/gloo/tcp_mesh.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <sstream>
#include <thread>

#include "common/logging.h"
#include "common/reduce.h"

namespace spark_hvd {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kHelloMagic = 0x73687664;  // "shvd"
constexpr size_t kTokenBytes = 32;            // hex characters
// Allreduces of at most this many bytes go direct (one round trip, every rank
// receives everything); larger ones take the ring (2 (n - 1) steps, each moving
// 1/n of the buffer).
constexpr size_t kDirectBytes = 64 * 1024;
// The reduce-scatter receives into a scratch ring of this size and reduces slices
// of at least kReduceSlice bytes (or what is left of a step) as they arrive.
constexpr size_t kScratchBytes = 4 << 20;
constexpr size_t kReduceSlice = 64 << 10;
// One send() or recv() moves at most this much, so reducing and forwarding keep
// pace with the wire instead of waiting for a whole chunk.
constexpr size_t kMaxIo = 1 << 20;
// Broadcasts of at least this many bytes among more than two ranks use a chain.
constexpr int64_t kChainBytes = 1 << 20;

std::string Errno(int err) { return std::string(std::strerror(err)); }

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

void SetNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void SetNonBlocking(int fd, bool on) {
  int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

// Blocking helpers for the handshake only (sockets still blocking, with a
// receive/send timeout set).
bool WriteAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = ::recv(fd, c, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

void SetIoTimeout(int fd, double seconds) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(seconds);
  tv.tv_usec = static_cast<suseconds_t>((seconds - static_cast<double>(tv.tv_sec)) * 1e6);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

std::string NewToken() {
  std::random_device rd;
  static const char* hex = "0123456789abcdef";
  std::string t(kTokenBytes, '0');
  for (auto& c : t) c = hex[rd() & 15];
  return t;
}

struct Hello {
  uint32_t magic;
  uint32_t rank;
  char token[kTokenBytes];
};

class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

[[noreturn]] void Throw(Status s) { throw StatusError(std::move(s)); }

// A listening socket on bind_host, any port; returns fd and the port.
int Listen(const std::string& host, int backlog, int* port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), "0", &hints, &res);
  if (rc != 0) {
    Throw(Status::InvalidArgument("cannot resolve this rank's address '" + host +
                                  "': " + gai_strerror(rc)));
  }
  std::string last;
  for (addrinfo* a = res; a; a = a->ai_next) {
    FdCloser fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (fd.get() < 0) {
      last = Errno(errno);
      continue;
    }
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd.get(), backlog) != 0) {
      last = Errno(errno);
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
    *port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    freeaddrinfo(res);
    return fd.release();
  }
  freeaddrinfo(res);
  Throw(Status::InvalidArgument("cannot listen on this rank's address '" + host + "': " + last));
}

// Connects to host:port, retrying until the deadline (the peer may not listen yet).
int ConnectTo(const std::string& host, int port, Clock::time_point deadline, int peer) {
  std::string last = "no address";
  do {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* res = nullptr;
    const std::string port_s = std::to_string(port);
    int rc = getaddrinfo(host.c_str(), port_s.c_str(), &hints, &res);
    if (rc == 0) {
      for (addrinfo* a = res; a; a = a->ai_next) {
        FdCloser fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
        if (fd.get() < 0) continue;
        if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) == 0) {
          freeaddrinfo(res);
          return fd.release();
        }
        last = Errno(errno);
      }
      freeaddrinfo(res);
    } else {
      last = gai_strerror(rc);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (Clock::now() < deadline);
  Throw(Status::Timeout("could not connect to rank " + std::to_string(peer) + " at " + host +
                        ":" + std::to_string(port) + ": " + last));
}

}  // namespace

TcpMesh::TcpMesh(int rank, int size, std::vector<int> fds, double timeout_s)
    : rank_(rank), size_(size), fds_(std::move(fds)), timeout_s_(timeout_s) {}

TcpMesh::~TcpMesh() {
  for (int fd : fds_) {
    if (fd >= 0) ::close(fd);
  }
}

std::unique_ptr<TcpMesh> TcpMesh::Connect(int rank, int size, Store* store,
                                          const std::string& bind_host, double timeout_s,
                                          double connect_timeout_s) {
  std::vector<int> fds(static_cast<size_t>(size), -1);
  auto close_all = [&fds] {
    for (int& fd : fds) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
  };
  try {
    int port = 0;
    FdCloser listener(Listen(bind_host, size, &port));
    const std::string token = NewToken();
    store->Set("tcp/" + std::to_string(rank), bind_host + " " + std::to_string(port) + " " + token);
    const auto deadline =
        Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(connect_timeout_s * 1000));

    // Connect to every lower rank and say hello with its token; the acknowledgement
    // (its rank) is read after accepting, so no rank waits on another's accept loop.
    for (int p = 0; p < rank; ++p) {
      std::istringstream in(store->Get("tcp/" + std::to_string(p), connect_timeout_s));
      std::string host, peer_token;
      int peer_port = 0;
      in >> host >> peer_port >> peer_token;
      if (peer_token.size() != kTokenBytes) {
        Throw(Status::StoreError("malformed address of rank " + std::to_string(p) + " in the store"));
      }
      fds[p] = ConnectTo(host, peer_port, deadline, p);
      SetIoTimeout(fds[p], connect_timeout_s);
      Hello h{kHelloMagic, static_cast<uint32_t>(rank), {}};
      std::memcpy(h.token, peer_token.data(), kTokenBytes);
      if (!WriteAll(fds[p], &h, sizeof(h))) {
        Throw(Status::PeerLost("rank " + std::to_string(p) + " closed the connection during set-up"));
      }
    }
    // Accept every higher rank; connections without this rank's token are dropped.
    int missing = size - 1 - rank;
    while (missing > 0) {
      const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
      pollfd pfd{listener.get(), POLLIN, 0};
      int rc = left > 0 ? ::poll(&pfd, 1, static_cast<int>(left * 1000) + 1) : 0;
      if (rc < 0 && errno == EINTR) continue;
      if (rc <= 0) {
        std::string who;
        for (int p = rank + 1; p < size; ++p) {
          if (fds[p] < 0) who += (who.empty() ? "" : ", ") + std::to_string(p);
        }
        Throw(Status::Timeout("rank " + std::to_string(rank) + " waited " +
                              std::to_string(connect_timeout_s) + " s for connections from rank(s) " +
                              who));
      }
      FdCloser conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (conn.get() < 0) continue;
      SetIoTimeout(conn.get(), std::min(5.0, connect_timeout_s));
      Hello h{};
      if (!ReadAll(conn.get(), &h, sizeof(h)) || h.magic != kHelloMagic ||
          std::memcmp(h.token, token.data(), kTokenBytes) != 0 ||
          h.rank <= static_cast<uint32_t>(rank) || h.rank >= static_cast<uint32_t>(size) ||
          fds[h.rank] >= 0) {
        SHVD_LOG(kWarning, "tcp") << "rank " << rank
                                  << " dropped a connection without a valid hello";
        continue;
      }
      const uint32_t me = static_cast<uint32_t>(rank);
      if (!WriteAll(conn.get(), &me, sizeof(me))) continue;
      SetIoTimeout(conn.get(), connect_timeout_s);
      fds[h.rank] = conn.release();
      --missing;
    }
    for (int p = 0; p < rank; ++p) {
      uint32_t ack = 0;
      if (!ReadAll(fds[p], &ack, sizeof(ack)) || ack != static_cast<uint32_t>(p)) {
        Throw(Status::PeerLost("rank " + std::to_string(p) +
                               " refused this rank's connection (wrong token?)"));
      }
    }
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      SetIoTimeout(fds[p], 0);
      SetNoDelay(fds[p]);
      SetNonBlocking(fds[p], true);
    }
  } catch (...) {
    close_all();
    throw;
  }
  SHVD_LOG(kDebug, "tcp") << "mesh of rank " << rank << " of " << size << " connected";
  return std::unique_ptr<TcpMesh>(new TcpMesh(rank, size, std::move(fds), timeout_s));
}

Status TcpMesh::Fail(Status s) {
  if (broken_.ok()) broken_ = s;
  return s;
}

Status TcpMesh::PeerError(int peer, const char* what, int err) {
  if (err == ECONNRESET || err == EPIPE) return PeerClosed(peer, what);
  return Fail(Status::PeerLost(std::string(what) + " on rank " + std::to_string(rank_) +
                               " lost rank " + std::to_string(peer) + ": " + Errno(err)));
}

Status TcpMesh::PeerClosed(int peer, const char* what) {
  // A rank that lost a peer stops and closes its connections too, so the first
  // closed connection seen here may be a bystander's: name every peer whose
  // connection is closed by now (a killed process's are closed by its kernel).
  std::vector<pollfd> pfds;
  std::vector<int> peers;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || p == peer) continue;
    pfds.push_back(pollfd{fds_[p], POLLRDHUP, 0});
    peers.push_back(p);
  }
  std::vector<int> closed{peer};
  if (!pfds.empty() && ::poll(pfds.data(), pfds.size(), 0) > 0) {
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (pfds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) closed.push_back(peers[i]);
    }
  }
  std::sort(closed.begin(), closed.end());
  std::string who;
  for (int p : closed) who += (who.empty() ? "" : ",") + std::to_string(p);
  return Fail(Status::PeerLost(std::string(what) + " on rank " + std::to_string(rank_) +
                               " lost rank" + (closed.size() > 1 ? "s " : " ") + who +
                               ": connection closed (the process exited or was killed, or "
                               "stopped after losing another rank)"));
}

Status TcpMesh::Timeout(const std::vector<int>& peers, const char* what) {
  std::string who;
  for (int p : peers) who += (who.empty() ? "" : ", ") + std::to_string(p);
  std::ostringstream os;
  os << what << " on rank " << rank_ << " heard nothing from rank(s) " << who << " for "
     << timeout_s_ << " s (SPARK_HVD_TIMEOUT_S)";
  return Fail(Status::Timeout(os.str()));
}

ssize_t TcpMesh::Move(int peer, bool send, iovec* iov, int iovcnt, const char* what,
                      Status* error) {
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = static_cast<size_t>(iovcnt);
  while (true) {
    ssize_t r = send ? ::sendmsg(fds_[peer], &msg, MSG_NOSIGNAL | MSG_DONTWAIT)
                     : ::recvmsg(fds_[peer], &msg, MSG_DONTWAIT);
    if (r > 0) return r;
    if (r == 0 && !send) {
      *error = PeerClosed(peer, what);
      return -1;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    *error = PeerError(peer, what, r < 0 ? errno : EPIPE);
    return -1;
  }
}

ssize_t TcpMesh::Move(int peer, bool send, char* data, size_t len, const char* what,
                      Status* error) {
  iovec iov{data, std::min(len, kMaxIo)};
  return Move(peer, send, &iov, 1, what, error);
}

Status TcpMesh::Wait(const std::vector<std::pair<int, short>>& waits,
                     Clock::time_point last_progress, const char* what) {
  std::vector<pollfd> pfds;
  std::vector<int> peers;
  for (const auto& w : waits) {
    auto it = std::find(peers.begin(), peers.end(), w.first);
    if (it != peers.end()) {
      pfds[static_cast<size_t>(it - peers.begin())].events |= w.second;
      continue;
    }
    pfds.push_back(pollfd{fds_[w.first], w.second, 0});
    peers.push_back(w.first);
  }
  SHVD_CHECK(!pfds.empty());
  const double left = timeout_s_ - SecondsSince(last_progress);
  if (left <= 0) return Timeout(peers, what);
  int rc = ::poll(pfds.data(), pfds.size(), static_cast<int>(left * 1000) + 1);
  if (rc < 0 && errno != EINTR) return Fail(Status::Internal(std::string("poll: ") + Errno(errno)));
  return Status::OK();
}

Status TcpMesh::Exchange(std::vector<Transfer>& xs, const char* what) {
  auto last_progress = Clock::now();
  std::vector<std::pair<int, short>> waits;
  Status error;
  while (true) {
    bool progress = false;
    waits.clear();
    for (auto& x : xs) {
      while (x.left > 0) {
        ssize_t r = Move(x.peer, x.send, x.data, x.left, what, &error);
        if (r < 0) return error;
        if (r == 0) break;
        x.data += r;
        x.left -= static_cast<size_t>(r);
        progress = true;
      }
      if (x.left > 0) waits.emplace_back(x.peer, x.send ? POLLOUT : POLLIN);
    }
    if (waits.empty()) return Status::OK();
    if (progress) last_progress = Clock::now();
    Status s = Wait(waits, last_progress, what);
    if (!s.ok()) return s;
  }
}

// Where each rank's block starts in a concatenation of blocks of these sizes
// (size + 1 entries, the last one the total).
std::vector<size_t> TcpMesh::Offsets(const std::vector<int64_t>& bytes) const {
  std::vector<size_t> offset(static_cast<size_t>(size_) + 1, 0);
  for (int p = 0; p < size_; ++p) offset[p + 1] = offset[p] + static_cast<size_t>(bytes[p]);
  return offset;
}

Status TcpMesh::AllgatherFixed(const void* in, void* out, int64_t bytes) {
  return AllgatherBlocks(in, out, Offsets(std::vector<int64_t>(size_, bytes)), "control allgather");
}

Status TcpMesh::Allgatherv(const void* in, void* out,
                           const std::vector<int64_t>& bytes_per_rank) {
  return AllgatherBlocks(in, out, Offsets(bytes_per_rank), "allgather");
}

Status TcpMesh::AllgatherBlocks(const void* in, void* out, const std::vector<size_t>& offset,
                                const char* what) {
  if (!broken_.ok()) return broken_;
  char* o = static_cast<char*>(out);
  char* mine = o + offset[rank_];
  const size_t n = offset[rank_ + 1] - offset[rank_];
  if (n > 0 && mine != in) std::memmove(mine, in, n);
  std::vector<Transfer> xs;
  for (int k = 1; k < size_; ++k) {
    if (n > 0) xs.push_back({(rank_ + k) % size_, mine, n, true});
  }
  for (int k = 1; k < size_; ++k) {
    const int p = (rank_ + size_ - k) % size_;
    const size_t theirs = offset[p + 1] - offset[p];
    if (theirs > 0) xs.push_back({p, o + offset[p], theirs, false});
  }
  return Exchange(xs, what);
}

// Large broadcasts among more than two ranks go down a chain (root, root + 1, ...),
// each rank forwarding what it has received while the rest arrives: the root
// sends the payload once instead of size - 1 times.
Status TcpMesh::Broadcast(void* buf, int64_t bytes, int root) {
  if (!broken_.ok()) return broken_;
  if (bytes == 0) return Status::OK();
  char* b = static_cast<char*>(buf);
  if (size_ > 2 && bytes >= kChainBytes) {
    const size_t total = static_cast<size_t>(bytes);
    const int pos = (rank_ - root + size_) % size_;
    const int prev = (rank_ + size_ - 1) % size_, next = (rank_ + 1) % size_;
    const bool forward = pos < size_ - 1;
    size_t got = pos == 0 ? total : 0, sent = 0;
    auto last_progress = Clock::now();
    Status error;
    while (got < total || (forward && sent < total)) {
      bool progress = false;
      while (got < total) {
        ssize_t r = Move(prev, false, b + got, total - got, "broadcast", &error);
        if (r < 0) return error;
        if (r == 0) break;
        got += static_cast<size_t>(r);
        progress = true;
      }
      while (forward && sent < got) {
        ssize_t w = Move(next, true, b + sent, got - sent, "broadcast", &error);
        if (w < 0) return error;
        if (w == 0) break;
        sent += static_cast<size_t>(w);
        progress = true;
      }
      if (progress) {
        last_progress = Clock::now();
        continue;
      }
      std::vector<std::pair<int, short>> waits;
      if (got < total) waits.emplace_back(prev, POLLIN);
      if (forward && sent < got) waits.emplace_back(next, POLLOUT);
      Status s = Wait(waits, last_progress, "broadcast");
      if (!s.ok()) return s;
    }
    return Status::OK();
  }
  std::vector<Transfer> xs;
  if (rank_ == root) {
    for (int k = 1; k < size_; ++k) xs.push_back({(rank_ + k) % size_, b, static_cast<size_t>(bytes), true});
  } else {
    xs.push_back({root, b, static_cast<size_t>(bytes), false});
  }
  return Exchange(xs, "broadcast");
}

Status TcpMesh::Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                          const std::vector<int64_t>& recv_bytes) {
  if (!broken_.ok()) return broken_;
  const std::vector<size_t> soff = Offsets(send_bytes), roff = Offsets(recv_bytes);
  const char* i = static_cast<const char*>(in);
  char* o = static_cast<char*>(out);
  if (send_bytes[rank_] > 0) {
    std::memcpy(o + roff[rank_], i + soff[rank_], static_cast<size_t>(send_bytes[rank_]));
  }
  std::vector<Transfer> xs;
  for (int k = 1; k < size_; ++k) {
    const int p = (rank_ + k) % size_;
    if (send_bytes[p] > 0) {
      xs.push_back({p, const_cast<char*>(i + soff[p]), static_cast<size_t>(send_bytes[p]), true});
    }
  }
  for (int k = 1; k < size_; ++k) {
    const int p = (rank_ + size_ - k) % size_;
    if (recv_bytes[p] > 0) xs.push_back({p, o + roff[p], static_cast<size_t>(recv_bytes[p]), false});
  }
  return Exchange(xs, "alltoall");
}

Status TcpMesh::Barrier() {
  char mine = 1;
  std::vector<char> all(static_cast<size_t>(size_));
  return AllgatherBlocks(&mine, all.data(), Offsets(std::vector<int64_t>(size_, 1)), "barrier");
}

// The bytes of an allreduce as one logical buffer over several memory segments
// (tensors reduced in place, without a fusion buffer).
class TcpMesh::Layout {
 public:
  Layout(const std::vector<Segment>& segments, size_t elem) {
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

  // All the bytes, packed into / unpacked from a contiguous buffer.
  void CopyOut(char* to) const {
    Pieces(0, bytes_, [&](char* p, size_t len) {
      std::memcpy(to, p, len);
      to += len;
    });
  }
  void CopyIn(const char* from) const {
    Pieces(0, bytes_, [&](char* p, size_t len) {
      std::memcpy(p, from, len);
      from += len;
    });
  }

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

Status TcpMesh::Allreduce(const std::vector<Segment>& segments, DataType dtype, ReduceOp op,
                          double scale) {
  if (!broken_.ok()) return broken_;
  const size_t elem = DataTypeSize(dtype);
  Layout buf(segments, elem);
  if (buf.bytes() == 0) return Status::OK();
  const size_t count = buf.bytes() / elem;
  if (buf.bytes() <= kDirectBytes || count < static_cast<size_t>(size_)) {
    return DirectAllreduce(buf, dtype, op, scale);
  }
  return RingAllreduce(buf, dtype, op, scale);
}

Status TcpMesh::DirectAllreduce(const Layout& buf, DataType dtype, ReduceOp op, double scale) {
  const size_t n = buf.bytes();
  const size_t elem = DataTypeSize(dtype);
  // Slots 0..size-1: each rank's contribution (this rank's packed here); slot size:
  // the result, reduced in rank order on every rank: ((x0 op x1) op x2) ...
  scratch_.resize(std::max(scratch_.size(), n * static_cast<size_t>(size_ + 1)));
  char* slots = scratch_.data();
  char* mine = slots + n * rank_;
  buf.CopyOut(mine);
  Status s = AllgatherBlocks(mine, slots, Offsets(std::vector<int64_t>(size_, n)), "allreduce");
  if (!s.ok()) return s;
  ReduceFn fn = GetReduceFn(dtype, op);
  char* acc = slots + n * size_;
  std::memcpy(acc, slots, n);
  for (int p = 1; p < size_; ++p) fn(acc, slots + n * p, n / elem);
  if (scale != 1.0) ScaleBuffer(acc, n / elem, dtype, scale);
  buf.CopyIn(acc);
  return Status::OK();
}

// Ring allreduce as one pipelined stream per direction. Chunk c of the buffer is
// elements [c * count / n, (c + 1) * count / n). Step k (0 <= k < 2n - 2) sends
// chunk S(k) to the next rank and receives chunk R(k) from the previous one:
//   reduce-scatter (k < n - 1):  S(k) = rank - k,        R(k) = rank - k - 1 (reduced in)
//   allgather (k = n - 1 + j):   S(k) = rank + 1 - j,    R(k) = rank - j     (copied in)
// S(k + 1) == R(k): what a step receives is what the next step forwards, so a byte
// of step k + 1 may go out as soon as that byte of step k is received (and reduced).
// The reduce-scatter lands in a scratch ring and is reduced into buf slice by slice;
// the last reduce-scatter step also applies `scale` (this rank's chunk is final then).
// Each chunk is reduced along the ring in one order, then copied to every rank,
// so all ranks hold the same bits. Sends and allgather receives go straight from
// and into the segments (sendmsg/recvmsg over iovecs).
Status TcpMesh::RingAllreduce(const Layout& buf, DataType dtype, ReduceOp op, double scale) {
  const int n = size_;
  const size_t elem = DataTypeSize(dtype);
  const size_t count = buf.bytes() / elem;
  auto chunk_begin = [&](int c) {
    c = ((c % n) + n) % n;
    return count * static_cast<size_t>(c) / static_cast<size_t>(n) * elem;
  };
  auto chunk_bytes = [&](int c) {
    c = ((c % n) + n) % n;
    return (count * static_cast<size_t>(c + 1) / static_cast<size_t>(n) -
            count * static_cast<size_t>(c) / static_cast<size_t>(n)) * elem;
  };
  const int steps = 2 * n - 2;
  auto send_chunk = [&](int k) { return k < n - 1 ? rank_ - k : rank_ + 1 - (k - (n - 1)); };
  auto recv_chunk = [&](int k) { return k < n - 1 ? rank_ - k - 1 : rank_ - (k - (n - 1)); };

  size_t largest = 0;
  for (int c = 0; c < n; ++c) largest = std::max(largest, chunk_bytes(c));
  const size_t ring = std::min(kScratchBytes, (largest + elem - 1) / elem * elem);
  scratch_.resize(std::max(scratch_.size(), ring));
  char* scratch = scratch_.data();
  ReduceFn fn = GetReduceFn(dtype, op);

  const int next = (rank_ + 1) % n, prev = (rank_ + n - 1) % n;
  Status error;
  int sk = 0, rk = 0;      // current send / receive step
  size_t sent = 0;         // bytes of step sk sent
  size_t got = 0;          // bytes of step rk received
  size_t done = 0;         // bytes of step rk reduced (reduce-scatter) or received (allgather)
  auto last_progress = Clock::now();
  iovec iov[Layout::kMaxIov];

  // Reduces received scratch bytes of step rk into buf, whole elements only.
  auto reduce_ready = [&](bool force) {
    size_t avail = (got - done) / elem * elem;
    if (avail == 0 || (!force && avail < kReduceSlice && got < chunk_bytes(recv_chunk(rk)))) {
      return;
    }
    const size_t base = chunk_begin(recv_chunk(rk));
    const bool last = rk == n - 2;
    while (avail > 0) {
      const size_t at = done % ring;
      const size_t len = std::min(avail, ring - at);
      const char* from = scratch + at;
      buf.Pieces(base + done, len, [&](char* p, size_t m) {
        fn(p, from, m / elem);
        if (last && scale != 1.0) ScaleBuffer(p, m / elem, dtype, scale);
        from += m;
      });
      done += len;
      avail -= len;
    }
  };
  // Bytes of send step sk that may go now.
  auto send_ready = [&]() -> size_t {
    if (sk == 0 || sk - 1 < rk) return chunk_bytes(send_chunk(sk));
    return sk - 1 == rk ? done : 0;
  };

  while (sk < steps || rk < steps) {
    bool progress = false;
    // Receive what has arrived for step rk.
    while (rk < steps) {
      const size_t total = chunk_bytes(recv_chunk(rk));
      if (got == total) {
        if (rk < n - 1) reduce_ready(true);
        ++rk;
        got = done = 0;
        progress = true;
        continue;
      }
      ssize_t r;
      if (rk < n - 1) {
        const size_t at = got % ring;
        // Never overrun bytes not reduced yet.
        const size_t room = std::min({ring - at, ring - (got - done), total - got});
        if (room == 0) {
          reduce_ready(true);
          continue;
        }
        r = Move(prev, false, scratch + at, room, "allreduce", &error);
      } else {
        const int k = buf.Iov(chunk_begin(recv_chunk(rk)) + got, std::min(total - got, kMaxIo), iov);
        r = Move(prev, false, iov, k, "allreduce", &error);
      }
      if (r < 0) return error;
      if (r == 0) break;
      got += static_cast<size_t>(r);
      if (rk < n - 1) {
        reduce_ready(false);
      } else {
        done = got;
      }
      progress = true;
    }
    // Send what may go: step 0 all of it, step sk > 0 what step sk - 1 has finished.
    while (sk < steps) {
      const size_t total = chunk_bytes(send_chunk(sk));
      if (sent == total) {
        ++sk;
        sent = 0;
        continue;
      }
      const size_t ready = send_ready();
      if (ready <= sent) break;
      const int k = buf.Iov(chunk_begin(send_chunk(sk)) + sent, std::min(ready - sent, kMaxIo), iov);
      ssize_t w = Move(next, true, iov, k, "allreduce", &error);
      if (w < 0) return error;
      if (w == 0) break;
      sent += static_cast<size_t>(w);
      progress = true;
    }
    if (sk >= steps && rk >= steps) break;
    if (progress) {
      last_progress = Clock::now();
      continue;
    }
    // Nothing moved: wait for the wire.
    std::vector<std::pair<int, short>> waits;
    if (rk < steps) waits.emplace_back(prev, POLLIN);
    if (sk < steps && send_ready() > sent) waits.emplace_back(next, POLLOUT);
    Status s = Wait(waits, last_progress, "allreduce");
    if (!s.ok()) return s;
  }
  return Status::OK();
}

}  // namespace spark_hvd
