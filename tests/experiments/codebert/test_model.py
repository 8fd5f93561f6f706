"""CodeBERT pieces: packed rows compute what separate rows do; dynamic masking."""

from __future__ import annotations

import pytest
import torch

from experiments.codebert.masking import mask_tokens
from experiments.codebert.model import document_mask, init_mlm, mlm_logits, segment_positions
from experiments.transformer import EncoderConfig, encoder_hidden


def _cfg(tt: bool) -> EncoderConfig:
    return EncoderConfig(
        vocab_size=100, max_len=16, d_model=32, heads=4, ffn=64, layers=2, dropout=0.0,
        tt=tt, rank=4, attn_modes=((8, 4), (4, 8)), ffn_in_modes=((8, 8), (4, 8)),
        ffn_out_modes=((4, 8), (8, 8)), emb_vocab_modes=(10, 10), emb_dim_modes=(4, 8),
        emb_rank=4,
    )  # fmt: skip


def test_positions_and_mask() -> None:
    seg = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [3, 3, 3, 3, 3, 3, 3]])
    assert segment_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 6]]
    m = document_mask(seg)[0, 0]
    assert m[0, :3].all() and not m[0, 3:].any()  # document 1 sees only itself
    assert m[3, 3:5].all() and not m[3, :3].any()
    assert m[5].tolist() == [False] * 5 + [True, False]  # padding: itself only


@pytest.mark.parametrize("tt", [False, True])
def test_packed_row_equals_separate_rows(tt: bool) -> None:
    cfg = _cfg(tt)
    params, state = init_mlm(cfg, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(5, 100, (6,), generator=g), torch.randint(5, 100, (5,), generator=g)
    packed = torch.cat([a, b, torch.zeros(3, dtype=torch.long)])[None]  # (1, 14)
    seg = torch.tensor([[1] * 6 + [2] * 5 + [0] * 3])

    def hidden(ids, seg):
        mask, pos = document_mask(seg), segment_positions(seg)
        return encoder_hidden(
            params, state, {"input_ids": ids}, cfg, attn_mask=mask, position_ids=pos
        )

    h = hidden(packed, seg)[0]
    ha = hidden(a[None], torch.ones(1, 6, dtype=torch.long))[0]
    hb = hidden(b[None], torch.ones(1, 5, dtype=torch.long))[0]
    torch.testing.assert_close(h[:6], ha, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h[6:11], hb, rtol=1e-5, atol=1e-5)
    labels = torch.full_like(packed, -100)
    labels[0, [1, 8]] = packed[0, [1, 8]]
    logits, target = mlm_logits(params, state, {"input_ids": packed, "segment_ids": seg,
                                                "labels": labels}, cfg)  # fmt: skip
    assert logits.shape == (2, 100) and target.tolist() == packed[0, [1, 8]].tolist()
    # the decoder is tied: the word embedding gets a gradient from the output side too
    word = params["embed"]["word"]
    leaves = [t.requires_grad_() for t in (word["cores"] if tt else [word["weight"]])]
    logits, target = mlm_logits(params, state, {"input_ids": packed, "segment_ids": seg,
                                                "labels": labels}, cfg)  # fmt: skip
    grads = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, target), leaves)
    assert all(bool(g.abs().sum() > 0) for g in grads)


def test_dynamic_masking_rates() -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (64, 512), generator=g)
    seg = torch.ones_like(ids)
    seg[:, -50:] = 0  # padding
    ids[:, ::97] = 0  # BOS-like specials
    special = [0, 1, 2, 3, 4]
    out, labels = mask_tokens(ids, seg, mask_id=4, vocab_size=1000, special_ids=special,
                              generator=torch.Generator().manual_seed(1))  # fmt: skip
    eligible = (seg > 0) & ~torch.isin(ids, torch.tensor(special))
    chosen = labels != -100
    assert not (chosen & ~eligible).any()
    assert float(chosen.sum() / eligible.sum()) == pytest.approx(0.15, abs=0.005)
    assert torch.equal(labels[chosen], ids[chosen])
    as_mask = (out == 4) & chosen
    kept = (out == ids) & chosen
    assert float(as_mask.sum() / chosen.sum()) == pytest.approx(0.8, abs=0.015)
    assert float(kept.sum() / chosen.sum()) == pytest.approx(0.1, abs=0.015)  # + rare collisions
    assert torch.equal(out[~chosen], ids[~chosen])
    again = mask_tokens(ids, seg, mask_id=4, vocab_size=1000, special_ids=special,
                        generator=torch.Generator().manual_seed(1))  # fmt: skip
    assert torch.equal(again[0], out) and torch.equal(again[1], labels)


def test_a_batch_the_draws_miss_still_has_a_token_to_predict() -> None:
    """Batch 1 x 8 (6 eligible tokens) chose none 38% of the time: the step had no loss
    term, the trainer stopped with a traceback, and a resume masked alike and stopped
    again. The eligible token of the smallest draw is chosen then; other batches keep
    their masks."""
    special = [0, 1, 2, 3, 4]
    ids = torch.tensor([[0, 11, 12, 13, 14, 15, 16, 2]])
    seg = torch.ones_like(ids)
    missed = 0
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        draw = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed))
        out, labels = mask_tokens(ids, seg, mask_id=4, vocab_size=100, special_ids=special,
                                  generator=g)  # fmt: skip
        chosen = labels != -100
        eligible = ~torch.isin(ids, torch.tensor(special))
        if not bool((eligible & (draw < 0.15)).any()):  # the draws chose nothing
            missed += 1
            assert int(chosen.sum()) == 1
            assert int(chosen.reshape(-1).nonzero()) == int(
                torch.where(eligible, draw, torch.ones_like(draw)).argmin()
            )
        else:
            assert torch.equal(chosen, eligible & (draw < 0.15))
    assert missed > 5
    pad = torch.zeros_like(seg)  # nothing eligible: nothing chosen
    assert bool((mask_tokens(ids, pad, mask_id=4, vocab_size=100, special_ids=special)[1]
                 == -100).all())  # fmt: skip


@pytest.mark.parametrize("rows", [7, 100])
def test_tied_logits_in_row_blocks_equal_the_whole_table(rows: int, monkeypatch) -> None:
    """The TTM decoder built block by block (and rebuilt in backward; 7 rows of width 32,
    with no table counted small enough to build whole) or whole (100 rows: ``3 d <= M``)
    gives the logits and gradients of ``h @ to_dense(table).T``, padded vocabulary rows
    dropped."""
    import comera as C
    import comera.layers
    from experiments.codebert.model import tied_logits

    monkeypatch.setattr(comera.layers, "WHOLE_TABLE_ELEMENTS", 0)

    cfg = _cfg(True)
    cfg = EncoderConfig(**{**{f: getattr(cfg, f) for f in cfg.__slots__},
                           "vocab_size": 93})  # 10 x 10 = 100 rows: 7 padded  # fmt: skip
    params, state = init_mlm(cfg, generator=torch.Generator().manual_seed(0))
    word = params["embed"]["word"]
    leaves = [t.requires_grad_() for t in [*word["cores"], *word["gates"]]]
    h = torch.randn(rows, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    w = torch.randn(rows, 93, generator=torch.Generator().manual_seed(2))
    got = tied_logits(params, state, h, cfg)
    want = h @ C.to_dense(word, state["embed"]["word"], cfg.embedding_spec()).T
    assert got.shape == (rows, 93)
    torch.testing.assert_close(got, want)
    g1 = torch.autograd.grad((got * w).sum(), [h, *leaves])
    g2 = torch.autograd.grad((want * w).sum(), [h, *leaves])
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)


def test_attention_recomputed_on_cpu_keeps_values_and_gradients(monkeypatch) -> None:
    """With attention dropout on CPU the encoder recomputes the attention core in backward
    (replaying the RNG): the loss and gradients equal plain SDPA under the same seed."""
    import torch.nn.functional as F

    from experiments import transformer

    calls = []
    inner = transformer.checkpoint
    monkeypatch.setattr(transformer, "ATTENTION_RECOMPUTE_MIN", 0)  # even this small
    monkeypatch.setattr(
        transformer, "checkpoint", lambda *a, **k: calls.append(1) or inner(*a, **k)
    )

    cfg = EncoderConfig(**{**{f: getattr(_cfg(True), f) for f in _cfg(True).__slots__},
                           "dropout": 0.3})  # fmt: skip
    params, state = init_mlm(cfg, generator=torch.Generator().manual_seed(0))
    leaves = [t.requires_grad_() for t in torch.utils._pytree.tree_leaves(params)]
    ids = torch.randint(5, 100, (2, 16), generator=torch.Generator().manual_seed(3))

    def run() -> tuple:
        torch.manual_seed(7)
        out = encoder_hidden(params, state, {"input_ids": ids,
                             "attention_mask": torch.ones(2, 16)}, cfg, train=True)  # fmt: skip
        loss = out.pow(2).mean()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)  # lm_head: unused
        return (loss, *(g for g in grads if g is not None))

    recomputed = run()
    plain = transformer._attention
    try:
        transformer._attention = lambda q, k, v, m, p: F.scaled_dot_product_attention(
            q, k, v, attn_mask=m, dropout_p=p
        )
        direct = run()
    finally:
        transformer._attention = plain
    assert len(calls) == cfg.layers  # the recomputing path ran, once per layer
    for a, b in zip(recomputed, direct, strict=True):
        torch.testing.assert_close(a, b)
