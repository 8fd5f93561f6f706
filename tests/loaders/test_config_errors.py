"""Config values that cannot work (a string or float from a CLI or YAML file, inf, an id
the output dtype cannot hold) raise LoaderInputError naming the field, when built rather
than at the first batch."""

from __future__ import annotations

import math

import numpy as np
import pytest

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
        (lambda: _config(seq_len="64"), "seq_len"),
        (lambda: _config(seq_len=64.5), "seq_len"),
        (lambda: _config(batch_size=2.0), "batch_size"),
        (lambda: _config(min_doc_len=0.5), "min_doc_len"),
        (lambda: _config(num_epochs=1.5), "num_epochs"),
        (lambda: _config(bos_id=2**40, out_dtype="int32"), "bos_id"),
        (lambda: _config(pad_id=None), "pad_id"),
        (lambda: TokenLoader(_config(), num_workers="2"), "num_workers"),
        (lambda: TokenLoader(_config()).set_weights({"a": "x"}), "set_weights 'a'"),
        (lambda: TokenLoader(_config()).set_weights({"a": math.inf}), "set_weights 'a'"),
        (lambda: TokenLoader(_config()).load_state_dict([]), "no loader states given"),
    ],
)
def test_bad_values_name_their_field(build, field):
    with pytest.raises(LoaderInputError, match=field):
        build()


def test_numpy_numbers_are_numbers():
    cfg = _config(seq_len=np.int64(8), bos_id=np.int32(1))
    assert cfg.seq_len == 8 and next(iter(TokenLoader(cfg)))["input_ids"].shape == (1, 8)
    assert DatasetSpec(name="b", path=_Docs(), weight=np.float32(0.5)).weight == 0.5
