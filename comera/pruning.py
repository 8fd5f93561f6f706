"""Rank pruning: which ranks of a TT/TTM layer die, and dropping them for real.

:func:`prune` turns ranks off in the rank state (the masks), :func:`compact` then removes
the dead ranks from the cores and gates so parameters and FLOPs shrink; :func:`live_ranks`
reads the masks. Two rules decide what dies: the paper's gate magnitude, and each rank's
share of the weight (:func:`rank_contributions`), explained below.

**Shares.** A gate alone is a poor measure of a rank's importance: cores and gates have a
scale symmetry. Multiplying ``d_k[i]`` by ``a`` and dividing the next core's slice
``G_{k+1}[i, ...]`` by ``a`` leaves the weight unchanged but shrinks the gate, so a rank
that carries most of ``W`` can look dead to a gate-magnitude threshold (a gate L1 penalty
without weight decay on the cores drives exactly that drift).

Splitting the train at internal bond ``k`` writes the weight as a sum of outer products,

    W = sum_i d_k[i] m_k[i] * (Left_i ⊗ Right_i),

where ``Left_i`` is the gated left partial train ``G_1 .. G_k`` ending in rank index ``i``
(``d_k`` itself excluded) and ``Right_i`` the gated right partial train ``G_{k+1} .. G_K``
starting in it. Each term's Frobenius norm is ``|d_k[i]| ||Left_i|| ||Right_i||``, and its
ratio to ``||W||_F`` is the rank's *share*: invariant under the scale symmetry (on every
bond) and under scaling ``W`` as a whole.
"""

from __future__ import annotations

import math

import torch

from comera.errors import ConfigError
from comera.spec import as_number
from comera.tensor_train import Params, State, check_state

__all__ = [
    "PRUNE_RULES",
    "batched_shares",
    "check_prune_rule",
    "compact",
    "kept_indices",
    "live_ranks",
    "prune",
    "rank_contributions",
    "rank_shares",
    "slice_ranks",
]


def _as_3way(core: torch.Tensor) -> torch.Tensor:
    """A TT core as is, a TTM core (r, v, d, r') with its two middle modes merged."""
    return core.reshape(core.shape[0], math.prod(core.shape[1:-1]), core.shape[-1])


def _shares(cores: list[torch.Tensor], gates: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every bond's shares from 3-way cores and masked gates, in their dtype.

    No host read and no branch on values, so it runs under autograd, in a sync-free step
    and under ``torch.compile``; the square roots are clamped away from 0 so a dead rank's
    gradient is 0, not NaN."""
    return [s[0] for s in batched_shares([c[None] for c in cores], [g[None] for g in gates])]


def batched_shares(cores: list[torch.Tensor], gates: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`_shares` of ``L`` trains at once: cores ``(L, r, n, r')`` and masked gates
    ``(L, r)`` -> one ``(L, r)`` share matrix per bond.

    Trains of other ranks or modes can share a batch zero-padded to the largest: a padded
    rank has a zero gate and a padded mode zero cores, so neither adds to any Gram matrix,
    and a padded rank's share is 0. A shorter train can be lengthened by ``1 x 1 x 1``
    cores holding one joined by gate-one bonds (its added bonds then carry share 1, or 0
    for a zero weight)."""
    n_bonds = len(gates)
    batch = cores[0].shape[0]
    one = cores[0].new_ones(batch, 1, 1)
    tiny = torch.finfo(cores[0].dtype).tiny

    # Left Grams: lefts[k] = P over the trailing bond of core k, d_k excluded.
    lefts: list[torch.Tensor] = []
    p = one
    for k, core in enumerate(cores):
        if k > 0:
            g = gates[k - 1]
            p = g[:, :, None] * p * g[:, None, :]
        _, r, n, r2 = core.shape
        t = torch.bmm(p, core.reshape(batch, r, n * r2)).reshape(batch, r * n, r2)  # P G
        p = torch.bmm(core.reshape(batch, r * n, r2).transpose(1, 2), t)
        if k < n_bonds:
            lefts.append(p)
    # (L, 1, 1) at the end
    norm_sq = p.reshape(batch, -1)[:, 0] if p.numel() else cores[0].new_zeros(batch)

    # Right Grams: rights[k] = Q over the leading bond of core k+1 (gates after it in).
    rights: list[torch.Tensor] = [one] * n_bonds
    q = one
    for k in range(len(cores) - 1, 0, -1):
        core = cores[k]
        if k < len(cores) - 1:
            g = gates[k]
            q = g[:, :, None] * q * g[:, None, :]
        _, r, n, r2 = core.shape
        t = torch.bmm(core.reshape(batch, r * n, r2), q).reshape(batch, r, n * r2)  # G Q
        q = torch.bmm(t, core.reshape(batch, r, n * r2).transpose(1, 2))
        rights[k - 1] = q

    norm = norm_sq.clamp_min(tiny).sqrt()[:, None]
    zero = (norm_sq == 0)[:, None]
    shares = []
    for g, p_k, q_k in zip(gates, lefts, rights, strict=True):
        pq = p_k.diagonal(dim1=1, dim2=2).clamp_min(0) * q_k.diagonal(dim1=1, dim2=2).clamp_min(0)
        term = g.abs() * pq.clamp_min(tiny).sqrt() * (pq > 0)
        # W == 0: nothing carries anything; a NaN norm (non-finite weight) stays NaN
        shares.append(torch.where(zero, 0.0, term / norm))
    return shares


def _masked_gates(params: Params, state: State, dtype: torch.dtype) -> list[torch.Tensor]:
    """gate * mask, with dead ranks exactly 0 whatever their gate holds."""
    return [
        torch.where(m.to(g.device), g.to(dtype), 0.0)
        for g, m in zip(params["gates"], state["masks"], strict=True)  # type: ignore[arg-type]
    ]


def rank_contributions(params: Params, state: State) -> list[torch.Tensor]:
    """Share of the weight carried by every rank of every internal bond.

    Returns one float64 vector per bond, ``share_i = ||term_i||_F / ||W||_F`` with
    ``term_i`` the bond-``k`` outer-product term of rank ``i`` (see the module docstring).
    Dead (masked) ranks have share 0. When ``W == 0`` every share is 0: no rank carries
    anything, so a threshold on shares treats the whole layer as dispensable, just as
    :func:`compact` treats a layer with an empty bond as the zero map. A non-finite
    weight gives NaN shares. A TTM's shares are of the padded ``prod(vocab_modes) x D``
    table the cores represent, padding rows included.

    Shares are not fractions that add to 1: by the triangle inequality their sum is at
    least 1 on every bond of a non-zero weight (equal to 1 only when all terms are
    parallel), and their squares add to 1 when the terms are orthogonal, which random
    cores nearly are (shares then about ``1 / sqrt(r)``).

    The norms come from Gram matrices, never from the partial trains themselves:
    ``P_k = sum_n G_k[:, n, :]^T diag(g_{k-1}) P_{k-1} diag(g_{k-1}) G_k[:, n, :]`` from the
    left (``P_0 = [[1]]``) and the mirror ``Q_k`` from the right, with ``g = gate * mask``.
    Then ``||Left_i||^2 = P_k[i, i]``, ``||Right_i||^2 = Q_k[i, i]``; ``||W||^2`` is the
    left recursion carried through the last core. Cost ``O(sum_k n_k r^3)``, in float64,
    without autograd; :func:`rank_shares` is the same with autograd, computed in at least
    fp32 and returned in the weights' dtype.
    """
    check_state(params, state)
    if not params["gates"]:  # type: ignore[index]
        return []
    cores = [_as_3way(c.detach()).to(torch.float64) for c in params["cores"]]  # type: ignore[union-attr]
    with torch.no_grad():
        return _shares(cores, _masked_gates(params, state, torch.float64))


def rank_shares(params: Params, state: State) -> list[torch.Tensor]:
    """:func:`rank_contributions` in the cores' dtype and differentiable: what a training
    objective on shares (``comera.train.objectives.share_size``) back-propagates through.
    No host read, so it runs in sync-free and compiled steps. Half-precision cores are
    measured in fp32 (their Gram matrices would overflow fp16's range) and the shares
    returned in their dtype."""
    check_state(params, state)
    if not params["gates"]:  # type: ignore[index]
        return []
    dtype = params["cores"][0].dtype  # type: ignore[index]
    work = torch.promote_types(dtype, torch.float32)
    cores = [_as_3way(c).to(work) for c in params["cores"]]  # type: ignore[union-attr]
    return [s.to(dtype) for s in _shares(cores, _masked_gates(params, state, work))]


def live_ranks(state: State) -> list[int]:
    """Number of live ranks per internal bond."""
    return [int(m.sum()) for m in state["masks"]]  # type: ignore[union-attr]


PRUNE_RULES = ("gate", "contribution")


def check_prune_rule(rule: str) -> None:
    """Raise a ``ConfigError`` naming the valid rules when ``rule`` is not one of them."""
    if rule not in PRUNE_RULES:
        raise ConfigError(f"unknown prune rule {rule!r}; valid rules: {', '.join(PRUNE_RULES)}")


def prune(params: Params, state: State, tau: float, *, rule: str = "gate") -> State:
    """New state where every rank judged dispensable under ``rule`` is dead.

    ``rule="gate"`` (the paper's rule, the default): a rank dies when its gate magnitude
    ``|d_k[i]| <= tau``. Cheap, but blind to the scale symmetry between gates and cores:
    a rank whose gate was scaled down while its core slice grew carries as much of the
    weight as before and still dies, changing the function.

    ``rule="contribution"``: a rank dies when its share of the weight,
    ``|d_k[i]| ||Left_i|| ||Right_i|| / ||W||_F`` from :func:`rank_contributions`, is
    ``<= tau``. The share is invariant to that symmetry and to the scale of ``W``, so only
    ranks that really carry little of the weight die. On every bond the shares of a
    non-zero weight add up to at least 1 (triangle inequality over ``W = sum_i term_i``),
    so the largest is at least
    ``1 / live_rank``: with ``tau < 1 / max live rank`` every bond keeps a live rank (unless
    ``W`` is already zero: then every share is 0 and every rank dies, which changes
    nothing). Pruning one bond moves ``W`` by at most the sum of the shares removed there,
    times ``||W||_F``. All bonds are judged on the unpruned weight and cut together, so
    that bound is per bond: terms that cancel exactly across two bonds can leave ranks
    that no longer connect, and in such a contrived case the pruned layer may compute far
    less than the bound says (even the zero map).
    Random cores give nearly orthogonal terms with shares about ``1 / sqrt(r)``
    (0.18 at rank 30), so ``tau = 1e-2`` is a safe threshold. Costs ``O(n r^3)`` per
    core (float64 Gram matrices, no dense weight).

    Pure: ``params`` are untouched and ranks already dead stay dead. Unknown ``rule``
    raises ``ValueError``.
    """
    check_prune_rule(rule)
    check_state(params, state)
    given = tau
    tau = as_number(tau)  # a number or a one-element tensor; not True (1.0: every rank)
    if not math.isfinite(tau):  # NaN compares false: the gate rule kills all, shares none
        raise ConfigError(f"prune: tau={given!r}; give a finite threshold (e.g. 1e-2)")
    if rule == "gate":
        keep = [g.detach().abs() > tau for g in params["gates"]]  # type: ignore[union-attr]
    else:
        # written as "not <= tau" so NaN shares (a non-finite weight) prune nothing
        keep = [~(s <= tau) for s in rank_contributions(params, state)]
    masks = [
        m & k.to(m.device)
        for k, m in zip(keep, state["masks"], strict=True)  # type: ignore[arg-type]
    ]
    return {**state, "masks": masks}


def compact(params: Params, state: State) -> tuple[Params, State]:
    """Physically drop dead ranks so cores, gates and FLOPs shrink; the function is unchanged.

    If any bond has no live rank the whole train is the zero map, so every bond is
    emptied and the layer keeps zero TT parameters (a bias, if any, remains). The new
    cores and gates are leaves with their old tensors' ``requires_grad``, as the bias
    keeps its own, so ``torch.autograd.grad`` over the result works as before.
    """
    check_state(params, state)
    keep = kept_indices(state)
    masks: list[torch.Tensor] = list(state["masks"])  # type: ignore[arg-type]
    new_state = {**state, "masks": [m.index_select(0, i) for m, i in zip(masks, keep, strict=True)]}
    new = slice_ranks(params, keep)
    for key in ("cores", "gates"):
        for old, t in zip(params[key], new[key], strict=True):  # type: ignore[call-overload]
            t.requires_grad_(old.requires_grad)
    return new, new_state


def slice_ranks(tree: Params, keep: list[torch.Tensor]) -> Params:
    """Keep only ranks ``keep[k]`` on every bond of a params-shaped dict.

    Works on the params themselves and on anything shaped like them (optimizer moments),
    so optimizer state follows compaction exactly, rank for rank.
    """
    cores: list[torch.Tensor] = list(tree["cores"])  # type: ignore[arg-type]
    new_cores = []
    for k, core in enumerate(cores):
        if k > 0:
            core = core.index_select(0, keep[k - 1])
        if k < len(cores) - 1:
            core = core.index_select(core.dim() - 1, keep[k])
        new_cores.append(core.detach().contiguous())
    gates = [g.detach().index_select(0, i) for g, i in zip(tree["gates"], keep, strict=True)]  # type: ignore[arg-type]
    return {**tree, "cores": new_cores, "gates": gates}


def kept_indices(state: State) -> list[torch.Tensor]:
    """Indices of the live ranks of every bond: what :func:`compact` keeps."""
    masks: list[torch.Tensor] = list(state["masks"])  # type: ignore[arg-type]
    if any(not bool(m.any()) for m in masks):
        return [m.new_zeros(0, dtype=torch.long) for m in masks]
    return [m.nonzero().squeeze(-1) for m in masks]
