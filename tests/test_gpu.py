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


@cuda
def test_table_batched_lookup_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(0)
    specs = [C.propose_ttm_embedding(n, 16, d=4, ranks=8) for n in (5000, 12000, 900)]
    params, states = zip(*[C.init(s, generator=g) for s in specs], strict=True)
    ids = torch.stack([torch.randint(0, s.num_embeddings, (512,), generator=g) for s in specs], 1)
    ref = C.ttm_embedding_batched(params, states, ids, specs=specs)
    to = lambda tree: torch.utils._pytree.tree_map(lambda t: t.cuda(), tree)  # noqa: E731
    out = C.ttm_embedding_batched(to(list(params)), to(list(states)), ids.cuda(), specs=specs)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-3, atol=1e-4)


@cuda
def test_dlrm_step_on_cuda(tmp_path):
    from comera.train import ComeraConfig, TrainConfig, Trainer
    from experiments.dlrm.bench import _batch
    from experiments.dlrm.model import DLRMConfig, init_dlrm
    from experiments.dlrm.task import DLRMTask

    model = DLRMConfig(cardinalities=(30, 5000, 20000, 7), tt_min_rows=1000, emb_rank=8)
    params, state = init_dlrm(model, generator=torch.Generator().manual_seed(0))
    cfg = TrainConfig(
        steps=10,
        run_dir=str(tmp_path),
        device="cuda",
        wandb="disabled",
        comera=ComeraConfig(early_steps=5),
        progress=False,
    )
    task = DLRMTask(model, None, None, device="cuda")  # type: ignore[arg-type]
    trainer = Trainer(cfg, task, params, state)
    metrics = trainer.train_step(_batch(model.cardinalities, 256))
    assert torch.isfinite(torch.tensor(metrics["loss"]))
