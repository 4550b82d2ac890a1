"""Horovod's public names, module by module, as Horovod's API documentation lists them
(docs/api.rst's automodule/autoclass entries: each module's exported names), against
spark_hvd's module at the same path. A name is either there or listed, with the reason, in
the "Horovod names spark_hvd does not have" table of docs/migrate-horovod.md."""

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

MIGRATION = Path(__file__).resolve().parents[2] / "docs" / "migrate-horovod.md"

# Horovod module -> (spark_hvd module, Horovod's public names there, what its classes need)
SURFACE = {
    "horovod.spark": ("spark_hvd.spark", ["run", "run_elastic"], None),
    "horovod.spark.torch": ("spark_hvd.spark.torch", ["TorchEstimator", "TorchModel"],
                            "torch"),
    "horovod.spark.keras": ("spark_hvd.spark.keras", ["KerasEstimator", "KerasModel"],
                            "tensorflow"),
    "horovod.spark.lightning": ("spark_hvd.spark.lightning", ["TorchEstimator", "TorchModel"],
                                "pytorch_lightning"),
    "horovod.spark.common.store": (
        "spark_hvd.spark.common.store",
        ["Store", "AbstractFilesystemStore", "FilesystemStore", "LocalStore", "HDFSStore",
         "DBFSLocalStore"], "pyarrow"),
    "horovod.spark.common.backend": ("spark_hvd.spark.common.backend",
                                     ["Backend", "SparkBackend", "default_num_proc"], None),
    "horovod.torch": ("spark_hvd.torch", [
        "elastic", "Compression", "allgather_object", "broadcast_object",
        "broadcast_optimizer_state", "broadcast_parameters", "allreduce", "allreduce_async",
        "allreduce_", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_async",
        "grouped_allreduce_", "grouped_allreduce_async_", "sparse_allreduce_async",
        "allgather", "allgather_async", "broadcast", "broadcast_async", "broadcast_",
        "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
        "reducescatter_async", "join", "barrier", "poll", "synchronize", "init", "shutdown",
        "is_initialized", "start_timeline", "stop_timeline", "size", "local_size",
        "cross_size", "rank", "local_rank", "cross_rank", "mpi_threads_supported",
        "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
        "ccl_built", "cuda_built", "rocm_built", "ProcessSet", "global_process_set",
        "add_process_set", "remove_process_set", "Average", "Sum", "Adasum",
        "DistributedOptimizer", "SyncBatchNorm"], "torch"),
}

def _listed_missing() -> set:
    """The backticked Horovod names of docs/migrate-horovod.md's table of what spark_hvd does
    not have."""
    text = MIGRATION.read_text(encoding="utf-8")
    section = text.split("## Horovod names spark_hvd does not have", 1)[1]
    section = section.split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `horovod")]
    return {name for row in rows for name in re.findall(r"`(horovod\.[\w.]+)`",
                                                        row.split("|")[1])}


@pytest.mark.parametrize("horovod_module", sorted(SURFACE))
def test_horovod_names_are_here_or_listed_with_the_reason(horovod_module):
    ours, names, needs = SURFACE[horovod_module]
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} is not installed")
    module = importlib.import_module(ours)
    listed = _listed_missing()
    # Lazy modules (the estimator paths) name what they give in __all__, loaded on first use
    # (tests/estimators/test_horovod_paths.py loads them and checks they are the same classes).
    missing = [n for n in names if n not in getattr(module, "__all__", ()) and
               not hasattr(module, n)]
    unexplained = [n for n in missing if f"{horovod_module}.{n}" not in listed]
    assert not unexplained, (f"{ours} lacks Horovod's {horovod_module} names {unexplained}: "
                             f"add them, or list them in docs/migrate-horovod.md's table with "
                             f"the reason")
    stale = [n for n in names if n not in missing and f"{horovod_module}.{n}" in listed]
    assert not stale, (f"docs/migrate-horovod.md lists {stale} of {horovod_module} as missing, "
                       f"but {ours} has them")


def test_an_unknown_name_is_an_attribute_error():
    import spark_hvd.spark.torch

    with pytest.raises(AttributeError, match="TorchEstimatr"):
        spark_hvd.spark.torch.TorchEstimatr  # noqa: B018


def test_spark_backend_gives_the_estimators_num_proc_and_refuses_a_bad_one():
    from spark_hvd.exceptions import InvalidArgumentError
    from spark_hvd.spark.common.backend import SparkBackend

    assert SparkBackend(num_proc=3).num_processes() == 3
    with pytest.raises(InvalidArgumentError, match="num_proc=0"):
        SparkBackend(num_proc=0)
