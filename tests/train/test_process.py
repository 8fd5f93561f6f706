"""A Trainer leaves its process as it found it: environment, allocator policy, threads and
global torch settings belong to the entry points (``experiments.cli`` applies
``train.cpu_malloc``), never to the library.

Each check runs in a fresh interpreter, where nothing else has touched the process. glibc
has no getter for its malloc parameters, so the probe reads them from behaviour: whether a
block gets its own ``mmap`` (``mallinfo2().hblks``) tells where the mmap threshold is; it
also records every ``mallopt`` looked up through ``ctypes``. The probe is first shown to
see the policies ``experiments.malloc`` sets."""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import ctypes, json, os, sys
sys.path.insert(0, {root!r})
for name in ("execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp"):
    def refuse(*args, _name=name):
        raise AssertionError(f"os.{{_name}} called: the process was re-executed")
    setattr(os, name, refuse)

mallopt_calls = []


class WatchedCDLL(ctypes.CDLL):
    # records every lookup of mallopt through ctypes (how Python code sets malloc's policy)
    def __getattr__(self, name):
        if name == "mallopt":
            mallopt_calls.append(self._name)
        return super().__getattr__(name)

    def __getitem__(self, name):
        if name == "mallopt":
            mallopt_calls.append(self._name)
        return super().__getitem__(name)


ctypes.CDLL, ctypes.cdll = WatchedCDLL, ctypes.LibraryLoader(WatchedCDLL)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
          "fordblks", "keepcost")
if hasattr(libc, "mallinfo2"):  # glibc >= 2.33
    class Info(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in FIELDS]
    libc.mallinfo2.restype = Info
    info = libc.mallinfo2
else:
    class Info(ctypes.Structure):
        _fields_ = [(f, ctypes.c_int) for f in FIELDS]
    libc.mallinfo.restype = Info
    info = libc.mallinfo

MiB = 1 << 20


def mapped(size):
    # whether glibc serves a block of `size` bytes with a mmap of its own
    before = info().hblks
    block = libc.malloc(size)
    after = info().hblks
    libc.free(block)
    return after > before


def thresholds():
    # glibc's own default: a freed 8 MiB mapping raises the dynamic threshold to 8 MiB, so
    # 2 MiB comes from the heap; 64 MiB is above the dynamic maximum (32 MiB) and mapped.
    # A fixed threshold (mallopt) of 1 MiB maps 2 MiB; one of 1 GiB maps neither.
    return {{"2MiB": mapped(2 * MiB), "64MiB": mapped(64 * MiB)}}


libc.free(libc.malloc(8 * MiB))
import torch
env = dict(os.environ)
settings = lambda: {{
    "threads": torch.get_num_threads(),
    "dtype": str(torch.get_default_dtype()),
    "deterministic": torch.are_deterministic_algorithms_enabled(),
    "matmul_precision": torch.get_float32_matmul_precision(),
    "grad": torch.is_grad_enabled(),
}}
before = {{"malloc": thresholds(), "settings": settings()}}
policy = {policy!r}
if policy:  # the control: what an entry point's allocator policy looks like to the probe
    from experiments.malloc import set_cpu_malloc
    assert set_cpu_malloc(policy)
else:
    from tests.train_helpers import ToyTask, _cfg, _toy_model
    from comera.train import Trainer
    from pathlib import Path
    # a config asking for a policy: applying it is the entry point's job, not the Trainer's
    cfg = _cfg(Path({tmp!r}), steps=6, cpu_malloc="release", checkpoint_every=3)
    trainer = Trainer(cfg, ToyTask(), *_toy_model())
    trainer.train_step(next(iter(trainer.task.train_iter)))
    trainer.fit()
after = {{"malloc": thresholds(), "settings": settings()}}
print(json.dumps({{
    "mallopt": mallopt_calls,
    "before": before, "after": after, "env_changed": sorted(
        k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)),
    "experiments": sorted(m for m in sys.modules if m.split(".")[0] in
                          ("experiments", "benchmarks")),
}}))
"""

DEFAULT = {"2MiB": False, "64MiB": True}


def _probe(tmp_path: Path, policy: str | None) -> dict:
    code = PROBE.format(root=str(ROOT), policy=policy, tmp=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


glibc = pytest.mark.skipif(
    sys.platform != "linux" or ctypes.util.find_library("c") is None,
    reason="the probe reads glibc's malloc counters",
)


@glibc
@pytest.mark.parametrize(
    ("policy", "seen"), [("release", {"2MiB": True, "64MiB": True}), ("keep", {"2MiB": False,
                                                                             "64MiB": False})]
)  # fmt: skip
def test_the_probe_sees_an_allocator_policy(tmp_path, policy, seen):
    """The control: after ``experiments.malloc.set_cpu_malloc`` the probe reads a
    different allocator, so the test below could fail."""
    got = _probe(tmp_path, policy)
    assert got["mallopt"]  # the policy's mallopt calls were seen
    assert got["before"]["malloc"] == DEFAULT
    assert got["after"]["malloc"] == seen != DEFAULT


@glibc
def test_a_trainer_leaves_the_process_as_it_found_it(tmp_path):
    """Build a Trainer whose config asks for ``cpu_malloc='release'``, take a step, fit
    and checkpoint: malloc's thresholds, the environment, torch's threads and global
    settings are unchanged, nothing re-executed the process, and neither experiments nor
    benchmarks (where ``experiments.malloc`` lives) was imported."""
    got = _probe(tmp_path, None)
    assert got["mallopt"] == []  # nothing looked mallopt up through ctypes
    assert got["before"]["malloc"] == DEFAULT
    assert got["after"] == got["before"]
    assert got["env_changed"] == []
    assert got["experiments"] == []
    assert (tmp_path / "run" / "metrics.jsonl").is_file()  # the run really trained
