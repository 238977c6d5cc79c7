"""bench/int4_fidelity.py, moetool's part (no llm-compressor here): tiny shapes, CPU."""
import json
import sys
from pathlib import Path

import pytest
import warm_python

pytestmark = pytest.mark.slow  # runs the script in its own process

ROOT = Path(__file__).resolve().parents[2]


def test_int4_fidelity_bench_reports_moetool_rows(tiny):
    src = tiny("mixtral")
    p = warm_python.run([sys.executable, str(ROOT / "bench" / "int4_fidelity.py"), "--shapes", "64x256,128x128",
                         "--dists", "gauss,t3", "--checkpoint", str(src), "--experts", "2", "--repeat", "1",
                         "--no-llmc", "--json", "-"], timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(p.stdout)
    assert result["tensors"] == 2 * 2 + 2 * 3  # distributions x shapes + experts x (gate, up, down)
    rows = {(r["symmetric"], r["quantizer"].endswith("mse")): r for r in result["rows"]}
    assert set(rows) == {(True, False), (True, True), (False, False), (False, True)}
    for symmetric in (True, False):
        plain, mse = rows[symmetric, False], rows[symmetric, True]
        assert set(plain["groups"]) == {"gauss", "t3", "checkpoint", "all"}
        for group, stats in plain["groups"].items():
            assert 0.05 < stats["mean"] <= stats["max"] < 0.3, (group, stats)
            assert stats["vs_llmc"] is None
            assert mse["groups"][group]["mean"] < stats["mean"], group
        assert plain["gbps"] > 0 and mse["gbps"] > 0
    assert "moetool sym --int4-clip mse" in p.stderr  # the table, on stderr with --json -
