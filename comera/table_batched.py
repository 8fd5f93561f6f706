"""Table-batched TTM lookup: many TTM embedding tables looked up in one pass.

A recommendation model holds dozens of tables; looking each up on its own costs a
dedup, a digit split and a gather + GEMM per core, per table. Here, as FBGEMM's
table-batched embeddings do for dense tables, the tables of a group share each of those
steps:

1. tables are grouped by their number of cores and their dim modes; inside a group
   core ``k`` of every table is zero-padded to the group's largest ranks and the
   tables are concatenated along the vocab axis, ``(sum of v, r, d, r')``. Zero rank
   padding is exact (a padded rank carries zeros on both sides of its bond), so tables
   with different vocabularies, or compacted to different ranks, stay in one group;
2. ``(table, id)`` keys of the whole group are deduplicated by one ``torch.unique``;
3. neighbouring cores are pre-contracted (one small GEMM per table, independent of the
   batch) when the merged rows of the group are no more than its unique rows, as
   :func:`comera.ttm_embedding` decides per table;
4. each remaining core is one gather (row ``offset_t + digit``) and one batched GEMM
   over all unique rows of all tables; one last gather puts rows in ``(..., T, D)`` order.

A small group (at most :data:`STACK_ELEMENTS` elements once padded) is also stacked
whole: core ``k`` of every table zero-padded to the group's largest vocab mode as well,
``(T, r, v, d, r')``, so gating every table is one product and pre-contracting a pair is
one batched GEMM for the group instead of a few small ops per table; a pair whose merged
tables are that small too is merged whatever the batch (step 3's rule otherwise). At
these sizes the per-table ops, not the arithmetic, were the lookup's cost (14 tables of
about 40,000 rows at batch 256: gating and merging took 5 of its 9.6 ms, fwd+bwd, 2 CPU
threads).

Values and gradients equal those of separate :func:`comera.ttm_embedding` calls.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from comera.errors import ConfigError, IdOutOfRangeError
from comera.layers import check_ids_dtype, gather_rows, pair_cores, ttm_embedding
from comera.spec import TTMEmbeddingSpec
from comera.tensor_train import (
    Params,
    State,
    check_format,
    check_state,
    gated_cores,
    is_batched,
    permuted,
    stacked_gated_core,
    under_func_transform,
)

# a group whose cores, padded to the largest vocab mode and ranks, hold at most this many
# elements (4 MiB of fp32) is stacked: there the padding's arithmetic is negligible and
# the ops saved are not. DLRM's Kaggle-size tables at their initial ranks (2.4M elements
# padded against 1.4M) take the per-table path, where padded pair merges would add GEMM
# work to the step; compacted to ranks of about 20 and under, they fit and are stacked.
STACK_ELEMENTS = 1 << 20

__all__ = ["STACK_ELEMENTS", "table_groups", "ttm_embedding_batched"]


def table_groups(params: Sequence[Params]) -> list[list[int]]:
    """Indices of the tables that share one batched lookup: same number of cores and the
    same dim modes (vocab modes and ranks may differ; they are padded)."""
    keys: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        dims = tuple(int(c.shape[2]) for c in p["cores"])  # type: ignore[union-attr]
        keys.setdefault(dims, []).append(i)
    return list(keys.values())


def _concat_cores(cores: list[torch.Tensor]) -> torch.Tensor:
    """One core ``(r, v, d, r')`` per table, in row form ``(v, r, d, r')`` with ranks
    zero-padded to the largest, concatenated along the vocab axis: ``(sum of v, r, d, r')``."""
    r = max(c.shape[0] for c in cores)
    r2 = max(c.shape[3] for c in cores)
    rows = [
        F.pad(c, (0, r2 - c.shape[3], 0, 0, 0, 0, 0, r - c.shape[0])).permute(1, 0, 2, 3)
        for c in cores
    ]
    return torch.cat(rows)  # (sum v, r, d, r')


def _gather_core_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``table[idx]`` for a row-form core ``(V, r, d, r')`` via the embedding kernel."""
    v, r, d, r2 = table.shape
    return gather_rows(table.reshape(v, r * d * r2), idx).reshape(len(idx), r, d, r2)


# gathered core slices per block: cache-sized, not batch-sized, and (for slices up to
# 3.75 KiB per row; a merged 4x32 pair is 512 B) under the 1 MiB mmap threshold of
# cpu_malloc release/lean, so a block's temporaries are reused from the heap rather than
# mapped and faulted in anew (fwd+bwd at the Kaggle sizes, 2 CPU threads:
# 8 MiB blocks 102 ms as found / 146 ms lean, these 82 / 92 ms)
_BLOCK_BYTES = 960 << 10


def _block_rows(tables: list[torch.Tensor]) -> int:
    """Unique rows per block: the largest gathered slice of a block fits in
    :data:`_BLOCK_BYTES` (at least 256 rows)."""
    slice_bytes = max(t[0].numel() for t in tables) * tables[0].element_size()
    return max(256, _BLOCK_BYTES // max(slice_bytes, 1))


def _chain_forward(
    tables: list[torch.Tensor], idx: list[torch.Tensor], *, last: bool = True
) -> tuple[torch.Tensor | None, list[torch.Tensor], list[torch.Tensor]]:
    """One block: gather each core's slices and chain them with batched GEMMs. Returns
    the rows ``(U, D)`` (``None`` when ``last`` is False: the backward skips the last
    GEMM), the gathered slices ``(U, r, d*r')`` and the partial products ``(U, D_acc, r)``
    that enter each GEMM."""
    # every size explicit: a table pruned to the zero map has rank-0 bonds, and a
    # reshape of 0 elements cannot infer a -1
    u = len(idx[0])
    slices = [
        _gather_core_rows(t, i).reshape(u, t.shape[1], t.shape[2] * t.shape[3])
        for t, i in zip(tables, idx, strict=True)
    ]
    acc = slices[0].reshape(u, tables[0].shape[2], tables[0].shape[3])  # (U, D_1, r_1)
    accs = [acc]
    for sl, core in zip(slices[1:-1], tables[1:-1], strict=True):
        d_acc = acc.shape[1] * core.shape[2]
        acc = torch.bmm(acc, sl).reshape(u, d_acc, core.shape[3])  # (U, D_acc*d, r')
        accs.append(acc)
    if not last or len(slices) == 1:
        return (acc.reshape(u, acc.shape[1] * acc.shape[2]) if last else None), slices, accs
    return torch.bmm(acc, slices[-1]).reshape(u, acc.shape[1] * tables[-1].shape[2]), slices, accs


class _GatheredChain(torch.autograd.Function):
    """Rows of a TTM chain over gathered core slices, block by block.

    Forward keeps only each core's row indices: the backward regathers each block's
    slices (cheap), recomputes its partial products, and adds the slices' gradients
    straight into one gradient buffer per core with ``index_add_``. First-order only
    (``once_differentiable``): no double backward through the lookup. Autograd over the same ops
    would keep the gathered slices of every block (the lookup's largest activations),
    and recomputing them per block (checkpointing) would build a full-table gradient per
    block and sum them."""

    @staticmethod
    def forward(ctx, n_tables: int, *args: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        tables, idx = list(args[:n_tables]), list(args[n_tables:])
        ctx.n_tables = n_tables
        ctx.save_for_backward(*tables, *idx)
        u, block = len(idx[0]), _block_rows(tables)
        dim = math.prod(int(t.shape[2]) for t in tables)
        out = tables[0].new_empty(u, dim)
        for lo in range(0, u, block):
            rows, _, _ = _chain_forward(tables, [i[lo : lo + block] for i in idx])
            out[lo : lo + block] = rows
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        saved = ctx.saved_tensors
        n = ctx.n_tables
        tables, idx = list(saved[:n]), list(saved[n:])
        grads = [
            torch.zeros_like(t).reshape(t.shape[0], -1) if ctx.needs_input_grad[1 + k] else None
            for k, t in enumerate(tables)
        ]
        u, block = len(idx[0]), _block_rows(tables)
        for lo in range(0, u, block):
            bidx = [i[lo : lo + block] for i in idx]
            _, slices, accs = _chain_forward(tables, bidx, last=False)
            g = grad[lo : lo + block]
            b = g.shape[0]
            for k in range(n - 1, 0, -1):  # through GEMM k: acc_{k} = acc_{k-1} @ slice_k
                g = g.reshape(b, accs[k - 1].shape[1], -1)  # (U, D_acc, d*r')
                if grads[k] is not None:
                    # acc^T @ g, computed as (g^T @ acc)^T: far faster with these shapes
                    gs = torch.bmm(g.transpose(1, 2), accs[k - 1]).transpose(1, 2)
                    grads[k].index_add_(0, bidx[k], gs.reshape(b, -1))
                g = torch.bmm(g, slices[k].transpose(1, 2))  # (U, D_acc, r)
            if grads[0] is not None:
                grads[0].index_add_(0, bidx[0], g.reshape(b, -1))
        out = [
            None if gr is None else gr.reshape(t.shape) for gr, t in zip(grads, tables, strict=True)
        ]
        return (None, *out, *([None] * len(idx)))


def _stacked_tables(
    params: Sequence[Params], states: Sequence[State], digits: list[torch.Tensor],
    tab: torch.Tensor, n_unique: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # fmt: skip
    """The group's chain tables in row form ``(T * v, r, d, r')`` and each unique row's
    index into them, from stacked cores. A pair is pre-contracted for all tables with one
    batched GEMM when its padded ``T * v * w`` rows are no more than the unique rows (as
    the per-table path decides), or when the merged table is as small as the stacked
    cores themselves (:data:`STACK_ELEMENTS`): then one GEMM saves a chain step, and
    its gathers, for every block of unique rows."""
    ncores = len(digits)
    stacked = [stacked_gated_core(params, states, k) for k in range(ncores)]
    tables, rows_idx, k = [], [], 0
    while k < ncores:
        t, r, v, d, r2 = stacked[k].shape
        w, e, r3 = stacked[k + 1].shape[2:] if k + 1 < ncores else (0, 0, 0)
        rows = t * v * w
        if w and (rows <= n_unique or rows * r * d * e * r3 <= STACK_ELEMENTS):
            merged = torch.bmm(stacked[k].reshape(t, r * v * d, r2),
                               stacked[k + 1].reshape(t, r2, w * e * r3))  # fmt: skip
            pairs = permuted(merged.reshape(t, r, v, d, w, e, r3), (0, 2, 4, 1, 3, 5, 6))
            tables.append(pairs.reshape(rows, r, d * e, r3))
            rows_idx.append((tab * v + digits[k]) * w + digits[k + 1])
            k += 2
        else:
            tables.append(stacked[k].transpose(1, 2).reshape(t * v, r, d, r2))
            rows_idx.append(tab * v + digits[k])
            k += 1
    return tables, rows_idx


def _concat_tables(
    cores_per_table: list[list[torch.Tensor]], digits: list[torch.Tensor], tab: torch.Tensor,
    vm: torch.Tensor, n_unique: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # fmt: skip
    """:func:`_stacked_tables` one table at a time, without padding any vocab mode: each
    table's pair is merged on its own when its ``v * w`` rows summed over the group are no
    more than the unique rows; the tables are concatenated along the vocab axis."""
    ncores = len(digits)
    modes = [[int(c.shape[1]) for c in cs] for cs in cores_per_table]
    dev = tab.device
    tables, rows_idx, k = [], [], 0
    while k < ncores:
        mine = [cs[k] for cs in cores_per_table]
        merged_rows = sum(m[k] * m[k + 1] for m in modes) if k + 1 < ncores else None
        if merged_rows is not None and merged_rows <= n_unique:  # merging pays off
            mine = [pair_cores([cs[k], cs[k + 1]])[0] for cs in cores_per_table]
            digit = digits[k] * vm[tab, k + 1] + digits[k + 1]
            k += 2
        else:
            digit = digits[k]
            k += 1
        sizes = torch.tensor([c.shape[1] for c in mine], device=dev)
        tables.append(_concat_cores(mine))
        rows_idx.append((torch.cumsum(sizes, 0) - sizes)[tab] + digit)
    return tables, rows_idx


def _padded_elements(params: Sequence[Params]) -> int:
    """Elements of the group's cores once stacked (padded to the largest modes and ranks)."""
    total = 0
    for k in range(len(params[0]["cores"])):  # type: ignore[arg-type]
        shapes = [p["cores"][k].shape for p in params]  # type: ignore[index]
        total += len(shapes) * math.prod(max(int(s[i]) for s in shapes) for i in range(4))
    return total


def _lookup_group(
    params: Sequence[Params], states: Sequence[State], names: Sequence[str], ids: torch.Tensor
) -> torch.Tensor:
    """Rows for ``ids (N, T)`` of one group -> ``(N, T, D)``."""
    n, t = ids.shape
    ncores = len(params[0]["cores"])  # type: ignore[arg-type]
    modes = tuple(tuple(int(c.shape[1]) for c in p["cores"]) for p in params)  # type: ignore[union-attr]
    dev = ids.device
    vm = torch.tensor(modes, device=dev)  # (T, d)
    span = int(torch.prod(vm, dim=1).max())  # keys t * span + id are unique
    keys = (ids + torch.arange(t, device=dev) * span).reshape(-1)  # (N * T,)
    uniq, inverse = torch.unique(keys, return_inverse=True)
    tab, row = torch.div(uniq, span, rounding_mode="floor"), uniq % span
    # each table's own mixed-radix digits, most significant first
    strides = torch.flip(torch.cumprod(torch.flip(vm, [1]), 1), [1])
    strides = torch.cat([strides[:, 1:], torch.ones_like(strides[:, :1])], 1)  # (T, d)
    digits = [
        torch.div(row, strides[tab, k], rounding_mode="floor") % vm[tab, k] for k in range(ncores)
    ]
    if _padded_elements(params) <= STACK_ELEMENTS:
        tables, rows_idx = _stacked_tables(params, states, digits, tab, len(uniq))
    else:
        cores = [gated_cores(p, s, name) for p, s, name in zip(params, states, names, strict=True)]
        tables, rows_idx = _concat_tables(cores, digits, tab, vm, len(uniq))
    # one dtype for the chain: autocast makes merged pairs bf16 while lone cores stay
    # fp32, and the backward (outside autocast) would mix them in one bmm; the cores'
    # own dtype also keeps the gradient sums out of bf16
    dtype = params[0]["cores"][0].dtype  # type: ignore[index]
    for tb in tables:
        dtype = torch.promote_types(dtype, tb.dtype)
    tables = [tb.to(dtype) for tb in tables]
    if under_func_transform():
        # a torch.func transform (grad, jacrev, ...): the Function has no setup_context,
        # so the chain runs as plain autograd ops, in one block
        acc = _chain_forward(tables, rows_idx)[0]
    else:
        acc = _GatheredChain.apply(len(tables), *tables, *rows_idx)  # (U, D)
    return gather_rows(acc, inverse).reshape(n, t, -1)


def ttm_embedding_batched(
    params: Sequence[Params],
    states: Sequence[State],
    ids: torch.Tensor,
    *,
    specs: Sequence[TTMEmbeddingSpec] | None = None,
) -> torch.Tensor:
    """Look up ``ids (..., T)`` (column ``t`` indexes table ``t``) in ``T`` TTM tables at
    once -> ``(..., T, D)``. Every table must have the same embedding dim ``D``.

    With ``specs`` the range check uses each table's real vocabulary size (ids in the
    padding are rejected) and errors name the table. Under ``vmap`` each table is looked up
    on its own (:func:`comera.ttm_embedding`): the shared dedup reads the ids' values.
    """
    t = len(params)
    if t == 0:  # failed deep in torch, reshaping an empty stack
        raise ValueError("ttm_embedding_batched: no tables; pass at least one")
    if len(states) != t or (specs is not None and len(specs) != t):
        raise ValueError(
            f"ttm_embedding_batched: {t} tables, {len(states)} states"
            + ("" if specs is None else f", {len(specs)} specs")
            + "; pass one of each per table"
        )
    if not isinstance(ids, torch.Tensor):
        check_ids_dtype("ttm_embedding_batched", ids)  # names the type and the way out
    if (
        ids.shape[-1:] != (t,)
        or ids.is_floating_point()
        or ids.is_complex()
        or ids.dtype == torch.bool
    ):
        raise ValueError(
            f"ttm_embedding_batched: ids must be an integer tensor (..., {t}) with one column "
            f"per table, got {tuple(ids.shape)} {ids.dtype}"
        )
    check_ids_dtype("ttm_embedding_batched", ids)
    names = [s.label for s in specs] if specs is not None else [f"table {i}" for i in range(t)]
    for p, s, n in zip(params, states, names, strict=True):
        check_format(p, 4, n)
        check_state(p, s, n)
    cores = [list(p["cores"]) for p in params]  # type: ignore[call-overload]
    dims = {math.prod(int(c.shape[2]) for c in cs) for cs in cores}
    if len(dims) > 1:
        raise ConfigError(
            f"ttm_embedding_batched: tables have embedding dims {sorted(dims)}; "
            "a batched lookup needs one dim (look the others up separately)"
        )
    dtypes = {c.dtype for cs in cores for c in cs}
    if len(dtypes) > 1:  # float32 and float64 tables were promoted, where one table refuses
        raise ConfigError(
            f"ttm_embedding_batched: tables have core dtypes {sorted(map(str, dtypes))}; "
            "a batched lookup needs one dtype (cast the tables together)"
        )
    if is_batched(ids) or any(is_batched(c) for cs in cores for c in cs):
        # under vmap the dedup and the range check cannot read values: each table's own
        # lookup, which handles it
        return torch.stack(
            [ttm_embedding(p, s, ids[..., i], spec=None if specs is None else specs[i])
             for i, (p, s) in enumerate(zip(params, states, strict=True))], -2
        )  # fmt: skip
    modes = [[int(c.shape[1]) for c in cs] for cs in cores]
    vocab = [math.prod(m) for m in modes]
    if specs is not None:
        vocab = [int(s.num_embeddings) for s in specs]  # type: ignore[arg-type]
    flat = ids.reshape(-1, t).long()  # (N, T)
    if flat.numel():
        limit = torch.tensor(vocab, device=flat.device)
        bad = (flat < 0) | (flat >= limit)
        if bool(bad.any()):
            col = int(bad.any(0).nonzero()[0])
            value = int(flat[:, col][bad[:, col]][0])
            raise IdOutOfRangeError(
                f"ttm_embedding_batched: {names[col]}: id {value} is out of range; ids must "
                f"be in [0, {vocab[col]})"
            )
    if not flat.shape[0]:  # nothing to look up: (..., T, D) zeros, still on the graph
        anchor = sum(cs[0].sum() for cs in cores) * 0
        return anchor + torch.zeros(
            *ids.shape, dims.pop(), dtype=cores[0][0].dtype, device=cores[0][0].device
        )
    parts: list[tuple[list[int], torch.Tensor]] = []
    for group in table_groups(params):
        rows = _lookup_group([params[i] for i in group], [states[i] for i in group],
                             [names[i] for i in group], flat[:, group])  # fmt: skip
        parts.append((group, rows))
    if len(parts) == 1:
        out = parts[0][1]
    else:
        order = [i for g, _ in parts for i in g]
        out = torch.cat([r for _, r in parts], 1)[:, _inverse_perm(order)]
    return out.reshape(*ids.shape, -1)


def _inverse_perm(order: list[int]) -> list[int]:
    inv = [0] * len(order)
    for pos, i in enumerate(order):
        inv[i] = pos
    return inv
