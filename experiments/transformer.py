"""A BERT-style encoder classifier as pure functions over a params pytree.

``init_encoder(cfg) -> (params, state)`` and ``encoder_logits(params, state, batch, cfg)``.
With ``cfg.tt`` every linear layer (Q/K/V/out, FFN in/out, pooler) is a gated tensor
train with the paper's mode shapes and the word embedding is a TTM; with
``cfg.tt=False`` the same architecture is fully dense (the baseline). The 3-way
classifier head stays dense in both (its 768 x 3 weight has no useful factorization).
Post-LN blocks as in BERT: ``h = LN(x + Drop(Attn(x)))``, ``h = LN(h + Drop(FFN(h)))``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import comera as C
from comera.errors import ConfigError
from comera.layers import tt_linear_shared_input
from comera.spec import propose_modes
from comera.tensor_train import is_tt_params

__all__ = [
    "EncoderConfig",
    "dense_param_count",
    "encoder_hidden",
    "encoder_logits",
    "fit_vocab",
    "grouped_halves",
    "init_encoder",
]

Modes = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(kw_only=True, slots=True)
class EncoderConfig:
    """Architecture; defaults are the paper's MNLI model (6 x d768, 12 heads, FFN 3072).

    TT shapes are ``(out_modes, in_modes)`` in our output-first core order: the paper's
    trains [12,8,8 | 8,8,12], [12,8,8 | 12,16,16] and [16,16,12 | 8,8,12] (input modes
    first) read backwards, which keeps the same cores and ranks.
    """

    vocab_size: int = 30522
    max_len: int = 128
    type_vocab: int = 2
    d_model: int = 768
    heads: int = 12
    ffn: int = 3072
    layers: int = 6
    dropout: float = 0.1
    num_labels: int = 3
    init_std: float = 0.02
    tt: bool = True
    tt_embedding: bool = True
    rank: int = 30
    attn_modes: Modes = ((12, 8, 8), (8, 8, 12))
    ffn_in_modes: Modes = ((16, 16, 12), (8, 8, 12))
    ffn_out_modes: Modes = ((12, 8, 8), (12, 16, 16))
    emb_vocab_modes: tuple[int, ...] = (16, 20, 10, 10)
    emb_dim_modes: tuple[int, ...] = (4, 4, 8, 6)
    emb_rank: int = 32
    recompute: bool = False  # recompute each block's activations in backward (training)
    fused_qkv: bool = False  # Q, K, V (comera path) read x in one GEMM: tt_linear_shared_input
    # the blocks' TT linears of one structure gated and contracted together each forward
    # pass (comera.plans.GroupedHalves); False: each layer builds its own, as before
    grouped_halves: bool = True

    # the fields derive_fields computes from the widths (``--set model.attn_modes=auto``)
    DERIVED: ClassVar[tuple[str, ...]] = ("attn_modes", "ffn_in_modes", "ffn_out_modes",
                                          "emb_dim_modes")  # fmt: skip

    _PAIRS: ClassVar[tuple[str, ...]] = ("attn_modes", "ffn_in_modes", "ffn_out_modes")

    def __post_init__(self) -> None:
        problems = []
        for name in ("d_model", "heads", "ffn", "max_len", "type_vocab", "rank", "emb_rank"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_labels < 0:  # 0: no classifier (CodeBERT's MLM counts it so)
            problems.append(f"num_labels must be >= 0, got {self.num_labels}")
        if self.layers < 0:
            problems.append(f"layers must be >= 0, got {self.layers}")
        if self.heads >= 1 and self.d_model % self.heads:
            problems.append(f"d_model={self.d_model} is not divisible by heads={self.heads}")
        if not 0 <= self.dropout < 1:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if not 0 < self.init_std < math.inf:  # inf drew infinite weights: NaN at step 1
            problems.append(f"init_std must be finite and > 0, got {self.init_std}")
        for name in ("attn_modes", "ffn_in_modes", "ffn_out_modes", "emb_vocab_modes",
                     "emb_dim_modes"):  # fmt: skip
            value = getattr(self, name)
            flat = [m for side in value for m in side] if name in self._PAIRS else value
            if any(m < 1 for m in flat):  # two negatives multiply to the width
                problems.append(f"{name}={value}: every mode must be >= 1")
        if self.tt:
            for name, (out_m, in_m), (o, i) in self._linear_modes(self.d_model, self.ffn):
                if math.prod(out_m) != o or math.prod(in_m) != i:
                    problems.append(
                        f"{name}={(out_m, in_m)} multiplies to {math.prod(out_m)} x "
                        f"{math.prod(in_m)}, expected {o} x {i} (out x in)"
                    )
            dims = self.emb_dim_modes
            if self.tt_embedding and dims and math.prod(dims) != self.d_model:
                problems.append(
                    f"emb_dim_modes={dims} multiplies to {math.prod(dims)}, expected "
                    f"d_model={self.d_model}"
                )
        if problems:  # every inconsistency at once: a resized model has several
            raise ConfigError("EncoderConfig: " + "; ".join(problems))

    def _linear_modes(self, d: int, f: int) -> list[tuple[str, Modes, tuple[int, int]]]:
        return [("attn_modes", self.attn_modes, (d, d)),
                ("ffn_in_modes", self.ffn_in_modes, (f, d)),
                ("ffn_out_modes", self.ffn_out_modes, (d, f))]  # fmt: skip

    def derive_fields(self, new: dict[str, Any], asked: set[str]) -> dict[str, Any]:
        """Modes for a resized model, with as many cores as now: those asked for
        (``auto``) and, when ``d_model`` or ``ffn`` change, those that no longer multiply to
        the new widths, unless ``new`` sets them. A width with no balanced split keeps its
        modes (the check then names them)."""
        d, f = new.get("d_model", self.d_model), new.get("ffn", self.ffn)
        resized = "d_model" in new or "ffn" in new
        out: dict[str, Any] = {}
        for name, (out_m, in_m), (o, i) in self._linear_modes(d, f):
            fits = math.prod(out_m) == o and math.prod(in_m) == i
            if name not in new and (name in asked or (resized and not fits)):
                with contextlib.suppress(ConfigError):  # output modes largest first (the paper's)
                    out[name] = (tuple(reversed(propose_modes(o, len(out_m)))),
                                 propose_modes(i, len(in_m)))  # fmt: skip
        dims = self.emb_dim_modes
        if "emb_dim_modes" not in new and (
            "emb_dim_modes" in asked or (resized and math.prod(dims) != d)
        ):
            with contextlib.suppress(ConfigError):
                out["emb_dim_modes"] = propose_modes(d, len(dims))
        return out

    def linear_spec(self, name: str, modes: Modes) -> C.TTLinearSpec:
        return C.TTLinearSpec(
            out_modes=modes[0], in_modes=modes[1], ranks=self.rank, name=name, std=self.init_std
        )

    def embedding_spec(self) -> C.TTMEmbeddingSpec:
        return C.TTMEmbeddingSpec(
            vocab_modes=self.emb_vocab_modes,
            dim_modes=self.emb_dim_modes,
            ranks=self.emb_rank,
            num_embeddings=self.vocab_size,
            embedding_dim=self.d_model,
            name="embed.word",
            std=self.init_std,
        )


def fit_vocab(model: EncoderConfig, vocab_size: int) -> EncoderConfig:
    """``model`` with the tokenizer's vocabulary; TTM vocab modes are re-proposed (padded,
    balanced) when the configured ones are empty or too small for it."""
    modes = model.emb_vocab_modes
    if not modes or math.prod(modes) < vocab_size:
        d = len(model.emb_dim_modes)
        modes = tuple(sorted(propose_modes(vocab_size, d, pad=True), reverse=True))
    return dataclasses.replace(model, vocab_size=vocab_size, emb_vocab_modes=modes)


def _dense_linear(out_f: int, in_f: int, std: float, gen: torch.Generator) -> dict:
    return {"weight": torch.randn(out_f, in_f, generator=gen) * std, "bias": torch.zeros(out_f)}


def _ln(d: int) -> dict:
    return {"weight": torch.ones(d), "bias": torch.zeros(d)}


def init_encoder(
    cfg: EncoderConfig, *, generator: torch.Generator | None = None
) -> tuple[dict, dict]:
    """Params and rank state of the whole model (state only holds TT layers' masks)."""
    gen = generator or torch.Generator().manual_seed(0)
    d, std = cfg.d_model, cfg.init_std
    state: dict = {"embed": {}, "layers": [], "pooler": {}}

    def linear(name: str, modes: Modes, out_f: int, in_f: int, st: dict, key: str) -> dict:
        if not cfg.tt:
            return _dense_linear(out_f, in_f, std, gen)
        p, s = C.init(cfg.linear_spec(name, modes), generator=gen)
        st[key] = s
        return p

    if cfg.tt and cfg.tt_embedding:
        word, state["embed"]["word"] = C.init(cfg.embedding_spec(), generator=gen)
    else:
        word = {"weight": torch.randn(cfg.vocab_size, d, generator=gen) * std}
    params: dict = {
        "embed": {
            "word": word,
            "position": torch.randn(cfg.max_len, d, generator=gen) * std,
            "token_type": torch.randn(cfg.type_vocab, d, generator=gen) * std,
            "ln": _ln(d),
        },
        "layers": [],
    }
    for i in range(cfg.layers):
        st: dict = {}
        layer = {
            key: linear(f"layers.{i}.{key}", cfg.attn_modes, d, d, st, key)
            for key in ("q", "k", "v", "o")
        }
        layer["ln1"] = _ln(d)
        layer["ffn_in"] = linear(f"layers.{i}.ffn_in", cfg.ffn_in_modes, cfg.ffn, d, st, "ffn_in")
        layer["ffn_out"] = linear(
            f"layers.{i}.ffn_out", cfg.ffn_out_modes, d, cfg.ffn, st, "ffn_out"
        )
        layer["ln2"] = _ln(d)
        params["layers"].append(layer)
        state["layers"].append(st)
    params["pooler"] = linear("pooler", cfg.attn_modes, d, d, state, "pooler")
    params["classifier"] = _dense_linear(cfg.num_labels, d, std, gen)
    return params, state


def dense_param_count(cfg: EncoderConfig) -> int:
    """Parameters of the dense baseline with this architecture (the compression reference)."""
    d, f = cfg.d_model, cfg.ffn
    embed = cfg.vocab_size * d + cfg.max_len * d + cfg.type_vocab * d + 2 * d
    layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
    return embed + cfg.layers * layer + (d * d + d) + (d * cfg.num_labels + cfg.num_labels)


def _linear(
    p: dict,
    s: dict | None,
    x: torch.Tensor,
    plan: C.plans.PlanLike,
    halves: C.plans.GroupedHalves | None = None,
) -> torch.Tensor:
    if is_tt_params(p):
        return C.tt_linear(p, s, x, plan=plan, halves=halves)  # type: ignore[arg-type]
    return F.linear(x, p["weight"], p.get("bias"))


BLOCK_LINEARS = ("q", "k", "v", "o", "ffn_in", "ffn_out")


def grouped_halves(
    params: dict, state: dict, plan_of: Callable[[str], C.plans.PlanLike]
) -> C.plans.GroupedHalves | None:
    """The blocks' TT linears whose plan reads halves (``comera``, ``dense``, ``auto``)
    gated and contracted together (:class:`comera.plans.GroupedHalves`); None when no two
    of them share their modes (whatever their ranks), where grouping saves nothing.
    ``plan_of(path)`` is a layer's plan (``layers.0.q``; None: the process default)."""
    layers, structures = [], set()
    for i, (p, s) in enumerate(zip(params["layers"], state["layers"], strict=True)):
        for n in BLOCK_LINEARS:
            plan = plan_of(f"layers.{i}.{n}")
            plan = C.get_default_plan() if plan is None else plan
            if is_tt_params(p[n]) and plan in ("comera", "dense", "auto"):
                layers.append((p[n], s[n]))
                cores = p[n]["cores"]
                modes = tuple(int(c.shape[1]) for c in cores)
                structures.add((modes, cores[0].dtype, cores[0].device))
    return C.plans.GroupedHalves(layers) if len(structures) < len(layers) else None


def _is_comera(plan: C.plans.PlanLike) -> bool:
    """Whether a layer's plan is the ``comera`` path (``None``: the process default)."""
    return (C.get_default_plan() if plan is None else plan) == "comera"


def _layer_norm(p: dict, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], p["weight"], p["bias"], eps=1e-12)


ATTENTION_RECOMPUTE_MIN = 1 << 20  # attention probabilities (elements) worth recomputing


def check_step_mode(model: EncoderConfig, step_mode: str) -> None:
    """Refuse ``model.recompute`` under ``train.step_mode='compile'``: torch.compile
    refuses RNG ops in a recomputed region, and the recomputed block holds them whatever
    the dropout rate (with ``model.dropout=0`` too the compile failed after ~13 s)."""
    if step_mode == "compile" and model.recompute:
        raise ConfigError(
            "model.recompute cannot be compiled (torch.compile refuses RNG ops in "
            "recomputed regions); drop --recompute or use --step-mode eager/sync_free"
        )


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, p_drop: float
) -> torch.Tensor:
    """Scaled dot-product attention ``(B, H, T, dh)``. On CPU, SDPA has no fused kernel
    with attention dropout and falls back to one that stores the ``(B, H, T, T)``
    probabilities for backward (432 MB for CodeBERT at batch 1 x 512); there the core is
    recomputed in backward instead, as flash attention does on GPU, with the same dropout
    mask (the RNG state is replayed), so values and gradients are unchanged. Only where
    the probabilities are large (``B * H * T * T >= 2**20``, 4 MB): checkpointing has a
    fixed cost (about 60 MB of resident memory on first use) that small attention never
    pays back (MNLI at batch 1 x 128: 142 -> 200 MB)."""
    big = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] >= ATTENTION_RECOMPUTE_MIN
    if (
        p_drop > 0
        and big
        and q.device.type == "cpu"
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()  # compiled code plans its own memory
    ):
        return checkpoint(F.scaled_dot_product_attention, q, k, v, attn_mask=mask,
                          dropout_p=p_drop, use_reentrant=False)  # fmt: skip
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p_drop)


def encoder_hidden(
    params: dict,
    state: dict,
    batch: dict[str, torch.Tensor],
    cfg: EncoderConfig,
    *,
    train: bool = False,
    plan: C.plans.PlanLike = None,
    plans: C.LayerPlans | None = None,
    attn_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hidden states ``(B, T, d)`` of the encoder stack for ``input_ids (B, T)``.

    ``attn_mask``: boolean ``(B, 1|H, T, T)`` (True = attend); default: keys allowed by
    ``batch["attention_mask"]``. ``position_ids (B, T)``: default ``0..T-1``.
    ``token_type_ids`` are optional (zeros). Dropout draws from torch's global RNG.
    ``plans`` picks the contraction per layer path (``layers.0.q``) and the TTM lookup;
    ``plan`` is one strategy for every layer (used when ``plans`` is None)."""

    def plan_of(path: str) -> C.plans.PlanLike:
        return plans.for_layer(path) if plans is not None else plan

    ids = batch["input_ids"]
    b, t = ids.shape
    if t > cfg.max_len:
        raise ValueError(f"encoder: sequence length {t} exceeds max_len={cfg.max_len}")
    p_drop = cfg.dropout if train else 0.0
    emb = params["embed"]
    if is_tt_params(emb["word"]):
        impl = plans.embedding_impl if plans is not None else "optimized"
        x = C.ttm_embedding(emb["word"], state["embed"]["word"], ids, impl=impl)  # (B, T, d)
    else:
        x = F.embedding(ids, emb["word"]["weight"])
    pos = (
        emb["position"][:t] if position_ids is None else F.embedding(position_ids, emb["position"])
    )
    types = batch.get("token_type_ids")
    types = emb["token_type"][0] if types is None else F.embedding(types, emb["token_type"])
    x = x + pos + types
    x = F.dropout(_layer_norm(emb["ln"], x), p_drop, train)
    if attn_mask is None:
        attn_mask = batch["attention_mask"].bool()[:, None, None, :]  # (B, 1, 1, T)
    h, dh = cfg.heads, cfg.d_model // cfg.heads
    halves = grouped_halves(params, state, plan_of) if cfg.grouped_halves else None

    def block(x: torch.Tensor, i: int, p: dict, s: dict) -> torch.Tensor:
        qkv = [(p[n], s.get(n), plan_of(f"layers.{i}.{n}")) for n in ("q", "k", "v")]
        if cfg.fused_qkv and all(is_tt_params(w) and _is_comera(pl) for w, _, pl in qkv):
            # one GEMM of x with the three input halves (comera.tt_linear_shared_input)
            outs = tt_linear_shared_input([(w, st) for w, st, _ in qkv], x, halves=halves)
        else:
            outs = [_linear(w, st, x, pl, halves) for w, st, pl in qkv]
        q, k, v = (o.view(b, t, h, dh).transpose(1, 2) for o in outs)  # (B, H, T, dh)
        att = _attention(q, k, v, attn_mask, p_drop)
        att = att.transpose(1, 2).reshape(b, t, cfg.d_model)
        x = _layer_norm(
            p["ln1"],
            x
            + F.dropout(
                _linear(p["o"], s.get("o"), att, plan_of(f"layers.{i}.o"), halves), p_drop, train
            ),
        )
        ff = F.gelu(
            _linear(p["ffn_in"], s.get("ffn_in"), x, plan_of(f"layers.{i}.ffn_in"), halves)
        )  # (B, T, ffn)
        return _layer_norm(
            p["ln2"],
            x
            + F.dropout(
                _linear(p["ffn_out"], s.get("ffn_out"), ff, plan_of(f"layers.{i}.ffn_out"), halves),
                p_drop,
                train,
            ),
        )

    recompute = cfg.recompute and train and torch.is_grad_enabled()
    for i, (p, s) in enumerate(zip(params["layers"], state["layers"], strict=True)):
        if recompute:  # keep only the block's input; rerun it in backward (same dropout)
            x = checkpoint(block, x, i, p, s, use_reentrant=False)
        else:
            x = block(x, i, p, s)
    return x


def encoder_logits(
    params: dict,
    state: dict,
    batch: dict[str, torch.Tensor],
    cfg: EncoderConfig,
    *,
    train: bool = False,
    plan: C.plans.PlanLike = None,
    plans: C.LayerPlans | None = None,
) -> torch.Tensor:
    """Class logits ``(B, num_labels)`` for a batch of ``input_ids``, ``token_type_ids`` and
    ``attention_mask`` (each ``(B, T)``): :func:`encoder_hidden`, then the pooler on the
    first token and the classifier."""
    x = encoder_hidden(params, state, batch, cfg, train=train, plan=plan, plans=plans)
    p_drop = cfg.dropout if train else 0.0
    pooler_plan = plans.for_layer("pooler") if plans is not None else plan
    pooled = torch.tanh(
        _linear(params["pooler"], state.get("pooler"), x[:, 0], pooler_plan)
    )  # (B, d)
    return _linear(params["classifier"], None, F.dropout(pooled, p_drop, train), None)
