"""Where Horovod keeps its shared modules (``horovod.common``): scripts that import
``horovod.common.exceptions`` import ``spark_hvd.common.exceptions`` instead."""
