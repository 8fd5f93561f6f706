"""DLRM as pure functions over a params pytree, dense or tensor-compressed.

The Criteo Kaggle configuration of facebookresearch/dlrm: 13 dense features through the
bottom MLP 13-512-256-64-16 (ReLU after every layer); 26 categorical features through
embedding tables of dim 16; pairwise dot products of the 27 vectors (bottom output and
26 embeddings, self-products excluded: 351), concatenated with the bottom output (367);
top MLP 367-512-256-1 (ReLU, then a logit). Tree::

    {"bottom": [layer, ...], "top": [layer, ...], "tables": {"C1": table, ...},
     "hot": {"C3": {"weight"}, ...}}

A dense layer is ``{"weight", "bias"}``, a dense table ``{"weight"}``; in the CoMERA
model every table with at least ``tt_min_rows`` rows is a TTM (``cores``, ``gates``) and
the layers named in ``tt_layers`` are TT linears, all with rank gates. ``hot`` holds the
dense hot rows of the TTM tables (``hot_rows``; absent without them), beside the TTMs so
that the TT accounting and compaction see plain TTM layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import comera as C
from comera.errors import ConfigError

__all__ = [
    "BATCHED_LOOKUP_IMPLS",
    "DLRMConfig",
    "check_lookup_impl",
    "dlrm_logits",
    "embed",
    "init_dlrm",
    "table_specs",
]

# the ``plans.embedding_impl`` values the table-batched lookup runs as asked: it is one
# implementation, ``optimized``'s dedup and pair merges over all tables at once, and
# ``auto`` (``benchmarks.plans``' variant) leaves the choice to the framework
BATCHED_LOOKUP_IMPLS = ("optimized", "auto")

KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip


@dataclass(kw_only=True, slots=True)
class DLRMConfig:
    """Architecture and compression. ``cardinalities`` come from the data (rows per table).

    ``tt``: False is the dense baseline. ``tt_min_rows``: smaller tables stay dense.
    ``emb_dim_modes`` factor the embedding dim (4 cores: 2x2x2x2 for 16); vocab modes are
    proposed per table (padded). ``tt_layers``: MLP layers held as TT (``bottom.1`` is
    512->256, ``top.1`` 512->256; 367 is prime, so ``top.0`` stays dense).
    ``batched_lookup``: all TTM tables in one table-batched lookup, else one call each.
    ``hot_rows``: the ids below it in each TTM table (the most frequent ones: the data
    numbers ids by descending frequency) also get a dense row, added to the TTM's and zero
    at init: TT-Rec's cache of hot rows, made static by that numbering. The rows count in
    the model's size; a table of no more than ``hot_rows`` rows gets a dense copy of all
    of them beside its TTM. 0 (the paper's model): none.
    ``hash_rows``: the dense baseline's large tables (``tt_min_rows`` rows and up, the
    ones CoMERA compresses) hold only this many rows, id ``i`` reading row ``i % K``: the
    hashing trick at a chosen size, the uncompressed model's way to shrink. With ids
    numbered by frequency (``data.id_order=frequency``, the default) the K most frequent
    values land in distinct rows, each shared with rarer values. Dense model only (``tt``
    False); 0: none."""

    cardinalities: tuple[int, ...] = KAGGLE_CARDINALITIES
    dense_features: int = 13
    emb_dim: int = 16
    bottom: tuple[int, ...] = (512, 256, 64)
    top: tuple[int, ...] = (512, 256)
    tt: bool = True
    tt_min_rows: int = 10_000
    emb_dim_modes: tuple[int, ...] = (2, 2, 2, 2)
    emb_rank: int = 32
    tt_layers: tuple[str, ...] = ("bottom.1", "top.1")
    tt_layer_cores: int = 3
    tt_layer_rank: int = 16
    batched_lookup: bool = True
    hot_rows: int = 0
    hash_rows: int = 0
    names: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("bottom", "top"):  # 0 divided by zero in init, -1 a negative dim
            if any(width < 1 for width in getattr(self, name)):  # () is one linear layer
                raise ConfigError(f"model.{name}={getattr(self, name)}: every layer width "
                                  "must be >= 1")  # fmt: skip
        if self.emb_dim < 1:
            raise ConfigError(f"model.emb_dim={self.emb_dim} must be >= 1")
        if len(self.cardinalities) < 1 or min(self.cardinalities) < 1:
            raise ConfigError(f"DLRMConfig.cardinalities must be >= 1, got {self.cardinalities}")
        if math.prod(self.emb_dim_modes) != self.emb_dim:
            raise ConfigError(
                f"DLRMConfig.emb_dim_modes {self.emb_dim_modes} multiply to "
                f"{math.prod(self.emb_dim_modes)}, not emb_dim={self.emb_dim}"
            )
        if self.tt_min_rows < 1 or self.emb_rank < 1 or self.tt_layer_rank < 1:
            raise ConfigError("DLRMConfig: tt_min_rows, emb_rank and tt_layer_rank must be >= 1")
        if self.hot_rows < 0 or self.hash_rows < 0:
            raise ConfigError(
                f"DLRMConfig: hot_rows and hash_rows must be >= 0, got {self.hot_rows}, "
                f"{self.hash_rows}"
            )
        if not self.names:
            self.names = tuple(f"C{i + 1}" for i in range(len(self.cardinalities)))
        if len(self.names) != len(self.cardinalities):  # was a bare zip() error at init
            raise ConfigError(
                f"DLRMConfig: {len(self.names)} names for {len(self.cardinalities)} "
                "cardinalities; give one name per table (or none)"
            )
        layers = self.layer_names()
        unknown = [n for n in self.tt_layers if n not in layers]
        if unknown:
            raise ConfigError(
                f"DLRMConfig.tt_layers names {unknown}, not layers of this model; "
                f"choose from {layers}"
            )

    def mlp_sizes(self) -> tuple[list[int], list[int]]:
        n = len(self.cardinalities) + 1
        bottom = [self.dense_features, *self.bottom, self.emb_dim]
        top = [self.emb_dim + n * (n - 1) // 2, *self.top, 1]
        return bottom, top

    def layer_names(self) -> list[str]:
        bottom, top = self.mlp_sizes()
        return [f"bottom.{i}" for i in range(len(bottom) - 1)] + [
            f"top.{i}" for i in range(len(top) - 1)
        ]

    def is_ttm(self, i: int) -> bool:
        return self.tt and self.cardinalities[i] >= self.tt_min_rows

    def table_rows(self, i: int) -> int:
        """Rows table ``i`` holds: its cardinality, or ``hash_rows`` where it is hashed."""
        n = self.cardinalities[i]
        if self.hash_rows and not self.tt and n >= self.tt_min_rows:
            return min(n, self.hash_rows)
        return n

    def is_hashed(self, i: int) -> bool:
        """Whether table ``i`` holds fewer rows than it has ids (``hash_rows``)."""
        return self.table_rows(i) < self.cardinalities[i]


def vocab_modes(n: int, d: int) -> tuple[int, ...]:
    """``d`` vocab modes for ``n`` rows: ``L`` repeated, ``L = ceil(n^(1/d))``, and a last
    mode just large enough (padding below ``L^(d-1)`` rows). Instant for 10M-row tables,
    where a search over padded sizes (``comera.spec.propose_modes``) takes about a minute."""
    big = max(2, math.ceil(n ** (1 / d) - 1e-9))
    while big**d < n:  # float rounding
        big += 1
    last = max(2, -(-n // big ** (d - 1)))
    return (big,) * (d - 1) + (last,)


def table_specs(cfg: DLRMConfig) -> dict[str, C.TTMEmbeddingSpec]:
    """TTM specs of the compressed tables, by name. Init std matches the reference's
    ``uniform(-1/sqrt(n), 1/sqrt(n))`` rows: ``1/sqrt(3n)``."""
    out = {}
    for i, (name, n) in enumerate(zip(cfg.names, cfg.cardinalities, strict=True)):
        if cfg.is_ttm(i):
            d = len(cfg.emb_dim_modes)
            out[name] = C.TTMEmbeddingSpec(
                vocab_modes=vocab_modes(n, d),
                dim_modes=cfg.emb_dim_modes,
                ranks=cfg.emb_rank,
                num_embeddings=n,
                name=f"tables.{name}",
                std=1 / math.sqrt(3 * n),
            )
    return out


def check_lookup_impl(cfg: DLRMConfig, impl: str) -> None:
    """Refuse a TTM lookup ``impl`` the model's lookups cannot run: the table-batched one
    (``batched_lookup``) has no other implementation than ``BATCHED_LOOKUP_IMPLS``."""
    if cfg.tt and cfg.batched_lookup and impl not in BATCHED_LOOKUP_IMPLS:
        raise ConfigError(
            f"--embedding-impl {impl} (plans.embedding_impl) cannot apply to the "
            "table-batched TTM lookup (model.batched_lookup=true), which runs only "
            f"{' or '.join(BATCHED_LOOKUP_IMPLS)}; add --set model.batched_lookup=false to "
            "look each table up with it, or drop --embedding-impl"
        )


def _tt_linear_spec(cfg: DLRMConfig, name: str, n_out: int, n_in: int) -> C.TTLinearSpec:
    return C.propose_tt_linear(
        n_out, n_in, d=cfg.tt_layer_cores, ranks=cfg.tt_layer_rank, name=name
    )


def init_dlrm(cfg: DLRMConfig, *, generator: torch.Generator) -> tuple[dict, dict]:
    """Fresh ``(params, state)``. Dense layers as the reference: weights
    ``N(0, sqrt(2 / (fan_in + fan_out)))``, biases ``N(0, sqrt(1 / fan_out))``."""
    params: dict = {"bottom": [], "top": [], "tables": {}}
    state: dict = {"bottom": [], "top": [], "tables": {}}
    bottom, top = cfg.mlp_sizes()
    for part, sizes in (("bottom", bottom), ("top", top)):
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            name = f"{part}.{i}"
            if cfg.tt and name in cfg.tt_layers:
                p, s = C.init(_tt_linear_spec(cfg, name, n_out, n_in), generator=generator)
            else:
                std_w = math.sqrt(2 / (n_in + n_out))
                p = {
                    "weight": torch.randn(n_out, n_in, generator=generator) * std_w,
                    "bias": torch.randn(n_out, generator=generator) * math.sqrt(1 / n_out),
                }
                s = {}
            params[part].append(p)
            state[part].append(s)
    specs = table_specs(cfg)
    for i, name in enumerate(cfg.names):
        n = cfg.table_rows(i)
        if name in specs:
            params["tables"][name], state["tables"][name] = C.init(specs[name], generator=generator)
            if cfg.hot_rows:
                hot = torch.zeros(min(cfg.hot_rows, n), cfg.emb_dim)
                params.setdefault("hot", {})[name] = {"weight": hot}
                state.setdefault("hot", {})[name] = {}
        else:
            bound = 1 / math.sqrt(n)
            w = torch.empty(n, cfg.emb_dim).uniform_(-bound, bound, generator=generator)
            params["tables"][name], state["tables"][name] = {"weight": w}, {}
    return params, state


def _mlp(
    layers: list, states: list, x: torch.Tensor, plans: C.LayerPlans, part: str, last_relu: bool
) -> torch.Tensor:
    for i, (p, s) in enumerate(zip(layers, states, strict=True)):
        if "cores" in p:
            x = C.tt_linear(p, s, x, plan=plans.for_layer(f"{part}.{i}"))
        else:
            x = F.linear(x, p["weight"], p["bias"])
        if i < len(layers) - 1 or last_relu:
            # in place: a linear's backward needs its input, not its output, so the ReLU
            # can overwrite it (one (B, width) buffer per layer instead of two)
            x = torch.relu_(x)
    return x


def embed(
    cfg: DLRMConfig,
    params: dict,
    state: dict,
    cat: torch.Tensor,
    *,
    sparse: bool = False,
    specs: dict[str, C.TTMEmbeddingSpec] | None = None,
    impl: str = "optimized",
) -> torch.Tensor:
    """``cat (B, T)`` -> ``(B, T, D)``: dense tables by ``F.embedding`` (``sparse``
    gradients for SGD), TTM tables together (table-batched) or one call each (by TTM
    lookup ``impl``), plus their hot rows where the model has them."""
    tables, states = params["tables"], state["tables"]
    specs = specs if specs is not None else table_specs(cfg)
    tt_cols = [i for i, n in enumerate(cfg.names) if "cores" in tables[n]]
    out: list[torch.Tensor | None] = [None] * len(cfg.names)
    for i, name in enumerate(cfg.names):
        if i not in tt_cols:
            ids = cat[:, i] % cfg.table_rows(i) if cfg.is_hashed(i) else cat[:, i]
            out[i] = F.embedding(ids, tables[name]["weight"], sparse=sparse)  # (B, D)
    if tt_cols and cfg.batched_lookup:
        check_lookup_impl(cfg, impl)
        names = [cfg.names[i] for i in tt_cols]
        rows = C.ttm_embedding_batched(
            [tables[n] for n in names],
            [states[n] for n in names],
            cat[:, tt_cols],
            specs=[specs[n] for n in names] if specs else None,
        )  # (B, T_tt, D)
        for i, r in zip(tt_cols, rows.unbind(1), strict=True):  # one gradient buffer, not T
            out[i] = r
    else:
        for i in tt_cols:
            name = cfg.names[i]
            out[i] = C.ttm_embedding(
                tables[name], states[name], cat[:, i], impl=impl, spec=specs.get(name)
            )
    for name, hot in params.get("hot", {}).items():
        i = cfg.names.index(name)
        ids, k = cat[:, i], hot["weight"].shape[0]
        # ids >= k read row k - 1 and are zeroed, so no gradient reaches it from them
        row = F.embedding(ids.clamp(max=k - 1), hot["weight"], sparse=sparse)
        out[i] = out[i] + row * (ids < k).unsqueeze(1).to(row.dtype)  # type: ignore[operator]
    return torch.stack(out, 1)  # type: ignore[arg-type]


class _Pairs(torch.autograd.Function):
    """``z.flatten(1)[:, flat]`` for distinct ``flat``; the backward writes the gradient
    into a zero ``z``-shaped buffer with one ``index_copy_`` (no accumulation needed)."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(flat)
        ctx.shape = z.shape
        return z.flatten(1).index_select(1, flat)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        (flat,) = ctx.saved_tensors
        b, n, m = ctx.shape
        gz = g.new_zeros(b, n * m).index_copy_(1, flat, g)
        return gz.view(b, n, m), None


def dlrm_logits(
    cfg: DLRMConfig,
    params: dict,
    state: dict,
    batch: dict,
    *,
    plans: C.LayerPlans | None = None,
    sparse: bool = False,
    specs: dict[str, C.TTMEmbeddingSpec] | None = None,
) -> torch.Tensor:
    """Click logits ``(B,)`` for ``batch`` (``dense (B, 13)``, ``cat (B, 26)``)."""
    plans = plans or C.LayerPlans()
    x = _mlp(params["bottom"], state["bottom"], batch["dense"], plans, "bottom", True)  # (B, D)
    emb = embed(
        cfg, params, state, batch["cat"], sparse=sparse, specs=specs, impl=plans.embedding_impl
    )  # (B, T, D)
    vecs = torch.cat([x.unsqueeze(1), emb], 1)  # (B, T+1, D)
    z = torch.bmm(vecs, vecs.transpose(1, 2))  # (B, T+1, T+1)
    n = vecs.shape[1]
    li, lj = torch.tril_indices(n, n, offset=-1, device=z.device)
    flat = li * n + lj
    # under torch.compile the graph's own backward serves (no custom Function to trace)
    if torch.compiler.is_compiling():
        pairs = z.flatten(1).index_select(1, flat)
    else:
        pairs = _Pairs.apply(z, flat)
    r = torch.cat([x, pairs], 1)  # (B, D + T(T+1)/2)
    return _mlp(params["top"], state["top"], r, plans, "top", False).squeeze(1)  # (B,)


def dense_param_count(cfg: DLRMConfig) -> int:
    """Parameters of the dense model with this architecture (the compression reference):
    full tables, whatever ``hash_rows`` says."""
    bottom, top = cfg.mlp_sizes()
    mlp = sum(a * b + b for s in (bottom, top) for a, b in zip(s[:-1], s[1:], strict=True))
    return mlp + sum(cfg.cardinalities) * cfg.emb_dim
