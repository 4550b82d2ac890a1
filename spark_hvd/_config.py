"""Every SPARK_HVD_* setting, read from the one table the core is compiled from.

The table is ``settings.def`` beside this file (an X-macro list the C++ getters in
csrc/common/env.h are generated from). This module parses it, so the launchers know
the settings without loading the native core, and defines for each setting
``SPARK_HVD_<KEY>``:

- ``<KEY>_ENV_VAR``: the variable's name, e.g. ``START_TIMEOUT_S_ENV_VAR``;
- ``DEFAULT_<KEY>``: its default (int, float or str), e.g. ``DEFAULT_START_TIMEOUT_S``;
- ``<key>(environ=None)``: its value in ``environ`` (default ``os.environ``), e.g.
  ``start_timeout_s()``; InvalidArgumentError naming the variable when it does not parse.

A setting Horovod has too names Horovod's variable (``Setting.alias``, e.g.
``HOROVOD_CYCLE_TIME``), read when the ``SPARK_HVD_`` one is unset, as the core does.

``python -m spark_hvd._config`` prints the settings table of docs/settings.md.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple, Union

from spark_hvd.exceptions import InvalidArgumentError

TABLE_PATH = Path(__file__).with_name("settings.def")
PREFIX = "SPARK_HVD_"
ALIAS_PREFIX = "HOROVOD_"
_TYPES = {"Int": int, "Float": float, "String": str, "Name": str}

Value = Union[int, float, str]


@dataclass(frozen=True)
class Setting:
    """One row of settings.def."""

    getter: str   # the C++ getter, env::<getter>()
    name: str     # SPARK_HVD_...
    type: str     # "Int", "Float" or "String"
    default: Value
    unit: str     # "" when the value has none
    meaning: str
    alias: str = ""  # Horovod's variable for it (HOROVOD_...), "" when it has none

    @property
    def key(self) -> str:
        """The name without SPARK_HVD_: the stem of the Python constants."""
        return self.name[len(PREFIX):]

    def source(self, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
        """The variable that decides the value in ``environ``: the name when it is set,
        else the alias when that is set, else None (the default)."""
        environ = os.environ if environ is None else environ
        for var in (self.name, self.alias):
            if var and var in environ:
                return var
        return None

    def read(self, environ: Optional[Mapping[str, str]] = None) -> Value:
        """This setting's value in ``environ`` (default ``os.environ``), parsed like the
        core does: the Horovod alias when the name is unset; numbers fall back to the
        default when unset or empty, strings only when unset; a Name in lower case."""
        environ = os.environ if environ is None else environ
        var = self.source(environ)
        value = None if var is None else environ[var]
        if value is None or (value == "" and self.type in ("Int", "Float")):
            return self.default
        if self.type == "Name":
            return value.lower()
        try:
            return _TYPES[self.type](value)
        except ValueError:
            kind = "an integer" if self.type == "Int" else "a number"
            raise InvalidArgumentError(f"{var}={value!r} is not {kind}") from None


def parse_table(text: str) -> Tuple[Setting, ...]:
    """The settings declared in ``text`` (the contents of settings.def)."""
    lines = [line if not line.lstrip().startswith(("//", "#")) else ""
             for line in text.splitlines()]  # blanked, so line numbers stay right
    settings = []
    for stmt in ast.parse("\n".join(lines), filename=str(TABLE_PATH)).body:
        settings.append(_parse_entry(stmt))
    return tuple(settings)


def _parse_entry(stmt: ast.stmt) -> Setting:
    where = f"{TABLE_PATH.name}:{stmt.lineno}"
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            and call.func.id == "SHVD_SETTING" and len(call.args) == 7 and not call.keywords):
        raise ValueError(f"{where}: expected SHVD_SETTING(Getter, name, Type, default, unit, "
                         "meaning, alias)")
    getter, name, type_, default, unit, meaning, alias = call.args
    if not (isinstance(getter, ast.Name) and isinstance(type_, ast.Name)
            and type_.id in _TYPES):
        raise ValueError(f"{where}: the getter must be an identifier and the type one of "
                         f"{', '.join(_TYPES)}")
    strings = [_literal(n, where) for n in (name, unit, meaning, alias)]
    if not all(isinstance(s, str) for s in strings) or not strings[0].startswith(PREFIX) \
            or not (strings[3] == "" or strings[3].startswith(ALIAS_PREFIX)):
        raise ValueError(f"{where}: name, unit, meaning and alias must be strings, the name "
                         f"{PREFIX}..., the alias {ALIAS_PREFIX}... or \"\"")
    value = _literal(default, where)
    if type(value) is not _TYPES[type_.id]:
        raise ValueError(f"{where}: default {value!r} is not of type {type_.id}")
    return Setting(getter.id, strings[0], type_.id, value, strings[1], strings[2], strings[3])


def _literal(node: ast.expr, where: str) -> Value:
    """A constant, a negated number (-1), or a product of integer constants (64 * 1024 *
    1024)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _literal(node.operand, where)
        if type(value) in (int, float):
            return -value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        left, right = _literal(node.left, where), _literal(node.right, where)
        if type(left) is int and type(right) is int:
            return left * right
    raise ValueError(f"{where}: {ast.unparse(node)} is not a literal")


SETTINGS: Tuple[Setting, ...] = parse_table(TABLE_PATH.read_text())
BY_NAME: Dict[str, Setting] = {s.name: s for s in SETTINGS}
BY_ALIAS: Dict[str, Setting] = {s.alias: s for s in SETTINGS if s.alias}

for _s in SETTINGS:
    for _attr, _value in ((f"{_s.key}_ENV_VAR", _s.name), (f"DEFAULT_{_s.key}", _s.default),
                          (_s.key.lower(), _s.read)):
        if _attr in globals():
            raise ValueError(f"{TABLE_PATH.name}: {_s.name} would redefine _config.{_attr}")
        globals()[_attr] = _value
del _s, _attr, _value


def _format_default(setting: Setting) -> str:
    text = f"{setting.default:g}" if setting.type == "Float" else str(setting.default)
    if setting.unit and not setting.name.lower().endswith("_" + setting.unit):
        text += f" {setting.unit}"  # the name does not carry the unit
    return text


def readme_rows() -> Tuple[Tuple[str, str, str, str], ...]:
    """The rows of docs/settings.md's table: (`variable`, default, meaning, `Horovod alias`)."""
    return tuple((f"`{s.name}`", _format_default(s), s.meaning,
                  f"`{s.alias}`" if s.alias else "") for s in SETTINGS)


def readme_table() -> str:
    """docs/settings.md's table, in Markdown."""
    lines = ["| variable | default | meaning | Horovod's name |", "|---|---|---|---|"]
    lines += ["|" + "|".join(f" {cell} " if cell else " " for cell in row) + "|"
              for row in readme_rows()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(readme_table())
