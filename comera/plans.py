"""Contraction plans for ``y = x W^T`` with ``W`` held as a tensor train.

A plan is an einsum equation over the operands ``[x, G_1, ..., G_2d]`` plus a pairwise
contraction path, built once per (strategy, core shapes, token bucket) with
``opt_einsum.contract_expression`` and cached. Strategies are chosen by name per call,
per layer (``TTLinear.plan``) or globally (:func:`set_default_plan` /
:func:`default_plan`), which is what makes contraction-path ablations a one-word change:

- ``comera``: the paper's path. Contract the output-mode cores into ``A`` (M x r) and
  the input-mode cores into ``B`` (r x N), then ``y = (x B^T) A^T``: two skinny GEMMs.
  Autograd keeps ``x B^T``, ``A`` and ``B`` and reuses them in the backward pass.
- ``optimal`` / ``dp`` / ``greedy``: opt_einsum's optimizers over the whole network,
  ``x`` included, for the actual (bucketed) number of tokens.
- ``dense``: rebuild ``W`` from the cores, then one GEMM.
- an explicit list of ``(i, j)`` pairs in opt_einsum's path format over
  ``[x, G_1, ..., G_2d]`` (contracted operands are removed, the result is appended).

- ``auto``: the fastest of ``comera``, ``dense`` and ``dp`` at the call's
  shapes, timed once and cached (:mod:`comera.autotune`).

Every strategy computes the same function; only cost and memory differ. :class:`LayerPlans`
also records which TTM lookup implementation (:data:`EMBEDDING_IMPLS`) a model uses.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, TypeVar

import opt_einsum as oe
import torch
import torch.nn.functional as F

from comera.errors import ConfigError
from comera.tensor_train import (
    Params,
    State,
    chain,
    chain_from_right,
    check_state,
    gated_cores,
    stacked_gated_core,
)

__all__ = [
    "DIRECT_STRATEGIES",
    "EMBEDDING_IMPLS",
    "FIXED_STRATEGIES",
    "OPTIMAL_MAX_CORES",
    "RANK_ALIGN",
    "STRATEGIES",
    "ContractionPlan",
    "GroupedHalves",
    "LayerPlans",
    "PlanLike",
    "constant_under_compile",
    "contract_halves",
    "default_plan",
    "get_default_plan",
    "resolve_plan",
    "set_default_plan",
    "shared_input_comera",
    "token_bucket",
    "tt_linear_plan",
]

# the strategies with a fixed path, and ``auto``, which picks one of them per call
FIXED_STRATEGIES = ("comera", "optimal", "dp", "greedy", "dense")
# the most cores "optimal" plans (opt_einsum's exhaustive search: 8 cores take ~4 s once)
OPTIMAL_MAX_CORES = 8
# the strategies run as direct GEMMs (no opt_einsum path: traceable by torch.compile); the
# others contract through opt_einsum, whose path code Dynamo cannot trace
DIRECT_STRATEGIES = ("comera", "dense")
STRATEGIES = ("auto", *FIXED_STRATEGIES)
# TTM lookup implementations (see comera.layers.ttm_embedding), chosen per model by LayerPlans
EMBEDDING_IMPLS = ("auto", "optimized", "naive", "static", "table")
# the comera path zero-pads its middle rank to a multiple of this (aligned BLAS inner size)
RANK_ALIGN = 8
PlanLike = str | Sequence[Sequence[int]] | None
T = TypeVar("T")

Strategy = str | tuple[tuple[int, ...], ...]
# Process-wide default (set_default_plan), overridden in a context by default_plan(...).
_PROCESS_DEFAULT: list[Strategy] = ["comera"]
_SCOPED_PLAN: ContextVar[Strategy | None] = ContextVar("comera_default_plan", default=None)


def resolve_plan(plan: PlanLike, name: str, *, pairs: bool = True) -> Strategy:
    """Validate a plan argument (a known strategy name or a list of index pairs) and resolve
    ``None`` to the default in force (:func:`get_default_plan`); ``name`` labels errors.
    ``pairs=False``: where only names are taken (a config's ``LayerPlans``), the error
    offers names only."""
    if plan is None:
        return get_default_plan()
    if isinstance(plan, str):
        if plan not in STRATEGIES:
            tip = " or an explicit list of (i, j) contraction pairs" if pairs else ""
            raise ConfigError(
                f"{name}: unknown contraction strategy {plan!r}; expected one of "
                f"{', '.join(STRATEGIES)}{tip}"
            )
        return plan
    if not pairs:  # a LayerPlans holding a pair list could not be hashed (nor cached)
        raise ConfigError(
            f"{name}: a plan here is a strategy name ({', '.join(STRATEGIES)}), got {plan!r}; "
            "give explicit (i, j) pairs per call (plan=...) instead"
        )
    try:
        if isinstance(plan, bytes):
            raise TypeError
        raw = list(plan)  # an iterator is read once, here
        if any(isinstance(step, str | bytes) for step in raw):  # "ab" was read as a pair
            raise TypeError
        given = [list(step) for step in raw]
        if any(isinstance(i, bool) for step in given for i in step):  # True was read as 1
            raise TypeError
        steps = tuple(tuple(operator.index(i) for i in step) for step in given)
    except TypeError:
        raise ConfigError(
            f"{name}: a plan must be a strategy name or a list of (i, j) pairs, got {plan!r}"
        ) from None
    return steps


def set_default_plan(plan: PlanLike) -> None:
    """Set the process-wide default strategy (all threads) used when a call and its layer
    name none; ``None`` restores ``"comera"``."""
    _PROCESS_DEFAULT[0] = resolve_plan(plan if plan is not None else "comera", "set_default_plan")


def constant_under_compile(fn: Callable[..., T]) -> Callable[..., T]:
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` marks it (a compiled
    function reads its result once, at trace time: the default plan, an ``auto``
    decision) without calling that function
    here: it imports ``torch._dynamo``, 1.6 s at the start of every process that imports
    ``comera``. ``tests/comera/test_contractions.py`` checks the mark against torch's own and
    that a compiled call reads it as a constant."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@constant_under_compile
def get_default_plan() -> Strategy:
    """The strategy in force: the innermost ``default_plan`` scope, else the process default."""
    scoped = _SCOPED_PLAN.get()
    return scoped if scoped is not None else _PROCESS_DEFAULT[0]


@contextlib.contextmanager
def default_plan(plan: PlanLike) -> Iterator[None]:
    """Change the default strategy for this thread/context only (``with default_plan("dp"):``);
    ``None`` keeps the one in force at entry for the block (a ``set_default_plan`` inside
    it changes the process default for after the block)."""
    token = _SCOPED_PLAN.set(resolve_plan(plan, "default_plan"))
    try:
        yield
    finally:
        _SCOPED_PLAN.reset(token)


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerPlans:
    """Which contraction runs where: a model-wide strategy, per-layer overrides by glob over
    layer paths (``"layers.*.ffn_*"``; later rules win), and the TTM lookup implementation.

    A model passes ``plans.for_layer(path)`` as each layer's ``plan=``; experiments keep
    one in their config so the CLI (``--plan``, ``--plan-for``, ``--embedding-impl``) and
    ``config.json`` record what ran."""

    default: str | None = None  # None: the process default (``set_default_plan``)
    per_layer: tuple[tuple[str, str], ...] = ()
    embedding_impl: str = "optimized"

    def __post_init__(self) -> None:
        given = self.per_layer if isinstance(self.per_layer, str) else tuple(self.per_layer)
        if isinstance(given, str) or any(isinstance(r, str) for r in given):
            raise ConfigError(  # a string was split into a glob and a strategy of one letter
                f"LayerPlans.per_layer={self.per_layer!r}: give (glob, strategy) pairs, e.g. "
                "(('layers.*.ffn_*', 'dense'),)"
            )
        rules = tuple(tuple(r) for r in given)  # a generator is read once, here
        object.__setattr__(self, "per_layer", rules)
        if self.default is not None:
            resolve_plan(self.default, "LayerPlans.default", pairs=False)
        for rule in rules:
            if len(rule) != 2:
                raise ConfigError(f"LayerPlans.per_layer: {rule!r} is not a (glob, strategy) pair")
            resolve_plan(rule[1], f"LayerPlans.per_layer[{rule[0]!r}]", pairs=False)
        if self.embedding_impl not in EMBEDDING_IMPLS:
            raise ConfigError(
                f"LayerPlans.embedding_impl={self.embedding_impl!r}; choose one of "
                f"{', '.join(EMBEDDING_IMPLS)}"
            )

    def for_layer(self, path: str) -> str | None:
        """The strategy for the layer at ``path`` (None: the process default). A padded
        layer's train sits at ``NAME.inner`` (``PaddedTTLinear``): rules over
        ``NAME``, the module that was tensorized, match it too."""
        chosen = self.default
        for pattern, strategy in self.per_layer:
            if _matches(path, pattern):
                chosen = strategy
        return chosen

    def check_layers(self, paths: Sequence[str], embeddings: Sequence[str] = ()) -> None:
        """Refuse a per-layer rule that matches no TT linear of ``paths``: a typo would
        silently do nothing, and so would a rule for the TTM ``embeddings`` (a lookup takes
        ``embedding_impl``, never a contraction plan)."""
        for pattern, _ in self.per_layer:
            if any(_matches(p, pattern) for p in paths):
                continue
            hit = [e for e in embeddings if fnmatch.fnmatchcase(e, pattern)]
            if hit:
                raise ConfigError(
                    f"plan rule {pattern!r} (--plan-for, plans.per_layer) matches only TTM "
                    f"embeddings ({', '.join(hit)}), which take embedding_impl "
                    "(--embedding-impl), not a contraction plan"
                )
            names = dict.fromkeys(p.removesuffix(_PADDED) for p in paths)  # as tensorized
            layers = ", ".join(names) if paths else "none (this model has no TT linear layer)"
            raise ConfigError(
                f"plan rule {pattern!r} (--plan-for, plans.per_layer) matches no TT layer; "
                f"layers are: {layers}"
            )


_PADDED = ".inner"  # where comera.tensorize.PaddedTTLinear holds its train


def _matches(path: str, pattern: str) -> bool:
    """Whether a plan rule's glob names the TT linear at ``path``, or the padded layer
    that holds it there."""
    if fnmatch.fnmatchcase(path, pattern):
        return True
    return path.endswith(_PADDED) and fnmatch.fnmatchcase(path.removesuffix(_PADDED), pattern)


def token_bucket(tokens: int) -> int:
    """Round a token count up to a power of two so paths are reused across batch sizes."""
    return 1 if tokens <= 1 else 1 << (tokens - 1).bit_length()


# --------------------------------------------------------------------------- network


def _network(num_cores: int) -> str:
    """Einsum equation over ``[x, G_1..G_2d]`` with the edge ranks (size 1) squeezed."""
    d = num_cores // 2
    sym = iter(oe.get_symbol(i) for i in range(4 * d + 2))
    t = next(sym)
    outs = [next(sym) for _ in range(d)]
    ins = [next(sym) for _ in range(d)]
    bonds = [next(sym) for _ in range(num_cores - 1)]
    modes = outs + ins
    terms = []
    for k in range(num_cores):
        left = bonds[k - 1] if k > 0 else ""
        right = bonds[k] if k < num_cores - 1 else ""
        terms.append(left + modes[k] + right)
    x_term = t + "".join(ins)
    return ",".join([x_term, *terms]) + "->" + t + "".join(outs)


def _merges_to_path(
    num_operands: int, merges: Sequence[tuple[object, object]]
) -> list[tuple[int, int]]:
    """Turn merges of named operands into opt_einsum's positional path format."""
    live: list[object] = list(range(num_operands))
    path = []
    for a, b in merges:
        i, j = live.index(a), live.index(b)
        path.append((i, j))
        for idx in sorted((i, j), reverse=True):
            live.pop(idx)
        live.append((a, b))
    return path


def _named_path(strategy: str, num_cores: int) -> list[tuple[int, int]]:
    """Explicit paths for the strategies that are fixed by construction.

    Operand ``0`` is ``x``; operand ``k`` is core ``G_k``.
    """
    d = num_cores // 2
    merges: list[tuple[object, object]] = []
    a: object = 1  # output half, left to right
    for k in range(2, d + 1):
        merges.append((a, k))
        a = (a, k)
    b: object = num_cores  # input half, right to left
    for k in range(num_cores - 1, d, -1):
        merges.append((k, b))
        b = (k, b)
    if strategy == "comera":
        merges += [(0, b), ((0, b), a)]  # (x B^T) A^T
    else:  # dense: W = A B, then x W^T
        merges += [(a, b), (0, (a, b))]
    return _merges_to_path(num_cores + 1, merges)


@dataclass(frozen=True)
class ContractionPlan:
    """A cached contraction of ``x (T x N)`` with a TT of ``2d`` cores into ``y (T x M)``.

    ``flops`` and ``largest_intermediate`` (elements) are opt_einsum's estimates for the
    forward pass at ``tokens`` (the bucket the plan was built for).
    """

    strategy: str
    equation: str
    path: tuple[tuple[int, ...], ...]
    tokens: int
    flops: int
    largest_intermediate: int
    core_shapes: tuple[tuple[int, ...], ...]
    _expr: Any = field(repr=False, compare=False)

    def __call__(
        self, x2d: torch.Tensor, cores: Sequence[torch.Tensor], bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x2d (T, N)`` -> ``(T, M)``, adding ``bias`` if given."""
        if self.strategy in DIRECT_STRATEGIES:
            return contract_halves(self.strategy, x2d, cores, bias)
        dev = x2d.device.type
        if torch.is_autocast_enabled(dev):
            # the path mixes einsum steps, which autocast runs in its dtype, with tensordot
            # steps, which it leaves alone and which refuse mixed dtypes: cast up front
            dt = torch.get_autocast_dtype(dev)
            x2d, cores = x2d.to(dt), [c.to(dt) for c in cores]
            bias = None if bias is None else bias.to(dt)
        d = len(cores) // 2
        n_modes = [c.shape[1] for c in cores[d:]]
        m = math.prod(c.shape[1] for c in cores[:d])
        x = x2d.reshape(x2d.shape[0], *n_modes)
        ops = [cores[0][0], *cores[1:-1], cores[-1][..., 0]]
        y = self._expr(x, *ops, backend="torch").reshape(x2d.shape[0], m)
        # a path may end in a transposed product (one mode a side, dp and optimal):
        # contiguous, as nn.Linear's output is, so a caller's .view() works under any plan
        y = y.contiguous()  # (y + bias keeps a transposed y's strides)
        return y if bias is None else y + bias

    def cost(self, tokens: int) -> tuple[int, int]:
        """(forward FLOPs, largest intermediate) of this path at ``tokens`` tokens, as
        executed: the ``comera`` path's zero rank padding included."""
        return _path_cost(self.strategy, self.equation, self.path, self.core_shapes, tokens)

    def weight_elements(self) -> int:
        """Elements of the tensors the path builds from the cores alone, before ``x``
        joins (``comera``'s halves and their partial chains; ``dense``'s the same and
        ``W``): weight-sized tensors a training step keeps for backward whatever its token
        count."""
        inputs, output = self.equation.split("->")
        terms = inputs.split(",")
        sizes: dict[str, int] = {}
        for term, shape in zip(terms, _operand_shapes(self.core_shapes, self.tokens),
                               strict=True):  # fmt: skip
            sizes.update(zip(term, shape, strict=True))
        live = [(t, i == 0) for i, t in enumerate(terms)]  # (indices, holds x)
        total = 0
        for step in self.path:
            taken = [live[i] for i in step]
            for i in sorted(step, reverse=True):
                live.pop(i)
            keep = set(output).union(*(t for t, _ in live))
            idx = "".join(sorted({c for t, _ in taken for c in t} & keep))
            has_x = any(x for _, x in taken)
            if not has_x:
                total += math.prod(sizes[c] for c in idx)
            live.append((idx, has_x))
        return total

    def describe(self) -> str:
        d = len(self.core_shapes) // 2
        r = self.core_shapes[d][0]
        pad = (-r) % RANK_ALIGN if self.strategy == "comera" else 0
        padded = f" (middle rank {r} run as {r + pad})" if pad else ""
        return (
            f"{self.strategy}: {self.equation} path={list(self.path)}{padded} "
            f"flops={self.flops:.3e} largest={self.largest_intermediate}"
        )


def _path_cost(
    strategy: str,
    equation: str,
    path: Sequence[tuple[int, ...]],
    core_shapes: Sequence[tuple[int, ...]],
    tokens: int,
) -> tuple[int, int]:
    """opt_einsum's (FLOPs, largest intermediate) of ``path``, plus for ``comera`` the two
    token GEMMs' extra width from the rank padding (``2 * T * pad * (N + M)``)."""
    shapes = _operand_shapes(core_shapes, tokens)
    info = oe.contract_path(equation, *shapes, shapes=True, optimize=list(path))[1]
    flops = int(info.opt_cost)
    if strategy == "comera":
        d = len(core_shapes) // 2
        pad = (-core_shapes[d][0]) % RANK_ALIGN
        n = math.prod(s[1] for s in core_shapes[d:])
        m = math.prod(s[1] for s in core_shapes[:d])
        flops += 2 * tokens * pad * (n + m)
    return flops, int(info.largest_intermediate)


def _halves(cores: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``A`` (M x r): the output-mode cores contracted; ``B`` (r x N): the input-mode ones."""
    d = len(cores) // 2
    a = chain(cores[:d])  # (1, M, r), left to right as the recorded path
    b = chain_from_right(cores[d:])  # (r, N, 1), right to left as the recorded path
    return a.reshape(a.shape[1], a.shape[2]), b.reshape(b.shape[0], b.shape[1])


def _stacked_halves(cores: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_halves` of ``L`` stacked trains (cores ``(L, r, n, r')``), each step one
    batched GEMM: ``A`` ``(L, M, r)`` and ``B`` ``(L, r, N)``."""
    d = len(cores) // 2
    a = cores[0]  # (L, 1, n, r): left to right, as chain
    n = a.shape[2]
    for core in cores[1:d]:
        big, r, nk, r2 = core.shape
        a = torch.bmm(a.reshape(big, n, r), core.reshape(big, r, nk * r2))
        n *= nk
    a = a.reshape(a.shape[0], n, -1)
    b = cores[-1]  # (L, r, n, 1): right to left, as chain_from_right
    n = b.shape[2]
    for core in reversed(cores[d:-1]):
        big, r, nk, r2 = core.shape
        b = torch.bmm(core.reshape(big, r * nk, r2), b.reshape(big, r2, n))
        n *= nk
    return a, b.reshape(b.shape[0], -1, n)


class GroupedHalves:
    """The gated halves ``A`` (M x r) and ``B`` (r x N) of many TT linears, built together
    once per forward pass: trains of the same modes (a transformer's Q, K, V and O of
    every block, compacted to other ranks or not) are stacked, zero-padded to their
    largest ranks, gated with one product per bond and contracted with one batched GEMM
    per core, where each layer alone costs a product per bond and a GEMM per core; each
    layer reads its halves at its own middle rank. At small widths those per-layer ops,
    not the arithmetic, are the TT layers' cost (``benchmarks.plans``' ``fixed extra``).
    The ``comera`` and ``dense`` paths read a layer's halves from here
    (:func:`comera.tt_linear`'s ``halves``); the values and gradients are those of the
    per-layer build, up to summation order.

    Build it where every layer's params are at hand (the model's forward), from the
    ``(params, state)`` of the layers it should serve; a train alone in its modes is built
    as one layer is. The halves are built here, eagerly, so a layer checkpointed for
    recomputation reads them rather than building them inside its region; they are the
    params and rank state given here (a layer's call reads them, not its own ``state``),
    so build a new one for every forward pass."""

    def __init__(self, layers: Sequence[tuple[Params, State]]) -> None:
        groups: dict[tuple, list[tuple[str, Params, State]]] = {}
        for k, (params, state) in enumerate(layers):
            cores: list[torch.Tensor] = params["cores"]  # type: ignore[assignment]
            if any(c.dim() != 3 for c in cores):
                raise ValueError(
                    f"GroupedHalves layer {k}: cores of shapes {[tuple(c.shape) for c in cores]} "
                    "are not a TT linear's (3-way cores); TTM embeddings are not grouped"
                )
            # one structure (the modes), whatever the ranks: compacted layers' trains are
            # zero-padded to the group's largest ranks (exact, :func:`stacked_gated_core`)
            key = (tuple(int(c.shape[1]) for c in cores), cores[0].dtype, cores[0].device)
            groups.setdefault(key, []).append((f"GroupedHalves layer {k}", params, state))
        self._halves: dict[int, tuple[Params, torch.Tensor, torch.Tensor]] = {}
        for group in groups.values():
            if len(group) == 1:
                name, params, state = group[0]
                a, b = _halves(gated_cores(params, state, name))  # checks the state too
                self._halves[id(params)] = (params, a, b)
                continue
            for name, params, state in group:
                check_state(params, state, name)  # gates that fit their bonds, padded
            trains, states = [p for _, p, _ in group], [s for _, _, s in group]
            k = len(trains[0]["cores"])  # type: ignore[arg-type]
            a_all, b_all = _stacked_halves([stacked_gated_core(trains, states, i)
                                            for i in range(k)])  # fmt: skip
            # one unbind each, not a select per layer: its backward stacks the layers'
            # gradients in one op, where each select's zero-fills a whole (L, M, R) buffer
            for params, a, b in zip(trains, a_all.unbind(0), b_all.unbind(0), strict=True):
                r = int(params["cores"][k // 2].shape[0])  # type: ignore[index]  # its middle rank
                if r < a.shape[1]:  # padded to a larger rank of the group
                    a, b = a[:, :r], b[:r]
                self._halves[id(params)] = (params, a, b)

    def get(self, params: Params) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(A, B)`` of the layer with these ``params``, or None if it was not given."""
        found = self._halves.get(id(params))
        return None if found is None or found[0] is not params else (found[1], found[2])


def contract_halves(
    strategy: str,
    x2d: torch.Tensor,
    cores: Sequence[torch.Tensor] | tuple[torch.Tensor, torch.Tensor],
    bias: torch.Tensor | None,
    *,
    built: bool = False,
) -> torch.Tensor:
    """The ``comera`` and ``dense`` paths as direct GEMMs (the same path the plan records).
    ``built=True``: ``cores`` is the pair of halves ``(A, B)`` already contracted
    (:class:`GroupedHalves`).

    For ``comera`` the middle rank is zero-padded to a multiple of :data:`RANK_ALIGN` (8): the
    extra terms are exact zeros, so the result is the same up to summation order, and BLAS
    runs skinny GEMMs with an aligned inner size markedly faster (r=32 beats r=30 on MKL).
    The bias rides in the first padding slot (``h[:, r] = 1``, ``A[:, r] = b``), so it
    costs neither a pass over the ``(T, M)`` output nor a separate gradient reduction.
    """
    if strategy == "dense":
        a, b = cores if built else _halves(cores)  # (M, r), (r, N)
        w = a @ b  # (M, N)
        return x2d @ w.T if bias is None else torch.addmm(bias, x2d, w.T)
    return shared_input_comera(x2d, [cores], [bias], built=built)[0]


def shared_input_comera(
    x2d: torch.Tensor,
    trains: Sequence[Sequence[torch.Tensor]],
    biases: Sequence[torch.Tensor | None],
    *,
    built: bool = False,
) -> list[torch.Tensor]:
    """The ``comera`` path for several TT layers that read the same ``x2d (T, N)`` (Q, K
    and V): their input halves ``B_i`` are stacked so ``x`` meets them in one wider GEMM
    ``x [B_1; B_2; ...]^T`` (and backward's ``dx`` is one GEMM too), then each output half
    ``A_i`` is applied to its slice. Each ``B_i``'s rank is zero-padded to a multiple of 8
    with its bias in the first padding slot, exactly as for one layer. ``built=True``:
    each train is its pair of halves ``(A, B)`` already contracted."""
    sides, blocks, slots, width = [], [], [], 0
    for cores, bias in zip(trains, biases, strict=True):
        a, b = cores if built else _halves(cores)  # (M, r), (r, N)
        m, r = a.shape
        pad = (-r) % RANK_ALIGN
        if pad:
            b = F.pad(b, (0, 0, 0, pad))  # (r + pad, N), zero rows
            if bias is None:
                a = F.pad(a, (0, pad))  # (M, r + pad)
            else:
                a = torch.cat([a, bias[:, None].to(a.dtype), a.new_zeros(m, pad - 1)], dim=1)
                slots.append(width + r)  # h_all's column that must read 1
        sides.append((a, bias if bias is not None and not pad else None))
        blocks.append(b)
        width += r + pad
    # the stacked halves as a contiguous (N, sum r) (a small copy): autograd then forms this
    # GEMM's weight gradient as x^T dh rather than (dh^T x)^T, which MKL runs markedly
    # slower for skinny ranks (2.1-2.5 ms against 1.4 ms at 4096 x 768 x 32, 2 threads)
    bt = (torch.cat(blocks) if len(blocks) > 1 else blocks[0]).T.contiguous()
    if slots:
        # the bias slots' ones enter as the GEMM's own addend (beta = 1), not as a pass
        # over h per layer; each slot is a fill of a one-element view: ``ones[c] = 1`` would
        # copy a host scalar to the device, which CUDA graph capture refuses
        ones = bt.new_zeros(width)
        for c in slots:
            ones.narrow(0, c, 1).fill_(1)
        h_all = torch.addmm(ones, x2d, bt)  # (T, sum r + pad)
    else:
        h_all = x2d @ bt
    # one split, not a slice per layer: backward joins the slices' gradients in one cat
    # instead of a zero-filled (T, sum r + pad) per layer summed together
    hs = torch.split(h_all, [a.shape[1] for a, _ in sides], dim=1) if len(sides) > 1 else [h_all]
    out = []
    for h, (a, bias) in zip(hs, sides, strict=True):  # h: (T, r + pad): padding 0, a bias slot 1
        # a bias with no free slot (r a multiple of 8, or an empty train) is added here
        out.append(h @ a.T if bias is None else torch.addmm(bias, h, a.T))  # (T, M)
    return out


def _operand_shapes(core_shapes: Sequence[tuple[int, ...]], tokens: int) -> list[tuple[int, ...]]:
    d = len(core_shapes) // 2
    x_shape = (tokens, *[s[1] for s in core_shapes[d:]])
    shapes = [tuple(s) for s in core_shapes]
    shapes[0] = shapes[0][1:]
    shapes[-1] = shapes[-1][:-1]
    return [x_shape, *shapes]


@lru_cache(maxsize=1024)
def _build(
    strategy: str | tuple[tuple[int, ...], ...],
    core_shapes: tuple[tuple[int, ...], ...],
    bucket: int,
) -> ContractionPlan:
    num_cores = len(core_shapes)
    eq = _network(num_cores)
    shapes = _operand_shapes(core_shapes, bucket)
    if isinstance(strategy, tuple):
        label = "explicit"
        optimize: Any = [tuple(p) for p in strategy]
    elif strategy in DIRECT_STRATEGIES:
        label = strategy
        optimize = _named_path(strategy, num_cores)
    else:
        label = strategy
        optimize = strategy
    if strategy == "optimal" and num_cores > OPTIMAL_MAX_CORES:
        raise ConfigError(  # its search grows factorially: 3.75 s at 8 cores, hours at 10
            f"plan='optimal' tries every contraction order, which takes minutes to hours for "
            f"{num_cores} cores (it is taken up to {OPTIMAL_MAX_CORES}); use 'dp' (dynamic "
            "programming over the same cost: milliseconds) or 'greedy'"
        )
    _, info = oe.contract_path(eq, *shapes, shapes=True, optimize=optimize)
    path = tuple(tuple(p) for p in info.path)
    expr = oe.contract_expression(eq, *shapes, optimize=list(path))
    flops, largest = _path_cost(label, eq, path, core_shapes, bucket)
    return ContractionPlan(
        strategy=label,
        equation=eq,
        path=path,
        tokens=bucket,
        flops=flops,
        largest_intermediate=largest,
        core_shapes=core_shapes,
        _expr=expr,
    )


def _check_pairs(path: Sequence[tuple[int, ...]], num_operands: int, name: str) -> None:
    n = num_operands
    for step, pair in enumerate(path):
        if len(pair) < 1 or len(set(pair)) != len(pair) or any(not 0 <= i < n for i in pair):
            raise ConfigError(
                f"{name}: explicit contraction path step {step} is {pair}, but only operands "
                f"0..{n - 1} exist at that point (operand 0 is x, k is core G_k; each "
                "contraction removes its operands and appends the result)"
            )
        n -= len(pair) - 1
    if n != 1:
        raise ConfigError(
            f"{name}: explicit contraction path {list(path)} leaves {n} operands; it must "
            f"contract all {num_operands} operands (x and every core) into one"
        )


def tt_linear_plan(
    plan: PlanLike,
    core_shapes: Sequence[Sequence[int]],
    tokens: int,
    name: str = "tt_linear",
) -> ContractionPlan:
    """The cached plan for a TT-linear call with these core shapes and token count."""
    strategy = resolve_plan(plan, name)
    if strategy == "auto":
        raise ConfigError(
            f"{name}: 'auto' is decided per call by timing (comera.autotune); a plan for "
            "given shapes needs a fixed strategy: " + ", ".join(FIXED_STRATEGIES)
        )
    shapes = tuple(tuple(int(s) for s in sh) for sh in core_shapes)
    if isinstance(strategy, tuple):
        _check_pairs(strategy, len(shapes) + 1, name)
    return _build(strategy, shapes, token_bucket(tokens))
