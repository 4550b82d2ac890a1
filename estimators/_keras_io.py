"""Keras models and optimizers as bytes, for the executors, the checkpoints and Pipeline
persistence: the ``.keras`` format (``model.save``), never a pickle of a live model.

* :func:`model_to_bytes` / :func:`model_from_bytes`: a model as the bytes of a ``.keras``
  file.  Loading never compiles (``compile=False``): the loss and metrics may be Python
  functions the file cannot hold, so whoever loads compiles with the objects it was given.
  ``safe_mode=False`` lets ``Lambda`` layers load: these bytes come from this library.
* :func:`with_metadata` / :func:`metadata_of`: a checkpoint is one ``.keras`` file with one
  more member, ``spark_hvd.json`` (epoch, history, ...), so model and metadata are written
  in one atomic write, and ``keras.models.load_model`` still opens the file.
* :func:`load_state`: weights and optimizer state from such bytes into a compiled model
  whose optimizer is built.
* :class:`SavedModel`: a model with its compile arguments (optimizer as its config), as
  KerasEstimator/KerasModel persist their ``model`` param.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import warnings
import zipfile
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

METADATA_MEMBER = "spark_hvd.json"


class _KerasFile:
    """A temporary ``model.keras`` path (Keras picks the format from the suffix), holding
    ``data`` when given."""

    def __init__(self, data: Optional[bytes] = None) -> None:
        self.data = data

    def __enter__(self) -> str:
        self.dir = tempfile.TemporaryDirectory(prefix="spark_hvd_keras_")
        path = os.path.join(self.dir.name, "model.keras")
        if self.data is not None:
            with open(path, "wb") as f:
                f.write(self.data)
        return path

    def __exit__(self, *exc: object) -> None:
        self.dir.cleanup()


def model_to_bytes(model: Any) -> bytes:
    """The bytes of ``model.save('x.keras')``."""
    with _KerasFile() as path, warnings.catch_warnings():
        # A lambda loss in the compile config: Keras warns that it cannot be reloaded
        # safely; the compile config is never used from these bytes (see the docstring).
        warnings.filterwarnings("ignore", message=".*lambda.*")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def model_from_bytes(data: bytes, custom_objects: Optional[Mapping[str, Any]] = None) -> Any:
    """The model of :func:`model_to_bytes`' bytes, not compiled."""
    import keras
    with _KerasFile(data) as path:
        return keras.models.load_model(path, custom_objects=dict(custom_objects or {}),
                                       compile=False, safe_mode=False)


def load_state(model: Any, data: bytes) -> None:
    """Weights (and, when the model's optimizer is built, its variables) from ``data``."""
    with _KerasFile(data) as path:
        model.load_weights(path)


def weight_shapes(model: Any) -> List[tuple]:
    return [tuple(w.shape) for w in model.weights]


def with_metadata(data: bytes, meta: Mapping[str, Any]) -> bytes:
    """``data`` (a .keras file) with ``meta`` as JSON in one more member."""
    buf = io.BytesIO(data)
    with zipfile.ZipFile(buf, "a") as z:
        z.writestr(METADATA_MEMBER, json.dumps(meta))
    return buf.getvalue()


def metadata_of(data: bytes) -> Dict[str, Any]:
    """The metadata :func:`with_metadata` added (ValueError when there is none)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            return json.loads(z.read(METADATA_MEMBER))
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ValueError(f"not a spark_hvd KerasEstimator checkpoint: {exc}") from None


# -- compile arguments -------------------------------------------------------------------------

def optimizer_config(optimizer: Any) -> Dict[str, Any]:
    """A Keras optimizer (or its name) as ``keras.optimizers.serialize`` gives it."""
    import keras
    if isinstance(optimizer, (str, dict)):
        optimizer = keras.optimizers.get(optimizer)
    return keras.optimizers.serialize(optimizer)


def optimizer_from_config(config: Mapping[str, Any],
                          custom_objects: Optional[Mapping[str, Any]] = None) -> Any:
    import keras
    return keras.optimizers.deserialize(dict(config),
                                        custom_objects=dict(custom_objects or {}))


def compiled_args(model: Any) -> Optional[Dict[str, Any]]:
    """What ``model.compile`` was given (optimizer, loss, metrics, loss_weights,
    weighted_metrics), or None when the model is not compiled."""
    if not getattr(model, "compiled", False):
        return None
    given = getattr(getattr(model, "_compile_config", None), "config", None) or {}
    args = {k: given.get(k) for k in ("loss", "metrics", "loss_weights", "weighted_metrics")}
    if args["loss"] is None:
        args["loss"] = getattr(model, "loss", None)
    args["optimizer"] = getattr(model, "optimizer", None) or given.get("optimizer")
    return args


@dataclass
class SavedModel:
    """A model as ``.keras`` bytes, with its compile arguments (the optimizer as its config;
    loss and metrics as they are, pickled with the rest of the params)."""

    data: bytes
    compile_args: Optional[Dict[str, Any]] = None

    @classmethod
    def of(cls, model: Any) -> "SavedModel":
        args = compiled_args(model)
        if args is not None and args["optimizer"] is not None:
            args["optimizer"] = optimizer_config(args["optimizer"])
        return cls(model_to_bytes(model), args)

    def load(self, custom_objects: Optional[Mapping[str, Any]] = None) -> Any:
        model = model_from_bytes(self.data, custom_objects)
        if self.compile_args is not None:
            args = dict(self.compile_args)
            if args["optimizer"] is not None:
                args["optimizer"] = optimizer_from_config(args["optimizer"], custom_objects)
            model.compile(**{k: v for k, v in args.items() if v is not None})
        return model


class KerasParamsMixin:
    """For KerasEstimator/KerasModel: persist ``model`` and ``optimizer`` as
    :func:`encode_params` says (goes before ParamsFromTable in the bases)."""

    def _encode_objects(self, objects: Dict[str, Any]) -> Dict[str, Any]:
        return encode_params(objects)

    def _decode_objects(self, objects: Dict[str, Any]) -> Dict[str, Any]:
        return decode_params(objects)


def encode_params(objects: Dict[str, Any]) -> Dict[str, Any]:
    """Object params for persistence: the model as :class:`SavedModel`, the optimizer as
    ``("keras_optimizer", config)``."""
    out = dict(objects)
    if out.get("model") is not None:
        out["model"] = SavedModel.of(out["model"])
    if out.get("optimizer") is not None:
        out["optimizer"] = ("keras_optimizer", optimizer_config(out["optimizer"]))
    return out


def decode_params(objects: Dict[str, Any]) -> Dict[str, Any]:
    """The inverse of :func:`encode_params`."""
    out = dict(objects)
    custom = out.get("custom_objects")
    if isinstance(out.get("model"), SavedModel):
        out["model"] = out["model"].load(custom)
    opt = out.get("optimizer")
    if isinstance(opt, tuple) and len(opt) == 2 and opt[0] == "keras_optimizer":
        out["optimizer"] = optimizer_from_config(opt[1], custom)
    return out
