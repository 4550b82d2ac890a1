"""The one settings table (spark_hvd/settings.def): the core, spark_hvd._config and the
README's Settings table agree on it, and no SPARK_HVD_* name is used without being
declared there (or in the launch contract, spark_hvd/_job/env.py). That the launchers
read the settings without loading the core is checked in test_imports.py."""

import re
from pathlib import Path

import pytest

from spark_hvd import _config
from spark_hvd._job import env as renv
from spark_hvd.exceptions import InvalidArgumentError

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"(?<![A-Za-z0-9_])SPARK_HVD_[A-Z0-9_]*[A-Z0-9]")
LITERAL = re.compile(r"""["'](SPARK_HVD_[A-Z0-9_]*[A-Z0-9])["']""")
SOURCES = ("*.py", "*.h", "*.cc", "*.def", "*.in")
DECLARED = {s.name for s in _config.SETTINGS}
CONTRACT = set(renv.LAUNCH_ENV_VARS)


def _files(*dirs):
    for d in dirs:
        for pattern in SOURCES:
            yield from sorted((ROOT / d).rglob(pattern))


def _readme_rows():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Settings\n"):]
    lines = [ln for ln in section.splitlines()[1:] if ln.strip()]
    rows = []
    for line in lines[2:]:  # after the header and the |---| line
        if not line.startswith("|"):
            break
        rows.append(tuple(cell.strip() for cell in line.strip().strip("|").split("|")))
    return rows


def test_readme_settings_table_is_the_declared_table():
    expected = list(_config.readme_rows())
    assert _readme_rows() == expected, (
        "README.md's Settings table differs from spark_hvd/settings.def; "
        "`python -m spark_hvd._config` prints the table to paste")


def test_the_core_was_compiled_from_the_same_table():
    from spark_hvd import _core

    assert _core.settings() == [
        {"name": s.name, "type": s.type, "default": s.default, "unit": s.unit,
         "meaning": s.meaning} for s in _config.SETTINGS]


def test_every_spark_hvd_name_in_the_code_is_declared():
    """A new knob cannot be read (or documented in a message) without a row in the table."""
    build_flags = set(re.findall(r"#cmakedefine01 (\w+)",
                                 (ROOT / "csrc/common/config.h.in").read_text()))
    assert not DECLARED & CONTRACT
    unknown = {}
    for path in _files("spark_hvd", "csrc", "estimators", "bench"):
        for name in set(NAME.findall(path.read_text())) - DECLARED - CONTRACT - build_flags:
            unknown.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not unknown, (f"undeclared SPARK_HVD_* names {unknown}: declare settings in "
                         "spark_hvd/settings.def, launcher variables in spark_hvd/_job/env.py")


def test_each_name_is_spelled_out_in_one_place():
    """Code refers to a setting through its getter or _config constant, never by a
    literal of its own (which would let a second default creep in)."""
    owner = {**{n: "spark_hvd/settings.def" for n in DECLARED},
             **{n: "spark_hvd/_job/env.py" for n in CONTRACT}}
    found = {}
    for path in _files("spark_hvd", "csrc"):
        for name in LITERAL.findall(path.read_text()):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert {n: paths for n, paths in found.items() if paths != [owner.get(n)]} == {}
    assert set(found) == set(owner)


def test_python_reads_like_the_core():
    timeout = _config.BY_NAME[_config.TIMEOUT_S_ENV_VAR]
    assert timeout.read({}) == _config.DEFAULT_TIMEOUT_S == 30.0
    assert timeout.read({timeout.name: ""}) == 30.0
    assert timeout.read({timeout.name: "2.5"}) == 2.5
    assert _config.cache_capacity({_config.CACHE_CAPACITY_ENV_VAR: "7"}) == 7
    with pytest.raises(InvalidArgumentError, match="CACHE_CAPACITY='x' is not an integer"):
        _config.cache_capacity({_config.CACHE_CAPACITY_ENV_VAR: "x"})
    assert _config.timeline({_config.TIMELINE_ENV_VAR: ""}) == ""
    assert _config.controller({}) == _config.DEFAULT_CONTROLLER == ""


def test_table_entries_must_be_literal():
    entry = 'SHVD_SETTING(Getter, "SPARK_HVD_X_S", Float, {}, "s", "m")\n'
    assert _config.parse_table("// comment\n" + entry.format("1.5"))[0].default == 1.5
    assert _config.parse_table(entry.format('"a" "b"').replace("Float", "String"))[0].default \
        == "ab"
    for bad in ("1", "os.getpid()", "2 ** 4"):
        with pytest.raises(ValueError, match="settings.def:1"):
            _config.parse_table(entry.format(bad))

