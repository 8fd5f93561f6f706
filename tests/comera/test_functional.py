"""The layers work under torch.func transforms and through the nn.Module adapters."""

import torch
from torch.func import functional_call, grad, vmap

import comera as C

SPEC = C.TTLinearSpec(out_modes=(2, 3), in_modes=(3, 2), ranks=3, dtype=torch.float64)
EMB = C.TTMEmbeddingSpec(vocab_modes=(4, 5), dim_modes=(2, 3), ranks=3, dtype=torch.float64)


def test_functional_call_on_module_uses_given_params():
    layer = C.TTLinear(SPEC, generator=torch.Generator().manual_seed(0))
    other, other_state = C.init(SPEC, generator=torch.Generator().manual_seed(1))
    named = {f"cores.{k}": c for k, c in enumerate(other["cores"])}
    named |= {f"gates.{k}": g for k, g in enumerate(other["gates"])}
    named["bias"] = other["bias"]
    x = torch.randn(4, 6, dtype=torch.float64)
    y = functional_call(layer, named, (x,))
    torch.testing.assert_close(y, C.tt_linear(other, other_state, x))
    assert set(dict(layer.named_parameters())) == set(named)
    assert set(dict(layer.named_buffers())) == {"masks.0", "masks.1", "masks.2"}


def test_grad_matches_autograd_for_every_strategy():
    params, state = C.init(SPEC, generator=torch.Generator().manual_seed(2))
    x = torch.randn(5, 6, dtype=torch.float64)

    for strategy in C.STRATEGIES:

        def loss(p, strategy=strategy):
            return C.tt_linear(p, state, x, plan=strategy).pow(2).sum()

        g = grad(loss)(params)
        leaves = {
            k: (
                [t.clone().requires_grad_() for t in v]
                if isinstance(v, list)
                else v.clone().requires_grad_()
            )
            for k, v in params.items()
        }
        loss(leaves).backward()
        for a, b in zip(g["cores"] + g["gates"], leaves["cores"] + leaves["gates"], strict=True):
            torch.testing.assert_close(a, b.grad)


def test_vmap_over_inputs_and_over_params():
    params, state = C.init(SPEC, generator=torch.Generator().manual_seed(3))
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    for strategy in C.STRATEGIES:
        y = vmap(lambda xi, s=strategy: C.tt_linear(params, state, xi, plan=s))(x)
        torch.testing.assert_close(y, C.tt_linear(params, state, x))
    # an ensemble: stack two param sets and vmap over them
    p2, _ = C.init(SPEC, generator=torch.Generator().manual_seed(4))
    stacked = {
        "cores": [torch.stack([a, b]) for a, b in zip(params["cores"], p2["cores"], strict=True)],
        "gates": [torch.stack([a, b]) for a, b in zip(params["gates"], p2["gates"], strict=True)],
        "bias": torch.stack([params["bias"], p2["bias"]]),
    }
    ys = vmap(lambda p: C.tt_linear(p, state, x[0]))(stacked)
    torch.testing.assert_close(ys[1], C.tt_linear(p2, state, x[0]))


def test_vmap_embedding_over_ids_and_params():
    params, state = C.init(EMB, generator=torch.Generator().manual_seed(5))
    ids = torch.randint(0, 20, (3, 7))
    table = C.to_dense(params, state)
    for impl in C.EMBEDDING_IMPLS:
        out = vmap(lambda i, impl=impl: C.ttm_embedding(params, state, i, impl=impl))(ids)
        torch.testing.assert_close(out, table[ids])
        stacked = {k: [torch.stack([t, 2 * t]) for t in v] for k, v in params.items()}
        outs = vmap(lambda p, impl=impl: C.ttm_embedding(p, state, ids[0], impl=impl))(stacked)
        torch.testing.assert_close(outs[0], table[ids[0]])


def test_module_trains_with_an_optimizer():
    torch.manual_seed(0)
    spec = C.TTLinearSpec(out_modes=(2, 2), in_modes=(2, 2), ranks=4)
    layer = C.TTLinear(spec, generator=torch.Generator().manual_seed(6))
    target = torch.nn.Linear(4, 4)
    x = torch.randn(64, 4)
    opt = torch.optim.Adam(layer.parameters(), lr=0.05)
    first = None
    for _ in range(60):
        loss = (layer(x) - target(x).detach()).pow(2).mean()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1 * first
