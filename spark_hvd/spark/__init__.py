"""Run a function as a distributed spark_hvd job on Spark: ``spark_hvd.spark.run``.

::

    import spark_hvd.spark

    def train(lr):
        import spark_hvd as hvd
        hvd.init()
        ...
        return hvd.rank()

    results = spark_hvd.spark.run(train, args=(0.1,), num_proc=4)  # by rank

Each rank is one task of a Spark barrier stage; see :func:`run`.
:func:`run_elastic` runs an elastic job instead (workers may fail or join while it
trains), each worker a plain Spark task.  :class:`TorchDistributor` is pyspark's
``TorchDistributor`` on this launch (an unchanged DDP program trains).  pyspark is
imported only when one of them is used.
"""

from spark_hvd.spark._elastic import run_elastic
from spark_hvd.spark.distributor import TorchDistributor
from spark_hvd.spark._checks import is_connect
from spark_hvd.spark.runner import check_launch, plan_launch, run, run_planned

# plan_launch/run_planned (run's checks kept, then its launch on them) and is_connect are
# the seams the estimators, the layer above, use.
__all__ = ["TorchDistributor", "check_launch", "is_connect", "plan_launch", "run", "run_elastic",
           "run_planned"]
