"""CodeBERT-style masked-LM pretraining, CoMERA vs dense, fed by ``loaders.TokenLoader``.

python -m experiments.codebert --preset smoke             # CPU: the stdlib corpus, minutes
python -m experiments.codebert --preset smoke --dense
python -m experiments.codebert --corpus app=./src --corpus lib=./vendor --mix app=0.7,lib=0.3

python -m experiments.codebert --preset paper                # GPU, CodeSearchNet from the hub
python -m benchmarks.codebert_step [--json]                  # one step (was --bench)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import comera as C
from comera.errors import ConfigError, DataError
from comera.train import ComeraConfig, TrainConfig
from comera.train.distributed import rank_first
from comera.train.optim import AdamWConfig
from experiments import cli
from experiments.cache import cache_root
from experiments.codebert.data import (
    CODESEARCHNET_LANGUAGES,
    Corpus,
    corpus_from_hub,
    corpus_from_paths,
    stdlib_corpus,
    tokenizer_info,
)
from experiments.codebert.model import init_mlm
from experiments.codebert.task import MLMTask
from experiments.cursor import check_global_batch
from experiments.notes import note
from experiments.transformer import EncoderConfig, check_step_mode, dense_param_count, fit_vocab
from loaders import (
    DatasetSpec,
    EmptyStream,
    LoaderConfig,
    MixingShortfall,
    ReadersWithoutDocuments,
    TokenLoader,
)
from loaders.config import check_weight, is_int
from loaders.pipeline import holds_long
from loaders.prepare import MAX_TRAIN_VOCAB

__all__ = [
    "EXPERIMENT",
    "CorpusConfig",
    "Preset",
    "build",
    "check_mix",
    "codebert_model",
    "main",
    "preset",
]


@dataclass(kw_only=True, slots=True)
class CorpusConfig:
    """Where the text comes from and how it is cut.

    ``source``: ``"stdlib"`` (the running Python's standard library, three sub-datasets by
    file kind), ``"paths"`` (``paths``: ``{name: folder}``, from ``--corpus``; a folder of
    source files, or one ``python -m loaders.prepare --heldout F`` made; its files are
    those ``globs[name]`` matches, from ``--corpus NAME=FOLDER:GLOB``, else those
    ``default_glob`` matches, every common source suffix when None, as the presets set it)
    or ``"hub"``
    (``hub_dataset`` with one sub-dataset per name in ``hub_configs``, the text in
    ``text_column``: CodeSearchNet's six languages by default; needs the network or a
    warm cache). ``mix``: sub-dataset weights (default equal). ``tokenizer``: a
    ``tokenizer.json`` or a hub name; ``None`` trains a byte-level BPE of ``vocab`` on the
    training files (not for ``"hub"``). ``heldout``: the fraction of files (or rows) held
    out, fixed by a hash of each. ``max_doc_tokens``: longer files are cut into pieces of
    this many tokens (the mixer switches sub-dataset between documents, so its shares are
    exact to one piece). ``provenance``: training batches also carry each token's
    (document, offset) (``doc_ids``, ``doc_offsets``; see ``loaders.LoaderConfig``).
    ``num_shards``: the logical shards the training stream is cut into, the most processes
    that can read it; fixed at a run's first start (its loader state holds it)."""

    source: str = "stdlib"
    paths: dict[str, str] = field(default_factory=dict)
    globs: dict[str, str] = field(default_factory=dict)
    # a folder's files when globs names none: None, every source suffix; a config saved
    # before the key existed reads its old pattern, so a resumed run sees the same files
    default_glob: str | None = "**/*.py"
    mix: dict[str, float] = field(default_factory=dict)
    tokenizer: str | None = None
    vocab: int = 2000
    heldout: float = 0.05
    max_files: int | None = None
    hub_dataset: str = "code_search_net"
    hub_configs: tuple[str, ...] = CODESEARCHNET_LANGUAGES
    text_column: str = "func_code_string"
    cache_dir: str | None = None
    seq_len: int = 128
    eval_batches: int = 8
    max_doc_tokens: int | None = 1024
    provenance: bool = False
    num_shards: int = 64

    def __post_init__(self) -> None:
        if not is_int(self.num_shards) or self.num_shards < 1:
            raise ConfigError(f"data.num_shards={self.num_shards!r}; give a positive integer")
        if self.source not in ("stdlib", "paths", "hub"):
            raise ConfigError(f"data.source={self.source!r}; choose 'stdlib', 'paths' or 'hub'")
        if self.source == "paths" and not self.paths:
            raise ConfigError(
                "data.source='paths' needs --corpus NAME=FOLDER (where a command has no "
                '--corpus, as experiments.ablate: --set \'data.paths={"NAME": "FOLDER"}\')'
            )
        for name in self.paths:  # a name is a cache folder's name, beside its BPE's file
            if name in ("", ".", "..", "tokenizer.json") or "/" in name or "\\" in name:
                raise ConfigError(
                    f"data.paths: {name!r} is not a sub-dataset name (no path separators, "
                    "not . or .. or tokenizer.json); name it as in --corpus NAME=FOLDER"
                )
        for name, folder in self.paths.items():
            if not isinstance(folder, str) or not folder.strip():  # Path("") is the cwd
                raise ConfigError(
                    f"data.paths: {name!r} has no folder ({folder!r}); give --corpus {name}=FOLDER"
                )
        for name, glob in self.globs.items():
            if Path(glob).is_absolute():  # Path.glob refuses it with a traceback
                raise ConfigError(
                    f"data.globs: the glob {glob!r} of {name!r} is absolute; give a pattern "
                    "relative to the folder (e.g. **/*.py)"
                )
            if ".." in Path(glob).parts:  # it read files outside the folder
                raise ConfigError(
                    f"data.globs: the glob {glob!r} of {name!r} leaves its folder ('..'); "
                    "give the other folder its own --corpus NAME=FOLDER"
                )
        if self.source != "paths" and (self.paths or self.globs):  # read by nothing
            raise ConfigError(
                f"data.source={self.source!r} does not read data.paths/data.globs "
                f"({sorted(self.paths) or sorted(self.globs)}); give folders with --corpus "
                "NAME=FOLDER alone (it sets data.source='paths')"
            )
        stray = sorted(set(self.globs) - set(self.paths))
        if stray:
            raise ConfigError(
                f"data.globs names {stray}, which are not corpus folders "
                f"({sorted(self.paths) or 'none'}); give the glob with --corpus NAME=FOLDER:GLOB"
            )
        if self.source == "hub" and self.tokenizer is None:
            raise ConfigError(
                "data.source='hub' needs data.tokenizer (e.g. microsoft/codebert-base)"
            )
        # each named alone: one line listing all three did not say which failed; a vocab
        # of 2**31 aborted inside the tokenizer trainer (a Rust allocation failure)
        if not 300 <= self.vocab <= MAX_TRAIN_VOCAB:
            raise ConfigError(
                f"data.vocab={self.vocab} must be between 300 and {MAX_TRAIN_VOCAB:,} (the "
                "BPE vocabulary trained on the corpus)"
            )
        if not 0 < self.heldout < 1:
            raise ConfigError(
                f"data.heldout={self.heldout} must be above 0 and below 1 (the share of files "
                "held out for the held-out loss)"
            )
        if self.seq_len < 8:
            raise ConfigError(f"data.seq_len={self.seq_len} must be at least 8 tokens")
        if self.max_doc_tokens is not None and (
            not is_int(self.max_doc_tokens) or self.max_doc_tokens < 1
        ):
            raise ConfigError(
                f"data.max_doc_tokens={self.max_doc_tokens!r} must be None (whole files) or "
                "an integer >= 1"
            )
        for name, weight in self.mix.items():  # the loader's error named no flag
            check_weight(f"--mix {name}={weight} (data.mix)", weight)
        if self.mix and not any(self.mix.values()):
            raise ConfigError("--mix gives every sub-dataset weight 0; weigh at least one above 0")
        if self.max_files is not None and self.max_files < 2:  # 0 read all, -1 all but one
            raise ConfigError(  # 1 was refused by prepare, naming its own --heldout flag
                f"data.max_files={self.max_files} must be None (all) or >= 2 (each group holds "
                "one file or more out, data.heldout, and trains on the rest)"
            )
        if self.eval_batches < 0:
            raise ConfigError(f"data.eval_batches={self.eval_batches} must be >= 0 (0: none)")


@dataclass(kw_only=True, slots=True)
class Preset:
    model: EncoderConfig
    data: CorpusConfig = field(default_factory=CorpusConfig)
    train: TrainConfig
    plans: C.LayerPlans = field(default_factory=C.LayerPlans)
    dense: bool = False
    batch_size: int = 16  # rows per micro-batch over all ranks (each takes its share)

    def __post_init__(self) -> None:
        if self.train.step_mode in ("compile", "cuda_graph"):
            raise ConfigError(
                f"train.step_mode={self.train.step_mode!r} cannot run the masked LM: the "
                "masked positions (and so the loss's shapes) change with every batch; use "
                "--step-mode eager or sync_free"
            )
        check_step_mode(self.model, self.train.step_mode)
        if self.train.eval_every and not self.data.eval_batches:  # every eval logged NaN
            raise ConfigError(
                f"data.eval_batches=0 holds nothing for the evaluations train.eval_every="
                f"{self.train.eval_every} asks for; raise it, or set train.eval_every=None"
            )
        if self.data.seq_len > self.model.max_len:  # else the first step fails
            raise ConfigError(
                f"data.seq_len={self.data.seq_len} is longer than the model's positions, "
                f"model.max_len={self.model.max_len}; raise model.max_len too "
                f"(--set model.max_len={self.data.seq_len})"
            )


def preset(name: str) -> Preset:
    """``paper``: CodeBERT as published (12 x 768, 12 heads, FFN 3072, vocab 50265,
    positions 514, one token type; 125M parameters) on CodeSearchNet's six languages with
    the ``microsoft/codebert-base`` tokenizer, sequence 512 (GPU). ``base``: the same
    encoder on local code (the stdlib, or ``--corpus``) with a BPE trained on it.
    ``smoke``: a 2-layer d64 encoder on the stdlib corpus (CPU, minutes).

    Tensor formats (``paper`` and ``base``): every encoder linear is a TT with the paper's
    MNLI shapes for its 768-wide encoder (attention 768x768 as [12,8,8 | 8,8,12], FFN
    [16,16,12 | 8,8,12] and back), rank 30; the word embedding is a TTM of vocab modes
    20x16x16x10 (51,200 rows >= 50,265) by 4x4x8x6, rank 32, and the MLM decoder is tied
    to it. The CoMERA paper's text reachable from here names neither CodeBERT's size nor
    its shapes and ranks; these are ours (stated in ``reports/codebert.md``)."""
    if name == "smoke":
        return Preset(
            model=EncoderConfig(
                vocab_size=0,
                max_len=128,
                d_model=64,
                heads=4,
                ffn=128,
                layers=2,
                dropout=0.0,
                init_std=0.05,
                rank=8,
                attn_modes=((8, 8), (8, 8)),
                ffn_in_modes=((16, 8), (8, 8)),
                ffn_out_modes=((8, 8), (16, 8)),
                emb_vocab_modes=(),
                emb_dim_modes=(8, 8),
                emb_rank=16,
            ),  # fmt: skip
            data=CorpusConfig(
                source="stdlib", vocab=2000, max_files=150, seq_len=128, default_glob=None
            ),
            batch_size=16,
            train=TrainConfig(
                steps=3000,
                run_dir="runs/codebert-smoke",
                # dense runs use lr_rest for every weight; CoMERA cores learn faster at 6e-3
                optim=AdamWConfig(lr_cores=6e-3, lr_gates=5e-3, lr_rest=1e-3, weight_decay=0.0),
                comera=ComeraConfig(
                    gamma=0.05,
                    tau=0.05,
                    prune_rule="contribution",
                    reg_start_step=1000,
                    early_steps=2000,
                    prune_every=100,
                    # the late stage asks for 0.8 of the early stage's live size: the masked
                    # LM is still learning at 3000 steps, and 2x costs it ~8% held-out loss
                    size_ratio=0.8,
                ),
                warmup_steps=200,
                log_every=10,
                eval_every=500,
                checkpoint_every=1000,
                run_name="codebert-smoke",
            ),  # fmt: skip
        )
    if name in ("paper", "base"):
        cuda = torch.cuda.is_available()
        data = (
            CorpusConfig(source="hub", tokenizer="microsoft/codebert-base", seq_len=512,
                         default_glob=None,
                         eval_batches=64)
            if name == "paper"
            else CorpusConfig(source="stdlib", vocab=50265, seq_len=512, eval_batches=64,
                              default_glob=None)
        )  # fmt: skip
        return Preset(
            model=codebert_model(),
            data=data,
            batch_size=32,
            train=TrainConfig(
                steps=100_000,
                accum_steps=8,  # 256 rows of 512 tokens per step and rank
                run_dir=f"runs/codebert-{name}",
                optim=AdamWConfig(lr_cores=5e-4, lr_gates=1e-3, lr_rest=1e-4, weight_decay=0.01),
                comera=ComeraConfig(
                    gamma=0.02,
                    tau=0.02,
                    prune_rule="contribution",
                    reg_start_step=5_000,
                    early_steps=50_000,
                    prune_every=500,
                ),  # fmt: skip
                warmup_steps=5_000,
                log_every=50,
                eval_every=2000,
                checkpoint_every=2000,
                device="cuda" if cuda else "cpu",
                bf16=cuda,
                run_name=f"codebert-{name}",
            ),
        )
    raise ConfigError(f"unknown preset {name!r}; choose 'paper', 'base' or 'smoke'")


def codebert_model(**changes: Any) -> EncoderConfig:
    """CodeBERT's published encoder (microsoft/codebert-base: RoBERTa-base shape) with the
    tensor formats of the ``paper`` preset."""
    cfg = EncoderConfig(
        vocab_size=50265, max_len=514, type_vocab=1, d_model=768, heads=12, ffn=3072,
        layers=12, dropout=0.1, init_std=0.02, rank=30,
        emb_vocab_modes=(20, 16, 16, 10), emb_dim_modes=(4, 4, 8, 6), emb_rank=32,
    )  # fmt: skip
    return dataclasses.replace(cfg, **changes)


def check_mix(mix: dict[str, float], names: set[str]) -> None:
    """Refuse ``--mix`` weights that name no sub-dataset of ``names`` or leave one out."""
    unknown = sorted(set(mix) - names)
    if unknown:
        raise ConfigError(f"--mix names {unknown}; the corpus has {sorted(names)}")
    unnamed = sorted(names - set(mix)) if mix else []
    if unnamed:  # weighed 1.0 each: --mix a=0.9 gave a 47%, not 90%
        keep = ",".join(f"{n}={mix.get(n, 1.0):g}" for n in sorted(names))
        raise ConfigError(
            f"--mix gives no weight to {unnamed}; weigh every sub-dataset (relative weights, "
            f"0 leaves one out), e.g. --mix {keep} (the weights a run saved before this "
            "check trained with)"
        )


def build(p: Preset, *, rank: int = 0, world: int = 1) -> tuple[MLMTask, dict, dict, int]:
    """Corpus (prepared and cached; rank 0 first), loaders, task and a fresh model."""
    check_global_batch(p.batch_size, world)  # per rank, a resume changed the batch
    root, progress = cache_root("codebert", p.data.cache_dir), p.train.progress and rank == 0
    for up in (root, *root.parents):  # a file on the way: NotADirectoryError mid-prepare
        if up.exists():
            if not up.is_dir():
                raise ConfigError(f"the corpus cache {root} lies under {up}, a file; point "
                                  "data.cache_dir (or $COMERA_CACHE) at a folder")  # fmt: skip
            break

    def corpus_of() -> Corpus:
        d = p.data
        if d.source == "stdlib":
            return stdlib_corpus(root, vocab=d.vocab, heldout=d.heldout, max_files=d.max_files,
                                 max_doc_tokens=d.max_doc_tokens, tokenizer=d.tokenizer,
                                 progress=progress)  # fmt: skip
        if d.source == "hub":
            return corpus_from_hub(d.hub_dataset, d.hub_configs, root, tokenizer=str(d.tokenizer),
                                   text_column=d.text_column, heldout=d.heldout,
                                   max_doc_tokens=d.max_doc_tokens, progress=progress)  # fmt: skip
        return corpus_from_paths(d.paths, root, vocab=d.vocab, heldout=d.heldout,
                                 max_doc_tokens=d.max_doc_tokens, tokenizer=d.tokenizer,
                                 progress=progress, globs=d.globs,
                                 glob=d.default_glob)  # fmt: skip

    if p.data.source == "paths" and p.data.max_files is not None:  # (--corpus sets None)
        note(
            f"data.max_files={p.data.max_files} picks files of the stdlib source only; every "
            "file of --corpus is read"
        )
    if world > p.data.num_shards:  # the loader's refusal names LoaderConfig, not the key;
        # and before minutes of preparing the corpus
        raise DataError(
            f"{world} processes, but the training stream is cut into data.num_shards="
            f"{p.data.num_shards} shards, one reader each at most; train on fewer processes, "
            "or start a new run with --set data.num_shards=N (N >= the processes; a run "
            "keeps the value it started with)"
        )
    if p.data.source == "paths" and p.data.paths:  # --corpus names them: checked before
        check_mix(p.data.mix, set(p.data.paths))  # minutes of preparing the corpus
    try:
        corpus = rank_first(corpus_of, rank, world)
    except cli.USER_ERRORS:
        raise
    except OSError as e:  # one line, as DLRM's cache errors: not a traceback mid-prepare
        raise _corpus_os_error(e, root) from None
    check_mix(p.data.mix, set(corpus.train))
    vocab_size, ids = tokenizer_info(corpus.tokenizer)
    bos, pad, eos, mask_id = ids["<s>"], ids["<pad>"], ids["</s>"], ids["<mask>"]
    if mask_id is None or pad is None:
        raise DataError(f"tokenizer {corpus.tokenizer} has no <mask> or <pad> token; MLM "
                        "needs both (a RoBERTa-style tokenizer): give data.tokenizer (or "
                        "prepare the --corpus folders with) one that has them")  # fmt: skip
    special = tuple(i for i in ids.values() if i is not None)

    def loader_cfg(folders: dict[str, Path], mix: dict[str, float], *, batch_size: int,
                   **kw: Any) -> LoaderConfig:  # fmt: skip
        specs = [DatasetSpec(name=n, path=str(f), weight=mix.get(n, 1.0))
                 for n, f in folders.items()]  # fmt: skip
        return LoaderConfig(datasets=specs, seq_len=p.data.seq_len, batch_size=batch_size,
                            bos_id=bos, eos_id=eos, pad_id=pad, seed=p.train.seed,
                            num_shards=p.data.num_shards, **kw)  # fmt: skip

    more_docs = {"paths": "more files in the --corpus folders",
                 "stdlib": "a larger data.max_files, or --corpus folders",
                 "hub": "more rows in the hub dataset"}[p.data.source]  # fmt: skip
    try:
        train_iter = TokenLoader(loader_cfg(corpus.train, p.data.mix, provenance=p.data.provenance,
                                            batch_size=p.batch_size // world),
                                 rank=rank, world_size=world)  # fmt: skip
    except ReadersWithoutDocuments as e:  # advice in this command's terms
        raise DataError(
            f"{e.fact}; give the corpus more documents ({more_docs}) or train on fewer processes"
        ) from None
    except MixingShortfall as e:
        raise DataError(
            f"{e.fact}; lower the --mix weight of the sub-datasets named, give them more "
            f"documents ({more_docs}), or train on fewer processes"
        ) from None
    except EmptyStream:  # the loader's own message names LoaderConfig.min_doc_len, no flag
        weighed = sorted(n for n in corpus.train if p.data.mix.get(n, 1.0) > 0)
        raise DataError(
            f"no sub-dataset with a positive weight ({', '.join(weighed)}) holds "
            "a training document with a token (empty files?); give --corpus folders with "
            "text, or --mix weight to one that has some"
        ) from None
    cfg = train_iter.config
    empty = _without_text(train_iter)
    if empty:  # the loader drops it, and its share goes to the others without a word
        raise DataError(
            f"sub-dataset {empty[0]!r} ({corpus.train[empty[0]]}) holds no training document "
            f"of {cfg.min_doc_len}+ tokens (empty files?); give it files with text, or drop "
            "it from --corpus"
        )
    # the held-out batches weigh every group alike, whatever --mix: a mix changed on resume
    # (or a group given no weight) leaves the held-out loss measured on the same tokens
    try:
        held_loader = TokenLoader(loader_cfg(corpus.heldout, {}, shuffle="none", num_epochs=1,
                                             batch_size=p.batch_size),
                                  rank=0, world_size=1)  # fmt: skip
    except EmptyStream:  # no held-out token: refused below, naming data.heldout
        held_loader = None
    silent = [] if held_loader is None or not p.data.eval_batches else _without_text(held_loader)
    if silent:  # its held-out files empty: the held-out loss measured the others alone
        raise DataError(
            f"sub-dataset {silent[0]!r}: its held-out split ({corpus.heldout[silent[0]]}) "
            f"holds no document of {held_loader.config.min_doc_len}+ tokens (empty files?), "
            "so the held-out loss would leave it out; hold out other files (data.heldout), "
            "or drop it from --corpus (a run saved so cannot resume: start it again)"
        )
    held = iter(held_loader) if held_loader is not None else iter(())
    model = fit_vocab(p.model, vocab_size)
    if p.dense:
        model = dataclasses.replace(model, tt=False)
    task = MLMTask(model, train_iter, [], mask_id=mask_id, special_ids=special,
                   plans=p.plans, device=p.train.device)  # fmt: skip
    gen = torch.Generator().manual_seed(1234)  # the held-out masks never change
    for _, batch in zip(range(p.data.eval_batches), held, strict=False):
        task.eval_batches.append(task.mask(batch, generator=gen))
    if p.data.eval_batches and not task.eval_batches:  # would report loss 0, perplexity 1
        raise DataError(
            f"the held-out split ({', '.join(str(f) for f in corpus.heldout.values())}) gives "
            "no batch: it holds no token; hold out more files (data.heldout) or give "
            "a corpus whose held-out part is not empty"
        )
    params, state = init_mlm(model, generator=torch.Generator().manual_seed(p.train.seed))
    # the dense model: the encoder (its pooler's d x d + d count stands for the head's dense
    # layer; no classifier), the head's LayerNorm and the output bias (decoder tied)
    d = model.d_model
    dense_size = dense_param_count(dataclasses.replace(model, num_labels=0)) + 2 * d
    dense_size += model.vocab_size
    return task, params, state, dense_size


def _without_text(loader: TokenLoader) -> list[str]:
    """The weighted sub-datasets of ``loader`` holding no document of ``min_doc_len``
    tokens: the loader drops them, and their share goes to the others without a word."""
    cfg = loader.config
    weighted = [d.name for d in cfg.datasets if d.weight > 0]
    return [n for n in weighted if not holds_long(loader.sources[n], cfg.min_doc_len)]


def _corpus_os_error(e: OSError, root: Path) -> DataError:
    """An ``OSError`` met preparing the corpus, as one line: the cache (not a folder, no
    room, no permission), or a corpus file that cannot be read."""
    name = str(e.filename) if e.filename else ""
    why = e.strerror or str(e)
    cached = not name or Path(name).resolve().is_relative_to(root.resolve())
    if cached:
        return DataError(
            f"cannot build the corpus cache under {root}: {why}{f' ({name})' if name else ''}; "
            "point data.cache_dir (or $COMERA_CACHE) at a writable folder with room for it"
        )
    return DataError(f"cannot read {name} of the corpus: {why}; check the file and its folder")


def _build(p: Preset, rank: int, world: int) -> tuple:
    task, params, state, dense_size = build(p, rank=rank, world=world)
    info = {"dense_params": dense_size, "vocab": task.model.vocab_size,
            "eval_batches": len(task.eval_batches)}  # fmt: skip
    return task, params, state, dense_size, info


def _flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--corpus", action="append", metavar="NAME=FOLDER[:GLOB]",
                    help="a folder of source files as a sub-dataset (repeatable): every file "
                         "with a common source suffix, or those GLOB matches (e.g. "
                         "js=./src:**/*.js)")  # fmt: skip
    ap.add_argument("--mix", help="sub-dataset weights, e.g. modules=0.5,tests=0.5")


def _parse_pairs(flag: str, text: str, convert: type, *, commas_in_values: bool = False) -> dict:
    """``NAME=VALUE,...`` as a dict. With ``commas_in_values`` (``--corpus``: folders) a
    part without ``=`` belongs to the value before it: a folder whose name holds a comma."""
    items = text.split(",")
    if commas_in_values:
        joined: list[str] = []
        for item in items:
            if joined and "=" not in item:
                joined[-1] += "," + item
            else:
                joined.append(item)
        items = joined
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise cli.CLIError(f"{flag} {item!r}: expected NAME=VALUE")
        if name in out:  # the later one replaced the earlier without a word
            raise cli.CLIError(f"{flag} {text!r}: {name!r} is named twice")
        try:
            out[name] = convert(value)
        except ValueError:
            raise cli.CLIError(f"{flag} {item!r}: {value!r} is not a {convert.__name__}") from None
    return out


def _folder_and_glob(value: str) -> tuple[str, str | None]:
    """``FOLDER:GLOB`` split at its last colon when what follows is a glob (it has ``*``,
    ``?`` or ``[``); anything else is a folder (whose name may hold a colon)."""
    folder, sep, glob = value.rpartition(":")
    if sep and folder and any(c in glob for c in "*?["):
        return folder, glob
    return value, None


def _flag_overrides(args: argparse.Namespace) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if args.corpus:
        paths, globs = {}, {}
        for item in args.corpus:
            for name, value in _parse_pairs("--corpus", item, str, commas_in_values=True).items():
                if name in paths:  # the later one replaced the earlier without a word
                    raise cli.CLIError(f"--corpus {item!r}: sub-dataset {name!r} is named twice")
                folder, glob = _folder_and_glob(value)
                # absolute: a run saved 'src' as typed, and --resume from another folder
                # then failed on '--corpus src: not a folder', a flag it had not been given
                paths[name] = os.path.abspath(folder) if folder else folder
                if glob:
                    globs[name] = glob
        # paths first: validated; max_files (the smoke preset's 150) picks stdlib files only
        out += [("data.paths", paths), ("data.source", "paths"), ("data.max_files", None)]
        if globs:
            out.append(("data.globs", globs))
    if args.mix:
        out.append(("data.mix", _parse_pairs("--mix", args.mix, float)))
    return out


def _bench(args: argparse.Namespace) -> int:
    """``--bench``: a forward to ``python -m benchmarks.codebert_step`` (``--json`` and ``--device``
    passed on), which goes in a later release."""
    from experiments.moved import bench_forward

    return bench_forward("experiments.codebert", "benchmarks.codebert_step", args)


EXPERIMENT = cli.Experiment(
    name="codebert",
    config_type=Preset,
    build=_build,
    presets={n: (lambda n=n: preset(n)) for n in ("smoke", "base", "paper")},
    flags=_flags,
    flag_overrides=_flag_overrides,
    bench=_bench,
    # --mix may change on resume, and the cache's place: the loader's fingerprint holds
    # what the prepared shards contain, so a corpus prepared anew from other sources is
    # refused
    resume_mutable=frozenset({"data.mix", "data.cache_dir"}),
    moved_hint=(
        "on --resume the run in {run} reads the --corpus folders it was saved with, which "
        "cannot change on resume: put the folder back at that path"
    ),
    derived={
        "model.vocab_size": (
            "the tokenizer's: data.tokenizer, or data.vocab for a BPE trained on the corpus"
        )
    },
    description=__doc__.split("\n")[0],
)


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments.codebert``: the shared experiment CLI."""
    return cli.main(EXPERIMENT, argv)
