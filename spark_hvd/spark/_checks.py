"""Checks ``spark_hvd.spark.run`` makes before it launches anything.

Each failure is an InvalidArgumentError that names the setting to change.  The
checks work on a plain mapping of Spark conf values (:func:`read_conf`), so they
hold the same for classic Spark and Spark Connect and can be tested without Spark.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from spark_hvd.exceptions import InvalidArgumentError

MASTER = "spark.master"
DRIVER_HOST = "spark.driver.host"
DRIVER_BIND_ADDRESS = "spark.driver.bindAddress"
TASK_CPUS = "spark.task.cpus"
EXECUTOR_CORES = "spark.executor.cores"
EXECUTOR_INSTANCES = "spark.executor.instances"
DYNAMIC_ALLOCATION = "spark.dynamicAllocation.enabled"
TASK_GPU_AMOUNT = "spark.task.resource.gpu.amount"
EXECUTOR_GPU_AMOUNT = "spark.executor.resource.gpu.amount"

CONF_KEYS = (MASTER, DRIVER_HOST, DRIVER_BIND_ADDRESS, TASK_CPUS, EXECUTOR_CORES,
             EXECUTOR_INSTANCES, DYNAMIC_ALLOCATION, TASK_GPU_AMOUNT, EXECUTOR_GPU_AMOUNT)

_LOCAL = re.compile(r"local(?:\[\s*(\*|\d+)\s*(?:,\s*\d+\s*)?\])?")
_LOCAL_CLUSTER = re.compile(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\]")


@dataclass(frozen=True)
class Plan:
    """What a launch will do: ``num_proc`` barrier tasks, GPUs pinned or not."""

    num_proc: int
    use_gpu: bool
    slots: Optional[int]


def is_connect(spark) -> bool:
    """Whether ``spark`` is a Spark Connect session (no SparkContext on this side)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def active_session():
    """The active (or default) SparkSession; InvalidArgumentError when there is none."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise InvalidArgumentError("spark_hvd.spark.run needs pyspark: pip install "
                                   "'spark_hvd[spark]'") from None
    spark = SparkSession.getActiveSession()
    if spark is None:
        try:
            spark = SparkSession.active()
        except Exception:
            spark = None
    if spark is None:
        raise InvalidArgumentError(
            "spark_hvd.spark.run needs an active SparkSession: create one first with "
            "SparkSession.builder...getOrCreate() (or pass spark=...)")
    return spark


def read_conf(spark) -> dict:
    """The conf values the checks and the launch need (None where unset)."""
    return {key: spark.conf.get(key, None) for key in CONF_KEYS}


def registered_slots(spark) -> Optional[int]:
    """Task slots of the executors registered now, as Spark's barrier check counts them.

    Classic Spark only (None under Connect or when the private API is not there).
    """
    if is_connect(spark):
        return None
    try:
        jsc = spark.sparkContext._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception:
        return None


def _number(conf: Mapping[str, Optional[str]], key: str, default: Optional[float] = None
            ) -> Optional[float]:
    value = conf.get(key)
    if value is None or str(value).strip() == "":
        return default
    try:
        return float(value)
    except ValueError:
        raise InvalidArgumentError(f"{key}={value!r} is not a number") from None


def _per_executor(conf: Mapping[str, Optional[str]], cores: int, task_cpus: int) -> int:
    slots = cores // task_cpus
    task_gpus = _number(conf, TASK_GPU_AMOUNT)
    executor_gpus = _number(conf, EXECUTOR_GPU_AMOUNT)
    if task_gpus and executor_gpus is not None:
        slots = min(slots, int(math.floor(executor_gpus / task_gpus + 1e-9)))
    return slots


def task_slots(conf: Mapping[str, Optional[str]],
               registered: Callable[[], Optional[int]] = lambda: None) -> Optional[int]:
    """How many tasks the cluster can run at once, or None when it cannot be told.

    From the master string for ``local[N]`` (N, tasks never get resources there) and
    ``local-cluster[W,C,M]`` (W executors of C cores); from
    spark.executor.instances x spark.executor.cores when both are set; else the
    slots of the executors registered now (``registered()``), if any.
    """
    master = (conf.get(MASTER) or "").strip()
    task_cpus = int(_number(conf, TASK_CPUS, 1))
    if task_cpus < 1:
        raise InvalidArgumentError(f"{TASK_CPUS}={conf.get(TASK_CPUS)} must be >= 1")
    m = _LOCAL.fullmatch(master)
    if m:
        cores = (os.cpu_count() or 1) if m.group(1) == "*" else int(m.group(1) or 1)
        return cores // task_cpus
    m = _LOCAL_CLUSTER.fullmatch(master)
    if m:
        return int(m.group(1)) * _per_executor(conf, int(m.group(2)), task_cpus)
    instances, cores = _number(conf, EXECUTOR_INSTANCES), _number(conf, EXECUTOR_CORES)
    if instances is not None and cores is not None:
        return int(instances) * _per_executor(conf, int(cores), task_cpus)
    return registered() or None


def _check_gpu(conf: Mapping[str, Optional[str]], use_gpu: Optional[bool]) -> bool:
    """Whether ranks get GPUs pinned; raises for settings that cannot work."""
    if use_gpu is False:
        return False
    if use_gpu not in (None, True):
        raise InvalidArgumentError(f"use_gpu must be True, False or None, got {use_gpu!r}")
    master = (conf.get(MASTER) or "").strip()
    amount = _number(conf, TASK_GPU_AMOUNT)
    if use_gpu is None and not amount:
        return False
    if _LOCAL.fullmatch(master):
        if use_gpu is None:
            return False
        raise InvalidArgumentError(
            f"use_gpu=True, but {MASTER}={master} never assigns GPUs to tasks: run on a "
            f"cluster (or local-cluster[...]) with {TASK_GPU_AMOUNT} set, or pass use_gpu=False")
    if amount is None or amount <= 0:
        raise InvalidArgumentError(
            f"use_gpu=True needs {TASK_GPU_AMOUNT} (e.g. 1) so that Spark gives each rank its "
            f"own GPUs; it is not set (also set {EXECUTOR_GPU_AMOUNT} and "
            f"spark.executor.resource.gpu.discoveryScript)")
    if amount != int(amount):
        raise InvalidArgumentError(
            f"{TASK_GPU_AMOUNT}={conf.get(TASK_GPU_AMOUNT)} is fractional: ranks would share a "
            f"GPU; set it to a whole number of GPUs per rank (e.g. 1)"
            + (" or pass use_gpu=False" if use_gpu is None else ""))
    return True


def plan(conf: Mapping[str, Optional[str]], num_proc: Optional[int],
         use_gpu: Optional[bool] = None,
         registered: Callable[[], Optional[int]] = lambda: None, *,
         barrier: bool = True, name: str = "num_proc") -> Plan:
    """Validate a launch of ``num_proc`` ranks against the Spark conf.

    ``barrier=False`` is an elastic launch (:func:`spark_hvd.spark.run_elastic`): its
    tasks need no barrier, so dynamic allocation is fine (and then executors still to
    come count, so the slots are not checked); ``num_proc`` is then the number of
    workers that must run at once for the job to start, named ``name`` in messages.
    """
    if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int)
                                 or num_proc < 1):
        raise InvalidArgumentError(f"{name} must be an int >= 1 (or None for every task "
                                   f"slot), got {num_proc!r}")
    dynamic = str(conf.get(DYNAMIC_ALLOCATION) or "").strip().lower() == "true"
    if dynamic and barrier:
        raise InvalidArgumentError(
            f"{DYNAMIC_ALLOCATION}=true: Spark's barrier mode, which spark_hvd.spark.run uses "
            f"to start all ranks together, does not work with dynamic allocation; set "
            f"{DYNAMIC_ALLOCATION}=false (or use spark_hvd.spark.run_elastic)")
    gpu = _check_gpu(conf, use_gpu)
    slots = None if dynamic else task_slots(conf, registered)
    master = conf.get(MASTER) or "?"
    if num_proc is None:
        if slots is None:
            raise InvalidArgumentError(
                f"cannot tell how many tasks {MASTER}={master} can run at once (no executor "
                f"has registered, {EXECUTOR_INSTANCES}/{EXECUTOR_CORES} are not set, or "
                f"{DYNAMIC_ALLOCATION} is on): pass {name}")
        num_proc = slots
    if slots is not None and num_proc > slots:
        how = f"{MASTER}={master}, {TASK_CPUS}={conf.get(TASK_CPUS) or 1}"
        if gpu:
            how += f", {TASK_GPU_AMOUNT}={conf.get(TASK_GPU_AMOUNT)}"
        need = "every rank needs its own task slot at the same time" if barrier else \
            "the job starts only once that many workers run at the same time"
        raise InvalidArgumentError(
            f"{name}={num_proc} is more than the {slots} tasks the cluster can run at once "
            f"({how}); {need}: lower {name} or give the cluster more executors/cores "
            f"({EXECUTOR_INSTANCES}, {EXECUTOR_CORES}, {TASK_CPUS})")
    if num_proc < 1:
        raise InvalidArgumentError(f"the cluster has no task slot ({MASTER}={master}, "
                                   f"{TASK_CPUS}={conf.get(TASK_CPUS) or 1})")
    return Plan(num_proc=num_proc, use_gpu=gpu, slots=slots)
