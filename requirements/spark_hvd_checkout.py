"""Copied by `make compat` into .venv-compat's site-packages (with a .pth that imports it):
spark_hvd from this checkout, as the main venv's editable install has it. The checkout's root
is on the path (a line of the .pth), so ``spark_hvd`` and its built ``_core`` import from
there; this finder adds what pyproject's package-dir maps: ``spark_hvd.estimators`` is the
checkout's ``estimators/`` directory."""

import importlib.abc
import importlib.util
import os
import sys

MAPPED = {"spark_hvd.estimators": "estimators"}


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name not in MAPPED:
            return None
        directory = os.path.join(self.root, MAPPED[name])
        return importlib.util.spec_from_file_location(
            name, os.path.join(directory, "__init__.py"),
            submodule_search_locations=[directory])


def install(root: str) -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder(root))
