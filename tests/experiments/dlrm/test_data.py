"""Criteo preprocessing, cache, errors, batches and click metrics."""

import json
import math
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from comera.errors import DataError
from experiments.dlrm.batches import RowBatches
from experiments.dlrm.data import (
    CriteoDataConfig,
    CriteoFormatError,
    load_criteo,
    preprocess,
)
from experiments.dlrm.task import click_metrics, roc_auc
from tests.criteo_helpers import SAMPLE


def _cfg(tmp_path: Path, **kw) -> CriteoDataConfig:
    return CriteoDataConfig(path="x", cache_dir=str(tmp_path / "cache"), **kw)


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("criteo")
    return preprocess(SAMPLE, _cfg(tmp), progress=False)


def test_sample_parses_like_the_reference(sample) -> None:
    lines = SAMPLE.read_text().splitlines()
    assert len(sample) == len(lines) == 200
    assert sample.splits == {"train": (0, 172), "test": (172, 186), "val": (186, 200)}
    for i in (0, 57, 199):
        f = lines[i].split("\t")
        assert sample.label[i] == int(f[0])
        want = [math.log1p(max(int(v), 0)) if v else 0.0 for v in f[1:14]]
        np.testing.assert_allclose(sample.dense[i], want, rtol=1e-6)
    for j in range(26):  # ids: contiguous, most frequent first, ties by hash, empty = 0
        hashes = [int(line.split("\t")[14 + j] or "0", 16) for line in lines]
        freq = Counter(hashes)
        order = {h: k for k, h in enumerate(sorted(freq, key=lambda h: (-freq[h], h)))}
        assert sample.cardinalities[j] == len(order)
        assert list(sample.cat[:, j]) == [order[h] for h in hashes]


def test_a_damaged_cache_is_named_and_left_alone(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    root = preprocess(SAMPLE, cfg, progress=False).root
    (root / "meta.json").write_text('{"rows": ')  # cut short
    with pytest.raises(DataError, match=rf"Criteo cache {root} is damaged .*delete that folder"):
        preprocess(SAMPLE, cfg, progress=False)
    (root / "meta.json").write_text('{"rows": 3}')  # a key missing
    with pytest.raises(DataError, match="damaged"):
        preprocess(SAMPLE, cfg, progress=False)
    assert (root / "cat.i32").is_file()  # nothing deleted


def test_cache_is_reused_and_partial_caches_are_rebuilt(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    first = preprocess(SAMPLE, cfg, progress=False)
    meta = first.root / "meta.json"
    stamp = meta.stat().st_mtime_ns
    assert preprocess(SAMPLE, cfg, progress=False).root == first.root
    assert meta.stat().st_mtime_ns == stamp  # not rebuilt
    want, root, cards = np.array(first.cat), first.root, first.cardinalities
    del first  # drop the memory maps before damaging the files under them
    meta.unlink()  # as if a build died before completing
    (root / "cat.i32").unlink()
    (root / "cat.i32").write_bytes(b"junk")
    again = preprocess(SAMPLE, cfg, progress=False)
    assert (again.root / "meta.json").is_file()
    np.testing.assert_array_equal(again.cat, want)
    # other settings: another cache entry
    hashed = preprocess(SAMPLE, _cfg(tmp_path, max_ind_range=50), progress=False)
    assert hashed.root != root
    assert all(c <= min(50, n) for c, n in zip(hashed.cardinalities, cards, strict=True))
    assert max(hashed.cardinalities) == 50 and int(hashed.cat.max()) < 50
    by_hash = preprocess(SAMPLE, _cfg(tmp_path, id_order="hash"), progress=False)
    first_col = [int(line.split("\t")[14] or "0", 16) for line in SAMPLE.read_text().splitlines()]
    ranks = {h: k for k, h in enumerate(sorted(set(first_col)))}
    assert list(by_hash.cat[:, 0]) == [ranks[h] for h in first_col]
    rare = preprocess(SAMPLE, _cfg(tmp_path, min_count=3), progress=False)
    assert all(r <= c + 1 for r, c in zip(rare.cardinalities, cards, strict=True))  # + id 0
    assert sum(rare.cardinalities) < sum(cards) / 2
    freq = Counter(first_col)
    kept = sorted((h for h in freq if freq[h] >= 3), key=lambda h: (-freq[h], h))
    want_ids = {h: k + 1 for k, h in enumerate(kept)}  # rare values: id 0
    assert list(rare.cat[:, 0]) == [want_ids.get(h, 0) for h in first_col]
    assert not list((tmp_path / "cache").glob("*.tmp-*"))


@pytest.mark.parametrize("settings", [{}, {"min_count": 3}, {"id_order": "hash"}])
def test_ids_do_not_depend_on_the_lookup_chunk(tmp_path: Path, monkeypatch, settings) -> None:
    """Pass 2 maps hashes to ids a chunk of rows at a time (bounded memory): chunks of 7
    rows, which split the 200-row sample unevenly, give the one-chunk result."""
    from experiments.dlrm import data as criteo_data

    whole = preprocess(SAMPLE, _cfg(tmp_path / "a", **settings), progress=False)
    monkeypatch.setattr(criteo_data, "_ID_CHUNK", 7)
    chunked = preprocess(SAMPLE, _cfg(tmp_path / "b", **settings), progress=False)
    np.testing.assert_array_equal(chunked.cat, whole.cat)
    assert chunked.cardinalities == whole.cardinalities


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda f: f[:-1], "line 5: expected 40 tab-separated fields"),
        (lambda f: f[:3] + ["12x"] + f[4:], "line 5, field I3: expected a 64-bit integer"),
        (lambda f: f[:20] + ["zz12"] + f[21:], "line 5, field C7: expected a hex hash"),
        (lambda f: ["2"] + f[1:], "line 5, field label: expected 0 or 1"),
    ],
)
def test_bad_lines_are_named(tmp_path: Path, mutate, message: str) -> None:
    lines = SAMPLE.read_text().splitlines()
    lines[4] = "\t".join(mutate(lines[4].split("\t")))
    bad = tmp_path / "bad.txt"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(CriteoFormatError, match=message):
        preprocess(bad, _cfg(tmp_path), progress=False)
    assert not list((tmp_path / "cache").glob("*")), "a failed build leaves nothing behind"


def test_bad_line_deep_in_the_file_is_found_by_the_fast_reader(tmp_path: Path) -> None:
    lines = SAMPLE.read_text().splitlines()
    lines[150] = lines[150].replace("\t", "\t9q", 1)  # label ok, I1 = "9q..."
    bad = tmp_path / "bad.txt"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(CriteoFormatError, match=r"bad.txt, line 151, field I1"):
        preprocess(bad, _cfg(tmp_path), progress=False)


def _set_field(lines: list[str], i: int, field: int, value: str) -> None:
    fields = lines[i].split("\t")
    fields[field] = value
    lines[i] = "\t".join(fields)


@pytest.mark.parametrize(
    "case", ["blank", "overflow", "+5", "1_000", "\uff15", "-0x1", "0x", "0x1" + "0" * 16]
)
def test_blank_lines_and_overflow_are_named(tmp_path: Path, case: str) -> None:
    lines = SAMPLE.read_text().splitlines()
    if case == "blank":
        _set_field(lines, 151, 1, "9q")  # a later bad line: the blank one comes first
        lines.insert(120, "")
        message = "line 121 is blank; a Criteo file has one row per line"  # was "got 1 field"
    elif case == "overflow":
        _set_field(lines, 151, 2, "9" * 20)  # does not fit in int64
        message = "line 152, field I2: expected a 64-bit integer"
    else:  # Python's int() takes these, the fast reader does not: the line is still named
        _set_field(lines, 151, 2, case)
        message = "line 152, field I2: expected a 64-bit integer"
    bad = tmp_path / "bad.txt"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(CriteoFormatError, match=message):
        preprocess(bad, _cfg(tmp_path), progress=False)


def test_spaces_around_an_integer_read_as_the_fast_reader_reads_them(tmp_path: Path) -> None:
    """The fast reader takes " 5", "7 " and hex ("0x1a", 64-bit patterns) as integers
    (and " 1", "01", "-0", "0x1" as labels): the head's check lets them through, and the
    data built equals that of the plain file."""
    lines = SAMPLE.read_text().splitlines()
    _set_field(lines, 2, 2, "5")
    _set_field(lines, 151, 2, "7")
    for i in (2, 151):
        _set_field(lines, i, 3, "26")
    _set_field(lines, 6, 4, "-1")
    plain, spaced = tmp_path / "plain.txt", tmp_path / "spaced.txt"
    plain.write_text("\n".join(lines) + "\n")
    _set_field(lines, 2, 2, " 5")  # in the head the check reads
    lines[3] = " " + lines[3]  # a spaced label too
    lines[4] = ("01" if lines[4][0] == "1" else "-0") + lines[4][1:]  # labels int() reads
    lines[5] = ("0x1" if lines[5][0] == "1" else "0X0") + lines[5][1:]  # and hex ones
    lines[160] = ("01" if lines[160][0] == "1" else "00") + lines[160][1:]
    _set_field(lines, 2, 3, "0x1a")  # hex, as the fast reader reads it
    _set_field(lines, 151, 3, " 0X1A ")
    _set_field(lines, 6, 4, "0xFFFFFFFFFFFFFFFF")  # a 64-bit pattern: -1
    _set_field(lines, 151, 2, "7 ")  # deep, where the fast reader alone reads
    spaced.write_text("\n".join(lines) + "\n")
    a = preprocess(plain, _cfg(tmp_path / "a"), progress=False)
    b = preprocess(spaced, _cfg(tmp_path / "b"), progress=False)
    np.testing.assert_array_equal(a.dense, b.dense)
    np.testing.assert_array_equal(a.cat, b.cat)
    np.testing.assert_array_equal(a.label, b.label)


def test_stale_partial_builds_are_removed(tmp_path: Path) -> None:
    from experiments.dlrm.data import fingerprint

    cfg = _cfg(tmp_path)
    stale = tmp_path / "cache" / f"{fingerprint(SAMPLE, cfg)}.tmp-999999999"  # no such pid
    stale.mkdir(parents=True)
    (stale / "hash.u32").write_bytes(b"\0" * 64)
    preprocess(SAMPLE, cfg, progress=False)
    assert not stale.exists()


def test_non_criteo_and_missing_files(tmp_path: Path) -> None:
    csv = tmp_path / "data.csv"
    csv.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(CriteoFormatError, match="line 1: expected 40 tab-separated"):
        preprocess(csv, _cfg(tmp_path), progress=False)
    with pytest.raises(FileNotFoundError, match="--data PATH"):
        preprocess(tmp_path / "nope.txt", _cfg(tmp_path), progress=False)


def test_generated_file_has_learnable_signal(tmp_path: Path) -> None:
    data = load_criteo(
        CriteoDataConfig(cache_dir=str(tmp_path), generated_rows=3000), progress=False
    )
    assert len(data) == 3000 and len(data.cardinalities) == 26
    assert 0.2 < data.meta["base_rate"] < 0.45


def test_row_batches_resume_and_rescale(sample) -> None:
    lo, hi = sample.splits["train"]

    def rows(it, n):
        return [tuple(next(it)["row"].tolist()) for _ in range(n)]

    one = RowBatches(sample, lo, hi, 16, seed=3)
    first = rows(one, 30)  # crosses epochs (10 batches per epoch)
    epoch = sum(first[:10], ())
    assert len(set(epoch)) == 160 and lo <= min(epoch) and max(epoch) < hi  # no repeats
    assert sorted(sum(first[10:20], ())) != sorted(epoch)  # a new order each epoch
    it = RowBatches(sample, lo, hi, 16, seed=3)
    rows(it, 13)
    state = it.state_dict()
    # resumed on 2 ranks: each takes half of every global batch, in the same order
    halves = []
    for rank in range(2):
        r = RowBatches(sample, lo, hi, 16, seed=3, rank=rank, world=2)
        r.load_state_dict([state, state])
        halves.append(rows(r, 17))
    for k in range(17):
        assert sorted(halves[0][k] + halves[1][k]) == sorted(first[13 + k])
    with pytest.raises(ValueError, match="batch_size=16"):
        RowBatches(sample, lo, hi, 32, seed=3).load_state_dict(state)


def test_row_batches_refuse_a_resume_on_changed_data(sample, tmp_path: Path) -> None:
    """A position saved over one file's rows is refused over another file of as many rows
    (the checkpoint's tables would read the new file's ids), and accepted over a copy."""
    lo, hi = sample.splits["train"]
    it = RowBatches(sample, lo, hi, 16, seed=3)
    next(it)
    state = it.state_dict()
    lines = SAMPLE.read_text().splitlines(keepends=True)
    (tmp_path / "copy.txt").write_text("".join(lines))
    (tmp_path / "reversed.txt").write_text("".join(reversed(lines)))
    copy = preprocess(tmp_path / "copy.txt", _cfg(tmp_path), progress=False)
    flipped = preprocess(tmp_path / "reversed.txt", _cfg(tmp_path), progress=False)
    assert len(flipped) == len(sample) and flipped.root != sample.root != copy.root
    RowBatches(copy, lo, hi, 16, seed=3).load_state_dict(state)
    with pytest.raises(DataError, match="trained on other data"):
        RowBatches(flipped, lo, hi, 16, seed=3).load_state_dict(state)
    old = {k: v for k, v in state.items() if k != "data_id"}  # saved before the digest
    RowBatches(flipped, lo, hi, 16, seed=3).load_state_dict(old)


def test_auc_is_exact_with_ties() -> None:
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, 300).astype(float)  # many ties
    labels = rng.random(300) < 0.3
    pos, neg = scores[labels], scores[~labels]
    brute = ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (
        len(pos) * len(neg)
    )
    assert roc_auc(scores, labels) == pytest.approx(brute, abs=1e-12)
    m = click_metrics(np.zeros(300), labels.astype(float))  # logit 0: p = 0.5
    assert m["auc"] == 0.5 and m["logloss"] == pytest.approx(math.log(2))
    assert m["nce"] > 1  # worse than predicting the base rate
    # a NaN score has no rank: a model that produced one has no AUC, not a plausible one
    assert math.isnan(roc_auc(np.array([np.nan, 0.0, 1.0, np.nan]), np.array([0, 0, 1, 1])))


def test_settings_and_caches_that_cannot_work_are_one_error(tmp_path: Path) -> None:
    """ids are uint32, so --max-ind-range must stay below 2**32; a cache dir that cannot
    be written is a DataError naming --cache-dir, not an OSError traceback."""
    from comera.errors import ConfigError

    with pytest.raises(ConfigError, match=r"max_ind_range < 2\*\*32"):
        CriteoDataConfig(path=str(SAMPLE), max_ind_range=2**32)
    (tmp_path / "afile").write_text("")
    cfg = CriteoDataConfig(path=str(SAMPLE), cache_dir=str(tmp_path / "afile"))
    with pytest.raises(DataError, match=r"cannot build the Criteo cache .*--cache-dir"):
        load_criteo(cfg, progress=False)


def test_unreadable_file_is_named(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "train.txt"
    path.write_text(SAMPLE.read_text())
    real_open = open

    def deny(file, *a, **kw):  # as a file without read permission (tests may run as root)
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *a, **kw)

    monkeypatch.setattr("builtins.open", deny)
    with pytest.raises(CriteoFormatError, match="cannot read Criteo file .*train.txt: Perm"):
        preprocess(path, _cfg(tmp_path), progress=False)


def _rows_outside_the_sample(n: int) -> list[int]:
    """Rows :func:`experiments.cursor.sample_digest` does not read (it reads 4,096)."""
    sampled = set(np.linspace(0, n - 1, num=min(n, 4096)).astype(np.int64).tolist())
    return [i for i in range(n) if i not in sampled]


def test_identity_covers_every_row_and_keeps_old_digests(tmp_path: Path) -> None:
    """A file edited in a row the 4,096 sampled rows miss is refused on resume; a copy
    resumes; a cache built before the full digest, and a checkpoint holding the sampled
    digest of then, still resume."""
    from experiments.dlrm.generate import write_generated

    path = tmp_path / "train.txt"
    write_generated(path, 5000, seed=1)
    data = preprocess(path, _cfg(tmp_path), progress=False)
    lo, hi = data.splits["train"]
    state = RowBatches(data, lo, hi, 64, seed=3).state_dict()
    lines = path.read_text().splitlines(keepends=True)
    row = _rows_outside_the_sample(len(lines))[0]
    shutil.copy(path, tmp_path / "copy.txt")
    lines[row] = ("1" if lines[row][0] == "0" else "0") + lines[row][1:]  # its label flipped
    (tmp_path / "edited.txt").write_text("".join(lines))
    edited = preprocess(tmp_path / "edited.txt", _cfg(tmp_path), progress=False)
    copy = preprocess(tmp_path / "copy.txt", _cfg(tmp_path), progress=False)
    assert edited.cardinalities == data.cardinalities and len(edited) == len(data)
    assert edited.identity() != data.identity() == copy.identity()
    with pytest.raises(DataError, match="trained on other data"):
        RowBatches(edited, lo, hi, 64, seed=3).load_state_dict(state)
    RowBatches(copy, lo, hi, 64, seed=3).load_state_dict(state)
    # a checkpoint saved with the sampled digest resumes over a new cache of the same rows
    legacy = {**state, "data_id": data.sampled_identity()}
    RowBatches(copy, lo, hi, 64, seed=3).load_state_dict(legacy)
    # a cache written before the full digest: its identity is the sampled one
    meta_path = data.root / "meta.json"
    meta = json.loads(meta_path.read_text())
    old = {k: v for k, v in meta.items() if k not in ("content_digest", "meta_digest")}
    meta_path.write_text(json.dumps(old))
    reopened = preprocess(path, _cfg(tmp_path), progress=False)
    assert reopened.identity() == data.sampled_identity()


def test_a_file_cut_inside_its_last_field_is_noted(tmp_path: Path, capsys) -> None:
    """A copy cut short inside its last hash still parses (fewer digits): a note on
    stderr says the file does not end with a newline; a complete file gets none."""
    lines = SAMPLE.read_text().splitlines()
    _set_field(lines, len(lines) - 1, 39, "abcd1234")
    whole, cut = tmp_path / "whole.txt", tmp_path / "cut.txt"
    whole.write_text("\n".join(lines) + "\n")
    cut.write_text("\n".join(lines)[:-3])  # C26 of the last line: "abcd1"
    capsys.readouterr()
    preprocess(whole, _cfg(tmp_path), progress=False)
    assert "note:" not in capsys.readouterr().err
    data = preprocess(cut, _cfg(tmp_path), progress=False)
    assert len(data) == len(lines)  # read as it stands
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("note:") and str(cut) in err[0]
    assert "does not end with a newline" in err[0]


def test_source_read_errors_name_the_data_file(tmp_path: Path, monkeypatch) -> None:
    """A plain text file named *.gz or *.bz2 reads as text (not decompressed by its name);
    a compressed file says so; an error reading the source names it and --data, never
    --cache-dir."""
    import gzip
    import lzma

    plain = preprocess(SAMPLE, _cfg(tmp_path), progress=False)
    for name in ("train.txt.gz", "train.txt.bz2"):
        shutil.copy(SAMPLE, tmp_path / name)
        cfg = CriteoDataConfig(path=str(tmp_path / name), cache_dir=str(tmp_path / "cache"))
        named = load_criteo(cfg, progress=False)
        np.testing.assert_array_equal(named.cat, plain.cat)
    packed = tmp_path / "packed.txt.gz"
    packed.write_bytes(gzip.compress(SAMPLE.read_bytes()))
    said = f"{packed} is gzip-compressed; decompress it first (gunzip -c {packed} > "
    said += f"{tmp_path / 'packed.txt'}) and pass the plain text file with --data "
    with pytest.raises(CriteoFormatError, match=re.escape(said + str(tmp_path / "packed.txt"))):
        preprocess(packed, _cfg(tmp_path), progress=False)
    # "gunzip day_0" refuses a name without .gz ("unknown suffix"): -c takes any name
    for name, plain in (("day_0", "day_0-plain.txt"), ("train.txt", "train-plain.txt")):
        (tmp_path / name).write_bytes(lzma.compress(SAMPLE.read_bytes()))
        said = f"(unxz -c {tmp_path / name} > {tmp_path / plain})"
        with pytest.raises(CriteoFormatError, match=re.escape(said)):
            preprocess(tmp_path / name, _cfg(tmp_path), progress=False)
    # a file of the suggested name already there: "> packed.txt" would have replaced it
    (tmp_path / "packed.txt").write_text("mine\n")
    said = f"(gunzip -c {packed} > {tmp_path / 'packed-plain2.txt'})"
    with pytest.raises(CriteoFormatError, match=re.escape(said)):
        preprocess(packed, _cfg(tmp_path), progress=False)

    def broken(*a, **kw):
        raise OSError("zlib inflate failed: incorrect header check")

    monkeypatch.setattr("pyarrow.csv.open_csv", broken)
    path = tmp_path / "other.txt"
    shutil.copy(SAMPLE, path)
    cfg = CriteoDataConfig(path=str(path), cache_dir=str(tmp_path / "empty"))  # not cached
    with pytest.raises(CriteoFormatError, match=r"cannot read Criteo file .*other.txt: zlib") as e:
        load_criteo(cfg, progress=False)
    assert "--data" in str(e.value) and "cache" not in str(e.value)


def _edit_meta(root: Path, edit) -> None:
    meta = json.loads((root / "meta.json").read_text())
    edit(meta)
    (root / "meta.json").write_text(json.dumps(meta))


def _largest_table_smaller(meta: dict) -> None:
    cards = meta["cardinalities"]
    j = cards.index(max(cards))
    cards[j] -= 1  # its largest id no longer fits


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(rows=-5), "rows=-5 is not a positive integer"),
        (lambda m: m.update(rows=150), "label.u8 holds 200 bytes"),
        (lambda m: m["splits"].update(val=[186, 250]), "splits="),
        (lambda m: m.update(cardinalities=m["cardinalities"][:3]), "list of 26"),
        (_largest_table_smaller, "meta_digest"),
        # a cache built before meta_digest: its ids are checked against the sizes
        (
            lambda m: (m.pop("meta_digest", None), _largest_table_smaller(m)),
            "outside its cardinality",
        ),
    ],
)
def test_a_meta_edited_into_other_valid_json_is_damaged(tmp_path: Path, edit, message) -> None:
    """meta.json that parses but does not describe the files beside it is the damaged
    cache's one error (nothing deleted), not an OverflowError or an IndexError later."""
    cfg = _cfg(tmp_path)
    root = preprocess(SAMPLE, cfg, progress=False).root
    _edit_meta(root, lambda m: m.pop("meta_digest", None))  # as built before it: still opens
    assert len(preprocess(SAMPLE, cfg, progress=False)) == 200
    shutil.rmtree(root)
    root = preprocess(SAMPLE, cfg, progress=False).root
    _edit_meta(root, edit)
    with pytest.raises(DataError, match=rf"Criteo cache {root} is damaged .*{message}"):
        preprocess(SAMPLE, cfg, progress=False)
    assert (root / "cat.i32").is_file()


def test_files_of_killed_generations_are_removed(tmp_path: Path, monkeypatch) -> None:
    """``generated-<rows>.txt.tmp-<pid>`` of a process that is gone goes, a live one's
    stays; a generation that fails leaves no file."""
    import os

    from experiments.dlrm import generate

    dead = [tmp_path / f"generated-{n}.txt.tmp-99999999{n % 10}" for n in (200, 7)]  # no pids
    live = tmp_path / f"generated-500.txt.tmp-{os.getpid()}"
    for f in (*dead, live):
        f.write_text("partial")
    real = generate.write_generated

    def killed(path, rows, seed=0):
        Path(path).write_text("partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "write_generated", killed)
    cfg = CriteoDataConfig(cache_dir=str(tmp_path), generated_rows=200)
    with pytest.raises(KeyboardInterrupt):
        load_criteo(cfg, progress=False)
    assert sorted(tmp_path.glob("generated-*")) == [live]
    for f in dead:
        f.write_text("partial")
    monkeypatch.setattr(generate, "write_generated", real)
    assert len(load_criteo(cfg, progress=False)) == 200
    assert sorted(tmp_path.glob("generated-*.tmp-*")) == [live]


def test_appended_lines_are_named_as_changed_data(sample, tmp_path: Path) -> None:
    """Lines appended since the checkpoint change the split's size too: the refusal says
    the data changed, not only that the sizes differ."""
    lo, hi = sample.splits["train"]
    state = RowBatches(sample, lo, hi, 16, seed=3).state_dict()
    lines = SAMPLE.read_text().splitlines(keepends=True)
    (tmp_path / "longer.txt").write_text("".join(lines + lines[:2]))
    longer = preprocess(tmp_path / "longer.txt", _cfg(tmp_path), progress=False)
    lo2, hi2 = longer.splits["train"]
    assert hi2 - lo2 != hi - lo
    with pytest.raises(DataError, match=rf"trained on other data .*had {hi - lo} examples"):
        RowBatches(longer, lo2, hi2, 16, seed=3).load_state_dict(state)


def test_a_changed_generator_writes_its_own_file(tmp_path: Path, monkeypatch) -> None:
    """The generated file was cached by its row count alone: after the generator changed,
    the old file was served again, and the report scored its labels against the new
    generator's planted logits. Its name now holds a digest of the generator's source."""
    from experiments.dlrm import generate
    from experiments.dlrm.data import generated_name

    cfg = CriteoDataConfig(cache_dir=str(tmp_path), generated_rows=200)
    load_criteo(cfg, progress=False)
    before = sorted(p.name for p in tmp_path.glob("generated-*"))
    assert before == [generated_name(200)]
    changed = tmp_path / "generate.py"
    changed.write_text(Path(generate.__file__).read_text() + "\n# changed\n")
    monkeypatch.setattr(generate, "__file__", str(changed))
    assert generated_name(200) not in before
    (tmp_path / "generated-200.txt").write_text("x")  # as named before the digest
    (tmp_path / "generated-2000.txt").write_text("x")  # other rows: another run's, kept
    kept = tmp_path / ("f" * 32)  # another file's tables, and a folder of unreadable meta
    kept.mkdir()
    (kept / "meta.json").write_text(json.dumps({"source": str(tmp_path / "generated-2000.txt")}))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "meta.json").write_text("[1, 2")

    def sources() -> list[str]:
        metas = [
            json.loads(m.read_text())
            for m in tmp_path.glob("*/meta.json")
            if m.parent.name != "junk"
        ]
        return sorted(Path(m["source"]).name for m in metas)

    assert sources() == sorted([before[0], "generated-2000.txt"])
    load_criteo(cfg, progress=False)
    # the earlier generators' files of these rows (up to 8 GB each) are removed, and the
    # tables preprocessed from them (named by the old file's fingerprint) with them
    assert sorted(p.name for p in tmp_path.glob("generated-*")) == sorted(
        [generated_name(200), "generated-2000.txt"]
    )
    assert sources() == sorted([generated_name(200), "generated-2000.txt"])
    assert (tmp_path / "junk" / "meta.json").is_file()


def test_tar_archives_long_lines_and_cr_line_ends(tmp_path: Path, capsys) -> None:
    """Kaggle's dac.tar.gz was told to be gunzipped into dac.tar, which then failed on a
    label of 1.6 KB of tar header; a file without newlines was read whole before its
    error; a file of CR line ends got a false 'no newline' note."""
    import tarfile

    inner = tmp_path / "dac" / "train.txt"
    inner.parent.mkdir()
    shutil.copy(SAMPLE, inner)
    for name, mode, flag in (("dac.tar.gz", "w:gz", "-xzf"), ("x.tar", "w", "-xf"),
                             ("renamed.gz", "w:gz", "-xzf")):  # fmt: skip
        with tarfile.open(tmp_path / name, mode) as tar:
            tar.add(inner, arcname="train.txt")
        with pytest.raises(CriteoFormatError, match=rf"{name} is a .*tar archive; extract it") as e:
            preprocess(tmp_path / name, _cfg(tmp_path), progress=False)
        assert f"(tar {flag} " in str(e.value) and "train.txt" in str(e.value)
    one = tmp_path / "one.txt"
    one.write_bytes(b"\x00" * 200_000)
    with pytest.raises(CriteoFormatError, match="line 1 is longer than 65,536 characters"):
        preprocess(one, _cfg(tmp_path), progress=False)
    lines = SAMPLE.read_text().splitlines()
    lines[0] = "1" * 1000 + lines[0][1:]
    (tmp_path / "wide.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(CriteoFormatError, match=r"label: expected 0 or 1, got '1{40}'\.\.\. "
                                                r"\(1,000 characters\)$"):  # fmt: skip
        preprocess(tmp_path / "wide.txt", _cfg(tmp_path), progress=False)
    cr = tmp_path / "cr.txt"
    cr.write_bytes(SAMPLE.read_bytes().replace(b"\n", b"\r"))
    capsys.readouterr()
    assert len(preprocess(cr, _cfg(tmp_path), progress=False)) == 200
    assert "note:" not in capsys.readouterr().err
    with pytest.raises(CriteoFormatError, match="into 101 days; .*lower data.days"):
        preprocess(SAMPLE, _cfg(tmp_path, days=101), progress=False)


def test_ids_damaged_in_place_are_a_damaged_cache(tmp_path: Path) -> None:
    """A cache whose ids were overwritten (its files keep their sizes) ended in
    F.embedding's IndexError traceback where a TTM table's lookup named the id."""
    from experiments.dlrm.batches import rows_to_batch

    data = preprocess(SAMPLE, _cfg(tmp_path), progress=False)
    assert rows_to_batch(data, np.arange(10))["cat"].shape == (10, 26)
    cat = np.memmap(data.root / "cat.i32", dtype=np.int32, mode="r+", shape=(200, 26))
    cat[7, 4] = 999_999
    cat.flush()
    del cat
    data = preprocess(SAMPLE, _cfg(tmp_path), progress=False)  # opens: sizes and meta fit
    want = rf"cache {data.root} is damaged: row 7 holds id 999999 in C5, outside its \d+ ids; "
    with pytest.raises(DataError, match=want + "delete that folder"):
        rows_to_batch(data, np.arange(10))
    # a damaged label was trained on as a target of 7, without a word
    label = np.memmap(data.root / "label.u8", dtype=np.uint8, mode="r+", shape=(200,))
    label[13] = 7
    label.flush()
    del label
    data = preprocess(SAMPLE, _cfg(tmp_path), progress=False)
    assert rows_to_batch(data, np.arange(12, 14) + 100)["label"].shape == (2,)
    with pytest.raises(DataError, match="row 13 holds label 7, not 0 or 1; delete that"):
        rows_to_batch(data, np.arange(12, 16))


def test_the_resume_hint_names_the_file_or_the_generated_rows(sample, tmp_path: Path) -> None:
    """A resume on other data named neither --data nor the file; for --data generated the
    way on is its row count, not a file."""
    assert f"this run reads {SAMPLE.resolve()}: give --data" in RowBatches(
        sample, 0, 100, 10).data_hint  # fmt: skip
    gen = load_criteo(CriteoDataConfig(path="generated", generated_rows=100,
                                       cache_dir=str(tmp_path / "c")), progress=False)  # fmt: skip
    assert "data.generated_rows" in RowBatches(gen, 0, 50, 10).data_hint
    mine = tmp_path / "generated-mine.txt"  # a user's file of that name is a file
    shutil.copy(SAMPLE, mine)
    data = preprocess(mine, _cfg(tmp_path), progress=False)
    assert f"this run reads {mine.resolve()}" in RowBatches(data, 0, 100, 10).data_hint
    # the generated file damaged (and its cache gone): blamed on a user's Criteo file
    (made,) = (tmp_path / "c").glob("generated-*.txt")
    for folder in (p for p in (tmp_path / "c").iterdir() if p.is_dir()):
        shutil.rmtree(folder)
    made.write_text("1\t2\t3\n")
    cfg = CriteoDataConfig(path="generated", generated_rows=100, cache_dir=str(tmp_path / "c"))
    with pytest.raises(CriteoFormatError, match=f"the generated data file {made} is damaged"):
        load_criteo(cfg, progress=False)
    # too few rows for the days is a setting, refused before any file is made or blamed
    from comera.errors import ConfigError

    with pytest.raises(ConfigError, match="generated_rows=100 cannot be split into data.days=60"):
        CriteoDataConfig(path="generated", generated_rows=100, days=60)
