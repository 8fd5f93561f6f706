"""Rank contributions (scale-invariant rank importance) and the prune rules."""

import math

import pytest
import torch

import comera as C
from comera.tensor_train import chain, gated_cores
from comera.tree import prune_tree


def _randomize(params, state, gen, dead=()):
    """Random gates (some negative, spread over two decades) and the listed (bond, rank)s dead."""
    gates = [
        (torch.rand(g.shape, generator=gen, dtype=g.dtype) * 2 - 0.5)
        * 10 ** (torch.rand(g.shape, generator=gen, dtype=g.dtype) * 2 - 1)
        for g in params["gates"]
    ]
    masks = [m.clone() for m in state["masks"]]
    for bond, rank in dead:
        masks[bond][rank] = False
    return {**params, "gates": gates}, {**state, "masks": masks}


def _tt_layer(seed, dead=((1, 0), (2, 3)), random_gates=True):
    spec = C.TTLinearSpec(
        out_modes=(3, 4, 2), in_modes=(2, 3, 4), ranks=5, dtype=torch.float64, bias=False
    )
    gen = torch.Generator().manual_seed(seed)
    params, state = C.init(spec, generator=gen)
    if not random_gates:  # gates at one: every rank carries a fair share
        state = {"masks": [m.clone() for m in state["masks"]]}
        for bond, rank in dead:
            state["masks"][bond][rank] = False
        return params, state, spec
    return (*_randomize(params, state, gen, dead), spec)


def _ttm_layer(seed, dead=((0, 2),)):
    spec = C.TTMEmbeddingSpec(
        vocab_modes=(3, 4, 2), dim_modes=(2, 2, 3), ranks=4, dtype=torch.float64
    )
    gen = torch.Generator().manual_seed(seed)
    params, state = C.init(spec, generator=gen)
    return (*_randomize(params, state, gen, dead), spec)


def _brute_shares(params, state):
    """Shares from the explicit outer-product terms: term_i = g_i * Left_i ⊗ Right_i."""
    cores = [c.reshape(c.shape[0], -1, c.shape[-1]) for c in gated_cores(params, state)]
    raw = [c.reshape(c.shape[0], -1, c.shape[-1]) for c in params["cores"]]
    w = chain(cores)
    norm = w.norm()
    out = []
    for k, g in enumerate(params["gates"]):
        g = g * state["masks"][k].to(g.dtype)
        left = chain([*cores[:k], raw[k]])[0]  # (n_left, r_k), d_k not folded in
        right = chain(cores[k + 1 :])[..., 0]  # (r_k, n_right)
        terms = torch.einsum("i,ai,ib->iab", g, left, right)
        torch.testing.assert_close(terms.sum(0), w.reshape(left.shape[0], -1))
        out.append(terms.flatten(1).norm(dim=1) / norm)
    return out


@pytest.mark.parametrize("make", [_tt_layer, _ttm_layer], ids=["tt", "ttm"])
@pytest.mark.parametrize("seed", range(3))
def test_shares_match_brute_force(make, seed):
    params, state, _ = make(seed)
    shares = C.rank_contributions(params, state)
    expected = _brute_shares(params, state)
    assert [s.shape for s in shares] == [g.shape for g in params["gates"]]
    for s, e, m in zip(shares, expected, state["masks"], strict=True):
        assert s.dtype == torch.float64
        torch.testing.assert_close(s, e, rtol=1e-10, atol=1e-12)
        assert bool((s[~m] == 0).all())
        assert float(s.sum()) >= 1 - 1e-12  # triangle inequality over the terms


def test_shares_follow_the_dense_weight_of_float32_layers():
    spec = C.TTLinearSpec(out_modes=(4, 4), in_modes=(4, 4), ranks=6)
    params, state = C.init(spec, generator=torch.Generator().manual_seed(3))
    params64 = {**params, "cores": [c.double() for c in params["cores"]]}
    params64["gates"] = [g.double() for g in params["gates"]]
    params = {**params, "gates": [g.requires_grad_() for g in params["gates"]]}
    assert not any(s.requires_grad for s in C.rank_contributions(params, state))
    for s, e in zip(
        C.rank_contributions(params, state), _brute_shares(params64, state), strict=True
    ):
        torch.testing.assert_close(s, e, rtol=1e-10, atol=1e-12)


def _rescale(params, bond, rank, a, side="right"):
    """d_k[i] *= a and the neighbouring core slice /= a: the weight is unchanged."""
    cores = [c.clone() for c in params["cores"]]
    gates = [g.clone() for g in params["gates"]]
    gates[bond][rank] *= a
    if side == "right":
        cores[bond + 1][rank] /= a
    else:
        cores[bond][..., rank] /= a
    return {**params, "cores": cores, "gates": gates}


@pytest.mark.parametrize("make", [_tt_layer, _ttm_layer], ids=["tt", "ttm"])
def test_shares_invariant_under_scale_symmetry_and_global_scale(make):
    params, state, _ = make(7)
    base = C.rank_contributions(params, state)
    moved = params
    for bond, rank in [(0, 1), (1, 2)]:
        for side, a in [("right", 1e-3), ("left", 37.0)]:
            moved = _rescale(moved, bond, rank, a, side)
    torch.testing.assert_close(C.to_dense(moved, state), C.to_dense(params, state))
    assert float((moved["gates"][0][1] / params["gates"][0][1]).abs()) == pytest.approx(3.7e-2)
    for s, b in zip(C.rank_contributions(moved, state), base, strict=True):
        torch.testing.assert_close(s, b, rtol=1e-9, atol=1e-12)
    scaled = {**params, "cores": [params["cores"][0] * 1e4, *params["cores"][1:]]}
    scaled["gates"] = [g * -0.5 for g in params["gates"]]
    for s, b in zip(C.rank_contributions(scaled, state), base, strict=True):
        torch.testing.assert_close(s, b, rtol=1e-9, atol=1e-12)


def test_gate_rule_kills_a_rank_hidden_by_the_symmetry_contribution_rule_keeps_it():
    spec = C.TTLinearSpec(
        out_modes=(4, 3, 2), in_modes=(2, 3, 4), ranks=5, dtype=torch.float64, bias=False
    )
    params, state = C.init(spec, generator=torch.Generator().manual_seed(11))
    shares = C.rank_contributions(params, state)
    bond = 2
    rank = int(shares[bond].argmax())
    assert float(shares[bond][rank]) > 0.3
    hidden = _rescale(params, bond, rank, 1e-3)
    w = C.to_dense(params, state)
    torch.testing.assert_close(C.to_dense(hidden, state), w)

    by_gate = C.prune(hidden, state, tau=1e-2, rule="gate")
    assert not bool(by_gate["masks"][bond][rank])
    assert C.live_ranks(by_gate) == [r - (b == bond) for b, r in enumerate(spec.ranks)]
    w_gate = C.to_dense(*C.compact(hidden, by_gate))
    assert float((w_gate - w).norm() / w.norm()) > 0.3  # the function changes a lot

    by_share = C.prune(hidden, state, tau=1e-2, rule="contribution")
    assert C.live_ranks(by_share) == C.live_ranks(state)
    torch.testing.assert_close(C.to_dense(*C.compact(hidden, by_share)), w)
    # and the default is still the gate rule
    assert [m.tolist() for m in C.prune(hidden, state, 1e-2)["masks"]] == [
        m.tolist() for m in by_gate["masks"]
    ]


def test_contribution_rule_prunes_a_rank_that_carries_nothing():
    params, state, spec = _tt_layer(5, dead=(), random_gates=False)
    assert float(torch.cat(C.rank_contributions(params, state)).min()) > 0.05
    cores = [c.clone() for c in params["cores"]]
    cores[2][1] = 0.0  # rank 1 of bond 1 feeds nothing into the right train
    cores[1][..., 3] *= 1e-6  # rank 3 of bond 1 carries a millionth-ish share
    params = {**params, "cores": cores}
    params["gates"][1][1] = params["gates"][1][3] = 50.0  # big gates do not save them
    new = C.prune(params, state, tau=1e-2, rule="contribution")
    assert new["masks"][1].tolist() == [True, False, True, False, True]
    assert C.prune(params, state, tau=1e-2, rule="gate")["masks"][1].tolist() == [True] * 5
    # the weight moves by at most the removed shares (here: only rank 3's, ~1e-4) x ||W||
    shares = C.rank_contributions(params, state)[1]
    assert float(shares[1]) == 0 and 0 < float(shares[3]) < 1e-3
    w = C.to_dense(params, state)
    moved = float((C.to_dense(*C.compact(params, new)) - w).norm() / w.norm())
    assert moved <= float(shares[3]) * (1 + 1e-9)


def test_contribution_rule_cannot_empty_a_bond_of_a_nonzero_weight():
    params, state, _ = _tt_layer(2, dead=(), random_gates=False)
    for tau in [1e-2, 0.15]:  # below 1 / rank = 0.2
        new = C.prune(params, state, tau=tau, rule="contribution")
        assert all(n >= 1 for n in C.live_ranks(new))
    zero = {**params, "cores": [torch.zeros_like(c) for c in params["cores"]]}
    assert all(float(s.abs().sum()) == 0 for s in C.rank_contributions(zero, state))
    emptied = C.prune(zero, state, tau=1e-2, rule="contribution")
    assert C.live_ranks(emptied) == [0] * len(state["masks"])


def test_unknown_rule_names_the_valid_ones():
    params, state, _ = _tt_layer(0)
    assert C.PRUNE_RULES == ("gate", "contribution")
    with pytest.raises(ValueError, match="'share'.*gate, contribution"):
        C.prune(params, state, 1e-2, rule="share")
    with pytest.raises(ValueError, match="gate, contribution"):
        prune_tree({}, {}, 1e-2, rule="magnitude")


@pytest.mark.parametrize("rule", ["gate", "contribution"])
def test_dead_ranks_stay_dead(rule):
    params, state, _ = _tt_layer(4, dead=((0, 1), (1, 4)))
    params["gates"][0][1] = params["gates"][1][4] = 100.0  # a dead rank's gate grew back
    new = C.prune(params, state, tau=1e-2, rule=rule)
    assert not bool(new["masks"][0][1]) and not bool(new["masks"][1][4])
    assert all(bool(m.all()) for m in new["masks"][2:])  # nothing else dies here
    assert C.rank_contributions(params, state)[0][1] == 0


def test_prune_tree_passes_the_rule_and_prune_is_pure():
    params, state, _ = _tt_layer(9, dead=(), random_gates=False)
    hidden = _rescale(params, 1, 2, 1e-3)
    tree_p = {"blocks": [{"lin": hidden, "norm": torch.ones(3)}]}
    tree_s = {"blocks": [{"lin": state}]}
    by_gate = prune_tree(tree_p, tree_s, 1e-2)
    by_share = prune_tree(tree_p, tree_s, 1e-2, rule="contribution")
    assert not bool(by_gate["blocks"][0]["lin"]["masks"][1][2])
    assert bool(by_share["blocks"][0]["lin"]["masks"][1][2])
    assert all(bool(m.all()) for m in state["masks"])


def test_compacted_and_empty_layers():
    params, state, _ = _tt_layer(1, dead=((1, 0), (1, 1)))
    small, small_state = C.compact(params, state)
    full = C.rank_contributions(params, state)
    torch.testing.assert_close(C.rank_contributions(small, small_state)[1], full[1][2:])
    dead = {"masks": [torch.zeros_like(m) for m in state["masks"]]}
    empty, empty_state = C.compact(params, dead)
    assert [s.numel() for s in C.rank_contributions(empty, empty_state)] == [0] * len(full)


def test_shares_at_init_are_about_one_over_sqrt_rank():
    spec = C.TTLinearSpec(out_modes=(12, 8, 8), in_modes=(8, 8, 12), ranks=30)
    params, state = C.init(spec, generator=torch.Generator().manual_seed(0))
    shares = C.rank_contributions(params, state)
    for s, r in zip(shares, spec.ranks, strict=True):
        assert float(s.min()) > 0.3 / math.sqrt(r)
        assert float((s**2).sum()) == pytest.approx(1.0, abs=0.25)  # nearly orthogonal terms


def test_tree_leaves_match_torch_pytree():
    """``comera.tree.leaves`` lists leaves in ``tree_flatten`` order (dicts by insertion,
    None a leaf) and hands other containers to torch's walk."""
    import collections

    from torch.utils._pytree import tree_flatten

    from comera.tree import leaves

    t = torch.ones(2)
    tree = {"b": [t, (None, 3)], "a": {"z": t * 2, "y": []}, "c": "s"}
    assert [id(x) for x in leaves(tree)] == [id(x) for x in tree_flatten(tree)[0]]
    pair = collections.namedtuple("Pair", "x y")
    odd = {"n": pair(1, t), "o": collections.OrderedDict(b=2, a=3)}
    assert leaves(odd) == tree_flatten(odd)[0]


def test_compact_keeps_requires_grad_so_autograd_reaches_the_result():
    """The functional compact returned detached cores and gates (requires_grad False) but
    the bias as it was; each now keeps its old tensor's flag, as the module adapter does."""
    spec = C.TTLinearSpec(out_modes=(3, 4), in_modes=(2, 5), ranks=4)
    p, s = C.init(spec, generator=torch.Generator().manual_seed(0))
    for t in [*p["cores"], *p["gates"], p["bias"]]:
        t.requires_grad_()
    p["gates"][0].requires_grad_(False)  # one frozen: stays frozen
    s = {"masks": [s["masks"][0], s["masks"][1].clone().fill_(True), s["masks"][2]]}
    s["masks"][1][0] = False
    p2, s2 = C.compact(p, s)
    assert [c.requires_grad for c in p2["cores"]] == [True] * 4
    assert [g.requires_grad for g in p2["gates"]] == [False, True, True]
    loss = C.tt_linear(p2, s2, torch.randn(2, 10)).sum()
    grads = torch.autograd.grad(loss, p2["cores"])
    assert [g.shape for g in grads] == [c.shape for c in p2["cores"]]


def test_compaction_keeps_tuples_and_namedtuples_in_the_tree():
    """A namedtuple of plain tensors beside a TT layer came back from compact_tree as a
    list (a task reading head.w failed at the run's first compaction), and a tuple as a
    list, in params, state and optimizer moments alike."""
    from collections import namedtuple

    from comera.tree import compact_tree, prune_tree

    Head = namedtuple("Head", "w b")
    spec = C.TTLinearSpec(out_modes=(4, 4), in_modes=(4, 4), ranks=4, name="tt")
    p, s = C.init(spec, generator=torch.Generator().manual_seed(0))
    p["gates"][0].data[0] = 0.0  # a rank to remove
    params = {"layers": (p, Head(torch.ones(2), torch.zeros(2))), "pair": (torch.ones(1),)}
    state = {"layers": (s, None)}
    moments = {"layers": (p, Head(torch.ones(2), torch.zeros(2))), "pair": (torch.ones(1),)}
    state = prune_tree(params, state, 0.01)
    new_p, new_s, new_m = compact_tree(params, state, moments)
    for tree in (new_p, new_m):
        assert type(tree["layers"]) is tuple and type(tree["layers"][1]) is Head
        assert type(tree["pair"]) is tuple and tree["layers"][1].w.tolist() == [1.0, 1.0]
    assert type(new_s["layers"]) is tuple
    assert new_p["layers"][0]["gates"][0].shape[0] == 3  # the rank went

    class Star(tuple):  # a tuple subclass built otherwise: a list, as before (not corrupted)
        def __new__(cls, *items):
            return super().__new__(cls, items)

    odd, _ = compact_tree({"x": Star(torch.ones(1), torch.zeros(1))}, {})
    assert type(odd["x"]) is list and [t.item() for t in odd["x"]] == [1.0, 0.0]
