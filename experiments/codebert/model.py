"""RoBERTa-style masked-LM encoder over packed rows, as pure functions of a params pytree.

The encoder is :func:`experiments.transformer.encoder_hidden` (post-LN blocks, TT linears
and a TTM word embedding when ``cfg.tt``). Packed rows hold several documents: attention
is confined to each document (``segment_ids``; padding, segment 0, attends only to
itself) and positions restart at every document, so a packed row computes what separate
rows would. The MLM head is RoBERTa's: dense d->d, GELU, LayerNorm, then the decoder tied
to the word embedding (a TTM table is built in checkpointed row blocks when it is large
and few tokens are masked: ``tied_logits``) plus an output bias. Logits are computed only
at the positions that carry a label.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import comera as C
from comera.layers import ttm_logits
from comera.tensor_train import is_tt_params
from experiments.transformer import EncoderConfig, encoder_hidden, init_encoder

__all__ = ["document_mask", "init_mlm", "mlm_logits", "segment_positions", "tied_logits"]


def document_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` segment ids -> boolean attention mask ``(B, 1, T, T)``: a token attends to
    tokens of its own document; padding (segment 0) attends only to itself."""
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, T, T)
    real = (segment_ids > 0)[:, :, None]
    eye = torch.eye(segment_ids.shape[1], dtype=torch.bool, device=segment_ids.device)
    return ((same & real) | eye)[:, None]


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """Position of each token within its document piece: 0 at every segment change."""
    t = segment_ids.shape[1]
    idx = torch.arange(t, device=segment_ids.device).expand_as(segment_ids)
    start = torch.ones_like(segment_ids, dtype=torch.bool)
    start[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first  # (B, T)


def init_mlm(cfg: EncoderConfig, *, generator: torch.Generator) -> tuple[dict, dict]:
    """Encoder (no pooler or classifier) plus the MLM head."""
    params, state = init_encoder(cfg, generator=generator)
    params.pop("pooler"), params.pop("classifier")
    state.pop("pooler", None)
    d, std = cfg.d_model, cfg.init_std
    params["lm_head"] = {
        "dense": {"weight": torch.randn(d, d, generator=generator) * std, "bias": torch.zeros(d)},
        "ln": {"weight": torch.ones(d), "bias": torch.zeros(d)},
        "bias": torch.zeros(cfg.vocab_size),
    }
    return params, state


def tied_logits(params: dict, state: dict, h: torch.Tensor, cfg: EncoderConfig) -> torch.Tensor:
    """``h (M, d)`` against the word embedding: ``(M, V)`` logits, no bias. A TTM table is
    built in checkpointed blocks of rows, or whole when small
    (:func:`comera.layers.ttm_logits`)."""
    word = params["embed"]["word"]
    if not is_tt_params(word):
        return F.linear(h, word["weight"])
    return ttm_logits(word, state["embed"]["word"], h, rows=cfg.vocab_size)


def mlm_logits(
    params: dict,
    state: dict,
    batch: dict[str, torch.Tensor],
    cfg: EncoderConfig,
    *,
    train: bool = False,
    plans: C.LayerPlans | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits (M, V), targets (M,))`` at the ``M`` positions whose ``labels`` are not
    -100, for ``input_ids``, ``segment_ids`` and ``labels`` (each ``(B, T)``)."""
    seg = batch["segment_ids"]
    hidden = encoder_hidden(
        params,
        state,
        {"input_ids": batch["input_ids"]},
        cfg,
        train=train,
        plans=plans,
        attn_mask=document_mask(seg),
        position_ids=segment_positions(seg),
    )  # (B, T, d)
    where = batch["labels"] != -100
    h = hidden[where]  # (M, d)
    head = params["lm_head"]
    h = F.gelu(F.linear(h, head["dense"]["weight"], head["dense"]["bias"]))
    h = F.layer_norm(h, h.shape[-1:], head["ln"]["weight"], head["ln"]["bias"], eps=1e-5)
    logits = tied_logits(params, state, h, cfg) + head["bias"]  # (M, V)
    return logits, batch["labels"][where]
