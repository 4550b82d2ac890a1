#include "backends/tcp/communicator.h"

#include <algorithm>
#include <cstring>

#include "backends/host_reduce.h"
#include "backends/members.h"
#include "backends/tcp/mesh.h"
#include "common/logging.h"
#include "common/reduce.h"

namespace spark_hvd {

TcpCommunicator::TcpCommunicator(const BackendOptions& options, std::vector<int32_t> members,
                                 int rank, std::unique_ptr<TcpMesh> mesh)
    : options_(options), members_(std::move(members)), rank_(rank), mesh_(std::move(mesh)) {}

TcpCommunicator::~TcpCommunicator() = default;

std::unique_ptr<TcpCommunicator> TcpCommunicator::Connect(const BackendOptions& options,
                                                          std::vector<int32_t> members,
                                                          int32_t set_id) {
  const int rank = MemberRank(members, options.rank);
  const int size = static_cast<int>(members.size());
  std::unique_ptr<TcpMesh> mesh;
  if (size > 1) {
    if (!options.store) {
      throw StatusError(Status::InvalidArgument(
          "more than one rank needs a rendezvous store: launch with spark-hvdrun or "
          "spark_hvd.spark.run (SPARK_HVD_RENDEZVOUS_ADDR/PORT are not set)"));
    }
    auto store = std::make_shared<PrefixStore>(
        options.store_prefix + "/tcp/set" + std::to_string(set_id), options.store);
    // The rendezvous service names lost ranks of the job; the mesh wants its own. Kept by
    // the mesh for the connections it makes later: everything captured by value.
    TcpMesh::LostPeers lost_peers;
    if (options.lost_ranks) {
      lost_peers = [lost_ranks = options.lost_ranks, members] {
        std::vector<int> lost;
        for (int32_t r : lost_ranks()) {
          auto it = std::lower_bound(members.begin(), members.end(), r);
          if (it != members.end() && *it == r)
            lost.push_back(static_cast<int>(it - members.begin()));
        }
        return lost;
      };
    }
    try {
      mesh = TcpMesh::Connect(rank, size, store, options.bind_host, options.timeout_s,
                              options.connect_timeout_s, lost_peers, members, options.liveness);
    } catch (const StatusError& e) {  // the mesh names its own ranks; the job wants its own
      std::vector<int32_t> lost;
      for (int32_t r : e.status().ranks()) lost.push_back(members[static_cast<size_t>(r)]);
      throw StatusError(Status(e.status().code(), e.status().message(), lost));
    }
  }
  SHVD_LOG(kDebug, "tcp") << "connected rank " << rank << " of " << size << " (set " << set_id
                          << ") on " << options.bind_host;
  return std::unique_ptr<TcpCommunicator>(
      new TcpCommunicator(options, std::move(members), rank, std::move(mesh)));
}

std::unique_ptr<Communicator> TcpCommunicator::Split(const std::vector<int32_t>& ranks,
                                                     int32_t set_id) {
  if (!std::binary_search(ranks.begin(), ranks.end(), rank_)) return nullptr;
  return Connect(options_, SplitMembers(members_, ranks), set_id);
}

Status TcpCommunicator::AllgatherFixed(const void* in, void* out, int64_t bytes) {
  if (!mesh_) {
    std::memcpy(out, in, static_cast<size_t>(bytes));
    return Status::OK();
  }
  return mesh_->AllgatherFixed(in, out, bytes);
}

Status TcpCommunicator::AllreduceFixed(void* inout, int64_t bytes, Combine combine) {
  return mesh_ ? mesh_->AllreduceFixed(inout, bytes, combine) : Status::OK();
}

Status TcpCommunicator::Allreduce(const ReduceArgs& args) {
  return HostAllreduce(
      args,
      [&](const std::vector<Segment>& segments, double scale) {
        if (mesh_) return mesh_->Allreduce(segments, args.dtype, args.op, scale);
        if (scale != 1.0) {
          for (const auto& s : segments) {
            ScaleBuffer(s.data, static_cast<size_t>(s.count), args.dtype, scale);
          }
        }
        return Status::OK();
      },
      &reduce_scratch_);
}

Status TcpCommunicator::Allgatherv(const void* in, void* out,
                                   const std::vector<int64_t>& bytes_per_rank) {
  int64_t total = 0;
  for (int64_t b : bytes_per_rank) total += b;
  if (mesh_) return total > 0 ? mesh_->Allgatherv(in, out, bytes_per_rank) : Status::OK();
  if (total > 0) std::memcpy(out, in, static_cast<size_t>(bytes_per_rank[0]));
  return Status::OK();
}

Status TcpCommunicator::Broadcast(void* buf, int64_t bytes, int root) {
  return mesh_ && bytes > 0 ? mesh_->Broadcast(buf, bytes, root) : Status::OK();
}

Status TcpCommunicator::Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                                  const std::vector<int64_t>& recv_bytes) {
  if (mesh_) return mesh_->Alltoallv(in, send_bytes, out, recv_bytes);
  if (send_bytes[0] > 0) std::memcpy(out, in, static_cast<size_t>(send_bytes[0]));
  return Status::OK();
}

Status TcpCommunicator::Barrier() { return mesh_ ? mesh_->Barrier() : Status::OK(); }

}  // namespace spark_hvd
