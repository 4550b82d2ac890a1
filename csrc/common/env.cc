#include "common/env.h"

#include <cstdlib>

#include "common/logging.h"

namespace spark_hvd {
namespace env {

int64_t GetInt(const char* name, int64_t default_value) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return default_value;
  char* end = nullptr;
  long long parsed = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0') {
    SHVD_LOG(kWarning, "env") << name << "=" << v << " is not an integer; using " << default_value;
    return default_value;
  }
  return parsed;
}

double GetDouble(const char* name, double default_value) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return default_value;
  char* end = nullptr;
  double parsed = std::strtod(v, &end);
  if (end == v || *end != '\0') {
    SHVD_LOG(kWarning, "env") << name << "=" << v << " is not a number; using " << default_value;
    return default_value;
  }
  return parsed;
}

std::string GetString(const char* name, const std::string& default_value) {
  const char* v = std::getenv(name);
  return (v == nullptr) ? default_value : std::string(v);
}

}  // namespace env
}  // namespace spark_hvd
