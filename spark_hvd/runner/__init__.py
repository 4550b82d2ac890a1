"""Driver-side pieces of a job: the rendezvous service, rank topology and the launcher.

``spark-hvdrun`` (``python -m spark_hvd.runner``) is :func:`spark_hvd.runner.launch.main`;
:func:`run` is Horovod's ``horovod.runner.run`` (a Python function as N ranks).
"""

from spark_hvd._job.topology import Topology, assign
from spark_hvd.runner._run_func import run
from spark_hvd.runner.rendezvous import RendezvousClient, RendezvousServer

__all__ = ["RendezvousClient", "RendezvousServer", "Topology", "assign", "run"]
