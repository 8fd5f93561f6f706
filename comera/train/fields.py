"""The kind check every train config runs first: each field's value of its annotated kind.

The configs' own checks compare values (``steps < 1``), and a value of another kind slips
past them or fails inside them: NaN passes ``< 1`` (``steps=nan`` trained nothing and
returned), ``2.5`` passed for a count and failed mid-run, ``None`` or a string raised a
bare ``TypeError``. :func:`check_kinds` refuses those first, naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

import numpy as np

from comera.errors import ConfigError

__all__ = ["check_kinds"]


def check_kinds(obj: Any) -> None:
    """Refuse, as a :class:`ConfigError` naming ``Class.field``, a field of the dataclass
    ``obj`` whose value is not of its annotated kind: ``int`` an integer (numpy's too, not
    a bool or a float), ``float`` a real number (an int too), ``bool`` a bool, ``str`` a
    string, a config class an instance of it, ``tuple[...]`` a tuple, list, set or other
    iterable of such; ``X | None`` also takes None. Another form of a right value (a
    numpy number or bool, a list for a tuple) is stored as the plain Python one."""
    cls = type(obj)
    for name, hint in _hints(cls):
        given = getattr(obj, name)
        value = _plain(given, hint)
        if not _fits(value, hint):
            raise ConfigError(f"{cls.__name__}.{name} must be {_say(hint)}, got {given!r}")
        if value is not given:
            setattr(obj, name, value)


def _plain(value: object, hint: Any) -> object:
    """``value`` as the plain Python value of its kind where it is another form of it: a
    numpy number as ``int``/``float`` (random.seed and JSON take Python's; an int past a
    float's range as infinity, which the field's own check judges), numpy's bool and string
    as ``bool`` and ``str``, a list or other iterable as a tuple of such (a set only for a
    tuple of any length, sorted: a pair has an order a set does not keep). Anything else is
    returned as it is, for :func:`_fits` to judge."""
    kinds = _options(hint)
    if value is None:
        return value
    if isinstance(value, str):  # numpy's, or a str-mixin Enum member (its value)
        return value if type(value) is str else str.__str__(value)
    if bool in kinds and isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, bool):
        return value
    if int in kinds and isinstance(value, numbers.Integral):
        return value if type(value) is int else int(value)
    if float in kinds and isinstance(value, numbers.Real):
        try:
            return value if type(value) is float else float(value)
        except OverflowError:
            return math.inf if value > 0 else -math.inf  # type: ignore[operator]
    for kind in kinds:
        args = typing.get_args(kind)
        if typing.get_origin(kind) is tuple and args and isinstance(value, Iterable):
            if isinstance(value, (bytes, Mapping)) or getattr(value, "ndim", 1) == 0:
                return value
            if isinstance(value, (set, frozenset)):
                if Ellipsis not in args:
                    return value
                try:
                    items = sorted(value)
                except TypeError:  # mixed kinds: refused as they are
                    return value
            else:
                items = list(value)
            each = _element_kinds(args, len(items))
            if each is None:
                return value
            return tuple(_plain(v, a) for v, a in zip(items, each, strict=True))
    return value


def _element_kinds(args: tuple[Any, ...], n: int) -> list[Any] | None:
    """The kinds of ``n`` elements of ``tuple[*args]`` (``tuple[X, ...]``: any number of X),
    or None when ``n`` elements cannot be one."""
    if Ellipsis in args:
        return [args[0]] * n
    return list(args) if len(args) == n else None


@cache
def _hints(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def _options(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return typing.get_args(hint)
    return (hint,)


def _fits(value: object, hint: Any) -> bool:
    for kind in _options(hint):
        if kind is type(None):
            if value is None:
                return True
        elif kind is bool:
            if isinstance(value, bool):
                return True
        elif kind is int:
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                return True
        elif kind is float:
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                return True
        elif kind is str:
            if isinstance(value, str):
                return True
        elif typing.get_origin(kind) is tuple:
            if isinstance(value, (tuple, list)):
                each = _element_kinds(typing.get_args(kind), len(value))
                if each is not None and all(_fits(v, a) for v, a in zip(value, each, strict=True)):
                    return True
        elif isinstance(kind, type):
            if isinstance(value, kind):
                return True
        else:  # a kind this check does not know: the config's own checks decide
            return True
    return False


def _say(hint: Any) -> str:
    words = {
        type(None): "None",
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
    }
    plural = {int: "integers", float: "numbers", str: "strings", bool: "bools"}
    out = []
    for kind in _options(hint):
        if kind in words:
            out.append(words[kind])
        elif typing.get_origin(kind) is tuple:
            args = typing.get_args(kind)
            what = plural.get(args[0], "values") if args else "values"
            out.append(f"a list of {what}" if Ellipsis in args else f"{len(args)} {what}")
        else:
            name = getattr(kind, "__name__", str(kind))
            out.append(f"{'an' if name[0] in 'AEIOU' else 'a'} {name}")
    return " or ".join(out)
