"""pyproject.toml declares only what the suite runs: every floor (``>=``) of a dependency or
an extra is a version some environment of ``make test`` installs, read from the pins of
requirements/ (dev.txt for .venv, compat.txt, spark35.txt, spark40.txt)."""

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
# Distributions installed under another name than the one declared.
SAME_AS = {"tensorflow": "tensorflow-cpu"}


def _pins() -> dict:
    """name -> every version pinned (``==``) in requirements/*.txt."""
    pins: dict = {}
    for path in sorted((ROOT / "requirements").glob("*.txt")):
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            m = re.fullmatch(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^\s;]+)", line)
            if m:
                version = Version(m.group(3).split("+", 1)[0])  # torch's +cpu
                pins.setdefault(canonicalize_name(m.group(1)), set()).add(version)
    return pins


def test_every_floor_in_pyproject_is_a_pinned_version_of_the_suite():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        declared += extra
    pins = _pins()
    floors, untested = 0, []
    for text in declared:
        req = Requirement(text)
        name = canonicalize_name(SAME_AS.get(req.name, req.name))
        for spec in req.specifier:
            if spec.operator != ">=":
                continue
            floors += 1
            floor = Version(spec.version)
            if not any(v == floor for v in pins.get(name, ())):  # 2.13 == 2.13.0
                pinned = sorted(map(str, pins.get(name, ())))
                untested.append(f"{text} (requirements/ pins {pinned})")
    assert floors >= 10, floors  # the parse found the floors
    assert not untested, ("floors no environment of the suite installs; pin that version in "
                          "a requirements/ file the suite runs, or move the floor up: "
                          + "; ".join(untested))
