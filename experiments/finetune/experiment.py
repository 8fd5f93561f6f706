"""Fine-tune a Hugging Face sequence classifier with CoMERA, or dense.

    python -m experiments.finetune --preset smoke                   # CPU, minutes: a 2-layer
                                                                    # BERT from a config on the
                                                                    # generated NLI task
    python -m experiments.finetune --preset smoke --dense           # the dense baseline
    python -m experiments.finetune --model ./bert-base-uncased --tokenizer ./bert-base-uncased \\
        --train-file train.jsonl --eval-file dev=dev.jsonl --target query,key,value,dense --rank 16

``--model`` is a local folder (or a hub name where the hub is reachable) holding a
``transformers`` model; without it the preset's small BERT is built from a config. The
model's linear layers named by ``--target`` (globs, PEFT-style; ``--exclude`` too) are
replaced by TT layers (:func:`comera.tensorize_`, TT-SVD of the weights by default) and
the shared trainer adapts their ranks (:class:`comera.train.ModuleTask`). Data and its
flags are MNLI's (:mod:`experiments.mnli.data`: sentence-pair classification from local
files, the hub or the generated task). The command line is the shared one of
:mod:`experiments.cli` (presets, ``--set``, ``--config``, plans, resume, wandb).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import comera as C
from comera.errors import ConfigError, MissingFileError, UserError, first_line
from comera.tensorize import INITS
from comera.train import TrainConfig
from comera.train.module_task import ModuleTask
from experiments import cli
from experiments.hub import hub_unreachable, offline_tip, quiet_hub
from experiments.mnli import experiment as mnli
from experiments.mnli.batches import BatchIterator
from experiments.mnli.data import (
    DEFAULT_TOKENIZER,
    GENERATED,
    LABEL_NAMES,
    HubUnreachableError,
    MNLIData,
    MNLIDataConfig,
    load_mnli,
)
from experiments.notes import note

__all__ = [
    "EXPERIMENT",
    "ModelConfig",
    "Preset",
    "architecture",
    "build",
    "check_fits",
    "load_model",
    "main",
    "nli_label_order",
    "preset",
]


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The model and how it is tensorized.

    ``path``: a local folder (or hub name) of a ``transformers`` model, loaded with a
    sequence-classification head of ``num_labels``; None builds a BERT of ``layers`` x
    ``hidden`` (``heads``, ``ffn``, ``dropout``, init std ``init_std``) from a config, for
    the data's tokenizer (the defaults: MNLI's smoke encoder, which learns the generated
    task: 16 small heads, std 0.1).
    ``target`` / ``exclude``: globs over module names (:class:`comera.TensorizeConfig`),
    ``rank`` (``embedding_rank`` for embedding tables), ``cores`` and ``embedding_cores``,
    ``init`` and ``min_compression`` are passed to it. ``init="auto"``: TT-SVD of a loaded
    model's weights (``svd``), a variance-matched draw (``random``) for one built from a
    config: a random matrix has a flat spectrum, so truncating it keeps little of it (the
    smoke model built so never leaves the 2/3 cue baseline; drawn at random it learns)."""

    path: str | None = None
    num_labels: int = 3
    layers: int = 2
    hidden: int = 64
    heads: int = 16
    ffn: int = 128
    dropout: float = 0.0
    init_std: float = 0.1
    target: tuple[str, ...] = ("query", "key", "value", "dense", "word_embeddings")
    exclude: tuple[str, ...] = ()
    rank: int = 8
    cores: int = 2
    embedding_cores: int = 2
    embedding_rank: int = 16
    init: str = "auto"
    min_compression: float = 1.0

    def __post_init__(self) -> None:
        if self.init not in ("auto", *INITS):
            raise ConfigError(f"model.init={self.init!r}; choose auto or one of {INITS}")
        # the sizes (the built BERT's only without model.path), before hidden % heads
        sizes = ("layers", "hidden", "heads", "ffn") if self.path is None else ()
        sizes += ("rank", "embedding_rank", "cores", "embedding_cores")
        small = [(k, getattr(self, k)) for k in sizes if getattr(self, k) < 1]
        if small:
            key, value = small[0]
            flag = " (--rank)" if key == "rank" else ""
            raise ConfigError(f"model.{key}={value}{flag} must be >= 1")
        if self.embedding_cores < 2:  # a TTM of one core is the table: every one stayed dense
            raise ConfigError(
                f"model.embedding_cores={self.embedding_cores} must be >= 2 (a TTM table of "
                "one core is the dense table); to keep embeddings dense, leave them out of "
                "model.target"
            )
        if self.path is None:  # the BERT built from a config
            if self.hidden % self.heads:
                raise ConfigError(
                    f"model.hidden={self.hidden} is not divisible by model.heads={self.heads}"
                )
            if not 0 < self.init_std < math.inf:
                raise ConfigError(f"model.init_std={self.init_std} must be finite and > 0")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.num_labels < 2:  # cross-entropy over one logit is 0: nothing would train
            raise ConfigError(f"model.num_labels={self.num_labels} must be >= 2")
        if not self.target:
            raise ConfigError("model.target: give at least one module glob (--target)")
        if not 0 <= self.min_compression < math.inf:  # NaN passed a "< 0" check
            raise ConfigError(
                f"model.min_compression={self.min_compression} must be finite and >= 0"
            )
        if self.path is not None:  # the saved model's own: a value here would be dropped
            built = [k for k in _BUILT if getattr(self, k) != _BUILT[k]]
            if built:
                raise ConfigError(
                    f"model.{built[0]}={getattr(self, built[0])} shapes the BERT built from a "
                    f"config, but --model {self.path} is loaded as saved; drop "
                    f"{', '.join('model.' + k for k in built)} (or train the built model)"
                )

    def tensorize(self) -> C.TensorizeConfig:
        return C.TensorizeConfig(
            target_modules=self.target, exclude=self.exclude, rank=self.rank,
            embedding_rank=self.embedding_rank,  # by kind: GPT-2's wte is a table too
            cores=self.cores, embedding_cores=self.embedding_cores,
            init=self.init if self.init != "auto" else ("svd" if self.path else "random"),
            min_compression=self.min_compression,
        )  # fmt: skip


# the built BERT's settings and their defaults: a loaded model (model.path) has its own
_BUILT = {f.name: f.default for f in dataclasses.fields(ModelConfig)
          if f.name in ("layers", "hidden", "heads", "ffn", "dropout", "init_std")}  # fmt: skip


@dataclass(kw_only=True, slots=True)
class Preset:
    """A complete experiment; ``dense`` fine-tunes the model as it is (the baseline)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: MNLIDataConfig
    train: TrainConfig
    plans: C.LayerPlans = field(default_factory=C.LayerPlans)
    dense: bool = False
    batch_size: int = 32
    eval_batch_size: int = 128

    def __post_init__(self) -> None:
        cli.check_batch_sizes(self.batch_size, self.eval_batch_size)


def preset(name: str) -> Preset:
    """``smoke``: MNLI's smoke schedule and generated task, on a 2-layer BERT built from a
    config with every attention and feed-forward linear, the pooler and the word embedding
    tensorized (the shapes and ranks of MNLI's smoke model; CPU, about 3 minutes)."""
    if name != "smoke":
        raise ConfigError(f"unknown preset {name!r}; choose 'smoke'")
    base = mnli.preset("smoke")
    # MNLI's smoke schedule, but the gate pull starts at 500 (this model has learned the
    # task by then) and the late stage cuts to 0.75 of the early stage's size
    comera = dataclasses.replace(base.train.comera, reg_start_step=500, size_ratio=0.75)
    train = dataclasses.replace(base.train, run_dir="runs/finetune-smoke",
                                run_name="finetune-smoke", comera=comera)  # fmt: skip
    return Preset(data=base.data, batch_size=base.batch_size, train=train)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "experiments.finetune needs transformers: pip install 'comera-framework[hf]'"
        ) from None
    return transformers


def load_model(cfg: ModelConfig, data: MNLIData, *, quiet: bool = False,
               notes: list[str] | None = None) -> nn.Module:  # fmt: skip
    """The classifier: ``cfg.path``'s (local folder, or hub name) or a BERT from a config.

    A saved model that cannot be loaded with a head of ``cfg.num_labels`` labels is a
    ``ConfigError`` naming ``--model``. What it says of the model (the weights it lacks,
    a fresh head; a pad id it changed) goes to ``notes`` where given (the command prints
    them once nothing can refuse the run), else on stderr unless ``quiet``."""
    tf = _transformers()
    if cfg.path is not None:
        said: list[str] = []
        model, missing = _load_pretrained(tf, cfg, labels=data.max_label() + 1)
        if missing:
            said.append(f"--model {cfg.path}: newly initialized (not in its checkpoint): "
                        f"{', '.join(missing)}")  # fmt: skip
        said += _take_data_pad_id(model, cfg, data)
        if notes is not None:
            notes += said
        elif not quiet:
            for line in said:
                note(line)
        return model
    bert = tf.BertConfig(
        vocab_size=data.vocab_size, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, intermediate_size=cfg.ffn,
        hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout,
        max_position_embeddings=max(data.train.input_ids.shape[1], 8), type_vocab_size=2,
        pad_token_id=data.pad_id, num_labels=cfg.num_labels, initializer_range=cfg.init_std,
    )  # fmt: skip
    return tf.BertForSequenceClassification(bert)


def _take_data_pad_id(model: nn.Module, cfg: ModelConfig, data: MNLIData) -> list[str]:
    """Give a loaded model's config the pad id its rows are padded with; returns what to
    say of it. A decoder-only classifier (GPT-2, Llama) finds each row's last token by
    ``config.pad_token_id``: its configs often have none, and one saved with another id
    than the tokenizer pads with pooled a pad position without a word. A model that numbers
    its positions after its own pad id (RoBERTa's family: a ``position_embeddings`` table
    with that ``padding_idx``) reads its text tokens of that id as pads: refused where the
    data's text holds such a token, else harmless (the data's pads are masked)."""
    config = getattr(model, "config", None)
    saved = getattr(config, "pad_token_id", None) if config is not None else None
    if config is None or saved == data.pad_id:
        return []
    said = []
    if saved is not None:
        numbered = any(
            name.rpartition(".")[2] == "position_embeddings"
            and getattr(module, "padding_idx", None) == saved
            for name, module in model.named_modules()
        )
        in_text = numbered and any(
            bool(((s.input_ids == saved) & (s.attention_mask == 1)).any()) for s in data.splits()
        )
        if in_text:
            raise ConfigError(
                f"--model {cfg.path} numbers its positions after pad id {saved} "
                f"(config.pad_token_id), which --tokenizer {data.tokenizer_path_or_name} "
                f"gives as a text token (it pads with id {data.pad_id}); give --tokenizer "
                "the tokenizer --model was trained with"
            )
        why = (f"its positions stay numbered after {saved}, which the data's text never holds"
               if numbered else
               "a decoder-only classifier finds each row's last token by it")  # fmt: skip
        said.append(f"--model {cfg.path}: its config's pad_token_id {saved} is not the id "
                    f"--tokenizer pads with ({data.pad_id}); config.pad_token_id is set to "
                    f"{data.pad_id} ({why})")  # fmt: skip
    config.pad_token_id = data.pad_id  # as a built BERT gets the data's
    return said


def _check_local_path(path: str) -> None:
    """Refuse ``--model`` paths that are plainly local and wrong before transformers tries
    them (or the hub, for tens of seconds): a file, not the folder; a folder that does not
    exist where its parent does (``models/bert_typo``), or a path written as local."""
    p = Path(path).expanduser()
    if p.is_file():
        raise ConfigError(
            f"--model {path}: that is a file; give the folder that holds config.json and "
            "the weights"
        )
    local = path.startswith((".", "/", "~")) or (
        len(p.parts) > 1 and Path(p.parts[0]).expanduser().is_dir()
    )
    if local and not p.exists():
        raise MissingFileError(f"--model {path}: no such folder")
    if p.is_dir() and not (p / "config.json").is_file():  # blamed on num_labels otherwise
        raise ConfigError(
            f"--model {path}: the folder holds no config.json; give a folder a transformers "
            "model was saved to (save_pretrained)"
        )


def _load_pretrained(tf: Any, cfg: ModelConfig, labels: int = 0) -> tuple[nn.Module, list[str]]:
    """``cfg.path``'s classifier with a ``cfg.num_labels`` head and the names of the
    weights its checkpoint lacks. transformers' own load report and progress bar are
    silenced (a failure becomes one line here); weights whose saved shape differs (a head
    trained for another label count) are refused, naming ``model.num_labels`` (and the
    saved head's count when the data's ``labels`` fit it)."""
    _check_local_path(cfg.path)  # type: ignore[arg-type]
    log = tf.utils.logging
    verbosity, bar = log.get_verbosity(), log.is_progress_bar_enabled()
    log.set_verbosity_error()
    log.disable_progress_bar()
    try:
        with quiet_hub():
            model, info = tf.AutoModelForSequenceClassification.from_pretrained(
                cfg.path, num_labels=cfg.num_labels, ignore_mismatched_sizes=True,
                output_loading_info=True,
            )  # fmt: skip
    except OSError as e:  # no such folder, no weights in it, or an unreachable hub
        tip = ""
        if hub_unreachable(e):
            tip = "; pass a local folder" + (f" ({t})" if (t := offline_tip()) else "")
        raise ConfigError(
            f"--model {cfg.path}: cannot load a model there ({first_line(e)}){tip}"
        ) from None
    except (RuntimeError, ValueError) as e:  # an unknown architecture, weights that do not fit
        if "Unrecognized model" in str(e):  # no model_type: not a saved model's config.json
            raise ConfigError(
                f"--model {cfg.path}: not a folder a transformers model was saved to "
                f"({first_line(e)})"
            ) from None
        if "does not recognize this architecture" in str(e):  # not about the labels
            raise ConfigError(
                f"--model {cfg.path}: this transformers ({tf.__version__}) does not "
                f"know the saved model's architecture ({first_line(e)})"
            ) from None
        raise ConfigError(
            f"--model {cfg.path}: cannot load it as a sequence classifier with "
            f"model.num_labels={cfg.num_labels} labels ({first_line(e)})"
        ) from None
    except Exception as e:  # noqa: BLE001 - damaged weights (safetensors', pickle's errors)
        raise ConfigError(
            f"--model {cfg.path}: cannot read the model saved there ({type(e).__name__}: "
            f"{first_line(e)})"
        ) from None
    finally:
        log.set_verbosity(verbosity)
        if bar:
            log.enable_progress_bar()
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        shapes = "; ".join(
            f"{key} is {tuple(saved)} there, {tuple(wanted)} here"
            for key, saved, wanted in mismatched
        )
        # the saved head's label count: the first size of what differs (weight and bias)
        saved_counts = {int(saved[0]) for _, saved, _ in mismatched if len(saved)}
        saved_n = saved_counts.pop() if len(saved_counts) == 1 else 0
        keep = ""
        if 2 <= saved_n and labels <= saved_n:  # a resume may not change num_labels
            keep = (f"--set model.num_labels={saved_n} to keep the saved head (a new run; "
                    "a resume keeps the run's own), or ")  # fmt: skip
        raise ConfigError(
            f"--model {cfg.path}: its saved weights do not fit model.num_labels="
            f"{cfg.num_labels} ({shapes}); {keep}give a model whose head has "
            f"{cfg.num_labels} labels, or one saved without a classification head (a fresh "
            "head is made)"
        )
    tt_keys = [k for k in info.get("unexpected_keys") or () if _TT_KEY.search(k)]
    if tt_keys:  # loaded as dense, the cores would be dropped and fresh weights compressed
        raise ConfigError(
            f"--model {cfg.path}: its checkpoint holds TT cores ({tt_keys[0]}, ...), saved "
            "from a tensorized model; --model loads a dense one (resume a run with --resume, "
            "or load those weights into a model tensorized the same way)"
        )
    # a model saved in half precision loads as such (transformers' dtype="auto"): Adam
    # on bf16 weights drops every update below their resolution (most of a LayerNorm's
    # stayed 1.0), so those train in float32 (``--bf16`` is autocast on top); other
    # dtypes (a float64 model, integer buffers) stay as saved
    half = (torch.float16, torch.bfloat16)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:  # in place: ties stay tied
            if t.dtype in half:
                t.data = t.data.float()
    return model, sorted(info.get("missing_keys") or ())


# a TT or TTM layer's tensors in a state dict (comera.nn's TTLinear and TTMEmbedding)
_TT_KEY = re.compile(r"(^|\.)(cores|gates)\.\d+$")


def check_fits(model: nn.Module, cfg: ModelConfig, data: MNLIData) -> None:
    """Refuse data the model cannot read, before any training: token ids (or token type
    ids) past its embeddings' sizes, or labels past its head's ``num_labels``."""
    splits = data.splits()
    source = f"--model {cfg.path}" if cfg.path is not None else "the model"
    config = getattr(model, "config", None)
    checks = [("input_ids", "vocab_size", "token ids")]
    if takes_token_types(model):  # else they are never given (DeBERTa-v3's size 0)
        checks.append(("token_type_ids", "type_vocab_size", "token type ids"))
    for field_, limit_name, what in checks:
        limit = getattr(config, limit_name, None)
        top = max((int(getattr(s, field_).max()) for s in splits), default=-1)
        if isinstance(limit, int) and top >= limit:
            raise ConfigError(
                f"--tokenizer {data.tokenizer_path_or_name} gives {what} up to {top}, past "
                f"what {source} reads ({limit_name} {limit}: ids 0..{limit - 1}); give "
                "--tokenizer the tokenizer that --model was trained with"
            )
    positions = _positions(model)
    longest = max((int(s.input_ids.shape[1]) for s in splits), default=0)
    if positions is not None and longest > positions:
        raise ConfigError(
            f"the data's rows are {longest} tokens long but {source} has {positions} "
            f"positions; lower data.max_length (--set data.max_length={positions}) or give "
            "--model one with more"
        )
    data.check_label_count(cfg.num_labels)


def _try_one_row(model: nn.Module, data: MNLIData, types: bool, device: torch.device,
                 cfg: ModelConfig) -> None:  # fmt: skip
    """Run the model, as loaded (before ``tensorize_``: a failure here is the model's or the
    data's, not the project's), on the first two training rows before the run starts: a
    model whose own input checks refuse the data (T5's classifier wants an
    end-of-sequence token the tokenizer does not give) raises a ``ValueError``, one whose
    config lacks what its forward reads (a T5 saved without ``decoder_start_token_id``)
    an ``AttributeError``; each becomes a one-line error naming ``--model`` and
    ``--tokenizer`` instead of a traceback at the first step. The project's own errors, and
    others (a kernel only another device has, a bug), pass through as they are."""
    source = f"--model {cfg.path}" if cfg.path is not None else "the model"
    rows = torch.arange(min(2, len(data.train)))  # two: some checks fire only past one row
    batch = {k: v.to(device) for k, v in data.train.batch(rows).items()}
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _logits(model, batch, types)
    except UserError:
        raise
    except ValueError as e:
        raise ConfigError(
            f"{source} refused the first training rows ({first_line(e)}); often --tokenizer is "
            "not the tokenizer --model was trained with"
        ) from None
    except AttributeError as e:  # what its forward reads from its config; other errors
        # (a kernel this device lacks, a bug) keep their traceback
        raise ConfigError(
            f"{source} cannot run on the first training rows ({type(e).__name__}: "
            f"{first_line(e)}); check its config.json, and that --tokenizer is the tokenizer "
            "it was trained with"
        ) from None
    finally:
        model.train(training)


def _positions(model: nn.Module) -> int | None:
    """How many token positions a model reads, or None where nothing bounds it. The
    config's count (``max_position_embeddings``, ``n_positions``, ``max_seq_len``), lowered
    to what a ``position_embeddings`` table holds: its rows, fewer ``padding_idx + 1`` where
    positions are numbered after the pad (RoBERTa, I-BERT, LUKE...). None for relative positions
    (DeBERTa-v3's ``position_biased_input=False``, XLNet's -1) and for rotary ones with no
    table (Llama); an absolute table counts even where the config names a rope (ESM-1b)."""
    config = getattr(model, "config", None)
    counts = ("max_position_embeddings", "n_positions", "max_seq_len")  # BERT, GPT-2, MPT
    n = next((getattr(config, k) for k in counts if getattr(config, k, None)), None)
    n = n if isinstance(n, int) and n > 0 else None
    kind = getattr(config, "position_embedding_type", "absolute")
    if getattr(config, "position_biased_input", True) is False or kind not in ("absolute", None):
        return None  # relative positions, though a table may be built
    rows = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if name.rpartition(".")[2] == "position_embeddings" and isinstance(weight, torch.Tensor):
            pad = getattr(module, "padding_idx", None)
            rows.append(weight.shape[0] - (pad + 1 if isinstance(pad, int) else 0))
    if rows:
        return min([*rows, *([n] if n is not None else [])])
    if any(hasattr(config, k) for k in ("rope_theta", "rope_scaling", "rope_parameters")):
        return None  # rotary positions: no table to run past
    return n


class _Eval:
    """Accuracy and loss on every eval split, each rank on its contiguous share."""

    def __init__(self, data: MNLIData, batch_size: int, device: torch.device,
                 types: bool = True) -> None:  # fmt: skip
        self.data, self.batch_size, self.device, self.types = data, batch_size, device, types

    def __call__(
        self, call: Any, *, rank: int = 0, world: int = 1
    ) -> dict[str, tuple[float, float]]:
        out = {}
        with torch.no_grad():
            for name, split in self.data.eval.items():
                correct, loss_sum = 0.0, 0.0
                lo, hi = rank * len(split) // world, (rank + 1) * len(split) // world
                for start in range(lo, hi, self.batch_size):
                    idx = torch.arange(start, min(start + self.batch_size, hi))
                    batch = {k: v.to(self.device) for k, v in split.batch(idx).items()}
                    logits = _logits(call, batch, self.types)
                    loss_sum += float(F.cross_entropy(logits, batch["labels"], reduction="sum"))
                    correct += float((logits.argmax(-1) == batch["labels"]).sum())
                # (sum, count): an empty split is NaN, not a perfect 0 loss
                out[f"{name}/accuracy"] = (correct, float(hi - lo))
                out[f"{name}/loss"] = (loss_sum, float(hi - lo))
        return out


def takes_token_types(model: nn.Module) -> bool:
    """Whether the model has a token-type table (BERT's family: ``type_vocab_size`` > 0)
    to read the second sentence's type ids with. GPT-2 would add them through its word
    table, and Hugging Face never gives them to it, nor to models without the table."""
    return (getattr(getattr(model, "config", None), "type_vocab_size", 0) or 0) > 0


def _logits(call: Any, batch: dict, types: bool = True) -> torch.Tensor:
    kw = {"token_type_ids": batch["token_type_ids"]} if types else {}
    out = call(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kw)
    return out.logits.float()


def nli_label_order(config: object) -> list[int] | None:
    """The ids a loaded model's ``id2label`` gives entailment, neutral and contradiction
    (any case), where it names exactly those three and numbers them otherwise than the
    data does (0, 1, 2: :data:`experiments.mnli.data.LABEL_NAMES`); else None. A head
    trained on MNLI elsewhere (roberta-large-mnli: contradiction=0) scored "entailment"
    as its "contradiction", without a word: a note says so (integer labels may already be
    in the head's order, so they are not remapped)."""
    given = getattr(config, "id2label", None)  # what label2id is derived from
    if not isinstance(given, dict):
        return None
    try:
        named = {str(v).lower(): int(k) for k, v in given.items()}
    except (TypeError, ValueError):
        return None
    if set(named) != set(LABEL_NAMES) or len(given) != len(LABEL_NAMES):
        return None
    order = [named[n] for n in LABEL_NAMES]
    return None if order == list(range(len(LABEL_NAMES))) else order


def build(p: Preset, *, rank: int = 0, world: int = 1) -> tuple:
    """Data, the (tensorized) model and its task; returns the CLI's five-tuple."""
    own = (
        p.model.path is not None and (Path(p.model.path).expanduser() / "tokenizer.json").is_file()
    )
    own = own and p.data.tokenizer == DEFAULT_TOKENIZER and p.data.dataset != GENERATED
    try:
        data = load_mnli(p.data)
    except HubUnreachableError as e:  # offline: bert-base-uncased from the hub
        if not (own and f"tokenizer {DEFAULT_TOKENIZER!r}" in str(e)):  # the data's: not it
            raise
        raise type(e)(f"{str(e).rstrip('.')} (--model {p.model.path} holds its own "
                      f"tokenizer.json: pass --tokenizer {p.model.path})") from None  # fmt: skip
    torch.manual_seed(p.train.seed)
    notes: list[str] = []  # printed by the command once nothing can refuse the run
    if own:  # the rows tokenized for another model than the one loaded
        notes.append(f"--model {p.model.path} holds a tokenizer.json, but the rows are "
                     f"tokenized with {DEFAULT_TOKENIZER} (the default): pass --tokenizer "
                     f"{p.model.path} to use the model's own")  # fmt: skip
    model = load_model(p.model, data, notes=notes)
    order = nli_label_order(getattr(model, "config", None))
    if order is not None:  # an MNLI-trained head (contradiction=0) beside the data's ids
        head = ", ".join(f"{n}={i}" for n, i in sorted(zip(LABEL_NAMES, order, strict=True),
                                                        key=lambda x: x[1]))  # fmt: skip
        ours = ", ".join(f"{n}={i}" for i, n in enumerate(LABEL_NAMES))
        notes.append(
            f"--model {p.model.path}: its head numbers the labels {head} (its id2label), where "
            f"the data's read as {ours} (words always; integer labels as given): the saved "
            "head starts out misreading them and relearns them, unless a local file gives "
            "integer labels in the head's order"
        )
    check_fits(model, p.model, data)
    types = takes_token_types(model)
    _try_one_row(model, data, types, next(model.parameters()).device, p.model)
    dense_size = sum(t.numel() for t in model.parameters())
    summary = None
    if not p.dense:
        try:
            with warnings.catch_warnings():  # said below as the one-line error it is
                warnings.filterwarnings("ignore", "tensorize_: every module the globs chose")
                summary = C.tensorize_(model, p.model.tensorize())
        except ConfigError as e:
            raise ConfigError(_name_glob_flag(str(e), p.model)) from None
        tt = (C.TTLinear, C.TTMEmbedding)
        if p.train.comera.enabled and not any(isinstance(m, tt) for m in model.modules()):
            why = "; ".join(f"{r.name}: {r.skipped}" for r in summary.layers[:3] if r.skipped)
            # every match left dense by its size: the rank, not the globs, is what to change
            sized = [(r.skipped or "").startswith("skipped: a rank-") for r in summary.layers]
            by_rank = (
                "lower --rank (model.embedding_rank for embedding tables) or model.min_compression"
            )
            globs = "name modules to compress with --target and --exclude"
            way = (by_rank if sized and all(sized) else
                   f"{by_rank}, or {globs}" if any(sized) else globs)  # fmt: skip
            raise ConfigError(
                f"no module was tensorized (--target {','.join(p.model.target)}"
                + (f", --exclude {','.join(p.model.exclude)}" if p.model.exclude else "")
                + (f"; {why}" if why else "")
                + f"), so CoMERA has no ranks to adapt; {way}, or train --dense"
            )
        for name, module in model.named_modules():
            if isinstance(module, C.TTLinear):
                module.plan = p.plans.for_layer(name)
            elif isinstance(module, C.TTMEmbedding):  # the lookup --embedding-impl names
                module.impl = p.plans.embedding_impl
    device = torch.device(p.train.device)
    model.to(device)

    def loss(call: Any, batch: dict) -> tuple:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = _logits(call, batch, types)
        acc = (logits.argmax(-1) == batch["labels"]).float().mean()
        return (F.cross_entropy(logits, batch["labels"], reduction="sum"), len(batch["labels"]),
                {"accuracy": acc.detach()})  # fmt: skip

    it = BatchIterator(data.train, p.batch_size, seed=p.train.seed, rank=rank, world_size=world)
    if summary is not None:
        linears = [n for n, m in model.named_modules() if isinstance(m, C.TTLinear)]
        lookups = [n for n, m in model.named_modules() if isinstance(m, C.TTMEmbedding)]
        if linears or lookups:  # as the command checks them once build returns (a model
            # left all dense has no layer for a rule to name): here too, for build's callers
            p.plans.check_layers(linears, lookups)
    task = ModuleTask(model, loss, it, evaluate=_Eval(data, p.eval_batch_size, device, types),
                      eval_data_id=data.eval_identity())  # fmt: skip
    info = {
        "dense_params": dense_size,
        "vocab": data.vocab_size,
        "train_examples": len(data.train),
        "tensorized": [
            {
                "layer": r.name,
                "kind": r.kind,
                "modes": r.modes,
                "ranks": list(r.ranks),
                # a layer left dense keeps its parameters
                "params": [r.params_before, r.params_before if r.skipped else r.params_after],
                "note": r.skipped or r.describe(),
            }
            for r in (summary.layers if summary is not None else [])
        ],  # fmt: skip
        # what the loaded model is, beyond its tensors' shapes: a resume from a moved
        # folder must find it (a changed head count or activation trained on silently)
        **({"model_config": architecture(model)} if p.model.path is not None else {}),
        # each TT layer's own sizes, by its params path: a train holds the padded ones, and
        # a report's layer table counts those without them (comera.summarize)
        "dense_shapes": {k: list(v) for k, v in task.dense_shapes().items()},
    }
    if summary is not None:  # the command prints it once nothing can refuse the run
        info["layer_table"] = str(summary)
    info["notes"] = [*notes, *[n for n in [data.unevaluated_note()] if n]]  # not stored
    return task, task.params(), task.state(), dense_size, info


# transformers config keys that say nothing of the function a loaded model computes (an
# initializer's scale: its weights are loaded; feed-forward chunking: the same values)
_NOT_ARCHITECTURE = frozenset({
    "architectures", "transformers_version", "dtype", "torch_dtype", "problem_type",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "id2label",
    "label2id", "torchscript", "initializer_range", "initializer_factor",
    "chunk_size_feed_forward",
})  # fmt: skip


def architecture(model: nn.Module) -> dict[str, Any]:
    """A loaded model's config as a dict, without what does not change what it computes
    (names, versions, dtype, output switches, label names, private ``_`` keys)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return {}
    return {k: v for k, v in sorted(config.to_dict().items())
            if not k.startswith("_") and k not in _NOT_ARCHITECTURE}  # fmt: skip


_DEFAULT_TARGET = next(f.default for f in dataclasses.fields(ModelConfig) if f.name == "target")


def _name_glob_flag(message: str, model: ModelConfig) -> str:
    """``tensorize_``'s error about a glob, with the flag that gave it (and, for the
    default ``--target``, that the user never typed it: its names are BERT's)."""
    for key in ("target", "exclude"):
        if message.startswith(f"tensorize_: {key} glob"):
            given = getattr(model, key)
            default = f" (its default {','.join(given)}: BERT's names)" if (
                key == "target" and given == _DEFAULT_TARGET) else ""  # fmt: skip
            return f"--{key}{default}: {message.removeprefix('tensorize_: ')}"
    if message.startswith("tensorize_: every module the target globs"):
        return f"--target, --exclude: {message.removeprefix('tensorize_: ')}"
    return message


def _flags(ap: argparse.ArgumentParser) -> None:
    mnli.data_flags(ap)  # the same data flags as MNLI's
    ap.add_argument("--model", dest="model_path",
                    help="a local folder (or hub name) of a transformers model")  # fmt: skip
    ap.add_argument("--target", help="module globs to tensorize, comma-separated")
    ap.add_argument("--exclude", help="module globs never tensorized, comma-separated")
    ap.add_argument("--rank", type=int, help="TT rank of every tensorized linear layer "
                    "(embedding tables: model.embedding_rank)")  # fmt: skip


def _model_run_defaults(args: argparse.Namespace, p: Preset) -> Preset:
    """A --model run's folder and name after its model folder (``runs/finetune-NAME``,
    ``-dense`` for the dense one): the preset's are the smoke runs', which the smoke report
    reads. A --config file, --run-dir, --wandb-name or --set still decides."""
    path = args.model_path or next(  # or model.path from a --set or the --config file
        (v.strip() for k, _, v in (i.partition("=") for i in reversed(args.sets))
         if k.strip() == "model.path"), None)  # fmt: skip
    if path is None and args.config:
        path = next((v for k, v, _ in reversed(cli.config_file_items(args.config, p))
                     if k == "model.path"), None)  # fmt: skip
    if not isinstance(path, str) or not path:
        return p
    name = Path(path.rstrip("/\\")).name or "model"
    dense = "-dense" if args.dense else ""
    train = dataclasses.replace(p.train, run_dir=f"runs/finetune-{name}{dense}",
                                run_name=f"finetune-{name}")  # fmt: skip
    return dataclasses.replace(p, train=train)


def _flag_overrides(args: argparse.Namespace) -> list[tuple[str, Any]]:
    out = mnli.data_flag_overrides(args)
    if args.model_path:
        out.append(("model.path", args.model_path))
    for flag in ("target", "exclude"):
        value = getattr(args, flag)
        if value is not None:
            out.append((f"model.{flag}", tuple(v.strip() for v in value.split(",") if v.strip())))
    if args.rank is not None:
        out.append(("model.rank", args.rank))
    return out


def _check_given(p: Preset, given: list[tuple[str, str]]) -> None:
    """Refuse a built-model setting given beside ``--model`` even at its default value
    (``ModelConfig`` refuses only values that differ from it): the loaded model keeps its
    own, and ``config.json`` would record the one given."""
    if p.model.path is None:
        return
    for key, how in given:
        if key.startswith("model.") and key[len("model.") :] in _BUILT:
            raise ConfigError(
                f"{how}: {key} shapes the BERT built from a config, but --model "
                f"{p.model.path} is loaded as saved (its own config decides it); drop {key}"
            )


EXPERIMENT = cli.Experiment(
    name="finetune",
    config_type=Preset,
    build=lambda p, rank, world: build(p, rank=rank, world=world),
    presets={"smoke": lambda: preset("smoke")},
    flags=_flags,
    flag_overrides=_flag_overrides,
    # a moved model folder or tokenizer: the checkpoint refuses another architecture or
    # other frozen weights, the examples' digest another tokenization
    resume_mutable=frozenset({"model.path", "data.tokenizer"}),
    resume_same={"model_config": "give --model a folder of the model the run was saved with"},
    preset_defaults=_model_run_defaults,
    check_given=_check_given,
    moved_hint=(
        "the run in {run} was saved with it: a moved model folder or tokenizer resumes with "
        "--resume {run} --model NEW_FOLDER or --tokenizer NEW_PATH (another architecture, "
        "other frozen weights or another tokenization is refused), a data file must be put "
        "back where it was (data files cannot change on resume)"
    ),
    description=__doc__.split("\n")[0],
)


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments.finetune``: the shared experiment CLI."""
    return cli.main(EXPERIMENT, argv)


if __name__ == "__main__":
    raise SystemExit(main())
