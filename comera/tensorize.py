"""Turn an existing PyTorch (or Hugging Face) model into a CoMERA one, in place.

``tensorize_(model, TensorizeConfig(target_modules=("*.query", "*.value")))`` replaces
every ``nn.Linear``, ``nn.Embedding`` and Hugging Face ``Conv1D`` (GPT-2's projections)
whose qualified name matches a target glob (and no ``exclude`` glob) by the TT / TTM
adapters of :mod:`comera.nn`, as PEFT's ``get_peft_model`` and torchao's ``quantize_``
rewrite the modules they match: the model then trains as before, with every replaced
weight held as gated cores. ``init="svd"`` compresses the existing weight by TT-SVD
(exact when the ranks do not bind), ``init="random"`` draws at the replaced weight's
standard deviation.

Modes come from :func:`comera.spec.propose_modes` (balanced; a size with no balanced
split is zero-padded: the input with zeros, the extra outputs dropped; the summary says
what was padded). A layer whose train would hold as many parameters as the dense weight
is left dense and listed as skipped. A linear layer whose weight is an embedding's (a tied
decoder, GPT-2's ``lm_head``) stays tied: it becomes a :class:`TiedDecoder` that reads
the TTM embedding's table.
"""

from __future__ import annotations

import fnmatch
import inspect
import math
import numbers
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

from comera import tensor_train
from comera.accounting import train_size
from comera.errors import ConfigError
from comera.layers import ttm_logits
from comera.nn import NoDenseWeight, TTLinear, TTMEmbedding
from comera.spec import TTLinearSpec, TTMEmbeddingSpec, cap_ranks, propose_modes
from comera.tensor_train import Params, State

__all__ = ["LayerReport", "TensorizeConfig", "TensorizeSummary", "TiedDecoder", "tensorize_"]

INITS = ("svd", "random")


@dataclass(frozen=True, kw_only=True)
class TensorizeConfig:
    """Which modules to replace and how.

    ``target_modules``: globs over qualified module names (``fnmatch``); a glob also
    matches a name's last parts, as PEFT's ``target_modules`` do (``"query"`` and
    ``"self.query"`` match ``encoder.layer.0.attention.self.query``). ``exclude``: globs
    never replaced.
    ``rank``: every bond's rank (capped by what a bond can carry); ``embedding_rank``: an
    embedding table's instead, when given; ``rank_for``: per-glob ``(glob, rank)``
    overrides of both, later rules winning. ``compression``: instead of a fixed
    rank, the largest rank (up to ``rank``) at which each layer is at least this many times
    smaller than its dense weight. ``cores``: modes per side of a linear map (``2 * cores``
    TT cores); ``embedding_cores``: TTM cores of an embedding. ``min_compression``: a
    layer that would be less than this many times smaller stays dense (0: replace every
    match, e.g. at full rank to check that TT-SVD reproduces the model)."""

    target_modules: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    rank: int = 16
    embedding_rank: int | None = None
    rank_for: tuple[tuple[str, int], ...] = ()
    compression: float | None = None
    cores: int = 3
    embedding_cores: int = 4
    init: str = "svd"
    min_compression: float = 1.0

    def __post_init__(self) -> None:
        for key in ("target_modules", "exclude"):  # one glob, or a list of them
            object.__setattr__(self, key, _globs(key, getattr(self, key)))
        object.__setattr__(self, "rank_for", _rank_rules(self.rank_for))
        if not self.target_modules:
            raise ConfigError("TensorizeConfig.target_modules: give at least one glob")
        if self.init not in INITS:
            raise ConfigError(f"TensorizeConfig.init={self.init!r}; choose one of {INITS}")
        for key in ("rank", "embedding_rank", "cores", "embedding_cores"):
            value = getattr(self, key)
            if not (value is None and key == "embedding_rank") and not _is_int(value):
                raise ConfigError(f"TensorizeConfig.{key}={value!r} must be an int")
        low = [f"{key}={getattr(self, key)}" for key in ("rank", "embedding_rank")
               if getattr(self, key) is not None and getattr(self, key) < 1]  # fmt: skip
        low += [f"rank_for {glob!r}: {r}" for glob, r in self.rank_for if r < 1]
        if low:
            raise ConfigError(f"TensorizeConfig: ranks must be >= 1, got {', '.join(low)}")
        for key in ("compression", "min_compression"):
            value = getattr(self, key)
            if not (value is None and key == "compression") and not _is_real(value):
                raise ConfigError(f"TensorizeConfig.{key}={value!r} must be a number")
        if self.compression is not None and not 1 < self.compression < math.inf:
            raise ConfigError(
                f"TensorizeConfig.compression must be finite and > 1, got {self.compression}"
            )
        if not 0 <= self.min_compression < math.inf:  # NaN passed a "< 0" check
            raise ConfigError(f"TensorizeConfig.min_compression must be finite and >= 0, got "
                              f"{self.min_compression}")  # fmt: skip
        if self.cores < 1:
            raise ConfigError(f"TensorizeConfig.cores={self.cores} must be >= 1")
        if self.embedding_cores < 2:  # every table stayed dense, "no split into 2 or more"
            raise ConfigError(
                f"TensorizeConfig.embedding_cores={self.embedding_cores}: a TTM table needs "
                ">= 2 cores (one core is the dense table); to keep embeddings dense, leave "
                "them out of target_modules"
            )

    def matches(self, name: str) -> bool:
        """Whether the module at ``name`` is a target (and not excluded)."""
        return _match(name, self.target_modules) and not _match(name, self.exclude)

    def rank_of(self, name: str | Sequence[str], embedding: bool = False) -> int:
        """The rank of the module at ``name`` (an embedding table's, if ``embedding``); a
        module reached by several paths takes a rule that names any of them (the last
        rule that does wins, as for one path)."""
        names = (name,) if isinstance(name, str) else tuple(name)
        chosen = self.embedding_rank if embedding and self.embedding_rank else self.rank
        for glob, r in self.rank_for:
            if any(_match(n, (glob,)) for n in names):
                chosen = r
        return chosen


def _is_int(value: object) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """A real number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _globs(key: str, value: object) -> tuple[str, ...]:
    """``value`` as a tuple of globs: one glob as a string, or any collection of them (a set
    as PEFT's ``LoraConfig`` holds them, sorted: a set has no order)."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (set, frozenset)) and all(isinstance(g, str) for g in value):
        return tuple(sorted(value))
    if isinstance(value, (tuple, list)) and all(isinstance(g, str) for g in value):
        return tuple(value)
    raise ConfigError(f"TensorizeConfig.{key}={value!r} must be a glob or a list of globs")


def _rank_rules(value: object) -> tuple[tuple[str, int], ...]:
    """``rank_for`` as ``((glob, rank), ...)``; a dict ``{glob: rank}`` is taken in order."""
    rules = tuple(value.items()) if isinstance(value, dict) else value
    if isinstance(rules, (tuple, list)) and all(
        isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[0], str) and _is_int(r[1])
        for r in rules
    ):
        return tuple((g, int(r)) for g, r in rules)
    raise ConfigError(
        f"TensorizeConfig.rank_for={value!r} must be (glob, rank) pairs, e.g. "
        "(('*.query', 8),) or {'*.query': 8}"
    )


def _match(name: str, globs: tuple[str, ...]) -> bool:
    """Whether a glob matches the qualified ``name``, or its last parts as PEFT's
    ``target_modules`` entries do: ``"query"`` and ``"attention.self.query"`` both match
    ``encoder.layer.0.attention.self.query``."""
    last = name.rsplit(".", 1)[-1]
    return any(
        fnmatch.fnmatchcase(name, g)
        or ("." not in g and fnmatch.fnmatchcase(last, g))
        or ("." in g and fnmatch.fnmatchcase(name, "*." + g))
        for g in globs
    )


@dataclass(frozen=True, kw_only=True)
class LayerReport:
    """One matched module: what it was, what it became (or why it stayed)."""

    name: str
    kind: str  # linear, conv1d, embedding, tied decoder
    shape: tuple[int, int]  # (out, in) or (rows, dim)
    modes: str = ""
    ranks: tuple[int, ...] = ()
    params_before: int = 0
    params_after: int = 0
    padded: str = ""
    skipped: str = ""
    note: str = ""  # what the adapter does not carry over (an embedding's padding_idx)

    @property
    def compression(self) -> float:
        return self.params_before / self.params_after if self.params_after else 1.0

    def describe(self) -> str:
        """The padding and notes of a replaced layer, as the summary's note column."""
        padded = f"padded {self.padded}" if self.padded else ""
        return "; ".join(x for x in (padded, self.note) if x)


@dataclass(kw_only=True)
class TensorizeSummary:
    """What :func:`tensorize_` did, per layer; ``str()`` is a table."""

    layers: list[LayerReport] = field(default_factory=list)

    @property
    def params_before(self) -> int:
        return sum(r.params_before for r in self.layers if not r.skipped)

    @property
    def params_after(self) -> int:
        return sum(r.params_after for r in self.layers if not r.skipped)

    def __str__(self) -> str:
        rows = ["| layer | kind | shape | modes | ranks | params | compression | note |",
                "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in self.layers:
            note = r.skipped or r.describe()
            size = f"{r.params_before:,} -> {r.params_after:,}" if not r.skipped else "-"
            rows.append(
                f"| {r.name} | {r.kind} | {r.shape[0]} x {r.shape[1]} | {r.modes or '-'} | "
                f"{','.join(map(str, r.ranks)) or '-'} | {size} | "
                f"{r.compression:.1f}x | {note} |"
            )
        done = [r for r in self.layers if not r.skipped]
        if done:
            rows.append(f"\n{len(done)} layers replaced: {self.params_before:,} -> "
                        f"{self.params_after:,} parameters "
                        f"({self.params_before / max(self.params_after, 1):.1f}x)")  # fmt: skip
        return "\n".join(rows)


class PaddedTTLinear(NoDenseWeight):
    """A :class:`TTLinear` over zero-padded sizes: the input is padded with zeros to the
    train's input size and the output cut to ``out_features``."""

    def __init__(self, inner: TTLinear, in_features: int, out_features: int) -> None:
        super().__init__()
        self.inner, self.in_features, self.out_features = inner, in_features, out_features

    def weight_label(self) -> str:
        return f"{type(self).__name__} over a TT linear"

    def extra_repr(self) -> str:
        spec = self.inner.spec
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, padded=("
            f"{spec.out_features}, {spec.in_features})"  # type: ignore[union-attr]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features:  # named in the caller's sizes,
            raise ValueError(  # not the padded train's
                f"{type(self).__name__}: input has shape {tuple(x.shape)} but the layer "
                f"expects a last dim of {self.in_features}"
            )
        pad = self.inner.spec.in_features - self.in_features  # type: ignore[union-attr]
        return self.inner(F.pad(x, (0, pad)) if pad else x)[..., : self.out_features]

    def prune(self, tau: float) -> list[int]:
        """:meth:`TTLinear.prune` of the padded train (every replaced layer has it)."""
        return self.inner.prune(tau)

    def compact(self) -> None:
        """:meth:`TTLinear.compact` of the padded train."""
        self.inner.compact()

    def params(self) -> Params:
        """The padded train's functional params (:meth:`TTLinear.params`): its shapes are
        the padded sizes, ``self.inner.spec``'s."""
        return self.inner.params()

    def state(self) -> State:
        """The padded train's functional state (:meth:`TTLinear.state`)."""
        return self.inner.state()

    def to_dense(self) -> torch.Tensor:
        """The weight this layer applies, ``(out_features, in_features)``: the padded
        train's, without the padding's rows and columns."""
        return self.inner.to_dense()[: self.out_features, : self.in_features]


class TiedDecoder(NoDenseWeight):
    """A decoder whose weight is a TTM embedding's table (a tied LM head): ``x E^T + b``
    with ``E`` rebuilt from the embedding's cores on each call (in checkpointed blocks of
    rows: :func:`comera.layers.ttm_logits`), so the two stay one.

    The embedding is read, not owned: it is not registered as a submodule, so its cores
    appear once in ``state_dict()``, ``parameters()`` and a Hugging Face checkpoint (under
    the embedding's own path) and nothing holds two names for one tensor. It must live in
    the same model (as :func:`tensorize_` leaves it) for ``.to()`` and the optimizer to
    reach it."""

    def __init__(self, embedding: TTMEmbedding, bias: torch.Tensor | None, *,
                 bias_from: tuple[nn.Module, str] | None = None) -> None:  # fmt: skip
        """``bias_from``: ``(module, attribute)`` of a bias another module registers; the
        decoder then adds whatever that attribute holds (``bias`` may be that tensor or
        None)."""
        if bias_from is not None:
            _check_bias_from(bias_from, bias)
        super().__init__()
        self.embedding = embedding
        # a bias another module registers (BERT's ``cls.predictions.bias``) is read through
        # that module, like the embedding: one parameter, trained once and saved once under
        # its owner's path, and whatever that module holds now (functional_call, a load
        # with assign=True, to_empty) is what the decoder adds
        object.__setattr__(self, "_bias_from", bias_from)
        if bias_from is None:
            if bias is None or isinstance(bias, nn.Parameter):
                self.bias = bias
            else:
                self.bias = nn.Parameter(bias.detach().clone())
        # a state dict from before the embedding (or a shared bias) was unregistered holds
        # copies here too
        self._register_load_state_dict_pre_hook(_load_read_keys, with_module=True)

    def __getattr__(self, name: str) -> Any:
        source = self.__dict__.get("_bias_from")
        if name == "bias" and source is not None:
            return getattr(source[0], source[1])
        return super().__getattr__(name)

    def weight_label(self) -> str:
        return f"{type(self).__name__} of a TTM embedding"

    @property
    def embedding(self) -> TTMEmbedding:
        """The TTM embedding whose table this decoder reads."""
        return self._tied_embedding

    def __setattr__(self, name: str, value: object) -> None:
        source = self.__dict__.get("_bias_from")
        if name == "embedding":  # read, not registered (nn.Module would register it)
            object.__setattr__(self, "_tied_embedding", value)
        elif name == "bias" and source is not None:  # the owner's: set there (HF's tying)
            setattr(source[0], source[1], value)
        else:
            super().__setattr__(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        emb = self.embedding
        rows = emb.spec.num_embeddings  # type: ignore[union-attr]
        logits = ttm_logits(emb.params(), emb.state(), x, rows=rows)  # blocks, checkpointed
        return logits if self.bias is None else logits + self.bias

    def extra_repr(self) -> str:
        return f"tied to a TTM embedding of {self.embedding.spec.num_embeddings} rows"  # type: ignore[union-attr]


def _check_bias_from(bias_from: object, bias: torch.Tensor | None) -> None:
    """Refuse a ``bias_from`` that is not an ``(nn.Module, attribute)`` pair naming a
    tensor, or that disagrees with the ``bias`` given beside it."""
    if not (isinstance(bias_from, tuple) and len(bias_from) == 2
            and isinstance(bias_from[0], nn.Module) and isinstance(bias_from[1], str)):  # fmt: skip
        raise TypeError(
            f"TiedDecoder: bias_from must be an (nn.Module, attribute name) pair, got {bias_from!r}"
        )
    owner, attr = bias_from
    held = getattr(owner, attr, None)
    if not isinstance(held, torch.Tensor):
        what = type(held).__name__ if hasattr(owner, attr) else "nothing"
        raise ValueError(
            f"TiedDecoder: bias_from names {type(owner).__name__}.{attr}, which holds "
            f"{what}, not a bias tensor"
        )
    if bias is not None and bias is not held:
        raise ValueError(
            f"TiedDecoder: bias is not the tensor {type(owner).__name__}.{attr} holds; pass "
            "that tensor or None with bias_from (the decoder reads the owner's)"
        )


def _load_read_keys(
    decoder: TiedDecoder, state_dict: dict, prefix: str, metadata: dict, strict: bool,
    missing: list, unexpected: list, errors: list,
) -> None:  # fmt: skip
    """A :class:`TiedDecoder`'s load pre-hook for state dicts saved while it registered
    what it now reads: drop ``<prefix>embedding.*`` (the embedding loads its cores under its
    own path), and load ``<prefix>bias`` into a bias another module owns (the decoder
    trained its own copy then, so that copy is the trained one; the owner's module loads
    first when it is the decoder's parent, as in BERT's head)."""
    _drop_embedding_keys(state_dict, prefix)
    if decoder._bias_from is not None and prefix + "bias" in state_dict:
        value, bias = state_dict.pop(prefix + "bias"), decoder.bias
        if value.shape != bias.shape:  # as load_state_dict says it of its own keys
            errors.append(f"size mismatch for {prefix}bias: copying a param with shape "
                            f"{tuple(value.shape)} from checkpoint, the shape in current "
                            f"model is {tuple(bias.shape)}.")  # fmt: skip
            return
        owner, attr = decoder._bias_from
        if attr in owner._parameters or attr in owner._buffers:
            # the owner loads it as it loads its own keys: a copy, or under assign=True the
            # file's tensor itself (a copy would write into the tensor the owner took from
            # the caller), with torch's requires_grad and swap rules
            assign = metadata.get("assign_to_params_buffers", False)
            meta = {"assign_to_params_buffers": assign}
            owner._load_from_state_dict({attr: value}, "", meta, False, [], [], errors)
            return
        with torch.no_grad():
            bias.copy_(value)


def _drop_embedding_keys(state_dict: dict, prefix: str, *args: object) -> None:
    """Drop ``<prefix>embedding.*`` (see :func:`_load_read_keys`); also the load pre-hook
    of decoders pickled whole before that one (their pickle names this function)."""
    for key in [k for k in state_dict if k.startswith(prefix + "embedding.")]:
        del state_dict[key]


def _untie_in_config(model: nn.Module, tied: list[nn.Module]) -> None:
    """Tell the Hugging Face models (and sub-models) holding a :class:`TiedDecoder` or its
    embedding that nothing is left for them to tie: ``tie_weights()`` (run by
    ``save_pretrained``, ``from_pretrained`` and some trainers) would look for an
    ``lm_head.weight`` and a ``wte.weight`` the rewrite removed, and fail. The decoder keeps
    the two one by construction. Only those models' own configs change (and their text
    config where it is another object), in place: a sibling sub-model's ties stay, and a
    config object shared with another model changes for it too."""
    ids = {id(m) for m in tied}
    holders = [m for m in model.modules()
               if hasattr(getattr(m, "config", None), "to_dict")
               and any(id(sub) in ids for sub in m.modules())]  # fmt: skip
    for module in holders:
        configs = [module.config]
        try:
            configs.append(module.config.get_text_config())
        except Exception:  # noqa: BLE001 - no (or several) text configs: the config alone
            pass
        for config in configs:
            if hasattr(config, "tie_word_embeddings"):
                config.tie_word_embeddings = False
    for module in holders:  # the mappings models cache, children's ties included
        if hasattr(module, "all_tied_weights_keys"):
            try:
                module.all_tied_weights_keys = module.get_expanded_tied_weights_keys(
                    all_submodels=True
                )
            except Exception:  # noqa: BLE001 - any HF version's failure: nothing to tie
                module.all_tied_weights_keys = {}


def _modes(size: int, d: int) -> tuple[tuple[int, ...], int] | None:
    """Balanced modes of ``size`` (ascending; zero-padded to a size that splits when it
    does not) and the size they multiply to; None when no ``d``-way split is near."""
    for pad in (False, True):
        try:
            modes = propose_modes(size, d, pad=pad)
        except ConfigError:
            continue
        return modes, math.prod(modes)
    return None


def _split(sizes: tuple[int, ...], d: int) -> list[tuple[tuple[int, ...], int]]:
    """Modes for every size with the same number of cores: ``d``, or fewer where a size
    (a small one) has no ``d``-way split; one core always works."""
    for k in range(d, 0, -1):
        found = [_modes(n, k) for n in sizes]
        if all(f is not None for f in found):
            return found  # type: ignore[return-value]
    raise AssertionError("unreachable: one mode always splits")  # pragma: no cover


def _size(modes: tuple[int, ...], rank: int, extra: int, name: str) -> int:
    """Parameters of a train over ``modes`` at ``rank`` (capped per bond), plus ``extra``
    (a bias)."""
    return train_size(list(modes), list(cap_ranks(modes, rank, name))) + extra


def _linear_plan(
    name: str, out_f: int, in_f: int, bias: bool, cfg: TensorizeConfig, dtype: torch.dtype,
    paths: Sequence[str] = (),
) -> tuple[TTLinearSpec, str] | str:  # fmt: skip
    """The spec of a linear layer's train and what was padded, or why it stays dense
    (``paths``: every path the layer is reached by, for ``rank_for``)."""
    if not out_f or not in_f:  # no split of 0 exists: _split would find none
        return f"skipped: an empty {out_f}x{in_f} weight has nothing to compress"
    (out_m, out_p), (in_m, in_p) = _split((out_f, in_f), cfg.cores)
    modes = (*reversed(out_m), *in_m)
    dense = out_f * in_f + (out_f if bias else 0)
    rank = _pick_rank(modes, cfg.rank_of((name, *paths)), dense, out_p if bias else 0, cfg, name)
    if dense < cfg.min_compression * _size(modes, rank, out_p if bias else 0, name):
        return _not_smaller(modes, rank, name, cfg)
    spec = TTLinearSpec(out_modes=tuple(reversed(out_m)), in_modes=in_m, ranks=rank, bias=bias,
                        name=name, dtype=dtype)  # fmt: skip
    padded = []
    if out_p != out_f:
        padded.append(f"out {out_f}->{out_p}")
    if in_p != in_f:
        padded.append(f"in {in_f}->{in_p}")
    return spec, ", ".join(padded)


def _not_smaller(modes: tuple[int, ...], rank: int, name: str, cfg: TensorizeConfig) -> str:
    """Why a layer stays dense: its train at ``rank`` is not ``min_compression`` times
    smaller. The ranks its bonds are capped to are quoted when they carry fewer (a rank far
    above the modes' is quoted as what the check used)."""
    capped = cap_ranks(modes, rank, name)
    # any bond capped: rank 8 over bonds that carry (4, 8, 4) is not a rank-8 train
    shown = f" (capped to {','.join(map(str, capped))})" if min(capped) < rank else ""
    if cfg.min_compression == 1:  # the default: skipped means larger (an equal size is kept)
        return f"skipped: a rank-{rank}{shown} train is larger than the dense layer"
    if cfg.min_compression < 1:  # a train larger than dense is kept up to 1/min_compression
        times = f"{1 / cfg.min_compression:g}x"
        return (f"skipped: a rank-{rank}{shown} train is more than {times} the dense "
                "layer's size (min_compression)")  # fmt: skip
    return (f"skipped: a rank-{rank}{shown} train is not {cfg.min_compression:g}x smaller "
            "than the dense layer (min_compression)")  # fmt: skip


def _short_of(cfg: TensorizeConfig, dense: int, size: int) -> str:
    """A note when a target compression could not be met even at rank 1."""
    if cfg.compression is None or dense >= cfg.compression * size:
        return ""
    return f"rank 1 is only {dense / size:.2f}x smaller, short of compression={cfg.compression:g}"


def _pick_rank(modes: tuple[int, ...], rank: int, dense: int, extra: int,
               cfg: TensorizeConfig, name: str) -> int:  # fmt: skip
    """``rank``, or with a target compression the largest rank up to it that meets it
    (1 if none does)."""
    if cfg.compression is None:
        return rank
    for r in range(rank, 0, -1):
        if dense / _size(modes, r, extra, name) >= cfg.compression:
            return r
    return 1


def _check_finite(name: str, weight: torch.Tensor) -> None:
    """Refuse to TT-SVD a weight holding NaN or inf (the SVD fails, naming no layer), or
    one on the meta device (no values to compress)."""
    if weight.is_meta:
        raise ConfigError(
            f"tensorize_: {name}'s weight is on the meta device, with no values for TT-SVD; "
            "use init='random' (then load the weights with load_state_dict(..., assign=True))"
        )
    if not bool(torch.isfinite(weight).all()):
        raise ConfigError(
            f"tensorize_: {name}'s weight holds NaN or inf, which TT-SVD cannot compress; "
            "fix the checkpoint, exclude the layer, or use init='random'"
        )


def _replace_linear(name: str, weight: torch.Tensor, bias: torch.Tensor | None, kind: str,
                    cfg: TensorizeConfig,
                    paths: Sequence[str] = ()) -> tuple[nn.Module | None, LayerReport]:  # fmt: skip
    """A TT replacement of the linear map ``x weight^T + bias`` (weight ``(out, in)``)."""
    out_f, in_f = weight.shape
    plan = _linear_plan(name, out_f, in_f, bias is not None, cfg, weight.dtype, paths)
    before = weight.numel() + (bias.numel() if bias is not None else 0)
    if isinstance(plan, str):
        return None, LayerReport(name=name, kind=kind, shape=(out_f, in_f),
                                 params_before=before, skipped=plan)  # fmt: skip
    spec, padded = plan
    dev = weight.device
    if cfg.init == "svd":
        w = torch.zeros(spec.out_features, spec.in_features, dtype=spec.dtype, device=dev)
        w[:out_f, :in_f] = weight.detach()
        b = None
        if bias is not None:
            b = torch.zeros(spec.out_features, dtype=spec.dtype, device=dev)
            b[:out_f] = bias.detach()
        params, state = tensor_train.from_dense(w, spec, b)
        layer = TTLinear(spec, params=params, state=state)
    else:
        layer = TTLinear(replace(spec, std=_weight_std(weight)), device=dev)
    module: nn.Module = layer if not padded else PaddedTTLinear(layer, in_f, out_f)
    after = sum(p.numel() for p in layer.parameters())
    return module, LayerReport(
        name=name, kind=kind, shape=(out_f, in_f),
        modes=f"{list(spec.out_modes)} / {list(spec.in_modes)}",
        ranks=tuple(tensor_train.bond_ranks(layer.params())), params_before=before,
        params_after=after, padded=padded, note=_short_of(cfg, before, after),
    )  # fmt: skip


def _weight_std(weight: torch.Tensor) -> float | None:
    """The standard deviation ``init="random"`` draws a replaced weight's train at: the
    weight's own (a model built from a config: its init's, such as Hugging Face's
    ``initializer_range``; torch's defaults drew a GPT-2 word table 50 times too wide),
    or None (torch's default) where it has none: one element, all zeros, the meta device,
    NaN or inf."""
    if weight.is_meta or weight.numel() < 2:
        return None
    std = float(weight.detach().float().std())
    return std if 0 < std < math.inf else None


def _embedding_modes(rows: int, dim: int, d: int) -> tuple[tuple[int, ...], tuple[int, ...]] | str:
    """Vocabulary modes (zero-padded rows where needed) and dim modes (exact: a table's
    width is not padded) with the same number of cores, ``d`` or fewer but at least two
    (a TTM train has two or more); or why there are none."""
    dim_splits = False
    for k in range(d, 1, -1):
        try:  # 30 into 4 needed padding, so the table was skipped, where 3 cores split it
            dim_m = propose_modes(dim, k)
        except ConfigError:
            continue
        dim_splits = True
        vocab = _modes(rows, k)
        if vocab is not None:
            return vocab[0], dim_m
    if d >= 2 and not dim_splits:
        return f"skipped: dim {dim} has no balanced split into 2 or more factors"
    return f"skipped: {rows}x{dim} has no split into 2 or more cores"


def _replace_embedding(
    name: str, emb: nn.Embedding, cfg: TensorizeConfig, paths: Sequence[str] = ()
) -> tuple[nn.Module | None, LayerReport]:
    rows, dim = emb.weight.shape
    report = {"name": name, "kind": "embedding", "shape": (rows, dim),
              "params_before": emb.weight.numel()}  # fmt: skip
    found = _embedding_modes(rows, dim, cfg.embedding_cores)
    if isinstance(found, str):
        return None, LayerReport(**report, skipped=found)
    vocab_m, dim_m = tuple(reversed(found[0])), found[1]
    merged = tuple(v * d for v, d in zip(vocab_m, dim_m, strict=True))
    rank = _pick_rank(merged, cfg.rank_of((name, *paths), embedding=True), rows * dim, 0, cfg,
                      name)  # fmt: skip
    if rows * dim < cfg.min_compression * _size(merged, rank, 0, name):
        return None, LayerReport(**report, skipped=_not_smaller(merged, rank, name, cfg))
    spec = TTMEmbeddingSpec(vocab_modes=vocab_m, dim_modes=dim_m, ranks=rank,
                            num_embeddings=rows, embedding_dim=dim, name=name,
                            dtype=emb.weight.dtype)  # fmt: skip
    if cfg.init == "svd":
        params, state = tensor_train.from_dense(emb.weight, spec)
        layer = TTMEmbedding(spec, params=params, state=state)
    else:
        layer = TTMEmbedding(replace(spec, std=_weight_std(emb.weight)), device=emb.weight.device)
    padded = f"rows {rows}->{math.prod(vocab_m)}" if math.prod(vocab_m) != rows else ""
    after = sum(p.numel() for p in layer.parameters())
    return layer, LayerReport(
        **report, modes=f"{list(vocab_m)} x {list(dim_m)}",
        ranks=tuple(tensor_train.bond_ranks(layer.params())),
        params_after=after, padded=padded, note=_short_of(cfg, rows * dim, after),
    )  # fmt: skip


def _is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): ``x @ weight + bias`` with weight ``(in, out)``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


@lru_cache(maxsize=256)
def _run_time_source(cls: type) -> str:
    """The source of every method of ``cls`` and the classes it derives from (below
    ``nn.Module``) that may run after the rewrite: all but those that set the model up
    (:data:`_SET_UP`); sources that cannot be read are left out."""
    sources = []
    for klass in cls.__mro__:
        if klass is nn.Module or klass is object:
            break
        for name, member in vars(klass).items():
            if _SET_UP.search(name):  # run before the rewrite: building, tying, initialising
                continue
            member = getattr(member, "__func__", None) or getattr(member, "fget", None) or member
            if not inspect.isfunction(member):
                continue
            try:
                sources.append(inspect.getsource(member))
            except (OSError, TypeError):  # compiled or generated: nothing to read
                continue
    return "\n".join(sources)


def _reads_weight(cls: type, child: str) -> str:
    """The read, as written, where a method of ``cls`` or of a class it derives from
    (below ``nn.Module``) reads ``self.<child>.weight`` (else ``""``), ``child`` a dotted
    path below it, a list's item at any index (``self.layers[0].proj.weight`` for
    ``layers.1.proj`` too) or a dict's by name (a TT adapter has no ``weight``: the first
    forward would fail).

    Every method counts, not only ``forward``: a helper it calls may read the weight
    (DeBERTa-v2's ``get_rel_embedding`` reads ``rel_embeddings.weight``); methods that set
    the model up (``__init__``, ``_init_weights``, ``tie_weights``: :data:`_SET_UP`) do
    not. A read in any branch counts, on purpose: which branch runs depends on the config,
    the device and the mode (``nn.TransformerEncoderLayer``'s fast path, Mamba mixers' CUDA
    kernels), and a layer wrongly left dense still trains where one wrongly replaced fails."""
    steps = []
    for part in child.split("."):  # a list's item by any index, a dict's by name too
        if part.isdigit():  # self.layers[0].proj, self.blocks[-1].proj, self.layers[i]
            steps.append(r"\[[^\]\n]*\]")
        else:
            name = re.escape(part)
            steps.append(rf"(?:\.{name}\b|\[\s*['\"]{name}['\"]\s*\])")
    pattern = re.compile(r"\bself" + "".join(steps) + r"\.weight\b")
    found = pattern.search(_run_time_source(cls))
    # the read as written (self.layers[0].proj.weight keeps layers.1.proj too), or ""
    return re.sub(r"\s+", "", found.group(0)).removeprefix("self.") if found else ""


# methods that set a model up (and run before tensorize_), so a weight read there is
# no read at run time: ``__init__``, ``_init_weights``, ``tie_weights``, ``reset_parameters``
_SET_UP = re.compile(
    r"^(__init__|post_init|_?init_\w*|\w*_init_weights|_?tie_\w*|\w*_tie_weights|_?reset_\w*"
    r"|_?resize_\w*)$"  # resize_token_embeddings, DistilBERT's resize_position_embeddings
)


_HOOKS = (
    ("_forward_pre_hooks", "forward pre-hooks"),
    ("_forward_hooks", "forward hooks"),
    ("_backward_pre_hooks", "backward pre-hooks"),
    ("_backward_hooks", "backward hooks"),
)


# forward hooks that read nothing of the module and are moved onto its adapter: Hugging
# Face's enable_input_require_grads (gradient checkpointing, PEFT's k-bit preparation)
# marks the input embedding's output as requiring grad
_CARRIED_HOOKS = ("make_inputs_require_grads",)


def _hook_name(hook: object) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def _carried(hook: object) -> bool:
    return getattr(hook, "__name__", None) in _CARRIED_HOOKS


def _call_problem(path: str, module: nn.Module, model: nn.Module) -> str:
    """Why the module at ``path`` cannot be swapped for an adapter given how it is called,
    or ``""``: its class overrides ``forward`` or the instance carries its own (what they
    add would be lost), it has hooks (the adapter would not run them), or its parent reads
    its weight directly (a TT adapter has none: the first forward would fail)."""
    base = next((k for k in (nn.Embedding, nn.Linear) if isinstance(module, k)), None)
    if base is not None and type(module).forward is not base.forward:
        # a scaled word embedding (BART's), a positional one with an offset (OPT's): the
        # adapter is a plain lookup or product and would silently drop what they add
        return f"{type(module).__name__} has its own forward, which the adapter lacks"
    if parametrize.is_parametrized(module):  # spectral or weight norm, orthogonality...
        return "its weight is parametrized (torch.nn.utils.parametrize), which the adapter drops"
    if "forward" in vars(module):  # accelerate's hooks replace the instance's forward
        return "the module has its own forward (set on the instance), which the adapter lacks"
    hooks = []
    for attr, what in _HOOKS:
        held = [_hook_name(h) for h in getattr(module, attr, {}).values() if not _carried(h)]
        if held:
            hooks.append(f"{what} ({', '.join(held)})")
    if hooks:
        return f"it has {' and '.join(hooks)}, which the adapter would not run"
    parent_name, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, nn.MultiheadAttention):
        return f"{parent_name or 'the model'} (nn.MultiheadAttention) reads its weight"
    # the parent (T5's feed-forward reads wo.weight.dtype) or any module above it (FSMT's
    # model reads decoder.embed_tokens.weight.dtype, nanoGPT's transformer.wpe.weight)
    parts = path.split(".")
    for i in range(len(parts) - 1, -1, -1):
        above = model.get_submodule(".".join(parts[:i])) if i else model
        below = ".".join(parts[i:])
        if read := _reads_weight(type(above), below):
            return f"{type(above).__name__} reads {read}"
    return ""


def _carry_handle(model: nn.Module, old: nn.Module, hook_id: int, handle: RemovableHandle) -> None:
    """Point a hook's handle kept on a module of ``model``, alone or in a list (Hugging
    Face's ``_require_grads_hooks``, which ``disable_input_require_grads`` removes), from
    ``old``'s hook to its carried copy on the adapter: it removed nothing, and a frozen
    embedding's output went on requiring grad."""

    def held(value: object) -> bool:
        return (isinstance(value, RemovableHandle) and value.id == hook_id
                and value.hooks_dict_ref() is old._forward_hooks)  # fmt: skip

    for m in model.modules():
        for key, value in list(vars(m).items()):
            if held(value):
                setattr(m, key, handle)
            elif isinstance(value, list) and any(held(v) for v in value):
                value[:] = [handle if held(v) else v for v in value]


def _why_not(name: str, module: nn.Module, model: nn.Module, owners: dict[int, list[str]],
             paths: dict[int, list[str]], embeddings: dict[int, TTMEmbedding],
             exclude: tuple[str, ...] = ()) -> str:  # fmt: skip
    """Why a matched module must stay as it is, or ``""``: how it is called at any of its
    paths (:func:`_call_problem`), or its weight or bias is shared with a module that is
    not being replaced with it (a tie this rewrite would break); an embedding also stays
    when a linear tied to it cannot become its :class:`TiedDecoder`."""
    for path in paths[id(module)]:
        why = _call_problem(path, module, model)
        if why:
            return f"skipped: {why}"
    weight = module.weight
    if isinstance(module, nn.Linear) and id(weight) in embeddings:
        return ""  # tied to a replaced embedding: a TiedDecoder of it (its bias kept as is)
    bias = getattr(module, "bias", None)
    if isinstance(bias, nn.Parameter) and bias.requires_grad != weight.requires_grad:
        # BitFit-style: a TT layer's tensors train together or not at all (ModuleTask)
        which = "weight" if not weight.requires_grad else "bias"
        return f"skipped: its {which} alone is frozen; a TT layer trains all or none"
    if isinstance(bias, nn.Parameter):  # the adapter would hold a copy, trained apart
        sharing = [o for o in owners.get(id(bias), []) if o not in paths[id(module)]]
        if sharing:
            return f"skipped: its bias is shared with {sharing[0]}; a TT layer holds its own"
    others = [o for o in owners.get(id(weight), []) if o not in paths[id(module)]]
    if isinstance(module, nn.Embedding):  # a linear tied to it becomes its TiedDecoder,
        # unless an exclude glob keeps it (it then keeps the weight, and the embedding too)
        kept = [o for o in others if _match(o, exclude)]
        unlinear = [o for o in others if not isinstance(model.get_submodule(o), nn.Linear)]
        for o in (o for o in others if o not in kept and o not in unlinear):
            why = _call_problem(o, model.get_submodule(o), model)
            if why:  # it would become a TiedDecoder, which has no weight, forward or hooks
                return f"skipped: its weight is tied to {o}, which must stay: {why}"
        others = list(dict.fromkeys(kept + unlinear))
        if others and all(isinstance(model.get_submodule(o), nn.Embedding) for o in others):
            # T5's shared and embed_tokens: other modules, one weight; one TTM at several
            # paths would be one module under several names, which HF's save refuses
            why = "one TTM for several embedding modules is not supported"
            if set(others) <= set(kept):  # the exclude alone keeps them all
                why = f"the exclude keeps {', '.join(kept)}"
            return (
                f"skipped: other embedding modules hold its weight too ({', '.join(others)}); {why}"
            )
    if others:
        return f"skipped: its weight is shared with {others[0]}, which this rewrite keeps"
    return ""


def tensorize_(model: nn.Module, config: TensorizeConfig) -> TensorizeSummary:
    """Replace, in place, every target ``nn.Linear``, ``nn.Embedding`` and HF ``Conv1D``
    of ``model`` by its TT / TTM adapter; returns what was done per layer (print it).

    A target or exclude glob that matches no replaceable module is an error that lists the
    model's module names. Linear layers tied to a replaced embedding (``weight is
    embedding.weight``) become a :class:`TiedDecoder` of it, whether or not a target glob
    names them (one an ``exclude`` glob names stays, and so does the embedding); a module
    reached by several paths is replaced at every one, unless an exclude glob names one of
    them. A frozen layer (``requires_grad`` False) is replaced by a frozen one; one whose
    weight or bias alone is frozen stays as it is. A matched module whose weight or bias
    is shared with one that stays (a tie the rewrite would break), whose parent reads its
    weight directly (``nn.MultiheadAttention.out_proj``), whose class or instance
    overrides ``forward`` (what it adds would be lost) or that has hooks (the adapter would
    not run them) is left as it is and listed as skipped; so is an embedding whose tied
    linear is such a module. Globs that match nothing (``rank_for``'s too), a target
    whose every match is excluded, and a lazy module not yet initialized are errors. Other
    modules are not touched. An embedding's ``padding_idx``, ``max_norm``,
    ``scale_grad_by_freq`` and ``sparse`` have no TTM counterpart: the summary notes them
    when set."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"tensorize_: model is a {type(model).__name__}, not an nn.Module")
    if not isinstance(config, TensorizeConfig):
        raise TypeError(
            f"tensorize_: config is a {type(config).__name__}; pass a TensorizeConfig, e.g. "
            "TensorizeConfig(target_modules=('query', 'value'))"
        )
    kinds = (nn.Linear, nn.Embedding)
    if isinstance(model, kinds) or _is_conv1d(model):  # no parent to swap it in
        raise ConfigError(
            f"tensorize_: the model is itself a layer ({type(model).__name__}), and tensorize_ "
            "replaces submodules in place; wrap it (nn.Sequential(layer)) or build the "
            "TT layer from its weight (comera.from_dense)"
        )
    candidates = [(n, m) for n, m in model.named_modules()
                  if n and (isinstance(m, kinds) or _is_conv1d(m))]  # fmt: skip
    paths: dict[int, list[str]] = {}  # id(module) -> every path that reaches it
    owners: dict[int, list[str]] = {}  # id(parameter) -> the module paths that hold it
    for n, m in model.named_modules(remove_duplicate=False):
        if n:
            paths.setdefault(id(m), []).append(n)
            for _, p in m.named_parameters(recurse=False):
                owners.setdefault(id(p), []).append(n)
    every = [p for _, m in candidates for p in paths[id(m)]]  # a shared module's paths too
    rank_globs = tuple(g for g, _ in config.rank_for)
    for flag, globs in (("target", config.target_modules), ("exclude", config.exclude),
                        ("rank_for", rank_globs)):  # fmt: skip
        for glob in globs:
            if not any(_match(p, (glob,)) for p in every):
                done = [n for n, m in model.named_modules() if n and _match(n, (glob,))
                        and isinstance(m, (TTLinear, TTMEmbedding, PaddedTTLinear))]  # fmt: skip
                # a padded layer once, not beside its train at NAME.inner
                done = [n for n in done if n.removesuffix(".inner") == n
                        or n.removesuffix(".inner") not in done]  # fmt: skip
                if done:  # a second call over a tensorized model
                    raise ConfigError(
                        f"tensorize_: {flag} glob {glob!r} matches only layers already "
                        f"tensorized ({', '.join(done[:6])}); tensorize_ replaces dense "
                        "layers, once"
                    )
                names = ", ".join(every[:40])
                more = f" (+{len(every) - 40} more)" if len(every) > 40 else ""
                raise ConfigError(
                    f"tensorize_: {flag} glob {glob!r} matches no nn.Linear, nn.Embedding or "
                    f"Conv1D; the model's are: {names or '(none)'}{more}"
                )

    def chosen_at(module: nn.Module) -> bool:  # a target at some path, excluded at none
        at = paths[id(module)]
        return any(_match(p, config.target_modules) for p in at) and not any(
            _match(p, config.exclude) for p in at
        )

    # embeddings first, so a linear tied to one is known as tied whatever the order
    chosen = sorted(((n, m) for n, m in candidates if chosen_at(m)),
                    key=lambda nm: not isinstance(nm[1], nn.Embedding))  # fmt: skip
    if not chosen:  # every match excluded: a summary with no rows would say nothing
        raise ConfigError(
            f"tensorize_: every module the target globs {list(config.target_modules)} match "
            f"is excluded by {list(config.exclude)}; nothing to replace"
        )
    # a head tied to a chosen embedding is re-pointed at its table, never given a rank
    tables = {id(m.weight) for _, m in chosen if isinstance(m, nn.Embedding)}
    replaced_paths = [p for _, m in chosen for p in paths[id(m)]
                      if not (isinstance(m, nn.Linear) and id(m.weight) in tables)]  # fmt: skip
    for glob in rank_globs:  # a rule over a module that stays dense did nothing, silently
        if not any(_match(p, (glob,)) for p in replaced_paths):
            hit = [p for p in every if _match(p, (glob,))]
            raise ConfigError(
                f"tensorize_: rank_for glob {glob!r} matches {', '.join(hit[:3])}, which no "
                "target glob chooses (or an exclude glob leaves out): its rank would apply to "
                "nothing; name a module that is replaced (a tied head follows its embedding's "
                "rank)"
            )
    lazy = [n for n, m in chosen if isinstance(m.weight, nn.parameter.UninitializedParameter)]  # type: ignore[union-attr]
    if lazy:  # no shape yet to plan a train for
        raise ConfigError(
            f"tensorize_: {lazy[0]} is a lazy module whose weight is not initialized yet; run "
            "one forward pass first (or exclude it)"
        )
    for n, m in chosen:  # all before any is replaced: no half-rewritten model
        if _why_not(n, m, model, owners, paths, {}, config.exclude):
            continue  # those that stay (a tie, a hook) are not compressed
        dtype = m.weight.dtype  # type: ignore[union-attr]
        if not dtype.is_floating_point:  # a complex or integer layer failed after others
            raise ConfigError(  # were replaced, leaving the model half rewritten
                f"tensorize_: {n} holds {dtype} weights; TT cores are real floating "
                "point: exclude it (exclude globs)"
            )
        if config.init == "svd":
            _check_finite(n, m.weight)  # type: ignore[arg-type]
    summary = TensorizeSummary()
    embeddings: dict[int, TTMEmbedding] = {}  # id(old weight) -> its replacement
    for name, module in chosen:
        why = _why_not(name, module, model, owners, paths, embeddings, config.exclude)
        new: nn.Module | None = None
        if why:
            shape = tuple(module.weight.shape)  # type: ignore[union-attr]
            if _is_conv1d(module):  # (in, out) stored: rows say (out, in), as replaced ones
                shape = shape[::-1]
            # weight and bias, as a layer skipped for its size counts them
            bias = getattr(module, "bias", None)
            held = module.weight.numel() + (bias.numel() if isinstance(bias, torch.Tensor) else 0)  # type: ignore[union-attr]
            kind = (
                "embedding"
                if isinstance(module, nn.Embedding)
                else ("linear" if isinstance(module, nn.Linear) else "conv1d")
            )  # as replaced rows say
            report = LayerReport(name=name, kind=kind, shape=shape,  # type: ignore[arg-type]
                                 params_before=held, skipped=why)  # fmt: skip
        elif isinstance(module, nn.Embedding):
            new, report = _replace_embedding(name, module, config, paths[id(module)])
            if new is not None:
                embeddings[id(module.weight)] = new  # type: ignore[assignment]
                lost = [k for k in ("padding_idx", "max_norm") if getattr(module, k) is not None]
                lost += [k for k in ("scale_grad_by_freq", "sparse") if getattr(module, k)]
                if lost:
                    note = f"{', '.join(lost)} dropped (no TTM counterpart)"
                    report = replace(report, note="; ".join(x for x in (report.note, note) if x))
        elif isinstance(module, nn.Linear):
            if id(module.weight) in embeddings:
                continue  # a tied decoder: handled below with every tied linear
            new, report = _replace_linear(name, module.weight, module.bias, "linear", config,
                                          paths[id(module)])  # fmt: skip
        else:
            w = module.weight.T  # type: ignore[union-attr]  # Conv1D keeps (in, out)
            new, report = _replace_linear(name, w, module.bias, "conv1d", config,  # type: ignore[arg-type]
                                          paths[id(module)])  # fmt: skip
        summary.layers.append(report)
        if new is not None:
            if not module.weight.requires_grad:  # type: ignore[union-attr]
                new.requires_grad_(False)  # a frozen layer stays frozen (its bias too)
            for hook_id, hook in module._forward_hooks.items():  # only carried (_why_not)
                _carry_handle(model, module, hook_id, new.register_forward_hook(hook))
            for path in paths[id(module)]:
                model.set_submodule(path, new)
    tied: list[nn.Module] = []  # the tied decoders and their embeddings
    heads = [m for _, m in candidates if isinstance(m, nn.Linear) and id(m.weight) in embeddings]
    head_paths = {p for m in heads for p in paths[id(m)]}
    bias_from: dict[int, tuple[nn.Module, str]] = {}  # id(bias) -> the module registering it
    for name, module in candidates:  # tied decoders, named by a glob or not
        if isinstance(module, nn.Linear) and id(module.weight) in embeddings:
            emb = embeddings[id(module.weight)]
            bias = module.bias  # another module (BERT's cls.predictions) may hold it too
            source = None
            if isinstance(bias, nn.Parameter):
                source = bias_from.get(id(bias))  # another head already registers it
                stays = [o for o in owners.get(id(bias), []) if o not in head_paths]
                for path in stays if source is None else ():  # one still holding it
                    owner = model.get_submodule(path)  # (a replaced linear holds a copy)
                    attr = next((k for k, v in owner._parameters.items() if v is bias), None)
                    if attr is not None:
                        source = bias_from[id(bias)] = (owner, attr)
                        break
            # one module (one bias) at every path
            decoder = TiedDecoder(emb, bias, bias_from=source)
            if isinstance(bias, nn.Parameter) and source is None:
                bias_from[id(bias)] = (decoder, "bias")  # registered here: others read it
            for path in paths[id(module)]:
                model.set_submodule(path, decoder)
            summary.layers.append(LayerReport(
                name=name, kind="tied decoder", shape=tuple(module.weight.shape),
                params_before=module.bias.numel() if module.bias is not None else 0,
                params_after=module.bias.numel() if module.bias is not None else 0,
                skipped="tied to " + emb.spec.name,
            ))  # fmt: skip
            tied += [emb, decoder]
    if tied:
        _untie_in_config(model, tied)
    if all(r.skipped and not r.skipped.startswith("tied to ") for r in summary.layers):
        why = "; ".join(f"{r.name}: {r.skipped}" for r in summary.layers[:3])
        warnings.warn(  # returned quietly: only the summary's rows said nothing changed
            f"tensorize_: every module the globs chose was left dense ({why}"
            f"{'; ...' if len(summary.layers) > 3 else ''}): the model is unchanged",
            stacklevel=2,
        )
    return summary
