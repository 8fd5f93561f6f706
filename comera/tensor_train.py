"""Tensor-train (TT) and tensor-train-matrix (TTM) weights as plain dict pytrees.

Layout shared by both formats::

    params = {"cores": [G_1, ..., G_K],      # TT (r_{k-1}, n_k, r_k); TTM (r_{k-1}, v_k, d_k, r_k)
              "gates": [d_1, ..., d_{K-1}],  # one trainable vector per internal bond, ones at init
              "bias": b}                     # TT linear only, optional
    state  = {"masks": [m_1, ..., m_{K-1}]}  # bool, True where a rank is alive

The effective weight is the train with ``diag(d_k * m_k)`` inserted on every internal
bond. Current ranks are always read from the core shapes, so nothing static needs to
change when :func:`comera.pruning.compact` removes dead ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

import torch
import torch.nn.functional as F

from comera.errors import ConfigError
from comera.spec import TTLinearSpec, TTMEmbeddingSpec

Params = dict[str, object]
State = dict[str, object]
Spec = TTLinearSpec | TTMEmbeddingSpec

__all__ = [
    "GATHER_ELEMENTS",
    "SHORT_RUN",
    "bond_ranks",
    "chain",
    "chain_from_right",
    "check_format",
    "check_params",
    "check_state",
    "from_dense",
    "gated_cores",
    "init",
    "is_batched",
    "is_tt_params",
    "under_func_transform",
    "pad_stack",
    "permuted",
    "stacked_gated_core",
    "to_dense",
    "ttm_table",
]


def _target_std(spec: Spec) -> float:
    """Std of the dense init the TT weight imitates.

    Linear: ``torch.nn.Linear``'s default (Kaiming-uniform with a=sqrt(5)) has variance
    ``1 / (3 * in_features)``. Embedding: ``torch.nn.Embedding``'s N(0, 1).
    """
    if spec.std is not None:
        return spec.std
    if isinstance(spec, TTLinearSpec):
        return 1.0 / math.sqrt(3.0 * spec.in_features)
    return 1.0


def _core_shapes(spec: Spec) -> list[tuple[int, ...]]:
    ranks = (1, *spec.ranks, 1)
    if isinstance(spec, TTLinearSpec):
        return [(ranks[k], n, ranks[k + 1]) for k, n in enumerate(spec.modes)]
    return [
        (ranks[k], v, d, ranks[k + 1])
        for k, (v, d) in enumerate(zip(spec.vocab_modes, spec.dim_modes, strict=True))
    ]


def init(
    spec: Spec,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[Params, State]:
    """Random cores whose reconstructed weight has the dense init's variance.

    Every entry of ``W`` is a sum of ``R = prod(internal ranks)`` products of ``K`` independent
    zero-mean core entries, so ``Var(W) = R * prod_k s_k^2``. We use the same Gaussian std
    ``s = (target_var / R) ** (1 / 2K)`` for every core. Gates start at one, all ranks alive.
    """
    shapes = _core_shapes(spec)
    var = _target_std(spec) ** 2
    r_prod = math.prod(spec.ranks)
    s = (var / r_prod) ** (1.0 / (2 * len(shapes)))
    cores = [
        torch.randn(sh, generator=generator, dtype=spec.dtype, device=device).mul_(s)
        for sh in shapes
    ]
    gates = [torch.ones(r, dtype=spec.dtype, device=device) for r in spec.ranks]
    params: Params = {"cores": cores, "gates": gates}
    if isinstance(spec, TTLinearSpec) and spec.bias:
        bound = 1.0 / math.sqrt(spec.in_features)  # nn.Linear's bias init
        b = torch.rand(spec.out_features, generator=generator, dtype=spec.dtype, device=device)
        params["bias"] = b.mul_(2 * bound).sub_(bound)
    state: State = {"masks": [torch.ones(r, dtype=torch.bool, device=device) for r in spec.ranks]}
    return params, state


def _leading_basis(mat: torch.Tensor, rank: int) -> torch.Tensor:
    """An orthonormal basis ``(m, r)`` of the leading ``rank`` left singular vectors of
    ``mat``, in descending order (exact, not randomized).

    TT-SVD needs only this basis: the rest of the train is its projection ``U^T mat``, so
    no singular value is divided by and a basis of the full space reconstructs exactly.
    TT-SVD's unfoldings are mostly very wide, where torch's CPU SVD is slow (GPT-2 small's
    tensorizing was nearly all SVD: a 960 x 10,800 unfolding took 3.3 s on 2 quiet
    threads, 0.35 s this way, and much longer on a busy machine): a wide or square one
    takes the eigenvectors of its Gram matrix, formed in float64 (the squaring then costs
    an fp32 weight none of its precision; a float64 one, whose small singular values it
    would blur, is reduced by a QR instead), and a tall one is reduced by a QR, so that
    only its small square factor goes through the SVD."""
    m, n = mat.shape
    if m <= n and mat.dtype != torch.float64:
        wide = mat.to(torch.float64)
        _, vecs = torch.linalg.eigh(wide @ wide.T)  # ascending eigenvalues
        r = min(rank, m)
        return vecs[:, m - r :].flip(1).to(mat.dtype)
    if m <= n:  # float64 kept whole: mat = R^T Q^T, and R^T's left vectors are mat's
        _, small = torch.linalg.qr(mat.T)  # (n, m), (m, m)
        return torch.linalg.svd(small.T).U[:, : min(rank, m)]
    q, small = torch.linalg.qr(mat)  # (m, n), (n, n)
    u = torch.linalg.svd(small).U
    return q @ u[:, : min(rank, n)]


def _tt_svd(tensor: torch.Tensor, max_ranks: Sequence[int]) -> list[torch.Tensor]:
    """Sequential truncated SVD of a K-way tensor into K TT cores (r_{k-1}, n_k, r_k)."""
    modes = tensor.shape
    cores = []
    rest = tensor.reshape(1, -1)
    r_prev = 1
    for k in range(len(modes) - 1):
        mat = rest.reshape(r_prev * modes[k], -1)
        u = _leading_basis(mat, max_ranks[k])
        r = u.shape[1]
        cores.append(u.reshape(r_prev, modes[k], r))
        rest = u.T @ mat
        r_prev = r
    cores.append(rest.reshape(r_prev, modes[-1], 1))
    return cores


def from_dense(
    weight: torch.Tensor, spec: Spec, bias: torch.Tensor | None = None
) -> tuple[Params, State]:
    """Compress a dense weight (``out x in``) or embedding table (``V x D``) by TT-SVD.

    ``spec.ranks`` are the maximum ranks; the result is exact when they are not binding.
    Use this to start CoMERA training from a pretrained dense model.
    """
    expected = spec.dense_shape
    for what, t in (("weight", weight), ("bias", bias)):
        if t is not None and not isinstance(t, torch.Tensor):  # numpy: no .detach
            raise ConfigError(f"{spec.label}: from_dense takes a torch.Tensor {what}, got "
                              f"{type(t).__name__}; convert it with torch.as_tensor")  # fmt: skip
    if bias is not None and not (isinstance(spec, TTLinearSpec) and spec.bias):
        raise ConfigError(
            f"{spec.label}: from_dense got a bias but the spec has none (bias=False), so the "
            "layer would compute without it; build the spec with bias=True"
        )
    if tuple(weight.shape) != expected:
        raise ConfigError(
            f"{spec.label}: from_dense expects a weight of shape {expected}, "
            f"got {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (spec.out_features,):  # type: ignore[union-attr]
        # a (1,) bias would broadcast under some plans and fail under others
        raise ConfigError(
            f"{spec.label}: from_dense expects a bias of shape ({spec.out_features},) "  # type: ignore[union-attr]
            f"(out_features), got {tuple(bias.shape)}"
        )
    if not weight.is_meta and not bool(torch.isfinite(weight).all()):
        raise ConfigError(  # the eigh inside the SVD failed to converge, naming no layer
            f"{spec.label}: from_dense got a weight holding NaN or inf, which TT-SVD cannot "
            "compress"
        )
    # the SVDs run in at least fp32: torch has no half-precision SVD, and the cores are
    # cast to the spec's dtype once they are found
    w = weight.detach().to(torch.promote_types(spec.dtype, torch.float32))
    if isinstance(spec, TTLinearSpec):
        cores = _tt_svd(w.reshape(spec.modes), spec.ranks)
    else:
        d = len(spec.vocab_modes)
        padded = torch.zeros(spec.padded_vocab, spec.embedding_dim, dtype=w.dtype, device=w.device)
        padded[: spec.num_embeddings] = w
        t = padded.reshape(*spec.vocab_modes, *spec.dim_modes)
        # interleave (v1, d1, v2, d2, ...) so each TT mode is one (v_k, d_k) pair
        t = t.permute(*[i for k in range(d) for i in (k, d + k)])
        merged = [v * dd for v, dd in zip(spec.vocab_modes, spec.dim_modes, strict=True)]
        cores = _tt_svd(t.reshape(merged), spec.ranks)
        cores = [
            c.reshape(c.shape[0], v, dd, c.shape[-1])
            for c, v, dd in zip(cores, spec.vocab_modes, spec.dim_modes, strict=True)
        ]
    cores = [c.to(spec.dtype).contiguous() for c in cores]
    ranks = [c.shape[-1] for c in cores[:-1]]
    params: Params = {
        "cores": cores,
        "gates": [torch.ones(r, dtype=spec.dtype, device=w.device) for r in ranks],
    }
    if isinstance(spec, TTLinearSpec) and spec.bias:
        params["bias"] = (
            bias.detach().to(spec.dtype).clone()
            if bias is not None
            else torch.zeros(spec.out_features, dtype=spec.dtype, device=w.device)
        )
    state: State = {"masks": [torch.ones(r, dtype=torch.bool, device=w.device) for r in ranks]}
    return params, state


def is_tt_params(node: object) -> bool:
    """True for a params dict of a TT/TTM layer (it has ``cores`` and ``gates`` lists)."""
    return isinstance(node, dict) and "cores" in node and "gates" in node


def bond_ranks(params: Params) -> list[int]:
    """Stored rank of every internal bond (dead ranks included until compaction)."""
    return [int(c.shape[-1]) for c in params["cores"][:-1]]  # type: ignore[index]


def check_state(params: Params, state: State, name: str = "TT layer") -> None:
    """Raise a clear error when ``state`` is not this layer's rank state (missing, or from
    before a compaction): one bool mask per bond, as long as that bond's gate; or when a
    gate does not fit its bond (trains padded together, :func:`pad_stack`, would pad it
    too and gate the wrong ranks silently)."""
    if not isinstance(state, dict) or "masks" not in state:
        raise ValueError(
            f"{name}: the rank state must be a dict with 'masks' (one bool vector per bond), "
            f"got {type(state).__name__}; pass the state returned with these params by "
            "comera.init / from_dense / compact"
        )
    for b, m in enumerate(state["masks"]):  # type: ignore[arg-type]
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or m.dim() != 1:
            got = f"{m.dtype} of shape {tuple(m.shape)}" if isinstance(m, torch.Tensor) else (
                type(m).__name__)  # fmt: skip
            raise ValueError(  # a float mask of 2s scaled the layer's output, silently
                f"{name}: rank mask {b} must be a 1-D bool tensor (True: a live rank), got "
                f"{got}; pass the state returned with these params by comera.init / "
                "from_dense / compact"
            )
    found = params.get("gates") if hasattr(params, "get") else None  # type: ignore[union-attr]
    if found is None:  # a bare KeyError named neither the layer nor what gates are
        raise ValueError(
            f"{name}: the params have no 'gates' (one vector per bond between cores); pass "
            "the params made by comera.init / from_dense / compact"
        )
    for b, g in enumerate(found):  # type: ignore[arg-type]
        if not isinstance(g, torch.Tensor) or g.dim() != 1:
            got = f"shape {tuple(g.shape)}" if isinstance(g, torch.Tensor) else type(g).__name__
            raise ValueError(  # a 2-D gate was read by its first dim and blamed on compaction
                f"{name}: gate {b} must be a 1-D tensor (one entry per rank of its bond), got {got}"
            )
    masks = [int(m.shape[0]) for m in state["masks"]]  # type: ignore[union-attr]
    gates = [int(g.shape[0]) for g in found]  # type: ignore[union-attr]
    if masks != gates:
        raise ValueError(
            f"{name}: the rank state does not match the params: masks of {masks} ranks for "
            f"gates of {gates} ranks. Was the state compacted together with the params? "
            "(comera.compact returns both)"
        )
    cores = params["cores"]
    ranks = [int(c.shape[-1]) for c in cores[:-1]]  # type: ignore[index]
    if len(gates) < len(ranks):
        raise ValueError(
            f"{name}: {len(gates)} gates for {len(ranks)} bonds; a train of {len(cores)} cores "  # type: ignore[arg-type]
            "has one gate (and one mask) per bond between cores"
        )
    lefts = [int(c.shape[0]) for c in cores]  # type: ignore[union-attr]
    if lefts[1:] != ranks or lefts[0] != 1 or int(cores[-1].shape[-1]) != 1:  # type: ignore[index]
        raise ValueError(
            f"{name}: the cores' ranks do not chain: cores of shapes "
            f"{[tuple(c.shape) for c in cores]} (each core's left rank must equal the one "  # type: ignore[union-attr]
            "before it's right rank, and the first and last cores have rank 1 outside)"
        )
    # a gate per bond; extra gates are not read by any path, as before
    for b, (g, r) in enumerate(zip(params["gates"], ranks, strict=False)):  # type: ignore[call-overload]
        if g.shape != (r,):
            raise ValueError(f"{name}: gate {b} has shape {tuple(g.shape)} for a bond of rank {r}")
        core = cores[b]  # type: ignore[index]
        if g.dtype != core.dtype and not _autocast_on(core.device):
            # a float64 gate promoted its core, and the GEMM then refused the input raw
            raise ValueError(  # (autocast casts each GEMM's operands: mixed dtypes work)
                f"{name}: gate {b} has dtype {g.dtype} but the cores have {core.dtype}; keep "
                "a layer's params in one dtype (cast them together)"
            )


def _autocast_on(device: torch.device) -> bool:
    """Whether autocast is on for ``device``'s type (never for one it has no mode for, such
    as meta: torch raises there)."""
    try:
        return torch.is_autocast_enabled(device.type)
    except RuntimeError:
        return False


def check_format(params: Params, ndim: int, name: str) -> None:
    """Refuse params whose cores are not all ``ndim``-D: a TT linear's are 3-D
    ``(r, mode, r')``, a TTM embedding's 4-D ``(r, v, d, r')``. One format's params passed
    to the other's function failed deep in a reshape, naming neither the layer nor why."""
    cores = params.get("cores") if hasattr(params, "get") else None
    # a list, a tuple, an nn.ParameterList: any sequence of tensors (a list or tuple, the
    # usual form, is taken as it is, with no ABC check: this runs on every layer call)
    found: Sequence | None = None
    if isinstance(cores, list | tuple):
        found = cores
    elif isinstance(cores, Iterable) and not isinstance(
        cores, torch.Tensor | str | bytes | Mapping
    ):
        found = list(cores)
    if found and all(isinstance(c, torch.Tensor) and c.dim() == ndim for c in found):
        return
    if found and all(isinstance(c, torch.Tensor) for c in found):
        got = f"cores of shapes {[tuple(c.shape) for c in found]}"
    elif found is not None and not found:
        got = "no core"
    else:
        got = f"{type(cores).__name__}, not a sequence of core tensors"
    want = "3-D cores (r, mode, r') of a TT linear" if ndim == 3 else (
        "4-D cores (r, v, d, r') of a TTM embedding")  # fmt: skip
    raise ValueError(
        f"{name}: params['cores'] must hold {want}, got {got}; pass the params made with "
        "this layer's spec (comera.init / from_dense)"
    )


def _check_modes(params: Params, state: State, spec: Spec) -> None:
    """:func:`check_state`, then the number of cores and each core's modes against
    ``spec``'s: what :func:`to_dense` checks (not the bias, which it never reads)."""
    name = spec.label
    check_state(params, state, name)
    want = [shape[1:-1] for shape in _core_shapes(spec)]
    got = [tuple(int(n) for n in c.shape[1:-1]) for c in params["cores"]]  # type: ignore[union-attr]
    if got != want:
        raise ValueError(
            f"{name}: the cores' modes {got} are not the spec's {want}; pass the params "
            "made for this spec (comera.init / from_dense with it), or build the spec they "
            "were made for"
        )


def check_params(params: Params, state: State, spec: Spec) -> None:
    """Refuse ``params``/``state`` that are not a train of ``spec`` (at any ranks: a
    compacted train fits its spec): :func:`check_state`, then the number of cores, each
    core's modes, and a bias exactly when ``spec.bias`` is set, of ``out_features``. A
    layer built from another spec's tensors computed at other sizes than its spec said,
    or dropped the bias the spec asked for, without a word."""
    name = spec.label
    _check_modes(params, state, spec)
    if isinstance(spec, TTLinearSpec):
        bias = params.get("bias")  # type: ignore[union-attr]
        if spec.bias != (bias is not None):
            raise ValueError(
                f"{name}: the spec has bias={spec.bias} but the params "
                f"{'have' if bias is not None else 'lack'} one; pass params with "
                f"{'a bias' if spec.bias else 'no bias'}, or a spec with bias={bias is not None}"
            )
        if bias is not None and tuple(bias.shape) != (spec.out_features,):  # type: ignore[union-attr]
            raise ValueError(
                f"{name}: the bias has shape {tuple(bias.shape)}, not ({spec.out_features},)"  # type: ignore[union-attr]
            )


def gated_cores(params: Params, state: State, name: str = "TT layer") -> list[torch.Tensor]:
    """Cores with ``diag(gate * mask)`` folded into the trailing bond of each core.

    Folding keeps every contraction strategy a plain network of cores: the gates are
    differentiated through this cheap elementwise product.
    """
    check_state(params, state, name)
    cores: list[torch.Tensor] = list(params["cores"])  # type: ignore[arg-type]
    out = []
    for k, core in enumerate(cores):
        if k < len(cores) - 1:
            # the bool mask promotes inside the product: no separate cast per bond
            gate = params["gates"][k] * state["masks"][k]  # type: ignore[index]
            core = core * gate
        out.append(core)
    return out


def pad_stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensors of one rank, each zero-padded at the end of every dim to the largest sizes
    and stacked: ``(L, *max sizes)``. Trains of other ranks stacked so stay exact: a padded
    rank carries zeros (and a zero gate) on its bond, so it adds nothing."""
    padded = [max(int(t.shape[d]) for t in tensors) for d in range(tensors[0].dim())]

    def pads(t: torch.Tensor) -> list[int]:  # F.pad's order: the last dim first
        sizes = zip(reversed(t.shape), reversed(padded), strict=True)
        return [x for have, want in sizes for x in (0, want - have)]

    return torch.stack([t if list(t.shape) == padded else F.pad(t, pads(t)) for t in tensors])


def is_batched(t: torch.Tensor) -> bool:
    """True inside ``vmap`` for a tensor that carries the vmapped dimension.

    Data-dependent checks, ``torch.unique`` and cached host-side indices cannot serve
    such tensors.
    """
    return bool(torch._C._functorch.is_batchedtensor(t))


def under_func_transform() -> bool:
    """True inside any ``torch.func`` transform (``vmap``, ``grad``, ``jvp``, ...), where an
    ``autograd.Function`` without ``setup_context`` cannot run and no timing is taken."""
    return torch._C._functorch.peek_interpreter_stack() is not None


# A permuted copy whose output keeps fewer contiguous input elements together than this
# runs as a gather on the CPU (:func:`permuted`), for tensors of at most GATHER_ELEMENTS
# elements (its cached index pair takes 8 bytes an element).
SHORT_RUN = 8
GATHER_ELEMENTS = 1 << 20


def permuted(x: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """``x.permute(dims)`` as a contiguous tensor.

    On the CPU, when the permuted view keeps fewer than :data:`SHORT_RUN` input elements
    contiguous at its end, the copy runs as one ``index_select`` with a cached flat
    index, forward and backward (the inverse index): the strided copy walks runs that
    short a few elements at a time. A stacked TTM pair merge at the DLRM smoke sizes,
    ``(14, 16, 15, 2, 13, 2, 1)`` to ``(14, 15, 13, 16, 2, 2, 1)``, copies in 0.63 ms
    strided and 0.06 ms gathered (2 threads). A non-contiguous ``x`` is made contiguous
    first. Elsewhere (other devices, more than :data:`GATHER_ELEMENTS` elements, under
    ``torch.compile`` or a ``torch.func`` transform: ``vmap``, ``grad``, ``jacrev``, ...)
    it is the plain copy."""
    view = x.permute(tuple(dims))  # torch checks the dims
    dims = tuple(int(d) % x.dim() for d in dims) if x.dim() else ()
    if (
        x.device.type != "cpu"
        or x.dim() < 2
        or x.numel() > GATHER_ELEMENTS
        or _run(tuple(x.shape), dims) >= SHORT_RUN
        or torch.compiler.is_compiling()
        or under_func_transform()
    ):
        return view.contiguous()
    fwd, inv = _perm_index(tuple(x.shape), dims)
    return _Gathered.apply(x, fwd, inv).view(view.shape)


def _run(shape: tuple[int, ...], dims: tuple[int, ...]) -> int:
    """How many elements the permuted view keeps contiguous at its end: the output's
    trailing modes that are also the input's, in order (size-1 modes skipped)."""
    run, k = 1, len(shape) - 1
    for d in reversed(dims):
        if shape[d] == 1:
            continue
        while k >= 0 and shape[k] == 1:
            k -= 1
        if d != k:
            break
        run *= shape[d]
        k -= 1
    return run


@lru_cache(maxsize=16)
def _perm_index(shape: tuple[int, ...], dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat gather indices of the permutation and of its inverse (int32: half the cache),
    on the CPU and as plain tensors whatever the caller's default device or inference
    mode (the cache outlives the call)."""
    n = math.prod(shape)
    with torch.inference_mode(False), torch.no_grad():
        fwd = torch.arange(n, dtype=torch.int32, device="cpu").reshape(shape)
        fwd = fwd.permute(dims).reshape(-1)
        inv = torch.empty_like(fwd)
        inv[fwd.long()] = torch.arange(n, dtype=torch.int32, device="cpu")
    return fwd, inv


class _Gathered(torch.autograd.Function):
    """``x.flatten()[fwd]``; its gradient is ``g[inv]`` (a permutation: no scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fwd: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(fwd, inv)
        ctx.shape = x.shape
        return x.reshape(-1).index_select(0, fwd)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        fwd, inv = ctx.saved_tensors
        return _Gathered.apply(g.reshape(-1), inv, fwd).view(ctx.shape), None, None


def stacked_gated_core(params: Sequence[Params], states: Sequence[State], k: int) -> torch.Tensor:
    """Core ``k`` of several trains, zero-padded to their largest sizes (:func:`pad_stack`)
    and stacked, with ``gate * mask`` folded into its trailing bond as
    :func:`gated_cores` does for one train: ``(L, *core sizes)``. One product gates every
    train, where each alone costs one. The last core has no trailing bond to gate."""
    stacked = pad_stack([p["cores"][k] for p in params])  # type: ignore[index]
    if k == len(params[0]["cores"]) - 1:  # type: ignore[arg-type]
        return stacked
    gates = pad_stack([p["gates"][k] for p in params])  # type: ignore[index]
    masks = pad_stack([s["masks"][k] for s in states])  # type: ignore[index]
    # the bool masks promote inside the product, as in gated_cores
    gate = gates * masks  # (L, r')
    return stacked * gate.reshape(gate.shape[0], *[1] * (stacked.dim() - 2), gate.shape[1])


def chain(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Contract a train of 3-way cores left to right: returns (r_0, prod(n), r_K)."""
    acc = cores[0]
    r0, n = acc.shape[0], acc.shape[1]
    for core in cores[1:]:
        r, nk, r2 = core.shape
        acc = acc.reshape(r0 * n, r) @ core.reshape(r, nk * r2)  # (r0 * n, nk * r2)
        n *= nk
        acc = acc.reshape(r0, n, r2)
    return acc


def chain_from_right(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`chain` contracted right to left: the same ``(r_0, prod(n), r_K)`` result.

    Cheaper when the right end's rank is the small one: a TT linear's input half ends in
    the edge rank 1, so each step is ``(r n) x r'`` by ``r' x (suffix)`` and the large
    middle rank ``r_0`` is met only once, in the last step."""
    acc = cores[-1]
    r_k, n_all = acc.shape[2], acc.shape[1]
    acc = acc.reshape(acc.shape[0], n_all * r_k)  # (r, n_K * r_K)
    for core in reversed(cores[:-1]):
        r, n, r2 = core.shape
        n_all *= n
        acc = (core.reshape(r * n, r2) @ acc).reshape(r, n_all * r_k)  # (r, n * suffix)
    return acc.reshape(acc.shape[0], n_all, r_k)


def ttm_table(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """The ``(prod v) x (prod d)`` table of TTM cores ``(r, v_k, d_k, r')`` (gated or not).

    Rows follow the vocabulary modes in row-major order, so the cores with the first one
    sliced to ``[:, a:b]`` give the table's rows ``a * V/v_1`` to ``b * V/v_1``: a table can
    be built (and used) in row blocks whose total cost is that of the whole."""
    d = len(cores)
    vs = [c.shape[1] for c in cores]
    ds = [c.shape[2] for c in cores]
    flat = [c.reshape(c.shape[0], c.shape[1] * c.shape[2], c.shape[3]) for c in cores]
    t = chain(flat).reshape([x for k in range(d) for x in (vs[k], ds[k])])
    # de-interleave (v1, d1, v2, d2, ...) -> (v1..vd, d1..dd)
    return t.permute(*range(0, 2 * d, 2), *range(1, 2 * d, 2)).reshape(math.prod(vs), math.prod(ds))


def to_dense(params: Params, state: State, spec: Spec | None = None) -> torch.Tensor:
    """Rebuild the dense weight (``out x in``) or table (``V x D``) the train represents.

    For a TTM the padded vocabulary rows are dropped when ``spec`` is given.
    """
    cores = gated_cores(params, state)
    if spec is not None and isinstance(spec, TTLinearSpec) != (cores[0].dim() == 3):
        kind = "a TT linear's (3-D cores)" if cores[0].dim() == 3 else "a TTM's (4-D cores)"
        raise ValueError(  # a linear spec for a table failed on a missing attribute
            f"{spec.label}: to_dense got a {type(spec).__name__} with {kind} params; pass "
            "the spec the params were made for"
        )
    if spec is not None:  # another table's spec cut rows off this one's without a word
        _check_modes(params, state, spec)
    if cores[0].dim() == 3:
        d = len(cores) // 2
        m = math.prod([c.shape[1] for c in cores[:d]])
        n = math.prod([c.shape[1] for c in cores[d:]])
        return chain(cores).reshape(m, n)
    t = ttm_table(cores)
    if spec is not None:
        t = t[: spec.num_embeddings]  # type: ignore[union-attr]
    return t
