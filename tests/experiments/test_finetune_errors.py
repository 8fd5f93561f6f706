"""``python -m experiments.finetune``: ``--embedding-impl`` reaches the tensorized embedding,
and a ``--model`` that does not fit the run (another label count, a smaller vocabulary)
is one line, exit 2, before the run dir is made."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import transformers as tf  # noqa: E402

import comera as C  # noqa: E402
from experiments import cli  # noqa: E402
from experiments.finetune import main  # noqa: E402
from experiments.finetune.experiment import EXPERIMENT, build, load_model, preset  # noqa: E402
from experiments.mnli.data import build_generated_tokenizer, load_mnli  # noqa: E402

SETS = ["train.steps=2", "train.eval_every=None", "data.generated_train=60",
        "data.generated_eval=12", "batch_size=16"]  # fmt: skip


def _argv(tmp_path: Path, run: str, *extra: str) -> list[str]:
    argv = ["--preset", "smoke", "--run-dir", str(tmp_path / run), "--no-progress",
            "--wandb", "disabled", *extra]  # fmt: skip
    for kv in SETS:
        argv += ["--set", kv]
    return argv


def _save_bert(path: Path, *, labels: int = 3, vocab: int | None = None, head: bool = True) -> str:
    """A tiny BERT saved to ``path``: a classifier of ``labels`` labels (or, without
    ``head``, the encoder alone) over ``vocab`` ids (default: the generated task's)."""
    if vocab is None:
        vocab = build_generated_tokenizer().get_vocab_size(with_added_tokens=True)
    config = tf.BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1,
                           num_attention_heads=4, intermediate_size=64,
                           max_position_embeddings=160, num_labels=labels)  # fmt: skip
    model = tf.BertForSequenceClassification(config) if head else tf.BertModel(config)
    model.save_pretrained(path)
    return str(path)


def _saved(capsys: pytest.CaptureFixture[str], path: Path, **kw: Any) -> str:
    """:func:`_save_bert`, its progress bar dropped from the captured stderr."""
    out = _save_bert(path, **kw)
    capsys.readouterr()
    return out


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith("python -m experiments.finetune: error: "), err
    return err[0]


def test_embedding_impl_reaches_the_tensorized_embedding() -> None:
    """``--embedding-impl naive`` is the impl of the tensorized word embedding (it was
    recorded but the module kept ``optimized``)."""
    ap = cli.build_parser(EXPERIMENT)
    args = ap.parse_args(["--preset", "smoke", "--embedding-impl", "naive",
                          *(x for kv in SETS for x in ("--set", kv))])  # fmt: skip
    cfg = cli.resolve_config(EXPERIMENT, args, ap)
    task = build(cfg)[0]
    impls = {name: m.impl for name, m in task.model.named_modules()
             if isinstance(m, C.TTMEmbedding)}  # fmt: skip
    assert impls == {"bert.embeddings.word_embeddings": "naive"}


def test_a_model_with_another_label_count_is_one_line(tmp_path: Path, capsys) -> None:
    """A saved classifier whose head has 2 labels, for a 3-label run: one line naming
    ``--model`` and ``model.num_labels`` (transformers' load report silenced), no run
    dir. An encoder saved without a head loads, its fresh head named on stderr."""
    two = _saved(capsys, tmp_path / "two", labels=2)
    assert main(_argv(tmp_path, "r", "--model", two)) == 2
    line = _one_line(capsys)
    assert f"--model {two}" in line and "model.num_labels=3" in line
    assert "classifier.weight is (2, 32) there, (3, 32) here" in line
    assert "--set model.num_labels=2" not in line  # the data's 3 labels do not fit it
    assert not (tmp_path / "r").exists()
    five = _saved(capsys, tmp_path / "five", labels=5)  # the data's 3 labels fit its head
    assert main(_argv(tmp_path, "r", "--model", five)) == 2
    # the way a resume cannot take (num_labels may not change there) says it is a new run's
    assert (
        "--set model.num_labels=5 to keep the saved head (a new run; a resume keeps the "
        "run's own), or" in _one_line(capsys)
    )
    p = cli.set_field(preset("smoke"), "model.path", _saved(capsys, tmp_path / "enc", head=False))
    p = cli.set_field(p, "data.generated_train", 30)
    capsys.readouterr()
    model = load_model(p.model, load_mnli(p.data))
    assert model.config.num_labels == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "newly initialized" in err[0] and "classifier.weight" in err[0]


@pytest.mark.parametrize("dense", [False, True])
def test_a_model_whose_vocabulary_the_tokenizer_overruns_is_one_line(
    tmp_path: Path, dense: bool, capsys
) -> None:
    """Token ids at or past the model's ``vocab_size`` are refused in ``build``, naming
    ``--tokenizer`` and ``--model``, before training (they were an IndexError at step 1),
    CoMERA and ``--dense`` alike; labels past ``model.num_labels`` likewise."""
    small = _saved(capsys, tmp_path / "small", vocab=20)
    extra = ["--dense"] if dense else []
    assert main(_argv(tmp_path, "r", "--model", small, *extra)) == 2
    line = _one_line(capsys)
    assert "--tokenizer" in line and f"--model {small}" in line and "vocab_size 20" in line
    assert not (tmp_path / "r").exists()
    two = _saved(capsys, tmp_path / "two", labels=2)
    assert main(_argv(tmp_path, "l", "--model", two, "--set", "model.num_labels=2", *extra)) == 2
    line = _one_line(capsys)
    assert "model.num_labels=2" in line and "label ids up to 2" in line
    assert not (tmp_path / "l").exists()


def test_a_comera_run_with_nothing_tensorized_is_one_line(tmp_path: Path, capsys) -> None:
    """``--exclude '*'`` leaves CoMERA no TT layer: refused in ``build`` naming the globs,
    with no run dir (it was a traceback at step 1 that left config.json claiming the dir);
    ``--dense`` runs the same model."""
    assert main(_argv(tmp_path, "r", "--exclude", "*")) == 2
    line = _one_line(capsys)
    assert "error: --target, --exclude: every module the target globs" in line
    assert "is excluded by ['*']" in line
    assert not (tmp_path / "r").exists()
    # every match skipped for its size rather than excluded: the way on is the rank (it
    # said to name other modules with --target and --exclude)
    for flag, reason in [(["--set", "model.min_compression=1000"], "is not 1000x smaller"),
                         (["--rank", "1000", "--set", "model.embedding_rank=1000"],
                          "train is larger than the dense layer")]:  # fmt: skip
        assert main(_argv(tmp_path, "r", *flag)) == 2
        line = _one_line(capsys)
        assert "no module was tensorized" in line and reason in line
        assert "lower --rank (model.embedding_rank for embedding tables) or " in line
        assert "--target and --exclude" not in line.partition("to adapt")[2]
        assert "--dense" in line and not (tmp_path / "r").exists()


def test_a_glob_that_matches_nothing_names_its_flag(tmp_path: Path, capsys) -> None:
    """The default --target globs are BERT's names: on GPT-2 the error quoted 'query',
    which the user never typed, and named no flag."""
    path = tmp_path / "gpt2"
    tf.GPT2ForSequenceClassification(tf.GPT2Config(
        vocab_size=_generated_vocab(), n_embd=16, n_layer=1, n_head=2, n_positions=160,
        num_labels=3)).save_pretrained(path)  # fmt: skip
    capsys.readouterr()
    assert main(_argv(tmp_path, "r", "--model", str(path))) == 2
    line = _one_line(capsys)
    assert line.startswith("python -m experiments.finetune: error: --target (its default "
                           "query,key,value,dense,word_embeddings: BERT's names): target glob "
                           "'query' matches no")  # fmt: skip
    assert "transformer.h.0.attn.c_attn" in line and not (tmp_path / "r").exists()
    assert main(_argv(tmp_path, "r", "--exclude", "nothing")) == 2
    assert ": error: --exclude: exclude glob 'nothing' matches no" in _one_line(capsys)
    # spaces after the commas ('query, key') were read as part of the next glob
    assert main(_argv(tmp_path, "r", "--exclude", "query, nothing")) == 2
    assert ": error: --exclude: exclude glob 'nothing' matches no" in _one_line(capsys)


@pytest.mark.parametrize(
    ("extra", "text"),
    [
        (["--rank", "0"], "model.rank=0 (--rank) must be >= 1"),
        (["--set", "model.embedding_rank=0"], "model.embedding_rank=0 must be >= 1"),
        (["--set", "model.layers=6"], "model.layers=6 shapes the BERT built from a config"),
        (["--set", "model.dropout=0.3"], "drop model.dropout"),
        # at the built model's default value: taken without a word (the loaded model kept
        # its own dropout while config.json said 0.0)
        (["--set", "model.dropout=0.0"], "--set model.dropout=0.0: model.dropout shapes the"),
        (["--set", "model.layers=2"], "is loaded as saved (its own config decides it); drop"),
        (["--set", "model.num_labels=1"], "model.num_labels=1 must be >= 2"),
        # every table stayed dense, exit 0: one core is the table itself
        (["--set", "model.embedding_cores=1"], "model.embedding_cores=1 must be >= 2"),
        (["--set", "model.min_compression=inf"], "model.min_compression=inf must be finite"),
        # refused after tensorizing: the layer table printed first made it 18 lines
        (["--plan-for", "nothing.*=dp"], "'nothing.*'"),
    ],
)
def test_settings_a_run_cannot_use_are_one_line(tmp_path: Path, capsys, extra, text) -> None:
    """A rank below 1 names its flag before any data loads; the built BERT's settings
    beside --model (whose saved config decides them) are refused, not dropped."""
    model = _saved(capsys, tmp_path / "bert")
    with_model = extra[0] == "--set" and extra[1].startswith(("model.layers", "model.dropout"))
    argv = _argv(tmp_path, "r", *extra, *(["--model", model] if with_model else []))
    assert main(argv) == 2
    assert text in _one_line(capsys)
    assert not (tmp_path / "r").exists()


def test_a_layer_left_dense_keeps_its_parameters_in_the_record(tmp_path: Path, capsys) -> None:
    ap = cli.build_parser(EXPERIMENT)
    args = ap.parse_args(
        _argv(
            tmp_path,
            "r",
            "--set",
            "model.min_compression=1000",
            "--set",
            "train.comera.enabled=false",
        )
    )
    *_, info = build(cli.resolve_config(EXPERIMENT, args, ap))
    capsys.readouterr()
    skipped = [t for t in info["tensorized"] if t["note"].startswith("skipped")]
    assert skipped and all(t["params"][0] == t["params"][1] > 0 for t in skipped)
    notes = [t["note"] for t in info["tensorized"]]
    assert not any(n.startswith("padded padding_idx") for n in notes), notes


def test_a_gpt2_tokenizer_pads_with_its_end_token_and_gets_no_token_types(tmp_path: Path) -> None:
    """GPT-2's tokenizer has no pad token: rows are padded with <|endoftext|> (the
    attention mask marks them), and GPT-2, which has no token-type table, is given none."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from experiments.finetune.experiment import takes_token_types
    from experiments.mnli.data import prepare_tokenizer

    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1, "b": 2, "[UNK]": 3},
                                     unk_token="[UNK]"))  # fmt: skip
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.ByteLevel()
    assert prepare_tokenizer(tok, 6) == 0
    row = tok.encode("a b", "b")
    assert row.ids[:3] == [1, 2, 2] and row.ids[3:] == [0, 0, 0]
    assert row.attention_mask == [1, 1, 1, 0, 0, 0]
    gpt2 = tf.GPT2ForSequenceClassification(tf.GPT2Config(vocab_size=8, n_embd=16, n_layer=1,
                                                          n_head=2, n_positions=8))  # fmt: skip
    bert = tf.BertModel(tf.BertConfig(vocab_size=8, hidden_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=32))  # fmt: skip
    assert not takes_token_types(gpt2) and takes_token_types(bert)


def test_a_model_saved_with_another_pad_id_pools_the_last_token(tmp_path: Path, capsys) -> None:
    """A GPT-2 classifier saved with pad id 1 where the tokenizer pads with 0 pooled a pad
    position of every padded row, without a word: it takes the data's pad id, saying so.
    A RoBERTa numbers positions after its pad id: refused where the data's text holds it."""
    vocab = _generated_vocab()
    gpt2 = tmp_path / "gpt2"
    tf.GPT2ForSequenceClassification(tf.GPT2Config(
        vocab_size=vocab, n_embd=32, n_layer=1, n_head=4, n_positions=64, num_labels=3,
        pad_token_id=1)).save_pretrained(gpt2)  # fmt: skip
    p = EXPERIMENT.presets["smoke"]()
    for kv in [*SETS, f"model.path={gpt2}"]:
        p = cli.set_field(p, *kv.split("=", 1), text=True)
    data = load_mnli(p.data)
    assert data.pad_id == 0
    capsys.readouterr()
    model = load_model(p.model, data).eval()
    assert "pad_token_id 1 is not the id --tokenizer pads with (0)" in capsys.readouterr().err
    assert model.config.pad_token_id == 0
    rows = data.train.batch(torch.arange(4))
    mask = rows["attention_mask"]
    assert (mask == 0).any()  # padded rows: their pooled token must be the last real one
    with torch.no_grad():
        padded = model(input_ids=rows["input_ids"], attention_mask=mask).logits
        for i in range(4):
            n = int(mask[i].sum())
            alone = model(input_ids=rows["input_ids"][i : i + 1, :n]).logits
            torch.testing.assert_close(padded[i : i + 1], alone, rtol=1e-4, atol=1e-5)
    # a RoBERTa numbers positions after its pad id: harmless where the data's text never
    # holds that id (1 here: [UNK]), wrong where it does (a text token read as a pad)
    text_id = int(data.train.input_ids[0, 1])
    for pad, code in [(1, 0), (text_id, 2)]:
        roberta = tmp_path / f"roberta{pad}"
        tf.RobertaForSequenceClassification(tf.RobertaConfig(
            vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=160, num_labels=3,
            pad_token_id=pad)).save_pretrained(roberta)  # fmt: skip
        capsys.readouterr()
        run = f"r{pad}"
        assert main(_argv(tmp_path, run, "--model", str(roberta), "--dense")) == code
        if code:
            line = _one_line(capsys)
            assert f"numbers its positions after pad id {pad}" in line
            assert "gives as a text token (it pads with id 0)" in line
            assert not (tmp_path / run).exists()


def _generated_vocab() -> int:
    return build_generated_tokenizer().get_vocab_size(with_added_tokens=True)


def test_models_that_cannot_take_the_run_are_one_line(tmp_path: Path, capsys) -> None:
    """A folder saved from a tensorized model (its cores were dropped as unexpected keys
    and fresh weights compressed), and a model whose own input checks refuse the data
    (T5's classifier wants an end token the tokenizer never gives; a traceback at step 1):
    one line each, naming ``--model``, before the run dir is made."""
    path = tmp_path / "tt"
    bert = tf.BertForSequenceClassification(tf.BertConfig(
        vocab_size=_generated_vocab(), hidden_size=32, num_hidden_layers=1,
        num_attention_heads=4, intermediate_size=64, max_position_embeddings=160,
        num_labels=3))  # fmt: skip
    C.tensorize_(bert, C.TensorizeConfig(target_modules=("query",), rank=4, cores=2))
    bert.save_pretrained(path)
    capsys.readouterr()
    assert main(_argv(tmp_path, "r", "--model", str(path))) == 2
    line = _one_line(capsys)
    assert f"--model {path}: its checkpoint holds TT cores" in line and "--resume" in line
    assert not (tmp_path / "r").exists()
    t5 = tmp_path / "t5"
    vocab = _generated_vocab()
    tf.T5ForSequenceClassification(tf.T5Config(
        vocab_size=vocab, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
        eos_token_id=vocab - 1, pad_token_id=0, decoder_start_token_id=0, num_labels=3),
    ).save_pretrained(t5)  # fmt: skip
    capsys.readouterr()
    assert main(_argv(tmp_path, "r", "--model", str(t5), "--dense")) == 2
    line = _one_line(capsys)
    assert f"--model {t5} refused the first training rows (" in line and "--tokenizer" in line
    assert not (tmp_path / "r").exists()
    # a config without what its forward reads: the model's AttributeError, in one line
    tf.T5ForSequenceClassification(tf.T5Config(
        vocab_size=vocab, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
        eos_token_id=vocab - 1, pad_token_id=0, num_labels=3),
    ).save_pretrained(t5)  # fmt: skip
    capsys.readouterr()
    assert main(_argv(tmp_path, "r", "--model", str(t5), "--target", "q,v")) == 2
    line = _one_line(capsys)
    assert f"--model {t5} cannot run on the first training rows (AttributeError: " in line
    assert not (tmp_path / "r").exists()


def test_a_model_with_no_token_type_table_trains_on_pairs(tmp_path: Path, capsys) -> None:
    """DeBERTa-v3's configs have ``type_vocab_size`` 0: the model is given no token types,
    so the tokenizer's are not checked against that size (they refused every such model)."""
    path = tmp_path / "deberta"
    tf.DebertaV2ForSequenceClassification(tf.DebertaV2Config(
        vocab_size=_generated_vocab(), hidden_size=32, num_hidden_layers=1,
        num_attention_heads=4, intermediate_size=64, max_position_embeddings=160,
        type_vocab_size=0, num_labels=3)).save_pretrained(path)  # fmt: skip
    capsys.readouterr()
    assert main(_argv(tmp_path, "r", "--model", str(path), "--target", "query_proj")) == 0
    assert (tmp_path / "r" / "config.json").is_file()


def test_a_resume_that_changes_the_model_names_the_flag_typed(tmp_path: Path, capsys) -> None:
    """The resume refusal built each flag's name from its dest: it said ``drop
    --model-path`` for the ``--model`` flag, which does not exist. (``--model`` may now
    give a moved model folder on resume; ``--train-file``, dest ``train_file``, may not.)"""
    assert main(_argv(tmp_path, "run")) == 0
    capsys.readouterr()
    run = str(tmp_path / "run")
    assert main(["--resume", run, "--train-file", str(tmp_path / "other.jsonl")]) == 2
    line = _one_line(capsys)
    assert "drop --train-file (only" in line and "train_file" not in line.split("(only")[0]
    from experiments import cli  # the flag whose name is not its dest's: --model, model_path
    from experiments.finetune.experiment import EXPERIMENT

    assert cli._flag_of(cli.build_parser(EXPERIMENT), "model_path") == "--model"
    assert main(["--resume", run, "--model", str(tmp_path / "other")]) == 2  # no such folder
    line = _one_line(capsys)
    assert "--model" in line and "no such folder" in line and f"--resume {run} --model" in line


def test_a_resume_from_a_moved_folder_of_another_architecture_is_refused(
    tmp_path: Path, capsys
) -> None:
    """``--resume RUN --model NEW`` takes a moved model folder; one whose config computes
    another function with tensors of the same shapes (more heads, another activation)
    resumed without a word. The saved config is compared; a moved copy resumes."""
    import json
    import shutil

    first = _saved(capsys, tmp_path / "bert")
    assert main(_argv(tmp_path, "run", "--model", first)) == 0
    run = tmp_path / "run"
    saved = json.loads((run / "config.json").read_text())["model_config"]
    assert saved["num_attention_heads"] == 4 and "transformers_version" not in saved
    capsys.readouterr()
    moved, other = tmp_path / "moved", tmp_path / "other"
    shutil.copytree(first, moved)
    shutil.copytree(first, other)
    config = json.loads((other / "config.json").read_text())
    config.update(num_attention_heads=8, hidden_act="relu")
    (other / "config.json").write_text(json.dumps(config))
    assert main(["--resume", str(run), "--model", str(other)]) == 2
    line = _one_line(capsys)
    assert "model_config differs from the run's" in line
    assert "hidden_act: 'gelu' saved, 'relu' now; num_attention_heads: 4 saved, 8 now" in line
    assert "give --model a folder of the model the run was saved with" in line
    assert main(["--resume", str(run), "--model", str(moved)]) == 0
    assert "| layer | kind |" in capsys.readouterr().err  # printed once the run is taken


def test_a_model_run_gets_its_own_run_dir_not_the_smoke_runs(tmp_path: Path, capsys) -> None:
    """The page's own-model command, given no --run-dir, trained into runs/finetune-smoke:
    the smoke run was then refused there, and the report compared the two. A --model run
    is named after its folder unless --run-dir, --wandb-name or --set says otherwise."""
    ap = cli.build_parser(EXPERIMENT)

    def resolved(*argv: str) -> tuple[str, str]:
        cfg = cli.resolve_config(EXPERIMENT, ap.parse_args(list(argv)), ap)
        return cfg.train.run_dir, cfg.train.run_name

    assert resolved() == ("runs/finetune-smoke", "finetune-smoke")
    assert resolved("--model", "models/my-bert/") == ("runs/finetune-my-bert", "finetune-my-bert")
    assert resolved("--model", "org/bert", "--run-dir", "r", "--wandb-name", "n") == ("r", "n")
    assert resolved("--model", "org/bert", "--set", "train.run_dir=r")[0] == "r"
    # the dense partner gets a folder and name of its own, not the smoke run's name
    assert resolved("--model", "org/bert", "--dense") == (
        "runs/finetune-bert-dense", "finetune-bert-dense")  # fmt: skip
    # a --config file decides too (the defaults are the preset's, not overrides)
    conf = tmp_path / "c.toml"
    conf.write_text('[train]\nrun_dir = "runs/mine"\nrun_name = "mine"\n')
    assert resolved("--config", str(conf), "--model", "org/bert") == ("runs/mine", "mine")
    assert resolved("--config", str(conf), "--model", "org/bert", "--dense")[1] == "mine"
    # model.path given as a key names the run as --model does
    assert resolved("--set", "model.path=org/bert")[0] == "runs/finetune-bert"
    conf.write_text('[model]\npath = "org/bert2"\n')
    assert resolved("--config", str(conf))[0] == "runs/finetune-bert2"
    # and errors name only what was typed
    assert main(["--model", "org/bert", "--set", "train.steps=0"]) == 2
    line = _one_line(capsys)
    assert "--run-dir" not in line and "--wandb-name" not in line, line


def test_plan_rules_are_checked_only_where_a_tt_layer_is_left(tmp_path: Path, capsys) -> None:
    """A model that tensorizing left all dense has no layer for a plan rule to name: the
    command never checked rules there, and build's own check (made to keep its errors to
    one line) must not either."""
    argv = _argv(tmp_path, "r", "--set", "train.comera.enabled=false", "--set",
                 "model.min_compression=1e9", "--plan-for", "x*=dp")  # fmt: skip
    assert main(argv) == 0


def test_each_rank_evaluates_its_share_and_the_shares_add_up() -> None:
    """The finetune evaluation took the whole split on every rank; each now takes its
    contiguous share, and the shares' (sum, count) pairs add up to the whole split's."""
    import dataclasses

    p = preset("smoke")
    p = dataclasses.replace(p, batch_size=16, data=dataclasses.replace(
        p.data, generated_train=60, generated_eval=13))  # fmt: skip
    task, params, state, _, _ = build(p)
    whole = task.evaluate(params, state)
    parts = [task.evaluate(params, state, rank=r, world=3) for r in range(3)]
    assert [pp["validation/accuracy"][1] for pp in parts] == [4.0, 4.0, 5.0]
    for k, (s, n) in whole.items():
        assert sum(pp[k][1] for pp in parts) == n == 13.0
        assert sum(pp[k][0] for pp in parts) == pytest.approx(s, rel=1e-5)


def test_a_missing_tokenizer_path_no_hub_id_can_be_is_one_line(tmp_path: Path, monkeypatch,
                                                               capsys) -> None:  # fmt: skip
    """``--tokenizer models/x/nothere`` and ``a/b/c`` were sent to the hub, whose name
    check ended in a traceback; a name with a space too. The first two are local paths
    that do not exist (no hub id holds two slashes), the last neither kind: one line."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for name, said in (("models/x/nothere", "tokenizer file 'models/x/nothere' does not exist"),
                       ("a/b/c", "tokenizer file 'a/b/c' does not exist"),
                       ("a b", "it is neither a local path nor a hub name")):  # fmt: skip
        assert main(_argv(tmp_path, "r", "--tokenizer", name)) == 2
        assert said in _one_line(capsys)
    assert not (tmp_path / "r").exists()
    # org/name stays a hub id beside a local folder org/ (microsoft/codebert-base, the
    # codebert preset's tokenizer, was read as a missing local path)
    from loaders.text import looks_like_path

    assert not looks_like_path("models/nothere") and looks_like_path("models/x/nothere")
    (tmp_path / "models" / "there").mkdir()
    assert looks_like_path("models/there")
