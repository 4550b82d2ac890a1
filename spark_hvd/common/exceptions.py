"""``horovod.common.exceptions``'s names, from :mod:`spark_hvd.exceptions`."""

from spark_hvd.exceptions import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]
