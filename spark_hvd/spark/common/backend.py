"""Horovod's ``horovod.spark.common.backend`` path: ``Backend`` and ``SparkBackend``.

The estimators take ``backend=SparkBackend(num_proc=4)`` as Horovod's do and read only its
``num_processes()``; ``SparkBackend.run`` launches through :func:`spark_hvd.spark.run`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from spark_hvd.exceptions import InvalidArgumentError

__all__ = ["Backend", "SparkBackend", "default_num_proc"]


def default_num_proc() -> int:
    """Horovod's default: the active SparkContext's ``defaultParallelism``; under Spark
    Connect (no SparkContext here), every task slot, as :func:`spark_hvd.spark.run`."""
    from spark_hvd.spark import _checks
    from spark_hvd.spark.runner import check_launch

    spark = _checks.active_session()
    if not _checks.is_connect(spark):
        return int(spark.sparkContext.defaultParallelism)
    return check_launch(spark=spark)


class Backend:
    """Where an estimator's training function runs (Horovod's interface)."""

    def run(self, fn: Callable, args: Sequence = (), kwargs: Optional[Mapping[str, Any]] = None,
            env: Optional[Mapping[str, str]] = None) -> List[Any]:
        """Runs ``fn(*args, **kwargs)`` on every process; their values in rank order."""
        raise NotImplementedError()

    def num_processes(self) -> int:
        """How many processes train."""
        raise NotImplementedError()


class SparkBackend(Backend):
    """Runs the training function with :func:`spark_hvd.spark.run`.

    Parameters
    ----------
    num_proc:
        Number of processes; default :func:`default_num_proc` (Horovod's:
        ``defaultParallelism``).
    env:
        Variables added to every process's environment (spark_hvd's ``run`` starts the
        processes with the executor's environment, not the driver's whole one).
    **kwargs:
        More arguments of :func:`spark_hvd.spark.run` (``start_timeout``, ``verbose``,
        ``stdout``...), passed at each ``run``.
    """

    def __init__(self, num_proc: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
                 **kwargs: Any) -> None:
        if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int)
                                     or num_proc < 1):
            raise InvalidArgumentError(f"SparkBackend(num_proc={num_proc!r}): num_proc must be "
                                       f"an int >= 1, or None for Spark's default parallelism")
        self._num_proc = num_proc or default_num_proc()
        self._env: Dict[str, str] = dict(env or {})
        self._kwargs = kwargs

    def run(self, fn: Callable, args: Sequence = (), kwargs: Optional[Mapping[str, Any]] = None,
            env: Optional[Mapping[str, str]] = None) -> List[Any]:
        from spark_hvd.spark.runner import run

        full_env = dict(self._env)
        full_env.update(env or {})
        # As Horovod: the ranks see every GPU Spark gives them, whatever the driver hid.
        full_env.pop("CUDA_VISIBLE_DEVICES", None)
        return run(fn, args=tuple(args), kwargs=dict(kwargs or {}), num_proc=self._num_proc,
                   env=full_env, **self._kwargs)

    def num_processes(self) -> int:
        return self._num_proc
