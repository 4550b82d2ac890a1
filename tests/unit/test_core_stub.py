"""spark_hvd/_core.pyi, the native module's stub: it names exactly what spark_hvd._core
exports (functions, Work's methods, every enum member with its value) and ships with
the package."""

import ast
import enum
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUB = ROOT / "spark_hvd" / "_core.pyi"


def _stub():
    """Top-level names of the stub: functions, and classes with their members."""
    names = {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            names[node.name] = None
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            members = {}
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                    members[item.name] = None
                elif isinstance(item, ast.Assign):
                    members[item.targets[0].id] = ast.literal_eval(item.value)
            names[node.name] = members
    return names


def _exported():
    from spark_hvd import _core

    names = {}
    for name in dir(_core):
        if name.startswith("_"):
            continue
        value = getattr(_core, name)
        if isinstance(value, type) and issubclass(value, enum.Enum):
            names[name] = {m.name: m.value for m in value}
        elif isinstance(value, type):
            names[name] = {n: None for n in vars(value) if not n.startswith("_")}
        else:
            names[name] = None
    return names


def test_core_stub_names_exactly_what_the_core_exports():
    assert _stub() == _exported()


def test_core_stub_ships_with_the_package():
    """As package data, with py.typed (PEP 561: type checkers use a package's stubs
    only when it has one)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]["spark_hvd"]
    assert {"_core.pyi", "py.typed"} <= set(data)
    assert (ROOT / "spark_hvd" / "py.typed").exists()
