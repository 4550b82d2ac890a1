"""``python -m spark_hvd.runner``: the same as ``spark-hvdrun``."""

from spark_hvd.runner.launch import main

if __name__ == "__main__":
    main()
