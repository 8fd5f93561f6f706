"""One command line for every experiment: presets, ``--set`` overrides, plans, resume, wandb.

An experiment module defines an :class:`Experiment` (its config dataclass, presets, a
``build`` that returns the task and model, optional extra flags and a benchmark) and calls
:func:`main`. Everything else is shared:

* ``--preset NAME`` then, in order, the experiment's own flags, the common flags
  (``--steps``, ``--plan``, ``--dense``, ``--device``...) and ``--set a.b.c=value`` (typed by
  the config's annotations and re-validated; an unknown key lists the valid ones);
* ``--resume RUN_DIR`` replays ``RUN_DIR/config.json`` (only where and how it runs may
  change: device, wandb, progress, the CPU allocator policy, block recomputation);
* bad input (a :class:`comera.errors.UserError` or :class:`loaders.errors.LoaderInputError`)
  prints one line naming the flag to change and exits with status 2; any other exception is
  a bug and keeps its traceback (exit status 1).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import comera as C
from comera import autotune
from comera.errors import CheckpointError, ConfigError, MissingFileError, UserError
from comera.plans import DIRECT_STRATEGIES, FIXED_STRATEGIES
from comera.train import NonFiniteLoss, Trainer, init_distributed
from comera.train.checkpoint import complete_checkpoints
from comera.train.config import (
    CPU_MALLOC_POLICIES,
    STEP_MODES,
    check_step_mode_device,
    usable_device,
)
from comera.train.distributed import own_process_group, rank_first
from comera.train.logging import last_logged, read_metrics, write_json_atomic
from comera.train.run_lock import hold_run_dir
from comera.tree import iter_tt
from experiments.cache import cache_root
from experiments.malloc import apply_cpu_malloc, restart_for
from experiments.notes import note
from experiments.report import kept_settings, record_host, resumes
from experiments.run_config import RESUME_MUTABLE, config_jsonable
from loaders.errors import LoaderInputError

__all__ = [
    "CLIError",
    "USER_ERRORS",
    "Experiment",
    "apply_overrides",
    "check_folder",
    "check_same_info",
    "config_file_items",
    "config_jsonable",
    "build_parser",
    "check_batch_sizes",
    "config_from_dict",
    "get_field",
    "main",
    "parse_value",
    "prepare",
    "resolve_config",
    "resumed_config",
    "run_experiment",
    "set_field",
    "sigterm_as_interrupt",
    "stop_signal",
    "stopped_before_training",
    "train",
    "user_error",
]


RUN_FILES = ("config.json", "metrics.jsonl", "checkpoints")  # a run dir already in use
# what a run adds to there: a fresh run would merge its history into another run's (host.json
# is rewritten: one left by a start killed before config.json would block every retry)
RUN_RECORDS = ("ranks.json", "plans.json")


class CLIError(UserError):
    """A bad flag or ``--set`` item (or a run dir in use): printed as one line, exit status 2."""


# what a command prints as one line and exit status 2: bad input, never a bug
USER_ERRORS: tuple[type[Exception], ...] = (UserError, LoaderInputError)


@dataclass(kw_only=True)
class Experiment:
    """What an experiment gives the shared CLI.

    ``build(cfg, rank, world) -> (task, params, state, reference_size, info)``: ``info`` is
    printed at start and stored in ``config.json``, but for its optional ``"layer_table"``
    (text) and ``"notes"`` (lines): printed by rank 0 once the run has passed every check
    (so an error stays one line), not stored.
    ``flags`` adds experiment-specific arguments; ``flag_overrides(args) -> [(key, value)]``
    maps them onto config keys (``(key, value, flag)``: named so in errors).
    Bad input raises a :data:`USER_ERRORS` kind (one line, exit 2)."""

    name: str
    config_type: type
    presets: dict[str, Callable[[], Any]]
    build: Callable[..., tuple]
    default_preset: str = "smoke"
    flags: Callable[[argparse.ArgumentParser], None] | None = None
    flag_overrides: Callable[[argparse.Namespace], list[tuple[Any, ...]]] | None = None
    # ``preset_defaults(args, cfg) -> cfg``: the preset adjusted to the flags before any
    # override applies, so a --config file, a flag or a --set still wins (finetune names a
    # --model run after its folder); new runs only
    preset_defaults: Callable[[argparse.Namespace, Any], Any] | None = None
    # ``--bench`` (the old command of a benchmark): ``bench(args)`` forwards to it
    bench: Callable[[argparse.Namespace], int] | None = None
    resume_mutable: frozenset[str] = frozenset()
    # config keys a smoke report's dense run may hold otherwise than its CoMERA partner
    # (DLRM's hot rows and hashed tables: each run's own, and the report says them)
    pair_differs: frozenset[str] = frozenset()
    # a resume's missing file or folder (it came from the saved config): how to go on,
    # with ``{run}`` the run dir
    moved_hint: str = ""
    # keys of the build's ``info`` a resume must find as the run saved them (key -> what to
    # do otherwise): what a resume may point elsewhere (a moved model folder) must still
    # hold what the run was built from
    resume_same: Mapping[str, str] = field(default_factory=dict)
    # config keys the build sets itself (key -> where from): a ``--set`` of one is refused,
    # as the build would replace its value without a word
    derived: Mapping[str, str] = field(default_factory=dict)
    # called with a new run's resolved config and every key given on the command line or
    # in --config (key, how it was given): refuses a key the config makes moot, which a
    # section's own check cannot tell from a default (fine-tune's built-model settings
    # beside --model, given at their default values)
    check_given: Callable[[Any, list[tuple[str, str]]], None] | None = None
    description: str = ""
    epilog: str = ""


# ----------------------------------------------------------------------------- typed config


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(obj: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def _convert(value: Any, hint: Any) -> Any:
    """Coerce a JSON-ish value (lists, dicts) to ``hint``: tuples stay tuples, nested
    dataclasses are rebuilt; used for both config.json and ``--set`` values."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _convert(value, args[0]) if len(args) == 1 else value
    if dataclasses.is_dataclass(hint):
        return config_from_dict(hint, value)
    if origin is tuple and isinstance(value, list | tuple):
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0]) for v in value)
        if args and len(args) == len(value):
            return tuple(_convert(v, a) for v, a in zip(value, args, strict=True))
        return tuple(value)
    if origin is dict and isinstance(value, dict):
        _, v_hint = typing.get_args(hint) or (Any, Any)
        return {k: _convert(v, v_hint) for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def check_batch_sizes(batch_size: int, eval_batch_size: int) -> None:
    """A preset's batch sizes, both at least 1, or a ``ConfigError`` naming them."""
    if batch_size < 1 or eval_batch_size < 1:
        raise ConfigError(
            f"Preset: batch_size and eval_batch_size must be >= 1, got {batch_size}, "
            f"{eval_batch_size}"
        )


def config_from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Rebuild a (nested) config dataclass from ``dataclasses.asdict`` output; keys that are
    not fields (derived facts stored beside the config) are ignored. A value of the wrong
    kind (a section that is not a mapping, ``"yes"`` for a bool, a string for a map) is a
    :class:`ConfigError` naming its dotted key: a config.json edited by hand otherwise
    failed as an AttributeError deep in the run, or trained on a mangled value."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix[:-1] or 'the config'}: expected a section (a mapping), "
                          f"got {data!r}")  # fmt: skip
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        key, hint, value = prefix + f.name, hints[f.name], data[f.name]
        if dataclasses.is_dataclass(hint):
            kwargs[f.name] = config_from_dict(hint, value, key + ".")
            continue
        value = _convert(value, hint)
        try:
            _check_type(value, hint, key)
        except CLIError as e:
            raise ConfigError(str(e)) from None
        kwargs[f.name] = value
    return cls(**kwargs)


def parse_value(text: str, hint: Any, key: str) -> Any:
    """Parse ``--set`` text into the field's annotated type."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if text.strip().lower() in ("none", "null"):
            if type(None) not in typing.get_args(hint):
                raise CLIError(f"--set {key}=None: {key} cannot be None")
            return None
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return parse_value(text, args[0], key) if len(args) == 1 else _literal(text, key)
    if text.strip().lower() in ("none", "null") and hint in (bool, int, float):
        raise CLIError(f"--set {key}={text}: {key} cannot be None")
    try:
        if hint is bool:
            low = text.strip().lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return low in ("true", "1", "yes")
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
        if hint is str:
            return text
    except ValueError:
        name = getattr(hint, "__name__", str(hint))
        raise CLIError(f"--set {key}={text}: expected a value of type {name}") from None
    if origin is tuple and typing.get_args(hint)[-1:] == (Ellipsis,):
        inner = typing.get_args(hint)[0]
        if inner is str and not text.lstrip().startswith(("(", "[")):
            return tuple(t for t in text.split(",") if t)
    return _convert(_literal(text, key), hint)


def _literal(text: str, key: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise CLIError(
            f"--set {key}={text}: not a Python literal (e.g. 3, 0.5, 'x', (4, 4), None)"
        ) from None


def set_field(cfg: Any, key: str, value: Any, *, text: bool = False, label: str = "") -> Any:
    """A copy of ``cfg`` with dotted ``key`` set (parsed from text when ``text``); every
    level is rebuilt with ``dataclasses.replace`` so its checks run again. Errors name
    ``label`` (the flag or ``--set`` item the value came from)."""
    label = label or f"--set {key}={value}"
    hint, _ = _field_hint(cfg, key, label)
    return _rebuild(cfg, "", {key: (_parsed(value, hint, key, text, label), label)}, {})


def _parsed(value: Any, hint: Any, key: str, text: bool, label: str) -> Any:
    """``value`` as the field's type: ``--set`` text parsed by its annotation, a typed value
    converted (a file's string for a non-string field parsed as text would be: YAML reads
    ``1e-3`` as one), then checked to be of the field's kind."""
    if text or (isinstance(value, str) and hint not in (str, Any)):
        try:
            value = parse_value(value, hint, key)
        except CLIError as e:  # named after the item (a --set, a file's key, --values)
            msg = str(e)
            for prefix in (f"--set {key}={value}: ", f"--set {key}=None: "):
                msg = msg.removeprefix(prefix)  # the reason alone (the text may hold ': ')
            raise CLIError(f"{label}: {msg}") from None
    else:
        value = _convert(value, hint)
    _check_type(value, hint, label)
    return value


def _field_hint(cfg: Any, key: str, label: str) -> tuple[Any, Any]:
    """``(annotated type, owning section)`` of dotted ``key`` in ``cfg``; an unknown key,
    or a key that names a section, is an error naming ``label``."""
    obj, parts = cfg, key.split(".")
    for i, head in enumerate(parts):
        if not dataclasses.is_dataclass(obj) or head not in _fields(obj):
            valid = ", ".join(_fields(obj)) if dataclasses.is_dataclass(obj) else "(none)"
            raise CLIError(
                f"{label}: unknown config key {key!r} ({head!r} is not in "
                f"{type(obj).__name__}); valid keys there: {valid}"
            )
        current = getattr(obj, head)
        if i < len(parts) - 1:
            if not dataclasses.is_dataclass(current):
                raise CLIError(f"{label}: {head!r} in {key!r} is a value, not a section")
            obj = current
        elif dataclasses.is_dataclass(current):
            raise CLIError(
                f"{label}: {key!r} is a section; set one of its keys: "
                + ", ".join(f"{key}.{f}" for f in _fields(current))
            )
    return _hints(type(obj))[parts[-1]], obj


def _read_config_file(path: str) -> Any:
    """The data of a ``--config`` file, by suffix: ``.toml``, ``.yaml``/``.yml``, ``.json``."""
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"--config {path}: no such file")
    suffix = p.suffix.lower()
    try:
        text = p.read_text()
        if suffix == ".toml":
            import tomllib

            return tomllib.loads(text)
        if suffix == ".json":
            return json.loads(text)
        if suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise CLIError(
                    f"--config {path}: reading YAML needs PyYAML (pip install pyyaml); or "
                    "write the file as TOML or JSON"
                ) from None
            return yaml.safe_load(text)
    except CLIError:
        raise
    except Exception as e:  # noqa: BLE001 - each parser has its own error types
        why = " ".join(str(e).split())  # YAML's errors span lines (a caret under the spot)
        raise CLIError(f"--config {path}: cannot read it as {suffix[1:].upper()} ({why})") from None
    raise CLIError(f"--config {path}: unknown format {suffix!r}; use .toml, .yaml, .yml or .json")


def config_file_items(path: str, cfg: Any) -> list[tuple[str, Any, str]]:
    """A ``--config`` file as ``(dotted key, value, label)`` overrides of ``cfg``: nested
    tables (mappings) follow the config's sections, and dotted keys work at any level, so
    ``[train.comera] gamma = 0.1`` and ``"train.comera.gamma" = 0.1`` say the same."""
    data = _read_config_file(path)
    if not isinstance(data, dict):
        raise CLIError(f"--config {path}: expected a mapping of config keys at the top level")
    items: list[tuple[str, Any, str]] = []

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            key = prefix + str(k)
            section: Any = cfg
            for part in key.split("."):
                ok = dataclasses.is_dataclass(section) and part in _fields(section)
                section = getattr(section, part) if ok else None
            if isinstance(v, dict) and dataclasses.is_dataclass(section):
                walk(v, key + ".")
            else:
                items.append((key, v, f"--config {path}: {key}"))

    walk(data, "")
    return items


def _derivable(section: Any, name: str) -> bool:
    """Whether ``section`` can derive field ``name`` itself (``--set KEY=auto``)."""
    return name in getattr(type(section), "DERIVED", ())


def apply_overrides(
    cfg: Any,
    overrides: Sequence[tuple[Any, ...]],
    sets: list[str],
    *,
    file_items: Sequence[tuple[str, Any, str]] = (),
) -> Any:
    """A copy of ``cfg`` with every override applied at once: ``file_items`` (a
    ``--config`` file's ``(key, value, label)``), then typed ``overrides`` (from flags),
    then ``--set KEY=VALUE`` texts; a later value of a key wins (an override's optional
    third item is the flag that gave it, for errors). Each section touched is
    rebuilt once, after all of its new values are in, so its checks see them together
    (a width and the modes that must multiply to it, in any order). A section may derive
    fields it can compute (``DERIVED``; ``derive_fields``), asked for with ``KEY=auto`` or
    because the values they depend on changed. Errors name the flags, items or file that
    set what is refused."""
    flag_of = {key: "--" + dest.replace("_", "-") for dest, key in _COMMON.items()}
    items = [(key, value, False, label) for key, value, label in file_items]
    for key, value, *given in overrides:  # a third item: the flag, as the user typed it
        label = given[0] if given else (
            f"{flag_of[key]} {value}" if key in flag_of else f"{key}={value}")  # fmt: skip
        items.append((key, value, False, label))
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise CLIError(f"--set {item!r}: expected KEY=VALUE, e.g. train.steps=40")
        items.append((key.strip(), text, True, f"--set {item}"))
    changes: dict[str, tuple[Any, str]] = {}
    asked: dict[str, str] = {}
    for key, value, text, label in items:
        hint, owner = _field_hint(cfg, key, label)
        if value == "auto" and _derivable(owner, key.rsplit(".", 1)[-1]):
            asked[key] = label
            changes.pop(key, None)
            continue
        changes[key] = (_parsed(value, hint, key, text, label), label)
        asked.pop(key, None)
    return _rebuild(cfg, "", changes, asked)


def _describe(hint: Any, plural: bool = False) -> str:
    """A type annotation as a user writes the value: ``list of 2 lists of ints``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return " or ".join(_describe(a, plural) for a in args)
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        lists = "lists" if plural else "list"
        if len(args) == 2 and args[1] is Ellipsis:
            return f"{lists} of {_describe(args[0], True)}"
        kinds = {_describe(a, True) for a in args}
        return f"{lists} of {len(args)} {kinds.pop() if len(kinds) == 1 else 'items'}"
    if typing.get_origin(hint) is dict:
        k_hint, v_hint = typing.get_args(hint) or (Any, Any)
        maps = "maps" if plural else "map"
        return f"{maps} of {_describe(k_hint, True)} to {_describe(v_hint, True)}"
    name = getattr(hint, "__name__", str(hint))
    return name + ("s" if plural else "")


def _tuple_shape_ok(value: Any, hint: Any, inner: bool = False) -> bool:
    """Whether ``value`` nests like the tuple annotation ``hint`` (lists where it has
    tuples, items of its plain kinds inside them); a plain value at the top is left to
    :func:`_check_type`'s own check."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return value is None or any(_tuple_shape_ok(value, a, inner) for a in args)
    if typing.get_origin(hint) is dict:  # a map: a dict whose keys and values fit
        if not isinstance(value, dict):
            return False
        k_hint, v_hint = typing.get_args(hint) or (Any, Any)
        return all(_tuple_shape_ok(k, k_hint, True) and _tuple_shape_ok(v, v_hint, True)
                   for k, v in value.items())  # fmt: skip
    if typing.get_origin(hint) is not tuple:
        if not inner or hint not in (bool, int, float, str):
            return True
        if hint is float:
            return isinstance(value, int | float) and not isinstance(value, bool)
        return isinstance(value, hint) and (hint is bool or not isinstance(value, bool))
    if not isinstance(value, list | tuple):
        return False
    args = typing.get_args(hint)
    if len(args) == 2 and args[1] is Ellipsis:
        return all(_tuple_shape_ok(v, args[0], True) for v in value)
    return len(value) == len(args) and all(
        _tuple_shape_ok(v, a, True) for v, a in zip(value, args, strict=True)
    )


def _flag_of(ap: argparse.ArgumentParser, dest: str) -> str:
    """The flag a user types for the parser's ``dest`` (finetune's ``--model`` sets
    ``model_path``): its longest option string."""
    for action in ap._actions:
        if action.dest == dest and action.option_strings:
            return max(action.option_strings, key=len)
    return "--" + dest.replace("_", "-")


def _check_type(value: Any, hint: Any, label: str) -> None:
    """Refuse a plain value of the wrong kind (a file's ``"7"`` for an int field), or a
    list nested otherwise than its field (``[4,4]`` for modes ``[[4,4],[4,4]]``), in one
    line, before a config check or the run trips over it."""
    if not _tuple_shape_ok(value, hint):
        raise CLIError(f"{label}: expected a {_describe(hint)}, got {value!r}")
    args = (
        typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else ()
    )
    kinds = [a for a in (args or (hint,)) if a in (bool, int, float, str)]
    if not kinds or (value is None and type(None) in args):
        return
    ok = any(
        isinstance(value, k)
        and not (k in (int, float) and isinstance(value, bool))
        or (k is float and isinstance(value, int) and not isinstance(value, bool))
        for k in kinds
    )
    if not ok:
        want = " or ".join(k.__name__ for k in kinds)
        raise CLIError(f"{label}: expected a value of type {want}, got {value!r}")


def _rebuild(section: Any, prefix: str, changes: dict, asked: dict) -> Any:
    """``section`` (at dotted ``prefix``) with its changes, inner sections first."""
    new: dict[str, Any] = {}
    for name in _fields(section):
        key, current = prefix + name, getattr(section, name)
        if dataclasses.is_dataclass(current):
            if any(k.startswith(key + ".") for k in (*changes, *asked)):
                new[name] = _rebuild(current, key + ".", changes, asked)
        elif key in changes:
            new[name] = changes[key][0]
    mine = {k[len(prefix) :] for k in asked if k.startswith(prefix) and "." not in k[len(prefix) :]}
    derive = getattr(section, "derive_fields", None)
    if derive is not None and (new or mine):
        plain = {k: v for k, v in new.items() if not dataclasses.is_dataclass(v)}
        for name, value in derive(plain, mine).items():
            new.setdefault(name, value)
    if not new:
        return section
    try:
        return dataclasses.replace(section, **new)
    except (*USER_ERRORS, TypeError) as e:  # a config's check, or a value of the wrong type
        under = [(k, lab) for k, (_, lab) in changes.items() if k.startswith(prefix)]
        under += [(k, lab) for k, lab in asked.items() if k.startswith(prefix)]
        # the whole config's check (across sections) sees every override: name those whose
        # keys its message names, where it names any (a section's own names them all: its
        # message may leave out one that counts, as d_model beside the modes it refuses)
        named = [(k, lab) for k, lab in under
                 if not prefix and re.search(rf"(?<!\w){re.escape(k.rsplit('.', 1)[-1])}(?!\w)",
                                             str(e))]  # fmt: skip
        labels = [lab for _, lab in named or under]
        raise CLIError(f"{', '.join(dict.fromkeys(labels))}: {e}") from None


# ----------------------------------------------------------------------------- the parser


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are :class:`CLIError`: one line and status 2 in
    the commands' ``except USER_ERRORS``, not argparse's usage block."""

    def error(self, message: str) -> typing.NoReturn:
        raise CLIError(message)


def build_parser(exp: Experiment) -> argparse.ArgumentParser:
    ap = Parser(
        prog=f"python -m experiments.{exp.name}",
        description=exp.description,
        epilog=exp.epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--preset",
        choices=sorted(exp.presets),
        default=exp.default_preset,
        help=f"the experiment's settings to start from (default: {exp.default_preset})",
    )
    ap.add_argument(
        "--config",
        metavar="FILE",
        help="overrides from a TOML, YAML or JSON file (sections as tables/mappings, or "
        "dotted keys), applied before the flags and --set",
    )
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config field, e.g. train.comera.gamma=0.02 (repeatable)",
    )
    ap.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR")
    ap.add_argument("--run-dir", dest="run_dir")
    ap.add_argument("--dense", action="store_true", help="train the dense baseline")
    ap.add_argument(
        "--plan",
        help=f"contraction strategy of every TT layer: {C.STRATEGIES} (auto: the fastest "
        "per shape, timed once and cached under $COMERA_CACHE/plans)",
    )
    ap.add_argument(
        "--plan-for",
        dest="plan_for",
        action="append",
        default=[],
        metavar="LAYER_GLOB=STRATEGY",
        help="per-layer strategy (repeatable)",
    )
    ap.add_argument("--embedding-impl", dest="embedding_impl", choices=C.EMBEDDING_IMPLS)
    for flag, typ in (
        ("--steps", int),
        ("--eval-every", int),
        ("--checkpoint-every", int),
        ("--accum-steps", int),
        ("--seed", int),
    ):
        ap.add_argument(flag, type=typ)
    ap.add_argument("--device", help="cpu, cuda, cuda:1 ...")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (CUDA)")
    ap.add_argument(
        "--cpu-malloc",
        dest="cpu_malloc",
        choices=CPU_MALLOC_POLICIES,
        help="CPU allocator policy: default (glibc as found), keep (faster, more resident "
        "memory), release (least memory, slower), lean (release on huge pages; the command "
        "restarts itself once to enable them)",
    )
    ap.add_argument(
        "--step-mode",
        dest="step_mode",
        choices=STEP_MODES,
        help="eager (default), sync_free (no host read inside the step), compile "
        "(torch.compile of that step) or cuda_graph (captured and replayed, CUDA)",
    )
    ap.add_argument(
        "--compile",
        dest="compile",
        action="store_true",
        help="same as --step-mode compile",
    )
    ap.add_argument(
        "--recompute",
        action="store_true",
        help="recompute each encoder block's activations in backward (less memory, slower; "
        "MNLI's and CodeBERT's encoders, not DLRM or finetune); "
        "also selects --cpu-malloc lean on a new run unless --cpu-malloc is given",
    )
    ap.add_argument(
        "--wandb",
        choices=("online", "offline", "disabled"),
        help="wandb mode (default: WANDB_MODE, else offline)",
    )
    for flag in ("--wandb-project", "--wandb-entity", "--wandb-group", "--wandb-name"):
        ap.add_argument(flag)
    ap.add_argument("--wandb-tags", help="comma-separated tags")
    ap.add_argument("--no-progress", dest="no_progress", action="store_true")
    if exp.bench is not None:
        ap.add_argument(
            "--bench",
            action="store_true",
            help=f"moved: runs python -m benchmarks.{exp.name}_step (one training step); "
            "this flag goes in a later release",
        )
        ap.add_argument("--json", action="store_true", help="with --bench: JSON on stdout")
    if exp.flags is not None:
        before = {a.dest for a in ap._actions}
        exp.flags(ap)
        ap.experiment_dests = {a.dest for a in ap._actions} - before  # type: ignore[attr-defined]
    return ap


_COMMON = {  # flag dest -> config key
    "steps": "train.steps",
    "eval_every": "train.eval_every",
    "checkpoint_every": "train.checkpoint_every",
    "accum_steps": "train.accum_steps",
    "seed": "train.seed",
    "device": "train.device",
    "wandb": "train.wandb",
    "wandb_project": "train.wandb_project",
    "wandb_entity": "train.wandb_entity",
    "wandb_group": "train.wandb_group",
    "wandb_name": "train.run_name",
    "run_dir": "train.run_dir",
    "plan": "plans.default",
    "embedding_impl": "plans.embedding_impl",
    "cpu_malloc": "train.cpu_malloc",
    "step_mode": "train.step_mode",
}


# --recompute trades time for activation memory; under glibc as found the memory it frees
# stays resident as heap holes, so it also selects this policy unless --cpu-malloc is given
RECOMPUTE_CPU_MALLOC = "lean"


def _common_overrides(
    args: argparse.Namespace, cfg: Any, *, fresh: bool = True, rules: Any = None,
    named: bool = False,
) -> list[tuple[Any, ...]]:  # fmt: skip
    """The common flags as ``(key, value)`` overrides of ``cfg`` (``(key, value, flag)``
    where the flag a user typed is not the key's own: ``--dense`` sets three keys);
    ``rules``: the per-layer plan rules a ``--config`` file gives (``--plan-for`` adds to
    them); ``named``: a ``--config`` file names the run (``--dense`` then keeps its name)."""
    out = [(key, getattr(args, dest)) for dest, key in _COMMON.items()]
    out = [(k, v) for k, v in out if v is not None]
    if args.wandb_tags is not None:
        tags = tuple(t for t in args.wandb_tags.split(",") if t)
        out.append(("train.wandb_tags", tags, f"--wandb-tags {args.wandb_tags}"))
    if args.bf16:
        out.append(("train.bf16", True, "--bf16"))
    if args.recompute:
        if not hasattr(getattr(cfg, "model", None), "recompute"):
            raise CLIError(
                "--recompute: this experiment's model has no recompute setting (only the "
                "project's own encoder, MNLI's and CodeBERT's, recomputes its blocks); drop it"
            )
        out.append(("model.recompute", True, "--recompute"))
        if args.cpu_malloc is None and fresh:  # a resumed run keeps its saved policy
            out.append(("train.cpu_malloc", RECOMPUTE_CPU_MALLOC, "--recompute"))
    if args.no_progress:
        out.append(("train.progress", False, "--no-progress"))
    if args.plan_for:
        file_rules, new_rules = rules, []
        for item in args.plan_for:
            glob, sep, strategy = item.partition("=")
            if not sep or not glob:
                raise CLIError(f"--plan-for {item!r}: expected LAYER_GLOB=STRATEGY")
            if strategy not in C.STRATEGIES:  # named here: the rule's section names no flag
                raise CLIError(f"--plan-for {item!r}: unknown strategy {strategy!r}; choose "
                               f"one of {', '.join(C.STRATEGIES)}")  # fmt: skip
            new_rules.append((glob, strategy))
        given = cfg.plans.per_layer if file_rules is None else file_rules
        if not isinstance(given, list | tuple):
            raise CLIError(f"--config {args.config}: plans.per_layer={given!r} must be a list "
                           "of [LAYER_GLOB, STRATEGY] pairs")  # fmt: skip
        base = tuple(tuple(r) if isinstance(r, list | tuple) else r for r in given)
        if file_rules is not None:  # checked here: merged, they would be named by no file
            for rule in base:
                if not (isinstance(rule, tuple) and len(rule) == 2 and rule[1] in C.STRATEGIES):
                    raise CLIError(f"--config {args.config}: plans.per_layer: {rule!r} is not "
                                   f"a [LAYER_GLOB, STRATEGY] pair of a strategy in "
                                   f"{', '.join(C.STRATEGIES)}")  # fmt: skip
        given_rules = " ".join(f"--plan-for {r}" for r in args.plan_for)
        out.append(("plans.per_layer", (*base, *new_rules), given_rules))
    if args.dense:
        out += [("dense", True, "--dense"), ("train.comera.enabled", False, "--dense")]
        if args.wandb_name is None and cfg.train.run_name and not named:
            out.append(("train.run_name", f"{cfg.train.run_name}-dense", "--dense"))
    return out


def _changed(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    return [k for k, v in vars(args).items() if v != ap.get_default(k)]


def check_device(device: str, what: str = "--device") -> None:
    """Refuse a CUDA device this process cannot use, naming ``what`` to change: without
    this a run (or a benchmark's every worker) on a CPU-only machine ends in a traceback
    at its first ``.to(device)``."""
    try:
        usable_device(device, what, cpu="--device cpu")
    except ConfigError as e:
        raise CLIError(str(e)) from None


def refuse_derived(exp: Experiment, keys: list[tuple[str, str]]) -> None:
    """Refuse a key the experiment sets itself (``exp.derived``: MNLI's
    ``model.vocab_size`` comes from the tokenizer), so a value given for it is not dropped
    without a word; ``keys`` are ``(dotted key, where it was given)``."""
    for key, where in keys:
        if key in exp.derived:
            raise CLIError(
                f"{where} {key}: {exp.name} sets {key} itself ({exp.derived[key]}); drop it"
            )


def refuse_derived_sets(exp: Experiment, sets: list[str]) -> None:
    """:func:`refuse_derived` of ``--set KEY=VALUE`` items."""
    refuse_derived(exp, [(s.partition("=")[0].strip(), "--set") for s in sets])


def resolve_config(exp: Experiment, args: argparse.Namespace, ap: argparse.ArgumentParser):
    """The effective config: a preset with every flag and ``--set`` applied, or, with
    ``--resume``, the saved config with the few settings that may change."""
    if getattr(args, "compile", False):  # an alias: a --step-mode saying otherwise is refused
        if args.step_mode not in (None, "compile"):
            raise CLIError(f"--compile is --step-mode compile; drop one of it and "
                           f"--step-mode {args.step_mode}")  # fmt: skip
        args.step_mode = "compile"
    refuse_derived_sets(exp, args.sets)
    if not args.resume:
        cfg = exp.presets[args.preset]()
        if exp.preset_defaults is not None:
            cfg = exp.preset_defaults(args, cfg)
        own = exp.flag_overrides(args) if exp.flag_overrides else []
        from_file = config_file_items(args.config, cfg) if args.config else []
        refuse_derived(exp, [(k, f"--config {args.config}:") for k, _, _ in from_file])
        # --plan-for adds its rules to the file's, not the preset's (the file's value as
        # given: a config built from the file alone could fail checks a flag completes)
        rules = next((v for k, v, _ in reversed(from_file) if k == "plans.per_layer"), None)
        named = any(k == "train.run_name" for k, _, _ in from_file)  # --dense keeps it
        common = _common_overrides(args, cfg, rules=rules, named=named)
        out = apply_overrides(cfg, [*own, *common], args.sets, file_items=from_file)
        if exp.check_given is not None:
            given = [(k, label) for k, _, label in from_file]
            given += [(o[0], o[2] if len(o) > 2 else o[0]) for o in [*own, *common]]
            given += [(item.partition("=")[0].strip(), f"--set {item}") for item in args.sets]
            exp.check_given(out, given)
        return out
    path = Path(args.resume) / "config.json"
    if not path.is_file():
        run_dir = Path(args.resume)
        if not run_dir.exists():
            raise CLIError(f"--resume {args.resume}: no such folder; give the run dir of the "
                           "run to go on with")  # fmt: skip
        if any(run_dir.glob("host.json*")) and not (run_dir / "checkpoints").exists():
            # killed while it prepared, before it trained: a requeue that always resumes
            # looped on "is it a run dir?"
            raise CLIError(f"--resume {args.resume}: the run there stopped before it started "
                           f"training (no config.json yet); start it again with --run-dir "
                           f"{args.resume} and its flags")  # fmt: skip
        raise CLIError(f"--resume {args.resume}: no config.json there; is it a run dir?")
    try:
        saved = json.loads(path.read_text())
    except ValueError as e:  # JSONDecodeError, bad UTF-8
        raise CLIError(f"--resume {args.resume}: config.json is not JSON ({e})") from None
    if not isinstance(saved, dict):
        raise CLIError(f"--resume {args.resume}: config.json is not a saved run config")
    if not isinstance(saved.get("experiment", exp.name), str):
        raise CLIError(f"--resume {args.resume}: config.json's \"experiment\" is "
                       f"{saved['experiment']!r}, not an experiment's name")  # fmt: skip
    if saved.get("experiment", exp.name) != exp.name:
        raise CLIError(
            f"--resume {args.resume}: that run is a {saved['experiment']!r} experiment; "
            f"resume it with python -m experiments.{saved['experiment']}"
        )
    mutable = RESUME_MUTABLE | exp.resume_mutable
    flags = {"device": "train.device", "no_progress": "train.progress",
             "cpu_malloc": "train.cpu_malloc", "recompute": "model.recompute",
             "step_mode": "train.step_mode"}  # fmt: skip
    flags |= {k: v for k, v in _COMMON.items() if k.startswith("wandb")}
    flags |= {"wandb_tags": "train.wandb_tags"}
    own_dests = getattr(ap, "experiment_dests", set())
    extra = [k for k in _changed(ap, args)
             if k not in ("resume", "sets", "compile", *flags, *own_dests)]  # fmt: skip
    bad_sets = [s.partition("=")[0] for s in args.sets if s.partition("=")[0] not in mutable]
    own = exp.flag_overrides(args) if exp.flag_overrides else []
    if any(o[0] not in mutable for o in own):  # an experiment flag that changes what may
        # not change: each changed one by what it sets alone (DLRM's --data, a moved file,
        # was named beside --max-ind-range)
        extra += [d for d in own_dests if d in _changed(ap, args)
                  and not _own_flag_mutable(exp, ap, args, d, mutable)]  # fmt: skip
    if extra or bad_sets:
        drop = [_flag_of(ap, k) for k in extra] + [f"--set {k}" for k in bad_sets]
        raise CLIError(
            f"--resume continues {args.resume} with its saved config; drop {', '.join(drop)} "
            f"(only --device, --wandb*, --no-progress, --cpu-malloc, --step-mode, --compile, "
            f"--recompute and --set of "
            f"{', '.join(sorted(mutable))} (or the flags that set them)"
            " may change on resume)"
        )
    if isinstance(saved.get("train"), dict):  # where it is now, before the checks read it
        saved["train"]["run_dir"] = str(args.resume)  # (an old run saved "" there)
    try:
        cfg = config_from_dict(exp.config_type, saved)
    except (*USER_ERRORS, TypeError) as e:  # missing fields, or values the checks refuse
        raise CLIError(
            f"--resume {args.resume}: config.json is not a saved run config ({e})"
        ) from None
    cfg = set_field(cfg, "train.run_dir", str(args.resume))
    overrides = [o for o in _common_overrides(args, cfg, fresh=False) if o[0] in mutable]
    kept = _kept_settings(saved, exp)
    return apply_overrides(cfg, [*kept, *own, *overrides], args.sets)


def _own_flag_mutable(exp: Experiment, ap: argparse.ArgumentParser, args: argparse.Namespace,
                      dest: str, mutable: frozenset[str]) -> bool:  # fmt: skip
    """Whether the experiment flag ``dest`` as given sets only keys a resume may change."""
    alone = argparse.Namespace(**{k: ap.get_default(k) for k in vars(args)})
    setattr(alone, dest, getattr(args, dest))
    alone.resume = args.resume
    try:
        keys = [o[0] for o in exp.flag_overrides(alone)]  # type: ignore[misc]
    except (*USER_ERRORS, ValueError, TypeError):
        return False
    return bool(keys) and all(k in mutable for k in keys)


def _changes(was: Any, now: Any, at: str = "") -> list[str]:
    """``KEY: X saved, Y now`` for each value that differs; of mappings (at any depth)
    only the entries both hold are compared: one another version adds or drops is no
    change of the run."""
    if isinstance(was, dict) and isinstance(now, dict):
        return [c for k in sorted(was.keys() & now.keys())
                for c in _changes(was[k], now[k], f"{at}{k}.")]  # fmt: skip
    if was == now:
        return []
    return [f"{at[:-1]}: {was!r} saved, {now!r} now" if at else f"{was!r} saved, {now!r} now"]


def check_same_info(run_dir: Path, info: Mapping[str, Any], keys: Mapping[str, str]) -> None:
    """Refuse a resume whose build gives another value of an ``info`` key in ``keys`` than
    the run's ``config.json`` saved: a ``CLIError`` naming what differs and ``keys[key]``,
    the way on. A key the file lacks (an older version wrote it) passes, and of mappings
    only the entries both hold are compared (:func:`_changes`)."""
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):  # the resume's own checks name a damaged config.json
        return
    for key in sorted(keys):
        if not isinstance(saved, dict) or key not in saved or key not in info:
            continue
        now = json.loads(json.dumps(info[key], default=config_jsonable))
        diff = _changes(saved[key], now)
        if not diff:
            continue
        more = f" (+{len(diff) - 4} more)" if len(diff) > 4 else ""
        what = "; ".join(diff[:4]) + more
        raise CLIError(f"--resume {run_dir}: {key} differs from the run's ({what}); "
                       f"{keys[key]}")  # fmt: skip


def resumed_config(exp: Experiment, run_dir: str | Path) -> Any:
    """The config a plain ``--resume RUN_DIR`` runs with: the saved one, with what its
    resumes kept (:func:`_kept_settings`: a moved data file, a changed mix)."""
    ap = build_parser(exp)
    return resolve_config(exp, ap.parse_args(["--resume", str(run_dir)]), ap)


def get_field(cfg: Any, key: str) -> Any:
    """The value of dotted ``key`` in ``cfg``."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _kept_settings(saved: dict, exp: Experiment) -> list[tuple[str, Any]]:
    """What the last resume ran with of the experiment's own mutable settings (a ``--mix``,
    a moved data path): they stay in force until changed again. The next plain ``--resume``
    (the command a stopped run prints) went back to the started config's weights."""
    return [(k, v) for k, v in kept_settings(saved).items() if k in exp.resume_mutable]


# ----------------------------------------------------------------------------- running


@dataclass(kw_only=True)
class Prepared:
    """A run ready to train: its trainer and what it printed at start."""

    exp: Experiment
    cfg: Any
    trainer: Trainer
    kind: str
    rank: int


def _clear_stopped_attempt(run_dir: Path, rank: int, world: int) -> None:
    """Drop the rows, rank table and plan history of a run that stopped before its first
    checkpoint, which starts over: every row is that attempt's (a step-0 row too), and the
    Trainer refuses a fresh run beside another run's rows. Rank 0 deletes while the others wait,
    so every rank's Trainer finds them gone; a failure is reported after the wait (a rank
    that raised before it would leave the others waiting)."""
    failed: list[OSError] = []

    def clear() -> None:
        if rank != 0:
            return
        try:
            for name in ("metrics.jsonl", "ranks.json", "plans.json"):
                (run_dir / name).unlink(missing_ok=True)
        except OSError as e:
            failed.append(e)
            return
        print(f"{run_dir}: no checkpoint was written; starting it over from step 0 with "
              "its saved config", file=sys.stderr)  # fmt: skip

    rank_first(clear, rank, world)
    if failed:
        raise CLIError(f"--resume {run_dir}: cannot clear the stopped attempt's rows ({failed[0]})")


def check_model_settings(exp: Experiment, run_dir: Path, saved: dict | None,
                         record: dict) -> None:  # fmt: skip
    """Refuse a resume whose model settings differ from those its checkpoint was written
    with: ``config.json`` edited by hand (attention heads, dropout) rebuilt another model of
    the same parameter shapes, which resumed from the checkpoint's weights without a word.
    Settings a resume may change (how the run executes, a moved model path) are not
    compared, nor keys only one side holds (a run saved before a setting existed)."""
    was = saved.get("model") if isinstance(saved, dict) else None
    now = record.get("model")
    if not isinstance(was, dict) or not isinstance(now, dict):
        return
    mutable = RESUME_MUTABLE | exp.resume_mutable
    changed = [k for k in was if k in now and f"model.{k}" not in mutable and was[k] != now[k]]
    if changed:
        said = "; ".join(f"model.{k}: {was[k]!r} saved, {now[k]!r} now" for k in changed[:4])
        raise CheckpointError(
            f"{run_dir}/config.json has other model settings than its checkpoint was written "
            f"with ({said}); put them back in config.json to resume (an edited model "
            "setting builds another model around the saved weights)"
        )


def uses_auto(plans: C.LayerPlans) -> bool:
    """Whether any layer of a run may ask the tuner: ``auto`` as the model-wide or a
    per-layer plan, or as the embedding implementation."""
    strategies = [plans.default, *(s for _, s in plans.per_layer)]
    return "auto" in strategies or plans.embedding_impl == "auto"


def check_folder(path: Path, flag: str) -> None:
    """Refuse, as one line naming ``flag``, a folder this command could not write into: a
    file, a path under a file, or a place where no folder can be made. Checked before
    anything runs, not as a traceback when the first file is written; nothing is left
    behind (a probe folder made to find out is removed at once)."""
    if path.exists() and not path.is_dir():
        raise CLIError(f"{flag} {path} is a file; give a folder")
    base = next(p for p in (path, *path.resolve().parents) if p.exists())
    if not base.is_dir():
        raise CLIError(f"{flag} {path}: {base} is a file, so the folder cannot be created")
    if not os.access(base, os.W_OK | os.X_OK):
        raise CLIError(f"{flag} {path}: {base} is not writable here; give another folder")
    # root passes os.access everywhere (/proc too), an existing folder included: try it;
    # a probe of its own name: ranks of one run check the same path at once
    try:
        os.rmdir(tempfile.mkdtemp(dir=base, prefix=".comera-probe-"))
    except OSError as e:
        raise CLIError(f"{flag} {path}: cannot create a folder in {base} ({e.strerror}); "
                       "give another folder") from None  # fmt: skip


def prepare(
    exp: Experiment,
    cfg: Any,
    *,
    resume: bool = False,
    argv: list[str] | None = None,
    preset: str | None = None,
) -> Prepared:
    """Build the task and model of ``cfg`` and its trainer (restored when ``resume``).
    ``preset`` is the preset's name for the run's record (``config.json``; default its run
    name, as before).

    Everything that can fail on bad input (files, columns, labels, hub, checkpoint) fails
    here, before any training."""
    if cfg.train.optimizer == "galore" and getattr(cfg, "dense", True) is False:
        # train.comera.enabled=false alone keeps the TT model: GaLore's plain AdamW then
        # trained its cores and gates at lr_rest, exit 0
        raise ConfigError(
            "train.optimizer=galore trains the dense baseline (GaLore projects dense "
            "weights' gradients): add --dense"
        )
    run_dir = Path(cfg.train.run_dir)
    flag = "--resume" if resume else "--run-dir"
    check_folder(run_dir, flag)
    rank, world = init_distributed(cfg.train.device)
    # before the run's records are read or touched (a stopped attempt's rows cleared,
    # config.json's resumes) and minutes of data preparation, a run dir another process
    # trains into is refused: any resumed one, and a run's folder given to a new run (its
    # "already holds a run; continue it with --resume" would then be refused); a new
    # folder is locked by the trainer that makes it
    lock = hold_run_dir(run_dir, rank, world, flag="" if resume else flag, existing=not resume)
    if not resume and (run_dir / "config.json").exists():
        raise CLIError(
            f"{run_dir} already holds a run; continue it with --resume {run_dir}, or give "
            "another --run-dir (nothing there is overwritten)"
        )
    # a run's files without its config.json: --resume, which reads it, cannot take them
    records = [f for f in (*RUN_FILES, *RUN_RECORDS) if (run_dir / f).exists()]
    if not resume and records:
        raise CLIError(
            f"{run_dir} holds {', '.join(records)} of another run (and no config.json to "
            "resume it); move them away or give another --run-dir (nothing there is "
            "overwritten)"
        )
    history: dict = {}  # what a restarted run's record keeps of the one it restarts
    if resume and not complete_checkpoints(run_dir):
        # it stopped before its first checkpoint (a crash, Ctrl-C): nothing to continue,
        # so it starts over from step 0 with its saved config, as resuming would have at
        # step 0 (the rows it logged are dropped, as those after a checkpoint are)
        resume = False
        saved = run_dir / "config.json"  # rewritten at the start: its history carries over
        old = json.loads(saved.read_text()) if saved.is_file() else {}
        preset = preset or old.get("preset")
        history = {"argv": old.get("argv", argv),
                   "resumes": [*resumes(old),
                               {"step": 0, "argv": argv, "restarted": True}]}  # fmt: skip
    elif resume and preset is None:  # the record checkpoints keep names the run's preset,
        # not its run name (config.json was right)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            saved_preset = json.loads((run_dir / "config.json").read_text()).get("preset")
            preset = saved_preset if isinstance(saved_preset, str) else None

    if uses_auto(cfg.plans):  # decisions cached on disk: a second run times nothing
        plans_dir = cache_root("plans")
        if autotune.current_tuner().cache_dir != plans_dir:
            autotune.set_tuner(autotune.PlanTuner(plans_dir))
    if torch.device(cfg.train.device).type == "cpu":
        apply_cpu_malloc(cfg.train.cpu_malloc)  # the command's policy: the library sets none
    try:
        task, params, state, reference, info = exp.build(cfg, rank, world)
    except MissingFileError as e:
        if not (resume and exp.moved_hint):
            raise
        # the path came from the saved config: a flag naming it again was refused
        raise MissingFileError(f"{e}; {exp.moved_hint.format(run=run_dir)}") from None
    table = info.pop("layer_table", None)  # printed once nothing can refuse the run
    notes = info.pop("notes", [])
    if resume and exp.resume_same:
        check_same_info(run_dir, info, exp.resume_same)
    layers = [(path, p["cores"][0].dim() == 3) for path, p, _ in iter_tt(params, state)]
    if not layers and cfg.train.comera.enabled:  # refused before the run dir is written
        if getattr(cfg, "dense", False):  # --set dense=true alone: --dense sets both
            raise CLIError(
                f"{exp.name}: dense=true builds the dense model, but train.comera.enabled is "
                "still true, so CoMERA would adapt ranks it does not have; pass --dense "
                "(it sets both), or also --set train.comera.enabled=false"
            )
        raise CLIError(
            f"{exp.name}: the CoMERA model has no TT/TTM layer, so it has no ranks to adapt; "
            "compress some layers (the experiment's model.* settings) or train --dense"
        )
    if layers:  # a dense baseline has no TT layer for a plan to name
        # TT linears' cores are (r, n, r'), TTM lookups' (r, v, d, r')
        cfg.plans.check_layers([p for p, linear in layers if linear],
                               [p for p, linear in layers if not linear])  # fmt: skip
    record = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "train"}
    record |= {"experiment": exp.name, "preset": preset or cfg.train.run_name, "argv": argv,
               **info, **history}  # fmt: skip
    record = json.loads(json.dumps(record, default=config_jsonable))
    if history:  # a restart: its rows go once nothing else can refuse the run
        _clear_stopped_attempt(run_dir, rank, world)
    try:
        trainer = Trainer(
            cfg.train,
            task,
            params,
            state,
            resume=resume,
            extra_config=record,
            reference_size=reference,
            copy=False,  # built for this run: no model-sized copy
            auto_plans=uses_auto(cfg.plans),
        )
    except CheckpointError as e:
        if not (resume and exp.derived and "than this run builds" in str(e)):
            raise
        # the model settings the message points at may be set by the data (MNLI's
        # vocabulary by its tokenizer): a tokenizer given on resume read as a model change
        why = "; ".join(f"{k} is {v}" for k, v in exp.derived.items())
        raise CheckpointError(f"{e} (or data that sets them: {why})") from None
    del lock  # the trainer holds the run dir now, for as long as it lives
    if resume:
        check_model_settings(exp, run_dir, trainer.saved_config, record)
    kind = "dense" if getattr(cfg, "dense", False) else "CoMERA"
    saved = run_dir / "config.json"
    if rank == 0 and resume and saved.is_file():
        # what a resume may change (--mix, --device, ...) is in its command line: recorded
        # beside the config the run was started with, which stays as it was
        data = json.loads(saved.read_text())
        entry: dict[str, Any] = {"step": trainer.step, "argv": argv}
        if exp.resume_mutable:  # kept for the next resume (_kept_settings)
            kept = {k: get_field(cfg, k) for k in sorted(exp.resume_mutable)}
            entry["settings"] = json.loads(json.dumps(kept, default=config_jsonable))
        data["resumes"] = [*resumes(data), entry]
        write_json_atomic(saved, data)
    if rank == 0:
        if not resume:  # a resume records it after training (train), if it trains
            record_host(run_dir)  # the machine a report on this run names in its header
        for line in notes:
            note(line)
        if table:
            print(table, file=sys.stderr)
        shown = {k: v for k, v in info.items() if isinstance(v, int | float | str)}
        facts = ", ".join(
            f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in shown.items()
        )
        print(
            f"{exp.name}: {kind} model, {C.param_count(trainer.params):,} params; {facts}; "
            f"world {world}",
            file=sys.stderr,
        )
    return Prepared(exp=exp, cfg=cfg, trainer=trainer, kind=kind, rank=rank)


class Interrupted(KeyboardInterrupt):
    """Training stopped by SIGINT (Ctrl-C) or SIGTERM (what schedulers and torchrun send
    to stop a job): the run's logs were closed (wandb's rows flushed) and its checkpoints
    stay. ``status`` is the shell's 128 + the signal's number. A KeyboardInterrupt, so a
    caller of :func:`run_experiment` stops as it would have; the commands print it as one
    line (:func:`interrupted`)."""

    def __init__(self, message: str, status: int, rank: int, how: str = "") -> None:
        super().__init__(message)
        self.status, self.rank = status, rank
        self.how = how or message  # "stopped by SIGINT at step 40", for callers' own lines


@contextlib.contextmanager
def sigterm_as_interrupt() -> typing.Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the training loop, as SIGINT does, so its
    ``finally`` closes the logs: killed by the default handler, a run lost every wandb row
    not yet flushed. The interrupt carries the shell's ``status`` for the signal (what
    wandb records, and what :func:`train` names); the old handler comes back."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may install a handler
        return

    def handler(signum: int, frame: object) -> None:
        stop = KeyboardInterrupt()
        stop.status = 128 + signum  # type: ignore[attr-defined]
        raise stop

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:  # None: a handler set outside Python, which Python cannot put back
        signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)


class PeerLost(RuntimeError):
    """Training stopped because another process of a multi-process run failed (a
    collective's connection to it was lost): the message says at which step and how to
    resume; the commands print it as one line, exit status 1."""


def train(run: Prepared) -> dict:
    """Fit a prepared run; prints the summary table; returns the final metrics. Stopped
    by SIGINT or SIGTERM, it raises :class:`Interrupted` saying how to go on; by the loss
    of another process of the run, :class:`PeerLost`."""
    t0, start = time.perf_counter(), run.trainer.step
    try:
        with sigterm_as_interrupt():
            out = run.trainer.fit()
    except KeyboardInterrupt as e:
        status, name = stop_signal(e)
        how = f"stopped by {name} at step {run.trainer.step}"
        raise Interrupted(f"{how}; {_go_on(run)}", status, run.rank, how) from None
    except RuntimeError as e:  # a collective failed: another process died (OOM-killed...)
        if getattr(run.trainer, "world", 1) == 1 or not _peer_failed(e):
            raise
        # its survivors printed gloo's traceback: said on each (rank 0 may be the one gone)
        raise PeerLost(
            f"stopped at step {run.trainer.step}: another process of this run failed "
            f"({_collective_reason(e)}); {_go_on(run)}"
        ) from None
    out["wall_s"] = time.perf_counter() - t0
    run_dir = Path(run.cfg.train.run_dir)
    if run.rank == 0 and run.trainer.step > start:  # a resume that trained: its machine
        record_host(run_dir)  # (one that trained nothing keeps the host)
    if "loss" not in out and (run_dir / "metrics.jsonl").is_file():
        out = {**last_logged(read_metrics(run_dir / "metrics.jsonl")), **out}
    if run.rank == 0:
        print(summary_table(run.exp.name, run.kind, out, run.trainer.step), file=sys.stderr)
    return out


def _untraced_plans(cfg: Any) -> str:
    """The plan settings of ``cfg`` that ``torch.compile`` cannot trace (opt_einsum's
    strategies), as their flags would say them, or "" (another step mode, or none)."""
    plans = getattr(cfg, "plans", None)
    if cfg.train.step_mode != "compile" or plans is None:
        return ""
    untraced = [s for s in FIXED_STRATEGIES if s not in DIRECT_STRATEGIES]
    said = [f"--plan {plans.default}"] if plans.default in untraced else []
    said += [f"--plan-for {g}={s}" for g, s in plans.per_layer if s in untraced]
    return ", ".join(said)


# what a resume may change that changes how its steps compute (not wandb or the progress
# bar): a stop line's command repeats those the run was resumed with, or following it would
# go on under the settings config.json started with
_HOW_IT_RUNS = ("train.device", "train.step_mode", "train.cpu_malloc", "model.recompute",
                "model.grouped_halves")  # fmt: skip


def _resume_flags(run: Prepared) -> str:
    """The flags (`` --step-mode sync_free``) of the settings in :data:`_HOW_IT_RUNS` this
    run holds otherwise than its ``config.json`` (a resume's own), or ""."""
    try:  # what a plain --resume runs with: config.json, its missing keys the defaults
        saved = json.loads((Path(run.cfg.train.run_dir) / "config.json").read_text())
        plain = config_from_dict(run.exp.config_type, saved)
    except (OSError, ValueError, TypeError, *USER_ERRORS):
        return ""
    flag_of = {key: "--" + dest.replace("_", "-") for dest, key in _COMMON.items()}
    out = []
    for key in _HOW_IT_RUNS:
        try:
            now, was = get_field(run.cfg, key), get_field(plain, key)
        except AttributeError:  # an experiment without the setting
            continue
        now_json = json.loads(json.dumps(now, default=config_jsonable))
        if now_json == json.loads(json.dumps(was, default=config_jsonable)):
            continue
        text = now_json if isinstance(now_json, str) else json.dumps(now_json)
        out.append(f" {flag_of[key]} {text}" if key in flag_of else f" --set {key}={text}")
    return "".join(out)


def _go_on(run: Prepared) -> str:
    """How a stopped run goes on: from its last checkpoint, or over from its config."""
    run_dir = run.cfg.train.run_dir
    go_on = (
        "continue from its last checkpoint"
        if complete_checkpoints(run_dir)
        else "no checkpoint was written yet; start it over from its saved config"
    )
    flags = _resume_flags(run)
    return f"{go_on} with python -m experiments.{run.exp.name} --resume {run_dir}{flags}"


# what a collective raises when the process at the other end is gone: gloo's bare
# RuntimeError, NCCL's DistBackendError ("remote process exited or there was a network
# error"); a failure of this process's own (a CUDA error at an NCCL call) keeps its traceback
_PEER_GONE = re.compile(
    r"Connection (reset|closed) by peer|remote process exited|Connection refused|Broken pipe"
)


def _peer_failed(error: RuntimeError) -> bool:
    """Whether ``error`` is a collective's loss of another process, not a bug here."""
    import torch.distributed as dist

    return isinstance(error, dist.DistNetworkError) or bool(_PEER_GONE.search(str(error)))


def _collective_reason(error: RuntimeError) -> str:
    """The failed collective's reason, short: gloo's source path and advice cut off."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0])
    return text.split(". ")[0].rstrip(".")[:160]


def run_experiment(
    exp: Experiment, cfg: Any, *, resume: bool = False, argv: list[str] | None = None
) -> dict:
    """Prepare and train ``cfg``; returns the final metrics."""
    return train(prepare(exp, cfg, resume=resume, argv=argv))


def summary_table(name: str, kind: str, out: dict, steps: int) -> str:
    """The end-of-run table: accuracy (and AUC), loss, compression, live params, time."""
    acc = {
        k: v
        for k, v in out.items()
        if k.startswith("eval/") and (k.endswith("accuracy") or k.endswith("/auc"))
    }
    rows = [("run", f"{name} ({kind}), {steps} steps")]
    rows += [(k.removeprefix("eval/"), f"{v:.4f}") for k, v in acc.items()]
    for key, fmt in (
        ("loss", "{:.4f}"),
        ("compression", "{:.1f}x"),
        ("live_params", "{:,}"),
        ("wall_s", "{:.1f} s"),
    ):
        if key in out:
            rows.append((key, fmt.format(out[key] if key != "live_params" else int(out[key]))))
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    return "\n".join(lines + [f"| {k.ljust(width)} | {v} |" for k, v in rows])


def main(exp: Experiment, argv: list[str] | None = None) -> int:
    """Parse, resolve, run. Bad input (:data:`USER_ERRORS`, argparse's errors included)
    becomes one line on stderr and exit status 2, before or during training; a loss that
    stops being finite, one line and status 1; anything else is a bug and keeps its
    traceback (status 1). Under torchrun the process group it joined is left before
    returning (:func:`comera.train.distributed.own_process_group`)."""
    with own_process_group():
        return _main(exp, argv)


def _main(exp: Experiment, argv: list[str] | None) -> int:
    from_command_line = argv is None  # only a command may re-execute itself
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser(exp)
    try:
        args = ap.parse_args(argv)
        if getattr(args, "bench", False):  # a forward to the benchmark's own command
            dropped = [  # --steps or --preset ran the whole benchmark, dropped unsaid
                a.option_strings[0] for a in ap._actions
                if a.option_strings and a.dest not in ("bench", "json", "device", "help")
                and getattr(args, a.dest, None) != a.default
            ]  # fmt: skip
            if dropped:
                raise CLIError(
                    f"--bench takes only --json and --device (it runs the step benchmark, "
                    f"python -m benchmarks.{exp.name}_step); drop {', '.join(dropped)}, or "
                    "run that command with its own flags"
                )
            if args.device:
                check_device(args.device)  # first: a device error stays one line
            return exp.bench(args)  # type: ignore[misc]
        if getattr(args, "json", False):  # a run prints no JSON: it was silently dropped
            raise CLIError("--json goes with --bench (a benchmark's result); drop it for a run")
        cfg = resolve_config(exp, args, ap)
        check_device(
            cfg.train.device, "--device" if args.device == cfg.train.device else "train.device"
        )
        # before the model is built: a command that prints its layers would print them first
        check_step_mode_device(cfg.train.step_mode, cfg.train.device)
        untraced = _untraced_plans(cfg)
        if untraced:
            note(f"--step-mode compile: {untraced} cannot be traced (opt_einsum's path code): "
                 "those layers fall back to eager inside the compiled step, slower; --plan "
                 "comera, dense or auto compile whole")  # fmt: skip
        if from_command_line and torch.device(cfg.train.device).type == "cpu":
            restart_for(cfg.train.cpu_malloc)  # lean: re-executed with huge pages enabled
        with sigterm_as_interrupt():  # SIGTERM here ended the process without a word
            run = prepare(exp, cfg, resume=args.resume is not None, argv=argv,
                          preset=None if args.resume is not None else args.preset)  # fmt: skip
    except USER_ERRORS as e:
        return user_error(ap.prog, e)
    except KeyboardInterrupt as e:  # Ctrl-C (or SIGTERM) while the data is read or the
        # model built: no traceback, as once training runs; nothing was trained
        return stopped_before_training(ap.prog, e)
    try:
        train(run)
    except NonFiniteLoss as e:  # a training outcome, not a bug
        print(f"{ap.prog}: stopped: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        return interrupted(ap.prog, e)
    except PeerLost as e:  # each survivor says it (rank 0 may be the one gone)
        print(f"{ap.prog}: {e}", file=sys.stderr)
        return 1
    except USER_ERRORS as e:  # e.g. a corrupt data file met mid-epoch
        return user_error(ap.prog, e)
    return 0


def stopped_before_training(prog: str, stop: KeyboardInterrupt) -> int:
    """Say, as one line on stderr (rank 0 only), that ``stop`` (SIGINT, or SIGTERM under
    :func:`sigterm_as_interrupt`) came before training started, so nothing was trained;
    return the shell's status for the signal."""
    status, name = stop_signal(stop)
    if os.environ.get("RANK", "0") == "0":
        print(f"{prog}: stopped by {name} before training started; nothing was trained",
              file=sys.stderr)  # fmt: skip
    return status


def stop_signal(stop: KeyboardInterrupt) -> tuple[int, str]:
    """The shell's exit status and the signal's name (``SIGINT``, ``SIGTERM``) of an
    interrupt: :func:`sigterm_as_interrupt`'s carries a ``status``; Ctrl-C's none."""
    status = getattr(stop, "status", 128 + signal.SIGINT)
    return status, signal.Signals(status - 128).name


def interrupted(prog: str, error: Interrupted) -> int:
    """Print ``error`` as one line on stderr (rank 0's: every rank is told to stop);
    return the exit status a signal's death would have had."""
    if error.rank == 0:
        print(f"{prog}: {error}", file=sys.stderr)
    return error.status


def user_error(prog: str, error: BaseException) -> int:
    """Print ``error`` as the one line ``PROG: error: MESSAGE`` on stderr; the exit status
    (2) of bad input, as argparse's own errors have."""
    print(f"{prog}: error: {error}", file=sys.stderr)
    return 2
