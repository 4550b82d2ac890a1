"""Every SPARK_HVD_* setting, mirrored from the native core (csrc/common/env.h).

Each knob is a ``FOO_ENV_VAR`` / ``DEFAULT_FOO`` pair; units are in the names.
The core reads its own copy once at init; Python reads these where it needs them.
"""

FUSION_THRESHOLD_ENV_VAR = "SPARK_HVD_FUSION_THRESHOLD"  # bytes; 0 disables fusion
DEFAULT_FUSION_THRESHOLD_BYTES = 64 * 1024 * 1024
CYCLE_TIME_ENV_VAR = "SPARK_HVD_CYCLE_TIME_MS"
DEFAULT_CYCLE_TIME_MS = 1.0
IDLE_CYCLE_TIME_ENV_VAR = "SPARK_HVD_IDLE_CYCLE_TIME_MS"  # longest pause while all ranks idle
DEFAULT_IDLE_CYCLE_TIME_MS = 10.0
GLOO_DATA_PLANE_ENV_VAR = "SPARK_HVD_GLOO_DATA_PLANE"  # "tcp" (own connections) or "gloo"
DEFAULT_GLOO_DATA_PLANE = "tcp"
GLOO_CHUNK_BYTES_ENV_VAR = "SPARK_HVD_GLOO_CHUNK_BYTES"  # "gloo" plane: allreduce pieces
DEFAULT_GLOO_CHUNK_BYTES = 16 * 1024 * 1024
CACHE_CAPACITY_ENV_VAR = "SPARK_HVD_CACHE_CAPACITY"  # response-cache entries; 0 disables
DEFAULT_CACHE_CAPACITY = 1024
STALL_CHECK_TIME_ENV_VAR = "SPARK_HVD_STALL_CHECK_TIME_S"
DEFAULT_STALL_CHECK_TIME_S = 60.0
STALL_SHUTDOWN_TIME_ENV_VAR = "SPARK_HVD_STALL_SHUTDOWN_TIME_S"  # 0 = only warn
DEFAULT_STALL_SHUTDOWN_TIME_S = 0.0
TIMEOUT_ENV_VAR = "SPARK_HVD_TIMEOUT_S"  # a silent peer is declared lost after this
DEFAULT_TIMEOUT_S = 30.0
START_TIMEOUT_ENV_VAR = "SPARK_HVD_START_TIMEOUT_S"  # rendezvous at init
DEFAULT_START_TIMEOUT_S = 60.0
TIMELINE_ENV_VAR = "SPARK_HVD_TIMELINE"  # path of a Chrome-trace JSON file
LOG_LEVEL_ENV_VAR = "SPARK_HVD_LOG_LEVEL"  # trace, debug, info, warning, error
LOST_RANK_WAIT_ENV_VAR = "SPARK_HVD_LOST_RANK_WAIT_S"  # how long an error waits to name lost ranks
DEFAULT_LOST_RANK_WAIT_S = 2.0


def get_float(name: str, default: float) -> float:
    import os

    value = os.environ.get(name, "")
    try:
        return float(value) if value else default
    except ValueError as exc:
        raise ValueError(f"{name}={value!r} is not a number") from exc
