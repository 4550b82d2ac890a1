#include "backends/shm/hierarchical.h"

#include <algorithm>
#include <cstring>

#include "backends/host_reduce.h"
#include "backends/members.h"
#include "common/env.h"
#include "common/logging.h"

namespace spark_hvd {

std::unique_ptr<Communicator> ConnectShmSet(const BackendOptions& options,
                                            std::vector<int32_t> members, HostKeys hosts,
                                            int32_t set_id) {
  const std::string& mine = (*hosts)[static_cast<size_t>(options.rank)];
  const bool one_host = std::all_of(members.begin(), members.end(), [&](int32_t r) {
    return (*hosts)[static_cast<size_t>(r)] == mine;
  });
  if (one_host) {
    return std::make_unique<ShmCommunicator>(options, std::move(members), std::move(hosts),
                                             "set" + std::to_string(set_id));
  }
  return std::make_unique<HierarchicalCommunicator>(options, std::move(members), std::move(hosts),
                                                    set_id);
}

HierarchicalCommunicator::HierarchicalCommunicator(const BackendOptions& options,
                                                   std::vector<int32_t> members, HostKeys hosts,
                                                   int32_t set_id)
    : options_(options),
      members_(std::move(members)),
      rank_(MemberRank(members_, options.rank)),
      hosts_(std::move(hosts)) {
  std::vector<std::string> keys;  // hosts in the order of their first member
  for (int m = 0; m < size(); ++m) {
    const std::string& key = (*hosts_)[static_cast<size_t>(members_[m])];
    const size_t k = static_cast<size_t>(std::find(keys.begin(), keys.end(), key) - keys.begin());
    if (k == keys.size()) {
      keys.push_back(key);
      host_members_.emplace_back();
    }
    if (m == rank_) {
      host_ = static_cast<int>(k);
      local_rank_ = static_cast<int>(host_members_[k].size());
    }
    host_members_[k].push_back(m);
  }
  const size_t per_host = host_members_[0].size();
  const bool even = std::all_of(host_members_.begin(), host_members_.end(),
                                [&](const std::vector<int>& h) { return h.size() == per_host; });
  // Allgather unset (-1): on where measured faster (docs/benchmarks.md, the box: 1.6-4.7x
  // at 1-256 MiB), a set with several of its ranks on each host; with one per host it
  // would be the tcp allgather plus copies.
  const int64_t gather = env::HierarchicalAllgather();
  allreduce_ = env::HierarchicalAllreduce() > 0 && even;
  allgather_ = (gather > 0 || (gather < 0 && per_host > 1)) && even;
  if (!even && (env::HierarchicalAllreduce() > 0 || gather > 0)) {
    SHVD_LOG(kInfo, "shm") << "set " << set_id << " has different numbers of ranks on its "
                           << keys.size() << " hosts: its ops run on tcp, not hierarchically";
  }
  set_name_ = "set" + std::to_string(set_id);
  SHVD_LOG(kDebug, "shm") << set_name_ << ": rank " << rank_ << " is local rank " << local_rank_
                          << " of host " << host_ << " (" << keys.size() << " hosts); "
                          << "hierarchical allreduce " << (allreduce_ ? "on" : "off")
                          << ", allgather " << (allgather_ ? "on" : "off");
}

// The host's shm group and the tcp communicator across hosts are made by the first op
// that runs here, not with the set: a set that never runs one (an allreduce-only job with
// the allgather on by default) opens no sockets and makes no rendezvous requests for them.
// Every member runs the set's ops in the same order, so all of them come to this together.
// Across hosts only the ranks that send there connect: every local rank for allreduce
// (each carries a slice), only local rank 0 for allgather.
Status HierarchicalCommunicator::Connected() {
  if (connected_) return broken_;
  connected_ = true;
  std::vector<int32_t> local;
  for (int m : host_members_[static_cast<size_t>(host_)]) local.push_back(members_[m]);
  try {
    if (local.size() > 1) {
      local_ = std::make_unique<ShmCommunicator>(options_, local, hosts_,
                                                 set_name_ + ".host" + std::to_string(host_));
    }
  } catch (const StatusError& e) {
    broken_ =
        Status(e.status().code(), "within this host: " + e.status().message(), e.status().ranks());
    return broken_;
  }
  if (!allreduce_ && local_rank_ != 0) return Status::OK();
  // Across hosts: tcp among the ranks with this local rank, numbered by host.
  std::vector<int32_t> cross;
  for (const auto& h : host_members_) cross.push_back(members_[h[local_rank_]]);
  BackendOptions o = options_;
  o.rank = host_;
  o.size = static_cast<int32_t>(cross.size());
  o.store_prefix =
      options_.store_prefix + "/shm/" + set_name_ + ".cross" + std::to_string(local_rank_);
  if (options_.lost_ranks) {
    o.lost_ranks = [lost = options_.lost_ranks, cross] {
      std::vector<int32_t> out;
      for (int32_t r : lost()) {
        auto it = std::find(cross.begin(), cross.end(), r);
        if (it != cross.end()) out.push_back(static_cast<int32_t>(it - cross.begin()));
      }
      return out;
    };
  }
  SHVD_CHECK(static_cast<bool>(options_.connect_backend));
  try {
    cross_ = options_.connect_backend("tcp", o);
  } catch (const StatusError& e) {  // it names its own ranks: the job wants its own
    std::vector<int32_t> ranks;
    for (int32_t r : e.status().ranks()) ranks.push_back(cross[static_cast<size_t>(r)]);
    broken_ = Status(e.status().code(), "across hosts: " + e.status().message(), ranks);
  }
  return broken_;
}

HierarchicalCommunicator::~HierarchicalCommunicator() = default;

bool HierarchicalCommunicator::Runs(OpType op) const {
  if (op == OpType::kAllreduce || op == OpType::kReducescatter) return allreduce_;
  return op == OpType::kAllgather && allgather_;
}

Status HierarchicalCommunicator::Declined(const char* op) const {
  return Status::Internal(std::string("shm: ") + op + " on a set across hosts was sent to the " +
                          "hierarchical communicator, which declines it (Runs)");
}

Status HierarchicalCommunicator::Across(Status s) const {
  if (s.ok()) return s;
  // The tcp communicator names ranks by host index; the job wants job ranks.
  std::vector<int32_t> ranks;
  for (int32_t k : s.ranks()) {
    ranks.push_back(
        members_[static_cast<size_t>(host_members_[static_cast<size_t>(k)][local_rank_])]);
  }
  return Status(s.code(),
                "across hosts (tcp among each host's local rank " + std::to_string(local_rank_) +
                    ", numbered by host): " + s.message(),
                ranks);
}

Status HierarchicalCommunicator::Allreduce(const ReduceArgs& args) {
  if (!allreduce_) return Declined("allreduce");
  Status ready = Connected();
  if (!ready.ok()) return ready;
  return HostAllreduce(args, [&](const std::vector<Segment>& segments, double scale) {
    const size_t elem = DataTypeSize(args.dtype);
    SegmentLayout buf(segments, elem);
    const size_t count = buf.bytes() / elem;
    if (local_) {
      Status s = local_->ReduceScatterPieces(buf, count, args.dtype, args.op);
      if (!s.ok()) return s;
    }
    const size_t local_size = host_members_[static_cast<size_t>(host_)].size();
    const size_t lo = count * static_cast<size_t>(local_rank_) / local_size;
    const size_t hi = count * static_cast<size_t>(local_rank_ + 1) / local_size;
    ReduceArgs cross;  // this rank's piece, in place; the set's scale once reduced
    cross.dtype = args.dtype;
    cross.op = args.op == ReduceOp::kAverage ? ReduceOp::kSum : args.op;
    cross.postscale = scale;
    cross.ranks = size();
    buf.Pieces(lo * elem, (hi - lo) * elem, [&](char* p, size_t n) {
      cross.tensors.push_back(ReduceTensor{p, p, static_cast<int64_t>(n / elem)});
    });
    Status s = Across(cross_->Allreduce(cross));
    if (!s.ok() || !local_) return s;
    return local_->AllgatherPieces(buf, count, args.dtype);
  });
}

Status HierarchicalCommunicator::Allgatherv(const void* in, void* out,
                                            const std::vector<int64_t>& bytes_per_rank) {
  if (!allgather_) return Declined("allgather");
  Status ready = Connected();
  if (!ready.ok()) return ready;
  // The blocks by host (each host's members in order), gathered in scratch_.
  std::vector<int64_t> host_bytes, local_bytes;
  for (const auto& h : host_members_) {
    int64_t b = 0;
    for (int m : h) b += bytes_per_rank[static_cast<size_t>(m)];
    host_bytes.push_back(b);
  }
  for (int m : host_members_[static_cast<size_t>(host_)]) {
    local_bytes.push_back(bytes_per_rank[static_cast<size_t>(m)]);
  }
  int64_t total = 0, here = 0;
  for (size_t k = 0; k < host_bytes.size(); ++k) {
    if (static_cast<int>(k) == host_) here = total;
    total += host_bytes[k];
  }
  if (scratch_.size() < static_cast<size_t>(total)) scratch_.resize(static_cast<size_t>(total));
  char* all = reinterpret_cast<char*>(scratch_.data());
  Status s = local_ ? local_->Allgatherv(in, all + here, local_bytes) : Status::OK();
  if (!local_ && local_bytes[0] > 0)
    std::memcpy(all + here, in, static_cast<size_t>(local_bytes[0]));
  if (s.ok() && local_rank_ == 0) s = Across(cross_->Allgatherv(all + here, all, host_bytes));
  if (s.ok() && local_) s = local_->Broadcast(all, total, 0);
  if (!s.ok()) return s;
  std::vector<int64_t> offset(bytes_per_rank.size() + 1, 0);
  for (size_t m = 0; m < bytes_per_rank.size(); ++m) offset[m + 1] = offset[m] + bytes_per_rank[m];
  const char* from = all;
  for (const auto& h : host_members_) {
    for (int m : h) {
      const size_t b = static_cast<size_t>(bytes_per_rank[static_cast<size_t>(m)]);
      if (b > 0) std::memcpy(static_cast<char*>(out) + offset[static_cast<size_t>(m)], from, b);
      from += b;
    }
  }
  return Status::OK();
}

Status HierarchicalCommunicator::AllgatherFixed(const void* in, void* out, int64_t bytes) {
  return Allgatherv(in, out, std::vector<int64_t>(members_.size(), bytes));
}

Status HierarchicalCommunicator::Broadcast(void*, int64_t, int) { return Declined("broadcast"); }

Status HierarchicalCommunicator::Alltoallv(const void*, const std::vector<int64_t>&, void*,
                                           const std::vector<int64_t>&) {
  return Declined("alltoall");
}

Status HierarchicalCommunicator::Barrier() { return Declined("barrier"); }

std::unique_ptr<Communicator> HierarchicalCommunicator::Split(const std::vector<int32_t>& ranks,
                                                              int32_t set_id) {
  if (!std::binary_search(ranks.begin(), ranks.end(), rank_)) return nullptr;
  return ConnectShmSet(options_, SplitMembers(members_, ranks), hosts_, set_id);
}

}  // namespace spark_hvd
