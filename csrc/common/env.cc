#include "common/env.h"

#include <cstdlib>

#include "common/logging.h"

namespace spark_hvd {
namespace env {

Int Read(const char* name, Int default_value) {
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

Float Read(const char* name, Float default_value) {
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

String Read(const char* name, const String& default_value) {
  const char* v = std::getenv(name);
  return (v == nullptr) ? default_value : String(v);
}

const std::vector<Setting>& Settings() {
  static const std::vector<Setting> settings = {
#define SHVD_SETTING(getter, name, type, default_value, unit, meaning) \
  {name, #type, type(default_value), unit, meaning},
#include "spark_hvd/settings.def"
#undef SHVD_SETTING
  };
  return settings;
}

}  // namespace env
}  // namespace spark_hvd
