"""The kind check every train config runs first: each field's value of its annotated kind.

The configs' own checks compare values (``steps < 1``), and a value of another kind slips
past them or fails inside them: NaN passes ``< 1`` (``steps=nan`` trained nothing and
returned), ``2.5`` passed for a count and failed mid-run, ``None`` or a string raised a
bare ``TypeError``. :func:`check_kinds` refuses those first, naming the field.
"""

from __future__ import annotations

import dataclasses
import numbers
import types
import typing
from functools import cache
from typing import Any

from comera.errors import ConfigError

__all__ = ["check_kinds"]


def check_kinds(obj: Any) -> None:
    """Refuse, as a :class:`ConfigError` naming ``Class.field``, a field of the dataclass
    ``obj`` whose value is not of its annotated kind: ``int`` an integer (numpy's too, not
    a bool or a float), ``float`` a real number (an int too), ``bool`` a bool, ``str`` a
    string, a config class an instance of it, ``tuple[...]`` a tuple or list of such;
    ``X | None`` also takes None. A numpy integer is stored as Python's."""
    cls = type(obj)
    for name, hint in _hints(cls):
        value = getattr(obj, name)
        if not _fits(value, hint):
            raise ConfigError(f"{cls.__name__}.{name} must be {_say(hint)}, got {value!r}")
        if int in _options(hint) and isinstance(value, numbers.Integral) and type(value) is not int:
            setattr(obj, name, int(value))  # numpy's: random.seed and JSON take Python's


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
            args = typing.get_args(kind)
            if isinstance(value, (tuple, list)) and (
                (len(args) == 2 and args[1] is Ellipsis and all(_fits(v, args[0]) for v in value))
                or (Ellipsis not in args and len(value) == len(args)
                    and all(_fits(v, a) for v, a in zip(value, args, strict=True)))
            ):  # fmt: skip
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
