// Runs one scenario against the fake CUDA runtime and NCCL, loaded the way the NCCL
// backend loads the real ones: dlopen by path, every symbol resolved by name.
//
//   fake_driver CUDART_SO NCCL_SO SCENARIO RANK SIZE DIR
//
// tests/fakes/test_fakes.py starts SIZE of these at once. Rank 0 writes the unique id to
// DIR/id; the others wait for it. A scenario prints "PASS" at the end and exits 0;
// a failed check prints "[rank R] FAIL file:line: ..." to stderr and exits 1.
// Expectations are computed from RANK and SIZE, so one scenario holds at 1, 2 and 3 ranks.
#include "fake_driver.h"

#include <csignal>
#include <functional>
#include <map>
#include <thread>

using namespace driver;

namespace {

constexpr int kHostPreMul = 100;    // ncclRedOpCreatePreMulSum with a host scalar of 2
constexpr int kDevicePreMul = 101;  // ... with a device scalar of rank + 1
const Dtype& kF32 = D(ncclFloat32);

double InputValue(const Dtype& d, int op, int rank, size_t i) {
  if (op == ncclProd) {
    static const double with_sign[] = {1, -2, 1, 2}, unsigned_[] = {1, 2, 1, 3};
    return (d.is_signed ? with_sign : unsigned_)[(rank + i) % 4];
  }
  double v = double((rank * 3 + i) % 7);
  return d.is_signed ? v - 3 : v;
}

// What reducing every rank's InputValue under op gives.
double Expected(const Dtype& d, int op, size_t i) {
  const int base = op >= kHostPreMul ? ncclSum : op;
  double acc = 0;
  for (int r = 0; r < g_size; ++r) {
    const double scale = op == kHostPreMul ? 2 : op == kDevicePreMul ? r + 1 : 1;
    double x = InputValue(d, base, r, i) * scale;
    if (r == 0)
      acc = x;
    else if (base == ncclProd)
      acc *= x;
    else if (base == ncclMax)
      acc = std::max(acc, x);
    else if (base == ncclMin)
      acc = std::min(acc, x);
    else
      acc += x;
  }
  if (op == ncclAvg) acc = d.floating ? acc / g_size : std::trunc(acc / g_size);
  return acc;
}

std::vector<double> Iota(size_t n, double start, double step = 1) {
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = start + step * double(i);
  return v;
}

void Collectives() {
  ncclComm_t comm = Join();
  cudaStream_t s = NewStream();
  const int n = g_size, me = g_rank;
  std::vector<Pending> checks;
  std::vector<std::vector<char>> keep;  // host sources of queued copies
  const size_t count = 7;
  for (const Dtype& d : kDtypes) {
    for (int op : {ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg, kHostPreMul, kDevicePreMul}) {
      const int base = op >= kHostPreMul ? ncclSum : op;
      std::vector<double> mine(count), want(count);
      for (size_t i = 0; i < count; ++i) {
        mine[i] = InputValue(d, base, me, i);
        want[i] = Expected(d, op, i);
      }
      void* send = DevCopy(Encoded(d, mine));
      void* recv = DevAlloc(count * d.size);
      ncclRedOp_t red = op;
      if (op == kHostPreMul) {
        char scalar[8];
        Encode(d, 2, scalar);
        NCCL(api.ncclRedOpCreatePreMulSum(&red, scalar, d.id, ncclScalarHostImmediate, comm));
      } else if (op == kDevicePreMul) {
        void* scalar = DevAlloc(d.size);  // 0xFF bytes until the stream writes rank + 1
        NCCL(api.ncclRedOpCreatePreMulSum(&red, scalar, d.id, ncclScalarDevice, comm));
        keep.push_back(Encoded(d, {double(me + 1)}));
        CUDA(api.cudaMemcpyAsync(scalar, keep.back().data(), d.size, cudaMemcpyHostToDevice, s));
      }
      NCCL(api.ncclAllReduce(send, recv, count, d.id, red, comm, s));
      if (op >= kHostPreMul) NCCL(api.ncclRedOpDestroy(red, comm));  // allowed once queued
      double tolerance = op == ncclAvg && d.floating ? (d.size == 2 ? 2e-2 : 1e-5) : 0;
      checks.push_back({std::string("allreduce ") + d.name + " op " + std::to_string(op), &d, recv,
                        want, tolerance});
    }
  }
  // Integers wrap like the dtype.
  const Dtype &i8 = D(ncclInt8), &u32 = D(ncclUint32);
  void* wrap8 = DevCopy(Encoded(i8, {100, -100}));
  NCCL(api.ncclAllReduce(wrap8, wrap8, 2, ncclInt8, ncclSum, comm, s));
  checks.push_back(
      {"int8 wraps",
       &i8,
       wrap8,
       {double(int8_t(uint8_t(100 * n))), double(int8_t(uint8_t(256 - 100 * n % 256)))},
       0});
  void* wrap32 = DevCopy(Encoded(u32, {4294967295.0}));
  NCCL(api.ncclAllReduce(wrap32, wrap32, 1, ncclUint32, ncclSum, comm, s));
  checks.push_back({"uint32 wraps", &u32, wrap32, {double(uint32_t(0xFFFFFFFFull * n))}, 0});
  // float16 and bfloat16 round to nearest even after each step (rank 0 + rank 1 + 0s).
  if (n >= 2) {
    const Dtype &f16 = D(ncclFloat16), &bf16 = D(ncclBfloat16);
    void* h = DevCopy(Encoded(f16, me == 0   ? std::vector<double>{1024, 1025}
                                   : me == 1 ? std::vector<double>{0.5, 0.5}
                                             : Iota(2, 0, 0)));
    NCCL(api.ncclAllReduce(h, h, 2, ncclFloat16, ncclSum, comm, s));
    checks.push_back({"float16 rounds to even", &f16, h, {1024, 1026}, 0});
    void* b = DevCopy(Encoded(bf16, me == 0   ? std::vector<double>{256, 258}
                                    : me == 1 ? std::vector<double>{1, 1}
                                              : Iota(2, 0, 0)));
    NCCL(api.ncclAllReduce(b, b, 2, ncclBfloat16, ncclSum, comm, s));
    checks.push_back({"bfloat16 rounds to even", &bf16, b, {256, 260}, 0});
  }
  // Odd and zero sizes; a long one.
  NCCL(api.ncclAllReduce(nullptr, nullptr, 0, ncclFloat32, ncclSum, comm, s));
  NCCL(api.ncclAllGather(nullptr, nullptr, 0, ncclFloat32, comm, s));
  std::vector<double> lengthy(1000), lengthy_want(1000);
  for (size_t i = 0; i < 1000; ++i) {
    lengthy[i] = double((me + 1) * (i % 17));
    lengthy_want[i] = double(n * (n + 1) / 2 * (i % 17));
  }
  void* big = DevCopy(Encoded(kF32, lengthy));
  NCCL(api.ncclAllReduce(big, big, 1000, ncclFloat32, ncclSum, comm, s));
  checks.push_back({"allreduce of 1000", &kF32, big, lengthy_want, 0});
  // Broadcast from every root, in place on the root; the others pass no send buffer.
  for (int root = 0; root < n; ++root) {
    for (ncclDataType_t id : {ncclFloat32, ncclInt64, ncclBfloat16}) {
      const Dtype& d = D(id);
      std::vector<double> values = Iota(5, 10.0 * root);
      void* buf = me == root ? DevCopy(Encoded(d, values)) : DevAlloc(5 * d.size);
      NCCL(api.ncclBroadcast(me == root ? buf : nullptr, buf, 5, id, root, comm, s));
      checks.push_back({std::string("broadcast ") + d.name + " from " + std::to_string(root), &d,
                        buf, values, 0});
    }
  }
  // Allgather: in place (my part already at my offset) and out of place.
  for (ncclDataType_t id : {ncclInt32, ncclFloat16, ncclUint8}) {
    const Dtype& d = D(id);
    std::vector<double> want;
    for (int r = 0; r < n; ++r)
      for (double v : Iota(3, 100.0 * r))
        want.push_back(id == ncclUint8 ? double(int(v) % 256) : v);
    std::vector<double> mine(want.begin() + 3 * me, want.begin() + 3 * me + 3);
    char* recv = static_cast<char*>(DevAlloc(3 * n * d.size));
    const void* send = recv + 3 * me * d.size;
    if (id == ncclUint8)
      send = DevCopy(Encoded(d, mine));
    else
      Put(recv + 3 * me * d.size, Encoded(d, mine));
    NCCL(api.ncclAllGather(send, recv, 3, id, comm, s));
    checks.push_back({std::string("allgather ") + d.name, &d, recv, want, 0});
  }
  // Reduce-scatter: rank r gets the sum of everyone's segment r.
  for (ncclDataType_t id : {ncclFloat32, ncclInt8}) {
    const Dtype& d = D(id);
    void* send = DevCopy(Encoded(d, Iota(4 * n, me)));
    void* recv = DevAlloc(4 * d.size);
    NCCL(api.ncclReduceScatter(send, recv, 4, id, ncclSum, comm, s));
    checks.push_back({std::string("reducescatter ") + d.name, &d, recv,
                      Iota(4, n * 4.0 * me + n * (n - 1) / 2.0, n), 0});
  }
  CUDA(api.cudaStreamSynchronize(s));
  Judge(checks);
  CUDA(api.cudaStreamDestroy(s));
  NCCL(api.ncclCommDestroy(comm));
  Pass();
}

void Grouped() {
  ncclComm_t comm = Join();
  cudaStream_t s = NewStream(), s2 = NewStream();
  const int n = g_size, me = g_rank;
  std::vector<Pending> checks;
  // A ragged allgather as grouped broadcasts (nested groups): root r sends 2(r + 1) values.
  std::vector<size_t> offset(n + 1, 0);
  std::vector<double> want;
  for (int r = 0; r < n; ++r) {
    offset[r + 1] = offset[r] + 2 * (r + 1);
    for (double v : Iota(2 * (r + 1), 1000.0 * r)) want.push_back(v);
  }
  char* ragged = static_cast<char*>(DevAlloc(offset[n] * 4));
  Put(ragged + offset[me] * 4, Encoded(kF32, Iota(2 * (me + 1), 1000.0 * me)));
  NCCL(api.ncclGroupStart());
  NCCL(api.ncclGroupStart());
  for (int r = 0; r < n; ++r) {
    void* seg = ragged + offset[r] * 4;
    NCCL(api.ncclBroadcast(seg, seg, 2 * (r + 1), ncclFloat32, r, comm, s));
  }
  NCCL(api.ncclGroupEnd());
  NCCL(api.ncclGroupEnd());
  checks.push_back({"grouped ragged broadcasts", &kF32, ragged, want, 0});
  // Alltoall as grouped send/recv (self included), sends on s and recvs on s2: a -> b
  // carries 1 + a + 2b int32 values a*1000 + b*10 + i.
  const Dtype& i32 = D(ncclInt32);
  auto pair_count = [](int a, int b) { return size_t(1 + a + 2 * b); };
  std::vector<double> out_values;
  std::vector<size_t> send_off(n + 1, 0), recv_off(n + 1, 0);
  std::vector<double> recv_want;
  for (int p = 0; p < n; ++p) {
    for (double v : Iota(pair_count(me, p), me * 1000.0 + p * 10)) out_values.push_back(v);
    for (double v : Iota(pair_count(p, me), p * 1000.0 + me * 10)) recv_want.push_back(v);
    send_off[p + 1] = send_off[p] + pair_count(me, p);
    recv_off[p + 1] = recv_off[p] + pair_count(p, me);
  }
  char* a2a_send = static_cast<char*>(DevCopy(Encoded(i32, out_values)));
  char* a2a_recv = static_cast<char*>(DevAlloc(recv_off[n] * 4));
  NCCL(api.ncclGroupStart());
  for (int p = 0; p < n; ++p) {
    NCCL(api.ncclSend(a2a_send + send_off[p] * 4, pair_count(me, p), ncclInt32, p, comm, s));
    NCCL(api.ncclRecv(a2a_recv + recv_off[p] * 4, pair_count(p, me), ncclInt32, p, comm, s2));
  }
  NCCL(api.ncclGroupEnd());
  checks.push_back({"grouped alltoall", &i32, a2a_recv, recv_want, 0});
  // Ungrouped send/recv around a ring, ordered so that it cannot deadlock.
  if (n >= 2) {
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    void* ring_out = DevCopy(Encoded(kF32, Iota(3, 7.0 * me)));
    void* ring_in = DevAlloc(12);
    if (me == 0) NCCL(api.ncclSend(ring_out, 3, ncclFloat32, next, comm, s2));
    NCCL(api.ncclRecv(ring_in, 3, ncclFloat32, prev, comm, s2));
    if (me != 0) NCCL(api.ncclSend(ring_out, 3, ncclFloat32, next, comm, s2));
    checks.push_back({"ring", &kF32, ring_in, Iota(3, 7.0 * prev), 0});
  }
  CUDA(api.cudaStreamSynchronize(s));
  CUDA(api.cudaStreamSynchronize(s2));
  Judge(checks);
  NCCL(api.ncclCommDestroy(comm));
  Pass();
}

// Run with a long SHVD_FAKE_CUDA_DELAY_US, so "right after enqueue" is reliably early.
// Its reads before synchronizing race with the stream on purpose (ThreadSanitizer says so).
void StreamOrder() {
  ncclComm_t comm = Join();
  cudaStream_t s1 = NewStream(), s2 = NewStream();
  cudaEvent_t e1 = NewEvent(), e2 = NewEvent();
  const int n = g_size;
  const std::vector<double> old = Iota(4, -1, 0);
  void* buf = DevCopy(Encoded(kF32, old));
  void* pinned_in = nullptr;
  void* pinned_out = nullptr;
  CUDA(api.cudaMallocHost(&pinned_in, 16));
  CUDA(api.cudaMallocHost(&pinned_out, 16));
  auto mine = Encoded(kF32, Iota(4, g_rank + 1.0, g_rank + 1.0));
  std::memcpy(pinned_in, mine.data(), 16);
  CUDA(api.cudaMemcpyAsync(buf, pinned_in, 16, cudaMemcpyHostToDevice, s1));
  NCCL(api.ncclAllReduce(buf, buf, 4, ncclFloat32, ncclSum, comm, s1));
  CUDA(api.cudaEventRecord(e1, s1));
  // Read at once without waiting: nothing has run yet.
  ExpectValues("read before the stream ran", Decoded(kF32, Get(buf, 16)), old);
  EXPECT_EQ(api.cudaEventQuery(e1), cudaErrorNotReady);
  // s2 copies the result out once e1 has fired.
  void* copy = DevAlloc(16);
  CUDA(api.cudaStreamWaitEvent(s2, e1, 0));
  CUDA(api.cudaMemcpyAsync(copy, buf, 16, cudaMemcpyDeviceToDevice, s2));
  CUDA(api.cudaMemcpyAsync(pinned_out, copy, 16, cudaMemcpyDeviceToHost, s2));
  CUDA(api.cudaEventRecord(e2, s2));
  int not_ready = 0;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  cudaError_t q;
  while ((q = api.cudaEventQuery(e2)) == cudaErrorNotReady) {
    CHECK(std::chrono::steady_clock::now() < deadline);
    ++not_ready;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(q, cudaSuccess);
  CHECK(not_ready > 0);
  EXPECT_EQ(api.cudaEventQuery(e1), cudaSuccess);
  std::vector<char> out(16);
  std::memcpy(out.data(), pinned_out, 16);
  ExpectValues("result after cudaEventQuery", Decoded(kF32, out),
               Iota(4, n * (n + 1) / 2.0, n * (n + 1) / 2.0));
  // cudaStreamSynchronize waits; a queued memset is not visible before.
  CUDA(api.cudaMemsetAsync(buf, 0, 16, s1));
  EXPECT_EQ(Decoded(kF32, Get(buf, 16))[0], n * (n + 1) / 2.0);
  CUDA(api.cudaStreamSynchronize(s1));
  ExpectValues("after cudaStreamSynchronize", Decoded(kF32, Get(buf, 16)), Iota(4, 0, 0));
  // Every queued item takes at least SHVD_FAKE_CUDA_DELAY_US.
  const char* delay_env = std::getenv("SHVD_FAKE_CUDA_DELAY_US");
  const double delay_s = (delay_env ? std::atof(delay_env) : 200) * 1e-6;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i) CUDA(api.cudaMemsetAsync(buf, i, 16, s1));
  CUDA(api.cudaStreamSynchronize(s1));
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - t0;
  CHECK(took.count() >= 3 * delay_s);
  // An event never recorded is complete; cudaEventSynchronize waits for the marker.
  cudaEvent_t e3 = NewEvent();
  EXPECT_EQ(api.cudaEventQuery(e3), cudaSuccess);
  CUDA(api.cudaEventRecord(e3, s1));
  EXPECT_EQ(api.cudaEventQuery(e3), cudaErrorNotReady);
  CUDA(api.cudaEventSynchronize(e3));
  EXPECT_EQ(api.cudaEventQuery(e3), cudaSuccess);
  NCCL(api.ncclCommDestroy(comm));
  Pass();
}

// kind: count, dtype, root, p2p (rank 0 -> 1), departed (the last rank destroys its
// comm without taking part).
void Mismatch(const std::string& kind) {
  ncclComm_t comm = Join();
  cudaStream_t s = NewStream();
  const int me = g_rank, odd = g_size - 1;
  CHECK(g_size >= 2);
  if (kind == "departed" && me == odd) {
    NCCL(api.ncclCommDestroy(comm));
    Pass();
    return;
  }
  void* in = DevCopy(Encoded(kF32, Iota(5, 1)));
  void* out1 = DevCopy(Encoded(kF32, Iota(5, 9, 0)));
  void* out2 = DevCopy(Encoded(kF32, Iota(5, 9, 0)));
  // Each call is queued, or refused at once if the error already reached this rank.
  auto issued = [](ncclResult_t r) { CHECK(r == ncclSuccess || r == ncclInvalidUsage); };
  if (kind == "count" || kind == "departed") {
    issued(api.ncclAllReduce(in, out1, me == odd && kind == "count" ? 5 : 4, ncclFloat32, ncclSum,
                             comm, s));
  } else if (kind == "dtype") {
    issued(api.ncclAllReduce(in, out1, 4, me == odd ? ncclInt32 : ncclFloat32, ncclSum, comm, s));
  } else if (kind == "root") {
    issued(api.ncclBroadcast(in, out1, 4, ncclFloat32, me == odd ? 0 : 1, comm, s));
  } else if (kind == "p2p") {
    if (me == 0) issued(api.ncclSend(in, 4, ncclFloat32, 1, comm, s));
    if (me == 1) issued(api.ncclRecv(out1, 5, ncclFloat32, 0, comm, s));
  }
  // A matching call queued behind fails as well.
  if (kind != "p2p") issued(api.ncclAllReduce(in, out2, 4, ncclFloat32, ncclSum, comm, s));
  ncclResult_t err = ncclSuccess;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (err == ncclSuccess && std::chrono::steady_clock::now() < deadline) {
    NCCL(api.ncclCommGetAsyncError(comm, &err));
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CUDA(api.cudaStreamSynchronize(s));  // the failed calls let the stream move on
  EXPECT_EQ(err, ncclInvalidUsage);
  const std::string text = api.ncclGetLastError(comm);
  std::printf("LAST_ERROR %s\n", text.c_str());
  const std::map<std::string, std::vector<std::string>> evidence = {
      {"count", {"count=4", "count=5"}},
      {"dtype", {"ncclFloat32", "ncclInt32"}},
      {"root", {"root=0", "root=1"}},
      {"p2p", {"count=4", "count=5"}},
      {"departed", {"rank " + std::to_string(odd), "destroyed"}}};
  for (const auto& part : evidence.at(kind)) CHECK(Contains(text, part));
  ExpectValues("untouched output", Decoded(kF32, Get(out1, 20)), Iota(5, 9, 0));
  ExpectValues("untouched output", Decoded(kF32, Get(out2, 20)), Iota(5, 9, 0));
  EXPECT_EQ(api.ncclAllReduce(in, out1, 4, ncclFloat32, ncclSum, comm, s), ncclInvalidUsage);
  NCCL(api.ncclCommDestroy(comm));
  Pass();
}

// Ungrouped, a send waits for its recv: both ranks sending first deadlock, as with real
// NCCL, until ncclCommAbort.
void UngroupedDeadlock() {
  ncclComm_t comm = Join();
  cudaStream_t s = NewStream();
  cudaEvent_t e = NewEvent();
  const int peer = 1 - g_rank;
  void* out = DevCopy(Encoded(kF32, {1, 2}));
  void* in = DevCopy(Encoded(kF32, {9, 9}));
  NCCL(api.ncclSend(out, 2, ncclFloat32, peer, comm, s));
  NCCL(api.ncclRecv(in, 2, ncclFloat32, peer, comm, s));
  CUDA(api.cudaEventRecord(e, s));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(api.cudaEventQuery(e), cudaErrorNotReady);
  ncclResult_t err;
  NCCL(api.ncclCommGetAsyncError(comm, &err));
  EXPECT_EQ(err, ncclSuccess);               // a hang, not an error
  Touch("stuck." + std::to_string(g_rank));  // both stuck before either aborts
  CHECK(WaitForFile(g_dir + "/stuck." + std::to_string(peer), 30));
  NCCL(api.ncclCommAbort(comm));
  CUDA(api.cudaStreamSynchronize(s));
  ExpectValues("recv of an aborted exchange", Decoded(kF32, Get(in, 8)), {9, 9});
  Pass();
}

void GroupErrors() {
  EXPECT_EQ(api.ncclGroupEnd(), ncclInvalidUsage);
  CHECK(Contains(api.ncclGetLastError(nullptr), "ncclGroupStart"));
  NCCL(api.ncclGroupStart());
  NCCL(api.ncclGroupStart());
  NCCL(api.ncclGroupEnd());
  NCCL(api.ncclGroupEnd());
  EXPECT_EQ(api.ncclGroupEnd(), ncclInvalidUsage);
  // A call that fails inside a group fails the group: none of it runs.
  ncclComm_t comm = JoinAlone();
  cudaStream_t s = NewStream();
  void* in = DevCopy(Encoded(kF32, {1, 2}));
  void* out = DevCopy(Encoded(kF32, {9, 9}));
  float host[2] = {0, 0};
  NCCL(api.ncclGroupStart());
  NCCL(api.ncclAllReduce(in, out, 2, ncclFloat32, ncclSum, comm, s));
  EXPECT_EQ(api.ncclAllReduce(host, out, 2, ncclFloat32, ncclSum, comm, s), ncclInvalidArgument);
  EXPECT_EQ(api.ncclGroupEnd(), ncclInvalidArgument);
  CUDA(api.cudaStreamSynchronize(s));
  ExpectValues("a failed group issued nothing", Decoded(kF32, Get(out, 8)), {9, 9});
  NCCL(api.ncclAllReduce(in, out, 2, ncclFloat32, ncclSum, comm, s));  // the comm still works
  CUDA(api.cudaStreamSynchronize(s));
  ExpectValues("after the failed group", Decoded(kF32, Get(out, 8)), {1, 2});
  NCCL(api.ncclCommDestroy(comm));
  Pass();
}

void UseAfterAbort() {
  ncclComm_t comm = Join();
  cudaStream_t s = NewStream();
  void* buf = DevCopy(Encoded(kF32, {1, 2}));
  NCCL(api.ncclAllReduce(buf, buf, 2, ncclFloat32, ncclSum, comm, s));
  CUDA(api.cudaStreamSynchronize(s));
  NCCL(api.ncclCommAbort(comm));
  ncclResult_t err;
  EXPECT_EQ(api.ncclAllReduce(buf, buf, 2, ncclFloat32, ncclSum, comm, s), ncclInvalidUsage);
  CHECK(Contains(api.ncclGetLastError(nullptr), "destroyed or aborted"));
  EXPECT_EQ(api.ncclCommGetAsyncError(comm, &err), ncclInvalidUsage);
  EXPECT_EQ(api.ncclCommAbort(comm), ncclInvalidUsage);
  EXPECT_EQ(api.ncclCommDestroy(comm), ncclInvalidUsage);
  NCCL(api.ncclGroupStart());
  EXPECT_EQ(api.ncclSend(buf, 2, ncclFloat32, 0, comm, s), ncclInvalidUsage);
  EXPECT_EQ(api.ncclGroupEnd(), ncclInvalidUsage);
  ncclComm_t gone = JoinAlone();
  NCCL(api.ncclCommDestroy(gone));
  EXPECT_EQ(api.ncclBroadcast(buf, buf, 2, ncclFloat32, 0, gone, s), ncclInvalidUsage);
  // Reduction ops: per communicator, per dtype, dead once destroyed.
  ncclComm_t a = JoinAlone(), b = JoinAlone();
  float two = 2;
  ncclRedOp_t op;
  NCCL(api.ncclRedOpCreatePreMulSum(&op, &two, ncclFloat32, ncclScalarHostImmediate, a));
  CHECK(op >= ncclNumOps);
  EXPECT_EQ(api.ncclAllReduce(buf, buf, 2, ncclFloat32, op, b, s), ncclInvalidArgument);
  EXPECT_EQ(api.ncclAllReduce(buf, buf, 2, ncclInt32, op, a, s), ncclInvalidArgument);
  NCCL(api.ncclAllReduce(buf, buf, 2, ncclFloat32, op, a, s));
  CUDA(api.cudaStreamSynchronize(s));
  ExpectValues("premulsum on one rank", Decoded(kF32, Get(buf, 8)), {2.0 * g_size, 4.0 * g_size});
  NCCL(api.ncclRedOpDestroy(op, a));
  EXPECT_EQ(api.ncclRedOpDestroy(op, a), ncclInvalidArgument);
  EXPECT_EQ(api.ncclAllReduce(buf, buf, 2, ncclFloat32, op, a, s), ncclInvalidArgument);
  EXPECT_EQ(api.ncclRedOpDestroy(ncclSum, a), ncclInvalidArgument);
  EXPECT_EQ(api.ncclAllReduce(buf, buf, 2, ncclFloat32, ncclRedOp_t(-1), a, s),
            ncclInvalidArgument);
  NCCL(api.ncclCommDestroy(a));
  NCCL(api.ncclCommDestroy(b));
  Pass();
}

// Run with SHVD_FAKE_CUDA_DEVICES=1: every rank on device 0 of one host.
void DuplicateDevice() {
  CUDA(api.cudaSetDevice(0));
  ncclUniqueId id = ShareId();
  ncclComm_t comm = nullptr;
  EXPECT_EQ(api.ncclCommInitRank(&comm, g_size, id, g_rank), ncclInvalidUsage);
  const std::string text = api.ncclGetLastError(nullptr);
  std::printf("LAST_ERROR %s\n", text.c_str());
  CHECK(Contains(text, "Duplicate GPU detected"));
  Pass();
}

void InitErrors() {
  UseOwnDevice();
  ncclUniqueId id = ShareId();
  ncclComm_t comm = nullptr;
  EXPECT_EQ(api.ncclCommInitRank(&comm, g_size + g_rank, id, g_rank), ncclInvalidUsage);
  CHECK(Contains(api.ncclGetLastError(nullptr), "nranks"));
  ncclUniqueId garbage;
  std::memset(&garbage, 7, sizeof garbage);
  EXPECT_EQ(api.ncclCommInitRank(&comm, 1, garbage, 0), ncclInvalidArgument);
  EXPECT_EQ(api.ncclCommInitRank(&comm, 2, id, 2), ncclInvalidArgument);
  Pass();
}

void Smoke() {
  ncclComm_t comm = Join();
  void* buf = DevCopy(Encoded(kF32, {g_rank + 1.0}));
  NCCL(api.ncclAllReduce(buf, buf, 1, ncclFloat32, ncclSum, comm, nullptr));  // null stream: now
  ExpectValues("smoke", Decoded(kF32, Get(buf, 4)), {g_size * (g_size + 1) / 2.0});
  NCCL(api.ncclCommDestroy(comm));
  Pass();
}

// Run with SHVD_FAKE_CUDA_DEVICES=2 on one rank.
void InvalidArguments() {
  int count = 0;
  CUDA(api.cudaGetDeviceCount(&count));
  EXPECT_EQ(count, 2);
  EXPECT_EQ(api.cudaSetDevice(2), 101);
  EXPECT_EQ(api.cudaSetDevice(-1), 101);
  char host[64] = {}, host2[64] = {};
  char* dev = static_cast<char*>(DevAlloc(64));
  char* dev2 = static_cast<char*>(DevAlloc(64));
  void* pinned = nullptr;
  CUDA(api.cudaMallocHost(&pinned, 64));
  EXPECT_EQ(api.cudaFree(host), 1);
  EXPECT_EQ(api.cudaFree(dev + 4), 1);
  EXPECT_EQ(api.cudaFreeHost(dev), 1);
  EXPECT_EQ(api.cudaFree(pinned), 1);
  EXPECT_EQ(api.cudaMemcpyAsync(host, host2, 64, cudaMemcpyHostToDevice, nullptr), 1);
  EXPECT_EQ(api.cudaMemcpyAsync(dev, dev2, 64, cudaMemcpyHostToDevice, nullptr), 1);
  EXPECT_EQ(api.cudaMemcpyAsync(host, host2, 64, cudaMemcpyDeviceToHost, nullptr), 1);
  EXPECT_EQ(api.cudaMemcpyAsync(dev, host, 64, cudaMemcpyDeviceToDevice, nullptr), 1);
  EXPECT_EQ(api.cudaMemcpyAsync(dev, host, 64, cudaMemcpyHostToHost, nullptr), 1);
  EXPECT_EQ(api.cudaMemcpyAsync(dev + 8, host, 64, cudaMemcpyHostToDevice, nullptr), 1);
  EXPECT_EQ(api.cudaMemcpyAsync(dev, host, 8, 7, nullptr), 21);
  EXPECT_EQ(api.cudaMemsetAsync(host, 0, 8, nullptr), 1);
  EXPECT_EQ(api.cudaMemsetAsync(dev + 60, 0, 8, nullptr), 1);
  CUDA(api.cudaMemcpyAsync(host, pinned, 64, cudaMemcpyHostToHost, nullptr));
  CUDA(api.cudaMemcpyAsync(dev, pinned, 64, cudaMemcpyDefault, nullptr));
  CUDA(api.cudaMemcpyAsync(dev2, dev, 64, cudaMemcpyDefault, nullptr));
  // NCCL: buffers must be this comm's device memory, streams live and on its device.
  ncclComm_t comm = JoinAlone();
  cudaStream_t s = NewStream(), dead = NewStream();
  CUDA(api.cudaStreamDestroy(dead));
  CUDA(api.cudaSetDevice(1));
  void* other_dev = DevAlloc(64);
  cudaStream_t other_stream = NewStream();
  CUDA(api.cudaSetDevice(0));
  EXPECT_EQ(api.ncclAllReduce(host, dev, 4, ncclFloat32, ncclSum, comm, s), ncclInvalidArgument);
  EXPECT_EQ(api.ncclAllReduce(dev, pinned, 4, ncclFloat32, ncclSum, comm, s), ncclInvalidArgument);
  EXPECT_EQ(api.ncclAllReduce(dev, dev, 17, ncclFloat32, ncclSum, comm, s), ncclInvalidArgument);
  EXPECT_EQ(api.ncclAllReduce(other_dev, other_dev, 4, ncclFloat32, ncclSum, comm, s),
            ncclInvalidArgument);
  CHECK(Contains(api.ncclGetLastError(nullptr), "mismatches with NCCL device"));
  EXPECT_EQ(api.ncclAllReduce(dev, dev, 4, ncclFloat32, ncclSum, comm, other_stream),
            ncclUnhandledCudaError);
  EXPECT_EQ(api.ncclAllReduce(dev, dev, 4, ncclFloat32, ncclSum, comm, dead),
            ncclUnhandledCudaError);
  EXPECT_EQ(api.ncclAllReduce(dev, dev, 4, ncclDataType_t(42), ncclSum, comm, s),
            ncclInvalidArgument);
  EXPECT_EQ(api.ncclBroadcast(dev, dev, 4, ncclFloat32, 1, comm, s), ncclInvalidArgument);
  EXPECT_EQ(api.ncclSend(dev, 4, ncclFloat32, -1, comm, s), ncclInvalidArgument);
  EXPECT_EQ(api.ncclAllGather(dev, dev, 17, ncclFloat32, comm, s), ncclInvalidArgument);
  EXPECT_EQ(api.ncclAllReduce(dev, dev, 4, ncclFloat32, ncclSum, nullptr, s), ncclInvalidArgument);
  float two = 2;
  ncclRedOp_t op;
  EXPECT_EQ(api.ncclRedOpCreatePreMulSum(&op, &two, ncclFloat32, ncclScalarDevice, comm),
            ncclInvalidArgument);
  NCCL(api.ncclAllReduce(dev, dev, 4, ncclFloat32, ncclSum, comm, s));  // still usable
  CUDA(api.cudaStreamSynchronize(s));
  NCCL(api.ncclCommDestroy(comm));
  Pass();
}

// Run with SHVD_FAKE_CUDA_DEVICES=3.
void CudaBasics() {
  int v = 0;
  CUDA(api.cudaRuntimeGetVersion(&v));
  EXPECT_EQ(v, 12040);
  NCCL(api.ncclGetVersion(&v));
  EXPECT_EQ(v, 22304);
  CUDA(api.cudaGetDeviceCount(&v));
  EXPECT_EQ(v, 3);
  CUDA(api.cudaGetDevice(&v));
  EXPECT_EQ(v, 0);
  CUDA(api.cudaSetDevice(2));
  CUDA(api.cudaGetDevice(&v));
  EXPECT_EQ(v, 2);
  std::thread([] {  // the current device is per thread
    int d = -1;
    CUDA(api.cudaGetDevice(&d));
    EXPECT_EQ(d, 0);
  })
      .join();
  char* p = static_cast<char*>(DevAlloc(10));
  EXPECT_EQ(uintptr_t(p) % 256, 0u);
  for (char c : Get(p, 10)) EXPECT_EQ(int(uint8_t(c)), 0xFF);
  void* z = p;
  CUDA(api.cudaMalloc(&z, 0));
  CHECK(z == nullptr);
  CUDA(api.cudaFree(nullptr));
  CUDA(api.cudaFree(p));
  for (int code : {0, 1, 2, 21, 100, 101, 400, 600})
    CHECK(std::strcmp(api.cudaGetErrorString(code), "unrecognized error code") != 0);
  CHECK(std::strcmp(api.cudaGetErrorString(12345), "unrecognized error code") == 0);
  for (int code = 0; code <= 7; ++code)
    CHECK(std::strcmp(api.ncclGetErrorString(code), "unknown result code") != 0);
  // One instance: NCCL uses the runtime that was dlopened.
  CHECK(dlsym(api.cudart, "shvd_fake_enqueue") == dlsym(api.nccl, "shvd_fake_enqueue"));
  cudaStream_t s = nullptr;
  EXPECT_EQ(api.cudaStreamCreateWithFlags(&s, 0x10), 1);
  s = NewStream();
  cudaEvent_t e = NewEvent();
  EXPECT_EQ(api.cudaEventQuery(e), cudaSuccess);
  EXPECT_EQ(api.cudaStreamWaitEvent(s, e, 1), 1);
  CUDA(api.cudaStreamDestroy(s));
  CUDA(api.cudaEventDestroy(e));
  EXPECT_EQ(api.cudaStreamSynchronize(s), 400);
  EXPECT_EQ(api.cudaStreamDestroy(s), 400);
  EXPECT_EQ(api.cudaEventQuery(e), 400);
  EXPECT_EQ(api.cudaEventRecord(NewEvent(), s), 400);
  Pass();
}

// Run with CUDA_VISIBLE_DEVICES="".
void NoDevice() {
  int count = -1;
  EXPECT_EQ(api.cudaGetDeviceCount(&count), 100);
  EXPECT_EQ(count, 0);
  Pass();
}

// Run with a long SHVD_FAKE_CUDA_DELAY_US: destroy returns only after the queued work.
void DestroyWaits() {
  ncclComm_t comm = Join();
  cudaStream_t s = NewStream();
  void* buf = DevCopy(Encoded(kF32, Iota(4, g_rank + 1.0, 0)));
  NCCL(api.ncclAllReduce(buf, buf, 4, ncclFloat32, ncclSum, comm, s));
  NCCL(api.ncclCommDestroy(comm));
  ExpectValues("after destroy", Decoded(kF32, Get(buf, 16)),
               Iota(4, g_size * (g_size + 1) / 2.0, 0));
  Pass();
}

bool ProcessGone(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string skip, state;
  return !(stat >> skip >> skip >> state) || state == "Z";
}

// Rank 0 hosts the coordinator: once everyone's calls are done it may destroy its comm
// and exit; the others see no error until they call again, which then fails (no hang).
void HomeLeavesFirst() {
  ncclComm_t comm = Join();
  cudaStream_t s = NewStream();
  void* buf = DevCopy(Encoded(kF32, {1}));
  NCCL(api.ncclAllReduce(buf, buf, 1, ncclFloat32, ncclSum, comm, s));
  CUDA(api.cudaStreamSynchronize(s));
  if (g_rank == 0) {
    NCCL(api.ncclCommDestroy(comm));
    std::ofstream(g_dir + "/home.pid") << getpid();
    std::printf("PASS\n");
    return;
  }
  CHECK(WaitForFile(g_dir + "/home.pid", 30));
  int pid = 0;
  std::ifstream(g_dir + "/home.pid") >> pid;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!ProcessGone(pid)) {
    CHECK(std::chrono::steady_clock::now() < deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // its sockets closed
  ncclResult_t err;
  NCCL(api.ncclCommGetAsyncError(comm, &err));
  EXPECT_EQ(err, ncclSuccess);
  NCCL(api.ncclAllReduce(buf, buf, 1, ncclFloat32, ncclSum, comm, s));
  CUDA(api.cudaStreamSynchronize(s));
  NCCL(api.ncclCommGetAsyncError(comm, &err));
  EXPECT_EQ(err, ncclInvalidUsage);
  std::printf("LAST_ERROR %s\n", api.ncclGetLastError(comm));
  CHECK(Contains(api.ncclGetLastError(comm), "stay alive"));
  NCCL(api.ncclCommDestroy(comm));
  std::printf("PASS\n");
}

// The victim rank dies (SIGKILL) while the others' allreduce waits for it. Its own
// allreduce is queued behind a minute-long kernel, so it never reaches the coordinator
// (however late the kill comes): the others' first call can never complete.
void PeerKilled(int victim) {
  ncclComm_t comm = Join();
  cudaStream_t s = NewStream();
  cudaEvent_t e = NewEvent();
  void* in = DevCopy(Encoded(kF32, {1, 2, 3}));
  void* out = DevCopy(Encoded(kF32, {9, 9, 9}));
  if (g_rank == victim) {
    for (int r = 0; r < g_size; ++r)
      if (r != victim) CHECK(WaitForFile(g_dir + "/enqueued." + std::to_string(r), 30));
    CUDA(LaunchKernel(s, 60u * 1000 * 1000));
    NCCL(api.ncclAllReduce(in, out, 3, ncclFloat32, ncclSum, comm, s));
    std::raise(SIGKILL);
  }
  NCCL(api.ncclAllReduce(in, out, 3, ncclFloat32, ncclSum, comm, s));
  NCCL(api.ncclAllReduce(in, out, 3, ncclFloat32, ncclSum, comm, s));  // queued behind
  CUDA(api.cudaEventRecord(e, s));
  Touch("enqueued." + std::to_string(g_rank));
  auto start = std::chrono::steady_clock::now();
  auto ms = [&] {
    return long(std::chrono::duration_cast<std::chrono::milliseconds>(
                    std::chrono::steady_clock::now() - start)
                    .count());
  };
  ncclResult_t err = ncclSuccess;
  while (err == ncclSuccess && ms() < 20000) {
    NCCL(api.ncclCommGetAsyncError(comm, &err));
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::printf("DETECTED_MS %ld\nLAST_ERROR %s\n", ms(), api.ncclGetLastError(comm));
  EXPECT_EQ(err, ncclRemoteError);
  EXPECT_EQ(api.cudaEventQuery(e), cudaErrorNotReady);  // still blocked, as a spinning kernel
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(api.cudaEventQuery(e), cudaErrorNotReady);
  EXPECT_EQ(api.ncclAllReduce(in, out, 3, ncclFloat32, ncclSum, comm, s), ncclRemoteError);
  NCCL(api.ncclCommAbort(comm));
  CUDA(api.cudaStreamSynchronize(s));  // abort let the blocked calls finish
  EXPECT_EQ(api.cudaEventQuery(e), cudaSuccess);
  ExpectValues("output of an aborted call", Decoded(kF32, Get(out, 12)), {9, 9, 9});
  EXPECT_EQ(api.ncclAllReduce(in, out, 3, ncclFloat32, ncclSum, comm, s), ncclInvalidUsage);
  std::printf("PASS\n");  // no Pass(): rank 0 may be the one that died
}

// Host code that touches device memory dies of SIGSEGV, as on a GPU: reading it, or
// passing a device pointer as a host-immediate scalar. Neither prints UNREACHABLE.
void HostReadsDeviceMemory() {
  UseOwnDevice();
  volatile char* p = static_cast<char*>(DevAlloc(64));
  std::printf("UNREACHABLE %d\n", p[0]);
}

void DevicePointerAsHostScalar() {
  ncclComm_t comm = JoinAlone();
  void* two = DevCopy(Encoded(kF32, {2}));
  ncclRedOp_t op;
  ncclResult_t rc =
      api.ncclRedOpCreatePreMulSum(&op, two, ncclFloat32, ncclScalarHostImmediate, comm);
  std::printf("UNREACHABLE %d\n", rc);
}

const std::map<std::string, std::function<void()>>& Scenarios() {
  static const std::map<std::string, std::function<void()>> table = {
      {"collectives", Collectives},
      {"grouped", Grouped},
      {"stream_order", StreamOrder},
      {"mismatch_count", [] { Mismatch("count"); }},
      {"mismatch_dtype", [] { Mismatch("dtype"); }},
      {"mismatch_root", [] { Mismatch("root"); }},
      {"mismatch_p2p", [] { Mismatch("p2p"); }},
      {"mismatch_departed", [] { Mismatch("departed"); }},
      {"group_errors", GroupErrors},
      {"ungrouped_deadlock", UngroupedDeadlock},
      {"use_after_abort", UseAfterAbort},
      {"duplicate_device", DuplicateDevice},
      {"init_errors", InitErrors},
      {"smoke", Smoke},
      {"invalid_arguments", InvalidArguments},
      {"cuda_basics", CudaBasics},
      {"no_device", NoDevice},
      {"destroy_waits", DestroyWaits},
      {"home_leaves_first", HomeLeavesFirst},
      {"kill_last", [] { PeerKilled(g_size - 1); }},
      {"kill_home", [] { PeerKilled(0); }},
      {"host_reads_device_memory", HostReadsDeviceMemory},
      {"device_pointer_as_host_scalar", DevicePointerAsHostScalar},
  };
  return table;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s CUDART_SO NCCL_SO SCENARIO RANK SIZE DIR\n", argv[0]);
    return 2;
  }
  g_rank = std::atoi(argv[4]);
  g_size = std::atoi(argv[5]);
  g_dir = argv[6];
  Load(argv[1], argv[2]);
  auto it = Scenarios().find(argv[3]);
  if (it == Scenarios().end()) {
    std::fprintf(stderr, "unknown scenario %s\n", argv[3]);
    return 2;
  }
  it->second();
  return 0;
}
