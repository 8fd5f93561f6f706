"""Run records: ``metrics.jsonl``, wandb, ``ranks.json``; only rank 0 writes.

wandb behaves as users expect: the mode comes from ``TrainConfig.wandb`` when set, else from
``WANDB_MODE``, else ``offline``; without the wandb package the run says so in one line and
logs to ``metrics.jsonl`` alone. The run id is kept in ``RUN_DIR/wandb_run_id`` so a resumed
run continues the same wandb run instead of starting a new one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

from comera.errors import CheckpointError, ConfigError, first_line
from comera.train.config import WANDB_MODES, TrainConfig

__all__ = [
    "RunLog",
    "check_metrics",
    "check_rank_snapshots",
    "last_logged",
    "read_metrics",
    "read_run_id",
    "resolve_wandb_mode",
    "train_and_eval_rows",
    "truncate_metrics",
    "write_json_atomic",
    "write_rank_snapshot",
]

WANDB_ID = "wandb_run_id"
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what a wandb id may be, and ours are
_ENV_MODES = {"run": "online", "dryrun": "offline"}  # wandb's older spellings


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Rows of a metrics file; a line cut short by a killed process is skipped, and so is
    anything else that is not a row (a JSON object with an integer step): readers of a
    damaged file get the rows it still holds (:func:`check_metrics` names the damage)."""
    text = Path(path).read_bytes().decode("utf-8", errors="replace")
    return [row for row in map(_row, text.splitlines()) if row is not None]


def train_and_eval_rows(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """A run's ``metrics.jsonl`` rows split into its training rows (they hold ``loss``) and
    its eval rows (they hold an ``eval/`` metric), each in step order."""
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    return train, evals


def last_logged(rows: list[dict]) -> dict:
    """A run's last training row with its last eval's ``eval/`` metrics: what ``fit``
    returns, read back for a finished run that a resume trains no further."""
    train, evals = train_and_eval_rows(rows)
    last_eval = evals[-1] if evals else {}
    return {**(train[-1] if train else {}),
            **{k: v for k, v in last_eval.items() if k.startswith("eval/")}}  # fmt: skip


def _row(line: str) -> dict | None:
    """The metrics row on ``line``, or None where it holds none."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    step = row.get("step", 0) if isinstance(row, dict) else None
    return row if isinstance(step, int) and not isinstance(step, bool) else None


def check_metrics(path: Path) -> list[dict] | None:
    """The rows of a metrics file a resume will rewrite (None: there is none), refusing,
    naming the line, one it would rewrite with rows lost: only its last line may be cut
    short (a killed process); every other line must be a row. A folder in its place is
    refused too (the first row would fail to be written)."""
    if not path.exists():
        return None
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file; move it away to resume (the run's "
                              "metrics rows start again from the checkpoint)")  # fmt: skip
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is unreadable ({first_line(e)}); fix it, or move it "
                              "away to resume without the rows so far") from None  # fmt: skip
    rows = []
    for n, line in enumerate(lines, 1):
        row = _row(line)
        if row is not None:
            rows.append(row)
        elif n < len(lines) and line.strip():
            raise CheckpointError(
                f"{path} line {n} is not a metrics row (a JSON object with an integer "
                f"step): {line[:60]!r}; fix or delete that line to resume"
            )
    return rows


def truncate_metrics(path: Path, step: int, rows: list[dict] | None = None) -> None:
    """Drop rows logged after ``step`` by a run that died after its last checkpoint, so a
    resumed run's rows are not doubled (check the file first: :func:`check_metrics`, whose
    rows it may pass, as it read them)."""
    if not path.is_file():
        return
    rows = read_metrics(path) if rows is None else rows
    keep = [r for r in rows if r.get("step", 0) <= step]
    _replace_text(path, "".join(json.dumps(r) + "\n" for r in keep))


def check_rank_snapshots(run_dir: Path) -> None:
    """Refuse a ``ranks.json`` that :func:`write_rank_snapshot` could not add to: found on
    resume, not at the run's last step, where the final checkpoint would be lost."""
    path = Path(run_dir) / "ranks.json"
    if not path.exists():
        return
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        data = e
    if not isinstance(data, dict):
        why = first_line(data) if isinstance(data, BaseException) else "not a JSON object"
        raise CheckpointError(
            f"{path} is damaged ({why}); restore it, or move it away to resume (the run's "
            "rank table then starts again from the checkpoint)"
        )


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
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:  # a full disk: no half-written temp file left beside it
        tmp.unlink(missing_ok=True)
        raise


def resolve_wandb_mode(flag: str | None) -> tuple[str, str | None]:
    """(mode, a note for the user or None): the flag, else ``WANDB_MODE``, else offline;
    ``disabled`` when the wandb package is missing."""
    mode, note = flag, None
    if mode is None:
        env = os.environ.get("WANDB_MODE", "").strip().lower()
        mode = _ENV_MODES.get(env, env) if env else "offline"
        if mode not in WANDB_MODES:
            mode, note = "offline", f"WANDB_MODE={env!r} is not one of {WANDB_MODES}; using offline"
    if mode != "disabled" and importlib.util.find_spec("wandb") is None:
        return "disabled", "wandb is not installed: logging to metrics.jsonl only"
    return mode, note


@contextlib.contextmanager
def _wandb_mode_env(mode: str) -> Iterator[None]:
    """``WANDB_MODE`` set to ``mode`` while wandb starts: wandb reads the variable itself
    and refuses a value it does not know (``junk``, ``Offline``, `` offline``), even when
    the flag names the mode, so the mode resolved here stands in for it meanwhile."""
    old = os.environ.get("WANDB_MODE")
    if old is None:
        yield
        return
    os.environ["WANDB_MODE"] = mode
    try:
        yield
    finally:
        os.environ["WANDB_MODE"] = old


def read_run_id(path: Path) -> str | None:
    """The wandb run id kept in ``path`` (None when there is none, or it is empty: a new
    run then starts); one that cannot be an id is refused, naming the file, not passed to
    wandb (an unreadable file, a folder, 300 characters, a "/")."""
    if not path.exists():
        return None
    try:
        run_id = path.read_bytes().decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as e:
        run_id = f"<{first_line(e)}>"
    if run_id and not _RUN_ID.fullmatch(run_id):
        raise CheckpointError(
            f"{path} holds {run_id[:40]!r}, not a wandb run id; restore it, or delete it to "
            "log the rest of this run to a new wandb run"
        )
    return run_id or None


class RunLog:
    """``metrics.jsonl`` plus an optional wandb run (rank 0 only)."""

    def __init__(self, cfg: TrainConfig, rank: int, config: dict, *, resume: bool) -> None:
        self.rank = rank
        self.run_dir = Path(cfg.run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.wandb = None
        self.wandb_from = 0  # the first step wandb takes (below: a resume's steps again)
        if rank != 0:
            return
        mode, note = resolve_wandb_mode(cfg.wandb)
        if note:
            print(f"comera: {note}", file=sys.stderr)
        if mode == "disabled":
            return
        for tag in cfg.wandb_tags:  # wandb's own refusal is a pydantic traceback
            if not 1 <= len(tag) <= 64:
                raise ConfigError(
                    f"train.wandb_tags: each tag must be 1 to 64 characters (wandb's limit), "
                    f"got {tag!r}; give others (--wandb-tags a,b) or --wandb disabled, and go "
                    f"on with --resume {self.run_dir}"
                )
        try:
            import wandb  # lazily: runs without wandb never import it
        except Exception as e:  # noqa: BLE001 - installed but broken (a protobuf mismatch)
            raise ConfigError(
                f"wandb={mode!r}: the wandb package is installed but does not import "
                f"({type(e).__name__}: {first_line(e)}); repair it (pip install "
                "--force-reinstall wandb) or use --wandb disabled, and go on with "
                f"--resume {self.run_dir}"
            ) from None

        id_path = self.run_dir / WANDB_ID
        # only a resume continues the recorded wandb run: a fresh one (a restart of a run
        # that stopped before its first checkpoint) is a new run, not the stopped one's
        run_id = read_run_id(id_path) if resume else None
        if not run_id:
            run_id = uuid.uuid4().hex[:8]  # wandb's id alphabet: lowercase letters, digits
            id_path.write_text(run_id + "\n")
        try:
            with _wandb_mode_env(mode):
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
        # no API key, a refused login, an unknown entity (wandb's errors); a setting it
        # refuses (pydantic's ValueErrors: a project name with "/"); a file it cannot write
        except (wandb.errors.Error, ValueError, OSError) as e:
            why = " ".join(str(e).split())[:300] or type(e).__name__
            # a refused key is a CommError too (AuthenticationError): login advice for it
            refused = isinstance(e, getattr(wandb.errors, "AuthenticationError", ()))
            unreachable = not refused and (
                isinstance(e, getattr(wandb.errors, "CommError", ())) or "timed out" in why.lower()
            )
            if isinstance(e, OSError):  # a disk, a permission: not a setting
                fix = f"make {self.run_dir / 'wandb'} writable (or use --wandb disabled)"
            elif mode == "online" and unreachable:  # a key, but no server answered in time
                fix = ("check the network (or WANDB_BASE_URL) or use --wandb offline "
                       "(WANDB_INIT_TIMEOUT=SECONDS gives up sooner than wandb's 90)")  # fmt: skip
            elif mode == "online":
                fix = "log in (wandb login, or WANDB_API_KEY) or use --wandb offline"
            else:
                fix = "fix that setting (train.wandb_*)"
            raise ConfigError(
                f"wandb={mode!r}: wandb could not start ({why}); {fix}, and go on with "
                f"--resume {self.run_dir}"
            ) from None
        if resume and mode == "online":
            # the server's next step: it drops, warning about each, the rows of the steps a
            # resume trains again after its checkpoint (an offline run starts from 0)
            try:
                self.wandb_from = int(self.wandb.step)
            except Exception:  # noqa: BLE001 - a count to skip warnings, not worth a stop
                self.wandb_from = 0

    @classmethod
    def silent(cls, cfg: TrainConfig) -> RunLog:
        """A log that writes nothing: a resumed run with no step left to train opened its
        wandb run again only to mark it finished twice."""
        return cls(cfg, 1, {}, resume=True)

    def log(self, row: dict) -> None:
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None and row["step"] >= self.wandb_from:
            self.wandb.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def update_config(self, changes: dict) -> None:
        """Add ``changes`` to the wandb run's config (the plans a run chose, say)."""
        if self.wandb is not None:
            self.wandb.config.update(changes, allow_val_change=True)

    def close(self, exit_code: int = 0) -> None:
        """End the wandb run: ``exit_code`` other than 0 marks it failed (a run stopped by
        Ctrl-C showed as finished)."""
        if self.wandb is not None:
            self.wandb.finish(exit_code=exit_code)
            self.wandb = None
