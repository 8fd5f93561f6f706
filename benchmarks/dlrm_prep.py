"""How fast, and in how much memory, the Criteo preprocessing runs at scale.

    python -m benchmarks.dlrm_prep [--rows 4000000] [--file PATH] [--json]
    python -m benchmarks.dlrm_prep --render RESULT.json   # the table of a saved --json

Writes a Criteo-format file of ``--rows`` rows shaped like Kaggle's (the reference's 26
cardinalities with heavy-headed ids, 10% of dense and 3% of categorical fields empty; no
planted signal: this measures the pipeline, not a model), unless ``--file`` names an
existing Criteo file, then preprocesses it into a fresh cache in a child process while
sampling the child's resident memory. Prints rows/s, the peak anonymous memory (what the
process allocated itself; also above its baseline after imports, before the work starts)
and the peak file-backed memory (pages of the memory-mapped
output columns, which the kernel can write back and drop), and the time the Kaggle file
(45,840,617 rows) would take at the same rate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.reporting import (
    add_json_and_render,
    arg_parser,
    one_line_errors,
    print_rendered,
    render_only,
)
from experiments.host import host_meta, report_header

__all__ = ["main", "measure", "render", "write_kaggle_like"]

KAGGLE_ROWS = 45_840_617
PROG = "python -m benchmarks.dlrm_prep"
ROWS = 4_000_000  # rows of the generated file by default
# a file of fewer rows is timed mostly in start-up: no Kaggle estimate is shown from it
# (the 200-row sample gave 718 minutes)
ESTIMATE_MIN_ROWS = 100_000


def write_kaggle_like(path: Path, rows: int, seed: int = 0, chunk: int = 250_000) -> None:
    """``rows`` Criteo-format lines with Kaggle's cardinalities, written chunk by chunk."""
    from experiments.dlrm.model import KAGGLE_CARDINALITIES

    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            label = (rng.random(n) < 0.26).astype(np.int64).astype(str)
            dense = np.floor(rng.lognormal(1.0, 1.5, size=(n, 13))).astype(np.int64).astype(str)
            dense[rng.random((n, 13)) < 0.1] = ""
            cats = np.empty((n, 26), dtype="<U8")
            for j, vocab in enumerate(KAGGLE_CARDINALITIES):
                # value k with probability ~ 1 / (k + 10), as the smoke generator draws them
                u = rng.random(n)
                k = np.minimum((np.exp(u * np.log(vocab / 10 + 1)) - 1) * 10, vocab - 1)
                hashed = (k.astype(np.uint64) * np.uint64(2654435761) + np.uint64(j)) % (1 << 32)
                cats[:, j] = np.char.zfill(np.char.mod("%x", hashed), 8)
            cats[rng.random((n, 26)) < 0.03] = ""
            table = np.concatenate([label[:, None], dense, cats], axis=1)
            f.write("\n".join("\t".join(r) for r in table.tolist()) + "\n")


def _child(path: str, cache: str) -> None:
    from experiments.dlrm.data import CriteoDataConfig, load_criteo

    base = _status_mb(os.getpid())
    t = time.perf_counter()
    data = load_criteo(CriteoDataConfig(path=path, cache_dir=cache), progress=False)
    out = {"rows": len(data), "seconds": time.perf_counter() - t}
    print(json.dumps({**out, "base_anon_mb": base[0] if base else 0}))


def _status_mb(pid: int) -> tuple[int, int] | None:
    """(RssAnon, RssFile) of ``pid`` in MB from /proc (Linux), or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    vals = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            vals[key] = int(rest.split()[0]) // 1024
    return (vals["RssAnon"], vals["RssFile"]) if len(vals) == 2 else None


def measure(path: Path) -> dict:
    """Preprocess ``path`` into a fresh cache in a child process; its time and peaks."""
    cache = tempfile.mkdtemp(prefix="criteo-prep-")
    try:
        cmd = [sys.executable, "-m", "benchmarks.dlrm_prep", "--child", str(path), cache]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        peak_anon = peak_file = 0
        while proc.poll() is None:
            mb = _status_mb(proc.pid)
            if mb:
                peak_anon, peak_file = max(peak_anon, mb[0]), max(peak_file, mb[1])
            time.sleep(0.05)
        out = proc.stdout.read() if proc.stdout else ""
        if proc.returncode == 2:  # bad input: the child said what in one line
            raise SystemExit(2)
        if proc.returncode:
            raise SystemExit(f"benchmarks.dlrm_prep: preprocessing failed (exit {proc.returncode})")
        res = json.loads(out.strip().splitlines()[-1])
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    rate = res["rows"] / res["seconds"]
    return {
        "rows": res["rows"],
        "file_mb": path.stat().st_size / 2**20,
        "seconds": res["seconds"],
        "rows_per_s": rate,
        "peak_anon_mb": peak_anon,
        "peak_anon_above_baseline_mb": peak_anon - res["base_anon_mb"],
        "peak_file_mb": peak_file,
        "kaggle_minutes_at_this_rate": KAGGLE_ROWS / rate / 60,
        **host_meta(),  # cpu, torch, date: the header of its table
    }


def render(res: dict, command: str | None = None) -> str:
    """The table of a result (the ``--json`` object), from the result alone: its header
    names ``command``, by default the one the result records (older results, which record
    none, came from ``--json``)."""
    command = command or res.get("command", f"{PROG} --json")
    meta = {"cpu": res.get("cpu"), "torch": res.get("torch"), "date": res.get("date")}
    rows = [
        ("rows", f"{res['rows']:,}"),
        ("file (MB)", f"{res['file_mb']:.0f}"),
        ("seconds", f"{res['seconds']:.1f}"),
        ("rows/s", f"{res['rows_per_s']:,.0f}"),
        ("peak anonymous memory above the process's baseline (MB)",
         f"{res['peak_anon_above_baseline_mb']}"),
        ("peak anonymous memory in all (MB)", f"{res['peak_anon_mb']}"),
        ("peak file-backed memory (MB)", f"{res['peak_file_mb']}"),
        (f"the Kaggle file ({KAGGLE_ROWS:,} rows) at this rate (min)",
         f"{res['kaggle_minutes_at_this_rate']:.1f}" if res["rows"] >= ESTIMATE_MIN_ROWS
         else f"n/a: under {ESTIMATE_MIN_ROWS:,} rows, start-up dominates the rate"),
    ]  # fmt: skip
    lines = report_header("Criteo preprocessing at scale", command, meta)
    lines += ["| measure | value |", "|---|---:|", *[f"| {a} | {b} |" for a, b in rows], ""]
    return "\n".join(lines)


@one_line_errors(PROG)
def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(PROG, __doc__.split("\n")[0])
    source = ap.add_mutually_exclusive_group()  # a file given is not generated
    source.add_argument(
        "--rows", type=int, default=None, help=f"rows of the generated file (default {ROWS:,})"
    )
    source.add_argument("--file", help="an existing Criteo file to preprocess instead")
    add_json_and_render(ap, "measure nothing: print the table of a saved --json result")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.render is not None:  # measuring flags beside it would do nothing
        render_only(ap, argv)
    args.rows = ROWS if args.rows is None else args.rows
    if args.child:
        from comera.errors import UserError

        try:
            _child(*args.child)
        except UserError as e:  # a file that is not Criteo: one line, as training says it
            # the data module's advice names training's flags: here the file is --file and
            # the cache a temporary folder
            text = re.sub(r"--data\b", "--file", str(e)).replace(
                "point --cache-dir (data.cache_dir) at",
                "point $TMPDIR (where the benchmark caches) at",
            )
            print(f"{ap.prog}: error: {text}", file=sys.stderr)
            return 2
        return 0
    if args.render is not None:
        return print_rendered(args.render, render, ap.prog)
    if args.rows < 100:
        print(f"{ap.prog}: error: --rows must be >= 100, got {args.rows}", file=sys.stderr)
        return 2
    tmp = None
    if args.file:
        path = Path(args.file)
        if not path.is_file():
            what = "a folder; give a Criteo train.txt" if path.is_dir() else "no such file"
            print(f"{ap.prog}: error: --file {path}: {what}", file=sys.stderr)
            return 2
    else:
        tmp = tempfile.mkdtemp(prefix="criteo-gen-")
        path = Path(tmp) / "train.txt"
        t = time.perf_counter()
        write_kaggle_like(path, args.rows)
        print(f"wrote {args.rows:,} rows in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    try:
        res = measure(path)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    flags = ["--file", str(path)] if args.file else ["--rows", str(args.rows)]
    # what measured it, kept in the result: --render of the saved JSON names the same command
    res["command"] = " ".join([PROG, *flags, *(["--json"] if args.json else [])])
    print(json.dumps(res, indent=1) if args.json else render(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
