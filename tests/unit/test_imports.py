"""The package's import structure.

- The module import graph (tests/import_graph.py: every import, function-level ones
  included) has no cycle, and its edges point down the layers below.
- No module imports another package's private (``_``) modules: a layer uses the seams the
  one below exports.
- Every module imports in a fresh interpreter (one per package), and the driver side
  (launchers, Spark, data, estimators) never loads the native core.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import import_graph

ROOT = Path(__file__).resolve().parents[2]

# Lowest first: a module imports only from its own layer or the ones before it.
LAYERS = (
    ("foundation", ("spark_hvd.exceptions", "spark_hvd._config")),
    ("job contract", ("spark_hvd._job",)),
    ("native core", ("spark_hvd._core",)),
    ("core API", ("spark_hvd", "spark_hvd._types", "spark_hvd._runtime", "spark_hvd._ops",
                  "spark_hvd._basics")),
    ("framework shims, data", ("spark_hvd.torch", "spark_hvd.tensorflow", "spark_hvd.keras",
                               "spark_hvd.mxnet", "spark_hvd.data")),
    ("runner", ("spark_hvd.runner",)),
    ("spark", ("spark_hvd.spark",)),
    # Horovod's estimator paths (spark_hvd.spark.torch ...) give the estimators' classes.
    ("estimators", ("spark_hvd.estimators", "spark_hvd.spark.torch", "spark_hvd.spark.keras",
                    "spark_hvd.spark.lightning", "spark_hvd.spark.common.store")),
)

# Fresh-interpreter groups (a flat module, or a subpackage with all its modules) whose
# imports must leave the native core unloaded: a Spark driver or a launcher needs no
# compiled collective engine.
CORE_FREE = ("spark_hvd", "spark_hvd.exceptions", "spark_hvd._config", "spark_hvd._job",
             "spark_hvd.data", "spark_hvd.runner", "spark_hvd.spark", "spark_hvd.estimators")
REQUIRES = {"spark_hvd.torch": "torch", "spark_hvd.tensorflow": "tensorflow",
            "spark_hvd.keras": "tensorflow",
            # MXNet 1.9 needs numpy < 1.24: only the compat env (.venv-compat) has it.
            "spark_hvd.mxnet": "mxnet",
            "spark_hvd.estimators": "pyspark"}


def layer_of(module: str) -> int:
    best, index = "", None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best):
                best, index = p, i
    assert index is not None, f"{module} is in no layer: add it to LAYERS"
    return index


def test_no_import_cycles():
    found = import_graph.cycles(import_graph.build_graph())
    assert not found, "import cycles:\n" + import_graph.format_cycles(found)


def test_dependencies_point_down_the_layers():
    upward = []
    for module, deps in sorted(import_graph.build_graph().items()):
        for dep in sorted(deps):
            if layer_of(dep) > layer_of(module):
                upward.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {dep} "
                              f"({LAYERS[layer_of(dep)][0]})")
    assert not upward, "\n".join(upward)


def _owner(module: str) -> str:
    """The package that owns a private module: the part before its first ``_name``
    (``spark_hvd.data._arrow`` -> ``spark_hvd.data``); "" for a public module."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and i > 0:
            return ".".join(parts[:i])
    return ""


def private_imports(graph):
    """Imports of a private module (``pkg._x``) from outside the package that owns it:
    a layer reaching into another's internals instead of the seam it exports."""
    found = []
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps):
            owner = _owner(dep)
            if owner and module != owner and not module.startswith(owner + "."):
                found.append(f"{module} imports {dep}, private to {owner}")
    return found


def test_no_module_imports_another_packages_private_modules():
    """The estimators take the data layer's Arrow conversions from ``spark_hvd.data`` and
    the Spark layer's launch plan from ``spark_hvd.spark``, not from their ``_`` modules;
    ``spark_hvd._core`` and its siblings belong to ``spark_hvd``, whose subpackages use them."""
    found = private_imports(import_graph.build_graph())
    assert not found, "\n".join(found)


def test_the_private_import_check_sees_one():
    graph = {"spark_hvd.estimators.materialize": {"spark_hvd.data._arrow"},
             "spark_hvd.data.reader": {"spark_hvd.data._arrow"},
             "spark_hvd.torch.mpi_ops": {"spark_hvd._ops"}}
    assert private_imports(graph) == [
        "spark_hvd.estimators.materialize imports spark_hvd.data._arrow, private to "
        "spark_hvd.data"]


def test_the_checker_sees_function_level_relative_and_type_only_imports(tmp_path,
                                                                        monkeypatch):
    """A function-level import one way and a type-only one back (as launch.py and
    _elastic_launch.py had) is a cycle too."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (pkg / "b.py").write_text("from . import c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from pkg.a import f\n")
    (pkg / "d.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    import pkg.b\n")
    monkeypatch.setattr(import_graph, "PACKAGES", {"pkg": pkg})
    graph = import_graph.build_graph()
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.b"}
    assert import_graph.cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


def _groups():
    groups = {}
    for module in import_graph.modules():
        if module.endswith(".__main__"):
            continue  # runs the launcher
        groups.setdefault(".".join(module.split(".")[:2]), []).append(module)
    return {g: sorted(ms, key=lambda m: (m != g, m)) for g, ms in sorted(groups.items())}


GROUPS = _groups()
_IMPORT_ALL = ("import importlib, json, sys\n"
               "for m in sys.argv[1:]:\n"
               "    importlib.import_module(m)\n"
               "print(json.dumps('spark_hvd._core' in sys.modules))\n")


@pytest.mark.parametrize("group", list(GROUPS))
def test_every_module_imports_in_a_fresh_interpreter(group):
    needed = REQUIRES.get(group)
    if needed and importlib.util.find_spec(needed) is None:
        pytest.skip(f"{needed} is not installed")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *GROUPS[group]], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"importing {GROUPS[group]} failed:\n{proc.stderr[-3000:]}"
    core_loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    if group in CORE_FREE:
        assert not core_loaded, f"importing {GROUPS[group]} loaded spark_hvd._core"


def test_the_entry_points_are_among_them():
    covered = {m for ms in GROUPS.values() for m in ms}
    for module in ("spark_hvd", "spark_hvd.torch", "spark_hvd.tensorflow",
                   "spark_hvd.tensorflow.keras", "spark_hvd.spark", "spark_hvd.runner",
                   "spark_hvd.runner.launch", "spark_hvd.data", "spark_hvd.estimators",
                   "spark_hvd.exceptions"):
        assert module in covered
