"""``spark_hvd.spark.TorchDistributor``: pyspark's ``TorchDistributor``, launched by spark_hvd.

A program written for ``pyspark.ml.torch.distributor.TorchDistributor`` changes its import
line only::

    from spark_hvd.spark import TorchDistributor     # was: from pyspark.ml.torch.distributor

    model = TorchDistributor(num_processes=2, local_mode=False, use_gpu=True).run(train, 1e-3)
    TorchDistributor(num_processes=2, local_mode=False).run("/path/train.py", "--lr=1e-3")

The processes get the torch.distributed environment ``torchrun`` gives (see
:mod:`spark_hvd.spark._torch_rank`), so an unchanged DDP or FSDP program calling
``dist.init_process_group("gloo" or "nccl")`` trains; they are also ranks of a spark_hvd job,
so ``spark_hvd.init()`` and its collectives work in them too. ``local_mode=False`` runs them
with :func:`spark_hvd.spark.run` (one barrier task per process, GPUs pinned as ``run`` pins
them), ``local_mode=True`` with :func:`spark_hvd.runner.run` on the driver host; both print
every process's output prefixed ``[rank]`` and raise one error carrying a failing rank's
traceback.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, List, Optional, Union

from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.spark import _checks
from spark_hvd.spark._task import _child_pythonpath
from spark_hvd.spark._torch_rank import RankSpec, main as _rank_main

logger = logging.getLogger(__name__)

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
SSL_ENABLED = "spark.ssl.enabled"
DRIVER_GPU_AMOUNT = "spark.driver.resource.gpu.amount"
_TORCH_SSL_CONF = "pytorch.spark.distributor.ignoreSsl"  # pyspark's override key


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"TorchDistributor({name}={value!r}): {name} must be True or "
                                   f"False")
    return value


class TorchDistributor:
    """pyspark's ``TorchDistributor``, with spark_hvd's launch.

    Parameters
    ----------
    num_processes:
        How many processes train (one rank each).
    local_mode:
        True: the processes run on the driver host (pyspark's default); False: each is one
        task of a Spark barrier stage on the executors.
    use_gpu:
        Give the processes GPUs: with ``local_mode=True`` the driver's
        (``spark.driver.resource.gpu.amount``; every process sees them all, ``LOCAL_RANK``
        picks one, as torchrun), else each task's own (``spark.task.resource.gpu.amount``
        1). False hides the GPUs of the executors' processes, as pyspark does.
    spark:
        The SparkSession (classic or Connect); default the active one.
    verbose:
        As :func:`spark_hvd.spark.run`'s (0: no output on the driver, 1: the processes'
        output, 2: also what the launch does).
    start_timeout:
        Seconds for every process to start; as :func:`spark_hvd.spark.run`'s.

    Raises
    ------
    InvalidArgumentError
        For arguments or Spark settings that cannot work, naming the value and the fix.
    """

    def __init__(self, num_processes: int = 1, local_mode: bool = True, use_gpu: bool = True,
                 _ssl_conf: str = _TORCH_SSL_CONF, *, spark=None, verbose: int = 1,
                 start_timeout: Optional[float] = None) -> None:
        if isinstance(num_processes, bool) or not isinstance(num_processes, int) \
                or num_processes < 1:
            raise InvalidArgumentError(f"TorchDistributor(num_processes={num_processes!r}): "
                                       f"num_processes must be an int >= 1")
        self.num_processes = num_processes
        self.local_mode = _flag("local_mode", local_mode)
        self.use_gpu = _flag("use_gpu", use_gpu)
        if isinstance(verbose, bool) or verbose not in (0, 1, 2):
            raise InvalidArgumentError(f"TorchDistributor(verbose={verbose!r}): verbose must "
                                       f"be 0, 1 or 2")
        self.verbose = verbose
        self.start_timeout = start_timeout
        self.spark = spark if spark is not None else (
            None if local_mode and not use_gpu else _checks.active_session())
        self._ssl_conf = _ssl_conf
        self._gpus: Optional[List[str]] = None
        if self.local_mode and self.use_gpu and not _checks.is_connect(self.spark):
            self._gpus = self._driver_gpus()
        elif not self.local_mode:
            self._check_cluster()

    # -- checks ---------------------------------------------------------------------------

    def _driver_gpus(self) -> List[str]:
        """The driver's GPUs the processes share (as pyspark: at most num_processes, which
        is lowered, with a warning, to the number of GPUs when there are fewer)."""
        from spark_hvd.spark._task import visible_devices

        resources = self.spark.sparkContext.resources
        gpu = resources.get("gpu")
        if gpu is None or not gpu.addresses:
            raise InvalidArgumentError(
                f"TorchDistributor(local_mode=True, use_gpu=True) runs the processes on the "
                f"driver's GPUs, but the driver has none: set {DRIVER_GPU_AMOUNT} and "
                f"spark.driver.resource.gpu.discoveryScript, or pass use_gpu=False")
        gpus = visible_devices(gpu.addresses, os.environ.get(CUDA_VISIBLE_DEVICES)).split(",")
        if self.num_processes > len(gpus):
            logger.warning("TorchDistributor: num_processes=%d is more than the driver's %d "
                           "GPUs; running %d processes (as pyspark's TorchDistributor does)",
                           self.num_processes, len(gpus), len(gpus))
            self.num_processes = len(gpus)
        return gpus[:self.num_processes]

    def _check_cluster(self) -> None:
        """local_mode=False: what spark_hvd.spark.run would refuse, and pyspark's refusals."""
        from spark_hvd.spark.runner import check_launch

        conf = self.spark.conf
        if str(conf.get(SSL_ENABLED, "false")).lower() == "true" and \
                str(conf.get(self._ssl_conf, "false")).lower() != "true":
            raise InvalidArgumentError(
                f"{SSL_ENABLED}=true, but the training processes' torch.distributed traffic is "
                f"not encrypted; to train anyway set {self._ssl_conf}=true in the Spark conf")
        amount = _checks.read_conf(self.spark).get(_checks.TASK_GPU_AMOUNT)
        if self.use_gpu and amount is not None and str(amount).strip() not in ("", "1", "1.0"):
            raise InvalidArgumentError(
                f"{_checks.TASK_GPU_AMOUNT}={amount}: spark_hvd's TorchDistributor runs one "
                f"process per Spark task, on that task's GPU; set {_checks.TASK_GPU_AMOUNT}=1 "
                f"(num_processes is then the number of GPUs that train)")
        check_launch(num_proc=self.num_processes, use_gpu=self.use_gpu, spark=self.spark)

    @staticmethod
    def _spec(local_mode: bool, train_object: Union[Callable, str, "os.PathLike[str]"],
              args: tuple, kwargs: Dict[str, Any]) -> RankSpec:
        if callable(train_object):
            return RankSpec(local_mode, fn=train_object, args=args, kwargs=kwargs)
        if not isinstance(train_object, (str, os.PathLike)):
            raise InvalidArgumentError(
                f"TorchDistributor.run: train_object must be a function or the path of a "
                f"Python script, got {type(train_object).__name__}")
        if kwargs:
            raise InvalidArgumentError(
                f"TorchDistributor.run({os.fspath(train_object)!r}, ...): a script takes "
                f"command-line arguments only (as strings), not keyword arguments "
                f"{sorted(kwargs)}")
        path = os.path.abspath(os.fspath(train_object))
        if not os.path.isfile(path):
            raise InvalidArgumentError(
                f"TorchDistributor.run: the script {path} does not exist on the driver (the "
                f"processes run it by that path: it must exist there"
                + ("" if local_mode else " and on every executor") + ")")
        return RankSpec(local_mode, script=path, args=tuple(str(a) for a in args))

    # -- the launch -----------------------------------------------------------------------

    def run(self, train_object: Union[Callable, str], *args: Any, **kwargs: Any
            ) -> Optional[Any]:
        """Runs ``train_object`` in ``num_processes`` processes, as pyspark's ``run``.

        Parameters
        ----------
        train_object:
            A function (called with ``*args, **kwargs`` in every process) or the path of a
            Python script (run as ``python script *args`` in every process, as torchrun
            would).
        *args, **kwargs:
            The function's arguments; a script's command-line arguments (no ``kwargs``).

        Returns
        -------
        object or None
            The function's return value on rank 0; None for a script.

        Raises
        ------
        InvalidArgumentError
            Before anything starts, for arguments that cannot work.
        RankFailedError
            When a process fails; with its traceback (a script's output tail).
        """
        spec = self._spec(self.local_mode, train_object, args, kwargs)
        env: Dict[str, str] = {}
        if self.local_mode:
            if self._gpus is not None:
                env[CUDA_VISIBLE_DEVICES] = ",".join(self._gpus)
            # What this Python imports, the processes import (modules the function's
            # pickle names by reference), as spark_hvd.spark.run gives its tasks' children.
            env["PYTHONPATH"] = _child_pythonpath(os.environ)
            if self.num_processes > 1 and not os.environ.get("OMP_NUM_THREADS"):
                env["OMP_NUM_THREADS"] = "1"  # as torchrun with more than one process a node
            from spark_hvd.runner import run as run_here

            values = run_here(_rank_main, args=(spec,), np=self.num_processes, env=env,
                              start_timeout=self.start_timeout, verbose=self.verbose >= 2)
        else:
            if not self.use_gpu:
                env[CUDA_VISIBLE_DEVICES] = ""  # as pyspark: the processes see no GPU
            from spark_hvd.spark.runner import run

            values = run(_rank_main, args=(spec,), num_proc=self.num_processes, env=env,
                         use_gpu=self.use_gpu, spark=self.spark, verbose=self.verbose,
                         start_timeout=self.start_timeout)
        return values[0]
