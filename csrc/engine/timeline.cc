#include "engine/timeline.h"

#include <chrono>

namespace spark_hvd {
namespace {

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

int64_t NowMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool Timeline::Start(const std::string& path, int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  if (file_ != nullptr) return true;
  file_ = std::fopen(path.c_str(), "w");
  if (file_ == nullptr) return false;
  rank_ = rank;
  first_ = true;
  rows_.clear();
  std::fputs("{\"traceEvents\": [\n", file_);
  return true;
}

void Timeline::Stop() {
  std::lock_guard<std::mutex> lock(mu_);
  if (file_ == nullptr) return;
  std::fputs("\n]}\n", file_);
  std::fclose(file_);
  file_ = nullptr;
}

int Timeline::Row(const std::string& tensor) {
  auto it = rows_.find(tensor);
  if (it != rows_.end()) return it->second;
  int row = static_cast<int>(rows_.size()) + 1;
  rows_[tensor] = row;
  std::fprintf(file_,
               "%s{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, "
               "\"args\": {\"name\": \"%s\"}}",
               first_ ? "" : ",\n", rank_, row, JsonEscape(tensor).c_str());
  first_ = false;
  return row;
}

void Timeline::Event(const std::string& tensor, const std::string& phase, int64_t start_us,
                     int64_t end_us) {
  std::lock_guard<std::mutex> lock(mu_);
  if (file_ == nullptr) return;
  int row = Row(tensor);
  std::fprintf(file_,
               ",\n{\"name\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %d, \"ts\": %lld, "
               "\"dur\": %lld, \"args\": {\"tensor\": \"%s\"}}",
               JsonEscape(phase).c_str(), rank_, row, static_cast<long long>(start_us),
               static_cast<long long>(end_us > start_us ? end_us - start_us : 0),
               JsonEscape(tensor).c_str());
  std::fflush(file_);
}

}  // namespace spark_hvd
