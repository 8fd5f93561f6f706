"""MNLI with the paper's six-encoder transformer, CoMERA vs dense.

    python -m experiments.mnli --preset smoke              # CPU, minutes, generated task
    python -m experiments.mnli --preset paper              # the paper's config (GPU)
    python -m experiments.mnli --preset paper --dense      # the dense baseline
    python -m experiments.mnli --resume runs/mnli-smoke    # continue a run bit-identically
    python -m experiments.mnli --bench [--json]            # one training step, CoMERA vs dense

Data: GLUE MNLI from the hub by default; ``--train-file/--eval-file`` and ``--tokenizer``
take local files instead, ``--dataset generated`` the synthetic task.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import comera as C
from comera.optim import AdamWConfig
from comera.training import ComeraConfig, TrainConfig, Trainer
from experiments.mnli_data import (
    GENERATED,
    BatchIterator,
    MNLIData,
    MNLIDataConfig,
    eval_batches,
    load_mnli,
)
from experiments.transformer import EncoderConfig, dense_param_count, encoder_logits, init_encoder

__all__ = ["MNLITask", "Preset", "build", "main", "preset"]


@dataclass(kw_only=True, slots=True)
class Preset:
    """A complete experiment: model, data, training."""

    model: EncoderConfig
    data: MNLIDataConfig
    train: TrainConfig
    batch_size: int = 32
    eval_batch_size: int = 128


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
        return Preset(
            model=EncoderConfig(
                vocab_size=0,  # set from the tokenizer
                max_len=32,
                d_model=64,
                heads=4,
                ffn=128,
                layers=2,
                dropout=0.1,
                rank=8,
                attn_modes=((4, 4, 4), (4, 4, 4)),
                ffn_in_modes=((8, 4, 4), (4, 4, 4)),
                ffn_out_modes=((4, 4, 4), (4, 4, 8)),
                emb_vocab_modes=(),
                emb_dim_modes=(4, 4, 4),
                emb_rank=8,
            ),
            data=MNLIDataConfig(dataset=GENERATED, max_length=32, generated_train=6000),
            train=TrainConfig(
                steps=600,
                run_dir=run_dir or "runs/mnli-smoke",
                optim=AdamWConfig(lr_cores=3e-3, lr_gates=5e-3, lr_rest=3e-3, weight_decay=0.0),
                comera=ComeraConfig(
                    gamma=0.05,
                    tau=0.05,
                    reg_start_step=100,
                    early_steps=400,
                    prune_every=25,
                    size_ratio=0.5,
                    rho=0.05,
                ),
                warmup_steps=20,
                schedule="constant",
                log_every=10,
                eval_every=100,
                checkpoint_every=100,
                run_name="mnli-smoke",
            ),
        )
    raise ValueError(f"unknown preset {name!r}; choose 'paper' or 'smoke'")


class MNLITask:
    """Cross-entropy classification over the encoder; evaluation on every eval split."""

    def __init__(
        self, model: EncoderConfig, data: MNLIData, train_iter: BatchIterator, eval_batch_size: int
    ) -> None:
        self.model = model
        self.data = data
        self.train_iter = train_iter
        self.eval_batch_size = eval_batch_size
        self.device = torch.device("cpu")

    def _to(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def loss(
        self, params: dict, state: dict, batch: dict, *, train: bool
    ) -> tuple[torch.Tensor, dict]:
        batch = self._to(batch)
        logits = encoder_logits(params, state, batch, self.model, train=train)  # (B, 3)
        loss = F.cross_entropy(logits.float(), batch["labels"])
        acc = (logits.argmax(-1) == batch["labels"]).float().mean()
        return loss, {"accuracy": acc.detach()}

    def evaluate(self, params: dict, state: dict) -> dict[str, float]:
        out = {}
        for name, split in self.data.eval.items():
            total, correct, loss_sum = 0, 0, 0.0
            for batch in eval_batches(split, self.eval_batch_size):
                batch = self._to(batch)
                logits = encoder_logits(params, state, batch, self.model, train=False).float()
                loss_sum += float(F.cross_entropy(logits, batch["labels"], reduction="sum"))
                correct += int((logits.argmax(-1) == batch["labels"]).sum())
                total += len(batch["labels"])
            out[f"{name}/accuracy"] = correct / max(total, 1)
            out[f"{name}/loss"] = loss_sum / max(total, 1)
        return out


def _fit_vocab(model: EncoderConfig, vocab_size: int) -> EncoderConfig:
    """Set the vocabulary from the tokenizer, re-factoring the TTM vocab modes if needed."""
    modes = model.emb_vocab_modes
    if not modes or math.prod(modes) < vocab_size:
        d = len(model.emb_dim_modes)
        modes = tuple(sorted(C.propose_modes(vocab_size, d, pad=True), reverse=True))
    return dataclasses.replace(model, vocab_size=vocab_size, emb_vocab_modes=modes)


def build(
    p: Preset, *, dense: bool, rank: int = 0, world: int = 1
) -> tuple[MNLITask, dict, dict, int]:
    """Data, task and a fresh model for a preset; returns (task, params, state, dense_size)."""
    data = load_mnli(p.data)
    model = _fit_vocab(p.model, data.vocab_size)
    if dense:
        model = dataclasses.replace(model, tt=False)
    it = BatchIterator(data.train, p.batch_size, seed=p.train.seed, rank=rank, world_size=world)
    task = MNLITask(model, data, it, p.eval_batch_size)
    task.device = torch.device(p.train.device)
    params, state = init_encoder(model, generator=torch.Generator().manual_seed(p.train.seed))
    return task, params, state, dense_param_count(model)


def _init_distributed(device: str) -> tuple[int, int]:
    """Join the process group when launched by torchrun (RANK/WORLD_SIZE set)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_rank(), dist.get_world_size()


def _parse_eval_files(values: list[str] | None) -> dict[str, str] | None:
    if not values:
        return None
    out = {}
    for v in values:
        name, sep, path = v.partition("=")
        if not sep:
            name, path = Path(v).stem, v
        out[name] = path
    return out


def _apply_args(p: Preset, args: argparse.Namespace) -> Preset:
    data = p.data
    if args.dataset:
        data = dataclasses.replace(data, dataset=args.dataset)
    if args.train_file:
        data = dataclasses.replace(
            data,
            dataset="local" if data.dataset == GENERATED else data.dataset,
            train_file=args.train_file,
            eval_files=_parse_eval_files(args.eval_file) or {},
        )
    if args.tokenizer:
        data = dataclasses.replace(data, tokenizer=args.tokenizer)
    for col in ("premise_column", "hypothesis_column", "label_column"):
        if getattr(args, col):
            data = dataclasses.replace(data, **{col: getattr(args, col)})
    train = p.train
    changes: dict = {"wandb": args.wandb}
    for key in ("steps", "checkpoint_every", "eval_every"):
        if getattr(args, key):
            changes[key] = getattr(args, key)
    if args.device:
        changes["device"] = args.device
    if args.bf16:
        changes["bf16"] = True
    if args.seed is not None:
        changes["seed"] = args.seed
    train = dataclasses.replace(train, **changes)
    if args.dense:
        train = dataclasses.replace(
            train,
            comera=dataclasses.replace(train.comera, enabled=False),
            run_name=f"{train.run_name}-dense",
        )
    return dataclasses.replace(p, data=data, train=train)


def run(
    p: Preset, *, dense: bool = False, resume: bool = False, argv: list[str] | None = None
) -> dict:
    """Train (or resume) a preset; returns the final metrics."""
    rank, world = _init_distributed(p.train.device)
    task, params, state, dense_size = build(p, dense=dense, rank=rank, world=world)
    extra = {
        "experiment": "mnli",
        "dense": dense,
        "model": dataclasses.asdict(task.model),
        "data": dataclasses.asdict(p.data),
        "batch_size": p.batch_size,
        "train_examples": len(task.data.train),
        "preset": p.train.run_name,
        "dense_params": dense_size,
        "argv": argv,
    }
    trainer = Trainer(
        p.train, task, params, state, resume=resume, extra_config=extra, reference_size=dense_size
    )
    if rank == 0:
        live = C.summary_table(trainer.params, trainer.state)
        kind = "dense" if dense else "CoMERA"
        print(
            f"mnli: {kind} model, {C.param_count(trainer.params):,} params "
            f"({dense_size:,} dense), vocab {task.model.vocab_size}, "
            f"{len(task.data.train):,} train examples, world {world}",
            file=sys.stderr,
        )
        if not dense:
            print(live.splitlines()[-1], file=sys.stderr)
    return trainer.fit()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.mnli", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--preset", choices=("paper", "smoke"), default="smoke")
    ap.add_argument("--dense", action="store_true", help="train the dense baseline")
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--resume", metavar="RUN_DIR", default=None, help="continue the run in RUN_DIR")
    ap.add_argument("--dataset", default=None, help="hub name or 'generated'")
    ap.add_argument("--train-file", default=None, help="local parquet/jsonl/json/csv train split")
    ap.add_argument("--eval-file", action="append", default=None, help="[NAME=]PATH, repeatable")
    ap.add_argument(
        "--tokenizer", default=None, help="hub name or local tokenizer.json / directory"
    )
    ap.add_argument("--premise-column", dest="premise_column", default=None)
    ap.add_argument("--hypothesis-column", dest="hypothesis_column", default=None)
    ap.add_argument("--label-column", dest="label_column", default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--checkpoint-every", dest="checkpoint_every", type=int, default=None)
    ap.add_argument("--eval-every", dest="eval_every", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (CUDA)")
    ap.add_argument("--wandb", choices=("online", "offline", "disabled"), default="offline")
    ap.add_argument("--bench", action="store_true", help="time one training step, CoMERA vs dense")
    ap.add_argument("--json", action="store_true", help="with --bench: one JSON object on stdout")
    args = ap.parse_args(argv)
    if args.bench:
        from experiments.mnli_bench import main as bench_main

        return bench_main(json_out=args.json, device=args.device)
    argv = list(sys.argv[1:] if argv is None else argv)
    if args.eval_file and not args.train_file:
        ap.error("--eval-file needs --train-file: local files replace the hub data as a whole")
    resume_dir = args.resume
    if resume_dir:  # the run's own arguments, so the resumed config is the same
        changed = {k for k, v in vars(args).items() if v != ap.get_default(k)}
        extra = sorted(changed - {"resume", "device", "wandb"})
        if extra:
            ap.error(
                f"--resume continues {resume_dir} with its saved arguments; drop "
                + ", ".join("--" + k.replace("_", "-") for k in extra)
                + " (only --device and --wandb may change on resume)"
            )
        cfg_path = Path(resume_dir) / "config.json"
        if not cfg_path.is_file():
            ap.error(f"--resume {resume_dir}: no config.json there; is it a run dir?")
        overrides = {k: getattr(args, k) for k in ("device", "wandb") if k in changed}
        argv = json.loads(cfg_path.read_text()).get("argv") or []
        args = ap.parse_args(argv)
        args.run_dir = resume_dir
        for k, v in overrides.items():
            setattr(args, k, v)
    p = _apply_args(preset(args.preset, args.run_dir), args)
    run(p, dense=args.dense, resume=resume_dir is not None, argv=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
