"""``python -m benchmarks.dlrm_prep``: the Kaggle-shaped file and the measurement."""

import json
from collections import Counter
from pathlib import Path


def test_prep_bench_measures_a_kaggle_shaped_file(tmp_path: Path, capsys) -> None:
    """``python -m benchmarks.dlrm_prep``: its generated file is valid Criteo with
    Kaggle's vocabularies (head-heavy), and preprocessing it in a child process reports
    the rows, a rate and the memory peaks; bad input is one line, exit 2."""
    from benchmarks import dlrm_prep as prep_bench
    from experiments.dlrm.data import check_line

    path = tmp_path / "train.txt"
    prep_bench.write_kaggle_like(path, 500, chunk=128)
    lines = path.read_text().splitlines()
    assert len(lines) == 500
    for n, line in enumerate(lines, 1):
        check_line(line, path, n)
    c3 = Counter(line.split("\t")[16] for line in lines)  # 10M values, heavy head
    assert 50 < len(c3) < 500 and c3.most_common(1)[0][1] >= 5
    assert prep_bench.main(["--file", str(path), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["rows"] == 500 and res["rows_per_s"] > 0 and res["peak_file_mb"] >= 0
    assert res["peak_anon_mb"] >= res["peak_anon_above_baseline_mb"] >= 0
    assert prep_bench.main(["--file", str(tmp_path / "missing.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert prep_bench.main(["--file", str(tmp_path)]) == 2  # was "no such file" too
    assert f"--file {tmp_path}: a folder; give a Criteo train.txt" in capsys.readouterr().err


def test_prep_bench_names_a_file_that_is_not_criteo_in_one_line(tmp_path: Path) -> None:
    """The child's CriteoFormatError is its one line, exit 2, as the training command
    gives: no child traceback, no second 'failed' line."""
    import subprocess
    import sys

    bad = tmp_path / "x.txt"
    bad.write_text("a\tb\n")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.dlrm_prep", "--file", str(bad)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert "x.txt, line 1: expected 40 tab-separated fields" in err[0]
