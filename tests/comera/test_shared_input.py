"""Q, K and V through one shared-input TT GEMM."""

from __future__ import annotations

import pytest
import torch

import comera as C
from comera.layers import tt_linear_shared_input


@pytest.mark.parametrize(
    ("ranks", "biases"),
    [
        ((30, 30, 30), (True, False, True)),
        ((32, 8, 5), (True, False, True)),
        ((16, 0, 30), (True, True, True)),  # an aligned rank with a bias, an empty train
        ((30, 5), (False, False)),  # no bias anywhere: no slot to fill
        ((8,), (True,)),  # one layer, aligned, with a bias
    ],
)
def test_shared_input_tt_linears_equal_separate_calls(
    ranks: tuple[int, ...], biases: tuple[bool, ...]
) -> None:
    """Q, K, V through one wider GEMM (``tt_linear_shared_input``) give the values and
    gradients of three ``tt_linear`` calls and of the rebuilt dense weights: padded ranks,
    aligned ranks (no free bias slot), an empty train (every rank of its middle bond
    pruned and compacted away), layers of different ranks, with and without biases."""
    gen = torch.Generator().manual_seed(0)
    layers = []
    for r, has_bias in zip(ranks, biases, strict=True):
        spec = C.TTLinearSpec(out_modes=(4, 4, 4), in_modes=(4, 4, 4), ranks=max(r, 1))
        p, s = C.init(spec, generator=gen)
        if r == 0:  # kill the middle bond and compact: the layer is the zero map (+ bias)
            s = {"masks": [m if k != 2 else torch.zeros_like(m) for k, m in enumerate(s["masks"])]}
            p, s = C.compact(p, s)
            assert p["cores"][3].shape[0] == 0
        if has_bias:
            p["bias"] = torch.randn(64, generator=gen)
        else:
            p.pop("bias", None)
        layers.append((p, s))
    leaves = [t.requires_grad_() for p, _ in layers for t in torch.utils._pytree.tree_leaves(p)]
    x = torch.randn(5, 7, 64, generator=gen, requires_grad=True)
    w = [torch.randn(5, 7, 64, generator=gen) for _ in layers]

    def grads(outs: list[torch.Tensor]) -> list[torch.Tensor]:
        loss = sum((o * g).sum() for o, g in zip(outs, w, strict=True))
        return [*outs, *torch.autograd.grad(loss, [x, *leaves], allow_unused=True)]

    def dense(p: dict, s: dict) -> torch.Tensor:
        y = x @ C.to_dense(p, s).T
        return y + p["bias"] if "bias" in p else y

    fused = grads(tt_linear_shared_input(layers, x))
    separate = grads([C.tt_linear(p, s, x, plan="comera") for p, s in layers])
    reference = grads([dense(p, s) for p, s in layers])
    for a, b, c in zip(fused, separate, reference, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        if c is not None:  # None: a leaf the dense rebuild does not reach (an empty train)
            torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="expects a last dim of 64"):
        tt_linear_shared_input(layers, torch.randn(3, 32))
