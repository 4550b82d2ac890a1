"""The one settings table (spark_hvd/settings.def): the core, spark_hvd._config and the
docs/settings.md's table agree on it, and no SPARK_HVD_* name is used without being
declared there (or in the launch contract, spark_hvd/_job/env.py). That the launchers
read the settings without loading the core is checked in test_imports.py."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spark_hvd import _config
from spark_hvd._job import env as renv
from spark_hvd.exceptions import InvalidArgumentError

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"(?<![A-Za-z0-9_])SPARK_HVD_[A-Z0-9_]*[A-Z0-9]")
HOROVOD_NAME = re.compile(r"(?<![A-Za-z0-9_])HOROVOD_[A-Z0-9_]*[A-Z0-9]")
LITERAL = re.compile(r"""["'](SPARK_HVD_[A-Z0-9_]*[A-Z0-9])["']""")
SOURCES = ("*.py", "*.h", "*.cc", "*.def", "*.in")
DECLARED = {s.name for s in _config.SETTINGS}
ALIASES = {s.alias for s in _config.SETTINGS if s.alias}
CONTRACT = set(renv.LAUNCH_ENV_VARS)


def _files(*dirs):
    for d in dirs:
        for pattern in SOURCES:
            yield from sorted((ROOT / d).rglob(pattern))


def _readme_rows():
    text = (ROOT / "docs" / "settings.md").read_text()
    section = text[text.index("| variable |"):]
    lines = [ln for ln in section.splitlines() if ln.strip()]
    rows = []
    for line in lines[2:]:  # after the header and the |---| line
        if not line.startswith("|"):
            break
        rows.append(tuple(cell.strip() for cell in line.strip().strip("|").split("|")))
    return rows


def test_readme_settings_table_is_the_declared_table():
    expected = list(_config.readme_rows())
    assert _readme_rows() == expected, (
        "docs/settings.md's table differs from spark_hvd/settings.def; "
        "`python -m spark_hvd._config` prints the table to paste")


def test_the_core_was_compiled_from_the_same_table():
    from spark_hvd import _core

    assert _core.settings() == [
        {"name": s.name, "type": s.type, "default": s.default, "unit": s.unit,
         "meaning": s.meaning, "alias": s.alias} for s in _config.SETTINGS]


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
    entry = 'SHVD_SETTING(Getter, "SPARK_HVD_X_S", Float, {}, "s", "m", "")\n'
    assert _config.parse_table("// comment\n" + entry.format("1.5"))[0].default == 1.5
    assert _config.parse_table(entry.format('"a" "b"').replace("Float", "String"))[0].default \
        == "ab"
    for bad in ("1", "os.getpid()", "2 ** 4"):
        with pytest.raises(ValueError, match="settings.def:1"):
            _config.parse_table(entry.format(bad))
    with pytest.raises(ValueError, match="the alias HOROVOD_"):
        _config.parse_table(entry.format("1.5").replace('"m", ""', '"m", "MY_X"'))


def test_horovod_aliases_are_declared_once_and_only_in_the_table():
    """Each Horovod name stands for one setting, and code names no other HOROVOD_
    variable (which would be a knob read outside the table)."""
    aliases = [s.alias for s in _config.SETTINGS if s.alias]
    assert len(aliases) == len(set(aliases)) == len(_config.BY_ALIAS)
    assert all(a.startswith(_config.ALIAS_PREFIX) for a in aliases)
    unknown, literal = {}, {}
    for path in _files("spark_hvd", "csrc", "estimators", "bench"):
        text, where = path.read_text(), str(path.relative_to(ROOT))
        for name in set(HOROVOD_NAME.findall(text)) - ALIASES:
            unknown.setdefault(name, []).append(where)
        quoted = re.search(r"[\"']HOROVOD_[A-Z0-9_]*[A-Z0-9][\"']", text)
        if quoted and where != "spark_hvd/settings.def":
            literal[where] = quoted.group()
    assert not unknown, f"HOROVOD_* names no row of spark_hvd/settings.def has: {unknown}"
    assert not literal, f"Horovod names spelled out outside spark_hvd/settings.def: {literal}"


def test_python_reads_the_horovod_alias_when_the_name_is_unset():
    cycle = _config.BY_NAME[_config.CYCLE_TIME_MS_ENV_VAR]
    assert cycle.alias == "HOROVOD_CYCLE_TIME" and cycle.unit == "ms"
    assert _config.cycle_time_ms({"HOROVOD_CYCLE_TIME": "3.5"}) == 3.5
    assert cycle.source({"HOROVOD_CYCLE_TIME": "3.5"}) == "HOROVOD_CYCLE_TIME"
    both = {"HOROVOD_CYCLE_TIME": "3.5", cycle.name: "2"}
    assert _config.cycle_time_ms(both) == 2.0 and cycle.source(both) == cycle.name
    assert _config.cycle_time_ms({"HOROVOD_CYCLE_TIME": ""}) == _config.DEFAULT_CYCLE_TIME_MS
    with pytest.raises(InvalidArgumentError, match="HOROVOD_CACHE_CAPACITY='x' is not"):
        _config.cache_capacity({"HOROVOD_CACHE_CAPACITY": "x"})
    # Horovod spells choices in upper case; a Name is read in lower case, a path as it is.
    assert _config.cpu_operations({"HOROVOD_CPU_OPERATIONS": "GLOO"}) == "gloo"
    assert _config.controller({"HOROVOD_CONTROLLER": "MPI"}) == "mpi"
    assert _config.timeline({"HOROVOD_TIMELINE": "/T/Line.json"}) == "/T/Line.json"


# Horovod's variables as a job configured for Horovod sets them (plus one SPARK_HVD_
# name that must win over its alias): the core and _config must agree on every value.
_HOROVOD_ENV = {
    "HOROVOD_FUSION_THRESHOLD": "1048576", "HOROVOD_CYCLE_TIME": "3.5",
    "HOROVOD_CACHE_CAPACITY": "9", "SPARK_HVD_CACHE_CAPACITY": "7",
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "120", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "240",
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "45", "HOROVOD_CPU_OPERATIONS": "GLOO",
    "HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_LOG_LEVEL": "ERROR",
    "HOROVOD_START_TIMEOUT": "50", "HOROVOD_TIMELINE": "/tmp/Horovod_Timeline.json",
    "HOROVOD_CONTROLLER": "GLOO", "HOROVOD_AUTOTUNE": "1",
    "HOROVOD_AUTOTUNE_LOG": "/tmp/Autotune_Log.csv", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "2",
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "4", "HOROVOD_ELASTIC_TIMEOUT": "90",
    "HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_HIERARCHICAL_ALLGATHER": "1",
}
_READ_BOTH = """
import json
from spark_hvd import _config, _core
print(json.dumps({s.name: [_core.setting_value(s.name), s.read()] for s in _config.SETTINGS}))
"""


def test_the_core_reads_the_horovod_aliases_like_python():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith((_config.PREFIX, _config.ALIAS_PREFIX))}
    env.update(_HOROVOD_ENV, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _READ_BOTH], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    values = json.loads(out.splitlines()[-1])
    assert {name: core for name, (core, _) in values.items()} \
        == {name: python for name, (_, python) in values.items()}
    assert values["SPARK_HVD_CYCLE_TIME_MS"][0] == 3.5
    assert values["SPARK_HVD_FUSION_THRESHOLD"][0] == 1048576
    assert values["SPARK_HVD_CACHE_CAPACITY"][0] == 7  # the SPARK_HVD_ name wins
    assert values["SPARK_HVD_CPU_OPERATIONS"][0] == "gloo"
    assert values["SPARK_HVD_GPU_OPERATIONS"][0] == "nccl"
    assert values["SPARK_HVD_LOG_LEVEL"][0] == "error"
    assert values["SPARK_HVD_TIMELINE"][0] == "/tmp/Horovod_Timeline.json"
    assert values["SPARK_HVD_AUTOTUNE"][0] == 1
    assert values["SPARK_HVD_AUTOTUNE_LOG"][0] == "/tmp/Autotune_Log.csv"
    assert values["SPARK_HVD_AUTOTUNE_WARMUP_SAMPLES"][0] == 2
    assert values["SPARK_HVD_AUTOTUNE_STEPS_PER_SAMPLE"][0] == 4
    assert values["SPARK_HVD_ELASTIC_TIMEOUT_S"][0] == 90.0
    assert values["SPARK_HVD_HIERARCHICAL_ALLREDUCE"][0] == 1
    assert values["SPARK_HVD_HIERARCHICAL_ALLGATHER"][0] == 1
    aliased = {s.name for s in _config.SETTINGS if s.alias in _HOROVOD_ENV}
    assert aliased == {s.name for s in _config.SETTINGS if s.alias}  # every alias tried


def test_autotune_rows_take_horovods_names_and_defaults():
    """Autotune is off by default; its sample settings default to Horovod's (3 warm-up
    samples, 10 steps per sample, the median of 5 samples per configuration, a number
    Horovod fixes and does not read)."""
    rows = {s.key: s for s in _config.SETTINGS if s.key.startswith("AUTOTUNE")}
    assert {k: (s.type, s.default, s.alias) for k, s in rows.items()} == {
        "AUTOTUNE": ("Int", 0, "HOROVOD_AUTOTUNE"),
        "AUTOTUNE_LOG": ("String", "", "HOROVOD_AUTOTUNE_LOG"),
        "AUTOTUNE_WARMUP_SAMPLES": ("Int", 3, "HOROVOD_AUTOTUNE_WARMUP_SAMPLES"),
        "AUTOTUNE_STEPS_PER_SAMPLE": ("Int", 10, "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"),
        "AUTOTUNE_SAMPLES": ("Int", 5, ""),
    }
    assert _config.autotune({"HOROVOD_AUTOTUNE": "1"}) == 1
    assert _config.autotune({"HOROVOD_AUTOTUNE": "1", _config.AUTOTUNE_ENV_VAR: "0"}) == 0
    assert _config.autotune_steps_per_sample({"HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "5"}) == 5


def test_setting_value_rejects_an_unknown_name():
    from spark_hvd import _core

    with pytest.raises(InvalidArgumentError, match="no setting is named SPARK_HVD_NOPE"):
        _core.setting_value("SPARK_HVD_NOPE")


def test_the_elastic_launchers_default_timeout_is_the_setting(monkeypatch):
    """spark-hvdrun's --elastic-timeout and run_elastic's elastic_timeout default to
    SPARK_HVD_ELASTIC_TIMEOUT_S, else Horovod's HOROVOD_ELASTIC_TIMEOUT, else 600 s."""
    from spark_hvd.runner._elastic_launch import ElasticOptions
    from spark_hvd.spark._elastic import _elastic_timeout
    name = _config.ELASTIC_TIMEOUT_S_ENV_VAR
    alias = _config.BY_NAME[name].alias
    for var in (name, alias):
        monkeypatch.delenv(var, raising=False)

    def defaults():
        return ElasticOptions().elastic_timeout_s, _elastic_timeout(None)
    assert defaults() == (600.0, 600.0)
    monkeypatch.setenv(alias, "42")
    assert defaults() == (42.0, 42.0)
    monkeypatch.setenv(name, "7.5")
    assert defaults() == (7.5, 7.5)
    assert ElasticOptions(elastic_timeout_s=3.0).elastic_timeout_s == _elastic_timeout(3) == 3.0
    monkeypatch.delenv(name)
    monkeypatch.setenv(alias, "0")
    with pytest.raises(InvalidArgumentError, match=f"^{alias} must be a number of seconds > 0"):
        _elastic_timeout(None)
