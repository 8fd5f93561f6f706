"""AdamW over a params pytree, with its moments stored as params-shaped trees.

Keeping the moments shaped like the params is what lets compaction slice them rank for
rank with the cores (:func:`comera.tree.compact_tree`): no stale state survives for a
removed rank and nothing needs re-registering. Three groups with their own learning
rates, as in the paper: TT ``cores``, rank ``gates``, and the ``rest``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten_with_path, tree_map

from comera.errors import ConfigError
from comera.tensor_train import is_tt_params
from comera.train.fields import check_kinds
from comera.tree import leaves as tree_leaves

__all__ = [
    "OPTIMIZERS",
    "AdamWConfig",
    "SGDConfig",
    "adamw_init",
    "adamw_step",
    "leaf_groups",
    "sgd_step",
]

GROUPS = ("cores", "gates", "rest")
OPTIMIZERS = ("adamw", "sgd", "galore")


@dataclass(kw_only=True, slots=True)
class AdamWConfig:
    """Per-group learning rates (the paper's: cores 1e-4, gates 1e-3, rest 5e-5)."""

    lr_cores: float = 1e-4
    lr_gates: float = 1e-3
    lr_rest: float = 5e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        check_kinds(self)
        for name in ("lr_cores", "lr_gates", "lr_rest", "eps", "weight_decay"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):  # NaN passes a ``< 0`` test
                raise ConfigError(f"AdamWConfig.{name} must be a finite number >= 0, got {value}")
        if not self.eps > 0:  # eps 0 divides 0 by 0 for a leaf whose gradient is all 0
            raise ConfigError(f"AdamWConfig.eps must be > 0, got {self.eps}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(
                f"AdamWConfig.betas must be two numbers in [0, 1), got {tuple(self.betas)}"
            )

    def lr(self, group: str) -> float:
        return {"cores": self.lr_cores, "gates": self.lr_gates, "rest": self.lr_rest}[group]


def leaf_groups(params: object) -> list[str]:
    """Group of every leaf, in ``tree_flatten`` order: an element of a TT/TTM layer's
    ``cores`` or ``gates`` list is a TT core or gate, everything else (biases, norms,
    dense, and a dense tensor that is merely named ``gates``, such as a router) is rest."""
    out = []
    for path, _ in tree_flatten_with_path(params)[0]:
        keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        group = "rest"
        if len(keys) >= 2 and keys[-2] in ("cores", "gates"):
            node = params
            for k in keys[:-2]:
                node = node[k]  # type: ignore[index]
            group = keys[-2] if is_tt_params(node) else "rest"
        out.append(group)
    return out


def adamw_init(params: object) -> dict:
    """Optimizer state: a step count, each leaf's group, and zeroed moments shaped like params.

    The groups are computed once: compaction changes leaf shapes, never the tree."""
    return {
        "step": 0,
        "groups": leaf_groups(params),
        "m": tree_map(lambda t: torch.zeros_like(t, memory_format=torch.preserve_format), params),
        "v": tree_map(lambda t: torch.zeros_like(t, memory_format=torch.preserve_format), params),
    }


@torch.no_grad()
def adamw_step(
    params: object,
    grads: list[torch.Tensor | None],
    opt: dict,
    cfg: AdamWConfig,
    lr_scale: float = 1.0,
) -> dict:
    """One AdamW update, in place on ``params`` and the moments; returns the state.

    ``grads`` follow ``tree_flatten(params)`` order (None: no gradient, skipped).
    Weight decay is decoupled and applies to matrices and TT cores (``dim >= 2``), not to
    gates, biases or norms. Each group is updated by torch's fused AdamW kernel where it
    has one (CPU and CUDA, floating dtypes): one call per group walks every tensor, where
    the ``torch._foreach_*`` chain (the fallback) makes seven passes; a TT model has three
    times a dense model's leaves, most of them tiny, so passes are what cost.
    """
    leaves, ms, vs = tree_leaves(params), tree_leaves(opt["m"]), tree_leaves(opt["v"])
    groups = opt.get("groups") or leaf_groups(params)
    if not len(leaves) == len(ms) == len(vs) == len(grads) == len(groups):
        raise ValueError(
            f"adamw_step: {len(leaves)} params, {len(grads)} grads, {len(ms)} moments; the "
            "optimizer state does not match the params (was it compacted with them?)"
        )
    step = opt["step"] + 1
    b1, b2 = cfg.betas
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    # one pass sorts the leaves to update by group and by decay (a TT model has hundreds
    # of tiny leaves: passes over them, not the kernel, are most of this step's cost)
    work: dict[str, tuple[list[int], list[int]]] = {g: ([], []) for g in GROUPS}
    for i, (gr, g, p) in enumerate(zip(groups, grads, leaves, strict=True)):
        if g is not None and p.numel() and gr in work:
            work[gr][p.dim() < 2].append(i)  # matrices and cores first, then vectors
    for group in GROUPS:
        mats, vecs = work[group]
        idx = mats + vecs
        if not idx:
            continue
        ps, gs = [leaves[i] for i in idx], [grads[i] for i in idx]
        m, v = [ms[i] for i in idx], [vs[i] for i in idx]
        lr = cfg.lr(group) * lr_scale
        if _fusable(ps, gs, m, v):
            decay = cfg.weight_decay if group != "gates" else 0.0
            count = torch.full((), float(step), device=ps[0].device)  # its bias corrections
            # the kernel takes one weight decay per call: decayed matrices, then the rest
            for lo, hi, wd in ((0, len(mats), decay), (len(mats), len(idx), 0.0)):
                if lo < hi:
                    _fused(ps[lo:hi], gs[lo:hi], m[lo:hi], v[lo:hi], count, lr, cfg, wd)
            continue
        if cfg.weight_decay and group != "gates" and mats:
            torch._foreach_mul_(ps[: len(mats)], 1 - lr * cfg.weight_decay)
        torch._foreach_lerp_(m, gs, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, gs, gs, value=1 - b2)
        denom = torch._foreach_div(v, bc2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, cfg.eps)
        torch._foreach_addcdiv_(ps, m, denom, value=-lr / bc1)
    return {**opt, "step": step, "groups": groups}


def _fusable(ps: list[torch.Tensor], gs: list[torch.Tensor], m: list[torch.Tensor],
             v: list[torch.Tensor]) -> bool:  # fmt: skip
    """Whether torch's fused AdamW kernel takes these params, gradients and moments: one
    floating dtype and device, dense, and every tensor contiguous (the kernel walks raw
    memory: a transposed or sliced parameter would be updated out of place)."""
    first = ps[0]
    device = first.device
    if device.type not in ("cpu", "cuda") or not first.is_floating_point():
        return False
    dtype = first.dtype
    for ts in (ps, gs, m, v):  # one loop, no generator: it meets every leaf four times
        for t in ts:
            if t.is_sparse or t.dtype != dtype or not t.is_contiguous() or t.device != device:
                return False
    return True


def _fused(ps: list, gs: list, m: list, v: list, count: torch.Tensor, lr: float,
           cfg: AdamWConfig, weight_decay: float) -> None:  # fmt: skip
    """One ``torch._fused_adamw_`` call (one weight decay); the math is the foreach
    path's. ``count`` is the step as a tensor: the kernel's bias corrections."""
    b1, b2 = cfg.betas
    torch._fused_adamw_(
        ps, gs, m, v, [], [count] * len(ps), lr=lr, beta1=b1, beta2=b2,
        weight_decay=weight_decay, eps=cfg.eps, amsgrad=False, maximize=False,
    )  # fmt: skip


@dataclass(kw_only=True, slots=True)
class SGDConfig:
    """Plain SGD, no momentum or weight decay (the DLRM reference's optimizer, lr 0.1 there).

    ``lr_gates`` lets a CoMERA model under SGD move its rank gates at their own rate;
    ``None`` uses ``lr``."""

    lr: float = 0.1
    lr_gates: float | None = None

    def __post_init__(self) -> None:
        check_kinds(self)
        if not (math.isfinite(self.lr) and self.lr > 0) or (
            self.lr_gates is not None and not (math.isfinite(self.lr_gates) and self.lr_gates >= 0)
        ):
            raise ConfigError(
                f"SGDConfig: lr must be finite and > 0, lr_gates None or finite and >= 0, "
                f"got {self.lr}, {self.lr_gates}"
            )

    def lr_for(self, group: str) -> float:
        """The learning rate of a leaf group (``gates`` may have its own)."""
        return self.lr_gates if group == "gates" and self.lr_gates is not None else self.lr


@torch.no_grad()
def sgd_step(
    params: object,
    grads: list[torch.Tensor | None],
    opt: dict,
    cfg: SGDConfig,
    lr_scale: float = 1.0,
) -> dict:
    """One SGD update in place: ``p -= lr * g``. A sparse ``g`` touches only its rows;
    ``None`` (no gradient) leaves the leaf alone, which for SGD equals a zero gradient."""
    leaves = tree_leaves(params)
    if len(leaves) != len(grads):
        raise ValueError(f"sgd_step: {len(leaves)} params but {len(grads)} grads")
    groups = opt.get("groups") or leaf_groups(params)
    for p, g, group in zip(leaves, grads, groups, strict=True):
        if g is None or not p.numel():
            continue
        p.add_(g, alpha=-cfg.lr_for(group) * lr_scale)
    return {**opt, "step": opt["step"] + 1, "groups": groups}
