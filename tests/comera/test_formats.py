"""TT/TTM formats: specs, factorization, init variance, TT-SVD, to_dense."""

import math

import pytest
import torch

import comera as C
from comera.spec import cap_ranks, factorize, propose_modes


def test_cap_ranks_caps_edges_by_mode_products():
    assert cap_ranks((12, 8, 8, 8, 8, 12), 30) == (12, 30, 30, 30, 12)
    assert cap_ranks((2, 3, 4), (100, 100)) == (2, 4)
    spec = C.TTLinearSpec(out_modes=(12, 8, 8), in_modes=(8, 8, 12), ranks=30)
    assert spec.ranks == (12, 30, 30, 30, 12)
    assert spec.dense_shape == (768, 768)


@pytest.mark.parametrize("n,d", [(768, 3), (3072, 3), (1024, 2), (30, 3), (7, 1)])
def test_factorize_exact(n, d):
    modes = factorize(n, d)
    assert modes is not None and math.prod(modes) == n and len(modes) == d
    assert max(modes) <= 2 * n ** (1 / d) + 1


def test_factorize_rejects_large_prime_factor():
    assert factorize(2 * 3 * 5087, 3) is None
    with pytest.raises(ValueError, match="pad=True"):
        propose_modes(30522, 4)
    # the primes show why: one too large, or too few for d modes of at least 2
    with pytest.raises(ValueError, match="30522 = 2 x 3 x 5087 has no balanced"):
        propose_modes(30522, 4)
    with pytest.raises(ValueError, match="8 = 2 x 2 x 2 has no balanced .* pass a smaller d$"):
        propose_modes(8, 4)


def test_vocab_padding_is_balanced():
    modes = propose_modes(30522, 4, pad=True)
    padded = math.prod(modes)
    assert 30522 <= padded <= 30522 * 1.1
    assert max(modes) <= 16, modes  # not 2 x 3 x 5087
    spec = C.propose_ttm_embedding(30522, 768)
    assert spec.num_embeddings == 30522 and spec.padded_vocab == padded
    assert math.prod(spec.dim_modes) == 768


def test_propose_tt_linear_puts_big_modes_at_the_edges():
    spec = C.propose_tt_linear(768, 3072, d=3, ranks=30)
    assert spec.out_modes[0] == max(spec.out_modes)
    assert spec.in_modes[-1] == max(spec.in_modes)
    assert spec.dense_shape == (768, 3072)


@pytest.mark.parametrize(
    "spec,target_var",
    [
        (C.TTLinearSpec(out_modes=(12, 8, 8), in_modes=(8, 8, 12), ranks=30), 1 / (3 * 768)),
        (C.TTLinearSpec(out_modes=(8, 8), in_modes=(4, 16), ranks=10, std=0.02), 0.02**2),
        (C.TTMEmbeddingSpec(vocab_modes=(10, 10, 10), dim_modes=(4, 4, 4), ranks=16), 1.0),
    ],
)
def test_init_matches_dense_variance(spec, target_var):
    # average over several seeds: one TT draw has correlated entries
    vars_ = []
    for seed in range(6):
        params, state = C.init(spec, generator=torch.Generator().manual_seed(seed))
        vars_.append(C.to_dense(params, state).double().var().item())
    ratio = sum(vars_) / len(vars_) / target_var
    assert 0.6 < ratio < 1.6, ratio


def test_init_layout_gates_ones_masks_alive():
    spec = C.TTLinearSpec(out_modes=(4, 3), in_modes=(2, 5), ranks=3)
    params, state = C.init(spec, generator=torch.Generator().manual_seed(0))
    assert [tuple(c.shape) for c in params["cores"]] == [(1, 4, 3), (3, 3, 3), (3, 2, 3), (3, 5, 1)]
    assert all(torch.equal(g, torch.ones(3)) for g in params["gates"])
    assert all(m.dtype == torch.bool and bool(m.all()) for m in state["masks"])
    assert params["bias"].shape == (12,)


@pytest.mark.parametrize(
    "out_modes,in_modes", [((4, 3), (2, 5)), ((2, 3, 2), (3, 2, 2)), ((6,), (5,))]
)
def test_from_dense_full_rank_is_exact(out_modes, in_modes):
    torch.manual_seed(0)
    spec = C.TTLinearSpec(out_modes=out_modes, in_modes=in_modes, ranks=1000, dtype=torch.float64)
    w = torch.randn(spec.dense_shape, dtype=torch.float64)
    b = torch.randn(spec.out_features, dtype=torch.float64)
    params, state = C.from_dense(w, spec, b)
    torch.testing.assert_close(C.to_dense(params, state), w)
    torch.testing.assert_close(params["bias"], b)


def test_from_dense_truncation_is_best_at_rank_for_a_matrix():
    # With two cores, TT-SVD is the truncated SVD: error equals the tail singular values.
    torch.manual_seed(1)
    spec = C.TTLinearSpec(out_modes=(12,), in_modes=(10,), ranks=4, dtype=torch.float64, bias=False)
    w = torch.randn(12, 10, dtype=torch.float64)
    params, state = C.from_dense(w, spec)
    s = torch.linalg.svdvals(w)
    err = torch.linalg.norm(C.to_dense(params, state) - w)
    torch.testing.assert_close(err, torch.linalg.norm(s[4:]))


def _textbook_tt_svd(t: torch.Tensor, ranks: tuple[int, ...]) -> torch.Tensor:
    """TT-SVD through a full SVD of every unfolding, multiplied back out (a reference)."""
    rest, out = t.reshape(1, -1), torch.ones(1, 1, dtype=t.dtype)
    for k, n in enumerate(t.shape[:-1]):
        u, s, vh = torch.linalg.svd(rest.reshape(rest.shape[0] * n, -1), full_matrices=False)
        r = min(ranks[k], s.shape[0])
        out = (out @ u[:, :r].reshape(rest.shape[0], -1)).reshape(-1, r)
        rest = s[:r, None] * vh[:r]
    return (out @ rest).reshape(t.shape)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "out_modes,in_modes,ranks",
    [((3, 4), (5, 3), 2), ((2, 9), (3, 2), 3), ((7, 2), (2, 11), (4, 3, 2))],
)
def test_from_dense_truncation_matches_textbook_tt_svd(out_modes, in_modes, ranks, dtype):
    # binding ranks through wide and tall unfoldings (each takes its own path to
    # the leading singular vectors); distinct singular values make the result unique
    torch.manual_seed(3)
    spec = C.TTLinearSpec(out_modes=out_modes, in_modes=in_modes, ranks=ranks, dtype=dtype,
                          bias=False)  # fmt: skip
    w = torch.randn(spec.dense_shape, dtype=torch.float64)
    params, state = C.from_dense(w.to(dtype), spec)
    assert [c.dtype for c in params["cores"]] == [dtype] * len(spec.modes)
    want = _textbook_tt_svd(w.reshape(spec.modes), spec.ranks).reshape(spec.dense_shape)
    got = C.to_dense(params, state).double()
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.linalg.norm(got - w) > 0.1  # the ranks did bind


def test_from_dense_keeps_float64_small_singular_values():
    # a float64 Gram matrix squares them away: singular value 1e-9 of an exact rank-4
    # weight came back with error 1e-9, not 1e-15
    torch.manual_seed(4)
    u, _ = torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(40, 8, dtype=torch.float64))
    s = torch.tensor([1, 0.5, 1e-9, 5e-10, 0, 0, 0, 0], dtype=torch.float64)
    w = (u * s) @ v.T  # rank 4 across the first unfolding (out_modes (8,) | rest)
    spec = C.TTLinearSpec(out_modes=(8,), in_modes=(40,), ranks=4, dtype=torch.float64,
                          bias=False)  # fmt: skip
    params, state = C.from_dense(w, spec)
    assert float(torch.linalg.norm(C.to_dense(params, state) - w)) < 1e-13


def test_ttm_from_dense_roundtrip_with_padding():
    torch.manual_seed(2)
    spec = C.TTMEmbeddingSpec(
        vocab_modes=(4, 5, 3),
        dim_modes=(2, 3, 2),
        ranks=1000,
        num_embeddings=57,
        dtype=torch.float64,
    )
    table = torch.randn(57, 12, dtype=torch.float64)
    params, state = C.from_dense(table, spec)
    torch.testing.assert_close(C.to_dense(params, state, spec), table)
    ids = torch.tensor([0, 56, 13, 13, 40])
    torch.testing.assert_close(C.ttm_embedding(params, state, ids, spec=spec), table[ids])
