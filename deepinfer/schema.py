"""One coercer from parsed TOML or JSON to frozen dataclasses.

`model.toml` (compiler/config.py), a checkpoint's `config.json` (regions/config.py)
and a bundle's `manifest.json` (bundles/manifest.py) are each a tree of plain
values read into dataclasses by `build`. Every field is checked against its
annotation (int, float, bool, str, Path, Literal[...], X | None, tuple[X, ...],
dict, dict[K, V] and nested dataclasses); the first problem raises `Problem`
with the key path it was found at, which each caller turns into its own error
(a TOML line number, the manifest's path, ...).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

Key = tuple[str | int, ...]


class Problem(Exception):
    """A value that does not fit its field: `key` is the path to it, `message` what is wrong."""

    def __init__(self, key: Key, message: str):
        super().__init__(message)
        self.key, self.message = key, message

    def dotted(self, root: str = "") -> str:
        """The key path as `a.b[2].c` (after `root` when given)."""
        out = root
        for part in self.key:
            if isinstance(part, int):
                out += f"[{part}]"
                continue
            text = part if part.isprintable() else part.encode("unicode_escape").decode()  # one line
            out += f".{text}" if out else text
        return out


@dataclasses.dataclass(frozen=True)
class Rules:
    """How `build` treats what the dataclasses do not declare.

    unknown: "error" (an unknown key is a Problem naming the valid ones) or "extra"
             (unknown keys go to the class's `extra` dict field).
    paths:   a Path field's value as given -> the Path to keep (e.g. relative to a file).
    """

    unknown: str = "error"
    paths: Callable[[str], Path] = Path


def describe(tp) -> str:
    """How an annotation reads in a message ("int", "a list of integers", ...)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in args if a is not type(None))
    if origin is tuple:
        inner = describe(args[0])
        return "a list of integers" if args[0] is int else f"a list of {inner}"
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin is dict or tp is dict:
        return "a table"
    if dataclasses.is_dataclass(tp):
        return "a table"
    return getattr(tp, "__name__", str(tp))


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def coerce(value, tp, key: Key, rules: Rules):
    """`value` as annotation `tp` requires, or Problem."""
    origin = typing.get_origin(tp)
    if tp is Any or tp is object:
        return value
    if origin in (typing.Union, types.UnionType):
        return _union(value, tp, key, rules)
    if origin is Literal:
        return _literal(value, tp, key)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key=key, rules=rules)
    if origin is tuple:
        return _tuple(value, tp, key, rules)
    if origin is dict or tp is dict:
        return _dict(value, tp, key, rules)
    return _scalar(value, tp, key, rules)


def _union(value, tp, key: Key, rules: Rules):
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:  # X | None: X's own problem, nested keys included
        return coerce(value, options[0], key, rules)
    for option in options[:-1]:
        try:
            return coerce(value, option, key, rules)
        except Problem:
            pass
    try:
        return coerce(value, options[-1], key, rules)
    except Problem:
        raise Problem(key, f"expected {describe(tp)}, got {value!r}") from None


def _literal(value, tp, key: Key):
    args = typing.get_args(tp)
    if value in args and type(value) in {type(a) for a in args}:
        return value
    raise Problem(key, f"expected one of {', '.join(map(repr, args))}, got {value!r}")


def _tuple(value, tp, key: Key, rules: Rules):
    if not isinstance(value, (list, tuple)):
        raise Problem(key, f"expected {describe(tp)}, got {value!r}")
    item = typing.get_args(tp)[0]
    try:
        return tuple(coerce(v, item, key + (i,), rules) for i, v in enumerate(value))
    except Problem as p:
        if item in (int, str, float):  # one message for a flat list
            raise Problem(key, f"expected {describe(tp)}, got {value!r}") from None
        raise p


def _dict(value, tp, key: Key, rules: Rules):
    if not isinstance(value, dict):
        raise Problem(key, f"expected {describe(tp)}, got {value!r}")
    args = typing.get_args(tp)
    if not args:
        return value
    kt, vt = args
    out = {}
    for raw, v in value.items():
        k = raw
        if kt is int:
            if not (isinstance(raw, int) or (isinstance(raw, str) and raw.lstrip("-").isdigit())):
                raise Problem(key + (raw,), f"expected an integer key, got {raw!r}")
            k = int(raw)
        out[k] = coerce(v, vt, key + (k,), rules)
    return out


def _scalar(value, tp, key: Key, rules: Rules):
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):  # JSON readers accept NaN and Infinity
                raise Problem(key, f"must be a finite number, got {value!r}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Path:
        if isinstance(value, str):
            try:
                return rules.paths(value)
            except (RuntimeError, ValueError, OSError) as e:  # e.g. `~nosuchuser/...`
                raise Problem(key, f"cannot resolve the path {value!r} ({e})") from None
    else:
        raise TypeError(f"schema: no rule for annotation {tp!r} at {key}")
    raise Problem(key, f"expected {describe(tp)}, got {value!r}")


def build(cls, data, *, key: Key = (), rules: Rules = Rules(), given: dict | None = None):
    """An instance of dataclass `cls` from the mapping `data`.

    `given` supplies fields that do not come from `data` (built by the caller).
    """
    if not isinstance(data, dict):
        raise Problem(key, f"expected a table, got {data!r}")
    given = given or {}
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in given}
    keep_extra = rules.unknown == "extra" and "extra" in fields
    kwargs, extra = dict(given), {}
    for name, value in data.items():
        f = fields.get(name)
        if f is None or (keep_extra and name == "extra"):
            if keep_extra:
                extra[name] = value
                continue
            valid = ", ".join(n for n in fields if n != "extra")
            raise Problem(key + (name,), f"unknown key {name!r}; valid keys: {valid}")
        kwargs[name] = coerce(value, hints[name], key + (name,), rules)
    if keep_extra:
        kwargs["extra"] = extra
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise Problem(key, f"missing required key(s) {', '.join(missing)}")
    return cls(**kwargs)


def dump(obj):
    """A dataclass tree as plain JSON values (tuples as lists, Paths as strings); fields whose
    value is None and whose default is None are left out."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is None and f.default is None:
                continue
            out[f.name] = dump(value)
        return out
    if isinstance(obj, (list, tuple)):
        return [dump(v) for v in obj]
    if isinstance(obj, dict):
        return {(str(k) if not isinstance(k, str) else k): dump(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj
