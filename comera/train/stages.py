"""The CoMERA stage machine as a small, pure controller.

It owns no tensors: given the step, the global loss value and the model, it says what the
objective is this step (a weight on the task loss plus a term in the parameters alone) and
which rank events follow the step. The loop carries the events out. Its whole state is
``{"stage", "targets", "loss_ema"}``, saved in every checkpoint.

Stages. ``early`` (``early_steps`` steps): ``L + gamma * R(gates)`` (``R`` from
``regularizer``; ``gamma`` is 0 before ``reg_start_step``). At the boundary the model is
pruned and compacted, then the late targets are fixed: the loss target ``L0`` (configured,
or the smoothed loss) and the size target in live parameters, ``P0 = c * P`` (``P`` the
live size then) or ``reference / target_compression``. ``late``: ``w_L * L + w_S * S``
with the weights of :func:`comera.train.objectives.late_weights`, which put the step's
weight on whichever of loss and size is relatively further from its target.

With ``size_objective="shares"`` the size that decides is the live parameter count
against a budget that falls from ``P`` to ``P0`` over the first ``prune_ramp`` of the
stage (:meth:`StageController.size_budget`), and the size term is
:func:`comera.train.objectives.share_size` (a size at or under the budget is met and never
leads: the step's weight then goes to the loss); with ``late_prune="schedule"`` the loop prunes
the smallest-share ranks down to the budget at every prune event (and to ``P0`` at the
end), so the target is met in parameters. ``size_ratio=1`` (no ``target_compression``)
holds the size: the loss alone. With ``size_objective="paper"`` both are the paper's
surrogate ``S`` and its target ``S0 = c * S``. ``dense``: the loss alone (``enabled=False``).

Events after step ``s``: ``prune`` every ``prune_every`` steps and where the budget's ramp
ends; ``transition`` at the boundary (none when that is the last step: an early stage as
long as the run has no late stage); ``compact`` every ``compact_every`` steps and at the
last step (``final``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from comera.errors import CheckpointError, ConfigError
from comera.train.config import WEIGHT_LIMIT, ComeraConfig
from comera.train.objectives import gate_regularizer, late_weights, share_size, size_surrogate

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
        # the model's live parameters: the loop sets it after every rank event (a host
        # int, so the late objective reads no device value)
        self.live_params: int | None = None

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"stage": self.stage, "targets": dict(self.targets), "loss_ema": self.loss_ema}

    def load_state_dict(self, state: dict) -> None:
        c = self.cfg
        if (
            state["stage"] == "late"
            and "params" not in state["targets"]
            and (c.size_objective == "shares" or c.late_prune == "schedule")
        ):
            raise CheckpointError(
                "this checkpoint's late stage predates live-size targets; resume it with "
                "--set train.comera.size_objective=paper --set train.comera.late_prune=threshold "
                "(the late stage it was trained with)"
            )
        self.stage = state["stage"]
        self.targets = dict(state["targets"])
        self.loss_ema = state["loss_ema"]

    def start(self, params: object, state: object, live: int, reference: int) -> None:
        """Fix the late targets up front when there is no early stage."""
        self.live_params = live
        if self.stage == "late" and not self.targets:
            self.fix_targets(params, state, live, reference, step=0)

    def fix_targets(
        self, params: object, state: object, live: int, reference: int, step: int
    ) -> None:
        """The late stage's targets, at ``step`` (its start), from the model as it is:
        ``live`` its live parameters, ``reference`` what compression is measured against."""
        c = self.cfg
        size = float(size_surrogate(params, state).detach())
        loss = c.loss_target if c.loss_target is not None else self.loss_ema
        goal = reference / c.target_compression if c.target_compression else c.size_ratio * live
        self.targets = {
            "size": c.size_ratio * size,  # the paper's S0 (size_objective="paper")
            "loss": float(loss) if loss is not None else 1.0,  # 0: refused, as L0 < 0
            "params_early": float(live),
            # never asks to grow, nor for less than one parameter (1 / budget weighs it)
            "params": min(max(float(goal), 1.0), float(live)),
            "params_asked": float(goal),
            "late_start": float(step),
        }
        self.live_params = live
        s0 = self.targets["size"]
        if c.size_objective == "paper" and 0 < s0 and (1 + c.rho) / s0 > WEIGHT_LIMIT:
            raise ConfigError(
                f"the late stage's size target S0 = size_ratio x S = {s0:.3g} is so small that "
                "its weight (1 + rho) / S0 would overflow float32; raise "
                "train.comera.size_ratio"
            )

    # -- the size budget ---------------------------------------------------------------
    @property
    def holds(self) -> bool:
        """The late stage keeps the size it starts with (the late stage off)."""
        t = self.targets
        return self.cfg.size_objective == "shares" and t.get("params", 0) >= t.get(
            "params_early", 1
        )

    def ramp_end(self) -> int | None:
        """The step where the budget reaches the target (None before the late stage)."""
        if "late_start" not in self.targets:
            return None
        start = int(self.targets["late_start"])
        return start + max(1, round(self.cfg.prune_ramp * (self.total_steps - start)))

    def size_budget(self, step: int) -> float | None:
        """Live parameters allowed after ``step``: from the late stage's start size down
        to its target, cubically (most of the pruning early, while the model has the most
        slack), reaching the target at :meth:`ramp_end`. None before the late stage."""
        end = self.ramp_end()
        if end is None:
            return None
        t = self.targets
        start, early, goal = t["late_start"], t["params_early"], t["params"]
        frac = min(max((step - start) / (end - start), 0.0), 1.0)
        return goal + (early - goal) * (1.0 - frac) ** 3

    def prunes_to_budget(self) -> bool:
        """Whether the loop prunes to :meth:`size_budget` at this stage's prune events."""
        return self.stage == "late" and self.cfg.late_prune == "schedule" and not self.holds

    # -- one step ----------------------------------------------------------------------
    def objective(self, step: int, loss_value: float, params: object, state: object) -> Objective:
        """The objective of 1-based ``step`` given the (global) loss value."""
        c = self.cfg
        if self.stage == "dense":
            return Objective(1.0, None, {})
        if self.stage == "early":
            # Adam turns even a tiny consistent L1 pull into lr-sized gate steps, so an
            # untrained model would lose its gates before it learns; reg_start_step waits.
            gamma = c.gamma if step > c.reg_start_step else 0.0
            with torch.no_grad() if gamma <= 0 else contextlib.nullcontext():
                reg = gate_regularizer(params, state, c.regularizer)  # else only logged
            term = gamma * reg if gamma > 0 else None
            return Objective(1.0, term, {"gate_reg": reg.detach()})
        if c.size_objective == "shares":
            budget = self.size_budget(step)
            if self.holds or budget is None or budget <= 0:
                return Objective(1.0, None, {})
            size = share_size(params, state)
            if not size.requires_grad:  # every layer pruned to nothing
                return Objective(1.0, None, {})
            live = float(self.live_params or 0)
            # at or under the budget the size is met: a lower share size buys nothing the
            # budget prune keeps, so the step's weight goes to the loss (plus rho's pull)
            gap_live = live if live > budget else -math.inf
            w = late_weights(loss_value, gap_live, self.loss_target(), budget, c.rho)
            metrics = {
                "size": size.detach(),
                "size_budget": budget,
                "focus_size": float(w.focus == "size"),
            }
            return Objective(w.loss, w.size * size, metrics)
        size = size_surrogate(params, state)
        if self.targets["size"] <= 0:  # pruned to nothing early: only the loss is left
            return Objective(1.0, None, {"size": size.detach()})
        w = late_weights(
            loss_value, float(size.detach()), self.loss_target(), self.targets["size"], c.rho
        )
        metrics = {"size": size.detach(), "focus_size": float(w.focus == "size")}
        return Objective(w.loss, w.size * size, metrics)

    def device_objective(
        self,
        loss: torch.Tensor,
        params: object,
        state: object,
        gamma: torch.Tensor,
        late: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """:meth:`objective` with no host read, for :mod:`comera.train.sync_free`.

        ``loss`` is the global mean loss as a device scalar and ``gamma`` the regularizer's
        weight this step (0 before ``reg_start_step``), filled by the host. Returns the
        loss weight, the parameter term and metrics as tensors; ``metrics["@term"]`` is
        the term's value (for the logged objective). The late stage's branch is a 0/1
        device scalar weighting both weights instead of an ``if`` on the host; the branch
        taken is the same. With ``size_objective="shares"``, ``late`` is the step's
        ``(size gap, 1 / size budget)`` as device scalars the host fills
        (:meth:`late_inputs`): the budget moves every step, so it is an input, not a
        constant baked into a graph."""
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
        metrics: dict = {}
        if c.size_objective == "shares":
            if self.holds or late is None:
                return one, None, {}
            size = share_size(params, state)
            if not size.requires_grad:
                return one, None, {}
            gap_size, inv_s0 = late
            metrics["size_budget"] = 1.0 / inv_s0
        else:
            size = size_surrogate(params, state)
            if self.targets["size"] <= 0:
                return one, None, {"size": size.detach()}
            inv_s0 = 1.0 / self.targets["size"]
            gap_size = size.detach().double() * inv_s0 - 1.0
        l0 = self.loss_target()  # here, where it is used: as eager, a held size needs none
        gap_loss = (loss - l0) / l0
        on_size = (gap_loss < gap_size).double()
        w_loss = c.rho / l0 + (1.0 - on_size) / l0
        w_size = (c.rho + on_size) * inv_s0
        term = w_size.to(size.dtype) * size
        metrics.update(size=size.detach(), focus_size=on_size)
        return w_loss, term, {**metrics, "@term": term.detach()}

    def loss_target(self) -> float:
        """The late stage's loss target L0, which its weights divide by: a smoothed loss
        that is not positive (a loss that can go below 0) is a ``ConfigError`` naming the
        setting that gives one."""
        l0 = self.targets["loss"]
        if not l0 > 0:
            raise ConfigError(
                f"the late stage's loss target L0 is {l0:.6g}, the smoothed loss at its start; "
                "its weights need L0 > 0: set train.comera.loss_target to a positive loss to "
                "reach"
            )
        if (1 + self.cfg.rho) / l0 > WEIGHT_LIMIT:  # overflows the step's float32 weight
            raise ConfigError(
                f"the late stage's loss target L0 is {l0:.6g}, the smoothed loss at its start; "
                f"its weight (1 + rho) / L0 would overflow: set train.comera.loss_target to a "
                f"loss of at least {(1 + self.cfg.rho) / WEIGHT_LIMIT:.3g}"
            )
        return l0

    def late_inputs(self, step: int) -> tuple[float, float] | None:
        """The host's side of :meth:`device_objective`'s ``late`` at 1-based ``step``:
        ``((live - budget) / budget, 1 / budget)``, or None when there is no size term."""
        if self.stage != "late" or self.cfg.size_objective != "shares" or self.holds:
            return None
        budget = self.size_budget(step)
        if budget is None or budget <= 0:
            return None
        live = float(self.live_params or 0)
        gap = (live - budget) / budget if live > budget else -math.inf  # met: the loss leads
        return gap, 1.0 / budget

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
        if step % c.prune_every == 0 or (self.prunes_to_budget() and step == self.ramp_end()):
            out.append("prune")
        # the last step has no late stage after it: a run whose early stage fills it ends
        # early (pruned and compacted as any run ends, not cut to a late target untrained)
        if self.stage == "early" and c.early_steps <= step < self.total_steps:
            out.append("transition")
        elif c.compact_every and step % c.compact_every == 0 and step != self.total_steps:
            out.append("compact")  # the final event compacts anyway
        if step == self.total_steps:
            out.append("final")
        return out
