"""Ablations as a command: one run per variant (same seed, same data), grouped in wandb,
summarized in ``reports/ablation_<name>.md`` (``ablation_<experiment>_<name>.md`` for
experiments other than MNLI, and for every experiment's ``compression`` and
``target_compression``) with a PNG.

    python -m experiments.ablate contraction --experiment mnli --preset smoke
    python -m experiments.ablate rank --experiment dlrm --preset smoke --values 8,16,32
    python -m experiments.ablate hot_rows --experiment dlrm --preset smoke
    python -m experiments.ablate steps --experiment dlrm --preset smoke
    python -m experiments.ablate capacity --experiment dlrm --preset smoke
    python -m experiments.ablate gamma --experiment codebert --preset smoke
    python -m experiments.ablate objective --experiment mnli --preset smoke --set train.steps=300 \
        --set train.comera.reg_start_step=100
    python -m experiments.ablate gamma --values 0,0.02,0.05 --experiment mnli
    python -m experiments.ablate compression --experiment dlrm --preset smoke
    python -m experiments.ablate target_compression --experiment mnli --values 8,16

Ablations: ``contraction`` (every strategy of ``comera.STRATEGIES``; also reports each
strategy's step time and its largest loss difference from the paper's path, which must be
float-tolerance small), ``rank`` (the initial TT rank; DLRM: the TTM tables' rank),
``gamma`` (the gate regularizer weight), ``size_ratio`` (the late-stage size target c),
``regularizer`` (mean vs L1), ``prune_rule`` (gate vs contribution), ``objective``
(both choices crossed), ``steps`` (the recipe trained 1, 2 and 3 times as long, its CoMERA
schedule scaled along: a plateau or a slow learner?), ``hot_rows`` (DLRM: dense hot rows
beside each TTM table, 0 to 4096: what accuracy they buy and what compression they cost)
and ``capacity`` (DLRM: CoMERA, fixed-rank TTM tables at 1x and 4x the rank, dense, dense
with hashed tables, and CoMERA and dense on 3x the generated rows: is the gap to dense
capacity, rank adaptation or data, and how does the hashing trick do at the same size?),
``compression`` (the late stage asked for 1x, 1/size_ratio, 1.5x, 2x and 4x less than the
early stage's live size, 1x being the late stage off; ``--values`` takes other factors:
accuracy, AUC or held-out loss against live compression, in
``ablation_<experiment>_compression.md``) and
``target_compression`` (``train.comera.target_compression`` at the ``--values`` given:
does the run reach each whole-model compression, at what cost?).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import shutil
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import comera as C
from comera.train import NonFiniteLoss, read_metrics
from comera.train.distributed import init_distributed, launched_world, own_process_group
from comera.train.run_lock import hold_run_dir
from comera.tree import iter_tt
from experiments import cli
from experiments.host import report_header
from experiments.malloc import restart_for
from experiments.report import (
    md_cell,
    number,
    read_run_json,
    record_host,
    runs_host,
    staged,
    step_times,
    train_and_eval_rows,
    write_report_json,
)

__all__ = [
    "ABLATIONS",
    "Variant",
    "gather",
    "main",
    "render_report",
    "run_ablation",
    "variants",
    "write_report",
]

EXPERIMENTS = ("mnli", "dlrm", "codebert")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One run of an ablation: a label and the config overrides that make it."""

    label: str
    overrides: tuple[tuple[str, Any], ...]


def _scaled(key: str, factors: tuple[float, ...]) -> Callable[[Any, Any], list[Variant]]:
    """The setting ``key`` times each factor (an integer one, a rank, at least 1); values
    that coincide (0.5x and 1x of rank 1) run once, and a sweep left with one value, whose
    report would hold one row (gamma 0 times anything), is refused."""

    def make(cfg: Any, exp: cli.Experiment) -> list[Variant]:
        base = cli.get_field(cfg, key)
        kind = type(base)
        vals = [kind(base * f) if f else kind(0) for f in factors]
        if kind is int:
            vals = [max(1, v) for v in vals]
        vals = list(dict.fromkeys(vals))
        if len(vals) < 2:
            raise cli.CLIError(
                f"ablation of {key}: {key}={base} scaled by {', '.join(f'{f:g}' for f in factors)} "
                f"gives the one value {vals[0]}; set {key} to a value the factors tell apart, "
                "or give --values"
            )
        return [Variant(f"{key.rsplit('.', 1)[-1]}={v}", ((key, v),)) for v in vals]

    return make


def _choices(key: str, values: tuple) -> Callable[[Any, Any], list[Variant]]:
    return lambda cfg, exp: [Variant(str(v), ((key, v),)) for v in values]


def _objective(cfg: Any, exp: cli.Experiment) -> list[Variant]:
    """mean/l1 x gate/contribution. With ``l1`` gamma is divided by the number of gates so
    both regularizers pull on each gate with the same strength at the start (they differ
    by exactly that count while every gate is live)."""
    g = cfg.train.comera.gamma
    n = _gate_count(cfg, exp)
    out = []
    for reg in ("mean", "l1"):
        for rule in ("gate", "contribution"):
            over = [("train.comera.regularizer", reg), ("train.comera.prune_rule", rule)]
            if reg == "l1":
                over.append(("train.comera.gamma", g / n))
            out.append(Variant(f"{reg}+{rule}", tuple(over)))
    return out


def _regularizer(cfg: Any, exp: cli.Experiment) -> list[Variant]:
    return [v for v in _objective(cfg, exp) if v.label.endswith("+" + cfg.train.comera.prune_rule)]


def _gate_count(cfg: Any, exp: cli.Experiment) -> int:
    _, params, state, _, _ = exp.build(cfg, 0, 1)
    return sum(int(m.numel()) for _, _, s in iter_tt(params, state) for m in s["masks"])


def _hot_rows(cfg: Any, exp: cli.Experiment) -> list[Variant]:
    _require_model_field(cfg, "hot_rows")
    return _choices("model.hot_rows", (0, 256, 1024, 4096))(cfg, exp)


def _steps(cfg: Any, exp: cli.Experiment) -> list[Variant]:
    """The same recipe trained 1, 2 and 3 times as long: ``train.steps`` and the CoMERA
    schedule (``early_steps``, ``reg_start_step``) scaled together, warm-up unchanged (the
    lr schedule decays over ``train.steps`` by itself). Does more training close a gap, or
    has the model plateaued? Read each variant's best eval beside its last."""
    t, c = cfg.train, cfg.train.comera
    return [
        Variant(
            f"steps={t.steps * f}",
            (
                ("train.steps", t.steps * f),
                ("train.comera.early_steps", c.early_steps * f),
                ("train.comera.reg_start_step", c.reg_start_step * f),
            ),
        )
        for f in (1, 2, 3)
    ]


def _capacity(cfg: Any, exp: cli.Experiment) -> list[Variant]:
    """DLRM: is CoMERA's gap to dense the compressed tables' capacity or the cost of rank
    adaptation, and does more data close it? The preset; its TTM tables at fixed ranks
    (``train.comera.enabled=false``: nothing pruned) at the preset's rank and at 4x it;
    the dense baseline, full and with its large tables hashed to 256 and 1,024 rows
    (``model.hash_rows``: the hashing trick, dense's way to a smaller model), trained with
    the CoMERA runs' optimizer so that only the tables differ; and, on generated data,
    CoMERA, the fixed-rank tables and dense trained for one epoch of a fresh draw of 3x
    the rows, the steps and the CoMERA schedule scaled along."""
    if exp.name != "dlrm":
        raise cli.CLIError("ablation 'capacity' is DLRM's: pass --experiment dlrm")
    from experiments.dlrm.experiment import dense_overrides

    dense = tuple(dense_overrides(cfg, optimizer=cfg.train.optimizer))
    fixed = (("train.comera.enabled", False),)
    rank = cfg.model.emb_rank
    out = [
        Variant("comera", ()),
        Variant(f"fixed_rank_{rank}", fixed),
        Variant(f"fixed_rank_{4 * rank}", (*fixed, ("model.emb_rank", 4 * rank))),
        Variant("dense", dense),
        *(Variant(f"dense_hash_rows_{k}", (*dense, ("model.hash_rows", k))) for k in (256, 1024)),
    ]
    if cfg.data.path == "generated":
        t, c = cfg.train, cfg.train.comera
        more = (
            ("data.generated_rows", 3 * cfg.data.generated_rows),
            ("train.steps", 3 * t.steps),
            ("train.comera.early_steps", 3 * c.early_steps),
            ("train.comera.reg_start_step", 3 * c.reg_start_step),
        )
        out += [
            Variant("comera_3x_data", more),
            Variant(f"fixed_rank_{rank}_3x_data", (*more, *fixed)),
            Variant("dense_3x_data", (*more, *dense)),
        ]
    return out


def _require_model_field(cfg: Any, name: str) -> None:
    """A clear error for an ablation of a model knob this experiment lacks (DLRM's)."""
    if not hasattr(cfg.model, name):
        raise cli.CLIError(f"ablation {name!r} is DLRM's (model.{name}): pass --experiment dlrm")


def _factors(values: str, what: str) -> list[float]:
    """``--values`` as finite numbers >= 1, all checked before anything trains (``inf``
    would ask the late stage for a size of 0)."""
    out = []
    for v in (x.strip() for x in values.split(",") if x.strip()):
        try:
            f = float(v)
        except ValueError:
            f = 0.0
        if not 1 <= f < math.inf:
            raise cli.CLIError(f"--values {v!r}: {what} must be finite numbers >= 1")
        out.append(f)
    return out


def _compression_variants(factors: list[float], own_ratio: float | None = None) -> list[Variant]:
    """``compression`` variants from factors beyond the early stage's size: ``f`` asks the
    late stage for ``1/f`` of it (``size_ratio``); ``1`` is the late stage off. The factor
    of ``own_ratio`` (the preset's) uses that ratio exactly."""
    out = []
    for f in factors:
        ratio = own_ratio if own_ratio and abs(f * own_ratio - 1) < 1e-3 else 1.0 / f
        out.append(Variant(f"{f:g}x", (("train.comera.size_ratio", ratio),)))
    return out


def _compression(cfg: Any, exp: cli.Experiment) -> list[Variant]:
    """1x (the late stage off), the preset's own ``1 / size_ratio``, 1.5x, 2x and 4x."""
    own = cfg.train.comera.size_ratio
    mine = round(1.0 / own, 4)
    # a built-in factor that names the preset's own ratio (1.5 beside 1/0.667 = 1.4993)
    # gives way to it: both would train size_ratio=own
    builtin = [f for f in (1.0, 1.5, 2.0, 4.0) if abs(f * own - 1) >= 1e-3]
    return _compression_variants(sorted({*builtin, mine}), own)


def _target_compression(cfg: Any, exp: cli.Experiment) -> list[Variant]:
    raise cli.CLIError(
        "ablation 'target_compression' needs --values X1,X2,... (whole-model compressions "
        "against the dense model, e.g. --values 8,16)"
    )


ABLATIONS: dict[str, Callable[[Any, cli.Experiment], list[Variant]]] = {
    "contraction": _choices("plans.default", C.STRATEGIES),
    "rank": lambda cfg, exp: _scaled(_rank_key(cfg), (0.5, 1.0, 2.0))(cfg, exp),
    "gamma": _scaled("train.comera.gamma", (0.0, 0.5, 1.0, 2.0)),
    "size_ratio": _choices("train.comera.size_ratio", (0.8, 0.5, 0.2)),
    "regularizer": _regularizer,
    "prune_rule": _choices("train.comera.prune_rule", C.PRUNE_RULES),
    "objective": _objective,
    "hot_rows": _hot_rows,
    "steps": _steps,
    "capacity": _capacity,
    "compression": _compression,
    "target_compression": _target_compression,
}
_KEYS = {
    "target_compression": "train.comera.target_compression",
    "contraction": "plans.default",
    "rank": "model.rank",
    "gamma": "train.comera.gamma",
    "size_ratio": "train.comera.size_ratio",
    "prune_rule": "train.comera.prune_rule",
    "hot_rows": "model.hot_rows",
}


def takes_values(name: str) -> bool:
    """Whether ablation ``name`` sweeps ``--values`` (the others have fixed variants)."""
    return name in _KEYS or name == "compression"


def _rank_key(cfg: Any) -> str:
    """The initial-rank knob: ``model.rank`` (MNLI's TT layers) or ``model.emb_rank``
    (DLRM's TTM tables)."""
    return "model.rank" if hasattr(cfg.model, "rank") else "model.emb_rank"


def variants(name: str, cfg: Any, exp: cli.Experiment, values: str | None) -> list[Variant]:
    """The variants of ablation ``name``; ``values`` (comma-separated) replaces the defaults
    of single-key ablations."""
    if values is None:
        return ABLATIONS[name](cfg, exp)
    given = [v.strip() for v in values.split(",") if v.strip()]
    if not given:  # an empty report over the real one
        raise cli.CLIError(f"--values {values!r}: give at least one value")
    items = values.split(",")
    if not items[-1].strip():  # a trailing comma ("0.1,0.2,") is no item left out
        items.pop()
    if len(given) < len(items):  # "0,,0.1" trained two and reported the three
        raise cli.CLIError(f"--values {values!r}: an empty item; give the values without gaps")
    if len(set(given)) < len(given):  # one run dir trained twice, one row reported twice
        twice = sorted({v for v in given if given.count(v) > 1})
        raise cli.CLIError(f"--values {values!r}: {', '.join(twice)} given twice; give each once")
    if name == "compression":
        what = "compression factors beyond the early stage (1 = the late stage off)"
        return _distinct(_compression_variants(_factors(values, what)))
    if name == "target_compression":  # checked here, not after the first runs trained
        _factors(values, "whole-model compressions against dense")
    if not takes_values(name):
        raise cli.CLIError(f"--values: ablation {name!r} has fixed variants; drop --values")
    key = _rank_key(cfg) if name == "rank" else _KEYS[name]
    if name == "hot_rows":
        _require_model_field(cfg, name)
    return _distinct([Variant(v, ((key, v),)) for v in given])


# what each ablation's own variants set whatever the config they start from says: a --set
# of one of these trained no run and was quoted in the report's command
_FIXED_KEYS = {
    "contraction": ("plans.default",),
    "size_ratio": ("train.comera.size_ratio",),
    "prune_rule": ("train.comera.prune_rule",),
    "hot_rows": ("model.hot_rows",),
    "objective": ("train.comera.regularizer", "train.comera.prune_rule"),
    "regularizer": ("train.comera.regularizer",),
}


def check_swept_sets(name: str, cfg: Any, sets: list[str], values_given: bool) -> None:
    """Refuse a ``--set`` item of the setting ablation ``name`` sweeps where its variants
    replace it: ``--values`` (each variant's value as given) or a sweep of fixed choices.
    Where the variants scale it (gamma, rank, steps) the ``--set`` is their base, and kept."""
    keys = set(_FIXED_KEYS.get(name, ()))
    if values_given:
        keys.add(
            _rank_key(cfg) if name == "rank"
            else "train.comera.size_ratio" if name == "compression"
            else _KEYS.get(name, "")
        )  # fmt: skip
    for item in sets:
        key = item.partition("=")[0].strip()
        if key in keys:
            how = "--values sets it for each variant" if values_given else "its variants set it"
            other = not values_given and name in _KEYS  # --values would compare yours
            raise cli.CLIError(
                f"--set {item}: the {name} ablation sweeps {key} ({how}), so no run would "
                "use this value; drop it from --set"
                + (", or give the values to compare with --values" if other else "")
            )


def _distinct(out: list[Variant]) -> list[Variant]:
    """``out``, refused when two variants share a run folder (2 and 2.0 are both 2x)."""
    folders = [_folder(v.label) for v in out]
    twice = sorted({f for f in folders if folders.count(f) > 1})
    if twice:  # one folder trained twice, reported as two rows
        raise cli.CLIError(f"--values: more than one value names the variant {twice[0]!r}; "
                           "give values that differ as the report shows them")  # fmt: skip
    return out


# what each ablation sweeps is read only by CoMERA runs (not dense), and from when on
_NEEDS = {
    "gamma": "reg", "regularizer": "reg", "objective": "reg", "prune_rule": "comera",
    "size_ratio": "late", "compression": "late", "target_compression": "late",
    "rank": "tt", "contraction": "tt",
}  # fmt: skip


def check_sweep(name: str, cfg: Any, label: str | None = None) -> None:
    """Refuse a variant (``label``; None: the config every variant starts from) whose
    swept setting the run never reads: its row would equal the others under another label
    (a dense run, CoMERA off, a run that ends before the regularizer starts or the late
    stage begins, a size target that overrides ``size_ratio``). Also a label too long to
    name a folder."""
    if label is not None and len(_folder(label).encode()) > 200:
        raise cli.CLIError(f"--values: {label[:40]}... is too long to name a run folder")
    c, steps = cfg.train.comera, cfg.train.steps
    where = f"ablation {name!r}" + (f", variant {label!r}" if label is not None else "")
    if name == "capacity" and label is None and (getattr(cfg, "dense", False) or not c.enabled):
        # its variants turn CoMERA off and build dense themselves: from such a base,
        # comera, fixed_rank_R and dense trained one model under three names
        raise cli.CLIError(
            f"{where} compares CoMERA with fixed ranks and dense itself, from a CoMERA base; "
            "drop --set dense=true and --set train.comera.enabled=false"
        )
    need = _NEEDS.get(name)
    if need is None:
        return
    if getattr(cfg, "dense", False):
        raise cli.CLIError(f"{where}: a dense run (dense=true) reads no TT or rank-adaptation "
                           "setting; drop --set dense=true")  # fmt: skip
    if name == "contraction" and not getattr(cfg.model, "tt_layers", True):
        # DLRM's smoke MLPs are dense, and TTM lookups read no plan: six equal rows
        raise cli.CLIError(
            f"{where}: model.tt_layers is empty, so no layer reads the contraction plan; make "
            "some MLP layers TT (e.g. --set \"model.tt_layers=('bottom.1', 'top.1')\", the "
            "Kaggle preset's)"
        )
    rules = getattr(getattr(cfg, "plans", None), "per_layer", ())
    if name == "contraction" and rules:
        # a per-layer rule wins over each variant's plans.default: its layers ran the rule's
        # strategy in every variant, and the rows (all "dense", say) matched to the bit
        raise cli.CLIError(
            f"{where}: plans.per_layer ({', '.join(f'{g}={s}' for g, s in rules)}) fixes "
            "the strategy of the layers it names in every variant; drop --plan-for and "
            "--set plans.per_layer"
        )
    if need != "tt" and not c.enabled:
        raise cli.CLIError(f"{where}: train.comera.enabled=false reads no rank-adaptation "
                           "setting; drop --set train.comera.enabled=false")  # fmt: skip
    if need == "reg" and name != "gamma" and not c.gamma > 0:  # gamma's own sweep may hold 0
        raise cli.CLIError(
            f"{where}: train.comera.gamma={c.gamma} turns the regularizer off, so its variants "
            "differ at most in the prune rule; set train.comera.gamma above 0"
        )
    if need == "reg" and steps <= c.reg_start_step:
        raise cli.CLIError(
            f"{where}: train.steps={steps} ends before the regularizer starts "
            f"(train.comera.reg_start_step={c.reg_start_step}), so every variant trains alike; "
            f"set train.comera.reg_start_step below {steps} (or train.steps above it)"
        )
    if need == "late" and steps <= c.early_steps:
        raise cli.CLIError(
            f"{where}: train.steps={steps} ends before the late stage "
            f"(train.comera.early_steps={c.early_steps}), where the size target acts; set "
            f"train.comera.early_steps below {steps} (or train.steps above it)"
        )
    if name in ("size_ratio", "compression") and c.target_compression is not None:
        raise cli.CLIError(
            f"{where}: train.comera.target_compression={c.target_compression} overrides the "
            "size_ratio this ablation sweeps; drop that --set (or ablate target_compression)"
        )


def _folder(label: str) -> str:
    """The folder name of the variant ``label`` (a label may hold a ``/``)."""
    return label.replace("/", "_")


def variant_dir(runs_root: Path, label: str) -> Path:
    """Where the variant ``label`` of an ablation trains."""
    return runs_root / _folder(label)


ABLATION_RECORD = "ablation.json"  # in an ablation's runs dir: the command that trained it


def run_ablation(
    name: str,
    exp: cli.Experiment,
    base: Any,
    chosen: list[Variant],
    runs_root: Path,
    *,
    text_values: bool = False,
    values_given: bool | None = None,
    command: str | None = None,
    argv: list[str] | None = None,
    preset: str | None = None,
) -> list[dict]:
    """Train every variant of ``base``; returns one record per variant. ``values_given``
    (default ``text_values``): the variants came from ``--values``, which errors then
    name. ``command``, the
    one that trains them, is kept in ``runs_root`` once the first variant is prepared (a
    command refused before that leaves the last good one for ``--report-only``). The first
    variant's earlier run is set aside while its new one is prepared and put back if that
    is refused: a command refused before it trains anything loses nothing."""
    group = base.train.wandb_group or f"ablate-{name}-{base.train.run_name or exp.name}"
    built = []  # every variant's config first: a bad value fails before any variant trains
    settings: dict[str, str] = {}  # each variant's swept values (repr) -> its label
    given = text_values if values_given is None else values_given
    for v in chosen:
        cfg = base
        for key, value in v.overrides:
            # a value of the ablation's own sweep is named as such, not as --values
            label = f"--values {value}" if given else f"ablation {name!r}'s {key}={value}"
            cfg = cli.set_field(cfg, key, value, text=text_values, label=label)
        check_sweep(name, cfg, v.label)
        same = repr(tuple(cli.get_field(cfg, key) for key, _ in v.overrides))
        if settings.setdefault(same, v.label) != v.label:  # 0.5 and 5e-1: one run twice
            raise cli.CLIError(
                f"--values: {settings[same]!r} and {v.label!r} are the same setting; give "
                "each value once"
                if given
                else f"ablation {name!r}: its variants "
                f"{settings[same]!r} and {v.label!r} are the same setting"
            )
        run_dir = variant_dir(runs_root, v.label)
        over = [("train.run_dir", str(run_dir)), ("train.wandb_group", group)]
        over.append(("train.run_name", f"{name}:{v.label}"))
        if name == "contraction":  # every step's loss: step 1 is the equivalence check
            over.append(("train.log_every", 1))
        built.append((v, cli.apply_overrides(cfg, over, []), run_dir))

    def keep(finished: list[str]) -> None:  # the record --report-only reads
        kept = {"command": command, "argv": argv, "finished": finished}
        (runs_root / ABLATION_RECORD).write_text(json.dumps(kept) + "\n")

    records = []
    for v, cfg, run_dir in built:
        print(f"ablate {name}: {v.label} -> {run_dir}", file=sys.stderr)
        # the ablation's own output: rerun afresh (the old runs kept until one trains)
        try:
            run = _prepare_afresh(exp, cfg, run_dir, keep_old=not records, preset=preset)
        except KeyboardInterrupt as e:  # Ctrl-C while its data is read: a traceback before
            status, signame = cli.stop_signal(e)
            how = f"stopped by {signame} before it trained"
            raise cli.Interrupted(
                f"{name} variant {v.label!r} ({run_dir}) {how}; run the ablation command "
                "again to train its variants (they start anew)",
                status,
                0,
                how,
            ) from None
        if command is not None and not records:  # prepared: this command trains the runs
            runs_root.mkdir(parents=True, exist_ok=True)
            keep([])
        try:
            final = cli.train(run)
        except NonFiniteLoss as e:  # the one line main prints names the variant that diverged
            # the swept value may be the cause: the trainer's advice names learning rates only
            own = ", ".join(f"{k}={val}" for k, val in v.overrides)
            sets = (
                f"This variant sets {own}"
                if own
                else "This variant trains the preset's own settings"
            )
            ways = ["lower the learning rates or clip gradients (--set train.optim.lr_*=..., "
                    "--set train.grad_clip=...)"]  # fmt: skip
            if v.overrides and takes_values(name):
                ways.insert(0, "leave its value out of --values")
            raise NonFiniteLoss(
                f"{name} variant {v.label!r} ({run_dir}): {e.what} {sets}; {', or '.join(ways)}, "
                "and run the ablation command again (its variants start anew)."
            ) from None
        except cli.Interrupted as e:  # its variants train anew: no --resume to point at
            raise cli.Interrupted(
                f"{name} variant {v.label!r} ({run_dir}) {e.how}; run the ablation command "
                "again to train its variants (they start anew)",
                e.status,
                e.rank,
                e.how,
            ) from None
        record_host(run_dir)  # the machine, torch and date the report's header names
        records.append({"label": v.label, "dir": run_dir, "final": final})
        if command is not None:  # what --report-only may show under this command
            keep([r["label"] for r in records])
    return records


def _put_back(run_dir: Path) -> Path:
    """Where :func:`_prepare_afresh` sets ``run_dir``'s run aside; a run left there by a
    command killed while preparing (the new run dir then holds no finished run) is put back
    first."""
    aside = run_dir.with_name(run_dir.name + ".replaced")
    if aside.is_dir():
        shutil.rmtree(run_dir, ignore_errors=True)
        aside.rename(run_dir)
    return aside


def _prepare_afresh(
    exp: cli.Experiment, cfg: Any, run_dir: Path, *, keep_old: bool = True,
    preset: str | None = None,
) -> cli.Prepared:  # fmt: skip
    """``cli.prepare`` of ``cfg`` in an emptied ``run_dir``; with ``keep_old`` the run that
    was there is moved aside meanwhile and put back if preparing fails (a missing file, a
    bad value), otherwise it is deleted first (a later variant of a command that already
    retrained others: an old run kept there would mix two commands in one report)."""
    # its old run is moved and deleted below: refused while another process trains there
    # (a second ablation command, a --resume of a variant), as the commands' runs are
    rank, world = init_distributed(cfg.train.device)
    guard = hold_run_dir(run_dir, rank, world, flag="--runs-dir")
    aside = _put_back(run_dir)
    if not keep_old:
        shutil.rmtree(run_dir, ignore_errors=True)
    if run_dir.exists():
        run_dir.rename(aside)
    try:
        run = cli.prepare(exp, cfg, preset=preset)  # (else config.json names the run's name)
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        if aside.exists():
            aside.rename(run_dir)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    del guard  # the new run's trainer holds its folder
    return run


def _summary(rec: dict) -> dict:
    rows = read_metrics(Path(rec["dir"]) / "metrics.jsonl")
    train, evals = train_and_eval_rows(rows)
    acc_key = next((k for k in (evals[-1] if evals else {}) if k.endswith("accuracy")), None)
    auc_key = next((k for k in (evals[-1] if evals else {}) if k.endswith("/auc")), None)
    loss_key = next(
        (k for k in (evals[-1] if evals else {}) if k.startswith("eval/") and k.endswith("/loss")),
        None,
    )
    # the headline metric: its best eval, and when (the masked LM's is its held-out loss,
    # lowest best; its masked-token accuracy is a side figure, as in the size ablations)
    mlm = bool(loss_key) and loss_key.endswith("heldout/loss")
    key = auc_key or (loss_key if mlm else acc_key)
    pick = min if mlm and not auc_key else max
    best = pick((r for r in evals if key in r), key=lambda r: r[key]) if key else None
    times = step_times(train)
    tail = [r["loss"] for r in train[-5:]]
    return {
        "label": rec["label"],
        "steps": train[-1]["step"] if train else 0,
        "loss_tail": sum(tail) / len(tail) if tail else None,
        "eval_acc": evals[-1][acc_key] if acc_key else None,
        "eval_auc": evals[-1][auc_key] if auc_key else None,
        "best_eval": (best[key], best["step"]) if best else None,
        "best_eval_metric": "AUC" if auc_key else ("held-out loss" if mlm else "accuracy"),
        "compression": train[-1]["compression"] if train else None,
        "live_params": train[-1]["live_params"] if train else None,
        "step_time_ms": 1e3 * statistics.median(times) if times else None,
        "wall_s": train[-1]["step"] / train[-1]["steps_per_s"] if train else None,
        "curve": [(r["step"], r["loss"]) for r in train],
        "eval_curve": [(r["step"], r[key]) for r in evals if key in r] if key else [],
        "live": [(r["step"], r["live_params"]) for r in train],
        "eval_loss": evals[-1][loss_key] if loss_key else None,
        "eval_loss_key": loss_key or "",
        # the compression path: every eval's size and headline metric (pick a point)
        "eval_path": [
            (r["eval_compression"], {k: v for k, v in r.items() if k.startswith("eval/")})
            for r in evals
            if "eval_compression" in r
        ],
        "size": _size_record(Path(rec["dir"])),
    }


def _size_record(run_dir: Path) -> dict:
    """The late stage's size target and how it was met (``ranks.json``'s ``end``)."""
    path = run_dir / "ranks.json"
    if not path.is_file():
        return {}
    end = read_run_json(path, dict).get("end", {})
    keys = ("size_target", "early_params", "live_params", "live_over_target",
            "above_target_because", "target_held_because")  # fmt: skip
    return {k: end[k] for k in keys if k in end}


def gather(name: str, records: list[dict], command: str) -> dict:
    """The ablation report's data: the host that made the runs, the command, and one
    summary per variant with its curves (for ``contraction`` also its loss differences
    from the ``comera`` variant, the paper's path, or else the first: at step 1, over steps
    1-10 and over the whole run)."""
    rows = [_summary(r) for r in records]
    if name == "contraction":
        # the paper's path where it ran (``auto`` may pick any plan per shape), else the first
        ref = next((r for r in rows if r["label"] == "comera"), rows[0])["curve"]
        for r in rows:
            diffs = [(a[0], abs(a[1] - b[1])) for a, b in zip(ref, r["curve"], strict=False)]
            r["first_diff"] = diffs[0][1] if diffs and diffs[0][0] == 1 else None
            r["early_diff"] = max((d for s, d in diffs if s <= 10), default=0.0)
            r["max_diff"] = max((d for _, d in diffs), default=0.0)
    host = runs_host(Path(r["dir"]) for r in records)
    return {"meta": {"command": command, **host}, "ablation": name, "variants": rows}


def render_report(data: dict, out: Path) -> str:
    """Write ``out`` (markdown) and its PNG from the ablation's JSON (:func:`gather`);
    returns the markdown."""
    name, rows = data["ablation"], data["variants"]
    if not rows:  # every table below reads its first row
        raise ValueError(
            f"render_report: ablation {name!r} has no variants to render; "
            "gather() the finished variants' records first"
        )
    lines = report_header(f"Ablation: {name}", data["meta"]["command"], data["meta"])
    lines += ["All variants share the seed, the data order and (where shapes allow) the init."]
    if name == "capacity" and any(r["label"].endswith("_3x_data") for r in rows):
        lines += [
            "The `_3x_data` variants are the exception: they train on a fresh draw of the",
            "generator with 3x the rows (other rows, another validation split), and their",
            "compression is against the dense model of that data.",
        ]
    if name == "compression":
        lines += [
            "",
            "Each variant asks the late stage for 1/f of the live size the early stage ends",
            "at (`train.comera.size_ratio=1/f`); `1x` holds the size: the late stage off.",
        ]
    if name == "contraction":
        lines += [
            "",
            "Step 1 runs every strategy on the same parameters and batch: its loss difference",
            "is the float-tolerance equivalence of the contractions. Later steps start from",
            "parameters that already differ in the last bits, and training amplifies that",
            "(Adam, pruning thresholds), so the whole-run column measures divergence, not error.",
        ]
    with_auc = any(r["eval_auc"] is not None for r in rows)
    # the masked LM's held-out loss (a JSON from before it was shown: by its key)
    held = any(r.get("eval_loss_key", "").endswith("heldout/loss") for r in rows)
    head = "| variant | steps | train loss (last 5 logs) | eval accuracy | "
    head += "eval AUC | " if with_auc else ""
    head += "held-out loss | " if held else ""
    with_best = any(r["best_eval"] is not None for r in rows)
    best_of = rows[0].get("best_eval_metric") or ("AUC" if with_auc else "accuracy")
    head += f"best eval {best_of} (step) | " if with_best else ""
    head += "compression "
    head += "| live params | median step (ms) | train time (s) |"
    if name == "contraction":
        ref = next((r["label"] for r in rows if r["label"] == "comera"), rows[0]["label"])
        head += f" loss diff vs {md_cell(ref)}: step 1 | steps 1-10 | whole run |"
    if name in SIZE_ABLATIONS:
        lines += _size_table(rows)
    lines += ["", head, "|" + "---|" * (head.replace("\\|", "").count("|") - 1)]
    for r in rows:
        cells = [
            md_cell(r["label"]),
            str(r["steps"]),
            number(r["loss_tail"], ".4f"),
            number(r["eval_acc"], ".4f"),
            *([number(r["eval_auc"], ".4f")] if with_auc else []),
            *([number(r.get("eval_loss"), ".4f")] if held else []),
            *([_best_cell(r["best_eval"])] if with_best else []),
            f"{number(r['compression'], '.2f')}x",
            number(r["live_params"], ","),
            number(r["step_time_ms"], ".1f"),
            number(r["wall_s"], ".1f"),
        ]
        if name == "contraction":
            first = "n/a" if r["first_diff"] is None else f"{r['first_diff']:.1e}"
            cells += [first, f"{r['early_diff']:.1e}", f"{r['max_diff']:.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    png = out.with_suffix(".png")
    _plot(name, rows, png)
    lines += ["", f"![{name}]({png.name})", ""]
    text = "\n".join(lines)
    out.write_text(text)
    return text


def write_report(name: str, records: list[dict], out: Path, command: str) -> Path:
    """``reports/ablation_<name>.md``, its JSON (the data it is rendered from: one summary
    and the curves per variant, the host, the command) and its PNG (loss curves and model
    size; step times for contraction; eval curves and AUC against compression for
    capacity)."""
    data = gather(name, records, command)
    with staged(out.parent) as stage:  # all of it, or none if the render fails
        render_report(write_report_json(stage / out.with_suffix(".json").name, data),
                      stage / out.name)  # fmt: skip
    return out


SIZE_ABLATIONS = ("compression", "target_compression", "size_ratio")
NAMED_BY_EXPERIMENT = ("compression", "target_compression")  # ablation_mnli_compression.md


def _headline(row: dict) -> tuple[str, float | None]:
    """The metric a size ablation is read by: eval AUC (DLRM), held-out loss (the masked
    LM, whose masked-token accuracy is a side figure), else eval accuracy."""
    if row.get("eval_auc") is not None:
        return "eval AUC", row["eval_auc"]
    if row.get("eval_loss_key", "").endswith("heldout/loss") or row.get("eval_acc") is None:
        return "held-out loss", row.get("eval_loss")
    return "eval accuracy", row["eval_acc"]


def _size_table(rows: list[dict]) -> list[str]:
    """Live size against the late stage's target, and the headline metric against the
    first variant's (the late stage off, for ``compression``)."""
    metric, _ = _headline(rows[0])
    ref = _headline(rows[0])[1]
    head = (
        "| variant | live params at the early stage's end | size target | live params at "
        f"the end | live / target | compression | {metric} | vs {md_cell(rows[0]['label'])} |"
    )
    out = ["", head, "|" + "---|" * (head.replace("\\|", "").count("|") - 1)]
    for r in rows:
        size, (_, val) = r.get("size") or {}, _headline(r)
        ratio = size.get("live_over_target")
        diff = "n/a" if val is None or ref is None else f"{val - ref:+.4f}"
        if val is not None and ref and metric == "held-out loss":
            diff += f" ({100 * (val - ref) / ref:+.1f}%)"
        out.append(
            "| "
            + " | ".join(
                [
                    md_cell(r["label"]),
                    f"{size['early_params']:,}" if "early_params" in size else "n/a",
                    f"{size['size_target']:,}" if "size_target" in size else "n/a",
                    f"{r['live_params']:,}" if r["live_params"] is not None else "n/a",
                    f"{ratio:.3f}" if ratio is not None else "n/a",
                    f"{r['compression']:.2f}x" if r["compression"] else "n/a",
                    "n/a" if val is None else f"{val:.4f}",
                    diff,
                ]
            )
            + " |"
        )
    missed = [r for r in rows if (r.get("size") or {}).get("above_target_because")]
    for r in missed:
        out.append(f"\n{r['label']}: above its target because {r['size']['above_target_because']}.")
    # a target the early stage already met: the late stage held the size, not the target
    held = [r for r in rows if (r.get("size") or {}).get("target_held_because")]
    for r in held:
        out.append(f"\n{r['label']}: not the size asked for: {r['size']['target_held_because']}.")
    return out


def _best_cell(best: tuple[float, int] | list | None) -> str:
    return "n/a" if best is None else f"{number(best[0], '.4f')} ({best[1]})"


def _plot(name: str, rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4), squeeze=False)
    if name == "capacity":  # accuracy against size, the question this ablation asks
        _plot_capacity(rows, axes[0])
    elif name in SIZE_ABLATIONS:
        _plot_size(rows, axes[0])
    else:
        _plot_curves(name, rows, axes[0])
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _plot_curves(name: str, rows: list[dict], axes: Any) -> None:
    """Left: each variant's loss curve. Right: its live parameters (step time per
    strategy for contraction)."""
    ax = axes[0]
    for r in rows:
        steps, losses = zip(*r["curve"], strict=True) if r["curve"] else ((), ())
        ax.plot(steps, losses, label=r["label"], lw=1.2)
    ax.set(xlabel="step", ylabel="train loss", title=f"{name}: loss curves")
    ax.legend(fontsize=8)
    ax = axes[1]
    if name == "contraction":
        ax.bar([r["label"] for r in rows], [r["step_time_ms"] for r in rows], color="tab:blue")
        ax.set(ylabel="median step time (ms)", title="step time per strategy")
    else:
        for r in rows:
            steps, live = zip(*r["live"], strict=True) if r["live"] else ((), ())
            ax.plot(steps, live, label=r["label"], lw=1.2)
        ax.set(xlabel="step", ylabel="live parameters", title=f"{name}: model size")
        ax.legend(fontsize=8)


def _plot_capacity(rows: list[dict], axes: Any) -> None:
    """Left: each variant's eval curve. Right: its last eval against its compression (log
    scale), labelled: which formats buy accuracy at which size."""
    ax = axes[0]
    for r in rows:
        if r["eval_curve"]:
            steps, vals = zip(*r["eval_curve"], strict=True)
            style = "--" if r["label"].endswith("_3x_data") else "-"
            ax.plot(steps, vals, style, marker=".", label=r["label"], lw=1.2)
    ax.set(xlabel="step", ylabel="eval AUC", title="capacity: eval curves")
    ax.legend(fontsize=8)
    ax = axes[1]
    for r in rows:
        if r["compression"] and r["eval_auc"] is not None:
            other_data = r["label"].endswith("_3x_data")  # another draw: hollow squares
            ax.scatter(r["compression"], r["eval_auc"], s=30, marker="s" if other_data else "o",
                       facecolors="none" if other_data else None,
                       edgecolors="k" if other_data else None)  # fmt: skip
            ax.annotate(r["label"], (r["compression"], r["eval_auc"]), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")  # fmt: skip
    ax.set_xscale("log")
    ax.set(xlabel="compression vs dense (x, log)", ylabel="eval AUC at end",
           title="capacity: accuracy against size")  # fmt: skip


def _plot_size(rows: list[dict], axes: Any) -> None:
    """Left: each variant's path, its headline metric at every eval against the live
    compression then. Right: the live parameters over training."""
    metric, _ = _headline(rows[0])
    key_end = {"eval AUC": "/auc", "eval accuracy": "accuracy", "held-out loss": "/loss"}[metric]
    ax = axes[0]
    for r in rows:
        pts = [(c, next((v for k, v in ev.items() if k.endswith(key_end)), None))
               for c, ev in r["eval_path"]]  # fmt: skip
        pts = [(c, v) for c, v in pts if v is not None]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker=".", lw=1.0, label=r["label"])
            ax.annotate(r["label"], (xs[-1], ys[-1]), fontsize=7, xytext=(4, 3),
                        textcoords="offset points")  # fmt: skip
    ax.set(xlabel="live compression vs dense (x)", ylabel=metric,
           title="metric against compression, every eval")  # fmt: skip
    ax.legend(fontsize=8)
    ax = axes[1]
    for r in rows:
        steps, live = zip(*r["live"], strict=True) if r["live"] else ((), ())
        ax.plot(steps, live, label=r["label"], lw=1.2)
    ax.set(xlabel="step", ylabel="live parameters", title="model size")
    ax.legend(fontsize=8)


def _read_record(record: Path, default: str) -> dict:
    """An ablation's ``record``, read once: its training ``command`` (``default`` when it
    names none) and what else it kept; an unreadable record is a one-line error naming
    the file."""
    try:
        saved = json.loads(record.read_text())
    except (ValueError, OSError) as e:  # not JSON, bad UTF-8, unreadable
        raise cli.CLIError(f"--report-only: cannot read {record} ({e}); delete it") from None
    command = saved.get("command", default) if isinstance(saved, dict) else None
    if not isinstance(command, str):
        raise cli.CLIError(f"--report-only: {record} names no training command; delete it")
    return {**saved, "command": command}


def _recorded_finished(saved: dict) -> list[str] | None:
    """The variants a read record says its command finished (None in a record written
    before it kept them)."""
    done = saved.get("finished")
    return [str(x) for x in done] if isinstance(done, list) else None


def _recorded_args(
    saved: dict, record: Path, ap: argparse.ArgumentParser
) -> argparse.Namespace | None:
    """The recorded command's arguments, parsed as the command parsed them (abbreviations,
    repeats, spaces); None for a record without them (written before they were kept)."""
    argv = saved.get("argv")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        return None
    try:
        return ap.parse_args(argv)
    except SystemExit:  # (argparse's own exit) a record this parser cannot read
        raise cli.CLIError(
            f"--report-only: {record} holds arguments this command refuses; delete it"
        ) from None


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments.ablate``: train the variants, write the report, in one
    process (under torchrun it refuses); a process group joined meanwhile is left on the
    way out."""
    with own_process_group():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    from_command_line = argv is None  # only a command may re-execute itself
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(
        prog="python -m experiments.ablate", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    ap.add_argument("ablation", choices=sorted(ABLATIONS))
    ap.add_argument("--experiment", choices=EXPERIMENTS, default="mnli")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--values", help="comma-separated values (single-key ablations)")
    ap.add_argument("--runs-dir", default="runs",
                    help="variants go to RUNS_DIR/ablate-[EXPERIMENT-]NAME-PRESET/")  # fmt: skip
    ap.add_argument("--reports", default="reports", help="where the report and PNG go")
    ap.add_argument("--wandb", choices=("online", "offline", "disabled"))
    ap.add_argument("--report-only", action="store_true", help="rebuild the report from the runs")
    args = ap.parse_args(argv)
    exp: cli.Experiment = importlib.import_module(f"experiments.{args.experiment}").EXPERIMENT
    try:
        if launched_world() > 1:
            # every process prepared the data, moved the same run folders aside and wrote
            # the record and the report: races, not a data-parallel ablation
            raise cli.CLIError(
                "experiments.ablate runs in one process, its variants one after another: "
                "run it without torchrun, or train each variant with torchrun -m "
                f"experiments.{args.experiment} (its own --set and --run-dir) and compare "
                "the runs"
            )
        preset = args.preset or exp.default_preset
        if preset not in exp.presets:
            raise cli.CLIError(f"--preset {preset!r}: choose one of {sorted(exp.presets)}")
        over = [("train.wandb", args.wandb)] if args.wandb else []
        cli.refuse_derived_sets(exp, args.sets)
        base = cli.apply_overrides(exp.presets[preset](), over, args.sets)
        if not args.report_only:  # before variants(): objective builds the model (dense: 0 gates)
            check_sweep(args.ablation, base)
            check_swept_sets(args.ablation, base, args.sets, args.values is not None)
        chosen = variants(args.ablation, base, exp, args.values)  # user errors before a restart
        if from_command_line and not args.report_only:
            if torch.device(base.train.device).type == "cpu":  # a valid device: TrainConfig
                restart_for(base.train.cpu_malloc)  # as the experiment's command (lean: THP)
        # MNLI's older ablations keep their names; the size ablations name every experiment
        named = args.experiment != "mnli" or args.ablation in NAMED_BY_EXPERIMENT
        tag = f"{args.experiment}-" if named else ""
        root = Path(args.runs_dir) / f"ablate-{tag}{args.ablation}-{preset}"
        cli.check_folder(Path(args.reports), "--reports")  # not after every variant trained
        if not args.report_only:
            cli.check_folder(root, "--runs-dir")
        # the command that trains the runs, kept beside them: a --report-only rebuild
        # names it, whatever --set items the rebuild is given
        ran = [a for a in argv if not (a.startswith("--report-") and "--report-only".startswith(a))]
        command = "python -m experiments.ablate " + " ".join(ran)
        record = root / ABLATION_RECORD
        if args.report_only:
            finished = None
            if record.is_file():
                saved = _read_record(record, command)
                command, finished = saved["command"], _recorded_finished(saved)
                recorded = _recorded_args(saved, record, ap)
                if args.values is None and recorded is not None:  # the variants it trained
                    if not args.sets and recorded.sets:  # its --set items name them too
                        base = cli.apply_overrides(exp.presets[preset](), over, recorded.sets)
                    chosen = variants(args.ablation, base, exp, recorded.values)
            records = [{"label": v.label, "dir": variant_dir(root, v.label)} for v in chosen]
            for r in records:  # a run a killed command set aside, as a training one would
                _put_back(r["dir"])
            unfinished = [r["label"] for r in records
                          if finished is not None and r["label"] not in finished]  # fmt: skip
            if unfinished:  # a run cut short, or one an earlier command trained
                raise cli.CLIError(
                    f"--report-only: variants {unfinished} did not finish under the recorded "
                    f"command ({command}); rerun it without --report-only"
                )
            for r in records:  # another experiment's run copied in: its metrics mix in
                cfg = r["dir"] / "config.json"
                ran = read_run_json(cfg, dict).get("experiment") if cfg.is_file() else None
                if ran not in (None, args.experiment):
                    raise cli.CLIError(
                        f"--report-only: {r['dir']} is a run of experiments.{ran}, not of "
                        f"experiments.{args.experiment}"
                    )
            missing = [str(r["dir"]) for r in records if not (r["dir"] / "metrics.jsonl").is_file()]
            if missing:
                more = f" (and {len(missing) - 1} more variants)" if len(missing) > 1 else ""
                raise cli.CLIError(
                    f"--report-only: no run in {missing[0]}{more}; run the ablation "
                    "without --report-only first (same --runs-dir, --experiment and --preset)"
                )
        else:
            with cli.sigterm_as_interrupt():  # SIGTERM while a variant is prepared: one line
                records = run_ablation(
                    args.ablation,
                    exp,
                    base,
                    chosen,
                    root,
                    # --values text goes to the config as typed; compression's are parsed here
                    text_values=args.values is not None and args.ablation != "compression",
                    values_given=args.values is not None,
                    command=command,
                    argv=ran,
                    preset=preset,
                )
    except cli.USER_ERRORS as e:  # bad input: one line; anything else keeps its traceback
        return cli.user_error(ap.prog, e)
    except NonFiniteLoss as e:  # a training outcome, as the experiment's command says it
        print(f"{ap.prog}: stopped: {e} (the report is not rewritten)", file=sys.stderr)
        return 1
    except cli.Interrupted as e:
        return cli.interrupted(ap.prog, e)
    except KeyboardInterrupt as e:  # between variants (its record written, its host noted)
        status, signame = cli.stop_signal(e)
        print(f"{ap.prog}: stopped by {signame}; run the ablation command again to train its "
              "variants (they start anew)", file=sys.stderr)  # fmt: skip
        return status
    named = args.experiment != "mnli" or args.ablation in NAMED_BY_EXPERIMENT
    tag = f"{args.experiment}_" if named else ""
    out = Path(args.reports) / f"ablation_{tag}{args.ablation}.md"
    try:
        write_report(args.ablation, records, out, command)
    except cli.USER_ERRORS as e:  # a run it cannot read: the old report stays
        return cli.user_error(ap.prog, e)
    print(out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
