"""Exactly-once epochs, token-identical resume, and rescaling at any N -> M (in-process)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loaders import TokenLoader
from tests.loaders_helpers import body_tokens, config, expected_tokens, make_corpus, take


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    a = make_corpus(root / "a", 211, first_id=0, seed=11, files=5)
    b = make_corpus(root / "b", 97, first_id=5000, seed=12, files=2, zero_every=13)
    return root, {**a, **b}


def _cfg(root, **kw):
    return config([("a", root / "a", 0.7), ("b", root / "b", 0.3)], **kw)


def _roundtrip(state):
    return json.loads(json.dumps(state))


@pytest.mark.parametrize("shuffle", ["global", "local", "none"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_exactly_once_per_epoch(corpus, world, shuffle):
    root, docs = corpus
    cfg = _cfg(root, num_epochs=1, shuffle=shuffle)
    batches = [b for r in range(world) for b in TokenLoader(cfg, rank=r, world_size=world)]
    assert np.array_equal(np.sort(body_tokens(batches)), expected_tokens(docs))


def test_two_epochs_see_each_document_twice_in_a_new_order(corpus):
    root, docs = corpus
    batches = list(TokenLoader(_cfg(root, num_epochs=2, seq_len=4096, batch_size=1)))
    toks = body_tokens(batches)
    assert np.array_equal(np.sort(toks), expected_tokens(docs, 2))
    firsts = toks[(toks % 1000) == 0] // 1000  # order of document starts
    half = len(firsts) // 2
    assert sorted(firsts[:half]) != list(firsts[:half])  # shuffled
    assert list(firsts[:half]) != list(firsts[half:])  # reshuffled per epoch


def test_order_is_a_pure_function_of_seed(corpus):
    root, _ = corpus
    a = body_tokens(take(TokenLoader(_cfg(root)), 20))
    b = body_tokens(take(TokenLoader(_cfg(root)), 20))
    c = body_tokens(take(TokenLoader(_cfg(root, seed=1)), 20))
    assert np.array_equal(a, b) and not np.array_equal(a[:500], c[:500])


def test_resume_is_token_identical_after_any_step(corpus):
    root, _ = corpus
    cfg = _cfg(root, seq_len=61)
    ref = TokenLoader(cfg)
    checkpoints, stream = {}, []
    save_at = set(range(31)) | {1000}
    for step in range(1021):
        if step in save_at:
            checkpoints[step] = _roundtrip(ref.state_dict())
        stream.append(next(ref)["input_ids"])
    mid_doc = 0
    for step, state in checkpoints.items():
        mid_doc += state["readers"][0]["current"] is not None
        ld = TokenLoader(cfg)
        ld.load_state_dict(state)
        for k in range(step, min(step + 20, len(stream))):
            assert torch_equal(next(ld)["input_ids"], stream[k]), (step, k)
    assert mid_doc >= 25  # most checkpoints fall inside a document


def torch_equal(a, b):
    return bool((a == b).all()) and a.shape == b.shape


def test_resume_from_files_with_changed_batch_shape(corpus, tmp_path):
    root, docs = corpus
    ld = TokenLoader(_cfg(root, num_epochs=1))
    before = take(ld, 9)
    ld.save(tmp_path / "ckpt", step=9)
    ld2 = TokenLoader(_cfg(root, num_epochs=1, seq_len=17, batch_size=5))  # packing may change
    ld2.load(tmp_path / "ckpt")
    after = list(ld2)
    assert np.array_equal(np.sort(body_tokens(before + after)), expected_tokens(docs))


def _run_rescale(root, docs, old, new, *, epochs=1, steps=lambda r: 3 + 2 * r, workers=(0, 0)):
    cfg = _cfg(root, num_epochs=epochs)
    seen, states = [], []
    for r in range(old):
        ld = TokenLoader(cfg, rank=r, world_size=old, num_workers=workers[0])
        seen += take(ld, steps(r))
        states.append(_roundtrip(ld.state_dict()))
        ld._close()
    for r in range(new):
        ld = TokenLoader(cfg, rank=r, world_size=new, num_workers=workers[1])
        ld.load_state_dict(states)
        seen += list(ld)
    return np.sort(body_tokens(seen)), expected_tokens(docs, epochs)


@pytest.mark.parametrize("new", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("old", [1, 2, 3, 4])
def test_rescale_mid_epoch_is_exactly_once(corpus, old, new):
    root, docs = corpus
    got, want = _run_rescale(root, docs, old, new)
    assert len(got) == len(want)  # no repeat before the epoch ends...
    assert np.array_equal(got, want)  # ...and full coverage after


def test_rescale_across_an_epoch_boundary(corpus):
    root, docs = corpus
    got, want = _run_rescale(root, docs, 3, 5, epochs=2, steps=lambda r: 60 + 7 * r)
    assert np.array_equal(got, want)


def test_state_of_one_rank_restores_only_that_rank(corpus):
    root, _ = corpus
    cfg = _cfg(root)
    ld = TokenLoader(cfg, rank=1, world_size=2)
    take(ld, 4)
    state = _roundtrip(ld.state_dict())
    ref = take(ld, 3)
    again = TokenLoader(cfg, rank=1, world_size=2)
    again.load_state_dict(state)  # a rank's own file is enough at an unchanged layout
    assert all(
        torch_equal(a["input_ids"], b["input_ids"])
        for a, b in zip(take(again, 3), ref, strict=True)
    )
    with pytest.raises(ValueError, match="pass every rank's state"):
        TokenLoader(cfg, rank=0, world_size=3).load_state_dict(state)


def test_set_weights_then_resume_replays_the_mid_run_weights(corpus):
    root, _ = corpus
    cfg = _cfg(root)
    ld = TokenLoader(cfg)
    take(ld, 5)
    ld.set_weights({"b": 0.9})
    take(ld, 5)
    state = _roundtrip(ld.state_dict())
    ref = take(ld, 10)
    again = TokenLoader(cfg)  # same config as at save time: the state's weights win
    again.load_state_dict(state)
    assert again.state_dict()["weights"] == {"a": 0.7, "b": 0.9}
    assert all(
        torch_equal(a["input_ids"], b["input_ids"])
        for a, b in zip(take(again, 10), ref, strict=True)
    )


def test_new_sub_dataset_can_join_on_resume(corpus, tmp_path):
    root, docs = corpus
    extra = make_corpus(tmp_path / "c", 31, first_id=9000, seed=13)
    ld = TokenLoader(config([("a", root / "a", 1.0)], num_epochs=1))
    before = take(ld, 5)
    state = _roundtrip(ld.state_dict())
    ld2 = TokenLoader(config([("a", root / "a", 1.0), ("c", tmp_path / "c", 1.0)], num_epochs=1))
    ld2.load_state_dict(state)
    after = list(ld2)
    a_docs = {g: d for g, d in docs.items() if g < 5000}
    assert np.array_equal(
        np.sort(body_tokens(before + after)), expected_tokens({**a_docs, **extra})
    )
