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

import contextlib
import json
import math
import os
import random
import re
import shutil
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_flatten_with_path, tree_map

from comera.errors import CheckpointError, DataError
from comera.train.galore import GaLore
from comera.train.logging import (
    WANDB_ID,
    check_metrics,
    check_rank_snapshots,
    read_run_id,
    resolve_wandb_mode,
    truncate_metrics,
)
from comera.train.task import replicated_by_name
from comera.tree import iter_tt

__all__ = [
    "CheckpointError",
    "check_crc",
    "checkpoint_dir",
    "complete_checkpoints",
    "data_position_text",
    "load_checkpoint",
    "read_rank_files",
    "restore_trainer",
    "rng_state",
    "save_trainer",
    "set_rng_state",
    "write_model",
    "write_rank_files",
]

CHECKPOINTS = "checkpoints"
MODEL = "model.pt"
DATA_FORMAT = "comera.data_state"
_STEP_RE = re.compile(r"^step_(\d+)$")
_DATA_RE = re.compile(r"^data_rank(\d+)\.json$")


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step_{step:08d}"


def _step_of(folder: Path) -> int | None:
    """The step a checkpoint folder's name says, for the names the trainer writes only
    (``step_00000030``): a copy named ``step_030`` beside it was read as step 30 and
    counted newest, and a stale ``step_99999999`` made every save delete the one before."""
    m = _STEP_RE.match(folder.name)
    return int(m.group(1)) if m and folder.name == f"step_{int(m.group(1)):08d}" else None


def _atomic(path: Path, write) -> None:
    """``write(f)`` into a temp file beside ``path``, fsynced, then renamed over it. A
    failed write (a full disk) removes the temp file and raises the ``OSError``: through a
    Python file, torch.save's own errors (``RuntimeError: unexpected pos``) name it."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def write_rank_files(directory: Path, step: int, rank: int, world: int, rng: dict, data: dict):
    """This rank's RNG and data position (no communication)."""
    tag = {"step": step, "rank": rank, "world_size": world}
    text = data_position_text({"format": DATA_FORMAT, "version": 1, **tag, "state": data})
    directory.mkdir(parents=True, exist_ok=True)
    _atomic(directory / f"rank{rank:05d}.pt", lambda f: torch.save({**tag, "rng": rng}, f))
    _atomic(directory / f"data_rank{rank:05d}.json", lambda f: f.write(text.encode()))


def data_position_text(record: dict) -> str:
    """``record`` (a data position: ``train_iter.state_dict()``'s) as JSON text, or a
    :class:`~comera.errors.DataError` saying it must be JSON data: a tensor or generator
    state in it failed at the first checkpoint, after that much training. numpy numbers
    and arrays are saved as plain ones: a position that became numpy once iteration began
    passed the check at the start of ``fit`` and failed at the first checkpoint."""

    def plain(value: object) -> object:
        import numpy as np

        if isinstance(value, np.generic | np.ndarray):
            return value.tolist()
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")

    try:
        return json.dumps(record, default=plain)
    except (TypeError, ValueError) as e:
        raise DataError(
            f"train_iter.state_dict() must return JSON data (dicts, lists, strings, "
            f"numbers, bools, None) for checkpoints to hold it: {e}; convert it (e.g. a "
            "tensor with .tolist())"
        ) from None


def write_model(directory: Path, payload: dict, keep: int) -> Path:
    """Rank 0, after every rank's files: the model file, then drop old checkpoints."""
    path = directory / MODEL
    _atomic(path, lambda f: torch.save(payload, f))
    root = directory.parent
    for old in complete_checkpoints(root.parent)[:-keep]:
        if old != directory:  # never the one just written, whatever else the folder holds
            if old.is_symlink():  # another run's checkpoint linked in: drop the link only
                old.unlink(missing_ok=True)  # (deleting through it emptied that run's)
                continue
            # the model file first: a delete killed half-way leaves a folder that no longer
            # counts as complete, not one that does and lacks its rank files
            try:
                (old / MODEL).unlink(missing_ok=True)
            except OSError:  # kept read-only (or busy): it stays whole, as it was
                continue
            shutil.rmtree(old, ignore_errors=True)
    for d in root.iterdir():  # debris of a save that died before its model file
        if (
            _step_of(d) is not None
            and d != directory
            and not d.is_symlink()
            and not (d / MODEL).is_file()
        ):
            shutil.rmtree(d, ignore_errors=True)
    return path


def complete_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [
        (step, d)
        for d in root.iterdir()
        if (step := _step_of(d)) is not None and (d / MODEL).is_file()
    ]
    return [d for _, d in sorted(found)]


# what set_rng_state reads of a rank file's RNG state
_RNG_KEYS = {"torch", "cuda", "python"}

# what restore_trainer reads of every model file (version 2; world_size and eval_data are
# newer and optional)
_MODEL_KEYS = ("step", "config", "params", "state", "opt", "stages", "initial_size")


def check_crc(path: Path) -> None:
    """Refuse a torch.save file whose bytes changed since it was written (a bit flipped on
    disk, a bad copy): torch.load reads a damaged tensor's bytes as they are, and a resume
    trained on from corrupted weights. The zip archive torch writes keeps a CRC per entry;
    reading them costs one more pass over the file. A file in torch's legacy (non-zip)
    format is left to torch.load."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):  # torch.load says what is wrong with it
        return
    with archive:
        for entry in archive.infolist():
            # 0: written without one (torch.utils.serialization.config.save.compute_crc32
            # = False), which testzip read as a mismatch
            if entry.CRC == 0 or entry.is_dir():
                continue
            try:
                with archive.open(entry) as f:  # checks the CRC at the entry's end
                    while f.read(1 << 24):
                        pass
            except zipfile.BadZipFile as e:
                raise CheckpointError(f"{path} is damaged: its entry {entry.filename} "
                                      f"fails its check ({e})") from None  # fmt: skip


def _read_model(directory: Path) -> dict:
    try:
        check_crc(directory / MODEL)
        ckpt = torch.load(directory / MODEL, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a corrupt file
        raise CheckpointError(f"cannot read checkpoint {directory / MODEL}: {e}") from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != "comera.checkpoint":
        raise CheckpointError(f"{directory / MODEL} is not a comera training checkpoint")
    missing = [k for k in _MODEL_KEYS if k not in ckpt]
    if missing or not isinstance(ckpt["config"], dict) or not isinstance(ckpt["opt"], dict):
        raise CheckpointError(
            f"{directory / MODEL} lacks {', '.join(missing) or 'a readable config or opt'}; "
            "the checkpoint is damaged"
        )
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
    if ckpt["step"] != _step_of(found[-1]):  # a folder renamed or copied over another
        back = (f"; the previous checkpoint is {found[-2]}: move {found[-1]} away to go on "
                "from it" if len(found) > 1 else "")  # fmt: skip
        raise CheckpointError(
            f"{found[-1] / MODEL} holds step {ckpt['step']}, not the step its folder's name "
            f"says{back}"
        )
    ckpt["dir"] = str(found[-1])
    ckpt["previous"] = str(found[-2]) if len(found) > 1 else None
    return ckpt


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_rank_files(
    directory: Path, step: int, world: int | None = None
) -> tuple[list[dict], list[dict]]:
    """Every saved rank's (RNG, data state), checked complete and tagged with ``step``.

    ``world`` (the model file's world size) limits the read to ranks ``0..world-1``, so
    files left by an older save at a larger world size are ignored."""
    # by exact name: a file manager's "data_rank00000 (copy).json" is not a rank's
    named = [(int(m.group(1)), p) for p in sorted(directory.glob("data_rank*.json"))
             if (m := _DATA_RE.match(p.name))]  # fmt: skip
    data_files = [p for r, p in named if world is None or r < world]
    if not data_files:
        raise CheckpointError(f"{directory} holds no data_rank*.json; the checkpoint is partial")
    datas = []
    for p in data_files:
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"data state {p} is unreadable: {e}") from e
        if not isinstance(d, dict) or d.get("format") != DATA_FORMAT:
            raise CheckpointError(f"{p} is not a {DATA_FORMAT} file")
        if not all(_is_index(d.get(k)) for k in ("rank", "world_size", "step")):
            raise CheckpointError(f"{p} lacks its rank, world_size or step; the checkpoint is "
                                  "damaged: resume from an earlier one")  # fmt: skip
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
            check_crc(p)
            r = torch.load(p, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"rank file {p} is unreadable: {e}") from e
        rng = r.get("rng") if isinstance(r, dict) else None
        if not isinstance(rng, dict) or "step" not in r or not _RNG_KEYS <= rng.keys():
            raise CheckpointError(f"rank file {p} lacks its step or RNG state; the checkpoint "
                                  "is damaged: resume from an earlier one")  # fmt: skip
        for what, tagged in (("data state", d["step"]), ("RNG state", r["step"])):
            if tagged != step:
                raise CheckpointError(
                    f"{what} of rank {d['rank']} in {directory} is from step {tagged} but "
                    f"the model checkpoint is from step {step}; the checkpoint is "
                    "inconsistent: resume from an earlier one"
                )
        rngs.append(r["rng"])
    return rngs, datas


# ----------------------------------------------------------------------------- a trainer


def rng_state(device: torch.device) -> dict:
    """This process's random streams that a train step draws from: Python's, torch's CPU
    generator and ``device``'s CUDA generator (None on the CPU)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"torch": torch.get_rng_state(), "cuda": cuda, "python": random.getstate()}


def set_rng_state(state: dict, device: torch.device) -> None:
    """Put back what :func:`rng_state` took."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    random.setstate(state["python"])


def save_trainer(tr: Any) -> Path:
    """Checkpoint a :class:`~comera.train.Trainer`: every rank its RNG and data position,
    then (after a barrier) rank 0 the model, optimizer and stage controller."""
    d = checkpoint_dir(tr.run_dir, tr.step)
    it = tr.task.train_iter
    data = None  # an iterator that cannot restore a position saves none (warned once)
    if hasattr(it, "state_dict") and hasattr(it, "load_state_dict"):
        data = it.state_dict()
    elif not getattr(tr, "_warned_no_position", False):
        tr._warned_no_position = True
        warnings.warn(
            f"train_iter ({type(it).__name__}) has no state_dict/load_state_dict: "
            "checkpoints cannot hold its position, so a resume restarts it from its "
            "beginning (not exact); give it both methods for an exact resume",
            stacklevel=3,
        )
    try:
        _save_files(tr, d, data)
    except OSError as e:  # a full disk, a folder made read-only: the saved ones stay
        done = [c for c in complete_checkpoints(tr.run_dir) if c != d]
        last = (
            f"the last complete checkpoint is {done[-1]}"
            if done
            else "no checkpoint is complete yet"
        )
        raise CheckpointError(
            f"cannot write checkpoint {d} ({e.strerror or e}); {last}: free space or make the "
            f"folder writable, then --resume {tr.run_dir}"
        ) from e
    return d


def _save_files(tr: Any, d: Path, data: object) -> None:
    """:func:`save_trainer`'s writes: every rank's files, then (after a barrier) rank 0's
    model file."""
    write_rank_files(d, tr.step, tr.rank, tr.world, rng_state(tr.device), data)
    if tr.world > 1:
        dist.barrier()
    if tr.rank == 0:
        cpu = lambda tree: tree_map(lambda t: t.detach().cpu(), tree)  # noqa: E731
        payload = {
            "format": "comera.checkpoint",
            "version": 2,
            "step": tr.step,
            "stages": tr.stages.state_dict(),
            "initial_size": tr.initial_size,
            "params": cpu(tr.params),
            "state": cpu(tr.state),
            "opt": {k: cpu(v) if k in ("m", "v") else v for k, v in tr.opt.items()}
            | ({"galore": tr.galore.state_dict()} if tr.galore is not None else {}),
            "world_size": tr.world,
            "config": tr.config_dict,
            "eval_data": eval_data_id(tr.task),
            "replicated": replicated_fingerprints(tr),
        }
        write_model(d, payload, tr.cfg.keep_checkpoints)


_SAMPLES = 64  # |x| at this many positions of each replicated tensor
_BLOCKS = 1024  # sum |x| over this many contiguous blocks of each
_CLOSE = 1e-3  # relative: another build's rounding passes, other weights do not


def _values(t: torch.Tensor) -> torch.Tensor | None:
    """A tensor's values, flat (a sparse one's stored values; a complex one's moduli);
    None where none can be read (a meta or quantized tensor)."""
    try:
        x = t.detach()
        if x.is_sparse:
            x = x.coalesce().values()
        elif x.layout != torch.strided:
            x = x.to_dense()
        x = x.reshape(-1)
        return x.abs() if x.is_complex() else x
    except (RuntimeError, NotImplementedError):
        return None


def _fingerprint(t: torch.Tensor, picks: list[int] | None = None) -> dict:
    """A replicated tensor's dtype and shape, its rms, ``sum |x|`` over 1024 contiguous
    blocks (a changed row of a frozen embedding moves its block), its nonzero count and
    ``|x|`` at ``picks`` (64 seeded positions unless given: a saved fingerprint's, so a
    resume reads the same ones): what tells other weights (another seed, another file)
    from the same ones built again. Magnitudes, not signs or bytes: a TT-SVD at another
    thread count or on another device differs in the last bits and in its cores' signs
    (so a tensor negated whole is taken as the same). One whose values cannot be read
    keeps only its dtype and shape."""
    out: dict = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    x = _values(t)
    if x is None or x.numel() == 0:
        return out
    n = x.numel()
    if picks is None:
        gen = torch.Generator().manual_seed(0)
        picks = torch.randint(n, (_SAMPLES,), generator=gen).tolist()
    if any(not 0 <= i < n for i in picks):  # another size: the shapes already differ
        return out
    # float64 sums: a float64 tensor's values past float32's range stay finite
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        y = x if x.is_floating_point() else x.to(wide)
        out["rms"] = float(torch.linalg.vector_norm(y, dtype=wide)) / math.sqrt(n)
        out["blocks"] = _block_sums(y, wide)
        out["nonzero"] = int(torch.count_nonzero(x))
        taken = x[torch.tensor(picks, device=x.device)]  # indexed first: 64 values copied
        out["abs"] = taken.double().abs().cpu().tolist()
    out["picks"] = picks
    return out


def _block_sums(y: torch.Tensor, wide: torch.dtype) -> list[float]:
    """``sum |y|`` over ``min(1024, n)`` contiguous blocks (the last takes the rest), as
    norms: no copy of the tensor is made."""
    n = y.numel()
    b = min(_BLOCKS, n)
    size = n // b
    head = torch.linalg.vector_norm(y[: b * size].reshape(b, size), ord=1, dim=1, dtype=wide)
    sums = head.double().cpu().tolist()
    if b * size < n:
        sums[-1] += float(torch.linalg.vector_norm(y[b * size :], ord=1, dtype=wide))
    return sums


def _alike(a: dict, b: dict) -> str | None:
    """Why two fingerprints are not of the same tensor, up to rounding (None: alike)."""
    if a.get("dtype") != b.get("dtype"):
        return f"dtype {a.get('dtype')} saved, {b.get('dtype')} now"
    if a.get("shape") != b.get("shape"):
        return f"shape {a.get('shape')} saved, {b.get('shape')} now"
    keys = ("rms", "blocks", "nonzero", "abs")
    if any(k not in a or k not in b for k in keys):  # one side unreadable: as can be told
        return None
    if len(a["abs"]) != len(b["abs"]) or len(a["blocks"]) != len(b["blocks"]):
        return "values"
    finite = [r for r in (a["rms"], b["rms"]) if math.isfinite(r)]
    tol = _CLOSE * max(finite, default=0.0)  # NaN or inf held: the rest compared exactly

    def same(x: float, y: float, scale: float) -> bool:  # NaN matches NaN
        if math.isnan(x) or math.isnan(y):
            return math.isnan(x) and math.isnan(y)
        return x == y or abs(x - y) <= scale

    # a few entries exactly zero in one build and not in another: rounding, not weights
    count = max(1.0, _CLOSE * max(a["nonzero"], b["nonzero"]))
    # a block's own sum, or a typical block's where it is small (blocks of a few entries
    # near zero differ by more than 1e-3 of themselves between builds)
    typical = max((sum(v) / len(v) for v in (a["blocks"], b["blocks"])
                   if v and math.isfinite(sum(v))), default=0.0)  # fmt: skip
    ok = (same(a["rms"], b["rms"], tol) and same(a["nonzero"], b["nonzero"], count)
          and all(same(x, y, tol) for x, y in zip(a["abs"], b["abs"], strict=True))
          and all(same(x, y, _CLOSE * max(abs(x), abs(y), typical))
                  for x, y in zip(a["blocks"], b["blocks"], strict=True)))  # fmt: skip
    return None if ok else "values"


def _replicated(tr: Any) -> dict[str, torch.Tensor]:
    """The tensors the task holds outside params and state (``replicated_tensors()``: a
    ``ModuleTask``'s frozen parameters) by name (:func:`replicated_by_name`); as the
    task's ``replicated_named()`` gives them where it has one (a ``ModuleTask``: a frozen
    TT layer as its output on fixed probes, not its cores)."""
    named = getattr(tr.task, "replicated_named", None)
    return dict(named()) if named is not None else replicated_by_name(tr.task)


def replicated_fingerprints(tr: Any) -> dict[str, dict]:
    """Fingerprints (:func:`_fingerprint`) of the task's replicated tensors. A checkpoint
    does not hold those tensors (a frozen backbone would double it), only these, so a
    resume onto other ones is refused. Each is taken again only when its tensor changed
    (frozen ones do not: a save reads a large backbone once per run)."""
    cache = tr.__dict__.setdefault("_fingerprints", {})
    out = {}
    for name, t in _replicated(tr).items():
        if not isinstance(t, torch.nn.Parameter):  # a probe's output, made anew: a key on
            out[name] = _fingerprint(t)  # its address could match a freed one's
            continue
        key = (id(t), t.data_ptr() if t.layout == torch.strided else 0, t._version)
        held = cache.get(name)
        if held is None or held[0] != key:
            held = cache[name] = (key, _fingerprint(t))
        out[name] = held[1]
    return out


def check_replicated(tr: Any, saved: object) -> None:
    """Refuse a resume whose task holds other replicated tensors (a ``ModuleTask``'s
    frozen parameters) than the run was saved with (``saved``: the checkpoint's
    fingerprints; None for a checkpoint written before they were recorded, and an entry
    of another form is not checked): a model rebuilt from another seed or backbone file
    went on training from another model without a word. Call it once every rank holds
    rank 0's tensors."""
    if not isinstance(saved, dict):
        return
    held = _replicated(tr)
    differ: dict[str, str] = {}
    for name in dict.fromkeys([*saved, *held]):
        was, t = saved.get(name), held.get(name)
        if was is None or t is None:  # a tensor only one side holds
            differ[name] = "saved only" if t is None else "not saved"
        elif isinstance(was, dict):  # (a string, an earlier build's digest: not checked)
            picks = was.get("picks")
            ok = isinstance(picks, list) and all(isinstance(i, int) for i in picks)
            why = _alike(was, _fingerprint(t, picks if ok else None))
            if why is not None:
                differ[name] = why
    if differ:
        more = f" (+{len(differ) - 4} more)" if len(differ) > 4 else ""
        shown = ", ".join(f"{n} ({why})" for n, why in list(differ.items())[:4])
        raise CheckpointError(
            f"checkpoint in {tr.run_dir} was trained with other frozen tensors than this run "
            f"built (a checkpoint holds only what trains; these differ: {shown}{more}); "
            "rebuild the model as it was (the same weights file, seed, dtype and frozen "
            "layers) to resume it"
        )


# TrainConfig fields a resume may change: where it runs, how it reports, how often it
# evaluates and saves; never what a step computes
RESUME_MAY_CHANGE = frozenset({
    "run_dir", "device", "cpu_malloc", "step_mode", "wandb", "wandb_project", "wandb_entity",
    "wandb_group", "wandb_tags", "run_name", "progress", "log_every", "eval_every",
    "checkpoint_every", "keep_checkpoints",
})  # fmt: skip


def _flat(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        out: dict[str, object] = {}
        for k, v in tree.items():
            out |= _flat(v, f"{prefix}{k}.")
        return out
    return {prefix[:-1]: tree}


def _unread(cfg: dict) -> tuple[str, ...]:
    """Sections of a :class:`TrainConfig` dict its run never reads: the other optimizers'
    settings, and CoMERA's when it is off."""
    optimizer = cfg.get("optimizer", "adamw")
    out = {"adamw": ("sgd.", "galore."), "sgd": ("optim.", "galore."),
           "galore": ("sgd.",)}.get(optimizer, ())  # fmt: skip
    comera = cfg.get("comera", {})
    if isinstance(comera, dict) and comera.get("enabled") is False:
        out += tuple(f"comera.{k}" for k in comera if k != "enabled")
    return out


def config_changes(saved: dict, now: dict) -> list[str]:
    """``train.KEY: saved X, now Y`` for every training setting the two configs (as
    :class:`TrainConfig` dicts) give different values, leaving out
    :data:`RESUME_MAY_CHANGE`, settings the run never reads (another optimizer's, CoMERA's
    when it is off) and keys only one has (a field added or dropped since)."""
    a = _flat(json.loads(json.dumps(saved, default=str)))
    b = _flat(json.loads(json.dumps(now, default=str)))
    unread = _unread(now)
    return [f"train.{k}: saved {a[k]!r}, now {b[k]!r}" for k in sorted(a.keys() & b.keys())
            if k.split(".")[0] not in RESUME_MAY_CHANGE and not k.startswith(unread)
            and a[k] != b[k]]  # fmt: skip


def _shapes(tree: object) -> dict[str, tuple[object, str]]:
    """Per leaf of a params tree (by dotted path): what a resume must keep (a TT/TTM
    layer's modes per core, as compaction changes its ranks; every other leaf's shape),
    and the TT layer it belongs to (its own path for any other leaf)."""
    kept: dict[int, object] = {}
    owner: dict[int, str] = {}
    for path, p, _ in iter_tt(tree):
        for c in p["cores"]:
            kept[id(c)] = ("modes", tuple(c.shape[1:-1]))
        for g in p["gates"]:
            kept[id(g)] = "gate"
        for t in tree_flatten(p)[0]:  # cores, gates and bias: named by the layer
            owner[id(t)] = path
    out: dict[str, tuple[object, str]] = {}
    for path, t in tree_flatten_with_path(tree)[0]:
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        out[name] = (kept.get(id(t)) or tuple(getattr(t, "shape", ())), owner.get(id(t), name))
    return out


def check_same_run(tr: Any, ckpt: dict) -> None:
    """Refuse a checkpoint of another training config or model: its params would replace
    the model built for this run without a word (a model of other modes then failed at
    the first step, with a traceback), and a changed objective or schedule would train on
    silently, e.g. after a config.json edited by hand lost its CoMERA settings."""
    changes = config_changes(ckpt["config"].get("train", {}), tr.config_dict["train"])
    if changes:
        more = f" (+{len(changes) - 4} more)" if len(changes) > 4 else ""
        raise CheckpointError(
            f"checkpoint in {ckpt['dir']} was written with other training settings: "
            f"{'; '.join(changes[:4])}{more}; resume with the config it was saved with"
        )
    saved, built = _shapes(ckpt["params"]), _shapes(tr.params)
    only_saved = list(dict.fromkeys(o for k, (_, o) in saved.items() if k not in built))
    only_built = list(dict.fromkeys(o for k, (_, o) in built.items() if k not in saved))
    if only_saved or only_built:
        # a layer in both whose tensors differ (another number of cores) is named as such,
        # not as a layer saved only
        in_saved, in_built = {o for _, o in saved.values()}, {o for _, o in built.values()}
        both = [
            o for o in dict.fromkeys(only_saved + only_built) if o in in_saved and o in in_built
        ]
        parts = [f"{what}: {names[:6]}" for what, names in (
            ("saved only", [o for o in only_saved if o not in in_built]),
            ("built only", [o for o in only_built if o not in in_saved]),
            ("held as other tensors (another number of cores, or a bias added or dropped?)",
             both)) if names]  # fmt: skip
        raise CheckpointError(
            f"checkpoint in {ckpt['dir']} holds other parameters than this run builds "
            f"({'; '.join(parts)}); resume with the model settings (and trainable layers) it "
            "was saved with"
        )
    for k, (v, _) in saved.items():
        if built[k][0] != v:
            raise CheckpointError(
                f"checkpoint in {ckpt['dir']} holds a model of another shape than this run "
                f"builds ({k}: {v} saved, {built[k][0]} built); resume with the model "
                "settings it was saved with"
            )


def check_same_data(tr: Any, datas: list[dict]) -> None:
    """Let the run's ``train_iter`` refuse a saved position over other data, where it can
    tell (an optional ``check_data(state)``, given what its ``load_state_dict`` takes),
    before the model's shapes are compared: data that sizes the model (DLRM's tables)
    was refused as a model of other settings."""
    it = tr.task.train_iter
    check = getattr(it, "check_data", None)
    if check is None or any(d["state"] is None for d in datas):
        return
    if not getattr(it, "rescalable", False) and len(datas) != tr.world:
        return  # refused by the position's restore, naming the world sizes
    check(_saved_position(it, datas, tr.rank))


def _saved_position(it: Any, datas: list[dict], rank: int) -> Any:
    """What the saved data position is for ``it``: every saved rank's state for a
    rescalable iterator, at any world size (at an unchanged one too, since a TokenLoader
    whose worker count changed needs every rank's shards to re-cut them), else this
    rank's."""
    return [d["state"] for d in datas] if getattr(it, "rescalable", False) else (
        datas[rank]["state"])  # fmt: skip


def eval_data_id(task: Any) -> dict[str, str]:
    """The task's optional ``eval_data_id``: eval split name to a digest of its examples."""
    ids = getattr(task, "eval_data_id", None)
    ids = ids() if callable(ids) else ids
    return {str(k): str(v) for k, v in (ids or {}).items()}


def check_same_eval(tr: Any, ckpt: dict) -> None:
    """Refuse a resume whose eval split of a saved name holds other examples: its curve
    would join two eval sets under one name, and the run's final score would be of data
    its earlier points never saw. A split added or dropped is allowed (its name says so)."""
    saved, now = ckpt.get("eval_data") or {}, eval_data_id(tr.task)
    changed = sorted(k for k in saved.keys() & now.keys() if saved[k] != now[k])
    if changed:
        raise CheckpointError(
            f"checkpoint in {ckpt['dir']} was evaluated on other examples in eval split "
            f"{changed[0]!r} than this run reads ({saved[changed[0]]} saved, "
            f"{now[changed[0]]} now): restore the data it was evaluated on, or start a new "
            "run"
        )


@contextlib.contextmanager
def _naming_previous(ckpt: dict) -> Iterator[None]:
    """A :class:`CheckpointError` raised inside, with the way on where there is one: the
    previous checkpoint, as for an unreadable model file."""
    try:
        yield
    except CheckpointError as e:
        if not ckpt.get("previous"):
            raise
        raise CheckpointError(
            f"{e}. The previous checkpoint is {ckpt['previous']}: move {ckpt['dir']} away "
            "and --resume again to continue from it"
        ) from e


def _restore_position(tr: Any, ckpt: dict, datas: list[dict]) -> None:
    """Hand the saved data position to the run's ``train_iter`` (every saved rank's to a
    rescalable one, else this rank's); before anything else is restored."""
    it, saved_world = tr.task.train_iter, len(datas)
    if all(d["state"] is None for d in datas):  # saved by an iterator without a state_dict
        warnings.warn(
            f"{ckpt['dir']} holds no data position (its train_iter had no state_dict): the "
            "data restarts from its beginning, so this resume is not exact",
            stacklevel=4,
        )
    elif not hasattr(it, "load_state_dict"):
        raise CheckpointError(
            f"{ckpt['dir']} holds a data position, but this run's train_iter "
            f"({type(it).__name__}) has no load_state_dict to restore it; resume with the "
            "iterator the run was saved with"
        )
    elif not getattr(it, "rescalable", False) and saved_world != tr.world:
        raise CheckpointError(
            f"{ckpt['dir']} was saved by {saved_world} ranks and this run has {tr.world}; "
            f"{type(it).__name__} cannot resume at another world size: relaunch with "
            f"torchrun --nproc_per_node {saved_world}"
        )
    else:
        with _naming_previous(ckpt):  # a damaged position, which the iterator found
            it.load_state_dict(_saved_position(it, datas, tr.rank))


def restore_trainer(tr: Any, ckpt: dict) -> None:
    """Load ``ckpt`` into a trainer built with the same config: model, optimizer, stage,
    the data position (every saved rank's for a rescalable iterator, else this rank's) and
    RNG streams (fresh ones at another world size)."""
    tr.saved_config = ckpt["config"]
    saved = ckpt["config"].get("train", {})
    for key in ("steps", "seed"):
        if saved.get(key) != getattr(tr.cfg, key):
            raise CheckpointError(
                f"checkpoint in {tr.run_dir} was written with {key}={saved.get(key)}, "
                f"this run has {key}={getattr(tr.cfg, key)}; resume with the same config"
            )
    enabled = saved.get("comera", {}).get("enabled")  # a dense run's stages are not CoMERA's
    if enabled is not None and enabled != tr.cfg.comera.enabled:
        raise CheckpointError(
            f"checkpoint in {tr.run_dir} was written with comera.enabled={enabled}, this run "
            f"has comera.enabled={tr.cfg.comera.enabled}; resume with the same config"
        )
    # checked before anything is restored: a caller that catches the error keeps its trainer
    kind = "adamw" if "m" in ckpt["opt"] else "galore" if "galore" in ckpt["opt"] else "sgd"
    if kind != tr.cfg.optimizer:
        raise CheckpointError(
            f"checkpoint in {tr.run_dir} holds {kind} optimizer state but this run uses "
            f"optimizer={tr.cfg.optimizer!r}; resume with the saved optimizer"
        )
    with _naming_previous(ckpt):  # read first: their data position is checked first
        rngs, datas = read_rank_files(Path(ckpt["dir"]), ckpt["step"], ckpt.get("world_size"))
        check_same_data(tr, datas)  # (a damaged position: the previous checkpoint's way on)
    check_same_eval(tr, ckpt)  # first: changed data also changes a vocabulary's shapes
    check_same_run(tr, ckpt)
    # the caller broadcast them: every rank decides alike, before anything is restored
    check_replicated(tr, ckpt.get("replicated"))
    # the run's records, which rank 0 adds to: checked on every rank (files all ranks see),
    # so every rank refuses (none waits at the first step for a rank that left)
    rows = check_metrics(tr.run_dir / "metrics.jsonl")  # kept for the truncation below
    check_rank_snapshots(tr.run_dir)
    if resolve_wandb_mode(tr.cfg.wandb)[0] != "disabled":  # the id is read only to log
        read_run_id(tr.run_dir / WANDB_ID)
    _restore_position(tr, ckpt, datas)
    saved_world = len(datas)
    dev = tr.device
    to_dev = lambda tree: tree_map(lambda t: t.to(dev), tree)  # noqa: E731
    tr.params = tree_map(lambda t: t.to(dev).requires_grad_(True), ckpt["params"])
    tr.state = to_dev(ckpt["state"])
    opt = dict(ckpt["opt"])
    galore = opt.pop("galore", None)
    tr.opt = {k: to_dev(v) if k in ("m", "v") else v for k, v in opt.items()}
    if galore is not None:  # a fresh GaLore over the restored leaves, then its state
        tr.galore = GaLore.with_adamw(tr.params, tr.cfg.galore, tr.cfg.optim)
        tr.galore.load_state_dict(galore)
    tr.step = ckpt["step"]
    tr.stages.load_state_dict(ckpt["stages"])
    given = getattr(tr, "reference_size", None)
    if given is not None and given != ckpt["initial_size"]:  # kept, as every run's figures
        # are against one size; it was replaced without a word
        warnings.warn(
            f"{ckpt['dir']}: reference_size={given} differs from the {ckpt['initial_size']} "
            "the run measures compression against; the run keeps its own",
            stacklevel=4,
        )
    tr.initial_size = ckpt["initial_size"]
    if saved_world == tr.world:
        set_rng_state(rngs[tr.rank], dev)
    else:  # another world size: positions are exact, random streams start afresh
        random.seed(tr.cfg.seed + tr.rank + tr.step)
        torch.manual_seed(tr.cfg.seed + tr.rank + tr.step)
    if tr.rank == 0:
        try:
            truncate_metrics(tr.run_dir / "metrics.jsonl", tr.step, rows)
        except OSError as e:  # a full disk; the file is as it was
            raise CheckpointError(
                f"cannot rewrite {tr.run_dir / 'metrics.jsonl'} to the checkpoint's step "
                f"({e.strerror or e}): free space or make the folder writable, then --resume "
                f"{tr.run_dir} again"
            ) from e
