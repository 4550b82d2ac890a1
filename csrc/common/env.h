// Every SPARK_HVD_* setting, read once (at first use) through cached getters generated
// from the one declaration table, spark_hvd/settings.def (Python reads the same file).
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace spark_hvd {
namespace env {

// The types a setting can have (the Type column of settings.def).
using Int = int64_t;
using Float = double;
using String = std::string;

// The variable's value, or default_value when it is unset or empty (String: unset only);
// a number that does not parse is logged and replaced by the default.
Int Read(const char* name, Int default_value);
Float Read(const char* name, Float default_value);
String Read(const char* name, const String& default_value);

// One row of settings.def, for spark_hvd._core.settings().
struct Setting {
  const char* name;
  const char* type;  // "Int", "Float" or "String"
  std::variant<Int, Float, String> default_value;
  const char* unit;
  const char* meaning;
};
const std::vector<Setting>& Settings();

// One getter per setting, e.g. env::FusionThresholdBytes().
#define SHVD_SETTING(getter, name, type, default_value, unit, meaning) \
  inline const type& getter() {                                       \
    static const type v = Read(name, type(default_value));            \
    return v;                                                         \
  }
#include "spark_hvd/settings.def"
#undef SHVD_SETTING

}  // namespace env
}  // namespace spark_hvd
