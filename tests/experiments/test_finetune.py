"""``python -m experiments.finetune``: a Hugging Face classifier tensorized and
rank-adapted, from a config or a local folder, CoMERA or dense; bad input is one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from experiments.finetune import main  # noqa: E402

SETS = ["train.steps=30", "train.eval_every=15", "train.checkpoint_every=15",
        "data.generated_train=300", "data.generated_eval=60", "train.warmup_steps=0",
        "train.comera.reg_start_step=5", "train.comera.early_steps=20",
        "train.comera.prune_every=5"]  # fmt: skip


def _argv(tmp_path: Path, run: str, *extra: str) -> list[str]:
    argv = ["--preset", "smoke", "--run-dir", str(tmp_path / run), "--no-progress",
            "--wandb", "disabled", *extra]  # fmt: skip
    for kv in SETS:
        argv += ["--set", kv]
    return argv


def test_smoke_cli_tensorizes_adapts_ranks_and_resumes(tmp_path: Path, capsys) -> None:
    from experiments.finetune import report

    assert main(_argv(tmp_path, "finetune-smoke")) == 0
    (tmp_path / "run").symlink_to(tmp_path / "finetune-smoke")
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    layers = {r["layer"]: r for r in config["tensorized"]}
    assert "bert.encoder.layer.0.attention.self.query" in layers
    assert "bert.embeddings.word_embeddings" in layers and "classifier" not in layers
    ranks = json.loads((tmp_path / "run" / "ranks.json").read_text())
    assert ranks  # the trainer tracked the tensorized layers' ranks
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/validation/accuracy" in r for r in rows)
    trained = [r for r in rows if "compression" in r]
    assert trained[-1]["compression"] > 3  # against the dense model's parameter count
    assert main(["--resume", str(tmp_path / "finetune-smoke"), "--no-progress"]) == 0  # done
    from comera.train import load_checkpoint  # a resume checks the eval split it names

    assert set(load_checkpoint(tmp_path / "finetune-smoke")["eval_data"]) == {"validation"}
    assert main(_argv(tmp_path, "finetune-smoke-dense", "--dense")) == 0
    dense = json.loads((tmp_path / "finetune-smoke-dense" / "config.json").read_text())
    assert dense["tensorized"] == [] and dense["dense"]
    text = report.write_report(tmp_path, tmp_path, None)  # the report of the two runs
    assert "| CoMERA |" in text and "| dense |" in text
    assert (tmp_path / "finetune_curves.png").is_file()
    again = report.render(json.loads((tmp_path / "finetune.json").read_text()), tmp_path)
    assert again == text  # rendered from the JSON alone


def test_the_layer_table_counts_padded_layers_at_their_own_size(tmp_path: Path) -> None:
    """An FFN of 97 is padded to a train of 98 or more: the report's layer table counted
    the padded size, and so overstated the compression."""
    from experiments.report import layer_summary, load_run

    # a plan rule over a padded layer's own name (what config.json shows) reaches its
    # train at NAME.inner: it was refused as matching no TT layer
    argv = _argv(tmp_path, "odd", "--set", "model.ffn=97", "--set", "train.steps=2",
                 "--set", "train.eval_every=None", "--set", "train.checkpoint_every=2",
                 "--plan-for", "*.intermediate.dense=dense")  # fmt: skip
    assert main(argv) == 0
    config = json.loads((tmp_path / "odd" / "config.json").read_text())
    padded = [r for r in config["tensorized"] if "padded" in r["note"]]
    assert padded, config["tensorized"]
    assert any(r["layer"].endswith(".intermediate.dense") for r in padded)
    summary = {
        r["path"].removesuffix(".inner"): r for r in layer_summary(load_run(tmp_path / "odd"))
    }
    for record in config["tensorized"]:
        if not record["note"].startswith("skipped"):
            assert summary[record["layer"]]["dense_params"] == record["params"][0], record


@pytest.mark.slow
def test_a_local_model_folder_and_bad_input(tmp_path: Path, capsys) -> None:
    """``--model FOLDER`` loads a saved transformers model (here one saved from the smoke
    config); a folder with no model, or a target that matches nothing, is one line."""
    from experiments.finetune.experiment import load_model, preset
    from experiments.mnli.data import load_mnli

    p = preset("smoke")
    model = load_model(p.model, load_mnli(p.data))
    model.save_pretrained(tmp_path / "bert")
    assert main(_argv(tmp_path, "local", "--model", str(tmp_path / "bert"), "--rank", "4")) == 0
    config = json.loads((tmp_path / "local" / "config.json").read_text())
    assert config["model"]["path"] == str(tmp_path / "bert") and config["model"]["rank"] == 4
    capsys.readouterr()
    assert main(_argv(tmp_path, "nomodel", "--model", str(tmp_path / "nothing"))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model" in err[0]
    assert main(_argv(tmp_path, "notarget", "--target", "attn.*")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'attn.*' matches no" in err[0] and "query" in err[0]
    # the model folder moved while the run was stopped: the resume named --model, which
    # it then refused as a change (a dead end); it now takes the new place
    import shutil

    run = tmp_path / "local"
    shutil.rmtree(run / "checkpoints" / "step_00000030")  # stopped after step 15
    (tmp_path / "bert").rename(tmp_path / "moved")
    resume = ["--resume", str(run), "--no-progress"]
    assert main(resume) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--resume {run} --model NEW_FOLDER" in err[0], err
    assert main([*resume, "--model", str(tmp_path / "moved")]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 30
    assert main(resume) == 0  # the new place holds for later resumes


def test_a_model_saved_in_half_precision_trains_in_float32(tmp_path: Path) -> None:
    """transformers loads a bf16 checkpoint as bf16: Adam on those weights dropped every
    update below their resolution (most of a LayerNorm's stayed 1.0), without a word."""
    import dataclasses

    import torch

    from experiments.finetune.experiment import load_model, preset
    from experiments.mnli.data import load_mnli

    p = preset("smoke")
    data = load_mnli(p.data)
    model = load_model(p.model, data).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    loaded = load_model(dataclasses.replace(p.model, path=str(tmp_path / "bf16")), data)
    assert {t.dtype for t in loaded.parameters()} == {torch.float32}
    saved = dict(model.named_parameters())
    for name, t in loaded.named_parameters():  # the saved values, upcast exactly
        assert torch.equal(t, saved[name].float()), name
    # float64 weights stay float64 (a float32 copy would round them)
    model.double().save_pretrained(tmp_path / "f64")
    wide = load_model(dataclasses.replace(p.model, path=str(tmp_path / "f64")), data)
    assert {t.dtype for t in wide.parameters()} == {torch.float64}


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_a_cuda_graph_step_off_cuda_is_one_line(tmp_path: Path, capsys) -> None:
    """It was refused once the model was built and its layer table printed: the table,
    then the line."""
    assert main(_argv(tmp_path, "graph", "--step-mode", "cuda_graph")) == 2
    assert "cuda_graph' needs a CUDA device (train.device)" in _one_error(capsys)
    assert not (tmp_path / "graph").exists()


def test_a_saved_decoder_classifier_and_path_mistakes(tmp_path: Path, capsys) -> None:
    """A GPT-2 classifier saved with no pad id (GPT-2's configs have none) trains with the
    data's; fewer positions than the rows, a file for the folder, a mistyped local folder
    and damaged weights are each one line, before the run dir is claimed."""
    import transformers as tf

    from experiments.mnli.data import build_generated_tokenizer

    vocab = build_generated_tokenizer().get_vocab_size(with_added_tokens=True)
    tiny = dict(vocab_size=vocab, n_embd=32, n_layer=1, n_head=4, num_labels=3)
    tf.GPT2ForSequenceClassification(tf.GPT2Config(n_positions=64, **tiny)).save_pretrained(
        tmp_path / "gpt2"
    )
    tf.GPT2ForSequenceClassification(tf.GPT2Config(n_positions=8, **tiny)).save_pretrained(
        tmp_path / "short"
    )
    fast = ["--set", "train.steps=2", "--set", "train.eval_every=None", "--dense"]
    assert main([*_argv(tmp_path, "run-gpt2", "--model", str(tmp_path / "gpt2")), *fast]) == 0
    capsys.readouterr()
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text((tmp_path / "gpt2" / "config.json").read_text())
    (damaged / "model.safetensors").write_bytes(b"\x01\x02 not a safetensors file")
    unknown = tmp_path / "unknown"  # blamed on model.num_labels before
    unknown.mkdir()
    (unknown / "config.json").write_text('{"model_type": "no_such_architecture"}')
    for model, text in [
        (unknown, "does not know the saved model's architecture"),
        (tmp_path / "short", "16 tokens long but --model"),
        (tmp_path / "gpt2" / "config.json", "that is a file; give the folder"),
        (tmp_path / "gpt2_typo" / "x", "no such folder"),
        (damaged, "cannot read the model saved there"),
        (tmp_path / "run-gpt2" / "checkpoints", "holds no config.json"),  # no model's
        (tmp_path / "run-gpt2", "not a folder a transformers model was saved to"),
    ]:
        run = tmp_path / "refused"
        assert main([*_argv(tmp_path, "refused", "--model", str(model)), *fast]) == 2, model
        assert text in _one_error(capsys)
        assert not (run / "config.json").exists()


def test_the_position_limit_is_the_table_the_model_reads() -> None:
    """RoBERTa-style tables (CamemBERT, Data2Vec, I-BERT: any ``position_embeddings`` with
    a padding_idx) lose ``padding_idx + 1`` rows; relative-only DeBERTa-v3 and XLNet have
    no limit; BERT reads its whole table, OpenAI GPT its config's count. A limit found is a
    length that runs."""
    import torch
    import transformers as tf

    from experiments.finetune.experiment import _positions

    tiny = dict(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                intermediate_size=64, max_position_embeddings=18, num_labels=3)  # fmt: skip
    torch.manual_seed(0)
    for cls, conf, want in [
        (tf.BertForSequenceClassification, tf.BertConfig(**tiny), 18),
        (tf.RobertaForSequenceClassification, tf.RobertaConfig(pad_token_id=1, **tiny), 16),
        (tf.CamembertForSequenceClassification, tf.CamembertConfig(pad_token_id=1, **tiny), 16),
        (tf.Data2VecTextForSequenceClassification,
         tf.Data2VecTextConfig(pad_token_id=1, **tiny), 16),
        (tf.IBertForSequenceClassification, tf.IBertConfig(pad_token_id=1, **tiny), 16),
        (tf.EsmForSequenceClassification,  # ESM-1b: absolute, though its config has rope_theta
         tf.EsmConfig(pad_token_id=1, mask_token_id=2, position_embedding_type="absolute",
                      **tiny), 16),
        (tf.DebertaV2ForSequenceClassification,
         tf.DebertaV2Config(position_biased_input=False, relative_attention=True, **tiny), None),
        (tf.FunnelForSequenceClassification,  # relative, unflagged: held to its config
         tf.FunnelConfig(vocab_size=50, d_model=32, block_sizes=[1], n_head=4, d_head=8,
                         d_inner=64, max_position_embeddings=18, num_labels=3), 18),
        (tf.LukeForSequenceClassification,  # two tables: the word positions' is smaller
         tf.LukeConfig(entity_vocab_size=10, entity_emb_size=16, pad_token_id=1, **tiny), 16),
        (tf.OpenAIGPTForSequenceClassification,  # no table by that name: the config's count
         tf.OpenAIGPTConfig(vocab_size=50, n_embd=32, n_layer=1, n_head=4, n_positions=18,
                            num_labels=3, pad_token_id=0), 18),
    ]:  # fmt: skip
        model = cls(conf).eval()
        assert _positions(model) == want, cls.__name__
        if want is not None:
            with torch.no_grad():
                model(torch.randint(5, 50, (1, want)))
    xlnet = tf.XLNetForSequenceClassification(tf.XLNetConfig(
        vocab_size=50, d_model=32, n_layer=1, n_head=4, d_inner=64))  # fmt: skip
    assert _positions(xlnet) is None


@pytest.mark.slow
def test_a_run_resumed_from_a_mid_run_checkpoint_ends_where_the_whole_run_did(
    tmp_path: Path,
) -> None:
    """Exact resume through ``ModuleTask``: the run is rebuilt from a fresh model, the
    checkpoint of step 15 (before the compaction at 20) restored into it, and the same 15
    steps taken again give the whole run's final weights and held-out metrics."""
    import shutil

    import torch

    from comera.train import load_checkpoint

    run = tmp_path / "run"
    assert main(_argv(tmp_path, "run")) == 0
    whole = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    final = load_checkpoint(run)
    shutil.rmtree(run / "checkpoints" / "step_00000030")
    rows = [r for r in whole if r["step"] <= 15]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--resume", str(run), "--no-progress"]) == 0
    again = load_checkpoint(run)
    assert again["step"] == final["step"] == 30
    a, b = final["params"], again["params"]
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        xs = torch.utils._pytree.tree_leaves(x)
        ys = torch.utils._pytree.tree_leaves(y)
        assert all(torch.equal(p, q) for p, q in zip(xs, ys, strict=True)), k
    resumed = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = lambda rs: [r for r in rs if "eval/validation/accuracy" in r]  # noqa: E731
    assert evals(resumed)[-1] == evals(whole)[-1]


def test_the_report_names_local_data_and_refuses_runs_without_validation(tmp_path: Path) -> None:
    """Runs on local files evaluated under another split name were reported with every
    figure "-", exit 0, as "the generated NLI task"; a dense run of another model was set
    beside CoMERA's as "the same model as built"."""
    from comera.errors import DataError
    from experiments.finetune import report

    for name, dense in (("finetune-smoke", False), ("finetune-smoke-dense", True)):
        d = tmp_path / name
        d.mkdir()
        config = {"experiment": "finetune", "dense": dense, "data": {"train_file": "t.jsonl"},
                  "model": {}, "dense_params": 10}  # fmt: skip
        (d / "config.json").write_text(json.dumps(config))
        rows = [{"step": 1, "loss": 1.0}, {"step": 1, "eval/dev/accuracy": 0.5}]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"smoke holds no evaluation \(eval/validation/accur"):
        report.gather(tmp_path, "cmd")
    config["dense_params"] = 99  # the dense slot's (another model's)
    (tmp_path / "finetune-smoke-dense" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match=r"other setups: dense_params \(10 against 99\)"):
        report.gather(tmp_path, "cmd")
    assert report._task({"data": {"train_file": "t.jsonl"}}) == "local files (train `t.jsonl`)"
    assert report._task({}) == "the generated NLI task"  # a JSON from before


def test_a_head_trained_on_mnli_elsewhere_is_noted(tmp_path: Path) -> None:
    """A checkpoint whose id2label numbers contradiction 0 (roberta-large-mnli's order)
    was trained and scored with the data's entailment=0, without a word. Integer labels
    may already follow the head, so nothing is remapped: a note says how the two differ."""
    import contextlib
    import io

    import transformers as tf

    from experiments.finetune.experiment import load_model, nli_label_order, preset
    from experiments.mnli.data import load_mnli

    mnli_order = {0: "CONTRADICTION", 1: "NEUTRAL", 2: "ENTAILMENT"}
    assert nli_label_order(tf.BertConfig(id2label=mnli_order)) == [2, 1, 0]
    assert nli_label_order(tf.BertConfig(num_labels=3)) is None  # LABEL_0, ...: the data's
    same = {0: "entailment", 1: "neutral", 2: "contradiction"}
    assert nli_label_order(tf.BertConfig(id2label=same)) is None
    assert nli_label_order(tf.BertConfig(id2label={0: "neg", 1: "pos"})) is None
    p = preset("smoke")
    model = load_model(p.model, load_mnli(p.data))
    model.config.id2label = mnli_order
    model.config.label2id = {v: k for k, v in mnli_order.items()}
    model.save_pretrained(tmp_path / "mnli-head")
    argv = _argv(tmp_path, "r", "--model", str(tmp_path / "mnli-head"), "--set",
                 "train.steps=2", "--set", "train.eval_every=None")  # fmt: skip
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(argv) == 0
    assert "its head numbers the labels contradiction=0, neutral=1, entailment=2" in (
        err.getvalue()
    )
    assert "the data's read as entailment=0, neutral=1, contradiction=2" in err.getvalue()


def test_a_model_folder_with_a_tokenizer_is_pointed_at(tmp_path: Path, monkeypatch) -> None:
    """--model DIR without --tokenizer loaded bert-base-uncased from the hub: offline an
    error naming nothing of DIR, online the rows tokenized for another model, silently."""
    from experiments.finetune import experiment as ft
    from experiments.mnli.data import HubUnreachableError

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    p = ft.preset("smoke")
    p = dataclasses.replace(p, model=dataclasses.replace(p.model, path=str(tmp_path / "m")),
                            data=dataclasses.replace(p.data, dataset="local",
                                                     train_file="t.jsonl"))  # fmt: skip

    what = ["tokenizer 'bert-base-uncased'"]

    def offline(cfg):
        raise HubUnreachableError(f"Could not reach the Hugging Face Hub to load {what[0]}.")

    monkeypatch.setattr(ft, "load_mnli", offline)
    with pytest.raises(
        HubUnreachableError, match=rf"\(--model .* pass --tokenizer {tmp_path / 'm'}\)$"
    ):
        ft.build(p)
    what[0] = "dataset 'nyu-mll/glue'"  # the data's failure: no tokenizer advice
    with pytest.raises(HubUnreachableError, match=r"glue'\.$"):
        ft.build(p)
