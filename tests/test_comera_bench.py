"""The core benchmark runs end to end in quick mode (output shape only, no timing asserts)."""

import json

import pytest

from comera import STRATEGIES, TTLinearSpec, init
from comera.bench import main, padded_rank
from comera.plans import _RANK_ALIGN


def test_bench_quick_json(capsys, tmp_path):
    report = tmp_path / "bench.md"
    assert main(["--quick", "--json", "--report", str(report)]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["tt_linear"]
    assert {r["strategy"] for r in rows} == set(STRATEGIES)
    for r in rows:
        assert set(r) >= {
            "shape",
            "strategy",
            "rank",
            "tokens",
            "time_ratio_vs_dense",
            "flops_ratio_vs_dense",
        }
        assert r["time_ratio_vs_dense"] > 0 and r["flops_ratio_vs_dense"] > 0
    e = out["ttm_embedding"]
    assert set(e) >= {"speedup_vs_naive", "memory_ratio_vs_naive", "time_ratio_vs_dense_embedding"}
    assert 0 < e["memory_ratio_vs_naive"]
    assert "TT-linear vs `nn.Linear`" in report.read_text()
    fq = out["fused_qkv"]
    assert fq["time_ratio_vs_dense"] > 0 and fq["time_ratio_vs_separate"] > 0
    assert "`fused_qkv`" in report.read_text()
    # the GEMMs-alone floor is timed beside the comera path, for every shape and for QKV
    assert all(("gemm_floor_ratio_vs_dense" in r) == (r["strategy"] == "comera") for r in rows)
    assert fq["gemm_floor_ratio_vs_dense"] > 0
    assert "its GEMMs alone" in report.read_text()


@pytest.mark.parametrize("ranks", [30, 8, 5, (2, 3, 9, 3, 2)])
def test_floor_gemms_use_the_paths_padded_rank(ranks):
    """The floor times GEMMs of the inner size the comera path really runs."""
    spec = TTLinearSpec(out_modes=(4, 3, 4), in_modes=(2, 6, 4), ranks=ranks)
    params, _ = init(spec)
    r = params["cores"][3].shape[0]  # the middle bond, between output and input halves
    assert padded_rank(spec) == r + (-r) % _RANK_ALIGN
