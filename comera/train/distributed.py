"""Exact data-parallel arithmetic without the DDP wrapper.

Every rank computes the gradient of its loss *sum* and counts its loss terms; one flat
all-reduce per dtype sums gradients, loss sums, counts and metric sums, and dividing by the
global count gives the gradient of the global mean: right for masked-LM (masked tokens differ
per rank), padded rows and short last batches. Missing (``None``) gradients are zero-filled
on every rank so the flat buffers line up; dtypes are reduced in a fixed order.

We do not wrap the model in ``DistributedDataParallel``: compaction changes parameter
shapes, which DDP's reducer cannot follow without being rebuilt.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist

from comera.errors import ConfigError

__all__ = [
    "broadcast_object",
    "broadcast_tensors",
    "check_alike",
    "check_rank_device",
    "init_distributed",
    "launched_world",
    "own_process_group",
    "rank_first",
    "rank_world",
    "sum_across_ranks",
    "union_names",
]

T = TypeVar("T")


def rank_world() -> tuple[int, int]:
    """This process's rank and the world size (0, 1 without a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def launched_world() -> int:
    """The number of processes the launcher started (``WORLD_SIZE``; 1 when it is unset or
    empty), without joining any group; text there is a :class:`ConfigError`."""
    try:
        return int(os.environ.get("WORLD_SIZE") or "1")  # set empty: as unset
    except ValueError:
        raise ConfigError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a process count; launch with "
            "torchrun, or unset WORLD_SIZE to run one process"
        ) from None


def init_distributed(device: str) -> tuple[int, int]:
    """Join the process group when launched by torchrun (``WORLD_SIZE`` > 1): gloo on CPU,
    nccl on CUDA, each rank on its ``LOCAL_RANK`` GPU. A group joined here is left at exit
    (if still held): a script need not call ``destroy_process_group`` itself."""
    world = launched_world()
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        # set by hand without torchrun's other variables: a ValueError traceback from
        # torch's rendezvous
        unset = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if unset:
            raise ConfigError(
                f"WORLD_SIZE={world} but {', '.join(unset)} {'is' if len(unset) == 1 else 'are'}"
                " not set; launch with torchrun (which sets them all), or unset WORLD_SIZE "
                "to run one process"
            )
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        atexit.register(_leave, dist.group.WORLD)
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_rank(), dist.get_world_size()


def _leave(group: object) -> None:
    """Leave at exit the group :func:`init_distributed` joined, if it is still the one held.
    A process that exits holding a gloo group can abort in its teardown ("terminate called
    without an active exception", status -6) after it has finished, or after printing its
    one-line error: a script that lets the ``Trainer`` join the group need not leave it."""
    if dist.is_available() and dist.is_initialized() and dist.group.WORLD is group:
        dist.destroy_process_group()


@contextlib.contextmanager
def own_process_group() -> Iterator[None]:
    """Leave, on the way out, a process group joined inside the block (a command's
    :func:`init_distributed` under torchrun): a rank that exits still holding it closes
    connections under the others, which can abort a slower rank at exit (status -6) after
    its own one-line error. A group that existed before the block is its caller's, kept."""
    before = dist.is_available() and dist.is_initialized()
    try:
        yield
    finally:
        if not before and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def check_rank_device(device: str) -> None:
    """Refuse a CUDA device index that differs from this rank's GPU in a torchrun world:
    :func:`init_distributed` gives each rank its ``LOCAL_RANK`` GPU, and ``cuda:0`` on
    every rank would put them all on one device (NCCL refuses two ranks on one GPU)."""
    rank, world = rank_world()
    dev = torch.device(device)
    if world <= 1 or dev.type != "cuda" or dev.index is None:
        return
    mine = torch.cuda.current_device()
    if dev.index != mine:
        raise ConfigError(
            f"train.device={device} on rank {rank} of {world}: each rank runs on its "
            f"LOCAL_RANK GPU (cuda:{mine} here), and one index would put every rank on one "
            "GPU; give --device cuda"
        )


def _groups(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` by dtype, dtypes in a fixed (name) order on every rank."""
    by: dict[str, list[int]] = {}
    for i, t in enumerate(tensors):
        by.setdefault(str(t.dtype), []).append(i)
    return [by[k] for k in sorted(by)]


def sum_across_ranks(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sum every tensor over ranks with one flat all-reduce per dtype (a no-op alone).

    All ranks must pass the same shapes and dtypes in the same order."""
    if rank_world()[1] == 1 or not tensors:
        return tensors
    out: list[torch.Tensor] = list(tensors)
    for idx in _groups(tensors):
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        dist.all_reduce(flat)
        offset = 0
        for i in idx:
            n = tensors[i].numel()
            out[i] = flat[offset : offset + n].view_as(tensors[i])
            offset += n
    return out


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Copy rank ``src``'s values into every rank's tensors, in place (one flat broadcast
    per dtype), so replicas start identical however they were initialized or loaded."""
    if rank_world()[1] == 1 or not tensors:
        return
    with torch.no_grad():
        for idx in _groups(tensors):
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
            dist.broadcast(flat, src)
            offset = 0
            for i in idx:
                n = tensors[i].numel()
                tensors[i].copy_(flat[offset : offset + n].view_as(tensors[i]))
                offset += n


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` (picklable) on every rank; ``obj`` itself alone."""
    if rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def check_alike(tensors: list[torch.Tensor], names: list[str], what: str) -> None:
    """Refuse, on every rank alike, ``tensors`` whose count, dtypes or shapes differ from
    rank 0's, before :func:`broadcast_tensors` copies rank 0's into them: it packs each
    dtype's tensors into one buffer, so a rank that built one of another size took values
    at other offsets into the rest without a word, or aborted in the transport. ``what``
    names them in the error (e.g. "frozen tensors")."""
    world = rank_world()[1]
    if world == 1:
        return
    mine = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors]
    ref = broadcast_object(mine)
    first = None
    if mine != ref:
        pairs = enumerate(zip(mine, ref, strict=False))  # the shorter list may end first
        at = next((i for i, (a, b) in pairs if a != b), min(len(mine), len(ref)))
        held = f"{mine[at][0]}{list(mine[at][1])}" if at < len(mine) else "none"
        want = f"{ref[at][0]}{list(ref[at][1])}" if at < len(ref) else "none"
        name = names[at] if at < len(names) else f"#{at}"
        first = f"{name}: {held} here, {want} on rank 0"
    told: list[str | None] = [None] * world
    dist.all_gather_object(told, first)
    bad = [(r, f) for r, f in enumerate(told) if f is not None]
    if bad:
        rank, said = bad[0]
        raise ConfigError(
            f"rank(s) {', '.join(str(r) for r, _ in bad)} built {what} other than rank 0's "
            f"(rank {rank}: {said}); build the model the same way on every rank"
        )


def union_names(names: list[str]) -> list[str]:
    """The sorted union of every rank's ``names`` (one gather of the lists): ranks whose
    task returned other metric names reduce them by name, not by position."""
    if rank_world()[1] == 1:
        return sorted(set(names))
    gathered: list[list[str] | None] = [None] * rank_world()[1]
    dist.all_gather_object(gathered, sorted(set(names)))
    return sorted({n for g in gathered for n in g or ()})


def rank_first(fn: Callable[[], T], rank: int, world: int) -> T:
    """Run ``fn`` on rank 0 while the other ranks wait, then on the others: rank 0 builds
    something shared (a preprocessed cache) once, and the rest find it built. If ``fn``
    fails on rank 0 (a data file that is missing, not Criteo), the others raise its error
    too: they waited at a barrier until rank 0's exit closed the process group under them,
    a transport traceback instead of the one line."""
    if world == 1:
        return fn()
    if rank != 0:
        failed = broadcast_object(None)  # rank 0's error, or None once it is done
        if failed is not None:
            raise failed
        return fn()
    try:
        out = fn()
    except BaseException as e:  # a Ctrl-C too: the others would wait for the group's end
        try:  # the exception itself (its kind decides how a command reports it)
            told: BaseException = pickle.loads(pickle.dumps(e))
        except Exception:  # noqa: BLE001 - one that cannot travel goes as its text
            told = RuntimeError(f"rank 0 failed: {type(e).__name__}: {e}")
        broadcast_object(told)
        raise
    broadcast_object(None)
    return out
