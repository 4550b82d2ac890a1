#include "engine/message.h"

#include <cstdio>
#include <cstring>

namespace spark_hvd {

bool Request::Signature(const Request& o) const {
  return name == o.name && op == o.op && dtype == o.dtype && shape == o.shape &&
         reduce_op == o.reduce_op && prescale == o.prescale && postscale == o.postscale &&
         root == o.root && process_set == o.process_set && device == o.device &&
         splits == o.splits && group == o.group && group_size == o.group_size;
}

void AssignTensorKey(std::string* out, int32_t process_set, const std::string& name) {
  char set[16];
  const int n = std::snprintf(set, sizeof(set), "%d/", process_set);
  out->assign(set, static_cast<size_t>(n));
  out->append(name);
}

int64_t Response::TotalElements() const {
  int64_t n = 0;
  for (const auto& t : tensors) n += NumElements(t.shape);
  return n;
}

void Writer::Raw(const void* p, size_t n) { buf_.append(static_cast<const char*>(p), n); }

void Writer::Str(const std::string& s) {
  I64(static_cast<int64_t>(s.size()));
  Raw(s.data(), s.size());
}

void Writer::Vec(const std::vector<int64_t>& v) {
  I64(static_cast<int64_t>(v.size()));
  if (!v.empty()) Raw(v.data(), v.size() * sizeof(int64_t));
}

void Reader::Raw(void* out, size_t n) {
  SHVD_CHECK_LE(static_cast<ptrdiff_t>(n), end_ - p_);
  std::memcpy(out, p_, n);
  p_ += n;
}

int32_t Reader::I32() {
  int32_t v;
  Raw(&v, sizeof(v));
  return v;
}
int64_t Reader::I64() {
  int64_t v;
  Raw(&v, sizeof(v));
  return v;
}
double Reader::F64() {
  double v;
  Raw(&v, sizeof(v));
  return v;
}

std::string Reader::Str() {
  int64_t n = I64();
  SHVD_CHECK_LE(n, end_ - p_);
  std::string s(p_, static_cast<size_t>(n));
  p_ += n;
  return s;
}

std::vector<int64_t> Reader::Vec() {
  int64_t n = I64();
  SHVD_CHECK_LE(n * static_cast<int64_t>(sizeof(int64_t)), end_ - p_);
  std::vector<int64_t> v(static_cast<size_t>(n));
  if (n) Raw(v.data(), static_cast<size_t>(n) * sizeof(int64_t));
  return v;
}

void WriteRequest(Writer& w, const Request& r) {
  w.I32(r.rank);
  w.Str(r.name);
  w.I32(static_cast<int32_t>(r.op));
  w.I32(static_cast<int32_t>(r.dtype));
  w.Vec(r.shape);
  w.I32(static_cast<int32_t>(r.reduce_op));
  w.F64(r.prescale);
  w.F64(r.postscale);
  w.I32(r.root);
  w.I32(r.process_set);
  w.I32(r.device);
  w.Vec(r.splits);
  w.Str(r.group);
  w.I32(r.group_size);
}

Request ReadRequest(Reader& rd) {
  Request r;
  r.rank = rd.I32();
  r.name = rd.Str();
  r.op = static_cast<OpType>(rd.I32());
  r.dtype = static_cast<DataType>(rd.I32());
  r.shape = rd.Vec();
  r.reduce_op = static_cast<ReduceOp>(rd.I32());
  r.prescale = rd.F64();
  r.postscale = rd.F64();
  r.root = rd.I32();
  r.process_set = rd.I32();
  r.device = rd.I32();
  r.splits = rd.Vec();
  r.group = rd.Str();
  r.group_size = rd.I32();
  return r;
}

}  // namespace spark_hvd
