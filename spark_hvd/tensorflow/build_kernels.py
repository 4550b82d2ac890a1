"""``python -m spark_hvd.tensorflow.build_kernels``: compiles spark_hvd's TensorFlow kernels
for the installed TensorFlow into ``SPARK_HVD_TF_KERNELS_DIR`` ahead of their first use
(an image, a CI cache) and prints the library's path."""

import logging

from spark_hvd.tensorflow._kernels import build

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(build())
