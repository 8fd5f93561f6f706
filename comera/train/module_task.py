"""Train an ``nn.Module`` (a model :func:`comera.tensorize_` rewrote, say) with the shared
trainer: rank adaptation, pruning, compaction, checkpoints, data parallelism, wandb.

The trainer works on a params pytree; :class:`ModuleTask` gives it the module's own
tensors in that form (each TT / TTM adapter as a ``{"cores", "gates", "bias"}`` dict at its
module path, every other parameter as a leaf under its name; the rank masks, and the
module's persistent buffers under :data:`BUFFERS`, as the state) and runs the module with
whatever tensors the trainer passes, through ``torch.func.functional_call``. After a
compaction the trainer's tensors are new and smaller: the task loads them into the
module's adapters, so the module always holds what the trainer trains (``copy=False``,
which :meth:`ModuleTask.trainer` passes)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from comera.errors import ConfigError
from comera.layers import tt_linear, ttm_embedding
from comera.nn import TTLinear, TTMEmbedding
from comera.train.task import BUFFERS
from comera.tree import iter_tt, leaves

__all__ = ["BUFFERS", "ModuleTask"]

Call = Callable[..., Any]


class ModuleTask:
    """A :class:`comera.train.Task` over ``model``.

    ``loss_fn(call, batch)`` computes a batch's loss, running the model as ``call(...)``
    (the module's forward, on the trainer's tensors); it returns a scalar mean (one loss
    term) or ``(sum, count, metrics)``. ``evaluate(call)`` (optional) returns held-out
    metrics as the trainer expects (floats, or ``(sum, count)`` pairs); written as
    ``evaluate(call, *, rank, world)`` it evaluates this rank's share (pairs, then).
    ``eval_data_id`` (optional) names what it evaluates on, as :class:`comera.train.Task`
    says. ``train_iter`` yields batches; with ``state_dict`` / ``load_state_dict`` a
    resume continues it exactly (without them, a resume restarts it from its beginning:
    warned).

    The module's persistent buffers (batch norm's running statistics, say) ride in the
    state: the module updates them as it runs (in place, or, in eager steps, by assigning
    a new tensor, which is written back after each call), and the checkpoint stores them,
    so a resumed run goes on from the saved statistics. A 0-dim buffer is held as a
    one-element view of itself, so ``step_mode="compile"`` keeps its in-place updates.
    Under data parallelism every rank holds rank 0's after each step (as DDP's
    ``broadcast_buffers``), so the ranks run, evaluate and checkpoint one model.
    Frozen parameters (``requires_grad=False``) stay the module's own and are not trained:
    a whole TT layer frozen is neither trained nor pruned, nor counted in the sizes the
    trainer reports and targets; the trainer gives every rank rank 0's when it starts
    (:meth:`replicated_tensors`). Checkpoints do not hold them, only their fingerprints: a
    resume onto other frozen weights is refused. A TT layer with some tensors frozen and
    others not is refused. The model must already be on the trainer's device
    (``model.to(cfg.device)``)."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[Call, Any], Any],
        train_iter: Any,
        evaluate: Callable[[Call], dict] | None = None,
        eval_data_id: dict[str, str] | None = None,
    ) -> None:
        self.model, self.loss_fn, self.train_iter = model, loss_fn, train_iter
        self._evaluate = evaluate
        self.eval_data_id = eval_data_id
        adapters = (TTLinear, TTMEmbedding)
        every = {name: m for name, m in model.named_modules() if isinstance(m, adapters)}
        self._tt = {name: m for name, m in every.items() if _trained(name, m)}
        self._frozen_tt = [name for name in every if name not in self._tt]
        owned = {_dotted(name, p) for name, m in every.items() for p, _ in m.named_parameters()}
        # frozen parameters stay the module's own: the trainer differentiates what it holds
        self._rest = [n for n, p in model.named_parameters() if n not in owned and p.requires_grad]
        persistent = set(model.state_dict(keep_vars=True))
        masks = {_dotted(name, b) for name, m in every.items() for b, _ in m.named_buffers()}
        self._buffers = [n for n, _ in model.named_buffers() if n in persistent and n not in masks]
        self._scalars = {n for n in self._buffers if model.get_buffer(n).dim() == 0}

    def params(self) -> dict:
        """The module's parameters as the trainer's params pytree (the same tensors)."""
        named = dict(self.model.named_parameters())
        out: dict[str, Any] = {name: m.params() for name, m in self._tt.items()}
        out.update({n: named[n] for n in self._rest})
        return out

    def dense_shapes(self) -> dict[str, tuple[int, int]]:
        """The real ``(out, in)`` (a table's ``(rows, dim)``) of every trained TT layer, by
        its path in :meth:`params`: a train holds the padded sizes ``tensorize_`` gave an
        awkward layer, and :func:`comera.summarize` counts those without them."""
        out = {}
        for name, m in self._tt.items():
            parent = self.model.get_submodule(name.rpartition(".")[0]) if "." in name else None
            outer = parent if getattr(parent, "inner", None) is m else m  # PaddedTTLinear
            if isinstance(m, TTMEmbedding):
                out[name] = (int(m.num_embeddings), int(m.embedding_dim))
            else:
                out[name] = (int(outer.out_features), int(outer.in_features))  # type: ignore[union-attr]
        return out

    def replicated_tensors(self) -> list[torch.Tensor]:
        """The module's frozen parameters: neither params nor state, yet every rank must
        hold the same (the trainer broadcasts rank 0's at start, as DDP does)."""
        held = {id(t) for t in leaves(self.params())}
        return [p for p in self.model.parameters() if id(p) not in held]

    def replicated_named(self) -> dict[str, torch.Tensor]:
        """The frozen tensors by name, as a checkpoint fingerprints them: a frozen TT layer
        as its output on fixed probes (``NAME(probe)``), not as its cores, which are one of
        many factorizations of its weight (a TT-SVD at another thread count gives others,
        its entries far apart); the rest as they are."""
        frozen = {n: self.model.get_submodule(n) if n else self.model for n in self._frozen_tt}
        inside = {id(p) for m in frozen.values() for p in m.parameters()}
        kept = {id(p) for p in self.replicated_tensors()} - inside  # the rest as they are
        out = {n: p for n, p in self.model.named_parameters() if id(p) in kept}
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, m in frozen.items():
                like = next(iter(m.parameters()))
                if isinstance(m, TTMEmbedding):  # a fixed plan: "auto" would time candidates
                    ids = torch.randint(m.num_embeddings, (16,), generator=gen).to(like.device)
                    y = ttm_embedding(m.params(), m.state(), ids, impl="optimized", spec=m.spec)
                else:
                    x = torch.randn(4, m.in_features, generator=gen).to(like.device, like.dtype)
                    y = tt_linear(m.params(), m.state(), x, plan="comera", spec=m.spec)
                out[f"{name or 'model'}(probe)"] = y
        return out

    def state(self) -> dict:
        """The adapters' rank masks as the trainer's state pytree, and the module's
        persistent buffers (the same tensors) under :data:`BUFFERS`."""
        out: dict[str, Any] = {name: m.state() for name, m in self._tt.items()}
        if self._buffers:
            get = self.model.get_buffer
            out[BUFFERS] = {n: get(n).view(1) if n in self._scalars else get(n)
                            for n in self._buffers}  # fmt: skip
        return out

    def _as_buffer(self, name: str, held: torch.Tensor) -> torch.Tensor:
        """The module's view of a buffer the state holds (a 0-dim one as its one element)."""
        return held.view(()) if name in self._scalars and held.dim() == 1 else held

    def _tensors(self, params: dict, state: dict) -> dict[str, torch.Tensor]:
        """``functional_call``'s ``{qualified name: tensor}`` for a params / state pair."""
        out: dict[str, torch.Tensor] = {}
        for name in self._tt:
            p, s = params[name], state[name]
            out.update({_dotted(name, f"cores.{k}"): c for k, c in enumerate(p["cores"])})
            out.update({_dotted(name, f"gates.{k}"): g for k, g in enumerate(p["gates"])})
            out.update({_dotted(name, f"masks.{k}"): m for k, m in enumerate(s["masks"])})
            if "bias" in p:
                out[_dotted(name, "bias")] = p["bias"]
        out.update({n: params[n] for n in self._rest})
        # a run saved before buffers were kept has none: the module's own are used
        out.update({n: self._as_buffer(n, t) for n, t in state.get(BUFFERS, {}).items()})
        return out

    def _call(self, params: dict, state: dict) -> Call:
        tensors = self._tensors(params, state)
        passed = {n: tensors[n] for n in state.get(BUFFERS, {})}

        def call(*args: Any, **kwargs: Any) -> Any:
            out = torch.func.functional_call(self.model, tensors, args, kwargs, strict=False)
            # functional_call writes a buffer the module assigned anew back into
            # ``tensors``: copy it into the state's tensor (what is checkpointed, and what
            # the module holds), which keeps its identity; a new shape or dtype replaces it
            for n, t in passed.items():
                new = tensors[n]
                if new is t:
                    continue
                if new.shape == t.shape and new.dtype == t.dtype:
                    with torch.no_grad():
                        t.copy_(new)
                    tensors[n] = t
                else:
                    new = new.detach()
                    state[BUFFERS][n] = new.reshape(1) if n in self._scalars else new
                    passed[n] = tensors[n] = self._as_buffer(n, state[BUFFERS][n])
                    self._set_buffer(n, passed[n])
            return out

        return call

    def _set_buffer(self, name: str, tensor: torch.Tensor) -> None:
        owner, _, leaf = name.rpartition(".")
        setattr(self.model.get_submodule(owner), leaf, tensor)

    def loss(self, params: dict, state: dict, batch: Any, *, train: bool) -> tuple:
        self.model.train(train)
        out = self.loss_fn(self._call(params, state), batch)
        loss = (out if isinstance(out, torch.Tensor)
                else out[0] if isinstance(out, (tuple, list)) and out else None)  # fmt: skip
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            what = (f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                    else f"type {type(out).__name__}")  # fmt: skip
            raise ValueError(
                f"ModuleTask: loss_fn returned a loss of {what}; return a scalar tensor (the "
                "batch's loss) or (loss, count, metrics)"
            )
        if isinstance(out, torch.Tensor):
            return out, 1, {}
        return out

    def evaluate(self, params: dict, state: dict, *, rank: int = 0, world: int = 1) -> dict:
        """The user's ``evaluate(call)``; one that takes ``rank`` and ``world`` too is
        passed them, to evaluate this rank's share of the held-out data (each rank doing
        the whole split would give the same numbers, at ``world`` times the work)."""
        if self._evaluate is None:
            return {}
        self.model.eval()
        call = self._call(params, state)
        if "rank" in inspect.signature(self._evaluate).parameters:
            return self._evaluate(call, rank=rank, world=world)
        return self._evaluate(call)

    def on_compaction(self, params: dict, state: dict) -> None:
        """Point the module at the trainer's tensors after they were replaced (a
        compaction's smaller trains, a resumed run's restored ones): the adapters load the
        new trains and every other parameter shares the trainer's storage, so the module
        is what is trained."""
        held = {path for path, _, _ in iter_tt(params, state)}
        if held != set(self._tt) or set(params) != set(self._tt) | set(self._rest):
            others = sorted(set(params) - held)
            raise ValueError(
                f"ModuleTask: the trainer holds the TT layers {sorted(held)} and the "
                f"parameters {others}, and this module trains {sorted(self._tt)} and "
                f"{sorted(self._rest)}; was something frozen or unfrozen since the run was "
                "saved? Freeze as the run did, or start a new run"
            )
        saved = state.get(BUFFERS)
        if saved is not None and set(saved) != set(self._buffers):
            raise ValueError(
                f"ModuleTask: the run's state holds the buffers {sorted(saved)} and this "
                f"module has {sorted(self._buffers)}; resume with the model the run saved"
            )
        for name, module in self._tt.items():
            module.load_tensors(params[name], state[name])
        for name in self._rest:
            t, p = params[name], self.model.get_parameter(name)
            if p.data_ptr() != t.data_ptr():
                p.data = t  # the same Parameter object: every module that shares it follows
        for name, t in state.get(BUFFERS, {}).items():  # a resumed run's statistics
            if self.model.get_buffer(name).data_ptr() != t.data_ptr():
                self._set_buffer(name, self._as_buffer(name, t))

    def trainer(self, cfg: Any, **kw: Any) -> Any:
        """A :class:`comera.train.Trainer` of this task on the module's own tensors."""
        from comera.train.loop import Trainer

        if self._frozen_tt and not self._tt and getattr(cfg.comera, "enabled", False):
            # the trainer would say the model holds no TT layer: it holds them, all frozen
            more = f" (+{len(self._frozen_tt) - 6} more)" if len(self._frozen_tt) > 6 else ""
            raise ConfigError(
                f"ModuleTask: every TT layer is frozen ({', '.join(self._frozen_tt[:6])}{more}), "
                "and CoMERA adapts the ranks of trained ones only; unfreeze some "
                "(requires_grad_(True)) or train with train.comera.enabled=False"
            )
        return Trainer(cfg, self, self.params(), self.state(), copy=False, **kw)


def _dotted(module: str, name: str) -> str:
    """``name`` of the submodule at ``module`` as the model names it (the model itself, a
    TT layer trained alone, is ``""``)."""
    return f"{module}.{name}" if module else name


def _trained(name: str, module: nn.Module) -> bool:
    """Whether the trainer trains a TT layer: all of its tensors require grad (it is
    trained) or none do (it is frozen); a mix is refused."""
    flags = {p.requires_grad for p in module.parameters()}
    if len(flags) > 1:
        frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
        raise ValueError(
            f"ModuleTask: TT layer {name!r} has frozen tensors ({', '.join(frozen)}) and "
            "trainable ones; freeze the whole layer (module.requires_grad_(False)) or none of it"
        )
    return flags != {False}
