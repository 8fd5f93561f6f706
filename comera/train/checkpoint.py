"""Checkpoints: the model written once, the data position written by every rank.

Layout of one checkpoint, ``RUN_DIR/checkpoints/step_00000100/``:

* ``rank00000.pt``: that rank's RNG streams (torch, CUDA, Python), tagged with the step;
* ``data_rank00000.json``: that rank's data iterator ``state_dict()`` (for
  :class:`loaders.TokenLoader` the loader's own per-rank state), tagged with the step;
* ``model.pt``: params, rank state, optimizer moments, stage controller, config: written by
  rank 0 after every rank has written its files, so its presence marks a complete
  checkpoint. Every file is written to a temp name, fsynced and renamed.

The newest ``keep`` complete checkpoints are kept. Loading checks that each rank file has
the model's step; a data state saved at another world size is handed whole to iterators that
can rescale (``rescalable = True``, e.g. ``TokenLoader``: any N -> M) and refused otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

__all__ = [
    "CheckpointError",
    "checkpoint_dir",
    "complete_checkpoints",
    "load_checkpoint",
    "read_rank_files",
    "write_model",
    "write_rank_files",
]

CHECKPOINTS = "checkpoints"
MODEL = "model.pt"
DATA_FORMAT = "comera.data_state"
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, incomplete or from an incompatible run."""


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step_{step:08d}"


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_rank_files(directory: Path, step: int, rank: int, world: int, rng: dict, data: dict):
    """This rank's RNG and data position (no communication)."""
    directory.mkdir(parents=True, exist_ok=True)
    tag = {"step": step, "rank": rank, "world_size": world}
    _atomic(directory / f"rank{rank:05d}.pt", lambda p: torch.save({**tag, "rng": rng}, p))
    text = json.dumps({"format": DATA_FORMAT, "version": 1, **tag, "state": data})
    _atomic(directory / f"data_rank{rank:05d}.json", lambda p: p.write_text(text))


def write_model(directory: Path, payload: dict, keep: int) -> Path:
    """Rank 0, after every rank's files: the model file, then drop old checkpoints."""
    path = directory / MODEL
    _atomic(path, lambda p: torch.save(payload, p))
    root = directory.parent
    for old in complete_checkpoints(root.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for d in root.iterdir():  # debris of a save that died before its model file
        m = _STEP_RE.match(d.name)
        if m and d != directory and not (d / MODEL).is_file():
            shutil.rmtree(d, ignore_errors=True)
    return path


def complete_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), d)
        for d in root.iterdir()
        if (m := _STEP_RE.match(d.name)) and (d / MODEL).is_file()
    ]
    return [d for _, d in sorted(found)]


def _read_model(directory: Path) -> dict:
    try:
        ckpt = torch.load(directory / MODEL, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a corrupt file
        raise CheckpointError(f"cannot read checkpoint {directory / MODEL}: {e}") from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != "comera.checkpoint":
        raise CheckpointError(f"{directory / MODEL} is not a comera training checkpoint")
    return ckpt


def load_checkpoint(run_dir: str | os.PathLike) -> dict:
    """The newest complete checkpoint's model payload (``["dir"]`` is its folder).

    A newest checkpoint that cannot be read is reported with the previous one named, never
    skipped silently and never deleted."""
    found = complete_checkpoints(run_dir)
    if not found:
        raise CheckpointError(
            f"no checkpoint in {Path(run_dir) / CHECKPOINTS}; --resume takes a run dir "
            "written by an earlier run"
        )
    try:
        ckpt = _read_model(found[-1])
    except CheckpointError as e:
        if len(found) < 2:
            raise CheckpointError(f"{e}; there is no earlier checkpoint to fall back on") from e
        raise CheckpointError(
            f"{e}. The previous checkpoint is {found[-2]}: move {found[-1]} away and "
            "--resume again to continue from it"
        ) from e
    ckpt["dir"] = str(found[-1])
    return ckpt


def read_rank_files(directory: Path, step: int) -> tuple[list[dict], list[dict]]:
    """Every saved rank's (RNG, data state), checked complete and tagged with ``step``."""
    data_files = sorted(directory.glob("data_rank*.json"))
    if not data_files:
        raise CheckpointError(f"{directory} holds no data_rank*.json; the checkpoint is partial")
    datas = []
    for p in data_files:
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"data state {p} is unreadable: {e}") from e
        if d.get("format") != DATA_FORMAT:
            raise CheckpointError(f"{p} is not a {DATA_FORMAT} file")
        datas.append(d)
    datas.sort(key=lambda d: d["rank"])
    world = datas[0]["world_size"]
    if sorted(d["rank"] for d in datas) != list(range(world)):
        raise CheckpointError(
            f"{directory} holds data states of ranks {sorted(d['rank'] for d in datas)} "
            f"but was saved by {world} ranks; the checkpoint is partial"
        )
    rngs = []
    for d in datas:
        p = directory / f"rank{d['rank']:05d}.pt"
        try:
            r = torch.load(p, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"rank file {p} is unreadable: {e}") from e
        for what, tagged in (("data state", d["step"]), ("RNG state", r["step"])):
            if tagged != step:
                raise CheckpointError(
                    f"{what} of rank {d['rank']} in {directory} is from step {tagged} but "
                    f"the model checkpoint is from step {step}; the checkpoint is "
                    "inconsistent: resume from an earlier one"
                )
        rngs.append(r["rng"])
    return rngs, datas
