"""``import spark_hvd.keras as hvd`` in place of ``horovod.keras``: with Keras 3 on
TensorFlow this is the same API as :mod:`spark_hvd.tensorflow.keras` (Horovod's two
Keras modules differed only in which Keras they imported)."""

from spark_hvd.tensorflow.keras import *  # noqa: F401,F403
from spark_hvd.tensorflow.keras import __all__  # noqa: F401
from spark_hvd.tensorflow.keras import callbacks  # noqa: F401
