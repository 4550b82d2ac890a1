#include "backends/shm/communicator.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>

#include "backends/members.h"
#include "backends/shm/group.h"
#include "backends/shm/hierarchical.h"
#include "common/env.h"
#include "common/logging.h"

namespace spark_hvd {
namespace {

size_t SlotBytes() {
  const int64_t bytes = env::ShmSlotBytes();
  if (bytes < 4096) {
    throw StatusError(Status::InvalidArgument(
        "SPARK_HVD_SHM_SLOT_BYTES=" + std::to_string(bytes) +
        " is below the smallest slot, 4096 bytes: set it to at least 4096 (default 1 MiB)"));
  }
  return static_cast<size_t>(bytes);
}

std::string FirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

}  // namespace

std::string ShmHostKey(const std::string& host) {
  char name[256] = {};
  std::string h = host;
  if (h.empty() && ::gethostname(name, sizeof(name) - 1) == 0) h = name;
  char ns[128] = {};
  const ssize_t n = ::readlink("/proc/self/ns/net", ns, sizeof(ns) - 1);
  return h + "|" + FirstLine("/proc/sys/kernel/random/boot_id") + "|" +
         (n > 0 ? std::string(ns, static_cast<size_t>(n)) : std::string("?"));
}

ShmCommunicator::ShmCommunicator(const BackendOptions& options, std::vector<int32_t> members,
                                 HostKeys hosts, const std::string& group)
    : options_(options),
      members_(std::move(members)),
      rank_(MemberRank(members_, options.rank)),
      hosts_(std::move(hosts)) {
  if (members_.size() > 1) group_ = shm::ConnectGroup(options_, members_, group, SlotBytes());
  SHVD_LOG(kDebug, "shm") << "rank " << rank_ << " of " << members_.size() << " connected ("
                          << group << ")";
}

ShmCommunicator::~ShmCommunicator() = default;

std::unique_ptr<Communicator> ConnectShmAll(const BackendOptions& options) {
  const std::string key = ShmHostKey(options.host);
  std::vector<std::string> keys{key};
  if (options.size > 1) {
    if (!options.store) {
      throw StatusError(Status::InvalidArgument(
          "more than one rank needs a rendezvous store: launch with spark-hvdrun or "
          "spark_hvd.spark.run (SPARK_HVD_RENDEZVOUS_ADDR/PORT are not set)"));
    }
    keys = shm::ExchangeHostKeys(options, key);
  }
  return ConnectShmSet(options, AllRanks(options.size),
                       std::make_shared<const std::vector<std::string>>(std::move(keys)), 0);
}

std::unique_ptr<Communicator> ShmCommunicator::Split(const std::vector<int32_t>& ranks,
                                                     int32_t set_id) {
  if (!std::binary_search(ranks.begin(), ranks.end(), rank_)) return nullptr;
  return ConnectShmSet(options_, SplitMembers(members_, ranks), hosts_, set_id);
}

Status ShmCommunicator::Barrier() {
  if (!group_) return Status::OK();
  uint64_t g;
  Status s = group_->Next("barrier", &g);
  if (!s.ok()) return s;
  group_->Post(shm::Counter::kStarted, g);
  return group_->Wait(shm::Counter::kStarted, g, "barrier");
}

Status ShmCommunicator::Broadcast(void* buf, int64_t bytes, int root) {
  if (!group_) return Status::OK();
  char* data = static_cast<char*>(buf);
  const size_t slot = group_->slot_bytes();
  for (size_t a = 0; a < static_cast<size_t>(bytes); a += slot) {
    const size_t len = std::min(slot, static_cast<size_t>(bytes) - a);
    uint64_t g;
    Status s = group_->Next("broadcast", &g);
    if (!s.ok()) return s;
    if (rank_ == root) std::memcpy(group_->slot(rank_, g), data + a, len);
    group_->Post(shm::Counter::kStarted, g);
    if (rank_ == root) continue;
    s = group_->Wait(shm::Counter::kStarted, g, "broadcast", root);
    if (!s.ok()) return s;
    std::memcpy(data + a, group_->slot(root, g), len);
  }
  return Status::OK();
}

Status ShmCommunicator::Allgatherv(const void* in, void* out,
                                   const std::vector<int64_t>& bytes_per_rank) {
  return Gather(in, out, bytes_per_rank, "allgather");
}

Status ShmCommunicator::Gather(const void* in, void* out,
                               const std::vector<int64_t>& bytes_per_rank, const char* what) {
  const size_t n = bytes_per_rank.size();
  std::vector<size_t>& offset = offset_;
  offset.assign(n + 1, 0);
  for (size_t r = 0; r < n; ++r) offset[r + 1] = offset[r] + static_cast<size_t>(bytes_per_rank[r]);
  char* dst = static_cast<char*>(out);
  const size_t mine = static_cast<size_t>(bytes_per_rank[static_cast<size_t>(rank_)]);
  const char* src = static_cast<const char*>(in);
  if (mine > 0 && dst + offset[rank_] != src) std::memmove(dst + offset[rank_], src, mine);
  if (!group_) return Status::OK();
  const size_t most =
      static_cast<size_t>(*std::max_element(bytes_per_rank.begin(), bytes_per_rank.end()));
  const size_t slot = group_->slot_bytes();
  for (size_t a = 0; a < most; a += slot) {
    uint64_t g;
    Status s = group_->Next(what, &g);
    if (!s.ok()) return s;
    if (a < mine)
      std::memcpy(group_->slot(rank_, g), dst + offset[rank_] + a, std::min(slot, mine - a));
    group_->Post(shm::Counter::kStarted, g);
    s = group_->Wait(shm::Counter::kStarted, g, what);
    if (!s.ok()) return s;
    for (size_t r = 0; r < n; ++r) {
      const size_t theirs = static_cast<size_t>(bytes_per_rank[r]);
      if (static_cast<int>(r) == rank_ || a >= theirs) continue;
      std::memcpy(dst + offset[r] + a, group_->slot(static_cast<int>(r), g),
                  std::min(slot, theirs - a));
    }
  }
  return Status::OK();
}

Status ShmCommunicator::AllgatherFixed(const void* in, void* out, int64_t bytes) {
  // The engine's per-cycle exchange (and alltoall's sizes).
  fixed_bytes_.assign(members_.size(), bytes);
  return Gather(in, out, fixed_bytes_, "exchange");
}

Status ShmCommunicator::Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                                  const std::vector<int64_t>& recv_bytes) {
  const size_t n = send_bytes.size();
  std::vector<size_t>&soff = soff_, &roff = roff_;
  soff.assign(n + 1, 0);
  roff.assign(n + 1, 0);
  for (size_t r = 0; r < n; ++r) {
    soff[r + 1] = soff[r] + static_cast<size_t>(send_bytes[r]);
    roff[r + 1] = roff[r] + static_cast<size_t>(recv_bytes[r]);
  }
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  const size_t me = static_cast<size_t>(rank_);
  if (send_bytes[me] > 0)
    std::memmove(dst + roff[me], src + soff[me], static_cast<size_t>(send_bytes[me]));
  if (!group_) return Status::OK();
  // Rounds: each slot holds up to `part` bytes for every destination; as many rounds as
  // the largest block of any rank needs (one small allgather tells).
  int64_t my_most = *std::max_element(send_bytes.begin(), send_bytes.end());
  std::vector<int64_t>& most = most_;
  most.resize(n);
  Status s = AllgatherFixed(&my_most, most.data(), sizeof(int64_t));
  if (!s.ok()) return s;
  const size_t part = group_->slot_bytes() / n;
  const size_t largest = static_cast<size_t>(*std::max_element(most.begin(), most.end()));
  for (size_t a = 0; a < largest; a += part) {
    uint64_t g;
    s = group_->Next("alltoall", &g);
    if (!s.ok()) return s;
    char* slot = group_->slot(rank_, g);
    for (size_t j = 0; j < n; ++j) {
      const size_t len = static_cast<size_t>(send_bytes[j]);
      if (j != me && a < len)
        std::memcpy(slot + j * part, src + soff[j] + a, std::min(part, len - a));
    }
    group_->Post(shm::Counter::kStarted, g);
    s = group_->Wait(shm::Counter::kStarted, g, "alltoall");
    if (!s.ok()) return s;
    for (size_t i = 0; i < n; ++i) {
      const size_t len = static_cast<size_t>(recv_bytes[i]);
      if (i == me || a >= len) continue;
      std::memcpy(dst + roff[i] + a, group_->slot(static_cast<int>(i), g) + me * part,
                  std::min(part, len - a));
    }
  }
  return Status::OK();
}

}  // namespace spark_hvd
