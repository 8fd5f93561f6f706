"""A training process killed with SIGKILL resumes from its last checkpoint exactly."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from loaders import TokenLoader, load_states
from tests.loaders_helpers import config, make_corpus

CHILD = """
import hashlib, sys, time
from pathlib import Path
from loaders import TokenLoader, load_states
from tests.loaders_helpers import config
root, ckpt, log = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
resume, total, hold = sys.argv[4] == "1", int(sys.argv[5]), int(sys.argv[6])
ld = TokenLoader(config([("a", root / "a", 0.6), ("b", root / "b", 0.4)], seq_len=37))
step = 0
if resume:
    ld.load(ckpt)
    step = load_states(ckpt)[0]["step"]
with open(log, "a") as f:
    while step < total:
        batch = next(ld)
        step += 1
        f.write(f"{step} {hashlib.sha1(batch['input_ids'].numpy().tobytes()).hexdigest()}\\n")
        f.flush()
        if step % 3 == 0:
            ld.save(ckpt, step=step)
        # waits there to be killed: a test process descheduled for the 0.8 s the 80 steps
        # take found the child done, not running
        time.sleep(60 if step == hold else 0.01)
"""


def _digest(batch) -> str:
    return hashlib.sha1(batch["input_ids"].numpy().tobytes()).hexdigest()


def test_sigkill_then_restart_continues_exactly(tmp_path):
    root = tmp_path / "corpus"
    make_corpus(root / "a", 73, first_id=0, seed=31)
    make_corpus(root / "b", 45, first_id=5000, seed=32)
    total = 80
    ref = TokenLoader(config([("a", root / "a", 0.6), ("b", root / "b", 0.4)], seq_len=37))
    expected = [f"{s + 1} {_digest(next(ref))}" for s in range(total)]

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo))
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.txt"

    def launch(resume: bool) -> subprocess.Popen:
        args = [
            sys.executable,
            str(script),
            str(root),
            str(ckpt),
            str(log),
            "1" if resume else "0",
            str(total),
            "0" if resume else str(kill_after),
        ]
        return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    kill_after = random.Random(7).randint(10, 40)
    proc = launch(False)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if log.exists() and len(log.read_text().splitlines()) >= kill_after:
            break
        time.sleep(0.005)
    assert proc.poll() is None, proc.stdout.read().decode()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lines = log.read_text().splitlines()
    assert lines == expected[: len(lines)]
    saved = load_states(ckpt)[0]["step"]
    assert saved >= 9 and saved % 3 == 0

    log.write_text("")
    proc = launch(True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out.decode()
    assert log.read_text().splitlines() == expected[saved:]
