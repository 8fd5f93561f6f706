"""Thin ``nn.Module`` adapters over the functional layers.

They hold exactly the functional ``params`` (as parameters) and ``state`` (masks, as
buffers), so optimizers, DDP/FSDP and ``torch.func.functional_call`` see the same
tensors as the pure functions. Parameter names: ``cores.K``, ``gates.K``, ``bias``;
buffer names: ``masks.K``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from comera import pruning, tensor_train
from comera.errors import ConfigError
from comera.layers import tt_linear, ttm_embedding
from comera.plans import EMBEDDING_IMPLS, PlanLike, resolve_plan
from comera.spec import TTLinearSpec, TTMEmbeddingSpec
from comera.tensor_train import Params, State

__all__ = ["TTLinear", "TTMEmbedding"]


class _Buffers(nn.Module):
    """A list of buffers named ``0, 1, ...`` (the masks of a train)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.n = len(tensors)
        for k, t in enumerate(tensors):
            self.register_buffer(str(k), t)

    def as_list(self) -> list[torch.Tensor]:
        return [getattr(self, str(k)) for k in range(self.n)]


class NoDenseWeight(nn.Module):
    """A module that holds its weight as TT cores, not as a dense ``weight``: reading
    ``weight`` says so (Hugging Face's ``resize_token_embeddings`` and ``tie_weights`` read
    it), still as an ``AttributeError``, so ``hasattr(m, "weight")`` stays False for code
    that probes; a weight registered on it after all is read as usual."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "weight":
                raise
            raise AttributeError(
                f"{self.weight_label()} holds its weight as TT cores, not a dense 'weight': "
                "code that reads or resizes it (Hugging Face's resize_token_embeddings, "
                "tie_weights) must run before tensorize_; to_dense() rebuilds the matrix"
            ) from None

    def weight_label(self) -> str:
        """What the module is, for that error."""
        return type(self).__name__


class _TTModule(NoDenseWeight):
    spec: TTLinearSpec | TTMEmbeddingSpec

    def __init__(
        self,
        spec: TTLinearSpec | TTMEmbeddingSpec,
        generator: torch.Generator | None,
        device: torch.device | str | None,
        params: Params | None,
        state: State | None,
    ) -> None:
        super().__init__()
        self.spec = spec
        if params is None:
            params, state = tensor_train.init(spec, generator=generator, device=device)
        elif state is None:
            raise ValueError(f"{spec.label}: pass state together with params")
        else:
            tensor_train.check_params(params, state, spec)
        self.load_tensors(params, state)

    def weight_label(self) -> str:
        spec = self.__dict__.get("spec")  # (not set yet while a copy is being built)
        return spec.label if spec is not None else type(self).__name__

    def load_tensors(self, params: Params, state: State) -> None:
        """Hold these params and state (new parameters, shapes as given: a compacted
        train's); the tensors are shared, not copied. Each new parameter keeps the
        ``requires_grad`` of the one it replaces (a frozen layer stays frozen)."""

        def held(new: list[torch.Tensor], key: str) -> nn.ParameterList:
            old = list(getattr(self, key, ()))
            return nn.ParameterList([
                nn.Parameter(t, requires_grad=old[k].requires_grad if k < len(old) else True)
                for k, t in enumerate(new)
            ])  # fmt: skip

        self.cores = held(params["cores"], "cores")  # type: ignore[arg-type]
        self.gates = held(params["gates"], "gates")  # type: ignore[arg-type]
        self.masks = _Buffers(list(state["masks"]))  # type: ignore[arg-type]
        if "bias" in params:
            old = getattr(self, "bias", None)
            trained = old.requires_grad if old is not None else True
            self.bias = nn.Parameter(params["bias"], requires_grad=trained)  # type: ignore[arg-type]

    def params(self) -> Params:
        """The functional params pytree (the module's own parameter tensors)."""
        out: Params = {"cores": list(self.cores), "gates": list(self.gates)}
        if getattr(self, "bias", None) is not None:
            out["bias"] = self.bias
        return out

    def state(self) -> State:
        """The functional state pytree (the module's mask buffers)."""
        return {"masks": self.masks.as_list()}

    @torch.no_grad()
    def prune(self, tau: float) -> list[int]:
        """Kill ranks whose gate magnitude is <= tau; returns live ranks per bond."""
        new = pruning.prune(self.params(), self.state(), tau)
        for k, m in enumerate(new["masks"]):  # type: ignore[arg-type]
            getattr(self.masks, str(k)).copy_(m)
        return pruning.live_ranks(new)

    @torch.no_grad()
    def compact(self) -> None:
        """Physically remove dead ranks. The cores and gates are replaced (keeping each one's
        ``requires_grad``), the bias is kept: rebuild the optimizer (or use ``comera``
        training utilities, which carry optimizer state over)."""
        self._swap_trains(*pruning.compact(self.params(), self.state()))

    def _swap_trains(self, params: Params, state: State) -> None:
        """Hold new cores, gates and masks, keeping each parameter's ``requires_grad`` (a
        frozen layer stays frozen, a trained one trained) and the bias itself (never
        resized: the same parameter, and its optimizer state)."""
        bias = getattr(self, "bias", None)
        self.load_tensors(params, state)  # it keeps each parameter's requires_grad
        if bias is not None:
            self.bias = bias

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object) -> None:
        """A state dict saved after compaction (other ranks, the same modes) loads into a
        layer built at the spec's ranks, as into one compacted alike: the layer first takes
        the saved ranks (new parameters: build the optimizer after loading), then loads
        the values as usual. Anything else (other modes, a partial dict) meets torch's own
        checks and errors."""
        with torch.no_grad():
            ranks = self._saved_ranks(state_dict, prefix)
            if ranks is not None and ranks != tensor_train.bond_ranks(self.params()):
                edges = zip(self.cores, [1, *ranks], [*ranks, 1], strict=True)
                cores = [c.new_empty((a, *c.shape[1:-1], b)) for c, a, b in edges]
                gates = [g.new_ones(r) for g, r in zip(self.gates, ranks, strict=True)]
                masks = [m.new_ones(r) for m, r in zip(self.masks.as_list(), ranks, strict=True)]
                self._swap_trains({"cores": cores, "gates": gates}, {"masks": masks})
                warnings.warn(  # one text for every layer: shown once, not per layer
                    "a TT/TTM layer took the saved state dict's ranks: its cores and gates "
                    "are new parameters, so build the optimizer (and any DDP/FSDP wrapper) "
                    "after loading",
                    stacklevel=2,
                )
        super()._load_from_state_dict(state_dict, prefix, *args)  # type: ignore[arg-type]

    def _saved_ranks(self, state_dict: dict, prefix: str) -> list[int] | None:
        """The bond ranks of the train saved under ``prefix``, when it is this layer's
        train at other ranks (the same number of cores and modes, consistent ranks)."""
        n = len(self.cores)
        cores = [state_dict.get(f"{prefix}cores.{k}") for k in range(n)]
        gates = [state_dict.get(f"{prefix}gates.{k}") for k in range(n - 1)]
        masks = [state_dict.get(f"{prefix}masks.{k}") for k in range(n - 1)]
        if not all(isinstance(t, torch.Tensor) for t in (*cores, *gates, *masks)):
            return None
        if any(t.dim() != c.dim() or t.shape[1:-1] != c.shape[1:-1]
               for t, c in zip(cores, self.cores, strict=True)):  # fmt: skip
            return None
        ranks = [int(t.shape[-1]) for t in cores[:-1]]
        chained = [int(t.shape[0]) for t in cores[1:]] == ranks
        edges = int(cores[0].shape[0]) == 1 and int(cores[-1].shape[-1]) == 1
        sized = all(tuple(t.shape) == (r,) for ts in (gates, masks)
                    for t, r in zip(ts, ranks, strict=True))  # fmt: skip
        return ranks if chained and edges and sized else None

    def to_dense(self) -> torch.Tensor:
        return tensor_train.to_dense(self.params(), self.state(), self.spec)

    def extra_repr(self) -> str:
        ranks = tensor_train.bond_ranks(self.params())
        return f"name={self.spec.name!r}, dense={self.spec.dense_shape}, ranks={ranks}"


class TTLinear(_TTModule):
    """``nn.Linear`` replacement whose weight is a gated tensor train."""

    def __init__(
        self,
        spec: TTLinearSpec,
        *,
        plan: PlanLike = None,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
        params: Params | None = None,
        state: State | None = None,
    ) -> None:
        super().__init__(spec, generator, device, params, state)
        if plan is not None:  # refused here, not at the first forward
            resolve_plan(plan, f"TTLinear {spec.name!r} plan")
        self.plan = plan  # per-layer strategy; None follows the global default

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: TTLinearSpec, **kw: object) -> TTLinear:
        """Compress an existing ``nn.Linear`` by TT-SVD (ranks capped by ``spec.ranks``)."""
        params, state = tensor_train.from_dense(linear.weight, spec, linear.bias)
        return cls(spec, params=params, state=state, **kw)  # type: ignore[arg-type]

    @property
    def in_features(self) -> int:
        """``nn.Linear``'s input size: the spec's (code that reads it after tensorize_)."""
        return int(self.spec.in_features)  # type: ignore[union-attr]

    @property
    def out_features(self) -> int:
        """``nn.Linear``'s output size: the spec's."""
        return int(self.spec.out_features)  # type: ignore[union-attr]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tt_linear(self.params(), self.state(), x, plan=self.plan, spec=self.spec)  # type: ignore[arg-type]


class TTMEmbedding(_TTModule):
    """``nn.Embedding`` replacement whose table is a gated tensor-train matrix."""

    def __init__(
        self,
        spec: TTMEmbeddingSpec,
        *,
        impl: str = "optimized",
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
        params: Params | None = None,
        state: State | None = None,
    ) -> None:
        super().__init__(spec, generator, device, params, state)
        if not isinstance(impl, str) or impl not in EMBEDDING_IMPLS:
            raise ConfigError(
                f"TTMEmbedding {spec.name!r}: unknown impl {impl!r}; expected one of "
                f"{', '.join(EMBEDDING_IMPLS)}"
            )
        self.impl = impl

    @property
    def num_embeddings(self) -> int:
        """``nn.Embedding``'s row count: the spec's (not the padded table's)."""
        return int(self.spec.num_embeddings)  # type: ignore[union-attr]

    @property
    def embedding_dim(self) -> int:
        """``nn.Embedding``'s row width: the spec's."""
        return int(self.spec.embedding_dim)  # type: ignore[union-attr]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ttm_embedding(self.params(), self.state(), ids, impl=self.impl, spec=self.spec)  # type: ignore[arg-type]
