"""GaLore (Zhao et al., 2024) as a baseline optimizer, through the ``galore-torch`` package.

GaLore keeps dense weights but runs Adam on a low-rank projection of each matrix's
gradient (re-projected every ``update_proj_gap`` steps), so its optimizer state is small
while the weights, their gradients and the activations stay dense. CoMERA's paper compares
against it (its Figure 1); here it is the dense model's third optimizer
(``TrainConfig.optimizer="galore"``), not re-implemented: install the extra with
``pip install -e ".[galore]"``.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch.utils._pytree import tree_flatten_with_path

from comera.errors import ConfigError, quiet_logger
from comera.train.fields import check_kinds
from comera.train.optim import AdamWConfig

__all__ = ["GaLore", "GaLoreConfig", "MissingExtraError", "import_galore"]


@dataclass(kw_only=True, slots=True)
class GaLoreConfig:
    """GaLore-AdamW settings. Every 2-D weight under a path matching ``targets`` (globs
    over dotted pytree paths; default the encoder blocks' linears, as GaLore applies it to
    attention and MLP layers, not to embeddings) with both sides > ``rank`` gets its
    gradient projected to ``rank`` (``proj_type`` "std", "reverse_std", "left", "right",
    "full"), the projection refreshed every ``update_proj_gap`` steps and the update scaled
    by ``scale``; every other parameter gets plain AdamW. Defaults: the GaLore paper's
    (rank 128, gap 200, scale 0.25). Learning rate, betas, eps and weight decay are the
    trainer's AdamW ``lr_rest``, ``betas``, ``eps`` and ``weight_decay``. A model with no
    weight to project is refused: that run would be plain AdamW under GaLore's name."""

    rank: int = 128
    update_proj_gap: int = 200
    scale: float = 0.25
    proj_type: str = "std"
    targets: tuple[str, ...] = ("layers.*",)

    def __post_init__(self) -> None:
        check_kinds(self)
        if (self.rank < 1 or self.update_proj_gap < 1 or not self.scale > 0
                or not math.isfinite(self.scale)):  # fmt: skip
            raise ConfigError(
                f"GaLoreConfig: rank and update_proj_gap >= 1 and a finite scale > 0 required, "
                f"got {self.rank}, {self.update_proj_gap}, {self.scale} (train.galore.rank, "
                "train.galore.update_proj_gap, train.galore.scale)"
            )
        if self.proj_type not in ("std", "reverse_std", "left", "right", "full"):
            raise ConfigError(
                f"GaLoreConfig.proj_type={self.proj_type!r} (train.galore.proj_type) is not a "
                "GaLore type; choose std, reverse_std, left, right or full"
            )


class MissingExtraError(ConfigError):
    """An optional package is not installed (the message says which extra to install)."""


def _path(keys: tuple) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)


def _move_projector(projector: Any, device: torch.device) -> None:
    """galore-torch keeps its projection matrix on the projector object, which
    ``Optimizer.load_state_dict`` does not move: put it next to its parameter."""
    ortho = getattr(projector, "ortho_matrix", None)
    if isinstance(ortho, torch.Tensor):
        projector.ortho_matrix = ortho.to(device)
    elif isinstance(ortho, list | tuple):
        projector.ortho_matrix = [t.to(device) for t in ortho]


def _why_none(named: list[torch.Tensor], cfg: GaLoreConfig) -> str:
    """Why no leaf is projected, naming the settings that would change it; ``named``: the
    2-D leaves the targets match."""
    found = (f"the largest short side among them is {max(min(p.shape) for p in named)}"
             if named else "they name no 2-D weight")  # fmt: skip
    return (
        f"GaLore would project no weight: it projects 2-D weights matched by "
        f"train.galore.targets={list(cfg.targets)} whose sides both exceed "
        f"train.galore.rank={cfg.rank}, and {found}; lower the rank or widen the targets "
        "(the run would otherwise be plain AdamW)"
    )


def import_galore() -> ModuleType:
    """``galore_torch``, imported without bitsandbytes' warning: galore-torch imports it,
    and its CPU backend warns that an optional kernel download failed (a line before every
    GaLore run's output and every one-line error), about 4-bit kernels GaLore never uses.
    Raises what the import raises (ImportError without the ``galore`` extra)."""
    with quiet_logger("bitsandbytes"):
        import galore_torch

    return galore_torch


class GaLore:
    """``galore_torch.GaLoreAdamW`` over the leaves of a params pytree, stepped with
    gradients the caller computed (the trainer reduces and clips them first)."""

    def __init__(self, params: Any, cfg: GaLoreConfig, lr: float, *, betas: tuple,
                 eps: float, weight_decay: float) -> None:  # fmt: skip
        try:
            GaLoreAdamW = import_galore().GaLoreAdamW  # noqa: N806 - the package's class
        except (ImportError, AttributeError):  # no extra, or a galore-torch without it
            raise MissingExtraError(
                "train.optimizer='galore' needs the galore-torch package: "
                "pip install -e '.[galore]'"
            ) from None
        flat = tree_flatten_with_path(params)[0]
        self.leaves = [t for _, t in flat]
        paths = [_path(k) for k, _ in flat]
        # a side equal to the rank would be projected onto itself: nothing saved, and
        # galore-torch's reverse_std then multiplies mismatched shapes
        named = {path for path in paths if any(fnmatch.fnmatchcase(path, g) for g in cfg.targets)}
        projected = [
            p.dim() == 2 and min(p.shape) > cfg.rank and path in named
            for path, p in zip(paths, self.leaves, strict=True)
        ]  # fmt: skip
        # AdamW's rule, as the trainer's: matrices decay, vectors (biases, norm gains) not
        kept = [p for p, j in zip(self.leaves, projected, strict=True) if not j]
        groups = [{"params": [p for p in kept if p.dim() >= 2]},
                  {"params": [p for p in kept if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
        groups = [g for g in groups if g["params"]]
        low = [p for p, j in zip(self.leaves, projected, strict=True) if j]
        if low:
            groups.append({"params": low, "rank": cfg.rank, "scale": cfg.scale,
                           "update_proj_gap": cfg.update_proj_gap,
                           "proj_type": cfg.proj_type})  # fmt: skip
        self.projected = len(low)
        self.unprojected_why = "" if low else _why_none(
            [p for path, p in zip(paths, self.leaves, strict=True)
             if path in named and p.dim() == 2], cfg,
        )  # fmt: skip
        self.base_lr = lr
        self.torch = GaLoreAdamW(
            groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            no_deprecation_warning=True,
        )  # fmt: skip

    @classmethod
    def with_adamw(cls, params: Any, cfg: GaLoreConfig, adamw: AdamWConfig) -> GaLore:
        """GaLore-AdamW over ``params`` with the trainer's AdamW settings: ``lr_rest``,
        ``betas``, ``eps`` and ``weight_decay`` (how the trainer builds it, and rebuilds
        it over the leaves a checkpoint restores)."""
        out = cls(params, cfg, adamw.lr_rest, betas=adamw.betas, eps=adamw.eps,
                  weight_decay=adamw.weight_decay)  # fmt: skip
        if not out.projected:  # a run under GaLore's name that is plain AdamW
            raise ConfigError(out.unprojected_why)
        return out

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
        self.torch.load_state_dict(self._regrouped(state))
        for p in self.leaves:  # moments follow their params; the projectors must be moved
            projector = self.torch.state.get(p, {}).get("projector")
            if projector is not None:
                _move_projector(projector, p.device)

    def _regrouped(self, state: dict) -> dict:
        """``state`` in this optimizer's groups, whose settings (weight decay, rank, ...) are
        always this config's, as the trainer's AdamW takes them from its config each step.
        A state saved when every unprojected leaf was in one group (decayed alike) is
        regrouped: the per-leaf state follows its leaf."""
        groups = self.torch.param_groups

        def ours(ids: list[list[int]]) -> list[dict]:  # this config's groups over saved ids
            return [{**{k: v for k, v in g.items() if k != "params"}, "params": i}
                    for g, i in zip(groups, ids, strict=True)]  # fmt: skip

        if len(state["param_groups"]) == len(groups):
            return {"state": state["state"],
                    "param_groups": ours([g["params"] for g in state["param_groups"]])}  # fmt: skip
        index = {id(p): i for i, p in enumerate(self.leaves)}
        now = [index[id(p)] for g in groups for p in g["params"]]
        low = {index[id(p)] for g in groups if "rank" in g for p in g["params"]}
        # the old order: the unprojected leaves, then the projected, each in leaf order
        before = [i for i in range(len(self.leaves)) if i not in low] + sorted(low)
        if len(state["param_groups"]) != 1 + bool(low) or len(before) != len(now):
            raise ValueError("GaLore state: its parameter groups do not match this model's")
        at = {leaf: k for k, leaf in enumerate(now)}
        moved = {at[before[int(k)]]: v for k, v in state["state"].items()}
        ids, start = [], 0  # the groups' leaves, numbered in order as torch saves them
        for g in groups:
            ids.append(list(range(start, start + len(g["params"]))))
            start += len(g["params"])
        return {"state": moved, "param_groups": ours(ids)}
