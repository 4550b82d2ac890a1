// The fake NCCL's coordinator: one per ncclGetUniqueId, a thread of the process that
// called it, listening on 127.0.0.1. Every rank of the communicator keeps one
// connection to it; it matches the ranks' calls and computes every result.
//
// Protocol (fake_nccl_wire.h has the message layouts)
// 1. A rank connects and sends kJoin {nonce, nranks, rank, device, physical device,
//    pid, host}. A wrong nonce, an nranks that differs from the first joiner's, a rank
//    out of range or taken, or (once all joined) two ranks on one host with one
//    physical device ("Duplicate GPU detected") fails the init: every joined rank and
//    any later joiner get kJoined{error}. Otherwise, once nranks joined, each gets
//    kJoined{ok, home rank} (the home rank lives in this process, -1 if none).
// 2. A rank sends kOps {unit, ops[]} when its stream reaches a call or group. Each op
//    is a slot keyed by its sequence number: collectives by their index among the
//    rank's collectives; send/recv by (sender, receiver, index among that pair's).
//    When a collective has all nranks contributions, or a send its recv, the
//    descriptors are compared (kind, count, dtype, op, root; counts and dtypes of the
//    pair); if they agree every participant gets kResult {unit, op index, data},
//    results for the home rank last, so that the home process, once it has its last
//    result, has already handed everyone else theirs (it may exit at once).
// 3. A disagreement fails the communicator: kFail{ncclInvalidUsage, both calls} to
//    every rank, an error kResult for every waiting op, now and later.
// 4. kBye (ncclCommDestroy): the rank is gone; the others get kDeparted{rank}, it gets
//    kByeAck. kAbort (ncclCommAbort): the same, without the ack. An op that still
//    needs a departed rank fails the communicator (3) (as ncclRemoteError if it
//    aborted).
// 5. A connection that closes without kBye/kAbort is a dead peer: kFail{ncclRemoteError}
//    to the others, and nothing is answered any more (queued and running ops block,
//    as kernels spinning on a dead peer do, until each rank aborts).
// 6. When every joined rank has closed its connection, the coordinator closes its
//    listening socket and its threads end.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <tuple>

#include "fake_nccl_wire.h"

namespace shvd_fake {
namespace {

struct Peer {
  int fd = -1;
  int rank = -1;
  int physical = -1;
  int pid = 0;
  std::string host;
  bool joined = false;
  bool gone = false;  // destroyed, aborted or lost
  bool aborted = false;
  std::string Name() const {
    return "rank " + std::to_string(rank) + " (pid " + std::to_string(pid) + " on " + host + ")";
  }
};

struct Contribution {
  bool present = false;
  std::shared_ptr<Peer> peer;
  uint64_t unit = 0;
  uint32_t index = 0;
  OpDesc desc;
  std::string data;
};

class Coordinator : public std::enable_shared_from_this<Coordinator> {
 public:
  Coordinator(int listen_fd, uint64_t nonce) : listen_fd_(listen_fd), nonce_(nonce) {}

  void AcceptLoop() {
    for (;;) {
      int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        break;  // shut down (step 6)
      }
      SetNoDelay(fd);
      auto self = shared_from_this();
      std::thread([self, fd] { self->Serve(fd); }).detach();
    }
    ::close(listen_fd_);
  }

 private:
  using P2PKey = std::tuple<int, int, uint64_t>;  // sender, receiver, index

  void Serve(int fd) {
    auto peer = std::make_shared<Peer>();
    peer->fd = fd;
    MsgType type;
    std::string payload;
    bool bye = false;
    while (!bye && RecvFrame(fd, &type, &payload)) {
      std::lock_guard<std::mutex> lock(mu_);
      switch (type) {
        case kJoin:
          OnJoin(peer, payload);
          break;
        case kOps:
          if (peer->joined && state_ == kRunning) OnOps(peer, payload);
          break;
        case kBye:
        case kAbort:
          OnDeparted(peer, type == kAbort);
          bye = type == kAbort;
          break;
        default:
          break;
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (peer->joined && !peer->gone) OnLost(peer);
    ::shutdown(fd, SHUT_RDWR);
    ::close(fd);
    peer->fd = -1;
    if (peer->joined && --open_ == 0 && state_ != kForming) ::shutdown(listen_fd_, SHUT_RDWR);
  }

  // Everything below runs under mu_.
  // The joined ranks, the home process's last (see step 2).
  std::vector<std::shared_ptr<Peer>> HomeLast() const {
    std::vector<std::shared_ptr<Peer>> peers;
    for (const auto& p : by_rank_)
      if (p) peers.push_back(p);
    std::stable_partition(peers.begin(), peers.end(),
                          [](const auto& p) { return p->pid != int(::getpid()); });
    return peers;
  }

  void Send(const std::shared_ptr<Peer>& p, MsgType type, const Writer& w) {
    if (p->fd >= 0 && !(p->gone && type != kByeAck)) SendFrame(p->fd, type, w.data());
  }

  void OnJoin(const std::shared_ptr<Peer>& peer, const std::string& payload) {
    Reader r(payload);
    uint64_t nonce = r.Get<uint64_t>();
    int nranks = r.Get<int32_t>(), rank = r.Get<int32_t>();
    r.Get<int32_t>();  // the device index: the physical one is what counts
    peer->physical = r.Get<int32_t>();
    peer->pid = r.Get<int32_t>();
    peer->host = r.Str();
    peer->rank = rank;
    if (!r.ok() || nonce != nonce_ || peer->joined) {
      Send(
          peer, kJoined,
          Writer()
              .Put<int32_t>(ncclInvalidArgument)
              .Put<int32_t>(-1)
              .Str("the ncclUniqueId does not belong to this coordinator (corrupt, or from another "
                   "ncclGetUniqueId)"));
      return;
    }
    if (state_ != kForming) {
      Send(peer, kJoined,
           Writer()
               .Put<int32_t>(init_error_)
               .Put<int32_t>(-1)
               .Str(state_ == kFailed
                        ? init_message_
                        : "this ncclUniqueId was already used by a complete communicator "
                          "of " +
                              std::to_string(nranks_) + " ranks"));
      return;
    }
    peer->joined = true;
    ++open_;
    members_.push_back(peer);
    if (nranks_ == 0) {
      nranks_ = nranks;
      by_rank_.resize(nranks_);
    }
    if (nranks != nranks_) {
      return FailInit(ncclInvalidUsage,
                      peer->Name() +
                          " called ncclCommInitRank with nranks=" + std::to_string(nranks) +
                          " but an earlier rank with nranks=" + std::to_string(nranks_));
    }
    if (rank < 0 || rank >= nranks_ || by_rank_[rank]) {
      return FailInit(ncclInvalidUsage,
                      peer->Name() + " joined as rank " + std::to_string(rank) +
                          (rank >= 0 && rank < nranks_
                               ? ", which " + by_rank_[rank]->Name() + " already took"
                               : ", out of range for nranks=" + std::to_string(nranks_)));
    }
    by_rank_[rank] = peer;
    if (++joined_ < nranks_) return;
    for (int a = 0; a < nranks_; ++a) {
      for (int b = a + 1; b < nranks_; ++b) {
        if (by_rank_[a]->host == by_rank_[b]->host &&
            by_rank_[a]->physical == by_rank_[b]->physical) {
          return FailInit(ncclInvalidUsage,
                          "Duplicate GPU detected : rank " + std::to_string(a) + " and rank " +
                              std::to_string(b) + " both on CUDA device " +
                              std::to_string(by_rank_[a]->physical) + " of host " +
                              by_rank_[a]->host + " (give each rank its own device)");
        }
      }
    }
    state_ = kRunning;
    int home = -1;
    for (int r2 = 0; r2 < nranks_; ++r2)
      if (by_rank_[r2]->pid == int(::getpid()) && home < 0) home = r2;
    for (auto& p : HomeLast())
      Send(p, kJoined, Writer().Put<int32_t>(ncclSuccess).Put<int32_t>(home).Str(std::string()));
  }

  void FailInit(ncclResult_t code, const std::string& message) {
    state_ = kFailed;
    init_error_ = code;
    init_message_ = message;
    for (auto& p : members_)
      Send(p, kJoined, Writer().Put<int32_t>(code).Put<int32_t>(-1).Str(message));
  }

  void OnOps(const std::shared_ptr<Peer>& peer, const std::string& payload) {
    Reader r(payload);
    uint64_t unit = r.Get<uint64_t>();
    uint32_t n = r.Get<uint32_t>();
    for (uint32_t i = 0; i < n && r.ok(); ++i) {
      Contribution c;
      c.present = true;
      c.peer = peer;
      c.unit = unit;
      c.index = i;
      c.desc = r.Desc();
      c.data = r.Str();
      if (!r.ok()) break;
      if (error_ == ncclRemoteError) continue;  // (5): never answered
      if (error_ != ncclSuccess) {
        Reply(c, error_, std::string());
        continue;
      }
      Add(std::move(c));
    }
  }

  void Add(Contribution c) {
    const OpDesc& d = c.desc;
    const int me = c.peer->rank;
    if (d.kind == kSend || d.kind == kRecv) {
      P2PKey key = d.kind == kSend ? P2PKey(me, d.peer, d.seq) : P2PKey(d.peer, me, d.seq);
      auto& slot = p2p_[key];
      (d.kind == kSend ? slot.first : slot.second) = std::move(c);
      if (slot.first.present && slot.second.present) CompletePair(key);
    } else {
      auto& slot = colls_[d.seq];
      slot.resize(nranks_);
      slot[me] = std::move(c);
      if (std::all_of(slot.begin(), slot.end(), [](const Contribution& x) { return x.present; }))
        CompleteCollective(d.seq);
    }
    CheckDeparted();
  }

  void CompletePair(const P2PKey& key) {
    auto node = p2p_.extract(key);
    Contribution& send = node.mapped().first;
    Contribution& recv = node.mapped().second;
    if (send.desc.count != recv.desc.count || send.desc.dtype != recv.desc.dtype) {
      Fail(ncclInvalidUsage,
           "send #" + std::to_string(std::get<2>(key)) + " from rank " +
               std::to_string(std::get<0>(key)) + " to rank " + std::to_string(std::get<1>(key)) +
               ": rank " + std::to_string(std::get<0>(key)) + " called " + Describe(send.desc) +
               " but rank " + std::to_string(std::get<1>(key)) + " called " + Describe(recv.desc),
           {&send, &recv});
      return;
    }
    std::vector<std::pair<Contribution*, std::string>> results = {{&send, std::string()},
                                                                  {&recv, send.data}};
    Deliver(&results);
  }

  void CompleteCollective(uint64_t seq) {
    auto node = colls_.extract(seq);
    std::vector<Contribution>& all = node.mapped();
    const OpDesc& d0 = all[0].desc;
    for (int r = 1; r < nranks_; ++r) {
      const OpDesc& d = all[r].desc;
      bool reduces = d.kind == kAllReduce || d.kind == kReduceScatter;
      if (d.kind != d0.kind || d.count != d0.count || d.dtype != d0.dtype ||
          (reduces && d.red != d0.red) || (d.kind == kBroadcast && d.peer != d0.peer)) {
        Fail(ncclInvalidUsage,
             "collective #" + std::to_string(seq) +
                 " does not match: rank 0 "
                 "called " +
                 Describe(d0) + " but rank " + std::to_string(r) + " called " + Describe(d),
             Pointers(&all));
        return;
      }
    }
    const size_t bytes = d0.count * DtypeSize(d0.dtype);
    for (int r = 0; r < nranks_; ++r) {
      size_t want = d0.kind == kReduceScatter               ? bytes * nranks_
                    : d0.kind == kBroadcast && r != d0.peer ? 0
                                                            : bytes;
      if (all[r].data.size() != want) {
        Fail(ncclInternalError,
             "fake NCCL: rank " + std::to_string(r) + " sent " +
                 std::to_string(all[r].data.size()) + " bytes for " + Describe(d0),
             Pointers(&all));
        return;
      }
    }
    std::vector<std::pair<Contribution*, std::string>> results;
    if (d0.kind == kBroadcast) {
      for (auto& c : all) results.emplace_back(&c, all[d0.peer].data);
    } else if (d0.kind == kAllGather) {
      std::string out;
      for (auto& c : all) out += c.data;
      for (auto& c : all) results.emplace_back(&c, out);
    } else {
      std::vector<const char*> inputs;
      std::vector<uint64_t> scalars;
      for (auto& c : all) {
        inputs.push_back(c.data.data());
        scalars.push_back(c.desc.scalar);
      }
      OpDesc whole = d0;
      if (d0.kind == kReduceScatter) whole.count *= nranks_;
      std::string out = Reduce(whole, inputs, scalars);
      for (int r = 0; r < nranks_; ++r)
        results.emplace_back(&all[r], d0.kind == kAllReduce ? out : out.substr(r * bytes, bytes));
    }
    Deliver(&results);
  }

  static std::vector<Contribution*> Pointers(std::vector<Contribution>* all) {
    std::vector<Contribution*> out;
    for (auto& c : *all) out.push_back(&c);
    return out;
  }

  // Sends each result, the home process's last (see step 2).
  void Deliver(std::vector<std::pair<Contribution*, std::string>>* results) {
    std::stable_partition(results->begin(), results->end(),
                          [](const auto& x) { return x.first->peer->pid != int(::getpid()); });
    for (auto& x : *results) Reply(*x.first, ncclSuccess, x.second);
  }

  void Reply(const Contribution& c, ncclResult_t status, const std::string& data) {
    Send(c.peer, kResult,
         Writer().Put<uint64_t>(c.unit).Put<uint32_t>(c.index).Put<int32_t>(status).Str(data));
  }

  // Fails the communicator (step 3 or 5); `involved` are contributions already taken
  // out of the slots.
  void Fail(ncclResult_t code, const std::string& message,
            const std::vector<Contribution*>& involved) {
    if (error_ == ncclSuccess) {
      error_ = code;
      for (auto& p : HomeLast()) Send(p, kFail, Writer().Put<int32_t>(code).Str(message));
    }
    if (error_ == ncclRemoteError) return;
    for (auto* c : involved) Reply(*c, error_, std::string());
    for (auto& kv : colls_)
      for (auto& c : kv.second)
        if (c.present) Reply(c, error_, std::string());
    for (auto& kv : p2p_)
      for (auto* c : {&kv.second.first, &kv.second.second})
        if (c->present) Reply(*c, error_, std::string());
    colls_.clear();
    p2p_.clear();
  }

  // An op waiting for a rank that left can never complete (step 4).
  void CheckDeparted() {
    if (error_ != ncclSuccess) return;
    auto check = [&](int rank, const std::string& what) {
      const auto& p = by_rank_[rank];
      if (!p->gone) return false;
      Fail(p->aborted ? ncclRemoteError : ncclInvalidUsage,
           p->Name() + (p->aborted ? " aborted" : " destroyed") +
               " its communicator before "
               "taking part in " +
               what +
               " (every rank must issue the same collectives, and "
               "match every send with a recv)",
           {});
      return true;
    };
    for (auto& kv : colls_) {
      const Contribution& have = *std::find_if(kv.second.begin(), kv.second.end(),
                                               [](const Contribution& c) { return c.present; });
      for (int r = 0; r < nranks_; ++r)
        if (!kv.second[r].present &&
            check(r, "collective #" + std::to_string(kv.first) + ", " + Describe(have.desc)))
          return;
    }
    for (auto& kv : p2p_) {
      const Contribution& have = kv.second.first.present ? kv.second.first : kv.second.second;
      int missing = kv.second.first.present ? std::get<1>(kv.first) : std::get<0>(kv.first);
      if (check(missing, "the pair of " + have.peer->Name() + "'s " + Describe(have.desc))) return;
    }
  }

  void OnDeparted(const std::shared_ptr<Peer>& peer, bool aborted) {
    if (!peer->joined || peer->gone) return;
    peer->gone = true;
    peer->aborted = aborted;
    for (auto& p : HomeLast())
      Send(p, kDeparted, Writer().Put<int32_t>(peer->rank).Put<uint8_t>(aborted));
    if (!aborted) Send(peer, kByeAck, Writer());
    if (state_ == kRunning) CheckDeparted();
  }

  void OnLost(const std::shared_ptr<Peer>& peer) {
    peer->gone = true;
    if (state_ == kForming) {
      FailInit(ncclRemoteError, peer->Name() +
                                    " closed its connection before all ranks joined "
                                    "(its process died?)");
      return;
    }
    if (state_ == kRunning)
      Fail(ncclRemoteError,
           peer->Name() +
               " is lost: its connection closed without "
               "ncclCommDestroy or ncclCommAbort (its process died?)",
           {});
  }

  enum State { kForming, kRunning, kFailed };

  const int listen_fd_;
  const uint64_t nonce_;
  std::mutex mu_;
  State state_ = kForming;
  ncclResult_t init_error_ = ncclSuccess;
  std::string init_message_;
  int nranks_ = 0;
  int joined_ = 0;
  int open_ = 0;                                // joined connections not closed yet
  std::vector<std::shared_ptr<Peer>> members_;  // every connection that sent a valid kJoin
  std::vector<std::shared_ptr<Peer>> by_rank_;
  ncclResult_t error_ = ncclSuccess;
  std::map<uint64_t, std::vector<Contribution>> colls_;
  std::map<P2PKey, std::pair<Contribution, Contribution>> p2p_;  // send, recv
};

}  // namespace

bool StartCoordinator(uint16_t* port, uint64_t* nonce) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;  // ephemeral
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) < 0 || ::listen(fd, 128) < 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) < 0) {
    ::close(fd);
    return false;
  }
  *port = ntohs(addr.sin_port);
  std::random_device rd;
  *nonce = (uint64_t(rd()) << 32) ^ rd();
  auto coordinator = std::make_shared<Coordinator>(fd, *nonce);
  std::thread([coordinator] { coordinator->AcceptLoop(); }).detach();
  return true;
}

}  // namespace shvd_fake
