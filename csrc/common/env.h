// Every SPARK_HVD_* setting, read once (at first use) through cached getters generated
// from the one declaration table, spark_hvd/settings.def (Python reads the same file).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace spark_hvd {
namespace env {

// The types a setting can have (the Type column of settings.def).
using Int = int64_t;
using Float = double;
using String = std::string;
// A string naming one of a few choices (a backend, a level), read in lower case, so
// Horovod's spellings (HOROVOD_CPU_OPERATIONS=GLOO) mean what they mean there.
struct Name : String {
  Name() = default;
  Name(const char* s) : String(s) {}  // NOLINT: converts like a String default
  explicit Name(String s) : String(std::move(s)) {}
};

// The variable's value, or default_value when it is unset or empty (String and Name:
// unset only). When `name` is unset (absent) and `alias` is not "", the alias (a
// Horovod name) is read instead. A number that does not parse is logged and replaced
// by the default.
Int Read(const char* name, const char* alias, Int default_value);
Float Read(const char* name, const char* alias, Float default_value);
String Read(const char* name, const char* alias, const String& default_value);
Name Read(const char* name, const char* alias, const Name& default_value);

using Value = std::variant<Int, Float, String>;

// One row of settings.def, for spark_hvd._core.settings().
struct Setting {
  const char* name;
  const char* type;  // "Int", "Float", "String" or "Name"
  Value default_value;
  const char* unit;
  const char* meaning;
  const char* alias;  // "" when Horovod has no equivalent
};
const std::vector<Setting>& Settings();

// The value the getter of setting `name` (SPARK_HVD_...) returns; false when no setting
// has that name. For spark_hvd._core.setting_value() (tests compare it with Python's).
bool Effective(const std::string& name, Value* value);

// Is the variable, or when it is absent its alias, set to a non-empty value?
bool IsSet(const char* name, const char* alias);

// One getter per setting, e.g. env::FusionThresholdBytes(), and one saying whether the
// value was chosen rather than defaulted, e.g. env::FusionThresholdBytesIsSet().
#define SHVD_SETTING(getter, name, type, default_value, unit, meaning, alias) \
  inline const type& getter() {                                               \
    static const type v = Read(name, alias, type(default_value));             \
    return v;                                                                 \
  }                                                                           \
  inline bool getter##IsSet() { return IsSet(name, alias); }
#include "spark_hvd/settings.def"
#undef SHVD_SETTING

}  // namespace env
}  // namespace spark_hvd
