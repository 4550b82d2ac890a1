#include "engine/instance.h"

namespace spark_hvd {

Engine& TheEngine() {
  static Engine* engine = new Engine();
  return *engine;
}

}  // namespace spark_hvd
