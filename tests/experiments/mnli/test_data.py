"""MNLI data: encoding layout, local files, errors, hub-offline message, batching, generated task.

Everything here is local and fast: the data is the generated task or tiny files the tests
write; the hub tests force offline mode so they fail at once instead of waiting on the network.
"""

import json

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch

from comera.errors import CheckpointError, ConfigError, DataError
from experiments.mnli import data as md
from experiments.mnli import generated as mg
from experiments.mnli.batches import BatchIterator, EncodedSplit, eval_batches
from experiments.mnli.data import MNLIDataConfig, load_mnli

L = 32


def _tok(max_length: int = L):
    tok = mg.build_generated_tokenizer()
    return tok, md.prepare_tokenizer(tok, max_length)


def _split(n: int) -> EncodedSplit:
    """A split whose input_ids[i, 0] == i, so batches reveal which examples they hold."""
    ids = torch.arange(n, dtype=torch.int32)[:, None].expand(n, 4).contiguous()
    return EncodedSplit(
        ids,
        torch.zeros(n, 4, dtype=torch.int8),
        torch.ones(n, 4, dtype=torch.bool),
        torch.arange(n) % 3,
    )


def _rows(batch: dict) -> list[int]:
    return batch["input_ids"][:, 0].tolist()


def _write(path, rows: list[dict]) -> str:
    table = pa.Table.from_pylist(rows)
    if path.suffix == ".parquet":
        pq.write_table(table, path)
    elif path.suffix == ".csv":
        pcsv.write_csv(table, path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [
    {"premise": "baba bade", "hypothesis": "baba", "label": 0},
    {"premise": "bada babe badi", "hypothesis": "bobo", "label": 1},
    {"premise": "babi bado", "hypothesis": "not babi", "label": 2},
]


# ---------------------------------------------------------------- encoding


def test_encode_layout_cls_sep_types_and_padding():
    tok, pad = _tok()
    enc = md.encode_pairs(tok, ["baba bade badi", "babe"], ["bado", "not babe babi"], [0, 2])
    v = tok.get_vocab()
    assert enc.input_ids.shape == enc.token_type_ids.shape == enc.attention_mask.shape == (2, L)
    assert pad == v["[PAD]"] == 0
    # row 0: [CLS] baba bade badi [SEP] bado [SEP] [PAD]...
    words = ["[CLS]", "baba", "bade", "badi", "[SEP]", "bado", "[SEP]"]
    assert enc.input_ids[0, :7].tolist() == [v[w] for w in words]
    assert enc.token_type_ids[0, :7].tolist() == [0, 0, 0, 0, 0, 1, 1]
    assert enc.attention_mask[0].tolist() == [True] * 7 + [False] * (L - 7)
    assert (enc.input_ids[0, 7:] == pad).all() and (enc.token_type_ids[0, 7:] == 0).all()
    assert enc.input_ids[1, :7].tolist() == [
        v[w] for w in ["[CLS]", "babe", "[SEP]", "not", "babe", "babi", "[SEP]"]
    ]
    assert enc.labels.tolist() == [0, 2] and enc.labels.dtype == torch.int64
    batch = next(eval_batches(enc, 2))
    assert batch["input_ids"].dtype == batch["token_type_ids"].dtype == torch.int64


def test_prepare_tokenizer_adds_bert_template_when_missing():
    tok = mg.build_generated_tokenizer()
    tok.post_processor = None
    md.prepare_tokenizer(tok, 12)
    enc = md.encode_pairs(tok, ["baba"], ["bade"], [0])
    assert enc.input_ids[0, :5].tolist() == [
        2,
        tok.token_to_id("baba"),
        3,
        tok.token_to_id("bade"),
        3,
    ]
    assert enc.token_type_ids[0, :5].tolist() == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="prepare_tokenizer"):
        md.encode_pairs(mg.build_generated_tokenizer(), ["a"], ["b"], [0])


def test_truncation_longest_first_keeps_both_segments_and_final_sep():
    tok, _ = _tok(max_length=10)
    enc = md.encode_pairs(tok, [" ".join(mg.GENERATED_WORDS[:20])], ["baba bade"], [1])
    sep = tok.token_to_id("[SEP]")
    assert enc.attention_mask.all() and enc.input_ids[0, -1] == sep
    assert enc.token_type_ids[0].tolist() == [0] * 7 + [1] * 3  # premise cut, hypothesis kept


# ---------------------------------------------------------------- local files and generated


@pytest.fixture(scope="module")
def gen_files(tmp_path_factory):
    return mg.write_generated_files(tmp_path_factory.mktemp("gen"), 60, 30, seed=3)


def test_generated_and_local_files_give_the_same_tensors(gen_files):
    train, val, tok_path = gen_files
    gen = load_mnli(
        MNLIDataConfig(
            dataset="generated", generated_train=60, generated_eval=30, seed=3, max_length=L
        )
    )
    for tok in (str(tok_path), str(tok_path.parent)):  # file or directory
        local = load_mnli(
            MNLIDataConfig(
                train_file=str(train),
                eval_files={"validation": str(val)},
                tokenizer=tok,
                max_length=L,
            )
        )
        assert list(local.eval) == list(gen.eval) == ["validation"]
        for a, b in ((local.train, gen.train), (local.eval["validation"], gen.eval["validation"])):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
            assert torch.equal(a.token_type_ids, b.token_type_ids)
        assert local.vocab_size == gen.vocab_size == 5 + 1 + 150 and local.pad_id == 0
        assert local.num_labels == 3 and local.tokenizer_path_or_name == tok
    assert len(gen.train) == 60 and gen.train.input_ids.shape[1] == L


def test_a_train_file_without_eval_files_says_nothing_is_evaluated(gen_files):
    """--train-file alone drops every eval split (local files replace the hub's as a
    whole): the run trained and reported no held-out score without a word."""
    train, val, tok = gen_files
    data = load_mnli(MNLIDataConfig(train_file=str(train), tokenizer=str(tok), max_length=L))
    assert data.eval == {}
    assert "no eval split is given (--eval-file NAME=PATH" in data.unevaluated_note()
    cfg = MNLIDataConfig(train_file=str(train), eval_files={"v": str(val)}, tokenizer=str(tok),
                         max_length=L)  # fmt: skip
    assert load_mnli(cfg).unevaluated_note() is None


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv", ".json"])
@pytest.mark.parametrize("renamed", [False, True])
def test_local_formats_with_default_and_renamed_columns(tmp_path, gen_files, suffix, renamed):
    names = {"premise": "sentence1", "hypothesis": "sentence2", "label": "gold"}
    rows = [{names[k] if renamed else k: v for k, v in r.items()} for r in ROWS]
    path = tmp_path / f"d{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        _write(path, rows)
    kw = (
        {"premise_column": "sentence1", "hypothesis_column": "sentence2", "label_column": "gold"}
        if renamed
        else {}
    )
    data = load_mnli(
        MNLIDataConfig(
            train_file=str(path),
            eval_files={"dev": str(path)},
            tokenizer=str(gen_files[2]),
            max_length=16,
            **kw,
        )
    )
    assert data.train.labels.tolist() == [0, 1, 2] and list(data.eval) == ["dev"]
    assert data.train.input_ids.shape == (3, 16)
    assert data.train.attention_mask.sum(1).tolist() == [6, 7, 7]


def test_missing_column_error_names_file_column_present_and_field(tmp_path, gen_files):
    path = _write(tmp_path / "t.jsonl", [{"sentence1": "a", "hypothesis": "b", "label": 0}])
    with pytest.raises(ValueError) as err:
        load_mnli(MNLIDataConfig(train_file=path, tokenizer=str(gen_files[2])))
    msg = str(err.value)
    assert "t.jsonl" in msg and "'premise'" in msg and "sentence1" in msg
    assert "premise_column" in msg


def test_bad_label_error_names_file_and_value(tmp_path, gen_files):
    path = _write(tmp_path / "bad.csv", [*ROWS, {"premise": "a", "hypothesis": "b", "label": -2}])
    with pytest.raises(ValueError, match=r"bad\.csv.*label -2 .*row 3"):
        load_mnli(MNLIDataConfig(train_file=path, tokenizer=str(gen_files[2])))


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_labels_past_three_classes_are_read_for_a_larger_head(tmp_path, gen_files, suffix):
    """Labels were 0/1/2 only, so a five-class file could not be fine-tuned at all; any
    class id is read now, and a head too small for them is refused naming num_labels. A
    label column with a float (1.0: pandas' writing of an int column with gaps) is read."""
    from comera.errors import ConfigError

    rows = [*ROWS, {"premise": "a", "hypothesis": "b", "label": 4}]
    path = _write(tmp_path / f"five{suffix}", rows)
    data = load_mnli(MNLIDataConfig(train_file=path, tokenizer=str(gen_files[2])))
    assert data.train.labels.tolist() == [0, 1, 2, 4]
    with pytest.raises(ConfigError, match=r"label ids up to 4 \(train\) .*num_labels=5"):
        data.check_label_count(3)
    data.check_label_count(5)
    # only an eval file holds the id past the head: named, as the data to check
    dev = _write(tmp_path / f"dev{suffix}", [{"premise": "a", "hypothesis": "b", "label": 3}])
    train = _write(tmp_path / f"t{suffix}", ROWS)
    cfg = MNLIDataConfig(train_file=train, eval_files={"dev": dev}, tokenizer=str(gen_files[2]))
    data = load_mnli(cfg)
    with pytest.raises(ConfigError, match=r"up to 3 \(eval split 'dev'\) but model.num_lab"):
        data.check_label_count(3)
    floats = _write(tmp_path / "f.jsonl", [{**r, "label": float(r["label"])} for r in ROWS])
    data = load_mnli(MNLIDataConfig(train_file=floats, tokenizer=str(gen_files[2])))
    assert data.train.labels.tolist() == [0, 1, 2]


def test_label_minus_one_dropped_and_said(tmp_path, gen_files, capsys):
    """Dropped rows are said on stderr (a log record no handler printed was all before)."""
    path = _write(tmp_path / "t.jsonl", [*ROWS, {"premise": "a", "hypothesis": "b", "label": -1}])
    data = load_mnli(
        MNLIDataConfig(
            train_file=path, eval_files={"v": path}, tokenizer=str(gen_files[2]),
            max_eval_examples=2,
        )
    )  # fmt: skip
    assert data.train.labels.tolist() == [0, 1, 2] and len(data.eval["v"]) == 2
    assert "note: " + path + ": dropped 1 of 4 rows labelled -1 or '-'" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])  # a CSV's empty field is ""
def test_a_missing_sentence_is_read_as_empty_and_said(tmp_path, gen_files, capsys, suffix):
    """A null premise or hypothesis trains as an empty sentence: said on stderr, as dropped
    rows are (before, nothing told a user that a column was half empty)."""
    rows = [*ROWS, {"premise": None, "hypothesis": "b", "label": 0}]
    path = _write(tmp_path / f"t{suffix}", rows)
    data = load_mnli(MNLIDataConfig(train_file=path, eval_files={"v": path},
                                    tokenizer=str(gen_files[2])))  # fmt: skip
    assert len(data.train) == 4
    err = capsys.readouterr().err
    assert f"note: {path}: 1 of 4 rows have no 'premise' (null or empty): read as empty" in err
    assert "'hypothesis'" not in err


@pytest.mark.parametrize("suffix", [".csv", ".tsv"])
def test_csv_sentences_are_read_as_written(tmp_path, gen_files, capsys, suffix):
    """Arrow's type guessing turned a premise "007" into 7, "1.50" into 1.5 and a date
    into a date, silently; an empty cell (Arrow reads it as "", not null) was no note."""
    sep = "," if suffix == ".csv" else "\t"
    lines = ["premise", "hypothesis", "label"], ["007", "1.50", "0"], ["2024-01-02", "true", "1"]
    lines = [*lines, ["", "b", "2"]]
    path = tmp_path / f"t{suffix}"
    path.write_text("".join(sep.join(r) + "\n" for r in lines))
    cfg = MNLIDataConfig(train_file=str(path), tokenizer=str(gen_files[2]))
    table = md._read_table(str(path), (cfg.premise_column, cfg.hypothesis_column))
    premises, hypotheses, labels = md._columns(table, str(path), cfg)
    assert premises == ["007", "2024-01-02", ""] and hypotheses == ["1.50", "true", "b"]
    assert labels.tolist() == [0, 1, 2]
    assert "1 of 3 rows have no 'premise' (null or empty): read as empty" in capsys.readouterr().err


def test_a_header_not_utf8_or_a_huge_label_is_one_error(tmp_path, gen_files):
    """A Latin-1 header (an unused column "catégorie") was a UnicodeDecodeError traceback,
    and a label past int64 (an id column named by --label-column) an OverflowError."""
    latin = tmp_path / "latin.csv"
    latin.write_bytes("premise,hypothesis,label,cat\xe9gorie\na,b,0,x\n".encode("latin-1"))
    with pytest.raises(DataError, match="its header is not UTF-8 text; save the file as UTF-8"):
        load_mnli(MNLIDataConfig(train_file=str(latin), tokenizer=str(gen_files[2])))
    for suffix, label in ((".csv", "99999999999999999999"), (".jsonl", 1e20)):
        path = tmp_path / f"big{suffix}"
        if suffix == ".csv":
            path.write_text(f"premise,hypothesis,label\na,b,{label}\n")
        else:
            path.write_text(json.dumps({"premise": "a", "hypothesis": "b", "label": label}))
        with pytest.raises(DataError, match=r"label .* is not a class id"):
            load_mnli(MNLIDataConfig(train_file=str(path), tokenizer=str(gen_files[2])))
    # an empty cell was "label None"
    (tmp_path / "empty.jsonl").write_text('{"premise": "a", "hypothesis": "b", "label": null}\n')
    with pytest.raises(DataError, match=r"empty.jsonl: an empty label in column 'label'"):
        load_mnli(MNLIDataConfig(train_file=str(tmp_path / "empty.jsonl"),
                                 tokenizer=str(gen_files[2])))  # fmt: skip


def test_an_eval_split_without_a_name_is_refused(tmp_path):
    """--eval-file =PATH was refused, but the same through --set or --config trained and
    logged eval//accuracy."""
    with pytest.raises(ConfigError, match="give every eval split a name"):
        MNLIDataConfig(train_file=str(tmp_path / "t.jsonl"), eval_files={"": "x.jsonl"})


def test_glue_tsv_files_are_read_as_glue_writes_them(tmp_path, gen_files):
    """GLUE's MNLI files are tab-separated with quotes as text: .tsv was refused."""
    lines = ["index\tsentence1\tsentence2\tgold_label",
             '0\tbaba "bade\tbaba\tentailment',  # an unmatched quote is text
             '1\tbada babe\t"bobo"\tneutral',
             "2\tbabi bado\tnot babi\tcontradiction"]  # fmt: skip
    path = tmp_path / "dev_matched.tsv"
    path.write_text("\n".join(lines) + "\n")
    cols = {"premise_column": "sentence1", "hypothesis_column": "sentence2",
            "label_column": "gold_label"}  # fmt: skip
    data = load_mnli(MNLIDataConfig(train_file=str(path), tokenizer=str(gen_files[2]), **cols))
    assert data.train.labels.tolist() == [0, 1, 2]
    table = md._read_table(str(path))
    assert table.column("sentence1")[0].as_py() == 'baba "bade'
    assert table.column("sentence2")[1].as_py() == '"bobo"'


def test_label_names_accepted(tmp_path, gen_files):
    rows = [dict(r, label=md.LABEL_NAMES[r["label"]]) for r in ROWS]
    # MultiNLI's own files mark examples without annotator consensus "-": unlabelled
    rows.append({"premise": "a", "hypothesis": "b", "label": "-"})
    path = _write(tmp_path / "n.jsonl", rows)
    data = load_mnli(MNLIDataConfig(train_file=path, tokenizer=str(gen_files[2])))
    assert data.train.labels.tolist() == [0, 1, 2] and data.eval == {}


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"max_length": 4}, "max_length"),
        ({"max_train_examples": 0}, "max_train_examples"),
        ({"eval_files": {"v": "x.jsonl"}}, "eval_files"),
        ({"train_file": "t.jsonl", "eval_files": {"train": "x.jsonl"}}, "eval_files"),
        ({"train_file": "x.txt"}, "train_file"),
        ({"dataset": "generated", "train_file": "x.jsonl"}, "train_file"),
        ({"premise_column": ""}, "premise_column"),
        # the labels read as a sentence, or one sentence twice: trained without a word
        ({"premise_column": "label"}, "premise_column"),
        ({"hypothesis_column": "premise"}, "premise_column"),
        ({"generated_vocab": 10}, "generated_vocab"),
    ],
)
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"MNLIDataConfig.{field}="):
        MNLIDataConfig(**kw)


def test_missing_local_tokenizer_file():
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        md.load_tokenizer("/nonexistent/dir/tokenizer.json")


# ---------------------------------------------------------------- hub offline


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Force HF offline mode in every test (no test may touch the network), also in modules
    that read the variables at import time."""
    import datasets.config
    import huggingface_hub.constants

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


def _assert_offline_message(msg: str, what: str) -> None:
    assert "could not reach the hugging face hub" in msg.lower() and what in msg
    for option in ("--train-file", "--eval-file", "--dataset generated", "--tokenizer"):
        assert option in msg
    # and the keys they set, for a command without them (experiments.ablate has none)
    for key in ("data.train_file=PATH", "'data.eval_files=", "data.tokenizer=PATH",
                "data.dataset=generated"):  # fmt: skip
        assert f"--set {key}" in msg


def test_hub_dataset_unreachable_error(offline, gen_files):
    name = "comera-tests-not-cached/mnli-absent"  # never in any cache
    with pytest.raises(md.HubUnreachableError) as err:
        load_mnli(MNLIDataConfig(dataset=name, tokenizer=str(gen_files[2])))
    assert isinstance(err.value, RuntimeError)
    _assert_offline_message(str(err.value), name)


def test_hub_tokenizer_unreachable_error(offline):
    name = "comera-tests-not-cached/tokenizer-absent"
    with pytest.raises(md.HubUnreachableError) as err:
        load_mnli(MNLIDataConfig(dataset="generated", tokenizer=name))
    _assert_offline_message(str(err.value), name)


def test_hub_path_with_a_stubbed_load_dataset(monkeypatch, gen_files):
    """The hub code path on an in-memory GLUE-shaped DatasetDict (test split labels are -1)."""
    import datasets

    calls = []
    rows = {k: [r[k] for r in ROWS] for k in ROWS[0]}
    unlabelled = dict(rows, label=[-1, -1, -1])
    dsd = datasets.DatasetDict(
        train=datasets.Dataset.from_dict(rows),
        validation_matched=datasets.Dataset.from_dict(rows),
        validation_mismatched=datasets.Dataset.from_dict(rows).select([2, 0]),
        test_matched=datasets.Dataset.from_dict(unlabelled),
    )
    monkeypatch.setattr(datasets, "load_dataset", lambda *a: calls.append(a) or dsd)
    data = load_mnli(MNLIDataConfig(tokenizer=str(gen_files[2]), max_length=16))
    assert calls == [("nyu-mll/glue", "mnli")]
    assert sorted(data.eval) == ["validation_matched", "validation_mismatched"]
    assert data.eval["validation_mismatched"].labels.tolist() == [2, 0]
    assert data.train.labels.tolist() == [0, 1, 2]


# ---------------------------------------------------------------- batching


def test_a_batch_the_world_does_not_divide_names_both_ways_out():
    """A resume keeps its batch size, so "round it" alone was advice --resume refuses."""
    with pytest.raises(ConfigError, match=r"batch_size=128 .* world_size=3; round it to a "
                       r"multiple \(--set batch_size=...\), or run on a number of processes "
                       r"that divides it"):  # fmt: skip
        BatchIterator(_split(300), 128, rank=0, world_size=3)


def test_epoch_visits_each_example_at_most_once_and_reshuffles():
    it = BatchIterator(_split(103), 10, seed=5)
    assert it.steps_per_epoch == 10
    e0 = [i for b in it.epoch_batches() for i in _rows(b)]
    assert len(e0) == len(set(e0)) == 100 and it.state_dict()["epoch"] == 1
    e1 = [i for b in it.epoch_batches() for i in _rows(b)]
    assert e1 != e0 and len(set(e1)) == 100
    g = torch.Generator().manual_seed(5)
    assert e0 == torch.randperm(103, generator=g)[:100].tolist()
    it = BatchIterator(_split(103), 10, seed=5, shuffle=False, drop_last=False)
    rows = [_rows(b) for b in it.epoch_batches()]
    assert it.steps_per_epoch == 11 and sum(rows, []) == list(range(103)) and len(rows[-1]) == 3


def test_a_resume_on_other_examples_of_the_same_count_is_refused():
    """Only the example count was checked: a --train-file changed in place, same row
    count, resumed silently on other data. The position now holds a digest."""
    it = BatchIterator(_split(23), 4, seed=1)
    next(it)
    state = json.loads(json.dumps(it.state_dict()))
    again = BatchIterator(_split(23), 4, seed=1)  # the same examples, built anew: resumes
    again.load_state_dict(state)
    assert again.state_dict() == state
    other = _split(23)
    other.labels[5] = (other.labels[5] + 1) % 3
    with pytest.raises(DataError, match="trained on other data"):
        BatchIterator(other, 4, seed=1).load_state_dict(state)
    old = {k: v for k, v in state.items() if k != "data_id"}  # saved before the digest
    BatchIterator(other, 4, seed=1).load_state_dict(old)


def test_a_changed_row_outside_the_sampled_ones_is_refused_and_old_digests_resume():
    """The digest hashed 4,096 evenly spaced rows: a file of more rows whose labels
    changed elsewhere resumed and trained on the new labels, without a word."""
    import numpy as np

    n = 4096 + 1000  # sample_digest's rows, and more
    it = BatchIterator(_split(n), 4, seed=1)
    next(it)
    state = json.loads(json.dumps(it.state_dict()))
    other = _split(n)
    sampled = set(np.unique(np.linspace(0, n - 1, 4096).astype(int)).tolist())
    row = next(i for i in range(n) if i not in sampled)
    other.labels[row] = (other.labels[row] + 1) % 3
    with pytest.raises(DataError, match="trained on other data"):
        BatchIterator(other, 4, seed=1).load_state_dict(state)
    # a checkpoint saved with the sampled digest still resumes on the same rows
    legacy = {**state, "data_id": _split(n).identity()}
    BatchIterator(_split(n), 4, seed=1).load_state_dict(legacy)


def test_resume_at_every_step_continues_identically():
    split, total = _split(23), 14  # 5 steps per epoch: crosses two epoch boundaries
    ref_it = BatchIterator(split, 4, seed=1)
    ref, states = [], []
    for _ in range(total):
        states.append(ref_it.state_dict())
        ref.append(_rows(next(ref_it)))
    for k, state in enumerate(states):
        state = json.loads(json.dumps(state))  # JSON round trip, as in a checkpoint
        it = BatchIterator(split, 4, seed=1)
        it.load_state_dict(state)
        assert [_rows(next(it)) for _ in range(total - k)] == ref[k:], k


def test_ranks_union_equals_single_process_batch_and_rescale_resume():
    split = _split(50)
    single = BatchIterator(split, 8, seed=2)
    ranks = [BatchIterator(split, 8, seed=2, rank=r, world_size=2) for r in range(2)]
    for _ in range(9):  # crosses an epoch boundary (6 steps per epoch)
        parts = [_rows(next(it)) for it in ranks]
        assert len(parts[0]) == len(parts[1]) == 4
        assert parts[0] + parts[1] == _rows(next(single))
    four = [BatchIterator(split, 8, seed=2, rank=r, world_size=4) for r in range(4)]
    for it in four:  # resume a 2-rank run on 4 ranks: same global stream
        it.load_state_dict(ranks[0].state_dict())
    assert sum((_rows(next(it)) for it in four), []) == _rows(next(single))


def test_state_mismatch_and_argument_errors():
    it = BatchIterator(_split(20), 4, seed=0)
    for key, value in (("n", 21), ("seed", 9), ("batch_size", 2)):
        with pytest.raises(ValueError, match=f"{key}={value}"):
            it.load_state_dict({**it.state_dict(), key: value})
    with pytest.raises(ValueError, match="out of range"):
        it.load_state_dict({**it.state_dict(), "batch_in_epoch": 5})
    # a damaged saved position is a damaged checkpoint, not a KeyError or int() traceback
    state = it.state_dict()
    for bad, what in (({}, "lacks epoch, batch_in_epoch"), ("x", "is a str, not a dict"),
                      ({**state, "epoch": "a"}, "non-integer epoch"),
                      ({**state, "seed": True}, "non-integer seed"),
                      ({**state, "data_id": 3}, "non-string data_id")):  # fmt: skip
        with pytest.raises(CheckpointError, match=f"saved position .*{what}.*damaged"):
            it.load_state_dict(bad)
    with pytest.raises(ValueError, match="multiple of world_size=4"):
        BatchIterator(_split(20), 6, world_size=4)
    with pytest.raises(ValueError, match="smaller than batch_size"):
        BatchIterator(_split(3), 4)


def test_eval_batches_in_order_without_dropping():
    sizes = [len(b["labels"]) for b in eval_batches(_split(10), 4)]
    assert sizes == [4, 4, 2]
    assert sum((_rows(b) for b in eval_batches(_split(10), 4)), []) == list(range(10))


# The generated task itself (rules, balance, cue baselines, files): test_mnli_generated.py


def test_splits_left_empty_and_boolean_labels_are_refused(tmp_path, gen_files):
    """An eval split with no labelled example scored loss 0 and accuracy 0 as if measured;
    a JSON ``true`` passed as label 1. Both are refused, naming the file."""
    tok = str(gen_files[2])
    train = _write(tmp_path / "t.jsonl", ROWS)
    dev = _write(tmp_path / "dev.jsonl", [dict(r, label=-1) for r in ROWS])
    with pytest.raises(DataError, match=r"dev\.jsonl \(v\) holds no labelled example .* 3 rows"):
        load_mnli(MNLIDataConfig(train_file=train, eval_files={"v": dev}, tokenizer=tok))
    (tmp_path / "empty.jsonl").write_text("")  # not "missing column, columns present: []"
    with pytest.raises(DataError, match=r"empty\.jsonl is empty"):
        load_mnli(MNLIDataConfig(train_file=str(tmp_path / "empty.jsonl"), tokenizer=tok))
    flag = _write(tmp_path / "b.jsonl", [{"premise": "a", "hypothesis": "b", "label": True}])
    with pytest.raises(DataError, match=r"label True"):
        load_mnli(MNLIDataConfig(train_file=flag, tokenizer=tok))


def test_a_dataset_without_the_config_names_the_field(monkeypatch, gen_files):
    """A local dataset folder (or another hub dataset) has no ``mnli`` config: one line
    naming ``data.dataset_config``, not datasets' bare ValueError."""
    import datasets

    def load(name, config):
        raise ValueError(f"BuilderConfig '{config}' not found. Available: ['default']")

    monkeypatch.setattr(datasets, "load_dataset", load)
    with pytest.raises(DataError, match=r"no config 'mnli' .*Available: \['default'\].*"
                                        r"data\.dataset_config"):  # fmt: skip
        load_mnli(MNLIDataConfig(dataset="/data/nli", tokenizer=str(gen_files[2])))


def test_rows_that_are_not_text_or_labels_are_named(tmp_path, gen_files, capsys):
    """Bytes are UTF-8 text (a latin-1 CSV was read as bytes and trained on "b'...'");
    bytes that are not UTF-8, lists and mappings are refused naming the row; a label
    ``int()`` refuses is the usual label error (a traceback before); JSON rows that mix
    kinds in a column, or lack a key in the first row, are read; a duplicated column and a
    tokenizer that cannot encode a row are one line each; truncation is said."""
    tok = str(gen_files[2])

    def jsonl(name: str, rows: list[dict]) -> str:
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)

    raw = pa.table({"premise": pa.array([b"a b", b"c"]), "hypothesis": ["d", "e"],
                    "label": [0, 1]})  # fmt: skip
    pq.write_table(raw, tmp_path / "bin.parquet")
    data = load_mnli(MNLIDataConfig(train_file=str(tmp_path / "bin.parquet"), tokenizer=tok))
    assert len(data.train) == 2
    bad = pa.table({"premise": pa.array([b"a", b"\xe9t\xe9"]), "hypothesis": ["d", "e"],
                    "label": [0, 1]})  # fmt: skip
    pq.write_table(bad, tmp_path / "latin.parquet")
    with pytest.raises(DataError, match=r"column 'premise' \(row 1\) is not UTF-8 text"):
        load_mnli(MNLIDataConfig(train_file=str(tmp_path / "latin.parquet"), tokenizer=tok))
    cases = [
        ([{"premise": ["a"], "hypothesis": "b", "label": 0}], r"\(row 0\) holds a list"),
        (
            [
                {"premise": "a", "hypothesis": "b", "label": 0},
                {"premise": ["a"], "hypothesis": "b", "label": 0},
            ],
            r"column 'premise' \(row 1\) holds a list among scalars",
        ),
        ([{"premise": "a", "hypothesis": "b", "label": "--1"}], r"label '--1' in column"),
    ]
    for rows, why in cases:
        path = jsonl("c.jsonl", rows)
        with pytest.raises(DataError, match=why):
            load_mnli(MNLIDataConfig(train_file=path, tokenizer=tok))
    mixed = [{"premise": "a", "label": 0}, {"premise": 12, "hypothesis": "b", "label": "1"}]
    data = load_mnli(MNLIDataConfig(train_file=jsonl("m.jsonl", mixed), tokenizer=tok))
    assert data.train.labels.tolist() == [0, 1]
    (tmp_path / "dup.csv").write_text("premise,hypothesis,label,premise\na,b,0,x\n")
    with pytest.raises(DataError, match="column 'premise' appears 2 times"):
        load_mnli(MNLIDataConfig(train_file=str(tmp_path / "dup.csv"), tokenizer=tok))
    capsys.readouterr()
    long = [{"premise": "a " * 300, "hypothesis": "b", "label": 0}]
    load_mnli(MNLIDataConfig(train_file=jsonl("l.jsonl", long), tokenizer=tok, max_length=16))
    assert "truncated 1 of 1 pairs to data.max_length=16 tokens" in capsys.readouterr().err


def test_a_bom_a_long_field_and_a_bad_line_are_read_or_named(tmp_path, gen_files):
    """A BOM in JSON was refused (read in CSV); a CSV field longer than Arrow's 1 MiB
    block was refused; a JSONL error named line 1 (its position within the line)."""
    tok = str(gen_files[2])
    row = {"premise": "a b", "hypothesis": "c", "label": 0}
    (tmp_path / "bom.jsonl").write_text("\ufeff" + json.dumps(row) + "\n", encoding="utf-8")
    data = load_mnli(MNLIDataConfig(train_file=str(tmp_path / "bom.jsonl"), tokenizer=tok))
    assert len(data.train) == 1
    (tmp_path / "long.csv").write_text("premise,hypothesis,label\n" + "a " * 700_000 + ",c,0\n")
    data = load_mnli(MNLIDataConfig(train_file=str(tmp_path / "long.csv"), tokenizer=tok))
    assert len(data.train) == 1
    odd = {"premise": "a\u2028b", "hypothesis": "c", "label": 1}  # one line of JSON
    (tmp_path / "sep.jsonl").write_text(json.dumps(odd, ensure_ascii=False) + "\n")
    data = load_mnli(MNLIDataConfig(train_file=str(tmp_path / "sep.jsonl"), tokenizer=tok))
    assert len(data.train) == 1
    lines = [json.dumps(row)] * 4 + ['{"premise": "x", ']
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"\(ValueError: line 5: Expecting property name"):
        load_mnli(MNLIDataConfig(train_file=str(tmp_path / "bad.jsonl"), tokenizer=tok))


def test_a_template_longer_than_max_length_is_one_error(tmp_path, gen_files):
    """A pair template with more special tokens than max_length leaves room for: the
    tokenizers library gave up truncating, and the encoded rows did not fit their array
    (a ValueError traceback)."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(gen_files[2]))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] " * 8 + "$A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])  # fmt: skip
    tok.save(str(tmp_path / "many.json"))
    rows = [{"premise": "a b c d e f", "hypothesis": "a b c d e", "label": 0}]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"made a pair of \d+ tokens where data.max_length=8"):
        load_mnli(MNLIDataConfig(train_file=str(tmp_path / "t.jsonl"), max_length=8,
                                 tokenizer=str(tmp_path / "many.json")))  # fmt: skip


def test_a_tokenizer_with_gaps_in_its_ids_or_an_unnamed_split_is_refused(tmp_path, capsys):
    """Ids past the tokenizer's own vocabulary size (a vocabulary with gaps) are refused
    before training (an IndexError at the first dense lookup); an eval split named ''
    (metrics under eval//accuracy) too."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from experiments.mnli.experiment import _parse_eval_files, check_fits_data
    from experiments.transformer import EncoderConfig

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "a": 4, "b": 40}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "gaps.json"))
    rows = [{"premise": "a b", "hypothesis": "a", "label": 0}]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_mnli(MNLIDataConfig(train_file=str(tmp_path / "t.jsonl"),
                                    tokenizer=str(tmp_path / "gaps.json")))  # fmt: skip
    with pytest.raises(DataError, match="gives token ids up to 40, past its own vocabulary of 6"):
        check_fits_data(EncoderConfig(vocab_size=data.vocab_size), data)
    with pytest.raises(ConfigError, match="give the split a name"):
        _parse_eval_files([f"={tmp_path / 't.jsonl'}"])


def test_an_eval_digest_covers_every_row() -> None:
    """The train digest samples 4,096 rows; an eval split's digest (what a resume checks)
    hashed only those, so most single-row edits to MNLI's 9,815-row dev split went unseen."""
    from experiments.mnli.batches import EncodedSplit

    n = 9815
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (n, 8), generator=g, dtype=torch.int32)
    labels = torch.randint(0, 3, (n,), generator=g)
    types, mask = torch.zeros(n, 8, dtype=torch.int8), torch.ones(n, 8, dtype=torch.bool)
    split = EncodedSplit(ids, types, mask, labels)
    edited = EncodedSplit(ids, split.token_type_ids, split.attention_mask, labels.clone())
    edited.labels[1] = (edited.labels[1] + 1) % 3  # row 1: not among the 4,096 sampled
    assert split.identity() == edited.identity()  # the train digest: sampled, by design
    assert split.identity(every_row=True) != edited.identity(every_row=True)


def test_a_parquet_class_label_is_read_by_its_names(tmp_path, gen_files):
    """A parquet written by datasets after class_encode_column holds contradiction=0,
    entailment=1, neutral=2 (names sorted), as its metadata says; its ids were read as
    entailment=0, neutral=1, contradiction=2 beside an eval file of words, silently."""
    datasets = pytest.importorskip("datasets")
    words = ["entailment", "neutral", "contradiction", "neutral"]
    ds = datasets.Dataset.from_dict(
        {"premise": ["baba bade"] * 4, "hypothesis": ["baba"] * 4, "label": words}
    ).class_encode_column("label")
    assert ds.features["label"].names == ["contradiction", "entailment", "neutral"]
    ds.to_parquet(str(tmp_path / "cl.parquet"))
    data = load_mnli(MNLIDataConfig(train_file=str(tmp_path / "cl.parquet"),
                                    tokenizer=str(gen_files[2])))  # fmt: skip
    assert data.train.labels.tolist() == [0, 1, 2, 1]  # entailment, neutral, contradiction
    # other class names: the ids are the classes (a sentiment task's 0/1)
    other = datasets.Dataset.from_dict(
        {"premise": ["baba"] * 2, "hypothesis": ["bade"] * 2, "label": ["pos", "neg"]}
    ).class_encode_column("label")
    other.to_parquet(str(tmp_path / "other.parquet"))
    data = load_mnli(MNLIDataConfig(train_file=str(tmp_path / "other.parquet"),
                                    tokenizer=str(gen_files[2])))  # fmt: skip
    assert data.train.labels.tolist() == [1, 0]  # neg=0, pos=1, as the file numbers them


def test_a_folder_utf16_quoted_tsv_and_a_pairless_tokenizer_are_named(tmp_path, gen_files):
    """A parquet dataset's folder was said not to exist; a UTF-16 CSV (Excel's "Unicode
    text") failed as 'Expected 3 columns, got 1'; a quoted TSV field holding a tab failed
    without saying .tsv takes no quoting; a tokenizer with no [CLS]/[SEP] named neither
    itself nor --tokenizer."""
    tok = str(gen_files[2])
    (tmp_path / "dirp.parquet").mkdir()
    with pytest.raises(DataError, match=r"dirp.parquet' is a folder; give one file"):
        load_mnli(MNLIDataConfig(train_file=str(tmp_path / "dirp.parquet"), tokenizer=tok))
    (tmp_path / "u16.csv").write_text("premise,hypothesis,label\na,b,0\n", encoding="utf-16")
    with pytest.raises(DataError, match=r"u16.csv' is UTF-16 text; save it as UTF-8"):
        load_mnli(MNLIDataConfig(train_file=str(tmp_path / "u16.csv"), tokenizer=tok))
    (tmp_path / "q.tsv").write_text('premise\thypothesis\tlabel\n"baba\tbade"\tbaba\t0\n')
    with pytest.raises(DataError, match=r"no quoting; save a file whose fields hold tabs as"):
        load_mnli(MNLIDataConfig(train_file=str(tmp_path / "q.tsv"), tokenizer=tok))
    tokenizers = pytest.importorskip("tokenizers")
    bare = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[PAD]": 0, "[UNK]": 1, "baba": 2},
                                                            unk_token="[UNK]"))  # fmt: skip
    bare.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    bare.save(str(tmp_path / "bare.json"))
    rows = _write(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(DataError, match=r"--tokenizer .*bare.json: the tokenizer has no "
                                        r"post-processor .*\(data.tokenizer\)"):  # fmt: skip
        load_mnli(MNLIDataConfig(train_file=rows, tokenizer=str(tmp_path / "bare.json")))
