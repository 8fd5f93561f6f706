"""The old benchmark commands forward to the new ones: one stderr line naming the new
command, then the new module's own output (cheap paths: help, refusals, --render)."""

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import moved

ROOT = Path(__file__).resolve().parents[2]
REPORTS = ROOT / "reports"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          check=False, cwd=ROOT, timeout=300)  # fmt: skip


def _notice(old: str, new: str) -> str:
    return f"`python -m {old}` has moved to `python -m {new}`"


@pytest.mark.parametrize(
    ("old", "new", "args", "rc", "out"),
    [
        ("comera.bench", "benchmarks.core", ["--help"], 0, "usage: python -m benchmarks.core"),
        ("loaders.bench", "benchmarks.loader", ["--help"], 0, "usage: python -m benchmarks.loader"),
        ("experiments.mnli_demo", "experiments.mnli.demo", ["--help"], 0,
         "usage: python -m experiments.mnli.demo"),
        ("experiments.efficiency", "benchmarks.efficiency", ["--batches", "x"], 2, ""),
        ("experiments.step_modes", "benchmarks.step_modes", ["--modes", "turbo"], 2, ""),
        ("experiments.dlrm.bench", "benchmarks.dlrm_step",
         ["--render", str(REPORTS / "dlrm_bench.json")], 0, "| dense_sgd |"),
        ("experiments.dlrm.prep_bench", "benchmarks.dlrm_prep", ["--file", "missing.txt"], 2, ""),
        ("experiments.codebert.bench", "benchmarks.codebert_step",
         ["--render", str(REPORTS / "codebert_bench.json")], 0, "| comera_half |"),
        ("experiments.report", "experiments.mnli.report", ["--help"], 0,
         "usage: python -m experiments.mnli.report"),
    ],
)  # fmt: skip
def test_old_command_names_the_new_one_and_runs_it(old, new, args, rc, out) -> None:
    proc = _run(old, *args)
    assert proc.returncode == rc, proc.stderr
    lines = proc.stderr.splitlines()
    assert _notice(old, new) in lines[0] and not any(_notice(old, new) in x for x in lines[1:])
    assert out in proc.stdout
    assert "Traceback" not in proc.stderr


def test_old_core_command_prints_the_new_ones_json() -> None:
    """``python -m comera.bench --quick --json``: the same JSON keys as the new command."""
    proc = _run("comera.bench", "--quick", "--json", "--no-report")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"tt_linear", "fused_qkv", "ttm_embedding", "config"}
    assert proc.stderr.startswith("note: " + _notice("comera.bench", "benchmarks.core"))


@pytest.mark.parametrize("path", ["comera/bench.py", "loaders/bench.py"])
def test_library_forwards_import_no_benchmark(path) -> None:
    """comera and loaders never import benchmarks or experiments: their forwards run the
    new module by name, and only under ``__main__``."""
    tree = ast.parse((ROOT / path).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            assert not any(n.split(".")[0] in ("benchmarks", "experiments") for n in names)
    top = [n for n in tree.body if not isinstance(n, ast.Expr)]  # the docstring aside
    assert len(top) == 1 and isinstance(top[0], ast.If)  # everything under __main__


@pytest.mark.parametrize(
    ("exp", "new"),
    [("mnli", "benchmarks.mnli_step"), ("dlrm", "benchmarks.dlrm_step"),
     ("codebert", "benchmarks.codebert_step")],
)  # fmt: skip
def test_experiment_bench_flag_forwards_json_and_device(exp, new, monkeypatch, capsys) -> None:
    import importlib

    module = importlib.import_module(f"experiments.{exp}.experiment")
    calls = []
    monkeypatch.setattr(moved, "run_module", lambda m, argv: calls.append((m, argv)) or 0)
    assert module.main(["--bench", "--json", "--device", "cpu"]) == 0
    assert module.main(["--bench"]) == 0
    assert calls == [(new, ["--json", "--device", "cpu"]), (new, [])]
    err = capsys.readouterr().err.splitlines()
    assert err == [f"note: {_notice(f'experiments.{exp} --bench', new)}; the old name goes in "
                   "a later release"] * 2  # fmt: skip
    # every other flag was dropped unsaid: --steps 3 ran the whole benchmark (minutes)
    assert module.main(["--bench", "--steps", "3", "--set", "train.seed=1"]) == 2
    assert calls == [(new, ["--json", "--device", "cpu"]), (new, [])]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--bench takes only --json and --device" in err[0]
    assert f"python -m {new}); drop --set, --steps, or" in err[0]


def test_bench_flag_refusal_comes_from_the_benchmark(monkeypatch, capsys) -> None:
    """The CPU-only step benches refuse another device themselves (one line, exit 2), run
    for real through the forward: a CUDA device is faked as present, so the forward's
    device check passes where no GPU is, and the benchmark's own refusal speaks."""
    import torch

    from experiments.codebert import experiment as codebert
    from experiments.dlrm import experiment as dlrm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert codebert.main(["--bench", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert _notice("experiments.codebert --bench", "benchmarks.codebert_step") in err[0]
    assert err[1] == (
        "python -m benchmarks.codebert_step: error: --device cuda: the codebert step bench runs "
        "on the CPU; drop --device"
    )
    assert dlrm.main(["--bench", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        "python -m benchmarks.dlrm_step: error: --device cuda: the dlrm step bench runs on the CPU"
    )
    # a device torch cannot use here is the forward's refusal, before any bench starts
    proc = _run("experiments.dlrm", "--bench", "--device", "meta")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--device 'meta': a meta tensor holds no data" in proc.stderr.splitlines()[-1]


def test_run_module_turns_system_exit_into_a_status(monkeypatch, capsys) -> None:
    def fake(module, run_name, alter_sys):
        assert run_name == "__main__" and alter_sys and sys.argv == [module, "--x"]
        raise SystemExit({"m.a": 3, "m.b": None, "m.c": "boom"}[module])

    monkeypatch.setattr(moved.runpy, "run_module", fake)
    argv = list(sys.argv)
    assert [moved.run_module(m, ["--x"]) for m in ("m.a", "m.b", "m.c")] == [3, 0, 1]
    assert sys.argv == argv and capsys.readouterr().err == "boom\n"
    ns = argparse.Namespace(json=False, device=None)
    monkeypatch.setattr(moved, "run_module", lambda m, a: 5)
    assert moved.bench_forward("experiments.x", "benchmarks.x_step", ns) == 5
