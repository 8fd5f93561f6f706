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
    from benchmarks.dlrm_step import _batch
    from comera.train import ComeraConfig, TrainConfig, Trainer
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


@cuda
def test_static_embedding_lookup_never_syncs():
    """``impl="static"`` forward and backward under CUDA's sync debug mode set to error:
    any host sync (``.item()``, ``torch.unique``, a boolean check) raises."""
    spec = C.TTMEmbeddingSpec(vocab_modes=(16, 20, 10, 10), dim_modes=(4, 4, 8, 6), ranks=32)
    params, state = C.init(spec, generator=torch.Generator().manual_seed(0))
    p = torch.utils._pytree.tree_map(
        lambda t: t.cuda().requires_grad_(t.is_floating_point()), params
    )
    s = torch.utils._pytree.tree_map(lambda t: t.cuda(), state)
    ids = torch.randint(0, 32000, (8, 128), device="cuda")
    ref = C.ttm_embedding(p, s, ids)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = C.ttm_embedding(p, s, ids, impl="static")
        grads = torch.autograd.grad(out.square().sum(), p["cores"])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out, ref)
    assert all(torch.isfinite(g).all() for g in grads)


def _graph_trainer(tmp_path, mode, steps):
    """The trainer tests' toy task on CUDA, through prunes, compaction and the late stage."""
    from comera.train import Trainer
    from tests.train.test_sync_free import STAGES, _PureToy
    from tests.train_helpers import _cfg, _toy_model

    cfg = _cfg(tmp_path / mode, steps=steps, step_mode=mode, comera=STAGES, device="cuda")
    return Trainer(cfg, _PureToy(), *_toy_model())


@cuda
def test_cuda_graph_step_captures_forward_backward_and_update(tmp_path):
    """The whole step (forward, backward, stage objective, clipping, AdamW) is captured and
    replayed; it trains like the uncaptured sync-free step through a prune, the
    transition's compaction (graphs rebuilt) and the late stage."""
    runs = {}
    for mode in ("sync_free", "cuda_graph"):
        tr = _graph_trainer(tmp_path, mode, 60)
        it = iter(tr.task.train_iter)
        rows, captured = [], 0
        while tr.step < 60:
            rows.append(tr.train_step(next(it)))
            if mode == "cuda_graph":
                captured = max(captured, len(tr.sync_free._graphs))
            tr._after_step()
        runs[mode] = (tr, rows, captured)
    (a, rows_a, _), (b, rows_b, captured) = runs["sync_free"], runs["cuda_graph"]
    assert captured >= 1
    assert a.ranks() == b.ranks() and a.stage == b.stage == "late"
    for x, y in zip(rows_a, rows_b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4)
    flat = torch.utils._pytree.tree_flatten
    for x, y in zip(flat(a.params)[0], flat(b.params)[0], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


@cuda
def test_cuda_graph_step_of_the_mnli_encoder(tmp_path):
    """The MNLI encoder (TT linears, TTM word embedding with dropout) trains under
    ``cuda_graph``: the optimized lookup turns static inside the capture."""
    import dataclasses

    from experiments.mnli import experiment as mnli

    p = mnli.preset("smoke", run_dir=str(tmp_path))
    p.data = dataclasses.replace(p.data, generated_train=2000, generated_eval=100)
    p.model = dataclasses.replace(
        p.model, dropout=0.1, emb_vocab_modes=(), emb_dim_modes=(8, 8), emb_rank=16
    )
    p.train = dataclasses.replace(
        p.train, steps=12, device="cuda", step_mode="cuda_graph", wandb="disabled",
        progress=False, eval_every=None, checkpoint_every=None,
    )  # fmt: skip
    task, params, state, _ = mnli.build(p)
    from comera.train import Trainer

    tr = Trainer(p.train, task, params, state)
    it = iter(task.train_iter)
    losses = [tr.train_step(next(it))["loss"] for _ in range(12)]
    assert tr.sync_free._graphs, "no graph was captured"
    assert all(torch.isfinite(torch.tensor(losses)))


@cuda
def test_dlrm_lookup_timing_runs_on_cuda():
    """``python -m benchmarks.dlrm_step --embedding --device cuda`` (``make gpu-check``):
    the table-batched vs separate lookup comparison at the Kaggle sizes, on the GPU."""
    from benchmarks.dlrm_step import embedding_times

    out = embedding_times(repeats=1, device="cuda")
    assert out["device"].startswith("cuda") and out["embedding_batched_s"] > 0
    assert out["embedding_time_ratio_batched_vs_separate"] > 0


@cuda
def test_core_bench_runs_on_cuda():
    """``python -m benchmarks.core --device cuda`` (``make gpu-check``): every section on the
    GPU, memory from the CUDA allocator, the report saying which device it measured."""
    from benchmarks import core as bench

    result = bench.run(quick=True, device="cuda")
    assert result["config"]["device"].startswith("cuda")
    assert result["fused_qkv"]["time_ratio_vs_dense"] > 0
    assert result["ttm_embedding"]["optimized_peak_bytes"] > 0
    assert "Device `cuda" in bench.render(result)
