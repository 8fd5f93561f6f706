"""Training-path flags of the experiments and the encoder's recomputed blocks."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import comera as C
from experiments import cli
from experiments.mnli import experiment as mnli
from experiments.transformer import EncoderConfig, encoder_hidden, grouped_halves, init_encoder

FAST = ["--preset", "smoke", "--wandb", "disabled", "--no-progress"]
FAST += ["--set", "train.steps=3", "--set", "train.eval_every=None"]
FAST += ["--set", "data.generated_train=200", "--set", "data.generated_eval=30"]


@pytest.mark.slow
def test_cli_flags_reach_the_config_and_may_change_on_resume(tmp_path, capsys, monkeypatch):
    applied = []  # a policy cannot be undone: record it instead of changing this process
    monkeypatch.setattr(cli, "apply_cpu_malloc", applied.append)
    run = tmp_path / "run"
    argv = [*FAST, "--run-dir", str(run), "--cpu-malloc", "keep", "--recompute"]
    assert mnli.main(argv) == 0
    saved = json.loads((run / "config.json").read_text())
    assert saved["train"]["cpu_malloc"] == "keep" and saved["model"]["recompute"] is True
    # --recompute alone also selects the lean allocator (what it frees is then returned)
    args = cli.build_parser(mnli.EXPERIMENT).parse_args([*FAST, "--recompute"])
    cfg = cli.resolve_config(mnli.EXPERIMENT, args, cli.build_parser(mnli.EXPERIMENT))
    assert cfg.train.cpu_malloc == "lean" and cfg.model.recompute is True
    ap = cli.build_parser(mnli.EXPERIMENT)  # resuming with --recompute keeps the saved policy
    args = ap.parse_args(["--resume", str(run), "--recompute"])
    assert cli.resolve_config(mnli.EXPERIMENT, args, ap).train.cpu_malloc == "keep"
    assert applied and set(applied) == {"keep"}
    ap = cli.build_parser(mnli.EXPERIMENT)
    args = ap.parse_args(["--resume", str(run), "--cpu-malloc", "default"])
    cfg = cli.resolve_config(mnli.EXPERIMENT, args, ap)
    assert cfg.train.cpu_malloc == "default" and cfg.model.recompute is True
    ap = cli.build_parser(mnli.EXPERIMENT)  # how the halves are built: not what is computed
    args = ap.parse_args(["--resume", str(run), "--set", "model.grouped_halves=false"])
    assert cli.resolve_config(mnli.EXPERIMENT, args, ap).model.grouped_halves is False
    from experiments.dlrm.experiment import main as dlrm_main

    assert dlrm_main(["--preset", "smoke", "--recompute", "--run-dir", str(tmp_path / "d")]) == 2
    assert "--recompute" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("tt", [False, True])
def test_recomputed_blocks_give_the_same_values_and_gradients(tt: bool) -> None:
    """``recompute=True`` reruns each block in backward with the same dropout masks: the
    hidden states and every gradient equal the stored-activation run's; so do the fused
    Q, K, V and each TT linear building its halves alone."""
    cfg = EncoderConfig(
        vocab_size=100, max_len=16, d_model=32, heads=4, ffn=64, layers=2, dropout=0.2,
        tt=tt, rank=4, attn_modes=((8, 4), (4, 8)), ffn_in_modes=((8, 8), (4, 8)),
        ffn_out_modes=((4, 8), (8, 8)), emb_vocab_modes=(10, 10), emb_dim_modes=(4, 8),
        emb_rank=4,
    )  # fmt: skip
    params, state = init_encoder(cfg, generator=torch.Generator().manual_seed(0))
    leaves = [t.requires_grad_() for t in torch.utils._pytree.tree_leaves(params)]
    batch = {"input_ids": torch.randint(5, 100, (3, 16), generator=torch.Generator()),
             "attention_mask": torch.ones(3, 16)}  # fmt: skip

    def run(c: EncoderConfig) -> list[torch.Tensor]:
        torch.manual_seed(3)
        out = encoder_hidden(params, state, batch, c, train=True)
        grads = torch.autograd.grad(out.pow(2).sum(), leaves, allow_unused=True)
        return [out, *(g for g in grads if g is not None)]

    plain, again = run(cfg), run(dataclasses.replace(cfg, recompute=True))
    assert len(plain) == len(again) > 10
    for a, b in zip(plain, again, strict=True):
        torch.testing.assert_close(a, b)
    fused = run(dataclasses.replace(cfg, fused_qkv=True))  # Q, K, V in one GEMM (TT only)
    for a, b in zip(plain, fused, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)  # summation order only
    # each TT linear building its own halves (the default builds same-shape ones together)
    assert (grouped_halves(params, state, lambda path: None) is not None) is tt
    alone = run(dataclasses.replace(cfg, grouped_halves=False))
    for a, b in zip(plain, alone, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)  # summation order only
    if not tt:
        return
    # compacted so that no two block linears share their core shapes (as after a late
    # stage's compaction): still grouped by their modes, with the same values
    for i, (p, s) in enumerate(zip(params["layers"], state["layers"], strict=True)):
        for j, n in enumerate(("q", "k", "v", "o", "ffn_in", "ffn_out")):
            idx = 6 * i + j
            masks = [m.clone() for m in s[n]["masks"]]
            masks[0][: idx % 3 + 1] = False
            masks[1][: idx // 3 % 4] = False
            p[n], s[n] = C.compact(p[n], {"masks": masks})
    shapes = [tuple(c.shape for c in p[n]["cores"]) for p in params["layers"]
              for n in ("q", "k", "v", "o", "ffn_in", "ffn_out")]  # fmt: skip
    assert len(set(shapes)) == len(shapes)
    assert grouped_halves(params, state, lambda path: None) is not None
    torch.manual_seed(3)
    grouped = encoder_hidden(params, state, batch, cfg, train=True)
    torch.manual_seed(3)
    apart = encoder_hidden(params, state, batch, dataclasses.replace(cfg, grouped_halves=False),
                           train=True)  # fmt: skip
    torch.testing.assert_close(grouped, apart, rtol=1e-3, atol=1e-4)


def test_plan_auto_from_the_cli_caches_on_disk_and_records_its_choices(tmp_path, monkeypatch):
    """``--plan auto --embedding-impl auto``: the run records what it chose
    (``config.json``, ``plans.json``), the decisions land in ``$COMERA_CACHE/plans``, and
    a second run in a fresh process state times nothing."""
    from comera import autotune

    monkeypatch.setenv("COMERA_CACHE", str(tmp_path / "cache"))
    timed = []
    real = autotune.PlanTuner._decide

    def counting(self, *args, **kw):
        timed.append(args[1])
        return real(self, *args, **kw)

    monkeypatch.setattr(autotune.PlanTuner, "_decide", counting)
    try:
        for run in ("first", "second"):
            autotune.set_tuner(None)  # what a new process starts with
            argv = [*FAST, "--run-dir", str(tmp_path / run), "--plan", "auto",
                    "--plan-for", "pooler=comera", "--embedding-impl", "auto"]  # fmt: skip
            assert mnli.main(argv) == 0
            if run == "first":
                first = list(timed)
                assert first, "the first run timed its layers"
        assert timed == first  # the second run read every decision from the disk cache
    finally:
        autotune.set_tuner(None)
    cached = json.loads((tmp_path / "cache" / "plans" / autotune.CACHE_FILE).read_text())
    assert set(first) <= set(cached)
    for run in ("first", "second"):
        config = json.loads((tmp_path / run / "config.json").read_text())
        history = json.loads((tmp_path / run / "plans.json").read_text())
        decided = {d["what"]: d["choice"] for h in history.values() for d in h.values()}
        assert config["auto_plans"] == decided and config["auto_plans"]
        assert {d["kind"] for h in history.values() for d in h.values()} == {
            "tt_linear", "ttm_embedding"}  # fmt: skip
    # the decisions sit beside the run's plan settings, so a resume keeps them: when they
    # overwrote config.json's ``plans``, a resume ran LayerPlans() (no auto, no rules)
    ap = cli.build_parser(mnli.EXPERIMENT)
    args = ap.parse_args(["--resume", str(tmp_path / "first")])
    assert cli.resolve_config(mnli.EXPERIMENT, args, ap).plans == C.LayerPlans(
        default="auto", per_layer=(("pooler", "comera"),), embedding_impl="auto"
    )
