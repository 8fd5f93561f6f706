"""Bad input raises errors that name the layer, the value and what was expected."""

import numpy as np
import pytest
import torch

import comera as C
from comera.errors import ConfigError, IdOutOfRangeError, UserError
from comera.layers import tt_linear_shared_input, ttm_logits


def test_modes_must_multiply_to_dims():
    with pytest.raises(ValueError, match=r"'q'.*product of in_modes \[8, 8, 8\] is 512.*768"):
        C.TTLinearSpec(out_modes=(12, 8, 8), in_modes=(8, 8, 8), ranks=4, in_features=768, name="q")
    with pytest.raises(ValueError, match=r"'emb'.*dim_modes.*is 24.*embedding_dim is 25"):
        C.TTMEmbeddingSpec(
            vocab_modes=(4, 5), dim_modes=(4, 6), ranks=2, embedding_dim=25, name="emb"
        )
    with pytest.raises(ValueError, match=r"num_embeddings=30522.*prod\(vocab_modes\)=20"):
        C.TTMEmbeddingSpec(vocab_modes=(4, 5), dim_modes=(4, 6), ranks=2, num_embeddings=30522)


def test_ranks_must_be_positive():
    with pytest.raises(ValueError, match=r"'ffn'.*ranks must be >= 1.*\[3, 0, 3\]"):
        C.TTLinearSpec(out_modes=(4, 4), in_modes=(4, 4), ranks=(3, 0, 3), name="ffn")
    with pytest.raises(ValueError, match="expected 3 internal ranks"):
        C.TTLinearSpec(out_modes=(4, 4), in_modes=(4, 4), ranks=(3, 3))
    with pytest.raises(ValueError, match="must be >= 1"):
        C.TTLinearSpec(out_modes=(4, 0), in_modes=(4, 4), ranks=2)


def test_input_dtype_device_and_shape_mismatch():
    spec = C.TTLinearSpec(out_modes=(2, 3), in_modes=(3, 2), ranks=2, name="v")
    layer = C.TTLinear(spec)
    with pytest.raises(ValueError, match=r"'v'.*dtype torch.float64.*torch.float32"):
        layer(torch.randn(2, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"'v'.*dtype torch.int64.*floating-point.*torch.float32"):
        layer(torch.ones(2, 6, dtype=torch.long))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="int64"):
        layer(torch.ones(2, 6, dtype=torch.long))
    with pytest.raises(ValueError, match=r"'v'.*shape \(2, 5\).*last dim of 6"):
        layer(torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"'v'.*on meta but the cores are on cpu"):
        layer(torch.randn(2, 6, device="meta"))
    # autocast is allowed to mix dtypes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(2, 6, dtype=torch.bfloat16)).shape == (2, 6)


def test_ids_out_of_range_and_bad_dtype():
    spec = C.TTMEmbeddingSpec(
        vocab_modes=(4, 5), dim_modes=(2, 3), ranks=2, num_embeddings=18, name="tok"
    )
    emb = C.TTMEmbedding(spec)
    with pytest.raises(IndexError, match=r"'tok'.*id 18 is out of range.*\[0, 18\)"):
        emb(torch.tensor([0, 18]))  # 18 is inside the padding (20 rows) but not the vocab
    with pytest.raises(IndexError, match=r"id -1"):
        emb(torch.tensor([-1]))
    with pytest.raises(ValueError, match=r"'tok'.*integer tensor.*torch.float32"):
        emb(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="unknown impl 'fast'"):
        C.ttm_embedding(emb.params(), emb.state(), torch.tensor([1]), impl="fast")
    with pytest.raises(ValueError, match="TTMEmbedding 'tok': unknown impl 'fast'"):
        C.TTMEmbedding(spec, impl="fast")


def test_unknown_strategy_and_bad_explicit_path():
    spec = C.TTLinearSpec(out_modes=(2, 3), in_modes=(3, 2), ranks=2, name="o")
    with pytest.raises(ValueError, match=r"'o'.*unknown contraction strategy 'fastest'.*comera"):
        C.TTLinear(spec, plan="fastest")  # when built, not at the first forward
    layer = C.TTLinear(spec)
    layer.plan = "fastest"  # set afterwards: still named at the call
    with pytest.raises(ValueError, match=r"'o'.*unknown contraction strategy 'fastest'.*comera"):
        layer(torch.randn(2, 6))
    with pytest.raises(ValueError, match="unknown contraction strategy"):
        C.set_default_plan("nope")
    p, s = C.init(spec)
    with pytest.raises(ValueError, match=r"step 0 is \(0, 9\)"):
        C.tt_linear(p, s, torch.randn(2, 6), plan=[(0, 9)])
    with pytest.raises(ValueError, match="leaves 3 operands"):
        C.tt_linear(p, s, torch.randn(2, 6), plan=[(0, 1), (0, 1)])


def test_from_dense_shape_mismatch():
    spec = C.TTLinearSpec(out_modes=(2, 3), in_modes=(3, 2), ranks=2, name="k")
    with pytest.raises(ValueError, match=r"'k'.*shape \(6, 6\), got \(6, 5\)"):
        C.from_dense(torch.randn(6, 5), spec)
    # a bias the spec has no place for would be dropped: the layer computes without it
    bare = C.TTLinearSpec(out_modes=(2, 3), in_modes=(3, 2), ranks=2, name="k", bias=False)
    with pytest.raises(ValueError, match=r"'k'.*got a bias but the spec has none"):
        C.from_dense(torch.randn(6, 6), bare, torch.randn(6))
    with pytest.raises(ValueError, match="got a bias"):
        C.TTLinear.from_linear(torch.nn.Linear(6, 6), bare)
    # a bias of another shape: some plans broadcast a (1,) bias, others failed in torch
    for bias in (torch.randn(1), torch.randn(5)):
        with pytest.raises(
            ConfigError, match=r"'k'.*bias of shape \(6,\).*got \(" + str(len(bias))
        ):
            C.from_dense(torch.randn(6, 6), spec, bias)


@pytest.mark.parametrize(
    ("call", "kind", "message"),
    [
        (
            lambda: C.TTLinearSpec(out_modes=(2, 3), in_modes=(3, 2), ranks=2.5),
            ConfigError,
            r"ranks must be an int or one int per bond \(3\), got 2.5",
        ),
        (
            lambda: C.TTLinearSpec(out_modes="ab", in_modes=(3, 2), ranks=2),
            ConfigError,
            "out_modes must be a sequence of ints, got 'ab'",
        ),
        (
            lambda: C.TTLinearSpec(out_modes=(2.5, 2), in_modes=(5,), ranks=2),
            ConfigError,
            "out_modes must be a sequence of ints",
        ),
        (
            lambda: C.tt_linear(*_layer(), torch.randn(2, 6), plan=["dp"]),
            ConfigError,
            "a plan must be a strategy name or a list of",
        ),
        (lambda: C.prune(*_layer(), tau=0.1, rule="x"), ConfigError, "unknown prune rule 'x'"),
        (lambda: C.prune(*_layer(), tau=True), ConfigError, "prune: tau=True; give a finite"),
        (lambda: C.prune(*_layer(), tau="0.1"), ConfigError, "prune: tau='0.1'; give a finite"),
        (lambda: C.prune(*_layer(), tau=np.True_), ConfigError, "prune: tau=np.True_; give a"),
        (lambda: C.propose_tt_linear(768.0, 768), ConfigError,
         "propose_tt_linear: out_features must be an int >= 1, got 768.0"),
        (lambda: C.propose_tt_linear(0, 768), ConfigError,
         "propose_tt_linear: out_features must be an int >= 1, got 0"),
        (lambda: C.propose_ttm_embedding(1000, "64"), ConfigError,
         "propose_ttm_embedding: embedding_dim must be an int >= 1, got '64'"),
        (lambda: C.prune(*_layer(), tau=torch.tensor(True)), ConfigError, "prune: tau=tensor"),
        (lambda: C.prune(*_layer(), tau=10**400), ConfigError, "prune: tau=1000.*; give a"),
        (lambda: C.TTLinearSpec(out_modes=(2,), in_modes=(3,), ranks=1, std=10**400),
         ConfigError, "std must be a finite number > 0"),
        (lambda: _table()(torch.tensor([18])), IdOutOfRangeError, "id 18 is out of range"),
        (
            lambda: C.ttm_embedding(*_table().params_state(), torch.tensor([1]), impl="fast"),
            ConfigError,
            "unknown impl 'fast'",
        ),
        # inf made infinite cores; "0.1" and a str feature count were bare or contradictory
        (lambda: C.TTLinearSpec(out_modes=(2,), in_modes=(3,), ranks=1, std=float("inf")),
         ConfigError, "std must be a finite number > 0"),
        (lambda: C.TTLinearSpec(out_modes=(2,), in_modes=(3,), ranks=1, std="0.1"),
         ConfigError, "std must be a finite number > 0 .*'0.1'"),
        (lambda: C.TTLinearSpec(out_modes=(2,), in_modes=(3,), ranks=1, in_features="3"),
         ConfigError, "in_features must be an int or None, got '3'"),
        (lambda: C.TTLinearSpec(out_modes=(2, 2), in_modes=(3, 3), ranks=True),
         ConfigError, "ranks must be an int"),
        (lambda: C.spec.propose_modes(100.0, 4), ConfigError,
         "propose_modes: dim and d must be ints, got dim=100.0"),
        (lambda: C.TTMEmbeddingSpec(vocab_modes=(3, 3), dim_modes=(2, 2), ranks=2,
                                    embedding_dim="4"),
         ConfigError, "embedding_dim must be an int or None"),
        # None made no bias, and the layer then blamed the params; "no" made one
        (lambda: C.TTLinearSpec(out_modes=(2,), in_modes=(3,), ranks=1, bias=None),
         ConfigError, "'tt_linear': bias must be True or False, got None"),
        (lambda: C.TTLinearSpec(out_modes=(2,), in_modes=(3,), ranks=1, bias="no"),
         ConfigError, "bias must be True or False, got 'no'"),
        # the advice was pad=True, which propose_tt_linear does not take
        (lambda: C.propose_tt_linear(6, 16), ConfigError,
         r"propose_tt_linear: out_features=6 = 2 x 3 has no balanced .* pass a smaller d$"),
        (lambda: C.propose_tt_linear(16, 1031), ConfigError,
         r"in_features=1031 = 1031 has no .*; pad the layer to a size that factors"),
        (lambda: C.propose_ttm_embedding(1000, 10), ConfigError,
         r"propose_ttm_embedding: embedding_dim=10 = 2 x 5 has no .* pass a smaller d$"),
        # 2.5 and "3" failed inside torch, and True was taken as 1
        *[(lambda v=v: C.ttm_embedding(*_table().params_state(), torch.tensor([1, 2]),
                                       impl="static", max_unique=v),
           ConfigError, "max_unique=.* needs impl='static' and an int >= 1")
          for v in (2.5, "3", True)],
        (lambda: C.from_dense(torch.full((6, 6), float("nan")), _spec()), ConfigError,
         "'o': from_dense got a weight holding NaN or inf"),
        (lambda: C.from_dense(np.ones((6, 6), np.float32), _spec()), ConfigError,
         "'o': from_dense takes a torch.Tensor weight, got ndarray"),
        # NaN and "0.1" failed inside range() naming neither; -1 was taken
        *[(lambda v=v: C.spec.propose_modes(30011, 4, pad=True, max_pad=v), ConfigError,
           "propose_modes: max_pad must be a finite number >= 0")
          for v in (float("nan"), "0.1", -1, True)],
        # a size too small to split reached a branch marked unreachable, with no way out
        (lambda: C.spec.propose_modes(7, 3, pad=True), ConfigError,
         "no balanced 3-factorization within 10% of 7; pass a smaller d or a larger max_pad"),
        # 12.0 gave (3, 4.0), a float mode every spec then refused
        (lambda: C.spec.factorize(12.0, 2), ConfigError,
         "factorize: n and d must be ints, got n=12.0"),
    ],
)  # fmt: skip
def test_bad_values_are_user_errors_naming_the_argument(call, kind, message):
    """What a user's configuration gets wrong is a UserError kind (one line from a
    command), its message naming the argument; an id out of range is an IndexError too.
    These were plain ValueErrors (a bug's kind) or bare torch messages."""
    with pytest.raises(kind, match=message) as err:
        call()
    assert isinstance(err.value, UserError)
    if kind is IdOutOfRangeError:
        assert isinstance(err.value, IndexError)


def _spec() -> C.TTLinearSpec:
    return C.TTLinearSpec(out_modes=(2, 3), in_modes=(3, 2), ranks=2, name="o")


def _layer():
    return C.init(_spec())


def test_a_layer_s_params_in_the_other_format_or_dtype_are_named():
    """TTM params passed to tt_linear (and the other way round), a float64 gate beside
    float32 cores and ids of torch's partly supported unsigned types failed in torch (a
    reshape, an unpack, a GEMM's dtype, ``lt_cpu``) without naming the layer or cause."""
    from comera import accounting
    from comera.table_batched import ttm_embedding_batched

    linear, table = _layer(), _table().params_state()
    spec = _spec()
    with pytest.raises(ValueError, match=r"'o': params\['cores'\] must hold 3-D cores .* got "
                                         r"cores of shapes \[\(1, 4, 2, 2\)"):  # fmt: skip
        C.tt_linear(*table, torch.randn(2, 6), spec=spec)
    for impl in ("optimized", "table", "naive"):
        with pytest.raises(ValueError, match="ttm_embedding: params.* must hold 4-D cores"):
            C.ttm_embedding(*linear, torch.tensor([1]), impl=impl)
    with pytest.raises(ValueError, match="table 1: params.* must hold 4-D cores"):
        ttm_embedding_batched([table[0], linear[0]], [table[1], linear[1]], torch.tensor([[1, 1]]))
    with pytest.raises(ValueError, match="tt_linear_flops: params.* must hold 3-D cores"):
        accounting.tt_linear_flops(table[0], 5)
    with pytest.raises(ValueError, match="ttm_embedding_flops: params.* must hold 4-D cores"):
        accounting.ttm_embedding_flops(linear[0], 5)
    params, state = linear
    doubled = {**params, "gates": [g.double() for g in params["gates"]]}
    with pytest.raises(ValueError, match="'o': gate 0 has dtype torch.float64 but the cores"):
        C.tt_linear(doubled, state, torch.randn(2, 6), spec=spec)
    for dtype in (torch.uint16, torch.uint32, torch.uint64):
        ids = torch.tensor([1], dtype=dtype)
        with pytest.raises(ValueError, match=f"ids have dtype {dtype}.* ids.long"):
            C.ttm_embedding(*table, ids)
        with pytest.raises(ValueError, match=f"ids have dtype {dtype}"):
            ttm_embedding_batched([table[0]], [table[1]], ids[:, None])
    # what still works: cores in an nn.ParameterList, a float32 gate beside bf16 cores
    # under autocast (it casts each GEMM's operands), uint8 ids, numpy int max_unique, a
    # numpy bool bias
    listed = {**params, "cores": torch.nn.ParameterList(params["cores"])}
    assert C.tt_linear(listed, state, torch.randn(2, 6)).shape == (2, 6)
    half = {**params, "cores": [c.bfloat16() for c in params["cores"]]}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert C.tt_linear(half, state, torch.randn(2, 6)).dtype == torch.bfloat16
    assert C.ttm_embedding(*table, torch.tensor([1], dtype=torch.uint8)).shape == (1, 6)
    rows = C.ttm_embedding(*table, torch.tensor([1, 1]), impl="static", max_unique=np.int64(1))
    assert rows.shape == (2, 6)
    assert C.TTLinearSpec(out_modes=(2,), in_modes=(3,), ranks=1, bias=np.False_).bias is False


class _Table(C.TTMEmbedding):
    def params_state(self):
        return self.params(), self.state()


def _table() -> _Table:
    spec = C.TTMEmbeddingSpec(vocab_modes=(4, 5), dim_modes=(2, 3), ranks=2, num_embeddings=18)
    return _Table(spec)


@pytest.mark.parametrize("plan", ["comera", "dense", "dp"])
def test_a_bias_of_another_dtype_or_shape_is_refused_by_every_plan_at_every_rank(plan):
    """The plans read a bias differently (a padding slot of the comera path while the
    middle rank is not a multiple of 8, an addmm addend otherwise): an fp32 bias on fp64
    cores worked at rank 7 and crashed once a compaction left rank 8, and a (1,) bias
    broadcast under some plans. Each call now refuses both, naming the layer."""
    x = torch.randn(4, 15, dtype=torch.float64)
    for rank in (7, 8):
        spec = C.TTLinearSpec(out_modes=(3, 5), in_modes=(3, 5), ranks=(3, rank, 3), name="q",
                              dtype=torch.float64)  # fmt: skip
        p, s = C.init(spec, generator=torch.Generator().manual_seed(0))
        assert C.tt_linear(p, s, x, plan=plan).dtype == torch.float64
        with pytest.raises(ValueError, match=r"'q'.*params\['bias'\] has dtype torch.float32"):
            C.tt_linear({**p, "bias": p["bias"].float()}, s, x, plan=plan, spec=spec)
        with pytest.raises(ValueError, match=r"'q'.*bias'\] has shape \(1,\).*shape \(15,\)"):
            C.tt_linear({**p, "bias": p["bias"][:1]}, s, x, plan=plan, spec=spec)
        with pytest.raises(ValueError, match=r"layer 1: params\['bias'\] has shape \(1,\)"):
            tt_linear_shared_input([(p, s), ({**p, "bias": p["bias"][:1]}, s)], x)


def test_trains_that_do_not_chain_or_lack_gates_are_named():
    spec = C.TTLinearSpec(out_modes=(2, 3), in_modes=(3, 2), ranks=3, name="q")
    p, s = C.init(spec, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 6)
    with pytest.raises(ValueError, match=r"'q': 2 gates for 3 bonds"):
        C.tt_linear({**p, "gates": p["gates"][:2]}, {"masks": s["masks"][:2]}, x, spec=spec)
    cores = list(p["cores"])
    cores[2] = torch.randn(2, 3, cores[2].shape[2])  # left rank 2 after a bond of rank 3
    with pytest.raises(ValueError, match=r"'q': the cores' ranks do not chain"):
        C.tt_linear({**p, "cores": cores}, s, x, spec=spec)
    edge = [torch.randn(2, *p["cores"][0].shape[1:]), *p["cores"][1:]]
    with pytest.raises(ValueError, match="rank 1 outside"):
        C.tt_linear({**p, "cores": edge}, s, x, spec=spec)


def test_lookups_and_decoders_refuse_what_would_read_other_rows():
    table = _table()
    p, s = table.params_state()
    with pytest.raises(ValueError, match=r"ttm_logits: h has shape \(3, 5\).*6 entries"):
        ttm_logits(p, s, torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"ttm_logits: h has dtype torch.float64"):
        ttm_logits(p, s, torch.randn(3, 6, dtype=torch.float64))
    # a spec of more rows than the cores hold: id 20 of 25 wrapped to another row
    big = C.TTMEmbeddingSpec(vocab_modes=(5, 5), dim_modes=(2, 3), ranks=2, name="big")
    for impl in ("optimized", "naive", "static", "table"):
        with pytest.raises(ValueError, match=r"'big': the spec has 25 rows.*hold 20"):
            C.ttm_embedding(p, s, torch.tensor([19]), impl=impl, spec=big)
    with pytest.raises(ValueError, match="integer tensor"):
        C.ttm_embedding_batched([p], [s], torch.tensor([[7 + 3j]]))
    with pytest.raises(ConfigError, match="num_embeddings must be an int or None, got 12.7"):
        C.TTMEmbeddingSpec(vocab_modes=(3, 5), dim_modes=(2, 2), ranks=3, num_embeddings=12.7)


@pytest.mark.parametrize("rule", ["gate", "contribution"])
def test_a_threshold_that_is_not_a_finite_number_is_refused(rule):
    """NaN compares false: the gate rule killed every rank, the share rule none."""
    p, s = _layer()
    for tau in (float("nan"), float("inf"), "x", None):
        with pytest.raises(ConfigError, match=r"prune: tau=.*finite threshold"):
            C.prune(p, s, tau, rule=rule)
    assert C.live_ranks(C.prune(p, s, torch.tensor(1e-9), rule=rule)) == C.live_ranks(s)


def test_a_numpy_or_tensor_std_is_still_taken():
    """The finite-std check must not refuse the numbers init always took."""
    import numpy as np

    for std in (np.float32(0.02), torch.tensor(0.02), 1):
        C.init(C.TTLinearSpec(out_modes=(2,), in_modes=(3,), ranks=1, std=std))


@pytest.mark.parametrize(
    ("mask", "got"),
    [(torch.full((4,), 2.0), "torch.float32"), (torch.tensor(True), "of shape ()"),
     ([True] * 4, "list")],
)  # fmt: skip
def test_a_rank_mask_that_is_no_bool_vector_is_refused(mask, got):
    """A float mask of 2s scaled every bond by 2 (the output 8x too large), silently; a
    0-d mask or a list was an IndexError or AttributeError."""
    spec = C.TTLinearSpec(out_modes=(4, 4), in_modes=(4, 4), ranks=4)
    p, s = C.init(spec, generator=torch.Generator().manual_seed(0))
    s = {"masks": [mask if b == 1 else m for b, m in enumerate(s["masks"])]}
    with pytest.raises(ValueError, match=f"rank mask 1 must be a 1-D bool tensor.*{got}"):
        C.tt_linear(p, s, torch.randn(2, 16))


def test_accounting_refuses_a_module_for_a_params_tree():
    """A module passed to the accounting functions counted nothing: param_count 0, a
    summary table totalling 0 at infx, and a bare TypeError from compression_ratio."""
    layer = C.TTLinear(C.TTLinearSpec(out_modes=(4, 4), in_modes=(4, 4), ranks=4))
    from comera.accounting import param_bytes

    calls = [(lambda: C.param_count(layer), "param_count"),
             (lambda: param_bytes(layer), "param_bytes"),
             (lambda: C.summary_table(layer), "summarize"),
             (lambda: C.summarize(layer), "summarize"),
             (lambda: C.compression_ratio(layer, None), "compression_ratio")]  # fmt: skip
    for call, name in calls:
        with pytest.raises(TypeError, match=rf"{name}: got the module TTLinear; pass a params"):
            call()
    assert C.param_count(layer.params()) == sum(p.numel() for p in layer.parameters())
    assert "**total**" in C.summary_table({"q": layer.params()}, {"q": layer.state()})
    # inside a list or dict too (0 parameters), and summarize's own rows (a total of 0)
    with pytest.raises(TypeError, match=r"param_count: got the module TTLinear at \[0\]; pass"):
        C.param_count([layer])
    with pytest.raises(TypeError, match="param_count: got the module TTLinear at enc.q; pass"):
        C.param_count({"enc": {"q": layer}})
    rows = C.summarize({"q": layer.params()}, {"q": layer.state()})
    with pytest.raises(TypeError, match=r"summarize: got a LayerSummary at \[0\] .summarize's"):
        C.summary_table(rows)


def test_a_layer_built_from_another_spec_s_tensors_is_refused():
    """TTLinear(spec, params=...) took any train: a 64x64 one under a 64x48 spec computed
    64x64 (its first forward then blamed the input), and params without a bias under a
    spec with one dropped the bias silently."""
    spec = C.TTLinearSpec(out_modes=(4, 4, 4), in_modes=(4, 4, 3), ranks=4, name="lin")
    other = C.TTLinear(C.TTLinearSpec(out_modes=(4, 4, 4), in_modes=(4, 4, 4), ranks=4))
    with pytest.raises(ValueError, match=r"'lin': the cores' modes .* are not the spec's"):
        C.TTLinear(spec, params=other.params(), state=other.state())
    own = C.TTLinear(spec)
    no_bias = {k: v for k, v in own.params().items() if k != "bias"}
    with pytest.raises(ValueError, match="'lin': the spec has bias=True but the params lack one"):
        C.TTLinear(spec, params=no_bias, state=own.state())
    wide = {**own.params(), "bias": torch.zeros(48)}
    with pytest.raises(ValueError, match=r"'lin': the bias has shape \(48,\), not \(64,\)"):
        C.TTLinear(spec, params=wide, state=own.state())
    # a compacted train of the spec (lower ranks) is its train
    own.gates[1].data[::2] = 0
    own.prune(1e-6)
    own.compact()
    again = C.TTLinear(spec, params=own.params(), state=own.state())
    assert (again.in_features, again.out_features) == (48, 64)
    emb = C.TTMEmbedding(C.TTMEmbeddingSpec(vocab_modes=(15, 20), dim_modes=(4, 4), ranks=4,
                                            num_embeddings=300))  # fmt: skip
    assert (emb.num_embeddings, emb.embedding_dim) == (300, 16)


def test_params_and_specs_of_the_wrong_shape_are_refused_by_name():
    """A 2-D gate was read by its first dim and blamed on compaction; params with no gates
    were a bare KeyError; ids in a list an AttributeError; a linear spec passed to
    ``to_dense`` with a table's params an AttributeError, and the other way round was
    ignored."""
    p, s = _layer()
    x = torch.randn(2, 6)
    with pytest.raises(ValueError, match="'o': gate 0 must be a 1-D tensor .*got shape"):
        C.tt_linear({**p, "gates": [g[None] for g in p["gates"]]}, s, x, spec=_spec())
    with pytest.raises(ValueError, match="the params have no 'gates'"):
        C.tt_linear({"cores": p["cores"]}, s, x)
    table = _table()
    with pytest.raises(ValueError, match="ids must be an integer torch.Tensor, got list"):
        C.ttm_embedding(*table.params_state(), [1, 2])
    with pytest.raises(ValueError, match="ids must be an integer torch.Tensor, got list"):
        C.ttm_embedding_batched([table.params()], [table.state()], [[1]])
    with pytest.raises(ValueError, match="to_dense got a TTLinearSpec with a TTM's"):
        C.to_dense(*table.params_state(), _spec())
    with pytest.raises(ValueError, match="to_dense got a TTMEmbeddingSpec with a TT linear's"):
        C.to_dense(p, s, table.spec)
    assert C.to_dense(p, s, _spec()).shape == (6, 6)


def test_a_batched_lookup_refuses_tables_of_two_dtypes():
    """A float32 table batched with a float64 one came back float64, where one table's
    lookup refuses mixed dtypes."""
    spec = C.TTMEmbeddingSpec(vocab_modes=(3, 4), dim_modes=(2, 2), ranks=2)
    a, sa = C.init(spec)
    b, sb = C.init(spec)
    b = {k: [t.double() for t in v] for k, v in b.items()}
    with pytest.raises(ConfigError, match="core dtypes .*float32.*float64.*one dtype"):
        C.ttm_embedding_batched([a, b], [sa, sb], torch.tensor([[1, 2]]))


def test_one_layer_accounting_refuses_a_tree_or_a_row_map():
    """``compression_ratio`` of a model's tree was ``KeyError: 'cores'``, and with the
    ``{path: rows}`` map summarize takes, a TypeError from inside; both name the way on."""
    spec = C.TTMEmbeddingSpec(vocab_modes=(10, 10), dim_modes=(4, 4), ranks=8,
                              num_embeddings=95, name="emb")  # fmt: skip
    p, s = C.init(spec)
    from comera.accounting import live_param_count

    assert C.compression_ratio(p, s, num_embeddings=95) == 95 * 16 / live_param_count(p, s)
    with pytest.raises(
        TypeError,
        match=r"compression_ratio: takes one TT/TTM layer's params.*"
        r"keys \['emb'\]; for a model's tree use param_count or summarize",
    ):
        C.compression_ratio({"emb": p}, {"emb": s})
    with pytest.raises(
        TypeError,
        match=r"num_embeddings is this table's row count \(an int\), "
        r"got dict; a \{path: rows\} map goes to summarize",
    ):
        C.compression_ratio(p, s, num_embeddings={"emb": 95})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got float$"):
        C.compression_ratio(p, s, num_embeddings=95.0)  # type: ignore[arg-type]
    # numpy and torch integers are row counts too (the review: they were refused)
    for rows in (np.int64(95), torch.tensor(95)):
        assert C.compression_ratio(p, s, num_embeddings=rows) == 95 * 16 / live_param_count(p, s)
        (row,) = C.summarize({"emb": p}, {"emb": s}, num_embeddings={"emb": rows})
        assert row.dense_shape == (95, 16) and type(row.dense_shape[0]) is int
    for rows in (True, torch.tensor(True), np.bool_(True)):  # not a count of 1
        with pytest.raises(TypeError, match="row count"):
            C.compression_ratio(p, s, num_embeddings=rows)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_embeddings=-5 must be >= 0"):
        C.compression_ratio(p, s, num_embeddings=-5)


def test_to_dense_refuses_another_layer_s_spec():
    """A spec of other modes cut a 100-row table to 50 rows without a word."""
    p, s = C.init(C.TTMEmbeddingSpec(vocab_modes=(10, 10), dim_modes=(4, 4), ranks=8, name="t"))
    other = C.TTMEmbeddingSpec(vocab_modes=(5, 10), dim_modes=(2, 8), ranks=8, name="u")
    with pytest.raises(ValueError, match="'u'"):
        C.to_dense(p, s, other)
    assert C.to_dense(p, s).shape == (100, 16)
    # the bias, which to_dense never reads, is not checked: a layer whose bias was dropped
    layer = C.TTLinear(C.TTLinearSpec(out_modes=(4, 4), in_modes=(4, 4), ranks=2, name="l"))
    layer.bias = None
    assert layer.to_dense().shape == (16, 16)


def test_core_arguments_found_loose_by_a_tester_are_refused_by_name():
    """Each of these was taken and did something else, or failed deep inside torch or
    opt_einsum: 'optimal' over 10 cores searched for hours; float64 input under autocast
    worked on some plans and failed in a GEMM on others; a LayerPlans holding pairs could
    not be hashed and a string rule was split into a one-letter glob and strategy; bool
    pair steps; rows=12.0 and rows=True in ttm_logits; negative FLOP counts and an impl
    name with a typo; a batched lookup of no tables."""
    from comera.accounting import tt_linear_flops, ttm_embedding_flops

    modes = (2, 2, 2, 1, 1)
    spec = C.TTLinearSpec(out_modes=modes, in_modes=modes[::-1], ranks=3)
    p, s = C.init(spec, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match="plan='optimal' tries every contraction order"):
        C.tt_linear(p, s, torch.randn(5, 8), plan="optimal")
    with pytest.raises(ConfigError, match="plan='optimal'"):
        tt_linear_flops(p, 5, plan="optimal")
    small = C.TTLinearSpec(out_modes=(4, 4), in_modes=(4, 4), ranks=3)
    ps, ss = C.init(small, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 16)
    torch.testing.assert_close(C.tt_linear(ps, ss, x, plan="optimal"), C.tt_linear(ps, ss, x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for plan in ("dp", "comera", "dense"):
            with pytest.raises(ValueError, match="autocast does not cast float64"):
                C.tt_linear(ps, ss, x.double(), plan=plan)
        assert C.tt_linear(ps, ss, x, plan="comera").dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="a plan here is a strategy name"):
        C.LayerPlans(default=[(0, 1)])
    with pytest.raises(ConfigError, match="give \\(glob, strategy\\) pairs"):
        C.LayerPlans(per_layer=["dp"])
    with pytest.raises(ConfigError, match="a list of \\(i, j\\) pairs"):
        C.tt_linear(ps, ss, x, plan=[(False, True), (0, 1)])
    # iterables are read once: the checks above had emptied a generator before it was kept
    rules = C.LayerPlans(per_layer=((g, s) for g, s in {"ffn_*": "dense"}.items()))
    assert rules.for_layer("ffn_1") == "dense"
    torch.testing.assert_close(C.tt_linear(ps, ss, x, plan=iter([(0, 1)] * 4)),
                               C.tt_linear(ps, ss, x, plan=[(0, 1)] * 4))  # fmt: skip
    emb = C.TTMEmbeddingSpec(vocab_modes=(3, 4), dim_modes=(2, 2), ranks=2)
    pe, se = C.init(emb, generator=torch.Generator().manual_seed(0))
    h = torch.randn(2, 4)
    assert ttm_logits(pe, se, h, rows=np.int64(10)).shape == (2, 10)
    for rows in (12.0, True, 0, 13):
        with pytest.raises(ConfigError, match="pass an int from 1 to 12"):
            ttm_logits(pe, se, h, rows=rows)
    with pytest.raises(ValueError, match="tokens=-5 must be >= 0"):
        tt_linear_flops(ps, -5)
    with pytest.raises(ConfigError, match="impl='tabel'"):
        ttm_embedding_flops(pe, 16, impl="tabel")
    assert ttm_embedding_flops(pe, 16, impl="naive") > 0
    with pytest.raises(ValueError, match="no tables"):
        C.ttm_embedding_batched([], [], torch.zeros(5, 0, dtype=torch.long))
