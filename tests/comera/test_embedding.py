"""TTM lookups: naive and optimized give identical values and gradients."""

import pytest
import torch

import comera as C


@pytest.mark.parametrize(
    "vocab_modes,dim_modes,ranks",
    [((4, 5, 3), (2, 3, 2), 5), ((3, 4, 2, 5), (2, 2, 2, 3), (3, 4, 2)), ((7, 6), (3, 4), 4)],
)
def test_naive_equals_optimized_values_and_grads(vocab_modes, dim_modes, ranks):
    gen = torch.Generator().manual_seed(0)
    spec = C.TTMEmbeddingSpec(
        vocab_modes=vocab_modes, dim_modes=dim_modes, ranks=ranks, dtype=torch.float64
    )
    params, state = C.init(spec, generator=gen)
    params = {
        **params,
        "gates": [
            g + 0.3 * torch.randn(g.shape, generator=gen, dtype=g.dtype) for g in params["gates"]
        ],
    }
    ids = torch.randint(0, spec.num_embeddings, (4, 13), generator=gen)
    ids[0, :5] = ids[1, 0]  # duplicates
    table = C.to_dense(params, state, spec)
    upstream = torch.randn(4, 13, spec.embedding_dim, generator=gen, dtype=torch.float64)
    results = {}
    for impl in C.EMBEDDING_IMPLS:
        leaves = [t.clone().requires_grad_() for t in params["cores"] + params["gates"]]
        p = {"cores": leaves[: len(params["cores"])], "gates": leaves[len(params["cores"]) :]}
        out = C.ttm_embedding(p, state, ids, impl=impl, spec=spec)
        torch.testing.assert_close(out, table[ids])
        out.backward(upstream)
        results[impl] = (out.detach(), [t.grad for t in leaves])
    for impl in ("optimized", "static"):
        torch.testing.assert_close(results["naive"][0], results[impl][0])
        for a, b in zip(results["naive"][1], results[impl][1], strict=True):
            torch.testing.assert_close(a, b)


def test_gradcheck_both_impls():
    gen = torch.Generator().manual_seed(1)
    spec = C.TTMEmbeddingSpec(
        vocab_modes=(3, 2, 2), dim_modes=(2, 1, 2), ranks=2, dtype=torch.float64
    )
    params, state = C.init(spec, generator=gen)
    ids = torch.tensor([0, 5, 5, 11, 3])
    leaves = [t.clone().requires_grad_() for t in params["cores"] + params["gates"]]
    for impl in C.EMBEDDING_IMPLS:

        def f(*ls, impl=impl):
            return C.ttm_embedding(
                {"cores": list(ls[:3]), "gates": list(ls[3:])}, state, ids, impl=impl
            )

        assert torch.autograd.gradcheck(f, tuple(leaves))


def test_empty_ids_and_shapes():
    spec = C.TTMEmbeddingSpec(vocab_modes=(4, 5), dim_modes=(2, 3), ranks=3)
    params, state = C.init(spec)
    for impl in C.EMBEDDING_IMPLS:
        assert C.ttm_embedding(
            params, state, torch.zeros(0, 7, dtype=torch.long), impl=impl
        ).shape == (0, 7, 6)
        assert C.ttm_embedding(params, state, torch.tensor(3), impl=impl).shape == (6,)


def test_module_matches_functional():
    spec = C.TTMEmbeddingSpec(
        vocab_modes=(4, 5, 3), dim_modes=(2, 3, 2), ranks=4, num_embeddings=50
    )
    emb = C.TTMEmbedding(spec, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[1, 2, 49], [0, 0, 7]])
    torch.testing.assert_close(emb(ids), emb.to_dense()[ids])
    assert emb.to_dense().shape == (50, 12)


def test_static_dedup_matches_unique():
    from comera.layers import _dedup_static

    gen = torch.Generator().manual_seed(3)
    for n, vocab in ((50, 7), (9, 1000), (1, 3)):
        flat = torch.randint(0, vocab, (n,), generator=gen)
        uniq, inverse = _dedup_static(flat, min(n, vocab))
        assert uniq.shape == (min(n, vocab),)  # fixed by the bound, not by the data
        assert torch.equal(uniq[inverse], flat)
        ref = torch.unique(flat)
        assert torch.equal(uniq[: len(ref)], ref)


def test_static_impl_bounds_and_range_check():
    spec = C.TTMEmbeddingSpec(vocab_modes=(4, 5), dim_modes=(2, 3), ranks=3, num_embeddings=18)
    params, state = C.init(spec, generator=torch.Generator().manual_seed(4))
    ids = torch.tensor([[1, 1, 2, 17], [2, 2, 2, 1]])  # three distinct ids
    ref = C.ttm_embedding(params, state, ids, spec=spec)
    torch.testing.assert_close(
        C.ttm_embedding(params, state, ids, impl="static", max_unique=3, spec=spec), ref
    )
    with pytest.raises(RuntimeError, match="more distinct ids than max_unique"):
        C.ttm_embedding(params, state, ids, impl="static", max_unique=2)
    with pytest.raises(RuntimeError, match=r"'tok'.*out of range.*\[0, 18\)"):
        C.ttm_embedding(
            params,
            state,
            torch.tensor([18]),
            impl="static",
            spec=C.TTMEmbeddingSpec(
                vocab_modes=(4, 5), dim_modes=(2, 3), ranks=3, num_embeddings=18, name="tok"
            ),
        )
    with pytest.raises(ValueError, match="max_unique=4 needs impl='static'"):
        C.ttm_embedding(params, state, ids, max_unique=4)


def test_static_impl_compiles_without_graph_breaks():
    """fullgraph=True refuses any graph break, and every host sync (``.item()``, ``bool``,
    a data-dependent shape) is one: compiling the lookup and its backward proves the
    static path has none. ``optimized`` (``torch.unique``) turns static under compile."""
    spec = C.TTMEmbeddingSpec(vocab_modes=(4, 5, 3), dim_modes=(2, 3, 2), ranks=4)
    params, state = C.init(spec, generator=torch.Generator().manual_seed(5))
    ids = torch.randint(0, 60, (3, 11), generator=torch.Generator().manual_seed(6))

    def loss(cores, impl):
        return C.ttm_embedding({**params, "cores": cores}, state, ids, impl=impl).square().sum()

    cores = [c.clone().requires_grad_() for c in params["cores"]]
    ref = loss(cores, "naive")
    ref_grads = torch.autograd.grad(ref, cores)
    for impl in ("static", "optimized"):
        torch._dynamo.reset()
        value = torch.compile(loss, fullgraph=True, backend="aot_eager")(cores, impl)
        grads = torch.autograd.grad(value, cores)
        torch.testing.assert_close(value, ref)
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b)
    torch._dynamo.reset()


def test_naive_lookup_checks_ids_without_a_host_read_inside_a_graph():
    """With ``sync_free=True``, or inside a :class:`SyncFreeLookups` scope (what a sync-free
    train step opens), even ``impl="naive"`` checks its ids on the device
    (``_assert_async``: a RuntimeError), not by reading them on the host; otherwise it
    raises the named IndexError, also after a scope has closed."""
    from comera.layers import SyncFreeLookups

    spec = C.TTMEmbeddingSpec(vocab_modes=(4, 5), dim_modes=(2, 3), ranks=3, num_embeddings=18)
    params, state = C.init(spec, generator=torch.Generator().manual_seed(4))
    ids, bad = torch.tensor([1, 17, 2]), torch.tensor([18])
    ref = C.ttm_embedding(params, state, ids, impl="naive")
    out = C.ttm_embedding(params, state, ids, impl="naive", sync_free=True)
    torch.testing.assert_close(out, ref)
    with pytest.raises(RuntimeError, match=r"out of range.*\[0, 18\)"):
        C.ttm_embedding(params, state, bad, impl="naive", spec=spec, sync_free=True)
    with SyncFreeLookups():
        with SyncFreeLookups():
            pass
        assert SyncFreeLookups.is_open()  # scopes nest: the inner one's exit keeps this open
        with pytest.raises(RuntimeError, match=r"out of range.*\[0, 18\)"):
            C.ttm_embedding(params, state, bad, impl="naive", spec=spec)
    assert not SyncFreeLookups.is_open()
    with pytest.raises(IndexError, match="id 18 is out of range"):
        C.ttm_embedding(params, state, bad, impl="naive", spec=spec)


def test_sync_free_optimized_lookup_runs_static(monkeypatch):
    """``impl="optimized"`` with ``sync_free=True`` or in a :class:`SyncFreeLookups` scope
    never calls ``torch.unique`` (a host sync on CUDA): it runs as ``static``, same values."""
    from comera.layers import SyncFreeLookups

    spec = C.TTMEmbeddingSpec(vocab_modes=(4, 5, 3), dim_modes=(2, 3, 2), ranks=4)
    params, state = C.init(spec, generator=torch.Generator().manual_seed(5))
    ids = torch.randint(0, 60, (3, 11), generator=torch.Generator().manual_seed(6))
    ref = C.ttm_embedding(params, state, ids)

    def no_unique(*args, **kwargs):
        raise AssertionError("torch.unique called in a sync-free lookup")

    monkeypatch.setattr(torch, "unique", no_unique)
    torch.testing.assert_close(C.ttm_embedding(params, state, ids, sync_free=True), ref)
    with SyncFreeLookups():
        torch.testing.assert_close(C.ttm_embedding(params, state, ids), ref)
    with pytest.raises(AssertionError, match="torch.unique called"):
        C.ttm_embedding(params, state, ids)  # outside: the optimized lookup's own dedup


def test_sync_free_scope_is_per_thread():
    """A scope opened on one thread (a train step) leaves another thread's lookups as they
    are: the other still reads its ids on the host and raises the IndexError."""
    import threading

    from comera.layers import SyncFreeLookups

    spec = C.TTMEmbeddingSpec(vocab_modes=(4, 5), dim_modes=(2, 3), ranks=3, num_embeddings=18)
    params, state = C.init(spec, generator=torch.Generator().manual_seed(4))
    seen: list[BaseException] = []

    def other() -> None:
        try:
            C.ttm_embedding(params, state, torch.tensor([18]), impl="naive", spec=spec)
        except BaseException as e:  # noqa: BLE001 - recorded for the main thread
            seen.append(e)

    with SyncFreeLookups():
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert len(seen) == 1 and isinstance(seen[0], IndexError), seen
