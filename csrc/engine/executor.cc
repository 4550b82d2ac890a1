#include "engine/executor.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "backends/host_adasum.h"
#include "common/env.h"

namespace spark_hvd {
namespace {

// Elements of one row: the product of the dimensions after the first.
int64_t RowElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

// `rows`, then `shape` after its first dimension (one allocation: the caller's output).
void SetOutputShape(std::vector<int64_t>* out, int64_t rows, const std::vector<int64_t>& shape) {
  out->clear();
  out->reserve(std::max<size_t>(shape.size(), 1));
  out->push_back(rows);
  for (size_t i = 1; i < shape.size(); ++i) out->push_back(shape[i]);
}

std::string Upper(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::toupper(c));
  return s;
}

}  // namespace

void Executor::Phase(const Entries& es, const Communicator* comm, const char* op,
                     int64_t start_us) {
  if (!timeline_->active()) return;
  const std::string phase = Upper(comm->name()) + op;
  int64_t now = NowMicros();
  for (const auto& e : es) {
    if (e) timeline_->Event(e->req.name, phase, start_us, now);
  }
}

Status Executor::Execute(const Response& r) {
  if (r.op == OpType::kJoin) {
    auto e = queue_->TakeJoin();
    if (e) {
      e->state->value = r.extra.empty() ? -1 : r.extra[0];
      completions_->Complete(*e->state, Status::OK());
    }
    return Status::OK();
  }
  Entries& es = es_;
  es.clear();
  struct Release {  // the entries go (their buffers' owners released) when the op is done
    Entries& es;
    ~Release() { es.clear(); }
  } release{es};
  for (const auto& t : r.tensors) es.push_back(queue_->Take(r.process_set, t.name));
  auto fail_all = [&](const Status& s) {  // each entry's error names its own tensor
    for (auto& e : es) {
      if (e) completions_->Complete(*e->state, s.WithTensor(e->req.name));
    }
  };
  if (r.error != StatusCode::kOk) {
    fail_all(Status(r.error, r.error_message, r.error_ranks));
    return Status::OK();
  }
  ProcessSet* set = sets_->Get(r.process_set);
  if (set == nullptr || !set->Contains(rank_)) return Status::OK();
  // Adasum runs on pairwise exchanges (HostAdasum): on a communicator that runs alltoall.
  const bool adasum = r.op == OpType::kAllreduce && r.reduce_op == ReduceOp::kAdasum;
  Communicator* comm = set->For(r.device, adasum ? OpType::kAlltoall : r.op, r.dtype);
  if (comm == nullptr) {
    fail_all(Status::InvalidArgument("no communicator of process set " +
                                     std::to_string(r.process_set) +
                                     " executes this op on device " + std::to_string(r.device)));
    return Status::OK();
  }
  const int64_t start = NowMicros();
  for (const auto& e : es) {
    if (e && timeline_->active()) {
      timeline_->Event(e->req.name, std::string("NEGOTIATE_") + Upper(OpTypeName(r.op)),
                       e->enqueue_us, start);
    }
  }
  DeviceInputs& inputs = inputs_;
  inputs.device = kCpuDevice;
  inputs.ready.clear();
  inputs.streams.clear();
  for (const auto& e : es) {
    if (!e) continue;
    inputs.device = e->req.device;
    if (inputs.device < 0) continue;
    // A backend's own stream waits for each input's ready event (recorded on its producer
    // stream, the null one included, at submit), not for what was queued there since.
    if (e->ready) inputs.ready.push_back(e->ready.get());
    if (std::find(inputs.streams.begin(), inputs.streams.end(), e->stream) ==
        inputs.streams.end()) {
      inputs.streams.push_back(e->stream);
    }
  }
  Status s = comm->Prepare(inputs);
  if (!s.ok()) {
    fail_all(s);
    return s;
  }
  switch (r.op) {
    case OpType::kAllreduce:
      s = Allreduce(r, es, comm);
      break;
    case OpType::kAllgather:
      s = Allgather(r, es, comm);
      break;
    case OpType::kBroadcast:
      s = Broadcast(r, es, comm);
      break;
    case OpType::kAlltoall:
      s = Alltoall(r, es, comm);
      break;
    case OpType::kReducescatter:
      s = Reducescatter(r, es, comm);
      break;
    case OpType::kBarrier: {
      s = comm->Barrier();
      if (timeline_->active()) {
        const int64_t now = NowMicros();
        for (const auto& e : es) {
          if (e) timeline_->Event(e->req.name, "BARRIER", start, now);
        }
      }
      break;
    }
    default:
      s = Status::Internal(std::string("executor got unexpected op ") + OpTypeName(r.op));
  }
  if (!s.ok()) {
    fail_all(s);
    // Work the op queued before it failed may still use the entries' buffers.
    if (auto pending = comm->TakePending()) in_flight_->Retain(std::move(pending), &es);
    return s;
  }
  if (auto pending = comm->TakePending()) {
    // Device work still queued: the ops complete (and their buffers are released)
    // when it finishes.
    in_flight_->Add(std::move(pending), &es);
    return Status::OK();
  }
  ReleaseThenComplete(&es, Status::OK(), completions_, &done_);
  return Status::OK();
}

Status Executor::Allreduce(const Response& r, Entries& es, Communicator* comm) {
  ReduceArgs& args = args_;
  args.tensors.clear();
  args.dtype = r.dtype;
  args.op = r.reduce_op;
  args.prescale = r.prescale;
  args.postscale = r.postscale;
  args.ranks = comm->size();  // Average divides by every member, joined ones too (Horovod)
  for (size_t i = 0; i < r.tensors.size(); ++i) {
    const int64_t n = NumElements(r.tensors[i].shape);
    args.tensors.push_back(es[i] ? ReduceTensor{es[i]->input, es[i]->output, n}
                                 : ReduceTensor{nullptr, nullptr, n});
  }
  const int64_t t1 = NowMicros();
  // Adasum is one host algorithm over the communicator's pairwise exchanges, the same
  // for every CPU backend (the engine admits it only on host memory).
  const bool adasum = args.op == ReduceOp::kAdasum;
  Status s = adasum ? HostAdasum(args, comm) : comm->Allreduce(args);
  if (!s.ok()) return s;
  Phase(es, comm, adasum ? "_ADASUM" : "_ALLREDUCE", t1);
  return Status::OK();
}

Status Executor::Allgather(const Response& r, Entries& es, Communicator* comm) {
  const ResponseTensor& t = r.tensors[0];
  const int64_t row_bytes = RowElements(t.shape) * static_cast<int64_t>(DataTypeSize(r.dtype));
  std::vector<int64_t>& bytes = bytes_;
  bytes.resize(t.rank_dims.size());
  int64_t rows = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    bytes[i] = t.rank_dims[i] * row_bytes;
    rows += t.rank_dims[i];
  }
  TensorEntry* e = es[0].get();
  Buffer out;  // a rank that joined gathers into scratch
  Status s = comm->Allocate(rows * row_bytes, &out);
  if (!s.ok()) return s;
  if (e) e->state->output = out;
  int64_t t1 = NowMicros();
  s = comm->Allgatherv(e ? e->input : nullptr, out.data, bytes);
  if (!s.ok()) return s;
  Phase(es, comm, "_ALLGATHER", t1);
  if (e) SetOutputShape(&e->state->output_shape, rows, t.shape);
  return Status::OK();
}

Status Executor::Broadcast(const Response& r, Entries& es, Communicator* comm) {
  const ResponseTensor& t = r.tensors[0];
  const int64_t bytes = NumElements(t.shape) * static_cast<int64_t>(DataTypeSize(r.dtype));
  TensorEntry* e = es[0].get();
  Buffer scratch;  // a rank that joined receives into scratch
  void* buf;
  if (e) {
    buf = e->output;
    if (comm->rank() == r.root && e->input != e->output) {
      Status s = comm->Copy(buf, e->input, bytes);
      if (!s.ok()) return s;
    }
  } else {
    Status s = comm->Allocate(bytes, &scratch);
    if (!s.ok()) return s;
    buf = scratch.data;
  }
  int64_t t1 = NowMicros();
  Status s = comm->Broadcast(buf, bytes, r.root);
  if (!s.ok()) return s;
  Phase(es, comm, "_BROADCAST", t1);
  return Status::OK();
}

Status Executor::Alltoall(const Response& r, Entries& es, Communicator* comm) {
  const ResponseTensor& t = r.tensors[0];
  const size_t n = static_cast<size_t>(comm->size());
  const size_t me = static_cast<size_t>(comm->rank());
  const int64_t row_bytes = RowElements(t.shape) * static_cast<int64_t>(DataTypeSize(r.dtype));
  std::vector<int64_t>&send = send_, &recv = recv_, &recv_rows = recv_rows_;
  send.resize(n);
  recv.resize(n);
  recv_rows.resize(n);
  int64_t rows = 0;
  for (size_t j = 0; j < n; ++j) {
    send[j] = t.rank_dims[me * n + j] * row_bytes;
    recv_rows[j] = t.rank_dims[j * n + me];
    recv[j] = recv_rows[j] * row_bytes;
    rows += recv_rows[j];
  }
  TensorEntry* e = es[0].get();
  SHVD_CHECK(e != nullptr);
  Status s = comm->Allocate(rows * row_bytes, &e->state->output);
  if (!s.ok()) return s;
  int64_t t1 = NowMicros();
  s = comm->Alltoallv(e->input, send, e->state->output.data, recv);
  if (!s.ok()) return s;
  Phase(es, comm, "_ALLTOALL", t1);
  SetOutputShape(&e->state->output_shape, rows, t.shape);
  e->state->received_splits = recv_rows;
  return Status::OK();
}

Status Executor::Reducescatter(const Response& r, Entries& es, Communicator* comm) {
  const ResponseTensor& t = r.tensors[0];
  TensorEntry* e = es[0].get();
  SHVD_CHECK(e != nullptr);
  const int64_t n = NumElements(t.shape);
  const int64_t dsize = static_cast<int64_t>(DataTypeSize(r.dtype));
  // This rank's rows: first dim split as evenly as possible, the first (rows % size)
  // ranks taking one extra row.
  const int64_t d0 = t.shape.empty() ? 1 : t.shape[0];
  const int64_t size = comm->size(), me = comm->rank();
  const int64_t base = d0 / size, rem = d0 % size;
  const int64_t my_rows = base + (me < rem ? 1 : 0);
  const int64_t first_row = me * base + std::min(me, rem);
  const int64_t row_bytes = RowElements(t.shape) * dsize;
  Status s = comm->Allocate(my_rows * row_bytes, &e->state->output);
  if (!s.ok()) return s;
  ReduceArgs& args = args_;
  args.tensors.clear();
  args.tensors.push_back(ReduceTensor{e->input, nullptr, n});
  args.dtype = r.dtype;
  args.op = r.reduce_op;
  args.prescale = r.prescale;
  args.postscale = r.postscale;
  args.ranks = static_cast<int64_t>(r.active.size());
  int64_t t1 = NowMicros();
  // Equal blocks where the backend has the collective; else reduce the whole tensor
  // and keep this rank's rows.
  const bool equal = rem == 0 && !t.shape.empty();
  if (!equal ||
      !comm->ReducescatterBlocks(args, my_rows * RowElements(t.shape), e->state->output.data, &s)) {
    // Host memory: this executor's scratch, reused. Device memory: a buffer of the op,
    // freed once the work on it is done (cudaFree waits for the device).
    Buffer full;
    void* whole = nullptr;
    if (e->state->output.device == kCpuDevice) {
      if (host_scratch_.size() < static_cast<size_t>(n * dsize)) {
        host_scratch_.resize(static_cast<size_t>(n * dsize));
      }
      whole = host_scratch_.data();
    } else {
      s = comm->Allocate(n * dsize, &full);
      if (!s.ok()) return s;
      whole = full.data;
    }
    args.tensors[0].output = whole;
    s = comm->Allreduce(args);
    if (s.ok()) {
      s = comm->Copy(e->state->output.data, static_cast<uint8_t*>(whole) + first_row * row_bytes,
                     my_rows * row_bytes);
    }
  }
  if (!s.ok()) return s;
  Phase(es, comm, "_REDUCESCATTER", t1);
  SetOutputShape(&e->state->output_shape, my_rows, t.shape);
  return Status::OK();
}

}  // namespace spark_hvd
