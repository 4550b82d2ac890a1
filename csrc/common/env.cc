#include "common/env.h"

#include <cctype>
#include <cstdlib>

#include "common/logging.h"

namespace spark_hvd {
namespace env {
namespace {

// The variable that decides the setting: `name` when it is set, else the alias.
const char* Lookup(const char* name, const char* alias, const char** used) {
  *used = name;
  const char* v = std::getenv(name);
  if (v == nullptr && *alias != '\0') {
    *used = alias;
    v = std::getenv(alias);
  }
  return v;
}

// A value as Settings() and Effective() hand it out (a Name as the String it is).
Value AsValue(Int v) { return v; }
Value AsValue(Float v) { return v; }
Value AsValue(const String& v) { return v; }

}  // namespace

bool IsSet(const char* name, const char* alias) {
  const char* used;
  const char* v = Lookup(name, alias, &used);
  return v != nullptr && *v != '\0';
}

Int Read(const char* name, const char* alias, Int default_value) {
  const char* used;
  const char* v = Lookup(name, alias, &used);
  if (v == nullptr || *v == '\0') return default_value;
  char* end = nullptr;
  long long parsed = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0') {
    SHVD_LOG(kWarning, "env") << used << "=" << v << " is not an integer; using " << default_value;
    return default_value;
  }
  return parsed;
}

Float Read(const char* name, const char* alias, Float default_value) {
  const char* used;
  const char* v = Lookup(name, alias, &used);
  if (v == nullptr || *v == '\0') return default_value;
  char* end = nullptr;
  double parsed = std::strtod(v, &end);
  if (end == v || *end != '\0') {
    SHVD_LOG(kWarning, "env") << used << "=" << v << " is not a number; using " << default_value;
    return default_value;
  }
  return parsed;
}

String Read(const char* name, const char* alias, const String& default_value) {
  const char* used;
  const char* v = Lookup(name, alias, &used);
  return (v == nullptr) ? default_value : String(v);
}

Name Read(const char* name, const char* alias, const Name& default_value) {
  Name value(Read(name, alias, static_cast<const String&>(default_value)));
  for (auto& c : value) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return value;
}

const std::vector<Setting>& Settings() {
  static const std::vector<Setting> settings = {
#define SHVD_SETTING(getter, name, type, default_value, unit, meaning, alias) \
  {name, #type, AsValue(type(default_value)), unit, meaning, alias},
#include "spark_hvd/settings.def"
#undef SHVD_SETTING
  };
  return settings;
}

bool Effective(const std::string& name, Value* value) {
#define SHVD_SETTING(getter, name_, type, default_value, unit, meaning, alias) \
  if (name == name_) {                                                         \
    *value = AsValue(getter());                                                \
    return true;                                                               \
  }
#include "spark_hvd/settings.def"
#undef SHVD_SETTING
  return false;
}

}  // namespace env
}  // namespace spark_hvd
