"""Real multi-process DataLoader workers, checkpoint files, and the torch.distributed glue."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import loaders.checkpoint as ckpt
from loaders import LoaderInputError, TokenLoader, load_states, state_path
from loaders.loader import resolve_rank_world
from tests.loaders_helpers import body_tokens, config, expected_tokens, make_corpus, take


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    a = make_corpus(root / "a", 157, first_id=0, seed=21, files=3)
    b = make_corpus(root / "b", 89, first_id=5000, seed=22, files=2)
    return root, {**a, **b}


def _cfg(root, **kw):
    return config([("a", root / "a", 0.6), ("b", root / "b", 0.4)], **kw)


def test_multiprocess_dataloader_epoch_is_exactly_once(corpus):
    root, docs = corpus
    cfg = _cfg(root, num_epochs=1)
    batches = [b for r in range(2) for b in TokenLoader(cfg, rank=r, world_size=2, num_workers=2)]
    assert all(set(b) == {"input_ids", "segment_ids"} for b in batches)
    assert np.array_equal(np.sort(body_tokens(batches)), expected_tokens(docs))


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_dataloader_resume_is_identical_and_worker_count_can_change(corpus):
    root, docs = corpus
    cfg = _cfg(root)
    ld = TokenLoader(cfg, num_workers=2, prefetch_factor=3)
    take(ld, 7)  # odd: the next batch is due from worker 1, and workers have prefetched ahead
    state = json.loads(json.dumps(ld.state_dict()))
    assert state["next_worker"] == 1 and len(state["readers"]) == 2
    ref = take(ld, 6)
    ld._close()
    again = TokenLoader(cfg, num_workers=2)
    again.load_state_dict(state)
    got = take(again, 6)
    again._close()
    assert all(
        bool((a["input_ids"] == b["input_ids"]).all()) for a, b in zip(got, ref, strict=True)
    )
    # 2 workers -> 3 workers and 0 workers mid-epoch: still exactly once
    fin = _cfg(root, num_epochs=1)
    first = TokenLoader(fin, num_workers=2)
    seen = take(first, 5)
    state = json.loads(json.dumps(first.state_dict()))
    first._close()
    second = TokenLoader(fin, num_workers=3)
    second.load_state_dict(state)
    seen += take(second, 4)
    state = json.loads(json.dumps(second.state_dict()))
    second._close()
    third = TokenLoader(fin, num_workers=0)
    third.load_state_dict(state)
    seen += list(third)
    assert np.array_equal(np.sort(body_tokens(seen)), expected_tokens(docs))


def test_set_weights_with_workers_restarts_exactly(corpus):
    root, docs = corpus
    ld = TokenLoader(_cfg(root, num_epochs=1), num_workers=2)
    seen = take(ld, 3)
    ld.set_weights({"a": 0.1, "b": 0.9})
    seen += list(ld)
    assert ld.state_dict()["weights"] == {"a": 0.1, "b": 0.9}
    assert np.array_equal(np.sort(body_tokens(seen)), expected_tokens(docs))


def test_atomic_save_keeps_previous_file_on_crash(corpus, tmp_path, monkeypatch):
    root, _ = corpus
    ld = TokenLoader(_cfg(root))
    take(ld, 2)
    ld.save(tmp_path, step=2)
    good = state_path(tmp_path, 0).read_text()
    take(ld, 2)

    def crash(*a, **k):
        raise OSError("disk died mid-save")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="mid-save"):
        ld.save(tmp_path, step=4)
    monkeypatch.undo()
    assert state_path(tmp_path, 0).read_text() == good  # previous checkpoint intact
    assert [p.name for p in tmp_path.iterdir()] == ["loader_rank00000.json"]  # no temp left


def test_background_save_and_stale_rank_files(corpus, tmp_path):
    root, _ = corpus
    cfg = _cfg(root)
    for r in range(3):
        ld = TokenLoader(cfg, rank=r, world_size=3)
        take(ld, 1 + r)
        fut = ld.save(tmp_path, background=True, step=7)
        assert fut.result() == state_path(tmp_path, r)
    assert len(load_states(tmp_path)) == 3
    small = TokenLoader(cfg, rank=0, world_size=1)
    small.load(tmp_path)  # 3 -> 1
    small.save(tmp_path, step=8)  # rank 0 drops the now stale files of ranks 1 and 2
    assert [s["world_size"] for s in load_states(tmp_path)] == [1]


def test_incomplete_checkpoint_folder_is_refused(corpus, tmp_path):
    root, _ = corpus
    for r in range(3):
        TokenLoader(_cfg(root), rank=r, world_size=3).save(tmp_path, step=1)
    state_path(tmp_path, 1).unlink()
    with pytest.raises(ValueError, match="ranks \\[0, 2\\] but world_size=3.*previous checkpoint"):
        TokenLoader(_cfg(root)).load(tmp_path)
    TokenLoader(_cfg(root), rank=1, world_size=3).save(tmp_path, step=2)
    with pytest.raises(ValueError, match=r"different points \(step 1, step 2\)"):
        TokenLoader(_cfg(root)).load(tmp_path)
    # the same states handed over as a list (not read from the folder) are refused too
    states = [json.loads(state_path(tmp_path, r).read_text()) for r in range(3)]
    with pytest.raises(ValueError, match=r"ranks \[0, 1, 2\] were saved at different points"):
        TokenLoader(_cfg(root)).load_state_dict(states)
    with pytest.raises(FileNotFoundError, match="no loader state files"):
        TokenLoader(_cfg(root)).load(tmp_path / "nothing")
    assert ckpt.STATE_VERSION == 1


def test_a_second_loader_saved_into_one_folder_keeps_the_first_ones_file(corpus, tmp_path):
    """A validation loader saved into the training loader's folder replaced its file
    (both rank 0), and loading the folder then blamed a sub-dataset the config lacked."""
    root, _ = corpus
    train = TokenLoader(_cfg(root))
    take(train, 3)
    train.save(tmp_path, step=5)
    kept = state_path(tmp_path, 0).read_text()
    val = TokenLoader(config([("b", root / "b", 1.0)]))
    with pytest.raises(LoaderInputError, match="holds another loader's state .*a folder of its"):
        val.save(tmp_path, step=5)
    with pytest.raises(LoaderInputError, match="holds another loader's state"):
        val.save(tmp_path, background=True, step=5)  # refused on the caller's thread
    assert state_path(tmp_path, 0).read_text() == kept
    val.save(tmp_path / "val", step=5)
    # a folder no live loader of this process holds is an earlier run's: saved over
    gone = TokenLoader(_cfg(root))
    gone.save(tmp_path / "old", step=5)
    del gone
    val.save(tmp_path / "old", step=5)
    assert load_states(tmp_path / "old")[0]["fingerprint"]["docs"].keys() == {"b"}
    # a resumed process: the training loader loaded its folder (its file is older than
    # the process), and the validation loader's save there is still refused
    resumed = TokenLoader(_cfg(root))
    resumed.load(tmp_path)
    with pytest.raises(LoaderInputError, match="which this process loaded or saved there"):
        TokenLoader(config([("b", root / "b", 1.0)])).save(tmp_path, step=5)
    assert state_path(tmp_path, 0).read_text() == kept
    # the holder's background save still queued: judged by its fingerprint, not its file
    fresh = tmp_path / "fresh"
    queued = train.save(fresh, background=True, step=6)
    with pytest.raises(LoaderInputError, match="holds another loader's state"):
        val.save(fresh, step=6)
    queued.result()
    assert load_states(fresh)[0]["fingerprint"]["docs"].keys() == {"a", "b"}
    # the folder deleted (its saves done): a claim on nothing, which said a state there
    # "is kept"; a new loader saves into it
    import shutil

    shutil.rmtree(fresh)
    val.save(fresh, step=6)
    assert load_states(fresh)[0]["fingerprint"]["docs"].keys() == {"b"}
    # the same run saves over its own files, with a sub-dataset added on the way
    more = TokenLoader(config([("a", root / "a", 0.6), ("b", root / "b", 0.4),
                               ("c", root / "b", 0.0)]))  # fmt: skip
    more.load(tmp_path)
    more.save(tmp_path, step=6)
    assert load_states(tmp_path)[0]["step"] == 6
    # a hand-made copy of a rank file was "a rank file is missing"
    (tmp_path / "loader_rank0.json").write_text(state_path(tmp_path, 0).read_text())
    with pytest.raises(LoaderInputError, match=r"rank 0's loader state twice \(loader_rank0.json"):
        load_states(tmp_path)


def test_unmarked_saves_into_one_folder_are_told_apart(corpus, tmp_path):
    # save(dir) without a step, into a folder reused each round: a rank that saved again
    # while another did not (it died first) left files of two rounds, which loaded
    # silently and repeated the tokens between them
    root, _ = corpus
    loaders = [TokenLoader(_cfg(root), rank=r, world_size=2) for r in range(2)]
    for ld in loaders:
        take(ld, 2)
        ld.save(tmp_path)
    take(loaders[1], 2)
    loaders[1].save(tmp_path)
    with pytest.raises(ValueError, match=r"different points \(save 1, save 2\)"):
        TokenLoader(_cfg(root)).load(tmp_path)
    take(loaders[0], 2)
    loaders[0].save(tmp_path)  # the round completed: one save
    merged = TokenLoader(_cfg(root))
    merged.load(tmp_path)
    # the resumed run counts on from there: its next round is save 3 on every rank
    again = [TokenLoader(_cfg(root), rank=r, world_size=3) for r in range(3)]
    for ld in again:
        ld.load(tmp_path)
    out = tmp_path / "next"
    for ld in again:
        ld.save(out)
    assert {s["save"] for s in load_states(out)} == {3}


def test_a_rank_file_renamed_by_hand_is_named(corpus, tmp_path):
    root, _ = corpus
    for r in range(2):
        TokenLoader(_cfg(root), rank=r, world_size=2).save(tmp_path, step=1)
    state_path(tmp_path, 1).write_text(state_path(tmp_path, 0).read_text())
    with pytest.raises(ValueError, match=r"loader_rank00001.json holds the state of rank 0"):
        TokenLoader(_cfg(root)).load(tmp_path)


def test_rank_and_world_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "5")
    assert resolve_rank_world() == (2, 5)
    assert resolve_rank_world(1, 3) == (1, 3)
    with pytest.raises(ValueError, match="rank 5 is outside world_size 5"):
        resolve_rank_world(5)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert resolve_rank_world() == (0, 1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        monkeypatch.setenv("RANK", "3")
        monkeypatch.setenv("WORLD_SIZE", "9")
        assert resolve_rank_world() == (0, 1)  # the process group wins over env vars
    finally:
        dist.destroy_process_group()
    assert torch.distributed.is_available()


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_a_dropped_loader_stops_its_workers_at_once_and_close_resumes_in_place(corpus):
    """The worker stream held its loader (a reference cycle): a loader dropped mid-stream
    kept its worker processes until the cycle collector ran, and that collection then
    stalled about 5 s per worker. Now dropping it, or ``close()``, stops them at once."""
    import gc
    import multiprocessing
    import time

    root, _ = corpus
    cfg = _cfg(root)
    was = gc.isenabled()
    gc.disable()  # only reference counts may free the loader
    try:
        ld = TokenLoader(cfg, num_workers=2)
        take(ld, 2)
        assert len(multiprocessing.active_children()) >= 2
        del ld
        deadline = time.monotonic() + 20
        while multiprocessing.active_children() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not multiprocessing.active_children()
    finally:
        if was:
            gc.enable()
    # close() stops the workers; the next batch starts new ones where the stream was
    ref = take(TokenLoader(cfg, num_workers=2), 7)
    with TokenLoader(cfg, num_workers=2) as ld:
        got = take(ld, 3)
        ld.close()
        assert not multiprocessing.active_children()
        got += take(ld, 4)
    assert not multiprocessing.active_children()
    assert all(
        bool((a["input_ids"] == b["input_ids"]).all()) for a, b in zip(got, ref, strict=True)
    )


def test_a_failed_save_retried_keeps_the_ranks_counts_equal(corpus, tmp_path, monkeypatch):
    # the count went up before the write: a rank that retried a failed save was one ahead
    # of the others from then on, and every later round in the folder was refused
    import errno

    import loaders.checkpoint as ckpt_module

    root, _ = corpus
    loaders = [TokenLoader(_cfg(root), rank=r, world_size=2) for r in range(2)]
    real = ckpt_module.atomic_write_text
    failures = [OSError(errno.ENOSPC, "No space left on device")]

    def flaky(path, text, **kw):
        if failures and "rank00001" in str(path):
            raise failures.pop()
        return real(path, text, **kw)

    monkeypatch.setattr(ckpt_module, "atomic_write_text", flaky)
    loaders[0].save(tmp_path)
    with pytest.raises(OSError):
        loaders[1].save(tmp_path)
    loaders[1].save(tmp_path)  # retried
    TokenLoader(_cfg(root)).load(tmp_path)
    failures.append(OSError(errno.ENOSPC, "No space left on device"))
    loaders[0].save(tmp_path, background=True).result()
    with pytest.raises(OSError):
        loaders[1].save(tmp_path, background=True).result()
    loaders[1].save(tmp_path, background=True).result()
    assert {s["save"] for s in load_states(tmp_path)} == {2}


def test_bad_input_met_by_a_worker_is_one_line(tmp_path):
    """A LoaderInputError raised in a worker reached the caller wrapped in torch's worker
    traceback (26 lines); bad input is one line, of its own class."""
    make_corpus(tmp_path / "a", 30, files=3)
    TokenLoader(config([("a", tmp_path / "a", 1.0)], num_shards=4))  # writes the counts
    path = tmp_path / "a" / "doc_counts.json"
    meta = json.loads(path.read_text())
    meta["files"][sorted(meta["files"])[-1]] = {"docs": 11}  # stale, no size to tell
    path.write_text(json.dumps(meta))
    loader = TokenLoader(config([("a", tmp_path / "a", 1.0)], num_shards=4, num_epochs=1),
                         num_workers=2)  # fmt: skip
    with pytest.raises(LoaderInputError) as err:
        list(loader)
    assert type(err.value) is LoaderInputError
    stale = "has 10 rows but the doc-count metadata says 11; delete the stale doc_counts.json"
    assert str(err.value).endswith(stale + " (or cache entry) and restart")
    assert "\n" not in str(err.value)
