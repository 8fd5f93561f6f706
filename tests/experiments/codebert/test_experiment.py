"""``python -m experiments.codebert`` end to end on a small slice of the stdlib corpus."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from experiments.codebert.experiment import main
from loaders import TokenLoader


def _argv(tmp_path: Path, run: str, *extra: str) -> list[str]:
    sets = ["train.steps=12", "train.eval_every=6", "train.checkpoint_every=6",
            "data.max_files=12", "data.vocab=400", "data.eval_batches=2", "batch_size=4",
            "train.comera.reg_start_step=2", "train.comera.early_steps=8",
            "train.comera.prune_every=2", "train.warmup_steps=0",
            f"data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    argv = ["--preset", "smoke", "--run-dir", str(tmp_path / run), "--no-progress"]
    argv += ["--wandb", "disabled", *extra]
    for kv in sets:
        argv += ["--set", kv]
    return argv


def test_smoke_cli_runs_on_the_stdlib(tmp_path: Path) -> None:
    assert main(_argv(tmp_path, "run", "--mix", "modules=0.5,packages=0.3,tests=0.2")) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/heldout/loss" in r]
    assert [r["step"] for r in evals] == [6, 12]
    assert all(0 < r["eval/heldout/loss"] < 7 for r in evals)  # below ln(400) ~ 6.0 + slack
    for r in evals:
        assert r["eval/heldout/perplexity"] == pytest.approx(math.exp(r["eval/heldout/loss"]))
    steps = [r for r in rows if "loss" in r]
    assert all(r["tokens"] == 4 * 128 and r["tokens_per_s"] > 0 for r in steps)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data"]["mix"] == {"modules": 0.5, "packages": 0.3, "tests": 0.2}
    assert any(r.get("stage") == "late" for r in rows)


def test_unknown_mix_name_is_one_line(tmp_path: Path, capsys) -> None:
    assert main(_argv(tmp_path, "bad", "--mix", "nope=1")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--mix names ['nope']" in err[0]


def strip_weights(state: dict) -> dict:
    """A loader state without its weights and the mixer's token tally (restarted under
    new weights): the positions, which must survive a --mix change."""
    drop = ("weights", "config_weights", "mix_tokens")
    out = {k: v for k, v in state.items() if k not in drop}
    if "readers" in out:
        out["readers"] = [strip_weights(r) for r in out["readers"]]
    return out


def test_mix_may_change_on_resume_and_nothing_else(tmp_path: Path, capsys) -> None:
    import shutil

    from experiments import cli
    from experiments.codebert.experiment import EXPERIMENT

    run = tmp_path / "run"
    assert main(_argv(tmp_path, "run", "--mix", "modules=1,packages=1,tests=1")) == 0
    shutil.rmtree(run / "checkpoints" / "step_00000012")  # as if killed after step 6
    ap = cli.build_parser(EXPERIMENT)
    args = ap.parse_args(["--resume", str(run), "--mix", "modules=0.7,tests=0.3",
                          "--no-progress"])  # fmt: skip
    cfg = cli.resolve_config(EXPERIMENT, args, ap)
    assert cfg.data.mix == {"modules": 0.7, "tests": 0.3}
    prepared = cli.prepare(EXPERIMENT, cfg, resume=True)
    assert prepared.trainer.step == 6
    loader = prepared.trainer.task.train_iter
    state = loader.state_dict()
    assert state["weights"] == {"modules": 0.7, "packages": 1.0, "tests": 0.3}  # missing: same
    saved = json.loads((run / "checkpoints" / "step_00000006" / "data_rank00000.json").read_text())
    assert strip_weights(state) == strip_weights(saved["state"])  # every position kept
    # the new weights hold over the next million tokens (traced to their sub-dataset)
    audit = TokenLoader(dataclasses.replace(loader.config, provenance=True, batch_size=64))
    audit.load_state_dict(state)
    per_source, total = torch.zeros(3, dtype=torch.long), 0
    while total < 1_000_000:
        doc = next(audit)["doc_ids"]
        source = doc[doc >= 0] >> 32
        per_source += torch.bincount(source, minlength=3)
        total += len(source)
    names = [d.name for d in loader.config.datasets]
    shares = dict(zip(names, (per_source / total).tolist(), strict=True))
    for name, want in {"modules": 0.35, "packages": 0.5, "tests": 0.15}.items():
        assert abs(shares[name] - want) < 0.01, (shares, name)
    cli.train(prepared)
    code = main(["--resume", str(run), "--corpus", f"x={tmp_path}", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "drop --corpus" in err[-1]


def test_a_prepared_folder_is_a_corpus_and_its_tokenizer_serves(tmp_path: Path, capsys) -> None:
    """``--corpus NAME=FOLDER`` takes a folder ``loaders.prepare --heldout`` made as it is
    (its tokenizer, its split); one made without a held-out split is refused in one line."""
    import sysconfig

    from loaders.prepare import prepare

    lib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(p) for p in sorted((lib / "json").glob("*.py"))]
    prepare(files, tmp_path / "json", train_vocab=400, heldout=0.3, progress=False)
    argv = _argv(tmp_path, "run", "--corpus", f"js={tmp_path / 'json'}", "--set", "data.vocab=900")
    assert main(argv) == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data"]["paths"] == {"js": str(tmp_path / "json")}
    assert config["vocab"] == 400  # the prepared folder's own tokenizer, not data.vocab
    prepare(files, tmp_path / "nosplit", train_vocab=400, progress=False)
    capsys.readouterr()
    assert main(_argv(tmp_path, "bad", "--corpus", f"x={tmp_path / 'nosplit'}")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prepared without --heldout" in err[0]
    (tmp_path / "json" / "train" / "doc_counts.json").unlink()  # as if prepare had crashed
    assert main(_argv(tmp_path, "bad2", "--corpus", f"js={tmp_path / 'json'}")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train split is incomplete" in err[0]


def test_hub_source_needs_a_tokenizer(tmp_path: Path, capsys) -> None:
    assert main(_argv(tmp_path, "hub", "--set", "data.source=hub")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.tokenizer" in err[0]


def test_paper_preset_is_codebert_with_tt_layers() -> None:
    """The ``paper`` preset's encoder is CodeBERT's published shape; at initial ranks its
    TT/TTM model is a fraction of the dense one (counted without building the latter)."""
    import comera as C
    from experiments.codebert.experiment import preset
    from experiments.codebert.model import init_mlm
    from experiments.transformer import dense_param_count

    p = preset("paper")
    m = p.model
    assert (m.layers, m.d_model, m.heads, m.ffn, m.vocab_size, m.max_len, m.type_vocab) == (
        12, 768, 12, 3072, 50265, 514, 1,
    )  # fmt: skip
    assert p.data.source == "hub" and p.data.tokenizer == "microsoft/codebert-base"
    assert p.data.hub_configs == ("python", "java", "javascript", "php", "ruby", "go")
    params, _ = init_mlm(m, generator=torch.Generator().manual_seed(0))
    dense = dense_param_count(dataclasses.replace(m, num_labels=0)) + 2 * m.d_model + m.vocab_size
    assert 124_000_000 < dense < 126_000_000  # CodeBERT: 125M
    assert C.param_count(params) < dense / 4


def test_bench_plumbing_on_a_toy_model(tmp_path: Path) -> None:
    from benchmarks import codebert_step as bench

    assert bench.main(steps=1, tiny=True, out=tmp_path / "b.json") == 0
    figures = json.loads((tmp_path / "b.json").read_text())
    for key in ("step_time_ratio_vs_dense", "peak_memory_ratio_vs_dense",
                "step_time_ratio_vs_dense_half_ranks",
                "peak_memory_ratio_vs_dense_mmap_threshold_1m"):  # fmt: skip
        assert figures[key] > 0, key
    assert len(figures["runs"]) == 7 + 2 * (bench.MEMORY_REPEATS - 1)
    peaks = figures["peak_memory_b1_mb_runs"]
    assert len(peaks["comera"]) == len(peaks["dense"]) == bench.MEMORY_REPEATS
    median = sorted(peaks["comera"])[1] / sorted(peaks["dense"])[1]  # three runs each
    assert figures["peak_memory_ratio_vs_dense"] == pytest.approx(median)
    batch = bench.packed_batch(3, 100, seq=512)
    assert batch["input_ids"].shape == (3, 512) and (batch["segment_ids"] > 0).all()
    assert batch["input_ids"].min() >= 5  # no special token among the inputs


def test_hub_source_prepares_one_sub_dataset_per_config(tmp_path: Path, monkeypatch) -> None:
    """``data.source=hub`` (the paper preset's CodeSearchNet) prepares one sub-dataset per
    hub config with the given tokenizer; the hub is replaced by in-memory datasets here."""
    import datasets

    from loaders import prepare as prep

    texts = {lang: [f"def f{i}(x):\n    return x * {i}  # {lang}\n" * (1 + i % 4)
                    for i in range(30)] for lang in ("python", "go")}  # fmt: skip
    calls = []

    def fake_hub(name: str, config: str, split: str, column: str) -> datasets.Dataset:
        calls.append((name, config, split, column))
        return datasets.Dataset.from_dict({column: texts[config]})

    monkeypatch.setattr(prep, "_load_hub", fake_hub)
    tok = prep.train_tokenizer(iter(texts["python"] + texts["go"]), 300, tmp_path / "tok.json")
    argv = _argv(tmp_path, "run", "--set", f"data.tokenizer={tok}", "--set", "data.source=hub",
                 "--set", "data.hub_configs=python,go", "--mix", "python=0.7,go=0.3")  # fmt: skip
    assert main(argv) == 0
    assert {c[1] for c in calls} == {"python", "go"}
    assert all(c[0] == "code_search_net" and c[3] == "func_code_string" for c in calls)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/heldout/loss" in r for r in rows)


def test_masked_lm_refuses_compiled_and_graphed_steps(tmp_path: Path, capsys) -> None:
    for mode in ("compile", "cuda_graph"):
        assert main(_argv(tmp_path, mode, "--step-mode", mode)) == 2
        assert "cannot run the masked LM" in capsys.readouterr().err.strip().splitlines()[-1]
