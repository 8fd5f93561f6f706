"""Unit properties: index cipher, shard ownership, packing, mixing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loaders import DatasetSpec, LoaderConfig, TokenLoader
from loaders.errors import MixingShortfall
from loaders.mixing import Mixer, owners, reader_targets
from loaders.packing import write_piece
from loaders.permute import IndexCipher
from loaders.shards import logical_shard_of, owned_shards, shard_bounds
from tests.loaders_helpers import BOS, EOS, config, make_corpus


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 100, 1001, 4097, 65_537])
def test_cipher_is_a_bijection(n):
    perm = IndexCipher(n, key=1234)(np.arange(n))
    assert np.array_equal(np.sort(perm), np.arange(n))


def test_cipher_depends_on_key_and_is_pure():
    n = 10_007
    a = IndexCipher(n, 1)(np.arange(n))
    assert np.array_equal(a, IndexCipher(n, 1)(np.arange(n)))  # same key, same order
    b = IndexCipher(n, 2)(np.arange(n))
    assert (a != b).mean() > 0.9  # a different epoch key reshuffles
    assert (a != np.arange(n)).mean() > 0.9  # actually shuffles
    assert np.array_equal(IndexCipher(n, 1)(np.array([5, 77])), a[[5, 77]])  # random access
    with pytest.raises(ValueError, match="out of range"):
        IndexCipher(n, 1)(n)


@pytest.mark.parametrize("L", [7, 35, 1024])
def test_ownership_is_disjoint_and_covering(L):
    for world in (1, 2, 3, 5, 7):
        for workers in (1, 2, 3):
            if world * workers > L:
                with pytest.raises(ValueError, match="num_shards"):
                    owned_shards(L, 0, world, 0, workers)
                continue
            seen = [
                s
                for r in range(world)
                for w in range(workers)
                for s in owned_shards(L, r, world, w, workers)
            ]
            assert sorted(seen) == list(range(L))


@pytest.mark.parametrize("n,L", [(1000, 7), (35, 35), (101, 35), (5, 35)])
def test_logical_shard_of_matches_bounds(n, L):
    for s in range(L):
        lo, hi = shard_bounds(n, L, s)
        for p in range(lo, hi):
            assert logical_shard_of(p, n, L) == s


@pytest.mark.parametrize("bos,eos", [(None, None), (BOS, None), (None, EOS), (BOS, EOS)])
def test_write_piece_splits_streams_exactly(bos, eos):
    toks = np.arange(1000, 1013)
    stream = ([bos] if bos is not None else []) + toks.tolist() + ([eos] if eos is not None else [])
    for width in (1, 2, 5, 40):
        out, off = [], 0
        while off < len(stream):
            row = np.full(width, -1)
            k = write_piece(row, 0, toks, off, bos, eos)
            assert k == min(width, len(stream) - off) and (row[k:] == -1).all()
            out += row[:k].tolist()
            off += k
        assert out == stream


def test_packing_exact_lengths_bos_eos_and_segments(tmp_path):
    docs = make_corpus(tmp_path / "a", 53, seed=3)
    for causal in (False, True):
        cfg = config(
            [("a", tmp_path / "a", 1.0)], num_epochs=1, seq_len=50, causal=causal, shuffle="none"
        )
        batches = list(TokenLoader(cfg))
        assert all(b["input_ids"].shape[1] == (51 if causal else 50) for b in batches)
        assert all(b["input_ids"].shape[0] == 3 for b in batches[:-1])
        ids = np.concatenate([b["input_ids"].numpy().reshape(-1) for b in batches])
        seg = np.concatenate([b["segment_ids"].numpy().reshape(-1) for b in batches])
        body = ids[seg > 0]
        expected = [[BOS, *d.tolist(), EOS] for d in docs.values() if len(d)]
        got_docs = np.split(body, np.nonzero(body == BOS)[0][1:])
        assert sorted(map(tuple, (d.tolist() for d in got_docs))) == sorted(map(tuple, expected))
        assert (ids[seg == 0] == 0).all() and (
            seg == 0
        ).sum() < cfg.row_len  # only the last row pads


def test_provenance_traces_every_token_to_its_document_and_offset(tmp_path):
    """``doc_ids``/``doc_offsets`` name each token's source: over one epoch of two
    sub-datasets, every (document, offset) of every stream appears exactly once, and the
    traceable token values agree with the pairs."""
    docs = make_corpus(tmp_path / "a", 30, seed=5, max_len=40)
    docs |= make_corpus(tmp_path / "b", 20, first_id=500, seed=6, max_len=40)
    cfg = config([("a", tmp_path / "a", 0.7), ("b", tmp_path / "b", 0.3)], seq_len=32,
                 num_epochs=1, provenance=True)  # fmt: skip
    batches = list(TokenLoader(cfg))
    ids, doc, off = (np.concatenate([b[k].numpy().reshape(-1) for b in batches])
                     for k in ("input_ids", "doc_ids", "doc_offsets"))  # fmt: skip
    assert ((doc == -1) == (ids == 0)).all() and ((off == -1) == (doc == -1)).all()
    real = doc >= 0
    pairs = set(zip(doc[real].tolist(), off[real].tolist(), strict=True))
    assert len(pairs) == real.sum()  # no (document, offset) twice
    assert (ids[real & (off == 0)] == BOS).all()
    body = real & (ids >= 1000)
    assert (ids[body] % 1000 == off[body] - 1).all()  # offset = position + 1 (BOS first)
    owner: dict[int, int] = {}  # provenance document -> traceable document
    for d, g in zip(doc[body].tolist(), (ids[body] // 1000).tolist(), strict=True):
        assert owner.setdefault(d, g) == g
    assert sorted(owner.values()) == sorted(g + 1 for g, d in docs.items() if len(d))
    assert {d >> 32 for d in owner} == {0, 1}
    streams = sum(len(d) + 2 for d in docs.values() if len(d))
    assert len(pairs) == streams
    plain = next(TokenLoader(config([("a", tmp_path / "a", 1.0)], seq_len=32)))
    assert set(plain) == {"input_ids", "segment_ids"}  # off by default


def test_segment_ids_restart_per_document(tmp_path):
    make_corpus(tmp_path / "a", 20, seed=4)
    b = next(TokenLoader(config([("a", tmp_path / "a", 1.0)], seq_len=200)))
    ids, seg = b["input_ids"].numpy(), b["segment_ids"].numpy()
    for r in range(ids.shape[0]):
        starts = np.nonzero(ids[r] == BOS)[0]
        for s in starts:
            assert seg[r, s] == (seg[r, s - 1] + 1 if s > 0 else 1)
        assert (np.diff(seg[r]) >= 0).all()


def test_mixer_rules():
    m = Mixer({"a": 0.75, "b": 0.25})
    picks = []
    for _ in range(400):
        d = m.choose(["a", "b"])
        m.add(d, 10)
        picks.append(d)
    assert picks.count("a") == 300
    with pytest.raises(ValueError, match="unknown sub-datasets \\['c'\\]"):
        m.set_weights({"c": 1.0})
    with pytest.raises(ValueError, match="all 0"):
        m.set_weights({"a": 0.0, "b": 0.0})


def _shares(batches):
    ids = np.concatenate([b["input_ids"].numpy().reshape(-1) for b in batches])
    ids = ids[ids >= 1000]
    a = (ids < 1_000_000).sum()  # sub-dataset a: ids < 1000 -> tokens < 1,001,000
    return a / len(ids)


def test_mixing_shares_converge_and_reweight_keeps_positions(tmp_path):
    make_corpus(tmp_path / "a", 211, first_id=0, seed=5)
    make_corpus(tmp_path / "b", 97, first_id=5000, seed=6)
    cfg = config(
        [("a", tmp_path / "a", 0.7), ("b", tmp_path / "b", 0.3)], seq_len=1024, batch_size=4
    )
    ld = TokenLoader(cfg)
    n = 1_000_000 // (1024 * 4) + 1  # >= 1M tokens
    batches = [next(ld) for _ in range(n)]
    assert abs(_shares(batches) - 0.7) < 0.01
    before = ld.state_dict()["readers"][0]["shards"]
    ld.set_weights({"a": 0.2, "b": 0.8})
    after = ld.state_dict()["readers"][0]["shards"]
    assert before == after  # no sub-dataset lost its position
    batches = [next(ld) for _ in range(n)]
    assert abs(_shares(batches) - 0.2) < 0.01
    state = json.loads(json.dumps(ld.state_dict()))
    cfg2 = config(
        [("a", tmp_path / "a", 0.5), ("b", tmp_path / "b", 0.5)], seq_len=1024, batch_size=4
    )
    ld2 = TokenLoader(cfg2)
    ld2.load_state_dict(state)  # the config's weights changed: they win on resume
    assert ld2.state_dict()["weights"] == {"a": 0.5, "b": 0.5}
    assert ld2.state_dict()["readers"][0]["shards"] == state["readers"][0]["shards"]
    batches = [next(ld2) for _ in range(n)]
    assert abs(_shares(batches) - 0.5) < 0.01


def test_state_is_small_for_a_million_documents():
    class Fake:
        num_docs = 1_000_000

        def doc(self, i):
            return np.full(700, 1000 + i % 7, dtype=np.int32)

    specs = [
        DatasetSpec(name="web", path=Fake(), weight=0.7),
        DatasetSpec(name="code", path=Fake()),
    ]
    cfg = LoaderConfig(datasets=specs, seq_len=4096, batch_size=2, bos_id=BOS, eos_id=EOS)
    ld = TokenLoader(cfg)
    for _ in range(5):
        next(ld)
    for sc in ld.readers[0].shards.values():  # worst case: late epoch, long docs
        sc.epoch = [99] * len(sc.ids)
        sc.counter = [976] * len(sc.ids)
        sc.offset = [123_456] * len(sc.ids)
    size = len(json.dumps(ld.state_dict()).encode())
    assert size <= 64 * 1024, size


def test_reader_targets_meet_the_weights_at_scale():
    """64 ranks x 4 workers over 1,024 shards: a 100-document sub-dataset reaches 100 of
    the 256 readers. At weight 0.05 the owners' targets give it 5% of all tokens (the mean
    of the readers' shares); at 0.5 no split can, and the message names the 39.1% it can
    reach. With every reader owning a document of each, the weights are used as they are."""
    docs, weights = {"web": 10**6, "rare": 100}, {"web": 0.95, "rare": 0.05}
    assert owners(docs, 1024, 256)[:, 1].sum() == 100
    rows = reader_targets(weights, docs, 1024, 256, range(256))
    shares = np.array([[r[n] / sum(r.values()) for n in docs] for r in rows]).mean(axis=0)
    assert np.allclose(shares, [0.95, 0.05], atol=1e-9)
    assert {r["rare"] == 0 for r in rows} == {True, False}
    with pytest.raises(MixingShortfall, match=r"'rare' \(100 documents\) reaches only 100 of "
                       r"256 readers .* at most 39\.1%"):  # fmt: skip
        reader_targets({"web": 0.5, "rare": 0.5}, docs, 1024, 256, [0])
    assert reader_targets(weights, {"web": 10**6, "rare": 5000}, 1024, 256, [0]) is None
    assert reader_targets({"web": 1.0, "rare": 0.0}, docs, 1024, 256, [0]) is None
