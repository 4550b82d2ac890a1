// Set-up of a shm communicator among `members` (job ranks, all on this host), under
// "<store_prefix>/shm/<name>" in the rendezvous store. Every member r runs:
//  1. Create its segment (segment.h: a memfd of mode 0600, sealed at its size) and
//     write its header. The segment has no name anywhere: until step 4 no other process
//     can reach it, and its memory goes when the last process that maps it does.
//  2. Listen on a Unix socket in the abstract namespace (no file; it goes with the
//     process) named "spark_hvd-shm-<32 random hex>", and publish "<name> <token>"
//     (another 32 random hex) under addr/<r>, in the request that reads step 3's
//     addresses (Store::SetAndMultiGet). Only holders of the job's secret read the
//     store. Anyone on the host may see the name (/proc/net/unix) and connect: the token
//     is what admits a connection.
//  3. Connect to every lower member p and send the tcp mesh's hello {magic, r, p's token}
//     (net/hello.h); accept the higher members through a net::HelloDesk, which admits a
//     connection only with this rank's token and acknowledges it; read each lower
//     member's acknowledgement. Stray, silent or wrong connections are dropped with a
//     warning and delay no one.
//  4. Over every admitted connection send a magic number with the segment's descriptor
//     (SCM_RIGHTS) and receive the peer's. Map each peer's segment (its size and seals
//     checked) and close every segment descriptor, this rank's too: the mappings keep
//     the memory, and no descriptor or name of a segment is left.
//  5. Close the listener. The connections stay open for the communicator's life: a
//     closed one is a lost peer (the kernel closes a killed process's).
// While waiting (steps 3 and 4), every kLostCheckS: a member the rendezvous service has
// lost fails the set-up with kPeerLost naming it. One deadline, connect_timeout_s.
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <sstream>

#include "backends/shm/group.h"
#include "common/logging.h"
#include "common/types.h"
#include "net/hello.h"
#include "net/socket.h"

namespace spark_hvd {
namespace shm {
namespace {

using net::After;
using net::Clock;
using net::Errno;

constexpr double kHelloTimeoutS = 5.0;  // per accepted connection, for its whole hello
constexpr double kLostCheckS = 0.5;
constexpr double kRetryS = 0.01;  // before connecting again to a busy or absent listener
constexpr uint64_t kNoteMagic = 0x65746f6e6d687373ULL;  // "sshmnote"

// What comes with a segment's descriptor.
struct Note {
  uint64_t magic;
};

[[noreturn]] void Throw(Status s) { throw StatusError(std::move(s)); }

std::string RandomHex() { return net::RandomHex(net::kTokenBytes); }

socklen_t AbstractAddress(const std::string& name, sockaddr_un* a) {
  std::memset(a, 0, sizeof(*a));
  a->sun_family = AF_UNIX;
  std::memcpy(a->sun_path + 1, name.data(), std::min(name.size(), sizeof(a->sun_path) - 1));
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

int UnixSocket() {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) Throw(Status::Internal("shm: socket(AF_UNIX): " + Errno(errno)));
  return fd;
}

using net::MillisUntil;

// A message of one Note with room for one descriptor (SCM_RIGHTS).
struct FdMessage {
  Note note{};
  iovec iov{&note, sizeof(note)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  FdMessage() {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
  }
  FdMessage(const FdMessage&) = delete;
  FdMessage& operator=(const FdMessage&) = delete;
};

class Setup {
 public:
  // prefix: this set-up's namespace in the store, under "<store_prefix>/shm/".
  Setup(const BackendOptions& o, const std::vector<int32_t>& members, const std::string& prefix,
        size_t slot_bytes)
      : o_(o),
        members_(members),
        rank_(static_cast<int>(std::lower_bound(members.begin(), members.end(), o.rank) -
                               members.begin())),
        size_(static_cast<int>(members.size())),
        store_(o.store_prefix + "/shm/" + prefix, o.store),
        slot_bytes_(slot_bytes),
        deadline_(After(o.connect_timeout_s)),
        socks_(static_cast<size_t>(size_), -1) {}

  ~Setup() {
    for (int fd : socks_) {
      if (fd >= 0) ::close(fd);
    }
  }

  // Every member's host key, by member: each publishes its own and reads the others'.
  std::vector<std::string> ExchangeHosts(const std::string& key) {
    std::vector<int> others;
    for (int p = 0; p < size_; ++p) {
      if (p != rank_) others.push_back(p);
    }
    std::vector<std::string> read = ReadKeys("host/", others, "the host", key);
    std::vector<std::string> keys(static_cast<size_t>(size_));
    keys[static_cast<size_t>(rank_)] = key;
    for (size_t i = 0; i < others.size(); ++i) keys[static_cast<size_t>(others[i])] = read[i];
    return keys;
  }

  std::unique_ptr<Group> Run() {
    std::vector<Mapping> maps(static_cast<size_t>(size_));
    net::FdCloser segment(CreateSegment(slot_bytes_, rank_, &maps[static_cast<size_t>(rank_)]));
    const std::string name = "spark_hvd-shm-" + RandomHex(), token = RandomHex();
    net::FdCloser listener(Listen(name));
    Connect(listener.get(), name, token);
    for (int p = 0; p < size_; ++p) {
      if (p != rank_) SendSegment(p, segment.get());
    }
    ReceiveSegments(&maps);
    SHVD_LOG(kDebug, "shm") << "rank " << rank_ << " of " << size_ << " mapped its peers' "
                            << "segments (slots of " << slot_bytes_ << " bytes)";
    auto group = std::make_unique<Group>(rank_, members_, std::move(maps), socks_, o_.timeout_s,
                                         o_.liveness);
    std::fill(socks_.begin(), socks_.end(), -1);  // the group owns them now
    return group;
  }

 private:
  int Listen(const std::string& name) {
    net::FdCloser fd(UnixSocket());
    sockaddr_un a;
    const socklen_t len = AbstractAddress(name, &a);
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), len) != 0 ||
        ::listen(fd.get(), 1024) != 0) {
      Throw(Status::Internal("shm: cannot listen on a Unix socket: " + Errno(errno)));
    }
    return fd.release();
  }

  // Step 3.
  void Connect(int listener, const std::string& name, const std::string& token) {
    struct Lower {
      std::string name, token;
      int got = 0;
      uint32_t ack = 0;
    };
    std::vector<Lower> lower(static_cast<size_t>(rank_));
    std::vector<int> below;
    for (int p = 0; p < rank_; ++p) below.push_back(p);
    const std::vector<std::string> addresses =
        ReadKeys("addr/", below, "the address", name + " " + token);
    for (int p = 0; p < rank_; ++p) {
      std::istringstream in(addresses[static_cast<size_t>(p)]);
      in >> lower[p].name >> lower[p].token;
      if (lower[p].token.size() != net::kTokenBytes) {
        Throw(Status::StoreError("shm: malformed address of rank " + std::to_string(members_[p]) +
                                 " in the store"));
      }
    }
    net::HelloDesk desk(rank_, size_, token, kHelloTimeoutS);
    auto acked = [&] {
      for (int p = 0; p < rank_; ++p) {
        if (lower[p].got < 4) return false;
      }
      return true;
    };
    while (!acked() || !desk.Missing().empty()) {
      CheckLost(false);
      if (Clock::now() >= deadline_) {
        std::vector<int> missing = desk.Missing();
        for (int p = 0; p < rank_; ++p) {
          if (lower[p].got < 4) missing.push_back(p);
        }
        ThrowTimeout("connections", missing);
      }
      Clock::time_point wake = std::min(deadline_, After(kLostCheckS));
      std::vector<pollfd> pfds;
      std::vector<int> owner;
      for (int p = 0; p < rank_; ++p) {
        if (socks_[p] < 0 && !StartConnect(p, lower[p].name, lower[p].token)) {
          wake = std::min(wake, After(kRetryS));
        }
        if (socks_[p] >= 0 && lower[p].got < 4) {
          pfds.push_back(pollfd{socks_[p], POLLIN, 0});
          owner.push_back(p);
        }
      }
      const size_t first_desk = pfds.size();
      desk.AddPolls(listener, &pfds, &wake);
      if (::poll(pfds.data(), pfds.size(), MillisUntil(wake)) < 0 && errno != EINTR) {
        Throw(Status::Internal("shm: poll: " + Errno(errno)));
      }
      for (size_t i = 0; i < first_desk; ++i) {
        if (pfds[i].revents == 0) continue;
        Lower& l = lower[owner[i]];
        ssize_t r = ::recv(socks_[owner[i]], reinterpret_cast<char*>(&l.ack) + l.got, 4 - l.got,
                           MSG_DONTWAIT);
        if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (r <= 0) Closed(owner[i], "before acknowledging its hello");
        l.got += static_cast<int>(r);
        if (l.got == 4 && l.ack != static_cast<uint32_t>(owner[i])) {
          Throw(Status::PeerLost("shm: the listener of rank " + std::to_string(members_[owner[i]]) +
                                 " acknowledged as rank " + std::to_string(l.ack)));
        }
      }
      desk.Handle(listener, pfds, first_desk);
    }
    for (int q = rank_ + 1; q < size_; ++q) socks_[q] = desk.Take(q);
  }

  // Connects to lower rank p and sends its hello; false when it is to be tried again.
  bool StartConnect(int p, const std::string& name, const std::string& token) {
    net::FdCloser fd(UnixSocket());
    sockaddr_un a;
    const socklen_t len = AbstractAddress(name, &a);
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), len) != 0) {
      // Busy (EAGAIN) or not listening: its set-up is late or over; lost checks decide.
      last_error_ = Errno(errno);
      return false;
    }
    const net::Hello hello = net::MakeHello(rank_, token);
    if (::send(fd.get(), &hello, sizeof(hello), MSG_NOSIGNAL | MSG_DONTWAIT) !=
        static_cast<ssize_t>(sizeof(hello))) {
      last_error_ = Errno(errno);
      return false;
    }
    socks_[p] = fd.release();
    return true;
  }

  // Members' values of `key_prefix`<p>, in one request (failing at once on a lost rank).
  // This rank's own value of `key_prefix` is published by the same request.
  std::vector<std::string> ReadKeys(const char* key_prefix, const std::vector<int>& ps,
                                    const char* what, const std::string& mine) {
    std::vector<std::string> keys;
    for (int p : ps) keys.push_back(key_prefix + std::to_string(p));
    const double left = std::chrono::duration<double>(deadline_ - Clock::now()).count();
    try {
      return store_.SetAndMultiGet(key_prefix + std::to_string(rank_), mine, keys,
                                   std::max(0.0, left), static_cast<bool>(o_.lost_ranks));
    } catch (const StatusError& e) {
      if (e.status().code() == StatusCode::kPeerLost && !e.status().ranks().empty()) {
        Throw(LostDuringInit("shm: rank " + std::to_string(o_.rank) + " stopped its set-up",
                             e.status()));
      }
      if (e.status().code() != StatusCode::kTimeout) throw;
      std::vector<int> late;
      for (size_t i : MissingKeys(&store_, keys)) late.push_back(ps[i]);
      ThrowTimeout(what, late);
    }
  }

  // Step 4: this rank's segment to peer p.
  void SendSegment(int p, int segment) {
    FdMessage m;
    m.note = Note{kNoteMagic};
    cmsghdr* c = CMSG_FIRSTHDR(&m.msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &segment, sizeof(int));
    if (::sendmsg(socks_[p], &m.msg, MSG_NOSIGNAL | MSG_DONTWAIT) !=
        static_cast<ssize_t>(sizeof(Note))) {
      if (errno == EPIPE || errno == ECONNRESET) Closed(p, "before taking this rank's segment");
      Throw(Status::Internal("shm: sending the segment to rank " + std::to_string(members_[p]) +
                             ": " + Errno(errno)));
    }
  }

  // Step 4: every peer's segment, mapped.
  void ReceiveSegments(std::vector<Mapping>* maps) {
    std::vector<bool> have(static_cast<size_t>(size_), false);
    have[rank_] = true;
    while (std::find(have.begin(), have.end(), false) != have.end()) {
      CheckLost(false);
      std::vector<int> missing;
      for (int p = 0; p < size_; ++p) {
        if (!have[p]) missing.push_back(p);
      }
      if (Clock::now() >= deadline_) ThrowTimeout("the segments", missing);
      std::vector<pollfd> pfds;
      std::vector<int> owner;
      for (int p = 0; p < size_; ++p) {
        if (have[p]) continue;
        pfds.push_back(pollfd{socks_[p], POLLIN, 0});
        owner.push_back(p);
      }
      const int ms = std::min(MillisUntil(deadline_), static_cast<int>(kLostCheckS * 1000));
      if (::poll(pfds.data(), pfds.size(), ms) < 0 && errno != EINTR) {
        Throw(Status::Internal("shm: poll: " + Errno(errno)));
      }
      for (size_t i = 0; i < pfds.size(); ++i) {
        if (pfds[i].revents == 0) continue;
        const int p = owner[i];
        const int fd = ReceiveFd(p);
        if (fd < 0) continue;
        net::FdCloser closer(fd);
        (*maps)[p] = MapSegment(fd, slot_bytes_, p);
        have[p] = true;
      }
    }
  }

  // The descriptor peer p sent, or -1 when nothing has arrived yet.
  int ReceiveFd(int p) {
    FdMessage m;
    const ssize_t r = ::recvmsg(socks_[p], &m.msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) return -1;
    if (r == 0) Closed(p, "before sending its segment");
    cmsghdr* c = CMSG_FIRSTHDR(&m.msg);
    int fd = -1;
    if (c != nullptr && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS &&
        c->cmsg_len == CMSG_LEN(sizeof(int))) {
      std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
    }
    if (r != static_cast<ssize_t>(sizeof(Note)) || m.note.magic != kNoteMagic || fd < 0 ||
        (m.msg.msg_flags & MSG_CTRUNC)) {
      if (fd >= 0) ::close(fd);
      Throw(Status::Internal("shm: rank " + std::to_string(members_[p]) +
                             " sent no valid segment (" + std::to_string(r) + " bytes" +
                             (r < 0 ? ": " + Errno(errno) : std::string()) + ")"));
    }
    return fd;
  }

  [[noreturn]] void Closed(int p, const char* when) {
    CheckLost(true);
    Throw(Status::PeerLost("shm: rank " + std::to_string(members_[p]) +
                               " closed its connection to rank " + std::to_string(o_.rank) + " " +
                               when + ": it exited, or refused this rank (see its log)",
                           {members_[p]}));
  }

  void CheckLost(bool now) {
    if (!o_.lost_ranks || (!now && Clock::now() < next_lost_check_)) return;
    next_lost_check_ = After(kLostCheckS);
    std::vector<int32_t> lost;
    for (int32_t r : o_.lost_ranks()) {
      if (std::binary_search(members_.begin(), members_.end(), r)) lost.push_back(r);
    }
    if (lost.empty()) return;
    Throw(Status::PeerLost("rank " + std::to_string(o_.rank) + " stopped connecting its shm " +
                               "peers: the rendezvous service lost rank" +
                               (lost.size() > 1 ? "s " : " ") + JoinRanks(lost) +
                               " during init (the process exited)",
                           lost));
  }

  // members: the member ranks waited for.
  [[noreturn]] void ThrowTimeout(const std::string& what, std::vector<int> members) {
    std::ostringstream os;
    os << "shm: rank " << o_.rank << " waited " << o_.connect_timeout_s
       << " s (SPARK_HVD_START_TIMEOUT_S) for " << what;
    if (!members.empty()) {
      std::sort(members.begin(), members.end());
      std::vector<int32_t> ranks;
      for (int m : members) ranks.push_back(members_[m]);
      os << " of rank(s) " << JoinRanks(ranks, ", ");
    }
    if (!last_error_.empty()) os << " (last connection error: " << last_error_ << ")";
    Throw(Status::Timeout(os.str()));
  }

  const BackendOptions& o_;
  const std::vector<int32_t>& members_;
  int rank_;
  int size_;
  PrefixStore store_;
  size_t slot_bytes_;
  Clock::time_point deadline_;
  Clock::time_point next_lost_check_ = After(kLostCheckS);  // reads fail at once on a loss
  std::vector<int> socks_;                                  // by member; -1 for this rank
  std::string last_error_;
};

}  // namespace

std::unique_ptr<Group> ConnectGroup(const BackendOptions& options,
                                    const std::vector<int32_t>& members, const std::string& name,
                                    size_t slot_bytes) {
  return Setup(options, members, name, slot_bytes).Run();
}

std::vector<std::string> ExchangeHostKeys(const BackendOptions& options, const std::string& key) {
  std::vector<int32_t> all(static_cast<size_t>(options.size));
  for (int32_t r = 0; r < options.size; ++r) all[static_cast<size_t>(r)] = r;
  return Setup(options, all, "hosts", 0).ExchangeHosts(key);
}

}  // namespace shm
}  // namespace spark_hvd
