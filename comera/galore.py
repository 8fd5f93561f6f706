"""GaLore (Zhao et al., 2024) as a baseline optimizer, through the ``galore-torch`` package.

GaLore keeps dense weights but runs Adam on a low-rank projection of each matrix's
gradient (re-projected every ``update_proj_gap`` steps), so its optimizer state is small
while the weights, their gradients and the activations stay dense. CoMERA's paper compares
against it (its Figure 1); here it is the dense model's third optimizer
(``TrainConfig.optimizer="galore"``), not re-implemented: install the extra with
``pip install -e ".[galore]"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["GaLore", "GaLoreConfig"]


@dataclass(kw_only=True, slots=True)
class GaLoreConfig:
    """GaLore-AdamW settings. Every 2-D weight with both sides >= ``rank`` gets its
    gradient projected to ``rank`` (``proj_type`` "std", "reverse_std", "left", "right",
    "full"), the projection refreshed every ``update_proj_gap`` steps and the update scaled
    by ``scale``; every other parameter gets plain AdamW. Defaults: the GaLore paper's
    (rank 128, gap 200, scale 0.25). Learning rate, betas, eps and weight decay are the
    trainer's AdamW ``lr_rest``, ``betas``, ``eps`` and ``weight_decay``."""

    rank: int = 128
    update_proj_gap: int = 200
    scale: float = 0.25
    proj_type: str = "std"

    def __post_init__(self) -> None:
        if self.rank < 1 or self.update_proj_gap < 1 or not self.scale > 0:
            raise ValueError(
                f"GaLoreConfig: rank and update_proj_gap >= 1, scale > 0 required, got "
                f"{self.rank}, {self.update_proj_gap}, {self.scale}"
            )
        if self.proj_type not in ("std", "reverse_std", "left", "right", "full"):
            raise ValueError(f"GaLoreConfig.proj_type={self.proj_type!r} is not a GaLore type")


class GaLore:
    """``galore_torch.GaLoreAdamW`` over the leaves of a params pytree, stepped with
    gradients the caller computed (the trainer reduces and clips them first)."""

    def __init__(self, params: Any, cfg: GaLoreConfig, lr: float, *, betas: tuple,
                 eps: float, weight_decay: float) -> None:  # fmt: skip
        try:
            from galore_torch import GaLoreAdamW
        except ImportError as exc:
            raise ImportError(
                "optimizer='galore' needs the galore-torch package: pip install -e '.[galore]'"
            ) from exc
        self.leaves = tree_flatten(params)[0]
        projected = [p.dim() == 2 and min(p.shape) >= cfg.rank for p in self.leaves]
        groups = [{"params": [p for p, j in zip(self.leaves, projected, strict=True) if not j]}]
        low = [p for p, j in zip(self.leaves, projected, strict=True) if j]
        if low:
            groups.append({"params": low, "rank": cfg.rank, "scale": cfg.scale,
                           "update_proj_gap": cfg.update_proj_gap,
                           "proj_type": cfg.proj_type})  # fmt: skip
        self.projected = len(low)
        self.base_lr = lr
        self.torch = GaLoreAdamW(
            groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            no_deprecation_warning=True,
        )  # fmt: skip

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor | None], lr_scale: float = 1.0) -> None:
        """One update in place with ``grads`` (``tree_flatten`` order; None: skipped)."""
        for p, g in zip(self.leaves, grads, strict=True):
            p.grad = None if g is None else (g.to_dense() if g.is_sparse else g)
        for group in self.torch.param_groups:
            group["lr"] = self.base_lr * lr_scale
        self.torch.step()
        for p in self.leaves:
            p.grad = None

    def state_dict(self) -> dict:
        return self.torch.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.torch.load_state_dict(state)
