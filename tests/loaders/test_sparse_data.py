"""Sub-datasets with fewer documents than shards, or few long enough to emit: no reader may
drop one that still has documents for it, and what it does drop must follow from the
config and the cursors alone, so a resume continues token-identically."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from loaders import DatasetSpec, LoaderConfig, TokenLoader
from loaders.errors import LoaderInputError, MixingShortfall
from tests.loaders_helpers import write_arrow


class Memory:
    """In-memory source: document ``i`` is ``(base + i + 1) * 1000 + arange(length)``."""

    def __init__(self, lengths: list[int], base: int = 0) -> None:
        self.lengths, self.base, self.num_docs = list(lengths), base, len(lengths)

    def doc(self, i: int) -> np.ndarray:
        return ((self.base + i + 1) * 1000 + np.arange(self.lengths[i])).astype(np.int32)


def _config(sources: list[tuple[str, object, float]], **kw) -> LoaderConfig:
    base = dict(seq_len=16, batch_size=2, bos_id=1, eos_id=2, pad_id=0, num_shards=8)
    base.update(kw)
    return LoaderConfig(
        datasets=[DatasetSpec(name=n, path=s, weight=w) for n, s, w in sources], **base
    )


def _body(batches: list[dict]) -> np.ndarray:
    ids = np.concatenate([b["input_ids"].numpy().reshape(-1) for b in batches])
    return ids[ids >= 1000]


def _take(loader: TokenLoader, n: int) -> list[dict]:
    return [b for _, b in zip(range(n), loader, strict=False)]


def test_local_mode_keeps_a_sub_dataset_smaller_than_num_shards():
    """With N < L most local blocks are empty in a given epoch; a reader whose shards draw
    empty blocks for many epochs in a row still reaches the documents later."""
    small = Memory([5] * 3)
    finite = _config([("a", small, 1.0)], shuffle="local", num_epochs=10, seq_len=8, batch_size=1)
    toks = np.concatenate([_body(list(TokenLoader(finite, rank=r, world_size=8)))
                           for r in range(8)])  # fmt: skip
    assert {int((toks == small.doc(i)[0]).sum()) for i in range(3)} == {10}
    endless = _config([("a", small, 1.0)], shuffle="local", seq_len=8, batch_size=1)
    for r in range(8):
        assert len(_take(TokenLoader(endless, rank=r, world_size=8), 30)) == 30
    mix = _config([("big", Memory([20] * 2000), 0.5), ("small", Memory([20] * 10, 10**5), 0.5)],
                  num_shards=64, shuffle="local", seq_len=64, batch_size=4)  # fmt: skip
    for r in (0, 13, 31):
        got = _body(_take(TokenLoader(mix, rank=r, world_size=32), 60))
        assert abs(float((got >= (10**5 + 1) * 1000).mean()) - 0.5) < 0.05


@pytest.mark.parametrize("shuffle", ["global", "local", "none"])
def test_rare_long_documents_are_not_dropped(shuffle):
    """Only document 7 passes ``min_doc_len``: the skips between two of its emissions span
    an epoch's end, and that must not count as a sub-dataset with nothing left."""
    lengths = [1] * 50
    lengths[7] = 10
    src = Memory(lengths)
    endless = _config([("a", src, 1.0)], num_shards=1, min_doc_len=5, shuffle=shuffle)
    assert len(_take(TokenLoader(endless), 200)) == 200
    finite = _config([("a", src, 1.0)], num_shards=1, min_doc_len=5, num_epochs=20,
                     shuffle=shuffle)  # fmt: skip
    assert int((_body(list(TokenLoader(finite))) == 8000).sum()) == 20


def test_a_dropped_sub_dataset_resumes_identically():
    """A sub-dataset with no document of ``min_doc_len`` tokens is dropped from an endless
    stream; a resume at the same layout drops it again and continues token-identically."""
    short, long = Memory([2] * 40), Memory([6] * 40, 100)
    cfg = _config([("a", short, 1.0), ("b", long, 1.0)], num_shards=4, min_doc_len=5)
    ref = TokenLoader(cfg)
    _take(ref, 6)
    assert ref.readers[0]._active == ["b"]
    state = json.loads(json.dumps(ref.state_dict()))
    want = [b["input_ids"] for b in _take(ref, 8)]
    resumed = TokenLoader(cfg)
    resumed.load_state_dict(state)
    got = [b["input_ids"] for b in _take(resumed, 8)]
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(want, got, strict=True))
    # the same in `none` mode, where a reader's own blocks decide (here: none is long)
    one = _config([("a", Memory([2] * 8 + [9] * 8), 1.0)], num_shards=2, min_doc_len=5,
                  shuffle="none")  # fmt: skip
    readers = [TokenLoader(one, rank=r, world_size=2) for r in range(2)]
    assert len(_take(readers[1], 20)) == 20
    with pytest.raises(StopIteration):
        next(readers[0])


def test_an_endless_stream_refuses_a_reader_without_documents(tmp_path):
    write_arrow(tmp_path / "empty" / "part-000.arrow", [])
    with pytest.raises(LoaderInputError, match="'e' .*empty.* holds no documents"):
        TokenLoader(_config([("e", tmp_path / "empty", 1.0)]))
    three = Memory([5] * 3)
    for rank in range(4):  # every rank raises, not only the one left without documents
        with pytest.raises(LoaderInputError, match="reader 0 of 4 .*num_epochs=None"):
            TokenLoader(_config([("a", three, 1.0)]), rank=rank, world_size=4)
    # finite epochs (ranks end unevenly anyway) and local blocks (they move) are fine
    TokenLoader(_config([("a", three, 1.0)], num_epochs=1), rank=0, world_size=4)
    TokenLoader(_config([("a", three, 1.0)], shuffle="local"), rank=0, world_size=4)
    # a sub-dataset with no weight does not count; giving it one is checked too
    cfg = _config([("a", three, 1.0), ("b", Memory([5] * 40, 100), 0.0)])
    with pytest.raises(LoaderInputError, match="reader 0 of 4"):
        TokenLoader(cfg, rank=1, world_size=4)
    ok = TokenLoader(_config([("a", Memory([5] * 40), 1.0), ("b", three, 0.0)]), rank=1,
                     world_size=4)  # fmt: skip
    with pytest.raises(LoaderInputError, match="reader 0 of 4"):
        ok.set_weights({"a": 0.0, "b": 1.0})
    assert ok.state_dict()["weights"] == {"a": 1.0, "b": 0.0}  # refused before any change
    assert ok.readers[0].mixer.weights == {"a": 1.0, "b": 0.0}


def test_raising_num_epochs_on_resume_continues():
    """A finished run resumed with more epochs goes on, at the same layout as at another."""
    src = Memory([5] * 20)
    one = TokenLoader(_config([("a", src, 1.0)], num_shards=4, num_epochs=1))
    first = _body(list(one))
    state = json.loads(json.dumps(one.state_dict()))
    two = _config([("a", src, 1.0)], num_shards=4, num_epochs=2)
    same = TokenLoader(two)
    same.load_state_dict(state)
    second = _body(list(same))
    assert np.array_equal(np.sort(first), np.sort(second))  # each document once more
    halves = [TokenLoader(two, rank=r, world_size=2) for r in range(2)]
    for h in halves:
        h.load_state_dict([state])
    assert np.array_equal(np.sort(np.concatenate([_body(list(h)) for h in halves])),
                          np.sort(second))  # fmt: skip


def test_load_state_dict_leaves_its_argument_alone():
    cfg = _config([("a", Memory([7] * 40), 1.0), ("b", Memory([5] * 40, 100), 1.0)])
    ld = TokenLoader(cfg)
    _take(ld, 5)
    state = json.loads(json.dumps(ld.state_dict()))
    pristine = copy.deepcopy(state)
    other = _config([("a", Memory([7] * 40), 3.0), ("b", Memory([5] * 40, 100), 1.0)])
    TokenLoader(other).load_state_dict(state)  # its weights changed: counters restart
    assert state == pristine


@pytest.mark.parametrize(("old", "new"), [(1, None), (None, 1), (1, 3)])
@pytest.mark.parametrize("world", [1, 2])
def test_turning_bos_on_or_off_on_resume_keeps_every_token_once(old, new, world):
    """A partly emitted document's offset counts ``[BOS] tokens [EOS]``: a resume that
    turns BOS on or off shifts it, at the same layout and at another."""
    src = Memory([10] * 8)
    kw = dict(num_shards=2, num_epochs=1, seq_len=7, batch_size=1)
    first = TokenLoader(_config([("a", src, 1.0)], bos_id=old, **kw))
    got = [next(first) for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    for r in range(world):
        again = TokenLoader(_config([("a", src, 1.0)], bos_id=new, **kw), rank=r, world_size=world)
        again.load_state_dict([state])
        got += list(again)
    want = np.sort(np.concatenate([src.doc(i) for i in range(8)]))
    assert np.array_equal(np.sort(_body(got)), want)


def test_turning_eos_off_on_resume_ends_a_document_waiting_for_it():
    """A row that ended right after a document's last token leaves its EOS pending; with
    EOS turned off the document is done, and the stream goes on with the next one."""
    src = Memory([6] * 6)
    kw = dict(num_shards=1, num_epochs=1, batch_size=1, bos_id=None)
    first = TokenLoader(_config([("a", src, 1.0)], eos_id=2, seq_len=6, **kw))
    got = [next(first)]  # exactly one document's tokens: its EOS is next
    state = json.loads(json.dumps(first.state_dict()))
    again = TokenLoader(_config([("a", src, 1.0)], eos_id=None, seq_len=6, **kw))
    again.load_state_dict(state)
    rest = list(again)
    want = np.sort(np.concatenate([src.doc(i) for i in range(6)]))
    assert np.array_equal(np.sort(_body(got + rest)), want)
    assert all(int(b["segment_ids"].max()) == 1 for b in rest)  # one piece per row


def test_weights_given_to_a_sub_dataset_after_the_end_revive_the_stream():
    """A finite stream that ended with a weight-0 sub-dataset unread goes on when it gets
    a weight, in-process as with workers."""
    src = [("a", Memory([5] * 8), 1.0), ("b", Memory([5] * 8, 100), 0.0)]
    ld = TokenLoader(_config(src, num_shards=2, num_epochs=1))
    first = list(ld)
    ld.set_weights({"b": 1.0})
    rest = list(ld)
    assert first and rest and int((_body(rest) >= 101_000).sum()) == 40  # b's 8 x 5 tokens


class _Counted(Memory):
    """A :class:`Memory` that counts its document reads."""

    def __init__(self, lengths: list[int], base: int = 0) -> None:
        super().__init__(lengths, base)
        self.reads = 0

    def doc(self, i: int) -> np.ndarray:
        self.reads += 1
        return super().doc(i)


@pytest.mark.parametrize("rank", [0, 7])
def test_a_rare_long_document_does_not_hold_the_others_up(rank):
    """One long document among 2,000 short ones reaches a reader of 8 about once in 8
    epochs. Waiting on it, the reader serves the other sub-dataset after at most about two
    passes of skips (250 documents each) per document, instead of skipping until it comes."""
    rare = _Counted([1] * 2000)
    rare.lengths[0] = 10
    other = Memory([6] * 200, 10_000)
    cfg = _config([("a", rare, 1.0), ("b", other, 1.0)], min_doc_len=5)
    ld = TokenLoader(cfg, rank=rank, world_size=8)
    ids = _body([next(ld) for _ in range(3)])
    served = len(set((ids[ids >= 10_001_000] // 1000).tolist()))
    assert served >= 7 and rare.reads / served < 700, (served, rare.reads)


def test_passing_over_a_sub_dataset_resumes_identically():
    """Whether a sub-dataset is passed over is decided within one choice, from the
    cursors: a resumed reader passes over what the uninterrupted one did."""
    rare = Memory([1] * 2000)
    rare.lengths[0], rare.lengths[1500] = 10, 12
    cfg = _config([("a", rare, 1.0), ("b", Memory([6] * 200, 10_000), 1.0)], min_doc_len=5)
    ref = TokenLoader(cfg, rank=3, world_size=8)
    _take(ref, 4)
    state = json.loads(json.dumps(ref.state_dict()))
    want = [b["input_ids"] for b in _take(ref, 10)]
    again = TokenLoader(cfg, rank=3, world_size=8)
    again.load_state_dict(state)
    got = [b["input_ids"] for b in _take(again, 10)]
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(want, got, strict=True))


def _share(batches: list[dict], base: int) -> float:
    """Share of body tokens that come from the :class:`Memory` source of ``base``."""
    body = _body(batches)
    return float((body >= (base + 1) * 1000).mean())


def _small_mix(weight: float, docs: int = 3, **kw) -> LoaderConfig:
    """A 400-document sub-dataset and one of ``docs`` documents at ``weight``."""
    big, small = Memory([20] * 400), Memory([20] * docs, 10**5)
    return _config([("big", big, 1 - weight), ("small", small, weight)], **kw)


@pytest.mark.parametrize(("docs", "weight", "world"), [(3, 0.5, 4), (5, 0.3, 8), (6, 0.6, 8)])
def test_a_small_sub_dataset_keeps_its_share_over_all_readers(docs, weight, world):
    """With fewer documents than readers, only some readers own one; they serve it more
    often, so its share of all ranks' tokens is still its weight (without that, 3
    documents at 0.5 over 4 ranks took 0.37 of the tokens)."""
    cfg = _small_mix(weight, docs)
    got = [b for r in range(world) for b in _take(TokenLoader(cfg, rank=r, world_size=world), 150)]
    assert abs(_share(got, 10**5) - weight) < 0.01


def test_workers_make_up_for_readers_without_the_small_sub_dataset():
    """The same with the readers as DataLoader workers: 2 ranks x 2 workers."""
    cfg = _small_mix(0.5)
    got = []
    for r in range(2):
        with TokenLoader(cfg, rank=r, world_size=2, num_workers=2) as ld:
            got += _take(ld, 120)
    assert abs(_share(got, 10**5) - 0.5) < 0.01


def test_a_share_the_owners_cannot_serve_is_refused_on_every_rank():
    """3 documents reach 3 of 4 readers: at most 3/4 of the tokens. A weight above that
    is refused up front on every rank, by set_weights before anything changes; at 3/4 the
    owners serve nothing else. Finite epochs and local blocks are not concerned."""
    for rank in range(4):
        with pytest.raises(
            MixingShortfall,
            match=r"4 ranks x 1 workers: .*'small' \(3 doc"
            r"uments\) reaches only 3 of 4 readers .* at most 75\.0% .* 90\.0%",
        ):
            TokenLoader(_small_mix(0.9), rank=rank, world_size=4)  # fmt: skip
    TokenLoader(_small_mix(0.9, num_epochs=1), rank=0, world_size=4)
    TokenLoader(_small_mix(0.9, shuffle="local"), rank=0, world_size=4)
    edge = [b for r in range(4) for b in _take(TokenLoader(_small_mix(0.75), rank=r,
                                                           world_size=4), 100)]  # fmt: skip
    assert abs(_share(edge, 10**5) - 0.75) < 0.01
    ld = TokenLoader(_small_mix(0.5), rank=1, world_size=4)
    with pytest.raises(MixingShortfall, match="reaches only 3 of 4 readers"):
        ld.set_weights({"big": 0.05, "small": 0.95})
    assert ld.state_dict()["weights"] == {"big": 0.5, "small": 0.5}
    ld.set_weights({"big": 0.7, "small": 0.3})
    assert ld.readers[0].mixer.weights == {"big": 0.7, "small": 0.3}
    assert ld.readers[0].mixer.targets["small"] > 0.3  # rank 1 owns one of the 3


def test_a_shortfall_of_restored_weights_says_where_they_came_from(tmp_path):
    """Weights set by set_weights before a save are restored on resume; a shortfall
    quoted them without saying so, while the config showed others."""
    ld = TokenLoader(_small_mix(0.1))
    ld.set_weights({"big": 0.1, "small": 0.9})
    ld.save(tmp_path)
    four = TokenLoader(_small_mix(0.1), rank=0, world_size=4)  # the config's weights fit
    saved = r"\(the weights \{'big': 0.1, 'small': 0.9\} are the saved state's, set by set_w"
    with pytest.raises(MixingShortfall, match=r"reaches only 3 of 4 readers.*" + saved):
        four.load(tmp_path)
    one = TokenLoader(_small_mix(0.1))  # the layout they were set at still serves them
    one.load(tmp_path)
    assert one.state_dict()["weights"] == {"big": 0.1, "small": 0.9}


@pytest.mark.parametrize(("world", "workers"), [(4, 0), (2, 2)])
def test_a_made_up_share_resumes_identically(world, workers):
    """The readers' targets follow from the layout, so a resume at the same layout goes
    on token-identically, in-process as with workers (4 readers either way)."""
    cfg = _small_mix(0.5)
    ref = TokenLoader(cfg, rank=world // 2, world_size=world, num_workers=workers)
    assert ref._targets[0] is not None  # this layout's readers are boosted
    _take(ref, 5)
    state = json.loads(json.dumps(ref.state_dict()))
    want = [b["input_ids"] for b in _take(ref, 8)]
    ref.close()
    again = TokenLoader(cfg, rank=world // 2, world_size=world, num_workers=workers)
    again.load_state_dict(state)
    got = [b["input_ids"] for b in _take(again, 8)]
    again.close()
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(want, got, strict=True))
