"""Sources, document-count metadata, text + tokenizer, and every bad input."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loaders import (
    ArrowTokenFile,
    DatasetSpec,
    LoaderConfig,
    LoaderInputError,
    TokenFolder,
    TokenLoader,
    datasets_from_root,
)
from loaders.metadata import METADATA_NAME
from tests.loaders_helpers import body_tokens, config, expected_tokens, make_corpus, write_arrow


def test_arrow_file_slices_documents_without_copying(tmp_path):
    docs = [np.arange(n, dtype=np.int32) + 1000 for n in (5, 0, 3, 9, 1, 4, 2, 8)]
    write_arrow(tmp_path / "x.arrow", docs, rows_per_batch=3)
    f = ArrowTokenFile(tmp_path / "x.arrow")
    assert f.num_docs == 8
    for i, d in enumerate(docs):
        got = f.doc(i)
        assert np.array_equal(got, d)
        if len(d):
            assert not got.flags.owndata  # a view into the memory map


def test_a_compressed_file_is_said_once_per_folder(tmp_path):
    """A feather file (lz4 by default) is decompressed into memory on every open, where the
    docs promise memory maps: the folder says so once; uncompressed files say nothing."""
    import warnings

    import pyarrow.feather as fe

    table = pa.table({"tokens": pa.array([[1, 2, 3], [4, 5]] * 50, type=pa.list_(pa.int32()))})
    for name, how in (("packed", "lz4"), ("plain", "uncompressed")):
        (tmp_path / name).mkdir()
        for k in range(3):
            fe.write_feather(table, str(tmp_path / name / f"p{k}.feather"), compression=how)
    for name, said in (("packed", 1), ("plain", 0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            folder = TokenFolder(tmp_path / name)
            assert [folder.doc(i).tolist() for i in (0, 101, 299)] == [[1, 2, 3], [4, 5], [4, 5]]
        msgs = [str(w.message) for w in caught]
        assert len(msgs) == said, msgs
        assert all("is compressed" in m and "compression='uncompressed'" in m for m in msgs)
        assert ArrowTokenFile(tmp_path / name / "p0.feather").mapped is (said == 0)


def test_a_folder_of_many_files_keeps_them_open_under_a_global_shuffle(tmp_path, monkeypatch):
    """At most 128 files were kept open: a shuffled read of a folder of more re-opened a
    file for nearly every document (6x slower at 600 files). Now up to MAX_OPEN_FILES (an
    explicit ``max_open_files`` still bounds it), of them at most MAX_OPEN_UNMAPPED
    compressed ones, whose tokens sit in memory."""
    import pyarrow.feather as fe

    import loaders.sources as sources

    assert sources.MAX_OPEN_FILES >= 1024 and sources.MAX_OPEN_UNMAPPED == 128
    for k in range(150):
        write_arrow(tmp_path / "many" / f"p{k:03d}.arrow", [np.array([k, k], dtype=np.int32)])
    opened = []
    real = sources.open_arrow_mapped
    monkeypatch.setattr(sources, "open_arrow_mapped", lambda p: opened.append(p) or real(p))
    order = np.random.default_rng(0).permutation(150).tolist() * 2
    folder = TokenFolder(tmp_path / "many")  # counts each file's documents, opens the first
    opened.clear()
    assert [int(folder.doc(i)[0]) for i in order] == order
    assert len(opened) == 149  # each other file once: none closed and opened again
    small = TokenFolder(tmp_path / "many", max_open_files=100)
    opened.clear()
    for i in order:
        small.doc(i)
    assert len(opened) > 150
    # compressed files: their own smaller cap (here 4 of them), mapped ones unaffected
    monkeypatch.setattr(sources, "MAX_OPEN_UNMAPPED", 4)
    (tmp_path / "packed").mkdir()
    for k in range(6):
        fe.write_feather(pa.table({"tokens": pa.array([[k]], type=pa.list_(pa.int32()))}),
                         str(tmp_path / "packed" / f"p{k}.feather"), compression="lz4")  # fmt: skip
    with pytest.warns(UserWarning, match="is compressed"):
        packed = TokenFolder(tmp_path / "packed")
        for i in range(6):
            packed.doc(i)
    opened.clear()
    for i in (2, 3, 4, 5, 0, 1):  # 2..5 still open; 0 and 1 were closed for them
        assert packed.doc(i).tolist() == [i]
    assert [p.name for p in opened] == ["p0.feather", "p1.feather"]


def test_stream_format_and_int64_large_list(tmp_path):
    arr = pa.array([[1, 2, 3], [4], []], type=pa.large_list(pa.int64()))
    table = pa.table({"ids": arr})
    with (
        pa.OSFile(str(tmp_path / "s.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as w,
    ):
        w.write_table(table)
    f = ArrowTokenFile(tmp_path / "s.arrow", column="ids")
    assert [f.doc(i).tolist() for i in range(3)] == [[1, 2, 3], [4], []]


def test_a_null_row_is_empty_even_over_tokens(tmp_path):
    """Arrow lets a null row sit over a non-empty stretch of the values; its offsets alone
    made it a document of those tokens."""
    values = pa.array(np.arange(100, 109), pa.int32())
    offsets = pa.array([0, 3, 6, 9], pa.int32())
    arr = pa.ListArray.from_arrays(offsets, values, mask=pa.array([False, True, False]))
    table = pa.table({"tokens": arr})
    with (
        pa.OSFile(str(tmp_path / "n.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as w,
    ):
        w.write_table(table)
    f = ArrowTokenFile(tmp_path / "n.arrow")
    assert [f.doc(i).tolist() for i in range(3)] == [[100, 101, 102], [], [106, 107, 108]]


def test_doc_counts_metadata_written_then_used(tmp_path):
    make_corpus(tmp_path / "a", 41, files=4)
    folder = TokenFolder(tmp_path / "a")
    assert folder.num_docs == 41
    meta = json.loads((tmp_path / "a" / METADATA_NAME).read_text())
    assert (
        meta["format"] == "loaders.doc_counts"
        and sum(e["docs"] for e in meta["files"].values()) == 41
    )
    assert "sub1/part-001.arrow" in meta["files"]  # nested folders, relative paths
    # a hand-written metadata file without sizes is trusted (no file is opened to count)
    for e in meta["files"].values():
        del e["bytes"]
    (tmp_path / "a" / METADATA_NAME).write_text(json.dumps(meta))
    assert TokenFolder(tmp_path / "a").num_docs == 41


def test_stale_metadata_is_recounted_and_wrong_counts_are_caught(tmp_path):
    make_corpus(tmp_path / "a", 20, files=2)
    TokenFolder(tmp_path / "a")
    path = tmp_path / "a" / METADATA_NAME
    meta = json.loads(path.read_text())
    first = sorted(meta["files"])[0]
    meta["files"][first]["bytes"] += 1  # stale size: recount
    meta["files"][first]["docs"] += 5
    path.write_text(json.dumps(meta))
    assert TokenFolder(tmp_path / "a").num_docs == 20
    meta = json.loads(path.read_text())
    del meta["files"][first]["bytes"]
    meta["files"][first]["docs"] += 5  # a wrong hand-written count
    path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="has 10 rows but the doc-count metadata says 15"):
        TokenFolder(tmp_path / "a")


@pytest.mark.parametrize("docs", [0, -3, True, "10"])
def test_a_count_that_would_hide_a_file_is_recounted(tmp_path, docs):
    """A file listed with 0 (or a negative, or a non-integer) documents was never opened,
    so the count was never checked: its documents dropped out of the stream silently."""
    make_corpus(tmp_path / "a", 30, files=3)
    TokenFolder(tmp_path / "a")
    path = tmp_path / "a" / METADATA_NAME
    meta = json.loads(path.read_text())
    last = sorted(meta["files"])[-1]
    meta["files"][last]["docs"] = docs  # its size still right: only the count is wrong
    path.write_text(json.dumps(meta))
    assert TokenFolder(tmp_path / "a").num_docs == 30
    assert json.loads(path.read_text())["files"][last]["docs"] == 10  # written back


def test_unwritable_data_folder_uses_cache_dir(tmp_path, monkeypatch):
    """The doc counts cannot be written beside the data (a real OSError, which root gets
    too, unlike a read-only folder's: the metadata's name is taken by a folder): they go
    to ``cache_dir``, the data folder is left as it was, and the next open reads them."""
    make_corpus(tmp_path / "a", 10, files=1)
    (tmp_path / "a" / METADATA_NAME).mkdir()
    listing = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert TokenFolder(tmp_path / "a", cache_dir=tmp_path / "cache").num_docs == 10
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == listing  # no temp debris
    cached = list((tmp_path / "cache").glob(f"*{METADATA_NAME}"))
    assert len(cached) == 1 and '"docs": 10' in cached[0].read_text()
    monkeypatch.setattr("loaders.sources.count_arrow_docs", lambda p, c: pytest.fail("recount"))
    assert TokenFolder(tmp_path / "a", cache_dir=tmp_path / "cache").num_docs == 10


def test_cache_dir_metadata_is_read(tmp_path, monkeypatch):
    make_corpus(tmp_path / "a", 10, files=1)
    # simulate a read-only data folder: writing next to the data fails
    import loaders.metadata as md

    real = md.atomic_write_text

    def refuse(path, text, **kw):
        if path.parent == tmp_path / "a":
            raise PermissionError("read-only")
        return real(path, text, **kw)

    monkeypatch.setattr(md, "atomic_write_text", refuse)
    assert TokenFolder(tmp_path / "a", cache_dir=tmp_path / "cache").num_docs == 10
    assert not (tmp_path / "a" / METADATA_NAME).exists()
    cached = list((tmp_path / "cache").glob(f"*{METADATA_NAME}"))
    assert len(cached) == 1
    calls = []
    monkeypatch.setattr("loaders.sources.count_arrow_docs", lambda p, c: calls.append(p) or 0)
    assert TokenFolder(tmp_path / "a", cache_dir=tmp_path / "cache").num_docs == 10
    assert calls == []  # counts came from the cache


def _tokenizer_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    words = ["[UNK]"] + [f"w{i}" for i in range(50)]
    model = tokenizers.models.WordLevel(
        {w: i + 1000 for i, w in enumerate(words)}, unk_token="[UNK]"
    )
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow", "datasets"])
def test_text_sources_tokenized_on_the_fly(tmp_path, kind):
    tok_path = _tokenizer_file(tmp_path)
    texts = [" ".join(f"w{(i * 7 + j) % 50}" for j in range(i % 13)) for i in range(37)]
    folder = tmp_path / "text"
    folder.mkdir()
    table = pa.table({"text": texts})
    if kind == "jsonl":
        (folder / "x.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        data = folder
    elif kind == "parquet":
        pq.write_table(table, folder / "x.parquet")
        data = folder
    elif kind == "arrow":
        with pa.OSFile(str(folder / "x.arrow"), "wb") as s, pa.ipc.new_file(s, table.schema) as w:
            w.write_table(table)
        data = folder / "x.arrow"
    else:
        datasets = pytest.importorskip("datasets")
        data = datasets.Dataset.from_dict({"text": texts}).shuffle(seed=0).select(range(37))
    spec = DatasetSpec(name="t", path=data, tokenizer=str(tok_path.parent))
    cfg = LoaderConfig(
        datasets=[spec], seq_len=16, batch_size=2, bos_id=1, eos_id=2, num_shards=5, num_epochs=1
    )
    got = body_tokens(list(TokenLoader(cfg)))
    expected = [1000 + 1 + int(w[1:]) for t in texts for w in t.split()]
    assert sorted(got.tolist()) == sorted(expected)


@pytest.mark.parametrize(
    "ids", [np.array([2**31 + 5, 7], np.int64), [2**31 + 5, 7], [1.7, 2.2], [-3, 4], [10**30]]
)
def test_a_tokenizer_giving_no_token_ids_is_refused(ids):
    """Ids were cast to int32 blindly: 2**31 + 5 became negative, 1.7 became 1, and a
    plain list with a large id was a bare OverflowError."""
    from loaders.errors import LoaderInputError
    from loaders.text import TextSource

    source = TextSource(pa.table({"text": ["a b"]}), tokenizer=lambda text: ids)
    with pytest.raises(LoaderInputError, match="document 0 ids that are not token ids"):
        source.doc(0)
    assert TextSource(pa.table({"text": ["a"]}), tokenizer=lambda t: [3, 4]).doc(0).tolist() == [
        3,
        4,
    ]


# -- bad input -------------------------------------------------------------------------


def test_truncated_arrow_file_names_the_file(tmp_path):
    make_corpus(tmp_path / "a", 30, files=1)
    path = next((tmp_path / "a").rglob("*.arrow"))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    (tmp_path / "a" / METADATA_NAME).unlink(missing_ok=True)
    with pytest.raises(ValueError, match=f"{path.name}.*truncated or corrupt"):
        TokenFolder(tmp_path / "a")


def test_corrupt_arrow_file_names_the_file(tmp_path):
    make_corpus(tmp_path / "a", 30, files=1)
    path = next((tmp_path / "a").rglob("*.arrow"))
    path.write_bytes(b"this is not arrow at all" * 10)
    with pytest.raises(ValueError, match=f"{path.name}.*truncated or corrupt"):
        TokenFolder(tmp_path / "a")


def test_missing_token_column(tmp_path):
    write_arrow(tmp_path / "a" / "x.arrow", [np.arange(3)], column="input_ids")
    with pytest.raises(ValueError, match="no token column 'tokens'.*input_ids.*token_column"):
        TokenLoader(config([("a", tmp_path / "a", 1.0)]))
    cfg = config([("a", tmp_path / "a", 1.0)])
    cfg.datasets[0].token_column = "input_ids"
    assert TokenLoader(cfg).fingerprint["docs"] == {"a": 1}


def test_non_integer_tokens(tmp_path):
    table = pa.table({"tokens": pa.array([[1.5, 2.0]], type=pa.list_(pa.float32()))})
    (tmp_path / "a").mkdir()
    with (
        pa.OSFile(str(tmp_path / "a" / "x.arrow"), "wb") as s,
        pa.ipc.new_file(s, table.schema) as w,
    ):
        w.write_table(table)
    with pytest.raises(ValueError, match="x.arrow has type list<item: float>.*list of integers"):
        TokenLoader(config([("a", tmp_path / "a", 1.0)]))


def test_empty_folder_and_missing_path(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty holds no Arrow files"):
        TokenLoader(config([("e", tmp_path / "empty", 1.0)]))
    with pytest.raises(FileNotFoundError, match="nope does not exist"):
        TokenLoader(config([("e", tmp_path / "nope", 1.0)]))


def test_unknown_weight_and_bad_config(tmp_path):
    make_corpus(tmp_path / "a", 10)
    ld = TokenLoader(config([("a", tmp_path / "a", 1.0)]))
    with pytest.raises(
        ValueError, match="unknown sub-datasets \\['b'\\].*known sub-datasets: \\['a'\\]"
    ):
        ld.set_weights({"b": 0.5})
    with pytest.raises(ValueError, match="unknown sub-datasets \\['zz'\\]; folders are \\['a'\\]"):
        datasets_from_root(tmp_path, {"zz": 0.5})
    assert [d.name for d in datasets_from_root(tmp_path, {"a": 0.5})] == ["a"]
    with pytest.raises(ValueError, match="duplicate names"):
        config([("a", tmp_path / "a", 1.0), ("a", tmp_path / "a", 1.0)])
    with pytest.raises(ValueError, match="shuffle='random'"):
        config([("a", tmp_path / "a", 1.0)], shuffle="random")
    with pytest.raises(ValueError, match="weight must be a finite number >= 0"):
        DatasetSpec(name="x", path=tmp_path, weight=-1)
    with pytest.raises(ValueError, match="36 readers but only num_shards=35"):
        TokenLoader(config([("a", tmp_path / "a", 1.0)]), rank=0, world_size=12, num_workers=3)


def test_state_from_incompatible_config(tmp_path):
    make_corpus(tmp_path / "a", 40)
    make_corpus(tmp_path / "b", 41)
    ld = TokenLoader(config([("a", tmp_path / "a", 1.0)]))
    next(ld)
    state = ld.state_dict()
    with pytest.raises(ValueError, match="num_shards=35 but the config has 36"):
        TokenLoader(config([("a", tmp_path / "a", 1.0)], num_shards=36)).load_state_dict(state)
    with pytest.raises(ValueError, match="'a' had 40 documents when saved but has 41 now"):
        TokenLoader(config([("a", tmp_path / "b", 1.0)])).load_state_dict(state)
    with pytest.raises(ValueError, match="sub-dataset 'a' that the config lacks"):
        TokenLoader(config([("b", tmp_path / "b", 1.0)])).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=0 but the config has 1"):
        TokenLoader(config([("a", tmp_path / "a", 1.0)], seed=1)).load_state_dict(state)
    with pytest.raises(ValueError, match="not a loader state"):
        ld.load_state_dict({"hello": 1})


def test_zero_length_and_short_documents_are_skipped_without_hanging(tmp_path):
    docs = make_corpus(tmp_path / "a", 61, zero_every=3, max_len=9)
    cfg = config([("a", tmp_path / "a", 1.0)], num_epochs=2, min_doc_len=4)
    got = np.sort(body_tokens(list(TokenLoader(cfg))))
    kept = {g: d for g, d in docs.items() if len(d) >= 4}
    assert np.array_equal(got, expected_tokens(kept, 2))
    # a sub-dataset with only empty documents: infinite mode must not hang, the other one streams
    write_arrow(tmp_path / "z" / "x.arrow", [np.zeros(0, dtype=np.int32)] * 50)
    cfg = config([("a", tmp_path / "a", 0.5), ("z", tmp_path / "z", 0.5)])
    batches = [next(iter(ld)) for ld in [TokenLoader(cfg)] for _ in range(5)]
    assert len(body_tokens(batches)) > 0
    # nothing to stream at all: refused when built (on every rank), not a silent empty stream
    with pytest.raises(LoaderInputError, match="no sub-dataset .* min_doc_len=1"):
        TokenLoader(config([("z", tmp_path / "z", 1.0)]))
    with pytest.raises(LoaderInputError, match="would yield no batch"):  # finite too
        TokenLoader(config([("z", tmp_path / "z", 1.0)], num_epochs=1))


def test_tokens_digest_is_of_the_documents_not_the_files(tmp_path) -> None:
    """The same documents split into other files, batches or integer types digest alike;
    a token moved across a document boundary, or a null row read as empty, digest as the
    documents they are."""
    from loaders.sources import tokens_digest

    docs = [np.arange(k, dtype=np.int64) + 10 * k for k in range(1, 9)]
    write_arrow(tmp_path / "one.arrow", docs, rows_per_batch=3)
    write_arrow(tmp_path / "a.arrow", docs[:5], rows_per_batch=2)
    wide = pa.array([d.tolist() for d in docs[5:]], type=pa.list_(pa.int64()))
    with (
        pa.OSFile(str(tmp_path / "b.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, pa.schema([("tokens", wide.type)])) as w,
    ):
        w.write_table(pa.table({"tokens": wide}))
    whole = tokens_digest([tmp_path / "one.arrow"])
    assert tokens_digest([tmp_path / "a.arrow", tmp_path / "b.arrow"]) == whole
    moved = [*docs[:2], np.concatenate([docs[2], docs[3][:1]]), docs[3][1:], *docs[4:]]
    write_arrow(tmp_path / "moved.arrow", moved)
    assert tokens_digest([tmp_path / "moved.arrow"]) != whole
    nulls = pa.array([[1, 2], None, [3]], type=pa.list_(pa.int32()))
    empty = [np.array([1, 2]), np.array([], dtype=np.int64), np.array([3])]
    with (
        pa.OSFile(str(tmp_path / "n.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, pa.schema([("tokens", nulls.type)])) as w,
    ):
        w.write_table(pa.table({"tokens": nulls}))
    write_arrow(tmp_path / "e.arrow", empty)
    assert tokens_digest([tmp_path / "n.arrow"]) == tokens_digest([tmp_path / "e.arrow"])


def test_a_link_to_nothing_in_a_folder_is_named(tmp_path):
    """A corpus copied without a link's target failed counting documents with a bare
    FileNotFoundError traceback; token and text folders alike name the link."""
    make_corpus(tmp_path / "corpus", 10)
    (tmp_path / "corpus" / "gone.arrow").symlink_to(tmp_path / "missing.arrow")
    with pytest.raises(LoaderInputError, match=r"gone.arrow is a link to .*missing.arrow, which"):
        TokenFolder(tmp_path / "corpus")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.jsonl").write_text('{"text": "w1 w2"}\n')
    (tmp_path / "text" / "b.jsonl").symlink_to(tmp_path / "missing.jsonl")
    spec = DatasetSpec(name="t", path=tmp_path / "text", tokenizer=str(_tokenizer_file(tmp_path)))
    with pytest.raises(LoaderInputError, match=r"b.jsonl is a link to .*missing.jsonl, which"):
        TokenLoader(LoaderConfig(datasets=[spec], seq_len=4, num_shards=2))


def test_text_given_where_token_files_belong_says_so(tmp_path):
    """A .jsonl or .parquet file as a token source without a tokenizer was "truncated or
    corrupt ...; re-write or remove the file": advice to delete good data."""
    (tmp_path / "rows.jsonl").write_text('{"text": "w1 w2"}\n')
    pq.write_table(pa.table({"text": ["w1"]}), tmp_path / "rows.parquet")
    for name in ("rows.jsonl", "rows.parquet"):
        suffix = name.split(".")[1]
        with pytest.raises(LoaderInputError, match=f"{name} is a .{suffix} file, not an Arrow"):
            TokenFolder(tmp_path / name)


@pytest.mark.parametrize("data", [["w1 w2", "w3"], {"train": None}, 5])
def test_text_data_of_an_unread_type_is_named(tmp_path, data):  # noqa: ANN001
    """A list, a DatasetDict or an IterableDataset as text failed with an AttributeError
    ("'list' object has no attribute 'data'")."""
    spec = DatasetSpec(name="t", path=data, tokenizer=str(_tokenizer_file(tmp_path)))
    with pytest.raises(LoaderInputError, match=f"text data of type {type(data).__name__}: give"):
        TokenLoader(LoaderConfig(datasets=[spec], seq_len=4, num_shards=2))


def test_saving_where_a_file_is_in_the_way_is_one_error(tmp_path):
    """``save`` to a file's path (or a folder under one) raised FileExistsError or
    NotADirectoryError from mkdir; loading the same path already said what was wrong."""
    make_corpus(tmp_path / "c", 10)
    loader = TokenLoader(config([("c", tmp_path / "c", 1.0)]))
    (tmp_path / "f").write_text("x")
    for where in (tmp_path / "f", tmp_path / "f" / "sub"):
        with pytest.raises(LoaderInputError, match="a file is in the way; give a folder path"):
            loader.save(where)
    assert (tmp_path / "f").read_text() == "x"
    assert loader.save(tmp_path / "ok").is_file()  # and the count of saves goes on


def test_a_json_array_and_a_stray_json_file_are_named_as_such(tmp_path):
    """A .json holding an array said only "Column() changed from object to array", and a
    dataset_info.json beside .jsonl data advised text_column=description, which would
    break the data files."""
    tok = str(_tokenizer_file(tmp_path))
    (tmp_path / "arr").mkdir()
    (tmp_path / "arr" / "rows.json").write_text(json.dumps([{"text": "w1"}, {"text": "w2"}]))
    spec = DatasetSpec(name="t", path=tmp_path / "arr", tokenizer=tok)
    with pytest.raises(LoaderInputError, match="rows.json is unreadable .*read as JSON Lines"):
        TokenLoader(LoaderConfig(datasets=[spec], seq_len=4, num_shards=2))
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text('{"text": "w1 w2"}\n')
    (tmp_path / "mixed" / "dataset_info.json").write_text('{"description": "x"}\n')
    spec = DatasetSpec(name="t", path=tmp_path / "mixed", tokenizer=tok)
    with pytest.raises(LoaderInputError, match="dataset_info.json has no text column 'text'") as e:
        TokenLoader(LoaderConfig(datasets=[spec], seq_len=4, num_shards=2))
    assert "other files of" in str(e.value) and "move that file out" in str(e.value)
    assert "text_column=" not in str(e.value)
    (tmp_path / "mixed" / "dataset_info.json").unlink()
    assert TokenLoader(LoaderConfig(datasets=[spec], seq_len=4, num_shards=2)).sources
