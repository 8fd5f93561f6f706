"""Every contraction strategy computes x W^T (+ b) with the same values and gradients."""

import random
import threading

import pytest
import torch

import comera as C
from comera.accounting import tt_linear_flops
from comera.errors import ConfigError
from comera.layers import tt_linear_shared_input
from comera.plans import tt_linear_plan


def _random_spec(rng: random.Random, dtype=torch.float64) -> C.TTLinearSpec:
    d = rng.choice([1, 2, 3])
    out_modes = tuple(rng.randint(1, 4) for _ in range(d))
    in_modes = tuple(rng.randint(1, 4) for _ in range(d))
    ranks = tuple(rng.randint(1, 5) for _ in range(2 * d - 1))
    return C.TTLinearSpec(
        out_modes=out_modes, in_modes=in_modes, ranks=ranks, dtype=dtype, bias=rng.random() < 0.7
    )


def _random_gates(params, gen):
    return {
        **params,
        "gates": [
            g + 0.5 * torch.randn(g.shape, generator=gen, dtype=g.dtype) for g in params["gates"]
        ],
    }


@pytest.mark.parametrize("seed", range(25))
def test_all_strategies_match_dense(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    spec = _random_spec(rng)
    params, state = C.init(spec, generator=gen)
    params = _random_gates(params, gen)
    lead = rng.choice([(7,), (2, 3), (1,), (5, 1, 2)])
    x = torch.randn(*lead, spec.in_features, generator=gen, dtype=torch.float64)
    w = C.to_dense(params, state)
    ref = x @ w.T + (params["bias"] if spec.bias else 0)
    for strategy in C.STRATEGIES:
        y = C.tt_linear(params, state, x, plan=strategy)
        assert y.shape == (*lead, spec.out_features)
        torch.testing.assert_close(y, ref, msg=strategy)


@pytest.mark.parametrize("seed", range(6))
def test_all_strategies_agree_in_float32_outputs_and_gradients(seed):
    rng = random.Random(100 + seed)
    gen = torch.Generator().manual_seed(seed)
    spec = _random_spec(rng, torch.float32)
    params, state = C.init(spec, generator=gen)
    params = _random_gates(params, gen)
    x = torch.randn(9, spec.in_features, generator=gen)
    g = torch.randn(9, spec.out_features, generator=gen)

    def run(strategy):
        leaves = {
            k: (
                [t.clone().requires_grad_() for t in v]
                if isinstance(v, list)
                else v.clone().requires_grad_()
            )
            for k, v in params.items()
        }
        xx = x.clone().requires_grad_()
        y = C.tt_linear(leaves, state, xx, plan=strategy)
        y.backward(g)
        grads = [xx.grad] + [t.grad for t in leaves["cores"] + leaves["gates"]]
        return y.detach(), grads

    ref_y, ref_g = run("dense")
    for strategy in C.STRATEGIES:
        y, grads = run(strategy)
        torch.testing.assert_close(y, ref_y, rtol=1e-4, atol=1e-5, msg=strategy)
        for a, b in zip(grads, ref_g, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=strategy)


@pytest.mark.parametrize("strategy", [*C.STRATEGIES, "explicit"])
def test_every_plan_runs_under_bf16_autocast(strategy):
    """opt_einsum's paths mix einsum steps (which autocast casts) with tensordot steps
    (which it does not, and which refuse mixed dtypes): every plan must still run, in
    autocast's dtype, close to the fp32 values, with fp32 gradients for the fp32 leaves."""
    from comera.autotune import PlanTuner, use_tuner

    gen = torch.Generator().manual_seed(4)
    spec = C.TTLinearSpec(out_modes=(4, 5), in_modes=(4, 6), ranks=3, bias=True)
    params, state = C.init(spec, generator=gen)
    x = torch.randn(8, 24, generator=gen)
    ref = C.tt_linear(params, state, x, plan="dense")
    plan = [(0, 4), (0, 3), (0, 2), (0, 1)] if strategy == "explicit" else strategy
    leaves = {**params, "cores": [c.clone().requires_grad_() for c in params["cores"]]}
    with use_tuner(PlanTuner()), torch.autocast("cpu", dtype=torch.bfloat16):
        y = C.tt_linear(leaves, state, x, plan=plan)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=0.05, atol=0.05)
    y.float().sum().backward()
    assert all(c.grad is not None and c.grad.dtype == torch.float32 for c in leaves["cores"])


@pytest.mark.parametrize("strategy", [*C.STRATEGIES, "explicit"])
def test_gradcheck_float64(strategy):
    gen = torch.Generator().manual_seed(3)
    spec = C.TTLinearSpec(out_modes=(2, 3), in_modes=(3, 2), ranks=(2, 3, 2), dtype=torch.float64)
    params, state = C.init(spec, generator=gen)
    plan = [(0, 4), (0, 3), (0, 2), (0, 1)] if strategy == "explicit" else strategy
    x = torch.randn(4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    tensors = [*params["cores"], *params["gates"], params["bias"]]
    tensors = [t.clone().requires_grad_() for t in tensors]

    def f(x, *leaves):
        p = {"cores": list(leaves[:4]), "gates": list(leaves[4:7]), "bias": leaves[7]}
        return C.tt_linear(p, state, x, plan=plan)

    assert torch.autograd.gradcheck(f, (x, *tensors))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("strategy", ["comera", "dense", "dp", "optimal", "greedy"])
def test_every_plan_returns_a_contiguous_output(strategy, bias):
    """With one mode a side, dp and optimal ended in a transposed product, so a caller's
    ``.view()`` of the output failed under those plans only (adding a bias kept its
    strides)."""
    spec = C.TTLinearSpec(out_modes=(6,), in_modes=(5,), ranks=3, bias=bias)
    p, s = C.init(spec, generator=torch.Generator().manual_seed(0))
    x = torch.randn(30, 5, generator=torch.Generator().manual_seed(1))
    y = C.tt_linear(p, s, x, plan=strategy)
    assert y.is_contiguous() and y.view(-1).shape == (180,)


@pytest.mark.parametrize("strategy", ["comera", "dense", "dp"])
def test_an_in_place_op_on_a_2d_output_copies_no_gradient(strategy):
    """A 2-D input's output is the GEMM's own tensor, not a same-shape reshape of it: an
    in-place op on a view (DLRM's ``relu_`` after its TT MLP layers) makes autograd copy
    the whole output gradient in backward (``CopySlices``: 5-7% of DLRM's Kaggle-size
    step). Q, K, V through the shared-input path keep that too."""
    spec = C.TTLinearSpec(out_modes=(4, 4), in_modes=(4, 2), ranks=3, bias=True)
    p, s = C.init(spec, generator=torch.Generator().manual_seed(0))
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = C.tt_linear(p, s, x, plan=strategy)
    assert y._base is None  # a view: relu_ would make its base's grad_fn a CopySlices
    y = torch.relu_(y)
    assert type(y.grad_fn).__name__ == "ReluBackward0"
    (g,) = torch.autograd.grad(y.sum(), x)
    (ref,) = torch.autograd.grad(torch.relu(C.tt_linear(p, s, x, plan=strategy)).sum(), x)
    torch.testing.assert_close(g, ref)
    for out in tt_linear_shared_input([(p, s)], x):
        assert out._base is None
    # an input of more dims still gets its leading dims back
    assert C.tt_linear(p, s, x.reshape(2, 5, 8), plan=strategy).shape == (2, 5, 16)


def test_explicit_pairs_match_and_are_reported():
    gen = torch.Generator().manual_seed(4)
    spec = C.TTLinearSpec(out_modes=(3, 4), in_modes=(2, 5), ranks=3, dtype=torch.float64)
    params, state = C.init(spec, generator=gen)
    x = torch.randn(6, 10, generator=gen, dtype=torch.float64)
    pairs = [(0, 4), (0, 3), (1, 2), (0, 1)]
    y = C.tt_linear(params, state, x, plan=pairs)
    torch.testing.assert_close(y, C.tt_linear(params, state, x, plan="dense"))
    plan = tt_linear_plan(pairs, [c.shape for c in params["cores"]], 6)
    assert plan.strategy == "explicit" and [tuple(p) for p in plan.path] == pairs


def test_plans_are_cached_per_shape_and_bucket_and_report_costs():
    shapes = [(1, 12, 12), (12, 8, 30), (30, 8, 30), (30, 8, 30), (30, 8, 12), (12, 12, 1)]
    a = tt_linear_plan("dp", shapes, 4000)
    b = tt_linear_plan("dp", shapes, 4096)  # same power-of-two bucket
    c = tt_linear_plan("dp", shapes, 5000)
    assert a is b and a is not c
    assert a.tokens == 4096 and a.flops > 0 and a.largest_intermediate > 0
    assert len(a.path) == len(shapes)  # 7 operands -> 6 pairwise contractions
    comera = tt_linear_plan("comera", shapes, 4096)
    dense = tt_linear_plan("dense", shapes, 4096)
    # The paper's path is far cheaper than rebuilding W at this size.
    assert comera.flops < dense.flops / 5
    assert "comera" in comera.describe()


def test_default_plan_is_global_and_scoped():
    assert C.get_default_plan() == "comera"
    with C.default_plan("greedy"):
        assert C.get_default_plan() == "greedy"
        spec = C.TTLinearSpec(out_modes=(2, 2), in_modes=(2, 2), ranks=2)
        layer = C.TTLinear(spec, generator=torch.Generator().manual_seed(0))
        layer(torch.randn(3, 4))  # uses the scoped default
    assert C.get_default_plan() == "comera"
    C.set_default_plan("dp")
    try:
        assert C.get_default_plan() == "dp"
        seen = []
        t = threading.Thread(target=lambda: seen.append(C.get_default_plan()))
        t.start()
        t.join()
        assert seen == ["dp"]  # process-wide: other threads see it too
        with C.default_plan("greedy"):
            assert C.get_default_plan() == "greedy"
        assert C.get_default_plan() == "dp"
    finally:
        C.set_default_plan(None)
    assert C.get_default_plan() == "comera"


def test_default_plan_carries_torch_compiles_constant_mark():
    """``get_default_plan`` is marked as ``torch.compiler.assume_constant_result`` marks a
    function (attribute for attribute), without calling it, which would import
    ``torch._dynamo`` with ``comera`` (that ``import comera`` does not:
    ``tests/comera/test_api.py``)."""
    probe = torch.compiler.assume_constant_result(lambda: None)
    marks = {k: v for k, v in vars(probe).items() if not k.startswith("__")}
    assert marks, "torch no longer marks constant functions by attribute: revisit plans.py"
    assert {k: getattr(C.get_default_plan, k, None) for k in marks} == marks
    # and a compiled call reads the plan as a constant (unmarked, dynamo refuses the call)
    compiled = torch.compile(lambda x: x + len(C.get_default_plan()), fullgraph=True,
                             backend="eager")  # fmt: skip
    assert compiled(torch.zeros(1)).item() == len("comera")


def test_per_layer_plan_overrides_default():
    spec = C.TTLinearSpec(out_modes=(2, 3), in_modes=(3, 2), ranks=2, dtype=torch.float64)
    layer = C.TTLinear(spec, plan="optimal", generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 6, dtype=torch.float64)
    with C.default_plan("dense"):
        torch.testing.assert_close(layer(x), x @ layer.to_dense().T + layer.bias)


def test_a_rule_over_a_padded_layer_names_its_train():
    """A padded layer's train sits at ``NAME.inner``; the summary and config.json show
    ``NAME``, and a rule over it was refused as matching no TT layer."""
    plans = C.LayerPlans(per_layer=(("*.gate_proj", "dp"),))
    assert plans.for_layer("mlp.gate_proj.inner") == "dp"
    assert plans.for_layer("mlp.gate_proj.inner.x") is None
    plans.check_layers(["mlp.gate_proj.inner", "mlp.up_proj"])
    typo = C.LayerPlans(per_layer=(("*.gate_prj", "dp"),))
    with pytest.raises(ConfigError, match=r"matches no TT layer; layers are: mlp.gate_proj, mlp"):
        typo.check_layers(["mlp.gate_proj.inner", "mlp.up_proj"])


def test_flops_accounting_dense_and_comera():
    spec = C.TTLinearSpec(out_modes=(12, 8, 8), in_modes=(8, 8, 12), ranks=30)
    params, _ = C.init(spec)
    f = tt_linear_flops(params, 4096, "comera")
    assert f["dense_forward"] == 2 * 4096 * 768 * 768
    assert f["backward"] == 2 * f["forward"]
    # two skinny GEMMs of rank 30, run padded to 32, dominate: 2*T*(N + M)*32
    gemms = 2 * 4096 * (768 + 768) * 32
    assert gemms <= f["forward"] < 1.05 * gemms


@pytest.mark.parametrize("ranks", [32, 30, (8, 30, 8, 16, 8)])
@pytest.mark.parametrize("strategy", ["comera", "dense"])
def test_recorded_cost_is_the_executed_cost(ranks, strategy):
    """``describe()`` and ``tt_linear_flops`` count what runs: the forward's matmul FLOPs
    under ``torch.utils.flop_counter`` equal the plan's, rank padding of the ``comera``
    path included (ranks 30 and 16 are padded to 32 and 16+0; 32 is aligned)."""
    from torch.utils.flop_counter import FlopCounterMode

    spec = C.TTLinearSpec(out_modes=(12, 8, 8), in_modes=(8, 8, 12), ranks=ranks, bias=False)
    params, state = C.init(spec, generator=torch.Generator().manual_seed(0))
    x = torch.randn(256, 768)
    with FlopCounterMode(display=False) as counter:
        C.tt_linear(params, state, x, plan=strategy)
    plan = tt_linear_plan(strategy, [c.shape for c in params["cores"]], 256)
    assert (
        counter.get_total_flops()
        == plan.cost(256)[0]
        == tt_linear_flops(params, 256, strategy)["forward"]
    )
    assert f"{plan.cost(256)[0]:.3e}" in plan.describe()


@pytest.mark.parametrize("seed", range(4))
def test_grouped_halves_give_each_layers_values_and_gradients(seed, monkeypatch):
    """Layers whose halves are built together (``GroupedHalves``: three of one shape, one
    compacted to other ranks and two pruned to nothing in their group, one alone, dead
    ranks and trained gates) give what each layer
    builds alone, on every path, for ``tt_linear`` and ``tt_linear_shared_input``
    alike; a layer it does not hold builds its own."""
    gen = torch.Generator().manual_seed(seed)
    shared = C.TTLinearSpec(out_modes=(3, 4), in_modes=(2, 5), ranks=(4, 6, 3),
                            dtype=torch.float64)  # fmt: skip
    other = C.TTLinearSpec(out_modes=(2, 3), in_modes=(5, 2), ranks=(2, 3, 2),
                           dtype=torch.float64, bias=False)  # fmt: skip
    layers = []
    for spec in (shared, shared, other, shared, other):
        params, state = C.init(spec, generator=gen)
        params = _random_gates(params, gen)
        state = {"masks": [torch.rand(m.shape, generator=gen) > 0.3 for m in state["masks"]]}
        layers.append((params, state))
    for _ in range(2):  # trains pruned to nothing (every bond emptied), grouped too
        params, state = C.init(shared, generator=gen)
        state["masks"][1] = torch.zeros_like(state["masks"][1])
        layers.append(C.compact(params, state))
    # compacted to other ranks (2, 4, 3 against 4, 6, 3; its middle rank 4): grouped with
    # the shared ones, zero-padded to their ranks
    params, state = C.init(shared, generator=gen)
    params = _random_gates(params, gen)
    state["masks"][0][:2], state["masks"][1][:2] = False, False
    layers.append(C.compact(params, state))
    held = [*layers[:4], *layers[5:]]  # layers[4] is not held: it builds its own
    alone = []  # trains GroupedHalves builds on their own: only layers[2], alone in its modes
    real_halves = C.plans._halves
    monkeypatch.setattr(C.plans, "_halves", lambda c: alone.append(c) or real_halves(c))
    grouped = C.plans.GroupedHalves(held)
    assert len(alone) == 1 and grouped.get(layers[7][0])[0].shape == (12, 4)
    monkeypatch.setattr(C.plans, "_halves", real_halves)
    leaves = [t for p, _ in layers for t in (*p["cores"], *p["gates"], p.get("bias"))
              if t is not None]  # fmt: skip
    for t in leaves:
        t.requires_grad_(True)
    x = torch.randn(7, 10, generator=gen, dtype=torch.float64, requires_grad=True)

    def run(halves, plan):
        grouped_now = C.plans.GroupedHalves(held) if halves else None
        ys = [C.tt_linear(p, s, x, plan=plan, halves=grouped_now) for p, s in layers]
        ys += C.layers.tt_linear_shared_input([layers[0], layers[1], layers[3]], x,
                                              halves=grouped_now)  # fmt: skip
        gy = [torch.randn(y.shape, generator=torch.Generator().manual_seed(1),
                          dtype=y.dtype) for y in ys]  # fmt: skip
        grads = torch.autograd.grad(ys, [x, *leaves], gy)
        return ys, grads

    assert grouped.get(layers[4][0]) is None and grouped.get(layers[0][0]) is not None
    ttm = C.init(C.TTMEmbeddingSpec(vocab_modes=(4, 5), dim_modes=(2, 4), ranks=3,
                                    dtype=torch.float64), generator=gen)  # fmt: skip
    with pytest.raises(ValueError, match="layer 1: .* not a TT linear's"):
        C.plans.GroupedHalves([layers[0], ttm])
    with pytest.raises(ValueError, match="GroupedHalves layer 1: the rank state"):
        C.plans.GroupedHalves([layers[0], (layers[1][0], layers[4][1])])  # another's state
    short = {**layers[1][0], "gates": [g[:-1] for g in layers[1][0]["gates"]]}
    masks = {"masks": [m[:-1] for m in layers[1][1]["masks"]]}
    with pytest.raises(ValueError, match=r"layer 1: gate 0 has shape \(2,\) for a bond of rank 3"):
        C.plans.GroupedHalves([layers[0], (short, masks)])  # would be padded with the rest
    built = []  # the layers that gate their own cores
    real = C.layers.gated_cores
    monkeypatch.setattr(C.layers, "gated_cores", lambda p, *a: built.append(p) or real(p, *a))
    for plan in ("comera", "dense", "dp"):
        built.clear()
        ys, grads = run(True, plan)
        # held layers read their halves; dp's whole-network plan gates every layer's cores
        want = len(layers) if plan == "dp" else 1
        assert len(built) == want and (plan == "dp" or built[0] is layers[4][0]), plan
        want_ys, want_grads = run(False, plan)
        for a, b in zip([*ys, *grads], [*want_ys, *want_grads], strict=True):
            torch.testing.assert_close(a, b, msg=plan)
