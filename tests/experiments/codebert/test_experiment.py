"""``python -m experiments.codebert`` end to end on a small slice of the stdlib corpus."""

from __future__ import annotations

import dataclasses
import json
import math
import re
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
    if "--corpus" in extra:
        sets.remove("data.max_files=12")  # it picks stdlib files: said, with --corpus
    argv = ["--preset", "smoke", "--run-dir", str(tmp_path / run), "--no-progress"]
    argv += ["--wandb", "disabled", *extra]
    for kv in sets:
        argv += ["--set", kv]
    return argv


MIX = {"modules": 0.5, "packages": 0.3, "tests": 0.2}
STEPS, BATCH = 100, 32
MARGIN = 0.1  # nats: CoMERA's held-out loss at least this far below the unigram baseline
DENSE_TOLERANCE = 0.05  # and at most 5% above the dense run's


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CoMERA and dense (``RUNS/codebert-smoke``, ``-smoke-dense``: the report's names),
    100 steps of 32 x 128 tokens on 12 stdlib files per sub-dataset under ``MIX``, the late
    stage from step 75 holding the early stage's size (``size_ratio=1``: 25 steps of a
    barely trained model cannot recover from a cut; what a cut costs is the compression
    ablation's to measure). A step of this tiny model costs about the same at batch 8 and 32,
    and the tokens are what the held-out loss needs to fall below the unigram baseline
    (200 steps at batch 8 took longer and ended closer to it). One torch thread: the numbers do not
    depend on the machine's core count, and a loaded machine is not oversubscribed."""
    root = tmp_path_factory.mktemp("codebert")
    sets = [f"train.steps={STEPS}", "train.eval_every=50", "train.checkpoint_every=50",
            "data.max_files=12", "data.vocab=400", "data.eval_batches=2", f"batch_size={BATCH}",
            "train.comera.reg_start_step=25", "train.comera.early_steps=75",
            "train.comera.prune_every=10", "train.warmup_steps=0",
            "train.optim.lr_rest=3e-3", "train.optim.lr_cores=1e-2",
            "train.comera.size_ratio=1", f"data.cache_dir={root / 'cache'}"]  # fmt: skip
    mix = ",".join(f"{k}={v}" for k, v in MIX.items())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for run, extra in (("codebert-smoke", []), ("codebert-smoke-dense", ["--dense"])):
            argv = ["--preset", "smoke", "--run-dir", str(root / "runs" / run), "--no-progress"]
            argv += ["--wandb", "disabled", "--mix", mix, *extra]
            for kv in sets:
                argv += ["--set", kv]
            assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    return root / "runs"


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_smoke_cli_learns_beyond_the_unigram_baseline(smoke_runs: Path) -> None:
    """CoMERA ends ``MARGIN`` below the unigram baseline of the same held-out masked tokens
    (the loss of a model that ignores its context, computed from the corpus) and no more
    than ``DENSE_TOLERANCE`` above the dense run's held-out loss at equal tokens."""
    from experiments import cli
    from experiments.codebert.experiment import EXPERIMENT, build
    from experiments.codebert.report import unigram_baseline

    final = {}
    for run in ("codebert-smoke", "codebert-smoke-dense"):
        rows = _rows(smoke_runs / run)
        evals = [r for r in rows if "eval/heldout/loss" in r]
        assert [r["step"] for r in evals] == [50, 100]
        for r in evals:
            assert r["eval/heldout/perplexity"] == pytest.approx(math.exp(r["eval/heldout/loss"]))
        steps = [r for r in rows if "loss" in r]
        assert all(r["tokens"] == BATCH * 128 and r["tokens_per_s"] > 0 for r in steps)
        config = json.loads((smoke_runs / run / "config.json").read_text())
        assert config["data"]["mix"] == MIX
        final[run] = evals[-1]["eval/heldout/loss"]
    assert any(r.get("stage") == "late" for r in _rows(smoke_runs / "codebert-smoke"))
    ap = cli.build_parser(EXPERIMENT)  # the run's own held-out batches and training files
    args = ap.parse_args(["--resume", str(smoke_runs / "codebert-smoke")])
    task = build(cli.resolve_config(EXPERIMENT, args, ap))[0]
    folders = [d.path for d in task.train_iter.config.datasets]
    vocab = task.model.vocab_size
    unigram = unigram_baseline(folders, task.eval_batches, vocab)
    assert unigram < math.log(vocab) - 0.5  # the frequencies alone already beat uniform
    comera, dense = final["codebert-smoke"], final["codebert-smoke-dense"]
    assert comera < unigram - MARGIN, (comera, unigram)
    assert comera <= dense * (1 + DENSE_TOLERANCE), (comera, dense)


@pytest.mark.slow
def test_report_is_rendered_from_its_json(smoke_runs: Path, tmp_path: Path, monkeypatch) -> None:
    """The report gathers the two runs, the mix audit and the bench into ``codebert.json``
    and renders the markdown and plot from that JSON alone."""
    from experiments.codebert import report
    from experiments.report import REPORTS

    monkeypatch.setattr(report, "AUDIT_TOKENS", 20_000)
    bench = json.loads((REPORTS / "codebert_bench.json").read_text())
    out = tmp_path / "rep"
    out.mkdir()
    command = "python -m experiments.codebert.report"
    text = report.write_report(smoke_runs, out, bench, command=command)
    data = json.loads((out / "codebert.json").read_text())
    assert data["meta"]["command"] == command
    assert data["meta"]["torch"] == torch.__version__ and data["meta"]["cpu"]
    assert data["bench"] == bench and data["setup"]["sub_datasets"] == list(MIX)
    assert data["setup"]["steps"] == STEPS and data["setup"]["vocab"] == 400
    for name, run in (("CoMERA", "codebert-smoke"), ("dense", "codebert-smoke-dense")):
        evals = [r for r in _rows(smoke_runs / run) if "eval/heldout/loss" in r]
        assert data["runs"][name]["final"]["loss"] == evals[-1]["eval/heldout/loss"]
        assert data["runs"][name]["curves"]["heldout_loss"] == [
            [r["step"], r["eval/heldout/loss"]] for r in evals
        ]
    assert data["runs"]["dense"]["compression"] == 1.0 < data["runs"]["CoMERA"]["compression"]
    assert data["unigram_baseline"] > data["runs"]["CoMERA"]["final"]["loss"]
    audit = data["mix_audit"]
    assert audit["weights"] == dict(zip(MIX, report.AUDIT_MIX, strict=True))
    assert audit["tokens"] >= 20_000
    assert sum(audit["shares"].values()) == pytest.approx(1.0)
    assert audit["largest_gap"] == max(abs(audit["shares"][n] - audit["targets"][n]) for n in MIX)
    assert data["ranks"]["end"]["step"] == STEPS and data["layers"]
    assert (out / "codebert_curves.png").stat().st_size > 1000
    again = tmp_path / "again"  # re-rendered from the JSON alone: the same report
    assert report.main(["--from-json", str(out / "codebert.json"), "--out", str(again)]) == 0
    assert (again / "codebert.md").read_text() == text
    assert "the Python standard library" in text and "`--corpus` folders" not in text
    # runs on --corpus folders were described as the stdlib corpus "by file kind"
    data["setup"]["paths"] = {"app": "/src/app", "lib": "/src/lib"}
    report.write_report_json(tmp_path / "corpus.json", data)
    assert report.main(["--from-json", str(tmp_path / "corpus.json"), "--out", str(again)]) == 0
    text = (again / "codebert.md").read_text()
    assert "(CPU, `--corpus` folders)" in text and "app: `/src/app`, lib: `/src/lib`" in text
    assert "standard library" not in text
    # a run shorter than its early stage was described as going on into the late stage
    for steps, said in ((400, "early stage only (2000 steps; the gate regularizer would start "
                               "at step 1000)"),
                        (1500, "early stage only (2000 steps, gate regularizer from step 1000)"),
                        (3000, "early stage 2000 steps (gate regularizer from step 1000), then "
                               "the late stage")):  # fmt: skip
        data["setup"] |= {"steps": steps, "early_steps": 2000, "reg_start_step": 1000}
        report.write_report_json(tmp_path / "short.json", data)
        assert report.main(["--from-json", str(tmp_path / "short.json"), "--out", str(again)]) == 0
        assert said + ". " in (again / "codebert.md").read_text()


def test_the_mix_audit_weighs_every_sub_dataset() -> None:
    """With other than three sub-datasets, the fourth was left out of the audit's weights:
    it kept its old weight while its target was 0, a 50-point gap that was no mixer's."""
    from experiments.codebert.report import AUDIT_MIX, audit_weights

    first = dict(zip("abc", AUDIT_MIX, strict=True))
    assert audit_weights(["a", "b", "c", "d"]) == {**first, "d": 0.0}
    assert audit_weights(["a", "b"]) == {"a": AUDIT_MIX[0], "b": AUDIT_MIX[1]}


def test_unknown_mix_name_is_one_line(tmp_path: Path, capsys) -> None:
    assert main(_argv(tmp_path, "bad", "--mix", "nope=1")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--mix names ['nope']" in err[0]


def test_mix_names_are_checked_before_the_corpus_is_prepared(tmp_path: Path, monkeypatch,
                                                             capsys) -> None:  # fmt: skip
    """With --corpus the sub-datasets are its names: a --mix that misnames one was refused
    only after the corpus was prepared (minutes, for a real one)."""
    from experiments.codebert import experiment

    def prepared(*a, **kw):
        raise AssertionError("the corpus was prepared before --mix was checked")

    monkeypatch.setattr(experiment, "corpus_from_paths", prepared)
    src = tmp_path / "src"
    src.mkdir()
    base = ["--preset", "smoke", "--run-dir", str(tmp_path / "run"), "--wandb", "disabled"]
    base += ["--set", f"data.cache_dir={tmp_path / 'cache'}", "--corpus", f"app={src}"]
    for mix, said in (("lib=1", "--mix names ['lib']; the corpus has ['app', 'tests']"),
                      ("app=1,lib=1", "--mix names ['lib']")):  # fmt: skip
        assert main([*base, "--corpus", f"tests={src}", "--mix", mix]) == 2
        assert said in capsys.readouterr().err
    assert main([*base, "--corpus", f"lib={src}", "--mix", "app=1"]) == 2
    assert "--mix gives no weight to ['lib']" in capsys.readouterr().err


def strip_weights(state: dict) -> dict:
    """A loader state without its weights and the mixer's token tally (restarted under
    new weights): the positions, which must survive a --mix change."""
    drop = ("weights", "config_weights", "mix_tokens")
    out = {k: v for k, v in state.items() if k not in drop}
    if "readers" in out:
        out["readers"] = [strip_weights(r) for r in out["readers"]]
    return out


@pytest.mark.slow
def test_mix_may_change_on_resume_and_nothing_else(tmp_path: Path, capsys) -> None:
    import shutil

    from comera.errors import ConfigError
    from experiments import cli
    from experiments.codebert.experiment import EXPERIMENT

    run = tmp_path / "run"
    assert main(_argv(tmp_path, "run", "--mix", "modules=1,packages=1,tests=1")) == 0
    shutil.rmtree(run / "checkpoints" / "step_00000012")  # as if killed after step 6
    ap = cli.build_parser(EXPERIMENT)

    def resolved(mix: str):
        args = ap.parse_args(["--resume", str(run), "--mix", mix, "--no-progress"])
        return cli.resolve_config(EXPERIMENT, args, ap)

    # a sub-dataset left out of --mix weighed 1.0, whatever the run gave it
    with pytest.raises(ConfigError, match=r"--mix gives no weight to \['packages'\]"):
        cli.prepare(EXPERIMENT, resolved("modules=0.7,tests=0.3"), resume=True)
    cfg = resolved("modules=0.7,packages=1,tests=0.3")
    assert cfg.data.mix == {"modules": 0.7, "packages": 1.0, "tests": 0.3}
    prepared = cli.prepare(EXPERIMENT, cfg, resume=True)
    assert prepared.trainer.step == 6
    loader = prepared.trainer.task.train_iter
    state = loader.state_dict()
    assert state["weights"] == {"modules": 0.7, "packages": 1.0, "tests": 0.3}
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
    # that resume's --mix stays in force at the next plain --resume (the command a stopped
    # run prints): it went back to the weights the run started with
    plain = cli.resolve_config(EXPERIMENT, ap.parse_args(["--resume", str(run)]), ap)
    assert plain.data.mix == {"modules": 0.7, "packages": 1.0, "tests": 0.3}
    args = ap.parse_args(["--resume", str(run), "--mix", "modules=1,packages=0,tests=1"])
    again = cli.resolve_config(EXPERIMENT, args, ap)
    assert again.data.mix == {"modules": 1.0, "packages": 0.0, "tests": 1.0}
    # the cache's place may change (a cache gone or unwritable): a resume prepares anew
    args = ap.parse_args(["--resume", str(run), "--set", f"data.cache_dir={tmp_path / 'c2'}"])
    assert cli.resolve_config(EXPERIMENT, args, ap).data.cache_dir == str(tmp_path / "c2")
    code = main(["--resume", str(run), "--corpus", f"x={tmp_path}", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "drop --corpus" in err[-1]


@pytest.mark.slow
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


def test_a_damaged_prepare_plan_is_a_data_error(tmp_path: Path) -> None:
    from comera.errors import DataError
    from experiments.codebert.data import corpus_from_paths
    from loaders.prepare import PLAN_NAME

    folder = tmp_path / "prepared"
    folder.mkdir()
    for text, why in [('{"settings": ', "is unreadable"), ("[1]", "is unreadable"),
                      ('{"settings": {"heldout": 0.1}}', "names no tokenizer")]:  # fmt: skip
        (folder / PLAN_NAME).write_text(text)
        for split in ("train", "heldout"):
            (folder / split).mkdir(exist_ok=True)
            (folder / split / "doc_counts.json").write_text("{}")
        with pytest.raises(
            DataError, match=re.escape(f"--corpus x={folder}: its {PLAN_NAME} {why}")
        ):
            corpus_from_paths({"x": str(folder)}, tmp_path / "cache", vocab=100, progress=False)


def _javascript(folder: Path, files: int = 16) -> None:
    """A small made-up JavaScript project (and files a corpus must not take)."""
    verbs, nouns = ["get", "set", "load", "save", "parse", "render"], ["user", "item", "page"]
    for i in range(files):
        lines = [f"// module {i}", "'use strict';"]
        for j in range(8):
            verb, noun = verbs[(i + j) % 6], nouns[(i * j) % 3]
            lines += [f"function {verb}{noun.title()}{j}(id, opts) {{",
                      f"  const {noun} = opts.{noun}s.find((x) => x.id === id + {j});",
                      f"  return {noun} ? {noun}.value * {i + 1} : null;", "}"]  # fmt: skip
        lines.append(f"module.exports = {{ {verbs[i % 6]}{nouns[i % 3].title()}0 }};")
        sub = folder / ("lib" if i % 2 else "src")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"m{i}.js").write_text("\n".join(lines) + "\n")
    (folder / ".git").mkdir(exist_ok=True)
    (folder / ".git" / "hook.js").write_text("hidden();\n")
    (folder / "NOTES.txt").write_text("not code\n")


def test_a_prepared_folder_sharing_files_with_another_group_is_refused(tmp_path: Path) -> None:
    """A prepared folder and a raw folder (or two prepared folders) made from the same
    files trained the raw group on files the prepared one holds out; its plan names its
    sources, so the overlap is refused as two raw groups' is."""
    from comera.errors import DataError
    from experiments.codebert.data import corpus_from_paths
    from loaders.prepare import prepare

    _javascript(tmp_path / "js", files=8)
    js = tmp_path / "js"
    prepare([str(js)], tmp_path / "prep", glob="lib/*.js", train_vocab=300, heldout=0.3,
            progress=False)  # fmt: skip
    prepare([str(js / "src" / "m0.js"), str(js / "src" / "m2.js")], tmp_path / "files",
            train_vocab=300, heldout=0.3, progress=False)  # fmt: skip
    with pytest.raises(DataError, match=r"--corpus prep and --corpus raw share files .*lib/m"):
        corpus_from_paths({"prep": str(tmp_path / "prep"), "raw": str(js)}, tmp_path / "c",
                          vocab=300)  # fmt: skip
    with pytest.raises(DataError, match=r"--corpus raw and --corpus files share files .*m0.js"):
        corpus_from_paths({"raw": str(js / "src"), "files": str(tmp_path / "files")},
                          tmp_path / "c", vocab=300)  # fmt: skip
    with pytest.raises(DataError, match=r"--corpus a and --corpus b share files"):
        corpus_from_paths({"a": str(tmp_path / "prep"), "b": str(tmp_path / "prep")},
                          tmp_path / "c", vocab=300)  # fmt: skip
    # apart: the prepared lib files beside the raw src files (its glob left src out)
    corpus = corpus_from_paths({"prep": str(tmp_path / "prep"), "raw": str(js / "src")},
                               tmp_path / "c", vocab=300, progress=False)  # fmt: skip
    assert set(corpus.train) == {"prep", "raw"}
    # data.tokenizer naming the folder's tokenizer in another spelling serves (it was
    # compared as a string: the offline route the hub error gives was refused)
    prep = tmp_path / "prep"
    for spelling in (f"{prep}/", str(prep / "tokenizer.json")):
        corpus = corpus_from_paths({"prep": str(prep)}, tmp_path / "c", vocab=300,
                                   tokenizer=spelling, progress=False)  # fmt: skip
        assert corpus.train == {"prep": prep / "train"}
    said = r"data.tokenizer=.*files is not the tokenizer the prepared --corpus folders were "
    with pytest.raises(DataError, match=said + r"made with .*--set data.tokenizer="):
        corpus_from_paths({"prep": str(prep)}, tmp_path / "c", vocab=300,
                          tokenizer=str(tmp_path / "files"))  # fmt: skip


def test_a_prepared_folder_s_relative_sources_are_where_prepare_ran(
    tmp_path: Path, monkeypatch
) -> None:
    """The plan keeps sources as typed: read from where training runs, a relative one
    named other files (a false overlap) or missed the real one. The plan also records
    where they are (source_paths)."""
    from comera.errors import DataError
    from experiments.codebert.data import corpus_from_paths
    from loaders.prepare import PLAN_NAME, prepare

    for side in ("a", "b"):
        _javascript(tmp_path / side / "js", files=6)
    monkeypatch.chdir(tmp_path / "a")
    prepare(["js"], tmp_path / "a" / "prep", glob="lib/*.js", train_vocab=300, heldout=0.3,
            progress=False)  # fmt: skip
    plan = json.loads((tmp_path / "a" / "prep" / PLAN_NAME).read_text())
    assert plan["source_paths"] == [str(tmp_path / "a" / "js")]
    monkeypatch.chdir(tmp_path / "b")  # its own js/lib: other files
    prep = str(tmp_path / "a" / "prep")
    corpus_from_paths({"prep": prep, "raw": "js"}, tmp_path / "c", vocab=300, progress=False)
    with pytest.raises(DataError, match="--corpus prep and --corpus raw share files"):
        corpus_from_paths({"prep": prep, "raw": str(tmp_path / "a" / "js")}, tmp_path / "c",
                          vocab=300)  # fmt: skip
    # a tokenizer given to prepare by a relative path: data.tokenizer naming that file
    # from elsewhere is taken, and the corpus uses the caller's spelling (the plan's
    # "prep/tokenizer.json" names nothing from here)
    monkeypatch.chdir(tmp_path / "a")
    prepare(["js/src"], tmp_path / "a" / "prep2", glob="*.js",
            tokenizer="prep/tokenizer.json", heldout=0.3, progress=False)  # fmt: skip
    monkeypatch.chdir(tmp_path / "b")
    mine = str(tmp_path / "a" / "prep" / "tokenizer.json")
    corpus = corpus_from_paths({"p2": str(tmp_path / "a" / "prep2")}, tmp_path / "c",
                               vocab=300, tokenizer=mine, progress=False)  # fmt: skip
    assert corpus.tokenizer == mine


def test_source_files_take_any_language_and_a_glob_picks_others(tmp_path: Path) -> None:
    from comera.errors import DataError
    from experiments.codebert.data import corpus_from_paths, source_files
    from experiments.codebert.experiment import _folder_and_glob

    _javascript(tmp_path / "js", files=4)
    found = [p.relative_to(tmp_path / "js").as_posix() for p in source_files(tmp_path / "js")]
    assert found == ["lib/m1.js", "lib/m3.js", "src/m0.js", "src/m2.js"]  # no .git, no .txt
    assert [p.name for p in source_files(tmp_path / "js", "*.txt")] == ["NOTES.txt"]
    assert _folder_and_glob("/a/b:**/*.txt") == ("/a/b", "**/*.txt")
    assert _folder_and_glob("/a/b:c") == ("/a/b:c", None)  # a folder whose name has a colon
    with pytest.raises(DataError, match=r"--corpus rs=.*: no file matches '\*\*/\*\.rs'"):
        corpus_from_paths({"rs": str(tmp_path / "js")}, tmp_path / "c", vocab=300,
                          globs={"rs": "**/*.rs"})  # fmt: skip
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no source file .*--corpus e=.*:GLOB"):
        corpus_from_paths({"e": str(tmp_path / "empty")}, tmp_path / "c", vocab=300)
    # a config saved before default_glob existed keeps the *.py files it trained on
    from experiments.cli import config_from_dict
    from experiments.codebert.experiment import CorpusConfig, preset

    old = config_from_dict(CorpusConfig, {"source": "paths", "paths": {"a": str(tmp_path)}})
    assert old.default_glob == "**/*.py" and preset("smoke").data.default_glob is None


def test_a_folder_of_javascript_trains(tmp_path: Path, capsys) -> None:
    """``--corpus js=FOLDER`` on a folder of ``.js`` files (the issue's failing case), and
    a glob that matches nothing is one line naming it."""
    _javascript(tmp_path / "js")
    assert main(_argv(tmp_path, "run", "--corpus", f"js={tmp_path / 'js'}")) == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data"]["paths"] == {"js": str(tmp_path / "js")} and config["data"]["globs"] == {}
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
    capsys.readouterr()
    assert main(_argv(tmp_path, "bad", "--corpus", f"js={tmp_path / 'js'}:**/*.rs")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no file matches '**/*.rs'" in err[0]


def test_an_edited_corpus_is_prepared_again(tmp_path: Path) -> None:
    """The prepared corpus is cached by each file's path, size and mtime: files edited in
    place are a new corpus, not the old tokens and BPE served again."""
    import os

    from experiments.codebert.data import corpus_from_paths

    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"m{i:02d}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    first = corpus_from_paths({"app": str(src)}, tmp_path / "c", vocab=300, progress=False)
    again = corpus_from_paths({"app": str(src)}, tmp_path / "c", vocab=300, progress=False)
    assert again.root == first.root  # unchanged files: the cache serves
    (src / "m03.py").write_text("class Changed:\n    value = 1\n")
    os.utime(src / "m03.py", ns=(1, 1))  # a new mtime whatever the clock's resolution
    edited = corpus_from_paths({"app": str(src)}, tmp_path / "c", vocab=300, progress=False)
    assert edited.root != first.root


def test_the_heldout_batches_do_not_follow_the_mix(tmp_path: Path) -> None:
    """--mix may change on resume; the held-out loss must stay measured on the same
    tokens, a group given no weight included."""
    import dataclasses

    from experiments.codebert.experiment import CorpusConfig, build, preset

    for g in ("a", "b"):
        (tmp_path / g).mkdir()
        for i in range(20):
            (tmp_path / g / f"{g}{i:02d}.py").write_text(
                f"def {g}{i}(x):\n    return x * {i}\n" * 8
            )

    def heldout(mix: dict[str, float]) -> list:
        p = preset("smoke")
        data = CorpusConfig(source="paths", paths={g: str(tmp_path / g) for g in "ab"}, mix=mix,
                            vocab=300, seq_len=64, eval_batches=2, heldout=0.2,
                            cache_dir=str(tmp_path / "cache"), default_glob=None)  # fmt: skip
        task, *_ = build(dataclasses.replace(p, data=data))
        return task.eval_batches

    even, skewed = heldout({}), heldout({"a": 1.0, "b": 0.0})
    assert all(
        torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(even, skewed, strict=True)
    )


def test_paths_without_folders_name_the_set_key_too() -> None:
    """experiments.ablate has no --corpus: the error named only that flag."""
    from comera.errors import ConfigError
    from experiments.codebert.experiment import CorpusConfig

    with pytest.raises(ConfigError, match=r"--corpus NAME=FOLDER \(where .* --set 'data.paths="):
        CorpusConfig(source="paths")


def test_the_batch_is_global_and_split_over_the_processes(tmp_path: Path) -> None:
    """batch_size was rows per rank: two processes trained twice the tokens per step of
    one, and a resume on another number of processes changed the batch mid-run, without a
    word. It is the global batch, as in the other experiments: each rank takes its share,
    and a batch the processes do not divide is refused before the corpus is prepared."""
    import dataclasses

    from comera.errors import ConfigError
    from experiments.codebert.experiment import build, preset

    def small(batch: int) -> object:
        p = preset("smoke")
        data = dataclasses.replace(p.data, max_files=4, vocab=300, seq_len=32, eval_batches=1,
                                   cache_dir=str(tmp_path / "cache"))  # fmt: skip
        return dataclasses.replace(p, data=data, batch_size=batch)

    with pytest.raises(
        ConfigError, match=r"batch_size=3 \(global\) must be a positive multiple of world_size=2"
    ):
        build(small(3), rank=0, world=2)
    assert not (tmp_path / "cache").exists()
    shares = [build(small(4), rank=r, world=2)[0].train_iter.config.batch_size for r in (0, 1)]
    assert shares == [2, 2] and build(small(4))[0].train_iter.config.batch_size == 4


def test_more_processes_than_shards_and_a_thin_group_name_this_command_s_keys(
    tmp_path: Path,
) -> None:
    """The stream's 64 shards were fixed, so no run could use more than 64 processes; and
    the loader's refusals of too many readers for a small group advised LoaderConfig
    settings (shuffle='local', num_epochs) this command refuses as unknown keys."""
    import dataclasses

    from comera.errors import DataError
    from experiments.codebert.experiment import build, preset

    for name, n in (("big", 6), ("tiny", 2)):
        (tmp_path / name).mkdir()
        for k in range(n):
            body = "\n".join(f"def f{k}_{j}(x):\n    return x + {j}\n" for j in range(30))
            (tmp_path / name / f"m{k}.py").write_text(body)

    def small(**data: object) -> object:
        p = preset("smoke")
        kw = {"source": "paths", "paths": {n: str(tmp_path / n) for n in ("big", "tiny")},
              "vocab": 300, "seq_len": 32, "eval_batches": 1,
              "cache_dir": str(tmp_path / "cache"), **data}  # fmt: skip
        return dataclasses.replace(p, data=dataclasses.replace(p.data, **kw), batch_size=6)

    with pytest.raises(DataError, match=r"3 processes, .*data\.num_shards=2 shards.*"
                                        r"--set data\.num_shards=N"):  # fmt: skip
        build(small(num_shards=2), rank=0, world=3)
    assert not (tmp_path / "cache").exists()  # refused before the corpus was prepared
    task = build(small(num_shards=3, mix={"big": 1.0, "tiny": 0.0}), rank=0, world=3)[0]
    assert task.train_iter.config.num_shards == 3
    with pytest.raises(DataError) as err:  # one document of "tiny", three readers
        build(small(num_shards=3), rank=0, world=3)
    text = str(err.value)
    assert "'tiny'" in text and "--mix weight" in text and "fewer processes" in text
    assert "shuffle='local'" not in text and "num_epochs" not in text
    with pytest.raises(DataError) as err:  # "tiny" alone: two of three readers get nothing
        build(small(num_shards=3, mix={"big": 0.0, "tiny": 1.0}), rank=0, world=3)
    text = str(err.value)
    assert "would get no document" in text and text.endswith("or train on fewer processes")
    assert "--mix" not in text and "shuffle='local'" not in text


def test_a_group_of_one_file_or_of_tables_is_refused(tmp_path: Path) -> None:
    """One file is all train or all held out, and a globbed table file would be read as
    rows rather than as one document: both are refused naming --corpus."""
    from comera.errors import DataError
    from experiments.codebert.data import corpus_from_paths

    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.py").write_text("x = 1\n")
    with pytest.raises(DataError, match=r"--corpus one=.*: 1 file; a group needs at least 2"):
        corpus_from_paths({"one": str(tmp_path / "one")}, tmp_path / "c", vocab=300)
    (tmp_path / "logs").mkdir()
    for i in range(3):
        (tmp_path / "logs" / f"l{i}.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(DataError, match=r"--corpus logs=.*l0.jsonl \(and 2 more\) is a table"):
        corpus_from_paths({"logs": str(tmp_path / "logs")}, tmp_path / "c", vocab=300,
                          globs={"logs": "*.jsonl"})  # fmt: skip


def test_an_unreachable_hub_names_the_local_route(tmp_path: Path, monkeypatch, capsys) -> None:
    """Offline, a hub corpus fails in one line that says how to run on a local copy with
    this command's own flags."""
    from loaders import prepare as prep

    def offline(name: str, config: str, split: str, column: str) -> None:
        raise prep.PrepareError(f"cannot load hub dataset {name!r}: no network")

    monkeypatch.setattr(prep, "_load_hub", offline)
    argv = _argv(tmp_path, "run", "--set", "data.tokenizer=tok.json", "--set", "data.source=hub",
                 "--set", "data.hub_configs=python")  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "python -m loaders.prepare FILE --out DIR" in err[0], err
    assert "--corpus python=DIR" in err[0]


@pytest.mark.parametrize(
    ("corpus", "message"),
    [
        (["a={src}", "a={src}"], "sub-dataset 'a' is named twice"),
        (["a={src}:/tmp/*.py"], "the glob '/tmp/\\*.py' of 'a' is absolute"),
        (["../../x={src}"], "is not a sub-dataset name"),
        (["a={src},a={src}"], "'a' is named twice"),  # within one flag too
        (["a={src}", "--set", 'data.paths={{"../x": "{src}"}}'], "is not a sub-dataset name"),
    ],
)
def test_corpus_flags_that_would_drop_or_escape_are_one_line(
    tmp_path: Path, capsys, corpus: list[str], message: str
) -> None:
    """A name given twice kept only the last folder; an absolute glob was a traceback;
    a name with path separators wrote shards outside the cache."""
    (tmp_path / "src").mkdir()
    argv = []
    for c in corpus:
        argv += [c.format(src=tmp_path / "src")] if c.startswith(("--", "data.")) else [
            "--corpus", c.format(src=tmp_path / "src")]  # fmt: skip
    assert main(_argv(tmp_path, "r", *argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err
    assert not (tmp_path / "r").exists()


def test_an_empty_held_out_part_is_refused(tmp_path: Path, capsys) -> None:
    """The held-out file of a corpus is empty: the held-out loss used to read 0 and the
    perplexity 1, as if measured; the build now refuses it naming data.heldout."""
    import json as _json

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("")  # the one file held out (the smallest hash of the two)
    (src / "b.py").write_text(Path(_json.__file__).read_text())  # a real module
    assert main(_argv(tmp_path, "r", "--corpus", f"e={src}")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gives no batch" in err[0] and "data.heldout" in err[0], err
    assert not (tmp_path / "r").exists()


def test_corpus_files_that_would_leak_or_train_as_noise_are_refused_or_said(
    tmp_path: Path, capsys
) -> None:
    """Two groups sharing a file drew their held-out files apart (a file trained in one
    and was held out in the other); a link to a file of its group could be held out while
    its target trained; a glob took ``.git`` and binary files (trained as replacement
    marks); a ``**`` typo was a traceback."""
    from comera.errors import DataError
    from experiments.codebert.data import corpus_from_paths, source_files

    _javascript(tmp_path / "js", files=6)
    (tmp_path / "js" / "src" / "blob.js").write_bytes(b"\x89PNG\r\n\x00\x00binary")
    (tmp_path / "js" / "src" / "latin.js").write_bytes(b"var caf\xe9 = 1;\n")
    found = [p.relative_to(tmp_path / "js").as_posix()
             for p in source_files(tmp_path / "js", "**/*")]  # fmt: skip
    assert found == ["NOTES.txt", "lib/m1.js", "lib/m3.js", "lib/m5.js", "src/m0.js",
                     "src/m2.js", "src/m4.js"]  # fmt: skip
    assert [p.name for p in source_files(tmp_path / "js", ".git/*.js")] == ["hook.js"]
    assert [p.name for p in source_files(tmp_path / "js", ".*/*.js")] == ["hook.js"]
    (tmp_path / "js" / "lib" / ".eslintrc.js").write_text("module.exports = {};\n")
    assert ".eslintrc.js" not in [p.name for p in source_files(tmp_path / "js", "**/*.js")]
    from experiments.codebert.data import is_binary

    (tmp_path / "cut.py").write_bytes(b"a" * 8191 + "é".encode() + b"b")  # é cut at 8 KiB
    (tmp_path / "bad.py").write_bytes(b"a" * 8190 + b"\xff" + b"b" * 9)
    assert not is_binary(tmp_path / "cut.py") and is_binary(tmp_path / "bad.py")
    (tmp_path / "end.py").write_bytes(b"a" * 8191 + "é".encode()[:1])  # 8 KiB, cut at the end
    assert is_binary(tmp_path / "end.py")
    js = str(tmp_path / "js")
    with pytest.raises(DataError, match=r"--corpus all and --corpus lib share files .*m1.js"):
        corpus_from_paths({"all": js, "lib": f"{js}/lib"}, tmp_path / "c", vocab=300)
    with pytest.raises(DataError, match=r"--corpus a=.*:\*\*.js: .*e.g. \*\*/\*.py"):
        corpus_from_paths({"a": js}, tmp_path / "c", vocab=300, globs={"a": "**.js"})
    (tmp_path / "bin").mkdir()
    for i in range(3):
        (tmp_path / "bin" / f"b{i}.py").write_bytes(bytes(range(256)))
    with pytest.raises(DataError, match=r"none of its 3 files is UTF-8 text"):
        corpus_from_paths({"b": str(tmp_path / "bin")}, tmp_path / "c", vocab=300)
    (tmp_path / "js" / "src" / "twin.js").symlink_to(tmp_path / "js" / "lib" / "m1.js")
    capsys.readouterr()
    corpus = corpus_from_paths({"a": js}, tmp_path / "c", vocab=300, progress=False,
                               globs={"a": "**/*.js"})  # fmt: skip
    err = capsys.readouterr().err
    assert "left out 2 files that are not UTF-8 text" in err
    assert "1 files are links to files already" in err
    plan = json.loads((corpus.root / "a" / "prepare_plan.json").read_text())
    assert len(plan["settings"]["sources"]) == 6  # six modules; no twin, no binary


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--corpus", "x="], "data.paths: 'x' has no folder"),
        (["--corpus", "a={src}", "--set", "data.source=stdlib"], "does not read data.paths"),
        (["--corpus", "a={src}:../*.py"], "leaves its folder"),
        (["--set", "data.max_doc_tokens=0"], "data.max_doc_tokens=0 must be None"),
        (["--corpus", "a={src}", "--corpus", "b={empty}"], "'b' .* holds no training document"),
        (["--corpus", "a={src}", "--corpus", "b={empty}", "--mix", "a=0.9"],
         r"--mix gives no weight to \['b'\]"),
        # the loader's message named no flag; a name was the cache's tokenizer file
        (["--corpus", "a={src}", "--corpus", "b={src}/x", "--mix", "a=-1,b=1"],
         r"--mix a=-1.0 \(data.mix\): weight must be a finite number >= 0"),
        (["--corpus", "a={src}", "--corpus", "b={src}/x", "--mix", "a=0,b=0"],
         "--mix gives every sub-dataset weight 0"),
        (["--corpus", "tokenizer.json={src}"], "'tokenizer.json' is not a sub-dataset name"),
        # the loader's EmptyStream named LoaderConfig.min_doc_len, which no flag sets
        (["--corpus", "b={empty}"],
         r"no sub-dataset with a positive weight \(b\) holds a training document"),
        # "none of its files is UTF-8 text ... convert them to UTF-8"
        (["--corpus", "z={gz}:*.gz"], r"compressed or another encoding\); decompress them"),
        # a local path that is no tokenizer: loaders' message named no flag
        (["--corpus", "a={src}", "--set", "data.tokenizer={src}/nope.json"],
         r"data.tokenizer='.*nope.json': cannot load it"),
    ],
)  # fmt: skip
def test_corpus_settings_that_were_ignored_or_misread_are_one_line(
    tmp_path: Path, capsys, extra: list[str], message: str
) -> None:
    """Each of these trained without a word on other data than asked: the current folder
    (an empty folder value), the stdlib (a source that does not read the folders), files
    outside the folder, a group of empty files dropped with its share, a group left out
    of --mix weighed 1.0; the others were tracebacks or named another command's flag."""
    import gzip

    src, empty, gz = tmp_path / "src", tmp_path / "empty", tmp_path / "gz"
    for folder in (src, empty, gz):
        folder.mkdir()
    for i in range(12):
        (src / f"m{i:02d}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 4)
        (empty / f"e{i:02d}.py").write_text("")
        with gzip.open(gz / f"g{i:02d}.jsonl.gz", "wt") as f:
            f.write('{"code": "x = 1"}\n')
    argv = [e.format(src=src, empty=empty, gz=gz) for e in extra]
    assert main(_argv(tmp_path, "r", "--set", "data.vocab=300", *argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.search(message, err[-1]) and "Traceback" not in "".join(err), err
    assert not (tmp_path / "r").exists()


def test_a_corpus_cache_that_cannot_be_made_or_a_folder_with_a_comma(
    tmp_path: Path, capsys
) -> None:
    """A cache where no folder can be made (/proc, even for root) was a FileNotFoundError
    traceback from the tokenizer's training; --corpus split a folder's name at its comma
    ("expected NAME=VALUE")."""
    argv = ["--preset", "smoke", "--run-dir", str(tmp_path / "r"), "--wandb", "disabled",
            "--set", "data.cache_dir=/proc/comera-cache"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot build the corpus cache under /proc/comera-cache" in err[0]
    assert "data.cache_dir" in err[0] and not (tmp_path / "r").exists(), err
    from experiments import cli
    from experiments.codebert.experiment import EXPERIMENT

    ap = cli.build_parser(EXPERIMENT)
    args = ap.parse_args(["--corpus", f"a={tmp_path}/with,comma", "--corpus", "b=x,c=y:*.js"])
    over = dict(EXPERIMENT.flag_overrides(args))
    cwd = Path.cwd()  # relative folders are kept absolute, for a resume from elsewhere
    assert over["data.paths"] == {"a": f"{tmp_path}/with,comma", "b": str(cwd / "x"),
                                  "c": str(cwd / "y")}  # fmt: skip
    assert over["data.globs"] == {"c": "*.js"}


def test_a_corpus_cache_under_a_file_is_one_line(tmp_path: Path, capsys) -> None:
    """It was a NotADirectoryError traceback from deep in the preparation."""
    (tmp_path / "afile").write_text("")
    argv = ["--preset", "smoke", "--run-dir", str(tmp_path / "r"), "--wandb", "disabled",
            "--set", f"data.cache_dir={tmp_path / 'afile' / 'c'}"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lies under" in err[0] and "data.cache_dir" in err[0], err


def test_a_resume_over_edited_held_out_files_is_refused(tmp_path: Path, capsys) -> None:
    """An edited corpus is prepared anew (another BPE, other held-out tokens), and a
    resume carried on over it, scoring the held-out loss on other tokens than before."""
    import os
    import shutil

    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"m{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i} + 1\n" * 6)
    argv = _argv(tmp_path, "run", "--corpus", f"a={src}", "--set", "data.vocab=300",
                 "--set", "data.eval_batches=1")  # fmt: skip
    assert main(argv) == 0
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_00000012")
    for i, f in enumerate(sorted(src.iterdir())):
        f.write_text(f.read_text() + "# edited: zeta handler\n")
        os.utime(f, ns=(i + 1, i + 1))
    capsys.readouterr()
    assert main(["--resume", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "other examples in eval split 'heldout'" in err[-1], err
    assert (tmp_path / "run" / "checkpoints" / "step_00000006" / "model.pt").is_file()


def test_prepared_folders_hard_links_and_relative_folders_are_taken_as_they_are(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """A prepared folder kept its own held-out split and piece length while config.json
    and the report showed data.heldout and data.max_doc_tokens (now said on stderr, and the
    report reads the folders'); a :GLOB on it was ignored (now refused); a hard link in
    two groups trained in one and was held out in the other; a relative --corpus folder
    was saved as typed, so --resume from elsewhere failed on a flag it was not given."""
    import argparse
    import os

    from comera.errors import DataError
    from experiments.codebert.data import corpus_from_paths, group_settings
    from experiments.codebert.experiment import _flag_overrides
    from experiments.codebert.report import _corpus_lines, _mixed, _pieces
    from loaders.prepare import prepare

    _javascript(tmp_path / "js", files=8)
    js = tmp_path / "js"
    prepare([str(js / "lib")], tmp_path / "prep", glob="*.js", train_vocab=300, heldout=0.3,
            progress=False)  # fmt: skip
    prep = str(tmp_path / "prep")
    with pytest.raises(DataError, match=r"--corpus p=.*prep:\*.js: .* drop the :GLOB"):
        corpus_from_paths({"p": prep}, tmp_path / "c", vocab=300, globs={"p": "*.js"})
    capsys.readouterr()
    corpus = corpus_from_paths({"p": prep, "raw": str(js / "src")}, tmp_path / "c", vocab=300,
                               heldout=0.05, max_doc_tokens=64, progress=False)  # fmt: skip
    err = capsys.readouterr().err
    assert "--corpus p=" in err and "data.heldout=0.05 not applied (the folder's: 0.3)" in err
    assert "data.max_doc_tokens=64 not applied (the folder's: None)" in err
    # data.vocab too: the prepared folder's tokenizer serves every group, raw ones included
    from experiments.codebert.data import tokenizer_info

    size = tokenizer_info(str(prep) + "/tokenizer.json")[0]
    corpus_from_paths({"p": prep, "raw": str(js / "src")}, tmp_path / "c2", vocab=size + 1,
                      heldout=0.3, progress=False)  # fmt: skip
    err = capsys.readouterr().err
    assert f"data.vocab={size + 1} not applied: the prepared --corpus folders' tokenizer" in err
    assert f"{size:,} tokens) tokenizes every group, the raw folders' too" in err
    corpus_from_paths({"p": prep}, tmp_path / "c3", vocab=size, heldout=0.3, progress=False)
    assert "data.vocab" not in capsys.readouterr().err
    groups = {n: group_settings(f.parent) for n, f in corpus.train.items()}
    assert groups == {"p": {"heldout": 0.3, "max_doc_tokens": None},
                      "raw": {"heldout": 0.05, "max_doc_tokens": 64}}  # fmt: skip
    s = {"sub_datasets": ["p", "raw"], "paths": {"p": prep, "raw": "src"}, "heldout": 0.05,
         "vocab": 300, "max_doc_tokens": 64, "groups": groups}  # fmt: skip
    assert "5%, 30% of each group's files held out" in _corpus_lines(s)[-1]
    assert _pieces(s) == "files cut into pieces of at most 64 tokens (some groups whole)"
    assert _pieces({"max_doc_tokens": 1024}) == "files cut into pieces of at most 1024 tokens"
    assert _mixed({"mix": {"p": 0.7, "raw": 0.3}}) == ", mixed by --mix p=0.7,raw=0.3"
    assert _mixed({"mix": {}}) == _mixed({}) == ""  # alike, or a JSON from before
    (tmp_path / "other").mkdir()
    os.link(js / "lib" / "m3.js", tmp_path / "other" / "m3.js")
    (tmp_path / "other" / "x.js").write_text("var x = 1;\n")
    with pytest.raises(DataError, match=r"--corpus a and --corpus b share files .*m3.js"):
        corpus_from_paths({"a": str(js / "lib"), "b": str(tmp_path / "other")},
                          tmp_path / "c", vocab=300)  # fmt: skip
    monkeypatch.chdir(tmp_path)
    paths = dict(_flag_overrides(argparse.Namespace(corpus=["a=js/lib,b=/abs"], mix=None)))
    assert paths["data.paths"] == {"a": str(js / "lib"), "b": "/abs"}
    monkeypatch.chdir(js)  # a run saved before folders were absolute, resumed elsewhere
    with pytest.raises(DataError, match=rf"--corpus a=js/lib: no such folder under {js} "):
        corpus_from_paths({"a": "js/lib"}, tmp_path / "c", vocab=300)


def test_a_group_whose_held_out_files_are_empty_is_refused(tmp_path: Path, capsys) -> None:
    """One group's held-out file was an empty ``__init__.py``: the held-out loss measured
    the other groups alone, without a word."""
    import json as _json
    import textwrap as _textwrap

    for name, text in (("e", ""), ("f", Path(_textwrap.__file__).read_text())):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.py").write_text(text)  # the one held out (the smaller hash)
        (tmp_path / name / "b.py").write_text(Path(_json.__file__).read_text())
    argv = _argv(
        tmp_path, "r", "--corpus", f"e={tmp_path / 'e'}", "--corpus", f"f={tmp_path / 'f'}"
    )
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sub-dataset 'e': its held-out split" in err[-1], err
    assert "data.heldout" in err[-1] and not (tmp_path / "r").exists()


def test_corpus_limits_a_prepared_split_and_a_moved_folder_are_named(
    tmp_path: Path, capsys
) -> None:
    """data.vocab=2**31 aborted in the tokenizer trainer (a Rust allocation failure) and
    the corpus limits shared one line that did not say which failed; a prepared folder's
    split was read as raw files ("no source file"); a resume whose folder had moved was
    told to pass NAME=FOLDER, which a resume then refused."""
    from comera.errors import ConfigError
    from experiments.codebert.experiment import CorpusConfig
    from loaders.prepare import prepare

    with pytest.raises(ConfigError, match="data.vocab=2147483648 must be between 300 and"):
        CorpusConfig(vocab=2**31)
    with pytest.raises(ConfigError, match="data.seq_len=4 must be at least 8"):
        CorpusConfig(seq_len=4)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"m{i:02d}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 4)
    prepare([str(src)], tmp_path / "prep", train_vocab=300, glob="*.py", heldout=0.2,
            progress=False)  # fmt: skip
    argv = _argv(tmp_path, "p", "--corpus", f"a={tmp_path / 'prep' / 'train'}")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"is the 'train' split of the loaders.prepare output {tmp_path / 'prep'}" in err[-1]
    moved = tmp_path / "moved"
    assert main(_argv(tmp_path, "r", "--corpus", f"a={src}", "--set", "train.steps=2")) == 0
    src.rename(moved)
    capsys.readouterr()
    assert main(["--resume", str(tmp_path / "r"), "--no-progress", "--wandb", "disabled"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--corpus a={src}: no such folder; on --resume" in err[0], err
    assert "put the folder back at that path" in err[0]
