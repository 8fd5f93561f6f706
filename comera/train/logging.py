"""Run records: ``metrics.jsonl``, wandb, ``ranks.json``; only rank 0 writes.

wandb behaves as users expect: the mode comes from ``TrainConfig.wandb`` when set, else from
``WANDB_MODE``, else ``offline``; without the wandb package the run says so in one line and
logs to ``metrics.jsonl`` alone. The run id is kept in ``RUN_DIR/wandb_run_id`` so a resumed
run continues the same wandb run instead of starting a new one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import uuid
from pathlib import Path

from comera.errors import ConfigError, first_line
from comera.train.config import WANDB_MODES, TrainConfig

__all__ = [
    "RunLog",
    "read_metrics",
    "resolve_wandb_mode",
    "truncate_metrics",
    "write_json_atomic",
    "write_rank_snapshot",
]

WANDB_ID = "wandb_run_id"
_ENV_MODES = {"run": "online", "dryrun": "offline"}  # wandb's older spellings


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Rows of a metrics file; a line cut short by a killed process is skipped."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def truncate_metrics(path: Path, step: int) -> None:
    """Drop rows logged after ``step`` by a run that died after its last checkpoint, so a
    resumed run's rows are not doubled."""
    if not path.is_file():
        return
    keep = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    _replace_text(path, "".join(json.dumps(r) + "\n" for r in keep))


def write_rank_snapshot(
    run_dir: Path,
    label: str,
    step: int,
    ranks: dict,
    live_params: int,
    extra: dict | None = None,
) -> None:
    """Per-layer, per-bond live ranks at a stage point (``init``, ``end_of_early``,
    ``end``) in ``RUN_DIR/ranks.json``: the rank table of the report. ``extra`` adds
    fields (the late stage's size target and how it was met, at ``end``)."""
    path = Path(run_dir) / "ranks.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[label] = {"step": step, "ranks": ranks, "live_params": live_params, **(extra or {})}
    write_json_atomic(path, data)


def write_json_atomic(path: Path, data: object) -> None:
    _replace_text(path, json.dumps(data, indent=1, default=str))


def _replace_text(path: Path, text: str) -> None:
    """Write ``text`` beside ``path`` and rename it over: readers never see half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def resolve_wandb_mode(flag: str | None) -> tuple[str, str | None]:
    """(mode, a note for the user or None): the flag, else ``WANDB_MODE``, else offline;
    ``disabled`` when the wandb package is missing."""
    mode = flag
    if mode is None:
        env = os.environ.get("WANDB_MODE", "").strip().lower()
        mode = _ENV_MODES.get(env, env) if env else "offline"
        if mode not in WANDB_MODES:
            return "offline", f"WANDB_MODE={env!r} is not one of {WANDB_MODES}; using offline"
    if mode != "disabled" and importlib.util.find_spec("wandb") is None:
        return "disabled", "wandb is not installed: logging to metrics.jsonl only"
    return mode, None


class RunLog:
    """``metrics.jsonl`` plus an optional wandb run (rank 0 only)."""

    def __init__(self, cfg: TrainConfig, rank: int, config: dict, *, resume: bool) -> None:
        self.rank = rank
        self.run_dir = Path(cfg.run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.wandb = None
        if rank != 0:
            return
        mode, note = resolve_wandb_mode(cfg.wandb)
        if note:
            print(f"comera: {note}", file=sys.stderr)
        if mode == "disabled":
            return
        import wandb  # lazily: runs without wandb never import it

        id_path = self.run_dir / WANDB_ID
        # only a resume continues the recorded wandb run: a fresh one (a restart of a run
        # that stopped before its first checkpoint) is a new run, not the stopped one's
        run_id = id_path.read_text().strip() if resume and id_path.is_file() else None
        if not run_id:
            run_id = uuid.uuid4().hex[:8]  # wandb's id alphabet: lowercase letters, digits
            id_path.write_text(run_id + "\n")
        try:
            self.wandb = wandb.init(
                project=cfg.wandb_project,
                entity=cfg.wandb_entity,
                group=cfg.wandb_group,
                tags=list(cfg.wandb_tags) or None,
                name=cfg.run_name,
                dir=str(self.run_dir),
                mode=mode,
                id=run_id,
                resume="allow" if resume else None,
                config=config,
            )
        except wandb.errors.Error as e:  # no API key, a refused login, an unknown entity
            raise ConfigError(
                f"wandb={mode!r}: wandb could not start ({first_line(e)}); log in (wandb login, or "
                f"WANDB_API_KEY) or use --wandb offline, and go on with --resume {self.run_dir}"
            ) from None

    def log(self, row: dict) -> None:
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def update_config(self, changes: dict) -> None:
        """Add ``changes`` to the wandb run's config (the plans a run chose, say)."""
        if self.wandb is not None:
            self.wandb.config.update(changes, allow_val_change=True)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
