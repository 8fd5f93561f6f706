"""Config values that cannot work (a string or float from a CLI or YAML file, inf, an id
the output dtype cannot hold) raise LoaderInputError naming the field, when built rather
than at the first batch."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from loaders import DatasetSpec, LoaderConfig, LoaderInputError, TokenLoader


class _Docs:
    num_docs = 20

    def doc(self, i: int) -> np.ndarray:
        return np.arange(5, dtype=np.int32) + 1000 * (i + 1)


def _config(**kw) -> LoaderConfig:
    return LoaderConfig(datasets=[DatasetSpec(name="a", path=_Docs())], num_shards=4, **kw)


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: DatasetSpec(name="a", path=_Docs(), weight="0.5"), "weight"),
        (lambda: DatasetSpec(name="a", path=_Docs(), weight=math.inf), "weight"),
        (lambda: DatasetSpec(name="a", path=None), "path is None"),
        # the shuffle's keys join parts with \x1f: inside a name, two orders could coincide
        (lambda: DatasetSpec(name="a\x1f1", path=_Docs()), "no control characters"),
        # a folder name that is not UTF-8, as os.fsdecode gives it: the keys cannot encode it
        (lambda: DatasetSpec(name="caf\udce9", path=_Docs()), "valid UTF-8 text"),
        (lambda: _config(seq_len="64"), "seq_len"),
        (lambda: _config(seq_len=64.5), "seq_len"),
        (lambda: _config(batch_size=2.0), "batch_size"),
        (lambda: _config(min_doc_len=0.5), "min_doc_len"),
        (lambda: _config(num_epochs=1.5), "num_epochs"),
        (lambda: _config(causal="false"), "causal must be True or False"),  # rows of seq_len+1
        (lambda: _config(provenance=1), "provenance must be True or False"),
        (lambda: _config(bos_id=2**40, out_dtype="int32"), "bos_id"),
        (lambda: _config(pad_id=None), "pad_id"),
        (lambda: TokenLoader(_config(), num_workers="2"), "num_workers"),
        (lambda: TokenLoader(_config()).set_weights({"a": "x"}), "set_weights 'a'"),
        (lambda: TokenLoader(_config()).set_weights({"a": math.inf}), "set_weights 'a'"),
        (lambda: TokenLoader(_config()).load_state_dict([]), "no loader states given"),
        # from a YAML file or a CLI: types that failed deep inside with a bare traceback
        (lambda: LoaderConfig(datasets=[{"name": "a", "path": "x"}]), r"datasets\[0\] is a dict"),
        (lambda: DatasetSpec(name="a", path=5), "path 5 .int. must be a folder"),
        (lambda: _config(cache_dir=5), "cache_dir"),
        (lambda: TokenLoader(_config(), rank="0", world_size=2), "rank must be an integer"),
        (lambda: TokenLoader(_config()).set_weights([0.5]), "weights must map sub-dataset names"),
        (lambda: TokenLoader(_config()).load_state_dict("x"), "a loader state is a dict"),
        (lambda: TokenLoader(_config()).load_state_dict([[1]]), "the state is a list"),
        # DataLoader arguments torch checked only at the first batch, or never
        (lambda: TokenLoader(_config(), num_workers=1, prefetch_factor=0), "prefetch_factor"),
        (lambda: TokenLoader(_config(), num_workers=1, prefetch_factor="2"), "prefetch_factor"),
        (lambda: TokenLoader(_config(), prefetch_factor=2), "applies to worker processes"),
        (lambda: TokenLoader(_config(), pin_memory="yes"), "pin_memory must be True or False"),
        (
            lambda: TokenLoader(_config(), num_workers=1, multiprocessing_context="bogus"),
            "multiprocessing_context='bogus' is not a start method",
        ),
        (
            lambda: TokenLoader(_config(), num_workers=1, multiprocessing_context=5),
            "multiprocessing_context=5 is not a start method",
        ),
    ],
)
def test_bad_values_name_their_field(build, field):
    with pytest.raises(LoaderInputError, match=field):
        build()


def test_numpy_numbers_are_numbers(tmp_path):
    cfg = LoaderConfig(datasets=[DatasetSpec(name="a", path=_Docs())], seq_len=np.int64(8),
                       bos_id=np.int32(1), seed=np.int64(3), num_shards=np.int64(4),
                       eos_id=np.int16(2))  # fmt: skip
    assert cfg.seq_len == 8 and next(iter(TokenLoader(cfg)))["input_ids"].shape == (1, 8)
    assert DatasetSpec(name="b", path=_Docs(), weight=np.float32(0.5)).weight == 0.5
    # they are stored as ints: the state is JSON, and its first save used to fail on them
    loader = TokenLoader(cfg, num_workers=np.int64(0), rank=np.int64(0), world_size=np.int64(1))
    next(loader)
    loader.save(tmp_path)
    again = TokenLoader(cfg)
    again.load(tmp_path)
    assert torch.equal(next(again)["input_ids"], next(loader)["input_ids"])


def test_a_bad_environment_rank_is_named(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(LoaderInputError, match="WORLD_SIZE='two' is not an integer"):
        TokenLoader(_config())


def _damage(state: dict, how: str) -> object:
    if how == "a list":
        return [state]
    if how == "no fingerprint":
        del state["fingerprint"]
    elif how == "short counter":
        state["readers"][0]["shards"]["a"]["counter"].pop()
    elif how == "unknown current":
        state["readers"][0]["current"] = ["zz", 0]
    elif how == "rank as text":
        state["rank"] = "0"
    elif how == "range past num_shards":
        state["readers"][0]["shards"]["a"]["range"] = [0, 99]
    # values in range of their type but not of the stream: they loaded, and lost or
    # repeated documents (a negative counter read the neighbouring shard's last one)
    elif how == "negative counter":
        state["readers"][0]["shards"]["a"]["counter"][1] = -1
    elif how == "counter past the shard":
        state["readers"][0]["shards"]["a"]["counter"][1] = 10**6
    elif how == "negative epoch":
        state["readers"][0]["shards"]["a"]["epoch"][2] = -2
    elif how == "a reader without a":
        del state["readers"][0]["shards"]["a"]
    elif how == "negative weight":
        state["weights"]["a"] = -1.0
    elif how == "zero weights":
        state["weights"] = dict.fromkeys(state["weights"], 0.0)
    elif how == "rr as text":
        state["readers"][0]["rr"]["a"] = "x"
    elif how == "no readers":
        state["readers"] = []
    elif how == "next worker as text":
        state["next_worker"] = "x"
    # out of range of what Python hands to C or to a float: bare Overflow/TypeErrors
    elif how == "huge world":
        state["world_size"] = 10**30
    elif how == "huge mix count":
        state["readers"][0]["mix_tokens"]["a"] = 10**400
    elif how == "huge weight":
        state["weights"]["a"] = 10**400
    elif how == "list as current":
        state["readers"][0]["current"] = [[0], 0]
    elif how == "list as step":
        state["step"] = [1]
    elif how == "range cut short":  # the arrays cut to match: the rest restarted from 0
        shards = state["readers"][0]["shards"]["a"]
        shards["range"] = [0, 2]
        for key in ("epoch", "counter", "offset"):
            shards[key] = shards[key][:2]
    return state


@pytest.mark.parametrize(
    ("how", "field"),
    [
        ("a list", "the state is a list"),
        ("no fingerprint", "fingerprint is missing"),
        ("short counter", r"shards\['a'\].counter is not 4 integers"),
        ("unknown current", "current is not one of its shards"),
        ("rank as text", "rank is not an integer"),
        ("range past num_shards", r"range is not a shard range within 4"),
        ("negative counter", r"shards\['a'\].counter is not 4 integers >= 0"),
        ("counter past the shard", r"shards\['a'\].counter passes the \d+ documents"),
        ("negative epoch", r"shards\['a'\].epoch is not 4 integers >= 0"),
        ("a reader without a", r"shards lacks sub-datasets \['a'\]"),
        ("negative weight", r"weights\['a'\] = -1.0 is not a finite weight >= 0"),
        ("zero weights", "weights are all 0"),
        ("rr as text", "rr is not a map of its sub-datasets to integers in range"),
        ("no readers", "readers are of workers \\[\\], not one per worker"),
        ("next worker as text", "next_worker 'x' is not a worker"),
        ("huge world", r"num_workers x world_size = 1 x 10{30} readers does not fit"),
        ("huge mix count", "mix_tokens is not a map of its sub-datasets to integers in range"),
        ("huge weight", r"weights\['a'\] = 10{400} is not a finite weight"),
        ("list as current", "current is not one of its shards"),
        ("list as step", r"step \[1\] is not an integer >= 0"),
        ("range cut short", r"range \[0, 2\] is not the shards \[0, 4\] its rank and worker own"),
    ],
)
def test_a_damaged_state_file_is_refused_before_anything_changes(tmp_path, how, field):
    """A state file edited or cut short fails with the field named (it used to fail with a
    bare KeyError or IndexError deep in the merge), and the loader keeps its position."""
    import json

    loader = TokenLoader(_config())
    next(loader)
    loader.save(tmp_path)
    path = next(tmp_path.glob("loader_rank*.json"))
    path.write_text(json.dumps(_damage(json.loads(path.read_text()), how)))
    fresh = TokenLoader(_config())
    first = fresh.state_dict()
    with pytest.raises(LoaderInputError, match=field):
        fresh.load(tmp_path)
    assert fresh.state_dict() == first


@pytest.mark.parametrize("step", [-1, 2.7, "3", True])
def test_a_save_step_that_loading_would_refuse_is_refused_first(tmp_path, step):
    """save(step=-1) wrote a file that every load then refused as damaged; 2.7 was
    written as 2."""
    loader = TokenLoader(_config())
    with pytest.raises(LoaderInputError, match="step must be an integer >= 0"):
        loader.save(tmp_path, step=step)
    assert not list(tmp_path.iterdir())
    loader.save(tmp_path, step=np.int64(3))  # a numpy integer is an integer
    assert json.loads(next(tmp_path.iterdir()).read_text())["step"] == 3


def test_an_offset_past_its_document_is_refused(tmp_path):
    """An offset past the end of its document (more than an EOS turned off explains)
    skipped the document silently."""
    loader = TokenLoader(_config(bos_id=1, eos_id=2, seq_len=3))
    next(loader)  # 3 of the first document's 7 tokens
    state = loader.state_dict()
    offsets = state["readers"][0]["shards"]["a"]["offset"]
    shard = next(i for i, o in enumerate(offsets) if o)
    offsets[shard] = 9  # 7 tokens: 8 is an EOS since turned off, 9 is no stream's
    fresh = TokenLoader(_config(bos_id=1, eos_id=2, seq_len=3))
    fresh.load_state_dict(state)
    with pytest.raises(LoaderInputError, match="resumes at offset 9 of a document of 5 tok"):
        for _ in range(20):
            next(fresh)
    offsets[shard] = 8
    again = TokenLoader(_config(bos_id=1, eos_id=2, seq_len=3))
    again.load_state_dict(state)
    assert next(again)["input_ids"].shape == (1, 3)


class _WideDocs(_Docs):
    def doc(self, i: int) -> np.ndarray:
        if i == 5:  # too short for min_doc_len=2: skipped, never emitted nor checked
            return np.array([2**41], dtype=np.int64)
        return np.array([7, 2**40 + 5 if i == 3 else 8], dtype=np.int64)


def test_names_of_any_script_are_taken() -> None:
    """Only control characters are refused: ZWNJ (Persian words), NBSP and the
    ideographic space are not printable to Python, yet are names."""
    for name in ("فارسی\u200cمتن", "a\u00a0b", "日本\u3000語", "code"):
        DatasetSpec(name=name, path=_Docs())


def test_loader_flags_take_what_torch_takes() -> None:
    """numpy's bools and 0/1 were taken for pin_memory before it was checked; a context
    object is a context."""
    import multiprocessing

    for pin in (np.True_, 1, 0):
        TokenLoader(_config(), num_workers=1, pin_memory=pin)
    TokenLoader(_config(), num_workers=1, multiprocessing_context=multiprocessing.get_context())


def test_ids_out_dtype_cannot_hold_are_refused(tmp_path):
    """Rows are filled by numpy assignment, which wrapped 2**40 + 5 to 5 in int32."""
    cfg = LoaderConfig(datasets=[DatasetSpec(name="w", path=_WideDocs())], num_shards=1,
                       seq_len=4, out_dtype="int32", shuffle="none", num_epochs=1,
                       min_doc_len=2)  # fmt: skip
    with pytest.raises(LoaderInputError, match=r"document 3 holds token id 1099511627781, wh"
                       r"ich LoaderConfig.out_dtype='int32' cannot hold; set out_dtype='int64'"
                       r" or re-tokenize the data"):  # fmt: skip
        list(TokenLoader(cfg))
    wide = LoaderConfig(datasets=[DatasetSpec(name="w", path=_WideDocs())], num_shards=1,
                        seq_len=4, shuffle="none", num_epochs=1)  # fmt: skip
    assert 2**40 + 5 in torch.cat([b["input_ids"].reshape(-1) for b in TokenLoader(wide)])
    # past int64 (a uint64 id) only the data can change: int64 is not advised, at any setting
    for out in ("int64", "int32"):
        huge = LoaderConfig(datasets=[DatasetSpec(name="w", path=_WideDocs())], num_shards=1,
                            seq_len=4, shuffle="none", num_epochs=1, out_dtype=out)  # fmt: skip
        huge.datasets[0].path.doc = lambda i: np.array([7, 2**64 - 1], np.uint64)
        with pytest.raises(LoaderInputError, match=rf"out_dtype='{out}' cannot hold; no output"
                           r" dtype holds it \(int64 is the widest\): re-tokenize"):  # fmt: skip
            list(TokenLoader(huge))
    # the short document alone out of range, skipped: nothing stops the run
    cfg.datasets[0].path.doc = lambda i: np.array([2**41] if i == 5 else [7, 8], np.int64)
    assert len(list(TokenLoader(cfg))) > 0


def test_an_endless_stream_counts_only_documents_of_min_doc_len(tmp_path):
    """Global mode: rank 0's shards reach only a sub-dataset of documents shorter than
    ``min_doc_len`` (every reader drops it), so its stream would end at once while rank 1
    streams on; both ranks now refuse it up front, as they do a reader with no document."""

    class Short(_Docs):
        num_docs = 10

        def doc(self, i: int) -> np.ndarray:
            return np.array([7 + i], dtype=np.int32)

    class OneLong(_Docs):
        num_docs = 1

    specs = [DatasetSpec(name="long", path=OneLong()), DatasetSpec(name="short", path=Short())]
    cfg = LoaderConfig(datasets=specs, num_shards=4, min_doc_len=3, seq_len=4)
    for rank in (0, 1):
        with pytest.raises(LoaderInputError, match="reader 0 of 2 .* min_doc_len=3"):
            TokenLoader(cfg, rank=rank, world_size=2)
    TokenLoader(cfg, rank=0, world_size=1)  # one reader: it reaches the long document
    only_short = LoaderConfig(datasets=specs[1:], num_shards=4, min_doc_len=3, seq_len=4)
    with pytest.raises(LoaderInputError, match="no sub-dataset .* min_doc_len=3"):
        TokenLoader(only_short)
    finite = LoaderConfig(datasets=specs, num_shards=4, min_doc_len=3, seq_len=4, num_epochs=1)
    TokenLoader(finite, rank=0, world_size=2)  # a finite stream ends on every rank anyway
    for kw in ({"num_epochs": 1}, {"shuffle": "local"}):  # no batch would come at all
        empty = LoaderConfig(datasets=specs[1:], num_shards=4, min_doc_len=3, seq_len=4, **kw)
        with pytest.raises(LoaderInputError, match="no sub-dataset .* would yield no batch"):
            TokenLoader(empty)


def test_a_state_dict_is_a_copy_the_caller_may_edit() -> None:
    """The returned fingerprint (and, with workers, the readers' counters) were the
    loader's own: editing them moved the loader or made it refuse its own valid state."""
    loader = TokenLoader(LoaderConfig(datasets=[DatasetSpec(name="a", path=_Docs())],
                                      num_shards=4, seq_len=4, batch_size=1))  # fmt: skip
    next(iter(loader))
    state = loader.state_dict()
    kept = json.dumps(state, sort_keys=True)
    state["fingerprint"]["docs"]["a"] = 999
    for r in state["readers"]:
        for sh in r["shards"].values():
            sh["counter"] = [0] * len(sh["counter"])
    assert json.dumps(loader.state_dict(), sort_keys=True) == kept


def test_fields_set_after_building_are_checked_when_a_loader_is_built() -> None:
    """``cfg.seq_len = 0`` after building streamed endless empty rows, a string batch size
    or an id the dtype cannot hold failed deep in packing: the loader checks again."""
    for field, value, text in [
        ("seq_len", 0, "LoaderConfig.seq_len must be an integer >= 1"),
        ("batch_size", "2", "LoaderConfig.batch_size must be an integer >= 1"),
        ("bos_id", 2**40, "LoaderConfig.bos_id must be an integer that out_dtype='int32'"),
    ]:
        cfg = _config(out_dtype="int32")
        setattr(cfg, field, value)
        with pytest.raises(LoaderInputError, match=text):
            TokenLoader(cfg)
    cfg = _config()
    cfg.datasets[0].weight = -1.0
    with pytest.raises(LoaderInputError, match="dataset 'a': weight must be a finite number"):
        TokenLoader(cfg)
    with pytest.raises(LoaderInputError, match="TokenLoader takes a LoaderConfig, got dict"):
        TokenLoader({"datasets": []})  # type: ignore[arg-type]


def test_datasets_given_as_a_generator_are_read_once_and_kept() -> None:
    """A generator of specs was used up by the type check, then reported as "all dataset
    weights are 0"; a dict is refused, naming the type."""
    cfg = LoaderConfig(datasets=(DatasetSpec(name=n, path=_Docs()) for n in "ab"), num_shards=4)
    assert [d.name for d in cfg.datasets] == ["a", "b"]
    assert len(list(TokenLoader(LoaderConfig(datasets=cfg.datasets, num_shards=4, seq_len=4,
                                             batch_size=1, num_epochs=1)))) == 50  # fmt: skip
    with pytest.raises(LoaderInputError, match="datasets must be a list of DatasetSpec, got dict"):
        LoaderConfig(datasets={"a": DatasetSpec(name="a", path=_Docs())})
    with pytest.raises(LoaderInputError, match="datasets must be a list of DatasetSpec, got int"):
        LoaderConfig(datasets=5)


def test_num_epochs_is_offered_against_an_empty_reader_only_on_one_rank() -> None:
    """A finite stream ends after different numbers of batches on different ranks, so the
    advice "or set num_epochs" led several ranks into the hang the check prevents."""
    few = LoaderConfig(datasets=[DatasetSpec(name="a", path=_Docs())], num_shards=32)
    with pytest.raises(LoaderInputError) as many_ranks:
        TokenLoader(few, rank=0, world_size=30)
    assert "would end at once" in str(many_ranks.value)
    assert "num_epochs" not in str(many_ranks.value).split("would end at once")[1]
    with pytest.raises(LoaderInputError) as workers:
        TokenLoader(few, num_workers=30)
    assert str(workers.value).endswith("or shuffle='local', or set num_epochs")
