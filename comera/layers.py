"""Functional TT layers: ``tt_linear`` and ``ttm_embedding``.

Both are pure functions of ``(params, state, input)``; they work under
``torch.func.functional_call``, ``grad`` and ``vmap``, and never materialize the dense
weight unless the chosen strategy says so.
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Sequence

import torch

from comera.autotune import choose_embedding, choose_linear
from comera.errors import ConfigError, IdOutOfRangeError
from comera.plans import (
    DIRECT_STRATEGIES,
    EMBEDDING_IMPLS,
    GroupedHalves,
    PlanLike,
    contract_halves,
    resolve_plan,
    shared_input_comera,
    tt_linear_plan,
)
from comera.spec import TTLinearSpec, TTMEmbeddingSpec
from comera.tensor_train import Params, State, check_format, gated_cores, is_batched, ttm_table

__all__ = [
    "WHOLE_TABLE_ELEMENTS",
    "SyncFreeLookups",
    "check_ids_dtype",
    "gather_rows",
    "pair_cores",
    "tt_linear",
    "tt_linear_shared_input",
    "ttm_embedding",
    "ttm_logits",
    "ttm_lookup",
]


class SyncFreeLookups:
    """A scope in which every :func:`ttm_embedding` call on this thread runs as if it passed
    ``sync_free=True``, as ``torch.no_grad()`` is a scope for autograd.

    For a caller that cannot reach the lookups' arguments: a train step runs a task's loss,
    and the model inside calls the lookup. :class:`comera.train.sync_free.SyncFreeStep`
    enters one around each step (``with SyncFreeLookups():``). Scopes nest and are per
    thread; what is open is read as a plain attribute, which ``torch.compile`` traces (it
    cannot trace a ``ContextVar``).
    """

    _open = threading.local()  # .depth: scopes open on this thread

    @classmethod
    def is_open(cls) -> bool:
        """True inside a scope entered on this thread."""
        return getattr(cls._open, "depth", 0) > 0

    def __enter__(self) -> SyncFreeLookups:
        SyncFreeLookups._open.depth = getattr(SyncFreeLookups._open, "depth", 0) + 1
        return self

    def __exit__(self, *exc: object) -> None:
        SyncFreeLookups._open.depth -= 1


def _no_host_sync(sync_free: bool) -> bool:
    """Whether a lookup must avoid every host sync: asked for (``sync_free``, an open
    :class:`SyncFreeLookups`), or while ``torch.compile`` traces or a CUDA graph captures."""
    if sync_free or torch.compiler.is_compiling() or SyncFreeLookups.is_open():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_operand(name: str, what: str, t: torch.Tensor, core: torch.Tensor) -> None:
    if t.device != core.device:
        raise ValueError(
            f"{name}: {what} is on {t.device} but the cores are on {core.device}; "
            f"move one of them (e.g. {what}.to({str(core.device)!r}))"
        )
    if not (t.is_floating_point() or t.is_complex()):  # autocast does not cast these
        raise ValueError(
            f"{name}: {what} has dtype {t.dtype} but a TT layer takes floating-point "
            f"input; cast it with {what}.to({core.dtype})"
        )
    if t.dtype != core.dtype and not torch.is_autocast_enabled(t.device.type):
        raise ValueError(
            f"{name}: {what} has dtype {t.dtype} but the cores have dtype {core.dtype}; "
            f"cast it with {what}.to({core.dtype}) or run under torch.autocast"
        )
    if t.dtype != core.dtype and torch.float64 in (t.dtype, core.dtype):
        # autocast leaves float64 as it is: some plans then mixed it with its dtype and
        # failed inside a GEMM, others cast it and worked
        raise ValueError(
            f"{name}: {what} has dtype {t.dtype} but the cores have dtype {core.dtype}, and "
            f"autocast does not cast float64; cast {what} with {what}.to({core.dtype})"
        )


# torch's "limited support" unsigned types: comparisons and casts of ids fail in its ops
_PARTLY_SUPPORTED = (torch.uint16, torch.uint32, torch.uint64)


def check_ids_dtype(name: str, ids: torch.Tensor) -> None:
    """Refuse ids that are not of an integer dtype a lookup can compare and index with."""
    if not isinstance(ids, torch.Tensor):  # a list failed on a missing tensor method
        raise ValueError(
            f"{name}: ids must be an integer torch.Tensor, got {type(ids).__name__}; wrap "
            "them with torch.as_tensor(ids)"
        )
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name}: ids must be an integer tensor, got dtype {ids.dtype}")
    if ids.dtype in _PARTLY_SUPPORTED:
        raise ValueError(
            f"{name}: ids have dtype {ids.dtype}, which torch supports only in part; cast "
            "them with ids.long()"
        )


def _count(v: object) -> int | None:
    """``v`` as an int >= 1 (numpy's ints too), or None: not a bool, float or string."""
    if isinstance(v, bool):
        return None
    try:
        n = operator.index(v)  # type: ignore[arg-type]
    except TypeError:
        return None
    return n if n >= 1 else None


def _check_bias(name: str, bias: object, m: int, core: torch.Tensor) -> None:
    """A layer's bias must be ``(M,)`` on the cores' device, in their dtype (any under
    autocast). Checked per call: the plans read a bias differently (a padding slot of the
    ``comera`` path while the middle rank is not a multiple of 8, an ``addmm`` addend
    otherwise), so a wrong one would broadcast, promote or fail by plan and rank, and a
    compaction could turn a working run into a crash."""
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (m,):
        shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(
            f"{name}: params['bias'] has shape {shape} but the layer has {m} outputs; "
            f"give a bias of shape ({m},) or None"
        )
    _check_operand(name, "params['bias']", bias, core)


def tt_linear(
    params: Params,
    state: State,
    x: torch.Tensor,
    *,
    plan: PlanLike = None,
    spec: TTLinearSpec | None = None,
    halves: GroupedHalves | None = None,
) -> torch.Tensor:
    """``x W^T + b`` with ``W`` a gated tensor train; ``x`` is ``(..., in_features)``.

    ``plan`` picks the contraction strategy for this call (a name from
    ``comera.STRATEGIES`` or explicit pairs); None uses the global default. ``"auto"``
    asks the tuner in force (:mod:`comera.autotune`) for the fastest plan at these shapes.
    ``spec`` only names the layer in error messages. ``halves``: the layer's gated halves
    built together with other layers' (:class:`comera.plans.GroupedHalves`), read by the
    ``comera`` and ``dense`` paths; a layer it does not hold builds its own.
    """
    name = spec.label if spec is not None else "tt_linear"
    check_format(params, 3, name)
    cores: list[torch.Tensor] = params["cores"]  # type: ignore[assignment]
    d = len(cores) // 2
    n = math.prod([c.shape[1] for c in cores[d:]])
    m = math.prod([c.shape[1] for c in cores[:d]])
    if x.dim() < 1 or x.shape[-1] != n:
        in_modes = [c.shape[1] for c in cores[d:]]
        raise ValueError(
            f"{name}: input has shape {tuple(x.shape)} but the layer expects a last dim of "
            f"{n} (= prod(in_modes) = prod({in_modes}))"
        )
    _check_operand(name, "x", x, cores[0])
    _check_bias(name, params.get("bias"), m, cores[0])
    lead = x.shape[:-1]
    x2 = x.reshape(-1, n)  # (T, N)
    built = halves.get(params) if halves is not None else None
    # the tuner reads the cores' shapes and times clones: the stored cores serve as well
    g = gated_cores(params, state, name) if built is None else params["cores"]
    strategy = resolve_plan(plan, name)
    if strategy == "auto":
        strategy = choose_linear(g, x2, params.get("bias"), built)  # type: ignore[arg-type]
    if strategy in DIRECT_STRATEGIES:  # direct GEMMs: no plan to look up (nor to trace)
        operands = g if built is None else built
        y = contract_halves(strategy, x2, operands, params.get("bias"), built=built is not None)
    else:
        if built is not None:  # a plan over the whole network needs the gated cores
            g = gated_cores(params, state, name)
        contraction = tt_linear_plan(strategy, [c.shape for c in g], x2.shape[0], name)
        y = contraction(x2, g, params.get("bias"))  # (T, M)
    # a 2-D input gets the GEMM's own output, not a reshape of it: a reshape to the same
    # shape is a view, and an in-place op on it (DLRM's ``relu_``) makes autograd copy
    # the whole output gradient (``CopySlices``) in backward
    return y if x.dim() == 2 else y.reshape(*lead, m)


def tt_linear_shared_input(
    layers: Sequence[tuple[Params, State]],
    x: torch.Tensor,
    *,
    halves: GroupedHalves | None = None,
) -> list[torch.Tensor]:
    """Several TT linears of one input (attention's Q, K, V) on the ``comera`` path, with
    their input halves contracted in one wider GEMM: the same values and gradients as
    ``[tt_linear(p, s, x, plan="comera") for p, s in layers]`` up to summation order, one
    read of ``x`` instead of one per layer, and one ``dx`` GEMM in backward. ``halves``:
    as for :func:`tt_linear`, used when it holds every layer."""
    if not layers:
        return []
    built = [halves.get(p) for p, _ in layers] if halves is not None else []
    ready = bool(built) and all(b is not None for b in built)
    trains, biases, outs = [], [], []
    for k, (params, state) in enumerate(layers):
        check_format(params, 3, f"tt_linear_shared_input layer {k}")
        cores: list[torch.Tensor] = params["cores"]  # type: ignore[assignment]
        d = len(cores) // 2
        n = math.prod([c.shape[1] for c in cores[d:]])
        if x.dim() < 1 or x.shape[-1] != n:
            raise ValueError(
                f"tt_linear_shared_input: layer {k} expects a last dim of {n}, the input "
                f"has shape {tuple(x.shape)}"
            )
        label = f"tt_linear_shared_input layer {k}"
        _check_operand(label, "x", x, cores[0])
        m = math.prod([c.shape[1] for c in cores[:d]])
        _check_bias(label, params.get("bias"), m, cores[0])
        if not ready:
            trains.append(gated_cores(params, state, label))
        biases.append(params.get("bias"))
        outs.append(m)
    lead = x.shape[:-1]
    ys = shared_input_comera(x.reshape(-1, x.shape[-1]), built if ready else trains, biases,
                             built=ready)  # type: ignore[arg-type]  # fmt: skip
    if x.dim() == 2:  # no reshape to the same shape: see tt_linear
        return ys
    return [y.reshape(*lead, m) for y, m in zip(ys, outs, strict=True)]


# --------------------------------------------------------------------------- embedding


def _digits(ids: torch.Tensor, modes: list[int]) -> list[torch.Tensor]:
    """Mixed-radix digits of row ids, most significant first (row-major over modes)."""
    out = []
    stride = math.prod(modes)
    for v in modes:
        stride //= v
        out.append(torch.div(ids, stride, rounding_mode="floor") % v)
    return out


def gather_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``table[idx]``. Uses the embedding kernel: its CPU backward accumulates
    duplicate indices about 4x faster than ``index_select``'s scatter-add."""
    return torch.nn.functional.embedding(idx, table)


def _chain_rows(groups: list[torch.Tensor], digits: list[torch.Tensor]) -> torch.Tensor:
    """Rows of a TTM given per-group cores ``(r, V_g, D_g, r')`` and each row's digits.

    Gathers each core's slice for every row, then multiplies along the train with
    batched GEMMs. Returns ``(rows, D)``.
    """
    _, v, d1, r1 = groups[0].shape
    b = digits[0].shape[0]
    acc = gather_rows(groups[0].reshape(v, d1 * r1), digits[0]).reshape(b, d1, r1)  # (B, D_1, r_1)
    for core, dig in zip(groups[1:], digits[1:], strict=True):
        r, v, dg, r2 = core.shape
        table = core.permute(1, 0, 2, 3).reshape(v, r * dg * r2)  # (V_g, r * D_g * r')
        sl = gather_rows(table, dig).reshape(b, r, dg * r2)  # (B, r, D_g * r')
        acc = torch.bmm(acc, sl)  # (B, D_acc, D_g * r')
        acc = acc.reshape(b, acc.shape[1] * dg, r2)  # (B, D_acc * D_g, r')
    return acc.reshape(acc.shape[0], acc.shape[1] * acc.shape[2])


def pair_cores(cores: list[torch.Tensor], n_rows: int | None = None) -> list[torch.Tensor]:
    """Pre-contract neighbouring cores two by two: ``(r, v, d, s), (s, w, e, t)`` ->
    ``(r, v*w, d*e, t)``.

    A pair is merged only when the merged table has at most ``n_rows`` rows (all pairs
    when ``None``): merging costs ``v*w`` rows once, so it pays when more rows than that
    are looked up, and a 10M-row table looked up 10k times is better left as a chain."""
    out, k = [], 0
    while k < len(cores):
        if k + 1 < len(cores) and (
            n_rows is None or cores[k].shape[1] * cores[k + 1].shape[1] <= n_rows
        ):
            merged = torch.einsum("avdb,bwec->avwdec", cores[k], cores[k + 1])  # one pair: no path
            r, v, w, d, e, t = merged.shape
            out.append(merged.reshape(r, v * w, d * e, t))
            k += 2
        else:
            out.append(cores[k])
            k += 1
    return out


def _dedup_static(flat: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(flat, return_inverse=True)`` with a fixed output size ``bound``.

    Sort, mark the first of each run, number the runs by a cumulative sum and scatter:
    no output shape depends on the data, so nothing waits for the device (CUDA graphs and
    ``torch.compile`` see one static graph). Slots past the real unique count hold id 0;
    their rows are computed but never gathered, so they get no gradient. ``bound`` must
    be at least the number of distinct ids; an overflow fails a device-side assert."""
    sorted_ids, order = torch.sort(flat)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    slot = torch.cumsum(first, 0) - 1
    if flat.numel() > bound:  # only a caller's max_unique can make a slot overflow
        torch._assert_async(
            slot[-1] < bound, "ttm_embedding: more distinct ids than max_unique; raise it"
        )
        slot = slot.clamp(max=bound - 1)
    inverse = torch.empty_like(slot).scatter_(0, order, slot)
    uniq = torch.zeros(bound, dtype=flat.dtype, device=flat.device).scatter_(0, slot, sorted_ids)
    return uniq, inverse


def ttm_embedding(
    params: Params,
    state: State,
    ids: torch.Tensor,
    *,
    impl: str = "optimized",
    spec: TTMEmbeddingSpec | None = None,
    max_unique: int | None = None,
    sync_free: bool = False,
) -> torch.Tensor:
    """Look up rows of a TTM embedding table: ``ids (...)`` -> ``(..., D)``.

    ``impl="naive"`` contracts a core chain for every id (duplicates included);
    ``impl="optimized"`` deduplicates ids with ``torch.unique``, pre-contracts core
    pairs (those whose merged table is no larger than the unique rows), runs one batched
    GEMM per remaining core over the unique rows and gathers back. ``impl="static"`` is
    the optimized lookup without a host sync: the dedup writes into a buffer of a size
    known before the ids are read (``max_unique``, by default ``min(ids.numel(), V)``,
    which cannot overflow) and the range check is a device-side assert, so a whole train
    step can be captured as a CUDA graph or compiled by ``torch.compile`` without a
    break. ``impl="table"`` rebuilds the whole table and indexes it (cheapest for small
    tables). ``impl="auto"`` asks the tuner in force
    (:mod:`comera.autotune`) for the faster of ``optimized`` and ``table`` at these
    shapes. All give the same values and gradients. With ``spec`` the range check
    uses the real vocabulary size (ids in the padding are rejected) and errors name the
    layer.

    ``sync_free=True`` makes the call read nothing back on the host: ``optimized`` runs as
    ``static`` and every impl checks the ids with a device-side assert (a bad id fails it
    with a RuntimeError rather than raising the IndexError). It is on by itself under
    ``torch.compile``, during a CUDA-graph capture and inside a :class:`SyncFreeLookups`
    scope.
    """
    name = spec.label if spec is not None else "ttm_embedding"
    if impl not in EMBEDDING_IMPLS:
        raise ConfigError(f"{name}: unknown impl {impl!r}; expected one of {EMBEDDING_IMPLS}")
    check_format(params, 4, name)
    cores: list[torch.Tensor] = params["cores"]  # type: ignore[assignment]
    vocab_modes = [c.shape[1] for c in cores]
    padded = math.prod(vocab_modes)
    vocab = spec.num_embeddings if spec is not None else padded
    if vocab > padded:  # ids past the cores' rows would wrap their digits
        raise ValueError(
            f"{name}: the spec has {vocab} rows but the cores' vocab modes {vocab_modes} "
            f"hold {padded}; pass the spec these params were built from"
        )
    check_ids_dtype(name, ids)
    if ids.device != cores[0].device:
        raise ValueError(
            f"{name}: ids are on {ids.device} but the cores are on {cores[0].device}; "
            f"move them with ids.to({str(cores[0].device)!r})"
        )
    if max_unique is not None:  # 2.5 and "3" failed in torch, and True counted as 1
        if impl != "static" or _count(max_unique) is None:
            raise ConfigError(
                f"{name}: max_unique={max_unique!r} needs impl='static' and an int >= 1"
            )
        max_unique = _count(max_unique)
    no_sync = _no_host_sync(sync_free)
    if impl == "optimized" and no_sync:
        impl = "static"  # torch.unique would sync (CUDA graphs) or break the graph
    batched = is_batched(ids)
    if (impl == "static" or no_sync) and not batched:  # naive too: no host read in a graph
        if ids.numel():
            torch._assert_async(
                ((ids >= 0) & (ids < vocab)).all(),
                f"{name}: an id is out of range; ids must be in [0, {vocab})",
            )
    elif not batched and ids.numel():
        bad = (ids < 0) | (ids >= vocab)
        if bool(bad.any()):
            value = int(ids[bad].flatten()[0])
            raise IdOutOfRangeError(
                f"{name}: id {value} is out of range; ids must be in [0, {vocab}) "
                f"(the vocabulary size{'' if spec is None else ' of this layer'})"
            )
    flat = ids.reshape(-1).long()
    g = gated_cores(params, state, name)
    dim = math.prod([c.shape[2] for c in g])
    if impl == "auto":
        impl = choose_embedding(g, flat, ttm_lookup, sync_free=no_sync)
        if impl == "optimized" and no_sync:
            impl = "static"
    rows = ttm_lookup(impl, g, flat, max_unique=max_unique)
    return rows.reshape(*ids.shape, dim)


def ttm_lookup(
    impl: str, cores: Sequence[torch.Tensor], flat: torch.Tensor, *, max_unique: int | None = None
) -> torch.Tensor:
    """Rows ``(len(flat), D)`` of the TTM with gated ``cores`` by one implementation
    (``naive``, ``optimized``, ``static`` or ``table``), with no checks: the engine behind
    :func:`ttm_embedding`, which validates ``flat`` first."""
    g = list(cores)
    vocab_modes = [c.shape[1] for c in g]
    if impl == "naive":
        return _chain_rows(g, _digits(flat, vocab_modes))
    if impl == "table":  # the whole table once, then rows by index (small tables)
        return gather_rows(ttm_table(g), flat)
    if is_batched(flat):  # torch.unique is data dependent: no dedup under vmap
        groups = pair_cores(g)
        return _chain_rows(groups, _digits(flat, [c.shape[1] for c in groups]))
    if impl == "static":
        bound = min(flat.numel(), math.prod(vocab_modes))
        uniq, inverse = _dedup_static(flat, max(1, min(bound, max_unique or bound)))
    else:
        uniq, inverse = torch.unique(flat, return_inverse=True)
    groups = pair_cores(g, len(uniq))
    rows = _chain_rows(groups, _digits(uniq, [c.shape[1] for c in groups]))
    return gather_rows(rows, inverse)


# a table this small (in elements, ``V * D``, three of them counted: the table, its
# gradient, the chain's partial products) is built whole whatever the token count: 4M
# elements, 16 MB of fp32. Block by block, CodeBERT's smoke table (2,025 x 64, 45 blocks)
# took about 20 ms of a one-sequence step for what its whole build does in well under 1.
WHOLE_TABLE_ELEMENTS = 1 << 22


def _rows_logits(h: torch.Tensor, rows: int | None, *cores: torch.Tensor) -> torch.Tensor:
    """``h`` against the table of ``cores``, its first ``rows`` rows (default: all)."""
    return torch.nn.functional.linear(h, ttm_table(cores)[:rows])  # (M, rows of this block)


def ttm_logits(
    params: Params, state: State, h: torch.Tensor, *, rows: int | None = None
) -> torch.Tensor:
    """``h (..., D)`` against a TTM embedding's table (a tied decoder): ``(..., rows)``
    logits, no bias; ``rows`` drops the padded vocabulary rows (default: all).

    A large table meeting few tokens is never stored whole: it is built one block of rows
    at a time (one index of its first vocabulary mode), each block's logits computed and
    the block dropped, and rebuilt block by block in backward (activation checkpointing).
    The blocks together cost one table build; the memory is one block instead of the
    table, its gradient and the chain's partial products (about 460 MB at 50,265 x 768).
    The table is built whole, once, where its memory does not matter: when those (about
    three tables, ``3 V D``) take no more memory than the ``(M, V)`` logits made anyway
    (``3 D <= M``), or hold at most :data:`WHOLE_TABLE_ELEMENTS`; there the blocks' many
    small ops cost more time than the whole table's memory."""
    from torch.utils.checkpoint import checkpoint

    cores = gated_cores(params, state, "ttm_logits")
    padded = math.prod([int(c.shape[1]) for c in cores])
    dim = math.prod([int(c.shape[2]) for c in cores])
    if h.dim() < 1 or h.shape[-1] != dim:
        raise ValueError(
            f"ttm_logits: h has shape {tuple(h.shape)} but the table's rows have {dim} "
            "entries (= prod(dim_modes)); h's last dim must match"
        )
    _check_operand("ttm_logits", "h", h, cores[0])
    if rows is not None:
        count = _count(rows)  # rows=12.0 worked, and True meant one row
        if count is None or count > padded:
            raise ConfigError(
                f"ttm_logits: rows={rows!r}; pass an int from 1 to {padded} (the table's "
                "padded vocabulary)"
            )
        rows = count
    h2 = h.reshape(-1, h.shape[-1])
    # the padded rows are cut from the table, not from the logits: slicing the (M, V)
    # logits left them strided for the loss and gave the slice a logits-sized backward
    if 3 * h2.shape[-1] <= h2.shape[0] or 3 * padded * h2.shape[-1] <= WHOLE_TABLE_ELEMENTS:
        out = _rows_logits(h2, rows, *cores)
    else:
        first, rest = cores[0], cores[1:]
        block = padded // first.shape[1]  # rows per index of the first mode
        total = padded if rows is None else rows
        blocks = [
            checkpoint(
                _rows_logits,
                h2,
                min(block, total - a * block),
                first[:, a : a + 1],
                *rest,
                use_reentrant=False,
            )
            for a in range(first.shape[1])
            if a * block < total
        ]
        out = torch.cat(blocks, dim=-1)
    return out.reshape(*h.shape[:-1], out.shape[-1])
