"""The masked-LM task for the shared trainer, fed by ``loaders.TokenLoader``."""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F

import comera as C
from experiments.codebert.masking import mask_tokens
from experiments.codebert.model import mlm_logits
from experiments.transformer import EncoderConfig

__all__ = ["MLMTask"]


class MLMTask:
    """Masked-LM over packed rows: ``loss`` masks each batch afresh (torch's global RNG,
    checkpointed per rank by the trainer) and returns the summed cross-entropy over masked
    tokens and their count, so data-parallel averaging is exact over tokens.

    ``eval_batches`` are fixed held-out batches, masked once with a seeded generator;
    rank ``r`` of ``w`` scores batches ``r, r + w, ...``."""

    def __init__(
        self,
        model: EncoderConfig,
        train_iter: object,
        eval_batches: list[dict[str, torch.Tensor]],
        *,
        mask_id: int,
        special_ids: tuple[int, ...],
        plans: C.LayerPlans | None = None,
        device: str = "cpu",
    ) -> None:
        self.model, self.train_iter, self.eval_batches = model, train_iter, eval_batches
        self.mask_id, self.special_ids = mask_id, special_ids
        self.plans = plans or C.LayerPlans()
        self.device = torch.device(device)

    @property
    def eval_data_id(self) -> dict[str, str]:
        """A digest of the held-out batches (tokens, masks, labels), kept in checkpoints: a
        resume whose held-out files or tokenizer changed is refused, not scored anew."""
        if not self.eval_batches:
            return {}
        h = hashlib.blake2b(digest_size=8)
        for batch in self.eval_batches:
            for key in sorted(batch):
                h.update(key.encode())
                h.update(batch[key].cpu().contiguous().numpy().tobytes())
        return {"heldout": h.hexdigest()}

    def batch_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Input tokens of a batch (padding excluded): the trainer's ``tokens_per_s``."""
        return int((batch["segment_ids"] > 0).sum())

    def derive_eval(self, metrics: dict[str, float]) -> dict[str, float]:
        """Held-out perplexity: ``exp`` of the mean masked-token loss (nats)."""
        return {"heldout/perplexity": math.exp(min(metrics["heldout/loss"], 50.0))}

    def mask(
        self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        ids, seg = batch["input_ids"], batch["segment_ids"]
        inputs, labels = mask_tokens(
            ids, seg, mask_id=self.mask_id, vocab_size=self.model.vocab_size,
            special_ids=self.special_ids, generator=generator,
        )  # fmt: skip
        return {"input_ids": inputs, "segment_ids": seg, "labels": labels}

    def _loss(self, params: dict, state: dict, batch: dict, train: bool) -> tuple:
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        logits, target = mlm_logits(params, state, batch, self.model, train=train,
                                    plans=self.plans)  # fmt: skip
        logits = logits.float()
        loss_sum = F.cross_entropy(logits, target, reduction="sum")
        correct = (logits.argmax(-1) == target).sum()
        return loss_sum, len(target), correct

    def loss(
        self, params: dict, state: dict, batch: dict, *, train: bool = True
    ) -> tuple[torch.Tensor, int, dict]:
        loss_sum, n, correct = self._loss(params, state, self.mask(batch), train)
        return loss_sum, n, {"accuracy": (correct / max(n, 1)).detach()}

    def evaluate(
        self, params: dict, state: dict, *, rank: int = 0, world: int = 1
    ) -> dict[str, tuple[float, float]]:
        total, count, correct = 0.0, 0.0, 0.0
        for batch in self.eval_batches[rank::world]:
            s, n, c = self._loss(params, state, batch, train=False)
            total, count, correct = total + float(s), count + n, correct + float(c)
        return {"heldout/loss": (total, count), "heldout/accuracy": (correct, count)}
