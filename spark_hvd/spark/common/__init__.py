"""Horovod's ``horovod.spark.common`` paths: :mod:`.store` (the Stores) and :mod:`.backend`
(``SparkBackend``)."""
