"""GPU paths (CUDA, bf16 autocast, CUDA graphs). Skipped without a GPU; never gates CI.

Run on a GPU machine with ``make gpu-check``.
"""

import pytest
import torch

import comera as C

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("strategy", C.STRATEGIES)
def test_tt_linear_on_cuda_matches_cpu(strategy):
    spec = C.TTLinearSpec(out_modes=(12, 8, 8), in_modes=(8, 8, 12), ranks=30)
    params, state = C.init(spec, generator=torch.Generator().manual_seed(0))
    x = torch.randn(64, 768, generator=torch.Generator().manual_seed(1))
    ref = C.tt_linear(params, state, x, plan=strategy)
    to = lambda t: t.cuda()  # noqa: E731
    p = torch.utils._pytree.tree_map(to, params)
    s = torch.utils._pytree.tree_map(to, state)
    y = C.tt_linear(p, s, x.cuda(), plan=strategy)
    torch.testing.assert_close(y.cpu(), ref, rtol=1e-3, atol=1e-4)


@cuda
def test_ttm_embedding_on_cuda_matches_cpu():
    spec = C.TTMEmbeddingSpec(vocab_modes=(16, 20, 10, 10), dim_modes=(4, 4, 8, 6), ranks=32)
    params, state = C.init(spec, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 32000, (8, 128), generator=torch.Generator().manual_seed(1))
    ref = C.ttm_embedding(params, state, ids)
    p = torch.utils._pytree.tree_map(lambda t: t.cuda(), params)
    s = torch.utils._pytree.tree_map(lambda t: t.cuda(), state)
    for impl in C.EMBEDDING_IMPLS:
        out = C.ttm_embedding(p, s, ids.cuda(), impl=impl)
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-3, atol=1e-4)


@cuda
def test_bf16_autocast_forward_backward():
    layer = C.TTLinear(C.TTLinearSpec(out_modes=(12, 8, 8), in_modes=(8, 8, 12), ranks=30)).cuda()
    x = torch.randn(32, 128, 768, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().pow(2).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


@cuda
def test_cuda_graph_replays_tt_linear():
    layer = C.TTLinear(C.TTLinearSpec(out_modes=(12, 8, 8), in_modes=(8, 8, 12), ranks=30)).cuda()
    static_x = torch.randn(256, 768, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(3):  # warm up plans and the allocator off the capture
            layer(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_y = layer(static_x)
    new_x = torch.randn(256, 768, device="cuda")
    static_x.copy_(new_x)
    graph.replay()
    with torch.no_grad():
        torch.testing.assert_close(static_y, layer(new_x))
