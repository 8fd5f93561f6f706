"""DLRM on Criteo with TTM tables, CoMERA vs dense, on the shared trainer and CLI.

    python -m experiments.dlrm --preset smoke                  # CPU, generated data, minutes
    python -m experiments.dlrm --preset smoke --dense --run-dir runs/dlrm-smoke-dense  # dense
    python -m experiments.dlrm --preset kaggle --data train.txt            # the paper (GPU)
    python -m experiments.dlrm --preset kaggle --data train.txt --dense    # reference DLRM
    python -m benchmarks.dlrm_step [--json]                    # one step (was --bench)

``--dense`` trains the dense model as the reference does (SGD, constant lr 0.1, sparse
embedding gradients, no clipping) in the ``kaggle`` preset; ``--set train.optimizer=adamw`` selects
the shared AdamW instead (the ``smoke`` preset's dense default, see ``preset``).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import comera as C
from comera.errors import ConfigError, MissingFileError
from comera.train import ComeraConfig, TrainConfig
from comera.train.distributed import rank_first
from comera.train.optim import OPTIMIZERS, AdamWConfig, SGDConfig
from comera.tree import iter_tt
from experiments import cli
from experiments.dlrm.batches import RowBatches
from experiments.dlrm.data import CriteoDataConfig, load_criteo
from experiments.dlrm.model import DLRMConfig, check_lookup_impl, dense_param_count, init_dlrm
from experiments.dlrm.task import DLRMTask

__all__ = ["EXPERIMENT", "Preset", "build", "dense_overrides", "main", "preset", "run"]


@dataclass(kw_only=True, slots=True)
class Preset:
    """Model, data, training and plans; ``dense`` trains the uncompressed baseline."""

    model: DLRMConfig = field(default_factory=DLRMConfig)
    data: CriteoDataConfig = field(default_factory=CriteoDataConfig)
    train: TrainConfig
    plans: C.LayerPlans = field(default_factory=C.LayerPlans)
    dense: bool = False
    dense_optimizer: str = "sgd"  # what --dense trains with (the reference: SGD)
    batch_size: int = 128
    eval_batch_size: int = 16384

    def __post_init__(self) -> None:
        if self.train.step_mode == "cuda_graph":
            batched = self.model.tt and self.model.batched_lookup and not self.dense
            why = ("the table-batched TTM lookup sizes its work from the ids on the host"
                   if batched else "its capture has never been checked with per-table "
                   "lookups or dense tables (its default table-batched lookup cannot be "
                   "captured at all)")  # fmt: skip
            raise ConfigError(
                f"train.step_mode='cuda_graph' cannot run DLRM: {why}; use --step-mode "
                "eager, sync_free or compile"
            )
        cli.check_batch_sizes(self.batch_size, self.eval_batch_size)
        if self.model.hot_rows and self.dense:  # before anything trains (an ablation's runs)
            raise ConfigError(
                f"model.hot_rows={self.model.hot_rows} adds dense rows beside CoMERA's TTM "
                "tables; the dense baseline has no TTM table: set model.hot_rows=0 with --dense"
            )
        if self.dense_optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"dense_optimizer={self.dense_optimizer!r} (what --dense trains with); "
                f"choose one of {OPTIMIZERS} (--set dense_optimizer=...)"
            )


# On CPU, DLRM trains with glibc's large blocks returned on free, on huge pages: at batch
# 10k (Kaggle table sizes, 2 threads) CoMERA's peak above baseline was 248 MB against 356
# MB under glibc as found (freed activations otherwise stay resident as heap holes), at
# 0.29 s per step against 0.36; dense and CoMERA alike (`python -m experiments.dlrm
# --bench` measures both policies). The smoke preset keeps it: its steps are faster
# under it too (three alternating pairs of fresh processes, `benchmarks.plans`' smoke
# steps: dense 8.0-8.7 ms against 10.0-12.5, CoMERA 10.4-11.1 against 12.8-16.8 under
# glibc as found, CoMERA / dense about 1.3 under both).
CPU_MALLOC = "lean"


# a run longer than this many epochs of its data gets a note (the reference trains one)
EPOCHS_NOTED = 10


def preset(name: str) -> Preset:
    """``kaggle``: the reference's Criteo Kaggle setting (batch 128, one epoch), CoMERA
    on it (GPU; the raw train.txt via --data). ``smoke``: a small DLRM on the generated
    file with planted signal (CPU, about 30 s per run, one epoch)."""
    if name == "kaggle":
        steps = 39_291_958 // 128  # one epoch of the six train days (45,840,617 rows)
        return Preset(
            data=CriteoDataConfig(path="", eval_rows=None),
            batch_size=128,
            train=TrainConfig(
                steps=steps,
                run_dir="runs/dlrm-kaggle",
                optim=AdamWConfig(lr_cores=1e-3, lr_gates=1e-3, lr_rest=1e-3, weight_decay=0.0),
                comera=ComeraConfig(
                    early_steps=steps // 2, prune_every=1000, reg_start_step=steps // 10
                ),
                grad_clip=None,
                log_every=200,
                eval_every=steps // 8,
                checkpoint_every=10_000,
                device="cuda" if torch.cuda.is_available() else "cpu",
                cpu_malloc=CPU_MALLOC,
                run_name="dlrm-kaggle",
            ),
        )
    if name == "smoke":
        return Preset(
            model=DLRMConfig(
                cardinalities=(1,),  # replaced by the data's
                bottom=(64, 32),
                top=(64,),
                tt_min_rows=2000,
                emb_rank=16,  # val AUC at 800 steps: rank 8 0.741, 16 0.753, 32 0.757, 64 0.756
                tt_layers=(),
                tt_layer_rank=8,
            ),
            # one epoch in 800 steps (205,715 train rows), as the reference trains Criteo: on
            # 120,000 rows the dense model overfit in its second epoch (val AUC 0.787 at step
            # 400, 0.730 at 800)
            data=CriteoDataConfig(path="generated", generated_rows=240_000),
            # the reference's SGD (lr 0.1) barely moves 1/sqrt(n)-sized rows in 800 steps
            # (val AUC 0.60 vs 0.74 with AdamW): the smoke baseline uses the shared AdamW
            dense_optimizer="adamw",
            batch_size=256,
            eval_batch_size=8192,
            train=TrainConfig(
                steps=800,
                run_dir="runs/dlrm-smoke",
                optim=AdamWConfig(lr_cores=3e-3, lr_gates=2e-2, lr_rest=3e-3, weight_decay=0.0),
                sgd=SGDConfig(lr=0.1),
                comera=ComeraConfig(
                    gamma=0.1,
                    tau=0.05,
                    prune_rule="contribution",
                    reg_start_step=300,
                    early_steps=600,
                    prune_every=50,
                    size_ratio=0.8,
                ),
                grad_clip=None,
                log_every=20,
                eval_every=200,
                checkpoint_every=400,
                cpu_malloc=CPU_MALLOC,
                run_name="dlrm-smoke",
            ),
        )
    raise ConfigError(f"unknown preset {name!r}; choose 'kaggle' or 'smoke'")


def _fit_model(p: Preset, cardinalities: list[int]) -> DLRMConfig:
    model = p.model
    if len(model.cardinalities) != len(cardinalities) or model.cardinalities != tuple(
        cardinalities
    ):
        model = dataclasses.replace(model, cardinalities=tuple(cardinalities), names=())
    if p.dense:
        model = dataclasses.replace(model, tt=False)
    return model


def build(p: Preset, *, rank: int = 0, world: int = 1) -> tuple[DLRMTask, dict, dict, int]:
    """Data, task and a fresh model; returns ``(task, params, state, dense_size)``.

    Under torchrun rank 0 preprocesses (and caches) the data while the others wait."""
    if not p.data.path:
        raise ConfigError(
            "this preset reads the raw Criteo Kaggle train.txt: pass --data PATH "
            "(or --data generated for the planted-signal file; --set data.path=PATH where a "
            "command has no --data, as experiments.ablate)"
        )
    if not p.dense:  # before the data: a lookup that cannot run as recorded is refused
        check_lookup_impl(p.model, p.plans.embedding_impl)
    if p.model.hot_rows and p.data.id_order != "frequency":
        raise ConfigError(
            f"model.hot_rows={p.model.hot_rows} keeps the most frequent ids of each table, "
            f"which needs ids numbered by frequency: set data.id_order=frequency (got "
            f"{p.data.id_order!r}) or model.hot_rows=0"
        )
    if p.model.hash_rows and not p.dense:
        raise ConfigError(
            f"model.hash_rows={p.model.hash_rows} hashes the dense baseline's tables; train "
            "it with --dense, or set model.hash_rows=0 for CoMERA"
        )
    # known before the data is read (on the Kaggle file that is minutes and a new cache):
    # a table holds at most max_ind_range values, and id 0 beside them where min_count
    # folds rare ones into it
    rows = p.data.max_ind_range + (p.data.min_count > 1)
    if (
        p.train.comera.enabled
        and not p.model.tt_layers
        and p.data.max_ind_range
        and rows < p.model.tt_min_rows
    ):
        raise ConfigError(
            f"--max-ind-range {p.data.max_ind_range} caps every table at {rows} rows, under "
            f"model.tt_min_rows={p.model.tt_min_rows}, and model.tt_layers is empty: the "
            "CoMERA model would have no compressed layer; raise --max-ind-range, lower --set "
            "model.tt_min_rows=N, or train --dense"
        )
    progress = p.train.progress and rank == 0
    data = rank_first(lambda: load_criteo(p.data, progress=progress), rank, world)
    model = _fit_model(p, data.cardinalities)
    if model.hash_rows and not any(model.is_hashed(i) for i in range(len(model.names))):
        raise ConfigError(
            f"model.hash_rows={model.hash_rows} hashes no table: no table has more rows "
            f"than that among those of model.tt_min_rows={model.tt_min_rows} rows and up "
            f"(largest {max(model.cardinalities)}); lower model.hash_rows or tt_min_rows"
        )
    lo, hi = data.splits["train"]
    it = RowBatches(data, lo, hi, p.batch_size, seed=p.train.seed, rank=rank, world=world)
    task = DLRMTask(
        model,
        data,
        it,
        eval_rows=p.data.eval_rows,
        eval_batch_size=p.eval_batch_size,
        plans=p.plans,
        # sparse gradients need the eager step; other step modes take dense ones, as
        # several ranks do
        sparse=p.train.optimizer == "sgd" and world == 1 and p.train.step_mode == "eager",
        device=p.train.device,
    )
    params, state = init_dlrm(model, generator=torch.Generator().manual_seed(p.train.seed))
    if p.train.comera.enabled and not any(True for _ in iter_tt(params, state)):
        folded = (  # the cause where rare values became id 0
            f" (data.min_count={p.data.min_count} folds values seen fewer times into id 0)"
            if p.data.min_count > 1
            else ""
        )
        raise ConfigError(
            f"the CoMERA model has no compressed layer: every table has fewer than "
            f"model.tt_min_rows={model.tt_min_rows} rows (largest {max(model.cardinalities)})"
            f"{folded} and model.tt_layers is empty; lower --set model.tt_min_rows=N"
            f"{' or data.min_count' if folded else ''}, or train --dense"
        )
    return task, params, state, dense_param_count(model)


def _build(p: Preset, rank: int, world: int) -> tuple:
    try:
        task, params, state, dense_size = build(p, rank=rank, world=world)
    except MissingFileError:
        run_dir = Path(p.train.run_dir)
        if not (run_dir / "config.json").is_file():  # a fresh run: --data PATH says it
            raise
        # a resume (the CLI refuses a fresh run in a folder that holds a config.json)
        try:  # where a plain --resume reads (a moved file's last --data is kept)
            saved = cli.resumed_config(EXPERIMENT, run_dir).data.path
        except (*cli.USER_ERRORS, OSError, ValueError):
            saved = p.data.path
        if saved != p.data.path:  # --data NEW given on this resume: NEW is what is missing
            raise MissingFileError(
                f"Criteo file {p.data.path} (--data) does not exist or is not a file; give "
                f"--data the path the run's data is at now (it last read {saved})"
            ) from None
        raise MissingFileError(
            f"Criteo file {p.data.path}, which the run in {run_dir} was trained on, does not "
            f"exist or is not a file; if it moved, continue with --resume {run_dir} --data "
            "NEW_PATH (a file with other content is refused)"
        ) from None
    info = {
        "dense_params": dense_size,
        "rows": len(task.data),
        "train_rows": task.train_iter.n,
        "ttm_tables": sum("cores" in t for t in params["tables"].values()),
        "cardinalities": list(task.model.cardinalities),
        "data_cache": str(task.data.root),
    }
    epochs = p.train.steps * p.batch_size / max(task.train_iter.n, 1)
    if epochs > EPOCHS_NOTED:  # the kaggle preset's one epoch of Kaggle on a small file
        info["notes"] = [
            f"train.steps={p.train.steps:,} at batch_size {p.batch_size} is {epochs:,.0f} "
            f"epochs of this file's {task.train_iter.n:,} training rows (DLRM trains one; "
            "--set train.steps=N sets the length)"
        ]
    return task, params, state, dense_size, info


def _flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--data", help="a Criteo-format train.txt, or 'generated'")
    ap.add_argument("--cache-dir", dest="cache_dir", help="where preprocessed data is cached")
    ap.add_argument(
        "--max-ind-range", dest="max_ind_range", type=int, help="hash ids modulo this (0: off)"
    )


def _flag_overrides(args: argparse.Namespace) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    # an empty value (``--data "$DATA"`` with DATA unset) is refused, not taken as absent
    if args.data == "":
        raise cli.CLIError(
            '--data "": empty; pass a Criteo-format train.txt with --data PATH, or --data '
            "generated for the planted-signal file"
        )
    if args.cache_dir == "":
        raise cli.CLIError(
            '--cache-dir "": empty; pass a folder for the preprocessed data, or drop '
            "--cache-dir for the default ($COMERA_CACHE/criteo or ~/.cache/comera/criteo)"
        )
    if args.data is not None:
        out.append(("data.path", args.data))
    if args.cache_dir is not None:
        out.append(("data.cache_dir", args.cache_dir))
    if args.max_ind_range is not None:
        out.append(("data.max_ind_range", args.max_ind_range))
    if getattr(args, "dense", False) and not args.resume:
        out += _dense_defaults(args)
    return out


def _dense_defaults(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """``--dense``'s reference training as defaults: the flag hook's items are applied
    after a ``--config`` file's and before ``--set``'s, so the keys the file sets are left
    out here (``--set`` wins by coming last). The optimizer is the preset's
    ``dense_optimizer``, or the one the file or a ``--set`` gives that field."""
    cfg = preset(args.preset)
    from_file = cli.config_file_items(args.config, cfg) if args.config else []
    optimizer = cfg.dense_optimizer
    for key, value, label in from_file:
        if key == "dense_optimizer":
            optimizer = cli.set_field(cfg, key, value, label=label).dense_optimizer
    for item in args.sets:
        key, _, text = item.partition("=")
        if key.strip() == "dense_optimizer":
            optimizer = cli.set_field(cfg, key.strip(), text, text=True).dense_optimizer
    in_file = {key for key, _, _ in from_file}
    return [(k, v) for k, v in _reference_training(optimizer) if k not in in_file]


def _reference_training(optimizer: str) -> list[tuple[str, Any]]:
    """How the dense baseline trains: the reference's SGD keeps its learning rate constant
    and clips nothing; ``optimizer`` is the preset's ``dense_optimizer``."""
    out: list[tuple[str, Any]] = [("train.optimizer", optimizer), ("train.grad_clip", None)]
    if optimizer == "sgd":
        out += [("train.schedule", "constant"), ("train.warmup_steps", 0)]
    return out


def _bench(args: argparse.Namespace) -> int:
    """``--bench``: a forward to ``python -m benchmarks.dlrm_step`` (``--json`` and ``--device``
    passed on), which goes in a later release."""
    from experiments.moved import bench_forward

    return bench_forward("experiments.dlrm", "benchmarks.dlrm_step", args)


EXPERIMENT = cli.Experiment(
    name="dlrm",
    config_type=Preset,
    build=_build,
    presets={"kaggle": lambda: preset("kaggle"), "smoke": lambda: preset("smoke")},
    flags=_flags,
    flag_overrides=_flag_overrides,
    bench=_bench,
    # a moved file resumes with --data NEW_PATH, and a cache gone or unwritable with
    # --cache-dir NEW: the data's digest guards its content
    pair_differs=frozenset({"model.hot_rows", "model.hash_rows"}),
    resume_mutable=frozenset({"data.path", "data.cache_dir"}),
    derived={
        "model.cardinalities": "one table per categorical column, sized by the data's ids",
        "model.names": "the data's column names, C1..C26",
        "model.dense_features": "the data's 13 dense columns",
    },
    description=__doc__.split("\n")[0],
)


def run(p: Preset, *, dense: bool = False, resume: bool = False, argv: list[str] | None = None):
    """Train (or resume) a preset from Python; returns the final metrics."""
    if dense and not p.dense:
        for key, value in dense_overrides(p):
            p = cli.set_field(p, key, value)
    return cli.run_experiment(EXPERIMENT, p, resume=resume, argv=argv)


def dense_overrides(p: Preset, optimizer: str | None = None) -> list[tuple[str, Any]]:
    """The config overrides that turn a CoMERA preset into its dense baseline: the shared
    CLI's ``--dense`` switch (uncompressed tables, no rank adaptation) plus this
    experiment's reference training with ``optimizer`` (default: the preset's
    ``dense_optimizer``, what ``--dense`` trains with). A test holds the two in step."""
    return [
        ("model.hot_rows", 0),  # every row of the dense model's tables is dense already
        ("dense", True),
        ("train.comera.enabled", False),
        *_reference_training(optimizer or p.dense_optimizer),
    ]


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments.dlrm``: the shared experiment CLI."""
    return cli.main(EXPERIMENT, argv)
