// The process's one Engine, shared by the two ways into it: the Python binding
// (csrc/python/bindings.cc) and the C entry points for framework adapters
// (csrc/capi/c_api.cc). Both live in the _core module.
#pragma once

#include "engine/engine.h"

namespace spark_hvd {

// Made on first use and deliberately never destroyed: its thread is joined by
// shutdown() (also registered with atexit by spark_hvd), not by static destructors.
Engine& TheEngine();

}  // namespace spark_hvd
