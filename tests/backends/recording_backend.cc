// A test-only backend, loaded through SPARK_HVD_BACKEND_PLUGINS: it takes the ops
// of a made-up device (77), runs them through the rendezvous store (every rank
// publishes its bytes under a key per call and reads the others'), and appends
// one line per op to the file named by SHVD_RECORDING_LOG. It shows a backend
// added through the registry alone, with no engine change, gets its device's ops.
// Float32 reductions only (what the test sends); anything else is an error.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/communicator.h"
#include "rendezvous/store.h"

namespace {

using namespace spark_hvd;

constexpr int32_t kDevice = 77;

float Neutral(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin:
      return 3.0e38f;
    case ReduceOp::kMax:
      return -3.0e38f;
    case ReduceOp::kProduct:
      return 1.0f;
    default:
      return 0.0f;
  }
}

class RecordingCommunicator : public Communicator {
 public:
  RecordingCommunicator(const BackendOptions& o, std::vector<int32_t> members, int32_t set_id)
      : options_(o), members_(std::move(members)), set_id_(set_id) {
    rank_ = static_cast<int>(std::lower_bound(members_.begin(), members_.end(), o.rank) -
                             members_.begin());
  }
  const char* name() const override { return "recording"; }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }

  Status AllgatherFixed(const void* in, void* out, int64_t bytes) override {
    return Allgatherv(in, out, std::vector<int64_t>(members_.size(), bytes));
  }
  Status Allreduce(const ReduceArgs& a) override {
    if (a.dtype != DataType::kFloat32) return Status::InvalidArgument("recording: float32 only");
    std::string mine;
    int64_t count = 0;
    for (const auto& t : a.tensors) {
      std::vector<float> x(static_cast<size_t>(t.count), Neutral(a.op));
      if (t.input) std::memcpy(x.data(), t.input, x.size() * 4);
      for (float& v : x) v = static_cast<float>(v * a.prescale);
      mine.append(reinterpret_cast<const char*>(x.data()), x.size() * 4);
      count += t.count;
    }
    std::vector<std::string> all = Exchange(mine);
    std::vector<float> acc(static_cast<size_t>(count));
    std::memcpy(acc.data(), all[0].data(), acc.size() * 4);
    for (size_t r = 1; r < all.size(); ++r) {
      const float* x = reinterpret_cast<const float*>(all[r].data());
      for (size_t i = 0; i < acc.size(); ++i) {
        switch (a.op) {
          case ReduceOp::kMin:
            acc[i] = std::min(acc[i], x[i]);
            break;
          case ReduceOp::kMax:
            acc[i] = std::max(acc[i], x[i]);
            break;
          case ReduceOp::kProduct:
            acc[i] *= x[i];
            break;
          default:
            acc[i] += x[i];
            break;
        }
      }
    }
    const double post = a.postscale / (a.op == ReduceOp::kAverage ? a.ranks : 1);
    size_t offset = 0;
    for (const auto& t : a.tensors) {
      float* out = static_cast<float*>(t.output);
      for (int64_t i = 0; out && i < t.count; ++i)
        out[i] = static_cast<float>(acc[offset + i] * post);
      offset += static_cast<size_t>(t.count);
    }
    Record("allreduce tensors=" + std::to_string(a.tensors.size()) +
           " count=" + std::to_string(count));
    return Status::OK();
  }
  Status Allgatherv(const void* in, void* out, const std::vector<int64_t>& bytes) override {
    std::vector<std::string> all =
        Exchange(std::string(static_cast<const char*>(in), static_cast<size_t>(bytes[rank_])));
    char* p = static_cast<char*>(out);
    for (const auto& a : all) {
      std::memcpy(p, a.data(), a.size());
      p += a.size();
    }
    Record("allgather bytes=" + std::to_string(p - static_cast<char*>(out)));
    return Status::OK();
  }
  Status Broadcast(void* buf, int64_t bytes, int root) override {
    std::vector<std::string> all =
        Exchange(rank_ == root ? std::string(static_cast<char*>(buf), static_cast<size_t>(bytes))
                               : std::string());
    std::memcpy(buf, all[static_cast<size_t>(root)].data(), static_cast<size_t>(bytes));
    Record("broadcast bytes=" + std::to_string(bytes) + " root=" + std::to_string(root));
    return Status::OK();
  }
  Status Alltoallv(const void*, const std::vector<int64_t>&, void*,
                   const std::vector<int64_t>&) override {
    return Status::InvalidArgument("recording: no alltoall");
  }
  Status Barrier() override {
    Exchange("");
    Record("barrier");
    return Status::OK();
  }
  std::unique_ptr<Communicator> Split(const std::vector<int32_t>& ranks, int32_t set_id) override {
    if (!std::binary_search(ranks.begin(), ranks.end(), rank_)) return nullptr;
    std::vector<int32_t> members;
    for (int32_t r : ranks) members.push_back(members_[static_cast<size_t>(r)]);
    return std::make_unique<RecordingCommunicator>(options_, std::move(members), set_id);
  }

 private:
  // Every member's bytes for this call, in rank order.
  std::vector<std::string> Exchange(const std::string& mine) {
    const std::string base = options_.store_prefix + "/recording/set" + std::to_string(set_id_) +
                             "/" + std::to_string(seq_++) + "/";
    options_.store->Set(base + std::to_string(rank_), mine);
    std::vector<std::string> all;
    for (size_t r = 0; r < members_.size(); ++r) {
      all.push_back(options_.store->Get(base + std::to_string(r), options_.timeout_s));
    }
    return all;
  }
  void Record(const std::string& what) {
    const char* path = std::getenv("SHVD_RECORDING_LOG");
    if (path == nullptr) return;
    std::ofstream(path, std::ios::app)
        << "rank " << options_.rank << " set " << set_id_ << " " << what << "\n";
  }

  BackendOptions options_;
  std::vector<int32_t> members_;
  int32_t set_id_;
  int rank_ = 0;
  int64_t seq_ = 0;
};

class RecordingBackend : public Backend {
 public:
  const char* name() const override { return "recording"; }
  bool Enabled(const BackendOptions& o) const override { return o.store != nullptr; }
  bool Accepts(int32_t device, OpType op, DataType) const override {
    return device == kDevice && op != OpType::kAlltoall;
  }
  std::unique_ptr<Communicator> Connect(const BackendOptions& o) override {
    std::vector<int32_t> all;
    for (int32_t r = 0; r < o.size; ++r) all.push_back(r);
    return std::make_unique<RecordingCommunicator>(o, std::move(all), 0);
  }
};

}  // namespace

extern "C" spark_hvd::Backend* spark_hvd_make_backend() { return new RecordingBackend(); }
