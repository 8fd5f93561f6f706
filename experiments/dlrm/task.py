"""The DLRM task for the shared trainer: BCE loss as (sum, count), click metrics."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import comera as C
from comera.accounting import live_param_count
from experiments.dlrm.batches import RowBatches, rows_to_batch
from experiments.dlrm.data import CriteoData, entropy
from experiments.dlrm.model import DLRMConfig, dlrm_logits, table_specs

__all__ = ["DLRMTask", "click_metrics", "roc_auc"]


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Exact ROC AUC (Mann-Whitney), tied scores sharing their average rank."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(bool)
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0 or not np.isfinite(scores).all():  # NaN has no rank: no AUC
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts  # 0-based rank where each distinct score starts
    avg_rank = first + (counts + 1) / 2.0  # 1-based average rank of a tie group
    rank_sum = avg_rank[inverse][labels].sum()
    return float((rank_sum - pos * (pos + 1) / 2) / (pos * neg))


def click_metrics(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Log loss, normalized cross-entropy (log loss / entropy of the base rate), AUC and
    accuracy at 0.5 of one set of predictions."""
    t_logits = torch.from_numpy(np.asarray(logits, dtype=np.float64))
    t_labels = torch.from_numpy(np.asarray(labels, dtype=np.float64))
    logloss = float(F.binary_cross_entropy_with_logits(t_logits, t_labels))
    base = entropy(float(t_labels.mean())) if len(labels) else 0.0
    return {
        "logloss": logloss,
        "nce": logloss / base if base > 0 else float("nan"),
        "auc": roc_auc(logits, labels),
        "accuracy": float(((t_logits > 0) == (t_labels > 0.5)).double().mean()),
    }


class DLRMTask:
    """Click prediction over a preprocessed Criteo table.

    ``loss`` returns the batch's summed BCE and its row count (exact data-parallel
    averaging). ``evaluate`` scores this rank's share of each eval split, gathers the
    predictions of all ranks (AUC is not a sum) and returns every metric as a pair the
    trainer reduces, with each compressed table's compression (dense rows x dim over its
    live parameters)."""

    def __init__(
        self,
        model: DLRMConfig,
        data: CriteoData,
        train_iter: RowBatches,
        *,
        eval_splits: tuple[str, ...] = ("val",),
        eval_rows: int | None = None,
        eval_batch_size: int = 16384,
        plans: C.LayerPlans | None = None,
        sparse: bool = False,
        device: str = "cpu",
    ) -> None:
        self.model, self.data, self.train_iter = model, data, train_iter
        self.eval_splits, self.eval_rows, self.eval_batch_size = (
            eval_splits,
            eval_rows,
            eval_batch_size,
        )
        self.plans = plans or C.LayerPlans()
        self.sparse = sparse
        self.device = torch.device(device)
        self.specs = table_specs(model)

    def _logits(self, params: dict, state: dict, batch: dict) -> torch.Tensor:
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        return dlrm_logits(
            self.model,
            params,
            state,
            batch,
            plans=self.plans,
            sparse=self.sparse,
            specs=self.specs,
        ).float()

    def loss(
        self, params: dict, state: dict, batch: dict, *, train: bool = True
    ) -> tuple[torch.Tensor, int, dict]:
        logits = self._logits(params, state, batch)  # (B,)
        label = batch["label"].to(logits.device)
        loss_sum = F.binary_cross_entropy_with_logits(logits, label, reduction="sum")
        acc = ((logits > 0) == (label > 0.5)).float().mean()
        return loss_sum, len(label), {"accuracy": acc.detach()}

    def predict(self, params: dict, state: dict, lo: int, hi: int) -> np.ndarray:
        """Logits for rows ``[lo, hi)`` in order."""
        out = []
        with torch.no_grad():
            for start in range(lo, hi, self.eval_batch_size):
                rows = np.arange(start, min(start + self.eval_batch_size, hi))
                out.append(self._logits(params, state, rows_to_batch(self.data, rows)).cpu())
        return torch.cat(out).numpy() if out else np.zeros(0, dtype=np.float32)

    def evaluate(
        self, params: dict, state: dict, *, rank: int = 0, world: int = 1
    ) -> dict[str, tuple[float, float]]:
        out: dict[str, tuple[float, float]] = {}
        for split in self.eval_splits:
            lo, hi = self.data.splits[split]
            if self.eval_rows is not None:
                hi = min(hi, lo + self.eval_rows)
            a, b = lo + (hi - lo) * rank // world, lo + (hi - lo) * (rank + 1) // world
            logits = self.predict(params, state, a, b)
            labels = self.data.label[a:b].astype(np.float64)
            if world > 1:  # AUC needs every prediction: gather them on every rank
                parts: list = [None] * world
                dist.all_gather_object(parts, (logits, labels))
                logits = np.concatenate([p[0] for p in parts])
                labels = np.concatenate([p[1] for p in parts])
            for key, value in click_metrics(logits, labels).items():
                # identical on every rank: (value, 1) summed over ranks averages back
                out[f"{split}/{key}"] = (value, 1.0)
        for name, table in params["tables"].items():  # each compressed table's compression
            if "cores" in table:
                live = live_param_count(table, state["tables"][name])
                hot = params.get("hot", {}).get(name)
                live += hot["weight"].numel() if hot is not None else 0
                rows = self.model.cardinalities[self.model.names.index(name)]
                out[f"compression/{name}"] = (rows * self.model.emb_dim / max(live, 1), 1.0)
        return out
