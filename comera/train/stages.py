"""The CoMERA stage machine as a small, pure controller.

It owns no tensors: given the step, the global loss value and the model, it says what the
objective is this step (a weight on the task loss plus a term in the parameters alone) and
which rank events follow the step. The loop carries the events out. Its whole state is
``{"stage", "targets", "loss_ema"}``, saved in every checkpoint.

Stages. ``early`` (``early_steps`` steps): ``L + gamma * R(gates)`` (``R`` from
``regularizer``; ``gamma`` is 0 before ``reg_start_step``). At the boundary the model is
pruned and compacted, then the late targets are fixed: ``S0 = c * S`` and ``L0`` (configured,
or the smoothed loss). ``late``: ``w_L * L + w_S * S`` with the weights of
:func:`comera.train.objectives.late_weights`. ``dense``: the loss alone (``enabled=False``).
Events after step ``s``: ``prune`` every ``prune_every`` steps; ``transition`` at the
boundary; ``compact`` every ``compact_every`` steps and at the last step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from comera.train.config import ComeraConfig
from comera.train.objectives import gate_regularizer, late_weights, size_surrogate

__all__ = ["Objective", "StageController"]


@dataclass(slots=True)
class Objective:
    """``loss_weight * L + param_term``: the second part depends on the parameters only,
    so data-parallel ranks add it after the gradient reduction, identically."""

    loss_weight: float
    param_term: torch.Tensor | None
    metrics: dict


class StageController:
    """Decides the objective of each step and the prune/compact/transition events."""

    def __init__(self, cfg: ComeraConfig, total_steps: int) -> None:
        self.cfg = cfg
        self.total_steps = total_steps
        if not cfg.enabled:
            self.stage = "dense"
        else:
            self.stage = "early" if cfg.early_steps > 0 else "late"
        self.targets: dict[str, float] = {}
        self.loss_ema: float | None = None

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"stage": self.stage, "targets": dict(self.targets), "loss_ema": self.loss_ema}

    def load_state_dict(self, state: dict) -> None:
        self.stage = state["stage"]
        self.targets = dict(state["targets"])
        self.loss_ema = state["loss_ema"]

    def start(self, params: object, state: object) -> None:
        """Fix the late targets up front when there is no early stage."""
        if self.stage == "late" and not self.targets:
            self.fix_targets(params, state)

    def fix_targets(self, params: object, state: object) -> None:
        size = float(size_surrogate(params, state).detach())
        loss = self.cfg.loss_target if self.cfg.loss_target is not None else self.loss_ema
        self.targets = {"size": self.cfg.size_ratio * size, "loss": float(loss or 1.0)}

    # -- one step ----------------------------------------------------------------------
    def objective(self, step: int, loss_value: float, params: object, state: object) -> Objective:
        """The objective of 1-based ``step`` given the (global) loss value."""
        c = self.cfg
        if self.stage == "dense":
            return Objective(1.0, None, {})
        if self.stage == "early":
            reg = gate_regularizer(params, state, c.regularizer)
            # Adam turns even a tiny consistent L1 pull into lr-sized gate steps, so an
            # untrained model would lose its gates before it learns; reg_start_step waits.
            gamma = c.gamma if step > c.reg_start_step else 0.0
            term = gamma * reg if gamma > 0 else None
            return Objective(1.0, term, {"gate_reg": reg.detach()})
        size = size_surrogate(params, state)
        if self.targets["size"] <= 0:  # pruned to nothing early: only the loss is left
            return Objective(1.0, None, {"size": size.detach()})
        w = late_weights(
            loss_value, float(size.detach()), self.targets["loss"], self.targets["size"], c.rho
        )
        metrics = {"size": size.detach(), "focus_size": float(w.focus == "size")}
        return Objective(w.loss, w.size * size, metrics)

    def device_objective(
        self, loss: torch.Tensor, params: object, state: object, gamma: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """:meth:`objective` with no host read, for :mod:`comera.train.sync_free`.

        ``loss`` is the global mean loss as a device scalar and ``gamma`` the regularizer's
        weight this step (0 before ``reg_start_step``), filled by the host. Returns the
        loss weight, the parameter term and metrics as tensors; ``metrics["@term"]`` is
        the term's value (for the logged objective). The late stage's branch is a 0/1
        device scalar weighting both weights instead of an ``if`` on the host; the branch
        taken is the same."""
        c = self.cfg
        one = torch.ones((), dtype=torch.float64, device=loss.device)
        if self.stage == "dense":
            return one, None, {}
        if self.stage == "early":
            reg = gate_regularizer(params, state, c.regularizer)
            if c.gamma <= 0:
                return one, None, {"gate_reg": reg.detach()}
            term = gamma.to(reg.dtype) * reg
            return one, term, {"gate_reg": reg.detach(), "@term": term.detach()}
        size = size_surrogate(params, state)
        if self.targets["size"] <= 0:
            return one, None, {"size": size.detach()}
        l0, s0 = self.targets["loss"], self.targets["size"]
        if l0 <= 0:  # what late_weights refuses, said here rather than as a NaN later
            raise ValueError(f"late stage targets must be > 0, got loss_target={l0}")
        gap_loss = (loss - l0) / l0
        gap_size = (size.detach().double() - s0) / s0
        on_size = (gap_loss < gap_size).double()
        w_loss = c.rho / l0 + (1.0 - on_size) / l0
        w_size = c.rho / s0 + on_size / s0
        term = w_size.to(size.dtype) * size
        return w_loss, term, {"size": size.detach(), "focus_size": on_size, "@term": term.detach()}

    def observe(self, loss_value: float) -> None:
        """Track the smoothed loss (the default loss target L0)."""
        self.loss_ema = (
            loss_value if self.loss_ema is None else 0.95 * self.loss_ema + 0.05 * loss_value
        )

    def events(self, step: int) -> list[str]:
        """Rank events after ``step``, in the order the loop must apply them."""
        c = self.cfg
        if self.stage == "dense":
            return []
        out = []
        if step % c.prune_every == 0:
            out.append("prune")
        if self.stage == "early" and step >= c.early_steps:
            out.append("transition")
        elif c.compact_every and step % c.compact_every == 0 and step != self.total_steps:
            out.append("compact")  # the final event compacts anyway
        if step == self.total_steps:
            out.append("final")
        return out
