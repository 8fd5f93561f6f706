"""Auto-tuned contraction plans: time the candidates once per shape, keep the fastest.

``plan="auto"`` (TT linears) and ``impl="auto"`` (TTM lookups) ask the tuner in force for
a concrete choice. For a key it has not seen (core shapes, token bucket, dtype, device,
thread count, torch version, whether gradients flow and reach the input) it times each
candidate on the call's own inputs, forward and backward, and keeps the median-fastest, as
``torch.backends.cudnn.benchmark`` does for convolutions. Decisions live in memory and,
when the tuner has a ``cache_dir``, in ``plans-v2.json`` there, so a second run times
nothing. Compaction changes core shapes, so the next call after it is a new key: it is
decided (or read from the cache) afresh.

Two rules bound what ``auto`` may pick:

- **Memory.** What a plan builds from the cores alone, before ``x`` joins, autograd
  keeps for the backward pass whatever the token count. A plan that builds more of it than
  the ``comera`` plan does (its halves) is a candidate for a training call only when the
  excess is at most :data:`DENSE_SHARE` (5%) of the call's input and output activations
  (``T x (N + M)``) for every token count ``T`` its key covers (half its power-of-two
  bucket and up). For ``dense`` the excess is the rebuilt ``W`` (``M x N``); an opt_einsum
  path (``dp``) may contract cores into tensors as large. This bounds what ``auto`` adds
  to a step's saved tensors at 5% of the TT layers' own activations. A TTM lookup
  rebuilds its table (``table``) only when the table has no more rows than the fewest
  ids its key covers.
- **Cost.** A candidate whose forward FLOPs (opt_einsum's count, ``describe()``) exceed
  :data:`FLOP_PRUNE` times the cheapest's is not timed.

Where timing is impossible (a CUDA-graph capture, inside ``vmap`` / ``grad``) a call
reads the cache and, on a miss, takes the paper's path (``comera`` / ``optimized``).
While ``torch.compile`` traces, a call reads the decision this process last made or read
for it, if that plan traces, else takes the paper's path; :class:`comera.train.Trainer`
(``auto_plans=True``) decides in an eager pass first, among the plans that trace.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from comera.errors import ConfigError
from comera.plans import (
    DIRECT_STRATEGIES,
    EMBEDDING_IMPLS,
    FIXED_STRATEGIES,
    constant_under_compile,
    contract_halves,
    token_bucket,
    tt_linear_plan,
)
from comera.tensor_train import is_batched, under_func_transform

__all__ = [
    "DENSE_SHARE",
    "EMBEDDING_CANDIDATES",
    "FLOP_PRUNE",
    "LINEAR_CANDIDATES",
    "Decision",
    "PlanTuner",
    "Timer",
    "choose_embedding",
    "choose_linear",
    "current_tuner",
    "median_timer",
    "rekey",
    "set_tuner",
    "summarize_decisions",
    "use_tuner",
]

LINEAR_CANDIDATES = ("comera", "dense", "dp")
EMBEDDING_CANDIDATES = ("optimized", "table")
DENSE_SHARE = 0.05  # rebuilt W <= 5% of the call's T x (N + M) activations (training)
FLOP_PRUNE = 32.0  # a candidate over 32x the cheapest forward FLOPs is not timed
# v2: decision names carry the layers' modes, and a bias-only gradient call is a "no dW"
# one; v1 files hold names and keys without them, so they are left to the old version
CACHE_FILE = "plans-v2.json"

# Timer({candidate: run}) -> {candidate: seconds}; ``run()`` executes one candidate once
Timer = Callable[[dict[str, Callable[[], None]]], dict[str, float]]
# Lookup(impl, gated cores, flat ids) -> rows: a TTM lookup by one implementation
Lookup = Callable[[str, Sequence[torch.Tensor], torch.Tensor], torch.Tensor]


def median_timer(repeats: int = 7, warmup: int = 2) -> Timer:
    """Each candidate's median over ``repeats`` rounds after ``warmup`` untimed runs. The
    candidates take turns within a round, so a change in the machine's load hits all of
    them alike (the device is synchronized around each run on CUDA)."""

    def timer(runs: dict[str, Callable[[], None]]) -> dict[str, float]:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        for run in runs.values():
            for _ in range(warmup):
                run()
        times: dict[str, list[float]] = {c: [] for c in runs}
        for _ in range(repeats):
            for c, run in runs.items():
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                run()
                if cuda:
                    torch.cuda.synchronize()
                times[c].append(time.perf_counter() - t0)
        return {c: statistics.median(t) for c, t in times.items()}

    return timer


@dataclass(frozen=True)
class Decision:
    """One decision: the ``choice``, each timed candidate's median (ms), and why any
    candidate was not timed. ``what`` is the shapes in words (for logs and reports)."""

    kind: str  # "tt_linear" | "ttm_embedding"
    what: str
    choice: str
    times_ms: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def _well_formed(d: Decision) -> bool:
    """Whether a decision read from disk has the field types a run relies on."""
    texts = all(isinstance(x, str) for x in (d.kind, d.what, d.choice))
    times = isinstance(d.times_ms, dict) and all(
        isinstance(c, str) and isinstance(t, int | float) and not isinstance(t, bool)
        and -1e300 < t < 1e300  # finite, and printable as a float (10**400 is not)
        for c, t in d.times_ms.items()
    )  # fmt: skip
    skipped = isinstance(d.skipped, dict) and all(
        isinstance(c, str) and isinstance(why, str) for c, why in d.skipped.items()
    )
    return texts and times and skipped


# how long a save waits for another process's lock on the cache before it gives up (a
# save takes milliseconds; a process stopped while holding the lock would hold it forever)
LOCK_WAIT_S = 10.0


class LockTimeout(OSError):
    """The plan cache's lock stayed held by another process past :data:`LOCK_WAIT_S`."""


@contextlib.contextmanager
def _file_lock(path: Path, wait_s: float | None = None) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created if missing, opened read-only: a
    lock needs no write access, so users sharing a cache can each take it) while the block
    runs, so two processes saving one cache do not drop each other's entries. Where it
    cannot be taken (no ``fcntl`` on Windows, a filesystem without locks, a lock file
    another user made unreadable), the block runs unlocked, as saves did before; one held
    by another process past ``wait_s`` (:data:`LOCK_WAIT_S`) raises :class:`LockTimeout`
    (the block never runs)."""
    wait_s = LOCK_WAIT_S if wait_s is None else wait_s
    fd = None
    try:
        import fcntl

        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    fd = None
                    raise LockTimeout(
                        f"its lock {path.name} stayed held by another process for {wait_s:g} s"
                    ) from None
                time.sleep(0.05)
    except LockTimeout:
        raise
    except (ImportError, OSError):
        if fd is not None:
            os.close(fd)
        fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing releases the lock


def _umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _choice_in_key(key: str, choice: str) -> bool:
    """Whether ``choice`` is one of the candidates a cache key names (``from=a,b``)."""
    part = next((p for p in key.split("|") if p.startswith("from=")), None)
    return part is not None and choice in part[len("from=") :].split(",")


def _device_name(device: torch.device) -> str:
    """The device's model (a GPU's name; a CPU's model name and torch's thread count)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name} x{torch.get_num_threads()}"


def rekey(key: str, device: torch.device) -> str:
    """A decision's ``key`` for ``device`` as it is now (its model and torch's thread count)
    and this torch version: a resumed run reinstalls the decisions it recorded under the
    keys its calls look up, on another thread count or machine too (it timed afresh and
    could pick other plans than its first steps ran)."""
    parts = key.split("|")
    if len(parts) < 6 or not parts[-1].startswith("torch "):
        return key  # not a key this version writes: left as it is (decided again)
    parts[4], parts[-1] = _device_name(device), f"torch {torch.__version__}"
    return "|".join(parts)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


def _cannot_time(*tensors: torch.Tensor) -> bool:
    """True where a timing run cannot happen: tracing, capture, inside functorch."""
    if torch.compiler.is_compiling():
        return True
    if under_func_transform():
        return True
    if any(is_batched(t) for t in tensors):
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _fewest(bucket: int) -> int:
    """The fewest tokens (ids) a decision for a power-of-two ``bucket`` covers: the memory
    rules must hold for every count that shares its key."""
    return bucket // 2 + 1 if bucket > 1 else 1


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def _fresh(t: torch.Tensor | None, grad: bool) -> torch.Tensor | None:
    return None if t is None else t.detach().clone().requires_grad_(grad)


class PlanTuner:
    """Decides ``auto`` plans by timing, caches the decisions (memory and ``cache_dir``).

    ``timer`` replaces the clock (tests pass a stub); ``linear_candidates`` /
    ``embedding_candidates`` restrict what is tried. ``timings`` counts the decisions that
    were timed (not read from a cache)."""

    def __init__(
        self,
        cache_dir: str | os.PathLike | None = None,
        *,
        timer: Timer | None = None,
        linear_candidates: Sequence[str] = LINEAR_CANDIDATES,
        embedding_candidates: Sequence[str] = EMBEDDING_CANDIDATES,
    ) -> None:
        # ``~`` as the shell would (a config file or a quoted argument keeps it literal)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else None
        self.timer = timer or median_timer()
        self.linear_candidates = tuple(linear_candidates)
        self.embedding_candidates = tuple(embedding_candidates)
        # a bad name was recorded as chosen and ran as "optimized" (an embedding), or
        # failed at the first call naming tt_linear; none at all was min()'s bare error
        for arg, given, known in (("linear_candidates", self.linear_candidates,
                                   FIXED_STRATEGIES),
                                  ("embedding_candidates", self.embedding_candidates,
                                   tuple(i for i in EMBEDDING_IMPLS if i != "auto"))):  # fmt: skip
            bad = [c for c in given if c not in known]
            if bad or not given:
                raise ConfigError(
                    f"PlanTuner({arg}={given!r}): give one or more of {', '.join(known)}"
                )
        self.decisions: dict[str, Decision] = {}
        self.timings = 0
        self.used: set[str] = set()  # keys asked for since the last ``take_used``
        self._fast: dict[tuple, tuple[str, str]] = {}  # (call, threads) -> (key, choice)
        self._last: dict[tuple, str] = {}  # call -> its latest choice (read under compile)
        self._loaded = False
        self._warned = False  # a cache it cannot read or write is warned of once
        self._unreadable = False  # a cache file this user cannot read is never replaced
        self._lock_stuck = False  # the cache's lock stayed held once: no more saves
        # one decision (timing, then recording and saving) at a time among threads
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ the cache

    @property
    def cache_file(self) -> Path | None:
        """``cache_dir / plans-v2.json``, or None for a memory-only tuner."""
        return self.cache_dir / CACHE_FILE if self.cache_dir is not None else None

    @staticmethod
    def _read_raw(path: Path) -> dict[str, Any]:
        """A cache file's entries as stored, or nothing when it is not a JSON object (a
        damaged file, rewritten by the next save). A file this user cannot read raises
        ``OSError``: it may hold other users' entries, which a save must not replace."""
        try:
            table = json.loads(path.read_text())
        except (ValueError, RecursionError):  # not JSON (or not UTF-8), too deep
            return {}
        return table if isinstance(table, dict) else {}

    @staticmethod
    def _parse(raw: dict[str, Any]) -> dict[str, Decision]:
        """The entries that make a decision, each on its own: one of the wrong shape (from
        another version, or damaged) is dropped (decided again, never trusted), as is a
        choice its key does not list among the candidates; the others stand."""
        out = {}
        for k, v in raw.items():
            try:
                d = Decision(**v)
            except TypeError:  # not a mapping, or other fields
                continue
            # a choice its own entry says was not timed (the memory rule ruled it out)
            # contradicts itself: damaged or edited
            if _well_formed(d) and _choice_in_key(k, d.choice) and d.choice not in d.skipped:
                out[k] = d
        return out

    @classmethod
    def _read_table(cls, path: Path) -> dict[str, Decision]:
        """The decisions in a cache file (see :meth:`_parse`); raises ``OSError`` when it
        cannot be read."""
        return cls._parse(cls._read_raw(path))

    def _warn(self, text: str) -> None:
        """One warning per tuner for a cache it cannot use: a run decides many shapes,
        and each would warn again (a message naming a random temp file is never seen
        twice by Python's filter)."""
        if not self._warned:
            self._warned = True
            warnings.warn(f"comera.autotune: {text}", stacklevel=4)

    def _load(self) -> None:
        with self._lock:  # threads sharing the tuner see the table once it is read
            if self._loaded:
                return
            path = self.cache_file
            try:  # is_file() raises for a folder this user cannot open
                if path is not None and path.is_file():
                    self.decisions = {**self._read_table(path), **self.decisions}
            except OSError as e:
                self._warn(f"cannot read the plan cache {path}: {e.strerror or e}; deciding "
                           "afresh (and not saving over it)")  # fmt: skip
                self._unreadable = True
            self._loaded = True

    def _save(self) -> None:
        """Merge our decisions into the cache file (another run's keys kept), written
        whole through a rename; a cache that cannot be written costs a warning, never the
        run."""
        path = self.cache_file
        if path is None or self._unreadable or self._lock_stuck:
            return
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with _file_lock(path.with_name(path.name + ".lock")):  # other processes' saves
                # entries as stored: one this version cannot read (another version's) is
                # kept; a file this user cannot read raises, and is not replaced
                disk = self._read_raw(path) if path.is_file() else {}
                merged = {**disk, **{k: asdict(v) for k, v in self.decisions.items()}}
                text = json.dumps(dict(sorted(merged.items())), indent=1)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide a shared cache
                os.replace(tmp, path)
                tmp = None
        except LockTimeout as e:  # waited once: the next decisions do not wait again
            self._lock_stuck = True
            self._warn(f"cannot write the plan cache {path}: {e}; decisions stay in memory "
                       "for this run")  # fmt: skip
        except OSError as e:  # the reason alone: e's text names a random temp file
            self._warn(f"cannot write the plan cache {path}: {e.strerror or e}; decisions "
                       "stay in memory for this run")  # fmt: skip
        finally:
            if tmp is not None:  # written but not renamed (a full disk, a folder there)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def lookup(self, key: str) -> Decision | None:
        """The cached decision for ``key`` (memory, then disk), or None."""
        self._load()
        return self.decisions.get(key)

    def export(self) -> dict[str, dict]:
        """Every decision as plain data (JSON, or a broadcast to other ranks)."""
        self._load()
        return {k: asdict(v) for k, v in sorted(self.decisions.items())}

    def install(self, table: dict[str, dict]) -> None:
        """Adopt ``table``'s decisions (rank 0's, on every rank; a resumed run's recorded
        ones), replacing any of our own; an entry of the wrong shape is dropped, as one on
        disk is (decided again)."""
        self._load()
        with self._lock:
            self.decisions.update(self._parse(table))
            for fast, (key, choice) in list(self._fast.items()):  # calls already seen follow
                new = self.decisions[key].choice if key in self.decisions else choice
                self._fast[fast] = (key, new)
                self._last[fast[0]] = new

    def take_used(self) -> dict[str, Decision]:
        """The decisions asked for since the last call (what a run reports), then forget."""
        with self._lock:
            used = {k: self.decisions[k] for k in sorted(self.used) if k in self.decisions}
            self.used = set()
        return used

    def describe(self, decisions: dict[str, Decision] | None = None) -> str:
        """A table of decisions: shapes, choice, each candidate's median time."""
        rows = ["| kind | shapes | choice | timed (ms) | not timed |", "|---|---|---|---|---|"]
        for d in (decisions if decisions is not None else self.decisions).values():
            timed = ", ".join(f"{c} {t:.3f}" for c, t in d.times_ms.items()) or "cached"
            skipped = ", ".join(f"{c}: {why}" for c, why in d.skipped.items()) or "-"
            what = d.what.replace("|", "\\|")  # the shapes' "[in | out]" splits no cell
            rows.append(f"| {d.kind} | {what} | {d.choice} | {timed} | {skipped} |")
        return "\n".join(rows)

    def _decide(self, base: tuple, key: str, what: str, runs: dict[str, Callable[[], None]],
                skipped: dict[str, str]) -> str:  # fmt: skip
        if not runs:  # nothing may run here: the paper's path, undecided
            return "comera" if base[0] == "tt_linear" else "optimized"
        with self._lock:
            known = self.decisions.get(key)  # another thread decided it meanwhile
            if known is not None:
                self._remember(base, key, known.choice)
                return known.choice
            with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                # a timing run saves its own tensors: never into an enclosing checkpoint's
                # saved-tensor hooks (activation recomputation would count them as its own)
                times = {c: 1e3 * t for c, t in self.timer(runs).items()}
            choice = min(times, key=lambda c: (times[c], list(runs).index(c)))
            self.decisions[key] = Decision(base[0], what, choice, times, skipped)
            self._remember(base, key, choice)
            self.timings += 1
            self._save()
        return choice

    def _candidates(self, kind: str) -> tuple[str, ...]:
        return self.linear_candidates if kind == "tt_linear" else self.embedding_candidates

    def _fast_lookup(self, base: tuple) -> tuple[str, str | None]:
        """(key, choice) for a call described by ``base`` (kind, core shapes, token
        bucket, dtype, device, grad, bias). A dict read per call once decided; the full key
        (device model, threads, candidates, torch version) is built only on a first sight."""
        cands = self._candidates(base[0])
        known = self._fast.get((base, torch.get_num_threads(), cands))
        if known is not None:
            self.used.add(known[0])
            self._last[base] = known[1]
            return known
        kind, shapes, bucket, dtype, device, grad, extra = base
        parts = [kind, str(tuple(tuple(int(x) for x in s) for s in shapes)), f"T{bucket}",
                 str(dtype), _device_name(device), f"grad={int(grad)}"]  # fmt: skip
        if kind == "tt_linear":
            bias, dx, dw, halves = extra
            parts.append(f"bias={int(bias)}")
            if grad and not dx:  # timed without the dx GEMM: not the answer for a call with it
                parts.append("dx=0")
            if grad and not dw:  # a frozen layer: timed without the weight gradients
                parts.append("dw=0")
            if halves:  # comera and dense read halves built beforehand (GroupedHalves)
                parts.append("halves=1")
        else:
            parts.append(f"sync_free={int(extra)}")
        key = "|".join([*parts, f"from={','.join(cands)}", f"torch {torch.__version__}"])
        self.used.add(key)
        hit = self.lookup(key)
        if hit is None:
            return key, None
        self._remember(base, key, hit.choice)
        return key, hit.choice

    def last_choice(self, base: tuple) -> str | None:
        """The latest choice made or read for the call ``base`` in this process."""
        return self._last.get(base)

    def _remember(self, base: tuple, key: str, choice: str) -> None:
        self._fast[(base, torch.get_num_threads(), self._candidates(base[0]))] = (key, choice)
        self._last[base] = choice

    @contextlib.contextmanager
    def restrict(self, linear: Sequence[str]) -> Iterator[PlanTuner]:
        """Decide TT linears among ``linear`` only, for as long as the block runs (a step
        that ``torch.compile`` traces takes the plain-GEMM plans ``comera`` and ``dense``;
        opt_einsum's paths do not trace). Keys name the candidates, so decisions made
        under a restriction never answer an unrestricted call."""
        saved = self.linear_candidates
        self.linear_candidates = tuple(c for c in saved if c in linear) or ("comera",)
        try:
            yield self
        finally:
            self.linear_candidates = saved

    # ------------------------------------------------------------------ TT linear

    def linear(
        self,
        cores: Sequence[torch.Tensor],
        x2d: torch.Tensor,
        bias: torch.Tensor | None,
        fallback: str = "comera",
        *,
        halves: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> str:
        """The plan for ``tt_linear`` of ``x2d (T, N)`` with these gated ``cores``;
        ``halves``: the layer's ``(A, B)`` built beforehand (:class:`GroupedHalves`), which
        the ``comera`` and ``dense`` paths then read (and are timed reading)."""
        base = _linear_call(cores, x2d, bias, halves is not None)
        _, shapes, bucket, dtype, _, grad, (has_bias, dx, dw, _) = base
        tokens = x2d.shape[0]
        key, choice = self._fast_lookup(base)
        if choice is not None:
            return choice
        if _cannot_time(x2d, *cores) or tokens == 0:
            return fallback
        d = len(shapes) // 2
        m, n = math.prod(s[1] for s in shapes[:d]), math.prod(s[1] for s in shapes[d:])
        ranks = [s[2] for s in shapes[:-1]]
        fewest = _fewest(bucket)
        no_dx = " no dx" if grad and not dx else ""
        no_dw = " no dW" if grad and not dw else ""
        # the modes too: two layers of one size and ranks but other modes are other calls
        modes = (f"[{','.join(str(s[1]) for s in shapes[:d])} | "
                 f"{','.join(str(s[1]) for s in shapes[d:])}]")  # fmt: skip
        what = (f"{m}x{n} {modes} ranks {','.join(map(str, ranks))} tokens {bucket} {dtype}"
                f"{'' if grad else ' no grad'}{no_dx}{no_dw}{' bias' if has_bias else ''}"
                f"{' halves' if halves is not None else ''}"
                f"{self._restricted('tt_linear')}")  # fmt: skip
        skipped: dict[str, str] = {}
        plans = {c: tt_linear_plan(c, shapes, tokens) for c in {*self.linear_candidates, "comera"}}
        flops = {c: plans[c].flops for c in self.linear_candidates}
        cheapest = max(min(flops.values()), 1)  # a dead bond's map costs nothing
        # the memory rule: tensors built from the cores alone (dense's W, an opt_einsum
        # path's cores contracted before x) are kept for backward; beyond what the comera
        # plan builds (its halves), at most 5% of the call's activations. Halves built
        # beforehand exist whatever the plan: dense reads them (its excess is W), while
        # another path builds all of its core-only tensors on top
        own = plans["comera"].weight_elements()
        runs: dict[str, Callable[[], None]] = {}
        for c in self.linear_candidates:
            base_elements = own if halves is None or c == "dense" else 0
            extra = plans[c].weight_elements() - base_elements if grad and c != "comera" else 0
            if extra > DENSE_SHARE * fewest * (m + n):
                built = f"W {m}x{n}" if c == "dense" else f"{extra} more weight elements"
                skipped[c] = f"{built} > {DENSE_SHARE:g} of T x (N + M) at T = {fewest}"
            elif flops[c] > FLOP_PRUNE * cheapest and c != fallback:
                skipped[c] = f"{flops[c] / cheapest:.0f}x the cheapest forward FLOPs"
            else:
                runs[c] = self._linear_run(c, shapes, x2d, cores, bias, grad, halves)
        return self._decide(base, key, what, runs, skipped)

    def _restricted(self, kind: str) -> str:
        """`` of a/b`` when ``kind``'s candidates are not the default set (a decision
        under :meth:`restrict` is another decision, and says so)."""
        cands = self._candidates(kind)
        default = LINEAR_CANDIDATES if kind == "tt_linear" else EMBEDDING_CANDIDATES
        return "" if cands == tuple(default) else f" of {'/'.join(cands)}"

    @staticmethod
    def _linear_run(
        strategy: str,
        shapes: tuple[tuple[int, ...], ...],
        x2d: torch.Tensor,
        cores: Sequence[torch.Tensor],
        bias: torch.Tensor | None,
        grad: bool,
        halves: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Callable[[], None]:
        # what the call differentiates, no more: no dx, or no weight gradients for a
        # frozen layer; with built halves comera and dense read (and differentiate) those
        x = _fresh(x2d, grad and x2d.requires_grad)
        direct = strategy in DIRECT_STRATEGIES
        weights = halves if direct and halves is not None else cores
        gs = [_fresh(c, grad and c.requires_grad) for c in weights]
        b = _fresh(bias, grad and bias is not None and bias.requires_grad)
        leaves = [t for t in (x, *gs, b) if t is not None and t.requires_grad]
        plan = None if direct else tt_linear_plan(strategy, shapes, x2d.shape[0])
        built = direct and halves is not None

        def run() -> None:
            with torch.set_grad_enabled(grad):
                y = (contract_halves(strategy, x, gs, b, built=built) if plan is None
                     else plan(x, gs, b))  # fmt: skip
                if grad:
                    torch.autograd.grad(y, leaves, torch.ones_like(y), allow_unused=True)

        return run

    # ------------------------------------------------------------------ TTM lookup

    def embedding(
        self,
        cores: Sequence[torch.Tensor],
        flat_ids: torch.Tensor,
        lookup: Lookup,
        fallback: str = "optimized",
        *,
        sync_free: bool = False,
    ) -> str:
        """The implementation for ``ttm_embedding`` of ``flat_ids`` with these gated cores:
        ``optimized`` (dedup, chain over unique rows) or ``table`` (rebuild, then index).
        ``lookup(impl, cores, flat_ids)`` runs one (``comera.layers`` passes its own)."""
        base = _embedding_call(cores, flat_ids, sync_free)
        _, shapes, bucket, dtype, _, grad, _ = base
        n_ids = flat_ids.numel()
        key, choice = self._fast_lookup(base)
        if choice is not None:
            return choice
        if _cannot_time(flat_ids, *cores) or n_ids == 0:
            return fallback
        rows = math.prod(s[1] for s in shapes)
        dim = math.prod(s[2] for s in shapes)
        ranks = [s[3] for s in shapes[:-1]]
        fewest = _fewest(bucket)
        modes = (f"[{','.join(str(s[1]) for s in shapes)} x "
                 f"{','.join(str(s[2]) for s in shapes)}]")  # fmt: skip
        what = (f"{rows}x{dim} {modes} ranks {','.join(map(str, ranks))} ids={bucket} {dtype}"
                f"{'' if grad else ' no grad'}{' sync-free' if sync_free else ''}"
                f"{self._restricted('ttm_embedding')}")  # fmt: skip
        skipped: dict[str, str] = {}
        runs: dict[str, Callable[[], None]] = {}
        for c in self.embedding_candidates:
            if c == "table" and rows > fewest:
                skipped[c] = f"table of {rows} rows > {fewest} ids looked up"
            else:
                run_as = "static" if c == "optimized" and sync_free else c
                runs[c] = self._embedding_run(lookup, run_as, cores, flat_ids, grad)
        return self._decide(base, key, what, runs, skipped)

    @staticmethod
    def _embedding_run(
        lookup: Lookup, impl: str, cores: Sequence[torch.Tensor], flat_ids: torch.Tensor,
        grad: bool,
    ) -> Callable[[], None]:  # fmt: skip
        gs = [_fresh(c, grad) for c in cores]
        ids = flat_ids.detach().clone()

        def run() -> None:
            with torch.set_grad_enabled(grad):
                y = lookup(impl, gs, ids)
                if grad:
                    torch.autograd.grad(y, gs, torch.ones_like(y), allow_unused=True)

        return run


def _linear_call(
    cores: Sequence[torch.Tensor],
    x2d: torch.Tensor,
    bias: torch.Tensor | None,
    halves: bool = False,
) -> tuple:
    weights = any(c.requires_grad for c in cores)
    trained_bias = bias is not None and bias.requires_grad
    grad = torch.is_grad_enabled() and (x2d.requires_grad or weights or trained_bias)
    shapes = tuple(tuple(c.shape) for c in cores)
    bucket = token_bucket(x2d.shape[0])
    # the timing runs compute dx and the cores' gradients only where the call does (a
    # bias's alone is a sum over tokens: it does not make a call one of the cores' dW)
    dx, dw = grad and x2d.requires_grad, grad and weights
    return ("tt_linear", shapes, bucket, _compute_dtype(x2d), x2d.device, grad,
            (bias is not None, dx, dw, halves))  # fmt: skip


TRACEABLE = ("comera", "dense", "optimized", "static", "table")  # plans torch.compile traces


@constant_under_compile
def _traced_choice(base: tuple, fallback: str) -> str:
    """While ``torch.compile`` traces: the decision the eager pass before it made for this
    call (read once, as a constant), if it is a plan that traces; else ``fallback``."""
    choice = current_tuner().last_choice(base)
    return choice if choice in TRACEABLE else fallback


def choose_linear(
    cores: Sequence[torch.Tensor],
    x2d: torch.Tensor,
    bias: torch.Tensor | None,
    halves: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> str:
    """The ``auto`` plan of a ``tt_linear`` call: the tuner in force decides (or a traced
    call reads what it decided). ``halves``: the layer's prebuilt ``(A, B)``, if any."""
    if torch.compiler.is_compiling():
        return _traced_choice(_linear_call(cores, x2d, bias, halves is not None), "comera")
    return current_tuner().linear(cores, x2d, bias, halves=halves)


def choose_embedding(
    cores: Sequence[torch.Tensor], flat_ids: torch.Tensor, lookup: Lookup, sync_free: bool = False
) -> str:
    """The ``auto`` implementation of a ``ttm_embedding`` call (see :func:`choose_linear`);
    ``sync_free``: the call may not read the device, so ``optimized`` runs (and is timed)
    as ``static``."""
    if torch.compiler.is_compiling():
        return _traced_choice(_embedding_call(cores, flat_ids, sync_free), "optimized")
    return current_tuner().embedding(cores, flat_ids, lookup, sync_free=sync_free)


def _embedding_call(
    cores: Sequence[torch.Tensor], flat_ids: torch.Tensor, sync_free: bool = False
) -> tuple:
    grad = torch.is_grad_enabled() and any(c.requires_grad for c in cores)
    shapes = tuple(tuple(c.shape) for c in cores)
    bucket = token_bucket(flat_ids.numel())
    dtype, device = _compute_dtype(cores[0]), cores[0].device
    return ("ttm_embedding", shapes, bucket, dtype, device, grad, sync_free)


def summarize_decisions(decisions: dict[str, dict]) -> str:
    """One line: how many calls of each kind run each choice (``tt_linear: comera 4,
    dense 8; ttm_embedding: table 1``)."""
    counts: dict[str, dict[str, int]] = {}
    for d in decisions.values():
        kind = counts.setdefault(d["kind"], {})
        kind[d["choice"]] = kind.get(d["choice"], 0) + 1
    return "; ".join(
        f"{kind}: " + ", ".join(f"{c} {n}" for c, n in sorted(ch.items()))
        for kind, ch in sorted(counts.items())
    )


# ---------------------------------------------------------------------- the tuner in force

_PROCESS_TUNER: list[PlanTuner] = [PlanTuner()]
_SCOPED_TUNER: ContextVar[PlanTuner | None] = ContextVar("comera_plan_tuner", default=None)


def current_tuner() -> PlanTuner:
    """The tuner ``auto`` plans ask: the innermost :func:`use_tuner` scope, else the
    process's (memory only until :func:`set_tuner` gives one with a cache directory)."""
    scoped = _SCOPED_TUNER.get()
    return scoped if scoped is not None else _PROCESS_TUNER[0]


def set_tuner(tuner: PlanTuner | None) -> None:
    """Make ``tuner`` the process's (None: a fresh memory-only one)."""
    _PROCESS_TUNER[0] = tuner if tuner is not None else PlanTuner()


@contextlib.contextmanager
def use_tuner(tuner: PlanTuner) -> Iterator[PlanTuner]:
    """Use ``tuner`` in this thread/context only (``with use_tuner(PlanTuner(dir)):``)."""
    token = _SCOPED_TUNER.set(tuner)
    try:
        yield tuner
    finally:
        _SCOPED_TUNER.reset(token)
