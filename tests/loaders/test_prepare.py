"""``python -m loaders.prepare``: text -> token shards the loader reads, resumable."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from loaders import DatasetSpec, LoaderConfig, TokenLoader, datasets_from_root
from loaders.prepare import PrepareError, main, prepare
from loaders.sources import ArrowTokenFile
from tests.loaders_helpers import BOS, EOS, PAD


def _corpus(root: Path, n: int = 40) -> dict[str, str]:
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "x", "(", ")", ":", "\n"]
    texts = {}
    for i in range(n):
        text = " ".join(rng.choice(words, size=int(rng.integers(5, 60)))) + f"\n# file {i} é\n"
        path = root / f"pkg{i % 3}" / f"mod{i:03d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        texts[str(path)] = text
    (root / "README.txt").write_text("not matched by the glob")
    return texts


def _docs(folder: Path) -> list[np.ndarray]:
    files = sorted(folder.glob("part-*.arrow"))
    return [f.doc(i) for f in map(ArrowTokenFile, files) for i in range(f.num_docs)]


def test_folder_to_shards_round_trips_and_loads(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    texts = _corpus(tmp_path / "src")
    out = tmp_path / "out"
    summary = prepare([str(tmp_path / "src")], out, train_vocab=300, glob="**/*.py",
                      heldout=0.25, docs_per_shard=7, progress=False)  # fmt: skip
    train, held = summary["splits"]["train"]["docs"], summary["splits"]["heldout"]["docs"]
    assert train + held == 40 and 0 < held < 20
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in ("<s>", "<pad>", "</s>", "<unk>", "<mask>")] == [
        0, 1, 2, 3, 4
    ]  # fmt: skip
    plan = json.loads((out / "train" / "doc_counts.json").read_text())
    assert sum(e["docs"] for e in plan["files"].values()) == train
    # every document decodes back to its file, exactly (byte-level BPE)
    decoded = {tok.decode(d.tolist()) for split in ("train", "heldout") for d in _docs(out / split)}
    assert decoded == set(texts.values())
    cfg = LoaderConfig(datasets=[DatasetSpec(name="py", path=str(out / "train"))], seq_len=32,
                       batch_size=2, bos_id=BOS, eos_id=EOS, pad_id=PAD, num_shards=4)  # fmt: skip
    batch = next(iter(TokenLoader(cfg, rank=0, world_size=1)))
    assert batch["input_ids"].shape[0] == 2


def test_a_tokenizer_never_adds_its_own_specials(tmp_path: Path) -> None:
    """The loader adds BOS/EOS itself; a RoBERTa-style tokenizer.json whose post-processor
    wraps every text in <s> ... </s> must not add them a second time."""
    from tokenizers import Tokenizer, processors

    from loaders.prepare import train_tokenizer
    from loaders.text import load_tokenizer

    path = train_tokenizer(iter(["def f(x): return x\n"] * 20), 300, tmp_path / "tok.json")
    tok = Tokenizer.from_file(str(path))
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tok.save(str(path))
    assert tok.encode("return x").ids[0] == 0  # the tokenizer itself would add them
    ids = load_tokenizer(str(path))("return x")
    assert ids and 0 not in ids and 2 not in ids


def test_max_doc_tokens_cuts_long_documents_into_pieces(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    texts = _corpus(tmp_path / "src", n=12)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    prepare([str(tmp_path / "src")], whole, train_vocab=300, glob="**/*.py", progress=False)
    tok = str(whole / "tokenizer.json")
    summary = prepare([str(tmp_path / "src")], cut, tokenizer=tok, glob="**/*.py",
                      max_doc_tokens=16, docs_per_shard=5, progress=False)  # fmt: skip
    docs, pieces = _docs(whole / "train"), _docs(cut / "train")
    assert len(docs) == 12 and max(map(len, pieces)) == 16
    assert summary["splits"]["train"]["docs"] == len(pieces) == sum(-(-len(d) // 16) for d in docs)
    counts = json.loads((cut / "train" / "doc_counts.json").read_text())["files"]
    assert sum(e["docs"] for e in counts.values()) == len(pieces)
    assert np.array_equal(np.concatenate(pieces), np.concatenate(docs))  # same order, no loss
    decoded = Tokenizer.from_file(tok).decode(np.concatenate(pieces).tolist())
    assert all(t in decoded for t in texts.values())
    assert main([str(tmp_path / "src"), "--out", str(cut), "--tokenizer", tok, "--glob",
                 "**/*.py", "--max-doc-tokens", "0", "--no-progress"]) == 2  # fmt: skip


def test_rerun_finishes_a_crashed_run_and_refuses_other_settings(tmp_path: Path) -> None:
    _corpus(tmp_path / "src")
    out = tmp_path / "out"
    kw = dict(train_vocab=300, glob="**/*.py", docs_per_shard=6, progress=False)
    prepare([str(tmp_path / "src")], out, **kw)
    shards = sorted((out / "train").glob("part-*.arrow"))
    before = {p.name: p.read_bytes() for p in shards}
    stamps = {p.name: p.stat().st_mtime_ns for p in shards}
    shards[2].unlink()  # as if the run died before this shard was renamed into place
    (out / "train" / f".{shards[2].name}.tmp-12345").write_bytes(b"half")
    prepare([str(tmp_path / "src")], out, **kw)
    assert shards[2].read_bytes() == before[shards[2].name]
    assert all(p.stat().st_mtime_ns == stamps[p.name] for p in shards if p != shards[2])
    with pytest.raises(PrepareError, match=r"other settings \(.*: docs_per_shard differ\)"):
        prepare([str(tmp_path / "src")], out, **{**kw, "docs_per_shard": 5})
    # a damaged plan (a crash while it was written by hand, a bad edit) is named, not a
    # JSONDecodeError with exit status 1; an --out that is a file likewise
    (out / "prepare_plan.json").write_text("{bad")
    with pytest.raises(PrepareError, match="prepare_plan.json is unreadable"):
        prepare([str(tmp_path / "src")], out, **kw)
    (tmp_path / "file").write_text("x")
    with pytest.raises(PrepareError, match="is a file; give a folder"):
        prepare([str(tmp_path / "src")], tmp_path / "file", **kw)
    # shards beside no plan (one removed by hand): nothing says they are this run's, and
    # existing shards are kept as they are (others' documents, lost or twice)
    (out / "prepare_plan.json").unlink()
    with pytest.raises(PrepareError, match="holds train, tokenizer.json but no prepare_plan"):
        prepare([str(tmp_path / "src")], out, **kw)
    assert shards[0].read_bytes() == before[shards[0].name]  # nothing lost by the refusal
    # sources edited since: the old shards (and tokenizer) would be served as they were
    shutil.rmtree(out)
    prepare([str(tmp_path / "src")], out, **kw)  # the plan again, with the sources' digest
    plan_mode = (out / "prepare_plan.json").stat().st_mode & 0o777
    mask = os.umask(0)
    os.umask(mask)
    assert plan_mode == 0o666 & ~mask  # readable by the folder's other readers (was 0600)
    assert (out / "train" / "doc_counts.json").stat().st_mode & 0o777 == 0o666 & ~mask
    # a trained tokenizer replaced: the missing shards would be another tokenization's
    (out / "train" / "part-00001.arrow").unlink()
    trained = (out / "tokenizer.json").read_text()
    (out / "tokenizer.json").write_text(trained.replace('"unk_token":', '"unk_token" :'))
    with pytest.raises(PrepareError, match="tokenizer.json is not the tokenizer .* prepared"):
        prepare([str(tmp_path / "src")], out, **kw)
    (out / "tokenizer.json").write_text(trained)
    prepare([str(tmp_path / "src")], out, **kw)  # as trained: the shard is made again
    first = sorted((tmp_path / "src").rglob("*.py"))[0]
    first.write_text(first.read_text() + "\nx = 1\n")
    with pytest.raises(PrepareError, match="other versions of these files"):
        prepare([str(tmp_path / "src")], out, **kw)
    # a tokenizer file replaced at the same path: the missing shards would be tokenized
    # by the new one beside the old one's
    tok = tmp_path / "tok.json"
    shutil.copy(out / "tokenizer.json", tok)
    given = {**kw, "train_vocab": None, "tokenizer": str(tok)}
    prepare([str(tmp_path / "src")], tmp_path / "given", **given)
    (tmp_path / "given" / "train" / "part-00001.arrow").unlink()
    tok.write_text(tok.read_text().replace('"unk_token":', '"unk_token" :'))
    with pytest.raises(PrepareError, match="another version of the tokenizer .*tok.json"):
        prepare([str(tmp_path / "src")], tmp_path / "given", **given)


def test_a_damaged_shard_or_a_file_name_not_utf8_is_no_traceback(tmp_path: Path) -> None:
    """A shard truncated on disk was an ArrowInvalid traceback at the next run; a file
    whose name is not UTF-8 was a UnicodeEncodeError in the held-out hash."""
    _corpus(tmp_path / "src")
    odd = os.fsencode(tmp_path / "src") + b"/caf\xe9.py"
    with open(odd, "wb") as f:
        f.write(b"x = 1\n")
    out = tmp_path / "out"
    kw = dict(train_vocab=300, glob="**/*.py", docs_per_shard=6, heldout=0.2, progress=False)
    summary = prepare([str(tmp_path / "src")], out, **kw)
    assert sum(s["docs"] for s in summary["splits"].values()) == 41
    shard, other = sorted((out / "train").glob("part-*.arrow"))[:2]
    os.truncate(shard, 100)
    with pytest.raises(PrepareError, match=r"part-00000.arrow is damaged .*delete it"):
        prepare([str(tmp_path / "src")], out, **kw)
    shard.unlink()  # rewritten; then a damaged footer (an OSError with no errno)
    data = bytearray(other.read_bytes())
    data[-60:-10] = bytes(50)
    other.write_bytes(bytes(data))
    with pytest.raises(PrepareError, match=r"part-00001.arrow is damaged"):
        prepare([str(tmp_path / "src")], out, **kw)


def test_parallel_equals_serial_and_table_sources(tmp_path: Path) -> None:
    texts = _corpus(tmp_path / "src")
    kw = dict(train_vocab=300, glob="**/*.py", docs_per_shard=5, progress=False)
    prepare([str(tmp_path / "src")], tmp_path / "one", workers=1, **kw)
    prepare([str(tmp_path / "src")], tmp_path / "two", workers=2, **kw)
    one, two = (sorted((tmp_path / d / "train").glob("part-*")) for d in ("one", "two"))
    assert [p.read_bytes() for p in one] == [p.read_bytes() for p in two]
    jsonl = tmp_path / "funcs.jsonl"
    jsonl.write_text("".join(json.dumps({"code": t, "id": i}) + "\n"
                             for i, t in enumerate(texts.values())))  # fmt: skip
    tok = str(tmp_path / "one" / "tokenizer.json")
    prepare([str(jsonl)], tmp_path / "tab", tokenizer=tok, text_column="code", progress=False)
    assert len(_docs(tmp_path / "tab" / "train")) == 40
    # a column of numbers is refused (str() of them was tokenized as text); bytes are
    # UTF-8 text, and bytes that are not UTF-8 are one line naming the row
    with pytest.raises(PrepareError, match="column 'id' of .* has type int64, not text"):
        prepare([str(jsonl)], tmp_path / "ids", tokenizer=tok, text_column="id", progress=False)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [t.encode() for t in texts.values()]}), tmp_path / "b.parquet")
    prepare([str(tmp_path / "b.parquet")], tmp_path / "bin", tokenizer=tok, progress=False)
    assert [d.tolist() for d in _docs(tmp_path / "bin" / "train")] == [
        d.tolist() for d in _docs(tmp_path / "tab" / "train")]  # fmt: skip
    pq.write_table(pa.table({"text": [b"ok", b"\xe9t\xe9"]}), tmp_path / "latin.parquet")
    with pytest.raises(PrepareError, match=r"column 'text' \(row 1\) is not UTF-8 text"):
        prepare([str(tmp_path / "latin.parquet")], tmp_path / "lat", tokenizer=tok, progress=False)


# a folder source's files into {out}, with a trained tokenizer
_PY = ["{src}", "--glob", "**/*.py", "--out", "{out}", "--train-tokenizer", "300"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{src}", "--out", "{out}", "--train-tokenizer", "300"], "pass --glob"),
        (["{src}/nope", "--out", "{out}", "--train-tokenizer", "300"], "does not exist"),
        (["{src}", "--glob", "*.py", "--out", "{out}"], "exactly one of --tokenizer"),
        (["{jsonl}", "--out", "{out}", "--train-tokenizer", "300"], "no column 'text'"),
        (
            ["{src}", "--glob", "**/*.py", "--out", "{out}", "--tokenizer", "{src}/tok.json"],
            "tok.json' does not exist; pass a tokenizer.json path",
        ),
        (
            ["{src}", "--glob", "**/*.py", "--out", "{out}", "--tokenizer", "~/no/such/tok"],
            "'~/no/such/tok' does not exist; pass a tokenizer.json path",
        ),
        (
            ["{src}", "--glob", "**/*.py", "--out", "{out}", "--train-tokenizer", "-5"],
            "needs a vocabulary of at least 261",
        ),
        (
            ["{src}", "--glob", "{src}/*.py", "--out", "{out}", "--train-tokenizer", "300"],
            "reaches outside",
        ),
        # each taken without a word: the parent's files, a document twice, the shards
        # inside the source (the next run refused), the current folder, a Rust abort
        (
            ["{src}/pkg0", "--glob", "../*.txt", "--out", "{out}", "--train-tokenizer", "300"],
            "--glob '../*.txt' reaches outside",
        ),
        (["{src}/pkg0", *_PY], "is a document twice among the sources"),
        (  # pathlib's own ValueError, a traceback
            ["{src}", "--glob", "a**b/*.py", "--out", "{out}", "--train-tokenizer", "300"],
            "--glob 'a**b/*.py' is not a pattern pathlib takes",
        ),
        (["{src}", "--glob", "**/*.py", "--out", "", "--train-tokenizer", "300"], "--out is empty"),
        (
            ["{src}", "--glob", "**/*.py", "--out", "{out}", "--train-tokenizer", "4294967296"],
            "give a vocabulary of at most 16,777,216",
        ),
        (
            [*_PY, "--workers", "0"],
            "--workers must be >= 1, got 0",
        ),
        (
            ["{tables}", "--glob", "*.parquet", "--out", "{out}", "--train-tokenizer", "300"],
            "matches table files",
        ),
        # a traceback, and a train split of no document with exit 0
        (
            ["{src}", "--glob", "**/*.py", "--out", "{jsonl}/o", "--train-tokenizer", "300"],
            "t.jsonl/o: cannot make that folder (Not a directory); give another",
        ),
        (
            ["{src}/one.py", "--out", "{out}", "--train-tokenizer", "300", "--heldout", "0.9"],
            "--heldout 0.9: the sources hold one document, which cannot be split",
        ),
        (  # the one document kept: an empty held-out split, exit 0
            ["{src}/one.py", "--out", "{out}", "--train-tokenizer", "300", "--heldout", "0.01"],
            "--heldout 0.01: the sources hold one document, which cannot be split",
        ),
    ],
)
def test_bad_input_is_one_line(tmp_path: Path, capsys, args: list[str], message: str) -> None:
    _corpus(tmp_path / "src", n=3)
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"code": "x = 1"}\n')
    (tmp_path / "src" / "one.py").write_text("x = 1\n")
    (tmp_path / "tables").mkdir()
    (tmp_path / "tables" / "a.parquet").write_bytes(b"PAR1")  # read as its bytes before
    fill = {"src": str(tmp_path / "src"), "out": str(tmp_path / "o"), "jsonl": str(jsonl),
            "tables": str(tmp_path / "tables")}  # fmt: skip
    code = main([a.format(**fill) for a in args] + ["--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0]
    assert not os.path.exists(tmp_path / "o" / "train")


def test_a_file_added_above_the_others_moves_no_held_out_file(tmp_path: Path, monkeypatch) -> None:
    """Keys were relative to the deepest folder holding every file: one file added at the
    top of a folder source re-keyed every other, and moved most of the held-out files into
    train (evaluation then scored files it had trained on)."""
    import loaders.prepare as P

    src = tmp_path / "src"
    (src / "pkg" / "mod").mkdir(parents=True)
    for i in range(200):
        (src / "pkg" / "mod" / f"m{i:03d}.py").write_text(f"x = {i}\n")
    tok = str(tmp_path / "tok.json")
    prepare([str(src)], tmp_path / "t", glob="**/*.py", train_vocab=300, progress=False)
    shutil.copy(tmp_path / "t" / "tokenizer.json", tok)
    held: list[set[str]] = []
    real = P.heldout_docs

    def spy(*args, **kw):
        out = real(*args, **kw)
        held.append({Path(d.path).name for d in out})
        return out

    monkeypatch.setattr(P, "heldout_docs", spy)
    prepare([str(src)], tmp_path / "a", glob="**/*.py", tokenizer=tok, heldout=0.1,
            progress=False)  # fmt: skip
    (src / "setup.py").write_text("y = 1\n")
    prepare([str(src)], tmp_path / "b", glob="**/*.py", tokenizer=tok, heldout=0.1,
            progress=False)  # fmt: skip
    assert len(held[0]) > 5 and held[0] <= held[1]


def test_an_out_inside_the_source_links_and_older_outputs(tmp_path: Path, capsys) -> None:
    """--out inside a folder source: its shards matched a '**/*' glob on the rerun, which
    was refused as "other settings"; they are left out. A link to a file of the same
    source is read once (said). An output prepared before the held-out keys changed
    reruns as it is without a held-out split, and is refused, saying why, with one."""
    src = tmp_path / "src"
    _corpus(src, n=6)
    (src / "pkg0" / "alias.py").symlink_to(src / "pkg1" / "mod001.py")
    for _ in range(2):
        s = prepare([str(src)], src / "o", glob="**/*", train_vocab=300, progress=False)
    assert s["splits"]["train"]["docs"] == 7  # 6 modules and the README, once each
    assert "1 files are links to files already in it; each is read once" in capsys.readouterr().err
    plan = src / "o" / "prepare_plan.json"
    for heldout, rule in ((0.0, 2), (0.3, 3)):
        out = tmp_path / f"h{heldout}"
        prepare([str(src)], out, glob="**/*.py", train_vocab=300, heldout=heldout, progress=False)
        plan = json.loads((out / "prepare_plan.json").read_text())
        assert plan["settings"]["heldout_rule"] == rule
        plan["settings"]["heldout_rule"] = 2  # as written before the keys changed
        (out / "prepare_plan.json").write_text(json.dumps(plan))
        if heldout:
            with pytest.raises(PrepareError, match="by an older loaders.prepare, whose held-out"):
                prepare([str(src)], out, glob="**/*.py", train_vocab=300, heldout=heldout,
                        progress=False)  # fmt: skip
        else:
            prepare([str(src)], out, glob="**/*.py", train_vocab=300, progress=False)


def test_a_relative_tokenizer_is_recorded_by_its_absolute_path(tmp_path: Path, monkeypatch):
    """A reader in another folder (the codebert command) took the plan's relative
    tokenizer path for a hub name, and waited through the hub's retries."""
    _corpus(tmp_path / "src", n=6)
    prepare([str(tmp_path / "src")], tmp_path / "trained", train_vocab=300, glob="**/*.py",
            progress=False)  # fmt: skip
    monkeypatch.chdir(tmp_path)
    kw = dict(tokenizer="trained/tokenizer.json", glob="**/*.py", progress=False, workers=4)
    prepare(["src"], Path("given"), **kw)  # type: ignore[arg-type]
    plan = json.loads((tmp_path / "given" / "prepare_plan.json").read_text())
    assert plan["tokenizer"] == str(tmp_path / "trained" / "tokenizer.json")
    assert plan["settings"]["tokenizer"] == "trained/tokenizer.json"  # reruns compare this


def test_one_tokenizer_spelled_two_ways_and_hard_links_are_one(tmp_path: Path, monkeypatch):
    """The same tokenizer given as its folder, then as its tokenizer.json (or relative,
    then absolute), was refused as "other settings" on the rerun (the codebert command's
    cache met it); another file is still refused. A hard link to a file of the source was
    read twice, so it could be held out while its target trained."""
    _corpus(tmp_path / "src", n=6)
    os.link(tmp_path / "src" / "pkg1" / "mod001.py", tmp_path / "src" / "pkg0" / "hard.py")
    prepare([str(tmp_path / "src")], tmp_path / "trained", train_vocab=300, glob="**/*.py",
            progress=False)  # fmt: skip
    monkeypatch.chdir(tmp_path)
    kw = dict(glob="**/*.py", progress=False, heldout=0.3)
    for spelling in ("trained", "trained/tokenizer.json", str(tmp_path / "trained")):
        s = prepare([str(tmp_path / "src")], tmp_path / "out", tokenizer=spelling, **kw)  # type: ignore[arg-type]
        assert s["splits"]["train"]["docs"] + s["splits"]["heldout"]["docs"] == 6
    shutil.copytree(tmp_path / "trained", tmp_path / "other")
    with open(tmp_path / "other" / "tokenizer.json", "a") as f:
        f.write(" ")  # the same tokens, but not the same file: refused
    with pytest.raises(PrepareError, match="other settings .*tokenizer differ"):
        prepare([str(tmp_path / "src")], tmp_path / "out", tokenizer="other", **kw)  # type: ignore[arg-type]


def test_a_file_system_without_inode_numbers_tells_files_apart_by_path(
    tmp_path: Path, monkeypatch
) -> None:
    """Files were told apart by device and inode alone: where a file system reports
    inode 0 for every file, two files would have been taken as one (review)."""
    import types

    from loaders import prepare as prep

    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text(name)
    real = os.stat
    with monkeypatch.context() as m:  # (undone before pytest itself stats a file)
        m.setattr(prep.os, "stat", lambda p, **kw: types.SimpleNamespace(
            st_dev=real(p, **kw).st_dev, st_ino=0, st_mode=real(p, **kw).st_mode))  # fmt: skip
        kept, twins = prep.drop_link_twins([tmp_path / "a.py", tmp_path / "b.py"])
    assert twins == 0 and len(kept) == 2


def test_a_local_tokenizer_folder_without_tokenizer_json_still_loads(tmp_path: Path) -> None:
    """A downloaded model folder with only ``vocab.txt`` (no ``tokenizer.json``) is a path,
    not a hub id: it loads through transformers, offline."""
    pytest.importorskip("transformers")
    from loaders.text import load_tokenizer

    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\nworld\n")
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "BertTokenizer"}')
    assert load_tokenizer(str(tmp_path))("hello world") == [5, 6]


def test_a_prepare_output_is_read_whole_or_refused(tmp_path: Path) -> None:
    """The loader refuses a prepare output's root (it read the held-out split into
    training), a split whose run did not finish (counting it wrote the doc_counts.json
    that marks a split finished), and a split with an Arrow file prepare did not write
    (mixed in) or lacks one it did."""
    import shutil

    from loaders.errors import LoaderInputError
    from loaders.sources import TokenFolder

    _corpus(tmp_path / "src")
    out = tmp_path / "out"
    prepare([str(tmp_path / "src")], out, train_vocab=300, glob="**/*.py", docs_per_shard=5,
            heldout=0.25, progress=False)  # fmt: skip
    (tmp_path / "prep_root").mkdir()
    (tmp_path / "prep_root" / "code").symlink_to(out / "train")  # a root of train splits
    train = TokenFolder(out / "train").num_docs
    assert train + TokenFolder(out / "heldout").num_docs == 40
    with pytest.raises(LoaderInputError, match=r"holding its splits \(heldout, train\)"):
        TokenFolder(out)
    # as sub-datasets of a corpus root, its splits (held-out too) were mixed into training
    with pytest.raises(LoaderInputError, match=r"is a loaders.prepare output: its sub-folders"):
        datasets_from_root(out)
    assert [d.name for d in datasets_from_root(tmp_path / "prep_root")] == ["code"]
    shards = sorted((out / "train").glob("part-*.arrow"))
    shutil.copy(shards[0], out / "train" / "part-99999.arrow")
    with pytest.raises(LoaderInputError, match=r"not written by prepare \(part-99999.arrow\)"):
        TokenFolder(out / "train")
    (out / "train" / "part-99999.arrow").unlink()
    (out / "train" / "doc_counts.json").unlink()  # as a killed run leaves it
    shards[-1].unlink()
    with pytest.raises(LoaderInputError, match="did not finish .* same prepare command"):
        TokenFolder(out / "train")
    assert not (out / "train" / "doc_counts.json").exists()  # not marked finished
    prepare([str(tmp_path / "src")], out, train_vocab=300, glob="**/*.py", docs_per_shard=5,
            heldout=0.25, progress=False)  # fmt: skip
    assert TokenFolder(out / "train").num_docs == train


def test_a_resume_on_shards_prepared_again_from_edited_sources_is_refused(
    tmp_path: Path, monkeypatch
) -> None:
    """The loader knew a folder by its document counts only: sources edited in place and
    prepared again (same files, other tokens) resumed silently on other data. prepare
    records a digest of the documents; the loader's fingerprint holds it."""
    from loaders.sources import tokens_digest

    src = tmp_path / "src"
    _corpus(src)
    kw = dict(train_vocab=300, glob="**/*.py", docs_per_shard=7, progress=False)
    prepare([str(src)], tmp_path / "v1", **kw)
    meta = json.loads((tmp_path / "v1" / "train" / "doc_counts.json").read_text())
    shards = sorted((tmp_path / "v1" / "train").glob("part-*.arrow"))
    assert meta["content"] == "tokens1:" + tokens_digest(shards)
    # a finished folder prepared again reads no shard to digest it
    monkeypatch.setattr("loaders.prepare.tokens_digest", lambda f: pytest.fail(f"read {f}"))
    prepare([str(src)], tmp_path / "v1", **kw)
    monkeypatch.undo()
    # the same documents in other files (another --docs-per-shard): the same digest
    given = {**kw, "train_vocab": None, "tokenizer": str(tmp_path / "v1" / "tokenizer.json")}
    prepare([str(src)], tmp_path / "v3", **{**given, "docs_per_shard": 5})
    again = json.loads((tmp_path / "v3" / "train" / "doc_counts.json").read_text())
    assert len(again["files"]) != len(meta["files"]) and again["content"] == meta["content"]

    def loader(folder: Path) -> TokenLoader:
        cfg = LoaderConfig(datasets=[DatasetSpec(name="py", path=str(folder / "train"))],
                           seq_len=16, batch_size=2, bos_id=BOS, eos_id=EOS, pad_id=PAD,
                           num_shards=4)  # fmt: skip
        return TokenLoader(cfg, rank=0, world_size=1)

    ld = loader(tmp_path / "v1")
    next(iter(ld))
    state = ld.state_dict()
    shutil.copytree(tmp_path / "v1", tmp_path / "moved")  # a copy holds the same content
    loader(tmp_path / "moved").load_state_dict(state)
    # a folder and a state of an earlier build's byte digests (no scheme; per-file
    # "digest" entries): the folder prepared again gets this build's id, the state resumes
    meta_path = tmp_path / "v1" / "train" / "doc_counts.json"
    byte_era = json.loads(meta_path.read_text())
    del byte_era["content"]
    for e in byte_era["files"].values():
        e["digest"] = "0" * 32
    meta_path.write_text(json.dumps(byte_era))
    assert loader(tmp_path / "v1").fingerprint["content"]["py"] is None
    prepare([str(src)], tmp_path / "v1", **kw)
    assert loader(tmp_path / "v1").fingerprint["content"]["py"] == meta["content"]
    byte_state = json.loads(json.dumps(state))
    byte_state["fingerprint"]["content"] = {"py": "068f1f3ffed5" + "0" * 20}
    loader(tmp_path / "v1").load_state_dict(byte_state)
    for f in sorted(src.rglob("*.py"))[:5]:  # edited in place: same files, same count
        f.write_text(f.read_text().replace("return", "yield"))
    prepare([str(src)], tmp_path / "v2", **given)
    again = loader(tmp_path / "v2")
    assert again.fingerprint["docs"] == ld.fingerprint["docs"]
    with pytest.raises(ValueError, match="'py' holds other tokens than when saved"):
        again.load_state_dict(state)
    old = json.loads(json.dumps(state))  # a state saved before content digests
    del old["fingerprint"]["content"]
    again.load_state_dict(old)


def test_a_tokenizer_kept_in_the_out_folder_is_used_not_refused(tmp_path: Path) -> None:
    """``--tokenizer OUT/tokenizer.json`` into a fresh OUT was refused as a stale output
    ("pass another --out or delete them"): deleting it deletes the tokenizer the command
    reads. With ``--tokenizer`` that file is never written, so it is no other run's."""
    _corpus(tmp_path / "src", n=12)
    first = tmp_path / "first"
    prepare([str(tmp_path / "src")], first, train_vocab=300, glob="**/*.py", progress=False)
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(first / "tokenizer.json", out / "tokenizer.json")
    tok = str(out / "tokenizer.json")
    prepare([str(tmp_path / "src")], out, tokenizer=tok, glob="**/*.py", progress=False)
    got, want = _docs(out / "train"), _docs(first / "train")
    assert len(got) == len(want) and all(map(np.array_equal, got, want))
    # a trained tokenizer there is another run's: refused as before
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(first / "tokenizer.json", fresh / "tokenizer.json")
    with pytest.raises(PrepareError, match="holds tokenizer.json but no prepare_plan"):
        prepare([str(tmp_path / "src")], fresh, train_vocab=300, glob="**/*.py", progress=False)


@pytest.mark.parametrize("sources", ["/", Path("/tmp"), ["a", Path("b")]])
def test_sources_that_are_not_a_list_of_str_are_refused(tmp_path: Path, sources) -> None:  # noqa: ANN001
    """A str source list was read character by character ("/ is a folder: pass --glob";
    with a glob, the whole file system from /)."""
    with pytest.raises(PrepareError, match="sources must be a list of str"):
        prepare(sources, tmp_path / "out", train_vocab=300, progress=False)
    assert not (tmp_path / "out").exists()


def test_folder_sources_take_text_files_and_refuse_rows_and_archives(tmp_path: Path, capsys):
    """A folder source took hidden folders (a project's .venv), binary and non-UTF-8
    files, .jsonl files and .jsonl.gz bytes each as one text document, where the
    experiments' raw folders leave the first out and the rest are not what was meant."""
    import gzip

    src = tmp_path / "src"
    texts = _corpus(src, n=6)
    (src / ".venv" / "lib").mkdir(parents=True)
    (src / ".venv" / "lib" / "site.py").write_text("import os\n")
    (src / "logo.py").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00IHDR")
    (src / "old.py").write_bytes("# caf\xe9\n".encode("latin-1"))
    summary = prepare([str(src)], tmp_path / "o", train_vocab=300, glob="**/*.py",
                      progress=False)  # fmt: skip
    assert summary["splits"]["train"]["docs"] == len(texts)
    err = capsys.readouterr().err
    assert "left out 2 files that are not UTF-8 text" in err and "logo.py" in err
    # a glob naming the hidden folder takes it
    assert prepare([str(src)], tmp_path / "o2", train_vocab=300, glob=".venv/**/*.py",
                   progress=False)["splits"]["train"]["docs"] == 1  # fmt: skip
    rows = tmp_path / "rows"
    rows.mkdir()
    (rows / "a.jsonl").write_text('{"code": "x = 1"}\n{"code": "y = 2"}\n')
    with pytest.raises(PrepareError, match=r"matches JSON Lines files .*a.jsonl.*each row a"):
        prepare([str(rows)], tmp_path / "o3", train_vocab=300, glob="*.jsonl", progress=False)
    with gzip.open(rows / "b.jsonl.gz", "wt") as f:
        f.write('{"code": "z = 3"}\n')
    with pytest.raises(PrepareError, match=r"matches compressed files .*b.jsonl.gz"):
        prepare([str(rows)], tmp_path / "o4", train_vocab=300, glob="*.gz", progress=False)
    with pytest.raises(PrepareError, match=r"b.jsonl.gz is compressed; decompress it first"):
        prepare([str(rows / "b.jsonl.gz")], tmp_path / "o5", train_vocab=300, progress=False)
    # beside text files (a repository's fixtures) they are left out, said, not refused
    (rows / "m.py").write_text("x = 1\n")
    capsys.readouterr()
    summary = prepare([str(rows)], tmp_path / "o7", train_vocab=300, glob="*", progress=False)
    assert summary["splits"]["train"]["docs"] == 1
    err = capsys.readouterr().err
    assert "left out 1 JSON Lines files (give them as sources" in err and "a.jsonl" in err
    assert "left out 1 compressed files, e.g." in err and "b.jsonl.gz" in err
    # rows with no text are counted; a line longer than pyarrow's 1 MiB block is read
    long = "x = " + " ".join(["ab"] * (1 << 20))  # 3 MiB on one line
    (rows / "c.jsonl").write_text(
        json.dumps({"code": long}) + '\n{"path": "p"}\n{"code": null}\n{"code": "w = 4"}\n'
    )
    out = tmp_path / "o6"
    tok = str(tmp_path / "o" / "tokenizer.json")  # not trained on 3 MiB again
    prepare([str(rows / "c.jsonl")], out, tokenizer=tok, text_column="code", progress=False)
    assert "2 of 4 rows have no 'code' (missing or null)" in capsys.readouterr().err
    assert ArrowTokenFile(next((out / "train").glob("part-*.arrow"))).num_docs == 4


def test_a_shard_replaced_in_a_prepared_split_is_refused(tmp_path: Path) -> None:
    """A shard copied over from another prepare run (same name, same document count) was
    counted anew: the loader rewrote the split's doc_counts.json without its content
    digest, and a resume trained on other tokens."""
    from loaders.errors import LoaderInputError
    from loaders.sources import TokenFolder

    _corpus(tmp_path / "src", n=12)
    for out in ("a", "b"):
        prepare([str(tmp_path / "src")], tmp_path / out, train_vocab=300, glob="**/*.py",
                docs_per_shard=50, progress=False)  # fmt: skip
        (tmp_path / "src" / "pkg0" / "mod000.py").write_text("x = 1\n" * 40)  # edited for b
    counts = (tmp_path / "a" / "train" / "doc_counts.json").read_text()
    shard = sorted((tmp_path / "a" / "train").glob("part-*.arrow"))[0]
    shutil.copy(tmp_path / "b" / "train" / shard.name, shard)
    with pytest.raises(LoaderInputError, match=rf"{shard.name} is not the one prepare wrote"):
        TokenFolder(tmp_path / "a" / "train")
    # reached through a link (a root of links to prepared splits), or as a copied split
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "code").symlink_to(tmp_path / "a" / "train")
    shutil.copytree(tmp_path / "a" / "train", tmp_path / "copied")
    for folder in (tmp_path / "root" / "code", tmp_path / "copied"):
        with pytest.raises(LoaderInputError, match=rf"{shard.name} is not the one"):
            TokenFolder(folder)
    assert (tmp_path / "a" / "train" / "doc_counts.json").read_text() == counts
