"""Per-rank state files and loading them back at any world size.

Each rank writes ``loader_rank{rank:05d}.json`` on its own (no collective), atomically
(temp file, fsync, rename) and optionally on a background thread, so a crash mid-save leaves
the previous file intact. Loading reads every rank file of a checkpoint folder, checks the
set is complete and compatible, and merges the readers' shard cursors into one map
``{sub-dataset: {shard: (epoch, counter, offset)}}``; the new layout then takes its shards
from that map, so any N -> M rescale continues the epoch exactly once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from loaders.config import check_weight, is_int
from loaders.errors import LoaderInputError, LoaderPathError
from loaders.metadata import atomic_write_text, is_content_id
from loaders.shards import owned_shards

STATE_FORMAT = "loaders.rank_state"
STATE_VERSION = 1
_FILE_RE = re.compile(r"^loader_rank(\d+)\.json$")
_writer: ThreadPoolExecutor | None = None


def state_path(directory: str | Path, rank: int) -> Path:
    """File of ``rank``'s loader state inside a checkpoint folder."""
    return Path(directory) / f"loader_rank{rank:05d}.json"


def save_state(
    state: dict,
    directory: str | Path,
    *,
    background: bool = False,
    on_failure: Callable[[], object] | None = None,
) -> Path | Future[Path]:
    """Write one rank's state atomically; with ``background`` return a Future.

    The state is serialized on the calling thread (so later mutations cannot leak in);
    background writes run in order on one thread. ``on_failure`` runs when the write
    fails, before the error reaches the caller (a background one: before the Future
    holds it). ``TokenLoader.save`` first refuses a folder another loader of the process
    holds (:func:`state_conflict`).
    """
    global _writer
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a file there, or on the way
        raise LoaderPathError(
            f"cannot save the loader's state in {directory}: a file is in the way; give a "
            "folder path"
        ) from None
    path = state_path(directory, int(state["rank"]))
    text = json.dumps(state, separators=(",", ":"))
    world = int(state["world_size"])

    def write() -> Path:
        try:
            atomic_write_text(path, text)
        except BaseException:
            if on_failure is not None:
                on_failure()
            raise
        if state["rank"] == 0:  # files of ranks beyond this world are stale: drop them
            for p in directory.glob("loader_rank*.json"):
                m = _FILE_RE.match(p.name)
                if m and int(m.group(1)) >= world:
                    p.unlink(missing_ok=True)
        return path

    if not background:
        return write()
    if _writer is None:
        _writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loader-ckpt")
    return _writer.submit(write)


def state_conflict(path: Path, fingerprint: dict) -> str | None:
    """Why the state file at ``path`` cannot be an earlier save of the loader whose
    fingerprint is given (None when it can, or when there is no readable state there).

    Within one run the shard count, seed and shuffle never change and sub-datasets are
    only added, each keeping its document count (:func:`merge_states` refuses the rest),
    so a file that breaks those rules is another loader's."""
    try:
        old = json.loads(path.read_text())["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # nothing there, or a damaged file no load would take
    return fingerprint_conflict(old, fingerprint)


def fingerprint_conflict(old: dict, fingerprint: dict) -> str | None:
    """:func:`state_conflict` of a state's fingerprint ``old`` itself (one in memory)."""
    try:
        docs = dict(old["docs"])
    except (KeyError, TypeError, ValueError):
        return None
    for key in ("num_shards", "seed", "shuffle"):
        if old.get(key) != fingerprint[key]:
            return f"{key} {old.get(key)!r} there, {fingerprint[key]!r} here"
    for name, n in docs.items():
        if name not in fingerprint["docs"]:
            return f"sub-dataset {name!r} there, not here"
        if fingerprint["docs"][name] != n:
            return f"sub-dataset {name!r} of {n} documents there, {fingerprint['docs'][name]} here"
    return None


def load_states(directory: str | Path) -> list[dict]:
    """All rank states of a checkpoint folder, checked to be one complete save."""
    directory = Path(directory)
    files = sorted(p for p in directory.glob("loader_rank*.json") if _FILE_RE.match(p.name))
    if not files:
        raise LoaderPathError(
            f"no loader state files (loader_rank*.json) in {directory}; check the checkpoint path"
        )
    states = []
    for p in files:
        try:
            states.append(json.loads(p.read_text()))
        except (OSError, ValueError) as exc:
            raise LoaderInputError(
                f"loader state {p} is unreadable ({exc}); use an older checkpoint"
            ) from exc
        check_state(states[-1], f"loader state {p}")
    worlds = {int(s.get("world_size", -1)) for s in states}
    if len(worlds) != 1:
        raise LoaderInputError(
            f"loader states in {directory} come from different world sizes {sorted(worlds)}; "
            "save each checkpoint into its own folder"
        )
    world = worlds.pop()
    for p, st in zip(files, states, strict=True):
        if int(_FILE_RE.match(p.name).group(1)) != int(st["rank"]):  # type: ignore[union-attr]
            raise LoaderInputError(
                f"{p} holds the state of rank {st['rank']}: a file renamed or copied by hand; "
                "restore the folder as the save wrote it, or use another checkpoint"
            )
    ranks = sorted(int(s["rank"]) for s in states)
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if twice:  # two names for one rank (the pattern takes unpadded numbers too)
        names = [p.name for p, st in zip(files, states, strict=True) if int(st["rank"]) in twice]
        raise LoaderInputError(
            f"{directory} holds rank {twice[0]}'s loader state twice ({', '.join(names)}): a "
            f"copy made by hand; keep the one the save wrote ({state_path('', twice[0])})"
        )
    if ranks != list(range(world)):
        raise LoaderInputError(
            f"{directory} holds loader states for ranks {ranks} but world_size={world}; "
            "a rank file is missing (the save was interrupted): use the previous checkpoint"
        )
    check_one_save(states, f"loader states in {directory}")
    return states


def check_one_save(states: list[dict], what: str) -> None:
    """Refuse rank states written by different saves: ranks apart in time would repeat or
    skip the tokens between. A save records its ``step`` when given one, else the rank's
    count of saves (``save``): equal on every rank of one save round, so a folder reused
    by ``save(dir)`` where one rank's newer file sits beside another's older one is
    refused."""
    marks = {(s.get("step"), s.get("save")) for s in states}
    if len(marks) > 1:
        shown = sorted(
            (f"step {a}" if a is not None else f"save {b}" if b is not None else "unmarked")
            for a, b in marks
        )
        raise LoaderInputError(
            f"{what} were saved at different points ({', '.join(shown)}); pass every "
            "rank's state of one save (save(dir, step=...) marks each save's step)"
        )


def check_state(state: object, where: str = "loader state") -> None:
    """Refuse anything that is not one rank's state as :meth:`TokenLoader.state_dict`
    writes it, naming the first field that is missing or malformed, before any of it is
    used: a damaged file would otherwise fail deep inside the merge, or start a reader at
    a position the state never held."""

    def bad(field: str, why: str) -> LoaderInputError:
        return LoaderInputError(
            f"{where}: {field} {why}; the state is damaged or not a loader state: use another "
            "checkpoint"
        )

    def ints(value: object, n: int | None = None) -> bool:
        return (
            isinstance(value, list)
            and all(is_int(v) for v in value)
            and (n is None or len(value) == n)
        )

    if not isinstance(state, dict):
        raise bad("the state", f"is a {type(state).__name__}, not a dict")
    if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
        raise LoaderInputError(
            f"{where}: not a loader state (format={state.get('format')!r}, "
            f"version={state.get('version')!r}); expected format={STATE_FORMAT!r} version "
            f"{STATE_VERSION}"
        )
    fp = state.get("fingerprint")
    if not isinstance(fp, dict):
        raise bad("fingerprint", "is missing")
    for key in ("num_shards", "seed"):
        if not is_int(fp.get(key)):
            raise bad(f"fingerprint.{key}", "is not an integer")
    docs = fp.get("docs")
    if not isinstance(fp.get("shuffle"), str) or not isinstance(docs, dict):
        raise bad("fingerprint", "lacks shuffle or docs")
    if not all(is_int(n) and n >= 0 for n in docs.values()) or fp["num_shards"] < 1:
        raise bad("fingerprint", "has document counts or num_shards out of range")
    content = fp.get("content", {})  # a state saved before content digests has none
    if not isinstance(content, dict) or not all(
        v is None or isinstance(v, str) for v in content.values()
    ):
        raise bad("fingerprint.content", "is not a mapping of digests")
    for key in ("rank", "world_size", "num_workers"):
        if not is_int(state.get(key)):
            raise bad(key, "is not an integer")
    for key in ("step", "save"):
        if key in state and not (is_int(state[key]) and state[key] >= 0):
            raise bad(key, f"{state[key]!r} is not an integer >= 0")
    if not 0 <= state["rank"] < state["world_size"]:
        raise bad("rank", f"{state['rank']} is outside world_size {state['world_size']}")
    if not 1 <= state["num_workers"] <= fp["num_shards"] // state["world_size"]:
        raise bad("num_workers", f"x world_size = {state['num_workers']} x {state['world_size']} "
                                 f"readers does not fit num_shards={fp['num_shards']}")  # fmt: skip
    readers = state.get("readers")
    if not isinstance(readers, list) or not all(isinstance(r, dict) for r in readers):
        raise bad("readers", "is not a list of reader states")
    for r in readers:
        if not is_int(r.get("worker")) or not isinstance(r.get("shards"), dict):
            raise bad("a reader", "lacks its worker or shards")
        shards = r["shards"]
        for name, sh in shards.items():
            at = f"readers[worker {r['worker']}].shards[{name!r}]"
            if name not in docs:
                raise bad(at, "names a sub-dataset the fingerprint lacks")
            span = sh.get("range") if isinstance(sh, dict) else None
            if not ints(span, 2) or not 0 <= span[0] <= span[1] <= fp["num_shards"]:
                raise bad(f"{at}.range", f"is not a shard range within {fp['num_shards']}")
            own = owned_shards(fp["num_shards"], state["rank"], state["world_size"],
                               r["worker"], state["num_workers"])  # fmt: skip
            if r["worker"] in range(state["num_workers"]) and span != [own.start, own.stop]:
                # a reader's cursors cover the shards its layout gives it: fewer would
                # restart the others from their first document
                raise bad(f"{at}.range", f"{span} is not the shards {[own.start, own.stop]} "
                                         "its rank and worker own")  # fmt: skip
            for key in ("epoch", "counter", "offset"):
                if not ints(sh.get(key), span[1] - span[0]) or min(sh[key], default=0) < 0:
                    raise bad(f"{at}.{key}", f"is not {span[1] - span[0]} integers >= 0")
            # a shard's block holds at most ceil(N / L) documents of the N saved with it
            most = -(-docs[name] // fp["num_shards"])
            if max(sh["counter"], default=0) > most:
                raise bad(f"{at}.counter", f"passes the {most} documents a shard holds")
        missing = [n for n in docs if n not in shards]
        if missing:  # a reader saves every sub-dataset's cursors, paused ones included
            raise bad(f"readers[worker {r['worker']}].shards", f"lacks sub-datasets {missing}")

        # rr: the next of the reader's own shards of a sub-dataset; mix_tokens: counts
        spans = {n: max(sh["range"][1] - sh["range"][0], 1) for n, sh in shards.items()}
        for key, top in (("rr", spans), ("mix_tokens", None)):
            counts = r.get(key, {})
            if not isinstance(counts, dict) or not all(
                n in spans and is_int(v) and 0 <= v < (2**63 if top is None else top[n])
                for n, v in counts.items()
            ):
                raise bad(f"readers[worker {r['worker']}].{key}",
                          "is not a map of its sub-datasets to integers in range")  # fmt: skip
        cur = r.get("current")
        if cur is not None and not (
            isinstance(cur, list)
            and len(cur) == 2
            and isinstance(cur[0], str)
            and cur[0] in shards
            and is_int(cur[1])
            and shards[cur[0]]["range"][0] <= cur[1] < shards[cur[0]]["range"][1]
        ):
            raise bad(f"readers[worker {r['worker']}].current", "is not one of its shards")
    workers = sorted(r["worker"] for r in readers)
    if workers != list(range(state["num_workers"])):
        raise bad("readers", f"are of workers {workers}, not one per worker of "
                             f"num_workers={state['num_workers']}")  # fmt: skip
    nxt = state.get("next_worker", 0)
    if not is_int(nxt) or not 0 <= nxt < max(state["num_workers"], 1):
        raise bad("next_worker", f"{nxt!r} is not a worker of num_workers={state['num_workers']}")
    for key in ("weights", "config_weights"):
        weights = state.get(key, {})
        if not isinstance(weights, dict):
            raise bad(key, "is not a dict")
        for n, v in weights.items():
            try:  # the config's own check of a weight, named as a damaged state's field
                if n not in docs:
                    raise LoaderInputError(f"unknown sub-dataset {n!r}")
                check_weight(f"{key}[{n!r}]", v)
            except LoaderInputError:
                raise bad(f"{key}[{n!r}]", f"= {v!r} is not a finite weight >= 0 of a "
                                           "sub-dataset of the state") from None  # fmt: skip
        if weights and not sum(weights.values()) > 0:
            raise bad(key, "are all 0")


@dataclass(slots=True)
class Resume:
    """Merged view of a saved loader state, ready to be cut for a new layout."""

    cursors: dict[str, dict[int, tuple[int, int, int]]]
    world_size: int
    num_workers: int
    readers: dict[tuple[int, int], dict] = field(default_factory=dict)
    next_worker: dict[int, int] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    config_weights: dict[str, float] = field(default_factory=dict)


def merge_states(states: list[dict], fingerprint: dict, *, complete: bool = True) -> Resume:
    """Check rank states against the current corpus/config and merge their cursors. Each
    state must have passed :func:`check_state` (``TokenLoader.load_state_dict`` checks
    every one before anything reads it).

    ``complete=False`` accepts a subset of ranks (a rank reloading its own state).
    """
    if not states:
        raise LoaderInputError("no loader states given: pass a rank's state or every rank's")
    L = fingerprint["num_shards"]
    for s in states:
        fp = s["fingerprint"]
        for key in ("num_shards", "seed", "shuffle"):
            if fp[key] != fingerprint[key]:
                raise LoaderInputError(
                    f"loader state has {key}={fp[key]!r} but the config has {fingerprint[key]!r}; "
                    f"{key} is fixed for a run: restore it in the config (or start a new run)"
                )
        for name, n in fp["docs"].items():
            if name not in fingerprint["docs"]:
                raise LoaderInputError(
                    f"loader state has sub-dataset {name!r} that the config lacks; add it back "
                    "(weight 0 keeps it paused)"
                )
            if fingerprint["docs"][name] != n:
                raise LoaderInputError(
                    f"sub-dataset {name!r} had {n} documents when saved but has "
                    f"{fingerprint['docs'][name]} now: the corpus changed; restore it or start "
                    "a new run"
                )
            saved, now = fp.get("content", {}).get(name), fingerprint.get("content", {}).get(name)
            # compared only within this build's scheme: a state saved with the byte digests
            # of an earlier build, or none, resumes as before
            if is_content_id(saved) and is_content_id(now) and saved != now:
                a, b = (x.partition(":")[2][:12] for x in (saved, now))
                raise LoaderInputError(
                    f"sub-dataset {name!r} holds other tokens than when saved (content {a} "
                    f"saved, {b} now; same {n} documents): it was prepared again from changed "
                    "sources; restore them or start a new run"
                )
    worlds = {int(s["world_size"]) for s in states}
    workers = {int(s["num_workers"]) for s in states}
    ranks = sorted(int(s["rank"]) for s in states)
    world = next(iter(worlds))
    if len(worlds) != 1 or len(workers) != 1 or (complete and ranks != list(range(world))):
        raise LoaderInputError(
            f"incomplete or mixed loader states (ranks {ranks}, world sizes {sorted(worlds)}, "
            f"workers {sorted(workers)}); pass every rank's state of one checkpoint"
        )
    check_one_save(states, f"loader states of ranks {ranks}")
    names = list(states[0]["fingerprint"]["docs"])
    cursors: dict[str, dict[int, tuple[int, int, int]]] = {n: {} for n in names}
    readers: dict[tuple[int, int], dict] = {}
    for s in states:
        for r in s["readers"]:
            readers[(int(s["rank"]), int(r["worker"]))] = r
            for name, sh in r["shards"].items():
                lo, hi = sh["range"]
                got = cursors[name]
                for i, shard in enumerate(range(lo, hi)):
                    if shard in got:
                        raise LoaderInputError(
                            f"shard {shard} of {name!r} appears in two loader states"
                        )
                    got[shard] = (sh["epoch"][i], sh["counter"][i], sh["offset"][i])
    for name, got in cursors.items():
        if complete and len(got) != L:
            missing = sorted(set(range(L)) - set(got))[:8]
            raise LoaderInputError(
                f"loader states cover {len(got)} of {L} shards of {name!r} (missing {missing}...); "
                "pass every rank's state of one checkpoint"
            )
    first = states[0]
    return Resume(
        cursors=cursors,
        world_size=world,
        num_workers=workers.pop(),
        readers=readers,
        next_worker={int(s["rank"]): int(s.get("next_worker", 0)) for s in states},
        weights=dict(first.get("weights", {})),
        config_weights=dict(first.get("config_weights", {})),
    )
