#include "backends/gloo/communicator.h"

#include <gloo/algorithm.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "backends/host_reduce.h"
#include "backends/members.h"
#include "common/env.h"
#include "common/logging.h"
#include "common/reduce.h"

namespace spark_hvd {
namespace {

// Allreduce is Gloo's halving-doubling at every size: measured with bench/allreduce.py on
// this Debian gloo (2022), both its chunked ring and the options-API ring take a
// ~90 ms stall per call from 256 KiB to 1 MiB on loopback, while halving-doubling
// matches or beats torch's gloo up to 16 MiB.
constexpr size_t kMaxCachedAlgorithms = 64;
// Each cached halving-doubling holds a scratch copy of its whole buffer; keep the
// sum under this many fusion thresholds.
constexpr int64_t kCachedScratchThresholds = 2;
constexpr int64_t kMinCachedScratchBytes = 64 << 20;
// Stable-buffer counts round up to a multiple of a quarter of their power of two
// (at most 25% padding; four size classes per octave), at least this many elements.
constexpr int64_t kMinCountGranule = 1024;
// A lone tensor of at least this size is reduced in its own memory (packing would
// only add two copies); smaller ones go through the fusion buffer, whose fixed
// address keeps the set-up-once algorithms reused.
constexpr int64_t kDirectMinBytes = 1 << 20;

// Adapts our Store to the interface gloo's rendezvous expects.
class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(std::shared_ptr<spark_hvd::Store> inner, double timeout_s)
      : inner_(std::move(inner)), timeout_s_(timeout_s) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    inner_->Set(key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    std::string v = inner_->Get(key, timeout_s_);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { inner_->Wait(keys, timeout_s_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    inner_->Wait(keys, std::max(timeout_s_, t.count() / 1000.0));
  }

 private:
  std::shared_ptr<spark_hvd::Store> inner_;
  double timeout_s_;
};

// gloo's algorithms take a ReductionFunction<T> holding a plain function pointer;
// these trampolines route every (dtype, op) to the shared kernels in common/reduce.
template <typename T, int D, int O>
void Trampoline(T* x, const T* y, size_t n) {
  GetReduceFn(static_cast<DataType>(D), static_cast<ReduceOp>(O))(x, y, n);
}

template <typename T, int D>
typename gloo::ReductionFunction<T>::Function* PickOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kProduct:
      return &Trampoline<T, D, 4>;
    case ReduceOp::kMin:
      return &Trampoline<T, D, 2>;
    case ReduceOp::kMax:
      return &Trampoline<T, D, 3>;
    default:
      return &Trampoline<T, D, 0>;
  }
}

template <typename T>
const gloo::ReductionFunction<T>* ReductionFor(DataType dtype, ReduceOp op) {
  static std::map<std::pair<int, int>, std::unique_ptr<gloo::ReductionFunction<T>>> table;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_pair(static_cast<int>(dtype), static_cast<int>(op));
  auto it = table.find(key);
  if (it != table.end()) return it->second.get();
  typename gloo::ReductionFunction<T>::Function* fn = nullptr;
  switch (dtype) {
    case DataType::kUInt8:
      fn = PickOp<T, 0>(op);
      break;
    case DataType::kInt8:
      fn = PickOp<T, 1>(op);
      break;
    case DataType::kInt16:
      fn = PickOp<T, 2>(op);
      break;
    case DataType::kInt32:
      fn = PickOp<T, 3>(op);
      break;
    case DataType::kInt64:
      fn = PickOp<T, 4>(op);
      break;
    case DataType::kFloat16:
      fn = PickOp<T, 5>(op);
      break;
    case DataType::kBFloat16:
      fn = PickOp<T, 6>(op);
      break;
    case DataType::kFloat32:
      fn = PickOp<T, 7>(op);
      break;
    case DataType::kFloat64:
      fn = PickOp<T, 8>(op);
      break;
    case DataType::kBool:
      fn = PickOp<T, 9>(op);
      break;
  }
  gloo::ReductionType type = gloo::SUM;
  if (op == ReduceOp::kProduct) type = gloo::PRODUCT;
  if (op == ReduceOp::kMin) type = gloo::MIN;
  if (op == ReduceOp::kMax) type = gloo::MAX;
  auto owned = std::make_unique<gloo::ReductionFunction<T>>(type, fn);
  auto* raw = owned.get();
  table.emplace(key, std::move(owned));
  return raw;
}

template <typename T>
std::unique_ptr<gloo::Algorithm> MakeAllreduce(const std::shared_ptr<gloo::Context>& ctx, void* buf,
                                               int64_t count, DataType dtype, ReduceOp op) {
  std::vector<T*> ptrs{static_cast<T*>(buf)};
  const auto* fn = ReductionFor<T>(dtype, op);
  return std::make_unique<gloo::AllreduceHalvingDoubling<T>>(ctx, ptrs, static_cast<int>(count),
                                                             fn);
}

// Runs a gloo call, turning its exceptions into a Status that names what failed.
template <typename F>
Status Guard(const char* what, int rank, F&& fn) {
  try {
    fn();
    return Status::OK();
  } catch (const gloo::IoException& e) {
    std::string msg = e.what();
    if (msg.find("Timed out") != std::string::npos || msg.find("timed out") != std::string::npos) {
      return Status::Timeout(std::string("gloo ") + what + " on rank " + std::to_string(rank) +
                             " timed out waiting for a peer (SPARK_HVD_TIMEOUT_S): " + msg);
    }
    return Status::PeerLost(std::string("gloo ") + what + " on rank " + std::to_string(rank) +
                            " lost a peer: " + msg);
  } catch (const gloo::Exception& e) {
    return Status::PeerLost(std::string("gloo ") + what + " failed on rank " +
                            std::to_string(rank) + ": " + e.what());
  } catch (const StatusError& e) {
    return e.status();
  } catch (const std::exception& e) {
    return Status::Internal(std::string("gloo ") + what + " failed: " + e.what());
  }
}

}  // namespace

GlooCommunicator::GlooCommunicator(const BackendOptions& options, std::vector<int32_t> members,
                                   int rank, std::shared_ptr<gloo::Context> context)
    : options_(options), members_(std::move(members)), rank_(rank), context_(std::move(context)) {}

GlooCommunicator::~GlooCommunicator() {
  algos_.clear();
  context_.reset();
}

std::unique_ptr<GlooCommunicator> GlooCommunicator::Connect(const BackendOptions& options,
                                                            std::vector<int32_t> members,
                                                            int32_t set_id) {
  const int rank = MemberRank(members, options.rank);
  const int size = static_cast<int>(members.size());
  std::shared_ptr<gloo::Context> result;
  if (size > 1) {
    SHVD_CHECK(options.store != nullptr);
    Status s = Guard("connect", rank, [&] {
      // Gloo's event-loop thread starts here and inherits this thread's name: name it
      // for top -H / perf, then take our own name back (also when this throws).
      struct LoopThreadName {
        char own[16] = {0};
        LoopThreadName() {
#ifdef __linux__
          pthread_getname_np(pthread_self(), own, sizeof(own));
          pthread_setname_np(pthread_self(), "shvd_gloo_io");
#endif
        }
        ~LoopThreadName() {
#ifdef __linux__
          pthread_setname_np(pthread_self(), own);
#endif
        }
      };
      gloo::transport::tcp::attr attr;
      attr.hostname = options.bind_host;
      std::shared_ptr<gloo::transport::Device> device;
      {
        LoopThreadName naming;
        device = gloo::transport::tcp::CreateDevice(attr);
      }
      auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
      ctx->setTimeout(std::chrono::milliseconds(static_cast<int64_t>(options.timeout_s * 1000)));
      auto prefixed = std::make_shared<PrefixStore>(
          options.store_prefix + "/gloo/set" + std::to_string(set_id), options.store);
      GlooStoreAdapter adapter(prefixed, options.connect_timeout_s);
      ctx->connectFullMesh(adapter, device);
      result = ctx;
    });
    if (!s.ok()) throw StatusError(s);
  }
  SHVD_LOG(kDebug, "gloo") << "connected rank " << rank << " of " << size << " (set " << set_id
                           << ") on " << options.bind_host;
  return std::unique_ptr<GlooCommunicator>(
      new GlooCommunicator(options, std::move(members), rank, std::move(result)));
}

std::unique_ptr<Communicator> GlooCommunicator::Split(const std::vector<int32_t>& ranks,
                                                      int32_t set_id) {
  if (!std::binary_search(ranks.begin(), ranks.end(), rank_)) return nullptr;
  return Connect(options_, SplitMembers(members_, ranks), set_id);
}

Status GlooCommunicator::AllgatherFixed(const void* in, void* out, int64_t bytes) {
  return Allgatherv(in, out, std::vector<int64_t>(members_.size(), bytes));
}

std::unique_ptr<gloo::Algorithm> GlooCommunicator::NewAllreduce(void* buf, int64_t count,
                                                                DataType dtype, ReduceOp op) {
  switch (DataTypeSize(dtype)) {
    case 1:
      return MakeAllreduce<uint8_t>(context_, buf, count, dtype, op);
    case 2:
      return MakeAllreduce<uint16_t>(context_, buf, count, dtype, op);
    case 4:
      return MakeAllreduce<uint32_t>(context_, buf, count, dtype, op);
    default:
      return MakeAllreduce<uint64_t>(context_, buf, count, dtype, op);
  }
}

gloo::Algorithm* GlooCommunicator::CachedAllreduce(void* buf, int64_t count, DataType dtype,
                                                   ReduceOp op) {
  AlgoKey key{buf, count, static_cast<int>(dtype), static_cast<int>(op)};
  for (auto it = algos_.begin(); it != algos_.end(); ++it) {
    if (it->key == key) {
      algos_.splice(algos_.begin(), algos_, it);
      return algos_.front().algo.get();
    }
  }
  // A new set-up allocates (and the kernel zero-fills) a scratch as large as the
  // buffer: on loopback that page faulting cost a quarter of the engine's CPU in
  // bench/torch_step.py until stable counts were rounded to size classes.
  const int64_t scratch = count * static_cast<int64_t>(DataTypeSize(dtype));
  const int64_t budget =
      std::max(kMinCachedScratchBytes, kCachedScratchThresholds * env::FusionThresholdBytes());
  while (!algos_.empty() &&
         (algos_.size() >= kMaxCachedAlgorithms || algos_bytes_ + scratch > budget)) {
    algos_bytes_ -= algos_.back().scratch_bytes;
    algos_.pop_back();
  }
  algos_.push_front(CachedAlgo{key, scratch, NewAllreduce(buf, count, dtype, op)});
  algos_bytes_ += scratch;
  return algos_.front().algo.get();
}

int64_t GlooCommunicator::SizeClass(int64_t count) {
  if (count <= kMinCountGranule) return count;
  int64_t pow2 = 1;
  while (pow2 * 2 <= count) pow2 *= 2;
  const int64_t granule = std::max(kMinCountGranule, pow2 / 4);
  return (count + granule - 1) / granule * granule;
}

Status GlooCommunicator::ReduceContiguous(void* buf, int64_t count, DataType dtype, ReduceOp op,
                                          bool stable) {
  if (!context_ || count == 0) return Status::OK();
  const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype));
  const int64_t chunk = std::max<int64_t>(1, env::GlooChunkBytes() / elem);
  return Guard("allreduce", rank_, [&] {
    // Large tensors go as consecutive pieces: one halving-doubling over 64 MiB
    // on loopback measured ~1.4x slower than four over 16 MiB (bench/allreduce.py).
    for (int64_t off = 0; off < count; off += chunk) {
      const int64_t n = std::min(chunk, count - off);
      void* piece = static_cast<char*>(buf) + off * elem;
      if (stable) {
        CachedAllreduce(piece, n, dtype, op)->run();
      } else {
        // A caller's buffer: its address may repeat on one rank and not on another
        // (the allocator reuses memory), so never key a cache on it.
        NewAllreduce(piece, n, dtype, op)->run();
      }
    }
  });
}

Status GlooCommunicator::Allreduce(const ReduceArgs& args) {
  return HostAllreduce(args, [&](const std::vector<Segment>& segments, double scale) {
    return fusion_.Allreduce(segments, args.dtype, scale, kDirectMinBytes,
                             context_ ? &SizeClass : nullptr,
                             [&](void* buf, int64_t count, bool stable) {
                               return ReduceContiguous(buf, count, args.dtype, args.op, stable);
                             });
  });
}

Status GlooCommunicator::Allgatherv(const void* in, void* out,
                                    const std::vector<int64_t>& bytes_per_rank) {
  int64_t total = 0;
  for (auto b : bytes_per_rank) total += b;
  if (!context_) {
    if (total > 0) std::memcpy(out, in, static_cast<size_t>(total));
    return Status::OK();
  }
  if (total == 0) return Status::OK();
  return Guard("allgather", rank_, [&] {
    gloo::AllgathervOptions opts(context_);
    std::vector<size_t> elems(bytes_per_rank.begin(), bytes_per_rank.end());
    opts.setInput(const_cast<char*>(static_cast<const char*>(in)), elems[rank_]);
    opts.setOutput(static_cast<char*>(out), elems);
    opts.setTag(tag_++);
    gloo::allgatherv(opts);
  });
}

Status GlooCommunicator::Broadcast(void* buf, int64_t bytes, int root) {
  if (!context_ || bytes == 0) return Status::OK();
  return Guard("broadcast", rank_, [&] {
    gloo::BroadcastOptions opts(context_);
    if (rank_ == root) opts.setInput(static_cast<char*>(buf), bytes);
    opts.setOutput(static_cast<char*>(buf), bytes);
    opts.setRoot(root);
    opts.setTag(tag_++);
    gloo::broadcast(opts);
  });
}

Status GlooCommunicator::Alltoallv(const void* in, const std::vector<int64_t>& send_bytes,
                                   void* out, const std::vector<int64_t>& recv_bytes) {
  int64_t total_send = 0, total_recv = 0;
  for (auto b : send_bytes) total_send += b;
  for (auto b : recv_bytes) total_recv += b;
  if (!context_) {
    if (total_send > 0) std::memcpy(out, in, static_cast<size_t>(total_send));
    return Status::OK();
  }
  return Guard("alltoall", rank_, [&] {
    // gloo rejects null pointers even for empty buffers.
    char dummy_in = 0, dummy_out = 0;
    gloo::AlltoallvOptions opts(context_);
    opts.setInput(total_send ? const_cast<char*>(static_cast<const char*>(in)) : &dummy_in,
                  send_bytes);
    opts.setOutput(total_recv ? static_cast<char*>(out) : &dummy_out, recv_bytes);
    opts.setTag(tag_++);
    gloo::alltoallv(opts);
  });
}

Status GlooCommunicator::Barrier() {
  if (!context_) return Status::OK();
  return Guard("barrier", rank_, [&] {
    gloo::BarrierOptions opts(context_);
    opts.setTag(tag_++);
    gloo::barrier(opts);
  });
}

}  // namespace spark_hvd
