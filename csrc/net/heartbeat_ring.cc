// Heartbeats (heartbeat.h), steps 1 and 5: set-up, and healing the ring past a lost
// successor by probing the next ranks.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <sstream>

#include "common/logging.h"
#include "common/traffic.h"
#include "common/types.h"
#include "net/heartbeat.h"
#include "net/heartbeat_wire.h"

namespace spark_hvd {

using namespace heartbeat;  // NOLINT: the heartbeats' own records and limits

std::string Heartbeats::Address(int32_t rank) {
  auto it = book_.find(rank);
  if (it != book_.end()) return it->second;
  // Past the book read at set-up: the next kBook ranks from here, in one request.
  std::vector<std::string> keys;
  std::vector<int32_t> which;
  for (int32_t k = 0; k < kBook && k < size_ - 1; ++k) {
    const int32_t r = (rank + k) % size_;
    if (r != rank_ && !book_.count(r)) {
      keys.push_back(std::to_string(r));
      which.push_back(r);
    }
  }
  try {
    std::vector<std::string> values = store_->MultiGet(keys, timeout_s_, false);
    for (size_t i = 0; i < which.size(); ++i) book_[which[i]] = values[i];
  } catch (const StatusError& e) {
    SHVD_LOG(kWarning, "heartbeat") << "rank " << rank_ << " could not read the address of rank "
                                    << rank << ": " << e.status().message();
    book_[rank] = "";  // unreadable: healing stops there
    return "";
  }
  return book_[rank];
}

// Step 1: the successor is probed as in healing, the predecessor accepted; both must
// be there by the start deadline.
void Heartbeats::SetUp(const LivenessOptions& options) {
  int port = 0;
  listener_ = net::Listen(options.bind_host, kBacklog, &port);
  token_ = net::RandomHex(net::kTokenBytes);
  desk_ = std::make_unique<net::HelloDesk>(rank_, size_, token_, kHelloTimeoutS, true);
  std::vector<std::string> keys;
  std::vector<int32_t> which;
  for (int32_t k = 1; k <= kBook && k < size_; ++k) {
    which.push_back((rank_ + k) % size_);
    keys.push_back(std::to_string(which.back()));
  }
  std::vector<std::string> values;
  try {
    values = store_->SetAndMultiGet(std::to_string(rank_),
                                    options.bind_host + " " + std::to_string(port) + " " + token_,
                                    keys, options.connect_timeout_s, true);
  } catch (const StatusError& e) {
    if (e.status().code() == StatusCode::kPeerLost && !e.status().ranks().empty()) {
      throw StatusError(LostDuringInit(
          "rank " + std::to_string(rank_) + " stopped setting up its heartbeats", e.status()));
    }
    if (e.status().code() != StatusCode::kTimeout) throw;
    std::vector<int32_t> late;
    for (size_t i : MissingKeys(store_.get(), keys)) late.push_back(which[i]);
    std::sort(late.begin(), late.end());
    throw StatusError(Status(
        StatusCode::kTimeout,
        "rank " + std::to_string(rank_) + " waited " + Seconds(options.connect_timeout_s) +
            " s (SPARK_HVD_START_TIMEOUT_S) to hear from rank" + (late.size() > 1 ? "s " : " ") +
            JoinRanks(late) + " in the rendezvous store (its heartbeat address): " +
            (late.size() > 1 ? "they" : "it") + " did not reach init in time",
        late));
  }
  for (size_t i = 0; i < which.size(); ++i) book_[which[i]] = values[i];

  const int32_t pred = (rank_ + size_ - 1) % size_;
  const int32_t succ = (rank_ + 1) % size_;
  const auto deadline = After(options.connect_timeout_s);
  Link s;  // the successor's connection, started again after a failure until the deadline
  auto retry_at = Clock::now();
  bool have_pred = false;
  std::vector<pollfd> pfds;
  auto lost_check = After(0.5);  // the service, asked every half second once a wait lasts
  while (!(s.ok && (have_pred || pred == succ))) {  // 2 ranks: one pair, either link
    const auto now = Clock::now();
    if (now >= deadline) {
      std::vector<int32_t> silent;
      if (!s.ok) silent.push_back(succ);
      if (!have_pred && pred != succ) silent.push_back(pred);
      std::sort(silent.begin(), silent.end());
      if (s.fd >= 0) ::close(s.fd);
      throw StatusError(Status(StatusCode::kTimeout,
                               "rank " + std::to_string(rank_) + " waited " +
                                   Seconds(options.connect_timeout_s) +
                                   " s (SPARK_HVD_START_TIMEOUT_S) for the heartbeat "
                                   "connections of ranks " +
                                   JoinRanks(silent),
                               silent));
    }
    if (options.lost_ranks && now >= lost_check) {
      lost_check = now + Duration(0.5);
      const std::vector<int32_t> lost = options.lost_ranks();
      if (!lost.empty()) {
        if (s.fd >= 0) ::close(s.fd);
        throw StatusError(Status::PeerLost("rank " + std::to_string(rank_) +
                                               " stopped setting up its heartbeats: the "
                                               "rendezvous service lost rank" +
                                               (lost.size() > 1 ? "s " : " ") + JoinRanks(lost),
                                           lost));
      }
    }
    if (!s.ok && s.failed) {
      ::close(s.fd);
      s = Link{};
      retry_at = now + Duration(0.02);
    }
    if (!s.ok && s.fd < 0 && now >= retry_at) {
      s.peer = succ;
      s.probe = true;
      std::string host, error, token;
      int p = 0;
      std::istringstream in(book_[succ]);
      in >> host >> p >> token;
      s.fd = net::StartConnect(host, p, &error);
      if (s.fd < 0) retry_at = now + Duration(0.02);
    }
    pfds.clear();
    auto wake = std::min(deadline, now + Duration(0.5));
    if (s.fd >= 0 && !s.ok) {
      const bool reading = s.connected && s.hello_sent >= sizeof(net::Hello);
      pfds.push_back(pollfd{s.fd, static_cast<short>(reading ? POLLIN : POLLOUT), 0});
    } else if (!s.ok) {
      wake = std::min(wake, retry_at);
    }
    const size_t first = pfds.size();
    desk_->AddPolls(listener_, &pfds, &wake);
    ::poll(pfds.data(), pfds.size(), net::MillisUntil(wake));
    if (first == 1 && pfds[0].revents != 0) AdvanceProbe(s);
    desk_->Handle(listener_, pfds, first);
    if (desk_->out_of_descriptors()) {
      if (s.fd >= 0) ::close(s.fd);
      throw StatusError(Status::InvalidArgument(
          "rank " + std::to_string(rank_) +
          " ran out of file descriptors accepting a heartbeat connection: " +
          net::DescriptorLimitAdvice(0)));
    }
    for (int peer : desk_->Ready()) {
      Link in;
      in.peer = peer;
      in.fd = desk_->Take(peer);
      in.last_heard = Clock::now();
      links_.push_back(std::move(in));
      have_pred = have_pred || peer == pred;
    }
  }
  s.probe = false;
  s.last_heard = Clock::now();
  links_.push_back(std::move(s));
  succ_ = succ;
  // A neighbour may still be in its set-up, which lasts until its own start deadline,
  // no later than this one's from now: silence until then is not a loss (step 3).
  const auto grace = After(options.connect_timeout_s + timeout_s_);
  for (Link& link : links_) {
    net::SetNoDelay(link.fd);
    link.grace = grace;
  }
}

Clock::time_point Heartbeats::SilentBy(const Link& l) const {
  return std::max(l.last_heard + Duration(timeout_s_), l.grace);
}

void Heartbeats::AdvanceProbe(Link& l) {
  if (!l.connected) {
    const int err = net::ConnectError(l.fd);
    if (err != 0) {
      l.failed = true;
      l.refused = err == ECONNREFUSED || err == ECONNRESET;
      Connections().failed.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    l.connected = true;
  }
  if (l.hello_sent < sizeof(net::Hello)) {
    std::string host, token;
    int port = 0;
    std::istringstream in(book_[l.peer]);
    in >> host >> port >> token;
    const net::Hello hello = net::MakeHello(rank_, token);
    const char* h = reinterpret_cast<const char*>(&hello);
    ssize_t w =
        ::send(l.fd, h + l.hello_sent, sizeof(hello) - l.hello_sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (w < 0) {
      l.failed = true;
      l.refused = true;
      return;
    }
    l.hello_sent += static_cast<size_t>(w);
    return;
  }
  char* a = reinterpret_cast<char*>(&l.ack);
  ssize_t r = ::recv(l.fd, a + l.ack_got, sizeof(l.ack) - l.ack_got, MSG_DONTWAIT);
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (r <= 0) {
    l.failed = true;
    l.refused = true;  // closed by its process: it refused us or is gone
    return;
  }
  l.ack_got += static_cast<size_t>(r);
  if (l.ack_got < sizeof(l.ack)) return;
  if (l.ack != static_cast<uint32_t>(l.peer)) {
    l.failed = true;
    l.refused = true;
    return;
  }
  l.ok = true;
  Connections().opened.fetch_add(1, std::memory_order_relaxed);
}

// The ranks the next probe batch would try whose address is not in the book.
std::vector<int32_t> Heartbeats::ProbeCandidates() const {
  std::vector<int32_t> unknown;
  for (const Link& l : links_) {
    if (l.probe) return unknown;  // a batch in flight
  }
  int counted = 0;
  for (int32_t k = 1; k < size_ && counted < kProbeBatch; ++k) {
    const int32_t r = (probed_up_to_ + k) % size_;
    if (r == rank_) break;
    if (ranks_[static_cast<size_t>(r)].state != kAlive) continue;
    ++counted;
    if (!book_.count(r)) unknown.push_back(r);
  }
  return unknown;
}

// Step 5: probes the next ranks after the lost successor, up to kProbeBatch at once.
void Heartbeats::Probe(const Clock::time_point& now) {
  for (const Link& l : links_) {
    if (l.probe) return;  // a batch in flight
  }
  int started = 0;
  for (int32_t k = 1; k < size_ && started < kProbeBatch; ++k) {
    const int32_t r = (probed_up_to_ + k) % size_;
    if (r == rank_) break;  // every other rank is lost or left
    if (ranks_[static_cast<size_t>(r)].state != kAlive) continue;
    auto known = book_.find(r);
    if (known == book_.end() || known->second.empty()) break;  // unreadable: stop healing
    const std::string& address = known->second;
    Link l;
    l.peer = r;
    l.probe = true;
    l.deadline = now + Duration(timeout_s_ / 3);
    l.last_heard = now;
    std::string host, error, token;
    int port = 0;
    std::istringstream in(address);
    in >> host >> port >> token;
    l.fd = net::StartConnect(host, port, &error);
    if (l.fd < 0) {
      l.failed = true;
      l.refused = true;
    }
    links_.push_back(std::move(l));
    ++started;
  }
  if (started == 0) probed_up_to_ = rank_;  // nothing left to heal towards
}

// Step 5, once every probe of the batch is settled: the nearest that answered is the
// successor, the others that answered get a goodbye, the ones that did not are lost.
void Heartbeats::SettleProbes() {
  bool any = false;
  for (const Link& l : links_) {
    if (!l.probe) continue;
    any = true;
    if (!l.ok && !l.failed) return;  // still in flight
  }
  if (!any) return;
  auto distance = [&](int32_t r) { return (r - rank_ + size_) % size_; };
  int32_t best = -1;
  for (const Link& l : links_) {
    if (l.probe && l.ok && (best < 0 || distance(l.peer) < distance(best))) best = l.peer;
  }
  std::vector<std::pair<int32_t, How>> lost;
  int32_t farthest = probed_up_to_;
  for (Link& l : links_) {
    if (!l.probe) continue;
    if (distance(l.peer) > distance(farthest)) farthest = l.peer;
    if (l.ok && l.peer == best) {
      l.probe = false;
      l.last_heard = Clock::now();
      net::SetNoDelay(l.fd);
      continue;
    }
    // Nearer than the successor found (or none found): lost. Farther: not needed.
    if (!l.ok && (best < 0 || distance(l.peer) < distance(best))) {
      lost.emplace_back(l.peer, l.refused ? kGone : kUnreachable);
    }
    CloseLink(l, l.ok);
  }
  if (best >= 0) {
    succ_ = best;
  } else {
    probed_up_to_ = farthest;  // the next batch starts past these
  }
  for (const auto& p : lost) Learn(p.first, kLost, p.second, -1, nullptr);
  if (best >= 0) {  // what the new successor may not know yet
    for (Link& l : links_) {
      if (l.peer != best || l.fd < 0) continue;
      for (int32_t r = 0; r < size_; ++r) {
        const Rank& x = ranks_[static_cast<size_t>(r)];
        if (x.state == kLost) Send(l, LostRecord(r, x.how, x.reporter < 0 ? rank_ : x.reporter));
      }
    }
  }
}

}  // namespace spark_hvd
