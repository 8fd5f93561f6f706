"""Parameter, memory and FLOP accounting for TT/TTM layers and whole models.

Counts come in two flavours: *stored* (what the tensors hold now, dead ranks included
until :func:`comera.compact` runs) and *live* (what would remain after compaction).
Compression ratios compare the dense layer's parameters with the live TT parameters
(cores + gates + bias).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from comera.errors import ConfigError
from comera.plans import PlanLike, tt_linear_plan
from comera.pruning import live_ranks
from comera.tensor_train import Params, State, check_format, check_state, is_tt_params

__all__ = [
    "LayerSummary",
    "compression_ratio",
    "dense_param_count",
    "live_param_count",
    "param_bytes",
    "param_count",
    "summarize",
    "summary_table",
    "tt_linear_flops",
    "ttm_embedding_flops",
]


def _no_module(tree: object, fn: str, where: str = "") -> None:
    """A module passed where a params pytree goes counted nothing (0 parameters, an
    empty table), inside a list or dict too, and so did :func:`summarize`'s own rows:
    refused, naming what to pass."""
    at = f" at {where}" if where else ""
    if isinstance(tree, torch.nn.Module):
        raise TypeError(
            f"{fn}: got the module {type(tree).__name__}{at}; pass a params pytree (a TT "
            "layer's layer.params(), with layer.state() as its state; a ModuleTask's "
            "task.params()), or count a module's tensors with sum(p.numel() for p in "
            "module.parameters())"
        )
    if isinstance(tree, LayerSummary):
        raise TypeError(
            f"{fn}: got a LayerSummary{at} (summarize's rows); pass the params pytree "
            "they were made from"
        )
    if isinstance(tree, dict):
        for k, v in tree.items():
            _no_module(v, fn, f"{where}.{k}" if where else str(k))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            _no_module(v, fn, f"{where}[{i}]")


def _leaves(tree: object) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from _leaves(v)


def param_count(params: object) -> int:
    """Number of stored elements in a params pytree."""
    _no_module(params, "param_count")
    return sum(t.numel() for t in _leaves(params))


def param_bytes(params: object) -> int:
    """Bytes held by a params pytree."""
    _no_module(params, "param_bytes")
    return sum(t.numel() * t.element_size() for t in _leaves(params))


def _is_ttm(params: Params) -> bool:
    return params["cores"][0].dim() == 4  # type: ignore[index]


def train_size(mode_sizes: list[int], ranks: list[int]) -> int:
    """Core and gate parameters of a train with cores of ``mode_sizes`` (each core's
    middle modes multiplied) at these bond ranks; an empty bond makes it 0."""
    if any(r == 0 for r in ranks):
        return 0
    full = [1, *ranks, 1]
    return sum(full[k] * n * full[k + 1] for k, n in enumerate(mode_sizes)) + sum(ranks)


def _one_layer(params: object, fn: str, num_embeddings: object = None) -> int | None:
    """Refuse what is not one TT/TTM layer's params (a model's tree gave ``KeyError:
    'cores'``) or a row count that is not one number (a ``{path: rows}`` map, which
    :func:`summarize` takes, gave a ``TypeError`` from deep inside); returns the row
    count as an ``int`` (None when not given)."""
    _no_module(params, fn)
    if not isinstance(params, dict) or "cores" not in params:
        raise TypeError(
            f"{fn}: takes one TT/TTM layer's params (a dict with 'cores'), got "
            f"{type(params).__name__}"
            + (f" with keys {sorted(map(str, params))[:6]}" if isinstance(params, dict) else "")
            + "; for a model's tree use param_count or summarize"
        )
    if num_embeddings is None:
        return None
    boolean = isinstance(num_embeddings, bool) or str(getattr(num_embeddings, "dtype", "")) in (
        "bool", "torch.bool")  # fmt: skip
    try:  # numpy and torch integers too
        rows = None if boolean else operator.index(num_embeddings)  # type: ignore[arg-type]
    except TypeError:
        rows = None
    if rows is None:
        where = "; a {path: rows} map goes to summarize" if isinstance(num_embeddings, dict) else ""
        raise TypeError(
            f"{fn}: num_embeddings is this table's row count (an int), got "
            f"{type(num_embeddings).__name__}{where}"
        )
    if rows < 0:
        raise ValueError(f"{fn}: num_embeddings={rows} must be >= 0 (0: the padded rows)")
    return rows


def _tokens(fn: str, name: str, n: object) -> None:
    """Refuse a count that is not an int >= 0 (a negative one gave negative FLOPs)."""
    try:
        if isinstance(n, bool):
            raise TypeError
        value = operator.index(n)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{fn}: {name} must be an int >= 0, got {type(n).__name__}") from None
    if value < 0:
        raise ValueError(f"{fn}: {name}={value} must be >= 0")


def live_param_count(params: Params, state: State) -> int:
    """Parameters a TT/TTM layer keeps after compaction (cores, gates, bias)."""
    _one_layer(params, "live_param_count")
    # a state from before a compaction counted ranks the params no longer hold
    check_state(params, state, "live_param_count")
    cores: list[torch.Tensor] = params["cores"]  # type: ignore[assignment]
    n = train_size([math.prod(c.shape[1:-1]) for c in cores], live_ranks(state))
    if params.get("bias") is not None:
        n += params["bias"].numel()  # type: ignore[union-attr]
    return n


def dense_param_count(params: Params, num_embeddings: int | None = None) -> int:
    """Parameters of the dense layer this TT/TTM layer replaces (weight + bias)."""
    num_embeddings = _one_layer(params, "dense_param_count", num_embeddings)
    cores: list[torch.Tensor] = params["cores"]  # type: ignore[assignment]
    if _is_ttm(params):
        padded = math.prod(c.shape[1] for c in cores)
        if num_embeddings is not None and num_embeddings > padded:  # inflated the ratio
            raise ValueError(
                f"dense_param_count: num_embeddings={num_embeddings} is more rows than the "
                f"table holds (prod(vocab_modes)={padded}); give its real row count"
            )
        rows = num_embeddings or padded
        return rows * math.prod(c.shape[2] for c in cores)
    if num_embeddings is not None:  # ignored without a word
        raise ValueError(
            "dense_param_count: num_embeddings is a TTM table's row count; these are a TT "
            "linear layer's params (summarize's dense_shapes gives a padded layer's sizes)"
        )
    n = math.prod(c.shape[1] for c in cores)
    bias = params.get("bias")
    return n + (bias.numel() if bias is not None else 0)  # type: ignore[union-attr]


def compression_ratio(params: Params, state: State, num_embeddings: int | None = None) -> float:
    """One TT/TTM layer's dense parameters / its live ones (inf when it was pruned to
    nothing); ``num_embeddings``: a padded table's real rows."""
    _one_layer(params, "compression_ratio", num_embeddings)
    live = live_param_count(params, state)
    dense = dense_param_count(params, num_embeddings)
    return dense / live if live else math.inf


def tt_linear_flops(params: Params, tokens: int, plan: PlanLike = "comera") -> dict[str, int]:
    """Forward/backward FLOPs of a TT-linear call on ``tokens`` rows, and of the dense layer.

    Forward FLOPs are opt_einsum's cost of the chosen path on the stored core shapes
    (2 per multiply-add). Backward is counted as twice the forward: every pairwise
    contraction has two input gradients of the same cost (the dense layer too).
    """
    check_format(params, 3, "tt_linear_flops")
    _tokens("tt_linear_flops", "tokens", tokens)
    cores: list[torch.Tensor] = params["cores"]  # type: ignore[assignment]
    p = tt_linear_plan(plan, [c.shape for c in cores], tokens)
    fwd, largest = p.cost(tokens)
    dense = 2 * tokens * math.prod(c.shape[1] for c in cores)
    return {
        "forward": fwd,
        "backward": 2 * fwd,
        "largest_intermediate": largest,
        "dense_forward": dense,
        "dense_backward": 2 * dense,
    }


def ttm_embedding_flops(
    params: Params, ids: int, unique: int | None = None, impl: str = "optimized"
) -> int:
    """Forward FLOPs of a TTM lookup of ``ids`` rows (``unique`` distinct for ``optimized``):
    the per-row chain (``naive``) or pairs merged first (``optimized``)."""
    check_format(params, 4, "ttm_embedding_flops")
    _tokens("ttm_embedding_flops", "ids", ids)
    if unique is not None:
        _tokens("ttm_embedding_flops", "unique", unique)
    if impl not in ("naive", "optimized"):  # "tabel" was counted as optimized
        raise ConfigError(
            f"ttm_embedding_flops: impl={impl!r}; it models 'naive' and 'optimized' lookups"
        )
    shapes = [tuple(c.shape) for c in params["cores"]]  # type: ignore[union-attr]

    def chain_cost(shapes: list[tuple[int, ...]], rows: int) -> int:
        cost, d_acc = 0, shapes[0][2]
        for r, _, d, r2 in shapes[1:]:
            cost += 2 * rows * d_acc * r * d * r2
            d_acc *= d
        return cost

    if impl == "naive":
        return chain_cost(shapes, ids)
    pairs, pre = [], 0
    for k in range(0, len(shapes) - 1, 2):
        (r, v, d, s), (_, w, e, t) = shapes[k], shapes[k + 1]
        pre += 2 * r * v * d * s * w * e * t
        pairs.append((r, v * w, d * e, t))
    if len(shapes) % 2:
        pairs.append(shapes[-1])
    return pre + chain_cost(pairs, ids if unique is None else unique)


@dataclass(frozen=True, slots=True)
class LayerSummary:
    """One row of a model summary."""

    path: str
    kind: str  # "tt_linear", "ttm_embedding" or "dense"
    dense_shape: tuple[int, int] | tuple[int, ...]
    stored_params: int
    live_params: int
    dense_params: int
    ranks: tuple[int, ...]
    live: tuple[int, ...]

    @property
    def compression(self) -> float:
        return self.dense_params / self.live_params if self.live_params else math.inf


def _walk(
    params: object,
    state: object,
    path: str,
    rows: Mapping[str, int],
    shapes: Mapping[str, tuple[int, int]],
) -> Iterator[LayerSummary]:
    if is_tt_params(params):
        p: Params = params  # type: ignore[assignment]
        st: State = (
            state
            if isinstance(state, dict) and "masks" in state
            else {
                "masks": [torch.ones(g.numel(), dtype=torch.bool) for g in p["gates"]]  # type: ignore[union-attr]
            }
        )
        if st is state:
            check_state(p, st, f"summarize: {path or '<root>'}")
        cores: list[torch.Tensor] = p["cores"]  # type: ignore[assignment]
        ttm = _is_ttm(p)
        vocab = _one_layer(p, "summarize", rows.get(path or "<root>")) if ttm else None
        if ttm:
            shape = (vocab or math.prod(c.shape[1] for c in cores),
                     math.prod(c.shape[2] for c in cores))  # fmt: skip
        else:
            d = len(cores) // 2
            shape = (
                math.prod(c.shape[1] for c in cores[:d]),
                math.prod(c.shape[1] for c in cores[d:]),
            )
        dense = dense_param_count(p, vocab)
        real = shapes.get(path or "<root>")
        if real is not None:  # a padded layer's own sizes (the train holds the padded ones)
            shape = (int(real[0]), int(real[1]))
            bias = shape[0] if not ttm and p.get("bias") is not None else 0
            dense = shape[0] * shape[1] + bias
        yield LayerSummary(
            path=path or "<root>",
            kind="ttm_embedding" if ttm else "tt_linear",
            dense_shape=shape,
            stored_params=param_count(p),
            live_params=live_param_count(p, st),
            dense_params=dense,
            ranks=tuple(int(c.shape[-1]) for c in cores[:-1]),
            live=tuple(live_ranks(st)),
        )
    elif isinstance(params, dict):
        for k, v in params.items():
            sub = state.get(k) if isinstance(state, dict) else None
            yield from _walk(v, sub, f"{path}.{k}" if path else str(k), rows, shapes)
    elif isinstance(params, list | tuple):
        for i, v in enumerate(params):
            sub = state[i] if isinstance(state, list | tuple) and i < len(state) else None
            yield from _walk(v, sub, f"{path}.{i}" if path else str(i), rows, shapes)
    elif isinstance(params, torch.Tensor):
        n = params.numel()
        yield LayerSummary(path, "dense", tuple(params.shape), n, n, n, (), ())


def summarize(
    params: object,
    state: object = None,
    *,
    num_embeddings: Mapping[str, int] | None = None,
    dense_shapes: Mapping[str, tuple[int, int]] | None = None,
) -> list[LayerSummary]:
    """One row per TT/TTM layer and per dense tensor in a model's params pytree.

    ``state`` mirrors the params tree (a TT layer's state sits at the same path);
    where it is missing every rank counts as live. A train's params hold only its padded
    sizes: a TTM table's dense size counts the padded vocabulary (``prod(vocab_modes)``)
    unless ``num_embeddings`` maps its path to the real one (``spec.num_embeddings``), and
    a linear layer ``tensorize_`` padded counts its padded ``out x in`` unless
    ``dense_shapes`` maps its path to the real ``(out, in)`` (``(rows, dim)`` for a
    table; :meth:`comera.train.ModuleTask.dense_shapes` gives them for a module). A key
    is a layer's path (``""`` or ``"<root>"`` for params that are one layer); one over a
    part that stayed dense counts nothing, and one that names nothing else (a typo), or a
    TT linear in ``num_embeddings``, is a :class:`ConfigError`.
    """
    _no_module(params, "summarize")
    # "" is the root (ModuleTask.dense_shapes of a bare layer), which rows call "<root>"
    rows = {k or "<root>": v for k, v in (num_embeddings or {}).items()}
    shapes = {k or "<root>": v for k, v in (dense_shapes or {}).items()}
    out = list(_walk(params, state, "", rows, shapes))
    # a key that names nothing (a typo, a stale path) left its layer at its padded size,
    # and one for a layer of the other kind was ignored; a key over a part that stayed
    # dense (a map over every table, one of which was not compressed) counts nothing
    tables = {r.path for r in out if r.kind == "ttm_embedding"}
    linears = {r.path for r in out if r.kind == "tt_linear"}
    dense = [r.path for r in out if r.kind == "dense"]

    def under(key: str, paths: Iterable[str]) -> bool:
        return any(p == key or p.startswith(key + ".") for p in paths)

    checks = (("num_embeddings", rows, tables, linears, "TTM tables"),
              ("dense_shapes", shapes, tables | linears, set(), "TT/TTM layers"))  # fmt: skip
    for arg, given, known, other, what in checks:
        # over a part left dense only: a parent of a TT layer too ('blk' over blk.e) is a
        # key for no table, which left blk.e at its padded size
        stays = {k for k in given if under(k, dense) and not under(k, tables | linears)}
        unknown = sorted(set(given) - known - stays)
        if unknown:
            why = ("are TT linear layers, not TTM tables" if set(unknown) <= other
                   else "name no layer of these params")  # fmt: skip
            raise ConfigError(
                f"summarize: {arg} names {unknown[:3]}, which {why}; its keys are paths of "
                f"the {what} ({sorted(known)[:6] or 'none'})"
            )
    return out


def summary_table(
    params: object,
    state: object = None,
    *,
    dense_rows: bool = False,
    num_embeddings: Mapping[str, int] | None = None,
    dense_shapes: Mapping[str, tuple[int, int]] | None = None,
) -> str:
    """A markdown table of :func:`summarize` with a total row (dense tensors folded in)."""
    rows = summarize(params, state, num_embeddings=num_embeddings, dense_shapes=dense_shapes)
    lines = [
        "| layer | kind | dense shape | ranks (live/stored) | params (live) | dense params "
        "| compression |",
        "|---|---|---|---|---|---:|---:|",
    ]
    for r in rows:
        if r.kind == "dense" and not dense_rows:
            continue
        ranks = ",".join(f"{a}/{b}" for a, b in zip(r.live, r.ranks, strict=True)) or "-"
        lines.append(
            f"| {r.path} | {r.kind} | {'x'.join(map(str, r.dense_shape))} | {ranks} | "
            f"{r.live_params:,} | {r.dense_params:,} | {r.compression:.1f}x |"
        )
    live = sum(r.live_params for r in rows)
    dense = sum(r.dense_params for r in rows)
    ratio = dense / live if live else math.inf
    lines.append(f"| **total** | | | | {live:,} | {dense:,} | {ratio:.1f}x |")
    return "\n".join(lines)
