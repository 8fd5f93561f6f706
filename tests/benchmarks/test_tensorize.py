"""``python -m benchmarks.tensorize``: the plumbing on a toy GPT-2 (fresh processes), and
the report rendered from its JSON alone."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from benchmarks import tensorize  # noqa: E402


@pytest.mark.slow
def test_bench_plumbing_on_a_toy_gpt2(tmp_path, capsys) -> None:
    out = tmp_path / "tensorize.json"
    assert tensorize.main(["--tiny", "--steps", "1", "--out", str(out), "--json"]) == 0
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert set(runs) == {"comera_b4", "dense_b4", "comera_b1", "dense_b1"}
    assert result["compression_ratio"] == pytest.approx(
        runs["dense_b4"]["params"] / runs["comera_b4"]["params"]
    )
    assert result["compression_ratio"] > 1
    assert result["step_time_ratio_vs_dense"] == pytest.approx(
        runs["comera_b4"]["step_s"] / runs["dense_b4"]["step_s"]
    )
    md = out.with_suffix(".md").read_text()
    assert result["rank"] == result["embedding_rank"] == 4  # what the toy ran with
    assert "A toy GPT-2" in md and "at rank 4" in md
    assert f"python -m benchmarks.tensorize --tiny --steps 1 --json --out {out}" in md
    capsys.readouterr()
    assert tensorize.main(["--render", str(out)]) == 0
    assert capsys.readouterr().out.strip() == md.strip()
