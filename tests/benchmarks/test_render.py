"""Benchmark reports are rendered from their JSON alone: the committed reports are what
their committed JSON renders to, a header names the command, CPU, torch version and date
the JSON recorded ("not recorded" where it holds none), and ``--render`` measures nothing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import (
    codebert_step,
    core,
    dlrm_prep,
    dlrm_step,
    efficiency,
    loader,
    mnli_step,
    step_modes,
)
from benchmarks.reporting import read_result
from experiments.host import NOT_RECORDED, host_meta, report_header

ROOT = Path(__file__).resolve().parents[2]
REPORTS = ROOT / "reports"


def test_report_header_reads_its_fields_from_the_json() -> None:
    meta = {"cpu": "AMD EPYC (family 26, model 2)", "torch": "2.13.0+cpu", "date": "2026-12-02"}
    lines = report_header("Title", "python -m benchmarks.core", meta)
    assert lines[0] == "# Title" and "`python -m benchmarks.core`" in lines[2]
    assert lines[4] == "CPU: AMD EPYC (family 26, model 2); torch: 2.13.0+cpu; date: 2026-12-02."
    lines = report_header("Title", "cmd", {"cpu": "x", "torch": "", "date": None})
    assert lines[4] == f"CPU: x; torch: {NOT_RECORDED}; date: {NOT_RECORDED}."
    assert set(host_meta()) == {"cpu", "torch", "date"}


@pytest.mark.parametrize(
    ("module", "stem"), [(efficiency, "efficiency"), (step_modes, "step_modes")]
)
def test_committed_reports_are_their_json_rendered(module, stem) -> None:
    """Re-rendering the committed JSON gives the committed report, byte for byte: nothing
    in it comes from anywhere but the JSON."""
    result = read_result(REPORTS / f"{stem}.json")
    assert (REPORTS / f"{stem}.md").read_text() == module.render(result)


@pytest.mark.parametrize(
    ("module", "stem"),
    [
        (core, "gpu/bench_core_cuda"),
        (mnli_step, "gpu/mnli_bench_cuda"),
        (step_modes, "gpu/step_modes_paper/step_modes"),
        (step_modes, "gpu/step_modes_smoke/step_modes"),
    ],
)
def test_committed_gpu_reports_are_their_json_rendered(module, stem) -> None:
    """The GPU reports (measured by scripts/gpu_check.sh on a lent GPU) are likewise their
    JSON rendered, so a renderer change that would alter them shows here."""
    result = read_result(REPORTS / f"{stem}.json")
    assert (REPORTS / f"{stem}.md").read_text() == module.render(result)


_COMMITTED = [
    (efficiency.render, "efficiency.json"),
    (step_modes.render, "step_modes.json"),
    (mnli_step.render, "mnli_bench.json"),
    (dlrm_step.render, "dlrm_bench.json"),
    (codebert_step.render, "codebert_bench.json"),
]


@pytest.mark.parametrize(("render", "name"), _COMMITTED)
def test_every_committed_result_renders_with_the_header_its_json_holds(render, name) -> None:
    result = read_result(REPORTS / name)
    lines = render(result).splitlines()
    header = lines[4]
    for key in ("cpu", "torch", "date"):
        want = result.get(key) or NOT_RECORDED
        assert f"{'CPU' if key == 'cpu' else key}: {want}" in header, (key, header)
    assert lines[2].startswith("Command: `python -m benchmarks.")
    text = "\n".join(lines).lower()
    assert "issue" not in text  # targets are the paper's figures or the benchmark's own


def _loader_result() -> dict:
    return {
        "tokens_per_s": 5_000_000, "first_batch_s": 0.01, "first_batch_cold_s": 0.02,
        "state_bytes": 100_000, "save_ms": 1.5, "load_ms": 2.0,
        "save_background_blocking_ms": 0.3, "dataloader_1worker_tokens_per_s": 1_000_000,
        "dataloader_1worker_first_batch_s": 0.05, "corpus_tokens": 1000, "corpus_docs": 3,
        "corpus_gen_s": 0.1, "num_shards": 1024, "seq_len": 4096, "batch_size": 8,
        "machine": "CPU X, x86_64, 2 CPUs",
    }  # fmt: skip


def test_loader_report_marks_its_thresholds_from_the_values() -> None:
    """Without cpu/torch/date (a result from before they were recorded) the header says
    so; each threshold row says whether the value is within it."""
    md = loader.render(_loader_result())
    assert f"CPU: {NOT_RECORDED}; torch: {NOT_RECORDED}; date: {NOT_RECORDED}." in md
    rows = {r.split(" | ")[0].lstrip("| "): r for r in md.splitlines() if r.startswith("| ")}
    assert rows["tokens/s, in-process reader"].endswith("| >= 4,000,000 | yes |")
    assert rows["state size (bytes, JSON)"].endswith("| <= 65,536 | no |")
    assert rows["save (ms, median of 7, fsync + rename)"].endswith("| < 10 | yes |")
    assert loader.command({**_loader_result(), "requested_tokens": 10}) == (
        "python -m benchmarks.loader --tokens 10"
    )


def test_loader_render_flag_writes_the_report_from_the_json(tmp_path: Path, capsys) -> None:
    saved = tmp_path / "bench_loader.json"
    saved.write_text(json.dumps(_loader_result()))
    out = tmp_path / "out.md"
    assert loader.main(["--render", str(saved), "--report", str(out)]) == 0
    assert out.read_text() == loader.render(_loader_result())
    assert loader.main(["--render", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--render" in err[0] and "no such file" in err[0]


def test_a_reduced_loader_run_records_its_report_path(tmp_path: Path, monkeypatch) -> None:
    """A run at another size must name --report: the result keeps it, so the report's
    header names the command that ran (a run without it is refused)."""
    measured = {**_loader_result(), "requested_tokens": 20000}
    monkeypatch.setattr(loader, "run", lambda *a: dict(measured))
    out = tmp_path / "small.md"
    assert loader.main(["--tokens", "20000", "--report", str(out), "--json"]) == 0
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved == {**measured, "out": str(out)}
    command = f"python -m benchmarks.loader --tokens 20000 --report {out}"
    assert f"Command: `{command}`" in out.read_text().splitlines()


def test_core_render_flag_measures_nothing(tmp_path: Path, capsys) -> None:
    """``--render`` on a saved quick result writes the report beside ``--report``; a file
    that is not a JSON object is one error line, exit 2."""
    assert core.main(["--quick", "--json", "--no-report"]) == 0
    result = json.loads(capsys.readouterr().out)
    saved = tmp_path / "r.json"
    saved.write_text(json.dumps(result))
    out = tmp_path / "r.md"
    assert core.main(["--render", str(saved), "--report", str(out)]) == 0
    assert out.read_text() == core.render(result)
    saved.write_text("[1, 2]")
    capsys.readouterr()
    assert core.main(["--render", str(saved)]) == 2
    assert "expected a JSON object" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("module", "name"),
    [("benchmarks.mnli_step", "mnli_bench.json"), ("benchmarks.dlrm_step", "dlrm_bench.json"),
     ("benchmarks.codebert_step", "codebert_bench.json")],
)  # fmt: skip
def test_step_benches_print_the_tables_of_a_saved_result(module, name) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", module, "--render", str(REPORTS / name)],
        capture_output=True, text=True, check=False, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = read_result(REPORTS / name)
    renderer = {"benchmarks.mnli_step": mnli_step, "benchmarks.dlrm_step": dlrm_step,
                "benchmarks.codebert_step": codebert_step}[module]  # fmt: skip
    assert proc.stdout == renderer.render(result) + "\n"


def test_dlrm_prep_render_reads_a_saved_result(tmp_path: Path, capsys) -> None:
    res = {"rows": 500, "file_mb": 0.1, "seconds": 0.5, "rows_per_s": 1000.0,
           "peak_anon_mb": 200, "peak_anon_above_baseline_mb": 40, "peak_file_mb": 10,
           "kaggle_minutes_at_this_rate": 764.0, "cpu": "CPU X", "torch": "2",
           "date": "d"}  # fmt: skip
    saved = tmp_path / "prep.json"
    saved.write_text(json.dumps(res))
    assert dlrm_prep.main(["--render", str(saved)]) == 0
    assert capsys.readouterr().out == dlrm_prep.render(res) + "\n"


def test_step_modes_report_sets_comera_beside_its_dense_baseline() -> None:
    """With ``_dense`` rows the report gains a ``vs dense`` column: CoMERA's step over its
    dense baseline's in the same mode; without them it is as it was."""
    result = read_result(REPORTS / "gpu/step_modes_paper/step_modes.json")
    assert "vs dense" not in step_modes.render(result)
    result["runs"] += [{**r, "model": "paper_dense", "step_s": 2 * r["step_s"]}
                       for r in result["runs"] if r["mode"] != "sync_free"]  # fmt: skip
    text = step_modes.render(result)
    assert "| vs eager | vs dense | peak MB |" in text
    rows = [line for line in text.splitlines() if line.startswith("| paper |")]
    assert [row.split("|")[7].strip() for row in rows] == ["0.50", "-", "0.50"]


def test_step_modes_report_says_when_first_step_holds_the_capture() -> None:
    """A cuda_graph row timed through its capture says so; older results, whose first
    cuda_graph step was a warm-up step, do not claim it."""
    result = read_result(REPORTS / "gpu/step_modes_paper/step_modes.json")
    assert "capture for `cuda_graph`" not in step_modes.render(result)
    for run in result["runs"]:
        run["first_step_includes"] = {"cuda_graph": "capture"}.get(run["mode"])
    assert "capture for `cuda_graph`" in step_modes.render(result)


def test_render_never_puts_toy_partial_or_gpu_figures_over_the_cpu_reports(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """``--render`` keeps the guards measuring has: a ``--tiny`` result needs ``--out``
    (it replaced reports/efficiency.md and step_modes.md), a partial one is never rendered,
    and a GPU result goes to reports/gpu/ as measuring it would (it replaced the CPU
    step_modes.md)."""
    monkeypatch.setattr(step_modes, "REPORTS", tmp_path / "reports")
    monkeypatch.setattr(efficiency, "REPORTS", tmp_path / "reports")
    saved = json.loads((REPORTS / "step_modes.json").read_text())
    eff = json.loads((REPORTS / "efficiency.json").read_text())
    for module, data, flag in ((step_modes, saved, "tiny"), (step_modes, saved, "partial"),
                               (efficiency, eff, "tiny")):  # fmt: skip
        path = tmp_path / f"{flag}.json"
        path.write_text(json.dumps({**data, flag: True}))
        assert module.main(["--render", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        want = "cannot be rendered" if flag == "partial" else "give --out PATH"
        assert len(err) == 1 and want in err[0], err
    assert not (tmp_path / "reports").exists()
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({**saved, "device": "cuda"}))
    assert step_modes.main(["--render", str(gpu)]) == 0
    capsys.readouterr()
    assert [p.relative_to(tmp_path).as_posix() for p in (tmp_path / "reports").rglob("*.md")] == [
        "reports/gpu/step_modes.md"]  # fmt: skip


def test_render_refuses_a_result_with_no_figures_and_keeps_the_report(
    tmp_path: Path, capsys
) -> None:
    """A step_modes result with no runs, or an efficiency one with no batches, replaced a
    good report with a table of no rows (exit 0); batches of another shape ended in
    matplotlib's traceback. Each is one line, exit 2, and the report stays."""
    saved = json.loads((REPORTS / "step_modes.json").read_text())
    eff = json.loads((REPORTS / "efficiency.json").read_text())
    for module, data, key, value, want in [
        (step_modes, saved, "runs", [], "holds no figures (runs is empty)"),
        (efficiency, eff, "batches", [], "holds no figures (batches is empty)"),
        (efficiency, eff, "runs", [], "holds no figures (runs is empty)"),
        (efficiency, eff, "batches", {"1": 1}, "its fields are not this one's"),
        (efficiency, eff, "batches", ["1"], "its fields are not this one's"),
    ]:  # fmt: skip
        out = tmp_path / "out"
        out.mkdir(exist_ok=True)
        (out / "keep.md").write_text("good")
        path = tmp_path / "r.json"
        path.write_text(json.dumps({**data, key: value}))
        assert module.main(["--render", str(path), "--out", str(out)]) == 2, (key, value)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and want in err[0], err
        assert [p.name for p in out.iterdir()] == ["keep.md"]


def _tables(text: str) -> list[list[str]]:
    """The markdown tables of ``text``: runs of lines that start with ``|``."""
    tables: list[list[str]] = []
    for line, prev in zip(text.splitlines(), ["", *text.splitlines()], strict=False):
        if line.startswith("|"):
            if not prev.startswith("|"):
                tables.append([])
            tables[-1].append(line)
    return tables


def test_every_committed_table_has_as_many_cells_per_row_as_its_header() -> None:
    """The layer shapes ``[12,8,8 | 8,8,12]`` went into tables unescaped: each such row
    had a cell too many, so the rendered "auto chose" column showed ``-`` and the choice
    landed under the timings."""
    import re

    pages = [*REPORTS.rglob("*.md"), *(ROOT / "docs").glob("*.md"), *ROOT.glob("*/README.md"),
             ROOT / "README.md"]  # fmt: skip
    for page in pages:
        for table in _tables(page.read_text()):
            cells = [len(re.findall(r"(?<!\\)\|", row)) for row in table]
            odd = [row for row, n in zip(table, cells, strict=True) if n != cells[0]]
            assert not odd, f"{page.relative_to(ROOT)}: {odd[0]}"


def test_a_result_without_later_fields_renders_or_names_the_field(tmp_path: Path, capsys) -> None:
    """An efficiency or step_modes result without ``threads`` (or ``repeats``), fields
    their command lines already treat as optional, was refused as "not a result of"
    the benchmark; it renders, saying the count was not recorded. A result that lacks a
    field the tables need names it, and that an older version may have written it."""
    for module, stem in ((efficiency, "efficiency"), (step_modes, "step_modes")):
        result = json.loads((REPORTS / f"{stem}.json").read_text())
        result.pop("threads"), result.pop("repeats", None)
        assert "an unrecorded number of threads" in module.render(result)
    old = json.loads((REPORTS / "efficiency.json").read_text())
    del old["runs"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert efficiency.main(["--render", str(path), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "it lacks the field 'runs': another command's result, or an older version's" in err
