"""Driver-side pieces of a job: the rendezvous service, rank topology and the launcher.

``spark-hvdrun`` (``python -m spark_hvd.runner``) is :func:`spark_hvd.runner.launch.main`;
:func:`run` is Horovod's ``horovod.runner.run`` (a Python function as N ranks).
"""

from spark_hvd._job.topology import Topology, assign
from spark_hvd.runner._elastic import Coordinator, check_sizes
from spark_hvd.runner._procs import LineRouter, ProcessGroup, Sink, describe_exit
from spark_hvd.runner._run_func import run
from spark_hvd.runner.rendezvous import RendezvousClient, RendezvousServer

# Besides the launcher's API, the seams spark_hvd.spark builds on: the elastic Coordinator
# and its size checks, and the rank processes' supervision and output routing.
__all__ = ["Coordinator", "LineRouter", "ProcessGroup", "RendezvousClient", "RendezvousServer",
           "Sink", "Topology", "assign", "check_sizes", "describe_exit", "run"]
