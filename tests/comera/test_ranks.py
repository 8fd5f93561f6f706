"""Rank gates, masks, prune and compact."""

import math

import pytest
import torch

import comera as C
from comera.accounting import live_param_count
from comera.errors import ConfigError
from comera.tensor_train import bond_ranks


def _expected_live_params(spec_modes, live, bias, ttm_dims=None):
    full = [1, *live, 1]
    per_mode = (
        spec_modes
        if ttm_dims is None
        else [v * d for v, d in zip(spec_modes, ttm_dims, strict=True)]
    )
    n = sum(full[k] * m * full[k + 1] for k, m in enumerate(per_mode))
    return n + sum(live) + bias


def _kill(params, which):
    """Set the gates listed in ``which`` ({bond: [rank indices]}) to tiny values."""
    gates = [g.clone() for g in params["gates"]]
    for bond, idx in which.items():
        gates[bond][idx] = 1e-4
    return {**params, "gates": gates}


def test_prune_is_pure_and_thresholds_magnitudes():
    spec = C.TTLinearSpec(out_modes=(3, 4), in_modes=(4, 2), ranks=4)
    params, state = C.init(spec, generator=torch.Generator().manual_seed(0))
    params = _kill(params, {1: [0, 2]})
    params["gates"][0][1] = -0.005  # negative gates are judged by magnitude
    new = C.prune(params, state, tau=1e-2)
    assert all(bool(m.all()) for m in state["masks"])  # input untouched
    assert C.live_ranks(new) == [2, 2, 2]
    assert new["masks"][1].tolist() == [False, True, False, True]
    # dead ranks stay dead even if a gate grows back
    params["gates"][1][0] = 5.0
    assert C.live_ranks(C.prune(params, new, tau=1e-2)) == [2, 2, 2]


@pytest.mark.parametrize("seed", range(8))
def test_compact_preserves_function_and_shrinks_by_formula(seed):
    gen = torch.Generator().manual_seed(seed)
    spec = C.TTLinearSpec(out_modes=(4, 3, 2), in_modes=(2, 3, 4), ranks=5, dtype=torch.float64)
    params, state = C.init(spec, generator=gen)
    kill = {
        b: torch.randperm(r, generator=gen)[
            : torch.randint(0, r, (1,), generator=gen).item()
        ].tolist()
        for b, r in enumerate(spec.ranks)
    }
    params = _kill(params, kill)
    state = C.prune(params, state, tau=1e-3)
    x = torch.randn(7, spec.in_features, generator=gen, dtype=torch.float64)
    before = C.tt_linear(params, state, x)
    live = C.live_ranks(state)
    predicted = live_param_count(params, state)
    new_params, new_state = C.compact(params, state)
    assert bond_ranks(new_params) == live
    assert predicted == _expected_live_params(spec.modes, live, spec.out_features)
    assert C.param_count(new_params) == predicted
    for strategy in C.STRATEGIES:
        torch.testing.assert_close(C.tt_linear(new_params, new_state, x, plan=strategy), before)
    torch.testing.assert_close(C.to_dense(new_params, new_state), C.to_dense(params, state))
    dense = spec.in_features * spec.out_features + spec.out_features
    assert C.compression_ratio(new_params, new_state) == pytest.approx(dense / predicted)


def test_masked_rank_contributes_nothing_before_compaction():
    spec = C.TTLinearSpec(
        out_modes=(3, 2), in_modes=(2, 3), ranks=3, dtype=torch.float64, bias=False
    )
    params, state = C.init(spec, generator=torch.Generator().manual_seed(1))
    state = {"masks": [m.clone() for m in state["masks"]]}
    state["masks"][1][0] = False
    # changing the dead rank's core slices must not change the output
    x = torch.randn(4, 6, dtype=torch.float64)
    y = C.tt_linear(params, state, x)
    cores = [c.clone() for c in params["cores"]]
    cores[1][..., 0] += 10.0
    y2 = C.tt_linear({**params, "cores": cores}, state, x)
    torch.testing.assert_close(y, y2)


def test_dead_bond_makes_zero_map_with_zero_params():
    spec = C.TTLinearSpec(out_modes=(3, 4), in_modes=(4, 2), ranks=3, dtype=torch.float64)
    params, state = C.init(spec, generator=torch.Generator().manual_seed(2))
    assert spec.ranks == (3, 3, 2)
    params = _kill(params, {2: [0, 1]})
    state = C.prune(params, state, tau=1e-3)
    assert live_param_count(params, state) == spec.out_features  # bias only
    new_params, new_state = C.compact(params, state)
    assert bond_ranks(new_params) == [0, 0, 0]
    assert sum(c.numel() for c in new_params["cores"]) == 0
    assert sum(g.numel() for g in new_params["gates"]) == 0
    x = torch.randn(5, 8, dtype=torch.float64)
    for strategy in C.STRATEGIES:
        y = C.tt_linear(new_params, new_state, x, plan=strategy)
        torch.testing.assert_close(y, params["bias"].expand(5, 12))
    assert torch.count_nonzero(C.to_dense(new_params, new_state)) == 0
    assert C.compression_ratio({**new_params, "bias": None}, new_state) == math.inf


def test_ttm_compact_preserves_lookup_and_counts():
    gen = torch.Generator().manual_seed(3)
    spec = C.TTMEmbeddingSpec(
        vocab_modes=(4, 5, 3), dim_modes=(2, 3, 2), ranks=6, dtype=torch.float64
    )
    params, state = C.init(spec, generator=gen)
    params = _kill(params, {0: [1, 3, 4], 1: [0]})
    state = C.prune(params, state, tau=1e-3)
    ids = torch.randint(0, 60, (3, 11), generator=gen)
    before = C.ttm_embedding(params, state, ids)
    new_params, new_state = C.compact(params, state)
    live = C.live_ranks(state)
    assert bond_ranks(new_params) == live
    expected = _expected_live_params(spec.vocab_modes, live, 0, spec.dim_modes)
    assert C.param_count(new_params) == live_param_count(params, state) == expected
    for impl in C.EMBEDDING_IMPLS:
        torch.testing.assert_close(C.ttm_embedding(new_params, new_state, ids, impl=impl), before)


def test_module_prune_compact():
    spec = C.TTLinearSpec(out_modes=(4, 4), in_modes=(4, 4), ranks=4, dtype=torch.float64)
    layer = C.TTLinear(spec, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        layer.gates[1][:2] = 0.0
    x = torch.randn(3, 16, dtype=torch.float64)
    before = layer(x)
    assert layer.prune(1e-2) == [4, 2, 4]
    torch.testing.assert_close(layer(x), before)
    layer.compact()
    assert bond_ranks(layer.params()) == [4, 2, 4]
    assert tuple(layer.masks.as_list()[1].shape) == (2,)
    torch.testing.assert_close(layer(x), before)


def test_summary_table_over_model_pytree():
    lin = C.TTLinearSpec(out_modes=(12, 8, 8), in_modes=(8, 8, 12), ranks=30, name="q")
    emb = C.TTMEmbeddingSpec(vocab_modes=(16, 20, 10, 10), dim_modes=(4, 4, 8, 6), ranks=32)
    pl, sl = C.init(lin)
    pe, se = C.init(emb)
    model = {"embed": pe, "layers": [{"q": pl, "ln": torch.ones(768)}]}
    state = {"embed": se, "layers": [{"q": sl}]}
    rows = C.summarize(model, state)
    kinds = {r.path: r.kind for r in rows}
    assert kinds == {"embed": "ttm_embedding", "layers.0.q": "tt_linear", "layers.0.ln": "dense"}
    q = next(r for r in rows if r.path == "layers.0.q")
    assert q.dense_shape == (768, 768) and q.ranks == (12, 30, 30, 30, 12)
    assert q.live_params == C.param_count(pl)
    table = C.summary_table(model, state)
    assert "layers.0.q" in table and "**total**" in table


def test_counts_refuse_a_state_rows_or_paths_that_are_not_these_params():
    """A rank state from before a compaction was counted as if it were the params' own
    (98.3x read as 27.7x; live ranks above the stored ones in summary_table); a row
    count above the table's padded rows inflated its ratio (45,454x), one given for a
    linear layer was ignored, and a summarize key that names no layer left it at its
    padded size. Each is refused by name; the counts of matching inputs are unchanged."""
    spec = C.TTLinearSpec(out_modes=(12, 8, 8), in_modes=(8, 8, 12), ranks=30, name="q")
    p, s0 = C.init(spec, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for g in p["gates"]:
            g[: g.numel() // 2] = 0
    p2, s2 = C.compact(p, C.prune(p, s0, 1e-2))
    assert C.compression_ratio(p2, s2) == pytest.approx(768 * 768 / 6009 + 0.0, rel=0.02)
    assert live_param_count(p2, s2) == C.param_count(p2)
    for call in (lambda: C.compression_ratio(p2, s0), lambda: C.summarize({"q": p2}, {"q": s0}),
                 lambda: live_param_count(p2, {"masks": s2["masks"][:-1]})):  # fmt: skip
        with pytest.raises(ValueError, match="rank state does not match|gates for"):
            call()
    emb = C.TTMEmbeddingSpec(vocab_modes=(3, 4, 5), dim_modes=(2, 3, 2), ranks=4)
    pe, se = C.init(emb)
    assert C.compression_ratio(pe, se, num_embeddings=55) < C.compression_ratio(pe, se)
    with pytest.raises(ValueError, match="num_embeddings=61 is more rows than the table"):
        C.compression_ratio(pe, se, num_embeddings=61)
    with pytest.raises(ValueError, match="num_embeddings is a TTM table's row count"):
        C.compression_ratio(p2, s2, num_embeddings=55)
    model, state = {"e": pe, "q": p2}, {"e": se, "q": s2}
    assert C.summarize(model, state, num_embeddings={"e": 55})[0].dense_params == 55 * 12
    with pytest.raises(ConfigError, match=r"num_embeddings names \['emb'\], which name no layer"):
        C.summarize(model, state, num_embeddings={"emb": 55})
    with pytest.raises(ConfigError, match=r"names \['q'\], which are TT linear layers, not TTM"):
        C.summary_table(model, state, num_embeddings={"q": 55})
    with pytest.raises(ConfigError, match=r"dense_shapes names \['k'\], which name no layer"):
        C.summarize(model, state, dense_shapes={"k": (700, 768)})
    # a map over every table, one of which stayed dense, and a bare layer's root key ""
    mixed = {**model, "d": {"weight": torch.zeros(7, 5)}}
    assert len(C.summarize(mixed, state, num_embeddings={"e": 55, "d": 7})) == 3
    assert C.summarize(pe, se, num_embeddings={"": 55})[0].dense_params == 55 * 12
    # a parent of a table beside dense tensors is no table's key: 'blk' for blk.e
    nested, nested_state = {"blk": {"e": pe, "norm": torch.zeros(4)}}, {"blk": {"e": se}}
    with pytest.raises(ConfigError, match=r"names \['blk'\], which name no layer"):
        C.summarize(nested, nested_state, num_embeddings={"blk": 5})
