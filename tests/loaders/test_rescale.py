"""Exactly-once across N -> M rescales with an endless stream (``num_epochs=None``).

A reader's shards finish an epoch at different times (sizes differ by one document, and after
a rescale the merged shards come from old readers that stopped at different points). The
reader must still serve every pending document of the current epoch before any document of
the next one, or a next-epoch document (a new shuffle) repeats one already emitted while
others of the epoch are still missing.

Checks, per case: each reader's stream of every sub-dataset, with ``num_epochs=None``, starts
with exactly what the same reader emits with ``num_epochs=1`` (the rest of the epoch, drained),
and the epoch-0 tokens emitted before the save plus the drained rest after the rescale are the
corpus, each body token once.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from loaders import TokenLoader
from tests.loaders_helpers import body_tokens, config, expected_tokens, make_corpus, take

_B_FIRST = 5000  # first document id of sub-dataset "b"


def _roundtrip(state):
    return json.loads(json.dumps(state))


def _split(batches: list[dict]) -> dict[str, np.ndarray]:
    """Body tokens of each sub-dataset, in emission order."""
    toks = body_tokens(batches)
    in_a = toks // 1000 - 1 < _B_FIRST
    return {"a": toks[in_a], "b": toks[~in_a]}


def _endless_prefix(loader: TokenLoader, rest: dict[str, np.ndarray], what: str) -> None:
    """``loader`` (num_epochs=None) first emits ``rest`` (same reader with num_epochs=1)."""
    got, batches = {"a": [], "b": []}, 0
    cap = 4 * sum(len(v) for v in rest.values()) + 16
    while any(sum(map(len, got[d])) < len(rest[d]) for d in rest) and batches < cap:
        for d, t in _split([next(loader)]).items():
            got[d].append(t)
        batches += 1
    for d, want in rest.items():
        seq = np.concatenate(got[d]) if got[d] else np.zeros(0, dtype=np.int64)
        assert np.array_equal(seq[: len(want)], want), (
            f"{what}: sub-dataset {d!r} leaves its epoch before finishing it"
        )


def _check_case(root, docs, *, old, new, steps, **kw) -> None:
    specs = [("a", root / "a", 0.6), ("b", root / "b", 0.4)]
    endless, once = config(specs, **kw), config(specs, num_epochs=1, **kw)
    epoch0, states = [], []
    for r in range(old):
        ld = TokenLoader(endless, rank=r, world_size=old)
        before = _split(take(ld, steps))
        states.append(_roundtrip(ld.state_dict()))
        whole = _split(list(TokenLoader(once, rank=r, world_size=old)))
        _endless_prefix(TokenLoader(endless, rank=r, world_size=old), whole, f"rank {r}/{old}")
        for d, t in before.items():
            epoch0.append(t[: len(whole[d])])  # past the reader's epoch: next epoch's tokens
    for r in range(new):
        drain = TokenLoader(once, rank=r, world_size=new)
        drain.load_state_dict(states)
        rest = _split(list(drain))
        epoch0 += list(rest.values())
        cont = TokenLoader(endless, rank=r, world_size=new)
        cont.load_state_dict(states)
        _endless_prefix(cont, rest, f"after {old} -> {new}, rank {r}")
    got = np.sort(np.concatenate(epoch0))
    assert len(np.unique(got)) == len(got), "a body token emitted twice in one epoch"
    assert np.array_equal(got, expected_tokens(docs)), "the epoch is not covered exactly"


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("rescale")
    docs = make_corpus(root / "a", 40, first_id=0, seed=1, max_len=60)
    docs |= make_corpus(root / "b", 30, first_id=_B_FIRST, seed=2, max_len=60)
    return root, docs


def test_two_to_one_mid_epoch_repeats_nothing(small_corpus):
    """The reported case: 2 ranks x 10 batches, merged into 1 rank, 20 more batches."""
    root, _ = small_corpus
    cfg = config([("a", root / "a", 0.6), ("b", root / "b", 0.4)], seq_len=16, batch_size=2)
    old = [TokenLoader(cfg, rank=r, world_size=2) for r in range(2)]
    before = body_tokens([next(ld) for _ in range(10) for ld in old])
    one = TokenLoader(cfg, rank=0, world_size=1)
    one.load_state_dict([_roundtrip(ld.state_dict()) for ld in old])
    after = body_tokens(take(one, 20))
    both = np.concatenate([before, after])
    assert len(np.unique(both)) == len(both)


def test_uninterrupted_reader_finishes_its_epoch_before_the_next(small_corpus):
    """Shards of 1 and 2 documents (40 docs, 35 shards): no early next-epoch document."""
    root, docs = small_corpus
    _check_case(root, docs, old=1, new=1, steps=0, seq_len=16, batch_size=2)


@pytest.mark.parametrize("seed", range(8))
def test_rescale_grid_is_exactly_once(tmp_path, seed):
    rng = np.random.default_rng(seed)
    max_len = int(rng.choice([6, 40, 150]))
    n_a, n_b = int(rng.integers(8, 45)), int(rng.integers(3, 40))
    docs = make_corpus(tmp_path / "a", n_a, first_id=0, seed=seed, max_len=max_len)
    docs |= make_corpus(
        tmp_path / "b", n_b, first_id=_B_FIRST, seed=seed + 50, max_len=max_len,
        zero_every=int(rng.choice([0, 5])),
    )  # fmt: skip
    total = sum(len(d) + 2 for d in docs.values())
    kw = dict(
        seq_len=int(rng.choice([3, 8, 16, 37])),
        batch_size=int(rng.integers(1, 4)),
        num_shards=int(rng.choice([7, 35])),
        shuffle=str(rng.choice(["global", "global", "local", "none"])),
    )
    per_step = kw["batch_size"] * (kw["seq_len"] + 1)
    for old in (1, 2, 3):
        for new in (1, 2, 3):
            # from a few rows up to past a reader's whole share of the epoch
            steps = int(rng.integers(0, 1.3 * total / (old * per_step) + 2))
            _check_case(tmp_path, docs, old=old, new=new, steps=steps, **kw)
