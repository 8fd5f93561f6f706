"""Walking a whole model's params pytree: find every TT/TTM layer and act on it.

A model is a nested dict/list of tensors; TT/TTM layers are the dicts with ``cores``
and ``gates`` (see :mod:`comera.tensor_train`). Its rank state mirrors the params tree
at those positions (``state["layers"][0]["q"] == {"masks": [...]}``); elsewhere the state
tree may be empty.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.utils._pytree as pytree

from comera.accounting import train_size
from comera.pruning import (
    check_prune_rule,
    compact,
    kept_indices,
    live_ranks,
    prune,
    rank_contributions,
    slice_ranks,
)
from comera.tensor_train import is_tt_params

__all__ = [
    "compact_tree",
    "iter_tt",
    "leaves",
    "map_tt",
    "prune_to_size",
    "prune_tree",
]


class _OtherNode(Exception):
    """A container :func:`leaves` leaves to torch's pytree (namedtuple, OrderedDict, ...)."""


def _collect(tree: object, out: list) -> None:
    kind = type(tree)
    if kind is dict:
        for v in tree.values():  # type: ignore[attr-defined]
            _collect(v, out)
    elif kind is torch.Tensor or kind is torch.nn.Parameter:  # most leaves: no node check
        out.append(tree)
    elif kind is list or kind is tuple:
        for v in tree:  # type: ignore[attr-defined]
            _collect(v, out)
    elif kind in pytree.SUPPORTED_NODES or pytree.is_namedtuple_class(kind):
        raise _OtherNode
    else:
        out.append(tree)


def leaves(tree: object) -> list:
    """``torch.utils._pytree.tree_flatten(tree)[0]``, several times faster on the plain
    dict/list/tuple trees models and optimizer states are made of (the train step lists a
    TT model's leaves several times per step, and a TT model has three times a dense one's
    leaves); any other container falls back to torch's walk."""
    out: list = []
    try:
        _collect(tree, out)
    except _OtherNode:
        return pytree.tree_flatten(tree)[0]
    return out


def _child(tree: object, key: object) -> object:
    if isinstance(tree, dict):
        return tree.get(key)
    if isinstance(tree, list | tuple) and isinstance(key, int) and key < len(tree):
        return tree[key]
    return None


def iter_tt(
    params: object, state: object = None, path: str = ""
) -> Iterator[tuple[str, dict, dict]]:
    """Yield ``(path, layer_params, layer_state)`` for every TT/TTM layer, in tree order."""
    if is_tt_params(params):
        yield path, params, state  # type: ignore[misc]
    elif isinstance(params, dict):
        for k, v in params.items():
            yield from iter_tt(v, _child(state, k), f"{path}.{k}" if path else str(k))
    elif isinstance(params, list | tuple):
        for i, v in enumerate(params):
            yield from iter_tt(v, _child(state, i), f"{path}.{i}" if path else str(i))


def map_tt(
    fn: Callable[..., tuple],
    params: object,
    state: object,
    *others: object,
) -> tuple:
    """Rebuild ``(params, state, *others)`` with ``fn(p, s, *o) -> (p, s, *o)`` applied at
    every TT/TTM layer; ``others`` are trees shaped like ``params`` (optimizer moments)."""
    if is_tt_params(params):
        return fn(params, state, *others)
    if isinstance(params, dict):
        outs: list[dict] = [{} for _ in range(2 + len(others))]
        st_out: dict = dict(state) if isinstance(state, dict) else {}
        for k, v in params.items():
            res = map_tt(fn, v, _child(state, k), *[o[k] for o in others])  # type: ignore[index]
            outs[0][k] = res[0]
            if res[1] is not None:
                st_out[k] = res[1]
            for j, o in enumerate(res[2:]):
                outs[2 + j][k] = o
        return (outs[0], st_out, *outs[2:])
    if isinstance(params, list | tuple):
        lists: list[list] = [[] for _ in range(2 + len(others))]
        for i, v in enumerate(params):
            res = map_tt(fn, v, _child(state, i), *[o[i] for o in others])  # type: ignore[index]
            for j, o in enumerate(res):
                lists[j].append(o if j != 1 else (o if o is not None else {}))
        # each rebuilt as the container it was (a tuple, a namedtuple): lists came back, and
        # a task reading head.w off a namedtuple failed at the first compaction
        same = isinstance(state, list | tuple) and len(state) == len(params)
        templates = [params, state if same else [], *others]
        return tuple(_like(t, items) for t, items in zip(templates, lists, strict=True))
    return (params, state, *others)


def _like(template: object, items: list) -> object:
    """``items`` in ``template``'s sequence type where it can be rebuilt from them: a
    tuple, a namedtuple (``_make``); any other sequence comes back a list."""
    if type(template) is tuple:
        return tuple(items)
    make = getattr(type(template), "_make", None)
    if isinstance(template, tuple) and callable(make):
        return make(items)
    return items


def prune_tree(params: object, state: object, tau: float, rule: str = "gate") -> object:
    """:func:`comera.pruning.prune` with ``rule`` (one of ``comera.pruning.PRUNE_RULES``) at
    every TT/TTM layer; returns the new state tree. An unknown rule raises even for a tree
    without layers."""
    check_prune_rule(rule)
    return map_tt(lambda p, s: (p, prune(p, s, tau, rule=rule)), params, state)[1]


def compact_tree(params: object, state: object, *others: object) -> tuple:
    """:func:`comera.pruning.compact` at every layer, slicing ``others`` (params-shaped trees such
    as optimizer moments) rank for rank like the cores and gates."""

    def one(p: dict, s: dict, *o: dict) -> tuple:
        keep = kept_indices(s)
        new_p, new_s = compact(p, s)
        return (new_p, new_s, *[slice_ranks(x, keep) for x in o])

    return map_tt(one, params, state, *others)


def prune_to_size(params: object, state: object, remove: int) -> tuple[object, int]:
    """Kill the ranks that carry the smallest share of their layer's weight, across every
    TT/TTM layer of the tree, until at least ``remove`` live parameters are gone.

    The share is :func:`comera.pruning.rank_contributions`' (invariant to the gate/core
    scale symmetry and to each layer's scale, so shares of different layers compare as
    relative errors). A bond's last live rank is never killed (the layer would become the
    zero map), so fewer than ``remove`` parameters go when every bond is down to one rank;
    ranks with a non-finite share are left alone. Returns the new state tree and the
    number of parameters removed. Pure, like :func:`prune_tree`."""
    layers = list(iter_tt(params, state))
    if remove <= 0 or not layers:
        return state, 0
    modes = [[math.prod(c.shape[1:-1]) for c in p["cores"]] for _, p, _ in layers]
    ranks = [live_ranks(s) for _, _, s in layers]
    masks = [[m.clone() for m in s["masks"]] for _, _, s in layers]
    candidates = []
    for li, (_, p, s) in enumerate(layers):
        for k, share in enumerate(rank_contributions(p, s)):
            values = share.tolist()  # one read per bond, not one per rank
            for i in s["masks"][k].nonzero().flatten().tolist():
                if math.isfinite(v := values[i]):
                    candidates.append((v, li, k, i))
    removed = 0
    for _, li, k, i in sorted(candidates):
        if removed >= remove:
            break
        if ranks[li][k] <= 1:
            continue
        before = train_size(modes[li], ranks[li])
        ranks[li][k] -= 1
        masks[li][k][i] = False
        removed += before - train_size(modes[li], ranks[li])
    new = iter(masks)
    out = map_tt(lambda p, s: (p, {**s, "masks": next(new)}), params, state)[1]
    return out, removed
