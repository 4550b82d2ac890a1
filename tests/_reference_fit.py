"""A TorchEstimator fit and transform that every pyspark the suite runs must reproduce.

The data is made in Spark from ``id`` alone (``spark.range`` in two partitions, features by
SQL), so every Spark version and master writes the same two Parquet files and the ranks read
the same rows in the same order; the model, the seed and torch are the same in every
environment (the old-Spark venvs take torch from the main one).  The predictions of
pyspark 4.3 (``arrow_udf``) are stored in ``_reference_fit.json``; tests/estimators checks
4.3 against them and tests/spark_versions checks 3.5 and 4.0 (``pandas_udf``).  Within
REFERENCE_ATOL: the same operations on the same values, but not promised bit for bit.

    .venv/bin/python tests/_reference_fit.py    # writes _reference_fit.json again (4.3)
"""

import json
import os
import sys

import numpy as np

ROWS = 240
CLASSES = 3
REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_reference_fit.json")
REFERENCE_ATOL = 1e-6


def frame(spark):
    """``id``, a 4-wide ``features`` Vector and a ``label`` in 0..2, from ``id`` only."""
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F
    i = F.col("id").cast("double")
    features = F.array(F.sin(i * 0.37), F.cos(i * 0.11), F.sin(i * 0.05 + 1.0), (i % 13) / 13)
    label = (F.when(F.sin(i * 0.37) + F.cos(i * 0.11) > 0.5, 2)
             .when(F.sin(i * 0.05 + 1.0) > 0, 1).otherwise(0))
    return spark.range(ROWS, numPartitions=2).select(
        "id", array_to_vector(features).alias("features"), label.cast("long").alias("label"))


def estimator(store):
    import torch
    import torch.nn.functional as F
    from spark_hvd.estimators import TorchEstimator
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, CLASSES))
    return TorchEstimator(num_proc=2, store=store, model=net,
                          optimizer=torch.optim.SGD(net.parameters(), lr=0.2), loss=F.cross_entropy,
                          feature_cols=["features"], label_cols=["label"], batch_size=16, epochs=2,
                          random_seed=1, verbose=0, mlflow_log=False)


def predictions(model, df):
    """The model's outputs for ``df``'s rows in ``id`` order, as a (rows, 3) array."""
    rows = model.transform(df).select("id", "label__output").orderBy("id").collect()
    return np.array([r["label__output"].toArray() for r in rows])


def fit_and_predict(spark, store):
    df = frame(spark)
    return predictions(estimator(store).fit(df), df)


def stored() -> np.ndarray:
    with open(REFERENCE) as f:
        return np.array(json.load(f)["predictions"])


def main() -> int:
    import tempfile

    from pyspark.sql import SparkSession

    from spark_hvd.estimators import LocalStore
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false") \
        .getOrCreate()
    with tempfile.TemporaryDirectory() as tmp:
        got = fit_and_predict(spark, LocalStore(os.path.join(tmp, "store")))
    with open(REFERENCE, "w") as f:
        json.dump({"pyspark": spark.version, "predictions": got.tolist()}, f)
        f.write("\n")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
