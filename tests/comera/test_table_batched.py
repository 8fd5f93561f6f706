"""Table-batched TTM lookup: equal to separate lookups, in values and gradients."""

import pytest
import torch

import comera as C
from comera.layers import pair_cores
from comera.table_batched import table_groups


def _tables(seed: int = 0, n: int = 300):
    g = torch.Generator().manual_seed(seed)
    specs = [
        C.propose_ttm_embedding(n, 16, d=4, ranks=6, name=f"t{i}")
        for i, n in enumerate([4096, 1460, 90000, 583])
    ]
    specs.append(
        C.TTMEmbeddingSpec(vocab_modes=(10, 10), dim_modes=(4, 4), ranks=5, num_embeddings=97)
    )  # another group: two cores
    params, states = [], []
    for s in specs:
        p, st = C.init(s, generator=g)
        params.append(p)
        states.append(st)
    # tables 0 and 2 compacted to different ranks: they stay in one group (rank padding)
    for i, dead in ((0, 2), (2, 4)):
        masks = [m.clone() for m in states[i]["masks"]]
        masks[1][:dead] = False
        params[i], states[i] = C.compact(params[i], {"masks": masks})
    # float64: the paths sum in other orders, and float32 sums of a thousand rows drift past
    # a tight tolerance with how BLAS happens to split them
    params = [{k: [t.detach().double().requires_grad_() for t in v] for k, v in p.items()}
              for p in params]  # fmt: skip
    ids = torch.stack([torch.randint(0, s.num_embeddings, (n,), generator=g) for s in specs], 1)
    ids[100:200] = ids[:100]  # duplicates
    return specs, params, states, ids


# the four-table group's cores stacked, merging both pairs (merged tables of 31,104 and
# 27,648 elements count as small); stacked, pairs merged only for as many unique rows as
# their 1,296 and 1,152 padded ones (12,000 padded core elements fit, merged tables do
# not: 300 rows hold under 1,152 unique ones, 1,000 rows more than 1,296); per table
STACKINGS = {"stacked": None, "stacked, merged by rows": 20_000, "per table": 0}


def _stacking(stack: str, monkeypatch) -> None:
    import comera.table_batched as tb

    if STACKINGS[stack] is not None:
        monkeypatch.setattr(tb, "STACK_ELEMENTS", STACKINGS[stack])


@pytest.mark.parametrize("stack", list(STACKINGS))
@pytest.mark.parametrize("rows", [6, 300, 1000])  # few rows: chains; many: merged pairs
def test_batched_equals_separate(rows: int, stack: str, monkeypatch) -> None:
    import comera.table_batched as tb

    _stacking(stack, monkeypatch)
    chains: list[int] = []  # the tables each group's chain runs through (2: pairs merged)
    apply = tb._GatheredChain.apply
    monkeypatch.setattr(tb._GatheredChain, "apply", lambda n, *a: chains.append(n) or apply(n, *a))
    specs, params, states, ids = _tables(n=max(rows, 300))
    assert tb._padded_elements(params[:4]) == 12_000 <= tb.STACK_ELEMENTS or stack == "per table"
    ids = ids[:rows]
    out = C.ttm_embedding_batched(params, states, ids, specs=specs)  # (N, T, D)
    ref = torch.stack(
        [
            C.ttm_embedding(p, s, ids[:, i], spec=sp)
            for i, (p, s, sp) in enumerate(zip(params, states, specs, strict=True))
        ],
        1,
    )
    assert out.shape == (rows, 5, 16)
    merged = {"stacked": True, "stacked, merged by rows": rows == 1000,
              "per table": rows > 6}[stack]  # fmt: skip
    assert chains[0] == (2 if merged else 4)  # the four-table group's four cores
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(out)
    leaves = [t for p in params for v in p.values() for t in v]
    g_out = torch.autograd.grad((out * w).sum(), leaves)
    g_ref = torch.autograd.grad((ref * w).sum(), leaves)
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_groups_and_errors() -> None:
    specs, params, states, ids = _tables()
    assert table_groups(params) == [[0, 1, 2, 3], [4]]
    bad = ids.clone()
    bad[3, 4] = 97  # table 4 has 97 rows (its modes hold 100)
    with pytest.raises(IndexError, match="id 97 is out of range"):
        C.ttm_embedding_batched(params, states, bad, specs=specs)
    with pytest.raises(ValueError, match="one column per table"):
        C.ttm_embedding_batched(params, states, ids[:, :3])
    other = C.init(C.TTMEmbeddingSpec(vocab_modes=(8, 8), dim_modes=(2, 4), ranks=3))
    with pytest.raises(ValueError, match="embedding dims"):
        C.ttm_embedding_batched([params[0], other[0]], [states[0], other[1]], ids[:, :2] % 64)


def test_many_blocks_and_empty_batches(monkeypatch) -> None:
    """Unique rows split into several recomputed blocks: same values and gradients."""
    import comera.table_batched as tb

    specs, params, states, ids = _tables()
    leaves = [t for p in params for v in p.values() for t in v]
    ref = C.ttm_embedding_batched(params, states, ids, specs=specs)
    g_ref = torch.autograd.grad(ref.square().sum(), leaves)
    monkeypatch.setattr(tb, "_BLOCK_BYTES", 1)  # blocks of 256 unique rows
    out = C.ttm_embedding_batched(params, states, ids, specs=specs)
    g_out = torch.autograd.grad(out.square().sum(), leaves)
    torch.testing.assert_close(out, ref)
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    empty = C.ttm_embedding_batched(params, states, ids[:0], specs=specs)
    assert empty.shape == (0, 5, 16)


@pytest.mark.parametrize("stack", list(STACKINGS))
@pytest.mark.parametrize("tables", [1, 2])
def test_a_table_pruned_to_the_zero_map_gives_zero_rows(stack: str, tables: int, monkeypatch):
    """A table whose bond lost every rank compacts to rank-0 cores, the zero map: zero rows
    and zero gradients, as ``ttm_embedding`` gives (a group of such tables included)."""
    _stacking(stack, monkeypatch)
    spec = C.TTMEmbeddingSpec(num_embeddings=60, embedding_dim=12, vocab_modes=(3, 4, 5),
                              dim_modes=(2, 3, 2), ranks=(3, 4))  # fmt: skip
    p, s = C.init(spec, generator=torch.Generator().manual_seed(0))
    masks = [m.clone() for m in s["masks"]]
    masks[0][:] = False
    p, s = C.compact(p, {"masks": masks})
    assert p["cores"][0].shape[-1] == 0
    p = {k: [t.detach().requires_grad_() for t in v] for k, v in p.items()}
    ids = torch.tensor([[1], [5], [59], [5]]).repeat(1, tables)
    out = C.ttm_embedding_batched([p] * tables, [s] * tables, ids)
    assert out.shape == (4, tables, 12) and not out.any()
    grads = torch.autograd.grad(out.sum(), p["cores"], allow_unused=True)
    assert all(g is None or not g.any() for g in grads)


@pytest.mark.parametrize("stack", list(STACKINGS))
def test_gradients_only_where_asked(stack: str, monkeypatch) -> None:
    """Tables (and cores) that do not require grad get none; the others get what separate
    lookups give."""
    _stacking(stack, monkeypatch)
    specs, params, states, ids = _tables()
    frozen = [{k: [t.detach() for t in v] for k, v in p.items()} for p in params]
    mixed = [params[0], frozen[1], params[2], frozen[3], params[4]]
    mixed[2] = {"cores": [mixed[2]["cores"][0].detach(), *mixed[2]["cores"][1:]],
                "gates": mixed[2]["gates"]}  # fmt: skip
    out = C.ttm_embedding_batched(mixed, states, ids, specs=specs)
    ref = torch.stack(
        [C.ttm_embedding(p, s, ids[:, i], spec=sp)
         for i, (p, s, sp) in enumerate(zip(mixed, states, specs, strict=True))], 1,
    )  # fmt: skip
    leaves = [t for p in mixed for v in p.values() for t in v if t.requires_grad]
    w = torch.randn_like(out)
    g_out = torch.autograd.grad((out * w).sum(), leaves)
    g_ref = torch.autograd.grad((ref * w).sum(), leaves)
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stack", list(STACKINGS))
def test_batched_under_bf16_autocast_keeps_one_dtype_and_fp32_gradients(
    stack: str, monkeypatch
) -> None:
    """Under autocast a merged core pair comes out bf16 while a lone core stays fp32; the
    chain runs in the cores' own dtype, so the backward mixes nothing and the gradients
    are fp32 and close to the fp32 ones."""
    _stacking(stack, monkeypatch)
    spec = C.TTMEmbeddingSpec(vocab_modes=(4, 5, 6), dim_modes=(2, 2, 4), ranks=4,
                              num_embeddings=120)  # fmt: skip
    p, st = C.init(spec, generator=torch.Generator().manual_seed(1))
    p = {k: [t.detach().requires_grad_() for t in v] for k, v in p.items()}
    ids = torch.randint(0, 120, (300, 1), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        merged = pair_cores(list(p["cores"]))  # what the lookup merges
        out = C.ttm_embedding_batched([p], [st], ids)
    assert merged[0].dtype == torch.bfloat16 and merged[-1].dtype == torch.float32  # mixed
    grads = torch.autograd.grad(out.float().square().sum(), p["cores"])
    ref_out = C.ttm_embedding_batched([p], [st], ids)
    ref = torch.autograd.grad(ref_out.square().sum(), p["cores"])
    for g, r in zip(grads, ref, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=0.05, atol=0.05 * float(r.abs().max()))


@pytest.mark.parametrize(
    ("shape", "dims", "gathered"),
    [
        ((3, 4, 5, 2, 6, 2, 1), (0, 2, 4, 1, 3, 5, 6), True),  # a run of 2: gathered
        ((3, 1, 5, 2, 4, 2, 8), (0, 2, 4, 1, 3, 5, 6), False),  # a run of 16: copied
        ((4, 3, 2), (-1, 0, 1), True),  # negative dims
        ((4, 3, 2), (0, 1, 2), False),  # no move: one run of all
    ],
)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_permuted_is_a_contiguous_permute_in_values_and_gradients(
    shape: tuple, dims: tuple, gathered: bool, layout: str, monkeypatch
) -> None:
    """The stacked pair merges' permuted copy: ``permute(dims).contiguous()``'s values,
    first and second derivatives, whichever way it copies, from a contiguous input or
    not."""
    import comera.tensor_train as tt

    used = []
    apply = tt._Gathered.apply
    monkeypatch.setattr(tt._Gathered, "apply", lambda *a: used.append(1) or apply(*a))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64, generator=gen)
    if layout == "transposed":  # the same values, laid out with the first two dims swapped
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    x.requires_grad_(True)
    got = tt.permuted(x, dims)
    assert bool(used) == gathered and got.is_contiguous()
    assert torch.equal(got, x.permute(dims))
    gy = torch.randn_like(got)
    (gx,) = torch.autograd.grad(got, x, gy)
    inverse = tuple(torch.argsort(torch.tensor([d % len(shape) for d in dims])).tolist())
    assert torch.equal(gx, gy.permute(inverse))
    assert torch.autograd.gradgradcheck(lambda t: tt.permuted(t, dims), (x,))


def test_permuted_index_survives_inference_mode_and_refuses_bad_dims(monkeypatch) -> None:
    """An index first built under ``inference_mode`` (an eval lookup) still serves a
    training call; a large tensor takes the plain copy; dims torch refuses are refused."""
    import comera.tensor_train as tt

    tt._perm_index.cache_clear()
    x = torch.randn(5, 4, 3, 2, 1)
    dims = (0, 2, 1, 4, 3)  # a run of 1: gathered
    with torch.inference_mode():
        torch.testing.assert_close(tt.permuted(x, dims), x.permute(dims))
    y = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(tt.permuted(y, dims).sum(), y)  # the cached index is saved
    assert torch.equal(g, torch.ones_like(x))
    used = []
    apply = tt._Gathered.apply
    monkeypatch.setattr(tt._Gathered, "apply", lambda *a: used.append(1) or apply(*a))
    monkeypatch.setattr(tt, "GATHER_ELEMENTS", x.numel() - 1)
    assert torch.equal(tt.permuted(x, dims), x.permute(dims)) and not used
    with pytest.raises((RuntimeError, IndexError)):
        tt.permuted(x, (0, 1, 2, 3, 5))


def test_permuted_runs_under_torch_func_transforms() -> None:
    """Under ``torch.func.grad`` (no ``vmap`` batching) the gathered copy's
    ``autograd.Function`` cannot run: the plain copy does, with the same gradient."""
    import comera.tensor_train as tt

    x = torch.randn(14, 16, 15, 2, 13, 2, 1, dtype=torch.float64)
    dims = (0, 2, 4, 1, 3, 5, 6)
    got = torch.func.grad(lambda t: tt.permuted(t, dims).pow(3).sum())(x)
    torch.testing.assert_close(got, 3 * x.pow(2))


@pytest.mark.parametrize("stack", list(STACKINGS))
def test_batched_lookup_under_torch_func_grad(stack: str, monkeypatch) -> None:
    """``torch.func.grad`` through the batched lookup (its chain Function cannot run
    under a functorch transform: the lookup runs the chain as plain autograd there) gives
    the gradients autograd gives."""
    _stacking(stack, monkeypatch)
    _, params, states, ids = _tables()
    cores = [c for p in params for c in p["cores"]]

    def loss(cs):
        it = iter(cs)
        ps = [{**p, "cores": [next(it) for _ in p["cores"]]} for p in params]
        return C.ttm_embedding_batched(ps, states, ids).pow(2).sum()

    got = torch.func.grad(loss)([c.detach() for c in cores])
    want = torch.autograd.grad(loss(cores), cores)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_batched_lookup_under_vmap_equals_a_loop() -> None:
    """Under ``vmap`` (ids batched) the lookup gives each sample's rows, as a loop does."""
    _, params, states, ids = _tables()
    batch = ids[:60].reshape(3, 20, -1)
    got = torch.func.vmap(lambda i: C.ttm_embedding_batched(params, states, i))(batch)
    want = torch.stack([C.ttm_embedding_batched(params, states, i) for i in batch])
    torch.testing.assert_close(got, want)
