"""Driver-side pieces of a job: the rendezvous service, rank topology and the launcher.

``spark-hvdrun`` (``python -m spark_hvd.runner``) is :func:`spark_hvd.runner.launch.main`.
"""

from spark_hvd._job.topology import Topology, assign
from spark_hvd.runner.rendezvous import RendezvousClient, RendezvousServer

__all__ = ["RendezvousClient", "RendezvousServer", "Topology", "assign"]
