"""The UDF that runs a model in ``transform``: one per Spark version, the same batches and values.

Both take the feature columns only (Vectors as arrays), one Arrow batch
(``spark.sql.execution.arrow.maxRecordsPerBatch`` rows) at a time, turn it into numpy arrays
with :func:`spark_hvd.data.array_to_numpy` (the same checks and errors) and call the
framework's ``run(arrays, batch_rows)``, which cuts it into ``inference_batch_size`` rows per
model call and returns each output as one ``(rows, width)`` float64 array.  They differ in how
those arrays reach and leave Python, which is what each Spark offers:

* ``arrow`` (pyspark >= 4.1, ``functions.arrow_udf``): a scalar-iterator Arrow UDF.  pyarrow
  arrays in and out; the outputs go back as Spark's own types (double, or Vector as its
  struct), several outputs as one struct split into columns.
* ``pandas`` (pyspark 3.5 and 4.0, which have no ``arrow_udf``): a scalar-iterator pandas
  UDF, the same Arrow stream seen through pandas.  In: pyspark hands each array column over
  as a Series of per-row numpy arrays, which pyarrow makes as views of one buffer; when they
  are (rows of one length, laid end to end: checked on the first and last row and on every
  length) they become one Arrow list array again without a copy, else the rows are
  re-assembled by pyarrow (a copy).  Out: a pandas UDF cannot return a Vector or an array
  without a Python conversion of every element (pyspark's converters), so the outputs come
  back as fields of one struct: a number as a double; a Vector, where the session has a
  driver JVM, as one ``binary`` per row holding its float64 values (:func:`binary_rows`,
  an Arrow array pyspark passes on as it is), which the JVM copies into an array
  (:meth:`VectorColumns.from_packed`), else as a double field per element, which the JVM
  gathers with ``array(...)`` (:meth:`VectorColumns.from_array`), either then declared a
  dense Vector's struct: no conversion per element; an output wider than
  :data:`MAX_STRUCT_WIDTH` goes back as ``array<double>`` instead (pyspark's per-element
  conversion: slower, the same values).  pandas turns nulls of numbers into NaN
  (or an integer column into floats), so the JVM checks for nulls first where the schema
  allows them (``raise_error``): a null is an error on both paths, never a silent NaN.

On a classic session (a driver JVM) a Vector feature column reaches either UDF packed
(:meth:`VectorColumns.packed`): one ``binary`` per row holding its values in the model's
dtype, big-endian, which the JVM makes with two bulk copies and Arrow writes with one, where
an ``array`` column costs Arrow's writer a call per element; :func:`unpack` makes it the
same list array again in Python (one byte-swapping copy into Arrow's aligned memory).

Which one runs is decided by what the session's ``pyspark.sql.functions`` offers
(:func:`udf_kind`), not by a version number.  bench/transform.py measures both against a
constant UDF of the same kind (the executor JVM's share, which bounds them).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

_OUT_TMP = "__spark_hvd_outputs"
#: Widest output returned as double columns by the ``pandas`` UDF; wider ones come back as
#: ``array<double>`` (pyspark converts those element by element).
MAX_STRUCT_WIDTH = 256
KINDS = ("arrow", "pandas")

# ``run(arrays, batch_rows)``: one Arrow batch's feature arrays in, the model called on
# ``batch_rows`` rows at a time, each output as one ``(rows, width)`` float64 array.
Run = Callable[[List[np.ndarray], int], List[np.ndarray]]


def udf_kind() -> str:
    """``arrow`` where ``pyspark.sql.functions`` has ``arrow_udf`` (pyspark >= 4.1),
    ``pandas`` otherwise."""
    from pyspark.sql import functions as F
    return "arrow" if hasattr(F, "arrow_udf") else "pandas"


def is_scalar(shape: Sequence[int]) -> bool:
    """Whether an output of this per-row shape is one number per row (a double column)."""
    return int(np.prod(shape)) == 1 and len(shape) <= 1


def output_type(shape: Sequence[int]) -> Any:
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T
    return T.DoubleType() if is_scalar(shape) else VectorUDT()


def add_predictions(dataset: Any, inputs: List[Any], fields: List[Any],
                    open_model: Callable[[], Run], names: List[str],
                    output_shapes: List[List[int]], out_cols: List[str], batch_rows: int,
                    where: str, kind: Optional[str] = None,
                    vectors: Optional["VectorColumns"] = None,
                    packed: Optional[Sequence[Optional[str]]] = None) -> Any:
    """``dataset`` with one column per model output, computed by the UDF of ``kind``
    (:func:`udf_kind` by default) on the feature columns ``inputs`` (named ``names``);
    ``fields`` are their StructFields in ``dataset`` where nulls must be checked for (None:
    the column can hold none); ``vectors``: ``dataset``'s :class:`VectorColumns`, made here
    when not given; ``packed``: per input, the dtype of a :meth:`VectorColumns.packed`
    column, None for the others."""
    kind = kind or udf_kind()
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    if kind == "arrow":
        return _with_arrow_udf(dataset, inputs, open_model, names, output_shapes, out_cols,
                               batch_rows, where, packed)
    return _with_pandas_udf(dataset, inputs, fields, open_model, names, output_shapes,
                            out_cols, batch_rows, where, vectors, packed)


def _outputs(run: Run, arrays: List[np.ndarray], output_shapes: List[List[int]],
             batch_rows: int) -> List[np.ndarray]:
    if len(arrays[0]):
        return run(arrays, batch_rows)
    return [np.zeros((0, max(1, int(np.prod(s))))) for s in output_shapes]


# -- arrow_udf (pyspark >= 4.1) ------------------------------------------------------------

def _with_arrow_udf(dataset, inputs, open_model, names, output_shapes, out_cols, batch_rows,
                    where, packed):
    import pyarrow as pa
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    out_types = [output_type(s) for s in output_shapes]
    predict = make_predict_fn(open_model, names, output_shapes, batch_rows,
                              single=len(out_cols) == 1, where=where, packed=packed)
    # The type hints tell pyspark this is a scalar-iterator Arrow UDF.
    arg = pa.Array if len(inputs) == 1 else Tuple[(pa.Array,) * len(inputs)]
    predict.__annotations__ = {"batches": Iterator[arg], "return": Iterator[pa.Array]}
    if len(out_cols) == 1:
        return dataset.withColumn(out_cols[0], F.arrow_udf(predict, out_types[0])(*inputs))
    struct = T.StructType([T.StructField(f"o{k}", t, True) for k, t in enumerate(out_types)])
    udf = F.arrow_udf(predict, struct)
    return (dataset.withColumn(_OUT_TMP, udf(*inputs))
            .select("*", *[F.col(f"{_OUT_TMP}.o{k}").alias(c) for k, c in enumerate(out_cols)])
            .drop(_OUT_TMP))


def make_predict_fn(open_model: Callable[[], Run], names: List[str],
                    output_shapes: List[List[int]], batch_rows: int, single: bool,
                    where: str, packed: Optional[Sequence[Optional[str]]] = None
                    ) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The Arrow UDF body: Arrow batches of the feature columns in, the outputs out.

    ``open_model()`` runs once per task, on the executor, and returns the function that
    predicts one Arrow batch, at most ``batch_rows`` rows per model call; ``packed``: per
    column, the dtype of a :meth:`VectorColumns.packed` one (None: an Arrow column as is).
    """
    packed = list(packed or [None] * len(names))

    def predict(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from spark_hvd.data import array_to_numpy

        run = open_model()
        for columns in batches:
            if not isinstance(columns, (tuple, list)):
                columns = (columns,)
            arrays = [array_to_numpy(name, col if dtype is None else
                                     unpack(name, col, dtype, where), where)
                      for col, name, dtype in zip(columns, names, packed)]
            outs = _outputs(run, arrays, output_shapes, batch_rows)
            out = [to_arrow(values, shape, pa) for values, shape in zip(outs, output_shapes)]
            yield out[0] if single else pa.StructArray.from_arrays(
                out, names=[f"o{k}" for k in range(len(out))])

    return predict


def to_arrow(values: np.ndarray, shape: Sequence[int], pa: Any) -> Any:
    """``(rows, width)`` float64 -> a double column (width 1, scalar shape) or dense Vectors
    (Spark's VectorUDT layout: type=1, size/indices null, values)."""
    n, width = values.shape[0], values.shape[1] if values.ndim > 1 else 1
    if is_scalar(shape):
        return pa.array(values.reshape(n))
    offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32))
    flat = pa.array(np.ascontiguousarray(values).reshape(-1))
    return pa.StructArray.from_arrays(
        [pa.array(np.ones(n, dtype=np.int8)), pa.nulls(n, pa.int32()),
         pa.nulls(n, pa.list_(pa.int32())), pa.ListArray.from_arrays(offsets, flat)],
        names=["type", "size", "indices", "values"])


# -- pandas_udf (pyspark < 4.1) -----------------------------------------------------------

class PandasLayout:
    """Where each output goes in the pandas UDF's struct, and how the JVM rebuilds it.

    A number is a double field.  A Vector output up to :data:`MAX_STRUCT_WIDTH` wide is,
    where the session's JVM can read it back (``packed``: :attr:`VectorColumns.unpacks`),
    one ``binary`` field holding each row's float64 values end to end (:func:`binary_rows`:
    pyspark hands an Arrow-backed Series to Arrow as it is, where it makes a converter, a
    null mask and an Arrow array per double field, per batch: 1.0-2.2 ms per 10,000 rows of
    a 10-wide output on pyspark 4.0 and 3.5, against 0.04-0.1 ms), else one double field per
    element; a wider one is an ``array<double>`` field."""

    def __init__(self, output_shapes: List[List[int]], packed: bool = False) -> None:
        self.widths = [max(1, int(np.prod(s))) for s in output_shapes]
        self.scalar = [is_scalar(s) for s in output_shapes]
        self.wide = [not s and w > MAX_STRUCT_WIDTH for s, w in zip(self.scalar, self.widths)]
        self.packed = [packed and not s and not wide for s, wide in zip(self.scalar, self.wide)]

    def fields(self, k: int) -> List[str]:
        if self.scalar[k] or self.wide[k] or self.packed[k]:
            return [f"o{k}"]
        return [f"o{k}_{j}" for j in range(self.widths[k])]

    def return_type(self) -> Any:
        from pyspark.sql import types as T
        fields = []
        for k in range(len(self.widths)):
            t = (T.ArrayType(T.DoubleType()) if self.wide[k] else
                 T.BinaryType() if self.packed[k] else T.DoubleType())
            fields += [T.StructField(name, t, True) for name in self.fields(k)]
        return T.StructType(fields)

    def frame(self, outs: List[np.ndarray]) -> Any:
        """The outputs of one batch as the struct's pandas DataFrame (no copy of a
        contiguous output)."""
        import pandas as pd
        columns = {}
        for k, values in enumerate(outs):
            n = values.shape[0]
            values = values.reshape(n, self.widths[k])
            if self.wide[k]:
                columns[f"o{k}"] = pd.Series(list(values), dtype=object)
            elif self.packed[k]:
                columns[f"o{k}"] = binary_rows(values)
            else:
                for j, name in enumerate(self.fields(k)):
                    columns[name] = values[:, j]
        return pd.DataFrame(columns, copy=False)

    def column(self, k: int, struct: str, vectors: "VectorColumns") -> Any:
        """The JVM expression of output ``k`` from the UDF's struct column ``struct``, its
        Vectors made by ``vectors``.  As SQL text, parsed in one py4j call (pyspark's Column
        functions make several each, which came to ~100 for a 10-wide output on pyspark
        4.0), or made once per driver JVM (:meth:`VectorColumns.from_packed`)."""
        fields = [f"`{struct}`.`{name}`" for name in self.fields(k)]
        if self.scalar[k]:
            from pyspark.sql import functions as F
            return F.expr(fields[0])
        if self.packed[k]:
            return vectors.from_packed(fields[0])
        return vectors.from_array(fields[0] if self.wide[k] else f"array({', '.join(fields)})")


def binary_rows(values: np.ndarray) -> Any:
    """The rows of a ``(rows, width)`` array as float64 bytes, one ``binary`` value per row
    in the machine's byte order (the executor JVM's, which reads them back with
    :meth:`VectorColumns.from_packed`), as a pandas Series backed by an Arrow array made
    over those bytes without a copy or a Python object per row."""
    import pandas as pd
    import pyarrow as pa
    n, width = values.shape
    if n * width * 8 > np.iinfo(np.int32).max:
        raise ValueError(f"{n} rows of {width} outputs do not fit one Arrow binary column; "
                         f"lower spark.sql.execution.arrow.maxRecordsPerBatch")
    flat = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
    offsets = np.arange(0, (n + 1) * width * 8, width * 8, dtype=np.int32)
    rows = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets),
                                                  pa.py_buffer(flat)])
    return pd.Series(pd.arrays.ArrowExtensionArray(rows))


class VectorColumns:
    """Vector <-> array columns in the JVM, the cheapest way ``dataset``'s session offers,
    with the values of ``pyspark.ml.functions``' ``vector_to_array`` and ``array_to_vector``.

    Spark stores a Vector as its VectorUDT's struct (``type`` 1 for dense, 0 for sparse;
    ``size``; ``indices``; ``values``), so on a classic session a Catalyst ``Invoke`` of
    the struct's ``InternalRow.copy()``, declared the other type, turns one into the other
    with nothing converted (built through py4j: ``Cast`` refuses a struct to a UDT and
    back).  A dense Vector's array is its struct's ``values`` field (a sparse one still goes
    through ``vector_to_array``), and an array becomes a Vector as the struct of a dense one.
    ``vector_to_array`` and ``array_to_vector`` themselves are Scala UDFs that box every
    element; they remain the way where the relabelling cannot be built (no JVM in the
    driver: Spark Connect; or a Catalyst without that constructor).  Measured with
    bench/transform.py's data (2026-12-06): a constant UDF fed the struct's values instead of
    ``vector_to_array`` 1.12-1.17x as fast on pyspark 3.5, 1.01-1.05x on 4.0, 1.03-1.07x on
    4.3; a 10-wide Vector output from a pandas UDF at 0.89-0.90x the rows/s of a one-double
    output on 3.5 and 4.0, against 0.76-0.77x through ``array_to_vector``."""

    def __init__(self, dataset: Any) -> None:
        catalyst = self._catalyst = _Catalyst.of(getattr(dataset, "sparkSession", None))
        self._relabel = _relabeller(catalyst)
        self._pack = _packer(catalyst) if self._relabel is not None else None
        self._unpack = _doubles_unpacker(catalyst) if self._relabel is not None else None

    @property
    def relabels(self) -> bool:
        """Whether this session turns Vectors and arrays into each other without a UDF."""
        return self._relabel is not None

    @property
    def unpacks(self) -> bool:
        """Whether this session makes Vectors of rows of float64 bytes (:meth:`from_packed`)."""
        return self._unpack is not None

    def to_array(self, column: Any, dtype: str) -> Any:
        """``vector_to_array(column, dtype)``'s values; ``dtype`` ``float32`` or ``float64``."""
        from pyspark.ml.functions import vector_to_array
        from pyspark.ml.linalg import VectorUDT
        by_udf = vector_to_array(column, dtype)
        if self._relabel is None:
            return by_udf
        # On the JVM's Column API: pyspark's own Column methods make several py4j calls each.
        struct = self._relabel(column, VectorUDT().sqlType())._jc
        values = struct.getField("values")
        if dtype == "float32":
            values = values.cast("array<float>")  # Scala's Double.toFloat, as the UDF's
        catalyst = self._catalyst
        assert catalyst is not None
        return catalyst.wrap(catalyst.functions.when(struct.getField("type").equalTo(1), values)
                             .otherwise(by_udf._jc))

    def packed(self, column: Any, dtype: str) -> Optional[Any]:
        """:meth:`to_array`'s values as one ``binary`` value per row, or None where this
        session cannot make it (no driver JVM): the row's ``dtype`` values, big-endian, end
        to end (:func:`unpack` reads them).  In the JVM, ``ArrayData.toFloatArray`` (a bulk
        copy), then netty's ``Unpooled.copyFloat`` (a tight loop; netty is on every
        executor's classpath, Spark's network layer), then Arrow's writer copies the bytes
        once, where an ``array`` column costs it a call per element.  A null Vector still
        fails in ``vector_to_array``.  Measured with bench/transform.py's data (2026-12-06,
        pyspark 4.3, C2-compiled executors): 0.09-0.10 s less executor JVM CPU per
        200,000 rows of 64 features than the relabelled array, about a fifth of the JVM's
        share of a constant UDF's pass; on 3.5 0.05 s less JVM and 0.07 s less Python."""
        if self._pack is None:
            return None
        return self._pack(self.to_array(column, dtype), dtype)

    def model_input(self, column: Any, dtype: str) -> Tuple[Any, Optional[str]]:
        """A Vector column as transform's UDF takes it, with what :func:`add_predictions`'
        ``packed`` says of it: :meth:`packed` and ``dtype`` where this session packs, else
        :meth:`to_array` and None."""
        packed = self.packed(column, dtype)
        return (self.to_array(column, dtype), None) if packed is None else (packed, dtype)

    def from_array(self, values: Any) -> Any:
        """``array_to_vector(values)``: dense Vectors of an ``array<double>`` column, given as
        a Column or as SQL text."""
        if self._relabel is None:
            from pyspark.ml.functions import array_to_vector
            from pyspark.sql import functions as F
            return array_to_vector(F.expr(values) if isinstance(values, str) else values)
        from pyspark.ml.linalg import VectorUDT
        return self._relabel(_dense_struct(values), VectorUDT())


    def from_packed(self, field: str) -> Any:
        """Dense Vectors of the ``binary`` column named by the SQL text ``field``, each row
        its float64 values end to end in the machine's byte order (:func:`binary_rows`).
        In the JVM, one copy per row (``UnsafeArrayData.fromPrimitiveArray`` of the bytes,
        as many doubles as whole 8-byte words), then the relabelled struct; the column is
        made once per driver JVM for each ``field`` (it names no DataFrame)."""
        catalyst, unpack, relabel = self._catalyst, self._unpack, self._relabel
        assert catalyst is not None and unpack is not None and relabel is not None

        def build() -> Any:
            from pyspark.ml.linalg import VectorUDT
            from pyspark.sql import functions as F
            return relabel(_dense_struct(unpack(F.expr(field))), VectorUDT())
        return catalyst.once("vectors of packed " + field, build)


def _dense_struct(values: Any) -> Any:
    """A dense Vector's struct of ``values`` (a Column, or SQL text: one py4j call)."""
    from pyspark.sql import functions as F
    if isinstance(values, str):
        return F.expr("named_struct('type', CAST(1 AS TINYINT), 'size', CAST(NULL AS INT), "
                      f"'indices', CAST(NULL AS ARRAY<INT>), 'values', {values})")
    return F.struct(F.lit(1).cast("byte").alias("type"), F.lit(None).cast("int").alias("size"),
                    F.lit(None).cast("array<int>").alias("indices"), values.alias("values"))


class _Catalyst:
    """Catalyst expressions built through py4j on a classic session's driver JVM: a
    pyspark Column to its JVM expression and back, on Spark 3.5 (a Column holds its
    Expression) and >= 4.0 (a Column holds a ColumnNode).

    One per driver JVM (:meth:`of`), holding what does not change with the DataFrame (the
    expression classes, data types, the probes of :func:`_relabeller` and :func:`_packer`),
    so that a ``transform`` call builds its columns only: each py4j call is a round trip
    (0.1-0.3 ms), and building them all afresh took ~440 of them, 0.1-0.15 s of the
    driver's time per call (2026-12-06), as long as the UDF's pass over 50,000 rows."""

    _by_jvm: Dict[int, Tuple[Any, Optional["_Catalyst"]]] = {}

    def __init__(self, jvm: Any) -> None:
        from py4j.java_gateway import JavaClass
        bridge = jvm.org.apache.spark.sql.classic.ExpressionUtils
        if isinstance(bridge, JavaClass):  # Spark >= 4.0
            self._to_expr, self._to_column = bridge.expression, bridge.column
        else:  # 3.5
            self._to_expr, self._to_column = (lambda jc: jc.expr()), jvm.org.apache.spark.sql.Column
        self.jvm = jvm
        self.nil = getattr(getattr(jvm.scala.collection.immutable, "Nil$"), "MODULE$")
        objects = jvm.org.apache.spark.sql.catalyst.expressions.objects
        self._invoke, self._static_invoke = objects.Invoke, objects.StaticInvoke
        self._from_json = jvm.org.apache.spark.sql.types.DataType.fromJson
        self.functions = jvm.org.apache.spark.sql.functions
        self._v2_function: Optional[Tuple[Any, ...]] = None  # StaticInvoke's last argument
        self._made: Dict[str, Any] = {}

    @classmethod
    def of(cls, spark: Any) -> Optional["_Catalyst"]:
        """For ``spark`` (a SparkSession), or None where it has no driver JVM (Connect)."""
        jvm = getattr(spark, "_jvm", None)
        if jvm is None:
            return None
        known = cls._by_jvm.get(id(jvm))
        if known is not None and known[0] is jvm:
            return known[1]
        from py4j.protocol import Py4JError
        try:
            catalyst: Optional[_Catalyst] = cls(jvm)
        except (Py4JError, TypeError):
            catalyst = None
        cls._by_jvm[id(jvm)] = (jvm, catalyst)
        return catalyst

    def once(self, name: str, build: Callable[[], Any]) -> Any:
        """``build()``, made the first time ``name`` is asked for on this JVM."""
        if name not in self._made:
            self._made[name] = build()
        return self._made[name]

    def probed(self, name: str, make: Callable[["_Catalyst"], Any]) -> Any:
        """``make(self)`` (a function built through py4j and tried once there), made the
        first time ``name`` is asked for on this JVM; None where this Spark lacks what it
        needs (a Py4JError; a TypeError where py4j gives a missing class as a JavaPackage)."""
        def build() -> Any:
            from py4j.protocol import Py4JError
            try:
                return make(self)
            except (Py4JError, TypeError):
                return None
        return self.once(name, build)

    def expr(self, column: Any) -> Any:
        return self._to_expr(column._jc)

    def column(self, expr: Any) -> Any:
        return self.wrap(self._to_column(expr))

    @staticmethod
    def wrap(jc: Any) -> Any:
        """A JVM Column as a pyspark one."""
        from pyspark.sql.column import Column
        return Column(jc)

    def data_type(self, json: str) -> Any:
        """The JVM DataType of a pyspark type's ``json()``."""
        return self.once("type " + json, lambda: self._from_json(json))

    def invoke(self, target: Any, method: str, data_type: Any, *args: Any) -> Any:
        """``target.method(args)`` declared ``data_type`` (a JVM DataType), null on a null
        target (Invoke: propagateNull, returnNullable, deterministic)."""
        return self._invoke(target, method, data_type, self.seq(args), self.nil,
                            True, True, True)

    def static_invoke(self, cls: str, method: str, data_type: Any, *args: Any) -> Any:
        from py4j.protocol import Py4JError
        rest = (self.seq(args), self.nil, True, True, True)
        klass = self.java_class(cls)
        if self._v2_function is None:
            v2_function = (self.jvm.scala.Option.empty(),)
            try:  # Spark >= 4.0: a last argument, the V2 function it implements
                made = self._static_invoke(klass, data_type, method, *rest, *v2_function)
                self._v2_function = v2_function
                return made
            except Py4JError:  # 3.5
                self._v2_function = ()
        return self._static_invoke(klass, data_type, method, *rest, *self._v2_function)

    def java_class(self, name: str) -> Any:
        return self.once("class " + name, lambda: self.jvm.java.lang.Class.forName(name))

    def object_type(self, cls: str) -> Any:
        def make() -> Any:
            return self.jvm.org.apache.spark.sql.types.ObjectType(self.java_class(cls))
        return self.once("object " + cls, make)

    def seq(self, items: Sequence[Any]) -> Any:
        out = self.nil
        for item in reversed(items):
            out = out.__getattr__("$colon$colon")(item)
        return out


def _relabeller(catalyst: Optional[_Catalyst]) -> Optional[Callable[[Any, Any], Any]]:
    """``relabel(column, data_type)``: ``column`` declared ``data_type`` (a pyspark type
    stored as the column's own: a UDT and its struct), or None where the session cannot
    build it (probed once per JVM).  See :class:`VectorColumns`."""
    return None if catalyst is None else catalyst.probed("relabel", _make_relabeller)


def _make_relabeller(catalyst: _Catalyst) -> Callable[[Any, Any], Any]:
    from pyspark.ml.linalg import VectorUDT

    def relabel(column: Any, data_type: Any) -> Any:
        return catalyst.column(catalyst.invoke(catalyst.expr(column), "copy",
                                               catalyst.data_type(data_type.json())))

    relabel(_dense_struct("array(0D)"), VectorUDT())  # what is missing fails here
    return relabel


#: Per packed dtype: the Spark array type it packs, the ``ArrayData`` method giving the
#: Java array, that array's class, and the netty ``Unpooled`` method copying it to bytes.
_PACKERS = {"float32": ("array<float>", "toFloatArray", "[F", "copyFloat"),
            "float64": ("array<double>", "toDoubleArray", "[D", "copyDouble")}


def _packer(catalyst: Optional[_Catalyst]) -> Optional[Callable[[Any, str], Any]]:
    """``pack(array_column, dtype)``: an ``array<float>`` (float32) or ``array<double>``
    (float64) column without null elements as one big-endian ``binary`` per row, or None
    where the session cannot build it (probed once per JVM).  See
    :meth:`VectorColumns.packed`."""
    return None if catalyst is None else catalyst.probed("pack", _make_packer)


def _make_packer(catalyst: _Catalyst) -> Callable[[Any, str], Any]:
    from pyspark.sql import functions as F

    def pack(values: Any, dtype: str) -> Any:
        _, to_java, java_array, copy = _PACKERS[dtype]
        array = catalyst.invoke(catalyst.expr(values), to_java, catalyst.object_type(java_array))
        buf = catalyst.static_invoke("io.netty.buffer.Unpooled", copy,
                                     catalyst.object_type("io.netty.buffer.ByteBuf"), array)
        return catalyst.column(catalyst.invoke(buf, "array", catalyst.data_type('"binary"')))

    for dtype, (spark_type, *_) in _PACKERS.items():  # what is missing fails here
        pack(F.array(F.lit(0.0)).cast(spark_type), dtype)
    return pack


def _doubles_unpacker(catalyst: Optional[_Catalyst]) -> Optional[Callable[[Any], Any]]:
    """``unpack(binary_column)``: each row's bytes as an ``array<double>`` of its whole
    8-byte words in the machine's byte order, or None where the session cannot build it
    (probed once per JVM).  See :meth:`VectorColumns.from_packed`."""
    return None if catalyst is None else catalyst.probed("unpack doubles",
                                                           _make_doubles_unpacker)


def _make_doubles_unpacker(catalyst: _Catalyst) -> Callable[[Any], Any]:
    from pyspark.sql import functions as F

    def unpack_doubles(binary: Any) -> Any:
        # UTF8String.fromBytes wraps the row's byte[] without a copy and says where its
        # bytes start (the JVM's array header), which fromPrimitiveArray copies from.
        utf8 = "org.apache.spark.unsafe.types.UTF8String"
        text = catalyst.static_invoke(utf8, "fromBytes", catalyst.object_type(utf8),
                                      catalyst.expr(binary))
        base = catalyst.invoke(text, "getBaseObject", catalyst.object_type("java.lang.Object"))
        offset = catalyst.expr(catalyst.column(
            catalyst.invoke(text, "getBaseOffset", catalyst.data_type('"long"'))).cast("int"))
        doubles = catalyst.expr(F.shiftright(F.octet_length(binary), 3))
        array = catalyst.static_invoke(
            "org.apache.spark.sql.catalyst.expressions.UnsafeArrayData", "fromPrimitiveArray",
            catalyst.data_type('{"type":"array","elementType":"double","containsNull":false}'),
            base, offset, doubles, catalyst.expr(F.lit(8)))
        return catalyst.column(array)

    unpack_doubles(F.lit(bytearray(8)))  # what is missing fails here
    return unpack_doubles


def unpack(name: str, column: Any, dtype: str, where: str) -> Any:
    """A :meth:`VectorColumns.packed` column (a pyarrow binary array, or a pandas Series of
    bytes) as the list array of ``dtype`` it was made from (native byte order; nulls kept):
    one byte-swapping copy of the values."""
    import pyarrow as pa
    if not isinstance(column, pa.Array):
        column = pa.array(column.to_numpy(), type=pa.binary())
    size = np.dtype(dtype).itemsize
    n = len(column)
    _, offsets_buf, data = column.buffers()
    offsets = np.frombuffer(offsets_buf, np.int32, count=n + 1, offset=4 * column.offset)
    first, last = int(offsets[0]), int(offsets[-1])
    if np.any(offsets % size):
        raise ValueError(f"column '{name}': packed values not whole {dtype}s{where}")
    count = (last - first) // size
    # Into Arrow's memory (64-byte aligned): torch's CPU matmul can round differently with
    # the input's alignment, and a model's predictions should not depend on malloc.
    values = pa.allocate_buffer(count * size)
    if count:
        np.copyto(np.frombuffer(values, dtype),
                  np.frombuffer(data, np.dtype(dtype).newbyteorder(">"), count, first))
    # A null row stays null (a null offset), for array_to_numpy to refuse as any list's.
    nulls = (np.append(column.is_null().to_numpy(zero_copy_only=False), False)
             if column.null_count else None)
    return pa.ListArray.from_arrays(pa.array((offsets - first) // size, mask=nulls),
                                    pa.Array.from_buffers(pa.from_numpy_dtype(np.dtype(dtype)),
                                                          count, [None, values]))


def _with_pandas_udf(dataset, inputs, fields, open_model, names, output_shapes, out_cols,
                     batch_rows, where, vectors, packed):
    import pandas as pd
    from pyspark.sql import functions as F

    vectors = vectors or VectorColumns(dataset)
    layout = PandasLayout(output_shapes, packed=vectors.unpacks)
    predict = make_pandas_predict_fn(open_model, names, output_shapes, batch_rows, layout,
                                     where, packed)
    arg = pd.Series if len(inputs) == 1 else Tuple[(pd.Series,) * len(inputs)]
    predict.__annotations__ = {"batches": Iterator[arg], "return": Iterator[pd.DataFrame]}
    udf = F.pandas_udf(predict, layout.return_type())
    guarded = [c if field is None else null_guard(field, c, name, where)
               for c, field, name in zip(inputs, fields, names)]
    return (dataset.withColumn(_OUT_TMP, udf(*guarded))
            .select("*", *[layout.column(k, _OUT_TMP, vectors).alias(c)
                           for k, c in enumerate(out_cols)])
            .drop(_OUT_TMP))


def null_guard(field: Any, c: Any, name: str, where: str) -> Any:
    """``c``, or a Spark error on a row where it (or, for arrays, an element) is null, when
    its type allows nulls: pandas would hand the model NaN (or floats for integers)."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T
    checks = []
    if field.nullable:
        checks.append(c.isNull())
    dt, depth = field.dataType, 0
    while isinstance(dt, T.ArrayType):
        if dt.containsNull:
            flat = c
            for _ in range(depth):
                flat = F.flatten(flat)
            checks.append(F.coalesce(F.exists(flat, lambda x: x.isNull()), F.lit(False)))
        dt, depth = dt.elementType, depth + 1
    if not checks:
        return c
    test = checks[0]
    for more in checks[1:]:
        test = test | more
    return F.when(test, F.raise_error(F.lit(
        f"column '{name}' has null value(s){where}; a model cannot be run on nulls. Drop or "
        f"fill them first, e.g. df.na.drop(subset=['{name}']) or df.na.fill(...)"))
    ).otherwise(c)


def make_pandas_predict_fn(open_model: Callable[[], Run], names: List[str],
                           output_shapes: List[List[int]], batch_rows: int,
                           layout: PandasLayout, where: str,
                           packed: Optional[Sequence[Optional[str]]] = None
                           ) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The pandas UDF body: the same as :func:`make_predict_fn`'s, through pandas."""
    packed = list(packed or [None] * len(names))

    def predict(batches: Iterator[Any]) -> Iterator[Any]:
        from spark_hvd.data import array_to_numpy

        run = open_model()
        for columns in batches:
            if not isinstance(columns, (tuple, list)):
                columns = (columns,)
            arrays = [array_to_numpy(name, series_to_arrow(s) if dtype is None else
                                     unpack(name, s, dtype, where), where)
                      for s, name, dtype in zip(columns, names, packed)]
            yield layout.frame(_outputs(run, arrays, output_shapes, batch_rows))

    return predict


def series_to_arrow(series: Any) -> Any:
    """A column as pyspark's pandas UDF hands it over, as an Arrow array again: numbers
    zero-copy; an array column's per-row numpy arrays as one list array, without a copy
    when they are views laid end to end in one buffer (see the module docstring), else
    re-assembled by pyarrow (ragged rows, nested arrays, nulls kept as such)."""
    import pyarrow as pa
    values = series.to_numpy()
    if values.dtype != object:
        return pa.array(values)
    whole = _rows_as_one(values)
    if whole is not None:
        n, width = whole.shape
        offsets = np.arange(0, (n + 1) * width, width, dtype=np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(whole.reshape(-1)))
    return pa.array(values, from_pandas=False)


def _rows_as_one(rows: np.ndarray) -> Optional[np.ndarray]:
    """The ``(rows, width)`` array whose rows ``rows`` (an object array of 1-D numeric numpy
    arrays) are views of, or None when they are not rows of one length laid end to end in
    one buffer.  The lengths are all read; the addresses of the first and last row, with
    those lengths and Arrow's non-decreasing offsets, place every row in between."""
    n = len(rows)
    first, last = rows[0] if n else None, rows[-1] if n else None
    if not (isinstance(first, np.ndarray) and isinstance(last, np.ndarray)):
        return None
    base = first.base
    if (base is None or last.base is not base or not isinstance(base, np.ndarray)
            or first.ndim != 1 or first.dtype.kind not in "fiub" or first.dtype != base.dtype
            or last.dtype != first.dtype or not base.flags.c_contiguous):
        return None
    width, size = len(first), first.itemsize
    if width == 0 or first.strides != (size,):
        return None
    try:
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=n)
    except TypeError:  # a None (null) row
        return None
    if lengths.min() != width or lengths.max() != width:
        return None
    start = first.ctypes.data - base.ctypes.data
    if last.ctypes.data - first.ctypes.data != (n - 1) * width * size or start % size:
        return None
    flat = base.reshape(-1)
    begin = start // size
    if begin + n * width > flat.size:
        return None
    return flat[begin:begin + n * width].reshape(n, width)
