"""transform's Vector <-> array columns (estimators/_predict_udf.VectorColumns) give the
values of pyspark's ``vector_to_array`` and ``array_to_vector``, bit for bit, on every
pyspark the suite runs (Makefile SPARK_VERSIONS_TESTS runs this module on 3.5 and 4.0 too):
through the relabelled struct where the session allows it, and through those UDFs where it
does not (Spark Connect)."""

import math

import pytest

pytestmark = pytest.mark.spark


def _frame(spark):
    from pyspark.ml.linalg import DenseVector, SparseVector
    rows = [(0, DenseVector([1.5, -2.25, 3.1e-8])), (1, SparseVector(3, [1], [7.0])),
            (2, DenseVector([1e300, 0.1, -0.0])), (3, SparseVector(3, [], [])),
            (4, DenseVector([1.0 / 3, 2.0 / 3, -5e-324]))]
    return spark.createDataFrame(rows, ["id", "v"])


def _bits(values):
    """Each value with its sign, so that -0.0 and 0.0 differ (no NaN here)."""
    return [(x, math.copysign(1.0, x)) for x in values]


@pytest.mark.parametrize("relabel", [True, False], ids=["relabelled", "udfs"])
def test_vector_columns_give_the_values_of_pyspark_s_udfs(spark_local, relabel):
    from pyspark.ml.functions import array_to_vector, vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    from spark_hvd.estimators._predict_udf import VectorColumns
    df = _frame(spark_local)
    vectors = VectorColumns(df)
    assert vectors.relabels, "a classic session can declare a Vector's struct a Vector"
    if not relabel:
        vectors._relabel = None  # what a session without a JVM in the driver gets
    for dtype, element in (("float32", T.FloatType()), ("float64", T.DoubleType())):
        got = df.select("id", vectors.to_array(df["v"], dtype).alias("a"),
                        vector_to_array("v", dtype).alias("b"))
        assert got.schema["a"].dataType.elementType == element
        plan = got._jdf.queryExecution().optimizedPlan().toString()
        assert (".copy" in plan) == relabel, plan
        rows = got.orderBy("id").collect()
        assert len(rows) == 5 and all(len(r["a"]) == 3 for r in rows)
        for r in rows:
            assert _bits(r["a"]) == _bits(r["b"]), (dtype, r)
    arrays = df.select("id", vector_to_array("v").alias("x"))
    back = arrays.select("id", vectors.from_array(arrays["x"]).alias("w"),
                         vectors.from_array("`x`").alias("s"),  # as SQL text
                         array_to_vector("x").alias("u"))
    assert isinstance(back.schema["w"].dataType, VectorUDT)
    assert isinstance(back.schema["s"].dataType, VectorUDT)
    for r in back.orderBy("id").collect():
        assert type(r["w"]).__name__ == type(r["s"]).__name__ == "DenseVector"
        assert _bits(r["w"].toArray()) == _bits(r["u"].toArray()) == _bits(r["s"].toArray()), r


def test_a_null_vector_is_refused_as_vector_to_array_refuses_it(spark_local):
    """Relabelled or not, a null Vector fails in the JVM (transform's null check relies on
    it): it takes the ``vector_to_array`` branch."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F

    from spark_hvd.estimators._predict_udf import VectorColumns
    df = _frame(spark_local)
    nulls = df.withColumn("v", F.when(F.col("id") == 2, F.lit(None).cast(VectorUDT()))
                          .otherwise(F.col("v")))
    with pytest.raises(Exception, match="FAILED_EXECUTE_UDF"):
        nulls.select(VectorColumns(nulls).to_array(nulls["v"], "float32")).collect()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_packed_vectors_unpack_to_the_values_of_vector_to_array(spark_local, dtype):
    """transform's packed input (one big-endian binary per row, made in the JVM) unpacks in
    Python to ``vector_to_array``'s values bit for bit, dense and sparse, from an Arrow
    binary array (sliced too) and from the pandas Series a pandas UDF is handed."""
    import numpy as np
    import pandas as pd
    import pyarrow as pa
    from pyspark.ml.functions import vector_to_array

    from spark_hvd.estimators._predict_udf import VectorColumns, unpack
    df = _frame(spark_local)
    vectors = VectorColumns(df)
    packed = vectors.packed(df["v"], dtype)
    assert packed is not None, "a classic session packs Vectors in the JVM"
    got = df.select("id", packed.alias("p"), vector_to_array("v", dtype).alias("b"))
    assert got.schema["p"].dataType.typeName() == "binary"
    plan = got._jdf.queryExecution().optimizedPlan().toString()
    assert ("copyFloat" if dtype == "float32" else "copyDouble") in plan, plan
    rows = got.orderBy("id").collect()
    want = np.array([r["b"] for r in rows], dtype=dtype)
    blobs = pa.array([bytes(r["p"]) for r in rows], pa.binary())
    assert all(len(b) == 3 * np.dtype(dtype).itemsize for b in blobs.to_pylist())
    for column, expect in ((blobs, want), (blobs.slice(2), want[2:]),
                           (pd.Series([bytes(r["p"]) for r in rows], dtype=object), want)):
        out = unpack("v", column, dtype, "")
        assert out.type == pa.list_(pa.from_numpy_dtype(np.dtype(dtype)))
        values = np.asarray(out.flatten()).reshape(len(expect), 3)
        assert values.dtype == np.dtype(dtype) and values.dtype.isnative
        assert values.tobytes() == expect.tobytes(), (dtype, values, expect)
        assert np.asarray(out.flatten()).ctypes.data % 64 == 0, "Arrow-aligned for the model"


def test_unpack_refuses_nulls_and_torn_values():
    import pyarrow as pa

    from spark_hvd.data import array_to_numpy
    from spark_hvd.estimators._predict_udf import unpack
    from spark_hvd.exceptions import InvalidArgumentError
    nulls = unpack("v", pa.array([b"\0" * 4, None, b"?\x80\0\0"], pa.binary()), "float32", "")
    assert nulls.to_pylist() == [[0.0], None, [1.0]]
    with pytest.raises(InvalidArgumentError, match="column 'v' has 1 null value"):
        array_to_numpy("v", nulls)
    with pytest.raises(ValueError, match="not whole float64s"):
        unpack("v", pa.array([b"\0" * 8, b"\0" * 7], pa.binary()), "float64", "")
    empty = unpack("v", pa.array([], pa.binary()), "float32", "")
    assert len(empty) == 0 and empty.type == pa.list_(pa.float32())


def test_a_null_vector_is_refused_when_packed_too(spark_local):
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F

    from spark_hvd.estimators._predict_udf import VectorColumns
    df = _frame(spark_local)
    nulls = df.withColumn("v", F.when(F.col("id") == 2, F.lit(None).cast(VectorUDT()))
                          .otherwise(F.col("v")))
    with pytest.raises(Exception, match="FAILED_EXECUTE_UDF"):
        nulls.select(VectorColumns(nulls).packed(nulls["v"], "float32")).collect()


def test_rows_of_float64_bytes_come_back_as_the_same_vectors(spark_local):
    """The pandas path's packed output: a pandas UDF's binary_rows, read back in the JVM as
    dense Vectors (from_packed), bit for bit (NaN, infinities, -0.0, a subnormal), also with
    whole-stage codegen off; the column is made once per driver JVM."""
    import numpy as np
    import pandas as pd
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from spark_hvd.estimators._predict_udf import VectorColumns, binary_rows
    values = np.array([[1.5, -0.0, np.inf, 2.0], [np.nan, -np.inf, 5e-324, 1e300],
                       [1.0 / 3, 0.1, -2.25, 0.0]])

    @F.pandas_udf(T.BinaryType())
    def rows(ids: pd.Series) -> pd.Series:
        return binary_rows(values[ids.to_numpy()])

    df = spark_local.range(3, numPartitions=2).select("id", rows("id").alias("b"))
    vectors = VectorColumns(df)
    assert vectors.unpacks
    column = vectors.from_packed("`b`")
    assert vectors.from_packed("`b`") is column
    for codegen in ("true", "false"):
        spark_local.conf.set("spark.sql.codegen.wholeStage", codegen)
        try:
            got = df.select("id", column.alias("v")).orderBy("id").collect()
        finally:
            spark_local.conf.unset("spark.sql.codegen.wholeStage")
        assert [r.id for r in got] == [0, 1, 2]
        for r in got:
            assert type(r.v).__name__ == "DenseVector"
            assert r.v.toArray().tobytes() == values[r.id].tobytes(), (codegen, r)
    empty = df.limit(0).select(column.alias("v"))
    assert empty.collect() == [] and type(empty.schema["v"].dataType).__name__ == "VectorUDT"


def test_transform_s_columns_are_built_in_a_few_py4j_calls(spark_local, monkeypatch):
    """Each py4j call is a round trip to the driver JVM (0.1-0.3 ms, more on a busy
    driver): what does not depend on the DataFrame (expression classes, data types, the
    probes) is made once per JVM, and the columns on the JVM's Column API or as SQL text
    rather than through pyspark's Column functions, which make several calls each.  Measured
    2026-12-06: 20 calls for a packed input on pyspark 4.3 and 4.0, 24 on 3.5, and 6 for a
    10-wide Vector output; before, ~440 per ``transform`` (0.1-0.15 s of the driver's)."""
    import py4j.clientserver
    import py4j.java_gateway

    from spark_hvd.estimators._predict_udf import PandasLayout, VectorColumns
    df = _frame(spark_local)
    VectorColumns(df).model_input(df["v"], "float32")  # the first one on this JVM, if any
    calls = []
    for cls in (py4j.clientserver.ClientServerConnection, py4j.java_gateway.GatewayConnection):
        def counted(self, command, _send=cls.send_command):
            calls.append(command.split("\n", 1)[0])
            return _send(self, command)
        monkeypatch.setattr(cls, "send_command", counted)

    vectors = VectorColumns(df)
    assert calls == [], "a second VectorColumns on this JVM makes no py4j call"
    vectors.model_input(df["v"], "float32")
    assert 0 < len(calls) <= 32, len(calls)
    del calls[:]
    PandasLayout([[10]]).column(0, "out", vectors)
    assert 0 < len(calls) <= 10, len(calls)
    PandasLayout([[10]], packed=True).column(0, "out", vectors)  # built on this JVM's first
    del calls[:]
    PandasLayout([[10]], packed=True).column(0, "out", vectors)
    assert calls == [], "the packed output's Vectors are made once per driver JVM"
