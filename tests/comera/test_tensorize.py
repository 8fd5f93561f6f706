"""``comera.tensorize_``: any model's linear and embedding layers as TT / TTM adapters."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import comera as C
from comera.errors import ConfigError
from comera.tensorize import PaddedTTLinear, TensorizeConfig, TiedDecoder, tensorize_
from comera.train import ModuleTask

FULL = 10**6  # a rank no bond can carry: TT-SVD is then exact
EXACT = {"rank": FULL, "cores": 2, "embedding_cores": 2, "min_compression": 0}


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.norm = nn.LayerNorm(64)
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64, bias=False)
        self.odd = nn.Linear(64, 97)  # 97 is prime: padded to a size that splits
        self.head = nn.Linear(64, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(ids))
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(h).sum(-1) + self.odd(h).mean(-1)


def _toy() -> Toy:
    torch.manual_seed(0)
    return Toy().double()


def test_full_rank_svd_keeps_the_outputs_and_leaves_the_rest_alone() -> None:
    model, ids = _toy(), torch.randint(0, 100, (4, 9))
    want = model(ids)
    norm, head = model.norm, model.head
    summary = tensorize_(model, TensorizeConfig(target_modules=("embed", "up", "down", "odd"),
                                                **EXACT))  # fmt: skip
    assert isinstance(model.up, C.TTLinear) and isinstance(model.embed, C.TTMEmbedding)
    assert isinstance(model.odd, PaddedTTLinear)
    assert model.norm is norm and model.head is head  # not targets: untouched
    torch.testing.assert_close(model(ids), want, rtol=1e-9, atol=1e-9)
    rows = {r.name: r for r in summary.layers}
    assert rows["odd"].padded.startswith("out 97->") and "odd" in str(summary)
    # a wrong width is named in the layer's sizes: it said (2, 397) against 384, the
    # padded train's, for a 380-wide input to a 367-wide layer
    wide = nn.Sequential(nn.Linear(367, 16))
    tensorize_(wide, TensorizeConfig(target_modules=("0",), rank=4, min_compression=0))
    assert isinstance(wide[0], PaddedTTLinear)
    with pytest.raises(ValueError, match=r"input has shape \(2, 380\) .* last dim of 367$"):
        wide(torch.randn(2, 380))
    # its weight and functional trees, as every replaced layer has them; its repr names
    # its own sizes beside the padded ones
    assert "in_features=367, out_features=16, padded=(16, 384)" in repr(wide[0])
    x = torch.randn(3, 367)
    assert model.odd.to_dense().shape == (97, model.odd.in_features)
    torch.testing.assert_close(
        wide[0](x), x @ wide[0].to_dense().T + wide[0].inner.bias[:16], rtol=1e-5, atol=1e-5
    )
    got = C.tt_linear(wide[0].params(), wide[0].state(), F.pad(x, (0, 384 - 367)))
    torch.testing.assert_close(got[..., :16], wide[0](x))


def test_low_ranks_compress_train_and_survive_state_dict_and_functional_call() -> None:
    model, ids = _toy(), torch.randint(0, 100, (8, 9))
    dense = sum(p.numel() for p in model.parameters())
    cfg = TensorizeConfig(target_modules=("*",), exclude=("head",), rank=4, cores=2)
    summary = tensorize_(model, cfg)
    assert sum(p.numel() for p in model.parameters()) < dense / 2
    assert summary.params_after < summary.params_before
    target = torch.randn(8, 9, dtype=torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = (model(ids) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    twin = _toy()
    tensorize_(twin, TensorizeConfig(target_modules=("*",), exclude=("head",), rank=4, cores=2,
                                     init="random"))  # fmt: skip
    twin.load_state_dict(model.state_dict())
    torch.testing.assert_close(twin(ids), model(ids))
    named = dict(model.named_parameters())
    out = torch.func.functional_call(model, {k: v * 1 for k, v in named.items()}, (ids,))
    torch.testing.assert_close(out, model(ids))
    # pruning and compaction run on a replaced layer (the optimizer is rebuilt after it)
    model.up.prune(float(model.up.gates[0].detach().abs().sort().values[1]))
    model.up.compact()
    assert C.tensor_train.bond_ranks(model.up.params())[0] < 4


def test_a_target_compression_and_bad_globs() -> None:
    model = _toy()
    summary = tensorize_(model, TensorizeConfig(target_modules=("up", "down"), rank=64,
                                                compression=4.0, cores=2))  # fmt: skip
    assert all(r.compression >= 4.0 for r in summary.layers)
    with pytest.raises(ConfigError, match=r"'attn\.\*' matches no .* the model's are: .*up"):
        tensorize_(_toy(), TensorizeConfig(target_modules=("attn.*",)))
    small = tensorize_(_toy(), TensorizeConfig(target_modules=("head",), rank=8))
    assert small.layers[0].skipped.startswith("skipped")  # 64 -> 3: a train is no smaller


def _hf_input(vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, vocab, (2, 12), generator=g)}


def test_bert_and_gpt2_built_from_configs() -> None:
    """Hugging Face models from configs (no download): BERT with a classification head
    keeps its outputs at full rank; GPT-2's Conv1D projections are replaced and its LM
    head stays tied to the (now TTM) token embedding."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=16, num_labels=3,
    )).eval().double()  # fmt: skip
    batch = _hf_input(120)
    want = bert(**batch).logits
    summary = tensorize_(bert, TensorizeConfig(target_modules=("query", "key", "value", "dense",
                                                               "word_embeddings"),
                                               **EXACT))  # fmt: skip
    assert isinstance(bert.bert.encoder.layer[0].attention.self.query, C.TTLinear)
    assert isinstance(bert.classifier, nn.Linear)  # not a target
    torch.testing.assert_close(bert(**batch).logits, want, rtol=1e-8, atol=1e-8)
    assert len([r for r in summary.layers if not r.skipped]) >= 13

    gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=4)).eval().double()  # fmt: skip
    batch = _hf_input(96)
    want = gpt(**batch).logits
    tensorize_(gpt, TensorizeConfig(target_modules=("c_attn", "c_fc", "c_proj", "wte"),
                                    **EXACT))  # fmt: skip
    assert isinstance(gpt.transformer.h[0].attn.c_attn, C.TTLinear)
    assert isinstance(gpt.lm_head, TiedDecoder) and gpt.lm_head.embedding is gpt.transformer.wte
    torch.testing.assert_close(gpt(**batch).logits, want, rtol=1e-8, atol=1e-8)


def test_a_tensorized_gpt2_trains_saves_and_calls_functionally() -> None:
    """At low rank: a few steps lower the LM loss, ``state_dict`` loads into another
    tensorized GPT-2, ``functional_call`` gives the module's outputs, and the modules no
    glob names (layer norms, positions) are the same objects."""
    transformers = pytest.importorskip("transformers")

    def build() -> nn.Module:
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0))  # fmt: skip

    cfg = TensorizeConfig(target_modules=("c_attn", "c_fc", "c_proj", "wte"), rank=4, cores=2,
                          embedding_cores=2, init="random")  # fmt: skip
    gpt = build()
    ln, wpe = gpt.transformer.ln_f, gpt.transformer.wpe
    tensorize_(gpt, cfg)
    assert gpt.transformer.ln_f is ln and gpt.transformer.wpe is wpe
    ids = _hf_input(96)["input_ids"]
    opt = torch.optim.Adam(gpt.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = gpt(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    twin = build()
    tensorize_(twin, cfg)
    twin.load_state_dict(gpt.state_dict())
    gpt.eval(), twin.eval()
    torch.testing.assert_close(twin(input_ids=ids).logits, gpt(input_ids=ids).logits)
    # functional_call runs the tensors it is given (the tied decoder's table included):
    # perturbed ones give what a module holding them gives
    named = {k: v.detach() + 0.01 * torch.randn_like(v) for k, v in gpt.named_parameters()}
    out = torch.func.functional_call(gpt, named, (), {"input_ids": ids})
    twin.load_state_dict(named, strict=False)  # the tied decoder shares wte's tensors
    torch.testing.assert_close(out.logits, twin(input_ids=ids).logits)
    assert not torch.allclose(out.logits, gpt(input_ids=ids).logits)


def test_a_tensorized_gpt2_survives_tie_weights_and_save_pretrained(tmp_path) -> None:  # noqa: ANN001
    """Hugging Face's own tying and saving after the rewrite: ``tie_weights()`` leaves the
    tied decoder (and the outputs) as they are, ``save_pretrained`` writes each core once,
    under the embedding's path, and its file loads into another tensorized GPT-2 (as
    does a state dict written when the decoder still held the embedding's cores too)."""
    transformers = pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.torch")

    def build() -> nn.Module:
        torch.manual_seed(0)
        gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=96, n_positions=16, n_embd=32, n_layer=1, n_head=4)).eval()  # fmt: skip
        tensorize_(gpt, TensorizeConfig(target_modules=("c_fc", "wte"), rank=4, cores=2,
                                        embedding_cores=2, init="random"))  # fmt: skip
        return gpt

    gpt = build()
    ids = _hf_input(96)["input_ids"]
    want = gpt(input_ids=ids).logits
    assert gpt.config.tie_word_embeddings is False  # the TiedDecoder ties; HF has nothing to
    gpt.tie_weights()
    assert isinstance(gpt.lm_head, TiedDecoder) and gpt.lm_head.embedding is gpt.transformer.wte
    torch.testing.assert_close(gpt(input_ids=ids).logits, want)
    keys = set(gpt.state_dict())
    assert not any(k.startswith("lm_head.embedding") for k in keys)
    assert "transformer.wte.cores.0" in keys
    gpt.save_pretrained(tmp_path)
    saved = safetensors.load_file(str(tmp_path / "model.safetensors"))
    assert {k for k in saved if k.startswith("transformer.wte.")} == {
        k for k in keys if k.startswith("transformer.wte.")
    }
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(0.01 * torch.randn_like(p))  # the twin must load these, not its init
    gpt.save_pretrained(tmp_path)
    twin = build()
    twin.load_state_dict(safetensors.load_file(str(tmp_path / "model.safetensors")))
    torch.testing.assert_close(twin(input_ids=ids).logits, gpt(input_ids=ids).logits)
    assert not torch.allclose(twin(input_ids=ids).logits, want)
    # a state dict from when the decoder registered the embedding (its cores twice) loads
    old = dict(gpt.state_dict())
    old.update({f"lm_head.embedding.{k}": v for k, v in gpt.transformer.wte.state_dict().items()})
    build().load_state_dict(old)
    twin.lm_head.embedding = twin.transformer.wte  # re-pointing registers nothing either
    assert set(twin.state_dict()) == keys


def test_only_the_models_holding_a_tied_decoder_are_untied() -> None:
    """An encoder-decoder whose GPT-2 decoder's ``wte`` is rewritten: the decoder's tie is
    dropped (its ``tie_weights()`` has nothing to tie), the T5 encoder's own tie stays in
    its config and in the top model's mapping, and HF's ``tie_weights()`` runs."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    enc = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4))  # fmt: skip
    dec = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4,
        add_cross_attention=True, is_decoder=True))  # fmt: skip
    model = transformers.EncoderDecoderModel(encoder=enc, decoder=dec)
    tensorize_(model, TensorizeConfig(target_modules=("decoder.transformer.wte",), rank=4,
                                      cores=2, embedding_cores=2, init="random"))  # fmt: skip
    assert isinstance(model.decoder.lm_head, TiedDecoder)
    assert model.decoder.config.tie_word_embeddings is False
    assert model.encoder.config.tie_word_embeddings is True
    assert model.all_tied_weights_keys == {
        "encoder.encoder.embed_tokens.weight": "encoder.shared.weight"
    }
    model.tie_weights()
    assert model.encoder.encoder.embed_tokens.weight is model.encoder.shared.weight


def test_a_tied_linear_reached_by_two_paths_stays_one_module() -> None:
    """A tied decoder reached by two paths becomes one :class:`TiedDecoder` (one bias)."""
    emb = nn.Embedding(24, 8)
    head = nn.Linear(8, 24)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head, "alias": head})
    tensorize_(model, TensorizeConfig(target_modules=("emb",), rank=4, cores=2,
                                      embedding_cores=2, init="random"))  # fmt: skip
    assert isinstance(model["head"], TiedDecoder) and model["head"] is model["alias"]
    assert model["head"].embedding is model["emb"]


# 3 * 16 > 5 tokens: checkpointed blocks unless the table is small enough to build whole
@pytest.mark.parametrize(("tokens", "whole", "blocks"), [(5, 0, 5), (200, 0, 0), (5, None, 0)])
@pytest.mark.parametrize("rows", [57, 48, None])  # a block cut short, one dropped, all 60
def test_ttm_logits_equal_the_dense_table_in_values_and_gradients(
    tokens: int, whole: int | None, blocks: int, rows: int | None, monkeypatch
) -> None:
    """Blocks of 12 rows (one index of the first mode): the padded rows never reach the
    logits, which come out contiguous (a slice of wider logits would not be). ``whole``:
    the table size built whole at any token count (None: the default, which this 60-row
    table is under); ``blocks``: the checkpointed blocks expected (0: the whole table)."""
    import torch.utils.checkpoint

    import comera.layers
    from comera.layers import ttm_logits
    from comera.tensor_train import gated_cores, ttm_table

    if whole is not None:
        monkeypatch.setattr(comera.layers, "WHOLE_TABLE_ELEMENTS", whole)
    calls = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                        lambda *a, **k: calls.append(1) or real(*a, **k))  # fmt: skip

    spec = C.TTMEmbeddingSpec(vocab_modes=(5, 4, 3), dim_modes=(2, 2, 4), ranks=4,
                              num_embeddings=57, embedding_dim=16, dtype=torch.float64)  # fmt: skip
    params, state = C.init(spec, generator=torch.Generator().manual_seed(0))
    leaves = [*params["cores"], *params["gates"]]
    for t in leaves:
        t.requires_grad_(True)
    h = torch.randn(tokens, 16, dtype=torch.float64, requires_grad=True)
    got = ttm_logits(params, state, h, rows=rows)
    assert len(calls) == (blocks if rows != 48 or not blocks else 4)  # 48 rows: 4 blocks
    table = ttm_table(gated_cores(params, state))  # all 60 rows, padding included
    want = h @ table[:rows].T
    assert got.shape == (tokens, rows or 60) and got.is_contiguous()
    torch.testing.assert_close(got, want)
    if rows == 57:
        torch.testing.assert_close(table[:57], C.to_dense(params, state, spec))
    gy = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, [h, *leaves], gy),
                    torch.autograd.grad(want, [h, *leaves], gy), strict=True):  # fmt: skip
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("whole", [None, 0])  # the table built whole; checkpointed blocks
def test_a_tied_head_compiles_as_one_graph(whole: int | None, monkeypatch) -> None:
    """``fullgraph=True`` refuses any graph break: an embedding and its tied decoder
    compile whole and give eager's values and gradients."""
    import comera.layers
    from comera.nn import TTMEmbedding

    if whole is not None:
        monkeypatch.setattr(comera.layers, "WHOLE_TABLE_ELEMENTS", whole)
    spec = C.TTMEmbeddingSpec(vocab_modes=(4, 5, 3), dim_modes=(2, 3, 2), ranks=4,
                              num_embeddings=55, dtype=torch.float64)  # fmt: skip
    emb = TTMEmbedding(spec, generator=torch.Generator().manual_seed(0))
    head = TiedDecoder(emb, torch.zeros(55, dtype=torch.float64))
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    ids = torch.randint(0, 55, (1, 5), generator=torch.Generator().manual_seed(1))

    def loss(m: torch.nn.Module) -> torch.Tensor:
        return m["head"](m["emb"](ids)).square().sum()

    leaves = list(model.parameters())
    want = loss(model)
    want_grads = torch.autograd.grad(want, leaves)
    torch._dynamo.reset()
    try:
        got = torch.compile(loss, fullgraph=True, backend="aot_eager")(model)
        grads = torch.autograd.grad(got, leaves)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("rows", [0, 61])
def test_ttm_logits_refuse_rows_outside_the_table(rows: int) -> None:
    from comera.layers import ttm_logits

    spec = C.TTMEmbeddingSpec(vocab_modes=(5, 4, 3), dim_modes=(2, 2, 4), ranks=4)
    params, state = C.init(spec, generator=torch.Generator().manual_seed(0))
    for tokens in (5, 200):  # checked before either path is taken
        with pytest.raises(ValueError, match=r"rows=.*pass an int from 1 to 60"):
            ttm_logits(params, state, torch.randn(tokens, 16), rows=rows)


def test_ties_shared_modules_and_attention_are_respected() -> None:
    """A weight shared with a module that stays is not split off; a module reached by two
    paths is replaced at both; ``nn.MultiheadAttention``'s ``out_proj`` (read directly by
    its parent) stays; an embedding's ``padding_idx`` is reported as dropped."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_positions=16, n_embd=32, n_layer=1, n_head=4))  # fmt: skip
    summary = tensorize_(gpt, TensorizeConfig(target_modules=("lm_head",), rank=4, cores=2))
    assert isinstance(gpt.lm_head, nn.Linear) and gpt.lm_head.weight is gpt.transformer.wte.weight
    assert "shared with transformer.wte" in summary.layers[0].skipped

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.b = self.a
            self.emb = nn.Embedding(100, 64, padding_idx=0, scale_grad_by_freq=True)
            self.layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.layer(self.b(self.a(self.emb(ids))))

    model = Twice()
    summary = tensorize_(model, TensorizeConfig(target_modules=("*",), rank=4, cores=2,
                                                embedding_cores=2))  # fmt: skip
    assert isinstance(model.a, C.TTLinear) and model.b is model.a
    assert isinstance(model.layer.self_attn.out_proj, nn.Linear)
    # the layer's inference fast path reads linear1.weight: a TT adapter there would fail
    assert isinstance(model.layer.linear1, nn.Linear)
    rows = {r.name: r for r in summary.layers}
    assert "MultiheadAttention" in rows["layer.self_attn.out_proj"].skipped
    assert "TransformerEncoderLayer reads linear1.weight" in rows["layer.linear1"].skipped
    assert rows["emb"].note == "padding_idx, scale_grad_by_freq dropped (no TTM counterpart)"
    assert not rows["emb"].padded
    with pytest.raises(ConfigError, match=r"the model is itself a layer \(Linear\), .* wrap it"):
        tensorize_(nn.Linear(16, 16), TensorizeConfig(target_modules=("*",)))
    for kw, said in [({"rank": 0}, "rank=0"), ({"embedding_rank": 0}, "embedding_rank=0"),
                     ({"rank_for": [("up", 0)]}, "rank_for 'up': 0")]:  # fmt: skip
        with pytest.raises(ConfigError, match=rf"ranks must be >= 1, got {said}$"):
            TensorizeConfig(target_modules=("*",), **kw)
    assert "padded" not in rows["emb"].describe()
    assert model(torch.randint(0, 100, (2, 5))).shape == (2, 5, 64)
    with torch.no_grad():
        assert model.eval()(torch.randint(0, 100, (2, 5))).shape == (2, 5, 64)


def test_embedding_rank_goes_by_kind_and_globs_override_it() -> None:
    """``embedding_rank`` is every embedding table's rank whatever its name (GPT-2's
    ``wte``), never a linear's; a ``rank_for`` glob overrides either."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.pos = nn.Embedding(256, 64), nn.Embedding(64, 64)
            self.embeddings_project = nn.Linear(64, 64)

    cfg = TensorizeConfig(target_modules=("*",), rank=4, embedding_rank=6, cores=2,
                          embedding_cores=2, rank_for=(("pos", 5),), min_compression=0)  # fmt: skip
    summary = tensorize_(Model(), cfg)
    ranks = {r.name: r.ranks for r in summary.layers}
    assert ranks == {"wte": (6,), "pos": (5,), "embeddings_project": (4, 4, 4)}


def test_a_module_whose_parent_reads_its_weight_is_skipped() -> None:
    """T5's feed-forward reads ``self.wo.weight.dtype``: a TT adapter has no ``weight``,
    so ``wo`` stays dense (listed as skipped) and the model still runs."""

    class FeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wi, self.wo = nn.Linear(16, 64), nn.Linear(64, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.wi(x))
            return self.wo(h.to(self.wo.weight.dtype))

    model = FeedForward()
    summary = tensorize_(model, TensorizeConfig(target_modules=("wi", "wo"), rank=4, cores=2))
    rows = {r.name: r.skipped for r in summary.layers}
    assert rows == {"wi": "", "wo": "skipped: FeedForward reads wo.weight"}
    assert isinstance(model.wi, C.TTLinear) and isinstance(model.wo, nn.Linear)
    assert model(torch.randn(3, 16)).shape == (3, 16)


def test_random_init_draws_at_the_replaced_weights_scale() -> None:
    """``init="random"`` drew torch's default scales (an embedding N(0, 1)), not the
    model's: a GPT-2 word table at initializer_range 0.02 came out 50 times too wide and
    its tied logits started at a loss of 59 against ln V = 6.9. A weight with no scale
    (all zeros) gets torch's default."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(256, 64), nn.Linear(64, 256), nn.Linear(64, 64))
    # scales far from torch's defaults (N(0, 1) for a table, about 0.07 for this linear)
    for m, std in ((model[0], 0.02), (model[1], 0.5)):
        nn.init.normal_(m.weight, std=std)
    nn.init.zeros_(model[2].weight)
    tensorize_(model, TensorizeConfig(target_modules=("*",), rank=16, cores=2,
                                      embedding_cores=2, init="random"))  # fmt: skip
    for i, want in ((0, 0.02), (1, 0.5)):
        got = float(model[i].to_dense().std())
        assert want / 1.5 < got < want * 1.5, (i, got)
    default = float(C.TTLinear(model[2].spec).to_dense().std())  # torch's nn.Linear scale
    assert default / 1.5 < float(model[2].to_dense().std()) < default * 1.5


def test_a_weight_read_through_an_index_is_seen() -> None:
    """A parent reading ``self.layers[0].proj.weight`` (transformers' Inkling vision model
    does) was not seen: both layers were replaced and the first forward failed with an
    AttributeError. Any index counts for every item (``[-1]``, ``[i]``), and a dict's item
    by name."""

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(64, 64, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Layer(), Layer()])
            self.heads = nn.ModuleDict({"a": nn.Linear(64, 64), "b": nn.Linear(64, 64)})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.to(self.layers[0].proj.weight.dtype) * self.heads["a"].weight.sum()
            for layer in self.layers:
                x = layer(x)
            return self.heads["a"](x) + self.heads["b"](x)

    model = Encoder()
    summary = tensorize_(model, TensorizeConfig(target_modules=("proj", "heads.*"), rank=4,
                                                cores=2))  # fmt: skip
    rows = {r.name: r.skipped for r in summary.layers}
    # the read as written: the one read at index 0 keeps every item of layers dense
    read = "skipped: Encoder reads layers[0].proj.weight"
    head = 'skipped: Encoder reads heads["a"].weight'
    assert rows == {"layers.0.proj": read, "layers.1.proj": read, "heads.a": head, "heads.b": ""}
    assert model(torch.randn(2, 64)).shape == (2, 64)


def test_a_shared_module_takes_a_rank_rule_naming_any_of_its_paths() -> None:
    """One linear reached as ``a`` and ``b``: ``rank_for=(("b", 2),)`` was accepted (the
    unmatched-glob check counts every path) but ignored (the rank was looked up by the
    first path alone)."""
    shared = nn.Linear(64, 64)
    model = nn.Module()
    model.a, model.b = shared, shared
    tensorize_(model, TensorizeConfig(target_modules=("a",), rank=8, cores=2,
                                      rank_for=(("b", 2),)))  # fmt: skip
    assert model.a is model.b and C.tensor_train.bond_ranks(model.a.params()) == [2, 2, 2]
    rules = TensorizeConfig(target_modules=("a",), rank_for=(("b", 2), ("a", 3)))
    assert rules.rank_of(("a", "b")) == 3  # the last rule naming one wins


def test_a_layer_of_complex_weights_leaves_the_model_unchanged() -> None:
    """A complex layer after a real one was refused only after the real one had been
    replaced: the model was left half rewritten."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64, dtype=torch.complex64))
    with pytest.raises(ConfigError, match=r"1 holds torch.complex64 weights; .* exclude it"):
        tensorize_(model, TensorizeConfig(target_modules=("0", "1"), rank=4, cores=2))
    assert [type(m) for m in model] == [nn.Linear, nn.Linear]
    tensorize_(model, TensorizeConfig(target_modules=("0", "1"), exclude=("1",), rank=4, cores=2))
    assert isinstance(model[0], C.TTLinear)


def test_a_weight_read_in_a_helper_method_or_a_base_class_is_seen() -> None:
    """DeBERTa-v2's encoder reads ``rel_embeddings.weight`` in ``get_rel_embedding``, not in
    ``forward``: a read anywhere in the parent's class (or a base below ``nn.Module``)
    keeps the module dense, so the model still runs."""

    class Base(nn.Module):
        def positions(self) -> torch.Tensor:
            return self.rel.weight  # read by a helper of a base class

    class Encoder(Base):
        def __init__(self) -> None:
            super().__init__()
            self.rel, self.proj = nn.Embedding(64, 16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x) + self.positions()[: x.shape[0]]

    model = Encoder()
    summary = tensorize_(model, TensorizeConfig(target_modules=("rel", "proj"), rank=4,
                                                cores=2, min_compression=0))  # fmt: skip
    rows = {r.name: r.skipped for r in summary.layers}
    assert rows == {"rel": "skipped: Encoder reads rel.weight", "proj": ""}
    assert model(torch.randn(5, 16)).shape == (5, 16)


def test_a_weight_read_from_further_up_the_model_is_seen() -> None:
    """nanoGPT's model reads ``self.transformer.wpe.weight`` (its parameter count, which
    ``estimate_mfu`` uses while training) and FSMT's reads
    ``self.decoder.embed_tokens.weight.dtype``: only the direct parent was searched, so
    the layer was replaced and the read failed (no ``weight``). Every module above it is
    searched for the path below it."""

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = nn.ModuleDict(
                {
                    "wte": nn.Embedding(1024, 64),
                    "wpe": nn.Embedding(128, 64),
                    "h": nn.Linear(64, 64),
                }  # fmt: skip
            )

        def num_params(self) -> int:
            n = sum(p.numel() for p in self.parameters())
            return n - self.transformer.wpe.weight.numel()

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(idx.shape[1])
            t = self.transformer
            return t.h(t.wte(idx) + t.wpe(pos))

    model = GPT()
    summary = tensorize_(model, TensorizeConfig(target_modules=("wte", "wpe", "h"), rank=8))
    rows = {r.name: r.skipped for r in summary.layers}
    assert rows["transformer.wpe"] == "skipped: GPT reads transformer.wpe.weight"
    assert not rows["transformer.wte"] and not rows["transformer.h"]
    assert isinstance(model.transformer.wte, C.TTMEmbedding)
    assert model.num_params() > 0 and model(torch.randint(0, 1024, (2, 16))).shape == (2, 16, 64)


def test_frozen_layers_stay_frozen_and_half_frozen_ones_stay_dense() -> None:
    model = _toy()
    model.up.requires_grad_(False)
    model.embed.requires_grad_(False)
    model.odd.weight.requires_grad_(False)  # BitFit-style: the bias alone trains
    summary = tensorize_(model, TensorizeConfig(target_modules=("up", "down", "odd", "embed"),
                                                rank=4, cores=2, min_compression=0))  # fmt: skip
    rows = {r.name: r.skipped for r in summary.layers}
    assert rows["odd"] == "skipped: its weight alone is frozen; a TT layer trains all or none"
    assert isinstance(model.odd, nn.Linear)
    for frozen in (model.up, model.embed):
        assert not any(p.requires_grad for p in frozen.parameters())
    assert all(p.requires_grad for p in model.down.parameters())
    ModuleTask(model, lambda call, batch: None, iter(()))  # all or none: accepted


def test_a_frozen_tied_head_with_a_trained_bias_is_one_tied_decoder() -> None:
    """The half-frozen check is for layers replaced on their own: a head tied to a frozen
    embedding becomes its TiedDecoder (keeping its bias as is), listed once."""

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)
            self.head.weight = self.emb.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(ids))

    model = Head()
    model.emb.requires_grad_(False)  # the head's bias still trains
    summary = tensorize_(model, TensorizeConfig(target_modules=("emb", "head"), rank=4,
                                                embedding_cores=2))  # fmt: skip
    assert [r.name for r in summary.layers] == ["emb", "head"]
    assert summary.layers[1].skipped == "tied to emb" and isinstance(model.head, TiedDecoder)
    assert model.head.bias.requires_grad
    assert not any(p.requires_grad for p in model.emb.parameters())


def test_set_up_methods_alone_are_passed_over_when_looking_for_weight_reads() -> None:
    from comera.tensorize import _SET_UP

    for name in ("__init__", "_init_weights", "init_weights", "post_init", "tie_weights",
                 "_tie_or_clone_weights", "reset_parameters", "resize_token_embeddings",
                 "resize_position_embeddings"):  # fmt: skip
        assert _SET_UP.search(name), name
    for name in ("forward", "entity_positions", "get_rel_embedding", "properties", "preset"):
        assert not _SET_UP.search(name), name


def test_an_exclude_glob_that_matches_nothing_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"exclude glob 'attention' matches no .*up"):
        tensorize_(_toy(), TensorizeConfig(target_modules=("up",), exclude=("attention",)))


def test_a_module_at_two_paths_is_targeted_or_excluded_at_either() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(64, 64)
            self.dec = self.enc  # one module, two paths
            self.out = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.dec(self.enc(x)))

    kept = Twice()
    tensorize_(kept, TensorizeConfig(target_modules=("*",), exclude=("dec",), rank=4))
    assert type(kept.enc) is nn.Linear and kept.dec is kept.enc
    assert isinstance(kept.out, C.TTLinear)
    # every match excluded: an error, not an empty summary over an unchanged model
    with pytest.raises(ConfigError, match=r"every module the target globs \['enc'\] match"):
        tensorize_(Twice(), TensorizeConfig(target_modules=("enc",), exclude=("dec",)))
    named = Twice()
    tensorize_(named, TensorizeConfig(target_modules=("dec",), rank=4))
    assert isinstance(named.enc, C.TTLinear) and named.dec is named.enc


def test_exclude_keeps_a_tied_head_and_so_its_embedding() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_positions=16, n_embd=32, n_layer=1, n_head=4))  # fmt: skip
    summary = tensorize_(gpt, TensorizeConfig(target_modules=("wte",), exclude=("lm_head",),
                                              rank=4, cores=2, embedding_cores=2))  # fmt: skip
    assert isinstance(gpt.lm_head, nn.Linear) and gpt.lm_head.weight is gpt.transformer.wte.weight
    assert [r.skipped for r in summary.layers] == [
        "skipped: its weight is shared with lm_head, which this rewrite keeps"
    ]


def test_embedding_modules_sharing_one_weight_stay_and_say_why() -> None:
    """T5 holds one weight in three embedding modules (and its head): one TTM cannot
    stand for several modules, so each stays, naming the others (not a circular 'kept')."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4))  # fmt: skip
    summary = tensorize_(t5, TensorizeConfig(target_modules=("shared", "embed_tokens"), rank=4,
                                             cores=2, embedding_cores=2))  # fmt: skip
    rows = {r.name: r.skipped for r in summary.layers}
    assert "(encoder.embed_tokens, decoder.embed_tokens); one TTM" in rows["shared"]
    assert all("not supported" in why for why in rows.values()) and len(rows) == 3
    assert type(t5.shared) is nn.Embedding
    # an exclude that keeps the others is the reason given, each named once
    only = TensorizeConfig(target_modules=("shared",), exclude=("embed_tokens",), rank=4)
    summary = tensorize_(t5, only)
    (why,) = [r.skipped for r in summary.layers]
    assert why.endswith("(encoder.embed_tokens, decoder.embed_tokens); the exclude keeps "
                        "encoder.embed_tokens, decoder.embed_tokens")  # fmt: skip
    # one excluded, one not: dropping the exclude would change nothing, so not named
    part = TensorizeConfig(target_modules=("shared",), exclude=("encoder.embed_tokens",), rank=4)
    (why,) = [r.skipped for r in tensorize_(t5, part).layers]
    assert why.endswith("not supported")


def test_a_tied_decoder_checks_the_bias_it_reads_elsewhere() -> None:
    """``bias_from`` is keyword-only, names a module's tensor, and agrees with ``bias``;
    the decoder then adds what the owner holds now."""
    from comera.nn import TTMEmbedding

    spec = C.TTMEmbeddingSpec(vocab_modes=(4, 5), dim_modes=(2, 3), ranks=3, num_embeddings=18)
    emb = TTMEmbedding(spec, generator=torch.Generator().manual_seed(0))
    owner = torch.nn.Module()
    owner.bias = torch.nn.Parameter(torch.zeros(18))
    with pytest.raises(TypeError):
        TiedDecoder(emb, owner.bias, (owner, "bias"))  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"bias_from must be an \(nn.Module, attribute"):
        TiedDecoder(emb, None, bias_from=(owner.bias, "bias"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Module.weight, which holds nothing, not a bias"):
        TiedDecoder(emb, None, bias_from=(owner, "weight"))
    with pytest.raises(ValueError, match="bias is not the tensor Module.bias holds"):
        TiedDecoder(emb, torch.zeros(18), bias_from=(owner, "bias"))
    x = torch.randn(2, 6)
    for given in (owner.bias, None):
        head = TiedDecoder(emb, given, bias_from=(owner, "bias"))
        assert head.bias is owner.bias and not list(head.parameters())
        with torch.no_grad():
            owner.bias.fill_(1.0)
        torch.testing.assert_close(head(x), TiedDecoder(emb, None)(x) + 1.0)
        with torch.no_grad():
            owner.bias.zero_()


def test_a_tied_decoder_keeps_a_bias_tied_elsewhere_one_parameter() -> None:
    """BERT's MLM head ties ``decoder.bias`` to ``cls.predictions.bias``: the decoder
    reads that parameter itself, so it is trained once, counted once and saved once."""
    transformers = pytest.importorskip("transformers")

    def config() -> object:
        return transformers.BertConfig(
            vocab_size=120, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=16)  # fmt: skip

    torch.manual_seed(0)
    bert = transformers.BertForMaskedLM(config())
    tensorize_(bert, TensorizeConfig(target_modules=("word_embeddings",), rank=4, cores=2,
                                     embedding_cores=2))  # fmt: skip
    head = bert.cls.predictions
    assert isinstance(head.decoder, TiedDecoder) and head.decoder.bias is head.bias
    ids = torch.randint(0, 120, (2, 8), generator=torch.Generator().manual_seed(1))
    bert(input_ids=ids, labels=ids).loss.backward()
    assert head.bias.grad is not None
    names = [n for n, _ in bert.named_parameters() if n.endswith("predictions.bias")
             or n.endswith("decoder.bias")]  # fmt: skip
    assert names == ["cls.predictions.bias"]
    # saved once, so a strict load into a twin tensorized the same way finds every key;
    # a state dict that also holds the decoder's own copy (files from when it trained one)
    # loads that copy, the trained one
    torch.manual_seed(2)
    twin = transformers.BertForMaskedLM(config())  # the original config: tied
    tensorize_(twin, TensorizeConfig(target_modules=("word_embeddings",), rank=4, cores=2,
                                     embedding_cores=2))  # fmt: skip
    state = bert.state_dict()
    assert "cls.predictions.decoder.bias" not in state
    twin.load_state_dict(state)  # strict
    assert torch.equal(twin.cls.predictions.decoder.bias, head.bias)
    twin.load_state_dict({**state, "cls.predictions.decoder.bias": head.bias.detach() + 1})
    assert torch.equal(twin.cls.predictions.bias, head.bias + 1)
    # the decoder adds whatever its owner holds now: functional_call, assign=True
    from torch.func import functional_call

    bert.eval()
    other = {"cls.predictions.bias": torch.full_like(head.bias, 3.0)}
    swapped = functional_call(bert, other, (ids,)).logits
    plain = bert(input_ids=ids).logits
    torch.testing.assert_close(swapped - plain, (3.0 - head.bias).expand_as(plain))
    # an older file under assign=True: the owner takes the decoder's trained copy, and
    # the tensors the caller passed stay as they were
    old = {k: v.clone() for k, v in state.items()}
    given, trained = old["cls.predictions.bias"], head.bias.detach() + 5
    kept = given.clone()
    twin.load_state_dict({**old, "cls.predictions.decoder.bias": trained}, assign=True)
    assert torch.equal(given, kept) and torch.equal(twin.cls.predictions.bias, trained)
    assert isinstance(twin.cls.predictions.bias, nn.Parameter)
    assert twin.cls.predictions.bias.requires_grad
    # as torch assigns its own keys: a frozen bias stays frozen, whatever the file holds
    twin.cls.predictions.bias.requires_grad_(False)
    twin.load_state_dict({**old, "cls.predictions.decoder.bias": nn.Parameter(trained + 1)},
                         assign=True)  # fmt: skip
    assert torch.equal(twin.cls.predictions.bias, trained + 1)
    assert not twin.cls.predictions.bias.requires_grad
    twin.load_state_dict(state, assign=True)
    assert twin.cls.predictions.decoder.bias is twin.cls.predictions.bias
    # a wrong shape under the decoder's old key is named as load_state_dict names its own
    with pytest.raises(RuntimeError, match=r"size mismatch for cls\.predictions\.decoder\.bias"):
        twin.load_state_dict({**state, "cls.predictions.decoder.bias": torch.zeros(1)})
    # setting the decoder's bias (as HF's tying does) sets the owner's
    new = nn.Parameter(torch.full_like(head.bias, 7.0))
    twin.cls.predictions.decoder.bias = new
    assert (
        twin.cls.predictions.bias is new and "bias" not in twin.cls.predictions.decoder._parameters
    )


def test_tied_heads_sharing_only_their_bias_register_it_once() -> None:
    """Two heads tied to one embedding and sharing a bias with nothing else: the first
    decoder registers the bias, the second reads it; it stays a trained parameter."""

    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(64, 16)
            self.head, self.other = nn.Linear(16, 64), nn.Linear(16, 64)
            self.head.weight = self.other.weight = self.emb.weight
            self.other.bias = self.head.bias

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.emb(ids)
            return self.head(h) + self.other(h)

    torch.manual_seed(0)
    model = TwoHeads()
    tensorize_(model, TensorizeConfig(target_modules=("emb",), rank=4, embedding_cores=2))
    assert isinstance(model.head, TiedDecoder) and isinstance(model.other, TiedDecoder)
    assert [n for n, _ in model.named_parameters() if "bias" in n] == ["head.bias"]
    assert model.other.bias is model.head.bias
    model(torch.arange(8)).sum().backward()
    assert model.head.bias.grad is not None


def test_subclasses_with_their_own_forward_are_skipped() -> None:
    """A scaled word embedding (BART's) or an offset positional one (OPT's) adds to the
    plain lookup: replacing it by a TTM lookup would drop that silently."""

    class Scaled(nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * 4.0

    class Plain(nn.Linear):  # a subclass that keeps the forward is still a linear
        pass

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.proj = Scaled(100, 64), Plain(64, 64)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.proj(self.emb(ids))

    torch.manual_seed(0)
    model, ids = Model().double(), torch.randint(0, 100, (2, 5))
    want = model(ids)
    summary = tensorize_(model, TensorizeConfig(target_modules=("*",), **EXACT))
    rows = {r.name: r for r in summary.layers}
    assert type(model.emb) is Scaled and "Scaled has its own forward" in rows["emb"].skipped
    assert isinstance(model.proj, C.TTLinear) and not rows["proj"].skipped
    torch.testing.assert_close(model(ids), want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models_are_compressed_in_their_dtype(dtype: torch.dtype) -> None:
    """torch has no half-precision SVD: the TT-SVD runs in fp32 and the cores come back in
    the model's dtype."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Embedding(256, 64)).to(dtype)
    x, ids = torch.randn(3, 64, dtype=dtype), torch.randint(0, 256, (3,))
    want = model[0](x).float(), model[1](ids).float()
    tensorize_(model, TensorizeConfig(target_modules=("0", "1"), **EXACT))
    assert {p.dtype for p in model.parameters()} == {dtype}
    tol = {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(model[0](x).float(), want[0], **tol)
    torch.testing.assert_close(model[1](ids).float(), want[1], **tol)


def test_compact_keeps_what_was_frozen_and_the_bias_parameter() -> None:
    """``compact()`` replaces the cores and gates: each keeps its ``requires_grad`` (an
    optimizer rebuilt from the trainable parameters must not train a frozen layer), and
    the bias, which compaction never slices, stays the same parameter."""
    torch.manual_seed(0)
    lin = C.TTLinear(C.propose_tt_linear(64, 64, d=2, ranks=8))
    emb = C.TTMEmbedding(C.TTMEmbeddingSpec(vocab_modes=(8, 8), dim_modes=(4, 4), ranks=(6,)))
    for module in (lin, emb):
        module.requires_grad_(False)
        module.prune(0.5 if module is lin else 10.0)
    lin.bias.requires_grad_(True)  # a layer frozen but its bias
    bias = lin.bias
    for module in (lin, emb):
        module.compact()
    assert [n for n, p in lin.named_parameters() if p.requires_grad] == ["bias"]
    assert lin.bias is bias and not any(p.requires_grad for p in emb.parameters())
    trained = C.TTLinear(C.propose_tt_linear(64, 64, d=2, ranks=8))
    trained.prune(0.5)
    trained.compact()
    assert all(p.requires_grad for p in trained.parameters())


def test_a_table_takes_fewer_cores_where_its_dim_splits_exactly() -> None:
    """A dim of 30 has no 4-way split but a 3-way one: the table was skipped as having "no
    balanced split" (the 4-way split padded it, and a table's dim is never padded); it now
    takes 3 cores and is exact at full rank. A prime dim is still skipped, by name."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Embedding(1000, 30), "b": nn.Embedding(1000, 31)})
    ids = torch.tensor([0, 7, 999])
    before = model["a"](ids)
    summary = tensorize_(model, TensorizeConfig(target_modules="*", rank=1000,
                                                min_compression=0.0))  # fmt: skip
    a, b = summary.layers
    assert a.modes == "[10, 10, 10] x [2, 3, 5]" and not a.skipped
    torch.testing.assert_close(model["a"](ids), before, rtol=1e-4, atol=1e-5)
    assert b.skipped == "skipped: dim 31 has no balanced split into 2 or more factors"
    assert isinstance(model["b"], nn.Embedding)


def test_a_table_too_small_for_two_cores_is_skipped_not_fatal() -> None:
    """BERT's 2-row ``token_type_embeddings`` has no split into the two cores a TTM train
    needs: it is listed as skipped (it raised a ConfigError after the word embedding had
    been replaced, leaving the model half rewritten), and a padded linear has ``prune``
    and ``compact`` like every replaced layer."""
    model = nn.ModuleDict({"words": nn.Embedding(1000, 64), "types": nn.Embedding(2, 64),
                           "odd": nn.Linear(64, 97)})  # fmt: skip
    summary = tensorize_(model, TensorizeConfig(target_modules=("words", "types", "odd")))
    assert isinstance(model["words"], C.TTMEmbedding) and isinstance(model["types"], nn.Embedding)
    (types,) = [r for r in summary.layers if r.name == "types"]
    assert types.skipped == "skipped: 2x64 has no split into 2 or more cores"
    odd = model["odd"]
    assert isinstance(odd, PaddedTTLinear)
    x = torch.randn(3, 64)
    before = odd(x)
    with torch.no_grad():
        odd.inner.gates[0][::2] = 0
    live = odd.prune(1e-6)
    after_prune = odd(x)
    odd.compact()
    assert tuple(C.tensor_train.bond_ranks(odd.inner.params()))[0] == live[0] < 8
    torch.testing.assert_close(odd(x), after_prune)
    assert not torch.equal(after_prune, before)


@pytest.mark.parametrize("assign", [False, True])
def test_a_compacted_state_dict_loads_into_a_model_tensorized_alike(assign: bool) -> None:
    """After compaction the trains are smaller than a fresh tensorization's: loading the
    saved state dict resizes each layer to the saved ranks first (it failed with size
    mismatches, assign or not), and the model computes what the saved one did."""
    torch.manual_seed(0)
    cfg = TensorizeConfig(target_modules=("embed", "up", "down", "odd"), rank=8)
    saved = Toy()
    tensorize_(saved, cfg)
    for m in saved.modules():
        if isinstance(m, (C.TTLinear, C.TTMEmbedding)):
            with torch.no_grad():
                m.gates[0][1::2] = 0
            m.prune(1e-6)
            m.compact()
    saved.down.requires_grad_(False)
    ids = torch.randint(0, 100, (2, 5))
    fresh = Toy()
    tensorize_(fresh, cfg)
    fresh.down.requires_grad_(False)  # frozen stays frozen through the resize
    with pytest.warns(UserWarning, match="build the optimizer .*after loading"):
        fresh.load_state_dict(saved.state_dict(), assign=assign)
    torch.testing.assert_close(fresh(ids), saved(ids), rtol=0, atol=0)
    assert [p.shape for p in fresh.parameters()] == [p.shape for p in saved.parameters()]
    assert not any(p.requires_grad for p in fresh.down.parameters())
    # other modes are not a train at other ranks: torch's own size-mismatch error
    other = C.TTLinear(C.TTLinearSpec(out_modes=(8, 16), in_modes=(8, 8), ranks=4))
    state = {k: v for k, v in saved.up.state_dict().items()}
    with pytest.raises(RuntimeError, match="size mismatch"):
        other.load_state_dict(state)


def test_summaries_count_a_padded_table_at_its_rows_when_told() -> None:
    spec = C.propose_ttm_embedding(1009, 64, d=3, ranks=8)
    p, s = C.init(spec)
    assert spec.padded_vocab > 1009
    (padded,) = C.summarize({"emb": p}, {"emb": s})
    (real,) = C.summarize({"emb": p}, {"emb": s}, num_embeddings={"emb": 1009})
    assert padded.dense_params == spec.padded_vocab * 64 and padded.dense_shape[0] > 1009
    assert real.dense_params == 1009 * 64 and real.dense_shape == (1009, 64)
    assert real.compression == pytest.approx(C.compression_ratio(p, s, 1009))
    assert "| emb | ttm_embedding | 1009x64 |" in C.summary_table(
        {"emb": p}, {"emb": s}, num_embeddings={"emb": 1009}
    )


def test_summaries_count_padded_linears_at_their_sizes_from_the_module() -> None:
    """A train holds the padded sizes tensorize_ gave awkward layers: summarize counted
    12,714 dense parameters for a model of 11,360 (7.3x claimed, 6.4x real) without the
    module's own sizes, which ModuleTask.dense_shapes gives."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.Linear(13, 97), nn.Linear(97, 101),
                          nn.Embedding(1009, 8))  # fmt: skip
    dense = sum(p.numel() for p in model.parameters())
    tensorize_(model, TensorizeConfig(target_modules="*", rank=6, cores=2, min_compression=0))
    assert any(isinstance(m, PaddedTTLinear) for m in model)
    task = ModuleTask(model, lambda call, batch: 0, iter([]))
    shapes = task.dense_shapes()
    assert shapes == {"0": (13, 7), "1.inner": (97, 13), "2.inner": (101, 97), "3": (1009, 8)}
    rows = C.summarize(task.params(), task.state(), dense_shapes=shapes)
    assert sum(r.dense_params for r in rows) == dense
    assert sum(r.dense_params for r in C.summarize(task.params(), task.state())) > dense
    table = C.summary_table(task.params(), task.state(), dense_shapes=shapes)
    assert "| 1.inner | tt_linear | 97x13 |" in table and f"| {dense:,} |" in table


def test_summary_rows_of_skipped_layers_and_unmet_targets_say_what_is_so() -> None:
    """A layer skipped for how it is called counted its weight without its bias (one
    skipped for its size counted both); a skip quoted the rank asked for, not the capped
    ranks the check used; a compression target rank 1 cannot meet was met silently."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(32, 3))
    model[0].register_forward_hook(lambda *a: None)
    summary = tensorize_(model, TensorizeConfig(target_modules="*", rank=2, min_compression=0))
    assert summary.layers[0].skipped and summary.layers[0].params_before == 16 * 16 + 16
    # its kind as replaced rows say it (it said "Linear" beside their "linear")
    assert [r.kind for r in summary.layers] == ["linear", "linear"]
    # a skipped Conv1D said its stored (in, out) shape where replaced ones say (out, in)
    from transformers.pytorch_utils import Conv1D

    conv = nn.Sequential(Conv1D(128, 32), Conv1D(128, 32))  # (nf=out, nx=in)
    conv[0].register_forward_hook(lambda *a: None)
    rows = tensorize_(conv, TensorizeConfig(target_modules="*", min_compression=0)).layers
    assert [r.kind for r in rows] == ["conv1d", "conv1d"] and rows[0].skipped
    assert rows[0].shape == rows[1].shape == (128, 32)
    # an empty linear failed the whole call on an internal assertion, replacing nothing
    empty = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 0), nn.Linear(0, 16))
    rows = tensorize_(empty, TensorizeConfig(target_modules="*", min_compression=0)).layers
    assert isinstance(empty[0], C.TTLinear) and isinstance(empty[1], nn.Linear)
    assert [r.skipped for r in rows[1:]] == [
        "skipped: an empty 0x16 weight has nothing to compress",
        "skipped: an empty 16x0 weight has nothing to compress",
    ]
    wide = TensorizeConfig(target_modules="*", rank=100_000, cores=2)
    big = tensorize_(nn.Sequential(nn.Linear(16, 16)), wide)
    assert (
        big.layers[0].skipped
        == "skipped: a rank-100000 (capped to 4,16,4) train is larger than the dense layer"
    )
    some = TensorizeConfig(target_modules="*", rank=8, cores=2, min_compression=1000)
    capped = tensorize_(nn.Sequential(nn.Linear(16, 16)), some).layers[0].skipped
    assert (
        capped == "skipped: a rank-8 (capped to 4,8,4) train is not 1000x smaller than the "
        "dense layer (min_compression)"
    )
    half = TensorizeConfig(target_modules="*", rank=16, cores=2, min_compression=0.5)
    larger = tensorize_(nn.Sequential(nn.Linear(16, 16)), half).layers[0].skipped
    assert larger.endswith("train is more than 2x the dense layer's size (min_compression)")
    four = TensorizeConfig(target_modules="*", rank=64, compression=4.0)
    short = tensorize_(nn.Sequential(nn.Linear(32, 3)), four)
    row = short.layers[0]
    assert row.ranks == (1,) and not row.skipped
    assert row.note == f"rank 1 is only {row.compression:.2f}x smaller, short of compression=4"
    assert row.note in str(short)


def test_load_tensors_keeps_a_frozen_layer_frozen() -> None:
    """A train pruned and compacted through the functional API, installed with
    ``load_tensors``, came back trainable: every new parameter had requires_grad=True."""
    torch.manual_seed(0)
    lin = C.TTLinear(C.propose_tt_linear(16, 16, d=2, ranks=4))
    lin.requires_grad_(False)
    p, s = C.compact(lin.params(), C.prune(lin.params(), lin.state(), 0.3, rule="contribution"))
    lin.load_tensors(p, s)
    assert not any(t.requires_grad for t in lin.parameters())
    fresh = C.TTLinear(C.propose_tt_linear(16, 16, d=2, ranks=4))  # a trained one stays trained
    fresh.load_tensors(*C.compact(fresh.params(), fresh.state()))
    assert all(t.requires_grad for t in fresh.parameters())


def test_modules_called_otherwise_than_their_class_says_stay_dense() -> None:
    """Hooks, an instance's own forward, a shared bias, and a tied linear whose parent
    reads its weight: replacing any of them would change the model silently (a hook that
    zeroes the output stopped running) or fail at the first forward; each stays, named."""
    torch.manual_seed(0)
    hooked = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    hooked[0].register_forward_hook(lambda mod, args, out: out * 0)
    hooked[1].register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    hooked[2].forward = lambda x: x  # as accelerate's hooks set it
    hooked.append(torch.nn.utils.parametrizations.spectral_norm(nn.Linear(16, 16)))
    x = torch.randn(2, 16)
    before = hooked(x)
    summary = tensorize_(hooked, TensorizeConfig(target_modules=("*",), min_compression=0))
    assert [r.skipped for r in summary.layers] == [
        "skipped: it has forward hooks (test_modules_called_otherwise_than_their_class_says_stay_"
        "dense.<locals>.<lambda>), which the adapter would not run",
        "skipped: it has forward pre-hooks (test_modules_called_otherwise_than_their_class_says_"
        "stay_dense.<locals>.<lambda>), which the adapter would not run",
        "skipped: the module has its own forward (set on the instance), which the adapter lacks",
        "skipped: its weight is parametrized (torch.nn.utils.parametrize), which the adapter drops",
    ]
    assert torch.equal(hooked(x), before)

    class SharedBias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
            self.b.bias = self.a.bias

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.b(self.a(x)))

    shared = SharedBias()
    summary = tensorize_(shared, TensorizeConfig(target_modules=("*",), min_compression=0))
    assert [r.skipped for r in summary.layers] == [
        "skipped: its bias is shared with b; a TT layer holds its own",
        "skipped: its bias is shared with a; a TT layer holds its own",
        "",
    ]
    assert shared.a.bias is shared.b.bias and isinstance(shared.c, C.TTLinear)
    assert summary.params_before == 16 * 16 + 16  # the shared bias is not counted twice

    class ReadsHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)
            self.head.weight = self.emb.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.emb(ids) @ self.head.weight.T  # the tied decoder would have none

    tied = ReadsHead()
    ids = torch.randint(0, 64, (2, 3))
    before = tied(ids)
    summary = tensorize_(tied, TensorizeConfig(target_modules=("emb",), rank=8))
    assert [r.skipped for r in summary.layers] == [
        "skipped: its weight is tied to head, which must stay: ReadsHead reads head.weight"
    ]
    assert torch.equal(tied(ids), before)


def test_bad_tensorize_configs_name_the_field() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    bad = [
        ({"rank": "4"}, "rank='4' must be an int"),
        ({"rank": True}, "rank=True must be an int"),
        ({"cores": 2.0}, "cores=2.0 must be an int"),
        ({"embedding_rank": 1.5}, "embedding_rank=1.5 must be an int"),
        ({"target_modules": 5}, "target_modules=5 must be a glob or a list of globs"),
        ({"target_modules": (1,)}, "target_modules=(1,) must be a glob"),
        ({"exclude": [None]}, "exclude=[None] must be a glob"),
        ({"rank_for": ("1", 2)}, "rank_for=('1', 2) must be (glob, rank) pairs"),
        ({"rank_for": (("0", "2"),)}, "must be (glob, rank) pairs"),
        ({"min_compression": float("nan")}, "min_compression must be finite and >= 0"),
        ({"min_compression": "2"}, "min_compression='2' must be a number"),
        ({"compression": float("inf")}, "compression must be finite and > 1"),
        # every table stayed dense, "no split into 2 or more cores": the setting's fault
        ({"embedding_cores": 1}, "embedding_cores=1: a TTM table needs >= 2 cores"),
    ]
    for kw, text in bad:
        with pytest.raises(ConfigError, match=re.escape(text)):
            TensorizeConfig(**{"target_modules": ("*",), **kw})
    # a dict of rank rules is taken in order, and a list of globs as a tuple
    cfg = TensorizeConfig(target_modules=["0", "1"], rank_for={"0": 2, "1": 3})
    assert cfg.target_modules == ("0", "1") and cfg.rank_for == (("0", 2), ("1", 3))
    with pytest.raises(ConfigError, match="rank_for glob 'typo' matches no nn.Linear"):
        tensorize_(model, TensorizeConfig(target_modules=("*",), rank_for=(("typo", 2),)))
    with pytest.raises(TypeError, match="config is a dict; pass a TensorizeConfig"):
        tensorize_(model, {"target_modules": ("*",)})  # type: ignore[arg-type]
    # a second call over layers it replaced: said so, not that they are no linear
    twice = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    tensorize_(twice, TensorizeConfig(target_modules=("0",), rank=2, min_compression=0))
    with pytest.raises(ConfigError, match=r"'0' matches only layers already tensorized \(0\)"):
        tensorize_(twice, TensorizeConfig(target_modules=("0",), rank=2, min_compression=0))
    odd = nn.Sequential(nn.Linear(16, 97))  # padded: its train sits at 0.inner
    tensorize_(odd, TensorizeConfig(target_modules=("*",), rank=2, min_compression=0))
    with pytest.raises(ConfigError, match=r"already tensorized \(0\); tensorize_ replaces"):
        tensorize_(odd, TensorizeConfig(target_modules=("*",), rank=2, min_compression=0))
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    with pytest.raises(ConfigError, match="1's weight holds NaN or inf, .* init='random'"):
        tensorize_(model, TensorizeConfig(target_modules=("*",), min_compression=0))
    assert type(model[0]) is nn.Linear  # refused before anything was replaced
    model[1].register_forward_hook(lambda mod, args, out: out)  # it stays dense: no SVD
    summary = tensorize_(model, TensorizeConfig(target_modules=("*",), min_compression=0))
    assert isinstance(model[0], C.TTLinear) and summary.layers[1].skipped
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(ConfigError, match="0's weight is on the meta device, .* init='random'"):
        tensorize_(meta, TensorizeConfig(target_modules=("*",), min_compression=0))
    lazy = nn.Sequential(nn.LazyLinear(16))
    with pytest.raises(ConfigError, match="0 is a lazy module .* run one forward pass first"):
        tensorize_(lazy, TensorizeConfig(target_modules=("*",)))


def test_configs_as_peft_and_numpy_give_them_and_hf_input_grads_hook_is_carried() -> None:
    """A set of globs (PEFT's ``LoraConfig.target_modules``) and numpy integers are taken;
    Hugging Face's ``enable_input_require_grads`` hook (gradient checkpointing, PEFT's k-bit
    preparation) reads nothing of the embedding and moves onto its adapter, which is
    replaced, not skipped."""
    np = pytest.importorskip("numpy")
    transformers = pytest.importorskip("transformers")
    cfg = TensorizeConfig(target_modules={"value", "query"}, rank=np.int64(4),
                          min_compression=np.float32(0.5))  # fmt: skip
    assert cfg.target_modules == ("query", "value") and cfg.rank == 4
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64))  # fmt: skip
    bert.enable_input_require_grads()
    # PEFT's dotted entries match a name's last parts: they matched nothing
    summary = tensorize_(bert, TensorizeConfig(target_modules=["embeddings.word_embeddings",
                                                               "self.query"],
                                               rank=4, embedding_cores=2))  # fmt: skip
    assert [r.name for r in summary.layers] == [
        "embeddings.word_embeddings", "encoder.layer.0.attention.self.query"]  # fmt: skip
    assert not summary.layers[0].skipped
    emb = bert.embeddings.word_embeddings
    assert isinstance(emb, C.TTMEmbedding) and len(emb._forward_hooks) == 1
    with torch.no_grad():  # the hook marks the output as requiring grad, as on the table
        assert emb(torch.tensor([[1, 2]])).requires_grad
    # and Hugging Face's own handle removes it: it pointed at the replaced table's hook
    bert.disable_input_require_grads()
    assert not emb._forward_hooks
    with torch.no_grad():
        assert not emb(torch.tensor([[1, 2]])).requires_grad


def test_a_rank_rule_or_a_call_that_changes_nothing_is_said() -> None:
    """A rank_for glob naming a module no target chooses (a tied head's ``lm_head``, a
    layer left out) was accepted and did nothing; a call whose every match stayed dense
    (MultiheadAttention reads its out_proj's weight itself) returned quietly, the model
    unchanged. The first is refused, the second warned about."""
    import warnings

    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    with pytest.raises(ConfigError, match="rank_for glob '1' matches 1, which no target glob"):
        C.tensorize_(model, C.TensorizeConfig(target_modules=("0",), rank_for={"1": 4}))
    assert all(isinstance(m, nn.Linear) for m in model)  # refused before any change
    C.tensorize_(model, C.TensorizeConfig(target_modules=("0", "1"), rank_for={"1": 2}))

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(16, 2)

    with pytest.warns(UserWarning, match="every module the globs chose was left dense"):
        C.tensorize_(Attention(), C.TensorizeConfig(target_modules=("out_proj",)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        C.tensorize_(nn.Sequential(nn.Linear(64, 64)),
                     C.TensorizeConfig(target_modules=("0",), rank=2))  # fmt: skip


def test_a_rank_rule_for_a_targeted_tied_head_is_refused() -> None:
    """A rank_for rule over a head tied to a replaced embedding did nothing when the head
    was itself a target: the head reads the embedding's table, at its rank."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(64, 16)
            self.lm_head = nn.Linear(16, 64, bias=False)
            self.lm_head.weight = self.wte.weight

    with pytest.raises(ConfigError, match="rank_for glob 'lm_head'"):
        C.tensorize_(Tied(), C.TensorizeConfig(target_modules=("wte", "lm_head"), rank=8,
                                               rank_for={"lm_head": 4}))  # fmt: skip
    C.tensorize_(Tied(), C.TensorizeConfig(target_modules=("wte", "lm_head"), rank=8,
                                           rank_for={"wte": 4}))  # fmt: skip


def test_reading_a_tt_modules_weight_says_why_there_is_none() -> None:
    """Hugging Face's resize_token_embeddings on a tensorized model failed with a bare
    "object has no attribute 'weight'"; ``hasattr`` must still say False (code probing
    for a dense weight takes the other route)."""
    emb = C.TTMEmbedding(C.TTMEmbeddingSpec(vocab_modes=(4, 4), dim_modes=(2, 2), ranks=2))
    lin = C.TTLinear(C.TTLinearSpec(out_modes=(4, 4), in_modes=(2, 2), ranks=2))
    for m in (emb, lin):
        assert not hasattr(m, "weight")
        with pytest.raises(AttributeError, match="holds its weight as TT cores.*before tensorize_"):
            m.weight  # noqa: B018 - the read is the point
    with pytest.raises(AttributeError, match="no attribute 'weights'"):  # others as before
        lin.weights  # noqa: B018
    lin.register_buffer("weight", torch.zeros(2))  # a weight registered after all is read
    assert lin.weight.shape == (2,)
    # a padded linear and a tied decoder, what tensorize_ makes of BERT's 30522-row head
    model = nn.ModuleDict({"words": nn.Embedding(97, 16), "odd": nn.Linear(16, 97)})
    model["odd"].weight = model["words"].weight
    model["pad"] = nn.Linear(16, 97)
    tensorize_(model, TensorizeConfig(target_modules=("words", "odd", "pad"), min_compression=0))
    assert isinstance(model["pad"], PaddedTTLinear) and isinstance(model["odd"], TiedDecoder)
    for m in (model["pad"], model["odd"]):
        assert not hasattr(m, "weight")
        with pytest.raises(AttributeError, match="holds its weight as TT cores"):
            m.weight  # noqa: B018
