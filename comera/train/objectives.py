"""CoMERA's rank-shrinking objectives.

Early stage: ``L + gamma * R(d)``. ``R`` is the mean magnitude of the live gates
(``kind="mean"``, what the authors' public code computes: gates above the threshold,
summed, divided by their count) or their sum (``kind="l1"``, the L1 norm the paper's text
writes). Both pull every live gate toward zero at the same rate under Adam; they differ
in scale by the number of live gates, which the mean divides out.
Late stage: a size target ``S0 = c * S(end of early stage)`` and a loss target ``L0``;
each step puts its weight on whichever objective is relatively further from its target
(``(L - L0) / L0`` vs ``(S - S0) / S0``, the achievement-scalarization of the paper) plus
a small weighted sum ``rho * (L / L0 + S / S0)`` of both, so neither is ever ignored.

``S(d)`` is the differentiable size surrogate of the paper: for every train,
``sum_k n_k * ||d_{k-1}||_1 * ||d_k||_1`` over live gates (edge bonds count 1), which
equals the stored core parameter count while every gate is one. Scaling a gate down and
the neighbouring core up by the same factor lowers it while the weight, every rank and
every parameter stay as they were, and an optimizer finds that direction: ``S`` falls,
the model does not shrink.

``share_size`` is the default late-stage size measure instead: the same count with every
bond's rank ``r_k`` replaced by a soft rank ``rho_k = sum_i s_i / max_i s_i`` over the
shares ``s_i`` of :func:`comera.pruning.rank_shares` (the part of the layer's weight each
rank carries). Shares do not move under that scaling, nor under scaling a layer's weight
as a whole; ``rho_k`` equals ``r_k`` while every rank carries the same share and falls
toward the number of ranks that carry the weight, so lowering it makes ranks dispensable,
which the late stage's pruning then removes (see :mod:`comera.train.stages`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from comera.pruning import batched_shares
from comera.tensor_train import check_state, pad_stack
from comera.tree import iter_tt

__all__ = ["LateWeights", "gate_regularizer", "late_weights", "share_size", "size_surrogate"]


def _live_gate_abs(path: str, p: dict, s: dict) -> list[torch.Tensor]:
    check_state(p, s, path)
    return [g.abs() * m.to(g.dtype) for g, m in zip(p["gates"], s["masks"], strict=True)]


def gate_regularizer(params: object, state: object, kind: str = "mean") -> torch.Tensor:
    """Mean (``kind="mean"``) or sum (``kind="l1"``) of the live gates' magnitudes over
    every TT/TTM layer in the model.

    All gates and masks are concatenated first: a handful of kernels instead of a few
    per bond (the paper model has ~200 bonds)."""
    gates, masks = [], []
    for path, p, s in iter_tt(params, state):
        check_state(p, s, path)
        gates += p["gates"]
        masks += s["masks"]
    if not gates:
        raise ValueError("gate_regularizer: the params tree holds no TT/TTM layer")
    if kind not in ("mean", "l1"):
        raise ValueError(f"gate_regularizer: kind={kind!r}; choose 'mean' or 'l1'")
    g = torch.cat(gates)
    m = torch.cat(masks).to(g.dtype)
    # summed in at least fp32: fp16 counts and sums end at 65504
    dtype = torch.promote_types(g.dtype, torch.float32)
    total = (g.abs() * m).sum(dtype=dtype)
    return total if kind == "l1" else total / m.sum(dtype=dtype).clamp(min=1)


def size_surrogate(params: object, state: object) -> torch.Tensor:
    """Differentiable size estimate ``sum_k n_k ||d_{k-1}||_1 ||d_k||_1`` over all layers."""
    total: torch.Tensor | None = None
    for path, p, s in iter_tt(params, state):
        cores: list[torch.Tensor] = p["cores"]
        # summed in at least fp32: a model's size overflows fp16 (65504)
        dtype = torch.promote_types(cores[0].dtype, torch.float32)
        norms = [a.sum(dtype=dtype) for a in _live_gate_abs(path, p, s)]
        one = cores[0].new_ones((), dtype=dtype)
        full = [one, *norms, one]
        for k, c in enumerate(cores):
            n_k = math.prod(c.shape[1:-1])
            term = n_k * full[k] * full[k + 1]
            total = term if total is None else total + term
    if total is None:
        raise ValueError("size_surrogate: the params tree holds no TT/TTM layer")
    return total


# On the CPU, structures of layers (modes and number of cores) are measured in one
# zero-padded batch while the batch's padded cores hold at most this many elements (4 MiB
# of fp32) and padding at most doubles them: at such sizes the late stage's step pays for
# the measure's ops, not their arithmetic (MNLI smoke, 14 layers in 4 structures: 6.7 ms
# of a 30 ms step, 2.3 ms batched). Larger structures keep their own batch, where padding
# would add real work; so does every structure on an accelerator, where a mixed batch
# would need its per-layer mode sizes copied to the device each step (a host wait, and
# no CUDA graph capture).
SHARE_BATCH_ELEMENTS = 1 << 20
PAD_RATIO = 2.0


def share_size(params: object, state: object) -> torch.Tensor:
    """Symmetry-invariant size ``sum_k n_k rho_{k-1} rho_k + sum_k rho_k`` over all layers.

    ``rho_k = sum_i s_i / max_i s_i`` is bond ``k``'s soft rank over its live ranks'
    shares (edge bonds count 1). Its value does not move under the gate/core scaling;
    its gradient reaches the gates only (the cores are held), so the size term works
    the rank selectors, as the paper's ``S`` does, and the cores keep learning from the
    loss (with the cores in the gradient, a size-led step turns every core toward the
    size term, and the model loses more of what it learned for the same target). The
    pull lowers every rank's gate but each bond's largest at the same rate under Adam,
    and the loss decides which ranks keep theirs.
    Equals the layers' stored core and gate count while all shares on a bond are equal.
    A model whose every layer was pruned to nothing has size 0 (a constant).

    Layers are measured in batches, zero-padded (:func:`comera.pruning.batched_shares`):
    the late stage computes this every step, and per layer it is a few dozen small ops.
    Layers of one structure (modes, dtype, device) always share a batch. On the CPU,
    structures are also merged, greedily in model order, into the first batch that stays
    small (:data:`SHARE_BATCH_ELEMENTS`, :data:`PAD_RATIO`), whatever their modes and
    number of cores."""
    buckets: dict[tuple, list[tuple[str, dict, dict]]] = {}
    layers = 0
    for path, p, s in iter_tt(params, state):
        check_state(p, s, path)
        layers += 1
        cores: list[torch.Tensor] = p["cores"]  # edge ranks 1: check_state refuses others
        if any(int(c.shape[-1]) == 0 for c in cores[:-1]):  # no rank: the zero map, size 0
            continue
        buckets.setdefault((cores[0].dtype, cores[0].device), []).append((path, p, s))
    if not layers:
        raise ValueError("share_size: the params tree holds no TT/TTM layer")
    terms = []
    for (_, device), members in buckets.items():
        structures: dict[tuple, list[int]] = {}
        shapes = [_shapes(p) for _, p, _ in members]
        for i, train in enumerate(shapes):
            structures.setdefault(tuple(n for _, n, _ in train), []).append(i)
        batches: list[list[int]] = []
        for group in structures.values():  # into the first batch it pads little
            for batch in batches if device.type == "cpu" else ():
                merged = [shapes[i] for i in batch + group]
                padded = _padded_elements(merged)
                if padded <= SHARE_BATCH_ELEMENTS and padded <= PAD_RATIO * _elements(merged):
                    batch += group
                    break
            else:
                batches.append(list(group))
        terms += [_group_size([members[i] for i in batch]) for batch in batches]
    return torch.stack(terms).sum() if terms else torch.zeros(())  # every layer pruned away


def _shapes(p: dict) -> list[tuple[int, int, int]]:
    """A train's cores' shapes as ``(r, n, r')`` (a TTM core's ``v * d`` as ``n``)."""
    return [(int(c.shape[0]), math.prod(c.shape[1:-1]), int(c.shape[-1])) for c in p["cores"]]


def _elements(shapes: list[list[tuple[int, int, int]]]) -> int:
    """Core elements of trains of these core shapes."""
    return sum(math.prod(s) for train in shapes for s in train)


def _padded_elements(shapes: list[list[tuple[int, int, int]]]) -> int:
    """Core elements of trains of these core shapes, stacked as :func:`_group_size` pads
    them."""
    total = 0
    for k in range(max(len(train) for train in shapes)):
        at_k = [train[k] for train in shapes if k < len(train)]
        total += len(shapes) * math.prod(max(s[i] for s in at_k) for i in range(3))
    return total


def _on(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``t.to(device, dtype)``, skipping the dispatch when it is already there: this runs
    for every bond of every layer, every late-stage step."""
    return t if t.dtype == dtype and t.device == device else t.to(device, dtype)


def _group_size(members: list[tuple[str, dict, dict]]) -> torch.Tensor:
    """:func:`share_size`'s summed terms of ``L`` layers, zero-padded to their largest
    modes and ranks. A layer with fewer cores is extended by ``1 x 1 x 1`` cores holding
    one, joined by bonds of rank 1 with gate one: the Grams pass through them unchanged,
    and the added modes and bonds weigh nothing in the size. Layers of one structure
    weigh their modes by plain numbers; a mixed batch (on the CPU only, see
    :func:`share_size`) by a tensor of each layer's modes."""
    first = members[0][1]["cores"][0]
    # at least fp32: a half-precision Gram (fp16's range ends at 65504) overflows for a
    # table of a few thousand rows, and the shares become 0 or NaN
    dtype, dev = torch.promote_types(first.dtype, torch.float32), first.device
    tiny = torch.finfo(dtype).tiny
    with torch.no_grad():  # the cores are held: their copies need no graph
        trains = [[c.reshape(c.shape[0], -1, c.shape[-1]).to(dtype) for c in p["cores"]]
                  for _, p, _ in members]  # fmt: skip
    n_cores = max(len(t) for t in trains)
    one_core = torch.ones(1, 1, 1, dtype=dtype, device=dev)
    one_gate = torch.ones(1, dtype=dtype, device=dev)
    live = torch.ones(1, dtype=torch.bool, device=dev)
    cores, gates = [], []
    for k in range(n_cores):
        with torch.no_grad():  # the cores are held: their padded copy needs no graph
            cores.append(pad_stack([t[k] if k < len(t) else one_core for t in trains]))
        if k < n_cores - 1:
            g = pad_stack([_on(p["gates"][k], dtype, dev) if k < len(t) - 1 else one_gate
                           for (_, p, _), t in zip(members, trains, strict=True)])  # fmt: skip
            m = pad_stack([_on(s["masks"][k], torch.bool, dev) if k < len(t) - 1 else live
                           for (_, _, s), t in zip(members, trains, strict=True)])  # fmt: skip
            gates.append(torch.where(m, g, 0.0))
    # amax, as the per-layer max(): tied shares split the gradient rather than one take it
    soft = [sh.sum(1) / sh.amax(1).clamp_min(tiny) for sh in batched_shares(cores, gates)]
    one = torch.ones(len(members), dtype=dtype, device=dev)
    modes = [[int(t[k].shape[1]) if k < len(t) else 0 for k in range(n_cores)] for t in trains]
    weights: list = list(modes[0])
    rhos = soft
    if any(m != modes[0] for m in modes):
        # an added core's mode weighs 0
        weights = list(torch.tensor(modes, dtype=dtype, device=dev).unbind(1))
    if any(len(t) < n_cores for t in trains):
        # (L, K - 1): bond k is the layer's own while core k + 1 is; an added bond counts 1
        # beside a mode (as an edge bond does) and 0 on its own
        own = torch.tensor([[k + 1 < len(t) for k in range(n_cores - 1)] for t in trains],
                           device=dev)  # fmt: skip
        rhos = [torch.where(own[:, k], r, 1.0) for k, r in enumerate(soft)]
        soft = [torch.where(own[:, k], r, 0.0) for k, r in enumerate(soft)]
    full = [one, *rhos, one]
    size = sum(weights[k] * full[k] * full[k + 1] for k in range(n_cores)) + sum(soft, 0 * one)
    return size.sum()


@dataclass(frozen=True, slots=True)
class LateWeights:
    """Weights of loss and size in one late-stage step, and which objective led."""

    loss: float
    size: float
    focus: str  # "loss" or "size"


def late_weights(
    loss: float, size: float, loss_target: float, size_target: float, rho: float
) -> LateWeights:
    """Weights for ``w_L * L + w_S * S`` in the late stage.

    The objective ``max((L - L0) / L0, (S - S0) / S0) + rho * (L / L0 + S / S0)`` has
    this gradient; computing the weights from (all-reduced) values keeps every
    data-parallel rank on the same branch.
    """
    if loss_target <= 0 or size_target <= 0:
        raise ValueError(
            f"late stage targets must be > 0, got loss_target={loss_target}, "
            f"size_target={size_target}"
        )
    gap_loss = (loss - loss_target) / loss_target
    gap_size = (size - size_target) / size_target
    focus = "loss" if gap_loss >= gap_size else "size"
    w_loss = rho / loss_target + (1.0 / loss_target if focus == "loss" else 0.0)
    w_size = rho / size_target + (1.0 / size_target if focus == "size" else 0.0)
    return LateWeights(w_loss, w_size, focus)
