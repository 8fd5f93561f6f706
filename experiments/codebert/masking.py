"""RoBERTa's dynamic masking: a fresh mask for every batch.

Of the tokens that may be predicted (real document tokens: not padding, not BOS/EOS or
other special ids), each is chosen with probability ``rate`` (15%); a chosen token is
replaced by ``<mask>`` 80% of the time, by a random token 10% (a draw that lands on a
special id keeps the original) and kept 10%.
Labels are the original ids at chosen positions and -100 elsewhere. A batch in which the
draws choose no token (a short sequence, a batch of one: 6 eligible tokens miss all
with probability 0.38) has its eligible token of the smallest draw chosen: a batch with
nothing to predict gives no loss term, and the trainer refuses such a step (a resumed
run, masking alike, met it again). The draws come from
``generator`` (default: torch's global RNG, which the trainer checkpoints per rank, so a
resumed run masks exactly as an uninterrupted one).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["mask_tokens"]


def mask_tokens(
    ids: torch.Tensor,
    segment_ids: torch.Tensor,
    *,
    mask_id: int,
    vocab_size: int,
    special_ids: Sequence[int],
    rate: float = 0.15,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` for a batch of token ids ``(B, T)``."""
    if not 0 < rate < 1:
        raise ValueError(f"mask rate must be in (0, 1), got {rate}")
    special = torch.tensor(sorted(set(special_ids)), dtype=ids.dtype, device=ids.device)
    eligible = (segment_ids > 0) & ~torch.isin(ids, special)
    draw = torch.rand(ids.shape, generator=generator, device=ids.device)
    chosen = eligible & (draw < rate)
    if not bool(chosen.any()) and bool(eligible.any()):
        first = torch.where(eligible, draw, torch.full_like(draw, 2.0)).argmin()
        chosen = chosen.reshape(-1).clone()
        chosen[first] = True
        chosen = chosen.reshape(ids.shape)
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    how = torch.rand(ids.shape, generator=generator, device=ids.device)
    random_ids = torch.randint(0, vocab_size, ids.shape, generator=generator, device=ids.device)
    random_ids = torch.where(torch.isin(random_ids, special), ids, random_ids)
    out = torch.where(chosen & (how < 0.8), torch.full_like(ids, mask_id), ids)
    out = torch.where(chosen & (how >= 0.8) & (how < 0.9), random_ids, out)
    return out, labels
