// Group: the members of one shm communicator as one rank sees them: every member's
// mapped segment (segment.h) and a connected Unix socket to each peer, whose closing
// says the peer is gone (the kernel closes a killed process's), and where the kernel
// allows, a pidfd of each peer's process, which says so even when a child the peer forked
// (a data loader) still holds its end of the socket. Internal to shm/.
//
// Synchronisation is two counters per member, `started` and `reduced` (segment.h),
// each written by its owner only, in rounds numbered alike on every member:
//   Post(c, g)  stores g into this rank's counter c (release: the slot data written
//               before it is visible with it) and rings the bell of every peer that
//               sleeps (FUTEX_WAKE on a word of the peer's segment).
//   Wait(c, g)  returns once the peers' counters c reached g: it spins for up to
//               kSpinUs (common/spin.h; a peer in step arrives within microseconds), then sleeps on
//               this rank's bell (FUTEX_WAIT), waking at least every kLiveCheckS to
//               check that every peer's socket is still open.
// A sleeper sets `sleeping` before reading its bell and the counters; a poster stores
// its counter before reading `sleeping` (both sequentially consistent), so either the
// sleeper sees the counter or the poster sees the sleeper and rings: no lost wake-up.
//
// Failures: a closed peer socket is kPeerLost naming every peer whose socket is closed
// by then (job ranks); a wait past timeout_s is kTimeout naming the peers not there.
// After either the group is broken: every later call returns that first error, and the
// rank's header says so (Header::failed, with the code and the ranks blamed), so that a
// peer seeing its connection close next reports that failure rather than this rank.
#pragma once

#include <poll.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/shm/segment.h"
#include "common/status.h"

namespace spark_hvd {
namespace shm {

enum class Counter { kStarted, kReduced };

class Group {
 public:
  // maps[r]: member r's segment (this rank's included); socks[r]: the connection to
  // peer r (-1 for this rank), owned from now on; job_ranks[r]: its rank in the job.
  // liveness: the job's heartbeats (net/liveness.h), or null; a wait stops when
  // they lose a peer.
  Group(int rank, std::vector<int32_t> job_ranks, std::vector<Mapping> maps, std::vector<int> socks,
        double timeout_s, PeerLiveness* liveness);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(maps_.size()); }
  // Member r's slot for round g.
  char* slot(int r, uint64_t g) const { return maps_[static_cast<size_t>(r)].slot(g); }
  size_t slot_bytes() const { return maps_[static_cast<size_t>(rank_)].slot_bytes(); }
  const Status& broken() const { return broken_; }

  // Starts the next round: waits until every peer has started the previous one (so none
  // still reads this rank's slot for this round's parity), then returns the round's
  // number; the caller fills its slot, then posts kStarted.
  Status Next(const char* what, uint64_t* round);
  void Post(Counter c, uint64_t round);
  // Waits until every peer (or only `peer`, when >= 0) has posted c >= round.
  Status Wait(Counter c, uint64_t round, const char* what, int peer = -1);

 private:
  uint64_t Load(int r, Counter c) const;
  bool Reached(Counter c, uint64_t round, int peer) const;
  Status CheckPeers(const char* what);
  int rank_of(int32_t job_rank) const;  // its member rank
  Status Fail(Status s);

  int rank_;
  std::vector<int32_t> job_ranks_;
  std::vector<Mapping> maps_;
  std::vector<int> socks_;
  std::vector<int> pidfds_;  // by member; -1 where none (this rank, no pidfd_open)
  double timeout_s_;
  PeerLiveness* liveness_;
  uint64_t round_ = 0;     // the last round this rank started
  uint64_t all_seen_ = 0;  // every peer is known to have started this round
  Status broken_;
  // CheckPeers' poll set (each peer's socket and pidfd, then the heartbeats' fd) and the
  // peers it polls, kept: a long wait checks every kLiveCheckS without allocating.
  std::vector<pollfd> pfds_;
  std::vector<int> peers_;
};

// The set-up (connect.cc): this rank's segment made, every member's mapped, a
// connection to each peer, through "<store_prefix>/shm/<name>" in the store (a name
// unique to the group). Collective over `members` (job ranks, sorted, all on this host,
// options.rank among them). Throws StatusError.
std::unique_ptr<Group> ConnectGroup(const BackendOptions& options,
                                    const std::vector<int32_t>& members, const std::string& name,
                                    size_t slot_bytes);
// Every job rank's host key (HostKey, communicator.h), by rank: each rank publishes its
// own under "<store_prefix>/shm/hosts" and reads the others'. Collective over the job.
std::vector<std::string> ExchangeHostKeys(const BackendOptions& options, const std::string& key);

}  // namespace shm
}  // namespace spark_hvd
