#include "backends/mpi/communicator.h"

#include <mpi.h>

#include <cstring>
#include <limits>
#include <map>
#include <string>

#include "backends/host_reduce.h"
#include "common/logging.h"
#include "common/reduce.h"

namespace spark_hvd {
namespace {

bool g_we_initialized = false;

Status Check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return Status::OK();
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return Status::PeerLost(std::string("MPI ") + what + " failed: " + std::string(text, len));
}

// MPI counts are int: refuse anything larger instead of truncating silently.
Status ToCount(int64_t n, int* out, const char* what) {
  if (n > std::numeric_limits<int>::max()) {
    return Status::InvalidArgument(std::string("MPI ") + what + ": " + std::to_string(n) +
                                   " elements exceed MPI's int count; use Gloo "
                                   "(SPARK_HVD_CONTROLLER=gloo) or split the tensor");
  }
  *out = static_cast<int>(n);
  return Status::OK();
}

// Our kernels as MPI user ops: one per (dtype, op), created on first use.
// MPI user functions carry no context, so the datatype tells us the dtype: we
// give every spark_hvd dtype its own contiguous byte datatype.
std::map<int, MPI_Datatype>& TypeTable() {
  static std::map<int, MPI_Datatype> t;
  return t;
}

DataType DtypeOf(MPI_Datatype t) {
  for (auto& kv : TypeTable()) {
    if (kv.second == t) return static_cast<DataType>(kv.first);
  }
  return DataType::kUInt8;
}

template <int O>
void UserOp(void* in, void* inout, int* len, MPI_Datatype* type) {
  GetReduceFn(DtypeOf(*type), static_cast<ReduceOp>(O))(inout, in, static_cast<size_t>(*len));
}

MPI_Datatype MpiType(DataType dtype) {
  auto& table = TypeTable();
  auto it = table.find(static_cast<int>(dtype));
  if (it != table.end()) return it->second;
  MPI_Datatype t;
  MPI_Type_contiguous(static_cast<int>(DataTypeSize(dtype)), MPI_BYTE, &t);
  MPI_Type_commit(&t);
  table[static_cast<int>(dtype)] = t;
  return t;
}

MPI_Op MpiOp(ReduceOp op) {
  static std::map<int, MPI_Op> ops;
  int key =
      static_cast<int>(op == ReduceOp::kAverage || op == ReduceOp::kAdasum ? ReduceOp::kSum : op);
  auto it = ops.find(key);
  if (it != ops.end()) return it->second;
  MPI_Op result;
  switch (static_cast<ReduceOp>(key)) {
    case ReduceOp::kProduct:
      MPI_Op_create(&UserOp<4>, 1, &result);
      break;
    case ReduceOp::kMin:
      MPI_Op_create(&UserOp<2>, 1, &result);
      break;
    case ReduceOp::kMax:
      MPI_Op_create(&UserOp<3>, 1, &result);
      break;
    default:
      MPI_Op_create(&UserOp<0>, 1, &result);
      break;
  }
  ops[key] = result;
  return result;
}

Status Displacements(const std::vector<int64_t>& bytes, std::vector<int>* counts,
                     std::vector<int>* displs, const char* what) {
  counts->resize(bytes.size());
  displs->resize(bytes.size());
  int64_t offset = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    Status s = ToCount(bytes[i], &(*counts)[i], what);
    if (!s.ok()) return s;
    s = ToCount(offset, &(*displs)[i], what);
    if (!s.ok()) return s;
    offset += bytes[i];
  }
  return Status::OK();
}

}  // namespace

struct MpiCommunicator::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  bool owned = false;
};

MpiCommunicator::MpiCommunicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  MPI_Comm_rank(impl_->comm, &rank_);
  MPI_Comm_size(impl_->comm, &size_);
}

MpiCommunicator::~MpiCommunicator() {
  if (impl_ && impl_->owned && impl_->comm != MPI_COMM_NULL) MPI_Comm_free(&impl_->comm);
}

std::unique_ptr<MpiCommunicator> MpiCommunicator::World() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    g_we_initialized = true;
  }
  auto impl = std::make_unique<Impl>();
  MPI_Comm_dup(MPI_COMM_WORLD, &impl->comm);
  MPI_Comm_set_errhandler(impl->comm, MPI_ERRORS_RETURN);
  impl->owned = true;
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(std::move(impl)));
}

std::unique_ptr<Communicator> MpiCommunicator::Split(const std::vector<int32_t>& ranks,
                                                     int32_t /*set_id*/) {
  std::vector<int> members(ranks.begin(), ranks.end());
  MPI_Group world_group, group;
  MPI_Comm_group(impl_->comm, &world_group);
  MPI_Group_incl(world_group, static_cast<int>(members.size()), members.data(), &group);
  auto impl = std::make_unique<Impl>();
  MPI_Comm_create(impl_->comm, group, &impl->comm);
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  if (impl->comm == MPI_COMM_NULL) return nullptr;
  MPI_Comm_set_errhandler(impl->comm, MPI_ERRORS_RETURN);
  impl->owned = true;
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(std::move(impl)));
}

void MpiCommunicator::Finalize() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (g_we_initialized && !finalized) MPI_Finalize();
}

Status MpiCommunicator::AllgatherFixed(const void* in, void* out, int64_t bytes) {
  int n;
  Status s = ToCount(bytes, &n, "control allgather");
  if (!s.ok()) return s;
  return Check(MPI_Allgather(in, n, MPI_BYTE, out, n, MPI_BYTE, impl_->comm), "control allgather");
}

Status MpiCommunicator::Allreduce(const ReduceArgs& args) {
  return HostAllreduce(args, [&](const std::vector<Segment>& segments, double scale) {
    return fusion_.Allreduce(segments, args.dtype, scale, /*direct_min_bytes=*/0, nullptr,
                             [&](void* buf, int64_t count, bool /*stable*/) {
                               if (size_ == 1 || count == 0) return Status::OK();
                               int n;
                               Status s = ToCount(count, &n, "allreduce");
                               if (!s.ok()) return s;
                               return Check(MPI_Allreduce(MPI_IN_PLACE, buf, n, MpiType(args.dtype),
                                                          MpiOp(args.op), impl_->comm),
                                            "allreduce");
                             });
  });
}

Status MpiCommunicator::Allgatherv(const void* in, void* out,
                                   const std::vector<int64_t>& bytes_per_rank) {
  std::vector<int> counts, displs;
  Status s = Displacements(bytes_per_rank, &counts, &displs, "allgather");
  if (!s.ok()) return s;
  return Check(MPI_Allgatherv(in, counts[rank_], MPI_BYTE, out, counts.data(), displs.data(),
                              MPI_BYTE, impl_->comm),
               "allgather");
}

Status MpiCommunicator::Broadcast(void* buf, int64_t bytes, int root) {
  if (size_ == 1 || bytes == 0) return Status::OK();
  int n;
  Status s = ToCount(bytes, &n, "broadcast");
  if (!s.ok()) return s;
  return Check(MPI_Bcast(buf, n, MPI_BYTE, root, impl_->comm), "broadcast");
}

Status MpiCommunicator::Alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                                  const std::vector<int64_t>& recv_bytes) {
  std::vector<int> sc, sd, rc, rd;
  Status s = Displacements(send_bytes, &sc, &sd, "alltoall");
  if (!s.ok()) return s;
  s = Displacements(recv_bytes, &rc, &rd, "alltoall");
  if (!s.ok()) return s;
  return Check(MPI_Alltoallv(in, sc.data(), sd.data(), MPI_BYTE, out, rc.data(), rd.data(),
                             MPI_BYTE, impl_->comm),
               "alltoall");
}

Status MpiCommunicator::Barrier() { return Check(MPI_Barrier(impl_->comm), "barrier"); }

}  // namespace spark_hvd
