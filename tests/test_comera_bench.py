"""The core benchmark runs end to end in quick mode (output shape only, no timing asserts)."""

import json

from comera import STRATEGIES
from comera.bench import main


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
