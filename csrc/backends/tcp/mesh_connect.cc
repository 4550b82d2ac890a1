// TcpMesh set-up: listen, publish the address in the store, connect to the lower
// ranks, accept the higher ones, exchange hellos.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <sstream>

#include "backends/tcp/mesh.h"
#include "backends/tcp/socket.h"
#include "common/logging.h"

namespace spark_hvd {

using tcp::Clock;
using tcp::ConnectTo;
using tcp::FdCloser;
using tcp::Listen;
using tcp::ReadAll;
using tcp::SetIoTimeout;
using tcp::SetNoDelay;
using tcp::SetNonBlocking;
using tcp::WriteAll;

namespace {

constexpr uint32_t kHelloMagic = 0x73687664;  // "shvd"
constexpr size_t kTokenBytes = 32;            // hex characters

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

[[noreturn]] void Throw(Status s) { throw StatusError(std::move(s)); }

}  // namespace

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

}  // namespace spark_hvd
