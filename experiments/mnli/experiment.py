"""MNLI with the paper's six-encoder transformer, CoMERA vs dense.

    python -m experiments.mnli --preset smoke              # CPU, minutes, generated task
    python -m experiments.mnli --preset paper              # the paper's config (GPU)
    python -m experiments.mnli --preset paper --dense      # the dense baseline
    python -m experiments.mnli --resume runs/mnli-smoke    # continue a run bit-identically
    python -m benchmarks.mnli_step [--json]                # one training step (was --bench)
    python -m experiments.mnli --plan dp --plan-for 'layers.*.ffn_*=greedy' --set train.steps=40

Data: GLUE MNLI from the hub by default; ``--train-file/--eval-file`` and ``--tokenizer``
take local files instead, ``--dataset generated`` the synthetic task. The command line is
the shared one of :mod:`experiments.cli` (presets, ``--set``, plans, resume, wandb).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import comera as C
from comera.errors import ConfigError, DataError
from comera.train import ComeraConfig, TrainConfig
from comera.train.optim import AdamWConfig
from experiments import cli
from experiments.mnli.batches import BatchIterator
from experiments.mnli.data import GENERATED, MNLIData, MNLIDataConfig, load_mnli
from experiments.transformer import (
    EncoderConfig,
    check_step_mode,
    dense_param_count,
    encoder_logits,
    fit_vocab,
    init_encoder,
)

__all__ = ["EXPERIMENT", "MNLITask", "Preset", "build", "main", "preset", "run"]


@dataclass(kw_only=True, slots=True)
class Preset:
    """A complete experiment: model, data, training, contraction plans; ``dense`` trains
    the same architecture uncompressed (the baseline)."""

    model: EncoderConfig
    data: MNLIDataConfig
    train: TrainConfig
    plans: C.LayerPlans = field(default_factory=C.LayerPlans)
    dense: bool = False
    batch_size: int = 32
    eval_batch_size: int = 128

    def __post_init__(self) -> None:
        check_step_mode(self.model, self.train.step_mode)
        cli.check_batch_sizes(self.batch_size, self.eval_batch_size)
        if self.data.max_length > self.model.max_len:  # else the first step fails
            raise ConfigError(
                f"data.max_length={self.data.max_length} is longer than the model's "
                f"positions, model.max_len={self.model.max_len}; raise model.max_len too "
                f"(--set model.max_len={self.data.max_length})"
            )


def preset(name: str, run_dir: str | None = None) -> Preset:
    """``paper``: the paper's model and schedule (GPU). ``smoke``: a tiny model on the
    generated task that shows every mechanism (learning, gate shrinkage, pruning,
    compaction, late stage) on 2 CPU cores in about a minute."""
    if name == "paper":
        steps_per_epoch = 392_702 // 32
        return Preset(
            model=EncoderConfig(),
            data=MNLIDataConfig(),
            train=TrainConfig(
                steps=3 * steps_per_epoch,
                run_dir=run_dir or "runs/mnli-paper",
                comera=ComeraConfig(early_steps=steps_per_epoch, prune_every=500),
                warmup_steps=1000,
                log_every=50,
                eval_every=steps_per_epoch // 2,
                checkpoint_every=2000,
                device="cuda" if torch.cuda.is_available() else "cpu",
                run_name="mnli-paper",
            ),
        )
    if name == "smoke":
        # Tuned on 2 CPU cores (runs/ notes in reports/mnli.md): the generated task needs
        # premise and hypothesis together (best single cue 2/3); 16 small heads over
        # 16 tokens learn it in 2000-2600 steps of 128. Two-core TTs (rank 8 on one 8x8 | 8x8
        # split) keep the layers cheap; the gate pull starts once the model has learned.
        return Preset(
            model=EncoderConfig(
                vocab_size=0,  # set from the tokenizer
                max_len=16,
                d_model=64,
                heads=16,
                ffn=128,
                layers=2,
                dropout=0.0,
                init_std=0.1,
                rank=8,
                attn_modes=((8, 8), (8, 8)),
                ffn_in_modes=((16, 8), (8, 8)),
                ffn_out_modes=((8, 8), (16, 8)),
                emb_vocab_modes=(),
                emb_dim_modes=(8, 8),
                emb_rank=16,
            ),
            data=MNLIDataConfig(
                dataset=GENERATED, max_length=16, generated_train=50_000, generated_eval=3000
            ),
            batch_size=128,
            train=TrainConfig(
                steps=2600,
                run_dir=run_dir or "runs/mnli-smoke",
                optim=AdamWConfig(lr_cores=2e-3, lr_gates=5e-3, lr_rest=2e-3, weight_decay=0.0),
                comera=ComeraConfig(
                    gamma=0.05,
                    tau=0.05,
                    prune_rule="contribution",  # robust to the gate/core scale symmetry
                    reg_start_step=1000,
                    early_steps=2000,
                    prune_every=50,
                    size_ratio=0.8,
                    rho=0.05,
                ),
                warmup_steps=50,
                schedule="linear",
                log_every=20,
                eval_every=200,
                checkpoint_every=500,
                run_name="mnli-smoke",
            ),
        )
    raise ConfigError(f"unknown preset {name!r}; choose 'paper' or 'smoke'")


class MNLITask:
    """Cross-entropy classification over the encoder; evaluation on every eval split.

    ``loss`` returns the batch's summed cross-entropy and its example count, so the trainer
    averages exactly over the global batch; ``evaluate`` scores this rank's share of each
    split and returns (sum, count) pairs that the trainer reduces over ranks."""

    def __init__(
        self,
        model: EncoderConfig,
        data: MNLIData,
        train_iter: BatchIterator,
        eval_batch_size: int,
        plans: C.LayerPlans | None = None,
    ) -> None:
        self.model = model
        self.data = data
        self.train_iter = train_iter
        self.eval_batch_size = eval_batch_size
        self.plans = plans or C.LayerPlans()
        self.device = torch.device("cpu")

    @property
    def eval_data_id(self) -> dict[str, str]:
        """Each eval split's digest, kept in checkpoints: a resume over changed eval data is
        refused. (A benchmark's task without data names none.)"""
        return self.data.eval_identity() if self.data is not None else {}

    def _to(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _logits(self, params: dict, state: dict, batch: dict, train: bool) -> torch.Tensor:
        return encoder_logits(params, state, batch, self.model, train=train, plans=self.plans)

    def loss(
        self, params: dict, state: dict, batch: dict, *, train: bool
    ) -> tuple[torch.Tensor, int, dict]:
        batch = self._to(batch)
        logits = self._logits(params, state, batch, train).float()  # (B, 3)
        loss_sum = F.cross_entropy(logits, batch["labels"], reduction="sum")
        acc = (logits.argmax(-1) == batch["labels"]).float().mean()
        return loss_sum, len(batch["labels"]), {"accuracy": acc.detach()}

    def evaluate(
        self, params: dict, state: dict, *, rank: int = 0, world: int = 1
    ) -> dict[str, tuple[float, float]]:
        out = {}
        for name, split in self.data.eval.items():
            n = len(split)
            lo, hi = rank * n // world, (rank + 1) * n // world  # this rank's contiguous share
            correct, loss_sum = 0.0, 0.0
            for start in range(lo, hi, self.eval_batch_size):
                batch = self._to(
                    split.batch(torch.arange(start, min(start + self.eval_batch_size, hi)))
                )
                logits = self._logits(params, state, batch, False).float()
                loss_sum += float(F.cross_entropy(logits, batch["labels"], reduction="sum"))
                correct += float((logits.argmax(-1) == batch["labels"]).sum())
            out[f"{name}/accuracy"] = (correct, float(hi - lo))
            out[f"{name}/loss"] = (loss_sum, float(hi - lo))
        return out


_fit_vocab = fit_vocab  # the old private name


def build(
    p: Preset, *, dense: bool | None = None, rank: int = 0, world: int = 1
) -> tuple[MNLITask, dict, dict, int]:
    """Data, task and a fresh model for a preset; returns (task, params, state, dense_size)."""
    dense = p.dense if dense is None else dense
    data = load_mnli(p.data)
    check_fits_data(p.model, data)
    model = fit_vocab(p.model, data.vocab_size)
    if dense:
        model = dataclasses.replace(model, tt=False)
    it = BatchIterator(data.train, p.batch_size, seed=p.train.seed, rank=rank, world_size=world)
    task = MNLITask(model, data, it, p.eval_batch_size, p.plans)
    task.device = torch.device(p.train.device)
    params, state = init_encoder(model, generator=torch.Generator().manual_seed(p.train.seed))
    return task, params, state, dense_param_count(model)


def check_fits_data(model: EncoderConfig, data: MNLIData) -> None:
    """Refuse a model whose token-type table or classifier is smaller than what the data
    holds (a pair's second sentence is type 1; labels run to num_labels - 1): each would
    fail in the first step's lookup or loss, naming no setting."""
    top = max((int(s.input_ids.max()) for s in data.splits()), default=0)
    if top >= data.vocab_size:  # the first lookup's IndexError (dense) or a late refusal
        raise DataError(
            f"--tokenizer {data.tokenizer_path_or_name} gives token ids up to {top}, past its "
            f"own vocabulary of {data.vocab_size}; its vocabulary has gaps: give a tokenizer "
            "whose ids run 0..size-1"
        )
    types = max((int(s.token_type_ids.max()) for s in data.splits()), default=0)
    if types >= model.type_vocab:
        raise ConfigError(
            f"the data's pairs use token types up to {types} but model.type_vocab="
            f"{model.type_vocab}; set --set model.type_vocab={types + 1}"
        )
    data.check_label_count(model.num_labels)


def _build(p: Preset, rank: int, world: int) -> tuple:
    task, params, state, dense_size = build(p, rank=rank, world=world)
    info = {
        "dense_params": dense_size,
        "vocab": task.model.vocab_size,
        "train_examples": len(task.data.train),
        "model_effective": dataclasses.asdict(task.model),
        "notes": [n for n in [task.data.unevaluated_note()] if n],  # printed, not stored
    }
    return task, params, state, dense_size, info


def _parse_eval_files(values: list[str] | None) -> dict[str, str] | None:
    if not values:
        return None
    out: dict[str, str] = {}
    for v in values:
        name, sep, path = v.partition("=")
        # a path (which may hold "="), unnamed: one that exists, or whose "name" is a path
        if not sep or "/" in name or "\\" in name or Path(v).is_file():
            name, path = Path(v).stem, v
        if not name:  # its metrics would be eval//accuracy
            raise ConfigError(f"--eval-file {v!r}: give the split a name (NAME=PATH) or drop '='")
        if name in out:  # the later one replaced the earlier without a word
            raise ConfigError(
                f"--eval-file {v!r}: the split name {name!r} is taken by {out[name]!r}; "
                "name each split (--eval-file NAME=PATH)"
            )
        out[name] = path
    return out


def _absolute(path: str) -> str:
    """``path`` made absolute where it names something here (a hub name stays as given):
    saved as typed, a relative one was read from wherever a resume ran, and a tokenizer
    folder taken there for a hub name."""
    return os.path.abspath(path) if os.path.exists(path) else path


def data_flags(ap: argparse.ArgumentParser) -> None:
    """The data flags (dataset, local files, tokenizer, columns): MNLI's and any sentence-pair
    classification experiment's (``experiments.finetune``)."""
    ap.add_argument("--dataset", help="hub name, a local dataset folder, or 'generated'")
    ap.add_argument(
        "--train-file", dest="train_file", help="local parquet/jsonl/json/csv/tsv train"
    )
    ap.add_argument("--eval-file", dest="eval_file", action="append", help="[NAME=]PATH")
    ap.add_argument("--tokenizer", help="hub name or local tokenizer.json / directory")
    for col in ("premise", "hypothesis", "label"):
        ap.add_argument(f"--{col}-column", dest=f"{col}_column")


def data_flag_overrides(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """:func:`data_flags`' values as ``data.*`` config overrides."""
    if args.eval_file and not args.train_file:
        raise cli.CLIError(
            "--eval-file needs --train-file: local files replace the hub data as a whole"
        )
    out: list[tuple[str, Any]] = []
    if args.dataset:
        out.append(("data.dataset", args.dataset if args.dataset == GENERATED else
                    _absolute(args.dataset)))  # fmt: skip
    if args.train_file:
        if args.dataset in (None, GENERATED):
            out.append(("data.dataset", "local"))
        out += [("data.train_file", _absolute(args.train_file))]
        evals = _parse_eval_files(args.eval_file) or {}
        out += [("data.eval_files", {k: _absolute(v) for k, v in evals.items()})]
    if args.tokenizer:
        out.append(("data.tokenizer", _absolute(args.tokenizer)))
    for col in ("premise_column", "hypothesis_column", "label_column"):
        if getattr(args, col):
            out.append((f"data.{col}", getattr(args, col)))
    return out


def _bench(args: argparse.Namespace) -> int:
    """``--bench``: a forward to ``python -m benchmarks.mnli_step`` (``--json`` and ``--device``
    passed on), which goes in a later release."""
    from experiments.moved import bench_forward

    return bench_forward("experiments.mnli", "benchmarks.mnli_step", args)


EXPERIMENT = cli.Experiment(
    name="mnli",
    config_type=Preset,
    build=_build,
    presets={"paper": lambda: preset("paper"), "smoke": lambda: preset("smoke")},
    flags=data_flags,
    flag_overrides=data_flag_overrides,
    bench=_bench,
    # a moved tokenizer folder: the encoded examples' digest refuses another tokenization
    resume_mutable=frozenset({"data.tokenizer"}),
    moved_hint=(
        "on --resume the run in {run} reads what it was saved with: a moved tokenizer "
        "resumes with --resume {run} --tokenizer NEW_PATH (the examples' digest refuses "
        "another), a moved data file must be put back (data files cannot change on resume)"
    ),
    derived={
        "model.vocab_size": "the tokenizer's vocabulary: data.tokenizer (--tokenizer) picks another"
    },
    description=__doc__.split("\n")[0],
)


def run(
    p: Preset, *, dense: bool = False, resume: bool = False, argv: list[str] | None = None
) -> dict:
    """Train (or resume) a preset from Python; returns the final metrics."""
    if dense and not p.dense:
        p = cli.set_field(p, "dense", True)
        p = cli.set_field(p, "train.comera.enabled", False)
    return cli.run_experiment(EXPERIMENT, p, resume=resume, argv=argv)


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments.mnli``: the shared experiment CLI."""
    return cli.main(EXPERIMENT, argv)


if __name__ == "__main__":
    raise SystemExit(main())
