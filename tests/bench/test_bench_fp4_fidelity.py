"""bench/fp4_fidelity.py still runs (tiny sizes, CPU, without llm-compressor: its rows skipped)."""
import json
import sys
from pathlib import Path

import pytest
import warm_python

from moetool.formats import TOLERANCES

pytestmark = pytest.mark.slow  # runs a script

ROOT = Path(__file__).resolve().parents[2]


def test_fp4_fidelity_bench_reports_moetool_rows(tmp_path):
    p = warm_python.run([sys.executable, str(ROOT / "bench" / "fp4_fidelity.py"), "--workdir", str(tmp_path),
                         "--hidden", "128", "--intermediate", "64", "--experts", "2", "--layers", "1",
                         "--llmc-python", str(tmp_path / "no-such-python"), "--json"], timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "llm-compressor not installed" in p.stderr
    rows = json.loads(p.stdout)["rows"]
    assert [(r["weights"], r["format"], r["tool"]) for r in rows] == [
        (d, f, "moetool") for d in ("normal", "t3") for f in ("nvfp4", "mxfp4")]
    for r in rows:
        # the format tolerances are for normal weights; heavy tails (t3) add error
        limit = TOLERANCES[r["format"]]["rel_err"] * (1 if r["weights"] == "normal" else 1.5)
        assert r["linears"] == 6 and 0 < r["mean_rel"] <= r["max_rel"] < limit
        assert r["vs_llmc"] is None and r["identical_linears"] is None
